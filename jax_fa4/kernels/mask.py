"""Causal and sequence-length masking of a score tile (sm90 accumulator fragments).

Causal is top-left aligned: query i sees key j iff j <= i (docs/design.md).
Masked scores become -inf so that the softmax gives them P = 0.

The column of every accumulator element is ``thread offset + a compile-time
column of thread 0`` (a wgmma accumulator gives each thread the same pattern,
shifted). Comparing the compile-time column against a per-thread limit keeps
the inner loop to one compare and one select per element.

With ``bitmask`` the causal mask of a row instead counts the row's visible
elements once, turns that count into a 32-bit mask (bit e set: element e kept),
and selects each element on its bit; ptxas moves such bits into predicates seven
at a time (R2P), so a row takes a few integer instructions and one select per
element instead of a compare and a select per element (FA4's sm90 masking).
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Uint32, cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_fa4.kernels.softmax import acc_mn_view

# Bits per mask word.
_WORD = 32


def acc_column(e: int) -> int:
    """Column of a thread's element e of one accumulator row, relative to the thread's
    first: an sm90 wgmma accumulator gives each thread column pairs 8 apart."""
    return 8 * (e // 2) + e % 2


def visible_elements(limit, maximum=max, minimum=min):
    """How many of a thread's elements of one row have column (``acc_column``) < limit;
    they are a prefix, since the columns grow with e. For plain ints (tests) and DSL
    integers alike."""
    lim = maximum(limit, 0)
    return lim // 8 * 2 + minimum(lim % 8, 2)


def keep_shift(visible, word: int, maximum=max):
    """The right shift of 0xFFFFFFFF that leaves the keep bits of 32-element word
    ``word`` of a row with ``visible`` visible elements: 32 (word + 1) - visible,
    at least 0. Shifts of 32 and more mean no bit (``_shr_b32`` clamps them, as
    PTX does)."""
    return maximum((word + 1) * _WORD - visible, 0)


@dsl_user_op
def _shr_b32(x: Uint32, n: Int32, *, loc=None, ip=None) -> Uint32:
    """x >> n for 0 <= n, with PTX's clamping: n >= 32 gives 0 (LLVM's lshr would be
    poison there)."""
    return Uint32(
        llvm.inline_asm(
            T.i32(),
            [Uint32(x).ir_value(loc=loc, ip=ip), Int32(n).ir_value(loc=loc, ip=ip)],
            "shr.b32 $0, $1, $2;",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def keep_inside(x: Float32, pos: Int32, lo: Int32, width: Int32, zero: bool = False, *,
                loc=None, ip=None) -> Float32:
    """x where lo <= pos < lo + width, else -inf (0 with ``zero``: for P): one
    unsigned compare of pos - lo with width (0 <= width). In PTX: LLVM folds the
    DSL's unsigned compare of a converted Int32 back into a signed one, which is
    wrong here, and two signed compares cost the backward's MMA warpgroups
    registers they do not have."""
    fill = "0f00000000" if zero else "0fFF800000"
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip), Int32(pos).ir_value(loc=loc, ip=ip),
             Int32(lo).ir_value(loc=loc, ip=ip), Int32(width).ir_value(loc=loc, ip=ip)],
            "{ .reg .pred p; .reg .b32 t; sub.s32 t, $2, $3; setp.lt.u32 p, t, $4; "
            f"selp.f32 $0, $1, {fill}, p; }}",
            "=f,f,r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


class TileMask:
    """Masks a (tile_m, tile_n) score tile of one thread.

    tile_m, tile_n: the CTA tile (compile time).
    seqlen_k: number of valid keys (runtime).
    thr_mma: the QK tiled MMA sliced for this thread (its partition of C fixes
    which rows and columns the thread holds).
    """

    def __init__(self, tile_m: int, tile_n: int, seqlen_k: Int32, thr_mma, thr_mma_t0,
                 bitmask: bool = False):
        self.bitmask = bitmask
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.seqlen_k = seqlen_k
        c_tile = cute.make_identity_tensor((tile_m, tile_n))
        # (rows, cols) coordinates of this thread's and of thread 0's elements.
        self.t_coord = acc_mn_view(thr_mma.partition_C(c_tile))
        self.t0_coord = acc_mn_view(thr_mma_t0.partition_C(c_tile))
        self._t0_cols = None

    def t0_cols(self, n_cols: int) -> list:
        """Thread 0's column of each accumulator column, compile-time ints, evaluated
        through the layout once per kernel instead of once per element and call (a
        layout evaluation is slow to trace)."""
        if self._t0_cols is None:
            self._t0_cols = [self.t0_coord[0, c][1] for c in range(n_cols)]
        return self._t0_cols

    @cute.jit
    def apply(
        self,
        acc_S: cute.Tensor,
        m_block: Int32,
        n_block: Int32,
        mask_seqlen: cutlass.Constexpr[bool],
        mask_causal: cutlass.Constexpr[bool],
        when=None,
    ) -> None:
        """Set masked entries of acc_S ((2, 2, V), MMA_M, MMA_N fp32) to -inf.

        mask_seqlen: mask keys >= seqlen_k (only the last KV block needs it).
        mask_causal: mask keys after the query (only diagonal blocks need it).
        when: a run-time Boolean: mask only where it holds (one uniform branch;
        the sm90 forward's merged diagonal loop).
        """
        s_mn = acc_mn_view(acc_S)
        col_offset = self.t_coord[0][1]
        cols0 = self.t0_cols(cute.size(s_mn, mode=[1]))
        # Limits on thread 0's column index, shifted by this thread's offset.
        # Element-wise arith.select (cutlass.select_), not `a if c else b`, which
        # the DSL traces as an scf.if region per element for the compiler to fold.
        seqlen_limit = self.seqlen_k - n_block * self.tile_n - col_offset
        if cutlass.const_expr(when is not None):
            if when:
                self._select(s_mn, cols0, col_offset, seqlen_limit, m_block, n_block,
                             mask_seqlen, mask_causal)
        else:
            self._select(s_mn, cols0, col_offset, seqlen_limit, m_block, n_block, mask_seqlen,
                         mask_causal)

    @cute.jit
    def _select(self, s_mn, cols0, col_offset, seqlen_limit, m_block, n_block,
                mask_seqlen: cutlass.Constexpr[bool], mask_causal: cutlass.Constexpr[bool]):
        n_rows = cute.size(s_mn, mode=[0])
        n_cols = cute.size(s_mn, mode=[1])
        neg_inf = -Float32.inf
        if cutlass.const_expr(mask_causal):
            if cutlass.const_expr(self.bitmask):
                self._check_columns(cols0)
            for r in cutlass.range_constexpr(n_rows):
                row = self.t_coord[r, 0][0] + m_block * self.tile_m
                # Key j is visible iff j <= row, i.e. local column < row + 1 - n0.
                limit = row + 1 - n_block * self.tile_n - col_offset
                if cutlass.const_expr(mask_seqlen):
                    limit = cutlass.min(limit, seqlen_limit)
                if cutlass.const_expr(self.bitmask):
                    self._select_by_bits(s_mn, r, n_cols, limit)
                else:
                    for c in cutlass.range_constexpr(n_cols):
                        # A select, not a branch: keeps the fragment in registers.
                        s_mn[r, c] = Float32(
                            cutlass.select_(cols0[c] >= limit, neg_inf, s_mn[r, c]))
        elif cutlass.const_expr(mask_seqlen):
            for c in cutlass.range_constexpr(n_cols):
                masked = cols0[c] >= seqlen_limit
                for r in cutlass.range_constexpr(n_rows):
                    s_mn[r, c] = Float32(cutlass.select_(masked, neg_inf, s_mn[r, c]))

    @staticmethod
    def _check_columns(cols0: list) -> None:
        """At trace time: the bitmask needs the sm90 accumulator's column pattern."""
        if list(cols0) != [acc_column(e) for e in range(len(cols0))]:
            raise ValueError("TileMask(bitmask=True) needs the sm90 accumulator's columns "
                             f"(pairs 8 apart), got {list(cols0)}")

    @cute.jit
    def _select_by_bits(self, s_mn, r: cutlass.Constexpr[int], n_cols: cutlass.Constexpr[int],
                        limit: Int32):
        """Row r of s_mn: elements at or past ``visible_elements(limit)`` become -inf,
        one 32-bit keep mask per 32 elements."""
        visible = visible_elements(limit, maximum=cutlass.max, minimum=cutlass.min)
        for w in cutlass.range_constexpr((n_cols + _WORD - 1) // _WORD):
            keep = _shr_b32(Uint32(0xFFFFFFFF), keep_shift(visible, w, maximum=cutlass.max))
            for i in cutlass.range_constexpr(min(_WORD, n_cols - w * _WORD)):
                c = w * _WORD + i
                kept = (keep & Uint32(1 << i)) != Uint32(0)
                s_mn[r, c] = Float32(cutlass.select_(kept, s_mn[r, c], -Float32.inf))


# The lower end of an empty key / query interval (rules/ranges.py: EMPTY_LO).
_EMPTY_LO = 1 << 30


def decode_hi(hi: Int32):
    """(hi, exact) of a stored interval end: a bit-inverted end marks a row whose
    segment is not contiguous (rules/ranges.py)."""
    return cutlass.select_(hi < 0, ~hi, hi), hi >= 0


class BlockRange:
    """The blocks one tile visits, from the intervals of its rows (rules/ranges.py),
    reduced over the tile by one warp: lane l reads rows l, l + 32, ... . Rows past
    the tensor's end (the last tile's padding) take no part.

    first, end: the blocks [first, end) hold every visible element of the tile
    (``at_least_one``: a tile with none still visits block 0, fully masked, which
    writes its rows' out 0 and lse -inf through the ordinary path).
    full_first, full_end: blocks in [full_first, full_end) are visible in every
    element of every row, so they need no element mask. A tile with a row whose
    segment is not contiguous has none (full_end = 0): its every block compares ids.

    flash-attn-4's ``BlockInfo`` finds the same first and last blocks from the
    causal / window diagonal; here they come from the intervals, so one rule serves
    every mask.
    """

    def __init__(self, mRanges: cute.Tensor, tile: int, block: int, tile_idx: Int32,
                 batch: Int32, num_rows: Int32, at_least_one: bool):
        lane = cute.arch.lane_idx()
        lo_min = Int32(_EMPTY_LO)
        lo_max = Int32(0)
        hi_max = Int32(0)
        hi_min = Int32(_EMPTY_LO)
        for k in range((tile + 31) // 32):  # traced inline: a static Python loop
            row = tile_idx * tile + k * 32 + lane
            ok = row < num_rows
            if k * 32 + 32 > tile:
                ok = ok & (k * 32 + lane < tile)
            at = cutlass.min(row, num_rows - 1)
            lo = mRanges[batch, at, 0]
            hi_raw = mRanges[batch, at, 1]
            hi, _ = decode_hi(hi_raw)
            lo_min = cutlass.min(lo_min, cutlass.select_(ok, lo, Int32(_EMPTY_LO)))
            lo_max = cutlass.max(lo_max, cutlass.select_(ok, lo, Int32(0)))
            hi_max = cutlass.max(hi_max, cutlass.select_(ok, hi, Int32(0)))
            # An inexact row leaves no block free of the mask.
            hi_min = cutlass.min(hi_min, cutlass.select_(ok, cutlass.select_(
                hi_raw < 0, Int32(0), hi), Int32(_EMPTY_LO)))
        lo_min = cute.arch.warp_reduction(lo_min, cutlass.min)
        lo_max = cute.arch.warp_reduction(lo_max, cutlass.max)
        hi_max = cute.arch.warp_reduction(hi_max, cutlass.max)
        hi_min = cute.arch.warp_reduction(hi_min, cutlass.min)
        first = lo_min // block
        end = (hi_max + block - 1) // block
        if at_least_one:
            none = end <= first
            first = cutlass.select_(none, Int32(0), first)
            end = cutlass.select_(none, Int32(1), end)
        else:
            end = cutlass.max(end, first)
        # Uniform over the warp (a reduction's result): said so, ptxas may keep them
        # in uniform registers, which the MMA warps' walk has to spare.
        uniform = cute.arch.make_warp_uniform
        self.first = uniform(first)
        self.end = uniform(end)
        self.full_first = uniform((lo_max + block - 1) // block)
        self.full_end = uniform(hi_min // block)
        self.block = block

    @classmethod
    def of(cls, fields: tuple, block: int) -> BlockRange:
        """The range whose ``fields()`` another warp reduced (the sm90 forward's load
        warp hands them to its consumers, Note [Tile ring] in sm90_fwd.py)."""
        r = cls.__new__(cls)
        uniform = cute.arch.make_warp_uniform
        r.first, r.end, r.full_first, r.full_end = (uniform(f) for f in fields)
        r.block = block
        return r

    def fields(self) -> tuple:
        """(first, end, full_first, full_end)."""
        return self.first, self.end, self.full_first, self.full_end

    def split(self, split: Int32, num_splits: Int32) -> tuple:
        """Keep split ``split`` of ``num_splits`` of the blocks (split keys, Note [Split
        keys] in sm90_fwd.py); returns the keys [lo, hi) the split may see, for
        ``RangeMask(keys=...)``. An empty split still visits one block, with no key
        visible, so that its rows get out 0 and lse -inf through the ordinary path."""
        first, end, keys = split_blocks(self.first, self.end, split, num_splits, self.block,
                                        cutlass.select_, cutlass.min)
        uniform = cute.arch.make_warp_uniform
        self.first, self.end = uniform(first), uniform(end)
        return keys

    @staticmethod
    def masked_block(n: Int32, full_first: Int32, full_end: Int32):
        """Whether block n needs the element mask (from the fields of a BlockRange,
        read before a loop: a run-time loop carries no Python objects)."""
        return (n < full_first) | (n >= full_end)


def split_blocks(first, end, split, num_splits, block,
                 select=lambda c, a, b: a if c else b, minimum=min):
    """(first, end, (key_lo, key_hi)) of split ``split`` of a tile's blocks [first,
    end): ceil(n / num_splits) consecutive blocks each, the last splits shorter or
    empty. An empty split keeps one block, [first, first + 1), with the empty key
    range (0, 0), which masks all of it. For plain ints (the host mirror in tests)
    and DSL integers (``cutlass.select_`` / ``cutlass.min``) alike."""
    per = (end - first + num_splits - 1) // num_splits
    lo = first + split * per
    hi = minimum(end, lo + per)
    empty = hi <= lo
    keys = (select(empty, 0, lo * block), select(empty, 0, hi * block))
    return select(empty, first, lo), select(empty, first + 1, hi), keys


def edge_walk(first, end, full_first, full_end, minimum=min, maximum=max):
    """(hi_edge, lo_edge) of a forward tile's walk over blocks [first, end), from the
    last: [hi_edge, end) masked (the last block always: it carries the sequence
    end), [lo_edge, hi_edge) unmasked (inside ``BlockRange``'s full blocks), and
    [first, lo_edge) masked again. For plain ints (the host mirror in tests) and DSL
    integers (``cutlass.min`` / ``cutlass.max``) alike."""
    hi_edge = maximum(minimum(full_end, end - 1), first)
    lo_edge = maximum(minimum(full_first, hi_edge), first)
    return hi_edge, lo_edge


class RangeMask:
    """Masks a (tile_m, tile_n) sm90 score tile of one thread to its rows' key
    intervals (rules/ranges.py), and, for rows whose segment is not contiguous, to
    equal segment ids. Rows are queries and columns keys (the forward's S). A row's
    interval is read (from L1) when a block needs the mask, not held across the
    loop: the consumers have no registers to spare.

    mRanges: (B, Sq, 2) int32; mQSeg, mKSeg: (B, Sq) / (B, Sk) int32 segment ids, or
    None where the kernel takes none; keys: (lo, hi), keys outside which every row
    is masked too (a split's, ``BlockRange.split``), or None.
    """

    def __init__(self, tile_m: int, tile_n: int, thr_mma, thr_mma_t0, mRanges: cute.Tensor,
                 mQSeg, mKSeg, m_block: Int32, batch: Int32, seqlen_q: Int32,
                 seqlen_k: Int32, keys: tuple | None = None):
        self.keys = keys
        self.tile_m = tile_m
        self.tile_n = tile_n
        c_tile = cute.make_identity_tensor((tile_m, tile_n))
        self.t_coord = acc_mn_view(thr_mma.partition_C(c_tile))
        t0_coord = acc_mn_view(thr_mma_t0.partition_C(c_tile))
        n_cols = cute.size(self.t_coord, mode=[1])
        self.cols0 = [t0_coord[0, c][1] for c in range(n_cols)]
        self.mRanges, self.mQSeg, self.mKSeg = mRanges, mQSeg, mKSeg
        self.m_block, self.batch = m_block, batch
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k

    @cute.jit
    def apply(self, acc_S: cute.Tensor, m_block: Int32, n_block: Int32,
              mask_seqlen: cutlass.Constexpr[bool] = True,
              mask_causal: cutlass.Constexpr[bool] = True, when=None) -> None:
        """Set the entries of acc_S ((2, 2, V), MMA_M, MMA_N fp32) outside their row's
        interval to -inf. ``TileMask.apply``'s signature; the intervals hold the
        sequence end and the diagonal, so mask_seqlen / mask_causal are ignored.
        when: a run-time Boolean: mask only where it holds."""
        s_mn = acc_mn_view(acc_S)
        if cutlass.const_expr(when is not None):
            if when:
                self._select(s_mn, n_block)
        else:
            self._select(s_mn, n_block)

    @cute.jit
    def _select(self, s_mn, n_block):
        n_rows = cute.size(s_mn, mode=[0])
        n_cols = cute.size(s_mn, mode=[1])
        col0 = n_block * self.tile_n + self.t_coord[0][1]
        any_cmp = Int32(0)
        for r in cutlass.range_constexpr(n_rows):
            row = cutlass.min(self.m_block * self.tile_m + self.t_coord[r, 0][0],
                              self.seqlen_q - 1)
            hi_raw = self.mRanges[self.batch, row, 1]
            hi, _ = decode_hi(hi_raw)
            lo = self.mRanges[self.batch, row, 0]
            if cutlass.const_expr(self.keys is not None):
                # Split keys: only this split's keys (none in an empty split).
                lo = cutlass.max(lo, self.keys[0])
                hi = cutlass.min(hi, self.keys[1])
            width = cutlass.max(hi - lo, 0)
            lo = lo - col0
            any_cmp = any_cmp | cutlass.select_(hi_raw < 0, Int32(1), Int32(0))
            for c in cutlass.range_constexpr(n_cols):
                s_mn[r, c] = keep_inside(s_mn[r, c], Int32(self.cols0[c]), lo, width)
        if cutlass.const_expr(self.mQSeg is not None):
            if any_cmp != 0:
                self._compare_segments(s_mn, col0)

    @cute.jit
    def _compare_segments(self, s_mn, col0):
        """-inf where the key's segment differs from the row's, in rows whose segment
        is not contiguous (the others' intervals hold only their own keys)."""
        n_rows = cute.size(s_mn, mode=[0])
        n_cols = cute.size(s_mn, mode=[1])
        for r in cutlass.range_constexpr(n_rows):
            row = cutlass.min(self.m_block * self.tile_m + self.t_coord[r, 0][0],
                              self.seqlen_q - 1)
            if self.mRanges[self.batch, row, 1] < 0:
                qseg = self.mQSeg[self.batch, row]
                for c in cutlass.range_constexpr(n_cols):
                    col = cutlass.min(col0 + self.cols0[c], self.seqlen_k - 1)
                    keep = self.mKSeg[self.batch, col] == qseg
                    s_mn[r, c] = Float32(cutlass.select_(keep, s_mn[r, c], -Float32.inf))
