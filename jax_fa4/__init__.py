"""jax_fa4: FlashAttention-4 for JAX.

Public API:

* :func:`attention` - fused attention on ``[B, S, H, D]`` inputs, causal or not,
  GQA/MQA, optional differentiable LSE; CuTe DSL kernels on H100/H200
  (sm_90a), the pure-JAX reference path elsewhere (logged once).
* :func:`dot_product_attention` - the signature and semantics of
  ``jax.nn.dot_product_attention``.
* :func:`ring_attention` - context parallelism inside ``jax.shard_map``: K/V travel
  around a ring of devices; :func:`to_zigzag` / :func:`from_zigzag` lay a sequence
  out for the load-balanced causal ring.
* :mod:`jax_fa4.flax` - ``attention_fn`` and multi-head attention modules for Flax.
* :mod:`jax_fa4.reference` - the pure-JAX reference (dense and blockwise).
"""

from jax_fa4.api import attention, dot_product_attention
from jax_fa4.ring import from_zigzag, ring_attention, to_zigzag
from jax_fa4.rules import KernelUnavailableError

__version__ = "0.1.0"

__all__ = [
    "KernelUnavailableError",
    "__version__",
    "attention",
    "dot_product_attention",
    "from_zigzag",
    "ring_attention",
    "to_zigzag",
]
