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
from jax_fa4 import reference
from jax_fa4.config import AttentionConfig
from jax_fa4.ffi import poison_outputs
from jax_fa4.rules.kernels_cuda import _packed_rows, _short_rows, _stat_rows


@pytest.mark.parametrize("b,s,p", [(4096, 32, 16), (1024, 128, 4), (7, 16, 7), (6, 128, 3),
                                   (12, 100, 4), (1, 32, 1), (8, 129, 1)])
def test_rows_hold_the_largest_divisor_of_the_batch_that_fits(b, s, p):
    assert _short_rows(AttentionConfig(scale=1.0, causal=True), b, s, s) == p


def test_lengths_and_windows_pack_too():
    for config in (AttentionConfig(scale=1.0, causal=True, kv_lengths=True),
                   AttentionConfig(scale=1.0, causal=False, q_lengths=True, kv_lengths=True),
                   AttentionConfig(scale=1.0, causal=True, window=(4, 0)),
                   AttentionConfig(scale=1.0, causal=True, bottom_right=True, window=(4, 2))):
        assert _short_rows(config, 64, 32, 32) == 16


def test_sinks_segments_per_sequence_diagonals_and_cross_attention_keep_one_per_row():
    for config in (AttentionConfig(scale=1.0, causal=False, sinks=True),
                   AttentionConfig(scale=1.0, causal=True, segments=True),
                   AttentionConfig(scale=1.0, causal=True, bottom_right=True, q_lengths=True)):
        assert _short_rows(config, 64, 32, 32) == 1
    assert _short_rows(AttentionConfig(scale=1.0, causal=False), 64, 32, 48) == 1
    # Masked, sequences longer than half a key block share none.
    lengths = AttentionConfig(scale=1.0, causal=False, kv_lengths=True)
    assert _short_rows(lengths, 64, 64, 64) == 8 and _short_rows(lengths, 64, 65, 65) == 1


@pytest.mark.parametrize("kw", [
    dict(causal=True, q_lengths=[32, 0, 5, 32, 17, 1], kv_lengths=[32, 9, 0, 40, 17, 3]),
    dict(q_lengths=[1, 32, 31, 0, 2, 20]),
    dict(causal=True, window=(3, 0), kv_lengths=[32, 4, 10, 0, 31, 32]),
    dict(causal="bottom_right", window=(2, 5)),
])
def test_packed_rows_keep_each_sequences_mask(kw):
    """The packed rows' segment ids and mask (``_packed_rows``) give every sequence
    what its own lengths, causal mode and window give it: the reference on the packed
    rows against the reference per sequence, rows that see nothing included."""
    b, s, p = 6, 32, 3
    q, k, v = rand_qkv(5, b, s, s, 2, 2, 64, dtype=jnp.float32)
    causal = kw.get("causal", False)
    config = AttentionConfig(scale=0.125, causal=bool(causal),
                             bottom_right=causal == "bottom_right", window=kw.get("window"),
                             q_lengths="q_lengths" in kw, kv_lengths="kv_lengths" in kw)
    lengths = tuple(jnp.asarray(kw[n], jnp.int32) for n in ("q_lengths", "kv_lengths")
                    if n in kw)
    packed, (pq, pk, pv), (qid, kid) = _packed_rows(p, config, lengths, q, k, v)
    assert packed.segments and not (packed.q_lengths or packed.kv_lengths or
                                    packed.bottom_right)

    def ref(q, k, v, config, masks):
        return reference.attention_dense(
            q, k, v, scale=0.125, causal=config.causal, bottom_right=config.bottom_right,
            window=config.window, masks=masks)

    want_out, want_lse = ref(q, k, v, config, reference.Masks(
        *(jnp.asarray(kw[n], jnp.int32) if n in kw else None
          for n in ("q_lengths", "kv_lengths"))))
    out, lse = ref(pq, pk, pv, packed, reference.Masks(None, None, qid, kid))
    np.testing.assert_allclose(out.reshape(want_out.shape), want_out, rtol=1e-5, atol=1e-6)
    lse = _stat_rows(p, lse, packed=False)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    assert np.isneginf(want_lse).any() == ("q_lengths" in kw or "kv_lengths" in kw)
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=1e-5)


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
