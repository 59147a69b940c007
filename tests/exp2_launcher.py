"""A kernel that applies the scalar software exp2 (``exp2_poly``) to a vector:
its SASS is checked on the CPU (test_exp2_poly.py) and its values on the GPU
against the numpy mirror (test_gpu.py). Imported inside those tests, since
importing cutlass fixes the DSL's target arch for the process."""

from __future__ import annotations

from cutlass import cute

from jax_fa4.kernels.exp2 import exp2_poly


def exp2_poly_launcher(n: int):
    """A jit-able launch(stream, x, y) writing exp2_poly(x[i]) to y[i] for float32
    vectors of n elements (n a multiple of 128)."""

    @cute.kernel
    def body(mx: cute.Tensor, my: cute.Tensor):
        i = cute.arch.block_idx()[0] * 128 + cute.arch.thread_idx()[0]
        my[i] = exp2_poly(mx[i])

    @cute.jit
    def launch(stream, mx: cute.Tensor, my: cute.Tensor):
        body(mx, my).launch(grid=(n // 128, 1, 1), block=(128, 1, 1), stream=stream)

    return launch
