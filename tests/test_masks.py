"""Masks through the public API on the reference path: causal modes, windows,
sequence lengths, segment ids and their compositions, against an independent
float64 numpy ground truth (forward) and a dense float32 jnp one (gradients),
including rows that see no key (out 0, lse -inf, zero gradients, no NaN)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_err, rand_qkv

import jax_fa4


def visible_np(b, sq, sk, causal=False, window=None, q_lengths=None, kv_lengths=None,
               q_seg=None, kv_seg=None):
    """[B, Sq, Sk] bool, written from the documented rule with loops over batch."""
    out = np.zeros((b, sq, sk), bool)
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    for n in range(b):
        lq = sq if q_lengths is None else min(max(int(q_lengths[n]), 0), sq)
        lk = sk if kv_lengths is None else min(max(int(kv_lengths[n]), 0), sk)
        off = lk - lq if causal == "bottom_right" else 0
        vis = (i < lq) & (j < lk)
        if causal:
            vis &= j <= i + off
        if window is not None:
            left, right = window
            if left is not None:
                vis &= j >= i + off - left
            if right is not None:
                vis &= j <= i + off + right
        if q_seg is not None:
            vis &= np.asarray(q_seg)[n][:, None] == np.asarray(kv_seg)[n][None, :]
        out[n] = vis
    return out


def naive64(q, k, v, scale, vis, softcap=None):
    """out, lse over the visible keys in float64; ``softcap`` c caps each scaled
    logit s to c * tanh(s / c)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    vis = vis[:, None]
    s = np.where(vis, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(vis, np.exp(s - m), 0.0)
    l = p.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", p / np.where(l == 0, 1, l), v)
    lse = np.where(l[..., 0] == 0, -np.inf, (m + np.log(np.where(l == 0, 1, l)))[..., 0])
    return out, lse


def dense_with(kw, scale, **more):
    """The dense reference with the masks of ``kw`` (a CASES entry) and ``more`` of
    its keyword arguments: f(q, k, v, **extra) -> (out, lse)."""
    from jax_fa4.reference import Masks, attention_dense

    m = _jnp(kw)
    masks = Masks(m.get("q_lengths"), m.get("kv_lengths"), m.get("q_segment_ids"),
                  m.get("kv_segment_ids", m.get("q_segment_ids")))
    causal = kw.get("causal", False)
    return lambda q, k, v, **extra: attention_dense(
        q, k, v, scale=scale, causal=bool(causal), bottom_right=causal == "bottom_right",
        window=kw.get("window"), masks=masks, **more, **extra)


def dense32(q, k, v, scale, vis):
    """Differentiable f32 ground truth with the mask given as an array."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    vis = jnp.asarray(vis)[:, None]
    m = jax.lax.stop_gradient(jnp.max(jnp.where(vis, s, -1e30), -1, keepdims=True))
    p = jnp.where(vis, jnp.exp(jnp.where(vis, s - m, 0.0)), 0.0)
    l = p.sum(-1, keepdims=True)
    out = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(l == 0, 1, l), v)
    lse = jnp.where(l[..., 0] == 0, -jnp.inf, (m + jnp.log(jnp.where(l == 0, 1, l)))[..., 0])
    return out, lse


B, SQ, SK, HQ, HKV, D = 3, 37, 45, 4, 2, 16
SEG_Q = np.array([[0] * 10 + [1] * 20 + [2] * 7, [5] * 37, [0] * 3 + [1] * 30 + [7] * 4])
SEG_K = np.array([[0] * 12 + [1] * 25 + [2] * 8, [5] * 40 + [6] * 5, [1] * 20 + [7] * 25])
CASES = {  # name: attention keyword arguments (arrays as numpy)
    "causal_top_left": dict(causal=True),
    "causal_bottom_right": dict(causal="bottom_right"),
    "window_both": dict(window=(5, 3)),
    "window_left_causal": dict(causal=True, window=(8, 0)),
    "window_right_only": dict(window=(None, 2)),
    "bottom_right_window": dict(causal="bottom_right", window=(4, None)),
    "kv_lengths": dict(kv_lengths=np.array([45, 20, 0], np.int32)),
    "q_lengths": dict(q_lengths=np.array([37, 1, 12], np.int32)),
    "both_lengths_causal": dict(causal=True, q_lengths=np.array([30, 37, 5], np.int32),
                                kv_lengths=np.array([45, 9, 60], np.int32)),
    "lengths_bottom_right": dict(causal="bottom_right", q_lengths=np.array([30, 1, 37], np.int32),
                                 kv_lengths=np.array([45, 17, 2], np.int32)),
    "segments": dict(q_segment_ids=SEG_Q, kv_segment_ids=SEG_K),
    "segments_causal_lengths": dict(causal=True, q_segment_ids=SEG_Q, kv_segment_ids=SEG_K,
                                    kv_lengths=np.array([40, 45, 30], np.int32)),
    "everything": dict(causal="bottom_right", window=(6, 1), q_segment_ids=SEG_Q,
                       kv_segment_ids=SEG_K, q_lengths=np.array([36, 20, 37], np.int32),
                       kv_lengths=np.array([44, 45, 33], np.int32)),
}


# A subset for the score modifiers' tests: masks that bound each side of the rows,
# segment ids, and rows that see no key.
SIDES = ["causal_top_left", "lengths_bottom_right", "window_both", "segments_causal_lengths",
         "everything"]


def _vis(kw, b=B, sq=SQ, sk=SK):
    return visible_np(b, sq, sk, causal=kw.get("causal", False), window=kw.get("window"),
                      q_lengths=kw.get("q_lengths"), kv_lengths=kw.get("kv_lengths"),
                      q_seg=kw.get("q_segment_ids"), kv_seg=kw.get("kv_segment_ids"))


def _jnp(kw):
    return {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_match_ground_truth(name):
    kw = CASES[name]
    q, k, v = rand_qkv(len(name), B, SQ, SK, HQ, HKV, D, dtype=jnp.float32)
    scale = 0.3
    vis = _vis(kw)
    out, lse = jax.jit(lambda q, k, v: jax_fa4.attention(
        q, k, v, scale=scale, return_lse=True, **_jnp(kw)))(q, k, v)
    want_out, want_lse = naive64(q, k, v, scale, vis)
    assert max_err(out, want_out) < 1e-5
    empty = ~vis.any(-1)  # [B, Sq]: rows that see no key
    lse_np = np.asarray(lse)
    assert np.array_equal(np.isneginf(lse_np), np.broadcast_to(empty[:, None], lse_np.shape))
    fin = np.isfinite(want_lse)
    assert np.max(np.abs(lse_np[fin] - want_lse[fin])) < 1e-5
    if empty.any():
        assert not np.any(np.asarray(out)[np.broadcast_to(empty[:, :, None, None],
                                                          out.shape)])

    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
    wl = jnp.sin(jnp.arange(lse.size, dtype=jnp.float32).reshape(lse.shape))

    def loss(fn):
        def f(q, k, v):
            o, l = fn(q, k, v)
            return jnp.sum(o * w) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0) * wl)
        return f

    got = jax.jit(jax.grad(loss(lambda q, k, v: jax_fa4.attention(
        q, k, v, scale=scale, return_lse=True, **_jnp(kw))), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: dense32(q, k, v, scale, vis)), argnums=(0, 1, 2))(
        q, k, v)
    for name_, g, h in zip(("dq", "dk", "dv"), got, want):
        assert np.all(np.isfinite(np.asarray(g))), name_
        assert max_err(g, h) < 2e-5, name_
    if empty.any():  # rows that see nothing get no gradient
        dq = np.asarray(got[0])
        assert not np.any(dq[np.broadcast_to(empty[:, :, None, None], dq.shape)])


def test_multiple_key_blocks_and_gqa():
    """Masks across several of the reference's 512-key blocks."""
    b, sq, sk = 2, 70, 1100
    q, k, v = rand_qkv(9, b, sq, sk, 6, 2, 8, dtype=jnp.float32)
    kw = dict(causal="bottom_right", window=(600, 0), kv_lengths=np.array([1100, 530], np.int32),
              q_lengths=np.array([70, 40], np.int32))
    vis = _vis(kw, b, sq, sk)
    out, lse = jax_fa4.attention(q, k, v, scale=0.2, return_lse=True, **_jnp(kw))
    want_out, want_lse = naive64(q, k, v, 0.2, vis)
    assert max_err(out, want_out) < 1e-5
    fin = np.isfinite(want_lse)
    assert np.max(np.abs(np.asarray(lse)[fin] - want_lse[fin])) < 1e-5


def test_lengths_are_data_under_jit_and_vmap():
    """New length values reuse the traced function; vmap over a batch of length
    vectors equals the loop."""
    q, k, v = rand_qkv(2, B, SQ, SK, HQ, HKV, D, dtype=jnp.float32)
    fn = jax.jit(lambda q, k, v, kl: jax_fa4.attention(q, k, v, causal=True, kv_lengths=kl))
    traced = []
    for kl in ([45, 3, 10], [1, 2, 3]):
        kl = jnp.asarray(kl, jnp.int32)
        got = fn(q, k, v, kl)
        want, _ = naive64(q, k, v, D**-0.5, _vis(dict(causal=True, kv_lengths=np.asarray(kl))))
        assert max_err(got, want) < 1e-5
        traced.append(fn._cache_size())
    assert traced[0] == traced[1]
    kls = jnp.asarray([[45, 3, 10], [7, 45, 1]], jnp.int32)
    got = jax.vmap(lambda kl: fn(q, k, v, kl))(kls)
    for n in range(2):
        assert max_err(got[n], fn(q, k, v, kls[n])) < 1e-6


def test_segment_ids_default_to_the_query_ids():
    q, k, v = rand_qkv(4, 2, 20, 20, 2, 2, 8, dtype=jnp.float32)
    seg = jnp.asarray([[0] * 7 + [1] * 13, [3] * 20], jnp.int32)
    a = jax_fa4.attention(q, k, v, causal=True, q_segment_ids=seg)
    b = jax_fa4.attention(q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg)
    assert max_err(a, b) == 0.0


def test_unbatched_masks():
    q, k, v = rand_qkv(5, 1, 11, 13, 2, 1, 8, dtype=jnp.float32)
    got = jax_fa4.attention(q[0], k[0], v[0], causal="bottom_right",
                            kv_lengths=jnp.int32(9), q_segment_ids=jnp.zeros(11, jnp.int32),
                            kv_segment_ids=jnp.zeros(13, jnp.int32))
    want = jax_fa4.attention(q, k, v, causal="bottom_right",
                             kv_lengths=jnp.asarray([9], jnp.int32))
    assert max_err(got, want[0]) < 1e-6


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(causal="sideways"), ValueError, "causal must be"),
    (dict(causal=1), ValueError, "causal must be"),
    (dict(window=(-1, 0)), ValueError, ">= 0"),
    (dict(window=(1,)), ValueError, "pair"),
    (dict(window=(1.5, 0)), TypeError, "ints"),
    (dict(kv_lengths=jnp.ones((3,), jnp.float32)), TypeError, "int32"),
    (dict(kv_lengths=jnp.ones((2,), jnp.int32)), ValueError, "shape"),
    (dict(q_lengths=jnp.ones((3, 1), jnp.int32)), ValueError, "shape"),
    (dict(q_segment_ids=jnp.ones((3, 36), jnp.int32),
          kv_segment_ids=jnp.ones((3, 45), jnp.int32)), ValueError, "shape"),
    (dict(q_segment_ids=jnp.ones((3, 37), jnp.int32)), ValueError, "Sq == Sk"),
    (dict(kv_segment_ids=jnp.ones((3, 45), jnp.int32)), ValueError, "without q_segment_ids"),
    (dict(q_segment_ids=jnp.ones((3, 37), jnp.int16),
          kv_segment_ids=jnp.ones((3, 45), jnp.int32)), TypeError, "int32"),
])
def test_bad_mask_arguments_raise_at_trace_time(kwargs, err, match):
    q, k, v = (jax.ShapeDtypeStruct(s, jnp.float32) for s in
               ((B, SQ, HQ, D), (B, SK, HKV, D), (B, SK, HKV, D)))
    with pytest.raises(err, match=match):
        jax.eval_shape(functools.partial(jax_fa4.attention, **kwargs), q, k, v)


def test_cute_raises_for_masks_without_a_kernel():
    q, k, v = rand_qkv(1, 1, 8, 8, 1, 1, 64)
    with pytest.raises(ValueError, match="implementation='cute'"):
        jax_fa4.attention(q, k, v, window=(2, 0), implementation="cute")


@pytest.mark.parametrize("kw", [
    dict(is_causal=True, key_value_seq_lengths=[45, 20, 3]),
    dict(query_seq_lengths=[37, 2, 20], key_value_seq_lengths=[30, 45, 10]),
    dict(local_window_size=(4, 2)),
    dict(is_causal=True, local_window_size=3, query_seq_lengths=[20, 37, 37]),
], ids=lambda kw: ",".join(kw))
def test_dot_product_attention_matches_jax_nn(kw):
    """The jax.nn signature: the same output (rows that see some key), and the
    residual in the input dtype with no gradient, as jax.nn gives it."""
    q, k, v = rand_qkv(3, B, SQ, SK, HQ, HKV, D, dtype=jnp.bfloat16)
    kw = {n: jnp.asarray(x, jnp.int32) if isinstance(x, list) else x for n, x in kw.items()}
    out, res = jax_fa4.dot_product_attention(q, k, v, return_residual=True, **kw)
    want, want_res = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kw)
    assert res.dtype == want_res.dtype == q.dtype and res.shape == want_res.shape
    assert max_err(out, want) < 2e-2
    fin = np.isfinite(np.asarray(res, np.float32))
    assert np.max(np.abs(np.asarray(res, np.float32)[fin] - np.asarray(want_res, np.float32)
                         [fin])) < 5e-2

    def through_residual(fn):
        return jax.grad(lambda q: jnp.sum(fn(q)[1].astype(jnp.float32)))(q)

    g = through_residual(lambda q: jax_fa4.dot_product_attention(
        q, k, v, return_residual=True, **kw))
    g_nn = through_residual(lambda q: jax.nn.dot_product_attention(
        q, k, v, return_residual=True, **kw))
    assert not np.any(np.asarray(g, np.float32)) and not np.any(np.asarray(g_nn, np.float32))


def test_flax_modules_take_lengths_and_segments():
    from flax import linen, nnx

    import jax_fa4.flax as fa4_flax

    x = jax.random.normal(jax.random.key(0), (2, 24, 32))
    seg = jnp.asarray([[0] * 10 + [1] * 14, [2] * 24], jnp.int32)
    lengths = jnp.asarray([24, 15], jnp.int32)
    mha = fa4_flax.MultiHeadAttention(num_heads=2, in_features=32, decode=False,
                                      rngs=nnx.Rngs(0))
    ref = nnx.MultiHeadAttention(num_heads=2, in_features=32, decode=False, rngs=nnx.Rngs(0))
    got = mha(x, q_segment_ids=seg, kv_lengths=lengths, is_causal=True)
    vis = visible_np(2, 24, 24, causal=True, kv_lengths=np.asarray(lengths), q_seg=seg,
                     kv_seg=seg)
    want = ref(x, mask=jnp.asarray(vis)[:, None])
    assert max_err(got, want) < 1e-4

    lin = fa4_flax.MultiHeadDotProductAttention(num_heads=2, qkv_features=32)
    params = lin.init(jax.random.key(1), x)
    got = lin.apply(params, x, q_segment_ids=seg, kv_lengths=lengths)
    vis = visible_np(2, 24, 24, kv_lengths=np.asarray(lengths), q_seg=seg, kv_seg=seg)
    want = linen.MultiHeadDotProductAttention(num_heads=2, qkv_features=32).apply(
        params, x, mask=jnp.asarray(vis)[:, None])
    assert max_err(got, want) < 1e-4
