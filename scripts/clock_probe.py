"""Sustained runs of jax_fa4 and flash-attn-4 with the GPU's SM clock and power
sampled meanwhile: does one kernel run at a lower clock than the other under load?

Nsight Compute locks the SM clock (1.35 GHz on the H200), and there the two
forwards' durations differ by 0.5-1.4%; the benchmark runs at whatever clock the
GPU's power management gives and reads gaps of 2.5-5% at the same shapes. This
script runs each (implementation, direction) for --seconds of back-to-back calls,
in alternating rounds, while `nvidia-smi --loop-ms` samples the SM clock, the
power draw and the active clock-event reasons; per phase it prints TFLOP/s over the
whole phase, the mean clock and power over the phase's middle 80%, and TFLOP/s per
GHz (work per clock cycle, which a clock difference does not change).

    python scripts/clock_probe.py [--cases 64:8192:1,128:16384:0] [--rounds 3]
        [--seconds 1.5] [--dirs fwd,bwd] [--variants st3,oq+st3] [--bwd-variants default,shfl]
        [--no-fa4] [--peers cudnn]

--bwd-variants adds backward main kernels alone (gpu_check_bwd's variants: default
for the table's, e.g. shfl), compared with bwd:default.

--variants adds jax_fa4 forward kernels with other tiles (gpu_check_fwd's --tiles
knobs), called alone (gpu_check_fwd.fwd_call), forward only; a variant that does not
serve a case's mask (lpt: causal only) or head dim (q_in_regs: up to 128) is left
out of that case.

--batch / --heads replace the benchmark's shape (16k tokens, hidden 2048). With few
tiles (e.g. --batch 1 --heads 1 at 8k: 64 tiles, one per SM for 64 of the 132 SMs)
the GPU stays below its power cap, every kernel runs at the top clock, and the power
column then compares the kernels' energy per FLOP (pJ/FLOP = W / (TFLOP/s)) with the
clock held equal. Calls are short there (0.1 ms at hdim 128 8k with B = H = 1), and
flash-attn-4's calls from PyTorch then leave gaps between its kernels; --fa4-graph N
replays N of its forward calls from one CUDA graph instead (forward only).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [here, os.path.join(here, ".."), os.path.join(here, "..", "benchmarks")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_attention import (  # noqa: E402
    HIDDEN,
    TOKENS,
    Prepared,
    flops,
    jax_impls,
    parse_cases,
    prepare_fa4_torch,
    prepare_jax,
)

FIELDS = ("timestamp", "clocks.sm", "power.draw", "temperature.gpu")


def start_sampler(path: str, interval_ms: int) -> subprocess.Popen:
    """nvidia-smi writing one CSV line per sample to path; the clock-event reasons
    column is added where this driver knows it."""
    fields = list(FIELDS)
    for extra in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
        probe = subprocess.run(["nvidia-smi", f"--query-gpu={extra}", "--format=csv,noheader"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and "Field" not in probe.stdout + probe.stderr:
            fields.append(extra)
            break
    return subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
         f"--loop-ms={interval_ms}", f"--filename={path}"])


def read_samples(path: str):
    """[(unix time, sm MHz, watts, reasons or None)] from the sampler's file."""
    out = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 4:
                continue
            try:
                t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                out.append((t, float(parts[1]), float(parts[2]),
                            parts[4] if len(parts) > 4 else None))
            except ValueError:
                continue
    return out


def case_shape(d: int, s: int, batch: int = 0, heads: int = 0) -> tuple[int, int]:
    """(B, H) of a case: the benchmark's (16k tokens, hidden 2048) unless given."""
    return batch or max(1, TOKENS // s), heads or max(1, HIDDEN // d)


def graph_replay(fwd, n: int):
    """A function that launches ``fwd`` n times by replaying one CUDA graph (PyTorch),
    so that host overhead leaves no gaps between short kernels."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():  # forward only: no autograd state captured
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up on a side stream, as torch.cuda.graphs asks
                fwd()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                out = fwd()

    def replay():
        graph.replay()
        return out

    return replay


def bwd_main_call(d: int, causal: bool, bsh: tuple[int, int, int], spec: str):
    """A zero-argument call of gpu_check_bwd's backward main kernel variant ``spec``
    (its table's kernel for "default") on random bf16 (B, S, H, d) inputs
    (``main_kernel_call``); None where no sm90 main kernel serves d (hdim 256 has
    its own)."""
    from gpu_check_bwd import kernel_call, main_kernel_call

    if d not in (64, 128):
        return None
    b, s, h = bsh
    ks = jax.random.split(jax.random.PRNGKey(11), 5)
    qkvdo = tuple(jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
                  for kk in ks[:4])
    return main_kernel_call(kernel_call, d, causal, spec, qkvdo, ks[4])


def run_phase(call, sync, seconds: float):
    """Back-to-back calls for about `seconds`; (host start, host end, calls)."""
    out = call()
    sync(out)
    t0 = time.time()
    n = 0
    while True:
        for _ in range(10):
            out = call()
        sync(out)
        n += 10
        if time.time() - t0 >= seconds:
            break
    return t0, time.time(), n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="64:8192:1,128:16384:0,128:16384:1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--dirs", default="fwd")
    ap.add_argument("--interval-ms", type=int, default=20)
    ap.add_argument("--variants", default="", help="jax_fa4 forward tile variants")
    ap.add_argument("--bwd-variants", default="",
                    help="jax_fa4 backward main-kernel variants (gpu_check_bwd's, e.g. "
                         "default,shfl): the main kernel alone, as bwd:<variant>")
    ap.add_argument("--no-fa4", action="store_true", help="leave flash-attn-4 out")
    ap.add_argument("--peers", default="", help="JAX peers too (bench_attention's: cudnn, xla)")
    ap.add_argument("--csv", default="", help="also write every phase to this CSV file")
    ap.add_argument("--batch", type=int, default=0, help="batch size (0: 16k tokens / seqlen)")
    ap.add_argument("--heads", type=int, default=0, help="heads (0: 2048 / head dim)")
    ap.add_argument("--fa4-graph", type=int, default=0,
                    help="N > 0: flash-attn-4's forward as N calls replayed from a CUDA graph")
    args = ap.parse_args()
    if args.batch < 0 or args.heads < 0:
        ap.error("--batch and --heads must be >= 0")
    if args.fa4_graph and (args.no_fa4 or args.dirs != "fwd"):
        ap.error("--fa4-graph times flash-attn-4's forward: needs it and --dirs fwd")
    dirs = args.dirs.split(",")
    peers = set(filter(None, args.peers.split(",")))
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    samples_path = os.path.join(tempfile.mkdtemp(), "smi.csv")
    sampler = start_sampler(samples_path, args.interval_ms)
    phases = []  # (case, impl, direction, t0, t1, calls)
    try:
        for d, s, causal in parse_cases(args.cases):
            b, h = case_shape(d, s, args.batch, args.heads)
            keys = jax.random.split(jax.random.PRNGKey(0), 3)
            q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
                       for kk in keys)
            preps = {name: prepare_jax(name, attn, q, k, v, causal, "direct")
                     for name, attn in jax_impls(peers).items()}
            per_call = {}  # kernel launches per timed call (a CUDA graph replays several)
            if not args.no_fa4:
                preps["fa4"] = prepare_fa4_torch(q, k, v, causal, "direct")
                if args.fa4_graph:
                    p = preps["fa4"]
                    preps["fa4"] = Prepared(graph_replay(p.fwd, args.fa4_graph), p.bwd,
                                            p.sync, p.mem)
                    per_call["fa4"] = args.fa4_graph
            order = [(n, dr) for dr in dirs for n in preps]
            for spec in filter(None, args.variants.split(",")):
                from gpu_check_fwd import fwd_call, resolve, tile_variant

                tiles = resolve(tile_variant(spec), d, causal)
                if tiles is False:
                    continue
                try:
                    f = fwd_call(jnp.bfloat16, d, causal, (b, s, s, h, h), poison=False,
                                 tiles=tiles)
                except ValueError as e:  # a knob that does not serve this head dim
                    print(f"  d{d} s{s}: variant {spec} left out: {e}", flush=True)
                    continue
                preps[spec] = Prepared(lambda f=f, a=(q, k, v): f(*a), None,
                                       jax.block_until_ready, {})
                order.append((spec, "fwd"))
            for spec in filter(None, args.bwd_variants.split(",")):
                call = bwd_main_call(d, causal, (b, s, h), spec)
                if call is None:
                    print(f"  d{d} s{s}: backward variant {spec} left out (no sm90 main "
                          "kernel of that head dim)", flush=True)
                    continue
                preps[f"bwd:{spec}"] = Prepared(None, call, jax.block_until_ready, {})
                order.append((f"bwd:{spec}", "bwd"))
            case = f"d{d} s{s} {'c' if causal else 'nc'}"
            if args.batch or args.heads:
                case += f" b{b} h{h}"
            # Bring the GPU up to its loaded power state before the first timed phase.
            first = preps[order[0][0]]
            run_phase(first.fwd, first.sync, 1.0)
            for r in range(args.rounds):
                for name, dr in (order if r % 2 == 0 else order[::-1]):
                    p = preps[name]
                    t0, t1, n = run_phase(p.fwd if dr == "fwd" else p.bwd, p.sync, args.seconds)
                    n *= per_call.get(name, 1)
                    phases.append((case, name, dr, t0, t1, n, flops(b, h, s, d, causal, dr)))
                    print(f"  {case} {name:8s} {dr} round {r}: {n} calls", flush=True)
            print(f"  {case}: done", flush=True)
            del preps
    finally:
        time.sleep(0.2)
        sampler.terminate()
        sampler.wait()
    samples = read_samples(samples_path)
    print(f"{len(samples)} clock samples")
    print(f"{'case':14s} {'impl':8s} {'dir':3s} {'TF/s':>6s} {'MHz':>6s} {'W':>5s} "
          f"{'TF/s/GHz':>8s} {'pJ/FLOP':>7s} reasons")
    summary = {}
    table = []
    for case, name, dr, t0, t1, n, fl in phases:
        lo, hi = t0 + 0.1 * (t1 - t0), t1 - 0.1 * (t1 - t0)
        sel = [x for x in samples if lo <= x[0] <= hi]
        tf = fl * n / (t1 - t0) / 1e12
        mhz = statistics.mean(x[1] for x in sel) if sel else float("nan")
        watts = statistics.mean(x[2] for x in sel) if sel else float("nan")
        reasons = sorted({x[3] for x in sel if x[3]})
        print(f"{case:14s} {name:8s} {dr:3s} {tf:6.1f} {mhz:6.0f} {watts:5.0f} "
              f"{tf / mhz * 1e3:8.1f} {watts / tf:7.3f} {','.join(reasons)}")
        summary.setdefault((case, dr, name), []).append((tf, mhz, watts))
        table.append((case, name, dr, f"{t1 - t0:.3f}", n, f"{tf:.1f}", f"{mhz:.0f}",
                      f"{watts:.0f}", ";".join(reasons)))
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(("case", "impl", "dir", "seconds", "calls", "tflops", "sm_mhz", "watts",
                        "clock_event_reasons"))
            w.writerows(table)
    print("medians over rounds; ratios x jax_fa4 (the API, the table's kernels); "
          "bwd:<variant> x bwd:default (the table's backward main kernel alone)")
    for (case, dr, name), vals in summary.items():
        base = ("bwd:default" if name.startswith("bwd:") and (case, dr, "bwd:default") in summary
                else "jax_fa4")
        if name == base or (case, dr, base) not in summary:
            continue
        mine = [statistics.median(x[i] for x in vals) for i in range(3)]
        ref = [statistics.median(x[i] for x in summary[(case, dr, base)]) for i in range(3)]
        print(f"ratio {case:14s} {dr} {name:10s}: TF/s {mine[0]:.1f} x {mine[0] / ref[0]:.3f}  "
              f"clock {mine[1]:.0f}/{ref[1]:.0f} MHz  power {mine[2]:.0f}/{ref[2]:.0f} W  "
              f"TF/s per GHz x {mine[0] / mine[1] / (ref[0] / ref[1]):.3f}  "
              f"energy per FLOP x {mine[2] / mine[0] / (ref[2] / ref[0]):.3f}")


if __name__ == "__main__":
    main()
