"""Public API: validation errors before anything compiles, dispatch, jax.nn parity."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest
from conftest import max_err, rand_qkv

import jax_fa4
from jax_fa4 import reference


def test_default_scale_and_unbatched():
    q, k, v = rand_qkv(0, 1, 9, 11, 2, 2, 16, dtype=jnp.float32)
    out, lse = jax_fa4.attention(q[0], k[0], v[0], return_lse=True)
    ref_out, ref_lse = reference.attention_dense(q, k, v, scale=0.25)
    assert out.shape == (9, 2, 16) and lse.shape == (2, 9)
    assert max_err(out, ref_out[0]) < 1e-5 and max_err(lse, ref_lse[0]) < 1e-5


def test_output_dtype_and_lse_dtype():
    q, k, v = rand_qkv(1, 2, 8, 8, 2, 1, 16, dtype=jnp.bfloat16)
    out, lse = jax_fa4.attention(q, k, v, return_lse=True)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert out.shape == (2, 8, 2, 16) and lse.shape == (2, 2, 8)


@pytest.mark.parametrize(
    "shapes,err,match",
    [
        (((2, 8, 4, 16), (2, 8, 4), (2, 8, 4, 16)), ValueError, "rank"),
        (((2, 8, 4, 16), (2, 8, 4, 32), (2, 8, 4, 16)), ValueError, "head dims differ"),
        (((2, 8, 4, 16), (2, 8, 3, 16), (2, 8, 3, 16)), ValueError, "multiple"),
        (((2, 8, 4, 16), (3, 8, 4, 16), (3, 8, 4, 16)), ValueError, "batch"),
        (((2, 8, 4, 16), (2, 8, 4, 16), (2, 9, 4, 16)), ValueError, "sequence lengths differ"),
        (((2, 8, 4, 16), (2, 0, 4, 16), (2, 0, 4, 16)), ValueError, ">= 1"),
        (((8, 16), (8, 16), (8, 16)), ValueError, "rank"),
    ],
)
def test_bad_shapes_raise(shapes, err, match):
    q, k, v = (jnp.ones(s, jnp.float32) for s in shapes)
    with pytest.raises(err, match=match):
        jax_fa4.attention(q, k, v)


def test_bad_dtypes_raise():
    q = jnp.ones((1, 4, 2, 64), jnp.bfloat16)
    with pytest.raises(TypeError, match="share a dtype"):
        jax_fa4.attention(q, q.astype(jnp.float16), q)
    with pytest.raises(TypeError, match="floating"):
        jax_fa4.attention(q.astype(jnp.int32), q.astype(jnp.int32), q.astype(jnp.int32))
    # float32 has no kernel: implementation="cute" refuses it up front.
    with pytest.raises(TypeError, match="dtype float32 has no kernel"):
        jax_fa4.attention(*(q.astype(jnp.float32),) * 3, implementation="cute")


def test_unsupported_head_dim_with_cute_raises():
    q = jnp.ones((1, 4, 2, 48), jnp.bfloat16)
    with pytest.raises(ValueError, match="head dims"):
        jax_fa4.attention(q, q, q, implementation="cute")


def test_deterministic_argument_checks():
    """deterministic must be a bool."""
    q = jnp.ones((1, 4, 2, 64), jnp.bfloat16)
    with pytest.raises(TypeError, match="deterministic"):
        jax_fa4.attention(q, q, q, deterministic=1)


def test_deterministic_reference_gradients_match_default():
    """On the reference path deterministic=True changes nothing: same gradients."""
    q, k, v = rand_qkv(5, 2, 33, 40, 4, 2, 32, dtype=jnp.float32)

    def grads(det):
        loss = lambda q, k, v: jnp.sum(jax_fa4.attention(  # noqa: E731
            q, k, v, causal=True, implementation="reference", deterministic=det) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    for a, b in zip(grads(False), grads(True)):
        assert float(jnp.max(jnp.abs(a))) > 0
        assert bool(jnp.all(a == b))


def test_bad_scale_and_implementation():
    q = jnp.ones((1, 4, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="scale"):
        jax_fa4.attention(q, q, q, scale=float("nan"))
    with pytest.raises(ValueError, match="implementation"):
        jax_fa4.attention(q, q, q, implementation="triton")
    with pytest.raises(TypeError, match="static"):
        jax.jit(lambda s: jax_fa4.attention(q, q, q, scale=s))(0.5)


def test_cute_on_cpu_raises_not_falls_back():
    q, k, v = rand_qkv(2, 1, 8, 8, 2, 2, 64)
    with pytest.raises(jax_fa4.KernelUnavailableError, match="implementation='cute'"):
        jax_fa4.attention(q, k, v, implementation="cute")


def test_fallback_is_logged_once(caplog):
    from jax_fa4.rules import primitives

    primitives._logged.clear()
    q, k, v = rand_qkv(3, 1, 8, 8, 2, 2, 16, dtype=jnp.float32)
    with caplog.at_level(logging.WARNING, logger="jax_fa4"):
        jax_fa4.attention(q, k, v)
        jax_fa4.attention(q, k, v, causal=True)
    msgs = [r.getMessage() for r in caplog.records if "reference path" in r.getMessage()]
    assert len(msgs) == 1, msgs
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jax_fa4"):
        jax_fa4.attention(q, k, v, implementation="reference")
    assert not caplog.records


@pytest.mark.parametrize("causal", [False, True])
def test_dot_product_attention_matches_jax_nn(causal):
    q, k, v = rand_qkv(4, 2, 37, 37, 4, 2, 32, dtype=jnp.float32)
    got, res = jax_fa4.dot_product_attention(q, k, v, is_causal=causal, return_residual=True)
    want, want_res = jax.nn.dot_product_attention(q, k, v, is_causal=causal, return_residual=True)
    assert max_err(got, want) < 1e-5
    assert res.shape == want_res.shape and max_err(res, want_res) < 1e-4


def test_dot_product_attention_bias_and_dense_mask():
    """A bias or a dense mask takes the dense reference path (alone, and with lengths;
    lengths and windows alone are tested against jax.nn in test_masks.py)."""
    q, k, v = rand_qkv(5, 2, 20, 24, 2, 2, 16, dtype=jnp.float32)
    bias = jax.random.normal(jax.random.key(1), (2, 2, 20, 24))
    mask = jax.random.bernoulli(jax.random.key(2), 0.8, (2, 2, 20, 24)).at[..., 0].set(True)
    lengths = jnp.array([20, 13], jnp.int32), jnp.array([24, 9], jnp.int32)
    for kwargs in (
        dict(bias=bias),
        dict(mask=mask, query_seq_lengths=lengths[0], key_value_seq_lengths=lengths[1]),
    ):
        got = jax_fa4.dot_product_attention(q, k, v, **kwargs)
        want = jax.nn.dot_product_attention(q, k, v, **kwargs)
        if "query_seq_lengths" in kwargs:  # rows past the query length are unspecified
            got, want = got[1, :13], want[1, :13]
        assert max_err(got, want) < 1e-5, kwargs
    with pytest.raises(ValueError, match="cannot take mask"):
        jax_fa4.dot_product_attention(q, k, v, mask=mask, implementation="cute")


def test_package_reads_only_its_two_environment_variables():
    """Configuration is by argument: the library reads $JAX_FA4_ARCH and
    $JAX_FA4_CACHE_DIR and no other JAX_FA4_* variable (an experiment switch read
    at trace time would be in no jit cache key)."""
    import pathlib
    import re

    import jax_fa4

    root = pathlib.Path(jax_fa4.__file__).parent
    names = set()
    for path in root.rglob("*.py"):
        names |= set(re.findall(r"JAX_FA4_[A-Z0-9_]+", path.read_text()))
    assert names == {"JAX_FA4_ARCH", "JAX_FA4_CACHE_DIR"}, names
