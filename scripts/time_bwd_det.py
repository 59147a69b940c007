"""Time the deterministic sm90 backward against the default one (GPU machine).

Both go through `rules.kernels_cuda.backward` (preprocess, main kernel, postprocess)
on the benchmark's rows (16k tokens, hidden 2048; hdim 128 at 4k, hdim 64 at 8k;
causal and not), on residuals of one forward computed once. Each row's two variants
are timed in the same process, alternately, median of 7 x 20 calls. Prints TFLOP/s
(backward FLOPs = 2.5 x forward) and the deterministic / default ratio.

    python scripts/time_bwd_det.py [--rows 128:4096,64:8192]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from gpu_check_bwd import bench  # noqa: E402  (median of 7 x 20 calls)

from jax_fa4.config import AttentionConfig  # noqa: E402
from jax_fa4.rules import kernels_cuda  # noqa: E402

TOKENS, HIDDEN = 16384, 2048


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="128:4096,64:8192", help="hdim:seqlen,...")
    args = ap.parse_args()
    for row in args.rows.split(","):
        d, s = (int(x) for x in row.split(":"))
        b, h = TOKENS // s, HIDDEN // d
        ks = jax.random.split(jax.random.key(3), 4)
        q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks)
        for causal in (False, True):
            cfg = AttentionConfig(scale=d**-0.5, causal=causal)
            out, lse = jax.jit(lambda q, k, v, cfg=cfg: kernels_cuda.forward(
                q, k, v, config=cfg, arch="sm_90a"))(q, k, v)
            dlse = jnp.zeros_like(lse)
            fns = {det: jax.jit(lambda q, k, v, o, l, do, dl, det=det, cfg=cfg:
                                kernels_cuda.backward(q, k, v, o, l, do, dl, arch="sm_90a",
                                                      config=dataclasses.replace(
                                                          cfg, deterministic=det)))
                   for det in (False, True)}
            flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
            times = {False: [], True: []}
            for _ in range(2):  # alternate, so drift hits both alike
                for det in (False, True):
                    times[det].append(bench(fns[det], (q, k, v, out, lse, do, dlse)))
            t = {det: min(ts) for det, ts in times.items()}
            print(f"d{d} S{s} causal={int(causal)}: default {flops / t[False] / 1e12:.0f} TF/s, "
                  f"deterministic {flops / t[True] / 1e12:.0f} TF/s, "
                  f"ratio {t[False] / t[True]:.3f}", flush=True)


if __name__ == "__main__":
    main()
