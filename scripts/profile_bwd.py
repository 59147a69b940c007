"""One backward step of jax_fa4 or of flash-attn-4 (PyTorch), for Nsight Compute.

Runs the forward once and the backward once (after one untimed warm-up step that
compiles), so an `ncu` run filtered on backward kernel names sees exactly one
launch of each backward kernel of the step: the preprocess, the main kernel and
the postprocess.

    ncu --set full --kernel-name 'regex:(?i)bwd|backward' --launch-skip-before-match 0 \
        -o $OUT/ours python scripts/profile_bwd.py --impl jax_fa4 --hdim 128 --seqlen 4096
    ncu ... python scripts/profile_bwd.py --impl fa4 ...

The warm-up launches are profiled too unless `--launch-skip` skips them: the script
prints how many backward kernels one step launches.
"""

import argparse
import math
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOKENS, HIDDEN = 16384, 2048


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("jax_fa4", "fa4"), default="jax_fa4")
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    d, s = args.hdim, args.seqlen
    b, h = TOKENS // s, HIDDEN // d
    print(f"profile_bwd: {args.impl} B={b} S={s} H={h} D={d} causal={args.causal}", flush=True)
    if args.impl == "jax_fa4":
        import jax
        import jax.numpy as jnp

        import jax_fa4

        ks = jax.random.split(jax.random.PRNGKey(0), 4)
        q, k, v, do = [jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks]

        @jax.jit
        def step(q, k, v, do):
            out, vjp = jax.vjp(lambda q, k, v: jax_fa4.attention(
                q, k, v, causal=args.causal, implementation="cute"), q, k, v)
            return vjp(do)

        for _ in range(args.warmup + 1):
            jax.block_until_ready(step(q, k, v, do))
    else:
        import torch

        try:
            from flash_attn.cute import flash_attn_func
        except ImportError:
            from flash_attn.cute.interface import flash_attn_func
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                       for _ in range(4)]
        for t in (q, k, v):
            t.requires_grad_(True)
        for _ in range(args.warmup + 1):
            out = flash_attn_func(q, k, v, causal=args.causal,
                                  softmax_scale=1.0 / math.sqrt(d))
            out = out[0] if isinstance(out, tuple) else out
            out.backward(do)
        torch.cuda.synchronize()
    print("profile_bwd: done", flush=True)


if __name__ == "__main__":
    main()
