"""The flat order of the fp32 dQ accumulator written by the sm90 backward (hdim 64/128).

Note [Flat dQ accumulator]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Each MMA warpgroup of the sm90 backward holds a 64 x N part of the dQ partial of
one query block in wgmma accumulator registers: thread t of the warpgroup (warp
t // 32, lane t % 32) holds, at register v = k + 2 i + 4 j,

    row = 16 (t // 32) + (t % 32) // 4 + 8 i,    col = 8 j + 2 (t % 4) + k.

Writing that into a row-major tile (as a TMA tensor reduce needs) takes 64-bit
stores that hit every SMEM bank twice (docs/performance.md, v3). Instead each
thread writes its registers in order, four at a time, thread-interleaved:

    flat = w P + q 512 + 4 t + e,    v = 4 q + e,    P = 64 N floats per part,

one 128-bit store per q, consecutive threads on consecutive 16 bytes (no bank
conflict), and one 1-D bulk reduce-add moves the part to global memory. The
(tile_m x D) block of a query block keeps its place in dQaccum (B, Hq, Sq_pad, D);
only its tile_m * D floats are permuted. The postprocess reads them back in the
same order into the same register fragment, so it never needs this formula; it is
spelled out here for checks on the host (tests, scripts/gpu_check_bwd.py).

Warpgroup w owns rows 64 (w % wg_m) and columns N (w // wg_m) of the block, with
wg_m = tile_m // 64 and N = D * wg_m / num_wg (the tiled MMA's atom layout,
column-major over (wg_m, wg_n)).

An 80-row tile (hdim 128, non-causal) computes dQ^T = K^T dS^T instead: the wgmma
rows above are dQ's columns and its columns dQ's rows (query), N = tile_m = 80,
and warpgroup w owns dQ columns [64 w, 64 w + 64). The formula and the flat order
are otherwise the same.

The deterministic backwards (sm90 and sm100) fix the order in which a query block's
dQ partials are added: ``det_key_block`` and ``det_add_rank`` below.

Note [dQ store first]
~~~~~~~~~~~~~~~~~~~~~
Zeroing dQaccum costs the preprocess a write of the whole fp32 accumulator (128 MiB
at 16k tokens x 2048 wide, about 40% of that kernel's traffic). The sm90 backward
at hdim 64 / 128 (``dq_store_first``) needs no zeroed accumulator: the first dQ
partial of each query block is stored with a plain bulk copy, and only the later
ones are added. The query block's int32 semaphore (zeroed by the preprocess) orders
them. Not deterministic: the dQ warp takes a ticket (an atomic add of 1) once its
partial is in SMEM. Ticket 0 stores, waits until the store has landed in global
memory and adds ``DQ_STORED``; every other ticket waits (acquire) until the
semaphore reaches ``DQ_STORED`` and then reduce-adds. Only the dQ warp waits, and only
on a CTA that is running (it took ticket 0), which never waits on another. The
deterministic backward's semaphore already orders the adds: rank 0 stores.
Every query block below Sq gets a partial (key block 0 reaches all of them, Sk >= 1),
so every block the postprocess reads has been written. The rows of a block past Sq
are stored as exact zeros (Note [Tails without predicates], sm90_bwd.py); the rows
of Sq_pad past the last block are never written or read.

Note [dQ store first by length]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Storing first saves the zeroing write, whose cost per token is fixed, and costs
the dQ warp waits whose share grows with the walk: on the H200 it measured +2.9% /
+4.4% at 1k causal and 0.94-1.01x at 4k, 0.95x at 16k (twentieth session). With
``BwdTiles.dq_first_max_seqlen_q`` = N > 0 one binary does both, chosen at run time
from the query length: the main kernel and the preprocess both read the extent of
the semaphore tensor they share, ceil(Sq / tile_m) blocks, and store first where
that times tile_m is at most N (``dq_first_by_length``). Elsewhere the preprocess
zeroes dQaccum as the add-only backward's does, and the main kernel's dQ warp
reduce-adds every partial (the semaphores, zeroed either way, go unused). The MMA
warpgroups are the same in both: two dQ buffers (``BwdTiles.dq_double``), which the
add path then uses as ``dq_double_add`` does.

Note [dQ from registers]
~~~~~~~~~~~~~~~~~~~~~~~~
With ``BwdTiles.dq_red`` the MMA threads skip the SMEM hand-off: once the dQ GEMM
is done, each thread adds its registers straight into the query block's flat tile
of dQaccum with 128-bit reductions (``red.global.add.v4.f32``, SASS
``REDG.E.ADD.F32x4``): register quad q of thread t of warpgroup w goes to floats
w P + 512 q + 4 t (Note [Flat dQ accumulator]), so a warp's reduction covers 512
contiguous bytes. No SMEM dQ buffer (32 KiB freed), no dQ warp, no hand-off
barriers; 8 reductions per thread per query block. Measured on the H200 (main
kernel, 1 s phases x 3 rounds, twenty-third session): 0.92-0.96x the table's
bulk-reduce hand-off at hdim 128 (1k / 16k causal, 1k non-causal) and hdim 64 8k
causal; a third Q / dO stage in the freed SMEM did not change that. Off.

Note [dQ fold]
~~~~~~~~~~~~~~
The postprocess reads the whole fp32 dQaccum back from DRAM and writes dQ: about a
tenth of the backward at 1k tokens (49 of 474 us of kernels, hdim 128 causal,
nineteenth session). With ``BwdTiles.dq_fold`` = L > 0 (``FlashBwdSm90Fold``; not
deterministic, not store first, a CTA per key block) the main kernel writes dQ
itself and no postprocess runs:

- The dQ warp reduce-adds each item's partial as before. Once item it - L's adds
  have landed (``cp.async.bulk.wait_group`` L * n_parts after issuing item it, so
  the wait overlaps L items), it posts that item's index to a ring of FOLD_RING
  mbarrier slots.
- Warp 2 (one lane) takes each posted item and counts it on its query block's
  int32 semaphore (zeroed by the preprocess with dQaccum) with a GPU-scope
  acquire-release atomic add. The count that reaches the block's number of
  contributing key blocks (``dq_contributors``: every key block in causal top-left
  order whose first key is <= the block's last query; at least key block 0, since
  Sk >= 1) posts the block to warp 3.
- Warp 3 bulk-loads the block's fp32 sums into a staging tile (one piece, or two
  at tile_m 128 where SMEM has room for half a block only), multiplies by the
  softmax scale, rounds to bf16 / fp16 and writes dQ (B, Sq, Hq, D) with 32-bit
  stores, skipping rows past Sq. It reads the staging tile in this module's flat
  order, 128-bit loads by consecutive lanes (no bank conflicts): chunk c = 32 k +
  lane holds MMA thread t = c % 128's registers 4 q .. 4 q + 3 of warpgroup w,
  rows r, r + 8 and columns col, col + 1 of the formula above. At N = 64 (both
  tiles that fold) chunk 4 j + g of a piece is rows r_base + 16 g + lane // 4 (+ 8)
  and columns 8 j + 2 (lane % 4) (+ 1).

Ordering: the adds' completion, observed by the dQ warp's bulk async-group wait,
comes with an implicit generic-async proxy fence (PTX ISA, "async proxy"); the post
(mbarrier arrive) and the count's release carry it to the converting CTA, whose
acquire, job mbarrier and proxy fence order the staging load after them.

On the H200 it measured 0.89-0.93x the postprocess backward at every length
(twenty-second session; docs/performance.md), with the count first on the dQ warp
(v1) and then off it (v2), at lag 1 and 3, with a ``fence.proxy.async.global`` on
the dQ warp before each post. The loss is in the main kernel's walk (it is as large
at 16k, where the postprocess is 1% of the time). Without that fence (v3, which the
completion already implies) it measured the same, 0.89-0.93x (twenty-third session).
Nsight Compute (twenty-fourth session) found the MMA warpgroups' dQ hand-off waiting
twice as long as in the table's kernel at 1k: the dQ warp freed the single buffer
for the next item only after the landing wait and the post. v4 frees it right after
the bulk engine's read (not yet run on a GPU). The same profile found more: at 16k
causal the SMs idle 13% of the time (one SM has 12% more active cycles than the
mean), and at 1k every CTA is active 32% longer. Neither is explained yet. Off in
the table.
"""

from __future__ import annotations

import numpy as np

WG_THREADS = 128
# Added to a query block's dQ semaphore once its first partial has been stored
# (Note [dQ store first]); the tickets before it count up from 0, far below.
DQ_STORED = 1 << 24
VEC = 4  # floats per 128-bit store


def flat_dq_rowcol(tile_m: int, head_dim: int, num_wg: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols): position f of a query block's flat tile_m * head_dim floats
    holds dQ[rows[f], cols[f]] of that block (Note [Flat dQ accumulator])."""
    if tile_m % 64:  # dQ^T: wgmma (row, col) = dQ (col, row)
        if tile_m % 16 or head_dim != 64 * num_wg:
            raise ValueError(f"tile_m {tile_m} computes dQ^T, which needs head_dim "
                             f"{64 * num_wg}, got {head_dim}")
        f = np.arange(tile_m * head_dim)
        w, r = np.divmod(f, 64 * tile_m)
        q, r = np.divmod(r, WG_THREADS * VEC)
        t, e = np.divmod(r, VEC)
        i, k = np.divmod(e, 2)
        cols = 64 * w + 16 * (t // 32) + (t % 32) // 4 + 8 * i
        rows = 8 * q + 2 * (t % 4) + k
        return rows, cols
    if num_wg % (tile_m // 64):
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
    # Sq_pad need not be a multiple of an 80-row tile; it covers the tiles that
    # hold rows below Sq (seqlen_q_padded), and the rows past the last whole
    # tile are padding.
    whole = s_pad // tile_m * tile_m
    blocks = acc[:, :, :whole].reshape(b, h, s_pad // tile_m, tile_m * d)
    out = blocks[..., inverse].reshape(b, h, whole, d)
    if whole == s_pad:
        return out
    if isinstance(acc, np.ndarray):
        return np.concatenate([out, acc[:, :, whole:]], axis=2)
    import jax.numpy as jnp

    return jnp.concatenate([out, acc[:, :, whole:]], axis=2)


__all__ = ["DQ_STORED", "dq_first_by_length", "flat_dq_rowcol", "unflatten_dq_accum"]


def dq_first_by_length(num_q_blocks, tile_m: int, max_seqlen_q: int):
    """Whether a store-first backward with ``dq_first_max_seqlen_q`` = max_seqlen_q
    (> 0) stores first for a query length of num_q_blocks query tiles (Note [dQ
    store first by length]); plain ints and DSL integers alike."""
    return num_q_blocks * tile_m <= max_seqlen_q


def det_key_block(block, num_n_blocks, causal: bool):
    """The key block that CTA ``block`` (blockIdx.x) of the deterministic backward
    runs: the block itself, or causal, in reverse (see ``det_add_rank``)."""
    return num_n_blocks - 1 - block if causal else block


def det_add_rank(m_block, n_block, num_n_blocks, tile_m: int, tile_n: int, causal: bool,
                 minimum=min):
    """The place of key block ``n_block``'s dQ partial in query block ``m_block``'s
    sum in the deterministic backward, for plain ints (tests) and DSL integers
    (``minimum`` = cutlass.min) alike. The key blocks reaching a query block are
    0..last (top-left causal keeps key j <= query i). Non-causal the order is 0, 1,
    ..., last; causal it is last, ..., 0: key block n starts at query block
    n * tile_n // tile_m, after its successors, so in ascending order each would
    wait for its predecessor to catch up (half the default's speed on the H200),
    while in descending order the block it waits for got there first."""
    if not causal:
        return n_block
    last = minimum(((m_block + 1) * tile_m - 1) // tile_n, num_n_blocks - 1)
    return last - n_block
