"""Learnable sinks through the public API on the reference path: one logit per query
head joins every row's softmax denominator. The forward against a float64 numpy
ground truth written from the formula, with masks of test_masks.py that bound each
side (rows that see no key give out 0 and lse = sink); all gradients, d sinks included, against
autodiff of the dense path and against finite differences; vmap, softcap, the
batch / head sharding rule; argument errors; the forward kernels' refusal."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_err, rand_qkv, weighted_loss
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_masks import CASES, SIDES, _jnp, _vis, dense_with

import jax_fa4

B, SQ, SK, HQ, HKV, D = 3, 37, 45, 4, 2, 16
SCALE = 0.4
SINKS = jnp.array([0.5, -2.0, 3.0, 1.0], jnp.float32)  # one far above the scores


def with_sinks64(q, k, v, scale, sinks, vis):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    e = np.exp(np.einsum("bqhd,bkhd->bhqk", q, k) * scale) * vis[:, None]
    denom = np.exp(np.asarray(sinks, np.float64))[None, :, None] + e.sum(-1)
    out = np.einsum("bhqk,bkhd->bqhd", e / denom[..., None], v)
    return out, np.log(denom)


def _attn(kw, **more):
    return lambda q, k, v, s: jax_fa4.attention(q, k, v, scale=SCALE, sinks=s,
                                                return_lse=True, **_jnp(kw), **more)


def _dense(kw, **more):
    f = dense_with(kw, SCALE, **more)
    return lambda q, k, v, s: f(q, k, v, sinks=jnp.broadcast_to(s, (q.shape[0], s.shape[0])))


def _loss(fn, b=B, sq=SQ, hq=HQ, dv=D):
    return weighted_loss(fn, (b, sq, hq, dv), (b, hq, sq))


@pytest.mark.parametrize("name", SIDES)
def test_sinks_forward_and_gradients(name):
    kw = CASES[name]
    q, k, v = rand_qkv(len(name) + 70, B, SQ, SK, HQ, HKV, D, dtype=jnp.float32)
    vis = _vis(kw)
    out, lse = jax.jit(_attn(kw))(q, k, v, SINKS)
    want_out, want_lse = with_sinks64(q, k, v, SCALE, SINKS, vis)
    assert max_err(out, want_out) < 1e-5
    assert max_err(lse, want_lse) < 1e-5  # every row finite: the sink is in each
    empty = ~vis.any(-1)
    if empty.any():  # no visible key: out 0, lse = the head's sink
        o, l = np.asarray(out), np.asarray(lse)
        assert not np.any(o[np.broadcast_to(empty[:, :, None, None], o.shape)])
        rows = np.broadcast_to(empty[:, None, :], l.shape)
        heads = np.broadcast_to(np.asarray(SINKS)[None, :, None], l.shape)
        assert np.array_equal(l[rows], heads[rows])

    got = jax.jit(jax.grad(_loss(_attn(kw)), argnums=(0, 1, 2, 3)))(q, k, v, SINKS)
    want = jax.grad(_loss(_dense(kw)), argnums=(0, 1, 2, 3))(q, k, v, SINKS)
    for n, g, h in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert np.all(np.isfinite(np.asarray(g))), n
        assert max_err(g, h) < 5e-5 * max(1.0, float(jnp.max(jnp.abs(h)))), n
    assert float(jnp.max(jnp.abs(got[3]))) > 1e-2  # the sinks do get a gradient


def test_sink_gradient_matches_finite_differences():
    """d sinks and dq against central differences of the forward (float32; a step
    of 1e-2 keeps rounding and truncation near 1e-4)."""
    q, k, v = rand_qkv(4, 2, 9, 13, 2, 1, 8, dtype=jnp.float32)
    kw = dict(causal=True, kv_lengths=np.array([13, 4], np.int32))
    s = jnp.array([0.3, -0.7], jnp.float32)
    f = jax.jit(_loss(_attn(kw), 2, 9, 2, 8))
    got = jax.grad(f, argnums=(0, 3))(q, k, v, s)
    eps = 1e-2
    rng = np.random.default_rng(1)
    for grad, move in ((got[0], lambda d: (q + d, s)), (got[1], lambda d: (q, s + d))):
        for _ in range(3):
            d = jnp.asarray(rng.standard_normal(grad.shape), jnp.float32)
            d = d / jnp.linalg.norm(d)
            (qu, su), (qd, sd) = move(eps * d), move(-eps * d)
            fd = float((f(qu, k, v, su) - f(qd, k, v, sd)) / (2 * eps))
            assert abs(float(jnp.vdot(grad, d)) - fd) < 2e-3 * max(1.0, abs(fd)), fd


def test_sinks_with_softcap_and_vmap():
    q, k, v = rand_qkv(6, B, SQ, SK, HQ, HKV, D, dtype=jnp.float32)
    kw = dict(causal=True, window=(9, 0))
    got = _attn(kw, softcap=1.5)(q, k, v, SINKS)
    want = _dense(kw, softcap=1.5)(q, k, v, SINKS)
    assert max_err(got[0], want[0]) < 1e-5 and max_err(got[1], want[1]) < 1e-5
    # vmap over the sinks (one set per model copy) and over the queries alone
    # (shared K / V: folded into the heads) equal the loops.
    two = jnp.stack([SINKS, -SINKS])
    batched = jax.vmap(lambda s: _attn(kw)(q, k, v, s))(two)
    qs = jnp.stack([q, 2 * q])
    shared = jax.vmap(lambda q: _attn(kw)(q, k, v, SINKS))(qs)
    for i in range(2):
        one = _attn(kw)(q, k, v, two[i])
        assert max_err(batched[0][i], one[0]) < 1e-6 and max_err(batched[1][i], one[1]) < 1e-6
        one = _attn(kw)(qs[i], k, v, SINKS)
        assert max_err(shared[0][i], one[0]) < 1e-6 and max_err(shared[1][i], one[1]) < 1e-6
    g = jax.vmap(jax.grad(_loss(_attn(kw)), argnums=3), in_axes=(None, None, None, 0))(
        q, k, v, two)
    for i in range(2):
        assert max_err(g[i], jax.grad(_loss(_attn(kw)), argnums=3)(q, k, v, two[i])) < 1e-5


@pytest.mark.parametrize("spec", [P("x"), P(None, None, "x")])
def test_sinks_under_batch_and_head_sharding(spec):
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip("needs 4 CPU devices (XLA_FLAGS set in conftest before JAX starts)")
    mesh = Mesh(np.array(devices[:4]), ("x",))
    q, k, v = rand_qkv(2, 4, 16, 16, 8, 4, 16, dtype=jnp.float32)
    s = jnp.linspace(-1.0, 2.0, 8, dtype=jnp.float32)
    sh = NamedSharding(mesh, spec)
    q, k, v = (jax.device_put(x, sh) for x in (q, k, v))
    loss = _loss(_attn({}), 4, 16, 8, 16)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    assert "all-gather" not in grad.lower(q, k, v, s).compile().as_text()
    got = grad(q, k, v, s)
    want = jax.grad(_loss(_dense({}), 4, 16, 8, 16), argnums=(0, 1, 2, 3))(q, k, v, s)
    for g, w in zip(got, want):
        assert max_err(g, w) < 1e-4


@pytest.mark.parametrize("sinks,err,match", [
    (jnp.zeros((4,), jnp.bfloat16), TypeError, "float32"),
    (jnp.zeros((2,), jnp.float32), ValueError, r"shape \(query heads,\)"),
    (jnp.zeros((1, 4), jnp.float32), ValueError, "shape"),
    ([0.0] * 4, TypeError, "array"),
])
def test_bad_sinks_raise(sinks, err, match):
    q, k, v = rand_qkv(1, 1, 8, 8, 4, 2, 16, dtype=jnp.float32)
    with pytest.raises(err, match=match):
        jax_fa4.attention(q, k, v, sinks=sinks)


@pytest.mark.parametrize("arch,d,kw", [("sm_90a", 64, dict(causal=True, window=(128, 0))),
                                       ("sm_90a", 128, dict(causal=True)),
                                       ("sm_90a", 256, dict()),
                                       ("sm_100a", 128, dict(causal=True))])
def test_forward_kernels_take_sinks(monkeypatch, kernel_calls, arch, d, kw):
    """The forward kernel takes the sink logits, (B, Hq) float32, last, and its build
    is keyed by them; the step is the four kernel calls (sm_100a: compiled, not run
    on hardware)."""
    monkeypatch.setenv("JAX_FA4_ARCH", arch)
    q, k, v = (jax.ShapeDtypeStruct((2, 200, 4, d), jnp.bfloat16),) * 3
    s = jax.ShapeDtypeStruct((4,), jnp.float32)
    fn = jax.jit(jax.grad(lambda q, k, v, s: jax_fa4.attention(
        q, k, v, sinks=s, implementation="cute", **kw).astype(jnp.float32).sum(),
        argnums=(0, 3)))
    text = fn.trace(q, k, v, s).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("CuteDSLRT_NvJaxCutlassCall") == 4
    (key, inputs), = [c for c in kernel_calls if c[0].kind == "fwd"]
    assert key.sinks and inputs[-1] == ((2, 4), jnp.float32)


def test_sm90_forward_with_sinks_keeps_registers(tmp_path):
    """The masked sm_90a forward with sinks (their term joins the denominator in the
    epilogue): no local memory."""
    pytest.importorskip("cutlass")
    import re

    from kernel_compile import dump_options, fwd_structs, lower, read_dump

    from jax_fa4.kernels.sm90_fwd import make_fwd_sm90

    b, sq, sk, hq, hkv, d = 2, 113, 203, 8, 2, 128
    ins, outs = fwd_structs(b, sq, sk, hq, hkv, d, jnp.bfloat16)
    # The tile counter rides in an extra batch entry of the intervals (Note [Counter
    # in the intervals]).
    ranges = jax.ShapeDtypeStruct((b + 1, sq, 2), jnp.int32)
    ins = ins + (ranges, jax.ShapeDtypeStruct((b, hq), jnp.float32))
    lower(lambda: make_fwd_sm90(jnp.bfloat16, d, d, False, masked=True, sinks=True),
          "sm_90a", ins, outs + (ranges,), aliases={3: 2},
          compile_options=dump_options(tmp_path))
    sass = read_dump(tmp_path, "sass")
    if sass is None:
        pytest.skip("the DSL wrote no SASS (disassembler unavailable to it)")
    assert "MUFU.EX2" in sass and not re.search(r"\b(LDL|STL)\b", sass)


@pytest.mark.gpu
@pytest.mark.parametrize("d,kw", [(64, dict(causal=True, window=(128, 0))),
                                  (128, dict(causal=True, kv_lengths=np.array([300, 0],
                                                                              np.int32))),
                                  (128, dict(causal=True)),
                                  (256, dict()),
                                  (96, dict(causal=True)),
                                  (64, dict(causal=True, deterministic=True))])
def test_gpu_kernels_with_sinks(d, kw):
    """On the GPU, kernels only (``implementation="cute"``): the forward with sinks,
    the backward with its lse; every gradient (d sinks included), out and lse by
    the 2x rule against the dense reference in float32 and bf16, outputs poisoned."""
    from conftest import assert_close_2x

    from jax_fa4.ffi import poison_outputs

    b, sq, sk, hq, hkv = 2, 300, 300, 4, 2
    q, k, v = rand_qkv(8, b, sq, sk, hq, hkv, d)
    s = jnp.array([0.5, -1.0, 2.0, 0.0], jnp.float32)
    fn = jax.jit(jax.value_and_grad(lambda q, k, v, s: _loss(
        lambda *a: jax_fa4.attention(*a[:3], scale=SCALE, sinks=a[3], return_lse=True,
                                     implementation="cute", **_jnp(kw)),
        b, sq, hq, d)(q, k, v, s), argnums=(0, 1, 2, 3)))
    with poison_outputs():
        _, got = fn(q, k, v, s)

    def ref(dtype):
        f = _loss(lambda q, k, v, s: tuple(x.astype(jnp.float32) for x in _dense(
            kw, compute_dtype=dtype)(q.astype(dtype), k.astype(dtype), v.astype(dtype), s)),
            b, sq, hq, d)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(q, k, v, s)

    hi, lo = ref(jnp.float32), ref(jnp.bfloat16)
    for n, g, h, lw in zip(("dq", "dk", "dv", "dsinks"), got, hi, lo):
        assert_close_2x(g, h, lw, atol=2e-3, name=n)
    with poison_outputs():
        out, lse = jax.jit(lambda q, k, v, s: jax_fa4.attention(
            q, k, v, scale=SCALE, sinks=s, return_lse=True, implementation="cute",
            **_jnp(kw)))(q, k, v, s)
    (hi_out, hi_lse), (lo_out, lo_lse) = (
        _dense(kw, compute_dtype=t)(q.astype(t), k.astype(t), v.astype(t), s)
        for t in (jnp.float32, jnp.bfloat16))
    assert_close_2x(out, hi_out, lo_out, atol=1e-3, name="out")
    assert_close_2x(lse, hi_lse, lo_lse, atol=1e-3, name="lse")
