"""Hopper (sm_90a) flash-attention forward: TMA + wgmma, warp specialized.

A CTA computes (tile_m x head_dim_v) tiles of O, each for one (batch, q head):
one tile per CTA (hdim 256), or persistent CTAs, one per SM, walking tiles in a
static round robin (non-causal) or taking them longest-first from a global
counter (causal, ``FlashFwdSm90Dynamic``); see ``Sm90FwdTiles``. Per tile:

* warpgroup 0 is the producer: its first warp issues TMA loads of the Q tile
  (once) and of K and V tiles through two multi-stage mbarrier pipelines; the
  warpgroup drops to a few registers (setmaxnreg) so the consumers get more.
* the other warpgroups (2, or 3 at hdim 64) are consumers; each owns 64 rows of
  the Q tile. Per KV block: S = Q K^T (wgmma, Q from SMEM or registers), mask,
  online softmax (exp2, lazy rescale, see softmax.py), P converted to 16 bits in
  registers, O += P V (wgmma with P as the register A operand, V^T from SMEM).
* Intra-warpgroup overlap (FA3): the next block's Q K^T is issued before the
  current block's P V finishes, so the tensor cores run while the softmax
  waits; the consumer warpgroups also take turns issuing their GEMMs
  (ping-pong through named barriers) so that one's softmax overlaps another's
  GEMMs.
* Epilogue: O / row_sum in 16 bits goes through SMEM (the Q buffer; its own
  buffer in persistent CTAs) and one TMA store, which clips rows past seqlen_q;
  LSE is stored per row directly.

The contract (docs/design.md): tensors arrive row-major as JAX holds them,
with dynamic batch, sequence and head extents; the head dims are compile-time.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, cute, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from jax_fa4.config import LOG2_E
from jax_fa4.kernels.cute_utils import (
    FwdCall,
    PagedKV,
    as_cutlass_dtype,
    check_forward_dtypes,
    consumer_release_elected,
    convert_to_operand_a,
    kv_box_layout,
    packed_gqa_views,
    permute,
    pin_fragment,
    set_forward_extras,
    set_mask_flags,
    set_page_size,
    sm90_smem_layout,
    stmatrix_acc,
    tma_store_tile,
    tma_tile_partition,
    transpose_smem,
    wgmma_gemm,
)
from jax_fa4.kernels.mask import BlockRange, RangeMask, TileMask, decode_hi, edge_walk
from jax_fa4.kernels.softmax import (
    OnlineSoftmax,
    acc_mn_view,
    cap_scores,
    rescale_rows,
    rescale_rows_if_needed,
)

logger = logging.getLogger(__name__)

_THREADS_PER_WG = 128

# The most dynamic shared memory one CTA may use on sm_90 (227 KiB).
_SM90_MAX_SMEM_BYTES = 227 * 1024

# Note [P V wait]
# ~~~~~~~~~~~~~~
# With intra-warpgroup overlap a step issues S_n = Q K_n and O += P_(n+1) V_(n+1),
# waits for S_n only, and runs S_n's softmax while the P V wgmma is still in
# flight; the PTX waits for P V (wgmma.wait_group 0) after the softmax, just
# before P_n overwrites the registers that wgmma reads. ptxas moves that wait up
# within its basic block, but not past its start: it lands part way through the
# exp2s. When a branch joins just before the softmax (the merged diagonal loop's
# run-time mask test), the join starts the block and the wait lands before every
# exp2, so P V no longer overlaps the softmax. The merged loop therefore ends the
# block after the exp2s with a branch that is never taken (on a row scale < 0; its
# body is a warp sync, so LLVM keeps it), and the wait stays below them.

# Note [K/V multicast]
# ~~~~~~~~~~~~~~~~~~~~~
# With cluster_m = 2 the grid is launched in clusters of two CTAs along x. A
# cluster's CTAs take query blocks 2c and 2c + 1 of one head (the persistent walk
# counts in clusters: unit u is (pair, head, batch), rank r takes block 2 pair + r),
# so both walk the same K / V blocks in the same order. The load warp of rank r
# issues rows [r tile_n / 2, (r + 1) tile_n / 2) of each K and V block as a
# multicast TMA into the same stage of both CTAs; each CTA's full barrier still
# expects the whole block's bytes (half from each load warp). A stage is free again
# only when the consumers of both CTAs are done with it: every consumer warp
# releases it on both CTAs' empty barriers (lane r arrives at rank r), so the empty
# barrier counts 2 x consumer warps. Q and O stay per CTA; Q's stage is released
# locally. Causal (one CTA per tile only; the dynamic scheduler hands out single
# tiles): both load warps walk the key blocks of the cluster's last query block,
# and a CTA whose own block ends earlier releases the first stages unread (at most
# 2 at hdim 256's 128 x 80); the LPT launch order runs over clusters. Where the head
# has an odd number of query blocks the last cluster's second CTA runs a block past
# the end: TMA fills its Q with zeros, the O store is clipped and LSE rows >=
# seqlen_q are not written. Both CTAs meet at a cluster barrier before they exit, so
# that no multicast or remote arrive targets a CTA that has left. What it saves:
# half of the K / V reads from L2 (at hdim 128, 64 KiB of 96 KiB per key block and
# CTA).

# Note [P conversion in the loop header]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# P's register fragment is written twice: after the first block's softmax, before
# the KV loop, and at the end of every step. Both writes are conversions of f32
# values, so after mem2reg the loop header's phi has a conversion on every
# incoming edge, and LLVM's InstCombine folds the conversion through the phi: the
# loop then carries S's 64 f32 values across the back edge and converts them in
# the header (visible in the PTX: 32 cvt.rn.bf16x2.f32 right after the header's
# label). In SASS the 32 F2FPs then run as one block after the lazy rescale's
# branch, just before the next wgmmas are issued, where the tensor cores wait for
# them. pin_p routes each 32-bit word of P through an empty inline-asm move
# (``pin_fragment``), which LLVM cannot fold, so the conversions stay in the step
# after the exp2s; ptxas then interleaves them with the MUFUs (M a P M a P ...), as
# in flash-attn-4's step, and also issues the P V wait earlier.

# Note [P through SMEM]
# ~~~~~~~~~~~~~~~~~~~~~
# With ``p_in_smem`` (the hdim-96 row, flash-attn-4's 192 x 128 tile with P in
# shared memory) O += P V takes P from SMEM instead of registers: at the end of each
# step, once the previous P V has finished (the step's wait_group(0)), every
# consumer warpgroup converts its 64 rows of P and writes them with stmatrix into
# its slice of one (tile_m x tile_n) tile, fences the writes to the async proxy and
# meets its own 128 threads at a named barrier (_BAR_P_WG0 + w); the next step's
# P V wgmma then reads them. One buffer suffices: P is rewritten only after the P V
# that read it. It frees the 32 registers per thread that P's A fragment takes,
# which three 160-register consumer warpgroups need at this head dim; the tile
# costs 48 KiB of SMEM (216 KiB in all with O's own buffer).

# Note [Packed GQA]
# ~~~~~~~~~~~~~~~~~
# With ``pack_gqa`` = g (the query heads per KV head) a masked forward tile holds the
# g query heads of one KV head: tile row r is position r // g of query head
# head_kv g + r % g, so K and V are read once for the g heads, and a tile of
# tile_m rows spans tile_m / g positions. Where the key range of a row is short (a
# sliding window, a decode step) that is fewer key blocks per row: with a window of
# 128 and 192 x 128 tiles a tile of one head spans 192 positions and visits 3 to 4
# key blocks, a packed tile of 8 heads spans 24 and visits 2 to 3 (flash-attn-4
# packs GQA heads the same way, ``pack_gqa``). Nothing in the kernel changes but
# its views (``pack_rows``): Q, O and LSE re-viewed with rows ((g, positions)) and
# heads the KV heads, the per-position key intervals and segment ids with the
# group as a stride-0 mode; the tile walk, ``BlockRange`` and ``RangeMask`` then read
# packed rows as they read positions, and TMA moves a tile as a (g, tile_m / g)
# box. The sinks are per row (each row's own query head).

# Note [Split keys]
# ~~~~~~~~~~~~~~~~~~
# Decode has one query row per sequence and head (a few with packed GQA heads), so
# its tiles are (batch x KV heads) and each walks the whole cache: 8 tiles for one
# sequence of 8 KV heads leave 124 of 132 SMs idle. Flash-decoding splits each
# tile's key blocks into s consecutive runs, one tile each: the tiles run over
# (query block, head, batch x split), split major, and write their O and LSE as
# float32 partials, [s x B, ...]; a combine after the kernel (``combine_splits`` in
# rules/kernels_cuda.py, one XLA fusion) weighs each split's O by exp(its lse - the
# total lse) and adds the sinks there, so the split kernel takes none. The split
# count is the partials' batch extent over B: data, not a compile-time constant,
# so one kernel serves every count (``rules/plan.split_count`` picks it from the
# shapes, enough to fill the SMs once). A split is ceil(n / s) of the tile's n
# blocks (``BlockRange.split``); one that gets none still visits one block with
# every key masked, so it writes out 0 and lse -inf through the ordinary path and
# the roles keep walking the same blocks. Partials leave the registers straight to
# global memory (``store_split``): a decode tile has few valid rows. flash-attn-4
# splits the same way (``num_splits``, its ``FlashAttentionForwardCombine``).

# Note [Counter in the intervals]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The dynamic scheduler's tile counter must be zero at launch. Passed alone, XLA
# makes that zero with a kernel of its own before every call (a 1 us memcpy and a
# launch gap: measurable against a decode kernel of 10-20 us). The masked forward
# already takes the key intervals, which an XLA fusion writes before every call, so
# the lowering has that fusion append one batch entry of zeros, (B + 1, Sq, 2), and
# the kernel takes its first int as the counter (``counter_in_intervals``), updated
# in place (the intervals are an aliased output, dropped).


def counter_in_intervals(mQ: cute.Tensor, mRanges: cute.Tensor):
    """(the tile counter, the (B, Sq, 2) intervals) of the (B + 1, Sq, 2) intervals
    a masked dynamic forward takes (Note [Counter in the intervals]); mQ: (B, Sq,
    Hq, D)."""
    b = mQ.shape[0]
    counter = cute.make_tensor(mRanges.iterator + cute.crd2idx((b, 0, 0), mRanges.layout),
                               cute.make_layout(1))
    ranges = cute.make_tensor(mRanges.iterator, cute.make_layout(
        (b, mRanges.shape[1], mRanges.shape[2]), stride=mRanges.stride))
    return counter, ranges


# Note [Tile ring]
# ~~~~~~~~~~~~~~~~
# The dynamic scheduler's load warp claims each tile and hands it to the consumer
# warpgroups through a 2-slot SMEM ring: its index and, masked, its (query block,
# head, batch) and key blocks (``BlockRange.fields``, and a split's keys). The load
# warp works them out while the consumers still run the tile before; the consumers
# read them from SMEM instead of waiting on global loads of their own at every
# tile's start. The intervals the load warp read stay in the SM's L1, where
# ``RangeMask`` reads each row's interval again. Unmasked, the index goes alone and
# first, before the load warp's own work on the tile: a causal 8k forward (B=2, 16
# heads of 128) took 758 us with the coordinates in the ring, 748 so.
#
# Note [Sections of masked tiles]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The LPT order takes heads in sections whose K and V fit in L2 together. A
# causal tile of an 8k row reads up to the whole row's keys, so at 8k and hdim 128
# a section holds 8 heads. A masked tile may read far fewer: a document of 1k
# tokens, a window. Sized for the whole row, the sections of packed documents run
# query blocks 63 down to 0 of 8 heads each, and the last section's tiles cost 8,
# 7, ..., 1 blocks over and over to the end, so the final long tiles start when
# few remain and SMs idle in the tail. So the masked forward sizes its sections by
# the keys a row sees (``key_span_blocks``): at kernel start the load warp reads
# the intervals of 32 rows spread over the batch and takes their widest, the same
# 32 rows in every CTA, so every CTA maps tile indices alike. On the H200, packed
# documents of 1k in 8k rows (B=2, 16 heads of 128): forward kernel 153 -> 149.6
# us with every section at 64 heads, 155 -> 147 with this and the tile ring; a
# causal row with key lengths in turn lost 8% with 64 (669 -> 722 us), which the
# widest interval keeps at 8. Split keys (decode, one query block per head) keep
# the whole row's sections: there they only reorder the heads.

# Note [Paged KV]
# ~~~~~~~~~~~~~~
# A paged cache's K and V are pools (pages, page_size, Hkv, D): sequence b's key j
# is row j % page_size of page table[b, j // page_size]. Viewed as FA4 views K, the
# pool is (page_size, D, Hkv, pages), pages in the place of the batch, so the TMA
# descriptor is the contiguous kernel's with the page as its last coordinate. A
# block of tile_n keys is loaded as tile_n / r boxes of r = min(page_size, tile_n)
# rows, each from its own page, into consecutive rows of the stage: the box's SMEM
# layout is the stage's first r rows (``kv_box_layout``), which is every r-row slice
# of it, since r is a multiple of the swizzle atom's 8 rows. The producer reads
# the block's page ids before it waits for the stage, so their latency hides behind
# the consumers' work. Everything else (intervals, lengths, split keys) sees
# logical key positions, as with contiguous keys. flash-attn-4 loads pages smaller
# than a block with cp.async (its PagedKVManager) and uses TMA where a page holds
# whole blocks; the per-page boxes here keep TMA for every page size that divides
# tile_n or that tile_n divides.

# Named barrier ids; 0 is __syncthreads.
_BAR_EPILOGUE = 1
_BAR_SCHED_WG1 = 2  # consumer warpgroup w waits on _BAR_SCHED_WG1 + w
_BAR_P_WG0 = 5  # p_in_smem: consumer warpgroup w's P is in SMEM (_BAR_P_WG0 + w)


@dataclasses.dataclass(frozen=True)
class Sm90FwdTiles:
    """The compile-time shape of the sm90 forward: one row of ``fwd_tiles`` per
    head dim and mask. Every kernel overlaps a step's softmax with its P V wgmma
    (intra-warpgroup overlap), has its consumer warpgroups take turns at the tensor
    cores (ping-pong), and runs causal tiles longest first (``lpt_tile``)."""

    # Query rows per CTA: 64 per consumer warpgroup, 2 or 3 of them.
    tile_m: int
    # Keys per KV block: S = Q K^T is 64 x tile_n per consumer warpgroup.
    tile_n: int
    # K / V stages in SMEM.
    num_stages: int
    # setmaxnreg: the producer warpgroup drops to producer_regs per thread so that
    # the consumers get consumer_regs (all of them within the SM's 64K registers).
    consumer_regs: int
    producer_regs: int
    # One CTA per SM walking tiles (static round robin non-causal; causal tiles, of
    # unequal cost, from a global counter: ``FlashFwdSm90Dynamic``); the load warp
    # fetches the next tile's Q and K while the consumers finish the current one,
    # and O gets its own SMEM buffer so its TMA store overlaps the next tile. Needs
    # that buffer to fit in SMEM (not at hdim 256).
    persistent: bool = False
    # CTAs per cluster along the query blocks, 1 or 2: with 2 a cluster's CTAs run
    # adjacent query blocks of one head and share each K / V block through multicast
    # TMA (Note [K/V multicast]). Not with the dynamic scheduler, which hands out
    # single tiles.
    cluster_m: int = 1
    # Q as the register (A) operand of S = Q K^T: each consumer thread loads its part
    # of Q from SMEM once per tile (ldmatrix), every S wgmma reads K alone from SMEM,
    # and with persistent CTAs the Q buffer is free for the next tile at once. Costs
    # D / 4 registers per thread: 240-register consumers and D <= 128 only.
    q_in_regs: bool = False
    # Keep P's conversions to 16 bits in the step that computes P, among its exp2s,
    # instead of in the loop header (Note [P conversion in the loop header]).
    pin_p: bool = False
    # P as the SMEM (A) operand of O += P V: each consumer warpgroup writes its 64 rows
    # of P to its own SMEM tile with stmatrix (Note [P through SMEM]).
    p_in_smem: bool = False
    # Causal: mask the diagonal blocks through one 32-bit keep mask per row
    # (``TileMask(bitmask=True)``, R2P) instead of a compare per element.
    mask_bitmask: bool = False
    # P's row sum in this many serial chains, 0 for one reduction (Note [Row sum in
    # chains] in softmax.py): it changes where ptxas issues a row's first exp2.
    row_sum_chains: int = 0
    # Non-causal: leave out the diagonal-block loop, which never runs there, instead
    # of tracing and compiling it: a smaller kernel that compiles faster, and that
    # ptxas schedules differently, so the table chooses it per head dim.
    prune_diagonal_loop: bool = False
    # Causal: one loop over every block after the first, masking the diagonal blocks
    # by a run-time test, instead of a loop for them and one for the rest: the step
    # is traced and compiled once instead of twice. The step then pins the P V wait
    # below its exp2s (Note [P V wait]).
    merge_diagonal_loop: bool = False


# L2 of an H100 / H200 that the LPT order budgets for K and V (FA4's figure).
_L2_BYTES = 50 * 1024 * 1024
# The largest L2 section of heads the LPT order forms (a power of two).
_LPT_MAX_SECTION = 64


def lpt_tile(t, num_m, num_heads, num_hb, section, minimum=min):
    """(m_block, head, batch) of tile t in FA4's longest-processing-time-first order,
    the causal forward's launch order (one CTA per tile) or the order in which its
    dynamic scheduler hands tiles out. Heads are taken in sections of as many as
    keep their K and V in L2 (``lpt_section_size``); within a section the query
    blocks go from the last (the most KV blocks) to the first, all heads of the
    section per block, so the longest tiles start first and the short ones fill the
    tail. For plain ints (tests) and DSL integers alike.

    Tiles t = s * (h_s * num_m) + j * h_s + r, where
    h_s = min(section, num_hb - s * section) heads are in section s (the last
    holds those left over), run query block num_m - 1 - j of (head, batch) pair
    hb = s * section + r, head fastest."""
    sec = t // (section * num_m)
    heads_here = minimum(section, num_hb - sec * section)
    rest = t - sec * section * num_m
    j = rest // heads_here
    hb = sec * section + (rest - j * heads_here)
    return num_m - 1 - j, hb % num_heads, hb // num_heads


def span_sample(lane, batch, rows):
    """(batch, row) of the interval lane ``lane`` (of 32) reads to estimate a masked
    tile's key span (Note [Sections of masked tiles]): rows spread evenly over the
    batch x rows of the intervals. For plain ints (tests) and DSL integers alike."""
    total = batch * rows
    # lane * total / 32 + total / 64, rounded down, without a product past int32.
    q, rem = total // 32, total % 32
    r = lane * q + (lane * rem + q * 16 + rem // 2) // 32
    b = r // rows
    return b, r - b * rows


def span_blocks(span, seqlen_k, tile_m: int, tile_n: int, minimum=min):
    """Key blocks a tile of tile_m rows reads when each row sees at most ``span``
    keys (on a diagonal that slopes across the tile), at most every block."""
    return minimum((seqlen_k + tile_n - 1) // tile_n, (span + tile_m + tile_n - 1) // tile_n)


def lpt_section_size(kv_blocks, group, kv_block_bytes: int,
                     select=lambda c, a, b: a if c else b, one=1):
    """Heads per L2 section of the LPT order: the largest power of two up to
    ``_LPT_MAX_SECTION`` whose K and V (kv_blocks blocks of kv_block_bytes each per
    KV head, shared by the ``group`` q heads of a GQA group) fit in ``_L2_BYTES``.
    For plain ints (tests) and DSL integers (``select`` = arith.select) alike."""
    blocks_in_l2 = _L2_BYTES // kv_block_bytes
    section = one
    p = 2
    while p <= _LPT_MAX_SECTION:
        section = select(kv_blocks * p <= blocks_in_l2 * group, p, section)
        p *= 2
    return section


# Rows of the hdim-64 masked forward's tile where every tile has at most this many.
SHORT_TILE_M = 128


def short_tiles(head_dim: int, head_dim_v: int, masked: bool, rows: int, pack: int,
                split_kv: bool) -> bool:
    """Whether the masked forward whose tiles hold ``rows`` query rows of each of
    ``pack`` packed GQA heads runs on ``fwd_tiles``' short row: head dims up to 64,
    at most ``SHORT_TILE_M`` rows in all, a ``pack`` that divides it, one split (the
    split count is sized by the table's row)."""
    return (masked and not split_kv and max(head_dim, head_dim_v) <= 64
            and 0 < rows * pack <= SHORT_TILE_M and SHORT_TILE_M % pack == 0)


def fwd_tiles(head_dim: int, head_dim_v: int, causal: bool, masked: bool = False,
              short: bool = False) -> Sm90FwdTiles:
    """The tile table: one row per head dim (D, Dv up to 64, up to 128, or both 256)
    and mask (none, top-left causal, or ``masked``: per-row key intervals, which
    runs as causal does). Configurations from FA3's Hopper forward; every other
    choice measured on the H200 (bf16) against the row without it. ``short``
    (masked, head dims up to 64): every tile's rows, a (batch, head)'s query rows
    with its packed GQA heads, number at most ``SHORT_TILE_M`` (``short_tiles``).

    Register budgets: 2 consumer warpgroups of 240 and a producer of 24 (24 x 128 +
    240 x 256 <= 64K registers a CTA), or 3 of 160 and 32.
    """
    d = max(head_dim, head_dim_v)
    # Intervals: tiles of unequal cost, as causal ones; no K/V multicast (the two
    # CTAs of a cluster would visit different blocks).
    bitmask = causal and not masked
    causal = causal or masked
    if d <= 64 and short:
        # Padded sequences of 128 (BERT's shape: 1024 x 128 with lengths, 12 heads of
        # 64): the 192-row tile leaves a third of its rows empty. 128 x 128 on two
        # consumer warpgroups: forward 0.340 -> 0.271 ms; with Q in registers, which
        # frees the Q buffer for the next tile at once, 0.256 ms. Decode of 64 query
        # heads on 8 (128 x 4k keys, 1 or 4 queries): 0.311 -> 0.252 ms, 0.318 -> 0.262.
        if not masked:
            raise ValueError("short tiles serve the masked forward")
        return Sm90FwdTiles(
            tile_m=SHORT_TILE_M, tile_n=128, num_stages=2, consumer_regs=240,
            producer_regs=24, persistent=True, q_in_regs=True, pin_p=True,
        )
    if d <= 64:
        # 192 x 128 with 3 consumer warpgroups: faster than 128 x 128 with 2. No K/V
        # multicast: slower here (a head's last cluster often runs a block past the end).
        return Sm90FwdTiles(
            tile_m=192, tile_n=128, num_stages=2, consumer_regs=160, producer_regs=32,
            persistent=True,
            pin_p=True,
            mask_bitmask=bitmask,  # faster causal at hdim 64 (not at 128)
            row_sum_chains=0 if causal else 2,  # faster non-causal, slower causal
        )
    if head_dim == head_dim_v == 96:
        # flash-attn-4's causal hdim-96 row (it takes 144 keys non-causal): 192 x 128 on
        # three consumer warpgroups, P through SMEM (Note [P through SMEM]); persistent
        # as hdim 64.
        return Sm90FwdTiles(
            tile_m=192, tile_n=128, num_stages=2, consumer_regs=160, producer_regs=32,
            persistent=True,
            p_in_smem=True,
        )
    if d <= 128:
        # tile_n 128, not FA3's 176 non-causal, which needs O in the Q buffer: slower.
        return Sm90FwdTiles(
            tile_m=128, tile_n=128, num_stages=2, consumer_regs=240, producer_regs=24,
            persistent=True,
            cluster_m=1 if causal else 2,  # K/V multicast: faster non-causal
            q_in_regs=not causal and head_dim == head_dim_v == 128,  # faster; level causal
            pin_p=True,
        )
    if (head_dim, head_dim_v) in ((192, 192), (192, 128)):
        # flash-attn-4's 128 x 112 at hdim 192, also for DeepSeek's (192, 128): Q 48 KiB
        # (O reuses it), 2 stages of K and V up to 42 KiB each, 216 KiB at (192, 192),
        # so no persistent CTAs; otherwise the hdim-256 row's choices.
        return Sm90FwdTiles(
            tile_m=128, tile_n=112, num_stages=2, consumer_regs=240, producer_regs=24,
            cluster_m=1 if masked else 2,
            prune_diagonal_loop=True,
            merge_diagonal_loop=causal,
        )
    if head_dim == head_dim_v == 256:
        # FA3's 128 x 80 with 2 stages: Q 64 KiB (O reuses it) and 2 x 40 KiB each of
        # K and V use 230400 of the 232448 bytes of SMEM a CTA may have, so no
        # persistent CTAs (no room for O's own buffer). P's conversions unpinned:
        # level here.
        return Sm90FwdTiles(
            tile_m=128, tile_n=80, num_stages=2, consumer_regs=240, producer_regs=24,
            cluster_m=1 if masked else 2,  # K/V multicast: faster, both masks
            prune_diagonal_loop=True,  # the largest compile; level on the H200
            merge_diagonal_loop=causal,  # compile time too; level on the H200
        )
    raise ValueError(
        f"sm90 forward supports head dims up to 128, 192, (192, 128) and 256, got "
        f"{head_dim}, {head_dim_v}"
    )


@cute.jit
def _wgmma(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    zero_init: cutlass.Constexpr[bool],
    wg_wait: cutlass.Constexpr[int],
) -> None:
    """Issue acc (+)= A B over all k-blocks as one wgmma group.

    wg_wait >= 0 waits until at most that many groups are in flight; -1 returns
    at once (the caller waits later, to overlap).
    """
    wgmma_gemm(tiled_mma, acc, tCrA, tCrB, zero_init)
    if cutlass.const_expr(wg_wait >= 0):
        warpgroup.wait_group(wg_wait)


def sm_count(default: int = 132) -> int:
    """Streaming multiprocessors of GPU 0, read when a persistent kernel is built
    (on the GPU host); 132 (H100 SXM / H200) when no GPU can be queried, as when
    cross-compiling. A kernel built for more SMs than it runs on stays correct."""
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return default
        err, dev = driver.cuDeviceGet(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return default
        err, n = driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
        return int(n) if err == driver.CUresult.CUDA_SUCCESS and n > 0 else default
    except Exception:  # noqa: BLE001 - no driver, no GPU: the default
        return default


class FlashFwdSm90(FwdCall):
    """Forward attention for sm_90a, one compiled binary per configuration.

    dtype: bfloat16 or float16 (cutlass type, numpy/jax dtype or name).
    head_dim, head_dim_v: D and Dv (compile time, D == Dv; 64, 128 and 256 (tile
        128 x 80) tested on the H200).
    causal: top-left causal mask.
    softmax_scale: multiplies q.k before the softmax; default 1/sqrt(D).
    tiles: a row in place of the tile table's (``fwd_tiles``); a row the kernel
        cannot run raises.
    masked: the call takes each query's interval of visible keys, (B, Sq, 2) int32
        (rules/ranges.py), which carries every mask (causal must then be False).
    segments: with ``masked``: the call also takes the query and key segment ids,
        (B, Sq) and (B, Sk) int32, compared where a document is not contiguous.
    sinks: the call also takes the sink logits, (B, Hq) float32, one more term of
        every row's softmax denominator (``OnlineSoftmax.finalize``).
    softcap: c > 0 caps each scaled logit s to c * tanh(s / c) (Note [Softcap in the
        kernels] in softmax.py); None for none.
    pack_gqa: with ``masked``, the number of query heads per KV head (the call's
        Hq / Hkv) that share one tile (Note [Packed GQA]), dividing tile_m; 1: a
        tile is one query head's.
    split_kv: with ``masked`` (and no sinks: the combine adds them), O and LSE are
        float32 partials (B x splits, ...), one per split of each tile's key blocks
        (Note [Split keys]); the split count is the outputs' batch extent over B.
    page_size: with ``masked``, K and V are page pools (pages, page_size, Hkv, D)
        and the call takes a page table (B, pages per sequence) int32 after the mask
        operands (Note [Paged KV]); 0: contiguous K and V.
    short: with ``masked``, ``fwd_tiles``' row for tiles of few rows (``short_tiles``).
    """

    def __init__(self, dtype: Any, head_dim: int, head_dim_v: int | None = None,
                 causal: bool = False, softmax_scale: float | None = None,
                 tiles: Sm90FwdTiles | None = None, masked: bool = False,
                 segments: bool = False, sinks: bool = False,
                 softcap: float | None = None, pack_gqa: int = 1, split_kv: bool = False,
                 page_size: int = 0, short: bool = False):
        self.dtype = as_cutlass_dtype(dtype, "sm90 forward")
        self.head_dim = head_dim
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        if self.head_dim % 16 or self.head_dim_v % 16:
            raise ValueError("head dims must be multiples of 16")
        self.causal = causal
        set_mask_flags(self, causal, masked, segments)
        # Tiles of unequal cost: launched (or handed out) longest first.
        self.lpt = causal or masked
        self.softmax_scale = (
            1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
        )
        self.tiles = tiles or fwd_tiles(self.head_dim, self.head_dim_v, causal, masked, short)
        t = self.tiles
        self.tile_m, self.tile_n, self.num_stages = t.tile_m, t.tile_n, t.num_stages
        set_forward_extras(self, sinks, softcap, pack_gqa, split_kv)
        set_page_size(self, page_size)
        if self.tile_m not in (128, 192):
            # Ping-pong takes turns between two or more consumer warpgroups.
            raise ValueError(f"tile_m must be 128 or 192 (64 rows per consumer "
                             f"warpgroup, 2 or 3 of them), got {self.tile_m}")
        self.num_consumer_wg = self.tile_m // 64
        self.num_threads = _THREADS_PER_WG * (1 + self.num_consumer_wg)
        self.num_mma_threads = _THREADS_PER_WG * self.num_consumer_wg
        self.persistent = t.persistent
        # Causal tiles differ in cost: persistent CTAs take them from a global
        # counter (the call's extra operand, see FlashFwdSm90Dynamic).
        self.dynamic = self.persistent and self.lpt
        # Int32 words of a tile ring slot (Note [Tile ring]): the tile index, and
        # masked its (m_block, head, batch), its ``BlockRange.fields()`` and with
        # split keys the split's keys.
        self.ring_words = 1 + (3 + 4 + 2 * int(self.split_kv) if self.masked else 0)
        self.num_sms = sm_count() if self.persistent else 0
        self.cluster_m = t.cluster_m
        if self.cluster_m not in (1, 2):
            raise ValueError(f"cluster_m must be 1 or 2, got {self.cluster_m}")
        if self.cluster_m > 1 and (self.dynamic or (t.tile_n // 2) % 8):
            raise ValueError("K/V multicast (cluster_m 2) serves the non-causal forward "
                             "and the causal one with a CTA per tile, with tile_n a "
                             "multiple of 16")
        if t.q_in_regs and not (head_dim <= 128 and t.consumer_regs >= 240):
            # hdim 64's 160-register consumers spill with it; at 256 Q alone would
            # take 128 registers per thread.
            raise ValueError("q_in_regs serves head dims up to 128 with 240-register "
                             f"consumers, got head dim {head_dim}, {t.consumer_regs}")
        logger.debug("FlashFwdSm90 %s D=%d Dv=%d causal=%s tiles=%s", self.dtype,
                     self.head_dim, self.head_dim_v, causal, t)

    # ------------------------------------------------------------------ host
    @cute.jit
    def launch(self, stream: cuda.CUstream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
               mO: cute.Tensor, mLSE: cute.Tensor, mTileCounter: cute.Tensor | None = None,
               mRanges: cute.Tensor | None = None, mQSeg: cute.Tensor | None = None,
               mKSeg: cute.Tensor | None = None, mSinks: cute.Tensor | None = None,
               mPageTable: cute.Tensor | None = None):
        """The host side of ``FwdCall.__call__``: the tensors as it takes them, the
        dynamic scheduler's (1,) int32 tile counter (zero at launch) or None, and
        with ``masked`` the key intervals (and with ``segments`` the ids), with
        ``page_size`` the page table."""
        if cutlass.const_expr(self.dynamic and self.masked and mTileCounter is None):
            mTileCounter, mRanges = counter_in_intervals(mQ, mRanges)
        if cutlass.const_expr(self.dynamic and mTileCounter is None):
            raise TypeError("the causal persistent forward takes a tile counter: call "
                            "FlashFwdSm90Dynamic (see make_fwd_sm90)")
        check_forward_dtypes(self, mQ, mK, mV, mO, mLSE)
        # FA4 order: (seqlen, head_dim, heads, batch); LSE (seqlen, heads, batch).
        mQ, mK, mV, mO = [permute(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO)]
        mLSE = permute(mLSE, [2, 1, 0])
        if cutlass.const_expr(self.pack_gqa > 1):  # Note [Packed GQA]
            mQ, mO, mLSE, mRanges, mQSeg = packed_gqa_views(self.pack_gqa, mQ, mO, mLSE,
                                                            mRanges, mQSeg)

        tm, tn, d, dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v
        major = cute.nvgpu.OperandMajorMode

        def tiled_mma(b_major, n, a_source):
            # One 64 x n wgmma atom per consumer warpgroup, A K-major, f32 accumulator.
            return sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, major.K, b_major, Float32,
                atom_layout_mnk=(self.num_consumer_wg, 1, 1), tiler_mn=(64, n),
                a_source=a_source)

        tiled_mma_qk = tiled_mma(major.K, tn, warpgroup.OperandSource.RMEM
                                 if self.tiles.q_in_regs else warpgroup.OperandSource.SMEM)
        # B = V^T (dv, n) is MN-major in SMEM (V rows are dv-contiguous).
        tiled_mma_pv = tiled_mma(major.MN, dv, warpgroup.OperandSource.SMEM
                                 if self.tiles.p_in_smem else warpgroup.OperandSource.RMEM)

        sQ_layout = sm90_smem_layout(self.dtype, tm, d)
        sK_layout = sm90_smem_layout(self.dtype, tn, d, self.num_stages)
        sV_layout = sm90_smem_layout(self.dtype, tn, dv, self.num_stages)
        sO_layout = sm90_smem_layout(self.dtype, tm, dv)
        # P (tile_m x tile_n, keys contiguous: the K-major A operand of P V).
        sP_layout = sm90_smem_layout(self.dtype, tm, tn)
        p_elems = cute.cosize(sP_layout) if cutlass.const_expr(self.tiles.p_in_smem) else 0

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        g2s_kv = (cpasync.CopyBulkTensorTileG2SMulticastOp() if self.cluster_m > 1
                  else g2s)
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_layout, (tm, d))
        # Paged: one TMA box per page piece of a block (Note [Paged KV]).
        box_n = self.page_rows
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            g2s_kv, mK, kv_box_layout(sK_layout, box_n, d), (box_n, d), self.cluster_m
        )
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            g2s_kv, mV, kv_box_layout(sV_layout, box_n, dv), (box_n, dv), self.cluster_m
        )
        # Split keys: float32 partials stored from the registers (``store_split``).
        tma_atom_O, tma_O = None, mO
        if cutlass.const_expr(not self.split_kv):
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, sO_layout, (tm, dv)
            )
        self.tx_bytes_q = cute.size_in_bytes(self.dtype, sQ_layout)
        self.tx_bytes_k = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        self.tx_bytes_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))

        # O reuses the Q buffer (Q is dead once the last S = Q K^T finished), except
        # in persistent CTAs, where the next tile's Q loads while O is stored.
        q_elems = max(cute.cosize(sQ_layout), cute.cosize(sO_layout))
        o_elems = cute.cosize(sO_layout) if cutlass.const_expr(self.persistent) else 0

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, q_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, o_elems], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], 1024]
            # Dynamic scheduler: a 2-slot ring of tiles, producer -> consumers (Note
            # [Tile ring]).
            mbar_sched: cute.struct.MemRange[cutlass.Int64, 4 if self.dynamic else 0]
            sched: cute.struct.MemRange[Int32, 2 * self.ring_words if self.dynamic else 0]

        smem_bytes = SharedStorage.size_in_bytes()
        if cutlass.const_expr(smem_bytes > _SM90_MAX_SMEM_BYTES):
            raise ValueError(f"sm90 forward with {self.tiles} needs {smem_bytes} bytes of "
                             f"SMEM, more than the {_SM90_MAX_SMEM_BYTES} a CTA may use")
        seqlen_q = self.q_rows(mQ)
        c = self.cluster_m
        # Clusters: the query blocks of a head rounded up to whole clusters.
        grid = (cute.ceil_div(seqlen_q, tm * c) * c, cute.size(mQ.shape[2]),
                cute.size(self.tile_batches(mQ, mLSE)))
        if cutlass.const_expr(self.persistent):
            total = grid[0] * grid[1] * grid[2] // c
            grid = (cutlass.min(total, self.num_sms // c) * c, 1, 1)
        if cutlass.const_expr(self.lpt and not self.persistent):
            # The LPT order over a 1-D grid (``block_coord``).
            grid = (grid[0] * grid[1] * grid[2], 1, 1)
        self.kernel(
            tma_Q,
            tma_K,
            tma_V,
            tma_O,
            mLSE,
            mTileCounter,
            mRanges,
            mQSeg,
            mKSeg,
            mSinks,
            mPageTable,
            tma_atom_Q,
            tma_atom_K,
            tma_atom_V,
            tma_atom_O,
            sQ_layout,
            sK_layout,
            sV_layout,
            sO_layout,
            sP_layout,
            tiled_mma_qk,
            tiled_mma_pv,
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], cluster=[c, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA view of Q (Sq, D, Hq, B)
        mK: cute.Tensor,  # TMA view of K (Sk, D, Hkv, B)
        mV: cute.Tensor,  # TMA view of V (Sk, Dv, Hkv, B)
        mO: cute.Tensor,  # TMA view of O (Sq, Dv, Hq, B)
        mLSE: cute.Tensor,  # (Sq, Hq, B) f32
        mTileCounter: cute.Tensor | None,  # (1,) int32 (dynamic scheduler only)
        mRanges: cute.Tensor | None,  # (B, Sq, 2) int32 key intervals (masked only)
        mQSeg: cute.Tensor | None,  # (B, Sq) int32 (segments only)
        mKSeg: cute.Tensor | None,  # (B, Sk) int32 (segments only)
        mSinks: cute.Tensor | None,  # (B, Hq) f32 sink logits (sinks only)
        mPageTable: cute.Tensor | None,  # (B, pages per sequence) int32 (paged only)
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tma_atom_O: cute.CopyAtom,
        sQ_layout: cute.ComposedLayout,  # (tile_m, D)
        sK_layout: cute.ComposedLayout,  # (tile_n, D, stages)
        sV_layout: cute.ComposedLayout,  # (tile_n, Dv, stages)
        sO_layout: cute.ComposedLayout,  # (tile_m, Dv)
        sP_layout: cute.ComposedLayout,  # (tile_m, tile_n), used with p_in_smem
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                if cutlass.const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)

        tma_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # PipelineTmaAsync releases with one elected lane per consumer warp.
        consumer_warps = pipeline.CooperativeGroup(
            pipeline.Agent.Thread, self.num_mma_threads // cute.arch.WARP_SIZE
        )

        c = self.cluster_m

        def tma_pipeline(mbar, num_stages, tx_count, shared=False):
            if cutlass.const_expr(not shared or c == 1):
                return pipeline.PipelineTmaAsync.create(
                    barrier_storage=mbar.data_ptr(),
                    num_stages=num_stages,
                    producer_group=tma_thread,
                    consumer_group=consumer_warps,
                    tx_count=tx_count,
                    defer_sync=True,
                )
            # K / V multicast into the cluster (Note [K/V multicast]): lane r of each
            # consumer warp releases a stage at rank r.
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar.data_ptr(),
                num_stages=num_stages,
                producer_group=tma_thread,
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, c * self.num_mma_threads // cute.arch.WARP_SIZE),
                tx_count=tx_count,
                cta_layout_vmnk=cute.make_layout((1, c, 1, 1)),
                mcast_mode_mn=(0, 1),
                defer_sync=True,
            )

        pipe_q = tma_pipeline(storage.mbar_q, 1, self.tx_bytes_q)
        pipe_k = tma_pipeline(storage.mbar_k, self.num_stages, self.tx_bytes_k, shared=True)
        pipe_v = tma_pipeline(storage.mbar_v, self.num_stages, self.tx_bytes_v, shared=True)
        pipe_sched = None
        if cutlass.const_expr(self.dynamic):
            # The load warp (all 32 lanes arrive) hands tile indices to every
            # consumer thread (each arrives when it has read its copy).
            pipe_sched = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_sched.data_ptr(),
                num_stages=2,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, self.num_mma_threads),
                defer_sync=True,
            )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(c, 1), is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if cutlass.const_expr(self.persistent):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        else:
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        sP = None
        if cutlass.const_expr(self.tiles.p_in_smem):
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)

        # Tiles run over (query block, head, batch x split) (Note [Split keys]).
        num_b = self.tile_batches(mQ, mLSE)
        # Non-persistent: this CTA's one tile (persistent CTAs leave it unused).
        m_block, head, out_batch = self.block_coord(mQ, mK, num_b)
        batch = out_batch
        seqlen_q = self.q_rows(mQ)
        seqlen_k = mK.shape[0]
        if cutlass.const_expr(self.page_size):
            seqlen_k = mPageTable.shape[1] * self.page_size
        group = mQ.shape[2] // mK.shape[2]
        head_kv = head // group
        n_block_max = self.n_block_max(m_block, seqlen_k)
        blocks = keys = None
        if cutlass.const_expr(self.masked and not self.persistent):
            batch, blocks, keys = self.kv_blocks(mRanges, m_block, out_batch, seqlen_q, num_b)
            n_block_max = blocks.end
        # Causal with K/V multicast: the cluster loads the key blocks of its last
        # query block; the others skip the ones past their own (Note [K/V multicast]).
        n_load, n_skip = n_block_max, None
        if cutlass.const_expr(c > 1 and self.causal):
            last = m_block - cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()) + c - 1
            n_load = self.n_block_max(last, seqlen_k)
            n_skip = n_load - n_block_max
        pipeline.pipeline_init_wait(cluster_shape_mn=(c, 1))

        # Pipeline states live across the tiles of a persistent CTA.
        kv_prod = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, self.num_stages)
        q_prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv_cons = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer, self.num_stages)
        q_cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.tiles.producer_regs)
            # What every tile's ``load`` takes before the pipeline states.
            load_ops = (mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, pipe_q,
                        pipe_k, pipe_v, mPageTable)
            if warp_idx == 0:
                if cutlass.const_expr(self.dynamic):
                    self.load_dynamic(
                        load_ops, q_prod, kv_prod, pipe_sched,
                        self.ring(storage), mTileCounter, mRanges,
                        num_b)
                elif cutlass.const_expr(self.persistent):
                    num_m, total = self.tile_count(mQ, num_b)
                    for t in cutlass.range(self.first_unit(), total, self.unit_step(),
                                           unroll=1):
                        t_m, t_head, t_batch = self.tile_coord(t, num_m, mQ.shape[2])
                        t_m = self.cta_block(t_m)
                        q_prod, kv_prod = self.load(
                            *load_ops, q_prod, kv_prod, t_m, t_head, t_head // group, t_batch,
                            cute.ceil_div(seqlen_k, self.tile_n))
                else:
                    self.load(*load_ops, q_prod, kv_prod, m_block, head, head_kv, batch,
                              n_load, blocks)
        else:
            cute.arch.setmaxregister_increase(self.tiles.consumer_regs)
            # What every tile's ``consume`` takes before the pipeline states.
            consume_ops = (mO, mLSE, mSinks, sQ, sK, sV, sO, sP, tma_atom_O, tiled_mma_qk,
                           tiled_mma_pv, pipe_q, pipe_k, pipe_v)
            masks = (mRanges, mQSeg, mKSeg)
            if cutlass.const_expr(self.persistent):
                # Warpgroup 1 takes the first GEMM turn (ping-pong); the turns then
                # alternate through every tile.
                if warp_idx // 4 == 1:
                    cute.arch.barrier_arrive(
                        barrier_id=_BAR_SCHED_WG1, number_of_threads=2 * _THREADS_PER_WG
                    )
                num_m, total = self.tile_count(mQ, num_b)
                if cutlass.const_expr(self.dynamic):
                    sched = self.ring(storage)
                    s_cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
                    t, slot, s_cons = self.next_tile(pipe_sched, sched, s_cons)
                    while t < total:
                        if cutlass.const_expr(self.masked):
                            t_m, t_head, t_out = slot[:3]
                        else:
                            t_m, t_head, t_out = self.lpt_coord(t, mQ, mK, num_b)
                        t_batch, t_blocks, t_keys = t_out, None, None
                        t_max = self.n_block_max(t_m, seqlen_k)
                        if cutlass.const_expr(self.masked):
                            t_batch, t_blocks, t_keys = self.ring_blocks(slot[3:], t_out,
                                                                         mRanges)
                            t_max = t_blocks.end
                        q_cons, kv_cons = self.consume(
                            *consume_ops, q_cons, kv_cons, t_m, t_head, t_batch, seqlen_q,
                            seqlen_k, t_max, first_turn=False, blocks=t_blocks, masks=masks,
                            out_batch=t_out, keys=t_keys)
                        t, slot, s_cons = self.next_tile(pipe_sched, sched, s_cons)
                else:
                    for t in cutlass.range(self.first_unit(), total, self.unit_step(),
                                           unroll=1):
                        t_m, t_head, t_batch = self.tile_coord(t, num_m, mQ.shape[2])
                        t_m = self.cta_block(t_m)
                        q_cons, kv_cons = self.consume(
                            *consume_ops, q_cons, kv_cons, t_m, t_head, t_batch, seqlen_q,
                            seqlen_k, cute.ceil_div(seqlen_k, self.tile_n), first_turn=False)
                # The last O store must have read SMEM before the CTA exits.
                if cute.arch.thread_idx()[0] == _THREADS_PER_WG:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            else:
                self.consume(*consume_ops, q_cons, kv_cons, m_block, head, batch, seqlen_q,
                             seqlen_k, n_block_max, first_turn=True, n_skip=n_skip,
                             blocks=blocks, masks=masks, out_batch=out_batch, keys=keys)
        if cutlass.const_expr(c > 1):
            # No CTA leaves while its peer may still multicast into it or release
            # its stages (Note [K/V multicast]).
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def tile_batches(self, mQ: cute.Tensor, mLSE: cute.Tensor):
        """The batch extent of the tiles: B, or with split keys B x splits, the
        partial LSE's (Note [Split keys])."""
        if cutlass.const_expr(self.split_kv):
            return mLSE.shape[2]
        return mQ.shape[3]

    def block_coord(self, mQ: cute.Tensor, mK: cute.Tensor, num_b):
        """(m_block, head, batch) of a non-persistent CTA. Causal tiles lower in the
        matrix have more KV blocks: the LPT order launches them first, so that the
        longest CTAs do not start last."""
        bidx, head, batch = cute.arch.block_idx()
        m_block = bidx
        c = self.cluster_m
        # With K/V multicast the order is over clusters (units of c query blocks of
        # one head), the CTA taking block c unit + rank.
        unit = bidx if cutlass.const_expr(c == 1) else bidx // c
        if cutlass.const_expr(self.lpt):
            m_block, head, batch = self.lpt_coord(unit, mQ, mK, num_b)
            m_block = self.cta_block(m_block)
        return m_block, head, batch

    def lpt_section(self, kv_blocks, group):
        """Heads per L2 section of this kernel (``lpt_section_size``) whose tiles
        read kv_blocks key blocks."""
        return lpt_section_size(
            kv_blocks, group,
            self.tile_n * (self.head_dim + self.head_dim_v) * (self.dtype.width // 8),
            lambda c, a, b: cutlass.select_(c, Int32(a), b), Int32(1))

    def lpt_coord(self, t, mQ: cute.Tensor, mK: cute.Tensor, num_b, kv_blocks=None):
        """(m_block, head, batch) of unit t in the LPT order (``lpt_tile``), over
        num_b batches (with split keys: batch x split, Note [Split keys]), in
        sections for tiles of kv_blocks key blocks (default: every key block)."""
        num_heads = mQ.shape[2]
        if cutlass.const_expr(kv_blocks is None):
            kv_blocks = cute.ceil_div(mK.shape[0], self.tile_n)
        size = self.lpt_section(kv_blocks, num_heads // mK.shape[2])
        num_m = cute.ceil_div(self.q_rows(mQ), self.tile_m * self.cluster_m)
        return lpt_tile(t, num_m, num_heads, num_heads * num_b, size, cutlass.min)

    def key_span_blocks(self, mRanges: cute.Tensor, seqlen_q, seqlen_k):
        """Key blocks a masked tile reads at most, estimated from the widest interval
        of 32 rows spread over the batch, the same rows in every CTA (Note
        [Sections of masked tiles]); one warp, every lane gets the result."""
        batch, row = span_sample(cute.arch.lane_idx(), mRanges.shape[0], seqlen_q)
        hi, _ = decode_hi(mRanges[batch, row, 1])
        span = cute.arch.warp_reduction(cutlass.max(hi - mRanges[batch, row, 0], 0),
                                        cutlass.max)
        return span_blocks(span, seqlen_k, self.tile_m, self.tile_n, cutlass.min)

    def ring(self, storage):
        """The tile ring in SMEM (Note [Tile ring]): (words, 2 slots) int32."""
        return storage.sched.get_tensor(cute.make_layout((self.ring_words, 2)))

    def post_tile(self, pipe_sched, sched: cute.Tensor, state: pipeline.PipelineState, t,
                  coords=(), blocks=None, keys=None):
        """Load warp: hand tile t to the consumers in the ring's next slot, masked
        with its (m_block, head, batch), key blocks and split's keys (the final
        index past the end goes alone); returns the advanced state."""
        words = (t,) + tuple(coords)
        if cutlass.const_expr(blocks is not None):
            words += blocks.fields() + (tuple(keys) if self.split_kv else ())
        pipe_sched.producer_acquire(state)
        for w, x in enumerate(words):
            sched[w, state.index] = x
        pipe_sched.producer_commit(state)
        state.advance()
        return state

    @cute.jit
    def next_tile(self, pipe_sched, sched: cute.Tensor, state: pipeline.PipelineState):
        """Consumer thread: the next tile from the load warp (an index >= the tile
        count when the CTA is done); returns (index, the slot's other words as a
        tuple, advanced state)."""
        pipe_sched.consumer_wait(state)
        t = sched[0, state.index]
        words = tuple(sched[w, state.index] for w in range(1, self.ring_words))
        pipe_sched.consumer_release(state)
        state.advance()
        return t, words, state

    def ring_blocks(self, words: tuple, tile_batch, mRanges: cute.Tensor):
        """(batch, blocks, keys) of a masked tile from its ring slot's words, as
        ``kv_blocks`` gives them."""
        batch, keys = tile_batch, None
        if cutlass.const_expr(self.split_kv):
            batch = tile_batch % mRanges.shape[0]
            keys = (words[4], words[5])
        return batch, BlockRange.of(words[:4], self.tile_n), keys

    @cute.jit
    def load_dynamic(
        self,
        load_ops: tuple,  # (mQ, mK, mV, sQ, sK, sV, TMA atoms, pipelines) as ``load`` takes
        q_state: pipeline.PipelineState,
        state: pipeline.PipelineState,
        pipe_sched,
        sched: cute.Tensor,  # the tile ring, (words, 2) int32 in SMEM
        mTileCounter: cute.Tensor,  # (1,) int32, zero at launch
        mRanges: cute.Tensor | None,  # (B, Sq, 2) int32 key intervals (masked only)
        num_b: Int32,  # the tiles' batch extent (``tile_count``)
    ):
        """Load warp of the dynamic scheduler: the CTA's first tile is its block
        index; each next one is grid + the global counter's old value (one atomic
        per tile, by lane 0, issued before the tile's loads so its latency hides
        behind them). Every tile, with its key blocks where masked, and a final
        index past the end go to the consumers through the tile ring (Note [Tile
        ring])."""
        mQ, mK = load_ops[0], load_ops[1]
        _, total = self.tile_count(mQ, num_b)
        group = mQ.shape[2] // mK.shape[2]
        seqlen_k = mK.shape[0]
        span = None
        # Split keys: decode's single query block per head, where sections only
        # reorder the heads (and the load warp has no register to spare).
        if cutlass.const_expr(self.masked and not self.split_kv):
            keys = seqlen_k
            if cutlass.const_expr(self.page_size):
                keys = load_ops[-1].shape[1] * self.page_size  # the page table's keys
            span = self.key_span_blocks(mRanges, self.q_rows(mQ), keys)
        grid = cute.arch.grid_dim()[0]
        lane = cute.arch.lane_idx()
        s_prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
        t = cute.arch.block_idx()[0]
        while t < total:
            if cutlass.const_expr(not self.masked):
                # The index alone, at once: the consumers work out the rest.
                s_prod = self.post_tile(pipe_sched, sched, s_prod, t)
            claimed = Int32(0)
            if lane == 0:
                claimed = cute.arch.atomic_add(mTileCounter.iterator, Int32(1))
            t_m, t_head, t_batch = self.lpt_coord(t, mQ, mK, num_b, span)
            t_blocks = None
            t_max = self.n_block_max(t_m, seqlen_k)
            if cutlass.const_expr(self.masked):
                coords = (t_m, t_head, t_batch)
                t_batch, t_blocks, t_keys = self.kv_blocks(mRanges, t_m, t_batch,
                                                           self.q_rows(mQ), num_b)
                t_max = t_blocks.end
                s_prod = self.post_tile(pipe_sched, sched, s_prod, t, coords, t_blocks, t_keys)
            q_state, state = self.load(*load_ops, q_state, state, t_m, t_head, t_head // group,
                                       t_batch, t_max, t_blocks)
            t = grid + cute.arch.shuffle_sync(claimed, 0)
        self.post_tile(pipe_sched, sched, s_prod, t)

    def tile_count(self, mQ, num_b):
        """(units per head, units of the whole problem) of the persistent walk; mQ
        is (Sq, D, Hq, B), num_b the tiles' batch extent (B, or B x splits). A unit
        is a query block, or with K/V multicast the cluster_m adjacent query blocks
        of one cluster (``cta_block``)."""
        num_m = cute.ceil_div(self.q_rows(mQ), self.tile_m * self.cluster_m)
        return num_m, num_m * mQ.shape[2] * num_b

    def first_unit(self):
        """The persistent walk's first unit for this CTA (its cluster's index)."""
        if cutlass.const_expr(self.cluster_m == 1):
            return cute.arch.block_idx()[0]
        return cute.arch.block_idx()[0] // self.cluster_m

    def unit_step(self):
        """Units between two of one CTA's walk (the grid's clusters)."""
        if cutlass.const_expr(self.cluster_m == 1):
            return cute.arch.grid_dim()[0]
        return cute.arch.grid_dim()[0] // self.cluster_m

    def cta_block(self, unit_m):
        """This CTA's query block of a unit's query-block index (Note [K/V
        multicast])."""
        if cutlass.const_expr(self.cluster_m == 1):
            return unit_m
        return unit_m * self.cluster_m + cute.arch.make_warp_uniform(
            cute.arch.block_idx_in_cluster())

    @staticmethod
    def tile_coord(t, num_m, num_heads):
        """(m_block, head, batch) of tile t of a persistent CTA: query blocks
        fastest, so the CTAs running together share the K/V of few heads in L2."""
        hb = t // num_m
        return t - hb * num_m, hb % num_heads, hb // num_heads

    def kv_blocks(self, mRanges: cute.Tensor, m_block, tile_batch, seqlen_q, num_b):
        """(batch, blocks, keys) of a masked tile: its batch, the key blocks query
        block m_block visits and, with split keys, the keys of the tile's split
        (``BlockRange.split``; tile_batch is split x B + batch of num_b = B x
        splits), else None. With one tile per CTA every warp that needs them reduces
        the tile's intervals itself, so the roles agree without talking; the
        dynamic scheduler's load warp hands them on (Note [Tile ring])."""
        batch, keys = tile_batch, None
        if cutlass.const_expr(self.split_kv):
            b = mRanges.shape[0]
            batch = tile_batch % b
        blocks = BlockRange(mRanges, self.tile_m, self.tile_n, m_block, batch, seqlen_q,
                            at_least_one=True)
        if cutlass.const_expr(self.split_kv):
            keys = blocks.split(tile_batch // b, num_b // b)
        return batch, blocks, keys

    def n_block_max(self, m_block, seqlen_k):
        """KV blocks this query block sees (causal: up to its last row)."""
        n = cute.ceil_div(seqlen_k, self.tile_n)
        if cutlass.const_expr(self.causal):
            n = cutlass.min(n, cute.ceil_div((m_block + 1) * self.tile_m, self.tile_n))
        return n

    @cute.jit
    def load(
        self,
        mQ: cute.Tensor,  # (Sq, D, Hq, B)
        mK: cute.Tensor,  # (Sk, D, Hkv, B)
        mV: cute.Tensor,  # (Sk, Dv, Hkv, B)
        sQ: cute.Tensor,  # (tile_m, D)
        sK: cute.Tensor,  # (tile_n, D, stages)
        sV: cute.Tensor,  # (tile_n, Dv, stages)
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        pipe_q: pipeline.PipelineTmaAsync,
        pipe_k: pipeline.PipelineTmaAsync,
        pipe_v: pipeline.PipelineTmaAsync,
        mPageTable: cute.Tensor | None,  # (B, pages per sequence) int32 (paged only)
        q_state: pipeline.PipelineState,
        state: pipeline.PipelineState,
        m_block: Int32,
        head: Int32,
        head_kv: Int32,
        batch: Int32,
        n_block_max: Int32,
        blocks: BlockRange | None = None,
    ):
        """Producer warp: Q once, then K/V blocks from the last one down to 0 (masked:
        down to ``blocks.first``).
        Returns the advanced (Q, K/V) pipeline states.

        K of block n is loaded before V of block n + 1, the order the consumers
        use them in with intra-warpgroup overlap (S_n = Q K_n is issued before
        O += P_(n+1) V_(n+1)). TMA zero-fills rows past the sequence ends.
        """
        gQ = cute.local_tile(
            mQ[None, None, head, batch], (self.tile_m, self.head_dim), (m_block, 0)
        )
        tQsQ, tQgQ = tma_tile_partition(tma_atom_Q, sQ, gQ)
        mcast = {}
        if cutlass.const_expr(self.page_size > 0):
            # Paged: each block's pages are looked up as it is loaded (``PagedKV``).
            tKgK = PagedKV(mK, mPageTable, sK, tma_atom_K, self.page_size, self.tile_n,
                           head_kv, batch)
            tVgV = PagedKV(mV, mPageTable, sV, tma_atom_V, self.page_size, self.tile_n,
                           head_kv, batch)
            tKsK = tVsV = None
        elif cutlass.const_expr(self.cluster_m == 1):
            gK = cute.local_tile(
                mK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (None, 0))
            gV = cute.local_tile(
                mV[None, None, head_kv, batch], (self.tile_n, self.head_dim_v), (None, 0))
            tKsK, tKgK = tma_tile_partition(tma_atom_K, sK, gK)
            tVsV, tVgV = tma_tile_partition(tma_atom_V, sV, gV)
        else:
            # This CTA's rows of each K / V block, multicast to the whole cluster
            # (Note [K/V multicast]).
            gK = cute.local_tile(
                mK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (None, 0))
            gV = cute.local_tile(
                mV[None, None, head_kv, batch], (self.tile_n, self.head_dim_v), (None, 0))
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            ranks = cute.make_layout(self.cluster_m)
            tKsK, tKgK = cpasync.tma_partition(tma_atom_K, rank, ranks,
                                               cute.group_modes(sK, 0, 2),
                                               cute.group_modes(gK, 0, 2))
            tVsV, tVgV = cpasync.tma_partition(tma_atom_V, rank, ranks,
                                               cute.group_modes(sV, 0, 2),
                                               cute.group_modes(gV, 0, 2))
            mcast = {"mcast_mask": cutlass.Int16((1 << self.cluster_m) - 1)}

        n_last = n_block_max - 1
        n_first = 0 if cutlass.const_expr(blocks is None) else blocks.first
        self._load_kv(pipe_k, tma_atom_K, tKgK, tKsK, n_last, state, mcast)
        pipe_q.producer_acquire(q_state)
        cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        for i in cutlass.range(n_last - n_first, unroll=1):
            n_prev = n_last - i
            state_prev = state.clone()
            state.advance()
            self._load_kv(pipe_k, tma_atom_K, tKgK, tKsK, n_prev - 1, state, mcast)
            self._load_kv(pipe_v, tma_atom_V, tVgV, tVsV, n_prev, state_prev, mcast)
        self._load_kv(pipe_v, tma_atom_V, tVgV, tVsV, n_first, state, mcast)
        state.advance()
        q_state.advance()
        return q_state, state

    @staticmethod
    def _load_kv(pipe, atom, tXgX, tXsX, n_block, state, mcast: dict):
        """K or V block n_block into the stage of ``state``, once the consumers have
        freed it (mcast: the multicast mask with K/V multicast, else empty; tXgX a
        ``PagedKV`` where the keys are paged)."""
        if cutlass.const_expr(isinstance(tXgX, PagedKV)):
            tXgX.load(pipe, state, n_block)
        else:
            pipe.producer_acquire(state)
            cute.copy(atom, tXgX[None, n_block], tXsX[None, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state), **mcast)

    # -------------------------------------------------------------- consumer
    def _sched_sync(self):
        """Wait for this warpgroup's turn to issue GEMMs (ping-pong)."""
        wg = cute.arch.make_warp_uniform(cute.arch.thread_idx()[0] // _THREADS_PER_WG)
        cute.arch.barrier(
            barrier_id=_BAR_SCHED_WG1 - 1 + wg, number_of_threads=2 * _THREADS_PER_WG
        )

    def _release(self, pipe, state):
        """Release a consumed K / V / Q stage."""
        if cutlass.const_expr(self.cluster_m > 1 and pipe.consumer_mask is None):
            # In a cluster the pipeline's own lane test for a CTA-local pipeline (Q)
            # is wrong at rank > 0; an elected lane's local arrive serves it.
            consumer_release_elected(pipe, state)
        else:
            pipe.consumer_release(state)

    def _sched_arrive(self):
        """Hand the GEMM turn to the next consumer warpgroup (round robin)."""
        wg = cute.arch.make_warp_uniform(cute.arch.thread_idx()[0] // _THREADS_PER_WG)
        # Consumer warpgroups are 1 .. num_consumer_wg.
        nxt = wg % self.num_consumer_wg + 1
        cute.arch.barrier_arrive(
            barrier_id=_BAR_SCHED_WG1 - 1 + nxt, number_of_threads=2 * _THREADS_PER_WG
        )

    @cute.jit
    def consume(
        self,
        mO: cute.Tensor,  # TMA view (Sq, Dv, Hq, B)
        mLSE: cute.Tensor,  # (Sq, Hq, B)
        mSinks: cute.Tensor | None,  # (B, Hq) f32 (sinks only)
        sQ: cute.Tensor,  # (tile_m, D)
        sK: cute.Tensor,  # (tile_n, D, stages)
        sV: cute.Tensor,  # (tile_n, Dv, stages)
        sO: cute.Tensor,  # (tile_m, Dv), its own buffer (persistent) or sQ's
        sP: cute.Tensor | None,  # (tile_m, tile_n) with p_in_smem
        tma_atom_O: cute.CopyAtom,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        pipe_q: pipeline.PipelineTmaAsync,
        pipe_k: pipeline.PipelineTmaAsync,
        pipe_v: pipeline.PipelineTmaAsync,
        q_state: pipeline.PipelineState,
        state: pipeline.PipelineState,
        m_block: Int32,
        head: Int32,
        batch: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        n_block_max: Int32,
        first_turn: cutlass.Constexpr[bool],
        n_skip=None,
        blocks: BlockRange | None = None,
        masks: tuple = (None, None, None),
        out_batch=None,
        keys: tuple | None = None,
    ):
        """Consumer warpgroups: one tile of O and LSE. Returns the advanced (Q, K/V)
        pipeline states. first_turn: give warpgroup 1 the first GEMM turn here (a
        persistent CTA does that once, before its first tile). n_skip: K / V stages
        to release unread first (causal K/V multicast). blocks, masks: with
        ``masked``, the tile's key blocks and (key intervals, query and key segment
        ids). out_batch: the batch index of O and LSE (split keys: split x B +
        batch), else ``batch``; keys: the split's keys (``kv_blocks``)."""
        if cutlass.const_expr(out_batch is None):
            out_batch = batch
        tidx = cute.arch.thread_idx()[0] - _THREADS_PER_WG
        wg_idx = cute.arch.make_warp_uniform(tidx // _THREADS_PER_WG)
        wg_layout = cute.make_layout(self.num_consumer_wg, stride=_THREADS_PER_WG)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        wg_mma_qk = tiled_mma_qk.get_slice(wg_layout(wg_idx))
        wg_mma_pv = tiled_mma_pv.get_slice(wg_layout(wg_idx))

        if cutlass.const_expr(self.tiles.q_in_regs):
            tSrQ = wg_mma_qk.make_fragment_A(
                wg_mma_qk.partition_shape_A((self.tile_m, self.head_dim)))
        else:
            tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        sVt = transpose_smem(sV)
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        if cutlass.const_expr(self.tiles.p_in_smem):
            tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_A(sP))
        else:
            tOrP = wg_mma_pv.make_fragment_A(
                wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))
        shape_S = wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
        acc_O = cute.make_rmem_tensor(
            wg_mma_pv.partition_shape_C((self.tile_m, self.head_dim_v)), Float32
        )
        acc_O.fill(0.0)

        softmax = OnlineSoftmax(self.scale_log2, cute.size(acc_mn_view(acc_O), mode=[0]),
                                row_sum_chains=self.tiles.row_sum_chains)
        softmax.reset()
        if cutlass.const_expr(self.masked):
            mask = RangeMask(self.tile_m, self.tile_n, thr_mma_qk, tiled_mma_qk.get_slice(0),
                             *masks, m_block, batch, seqlen_q, seqlen_k, keys=keys)
        else:
            mask = TileMask(self.tile_m, self.tile_n, seqlen_k, thr_mma_qk,
                            tiled_mma_qk.get_slice(0), bitmask=self.tiles.mask_bitmask)

        # Warpgroup 1 takes the first GEMM turn. (A compile-time and a run-time
        # test cannot share one `if` in the DSL.)
        if cutlass.const_expr(first_turn):  # noqa: SIM102
            if wg_idx == 0:
                cute.arch.barrier_arrive(
                    barrier_id=_BAR_SCHED_WG1, number_of_threads=2 * _THREADS_PER_WG
                )

        if cutlass.const_expr(n_skip is not None):
            # K/V multicast, causal: the cluster's first n_skip key blocks are past
            # this query block's last one; free their stages unread.
            for _ in cutlass.range(n_skip, unroll=1):
                pipe_k.consumer_wait(state)
                self._release(pipe_k, state)
                pipe_v.consumer_wait(state)
                self._release(pipe_v, state)
                state.advance()
        pipe_q.consumer_wait(q_state)
        if cutlass.const_expr(self.tiles.q_in_regs):
            load_q = cute.make_copy_atom(
                cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
            thr_load_q = cute.make_tiled_copy_A(load_q, tiled_mma_qk).get_slice(tidx)
            cute.copy(load_q, thr_load_q.partition_S(sQ), thr_load_q.retile(tSrQ))
            if cutlass.const_expr(self.persistent):
                # Q lives in registers now: the next tile's Q may load.
                self._release(pipe_q, q_state)
                q_state.advance()

        # Blocks [n_causal, n_block_max) touch the diagonal; the first block
        # processed (the last one) also carries the seqlen_k tail.
        n_last = n_block_max - 1
        n_causal = n_last
        if cutlass.const_expr(self.causal):
            n_causal = cutlass.min((m_block * self.tile_m) // self.tile_n, n_last)

        def qk(stage, wg_wait):
            acc_S = cute.make_rmem_tensor(shape_S, Float32)
            _wgmma(
                tiled_mma_qk,
                acc_S,
                tSrQ,
                tSrK[None, None, None, stage],
                zero_init=True,
                wg_wait=wg_wait,
            )
            return acc_S

        def pv(stage, wg_wait):
            _wgmma(
                tiled_mma_pv,
                acc_O,
                tOrP,
                tOrVt[None, None, None, stage],
                zero_init=False,
                wg_wait=wg_wait,
            )

        def to_p(acc_S):
            if cutlass.const_expr(self.tiles.p_in_smem):
                # Called once the previous P V finished reading sP (Note [P through
                # SMEM]); the warpgroup's writes are visible to its wgmma after the
                # async-proxy fence and its own barrier.
                rP = cute.make_fragment_like(acc_S, self.dtype)
                rP.store(acc_S.load().to(self.dtype))
                stmatrix_acc(rP, tiled_mma_qk, sP, tidx, self.dtype)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=_BAR_P_WG0 + wg_idx,
                                  number_of_threads=_THREADS_PER_WG)
            else:
                convert_to_operand_a(acc_S, tOrP, self.dtype)
                if cutlass.const_expr(self.tiles.pin_p):
                    pin_fragment(tOrP)

        # What every step takes after (state, n_block).
        step_args = (m_block, qk, pv, to_p, softmax, mask, acc_O, pipe_k, pipe_v)

        # First block: S, softmax, P; its P V is issued with the next S.
        pipe_k.consumer_wait(state)
        self._sched_sync()
        acc_S = qk(state.index, wg_wait=-1)
        self._sched_arrive()
        warpgroup.wait_group(0)
        self._release(pipe_k, state)
        self._cap(acc_S)
        mask.apply(acc_S, m_block, n_last, mask_seqlen=True, mask_causal=self.causal)
        softmax.online_softmax(acc_S, is_first=True)
        to_p(acc_S)
        if cutlass.const_expr(self.masked):
            n_first, full_first, full_end = blocks.first, blocks.full_first, blocks.full_end
            if cutlass.const_expr(self.tiles.merge_diagonal_loop):
                # Blocks n_last - 1 down to the first; those with a masked element
                # (``BlockRange.masked_block``) mask by a run-time test.
                for i in cutlass.range(n_last - n_first, unroll=1):
                    n = n_last - 1 - i
                    state = self._overlapped_step(
                        state, n, *step_args, mask_causal=True,
                        mask_if=BlockRange.masked_block(n, full_first, full_end))
            else:
                # As causal: blocks [hi_edge, n_last) masked (the diagonal, the key
                # lengths), [lo_edge, hi_edge) not, [n_first, lo_edge) masked (a
                # window's left edge, earlier documents), walked from the last.
                hi_edge, lo_edge = edge_walk(n_first, n_last + 1, full_first, full_end,
                                             cutlass.min, cutlass.max)
                for i in cutlass.range(n_last - hi_edge, unroll=1):
                    state = self._overlapped_step(state, n_last - 1 - i, *step_args,
                                                  mask_causal=True)
                for i in cutlass.range(hi_edge - lo_edge, unroll=1):
                    state = self._overlapped_step(state, hi_edge - 1 - i, *step_args,
                                                  mask_causal=False)
                for i in cutlass.range(lo_edge - n_first, unroll=1):
                    state = self._overlapped_step(state, lo_edge - 1 - i, *step_args,
                                                  mask_causal=True)
        elif cutlass.const_expr(self.causal and self.tiles.merge_diagonal_loop):
            # Blocks n_last - 1 down to 0; those >= n_causal touch the diagonal.
            for i in cutlass.range(n_last, unroll=1):
                state = self._overlapped_step(state, n_last - 1 - i, *step_args,
                                              mask_causal=True,
                                              mask_if=n_last - 1 - i >= n_causal)
        else:
            # Diagonal blocks (none non-causal: n_causal = n_last).
            if cutlass.const_expr(self.causal or not self.tiles.prune_diagonal_loop):
                for i in cutlass.range(n_last - n_causal, unroll=1):
                    state = self._overlapped_step(state, n_last - 1 - i, *step_args,
                                                  mask_causal=True)
            for i in cutlass.range(n_causal, unroll=1):
                state = self._overlapped_step(state, n_causal - 1 - i, *step_args,
                                              mask_causal=False)
        if cutlass.const_expr(self.persistent and not self.tiles.q_in_regs):
            # Every S = Q K^T of this tile is done: the next tile's Q may load.
            self._release(pipe_q, q_state)
            q_state.advance()
        # Last P V.
        pipe_v.consumer_wait(state)
        self._sched_sync()
        pv(state.index, wg_wait=-1)
        self._sched_arrive()
        warpgroup.wait_group(0)
        self._release(pipe_v, state)
        state.advance()

        sink_log2 = None
        if cutlass.const_expr(self.sinks and self.pack_gqa > 1):
            # Each row's own query head (Note [Packed GQA]).
            g = self.pack_gqa
            rows = acc_mn_view(tiled_mma_pv.get_slice(tidx).partition_C(
                cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
            sink_log2 = cute.make_rmem_tensor(softmax.num_rows, Float32)
            for r in cutlass.range_constexpr(softmax.num_rows):
                sink_log2[r] = mSinks[batch, head * g + rows[r, 0][0] % g] * LOG2_E
        elif cutlass.const_expr(self.sinks):
            sink_log2 = mSinks[batch, head] * LOG2_E
        inv_sum, lse = softmax.finalize(sink_log2)
        rescale_rows(acc_O, inv_sum)
        if cutlass.const_expr(self.split_kv):
            self.store_split(acc_O, lse, mO, mLSE, tiled_mma_pv, tidx, m_block, head,
                             out_batch, seqlen_q)
        else:
            self.epilogue(acc_O, lse, mO, mLSE, sO, tma_atom_O, tiled_mma_pv, tidx, m_block,
                          head, out_batch, seqlen_q)
        return q_state, state

    def _cap(self, acc_S):
        """Softcap: the scores become tanh(q.k * scale / c), before any mask."""
        if cutlass.const_expr(self.cap_in is not None):
            cap_scores(acc_S, self.cap_in)

    @cute.jit
    def _overlapped_step(
        self,
        state,
        n_block,
        m_block,
        qk,
        pv,
        to_p,
        softmax,
        mask,
        acc_O,
        pipe_k,
        pipe_v,
        mask_causal: cutlass.Constexpr[bool],
        mask_if=None,
    ):
        """S_n = Q K_n issued together with O += P_(n+1) V_(n+1); softmax of S_n
        runs while the P V wgmma is still in flight. mask_if: a run-time Boolean;
        with it the causal mask applies only where it holds (the merged diagonal
        loop, ``merge_diagonal_loop``)."""
        state_v = state.clone()
        state.advance()
        pipe_k.consumer_wait(state)
        self._sched_sync()
        acc_S = qk(state.index, wg_wait=-1)
        pipe_v.consumer_wait(state_v)
        pv(state_v.index, wg_wait=-1)
        self._sched_arrive()
        warpgroup.wait_group(1)  # S ready; P V may still run
        self._release(pipe_k, state)
        self._cap(acc_S)
        if cutlass.const_expr(mask_causal):
            mask.apply(acc_S, m_block, n_block, mask_seqlen=False, mask_causal=True,
                       when=mask_if)
        row_scale = softmax.online_softmax(acc_S, is_first=False)
        if cutlass.const_expr(mask_if is not None):
            # Never taken (a row scale is exp2 of a difference, >= 0): a block
            # boundary that keeps ptxas from hoisting the wait above the exp2s to
            # the mask test's join (Note [P V wait]).
            if row_scale[0] < 0.0:
                cute.arch.sync_warp()
        warpgroup.wait_group(0)  # P V done: tOrP and acc_O are free
        self._release(pipe_v, state_v)
        to_p(acc_S)
        rescale_rows_if_needed(acc_O, row_scale)
        return state

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,  # this thread's O fragment, fp32, already / row_sum
        lse: cute.Tensor,  # (rows of this thread,) f32
        mO: cute.Tensor,  # TMA view (Sq, Dv, Hq, B)
        mLSE: cute.Tensor,  # (Sq, Hq, B)
        sO: cute.Tensor,  # (tile_m, Dv)
        tma_atom_O: cute.CopyAtom,
        tiled_mma_pv: cute.TiledMma,
        tidx: Int32,
        m_block: Int32,
        head: Int32,
        batch: Int32,
        seqlen_q: Int32,
    ):
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        if cutlass.const_expr(self.persistent):  # noqa: SIM102
            # sO is free once the previous tile's O store has read it.
            if tidx == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        # sO aliases sQ (not persistent): every consumer warpgroup must be done with
        # its S = Q K^T. Persistent: the wait above is done.
        cute.arch.barrier(barrier_id=_BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
        stmatrix_acc(rO, tiled_mma_pv, sO, tidx, self.dtype)

        # LSE: one of the 4 threads of each row writes it, rows < seqlen_q only.
        thr_mma = tiled_mma_pv.get_slice(tidx)
        c_o = acc_mn_view(
            thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v)))
        )
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = m_block * self.tile_m + c_o[r, 0][0]
            if c_o[0][1] == 0 and row < seqlen_q:
                mLSE[row, head, batch] = lse[r]

        # Make the st.matrix writes visible to the TMA engine, then one thread stores.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=_BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
        if tidx == 0:
            gO = cute.local_tile(
                mO[None, None, head, batch], (self.tile_m, self.head_dim_v), (m_block, 0)
            )
            tma_store_tile(tma_atom_O, sO, gO)
            cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(not self.persistent):
                # The store reads sQ's buffer: done before the CTA exits.
                cute.arch.cp_async_bulk_wait_group(0, read=True)


    @cute.jit
    def store_split(
        self,
        acc_O: cute.Tensor,  # this thread's O fragment, fp32, already / row_sum
        lse: cute.Tensor,  # (rows of this thread,) f32
        mO: cute.Tensor,  # (Sq, Dv, Hq, B x splits) f32
        mLSE: cute.Tensor,  # (Sq, Hq, B x splits) f32
        tiled_mma_pv: cute.TiledMma,
        tidx: Int32,
        m_block: Int32,
        head: Int32,
        batch: Int32,  # split x B + batch
        seqlen_q: Int32,
    ):
        """A split's O and LSE in float32 for the combine (Note [Split keys]),
        straight from the registers: a decode tile has few valid rows, so nothing
        goes through SMEM."""
        c_o = acc_mn_view(tiled_mma_pv.get_slice(tidx).partition_C(
            cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
        o_mn = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            row = m_block * self.tile_m + c_o[r, 0][0]
            if row < seqlen_q:
                if c_o[0][1] == 0:
                    mLSE[row, head, batch] = lse[r]
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                    mO[row, c_o[r, c][1], head, batch] = o_mn[r, c]


class FlashFwdSm90Dynamic(FlashFwdSm90):
    """The causal persistent forward (``Sm90FwdTiles.persistent`` with causal): one
    CTA per SM takes tiles from a global counter, longest first, so the tiles'
    unequal costs balance as the hardware's own scheduler would, while each CTA
    still overlaps one tile's epilogue with the next one's loads.

    The call takes one extra operand, after V: a (1,) int32 counter that must be
    zero at launch (the FFI layer passes a fresh zero buffer aliased to an extra
    output, see ``rules.kernels_cuda.forward``); masked, the counter is the first
    int of an extra batch entry of the intervals instead (Note [Counter in the
    intervals])."""

    takes_tile_counter = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.dynamic:
            raise ValueError("FlashFwdSm90Dynamic is the causal persistent forward (or the "
                             "masked one)")


def make_fwd_sm90(dtype: Any, head_dim: int, head_dim_v: int | None = None,
                  causal: bool = False, softmax_scale: float | None = None,
                  tiles: Sm90FwdTiles | None = None, masked: bool = False,
                  segments: bool = False, sinks: bool = False,
                  softcap: float | None = None, pack_gqa: int = 1,
                  split_kv: bool = False, page_size: int = 0,
                  short: bool = False) -> FlashFwdSm90:
    """The sm90 forward kernel object for a configuration: ``FlashFwdSm90Dynamic``
    where its tiles make it the causal (or masked) persistent kernel, which takes
    the tile counter operand, else ``FlashFwdSm90``."""
    hv = head_dim if head_dim_v is None else head_dim_v
    t = tiles or fwd_tiles(head_dim, hv, causal, masked, short)
    cls = FlashFwdSm90Dynamic if t.persistent and (causal or masked) else FlashFwdSm90
    return cls(dtype, head_dim, hv, causal, softmax_scale, tiles=t, masked=masked,
               segments=segments, sinks=sinks, softcap=softcap, pack_gqa=pack_gqa,
               split_kv=split_kv, page_size=page_size)
