"""The CUDA lowering of the primitives: the calls a launch plan names, in order.

Forward: one kernel. Backward: preprocess (Dpsum, LSE in log2 units, zeroed fp32
dQ accumulator) -> main kernel (dK, dV; dQ partials reduce-added into the
accumulator) -> postprocess (dQ to 16 bits); see ``plan.py``. Every tensor crosses
the custom call in the `[B, S, H, D]` layout the user gave; no transposes are added
around it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_fa4.config import (
    AttentionConfig,
    dtype_name,
    page_size_error,
)
from jax_fa4.ffi import cutlass_available, kernel_call
from jax_fa4.reference import gather_pages
from jax_fa4.rules.plan import (
    bwd_plan,
    dq_store_keys,
    fwd_plan,
    fwd_tile_shape,
    num_sms,
    split_count,
)
from jax_fa4.rules.ranges import (
    key_block_ranges,
    key_ranges,
    mask_arrays,
    owned_walks,
    query_ranges,
)

# Per tensor: the dimensions that are compile-time constants (the head dims).
_BSHD = (3,)
_BHS = ()


def unavailable(arch: str) -> str | None:
    """None when the kernels of ``arch`` can be compiled here, else why not."""
    return cutlass_available(arch)


# Note [Short sequences]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A batch of many short sequences (Sq = Sk <= 128) would give each kernel tile one
# sequence of a (batch, head) pair: a 128- or 192-row tile with 32 of its rows
# used, and a CTA per few microseconds of work. Instead the CUDA lowering lays p
# sequences of the batch end to end, [B, S] -> [B / p, p S] (a free reshape), as
# packed documents: segment ids, whose intervals are exact, so the masked kernels
# skip every key block of other sequences and mask within the diagonal blocks. Out,
# dq, dk, dv reshape back for free; the lse and its cotangent, [B, H, S], are
# transposed. p is the largest divisor of B with p S <= _SHORT_ROW.
#
# Lengths become ids too (``_packed_rows``): sequence s of a row is id s up to its
# length, and past it id p + s among the queries and 2 p + s among the keys, ids
# that the other side never holds: a padding query sees no key, a padding key is
# seen by none, and every id is still one run. Windows and top-left causal are the
# same in a packed row as in each sequence. Masked, only sequences of at most half
# a key block pack: longer ones share no key block, and tiles that straddle two of
# them mask each element (1024 x 128 with lengths, hdim 64: forward 0.338 ms in
# rows of one, 0.377 ms packed four to a row; the backward's dQ is stored either
# way, Note [One key block per query block]). Sinks, which may differ per batch
# entry, segment ids of the caller's, and a bottom-right diagonal set by each
# sequence's own lengths keep one sequence per row.
_SHORT_SEQ = 128
_SHORT_ROW = 512


def _short_rows(config: AttentionConfig, b: int, sq: int, sk: int) -> int:
    """Sequences per packed row (Note [Short sequences]); 1 for none."""
    lengths = config.q_lengths or config.kv_lengths
    if (sq != sk or sq > _SHORT_SEQ or config.sinks or config.paged or config.segments
            or (config.bottom_right and lengths) or (config.masked and 2 * sq > _SHORT_SEQ)):
        return 1
    p = max(1, min(b, _SHORT_ROW // sq))
    while b % p:
        p -= 1
    return p


def stores_dq(config: AttentionConfig, arch: str, b: int, sq: int, sk: int, head_dim: int,
              head_dim_v: int) -> bool:
    """Whether the backward's main kernel writes dQ itself, where every query block
    meets one key block (Note [One key block per query block] in kernels/sm90_bwd.py):
    all keys in one block, or short sequences that tile the key blocks (Note [Short
    sequences]; every query block, at most as many rows as a key block has keys,
    then lies in one too). Masked, each key block walks every query block it owns
    (``owned_walks`` in rules/ranges.py), so the blocks that the mask hides from all
    keys get their zeros too."""
    keys = dq_store_keys(arch, head_dim, head_dim_v)
    if not keys:
        return False
    if _short_rows(config, b, sq, sk) > 1:
        return keys % sq == 0
    return 0 < sk <= keys


def _packed_rows(p: int, config: AttentionConfig, masks, *xs):
    """(config with segment ids and no lengths, [B, S, ...] arrays as [B / p, p S,
    ...], then the query and key ids [B / p, p S]) of ``p`` sequences per row, the
    lengths among ``masks`` as ids (Note [Short sequences])."""
    b, s = xs[0].shape[:2]
    rows = tuple(x.reshape(b // p, p * s, *x.shape[2:]) for x in xs)
    m = mask_arrays(config, masks)
    seq = jnp.arange(p, dtype=jnp.int32)[:, None]  # [p, 1]: a sequence's place in its row

    def ids(lengths, pad):
        if lengths is None:
            return jnp.broadcast_to(seq, (b // p, p, s)).reshape(b // p, p * s)
        valid = jnp.arange(s) < lengths.astype(jnp.int32).reshape(b // p, p, 1)
        return jnp.where(valid, seq, pad + seq).reshape(b // p, p * s)

    packed = dataclasses.replace(config, segments=True, q_lengths=False, kv_lengths=False,
                                 bottom_right=False)
    return packed, rows, (ids(m.q_lengths, p), ids(m.kv_lengths, 2 * p))


def _stat_rows(p: int, x, packed: bool):
    """An lse-like [B, H, S] as [B / p, H, p S] (packed) or back."""
    if packed:
        b, h, s = x.shape
        return x.reshape(b // p, p, h, s).transpose(0, 2, 1, 3).reshape(b // p, h, p * s)
    bp, h, ps = x.shape
    return x.reshape(bp, h, p, ps // p).transpose(0, 2, 1, 3).reshape(bp * p, h, ps // p)


def _positive_scale(q, config: AttentionConfig):
    """(q, config) with a positive softmax scale, the same scaled scores.

    The kernels take scale > 0: they mask with -inf raw scores and keep the row max
    of the raw q.k, which is the max of the scaled scores only then. A negative
    scale runs as -q with |scale| (negation is exact in 16 bits), one elementwise
    pass over q, and over dq in the backward (``backward`` negates it back)."""
    if config.scale > 0:
        return q, config
    return -q, dataclasses.replace(config, scale=-config.scale)


def _mask_operands(config: AttentionConfig, masks, q, k, *, keys: bool, walk_tiles=None,
                   sk: int | None = None, own_blocks: bool = False):
    """The masked kernels' operands after their others: each query's key interval
    (forward) or each key's query interval (backward), then with segment ids the
    ids, then with ``walk_tiles`` (a backward that takes them: (keys, queries) per
    block) each key block's walk over the query blocks (rules/ranges.py), with
    ``own_blocks`` (a backward that stores dQ) over every query block it owns."""
    m = mask_arrays(config, masks)
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1] if sk is None else sk
    if keys:
        ranges = key_ranges(config, sq, sk, m, b)
    else:
        ranges = query_ranges(config, sq, sk, m, b)
    ops, static = (ranges,), ((2,),)
    if config.segments:
        ops += (m.q_segment_ids.astype(jnp.int32), m.kv_segment_ids.astype(jnp.int32))
        static += ((), ())
    if walk_tiles is not None:
        walks = key_block_ranges(ranges, *walk_tiles)
        if own_blocks:
            walks = owned_walks(walks, *walk_tiles, sq)
        ops += (walks,)
        static += ((2,),)
    return ops, static


def _forward_splits(config: AttentionConfig, arch: str, q, sk: int, hkv: int, dv: int
                    ) -> tuple[bool, int]:
    """(masked kernel, key splits) of a forward call with ``sk`` keys on ``hkv`` heads.
    Calls whose every query row of a KV head fits one tile (decode, short chunks)
    take the masked kernel even without a mask: it packs the GQA heads into the tile
    and splits the keys where the tiles alone would leave SMs idle (Note [Split
    keys] in kernels/sm90_fwd.py)."""
    b, sq, hq, d = q.shape
    group = hq // hkv
    tile_m, _ = fwd_tile_shape(arch, d, dv, True)
    forced = config.num_splits is not None and config.num_splits > 1
    masked = config.masked or sq * group <= tile_m or forced
    if not masked or config.num_splits == 1:
        return masked, 1
    if config.num_splits is not None:
        return True, config.num_splits
    pack = fwd_plan(arch, dtype_name(q.dtype), d, dv, False, 1.0, True, group=group).key.pack_gqa
    heads, rows = (hkv, sq * group) if pack > 1 else (hq, sq)
    return True, split_count(arch, d, dv, b, heads, rows, sk, num_sms())


def _paged_operands(config: AttentionConfig, arch: str, q, k, v, masks):
    """(k, v, the other operands, page table or None, page size or 0, key count) of
    a forward call. A paged call's kernel reads the pools in place (Note [Paged KV]
    in kernels/sm90_fwd.py) where its key blocks and the page size tile each other;
    else the pages are gathered into contiguous K / V here (one XLA gather each)."""
    if not config.paged:
        return k, v, masks, None, 0, k.shape[1]
    n = config.num_mask_operands
    table, masks = masks[n], masks[:n] + masks[n + 1:]
    page_size = k.shape[1]
    tile_n = fwd_tile_shape(arch, q.shape[-1], v.shape[-1], True)[1]
    # sm_100a reads pages smaller than a block as rows of the 128-byte swizzle (Note
    # [Page pieces] in kernels/sm100_fwd.py): head dims that are multiples of 64.
    pieces_error = arch == "sm_100a" and page_size < tile_n and (
        q.shape[-1] % 64 or v.shape[-1] % 64)
    if page_size_error(page_size, tile_n) is not None or pieces_error:
        k, v = gather_pages(k, v, table)
        return k, v, masks, None, 0, k.shape[1]
    return k, v, masks, table, page_size, table.shape[1] * page_size


def combine_splits(out, lse, splits: int, sinks=None, dtype=None):
    """(out [B, Sq, Hq, Dv], lse [B, Hq, Sq]) from the float32 partials of ``splits``
    key splits (out [splits x B, Sq, Hq, Dv], lse [splits x B, Hq, Sq], split major),
    in float32: each split's out weighted by exp(its lse - the total lse). ``sinks``
    [B, Hq] join the denominator here (the split kernels take none). A row no split
    saw (all lse -inf) gets out 0 and lse -inf (or the sink's)."""
    sb, sq, hq, dv = out.shape
    b = sb // splits
    out = out.reshape(splits, b, sq, hq, dv)
    lse = lse.reshape(splits, b, hq, sq)
    top = jnp.max(lse, axis=0)
    if sinks is not None:
        sink = sinks.astype(jnp.float32)[:, :, None]
        top = jnp.maximum(top, sink)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    w = jnp.exp(lse - top)
    total = jnp.sum(w, axis=0)
    if sinks is not None:
        total = total + jnp.exp(sink - top)
    seen = total > 0
    lse_out = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    w = w / jnp.where(seen, total, 1.0)
    # Elementwise and summed (one XLA fusion), not a dot: no TF32 on the way.
    o = jnp.sum(jnp.transpose(w, (0, 1, 3, 2))[..., None] * out, axis=0)
    return o.astype(dtype or out.dtype), lse_out


def forward(q, k, v, *masks, config: AttentionConfig, arch: str):
    """(out [B,Sq,Hq,Dv], lse [B,Hq,Sq] f32) from the forward kernel. masks: the mask
    arrays the config names (AttentionConfig)."""
    q, config = _positive_scale(q, config)
    b, sq, hq, _ = q.shape
    dv = v.shape[-1]
    if b == 0 or hq == 0:  # nothing to compute (a CUDA grid may not be empty)
        return jnp.zeros((b, sq, hq, dv), q.dtype), jnp.zeros((b, hq, sq), jnp.float32)
    p = _short_rows(config, b, sq, k.shape[1])
    if p > 1:  # Note [Short sequences]
        packed, (q, k, v), ids = _packed_rows(p, config, masks, q, k, v)
        out, lse = forward(q, k, v, *ids, config=packed, arch=arch)
        return out.reshape(b, sq, hq, dv), _stat_rows(p, lse, packed=False)
    k, v, masks, table, page_size, sk = _paged_operands(config, arch, q, k, v, masks)
    masked, splits = _forward_splits(config, arch, q, sk, k.shape[2], dv)
    plan = fwd_plan(arch, dtype_name(q.dtype), q.shape[-1], dv, bool(config.causal),
                    float(config.scale), masked, config.segments, config.sinks,
                    config.softcap, hq // k.shape[2], splits > 1, page_size, sq)
    inputs, in_static = (q, k, v), (_BSHD, _BSHD, _BSHD)
    if splits > 1:
        outs = (jax.ShapeDtypeStruct((splits * b, sq, hq, dv), jnp.float32),
                jax.ShapeDtypeStruct((splits * b, hq, sq), jnp.float32))
    else:
        outs = (jax.ShapeDtypeStruct((b, sq, hq, dv), q.dtype),
                jax.ShapeDtypeStruct((b, hq, sq), jnp.float32))
    out_static, aliases = (_BSHD, _BHS), {}
    if plan.tile_counter and not masked:
        # A fresh zero each call (XLA memsets it), updated in place and dropped.
        inputs, in_static = inputs + (jnp.zeros((1,), jnp.int32),), in_static + ((0,),)
        outs, out_static = outs + (jax.ShapeDtypeStruct((1,), jnp.int32),), out_static + ((0,),)
        aliases = {3: 2}
    if masked:
        ops, static = _mask_operands(config, masks, q, k, keys=False, sk=sk)
        if plan.tile_counter:
            # The counter is an extra batch entry of zeros written by the intervals'
            # own fusion, updated in place and dropped (Note [Counter in the
            # intervals] in kernels/sm90_fwd.py).
            ranges = ops[0]
            ranges = jnp.concatenate([ranges, jnp.zeros((1,) + ranges.shape[1:], jnp.int32)])
            ops = (ranges,) + ops[1:]
            aliases = {len(inputs): len(outs)}
            outs = outs + (jax.ShapeDtypeStruct(ranges.shape, jnp.int32),)
            out_static = out_static + (static[0],)
        inputs, in_static = inputs + ops, in_static + static
    if table is not None:
        inputs, in_static = inputs + (table,), in_static + ((),)
    if plan.key.sinks:  # the last operand: the sink logits (B, Hq) float32
        inputs, in_static = inputs + (masks[-1].astype(jnp.float32),), in_static + ((),)
    out, lse = kernel_call(plan.key, plan.build, inputs, outs, in_static=in_static,
                           out_static=out_static, aliases=aliases)[:2]
    if splits > 1:
        out, lse = combine_splits(out, lse, splits, masks[-1] if config.sinks else None,
                                  q.dtype)
    return out, lse


def backward(q, k, v, out, lse, dout, *rest, config: AttentionConfig, arch: str,
             one_key_block: bool | None = None):
    """(dq, dk, dv) from the three backward kernels. rest: the mask arrays the config
    names, then LSE's cotangent, or nothing where it is a symbolic zero (the
    preprocess then reads none).

    config.deterministic: the main kernel adds each query block's dQ partials in a
    fixed key-block order through per-block semaphores, with masks an order computed
    from the key blocks' walks (kernels/dq_layout.py).

    one_key_block: the main kernel writes dQ itself (``stores_dq``, which None asks;
    the packed rows of short sequences pass what it said of the sequences)."""
    if config.scale < 0:  # as forward: -q with |scale|; dL/dq is minus dL/d(-q)
        neg_q, config = _positive_scale(q, config)
        dq, dk, dv = backward(neg_q, k, v, out, lse, dout, *rest, config=config, arch=arch,
                              one_key_block=one_key_block)
        return -dq, dk, dv
    masks, dlse = rest[:config.num_mask_operands], rest[config.num_mask_operands:]
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    if one_key_block is None:
        one_key_block = stores_dq(config, arch, b, sq, sk, q.shape[-1], v.shape[-1])
    p = _short_rows(config, b, sq, sk)
    if p > 1:  # Note [Short sequences]
        packed, rows, ids = _packed_rows(p, config, masks, q, k, v, out, dout)
        stats = [_stat_rows(p, x, packed=True) for x in (lse, *dlse)]
        grads = backward(*rows[:4], stats[0], rows[4], *ids, *stats[1:], config=packed,
                         arch=arch, one_key_block=one_key_block)
        return tuple(g.reshape(x.shape) for g, x in zip(grads, (q, k, v)))
    if b == 0 or hq == 0:  # no query attends to K and V: their gradients are zero
        return tuple(jnp.zeros(x.shape, x.dtype) for x in (q, k, v))
    plan = bwd_plan(arch, dtype_name(q.dtype), q.shape[-1], v.shape[-1], bool(config.causal),
                    float(config.scale), bool(config.deterministic), bool(dlse), config.masked,
                    config.segments, config.softcap, one_key_block)
    mask_ops = mask_static = ()
    if config.masked:
        mask_ops, mask_static = _mask_operands(config, masks, q, k, keys=True,
                                               walk_tiles=plan.walk_tiles,
                                               own_blocks=plan.main.dq_store)
        # The intervals before the preprocess: scheduled between it and the main
        # kernel, their XLA kernels would break the programmatic-dependent-launch
        # chain of the three.
        lse, mask_ops = jax.lax.optimization_barrier((lse, mask_ops))
    ws = plan.workspaces(b, sq, hq)
    if plan.main.dq_store:
        # Note [One key block per query block]: no accumulator, no postprocess.
        ws = ws[:2]
    dpsum, lse_log2, *dq_accum = kernel_call(
        plan.pre, plan.build_pre, (out, dout, lse, *dlse), ws,
        in_static=(_BSHD, _BSHD, _BHS) + (_BHS,) * len(dlse),
        out_static=(_BHS, _BHS, _BSHD)[:len(ws)],
    )
    if plan.main.dq_store:
        grads = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
        dq, dk, dv = kernel_call(plan.main, plan.build_main,
                                 (q, k, v, dout, lse_log2, dpsum) + mask_ops, grads,
                                 in_static=(_BSHD,) * 4 + (_BHS, _BHS) + mask_static,
                                 out_static=(_BSHD,) * 3)[:3]
        return dq, dk, dv
    (dq_accum,) = dq_accum
    inputs = (q, k, v, dout, lse_log2, dpsum, dq_accum)
    in_static = (_BSHD,) * 4 + (_BHS, _BHS, _BSHD)
    outs = (ws[2], jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    out_static, aliases = (_BSHD, _BSHD, _BSHD), {6: 0}
    if plan.sem_tile_m:
        # One int32 semaphore per query block: a fresh zero, updated in place, dropped.
        sem = plan.semaphores(b, sq, hq)
        inputs, in_static = inputs + (jnp.zeros(sem.shape, sem.dtype),), in_static + (_BHS,)
        outs, out_static = outs + (sem,), out_static + (_BHS,)
        aliases[7] = 3
    inputs, in_static = inputs + mask_ops, in_static + mask_static
    dq_accum, dk, dv = kernel_call(plan.main, plan.build_main, inputs, outs,
                                   in_static=in_static, out_static=out_static,
                                   aliases=aliases)[:3]
    (dq,) = kernel_call(plan.post, plan.build_post, (dq_accum,),
                        (jax.ShapeDtypeStruct(q.shape, q.dtype),),
                        in_static=(_BSHD,), out_static=(_BSHD,))
    return dq, dk, dv
