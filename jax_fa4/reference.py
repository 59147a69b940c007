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
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

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


def _causal_visible(sq_idx: jax.Array, sk_idx: jax.Array) -> jax.Array:
    """Top-left causal: query i sees key j iff j <= i."""
    return sk_idx[None, :] <= sq_idx[:, None]


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
) -> tuple[jax.Array, jax.Array]:
    """Dense reference attention.

    Args:
      q: ``[B, Sq, Hq, D]``; k: ``[B, Sk, Hkv, D]``; v: ``[B, Sk, Hkv, Dv]``.
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
    s = s.reshape(b, hq, sq, sk)
    if bias is not None:
        s = s + jnp.broadcast_to(bias, s.shape).astype(compute_dtype)
    visible = jnp.ones((sq, sk), bool)
    if causal:
        visible = _causal_visible(jnp.arange(sq), jnp.arange(sk))
    visible = jnp.broadcast_to(visible, s.shape)
    if mask is not None:
        visible = visible & jnp.broadcast_to(mask, s.shape)
    neg = jnp.finfo(compute_dtype).min
    s = jnp.where(visible, s, neg)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    p = jnp.where(visible, p, 0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    safe_l = jnp.where(l == 0, 1, l)
    lse = jnp.where(l[..., 0] == 0, -jnp.inf, (m + jnp.log(safe_l))[..., 0])
    p = (p / safe_l).reshape(b, hkv, hq // hkv, sq, sk)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(compute_dtype), v.astype(compute_dtype))
    out = out.reshape(b, sq, hq, v.shape[-1])
    return out.astype(q.dtype), lse.astype(jnp.float32)


def _like_inputs(init, *inputs):
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


def attention_blockwise(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    causal: bool = False,
    block_k: int = 512,
    rescale_threshold: float = LAZY_RESCALE_THRESHOLD,
) -> tuple[jax.Array, jax.Array]:
    """Online-softmax attention over key blocks; never builds ``[Sq, Sk]``.

    ``rescale_threshold`` is the lazy-rescale threshold in log2 units (Note
    [Lazy rescale]); 0.0 gives classic eager rescaling. Shapes as in
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
    # Scores in log2 units: s2 = (q.k) * scale * log2(e).
    qg = _group_queries(q.astype(jnp.float32), hkv) * (scale * LOG2E)
    q_idx = jnp.arange(sq)

    def step(carry, xs):
        o, l, m = carry  # o [B,Hkv,G,Sq,Dv], l/m [B,Hkv,G,Sq]
        j, kj, vj = xs
        k_idx = j * bk + jnp.arange(bk)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, kj.astype(jnp.float32))
        visible = jnp.broadcast_to(k_idx[None, :] < sk, (sq, bk))
        if causal:
            visible = visible & _causal_visible(q_idx, k_idx)
        s = jnp.where(visible, s, -jnp.inf)
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
    init = _like_inputs(init, q, k, v)
    (o, l, m), _ = jax.lax.scan(step, init, (jnp.arange(nblk), kb, vb))
    safe_l = jnp.where(l == 0, 1.0, l)
    out = (o / safe_l[..., None]).reshape(b, hq, sq, dv).transpose(0, 2, 1, 3)
    lse = jnp.where(l == 0, -jnp.inf, (m + jnp.log2(safe_l)) * LN2).reshape(b, hq, sq)
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
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of (out, lse) w.r.t. q, k, v, recomputing P per key block.

    The same math the backward kernels do: with P = exp(S - lse),
    dP = dO V^T and Dpsum = rowsum(dO * O) - dLSE, dS = P * (dP - Dpsum);
    dQ = scale * dS K, dK = scale * dS^T Q, dV = P^T dO. The LSE cotangent
    enters through Dpsum (d lse_i / d S_ij = P_ij); ``dlse`` None: it is zero.

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
    q_idx = jnp.arange(sq)

    def step(dq, xs):
        j, kj, vj = xs
        k_idx = j * bk + jnp.arange(bk)
        kj = kj.astype(jnp.float32)
        vj = vj.astype(jnp.float32)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, kj) * scale
        visible = jnp.broadcast_to(k_idx[None, :] < sk, (sq, bk))
        if causal:
            visible = visible & _causal_visible(q_idx, k_idx)
        p = jnp.where(visible, jnp.exp(s - lse_g[..., None]), 0.0)
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", dog, vj)
        ds = p * (dp - dpsum[..., None])
        dq = dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds, kj) * scale
        dk_j = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg) * scale
        dv_j = jnp.einsum("bhgqk,bqhgd->bkhd", p, dog)
        return dq, (dk_j, dv_j)

    dq0 = _like_inputs(jnp.zeros((b, sq, hkv, g, d), jnp.float32), q, k, v, out, lse, dout,
                       *(() if dlse is None else (dlse,)))
    dq, (dkb, dvb) = jax.lax.scan(step, dq0, (jnp.arange(nblk), kb, vb))
    dk = dkb.transpose(1, 0, 2, 3, 4).reshape(b, nblk * bk, hkv, d)[:, :sk]
    dv = dvb.transpose(1, 0, 2, 3, 4).reshape(b, nblk * bk, hkv, dv_)[:, :sk]
    return dq.reshape(b, sq, hq, d).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
