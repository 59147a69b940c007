#!/usr/bin/env bash
# One call on a GPU machine: the GPU tests, the benchmark, the compile-time
# measurement, or all of them with the example, with logs under $OUT and a short
# summary last.
#   bash scripts/device_check.sh tests   [pytest args...]          # pytest -m gpu
#   bash scripts/device_check.sh bench   [bench_attention args...] # the benchmark
#   bash scripts/device_check.sh masks   [bench_masks args...]     # the masked rows
#   bash scripts/device_check.sh compile [compile_time args...]    # compile times
#   bash scripts/device_check.sh all                               # all, and the example
# OUT: the folder for the logs, the benchmark's CSV and plot, and the compile-time CSV
# (default ./bench_out). TEST_WORKERS: pytest-xdist processes when xdist is importable
# or packed in .device/testtools.tar.xz (scripts/pack_test_tools.sh); default 6.
# TEST_TIMEOUT / COMPILE_TIMEOUT: seconds before the tests / the compile-time
# measurement are stopped (570 / 540).
# Needs an environment where jax_fa4's kernels run (JAX's CUDA build and
# nvidia-cutlass-dsl) and, for the benchmark's fa4 peer, flash-attn-4 (PyTorch).
set -uo pipefail
what=${1:-all}; shift || true
case $what in
  tests|bench|masks|compile|all) ;;
  *) echo "usage: $0 tests|bench|masks|compile|all [args...]"; exit 2;;
esac
out=${OUT:-bench_out}; mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.limit \
  --format=csv,noheader | tee "$out/gpu.txt"
python -c "import jax, cutlass; print('jax', jax.__version__, 'cutlass-dsl', \
getattr(cutlass, '__version__', '?'), jax.devices())"
summary=""
if [[ -f .device/testtools.tar.xz ]]; then
  tools=${TEST_TOOLS_DIR:-/tmp/jax_fa4_testtools}
  if [[ ! -f $tools/.done ]]; then
    mkdir -p "$tools" && python3 -c \
      "import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
      .device/testtools.tar.xz "$tools" && touch "$tools/.done"
  fi
  export PYTHONPATH="$tools${PYTHONPATH:+:$PYTHONPATH}"
fi
if [[ $what == tests || $what == all ]]; then
  workers=()
  python -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-6}")
  args=(); [[ $what == tests ]] && args=("$@")
  timeout "${TEST_TIMEOUT:-570}" python -m pytest -m gpu -q -ra -p no:cacheprovider \
    "${workers[@]}" "${args[@]}" 2>&1 | tee "$out/gpu_tests.log" | tail -25
  summary+="gpu tests: $(tail -1 "$out/gpu_tests.log")"$'\n'
fi
if [[ $what == all ]]; then
  python examples/train_tiny_transformer.py --steps 20 2>&1 | tee "$out/example.log" | tail -4
  summary+="example: $(tail -1 "$out/example.log")"$'\n'
fi
if [[ $what == bench || $what == all ]]; then
  args=(); [[ $what == bench ]] && args=("$@")
  python benchmarks/bench_attention.py --out "$out" "${args[@]}" 2>&1 \
    | tee "$out/bench.log" | tail -40
  summary+="bench: $(grep -m1 'csv:' "$out/bench.log" || tail -1 "$out/bench.log")"$'\n'
fi
if [[ $what == masks || $what == all ]]; then
  args=(); [[ $what == masks ]] && args=("$@")
  python benchmarks/bench_masks.py --out "$out" "${args[@]}" 2>&1 \
    | tee "$out/bench_masks.log" | tail -16
  summary+="masks: $(grep -m1 'csv:' "$out/bench_masks.log" || tail -1 "$out/bench_masks.log")"$'\n'
fi
if [[ $what == compile || $what == all ]]; then
  args=(); [[ $what == compile ]] && args=("$@")
  timeout "${COMPILE_TIMEOUT:-540}" python benchmarks/compile_time.py --out "$out" \
    "${args[@]}" 2>&1 | tee "$out/compile.log" | tail -25
  summary+="compile: $(grep -m1 '^csv:' "$out/compile.log" || tail -1 "$out/compile.log")"$'\n'
fi
echo "=== summary"; printf "%s" "$summary"
