"""Flax integration: an ``attention_fn`` for ``nnx.MultiHeadAttention`` and
``linen.MultiHeadDotProductAttention``.

Usage::

    nnx.MultiHeadAttention(..., attention_fn=jax_fa4.flax.attention_fn)
    mha(x, is_causal=True)                      # nnx passes is_causal through
    linen.MultiHeadDotProductAttention(
        ..., attention_fn=functools.partial(jax_fa4.flax.attention_fn, is_causal=True))

Calls the kernels need nothing the kernel lacks for run on them; a dense mask,
a bias, active dropout or weight sowing (``module``) run Flax's own
``dot_product_attention`` instead, logged once, never silently ignored.
"""

from __future__ import annotations

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
      Other arguments as ``flax.nnx.dot_product_attention``.

    Returns:
      ``[batch..., q_len, heads, head_dim_v]``.
    """
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
    out = attention(
        fold(query), fold(key), fold(value), causal=is_causal, implementation=implementation,
        deterministic=deterministic_backward,
    )
    return out.reshape(batch_shape + out.shape[-3:])


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
