"""What the two sm90 backward main kernels share: their constructor and call, the
operands' views and TMA atoms, the shared memory, the kernel itself up to the
roles (prologue, work list, role split), the load warp and the score mask.

`FlashBwdSm90` (kernels/sm90_bwd.py, hdim 64 and 128) and `FlashBwdSm90Wide`
(kernels/sm90_bwd_wide.py, hdim 256) differ in their MMA warpgroups (``mma``) and
in how their dQ partials leave (``dq_warp``): both have one CTA per (key block, kv
head, batch entry), warp 0 loading K and V once and then Q, dO, LSElog2 and Dpsum
per (query head of the GQA group, query block), and warp 1 reduce-adding dQ
partials into the fp32 accumulator.
"""

import logging
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync

from jax_fa4.kernels.bwd_preprocess import SEQLEN_Q_PAD
from jax_fa4.kernels.cute_utils import (
    BwdMainCall,
    check_bwd_operand_dtypes,
    init_bwd_kernel,
    masked_add_rank,
    pdl_start,
    permute,
    semaphore_wait,
    set_mask_flags,
    sm90_smem_layout,
    stat_rows_view,
    tma_tile_partition,
)
from jax_fa4.kernels.dq_layout import det_add_rank
from jax_fa4.kernels.mask import BlockRange, decode_hi, keep_inside

log = logging.getLogger(__name__)

# The most dynamic shared memory one CTA may use on sm_90 (227 KiB).
SM90_MAX_SMEM_BYTES = 227 * 1024


def dq_tiled_mma(dtype, tile_m: int, head_dim: int, num_wg: int = 2) -> cute.TiledMma:
    """The tiled MMA of dQ = dS K (tile_m x head_dim, fp32 accumulator) in the sm90
    backward: one 64-row atom per warpgroup, split along m when tile_m has two,
    else along d. A = dS read from the dS^T buffer and B = K^T are both MN-major.
    The postprocess rebuilds it to read the flat dQ accumulator back into the
    same register fragments (Note [Flat dQ accumulator] in dq_layout.py)."""
    import cutlass.utils.hopper_helpers as sm90_utils

    mn = cute.nvgpu.OperandMajorMode.MN
    wg_m = tile_m // 64
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, mn, mn, Float32, (wg_m, num_wg // wg_m, 1),
        (64, dq_part_cols(tile_m, head_dim, num_wg)))


def dq_part_cols(tile_m: int, head_dim: int, num_wg: int = 2) -> int:
    """Columns of dQ (and of K, its B operand) per warpgroup of ``dq_tiled_mma``:
    all of them where the warpgroups split tile_m, else a share of head_dim."""
    return head_dim // (num_wg // (tile_m // 64))


def dq_tile_layout(dtype, tile_m: int, head_dim: int):
    """SMEM layout of a (tile_m, head_dim) dQ tile in ``dtype`` that stmatrix writes
    through ``dq_tiled_mma`` and one TMA store reads: swizzle atoms that divide each
    warpgroup's part (the postprocess's tile, and the main kernel's with
    ``FlashBwdSm90.dq_store``)."""
    return sm90_smem_layout(dtype, tile_m, head_dim, None,
                            swizzle_cols=dq_part_cols(tile_m, head_dim))


@dataclass
class Cta:
    """One CTA of an sm90 backward kernel, as ``Sm90BwdCommon.kernel`` sets it up for
    its roles (plain Python, read while tracing)."""

    coords: tuple  # (key block, kv head, batch entry)
    work: tuple  # ``work_list``: (GQA group, first query block, query blocks, items)
    masks: tuple  # masked: (query intervals, query and key segment ids or None)
    # masked, where the kernel takes them: the key blocks' walks (B, num_n, 5), else
    # None.
    walks: object
    # masked: (first full query block, end of the full ones, the warpgroups' peel
    # bits) of the key block (``work_list``), else None.
    full: tuple | None
    seqlen_k: object
    storage: object  # the SharedStorage
    smem: dict  # SMEM tensors by name
    layouts: dict  # their layouts by name (the row statistics' as "sRow")
    pipe_qdo: object  # Q / dO / LSElog2 / Dpsum pipeline (split: Q / LSElog2 only)
    pipe_do: object  # split Q / dO stages: the dO / Dpsum pipeline, else None
    pipe_kv: object  # K / V pipeline
    outs: tuple  # the subclass's arguments of ``kernel``
    atoms: tuple
    mmas: tuple


class Sm90BwdCommon(BwdMainCall):
    """Base of the sm90 backward kernels.

    Args:
      dtype: cutlass.BFloat16 or cutlass.Float16 (Q, K, V, dO, dK, dV).
      head_dim, head_dim_v: equal, one of the subclass's ``head_dims``.
      causal: top-left causal mask (query i sees key j <= i).
      softmax_scale: scale applied to Q K^T (default 1 / sqrt(head_dim)).
      use_pdl: launched with programmatic dependent launch (``pdl_start``).
      masked: the call takes each key's interval of seeing queries (rules/ranges.py),
        which carries every mask (causal must then be False); segments: and the
        segment ids, compared where a document is not contiguous.
      softcap: c > 0 caps each scaled logit s to c * tanh(s / c) (Note [Softcap in the
        kernels] in softmax.py); None for none.

    A subclass sets head_dims, tile_m, tile_n, stages_qdo (and stages_do where dO has
    fewer stages than Q: Note [Split Q and dO stages]), smem_more (the names of
    its SMEM tensors besides Q, dO, K, V and the row statistics), the named-barrier
    ids bar_dq_full (MMA warpgroups -> dQ warp: the dQ partial is in SMEM) and
    bar_dq_empty (dQ warp -> MMA warpgroups: it may be overwritten), and defines
    ``launch`` (the host side of the call) and the roles ``dq_warp`` and ``mma``."""

    num_mma_wg = 2
    num_mma_threads = 128 * num_mma_wg
    num_threads = 128 + num_mma_threads  # the load / dQ warpgroup and two MMA warpgroups
    # setmaxnreg: the load / dQ warpgroup gives its registers to the MMA warpgroups.
    regs_producer = 24
    regs_mma = 240

    # Note [Split Q and dO stages]: one pipeline brings Q, dO and their row statistics
    # per work item, in stages_qdo stages. Where a second dO stage does not fit in
    # SMEM but a second Q stage does (the wide kernel at 192), dO and Dpsum get a
    # pipeline of their own with stages_do stages: the next item's Q is loaded under
    # this one, and dO is released as soon as dV has read it, before dK and dQ, so its
    # next load starts that much earlier (flash-attn-4's hdim-192 staging). Dpsum
    # keeps stages_qdo slots, of which the dO pipeline uses the first stages_do.
    @property
    def stages_do(self) -> int:
        """dO / Dpsum stages: those of Q unless a subclass gives dO fewer."""
        return self.stages_qdo

    @property
    def split_qdo(self) -> bool:
        """Whether dO has a pipeline of its own (Note [Split Q and dO stages])."""
        return self.stages_do != self.stages_qdo

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        head_dim_v: int | None = None,
        causal: bool = False,
        softmax_scale: float | None = None,
        use_pdl: bool = False,
        masked: bool = False,
        segments: bool = False,
        softcap: float | None = None,
    ):
        init_bwd_kernel(self, type(self).__name__, dtype, head_dim, head_dim_v, self.head_dims,
                        causal, softmax_scale, softcap)
        set_mask_flags(self, causal, masked, segments)
        self.use_pdl = use_pdl
        log.debug("%s %s d=%d causal=%s", type(self).__name__, dtype, head_dim, causal)

    def operand_views(self, mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV):
        """Check the operands' dtypes and re-view them as the TMA tiles see them:
        (S, D, H, B) for the [B, S, H, D] tensors, (Sq_pad, D, Hq, B) for dQaccum,
        (Sq_pad, Hq, B) for the row statistics. mdQaccum: a [B, Sq, Hq, D] dQ in the
        kernel's dtype where the kernel stores dQ itself (``FlashBwdSm90.dq_store``)."""
        check_bwd_operand_dtypes(self, mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV)
        mQ, mK, mV, mdO, mdK, mdV = [permute(t, [1, 3, 2, 0])
                                     for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mdQaccum = permute(mdQaccum, [1, 3, 2, 0] if self.dq_store else [2, 3, 1, 0])
        mLSElog2, mDpsum = [stat_rows_view(t, SEQLEN_Q_PAD) for t in (mLSElog2, mDpsum)]
        return mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV

    def load_layouts(self):
        """SMEM layouts of what the load warp fills: Q and dO (stages), K, V, and the
        row statistics, whose stages start 128-byte aligned as a TMA destination must.
        Returns (sQ, sdO, sK, sV, sRow, floats per row stage)."""
        d, dv, tm, tn = self.head_dim, self.head_dim_v, self.tile_m, self.tile_n
        st = self.stages_qdo
        row_stage = (tm + 31) // 32 * 32
        # K is also dQ = dS K's B operand, split along d between the warpgroups when
        # the query tile has one 64-row atom (``dq_tiled_mma``): at d = 96 each
        # takes 48 columns, which the 64-byte swizzle's 32-column atoms do not divide.
        k_cols = dq_part_cols(tm, d, self.num_mma_wg)
        return (sm90_smem_layout(self.dtype, tm, d, st),
                sm90_smem_layout(self.dtype, tm, dv, self.stages_do),
                sm90_smem_layout(self.dtype, tn, d, None, swizzle_cols=k_cols),
                sm90_smem_layout(self.dtype, tn, dv, None),
                cute.make_layout((tm, st), stride=(1, row_stage)), row_stage)

    def load_atoms(self, mQ, mK, mV, mdO, mLSElog2, mDpsum, sQ_layout, sdO_layout, sK_layout,
                   sV_layout):
        """TMA atoms and their global views for Q, K, V, dO, LSElog2 and Dpsum (in
        that order, as (atom, view) pairs), and the transaction bytes of one Q/dO
        stage (split: of Q and of dO, a pair) and of K + V."""
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
        bytes_q = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1])) + tm * 4
        bytes_do = cute.size_in_bytes(self.dtype, cute.select(sdO_layout, mode=[0, 1])) + tm * 4
        bytes_qdo = (bytes_q, bytes_do) if self.split_qdo else bytes_q + bytes_do
        bytes_kv = (cute.size_in_bytes(self.dtype, sK_layout)
                    + cute.size_in_bytes(self.dtype, sV_layout))
        return atoms, bytes_qdo, bytes_kv

    def shared_storage(self, sQ_layout, sdO_layout, sK_layout, sV_layout, row_stage: int,
                       **more):
        """The CTA's shared memory: the pipelines' mbarriers, the row statistics, Q,
        dO, K and V, then ``more`` (name -> (element type, layout), each 1024-byte
        aligned). Refused at compile time where it exceeds what a CTA may have."""
        mr, al = cute.struct.MemRange, cute.struct.Align
        st = self.stages_qdo
        fields = {
            "mbar_qdo": mr[cutlass.Int64, 2 * st],
            "mbar_kv": mr[cutlass.Int64, 2],
            **({"mbar_do": mr[cutlass.Int64, 2 * self.stages_do]} if self.split_qdo else {}),
            "sLSE": al[mr[Float32, row_stage * st], 128],
            "sDpsum": al[mr[Float32, row_stage * st], 128],
        }
        for name, (dtype, layout) in dict(
                sQ=(self.dtype, sQ_layout), sdO=(self.dtype, sdO_layout),
                sK=(self.dtype, sK_layout), sV=(self.dtype, sV_layout), **more).items():
            fields[name] = al[mr[dtype, cute.cosize(layout)], 1024]
        storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        smem_bytes = storage.size_in_bytes()
        if smem_bytes > SM90_MAX_SMEM_BYTES:
            raise ValueError(f"{type(self).__name__} needs {smem_bytes} bytes of SMEM, more "
                             f"than the {SM90_MAX_SMEM_BYTES} sm_90 allows")
        return storage

    def launch_kernel(self, mK, loads, outs, tma_loads, atoms, layouts, mmas, bytes_qdo,
                      bytes_kv: int, SharedStorage, stream, masks: tuple = ()) -> None:
        """Launch ``kernel`` with one CTA per (key block, kv head, batch entry) of K
        (``mK``: (Sk, D, Hkv, B)), on the subclass's ``grid``. masks: with
        ``masked``, (query intervals, query and key segment ids or None), and
        deterministic, the key blocks' walks."""
        num_n_blocks = cute.ceil_div(mK.shape[0], self.tile_n)
        masks = tuple(masks) + (None,) * (4 - len(masks))
        self.kernel(loads, outs, masks, tma_loads, atoms, layouts, mmas, bytes_qdo, bytes_kv,
                    SharedStorage).launch(
            grid=self.grid(num_n_blocks, cute.size(mK.shape[2]), cute.size(mK.shape[3])),
            block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(),
            stream=stream, min_blocks_per_mp=1, use_pdl=self.use_pdl)

    def grid(self, num_n_blocks, num_kv_heads, batch):
        return (num_n_blocks, num_kv_heads, batch)

    def cta_coords(self, mQ: cute.Tensor, mK: cute.Tensor):
        """(key block, kv head, batch entry) of this CTA."""
        return cute.arch.block_idx()

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        loads: tuple,  # TMA views of Q (Sq, D, Hq, B), K (Sk, D, Hkv, B), V (Sk, Dv, Hkv,
        # B), dO (Sq, Dv, Hq, B), LSElog2 and Dpsum (Sq_pad, Hq, B) f32
        outs: tuple,  # the subclass's outputs (its ``launch`` says), dQaccum first
        masks: tuple,  # (B, Sk, 2) query intervals, (B, Sq) / (B, Sk) segment ids,
        # (B, num_n, 2) key-block walks, or None each
        tma_loads: tuple,  # the TMA atoms of ``loads``
        atoms: tuple,  # the subclass's other TMA atoms
        layouts: tuple,  # SMEM layouts: Q, dO, K, V, the row statistics, ``smem_more``
        mmas: tuple,  # the subclass's tiled MMAs
        bytes_qdo: cutlass.Constexpr,  # an int, or split a pair (``load_atoms``)
        bytes_kv: cutlass.Constexpr[int],
        SharedStorage: cutlass.Constexpr,
    ):
        """One CTA: warp 0 prefetches the TMA descriptors, the shared memory and both
        pipelines are set up, with PDL every thread waits for the kernel before; then
        the roles split, each walking the CTA's work list: warp 0 ``load``s, warp 1
        runs the subclass's ``dq_warp``, the MMA warpgroups its ``mma``. setmaxnreg
        moves the first warpgroup's registers to the MMA warpgroups."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        mQ, mK = loads[0], loads[1]
        coords = self.cta_coords(mQ, mK)
        if warp_idx == 0:
            for atom in tma_loads + atoms:
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        pipe_qdo, pipe_do, pipe_kv = self.make_pipelines(storage, bytes_qdo, bytes_kv)
        names = ("sQ", "sdO", "sK", "sV", "sRow") + self.smem_more
        by_name = dict(zip(names, layouts, strict=True))
        smem = {}
        for name in ("sQ", "sdO", "sK", "sV") + self.smem_more + ("sLSE", "sDpsum"):
            layout = by_name.get(name, by_name["sRow"])
            field = getattr(storage, name)
            if const_expr(isinstance(layout, cute.ComposedLayout)):
                smem[name] = field.get_tensor(layout.outer, swizzle=layout.inner)
            else:
                smem[name] = field.get_tensor(layout)
        # Everything above only set up SMEM and barriers: no global memory yet.
        pdl_start(self.use_pdl)
        if const_expr(self.masked):
            # Note [K and V first]: masked, the walk's bounds are a global load away
            # (and, from the keys' intervals, a reduction); K and V go first, so
            # that their transfer hides that latency rather than follow it.
            if warp_idx == 0:
                self.load_kv(coords, loads, tma_loads, smem, pipe_kv, True)
        work, full = self.work_list(coords, mQ, mK, masks[0], masks[3])
        cta = Cta(coords=coords, work=work, masks=masks[:3], walks=masks[3], full=full,
                  seqlen_k=mK.shape[0], storage=storage, smem=smem, layouts=by_name,
                  pipe_qdo=pipe_qdo, pipe_do=pipe_do, pipe_kv=pipe_kv, outs=outs, atoms=atoms,
                  mmas=mmas)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.regs_producer)
            if warp_idx == 0:
                self.load(cta, loads, tma_loads)
            if warp_idx == 1:
                self.dq_warp(cta)
        else:
            cute.arch.setmaxregister_increase(self.regs_mma)
            self.mma(cta, tidx - 128)

    @cute.jit
    def wait_dq_turn(self, cta, head_q, m_block):
        """The deterministic dQ warp (the whole warp): the semaphore of query block
        ``m_block`` of ``head_q``, once lane 0 has seen it count this key block's
        rank (``det_add_rank``: ascending key blocks, causal descending; masked,
        ``masked_add_rank`` from the key blocks' walks, descending) with acquire
        loads, so the bulk reduces that follow come after the adds before them."""
        mdQsem = cta.outs[3]
        n_block, _, batch = cta.coords
        sem_ptr = mdQsem.iterator + cute.crd2idx((batch, head_q, m_block), mdQsem.layout)
        if const_expr(self.masked):
            rank = masked_add_rank(cta.walks, batch, n_block, m_block)  # every lane counts
        else:
            rank = det_add_rank(m_block, n_block, cute.ceil_div(cta.seqlen_k, self.tile_n),
                                self.tile_m, self.tile_n, self.causal, cutlass.min)
        if cute.arch.lane_idx() == 0:
            semaphore_wait(sem_ptr, rank)
        return sem_ptr

    def flat_dq_copy(self, thr_dq, sdQ: cute.Tensor, tidx, wg_idx):
        """(copy, SMEM destination) of this MMA thread's dQ registers: warpgroup w's,
        4 at a time, thread-interleaved, into floats [w P, (w + 1) P) of the partial
        (Note [Flat dQ accumulator] in dq_layout.py). thr_dq: the thread's slice of
        the dQ tiled MMA; tidx counted from the first MMA thread."""
        part = cute.size(thr_dq.partition_shape_C((self.tile_m, self.head_dim))) * 128
        r2s_dq = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128),
            cute.make_layout(128), cute.make_layout(4))
        tdQsdQ = r2s_dq.get_slice(tidx % 128).partition_D(cute.make_tensor(
            sdQ.iterator, cute.make_layout((part, self.num_mma_wg)))[None, wg_idx])
        return r2s_dq, tdQsdQ

    @cute.jit
    def dq_handoff(self, r2s_dq, acc_dQ, tdQsdQ, dq_bar_off, dq_threads):
        """The MMA side of the dQ hand-off: wait until the dQ warp's reduce has read
        this warpgroup's part, write this thread's registers (flat order), make them
        visible to the bulk engine, signal the dQ warp."""
        cute.arch.barrier(barrier_id=self.bar_dq_empty + dq_bar_off,
                          number_of_threads=dq_threads)
        cute.copy(r2s_dq, cute.make_tensor(acc_dQ.iterator, cute.make_layout(tdQsdQ.shape)),
                  tdQsdQ)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=self.bar_dq_full + dq_bar_off,
                                 number_of_threads=dq_threads)

    def make_pipelines(self, storage, bytes_qdo, bytes_kv: int):
        """(Q/dO/row-statistics pipeline, dO pipeline or None, K/V pipeline), all fed
        by TMA from warp 0 (Note [Split Q and dO stages])."""
        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        # One arrive per consumer warp (the pipeline elects lane 0 of each warp).
        consumer_group = pipeline.CooperativeGroup(
            pipeline.Agent.Thread, self.num_mma_threads // 32)
        bytes_q, pipe_do = bytes_qdo, None
        if const_expr(self.split_qdo):
            bytes_q, bytes_do = bytes_qdo
            pipe_do = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_do.data_ptr(), num_stages=self.stages_do,
                producer_group=producer_group, consumer_group=consumer_group,
                tx_count=bytes_do, defer_sync=True)
        pipe_qdo = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_qdo.data_ptr(), num_stages=self.stages_qdo,
            producer_group=producer_group, consumer_group=consumer_group,
            tx_count=bytes_q, defer_sync=True)
        # This one fences and syncs the CTA after both pipelines' mbarrier inits.
        pipe_kv = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1,
            producer_group=producer_group, consumer_group=consumer_group,
            tx_count=bytes_kv, defer_sync=False)
        return pipe_qdo, pipe_do, pipe_kv

    def work_list(self, coords, mQ: cute.Tensor, mK: cute.Tensor, mRanges, mWalks=None):
        """((group, m_block_min, num_m, num_iters), full): every (query head of the
        group, query block) pair that can see at least one key of this block, as
        ``num_iters = num_m * group`` items, and with ``masked`` (first full query
        block, end of the full ones, the warpgroups' peel bits) of the key block,
        else None. All roles walk the same list, so they agree on every barrier
        count. mQ, mK: (S, D, H, B) views. mWalks: the key blocks' walks
        (Note [Block walks] in rules/ranges.py), else the walk is reduced here from
        the keys' intervals (``BlockRange``; no peel)."""
        n_block, _, batch = coords
        group = mQ.shape[2] // mK.shape[2]
        m_block_max = cute.ceil_div(mQ.shape[0], self.tile_m)
        m_block_min = Int32(0)
        full = None
        if const_expr(self.masked):
            if const_expr(mWalks is not None):
                uniform = cute.arch.make_warp_uniform
                walk = [uniform(mWalks[batch, n_block, i]) for i in range(5)]
                m_block_min, m_block_max = walk[0], walk[1]
                full = (walk[2], walk[3], walk[4])
            else:
                blocks = BlockRange(mRanges, self.tile_n, self.tile_m, n_block, batch,
                                    mK.shape[0], at_least_one=False)
                m_block_min, m_block_max = blocks.first, blocks.end
                full = (blocks.full_first, blocks.full_end, Int32(0))
        elif const_expr(self.causal):
            # First query block holding a query >= this block's first key.
            m_block_min = cutlass.min(n_block * self.tile_n // self.tile_m, m_block_max)
        num_m = m_block_max - m_block_min
        return (group, m_block_min, num_m, num_m * group), full

    def work_item(self, it, head_kv, group, m_block_min, num_m):
        """(query head, query block) of work item ``it``."""
        h_off = it // num_m
        return head_kv * group + h_off, m_block_min + it - h_off * num_m

    @cute.jit
    def load(self, cta, loads, tma_loads):
        """Warp 0: K and V of this block once, then Q, dO and their row statistics
        per work item (one mbarrier transaction per item; split, one for Q and its
        LSE rows, one for dO and its Dpsum rows)."""
        mQ, _, _, mdO, mLSElog2, mDpsum = loads
        tma_Q, _, _, tma_dO, tma_LSE, tma_Dpsum = tma_loads
        n_block, head_kv, batch = cta.coords
        group, m_block_min, num_m, num_iters = cta.work
        smem, pipe_qdo, pipe_do, pipe_kv = cta.smem, cta.pipe_qdo, cta.pipe_do, cta.pipe_kv
        tm = self.tile_m
        d, dv = self.head_dim, self.head_dim_v
        if const_expr(not self.masked):  # masked, K and V are on their way already
            self.load_kv(cta.coords, loads, tma_loads, smem, pipe_kv, num_iters > 0)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                             self.stages_qdo)
        # Split: dO's own producer state (Note [Split Q and dO stages]); else unused.
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                self.stages_do)
        for it in cutlass.range(num_iters, unroll=1):
            head_q, m_block = self.work_item(it, head_kv, group, m_block_min, num_m)
            gQ = cute.local_tile(mQ[None, None, head_q, batch], (tm, d), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head_q, batch], (tm, dv), (None, 0))
            gLSE = cute.local_tile(mLSElog2[None, head_q, batch], (tm,), (None,))
            gDpsum = cute.local_tile(mDpsum[None, head_q, batch], (tm,), (None,))
            tQsQ, tQgQ = tma_tile_partition(tma_Q, smem["sQ"], gQ)
            tdOsdO, tdOgdO = tma_tile_partition(tma_dO, smem["sdO"], gdO)
            tLsL, tLgL = tma_tile_partition(tma_LSE, smem["sLSE"], gLSE, rank=1)
            tDsD, tDgD = tma_tile_partition(tma_Dpsum, smem["sDpsum"], gDpsum, rank=1)
            pipe_qdo.producer_acquire(state)
            bar = pipe_qdo.producer_get_barrier(state)
            s = state.index
            cute.copy(tma_Q, tQgQ[None, m_block], tQsQ[None, s], tma_bar_ptr=bar)
            cute.copy(tma_LSE, tLgL[None, m_block], tLsL[None, s], tma_bar_ptr=bar)
            if const_expr(self.split_qdo):  # Note [Split Q and dO stages]
                pipe_do.producer_acquire(do_state)
                cute.copy(tma_dO, tdOgdO[None, m_block], tdOsdO[None, do_state.index],
                          tma_bar_ptr=pipe_do.producer_get_barrier(do_state))
                cute.copy(tma_Dpsum, tDgD[None, m_block], tDsD[None, do_state.index],
                          tma_bar_ptr=pipe_do.producer_get_barrier(do_state))
                do_state.advance()
            if const_expr(not self.split_qdo):
                cute.copy(tma_dO, tdOgdO[None, m_block], tdOsdO[None, s], tma_bar_ptr=bar)
                cute.copy(tma_Dpsum, tDgD[None, m_block], tDsD[None, s], tma_bar_ptr=bar)
            state.advance()

    @cute.jit
    def load_kv(self, coords, loads, tma_loads, smem, pipe_kv, issue):
        """Warp 0: the TMA loads of this block's K and V tiles (one transaction), if
        ``issue``."""
        _, mK, mV = loads[:3]
        _, tma_K, tma_V = tma_loads[:3]
        n_block, head_kv, batch = coords
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.head_dim),
                             (n_block, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.head_dim_v),
                             (n_block, 0))
        tKsK, tKgK = tma_tile_partition(tma_K, smem["sK"], gK)
        tVsV, tVgV = tma_tile_partition(tma_V, smem["sV"], gV)
        if issue:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipe_kv.producer_acquire(kv_state)
            cute.copy(tma_K, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
            cute.copy(tma_V, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))

    @cute.jit
    def mma_start(self, pipe_kv, num_iters):
        """MMA warpgroups, before the walk: wait for K and V (loaded only if there
        is work, masked always); returns the first Q / dO consumer state."""
        # Note [K and V first]: a masked block with no work waits too, or the
        # epilogue's zeros written to the K and V tiles could land before the
        # tiles' own load and be overwritten, then stored as dK and dV.
        kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        if const_expr(self.masked):
            pipe_kv.consumer_wait(kv)
        else:
            if num_iters > 0:
                pipe_kv.consumer_wait(kv)
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                            self.stages_qdo)

    def key_mask(self, cta, tScS, keys: int):
        """masked: this thread's keys' intervals (``KeyRangeMask``), else None."""
        if const_expr(not self.masked):
            return None
        n_block, _, batch = cta.coords
        return KeyRangeMask(tScS, keys, self.tile_n, *cta.masks, n_block, batch, cta.seqlen_k)

    def segment_bits(self, kmask, tScS, m_block):
        """Segment ids: ``KeyRangeMask.segment_bits`` of query block m_block; else None.
        (A method of the kernel: the walk's loop may not call one of the mask's.)"""
        if const_expr(kmask is None):
            return None
        return kmask.segment_bits(tScS, m_block * self.tile_m)

    @cute.jit
    def mask_scores(self, S, tScS, keys: cutlass.Constexpr[int], m_block, n_block, key_limit,
                    kmask=None, full=None, bits=None):
        """S = -inf (P = 0) where the key is past seqlen_k (``key_limit`` keys of the
        block are valid) or, causal, after the query. S, tScS: (rows, cols) views of
        a thread's scores and their (row, col) coordinates in the block; ``keys``:
        the mode of the keys (0 for S^T, 1 for S). Only blocks holding such a key pay
        for the test: valid is key < min(key_limit, query - key0 + 1) in block
        coordinates, and the block's first query has the smallest causal limit.
        masked: ``kmask`` (``KeyRangeMask``) masks the blocks outside ``cta.full``
        (with segment ids also by ``bits``, its ``segment_bits`` of the item).
        """
        if const_expr(kmask is not None):
            full_first, full_end = full[0], full[1]
            kmask.apply(S, tScS, m_block * self.tile_m,
                        BlockRange.masked_block(m_block, full_first, full_end), bits)
        else:
            self._mask_seqlen_causal(S, tScS, keys, m_block, n_block, key_limit)

    @cute.jit
    def _mask_seqlen_causal(self, S, tScS, keys: cutlass.Constexpr[int], m_block, n_block,
                            key_limit):
        queries = 1 - keys
        causal_off = m_block * self.tile_m - n_block * self.tile_n + 1
        first_limit = key_limit
        if const_expr(self.causal):
            first_limit = cutlass.min(key_limit, causal_off)
        if first_limit < self.tile_n:
            for q in cutlass.range_constexpr(cute.size(tScS, mode=[queries])):
                limit = key_limit
                if const_expr(self.causal):
                    limit = cutlass.min(limit, tScS[_at(keys, 0, q)][queries] + causal_off)
                for k in cutlass.range_constexpr(cute.size(tScS, mode=[keys])):
                    at = _at(keys, k, q)
                    S[at] = S[at] if tScS[at][keys] < limit else -Float32.inf


class KeyRangeMask:
    """The intervals of the queries that see this thread's keys (rules/ranges.py),
    applied to a (rows, cols) view of a thread's scores; ``keys`` is the mode that
    holds the keys (0 for S^T, 1 for S). The intervals are read (from L1) when a
    block needs the mask: the MMA warpgroups have no registers to hold them across
    the walk.

    With segment ids, keys whose document is not contiguous also compare the ids of
    each query: ``segment_bits`` does that before the item's GEMMs are issued (their
    accumulators are not live yet), into one keep bit per score, which ``apply``
    then reads; comparing after S arrived spilled the MMA warpgroups' registers."""

    def __init__(self, tScS, keys: int, tile_n: int, mRanges, mQSeg, mKSeg, n_block, batch,
                 seqlen_k):
        self.keys, self.tile_n = keys, tile_n
        self.mRanges, self.mQSeg, self.mKSeg = mRanges, mQSeg, mKSeg
        self.n_block, self.batch, self.seqlen_k = n_block, batch, seqlen_k
        self.n_k = cute.size(tScS, mode=[keys])
        self.n_q = cute.size(tScS, mode=[1 - keys])
        self.n_words = (self.n_k * self.n_q + 31) // 32

    def _key(self, tScS, k: int):
        keys = self.keys
        return cutlass.min(self.n_block * self.tile_n + tScS[_at(keys, k, 0)][keys],
                           self.seqlen_k - 1)

    @cute.jit
    def segment_bits(self, tScS, query0) -> cute.Tensor | None:
        """Keep bits of this thread's scores for the item of queries from ``query0``
        (bit k * n_q + q: key k, query q): clear where the key's document is not
        contiguous and the ids differ. None without segment ids."""
        if cutlass.const_expr(self.mQSeg is None):
            return None
        keys = self.keys
        queries = 1 - keys
        words = cute.make_rmem_tensor(self.n_words, Int32)
        words.fill(-1)
        any_cmp = Int32(0)
        for k in cutlass.range_constexpr(self.n_k):
            raw = self.mRanges[self.batch, self._key(tScS, k), 1]
            any_cmp = any_cmp | cutlass.select_(raw < 0, Int32(1), Int32(0))
        if any_cmp != 0:
            num_q = self.mQSeg.shape[1]
            for w in cutlass.range_constexpr(self.n_words):
                words[w] = Int32(0)
            for k in cutlass.range_constexpr(self.n_k):
                key = self._key(tScS, k)
                exact = self.mRanges[self.batch, key, 1] >= 0
                kseg = self.mKSeg[self.batch, key]
                for q in cutlass.range_constexpr(self.n_q):
                    query = cutlass.min(query0 + tScS[_at(keys, k, q)][queries], num_q - 1)
                    keep = exact | (self.mQSeg[self.batch, query] == kseg)
                    e = k * self.n_q + q
                    words[e // 32] = words[e // 32] | cutlass.select_(
                        keep, Int32(1 << (e % 32)) if e % 32 < 31 else Int32(-(1 << 31)),
                        Int32(0))
        return words

    @cute.jit
    def apply(self, S, tScS, query0, when, bits=None):
        """S = -inf where the query (``query0`` + its block coordinate) is outside its
        key's interval, or where ``bits`` (``segment_bits``) clear it; only where
        the run-time Boolean ``when`` holds."""
        if when:
            self._select(S, tScS, query0, bits)

    @cute.jit
    def _select(self, S, tScS, query0, bits):
        keys = self.keys
        queries = 1 - keys
        neg_inf = -Float32.inf
        for k in cutlass.range_constexpr(self.n_k):
            key = self._key(tScS, k)
            hi, _ = decode_hi(self.mRanges[self.batch, key, 1])
            lo = self.mRanges[self.batch, key, 0]
            width = cutlass.max(hi - lo, 0)
            lo = lo - query0
            for q in cutlass.range_constexpr(self.n_q):
                at = _at(keys, k, q)
                S[at] = keep_inside(S[at], tScS[at][queries], lo, width)
        if cutlass.const_expr(bits is not None):
            for k in cutlass.range_constexpr(self.n_k):
                for q in cutlass.range_constexpr(self.n_q):
                    at = _at(keys, k, q)
                    e = k * self.n_q + q
                    keep = (Uint32(bits[e // 32]) >> (e % 32)) & Uint32(1)
                    S[at] = Float32(cutlass.select_(keep != Uint32(0), S[at], neg_inf))


def _at(keys: int, k: int, q: int) -> tuple[int, int]:
    """The (row, col) of key k, query q in a view whose mode ``keys`` holds the keys."""
    return (k, q) if keys == 0 else (q, k)
