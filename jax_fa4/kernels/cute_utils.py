"""Small CuTe DSL helpers the kernels share: dtype mapping, tensor re-views,
and the sm90 swizzled SMEM operand layout."""

from __future__ import annotations

import math
from typing import Any

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, const_expr, cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum


def as_cutlass_dtype(dtype: Any, kernel: str) -> type[cutlass.Numeric]:
    """Accept cutlass types, numpy/jax dtypes or their names (bf16 and fp16 only)."""
    if isinstance(dtype, type) and issubclass(dtype, cutlass.Numeric):
        return dtype
    name = getattr(dtype, "name", None) or getattr(dtype, "__name__", None) or str(dtype)
    table = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
    if name not in table:
        raise ValueError(f"{kernel} supports bfloat16 and float16, got {dtype!r}")
    return table[name]


def init_bwd_kernel(kernel, name: str, dtype, head_dim: int, head_dim_v: int | None,
                    head_dims: tuple[int, ...], causal: bool,
                    softmax_scale: float | None) -> None:
    """Check and store what every backward main kernel takes: dtype (bf16/fp16),
    head_dim == head_dim_v in ``head_dims``, the mask and the softmax scale
    (default 1 / sqrt(head_dim))."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if dtype not in (cutlass.BFloat16, cutlass.Float16):
        raise TypeError(f"{name} needs bf16 or fp16, got {dtype}")
    if head_dim != head_dim_v or head_dim not in head_dims:
        raise ValueError(f"{name} needs head_dim == head_dim_v in {head_dims}, "
                         f"got {head_dim}, {head_dim_v}")
    kernel.dtype = dtype
    kernel.head_dim = head_dim
    kernel.head_dim_v = head_dim_v
    kernel.causal = causal
    kernel.softmax_scale = (1.0 / math.sqrt(head_dim) if softmax_scale is None
                            else float(softmax_scale))


def permute(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    """Re-view a tensor with its modes reordered (no data movement)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def transpose_smem(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of an SMEM tensor without moving data
    (e.g. V (n, dv, stage) -> V^T (dv, n, stage))."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def sm90_smem_layout(dtype, rows: int, cols: int, stages: int | None = None):
    """Row-major (cols contiguous) swizzled SMEM tile for a (rows, cols[, stages])
    wgmma operand: K-major as it is, MN-major through `transpose_smem`."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View an sm90 wgmma accumulator as the register A operand of a following wgmma.

    acc ((2, 2, V), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (V / 2, MMA_N)): a k16
    slice of A is two adjacent 8-column groups of the accumulator, so V splits
    into pairs.
    """
    div = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    shp, std = div.shape, div.stride
    layout = cute.make_layout(
        ((shp[0][0], shp[0][1], shp[0][2][0]), shp[1], (shp[0][2][1], shp[2])),
        stride=((std[0][0], std[0][1], std[0][2][0]), std[1], (std[0][2][1], std[2])),
    )
    return cute.make_tensor(acc.iterator, layout)


def convert_to_operand_a(acc: cute.Tensor, frag_a: cute.Tensor, dtype) -> None:
    """Write an fp32 accumulator into a 16-bit register A fragment of a following wgmma.

    One k16 slice at a time: 8-element vectors lower to paired cvt.rn.{bf16x2,f16x2}.
    Converting a whole fragment whose size is not a power of two (e.g. 40 values at
    tile_n 80) went element-wise, and ptxas then placed the packing moves between
    the consuming wgmmas and serialised them (C7519).
    """
    view = acc_as_operand_a(acc)
    for k in range(cute.size(frag_a, mode=[2])):  # traced inline: a static Python loop
        frag_a[None, None, k].store(view[None, None, k].load().to(dtype))


@dsl_user_op
def _opaque_b32(x: Int32, *, loc=None, ip=None) -> Int32:
    """x through an empty register move that LLVM cannot see into."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(x).ir_value(loc=loc, ip=ip)],
            "mov.b32 $0, $1;",
            "=r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def pin_fragment(frag: cute.Tensor) -> None:
    """Route every 32-bit register of a 16-bit register fragment through
    ``_opaque_b32``, so that the conversions that wrote it stay where the source
    put them (Note [P conversion in the loop header] in sm90_fwd.py)."""
    words = cute.recast_tensor(frag, Int32)
    for i in range(cute.size(words)):  # traced inline: a static Python loop
        words[i] = _opaque_b32(words[i])


@cute.jit
def wgmma_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor,
               tCrB: cute.Tensor, zero_init: cutlass.Constexpr[bool]):
    """Issue one warpgroup GEMM over the whole K extent of the fragments (and all
    of its M / N atoms) and commit it as one wgmma group."""
    warpgroup.fence()
    # A fresh atom per call: its ACCUMULATE field is mutated below.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


def consumer_release_elected(pipe, state) -> None:
    """``pipe.consumer_release(state)`` of a TMA pipeline in a cluster of one CTA,
    with the arriving lane of each warp chosen by ``elect.sync`` (ELECT: the
    predicate at once) instead of the pipeline's stored ``lane == 0`` test. Inside
    a register-bound loop ptxas keeps no register for that test and re-reads the
    thread index each step (S2R, a variable-latency read; Nsight Compute put 3.8%
    of the hdim 128 backward's walk on its first use, eleventh session)."""
    if pipe.consumer_mask is not None:
        raise ValueError("consumer_release_elected serves a cluster of one CTA")
    with cute.arch.elect_one():
        pipe.sync_object_empty.arrive(state.index, None)


def stat_rows_view(t: cute.Tensor, row_multiple: int) -> cute.Tensor:
    """(B, Hq, Sq_pad) f32 row statistics -> (Sq_pad, Hq, B) for 1-D TMA boxes along
    the sequence. Sq_pad is declared a multiple of ``row_multiple`` so that the
    compiler can prove the 16-byte aligned strides TMA needs."""
    b, h = t.shape[0], t.shape[1]
    s = cute.assume(t.shape[2], divby=row_multiple)
    head_stride = cute.assume(cutlass.Int64(s) * h, divby=row_multiple)
    return cute.make_tensor(t.iterator, cute.make_layout((s, h, b), stride=(1, s, head_stride)))


def _ptx(text: str, operands: list, constraints: str, loc, ip, result=None):
    """One inline PTX statement ``text`` on ``operands`` (DSL values and pointers,
    pointers passed as integer addresses), side effects unless it has a ``result``
    (an LLVM type, then returned)."""
    values = [(x.toint(loc=loc, ip=ip) if isinstance(x, cute.Pointer) else x)
              .ir_value(loc=loc, ip=ip) for x in operands]
    return llvm.inline_asm(result, values, text, constraints,
                           has_side_effects=result is None, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT)


def _bulk_s2g(ptx: str, dst: cute.Pointer, src: cute.Pointer, num_bytes: int, loc, ip):
    """One 1-D bulk copy instruction ``ptx`` [dst], [src], num_bytes from SMEM to
    global memory, in the calling thread's bulk async-group."""
    if num_bytes % 16:
        raise ValueError(f"a bulk copy moves a multiple of 16 bytes, got {num_bytes}")
    _ptx(f"{ptx} [$0], [$1], $2;", [dst, src, Int32(num_bytes)], "l,r,r", loc, ip)


@dsl_user_op
def bulk_reduce_add_f32(dst: cute.Pointer, src: cute.Pointer, num_bytes: int, *, loc=None,
                        ip=None) -> None:
    """dst[:] += src[:] for ``num_bytes`` of float32: one 1-D bulk reduce-add from
    SMEM to global memory, in the calling thread's bulk async-group (commit and wait
    with ``cp_async_bulk_commit_group`` / ``cp_async_bulk_wait_group``). Both
    addresses 16-byte aligned, num_bytes a multiple of 16. Issue it from one thread:
    every thread that executes it adds once. The DSL has the tensor-map form of
    this instruction only."""
    _bulk_s2g("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32", dst, src,
              num_bytes, loc, ip)


@dsl_user_op
def bulk_store(dst: cute.Pointer, src: cute.Pointer, num_bytes: int, *, loc=None,
               ip=None) -> None:
    """dst[:] = src[:]: ``bulk_reduce_add_f32``'s plain-copy twin (any element type),
    with the same alignment rules and async-group."""
    _bulk_s2g("cp.async.bulk.global.shared::cta.bulk_group", dst, src, num_bytes, loc, ip)


@dsl_user_op
def bulk_load_g2s(dst: cute.Pointer, src: cute.Pointer, num_bytes: int, mbar: cute.Pointer, *,
                  loc=None, ip=None) -> None:
    """dst[:] = src[:]: one 1-D bulk copy of ``num_bytes`` from global memory to this
    CTA's SMEM, whose arrival completes ``num_bytes`` of the transaction count of the
    mbarrier at ``mbar`` (arm it with ``mbarrier_arrive_and_expect_tx`` first). Both
    addresses 16-byte aligned, num_bytes a multiple of 16; issue it from one thread."""
    if num_bytes % 16:
        raise ValueError(f"a bulk copy moves a multiple of 16 bytes, got {num_bytes}")
    _ptx("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
         "[$0], [$1], $2, [$3];", [dst, src, Int32(num_bytes), mbar], "r,l,r,r", loc, ip)


@dsl_user_op
def pack_f32x2(lo, hi, dtype: type[cutlass.Numeric], *, loc=None, ip=None) -> Int32:
    """Two floats rounded to ``dtype`` (bf16 / fp16, round to nearest even) in one
    32-bit word, ``lo`` in the low half (the lower address in memory)."""
    op = {cutlass.BFloat16: "bf16x2", cutlass.Float16: "f16x2"}[dtype]
    return Int32(_ptx(f"cvt.rn.{op}.f32 $0, $1, $2;",
                      [cutlass.Float32(hi), cutlass.Float32(lo)], "=r,f,f", loc, ip,
                      result=T.i32()))


@dsl_user_op
def red_add_f32x4(ptr: cute.Pointer, a, b, c, d, *, loc=None, ip=None) -> None:
    """ptr[0:4] += (a, b, c, d): one 128-bit reduce-add into global memory (PTX
    ``red.global.add.v4.f32``, sm_90 and later; SASS ``REDG.E.ADD.F32x4``), relaxed,
    GPU scope, no result. ``ptr`` 16-byte aligned."""
    _ptx("red.global.add.v4.f32 [$0], {$1, $2, $3, $4};",
         [ptr] + [cutlass.Float32(x) for x in (a, b, c, d)], "l,f,f,f,f", loc, ip)


@dsl_user_op
def st_global_b32(ptr: cute.Pointer, value, *, loc=None, ip=None) -> None:
    """One 32-bit global store of ``value`` (an Int32) at ``ptr`` (4-byte aligned)."""
    _ptx("st.global.b32 [$0], $1;", [ptr, Int32(value)], "l,r", loc, ip)


@dsl_user_op
def global_timer_halves(*, loc=None, ip=None) -> tuple[Int32, Int32]:
    """One read of the GPU's nanosecond clock (PTX ``%globaltimer``) as its (low,
    high) 32-bit halves. Marked as having side effects, so that reads at different
    points of a kernel stay where they are written."""
    t = llvm.inline_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l",
                        has_side_effects=True, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT)
    t = cutlass.Int64(t)
    return Int32(t), Int32(t >> 32)


@dsl_user_op
def sm_id(*, loc=None, ip=None) -> Int32:
    """The SM this CTA runs on (PTX ``%smid``)."""
    return Int32(_ptx("mov.u32 $0, %smid;", [], "=r", loc, ip, result=T.i32()))


class DqSemaphoreCall:
    """The call of a deterministic backward main kernel (put before the kernel class
    in the bases): the backward operands with mdQsem, (B, Hq, ceil(Sq / tile_m))
    int32 and zero at launch, after mdQaccum; it runs the kernel's
    ``launch(..., mdQsem)``."""

    takes_dq_semaphores = True

    @cute.jit
    def __call__(
        self,
        stream,
        mQ: cute.Tensor,  # (B, Sq, Hq, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D)
        mV: cute.Tensor,  # (B, Sk, Hkv, Dv)
        mdO: cute.Tensor,  # (B, Sq, Hq, Dv)
        mLSElog2: cute.Tensor,  # (B, Hq, Sq) f32
        mDpsum: cute.Tensor,  # (B, Hq, Sq) f32
        mdQaccum: cute.Tensor,  # (B, Hq, Sq_pad, D) f32, accumulated in place
        mdQsem: cute.Tensor,  # (B, Hq, num_m) int32, zero at launch
        mdK: cute.Tensor,  # (B, Sk, Hkv, D)
        mdV: cute.Tensor,  # (B, Sk, Hkv, Dv)
    ):
        if const_expr(mdQsem.element_type != Int32):
            raise TypeError("the dQ semaphores must be int32")
        self.launch(stream, mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV, mdQsem)


def block_idx_heads_last_first(reverse: bool):
    """blockIdx of a (query block, head, batch) grid, with head and batch counted from
    the end when ``reverse`` (Note [Pre / post order] in bwd_preprocess.py): the
    grid then dispatches the last (batch, head) first. A plain Python switch."""
    x, y, z = cute.arch.block_idx()
    if reverse:
        _, gy, gz = cute.arch.grid_dim()
        y, z = gy - 1 - y, gz - 1 - z
    return x, y, z


def pdl_start(use_pdl: bool) -> None:
    """The first device step of a kernel launched with programmatic dependent launch
    (``launch(use_pdl=True)``). Such a kernel may start while the kernel before it
    in the stream still runs: every thread waits here until that grid has finished
    and its writes are visible, before it reads or writes global memory. Then it
    lets the next PDL kernel in the stream launch; that kernel waits the same way,
    so nothing it reads can be unfinished. What comes before this call may only set
    up SMEM, barriers and registers. No-op when ``use_pdl`` is False."""
    if use_pdl:
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def semaphore_wait(ptr: cute.Pointer, value) -> None:
    """Spin with GPU-scope acquire loads until the int32 at ``ptr`` equals ``value``,
    then order the async proxy's global accesses (bulk / TMA reduces) after it."""
    done = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
    while done != value:
        done = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
    cute.arch.fence_proxy("async.global")


@cute.jit
def semaphore_wait_at_least(ptr: cute.Pointer, value) -> None:
    """``semaphore_wait`` until the int32 at ``ptr`` is at least ``value``."""
    done = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
    while done < value:
        done = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
    cute.arch.fence_proxy("async.global")


@cute.jit
def semaphore_release_after_bulk(ptr: cute.Pointer, value: cutlass.Constexpr[int] = 1) -> None:
    """Wait until this thread's bulk groups have landed in global memory (not only
    read SMEM), then add ``value`` to the int32 at ``ptr`` with a GPU-scope release."""
    cute.arch.cp_async_bulk_wait_group(0, read=False)
    cute.arch.fence_proxy("async.global")
    cute.arch.atomic_add(ptr, Int32(value), sem="release", scope="gpu")


def stmatrix_acc(acc16: cute.Tensor, tiled_mma: cute.TiledMma, smem: cute.Tensor, tidx,
                 dtype, transpose: bool = False) -> None:
    """Write this thread's 16-bit copy of a wgmma accumulator into the SMEM tile the
    tiled MMA covers, with st.matrix (four 8x8 matrices per instruction; transposed,
    st.matrix .trans, into a tile whose contiguous mode is the MMA's M). The caller
    fences (``fence_view_async_shared``) before a TMA engine reads the tile."""
    atom = cute.make_copy_atom(
        cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=transpose, num_matrices=4), dtype)
    thr = cute.make_tiled_copy_C(atom, tiled_mma).get_slice(tidx)
    cute.copy(atom, thr.retile(acc16), thr.partition_D(smem))


def tma_tile_partition(atom: cute.CopyAtom, smem: cute.Tensor, gmem: cute.Tensor,
                       rank: int = 2):
    """(SMEM, global) views of a TMA copy of whole tiles: the first ``rank`` modes of
    both tensors are the tile, the rest index tiles / stages. One CTA, no multicast."""
    from cutlass.cute.nvgpu import cpasync

    return cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                 cute.group_modes(smem, 0, rank),
                                 cute.group_modes(gmem, 0, rank))


def tma_store_tile(atom: cute.CopyAtom, smem: cute.Tensor, gmem: cute.Tensor) -> None:
    """Issue one TMA store of a (rows, cols) SMEM tile to the global tile of the same
    shape (a ``local_tile`` of the atom's TMA view; rows past its end are clipped).
    Call from one thread; commit and wait with the bulk async-group calls."""
    ts, tg = tma_tile_partition(atom, smem, gmem)
    cute.copy(atom, ts, tg)


def check_bwd_operand_dtypes(kernel, mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK,
                             mdV) -> None:
    """Refuse, at compile time, backward operands whose dtypes the kernel was not
    built for: Q, K, V, dO, dK, dV in kernel.dtype; LSElog2, Dpsum, dQaccum in f32."""
    if not (mQ.element_type == mK.element_type == mV.element_type == mdO.element_type
            == mdK.element_type == mdV.element_type == kernel.dtype):
        raise TypeError("Q, K, V, dO, dK, dV must all have the kernel's dtype")
    if not (mLSElog2.element_type == mDpsum.element_type == mdQaccum.element_type
            == cutlass.Float32):
        raise TypeError("LSElog2, Dpsum and dQaccum must be float32")
