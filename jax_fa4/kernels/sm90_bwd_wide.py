"""Hopper (sm_90a) backward attention main kernel for head dims 256, 192 and (192, 128).

Same contract as `FlashBwdSm90` (kernels/sm90_bwd.py), whose register-resident
design does not fit these heads. One CTA owns one key/value block (`tile_n` = 64
keys at 256, 96 at 192) of one kv head of one batch entry and walks every query
block (`tile_m` = 64 queries) of every query head of its GQA group, so dK and dV
stay in registers for the whole walk (deterministic, no dK/dV atomics). dQ partials
(sum over this CTA's keys of dS K) are reduce-added into the fp32 accumulator by
bulk copies. Below, the figures are hdim 256's; Note [Wide dK and dV] gives 192's.

Warp roles (384 threads; everything but the MMA warpgroups and the dQ warp is
shared with `FlashBwdSm90` in sm90_bwd_common.py):
  warpgroup 0   warp 0: TMA loads (K, V once; Q, dO, LSElog2 and Dpsum rows per
                        query block, one or two pipeline stages)
                warp 1: bulk reduce-add of the dQ partial into mdQaccum
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
runs; P stored to SMEM with stmatrix (Note [P/dS buffers]), barrier over both
warpgroups, dV^T issued; dS computed while dV^T runs; dS stored (single buffer),
barrier, then dK^T and dQ issued in the order of Note [Wide GEMM order]; the dQ
partial goes to the dQ warp through SMEM (Note [Wide dQ hand-off]).

Note [Wide GEMM order]: at 256, with one Q/dO stage, dK^T goes before dQ: the
stage is released once dV^T and dK^T are done, so the next block's Q/dO load
overlaps the dQ GEMM and its hand-off. At 192 a second stage already holds the
next block, so dQ goes first, as in the hdim 64-128 kernel and flash-attn-4's: its
hand-off to SMEM then runs while dK^T is on the tensor cores, and the stage is
released after dK^T ((192, 128) backward 2% faster).

Note [Wide shared memory]: Q, dO, K and V tiles are 32 KiB each at d = 256, the
fp32 dQ tile 64 KiB, P 2 x 8 KiB, dS 8 KiB: 216 KiB plus 1 KiB of barriers and row
statistics (222208 bytes), within the 227 KiB a CTA may use. A second Q/dO stage
(+64 KiB, or +32 KiB for Q alone) does not fit, so each block's Q/dO load is
exposed except for the overlap with the previous block's dQ GEMM and hand-off.
At 192 (96-key blocks) Q is 24 KiB, K 36 KiB, the dQ tile 48 KiB, P and dS 12 KiB
each: with dO and V of 16 / 24 KiB, (192, 128) takes two Q/dO stages (212 KiB),
which load the next block under the current one; (192, 192) two of Q and one of
dO (216 KiB; two of both would need 240), dO in a pipeline of its own (Note [Split
Q and dO stages] in sm90_bwd_common.py), as flash-attn-4's hdim-192 backward stages
them.

Note [P/dS buffers]: at 256 every warpgroup reads all of P (dV^T) and all of dS
(dK^T and dQ), and each writes only its own 32 columns, so a barrier over both
warpgroups separates writes from reads. For the write-after-read side: warpgroup w
finishes all GEMMs of query block i-1 (wait_group(0)) before it arrives at the P
barrier of block i. dS of block i is written after that barrier, so one dS buffer
suffices. P of block i is written before it, while the other warpgroup may still
run dV^T of block i-1 (which reads P of i-1): P alternates between two buffers, and
the buffer written in block i was last read by dV^T of block i-2, finished before
either warpgroup passed the P barrier of block i-1. At 192 a warpgroup's dV^T and
dK^T read only the 48 columns of P and dS it wrote itself (Note [Wide dK and dV]);
dQ still reads all of dS. P then needs one buffer: warpgroup w writes its columns
of block i after its own GEMMs of block i-1 are done.

Note [Wide dQ hand-off]: each warpgroup writes its (64 x d/2) dQ part into SMEM in
the flat order of the hdim-128 kernel (Note [Flat dQ accumulator] in dq_layout.py):
its registers four at a time, thread-interleaved, one conflict-free 128-bit store
each, and the dQ warp adds each part to mdQaccum with one 1-D bulk reduce. The
postprocess reads the same order back. Written row-major for a TMA tensor reduce
(the 128-byte swizzle), the accumulator's 64-bit stores took four SMEM wavefronts
instead of two: a half-warp's rows r and r ^ 1 land on the same banks.

Note [Tails without predicates]: TMA zero-fills Q/dO rows past seqlen_q and K/V
rows past seqlen_k. The LSElog2 / Dpsum workspaces have Sq_pad rows, the ones past
seqlen_q set to +inf / 0 by the preprocess kernel, so P = exp2(-inf) = 0 there and
with it dS = 0: those queries add exact zeros to dV, dK and to the padding rows of
dQaccum (whose Sq_pad rows keep every 64-row reduce in bounds). Keys past seqlen_k
(and, causal, keys after the query) get S = -inf, hence P = 0, in the blocks that
contain any; their dK/dV rows are never stored (predicated epilogue).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import warpgroup

from jax_fa4.kernels.cute_utils import (
    DqSemaphoreCall,
    bulk_reduce_add_f32,
    permute,
    semaphore_release_after_bulk,
    sm90_smem_layout,
    smem_operands,
    transpose_smem,
    wgmma_gemm,
    zero_acc,
)
from jax_fa4.kernels.dq_layout import det_key_block
from jax_fa4.kernels.sm90_bwd_common import Sm90BwdCommon
from jax_fa4.kernels.softmax import acc_mn_view, cap_scores, capped_grad


def wide_tile_n(head_dim: int) -> int:
    """Key rows per CTA of the wide kernel, split between the two MMA warpgroups in S
    and dP: 64 at 256, flash-attn-4's 96 at 192 (Note [Wide dK and dV])."""
    return 64 if head_dim == 256 else 96


# Named hardware barriers (0 is __syncthreads).
_BAR_P = 1  # both MMA warpgroups: P of this query block is in SMEM
_BAR_DS = 2  # both MMA warpgroups: dS of this query block is in SMEM
# The dQ hand-off (Sm90BwdCommon): FlashBwdSm90Wide.bar_dq_full = 3, bar_dq_empty = 4.


class FlashBwdSm90Wide(Sm90BwdCommon):
    """Backward main kernel for sm_90a at head dims 256, 192 and (192, 128); see the
    module docstring.

    Same constructor and call as `FlashBwdSm90`. FA3's sm90 hdim-256 backward tiles:
    64 x 64 and one Q/dO stage, the only ones that fit in SMEM (Note [Wide shared
    memory]); flash-attn-4's 64 x 96 at 192. The mask changes only which blocks run
    and which are masked.

    Note [Wide dK and dV]: dK and dV accumulate transposed, dV^T = dO^T P and dK^T =
    Q^T dS (head dim x keys, "swapAB"). At 256 the warpgroups split them along the
    head dim in 64-row atoms (two each). 192 rows are three such atoms, which two
    warpgroups cannot share evenly, so at 192 they split them along the keys
    instead: each warpgroup's 48 of the block's 96 keys, the same keys whose S and dP
    it computes, so its dV^T and dK^T read only its own columns of P and dS (SMEM
    swizzle atoms that divide 48). Per thread that is 72 + 72 accumulator registers
    at (192, 192), 48 + 72 at (192, 128); per warpgroup and query block 12 + 12 + 12
    + 12 + 6 = 54 wgmma instructions ((192, 128): 46). flash-attn-4's hdim-192
    backward splits the same way (dKV swapAB, its atoms along n).

    Args: as ``Sm90BwdCommon``; head dims 256, 192 or (192, 128).
    """

    head_dims = (192, 256, (192, 128))
    smem_more = ("sP", "sdS", "sdQ")
    bar_dq_full = 3
    bar_dq_empty = 4
    tile_m = 64  # query rows per block
    # Every query block's dQ partials are added in a fixed key-block order
    # (FlashBwdSm90WideDeterministic).
    deterministic = False

    @property
    def tile_n(self) -> int:
        return wide_tile_n(self.head_dim)

    @property
    def stages_qdo(self) -> int:
        """Q / LSElog2 stages: 2 where they fit (192, Note [Wide shared memory])."""
        return 2 if self.head_dim == 192 else 1

    @property
    def stages_do(self) -> int:
        """dO / Dpsum stages: 2 where they fit too ((192, 128)); at (192, 192) one, in
        a pipeline of its own (Note [Split Q and dO stages] in sm90_bwd_common.py)."""
        return 2 if self.head_dim_v == 128 else 1

    @property
    def dq_first(self) -> bool:
        """dQ issued before dK^T where a second Q stage holds the next block (192;
        Note [Wide GEMM order])."""
        return self.stages_qdo > 1

    @property
    def dkv_split_n(self) -> bool:
        """Note [Wide dK and dV]: the warpgroups split dK^T / dV^T along the keys (192)
        rather than along the head dim (256)."""
        return self.head_dim == 192

    @property
    def p_buffers(self) -> int:
        """P's SMEM buffers (Note [P/dS buffers]): one where each warpgroup's dV^T reads
        only the P columns it wrote itself."""
        return 1 if self.dkv_split_n else 2

    # ------------------------------------------------------------------ host side
    def _tiled_mmas(self):
        d = self.head_dim
        tm, tn = self.tile_m, self.tile_n
        wg = self.num_mma_wg
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        # S = Q K^T and dP = dO V^T (tile_m x tile_n): A = Q / dO (tile_m x d) and
        # B = K / V (tile_n x d), K-major as stored; warpgroups side by side along n.
        mma_sdp = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, (1, wg, 1), (tm, tn // wg))
        # dV^T = dO^T P and dK^T = Q^T dS (d x tile_n, reduced over tile_m): A = dO^T /
        # Q^T (d x tile_m, d contiguous: MN-major), B[n, m] = P[m, n] / dS[m, n] (n
        # contiguous: MN-major). Warpgroups side by side along n, each on the keys
        # whose S and dP it computed (192), or stacked along d (256).
        atoms, tiler = ((1, wg, 1), (64, tn // wg)) if self.dkv_split_n else ((wg, 1, 1), (64, tn))
        mma_dk = mma_dv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN, MN, Float32, atoms, tiler)
        # dQ = dS K (tile_m x d, reduced over tile_n): A = dS (K-major as stored),
        # B[d, n] = K[n, d] (d contiguous: MN-major); warpgroups side by side along d.
        mma_dq = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, MN, Float32, (1, wg, 1), (tm, d // wg))
        return mma_sdp, mma_dk, mma_dv, mma_dq

    @cute.jit
    def launch(self, stream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
               mdO: cute.Tensor, mLSElog2: cute.Tensor, mDpsum: cute.Tensor,
               mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
               mdQsem: cute.Tensor | None = None, *masks: cute.Tensor):
        """The host side of the call (``BwdMainCall``); mdQsem: (B, Hq, ceil(Sq /
        tile_m)) int32, zero at launch, with the deterministic backward, else None;
        masks: with ``masked``, the keys' query intervals (and segment ids), and
        deterministic, the key blocks' walks."""
        d = self.head_dim
        tm, tn = self.tile_m, self.tile_n
        mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV = self.operand_views(
            mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV)

        mmas = self._tiled_mmas()

        sQ_layout, sdO_layout, sK_layout, sV_layout, sRow_layout, row_stage = (
            self.load_layouts())
        # P (tile_m x tile_n, keys contiguous), one or two buffers; dS one (Note
        # [P/dS buffers]). Split along the keys, each warpgroup's dV^T / dK^T reads
        # its own 48 of them as B: swizzle atoms that divide 48.
        cols = tn // self.num_mma_wg if self.dkv_split_n else None
        sP_layout = sm90_smem_layout(self.dtype, tm, tn, self.p_buffers, swizzle_cols=cols)
        sdS_layout = sm90_smem_layout(self.dtype, tm, tn, None, swizzle_cols=cols)
        # The dQ partial, both warpgroups' parts in the flat order (Note [Wide dQ
        # hand-off]): plain floats.
        sdQ_layout = cute.make_layout(tm * d)

        ((tma_Q, gmem_Q), (tma_K, gmem_K), (tma_V, gmem_V), (tma_dO, gmem_dO),
         (tma_LSE, gmem_LSE), (tma_Dpsum, gmem_Dpsum)), bytes_qdo, bytes_kv = self.load_atoms(
            mQ, mK, mV, mdO, mLSElog2, mDpsum, sQ_layout, sdO_layout, sK_layout, sV_layout)

        SharedStorage = self.shared_storage(
            sQ_layout, sdO_layout, sK_layout, sV_layout, row_stage, sP=(self.dtype, sP_layout),
            sdS=(self.dtype, sdS_layout), sdQ=(Float32, sdQ_layout))
        self.launch_kernel(
            mK, (gmem_Q, gmem_K, gmem_V, gmem_dO, gmem_LSE, gmem_Dpsum),
            (mdQaccum, mdK, mdV, mdQsem),
            (tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_Dpsum), (),
            (sQ_layout, sdO_layout, sK_layout, sV_layout, sRow_layout, sP_layout, sdS_layout,
             sdQ_layout),
            mmas, bytes_qdo, bytes_kv, SharedStorage, stream, masks)

    def cta_coords(self, mQ: cute.Tensor, mK: cute.Tensor):
        n_block, head_kv, batch = cute.arch.block_idx()
        if const_expr(self.deterministic):
            # Causal or masked, key blocks launch last first: each waits only on
            # higher key blocks (dq_warp), which have then launched before it.
            n_block = det_key_block(n_block, cute.ceil_div(mK.shape[0], self.tile_n),
                                    self.causal or self.masked)
        return n_block, head_kv, batch

    # ---------------------------------------------------------------- device side
    @cute.jit
    def dq_warp(self, cta):
        """Warp 1: reduce-add each query block's dQ partial, written by both MMA
        warpgroups together in the flat order (Note [Wide dQ hand-off]), from SMEM
        into its (tile_m x d) block of mdQaccum (fp32), one 1-D bulk reduce per
        warpgroup part.

        Deterministic: as ``FlashBwdSm90.dq_warp``, the query block's semaphore
        counts the key blocks whose partials have landed, and this CTA adds its
        partial when the count reaches its rank (``det_add_rank``; masked,
        ``masked_add_rank`` from the walks)."""
        mdQaccum = cta.outs[0]
        sdQ = cta.smem["sdQ"]
        _, head_kv, batch = cta.coords
        group, m_block_min, num_m, num_iters = cta.work
        tm, d = self.tile_m, self.head_dim
        part = tm * d // self.num_mma_wg
        nthr = self.num_mma_threads + 32
        lane = cute.arch.lane_idx()
        for it in cutlass.range(num_iters, unroll=1):
            head_q, m_block = self.work_item(it, head_kv, group, m_block_min, num_m)
            gdQ = cute.local_tile(mdQaccum[None, None, head_q, batch], (tm, d), (m_block, 0))
            # The SMEM partial is free (the previous reduces have read it): let the
            # MMA warpgroups write the next one.
            cute.arch.barrier_arrive(barrier_id=self.bar_dq_empty, number_of_threads=nthr)
            if const_expr(self.deterministic):
                sem_ptr = self.wait_dq_turn(cta, head_q, m_block)
            cute.arch.barrier(barrier_id=self.bar_dq_full, number_of_threads=nthr)
            if lane == 0:
                for w in cutlass.range_constexpr(self.num_mma_wg):
                    bulk_reduce_add_f32(gdQ.iterator + w * part, sdQ.iterator + w * part,
                                        part * 4)
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(self.deterministic):
                    # The reduces land before the next key block may add.
                    semaphore_release_after_bulk(sem_ptr)
                else:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
        # The reduce-adds must land before the kernel ends.
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def mma(self, cta, tidx):
        """MMA warpgroups (``tidx`` counted from their first thread): all GEMMs and
        the pointwise math; dK/dV epilogue."""
        sQ, sdO, sK, sV, sP, sdS, sdQ, sLSE, sDpsum = cta.smem.values()
        _, mdK, mdV, _ = cta.outs
        mma_sdp, mma_dk, mma_dv, mma_dq = cta.mmas
        pipe_qdo, pipe_do, pipe_kv = cta.pipe_qdo, cta.pipe_do, cta.pipe_kv
        n_block, head_kv, batch = cta.coords
        _, m_block_min, num_m, num_iters = cta.work
        seqlen_k = cta.seqlen_k
        tm, tn = self.tile_m, self.tile_n
        d, dv = self.head_dim, self.head_dim_v
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        wg_slice = wg_idx * 128
        scale_log2 = self.scale_log2

        # wgmma A/B operands are partitioned per warpgroup; C per thread.
        thr_sdp, thr_dk, thr_dv, thr_dq = [m.get_slice(tidx) for m in cta.mmas]
        # S = Q K^T and dP = dO V^T.
        tSrQ, tSrK = smem_operands(mma_sdp, wg_slice, sQ, sK)
        tdPrdO, tdPrV = smem_operands(mma_sdp, wg_slice, sdO, sV)
        sdOt, sPt, sQt, sdSt = (transpose_smem(t) for t in (sdO, sP, sQ, sdS))
        # dV^T = dO^T P: A = dO^T (dv x tile_m), B = P^T (tile_n x tile_m), and
        # dK^T = Q^T dS: A = Q^T (d x tile_m), B = dS^T, all MN-major.
        tdVrdOt, tdVrPt = smem_operands(mma_dv, wg_slice, sdOt, sPt)
        tdKrQt, tdKrdSt = smem_operands(mma_dk, wg_slice, sQt, sdSt)
        acc_dK = zero_acc(thr_dk, (d, tn))
        acc_dV = zero_acc(thr_dv, (dv, tn))
        # dQ = dS K: A = dS (tile_m x tile_n) K-major, B = K^T (d x tile_n) MN-major.
        tdQrdS, tdQrKt = smem_operands(mma_dq, wg_slice, sdS, transpose_smem(sK))

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
        r2s_dq, tdQsdQ = self.flat_dq_copy(thr_dq, sdQ, tidx, wg_idx)

        p_bar = pipeline.NamedBarrier(barrier_id=_BAR_P, num_threads=self.num_mma_threads)
        ds_bar = pipeline.NamedBarrier(barrier_id=_BAR_DS, num_threads=self.num_mma_threads)
        dq_threads = self.num_mma_threads + 32
        key_limit = seqlen_k - n_block * tn
        kmask = self.key_mask(cta, tScS, 1)
        state = self.mma_start(pipe_kv, num_iters)
        # Split: dO's own consumer state (Note [Split Q and dO stages]); else unused.
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.stages_do)
        for it in cutlass.range(num_iters, unroll=1):
            _, m_block = self.work_item(it, head_kv, 0, m_block_min, num_m)
            stage = state.index
            do_stage = stage
            if const_expr(self.split_qdo):
                do_stage = do_state.index
            buf = it % self.p_buffers

            # Segment ids: keep bits before the GEMMs' accumulators are live.
            bits = self.segment_bits(kmask, tScS, m_block)
            pipe_qdo.consumer_wait(state)
            acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((tm, tn)), Float32)
            wgmma_gemm(mma_sdp, acc_S, tSrQ[None, None, None, stage], tSrK, zero_init=True)
            if const_expr(self.split_qdo):
                pipe_do.consumer_wait(do_state)
            acc_dP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((tm, tn)), Float32)
            wgmma_gemm(mma_sdp, acc_dP, tdPrdO[None, None, None, do_stage], tdPrV,
                       zero_init=True)

            # Row statistics of this thread's queries (+inf / 0 on padding rows).
            lse = cute.make_rmem_tensor((n_rows,), Float32)
            dpsum = cute.make_rmem_tensor((n_rows,), Float32)
            for r in cutlass.range_constexpr(n_rows):
                lse[r] = sLSE[tScS[r, 0][0], stage]
                dpsum[r] = sDpsum[tScS[r, 0][0], do_stage]
            warpgroup.wait_group(1)  # S done

            S = acc_mn_view(acc_S)
            if const_expr(self.cap_in is not None):
                cap_scores(S, self.cap_in)
            self.mask_scores(S, tScS, 1, m_block, n_block, key_limit, kmask, cta.full,
                             bits)
            # P = exp2(S * scale * log2 e - LSElog2[query]); exp2(-inf) = 0.
            # softcap: P to its own fragment, P (1 - t^2) to S (Note [Softcap in the
            # kernels]).
            acc_P = acc_S
            if const_expr(self.cap_in is not None):
                acc_P = cute.make_fragment_like(acc_S, Float32)
            P = acc_mn_view(acc_P)
            for r in cutlass.range_constexpr(n_rows):
                for c in cutlass.range_constexpr(n_cols):
                    P[r, c] = cute.math.exp2(S[r, c] * scale_log2 - lse[r], fastmath=True)
                    if const_expr(self.cap_in is not None):
                        S[r, c] = capped_grad(P[r, c], S[r, c])
            rP = cute.make_fragment_like(acc_S, self.dtype)
            rP.store(acc_P.load().to(self.dtype))
            # P to its buffer `buf` (Note [P/dS buffers]); generic-proxy SMEM writes
            # must be made visible to the async proxy (wgmma) before the barrier.
            cute.copy(copy_pds, thr_copy_pds.retile(rP), tPsP[None, None, None, buf])
            cute.arch.fence_view_async_shared()
            p_bar.arrive_and_wait()
            # dV^T runs on the tensor cores while dS is computed.
            wgmma_gemm(mma_dv, acc_dV, tdVrdOt[None, None, None, do_stage],
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
            if const_expr(self.split_qdo):
                # dV^T, the last reader of dO, is done (it ran under dS): dO's stage is
                # free before dK and dQ are issued (Note [Split Q and dO stages]).
                warpgroup.wait_group(0)
                pipe_do.consumer_release(do_state)
                do_state.advance()

            acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((tm, d)), Float32)
            if const_expr(self.dq_first):
                # The hand-off runs under dK^T (Note [Wide GEMM order]).
                wgmma_gemm(mma_dq, acc_dQ, tdQrdS, tdQrKt, zero_init=True)
                wgmma_gemm(mma_dk, acc_dK, tdKrQt[None, None, None, stage], tdKrdSt,
                           zero_init=False)
                warpgroup.wait_group(1)  # dV and dQ done; dK may still run
                self.dq_handoff(r2s_dq, acc_dQ, tdQsdQ, 0, dq_threads)
                warpgroup.wait_group(0)  # dK done: nothing reads this stage
                pipe_qdo.consumer_release(state)  # split: Q's (dO's went above)
            else:
                # The stage frees before dQ (Note [Wide GEMM order]).
                wgmma_gemm(mma_dk, acc_dK, tdKrQt[None, None, None, stage], tdKrdSt,
                           zero_init=False)
                wgmma_gemm(mma_dq, acc_dQ, tdQrdS, tdQrKt, zero_init=True)
                warpgroup.wait_group(1)  # dV and dK done: nothing reads this stage
                pipe_qdo.consumer_release(state)
                warpgroup.wait_group(0)  # dQ done
                self.dq_handoff(r2s_dq, acc_dQ, tdQsdQ, 0, dq_threads)
            state.advance()
        self.store_acc(acc_dK, mdK, thr_dk, d, self.softmax_scale, n_block, head_kv,
                       batch, seqlen_k)
        self.store_acc(acc_dV, mdV, thr_dv, dv, 1.0, n_block, head_kv, batch, seqlen_k)

    @cute.jit
    def store_acc(self, acc, mX, thr, width: cutlass.Constexpr[int],
                  scale: cutlass.Constexpr[float], n_block, head_kv, batch, seqlen_k):
        """dK = scale * sum dS^T Q and dV = sum P^T dO from their transposed (width x
        tile_n) accumulators, straight to global memory; keys past seqlen_k are not
        stored."""
        tn = self.tile_n
        gX = cute.local_tile(mX[None, None, head_kv, batch], (tn, width), (n_block, 0))
        tXgX = thr.partition_C(permute(gX, [1, 0]))  # (width, tile_n) view of the rows
        tXcX = thr.partition_C(cute.make_identity_tensor((width, tn)))
        rX = cute.make_fragment_like(acc, self.dtype)
        if const_expr(scale != 1.0):
            rX.store((acc.load() * scale).to(self.dtype))
        else:
            rX.store(acc.load().to(self.dtype))
        key_limit = seqlen_k - n_block * tn
        for i in cutlass.range_constexpr(cute.size(rX)):
            if tXcX[i][1] < key_limit:
                tXgX[i] = rX[i]


class FlashBwdSm90WideDeterministic(DqSemaphoreCall, FlashBwdSm90Wide):
    """The deterministic sm90 backward at head dims 192, (192, 128) and 256: every
    query block sums its dQ partials in a fixed key-block order, as
    ``FlashBwdSm90Deterministic`` does at the smaller head dims (the same call: the
    semaphores after mdQaccum, masked also the key blocks' walks)."""

    deterministic = True
