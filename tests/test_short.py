"""Many short sequences (Note [Short sequences] in rules/kernels_cuda.py): the CUDA
lowering lays p sequences of the batch end to end as packed documents for the
masked kernels. On the CPU: how many share a row, and that the lowering calls the
masked kernels with segment ids on the packed shape; on the GPU (``-m gpu``): out,
lse and every gradient (the lse's too) against the f32 reference, 2x rule, causal
or not, GQA, odd batch sizes, outputs poisoned."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_step_2x, attention_step, rand_qkv

import jax_fa4
from jax_fa4.config import AttentionConfig
from jax_fa4.ffi import poison_outputs
from jax_fa4.rules.kernels_cuda import _short_rows, _stat_rows


@pytest.mark.parametrize("b,s,p", [(4096, 32, 16), (1024, 128, 4), (7, 16, 7), (6, 128, 3),
                                   (12, 100, 4), (1, 32, 1), (8, 129, 1)])
def test_rows_hold_the_largest_divisor_of_the_batch_that_fits(b, s, p):
    assert _short_rows(AttentionConfig(scale=1.0, causal=True), b, s, s) == p


def test_masks_sinks_and_cross_attention_keep_one_sequence_per_row():
    for config in (AttentionConfig(scale=1.0, causal=True, kv_lengths=True),
                   AttentionConfig(scale=1.0, causal=True, window=(4, 0)),
                   AttentionConfig(scale=1.0, causal=False, sinks=True)):
        assert _short_rows(config, 64, 32, 32) == 1
    assert _short_rows(AttentionConfig(scale=1.0, causal=False), 64, 32, 48) == 1


def test_stat_rows_round_trip():
    x = jnp.arange(6 * 3 * 5, dtype=jnp.float32).reshape(6, 3, 5)
    packed = _stat_rows(2, x, packed=True)
    assert packed.shape == (3, 3, 10)
    # Row r of head h: sequence 2r's positions, then sequence 2r + 1's.
    np.testing.assert_array_equal(packed[1, 2], np.concatenate([x[2, 2], x[3, 2]]))
    np.testing.assert_array_equal(_stat_rows(2, packed, packed=False), x)


def test_short_sequences_lower_to_the_masked_kernels(monkeypatch, kernel_calls):
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_90a")
    q, k, v = rand_qkv(0, 64, 32, 32, 4, 2, 64)

    def loss(q, k, v):
        return jax_fa4.attention(q, k, v, causal=True, implementation="cute").sum()

    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(
        lowering_platforms=("cuda",))
    keys = {c[0].kind: c for c in kernel_calls}
    fwd_key, fwd_inputs = keys["fwd"]
    assert fwd_key.masked and fwd_key.segments
    assert fwd_inputs[0][0] == (4, 512, 4, 64)  # 16 sequences of 32 per row
    assert keys["bwd"][0].masked and keys["bwd"][0].segments


SHAPES = [(64, 32, 4, 2, 64, True), (24, 128, 4, 4, 128, True), (9, 100, 2, 1, 128, False),
          (10, 48, 8, 2, 256, True), (32, 16, 3, 3, 64, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("b,s,hq,hkv,d,causal", SHAPES, ids=lambda c: str(c))
def test_short_sequences_against_the_reference(b, s, hq, hkv, d, causal):
    q, k, v = rand_qkv(b + s + d, b, s, s, hq, hkv, d)

    def attend(q, k, v, implementation):
        return jax_fa4.attention(q, k, v, causal=causal, return_lse=True,
                                 implementation=implementation)

    run = attention_step(attend, (b, s, hq, d), (b, hq, s))
    with poison_outputs():
        got = jax.jit(functools.partial(run, "cute"))(q, k, v)
    assert_step_2x(run, q, k, v, got)
