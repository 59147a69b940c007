"""Backward preprocess: Dpsum, LSE in base 2, and a zeroed dQ accumulator.

Runs once before the main backward kernel. Per query row i of every
(batch, head) it computes

    Dpsum[i]   = sum_d dO[i, d] * O[i, d]  -  dLSE[i]      (fp32)
    LSElog2[i] = LSE[i] * log2(e)

(``FlashBwdPreprocessNoDlse``: without the dLSE term, for a backward whose LSE
cotangent is a symbolic zero; no zero-filled dLSE is made or read then)

and zeroes the whole fp32 dQ accumulator, padding rows included, because the
main kernel adds into it (none where the main kernel writes dQ itself: Note [One
key block per query block] in sm90_bwd.py).

The kernel is architecture neutral (plain vectorized global loads and stores,
warp shuffles): the same code compiles for sm_90a and sm_100a. It is memory
bound; one CTA streams a `tile_m x head_dim_v` block of O and dO of one
(batch, head) through registers, threads of a row group cooperating over the
head dimension, and zeroes the matching `tile_m x head_dim` block of dQaccum.

`bwd_workspace_shapes` is pure Python so that the JAX side can size the
workspaces on machines without the CuTe DSL.

Note [Pre / post order]
~~~~~~~~~~~~~~~~~~~~~~~
The main backward kernel walks (batch, head) pairs from the first to the last (its
LPT order too, in sections of heads). So when it ends, L2 still holds the dQ
accumulator of its last heads, which a postprocess in grid order would read last,
after the others have evicted them. Both the preprocess and the postprocess
therefore walk (batch, head) from the last to the first
(``block_idx_heads_last_first``): the postprocess reads the main kernel's last dQ
partials from L2 while they are there (it is bound by DRAM), and the preprocess
leaves in L2 the O / dO rows and zeroed dQaccum blocks of the heads the main kernel
starts with. It matters at short sequences, where the postprocess is a noticeable
part of the backward.
"""

from __future__ import annotations

import math

import numpy as np

# Sq_pad is a multiple of SEQLEN_Q_PAD: a backward Q tile of 64 or 128 rows is
# always a whole block of dQaccum, so its reduce-add never runs off the end.
SEQLEN_Q_PAD = 128


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def seqlen_q_padded(seqlen_q: int) -> int:
    """Sq_pad: round_up(Sq, 128)."""
    return _round_up(seqlen_q, SEQLEN_Q_PAD)


def bwd_workspace_shapes(
    batch: int, seqlen_q: int, heads_q: int, head_dim: int, tile_m: int | None = None
) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shapes and dtypes of the fp32 workspaces the backward pass needs.

    Args:
      batch, seqlen_q, heads_q: B, Sq, Hq of the query.
      head_dim: D, the query/key head dim (dQ has this width).
      tile_m: the main kernel's query tile, if known; it must divide 128, so that
        every query tile is a whole block of the workspaces.

    Returns:
      name -> (shape, dtype) for
        Dpsum   (B, Hq, Sq_pad)      f32: rowsum(dO * O) - dLSE; 0 past Sq
        LSElog2 (B, Hq, Sq_pad)      f32: LSE * log2(e); +inf past Sq
        dQaccum (B, Hq, Sq_pad, D)   f32: zeroed here, Sq_pad = seqlen_q_padded(Sq)

    The statistics are padded like dQaccum so that a main kernel can load a whole
    block of them with one aligned bulk copy, and so that padding queries get
    P = exp2(s - inf) = 0 without a bounds test.
    """
    if tile_m is not None and SEQLEN_Q_PAD % tile_m:
        raise ValueError(f"a query tile of {tile_m} rows does not divide {SEQLEN_Q_PAD}")
    f32 = np.dtype(np.float32)
    seqlen_q_pad = seqlen_q_padded(seqlen_q)
    return {
        "Dpsum": ((batch, heads_q, seqlen_q_pad), f32),
        "LSElog2": ((batch, heads_q, seqlen_q_pad), f32),
        "dQaccum": ((batch, heads_q, seqlen_q_pad, head_dim), f32),
    }


def stat_position(row, block: int):
    """Where query row ``row``'s LSElog2 / Dpsum go in a workspace laid out for a
    main kernel that reads them by thread (``BwdTiles.stats`` "by_thread"), for plain
    ints, numpy arrays and DSL integers alike.

    Within each aligned block of ``block`` rows (the main kernel's query tile, a
    multiple of 16 that divides SEQLEN_Q_PAD), the wgmma accumulator gives lane quad
    q the columns 8 j + 2 q + e (e = 0, 1). In the thread's register order
    (r = 2 j + e) they form chunks of 4 (r // 4 = j // 2); chunk k of quad q goes to
    16 k + 4 q, so each chunk is one 128-bit load and the four quads' chunks k are
    64 contiguous bytes (no bank conflict; whole runs per quad, 64 or 128 bytes
    apart, put 2 or 4 quads on the same banks). Identity order: ``block`` None."""
    if block is None:
        return row
    c = row % block
    return row - c + c // 16 * 16 + (c % 8 // 2) * 4 + (c // 8 % 2) * 2 + c % 2


def stat_order(seqlen_q_pad: int, block: int | None) -> np.ndarray:
    """The row stored at each position of a Sq_pad-long statistics workspace laid
    out by ``stat_position`` (host side: jnp references and tests permute with it)."""
    rows = np.arange(seqlen_q_pad)
    order = np.empty_like(rows)
    order[stat_position(rows, block)] = rows
    return order


def check_stat_block(block: int | None) -> None:
    """A by-thread statistics block must be a multiple of 16 dividing SEQLEN_Q_PAD, so
    that every block of a workspace is whole and the order stays inside it."""
    if block is not None and (block % 16 or SEQLEN_Q_PAD % block):
        raise ValueError(f"statistics block {block} must be a multiple of 16 dividing "
                         f"{SEQLEN_Q_PAD}")


try:  # The kernel needs the CuTe DSL; the workspace helper above does not.
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import Float32, const_expr, cute

    from jax_fa4.config import LOG2_E
except ImportError:  # pragma: no cover - exercised only without nvidia-cutlass-dsl
    cutlass = None

    class _NoCute:
        """Stands in for `cute` so the kernel classes still define (their
        annotations are strings); constructing one raises ImportError."""

        @staticmethod
        def jit(fn):
            return fn

        kernel = jit

    cute = _NoCute()

def _cutlass_dtype(dtype):
    """Accept a cutlass numeric type or anything numpy/JAX calls bf16/fp16."""
    if isinstance(dtype, type) and issubclass(dtype, cutlass.Numeric):
        return dtype
    name = np.dtype(dtype).name
    table = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
    if name not in table:
        raise TypeError(f"backward pre/postprocess supports bf16 and fp16, got {name}")
    return table[name]


def _threads_per_row(head_dim: int, elems_per_vec: int, max_threads: int) -> int:
    """Threads that share one row: a power of two (so the row sum is a warp
    butterfly over aligned lanes), dividing the row's vector count."""
    vecs = head_dim // elems_per_vec
    tpr = 1
    while tpr * 2 <= max_threads and vecs % (tpr * 2) == 0:
        tpr *= 2
    return tpr


def preprocess_tiling(head_dim_v: int) -> tuple[int, int]:
    """(tile_m, num_threads) per head dim: the tuning table of this kernel.

    tile_m divides SEQLEN_Q_PAD so the grid of Sq_pad / tile_m CTAs zeroes
    dQaccum exactly. A thread holds tile_m * Dv / num_threads values of O and
    as many of dO; 32 each (about 45 registers, 5 CTAs per SM) measured best on
    the H200.
    """
    if head_dim_v <= 128:
        return 64, 256
    return 32, 256


def bshd_view(t, head_dim: int):
    """(B, S, H, D) row-major -> (S, D, H, B) with a compile-time D.

    Rebuilding the compact layout with D static makes every row start provably
    16-byte aligned whatever divisibility hints the bridge was given, so the
    copies vectorize to 128 bits.
    """
    b, s, h = t.shape[0], t.shape[1], t.shape[2]
    row = cute.assume(cutlass.Int64(h) * head_dim, divby=head_dim)
    batch = cute.assume(row * s, divby=head_dim)
    layout = cute.make_layout((s, head_dim, h, b), stride=(row, 1, head_dim, batch))
    return cute.make_tensor(t.iterator, layout)


def bhs_view(t):
    """(B, H, S) row-major -> (S, H, B)."""
    b, h, s = t.shape[0], t.shape[1], t.shape[2]
    layout = cute.make_layout((s, h, b), stride=(1, s, cutlass.Int64(s) * h))
    return cute.make_tensor(t.iterator, layout)


def bhsd_view(t, head_dim: int):
    """(B, H, S_pad, D) row-major -> (S_pad, D, H, B) with a compile-time D."""
    b, h, s = t.shape[0], t.shape[1], t.shape[2]
    head = cute.assume(cutlass.Int64(s) * head_dim, divby=head_dim)
    batch = cute.assume(head * h, divby=head_dim)
    layout = cute.make_layout((s, head_dim, h, b), stride=(head_dim, 1, head, batch))
    return cute.make_tensor(t.iterator, layout)


def row_tiled_copy(dtype, head_dim: int, num_threads: int, elems_per_thread: int = 0):
    """Tiled copy of a (rows, head_dim) block: 128-bit vectors along D,
    consecutive threads on consecutive vectors of a row (coalesced).

    elems_per_thread (default: one 128-bit vector) lets an fp32 source and a
    16-bit destination share one thread-value layout.
    """
    vec = 128 // dtype.width
    elems = elems_per_thread or vec
    tpr = _threads_per_row(head_dim, elems, min(32, num_threads))
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    thr_layout = cute.make_ordered_layout((num_threads // tpr, tpr), order=(1, 0))
    val_layout = cute.make_layout((1, elems))
    return cute.make_tiled_copy_tv(atom, thr_layout, val_layout), tpr


class FlashBwdPreprocess:
    """Dpsum = rowsum(dO * O) - dLSE, LSElog2 = LSE * log2(e), dQaccum = 0.

    Compile-time: dtype (bf16/fp16), head_dim_v (width of O/dO), head_dim
    (width of dQaccum), stat_block (None: LSElog2 / Dpsum in row order; else in
    the by-thread order of ``stat_position`` for a main kernel with that query tile),
    zero_dq (False: no dQaccum at all, for a main kernel that stores dQ itself, Note
    [One key block per query block] in sm90_bwd.py; the call then ends at mLSElog2).
    Batch, seqlen and heads are dynamic.
    """

    def __init__(self, dtype, head_dim_v: int, head_dim: int, stat_block: int | None = None,
                 use_pdl: bool = False, zero_dq: bool = True):
        if cutlass is None:
            raise ImportError("FlashBwdPreprocess needs nvidia-cutlass-dsl")
        if head_dim_v % 8 or head_dim % 8:
            raise ValueError(f"head dims must be multiples of 8, got {head_dim_v}, {head_dim}")
        self.dtype = _cutlass_dtype(dtype)
        self.head_dim_v = head_dim_v
        self.head_dim = head_dim
        check_stat_block(stat_block)
        # LSElog2 / Dpsum in the main kernel's by-thread order (``stat_position``).
        self.stat_block = stat_block
        # Launched with programmatic dependent launch (``cute_utils.pdl_start``).
        self.use_pdl = use_pdl
        self.zero_dq = zero_dq
        self.tile_m, self.num_threads = preprocess_tiling(head_dim_v)
        assert SEQLEN_Q_PAD % self.tile_m == 0
        assert self.tile_m <= self.num_threads  # one thread per row moves LSE
        # The zeroing copy moves 4 floats per thread per step over a flat tile.
        assert (self.tile_m * head_dim // 4) % self.num_threads == 0

    @cute.jit
    def __call__(
        self,
        stream: cuda.CUstream,
        mO: cute.Tensor,  # (B, Sq, Hq, Dv) bf16/fp16
        mdO: cute.Tensor,  # (B, Sq, Hq, Dv) same dtype
        mLSE: cute.Tensor,  # (B, Hq, Sq) f32, natural log
        mdLSE: cute.Tensor,  # (B, Hq, Sq) f32, cotangent of LSE
        mDpsum: cute.Tensor,  # (B, Hq, Sq_pad) f32, out
        mLSElog2: cute.Tensor,  # (B, Hq, Sq_pad) f32, out
        *accum: cute.Tensor,  # with ``zero_dq``: mdQaccum (B, Hq, Sq_pad, D) f32, out:
        # zeroed
    ):
        self.launch(stream, mO, mdO, mLSE, mdLSE, mDpsum, mLSElog2, *accum)

    @cute.jit
    def launch(self, stream: cuda.CUstream, mO: cute.Tensor, mdO: cute.Tensor,
               mLSE: cute.Tensor, mdLSE: cute.Tensor | None, mDpsum: cute.Tensor,
               mLSElog2: cute.Tensor, mdQaccum: cute.Tensor | None = None):
        """The launch behind ``__call__``; mdLSE None: no LSE cotangent
        (``FlashBwdPreprocessNoDlse``)."""
        if const_expr(mO.element_type != self.dtype or mdO.element_type != self.dtype):
            raise TypeError("O and dO must have the kernel's dtype")
        for t in (mLSE, mdLSE, mDpsum, mLSElog2, mdQaccum):
            if const_expr(t is not None and t.element_type != Float32):
                raise TypeError("LSE, dLSE and the workspaces must be float32")

        sO = bshd_view(mO, self.head_dim_v)  # (Sq, Dv, Hq, B)
        sdO = bshd_view(mdO, self.head_dim_v)  # (Sq, Dv, Hq, B)
        sLSE, sDpsum, sLSElog2 = [bhs_view(t) for t in (mLSE, mDpsum, mLSElog2)]
        sdLSE = None if const_expr(mdLSE is None) else bhs_view(mdLSE)
        sdQaccum = None
        if const_expr(self.zero_dq):
            # (Sq_pad * D, Hq, B): each head's accumulator is one contiguous run.
            b, h, s_pad = mdQaccum.shape[0], mdQaccum.shape[1], mdQaccum.shape[2]
            head_elems = cute.assume(cutlass.Int64(s_pad) * self.head_dim,
                                     divby=self.head_dim)
            sdQaccum = cute.make_tensor(
                mdQaccum.iterator,
                cute.make_layout(
                    (s_pad * self.head_dim, h, b),
                    stride=(1, head_elems, cute.assume(head_elems * h, divby=self.head_dim)),
                ),
            )

        copy_o, tpr = row_tiled_copy(self.dtype, self.head_dim_v, self.num_threads)
        zero_atom = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128
        )
        copy_zero = cute.make_tiled_copy_tv(
            zero_atom, cute.make_layout(self.num_threads), cute.make_layout(4)
        )
        # Sq_pad / tile_m blocks cover every row of dQaccum; blocks past Sq only zero.
        grid = (cute.ceil_div(mDpsum.shape[2], self.tile_m), mDpsum.shape[1], mDpsum.shape[0])
        self.kernel(
            sO, sdO, sLSE, sdLSE, sDpsum, sLSElog2, sdQaccum, copy_o, copy_zero, tpr
        ).launch(grid=grid, block=(self.num_threads, 1, 1), stream=stream,
                 use_pdl=self.use_pdl)

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,  # (Sq, Dv, Hq, B)
        mdO: cute.Tensor,  # (Sq, Dv, Hq, B)
        mLSE: cute.Tensor,  # (Sq, Hq, B)
        mdLSE: cute.Tensor | None,  # (Sq, Hq, B); None: no LSE cotangent
        mDpsum: cute.Tensor,  # (Sq, Hq, B)
        mLSElog2: cute.Tensor,  # (Sq, Hq, B)
        mdQaccum: cute.Tensor | None,  # (Sq_pad * D, Hq, B); None: ``zero_dq`` off
        copy_o: cute.TiledCopy,
        copy_zero: cute.TiledCopy,
        threads_per_row: cutlass.Constexpr[int],
    ):
        from jax_fa4.kernels.cute_utils import block_idx_heads_last_first, pdl_start

        # O, dO and LSE may come from the kernel before; dQaccum may be a buffer it
        # still reads.
        pdl_start(self.use_pdl)
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = block_idx_heads_last_first()
        tile_m = self.tile_m
        seqlen = mO.shape[0]
        rows_left = seqlen - m_block * tile_m

        # (tile_m, Dv) blocks of this (batch, head)
        blk = (tile_m, self.head_dim_v)
        gO = cute.local_tile(mO[None, None, head, batch], blk, (m_block, 0))
        gdO = cute.local_tile(mdO[None, None, head, batch], blk, (m_block, 0))
        thr_copy = copy_o.get_slice(tidx)
        tOgO = thr_copy.partition_S(gO)  # (CPY, CPY_M, CPY_K)
        tOgdO = thr_copy.partition_S(gdO)
        cO = cute.make_identity_tensor(blk)
        tOcO = thr_copy.partition_S(cO)
        # Thread 0's row coordinates are compile-time constants, so the row test
        # per CPY_M step is a compare against one hoisted limit.
        t0OcO = copy_o.get_slice(0).partition_S(cO)
        row_limit = rows_left - tOcO[0][0]

        tOrO = cute.make_rmem_tensor_like(tOgO)
        tOrdO = cute.make_rmem_tensor_like(tOgdO)
        tOrO.fill(0.0)
        tOrdO.fill(0.0)
        for m in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
            if t0OcO[0, m, 0][0] < row_limit:
                cute.copy(copy_o, tOgO[None, m, None], tOrO[None, m, None])
                cute.copy(copy_o, tOgdO[None, m, None], tOrdO[None, m, None])

        if const_expr(self.zero_dq):
            # Zero this CTA's block of dQaccum (flat per head) while the loads are
            # in flight.
            gdQaccum = cute.local_tile(
                mdQaccum[None, head, batch], (tile_m * self.head_dim,), (m_block,)
            )
            thr_zero = copy_zero.get_slice(tidx)
            tZgZ = thr_zero.partition_D(gdQaccum)
            tZrZ = cute.make_rmem_tensor_like(tZgZ)
            tZrZ.fill(0.0)
            cute.copy(copy_zero, tZrZ, tZgZ)

        # LSE in base 2: one thread per row, coalesced; +inf on padding rows.
        if tidx < tile_m:
            row = m_block * tile_m + tidx
            lse_log2 = Float32.inf
            if tidx < rows_left:
                lse = mLSE[row, head, batch]
                # A row that saw no key (masks) has LSE = -inf; 0 keeps the main
                # kernel's exp2(s - LSElog2) at 0 instead of NaN: every score of
                # such a row is masked there (no key's query interval holds it), so
                # it is exp2(-inf - 0) = 0.
                lse_log2 = lse * LOG2_E if lse != -Float32.inf else Float32(0.0)
            mLSElog2[stat_position(row, self.stat_block), head, batch] = lse_log2

        # Row sums of dO * O in fp32: within a thread, then across the row's lanes.
        num_m = cute.size(tOgO, mode=[1])
        dpsum = cute.make_rmem_tensor(num_m, Float32)
        for m in cutlass.range_constexpr(num_m):
            prod = tOrO[None, m, None].load().to(Float32) * tOrdO[None, m, None].load().to(Float32)
            acc = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            for i in cutlass.range_constexpr(int(math.log2(threads_per_row))):
                acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=1 << i)
            dpsum[m] = acc

        # The first lane of each row writes it; padding rows (O, dO zero) get 0.
        if tOcO[0][1] == 0:
            for m in cutlass.range_constexpr(num_m):
                row = m_block * tile_m + tOcO[0, m, 0][0]
                val = dpsum[m]
                if const_expr(mdLSE is not None):
                    if t0OcO[0, m, 0][0] < row_limit:
                        val = val - mdLSE[row, head, batch]
                mDpsum[stat_position(row, self.stat_block), head, batch] = val


class FlashBwdPreprocessNoDlse(FlashBwdPreprocess):
    """``FlashBwdPreprocess`` for a backward whose LSE cotangent is a symbolic zero
    (nothing used the LSE): Dpsum = rowsum(dO * O), and the call takes no dLSE."""

    @cute.jit
    def __call__(self, stream: cuda.CUstream, mO: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mDpsum: cute.Tensor, mLSElog2: cute.Tensor,
                 *accum: cute.Tensor):
        # FlashBwdPreprocess.__call__'s operands without mdLSE.
        self.launch(stream, mO, mdO, mLSE, None, mDpsum, mLSElog2, *accum)


__all__ = [
    "SEQLEN_Q_PAD",
    "seqlen_q_padded",
    "FlashBwdPreprocess",
    "FlashBwdPreprocessNoDlse",
    "bwd_workspace_shapes",
    "preprocess_tiling",
    "stat_order",
    "stat_position",
]
