"""Ring attention over shard_map on 8 CPU devices (the reference path per hop):
equal to single-device attention for out, lse and every gradient, causal or not,
contiguous or zigzag, with GQA; skipped hops leave no kernel call behind; the K/V
transfer of a hop is issued before its kernel call."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_err, rand_qkv
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_fa4
from jax_fa4 import reference

N = 8


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices("cpu")
    if len(devices) < N:
        pytest.skip(f"needs {N} CPU devices (XLA_FLAGS set in conftest before JAX starts)")
    return Mesh(np.array(devices[:N]), ("sp",))


def _ring_fn(mesh, causal, zigzag, return_lse=True, softcap=None):
    spec = P(None, "sp")

    def local(q, k, v):
        return jax_fa4.ring_attention(q, k, v, axis_name="sp", causal=causal,
                                      load_balance="zigzag" if zigzag else None,
                                      return_lse=return_lse, scale=0.3, softcap=softcap)

    out_specs = (spec, P(None, None, "sp")) if return_lse else spec
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=out_specs)


def _global(x, zigzag, axis=1):
    return jax_fa4.from_zigzag(x, N, axis) if zigzag else x


def _local(x, zigzag, axis=1):
    return jax_fa4.to_zigzag(x, N, axis) if zigzag else x


@pytest.mark.parametrize("causal,zigzag,softcap", [
    (False, False, None), (True, False, None), (False, True, None), (True, True, None),
    (True, True, 1.5)])
def test_ring_equals_single_device(mesh, causal, zigzag, softcap):
    b, s, hq, hkv, d = 2, 8 * 6, 4, 2, 16  # 6 positions per device: 2 chunks of 3
    q, k, v = rand_qkv(3 + causal + 2 * zigzag, b, s, s, hq, hkv, d, dtype=jnp.float32)
    if softcap is not None:
        q = 4.0 * q  # scores past the cap
    ring = jax.jit(_ring_fn(mesh, causal, zigzag, softcap=softcap))
    out, lse = ring(*(_local(x, zigzag) for x in (q, k, v)))
    out, lse = _global(out, zigzag), _global(lse, zigzag, axis=2)
    want_out, want_lse = reference.attention_dense(q, k, v, scale=0.3, causal=causal,
                                                   softcap=softcap)
    assert max_err(out, want_out) < 1e-5
    assert max_err(lse, want_lse) < 1e-5

    w = jnp.cos(jnp.arange(q.size, dtype=jnp.float32).reshape(q.shape))
    wl = jnp.sin(jnp.arange(b * hq * s, dtype=jnp.float32).reshape(b, hq, s))

    def loss_ring(q, k, v):
        o, l = _ring_fn(mesh, causal, zigzag, softcap=softcap)(q, k, v)
        return jnp.sum(o * _local(w, zigzag)) + jnp.sum(l * _local(wl, zigzag, axis=2))

    def loss_ref(q, k, v):
        o, l = reference.attention_dense(q, k, v, scale=0.3, causal=causal, softcap=softcap)
        return jnp.sum(o * w) + jnp.sum(l * wl)

    got = jax.jit(jax.grad(loss_ring, argnums=(0, 1, 2)))(*(_local(x, zigzag) for x in (q, k, v)))
    want = jax.grad(loss_ref, argnums=(0, 1, 2))(q, k, v)
    for name, g, h in zip(("dq", "dk", "dv"), got, want):
        assert max_err(_global(g, zigzag), h) < 2e-5, name


def test_output_only_gradient(mesh):
    """Without return_lse the LSE's cotangent is a symbolic zero."""
    q, k, v = rand_qkv(8, 1, 8 * 4, 8 * 4, 2, 2, 8, dtype=jnp.float32)
    ring = _ring_fn(mesh, True, True, return_lse=False)

    def loss_ring(q, k, v):
        return jnp.sum(ring(q, k, v) ** 2)

    got = jax.jit(jax.grad(loss_ring, argnums=(0, 1, 2)))(*(_local(x, True) for x in (q, k, v)))
    want = jax.grad(lambda q, k, v: jnp.sum(reference.attention_dense(
        q, k, v, scale=0.3, causal=True)[0] ** 2), argnums=(0, 1, 2))(q, k, v)
    for g, h in zip(got, want):
        assert max_err(_global(g, True), h) < 2e-5


def _count_binds(jaxpr, name, in_cond=False):
    """(top-level binds, binds inside a conditional) of primitive ``name``."""
    top = cond = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            if in_cond:
                cond += 1
            else:
                top += 1
        for sub in jax.core.jaxprs_in_params(eqn.params):
            t, c = _count_binds(sub, name, in_cond or eqn.primitive.name == "cond")
            top, cond = top + t, cond + c
    return top, cond


def _program_order(jaxpr):
    """Primitive names in program order, nested jaxprs inlined where they stand."""
    names = []
    for eqn in jaxpr.eqns:
        subs = list(jax.core.jaxprs_in_params(eqn.params))
        names.append(eqn.primitive.name)
        for sub in subs:
            names += _program_order(sub)
    return names


@pytest.mark.parametrize("zigzag", [False, True])
def test_causal_hops_and_transfer_order(mesh, zigzag):
    """Causal contiguous: one unconditional kernel call (the diagonal) and n - 1
    calls behind a conditional whose other branch has none (the skipped hops);
    zigzag: three diagonal calls and every other hop a conditional between two half
    calls. Non-causal: n calls, no conditional. Each hop's K/V ppermute comes before
    its kernel call in the program."""
    q = jax.ShapeDtypeStruct((1, 8 * 4, 2, 16), jnp.float32)
    for causal in (False, True):
        fn = _ring_fn(mesh, causal, zigzag)
        jaxpr = jax.make_jaxpr(fn)(q, q, q).jaxpr
        top, cond = _count_binds(jaxpr, "fa4_fwd")
        if not causal:
            assert (top, cond) == (N, 0)
        elif zigzag:
            assert (top, cond) == (3, 2 * (N - 1))
        else:
            assert (top, cond) == (1, N - 1)
    order = [n for n in _program_order(jax.make_jaxpr(_ring_fn(mesh, False, zigzag))(
        q, q, q).jaxpr) if n in ("ppermute", "fa4_fwd")]
    # hop 0: the transfer for hop 1 (two ppermutes, K and V) precede the first call.
    assert order[:3] == ["ppermute", "ppermute", "fa4_fwd"], order
    assert order.count("ppermute") == 2 * (N - 1)


def test_gradient_kernels_per_hop(mesh):
    """The backward calls the backward primitive once per non-skipped hop (no
    recomputation of the forward ring: no fa4_fwd in the backward)."""
    q = jax.ShapeDtypeStruct((1, 8 * 4, 2, 16), jnp.float32)
    fn = _ring_fn(mesh, False, False, return_lse=False)
    jaxpr = jax.make_jaxpr(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)),
                                    argnums=(0, 1, 2)))(q, q, q).jaxpr
    assert _count_binds(jaxpr, "fa4_bwd") == (N, 0)
    assert _count_binds(jaxpr, "fa4_fwd") == (N, 0)


def test_bad_arguments(mesh):
    q = jax.ShapeDtypeStruct((1, 8 * 3, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="even local sequence"):
        jax.eval_shape(_ring_fn(mesh, True, True), q, q, q)
    with pytest.raises(ValueError, match="load_balance"):
        jax.eval_shape(jax.shard_map(functools.partial(
            jax_fa4.ring_attention, axis_name="sp", load_balance="spiral"), mesh=mesh,
            in_specs=P(None, "sp"), out_specs=P(None, "sp")), q, q, q)
    with pytest.raises(ValueError, match="2 x 8 chunks"):
        jax_fa4.to_zigzag(jnp.zeros((1, 24)), N)


def test_zigzag_layout_round_trip():
    x = jnp.arange(2 * 32).reshape(2, 32)
    z = jax_fa4.to_zigzag(x, 4)
    # device 0 holds chunks 0 and 7, device 1 chunks 1 and 6 (chunks of 4).
    assert z[0, :8].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    assert z[0, 8:16].tolist() == [4, 5, 6, 7, 24, 25, 26, 27]
    assert (jax_fa4.from_zigzag(z, 4) == x).all()


def test_compiled_ring_moves_blocks_by_permutes_only(mesh):
    """The compiled step has no all-gather; the forward sends K / V n - 1 times, the
    backward sends them again (the other way round, so XLA does not merge them with
    the forward's and keep every block alive) plus dK / dV n times."""
    q = jax.ShapeDtypeStruct((1, 8 * 4, 2, 16), jnp.float32)
    fn = _ring_fn(mesh, True, True, return_lse=False)
    text = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))).lower(
        q, q, q).compile().as_text()
    assert "all-gather" not in text and "all-reduce" not in text
    permutes = text.count("collective-permute(") + text.count("collective-permute-start(")
    assert permutes == 2 * (N - 1) + 2 * (N - 1) + 2 * N, permutes


def test_ring_with_sinks(mesh):
    """Sinks join the ring's LSE merge once: out, lse and every gradient, d sinks
    (summed over the ring) included, equal one device's."""
    b, s, hq, hkv, d = 2, 8 * 6, 4, 2, 16
    q, k, v = rand_qkv(11, b, s, s, hq, hkv, d, dtype=jnp.float32)
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0], jnp.float32)
    spec = P(None, "sp")

    def ring(q, k, v, sinks):
        return jax.shard_map(
            lambda q, k, v, sinks: jax_fa4.ring_attention(
                q, k, v, axis_name="sp", causal=True, load_balance="zigzag", scale=0.3,
                sinks=sinks, return_lse=True),
            mesh=mesh, in_specs=(spec, spec, spec, P()),
            out_specs=(spec, P(None, None, "sp")))(q, k, v, sinks)

    def dense(q, k, v, sinks):
        return reference.attention_dense(q, k, v, scale=0.3, causal=True,
                                         sinks=jnp.broadcast_to(sinks, (b, hq)))

    w = jnp.cos(jnp.arange(q.size, dtype=jnp.float32).reshape(q.shape))
    wl = jnp.sin(jnp.arange(b * hq * s, dtype=jnp.float32).reshape(b, hq, s))
    local = [_local(x, True) for x in (q, k, v)]
    out, lse = jax.jit(ring)(*local, sinks)
    want_out, want_lse = dense(q, k, v, sinks)
    assert max_err(_global(out, True), want_out) < 1e-5
    assert max_err(_global(lse, True, axis=2), want_lse) < 1e-5

    def loss_ring(q, k, v, sinks):
        o, l = ring(q, k, v, sinks)
        return jnp.sum(o * _local(w, True)) + jnp.sum(l * _local(wl, True, axis=2))

    def loss_ref(q, k, v, sinks):
        o, l = dense(q, k, v, sinks)
        return jnp.sum(o * w) + jnp.sum(l * wl)

    got = jax.jit(jax.grad(loss_ring, argnums=(0, 1, 2, 3)))(*local, sinks)
    want = jax.grad(loss_ref, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for name, g, h in zip(("dq", "dk", "dv"), got[:3], want[:3]):
        assert max_err(_global(g, True), h) < 2e-5, name
    assert max_err(got[3], want[3]) < 1e-4 and float(jnp.max(jnp.abs(want[3]))) > 1e-2
