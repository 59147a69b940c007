"""The forward through jax_fa4.attention against the same kernel called alone
(gpu_check_fwd.fwd_call), alternating rounds in one process, both timed by
gpu_check_fwd.bench and by bench_attention.time_calls: separates the API path's
cost from the timing method's. Usage: python scripts/api_vs_kernel.py B,S,H [rounds]."""

from __future__ import annotations

import os
import statistics
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [here, os.path.join(here, ".."), os.path.join(here, "..", "benchmarks")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_attention import time_calls  # noqa: E402
from gpu_check_fwd import bench, fwd_call  # noqa: E402

import jax_fa4  # noqa: E402


def main():
    b, s, h = (int(x) for x in sys.argv[1].split(","))
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    d, dtype = 128, jnp.bfloat16
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(dtype) for kk in keys)
    for causal in (False, True):
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        kern = fwd_call(dtype, d, causal, (b, s, s, h, h), poison=False)
        api = jax.jit(lambda q, k, v, c=causal: jax_fa4.attention(q, k, v, causal=c,
                                                                  implementation="cute"))
        res = {n: [] for n in ("kernel/bench", "api/bench", "kernel/time_calls", "api/time_calls")}
        for _ in range(rounds):
            res["kernel/bench"].append(bench(kern, (q, k, v)))
            res["api/bench"].append(bench(api, (q, k, v)))
            res["kernel/time_calls"].append(
                time_calls(lambda f=kern: f(q, k, v), jax.block_until_ready, 20))
            res["api/time_calls"].append(
                time_calls(lambda f=api: f(q, k, v), jax.block_until_ready, 20))
        for n, t in res.items():
            m = statistics.median(t)
            print(f"causal={causal} {n:18s} {flops / m / 1e12:7.1f} TF/s "
                  f"range {(max(t) - min(t)) / m * 100:4.1f}%")


if __name__ == "__main__":
    main()
