"""Hopper (sm_90a) backward attention main kernel: dK, dV and the fp32 dQ accumulator.

One CTA owns one key/value block (`tile_n` keys) of one kv head of one batch entry
and walks every query block of every query head of its GQA group, so dK and dV
stay in registers for the whole walk (deterministic, no dK/dV atomics). dQ
partials (sum over this CTA's keys of dS K) are reduce-added into the fp32
accumulator by TMA.

Warp roles (384 threads):
  warpgroup 0   warp 0: TMA loads (K, V once; Q and dO per query block)
                warp 1: TMA reduce-add of the dQ partial tile into mdQaccum
  warpgroups 1-2: the five GEMMs (wgmma) and the pointwise softmax backward

Per query block, both MMA warpgroups together compute
  S  = Q K^T,   P = exp2(S * scale * log2(e) - LSElog2)      (tile_m x tile_n)
  dP = dO V^T,  dS = P * (dP - Dpsum)
  dV += P^T dO, dK += dS^T Q,  dQ_partial = dS K
with P and dS staged through shared memory in the input dtype, because dV, dK and
dQ read them as the A operand in transposed and plain orientation.

Order within one query block (overlap_dv, the default): S and dP issued together;
P = exp2(...) while dP runs; each warpgroup stores its own 64 columns of P and
issues its dV GEMM at once (it reads only those columns), then computes dS while
dV runs; after a barrier over both warpgroups, dQ (first, so its SMEM hand-off to
the dQ warp overlaps the rest) and dK.

Note [Tails without predicates]: TMA zero-fills Q/dO rows past seqlen_q and K/V
rows past seqlen_k. Rows past seqlen_q get LSElog2 = +inf, so P = exp2(-inf) = 0
and with it dS = 0: they add exact zeros to dV, dK and to the padding rows of
dQaccum (whose Sq_pad rows make each 64-row tile reduce in bounds). Columns past
seqlen_k (and right of the causal diagonal) are set to P = 0 explicitly; their
dK/dV rows are never stored (predicated epilogue).
"""

import logging
import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from jax_fa4.kernels.cute_utils import permute, sm90_smem_layout, transpose_smem

log = logging.getLogger(__name__)

LOG2_E = math.log2(math.e)

# Named hardware barriers (0 is __syncthreads).
_BAR_PDS = 1  # both MMA warpgroups: P/dS fully written, or fully consumed
_BAR_DQ_FULL = 2  # MMA warpgroups -> dQ warp: the dQ partial tile is in SMEM
_BAR_DQ_EMPTY = 3  # dQ warp -> MMA warpgroups: the dQ SMEM tile may be overwritten
_BAR_P_WG0 = 4  # (4, 5) one MMA warpgroup: its columns of P are in SMEM


@dataclass(frozen=True)
class BwdTiles:
    """Tuning knobs of the sm90 backward kernel (one row of the table below)."""

    tile_m: int  # query rows per block
    tile_n: int  # key rows per CTA
    stages_qdo: int  # Q/dO SMEM pipeline depth
    regs_producer: int  # setmaxnreg for the load/store warpgroup
    regs_mma: int  # setmaxnreg for each MMA warpgroup
    overlap_dv: bool = True  # issue dV = P^T dO before computing dS (needs tile_m == 64)


def bwd_tiles(head_dim: int, causal: bool) -> BwdTiles:
    """The tile table, keyed by head dim (FA3's sm90 backward choices, adapted)."""
    del causal  # same tiles for now; causal skips blocks instead
    if head_dim <= 64:
        return BwdTiles(tile_m=64, tile_n=128, stages_qdo=2, regs_producer=24, regs_mma=240)
    if head_dim <= 128:
        return BwdTiles(tile_m=64, tile_n=128, stages_qdo=2, regs_producer=24, regs_mma=240)
    raise ValueError(f"sm90 backward supports head_dim 64 and 128, got {head_dim}")








def _rows_cols(t: cute.Tensor) -> cute.Tensor:
    """View an sm90 accumulator partition ((2, 2, V), MMA_M, MMA_N) as (rows, cols).

    In a wgmma accumulator the second `2` steps 8 rows and MMA_M steps 64 rows;
    the first `2`, V and MMA_N step columns."""
    idx = cute.make_layout(t.layout.shape)
    shp, std = idx.shape, idx.stride
    mn = cute.make_layout(
        ((shp[0][1], shp[1]), (shp[0][0], shp[0][2], shp[2])),
        stride=((std[0][1], std[1]), (std[0][0], std[0][2], std[2])),
    )
    return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))


@cute.jit
def _gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
          zero_init: cutlass.Constexpr[bool]):
    """Issue one warpgroup GEMM over the whole K extent of the fragments and commit it."""
    warpgroup.fence()
    # A fresh atom per call: its ACCUMULATE field is mutated below.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


class FlashBwdSm90:
    """Backward main kernel for sm_90a; see the module docstring and docs/design.md.

    Args:
      dtype: cutlass.BFloat16 or cutlass.Float16 (Q, K, V, dO, dK, dV).
      head_dim, head_dim_v: 64 or 128, equal.
      causal: top-left causal mask (query i sees key j <= i).
      softmax_scale: scale applied to Q K^T.
    """

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        head_dim_v: int | None = None,
        causal: bool = False,
        softmax_scale: float | None = None,
        tiles: BwdTiles | None = None,
    ):
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"sm90 backward needs bf16 or fp16, got {dtype}")
        if head_dim != head_dim_v or head_dim not in (64, 128):
            raise ValueError(f"sm90 backward needs head_dim == head_dim_v in (64, 128), "
                             f"got {head_dim}, {head_dim_v}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.softmax_scale = (1.0 / math.sqrt(head_dim) if softmax_scale is None
                              else float(softmax_scale))
        self.tiles = bwd_tiles(head_dim, causal) if tiles is None else tiles
        t = self.tiles
        self.tile_m, self.tile_n = t.tile_m, t.tile_n
        self.num_mma_wg = 2
        self.num_mma_threads = 128 * self.num_mma_wg
        self.num_threads = 128 + self.num_mma_threads
        # How the two MMA warpgroups split each GEMM's output tile.
        # S/dP (tile_m x tile_n): along m when there are two 64-row atoms, else along n.
        self.wg_m_sdp = min(self.tile_m // 64, self.num_mma_wg)
        # dK/dV (tile_n x d): along n (each warpgroup owns 64 keys).
        self.wg_n_dkv = self.num_mma_wg
        # dQ (tile_m x d): like S.
        self.wg_m_dq = self.wg_m_sdp
        assert self.tile_n == 64 * self.wg_n_dkv
        # overlap_dv relies on warpgroup w owning S columns [64w, 64w + 64), which
        # are exactly the P^T rows of its dV tile.
        assert not t.overlap_dv or self.wg_m_sdp == 1
        log.debug("FlashBwdSm90 %s d=%d causal=%s tiles=%s", dtype, head_dim, causal, t)

    # ------------------------------------------------------------------ host side
    def _tiled_mmas(self):
        d, dv = self.head_dim, self.head_dim_v
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        wg_n_sdp = self.num_mma_wg // self.wg_m_sdp
        mma_sdp = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, (self.wg_m_sdp, wg_n_sdp, 1),
            (64, self.tile_n // wg_n_sdp))
        mma_dk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN, MN, Float32, (self.wg_n_dkv, 1, 1), (64, d))
        mma_dv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN, MN, Float32, (self.wg_n_dkv, 1, 1), (64, dv))
        wg_n_dq = self.num_mma_wg // self.wg_m_dq
        mma_dq = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, MN, Float32, (self.wg_m_dq, wg_n_dq, 1),
            (64, d // wg_n_dq))
        return mma_sdp, mma_dk, mma_dv, mma_dq

    @cute.jit
    def __call__(
        self,
        stream,
        mQ: cute.Tensor,  # (B, Sq, Hq, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D)
        mV: cute.Tensor,  # (B, Sk, Hkv, Dv)
        mdO: cute.Tensor,  # (B, Sq, Hq, Dv)
        mLSElog2: cute.Tensor,  # (B, Hq, Sq) f32, LSE * log2(e)
        mDpsum: cute.Tensor,  # (B, Hq, Sq) f32, rowsum(dO * O) - dLSE
        mdQaccum: cute.Tensor,  # (B, Hq, Sq_pad, D) f32, accumulated in place
        mdK: cute.Tensor,  # (B, Sk, Hkv, D)
        mdV: cute.Tensor,  # (B, Sk, Hkv, Dv)
    ):
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type
                           == mdO.element_type == mdK.element_type == mdV.element_type
                           == self.dtype)):
            raise TypeError("Q, K, V, dO, dK, dV must all have the kernel's dtype")
        if const_expr(not (mLSElog2.element_type == mDpsum.element_type
                           == mdQaccum.element_type == Float32)):
            raise TypeError("LSElog2, Dpsum and dQaccum must be float32")
        d, dv = self.head_dim, self.head_dim_v
        tm, tn = self.tile_m, self.tile_n
        st = self.tiles.stages_qdo

        # (S, D, H, B) views: sequence and head dim first, as the TMA tiles see them.
        mQ, mK, mV, mdO, mdK, mdV = [permute(t, [1, 3, 2, 0])
                                     for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mdQaccum = permute(mdQaccum, [2, 3, 1, 0])  # (Sq_pad, D, Hq, B)

        mma_sdp, mma_dk, mma_dv, mma_dq = self._tiled_mmas()

        sQ_layout = sm90_smem_layout(self.dtype, tm, d, st)
        sdO_layout = sm90_smem_layout(self.dtype, tm, dv, st)
        sK_layout = sm90_smem_layout(self.dtype, tn, d, None)
        sV_layout = sm90_smem_layout(self.dtype, tn, dv, None)
        sPdS_layout = sm90_smem_layout(self.dtype, tm, tn, None)
        sdQ_layout = sm90_smem_layout(Float32, tm, d, None)

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_Q, gmem_Q = cpasync.make_tiled_tma_atom(
            tma_load, mQ, cute.select(sQ_layout, mode=[0, 1]), (tm, d))
        tma_dO, gmem_dO = cpasync.make_tiled_tma_atom(
            tma_load, mdO, cute.select(sdO_layout, mode=[0, 1]), (tm, dv))
        tma_K, gmem_K = cpasync.make_tiled_tma_atom(tma_load, mK, sK_layout, (tn, d))
        tma_V, gmem_V = cpasync.make_tiled_tma_atom(tma_load, mV, sV_layout, (tn, dv))
        tma_dQ, gmem_dQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), mdQaccum, sdQ_layout, (tm, d))

        bytes_qdo = (cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1]))
                     + cute.size_in_bytes(self.dtype, cute.select(sdO_layout, mode=[0, 1])))
        bytes_kv = (cute.size_in_bytes(self.dtype, sK_layout)
                    + cute.size_in_bytes(self.dtype, sV_layout))

        @cute.struct
        class SharedStorage:
            mbar_qdo: cute.struct.MemRange[cutlass.Int64, 2 * st]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sP: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sdS: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]

        num_n_blocks = cute.ceil_div(mK.shape[0], tn)
        grid = (num_n_blocks, cute.size(mK.shape[2]), cute.size(mK.shape[3]))
        self.kernel(
            gmem_Q, gmem_K, gmem_V, gmem_dO, gmem_dQ, mLSElog2, mDpsum, mdK, mdV,
            tma_Q, tma_K, tma_V, tma_dO, tma_dQ,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout, sdQ_layout,
            mma_sdp, mma_dk, mma_dv, mma_dq, bytes_qdo, bytes_kv, SharedStorage,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA view (Sq, D, Hq, B)
        mK: cute.Tensor,  # TMA view (Sk, D, Hkv, B)
        mV: cute.Tensor,  # TMA view (Sk, Dv, Hkv, B)
        mdO: cute.Tensor,  # TMA view (Sq, Dv, Hq, B)
        mdQaccum: cute.Tensor,  # TMA view (Sq_pad, D, Hq, B) f32
        mLSElog2: cute.Tensor,  # (B, Hq, Sq) f32
        mDpsum: cute.Tensor,  # (B, Hq, Sq) f32
        mdK: cute.Tensor,  # (Sk, D, Hkv, B)
        mdV: cute.Tensor,  # (Sk, Dv, Hkv, B)
        tma_Q: cute.CopyAtom,
        tma_K: cute.CopyAtom,
        tma_V: cute.CopyAtom,
        tma_dO: cute.CopyAtom,
        tma_dQ: cute.CopyAtom,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sPdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.ComposedLayout,
        mma_sdp: cute.TiledMma,
        mma_dk: cute.TiledMma,
        mma_dv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        bytes_qdo: cutlass.Constexpr[int],
        bytes_kv: cutlass.Constexpr[int],
        SharedStorage: cutlass.Constexpr,
    ):
        tm, tn = self.tile_m, self.tile_n
        st = self.tiles.stages_qdo
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head_kv, batch = cute.arch.block_idx()

        if warp_idx == 0:
            for atom in (tma_Q, tma_K, tma_V, tma_dO, tma_dQ):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)

        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        # One arrive per consumer warp (the pipeline elects lane 0 of each warp).
        consumer_group = pipeline.CooperativeGroup(
            pipeline.Agent.Thread, self.num_mma_threads // 32)
        pipe_qdo = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_qdo.data_ptr(), num_stages=st,
            producer_group=producer_group, consumer_group=consumer_group,
            tx_count=bytes_qdo, defer_sync=True)
        pipe_kv = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1,
            producer_group=producer_group, consumer_group=consumer_group,
            tx_count=bytes_kv, defer_sync=False)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sP = storage.sP.get_tensor(sPdS_layout.outer, swizzle=sPdS_layout.inner)
        sdS = storage.sdS.get_tensor(sPdS_layout.outer, swizzle=sPdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)

        # The work list of this CTA: every (q head of the group, query block) pair
        # that can see at least one key of this block.
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        group = mQ.shape[2] // mK.shape[2]
        m_block_max = cute.ceil_div(seqlen_q, tm)
        m_block_min = Int32(0)
        if const_expr(self.causal):
            m_block_min = cutlass.min(n_block * tn // tm, m_block_max)
        num_m = m_block_max - m_block_min
        num_iters = num_m * group

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.tiles.regs_producer)
            if warp_idx == 0:
                self.load(mQ, mK, mV, mdO, sQ, sK, sV, sdO, tma_Q, tma_K, tma_V, tma_dO,
                          pipe_qdo, pipe_kv, n_block, head_kv, batch, group,
                          m_block_min, num_m, num_iters)
            if warp_idx == 1:
                self.store_dq(mdQaccum, sdQ, tma_dQ, head_kv, batch, group,
                              m_block_min, num_m, num_iters)
        else:
            cute.arch.setmaxregister_increase(self.tiles.regs_mma)
            self.mma(mLSElog2, mDpsum, mdK, mdV, sQ, sK, sV, sdO, sP, sdS, sdQ,
                     mma_sdp, mma_dk, mma_dv, mma_dq, pipe_qdo, pipe_kv,
                     tidx - 128, n_block, head_kv, batch, group, seqlen_q, seqlen_k,
                     m_block_min, num_m, num_iters)

    @cute.jit
    def load(self, mQ, mK, mV, mdO, sQ, sK, sV, sdO, tma_Q, tma_K, tma_V, tma_dO,
             pipe_qdo, pipe_kv, n_block, head_kv, batch, group, m_block_min, num_m,
             num_iters):
        """Warp 0: K and V of this block once, then Q and dO per work item."""
        tm, tn = self.tile_m, self.tile_n
        d, dv = self.head_dim, self.head_dim_v
        gK = cute.local_tile(mK[None, None, head_kv, batch], (tn, d), (n_block, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (tn, dv), (n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(
            tma_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
            cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(
            tma_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
            cute.group_modes(gV, 0, 2))
        if num_iters > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipe_kv.producer_acquire(kv_state)
            cute.copy(tma_K, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
            cute.copy(tma_V, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))

        state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, self.tiles.stages_qdo)
        for it in cutlass.range(num_iters, unroll=1):
            h_off = it // num_m
            m_block = m_block_min + it - h_off * num_m
            head_q = head_kv * group + h_off
            gQ = cute.local_tile(mQ[None, None, head_q, batch], (tm, d), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head_q, batch], (tm, dv), (None, 0))
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                cute.group_modes(gQ, 0, 2))
            tdOsdO, tdOgdO = cpasync.tma_partition(
                tma_dO, 0, cute.make_layout(1), cute.group_modes(sdO, 0, 2),
                cute.group_modes(gdO, 0, 2))
            pipe_qdo.producer_acquire(state)
            bar = pipe_qdo.producer_get_barrier(state)
            cute.copy(tma_Q, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=bar)
            cute.copy(tma_dO, tdOgdO[None, m_block], tdOsdO[None, state.index],
                      tma_bar_ptr=bar)
            state.advance()

    @cute.jit
    def store_dq(self, mdQaccum, sdQ, tma_dQ, head_kv, batch, group, m_block_min, num_m,
                 num_iters):
        """Warp 1: reduce-add each dQ partial tile from SMEM into mdQaccum (fp32)."""
        tm, d = self.tile_m, self.head_dim
        nthr = self.num_mma_threads + 32
        for it in cutlass.range(num_iters, unroll=1):
            h_off = it // num_m
            m_block = m_block_min + it - h_off * num_m
            head_q = head_kv * group + h_off
            gdQ = cute.local_tile(mdQaccum[None, None, head_q, batch], (tm, d), (None, 0))
            tsdQ, tgdQ = cpasync.tma_partition(
                tma_dQ, 0, cute.make_layout(1), cute.group_modes(sdQ, 0, 2),
                cute.group_modes(gdQ, 0, 2))
            # The SMEM tile is free (previous reduce has read it): let the MMA
            # warpgroups write the next partial.
            cute.arch.barrier_arrive(barrier_id=_BAR_DQ_EMPTY, number_of_threads=nthr)
            cute.arch.barrier(barrier_id=_BAR_DQ_FULL, number_of_threads=nthr)
            cute.copy(tma_dQ, tsdQ, tgdQ[None, m_block])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def mma(self, mLSElog2, mDpsum, mdK, mdV, sQ, sK, sV, sdO, sP, sdS, sdQ,
            mma_sdp, mma_dk, mma_dv, mma_dq, pipe_qdo, pipe_kv,
            tidx, n_block, head_kv, batch, group, seqlen_q, seqlen_k,
            m_block_min, num_m, num_iters):
        """MMA warpgroups: all GEMMs and the pointwise math; dK/dV epilogue."""
        tm, tn = self.tile_m, self.tile_n
        d, dv = self.head_dim, self.head_dim_v
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        wg_slice = wg_idx * 128
        scale_log2 = self.softmax_scale * LOG2_E

        # wgmma A/B operands are partitioned per warpgroup; C per thread.
        thr_sdp = mma_sdp.get_slice(tidx)
        wg_sdp = mma_sdp.get_slice(wg_slice)
        wg_dk = mma_dk.get_slice(wg_slice)
        wg_dv = mma_dv.get_slice(wg_slice)
        wg_dq = mma_dq.get_slice(wg_slice)
        thr_dk = mma_dk.get_slice(tidx)
        thr_dv = mma_dv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)

        # S = Q K^T and dP = dO V^T: A (tile_m x d) and B (tile_n x d) both K-major.
        tSrQ = mma_sdp.make_fragment_A(wg_sdp.partition_A(sQ))
        tSrK = mma_sdp.make_fragment_B(wg_sdp.partition_B(sK))
        tdPrdO = mma_sdp.make_fragment_A(wg_sdp.partition_A(sdO))
        tdPrV = mma_sdp.make_fragment_B(wg_sdp.partition_B(sV))
        # dV += P^T dO: A = P^T (tile_n x tile_m), B = dO^T (dv x tile_m), both MN-major.
        tdVrPt = mma_dv.make_fragment_A(wg_dv.partition_A(transpose_smem(sP)))
        tdVrdOt = mma_dv.make_fragment_B(wg_dv.partition_B(transpose_smem(sdO)))
        # dK += dS^T Q: A = dS^T (tile_n x tile_m), B = Q^T (d x tile_m), both MN-major.
        tdKrdSt = mma_dk.make_fragment_A(wg_dk.partition_A(transpose_smem(sdS)))
        tdKrQt = mma_dk.make_fragment_B(wg_dk.partition_B(transpose_smem(sQ)))
        # dQ = dS K: A = dS (tile_m x tile_n) K-major, B = K^T (d x tile_n) MN-major.
        tdQrdS = mma_dq.make_fragment_A(wg_dq.partition_A(sdS))
        tdQrKt = mma_dq.make_fragment_B(wg_dq.partition_B(transpose_smem(sK)))

        acc_dK = cute.make_rmem_tensor(thr_dk.partition_shape_C((tn, d)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_dv.partition_shape_C((tn, dv)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # Where each accumulator element of S lives in the (tile_m, tile_n) tile.
        tScS = _rows_cols(thr_sdp.partition_C(cute.make_identity_tensor((tm, tn))))
        # P and dS go to SMEM with stmatrix: 4 instructions and 1 address per thread
        # per tile instead of one 32-bit store (and one live address) per pair.
        stsm = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        copy_pds = cute.make_tiled_copy_C(stsm, mma_sdp)
        thr_copy_pds = copy_pds.get_slice(tidx)
        tPsP = thr_copy_pds.partition_D(sP)
        tdSsdS = thr_copy_pds.partition_D(sdS)
        tdQsdQ = thr_dq.partition_C(sdQ)
        n_rows = cute.size(tScS, mode=[0])
        n_cols = cute.size(tScS, mode=[1])

        pds_bar = pipeline.NamedBarrier(barrier_id=_BAR_PDS, num_threads=self.num_mma_threads)
        dq_threads = self.num_mma_threads + 32

        if num_iters > 0:
            pipe_kv.consumer_wait(
                pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))

        state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer, self.tiles.stages_qdo)
        for it in cutlass.range(num_iters, unroll=1):
            h_off = it // num_m
            m_block = m_block_min + it - h_off * num_m
            head_q = head_kv * group + h_off
            stage = state.index

            # Row statistics of this thread's rows; rows past seqlen_q get
            # LSE = +inf so that P (and with it dS, dV, dK, dQ) is exactly 0 there.
            lse = cute.make_rmem_tensor((n_rows,), Float32)
            dpsum = cute.make_rmem_tensor((n_rows,), Float32)
            for r in cutlass.range_constexpr(n_rows):
                row = m_block * tm + tScS[r, 0][0]
                lse[r] = Float32.inf
                dpsum[r] = Float32(0.0)
                if row < seqlen_q:
                    lse[r] = mLSElog2[batch, head_q, row]
                    dpsum[r] = mDpsum[batch, head_q, row]

            pipe_qdo.consumer_wait(state)
            acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((tm, tn)), Float32)
            _gemm(mma_sdp, acc_S, tSrQ[None, None, None, stage], tSrK, zero_init=True)
            acc_dP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((tm, tn)), Float32)
            _gemm(mma_sdp, acc_dP, tdPrdO[None, None, None, stage], tdPrV, zero_init=True)
            warpgroup.wait_group(1)  # S done

            # P = exp2(S * scale * log2 e - LSElog2), masked past seqlen_k and
            # (causal) right of the diagonal.
            S = _rows_cols(acc_S)
            for r in cutlass.range_constexpr(n_rows):
                col_limit = seqlen_k - n_block * tn
                if const_expr(self.causal):
                    col_limit = cutlass.min(
                        col_limit, m_block * tm + tScS[r, 0][0] + 1 - n_block * tn)
                for c in cutlass.range_constexpr(n_cols):
                    p = cute.math.exp2(S[r, c] * scale_log2 - lse[r], fastmath=True)
                    S[r, c] = p if tScS[r, c][1] < col_limit else Float32(0.0)

            rP = cute.make_fragment_like(acc_S, self.dtype)
            rP.store(acc_S.load().to(self.dtype))
            if const_expr(self.tiles.overlap_dv):
                # sP columns [64w, 64w + 64) are written and read (dV) only by
                # warpgroup w, whose previous dV finished last item: a warpgroup-local
                # barrier suffices, and dV runs on the tensor cores during dS below.
                cute.copy(copy_pds, thr_copy_pds.retile(rP), tPsP)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=_BAR_P_WG0 + wg_idx, number_of_threads=128)
                _gemm(mma_dv, acc_dV, tdVrPt, tdVrdOt[None, None, None, stage],
                      zero_init=False)
                warpgroup.wait_group(1)  # dP done (dV may still run)
            else:
                warpgroup.wait_group(0)  # dP done
            dP = _rows_cols(acc_dP)
            for r in cutlass.range_constexpr(n_rows):
                for c in cutlass.range_constexpr(n_cols):
                    dP[r, c] = S[r, c] * (dP[r, c] - dpsum[r])
            rdS = cute.make_fragment_like(acc_dP, self.dtype)
            rdS.store(acc_dP.load().to(self.dtype))
            # The previous work item's GEMMs in both warpgroups (dQ reads all of
            # sdS) must be done before sP/sdS are overwritten.
            pds_bar.arrive_and_wait()
            if const_expr(not self.tiles.overlap_dv):
                cute.copy(copy_pds, thr_copy_pds.retile(rP), tPsP)
            cute.copy(copy_pds, thr_copy_pds.retile(rdS), tdSsdS)
            # Generic-proxy SMEM writes must be visible to the async proxy (wgmma).
            cute.arch.fence_view_async_shared()
            pds_bar.arrive_and_wait()

            # dQ before dK (and dV): its SMEM hand-off to the dQ warp then overlaps
            # the GEMMs still running.
            acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((tm, d)), Float32)
            _gemm(mma_dq, acc_dQ, tdQrdS, tdQrKt, zero_init=True)
            if const_expr(not self.tiles.overlap_dv):
                _gemm(mma_dv, acc_dV, tdVrPt, tdVrdOt[None, None, None, stage],
                      zero_init=False)
            _gemm(mma_dk, acc_dK, tdKrdSt, tdKrQt[None, None, None, stage], zero_init=False)

            # dQ done; dK (and, without overlap_dv, dV) may still run.
            warpgroup.wait_group(1 if const_expr(self.tiles.overlap_dv) else 2)
            cute.arch.barrier(barrier_id=_BAR_DQ_EMPTY, number_of_threads=dq_threads)
            cute.autovec_copy(acc_dQ, tdQsdQ)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=_BAR_DQ_FULL, number_of_threads=dq_threads)

            warpgroup.wait_group(0)
            pipe_qdo.consumer_release(state)
            state.advance()
        self.store_dkv(acc_dK, acc_dV, mdK, mdV, thr_dk, thr_dv, n_block, head_kv, batch,
                       seqlen_k)

    @cute.jit
    def store_dkv(self, acc_dK, acc_dV, mdK, mdV, thr_dk, thr_dv, n_block, head_kv, batch,
                  seqlen_k):
        """dK = scale * sum dS^T Q and dV, straight from registers to global memory."""
        self.store_acc(acc_dK, mdK, thr_dk, self.head_dim, self.softmax_scale, n_block,
                       head_kv, batch, seqlen_k)
        self.store_acc(acc_dV, mdV, thr_dv, self.head_dim_v, 1.0, n_block, head_kv, batch,
                       seqlen_k)

    @cute.jit
    def store_acc(self, acc, mX, thr, width: cutlass.Constexpr[int],
                  scale: cutlass.Constexpr[float], n_block, head_kv, batch, seqlen_k):
        tn = self.tile_n
        gX = cute.local_tile(mX[None, None, head_kv, batch], (tn, width), (n_block, 0))
        tXgX = thr.partition_C(gX)
        tXcX = thr.partition_C(cute.make_identity_tensor((tn, width)))
        rX = cute.make_fragment_like(acc, self.dtype)
        if const_expr(scale != 1.0):
            rX.store((acc.load() * scale).to(self.dtype))
        else:
            rX.store(acc.load().to(self.dtype))
        row_limit = seqlen_k - n_block * tn
        for i in cutlass.range_constexpr(cute.size(rX)):
            if tXcX[i][0] < row_limit:
                tXgX[i] = rX[i]
