#!/usr/bin/env bash
# Per-kernel GPU durations of one training step (forward + backward) of jax_fa4 and
# flash-attn-4 (scripts/profile_step.py), under Nsight Compute with the clocks and
# caches left alone (--clock-control none --cache-control none) and one metric only,
# so each kernel runs once at its normal speed. Prints one line per kernel launch
# (2 warm-up steps, then the one to read).
#   bash scripts/kernel_times.sh [hdim] [seqlen] [impls] [causal flags]
#   e.g. bash scripts/kernel_times.sh 128 1024 "jax_fa4 fa4" "0 1"
#   bash scripts/kernel_times.sh --case packed [impls]   # a masked row of bench_masks.py
set -uo pipefail
case_args=()
if [[ ${1:-} == --case ]]; then
  case_args=(--case "$2"); d=128; s=4096; impls=${3:-"jax_fa4 fa4"}; causals=0
else
  d=${1:-128}; s=${2:-1024}; impls=${3:-"jax_fa4 fa4"}; causals=${4:-"0 1"}
fi
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
for impl in $impls; do
  for c in $causals; do
    flag=""; [[ $c == 1 ]] && flag="--causal"
    tag="${impl}_d${d}_s${s}_c${c}"
    [[ ${#case_args[@]} -gt 0 ]] && tag="${impl}_${case_args[1]}"
    timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none --cache-control none \
      --metrics gpu__time_duration.sum --csv --page raw \
      python "$here/profile_step.py" --impl "$impl" --hdim "$d" --seqlen "$s" --warmup 2 $flag \
      "${case_args[@]}" \
      > "$tmp/$tag.csv" 2> "$tmp/$tag.err" || { echo "$tag: ncu failed"; tail -5 "$tmp/$tag.err"; continue; }
    python - "$tmp/$tag.csv" "$tag" <<'PY'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, units, data = rows[0], rows[1], rows[2:]
ki, ti = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[units[ti]]
data = [(r[ki], float(r[ti].replace(",", "")) * scale) for r in data]
print(f"== {sys.argv[2]}: {len(data)} kernel launches (3 steps, the last is timed)")
for name, t in data:
    print(f"  {t:9.1f} us  {name[:100]}")
PY
  done
done
rm -rf "$tmp"
