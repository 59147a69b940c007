"""Small CuTe DSL helpers the kernels share: dtype mapping, tensor re-views, the
sm90 swizzled SMEM operand layout and wgmma helpers, the backward main kernels'
call, programmatic dependent launch, the dQ semaphores and bulk / TMA copies."""

from __future__ import annotations

import math
from typing import Any

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from jax_fa4.config import page_size_error
from jax_fa4.kernels.softmax import score_scales


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
                    softmax_scale: float | None, softcap: float | None = None) -> None:
    """Check and store what every backward main kernel takes: dtype (bf16/fp16),
    head dims in ``head_dims`` (an int d: head_dim = head_dim_v = d; a pair: those
    two), the mask, the softmax scale (default 1 / sqrt(head_dim)) and the softcap
    (``score_scales``: ``cap_in``, and ``scale_log2``, the factor of P's exponent)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if dtype not in (cutlass.BFloat16, cutlass.Float16):
        raise TypeError(f"{name} needs bf16 or fp16, got {dtype}")
    pairs = [(d, d) if isinstance(d, int) else tuple(d) for d in head_dims]
    if (head_dim, head_dim_v) not in pairs:
        raise ValueError(f"{name} needs head dims (qk, v) in {pairs}, "
                         f"got {head_dim}, {head_dim_v}")
    kernel.dtype = dtype
    kernel.head_dim = head_dim
    kernel.head_dim_v = head_dim_v
    kernel.causal = causal
    kernel.softmax_scale = (1.0 / math.sqrt(head_dim) if softmax_scale is None
                            else float(softmax_scale))
    kernel.softcap = softcap
    kernel.cap_in, kernel.scale_log2 = score_scales(kernel.softmax_scale, softcap)


def set_mask_flags(kernel, causal: bool, masked: bool, segments: bool) -> None:
    """Store a kernel's ``masked`` / ``segments`` flags: a masked kernel takes the
    intervals of rules/ranges.py, which carry causal too (so it is not also causal),
    and segment ids come with the intervals only."""
    if masked and causal or segments and not masked:
        raise ValueError("masked kernels carry causal in their intervals, and segment "
                         "ids need masked")
    kernel.masked = masked
    kernel.segments = segments


def set_forward_extras(kernel, sinks: bool, softcap: float | None, pack_gqa: int,
                       split_kv: bool = False) -> None:
    """Store a forward kernel's ``sinks``, ``softcap`` (with ``score_scales``'
    ``cap_in`` and ``scale_log2``), ``pack_gqa`` and ``split_kv``, after its
    ``softmax_scale``, ``masked`` and ``tile_m``: packed GQA heads serve the masked
    forward with a group that divides tile_m (Note [Packed GQA] in sm90_fwd.py),
    split keys the masked forward without sinks, which the combine adds (Note
    [Split keys])."""
    if split_kv and (not kernel.masked or sinks):
        raise ValueError("split_kv serves the masked forward without sinks (the combine "
                         "adds them)")
    kernel.split_kv = split_kv
    kernel.sinks = sinks
    kernel.softcap = softcap
    kernel.cap_in, kernel.scale_log2 = score_scales(kernel.softmax_scale, softcap)
    kernel.pack_gqa = pack_gqa
    if pack_gqa > 1 and (not kernel.masked or kernel.tile_m % pack_gqa):
        raise ValueError(f"pack_gqa serves the masked forward with a group that divides "
                         f"tile_m {kernel.tile_m}, got {pack_gqa}")


def set_page_size(kernel, page_size: int) -> None:
    """Store a forward kernel's ``page_size`` (0: contiguous K / V) and ``page_rows``,
    the rows of one K / V TMA box: a block of tile_n keys is loaded as whole pages or
    a page as whole blocks (Note [Paged KV] in sm90_fwd.py), after its ``masked`` and
    ``tile_n``."""
    kernel.page_size = page_size
    kernel.page_rows = kernel.tile_n
    if page_size:
        error = page_size_error(page_size, kernel.tile_n)
        if error or not kernel.masked:
            raise ValueError(error or "a paged forward is masked (it takes key lengths)")
        kernel.page_rows = min(page_size, kernel.tile_n)


def kv_box_layout(stage_layout, rows: int, cols: int):
    """The SMEM layout of one (rows, cols) TMA box of a (tile_n, cols, stages) K or V
    layout: its stage's first ``rows`` rows (all of them when rows is tile_n)."""
    one = cute.select(stage_layout, mode=[0, 1])
    if const_expr(rows == cute.size(one, mode=[0])):
        return one
    return cute.composition(one, (cute.make_layout(rows), cute.make_layout(cols)))


def check_forward_dtypes(kernel, mQ, mK, mV, mO, mLSE) -> None:
    """At trace time: Q, K, V in the kernel's dtype, O too (float32 partials with
    split keys), LSE float32."""
    o_type = Float32 if const_expr(kernel.split_kv) else kernel.dtype
    for t, want in ((mQ, kernel.dtype), (mK, kernel.dtype), (mV, kernel.dtype), (mO, o_type),
                    (mLSE, Float32)):
        if const_expr(t.element_type != want):
            raise TypeError(f"expected {want}, got {t.element_type}")


def _pop_int32(rest: list, what: str):
    """The first of a call's remaining operands, checked to be int32 (``what`` names
    it in the error)."""
    t = rest.pop(0)
    if const_expr(t.element_type != Int32):
        raise TypeError(f"{what} must be int32")
    return t


def _pop_mask_operands(kernel, rest: list) -> tuple:
    """(intervals, query ids, key ids) from the front of a call's remaining operands
    as the kernel takes them (None for those it does not), checked to be int32."""
    masks = [rest.pop(0) if kernel.masked else None]
    masks += [rest.pop(0), rest.pop(0)] if kernel.segments else [None, None]
    for t in masks:
        if const_expr(t is not None and t.element_type != Int32):
            raise TypeError("intervals and segment ids must be int32")
    return tuple(masks)


def permute(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    """Re-view a tensor with its modes reordered (no data movement)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def pack_rows(t: cute.Tensor, group: int, row_mode: int, head_mode: int | None) -> cute.Tensor:
    """Re-view a tensor whose modes ``row_mode`` (positions) and ``head_mode`` (query
    heads, ``group`` per KV head, a group's heads adjacent) become ((group,
    positions), KV heads): row r of a KV head is position r // group of its query
    head r % group (Note [Packed GQA] in sm90_fwd.py). Without a head mode the
    positions repeat ``group`` times (stride 0): per-position data (key intervals,
    segment ids) read by packed rows."""
    shape, stride = list(t.shape), list(t.stride)
    head_stride = 0
    if head_mode is not None:
        head_stride = stride[head_mode]
        shape[head_mode] = shape[head_mode] // group
        stride[head_mode] = head_stride * group
    shape[row_mode] = (group, shape[row_mode])
    stride[row_mode] = (head_stride, stride[row_mode])
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))


def packed_gqa_views(group: int, mQ, mO, mLSE, mRanges, mQSeg):
    """(mQ, mO, mLSE, mRanges, mQSeg) of a masked forward re-viewed for packed GQA
    heads (Note [Packed GQA] in sm90_fwd.py): Q and O (Sq, D, Hq, B) and LSE (Sq, Hq,
    B) with rows (position, query head of the group) and the KV heads as heads; the
    per-position intervals (B, Sq, 2) and query segment ids (B, Sq) or None repeat
    over the group."""
    mQ, mO = [pack_rows(t, group, 0, 2) for t in (mQ, mO)]
    mLSE = pack_rows(mLSE, group, 0, 1)
    mRanges = pack_rows(mRanges, group, 1, None)
    if const_expr(mQSeg is not None):
        mQSeg = pack_rows(mQSeg, group, 1, None)
    return mQ, mO, mLSE, mRanges, mQSeg


def transpose_smem(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of an SMEM tensor without moving data
    (e.g. V (n, dv, stage) -> V^T (dv, n, stage))."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def sm90_smem_layout(dtype, rows: int, cols: int, stages: int | None = None,
                     swizzle_cols: int | None = None):
    """Row-major (cols contiguous) swizzled SMEM tile for a (rows, cols[, stages])
    wgmma operand: K-major as it is, MN-major through `transpose_smem`. The swizzle
    is the widest whose atom divides ``swizzle_cols`` (default cols): an MN-major
    operand split along its columns between warpgroups needs atoms that divide
    each warpgroup's part."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, swizzle_cols or cols),
        dtype)
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
    for k in range(cute.size(frag_a, mode=[2])):  # traced inline: a static Python loop
        convert_slice_to_operand_a(acc, frag_a, dtype, k)


def convert_slice_to_operand_a(acc: cute.Tensor, frag_a: cute.Tensor, dtype, k: int) -> None:
    """``convert_to_operand_a`` of k16 slice ``k`` alone: the accumulator's columns
    4k .. 4k + 3 in its ``acc_mn_view``."""
    view = acc_as_operand_a(acc)
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


def smem_operands(tiled_mma: cute.TiledMma, wg_slice, sA: cute.Tensor, sB: cute.Tensor):
    """The A and B fragments of warpgroup ``wg_slice``'s share of a wgmma whose
    operands are both in shared memory (``sA``, ``sB``: tiles, or their stages)."""
    wg = tiled_mma.get_slice(wg_slice)
    return (tiled_mma.make_fragment_A(wg.partition_A(sA)),
            tiled_mma.make_fragment_B(wg.partition_B(sB)))


def zero_acc(thr_mma, shape) -> cute.Tensor:
    """A zeroed fp32 accumulator of this thread's share of a ``shape`` GEMM result."""
    acc = cute.make_rmem_tensor(thr_mma.partition_shape_C(shape), cutlass.Float32)
    acc.fill(0.0)
    return acc


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
    thread index each step (S2R, a variable-latency read the release then waits
    for)."""
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


def _ptx(text: str, operands: list, constraints: str, loc, ip) -> None:
    """One inline PTX statement ``text`` with side effects on ``operands`` (DSL values
    and pointers, pointers passed as integer addresses)."""
    values = [(x.toint(loc=loc, ip=ip) if isinstance(x, cute.Pointer) else x)
              .ir_value(loc=loc, ip=ip) for x in operands]
    llvm.inline_asm(None, values, text, constraints, has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def bulk_reduce_add_f32(dst: cute.Pointer, src: cute.Pointer, num_bytes: int, *, loc=None,
                        ip=None) -> None:
    """dst[:] += src[:] for ``num_bytes`` of float32: one 1-D bulk reduce-add from
    SMEM to global memory, in the calling thread's bulk async-group (commit and wait
    with ``cp_async_bulk_commit_group`` / ``cp_async_bulk_wait_group``). Both
    addresses 16-byte aligned, num_bytes a multiple of 16. Issue it from one thread:
    every thread that executes it adds once. The DSL has the tensor-map form of
    this instruction only."""
    if num_bytes % 16:
        raise ValueError(f"a bulk copy moves a multiple of 16 bytes, got {num_bytes}")
    _ptx("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
         [dst, src, Int32(num_bytes)], "l,r,r", loc, ip)


class FwdCall:
    """The call of a forward kernel, as the lowering makes it; it runs the kernel's
    host side, ``launch(stream, mQ, mK, mV, mO, mLSE, mTileCounter, mRanges, mQSeg,
    mKSeg)`` (None for each operand the kernel does not take).

    After V, in this order: a kernel with ``takes_tile_counter`` (the sm90 causal
    persistent forward) takes a (1,) int32 tile counter, zero at launch, unless it is
    ``masked``: a ``masked`` one takes each query's key interval, (B, Sq, 2) int32,
    and with ``takes_tile_counter`` (B + 1, Sq, 2), the counter the first int of the
    last batch entry, zero (Note [Counter in the intervals] in sm90_fwd.py); one with
    ``segments`` the query and key segment ids, (B, Sq) and (B, Sk) int32; one with
    ``sinks`` the sink logits, (B, Hq) float32, passed to ``launch`` last."""

    takes_tile_counter = False
    masked = False
    segments = False
    sinks = False
    pack_gqa = 1
    split_kv = False
    page_size = 0

    def q_rows(self, mQ: cute.Tensor):
        """Rows of the (permuted) query view: Sq, or Sq x group packed (Note [Packed
        GQA] in sm90_fwd.py)."""
        if const_expr(self.pack_gqa > 1):
            return cute.size(mQ, mode=[0])
        return mQ.shape[0]

    @cute.jit
    def __call__(
        self,
        stream,
        mQ: cute.Tensor,  # (B, Sq, Hq, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D)
        mV: cute.Tensor,  # (B, Sk, Hkv, Dv)
        *rest: cute.Tensor,  # the operands above, then mO (B, Sq, Hq, Dv) and mLSE
        # (B, Hq, Sq) f32
    ):
        rest = list(rest)
        mTileCounter = None
        if const_expr(self.takes_tile_counter and not self.masked):
            mTileCounter = _pop_int32(rest, "the tile counter")
        mRanges, mQSeg, mKSeg = _pop_mask_operands(self, rest)
        table = {}
        if const_expr(self.page_size):
            table["mPageTable"] = _pop_int32(rest, "the page table")
        sinks = ()
        if const_expr(self.sinks):
            sinks = (rest.pop(0),)
            if const_expr(sinks[0].element_type != Float32):
                raise TypeError("the sink logits must be float32")
        mO, mLSE = rest
        self.launch(stream, mQ, mK, mV, mO, mLSE, mTileCounter, mRanges, mQSeg, mKSeg, *sinks,
                    **table)


class BwdMainCall:
    """The call of a backward main kernel, as the lowering makes it; it runs the
    kernel's host side, ``launch(stream, mQ, ..., mdQaccum, mdK, mdV[, mdQsem])``.

    After mdQaccum, in this order: a deterministic kernel (``DqSemaphoreCall``) takes
    mdQsem, (B, Hq, ceil(Sq / tile_m)) int32 and zero at launch, one semaphore per
    query block; a ``masked`` one each key's query interval, (B, Sk, 2) int32
    (rules/ranges.py), passed to ``launch`` as mRanges after mdQsem (None if none);
    one with ``segments`` the query and key segment ids, (B, Sq) and (B, Sk); one
    masked that ``takes_walks`` each key block's walk, (B, ceil(Sk / tile_n), 5)
    int32 (``key_block_ranges``), passed after them as mWalks.

    ``dq_store`` (Note [One key block per query block] in sm90_bwd.py): no
    accumulator; dQ (B, Sq, Hq, D) in the kernel's dtype is an output, before mdK,
    and goes to ``launch`` in mdQaccum's place."""

    takes_dq_semaphores = False
    masked = False
    segments = False
    dq_store = False

    @property
    def takes_walks(self) -> bool:
        """Whether a masked call takes the key blocks' walks: the deterministic
        kernels rank their dQ adds by them."""
        return self.takes_dq_semaphores

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
        *rest: cute.Tensor,  # the optional operands, then mdK (B, Sk, Hkv, D) and
        # mdV (B, Sk, Hkv, Dv)
    ):
        rest = list(rest)
        if const_expr(self.dq_store):  # mdQaccum took the first operand after Dpsum
            rest = [mdQaccum] + rest
        if const_expr(self.takes_dq_semaphores):
            mdQsem = _pop_int32(rest, "the dQ semaphores")
        masks = _pop_mask_operands(self, rest)
        if const_expr(self.masked and self.takes_walks):
            masks = masks + (_pop_int32(rest, "the key blocks' walks"),)
        if const_expr(self.dq_store):
            mdQaccum = rest.pop(0)
        mdK, mdV = rest
        if const_expr(self.takes_dq_semaphores):
            self.launch(stream, mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV, mdQsem,
                        *masks)
        elif const_expr(self.masked):
            self.launch(stream, mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV, None,
                        *masks)
        else:
            self.launch(stream, mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV)


class DqSemaphoreCall(BwdMainCall):
    """Put before the class of a deterministic backward main kernel in its bases:
    its call takes mdQsem (``BwdMainCall``)."""

    takes_dq_semaphores = True


def block_idx_heads_last_first():
    """blockIdx of a (query block, head, batch) grid, with head and batch counted from
    the end (Note [Pre / post order] in bwd_preprocess.py): the grid then dispatches
    the last (batch, head) first."""
    x, y, z = cute.arch.block_idx()
    _, gy, gz = cute.arch.grid_dim()
    return x, gy - 1 - y, gz - 1 - z


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
def masked_add_rank(mWalks: cute.Tensor, batch, n_block, m_block) -> Int32:
    """Called by a whole warp (every lane gets the result): the rank of key block
    ``n_block``'s dQ add in query block ``m_block``'s sum under masks, the number
    of key blocks above it whose walk holds m_block (Note [Masked dQ order] in
    dq_layout.py; ``det_masked_add_rank`` on the host). mWalks: (B, num_n, 5) int32,
    ``[first, end)`` per key block first (``key_block_ranges``). Lane l tests blocks
    n_block + 1 + l + 32 k, and one warp reduction (redux.sync) sums the lanes'
    counts."""
    lane = cute.arch.lane_idx()
    num_n = mWalks.shape[1]
    count = Int32(0)
    for k in cutlass.range((num_n - n_block + 30) // 32, unroll=1):
        n = n_block + 1 + k * 32 + lane
        at = cutlass.min(n, num_n - 1)
        visits = (mWalks[batch, at, 0] <= m_block) & (m_block < mWalks[batch, at, 1])
        count = count + cutlass.select_((n < num_n) & visits, Int32(1), Int32(0))
    return cute.arch.warp_redux_sync(count, "add")


@cute.jit
def semaphore_release_after_bulk(ptr: cute.Pointer) -> None:
    """Wait until this thread's bulk groups have landed in global memory (not only
    read SMEM), then add 1 to the int32 at ``ptr`` with a GPU-scope release."""
    cute.arch.cp_async_bulk_wait_group(0, read=False)
    cute.arch.fence_proxy("async.global")
    cute.arch.atomic_add(ptr, Int32(1), sem="release", scope="gpu")


def stmatrix_acc(acc16: cute.Tensor, tiled_mma: cute.TiledMma, smem: cute.Tensor, tidx,
                 dtype) -> None:
    """Write this thread's 16-bit copy of a wgmma accumulator into the SMEM tile the
    tiled MMA covers, with st.matrix (four 8x8 matrices per instruction). The caller
    fences (``fence_view_async_shared``) before a TMA engine reads the tile."""
    atom = cute.make_copy_atom(
        cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
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
    built for: Q, K, V, dO, dK, dV in kernel.dtype; LSElog2, Dpsum, dQaccum in f32
    (dQ itself in kernel.dtype where the kernel stores it, ``dq_store``)."""
    if not (mQ.element_type == mK.element_type == mV.element_type == mdO.element_type
            == mdK.element_type == mdV.element_type == kernel.dtype):
        raise TypeError("Q, K, V, dO, dK, dV must all have the kernel's dtype")
    if not (mLSElog2.element_type == mDpsum.element_type == cutlass.Float32):
        raise TypeError("LSElog2 and Dpsum must be float32")
    dq_type = kernel.dtype if kernel.dq_store else cutlass.Float32
    if mdQaccum.element_type != dq_type:
        raise TypeError(f"{'dQ' if dq_type is kernel.dtype else 'dQaccum'} must be {dq_type}")


class PagedKV:
    """The K or V loads of one tile from a page pool (Note [Paged KV] in sm90_fwd.py,
    Note [Page pieces] in sm100_fwd.py): ``load`` puts block n's tile_n keys into a
    stage as tile_n / r TMA boxes of r rows, each from the page that holds them.
    Page slots past the table's end (a block that runs past a sequence's last page)
    read its last page, and page ids are clamped into the pool: never an
    out-of-bounds read, and the intervals mask those keys."""

    def __init__(self, mX: cute.Tensor, mPageTable: cute.Tensor, sX: cute.Tensor,
                 atom: cute.CopyAtom, page_size: int, tile_n: int, head_kv: Int32,
                 batch: Int32):
        self.rows = min(page_size, tile_n)
        self.cols = cute.size(sX, mode=[1])
        self.page_size, self.tile_n = page_size, tile_n
        self.mX, self.table, self.atom = mX, mPageTable, atom
        self.head_kv, self.batch = head_kv, batch
        # (rows, cols, pieces, 1, stages): piece j of a stage is its rows [j r, j r + r).
        self.sX = cute.flat_divide(sX, (self.rows, self.cols))

    @cute.jit
    def load(self, pipe, state, n_block: Int32, tx_bytes: cutlass.Constexpr = None):
        """Block n_block into the stage of ``state``, by the whole load warp: lane j
        reads piece j's page id (before the wait for the stage), the copies take
        them by shuffle. tx_bytes: the bytes the stage's barrier expects where they
        are not the pipeline's own (sm100: V tiles in K-sized slots)."""
        pieces = self.tile_n // self.rows
        lane_key = n_block * self.tile_n + cute.arch.lane_idx() * self.rows
        slot = cutlass.min(lane_key // self.page_size, self.table.shape[1] - 1)
        lane_page = cutlass.max(cutlass.min(self.table[self.batch, slot],
                                            self.mX.shape[3] - 1), 0)
        if cutlass.const_expr(tx_bytes is not None):
            pipe.producer_acquire(state, expected_tx=tx_bytes)
        else:
            pipe.producer_acquire(state)
        for j in cutlass.range(pieces, unroll=1):
            key = n_block * self.tile_n + j * self.rows
            page = cute.arch.shuffle_sync(lane_page, j)
            g = cute.local_tile(self.mX[None, None, self.head_kv, page],
                                (self.rows, self.cols), (None, 0))
            tXsX, tXgX = tma_tile_partition(self.atom, self.sX, g)
            cute.copy(self.atom, tXgX[None, (key % self.page_size) // self.rows],
                      tXsX[None, j, 0, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state))
