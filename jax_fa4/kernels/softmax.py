"""Online softmax for the forward kernels: exp2 domain, FA4's lazy rescale.

Device-side helpers shared by the forward kernels. Every function here runs
inside a ``@cute.kernel`` trace; tensors are per-thread register fragments of a
wgmma accumulator.

Note [Lazy rescale]
~~~~~~~~~~~~~~~~~~~
Classic online softmax keeps the running row max ``m`` and, whenever a new KV
block raises it, multiplies O and the row sum by ``2^((m_old - m_new) * c)``
(``c = softmax_scale * log2(e)``). FA4 keeps the *stale* max instead, unless
the new block's max exceeds it by more than ``RESCALE_THRESHOLD = 8.0`` in log2
units (a factor 256). This is exact, not an approximation:

* O and the row sum are both accumulated against the same reference max (the
  stale one). The final ``O / row_sum`` divides out any common reference, so it
  does not matter which max was used, only that both used the same one.
* The LSE is ``(m_ref * c + log2(row_sum)) * ln 2`` with that same ``m_ref``, so
  it is exact as well.
* While the max is stale, ``P = 2^(s*c - m_ref*c) <= 2^8 = 256``. That is far
  below the fp16 limit (65504) and bf16's range, so P converts to 16 bits
  without overflow, and the fp32 accumulators of O and the row sum gain at
  most 8 bits of magnitude over a fresh-max run, far from overflow.

On Hopper O lives in registers, so a skipped rescale saves the FMULs over the
O accumulator (64 per thread per KV block at head dim 128) and, more
importantly, the scale's exp2 and its dependency chain rarely matter: after
the first few KV blocks the running max of real data almost never grows by a
factor of 256.

A fully masked row keeps ``m = -inf``; the exponent then uses 0 as the
reference so that ``exp2(-inf - 0) = 0`` instead of ``exp2(-inf + inf) = NaN``.

Note [Short max chain]
~~~~~~~~~~~~~~~~~~~~~~
The path from the last score to the first exp2 is latency: each warpgroup's
softmax starts it after its S wgmma. ``short_chain`` shortens it:
* the row max uses fmax (FMNMX) in four independent chains, not the
  NaN-propagating reduction (FMNMX.NAN, and an FSETP / FSETP / FSEL per quad
  shuffle step), with the old max folded in before the shuffles;
* the keep test compares the new max with ``ref + threshold / c`` and the
  exponent offset ``-ref * c`` of the kept reference, both computed a block
  ahead, so after the shuffles only the new max's own offset (an FSETP / FSEL /
  FMUL) and one select stand before the first FFMA.
It needs c > 0, which the kernels get (``rules.kernels_cuda`` runs a negative
scale as -q with |scale|). Scores that are NaN no longer propagate into the max;
they still make their own P NaN.

Note [Row sum in chains]
~~~~~~~~~~~~~~~~~~~~~~~~
The row sum of P (``TensorSSA.reduce``) compiles to one serial chain of 32 FADDs
per row, and with it ptxas issues a row's 32 exponent FFMAs (s * c - m * c) back to
back before the row's first exp2 of P (every step at hdim 64 and at hdim 128
non-causal; hdim 128's masked causal step): the MUFU pipe waits for those issue
slots. flash-attn-4's hdim 64 step issues its first exp2 after two of
them (step_compare.py, twenty-fifth session). Emitting the FFMA and the exp2 per
element does not change the SASS. With ``row_sum_chains`` = k the sum runs in k
serial chains (element i into chain i mod k), and at hdim 64 (either mask) ptxas
then issues the first exp2 after 6 of the FFMAs; it also moves the P V wait (Note
[P V wait] in sm90_fwd.py) up: before every exp2 at k = 2 or 4, after 5 of them at
k = 8, against 9-10 with the single chain. At hdim 128 it does not help: the
non-causal step keeps its 32 FFMAs first, and the causal kernel's unmasked step goes
from 7 to 32. With pin_pv_wait, hdim 64 goes back to 29 FFMAs first. The sum is the same
up to fp32 rounding order. Measured on the H200 (twenty-sixth session, hdim 64
8k, 3 rounds of 1 s, one process, x the single chain): k = 2 1.010 non-causal and
0.995 causal, k = 8 0.988 / 0.987. The table takes k = 2 at hdim 64 non-causal. The
chains need not divide the row: at hdim 256 (tile_n 80) a row has 20 elements per
thread.
"""

from __future__ import annotations

import math

import cutlass
from cutlass import Float32, cute

from jax_fa4.kernels.exp2 import exp2_poly

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# See Note [Lazy rescale]: the max may lag by this many log2 units (P <= 2^8).
RESCALE_THRESHOLD = 8.0


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """View an sm90 wgmma accumulator fragment as (rows, cols) of this thread.

    acc: ((2, 2, V), MMA_M, MMA_N) fp32 fragment, where the first 2 are two
    adjacent columns, the second 2 are rows r and r + 8, and V counts column
    groups of 8. Returns a view ((2, MMA_M), (2, V, MMA_N)) of the same registers,
    so that ``view[r, None]`` is one row held by this thread.
    """
    flat = cute.make_layout(acc.layout.shape)
    shp, std = flat.shape, flat.stride
    row_shape = (shp[0][1], shp[1])
    row_stride = (std[0][1], std[1])
    col_shape = (shp[0][0], *shp[0][2:], shp[2])
    col_stride = (std[0][0], *std[0][2:], std[2])
    mn = cute.make_layout((row_shape, col_shape), stride=(row_stride, col_stride))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


class OnlineSoftmax:
    """Running row max and row sum of one thread's rows, exp2 domain.

    scale_log2: softmax_scale * log2(e), a compile-time float.
    num_rows: rows of the accumulator this thread holds (2 per 64-row wgmma tile).
    The row sum is kept per thread (partial over this thread's columns) and
    reduced across the 4 threads of a row only in ``finalize``; that is valid
    because all 4 threads apply the same per-row scale (the max is reduced
    across them every block).
    """

    def __init__(
        self,
        scale_log2: float,
        num_rows: int,
        rescale_threshold: float = RESCALE_THRESHOLD,
        short_chain: bool = False,
        sw_exp2_per_32: int = 0,
        quad_fmax: bool = False,
        row_fmax: bool = False,
        row_sum_chains: int = 0,
    ):
        if short_chain and not scale_log2 > 0:
            raise ValueError(f"the short max chain needs a positive scale, got {scale_log2}")
        if sw_exp2_per_32 not in (0, 1, 2, 4, 8, 16):
            raise ValueError(f"sw_exp2_per_32 must be 0 or a power of two up to 16, "
                             f"got {sw_exp2_per_32}")
        # Of every 32 columns of a row, this many (evenly spread) take P's exp2 from
        # the polynomial (exp2_poly) instead of MUFU (Note [Software exp2]).
        self.sw_exp2_per_32 = sw_exp2_per_32
        # The row max's quad shuffles with fmax (FMNMX) instead of the
        # NaN-propagating reduction (an FSETP.NAN, FSETP.GTU and FSEL per shuffle
        # step). A NaN score still makes its own P, and so the row, NaN.
        self.quad_fmax = quad_fmax
        # The thread's own columns of a row reduced with fmax (FMNMX) in four
        # independent chains, the old max folded in before the quad shuffles,
        # instead of ``TensorSSA.reduce`` (FMNMX.NAN, one chain per row). Same NaN
        # behaviour as quad_fmax.
        self.row_fmax = row_fmax
        # P's row sum in this many serial chains, 0: TensorSSA.reduce (Note [Row
        # sum in chains]).
        if row_sum_chains not in (0, 1, 2, 4, 8):
            raise ValueError(f"row_sum_chains must be 0, 1, 2, 4 or 8, got {row_sum_chains}")
        if row_sum_chains and sw_exp2_per_32:
            raise ValueError("row_sum_chains and sw_exp2_per_32 do not combine")
        self.row_sum_chains = row_sum_chains
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        self.rescale_threshold = rescale_threshold
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)
        # Note [Short max chain]: with short_chain, per row also the exponent
        # offset of the reference max (-ref * c, 0 for -inf) and the largest block
        # max that keeps it (ref + threshold / c), both computed a block ahead.
        self.short_chain = short_chain
        if short_chain:
            self.neg_ref = cute.make_rmem_tensor(num_rows, Float32)
            self.keep_limit = cute.make_rmem_tensor(num_rows, Float32)

    def reset(self) -> None:
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)
        if cutlass.const_expr(self.short_chain):
            self.neg_ref.fill(0.0)
            self.keep_limit.fill(-Float32.inf)

    @cute.jit
    def online_softmax(
        self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool] = False
    ) -> cute.Tensor:
        """Turn the scores acc_S into P in place; return the per-row O scale.

        acc_S: ((2, 2, V), MMA_M, MMA_N) fp32 raw scores q.k (unscaled), masked
        entries at -inf. On return it holds P = 2^(s*c - m_ref*c) and the row
        sums are updated; the returned (num_rows,) tensor is the factor O must be
        multiplied by (exactly 1.0 for rows whose reference max did not move).
        """
        if cutlass.const_expr(self.short_chain):
            return self._online_softmax_short(acc_S, is_first)
        s_mn = acc_mn_view(acc_S)
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        c = self.scale_log2
        for r in cutlass.range_constexpr(self.num_rows):
            row = s_mn[r, None].load()
            if cutlass.const_expr(self.row_fmax):
                # Includes the old max (so blk_max is the new candidate).
                blk_max = self._thread_fmax(s_mn[r, None], r, is_first)
            else:
                blk_max = row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
            # The 4 threads of a quad hold the 4 column slices of the row.
            if cutlass.const_expr(self.quad_fmax):
                blk_max = cute.arch.warp_reduction(blk_max, cute.arch.fmax, threads_in_group=4)
            else:
                blk_max = cute.arch.warp_reduction_max(blk_max, threads_in_group=4)
            if cutlass.const_expr(is_first):
                ref = blk_max
                row_scale[r] = Float32(1.0)
            else:
                old = self.row_max[r]
                cand = blk_max
                if cutlass.const_expr(not self.row_fmax):
                    cand = cute.arch.fmax(old, blk_max)
                # NaN (both -inf) compares false and takes cand, which is -inf too.
                keep = (cand - old) * c <= self.rescale_threshold
                ref = old if keep else cand
                cand_safe = Float32(0.0) if cand == -Float32.inf else cand
                # Only used when the max moves; exp2(-inf) = 0 when old is -inf.
                scale = cute.math.exp2((old - cand_safe) * c, fastmath=True)
                row_scale[r] = Float32(1.0) if keep else scale
            self.row_max[r] = ref
            ref_safe = Float32(0.0) if ref == -Float32.inf else ref
            neg_ref_scaled = -ref_safe * c
            if cutlass.const_expr(self.row_sum_chains > 0):
                p, blk_sum = self._exp2_chained(s_mn[r, None], neg_ref_scaled)
            else:
                if cutlass.const_expr(self.sw_exp2_per_32 == 0):
                    p = cute.math.exp2(row * c + neg_ref_scaled, fastmath=True)
                else:
                    p = self._exp2_mixed(s_mn[r, None], neg_ref_scaled)
                blk_sum = p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if cutlass.const_expr(is_first):
                self.row_sum[r] = blk_sum
            else:
                self.row_sum[r] = self.row_sum[r] * row_scale[r] + blk_sum
            s_mn[r, None].store(p)
        return row_scale

    @cute.jit
    def _thread_fmax(self, row: cute.Tensor, r: cutlass.Constexpr[int],
                     is_first: cutlass.Constexpr[bool]) -> Float32:
        """Max of this thread's columns of row r (and, after the first block, of the
        running max), in four independent fmax chains (``row_fmax``)."""
        n = cute.size(row)
        assert n >= 4, n
        chains = [row[i] for i in range(4)]
        for i in cutlass.range_constexpr(4, n):
            chains[i % 4] = cute.arch.fmax(chains[i % 4], row[i])
        m = cute.arch.fmax(cute.arch.fmax(chains[0], chains[1]),
                           cute.arch.fmax(chains[2], chains[3]))
        if cutlass.const_expr(not is_first):
            m = cute.arch.fmax(m, self.row_max[r])
        return m

    @cute.jit
    def _exp2_mixed(self, row: cute.Tensor, neg_ref_scaled: Float32):
        """exp2(row * c + neg_ref_scaled) of one row's registers, returned as a
        TensorSSA: every (32 / sw_exp2_per_32)-th column from exp2_poly, the rest
        from MUFU, so the FMA and MUFU pipes share the row."""
        step = 32 // self.sw_exp2_per_32
        c = self.scale_log2
        for i in cutlass.range_constexpr(cute.size(row)):
            x = row[i] * c + neg_ref_scaled
            if cutlass.const_expr(i % step == step - 1):
                row[i] = exp2_poly(x)
            else:
                row[i] = cute.math.exp2(x, fastmath=True)
        return row.load()

    @cute.jit
    def _exp2_chained(self, row: cute.Tensor, neg_ref_scaled: Float32):
        """(P, its sum) of one row's registers: exp2(row * c + neg_ref_scaled) per
        element, written back to ``row``, summed in ``row_sum_chains`` serial chains
        (element i into chain i mod k, so the chains differ by at most one
        element where k does not divide the row; Note [Row sum in chains])."""
        k = self.row_sum_chains
        n = cute.size(row)
        assert n >= k, (n, k)
        c = self.scale_log2
        chains = [None] * k
        for i in cutlass.range_constexpr(n):
            e = cute.math.exp2(row[i] * c + neg_ref_scaled, fastmath=True)
            row[i] = e
            if cutlass.const_expr(i < k):
                chains[i] = e
            else:
                chains[i % k] = chains[i % k] + e
        total = chains[0]
        for j in cutlass.range_constexpr(1, k):
            total = total + chains[j]
        return row.load(), total

    @cute.jit
    def _online_softmax_short(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool]):
        """``online_softmax`` with the short max chain (Note [Short max chain])."""
        s_mn = acc_mn_view(acc_S)
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        c = self.scale_log2
        for r in cutlass.range_constexpr(self.num_rows):
            row = s_mn[r, None]
            # Four independent fmax chains over the thread's columns and the old
            # max, then across the quad.
            cand = self._thread_fmax(row, r, is_first)
            for offset in (2, 1):
                cand = cute.arch.fmax(cand, cute.arch.shuffle_sync_bfly(cand, offset=offset))
            cand_safe = Float32(0.0) if cand == -Float32.inf else cand
            neg_cand = -cand_safe * c
            if cutlass.const_expr(is_first):
                ref = cand
                neg_ref = neg_cand
                row_scale[r] = Float32(1.0)
            else:
                old = self.row_max[r]
                # cand >= old; -inf <= -inf keeps a row that saw only masked keys.
                keep = cand <= self.keep_limit[r]
                ref = old if keep else cand
                neg_ref = self.neg_ref[r] if keep else neg_cand
                # exp2((old - cand) c); 0 when old is -inf. Used only when it moves.
                scale = cute.math.exp2(old * c + neg_cand, fastmath=True)
                row_scale[r] = Float32(1.0) if keep else scale
            if cutlass.const_expr(self.row_sum_chains > 0):
                p, blk_sum = self._exp2_chained(row, neg_ref)
            else:
                if cutlass.const_expr(self.sw_exp2_per_32 == 0):
                    p = cute.math.exp2(row.load() * c + neg_ref, fastmath=True)
                else:
                    p = self._exp2_mixed(row, neg_ref)
                blk_sum = p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            self.row_max[r] = ref
            self.neg_ref[r] = neg_ref
            self.keep_limit[r] = ref + self.rescale_threshold / c
            if cutlass.const_expr(is_first):
                self.row_sum[r] = blk_sum
            else:
                self.row_sum[r] = self.row_sum[r] * row_scale[r] + blk_sum
            row.store(p)
        return row_scale

    @cute.jit
    def finalize(self) -> tuple[cute.Tensor, cute.Tensor]:
        """Return (1 / row_sum, lse) per row; lse is natural-log, scaled logits.

        A row with no unmasked key (sum 0) gets scale 0 and lse -inf, so its O is
        0 instead of NaN.
        """
        inv_sum = cute.make_rmem_tensor(self.num_rows, Float32)
        lse = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            empty = total == 0.0 or total != total  # noqa: PLR0124 (NaN test)
            inv_sum[r] = Float32(0.0) if empty else cute.arch.rcp_approx(total)
            m = self.row_max[r]
            m_safe = Float32(0.0) if m == -Float32.inf else m
            log2_sum = cute.math.log2(Float32(1.0) if empty else total, fastmath=True)
            lse[r] = -Float32.inf if empty else (m_safe * self.scale_log2 + log2_sum) * LN_2
        return inv_sum, lse


@cute.jit
def rescale_rows(acc: cute.Tensor, row_scale: cute.Tensor) -> None:
    """Multiply each row of an accumulator fragment by row_scale[row].

    acc: ((2, 2, V), MMA_M, MMA_N) fp32; row_scale: (rows of this thread,).
    """
    acc_mn = acc_mn_view(acc)
    for r in cutlass.range_constexpr(cute.size(row_scale)):
        acc_mn[r, None].store(acc_mn[r, None].load() * row_scale[r])


@cute.jit
def rescale_rows_if_needed(acc: cute.Tensor, row_scale: cute.Tensor) -> None:
    """``rescale_rows``, skipped when every scale is exactly 1 (lazy rescale).

    The test is per thread; the 4 threads of a row always agree, and a warp
    whose threads disagree just runs the multiply on some lanes.
    """
    needed = row_scale[0] != 1.0
    for r in cutlass.range_constexpr(1, cute.size(row_scale)):
        needed = needed or row_scale[r] != 1.0
    if needed:
        rescale_rows(acc, row_scale)
