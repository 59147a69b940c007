"""jax_fa4: FlashAttention-4 for JAX.

Public API:

* :func:`attention` - fused attention on ``[B, S, H, D]`` inputs, causal or not,
  GQA/MQA, optional differentiable LSE; CuTe DSL kernels on H100/H200
  (sm_90a), the pure-JAX reference path elsewhere (logged once).
* :func:`dot_product_attention` - the signature and semantics of
  ``jax.nn.dot_product_attention``.
* :mod:`jax_fa4.flax` - ``attention_fn`` for Flax's multi-head attention modules.
* :mod:`jax_fa4.reference` - the pure-JAX reference (dense and blockwise).
"""

from jax_fa4.api import attention, dot_product_attention
from jax_fa4.rules import KernelUnavailableError

__version__ = "0.1.0"

__all__ = ["KernelUnavailableError", "attention", "dot_product_attention", "__version__"]
