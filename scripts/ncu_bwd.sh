#!/usr/bin/env bash
# Nsight Compute profile of the backward kernels of jax_fa4 and flash-attn-4 on the
# GPU machine (after `bash .device/install.sh && . /opt/jax_fa4_site/env.sh`).
#   bash scripts/ncu_bwd.sh [hdim] [seqlen] [impls] [causal flags]
#   e.g. bash scripts/ncu_bwd.sh 128 4096 "jax_fa4 fa4" "0 1"
# For each case ncu_<impl>_d<hdim>_s<seqlen>_c<causal>: the report (.ncu-rep), the
# details page (.txt), the per-SASS-instruction source page (.src.csv: warp stall
# samples, shared-memory conflicts and instruction counts per instruction; read it
# with scripts/ncu_source.py) and a few raw metrics (.metrics.csv). The device
# returns only a handful of files per call, so everything except the reports is
# packed into $OUT/ncu_d<hdim>_s<seqlen>.tar.xz (the reports stay in $NCU_DIR).
# The forward kernel instead: KERNEL_RE='(?i)fwd|forward' LAUNCHES=1 PREFIX=ncufwd.
set -uo pipefail
d=${1:-128}; s=${2:-4096}; impls=${3:-"jax_fa4 fa4"}; causals=${4:-"0 1"}
final=${OUT:-/tmp/jax_fa4_out}; mkdir -p "$final"
out=${NCU_DIR:-/tmp/ncu_reports}; mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
for impl in $impls; do
  for c in $causals; do
    tag="${PREFIX:-ncu}_${impl}_d${d}_s${s}_c${c}"
    flag=""; [[ $c == 1 ]] && flag="--causal"
    timeout "${NCU_TIMEOUT:-240}" ncu --set full --import-source no \
      --kernel-name "regex:${KERNEL_RE:-(?i)bwd}" --launch-count "${LAUNCHES:-3}" -f -o "$out/$tag" \
      python scripts/profile_bwd.py --impl "$impl" --hdim "$d" --seqlen "$s" --warmup 0 $flag \
      > "$out/$tag.log" 2>&1 || { echo "$tag: ncu failed"; tail -5 "$out/$tag.log"; continue; }
    ncu --import "$out/$tag.ncu-rep" --page details > "$out/$tag.txt" 2>&1
    ncu --import "$out/$tag.ncu-rep" --page source --print-source sass --csv \
      > "$out/$tag.src.csv" 2>/dev/null || true
    ncu --import "$out/$tag.ncu-rep" --page raw --csv \
      --metrics gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,launch__registers_per_thread,smsp__warps_issue_stalled_barrier_per_warp_active.pct,smsp__warps_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warps_issue_stalled_wait_per_warp_active.pct,smsp__warps_issue_stalled_math_pipe_throttle_per_warp_active.pct,smsp__warps_issue_stalled_membar_per_warp_active.pct,smsp__warps_issue_stalled_short_scoreboard_per_warp_active.pct,smsp__warps_issue_stalled_mio_throttle_per_warp_active.pct,smsp__warps_issue_stalled_dispatch_stall_per_warp_active.pct \
      > "$out/$tag.metrics.csv" 2>&1
    echo "== $tag"
  done
done
(cd "$out" && tar cJf "$final/${PREFIX:-ncu}_d${d}_s${s}.tar.xz" ./*.txt ./*.csv ./*.log) \
  && echo "packed: $final/${PREFIX:-ncu}_d${d}_s${s}.tar.xz"
