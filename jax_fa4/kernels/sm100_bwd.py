"""Blackwell (sm_100a) backward attention main kernel: dK, dV and the fp32 dQ accumulator.

Status: compiled (cross-compiled for sm_100a on a CPU machine, PTX and SASS read),
never run on Blackwell hardware.

One CTA owns one key/value block (`tile_n` keys) of one kv head of one batch
entry and walks every query block of every query head of its GQA group, so dK
and dV accumulate in tensor memory over the whole walk (deterministic, no dK/dV
atomics). dQ partials (sum over this CTA's keys of dS K) are reduce-added into the
fp32 accumulator by TMA, unscaled (docs/design.md).

The scores are computed transposed, S^T = K Q^T and dP^T = V dO^T, so that the
key block is the MMA's M dimension: each TMEM lane is one key, which is the row
dV = P^T dO and dK = dS^T Q accumulate into.

Warp roles (16 warps, 512 threads):
  warps 0-3    dQ reduce: dQ (TMEM) -> registers -> SMEM -> TMA reduce-add
  warps 4-11   compute: P = exp2(S * scale * log2(e) - LSElog2) and
               dS = P * (dP - Dpsum), written to SMEM as 16-bit MMA operands;
               after the walk, the dK / dV epilogue (TMEM -> global)
  warp 12      MMA: allocates TMEM, issues every tcgen05.mma, frees TMEM
  warp 13      load: K, V once (TMA); Q, dO (TMA) and LSElog2, Dpsum per query block
  warps 14-15  idle (they only exist so that setmaxnreg sees whole warpgroups)

Per query block (one work item) the MMA warp issues
  S^T  = K Q^T           -> TMEM (tile_n x tile_m fp32)
  dP^T = V dO^T          -> TMEM
  dV  += P^T dO          A = P^T from SMEM, accumulated in TMEM
  dK  += dS^T Q          A = dS^T from SMEM, accumulated in TMEM
  dQ   = dS K            A = dS (the same SMEM tile read MN-major) -> TMEM
so the compute warps compute P while dP^T runs and dS while dV runs. With two
Q/dO stages (hdim 64) the next item's S^T is issued between dV and dK, so it
also runs while the compute warps work on dS. All MMA operands come from SMEM
(P^T too: FA4 keeps P in TMEM as the A operand, which needs hand-built
instruction descriptors), and the roles hand buffers to each other only through mbarrier pipelines:
  load -> MMA     kv, qdo (TMA transaction counts)
  load -> compute lse (LSElog2 / Dpsum rows, written with plain stores)
  MMA -> compute  s, dp (tcgen05.commit), dkv (once, after the walk)
  compute -> MMA  p, ds (SMEM operands written, proxy-fenced)
  MMA -> reduce   dq (tcgen05.commit), reduce -> MMA: dq released
The "empty" side of each pipeline is what makes buffer reuse safe: the MMA warp
acquires s / dp / dq before it overwrites those TMEM columns, the compute warps
acquire p / ds (released by tcgen05.commit once the MMAs reading them are done)
before they overwrite sP / sdS.

Note [Wide sm100 backward]: at DeepSeek's head dims (192, 128) dV (128 columns)
and dK (192) leave 192 of the 512 tensor-memory columns, and S^T, dP^T and dQ want
128 + 128 + 192. So dP^T is written over S^T (the MMA warp issues it once the
compute warps have read S^T into registers, which they do first thing), and dQ
over both, into the 64 columns after them (issued once dS is in SMEM, so once
dP^T has been read); the next item's S^T waits for the reduce warps to have read
dQ. In SMEM, Q, dO, K and V take 160 KiB at 128 queries and keys, so P^T and dS^T
share one tile: dS^T is written once dV has read P^T (the p pipeline), and the
next P^T once dK and dQ have read dS^T (the ds pipeline). Without the two Q / dO
stages of hdim 64 no S^T runs ahead, so nothing else waits. At 192, dV and dK leave
128 columns: dQ goes in two passes over them (``dq_passes``: head-dim columns 0-127,
then 128-191, each a whole number of K^T's 64-row atoms), the second once the
reduce warps have read the first; and Q, dO, K and V take 192 KiB, which leaves no
room for the dQ staging tiles, so the reduce warps add dQ rows from registers with
vector red.global.add (``BwdTiles.dq_direct``). flash-attn-4 runs (192, 128) with a
kernel of its own (its MLA backward) and has no sm100 backward at 192.

Note [Head-dim halves]: at head dim 256 dK and dV (128 keys x 256 columns each)
alone fill the 512 tensor-memory columns. So two CTAs share each key block, CTA h
owning head-dim columns [128 h, 128 h + 128) of dK, dV and dQ (``BwdTiles.dkv_split``);
each computes the block's whole S^T and dP^T (over all 256 columns), so those two
GEMMs run twice per key block: 7 GEMM units where one CTA would run 5. Tensor
memory then holds S^T and dP^T (64 columns each), the dV and dK halves (128 each)
and dQ^T (64): 448 columns, none shared. In SMEM, K and V take 64 KiB each, so a
query block is 64 rows (Q and dO 32 KiB each, P^T and dS^T 16 KiB each): 224 KiB,
one Q / dO stage, dQ added from registers (``dq_direct``). dQ = dS K would be an
M = 64 MMA, whose accumulator lies in tensor memory otherwise than the M = 128 ones
the reduce warps read; each CTA computes its half transposed instead, dQ^T = K^T
dS^T (M = 128 head-dim columns, N = 64 queries, both operands read MN-major from
the K and dS^T tiles): a reduce thread holds one head-dim column, and each warp
adds a query's 32 columns with one coalesced 128-byte red.global.add. flash-attn-4
runs this head dim on a two-CTA (cta_group::2) kernel whose M = 128 MMAs span both
CTAs' tensor memory; the halves keep to one-CTA MMAs at the cost of the repeated
S^T and dP^T.

Note [Tails and masking]: TMA zero-fills Q/dO rows past seqlen_q and K/V rows
past seqlen_k. Query rows past seqlen_q get LSElog2 = +inf (the load warp
stores -LSElog2 = -inf, the addend of P's exponent), so P = exp2(-inf) = 0
there and with it dS = 0: they add exact zeros to dV, dK and to the padding rows
of dQaccum (Sq_pad rows make every 128-row tile reduce in bounds). Keys past
seqlen_k and, when causal, query columns m < n of a key row n, are set to P = 0
explicitly with a select (so dS = 0 too, even where exp2 overflowed); their
dK/dV rows are not stored. A CTA whose keys see no query at all (causal,
n_block * tile_n >= seqlen_q) still writes dK = dV = 0 for its keys.
"""

import dataclasses
import logging
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05, warpgroup

from jax_fa4.kernels.cute_utils import (
    BwdMainCall,
    DqSemaphoreCall,
    check_bwd_operand_dtypes,
    init_bwd_kernel,
    masked_add_rank,
    permute,
    semaphore_release_after_bulk,
    semaphore_wait,
    set_mask_flags,
    tma_tile_partition,
)
from jax_fa4.kernels.dq_layout import det_add_rank, det_key_block
from jax_fa4.kernels.mask import BlockRange, keep_inside
from jax_fa4.kernels.softmax import cap_scores

log = logging.getLogger(__name__)


# Warp roles.
_COMPUTE_WARP0 = 4  # warps 4-11
_MMA_WARP = 12
_LOAD_WARP = 13
_NUM_WARPS = 16

# Named hardware barriers (0 is __syncthreads).
_BAR_TMEM = 1  # MMA + compute + reduce warps: TMEM address published / TMEM may be freed
_BAR_REDUCE = 2  # the four dQ reduce warps: the SMEM staging tile is free / written

_TMEM_COLS = 512  # the whole tensor memory: one CTA per SM
_SMEM_BYTES = 232448  # opt-in dynamic shared memory per block on sm_100


@dataclass(frozen=True)
class BwdTiles:
    """Tuning knobs of the sm100 backward kernel (one row of the table below)."""

    tile_m: int  # query rows per block (the N of S^T, the M of dQ)
    tile_n: int  # key rows per CTA (the M of S^T, dV, dK)
    stages_qdo: int  # Q/dO (and LSElog2/Dpsum) SMEM pipeline depth
    dq_cols: int  # dQ columns per TMEM load / SMEM staging tile / TMA reduce
    dq_stages: int  # SMEM staging tiles for the dQ reduce (double buffering)
    regs_compute: int  # setmaxnreg of the two compute warpgroups
    regs_reduce: int  # setmaxnreg of the dQ reduce warpgroup
    regs_other: int  # setmaxnreg of the MMA / load / idle warpgroup
    # Note [Wide sm100 backward]: dP^T in S^T's tensor-memory columns and dQ over
    # them, P^T and dS^T in one SMEM tile (head dim 192).
    wide: bool = False
    # dQ rows reduce-added from registers into the fp32 accumulator (red.global.add)
    # instead of through SMEM staging tiles and TMA (192, 192): no staging SMEM.
    dq_direct: bool = False
    # CTAs per key block, each owning head-dim columns [h d / n, (h + 1) d / n) of dK,
    # dV and dQ, dQ transposed (Note [Head-dim halves]); 1: one CTA owns them all.
    dkv_split: int = 1


def bwd_tiles(head_dim: int, causal: bool, head_dim_v: int | None = None) -> BwdTiles:
    """The tile table, keyed by head dim (FA4's 1-CTA sm100 choices, adapted).

    SMEM per stage of Q + dO is 32 KB at hdim 64 and 64 KB at hdim 128; with K, V,
    P, dS (32 KB each at hdim 128) and 32 KB of dQ staging only one stage fits
    at hdim 128 under the 227 KB limit. The register split sums to at most 512
    per thread slot over the four warpgroups (compute x 2 + reduce + MMA/load).
    """
    del causal  # same tiles; causal skips blocks instead
    if head_dim <= 64:
        return BwdTiles(tile_m=128, tile_n=128, stages_qdo=2, dq_cols=32, dq_stages=2,
                        regs_compute=168, regs_reduce=96, regs_other=80)
    if head_dim == 96:
        # hdim 128's row with one dQ stage: 96 columns, three chunks of 32, do not
        # split into two stages; three stages spilled the reduce warps.
        return BwdTiles(tile_m=128, tile_n=128, stages_qdo=1, dq_cols=32, dq_stages=1,
                        regs_compute=160, regs_reduce=64, regs_other=120)
    if head_dim <= 128:
        # The MMA warp keeps 8 K-steps of 64-bit SMEM descriptors per GEMM live.
        return BwdTiles(tile_m=128, tile_n=128, stages_qdo=1, dq_cols=32, dq_stages=2,
                        regs_compute=160, regs_reduce=64, regs_other=120)
    if head_dim == 192 and head_dim_v in (None, 192):  # None: head_dim_v = head_dim
        # The wide arrangement (Note [Wide sm100 backward]): K, V, Q, dO 48 KiB each
        # and P^T / dS^T 32 KiB leave no room for a dQ staging tile.
        return BwdTiles(tile_m=128, tile_n=128, stages_qdo=1, dq_cols=32, dq_stages=1,
                        regs_compute=160, regs_reduce=72, regs_other=120, wide=True,
                        dq_direct=True)
    if head_dim == 192:
        # (192, 128): hdim 128's row, in the wide arrangement (Note [Wide sm100
        # backward]): K 48 KiB, V 32, Q 48, dO 32, P^T / dS^T 32 and two dQ staging
        # tiles of 16 KiB: 224 KiB.
        return BwdTiles(tile_m=128, tile_n=128, stages_qdo=1, dq_cols=32, dq_stages=2,
                        regs_compute=160, regs_reduce=64, regs_other=120, wide=True)
    if head_dim == 256:
        # Two CTAs per key block, 64-query blocks (Note [Head-dim halves]). The reduce
        # warps take 80 registers: masked, 64 spilled (dQ^T's 32 columns, the loop).
        return BwdTiles(tile_m=64, tile_n=128, stages_qdo=1, dq_cols=32, dq_stages=1,
                        regs_compute=160, regs_reduce=80, regs_other=112, dq_direct=True,
                        dkv_split=2)
    raise ValueError(f"sm100 backward supports head_dim 64, 96, 128, 192 and 256, got "
                     f"{head_dim}")




def _as_view(t: cute.Tensor, layout, offset=0) -> cute.Tensor:
    """The same SMEM bytes seen through another MMA operand layout (same swizzle),
    from ``offset`` elements on (a head-dim half, Note [Head-dim halves])."""
    ptr = t.iterator if isinstance(offset, int) and offset == 0 else t.iterator + offset
    return cute.make_tensor(cute.recast_ptr(ptr, layout.inner, dtype=t.element_type),
                            layout.outer)


def _rows_cols(t: cute.Tensor, rows: int, cols: int) -> cute.Tensor:
    """View a K-major MMA A operand in SMEM, ((rows, k_atom), 1, cols / k_atom), as a
    plain (rows, cols) tensor: row r, column c of the operand."""
    k_atom = cute.size(t.shape[0][1])
    assert cute.size(t.shape[0][0]) == rows and cute.size(t, mode=[1]) == 1
    flat = cute.make_layout((rows, (k_atom, cols // k_atom)),
                            stride=(1, (rows, rows * k_atom)))
    return cute.composition(t, flat)


@cute.jit
def _umma(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
          accumulate):
    """Issue one tcgen05 GEMM over the whole K extent of the operands (one thread
    issues, the warp calls it uniformly). `accumulate` may be a runtime Boolean."""
    # A fresh atom per call: its ACCUMULATE field is mutated below, and a mutation
    # of the shared tiled MMA inside the runtime loop would escape the loop body.
    atom = cute.make_mma_atom(tiled_mma.op)
    for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
        if const_expr(k == 0):
            atom.set(tcgen05.Field.ACCUMULATE, accumulate)
        else:
            atom.set(tcgen05.Field.ACCUMULATE, True)
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)


class FlashBwdSm100(BwdMainCall):
    """Backward main kernel for sm_100a; see the module docstring and docs/design.md.

    Compiled for sm_100a, not run on hardware.

    Args:
      dtype: cutlass.BFloat16 or cutlass.Float16 (Q, K, V, dO, dK, dV).
      head_dim, head_dim_v: 64, 96, 128, 192 or 256, equal, or DeepSeek's (192, 128).
      causal: top-left causal mask (query i sees key j <= i).
      softmax_scale: scale applied to Q K^T.
      tiles: a row in place of the tile table's (``bwd_tiles``): the deterministic
        kernel's, whose reduce warps take more registers.
      deterministic: add each query block's dQ partials in a fixed key-block order
        (``FlashBwdSm100Deterministic``, which takes the semaphores).
      masked: the call takes each key's interval of seeing queries (rules/ranges.py),
        which carries every mask (causal must then be False); segments: and the
        segment ids, compared where a document is not contiguous; then the key
        blocks' walks (Note [Block walks] in rules/ranges.py).
      softcap: c > 0 caps each scaled logit s to c * tanh(s / c) (Note [Softcap in the
        kernels] in softmax.py); None for none.
    """

    # Masked, the key blocks' walks come from the lowering.
    takes_walks = True

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        head_dim_v: int | None = None,
        causal: bool = False,
        softmax_scale: float | None = None,
        tiles: BwdTiles | None = None,
        deterministic: bool = False,
        masked: bool = False,
        segments: bool = False,
        softcap: float | None = None,
    ):
        self.deterministic = deterministic
        init_bwd_kernel(self, "sm100 backward", dtype, head_dim, head_dim_v,
                        (64, 96, 128, 192, (192, 128), 256), causal, softmax_scale,
                        softcap)
        set_mask_flags(self, causal, masked, segments)
        self.tiles = bwd_tiles(head_dim, causal, self.head_dim_v) if tiles is None else tiles
        t = self.tiles
        self.tile_m, self.tile_n = t.tile_m, t.tile_n
        # One TMEM lane per key / per query row, two compute warpgroups split the
        # tile_m columns of S^T and dP^T, and the dK/dV columns in the epilogue.
        # Head-dim halves: 64-query blocks, dQ^T's columns are queries.
        self.split = t.dkv_split
        self.dq_t = self.split > 1
        assert self.tile_n == 128 and self.tile_m == (64 if self.dq_t else 128)
        assert not self.dq_t or (t.dq_direct and not t.wide and t.stages_qdo == 1)
        assert head_dim % t.dq_cols == 0 and (head_dim // t.dq_cols) % t.dq_stages == 0
        assert (head_dim // 2) % 16 == 0
        assert 2 * t.regs_compute + t.regs_reduce + t.regs_other <= 512
        self.num_threads = 32 * _NUM_WARPS

        # TMEM map (fp32 columns): S^T, dP^T, dV, dK and dQ. At hdim 128 they need
        # 640 columns, so dQ shares dP^T's: dQ is issued only after the compute
        # warps have read dP^T (the ds pipeline), and the next dP^T only after the
        # reduce warps have read dQ (the dq pipeline). Wide (Note [Wide sm100
        # backward]): dV, dK, then S^T and dP^T in the same columns, and dQ from
        # there to the end.
        d, dv = head_dim, head_dim_v
        # The head-dim columns of dK / dV (and dQ) this CTA owns.
        self.d_part, self.dv_part = d // self.split, dv // self.split
        self.wide = t.wide
        if self.wide:
            self.tmem_dv = 0
            self.tmem_dk = self.tmem_dv + dv
            self.tmem_s = self.tmem_dp = self.tmem_dq = self.tmem_dk + d
            self.dq_aliases_dp = False
        else:
            self.tmem_s = 0
            self.tmem_dp = self.tmem_s + self.tile_m
            self.tmem_dv = self.tmem_dp + self.tile_m
            self.tmem_dk = self.tmem_dv + self.dv_part
            dq_width = self.tile_m if self.dq_t else d  # dQ^T: one column per query
            self.dq_aliases_dp = self.tmem_dk + self.d_part + dq_width > _TMEM_COLS
            self.tmem_dq = (self.tmem_dp if self.dq_aliases_dp
                            else self.tmem_dk + self.d_part)
        # dQ in passes of whole 64-column atoms of K^T (Note [Wide sm100 backward]):
        # one, unless the columns from tmem_dq on do not hold d.
        room = (_TMEM_COLS - self.tmem_dq) // 64 * 64
        self.dq_passes = tuple((c, min(room, d - c)) for c in range(0, d, room))
        if self.dq_t:
            self.dq_passes = ((0, self.d_part),)
        assert len(self.dq_passes) == 1 or t.dq_direct
        assert max(self.tmem_dk + self.d_part, self.tmem_s + self.tile_m) <= _TMEM_COLS
        assert self.tmem_dq + (self.tile_m if self.dq_t else self.dq_passes[0][1]) \
            <= _TMEM_COLS
        log.debug("FlashBwdSm100 %s d=%d causal=%s tiles=%s", dtype, head_dim, causal, t)

    # ------------------------------------------------------------------ host side
    def _tiled_mmas(self):
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        one = tcgen05.CtaGroup.ONE
        dt, tm, tn = self.dtype, self.tile_m, self.tile_n
        d, dv = self.head_dim, self.head_dim_v
        dp, dvp = self.d_part, self.dv_part  # d, dv but with head-dim halves
        # S^T = K Q^T: A = K (tn x d), B = Q (tm x d), both K-major.
        mma_s = sm100_utils.make_trivial_tiled_mma(dt, dt, K, K, Float32, one, (tn, tm))
        # dP^T = V dO^T: A = V (tn x dv), B = dO (tm x dv).
        mma_dp = sm100_utils.make_trivial_tiled_mma(dt, dt, K, K, Float32, one, (tn, tm))
        # dV += P^T dO: A = P^T (tn x tm) K-major, B = dO as (dv x tm), MN-major.
        mma_dv = sm100_utils.make_trivial_tiled_mma(dt, dt, K, MN, Float32, one, (tn, dvp))
        # dK += dS^T Q: A = dS^T (tn x tm) K-major, B = Q as (d x tm), MN-major.
        mma_dk = sm100_utils.make_trivial_tiled_mma(dt, dt, K, MN, Float32, one, (tn, dp))
        # dQ = dS K: A = dS (tm x tn) MN-major (the dS^T tile), B = K as (d x tn), MN-major.
        # Head-dim halves, dQ^T = K^T dS^T: A = K^T (dp x tn), B = dS (tm x tn), both
        # MN-major (Note [Head-dim halves]).
        mma_dq = self._dq_mma(dp if self.dq_t else d)
        tilers = {
            "s": (tn, tm, d), "dp": (tn, tm, dv), "dv": (tn, dvp, tm),
            "dk": (tn, dp, tm), "dq": (dp, tm, tn) if self.dq_t else (tm, d, tn),
        }
        return (mma_s, mma_dp, mma_dv, mma_dk, mma_dq), tilers

    @cute.jit
    def launch(self, stream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
               mdO: cute.Tensor, mLSElog2: cute.Tensor, mDpsum: cute.Tensor,
               mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
               mdQsem: cute.Tensor | None = None, *masks: cute.Tensor):
        """The host side of ``BwdMainCall.__call__``; mdQsem: (B, Hq, ceil(Sq / tile_m)
        x split) int32, zero at launch, with the deterministic backward, else None; masks:
        with ``masked``, the keys' query intervals (and the segment ids), and the
        key blocks' walks."""
        masks = tuple(masks) + (None,) * (4 - len(masks))
        if const_expr(self.deterministic and mdQsem is None):
            raise TypeError("the deterministic backward takes the dQ semaphores: call "
                            "FlashBwdSm100Deterministic")
        check_bwd_operand_dtypes(self, mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV)
        dt = self.dtype
        tm, tn = self.tile_m, self.tile_n
        st = self.tiles.stages_qdo
        dq_cols, dq_stages = self.tiles.dq_cols, self.tiles.dq_stages

        # (S, D, H, B) views: sequence and head dim first, as the TMA tiles see them.
        mQ, mK, mV, mdO, mdK, mdV = [permute(t, [1, 3, 2, 0])
                                     for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mdQaccum = permute(mdQaccum, [2, 3, 1, 0])  # (Sq_pad, D, Hq, B)

        (mma_s, mma_dp, mma_dv, mma_dk, mma_dq), tl = self._tiled_mmas()

        # SMEM operand layouts. Each buffer is written once (TMA or the compute
        # warps) and read by two MMAs in different majorness: the K-major and
        # MN-major 128B-swizzled layouts of the same tile put every element at the
        # same byte, so the second reader gets a re-typed view of the same bytes.
        sK_layout = cute.slice_(sm100_utils.make_smem_layout_a(mma_s, tl["s"], dt, 1),
                                (None, None, None, 0))
        # dQ's K^T and dS: its B and A, or with head-dim halves its A and B.
        kt_side, ds_side = sm100_utils.make_smem_layout_b, sm100_utils.make_smem_layout_a
        if const_expr(self.dq_t):
            kt_side, ds_side = ds_side, kt_side
        sKt_layout = cute.slice_(kt_side(mma_dq, tl["dq"], dt, 1), (None, None, None, 0))
        sV_layout = cute.slice_(sm100_utils.make_smem_layout_a(mma_dp, tl["dp"], dt, 1),
                                (None, None, None, 0))
        sQ_layout = sm100_utils.make_smem_layout_b(mma_s, tl["s"], dt, st)
        sQt_layout = sm100_utils.make_smem_layout_b(mma_dk, tl["dk"], dt, st)
        sdO_layout = sm100_utils.make_smem_layout_b(mma_dp, tl["dp"], dt, st)
        sdOt_layout = sm100_utils.make_smem_layout_b(mma_dv, tl["dv"], dt, st)
        sPt_layout = cute.slice_(sm100_utils.make_smem_layout_a(mma_dv, tl["dv"], dt, 1),
                                 (None, None, None, 0))
        sdSt_layout = cute.slice_(sm100_utils.make_smem_layout_a(mma_dk, tl["dk"], dt, 1),
                                  (None, None, None, 0))
        sdS_layout = cute.slice_(ds_side(mma_dq, tl["dq"], dt, 1), (None, None, None, 0))
        # dQ staging: (tm, dq_cols) fp32 row-major tiles, 128B swizzle for the TMA.
        dq_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, Float32,
                                            dq_cols), Float32)
        sdQ_layout = cute.tile_to_shape(dq_atom, (tm, dq_cols, dq_stages), order=(0, 1, 2))

        tma_load = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tma_K, gmem_K = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load, mK, sK_layout, tl["s"], mma_s)
        tma_Q, gmem_Q = cute.nvgpu.make_tiled_tma_atom_B(
            tma_load, mQ, cute.select(sQ_layout, mode=[0, 1, 2]), tl["s"], mma_s)
        tma_V, gmem_V = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load, mV, sV_layout, tl["dp"], mma_dp)
        tma_dO, gmem_dO = cute.nvgpu.make_tiled_tma_atom_B(
            tma_load, mdO, cute.select(sdO_layout, mode=[0, 1, 2]), tl["dp"], mma_dp)
        tma_dQ, gmem_dQ = None, mdQaccum  # dq_direct: red.global.add from registers
        if const_expr(not self.tiles.dq_direct):
            tma_dQ, gmem_dQ = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), mdQaccum,
                cute.select(sdQ_layout, mode=[0, 1]), (tm, dq_cols))

        # Wide: dS^T is written into P^T's tile (Note [Wide sm100 backward]), which
        # needs the two operand layouts to be one.
        assert not self.wide or str(sdSt_layout) == str(sPt_layout)
        bytes_qdo = (cute.size_in_bytes(dt, cute.select(sQ_layout, mode=[0, 1, 2]))
                     + cute.size_in_bytes(dt, cute.select(sdO_layout, mode=[0, 1, 2])))
        bytes_kv = cute.size_in_bytes(dt, sK_layout) + cute.size_in_bytes(dt, sV_layout)

        mr, al = cute.struct.MemRange, cute.struct.Align
        fields = {f"mbar_{n}": mr[cutlass.Int64, 2] for n in ("kv", "qdo", "lse", "s", "dp",
                                                              "p", "ds", "dq", "dkv")}
        fields["mbar_qdo"] = fields["mbar_lse"] = mr[cutlass.Int64, 2 * st]
        fields["tmem_addr"] = Int32
        fields["sLSE"] = fields["sDpsum"] = al[mr[Float32, tm * st], 16]
        for name, layout in (("sK", sK_layout), ("sV", sV_layout), ("sQ", sQ_layout),
                             ("sdO", sdO_layout), ("sP", sPt_layout), ("sdS", sdSt_layout)):
            fields[name] = al[mr[dt, cute.cosize(layout)], 1024]
        if const_expr(self.wide):
            del fields["sdS"]  # dS^T goes into sP
        if const_expr(not self.tiles.dq_direct):
            fields["sdQ"] = al[mr[Float32, cute.cosize(sdQ_layout)], 1024]
        SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

        if const_expr(SharedStorage.size_in_bytes() > _SMEM_BYTES):
            raise ValueError(f"sm100 backward needs {SharedStorage.size_in_bytes()} bytes of "
                             f"shared memory, more than {_SMEM_BYTES}: fewer stages")
        num_n_blocks = cute.ceil_div(mK.shape[0], tn)
        # Head-dim halves: the CTAs of a key block are adjacent (Note [Head-dim halves]).
        grid = (num_n_blocks * self.split, cute.size(mK.shape[2]), cute.size(mK.shape[3]))
        self.kernel(
            gmem_Q, gmem_K, gmem_V, gmem_dO, gmem_dQ, mdQsem, mLSElog2, mDpsum, mdK, mdV,
            masks[0], masks[1], masks[2], masks[3], tma_Q, tma_K, tma_V, tma_dO, tma_dQ,
            sQ_layout, sQt_layout, sdO_layout, sdOt_layout, sK_layout, sKt_layout,
            sV_layout, sPt_layout, sdSt_layout, sdS_layout, sdQ_layout,
            mma_s, mma_dp, mma_dv, mma_dk, mma_dq, bytes_qdo, bytes_kv, SharedStorage,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA view (Sq, D, Hq, B)
        mK: cute.Tensor,  # TMA view (Sk, D, Hkv, B)
        mV: cute.Tensor,  # TMA view (Sk, Dv, Hkv, B)
        mdO: cute.Tensor,  # TMA view (Sq, Dv, Hq, B)
        mdQaccum: cute.Tensor,  # TMA view (Sq_pad, D, Hq, B) f32
        mdQsem: cute.Tensor | None,  # (B, Hq, num_m x split) int32 (deterministic only)
        mLSElog2: cute.Tensor,  # (B, Hq, Sq) f32
        mDpsum: cute.Tensor,  # (B, Hq, Sq) f32
        mdK: cute.Tensor,  # (Sk, D, Hkv, B)
        mdV: cute.Tensor,  # (Sk, Dv, Hkv, B)
        mRanges: cute.Tensor | None,  # (B, Sk, 2) int32 query intervals (masked only)
        mQSeg: cute.Tensor | None,  # (B, Sq) int32 (segments only)
        mKSeg: cute.Tensor | None,  # (B, Sk) int32 (segments only)
        mWalks: cute.Tensor | None,  # (B, num_n, 5) int32 key-block walks (masked only)
        tma_Q: cute.CopyAtom,
        tma_K: cute.CopyAtom,
        tma_V: cute.CopyAtom,
        tma_dO: cute.CopyAtom,
        tma_dQ: cute.CopyAtom,
        sQ_layout: cute.ComposedLayout,
        sQt_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sdOt_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sKt_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sPt_layout: cute.ComposedLayout,
        sdSt_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.ComposedLayout,
        mma_s: cute.TiledMma,
        mma_dp: cute.TiledMma,
        mma_dv: cute.TiledMma,
        mma_dk: cute.TiledMma,
        mma_dq: cute.TiledMma,
        bytes_qdo: cutlass.Constexpr[int],
        bytes_kv: cutlass.Constexpr[int],
        SharedStorage: cutlass.Constexpr,
    ):
        tm, tn = self.tile_m, self.tile_n
        st = self.tiles.stages_qdo
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head_kv, batch = cute.arch.block_idx()
        part = 0  # the head-dim columns this CTA owns (Note [Head-dim halves])
        if const_expr(self.dq_t):
            part = n_block % self.split
            n_block = n_block // self.split
        num_n_blocks = cute.ceil_div(mK.shape[0], tn)
        if const_expr(self.deterministic):
            # Causal or masked, key blocks launch last first (det_key_block,
            # det_add_rank, Note [Masked dQ order]).
            n_block = det_key_block(n_block, num_n_blocks, self.causal or self.masked)

        if warp_idx == _LOAD_WARP:
            for atom in (tma_Q, tma_K, tma_V, tma_dO, tma_dQ):
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)

        def group(n: int):
            return pipeline.CooperativeGroup(pipeline.Agent.Thread, n)

        n_compute = 32 * 8
        n_reduce = 32 * 4
        pipe_kv = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1,
            producer_group=group(1), consumer_group=group(1), tx_count=bytes_kv,
            defer_sync=True)
        pipe_qdo = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.mbar_qdo.data_ptr(), num_stages=st,
            producer_group=group(1), consumer_group=group(1), tx_count=bytes_qdo,
            defer_sync=True)
        # LSElog2 / Dpsum rows: every load-warp lane stores then arrives.
        pipe_lse = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar_lse.data_ptr(), num_stages=st,
            producer_group=group(32), consumer_group=group(n_compute), defer_sync=True)
        pipe_s = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.mbar_s.data_ptr(), num_stages=1,
            producer_group=group(1), consumer_group=group(n_compute), defer_sync=True)
        pipe_dp = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.mbar_dp.data_ptr(), num_stages=1,
            producer_group=group(1), consumer_group=group(n_compute), defer_sync=True)
        pipe_p = pipeline.PipelineAsyncUmma.create(
            barrier_storage=storage.mbar_p.data_ptr(), num_stages=1,
            producer_group=group(n_compute), consumer_group=group(1), defer_sync=True)
        pipe_ds = pipeline.PipelineAsyncUmma.create(
            barrier_storage=storage.mbar_ds.data_ptr(), num_stages=1,
            producer_group=group(n_compute), consumer_group=group(1), defer_sync=True)
        pipe_dq = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.mbar_dq.data_ptr(), num_stages=1,
            producer_group=group(1), consumer_group=group(n_reduce), defer_sync=True)
        # Last one: initialises its barriers and syncs the CTA so every mbarrier
        # above is visible before any role starts.
        pipe_dkv = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.mbar_dkv.data_ptr(), num_stages=1,
            producer_group=group(1), consumer_group=group(n_compute), defer_sync=False)

        tmem_bar = pipeline.NamedBarrier(barrier_id=_BAR_TMEM,
                                         num_threads=32 + n_compute + n_reduce)
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_addr.ptr, barrier_for_retrieve=tmem_bar,
            allocator_warp_id=_MMA_WARP)

        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sPt = storage.sP.get_tensor(sPt_layout.outer, swizzle=sPt_layout.inner)
        sdSt = (storage.sP if const_expr(self.wide) else storage.sdS).get_tensor(
            sdSt_layout.outer, swizzle=sdSt_layout.inner)
        sdQ = None
        if const_expr(not self.tiles.dq_direct):
            sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
        sLSE = storage.sLSE.get_tensor(cute.make_layout((tm, st)))
        sDpsum = storage.sDpsum.get_tensor(cute.make_layout((tm, st)))

        # The work list of this CTA: every (q head of the group, query block) pair
        # that can see at least one of its keys.
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        group_size = mQ.shape[2] // mK.shape[2]
        m_block_max = cute.ceil_div(seqlen_q, tm)
        m_block_min = Int32(0)
        masks = None
        if const_expr(self.masked):
            # The block's walk from the lowering (Note [Block walks] in
            # rules/ranges.py), which the deterministic dQ ranks count too (Note
            # [Masked dQ order]).
            walk = [cute.arch.make_warp_uniform(mWalks[batch, n_block, i]) for i in range(4)]
            m_block_min, m_block_max = walk[0], walk[1]
            masks = (mRanges, mQSeg, mKSeg, walk[2], walk[3], seqlen_q)
        elif const_expr(self.causal):
            m_block_min = cutlass.min(n_block * tn // tm, m_block_max)
        num_m = m_block_max - m_block_min
        num_iters = num_m * group_size

        if warp_idx >= _MMA_WARP:
            cute.arch.setmaxregister_decrease(self.tiles.regs_other)
            if warp_idx == _LOAD_WARP:
                self.load(mQ, mK, mV, mdO, mLSElog2, mDpsum, sQ, sK, sV, sdO, sLSE, sDpsum,
                          tma_Q, tma_K, tma_V, tma_dO, mma_s, mma_dp,
                          pipe_kv, pipe_qdo, pipe_lse, n_block, head_kv, batch, group_size,
                          seqlen_q, m_block_min, num_m, num_iters)
            if warp_idx == _MMA_WARP:
                tmem.allocate(_TMEM_COLS)
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                # Head-dim halves: Q^T, dO^T and K^T of this CTA's columns, whole
                # 64-column atoms of the K-major tiles (Note [Head-dim halves]).
                sQt, sdOt, sKt = (
                    _as_view(sQ, sQt_layout, part * (self.d_part * tm)),
                    _as_view(sdO, sdOt_layout, part * (self.dv_part * tm)),
                    _as_view(sK, sKt_layout, part * (self.d_part * tn)))
                sdS = _as_view(sdSt, sdS_layout)
                self.mma(mma_s, mma_dp, mma_dv, mma_dk, mma_dq, sQ, sQt, sK, sKt, sV, sdO,
                         sdOt, sPt, sdSt, sdS, tmem_ptr, pipe_kv, pipe_qdo, pipe_s, pipe_dp,
                         pipe_p, pipe_ds, pipe_dq, pipe_dkv, num_iters)
                # Every TMEM reader has arrived on tmem_bar once it is done.
                tmem.relinquish_alloc_permit()
                tmem_bar.arrive_and_wait()
                tmem.free(tmem_ptr)
        elif warp_idx >= _COMPUTE_WARP0:
            cute.arch.setmaxregister_increase(self.tiles.regs_compute)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.compute(mma_s, mma_dp, mma_dv, mma_dk, mdK, mdV, sPt, sdSt, sLSE, sDpsum,
                         tmem_ptr, pipe_lse, pipe_s, pipe_dp, pipe_p, pipe_ds, pipe_dkv,
                         tidx - 32 * _COMPUTE_WARP0, n_block, part, head_kv, batch,
                         seqlen_k, m_block_min, num_m, num_iters, masks)
            tmem_bar.arrive()
        else:
            cute.arch.setmaxregister_decrease(self.tiles.regs_reduce)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            order = (mdQsem, mWalks, n_block, num_n_blocks, part)
            if const_expr(self.dq_t):
                self.reduce_dq_t(mdQaccum, tmem_ptr, pipe_dq, tidx, part, head_kv, batch,
                                 group_size, m_block_min, num_m, num_iters, order)
            elif const_expr(self.tiles.dq_direct):
                self.reduce_dq_direct(mdQaccum, tmem_ptr, pipe_dq, tidx, head_kv, batch,
                                      group_size, m_block_min, num_m, num_iters, order)
            else:
                self.reduce_dq(mma_dq, mdQaccum, mdQsem, sdQ, tma_dQ, tmem_ptr, pipe_dq,
                               tidx, n_block, num_n_blocks, head_kv, batch, group_size,
                               m_block_min, num_m, num_iters, mWalks)
            tmem_bar.arrive()

    # ------------------------------------------------------------------ load warp
    @cute.jit
    def load(self, mQ, mK, mV, mdO, mLSElog2, mDpsum, sQ, sK, sV, sdO, sLSE, sDpsum,
             tma_Q, tma_K, tma_V, tma_dO, mma_s, mma_dp, pipe_kv, pipe_qdo, pipe_lse,
             n_block, head_kv, batch, group_size, seqlen_q, m_block_min, num_m, num_iters):
        """Warp 13: K and V of this block once, then per work item Q, dO (TMA) and
        the LSElog2 / Dpsum rows (plain loads: their rows are not 16-byte aligned
        for odd seqlen_q, which TMA would need)."""
        tm, tn = self.tile_m, self.tile_n
        d, dv = self.head_dim, self.head_dim_v
        lane = cute.arch.lane_idx()
        thr_s = mma_s.get_slice(0)
        thr_dp = mma_dp.get_slice(0)
        gK = cute.local_tile(mK[None, None, head_kv, batch], (tn, d), (n_block, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (tn, dv), (n_block, 0))
        tKsK, tKgK = tma_tile_partition(tma_K, sK, thr_s.partition_A(gK), rank=3)
        tVsV, tVgV = tma_tile_partition(tma_V, sV, thr_dp.partition_A(gV), rank=3)
        if num_iters > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipe_kv.producer_acquire(kv_state)
            bar = pipe_kv.producer_get_barrier(kv_state)
            cute.copy(tma_K, tKgK, tKsK, tma_bar_ptr=bar)
            cute.copy(tma_V, tVgV, tVsV, tma_bar_ptr=bar)

        st = self.tiles.stages_qdo
        qdo_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, st)
        lse_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, st)
        for it in cutlass.range(num_iters, unroll=1):
            head_q, m_block = self._work_item(it, head_kv, group_size, m_block_min, num_m)
            gQ = cute.local_tile(mQ[None, None, head_q, batch], (tm, d), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head_q, batch], (tm, dv), (None, 0))
            tQsQ, tQgQ = tma_tile_partition(tma_Q, sQ, thr_s.partition_B(gQ), rank=3)
            tdOsdO, tdOgdO = tma_tile_partition(tma_dO, sdO, thr_dp.partition_B(gdO), rank=3)
            pipe_qdo.producer_acquire(qdo_state)
            bar = pipe_qdo.producer_get_barrier(qdo_state)
            cute.copy(tma_Q, tQgQ[None, m_block], tQsQ[None, qdo_state.index], tma_bar_ptr=bar)
            cute.copy(tma_dO, tdOgdO[None, m_block], tdOsdO[None, qdo_state.index],
                      tma_bar_ptr=bar)
            qdo_state.advance()

            # sLSE holds -LSElog2 (the FMA addend of P's exponent); rows past
            # seqlen_q get -inf, which makes P (and dS) exactly zero there.
            pipe_lse.producer_acquire(lse_state)
            for j in cutlass.range_constexpr(tm // 32):
                r = j * 32 + lane
                row = m_block * tm + r
                neg_lse = -Float32.inf
                dpsum = Float32(0.0)
                if row < seqlen_q:
                    neg_lse = -mLSElog2[batch, head_q, row]
                    dpsum = mDpsum[batch, head_q, row]
                sLSE[r, lse_state.index] = neg_lse
                sDpsum[r, lse_state.index] = dpsum
            pipe_lse.producer_commit(lse_state)
            lse_state.advance()

    # ------------------------------------------------------------------- MMA warp
    @cute.jit
    def mma(self, mma_s, mma_dp, mma_dv, mma_dk, mma_dq, sQ, sQt, sK, sKt, sV, sdO, sdOt,
            sPt, sdSt, sdS, tmem_ptr, pipe_kv, pipe_qdo, pipe_s, pipe_dp, pipe_p, pipe_ds,
            pipe_dq, pipe_dkv, num_iters):
        """Warp 12: every tcgen05.mma of the walk, in an order that lets the compute
        warps work on P while dP^T runs and on dS while dV runs."""
        tm, tn = self.tile_m, self.tile_n
        d = self.head_dim
        tSrK = mma_s.make_fragment_A(sK)
        tSrQ = mma_s.make_fragment_B(sQ)
        tdPrV = mma_dp.make_fragment_A(sV)
        tdPrdO = mma_dp.make_fragment_B(sdO)
        tdVrP = mma_dv.make_fragment_A(sPt)
        tdVrdO = mma_dv.make_fragment_B(sdOt)
        tdKrdS = mma_dk.make_fragment_A(sdSt)
        tdKrQ = mma_dk.make_fragment_B(sQt)
        # dQ's operands, (dS, K^T), or with head-dim halves dQ^T's (K^T, dS).
        dq_a, dq_b, dq_shape = sdS, sKt, (tm, d)
        if const_expr(self.dq_t):
            dq_a, dq_b, dq_shape = sKt, sdS, (self.d_part, tm)
        tdQrA = mma_dq.make_fragment_A(dq_a)
        tdQrB = mma_dq.make_fragment_B(dq_b)
        dq_passes = []
        if const_expr(len(self.dq_passes) > 1):
            for c0, w in self.dq_passes:
                mma_p, sdS_p, sKt_p = self._dq_pass_views(sdS, sK, c0, w)
                dq_passes.append((mma_p, self._tmem_acc(mma_p, tmem_ptr, self.tmem_dq, (tm, w)),
                                  mma_p.make_fragment_A(sdS_p), mma_p.make_fragment_B(sKt_p)))
        tS = self._tmem_acc(mma_s, tmem_ptr, self.tmem_s, (tn, tm))
        tdP = self._tmem_acc(mma_dp, tmem_ptr, self.tmem_dp, (tn, tm))
        tdV = self._tmem_acc(mma_dv, tmem_ptr, self.tmem_dv, (tn, self.dv_part))
        tdK = self._tmem_acc(mma_dk, tmem_ptr, self.tmem_dk, (tn, self.d_part))
        tdQ = self._tmem_acc(mma_dq, tmem_ptr, self.tmem_dq, dq_shape)

        Consumer = pipeline.PipelineUserType.Consumer
        Producer = pipeline.PipelineUserType.Producer
        qdo_state = pipeline.make_pipeline_state(Consumer, self.tiles.stages_qdo)
        s_state = pipeline.make_pipeline_state(Producer, 1)
        dp_state = pipeline.make_pipeline_state(Producer, 1)
        dq_state = pipeline.make_pipeline_state(Producer, 1)
        p_state = pipeline.make_pipeline_state(Consumer, 1)
        ds_state = pipeline.make_pipeline_state(Consumer, 1)
        # With two Q/dO stages, S^T of the next item is issued before dK / dQ of
        # this one, so it runs while the compute warps work on dS and the compute
        # warps find it ready. qdo_next is the item whose S^T is issued next;
        # qdo_state the item whose remaining GEMMs run. (With one stage the next
        # Q cannot arrive before this item's dK has released the stage.)
        lookahead = self.tiles.stages_qdo >= 2
        assert not (lookahead and self.wide)  # the next S^T would overwrite dQ
        qdo_next = pipeline.make_pipeline_state(Consumer, self.tiles.stages_qdo)
        if num_iters > 0:
            pipe_kv.consumer_wait(pipeline.make_pipeline_state(Consumer, 1))
        if const_expr(lookahead):
            if num_iters > 0:
                pipe_qdo.consumer_wait(qdo_next)
                pipe_s.producer_acquire(s_state)
                _umma(mma_s, tS, tSrK, tSrQ[None, None, None, qdo_next.index], False)
                pipe_s.producer_commit(s_state)
            # Advanced unconditionally: a state advanced past the last item is never used.
            qdo_next.advance()
            s_state.advance()

        for it in cutlass.range(num_iters, unroll=1):
            accumulate = it > 0
            if const_expr(not lookahead):
                pipe_qdo.consumer_wait(qdo_state)
                # S^T: the compute warps have read the previous S^T (s released);
                # wide, the reduce warps the previous dQ, in the same columns.
                pipe_s.producer_acquire(s_state)
                if const_expr(self.wide):
                    pipe_dq.producer_acquire(dq_state)
                _umma(mma_s, tS, tSrK, tSrQ[None, None, None, qdo_state.index], False)
                pipe_s.producer_commit(s_state)
                s_state.advance()
            stage = qdo_state.index
            # dP^T: previous dP^T read (dp released) and, when dQ shares its
            # columns, the previous dQ read by the reduce warps; wide, this S^T read
            # by the compute warps (dP^T takes its columns).
            if const_expr(self.wide):
                pipe_s.producer_acquire(s_state)
            pipe_dp.producer_acquire(dp_state)
            if const_expr(self.dq_aliases_dp):
                pipe_dq.producer_acquire(dq_state)
            _umma(mma_dp, tdP, tdPrV, tdPrdO[None, None, None, stage], False)
            pipe_dp.producer_commit(dp_state)
            dp_state.advance()
            # dV += P^T dO once P^T is in SMEM; releasing p (a tcgen05.commit)
            # tells the compute warps when sP may be overwritten.
            pipe_p.consumer_wait(p_state)
            _umma(mma_dv, tdV, tdVrP, tdVrdO[None, None, None, stage], accumulate)
            pipe_p.consumer_release(p_state)
            p_state.advance()
            if const_expr(lookahead):
                # The compute warps released S^T before they wrote P (waited above).
                if it + 1 < num_iters:
                    pipe_qdo.consumer_wait(qdo_next)
                    pipe_s.producer_acquire(s_state)
                    _umma(mma_s, tS, tSrK, tSrQ[None, None, None, qdo_next.index], False)
                    pipe_s.producer_commit(s_state)
                qdo_next.advance()
                s_state.advance()
            # dK += dS^T Q and dQ = dS K once dS is in SMEM.
            pipe_ds.consumer_wait(ds_state)
            _umma(mma_dk, tdK, tdKrdS, tdKrQ[None, None, None, stage], accumulate)
            if const_expr(not (self.dq_aliases_dp or self.wide)):
                pipe_dq.producer_acquire(dq_state)
            if const_expr(len(self.dq_passes) == 1):
                _umma(mma_dq, tdQ, tdQrA, tdQrB, False)
                pipe_dq.producer_commit(dq_state)
                dq_state.advance()
            else:
                # dQ's column passes into the same TMEM columns, each once the reduce
                # warps have read the one before (the first acquired before S^T).
                for p, (mma_p, tdQ_p, tdQrdS_p, tdQrK_p) in enumerate(dq_passes):
                    if const_expr(p > 0):
                        pipe_dq.producer_acquire(dq_state)
                    _umma(mma_p, tdQ_p, tdQrdS_p, tdQrK_p, False)
                    pipe_dq.producer_commit(dq_state)
                    dq_state.advance()
            pipe_ds.consumer_release(ds_state)
            ds_state.advance()
            pipe_qdo.consumer_release(qdo_state)
            qdo_state.advance()
        if num_iters > 0:
            pipe_dkv.producer_commit(pipeline.make_pipeline_state(Producer, 1))

    @staticmethod
    def _work_item(it, head_kv, group_size, m_block_min, num_m):
        """(query head, query block) of work item ``it``: every query block of the
        walk for one query head of the GQA group, then the next head."""
        h_off = it // num_m
        m_block = m_block_min + it - h_off * num_m
        return head_kv * group_size + h_off, m_block

    @cute.jit
    def _tmem_acc(self, tiled_mma, tmem_ptr, col: cutlass.Constexpr[int], shape_mn):
        """The fp32 accumulator of `tiled_mma` at TMEM column `col`."""
        thr = tiled_mma.get_slice(0)
        frag = thr.make_fragment_C(thr.partition_shape_C(shape_mn))
        return cute.make_tensor(tmem_ptr + col, frag.layout)

    # -------------------------------------------------------------- compute warps
    @cute.jit
    def compute(self, mma_s, mma_dp, mma_dv, mma_dk, mdK, mdV, sPt, sdSt, sLSE, sDpsum,
                tmem_ptr, pipe_lse, pipe_s, pipe_dp, pipe_p, pipe_ds, pipe_dkv, tidx,
                n_block, part, head_kv, batch, seqlen_k, m_block_min, num_m, num_iters,
                masks=None):
        """Warps 4-11: P and dS per work item, then the dK / dV epilogue.

        Thread t owns TMEM lane t % 128, i.e. key row n = t % 128 of S^T and dP^T,
        and warpgroup g = t // 128 owns query columns [g tm / 2, (g + 1) tm / 2); part:
        the CTA's head-dim columns of dK and dV (Note [Head-dim halves]). masks: with
        ``masked``, (query intervals, segment ids, the block's full query blocks,
        seqlen_q)."""
        tm, tn = self.tile_m, self.tile_n
        half = tm // 2
        wg = cute.arch.make_warp_uniform(tidx // 128)
        scale_log2 = self.scale_log2

        tS = self._tmem_acc(mma_s, tmem_ptr, self.tmem_s, (tn, tm))
        tdP = self._tmem_acc(mma_dp, tmem_ptr, self.tmem_dp, (tn, tm))
        # This warpgroup's (tn, tm / 2) column half of S^T, dP^T and of their coordinates.
        tS_h = cute.local_tile(tS[(None, None), 0, 0], (tn, half), (0, wg))
        tdP_h = cute.local_tile(tdP[(None, None), 0, 0], (tn, half), (0, wg))
        c_h = cute.local_tile(cute.make_identity_tensor((tn, tm)), (tn, half), (0, wg))
        ld_atom = cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(half)), Float32)
        t2r = tcgen05.make_tmem_copy(ld_atom, tS_h).get_slice(tidx % 128)
        tS_t2r = t2r.partition_S(tS_h)
        tc = t2r.partition_D(c_h)
        # dP^T is read 32 columns at a time so that only P (fp32) and one chunk of
        # dP^T are live at once.
        dp_cols = 32
        ld_atom_dp = cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(dp_cols)), Float32)
        t2r_dp = tcgen05.make_tmem_copy(
            ld_atom_dp, cute.local_tile(tdP_h, (tn, dp_cols), (0, 0))).get_slice(tidx % 128)
        row_n = tc[0][0]  # this thread's key, local to the block
        n_glob = n_block * tn + row_n
        # masked: the key's query interval [q_lo, q_lo + q_width), read once (a key
        # past the sequence end sees nothing), and its id where its document is not
        # contiguous (else -1 - 2^31: no compare).
        q_lo = q_width = kseg = None
        if const_expr(masks is not None):
            mRanges, mQSeg, mKSeg, full_first, full_end, seqlen_q = masks
            at = cutlass.min(n_glob, seqlen_k - 1)
            hi_raw = mRanges[batch, at, 1]
            q_lo = mRanges[batch, at, 0]
            q_width = cutlass.select_(
                n_glob < seqlen_k,
                cutlass.max(cutlass.select_(hi_raw < 0, ~hi_raw, hi_raw) - q_lo, 0), Int32(0))
            if const_expr(mQSeg is not None):
                kseg = cutlass.select_(hi_raw < 0, mKSeg[batch, at], Int32(-(1 << 31)))
        # Register j of rS / rP is query column tc[j][1] = wg * half + j (32x32b loads
        # return a lane's columns in order), which _store_row and the sLSE / sDpsum
        # indexing below rely on.

        # Row-major (key, query) views of the P^T and dS^T operand tiles.
        sPt_rc = _rows_cols(sPt, tn, tm)
        sdSt_rc = _rows_cols(sdSt, tn, tm)

        Consumer = pipeline.PipelineUserType.Consumer
        Producer = pipeline.PipelineUserType.Producer
        lse_state = pipeline.make_pipeline_state(Consumer, self.tiles.stages_qdo)
        s_state = pipeline.make_pipeline_state(Consumer, 1)
        dp_state = pipeline.make_pipeline_state(Consumer, 1)
        p_state = pipeline.make_pipeline_state(Producer, 1)
        ds_state = pipeline.make_pipeline_state(Producer, 1)

        for it in cutlass.range(num_iters, unroll=1):
            _, m_block = self._work_item(it, 0, 0, m_block_min, num_m)
            # First visible local query column of this key row (relative to this
            # warpgroup's half): keys past seqlen_k see nothing; causal keys see
            # queries m >= n.
            col_start = Int32(0)
            if const_expr(self.causal):
                col_start = n_glob - m_block * tm
            if n_glob >= seqlen_k:
                col_start = Int32(tm)
            col_start = col_start - wg * half
            # masked: this key's interval, relative to this warpgroup's first column.
            lo_j = None
            if const_expr(masks is not None):
                lo_j = q_lo - m_block * tm - wg * half
            pipe_lse.consumer_wait(lse_state)
            sNegLSE_s = cute.local_tile(sLSE[None, lse_state.index], (half,), (wg,))
            sDpsum_s = cute.local_tile(sDpsum[None, lse_state.index], (half,), (wg,))

            pipe_s.consumer_wait(s_state)
            rS = cute.make_rmem_tensor(tc.shape, Float32)
            cute.copy(t2r, tS_t2r, rS)
            cute.arch.fence_view_async_tmem_load()
            pipe_s.consumer_release(s_state)
            s_state.advance()
            rT = None
            if const_expr(self.cap_in is not None):
                # t = tanh(q.k scale / c), kept for dS's 1 - t^2 (Note [Softcap in the
                # kernels]); finite, so a P the masks zero below stays 0 in dS.
                cap_scores(rS, self.cap_in)
                rT = cute.make_fragment_like(rS, Float32)
                rT.store(rS.load())

            # P = exp2(S * scale * log2(e) - LSElog2), two columns per packed FMA.
            rNegLSE = cute.make_rmem_tensor((half,), Float32)
            cute.autovec_copy(sNegLSE_s, rNegLSE)
            for v in cutlass.range_constexpr(half // 2):
                a, b = cute.arch.fma_packed_f32x2(
                    (rS[2 * v], rS[2 * v + 1]), (scale_log2, scale_log2),
                    (rNegLSE[2 * v], rNegLSE[2 * v + 1]))
                rS[2 * v] = cute.math.exp2(a, fastmath=True)
                rS[2 * v + 1] = cute.math.exp2(b, fastmath=True)
            if const_expr(masks is not None):
                # Query blocks not fully inside every key's interval only.
                if BlockRange.masked_block(m_block, full_first, full_end):
                    for j in cutlass.range_constexpr(half):
                        rS[j] = keep_inside(rS[j], Int32(j), lo_j, q_width, zero=True)
                    if const_expr(kseg is not None):
                        if kseg != Int32(-(1 << 31)):
                            for j in cutlass.range_constexpr(half):
                                q = cutlass.min(m_block * tm + wg * half + j, seqlen_q - 1)
                                same = mQSeg[batch, q] == kseg
                                rS[j] = rS[j] if same else Float32(0.0)
            elif col_start > 0:
                # Diagonal or last key block only: a compare and select per element.
                for v in cutlass.range_constexpr(half // 2):
                    for j in (2 * v, 2 * v + 1):
                        rS[j] = rS[j] if j >= col_start else Float32(0.0)
            rP = cute.make_rmem_tensor(tc.shape, self.dtype)
            rP.store(rS.load().to(self.dtype))
            if const_expr(self.cap_in is not None):
                # P (1 - t^2): what dS takes from P under softcap.
                for v in cutlass.range_constexpr(half // 2):
                    t = (rT[2 * v], rT[2 * v + 1])
                    g = cute.arch.fma_packed_f32x2((-t[0], -t[1]), t, (1.0, 1.0))
                    rS[2 * v], rS[2 * v + 1] = cute.arch.mul_packed_f32x2(
                        (rS[2 * v], rS[2 * v + 1]), g)
            # sP is free once the previous dV has read it; wide, once the previous dK
            # and dQ have read the dS^T it shares the tile with.
            pipe_p.producer_acquire(p_state)
            if const_expr(self.wide):
                pipe_ds.producer_acquire(ds_state)
            self._store_row(rP, sPt_rc, row_n, wg, half)
            # Generic-proxy SMEM writes must be visible to the async proxy (tcgen05).
            cute.arch.fence_view_async_shared()
            pipe_p.producer_commit(p_state)
            p_state.advance()

            # dS = P * (dP - Dpsum), 32 columns at a time.
            pipe_dp.consumer_wait(dp_state)
            if const_expr(self.wide):
                # dS^T goes where P^T is, once this dV has read it.
                pipe_p.producer_acquire(p_state)
            else:
                # sdS is free once the previous dK and dQ have read it.
                pipe_ds.producer_acquire(ds_state)
            for c in cutlass.range_constexpr(half // dp_cols):
                tdP_c = cute.local_tile(tdP_h, (tn, dp_cols), (0, c))
                rdP = cute.make_rmem_tensor(
                    t2r_dp.partition_D(cute.local_tile(c_h, (tn, dp_cols), (0, c))).shape,
                    Float32)
                cute.copy(t2r_dp, t2r_dp.partition_S(tdP_c), rdP)
                cute.arch.fence_view_async_tmem_load()
                if const_expr(c == half // dp_cols - 1):
                    pipe_dp.consumer_release(dp_state)
                rDpsum = cute.make_rmem_tensor((dp_cols,), Float32)
                cute.autovec_copy(cute.local_tile(sDpsum_s, (dp_cols,), (c,)), rDpsum)
                for v in cutlass.range_constexpr(dp_cols // 2):
                    j = c * dp_cols + 2 * v
                    d0, d1 = cute.arch.sub_packed_f32x2(
                        (rdP[2 * v], rdP[2 * v + 1]), (rDpsum[2 * v], rDpsum[2 * v + 1]))
                    rdP[2 * v], rdP[2 * v + 1] = cute.arch.mul_packed_f32x2(
                        (rS[j], rS[j + 1]), (d0, d1))
                rdS = cute.make_rmem_tensor(rdP.shape, self.dtype)
                rdS.store(rdP.load().to(self.dtype))
                self._store_row(rdS, sdSt_rc, row_n, wg * (half // dp_cols) + c, dp_cols)
            dp_state.advance()
            pipe_lse.consumer_release(lse_state)
            lse_state.advance()
            cute.arch.fence_view_async_shared()
            pipe_ds.producer_commit(ds_state)
            ds_state.advance()

        if num_iters > 0:
            pipe_dkv.consumer_wait(pipeline.make_pipeline_state(Consumer, 1))
        self.store_dkv(mma_dv, tmem_ptr, self.tmem_dv, mdV, self.dv_part, 1.0, tidx, wg,
                       n_block, part, head_kv, batch, seqlen_k, num_iters)
        self.store_dkv(mma_dk, tmem_ptr, self.tmem_dk, mdK, self.d_part,
                       self.softmax_scale, tidx, wg, n_block, part, head_kv, batch, seqlen_k,
                       num_iters)

    @cute.jit
    def _store_row(self, rX: cute.Tensor, sX_rc: cute.Tensor, row, blk, ncols: int):
        """Write `ncols` 16-bit registers (columns blk * ncols, blk * ncols + 1, ... of
        key row `row`) into a (key, query) SMEM operand view, 16 bytes at a time: the
        128B swizzle moves whole 16-byte chunks, so 8 consecutive columns stay
        contiguous."""
        vec = 8
        row_view = cute.local_tile(sX_rc[row, None], (ncols,), (blk,))
        for q in cutlass.range_constexpr(ncols // vec):
            src = cute.make_tensor(rX.iterator + q * vec, cute.make_layout(vec))
            dst = cute.local_tile(row_view, (vec,), (q,))
            cute.autovec_copy(src, dst)

    @cute.jit
    def store_dkv(self, tiled_mma, tmem_ptr, col: cutlass.Constexpr[int], mX,
                  width: cutlass.Constexpr[int], scale: cutlass.Constexpr[float], tidx, wg,
                  n_block, part, head_kv, batch, seqlen_k, num_iters):
        """dV, or dK = scale * sum dS^T Q: TMEM -> registers -> global, 32 columns at a
        time (16 where a warpgroup's half is not a multiple of 32: hdim 96);
        warpgroup g stores columns [g * width / 2, (g + 1) * width / 2) of the CTA's
        ``width`` columns, block ``part`` of the head dim."""
        tn = self.tile_n
        chunk = 32 if (width // 2) % 32 == 0 else 16
        chunks_per_wg = width // 2 // chunk
        tX = self._tmem_acc(tiled_mma, tmem_ptr, col, (tn, width))
        tX2 = tX[(None, None), 0, 0]
        cX = cute.make_identity_tensor((tn, width))
        gX = cute.local_tile(mX[None, None, head_kv, batch], (tn, width), (n_block, part))
        ld_atom = cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(chunk)), Float32)
        for c in cutlass.range_constexpr(chunks_per_wg):
            blk = wg * chunks_per_wg + c
            tX_c = cute.local_tile(tX2, (tn, chunk), (0, blk))
            t2r = tcgen05.make_tmem_copy(ld_atom, tX_c).get_slice(tidx % 128)
            tc = t2r.partition_D(cute.local_tile(cX, (tn, chunk), (0, blk)))
            rAcc = cute.make_rmem_tensor(tc.shape, Float32)
            if num_iters > 0:
                cute.copy(t2r, t2r.partition_S(tX_c), rAcc)
                cute.arch.fence_view_async_tmem_load()
            else:
                rAcc.fill(0.0)
            rX = cute.make_rmem_tensor(tc.shape, self.dtype)
            if const_expr(scale != 1.0):
                rX.store((rAcc.load() * scale).to(self.dtype))
            else:
                rX.store(rAcc.load().to(self.dtype))
            row = tc[0][0]
            if n_block * tn + row < seqlen_k:
                for j in cutlass.range_constexpr(cute.size(rX)):
                    gX[tc[j]] = rX[j]

    def _dq_mma(self, width: int):
        """The tiled MMA of dQ[:, c0 : c0 + width] = dS K[:, c0 : c0 + width]: the whole
        dQ (width = head dim, ``_tiled_mmas``) or one of its passes; with head-dim
        halves, of dQ^T's (Note [Head-dim halves])."""
        MN = cute.nvgpu.OperandMajorMode.MN
        shape = (width, self.tile_m) if self.dq_t else (self.tile_m, width)
        return sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN, MN, Float32, tcgen05.CtaGroup.ONE, shape)

    def _dq_pass_views(self, sdS, sK, c0: int, width: int):
        """(MMA, dS, K^T[c0 : c0 + width]) of one dQ pass: K^T's MN-major layout keeps
        each 64-row atom of the head dim in its own tile_n x 64 block, so the pass's
        rows are the pass-width layout at c0 * tile_n elements from K's start
        (checked in tests/test_kernels_sm100_bwd_compile.py)."""
        tm, tn, dt = self.tile_m, self.tile_n, self.dtype
        mma = self._dq_mma(width)
        kt = cute.slice_(sm100_utils.make_smem_layout_b(mma, (tm, width, tn), dt, 1),
                         (None, None, None, 0))
        ds = cute.slice_(sm100_utils.make_smem_layout_a(mma, (tm, width, tn), dt, 1),
                         (None, None, None, 0))
        sKt = cute.make_tensor(cute.recast_ptr(sK.iterator + c0 * tn, kt.inner, dtype=dt),
                               kt.outer)
        return mma, _as_view(sdS, ds), sKt

    @cute.jit
    def _ordered_adds(self, order, tidx, batch, head_q, m_block, begin: cutlass.Constexpr):
        """Deterministic, around one work item's red.global.adds from the four reduce
        warps (``BwdTiles.dq_direct``): ``begin``, thread 0 spins until the query
        block's semaphore reaches this key block's rank (``det_add_rank``; masked,
        ``masked_add_rank`` over the walks, every warp counting), and the barrier
        holds every thread's adds after it; at the end every thread fences its adds
        (GPU scope) before the barrier, then thread 0 releases the next key block.
        order: (semaphores (B, Hq, num_m x split), walks or None, key block, key
        blocks, head-dim part); each part of a key block has its own semaphore."""
        mdQsem, mWalks, n_block, num_n_blocks, part = order
        reduce_bar = pipeline.NamedBarrier(barrier_id=_BAR_REDUCE, num_threads=128)
        sem_ptr = mdQsem.iterator + cute.crd2idx(
            (batch, head_q, m_block * self.split + part), mdQsem.layout)
        if const_expr(begin):
            if const_expr(self.masked):
                rank = masked_add_rank(mWalks, batch, n_block, m_block)
            else:
                rank = det_add_rank(m_block, n_block, num_n_blocks, self.tile_m, self.tile_n,
                                    self.causal, cutlass.min)
            if tidx == 0:
                semaphore_wait(sem_ptr, rank)
            reduce_bar.arrive_and_wait()
        else:
            cute.arch.fence_acq_rel_gpu()
            reduce_bar.arrive_and_wait()
            if tidx == 0:
                cute.arch.atomic_add(sem_ptr, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def reduce_dq_direct(self, mdQaccum, tmem_ptr, pipe_dq, tidx, head_kv, batch, group_size,
                         m_block_min, num_m, num_iters, order):
        """Warps 0-3 (``BwdTiles.dq_direct``): per work item and dQ pass, dQ (TMEM,
        lane = query row) in dq_cols-column chunks -> registers -> red.global.add into
        mdQaccum (fp32, the plain (Sq_pad, D, Hq, B) view): no SMEM staging. Thread t
        adds row t of the query block. Deterministic: the item's adds in the query
        block's order (``_ordered_adds``)."""
        tm, d, ncol = self.tile_m, self.head_dim, self.tiles.dq_cols
        ld_atom = cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(ncol)), Float32)
        dq_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        for it in cutlass.range(num_iters, unroll=1):
            head_q, m_block = self._work_item(it, head_kv, group_size, m_block_min, num_m)
            gdQ = cute.local_tile(mdQaccum[None, None, head_q, batch], (tm, d), (m_block, 0))
            if const_expr(self.deterministic):
                self._ordered_adds(order, tidx, batch, head_q, m_block, True)
            for c0, w in self.dq_passes:
                tdQ = self._tmem_acc(self._dq_mma(w), tmem_ptr, self.tmem_dq, (tm, w))
                tdQ2 = tdQ[(None, None), 0, 0]
                cdQ = cute.make_identity_tensor((tm, w))
                t2r = tcgen05.make_tmem_copy(ld_atom, cute.local_tile(tdQ2, (tm, ncol), (0, 0)))
                thr_t2r = t2r.get_slice(tidx)
                pipe_dq.consumer_wait(dq_state)
                for c in cutlass.range_constexpr(w // ncol):
                    tc, rdQ = self._dq_chunk(thr_t2r, tdQ2, cdQ, (tm, ncol), c,
                                             c == w // ncol - 1, pipe_dq, dq_state)
                    # Register j holds column j of the chunk (32x32b loads return a
                    # lane's columns in order), D contiguous in the accumulator.
                    row = gdQ[tc[0][0], None]
                    base = row.iterator + cute.crd2idx(c0 + c * ncol, row.layout)
                    for q in cutlass.range_constexpr(ncol // 4):
                        four = cute.make_tensor(rdQ.iterator + 4 * q, cute.make_layout(4))
                        cute.arch.red(base + 4 * q, four.load().ir_value(), op="add",
                                      dtype=Float32, sem="relaxed", scope="gpu")
                dq_state.advance()
            if const_expr(self.deterministic):
                self._ordered_adds(order, tidx, batch, head_q, m_block, False)

    def _dq_reader(self, mma_dq, tmem_ptr, shape, tidx):
        """(dQ's TMEM accumulator as (rows, cols), its coordinates, this reduce
        thread's TMEM load of dq_cols columns at a time) for the reduce warps; dQ^T's
        with head-dim halves."""
        ncol = self.tiles.dq_cols
        tdQ2 = self._tmem_acc(mma_dq, tmem_ptr, self.tmem_dq, shape)[(None, None), 0, 0]
        cdQ = cute.make_identity_tensor(shape)
        ld_atom = cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(ncol)), Float32)
        t2r = tcgen05.make_tmem_copy(ld_atom,
                                     cute.local_tile(tdQ2, (shape[0], ncol), (0, 0)))
        return tdQ2, cdQ, t2r.get_slice(tidx)

    @cute.jit
    def _dq_chunk(self, thr_t2r, tdQ2, cdQ, tile: cutlass.Constexpr, c: cutlass.Constexpr[int],
                  last: cutlass.Constexpr[bool], pipe_dq, dq_state):
        """(coordinates, registers) of chunk c, a ``tile`` of dQ (or dQ^T) in TMEM, read
        by the reduce warps; after the ``last`` chunk of a pass the MMA may overwrite
        the columns (dq released)."""
        tc = thr_t2r.partition_D(cute.local_tile(cdQ, tile, (0, c)))
        rdQ = cute.make_rmem_tensor(tc.shape, Float32)
        cute.copy(thr_t2r, thr_t2r.partition_S(cute.local_tile(tdQ2, tile, (0, c))), rdQ)
        cute.arch.fence_view_async_tmem_load()
        if const_expr(last):
            pipe_dq.consumer_release(dq_state)
        return tc, rdQ

    @cute.jit
    def reduce_dq_t(self, mdQaccum, tmem_ptr, pipe_dq, tidx, part, head_kv, batch,
                    group_size, m_block_min, num_m, num_iters, order):
        """Warps 0-3 with head-dim halves (Note [Head-dim halves]): per work item,
        dQ^T (TMEM, lane = one of the CTA's head-dim columns, column = query) in
        dq_cols-query chunks -> registers -> red.global.add into mdQaccum (fp32, the
        plain (Sq_pad, D, Hq, B) view). Thread t adds column part * d_part + t of
        every query row, so a warp's adds for one query are one 128-byte segment.
        Deterministic: the item's adds in the order of the query block's semaphore of
        this part (``_ordered_adds``)."""
        tm, dp, ncol = self.tile_m, self.d_part, self.tiles.dq_cols
        tdQ2, cdQ, thr_t2r = self._dq_reader(self._dq_mma(dp), tmem_ptr, (dp, tm), tidx)
        dq_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        for it in cutlass.range(num_iters, unroll=1):
            head_q, m_block = self._work_item(it, head_kv, group_size, m_block_min, num_m)
            # The item's queries x this CTA's head-dim columns.
            gdQ = cute.local_tile(mdQaccum[None, None, head_q, batch], (tm, dp),
                                  (m_block, part))
            if const_expr(self.deterministic):
                self._ordered_adds(order, tidx, batch, head_q, m_block, True)
            pipe_dq.consumer_wait(dq_state)
            for c in cutlass.range_constexpr(tm // ncol):
                tc, rdQ = self._dq_chunk(thr_t2r, tdQ2, cdQ, (dp, ncol), c,
                                         c == tm // ncol - 1, pipe_dq, dq_state)
                # Register j holds (this thread's head-dim column, query tc[j][1]).
                col = gdQ[None, tc[0][0]]
                for j in cutlass.range_constexpr(ncol):
                    cute.arch.red(col.iterator + cute.crd2idx(tc[j][1], col.layout),
                                  rdQ[j], op="add", dtype=Float32, sem="relaxed",
                                  scope="gpu")
            if const_expr(self.deterministic):
                self._ordered_adds(order, tidx, batch, head_q, m_block, False)
            dq_state.advance()

    # ---------------------------------------------------------- dQ reduce warps
    @cute.jit
    def reduce_dq(self, mma_dq, mdQaccum, mdQsem, sdQ, tma_dQ, tmem_ptr, pipe_dq, tidx,
                  n_block, num_n_blocks, head_kv, batch, group_size, m_block_min, num_m,
                  num_iters, mWalks=None):
        """Warps 0-3: per work item, dQ (TMEM, lane = query row) in dq_cols-column
        chunks -> SMEM staging tile -> TMA reduce-add into mdQaccum (fp32).

        Deterministic: before the work item's first reduce the leader spins (acquire
        loads) until the query block's semaphore reaches this key block's rank
        (``det_add_rank``; masked, ``masked_add_rank`` over the key blocks' walks
        ``mWalks``); after its last reduce it waits for all of them to land and
        releases the next key block (fence, GPU-scope release increment), as the
        sm90 kernel's dQ warp does."""
        tm, d = self.tile_m, self.head_dim
        ncol, nstage = self.tiles.dq_cols, self.tiles.dq_stages
        nchunk = d // ncol
        tdQ2, cdQ, thr_t2r = self._dq_reader(mma_dq, tmem_ptr, (tm, d), tidx)
        reduce_bar = pipeline.NamedBarrier(barrier_id=_BAR_REDUCE, num_threads=128)
        is_leader = tidx == 0

        dq_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        for it in cutlass.range(num_iters, unroll=1):
            head_q, m_block = self._work_item(it, head_kv, group_size, m_block_min, num_m)
            gdQ = cute.local_tile(mdQaccum[None, None, head_q, batch], (tm, ncol),
                                  (m_block, None))  # (tm, ncol, nchunk)
            tsdQ, tgdQ = tma_tile_partition(tma_dQ, sdQ, gdQ)
            sem_ptr = None
            if const_expr(self.deterministic):
                sem_ptr = mdQsem.iterator + cute.crd2idx((batch, head_q, m_block),
                                                         mdQsem.layout)
                if const_expr(self.masked):
                    # Every reduce warp counts (a warp-wide reduction); the leader
                    # waits. Counted before dQ is read: the loads overlap the MMAs.
                    walk_rank = masked_add_rank(mWalks, batch, n_block, m_block)
            pipe_dq.consumer_wait(dq_state)
            for c in cutlass.range_constexpr(nchunk):
                stage = c % nstage
                tdQ_c = cute.local_tile(tdQ2, (tm, ncol), (0, c))
                tc = thr_t2r.partition_D(cute.local_tile(cdQ, (tm, ncol), (0, c)))
                rdQ = cute.make_rmem_tensor(tc.shape, Float32)
                cute.copy(thr_t2r, thr_t2r.partition_S(tdQ_c), rdQ)
                cute.arch.fence_view_async_tmem_load()
                if const_expr(c == nchunk - 1):
                    # All of dQ is in registers or SMEM: the MMA may overwrite it.
                    pipe_dq.consumer_release(dq_state)
                # The staging tile is free once the reduce issued nstage chunks ago
                # has finished reading it.
                if is_leader:
                    cute.arch.cp_async_bulk_wait_group(nstage - 1, read=True)
                reduce_bar.arrive_and_wait()
                # Row tidx of the staging tile, 16 bytes at a time (the swizzle moves
                # whole 16-byte chunks); register j holds column j of the chunk.
                sdQ_row = sdQ[tc[0][0], None, stage]
                for q in cutlass.range_constexpr(ncol // 4):
                    cute.autovec_copy(
                        cute.make_tensor(rdQ.iterator + q * 4, cute.make_layout(4)),
                        cute.local_tile(sdQ_row, (4,), (q,)))
                cute.arch.fence_view_async_shared()
                reduce_bar.arrive_and_wait()
                if is_leader:
                    if const_expr(self.deterministic and self.masked and c == 0):
                        semaphore_wait(sem_ptr, walk_rank)  # the reduces come after it
                    elif const_expr(self.deterministic and c == 0):
                        rank = det_add_rank(m_block, n_block, num_n_blocks, tm, self.tile_n,
                                            self.causal, cutlass.min)
                        semaphore_wait(sem_ptr, rank)  # the reduces come after it
                    cute.copy(tma_dQ, tsdQ[None, stage], tgdQ[None, c])
                    cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.deterministic):
                if is_leader:
                    # Every chunk's add lands before the next key block may add.
                    semaphore_release_after_bulk(sem_ptr)
            dq_state.advance()
        if is_leader:
            cute.arch.cp_async_bulk_wait_group(0, read=False)


class FlashBwdSm100Deterministic(DqSemaphoreCall, FlashBwdSm100):
    """The deterministic sm100 backward: every query block sums its dQ partials in
    a fixed key-block order (``det_add_rank``), so dQ is bitwise reproducible. The
    call takes one extra operand after mdQaccum: mdQsem, (B, Hq, ceil(Sq / tile_m) x
    split) int32, zero at launch (one semaphore per query block and head-dim part,
    Note [Head-dim halves]). Where dQ leaves by TMA reduce-adds the reduce warps'
    leader orders them (``reduce_dq``); where the reduce warps add it from registers
    (192, 256) all four order theirs around a barrier (``_ordered_adds``).
    ``masked``: it also takes the key blocks' walks after the intervals (and ids),
    walks them, and ranks its adds by them (Note [Masked dQ order] in dq_layout.py).
    Compiled for sm_100a, not run on hardware (with masks or without)."""

    def __init__(self, dtype, head_dim, head_dim_v=None, causal=False, softmax_scale=None,
                 tiles=None, masked=False, segments=False, softcap=None):
        if tiles is None:
            tiles = bwd_tiles(head_dim, causal, head_dim_v)
            spare = 512 - 2 * tiles.regs_compute - tiles.regs_reduce - tiles.regs_other
            if head_dim > 64 and spare >= 8:
                # The semaphore's address and rank: the reduce warps take 8 of the
                # registers per thread the split leaves free (hdim 96, 128, (192,
                # 128): 2 x 160 + 72 + 120 = 512); at 64 they spilled.
                tiles = dataclasses.replace(tiles, regs_reduce=tiles.regs_reduce + 8)
        super().__init__(dtype, head_dim, head_dim_v, causal, softmax_scale, tiles,
                         deterministic=True, masked=masked, segments=segments,
                         softcap=softcap)
