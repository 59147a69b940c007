"""The reference path against a float64 naive attention (numpy), forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_err, rand_qkv

from jax_fa4 import reference


def naive64(q, k, v, scale, causal):
    """out, lse in float64 with numpy: the ground truth."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    k = np.repeat(k, g, axis=2)
    v = np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = np.where(np.arange(sk)[None, :] <= np.arange(sq)[:, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", p / l, v)
    return out, (m + np.log(l))[..., 0]


SHAPES = [(1, 1, 1, 1, 1), (2, 17, 17, 4, 2), (2, 113, 203, 4, 1), (1, 300, 77, 2, 2)]


@pytest.mark.parametrize("b,sq,sk,hq,hkv", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("threshold", [0.0, reference.LAZY_RESCALE_THRESHOLD])
def test_blockwise_matches_float64(b, sq, sk, hq, hkv, causal, threshold):
    q, k, v = rand_qkv(1, b, sq, sk, hq, hkv, 32, dtype=jnp.float32)
    # Spread the logits so the running max moves by more than the threshold.
    q = q * 3.0
    out, lse = reference.attention_blockwise(
        q, k, v, scale=0.3, causal=causal, block_k=64, rescale_threshold=threshold
    )
    ref_out, ref_lse = naive64(q, k, v, 0.3, causal)
    assert max_err(out, ref_out) < 2e-5
    assert max_err(lse, ref_lse) < 2e-5


def test_lazy_rescale_equals_eager():
    """Lazy rescaling (threshold 8) gives the same out and LSE as eager (threshold 0)."""
    q, k, v = rand_qkv(7, 2, 257, 1000, 4, 2, 64, dtype=jnp.float32)
    # Increasing key norms make the row max grow block after block.
    k = k * jnp.linspace(0.2, 4.0, 1000)[None, :, None, None]
    lazy = reference.attention_blockwise(q, k, v, scale=0.5, block_k=128, rescale_threshold=8.0)
    eager = reference.attention_blockwise(q, k, v, scale=0.5, block_k=128, rescale_threshold=0.0)
    ref_out, ref_lse = naive64(q, k, v, 0.5, False)
    for got in (lazy, eager):
        assert max_err(got[0], ref_out) < 1e-4
        assert max_err(got[1], ref_lse) < 1e-4
    assert max_err(lazy[0], eager[0]) < 1e-4


@pytest.mark.parametrize("causal", [False, True])
def test_dense_matches_float64(causal):
    q, k, v = rand_qkv(2, 2, 33, 47, 6, 3, 16, dtype=jnp.float32)
    out, lse = reference.attention_dense(q, k, v, scale=0.25, causal=causal)
    ref_out, ref_lse = naive64(q, k, v, 0.25, causal)
    assert max_err(out, ref_out) < 1e-5
    assert max_err(lse, ref_lse) < 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_backward_matches_autodiff_of_dense(causal):
    q, k, v = rand_qkv(3, 2, 45, 130, 4, 2, 16, dtype=jnp.float32)
    kd = jax.random.split(jax.random.key(9), 2)
    dout = jax.random.normal(kd[0], (2, 45, 4, 16))
    dlse = jax.random.normal(kd[1], (2, 4, 45))

    def f(q, k, v):
        return reference.attention_dense(q, k, v, scale=0.2, causal=causal)

    (out, lse), vjp = jax.vjp(f, q, k, v)
    want = vjp((dout, dlse))
    got = reference.attention_bwd_blockwise(
        q, k, v, out, lse, dout, dlse, scale=0.2, causal=causal, block_k=32
    )
    for g, w in zip(got, want):
        assert max_err(g, w) < 1e-4
