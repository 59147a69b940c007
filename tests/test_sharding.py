"""Sharding: jax_fa4 inside shard_map's per-device code, and under jit with batch- or
head-sharded inputs (ring attention over sequence shards: test_ring.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_err, rand_qkv
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_fa4
from jax_fa4 import reference

SCALE = 0.25


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip("needs 4 CPU devices (XLA_FLAGS set in conftest before JAX starts)")
    return Mesh(np.array(devices[:4]), ("x",))


def test_batch_sharded_forward_and_grad(mesh):
    q, k, v = rand_qkv(0, 8, 21, 21, 4, 2, 16, dtype=jnp.float32)

    def local(q, k, v):
        return jax_fa4.attention(q, k, v, scale=SCALE, causal=True)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x"))
    out = jax.jit(sharded)(q, k, v)
    assert max_err(out, reference.attention_dense(q, k, v, scale=SCALE, causal=True)[0]) < 1e-5

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))

    got = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(
        loss(lambda q, k, v: reference.attention_dense(q, k, v, scale=SCALE, causal=True)[0]),
        argnums=(0, 1, 2),
    )(q, k, v)
    for g, w in zip(got, want):
        assert max_err(g, w) < 1e-4


@pytest.mark.parametrize("spec", [P("x"), P(None, None, "x"), P(("x",), None, None, None)])
def test_jit_with_sharded_inputs_runs_per_device(mesh, spec):
    """Batch- or head-sharded inputs stay sharded: no all-gather, same values."""
    from jax.sharding import NamedSharding

    q, k, v = rand_qkv(2, 4, 16, 16, 8, 4, 16, dtype=jnp.float32)
    sh = NamedSharding(mesh, spec)
    q, k, v = (jax.device_put(x, sh) for x in (q, k, v))

    def loss(q, k, v):
        out, lse = jax_fa4.attention(q, k, v, scale=SCALE, causal=True, return_lse=True)
        return jnp.sum(out**2) + jnp.sum(lse)

    fwd = jax.jit(lambda q, k, v: jax_fa4.attention(q, k, v, scale=SCALE, causal=True))
    out = fwd(q, k, v)
    assert out.sharding.is_equivalent_to(sh, 4)
    hlo = fwd.lower(q, k, v).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    want = reference.attention_dense(q, k, v, scale=SCALE, causal=True)[0]
    assert max_err(out, want) < 1e-5

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    hlo = grad.lower(q, k, v).compile().as_text()
    assert "all-gather" not in hlo
    got = grad(q, k, v)
    ref_loss = lambda q, k, v: jnp.sum(  # noqa: E731
        reference.attention_dense(q, k, v, scale=SCALE, causal=True)[0] ** 2
    ) + jnp.sum(reference.attention_dense(q, k, v, scale=SCALE, causal=True)[1])
    for g, w in zip(got, jax.grad(ref_loss, argnums=(0, 1, 2))(q, k, v)):
        assert max_err(g, w) < 1e-4


def test_sequence_sharded_inputs_raise_and_name_ring_attention(mesh):
    """Under plain jit a sequence-sharded q / k / v would be gathered onto every
    device and every query computed everywhere: it raises instead, naming the
    shard_map route."""
    from jax.sharding import NamedSharding

    q, k, v = rand_qkv(3, 2, 16, 16, 2, 2, 16, dtype=jnp.float32)
    sh = NamedSharding(mesh, P(None, "x"))
    q, k, v = (jax.device_put(x, sh) for x in (q, k, v))
    # XLA's partitioner reports the rule's ValueError as a runtime error with its text.
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match="ring_attention"):
        jax.jit(lambda q, k, v: jax_fa4.attention(q, k, v, scale=SCALE, causal=True))(q, k, v)


@pytest.mark.parametrize("spec", [P("x"), P(None, None, "x")])
def test_masks_shard_with_the_batch(mesh, spec):
    """Lengths and segment ids follow the batch sharding of q / k / v (replicated
    under a head sharding): no all-gather, the values and gradients of one device."""
    from jax.sharding import NamedSharding

    q, k, v = rand_qkv(4, 4, 16, 16, 8, 4, 16, dtype=jnp.float32)
    kl = jnp.asarray([16, 3, 0, 9], jnp.int32)
    seg = jnp.asarray([[0] * 5 + [1] * 11, [2] * 16, [0] * 16, [1] * 8 + [2] * 8], jnp.int32)
    sh = NamedSharding(mesh, spec)
    batch = NamedSharding(mesh, P(spec[0]))
    args = [jax.device_put(x, sh) for x in (q, k, v)]
    args += [jax.device_put(kl, batch), jax.device_put(seg, NamedSharding(mesh, P(spec[0], None)))]

    def loss(q, k, v, kl, seg):
        out, lse = jax_fa4.attention(q, k, v, scale=SCALE, causal=True, kv_lengths=kl,
                                     q_segment_ids=seg, return_lse=True)
        return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    hlo = grad.lower(*args).compile().as_text()
    assert "all-gather" not in hlo
    got = grad(*args)
    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, kl, seg)
    for g, w in zip(got, want):
        assert g.sharding.is_equivalent_to(sh, 4)
        assert max_err(g, w) < 1e-5


@pytest.mark.parametrize("spec", [P("x"), P(None, None, "x")])
def test_paged_decode_shards_with_the_batch_or_heads(mesh, spec):
    """A paged call under jit: queries, page tables and lengths split with the batch
    while every device keeps the whole pools (each sequence's pages may be anywhere
    in them), or the pools split with the heads; no all-gather, the unsharded
    call's values."""
    from jax.sharding import NamedSharding

    rng = np.random.default_rng(6)
    pages, page_size, hkv, d = 12, 8, 4, 16
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((pages, page_size, hkv, d)), jnp.float32)
                      for _ in range(2))
    table = jnp.asarray(rng.permutation(pages)[:8].reshape(4, 2), jnp.int32)
    lengths = jnp.asarray([16, 3, 0, 9], jnp.int32)
    q = jnp.asarray(rng.standard_normal((4, 1, 8, d)), jnp.float32)
    batch, heads = spec[0], spec[2] if len(spec) > 2 else None
    args = (jax.device_put(q, NamedSharding(mesh, spec)),
            jax.device_put(k_pool, NamedSharding(mesh, P(None, None, heads))),
            jax.device_put(v_pool, NamedSharding(mesh, P(None, None, heads))),
            jax.device_put(table, NamedSharding(mesh, P(batch))),
            jax.device_put(lengths, NamedSharding(mesh, P(batch))))

    def attend(q, kp, vp, t, n):
        return jax_fa4.attention(q, kp, vp, page_table=t, kv_lengths=n, scale=SCALE,
                                 causal="bottom_right")

    fn = jax.jit(attend)
    hlo = fn.lower(*args).compile().as_text()
    assert "all-gather" not in hlo
    out = fn(*args)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
    assert max_err(out, attend(q, k_pool, v_pool, table, lengths)) < 1e-6
