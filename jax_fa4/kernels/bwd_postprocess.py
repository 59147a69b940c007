"""Backward postprocess: dQ = softmax_scale * dQaccum, cast and transposed.

The main backward kernel accumulates the unscaled dQ of each (batch, head) in
fp32 as one contiguous (Sq_pad, D) block. This kernel applies the softmax scale,
rounds to the input dtype and writes dQ in the layout of q, (B, Sq, Hq, D),
dropping the padding rows.

Architecture neutral and memory bound: one CTA moves a `tile_m x D` block of one
(batch, head). Each thread loads 8 consecutive floats (two 128-bit loads) and
stores them as 8 halves (one 128-bit store), so reads and writes are both
vectorized and coalesced along D.
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


def postprocess_tiling(head_dim: int) -> tuple[int, int]:
    """(tile_m, num_threads) per head dim: the tuning table of this kernel.

    A thread holds tile_m * D / num_threads floats; 32 measured best on the
    H200 at B=4, S=4096, H=16, D=128 (50.6 us against 53.2 us for 64). tile_m
    divides SEQLEN_Q_PAD so no block reads past the padded accumulator.
    """
    if head_dim <= 128:
        return 64, 256
    return 32, 256


class FlashBwdPostprocess:
    """dQ (B, Sq, Hq, D) = softmax_scale * dQaccum[:, :, :Sq, :], in dtype.

    Compile-time: dtype (bf16/fp16), head_dim, softmax_scale. Batch, seqlen and
    heads are dynamic.
    """

    def __init__(self, dtype, head_dim: int, softmax_scale: float):
        if cutlass is None:
            raise ImportError("FlashBwdPostprocess needs nvidia-cutlass-dsl")
        if head_dim % 8:
            raise ValueError(f"head_dim must be a multiple of 8, got {head_dim}")
        self.dtype = _cutlass_dtype(dtype)
        self.head_dim = head_dim
        self.softmax_scale = float(softmax_scale)
        self.tile_m, self.num_threads = postprocess_tiling(head_dim)
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
        # Both copies give a thread the same 8 consecutive elements of a row:
        # two 128-bit fp32 loads feed one 128-bit 16-bit store, no shuffling.
        vec = 128 // self.dtype.width
        copy_acc, _ = row_tiled_copy(Float32, self.head_dim, self.num_threads, vec)
        copy_dq, _ = row_tiled_copy(self.dtype, self.head_dim, self.num_threads)
        grid = (cute.ceil_div(sdQ.shape[0], self.tile_m), sdQ.shape[2], sdQ.shape[3])
        self.kernel(sdQaccum, sdQ, copy_acc, copy_dq).launch(
            grid=grid, block=(self.num_threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mdQaccum: cute.Tensor,  # (Sq_pad, D, Hq, B) f32
        mdQ: cute.Tensor,  # (Sq, D, Hq, B)
        copy_acc: cute.TiledCopy,
        copy_dq: cute.TiledCopy,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
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


__all__ = ["FlashBwdPostprocess", "postprocess_tiling"]
