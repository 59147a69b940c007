"""Transformations through the primitives (reference lowering on CPU): jit, grad,
vmap on several axes, vmap(grad), grad of jit, check_grads, the LSE gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import max_err, rand_qkv
from jax.test_util import check_grads

import jax_fa4
from jax_fa4 import reference

SCALE = 0.3


def ref(q, k, v, causal):
    return reference.attention_dense(q, k, v, scale=SCALE, causal=causal)


def fa4(q, k, v, causal):
    return jax_fa4.attention(q, k, v, scale=SCALE, causal=causal, return_lse=True)


def loss(fn, causal):
    def f(q, k, v):
        out, lse = fn(q, k, v, causal)
        w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
        return jnp.sum(out * w) + jnp.sum(jnp.sin(lse))

    return f


@pytest.mark.parametrize("causal", [False, True])
def test_jit_and_grad_with_lse(causal):
    q, k, v = rand_qkv(0, 2, 19, 23, 4, 2, 16, dtype=jnp.float32)
    out, lse = jax.jit(fa4, static_argnums=3)(q, k, v, causal)
    r_out, r_lse = ref(q, k, v, causal)
    assert max_err(out, r_out) < 1e-5 and max_err(lse, r_lse) < 1e-5
    got = jax.grad(loss(fa4, causal), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(ref, causal), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        assert max_err(g, w) < 1e-4
    # grad of jit and jit of grad agree.
    got_j = jax.grad(jax.jit(loss(fa4, causal)), argnums=(0, 1, 2))(q, k, v)
    got_jj = jax.jit(jax.grad(loss(fa4, causal), argnums=(0, 1, 2)))(q, k, v)
    for a, b, w in zip(got_j, got_jj, want):
        assert max_err(a, w) < 1e-4 and max_err(b, w) < 1e-4


def test_lse_only_gradient():
    """Gradient through the LSE output alone (the cotangent cuDNN drops)."""
    q, k, v = rand_qkv(1, 1, 12, 12, 2, 2, 8, dtype=jnp.float32)

    def f(fn):
        return lambda q, k: jnp.sum(fn(q, k, v, False)[1] ** 2)

    got = jax.grad(f(fa4), argnums=(0, 1))(q, k)
    want = jax.grad(f(ref), argnums=(0, 1))(q, k)
    assert max(max_err(g, w) for g, w in zip(got, want)) < 1e-4
    assert float(jnp.abs(got[0]).max()) > 1e-3  # a non-trivial gradient


def _bwd_operand_counts(fn, *args):
    """Operand counts of every fa4_bwd in the jaxpr of fn(*args)."""
    counts = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "fa4_bwd":
                counts.append(len(eqn.invars))
            for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
                walk(sub)
            for p in eqn.params.values():
                if hasattr(p, "jaxpr") and hasattr(p.jaxpr, "eqns"):
                    walk(p.jaxpr)
                elif hasattr(p, "eqns"):
                    walk(p)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return counts


@pytest.mark.parametrize("causal", [False, True])
def test_output_only_gradient_has_no_lse_cotangent(causal):
    """Without return_lse the LSE's cotangent is a symbolic zero: fa4_bwd gets no
    dlse operand (6, not 7: no zero-filled (B, H, Sq) array), and the gradients
    still match the reference's, also under vmap. A loss that uses the LSE passes
    its cotangent (7 operands)."""
    q, k, v = rand_qkv(3, 2, 19, 23, 4, 2, 16, dtype=jnp.float32)
    w = jnp.cos(jnp.arange(q.size, dtype=jnp.float32).reshape(q.shape))

    def out_loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    fa4_out = lambda q, k, v: jax_fa4.attention(q, k, v, scale=SCALE, causal=causal)  # noqa: E731
    ref_out = lambda q, k, v: ref(q, k, v, causal)[0]  # noqa: E731
    grad = jax.grad(out_loss(fa4_out), argnums=(0, 1, 2))
    assert _bwd_operand_counts(grad, q, k, v) == [6]
    assert _bwd_operand_counts(jax.grad(loss(fa4, causal), argnums=(0, 1, 2)), q, k, v) == [7]
    want = jax.grad(out_loss(ref_out), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(jax.jit(grad)(q, k, v), want):
        assert max_err(g, r) < 1e-4
    assert float(jnp.abs(want[0]).max()) > 1e-3  # a non-trivial gradient
    qs = jnp.stack([q, q[:, ::-1]])
    got = jax.vmap(grad, in_axes=(0, None, None))(qs, k, v)
    for i in range(2):
        want_i = jax.grad(out_loss(ref_out), argnums=(0, 1, 2))(qs[i], k, v)
        for g, r in zip(got, want_i):
            assert max_err(g[i], r) < 1e-4


@pytest.mark.parametrize("causal", [False, True])
def test_check_grads(causal):
    q, k, v = rand_qkv(2, 1, 6, 7, 2, 1, 4, dtype=jnp.float32)
    f = lambda q, k, v: fa4(q, k, v, causal)  # noqa: E731
    check_grads(f, (q, k, v), order=1, modes=("rev",), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "in_axes",
    [(0, 0, 0), (1, 1, 1), (2, None, None), (None, 3, 3), (4, 0, None)],
)
def test_vmap_axes(in_axes):
    n = 3
    base = rand_qkv(3, 2, 10, 14, 4, 2, 8, dtype=jnp.float32)
    keys = jax.random.split(jax.random.key(5), 3)
    args = []
    for x, ax, kk in zip(base, in_axes, keys):
        if ax is None:
            args.append(x)
        else:
            stacked = x[None] + 0.1 * jax.random.normal(kk, (n,) + x.shape)
            args.append(jnp.moveaxis(stacked, 0, ax))
    f = lambda q, k, v: fa4(q, k, v, True)  # noqa: E731
    out, lse = jax.vmap(f, in_axes=in_axes)(*args)
    for i in range(n):
        sl = [a if ax is None else jnp.take(a, i, axis=ax) for a, ax in zip(args, in_axes)]
        r_out, r_lse = ref(*sl, True)
        assert max_err(out[i], r_out) < 1e-5 and max_err(lse[i], r_lse) < 1e-5


def test_nested_vmap():
    q, k, v = rand_qkv(4, 2, 9, 9, 2, 2, 8, dtype=jnp.float32)
    qs = jnp.stack([jnp.stack([q * (1 + i + j) for j in range(2)]) for i in range(3)])
    f = jax.vmap(jax.vmap(lambda q: fa4(q, k, v, False)[0]))
    out = f(qs)
    assert out.shape == (3, 2) + q.shape
    assert max_err(out[2, 1], ref(q * 4, k, v, False)[0]) < 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_vmap_of_grad_matches_reference(causal):
    """vmap(grad) with batch > 1 and vmapped size > 1: no permuted gradients."""
    n = 3
    qs, ks, vs = (
        jnp.stack([x * (1.0 + 0.3 * i) for i in range(n)])
        for x in rand_qkv(6, 2, 11, 13, 4, 2, 8, dtype=jnp.float32)
    )
    got = jax.vmap(jax.grad(loss(fa4, causal), argnums=(0, 1, 2)))(qs, ks, vs)
    for i in range(n):
        want = jax.grad(loss(ref, causal), argnums=(0, 1, 2))(qs[i], ks[i], vs[i])
        for g, w in zip(got, want):
            assert max_err(g[i], w) < 1e-4


def test_vmap_grad_unbatched_kv():
    q, k, v = rand_qkv(8, 2, 7, 9, 2, 1, 8, dtype=jnp.float32)
    qs = jnp.stack([q, 2 * q])
    g = jax.vmap(jax.grad(loss(fa4, False), argnums=(0, 1, 2)), in_axes=(0, None, None))
    dq, dk, dv = g(qs, k, v)
    want = jax.grad(loss(ref, False), argnums=(0, 1, 2))(2 * q, k, v)
    assert max_err(dq[1], want[0]) < 1e-4
    assert max_err(dk[1], want[1]) < 1e-4 and max_err(dv[1], want[2]) < 1e-4
