"""Attention speed: jax_fa4 against flash-attn-4 (PyTorch), cuDNN and XLA (both through
jax.nn.dot_product_attention), all in one process on the same GPU.

Cases: bf16, 16k tokens per batch (batch = 16384 / seqlen), hidden 2048 (heads =
2048 / hdim). FLOPs: forward 4*B*H*S^2*D (halved when causal), backward 2.5x the
forward. Prints a table of TFLOP/s, jax_fa4's ratio to each peer and memory; writes a
CSV and (with matplotlib) a PNG plot to --out (default ./bench_out).

Method (the defaults): every implementation of a case is set up and compiled first,
then timed in --rounds (6) alternating rounds (A B C, then C B A, ...), each round
--iters (20) back-to-back calls of each forward and backward, synchronised once; a
figure is the median over the rounds, and the CSV gets each one's range over the
rounds (fwd_range / bwd_range, as a fraction of the median). Before each timed burst
the same implementation runs untimed for --settle-ms (200 ms): under this load the
H200 sits at its 700 W power cap, where each kernel holds its own SM clock (Note
[Clock settling]). XLA, which materialises the scores and runs far below the cap, is
timed after the rounds on its own (OUTSIDE_ROUNDS), without a range. "bwd" is the
backward alone, run on the residuals of one saved forward (--bwd-timing direct), or
(forward + backward) minus forward (diff). --rounds 1 times each implementation on
its own, in turn (``time_calls``: the median of 5 reps of --iters calls).

Memory of the forward + backward step, in MiB:
  temp / total  JAX implementations: XLA's buffer assignment of the compiled
                jitted step (`compile().memory_analysis()`): temp buffers, and
                arguments + outputs + temp. '-' where XLA does not say.
  peak          flash-attn-4 (PyTorch): torch.cuda.max_memory_allocated() during
                one step minus what was allocated before it (inputs and dout
                already allocated): outputs (dq, dk, dv, out, lse) and every
                temporary. Compare it with total minus the inputs (q, k, v, dout).

    python benchmarks/bench_attention.py [--out DIR] [--peers fa4,cudnn,xla] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

# XLA grows its pool on demand instead of taking 75% of the GPU at start: PyTorch
# (flash-attn-4) runs in the same process. main() warns when this was overridden.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Benchmark this checkout's jax_fa4, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

import jax_fa4

FULL_CASES = [  # hdim, seqlen, causal
    (128, 1024, False), (128, 1024, True),
    (128, 4096, False), (128, 4096, True),
    (128, 16384, False), (128, 16384, True),
    (64, 8192, False), (64, 8192, True),
    (256, 8192, False), (256, 8192, True),
]
QUICK_CASES = [(128, 4096, False), (128, 4096, True), (64, 8192, False), (64, 8192, True)]
TOKENS, HIDDEN = 16384, 2048


def parse_cases(text: str) -> list[tuple[int, int, bool]]:
    """--cases "128:4096:0,256:8192:1" -> [(128, 4096, False), (256, 8192, True)]."""
    cases = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 3 or parts[2] not in ("0", "1"):
            raise ValueError(f"--cases wants hdim:seqlen:causal(0|1), got {item!r}")
        cases.append((int(parts[0]), int(parts[1]), parts[2] == "1"))
    return cases


def flops(b, h, s, d, causal, direction):
    f = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return f * (2.5 if direction == "bwd" else 1.0)


def time_calls(call, sync, iters: int, reps: int = 5) -> float:
    """Median over reps of the mean time of `iters` back-to-back calls (seconds).

    `call()` launches one step; `sync(out)` waits for the device. One warm-up
    call first (compilation stays out of the numbers). JAX and PyTorch are timed
    by this same function, so their numbers compare.
    """
    out = call()
    sync(out)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = call()
        sync(out)
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


# Note [Clock settling]
# ~~~~~~~~~~~~~~~~~~~~~
# Under a sustained attention load the H200 sits at its 700 W power cap, and its SM
# clock depends on the kernel: 1.59-1.89 GHz, cuDNN's kernels 50-200 MHz above
# jax_fa4's or flash-attn-4's at the same power. After a switch of kernel the clock
# takes time to move to the new kernel's level, so a burst of 20 calls (3-70 ms)
# partly runs at the clock the previous implementation left behind; in a fixed
# alternating order one peer always follows the same other one. `settle` runs each
# implementation untimed first, so that every timed burst starts at its own clock.


def interleaved(calls: Mapping[object, Callable[[], object]], sync: Callable[[object], object],
                rounds: int = 7, inner: int = 20, warmup: int = 3,
                clock: Callable[[], float] = time.perf_counter,
                settle: float = 0.0) -> dict[object, list[float]]:
    """Seconds per call of each entry of ``calls``, one value per round.

    calls: name -> a function launching one step (asynchronously) and returning its
    outputs; sync(outputs) waits for the device. Rounds alternate the order (forward,
    then reversed), so that no entry always runs first or last.

    Each call's outputs are dropped when the next call is launched and only the last
    call's are synchronised on, as in a training loop and in ``time_calls``: the
    allocators then recycle the same buffers (keeping every output alive makes each
    round allocate afresh, and single rounds ran several times slower). One untimed
    round of ``inner`` calls per entry follows the ``warmup`` calls, so the first
    timed round starts from the same memory state as the others.

    settle > 0: before each timed burst, untimed bursts of ``inner`` calls of the same
    entry run until at least ``settle`` seconds have passed (Note [Clock settling]).
    """
    if rounds < 1 or inner < 1:
        raise ValueError("rounds and inner must be positive")
    for f in calls.values():
        for _ in range(warmup):
            sync(f())
    names = list(calls)

    def run(f):
        out = None
        for _ in range(inner):
            out = f()
        sync(out)

    for n in names:
        run(calls[n])
    times: dict[object, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else reversed(names):
            if settle > 0:
                t_settle = clock()
                while True:
                    run(calls[n])
                    if clock() - t_settle >= settle:
                        break
            t0 = clock()
            run(calls[n])
            times[n].append((clock() - t0) / inner)
    return times


MiB = 2.0**20


def xla_memory(jitted, args) -> dict:
    """{"temp_mib", "total_mib"} of a jitted function's compiled buffers; None where unknown."""
    mem = {"temp_mib": None, "total_mib": None}
    try:
        stats = jitted.lower(*args).compile().memory_analysis()
    except Exception as e:  # noqa: BLE001 - memory is a side figure; never fail the timing
        print(f"  memory_analysis failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return mem
    if isinstance(stats, (list, tuple)):  # one entry per device in some versions
        stats = stats[0] if stats else None
    if stats is None:
        return mem

    def field(name):
        v = getattr(stats, name, None)
        return v if isinstance(v, int) and v >= 0 else None

    temp = field("temp_size_in_bytes")
    parts = (field("argument_size_in_bytes"), field("output_size_in_bytes"), temp)
    if temp is not None:
        mem["temp_mib"] = temp / MiB
    if all(p is not None for p in parts):
        # Literally arguments + outputs + temp; no buffer is donated here, so
        # alias_size_in_bytes (bytes counted twice) is 0.
        mem["total_mib"] = sum(parts) / MiB
    return mem


def jax_impls(peers):
    """{name: attention(q, k, v, causal)} of the JAX implementations: jax_fa4 and the
    peers asked for (det: jax_fa4 with deterministic=True; cudnn; xla)."""
    impls = {
        "jax_fa4": lambda q, k, v, c: jax_fa4.attention(q, k, v, causal=c, implementation="cute")
    }
    if "det" in peers:  # jax_fa4's deterministic backward (its cost, in the same run)
        impls["jax_fa4_det"] = lambda q, k, v, c: jax_fa4.attention(
            q, k, v, causal=c, implementation="cute", deterministic=True)
    if "cudnn" in peers:
        impls["cudnn"] = lambda q, k, v, c: jax.nn.dot_product_attention(
            q, k, v, is_causal=c, implementation="cudnn")
    if "xla" in peers:
        impls["xla"] = lambda q, k, v, c: jax.nn.dot_product_attention(
            q, k, v, is_causal=c, implementation="xla")
    return impls


@dataclass
class Prepared:
    """One implementation of one case, set up and compiled, ready to time.

    fwd / bwd launch one forward / backward (asynchronously) and return its
    outputs; with diff, bwd is the whole forward + backward step and the backward's
    time is that minus the forward's. sync(outputs) waits for the device.
    """

    fwd: Callable[[], object]
    bwd: Callable[[], object]
    sync: Callable[[object], object]
    mem: dict
    diff: bool = False


def prepare_jax(attn, q, k, v, causal, bwd_timing="direct", data=()) -> Prepared:
    """A JAX implementation, ready to time (``Prepared``).

    bwd_timing "direct": the pullback alone, timed on the residuals of one forward
    (jax.vjp's function is a pytree, so a jitted function takes it as an argument);
    "diff": the backward is the fwd+bwd step's time minus the forward's.
    data: more arguments of ``attn`` after ``causal`` (mask arrays), passed to the
    jitted functions as arguments: closed over, XLA would fold what they feed.
    """
    fwd = jax.jit(lambda q, k, v, *d: attn(q, k, v, causal, *d))
    dout = jax.random.normal(jax.random.key(3), q.shape[:-1] + v.shape[-1:], q.dtype)

    # dout is an argument: closed over, it would be a constant in the HLO.
    def _bwd(q, k, v, dout, *d):
        _, pull = jax.vjp(lambda q, k, v: attn(q, k, v, causal, *d), q, k, v)
        return pull(dout)

    step = jax.jit(_bwd)
    mem = xla_memory(step, (q, k, v, dout, *data))
    if bwd_timing == "direct":
        _, pull = jax.jit(lambda q, k, v, *d: jax.vjp(
            lambda q, k, v: attn(q, k, v, causal, *d), q, k, v))(q, k, v, *data)
        pullback = jax.jit(lambda pull, dout: pull(dout))
        return Prepared(lambda: fwd(q, k, v, *data), lambda: pullback(pull, dout),
                        jax.block_until_ready, mem)
    return Prepared(lambda: fwd(q, k, v, *data), lambda: step(q, k, v, dout, *data),
                    jax.block_until_ready, mem, diff=True)


def measure(prep: Prepared, iters: int, reps: int = 5):
    """(fwd seconds, bwd seconds, memory) of one implementation timed on its own
    (``time_calls``: the forward's reps, then the backward's)."""
    t_fwd = time_calls(prep.fwd, prep.sync, iters, reps)
    t_bwd = time_calls(prep.bwd, prep.sync, iters, reps)
    if prep.diff:
        t_bwd = max(t_bwd - t_fwd, 1e-9)
    return t_fwd, t_bwd, prep.mem


# Peers timed after the alternating rounds, on their own (``measure``), not in them.
# XLA's attention materialises the scores: at 16k its calls run 10-30x longer than
# the fused kernels' and far below the power cap, so whichever implementation
# followed it in a round started its burst with the power budget XLA left (at hdim
# 128 16k causal, XLA in the rounds moved jax_fa4's backward ratio to flash-attn-4
# from 1.020 to 0.994 and doubled the ranges).
OUTSIDE_ROUNDS = ("xla",)


def measure_rounds(preps: dict[str, Prepared], iters: int, rounds: int, settle: float = 0.0):
    """{name: (fwd seconds, bwd seconds, memory, fwd range, bwd range)} of every
    implementation of a case, timed in alternating rounds (``interleaved``, with its
    `settle` seconds before each timed burst); the seconds are medians over the
    rounds, the ranges (max - min) / median. The OUTSIDE_ROUNDS peers are timed
    afterwards on their own and get (fwd seconds, bwd seconds, memory)."""
    alone = {n: p for n, p in preps.items() if n in OUTSIDE_ROUNDS}
    preps = {n: p for n, p in preps.items() if n not in OUTSIDE_ROUNDS}
    calls = {}
    for name, prep in preps.items():
        calls[(name, "fwd")] = prep.fwd
        calls[(name, "bwd")] = prep.bwd
    syncs = list(dict.fromkeys(p.sync for p in preps.values()))

    def sync_all(outs):
        for sync in syncs:
            sync(outs)

    times = (interleaved(calls, sync_all, rounds=rounds, inner=iters, warmup=1, settle=settle)
             if calls else {})
    out = {}
    for name, prep in preps.items():
        tf, tb = times[(name, "fwd")], times[(name, "bwd")]
        med_f, med_b = statistics.median(tf), statistics.median(tb)
        rng = lambda ts, m: (max(ts) - min(ts)) / m  # noqa: E731
        if prep.diff:  # per round, the step minus that round's forward
            tb = [max(b - f, 1e-9) for f, b in zip(tf, tb, strict=True)]
            med_b = statistics.median(tb)
        out[name] = (med_f, med_b, prep.mem, rng(tf, med_f), rng(tb, med_b))
    for name, prep in alone.items():
        out[name] = measure(prep, iters)
    return out


def bench_jax(attn, q, k, v, causal, iters, bwd_timing="direct"):
    """(fwd seconds, bwd seconds, memory of the fwd+bwd step) of one JAX
    implementation, timed on its own (``prepare_jax``, ``measure``)."""
    return measure(prepare_jax(attn, q, k, v, causal, bwd_timing), iters)


def import_fa4_func():
    """flash-attn-4's flash_attn_func (PyTorch, CuTe DSL kernels)."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:  # older layouts export it from the interface module only
        from flash_attn.cute.interface import flash_attn_func
    return flash_attn_func


def prepare_fa4_torch(q, k, v, causal, bwd_timing="direct") -> Prepared:
    """flash-attn-4 (PyTorch), ready to time (``Prepared``), with the peak memory
    of one fwd+bwd step.

    Same data as the JAX implementations (bf16 -> f32 -> bf16 is exact); the
    forward runs with grad enabled, as in training. bwd_timing as in
    ``prepare_jax`` ("direct": autograd.grad on one forward's graph, kept with
    retain_graph).
    """
    import numpy as np
    import torch

    flash_attn_func = import_fa4_func()
    tq, tk, tv = (torch.from_numpy(np.array(x.astype(jnp.float32))).cuda().bfloat16()
                  .requires_grad_(True) for x in (q, k, v))

    def fwd():
        out = flash_attn_func(tq, tk, tv, causal=causal)
        return out[0] if isinstance(out, tuple) else out  # some versions also return the LSE

    dout = torch.randn_like(fwd())

    def fb():
        return torch.autograd.grad(fwd(), (tq, tk, tv), dout)

    fb()  # compiles flash-attn-4's kernels outside the measured step
    # Peak of one step above what is allocated before it (inputs and dout).
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = fb()
    torch.cuda.synchronize()
    mem = {"peak_mib": (torch.cuda.max_memory_allocated() - before) / MiB}
    del grads
    sync = lambda _: torch.cuda.synchronize()  # noqa: E731
    if bwd_timing == "direct":
        out = fwd()
        return Prepared(fwd, lambda: torch.autograd.grad(out, (tq, tk, tv), dout,
                                                         retain_graph=True), sync, mem)
    return Prepared(fwd, fb, sync, mem, diff=True)


def bench_fa4_torch(q, k, v, causal, iters, bwd_timing="direct"):
    """(fwd seconds, bwd seconds, memory of the fwd+bwd step) of flash-attn-4
    (PyTorch), timed on its own (``prepare_fa4_torch``, ``measure``)."""
    return measure(prepare_fa4_torch(q, k, v, causal, bwd_timing), iters)


def release_torch_memory():
    """Hand PyTorch's cached blocks back to the driver, so that XLA can grow into them."""
    try:
        import torch

        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - a failed peer must not stop the JAX cases
        print(f"  torch.cuda.empty_cache failed: {type(e).__name__}: {e}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="four cases instead of ten")
    p.add_argument("--cases", default="",
                   help="only these cases, hdim:seqlen:causal joined by commas, "
                        "e.g. 128:4096:0,256:8192:1")
    p.add_argument("--out", default="bench_out",
                   help="folder for the CSV and the plot (created; default ./bench_out)")
    p.add_argument("--peers", default="fa4,cudnn,xla",
                   help="comma-separated peers of jax_fa4: fa4 (flash-attn-4, PyTorch), "
                        "cudnn, xla, det (jax_fa4 with deterministic=True)")
    p.add_argument("--iters", type=int, default=20,
                   help="back-to-back calls per timed burst")
    p.add_argument("--rounds", type=int, default=6,
                   help="alternating rounds per case (median; ranges in the CSV); 1: each "
                        "implementation timed on its own, in turn (median of 5 reps)")
    p.add_argument("--bwd-timing", choices=("diff", "direct"), default="direct",
                   help="backward time: the backward alone on saved residuals (direct), or "
                        "the fwd+bwd step minus the forward (diff)")
    p.add_argument("--settle-ms", type=float, default=None,
                   help="with --rounds > 1: before each timed burst, run the same "
                        "implementation untimed for at least this long (default 200; 0: no "
                        "settling), so the burst starts at the clock its own kernel holds at "
                        "the power cap (Note [Clock settling])")
    args = p.parse_args(argv)
    if args.settle_ms is None:
        args.settle_ms = 200.0 if args.rounds > 1 else 0.0
    elif args.rounds < 2:
        p.error("--settle-ms applies to --rounds > 1")
    peers = set(args.peers.split(",")) if args.peers else set()
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {dev.platform} {dev.device_kind}", flush=True)
    cases = QUICK_CASES if args.quick else FULL_CASES
    if args.cases:
        cases = parse_cases(args.cases)
    rows = []
    have_fa4 = False
    if "fa4" in peers:
        try:
            import_fa4_func()
            have_fa4 = True
        except Exception as e:  # noqa: BLE001 - the peer is optional
            print(f"flash-attn-4 not importable, skipping it: {type(e).__name__}: {e}", flush=True)
    if have_fa4 and os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"].lower() not in ("false", "0"):
        print("warning: XLA_PYTHON_CLIENT_PREALLOCATE is not false: XLA holds most of the GPU "
              "and PyTorch may run out of memory", flush=True)
    impls = jax_impls(peers)
    for i, (d, s, causal) in enumerate(cases):
        h = HIDDEN // d
        b = TOKENS // s
        kq, kk, kv = jax.random.split(jax.random.key(i), 3)
        q, k, v = (jax.random.normal(key, (b, s, h, d), jnp.bfloat16) for key in (kq, kk, kv))
        if args.rounds > 1:
            results = bench_case_rounds(impls, q, k, v, causal, have_fa4, args, i, len(cases))
        else:
            results = bench_case(impls, q, k, v, causal, have_fa4, args, i, len(cases))
        for name, (tf, tb, mem, *ranges) in results.items():
            rows.append(dict(
                impl=name, hdim=d, seqlen=s, causal=causal, batch=b, heads=h,
                fwd_ms=tf * 1e3, bwd_ms=tb * 1e3,
                fwd_tflops=flops(b, h, s, d, causal, "fwd") / tf / 1e12,
                bwd_tflops=flops(b, h, s, d, causal, "bwd") / tb / 1e12,
                **{c: mem.get(c) for c in MEM_COLUMNS},
                fwd_range=ranges[0] if ranges else None,
                bwd_range=ranges[1] if ranges else None,
            ))
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    path = os.path.join(args.out, f"bench_attention_{stamp}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()) if rows else ["impl"])
        w.writeheader()
        # Unknown memory figures are empty fields.
        w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    _print_table(rows)
    print(f"versions: jax {jax.__version__}, python {sys.version.split()[0]}; csv: {path}")
    _plot(rows, os.path.join(args.out, f"bench_attention_{stamp}.png"))
    return rows


MEM_COLUMNS = ("temp_mib", "total_mib", "peak_mib")


def bench_case(impls, q, k, v, causal, have_fa4, args, i, n_cases):
    """{name: (fwd s, bwd s, memory)}: each implementation timed on its own, in turn."""
    d, s = q.shape[3], q.shape[1]
    results = {}
    for name, attn in impls.items():
        print(f"[{i + 1}/{n_cases}] d={d} s={s} causal={causal}: {name} ...", flush=True)
        try:
            results[name] = bench_jax(attn, q, k, v, causal, args.iters, args.bwd_timing)
        except Exception as e:  # noqa: BLE001 - report and continue with the others
            print(f"  {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        _print_progress(results[name])
    if have_fa4:
        print(f"[{i + 1}/{n_cases}] d={d} s={s} causal={causal}: fa4 (torch) ...", flush=True)
        try:
            results["fa4_torch"] = bench_fa4_torch(q, k, v, causal, args.iters, args.bwd_timing)
        except Exception as e:  # noqa: BLE001
            print(f"  fa4_torch failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        else:
            _print_progress(results["fa4_torch"])
        release_torch_memory()  # after the except clause: its traceback held the tensors
    return results


def bench_case_rounds(impls, q, k, v, causal, have_fa4, args, i, n_cases):
    """{name: (fwd s, bwd s, memory, fwd range, bwd range)}: every implementation
    set up first, then timed in args.rounds alternating rounds (``measure_rounds``)."""
    d, s = q.shape[3], q.shape[1]
    preps = {}
    for name, attn in impls.items():
        print(f"[{i + 1}/{n_cases}] d={d} s={s} causal={causal}: {name} (set up) ...",
              flush=True)
        try:
            preps[name] = prepare_jax(attn, q, k, v, causal, args.bwd_timing)
        except Exception as e:  # noqa: BLE001 - report and continue with the others
            print(f"  {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    if have_fa4:
        print(f"[{i + 1}/{n_cases}] d={d} s={s} causal={causal}: fa4 (torch, set up) ...",
              flush=True)
        try:
            preps["fa4_torch"] = prepare_fa4_torch(q, k, v, causal, args.bwd_timing)
        except Exception as e:  # noqa: BLE001
            print(f"  fa4_torch failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    after = [n for n in preps if n in OUTSIDE_ROUNDS]
    print(f"[{i + 1}/{n_cases}] timing {len(preps) - len(after)} implementations in "
          f"{args.rounds} alternating rounds (settling {args.settle_ms:g} ms before each)"
          + (f", then {', '.join(after)} on its own" if after else "") + " ...", flush=True)
    try:
        results = measure_rounds(preps, args.iters, args.rounds, args.settle_ms / 1e3)
    except Exception as e:  # noqa: BLE001 - one failed case must not end the run
        print(f"  timing failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        results = {}
    for name, res in results.items():
        if len(res) > 3:
            print(f"  {name}: range over rounds fwd {100 * res[3]:.1f}%, "
                  f"bwd {100 * res[4]:.1f}%", flush=True)
        _print_progress(res[:3])
    del preps
    if have_fa4:
        release_torch_memory()
    return results


def _mib(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def _print_progress(result):
    tf, tb, mem = result
    print(f"  fwd {tf * 1e3:.3f} ms, bwd {tb * 1e3:.3f} ms; fwd+bwd MiB: "
          + ", ".join(f"{c[:-4]} {_mib(mem.get(c))}" for c in MEM_COLUMNS if c in mem),
          flush=True)


def _print_table(rows):
    key = lambda r: (r["hdim"], r["seqlen"], r["causal"])  # noqa: E731
    cases = sorted({key(r) for r in rows})
    by = {(key(r), r["impl"]): r for r in rows}
    print("\nTFLOP/s fwd / bwd, jax_fa4's ratio to each peer, MiB of the fwd+bwd step, and")
    print("each timing's range over the rounds in % of its median (with --rounds; a ratio")
    print("closer to 1 than its two ranges is not a difference)")
    print("(temp / total: XLA temp buffers / arguments + outputs + temp; "
          "peak: torch peak above the inputs)")
    print(f"{'hdim':>4} {'seq':>6} {'causal':>6} | {'impl':>9} {'fwd':>7} {'bwd':>7} | "
          f"{'fwd x':>6} {'bwd x':>6} | {'temp':>7} {'total':>7} {'peak':>7} | "
          f"{'rng f%':>6} {'rng b%':>6}")
    for c in cases:
        ours = by.get((c, "jax_fa4"))
        for impl in ("jax_fa4", "fa4_torch", "cudnn", "xla"):
            r = by.get((c, impl))
            if r is None:
                continue
            rf = rb = ""
            if ours is not None and impl != "jax_fa4":
                rf = f"{ours['fwd_tflops'] / r['fwd_tflops']:.3f}"
                rb = f"{ours['bwd_tflops'] / r['bwd_tflops']:.3f}"
            mem = " ".join(f"{_mib(r.get(m)):>7}" for m in MEM_COLUMNS)
            rng = " ".join("-".rjust(6) if r.get(k) is None else f"{100 * r[k]:6.1f}"
                           for k in ("fwd_range", "bwd_range"))
            print(f"{c[0]:>4} {c[1]:>6} {str(c[2]):>6} | {impl:>9} {r['fwd_tflops']:7.1f} "
                  f"{r['bwd_tflops']:7.1f} | {rf:>6} {rb:>6} | {mem} | {rng}")


def _plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    hdims = sorted({r["hdim"] for r in rows})
    fig, axes = plt.subplots(2, len(hdims), figsize=(4 * len(hdims), 7), squeeze=False)
    for j, d in enumerate(hdims):
        for i, direction in enumerate(("fwd", "bwd")):
            ax = axes[i][j]
            for impl in sorted({r["impl"] for r in rows}):
                for causal in (False, True):
                    pts = sorted((r["seqlen"], r[f"{direction}_tflops"]) for r in rows
                                 if r["impl"] == impl and r["hdim"] == d and r["causal"] == causal)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", ls="-" if not causal else "--",
                                label=f"{impl}{' causal' if causal else ''}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"hdim {d} {direction}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
