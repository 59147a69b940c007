"""CPU compile checks for the backward preprocess and postprocess kernels.

Lowers each kernel through cutlass.jax.cutlass_call for sm_90a and sm_100a
(cute.compile runs on the CPU, no GPU needed) and checks that the HLO holds
the custom call. Shapes are dynamic (divisibility 1 on B, S, H), as in use.
"""

import importlib.util
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fa4.kernels.bwd_postprocess import FlashBwdPostprocess
from jax_fa4.kernels.bwd_preprocess import FlashBwdPreprocess, bwd_workspace_shapes

needs_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed"
)

ARCHS = ("sm_90a", "sm_100a")
DTYPES = (jnp.bfloat16, jnp.float16)


def _spec(rank: int, head_dim: int | None = None):
    from cutlass.jax import TensorSpec

    # Explicit 1s on B, S, H: otherwise the bridge would assume the concrete
    # example extents divide every runtime extent.
    div = (1,) * (rank - 1) + ((head_dim,) if head_dim else (1,))
    return TensorSpec(divisibility=div)


def _call(kernel, **kwargs):
    from cutlass.jax import cutlass_call

    return cutlass_call(kernel, **kwargs)


def _lower(call, *args) -> str:
    return jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_workspace_shapes():
    ws = bwd_workspace_shapes(2, 203, 3, 64)
    assert ws["Dpsum"] == ((2, 3, 203), np.dtype(np.float32))
    assert ws["LSElog2"] == ((2, 3, 203), np.dtype(np.float32))
    assert ws["dQaccum"] == ((2, 3, 256, 64), np.dtype(np.float32))
    assert bwd_workspace_shapes(1, 128, 1, 128)["dQaccum"][0] == (1, 1, 128, 128)
    assert bwd_workspace_shapes(1, 1, 1, 128)["dQaccum"][0] == (1, 1, 128, 128)


@needs_cutlass
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_preprocess_compiles(arch, dtype, head_dim):
    batch, seqlen, heads = 2, 203, 3
    ws = bwd_workspace_shapes(batch, seqlen, heads, head_dim)
    kernel = FlashBwdPreprocess(dtype, head_dim, head_dim)
    call = _call(
        kernel,
        output_shape_dtype=tuple(jax.ShapeDtypeStruct(*ws[k]) for k in ws),
        input_spec=[_spec(4, head_dim), _spec(4, head_dim), _spec(3), _spec(3)],
        output_spec=[_spec(3), _spec(3), _spec(4, head_dim)],
        compile_options=f"--gpu-arch {arch}",
    )
    o = jax.ShapeDtypeStruct((batch, seqlen, heads, head_dim), dtype)
    lse = jax.ShapeDtypeStruct((batch, heads, seqlen), jnp.float32)
    text = _lower(call, o, o, lse, lse)
    assert "custom_call" in text


@needs_cutlass
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_postprocess_compiles(arch, dtype, head_dim):
    batch, seqlen, heads = 2, 203, 3
    shape, f32 = bwd_workspace_shapes(batch, seqlen, heads, head_dim)["dQaccum"]
    kernel = FlashBwdPostprocess(dtype, head_dim, head_dim**-0.5)
    call = _call(
        kernel,
        output_shape_dtype=jax.ShapeDtypeStruct((batch, seqlen, heads, head_dim), dtype),
        input_spec=[_spec(4, head_dim)],
        output_spec=[_spec(4, head_dim)],
        compile_options=f"--gpu-arch {arch}",
    )
    text = _lower(call, jax.ShapeDtypeStruct(shape, f32))
    assert "custom_call" in text


@needs_cutlass
def test_rejects_bad_dtype():
    with pytest.raises(TypeError):
        FlashBwdPreprocess(jnp.float32, 128, 128)
    with pytest.raises(ValueError):
        FlashBwdPostprocess(jnp.bfloat16, 100, 0.1)
