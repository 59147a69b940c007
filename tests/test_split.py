"""Split keys (flash-decoding, Note [Split keys] in kernels/sm90_fwd.py): the host
mirror of the kernels' split of a tile's key blocks, the float32 combine against a
float64 ground truth (sinks, rows that see no key), the split count chosen from the
shapes, the argument's checks, one compiled kernel for every split count, and on
the GPU (``-m gpu``) decode and short-chunk calls, split or not, against the f32
reference with the 2x rule (GQA 32/8, MQA 32/1, lengths 0, 1 and odd, bottom-right
causal, sinks, softcap), outputs poisoned."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_2x, max_err, rand_qkv

import jax_fa4
from jax_fa4.ffi import poison_outputs
from jax_fa4.kernels.mask import split_blocks
from jax_fa4.rules import kernels_cuda
from jax_fa4.rules.kernels_cuda import combine_splits
from jax_fa4.rules.plan import split_count


@pytest.mark.parametrize("first,end", [(0, 1), (0, 7), (3, 4), (5, 64), (2, 3)])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 8])
def test_splits_cover_the_blocks_once(first, end, num_splits):
    """The non-empty splits cut [first, end) into consecutive pieces in split order;
    an empty split visits block ``first`` with no key visible."""
    block = 128
    covered = []
    for s in range(num_splits):
        lo, hi, (key_lo, key_hi) = split_blocks(first, end, s, num_splits, block)
        if key_lo == key_hi:
            assert (lo, hi, key_lo) == (first, first + 1, 0)
            continue
        assert (key_lo, key_hi) == (lo * block, hi * block) and lo < hi
        covered.extend(range(lo, hi))
    assert covered == list(range(first, end))


def _partials(q, k, v, cuts, scale, sinks=None):
    """float64: (full out, full lse) over all keys, and per split of the keys at
    ``cuts`` its (out, lse) stacked split-major as the kernels write them; rows with
    no key in a split: out 0, lse -inf. ``sinks`` [B, H] join the full softmax."""
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    def softmax_out(s, v, sink=None):
        top = s.max(-1, keepdims=True)
        if sink is not None:
            top = np.maximum(top, sink[..., None, None])
        top = np.where(np.isneginf(top), 0.0, top)
        p = np.exp(s - top)
        total = p.sum(-1, keepdims=True)
        if sink is not None:
            total = total + np.exp(sink[..., None, None] - top)
        o = np.einsum("bhqk,bkhd->bqhd", p / np.where(total > 0, total, 1), v)
        lse = np.where(total[..., 0] > 0, top[..., 0] + np.log(np.maximum(total[..., 0], 1e-300)),
                       -np.inf)
        return o, lse
    outs, lses = [], []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        part = np.full_like(s, -np.inf)
        part[..., lo:hi] = s[..., lo:hi]
        o, lse = softmax_out(part, v)
        outs.append(o)
        lses.append(lse)
    full = softmax_out(s, v, sinks)
    return full, np.concatenate(outs), np.concatenate(lses)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_combine_matches_the_unsplit_softmax(with_sinks):
    rng = np.random.default_rng(3)
    b, sq, sk, h, d = 2, 3, 50, 4, 8
    q, k, v = (rng.standard_normal(x) for x in ((b, sq, h, d), (b, sk, h, d), (b, sk, h, d)))
    k[1, :, 2] = 0  # a head whose keys all tie
    sinks = rng.standard_normal((b, h)) if with_sinks else None
    cuts = [0, 7, 7, 30, 50]  # an empty split among them
    (out, lse), po, pl = _partials(q, k, v, cuts, 0.4, sinks)
    got_out, got_lse = combine_splits(jnp.asarray(po, jnp.float32), jnp.asarray(pl, jnp.float32),
                                      len(cuts) - 1, None if sinks is None else
                                      jnp.asarray(sinks, jnp.float32), jnp.float32)
    assert got_out.shape == out.shape and got_lse.shape == lse.shape
    assert max_err(got_out, out) < 1e-5
    assert max_err(got_lse, lse) < 1e-5


def test_combine_rows_that_no_split_saw():
    """Out 0 and lse -inf (with sinks: lse the sink), nothing NaN."""
    splits, b, sq, h, d = 3, 1, 2, 2, 4
    # Non-zero partials: rows that no split saw weigh none of them.
    po = jax.random.normal(jax.random.key(3), (splits * b, sq, h, d), jnp.float32) + 5.0
    pl = jnp.full((splits * b, h, sq), -jnp.inf, jnp.float32)
    out, lse = combine_splits(po, pl, splits, None, jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    assert np.all(np.asarray(out, np.float32) == 0) and np.all(np.isneginf(np.asarray(lse)))
    sinks = jnp.array([[0.5, -2.0]], jnp.float32)
    out, lse = combine_splits(po, pl, splits, sinks, jnp.float32)
    assert np.all(np.asarray(out) == 0)
    np.testing.assert_allclose(np.asarray(lse), np.broadcast_to(np.asarray(sinks)[:, :, None],
                                                                (b, h, sq)), rtol=1e-6)


def test_split_count_fills_the_sms_once():
    # Decode, hdim 128 (128-row tiles, 128-key blocks), 132 SMs.
    def count(b, heads, rows, sk):
        return split_count("sm_90a", 128, 128, b, heads, rows, sk, 132)
    assert count(1, 8, 4, 8192) == 16  # 8 tiles: 16 splits of 4 blocks
    assert count(1, 1, 32, 131072) == 128  # MQA, one tile: the most splits
    assert count(4, 8, 4, 8192) == 4
    assert count(64, 8, 4, 8192) == 1  # 512 tiles fill the SMs
    assert count(1, 8, 4, 512) == 2  # 4 blocks: splits of at least 2
    assert count(1, 8, 4, 128) == 1
    assert split_count("sm_100a", 128, 128, 1, 8, 4, 8192, 148) == 18


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_num_splits_must_be_a_positive_int(bad):
    q, k, v = rand_qkv(0, 1, 1, 64, 4, 2, 64)
    with pytest.raises(ValueError, match="num_splits"):
        jax.jit(lambda q, k, v: jax_fa4.attention(q, k, v, num_splits=bad)).trace(q, k, v)


def test_one_kernel_serves_every_split_count(monkeypatch, kernel_calls):
    """Decode lowers to the masked forward with split keys: float32 partials of
    B x splits batches; the split count changes the partials' shape, not the
    kernel; num_splits=1 and a long query take the kernels without a split."""
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_90a")
    b, sk, hq, hkv, d = 2, 4096, 32, 8, 128
    q, k, v = rand_qkv(1, b, 1, sk, hq, hkv, d)
    lengths = jnp.array([4000, 17], jnp.int32)
    for n in (None, 3, 16, 1):
        jax.jit(lambda q, k, v, n=n: jax_fa4.attention(
            q, k, v, kv_lengths=lengths, causal="bottom_right", num_splits=n,
            implementation="cute")).trace(q, k, v).lower(lowering_platforms=("cuda",))
    keys = [c[0] for c in kernel_calls]
    assert [key.split_kv for key in keys] == [True, True, True, False]
    assert len({key for key in keys[:3]}) == 1
    assert all(key.masked and key.pack_gqa == 4 for key in keys)
    # Auto: 2 x 8 packed tiles on 132 SMs -> 8 splits.
    config = jax_fa4.config.AttentionConfig(scale=0.1, causal=True, bottom_right=True,
                                            kv_lengths=True)
    assert kernels_cuda._forward_splits(config, "sm_90a", q, sk, hkv, d) == (True, 8)
    kernel_calls.clear()
    q_long, k_long, v_long = rand_qkv(2, 1, 512, 512, 4, 4, 128)
    jax.jit(lambda q, k, v: jax_fa4.attention(q, k, v, causal=True, implementation="cute")
            ).trace(q_long, k_long, v_long).lower(lowering_platforms=("cuda",))
    assert [(c[0].masked, c[0].split_kv) for c in kernel_calls] == [(False, False)]


# ----------------------------------------------------------------------------- GPU

# (B, Sq, Sk, Hq, Hkv, D, kv_lengths or None, causal)
GPU_CASES = [
    (3, 1, 3000, 32, 8, 128, [0, 1, 2999], "bottom_right"),
    (2, 1, 5000, 32, 1, 128, [4097, 63], "bottom_right"),
    (4, 1, 2048, 16, 16, 64, None, False),
    (2, 5, 1500, 8, 2, 64, [1500, 77], "bottom_right"),  # multi-token decode
    (1, 1, 4000, 8, 8, 256, [3333], "bottom_right"),
    (2, 64, 9000, 8, 8, 128, None, True),  # a short chunk against a long cache
    (3, 1, 3000, 32, 8, 96, [0, 1, 2999], "bottom_right"),  # hdim 96's 192-row tile
]


def _attend(q, k, v, case, implementation, num_splits=None, **extra):
    *_, lengths, causal = case
    kw = dict(causal=causal, return_lse=True, implementation=implementation, **extra)
    if lengths is not None:
        kw["kv_lengths"] = jnp.asarray(lengths, jnp.int32)
    if implementation == "cute":
        kw["num_splits"] = num_splits
    return jax_fa4.attention(q, k, v, **kw)


def _check(got, q, k, v, case, **extra):
    ref = functools.partial(_attend, case=case, implementation="reference", **extra)
    hi_out, hi_lse = jax.jit(ref)(*(x.astype(jnp.float32) for x in (q, k, v)))
    lo_out, lo_lse = jax.jit(ref)(q, k, v)
    out, lse = got
    assert out.dtype == q.dtype
    assert_close_2x(out, hi_out, lo_out, atol=1e-3, name="out")
    lse, hi_lse, lo_lse = (np.asarray(x, np.float64) for x in (lse, hi_lse, lo_lse))
    assert np.array_equal(np.isneginf(lse), np.isneginf(hi_lse))
    seen = ~np.isneginf(hi_lse)
    assert_close_2x(lse[seen], hi_lse[seen], lo_lse[seen], atol=1e-3, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "x".join(map(str, c[:6])))
@pytest.mark.parametrize("num_splits", [None, 1, 3, 16])
def test_decode_against_the_reference(case, num_splits):
    b, sq, sk, hq, hkv, d, *_ = case
    q, k, v = rand_qkv(sk + d, b, sq, sk, hq, hkv, d)
    fn = jax.jit(functools.partial(_attend, case=case, implementation="cute",
                                   num_splits=num_splits))
    with poison_outputs():
        got = fn(q, k, v)
    _check(got, q, k, v, case)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 5])
def test_decode_with_sinks_and_softcap(num_splits):
    """The split kernels take no sinks: the combine adds them."""
    case = (2, 1, 3000, 32, 8, 128, [2500, 0], "bottom_right")
    q, k, v = rand_qkv(11, *case[:6])
    sinks = jax.random.normal(jax.random.key(5), (32,), jnp.float32)
    extra = dict(sinks=sinks, softcap=20.0)
    fn = jax.jit(functools.partial(_attend, case=case, implementation="cute",
                                   num_splits=num_splits, **extra))
    with poison_outputs():
        got = fn(q, k, v)
    _check(got, q, k, v, case, **extra)
