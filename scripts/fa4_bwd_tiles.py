"""flash-attn-4's sm90 backward at another query tile, to learn what its tile choice
is worth (hdim 128, bf16, B=4, S=4096, H=16, non-causal by default).

flash-attn-4 picks 80-row query tiles for the non-causal hdim 128 backward and 64
for causal; jax_fa4 uses 64 for both. This times flash-attn-4's own backward with its
tile table and with the query tile overridden (its `_tile_size_bwd_sm90`, patched in
this process only), in one process, the backward alone on one saved forward.

    python scripts/fa4_bwd_tiles.py [--tile-m 64,80] [--causal] [--iters 20]
"""

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tile-m", default="80,64")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shape", default="4,4096,16,128", help="B,S,H,D")
    args = ap.parse_args()

    import flash_attn.cute.interface as fi
    import torch
    from bench_attention import import_fa4_func, time_calls

    b, s, h, d = (int(x) for x in args.shape.split(","))
    flops = 2.5 * 4 * b * h * s * s * d / (2 if args.causal else 1)
    fwd_fn = import_fa4_func()
    original = fi._tile_size_bwd_sm90
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
               for _ in range(3))
    sync = lambda _: torch.cuda.synchronize()
    for tile_m in (int(x) for x in args.tile_m.split(",")):
        def patched(*a, tile_m=tile_m, **kw):
            cfg = original(*a, **kw)
            return dataclasses.replace(cfg, m_block_size=tile_m, dQ_swapAB=tile_m % 64 != 0)
        fi._tile_size_bwd_sm90 = patched
        out = fwd_fn(q, k, v, causal=args.causal)
        out = out[0] if isinstance(out, tuple) else out
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        t = time_calls(lambda out=out, dout=dout: torch.autograd.grad(
            out, (q, k, v), dout, retain_graph=True), sync, args.iters)
        print(f"flash-attn-4 bwd tile_m={tile_m} causal={args.causal}: {t * 1e3:.3f} ms "
              f"{flops / t / 1e12:.0f} TF/s (cfg {patched(d, d, args.causal, False)})",
              flush=True)
        del grads, out
    fi._tile_size_bwd_sm90 = original


if __name__ == "__main__":
    main()
