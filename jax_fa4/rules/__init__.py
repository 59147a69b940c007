"""Primitives `fa4_fwd` / `fa4_bwd` and their rules (see primitives.py)."""

from jax_fa4.rules.primitives import KernelUnavailableError, fa4_bwd_p, fa4_fwd_p

__all__ = ["KernelUnavailableError", "fa4_bwd_p", "fa4_fwd_p"]
