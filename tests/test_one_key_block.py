"""Backwards whose every query block meets one key block (Note [One key block per
query block] in kernels/sm90_bwd.py): the sm_90a main kernel writes dQ itself, with
no fp32 accumulator (the preprocess writes none) and no postprocess. On the CPU:
which calls the lowering plans that way (all keys in one block without a mask,
short sequences that tile the key blocks) and which not; on the GPU (``-m gpu``):
out, lse and every gradient against the f32 reference, 2x rule, outputs poisoned
(a block of dQ the kernel failed to store stays NaN), deterministic too."""

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
from jax_fa4.rules.plan import bwd_plan, dq_store_keys


def _bwd_keys(monkeypatch, kernel_calls, b, sq, sk, hq, hkv, d, **kw):
    """The backward's (pre, main) kernel keys of one jitted gradient, lowered for an
    sm_90a GPU, and whether it runs a postprocess."""
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_90a")
    q, k, v = rand_qkv(0, b, sq, sk, hq, hkv, d)

    def loss(q, k, v):
        return jax_fa4.attention(q, k, v, implementation="cute", **kw).sum()

    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(
        lowering_platforms=("cuda",))
    keys = {c[0].kind: c[0] for c in kernel_calls}
    main = keys.get("bwd") or keys["bwd_det"]
    return keys["bwd_pre"], main, "bwd_post" in keys


def _lengths(*xs):
    return jnp.array(xs, jnp.int32)


@pytest.mark.parametrize("sq,sk,d,kw", [
    (300, 128, 128, dict(causal=True)),  # all keys in one block
    (70, 1, 64, dict(causal=False)),
    (1000, 77, 96, dict(causal=False, deterministic=True)),  # one partial: no order
    (32, 32, 128, dict(causal=True)),  # short sequences, 16 per row, 4 per key block
    (128, 128, 64, dict(causal=False)),
    # Masked: one key block, its walk widened to every query block.
    (300, 100, 128, dict(causal=True, kv_lengths=_lengths(100, 3))),
    (300, 100, 64, dict(causal="bottom_right", window=(30, 0), q_lengths=_lengths(300, 9))),
    (200, 128, 128, dict(q_segment_ids=jnp.zeros((2, 200), jnp.int32),
                         kv_segment_ids=jnp.ones((2, 128), jnp.int32))),
    (128, 128, 64, dict(q_lengths=jnp.arange(64, dtype=jnp.int32) * 2)),  # one per row
    # Short sequences with lengths, packed (Note [Short sequences]).
    (32, 32, 128, dict(causal=True, kv_lengths=jnp.arange(64, dtype=jnp.int32) % 33)),
])
def test_stored_dq(monkeypatch, kernel_calls, sq, sk, d, kw):
    pre, main, post = _bwd_keys(monkeypatch, kernel_calls, 64 if sq == sk else 2, sq, sk, 4, 2,
                                d, **kw)
    assert pre.dq_store and main.dq_store and main.kind == "bwd" and not post


@pytest.mark.parametrize("b,sq,sk,d,kw", [
    (2, 300, 129, 128, dict(causal=True)),  # two key blocks
    (2, 300, 129, 128, dict(causal=True, kv_lengths=_lengths(100, 3))),
    (12, 100, 100, 128, dict(causal=True)),  # packed sequences that straddle key blocks
    (12, 48, 48, 128, dict(q_lengths=jnp.arange(12, dtype=jnp.int32))),
    (2, 300, 64, 256, dict(causal=True)),  # the wide kernel adds
])
def test_added_dq(monkeypatch, kernel_calls, b, sq, sk, d, kw):
    pre, main, post = _bwd_keys(monkeypatch, kernel_calls, b, sq, sk, 4, 2, d, **kw)
    assert not pre.dq_store and not main.dq_store and post


def test_masked_walks_visit_every_query_block(monkeypatch, kernel_calls):
    """A masked backward that stores dQ gets walks over every query block (rows the
    mask hides from the keys included); one that adds dQ the mask's own walks."""
    from jax_fa4.rules import kernels_cuda

    widened = []
    real = kernels_cuda.owned_walks
    monkeypatch.setattr(kernels_cuda, "owned_walks",
                        lambda *a: widened.append(a[1:]) or real(*a))
    kw = dict(causal="bottom_right", window=(30, 0), q_lengths=_lengths(300, 9))
    for sk, stored in ((100, True), (129, False)):
        _, main, _ = _bwd_keys(monkeypatch, kernel_calls, 2, 300, sk, 4, 2, 128, **kw)
        assert main.dq_store == stored
    assert widened == [(128, 64, 300)]
    # The operands themselves, on concrete masks: the bottom-right diagonal hides
    # query blocks 0-2 of batch 0 from the keys, the lengths blocks 1-4 of batch 1.
    config = AttentionConfig(scale=1.0, causal=True, bottom_right=True, window=(30, 0),
                             q_lengths=True)
    q, k, _ = rand_qkv(0, 2, 300, 100, 4, 2, 128)
    for own in (False, True):
        (*_, walks), _ = kernels_cuda._mask_operands(
            config, (_lengths(300, 9),), q, k, keys=True, walk_tiles=(128, 64),
            own_blocks=own)
        walks = np.asarray(walks)
        if own:
            assert np.all(walks[:, 0, :2] == [0, 5])
        else:
            assert tuple(walks[0, 0, :2]) == (3, 5) and tuple(walks[1, 0, :2]) == (0, 1)


def test_plan():
    assert dq_store_keys("sm_90a", 128, 128) == 128
    assert dq_store_keys("sm_90a", 256, 256) == dq_store_keys("sm_100a", 128, 128) == 0
    plan = bwd_plan("sm_90a", "bfloat16", 64, 64, True, 0.1, True, False, one_key_block=True)
    assert plan.main.kind == "bwd" and plan.sem_tile_m == 0
    assert plan.pre.dq_store and plan.main.dq_store and not plan.post.dq_store
    with pytest.raises(ValueError, match="adds every dQ partial"):
        bwd_plan("sm_100a", "bfloat16", 128, 128, True, 0.1, False, False, one_key_block=True)


# Two keys, not one: with one key dV is a plain sum of dO, where XLA on the GPU keeps
# the bf16 reference's dO in float32 (it drops the round trip through bf16), so that
# reference is no bf16 baseline there.
CASES = [(3, 300, 128, 4, 2, 128, True, False), (2, 77, 2, 2, 2, 64, False, False),
         (2, 1000, 77, 6, 2, 96, False, True), (1, 64, 100, 2, 1, 128, True, True),
         (64, 32, 32, 4, 2, 128, True, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,causal,det", CASES, ids=lambda c: str(c))
def test_against_the_reference(b, sq, sk, hq, hkv, d, causal, det):
    q, k, v = rand_qkv(b + sq + sk, b, sq, sk, hq, hkv, d)

    def attend(q, k, v, implementation):
        return jax_fa4.attention(q, k, v, causal=causal, deterministic=det, return_lse=True,
                                 implementation=implementation)

    run = attention_step(attend, (b, sq, hq, d), (b, hq, sq))
    with poison_outputs():
        step = jax.jit(functools.partial(run, "cute"))
        got = step(q, k, v)
        if det:
            for g, h in zip(got[1], step(q, k, v)[1]):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(h))
    assert_step_2x(run, q, k, v, got)


def _random_lengths(seed, b, s):
    """[B] lengths drawn in [0, s], with 0, 1 and s among them."""
    rng = np.random.default_rng(seed)
    return np.concatenate([[0, 1, s], rng.integers(0, s + 1, b - 3)]).astype(np.int32)


# Masked (Note [One key block per query block]: walks over every query block).
MASKED = [
    # Packed 4 per row at hdim 128 (two 64-row query blocks per key block): a
    # sequence of one query leaves a whole block that no key sees; an empty one.
    ((4, 128, 128, 4, 4, 128), dict(q_lengths=[128, 70, 1, 0], kv_lengths=[128, 64, 5, 128]),
     jnp.bfloat16, False),
    # Short sequences with lengths, 16 per row, GQA.
    ((64, 32, 32, 4, 2, 128), dict(causal=True, q_lengths=_random_lengths(1, 64, 32),
                                   kv_lengths=_random_lengths(2, 64, 32)), jnp.bfloat16, False),
    ((24, 64, 64, 2, 2, 64), dict(causal=True, window=(9, 0), kv_lengths=_random_lengths(
        3, 24, 64)), jnp.float16, True),
    # Cross-attention to a short key set with key lengths (not packed).
    ((2, 1000, 77, 6, 2, 96), dict(kv_lengths=[77, 10]), jnp.bfloat16, False),
    # Bottom-right causal window: query blocks that no key sees.
    ((2, 300, 100, 4, 2, 128), dict(causal="bottom_right", window=(30, 0),
                                    q_lengths=[300, 9]), jnp.bfloat16, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,kw,dtype,det", MASKED, ids=lambda c: str(c)[:40])
def test_masked_against_the_reference(kernel_calls, shape, kw, dtype, det):
    b, sq, sk, hq, hkv, d = shape
    q, k, v = rand_qkv(b + sq + d, b, sq, sk, hq, hkv, d, dtype=dtype)
    kw = {n: jnp.asarray(x, jnp.int32) if isinstance(x, list | np.ndarray) else x
          for n, x in kw.items()}

    def attend(q, k, v, implementation):
        return jax_fa4.attention(q, k, v, deterministic=det, return_lse=True,
                                 implementation=implementation, **kw)

    run = attention_step(attend, (b, sq, hq, d), (b, hq, sq))
    with poison_outputs():
        step = jax.jit(functools.partial(run, "cute"))
        got = step(q, k, v)
        kinds = {c[0].kind: c[0] for c in kernel_calls}
        assert kinds["bwd"].dq_store and "bwd_post" not in kinds
        if det:
            for g, h in zip(got[1], step(q, k, v)[1]):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(h))
    assert_step_2x(run, q, k, v, got)
