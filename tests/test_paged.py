"""A paged KV cache through ``jax_fa4.attention(..., page_table=...)``: sequence b's
keys are its pages of the key / value pools in table order, cut at kv_lengths[b].
Paged equals contiguous attention with the same lengths (shuffled page tables,
lengths 0, 1, page size - 1, page size and odd ones; decode, multi-token decode and
chunked prefill with bottom-right causal; GQA and MQA; with sinks and softcap);
against a float64 ground truth; page ids out of the pool and lengths past the table
never read out of bounds; bad arguments raise; differentiating raises."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_err

import jax_fa4

D = 16


def _cache(seed, lengths, page_size, pages_per_seq, hkv, extra_pages=3):
    """(key pool, value pool, page table, contiguous K, V [B, P * page_size, ...]):
    each sequence's pages at shuffled places in the pools."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    num_pages = b * pages_per_seq + extra_pages
    k_pool = rng.standard_normal((num_pages, page_size, hkv, D)).astype(np.float32)
    v_pool = rng.standard_normal((num_pages, page_size, hkv, D)).astype(np.float32)
    table = rng.permutation(num_pages)[:b * pages_per_seq].reshape(b, pages_per_seq)
    k = k_pool[table].reshape(b, pages_per_seq * page_size, hkv, D)
    v = v_pool[table].reshape(b, pages_per_seq * page_size, hkv, D)
    return (jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(table, jnp.int32),
            jnp.asarray(k), jnp.asarray(v))


def _ground_truth(q, k, v, lengths, scale, causal):
    """float64 numpy: bottom-right causal (each sequence's last query meets its last
    key) or none, keys cut at the lengths; rows with no key: out 0, lse -inf."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, hq, _ = q.shape
    g = hq // k.shape[2]
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    lse = np.full((b, hq, sq), -np.inf)
    for n in range(b):
        lk = int(lengths[n])
        for h in range(hq):
            s = q[n, :, h] @ k[n, :lk, h // g].T * scale
            if causal:
                vis = np.arange(lk)[None] <= np.arange(sq)[:, None] + lk - sq
                s = np.where(vis, s, -np.inf)
            for i in range(sq):
                if np.isfinite(s[i]).any():
                    m = s[i].max()
                    p = np.exp(s[i] - m)
                    out[n, i, h] = p @ v[n, :lk, h // g] / p.sum()
                    lse[n, h, i] = m + np.log(p.sum())
    return out, lse


@pytest.mark.parametrize("sq,causal,hq,hkv,page_size", [
    (1, False, 4, 2, 16),            # decode, GQA
    (3, "bottom_right", 4, 1, 16),   # multi-token decode, MQA
    (7, "bottom_right", 4, 2, 8),    # chunked prefill
])
def test_paged_equals_contiguous_and_ground_truth(sq, causal, hq, hkv, page_size):
    lengths = np.array([0, 1, page_size - 1, page_size, 3 * page_size + 5], np.int32)
    k_pool, v_pool, table, k, v = _cache(sq + hq, lengths, page_size, 4, hkv)
    q = jax.random.normal(jax.random.key(sq), (len(lengths), sq, hq, D), jnp.float32)
    kw = dict(causal=causal, kv_lengths=jnp.asarray(lengths), return_lse=True, scale=0.3)
    out, lse = jax.jit(lambda q, kp, vp, t: jax_fa4.attention(q, kp, vp, page_table=t, **kw))(
        q, k_pool, v_pool, table)
    want_out, want_lse = jax_fa4.attention(q, k, v, **kw)
    assert max_err(out, want_out) < 1e-6 and max_err(lse[jnp.isfinite(lse)],
                                                     want_lse[jnp.isfinite(want_lse)]) < 1e-6
    gt_out, gt_lse = _ground_truth(q, k, v, lengths, 0.3, causal == "bottom_right")
    assert max_err(out, gt_out) < 1e-5
    assert np.array_equal(np.isneginf(np.asarray(lse)), np.isneginf(gt_lse))
    fin = np.isfinite(gt_lse)
    assert np.max(np.abs(np.asarray(lse)[fin] - gt_lse[fin])) < 1e-5
    # A sequence of length 0 sees nothing: out 0, lse -inf, no NaN.
    assert not np.asarray(out[0]).any() and np.isneginf(np.asarray(lse[0])).all()
    assert not np.isnan(np.asarray(out)).any()


def test_paged_with_sinks_and_softcap_equals_contiguous():
    lengths = np.array([5, 33, 0], np.int32)
    k_pool, v_pool, table, k, v = _cache(1, lengths, 16, 3, 2)
    q = jax.random.normal(jax.random.key(2), (3, 2, 4, D), jnp.float32)
    kw = dict(causal="bottom_right", kv_lengths=jnp.asarray(lengths), softcap=2.0,
              sinks=jnp.array([0.5, -1.0, 1.0, 0.0], jnp.float32), return_lse=True)
    got = jax_fa4.attention(q, k_pool, v_pool, page_table=table, **kw)
    want = jax_fa4.attention(q, k, v, **kw)
    for g, w in zip(got, want):
        assert max_err(g, w) < 1e-6


def test_pages_and_lengths_out_of_range_stay_in_bounds():
    """Page ids past the pool are clamped into it, lengths past the table's capacity
    cut at it: the result equals the clamped call's and is finite."""
    lengths = np.array([40, 16], np.int32)
    k_pool, v_pool, table, _, _ = _cache(3, lengths, 16, 2, 1, extra_pages=0)
    q = jax.random.normal(jax.random.key(4), (2, 1, 2, D), jnp.float32)
    bad = table.at[1, 1].set(1000)
    out = jax_fa4.attention(q, k_pool, v_pool, page_table=bad, kv_lengths=jnp.array([99, 16]))
    clamped = bad.at[1, 1].set(k_pool.shape[0] - 1)
    want = jax_fa4.attention(q, k_pool, v_pool, page_table=clamped,
                             kv_lengths=jnp.array([32, 16]))
    assert np.isfinite(np.asarray(out)).all() and max_err(out, want) == 0.0


@pytest.mark.parametrize("change,err,match", [
    (dict(page_table=jnp.zeros((2, 3), jnp.float32)), TypeError, "int32"),
    (dict(page_table=jnp.zeros((2,), jnp.int32)), ValueError, "pages_per_sequence"),
    (dict(page_table=jnp.zeros((3, 2), jnp.int32)), ValueError, r"\[2, P\]"),
    (dict(kv_lengths=None), ValueError, "needs kv_lengths"),
    (dict(kv_segment_ids=jnp.zeros((2, 32), jnp.int32)), ValueError, "kv_segment_ids"),
    (dict(key=jnp.zeros((4, 16, 1, D))), ValueError, "key and value pools"),
    (dict(query=jnp.zeros((1, 2, D))), ValueError, "batched query"),
])
def test_bad_paged_arguments_raise(change, err, match):
    args = dict(query=jnp.zeros((2, 1, 2, D)), key=jnp.zeros((5, 16, 2, D)),
                value=jnp.zeros((5, 16, 2, D)), page_table=jnp.zeros((2, 2), jnp.int32),
                kv_lengths=jnp.array([3, 4], jnp.int32))
    args.update(change)
    with pytest.raises(err, match=match):
        jax_fa4.attention(**args)


def test_differentiating_a_paged_call_raises():
    k_pool, v_pool, table, _, _ = _cache(5, np.array([3, 9]), 8, 2, 1)
    q = jnp.ones((2, 1, 2, D))
    f = lambda q, k: jax_fa4.attention(q, k, v_pool, page_table=table,  # noqa: E731
                                       kv_lengths=jnp.array([3, 9])).sum()
    with pytest.raises(ValueError, match="forward only"):
        jax.grad(f, argnums=(0, 1))(q, k_pool)


@pytest.mark.parametrize("arch,page_size,in_place", [
    ("sm_90a", 64, True), ("sm_90a", 16, True), ("sm_90a", 256, True), ("sm_90a", 48, False),
    ("sm_100a", 128, True), ("sm_100a", 256, True), ("sm_100a", 64, True),
    ("sm_100a", 48, False)])
def test_paged_decode_lowers_to_the_masked_forward_kernel(monkeypatch, kernel_calls, arch,
                                                          page_size, in_place):
    """A paged decode step is one masked forward kernel (GQA heads packed into its
    tiles) that reads the pools in place (Note [Paged KV]) where the page size and
    its 128-key blocks tile each other (sm_100a: compiled, not run on hardware);
    other page sizes are gathered into contiguous keys first."""
    monkeypatch.setenv("JAX_FA4_ARCH", arch)
    sds = jax.ShapeDtypeStruct
    pool = sds((64, page_size, 2, 128), jnp.bfloat16)
    text = jax.jit(lambda q, kp, vp, t, n: jax_fa4.attention(
        q, kp, vp, page_table=t, kv_lengths=n, causal="bottom_right",
        implementation="cute")).trace(
        sds((4, 1, 8, 128), jnp.bfloat16), pool, pool, sds((4, 16), jnp.int32),
        sds((4,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("CuteDSLRT_NvJaxCutlassCall") == 1
    ((key, inputs),) = kernel_calls
    assert key.kind == "fwd" and key.masked and key.pack_gqa == 4
    assert key.page_size == (page_size if in_place else 0)
    assert ("gather" in text) != in_place
    if in_place:
        assert inputs[1][0] == pool.shape and inputs[-1][0] == (4, 16)


def test_vmap_over_sequences_shares_the_pools():
    """vmap over queries, tables and lengths against one pool equals the unbatched
    calls; vmap over the pools raises."""
    lengths = np.array([5, 40], np.int32)
    k_pool, v_pool, table, _, _ = _cache(8, np.tile(lengths, 2), 16, 3, 2)
    q = jax.random.normal(jax.random.key(9), (2, 2, 1, 4, D), jnp.float32)
    tables = table.reshape(2, 2, 3)
    lens = jnp.asarray(np.tile(lengths, 2)).reshape(2, 2)

    def one(q, t, n):
        return jax_fa4.attention(q, k_pool, v_pool, page_table=t, kv_lengths=n)

    got = jax.vmap(one)(q, tables, lens)
    for i in range(2):
        assert max_err(got[i], one(q[i], tables[i], lens[i])) < 1e-6
    with pytest.raises(NotImplementedError, match="page pools"):
        jax.vmap(lambda kp, q: jax_fa4.attention(q, kp, v_pool, page_table=tables[0],
                                                 kv_lengths=lens[0]))(
            jnp.stack([k_pool, k_pool]), q)


# (page size, head dim, Hq, Hkv, Sq, num_splits): the kernel reads pages in place
# where they tile its key blocks (128 keys; 80 at head dim 256).
GPU_PAGED = [(16, 128, 32, 8, 1, None), (64, 128, 32, 8, 1, None), (64, 128, 32, 1, 1, 1),
             (128, 128, 8, 8, 5, None), (256, 64, 16, 2, 3, 4), (32, 64, 24, 8, 1, None),
             (16, 256, 8, 2, 1, None), (64, 256, 8, 2, 2, None), (64, 96, 32, 8, 1, None),
             # 12 queries of 8 heads a tile: the short rows' tiles (``short_tiles``)
             (64, 64, 16, 2, 12, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size,d,hq,hkv,sq,splits", GPU_PAGED,
                         ids=lambda c: str(c))
def test_paged_kernel_against_the_reference(page_size, d, hq, hkv, sq, splits):
    """The kernel's paged read (shuffled tables, lengths 0, 1, page size - 1, page
    size and odd ones, bottom-right causal) against the f32 reference of the
    gathered keys (2x rule), outputs poisoned."""
    from conftest import assert_close_2x

    from jax_fa4.ffi import poison_outputs

    rng = np.random.default_rng(page_size + d)
    lengths = np.array([0, 1, page_size - 1, page_size, 1000, 2047], np.int32)
    per_seq = -(-2048 // page_size)
    b = len(lengths)
    num_pages = b * per_seq + 5
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((num_pages, page_size, hkv, d)),
                                  jnp.bfloat16) for _ in range(2))
    table = jnp.asarray(rng.permutation(num_pages)[:b * per_seq].reshape(b, per_seq),
                        jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, sq, hq, d)), jnp.bfloat16)
    kw = dict(causal="bottom_right", kv_lengths=jnp.asarray(lengths), return_lse=True)
    fn = jax.jit(lambda q, kp, vp, t: jax_fa4.attention(
        q, kp, vp, page_table=t, implementation="cute", num_splits=splits, **kw))
    with poison_outputs():
        out, lse = fn(q, k_pool, v_pool, table)
    k, v = (x[table].reshape(b, per_seq * page_size, hkv, d) for x in (k_pool, v_pool))
    ref = jax.jit(lambda q, k, v: jax_fa4.attention(q, k, v, implementation="reference", **kw))
    hi_out, hi_lse = ref(*(x.astype(jnp.float32) for x in (q, k, v)))
    lo_out, lo_lse = ref(q, k, v)
    assert_close_2x(out, hi_out, lo_out, atol=1e-3, name="out")
    lse, hi_lse, lo_lse = (np.asarray(x, np.float64) for x in (lse, hi_lse, lo_lse))
    assert np.array_equal(np.isneginf(lse), np.isneginf(hi_lse))
    seen = ~np.isneginf(hi_lse)
    assert_close_2x(lse[seen], hi_lse[seen], lo_lse[seen], atol=1e-3, name="lse")
    assert not np.asarray(out[0], np.float32).any()  # length 0: out 0
