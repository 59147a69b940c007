"""softcap through the public API on the reference path: each scaled logit s
becomes c * tanh(s / c). The forward against a float64 numpy ground truth written
from that formula, composed with masks of test_masks.py that bound each side (rows
that see no key included); the gradients against autodiff of the dense path and against finite
differences; argument errors; the kernels built for it, and (on the GPU) their results."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_err, rand_qkv, weighted_loss
from test_masks import CASES, SIDES, _jnp, _vis, dense_with, naive64

import jax_fa4

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


@pytest.mark.parametrize("arch,d,kw", [
    ("sm_90a", 128, dict(causal=True)),
    ("sm_90a", 64, dict(causal=True, window=(128, 0), deterministic=True)),
    ("sm_90a", 256, dict()),
    ("sm_100a", 128, dict(causal=True)),
    ("sm_100a", 64, dict(causal="bottom_right", deterministic=True)),
])
def test_kernels_take_softcap(monkeypatch, kernel_calls, arch, d, kw):
    """Forward and backward main kernel are built for the cap (their keys carry it);
    the step is the four kernel calls (sm_100a: compiled, not run on hardware)."""
    monkeypatch.setenv("JAX_FA4_ARCH", arch)
    q, k, v = (jax.ShapeDtypeStruct((2, 200, 4, d), jnp.bfloat16),) * 3
    fn = jax.jit(jax.grad(lambda q, k, v: jax_fa4.attention(
        q, k, v, softcap=30.0, implementation="cute", **kw).astype(jnp.float32).sum()))
    text = fn.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("CuteDSLRT_NvJaxCutlassCall") == 4
    caps = {key.kind: key.softcap for key, _ in kernel_calls}
    main = "bwd_det" if kw.get("deterministic") else "bwd"
    assert caps["fwd"] == caps[main] == 30.0
    # The pre- and postprocess do not depend on it.
    assert caps["bwd_pre"] is None and caps["bwd_post"] is None


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("d", [64, 128])
def test_sm90_softcap_builds(tmp_path, direction, d):
    """The sm_90a kernels with softcap: one MUFU.TANH per score, and the backward
    takes no extra exponent for dS. No local memory at hdim 128; at hdim 64 the
    backward spills a few scalars (at most 16 instructions)."""
    pytest.importorskip("cutlass")
    from kernel_compile import count, dump_options, dumped_sass, fwd_structs, lower, lower_bwd

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90
    from jax_fa4.kernels.sm90_fwd import FlashFwdSm90Dynamic, make_fwd_sm90

    if direction == "fwd":
        ins, outs = fwd_structs(2, 113, 203, 8, 2, d, jnp.bfloat16)
        assert isinstance(make_fwd_sm90(jnp.bfloat16, d, d, True), FlashFwdSm90Dynamic)
        cnt = jax.ShapeDtypeStruct((1,), jnp.int32)
        lower(lambda: make_fwd_sm90(jnp.bfloat16, d, d, True, softcap=30.0), "sm_90a",
              ins + (cnt,), outs + (cnt,), aliases={3: 2}, compile_options=dump_options(tmp_path))
    else:
        lower_bwd(FlashBwdSm90, "sm_90a", jnp.bfloat16, d, True,
                  compile_options=dump_options(tmp_path), softcap=30.0)
    sass = dumped_sass(tmp_path)
    tanh, ex2 = count(r"MUFU\.TANH", sass), count(r"MUFU\.EX2", sass)
    assert tanh > 0
    if direction == "bwd":
        assert tanh == ex2  # one tanh per P, nothing more for dS
    spills = count(r"\b(LDL|STL)\b", sass)
    assert spills == 0 if d == 128 else spills <= 16, spills


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_sm100_softcap_builds(tmp_path, direction):
    """The sm_100a kernels with softcap (compiled, not run on hardware): the tanh is
    in the PTX."""
    pytest.importorskip("cutlass")
    from kernel_compile import dump_options, fwd_structs, lower, lower_bwd, read_dump

    from jax_fa4.kernels.sm100_bwd import FlashBwdSm100
    from jax_fa4.kernels.sm100_fwd import FlashFwdSm100

    if direction == "fwd":
        ins, outs = fwd_structs(2, 113, 203, 8, 2, 128, jnp.bfloat16)
        lower(lambda: FlashFwdSm100(jnp.bfloat16, 128, 128, True, softcap=30.0), "sm_100a",
              ins, outs, compile_options=dump_options(tmp_path))
    else:
        lower_bwd(FlashBwdSm100, "sm_100a", jnp.bfloat16, 128, True,
                  compile_options=dump_options(tmp_path), softcap=30.0)
    ptx = read_dump(tmp_path, "ptx")
    assert ptx is not None and "tanh.approx.f32" in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("d,kw", [
    (128, dict(causal=True)),
    (64, dict(causal=True, window=(128, 0))),
    (256, dict()),
    (96, dict(causal=True, window=(128, 0))),
    (128, dict(causal=True, kv_lengths=np.array([300, 0], np.int32), deterministic=True)),
    (64, dict(causal="bottom_right", sinks=True)),
    # 50 rows of 2 heads a tile: the short rows' tiles (``short_tiles``)
    (64, dict(causal="bottom_right", sinks=True, sq=50)),
])
def test_gpu_kernels_with_softcap(d, kw):
    """On the GPU, kernels only (``implementation="cute"``), logits well past the
    cap: out, lse and every gradient by the 2x rule against the dense reference in
    float32 and bf16, outputs poisoned; a row with no key gives out 0, lse -inf and
    no NaN anywhere."""
    from conftest import assert_close_2x

    from jax_fa4.ffi import poison_outputs

    kw = dict(kw)
    b, sq, sk, hq, hkv, cap = 2, kw.pop("sq", 300), 333, 4, 2, 2.5
    q, k, v = rand_qkv(9, b, sq, sk, hq, hkv, d)
    q = q * 3.0
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0], jnp.float32) if kw.pop("sinks", False) else None
    extra = {} if sinks is None else dict(sinks=jnp.broadcast_to(sinks, (b, hq)))
    attn = lambda q, k, v: jax_fa4.attention(  # noqa: E731
        q, k, v, scale=SCALE, softcap=cap, sinks=sinks, return_lse=True,
        implementation="cute", **_jnp(kw))
    loss = _loss(attn, (b, sq, hq, d), (b, hq, sq))
    with poison_outputs():
        (out, lse), got = jax.jit(lambda q, k, v: (attn(q, k, v), jax.grad(
            loss, argnums=(0, 1, 2))(q, k, v)))(q, k, v)

    def ref(dtype):
        f = lambda q, k, v: tuple(x.astype(jnp.float32) for x in dense_with(  # noqa: E731
            kw, SCALE, softcap=cap, compute_dtype=dtype)(
                q.astype(dtype), k.astype(dtype), v.astype(dtype), **extra))
        return f(q, k, v), jax.grad(_loss(f, (b, sq, hq, d), (b, hq, sq)),
                                    argnums=(0, 1, 2))(q, k, v)

    (hi_out, hi_lse), hi = ref(jnp.float32)
    (lo_out, lo_lse), lo = ref(jnp.bfloat16)
    for n, g, h, lw in zip(("dq", "dk", "dv"), got, hi, lo):
        assert_close_2x(g, h, lw, atol=2e-3, name=n)
    assert_close_2x(out, hi_out, lo_out, atol=1e-3, name="out")
    lse, hi_lse, lo_lse = (np.asarray(x) for x in (lse, hi_lse, lo_lse))
    empty = np.isneginf(hi_lse)
    assert np.array_equal(np.isneginf(lse), empty) and not np.isnan(lse).any()
    assert_close_2x(lse[~empty], hi_lse[~empty], lo_lse[~empty], atol=1e-3, name="lse")
    if empty.any():
        assert not np.asarray(out, np.float32)[np.moveaxis(empty, 1, 2)].any()
