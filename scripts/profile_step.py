"""One training step (forward + backward) of jax_fa4 or of flash-attn-4 (PyTorch), for
Nsight Compute: scripts/ncu.sh and scripts/kernel_times.sh run it under `ncu`.

The benchmark's shapes: bf16, 16k tokens per batch, hidden 2048 (B = 16384 / seqlen,
H = 2048 / hdim). `--warmup` untimed steps come first (the first compiles), so a
profile filtered on kernel names sees the last step's launches after the warm-up ones.

    python scripts/profile_step.py --impl jax_fa4|fa4 [--hdim 128] [--seqlen 4096]
        [--causal] [--warmup 1]
    python scripts/profile_step.py --impl jax_fa4|fa4 --case packed   # a masked row
        # of benchmarks/bench_masks.py, with its shape and mask
"""

from __future__ import annotations

import argparse
import math
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TOKENS, HIDDEN = 16384, 2048


def run_jax_fa4(b: int, s: int, h: int, d: int, causal: bool, steps: int) -> None:
    import jax
    import jax.numpy as jnp

    import jax_fa4

    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks)

    @jax.jit
    def step(q, k, v, do):
        _, vjp = jax.vjp(lambda q, k, v: jax_fa4.attention(
            q, k, v, causal=causal, implementation="cute"), q, k, v)
        return vjp(do)

    for _ in range(steps):
        jax.block_until_ready(step(q, k, v, do))


def run_fa4(b: int, s: int, h: int, d: int, causal: bool, steps: int) -> None:
    import torch

    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:  # older layouts export it from the interface module only
        from flash_attn.cute.interface import flash_attn_func
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    for _ in range(steps):
        out = flash_attn_func(q, k, v, causal=causal, softmax_scale=1.0 / math.sqrt(d))
        out = out[0] if isinstance(out, tuple) else out
        out.backward(do)
    torch.cuda.synchronize()


def run_case(impl: str, name: str, steps: int) -> None:
    """A masked row of bench_masks.py: its inputs, its mask, its peer's call."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_masks
    import jax
    import jax.numpy as jnp

    import jax_fa4

    c = next(c for c in bench_masks.cases() if c.name == name)
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (c.b, c.sq, c.heads, c.hdim), jnp.bfloat16)
    k = jax.random.normal(ks[1], (c.b, c.sk, c.kv_heads, c.hdim), jnp.bfloat16)
    v = jax.random.normal(ks[2], (c.b, c.sk, c.kv_heads, c.hdim_v or c.hdim), jnp.bfloat16)
    if impl == "fa4":
        import torch

        if c.fa4 is None:
            raise SystemExit(f"case {name} has no flash-attn-4 peer")
        prep = bench_masks.prepare_fa4(c, q, k, v)
        for _ in range(steps):
            prep.fwd()
            prep.bwd()
        torch.cuda.synchronize()
        return
    # The mask arrays are arguments, as bench_masks.py times them.
    arrays, attn = bench_masks._with_arrays(c.ours, lambda q, k, v, **kw: jax_fa4.attention(
        q, k, v, implementation="cute", **kw))

    @jax.jit
    def step(q, k, v, do, *data):
        _, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, None, *data), q, k, v)
        return vjp(do)

    for _ in range(steps):
        jax.block_until_ready(step(q, k, v, jnp.ones(q.shape[:3] + v.shape[3:], q.dtype),
                                   *arrays.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=("jax_fa4", "fa4"), default="jax_fa4")
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--case", default="", help="a masked row of bench_masks.py instead")
    args = ap.parse_args()
    if args.case:
        print(f"profile_step: {args.impl} case {args.case}", flush=True)
        run_case(args.impl, args.case, args.warmup + 1)
        print("profile_step: done", flush=True)
        return
    d, s = args.hdim, args.seqlen
    b, h = TOKENS // s, HIDDEN // d
    print(f"profile_step: {args.impl} B={b} S={s} H={h} D={d} causal={args.causal}", flush=True)
    run = run_jax_fa4 if args.impl == "jax_fa4" else run_fa4
    run(b, s, h, d, args.causal, args.warmup + 1)
    print("profile_step: done", flush=True)


if __name__ == "__main__":
    main()
