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


@pytest.mark.parametrize("sq,sk,d,kw", [
    (300, 128, 128, dict(causal=True)),  # all keys in one block
    (70, 1, 64, dict(causal=False)),
    (1000, 77, 96, dict(causal=False, deterministic=True)),  # one partial: no order
    (32, 32, 128, dict(causal=True)),  # short sequences, 16 per row, 4 per key block
    (128, 128, 64, dict(causal=False)),
])
def test_stored_dq(monkeypatch, kernel_calls, sq, sk, d, kw):
    pre, main, post = _bwd_keys(monkeypatch, kernel_calls, 64 if sq == sk else 2, sq, sk, 4, 2,
                                d, **kw)
    assert pre.dq_store and main.dq_store and main.kind == "bwd" and not post


@pytest.mark.parametrize("b,sq,sk,d,kw", [
    (2, 300, 129, 128, dict(causal=True)),  # two key blocks
    (2, 300, 100, 128, dict(causal=True, kv_lengths=jnp.array([100, 3], jnp.int32))),
    (12, 100, 100, 128, dict(causal=True)),  # packed sequences that straddle key blocks
    (2, 300, 64, 256, dict(causal=True)),  # the wide kernel adds
])
def test_added_dq(monkeypatch, kernel_calls, b, sq, sk, d, kw):
    pre, main, post = _bwd_keys(monkeypatch, kernel_calls, b, sq, sk, 4, 2, d, **kw)
    assert not pre.dq_store and not main.dq_store and post


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
