"""softcap through the public API on the reference path: each scaled logit s
becomes c * tanh(s / c). The forward against a float64 numpy ground truth written
from that formula, composed with masks of test_masks.py that bound each side (rows
that see no key included); the gradients against autodiff of the dense path and against finite
differences; argument errors; and the kernels' refusal, which names softcap."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_err, rand_qkv, weighted_loss
from test_masks import CASES, SIDES, _jnp, _vis, dense_with, naive64

import jax_fa4
from jax_fa4.rules.primitives import KernelUnavailableError

B, SQ, SK, HQ, HKV, D = 3, 37, 45, 4, 2, 16
SCALE, CAP = 0.9, 2.5  # logits up to ~10: the cap bends them


def _attn(kw, cap=CAP):
    return lambda q, k, v: jax_fa4.attention(q, k, v, scale=SCALE, softcap=cap,
                                             return_lse=True, **_jnp(kw))


def _loss(fn, shape_out, shape_lse):
    return weighted_loss(fn, shape_out, shape_lse)


@pytest.mark.parametrize("name", SIDES)
def test_softcap_forward_and_gradients(name):
    kw = CASES[name]
    q, k, v = rand_qkv(len(name) + 40, B, SQ, SK, HQ, HKV, D, dtype=jnp.float32)
    q = q * 3.0  # scaled logits well past the cap, where tanh bends
    vis = _vis(kw)
    out, lse = jax.jit(_attn(kw))(q, k, v)
    want_out, want_lse = naive64(q, k, v, SCALE, vis, softcap=CAP)
    assert max_err(out, want_out) < 1e-5
    empty = ~vis.any(-1)
    lse_np = np.asarray(lse)
    assert np.array_equal(np.isneginf(lse_np), np.broadcast_to(empty[:, None], lse_np.shape))
    fin = np.isfinite(want_lse)
    assert np.max(np.abs(lse_np[fin] - want_lse[fin])) < 1e-5
    # Not the uncapped result: the cap changed the answer.
    plain, _ = jax_fa4.attention(q, k, v, scale=SCALE, return_lse=True, **_jnp(kw))
    assert max_err(plain, want_out) > 1e-2

    loss = functools.partial(_loss, shape_out=out.shape, shape_lse=lse.shape)
    got = jax.jit(jax.grad(loss(_attn(kw)), argnums=(0, 1, 2)))(q, k, v)

    dense = dense_with(kw, SCALE, softcap=CAP)
    want = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v)
    for n, g, h in zip(("dq", "dk", "dv"), got, want):
        assert np.all(np.isfinite(np.asarray(g))), n
        assert max_err(g, h) < 5e-5 * max(1.0, float(jnp.max(jnp.abs(h)))), n
    if empty.any():  # rows that see nothing get no gradient
        dq = np.asarray(got[0])
        assert not np.any(dq[np.broadcast_to(empty[:, :, None, None], dq.shape)])


def test_softcap_gradients_match_finite_differences():
    """The hand-written blockwise backward (its dS takes the cap's derivative)
    against central differences of the forward along random directions. The
    reference computes in float32: a step of 1e-2 keeps the rounding of the loss
    and the truncation both near 1e-4, while a dS without the cap's derivative is
    off by its whole size."""
    q, k, v = rand_qkv(3, 1, 9, 13, 2, 1, 8, dtype=jnp.float32)
    q = q * 3.0
    kw = dict(causal=True, window=(6, None))
    f = jax.jit(_loss(_attn(kw), (1, 9, 2, 8), (1, 2, 9)))
    got = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
    eps = 1e-2
    rng = np.random.default_rng(0)
    for i, x in enumerate((q, k, v)):
        for _ in range(3):
            d = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
            d = d / jnp.linalg.norm(d)
            args = [q, k, v]
            args[i] = x + eps * d
            up = f(*args)
            args[i] = x - eps * d
            fd = float((up - f(*args)) / (2 * eps))
            assert abs(float(jnp.vdot(got[i], d)) - fd) < 2e-3 * max(1.0, abs(fd)), (i, fd)


def test_softcap_composes_with_vmap_and_deterministic():
    q, k, v = rand_qkv(5, B, SQ, SK, HQ, HKV, D, dtype=jnp.float32)
    kw = dict(causal=True, kv_lengths=np.array([45, 20, 0], np.int32))
    one = jax.vmap(lambda q, k, v: _attn(kw)(q, k, v))(q[None], k[None], v[None])
    out, lse = _attn(kw)(q, k, v)
    assert np.array_equal(np.asarray(one[0][0]), np.asarray(out))
    assert np.array_equal(np.asarray(one[1][0]), np.asarray(lse))  # -inf rows included
    f = _loss(lambda q, k, v: jax_fa4.attention(q, k, v, scale=SCALE, softcap=CAP,
                                                deterministic=True, return_lse=True,
                                                **_jnp(kw)), out.shape, lse.shape)
    g = _loss(_attn(kw), out.shape, lse.shape)
    for a, b_ in zip(jax.grad(f, argnums=(0, 1, 2))(q, k, v),
                     jax.grad(g, argnums=(0, 1, 2))(q, k, v)):
        assert np.array_equal(np.asarray(a), np.asarray(b_))


@pytest.mark.parametrize("cap,err", [
    (0.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
    ("30", TypeError), (True, TypeError), (jnp.float32(30.0), TypeError),
])
def test_bad_softcap_raises(cap, err):
    q, k, v = rand_qkv(1, 1, 8, 8, 2, 2, 16, dtype=jnp.float32)
    with pytest.raises(err, match="softcap"):
        jax_fa4.attention(q, k, v, softcap=cap)


def test_traced_softcap_raises():
    q, k, v = rand_qkv(1, 1, 8, 8, 2, 2, 16, dtype=jnp.float32)
    with pytest.raises(TypeError, match="softcap must be a static"):
        jax.jit(lambda c: jax_fa4.attention(q, k, v, softcap=c))(30.0)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_kernels_refuse_softcap_by_name(monkeypatch, caplog, arch):
    """No kernel takes softcap yet: lowered for a GPU, the default logs the reference
    path and names softcap; implementation="cute" raises."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("JAX_FA4_ARCH", arch)
    q, k, v = (jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16),) * 3

    def lower(implementation):
        fn = jax.jit(jax.grad(lambda q, k, v: jax_fa4.attention(
            q, k, v, softcap=30.0, implementation=implementation).astype(jnp.float32).sum()))
        return fn.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()

    with caplog.at_level("WARNING", logger="jax_fa4"):
        text = lower(None)
    assert f"no {arch} kernel takes softcap" in caplog.text
    # The reference path: plain HLO (tests/test_lowering.py: the same shapes without
    # softcap lower to the kernels' custom calls).
    assert "CuteDSLRT_NvJaxCutlassCall" not in text
    with pytest.raises(KernelUnavailableError, match=f"no {arch} kernel takes softcap"):
        lower("cute")
