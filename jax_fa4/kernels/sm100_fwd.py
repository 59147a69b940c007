"""Blackwell (sm_100a) flash-attention forward with FA4's design.

Status: compiled for sm_100a and inspected (PTX / SASS) on a CPU machine; it has
NOT been run on Blackwell hardware yet.

One CTA computes two 128-row Q tiles (256 rows of O) of one (batch, q head),
with 16 warps that each have one role and talk only through mbarriers:

    warps 0-3    softmax of Q tile 0       (setmaxnreg 192)
    warps 4-7    softmax of Q tile 1       (192)
    warps 8-11   correction: rescale O in TMEM, final 1/row_sum, LSE  (80)
    warp  12     MMA issue; allocates and frees the tensor memory      (48)
    warp  13     epilogue: TMA store of O                              (48)
    warp  14     load: TMA of Q0, Q1 and of the K/V ring               (48)
    warp  15     idle (its warpgroup must still run setmaxnreg)        (48)

Tensor memory (512 columns, fp32 words, lane = row of the tile):

    cols   0-127  S0 = Q0 K^T; P0 (16 bit, 64 words) overwrites cols 64-127
    cols 128-255  S1, P1 in cols 192-255
    cols 256-     O0 (Dv words), then O1

Per KV block t (blocks run from the last one down to 0, so the first block
processed carries the seqlen_k tail and the causal diagonal):

    MMA:        S_i(t) = Q_i K(t)^T   (tcgen05.mma, both operands in SMEM)
    softmax_i:  tcgen05.ld S_i, mask, row max (FA4's lazy rescale), exp2 on
                MUFU and, for a fraction of each row, in software (exp2.py),
                P_i in 16 bits tcgen05.st over S_i; the O scale of each row
                goes to SMEM for the correction warps
    correction: once O_i += P_i(t-1) V(t-1) has finished, rescale O_i in TMEM
                where a row's reference max moved (one ballot per warp)
    MMA:        O_i += P_i(t) V(t)    (tcgen05.mma, P from TMEM, V in SMEM),
                issued once P_i(t) is written AND O_i is rescaled; then
                S_i(t+1) = Q_i K(t+1)^T into the same columns (tcgen05 MMAs
                of one thread execute in issue order, so the read of P comes
                before the overwrite)

Synchronisation (every barrier completes once per use; waiters track parity):

    q_full[2], kv_full/empty[stages]   load <-> MMA (PipelineTmaUmma)
    s_full[i]     MMA -> softmax_i       tcgen05.commit after S_i(t)
    p_ready[i]    softmax_i (128) + correction (128) -> MMA, before O_i += P_i V
    o_done[i]     MMA -> correction      tcgen05.commit after O_i += P_i V
    stats[i]      softmax_i -> correction: row scales of block t >= 1 in SMEM
    final[i]      softmax_i -> correction: row sum and max after the last block
    o_smem[i]     correction -> epilogue: O_i normalised in SMEM

No barrier can run a full phase ahead of its waiter: each producer's next
arrival depends (through the chain above) on the waiter's previous wait, which
keeps parity waits unambiguous.

The contract (docs/design.md): tensors arrive row-major as JAX holds them, with
dynamic batch, sequence and head extents; head dims are compile-time.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, cute, pipeline
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from jax_fa4.config import LN_2, LOG2_E
from jax_fa4.kernels.cute_utils import (
    FwdCall,
    PagedKV,
    as_cutlass_dtype,
    check_forward_dtypes,
    kv_box_layout,
    packed_gqa_views,
    permute,
    set_forward_extras,
    set_mask_flags,
    set_page_size,
    tma_tile_partition,
)
from jax_fa4.kernels.exp2 import exp2_poly_x2
from jax_fa4.kernels.mask import BlockRange, edge_walk, keep_inside
from jax_fa4.kernels.softmax import (
    RESCALE_THRESHOLD,
    cap_scores,
    finalize_with_sink,
)

logger = logging.getLogger(__name__)

_WARP = 32
_WG = 128  # threads of a warpgroup = rows of a Q tile (one TMEM lane each)

# Warp roles (see the module docstring).
_SOFTMAX0_WARP = 0
_SOFTMAX1_WARP = 4
_CORRECTION_WARP = 8
_MMA_WARP = 12
_EPILOGUE_WARP = 13
_LOAD_WARP = 14
_NUM_WARPS = 16

# Named barriers; 0 is __syncthreads.
_BAR_TMEM_ALLOC = 1  # MMA warp + softmax + correction: TMEM address is published
_BAR_TMEM_FREE = 2  # MMA warp + correction: last TMEM read done, free it

# mbarrier slots in SharedStorage.mbar (one per Q tile each).
_S_FULL = 0
_P_READY = 2
_O_DONE = 4
_STATS = 6
_FINAL = 8
_O_SMEM = 10
_NUM_MBARS = 12

# Sizes in bytes.
_SMEM_CAPACITY = 227 * 1024  # sm_100 dynamic SMEM per CTA
_SMEM_RESERVE = 4 * 1024  # row stats, mbarriers, TMEM address, alignment slack
_TMEM_COLS = 512
_P_CHUNK = 32  # S columns converted and stored to TMEM as P at a time
_O_CHUNK = 32  # O columns per correction tcgen05.ld / st (32 registers in flight)


# (D, Dv) pairs of the forward.
SM100_FWD_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256))


# Note [One Q tile]
# ~~~~~~~~~~~~~~~~~~
# Two Q tiles per CTA need S0, S1, O0 and O1 in the 512 tensor-memory columns:
# 2 tile_n + 2 Dv. At Dv = 256 that leaves nothing for S, so the CTA takes one Q
# tile of 128 rows (``q_tiles`` = 1): S0 and O0 only; the second softmax
# warpgroup has no tile and leaves at once (no barrier counts it), and each CTA
# covers 128 rows instead of 256. flash-attn-4 runs head dim 256 on two CTAs
# instead (a 2-CTA MMA shares the B operand); one CTA keeps every other part of
# this kernel as it is.


@dataclasses.dataclass(frozen=True)
class Sm100FwdTiles:
    """Tuning knobs of the sm100 forward; see ``fwd_tiles``."""

    tile_m: int  # rows of one Q tile (the tcgen05 MMA M)
    tile_n: int  # keys per KV block
    kv_stages: int  # K and V tiles share one SMEM ring of this many slots
    softmax_regs: int
    correction_regs: int
    other_regs: int
    sw_exp2_per_32: int  # of every 32 elements of a row, the last this many use exp2_poly_x2
    q_tiles: int = 2  # Q tiles per CTA (Note [One Q tile])


def fwd_tiles(head_dim: int, head_dim_v: int, causal: bool, dtype_bytes: int = 2) -> Sm100FwdTiles:
    """The tile table: 2 x (128 x tile_n) tiles, KV stages from the SMEM budget.

    SMEM holds the Q tiles (O reuses them in the epilogue: a Q tile is dead once
    O_i's last P V has completed, which is when its O is normalised) and the K/V
    ring: stages = (227 KB - 4 KB reserve - Q) / tile bytes, which gives 4 at head
    dim 128 and 11 at head dim 64 (FA4, which keeps a separate O buffer, uses 3
    and 10), and 2 at DeepSeek's (192, 128), whose V tiles take K tiles' slots;
    tensor memory then holds S0, S1, O0 and O1 in 128 columns each.
    Head dim 192 (Dv = 192): O0 and O1 take 384 of the 512 columns, so S0 and S1
    get 64 each: 64-key blocks, 5 stages of them.
    Head dim 256: one Q tile (Note [One Q tile]); 64-key blocks, so that 4 stages
    fit beside Q (128-key blocks would leave 2: K and V of one block).
    Registers: 512 threads x 128 = 64K; softmax 2 x 128 x 192 + correction
    128 x 80 + the rest 128 x 48 = 64K (FA4's split).
    Software exp2: 4 of every 32 elements (12.5%) at head dim 128, 8 (25%) at
    head dim 64, where the MUFU unit limits the softmax most (FA4 uses 12.5%
    to 25%). Not tuned on hardware (none available yet).
    """
    if (head_dim, head_dim_v) not in SM100_FWD_HEAD_DIMS:
        raise ValueError(f"sm100 forward supports head dims 64, 96, 128, 192, (192, 128) and "
                         f"256, got {head_dim}, {head_dim_v}")
    del causal  # same tiles for causal and not (not measured yet)
    tile_m = 128
    q_tiles = 1 if 2 * head_dim_v >= _TMEM_COLS else 2
    # Two tiles: S0 and S1 take the tensor memory that O0 and O1 leave. One tile:
    # 64 keys, for the SMEM stages.
    tile_n = min(128, (_TMEM_COLS - 2 * head_dim_v) // 2) if q_tiles == 2 else 64
    q_bytes = q_tiles * tile_m * head_dim * dtype_bytes
    # The ring's slots hold a K tile; V's (Dv <= D) takes one too.
    kv_tile_bytes = tile_n * head_dim * dtype_bytes
    stages = (_SMEM_CAPACITY - _SMEM_RESERVE - q_bytes) // kv_tile_bytes
    # Head dims above 128: the MMA warp issues 12 or 16 k-steps of Q K^T per tile
    # and gets 80 registers, the softmax warps 176 (Note [Descriptors per block]);
    # with 48 it used local memory for its descriptors.
    wide = head_dim > 128
    return Sm100FwdTiles(
        tile_m=tile_m,
        tile_n=tile_n,
        kv_stages=stages,
        softmax_regs=176 if wide else 192,
        correction_regs=80,
        other_regs=80 if wide else 48,
        sw_exp2_per_32=4 if head_dim >= 128 else 8,
        q_tiles=q_tiles,
    )


def kv_block_schedule(m_block, seqlen_k, causal: bool, rows_per_cta: int, tile_n: int):
    """(n_blocks, n_masked) of the CTA that owns rows [m_block * rows_per_cta, +rows_per_cta).

    Blocks are processed from n_blocks - 1 down to 0; the first n_masked of them
    (the highest) are masked: the seqlen_k tail always, and under causal every
    block that reaches past the CTA's first row. The rest are fully visible to
    every row of the CTA. Works on Python ints (tests) and DSL Int32 (kernel).
    """
    n_blocks = cute.ceil_div(seqlen_k, tile_n)
    n_masked = 1
    if cutlass.const_expr(causal):
        n_blocks = cutlass.min(n_blocks, cute.ceil_div((m_block + 1) * rows_per_cta, tile_n))
        n_full = cutlass.min((m_block * rows_per_cta) // tile_n, n_blocks)
        n_masked = cutlass.max(n_blocks - n_full, 1)
    return n_blocks, n_masked






# Note [Page pieces]
# ~~~~~~~~~~~~~~~~~~~
# A paged cache whose pages are smaller than a key block (Note [Paged KV] in
# sm90_fwd.py) fills each ring slot as tile_n / page_size row boxes, one per page,
# with ``PagedKV`` (cute_utils.py). The MMA operand layouts of K (K-major) and V
# (MN-major) put a key's 64 columns in one 128-byte row of the swizzle, tile_n such
# rows per 64 columns, so the slot seen as (tile_n keys, columns) has plain rows
# (``_ring_rows``, checked against the MMA layouts when traced), and a piece of r
# keys is rows [j r, j r + r) of each 64-column band: r a multiple of the swizzle's
# 8 rows keeps the pattern. V is then read through its (keys, Dv) view, as K is. The
# MMA warp reads the same bytes through the MMA layouts. Head dims that are
# multiples of 64 only (the 128-byte swizzle); others gather their pages.


# Note [Descriptors per block]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Q's SMEM descriptors do not change over the key blocks, so the compiler builds
# them once before the MMA warp's loop and keeps them: 2 tiles x D / 16 k-steps of
# 64 bits, 48 registers at D = 192, more than the warp's budget (it spilled 203
# local-memory instructions). Indexing the Q tile by a value the compiler takes to
# depend on the block (``_per_block``) has them rebuilt in each block, a few
# integer adds per MMA. flash-attn-4 builds its descriptors by increments in
# inline PTX for the same reason.


@dsl_user_op
def _per_block(value: int, block: Int32, *, loc=None, ip=None) -> Int32:
    """``value`` as a run-time integer that the compiler takes to depend on
    ``block``: what is built from it is rebuilt in each loop iteration instead of
    held in registers across the loop (Note [Descriptors per block])."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(block).ir_value(loc=loc, ip=ip)],
            f"mov.b32 $0, {int(value)};",
            "=r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def _advanced(state):
    """A copy of a pipeline state moved to the next stage.

    Loops reassign states (``s = _advanced(s)``) rather than mutate them, so
    the DSL sees them as loop-carried values.
    """
    state = state.clone()
    state.advance()
    return state


@dsl_user_op
def _tcgen05_fence_before_sync(*, loc=None, ip=None) -> None:
    """Order this thread's tcgen05 ops before a following barrier arrive."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC, loc=loc, ip=ip)


@dsl_user_op
def _tcgen05_fence_after_sync(*, loc=None, ip=None) -> None:
    """Order this thread's later tcgen05 ops after a preceding barrier wait."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC, loc=loc, ip=ip)


class FlashFwdSm100(FwdCall):
    """Forward attention for sm_100a, one compiled binary per configuration.

    dtype: bfloat16 or float16 (cutlass type, numpy/jax dtype or name).
    head_dim, head_dim_v: D and Dv (compile time; ``fwd_tiles``' pairs).
    causal: top-left causal mask.
    softmax_scale: multiplies q.k before the softmax; default 1/sqrt(D).
    masked: the call takes each query's interval of visible keys, (B, Sq, 2) int32
        (rules/ranges.py), which carries every mask (causal must then be False).
    segments: with ``masked``: the call also takes the query and key segment ids,
        (B, Sq) and (B, Sk) int32, compared where a document is not contiguous.
    sinks: the call also takes the sink logits, (B, Hq) float32 (``finalize_with_sink``).
    softcap: c > 0 caps each scaled logit s to c * tanh(s / c) (Note [Softcap in the
        kernels] in softmax.py); None for none.
    pack_gqa: with ``masked``, the query heads per KV head that share one tile
        (Note [Packed GQA] in sm90_fwd.py), dividing tile_m; 1: none.
    split_kv: with ``masked`` and no sinks, O and LSE are float32 partials, one per
        split of each tile's key blocks (Note [Split keys] in sm90_fwd.py).
    page_size: with ``masked``, K and V are page pools (pages, page_size, Hkv, D), and
        the call takes a page table after the mask operands (Note [Paged KV] in
        sm90_fwd.py, Note [Page pieces] here); 0: contiguous.
    """

    def __init__(
        self,
        dtype: Any,
        head_dim: int,
        head_dim_v: int | None = None,
        causal: bool = False,
        softmax_scale: float | None = None,
        masked: bool = False,
        segments: bool = False,
        sinks: bool = False,
        softcap: float | None = None,
        pack_gqa: int = 1,
        split_kv: bool = False,
        page_size: int = 0,
    ):
        self.dtype = as_cutlass_dtype(dtype, "sm100 forward")
        self.head_dim = head_dim
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.causal = causal
        set_mask_flags(self, causal, masked, segments)
        self.softmax_scale = (
            1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
        )
        if self.softmax_scale <= 0.0:
            raise ValueError("softmax_scale must be positive")
        self.tiles = fwd_tiles(self.head_dim, self.head_dim_v, causal)
        t = self.tiles
        self.tile_m, self.tile_n = t.tile_m, t.tile_n
        if self.tile_m != 128 or self.tile_n not in (64, 128):
            raise ValueError("sm100 forward is written for 128 x 128 and 128 x 64 tiles")
        set_forward_extras(self, sinks, softcap, pack_gqa, split_kv)
        set_page_size(self, page_size)
        # Note [Page pieces]: pages smaller than a block, read as pieces of it.
        self.page_pieces = bool(page_size) and page_size < self.tile_n
        if self.page_pieces and (self.head_dim % 64 or self.head_dim_v % 64):
            raise ValueError("the sm100 forward reads pages smaller than a block at head "
                             "dims that are multiples of 64 (rows of the 128-byte swizzle)")
        self.q_tiles = t.q_tiles
        if self.q_tiles not in (1, 2):
            raise ValueError(f"q_tiles must be 1 or 2, got {self.q_tiles}")
        if self.q_tiles * (self.tile_n + self.head_dim_v) > _TMEM_COLS:
            raise ValueError("the S and O tiles do not fit in tensor memory")
        if self.tile_n % 32 or t.sw_exp2_per_32 % 2 or not 0 <= t.sw_exp2_per_32 <= 32:
            raise ValueError("sw_exp2_per_32 must be even and in [0, 32]")
        self.num_threads = _NUM_WARPS * _WARP
        logger.debug(
            "FlashFwdSm100 %s D=%d Dv=%d causal=%s tiles=%s",
            self.dtype,
            self.head_dim,
            self.head_dim_v,
            causal,
            t,
        )

    # ------------------------------------------------------------------ host
    @cute.jit
    def launch(self, stream: cuda.CUstream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
               mO: cute.Tensor, mLSE: cute.Tensor, mTileCounter=None, mRanges=None, mQSeg=None,
               mKSeg=None, mSinks=None, mPageTable=None):
        """The host side of ``FwdCall.__call__``, with the tensors as it takes them (no
        tile counter; with ``masked`` the key intervals, with ``segments`` the ids,
        with ``sinks`` the sink logits (B, Hq) f32)."""
        check_forward_dtypes(self, mQ, mK, mV, mO, mLSE)
        # FA4 order: Q, K, O (seqlen, head_dim, heads, batch); V as the MN-major
        # B operand of P V: (head_dim_v, seqlen_k, heads, batch); LSE (seqlen, heads, batch).
        mQ, mK, mO = [permute(t, [1, 3, 2, 0]) for t in (mQ, mK, mO)]
        mVt = permute(mV, [3, 1, 2, 0])
        # Page pieces: V as K, (seqlen, head_dim_v, heads, pages), for row boxes.
        mV_rows = permute(mV, [1, 3, 2, 0]) if cutlass.const_expr(self.page_pieces) else None
        mLSE = permute(mLSE, [2, 1, 0])
        if cutlass.const_expr(self.pack_gqa > 1):  # Note [Packed GQA] in sm90_fwd.py
            mQ, mO, mLSE, mRanges, mQSeg = packed_gqa_views(self.pack_gqa, mQ, mO, mLSE,
                                                            mRanges, mQSeg)

        tm, tn, d, dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v
        stages = self.tiles.kv_stages
        major_k = cute.nvgpu.OperandMajorMode.K
        major_mn = cute.nvgpu.OperandMajorMode.MN
        cta_group = tcgen05.CtaGroup.ONE
        tiled_mma_qk = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, major_k, major_k, Float32, cta_group, (tm, tn)
        )
        # P comes from TMEM (K-major, 16 bit); V^T is MN-major in SMEM.
        tiled_mma_pv = sm100_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            major_k,
            major_mn,
            Float32,
            cta_group,
            (tm, dv),
            tcgen05.OperandSource.TMEM,
        )
        qk_tiler = (tm, tn, d)
        pv_tiler = (tm, dv, tn)

        sQ_layout = sm100_utils.make_smem_layout_a(tiled_mma_qk, qk_tiler, self.dtype,
                                                   self.q_tiles)
        sK_layout = sm100_utils.make_smem_layout_b(tiled_mma_qk, qk_tiler, self.dtype, stages)
        sV_layout = sm100_utils.make_smem_layout_b(tiled_mma_pv, pv_tiler, self.dtype, stages)
        tP_layout = sm100_utils.make_smem_layout_a(tiled_mma_pv, pv_tiler, self.dtype, 1)
        sO_layout = sm100_utils.make_smem_layout_epi(self.dtype, LayoutEnum.ROW_MAJOR, (tm, dv),
                                                     self.q_tiles)
        # K and V share the ring in slots of K's size (Dv <= D): V's stages take K's
        # stride, and a V load expects its own bytes (``_tma_load``).
        k_tile = cute.cosize(cute.select(sK_layout, mode=[0, 1, 2]))
        v_tile = cute.cosize(cute.select(sV_layout, mode=[0, 1, 2]))
        if cutlass.const_expr(v_tile > k_tile):
            raise ValueError("V tiles must fit in the K slots of the ring (Dv <= D)")
        if cutlass.const_expr(v_tile < k_tile):
            outer = sV_layout.outer
            sV_layout = cute.make_composed_layout(
                sV_layout.inner, 0,
                cute.make_layout(outer.shape, stride=(*outer.stride[:3], k_tile)))
        if cutlass.const_expr(cute.cosize(sO_layout) > cute.cosize(sQ_layout)):
            raise ValueError("O must fit in the Q buffer it reuses")

        cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma_qk.thr_id.shape,))
        g2s = cpasync.CopyBulkTensorTileG2SOp(cta_group)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, mQ, cute.select(sQ_layout, mode=[0, 1, 2]), qk_tiler, tiled_mma_qk,
            cluster_vmnk.shape,
        )  # fmt: skip
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, mK, cute.select(sK_layout, mode=[0, 1, 2]), qk_tiler, tiled_mma_qk,
            cluster_vmnk.shape,
        )  # fmt: skip
        tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, mVt, cute.select(sV_layout, mode=[0, 1, 2]), pv_tiler, tiled_mma_pv,
            cluster_vmnk.shape,
        )  # fmt: skip
        # Note [Page pieces]: row boxes of a page into the ring's rows.
        sK_rows = sV_rows = None
        if cutlass.const_expr(self.page_pieces):
            sK_rows = self._ring_rows(sK_layout, d, k_tile, True)
            sV_rows = self._ring_rows(sV_layout, dv, k_tile, False)
            g2s_rows = cpasync.CopyBulkTensorTileG2SOp()
            r = self.page_rows
            tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
                g2s_rows, mK, kv_box_layout(sK_rows, r, d), (r, d))
            tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
                g2s_rows, mV_rows, kv_box_layout(sV_rows, r, dv), (r, dv))
        # Split keys: float32 partials stored by the correction warps.
        tma_atom_O, tma_O = None, mO
        if cutlass.const_expr(not self.split_kv):
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, cute.select(sO_layout, mode=[0, 1]),
                (tm, dv))
        self.tx_bytes_q = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1, 2]))
        self.tx_bytes_kv = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1, 2]))
        self.tx_bytes_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1, 2]))

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * 2]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar: cute.struct.MemRange[cutlass.Int64, _NUM_MBARS]
            tmem_addr: Int32
            # Per Q tile and row: the O scale of the current block, then the
            # final row sum and reference max (separate slots: see correction()).
            row_scale: cute.struct.MemRange[Float32, 2 * tm]
            row_sum: cute.struct.MemRange[Float32, 2 * tm]
            row_max: cute.struct.MemRange[Float32, 2 * tm]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]

        seqlen_q = self.q_rows(mQ)
        # With split keys the batches are batch x split, as the partial LSE has them.
        batches = mLSE.shape[2] if cutlass.const_expr(self.split_kv) else mQ.shape[3]
        grid = (cute.ceil_div(seqlen_q, self.q_tiles * tm), cute.size(mQ.shape[2]),
                cute.size(batches))
        self.kernel(
            tma_Q,
            tma_K,
            tma_V,
            tma_O,
            mLSE,
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
            tP_layout,
            sO_layout,
            sK_rows,
            sV_rows,
            tiled_mma_qk,
            tiled_mma_pv,
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA view of Q (Sq, D, Hq, B)
        mK: cute.Tensor,  # TMA view of K (Sk, D, Hkv, B)
        mVt: cute.Tensor,  # TMA view of V^T (Dv, Sk, Hkv, B)
        mO: cute.Tensor,  # TMA view of O (Sq, Dv, Hq, B)
        mLSE: cute.Tensor,  # (Sq, Hq, B) f32
        mRanges: cute.Tensor | None,  # (B, Sq, 2) int32 key intervals (masked only)
        mQSeg: cute.Tensor | None,  # (B, Sq) int32 (segments only)
        mKSeg: cute.Tensor | None,  # (B, Sk) int32 (segments only)
        mSinks: cute.Tensor | None,  # (B, Hq) f32 sink logits (sinks only)
        mPageTable: cute.Tensor | None,  # (B, pages per sequence) int32 (paged only)
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tma_atom_O: cute.CopyAtom,
        sQ_layout: cute.ComposedLayout,  # ((MMA, MMA_M, MMA_K), 2 Q tiles)
        sK_layout: cute.ComposedLayout,  # ((MMA, MMA_N, MMA_K), stages)
        sV_layout: cute.ComposedLayout,  # ((MMA, MMA_N=Dv, MMA_K), stages)
        tP_layout: cute.ComposedLayout,  # P as the TMEM A operand of P V
        sO_layout: cute.ComposedLayout,  # (tile_m, Dv, 2 Q tiles), aliases sQ
        sK_rows: cute.ComposedLayout | None,  # page pieces: (tile_n, D, stages) rows
        sV_rows: cute.ComposedLayout | None,  # page pieces: (tile_n, Dv, stages) rows
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == _LOAD_WARP:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                if cutlass.const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar = storage.mbar.data_ptr()

        load_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        mma_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        pipe_q = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.mbar_q.data_ptr(),
            num_stages=self.q_tiles,
            producer_group=load_thread,
            consumer_group=mma_thread,
            tx_count=self.tx_bytes_q,
            defer_sync=True,
        )
        pipe_kv = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.mbar_kv.data_ptr(),
            num_stages=self.tiles.kv_stages,
            producer_group=load_thread,
            consumer_group=mma_thread,
            tx_count=self.tx_bytes_kv,
            defer_sync=True,
        )
        if warp_idx == 0:
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_init(mbar + _S_FULL + i, 1)
                    cute.arch.mbarrier_init(mbar + _P_READY + i, 2 * _WG)
                    cute.arch.mbarrier_init(mbar + _O_DONE + i, 1)
                    cute.arch.mbarrier_init(mbar + _STATS + i, _WG)
                    cute.arch.mbarrier_init(mbar + _FINAL + i, _WG)
                    cute.arch.mbarrier_init(mbar + _O_SMEM + i, _WG)
            cute.arch.mbarrier_init_fence()

        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_addr.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=_BAR_TMEM_ALLOC, num_threads=(self.q_tiles * 4 + 4 + 1) * _WARP
            ),
            allocator_warp_id=_MMA_WARP,
        )
        tmem_free_bar = pipeline.NamedBarrier(barrier_id=_BAR_TMEM_FREE, num_threads=5 * _WARP)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sKV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        row_scale = storage.row_scale.get_tensor(cute.make_layout((self.tile_m, 2)))
        row_sum = storage.row_sum.get_tensor(cute.make_layout((self.tile_m, 2)))
        row_max = storage.row_max.get_tensor(cute.make_layout((self.tile_m, 2)))

        # Block coordinates. Causal CTAs lower in the matrix have more KV blocks:
        # launch them first so the longest CTAs do not start last.
        bidx, head, out_batch = cute.arch.block_idx()
        batch = out_batch
        if cutlass.const_expr(self.split_kv):
            batch = out_batch % mRanges.shape[0]
        m_block = bidx
        if cutlass.const_expr(self.causal or self.masked):
            m_block = cute.arch.grid_dim()[0] - 1 - bidx
        seqlen_q = self.q_rows(mQ)
        seqlen_k = mK.shape[0]
        if cutlass.const_expr(self.page_size):
            seqlen_k = mPageTable.shape[1] * self.page_size
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        # Blocks [n_end - n_blocks, n_end), walked from the last; the first n_masked
        # steps masked, then n_full unmasked ones, then the rest masked again.
        n_blocks, n_masked = kv_block_schedule(
            m_block, seqlen_k, self.causal, self.q_tiles * self.tile_m, self.tile_n
        )
        n_end, n_full = n_blocks, n_blocks - n_masked
        masks = None
        if cutlass.const_expr(self.masked):
            # Every warp reduces the CTA's rows' intervals itself (BlockRange).
            blocks = BlockRange(mRanges, self.q_tiles * self.tile_m, self.tile_n, m_block, batch,
                                seqlen_q, at_least_one=True)
            keys = None
            if cutlass.const_expr(self.split_kv):
                b = mRanges.shape[0]
                keys = blocks.split(out_batch // b, mLSE.shape[2] // b)
            n_end = blocks.end
            n_blocks = blocks.end - blocks.first
            hi_edge, lo_edge = edge_walk(blocks.first, n_end, blocks.full_first,
                                         blocks.full_end, cutlass.min, cutlass.max)
            # The last block is always masked (it carries the sequence end).
            n_masked = n_end - hi_edge
            n_full = hi_edge - lo_edge
            masks = (mRanges, mQSeg, mKSeg, batch, seqlen_q, seqlen_k, keys)

        cute.arch.sync_threads()  # barriers initialised and visible

        if warp_idx < _CORRECTION_WARP:
            if cutlass.const_expr(self.q_tiles == 2):
                cute.arch.setmaxregister_increase(self.tiles.softmax_regs)
                tile = warp_idx // 4
                self.softmax(
                    tmem, tiled_mma_qk, row_scale, row_sum, row_max, mbar, tile,
                    m_block, seqlen_k, n_blocks, n_masked, n_end, n_full, masks,
                )  # fmt: skip
            else:
                if warp_idx < _SOFTMAX1_WARP:
                    cute.arch.setmaxregister_increase(self.tiles.softmax_regs)
                    self.softmax(
                        tmem, tiled_mma_qk, row_scale, row_sum, row_max, mbar, Int32(0),
                        m_block, seqlen_k, n_blocks, n_masked, n_end, n_full, masks,
                    )  # fmt: skip
                else:
                    # Note [One Q tile]: no second tile; these warps leave.
                    cute.arch.setmaxregister_decrease(self.tiles.other_regs)
        elif warp_idx < _MMA_WARP:
            cute.arch.setmaxregister_decrease(self.tiles.correction_regs)
            self.correction(
                tmem, tmem_free_bar, tiled_mma_pv, row_scale, row_sum, row_max, sO, mO, mLSE,
                mSinks, mbar, m_block, head, out_batch, seqlen_q, n_blocks,
            )  # fmt: skip
        else:
            cute.arch.setmaxregister_decrease(self.tiles.other_regs)
            if warp_idx == _MMA_WARP:
                self.mma(
                    tmem, tmem_free_bar, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, tP_layout,
                    pipe_q, pipe_kv, mbar, n_blocks,
                )  # fmt: skip
            elif warp_idx == _EPILOGUE_WARP:
                # Split keys: the correction warps store the float32 partials.
                if cutlass.const_expr(not self.split_kv):
                    self.epilogue(mO, sO, tma_atom_O, mbar, m_block, head, batch)
            elif warp_idx == _LOAD_WARP:
                self.load(
                    mQ, mK, mVt, sQ, *self._ring_views(storage, sK, sV, sK_rows, sV_rows),
                    tma_atom_Q, tma_atom_K, tma_atom_V,
                    tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_kv, m_block, head, head_kv,
                    batch, n_blocks, n_end, mPageTable,
                )  # fmt: skip

    # ------------------------------------------------------------------ load
    @cute.jit
    def load(
        self,
        mQ: cute.Tensor,  # (Sq, D, Hq, B)
        mK: cute.Tensor,  # (Sk, D, Hkv, B)
        mVt: cute.Tensor,  # (Dv, Sk, Hkv, B)
        sQ: cute.Tensor,  # ((MMA, MMA_M, MMA_K), 2)
        sK: cute.Tensor,  # ((MMA, MMA_N, MMA_K), stages)
        sV: cute.Tensor,  # ((MMA, MMA_N, MMA_K), stages), aliases sK
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        pipe_q: pipeline.PipelineTmaUmma,
        pipe_kv: pipeline.PipelineTmaUmma,
        m_block: Int32,
        head: Int32,
        head_kv: Int32,
        batch: Int32,
        n_blocks: Int32,
        n_end: Int32,
        mPageTable: cute.Tensor | None = None,  # (B, pages per sequence) (paged only)
    ):
        """Load warp: Q0, K(first), Q1, then K(t), V(t-1) ... V(last) through the ring,
        for the n_blocks key blocks before n_end, the last first.

        This is the order the MMA warp consumes them in. TMA zero-fills rows
        past the sequence ends, so tails need no special loads. Paged: each block
        is a whole-block box of its page (``_paged_tiles``).
        """
        thr_qk = tiled_mma_qk.get_slice(0)
        thr_pv = tiled_mma_pv.get_slice(0)
        # (tile_m, D, m tiles, 1) -> MMA partition -> TMA partition.
        gQ = cute.flat_divide(mQ[None, None, head, batch], (self.tile_m, self.head_dim))
        tQsQ, tQgQ = tma_tile_partition(tma_atom_Q, sQ, thr_qk.partition_A(gQ), rank=3)
        if cutlass.const_expr(self.page_pieces):
            # Note [Page pieces]: mK / mVt are the pools as (rows, D, Hkv, pages), sK /
            # sV the ring's rows.
            blocks = (PagedKV(mK, mPageTable, sK, tma_atom_K, self.page_size, self.tile_n,
                              head_kv, batch),
                      PagedKV(mVt, mPageTable, sV, tma_atom_V, self.page_size, self.tile_n,
                              head_kv, batch))
        else:
            gK = cute.flat_divide(mK[None, None, head_kv, batch], (self.tile_n, self.head_dim))
            tKsK, tKgK = tma_tile_partition(tma_atom_K, sK, thr_qk.partition_B(gK), rank=3)
            gV = cute.flat_divide(mVt[None, None, head_kv, batch],
                                  (self.head_dim_v, self.tile_n))
            tVsV, tVgV = tma_tile_partition(tma_atom_V, sV, thr_pv.partition_B(gV), rank=3)
            # What a paged block's tiles are made from (``_kv_tile``).
            pages = (mK, mVt, mPageTable, tma_atom_K, tma_atom_V, sK, sV, thr_qk, thr_pv,
                     head_kv, batch)
            blocks = ((tma_atom_K, tKgK, tKsK, pages), (tma_atom_V, tVgV, tVsV, pages))

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.q_tiles)
        kv_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, self.tiles.kv_stages
        )

        n_last = n_end - 1
        q_tile0 = self.q_tiles * m_block
        q_state = self._tma_load(pipe_q, tma_atom_Q, tQgQ[None, q_tile0, 0], tQsQ, q_state)
        kv_state = self._load_block(pipe_kv, kv_state, blocks, n_last, 0)
        if cutlass.const_expr(self.q_tiles == 2):
            q_state = self._tma_load(pipe_q, tma_atom_Q, tQgQ[None, q_tile0 + 1, 0], tQsQ,
                                     q_state)
        for t in cutlass.range(1, n_blocks, unroll=1):
            kv_state = self._load_block(pipe_kv, kv_state, blocks, n_last - t, 0)
            kv_state = self._load_block(pipe_kv, kv_state, blocks, n_last - t + 1, 1)
        kv_state = self._load_block(pipe_kv, kv_state, blocks, n_end - n_blocks, 1)

    def _load_block(self, pipe_kv, kv_state, blocks: tuple, n, which: int):
        """Key block n's K (which 0) or V (1) into the next ring slot; returns the
        advanced state. A V load expects its own bytes (V tiles in K-sized slots)."""
        tx = self.tx_bytes_v if which == 1 else None
        if cutlass.const_expr(self.page_pieces):
            if cutlass.const_expr(tx == self.tx_bytes_kv):
                tx = None
            blocks[which].load(pipe_kv, kv_state, n, tx)
            return _advanced(kv_state)
        atom, tXgX, tXsX, pages = blocks[which]
        return self._tma_load(pipe_kv, atom, self._kv_tile(tXgX, pages, n, which), tXsX,
                              kv_state, tx)

    def _ring_views(self, storage, sK, sV, sK_rows, sV_rows):
        """(K, V) ring tensors the load warp fills: the MMA layouts, or with page pieces
        the ring's rows (Note [Page pieces])."""
        if not self.page_pieces:
            return sK, sV
        return (storage.sKV.get_tensor(sK_rows.outer, swizzle=sK_rows.inner),
                storage.sKV.get_tensor(sV_rows.outer, swizzle=sV_rows.inner))

    def _ring_rows(self, stage_layout: cute.ComposedLayout, cols: int, slot: int,
                   k_major: bool):
        """Note [Page pieces]: the K (``k_major``) or V ring as (tile_n keys, cols,
        stages). In the MMA layouts (``make_smem_layout_b``, 128-byte swizzle) a
        key's 64-column pieces are 128-byte rows, tile_n of them per 64 columns; the
        stages are ``slot`` elements apart. Checked at trace time against the MMA
        layout, read through the order of its own coordinates."""
        tn = self.tile_n
        rows = cute.make_layout((tn, (64, cols // 64), self.tiles.kv_stages),
                                stride=(64, (1, tn * 64), slot))
        one = cute.select(stage_layout.outer, mode=[0, 1, 2])
        if k_major:  # ((keys, 16), 1, columns / 16): keys first
            flat = cute.make_layout((tn, (16, cols // 16)), stride=(1, (tn, tn * 16)))
        else:  # (((columns), 16 keys), 1, keys / 16): columns first
            flat = cute.make_layout(((16, tn // 16), cols), stride=((cols, cols * 16), 1))
        mma_rows = cute.composition(one, flat)
        for r in (0, 7, 8, tn // 2 - 1, tn - 1):
            for c in (0, 15, 16, 63, cols - 64, cols - 1):
                if mma_rows((r, c)) != rows((r, c, 0)):
                    raise ValueError(f"the ring's rows are not 128-byte rows at ({r}, {c})")
        return cute.make_composed_layout(stage_layout.inner, 0, rows)

    def _kv_tile(self, tXgX, pages: tuple, n, which: int):
        """Key block n's K (which 0) or V (1) tile in global memory: of the contiguous
        partition tXgX, or of its page (``_paged_tiles``)."""
        if cutlass.const_expr(self.page_size):
            return self._paged_tiles(*pages, n)[which]
        return tXgX[None, n, 0] if which == 0 else tXgX[None, 0, n]

    def _paged_tiles(self, mK, mVt, mPageTable, tma_atom_K, tma_atom_V, sK, sV, thr_qk,
                     thr_pv, head_kv, batch, n):
        """(K tile, V tile) of key block n of a paged cache (Note [Paged KV] in
        sm90_fwd.py): the block's page from the table (slots past its end read the
        last one, ids clamped into the pool; the intervals mask those keys), then
        the block's box inside the page, partitioned as the contiguous tiles are."""
        slot = cutlass.min(n * self.tile_n // self.page_size, mPageTable.shape[1] - 1)
        page = cutlass.max(cutlass.min(mPageTable[batch, slot], mK.shape[3] - 1), 0)
        in_page = (n * self.tile_n % self.page_size) // self.tile_n
        gK = cute.flat_divide(mK[None, None, head_kv, page], (self.tile_n, self.head_dim))
        _, tKgK = tma_tile_partition(tma_atom_K, sK, thr_qk.partition_B(gK), rank=3)
        gV = cute.flat_divide(mVt[None, None, head_kv, page], (self.head_dim_v, self.tile_n))
        _, tVgV = tma_tile_partition(tma_atom_V, sV, thr_pv.partition_B(gV), rank=3)
        return tKgK[None, in_page, 0], tVgV[None, 0, in_page]

    @cute.jit
    def _tma_load(
        self,
        pipe: pipeline.PipelineTmaUmma,
        atom: cute.CopyAtom,
        src: cute.Tensor,  # (TMA,) one tile in global memory
        dst: cute.Tensor,  # (TMA, stages) SMEM
        state: pipeline.PipelineState,
        tx_bytes: int | None = None,
    ) -> pipeline.PipelineState:
        """Acquire a slot, start the TMA into it; return the advanced state.
        tx_bytes: the bytes it brings where they are not the pipeline's own (V
        tiles smaller than the K tiles whose slots they take).

        Loops reassign the returned state so the DSL carries it through them.
        """
        if cutlass.const_expr(tx_bytes is not None and tx_bytes != self.tx_bytes_kv):
            pipe.producer_acquire(state, expected_tx=tx_bytes)
        else:
            pipe.producer_acquire(state)
        bar = pipe.producer_get_barrier(state)
        cute.copy(atom, src, dst[None, state.index], tma_bar_ptr=bar)
        return _advanced(state)

    # ------------------------------------------------------------------- mma
    @cute.jit
    def mma(
        self,
        tmem: cutlass.memory.TmemAllocator,
        tmem_free_bar: pipeline.NamedBarrier,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        sQ: cute.Tensor,  # ((MMA, MMA_M, MMA_K), 2)
        sK: cute.Tensor,  # ((MMA, MMA_N, MMA_K), stages)
        sV: cute.Tensor,  # ((MMA, MMA_N, MMA_K), stages)
        tP_layout: cute.ComposedLayout,
        pipe_q: pipeline.PipelineTmaUmma,
        pipe_kv: pipeline.PipelineTmaUmma,
        mbar: cute.Pointer,
        n_blocks: Int32,
    ):
        """MMA warp: allocates TMEM, issues every tcgen05.mma, frees TMEM at the end.

        Per block t >= 1 and tile i: wait p_ready[i] (P_i(t-1) written and O_i
        rescaled), O_i += P_i(t-1) V(t-1), then S_i(t) = Q_i K(t)^T.
        """
        tmem.allocate(_TMEM_COLS)
        tmem.relinquish_alloc_permit()
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(Float32)

        thr_qk = tiled_mma_qk.get_slice(0)
        thr_pv = tiled_mma_pv.get_slice(0)
        tSrQ = thr_qk.make_fragment_A(sQ)  # (MMA, MMA_M, MMA_K, 2)
        tSrK = thr_qk.make_fragment_B(sK)  # (MMA, MMA_N, MMA_K, stages)
        tOrV = thr_pv.make_fragment_B(sV)  # (MMA, MMA_N, MMA_K, stages)
        tStS, tOtO, tOrP = self._tmem_views(thr_qk, thr_pv, tP_layout, tmem_ptr)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.q_tiles)
        kv_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer, self.tiles.kv_stages
        )
        # Block 0 of the sequence: S_0 and S_1 against the first K.
        pipe_kv.consumer_wait(kv_state)
        for tile in cutlass.range_constexpr(self.q_tiles):
            pipe_q.consumer_wait(q_state)
            # Q tile i sits in Q stage i (loaded in that order).
            self._issue_qk(
                tiled_mma_qk,
                tStS[tile],
                tSrQ[None, None, None, tile],
                tSrK[None, None, None, kv_state.index],
                mbar + _S_FULL + tile,
            )
            q_state = _advanced(q_state)
        pipe_kv.consumer_release(kv_state)
        kv_state = _advanced(kv_state)
        for t in cutlass.range(1, n_blocks, unroll=1):
            k_state = kv_state
            pipe_kv.consumer_wait(k_state)  # K(t)
            v_state = _advanced(k_state)
            pipe_kv.consumer_wait(v_state)  # V(t-1)
            for tile in cutlass.range_constexpr(self.q_tiles):
                self._issue_pv(
                    tiled_mma_pv,
                    tOtO[tile],
                    tOrP[tile],
                    tOrV[None, None, None, v_state.index],
                    mbar,
                    tile,
                    t - 1,
                    t > 1,
                )
                q_tile = tile
                if cutlass.const_expr(self.head_dim > 128):
                    q_tile = _per_block(tile, t)  # Note [Descriptors per block]
                self._issue_qk(
                    tiled_mma_qk,
                    tStS[tile],
                    tSrQ[None, None, None, q_tile],
                    tSrK[None, None, None, k_state.index],
                    mbar + _S_FULL + tile,
                )
            pipe_kv.consumer_release(k_state)
            pipe_kv.consumer_release(v_state)
            kv_state = _advanced(v_state)
        pipe_kv.consumer_wait(kv_state)  # V(last)
        for tile in cutlass.range_constexpr(self.q_tiles):
            self._issue_pv(
                tiled_mma_pv,
                tOtO[tile],
                tOrP[tile],
                tOrV[None, None, None, kv_state.index],
                mbar,
                tile,
                n_blocks - 1,
                n_blocks > 1,
            )
        pipe_kv.consumer_release(kv_state)
        # Q tiles are never released: each CTA loads them once.

        # The correction warps arrive here after their last TMEM read.
        tmem_free_bar.arrive_and_wait()
        _tcgen05_fence_after_sync()
        tmem.free(tmem_ptr)

    @cute.jit
    def _issue_qk(
        self,
        tiled_mma: cute.TiledMma,
        tStS: cute.Tensor,  # (MMA, MMA_M, MMA_N) fp32 TMEM, S_i
        tSrQ: cute.Tensor,  # (MMA, MMA_M, MMA_K) SMEM descriptors of Q_i
        tSrK: cute.Tensor,  # (MMA, MMA_N, MMA_K) SMEM descriptors of one K slot
        s_full: cute.Pointer,
    ):
        """S_i = Q_i K^T over all k-blocks, then signal the softmax on completion."""
        # A local atom: setting a field on the shared tiled MMA inside a runtime
        # loop would make the tracer carry it out of the loop.
        atom = cute.make_mma_atom(tiled_mma.op)
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            atom.set(tcgen05.Field.ACCUMULATE, k != 0)
            cute.gemm(atom, tStS, tSrQ[None, None, k], tSrK[None, None, k], tStS)
        with cute.arch.elect_one():
            tcgen05.commit(s_full)

    @cute.jit
    def _issue_pv(
        self,
        tiled_mma: cute.TiledMma,
        tOtO: cute.Tensor,  # (MMA, MMA_M, MMA_N) fp32 TMEM, O_i
        tOrP: cute.Tensor,  # (MMA, MMA_M, MMA_K) 16-bit TMEM, P_i
        tOrV: cute.Tensor,  # (MMA, MMA_N, MMA_K) SMEM descriptors of one V slot
        mbar: cute.Pointer,
        tile: int,
        t_prev: Int32,
        accumulate,
    ):
        """O_i (+)= P_i V once P_i is written and O_i rescaled; signal o_done[i].

        accumulate is False for the first block: O's TMEM starts uninitialised.
        """
        cute.arch.mbarrier_wait(mbar + _P_READY + tile, t_prev % 2)
        _tcgen05_fence_after_sync()
        atom = cute.make_mma_atom(tiled_mma.op)
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            if cutlass.const_expr(k == 0):
                atom.set(tcgen05.Field.ACCUMULATE, accumulate)
            else:
                atom.set(tcgen05.Field.ACCUMULATE, True)
            cute.gemm(atom, tOtO, tOrP[None, None, k], tOrV[None, None, k], tOtO)
        with cute.arch.elect_one():
            tcgen05.commit(mbar + _O_DONE + tile)

    def _tmem_views(self, thr_qk, thr_pv, tP_layout, tmem_ptr):
        """Per Q tile: S_i, O_i and P_i views of the tensor memory.

        S_i: (MMA, MMA_M, MMA_N) fp32, tile_m x tile_n at column i * tile_n.
        O_i: (MMA, MMA_M, MMA_N) fp32, tile_m x Dv at column 2 * tile_n + i * Dv.
        P_i: (MMA, MMA_M, MMA_K) 16-bit A operand of P V, over the upper half
        of S_i's columns (two elements per 32-bit column).
        """
        s_layout = thr_qk.make_fragment_C(
            thr_qk.partition_shape_C((self.tile_m, self.tile_n))
        ).layout
        o_layout = thr_pv.make_fragment_C(
            thr_pv.partition_shape_C((self.tile_m, self.head_dim_v))
        ).layout
        p_layout = thr_pv.make_fragment_A(cute.make_tensor(tmem_ptr, tP_layout.outer))[
            None, None, None, 0
        ].layout
        tStS = [cute.make_tensor(tmem_ptr + self._s_col(i), s_layout)
                for i in range(self.q_tiles)]
        tOtO = [cute.make_tensor(tmem_ptr + self._o_col(i), o_layout)
                for i in range(self.q_tiles)]
        tOrP = [
            cute.make_tensor(cute.recast_ptr(tmem_ptr + self._p_col(i), dtype=self.dtype), p_layout)
            for i in range(self.q_tiles)
        ]
        return tStS, tOtO, tOrP

    # TMEM column map (32-bit columns), see the module docstring.
    def _s_col(self, tile):
        return tile * self.tile_n

    def _p_col(self, tile):
        return tile * self.tile_n + self.tile_n // 2

    def _o_col(self, tile):
        return self.q_tiles * self.tile_n + tile * self.head_dim_v

    # --------------------------------------------------------------- softmax
    @cute.jit
    def softmax(
        self,
        tmem: cutlass.memory.TmemAllocator,
        tiled_mma_qk: cute.TiledMma,
        row_scale: cute.Tensor,  # (tile_m, 2) f32 SMEM
        row_sum: cute.Tensor,  # (tile_m, 2) f32 SMEM
        row_max: cute.Tensor,  # (tile_m, 2) f32 SMEM
        mbar: cute.Pointer,
        tile: Int32,
        m_block: Int32,
        seqlen_k: Int32,
        n_blocks: Int32,
        n_masked: Int32,
        n_end: Int32,
        n_full: Int32,
        masks: tuple | None,
    ):
        """Softmax warpgroup of Q tile ``tile``: one thread per row, whole rows.
        Steps [0, n_masked) and [n_masked + n_full, n_blocks) are masked, the block
        of step t being n_end - 1 - t; ``masks``: (key intervals, segment ids, batch,
        seqlen_q, seqlen_k) with ``masked``, else None.

        A thread holds its row's 128 scores, so the row max and sum need no
        shuffles. Per block: S from TMEM, mask, lazy max (Note [Lazy rescale] in
        softmax.py), exp2 (MUFU + exp2_poly_x2), P to TMEM over S.
        """
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(Float32)
        tidx = cute.arch.thread_idx()[0] % _WG
        thr_qk = tiled_mma_qk.get_slice(0)
        tStS = cute.make_tensor(
            tmem_ptr,
            thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.tile_m, self.tile_n))).layout,
        )
        tStS_i = cute.make_tensor(tmem_ptr + tile * self.tile_n, tStS.layout)
        tScS = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))

        # S: tcgen05.ld 32 lanes x 32 columns per instruction, one row per thread.
        ld_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        thr_ld = tcgen05.make_tmem_copy(ld_atom, tStS_i).get_slice(tidx)
        tSsrc = thr_ld.partition_S(tStS_i)
        tScrd = thr_ld.partition_D(tScS)  # (row, col) of every register of the row
        rS = cute.make_rmem_tensor(tScrd.shape, Float32)

        # P: 16-bit pairs packed in 32-bit words, in the upper half of S's columns.
        p_cols = self.tile_n * self.dtype.width // 32
        tStP = cute.make_tensor(
            tmem_ptr + tile * self.tile_n + self.tile_n // 2,
            cute.composition(tStS.layout, cute.make_layout((self.tile_m, p_cols))),
        )
        tScP = cute.make_tensor(
            tScS.iterator, cute.composition(tScS.layout, cute.make_layout((self.tile_m, p_cols)))
        )
        # One tcgen05.st per 32 columns of S (16 words of P), issued as soon as
        # that chunk is converted: frees its registers and overlaps the stores.
        st_atom = cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(_P_CHUNK // 2)), Float32
        )
        thr_st = tcgen05.make_tmem_copy(st_atom, tStP).get_slice(tidx)
        tPdst = thr_st.partition_D(tStP)
        rP32 = cute.make_rmem_tensor(thr_st.partition_S(tScP).shape, Float32)
        # The same registers as 16-bit values, element i = column i of the row
        # (the 32x32b load puts column i in register i; so does the store).
        rP = cute.make_tensor(cute.recast_ptr(rP32.iterator, dtype=self.dtype), rS.layout)

        row = tScrd[0][0]  # this thread's row of the tile (its TMEM lane)
        row_global = (m_block * self.q_tiles + tile) * self.tile_m + row
        c = self.scale_log2
        m_ref = Float32(-math.inf)  # reference max of the row (stale by up to the threshold)
        l_sum = Float32(0.0)  # row sum of P against m_ref, fp32 (before 16-bit rounding)
        n_last = n_end - 1
        # masked: the row's key interval [lo, lo + width), read once; a row past
        # the sequence end sees nothing.
        lo = width = seg = None
        if cutlass.const_expr(masks is not None):
            mRanges, mQSeg, _, batch, seqlen_q, _, keys = masks
            at = cutlass.min(row_global, seqlen_q - 1)
            hi_raw = mRanges[batch, at, 1]
            lo = mRanges[batch, at, 0]
            hi = cutlass.select_(hi_raw < 0, ~hi_raw, hi_raw)
            if cutlass.const_expr(keys is not None):
                # Split keys: only this split's keys (none in an empty split).
                lo = cutlass.max(lo, keys[0])
                hi = cutlass.min(hi, keys[1])
            width = cutlass.select_(row_global < seqlen_q, cutlass.max(hi - lo, 0), Int32(0))
            if cutlass.const_expr(mQSeg is not None):
                # The row's id where its document is not contiguous, else -1 - 2^31
                # (no compare): ids are compared only for such rows.
                seg = cutlass.select_(hi_raw < 0, mQSeg[batch, at], Int32(-(1 << 31)))
        row_mask = (row_global, seqlen_k, lo, width, seg, masks)

        for t in cutlass.range(n_masked, unroll=1):
            m_ref, l_sum = self._softmax_step(
                t, n_last - t, True, row_mask, m_ref, l_sum, c, mbar,
                tile, row, row_scale, thr_ld, tSsrc, tScrd, rS, thr_st, tPdst, rP32, rP,
            )  # fmt: skip
        # (Plain: n_masked + n_full is n_blocks; said so, the build is the one before
        # the masks.)
        full_end = n_blocks if cutlass.const_expr(masks is None) else n_masked + n_full
        for t in cutlass.range(n_masked, full_end, unroll=1):
            m_ref, l_sum = self._softmax_step(
                t, n_last - t, False, row_mask, m_ref, l_sum, c, mbar,
                tile, row, row_scale, thr_ld, tSsrc, tScrd, rS, thr_st, tPdst, rP32, rP,
            )  # fmt: skip
        if cutlass.const_expr(masks is not None):
            for t in cutlass.range(n_masked + n_full, n_blocks, unroll=1):
                m_ref, l_sum = self._softmax_step(
                    t, n_last - t, True, row_mask, m_ref, l_sum, c, mbar,
                    tile, row, row_scale, thr_ld, tSsrc, tScrd, rS, thr_st, tPdst, rP32, rP,
                )  # fmt: skip

        # Final stats for the correction warps (their own slots, see correction()).
        row_sum[row, tile] = l_sum
        row_max[row, tile] = m_ref
        cute.arch.mbarrier_arrive(mbar + _FINAL + tile)

    @cute.jit
    def _softmax_step(
        self,
        t: Int32,
        n_block: Int32,
        apply_mask: cutlass.Constexpr[bool],
        row_mask: tuple,  # (row_global, seqlen_k, lo, width, seg, masks): softmax()
        m_ref: Float32,
        l_sum: Float32,
        c: cutlass.Constexpr[float],
        mbar: cute.Pointer,
        tile: Int32,
        row: Int32,
        row_scale: cute.Tensor,  # (tile_m, 2) f32 SMEM
        thr_ld,
        tSsrc: cute.Tensor,  # this thread's S row in TMEM
        tScrd: cute.Tensor,  # (row, col) coordinates of rS
        rS: cute.Tensor,  # (tile_n,) f32 registers
        thr_st,
        tPdst: cute.Tensor,  # this thread's P row in TMEM (packed pairs)
        rP32: cute.Tensor,  # (tile_n / 2,) 32-bit registers
        rP: cute.Tensor,  # the same registers, (tile_n,) 16-bit
    ):
        """One KV block of one row: returns the new (m_ref, l_sum)."""
        cute.arch.mbarrier_wait(mbar + _S_FULL + tile, t % 2)
        _tcgen05_fence_after_sync()
        cute.copy(thr_ld, tSsrc, rS)
        cute.arch.fence_view_async_tmem_load()
        n = cute.size(rS)
        if cutlass.const_expr(self.cap_in is not None):
            cap_scores(rS, self.cap_in)  # before the mask

        row_global, seqlen_k, lo, width, seg, masks = row_mask
        if cutlass.const_expr(apply_mask and masks is not None):
            # Key j is visible iff lo <= j < lo + width (the row's interval), and
            # where the row's document is not contiguous iff its id is the row's.
            lo_n = lo - n_block * self.tile_n
            for i in cutlass.range_constexpr(n):
                rS[i] = keep_inside(rS[i], tScrd[i][1], lo_n, width)
            if cutlass.const_expr(seg is not None):
                if seg != Int32(-(1 << 31)):
                    mKSeg, batch = masks[2], masks[3]
                    for i in cutlass.range_constexpr(n):
                        col = cutlass.min(n_block * self.tile_n + tScrd[i][1], seqlen_k - 1)
                        same = mKSeg[batch, col] == seg
                        rS[i] = rS[i] if same else -Float32.inf
        elif cutlass.const_expr(apply_mask):
            # Key j is visible iff j < seqlen_k and (not causal or j <= query row).
            limit = seqlen_k - n_block * self.tile_n
            if cutlass.const_expr(self.causal):
                limit = cutlass.min(limit, row_global + 1 - n_block * self.tile_n)
            for i in cutlass.range_constexpr(n):
                rS[i] = -Float32.inf if tScrd[i][1] >= limit else rS[i]

        # Row max with 4 independent chains (the FMNMX latency dominates otherwise).
        mx = [rS[j] for j in range(4)]
        for i in cutlass.range_constexpr(4, n):
            mx[i % 4] = cute.arch.fmax(mx[i % 4], rS[i])
        blk_max = cute.arch.fmax(cute.arch.fmax(mx[0], mx[1]), cute.arch.fmax(mx[2], mx[3]))

        # Lazy rescale (Note [Lazy rescale] in softmax.py): keep the stale
        # reference unless the max grew by more than the threshold. A NaN test
        # (both -inf) compares false and keeps the reference.
        cand = cute.arch.fmax(m_ref, blk_max)
        moved = (cand - m_ref) * c > RESCALE_THRESHOLD
        new_ref = cand if moved else m_ref
        new_ref_safe = Float32(0.0) if new_ref == -Float32.inf else new_ref
        # exp2(-inf) = 0 when the old reference is -inf (nothing accumulated yet).
        scale = cute.math.exp2((m_ref - new_ref_safe) * c, fastmath=True)
        scale = scale if moved else Float32(1.0)
        if t > 0:
            # Block 0 needs no O scale (the first P V overwrites O).
            row_scale[row, tile] = scale
            cute.arch.mbarrier_arrive(mbar + _STATS + tile)

        # P = exp2(s * c - ref * c): MUFU for most elements, the polynomial for
        # the last sw_exp2_per_32 of every 32 (Note [Software exp2]).
        neg_ref_c = -new_ref_safe * c
        sw = self.tiles.sw_exp2_per_32
        # Two packed partial sums: halves the dependent FADD2 chain.
        sums = [(Float32(0.0), Float32(0.0)), (Float32(0.0), Float32(0.0))]
        for chunk in cutlass.range_constexpr(n // _P_CHUNK):
            lo = chunk * _P_CHUNK
            for i in cutlass.range_constexpr(lo, lo + _P_CHUNK, 2):
                x0, x1 = cute.arch.fma_packed_f32x2(
                    (rS[i], rS[i + 1]), (Float32(c), Float32(c)), (neg_ref_c, neg_ref_c)
                )
                if cutlass.const_expr(i - lo >= _P_CHUNK - sw):
                    p0, p1 = exp2_poly_x2(x0, x1)
                else:
                    p0 = cute.math.exp2(x0, fastmath=True)
                    p1 = cute.math.exp2(x1, fastmath=True)
                rS[i] = p0
                rS[i + 1] = p1
                acc = (i // 2) % 2
                sums[acc] = cute.arch.add_packed_f32x2(sums[acc], (p0, p1))
            # The finished chunk: to 16 bits (packed cvt), then to TMEM.
            rP_chunk = cute.make_tensor(rP.iterator + lo, cute.make_layout(_P_CHUNK))
            rS_chunk = cute.make_tensor(rS.iterator + lo, cute.make_layout(_P_CHUNK))
            rP_chunk.store(rS_chunk.load().to(self.dtype))
            cute.copy(thr_st, rP32[None, None, chunk], tPdst[None, None, chunk])
        total = cute.arch.add_packed_f32x2(sums[0], sums[1])
        l_new = l_sum * scale + (total[0] + total[1])

        cute.arch.fence_view_async_tmem_store()
        _tcgen05_fence_before_sync()
        cute.arch.mbarrier_arrive(mbar + _P_READY + tile)
        return new_ref, l_new

    # ------------------------------------------------------------ correction
    @cute.jit
    def correction(
        self,
        tmem: cutlass.memory.TmemAllocator,
        tmem_free_bar: pipeline.NamedBarrier,
        tiled_mma_pv: cute.TiledMma,
        row_scale: cute.Tensor,  # (tile_m, 2) f32 SMEM
        row_sum: cute.Tensor,  # (tile_m, 2) f32 SMEM
        row_max: cute.Tensor,  # (tile_m, 2) f32 SMEM
        sO: cute.Tensor,  # (tile_m, Dv, 2) SMEM, aliases sQ
        mO: cute.Tensor,  # split keys: (Sq, Dv, Hq, B x splits) f32; else unused
        mLSE: cute.Tensor,  # (Sq, Hq, B) f32 (split keys: B x splits)
        mSinks: cute.Tensor | None,  # (B, Hq) f32 (sinks only)
        mbar: cute.Pointer,
        m_block: Int32,
        head: Int32,
        batch: Int32,  # split keys: split x B + batch
        seqlen_q: Int32,
        n_blocks: Int32,
    ):
        """Correction warpgroup: thread r owns row r of both O tiles in TMEM.

        Block t >= 1, tile i: read the row's O scale (stats[i]), wait until
        O_i += P_i(t-1) V(t-1) finished (o_done[i]), rescale O_i's rows if any
        row of the warp needs it, then release the MMA (p_ready[i]). The final
        row sum and max come through separate SMEM slots and barrier (final[i])
        because softmax writes them right after its last row scale, possibly
        before this warp has read that scale.
        """
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(Float32)
        tidx = cute.arch.thread_idx()[0] % _WG
        thr_pv = tiled_mma_pv.get_slice(0)
        tOtO = cute.make_tensor(
            tmem_ptr,
            thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.tile_m, self.head_dim_v))).layout,
        )
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v)))
        # O is handled 32 columns at a time (32 registers in flight, 80 allowed).
        chunk = _O_CHUNK
        tOtO_c = cute.make_tensor(
            tOtO.iterator, cute.composition(tOtO.layout, cute.make_layout((self.tile_m, chunk)))
        )
        tOcO_c = cute.make_tensor(
            tOcO.iterator, cute.composition(tOcO.layout, cute.make_layout((self.tile_m, chunk)))
        )
        ld_atom = cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(chunk)), Float32
        )
        st_atom = cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(chunk)), Float32
        )
        thr_ld = tcgen05.make_tmem_copy(ld_atom, tOtO_c).get_slice(tidx)
        thr_st = tcgen05.make_tmem_copy(st_atom, tOtO_c).get_slice(tidx)
        tOsrc = thr_ld.partition_S(tOtO_c)
        tOdst = thr_st.partition_D(tOtO_c)
        tOcrd = thr_ld.partition_D(tOcO_c)  # (row, col) of every register
        rO = cute.make_rmem_tensor(tOcrd.shape, Float32)
        row = tOcrd[0][0]  # this thread's row of both O tiles (its TMEM lane)
        n_chunks = self.head_dim_v // chunk
        # Block 0: no O exists yet, nothing to rescale.
        for tile in cutlass.range_constexpr(self.q_tiles):
            _tcgen05_fence_before_sync()
            cute.arch.mbarrier_arrive(mbar + _P_READY + tile)
        for t in cutlass.range(1, n_blocks, unroll=1):
            for tile in cutlass.range_constexpr(self.q_tiles):
                cute.arch.mbarrier_wait(mbar + _STATS + tile, (t - 1) % 2)
                scale = row_scale[row, tile]
                cute.arch.mbarrier_wait(mbar + _O_DONE + tile, (t - 1) % 2)
                # One vote per warp: most blocks need no rescale at all.
                if cute.arch.vote_ballot_sync(scale != 1.0) != 0:
                    _tcgen05_fence_after_sync()
                    for k in cutlass.range_constexpr(n_chunks):
                        cute.copy(thr_ld, self._o_chunk(tOsrc, tile, k), rO)
                        cute.arch.fence_view_async_tmem_load()  # rO valid from here
                        for j in cutlass.range_constexpr(0, cute.size(rO), 2):
                            rO[j], rO[j + 1] = cute.arch.mul_packed_f32x2(
                                (rO[j], rO[j + 1]), (scale, scale)
                            )
                        cute.copy(thr_st, rO, self._o_chunk(tOdst, tile, k))
                    cute.arch.fence_view_async_tmem_store()
                _tcgen05_fence_before_sync()
                cute.arch.mbarrier_arrive(mbar + _P_READY + tile)

        # Final: O / row_sum in 16 bits into SMEM (split keys: in float32 straight to
        # global memory, Note [Split keys] in sm90_fwd.py), LSE to global memory.
        rOh = cute.make_rmem_tensor(tOcrd.shape, self.dtype)
        for tile in cutlass.range_constexpr(self.q_tiles):
            cute.arch.mbarrier_wait(mbar + _FINAL + tile, 0)
            total = row_sum[row, tile]
            m_ref = row_max[row, tile]
            cute.arch.mbarrier_wait(mbar + _O_DONE + tile, (n_blocks - 1) % 2)
            _tcgen05_fence_after_sync()
            if cutlass.const_expr(self.sinks):
                # Packed: the row's own query head (the group divides tile_m).
                sink_head = head
                if cutlass.const_expr(self.pack_gqa > 1):
                    sink_head = head * self.pack_gqa + row % self.pack_gqa
                inv, lse = finalize_with_sink(total, m_ref, self.scale_log2,
                                              mSinks[batch, sink_head] * LOG2_E)
            else:
                # A row without a visible key (sum 0) gets O = 0 and LSE = -inf.
                empty = total == 0.0 or total != total  # noqa: PLR0124 (NaN test)
                inv = Float32(0.0) if empty else cute.arch.rcp_approx(total)
            sO_i = sO[None, None, tile]
            row_global = (m_block * self.q_tiles + tile) * self.tile_m + row
            for k in cutlass.range_constexpr(n_chunks):
                cute.copy(thr_ld, self._o_chunk(tOsrc, tile, k), rO)
                cute.arch.fence_view_async_tmem_load()
                for j in cutlass.range_constexpr(0, cute.size(rO), 2):
                    rO[j], rO[j + 1] = cute.arch.mul_packed_f32x2((rO[j], rO[j + 1]), (inv, inv))
                if cutlass.const_expr(self.split_kv):
                    if row_global < seqlen_q:
                        for j in cutlass.range_constexpr(cute.size(rO)):
                            mO[row_global, k * chunk + tOcrd[j][1], head, batch] = rO[j]
                else:
                    rOh.store(rO.load().to(self.dtype))
                    # 16-byte vectors: 8 consecutive columns of a row stay contiguous
                    # under the 128-byte swizzle of sO.
                    sO_row = sO_i[row, None]
                    for g in cutlass.range_constexpr(chunk // 8):
                        cute.autovec_copy(
                            cute.make_tensor(rOh.iterator + 8 * g, cute.make_layout(8)),
                            cute.local_tile(sO_row, (8,), (k * (chunk // 8) + g,)),
                        )
            if cutlass.const_expr(not self.sinks):
                m_safe = Float32(0.0) if m_ref == -Float32.inf else m_ref
                log2_sum = cute.math.log2(Float32(1.0) if empty else total, fastmath=True)
                lse = -Float32.inf if empty else (m_safe * self.scale_log2 + log2_sum) * LN_2
            if row_global < seqlen_q:
                mLSE[row_global, head, batch] = lse
            # Generic-proxy SMEM writes must be visible to the TMA store.
            cute.arch.fence_view_async_shared()
            cute.arch.mbarrier_arrive(mbar + _O_SMEM + tile)
        cute.arch.fence_view_async_tmem_load()
        _tcgen05_fence_before_sync()
        tmem_free_bar.arrive()

    def _o_chunk(self, tensor: cute.Tensor, tile: int, k: int) -> cute.Tensor:
        """A (tile_m x 32)-column view of O_tile's TMEM, chunk k."""
        return cute.make_tensor(tensor.iterator + self._o_col(tile) + k * _O_CHUNK, tensor.layout)

    # -------------------------------------------------------------- epilogue
    @cute.jit
    def epilogue(
        self,
        mO: cute.Tensor,  # TMA view (Sq, Dv, Hq, B)
        sO: cute.Tensor,  # (tile_m, Dv, 2)
        tma_atom_O: cute.CopyAtom,
        mbar: cute.Pointer,
        m_block: Int32,
        head: Int32,
        batch: Int32,
    ):
        """Epilogue warp: one TMA store per O tile; TMA clips rows past seqlen_q."""
        gO = cute.local_tile(
            mO[None, None, head, batch], (self.tile_m, self.head_dim_v), (None, 0)
        )  # (tile_m, Dv, m tiles)
        tOsO, tOgO = tma_tile_partition(tma_atom_O, sO, gO)
        for tile in cutlass.range_constexpr(self.q_tiles):
            cute.arch.mbarrier_wait(mbar + _O_SMEM + tile, 0)
            cute.copy(tma_atom_O, tOsO[None, tile], tOgO[None, self.q_tiles * m_block + tile])
            cute.arch.cp_async_bulk_commit_group()
        # SMEM must outlive the TMA engine's reads of it.
        cute.arch.cp_async_bulk_wait_group(0, read=True)
