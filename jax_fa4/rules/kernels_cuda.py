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

from jax_fa4.config import AttentionConfig, deterministic_bwd_support_error, dtype_name
from jax_fa4.ffi import cutlass_available, kernel_call
from jax_fa4.rules.plan import bwd_plan, fwd_plan
from jax_fa4.rules.ranges import key_block_ranges, key_ranges, mask_arrays, query_ranges

# Per tensor: the dimensions that are compile-time constants (the head dims).
_BSHD = (3,)
_BHS = ()


def unavailable(arch: str) -> str | None:
    """None when the kernels of ``arch`` can be compiled here, else why not."""
    return cutlass_available(arch)


def _positive_scale(q, config: AttentionConfig):
    """(q, config) with a positive softmax scale, the same scaled scores.

    The kernels take scale > 0: they mask with -inf raw scores and keep the row max
    of the raw q.k, which is the max of the scaled scores only then. A negative
    scale runs as -q with |scale| (negation is exact in 16 bits), one elementwise
    pass over q, and over dq in the backward (``backward`` negates it back)."""
    if config.scale > 0:
        return q, config
    return -q, dataclasses.replace(config, scale=-config.scale)


def _mask_operands(config: AttentionConfig, masks, q, k, *, keys: bool, walk_tiles=None):
    """The masked kernels' operands after their others: each query's key interval
    (forward) or each key's query interval (backward), then with segment ids the
    ids, then with ``walk_tiles`` (the deterministic backward: (keys, queries) per
    block) each key block's walk over the query blocks (rules/ranges.py)."""
    m = mask_arrays(config, masks)
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    if keys:
        ranges = key_ranges(config, sq, sk, m, b)
    else:
        ranges = query_ranges(config, sq, sk, m, b)
    ops, static = (ranges,), ((2,),)
    if config.segments:
        ops += (m.q_segment_ids.astype(jnp.int32), m.kv_segment_ids.astype(jnp.int32))
        static += ((), ())
    if walk_tiles is not None:
        ops += (key_block_ranges(ranges, *walk_tiles),)
        static += ((2,),)
    return ops, static


def forward(q, k, v, *masks, config: AttentionConfig, arch: str):
    """(out [B,Sq,Hq,Dv], lse [B,Hq,Sq] f32) from the forward kernel. masks: the mask
    arrays the config names (AttentionConfig)."""
    q, config = _positive_scale(q, config)
    b, sq, hq, _ = q.shape
    dv = v.shape[-1]
    if b == 0 or hq == 0:  # nothing to compute (a CUDA grid may not be empty)
        return jnp.zeros((b, sq, hq, dv), q.dtype), jnp.zeros((b, hq, sq), jnp.float32)
    plan = fwd_plan(arch, dtype_name(q.dtype), q.shape[-1], dv, bool(config.causal),
                    float(config.scale), config.masked, config.segments, config.sinks,
                    config.softcap, hq // k.shape[2])
    inputs, in_static = (q, k, v), (_BSHD, _BSHD, _BSHD)
    outs = (jax.ShapeDtypeStruct((b, sq, hq, dv), q.dtype),
            jax.ShapeDtypeStruct((b, hq, sq), jnp.float32))
    out_static, aliases = (_BSHD, _BHS), {}
    if plan.tile_counter:
        # A fresh zero each call (XLA memsets it), updated in place and dropped.
        inputs, in_static = inputs + (jnp.zeros((1,), jnp.int32),), in_static + ((0,),)
        outs, out_static = outs + (jax.ShapeDtypeStruct((1,), jnp.int32),), out_static + ((0,),)
        aliases = {3: 2}
    if config.masked:
        ops, static = _mask_operands(config, masks, q, k, keys=False)
        inputs, in_static = inputs + ops, in_static + static
    if config.sinks:  # the last operand: the sink logits (B, Hq) float32
        inputs, in_static = inputs + (masks[-1].astype(jnp.float32),), in_static + ((),)
    out, lse = kernel_call(plan.key, plan.build, inputs, outs, in_static=in_static,
                           out_static=out_static, aliases=aliases)[:2]
    return out, lse


def backward(q, k, v, out, lse, dout, *rest, config: AttentionConfig, arch: str):
    """(dq, dk, dv) from the three backward kernels. rest: the mask arrays the config
    names, then LSE's cotangent, or nothing where it is a symbolic zero (the
    preprocess then reads none).

    config.deterministic: the main kernel adds each query block's dQ partials in a
    fixed key-block order through per-block semaphores (head dims 64 and 128), with
    masks an order computed from the key blocks' walks (kernels/dq_layout.py)."""
    if config.deterministic:
        err = deterministic_bwd_support_error(arch, q.shape[-1], v.shape[-1])
        if err is not None:
            raise ValueError(err)
    if config.scale < 0:  # as forward: -q with |scale|; dL/dq is minus dL/d(-q)
        neg_q, config = _positive_scale(q, config)
        dq, dk, dv = backward(neg_q, k, v, out, lse, dout, *rest, config=config, arch=arch)
        return -dq, dk, dv
    masks, dlse = rest[:config.num_mask_operands], rest[config.num_mask_operands:]
    b, sq, hq, _ = q.shape
    if b == 0 or hq == 0:  # no query attends to K and V: their gradients are zero
        return tuple(jnp.zeros(x.shape, x.dtype) for x in (q, k, v))
    plan = bwd_plan(arch, dtype_name(q.dtype), q.shape[-1], v.shape[-1], bool(config.causal),
                    float(config.scale), bool(config.deterministic), bool(dlse), config.masked,
                    config.segments, config.softcap)
    mask_ops = mask_static = ()
    if config.masked:
        # A query that sees no key has lse -inf; as +inf its P = exp2(s - lse) is 0
        # for every score, -inf (masked) ones included, where -inf would give NaN.
        lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
        mask_ops, mask_static = _mask_operands(config, masks, q, k, keys=True,
                                               walk_tiles=plan.walk_tiles)
        # The intervals before the preprocess: scheduled between it and the main
        # kernel, their XLA kernels would break the programmatic-dependent-launch
        # chain of the three.
        lse, mask_ops = jax.lax.optimization_barrier((lse, mask_ops))
    ws = plan.workspaces(b, sq, hq)
    dpsum, lse_log2, dq_accum = kernel_call(
        plan.pre, plan.build_pre, (out, dout, lse, *dlse), ws,
        in_static=(_BSHD, _BSHD, _BHS) + (_BHS,) * len(dlse),
        out_static=(_BHS, _BHS, _BSHD),
    )
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
