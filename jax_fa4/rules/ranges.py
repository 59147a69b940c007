"""The masks as the kernels take them: one interval of visible keys per query row
(forward) and one interval of seeing queries per key (backward).

Every mask ``attention`` takes (reference.py's rule) leaves each query row a set of
visible keys that is one interval, except segment ids whose documents are not
contiguous: the lengths cut both ends, the causal diagonal and the window each
bound one side, and a contiguous segment is an interval. So the kernels take
no mask parameters at all: a small pass here turns the mask arguments into
int32 intervals, ``[B, Sq, 2]`` (keys ``[lo, hi)`` of each query) and
``[B, Sk, 2]`` (queries ``[lo, hi)`` of each key), and one compiled kernel serves
every causal mode, window, length vector and segment layout. A kernel reduces
the intervals of a tile's rows to the blocks it visits (no fully masked block is
loaded) and to those whose every element is visible (no element mask there);
``block_ranges`` mirrors that reduction on the host for tests. The backward
takes each key block's reduced range too (``key_block_ranges``).

Note [Segment table]: segment ids are data, any int32 values. Each id's first
and last position, and whether it is one run, come from a table of T slots (T a
power of two >= the row's length) filled by one scatter-max from the ends of the
runs of equal ids, and read at slot ``id mod T``. A slot that holds one id, whose
last run starts where its first does, is a contiguous document: its intervals
are exact. Ids that come back, or that share a slot (equal modulo T, which ids
counted from 0 or 1 never are), get an interval that holds all their positions,
marked for the id compare: correct, only less skipped. (A sort and a binary
search per query take XLA several kernels per direction instead of one scatter.)

Encoding (Note [Interval encoding]):

* an empty interval (a query that sees no key, a key no query sees, rows past the
  lengths) is ``(EMPTY_LO, 0)``: it neither widens a tile's block range nor
  passes any element test;
* segment ids that repeat after another id (documents not contiguous) make the
  interval ``[first, last + 1)`` of the matching keys, which holds others too:
  such rows store ``hi`` bit-inverted (``~hi < 0``) and the kernel then also
  compares the segment ids of each element of their tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4.config import AttentionConfig
from jax_fa4.reference import Masks

# The lower end of an empty interval: above every sequence position.
EMPTY_LO = 1 << 30


# The (architecture, direction) pairs whose kernels take the intervals.
MASKED_KERNELS = {(a, k) for a in ("sm_90a", "sm_100a") for k in ("fwd", "bwd")}


def masked_kernel_error(arch: str, kind: str, config: AttentionConfig) -> str | None:
    """Why no kernel of ``arch`` runs this masked ``kind`` ("fwd" / "bwd"), or None."""
    what = ", ".join(config.mask_features())
    if (arch, kind) not in MASKED_KERNELS:
        direction = "forward" if kind == "fwd" else "backward"
        return f"no {arch} {direction} kernel takes {what} yet"
    return None


def mask_arrays(config: AttentionConfig, operands) -> Masks:
    """The per-batch mask operands the config names, by name (their order is
    ``AttentionConfig``'s)."""
    it = iter(operands)
    return Masks(
        next(it) if config.q_lengths else None,
        next(it) if config.kv_lengths else None,
        next(it) if config.segments else None,
        next(it) if config.segments else None,
    )


def _lengths(masks: Masks, b: int, sq: int, sk: int):
    lq = (jnp.full((b,), sq, jnp.int32) if masks.q_lengths is None
          else jnp.clip(masks.q_lengths.astype(jnp.int32), 0, sq))
    lk = (jnp.full((b,), sk, jnp.int32) if masks.kv_lengths is None
          else jnp.clip(masks.kv_lengths.astype(jnp.int32), 0, sk))
    return lq, lk


def _occurrences(ids: jax.Array, of: jax.Array):
    """For each value of ``of`` [B, M], where it occurs in ``ids`` [B, N]: (first,
    last + 1, exact), exact when every position in between holds it too; an empty
    interval where it does not occur. Not exact also where ``of``'s value shares
    its slot with another id (Note [Segment table]): the interval then holds both
    ids' positions, which the kernels' id compare tells apart."""
    b, n = ids.shape
    t = 1 << max(n - 1, 0).bit_length()
    pos = jnp.arange(n, dtype=jnp.int32)
    starts = jnp.pad(ids[:, 1:] != ids[:, :-1], ((0, 0), (1, 0)), constant_values=True)
    ends = jnp.pad(ids[:, 1:] != ids[:, :-1], ((0, 0), (0, 1)), constant_values=True)
    low = jnp.iinfo(jnp.int32).min
    # One scatter-max of (~first, last, ~smallest id, largest id, last run start)
    # per slot, from the runs' ends only (the rest go out of bounds and are dropped):
    # a handful of atomics per document, not one per position on the same address.
    ups = jnp.stack([jnp.where(starts, ~pos, low), jnp.where(ends, pos, low), ~ids, ids,
                     jnp.where(starts, pos, low)], axis=-1)
    slot = jnp.where(starts | ends, ids & (t - 1), t)
    table = jnp.full((b, t, 5), low, jnp.int32).at[
        jnp.arange(b)[:, None], slot].max(ups, mode="drop")
    entry = jnp.take_along_axis(table, (of & (t - 1))[..., None], axis=1)
    first, last, id_min, id_max, last_start = (entry[..., i] for i in range(5))
    first, id_min = ~first, ~id_min
    alone = id_min == id_max
    absent = alone & (id_min != of)
    lo = jnp.where(absent, n, first)
    hi = jnp.where(absent, 0, last + 1)
    return lo, hi, alone & (last_start == first)


def _pack(lo, hi, exact, valid):
    """(B, S, 2) int32 of the intervals (Note [Interval encoding] in the module
    docstring)."""
    empty = ~valid | (lo >= hi)
    lo = jnp.where(empty, EMPTY_LO, lo)
    hi = jnp.where(empty, 0, hi)
    hi = jnp.where(exact | empty, hi, ~hi)
    return jnp.stack([lo, hi], axis=-1).astype(jnp.int32)


def query_ranges(config: AttentionConfig, sq: int, sk: int, masks: Masks, batch: int):
    """[B, Sq, 2] int32: the keys ``[lo, hi)`` query i of batch b sees."""
    lq, lk = _lengths(masks, batch, sq, sk)
    i = jnp.arange(sq, dtype=jnp.int32)[None, :]
    diag = i + ((lk - lq)[:, None] if config.bottom_right else 0)
    lo = jnp.zeros((batch, sq), jnp.int32)
    hi = jnp.broadcast_to(lk[:, None], (batch, sq))
    if config.causal:
        hi = jnp.minimum(hi, diag + 1)
    if config.window is not None:
        left, right = config.window
        if left is not None:
            lo = jnp.maximum(lo, diag - left)
        if right is not None:
            hi = jnp.minimum(hi, diag + right + 1)
    exact = jnp.ones((batch, sq), bool)
    if config.segments:
        slo, shi, exact = _occurrences(masks.kv_segment_ids, masks.q_segment_ids)
        lo, hi = jnp.maximum(lo, slo), jnp.minimum(hi, shi)
    return _pack(lo, hi, exact, i < lq[:, None])


def key_ranges(config: AttentionConfig, sq: int, sk: int, masks: Masks, batch: int):
    """[B, Sk, 2] int32: the queries ``[lo, hi)`` that see key j of batch b."""
    lq, lk = _lengths(masks, batch, sq, sk)
    j = jnp.arange(sk, dtype=jnp.int32)[None, :]
    # Query i's diagonal is i + off: key j is on the diagonal of query j - off.
    at = j - ((lk - lq)[:, None] if config.bottom_right else 0)
    lo = jnp.zeros((batch, sk), jnp.int32)
    hi = jnp.broadcast_to(lq[:, None], (batch, sk))
    if config.causal:
        lo = jnp.maximum(lo, at)
    if config.window is not None:
        left, right = config.window
        if left is not None:
            hi = jnp.minimum(hi, at + left + 1)
        if right is not None:
            lo = jnp.maximum(lo, at - right)
    exact = jnp.ones((batch, sk), bool)
    if config.segments:
        slo, shi, exact = _occurrences(masks.q_segment_ids, masks.kv_segment_ids)
        lo, hi = jnp.maximum(lo, slo), jnp.minimum(hi, shi)
    return _pack(lo, hi, exact, j < lk[:, None])


def key_block_ranges(ranges: jax.Array, tile_n: int, tile_m: int, part: int = 64) -> jax.Array:
    """[B, ceil(Sk / tile_n), 5] int32: each block of ``tile_n`` keys' walk over the
    query blocks of ``tile_m`` rows, from ``key_ranges`` [B, Sk, 2] by the kernels'
    reduction (kernels/mask.py: ``BlockRange``; ``block_ranges`` on the host):

    * ``[first, end)``, the query blocks the key block visits, ``(0, 0)`` for a block
      that no query sees;
    * ``[full_first, full_end)``, the query blocks that see every key of the block
      (no element mask there);
    * bit p set where keys ``[p part, (p + 1) part)`` of the block see no query of
      block ``first`` (Note [Masked warpgroup] in kernels/sm90_bwd.py).

    Note [Block walks]: the masked backward reads its walk here, one row of five
    ints, instead of reducing its keys' intervals itself: a CTA's first Q / dO
    loads wait on the walk's first block, and a reduction over 128 intervals (loads,
    then shuffles) put microseconds before each CTA's loads; the XLA pass that makes
    the intervals makes these too. The deterministic backward also ranks its dQ
    adds by the walks (Note [Masked dQ order] in kernels/dq_layout.py): every CTA
    must count exactly the walks the others run, so they read one array."""
    b, sk, _ = ranges.shape
    num_n = -(-sk // tile_n)
    parts = -(-tile_n // part)
    lo, hi_raw = ranges[..., 0], ranges[..., 1]
    hi = jnp.where(hi_raw < 0, ~hi_raw, hi_raw)  # the end of a row that compares ids
    # A row that compares segment ids leaves no block free of the mask.
    hi_full = jnp.where(hi_raw < 0, 0, hi)
    # One variadic min-reduction over each part of each block (one XLA kernel; a
    # reduction per statistic took one each): of lo, -hi, -lo and hi_full, with
    # the padding keys neutral (empty intervals, (EMPTY_LO, 0), widen nothing).
    def blocks(x, fill):
        x = jnp.pad(x, ((0, 0), (0, num_n * tile_n - sk)), constant_values=fill)
        return jnp.pad(x.reshape(b, num_n, tile_n), ((0, 0), (0, 0), (0, parts * part - tile_n)),
                       constant_values=fill).reshape(b, num_n, parts, part)

    fills = (EMPTY_LO, 0, 0, EMPTY_LO)
    stats = jax.lax.reduce(
        tuple(blocks(x, f) for x, f in zip((lo, -hi, -lo, hi_full), fills)),
        tuple(jnp.int32(f) for f in fills),
        lambda x, y: tuple(jnp.minimum(a, c) for a, c in zip(x, y)), (3,))  # 4 x [B, num_n, parts]
    # The rest elementwise over the few parts (one more kernel).
    lo_min, neg_hi_max, neg_lo_max, hi_min = (
        functools.reduce(jnp.minimum, [x[..., p] for p in range(parts)]) for x in stats)
    first = lo_min // tile_m
    end = -(neg_hi_max // tile_m)  # ceil(max hi / tile_m)
    full_first = -(neg_lo_max // tile_m)  # ceil(max lo / tile_m)
    full_end = hi_min // tile_m
    empty = end <= first
    bits = functools.reduce(jnp.bitwise_or, [
        (stats[0][..., p] >= (first + 1) * tile_m).astype(jnp.int32) << p
        for p in range(parts)])
    return jnp.stack([jnp.where(empty, 0, first), jnp.where(empty, 0, end), full_first,
                      full_end, jnp.where(empty, 0, bits)], axis=-1).astype(jnp.int32)


def owned_walks(walks: jax.Array, tile_n: int, tile_m: int, sq: int) -> jax.Array:
    """``key_block_ranges``'s walks of a backward that stores dQ (Note [One key
    block per query block] in kernels/sm90_bwd.py) widened to every query block that
    its key block owns: all of them where the keys fit one block, else blocks ``[n
    tile_n, (n + 1) tile_n)`` of rows (short sequences packed, Sq = Sk, whose
    documents the key blocks tile). The key block then writes each of those dQ
    blocks, zeros where the mask hides its keys from every row (there its
    elements are masked: P = 0); no block is left unwritten. A peel bit holds for
    the walk's first block only, so it is cleared where the first block moves."""
    num_n = walks.shape[1]
    num_m = -(-sq // tile_m)
    n = jnp.arange(num_n, dtype=jnp.int32)
    first = jnp.minimum(n * (tile_n // tile_m), num_m)
    end = jnp.where(n == num_n - 1, num_m, jnp.minimum((n + 1) * (tile_n // tile_m), num_m))
    first, end = (jnp.broadcast_to(x, walks.shape[:2]) for x in (first, end))
    bits = jnp.where(walks[..., 0] == first, walks[..., 4], 0)
    return jnp.stack([first, end, walks[..., 2], walks[..., 3], bits], axis=-1)


def decode(ranges: np.ndarray):
    """(lo, hi, exact) of packed intervals (numpy; tests)."""
    lo, hi = ranges[..., 0], ranges[..., 1]
    exact = hi >= 0
    return lo, np.where(exact, hi, ~hi), exact


def block_ranges(ranges: np.ndarray, tile: int, block: int, at_least_one: bool):
    """The kernels' reduction (kernels/mask.py: ``BlockRange``) on the host (numpy;
    tests): for each tile of ``tile`` rows of ``ranges`` [S, 2], (first block, end
    block, first full block, end of the full blocks, exact) over blocks of ``block``
    positions. Blocks outside [first, end) hold no visible element; blocks in
    [full first, full end) hold only visible ones (unless not exact). With
    ``at_least_one`` (the forward) a tile with no visible element still visits
    block 0, fully masked."""
    lo, hi, exact = decode(ranges)
    out = []
    for t0 in range(0, len(lo), tile):
        tlo, thi = lo[t0:t0 + tile], hi[t0:t0 + tile]
        first = int(tlo.min()) // block
        end = -(-int(thi.max()) // block)
        if at_least_one and end <= first:
            first, end = 0, 1
        end = max(end, first)
        full_first = -(-int(tlo.max()) // block)
        tile_exact = bool(exact[t0:t0 + tile].all())
        # A row that compares segment ids leaves no block free of the mask.
        full_end = int(thi.min()) // block if tile_exact else 0
        out.append((first, end, full_first, full_end, tile_exact))
    return out
