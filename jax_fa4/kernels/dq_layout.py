"""The flat order of the fp32 dQ accumulator written by the sm90 backwards (every head
dim), and the order of the deterministic backwards' dQ adds.

Note [Flat dQ accumulator]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Each MMA warpgroup of the sm90 backward holds a 64 x N part of the dQ partial of
one query block in wgmma accumulator registers: thread t of the warpgroup (warp
t // 32, lane t % 32) holds, at register v = k + 2 i + 4 j,

    row = 16 (t // 32) + (t % 32) // 4 + 8 i,    col = 8 j + 2 (t % 4) + k.

Writing that into a row-major tile (as a TMA tensor reduce needs) takes 64-bit
stores that hit every SMEM bank twice. Instead each thread writes its registers in
order, four at a time, thread-interleaved:

    flat = w P + q 512 + 4 t + e,    v = 4 q + e,    P = 64 N floats per part,

one 128-bit store per q, consecutive threads on consecutive 16 bytes (no bank
conflict), and one 1-D bulk reduce-add moves the part to global memory. The
(tile_m x D) block of a query block keeps its place in dQaccum (B, Hq, Sq_pad, D);
only its tile_m * D floats are permuted. The postprocess reads them back in the
same order into the same register fragment, so it never needs this formula; it is
spelled out here for checks on the host (tests).

Warpgroup w owns rows 64 (w % wg_m) and columns N (w // wg_m) of the block, with
wg_m = tile_m // 64 and N = D * wg_m / num_wg (the tiled MMA's atom layout,
column-major over (wg_m, wg_n)).

The deterministic backwards (sm90 and sm100) fix the order in which a query block's
dQ partials are added: ``det_key_block`` and ``det_add_rank`` below, and with masks
Note [Masked dQ order].

Note [Masked dQ order]
~~~~~~~~~~~~~~~~~~~~~~
With masks (the key intervals of rules/ranges.py) which key blocks reach a query
block is data. The lowering reduces the intervals once, in XLA, to each key block's
walk, the query blocks [first, end) it visits (``key_block_ranges``), and the kernel
walks exactly those bounds. Key block n adds to query block m at rank

    rank = #{n' > n : first(n') <= m < end(n')},

the number of key blocks above it that visit m (``det_masked_add_rank``): the key
blocks that visit m take ranks 0, 1, ... in descending order, every CTA computing
them from the same array. Descending because the masks that bound a walk (causal,
windows, documents) start the walks of higher key blocks at later query blocks:
they reach m in fewer steps of their walk, so the blocks a CTA waits for are
ahead of it, as in the plain causal order. The grid runs the key blocks in reverse
(``det_key_block`` with ``descending``), so a CTA waits only on CTAs launched
before it, which no CTA launched later can hold up: the waits cannot deadlock.
"""

from __future__ import annotations

import numpy as np

WG_THREADS = 128
VEC = 4  # floats per 128-bit store


def flat_dq_rowcol(tile_m: int, head_dim: int, num_wg: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols): position f of a query block's flat tile_m * head_dim floats
    holds dQ[rows[f], cols[f]] of that block (Note [Flat dQ accumulator])."""
    if tile_m % 64 or num_wg % (tile_m // 64):
        raise ValueError(f"tile_m {tile_m} is not 64 rows per warpgroup row")
    wg_m = tile_m // 64
    wg_n = num_wg // wg_m
    n = head_dim // wg_n
    if n % 8 or n * wg_n != head_dim:
        raise ValueError(f"head_dim {head_dim} does not split into {wg_n} parts of 8k")
    f = np.arange(tile_m * head_dim)
    part = 64 * n
    w, r = np.divmod(f, part)
    q, r = np.divmod(r, WG_THREADS * VEC)
    t, e = np.divmod(r, VEC)
    i, k = np.divmod(e, 2)
    j = q
    rows = 64 * (w % wg_m) + 16 * (t // 32) + (t % 32) // 4 + 8 * i
    cols = n * (w // wg_m) + 8 * j + 2 * (t % 4) + k
    return rows, cols


def unflatten_dq_accum(acc, tile_m: int, num_wg: int = 2):
    """(B, Hq, Sq_pad, D) flat-ordered accumulator -> row-major, with jax.numpy or
    numpy arrays alike (host-side checks only; the postprocess does this on device)."""
    b, h, s_pad, d = acc.shape
    rows, cols = flat_dq_rowcol(tile_m, d, num_wg)
    inverse = np.empty(tile_m * d, dtype=np.int64)
    inverse[rows * d + cols] = np.arange(tile_m * d)
    blocks = acc.reshape(b, h, s_pad // tile_m, tile_m * d)
    return blocks[..., inverse].reshape(b, h, s_pad, d)


def det_key_block(block, num_n_blocks, descending: bool):
    """The key block that CTA ``block`` (blockIdx.x) of the deterministic backward
    runs: the block itself, or ``descending`` (causal, and every masked kernel), in
    reverse (see ``det_add_rank``, Note [Masked dQ order])."""
    return num_n_blocks - 1 - block if descending else block


def det_add_rank(m_block, n_block, num_n_blocks, tile_m: int, tile_n: int, causal: bool,
                 minimum=min):
    """The place of key block ``n_block``'s dQ partial in query block ``m_block``'s
    sum in the deterministic backward, for plain ints (tests) and DSL integers
    (``minimum`` = cutlass.min) alike. The key blocks reaching a query block are
    0..last (top-left causal keeps key j <= query i). Non-causal the order is 0, 1,
    ..., last; causal it is last, ..., 0: key block n starts at query block
    n * tile_n // tile_m, after its successors, so in ascending order each would
    wait for its predecessor to catch up, while in descending order the block it
    waits for got there first."""
    if not causal:
        return n_block
    last = minimum(((m_block + 1) * tile_m - 1) // tile_n, num_n_blocks - 1)
    return last - n_block


def det_masked_add_rank(walks, n_block: int, m_block: int) -> int:
    """The rank of key block ``n_block``'s dQ partial in query block ``m_block``'s sum
    in the deterministic masked backward (Note [Masked dQ order]), on the host
    (tests; the kernels' is ``cute_utils.masked_add_rank``). walks: ``[num_n, 2]``,
    one batch entry of ``key_block_ranges``."""
    above = np.asarray(walks)[n_block + 1:]
    return int(((above[:, 0] <= m_block) & (m_block < above[:, 1])).sum())


__all__ = ["det_add_rank", "det_key_block", "det_masked_add_rank", "flat_dq_rowcol",
           "unflatten_dq_accum"]
