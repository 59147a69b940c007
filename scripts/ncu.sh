#!/usr/bin/env bash
# Nsight Compute profiles of the attention kernels of jax_fa4 and flash-attn-4, one
# training step each (scripts/profile_step.py), on a GPU machine with ncu.
#   bash scripts/ncu.sh [hdim] [seqlen] [impls] [causal flags]
#   e.g. bash scripts/ncu.sh 128 4096 "jax_fa4 fa4" "0 1"
#   bash scripts/ncu.sh --case mla [impls]   # a masked row of bench_masks.py
# The backward kernels by default (preprocess, main kernel, postprocess: 3 launches);
# the forward instead: KERNEL_RE='(?i)fwd|forward' LAUNCHES=1 PREFIX=ncufwd.
# For each case <PREFIX>_<impl>_d<hdim>_s<seqlen>_c<causal>: the report (.ncu-rep,
# kept in $NCU_DIR), its details page (.txt), the per-SASS-instruction source page
# (.src.csv: stall samples, shared-memory conflicts and executed instructions per
# instruction), its summary by scripts/ncu_source.py (.summary.txt) and a few raw
# metrics (.metrics.csv); all but the reports are packed into
# $OUT/<PREFIX>_d<hdim>_s<seqlen>.tar.xz (OUT defaults to ./bench_out).
# ncu locks the clocks, so its durations are longer than the benchmark's; for
# durations at the normal clocks use scripts/kernel_times.sh.
set -uo pipefail
if [[ ${1:-} == --case ]]; then
  shape=(--case "$2"); d=$2; s=case; impls=${3:-"jax_fa4 fa4"}; causals=0
else
  d=${1:-128}; s=${2:-4096}; impls=${3:-"jax_fa4 fa4"}; causals=${4:-"0 1"}
  shape=(--hdim "$d" --seqlen "$s")
fi
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "${OUT:-bench_out}"; final=$(cd "${OUT:-bench_out}" && pwd)
out=${NCU_DIR:-/tmp/ncu_reports}; mkdir -p "$out"
prefix=${PREFIX:-ncu}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
metrics=gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed
metrics+=,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum
metrics+=,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,launch__registers_per_thread
for stall in barrier long_scoreboard wait math_pipe_throttle membar short_scoreboard \
    mio_throttle dispatch_stall; do
  metrics+=,smsp__warps_issue_stalled_${stall}_per_warp_active.pct
done
for impl in $impls; do
  for c in $causals; do
    tag="${prefix}_${impl}_d${d}_s${s}_c${c}"
    flag=""; [[ $c == 1 ]] && flag="--causal"
    timeout "${NCU_TIMEOUT:-240}" ncu --set full --import-source no \
      --kernel-name "regex:${KERNEL_RE:-(?i)bwd}" --launch-count "${LAUNCHES:-3}" \
      -f -o "$out/$tag" \
      python "$here/profile_step.py" --impl "$impl" --warmup 0 $flag \
      "${shape[@]}" > "$out/$tag.log" 2>&1 || { echo "$tag: ncu failed"; tail -5 "$out/$tag.log"; continue; }
    ncu --import "$out/$tag.ncu-rep" --page details > "$out/$tag.txt" 2>&1
    ncu --import "$out/$tag.ncu-rep" --page source --print-source sass --csv \
      > "$out/$tag.src.csv" 2>/dev/null || true
    python "$here/ncu_source.py" "$out/$tag.src.csv" "" 20 > "$out/$tag.summary.txt" 2>&1 || true
    ncu --import "$out/$tag.ncu-rep" --page raw --csv --metrics "$metrics" \
      > "$out/$tag.metrics.csv" 2>&1
    echo "== $tag"
    head -4 "$out/$tag.summary.txt"
  done
done
(cd "$out" && tar cJf "$final/${prefix}_d${d}_s${s}.tar.xz" ./*.txt ./*.csv ./*.log) \
  && echo "packed: $final/${prefix}_d${d}_s${s}.tar.xz"
