"""What the two sm90 backward main kernels share: their pipelines, the work list of
a CTA, the load warp, and the joint dQ hand-off.

`FlashBwdSm90` (kernels/sm90_bwd.py, hdim 64 and 128) and `FlashBwdSm90Wide`
(kernels/sm90_bwd_wide.py, hdim 256) differ in their MMA warpgroups only: both have
one CTA per (key block, kv head, batch entry), warp 0 loading K and V once and then
Q, dO, LSElog2 and Dpsum per (query head of the GQA group, query block), and warp 1
reduce-adding dQ partials into the fp32 accumulator with TMA.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from jax_fa4.kernels.bwd_preprocess import SEQLEN_Q_PAD
from jax_fa4.kernels.cute_utils import (
    check_bwd_operand_dtypes,
    permute,
    sm90_smem_layout,
    stat_rows_view,
    tma_tile_partition,
)

# The most dynamic shared memory one CTA may use on sm_90 (227 KiB).
SM90_MAX_SMEM_BYTES = 227 * 1024


def dq_mma_shape(tile_m: int, head_dim: int) -> tuple[int, int]:
    """The (M, N) of the sm90 backward's dQ GEMM: (tile_m, head_dim), or with a
    tile_m that is no multiple of 64 (head_dim, tile_m): it computes dQ^T."""
    return (head_dim, tile_m) if tile_m % 64 else (tile_m, head_dim)


def dq_tiled_mma(dtype, tile_m: int, head_dim: int, num_wg: int = 2) -> cute.TiledMma:
    """The tiled MMA of dQ = dS K (tile_m x head_dim, fp32 accumulator) in the sm90
    backward: one 64-row atom per warpgroup, split along m when tile_m has two,
    else along d. A = dS read from the dS^T buffer and B = K^T are both MN-major.
    A tile_m that is no multiple of 64 (80) computes dQ^T = K^T dS^T instead
    (``dq_mma_shape``): A = K^T MN-major, B = dS K-major, split along d.
    The postprocess rebuilds it to read the flat dQ accumulator back into the
    same register fragments (Note [Flat dQ accumulator] in dq_layout.py)."""
    import cutlass.utils.hopper_helpers as sm90_utils

    mn = cute.nvgpu.OperandMajorMode.MN
    if tile_m % 64:
        return sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, mn, cute.nvgpu.OperandMajorMode.K, Float32, (num_wg, 1, 1),
            (64, tile_m))
    wg_m = tile_m // 64
    wg_n = num_wg // wg_m
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, mn, mn, Float32, (wg_m, wg_n, 1), (64, head_dim // wg_n))


class Sm90BwdCommon:
    """Mixin for the sm90 backward kernels. Needs the attributes tile_m, tile_n,
    head_dim, head_dim_v, causal, num_mma_threads and tiles.stages_qdo, and the
    named-barrier ids bar_dq_full (MMA warpgroups -> dQ warp: the dQ partial tile is
    in SMEM) and bar_dq_empty (dQ warp -> MMA warpgroups: it may be overwritten)."""

    def operand_views(self, mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV):
        """Check the operands' dtypes and re-view them as the TMA tiles see them:
        (S, D, H, B) for the [B, S, H, D] tensors, (Sq_pad, D, Hq, B) for dQaccum,
        (Sq_pad, Hq, B) for the row statistics."""
        check_bwd_operand_dtypes(self, mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV)
        mQ, mK, mV, mdO, mdK, mdV = [permute(t, [1, 3, 2, 0])
                                     for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mdQaccum = permute(mdQaccum, [2, 3, 1, 0])
        mLSElog2, mDpsum = [stat_rows_view(t, SEQLEN_Q_PAD) for t in (mLSElog2, mDpsum)]
        return mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV

    def load_layouts(self):
        """SMEM layouts of what the load warp fills: Q and dO (stages), K, V, and the
        row statistics, whose stages start 128-byte aligned as a TMA destination must
        (80 rows take 96 floats). Returns (sQ, sdO, sK, sV, sRow, floats per row stage)."""
        d, dv, tm, tn = self.head_dim, self.head_dim_v, self.tile_m, self.tile_n
        st = self.tiles.stages_qdo
        row_stage = (tm + 31) // 32 * 32
        return (sm90_smem_layout(self.dtype, tm, d, st),
                sm90_smem_layout(self.dtype, tm, dv, st),
                sm90_smem_layout(self.dtype, tn, d, None),
                sm90_smem_layout(self.dtype, tn, dv, None),
                cute.make_layout((tm, st), stride=(1, row_stage)), row_stage)

    def load_atoms(self, mQ, mK, mV, mdO, mLSElog2, mDpsum, sQ_layout, sdO_layout, sK_layout,
                   sV_layout):
        """TMA atoms and their global views for Q, K, V, dO, LSElog2 and Dpsum (in
        that order, as (atom, view) pairs), and the transaction bytes of one Q/dO
        stage and of K + V."""
        d, dv, tm, tn = self.head_dim, self.head_dim_v, self.tile_m, self.tile_n
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        atoms = (
            cpasync.make_tiled_tma_atom(g2s, mQ, cute.select(sQ_layout, mode=[0, 1]), (tm, d)),
            cpasync.make_tiled_tma_atom(g2s, mK, sK_layout, (tn, d)),
            cpasync.make_tiled_tma_atom(g2s, mV, sV_layout, (tn, dv)),
            cpasync.make_tiled_tma_atom(g2s, mdO, cute.select(sdO_layout, mode=[0, 1]), (tm, dv)),
            cpasync.make_tiled_tma_atom(g2s, mLSElog2, cute.make_layout(tm), (tm,)),
            cpasync.make_tiled_tma_atom(g2s, mDpsum, cute.make_layout(tm), (tm,)),
        )
        bytes_qdo = (cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1]))
                     + cute.size_in_bytes(self.dtype, cute.select(sdO_layout, mode=[0, 1]))
                     + 2 * tm * 4)
        bytes_kv = (cute.size_in_bytes(self.dtype, sK_layout)
                    + cute.size_in_bytes(self.dtype, sV_layout))
        return atoms, bytes_qdo, bytes_kv

    def check_smem(self, storage_cls) -> None:
        """Refuse at compile time a configuration whose SMEM a CTA cannot have."""
        smem_bytes = storage_cls.size_in_bytes()
        if smem_bytes > SM90_MAX_SMEM_BYTES:
            raise ValueError(f"{type(self).__name__} with {self.tiles} needs {smem_bytes} "
                             f"bytes of SMEM, more than the {SM90_MAX_SMEM_BYTES} sm_90 allows")

    # K and V land on two mbarriers (stages 0 and 1 of the K/V pipeline) instead of
    # one, V issued after the first Q / dO item: the first S^T GEMM needs only K and
    # that item, not V as well (BwdTiles.split_kv). Subclasses set it.
    split_kv = False

    def make_pipelines(self, storage, bytes_qdo: int, bytes_kv: int):
        """(Q/dO/row-statistics pipeline, K/V pipeline), both fed by TMA from warp 0.
        With ``split_kv`` the K/V pipeline has two single-use stages, K then V, of
        half the bytes each (the kernels that set it have head_dim == head_dim_v)."""
        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        # One arrive per consumer warp (the pipeline elects lane 0 of each warp).
        consumer_group = pipeline.CooperativeGroup(
            pipeline.Agent.Thread, self.num_mma_threads // 32)
        pipe_qdo = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_qdo.data_ptr(), num_stages=self.tiles.stages_qdo,
            producer_group=producer_group, consumer_group=consumer_group,
            tx_count=bytes_qdo, defer_sync=True)
        # This one fences and syncs the CTA after both pipelines' mbarrier inits.
        split = self.split_kv
        pipe_kv = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=2 if split else 1,
            producer_group=producer_group, consumer_group=consumer_group,
            tx_count=bytes_kv // 2 if split else bytes_kv, defer_sync=False)
        return pipe_qdo, pipe_kv

    def work_list(self, n_block, mQ: cute.Tensor, mK: cute.Tensor):
        """(group, m_block_min, num_m, num_iters): every (query head of the group,
        query block) pair that can see at least one key of this block, as
        ``num_iters = num_m * group`` items. All roles walk the same list, so they
        agree on every barrier count. mQ, mK: (S, D, H, B) views."""
        group = mQ.shape[2] // mK.shape[2]
        m_block_max = cute.ceil_div(mQ.shape[0], self.tile_m)
        m_block_min = Int32(0)
        if const_expr(self.causal):
            # First query block holding a query >= this block's first key.
            m_block_min = cutlass.min(n_block * self.tile_n // self.tile_m, m_block_max)
        num_m = m_block_max - m_block_min
        return group, m_block_min, num_m, num_m * group

    # The CTA's walk rotation (BwdTiles.rotate_walk): None, or (rot, num_iters) as
    # DSL values, set by the kernel before its roles split.
    walk_rot = None

    def work_item(self, it, head_kv, group, m_block_min, num_m):
        """(query head, query block) of work item ``it`` (of the rotated walk, with
        ``walk_rot``: item (it + rot) mod num_iters of the list)."""
        if const_expr(self.walk_rot is not None):
            rot, total = self.walk_rot
            it = it + rot
            it = cutlass.select_(it >= total, it - total, it)
        h_off = it // num_m
        return head_kv * group + h_off, m_block_min + it - h_off * num_m

    @cute.jit
    def load(self, mQ, mK, mV, mdO, mLSElog2, mDpsum, sQ, sK, sV, sdO, sLSE, sDpsum,
             tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_Dpsum,
             pipe_qdo, pipe_kv, n_block, head_kv, batch, group, m_block_min, num_m,
             num_iters, state=None, kv_round=None):
        """Warp 0: K and V of this block once, then Q, dO and their row statistics
        per work item (one mbarrier transaction per item); returns the Q/dO producer
        state. A persistent walk passes that state and kv_round, the number of tiles
        this CTA walked before: K and V then load after the first items' Q and dO
        (the K/V buffers are freed only by the previous tile's dK / dV stores, the Q
        / dO stages earlier), and also for a tile with no work items, whose epilogue
        still stores zeros."""
        tm, tn = self.tile_m, self.tile_n
        d, dv = self.head_dim, self.head_dim_v
        gK = cute.local_tile(mK[None, None, head_kv, batch], (tn, d), (n_block, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (tn, dv), (n_block, 0))
        tKsK, tKgK = tma_tile_partition(tma_K, sK, gK)
        tVsV, tVgV = tma_tile_partition(tma_V, sV, gV)
        kv_pre = Int32(0)
        if const_expr(kv_round is not None):
            # K and V go after item kv_pre: the first min(stages, items) items' Q
            # and dO go first.
            kv_pre = cutlass.min(self.tiles.stages_qdo, num_iters) - 1
        elif num_iters > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                    2 if const_expr(self.split_kv) else 1)
            pipe_kv.producer_acquire(kv_state)
            cute.copy(tma_K, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
            if const_expr(not self.split_kv):
                cute.copy(tma_V, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))

        if const_expr(state is None):
            state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.tiles.stages_qdo)
        for it in cutlass.range(num_iters, unroll=1):
            head_q, m_block = self.work_item(it, head_kv, group, m_block_min, num_m)
            gQ = cute.local_tile(mQ[None, None, head_q, batch], (tm, d), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head_q, batch], (tm, dv), (None, 0))
            gLSE = cute.local_tile(mLSElog2[None, head_q, batch], (tm,), (None,))
            gDpsum = cute.local_tile(mDpsum[None, head_q, batch], (tm,), (None,))
            tQsQ, tQgQ = tma_tile_partition(tma_Q, sQ, gQ)
            tdOsdO, tdOgdO = tma_tile_partition(tma_dO, sdO, gdO)
            tLsL, tLgL = tma_tile_partition(tma_LSE, sLSE, gLSE, rank=1)
            tDsD, tDgD = tma_tile_partition(tma_Dpsum, sDpsum, gDpsum, rank=1)
            pipe_qdo.producer_acquire(state)
            bar = pipe_qdo.producer_get_barrier(state)
            s = state.index
            cute.copy(tma_Q, tQgQ[None, m_block], tQsQ[None, s], tma_bar_ptr=bar)
            cute.copy(tma_LSE, tLgL[None, m_block], tLsL[None, s], tma_bar_ptr=bar)
            cute.copy(tma_dO, tdOgdO[None, m_block], tdOsdO[None, s], tma_bar_ptr=bar)
            cute.copy(tma_Dpsum, tDgD[None, m_block], tDsD[None, s], tma_bar_ptr=bar)
            state.advance()
            if const_expr(self.split_kv):
                if it == 0:  # V (stage 1) after the first item
                    v_state = pipeline.PipelineState(2, Int32(1), Int32(1), Int32(1))
                    pipe_kv.producer_acquire(v_state)
                    cute.copy(tma_V, tVgV, tVsV,
                              tma_bar_ptr=pipe_kv.producer_get_barrier(v_state))
            if const_expr(kv_round is not None):
                if it == kv_pre:
                    self.load_kv_round(pipe_kv, kv_round, tma_K, tKgK, tKsK, tma_V, tVgV, tVsV)
        if const_expr(kv_round is not None):
            if num_iters == 0:
                self.load_kv_round(pipe_kv, kv_round, tma_K, tKgK, tKsK, tma_V, tVgV, tVsV)
        return state

    @cute.jit
    def load_kv_round(self, pipe_kv, kv_round, tma_K, tKgK, tKsK, tma_V, tVgV, tVsV):
        """K and V of a persistent walk's tile kv_round on the one-stage K/V
        pipeline: its producer phase alternates from 1 (the first acquire passes)."""
        kv_state = pipeline.PipelineState(1, kv_round, Int32(0), (kv_round + 1) % 2)
        pipe_kv.producer_acquire(kv_state)
        cute.copy(tma_K, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        cute.copy(tma_V, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))

    @cute.jit
    def store_dq_joint(self, mdQaccum, sdQ, tma_dQ, head_kv, batch, group, m_block_min,
                       num_m, num_iters):
        """Warp 1: reduce-add each (tile_m x d) dQ partial tile, written by both MMA
        warpgroups together, from SMEM into mdQaccum (fp32)."""
        tm, d = self.tile_m, self.head_dim
        nthr = self.num_mma_threads + 32
        for it in cutlass.range(num_iters, unroll=1):
            head_q, m_block = self.work_item(it, head_kv, group, m_block_min, num_m)
            gdQ = cute.local_tile(mdQaccum[None, None, head_q, batch], (tm, d), (None, 0))
            tsdQ, tgdQ = tma_tile_partition(tma_dQ, sdQ, gdQ)
            # The SMEM tile is free (the previous reduce has read it): let the MMA
            # warpgroups write the next partial.
            cute.arch.barrier_arrive(barrier_id=self.bar_dq_empty, number_of_threads=nthr)
            cute.arch.barrier(barrier_id=self.bar_dq_full, number_of_threads=nthr)
            cute.copy(tma_dQ, tsdQ, tgdQ[None, m_block])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        # The reduce-adds must land before the kernel ends.
        cute.arch.cp_async_bulk_wait_group(0, read=False)
