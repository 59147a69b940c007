"""Backward postprocess: dQ = softmax_scale * dQaccum, cast and transposed.

The main backward kernel accumulates the unscaled dQ of each (batch, head) in
fp32 as one contiguous (Sq_pad, D) block. This kernel applies the softmax scale,
rounds to the input dtype and writes dQ in the layout of q, (B, Sq, Hq, D),
dropping the padding rows.

Row-major accumulator (sm100): architecture neutral
and memory bound; one CTA moves a `tile_m x D` block of one (batch, head). Each
thread loads 8 consecutive floats (two 128-bit loads) and stores them as 8 halves
(one 128-bit store), so reads and writes are both vectorized and coalesced along D.

Flat accumulator (`flat_tile_m`, every sm90 backward; Note [Flat dQ accumulator]
in dq_layout.py): one CTA of two warpgroups per query block of the
main kernel. Each thread loads the 128-bit chunks its namesake MMA thread stored
(coalesced), which fills the very register fragment of the main kernel's dQ GEMM;
the fragment is scaled, rounded and written to SMEM with stmatrix through the same
tiled MMA, and one TMA store (clipping rows past Sq) writes the (tile_m x D) tile.
"""

from __future__ import annotations

from jax_fa4.kernels.bwd_preprocess import (
    SEQLEN_Q_PAD,
    _cutlass_dtype,
    bhsd_view,
    bshd_view,
    cute,
    row_tiled_copy,
)

try:  # The kernel needs the CuTe DSL; importing this module must not.
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import Float32, const_expr
except ImportError:  # pragma: no cover - exercised only without nvidia-cutlass-dsl
    cutlass = None


# (main kernel's tile_m, head dim) of the sm90 backwards' flat accumulators: the
# hdim 64 / 96 / 128 kernel's, and the wide kernel's at 192 and 256.
_FLAT_TILES = {(m, d) for m in (64, 128) for d in (64, 96, 128)} | {(64, 192), (64, 256)}


def postprocess_tiling(head_dim: int) -> tuple[int, int]:
    """(tile_m, num_threads) per head dim: the tuning table of this kernel.

    A thread holds tile_m * D / num_threads floats; 32 measured best on the
    H200. tile_m divides SEQLEN_Q_PAD so no block reads past the padded
    accumulator.
    """
    if head_dim <= 128:
        return 64, 256
    return 32, 256


class FlashBwdPostprocess:
    """dQ (B, Sq, Hq, D) = softmax_scale * dQaccum[:, :, :Sq, :], in dtype.

    Compile-time: dtype (bf16/fp16), head_dim, softmax_scale. Batch, seqlen and
    heads are dynamic.
    """

    def __init__(self, dtype, head_dim: int, softmax_scale: float,
                 flat_tile_m: int | None = None, use_pdl: bool = False):
        if cutlass is None:
            raise ImportError("FlashBwdPostprocess needs nvidia-cutlass-dsl")
        if head_dim % 8:
            raise ValueError(f"head_dim must be a multiple of 8, got {head_dim}")
        self.dtype = _cutlass_dtype(dtype)
        self.head_dim = head_dim
        self.softmax_scale = float(softmax_scale)
        # Launched with programmatic dependent launch (``cute_utils.pdl_start``).
        self.use_pdl = use_pdl
        self.tile_m, self.num_threads = postprocess_tiling(head_dim)
        # The main kernel's query tile when dQaccum is in flat order, else None.
        self.flat_tile_m = flat_tile_m
        if flat_tile_m is not None:
            if (flat_tile_m, head_dim) not in _FLAT_TILES:
                raise ValueError(f"no flat dQ accumulator for tile_m {flat_tile_m}, "
                                 f"head_dim {head_dim}")
            self.tile_m, self.num_threads = flat_tile_m, 256
        assert SEQLEN_Q_PAD % self.tile_m == 0

    @cute.jit
    def __call__(
        self,
        stream: cuda.CUstream,
        mdQaccum: cute.Tensor,  # (B, Hq, Sq_pad, D) f32, unscaled
        mdQ: cute.Tensor,  # (B, Sq, Hq, D) bf16/fp16, out
    ):
        if const_expr(mdQaccum.element_type != Float32):
            raise TypeError("dQaccum must be float32")
        if const_expr(mdQ.element_type != self.dtype):
            raise TypeError("dQ must have the kernel's dtype")
        sdQaccum = bhsd_view(mdQaccum, self.head_dim)  # (Sq_pad, D, Hq, B)
        sdQ = bshd_view(mdQ, self.head_dim)  # (Sq, D, Hq, B)
        if const_expr(self.flat_tile_m is not None):
            self.launch_flat(stream, sdQaccum, sdQ)
        else:
            self.launch_rows(stream, sdQaccum, sdQ)

    @cute.jit
    def launch_rows(self, stream: cuda.CUstream, sdQaccum: cute.Tensor, sdQ: cute.Tensor):
        # Both copies give a thread the same 8 consecutive elements of a row:
        # two 128-bit fp32 loads feed one 128-bit 16-bit store, no shuffling.
        vec = 128 // self.dtype.width
        copy_acc, _ = row_tiled_copy(Float32, self.head_dim, self.num_threads, vec)
        copy_dq, _ = row_tiled_copy(self.dtype, self.head_dim, self.num_threads)
        grid = (cute.ceil_div(sdQ.shape[0], self.tile_m), sdQ.shape[2], sdQ.shape[3])
        self.kernel(sdQaccum, sdQ, copy_acc, copy_dq).launch(
            grid=grid, block=(self.num_threads, 1, 1), stream=stream, use_pdl=self.use_pdl
        )

    @cute.kernel
    def kernel(
        self,
        mdQaccum: cute.Tensor,  # (Sq_pad, D, Hq, B) f32
        mdQ: cute.Tensor,  # (Sq, D, Hq, B)
        copy_acc: cute.TiledCopy,
        copy_dq: cute.TiledCopy,
    ):
        from jax_fa4.kernels.cute_utils import block_idx_heads_last_first, pdl_start

        pdl_start(self.use_pdl)  # dQaccum comes from the main kernel
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = block_idx_heads_last_first()
        rows_left = mdQ.shape[0] - m_block * self.tile_m

        blk = (self.tile_m, self.head_dim)
        # (tile_m, D) blocks of this (batch, head)
        gAcc = cute.local_tile(mdQaccum[None, None, head, batch], blk, (m_block, 0))
        gdQ = cute.local_tile(mdQ[None, None, head, batch], blk, (m_block, 0))
        thr_acc = copy_acc.get_slice(tidx)
        thr_dq = copy_dq.get_slice(tidx)
        tAgAcc = thr_acc.partition_S(gAcc)  # (CPY, CPY_M, CPY_K)
        tQgdQ = thr_dq.partition_D(gdQ)  # (CPY, CPY_M, CPY_K)
        cdQ = cute.make_identity_tensor(blk)
        tQcdQ = thr_dq.partition_D(cdQ)
        # Thread 0's row coordinates are compile-time constants: one hoisted limit.
        t0QcdQ = copy_dq.get_slice(0).partition_D(cdQ)
        row_limit = rows_left - tQcdQ[0][0]

        # Rows past Sq are padding: neither read nor written.
        tArAcc = cute.make_rmem_tensor_like(tAgAcc)
        for m in cutlass.range_constexpr(cute.size(tAgAcc, mode=[1])):
            if t0QcdQ[0, m, 0][0] < row_limit:
                cute.copy(copy_acc, tAgAcc[None, m, None], tArAcc[None, m, None])
        tQrdQ = cute.make_rmem_tensor_like(tQgdQ)
        tQrdQ.store((tArAcc.load() * self.softmax_scale).to(self.dtype))
        for m in cutlass.range_constexpr(cute.size(tQgdQ, mode=[1])):
            if t0QcdQ[0, m, 0][0] < row_limit:
                cute.copy(copy_dq, tQrdQ[None, m, None], tQgdQ[None, m, None])


    @cute.jit
    def launch_flat(self, stream: cuda.CUstream, sdQaccum: cute.Tensor, sdQ: cute.Tensor):
        from cutlass.cute.nvgpu import cpasync

        from jax_fa4.kernels.sm90_bwd_common import dq_tile_layout, dq_tiled_mma

        tm, d = self.tile_m, self.head_dim
        mma = dq_tiled_mma(self.dtype, tm, d)
        sdQ_layout = dq_tile_layout(self.dtype, tm, d)
        tma, gdQ = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), sdQ,
                                               sdQ_layout, (tm, d))

        @cute.struct
        class Storage:
            sdQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdQ_layout)],
                                   1024]

        grid = (cute.ceil_div(sdQ.shape[0], tm), sdQ.shape[2], sdQ.shape[3])
        self.kernel_flat(sdQaccum, gdQ, tma, mma, sdQ_layout, Storage).launch(
            grid=grid, block=(self.num_threads, 1, 1), smem=Storage.size_in_bytes(),
            stream=stream, use_pdl=self.use_pdl)

    @cute.kernel
    def kernel_flat(
        self,
        mdQaccum: cute.Tensor,  # (Sq_pad, D, Hq, B) f32, query blocks in flat order
        mdQ: cute.Tensor,  # TMA view (Sq, D, Hq, B)
        tma: cute.CopyAtom,
        mma: cute.TiledMma,
        sdQ_layout: cute.ComposedLayout,
        Storage: cutlass.Constexpr,
    ):
        from jax_fa4.kernels.cute_utils import (
            block_idx_heads_last_first,
            pdl_start,
            stmatrix_acc,
            tma_store_tile,
        )

        pdl_start(self.use_pdl)  # dQaccum comes from the main kernel
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = block_idx_heads_last_first()
        tm, d = self.tile_m, self.head_dim
        wg = cute.arch.make_warp_uniform(tidx // 128)
        storage = cutlass.utils.SmemAllocator().allocate(Storage)
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)

        # This thread's chunks: 4 floats every 512, as its MMA namesake stored them.
        thr_mma = mma.get_slice(tidx)
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((tm, d)), Float32)
        part = cute.size(acc) * 128
        gblk = cute.local_tile(mdQaccum[None, None, head, batch], (tm, d), (m_block, 0))
        gpart = cute.make_tensor(gblk.iterator, cute.make_layout((part, 2)))[None, wg]
        g2r = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128),
            cute.make_layout(128), cute.make_layout(4))
        tg = g2r.get_slice(tidx % 128).partition_S(gpart)
        cute.copy(g2r, tg, cute.make_tensor(acc.iterator, cute.make_layout(tg.shape)))

        rdQ = cute.make_fragment_like(acc, self.dtype)
        rdQ.store((acc.load() * self.softmax_scale).to(self.dtype))
        stmatrix_acc(rdQ, mma, sdQ, tidx, self.dtype)
        # The st.matrix writes must be visible to the TMA engine before it reads.
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()
        if tidx == 0:
            tma_store_tile(tma, sdQ, cute.local_tile(mdQ[None, None, head, batch], (tm, d),
                                                     (m_block, 0)))
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)


__all__ = ["FlashBwdPostprocess", "postprocess_tiling"]
