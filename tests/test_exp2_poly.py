"""Host checks of the software exp2 (jax_fa4/kernels/exp2.py, Note [Software exp2]).

The numpy mirror performs the device helper's float32 arithmetic step by step
with the same constants, so these bounds are the kernel's bounds.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")
if importlib.util.find_spec("cutlass") is None:  # exp2.py also holds the device helper
    pytest.skip("nvidia-cutlass-dsl is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def exp2():
    """jax_fa4.kernels.exp2, imported when the tests run, not at collection.

    Importing it imports cutlass, which fixes the DSL's target arch for the
    process; at collection that would precede the kernel test modules' own
    CUTE_DSL_ARCH settings.
    """
    from jax_fa4.kernels import exp2

    return exp2


_N = 1_000_000


def _inputs(seed: int = 0) -> np.ndarray:
    """Uniform float32 samples in [-126, 0], the normal-range domain."""
    return np.random.default_rng(seed).uniform(-126.0, 0.0, _N).astype(np.float32)


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round to bf16 (nearest even) and return the 16-bit patterns as int64."""
    return np.asarray(a).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.int64)


def test_relative_error_bound(exp2):
    x = _inputs()
    exact = np.exp2(x.astype(np.float64))
    rel = np.abs(exp2.exp2_poly_numpy(x).astype(np.float64) - exact) / exact
    assert rel.max() < 1.2e-4, rel.max()


def test_bf16_rounding_agrees(exp2):
    x = _inputs(1)
    exact = np.exp2(x.astype(np.float64))
    got = _bf16_bits(exp2.exp2_poly_numpy(x))
    want = _bf16_bits(exact)  # float64 -> bf16 directly: one rounding
    # All values are positive, so bit distance is ulp distance.
    ulps = np.abs(got - want)
    assert ulps.max() <= 1, ulps.max()
    assert np.mean(ulps == 0) >= 0.985, np.mean(ulps == 0)


def test_integers_and_edges(exp2):
    # f = 0 at integers: the polynomial gives exactly 1, so 2^n is exact.
    n = np.arange(-126, 1, dtype=np.float32)
    assert np.array_equal(exp2.exp2_poly_numpy(n), np.exp2(n))
    # Clamp and flush: -inf (masked scores), below -126 -> 0; never NaN.
    edge = np.array([-np.inf, -1e30, exp2.EXP2_CLAMP, -126.5, exp2.EXP2_FLUSH_BELOW], np.float32)
    out = exp2.exp2_poly_numpy(edge)
    assert np.array_equal(out[:4], np.zeros(4, np.float32))
    assert out[4] == np.float32(2.0**-126)
    assert not np.isnan(out).any()


def test_monotone_on_a_fine_grid(exp2):
    # P must not invert the order of two scores by more than rounding noise.
    x = np.linspace(-20.0, 0.0, 200_001, dtype=np.float32)
    y = exp2.exp2_poly_numpy(x)
    assert np.all(np.diff(y.astype(np.float64)) >= -2e-4 * y[1:])


def test_constants_are_float32_exact(exp2):
    # The device builds Float32 constants; the mirror must see the same values.
    for c in exp2.EXP2_POLY:
        assert float(np.float32(c)) == c


def test_scalar_device_helper_sass(tmp_path):
    """``exp2_poly`` (the polynomial's steps in scalar PTX) compiled alone for
    sm_90a: no MUFU, one round-down add, the three Horner FFMAs, the flush select,
    and every constant of the module in the SASS (so the PTX immediates are the
    module's values). Its values are checked on the GPU against exp2_poly_numpy
    (tests/test_gpu.py)."""
    import re

    import jax
    import jax.numpy as jnp
    from exp2_launcher import exp2_poly_launcher
    from kernel_compile import dump_options, dumped_sass, lower

    n = 256
    sd = jax.ShapeDtypeStruct((n,), jnp.float32)
    # As the GPU test calls it: the output aliases a second (poisoned) input.
    hlo = lower(lambda: exp2_poly_launcher(n), "sm_90a", [sd, sd], [sd], aliases={1: 0},
                compile_options=dump_options(tmp_path))
    assert "CuteDSLRT_NvJaxCutlassCall" in hlo
    sass = dumped_sass(tmp_path)
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\d\s+)?([A-Z0-9_.]+)", sass)
    assert "MUFU.EX2" not in ops, ops
    assert ops.count("FADD.RM") == 1 and ops.count("FFMA") == 3, ops
    for c in (12582912, -127, 0.227564394474029541015625):
        assert str(c) in sass, c
