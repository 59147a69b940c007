"""Hopper (sm_90a) backward attention main kernel for head_dim = head_dim_v = 256.

Same contract as `FlashBwdSm90` (kernels/sm90_bwd.py), whose register-resident
design does not fit 256-wide heads. One CTA owns one key/value block (`tile_n` = 64
keys) of one kv head of one batch entry and walks every query block (`tile_m` = 64
queries) of every query head of its GQA group, so dK and dV stay in registers for
the whole walk (deterministic, no dK/dV atomics). dQ partials (sum over this CTA's
keys of dS K) are reduce-added into the fp32 accumulator by TMA.

Warp roles (384 threads):
  warpgroup 0   warp 0: TMA loads (K, V once; Q, dO, LSElog2 and Dpsum rows per
                        query block, one pipeline stage)
                warp 1: TMA reduce-add of the dQ partial tile into mdQaccum
                warps 2-3: idle (exit at once)
  warpgroups 1-2: the five GEMMs (wgmma) and the pointwise softmax backward

Per query block both MMA warpgroups compute (all operands from shared memory):
  S    = Q K^T,   P = exp2(S * scale * log2(e) - LSElog2)   (tile_m x tile_n)
  dP   = dO V^T,  dS = P * (dP - Dpsum)
         split along n: each warpgroup owns 32 of the 64 keys (m64n32 wgmma)
  dV^T += dO^T P  and  dK^T += Q^T dS                        (d x tile_n each)
         "dKV swapAB": M = head dim, split along M, warpgroup w owns head-dim rows
         [64w, 64w + 64) and [128 + 64w, 192 + 64w) (two m64 atoms) x 64 keys:
         2 x 64 fp32 accumulator registers
  dQ    = dS K                                               (tile_m x d)
         split along d, each warpgroup 64 x 128 (64 registers), written to an fp32
         SMEM tile that the dQ warp reduce-adds into mdQaccum
Per warpgroup and query block that is 16 + 16 + 8 + 8 + 4 = 52 wgmma instructions.

Order within one query block: S and dP issued together; P = exp2(...) (masked only
in blocks holding a key past seqlen_k or, causal, a key after some query) while dP
runs; P stored to SMEM with stmatrix (double buffered), barrier over both
warpgroups, dV^T issued; dS computed while dV^T runs; dS stored (single buffer),
barrier, dK^T then dQ issued; once dV^T and dK^T are done the Q/dO stage is
released, so the next block's load overlaps the dQ GEMM; then the dQ partial goes
to the dQ warp through SMEM (Note [dQ SMEM addresses]).

Note [Wide shared memory]: Q, dO, K and V tiles are 32 KiB each at d = 256, the
fp32 dQ tile 64 KiB, P 2 x 8 KiB, dS 8 KiB: 216 KiB plus 1 KiB of barriers and row
statistics (222208 bytes), within the 227 KiB a CTA may use. A second Q/dO stage
(+64 KiB, or +32 KiB for Q alone) does not fit, so each block's Q/dO load is
exposed except for the overlap with the previous block's dQ GEMM and hand-off.

Note [P/dS buffers]: every warpgroup reads all of P (dV^T) and all of dS (dK^T and
dQ), and each writes only its own 32 columns, so a barrier over both warpgroups
separates writes from reads. For the write-after-read side: warpgroup w finishes
all GEMMs of query block i-1 (wait_group(0)) before it arrives at the P barrier of
block i. dS of block i is written after that barrier, so one dS buffer suffices.
P of block i is written before it, while the other warpgroup may still run dV^T of
block i-1 (which reads P of i-1): P alternates between two buffers, and the buffer
written in block i was last read by dV^T of block i-2, finished before either
warpgroup passed the P barrier of block i-1.

Note [dQ SMEM addresses]: the fp32 dQ tile uses the 128-byte swizzle (TMA boxes of
64 x 32, conflict-free 64-bit stores from the accumulator). Through the generic
partition every one of a thread's 32 float2 stores gets its own swizzled address,
all hoisted out of the loop: 32 registers, and at 192 live accumulator registers
ptxas spilled. Within a 128-byte row a thread's four float2 sit in four different
16-byte chunks (four swizzle patterns); its other rows (+8) and column blocks (+32)
only change address bits the swizzle neither reads nor writes. So
`_store_dq_smem` swizzles four base offsets and stores everything else at
immediate offsets from them (checked for every thread and register by
tests/test_kernels_sm90_bwd_wide_compile.py).

Note [Tails without predicates]: TMA zero-fills Q/dO rows past seqlen_q and K/V
rows past seqlen_k. The LSElog2 / Dpsum workspaces have Sq_pad rows, the ones past
seqlen_q set to +inf / 0 by the preprocess kernel, so P = exp2(-inf) = 0 there and
with it dS = 0: those queries add exact zeros to dV, dK and to the padding rows of
dQaccum (whose Sq_pad rows keep every 64-row reduce in bounds). Keys past seqlen_k
(and, causal, keys after the query) get S = -inf, hence P = 0, in the blocks that
contain any; their dK/dV rows are never stored (predicated epilogue).
"""

import logging
import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from jax_fa4.kernels.bwd_preprocess import SEQLEN_Q_PAD
from jax_fa4.kernels.cute_utils import (
    init_bwd_kernel,
    pdl_start,
    permute,
    sm90_smem_layout,
    transpose_smem,
    wgmma_gemm,
)
from jax_fa4.kernels.sm90_bwd_common import Sm90BwdCommon
from jax_fa4.kernels.softmax import acc_mn_view

log = logging.getLogger(__name__)

LOG2_E = math.log2(math.e)


# Named hardware barriers (0 is __syncthreads).
_BAR_P = 1  # both MMA warpgroups: P of this query block is in SMEM
_BAR_DS = 2  # both MMA warpgroups: dS of this query block is in SMEM
# The dQ hand-off (Sm90BwdCommon): FlashBwdSm90Wide.bar_dq_full = 3, bar_dq_empty = 4.


@dataclass(frozen=True)
class BwdTilesWide:
    """Tuning knobs of the wide backward kernel; field names match sm90_bwd.BwdTiles
    so either may be passed as `tiles`. Only the values below fit in SMEM."""

    tile_m: int = 64  # query rows per block
    tile_n: int = 64  # key rows per CTA (32 per MMA warpgroup in S and dP)
    stages_qdo: int = 1  # Q/dO/LSE/Dpsum SMEM pipeline depth
    regs_producer: int = 24  # setmaxnreg for the load/store warpgroup
    regs_mma: int = 240  # setmaxnreg for each MMA warpgroup


def bwd_tiles_wide(head_dim: int, causal: bool) -> BwdTilesWide:
    """FA3's sm90 hdim-256 backward tiles: 64 x 64, one Q/dO stage."""
    del causal  # same tiles; causal skips whole blocks and masks the diagonal ones
    if head_dim != 256:
        raise ValueError(f"the wide sm90 backward supports head_dim 256, got {head_dim}")
    return BwdTilesWide()


# See Note [dQ SMEM addresses]. In a thread's accumulator, register (e, i, jp + 4 jj)
# is row r0 + 8 i, column c0 + 8 jp + 32 jj + e of the tile; in the unswizzled
# (tile_m x d) fp32 layout (8 x 32 atoms, rows first) that is
# lin(r0, c0 + 8 jp) + e + 256 i + 2048 jj.
_DQ_REG_STRIDE = (1, 2, 16)  # registers of (e, i, jj) within one jp group
_DQ_SMEM_STRIDE = (1, 256, 2048)  # their fp32 offsets from the group's base


def swizzle128_f32(lin):
    """The 128-byte TMA / wgmma swizzle (bytes: bits 4-6 ^= bits 7-9) of an fp32
    offset from a 1024-byte aligned base; Python ints or DSL integers."""
    return lin ^ ((lin >> 3) & 0x1C)


@cute.jit
def _store_dq_smem(acc: cute.Tensor, tCcC: cute.Tensor, sdQ_base: cute.Pointer,
                   sdQ_layout: cute.ComposedLayout):
    """Write one warpgroup's fp32 dQ accumulator into the swizzled (tile_m x d) SMEM
    tile with 4 base addresses per thread instead of 32 (Note [dQ SMEM addresses]).

    acc: ((2, 2, V), 1, 1) wgmma accumulator; tCcC: its (row, col) coordinates;
    sdQ_base: the tile's plain (unswizzled) pointer, 1024-byte aligned.
    """
    outer = sdQ_layout.outer
    # The static structure the address arithmetic relies on; anything else fails
    # the compile instead of storing to the wrong place. (The DSL's swizzled SMEM
    # pointers apply `inner` to byte addresses, as TMA does.)
    assert str(tCcC.layout).startswith("((2,2,") and str(tCcC.layout).endswith(
        "),1,1):((1@1,8@0,8@1),0,0)"), tCcC.layout
    assert str(outer) == "((8,8),(32,8)):((32,256),(1,2048))", outer
    assert str(sdQ_layout.inner) == "S<3,4,3>", sdQ_layout.inner
    n_groups = cute.size(acc.shape[0][2])  # 8-column groups of this thread
    assert n_groups % 4 == 0
    src_layout = cute.make_layout((2, 2, n_groups // 4), stride=_DQ_REG_STRIDE)
    # None of the bits of these offsets is read or written by the swizzle.
    dst_layout = cute.make_layout((2, 2, n_groups // 4), stride=_DQ_SMEM_STRIDE)
    for jp in cutlass.range_constexpr(4):
        row, col = tCcC[4 * jp]
        off = swizzle128_f32(cute.crd2idx((row, col), outer))
        dst = cute.make_tensor(sdQ_base + cute.assume(off, divby=2), dst_layout)
        src = cute.make_tensor(acc.iterator + 4 * jp, src_layout)
        cute.autovec_copy(src, dst)


class FlashBwdSm90Wide(Sm90BwdCommon):
    """Backward main kernel for sm_90a at head dim 256; see the module docstring.

    Same constructor and call signature as `FlashBwdSm90`.

    Args:
      dtype: cutlass.BFloat16 or cutlass.Float16 (Q, K, V, dO, dK, dV).
      head_dim, head_dim_v: 256, equal.
      causal: top-left causal mask (query i sees key j <= i).
      softmax_scale: scale applied to Q K^T.
      tiles: BwdTilesWide (or an object with the same fields); only the defaults fit.
    """

    bar_dq_full = 3
    bar_dq_empty = 4

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        head_dim_v: int | None = None,
        causal: bool = False,
        softmax_scale: float | None = None,
        tiles: BwdTilesWide | None = None,
        use_pdl: bool = False,
    ):
        init_bwd_kernel(self, "the wide sm90 backward", dtype, head_dim, head_dim_v, (256,), causal,
                        softmax_scale)
        # Launched with programmatic dependent launch (``pdl_start``).
        self.use_pdl = use_pdl
        self.tiles = bwd_tiles_wide(head_dim, causal) if tiles is None else tiles
        t = self.tiles
        self.tile_m, self.tile_n = t.tile_m, t.tile_n
        if (self.tile_m, self.tile_n, t.stages_qdo) != (64, 64, 1):
            raise ValueError(f"the wide sm90 backward needs tile_m = tile_n = 64 and one "
                             f"Q/dO stage (SMEM budget), got {t}")
        if SEQLEN_Q_PAD % self.tile_m:
            raise ValueError("tile_m must divide SEQLEN_Q_PAD")
        self.num_mma_wg = 2
        self.num_mma_threads = 128 * self.num_mma_wg
        self.num_threads = 128 + self.num_mma_threads
        log.debug("FlashBwdSm90Wide %s d=%d causal=%s tiles=%s", dtype, head_dim, causal, t)

    # ------------------------------------------------------------------ host side
    def _tiled_mmas(self):
        d, dv = self.head_dim, self.head_dim_v
        tm, tn = self.tile_m, self.tile_n
        wg = self.num_mma_wg
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        # S = Q K^T and dP = dO V^T (tile_m x tile_n): A = Q / dO (tile_m x d) and
        # B = K / V (tile_n x d), K-major as stored; warpgroups side by side along n.
        mma_sdp = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, (1, wg, 1), (tm, tn // wg))
        # dV^T = dO^T P and dK^T = Q^T dS (d x tile_n, reduced over tile_m):
        # A = dO^T / Q^T (d x tile_m, d contiguous: MN-major), B[n, m] = P[m, n] /
        # dS[m, n] (n contiguous: MN-major); warpgroups stacked along d.
        mma_dkv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN, MN, Float32, (wg, 1, 1), (64, tn))
        assert d == dv
        # dQ = dS K (tile_m x d, reduced over tile_n): A = dS (K-major as stored),
        # B[d, n] = K[n, d] (d contiguous: MN-major); warpgroups side by side along d.
        mma_dq = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, MN, Float32, (1, wg, 1), (tm, d // wg))
        return mma_sdp, mma_dkv, mma_dq

    @cute.jit
    def __call__(
        self,
        stream,
        mQ: cute.Tensor,  # (B, Sq, Hq, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D)
        mV: cute.Tensor,  # (B, Sk, Hkv, Dv)
        mdO: cute.Tensor,  # (B, Sq, Hq, Dv)
        mLSElog2: cute.Tensor,  # (B, Hq, Sq_pad) f32, LSE * log2(e); +inf past Sq
        mDpsum: cute.Tensor,  # (B, Hq, Sq_pad) f32, rowsum(dO * O) - dLSE; 0 past Sq
        mdQaccum: cute.Tensor,  # (B, Hq, Sq_pad, D) f32, accumulated in place
        mdK: cute.Tensor,  # (B, Sk, Hkv, D)
        mdV: cute.Tensor,  # (B, Sk, Hkv, Dv)
    ):
        d = self.head_dim
        tm, tn = self.tile_m, self.tile_n
        st = self.tiles.stages_qdo
        mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV = self.operand_views(
            mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV)

        mma_sdp, mma_dkv, mma_dq = self._tiled_mmas()

        sQ_layout, sdO_layout, sK_layout, sV_layout, sRow_layout, row_stage = (
            self.load_layouts())
        # P (tile_m x tile_n, keys contiguous), double buffered; dS single
        # (Note [P/dS buffers]).
        sP_layout = sm90_smem_layout(self.dtype, tm, tn, 2)
        sdS_layout = sm90_smem_layout(self.dtype, tm, tn, None)
        sdQ_layout = sm90_smem_layout(Float32, tm, d, None)

        ((tma_Q, gmem_Q), (tma_K, gmem_K), (tma_V, gmem_V), (tma_dO, gmem_dO),
         (tma_LSE, gmem_LSE), (tma_Dpsum, gmem_Dpsum)), bytes_qdo, bytes_kv = self.load_atoms(
            mQ, mK, mV, mdO, mLSElog2, mDpsum, sQ_layout, sdO_layout, sK_layout, sV_layout)
        # The 128-byte swizzle of the fp32 tile makes this 8 boxes of 64 x 32.
        tma_dQ, gmem_dQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), mdQaccum, sdQ_layout, (tm, d))

        @cute.struct
        class SharedStorage:
            mbar_qdo: cute.struct.MemRange[cutlass.Int64, 2 * st]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, row_stage * st], 128]
            sDpsum: cute.struct.Align[cute.struct.MemRange[Float32, row_stage * st], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]
            sdS: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]

        self.check_smem(SharedStorage)

        num_n_blocks = cute.ceil_div(mK.shape[0], tn)
        grid = (num_n_blocks, cute.size(mK.shape[2]), cute.size(mK.shape[3]))
        self.kernel(
            gmem_Q, gmem_K, gmem_V, gmem_dO, gmem_LSE, gmem_Dpsum, gmem_dQ, mdK, mdV,
            tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_Dpsum, tma_dQ,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sP_layout, sdS_layout, sdQ_layout,
            sRow_layout, mma_sdp, mma_dkv, mma_dq, bytes_qdo, bytes_kv, SharedStorage,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
            use_pdl=self.use_pdl,
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA view (Sq, D, Hq, B)
        mK: cute.Tensor,  # TMA view (Sk, D, Hkv, B)
        mV: cute.Tensor,  # TMA view (Sk, Dv, Hkv, B)
        mdO: cute.Tensor,  # TMA view (Sq, Dv, Hq, B)
        mLSElog2: cute.Tensor,  # TMA view (Sq_pad, Hq, B) f32
        mDpsum: cute.Tensor,  # TMA view (Sq_pad, Hq, B) f32
        mdQaccum: cute.Tensor,  # TMA view (Sq_pad, D, Hq, B) f32
        mdK: cute.Tensor,  # (Sk, D, Hkv, B)
        mdV: cute.Tensor,  # (Sk, Dv, Hkv, B)
        tma_Q: cute.CopyAtom,
        tma_K: cute.CopyAtom,
        tma_V: cute.CopyAtom,
        tma_dO: cute.CopyAtom,
        tma_LSE: cute.CopyAtom,
        tma_Dpsum: cute.CopyAtom,
        tma_dQ: cute.CopyAtom,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.ComposedLayout,
        sRow_layout: cute.Layout,
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        bytes_qdo: cutlass.Constexpr[int],
        bytes_kv: cutlass.Constexpr[int],
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head_kv, batch = cute.arch.block_idx()

        if warp_idx == 0:
            for atom in (tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_Dpsum, tma_dQ):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)

        pipe_qdo, pipe_kv = self.make_pipelines(storage, bytes_qdo, bytes_kv)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
        sLSE = storage.sLSE.get_tensor(sRow_layout)
        sDpsum = storage.sDpsum.get_tensor(sRow_layout)

        # Everything above only set up SMEM and barriers: no global memory yet.
        pdl_start(self.use_pdl)
        seqlen_k = mK.shape[0]
        group, m_block_min, num_m, num_iters = self.work_list(n_block, mQ, mK)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.tiles.regs_producer)
            if warp_idx == 0:
                self.load(mQ, mK, mV, mdO, mLSElog2, mDpsum, sQ, sK, sV, sdO, sLSE, sDpsum,
                          tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_Dpsum,
                          pipe_qdo, pipe_kv, n_block, head_kv, batch, group,
                          m_block_min, num_m, num_iters)
            if warp_idx == 1:
                self.store_dq_joint(mdQaccum, sdQ, tma_dQ, head_kv, batch, group,
                                    m_block_min, num_m, num_iters)
        else:
            cute.arch.setmaxregister_increase(self.tiles.regs_mma)
            self.mma(mdK, mdV, sQ, sK, sV, sdO, sP, sdS, storage.sdQ.data_ptr(), sdQ_layout,
                     sLSE, sDpsum,
                     mma_sdp, mma_dkv, mma_dq, pipe_qdo, pipe_kv,
                     tidx - 128, n_block, head_kv, batch, seqlen_k,
                     m_block_min, num_m, num_iters)

    @cute.jit
    def mma(self, mdK, mdV, sQ, sK, sV, sdO, sP, sdS, sdQ_base, sdQ_layout, sLSE, sDpsum,
            mma_sdp, mma_dkv, mma_dq, pipe_qdo, pipe_kv,
            tidx, n_block, head_kv, batch, seqlen_k, m_block_min, num_m, num_iters):
        """MMA warpgroups: all GEMMs and the pointwise math; dK/dV epilogue."""
        tm, tn = self.tile_m, self.tile_n
        d, dv = self.head_dim, self.head_dim_v
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        wg_slice = wg_idx * 128
        scale_log2 = self.softmax_scale * LOG2_E

        # wgmma A/B operands are partitioned per warpgroup; C per thread.
        thr_sdp = mma_sdp.get_slice(tidx)
        wg_sdp = mma_sdp.get_slice(wg_slice)
        wg_dkv = mma_dkv.get_slice(wg_slice)
        wg_dq = mma_dq.get_slice(wg_slice)
        thr_dkv = mma_dkv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)

        # S = Q K^T and dP = dO V^T.
        tSrQ = mma_sdp.make_fragment_A(wg_sdp.partition_A(sQ))
        tSrK = mma_sdp.make_fragment_B(wg_sdp.partition_B(sK))
        tdPrdO = mma_sdp.make_fragment_A(wg_sdp.partition_A(sdO))
        tdPrV = mma_sdp.make_fragment_B(wg_sdp.partition_B(sV))
        # dV^T = dO^T P: A = dO^T (dv x tile_m), B = P^T (tile_n x tile_m), MN-major.
        tdVrdOt = mma_dkv.make_fragment_A(wg_dkv.partition_A(transpose_smem(sdO)))
        tdVrPt = mma_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(sP)))
        # dK^T = Q^T dS: A = Q^T (d x tile_m), B = dS^T (tile_n x tile_m), MN-major.
        tdKrQt = mma_dkv.make_fragment_A(wg_dkv.partition_A(transpose_smem(sQ)))
        tdKrdSt = mma_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(sdS)))
        # dQ = dS K: A = dS (tile_m x tile_n) K-major, B = K^T (d x tile_n) MN-major.
        tdQrdS = mma_dq.make_fragment_A(wg_dq.partition_A(sdS))
        tdQrKt = mma_dq.make_fragment_B(wg_dq.partition_B(transpose_smem(sK)))

        acc_dKt = cute.make_rmem_tensor(thr_dkv.partition_shape_C((d, tn)), Float32)
        acc_dVt = cute.make_rmem_tensor(thr_dkv.partition_shape_C((dv, tn)), Float32)
        acc_dKt.fill(0.0)
        acc_dVt.fill(0.0)

        # (query, key) of each accumulator element of S, as (rows, cols).
        tScS = acc_mn_view(thr_sdp.partition_C(cute.make_identity_tensor((tm, tn))))
        n_rows = cute.size(tScS, mode=[0])
        n_cols = cute.size(tScS, mode=[1])
        # P and dS go to SMEM with stmatrix: 4 8x8 matrices per instruction.
        stsm = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        copy_pds = cute.make_tiled_copy_C(stsm, mma_sdp)
        thr_copy_pds = copy_pds.get_slice(tidx)
        tPsP = thr_copy_pds.partition_D(sP)
        tdSsdS = thr_copy_pds.partition_D(sdS)
        tdQcdQ = thr_dq.partition_C(cute.make_identity_tensor((tm, d)))

        p_bar = pipeline.NamedBarrier(barrier_id=_BAR_P, num_threads=self.num_mma_threads)
        ds_bar = pipeline.NamedBarrier(barrier_id=_BAR_DS, num_threads=self.num_mma_threads)
        dq_threads = self.num_mma_threads + 32
        key_limit = seqlen_k - n_block * tn

        if num_iters > 0:
            pipe_kv.consumer_wait(
                pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))

        state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer, self.tiles.stages_qdo)
        for it in cutlass.range(num_iters, unroll=1):
            _, m_block = self.work_item(it, head_kv, 0, m_block_min, num_m)
            stage = state.index
            buf = it % 2

            pipe_qdo.consumer_wait(state)
            acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((tm, tn)), Float32)
            wgmma_gemm(mma_sdp, acc_S, tSrQ[None, None, None, stage], tSrK, zero_init=True)
            acc_dP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((tm, tn)), Float32)
            wgmma_gemm(mma_sdp, acc_dP, tdPrdO[None, None, None, stage], tdPrV, zero_init=True)

            # Row statistics of this thread's queries (+inf / 0 on padding rows).
            lse = cute.make_rmem_tensor((n_rows,), Float32)
            dpsum = cute.make_rmem_tensor((n_rows,), Float32)
            for r in cutlass.range_constexpr(n_rows):
                lse[r] = sLSE[tScS[r, 0][0], stage]
                dpsum[r] = sDpsum[tScS[r, 0][0], stage]
            warpgroup.wait_group(1)  # S done

            # Keys past seqlen_k and (causal) keys after the query: S = -inf. Valid
            # is key < min(key_limit, query + causal_off) in block coordinates; the
            # block's first query has the smallest causal limit, so only blocks
            # where that limit is below tile_n pay for the test.
            S = acc_mn_view(acc_S)
            causal_off = m_block * tm - n_block * tn + 1
            first_limit = key_limit
            if const_expr(self.causal):
                first_limit = cutlass.min(key_limit, causal_off)
            if first_limit < tn:
                for r in cutlass.range_constexpr(n_rows):
                    limit = key_limit
                    if const_expr(self.causal):
                        limit = cutlass.min(limit, tScS[r, 0][0] + causal_off)
                    for c in cutlass.range_constexpr(n_cols):
                        S[r, c] = S[r, c] if tScS[r, c][1] < limit else -Float32.inf
            # P = exp2(S * scale * log2 e - LSElog2[query]); exp2(-inf) = 0.
            for r in cutlass.range_constexpr(n_rows):
                for c in cutlass.range_constexpr(n_cols):
                    S[r, c] = cute.math.exp2(S[r, c] * scale_log2 - lse[r], fastmath=True)
            rP = cute.make_fragment_like(acc_S, self.dtype)
            rP.store(acc_S.load().to(self.dtype))
            # P to its buffer `buf` (Note [P/dS buffers]); generic-proxy SMEM writes
            # must be made visible to the async proxy (wgmma) before the barrier.
            cute.copy(copy_pds, thr_copy_pds.retile(rP), tPsP[None, None, None, buf])
            cute.arch.fence_view_async_shared()
            p_bar.arrive_and_wait()
            # dV^T runs on the tensor cores while dS is computed.
            wgmma_gemm(mma_dkv, acc_dVt, tdVrdOt[None, None, None, stage],
                  tdVrPt[None, None, None, buf], zero_init=False)
            warpgroup.wait_group(1)  # dP done (dV^T may still run)

            dP = acc_mn_view(acc_dP)
            for r in cutlass.range_constexpr(n_rows):
                for c in cutlass.range_constexpr(n_cols):
                    dP[r, c] = S[r, c] * (dP[r, c] - dpsum[r])
            rdS = cute.make_fragment_like(acc_dP, self.dtype)
            rdS.store(acc_dP.load().to(self.dtype))
            # Every reader of the previous dS finished before its warpgroup arrived
            # at p_bar above (Note [P/dS buffers]).
            cute.copy(copy_pds, thr_copy_pds.retile(rdS), tdSsdS)
            cute.arch.fence_view_async_shared()
            ds_bar.arrive_and_wait()

            # dK^T before dQ: Q and dO are then free as soon as dK^T is done, so the
            # next block's Q/dO load overlaps the dQ GEMM and its SMEM hand-off.
            wgmma_gemm(mma_dkv, acc_dKt, tdKrQt[None, None, None, stage], tdKrdSt,
                  zero_init=False)
            acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((tm, d)), Float32)
            wgmma_gemm(mma_dq, acc_dQ, tdQrdS, tdQrKt, zero_init=True)

            warpgroup.wait_group(1)  # dV^T and dK^T done: nothing reads this stage
            pipe_qdo.consumer_release(state)
            warpgroup.wait_group(0)  # dQ done
            cute.arch.barrier(barrier_id=self.bar_dq_empty, number_of_threads=dq_threads)
            _store_dq_smem(acc_dQ, tdQcdQ, sdQ_base, sdQ_layout)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=self.bar_dq_full, number_of_threads=dq_threads)
            state.advance()
        self.store_acc_t(acc_dKt, mdK, thr_dkv, d, self.softmax_scale, n_block, head_kv,
                         batch, seqlen_k)
        self.store_acc_t(acc_dVt, mdV, thr_dkv, dv, 1.0, n_block, head_kv, batch, seqlen_k)

    @cute.jit
    def store_acc_t(self, acc_t, mX, thr, width: cutlass.Constexpr[int],
                    scale: cutlass.Constexpr[float], n_block, head_kv, batch, seqlen_k):
        """dK = scale * (sum Q^T dS)^T and dV = (sum dO^T P)^T from the transposed
        (width x tile_n) accumulators straight to global memory; keys past seqlen_k
        are not stored."""
        tn = self.tile_n
        gX = cute.local_tile(mX[None, None, head_kv, batch], (tn, width), (n_block, 0))
        tXgX = thr.partition_C(permute(gX, [1, 0]))  # (width, tile_n) view of the rows
        tXcX = thr.partition_C(cute.make_identity_tensor((width, tn)))
        rX = cute.make_fragment_like(acc_t, self.dtype)
        if const_expr(scale != 1.0):
            rX.store((acc_t.load() * scale).to(self.dtype))
        else:
            rX.store(acc_t.load().to(self.dtype))
        key_limit = seqlen_k - n_block * tn
        for i in cutlass.range_constexpr(cute.size(rX)):
            if tXcX[i][1] < key_limit:
                tXgX[i] = rX[i]
