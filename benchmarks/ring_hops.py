"""The per-hop work of zigzag ring attention, timed on one GPU, and the scaling model
built from it (docs/scaling.md).

A causal zigzag ring over n devices (Note [Zigzag layout] in jax_fa4/ring.py) runs n
hops per step; in every hop each device attends S_local queries to S_local / 2 keys
unmasked (or the reverse), and hop 0 is the same amount of work split in three calls.
So the hop's kernel time is that of one unmasked (S_local x S_local / 2) attention,
forward and backward, at the per-device shapes, which this measures with jax_fa4:

    python benchmarks/ring_hops.py --out bench_out            # on the GPU: writes ring_hops.csv
    python benchmarks/ring_hops.py --model bench_out/ring_hops.csv   # anywhere: the table

The model (``--model``): per hop the K / V block (bf16) moves to the next device in
the forward, and K / V with the fp32 dK / dV partials in the backward; transfer time
= bytes / link bandwidth, NVLink 4 at 450 GB/s per direction within an 8-GPU node,
400 Gb/s InfiniBand (50 GB/s) once the ring spans nodes (every hop then has a link
between nodes, which sets the pace). A step takes n x max(kernel, transfer) per
direction: communication hides while the transfer is shorter than the kernel.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128  # a Llama-3-8B-like attention layer
NVLINK_BPS, IB_BPS, GPUS_PER_NODE = 450e9, 50e9, 8
LOCALS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def time_hop(s: int, iters: int) -> tuple[float, float]:
    """(forward, backward) seconds of one hop's kernels at S_local = s."""
    import jax
    import jax.numpy as jnp

    import jax_fa4
    from benchmarks.bench_attention import time_calls

    keys = jax.random.split(jax.random.key(s), 3)
    q = jax.random.normal(keys[0], (1, s, HEADS_Q, HEAD_DIM), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, s // 2, HEADS_KV, HEAD_DIM), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, s // 2, HEADS_KV, HEAD_DIM), jnp.bfloat16)

    def attn(q, k, v):
        return jax_fa4.attention(q, k, v, return_lse=True, implementation="cute")

    fwd = jax.jit(attn)
    cot = fwd(q, k, v)
    _, pullback = jax.vjp(attn, q, k, v)
    bwd = jax.jit(pullback)
    n = max(1, iters * 4096 // s)
    return (time_calls(lambda: fwd(q, k, v), jax.block_until_ready, n),
            time_calls(lambda: bwd(cot), jax.block_until_ready, n))


def measure(out_dir: str, iters: int) -> str:
    rows = []
    for s in LOCALS:
        t_fwd, t_bwd = time_hop(s, iters)
        flop = 4.0 * HEADS_Q * s * (s // 2) * HEAD_DIM
        rows.append(dict(s_local=s, fwd_us=t_fwd * 1e6, bwd_us=t_bwd * 1e6,
                         fwd_tflops=flop / t_fwd / 1e12, bwd_tflops=2.5 * flop / t_bwd / 1e12))
        print(f"S_local {s:6d}: hop forward {t_fwd * 1e6:9.1f} us "
              f"({rows[-1]['fwd_tflops']:.0f} TFLOP/s), backward {t_bwd * 1e6:9.1f} us "
              f"({rows[-1]['bwd_tflops']:.0f} TFLOP/s)", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "ring_hops.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"csv: {path}")
    return path


def model(path: str) -> str:
    """The markdown scaling table from a ring_hops.csv."""
    with open(path) as f:
        hops = {int(r["s_local"]): (float(r["fwd_us"]), float(r["bwd_us"])) for r in
                csv.DictReader(f)}
    lines = ["| tokens | GPUs | S_local | hop kernel fwd / bwd (us) | hop transfer fwd / bwd "
             "(us) | transfer hidden fwd / bwd | step fwd + bwd (ms) | TFLOP/s per GPU |",
             "|---|---|---|---|---|---|---|---|"]
    for tokens in (131072, 262144, 524288, 1048576):
        for n in (8, 16, 32, 64, 128, 256, 512, 1024):
            s = tokens // n
            if s not in hops:
                continue
            k_f, k_b = hops[s]
            bw = NVLINK_BPS if n <= GPUS_PER_NODE else IB_BPS
            kv_bytes = 2 * s * HEADS_KV * HEAD_DIM * 2
            c_f = kv_bytes / bw * 1e6
            c_b = (kv_bytes + 2 * s * HEADS_KV * HEAD_DIM * 4) / bw * 1e6
            step_us = n * (max(k_f, c_f) + max(k_b, c_b))
            hidden = " / ".join("yes" if c <= k else "no" for k, c in ((k_f, c_f), (k_b, c_b)))
            flop = 3.5 * 4.0 * HEADS_Q * tokens * tokens * HEAD_DIM / 2  # causal, fwd + bwd
            lines.append(f"| {tokens // 1024}k | {n} | {s} | {k_f:.0f} / {k_b:.0f} | "
                         f"{c_f:.0f} / {c_b:.0f} | {hidden} | {step_us / 1e3:.2f} | "
                         f"{flop / n / (step_us * 1e-6) / 1e12:.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out", help="folder for ring_hops.csv")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--model", metavar="CSV", help="print the scaling table from a CSV")
    args = p.parse_args()
    if args.model:
        print(model(args.model))
    else:
        print(model(measure(args.out, args.iters)))


if __name__ == "__main__":
    main()
