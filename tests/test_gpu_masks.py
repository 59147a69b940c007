"""The masked kernels (key intervals, rules/ranges.py) on an sm_90a GPU against the
f32 reference: causal modes, windows, lengths, segment ids (contiguous or not) and
their compositions, with GQA, odd lengths and rows that see no key (out 0, lse
-inf, zero gradients, no NaN), and the deterministic backward with masks (bitwise
equal gradients over two runs). Outputs are poisoned; the 2x rule as in test_gpu.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_2x, assert_lse_2x, rand_qkv

import jax_fa4
from jax_fa4 import reference
from jax_fa4.config import AttentionConfig
from jax_fa4.ffi import poison_outputs
from jax_fa4.rules.kernels_cuda import stores_dq

pytestmark = pytest.mark.gpu

CALL = "CuteDSLRT_NvJaxCutlassCall"


def _docs(b, s, sizes, seed):
    """[B, S] int32 ids of packed documents of the given sizes (cycled), contiguous."""
    rng = np.random.default_rng(seed)
    out = np.zeros((b, s), np.int32)
    for n in range(b):
        pos, doc = 0, int(rng.integers(0, 5))
        while pos < s:
            size = sizes[(doc + n) % len(sizes)]
            out[n, pos:pos + size] = doc
            pos, doc = pos + size, doc + 1
    return out


def _cases(b, sq, sk):
    """name -> the mask keyword arguments of ``jax_fa4.attention`` (numpy arrays)."""
    rng = np.random.default_rng(sq * 31 + sk)
    kvl = np.array([sk, max(sk // 2 + 3, 1)] * b, np.int32)[:b]
    ql = np.array([max(sq - 5, 1), 0] * b, np.int32)[:b]
    seg = _docs(b, max(sq, sk), [97, 300, 5, 211], sq)
    return {
        "causal_kv_lengths": dict(causal=True, kv_lengths=kvl),
        "q_lengths_empty": dict(q_lengths=ql, kv_lengths=np.array([sk, 0] * b, np.int32)[:b]),
        "window": dict(window=(37, 11)),
        "window_causal": dict(causal=True, window=(100, 0)),
        "bottom_right": dict(causal="bottom_right"),
        "bottom_right_lengths_window": dict(causal="bottom_right", window=(64, None),
                                            q_lengths=ql[::-1].copy(), kv_lengths=kvl),
        "segments_causal": dict(causal=True, q_segment_ids=seg[:, :sq],
                                kv_segment_ids=seg[:, :sk]),
        "segments_scattered": dict(q_segment_ids=rng.integers(0, 3, (b, sq)).astype(np.int32),
                                   kv_segment_ids=rng.integers(0, 3, (b, sk)).astype(np.int32)),
        "everything": dict(causal="bottom_right", window=(90, 7), q_segment_ids=seg[:, :sq],
                           kv_segment_ids=seg[:, :sk], q_lengths=ql, kv_lengths=kvl),
    }


def _ref(q, k, v, kw, dtype):
    masks = reference.Masks(
        *(None if kw.get(n) is None else jnp.asarray(kw[n])
          for n in ("q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids")))
    causal = kw.get("causal", False)
    return reference.attention_dense(
        q, k, v, scale=q.shape[-1] ** -0.5, causal=bool(causal),
        bottom_right=causal == "bottom_right", window=kw.get("window"), masks=masks,
        compute_dtype=dtype)


def _kernel(q, k, v, kw, deterministic=False):
    return jax_fa4.attention(q, k, v, return_lse=True, implementation="cute",
                             deterministic=deterministic,
                             **{n: jnp.asarray(x) if isinstance(x, np.ndarray) else x
                                for n, x in kw.items()})


def _calls(b, sq, sk, d):
    """Kernel calls of a masked forward + backward step: the forward, the
    preprocess, the main kernel and the postprocess, none where the main kernel
    writes dQ itself (Note [One key block per query block] in kernels/sm90_bwd.py;
    no shape here packs short sequences)."""
    config = AttentionConfig(scale=1.0, causal=False, kv_lengths=True)
    return 3 if stores_dq(config, "sm_90a", b, sq, sk, d, d) else 4


SHAPES = [(2, 300, 300, 4, 2), (2, 113, 503, 4, 1), (2, 503, 113, 2, 2), (1, 1000, 1000, 2, 1)]
# Three shapes at hdim 128, one each at 64 and 256 (the other classes), to keep the
# device run short; at hdim 64 also groups of 3 and 8 query heads per KV head, which
# the forward packs into its 192-row tiles (Note [Packed GQA]), and tiles of 113 rows
# and of 29 rows of 4 heads, which it runs on 128-row tiles (``short_tiles`` in
# kernels/sm90_fwd.py).
CASES = ([(s, 128) for s in SHAPES[1:]] + [(SHAPES[1], 64), (SHAPES[0], 256),
                                           ((2, 300, 300, 6, 2), 64),
                                           ((1, 257, 1031, 8, 1), 64),
                                           ((2, 113, 203, 4, 4), 64),
                                           ((2, 29, 300, 8, 2), 64)])
NAMES = list(_cases(1, 8, 8))


def _check_against_reference(name, shape, d, deterministic=False):
    """The kernels' out, lse and gradients of mask ``name`` against the f32
    reference (2x rule); returns the jitted step and its gradients."""
    b, sq, sk, hq, hkv = shape
    dtype = jnp.float16 if name == "window" else jnp.bfloat16
    kw = _cases(b, sq, sk)[name]
    q, k, v = rand_qkv(sq + 3 * d, b, sq, sk, hq, hkv, d, dtype=dtype)
    kd = jax.random.split(jax.random.key(sk), 2)
    dout = jax.random.normal(kd[0], (b, sq, hq, d)).astype(dtype)
    dlse = jax.random.normal(kd[1], (b, hq, sq))

    def run(f):
        (out, lse), pullback = jax.vjp(f, q, k, v)
        return (out, lse), pullback((dout, dlse))

    fn = jax.jit(lambda: run(functools.partial(_kernel, kw=kw, deterministic=deterministic)))
    with poison_outputs():
        assert fn.lower().as_text().count(CALL) == _calls(b, sq, sk, d)
        (out, lse), grads = fn()
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]

    @functools.partial(jax.jit, static_argnums=4)
    def ref_vjp(q, k, v, dout, dtype):
        outs, pullback = jax.vjp(lambda q, k, v: _ref(q, k, v, kw, dtype), q, k, v)
        return outs, pullback((dout, dlse))

    (hi_out, hi_lse), hi_grads = ref_vjp(*f32, dout.astype(jnp.float32), jnp.float32)
    (lo_out, lo_lse), lo_grads = ref_vjp(q, k, v, dout, dtype)
    assert_close_2x(out, hi_out, lo_out, atol=1e-3, name="out")
    assert_lse_2x(lse, hi_lse, lo_lse)
    for n, g, h, lw in zip(("dq", "dk", "dv"), grads, hi_grads, lo_grads):
        assert g.dtype == dtype
        assert_close_2x(g, h, lw, atol=2e-3, name=n)
    return fn, grads


@pytest.mark.parametrize("shape,d", CASES, ids=lambda c: "x".join(map(str, c))
                         if isinstance(c, tuple) else f"d{c}")
@pytest.mark.parametrize("name", NAMES)
def test_masked_forward_and_backward(name, shape, d):
    _check_against_reference(name, shape, d)


# The deterministic backward: six key blocks reach most query blocks, so the order
# of the dQ adds matters; GQA; rows without keys (q_lengths_empty).
DET_SHAPE = (2, 300, 700, 4, 2)
DET_CASES = [("window", 128), ("q_lengths_empty", 128), ("segments_scattered", 128),
             ("bottom_right_lengths_window", 128), ("causal_kv_lengths", 64),
             ("segments_causal", 64), ("window_causal", 64), ("everything", 64),
             ("everything", 192), ("window_causal", 256)]


@pytest.mark.parametrize("name,d", DET_CASES)
def test_deterministic_masked_backward(name, d):
    """deterministic=True with masks (Note [Masked dQ order]): the 2x rule as the
    default backward, and the gradients bitwise equal over two runs."""
    fn, grads = _check_against_reference(name, DET_SHAPE, d, deterministic=True)
    with poison_outputs():
        _, again = fn()
    for n, g, h in zip(("dq", "dk", "dv"), grads, again):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16),
                                      np.asarray(h).view(np.uint16), err_msg=n)


def test_rows_without_keys_are_zero_with_zero_gradients():
    b, sq, sk, hq, hkv, d = 2, 200, 300, 2, 2, 128
    q, k, v = rand_qkv(7, b, sq, sk, hq, hkv, d)
    kw = dict(q_lengths=jnp.array([150, 0], jnp.int32), kv_lengths=jnp.array([0, 300], jnp.int32))

    def loss(q, k, v):
        out, lse = _kernel(q, k, v, kw)
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

    with poison_outputs():
        (out, lse) = jax.jit(functools.partial(_kernel, kw=kw))(q, k, v)
        dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert np.all(np.asarray(out, np.float32) == 0)
    assert np.all(np.isneginf(np.asarray(lse)))
    for g in (dq, dk, dv):
        assert np.all(np.asarray(g, np.float32) == 0)
