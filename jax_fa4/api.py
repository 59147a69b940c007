"""Validation, defaults and dispatch for the public functions.

Every check here runs at trace time, before anything is compiled: bad input
raises a clear ValueError / TypeError instead of reaching a kernel.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jax_fa4 import reference
from jax_fa4.config import (
    CAUSAL_MODES,
    IMPLEMENTATIONS,
    AttentionConfig,
    any_kernel_support_error,
)
from jax_fa4.reference import Masks
from jax_fa4.rules.primitives import fa4_bwd_p, fa4_fwd_p, log_once


def _check_qkv(query, key, value) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim not in (3, 4):
            raise ValueError(
                f"{name} must have rank 4 [batch, seq, heads, head_dim] or rank 3 "
                f"[seq, heads, head_dim]; got shape {tuple(x.shape)}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating point, got {x.dtype}")
    if not query.ndim == key.ndim == value.ndim:
        raise ValueError(
            "query, key and value must have the same rank; got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(
            "query, key and value must share a dtype; got "
            f"{query.dtype}, {key.dtype}, {value.dtype}"
        )
    q4 = query.shape if query.ndim == 4 else (1,) + tuple(query.shape)
    k4 = key.shape if key.ndim == 4 else (1,) + tuple(key.shape)
    v4 = value.shape if value.ndim == 4 else (1,) + tuple(value.shape)
    if not q4[0] == k4[0] == v4[0]:
        raise ValueError(f"batch sizes differ: query {q4[0]}, key {k4[0]}, value {v4[0]}")
    if k4[1] != v4[1]:
        raise ValueError(f"key and value sequence lengths differ: {k4[1]} vs {v4[1]}")
    if k4[2] != v4[2]:
        raise ValueError(f"key and value head counts differ: {k4[2]} vs {v4[2]}")
    if q4[3] != k4[3]:
        raise ValueError(f"query and key head dims differ: {q4[3]} vs {k4[3]}")
    if k4[2] == 0 or q4[2] % k4[2]:
        raise ValueError(
            f"query heads ({q4[2]}) must be a multiple of key/value heads ({k4[2]}) (GQA/MQA)"
        )
    if q4[1] < 1 or k4[1] < 1:
        raise ValueError(f"sequence lengths must be >= 1; got query {q4[1]}, key {k4[1]}")
    if q4[3] < 1 or v4[3] < 1:
        raise ValueError("head dims must be >= 1")


def _resolve_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, jax.core.Tracer):
        raise TypeError("scale must be a static Python float, not a traced value")
    scale = float(scale)
    if not math.isfinite(scale) or scale == 0.0:
        raise ValueError(f"scale must be finite and non-zero, got {scale}")
    return scale


def _resolve_causal(causal) -> tuple[bool, bool]:
    """(causal, bottom_right) from False / True / "top_left" / "bottom_right"."""
    if isinstance(causal, str) and causal in ("top_left", "bottom_right"):
        return True, causal == "bottom_right"
    if isinstance(causal, bool):
        return causal, False
    raise ValueError(f"causal must be one of {CAUSAL_MODES}, got {causal!r}")


def _resolve_window(window) -> tuple[int | None, int | None] | None:
    if window is None:
        return None
    if not isinstance(window, tuple | list) or len(window) != 2:
        raise ValueError(f"window must be a (left, right) pair, got {window!r}")
    sides = []
    for side in window:
        if side is not None and (isinstance(side, bool) or not isinstance(side, int)):
            raise TypeError(f"window sides must be Python ints or None, got {window!r}")
        if side is not None and side < 0:
            raise ValueError(f"window sides must be >= 0 (or None: unbounded), got {window!r}")
        sides.append(side)
    return None if sides == [None, None] else tuple(sides)


def _resolve_softcap(softcap) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, jax.core.Tracer):
        raise TypeError("softcap must be a static Python float, not a traced value")
    if isinstance(softcap, bool) or not isinstance(softcap, int | float):
        raise TypeError(f"softcap must be a Python float or None, got {softcap!r}")
    softcap = float(softcap)
    if not math.isfinite(softcap) or softcap <= 0.0:
        raise ValueError(f"softcap must be finite and > 0 (or None: off), got {softcap}")
    return softcap


def _check_array(name: str, x, dtype: str, shape: tuple[int, ...],
                 shape_text: str = "") -> jax.Array | None:
    """``x`` (or None) checked to be a ``dtype`` array of ``shape`` (named
    ``shape_text`` in the error, if given)."""
    if x is None:
        return None
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array of {dtype}, got {type(x).__name__}")
    if x.dtype != jnp.dtype(dtype):
        raise TypeError(f"{name} must be {dtype}, got {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape_text}{shape}, got {tuple(x.shape)}")
    return x


def _check_sinks(sinks, hq: int) -> jax.Array | None:
    return _check_array("sinks", sinks, "float32", (hq,), "(query heads,) = ")


def _check_mask_array(name: str, x, shape: tuple[int, ...]) -> jax.Array | None:
    return _check_array(name, x, "int32", shape)


def _check_pages(query, key, value, page_table, kv_lengths, kv_segment_ids):
    """(the keys' logical shape [B, P * page_size, Hkv, D], kv_lengths clamped to
    the table's capacity) of a paged call, its arguments checked: sequence b's keys
    are pages ``page_table[b]`` of the pools ``key`` / ``value`` in table order, cut
    at ``kv_lengths[b]``. (Page ids outside the pool are clamped into it where the
    pages are read: never out of bounds.)"""
    _check_qkv(query, query, query)
    if query.ndim != 4:
        raise ValueError(f"page_table needs a batched query [batch, seq, heads, head_dim]; "
                         f"got shape {tuple(query.shape)}")
    for name, x in (("key", key), ("value", value)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"with page_table, {name} is a page pool [num_pages, page_size, "
                             f"kv_heads, head_dim]; got shape {tuple(x.shape)}")
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(f"key and value pools differ in pages, page size or heads: "
                         f"{tuple(key.shape)} vs {tuple(value.shape)}")
    b = int(query.shape[0])
    if not hasattr(page_table, "shape") or page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table must have shape [batch, pages_per_sequence] = [{b}, P]; "
                         f"got {getattr(page_table, 'shape', type(page_table).__name__)}")
    _check_array("page_table", page_table, "int32", tuple(page_table.shape))
    if kv_lengths is None:
        raise ValueError("page_table needs kv_lengths (int32 [batch]): a sequence's keys are "
                         "its pages cut at its length")
    if kv_segment_ids is not None:
        raise ValueError("page_table does not take kv_segment_ids")
    lengths = _check_mask_array("kv_lengths", kv_lengths, (b,))
    capacity = int(page_table.shape[1]) * int(key.shape[1])
    return (b, capacity, *key.shape[2:]), jnp.clip(lengths, 0, capacity)


def _check_masks(unbatched: bool, b: int, sq: int, sk: int, q_lengths, kv_lengths,
                 q_segment_ids, kv_segment_ids) -> Masks:
    """The mask arrays, batched; shapes and dtypes checked."""
    lead = () if unbatched else (b,)
    if q_segment_ids is None and kv_segment_ids is not None:
        raise ValueError("kv_segment_ids given without q_segment_ids")
    if kv_segment_ids is None and q_segment_ids is not None:
        if sq != sk:
            raise ValueError("q_segment_ids alone serves self-attention (Sq == Sk); "
                             f"got Sq={sq}, Sk={sk}: pass kv_segment_ids too")
        kv_segment_ids = q_segment_ids
    arrays = Masks(
        _check_mask_array("q_lengths", q_lengths, lead),
        _check_mask_array("kv_lengths", kv_lengths, lead),
        _check_mask_array("q_segment_ids", q_segment_ids, lead + (sq,)),
        _check_mask_array("kv_segment_ids", kv_segment_ids, lead + (sk,)),
    )
    if unbatched:
        arrays = Masks(*(None if x is None else x[None] for x in arrays))
    return arrays


def _check_implementation(implementation, dtype, head_dim: int, head_dim_v: int) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    if implementation == "cute":
        err = any_kernel_support_error(dtype, head_dim, head_dim_v)
        if err is not None:
            kind = TypeError if "dtype" in err else ValueError
            raise kind(f"jax_fa4: implementation='cute' but {err}")


# The VJP: gradients of both outputs (out and lse) flow into fa4_bwd. With symbolic
# zeros, an LSE that nothing downstream uses (return_lse=False, the common case)
# sends no cotangent: fa4_bwd then takes no dlse operand, so no zero-filled
# (B, H, Sq) array is written for it and the preprocess reads none.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, masks: tuple, config: AttentionConfig):
    return tuple(fa4_fwd_p.bind(q, k, v, *masks, config=config))


def _attention_fwd(q, k, v, masks, config):
    q, k, v = (x.value for x in (q, k, v))  # CustomVJPPrimal (symbolic_zeros)
    masks = tuple(m.value for m in masks)
    out, lse = fa4_fwd_p.bind(q, k, v, *masks, config=config)
    return (out, lse), (q, k, v, masks, out, lse)


def _attention_bwd(config, residuals, cotangents):
    if config.paged:
        raise ValueError("jax_fa4.attention with a page_table is forward only (inference): "
                         "it has no gradient")
    q, k, v, operands, out, lse = residuals
    dout, dlse = cotangents
    if isinstance(dout, SymbolicZero):  # only the LSE is used
        dout = jnp.zeros(out.shape, out.dtype)
    extra = () if isinstance(dlse, SymbolicZero) else (dlse.astype(jnp.float32),)
    masks = operands[:config.num_mask_operands]
    dq, dk, dv = fa4_bwd_p.bind(
        q, k, v, out, lse, dout.astype(out.dtype), *masks, *extra, config=config
    )
    grads = [None] * len(operands)
    if config.sinks:
        grads[-1] = _sink_gradient(operands[-1], out, lse, dout, extra)
    return dq, dk, dv, tuple(grads)


def _sink_gradient(sinks, out, lse, dout, dlse):
    """d sinks [B, Hq]: lse_i = log(exp(sink) + sum_j exp(s_ij)) moves by the sink's
    share of row i, p_i = exp(sink - lse_i), and out_i by -p_i out_i, so the
    gradient is sum_i p_i (dlse_i - dout_i . out_i) (no operand of the backward
    primitive: its P = exp(S - lse) already holds the sinks)."""
    dpsum = jnp.einsum("bshe,bshe->bhs", dout.astype(jnp.float32), out.astype(jnp.float32))
    if dlse:
        dpsum = dpsum - dlse[0]
    share = jnp.exp(sinks[:, :, None] - lse)
    return -jnp.sum(share * dpsum, axis=-1)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    scale: float | None = None,
    causal: bool | str = False,
    window: tuple[int | None, int | None] | None = None,
    q_lengths: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    page_table: jax.Array | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    deterministic: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Fused scaled dot-product attention (FlashAttention-4 kernels).

    Args:
      query: ``[B, Sq, Hq, D]`` (or unbatched ``[Sq, Hq, D]``).
      key: ``[B, Sk, Hkv, D]``; Hq must be a multiple of Hkv (GQA / MQA).
      value: ``[B, Sk, Hkv, Dv]``.
      scale: softmax scale, default ``1 / sqrt(D)``; any finite non-zero float (the
        kernels run a negative one as ``-q`` with ``|scale|``).
      causal: False; True or "top_left": query i sees key j iff j <= i (as
        ``jax.nn.dot_product_attention(is_causal=True)``); "bottom_right": j <= i +
        Lk - Lq (the KV-cache / chunked-prefill convention, flash-attn's), with each
        sequence's own lengths Lq, Lk, so its last query meets its last key.
      window: (left, right): query i sees key j iff i - left <= j <= i + right, on
        the causal mode's diagonal (shifted by Lk - Lq for "bottom_right"); None
        for an unbounded side. Combines with ``causal`` (both must hold).
      q_lengths, kv_lengths: int32 ``[B]``: keys at or past ``kv_lengths[b]`` are
        masked; query rows at or past ``q_lengths[b]`` give out 0, lse -inf and
        zero gradients. Values beyond the sequence act as its length.
      q_segment_ids, kv_segment_ids: int32 ``[B, Sq]`` / ``[B, Sk]``: query i sees
        key j only where the ids are equal (packed documents). kv_segment_ids
        defaults to q_segment_ids when Sq == Sk.
        A query row that sees no key gives out 0, lse -inf, zero gradients.
      softcap: c (finite, > 0): each scaled logit s = scale * q.k becomes
        c * tanh(s / c) before the softmax (Gemma 2's logit capping); the backward
        applies its derivative. None: off.
      sinks: float32 ``[Hq]``: one learnable logit per query head that joins every
        row's softmax denominator and attends to no value (GPT-OSS, streaming
        attention): out_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij));
        the returned lse includes it, and it gets its gradient. A row that sees no
        key then gives out 0 and lse = sink_h.
      page_table: int32 ``[B, pages_per_sequence]``: a paged KV cache. ``key`` and
        ``value`` are then page pools ``[num_pages, page_size, Hkv, D]`` and sequence
        b's keys are its pages in table order, cut at ``kv_lengths[b]`` (required;
        clamped to the table's capacity); page ids outside the pool are clamped into
        it. Decode (Sq = 1), multi-token decode and chunked prefill (``causal=
        "bottom_right"``). Forward only: differentiating raises. The kernels read
        the pages in place where the page size divides their key blocks or is a
        multiple of them (sm_90a: 16 to 256 at head dims up to 128); other sizes
        are gathered into contiguous K / V first (one XLA gather).
      num_splits: splits of the key range in the forward kernel (flash-decoding):
        where a call's tiles leave SMs idle (decode, short chunks of few
        sequences) each tile's keys are split across CTAs and the float32 partials
        combined. None chooses the count from the shapes, 1 never splits, n > 1
        forces n (benchmarking). One compiled kernel serves every count; the
        reference path ignores it.
      return_lse: also return the log-sum-exp of the scaled logits.
      implementation: None = the CuTe DSL kernel where one exists for the
        device, dtype and head dims, else the reference path (logged once);
        "cute" = the kernel or a clear error; "reference" = pure JAX.
      deterministic: make the backward bitwise reproducible. The default
        backward adds the dQ partials of its key blocks in whatever order they
        finish; this one adds them in a fixed key-block order (every kernel head
        dim and mask; sm_100a compiled, not run on hardware; 0.80-0.98x the
        default backward's speed on the H200 without masks). The forward is
        deterministic either way.

    Returns:
      ``out [B, Sq, Hq, Dv]`` in the input dtype; with ``return_lse``,
      ``(out, lse)`` where ``lse`` is ``[B, Hq, Sq]`` float32 (natural log) and
      differentiable.
    """
    paged = page_table is not None
    if paged:
        logical, kv_lengths = _check_pages(query, key, value, page_table, kv_lengths,
                                           kv_segment_ids)
        dims = jax.ShapeDtypeStruct(logical, key.dtype)
        _check_qkv(query, dims, jax.ShapeDtypeStruct(logical[:3] + value.shape[3:],
                                                     value.dtype))
    else:
        _check_qkv(query, key, value)
    head_dim, head_dim_v = int(query.shape[-1]), int(value.shape[-1])
    _check_implementation(implementation, query.dtype, head_dim, head_dim_v)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a Python bool, got {type(deterministic).__name__}")
    is_causal, bottom_right = _resolve_causal(causal)
    window = _resolve_window(window)
    unbatched = query.ndim == 3
    b = 1 if unbatched else int(query.shape[0])
    sq, sk = int(query.shape[-3]), int(logical[1] if paged else key.shape[-3])
    masks = _check_masks(unbatched, b, sq, sk, q_lengths, kv_lengths, q_segment_ids,
                         kv_segment_ids)
    if q_lengths is None and kv_lengths is None and sq == sk or not (is_causal or window):
        bottom_right = False  # the same diagonal either way
    config = AttentionConfig(
        scale=_resolve_scale(scale, head_dim), causal=is_causal, implementation=implementation,
        deterministic=deterministic, bottom_right=bottom_right, window=window,
        q_lengths=masks.q_lengths is not None, kv_lengths=masks.kv_lengths is not None,
        segments=masks.q_segment_ids is not None, softcap=_resolve_softcap(softcap),
        sinks=_check_sinks(sinks, int(query.shape[-2])) is not None, num_splits=num_splits,
        paged=paged,
    )
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    operands = tuple(x for x in masks if x is not None)
    if paged:
        operands += (page_table,)
    if sinks is not None:
        # Per batch entry, so that vmap and the batch sharding fold and split it with
        # the batch; the broadcast's transpose sums its gradient.
        operands += (jnp.broadcast_to(sinks, (query.shape[0], sinks.shape[0])),)
    out, lse = _attention(query, key, value, operands, config)
    if unbatched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
) -> Any:
    """Drop-in replacement for ``jax.nn.dot_product_attention``.

    Same arguments and semantics (shapes ``[B, T, N, H]`` or ``[T, N, H]``).
    ``implementation`` takes None / "cute" / "reference" ("xla" is read as
    "reference"). ``query_seq_lengths``, ``key_value_seq_lengths`` and
    ``local_window_size`` map onto :func:`attention`'s ``q_lengths``, ``kv_lengths``
    and ``window`` (top-left diagonal, as jax.nn). A bias or a dense mask runs the
    dense reference path, logged once; with ``implementation="cute"`` it raises.
    ``return_residual`` also returns the log-sum-exp as ``[B, T, N]`` in the input
    dtype without a gradient, as jax.nn does (``attention(return_lse=True)`` gives
    it in float32, differentiable); a query row that sees no key has -inf there.
    """
    if implementation == "xla":
        implementation = "reference"
    if implementation == "cudnn":
        raise ValueError("jax_fa4.dot_product_attention: use jax.nn for implementation='cudnn'")
    window = local_window_size
    if isinstance(window, int) and not isinstance(window, bool):
        window = (window, window)
    if query.ndim == 3:  # jax.nn takes the lengths of an unbatched call as [1]
        query_seq_lengths, key_value_seq_lengths = (
            x.reshape(()) if x is not None and getattr(x, "shape", None) == (1,) else x
            for x in (query_seq_lengths, key_value_seq_lengths))
    if bias is None and mask is None:
        out = attention(query, key, value, scale=scale, causal=bool(is_causal),
                        window=None if window is None else tuple(window),
                        q_lengths=query_seq_lengths, kv_lengths=key_value_seq_lengths,
                        return_lse=return_residual, implementation=implementation)
        if not return_residual:
            return out
        out, lse = out
        return out, jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2).astype(out.dtype))

    _check_qkv(query, key, value)
    used = [name for name, val in (("bias", bias), ("mask", mask)) if val is not None]
    if implementation == "cute":
        raise ValueError(
            f"jax_fa4: implementation='cute' cannot take {', '.join(used)}; "
            "use implementation=None or 'reference'"
        )
    if implementation is None:
        log_once(
            f"jax_fa4.dot_product_attention: {', '.join(used)} given; no kernel takes "
            "them, using the dense reference path"
        )
    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
        bias = None if bias is None else jnp.asarray(bias)[None] if bias.ndim == 3 else bias
        mask = None if mask is None else jnp.asarray(mask)[None] if mask.ndim == 3 else mask
    sq, sk = query.shape[1], key.shape[1]
    b = query.shape[0]
    masks = _check_masks(unbatched, b, sq, sk, query_seq_lengths, key_value_seq_lengths,
                         None, None)
    out, lse = reference.attention_dense(
        query,
        key,
        value,
        scale=_resolve_scale(scale, query.shape[-1]),
        causal=bool(is_causal),
        bias=bias,
        mask=None if mask is None else jnp.asarray(mask).astype(bool),
        window=_resolve_window(None if window is None else tuple(window)),
        masks=masks,
    )
    if unbatched:
        out, lse = out[0], lse[0]
    if return_residual:
        return out, jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2).astype(out.dtype))
    return out
