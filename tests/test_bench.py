"""CPU checks of the benchmark's JAX timing path (benchmarks/bench_attention.py)."""

from __future__ import annotations

import math
import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_attention as ba  # noqa: E402


@pytest.mark.parametrize("bwd_timing", ["diff", "direct"])
def test_bench_jax_times_forward_and_backward(bwd_timing):
    """Both backward timings give positive times and the fwd+bwd step's memory;
    "direct" times the pullback on saved residuals (a jitted function of the vjp
    closure), which must run as well as the whole step."""
    attn = ba.jax_impls({"xla"})["xla"]
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 64, 4, 32), jnp.bfloat16)
               for i in range(3))
    t_fwd, t_bwd, mem = ba.bench_jax("xla", attn, q, k, v, True, 2, bwd_timing)
    assert 0 < t_fwd < 10 and 0 < t_bwd < 10
    assert mem["temp_mib"] is None or (math.isfinite(mem["temp_mib"]) and mem["temp_mib"] > 0)


def test_flops_counts_causal_half_and_backward_2_5x():
    f = ba.flops(2, 4, 1024, 128, False, "fwd")
    assert f == 4 * 2 * 4 * 1024**2 * 128
    assert ba.flops(2, 4, 1024, 128, True, "fwd") == f / 2
    assert ba.flops(2, 4, 1024, 128, False, "bwd") == 2.5 * f


def test_det_peer_is_jax_fa4_with_a_deterministic_backward(monkeypatch):
    """--peers det adds jax_fa4 with deterministic=True, and only when asked."""
    import jax_fa4

    assert "jax_fa4_det" not in ba.jax_impls({"cudnn", "xla"})
    seen = {}
    monkeypatch.setattr(jax_fa4, "attention", lambda *a, **kw: seen.update(kw) or a[0])
    ba.jax_impls({"det"})["jax_fa4_det"](1, 2, 3, True)
    assert seen == {"causal": True, "implementation": "cute", "deterministic": True}



def test_cases_option_picks_rows():
    assert ba.parse_cases("128:4096:0,256:8192:1") == [(128, 4096, False), (256, 8192, True)]
    with pytest.raises(ValueError, match="hdim:seqlen:causal"):
        ba.parse_cases("128:4096")
    with pytest.raises(ValueError, match="hdim:seqlen:causal"):
        ba.parse_cases("128:4096:yes")
