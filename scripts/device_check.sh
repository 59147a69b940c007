#!/usr/bin/env bash
# One call on the GPU machine (see ../shared/device/README.md): GPU tests, the
# example, the benchmark and the compile-time measurement, with logs under $OUT
# and a short summary last.
#   bash scripts/device_check.sh [tests|tests-bwd|tests-fwd|bench|quick|compile|knobs|next|all]
#       [extra pytest args...]
# tests-bwd / tests-fwd: the backward half of the GPU tests / the rest. The whole
# suite took more than one 600 s call in the twenty-first session (210 passed when
# the call's time ran out); each half took 240-320 s with 6-7 workers.
# knobs: the GPU tests of the forward's tile-order knobs (persistent, lpt), then
# gpu_check_fwd checks and A/B timings of both at the benchmark's rows (hdim 128 at
# 1k, 4k, 16k; hdim 64 and 256 at 8k).
# next: the GPU work the last session queued (below).
# compile: benchmarks/compile_time.py (fresh processes, cold and cached; about 3-4
# minutes for 4 configurations), stopped after COMPILE_TIMEOUT seconds (540).
# BWD_TIMING=diff times the backward as fwd+bwd minus fwd (default: direct, the
# backward alone on saved residuals; bench_attention --bwd-timing). BENCH_ROUNDS=R
# (> 1) times each case's implementations in R alternating rounds (--rounds), each
# timed burst after 200 ms of the same implementation (--settle-ms; BENCH_SETTLE_MS).
# Run after `bash .device/install.sh && . /opt/jax_fa4_site/env.sh`.
set -uo pipefail
what=${1:-all}; shift || true
out=${OUT:-/tmp/jax_fa4_out}; mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$out/gpu.txt"
python -c "import jax, cutlass; print('jax', jax.__version__, 'cutlass-dsl', cutlass.__version__ if hasattr(cutlass,'__version__') else '?', jax.devices())"
summary=""
# pytest-xdist, when carried (scripts/pack_test_tools.sh), runs the GPU tests in
# TEST_WORKERS processes; each test's time is mostly compiling (host CPU bound: 16
# cores). With 4 workers the 183 tests took longer than one 600 s call (sixteenth
# session); 6 is the default since (not yet timed).
if [[ -f .device/testtools.tar.xz && ! -f /opt/jax_fa4_site/.testtools.done ]]; then
  python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
    .device/testtools.tar.xz /opt/jax_fa4_site && touch /opt/jax_fa4_site/.testtools.done
fi
workers=()
python -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-6}")
bwd_tests="backward or grad or train or vjp or pdl or store_first or by_length or two_buffers"
half=()
[[ $what == tests-bwd ]] && half=(-k "$bwd_tests")
[[ $what == tests-fwd ]] && half=(-k "not ($bwd_tests)")
if [[ $what == tests || $what == tests-bwd || $what == tests-fwd || $what == all ]]; then
  timeout "${TEST_TIMEOUT:-900}" python -m pytest -m gpu -q -ra -p no:cacheprovider "${workers[@]}" \
    "${half[@]}" "$@" 2>&1 \
    | tee "$out/gpu_tests.log" | tail -25
  summary+="gpu tests: $(tail -1 "$out/gpu_tests.log")"$'\n'
fi
if [[ $what == knobs ]]; then
  timeout 200 python -m pytest -m gpu -q -p no:cacheprovider -k tile_order_knobs tests/test_gpu.py 2>&1 \
    | tee "$out/knob_tests.log" | tail -3
  # Checks of both knobs (bf16, short shapes) with the 1k timing, then timing only.
  python scripts/gpu_check_fwd.py --tiles nopers,lpt --time-size 16,1024,16 2>&1 \
    | tee "$out/knob_fwd_1k.log" | tail -9
  for size in 4,4096,16 1,16384,16; do
    python scripts/gpu_check_fwd.py --tiles nopers,lpt --no-check --time-size $size 2>&1 \
      | tee "$out/knob_fwd_${size//,/_}.log" | tail -7
  done
  python scripts/gpu_check_fwd.py --hdim64 --tiles nopers,nolpt --no-check 2>&1 \
    | tee "$out/knob_fwd_d64.log" | tail -7
  python scripts/gpu_check_fwd.py --hdim256 --tiles pers+oq 2>&1 \
    | tee "$out/knob_fwd_d256.log" | tail -8
  summary+="knob tests: $(tail -1 "$out/knob_tests.log")"$'\n'
  summary+="knob checks: $(grep -h 'correctness:' "$out"/knob_fwd_1k.log)"$'\n'
fi
if [[ $what == next ]]; then
  # What the twenty-sixth session left to run (its device time went to the
  # twenty-fifth session's queue, the changed defaults' tests and two benchmark
  # runs): compile times of the changed configurations (hdim 64 non-causal forward,
  # the reversed pre / post) and the API-level GPU tests not run since the defaults
  # changed; about 5-7 minutes.
  timeout "${COMPILE_TIMEOUT:-330}" python benchmarks/compile_time.py --hdims 64,128 \
    --out "$out" 2>&1 | tee "$out/compile.log" | tail -12
  summary+="compile: $(grep -m1 '^csv:' "$out/compile.log" || tail -1 "$out/compile.log")"$'\n'
  timeout "${TEST_TIMEOUT:-240}" python -m pytest -m gpu -q -ra -p no:cacheprovider \
    "${workers[@]}" -k "vmap or nnx or deterministic or pdl_chain or negative_scale or store_first" \
    2>&1 | tee "$out/next_tests.log" | tail -8
  summary+="next tests: $(tail -1 "$out/next_tests.log")"$'\n'
fi
if [[ $what == all ]]; then
  python examples/train_tiny_transformer.py --steps 20 2>&1 | tee "$out/example.log" | tail -4
  summary+="example: $(tail -1 "$out/example.log")"$'\n'
fi
if [[ $what == bench || $what == quick || $what == all ]]; then
  flag=""; [[ $what != bench ]] && flag="--quick"
  python benchmarks/bench_attention.py $flag --peers "${PEERS:-fa4,cudnn,xla}" \
    --rounds "${BENCH_ROUNDS:-1}" ${BENCH_SETTLE_MS:+--settle-ms "$BENCH_SETTLE_MS"} \
    --bwd-timing "${BWD_TIMING:-direct}" --out "$out" 2>&1 \
    | tee "$out/bench.log" | tail -40
fi
if [[ $what == compile || $what == all ]]; then
  timeout "${COMPILE_TIMEOUT:-540}" python benchmarks/compile_time.py --out "$out" 2>&1 \
    | tee "$out/compile.log" | tail -25
  summary+="compile: $(grep -m1 '^csv:' "$out/compile.log" || tail -1 "$out/compile.log")"$'\n'
fi
echo "=== summary"; printf "%s" "$summary"
