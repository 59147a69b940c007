"""Flax integration: an ``attention_fn`` for ``nnx.MultiHeadAttention`` and
``linen.MultiHeadDotProductAttention``.

Usage::

    nnx.MultiHeadAttention(..., attention_fn=jax_fa4.flax.attention_fn)
    mha(x, is_causal=True)                      # nnx passes is_causal through
    linen.MultiHeadDotProductAttention(
        ..., attention_fn=functools.partial(jax_fa4.flax.attention_fn, is_causal=True))

Static masks (``window``, ``causal="bottom_right"``) bind into ``attention_fn`` with
``functools.partial``. Flax's attention modules pass no per-batch arrays to their
``attention_fn``, so for lengths and segment ids use :class:`MultiHeadAttention`
(nnx) or :class:`MultiHeadDotProductAttention` (linen): Flax's modules with the same
parameters and initialisation, whose call also takes ``q_lengths``, ``kv_lengths``,
``q_segment_ids`` and ``kv_segment_ids``.

``MultiHeadAttention(..., sinks=True)`` (nnx) also learns one sink logit per head
(``jax_fa4.attention``'s ``sinks``), a parameter initialised to 0.

A dense mask, a bias, active dropout or weight sowing (``module``) run Flax's own
``dot_product_attention`` instead, logged once, never silently ignored.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import jax
import jax.numpy as jnp

from jax_fa4.api import attention
from jax_fa4.rules.primitives import log_once


def attention_fn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    promote_dtype: Any = None,
    is_causal: bool = False,
    implementation: str | None = None,
    deterministic_backward: bool = False,
    causal: bool | str | None = None,
    window: tuple[int | None, int | None] | None = None,
    q_lengths: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Flax-compatible attention on jax_fa4.

    Args:
      query: ``[batch..., q_len, heads, head_dim]``.
      key, value: ``[batch..., kv_len, kv_heads, head_dim(_v)]``.
      mask: boolean ``[batch..., heads, q_len, kv_len]`` (False hides a key).
      is_causal: top-left causal masking, on the kernel.
      deterministic_backward: bitwise reproducible gradients
        (``jax_fa4.attention(deterministic=True)``); bind it with
        ``functools.partial``. Flax's own ``deterministic`` only turns dropout off.
      causal: a causal mode of :func:`jax_fa4.attention` ("top_left",
        "bottom_right"); overrides ``is_causal`` when given.
      window, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids: as in
        :func:`jax_fa4.attention`, with the batch dims folded into one ``[B]``.
      softcap: the logit cap of :func:`jax_fa4.attention` (bind it with
        ``functools.partial``).
      sinks: the sink logits ``[heads]`` of :func:`jax_fa4.attention` (the nnx
        :class:`MultiHeadAttention` with ``sinks=True`` passes its own).
      Other arguments as ``flax.nnx.dot_product_attention``.

    Returns:
      ``[batch..., q_len, heads, head_dim_v]``.
    """
    bound = _bound_masks.get() or {}
    q_lengths = bound.get("q_lengths", q_lengths)
    kv_lengths = bound.get("kv_lengths", kv_lengths)
    q_segment_ids = bound.get("q_segment_ids", q_segment_ids)
    kv_segment_ids = bound.get("kv_segment_ids", kv_segment_ids)
    sinks = bound.get("sinks", sinks)
    dropout_active = dropout_rate > 0.0 and not deterministic
    reasons = [
        name
        for name, active in (
            ("mask", mask is not None),
            ("bias", bias is not None),
            ("dropout", dropout_active),
            ("sow_weights (module)", module is not None),
        )
        if active
    ]
    if dtype is not None:
        query, key, value = (x.astype(dtype) for x in (query, key, value))
    elif not query.dtype == key.dtype == value.dtype:
        dt = jnp.result_type(query, key, value)
        query, key, value = (x.astype(dt) for x in (query, key, value))
    masked = any(x is not None for x in (window, q_lengths, kv_lengths, q_segment_ids,
                                         kv_segment_ids, softcap, sinks)) or causal not in (
                                             None, False, True)
    if reasons and masked:
        raise ValueError("jax_fa4.flax.attention_fn: lengths, segment ids, windows, causal "
                         f"modes, softcap and sinks do not combine with {', '.join(reasons)}")
    if reasons:
        if implementation == "cute":
            raise ValueError(f"jax_fa4: implementation='cute' cannot take {', '.join(reasons)}")
        log_once(
            f"jax_fa4.flax.attention_fn: {', '.join(reasons)} given; no kernel takes "
            "them, using Flax's dot_product_attention"
        )
        return _flax_reference(
            query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
            deterministic, precision, module, is_causal,
        )
    batch_shape = query.shape[:-3]
    fold = lambda x: x.reshape((-1,) + x.shape[-3:])  # noqa: E731
    fold_ids = lambda x: None if x is None else x.reshape((-1,) + x.shape[-1:])  # noqa: E731
    fold_lengths = lambda x: None if x is None else x.reshape(-1)  # noqa: E731
    out = attention(
        fold(query), fold(key), fold(value), causal=is_causal if causal is None else causal,
        window=window, q_lengths=fold_lengths(q_lengths), kv_lengths=fold_lengths(kv_lengths),
        q_segment_ids=fold_ids(q_segment_ids), kv_segment_ids=fold_ids(kv_segment_ids),
        softcap=softcap, sinks=sinks, implementation=implementation,
        deterministic=deterministic_backward,
    )
    return out.reshape(batch_shape + out.shape[-3:])


# The per-batch mask arrays (and the nnx module's sink logits) of the module call in
# progress (MultiHeadAttention, MultiHeadDotProductAttention), read by attention_fn
# while it is traced: Flax's modules call their attention_fn with a fixed set of
# arguments.
_bound_masks: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jax_fa4_masks",
                                                                           default=None)


@contextlib.contextmanager
def _masks_bound(**arrays):
    token = _bound_masks.set({k: v for k, v in arrays.items() if v is not None})
    try:
        yield
    finally:
        _bound_masks.reset(token)


def _mask_doc(cls):
    cls.__call__.__doc__ = (
        f"{cls.__mro__[1].__name__}'s call, plus the per-batch masks of "
        ":func:`jax_fa4.attention`: ``q_lengths`` / ``kv_lengths`` ``[batch]`` and "
        "``q_segment_ids`` / ``kv_segment_ids`` ``[batch, length]``, int32.")
    return cls


def _modules():
    from flax import linen, nnx

    @_mask_doc
    class MultiHeadAttention(nnx.MultiHeadAttention):
        """``flax.nnx.MultiHeadAttention`` on jax_fa4, whose call takes lengths and
        segment ids. Same constructor; ``attention_fn`` defaults to jax_fa4's.
        ``sinks=True``: one more parameter, ``sinks`` ``[num_heads]`` float32 (zeros),
        the sink logits of every row's softmax (``jax_fa4.attention``'s ``sinks``)."""

        def __init__(self, *args, attention_fn=attention_fn, sinks: bool = False, **kwargs):
            super().__init__(*args, attention_fn=attention_fn, **kwargs)
            self.sinks = (nnx.Param(jnp.zeros((self.num_heads,), jnp.float32)) if sinks
                          else None)

        def __call__(self, *args, q_lengths=None, kv_lengths=None, q_segment_ids=None,
                     kv_segment_ids=None, **kwargs):
            sinks = None if self.sinks is None else self.sinks.value
            with _masks_bound(q_lengths=q_lengths, kv_lengths=kv_lengths,
                              q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                              sinks=sinks):
                return super().__call__(*args, **kwargs)

    @_mask_doc
    class MultiHeadDotProductAttention(linen.MultiHeadDotProductAttention):
        """``flax.linen.MultiHeadDotProductAttention`` on jax_fa4, whose call takes
        lengths and segment ids. Same fields; ``attention_fn`` defaults to jax_fa4's."""

        attention_fn: Any = attention_fn

        def __call__(self, *args, q_lengths=None, kv_lengths=None, q_segment_ids=None,
                     kv_segment_ids=None, **kwargs):
            with _masks_bound(q_lengths=q_lengths, kv_lengths=kv_lengths,
                              q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids):
                return super().__call__(*args, **kwargs)

    return MultiHeadAttention, MultiHeadDotProductAttention


def __getattr__(name):
    # Built on first use, so that importing jax_fa4.flax does not import Flax.
    if name in ("MultiHeadAttention", "MultiHeadDotProductAttention"):
        mods = dict(zip(("MultiHeadAttention", "MultiHeadDotProductAttention"), _modules(),
                        strict=True))
        globals().update(mods)
        return mods[name]
    raise AttributeError(name)


def _flax_reference(
    query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
    deterministic, precision, module, is_causal,
):
    from flax import linen

    if is_causal:
        sq, sk = query.shape[-3], key.shape[-3]
        causal = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None]
        mask = causal if mask is None else jnp.logical_and(mask, causal)
    hq, hkv = query.shape[-2], key.shape[-2]
    if hq != hkv:
        # Flax's reference wants equal head counts: repeat kv heads (GQA).
        key = jnp.repeat(key, hq // hkv, axis=-2)
        value = jnp.repeat(value, hq // hkv, axis=-2)
    return linen.dot_product_attention(
        query, key, value, bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng, dropout_rate=dropout_rate, deterministic=deterministic,
        precision=precision, module=module,
    )
