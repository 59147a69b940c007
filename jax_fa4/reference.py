"""The pure-JAX reference path: attention forward and backward, out and LSE, f32 math.

Two forms of the same function:

* :func:`attention_dense` builds the full ``[Sq, Sk]`` score matrix. It is the
  ground truth in tests and the path for features no kernel has (dense bias,
  dense mask, sequence lengths, windows).
* :func:`attention_blockwise` / :func:`attention_bwd_blockwise` walk the keys in
  blocks with an online softmax, so long sequences never build an
  ``[Sq, Sk]`` matrix. This is what the primitives lower to on CPU and on GPUs
  without a kernel. The forward mirrors the kernels' lazy rescaling (see
  Note [Lazy rescale] below), so the CPU tests exercise the same algorithm.

Layouts follow ``jax.nn.dot_product_attention``: q ``[B, Sq, Hq, D]``,
k ``[B, Sk, Hkv, D]``, v ``[B, Sk, Hkv, Dv]``; lse ``[B, Hq, Sq]`` (natural log).

Masks (``Masks`` for the per-batch arrays, keyword arguments for the rest): query
i of batch b sees key j iff every one of these holds, with Lq = q_lengths[b] and
Lk = kv_lengths[b] (Sq, Sk when not given; clamped to them) and the diagonal
offset off = Lk - Lq for ``bottom_right`` (0 otherwise):

    i < Lq and j < Lk                          (lengths)
    j <= i + off                               (causal)
    i + off - left <= j <= i + off + right     (window; a None side is unbounded)
    q_segment_ids[b, i] == kv_segment_ids[b, j]

A row that sees no key returns out 0 and lse -inf, and gets zero gradients.

``softcap`` c (None: off) caps each scaled logit s to c * tanh(s / c) before the
softmax (and before a dense ``bias``); the backward multiplies dS by its
derivative, 1 - tanh(s / c)^2.

``sinks`` [B, Hq] (None: none) are logits that join every row's softmax
denominator and attend to no value: out_i = sum_j exp(s_ij) v_j / (exp(sink) +
sum_j exp(s_ij)), lse_i = log(exp(sink) + sum_j exp(s_ij)). A row that sees no key
then has out 0 and lse = sink. The backward is the same with that lse (its P =
exp(S - lse) sums to less than 1); the sinks' own gradient is api.py's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_fa4.config import LN_2, LOG2_E

# Note [Lazy rescale]
# ~~~~~~~~~~~~~~~~~~~
# The online softmax keeps a running row max m and accumulates
#   O = sum_j 2^(s_j - m) v_j,   l = sum_j 2^(s_j - m)      (s in log2 units)
# Classic flash attention rescales O and l by 2^(m_old - m_new) whenever the
# max grows. FA4 keeps the stale max unless the new one exceeds it by more than
# a threshold (8.0 in log2 units for 16-bit inputs). While the max is stale the
# terms 2^(s_j - m) can reach 2^8 = 256: far inside the range of fp32
# accumulators and of bf16/fp16 P. O and l are always accumulated against the
# *same* max, so O / l is exact whichever max was used, and
#   lse = (m + log2(l)) * ln 2
# is exact too. Skipping the rescale saves a pass over O for most KV blocks.
LAZY_RESCALE_THRESHOLD = 8.0


def _group_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[B, S, Hq, D] -> [B, S, Hkv, G, D]: query head h reads kv head h // G."""
    b, s, hq, d = q.shape
    return q.reshape(b, s, num_kv_heads, hq // num_kv_heads, d)


class Masks(NamedTuple):
    """The per-batch mask arrays (int32), each optional."""

    q_lengths: jax.Array | None = None  # [B]
    kv_lengths: jax.Array | None = None  # [B]
    q_segment_ids: jax.Array | None = None  # [B, Sq]
    kv_segment_ids: jax.Array | None = None  # [B, Sk]


NO_MASKS = Masks()


def visible(q_idx: jax.Array, k_idx: jax.Array, sq: int, sk: int, *, causal: bool = False,
            bottom_right: bool = False, window: tuple[int | None, int | None] | None = None,
            masks: Masks = NO_MASKS, kv_segment_block: jax.Array | None = None) -> jax.Array:
    """Which keys ``k_idx`` each query ``q_idx`` sees: bool ``[B or 1, len(q_idx),
    len(k_idx)]`` (the module docstring's rule). Key indices at or past ``sk`` (block
    padding) are never visible. ``kv_segment_block``: the kv segment ids of these keys,
    ``[B, len(k_idx)]``, when ``k_idx`` is not ``arange(sk)``."""
    i = q_idx[None, :, None]
    j = k_idx[None, None, :]
    lq = sq if masks.q_lengths is None else jnp.clip(masks.q_lengths, 0, sq)[:, None, None]
    lk = sk if masks.kv_lengths is None else jnp.clip(masks.kv_lengths, 0, sk)[:, None, None]
    vis = (j < lk) & (i < lq) & (j < sk)
    diag = i + (lk - lq) if bottom_right else i
    if causal:
        vis = vis & (j <= diag)
    if window is not None:
        left, right = window
        if left is not None:
            vis = vis & (j >= diag - left)
        if right is not None:
            vis = vis & (j <= diag + right)
    if masks.q_segment_ids is not None:
        ks = masks.kv_segment_ids if kv_segment_block is None else kv_segment_block
        vis = vis & (masks.q_segment_ids[:, q_idx, None] == ks[:, None, :])
    return vis


def attention_dense(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    causal: bool = False,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    compute_dtype=jnp.float32,
    bottom_right: bool = False,
    window: tuple[int | None, int | None] | None = None,
    masks: Masks = NO_MASKS,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Dense reference attention.

    Args:
      q: ``[B, Sq, Hq, D]``; k: ``[B, Sk, Hkv, D]``; v: ``[B, Sk, Hkv, Dv]``.
      causal, bottom_right, window, masks: the masks of the module docstring.
      softcap, sinks: the logit cap and the sink logits [B, Hq] of the module
        docstring (None: off).
      bias: optional, broadcastable to ``[B, Hq, Sq, Sk]``, added to the scaled logits.
      mask: optional boolean, broadcastable to ``[B, Hq, Sq, Sk]``; False hides a key.
      compute_dtype: the precision of every step (f32 by default; tests use the
        input dtype to measure low-precision error, f64 for ground truth).

    Returns:
      ``(out [B, Sq, Hq, Dv] in q.dtype, lse [B, Hq, Sq] float32)``.
    """
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qg = _group_queries(q.astype(compute_dtype), hkv)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(compute_dtype)) * jnp.asarray(
        scale, compute_dtype
    )
    s = _capped(s.reshape(b, hq, sq, sk), softcap)
    if bias is not None:
        s = s + jnp.broadcast_to(bias, s.shape).astype(compute_dtype)
    vis = visible(jnp.arange(sq), jnp.arange(sk), sq, sk, causal=causal,
                  bottom_right=bottom_right, window=window, masks=masks)
    vis = jnp.broadcast_to(vis[:, None], s.shape)
    if mask is not None:
        vis = vis & jnp.broadcast_to(mask, s.shape)
    neg = jnp.finfo(compute_dtype).min
    s = jnp.where(vis, s, neg)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(compute_dtype)[:, :, None, None]
        m = jnp.maximum(m, sink)
    p = jnp.exp(s - m)
    p = jnp.where(vis, p, 0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        l = l + jnp.exp(sink - m)
    safe_l = jnp.where(l == 0, 1, l)
    lse = jnp.where(l[..., 0] == 0, -jnp.inf, (m + jnp.log(safe_l))[..., 0])
    p = (p / safe_l).reshape(b, hkv, hq // hkv, sq, sk)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(compute_dtype), v.astype(compute_dtype))
    out = out.reshape(b, sq, hq, v.shape[-1])
    return out.astype(q.dtype), lse.astype(jnp.float32)


def gather_pages(key_pool: jax.Array, value_pool: jax.Array, page_table: jax.Array):
    """(key, value) ``[B, P * page_size, Hkv, D]`` of a paged cache: sequence b's keys
    are pages ``page_table[b]`` ``[B, P]`` of the pools ``[pages, page_size, Hkv, D]``
    in table order; page ids outside the pool are clamped into it."""
    b, p = page_table.shape
    return tuple(jnp.take(x, page_table, axis=0, mode="clip").reshape(b, p * x.shape[1],
                                                                      *x.shape[2:])
                 for x in (key_pool, value_pool))


def _capped(s: jax.Array, softcap: float | None) -> jax.Array:
    """c * tanh(s / c) of scaled logits s (``softcap`` c; None: s)."""
    if softcap is None:
        return s
    return softcap * jnp.tanh(s * (1.0 / softcap))


def like_inputs(init, *inputs):
    """Give loop-carry initial values the varying manual axes of the inputs.

    Inside shard_map the scan body's carry picks up the mesh axes its inputs
    vary over; constant initial values must carry the same axes, or the carry
    types disagree. Selecting 0 against one element of each input does that
    with public APIs on every JAX version (the select folds away).
    """
    zero = sum(
        jnp.where(False, x.reshape(-1)[0].astype(jnp.float32), jnp.float32(0)) for x in inputs
    )
    return jax.tree.map(lambda a: a + jax.lax.stop_gradient(zero).astype(a.dtype), init)


def _pad_keys(x: jax.Array, block: int) -> tuple[jax.Array, int]:
    sk = x.shape[1]
    nblk = -(-sk // block)
    pad = nblk * block - sk
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return x, nblk


def _key_block_size(sk: int, block_k: int) -> int:
    return min(block_k, sk)


def _present(masks: Masks) -> tuple[jax.Array, ...]:
    return tuple(x for x in masks if x is not None)


def _segment_blocks(masks: Masks, bk: int, nblk: int) -> jax.Array:
    """The kv segment ids in key blocks, [nblk, B, bk] (a dummy [nblk] without them)."""
    ks = masks.kv_segment_ids
    if ks is None:
        return jnp.zeros((nblk,), jnp.int32)
    ks = jnp.pad(ks, ((0, 0), (0, nblk * bk - ks.shape[1])))
    return ks.reshape(ks.shape[0], nblk, bk).transpose(1, 0, 2)


def _block_visibility(sq, sk, bk, nblk, causal, bottom_right, window, masks: Masks):
    """j, segment ids of key block j -> visibility [B or 1, Sq, bk] (``visible``)."""
    q_idx = jnp.arange(sq)

    def vis_of(j, segj):
        return visible(q_idx, j * bk + jnp.arange(bk), sq, sk, causal=causal,
                       bottom_right=bottom_right, window=window, masks=masks,
                       kv_segment_block=None if masks.kv_segment_ids is None else segj)

    return vis_of


def attention_blockwise(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    causal: bool = False,
    block_k: int = 512,
    rescale_threshold: float = LAZY_RESCALE_THRESHOLD,
    bottom_right: bool = False,
    window: tuple[int | None, int | None] | None = None,
    masks: Masks = NO_MASKS,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Online-softmax attention over key blocks; never builds ``[Sq, Sk]``.

    ``rescale_threshold`` is the lazy-rescale threshold in log2 units (Note
    [Lazy rescale]); 0.0 gives classic eager rescaling. Shapes and masks as in
    :func:`attention_dense`. Returns ``(out in q.dtype, lse float32)``.
    """
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    bk = _key_block_size(sk, block_k)
    kp, nblk = _pad_keys(k, bk)
    vp, _ = _pad_keys(v, bk)
    kb = kp.reshape(b, nblk, bk, hkv, d).transpose(1, 0, 2, 3, 4)
    vb = vp.reshape(b, nblk, bk, hkv, dv).transpose(1, 0, 2, 3, 4)
    # Scores in log2 units: s2 = (q.k) * scale * log2(e), or capped: softcap *
    # tanh((q.k) * scale / softcap) * log2(e).
    qg = _group_queries(q.astype(jnp.float32), hkv) * (
        scale * (LOG2_E if softcap is None else 1.0))
    vis_of = _block_visibility(sq, sk, bk, nblk, causal, bottom_right, window, masks)

    def step(carry, xs):
        o, l, m = carry  # o [B,Hkv,G,Sq,Dv], l/m [B,Hkv,G,Sq]
        j, kj, vj, segj = xs
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, kj.astype(jnp.float32))
        if softcap is not None:
            s = _capped(s, softcap) * LOG2_E
        s = jnp.where(vis_of(j, segj)[:, None, None], s, -jnp.inf)
        m_blk = jnp.max(s, axis=-1)
        m_cand = jnp.maximum(m, m_blk)
        # Lazy rescale: move the max only when it grew by more than the threshold
        # (always from -inf, the first time a row sees a key).
        grow = (m_cand - m > rescale_threshold) | jnp.isneginf(m)
        m_new = jnp.where(grow, m_cand, m)
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        corr = jnp.where(grow, jnp.exp2(jnp.where(jnp.isneginf(m), -jnp.inf, m - m_safe)), 1.0)
        p = jnp.exp2(s - m_safe[..., None])
        l = l * corr + jnp.sum(p, axis=-1)
        o = o * corr[..., None] + jnp.einsum("bhgqk,bkhd->bhgqd", p, vj.astype(jnp.float32))
        return (o, l, m_new), None

    init = (
        jnp.zeros((b, hkv, g, sq, dv), jnp.float32),
        jnp.zeros((b, hkv, g, sq), jnp.float32),
        jnp.full((b, hkv, g, sq), -jnp.inf, jnp.float32),
    )
    init = like_inputs(init, q, k, v, *_present(masks),
                       *(() if sinks is None else (sinks,)))
    (o, l, m), _ = jax.lax.scan(step, init, (jnp.arange(nblk), kb, vb,
                                             _segment_blocks(masks, bk, nblk)))
    if sinks is not None:
        # The sink joins the denominator at the end, in log2 units, against the
        # larger of it and the (possibly stale, possibly -inf) running max.
        sink = sinks.astype(jnp.float32).reshape(b, hkv, g, 1) * LOG2_E
        m_fin = jnp.maximum(m, sink)
        corr = jnp.exp2(m - m_fin)  # 0 where no key was seen (m = -inf)
        o, l, m = o * corr[..., None], l * corr + jnp.exp2(sink - m_fin), m_fin
    safe_l = jnp.where(l == 0, 1.0, l)
    out = (o / safe_l[..., None]).reshape(b, hq, sq, dv).transpose(0, 2, 1, 3)
    lse = jnp.where(l == 0, -jnp.inf, (m + jnp.log2(safe_l)) * LN_2).reshape(b, hq, sq)
    return out.astype(q.dtype), lse


def attention_bwd_blockwise(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    dlse: jax.Array | None,
    *,
    scale: float,
    causal: bool = False,
    block_k: int = 512,
    bottom_right: bool = False,
    window: tuple[int | None, int | None] | None = None,
    masks: Masks = NO_MASKS,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of (out, lse) w.r.t. q, k, v, recomputing P per key block.

    The same math the backward kernels do: with P = exp(S - lse),
    dP = dO V^T and Dpsum = rowsum(dO * O) - dLSE, dS = P * (dP - Dpsum);
    dQ = scale * dS K, dK = scale * dS^T Q, dV = P^T dO. The LSE cotangent
    enters through Dpsum (d lse_i / d S_ij = P_ij); ``dlse`` None: it is zero.
    Masks as in :func:`attention_dense`: a row that sees no key gets P = 0. With
    ``softcap`` c, P is of the capped scores and dS also takes the cap's
    derivative, 1 - tanh(S / c)^2.

    Returns ``(dq, dk, dv)`` in the dtypes of q, k, v.
    """
    b, sq, hq, d = q.shape
    sk, hkv, dv_ = k.shape[1], k.shape[2], v.shape[-1]
    bk = _key_block_size(sk, block_k)
    kp, nblk = _pad_keys(k, bk)
    vp, _ = _pad_keys(v, bk)
    kb = kp.reshape(b, nblk, bk, hkv, d).transpose(1, 0, 2, 3, 4)
    vb = vp.reshape(b, nblk, bk, hkv, dv_).transpose(1, 0, 2, 3, 4)
    qg = _group_queries(q.astype(jnp.float32), hkv)
    dog = _group_queries(dout.astype(jnp.float32), hkv)
    og = _group_queries(out.astype(jnp.float32), hkv)
    g = hq // hkv
    # [B, Hkv, G, Sq]
    lse_g = lse.astype(jnp.float32).reshape(b, hkv, g, sq)
    dpsum = jnp.einsum("bqhgd,bqhgd->bhgq", dog, og)
    if dlse is not None:
        dpsum = dpsum - dlse.astype(jnp.float32).reshape(b, hkv, g, sq)
    vis_of = _block_visibility(sq, sk, bk, nblk, causal, bottom_right, window, masks)
    # A row that sees no key has lse -inf: exp(s - lse) is then never taken.
    lse_g = jnp.where(jnp.isneginf(lse_g), 0.0, lse_g)

    def step(dq, xs):
        j, kj, vj, segj = xs
        kj = kj.astype(jnp.float32)
        vj = vj.astype(jnp.float32)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, kj) * scale
        capped = _capped(s, softcap)
        vis = vis_of(j, segj)[:, None, None]
        p = jnp.where(vis, jnp.exp(jnp.where(vis, capped - lse_g[..., None], 0.0)), 0.0)
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", dog, vj)
        ds = p * (dp - dpsum[..., None])
        if softcap is not None:  # d(c tanh(s / c)) / ds = 1 - tanh(s / c)^2
            ds = ds * (1.0 - jnp.square(capped * (1.0 / softcap)))
        dq = dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds, kj) * scale
        dk_j = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg) * scale
        dv_j = jnp.einsum("bhgqk,bqhgd->bkhd", p, dog)
        return dq, (dk_j, dv_j)

    dq0 = like_inputs(jnp.zeros((b, sq, hkv, g, d), jnp.float32), q, k, v, out, lse, dout,
                       *(() if dlse is None else (dlse,)), *_present(masks))
    dq, (dkb, dvb) = jax.lax.scan(step, dq0, (jnp.arange(nblk), kb, vb,
                                              _segment_blocks(masks, bk, nblk)))
    dk = dkb.transpose(1, 0, 2, 3, 4).reshape(b, nblk * bk, hkv, d)[:, :sk]
    dv = dvb.transpose(1, 0, 2, 3, 4).reshape(b, nblk * bk, hkv, dv_)[:, :sk]
    return dq.reshape(b, sq, hq, d).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
