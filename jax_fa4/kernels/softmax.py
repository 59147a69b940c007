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

Note [Softcap in the kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With softcap c each scaled logit s = scale * q.k becomes c * tanh(s / c). The kernels
keep t = tanh(q.k * scale / c) in the score registers (an FMUL and one MUFU.TANH per
score, before the mask, so a masked score is still -inf) and run the softmax on t
with ``scale_log2`` = c * log2(e) in place of scale * log2(e): the exponents, the
row max and the lse are then those of the capped logits, and the forward is
otherwise unchanged (flash-attn-4 also applies its softcap before the mask, as a
score modifier).

The backward needs dS = P (dP - D) (1 - t^2) (times the scale, which dQ and dK take
as before). Each score's P goes straight to the 16-bit operand of the dV GEMM, and
P (1 - t^2) takes the score's register, where dS reads it as it reads P without
softcap: no register lives longer than without softcap. (Recovering t from P
after the conversion, t = (log2 P + LSElog2) / (c log2 e), kept the LSE registers
live across the conversion and spilled the sm_90a backward.) A masked score is
-inf, its P 0, and its product 0, not 0 * -inf.

Note [Row sum in chains]
~~~~~~~~~~~~~~~~~~~~~~~~
The row sum of P (``TensorSSA.reduce``) compiles to one serial chain of 32 FADDs
per row, and with it ptxas issues a row's 32 exponent FFMAs (s * c - m * c) back to
back before the row's first exp2 of P: the MUFU pipe waits for those issue slots
(flash-attn-4's hdim 64 step issues its first exp2 after two of them). Emitting the
FFMA and the exp2 per element does not change the SASS. With ``row_sum_chains`` = k
the sum runs in k serial chains (element i into chain i mod k), and at hdim 64
ptxas then issues the first exp2 after a few of the FFMAs; it also moves the P V
wait (Note [P V wait] in sm90_fwd.py) up. At hdim 128 it does not help: the
non-causal step keeps its 32 FFMAs first. The sum is the same up to fp32 rounding
order. The chains need not divide the row: at hdim 256 (tile_n 80) a row has 20
elements per thread.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, cute

from jax_fa4.config import LN_2, LOG2_E

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
    row_sum_chains: P's row sum in this many serial chains, 0 for one reduction
    (Note [Row sum in chains]).
    The row sum is kept per thread (partial over this thread's columns) and
    reduced across the 4 threads of a row only in ``finalize``; that is valid
    because all 4 threads apply the same per-row scale (the max is reduced
    across them every block).
    """

    def __init__(self, scale_log2: float, num_rows: int, row_sum_chains: int = 0):
        if row_sum_chains not in (0, 1, 2, 4, 8):
            raise ValueError(f"row_sum_chains must be 0, 1, 2, 4 or 8, got {row_sum_chains}")
        self.row_sum_chains = row_sum_chains
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)

    def reset(self) -> None:
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

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
        s_mn = acc_mn_view(acc_S)
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        c = self.scale_log2
        for r in cutlass.range_constexpr(self.num_rows):
            row = s_mn[r, None].load()
            blk_max = row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
            # The 4 threads of a quad hold the 4 column slices of the row. fmax
            # (FMNMX), not the NaN-propagating reduction (an FSETP.NAN, FSETP.GTU and
            # FSEL per shuffle step): a NaN score still makes its own P, and so the
            # row, NaN.
            blk_max = cute.arch.warp_reduction(blk_max, cute.arch.fmax, threads_in_group=4)
            if cutlass.const_expr(is_first):
                ref = blk_max
                row_scale[r] = Float32(1.0)
            else:
                old = self.row_max[r]
                cand = cute.arch.fmax(old, blk_max)
                # NaN (both -inf) compares false and takes cand, which is -inf too.
                keep = (cand - old) * c <= RESCALE_THRESHOLD
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
                p = cute.math.exp2(row * c + neg_ref_scaled, fastmath=True)
                blk_sum = p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if cutlass.const_expr(is_first):
                self.row_sum[r] = blk_sum
            else:
                self.row_sum[r] = self.row_sum[r] * row_scale[r] + blk_sum
            s_mn[r, None].store(p)
        return row_scale

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
    def finalize(self, sink_log2=None) -> tuple[cute.Tensor, cute.Tensor]:
        """Return (1 / row_sum, lse) per row; lse is natural-log, scaled logits.

        A row with no unmasked key (sum 0) gets scale 0 and lse -inf, so its O is
        0 instead of NaN. ``sink_log2``: the rows' sink logit in log2 units, one
        more term of the denominator (Note [Sinks in the denominator]); a row with
        no key then has O 0 and lse the sink; a tensor: one per row (rows of
        different query heads, Note [Packed GQA] in sm90_fwd.py).
        """
        inv_sum = cute.make_rmem_tensor(self.num_rows, Float32)
        lse = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            m = self.row_max[r]
            m_safe = Float32(0.0) if m == -Float32.inf else m
            if cutlass.const_expr(sink_log2 is None):
                empty = total == 0.0 or total != total  # noqa: PLR0124 (NaN test)
                inv_sum[r] = Float32(0.0) if empty else cute.arch.rcp_approx(total)
                log2_sum = cute.math.log2(Float32(1.0) if empty else total, fastmath=True)
                lse[r] = -Float32.inf if empty else (m_safe * self.scale_log2 + log2_sum) * LN_2
            elif cutlass.const_expr(isinstance(sink_log2, cute.Tensor)):
                inv_sum[r], lse[r] = finalize_with_sink(total, m, self.scale_log2,
                                                        sink_log2[r])
            else:
                inv_sum[r], lse[r] = finalize_with_sink(total, m, self.scale_log2, sink_log2)
        return inv_sum, lse


@cute.jit
def finalize_with_sink(total: Float32, m: Float32, scale_log2: float, sink_log2: Float32):
    """(O's row scale, lse) of a row whose softmax denominator also holds a sink
    logit (``sink_log2`` in log2 units): ``total`` is the row's sum of P and O its
    accumulator, both relative to the row's reference max ``m`` (raw units).

    Note [Sinks in the denominator]: against top = max(m * scale_log2, sink) neither
    the sink's term nor the sum can overflow, and a row with no key (m = -inf)
    keeps nothing of its (zero) sum: its O is 0 and its lse the sink.
    """
    m2 = -Float32.inf if m == -Float32.inf else m * scale_log2
    top = cute.arch.fmax(m2, sink_log2)
    keep = cute.math.exp2(m2 - top, fastmath=True)
    total = total * keep + cute.math.exp2(sink_log2 - top, fastmath=True)
    return keep * cute.arch.rcp_approx(total), (top + cute.math.log2(total, fastmath=True)) * LN_2


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


def score_scales(softmax_scale: float, softcap: float | None) -> tuple[float | None, float]:
    """(the factor of q.k inside the tanh, or None without softcap; ``scale_log2``,
    the factor of the softmax's exponents) (Note [Softcap in the kernels])."""
    if softcap is None:
        return None, softmax_scale * LOG2_E
    return softmax_scale / softcap, softcap * LOG2_E


@cute.jit
def cap_scores(scores: cute.Tensor, cap_in: float) -> None:
    """scores = tanh(scores * cap_in), in place (Note [Softcap in the kernels])."""
    scores.store(cute.math.tanh(scores.load() * cap_in, fastmath=True))


@cute.jit
def capped_grad(p: Float32, t: Float32) -> Float32:
    """p (1 - t^2), 0 where p is 0 (t may then be -inf: masked) (Note [Softcap in
    the kernels])."""
    return Float32(0.0) if p == 0.0 else p * (Float32(1.0) - t * t)
