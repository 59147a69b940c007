"""The masks as intervals (rules/ranges.py), on the host: every mask of
test_masks.py turned into per-query key intervals and per-key query intervals
matches the documented visibility rule element for element, and the block
reduction the kernels run (mirrored by ``block_ranges``) never skips a visible
element nor leaves one unmasked."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_masks import CASES, visible_np

from jax_fa4.config import AttentionConfig
from jax_fa4.kernels.mask import edge_walk
from jax_fa4.reference import Masks
from jax_fa4.rules.ranges import EMPTY_LO, block_ranges, decode, key_ranges, query_ranges

B, SQ, SK = 3, 37, 45
RNG = np.random.default_rng(0)
ALL = dict(CASES)
# Documents that come back after another one: intervals hold other ids too.
ALL["segments_scattered"] = dict(q_segment_ids=RNG.integers(0, 3, (B, SQ)).astype(np.int32),
                                 kv_segment_ids=RNG.integers(0, 3, (B, SK)).astype(np.int32))
ALL["scattered_causal_lengths"] = dict(ALL["segments_scattered"], causal=True,
                                       q_lengths=np.array([37, 20, 2], np.int32))


def _setup(kw):
    causal = kw.get("causal", False)
    config = AttentionConfig(scale=1.0, causal=bool(causal),
                             bottom_right=causal == "bottom_right", window=kw.get("window"),
                             q_lengths="q_lengths" in kw, kv_lengths="kv_lengths" in kw,
                             segments="q_segment_ids" in kw)
    masks = Masks(*(None if kw.get(n) is None else jnp.asarray(kw[n])
                    for n in ("q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids")))
    vis = visible_np(B, SQ, SK, causal=causal, window=kw.get("window"),
                     q_lengths=kw.get("q_lengths"), kv_lengths=kw.get("kv_lengths"),
                     q_seg=kw.get("q_segment_ids"), kv_seg=kw.get("kv_segment_ids"))
    return config, masks, vis


def _check(ranges, vis, same_seg):
    """Each row's visible set is its interval (exact rows) or its interval's
    elements of the same segment (the others); an exact row that sees nothing has
    the empty interval (EMPTY_LO, 0)."""
    lo, hi, exact = decode(np.asarray(ranges))
    pos = np.arange(vis.shape[-1])
    inside = (pos >= lo[..., None]) & (pos < hi[..., None])
    want = np.where(exact[..., None], inside, inside & same_seg)
    np.testing.assert_array_equal(want, vis)
    # (A row of a scattered segment may see none of its interval's keys: the
    # compare masks them all.)
    empty = ~vis.any(-1) & exact
    assert np.all(lo[empty] == EMPTY_LO) and np.all(hi[empty] == 0)


@pytest.mark.parametrize("name", list(ALL))
def test_intervals_are_the_visibility_rule(name):
    kw = ALL[name]
    config, masks, vis = _setup(kw)
    if "q_segment_ids" in kw:
        same = kw["q_segment_ids"][:, :, None] == kw["kv_segment_ids"][:, None, :]
    else:
        same = np.ones(vis.shape, bool)
    _check(query_ranges(config, SQ, SK, masks, B), vis, same)
    _check(key_ranges(config, SQ, SK, masks, B), vis.transpose(0, 2, 1),
           same.transpose(0, 2, 1))
    if name.startswith("segments_scattered"):
        assert not decode(np.asarray(query_ranges(config, SQ, SK, masks, B)))[2].all()


@pytest.mark.parametrize("name", list(ALL))
@pytest.mark.parametrize("tile,block", [(8, 4), (16, 16), (5, 7)])
def test_block_ranges_skip_only_masked_blocks(name, tile, block):
    config, masks, vis = _setup(ALL[name])
    for ranges, v, fwd in ((query_ranges(config, SQ, SK, masks, B), vis, True),
                           (key_ranges(config, SQ, SK, masks, B), vis.transpose(0, 2, 1), False)):
        ranges = np.asarray(ranges)
        for b in range(B):
            tiles = block_ranges(ranges[b], tile, block, at_least_one=fwd)
            assert len(tiles) == -(-v.shape[1] // tile)
            for t, (first, end, full_first, full_end, exact) in enumerate(tiles):
                rows = v[b, t * tile:(t + 1) * tile]
                cols = np.arange(v.shape[2]) // block
                visited = (cols >= first) & (cols < end)
                assert not rows[:, ~visited].any(), (b, t)
                if exact:
                    full = (cols >= full_first) & (cols < full_end)
                    assert rows[:, full].all(), (b, t)
                if fwd:
                    assert end > first
                    if not rows.any():
                        assert (first, end) == (0, 1)


@pytest.mark.parametrize("name", list(ALL))
@pytest.mark.parametrize("tile,block", [(16, 8), (7, 5), (37, 4)])
def test_forward_walk_masks_every_block_with_a_masked_element(name, tile, block):
    """The forward walks its blocks in three runs (``edge_walk``): the runs it leaves
    unmasked hold only visible elements, the others cover every partly masked
    block."""
    config, masks, vis = _setup(ALL[name])
    ranges = np.asarray(query_ranges(config, SQ, SK, masks, B))
    cols = np.arange(SK) // block
    for b in range(B):
        for t, (first, end, full_first, full_end, _) in enumerate(
                block_ranges(ranges[b], tile, block, at_least_one=True)):
            hi_edge, lo_edge = edge_walk(first, end, full_first, full_end)
            assert first <= lo_edge <= hi_edge <= end - 1
            rows = vis[b, t * tile:(t + 1) * tile]
            unmasked = (cols >= lo_edge) & (cols < hi_edge)
            assert rows[:, unmasked].all(), (b, t)


# Note [Segment table] in rules/ranges.py: ids are hashed to slots mod a power of
# two >= the row (64 for 45 keys).
_DOCS = np.repeat(np.array([7, -3, 1_000_001, 0], np.int32), [10, 20, 12, 3])


@pytest.mark.parametrize("ids,exact", [
    (_DOCS, True),  # any int32 ids, a padding id at the end: contiguous documents
    (np.repeat(np.array([3, 67, 5], np.int32), [20, 15, 10]), False),  # 3 and 67 share a slot
    (np.repeat(np.array([1, 2, 1], np.int32), [20, 15, 10]), False),  # id 1 comes back
])
@pytest.mark.parametrize("causal", [False, True])
def test_segment_intervals_of_any_ids(ids, exact, causal):
    """Contiguous documents give exact intervals whatever their ids; ids that share
    a slot of the table or come back give intervals marked for the id compare, and
    both match the visibility rule."""
    seg = np.stack([ids, ids[::-1], ids])
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg, causal=causal)
    config = AttentionConfig(scale=1.0, causal=causal, segments=True)
    masks = Masks(None, None, jnp.asarray(seg), jnp.asarray(seg))
    vis = visible_np(B, SK, SK, causal=causal, q_seg=seg, kv_seg=seg)
    same = seg[:, :, None] == seg[:, None, :]
    q_ranges = query_ranges(config, SK, SK, masks, B)
    _check(q_ranges, vis, same)
    _check(key_ranges(config, SK, SK, masks, B), vis.transpose(0, 2, 1), same)
    # The rows whose document's id is alone in its slot and never comes back.
    alone = True if exact else np.isin(seg, [5, 2])
    got = decode(np.asarray(q_ranges))[2]
    assert np.array_equal(got, np.broadcast_to(alone, got.shape)), kw
