"""Hopper (sm_90a) backward attention main kernel: dK, dV and the fp32 dQ accumulator.

One CTA owns one key/value block (`tile_n` keys) of one kv head of one batch entry
and walks every query block of every query head of its GQA group, so dK and dV
stay in registers for the whole walk (deterministic, no dK/dV atomics). dQ
partials (sum over this CTA's keys of dS K) are reduce-added into the fp32
accumulator by 1-D bulk reduces, in the flat order of Note [Flat dQ accumulator]
(dq_layout.py), which the postprocess reads back.

Warp roles (384 threads; the prologue and the load warp are shared with the hdim
256 kernel in sm90_bwd_common.py):
  warpgroup 0   warp 0: TMA loads (K, V once; Q, dO, LSElog2 and Dpsum rows per
                        query block, two pipeline stages)
                warp 1: bulk reduce-add of each warpgroup's dQ partial into mdQaccum
                warps 2-3: idle
  warpgroups 1-2: the five GEMMs (wgmma) and the pointwise softmax backward

Per query block the MMA warpgroups compute the transposed scores, each warpgroup
for its own 64 keys (Note [Transposed scores]):
  S^T  = K Q^T,  P^T = exp2(S^T * scale * log2(e) - LSElog2)   (tile_n x tile_m)
  dP^T = V dO^T, dS^T = P^T * (dP^T - Dpsum)
  dV  += P^T dO   (A operand P^T from registers)
  dK  += dS^T Q   (A operand dS^T from registers)
  dQ   = dS K     (dS from shared memory: every warpgroup needs all keys)

Order within one query block: S^T and dP^T issued together; P^T while dP^T runs;
dS^T; dS^T stored to SMEM (double buffered); dV issued (it runs while the
warpgroups meet at the dS barrier); dQ then dK issued; each warpgroup hands its
part of the dQ partial to the dQ warp through SMEM while dK still runs (own SMEM
part, own barrier pair, own bulk reduce, so the warpgroups meet only at the dS
barrier): each thread stores its dQ registers in order (conflict-free 128-bit
stores). Issuing dV before dS^T instead would keep P^T and the dV accumulator
live under an in-flight wgmma next to S^T, dP^T and dS^T: past the 240 registers
of an MMA thread at hdim 64, where ptxas then serialises every wgmma (C7512).
After the walk dK and dV go through SMEM (the K and V tiles) and leave by TMA
store.

Note [Transposed scores]: with S^T a warpgroup's accumulator rows are its own
keys, which are exactly the rows of its dV and dK tiles, so P^T and dS^T feed
those GEMMs straight from registers as the A operand (FA3's SdP_swapAB). Only dS
goes through shared memory (for dQ, which reduces over all keys of the block),
and P never does. The price: each thread's columns are queries, so it reads
LSElog2 and Dpsum per column from shared memory (staged by the load warp;
``BwdTiles.stats`` says how).

Note [Masked warpgroup]: causal at hdim 128 (64-row query tiles, 128-key blocks),
the first query block of a key block's walk lies on the diagonal, and warpgroup 1's
64 keys all come after its last query (likewise a last key block of at most 64
keys past seqlen_k): P^T = dS^T = 0 there. Under masks (key intervals) the same
holds on the diagonal blocks of causal rows, windows and documents; the walk says
which warpgroup it masks (Note [Block walks] in rules/ranges.py). With
``BwdTiles.skip_masked_wg`` that item is peeled off the loop
(``masked_first_item``): the masked warpgroup stores zeros as its half of dS^T,
meets the other at the dS barrier, runs only its dQ GEMM and hand-off, and starts
the loop at item 1. That saves 4 of the item's 10 warpgroup GEMMs. A test inside
the loop instead would cost every item a branch; the peeled item makes the loop
start at a run-time item, and the walk then carries its query block from item to
item (``BwdTiles.carry_coords``) rather than divide the item index by the number
of query blocks, a division ptxas strength-reduces only in a loop that starts at
0.

Note [Tails without predicates]: TMA zero-fills Q/dO rows past seqlen_q and K/V
rows past seqlen_k. The LSElog2 / Dpsum workspaces have Sq_pad rows, the ones
past seqlen_q set to +inf / 0 by the preprocess kernel, so P = exp2(-inf) = 0
there and with it dS = 0: those queries add exact zeros to dV, dK and to the
padding rows of dQaccum. Keys past seqlen_k (and, causal, keys after the query)
get S = -inf, hence P = 0, in the blocks that contain any; their dK/dV rows are
never stored (the epilogue's TMA store clips them).

Note [One key block per query block]: where the lowering knows that every query
block's walk meets exactly one key block (all keys in one block, Sk <= tile_n, or
short sequences packed whole into the key blocks, Note [Short sequences] in
rules/kernels_cuda.py), that block's partial is the whole dQ of the query block.
With ``dq_store`` the MMA warpgroups scale and round it into dQ's tile in SMEM
(stmatrix, as the epilogue writes dK) and the dQ warp stores the tile by TMA, rows
past seqlen_q clipped: no fp32 accumulator, so the preprocess zeroes none and no
postprocess runs; dQ leaves once, in the input dtype, instead of as floats added
into zeroed lines that the postprocess reads back. With one partial per block dQ
is also reproducible without the deterministic kernel's semaphores. Nothing else
writes dQ, so under a mask every query block must be walked, those whose rows see
none of the block's keys too: the lowering widens the masked walks to every query
block a key block owns (``owned_walks`` in rules/ranges.py), and there the element
mask leaves P = 0, so the stored tile is zeros. (Many short
sequences spend much of their backward on that traffic: 1024 x 128 tokens at hdim
128 move 2 GB of accumulator zeros, adds and reads for 0.5 GB of dQ.)
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from jax_fa4.kernels.cute_utils import (
    DqSemaphoreCall,
    bulk_reduce_add_f32,
    consumer_release_elected,
    convert_slice_to_operand_a,
    convert_to_operand_a,
    semaphore_release_after_bulk,
    sm90_smem_layout,
    smem_operands,
    stmatrix_acc,
    tma_store_tile,
    transpose_smem,
    wgmma_gemm,
    zero_acc,
)
from jax_fa4.kernels.dq_layout import det_key_block
from jax_fa4.kernels.sm90_bwd_common import Sm90BwdCommon, dq_tile_layout, dq_tiled_mma
from jax_fa4.kernels.sm90_fwd import lpt_section_size, lpt_tile
from jax_fa4.kernels.softmax import acc_mn_view, cap_scores, capped_grad

# Named hardware barriers (0 is __syncthreads).
_BAR_DS = 1  # both MMA warpgroups: dS^T of this query block is in SMEM
# The dQ hand-off, one pair per MMA warpgroup w: FlashBwdSm90.bar_dq_full + w = 2, 3
# and bar_dq_empty + w = 4, 5.

_STATS = ("rows", "by_thread", "shuffle")


@dataclass(frozen=True)
class BwdTiles:
    """The choices of the sm90 backward that differ between configurations (one row
    of ``_TILE_TABLE``); the rest is fixed in ``FlashBwdSm90``."""

    # Query rows per block. The MMA threads hold dK and dV (tile_n x d each) for
    # the whole walk: 128 fits beside them at hdim 64, 64 at hdim 128.
    tile_m: int
    # How a thread gets the LSElog2 and Dpsum of its S^T columns (its queries; Note
    # [Transposed scores]), which the exp2s and dS^T wait for:
    #   "rows": row order, each column's value loaded where it is first used;
    #   "by_thread": the by-thread order of ``stat_position`` (the preprocess writes
    #     it, ``stats_thread_block``): a thread's values are chunks of 4 adjacent
    #     floats, one conflict-free 128-bit load each, all loaded at the top of the
    #     step so that they do not queue behind the GEMMs' shared-memory reads.
    #     tile_m 64: 2 x 16 more live registers, where 2 x 32 would spill;
    #   "shuffle": row order; each lane loads an eighth of its columns (the eight
    #     lanes of a warp that share lane % 4 hold the same columns) right after
    #     issuing S^T and dP^T, and takes each column's value from the lane that
    #     loaded it (``_shuffled_stat``), as flash-attn-4 does at hdim 64: 2 x 4
    #     live registers instead of 2 x 32 at tile_m 128.
    stats: str = "rows"
    # Wait for the dV GEMM (issued before the dS barrier) before issuing dK, after
    # dQ, as flash-attn-4 orders them; else dK's register-A wgmma is issued at once
    # and its issue stalls behind dV.
    dv_done_before_dk: bool = False
    # Causal: launch the key blocks in FA4's LPT order (``lpt_key_block``) over a
    # 1-D grid, key block 0 (the most query blocks) of every head of an L2 section
    # first, so that the longest CTAs start first and the short ones fill the
    # tail. Else every key block of one head runs before the next head.
    lpt: bool = False
    # Peel a warpgroup's fully masked first item off the walk (Note [Masked
    # warpgroup]); only hdim 128 causal has such items.
    skip_masked_wg: bool = False
    # Carry the walk's query block from item to item instead of dividing the item
    # index by num_m (Note [Masked warpgroup]: the walk starts at a run-time item).
    carry_coords: bool = False

    def __post_init__(self):
        if self.tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128, got {self.tile_m}")
        if self.stats not in _STATS:
            raise ValueError(f"stats must be one of {_STATS}, got {self.stats!r}")
        if self.stats == "by_thread" and self.tile_m != 64:
            raise ValueError("by-thread statistics load at the top of the step: tile_m 64 only")


# Tiles after FA3's sm90 backward (128 x 128 at hdim 64, 64 x 128 at hdim 128); the
# other choices measured on the H200, the main kernel alone.
_TILE_TABLE = {
    # Shuffled statistics: faster here, level causal.
    (64, False): BwdTiles(tile_m=128, stats="shuffle"),
    # Waiting for dV before dK: faster here only. By-thread statistics: slower here.
    (64, True): BwdTiles(tile_m=128, stats="rows", dv_done_before_dk=True),
    # By-thread statistics: faster at hdim 128 with either mask.
    (128, False): BwdTiles(tile_m=64, stats="by_thread"),
    # LPT: faster at 4k tokens (slower at hdim 64); the masked warpgroup's skip pays
    # only with the carried coordinates.
    (128, True): BwdTiles(tile_m=64, stats="by_thread", lpt=True, skip_masked_wg=True,
                          carry_coords=True),
}


# Key intervals (rules/ranges.py): the causal rows without the LPT order, which
# assumes the causal triangle; the masked warpgroup's peel reads the walk's bits.
_MASKED_TILES = {
    64: BwdTiles(tile_m=128, stats="rows", dv_done_before_dk=True),
    128: BwdTiles(tile_m=64, stats="by_thread", skip_masked_wg=True, carry_coords=True),
}


def bwd_tiles(head_dim: int, causal: bool, masked: bool = False) -> BwdTiles:
    """The tile table, keyed by head dim and mask (none, top-left causal, or
    ``masked``: key intervals)."""
    if head_dim not in (64, 96, 128):
        raise ValueError(f"sm90 backward supports head_dim 64, 96 and 128, got {head_dim}")
    # hdim 96 takes hdim 128's rows.
    row = 128 if head_dim == 96 else head_dim
    if masked:
        return _MASKED_TILES[row]
    return _TILE_TABLE[(row, bool(causal))]


def stats_thread_block(head_dim: int, causal: bool, masked: bool = False) -> int | None:
    """The block of the by-thread LSElog2 / Dpsum order (``stat_position``) the sm90
    backward reads for this configuration (what its preprocess must write), or
    None for row order."""
    t = bwd_tiles(head_dim, causal, masked)
    return t.tile_m if t.stats == "by_thread" else None


def dq_accum_flat_tile_m(head_dim: int, causal: bool, masked: bool = False) -> int:
    """The tile_m of the flat dQaccum order the sm90 backward writes for this
    configuration (what its postprocess must read)."""
    return bwd_tiles(head_dim, causal, masked).tile_m


def lpt_key_block(t, num_n_blocks, num_kv_heads, num_hb, section, minimum=min):
    """(n_block, kv head, batch) of CTA t in the backward's LPT order
    (``BwdTiles.lpt``): ``lpt_tile``'s order with key block 0, the one with the
    most query blocks under the causal mask, first. Plain ints (tests) or DSL
    integers."""
    last_first, head, batch = lpt_tile(t, num_n_blocks, num_kv_heads, num_hb, section,
                                       minimum)
    return num_n_blocks - 1 - last_first, head, batch


def stat_part_query(c: int, lane):
    """The query (row of the block, row order) of column c of S^T at a lane of the
    MMA warpgroup: 8 (c // 2) + 2 (lane % 4) + c % 2 (the wgmma accumulator's
    layout, checked against CuTe's in the tests). Plain ints or DSL integers."""
    return 8 * (c // 2) + 2 * (lane % 4) + c % 2


def stat_part_base(lane, n_cols: int):
    """Statistics by shuffle: a lane loads the statistics of its columns per *
    (lane // 4) + i, i < per = n_cols / 8, whose queries (``stat_part_query``) are
    this base + ``stat_part_offset(i)``. Plain ints or DSL integers."""
    return (n_cols // 2) * (lane // 4) + 2 * (lane % 4)


def stat_part_offset(i: int) -> int:
    return 8 * (i // 2) + i % 2


def _stat_part(s_stat, part_base, per: int, stage):
    """Statistics by shuffle: this lane's ``per`` values of a row statistic (rows
    ``part_base`` + ``stat_part_offset(i)`` of stage ``stage``). Called while tracing."""
    part = cute.make_rmem_tensor(cute.make_layout(per), Float32)
    for i in range(per):
        part[i] = s_stat[part_base + stat_part_offset(i), stage]
    return part


def _shuffled_stat(part, c: int, quad_lane):
    """Statistics by shuffle: the statistic of this thread's column c, read from the
    lane of its quad position that loaded it (``_stat_part``): lane 4 (c // per) +
    lane % 4, its value c % per. Called while tracing."""
    per = cute.size(part)
    return cute.arch.shuffle_sync(part[c % per], offset=4 * (c // per) + quad_lane)


def _column_stat(stats: str, regs, c: int, s_stat, stage, tScS, part, quad_lane) -> None:
    """regs[c] = the row statistic (LSElog2 or Dpsum) of this thread's column c of
    S^T, where ``BwdTiles.stats`` loads it at its first use: from the lane that
    loaded it ("shuffle", ``part``) or from the SMEM rows of stage ``stage``
    ("rows"); "by_thread" loaded every column at the top of the step. Called while
    tracing."""
    if stats == "shuffle":
        regs[c] = _shuffled_stat(part, c, quad_lane)
    elif stats == "rows":
        regs[c] = s_stat[tScS[0, c][1], stage]


class FlashBwdSm90(Sm90BwdCommon):
    """Backward main kernel for sm_90a; see the module docstring and docs/design.md.

    Args: as ``Sm90BwdCommon``; head_dim = head_dim_v = 64, 96 or 128; dq_store:
    Note [One key block per query block].
    """

    def __init__(self, *args, dq_store: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if dq_store and self.deterministic:
            raise ValueError("a stored dQ is the only partial: no add order to fix")
        self.dq_store = dq_store

    head_dims = (64, 96, 128)
    smem_more = ("sdS", "sdQ")
    bar_dq_full = 2
    bar_dq_empty = 4
    tile_n = 128  # key rows per CTA: 64 per MMA warpgroup (Note [Transposed scores])
    stages_qdo = 2  # Q / dO / LSElog2 / Dpsum pipeline stages
    # Every query block's dQ partials are added in a fixed key-block order
    # (FlashBwdSm90Deterministic).
    deterministic = False
    # Masked, the key blocks' walks come from the lowering (Note [Block walks] in
    # rules/ranges.py).
    takes_walks = True

    @property
    def tiles(self) -> BwdTiles:
        return bwd_tiles(self.head_dim, self.causal, self.masked)

    @property
    def tile_m(self) -> int:
        return self.tiles.tile_m

    @property
    def lpt(self) -> bool:
        # The deterministic backward has its own launch order (det_key_block).
        return self.tiles.lpt and not self.deterministic

    # ------------------------------------------------------------------ host side
    def _tiled_mmas(self):
        d, dv = self.head_dim, self.head_dim_v
        tm = self.tile_m
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        wg = self.num_mma_wg
        # S^T = K Q^T and dP^T = V dO^T: A (tile_n x d) and B (tile_m x d), K-major.
        mma_sdp = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, (wg, 1, 1), (64, tm))
        # dK += dS^T Q, dV += P^T dO: A from registers, B = Q^T / dO^T MN-major.
        mma_dk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, MN, Float32, (wg, 1, 1), (64, d),
            a_source=warpgroup.OperandSource.RMEM)
        mma_dv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, MN, Float32, (wg, 1, 1), (64, dv),
            a_source=warpgroup.OperandSource.RMEM)
        # dQ = dS K: A = dS (tile_m x tile_n) MN-major (SMEM holds dS^T), B = K^T
        # (d x tile_n) MN-major.
        return mma_sdp, mma_dk, mma_dv, dq_tiled_mma(self.dtype, tm, d, wg)

    def wg_all_masked(self, m_block, n_block, wg_idx, key_limit, peel):
        """Note [Masked warpgroup]: whether every key of MMA warpgroup ``wg_idx``'s
        64 (rows 64 wg_idx.. of S^T in key block ``n_block``) is masked for every
        query of ``m_block``, the walk's first: at or past seqlen_k (``key_limit``
        keys of the block are valid) or, causal, after the block's last query;
        ``masked``, bit wg_idx of the walk's ``peel`` (Note [Block walks] in
        rules/ranges.py)."""
        if const_expr(self.masked):
            return ((peel >> wg_idx) & 1) != 0
        first = 64 * wg_idx
        masked = key_limit <= first
        if const_expr(self.causal):
            masked = masked | (n_block * self.tile_n + first >= (m_block + 1) * self.tile_m)
        return masked

    @cute.jit
    def launch(self, stream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
               mdO: cute.Tensor, mLSElog2: cute.Tensor, mDpsum: cute.Tensor,
               mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
               mdQsem: cute.Tensor | None = None, *masks: cute.Tensor):
        """The host side of the call (``BwdMainCall``); mdQsem: (B, Hq, ceil(Sq /
        tile_m)) int32, zero at launch, with the deterministic backward, else None;
        masks: with ``masked``, the keys' query intervals (and segment ids)."""
        d = self.head_dim
        tm, tn = self.tile_m, self.tile_n
        # dq_store: mdQaccum is dQ itself, (B, Sq, Hq, D), viewed as (Sq, D, Hq, B).
        mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV = self.operand_views(
            mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV)

        mma_sdp, mma_dk, mma_dv, mma_dq = self._tiled_mmas()

        sQ_layout, sdO_layout, sK_layout, sV_layout, sRow_layout, row_stage = (
            self.load_layouts())
        # dS^T (tile_n x tile_m, queries contiguous), double buffered.
        sdS_layout = sm90_smem_layout(self.dtype, tn, tm, 2)
        # The dQ partial, both warpgroups' parts in the flat order: plain floats. Stored
        # (dq_store): dQ's tile, written by stmatrix through the dQ MMA (whose warpgroups
        # split it along d at one 64-row atom: swizzle atoms that divide their parts).
        sdQ_layout, sdQ_dtype = cute.make_layout(tm * d), Float32
        if const_expr(self.dq_store):
            sdQ_layout = dq_tile_layout(self.dtype, tm, d)
            sdQ_dtype = self.dtype

        ((tma_Q, gmem_Q), (tma_K, gmem_K), (tma_V, gmem_V), (tma_dO, gmem_dO),
         (tma_LSE, gmem_LSE), (tma_Dpsum, gmem_Dpsum)), bytes_qdo, bytes_kv = self.load_atoms(
            mQ, mK, mV, mdO, mLSElog2, mDpsum, sQ_layout, sdO_layout, sK_layout, sV_layout)
        # dK and dV leave through SMEM (the K and V tiles, free after the walk) by TMA,
        # which also clips the rows past seqlen_k.
        s2g = cpasync.CopyBulkTensorTileS2GOp()
        tma_dK, gmem_dK = cpasync.make_tiled_tma_atom(s2g, mdK, sK_layout, (tn, d))
        tma_dV, gmem_dV = cpasync.make_tiled_tma_atom(s2g, mdV, sV_layout, (tn, self.head_dim_v))
        atoms = (tma_dK, tma_dV)
        if const_expr(self.dq_store):
            tma_dQ, mdQaccum = cpasync.make_tiled_tma_atom(s2g, mdQaccum, sdQ_layout, (tm, d))
            atoms = atoms + (tma_dQ,)

        SharedStorage = self.shared_storage(
            sQ_layout, sdO_layout, sK_layout, sV_layout, row_stage,
            sdS=(self.dtype, sdS_layout), sdQ=(sdQ_dtype, sdQ_layout))
        self.launch_kernel(
            mK, (gmem_Q, gmem_K, gmem_V, gmem_dO, gmem_LSE, gmem_Dpsum),
            (mdQaccum, gmem_dK, gmem_dV, mdQsem), (tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_Dpsum),
            atoms, (sQ_layout, sdO_layout, sK_layout, sV_layout, sRow_layout,
                    sdS_layout, sdQ_layout),
            (mma_sdp, mma_dk, mma_dv, mma_dq), bytes_qdo, bytes_kv, SharedStorage, stream,
            masks)

    def grid(self, num_n_blocks, num_kv_heads, batch):
        if self.lpt:  # a 1-D grid in LPT order (cta_coords)
            return (num_n_blocks * num_kv_heads * batch, 1, 1)
        return (num_n_blocks, num_kv_heads, batch)

    def cta_coords(self, mQ: cute.Tensor, mK: cute.Tensor):
        n_block, head_kv, batch = cute.arch.block_idx()
        num_n_blocks = cute.ceil_div(mK.shape[0], self.tile_n)
        if const_expr(self.lpt):
            n_block, head_kv, batch = self.lpt_coord(n_block, num_n_blocks, mQ, mK)
        if const_expr(self.deterministic):
            # Causal or masked, key blocks launch last first: each waits only on
            # higher key blocks (dq_warp), which have then launched before it.
            n_block = det_key_block(n_block, num_n_blocks, self.causal or self.masked)
        return n_block, head_kv, batch

    def lpt_coord(self, t, num_n_blocks, mQ: cute.Tensor, mK: cute.Tensor):
        """(n_block, kv head, batch) of CTA t in the LPT order (``BwdTiles.lpt``),
        in sections of as many kv heads as keep one query block's Q, dO, fp32 dQ
        partial and row statistics of each head of their GQA groups in L2."""
        num_kv_heads = mK.shape[2]
        group = mQ.shape[2] // num_kv_heads
        q_block_bytes = self.tile_m * ((self.head_dim + self.head_dim_v) * (self.dtype.width // 8)
                                       + 4 * self.head_dim + 8)
        section = lpt_section_size(
            cute.ceil_div(mQ.shape[0], self.tile_m) * group, 1, q_block_bytes,
            lambda c, a, b: cutlass.select_(c, cutlass.Int32(a), b), cutlass.Int32(1))
        return lpt_key_block(t, num_n_blocks, num_kv_heads, num_kv_heads * mK.shape[3],
                             section, cutlass.min)

    # ---------------------------------------------------------------- device side
    @cute.jit
    def dq_warp(self, cta):
        """Warp 1: as each warpgroup's part of the dQ partial is in SMEM, one 1-D bulk
        reduce-add of it into the query block's tile_m * d floats of mdQaccum, in
        flat order (Note [Flat dQ accumulator]); with ``dq_store``, once both parts
        of dQ's tile are in SMEM, one TMA store of it (Note [One key block per query
        block]).

        Deterministic: the query block's semaphore counts the key blocks whose
        partials have landed; this CTA adds its partial when the count reaches its
        rank (``det_add_rank``: ascending key blocks, causal descending; masked,
        ``masked_add_rank`` from the key blocks' walks, descending), waits for the
        add to complete, then counts itself. CTAs wait only on blocks that launch
        earlier (``det_key_block``: the causal and masked grids run the key blocks
        in reverse), so the wait cannot deadlock."""
        mdQaccum = cta.outs[0]  # dq_store: the TMA view of dQ
        _, head_kv, batch = cta.coords
        group, m_block_min, num_m, num_iters = cta.work
        sdQ = cta.smem["sdQ"]
        tm, d = self.tile_m, self.head_dim
        n_parts = self.num_mma_wg
        part = tm * d // n_parts
        nthr = self.num_mma_threads // n_parts + 32
        lane = cute.arch.lane_idx()
        for it in cutlass.range(num_iters, unroll=1):
            head_q, m_block = self.work_item(it, head_kv, group, m_block_min, num_m)
            gdQ = cute.local_tile(mdQaccum[None, None, head_q, batch], (tm, d), (m_block, 0))
            # Each part is free again (its previous reduce or store has read it): let
            # its warpgroup write the next one. Parts are served in order, and their
            # writers never wait for each other.
            for w in cutlass.range_constexpr(n_parts):
                cute.arch.barrier_arrive(barrier_id=self.bar_dq_empty + w,
                                         number_of_threads=nthr)
            if const_expr(self.dq_store):
                # dQ's tile, both parts, leaves by one TMA store (rows past Sq clipped).
                for w in cutlass.range_constexpr(n_parts):
                    cute.arch.barrier(barrier_id=self.bar_dq_full + w, number_of_threads=nthr)
                if lane == 0:
                    tma_store_tile(cta.atoms[2], sdQ, gdQ)
                    cute.arch.cp_async_bulk_commit_group()
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            else:
                if const_expr(self.deterministic):
                    sem_ptr = self.wait_dq_turn(cta, head_q, m_block)
                for w in cutlass.range_constexpr(n_parts):
                    cute.arch.barrier(barrier_id=self.bar_dq_full + w, number_of_threads=nthr)
                    if lane == 0:
                        bulk_reduce_add_f32(gdQ.iterator + w * part, sdQ.iterator + w * part,
                                            part * 4)
                        cute.arch.cp_async_bulk_commit_group()
                if lane == 0:
                    if const_expr(self.deterministic):
                        # The reduces land before the next key block may add.
                        semaphore_release_after_bulk(sem_ptr)
                    else:
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
        # The reduce-adds (stores) must land before the kernel ends.
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def mma(self, cta, tidx):
        """MMA warpgroups (``tidx`` counted from their first thread): all GEMMs and
        the pointwise math; dK/dV epilogue."""
        sQ, sdO, sK, sV, sdS, sdQ, sLSE, sDpsum = cta.smem.values()
        _, mdK, mdV, _ = cta.outs
        tma_dK, tma_dV = cta.atoms[0], cta.atoms[1]
        mma_sdp, mma_dk, mma_dv, mma_dq = cta.mmas
        pipe_qdo, pipe_kv = cta.pipe_qdo, cta.pipe_kv
        n_block, head_kv, batch = cta.coords
        _, m_block_min, num_m, num_iters = cta.work
        tm, tn = self.tile_m, self.tile_n
        d, dv = self.head_dim, self.head_dim_v
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        wg_slice = wg_idx * 128
        scale_log2 = self.scale_log2

        # wgmma A/B operands are partitioned per warpgroup; C per thread.
        thr_sdp, thr_dk, thr_dv, thr_dq = [m.get_slice(tidx) for m in cta.mmas]
        # S^T = K Q^T and dP^T = V dO^T.
        tSrK, tSrQ = smem_operands(mma_sdp, wg_slice, sK, sQ)
        tdPrV, tdPrdO = smem_operands(mma_sdp, wg_slice, sV, sdO)
        # dV += P^T dO and dK += dS^T Q: A from registers, B = dO^T / Q^T (MN-major).
        wg_dk, wg_dv = mma_dk.get_slice(wg_slice), mma_dv.get_slice(wg_slice)
        tdVrP = mma_dv.make_fragment_A(wg_dv.partition_shape_A((tn, tm)))
        tdVrdOt = mma_dv.make_fragment_B(wg_dv.partition_B(transpose_smem(sdO)))
        tdKrdS = mma_dk.make_fragment_A(wg_dk.partition_shape_A((tn, tm)))
        tdKrQt = mma_dk.make_fragment_B(wg_dk.partition_B(transpose_smem(sQ)))
        # dQ = dS K: A = dS (tile_m x tile_n) read from the dS^T buffer, B = K^T.
        tdQrdS, tdQrKt = smem_operands(mma_dq, wg_slice, transpose_smem(sdS),
                                       transpose_smem(sK))
        acc_dK = zero_acc(thr_dk, (tn, d))
        acc_dV = zero_acc(thr_dv, (tn, dv))

        # (key, query) of each accumulator element of S^T, as (rows, cols).
        tScS = acc_mn_view(thr_sdp.partition_C(cute.make_identity_tensor((tn, tm))))
        n_rows = cute.size(tScS, mode=[0])
        n_cols = cute.size(tScS, mode=[1])
        stats = self.tiles.stats
        quad_lane = part_base = None
        if const_expr(stats == "shuffle"):
            # This lane's eighth of the columns.
            lane = cute.arch.lane_idx()
            quad_lane = lane % 4
            part_base = stat_part_base(lane, n_cols)
        thr_lse = thr_dpsum = None
        if const_expr(stats == "by_thread"):
            # Column 8 j + 2 q + e of the block sits at 16 (j // 2) + 4 q + 2 (j % 2)
            # + e (stat_position): this thread's n_cols values, in register order,
            # are n_cols / 4 chunks of 4, 16 floats apart, from 4 q. Block-major
            # view ((4, quad, chunk), stage) of each (tm, stages) buffer, sliced at
            # this quad: (4, chunk, stage).
            assert n_cols == tm // 4 and tm % 16 == 0
            quad = tScS[0, 0][1] // 2
            by_quad = cute.make_layout(((4, 4, tm // 16), self.stages_qdo),
                                       stride=((1, 4, 16), sLSE.layout.stride[1]))
            thr_lse, thr_dpsum = [cute.make_tensor(t.iterator, by_quad)[(None, quad, None), None]
                                  for t in (sLSE, sDpsum)]
        # dS^T goes to SMEM with stmatrix: 4 instructions per 8x8x4 block.
        stsm = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        copy_ds = cute.make_tiled_copy_C(stsm, mma_sdp)
        thr_copy_ds = copy_ds.get_slice(tidx)
        tdSsdS = thr_copy_ds.partition_D(sdS)
        r2s_dq, tdQsdQ = None, sdQ  # dq_store: stmatrix into dQ's tile (``dq_out``)
        if const_expr(not self.dq_store):
            r2s_dq, tdQsdQ = self.flat_dq_copy(thr_dq, sdQ, tidx, wg_idx)

        ds_bar = pipeline.NamedBarrier(barrier_id=_BAR_DS, num_threads=self.num_mma_threads)
        dq_threads = 128 + 32  # this warpgroup and the dQ warp
        dq_bar_off = wg_idx
        key_limit = cta.seqlen_k - n_block * tn
        kmask = self.key_mask(cta, tScS, 0)
        state = self.mma_start(pipe_kv, num_iters)
        it0 = 0
        if const_expr(self.tiles.skip_masked_wg):
            # Note [Masked warpgroup]: the walk's first item, peeled off the loop
            # for the warpgroup whose keys it masks entirely.
            peel = cta.full[2] if self.masked else Int32(0)
            it0 = self.masked_first_item(
                state, pipe_qdo, copy_ds, thr_copy_ds, tdKrdS, tdSsdS, ds_bar, mma_dq,
                thr_dq, tdQrdS, tdQrKt, r2s_dq, tdQsdQ, dq_bar_off, dq_threads, wg_idx, tidx,
                n_block, head_kv, m_block_min, num_m, num_iters, key_limit, peel)
            state = pipeline.PipelineState(self.stages_qdo, it0, it0, Int32(0))
        # BwdTiles.carry_coords: item it's query block is m_block_min + m_rel, m_rel
        # carried from item to item (no division by num_m in the walk).
        m_rel = Int32(0)
        if const_expr(self.tiles.carry_coords and self.tiles.skip_masked_wg):
            m_rel = cutlass.select_(it0 == num_m, Int32(0), it0)
        for it in cutlass.range(it0, num_iters, unroll=1):
            if const_expr(self.tiles.carry_coords):
                m_block = m_block_min + m_rel
            else:
                _, m_block = self.work_item(it, head_kv, 0, m_block_min, num_m)
            stage = state.index
            buf = it % 2

            # Segment ids: keep bits before the GEMMs' accumulators are live.
            bits = self.segment_bits(kmask, tScS, m_block)
            pipe_qdo.consumer_wait(state)
            lse = cute.make_rmem_tensor(cute.make_layout(n_cols), Float32)
            dpsum = cute.make_rmem_tensor(cute.make_layout(n_cols), Float32)
            if const_expr(stats == "by_thread"):
                cute.autovec_copy(thr_lse[None, None, stage], lse)
                cute.autovec_copy(thr_dpsum[None, None, stage], dpsum)
            acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((tn, tm)), Float32)
            wgmma_gemm(mma_sdp, acc_S, tSrK, tSrQ[None, None, None, stage], zero_init=True)
            acc_dP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((tn, tm)), Float32)
            wgmma_gemm(mma_sdp, acc_dP, tdPrV, tdPrdO[None, None, None, stage], zero_init=True)
            lse_part = dpsum_part = None
            if const_expr(stats == "shuffle"):
                lse_part = _stat_part(sLSE, part_base, n_cols // 8, stage)
                dpsum_part = _stat_part(sDpsum, part_base, n_cols // 8, stage)
            warpgroup.wait_group(1)  # S^T done

            S = acc_mn_view(acc_S)
            if const_expr(self.cap_in is not None):
                cap_scores(S, self.cap_in)
            self.mask_scores(S, tScS, 0, m_block, n_block, key_limit, kmask, cta.full,
                             bits)
            # P^T = exp2(S^T * scale * log2 e - LSElog2[query]).
            if const_expr(self.cap_in is None):
                for c in cutlass.range_constexpr(n_cols):
                    _column_stat(stats, lse, c, sLSE, stage, tScS, lse_part, quad_lane)
                    for r in cutlass.range_constexpr(n_rows):
                        S[r, c] = cute.math.exp2(S[r, c] * scale_log2 - lse[c],
                                                 fastmath=True)
                convert_to_operand_a(acc_S, tdVrP, self.dtype)
            else:
                # P^T to its own fragment, converted a k16 slice (4 columns) at a time
                # so that few of its values are live; P^T (1 - t^2) to S^T (Note
                # [Softcap in the kernels]).
                acc_P = cute.make_fragment_like(acc_S, Float32)
                P = acc_mn_view(acc_P)
                for k in cutlass.range_constexpr(n_cols // 4):
                    for c in cutlass.range_constexpr(4 * k, 4 * k + 4):
                        _column_stat(stats, lse, c, sLSE, stage, tScS, lse_part, quad_lane)
                        for r in cutlass.range_constexpr(n_rows):
                            P[r, c] = cute.math.exp2(S[r, c] * scale_log2 - lse[c],
                                                     fastmath=True)
                            S[r, c] = capped_grad(P[r, c], S[r, c])
                    convert_slice_to_operand_a(acc_P, tdVrP, self.dtype, k)
            warpgroup.wait_group(0)  # dP^T done

            dP = acc_mn_view(acc_dP)
            for c in cutlass.range_constexpr(n_cols):
                _column_stat(stats, dpsum, c, sDpsum, stage, tScS, dpsum_part, quad_lane)
                for r in cutlass.range_constexpr(n_rows):
                    dP[r, c] = S[r, c] * (dP[r, c] - dpsum[c])
            convert_to_operand_a(acc_dP, tdKrdS, self.dtype)

            # dS^T to SMEM buffer `buf`. Its previous readers (the dQ GEMMs of item
            # it - 2, in both warpgroups) finished before either warpgroup passed
            # the barrier of item it - 1.
            cute.copy(copy_ds, thr_copy_ds.retile(tdKrdS), tdSsdS[None, None, None, buf])
            # dV runs while the warpgroups meet at the dS barrier.
            wgmma_gemm(mma_dv, acc_dV, tdVrP, tdVrdOt[None, None, None, stage], zero_init=False)
            # Generic-proxy SMEM writes must be visible to the async proxy (wgmma).
            cute.arch.fence_view_async_shared()
            ds_bar.arrive_and_wait()

            acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((tm, d)), Float32)
            wgmma_gemm(mma_dq, acc_dQ, tdQrdS[None, None, None, buf], tdQrKt, zero_init=True)
            if const_expr(self.tiles.dv_done_before_dk):
                warpgroup.wait_group(1)  # dV done; dQ may still run
            wgmma_gemm(mma_dk, acc_dK, tdKrdS, tdKrQt[None, None, None, stage], zero_init=False)

            # dV and dQ done; dK may still run.
            warpgroup.wait_group(1)
            self.dq_out(r2s_dq, acc_dQ, tdQsdQ, mma_dq, tidx, dq_bar_off, dq_threads)

            warpgroup.wait_group(0)
            consumer_release_elected(pipe_qdo, state)
            state.advance()
            if const_expr(self.tiles.carry_coords):
                m_rel = m_rel + 1
                m_rel = cutlass.select_(m_rel == num_m, Int32(0), m_rel)
        self.epilogue(acc_dK, acc_dV, mdK, mdV, tma_dK, tma_dV, sK, sV, mma_dk, mma_dv, ds_bar,
                      tidx, n_block, head_kv, batch)

    @cute.jit
    def masked_first_item(self, state, pipe_qdo, copy_ds, thr_copy_ds, tdKrdS, tdSsdS, ds_bar,
                          mma_dq, thr_dq, tdQrdS, tdQrKt, r2s_dq, tdQsdQ, dq_bar_off,
                          dq_threads, wg_idx, tidx, n_block, head_kv, m_block_min, num_m,
                          num_iters, key_limit, peel):
        """MMA warpgroup, ``BwdTiles.skip_masked_wg`` (Note [Masked warpgroup]): if
        this warpgroup's keys are all masked for the walk's first query block, its
        part of that item without the S^T, dP^T, dV and dK GEMMs: zeros as its half
        of dS^T (buffer 0), the dQ GEMM and hand-off, the stage released. Returns
        the loop's first item: 1 if so, else 0 (state then still at item 0)."""
        skip = cutlass.Boolean(False)
        if num_iters > 0:
            _, m_block = self.work_item(0, head_kv, 0, m_block_min, num_m)
            skip = self.wg_all_masked(m_block, n_block, wg_idx, key_limit, peel)
        if skip:
            pipe_qdo.consumer_wait(state)
            tdKrdS.fill(0.0)
            cute.copy(copy_ds, thr_copy_ds.retile(tdKrdS), tdSsdS[None, None, None, 0])
            cute.arch.fence_view_async_shared()
            ds_bar.arrive_and_wait()
            acc_dQ = cute.make_rmem_tensor(
                thr_dq.partition_shape_C((self.tile_m, self.head_dim)), Float32)
            wgmma_gemm(mma_dq, acc_dQ, tdQrdS[None, None, None, 0], tdQrKt, zero_init=True)
            warpgroup.wait_group(0)
            self.dq_out(r2s_dq, acc_dQ, tdQsdQ, mma_dq, tidx, dq_bar_off, dq_threads)
            consumer_release_elected(pipe_qdo, state)
        return cutlass.select_(skip, Int32(1), Int32(0))

    @cute.jit
    def dq_out(self, r2s_dq, acc_dQ, tdQsdQ, mma_dq, tidx, dq_bar_off, dq_threads):
        """MMA warpgroup: this query block's dQ registers to the dQ warp through SMEM,
        as flat floats of the partial (``dq_handoff``) or, with ``dq_store``, scaled
        and rounded into dQ's tile (``tdQsdQ`` is then the tile; stmatrix as the
        epilogue writes dK, once this warpgroup's part of it is free)."""
        if const_expr(self.dq_store):
            rdQ = cute.make_fragment_like(acc_dQ, self.dtype)
            rdQ.store((acc_dQ.load() * self.softmax_scale).to(self.dtype))
            cute.arch.barrier(barrier_id=self.bar_dq_empty + dq_bar_off,
                              number_of_threads=dq_threads)
            stmatrix_acc(rdQ, mma_dq, tdQsdQ, tidx, self.dtype)
            # The st.matrix writes must be visible to the TMA engine before it reads.
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=self.bar_dq_full + dq_bar_off,
                                     number_of_threads=dq_threads)
        else:
            self.dq_handoff(r2s_dq, acc_dQ, tdQsdQ, dq_bar_off, dq_threads)

    @cute.jit
    def epilogue(self, acc_dK, acc_dV, mdK, mdV, tma_dK, tma_dV, sK, sV, mma_dk, mma_dv,
                 mma_bar, tidx, n_block, head_kv, batch):
        """dK = scale * sum dS^T Q and dV: registers -> SMEM (stmatrix into the K and V
        tiles) -> global memory (one TMA store each, clipped at seqlen_k). Stores
        from registers would use half of every 32-byte sector."""
        tn = self.tile_n
        rdK = cute.make_fragment_like(acc_dK, self.dtype)
        rdK.store((acc_dK.load() * self.softmax_scale).to(self.dtype))
        rdV = cute.make_fragment_like(acc_dV, self.dtype)
        rdV.store(acc_dV.load().to(self.dtype))
        # Both warpgroups' GEMMs that read K or V (the dQ GEMM reads all of K) are
        # done: each waited for its last wgmma group at the end of the walk.
        mma_bar.arrive_and_wait()
        for acc_bf, mma, s in ((rdK, mma_dk, sK), (rdV, mma_dv, sV)):
            stmatrix_acc(acc_bf, mma, s, tidx, self.dtype)
        # The st.matrix writes must be visible to the TMA engine before it reads.
        cute.arch.fence_view_async_shared()
        mma_bar.arrive_and_wait()
        if tidx == 0:
            for atom, s, m, width in ((tma_dK, sK, mdK, self.head_dim),
                                      (tma_dV, sV, mdV, self.head_dim_v)):
                tma_store_tile(atom, s, cute.local_tile(m[None, None, head_kv, batch],
                                                        (tn, width), (n_block, 0)))
            cute.arch.cp_async_bulk_commit_group()
            # SMEM must stay valid until the TMA engine has read it.
            cute.arch.cp_async_bulk_wait_group(0, read=True)


class FlashBwdSm90Deterministic(DqSemaphoreCall, FlashBwdSm90):
    """The deterministic sm90 backward (hdim 64/128): every query block sums its dQ
    partials in a fixed key-block order (``det_add_rank``), so dQ is bitwise
    reproducible. The call takes one extra operand after mdQaccum: mdQsem, (B, Hq,
    ceil(Sq / tile_m)) int32, zero at launch (one semaphore per query block).
    ``masked``: it also takes the key blocks' walks after the intervals (and ids),
    walks them, and ranks its adds by them (Note [Masked dQ order] in
    dq_layout.py)."""

    deterministic = True
