"""Shared test helpers: GPU detection, inputs, and the 2x-of-low-precision rule."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

# Eight CPU devices for the shard_map and ring tests (read when JAX's CPU backend starts).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
if shutil.which("nvidia-smi") is None:
    # No GPU here: the tests' XLA programs are small and run once, so XLA's backend
    # optimisations cost more time than they save (the CPU suite runs ~40% faster).
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Tests compile kernels afresh: never load binaries an earlier run left in ~/.cache.
# pytest-xdist workers inherit the controller's fresh folder, so each kernel of a run
# compiles once, not once per worker.
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ["JAX_FA4_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax_fa4_test_cache_")


def _suitable_gpu() -> str | None:
    """None if a GPU with jax_fa4 kernels (sm_90a; sm_100a) and the CuTe DSL are here."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return "no CUDA device"
    if not devices:
        return "no CUDA device"
    cc = getattr(devices[0], "compute_capability", None)
    if str(cc) not in ("9.0", "10.0"):
        return f"GPU compute capability {cc} has no jax_fa4 kernels (9.0, 10.0)"
    from jax_fa4.ffi import cutlass_available

    return cutlass_available()


def pytest_collection_modifyitems(config, items):
    why = _suitable_gpu()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"needs an sm_90a/sm_100a GPU: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def rand_qkv(seed, b, sq, sk, hq, hkv, d, dv=None, dtype=jnp.bfloat16):
    dv = d if dv is None else dv
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, sq, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, sk, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, sk, hkv, dv), jnp.float32).astype(dtype)
    return q, k, v


def max_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def weighted_loss(fn, out_shape, lse_shape):
    """A scalar of ``fn``'s (out, lse) that weighs every element differently (cos /
    sin ramps); rows with lse -inf count 0 there."""
    w = jnp.cos(jnp.arange(np.prod(out_shape), dtype=jnp.float32).reshape(out_shape))
    wl = jnp.sin(jnp.arange(np.prod(lse_shape), dtype=jnp.float32).reshape(lse_shape))

    def f(*args):
        o, l = fn(*args)
        return jnp.sum(o * w) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0) * wl)
    return f


def assert_close_2x(got, ref_hi, ref_lo, atol: float, name: str = "") -> None:
    """Error of `got` vs the f32 reference <= 2x the low-precision error + atol."""
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), f"{name}: non-finite values"
    err = max_err(got, ref_hi)
    base = max_err(ref_lo, ref_hi)
    assert err <= 2 * base + atol, f"{name}: err {err:.3e} > 2 * {base:.3e} + {atol:.1e}"


def assert_lse_2x(got, hi, lo) -> None:
    """-inf exactly where the reference has it (rows that see no key), else the 2x
    rule."""
    got, hi, lo = (np.asarray(x, np.float64) for x in (got, hi, lo))
    empty = np.isneginf(hi)
    assert np.array_equal(np.isneginf(got), empty), "lse: -inf rows differ"
    assert not np.isnan(got).any()
    if not empty.all():
        assert_close_2x(got[~empty], hi[~empty], lo[~empty], atol=1e-3, name="lse")


def attention_step(attend, out_shape, lse_shape):
    """run(implementation, q, k, v) -> ((out, lse), (dq, dk, dv)): ``attend(q, k, v,
    implementation)`` and the gradients of its ``weighted_loss``."""
    def run(implementation, *xs):
        f = functools.partial(attend, implementation=implementation)
        loss = weighted_loss(f, out_shape, lse_shape)
        return f(*xs), jax.grad(loss, argnums=(0, 1, 2))(*xs)
    return run


def assert_step_2x(run, q, k, v, got) -> None:
    """``got``, run("cute", q, k, v)'s result (``attention_step``): out, lse and every
    gradient (in q's dtype) within the 2x rule of the reference's at float32 and at
    q's dtype; lse -inf on the rows where the reference's is."""
    (out, lse), grads = got
    ref = jax.jit(functools.partial(run, "reference"))
    (hi_out, hi_lse), hi_grads = ref(*(x.astype(jnp.float32) for x in (q, k, v)))
    (lo_out, lo_lse), lo_grads = ref(q, k, v)
    assert_close_2x(out, hi_out, lo_out, atol=1e-3, name="out")
    assert_lse_2x(lse, hi_lse, lo_lse)
    for n, g, h, lw in zip(("dq", "dk", "dv"), grads, hi_grads, lo_grads):
        assert g.dtype == q.dtype
        assert_close_2x(g, h, lw, atol=2e-3, name=n)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Every kernel call the lowering makes from now on, recorded as (KernelKey,
    [(shape, dtype) of each input]) (the CuTe DSL needed: the test skips without it)."""
    pytest.importorskip("cutlass")
    from jax_fa4.rules import kernels_cuda

    calls = []
    real = kernels_cuda.kernel_call

    def call(key, build, inputs, *args, **kwargs):
        calls.append((key, [(tuple(x.shape), x.dtype) for x in inputs]))
        return real(key, build, inputs, *args, **kwargs)

    monkeypatch.setattr(kernels_cuda, "kernel_call", call)
    return calls
