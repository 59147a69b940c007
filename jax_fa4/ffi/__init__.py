"""The XLA FFI bridge to CuTe DSL kernels (see bridge.py)."""

from jax_fa4.ffi.bridge import compile_seconds, cutlass_available, kernel_call, poison_outputs

__all__ = ["compile_seconds", "cutlass_available", "kernel_call", "poison_outputs"]
