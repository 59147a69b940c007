"""The masks as intervals (rules/ranges.py), on the host: every mask of
test_masks.py turned into per-query key intervals and per-key query intervals
matches the documented visibility rule element for element, and the block
reduction the kernels run (mirrored by ``block_ranges``) never skips a visible
element nor leaves one unmasked. The deterministic masked backward's key-block
walks (``key_block_ranges``) and the order of its dQ adds (Note [Masked dQ order]
in kernels/dq_layout.py) are checked on these masks and random ones: every add
once, in a fixed order, and no deadlock under any residency."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_masks import CASES, visible_np

from jax_fa4.config import AttentionConfig
from jax_fa4.kernels.dq_layout import det_key_block, det_masked_add_rank
from jax_fa4.kernels.mask import edge_walk
from jax_fa4.reference import Masks
from jax_fa4.rules.ranges import (
    EMPTY_LO,
    block_ranges,
    decode,
    key_block_ranges,
    key_ranges,
    owned_walks,
    query_ranges,
)

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
def test_backward_masks_every_score_of_a_row_that_sees_nothing(name):
    """The masked backward takes LSE as it is: a query row that sees no key has LSE
    -inf (LSElog2 0 after the preprocess), which gives P = 0 only because the key
    intervals (with the id compare of inexact rows) mask every one of its scores."""
    kw = ALL[name]
    config, masks, vis = _setup(kw)
    lo, hi, exact = decode(np.asarray(key_ranges(config, SQ, SK, masks, B)))
    pos = np.arange(SQ)
    kept = (pos >= lo[..., None]) & (pos < hi[..., None])  # [B, Sk, Sq]
    if "q_segment_ids" in kw:
        same = kw["kv_segment_ids"][:, :, None] == kw["q_segment_ids"][:, None, :]
        kept &= np.where(exact[..., None], True, same)
    blind = ~vis.any(-1)  # [B, Sq]: rows that see no key
    assert not kept.transpose(0, 2, 1)[blind].any()
    if "lengths" in name or name.startswith("segments_causal") or name == "everything":
        assert blind.any()  # these cases have such rows: the check is exercised


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


def _random_masks(seed: int) -> dict:
    """Mask keyword arguments drawn at random: a causal mode, a window, lengths, and
    segment ids contiguous or not, each present or not."""
    rng = np.random.default_rng(seed)
    kw = {}
    causal = [False, True, "bottom_right"][rng.integers(3)]
    if causal:
        kw["causal"] = causal
    if rng.random() < 0.5:
        kw["window"] = tuple(None if rng.random() < 0.3 else int(rng.integers(0, 20))
                             for _ in range(2))
    if rng.random() < 0.5:
        kw["q_lengths"] = rng.integers(0, SQ + 3, B).astype(np.int32)
    if rng.random() < 0.5:
        kw["kv_lengths"] = rng.integers(0, SK + 3, B).astype(np.int32)
    if rng.random() < 0.5:
        ids = rng.integers(0, 4, (B, SQ + SK)).astype(np.int32)
        if rng.random() < 0.5:  # contiguous documents
            ids = np.sort(ids, axis=1)
        kw["q_segment_ids"], kw["kv_segment_ids"] = ids[:, :SQ], ids[:, SQ:]
    return kw


# The masks of test_masks.py and the scattered ones above, then random ones.
WALK_CASES = [ALL[n] for n in ALL] + [_random_masks(s) for s in range(24)]
# (keys, queries) per block: more than 32 key blocks (two rounds of the rank's
# lanes), blocks of unequal sizes, and a block wider than the sequence.
WALK_TILES = [(1, 3), (4, 8), (7, 5), (64, 16)]


def _walks(kw, tile_n, tile_m, part=64):
    config, masks, vis = _setup(kw)
    ranges = key_ranges(config, SQ, SK, masks, B)
    return (np.asarray(ranges), np.asarray(key_block_ranges(ranges, tile_n, tile_m, part)),
            vis)


@pytest.mark.parametrize("tile_n,tile_m", WALK_TILES)
@pytest.mark.parametrize("case", range(len(WALK_CASES)))
def test_key_block_walks_are_the_kernels_reduction(case, tile_n, tile_m):
    """``key_block_ranges`` (XLA) is ``block_ranges``'s reduction of the key
    intervals (the kernels' ``BlockRange``): [first, end), (0, 0) where a block sees
    no query, and every visible (query, key) pair lies in its key block's walk;
    [full_first, full_end), whose query blocks see every key of the block."""
    ranges, walks, vis = _walks(WALK_CASES[case], tile_n, tile_m)
    assert walks.shape == (B, -(-SK // tile_n), 5) and walks.dtype == np.int32
    for b in range(B):
        want = [((first, end) if end > first else (0, 0)) + (full_first, full_end)
                for first, end, full_first, full_end, _ in
                block_ranges(ranges[b], tile_n, tile_m, False)]
        assert [tuple(w[:4]) for w in walks[b]] == want, b
    for b in range(B):
        queries, keys = np.nonzero(vis[b])
        first, end = walks[b, keys // tile_n, 0], walks[b, keys // tile_n, 1]
        assert np.all((first <= queries // tile_m) & (queries // tile_m < end)), b


@pytest.mark.parametrize("tile_n,tile_m,part", [(4, 8, 2), (8, 4, 4), (7, 5, 3), (64, 16, 64)])
@pytest.mark.parametrize("case", range(len(WALK_CASES)))
def test_key_block_peel_bits_mark_parts_that_see_nothing(case, tile_n, tile_m, part):
    """Bit p of a walk's fifth value says that keys [p part, (p + 1) part) of the
    block see no query of its first query block (Note [Masked warpgroup]): where it
    is set no such pair is visible, and where it is clear and the intervals are
    exact, one is."""
    ranges, walks, vis = _walks(WALK_CASES[case], tile_n, tile_m, part)
    exact = decode(ranges)[2]
    for b in range(B):
        for n, (first, end, _, _, bits) in enumerate(walks[b]):
            if end <= first:
                assert bits == 0
                continue
            rows = vis[b, first * tile_m:(first + 1) * tile_m]
            for p in range(-(-tile_n // part)):
                start = n * tile_n + p * part
                keys = slice(start, min((n + 1) * tile_n, start + part))
                seen = rows[:, keys].any()
                if bits >> p & 1:
                    assert not seen, (b, n, p)
                elif exact[b, keys].all() and keys.start < SK:
                    assert seen, (b, n, p)


def _assert_owned(walks, owned, vis, tile_n, tile_m, num_m):
    """``owned_walks`` of ``walks``: the key blocks' walks tile the query blocks (each
    walked by exactly one key block), hold the walks before (so every visible pair),
    keep the full blocks, and keep a peel bit only where the first block stayed."""
    for b in range(walks.shape[0]):
        walked = np.zeros(num_m, np.int32)
        for (first, end, full_first, full_end, bits), w in zip(owned[b], walks[b]):
            walked[first:end] += 1
            if w[1] > w[0]:
                assert first <= w[0] and w[1] <= end
            assert (full_first, full_end) == tuple(w[2:4])
            assert bits == (w[4] if first == w[0] else 0)
        assert np.all(walked == 1), b
        queries, keys = np.nonzero(vis[b])
        first, end = owned[b, keys // tile_n, 0], owned[b, keys // tile_n, 1]
        assert np.all((first <= queries // tile_m) & (queries // tile_m < end)), b


@pytest.mark.parametrize("tile_m", [8, 16, 64])
@pytest.mark.parametrize("case", range(len(WALK_CASES)))
def test_owned_walks_of_one_key_block_visit_every_query_block(case, tile_m):
    """All keys in one block (Note [One key block per query block]): the block walks
    every query block, so a backward that stores dQ writes each of them."""
    ranges, walks, vis = _walks(WALK_CASES[case], 64, tile_m)
    owned = np.asarray(owned_walks(jnp.asarray(walks), 64, tile_m, SQ))
    assert owned.shape == walks.shape and owned.dtype == np.int32
    _assert_owned(walks, owned, vis, 64, tile_m, -(-SQ // tile_m))


@pytest.mark.parametrize("s,tile_n,tile_m", [(16, 32, 16), (8, 32, 32), (32, 32, 16)])
@pytest.mark.parametrize("seed", range(6))
def test_owned_walks_of_packed_short_sequences(s, tile_n, tile_m, seed):
    """Short sequences with lengths, packed as Note [Short sequences] packs them
    (key blocks of whole sequences): each key block walks the query blocks of its own
    rows."""
    from jax_fa4.rules.kernels_cuda import _packed_rows

    rng = np.random.default_rng(seed)
    b, p = 12, 6
    kw = dict(q_lengths=rng.integers(0, s + 2, b).astype(np.int32),
              kv_lengths=rng.integers(0, s + 2, b).astype(np.int32))
    config = AttentionConfig(scale=1.0, causal=bool(seed % 2), window=(5, None) if seed > 3
                             else None, q_lengths=True, kv_lengths=True)
    x = jnp.zeros((b, s, 1, 1))
    packed, _, (qid, kid) = _packed_rows(p, config, tuple(jnp.asarray(kw[n]) for n in kw), x)
    rows = b // p
    ranges = key_ranges(packed, p * s, p * s, Masks(None, None, qid, kid), rows)
    walks = np.asarray(key_block_ranges(ranges, tile_n, tile_m))
    owned = np.asarray(owned_walks(jnp.asarray(walks), tile_n, tile_m, p * s))
    vis = np.zeros((rows, p * s, p * s), bool)
    for n in range(b):  # each sequence's own rule, placed on the packed row's diagonal
        r, o = divmod(n, p)
        i, j = np.arange(s)[:, None], np.arange(s)[None, :]
        v = (i < kw["q_lengths"][n]) & (j < kw["kv_lengths"][n])
        if config.causal:
            v &= j <= i
        if config.window:
            v &= j >= i - 5
        vis[r, o * s:(o + 1) * s, o * s:(o + 1) * s] = v
    _assert_owned(walks, owned, vis, tile_n, tile_m, -(-(p * s) // tile_m))


def _lane_rank(walks, n_block: int, m_block: int) -> int:
    """``masked_add_rank``'s loop (kernels/cute_utils.py) on the host: lane l of a
    warp tests key blocks n_block + 1 + l + 32 k, clamped to the last one and
    dropped past it; the warp's counts are summed."""
    num_n = len(walks)
    count = [0] * 32
    for k in range((num_n - 1 - n_block + 31) // 32):
        for lane in range(32):
            n = n_block + 1 + k * 32 + lane
            first, end = walks[min(n, num_n - 1)][:2]
            count[lane] += int(n < num_n and first <= m_block < end)
    return sum(count)


@pytest.mark.parametrize("tile_n,tile_m", WALK_TILES)
@pytest.mark.parametrize("case", range(len(WALK_CASES)))
def test_masked_ranks_order_every_add_once(case, tile_n, tile_m):
    """Note [Masked dQ order]: the key blocks whose walks hold a query block take
    the ranks 0, 1, ... of its sum once each, in descending key-block order, so
    every spin ends and every partial is added once; the kernels' lane loop
    computes the same rank."""
    _, walks, _ = _walks(WALK_CASES[case], tile_n, tile_m)
    num_m = -(-SQ // tile_m)
    for b in range(B):
        for m in range(num_m):
            visitors = [n for n in range(len(walks[b])) if walks[b, n, 0] <= m < walks[b, n, 1]]
            ranks = [det_masked_add_rank(walks[b], n, m) for n in visitors]
            assert ranks == list(range(len(visitors)))[::-1], (b, m)
            assert ranks == [_lane_rank(walks[b], n, m) for n in visitors], (b, m)


def _run_protocol(walks, group: int, slots: int):
    """Every CTA of one (batch entry, kv head) under the semaphore protocol, as a
    GPU would run them: CTAs start in launch order (``det_key_block``, descending)
    as ``slots`` SMs free up, each walks its items (query head outer, query block
    inner, as ``work_item``) and at each waits until the query block's semaphore
    equals its rank, then adds and increments it. Returns the order of the adds per
    (head, query block); raises if the CTAs deadlock."""
    num_n = len(walks)
    launch = [det_key_block(x, num_n, True) for x in range(num_n)]
    items = {n: [(h, m) for h in range(group) for m in range(*walks[n][:2])]
             for n in range(num_n)}
    sem, adds, step = {}, {}, dict.fromkeys(range(num_n), 0)
    waiting, resident = list(launch), []
    while waiting or resident:
        while waiting and len(resident) < slots:
            resident.append(waiting.pop(0))
        moved = False
        for n in list(resident):
            if step[n] == len(items[n]):
                resident.remove(n)
                moved = True
                continue
            h, m = items[n][step[n]]
            if sem.get((h, m), 0) == det_masked_add_rank(walks, n, m):
                sem[(h, m)] = sem.get((h, m), 0) + 1
                adds.setdefault((h, m), []).append(n)
                step[n] += 1
                moved = True
        if not moved:
            raise AssertionError(f"deadlock: resident {resident}, waiting {waiting}")
    return adds


@pytest.mark.parametrize("slots", [1, 3])
@pytest.mark.parametrize("case", range(len(WALK_CASES)))
def test_masked_order_cannot_deadlock(case, slots):
    """The launch order and the ranks together: with as few as one SM, every CTA
    finishes and every query block sums its partials in descending key-block
    order, each visiting block once."""
    _, walks, _ = _walks(WALK_CASES[case], 4, 8)
    for b in range(B):
        adds = _run_protocol(walks[b], group=2, slots=slots)
        for (h, m), order in adds.items():
            visitors = [n for n in range(len(walks[b])) if walks[b, n, 0] <= m < walks[b, n, 1]]
            assert order == visitors[::-1], (b, h, m)
