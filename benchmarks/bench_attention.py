"""Attention speed: jax_fa4 vs cuDNN and XLA (via jax.nn) and flash-attn-4 (PyTorch),
all in one process on the same GPU.

Cases follow ../shared/FA4_FACTS.md: bf16, 16k tokens per batch, hidden 2048
(heads = 2048 / hdim). FLOPs: forward 4*B*H*S^2*D (halved when causal),
backward 2.5x forward. Prints a table of ms, TFLOP/s and ratios; writes CSV
and a PNG plot to --out.

    python benchmarks/bench_attention.py [--quick] [--out DIR] [--peers fa4,cudnn,xla]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for PyTorch

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


def flops(b, h, s, d, causal, direction):
    f = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return f * (2.5 if direction == "bwd" else 1.0)


def time_jax(fn, args, iters: int, reps: int = 5) -> float:
    """Median over reps of the mean time of `iters` back-to-back calls (seconds)."""
    out = fn(*args)
    jax.block_until_ready(out)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def jax_impls(peers):
    impls = {
        "jax_fa4": lambda q, k, v, c: jax_fa4.attention(q, k, v, causal=c, implementation="cute")
    }
    if "cudnn" in peers:
        impls["cudnn"] = lambda q, k, v, c: jax.nn.dot_product_attention(
            q, k, v, is_causal=c, implementation="cudnn")
    if "xla" in peers:
        impls["xla"] = lambda q, k, v, c: jax.nn.dot_product_attention(
            q, k, v, is_causal=c, implementation="xla")
    return impls


def bench_jax(name, attn, q, k, v, causal, iters):
    fwd = jax.jit(lambda q, k, v: attn(q, k, v, causal))
    dout = jax.random.normal(jax.random.key(3), q.shape, q.dtype)

    def _bwd(q, k, v):
        _, pull = jax.vjp(lambda q, k, v: attn(q, k, v, causal), q, k, v)
        return pull(dout)

    bwd = jax.jit(_bwd)
    t_fwd = time_jax(fwd, (q, k, v), iters)
    t_fb = time_jax(bwd, (q, k, v), iters)  # forward + backward
    return t_fwd, max(t_fb - t_fwd, 1e-9)


def bench_fa4_torch(q, k, v, causal, iters):
    import numpy as np
    import torch
    from flash_attn.cute.interface import flash_attn_func
    from triton.testing import do_bench

    tq, tk, tv = (torch.from_numpy(np.array(x.astype(jnp.float32))).cuda().bfloat16()
                  .requires_grad_(True) for x in (q, k, v))

    def fwd():
        out = flash_attn_func(tq, tk, tv, causal=causal)
        return out[0] if isinstance(out, tuple) else out  # some versions also return the LSE

    dout = torch.randn_like(fwd())

    def fb():
        torch.autograd.grad(fwd(), (tq, tk, tv), dout)

    t_fwd = do_bench(fwd, warmup=100, rep=500, return_mode="median") / 1e3
    t_fb = do_bench(fb, warmup=100, rep=500, return_mode="median") / 1e3
    return t_fwd, max(t_fb - t_fwd, 1e-9)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="four cases instead of ten")
    p.add_argument("--out", default="docs/benchmarks")
    p.add_argument("--peers", default="fa4,cudnn,xla")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    peers = set(args.peers.split(",")) if args.peers else set()
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {dev.platform} {dev.device_kind}", flush=True)
    cases = QUICK_CASES if args.quick else FULL_CASES
    rows = []
    have_fa4 = False
    if "fa4" in peers:
        try:
            import flash_attn.cute.interface  # noqa: F401

            have_fa4 = True
        except Exception as e:  # noqa: BLE001 - the peer is optional
            print(f"flash-attn-4 not importable, skipping it: {type(e).__name__}: {e}")
    impls = jax_impls(peers)
    for i, (d, s, causal) in enumerate(cases):
        h = HIDDEN // d
        b = TOKENS // s
        kq, kk, kv = jax.random.split(jax.random.key(i), 3)
        q, k, v = (jax.random.normal(key, (b, s, h, d), jnp.bfloat16) for key in (kq, kk, kv))
        results = {}
        for name, attn in impls.items():
            print(f"[{i + 1}/{len(cases)}] d={d} s={s} causal={causal}: {name} ...", flush=True)
            try:
                results[name] = bench_jax(name, attn, q, k, v, causal, args.iters)
            except Exception as e:  # noqa: BLE001 - report and continue with the others
                print(f"  {name} failed: {type(e).__name__}: {str(e)[:200]}")
        if have_fa4:
            print(f"[{i + 1}/{len(cases)}] d={d} s={s} causal={causal}: fa4 (torch) ...",
                  flush=True)
            try:
                results["fa4_torch"] = bench_fa4_torch(q, k, v, causal, args.iters)
            except Exception as e:  # noqa: BLE001
                print(f"  fa4_torch failed: {type(e).__name__}: {str(e)[:200]}")
        for name, (tf, tb) in results.items():
            rows.append(dict(
                impl=name, hdim=d, seqlen=s, causal=causal, batch=b, heads=h,
                fwd_ms=tf * 1e3, bwd_ms=tb * 1e3,
                fwd_tflops=flops(b, h, s, d, causal, "fwd") / tf / 1e12,
                bwd_tflops=flops(b, h, s, d, causal, "bwd") / tb / 1e12,
            ))
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    path = os.path.join(args.out, f"h200_{stamp}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()) if rows else ["impl"])
        w.writeheader()
        w.writerows(rows)
    _print_table(rows)
    print(f"versions: jax {jax.__version__}, python {sys.version.split()[0]}; csv: {path}")
    _plot(rows, os.path.join(args.out, f"h200_{stamp}.png"))
    return rows


def _print_table(rows):
    key = lambda r: (r["hdim"], r["seqlen"], r["causal"])  # noqa: E731
    cases = sorted({key(r) for r in rows})
    by = {(key(r), r["impl"]): r for r in rows}
    print("\nTFLOP/s fwd / bwd, and jax_fa4's ratio to each peer")
    print(f"{'hdim':>4} {'seq':>6} {'causal':>6} | {'impl':>9} {'fwd':>7} {'bwd':>7} | "
          f"{'fwd x':>6} {'bwd x':>6}")
    for c in cases:
        ours = by.get((c, "jax_fa4"))
        for impl in ("jax_fa4", "fa4_torch", "cudnn", "xla"):
            r = by.get((c, impl))
            if r is None:
                continue
            rf = rb = ""
            if ours is not None and impl != "jax_fa4":
                rf = f"{ours['fwd_tflops'] / r['fwd_tflops']:.2f}"
                rb = f"{ours['bwd_tflops'] / r['bwd_tflops']:.2f}"
            print(f"{c[0]:>4} {c[1]:>6} {str(c[2]):>6} | {impl:>9} {r['fwd_tflops']:7.1f} "
                  f"{r['bwd_tflops']:7.1f} | {rf:>6} {rb:>6}")


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
