"""Hopper (sm_90a) backward attention main kernel: dK, dV and the fp32 dQ accumulator.

One CTA owns one key/value block (`tile_n` keys) of one kv head of one batch entry
and walks every query block of every query head of its GQA group, so dK and dV
stay in registers for the whole walk (deterministic, no dK/dV atomics). dQ
partials (sum over this CTA's keys of dS K) are reduce-added into the fp32
accumulator by 1-D bulk reduces, in the flat order of Note [Flat dQ accumulator]
(dq_layout.py), which the postprocess reads back.

Warp roles (384 threads; the load warp, the work list and the joint dQ hand-off are
shared with the hdim 256 kernel in sm90_bwd_common.py):
  warpgroup 0   warp 0: TMA loads (K, V once; Q, dO, LSElog2 and Dpsum rows per
                        query block, one pipeline stage each)
                warp 1: bulk reduce-add of the dQ partial into mdQaccum (or, with
                        dq_store_first, a bulk store of each query block's first
                        partial: Note [dQ store first] in dq_layout.py)
                warps 2-3: idle, or with dq_fold the count of landed partials and
                        the conversion of complete query blocks to dQ (Note [dQ
                        fold] in dq_layout.py)
  warpgroups 1-2: the five GEMMs (wgmma) and the pointwise softmax backward

Per query block the MMA warpgroups compute the transposed scores, each warpgroup
for its own 64 keys (Note [Transposed scores]):
  S^T  = K Q^T,  P^T = exp2(S^T * scale * log2(e) - LSElog2)   (tile_n x tile_m)
  dP^T = V dO^T, dS^T = P^T * (dP^T - Dpsum)
  dV  += P^T dO   (A operand P^T from registers)
  dK  += dS^T Q   (A operand dS^T from registers)
  dQ   = dS K     (dS from shared memory: every warpgroup needs all keys)

Order within one query block: S^T and dP^T issued together (this thread's LSElog2
values load meanwhile); P^T while dP^T runs; dS^T; dS^T stored to SMEM (double
buffered); dV issued; one barrier over both warpgroups (dV runs through it); dQ
then dK issued; the dQ partial goes to the dQ warp through SMEM while dK still
runs: each thread stores its dQ registers in order (8 conflict-free 128-bit
stores). With `dq_per_wg` each warpgroup hands over its own part of the dQ tile (own
SMEM part, own barrier pair, own reduce), so the warpgroups meet only at the dS
barrier. After the walk dK and dV go through SMEM (the K and V tiles) and
leave by TMA store.

Note [Transposed scores]: with S^T a warpgroup's accumulator rows are its own
keys, which are exactly the rows of its dV and dK tiles, so P^T and dS^T feed
those GEMMs straight from registers as the A operand (FA3's SdP_swapAB). Only dS
goes through shared memory (for dQ, which reduces over all keys of the block),
and P never does. The price: each thread's columns are queries, so it reads
LSElog2 and Dpsum per column from shared memory (staged by the load warp).

Note [Masked warpgroup]: causal at hdim 128 (64-row query tiles, 128-key blocks),
the first query block of a key block's walk lies on the diagonal, and warpgroup 1's
64 keys all come after its last query (likewise a last key block of at most 64
keys past seqlen_k): P^T = dS^T = 0 there. With ``BwdTiles.skip_masked_wg`` that
item is peeled off the loop (``masked_first_item``): the masked warpgroup stores
zeros as its half of dS^T, meets the other at the dS barrier, runs only its dQ
GEMM and hand-off, and starts the loop at item 1. That saves 4 of the item's 10
warpgroup GEMMs, about 1 / (2 x 9) of the work of the mean key block at 1k tokens.
A branch inside the loop instead cost 2.6% at 16k tokens, where it is never taken;
the peeled version starts the loop at a run-time item, which ptxas schedules
differently: 1.018x at 1k causal, 0.999x at 4k, 0.989x at 16k (main kernel, 1 s
phases x 3 rounds, twenty-third session). Peeling the item for both warpgroups, so
that the loop starts at the constant 1 (the item body then traced twice), measured
worse: 1.005x at 1k, 0.975x at 16k. Part of that loss was a division by num_m in
the walk that ptxas strength-reduces only from item 0; with ``BwdTiles.carry_coords``
(the query block carried from item to item) the peeled version measured 1.026x at
1k, 1.011x at 4k and 1.000x at 16k (twenty-fourth session), and both are the table's
at hdim 128 causal.

Note [CTA timeline]: a kernel built with ``trace=True`` (a diagnostic, never in the
lowering) takes one more operand after its outputs, mTrace: (CTAs of the grid,
TRACE_COLS) int32, one row per CTA in launch order (blockIdx linearised, x fastest).
Columns: 0 the SM id; 1 unused; 2-5 the CTA's key block, kv head, batch and number
of walk items; 6-7 its start time (``%globaltimer`` ns, low and high halves), read
by thread 0 before anything else; then from TRACE_WARP_END, per warp w, the time its
lane 0 finished its role (low, high at TRACE_WARP_END + 2 w). Not with the persistent
backward, whose CTAs run many tiles. ``scripts/cta_timeline.py`` reads it: per-SM
busy time, the gaps between a SM's CTAs, the tail, and each CTA's length against
its number of items.

Note [Tails without predicates]: TMA zero-fills Q/dO rows past seqlen_q and K/V
rows past seqlen_k. The LSElog2 / Dpsum workspaces have Sq_pad rows, the ones
past seqlen_q set to +inf / 0 by the preprocess kernel, so P = exp2(-inf) = 0
there and with it dS = 0: those queries add exact zeros to dV, dK and to the
padding rows of dQaccum. Keys past seqlen_k (and, causal, keys after the query)
get S = -inf, hence P = 0, in the blocks that contain any; their dK/dV rows are
never stored (the epilogue's TMA store clips them).
"""

import logging
import math
from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from jax_fa4.kernels.cute_utils import (
    DqSemaphoreCall,
    bulk_load_g2s,
    bulk_reduce_add_f32,
    bulk_store,
    consumer_release_elected,
    convert_to_operand_a,
    global_timer_halves,
    init_bwd_kernel,
    pack_f32x2,
    pdl_start,
    red_add_f32x4,
    semaphore_release_after_bulk,
    semaphore_wait,
    semaphore_wait_at_least,
    sm90_smem_layout,
    sm_id,
    st_global_b32,
    stmatrix_acc,
    tma_store_tile,
    tma_tile_partition,
    transpose_smem,
    wgmma_gemm,
)
from jax_fa4.kernels.dq_layout import (
    DQ_STORED,
    det_add_rank,
    det_key_block,
    dq_first_by_length,
)
from jax_fa4.kernels.sm90_bwd_common import Sm90BwdCommon, dq_mma_shape, dq_tiled_mma
from jax_fa4.kernels.sm90_fwd import lpt_section_size, lpt_tile, sm_count
from jax_fa4.kernels.softmax import acc_mn_view

log = logging.getLogger(__name__)

LOG2_E = math.log2(math.e)

# Named hardware barriers (0 is __syncthreads).
_BAR_DS = 1  # both MMA warpgroups: dS^T of this query block is in SMEM
# Note [dQ fold]: slots of the ring of landed items from the dQ warp to the counting warp.
FOLD_RING = 4
# The dQ hand-off (Sm90BwdCommon): FlashBwdSm90.bar_dq_full = 2 and bar_dq_empty = 4,
# with dq_per_wg one of each per warpgroup (2, 3 and 4, 5).


@dataclass(frozen=True)
class BwdTiles:
    """Tuning knobs of the sm90 backward kernel (one row of the table below)."""

    tile_m: int  # query rows per block (64, 80 with head dim 128, or 128)
    tile_n: int  # key rows per CTA (64 per MMA warpgroup)
    stages_qdo: int  # Q/dO/LSE/Dpsum SMEM pipeline depth
    regs_producer: int  # setmaxnreg for the load/store warpgroup
    regs_mma: int  # setmaxnreg for each MMA warpgroup
    # Each MMA warpgroup hands its own part of the dQ partial to the dQ warp (own
    # SMEM tile and barrier pair, one TMA reduce each) instead of both together.
    dq_per_wg: bool = False
    # Issue dV += P^T dO before computing dS^T (it runs meanwhile) or after storing
    # dS^T (it runs while the warpgroups meet at the dS barrier). Before pins P^T
    # and the dV accumulator under an in-flight wgmma while S^T, dP^T and dS^T are
    # live: at hdim 64 with 128-row tiles that is more than 240 registers, and
    # ptxas then serialises every wgmma (C7512; 21% slower on the H200).
    dv_before_ds: bool = False
    # The dQ partial goes to SMEM in register order (128-bit stores, no bank
    # conflicts) and to global memory by a 1-D bulk reduce, leaving dQaccum's
    # query blocks in the flat order of Note [Flat dQ accumulator] (dq_layout.py),
    # which the postprocess reads back. Else a row-major swizzled tile and a TMA
    # tensor reduce (row-major dQaccum). Needs tile_m a multiple of 64.
    dq_flat: bool = False
    # This thread's LSElog2 values load before S^T is issued instead of after dP^T
    # is (with 16 columns only). Loaded after, the loads queue behind the GEMMs'
    # shared-memory reads and the exp2 argument waits for them (ncu: 13% of the
    # stall samples at hdim 128); flash-attn-4 loads them around its S GEMM.
    lse_early: bool = False
    # Each column's Dpsum loads into registers before the wait for dP^T, not after.
    dpsum_early: bool = False
    # Wait for the dV GEMM (issued before the dS barrier) to finish before issuing
    # dK, after dQ, as flash-attn-4 orders them. Without it, dK's register-A wgmma
    # is issued at once and its issue stalls: 11% of the stall samples at hdim 128
    # against 7% for flash-attn-4 (ncu, seventh session). In the table at hdim 64
    # causal, the one configuration where it measured faster.
    dv_done_before_dk: bool = False
    # Causal, not deterministic: launch the key blocks in FA4's forward LPT order
    # (``lpt_tile``) over a 1-D grid: in sections of as many KV heads as keep their
    # Q, dO and dQ accumulator in L2, key block 0 (the most query blocks) of every
    # head of the section first, then key block 1, and so on. The default grid runs
    # every key block of one head before the next head, as flash-attn-4 does.
    lpt: bool = False
    # End the exp2s' basic block with a branch that is never taken (on P^T < 0), so
    # that ptxas cannot hoist the wait for dP^T above them (the forward's Note [P V
    # wait]): without it every exp2 runs after dP^T is done, and the two warpgroups,
    # which meet at the dS barrier, both compute P^T while the tensor cores idle.
    # flash-attn-4's SASS has about a third of its exp2s before that wait. Off: on
    # the H200 it measured level to slower at hdim 128 (0.95-1.0x, ninth session),
    # as the seventh session's dvearly did; at hdim 64 (128-row tiles) ptxas then
    # serialises every wgmma.
    pin_dp_wait: bool = False
    # K and V on two mbarriers, V loaded after the first Q / dO item: the first S^T
    # GEMM starts when K and that item have landed, without waiting for V (as
    # flash-attn-4 pairs K with Q and V with dO). At 1k tokens a CTA walks 9-16
    # query blocks, and Nsight Compute put 3% of the MMA warps' samples on the
    # wait for K and V together (ninth session). Off: level on the H200 (hdim 128,
    # 1k: 0.985x non-causal, 1.002x causal; 4k: 0.994x / 0.996x; 9 / 7 alternating
    # rounds).
    split_kv: bool = False
    # Not deterministic, flat dQ, one K/V mbarrier: one CTA per SM walks the
    # (key block, kv head, batch) tiles in launch order (LPT with ``lpt``), so the
    # load warp fetches the next tile's Q / dO and computes its coordinates while
    # the MMA warpgroups finish this one and store dK / dV, and the CTA start and
    # end are paid once. The K/V tile is released when the dK / dV stores (staged
    # in the K and V buffers) have read it. At 1k tokens a CTA walks 9-16 query
    # blocks and Nsight Compute put about a tenth of each CTA's life outside the
    # walk (ninth session). Off: on the H200 (hdim 128, 1k) it measured level non-
    # causal (1.003x) and 0.75x causal. Causal tiles differ in length, and the
    # static round-robin share of the LPT order leaves the busiest CTA 1.23x the
    # mean (a greedy dynamic share: 1.02x). K and V still load only after the
    # previous tile's stores, so their latency stays exposed.
    persistent: bool = False
    # With lpt: the launch order's divisors (section tiles, section, the last
    # section's heads, kv heads) are set up on the host, and each CTA finds its
    # coordinates with multiply-shift divisions (``lpt_key_block_fast``) instead of
    # the run-time integer divisions of ``lpt_coord``. Those are about 170 dependent
    # instructions ahead of every warp's first step, the load warp's first TMA
    # included: Nsight Compute put 3.5% of the walk's samples on them at 1k causal
    # (ninth session), flash-attn-4's prologue 1%. Same order, 51 instructions before
    # the first barrier instead of 172. Off: level on the H200 (hdim 128 causal,
    # main kernel, 9 alternating rounds: 1.002x at 1k, 1.003x at 4k; tenth session).
    lpt_host_div: bool = False
    # Each column's Dpsum loads into registers with LSElog2, before S^T is issued
    # (16 columns, 64-row tiles, not persistent: else it spills), not just before
    # the wait for dP^T (dpsum_early): at 1k causal Nsight Compute put 4% of the
    # walk's samples on the first use of those late loads, queued behind the GEMMs'
    # shared-memory reads (the ninth session's profile); flash-attn-4 loads them
    # before its exp2s. In the table at hdim 128 (tenth session).
    dpsum_top: bool = False
    # The MMA warpgroups release each Q / dO stage from a lane chosen by elect.sync
    # (``consumer_release_elected``), not by the pipeline's lane test, which ptxas
    # recomputed in the walk from an S2R of the thread index: its first use took
    # 3.8% of the walk's stall samples at hdim 128, 1k causal (eleventh session).
    # In the table at hdim 128.
    elect_release: bool = False
    # LSElog2 and Dpsum come in the by-thread order of ``stat_position`` (the
    # preprocess writes them so, ``stats_thread_block``): each thread's 16 (tile_m
    # 64) or 32 (128) values come in chunks of 4 that load as 128-bit LDS, half the
    # instructions of the pairs 8 floats apart of the row order, and the four lane
    # quads' chunks are adjacent (no bank conflicts). Nsight Compute put
    # about 5% of the hdim 128 walk (1k causal) on those loads waiting in the MIO
    # queue at the top of the step (eleventh session). tile_m 64 or 128 only.
    # In the table at hdim 128 (twelfth session).
    stats_by_thread: bool = False
    # Row order: each thread loads only an eighth of its columns' LSElog2 and Dpsum
    # (the eight lanes of a warp that share a lane-in-quad, lane % 4, hold the same
    # columns of S^T: column c of lane l is query 8 (c // 2) + 2 (l % 4) + c % 2),
    # right after issuing S^T and dP^T, and takes each column's value from the lane
    # that loaded it with a shuffle (``_shuffled_stat``), as flash-attn-4 does at
    # hdim 64. 4 + 4 live registers instead of 32 + 32 at tile_m 128, so the loads
    # leave the step's top without spilling; the row order loads them in the step,
    # after the S^T wait (LSElog2) and the dP^T wait (Dpsum). Per step at hdim 64:
    # 64 SHFL and 4 LDS.64 instead of 32 LDS.64. At hdim 64, 8k, the table's main
    # kernel took 1.020x flash-attn-4's time non-causal, 1.001x causal (Nsight
    # Compute, seventeenth session). In the table at hdim 64 non-causal: the main
    # kernel alone under the power cap (clock_probe, 3 rounds, eighteenth session)
    # 1.020x non-causal, 0.999x causal, 0.957x at hdim 128 causal 16k; Nsight Compute
    # then had the hdim 64 non-causal main kernel at 0.964x flash-attn-4's time.
    stats_shuffle: bool = False
    # With dq_store_first (not deterministic; else ignored): two SMEM buffers for the
    # dQ partial, item it in buffer it % 2, so the MMA warpgroups write the next
    # partial while the dQ warp still waits for a query block's first store to land
    # (Note [dQ store first]). 32 KiB more SMEM (224-226 KiB at hdim 64 / 128; an
    # 80-row tile does not fit). In the table, so that JAX_FA4_DQ_STORE_FIRST=1 runs
    # the measured v3 (docs/performance.md, twentieth session).
    dq_double: bool = False
    # Non-causal, not deterministic (off: not faster, twentieth session): each CTA
    # starts its walk at item n_block * num_iters // num_n_blocks of the work list
    # and wraps around, so the key blocks of one head visit different query blocks
    # at any time instead of all the same one. Their dQ partials of a query block
    # then arrive spread over the walk (no queue of reduce-adds on one tile; with
    # dq_store_first, the first store has landed before the next key block gets
    # there). Q / dO of a head stay in L2.
    rotate_walk: bool = False
    # The backward runs as FlashBwdSm90StoreFirst (the lowering reads this; Note [dQ
    # store first]): the preprocess zeroes per-query-block semaphores, not dQaccum.
    # Off: on the H200, +1.6-2.9% at 1k tokens, 3-5% slower at 4k-16k (twentieth
    # session): the waits for each query block's first store stall the dQ hand-off.
    dq_store_first: bool = False
    # With dq_store_first, not deterministic: store first only where the query
    # length, rounded up to whole query tiles, is at most this (one binary; the
    # main kernel and the preprocess read it from the semaphores' extent at run
    # time; Note [dQ store first by length]). 0: everywhere.
    dq_first_max_seqlen_q: int = 0
    # Not deterministic, not store first: two SMEM buffers for the dQ partial (as
    # dq_double), so the MMA warpgroups write item it + 1 while the bulk engine
    # still reads item it. Off: 0.978-0.994x the one-buffer kernel on the H200
    # (hdim 128, 1k-16k; twenty-second session).
    dq_double_add: bool = False
    # Not deterministic, not store first, not folded, one CTA per key block, flat dQ:
    # the MMA threads add their dQ registers straight into dQaccum, four floats per
    # 128-bit reduction (``red_add_f32x4``), in the flat order (Note [dQ from
    # registers]); no SMEM dQ buffer, no dQ warp, no hand-off barriers. Off:
    # 0.92-0.96x on the H200 (twenty-third session).
    dq_red: bool = False
    # Causal (or a last key block with at most 64 keys): a warpgroup whose 64 keys
    # all come after the query block's last query, or past seqlen_k, skips its
    # S^T, dP^T, dV and dK GEMMs for that block and stores zeros as its half of
    # dS^T (Note [Masked warpgroup]). At hdim 128 (64-row query tiles, 128-key
    # blocks) that is warpgroup 1 on each key block's first query block. Alone:
    # 1.018x at 1k causal, 0.989x at 16k on the H200 (twenty-third session); with
    # carry_coords the table's at hdim 128 causal (``bwd_tiles``).
    skip_masked_wg: bool = False
    # The MMA warpgroups' walk carries its query block from item to item (m_rel,
    # wrapped at num_m) instead of dividing the item index by num_m per item
    # (``work_item``). Not with rotate_walk or the persistent walk. From item 0 the
    # same SASS as without (LLVM strength-reduces the division there); after the
    # peeled item of skip_masked_wg it removes a run-time division (H200: 1.000x
    # alone, with the skip 1.026x / 1.011x / 1.000x at 1k / 4k / 16k causal).
    carry_coords: bool = False
    # Not deterministic, not store first, one CTA per key block, > 0: the backward
    # runs as FlashBwdSm90Fold (the lowering reads this; Note [dQ fold]): the last key
    # block to add into a query block converts it to dQ, and no postprocess runs. The
    # dQ warp hands an item on this many items after its adds (the lag). 0: off.
    dq_fold: int = 0


# The tuning table: (head dim, causal) -> (tile_m, dq_per_wg, dv_before_ds, dq_flat,
# lse_early, dpsum_early, dv_done_before_dk, lpt, dpsum_top, elect_release,
# stats_by_thread, stats_shuffle).
# Measured on the H200 (docs/performance.md, "Backward, sm90 main kernel"): at hdim
# 128 the per-warpgroup dQ hand-off gained 2-3%, 80-row tiles lost 10% with dS^T
# queries-contiguous and measured level (+0.4%, seventh session) keys-contiguous
# with the flat dQ^T (flash-attn-4's non-causal choice, +2.4% for it), issuing dV
# after dS^T measured the same or 1% faster, and the flat dQ order gained 4% (non-
# causal) / 8% (causal); at hdim 64 issuing dV after dS^T removed the wgmma
# serialisation (+21%), the per-warpgroup hand-off then gained 2-5%, and the flat
# dQ order measured level (+0.5%). lse_early / dpsum_early: "v5" in the log.
# dv_done_before_dk: +2.7% at hdim 64 causal (9 alternating rounds and a single
# timing agree), level elsewhere; lpt: +4-6% at hdim 128 causal 4k, level at 1k and
# 16k, 4-6% slower at hdim 64 (eighth session); dpsum_top: +0.8% to +5.3% at hdim
# 128 in 8 alternating-round A/Bs (9-15 rounds; 1k, 4k, 16k, both masks), none
# below level (tenth session); at hdim 64 it does not apply (32 columns).
# elect_release: at hdim 128 (main kernel, alternating rounds, eleventh session)
# causal 1.016x / 1.007x at 1k (9 / 15 rounds), 1.026x at 4k, 1.022x at 16k (9);
# non-causal 1.000x / 1.002x at 1k, 1.000x at 4k, 0.997x at 16k; at hdim 64 (8k,
# twelfth session) 0.994x / 1.016x non-causal, 1.042x / 1.005x causal (9 rounds each).
# stats_by_thread (twelfth session, conflict-free chunk order; 9 / 9 / 5 rounds at
# 1k / 4k / 16k): at hdim 128 non-causal 1.014x / 1.013x / 1.028x, causal 1.006x /
# 1.007x / 1.016x; at hdim 64 (8k) 1.008x non-causal, 0.970x causal: off there. The
# first order (whole runs per quad, 2- or 4-way bank conflicts) measured 0.93-0.96x
# at hdim 128 and 0.80-0.83x at hdim 64. stats_shuffle: see BwdTiles (hdim 64
# non-causal only).
_TILE_TABLE = {
    (64, False): (128, True, False, True, False, False, False, False, False, True, False, True),
    (64, True): (128, True, False, True, False, False, True, False, False, True, False, False),
    (128, False): (64, True, False, True, True, True, False, False, True, True, True, False),
    (128, True): (64, True, False, True, True, True, False, True, True, True, True, False),
}


def bwd_tiles(head_dim: int, causal: bool) -> BwdTiles:
    """The tile table, keyed by head dim and mask (FA3's sm90 backward choices, adapted).

    hdim 64: 128 x 128 (S^T per warpgroup 64 x 128, dK/dV 64 x 64 each);
    hdim 128: 64 x 128 (S^T 64 x 64, dK/dV 64 x 128 each); 80 x 128 (dQ^T computed
    from a keys-contiguous dS, flat dQ^T order; the workspaces then need
    ``seqlen_q_padded(Sq, 80)``) is a knob, not the default: it measured level.
    Both issue dV after dS^T, which keeps every wgmma asynchronous within the 240
    registers of an MMA thread.
    """
    if head_dim not in (64, 128):
        raise ValueError(f"sm90 backward supports head_dim 64 and 128, got {head_dim}")
    (tile_m, dq_per_wg, dv_before_ds, dq_flat, lse_early, dpsum_early, dv_done_before_dk,
     lpt, dpsum_top, elect_release, stats_by_thread,
     stats_shuffle) = _TILE_TABLE[(head_dim, bool(causal))]
    # Only hdim 128 causal has a warpgroup masked entirely on a query block (64-row
    # query tiles, 64 keys per warpgroup): skip_masked_wg with carry_coords, 1.026x /
    # 1.011x / 1.000x the kernel without them at 1k / 4k / 16k (H200, 3 alternating
    # rounds, twenty-fourth session); skip_masked_wg alone lost 1.1% at 16k.
    masked_wg = head_dim == 128 and bool(causal)
    return BwdTiles(tile_m=tile_m, tile_n=128, stages_qdo=2, regs_producer=24, regs_mma=240,
                    dq_per_wg=dq_per_wg, dv_before_ds=dv_before_ds, dq_flat=dq_flat,
                    lse_early=lse_early, dpsum_early=dpsum_early,
                    dv_done_before_dk=dv_done_before_dk, lpt=lpt, dpsum_top=dpsum_top,
                    elect_release=elect_release, stats_by_thread=stats_by_thread,
                    stats_shuffle=stats_shuffle, dq_double=True,
                    skip_masked_wg=masked_wg, carry_coords=masked_wg)


def masked_wg_buildable(t: BwdTiles, dq_store_first: bool = False,
                        dq_fold: int = 0) -> tuple[bool, bool]:
    """Whether skip_masked_wg and carry_coords go with the rest of ``t`` (and the
    store-first / fold kernels): the skip needs the add-only flat dQ hand-off through
    one SMEM buffer, K and V on one mbarrier, a CTA per key block and two or more
    Q / dO stages; carrying the walk's coordinates needs the plain walk."""
    skip = not (t.split_kv or t.persistent or not t.dq_flat or t.dq_red or t.dq_double_add
                or dq_store_first or dq_fold or t.stages_qdo < 2)
    return skip, not (t.rotate_walk or t.persistent)


def without_masked_wg_conflicts(t: BwdTiles, dq_store_first: bool = False,
                                dq_fold: int = 0) -> BwdTiles:
    """``t`` with skip_masked_wg / carry_coords turned off where
    ``masked_wg_buildable`` rules them out: for builds derived from the table's
    tiles, which has both on at hdim 128 causal. Tiles given explicitly to the
    kernel are refused instead."""
    skip_ok, carry_ok = masked_wg_buildable(t, dq_store_first, dq_fold)
    skip, carry = t.skip_masked_wg and skip_ok, t.carry_coords and carry_ok
    if (skip, carry) == (t.skip_masked_wg, t.carry_coords):
        return t
    return replace(t, skip_masked_wg=skip, carry_coords=carry)


def lpt_key_block(t, num_n_blocks, num_kv_heads, num_hb, section, minimum=min):
    """(n_block, kv head, batch) of CTA t in the backward's LPT order
    (``BwdTiles.lpt``): ``lpt_tile``'s order with key block 0, the one with the
    most query blocks under the causal mask, first. Plain ints (tests) or DSL
    integers."""
    last_first, head, batch = lpt_tile(t, num_n_blocks, num_kv_heads, num_hb, section,
                                       minimum)
    return num_n_blocks - 1 - last_first, head, batch


def lpt_key_block_fast(t, div_section_tiles, div_section, div_last, div_heads, section,
                       full_sections, select=lambda c, a, b: a if c else b):
    """``lpt_key_block`` from divisors set up once per launch (``lpt_divisors``):
    plain ints (tests) or the CuTe DSL's fast divisors, whose ``divmod`` is a
    multiply and a shift. div_section_tiles divides by section * num_n_blocks,
    div_section by section, div_last by the heads of the last, short section (1 if
    there is none), div_heads by the kv heads; full_sections = num_hb // section."""
    sec, rest = divmod(t, div_section_tiles)
    n_full, r_full = divmod(rest, div_section)
    n_last, r_last = divmod(rest, div_last)
    short = sec == full_sections
    hb = sec * section + select(short, r_last, r_full)
    batch, head = divmod(hb, div_heads)
    return select(short, n_last, n_full), head, batch


def lpt_divisors(num_n_blocks, q_blocks, num_kv_heads, batch, q_block_bytes: int,
                 divisor=lambda x: x, select=lambda c, a, b: a if c else b, one=1,
                 maximum=max):
    """The arguments of ``lpt_key_block_fast`` after t: (div_section_tiles,
    div_section, div_last, div_heads, section, full_sections), for the order
    ``lpt_coord`` computes (sections of ``lpt_section_size`` kv heads); q_blocks =
    query blocks x GQA group. ``divisor`` makes a divisor of an integer."""
    section = lpt_section_size(q_blocks, 1, q_block_bytes, select, one)
    num_hb = num_kv_heads * batch
    full_sections = num_hb // section
    last = num_hb - full_sections * section
    return (divisor(section * num_n_blocks), divisor(section), divisor(maximum(last, one)),
            divisor(num_kv_heads), section, full_sections)


def _stats_to_regs(dst, s_stat, thr_stat, tScS, stage) -> None:
    """dst[c] = the row statistic (LSElog2 or Dpsum) of this thread's column c in
    Q / dO stage ``stage``: one vectorised copy of the thread's contiguous run
    (``thr_stat``, BwdTiles.stats_by_thread), else one load per column from the
    row-order ``s_stat``. Called while tracing."""
    if thr_stat is not None:
        cute.autovec_copy(thr_stat[None, None, stage], dst)
    else:
        for c in range(cute.size(dst)):
            dst[c] = s_stat[tScS[0, c][1], stage]


def stat_part_query(c: int, lane):
    """The query (row of the block, row order) of column c of S^T at a lane of the
    MMA warpgroup: 8 (c // 2) + 2 (lane % 4) + c % 2 (the wgmma accumulator's
    layout, checked against CuTe's in the tests). Plain ints or DSL integers."""
    return 8 * (c // 2) + 2 * (lane % 4) + c % 2


def stat_part_base(lane, n_cols: int):
    """BwdTiles.stats_shuffle: a lane loads the statistics of its columns per *
    (lane // 4) + i, i < per = n_cols / 8, whose queries (``stat_part_query``) are
    this base + ``stat_part_offset(i)``. Plain ints or DSL integers."""
    return (n_cols // 2) * (lane // 4) + 2 * (lane % 4)


def stat_part_offset(i: int) -> int:
    return 8 * (i // 2) + i % 2


def _stat_part(s_stat, part_base, per: int, stage):
    """BwdTiles.stats_shuffle: this lane's ``per`` values of a row statistic (rows
    ``part_base`` + ``stat_part_offset(i)`` of stage ``stage``). Called while tracing."""
    part = cute.make_rmem_tensor(cute.make_layout(per), Float32)
    for i in range(per):
        part[i] = s_stat[part_base + stat_part_offset(i), stage]
    return part


def _shuffled_stat(part, c: int, quad_lane):
    """BwdTiles.stats_shuffle: the statistic of this thread's column c, read from
    the lane of its quad position that loaded it (``_stat_part``): lane 4 (c // per)
    + lane % 4, its value c % per. Called while tracing."""
    per = cute.size(part)
    return cute.arch.shuffle_sync(part[c % per], offset=4 * (c // per) + quad_lane)


def stats_thread_block(head_dim: int, causal: bool) -> int | None:
    """The block of the by-thread LSElog2 / Dpsum order (``stat_position``) the sm90
    backward reads for this configuration (what its preprocess must write), or
    None for row order."""
    t = bwd_tiles(head_dim, causal)
    return t.tile_m if t.stats_by_thread else None


def dq_accum_flat_tile_m(head_dim: int, causal: bool) -> int | None:
    """The tile_m of the flat dQaccum order the sm90 backward writes for this
    configuration (what its postprocess must read), or None for row-major."""
    t = bwd_tiles(head_dim, causal)
    return t.tile_m if t.dq_flat else None


# Note [CTA timeline]: the row width and the first per-warp end column.
TRACE_WARP_END = 8
TRACE_COLS = TRACE_WARP_END + 2 * 12


class FlashBwdSm90(Sm90BwdCommon):
    """Backward main kernel for sm_90a; see the module docstring and docs/design.md.

    Args:
      dtype: cutlass.BFloat16 or cutlass.Float16 (Q, K, V, dO, dK, dV).
      head_dim, head_dim_v: 64 or 128, equal.
      causal: top-left causal mask (query i sees key j <= i).
      softmax_scale: scale applied to Q K^T.
    """

    bar_dq_full = 2
    bar_dq_empty = 4

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        head_dim_v: int | None = None,
        causal: bool = False,
        softmax_scale: float | None = None,
        tiles: BwdTiles | None = None,
        deterministic: bool = False,
        use_pdl: bool = False,
        dq_store_first: bool = False,
        dq_first_max_seqlen_q: int | None = None,
        dq_fold: int = 0,
        trace: bool = False,
    ):
        init_bwd_kernel(self, "sm90 backward", dtype, head_dim, head_dim_v, (64, 128), causal,
                        softmax_scale)
        # Note [CTA timeline]: the call takes mTrace after its outputs.
        self.trace = trace
        self.deterministic = deterministic
        # Each query block's first dQ partial is stored, not added, so dQaccum need
        # not be zeroed (Note [dQ store first]); takes the dQ semaphores.
        self.dq_store_first = dq_store_first
        # Launched with programmatic dependent launch (``pdl_start``).
        self.use_pdl = use_pdl
        if tiles is None:
            # The table's masked-warpgroup skip serves the add-only hand-off; the
            # store-first and fold switches ($JAX_FA4_DQ_STORE_FIRST, _DQ_FOLD) build
            # the table's kernel without it.
            tiles = without_masked_wg_conflicts(bwd_tiles(head_dim, causal),
                                                dq_store_first, dq_fold)
        self.tiles = tiles
        t = self.tiles
        self.tile_m, self.tile_n = t.tile_m, t.tile_n
        self.split_kv = t.split_kv
        self.num_mma_wg = 2
        self.num_mma_threads = 128 * self.num_mma_wg
        self.num_threads = 128 + self.num_mma_threads
        if self.tile_n != 64 * self.num_mma_wg:
            raise ValueError("tile_n must be 64 keys per MMA warpgroup")
        if self.tile_m not in (64, 80, 128):
            raise ValueError(f"tile_m must be 64, 80 or 128, got {self.tile_m}")
        # dQ = dS K (tile_m x d): split along m when there are two 64-row atoms,
        # else along d. A tile_m that is no multiple of 64 computes dQ^T = K^T dS^T
        # instead (M = d, split along d; FA3's dQ_swapAB), which needs d = 128.
        # Its SMEM dS is then (tile_m, tile_n), keys contiguous: 256-byte rows take
        # the 128-byte swizzle, where 80 queries contiguous (160 bytes) got only 32.
        self.dq_swap = self.tile_m % 64 != 0
        if self.dq_swap and self.head_dim != 64 * self.num_mma_wg:
            raise ValueError(f"tile_m {self.tile_m} needs head_dim 128, got {head_dim}")
        self.wg_m_dq = 1 if self.dq_swap else self.tile_m // 64
        if deterministic and not t.dq_flat:
            raise ValueError("the deterministic backward orders the flat dQ reduces "
                             "(BwdTiles.dq_flat)")
        # The deterministic backward has its own launch order (det_key_block).
        self.lpt = t.lpt and causal and not deterministic
        self.persistent = t.persistent
        self.lpt_host_div = self.lpt and t.lpt_host_div and not t.persistent
        if t.persistent and trace:
            raise ValueError("the CTA timeline (trace) records one CTA per tile: not with "
                             "the persistent backward")
        if t.persistent and (deterministic or not t.dq_flat or t.split_kv):
            raise ValueError("the persistent backward needs dq_flat, one K/V mbarrier "
                             "(split_kv off) and the non-deterministic mode")
        if dq_store_first and (not t.dq_flat or t.persistent):
            raise ValueError("dq_store_first needs the flat dQ accumulator (BwdTiles.dq_flat) "
                             "and a CTA per key block (BwdTiles.persistent off)")
        # BwdTiles.rotate_walk: non-causal, not deterministic (whose add order is fixed
        # per query block), one CTA per key block.
        self.rotate_walk = t.rotate_walk and not (causal or deterministic or t.persistent)
        # Store first only up to this query length (Note [dQ store first by length]);
        # 0: everywhere. The argument overrides BwdTiles.dq_first_max_seqlen_q.
        self.dq_first_max_sq = (t.dq_first_max_seqlen_q if dq_first_max_seqlen_q is None
                                else dq_first_max_seqlen_q)
        if self.dq_first_max_sq < 0:
            raise ValueError(f"dq_first_max_seqlen_q must be >= 0, got {self.dq_first_max_sq}")
        if self.dq_first_max_sq and (deterministic or not dq_store_first):
            raise ValueError("dq_first_max_seqlen_q serves the non-deterministic store-first "
                             "backward")
        # Two dQ buffers: BwdTiles.dq_double for the store-first kernel (whose add
        # path, by length, uses them too), dq_double_add for the add-only one; never
        # deterministic.
        # The last key block to add into a query block writes dQ (Note [dQ fold]);
        # the dQ warp hands on item it - dq_fold after issuing item it's adds.
        self.dq_fold = int(dq_fold)
        if not 0 <= self.dq_fold <= 8:
            raise ValueError(f"dq_fold must be 0 (off) or a lag from 1 to 8, got {dq_fold}")
        if dq_fold and (deterministic or dq_store_first or not t.dq_flat or t.persistent
                        or self.dq_swap or self._dq_part()[1] != 64):
            raise ValueError("dq_fold needs the non-deterministic add-only backward with "
                             "the flat dQ accumulator (BwdTiles.dq_flat, tile_m 64 or 128) "
                             "and a CTA per key block (BwdTiles.persistent off)")
        skip_ok, carry_ok = masked_wg_buildable(t, dq_store_first, dq_fold)
        if t.carry_coords and not carry_ok:
            raise ValueError("carry_coords needs the plain walk (rotate_walk and persistent "
                             "off)")
        if t.skip_masked_wg and not skip_ok:
            raise ValueError("skip_masked_wg needs the add-only flat dQ hand-off through one "
                             "SMEM buffer (no dq_red, dq_double_add, store first or fold), "
                             "K and V on one mbarrier, a CTA per key block and two or more "
                             "Q / dO stages")
        # Note [dQ from registers]: the MMA threads reduce-add dQ themselves.
        self.dq_red = t.dq_red
        if t.dq_red and (deterministic or dq_store_first or dq_fold or not t.dq_flat
                         or t.persistent or t.dq_double_add):
            raise ValueError("dq_red needs the non-deterministic add-only backward with the "
                             "flat dQ accumulator (BwdTiles.dq_flat), one dQ buffer's hand-off "
                             "replaced (dq_double_add off), no fold and a CTA per key block "
                             "(BwdTiles.persistent off)")
        two = (t.dq_double and dq_store_first) or (t.dq_double_add and not dq_store_first)
        self.dq_bufs = 2 if two and not deterministic and t.dq_flat else 1
        self.num_sms = sm_count() if t.persistent else 0
        if t.stats_by_thread and self.tile_m not in (64, 128):
            raise ValueError(f"stats_by_thread needs tile_m 64 or 128, got {self.tile_m}")
        if t.stats_shuffle and (t.stats_by_thread or self.tile_m not in (64, 128)):
            raise ValueError("stats_shuffle needs the row order (stats_by_thread off) and "
                             f"tile_m 64 or 128, got tile_m {self.tile_m}")
        log.debug("FlashBwdSm90 %s d=%d causal=%s tiles=%s", dtype, head_dim, causal, t)

    # ------------------------------------------------------------------ host side
    def _tiled_mmas(self):
        d, dv = self.head_dim, self.head_dim_v
        tm = self.tile_m
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        wg = self.num_mma_wg
        # S^T = K Q^T and dP^T = V dO^T: A (tile_n x d) and B (tile_m x d), K-major.
        mma_sdp = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, (wg, 1, 1), (64, tm))
        # dK += dS^T Q, dV += P^T dO: A from registers, B = Q^T / dO^T MN-major.
        mma_dk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, MN, Float32, (wg, 1, 1), (64, d),
            a_source=warpgroup.OperandSource.RMEM)
        mma_dv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, MN, Float32, (wg, 1, 1), (64, dv),
            a_source=warpgroup.OperandSource.RMEM)
        # dQ = dS K: A = dS (tile_m x tile_n) MN-major (SMEM holds dS^T), B = K^T
        # (d x tile_n) MN-major; with dq_swap dQ^T = K^T dS^T: A = K^T MN-major,
        # B = dS K-major, warpgroup w owning dQ columns [64w, 64w + 64).
        return mma_sdp, mma_dk, mma_dv, dq_tiled_mma(self.dtype, tm, d, wg)

    def wg_all_masked(self, m_block, n_block, wg_idx, key_limit):
        """Note [Masked warpgroup]: whether every key of MMA warpgroup ``wg_idx``'s
        64 (rows 64 wg_idx.. of S^T in key block ``n_block``) is masked for every
        query of ``m_block``: at or past seqlen_k (``key_limit`` keys of the block
        are valid) or, causal, after the block's last query."""
        first = 64 * wg_idx
        masked = key_limit <= first
        if const_expr(self.causal):
            masked = masked | (n_block * self.tile_n + first >= (m_block + 1) * self.tile_m)
        return masked

    def _dq_part(self) -> tuple[int, int]:
        """The (rows, cols) of dQ each MMA warpgroup computes."""
        wg_n = self.num_mma_wg // self.wg_m_dq
        return self.tile_m // self.wg_m_dq, self.head_dim // wg_n

    def _dq_part_coord(self, wg: int, m_block):
        """Block coordinate of warpgroup ``wg``'s dQ part in (rows, cols) units."""
        if self.wg_m_dq == 2:
            return m_block * 2 + wg, 0
        return m_block, wg

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
        mdK: cute.Tensor,  # (B, Sk, Hkv, D)
        mdV: cute.Tensor,  # (B, Sk, Hkv, Dv)
        mTrace: cute.Tensor | None = None,  # Note [CTA timeline], with trace only
    ):
        if const_expr(self.deterministic or self.dq_store_first):
            raise TypeError("the deterministic and the store-first backward take the dQ "
                            "semaphores: call FlashBwdSm90Deterministic / "
                            "FlashBwdSm90StoreFirst")
        self.launch(stream, mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV, None,
                    mTrace=mTrace)

    @cute.jit
    def launch(self, stream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
               mdO: cute.Tensor, mLSElog2: cute.Tensor, mDpsum: cute.Tensor,
               mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
               mdQsem: cute.Tensor | None, mdQ: cute.Tensor | None = None,
               mTrace: cute.Tensor | None = None):
        """The host side of ``__call__``; mdQsem: (B, Hq, ceil(Sq / tile_m)) int32,
        zero at launch, with the deterministic, the store-first or the folding
        backward, else None; mdQ: (B, Sq, Hq, D), the folding backward's dQ; mTrace:
        Note [CTA timeline], exactly when the kernel was built with ``trace``."""
        if const_expr(self.trace != (mTrace is not None)):
            raise TypeError("a kernel built with trace takes mTrace (Note [CTA timeline]), "
                            "and only such a kernel")
        if const_expr(mTrace is not None and mTrace.element_type != Int32):
            raise TypeError("mTrace must be int32")
        d = self.head_dim
        tm, tn = self.tile_m, self.tile_n
        st = self.tiles.stages_qdo
        mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV = self.operand_views(
            mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV)

        mma_sdp, mma_dk, mma_dv, mma_dq = self._tiled_mmas()

        sQ_layout, sdO_layout, sK_layout, sV_layout, sRow_layout, row_stage = (
            self.load_layouts())
        # dS^T (tile_n x tile_m, queries contiguous), double buffered; with dq_swap
        # dS (tile_m x tile_n, keys contiguous).
        sdS_layout = (sm90_smem_layout(self.dtype, tm, tn, 2) if self.dq_swap
                      else sm90_smem_layout(self.dtype, tn, tm, 2))
        # dQ partial in SMEM: the whole (tile_m, d) tile, or with dq_per_wg one
        # (tile_m / wg_m, d / wg_n) part per warpgroup (stage mode = warpgroup).
        dq_part = self._dq_part()
        sdQ_layout = (sm90_smem_layout(Float32, *dq_part, 2) if self.tiles.dq_per_wg
                      else sm90_smem_layout(Float32, tm, d, None))

        ((tma_Q, gmem_Q), (tma_K, gmem_K), (tma_V, gmem_V), (tma_dO, gmem_dO),
         (tma_LSE, gmem_LSE), (tma_Dpsum, gmem_Dpsum)), bytes_qdo, bytes_kv = self.load_atoms(
            mQ, mK, mV, mdO, mLSElog2, mDpsum, sQ_layout, sdO_layout, sK_layout, sV_layout)
        if const_expr(self.tiles.dq_flat):
            # 1-D bulk reduces from plain addresses: no tensor map.
            tma_dQ, gmem_dQ = None, mdQaccum
        else:
            tma_dQ, gmem_dQ = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), mdQaccum,
                cute.select(sdQ_layout, mode=[0, 1]),
                dq_part if self.tiles.dq_per_wg else (tm, d))
        # dK and dV leave through SMEM (the K and V tiles, free after the walk) by TMA,
        # which also clips the rows past seqlen_k.
        s2g = cpasync.CopyBulkTensorTileS2GOp()
        tma_dK, gmem_dK = cpasync.make_tiled_tma_atom(s2g, mdK, sK_layout, (tn, d))
        tma_dV, gmem_dV = cpasync.make_tiled_tma_atom(s2g, mdV, sV_layout, (tn, self.head_dim_v))

        mr, al = cute.struct.MemRange, cute.struct.Align
        fields = {
            "mbar_qdo": mr[cutlass.Int64, 2 * st],
            "mbar_kv": mr[cutlass.Int64, 4 if self.split_kv else 2],
            "sLSE": al[mr[Float32, row_stage * st], 128],
            "sDpsum": al[mr[Float32, row_stage * st], 128],
            "sQ": al[mr[self.dtype, cute.cosize(sQ_layout)], 1024],
            "sdO": al[mr[self.dtype, cute.cosize(sdO_layout)], 1024],
            "sK": al[mr[self.dtype, cute.cosize(sK_layout)], 1024],
            "sV": al[mr[self.dtype, cute.cosize(sV_layout)], 1024],
            "sdS": al[mr[self.dtype, cute.cosize(sdS_layout)], 1024],
        }
        if const_expr(not self.dq_red):  # Note [dQ from registers]: no SMEM dQ
            fields["sdQ"] = al[mr[Float32, cute.cosize(sdQ_layout) * self.dq_bufs], 1024]
        if const_expr(self.dq_fold):
            # Note [dQ fold]: the job / ring mbarriers and words, the staging tile.
            fields.update({
                "mbar_conv": mr[cutlass.Int64, 3 + 2 * FOLD_RING],
                "conv_job": mr[Int32, 2 + 2 * FOLD_RING],
                "sConv": al[mr[Float32, tm * d // self.conv_pieces], 128],
            })
        SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

        self.check_smem(SharedStorage)
        num_n_blocks = cute.ceil_div(mK.shape[0], tn)
        grid = (num_n_blocks, cute.size(mK.shape[2]), cute.size(mK.shape[3]))
        if const_expr(self.lpt or self.persistent):
            grid = (num_n_blocks * cute.size(mK.shape[2]) * cute.size(mK.shape[3]), 1, 1)
        if const_expr(self.persistent):
            grid = (cutlass.min(grid[0], self.num_sms), 1, 1)
        lpt_divs = None
        if const_expr(self.lpt_host_div):
            lpt_divs = self.lpt_host_divisors(num_n_blocks, mQ, mK)
        self.kernel(
            gmem_Q, gmem_K, gmem_V, gmem_dO, gmem_LSE, gmem_Dpsum, gmem_dQ, gmem_dK, gmem_dV,
            mdQsem, mdQ, lpt_divs, mTrace, tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_Dpsum,
            tma_dQ, tma_dK, tma_dV,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout, sRow_layout,
            mma_sdp, mma_dk, mma_dv, mma_dq, bytes_qdo, bytes_kv, SharedStorage,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
            use_pdl=self.use_pdl,
        )

    def tile_coord(self, t, num_n_blocks, mQ: cute.Tensor, mK: cute.Tensor):
        """(n_block, kv head, batch) of tile t of the persistent walk: the LPT order,
        or key blocks fastest, then heads, then batches (the per-head grid's)."""
        if const_expr(self.lpt):
            return self.lpt_coord(t, num_n_blocks, mQ, mK)
        hb = t // num_n_blocks
        return t - hb * num_n_blocks, hb % mK.shape[2], hb // mK.shape[2]

    def _lpt_q_block_bytes(self) -> int:
        """What one query block of one q head keeps in L2 in the LPT order: Q, dO,
        the fp32 dQ partials and the two row statistics."""
        return self.tile_m * ((self.head_dim + self.head_dim_v) * (self.dtype.width // 8)
                              + 4 * self.head_dim + 8)

    def lpt_coord(self, t, num_n_blocks, mQ: cute.Tensor, mK: cute.Tensor):
        """(n_block, kv head, batch) of CTA t in the LPT order (``BwdTiles.lpt``)."""
        num_kv_heads = mK.shape[2]
        group = mQ.shape[2] // num_kv_heads
        section = lpt_section_size(
            cute.ceil_div(mQ.shape[0], self.tile_m) * group, 1, self._lpt_q_block_bytes(),
            lambda c, a, b: cutlass.select_(c, cutlass.Int32(a), b), cutlass.Int32(1))
        return lpt_key_block(t, num_n_blocks, num_kv_heads, num_kv_heads * mK.shape[3],
                             section, cutlass.min)

    def lpt_host_divisors(self, num_n_blocks, mQ: cute.Tensor, mK: cute.Tensor):
        """Host side of ``BwdTiles.lpt_host_div``: ``lpt_divisors`` for this launch
        (TMA views), as fast divisors the kernel takes as arguments."""
        num_kv_heads = mK.shape[2]
        return lpt_divisors(
            num_n_blocks, cute.ceil_div(mQ.shape[0], self.tile_m) * (mQ.shape[2] // num_kv_heads),
            num_kv_heads, mK.shape[3], self._lpt_q_block_bytes(),
            cute.fast_divmod_create_divisor_v2,
            lambda c, a, b: cutlass.select_(c, cutlass.Int32(a), b), cutlass.Int32(1),
            cutlass.max)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA view (Sq, D, Hq, B)
        mK: cute.Tensor,  # TMA view (Sk, D, Hkv, B)
        mV: cute.Tensor,  # TMA view (Sk, Dv, Hkv, B)
        mdO: cute.Tensor,  # TMA view (Sq, Dv, Hq, B)
        mLSElog2: cute.Tensor,  # TMA view (Sq_pad, Hq, B) f32
        mDpsum: cute.Tensor,  # TMA view (Sq_pad, Hq, B) f32
        mdQaccum: cute.Tensor,  # (Sq_pad, D, Hq, B) f32: TMA view, or plain if dq_flat
        mdK: cute.Tensor,  # TMA view (Sk, D, Hkv, B)
        mdV: cute.Tensor,  # TMA view (Sk, Dv, Hkv, B)
        mdQsem: cute.Tensor | None,  # (B, Hq, num_m) int32 (deterministic, store first, fold)
        mdQ: cute.Tensor | None,  # (B, Sq, Hq, D) out (fold)
        lpt_divs: tuple | None,  # lpt_host_divisors (BwdTiles.lpt_host_div only)
        mTrace: cute.Tensor | None,  # (CTAs, TRACE_COLS) int32, Note [CTA timeline]
        tma_Q: cute.CopyAtom,
        tma_K: cute.CopyAtom,
        tma_V: cute.CopyAtom,
        tma_dO: cute.CopyAtom,
        tma_LSE: cute.CopyAtom,
        tma_Dpsum: cute.CopyAtom,
        tma_dQ: cute.CopyAtom | None,  # None with dq_flat
        tma_dK: cute.CopyAtom,
        tma_dV: cute.CopyAtom,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.ComposedLayout,
        sRow_layout: cute.Layout,
        mma_sdp: cute.TiledMma,
        mma_dk: cute.TiledMma,
        mma_dv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        bytes_qdo: cutlass.Constexpr[int],
        bytes_kv: cutlass.Constexpr[int],
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head_kv, batch = cute.arch.block_idx()
        trace_row = None
        if const_expr(self.trace):
            trace_row = self.trace_start(mTrace, tidx)
        num_n_blocks = cute.ceil_div(mK.shape[0], self.tile_n)
        if const_expr(self.lpt_host_div):
            n_block, head_kv, batch = lpt_key_block_fast(
                n_block, *lpt_divs, lambda c, a, b: cutlass.select_(c, a, b))
        elif const_expr(self.lpt and not self.persistent):
            n_block, head_kv, batch = self.lpt_coord(n_block, num_n_blocks, mQ, mK)
        if const_expr(self.deterministic):
            # Causal, key blocks launch last first: each waits only on higher key
            # blocks (store_dq_flat), which have then launched before it.
            n_block = det_key_block(n_block, num_n_blocks, self.causal)

        if warp_idx == 0:
            for atom in (tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_Dpsum, tma_dQ, tma_dK, tma_dV):
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        conv = None
        if const_expr(self.dq_fold):
            # Note [dQ fold]: (staging tile, [full, empty] mbarriers, job words). The
            # pipelines' creation below fences and syncs after these inits.
            conv = (storage.sConv.get_tensor(
                        cute.make_layout(self.tile_m * self.head_dim // self.conv_pieces)),
                    storage.mbar_conv.data_ptr(),
                    storage.conv_job.get_tensor(cute.make_layout(2 + 2 * FOLD_RING)))
            if tidx == 0:
                cute.arch.mbarrier_init(conv[1], 1)  # job posted
                cute.arch.mbarrier_init(conv[1] + 1, self.conv_threads)  # job done
                cute.arch.mbarrier_init(conv[1] + 2, 1)  # staged piece landed
                for slot in cutlass.range_constexpr(FOLD_RING):
                    cute.arch.mbarrier_init(conv[1] + 3 + slot, 1)  # item landed
                    cute.arch.mbarrier_init(conv[1] + 3 + FOLD_RING + slot, 1)  # slot free

        pipe_qdo, pipe_kv = self.make_pipelines(storage, bytes_qdo, bytes_kv)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        if const_expr(self.dq_red):
            sdQ = None
        elif const_expr(self.tiles.dq_flat):
            sdQ = storage.sdQ.get_tensor(cute.make_layout(cute.cosize(sdQ_layout)
                                                          * self.dq_bufs))
        else:
            sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
        sLSE = storage.sLSE.get_tensor(sRow_layout)
        sDpsum = storage.sDpsum.get_tensor(sRow_layout)

        # Everything above only set up SMEM and barriers: no global memory yet.
        pdl_start(self.use_pdl)
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        if const_expr(self.persistent):
            self.persistent_roles(
                warp_idx, tidx, num_n_blocks, mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum,
                mdK, mdV, sQ, sK, sV, sdO, sdS, sdQ, sLSE, sDpsum, tma_Q, tma_K, tma_V,
                tma_dO, tma_LSE, tma_Dpsum, tma_dK, tma_dV, mma_sdp, mma_dk, mma_dv, mma_dq,
                pipe_qdo, pipe_kv, seqlen_q, seqlen_k)
            return
        group, m_block_min, num_m, num_iters = self.work_list(n_block, mQ, mK)
        if const_expr(self.rotate_walk):
            self.walk_rot = (n_block * num_iters // num_n_blocks, num_iters)
        if const_expr(self.trace):
            if tidx == 0:
                for c, v in enumerate((n_block, head_kv, batch, num_iters)):
                    mTrace[trace_row, 2 + c] = Int32(v)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.tiles.regs_producer)
            if warp_idx == 0:
                self.load(mQ, mK, mV, mdO, mLSElog2, mDpsum, sQ, sK, sV, sdO, sLSE, sDpsum,
                          tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_Dpsum,
                          pipe_qdo, pipe_kv, n_block, head_kv, batch, group,
                          m_block_min, num_m, num_iters)
            if warp_idx == 1:
                if const_expr(self.dq_fold):
                    self.store_dq_flat_fold(mdQaccum, sdQ, conv, head_kv, batch, group,
                                            m_block_min, num_m, num_iters)
                elif const_expr(not self.dq_red):
                    self.store_dq(mdQaccum, mdQsem, sdQ, tma_dQ, n_block, num_n_blocks,
                                  head_kv, batch, group, m_block_min, num_m, num_iters)
            if const_expr(self.dq_fold):
                if warp_idx == 2:
                    if cute.arch.lane_idx() == 0:
                        self.dq_fold_counter(mdQsem, conv, batch, num_n_blocks)
                if warp_idx == 3:
                    self.dq_convert(mdQaccum, mdQ, conv, batch, seqlen_q, tidx - 96)
        else:
            cute.arch.setmaxregister_increase(self.tiles.regs_mma)
            self.mma(mdK, mdV, tma_dK, tma_dV, sQ, sK, sV, sdO, sdS, sdQ, sLSE, sDpsum,
                     mma_sdp, mma_dk, mma_dv, mma_dq, pipe_qdo, pipe_kv,
                     tidx - 128, n_block, head_kv, batch, seqlen_q, seqlen_k,
                     m_block_min, num_m, num_iters,
                     dq_red=(mdQaccum, group) if const_expr(self.dq_red) else None)
        if const_expr(self.trace):
            if cute.arch.lane_idx() == 0:
                lo, hi = global_timer_halves()
                mTrace[trace_row, TRACE_WARP_END + 2 * warp_idx] = lo
                mTrace[trace_row, TRACE_WARP_END + 2 * warp_idx + 1] = hi

    @cute.jit
    def trace_start(self, mTrace, tidx):
        """Note [CTA timeline]: this CTA's row (its launch index), and from thread 0
        the SM id and the start time. Before anything else in the kernel."""
        bx, by, bz = cute.arch.block_idx()
        gx, gy, _ = cute.arch.grid_dim()
        row = bx + gx * (by + gy * bz)
        if tidx == 0:
            lo, hi = global_timer_halves()
            mTrace[row, 0] = sm_id()
            mTrace[row, 6] = lo
            mTrace[row, 7] = hi
        return row

    @cute.jit
    def persistent_roles(self, warp_idx, tidx, num_n_blocks, mQ, mK, mV, mdO, mLSElog2,
                         mDpsum, mdQaccum, mdK, mdV, sQ, sK, sV, sdO, sdS, sdQ, sLSE, sDpsum,
                         tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_Dpsum, tma_dK, tma_dV,
                         mma_sdp, mma_dk, mma_dv, mma_dq, pipe_qdo, pipe_kv, seqlen_q,
                         seqlen_k):
        """BwdTiles.persistent: every role walks the CTA's tiles (t = blockIdx.x,
        + gridDim.x, ...) with its pipeline states carried from tile to tile."""
        tile0 = cute.arch.block_idx()[0]
        step = cute.arch.grid_dim()[0]
        num_tiles = num_n_blocks * mK.shape[2] * mK.shape[3]
        producer, consumer = pipeline.PipelineUserType.Producer, pipeline.PipelineUserType.Consumer
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.tiles.regs_producer)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(producer, self.tiles.stages_qdo)
                for t in cutlass.range(tile0, num_tiles, step, unroll=1):
                    n_block, head_kv, batch = self.tile_coord(t, num_n_blocks, mQ, mK)
                    group, m_block_min, num_m, num_iters = self.work_list(n_block, mQ, mK)
                    state = self.load(
                        mQ, mK, mV, mdO, mLSElog2, mDpsum, sQ, sK, sV, sdO, sLSE, sDpsum,
                        tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_Dpsum, pipe_qdo, pipe_kv,
                        n_block, head_kv, batch, group, m_block_min, num_m, num_iters,
                        state=state, kv_round=(t - tile0) // step)
            if warp_idx == 1:
                for t in cutlass.range(tile0, num_tiles, step, unroll=1):
                    n_block, head_kv, batch = self.tile_coord(t, num_n_blocks, mQ, mK)
                    group, m_block_min, num_m, num_iters = self.work_list(n_block, mQ, mK)
                    self.store_dq_flat(mdQaccum, None, sdQ, n_block, num_n_blocks, head_kv,
                                       batch, group, m_block_min, num_m, num_iters,
                                       final_wait=False)
                # The reduce-adds must land before the kernel ends.
                if cute.arch.lane_idx() == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
        else:
            cute.arch.setmaxregister_increase(self.tiles.regs_mma)
            state = pipeline.make_pipeline_state(consumer, self.tiles.stages_qdo)
            for t in cutlass.range(tile0, num_tiles, step, unroll=1):
                n_block, head_kv, batch = self.tile_coord(t, num_n_blocks, mQ, mK)
                group, m_block_min, num_m, num_iters = self.work_list(n_block, mQ, mK)
                kv_round = (t - tile0) // step
                state = self.mma(
                    mdK, mdV, tma_dK, tma_dV, sQ, sK, sV, sdO, sdS, sdQ, sLSE, sDpsum,
                    mma_sdp, mma_dk, mma_dv, mma_dq, pipe_qdo, pipe_kv,
                    tidx - 128, n_block, head_kv, batch, seqlen_q, seqlen_k,
                    m_block_min, num_m, num_iters, state=state,
                    kv_state=pipeline.PipelineState(1, kv_round, Int32(0), kv_round % 2))

    @cute.jit
    def store_dq(self, mdQaccum, mdQsem, sdQ, tma_dQ, n_block, num_n_blocks, head_kv, batch,
                 group, m_block_min, num_m, num_iters):
        """Warp 1: reduce-add each dQ partial tile from SMEM into mdQaccum (fp32)."""
        if const_expr(self.dq_store_first and not self.deterministic
                      and self.dq_first_max_sq > 0):
            # Note [dQ store first by length]: the preprocess zeroed dQaccum exactly
            # where this test fails.
            if dq_first_by_length(mdQsem.shape[2], self.tile_m, self.dq_first_max_sq):
                self.store_dq_flat_first(mdQaccum, mdQsem, sdQ, head_kv, batch, group,
                                         m_block_min, num_m, num_iters)
            else:
                self.store_dq_flat(mdQaccum, None, sdQ, n_block, num_n_blocks, head_kv,
                                   batch, group, m_block_min, num_m, num_iters)
        elif const_expr(self.dq_store_first and not self.deterministic):
            self.store_dq_flat_first(mdQaccum, mdQsem, sdQ, head_kv, batch, group,
                                     m_block_min, num_m, num_iters)
        elif const_expr(self.tiles.dq_flat):
            self.store_dq_flat(mdQaccum, mdQsem, sdQ, n_block, num_n_blocks, head_kv, batch,
                               group, m_block_min, num_m, num_iters)
        elif const_expr(not self.tiles.dq_per_wg):
            self.store_dq_joint(mdQaccum, sdQ, tma_dQ, head_kv, batch, group, m_block_min,
                                num_m, num_iters)
        else:
            nthr = 128 + 32
            for it in cutlass.range(num_iters, unroll=1):
                head_q, m_block = self.work_item(it, head_kv, group, m_block_min, num_m)
                gdQ = cute.local_tile(mdQaccum[None, None, head_q, batch], self._dq_part(),
                                      (None, None))
                tsdQ, tgdQ = tma_tile_partition(tma_dQ, sdQ, gdQ)
                # Each part is free (its previous reduce has read it): let its
                # warpgroup write the next one. Warpgroups are served in order but
                # never wait for each other.
                for w in cutlass.range_constexpr(self.num_mma_wg):
                    cute.arch.barrier_arrive(barrier_id=self.bar_dq_empty + w,
                                             number_of_threads=nthr)
                for w in cutlass.range_constexpr(self.num_mma_wg):
                    cute.arch.barrier(barrier_id=self.bar_dq_full + w, number_of_threads=nthr)
                    rb, cb = self._dq_part_coord(w, m_block)
                    cute.copy(tma_dQ, tsdQ[None, w], tgdQ[None, rb, cb])
                    cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def store_dq_flat(self, mdQaccum, mdQsem, sdQ, n_block, num_n_blocks, head_kv, batch,
                      group, m_block_min, num_m, num_iters,
                      final_wait: cutlass.Constexpr[bool] = True):
        """Warp 1, dq_flat: one 1-D bulk reduce-add per part (per warpgroup with
        dq_per_wg, else the whole tile) from SMEM into the query block's tile_m * d
        floats of mdQaccum, in flat order (Note [Flat dQ accumulator]).

        Deterministic: the query block's semaphore counts the key blocks whose
        partials have landed; this CTA adds its partial when the count reaches its
        rank (``det_add_rank``: ascending key blocks, causal descending), waits for
        the add to complete, then counts itself. CTAs wait only on blocks that
        launch earlier (``det_key_block``: the causal grid runs the key blocks in
        reverse), so the wait cannot deadlock."""
        tm, d = self.tile_m, self.head_dim
        n_parts = self.num_mma_wg if const_expr(self.tiles.dq_per_wg) else 1
        part = tm * d // n_parts
        nthr = self.num_mma_threads // n_parts + 32
        lane = cute.arch.lane_idx()
        # Two buffers (``dq_bufs``, never deterministic): item it in buffer it % 2,
        # with the barrier pairs of ``dq_handoff_double``.
        two = const_expr(self.dq_bufs == 2 and not self.deterministic)
        self.dq_bufs_open(two, num_iters, n_parts, nthr)
        for it in cutlass.range(num_iters, unroll=1):
            head_q, m_block = self.work_item(it, head_kv, group, m_block_min, num_m)
            gdQ = cute.local_tile(mdQaccum[None, None, head_q, batch], (tm, d), (m_block, 0))
            bar_off, src = self.dq_buf_turn(two, it, num_iters, n_parts, nthr, sdQ)
            if const_expr(self.deterministic):
                sem_ptr = mdQsem.iterator + cute.crd2idx((batch, head_q, m_block),
                                                         mdQsem.layout)
                rank = det_add_rank(m_block, n_block, num_n_blocks, tm, self.tile_n,
                                    self.causal, cutlass.min)
                if lane == 0:
                    # The bulk copies below come after the acquire.
                    semaphore_wait(sem_ptr, rank)
                for w in cutlass.range_constexpr(n_parts):
                    cute.arch.barrier(barrier_id=self.bar_dq_full + w, number_of_threads=nthr)
                    if lane == 0:
                        if const_expr(self.dq_store_first):
                            if rank == 0:
                                bulk_store(gdQ.iterator + w * part, sdQ.iterator + w * part,
                                           part * 4)
                            else:
                                bulk_reduce_add_f32(gdQ.iterator + w * part,
                                                    sdQ.iterator + w * part, part * 4)
                        else:
                            bulk_reduce_add_f32(gdQ.iterator + w * part,
                                                sdQ.iterator + w * part, part * 4)
                        cute.arch.cp_async_bulk_commit_group()
                if lane == 0:
                    # The copies land before the next key block may add.
                    semaphore_release_after_bulk(sem_ptr)
            else:
                self.dq_parts_out(False, gdQ, src, bar_off, n_parts, part, nthr, lane)
                if lane == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
        if const_expr(final_wait):
            # The reduce-adds must land before the kernel ends.
            if lane == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def store_dq_flat_first(self, mdQaccum, mdQsem, sdQ, head_kv, batch, group, m_block_min,
                            num_m, num_iters):
        """Warp 1, dq_flat with ``dq_store_first``, not deterministic (Note [dQ store
        first]): per query block, a ticket from its semaphore; ticket 0 stores the
        partial, every other ticket waits until that store has landed and adds.

        The ticket is taken before the partial is ready (it needs no data), so its
        round trip overlaps the GEMMs. Ticket 0 lets the MMA warpgroups write the
        next partial once the store has read SMEM, and publishes the store
        (``DQ_STORED``, after it has landed) at the top of the next item, or after
        the walk. With ``BwdTiles.dq_double`` item it is in buffer it % 2, and the
        MMA warpgroups may write item it + 1 while this warp waits on item it."""
        tm, d = self.tile_m, self.head_dim
        n_parts = self.num_mma_wg if const_expr(self.tiles.dq_per_wg) else 1
        part = tm * d // n_parts
        nthr = self.num_mma_threads // n_parts + 32
        two = const_expr(self.dq_bufs == 2)
        lane = cute.arch.lane_idx()
        self.dq_bufs_open(two, num_iters, n_parts, nthr)
        # The query block whose store this warp has yet to publish: (head, block), -1.
        pend_h, pend_m = Int32(0), Int32(-1)
        for it in cutlass.range(num_iters, unroll=1):
            head_q, m_block = self.work_item(it, head_kv, group, m_block_min, num_m)
            gdQ = cute.local_tile(mdQaccum[None, None, head_q, batch], (tm, d), (m_block, 0))
            bar_off, src = self.dq_buf_turn(two, it, num_iters, n_parts, nthr, sdQ)
            if lane == 0:
                if pend_m >= 0:
                    semaphore_release_after_bulk(
                        mdQsem.iterator + cute.crd2idx((batch, pend_h, pend_m), mdQsem.layout),
                        DQ_STORED)
            pend_m = Int32(-1)
            sem_ptr = mdQsem.iterator + cute.crd2idx((batch, head_q, m_block), mdQsem.layout)
            ticket = Int32(0)
            if lane == 0:
                ticket = cute.arch.atomic_add(sem_ptr, Int32(1), sem="relaxed", scope="gpu")
            ticket = cute.arch.shuffle_sync(ticket, 0)
            if ticket == 0:
                self.dq_parts_out(True, gdQ, src, bar_off, n_parts, part, nthr, lane)
                pend_h, pend_m = head_q, m_block
            else:
                if lane == 0:
                    # The reduce-adds below come after the acquire.
                    semaphore_wait_at_least(sem_ptr, DQ_STORED)
                self.dq_parts_out(False, gdQ, src, bar_off, n_parts, part, nthr, lane)
            if lane == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        if lane == 0:
            if pend_m >= 0:
                semaphore_release_after_bulk(
                    mdQsem.iterator + cute.crd2idx((batch, pend_h, pend_m), mdQsem.layout),
                    DQ_STORED)
            # The reduce-adds must land before the kernel ends.
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    # Note [dQ fold]: warp 3 of the producer warpgroup converts.
    conv_threads = 32

    @property
    def conv_pieces(self) -> int:
        """The staging tile holds a query block's fp32 sums in this many pieces: two
        at tile_m 128 (hdim 64), whose 32 KiB more would not fit in SMEM."""
        return 2 if self.tile_m == 128 else 1

    def dq_contributors(self, m_block, num_n_blocks):
        """How many key blocks add a dQ partial into query block ``m_block`` (the
        work lists of ``work_list``; causal: those whose first key is <= the block's
        last query)."""
        if const_expr(self.causal):
            return cutlass.min(num_n_blocks,
                               cute.ceil_div((m_block + 1) * self.tile_m, self.tile_n))
        return num_n_blocks

    @cute.jit
    def store_dq_flat_fold(self, mdQaccum, sdQ, conv, head_kv, batch, group, m_block_min,
                           num_m, num_iters):
        """Warp 1 with ``dq_fold`` (Note [dQ fold]): ``store_dq_flat``'s reduce-adds,
        and once an item's adds have landed (checked ``dq_fold`` items later, so the
        wait overlaps the items between) its query block goes to the counting warp."""
        tm, d = self.tile_m, self.head_dim
        n_parts = self.num_mma_wg if const_expr(self.tiles.dq_per_wg) else 1
        part = tm * d // n_parts
        nthr = self.num_mma_threads // n_parts + 32
        lane = cute.arch.lane_idx()
        lag = self.dq_fold
        two = const_expr(self.dq_bufs == 2)
        # One buffer: it is freed for item it + 1 as soon as the bulk engine has read
        # item it (below), not at the top of item it + 1 as ``dq_buf_turn`` frees it:
        # the landing wait and the post in between would hold the MMA warpgroups'
        # hand-off (Nsight Compute, 1k causal, twenty-fourth session: their dQ store
        # waited on that barrier twice as long as in the table's kernel).
        if const_expr(two):
            self.dq_bufs_open(two, num_iters, n_parts, nthr)
        elif num_iters > 0:
            self.dq_parts_free(n_parts, nthr)
        for it in cutlass.range(num_iters, unroll=1):
            head_q, m_block = self.work_item(it, head_kv, group, m_block_min, num_m)
            gdQ = cute.local_tile(mdQaccum[None, None, head_q, batch], (tm, d), (m_block, 0))
            bar_off, src = Int32(0), sdQ.iterator
            if const_expr(two):
                bar_off, src = self.dq_buf_turn(two, it, num_iters, n_parts, nthr, sdQ)
            self.dq_parts_out(False, gdQ, src, bar_off, n_parts, part, nthr, lane)
            if lane == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            if const_expr(not two):
                if it + 1 < num_iters:
                    self.dq_parts_free(n_parts, nthr)
            if lane == 0:
                if it >= lag:
                    # Items it - lag + 1 .. it (lag * n_parts groups) may still be in
                    # flight; item it - lag has landed once at most that many are.
                    cute.arch.cp_async_bulk_wait_group(lag * n_parts, read=False)
                    done_h, done_m = self.work_item(it - lag, head_kv, group, m_block_min,
                                                    num_m)
                    self.dq_fold_post(conv, done_h, done_m, it - lag)
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)
            for it in cutlass.range(cutlass.max(num_iters - lag, 0), num_iters, unroll=1):
                done_h, done_m = self.work_item(it, head_kv, group, m_block_min, num_m)
                self.dq_fold_post(conv, done_h, done_m, it)
            self.dq_fold_post(conv, Int32(0), Int32(-1), num_iters)  # the end

    @cute.jit
    def dq_fold_post(self, conv, head_q, m_block, n):
        """dQ warp, one lane: the n-th landed item (head_q, m_block) into slot n %
        FOLD_RING of the ring the counting warp reads (once that slot is free);
        ``m_block`` < 0: the end of the walk. No proxy fence: the completion of a
        bulk copy observed through its async-group carries an implicit generic-async
        proxy fence (PTX ISA, "async proxy"), and the mbarrier arrive releases it to
        the counting warp."""
        _, mbar, s_job = conv
        slot = n % FOLD_RING
        if n >= FOLD_RING:
            cute.arch.mbarrier_wait(mbar + 3 + FOLD_RING + slot, (n // FOLD_RING - 1) % 2)
        s_job[2 + 2 * slot] = head_q
        s_job[3 + 2 * slot] = m_block
        cute.arch.mbarrier_arrive(mbar + 3 + slot)

    @cute.jit
    def dq_fold_counter(self, mdQsem, conv, batch, num_n_blocks):
        """Warp 2, one lane, with ``dq_fold`` (Note [dQ fold]): per landed item from
        the dQ warp, one count on its query block's semaphore (acquire-release, GPU
        scope); the count that completes the block posts it to the converting warp
        (once that is done with the previous one). Passes the end on."""
        _, mbar, s_job = conv
        got = Int32(0)
        jobs = Int32(0)
        m_block = Int32(0)
        while m_block >= 0:
            slot = got % FOLD_RING
            cute.arch.mbarrier_wait(mbar + 3 + slot, (got // FOLD_RING) % 2)
            head_q = s_job[2 + 2 * slot]
            m_block = s_job[3 + 2 * slot]
            cute.arch.mbarrier_arrive(mbar + 3 + FOLD_RING + slot)
            got = got + 1
            post = Int32(1)
            if m_block >= 0:
                sem_ptr = mdQsem.iterator + cute.crd2idx((batch, head_q, m_block),
                                                         mdQsem.layout)
                old = cute.arch.atomic_add(sem_ptr, Int32(1), sem="acq_rel", scope="gpu")
                if old + 1 != self.dq_contributors(m_block, num_n_blocks):
                    post = Int32(0)
            if post == 1:
                if jobs > 0:
                    cute.arch.mbarrier_wait(mbar + 1, (jobs - 1) % 2)
                s_job[0] = head_q
                s_job[1] = m_block
                cute.arch.mbarrier_arrive(mbar)
                jobs = jobs + 1

    @cute.jit
    def dq_convert(self, mdQaccum, mdQ, conv, batch, seqlen_q, tid):
        """Warps 2 and 3 with ``dq_fold`` (Note [dQ fold]): per job, the query block's
        fp32 sums bulk-loaded into the staging tile (``conv_pieces`` pieces, one at a
        time), times the softmax scale, rounded to dtype and written to dQ (B, Sq,
        Hq, D) as 32-bit stores, rows past seqlen_q skipped. SMEM reads are 128-bit,
        consecutive threads on consecutive 16 bytes (the flat order: no conflicts)."""
        s_conv, mbar, s_job = conv
        tm, d = self.tile_m, self.head_dim
        wg_m = self.wg_m_dq
        n_cols = self._dq_part()[1]  # N of Note [Flat dQ accumulator]
        nt = self.conv_threads
        pieces = self.conv_pieces
        piece_bytes = tm * d * 4 // pieces
        k_per_piece = tm * d // (4 * nt * pieces)
        s2r = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128),
            cute.make_layout(nt), cute.make_layout(4))
        tS = s2r.get_slice(tid).partition_S(s_conv)
        # Chunk c = nt k + tid holds MMA thread t = c % 128's registers 4 q .. 4 q + 3
        # of warpgroup w: rows r, r + 8 and columns col, col + 1 (Note [Flat dQ
        # accumulator]). The tid-dependent part of (r, col):
        row0 = 16 * (tid // 32) + (tid % 32) // 4
        col0 = 2 * (tid % 4)
        s_row, s_col = mdQ.layout.stride[1], mdQ.layout.stride[3]
        sc = self.softmax_scale
        job_phase = Int32(0)
        data_phase = Int32(0)
        m_block = Int32(0)
        while m_block >= 0:
            cute.arch.mbarrier_wait(mbar, job_phase)
            job_phase = job_phase ^ 1
            head_q = s_job[0]
            m_block = s_job[1]
            if m_block >= 0:
                src = cute.local_tile(mdQaccum[None, None, head_q, batch], (tm, d),
                                      (m_block, 0)).iterator
                rows_left = seqlen_q - m_block * tm - row0
                base = mdQ.iterator + cute.crd2idx((batch, m_block * tm + row0, head_q, col0),
                                                   mdQ.layout)
                for p in cutlass.range_constexpr(pieces):
                    if const_expr(p > 0):  # every lane has read the previous piece
                        cute.arch.fence_view_async_shared()
                        cute.arch.sync_warp()
                    if tid == 0:
                        cute.arch.mbarrier_arrive_and_expect_tx(mbar + 2, piece_bytes)
                        # The counting warp's acquire (its semaphore count, then the
                        # job mbarrier) orders every CTA's reduce-adds before this
                        # (async proxy) read.
                        cute.arch.fence_proxy("async.global")
                        bulk_load_g2s(s_conv.iterator, src + p * (piece_bytes // 4),
                                      piece_bytes, mbar + 2)
                    cute.arch.mbarrier_wait(mbar + 2, data_phase)
                    data_phase = data_phase ^ 1
                    # Chunk kk = 4 j + g of the piece: rows r, r + 8 with r = r_base +
                    # 16 g, columns 8 j, 8 j + 1 (plus row0, col0). One row pair per
                    # (run-time) g keeps two row pointers live, not sixteen.
                    r_base = 64 * (((p * k_per_piece * nt) // (16 * n_cols)) % wg_m)
                    for g in cutlass.range(4, unroll=1):
                        r = r_base + 16 * g
                        p_top = base + r * s_row
                        p_bot = p_top + 8 * s_row
                        top_ok = r < rows_left
                        bot_ok = r + 8 < rows_left
                        for j in cutlass.range_constexpr(k_per_piece // 4):
                            frag = cute.make_rmem_tensor((4,), Float32)
                            cute.copy(s2r, tS[None, 4 * j + g], frag)
                            top = pack_f32x2(frag[0] * sc, frag[1] * sc, self.dtype)
                            bot = pack_f32x2(frag[2] * sc, frag[3] * sc, self.dtype)
                            if top_ok:
                                st_global_b32(p_top + 8 * j * s_col, top)
                            if bot_ok:
                                st_global_b32(p_bot + 8 * j * s_col, bot)
                # The next job's bulk load writes the tile these reads came from.
                cute.arch.fence_view_async_shared()
                cute.arch.mbarrier_arrive(mbar + 1)

    # BwdTiles.dq_double: buffer b's barrier pair is (bar_dq_full, bar_dq_empty)
    # + dq_buf_bar * b, per warpgroup part as with one buffer (IDs 6-9 for b = 1).
    dq_buf_bar = 4

    @cute.jit
    def dq_parts_out(self, store: cutlass.Constexpr[bool], gdQ, src, bar_off, n_parts: int,
                     part: int, nthr: int, lane):
        """dQ warp: as each part of the partial is in SMEM (its full barrier), one
        1-D bulk copy of it to the query block's flat tile, a plain store (``store``,
        the first partial of Note [dQ store first]) or a reduce-add; one lane issues
        and commits."""
        for w in cutlass.range_constexpr(n_parts):
            cute.arch.barrier(barrier_id=self.bar_dq_full + bar_off + w, number_of_threads=nthr)
            if lane == 0:
                if const_expr(store):
                    bulk_store(gdQ.iterator + w * part, src + w * part, part * 4)
                else:
                    bulk_reduce_add_f32(gdQ.iterator + w * part, src + w * part, part * 4)
                cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def dq_parts_free(self, n_parts: int, nthr: int):
        """dQ warp, one buffer: each part may be written again (its bulk copy has
        read it)."""
        for w in cutlass.range_constexpr(n_parts):
            cute.arch.barrier_arrive(barrier_id=self.bar_dq_empty + w, number_of_threads=nthr)

    @cute.jit
    def dq_bufs_open(self, two: cutlass.Constexpr[bool], num_iters, n_parts: int, nthr: int):
        """dQ warp, before the walk, with two buffers: buffer 0 is free for item 0."""
        if const_expr(two):
            if num_iters > 0:
                for w in cutlass.range_constexpr(n_parts):
                    cute.arch.barrier_arrive(barrier_id=self.bar_dq_empty + w,
                                             number_of_threads=nthr)

    @cute.jit
    def dq_buf_turn(self, two: cutlass.Constexpr[bool], it, num_iters, n_parts: int,
                    nthr: int, sdQ):
        """dQ warp, top of item it: lets the MMA warpgroups write the next partial
        and returns item it's (barrier-id offset, SMEM source). One buffer: each part
        is free again (its previous bulk copy has read it); parts are served in
        order and their writers never wait for each other. Two: item it is in
        buffer it % 2; the other held item it - 1, which the bulk engine has read
        (the wait at the end of that item), so item it + 1 may go there."""
        bar_off = Int32(0)
        src = sdQ.iterator
        if const_expr(two):
            if it + 1 < num_iters:
                nxt = self.dq_buf_bar * ((it + 1) % 2)
                for w in cutlass.range_constexpr(n_parts):
                    cute.arch.barrier_arrive(barrier_id=self.bar_dq_empty + nxt + w,
                                             number_of_threads=nthr)
            bar_off = self.dq_buf_bar * (it % 2)
            src = sdQ.iterator + (it % 2) * (self.tile_m * self.head_dim)
        else:
            self.dq_parts_free(n_parts, nthr)
        return bar_off, src

    @cute.jit
    def dq_handoff_single(self, r2s_dq, acc_dQ, tdQsdQ, dq_bar_off, dq_threads):
        """The MMA side of the dQ hand-off through one SMEM buffer: wait until the
        dQ warp's reduce has read it, write this thread's registers (flat order with
        dq_flat), make them visible to the bulk engine, signal the dQ warp."""
        cute.arch.barrier(barrier_id=self.bar_dq_empty + dq_bar_off,
                          number_of_threads=dq_threads)
        if const_expr(self.tiles.dq_flat):
            cute.copy(r2s_dq, cute.make_tensor(acc_dQ.iterator, cute.make_layout(tdQsdQ.shape)),
                      tdQsdQ)
        else:
            cute.autovec_copy(acc_dQ, tdQsdQ)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=self.bar_dq_full + dq_bar_off,
                                 number_of_threads=dq_threads)

    @cute.jit
    def dq_handoff_double(self, r2s_dq, acc_dQ, tdQsdQ_bufs, buf, dq_bar_off, dq_threads):
        """The MMA side of the dQ hand-off with two buffers: this item's buffer."""
        acc = cute.make_tensor(acc_dQ.iterator, cute.make_layout(tdQsdQ_bufs[0].shape))
        if buf == 0:
            cute.arch.barrier(barrier_id=self.bar_dq_empty + dq_bar_off,
                              number_of_threads=dq_threads)
            cute.copy(r2s_dq, acc, tdQsdQ_bufs[0])
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=self.bar_dq_full + dq_bar_off,
                                     number_of_threads=dq_threads)
        else:
            cute.arch.barrier(barrier_id=self.bar_dq_empty + self.dq_buf_bar + dq_bar_off,
                              number_of_threads=dq_threads)
            cute.copy(r2s_dq, acc, tdQsdQ_bufs[1])
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=self.bar_dq_full + self.dq_buf_bar + dq_bar_off,
                                     number_of_threads=dq_threads)

    @cute.jit
    def mma(self, mdK, mdV, tma_dK, tma_dV, sQ, sK, sV, sdO, sdS, sdQ, sLSE, sDpsum,
            mma_sdp, mma_dk, mma_dv, mma_dq, pipe_qdo, pipe_kv,
            tidx, n_block, head_kv, batch, seqlen_q, seqlen_k,
            m_block_min, num_m, num_iters, state=None, kv_state=None, dq_red=None):
        """MMA warpgroups: all GEMMs and the pointwise math; dK/dV epilogue. The
        persistent walk passes its Q/dO consumer state (returned, advanced) and the
        tile's K/V consumer state: K and V are then waited for even with no work
        items and released once the dK / dV stores have read them. ``dq_red``:
        (mdQaccum, GQA group), into which the threads reduce-add dQ themselves
        (Note [dQ from registers])."""
        tm, tn = self.tile_m, self.tile_n
        d, dv = self.head_dim, self.head_dim_v
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        wg_slice = wg_idx * 128
        scale_log2 = self.softmax_scale * LOG2_E

        # wgmma A/B operands are partitioned per warpgroup; C per thread.
        thr_sdp = mma_sdp.get_slice(tidx)
        wg_sdp = mma_sdp.get_slice(wg_slice)
        wg_dk = mma_dk.get_slice(wg_slice)
        wg_dv = mma_dv.get_slice(wg_slice)
        wg_dq = mma_dq.get_slice(wg_slice)
        thr_dk = mma_dk.get_slice(tidx)
        thr_dv = mma_dv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)

        # S^T = K Q^T and dP^T = V dO^T.
        tSrK = mma_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = mma_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tdPrV = mma_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tdPrdO = mma_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        # dV += P^T dO and dK += dS^T Q: A from registers, B = dO^T / Q^T (MN-major).
        tdVrP = mma_dv.make_fragment_A(wg_dv.partition_shape_A((tn, tm)))
        tdVrdOt = mma_dv.make_fragment_B(wg_dv.partition_B(transpose_smem(sdO)))
        tdKrdS = mma_dk.make_fragment_A(wg_dk.partition_shape_A((tn, tm)))
        tdKrQt = mma_dk.make_fragment_B(wg_dk.partition_B(transpose_smem(sQ)))
        # dQ = dS K: A = dS (tile_m x tile_n) read from the dS^T buffer, B = K^T.
        if const_expr(self.dq_swap):  # dQ^T = K^T dS^T; SMEM holds dS
            tdQrKt = mma_dq.make_fragment_A(wg_dq.partition_A(transpose_smem(sK)))
            tdQrdS = mma_dq.make_fragment_B(wg_dq.partition_B(sdS))
        else:
            tdQrdS = mma_dq.make_fragment_A(wg_dq.partition_A(transpose_smem(sdS)))
            tdQrKt = mma_dq.make_fragment_B(wg_dq.partition_B(transpose_smem(sK)))

        acc_dK = cute.make_rmem_tensor(thr_dk.partition_shape_C((tn, d)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_dv.partition_shape_C((tn, dv)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # (key, query) of each accumulator element of S^T, as (rows, cols).
        tScS = acc_mn_view(thr_sdp.partition_C(cute.make_identity_tensor((tn, tm))))
        n_rows = cute.size(tScS, mode=[0])
        n_cols = cute.size(tScS, mode=[1])
        shuffle = self.tiles.stats_shuffle
        hoist_lse = n_cols <= 20 and not shuffle
        # 16 more live registers: at 20 columns (80-row tiles) and in the persistent
        # walk they spill, so there Dpsum loads as dpsum_early says.
        dpsum_top = (self.tiles.dpsum_top and n_cols <= 16 and not self.persistent
                     and not shuffle)
        quad_lane = part_base = None
        if const_expr(shuffle):
            # This lane's eighth of the columns (BwdTiles.stats_shuffle).
            lane = cute.arch.lane_idx()
            quad_lane = lane % 4
            part_base = stat_part_base(lane, n_cols)
        by_thread = self.tiles.stats_by_thread
        thr_lse = thr_dpsum = None
        if const_expr(by_thread):
            # Column 8 j + 2 q + e of the block sits at 16 (j // 2) + 4 q + 2 (j % 2)
            # + e (stat_position): this thread's n_cols values, in register order,
            # are n_cols / 4 chunks of 4, 16 floats apart, from 4 q. Block-major
            # view ((4, quad, chunk), stage) of each (tm, stages) buffer, sliced at
            # this quad: (4, chunk, stage).
            assert n_cols == tm // 4 and tm % 16 == 0
            quad = tScS[0, 0][1] // 2
            by_quad = cute.make_layout(((4, 4, tm // 16), self.tiles.stages_qdo),
                                       stride=((1, 4, 16), sLSE.layout.stride[1]))
            thr_lse, thr_dpsum = [cute.make_tensor(t.iterator, by_quad)[(None, quad, None), None]
                                  for t in (sLSE, sDpsum)]
        # dS^T goes to SMEM with stmatrix: 4 instructions per 8x8x4 block; with
        # dq_swap transposed (st.matrix .trans), into the keys-contiguous dS.
        stsm = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=self.dq_swap, num_matrices=4),
            self.dtype)
        copy_ds = cute.make_tiled_copy_C(stsm, mma_sdp)
        thr_copy_ds = copy_ds.get_slice(tidx)
        tdSsdS = thr_copy_ds.partition_D(transpose_smem(sdS) if const_expr(self.dq_swap)
                                         else sdS)
        r2s_dq = None  # the flat order's register -> SMEM copy (dq_flat, not dq_red)
        if const_expr(dq_red is not None):
            # Note [dQ from registers]: this thread's floats of the flat block start
            # at w P + 4 t; register quad q is 512 floats further per q.
            dq_quads = cute.size(thr_dq.partition_shape_C(dq_mma_shape(tm, d))) // 4
            dq_thread_off = wg_idx * dq_quads * 512 + 4 * (tidx % 128)
        elif const_expr(self.tiles.dq_flat):
            # Warpgroup w's registers, 4 at a time, thread-interleaved, into floats
            # [w P, (w + 1) P) (Note [Flat dQ accumulator]).
            # With dq_double, buffer b holds the items it with it % 2 == b.
            part = cute.size(thr_dq.partition_shape_C(dq_mma_shape(tm, d))) * 128
            r2s_dq = cute.make_tiled_copy_tv(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32,
                                    num_bits_per_copy=128),
                cute.make_layout(128), cute.make_layout(4))
            tdQsdQ_bufs = [
                r2s_dq.get_slice(tidx % 128).partition_D(cute.make_tensor(
                    sdQ.iterator + b * part * self.num_mma_wg,
                    cute.make_layout((part, self.num_mma_wg)))[None, wg_idx])
                for b in range(self.dq_bufs)]
            tdQsdQ = tdQsdQ_bufs[0]
        elif const_expr(self.tiles.dq_per_wg):
            # View the per-warpgroup parts (rows, cols, wg) as the whole (tile_m, d)
            # tile, so that each thread's dQ elements land in its warpgroup's part.
            # dQ^T (swapped) is viewed as (d, tile_m) directly.
            a, b = self._dq_part()
            if const_expr(self.dq_swap):
                whole = cute.make_layout(((b, 2), a), stride=((a, a * b), 1))
            elif const_expr(self.wg_m_dq == 2):
                whole = cute.make_layout(((a, 2), b), stride=((1, a * b), a))
            else:
                whole = cute.make_layout((a, (b, 2)), stride=(1, (a, a * b)))
            sdQ = cute.composition(sdQ, whole)
            tdQsdQ = thr_dq.partition_C(sdQ)
        else:
            if const_expr(self.dq_swap):
                sdQ = transpose_smem(sdQ)
            tdQsdQ = thr_dq.partition_C(sdQ)

        ds_bar = pipeline.NamedBarrier(barrier_id=_BAR_DS, num_threads=self.num_mma_threads)
        dq_threads = (128 if const_expr(self.tiles.dq_per_wg) else self.num_mma_threads) + 32
        dq_bar_off = wg_idx if const_expr(self.tiles.dq_per_wg) else 0
        key_limit = seqlen_k - n_block * tn

        if const_expr(kv_state is not None):
            pipe_kv.consumer_wait(kv_state)
        elif num_iters > 0:  # K (and V unless split_kv)
            pipe_kv.consumer_wait(pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, 2 if const_expr(self.split_kv) else 1))

        if const_expr(state is None):
            state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.tiles.stages_qdo)
        it0 = 0
        if const_expr(self.tiles.skip_masked_wg):
            # Note [Masked warpgroup]: the walk's first item, peeled off the loop
            # for the warpgroup whose keys it masks entirely.
            it0 = self.masked_first_item(
                state, pipe_qdo, copy_ds, thr_copy_ds, tdKrdS, tdSsdS, ds_bar, mma_dq,
                thr_dq, tdQrdS, tdQrKt, r2s_dq, tdQsdQ, dq_bar_off, dq_threads, wg_idx,
                n_block, head_kv, m_block_min, num_m, num_iters, key_limit)
            state = pipeline.PipelineState(self.tiles.stages_qdo, it0, it0, Int32(0))
        # BwdTiles.carry_coords: item it's query block is m_block_min + m_rel, m_rel
        # carried from item to item (no division by num_m in the walk).
        m_rel = Int32(0)
        if const_expr(self.tiles.carry_coords and self.tiles.skip_masked_wg):
            m_rel = cutlass.select_(it0 == num_m, Int32(0), it0)
        for it in cutlass.range(it0, num_iters, unroll=1):
            if const_expr(self.tiles.carry_coords):
                m_block = m_block_min + m_rel
            else:
                _, m_block = self.work_item(it, head_kv, 0, m_block_min, num_m)
            stage = state.index
            buf = it % 2

            pipe_qdo.consumer_wait(state)
            # This thread's LSElog2 values (one per column) load before the exp2s:
            # read at first use, their latency stalled the exp2 argument (ncu). Only
            # with 16 columns: 32 of them (tile_m 128) spill, and hoisting Dpsum's
            # 16 as well spilled (with dV issued before dS^T).
            lse = cute.make_rmem_tensor(cute.make_layout(n_cols), Float32)
            if const_expr(hoist_lse and self.tiles.lse_early):
                _stats_to_regs(lse, sLSE, thr_lse, tScS, stage)
            dpsum = cute.make_rmem_tensor(cute.make_layout(n_cols), Float32)
            if const_expr(dpsum_top):
                _stats_to_regs(dpsum, sDpsum, thr_dpsum, tScS, stage)
            acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((tn, tm)), Float32)
            wgmma_gemm(mma_sdp, acc_S, tSrK, tSrQ[None, None, None, stage], zero_init=True)
            if const_expr(self.split_kv):
                # V (stage 1, single use: after the first item a completed phase).
                pipe_kv.consumer_wait(pipeline.PipelineState(2, Int32(1), Int32(1), Int32(0)))
            acc_dP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((tn, tm)), Float32)
            wgmma_gemm(mma_sdp, acc_dP, tdPrV, tdPrdO[None, None, None, stage], zero_init=True)
            if const_expr(hoist_lse and not self.tiles.lse_early):
                _stats_to_regs(lse, sLSE, thr_lse, tScS, stage)
            if const_expr(shuffle):
                lse_part = _stat_part(sLSE, part_base, n_cols // 8, stage)
                dpsum_part = _stat_part(sDpsum, part_base, n_cols // 8, stage)
            warpgroup.wait_group(1)  # S^T done

            # Keys past seqlen_k and (causal) keys after the query: S = -inf. Only
            # blocks holding such a key pay for the test.
            S = acc_mn_view(acc_S)
            # Valid: key < min(key_limit, query - key0 + 1) in block coordinates;
            # the block's first query has the smallest causal limit.
            causal_off = m_block * tm - n_block * tn + 1
            first_limit = key_limit
            if const_expr(self.causal):
                first_limit = cutlass.min(key_limit, causal_off)
            if first_limit < tn:
                for c in cutlass.range_constexpr(n_cols):
                    limit = key_limit
                    if const_expr(self.causal):
                        limit = cutlass.min(limit, tScS[0, c][1] + causal_off)
                    for r in cutlass.range_constexpr(n_rows):
                        S[r, c] = S[r, c] if tScS[r, c][0] < limit else -Float32.inf
            # P^T = exp2(S^T * scale * log2 e - LSElog2[query]).
            if const_expr(not hoist_lse and by_thread):
                _stats_to_regs(lse, sLSE, thr_lse, tScS, stage)
            for c in cutlass.range_constexpr(n_cols):
                if const_expr(shuffle):
                    lse[c] = _shuffled_stat(lse_part, c, quad_lane)
                elif const_expr(not hoist_lse and not by_thread):
                    lse[c] = sLSE[tScS[0, c][1], stage]
                for r in cutlass.range_constexpr(n_rows):
                    S[r, c] = cute.math.exp2(S[r, c] * scale_log2 - lse[c], fastmath=True)
            if const_expr(not self.tiles.pin_dp_wait):
                convert_to_operand_a(acc_S, tdVrP, self.dtype)
            if const_expr(self.tiles.dpsum_early and not dpsum_top and not shuffle):
                _stats_to_regs(dpsum, sDpsum, thr_dpsum, tScS, stage)
            if const_expr(self.tiles.pin_dp_wait):
                # Never taken (P = exp2(.) >= 0): a block boundary that keeps the
                # dP^T wait below the exp2s (BwdTiles.pin_dp_wait).
                if S[0, 0] < 0.0:
                    cute.arch.sync_warp()
                convert_to_operand_a(acc_S, tdVrP, self.dtype)
            if const_expr(self.tiles.dv_before_ds):
                # dV runs on the tensor cores while dS^T is computed.
                wgmma_gemm(mma_dv, acc_dV, tdVrP, tdVrdOt[None, None, None, stage],
                           zero_init=False)
                warpgroup.wait_group(1)  # dP^T done (dV may still run)
            else:
                warpgroup.wait_group(0)  # dP^T done

            dP = acc_mn_view(acc_dP)
            dpsum_late = not (self.tiles.dpsum_early or dpsum_top or shuffle)
            if const_expr(dpsum_late and by_thread):
                _stats_to_regs(dpsum, sDpsum, thr_dpsum, tScS, stage)
            for c in cutlass.range_constexpr(n_cols):
                if const_expr(shuffle):
                    dpsum[c] = _shuffled_stat(dpsum_part, c, quad_lane)
                elif const_expr(dpsum_late and not by_thread):
                    dpsum[c] = sDpsum[tScS[0, c][1], stage]
                for r in cutlass.range_constexpr(n_rows):
                    dP[r, c] = S[r, c] * (dP[r, c] - dpsum[c])
            convert_to_operand_a(acc_dP, tdKrdS, self.dtype)

            # dS^T to SMEM buffer `buf`. Its previous readers (the dQ GEMMs of item
            # it - 2, in both warpgroups) finished before either warpgroup passed
            # the barrier of item it - 1.
            cute.copy(copy_ds, thr_copy_ds.retile(tdKrdS), tdSsdS[None, None, None, buf])
            if const_expr(not self.tiles.dv_before_ds):
                # dV runs while the warpgroups meet at the dS barrier.
                wgmma_gemm(mma_dv, acc_dV, tdVrP, tdVrdOt[None, None, None, stage],
                           zero_init=False)
            # Generic-proxy SMEM writes must be visible to the async proxy (wgmma).
            cute.arch.fence_view_async_shared()
            ds_bar.arrive_and_wait()

            if const_expr(self.dq_swap):
                acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((d, tm)), Float32)
                wgmma_gemm(mma_dq, acc_dQ, tdQrKt, tdQrdS[None, None, None, buf],
                           zero_init=True)
            else:
                acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((tm, d)), Float32)
                wgmma_gemm(mma_dq, acc_dQ, tdQrdS[None, None, None, buf], tdQrKt,
                           zero_init=True)
            if const_expr(self.tiles.dv_done_before_dk):
                warpgroup.wait_group(1)  # dV done; dQ may still run
            wgmma_gemm(mma_dk, acc_dK, tdKrdS, tdKrQt[None, None, None, stage], zero_init=False)

            # dV and dQ done; dK may still run.
            warpgroup.wait_group(1)
            if const_expr(dq_red is not None):
                mdQaccum, group = dq_red
                head_q, _ = self.work_item(it, head_kv, group, m_block_min, num_m)
                dst = cute.local_tile(mdQaccum[None, None, head_q, batch], (tm, d),
                                      (m_block, 0)).iterator + dq_thread_off
                regs = cute.make_tensor(acc_dQ.iterator, cute.make_layout(4 * dq_quads))
                for q in cutlass.range_constexpr(dq_quads):
                    red_add_f32x4(dst + 512 * q, regs[4 * q], regs[4 * q + 1],
                                  regs[4 * q + 2], regs[4 * q + 3])
            elif const_expr(self.dq_bufs == 2):
                self.dq_handoff_double(r2s_dq, acc_dQ, tdQsdQ_bufs, buf, dq_bar_off,
                                       dq_threads)
            else:
                self.dq_handoff_single(r2s_dq, acc_dQ, tdQsdQ, dq_bar_off, dq_threads)

            warpgroup.wait_group(0)
            if const_expr(self.tiles.elect_release):
                consumer_release_elected(pipe_qdo, state)
            else:
                pipe_qdo.consumer_release(state)
            state.advance()
            if const_expr(self.tiles.carry_coords):
                m_rel = m_rel + 1
                m_rel = cutlass.select_(m_rel == num_m, Int32(0), m_rel)
        self.epilogue(acc_dK, acc_dV, mdK, mdV, tma_dK, tma_dV, sK, sV, mma_dk, mma_dv, ds_bar,
                      tidx, n_block, head_kv, batch)
        if const_expr(kv_state is not None):
            # Thread 0 has waited for the dK / dV stores to read the K and V buffers.
            ds_bar.arrive_and_wait()
            pipe_kv.consumer_release(kv_state)
        return state

    @cute.jit
    def masked_first_item(self, state, pipe_qdo, copy_ds, thr_copy_ds, tdKrdS, tdSsdS, ds_bar,
                          mma_dq, thr_dq, tdQrdS, tdQrKt, r2s_dq, tdQsdQ, dq_bar_off,
                          dq_threads, wg_idx, n_block, head_kv, m_block_min, num_m, num_iters,
                          key_limit):
        """MMA warpgroup, ``BwdTiles.skip_masked_wg`` (Note [Masked warpgroup]): if
        this warpgroup's keys are all masked for the walk's first query block, its
        part of that item without the S^T, dP^T, dV and dK GEMMs: zeros as its half
        of dS^T (buffer 0), the dQ GEMM and hand-off, the stage released. Returns
        the loop's first item: 1 if so, else 0 (state then still at item 0)."""
        skip = cutlass.Boolean(False)
        if num_iters > 0:
            _, m_block = self.work_item(0, head_kv, 0, m_block_min, num_m)
            skip = self.wg_all_masked(m_block, n_block, wg_idx, key_limit)
        if skip:
            pipe_qdo.consumer_wait(state)
            tdKrdS.fill(0.0)
            cute.copy(copy_ds, thr_copy_ds.retile(tdKrdS), tdSsdS[None, None, None, 0])
            cute.arch.fence_view_async_shared()
            ds_bar.arrive_and_wait()
            acc_dQ = cute.make_rmem_tensor(
                thr_dq.partition_shape_C(dq_mma_shape(self.tile_m, self.head_dim)), Float32)
            if const_expr(self.dq_swap):
                wgmma_gemm(mma_dq, acc_dQ, tdQrKt, tdQrdS[None, None, None, 0], zero_init=True)
            else:
                wgmma_gemm(mma_dq, acc_dQ, tdQrdS[None, None, None, 0], tdQrKt, zero_init=True)
            warpgroup.wait_group(0)
            self.dq_handoff_single(r2s_dq, acc_dQ, tdQsdQ, dq_bar_off, dq_threads)
            if const_expr(self.tiles.elect_release):
                consumer_release_elected(pipe_qdo, state)
            else:
                pipe_qdo.consumer_release(state)
        return cutlass.select_(skip, Int32(1), Int32(0))

    @cute.jit
    def epilogue(self, acc_dK, acc_dV, mdK, mdV, tma_dK, tma_dV, sK, sV, mma_dk, mma_dv,
                 mma_bar, tidx, n_block, head_kv, batch):
        """dK = scale * sum dS^T Q and dV: registers -> SMEM (stmatrix into the K and V
        tiles) -> global memory (one TMA store each, clipped at seqlen_k).

        Writing them from registers with 4-byte stores instead used half of every
        32-byte sector and, by Nsight Compute's samples, about a tenth of the MMA
        warps' time in the causal hdim 128 backward at 4k (docs/performance.md)."""
        tn = self.tile_n
        rdK = cute.make_fragment_like(acc_dK, self.dtype)
        rdK.store((acc_dK.load() * self.softmax_scale).to(self.dtype))
        rdV = cute.make_fragment_like(acc_dV, self.dtype)
        rdV.store(acc_dV.load().to(self.dtype))
        # Both warpgroups' GEMMs that read K or V (the dQ GEMM reads all of K) are
        # done: each waited for its last wgmma group at the end of the walk.
        mma_bar.arrive_and_wait()
        for acc_bf, mma, s in ((rdK, mma_dk, sK), (rdV, mma_dv, sV)):
            stmatrix_acc(acc_bf, mma, s, tidx, self.dtype)
        # The st.matrix writes must be visible to the TMA engine before it reads.
        cute.arch.fence_view_async_shared()
        mma_bar.arrive_and_wait()
        if tidx == 0:
            for atom, s, m, width in ((tma_dK, sK, mdK, self.head_dim),
                                      (tma_dV, sV, mdV, self.head_dim_v)):
                tma_store_tile(atom, s, cute.local_tile(m[None, None, head_kv, batch],
                                                        (tn, width), (n_block, 0)))
            cute.arch.cp_async_bulk_commit_group()
            # SMEM must stay valid until the TMA engine has read it.
            cute.arch.cp_async_bulk_wait_group(0, read=True)


class FlashBwdSm90Deterministic(DqSemaphoreCall, FlashBwdSm90):
    """The deterministic sm90 backward (hdim 64/128, flat dQ): every query block
    sums its dQ partials in a fixed key-block order (``det_add_rank``), so dQ is
    bitwise reproducible. The call takes one extra operand after mdQaccum: mdQsem,
    (B, Hq, ceil(Sq / tile_m)) int32, zero at launch (one semaphore per query
    block). Bitwise reproducibility and the 2x rule were checked on the H200 with
    ascending order for every mask. The causal descending order has been timed
    there, not tested (docs/performance.md, v5)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, deterministic=True, **kwargs)


class FlashBwdSm90Fold(FlashBwdSm90):
    """The sm90 backward (hdim 64/128, flat dQ, not deterministic) that writes dQ
    itself: the last key block to add into a query block converts it (Note [dQ
    fold]), so no postprocess runs. The call takes mdQsem after mdQaccum, (B, Hq,
    ceil(Sq / tile_m)) int32, zero at launch (the preprocess zeroes it with
    dQaccum), and mdQ (B, Sq, Hq, D) in dtype after mdV."""

    def __init__(self, *args, dq_fold: int = 1, **kwargs):
        if not dq_fold:
            raise ValueError("FlashBwdSm90Fold needs a lag dq_fold >= 1")
        super().__init__(*args, dq_fold=dq_fold, **kwargs)

    @cute.jit
    def __call__(
        self,
        stream,
        mQ: cute.Tensor,  # (B, Sq, Hq, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D)
        mV: cute.Tensor,  # (B, Sk, Hkv, Dv)
        mdO: cute.Tensor,  # (B, Sq, Hq, Dv)
        mLSElog2: cute.Tensor,  # (B, Hq, Sq_pad) f32
        mDpsum: cute.Tensor,  # (B, Hq, Sq_pad) f32
        mdQaccum: cute.Tensor,  # (B, Hq, Sq_pad, D) f32, zero at launch
        mdQsem: cute.Tensor,  # (B, Hq, num_m) int32, zero at launch
        mdK: cute.Tensor,  # (B, Sk, Hkv, D)
        mdV: cute.Tensor,  # (B, Sk, Hkv, Dv)
        mdQ: cute.Tensor,  # (B, Sq, Hq, D), out
        mTrace: cute.Tensor | None = None,  # Note [CTA timeline], with trace only
    ):
        if const_expr(mdQsem.element_type != Int32):
            raise TypeError("the dQ semaphores must be int32")
        if const_expr(mdQ.element_type != self.dtype):
            raise TypeError("dQ must have the kernel's dtype")
        self.launch(stream, mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQaccum, mdK, mdV, mdQsem,
                    mdQ, mTrace=mTrace)


class FlashBwdSm90StoreFirst(DqSemaphoreCall, FlashBwdSm90):
    """The sm90 backward (hdim 64/128, flat dQ) that needs no zeroed dQaccum: each
    query block's first dQ partial is stored and the others wait for it, then add
    (Note [dQ store first]). The call takes mdQsem after mdQaccum, (B, Hq,
    ceil(Sq / tile_m)) int32, zero at launch (one ticket counter per query block;
    the preprocess zeroes it, ``FlashBwdPreprocess(sem_tile_m=...)``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, dq_store_first=True, **kwargs)
