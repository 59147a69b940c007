"""GPU check of the sm90 backward main kernel (jax_fa4/kernels/sm90_bwd.py) on an H200.

Correctness: dq, dk, dv against jax.vjp of an f32 reference attention (LSE from the
reference), with the 2x rule: the kernel's max error must be at most twice the error
of the same math done in the input precision, plus a small atol. The preprocess
(Dpsum, LSElog2, zeroed dQaccum) and postprocess (dQ = scale * dQaccum) are plain
jax.numpy here so this script depends only on the main kernel.

Each kernel configuration is exported once with symbolic B / S / H (jax.export), so
one compiled binary serves every shape checked; that is the dynamic-extent contract.

Timing: bf16, hdim 128 (B=4 S=4096 H=16) and 64 (B=2 S=8192 H=32), causal and not,
main kernel alone and with the jnp pre/post, against cuDNN's backward
(jax.nn.dot_product_attention).

Usage (device): python scripts/gpu_check_bwd.py [--quick] [--no-time] [--rounds R]
With --rounds R > 1 the variants' main kernels are also timed interleaved, R rounds
(scripts/ab_timing.py), each against its own spread.
Logs go to $OUT (or /tmp) as gpu_check_bwd.log; a short table is printed last.
"""

import argparse
import dataclasses
import logging
import math
import os
import sys
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from cutlass.jax import TensorSpec, cutlass_call, get_export_disabled_safety_checks  # noqa: E402
from jax import export  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from jax_fa4.kernels.bwd_preprocess import seqlen_q_padded, stat_order  # noqa: E402
from jax_fa4.kernels.dq_layout import unflatten_dq_accum  # noqa: E402
from jax_fa4.kernels.sm90_bwd import (  # noqa: E402
    FlashBwdSm90,
    FlashBwdSm90StoreFirst,
    bwd_tiles,
    without_masked_wg_conflicts,
)

log = logging.getLogger("gpu_check_bwd")
LOG2_E = math.log2(math.e)
CUTE_DTYPE = {jnp.bfloat16: cutlass.BFloat16, jnp.float16: cutlass.Float16}


def make_tiles(d, causal, variant):
    """The kernel's own tile table, with a knob flipped for A/B variants."""
    tiles = bwd_tiles(d, causal)
    for knob in variant.split("+"):  # e.g. "m80+pwg"
        if knob[:1] == "m" and knob[1:].isdigit():  # m64 / m80 / m128: another query tile
            # (by-thread statistics only with 64- or 128-row tiles)
            tiles = dataclasses.replace(tiles, tile_m=int(knob[1:]), stats_by_thread=(
                tiles.stats_by_thread and int(knob[1:]) in (64, 128)))
        elif knob[:1] == "s" and knob[1:].isdigit():  # s3: Q/dO pipeline stages
            tiles = dataclasses.replace(tiles, stages_qdo=int(knob[1:]))
        elif knob == "pwg":  # dQ handed off per warpgroup
            tiles = dataclasses.replace(tiles, dq_per_wg=True)
        elif knob == "joint":  # dQ handed off by both warpgroups together
            tiles = dataclasses.replace(tiles, dq_per_wg=False)
        elif knob in ("dvlate", "dvearly"):  # dV issued after / before dS^T
            tiles = dataclasses.replace(tiles, dv_before_ds=knob == "dvearly")
        elif knob in ("flat", "tma"):  # dQ: flat order + bulk reduce / TMA tensor reduce
            tiles = dataclasses.replace(tiles, dq_flat=knob == "flat")
        elif knob in ("lse", "nolse"):  # LSElog2 loaded before S^T is issued / after dP^T
            tiles = dataclasses.replace(tiles, lse_early=knob == "lse")
        elif knob in ("dps", "nodps"):  # Dpsum loaded before / after the dP^T wait
            tiles = dataclasses.replace(tiles, dpsum_early=knob == "dps")
        elif knob in ("dvwait", "nodvwait"):  # dV done before dK is issued, or not
            tiles = dataclasses.replace(tiles, dv_done_before_dk=knob == "dvwait")
        elif knob in ("splitkv", "nosplitkv"):  # K and V on two mbarriers, or one
            tiles = dataclasses.replace(tiles, split_kv=knob == "splitkv")
        elif knob in ("pers", "nopers"):  # persistent CTAs walking the tiles, or a grid
            tiles = dataclasses.replace(tiles, persistent=knob == "pers")
        elif knob in ("pin", "nopin"):  # dP^T wait kept below the exp2s, or not
            tiles = dataclasses.replace(tiles, pin_dp_wait=knob == "pin")
        elif knob in ("lpt", "nolpt"):  # causal launch order: LPT sections / per head
            tiles = dataclasses.replace(tiles, lpt=knob == "lpt")
        elif knob in ("dtop", "nodtop"):  # Dpsum loaded with LSElog2 before S^T, or later
            tiles = dataclasses.replace(tiles, dpsum_top=knob == "dtop")
        elif knob in ("sbt", "nosbt"):  # row statistics in by-thread order (LDS.128) or rows
            tiles = dataclasses.replace(tiles, stats_by_thread=knob == "sbt")
        elif knob in ("shfl", "noshfl"):  # an eighth of the statistics per lane + shuffles
            tiles = dataclasses.replace(tiles, stats_shuffle=knob == "shfl", stats_by_thread=(
                tiles.stats_by_thread and knob == "noshfl"))
        elif knob in ("elect", "noelect"):  # Q / dO stage released from an elected lane
            tiles = dataclasses.replace(tiles, elect_release=knob == "elect")
        elif knob in ("hdiv", "nohdiv"):  # LPT coordinates: host divisors / run-time divisions
            tiles = dataclasses.replace(tiles, lpt_host_div=knob == "hdiv")
        elif knob in ("rot", "norot"):  # non-causal walk rotated per key block, or not
            tiles = dataclasses.replace(tiles, rotate_walk=knob == "rot")
        elif knob in ("dq1", "dq2"):  # store first: one or two dQ SMEM buffers
            tiles = dataclasses.replace(tiles, dq_double=knob == "dq2")
        elif knob in ("add1", "add2"):  # add-only: one or two dQ SMEM buffers
            tiles = dataclasses.replace(tiles, dq_double_add=knob == "add2")
        elif knob in ("skipwg", "noskipwg"):  # fully masked warpgroup halves skipped
            tiles = dataclasses.replace(tiles, skip_masked_wg=knob == "skipwg")
        elif knob in ("carry", "nocarry"):  # MMA walk: query block carried, or divided
            tiles = dataclasses.replace(tiles, carry_coords=knob == "carry")
        elif knob in ("red", "nored"):  # dQ reduce-added from registers, or via SMEM
            tiles = dataclasses.replace(tiles, dq_red=knob == "red")
        elif knob not in ("default", "first"):  # first: a kernel class (kernel_call)
            raise ValueError(f"unknown variant knob {knob!r}")
    knobs = variant.split("+")
    if not {"skipwg", "carry"} & set(knobs):
        # The table's skip_masked_wg / carry_coords (hdim 128 causal) give way to the
        # knobs that rule them out; named explicitly they are refused instead.
        tiles = without_masked_wg_conflicts(tiles, dq_store_first="first" in knobs)
    return tiles


def kernel_call(dtype, d, causal, scale, variant="default"):
    """The cutlass_call of the backward main kernel; shapes come from its arguments.

    Variant knob "first": ``FlashBwdSm90StoreFirst`` (Note [dQ store first]) on a
    NaN-poisoned dQaccum with zeroed semaphores. Rows of dQaccum past the last query
    block must come back untouched (NaN); they are returned as 0 if so, else inf,
    so the runner's padding check sees both that and the stored zero rows."""
    first = "first" in variant.split("+")
    tiles = make_tiles(d, causal, variant)
    kernel = (FlashBwdSm90StoreFirst if first else FlashBwdSm90)(
        CUTE_DTYPE[dtype], d, d, causal, scale, tiles=tiles)
    s4 = TensorSpec(divisibility=(1, 1, 1, d))
    s3 = TensorSpec(divisibility=(1, 1, 1))

    def f(q, k, v, do, lse_log2, dpsum, dq_accum):
        out = (jax.ShapeDtypeStruct(dq_accum.shape, jnp.float32),
               jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype))
        if not first:
            return cutlass_call(kernel, output_shape_dtype=out,
                                input_spec=[s4, s4, s4, s4, s3, s3, s4],
                                output_spec=[s4, s4, s4],
                                input_output_aliases={6: 0})(q, k, v, do, lse_log2, dpsum,
                                                             dq_accum)
        b, sq, hq, _ = q.shape
        num_m = -(-sq // tiles.tile_m)
        sem = jnp.zeros((b, hq, num_m), jnp.int32)
        acc, dk, dv, _ = cutlass_call(
            kernel, output_shape_dtype=out + (jax.ShapeDtypeStruct(sem.shape, jnp.int32),),
            input_spec=[s4, s4, s4, s4, s3, s3, s4, s3], output_spec=[s4, s4, s4, s3],
            input_output_aliases={6: 0, 7: 3})(q, k, v, do, lse_log2, dpsum,
                                              jnp.full_like(dq_accum, jnp.nan), sem)
        end = num_m * tiles.tile_m
        untouched = jnp.all(jnp.isnan(acc[:, :, end:]))
        acc = acc.at[:, :, end:].set(jnp.where(untouched, 0.0, jnp.inf))
        return acc, dk, dv
    return f


_EXPORTED = {}


def exported_kernel(dtype, d, causal, scale, variant="default"):
    """Export once with symbolic extents: one binary for every B, Sq, Sk, Hq, Hkv."""
    cache_key = (dtype, d, causal, scale, variant)
    if cache_key in _EXPORTED:
        return _EXPORTED[cache_key]
    b, sq, sk, hq, hkv, sqp = export.symbolic_shape("b, sq, sk, hq, hkv, sqp")
    sds = jax.ShapeDtypeStruct
    args = [sds((b, sq, hq, d), dtype), sds((b, sk, hkv, d), dtype),
            sds((b, sk, hkv, d), dtype), sds((b, sq, hq, d), dtype),
            sds((b, hq, sqp), jnp.float32), sds((b, hq, sqp), jnp.float32),
            sds((b, hq, sqp, d), jnp.float32)]
    t0 = time.time()
    exp = export.export(jax.jit(kernel_call(dtype, d, causal, scale, variant)),
                        platforms=["cuda"],
                        disabled_checks=get_export_disabled_safety_checks())(*args)
    log.info("exported %s d=%d causal=%s %s in %.1fs", dtype.__name__, d, causal, variant,
             time.time() - t0)
    _EXPORTED[cache_key] = exp.call
    return exp.call


def attention(q, k, v, scale, causal):
    """Reference attention in the dtype of its inputs; returns (out, lse)."""
    hq, hkv = q.shape[2], k.shape[2]
    k = jnp.repeat(k, hq // hkv, axis=2)
    v = jnp.repeat(v, hq // hkv, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(scale, q.dtype)
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        mask = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None]
        s = jnp.where(mask, s, jnp.asarray(-jnp.inf, s.dtype))
    lse = jax.nn.logsumexp(s.astype(jnp.float32), axis=-1)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v), lse


def q_tile_pad(d, causal, variant):
    """The tile_m argument of seqlen_q_padded for this variant's query tile."""
    tile_m = make_tiles(d, causal, variant).tile_m
    return tile_m if tile_m % 64 else None


def pad_stats(dpsum, lse_log2, tile_m=None, stats_block=None):
    """The workspaces' Sq_pad rows: Dpsum 0 and LSElog2 +inf past Sq (bwd_preprocess),
    in the by-thread order of ``stat_position`` when stats_block is set."""
    sqp = seqlen_q_padded(dpsum.shape[-1], tile_m)
    widths = ((0, 0), (0, 0), (0, sqp - dpsum.shape[-1]))
    dpsum, lse_log2 = jnp.pad(dpsum, widths), jnp.pad(lse_log2, widths, constant_values=jnp.inf)
    if stats_block is not None:
        order = stat_order(sqp, stats_block)
        dpsum, lse_log2 = dpsum[..., order], lse_log2[..., order]
    return dpsum, lse_log2


def stats_block_of(d, causal, variant):
    """The by-thread statistics block of this variant's main kernel, or None."""
    tiles = make_tiles(d, causal, variant)
    return tiles.tile_m if tiles.stats_by_thread else None


def flat_tile_m(d, causal, variant):
    """The main kernel's query tile if it writes dQaccum in flat order, else None."""
    tiles = make_tiles(d, causal, variant)
    return tiles.tile_m if tiles.dq_flat else None


def jnp_postprocess(dq_accum, sq, scale, dtype, tile_m):
    """What bwd_postprocess.py computes (after undoing the flat order, if any)."""
    if tile_m is not None:
        dq_accum = unflatten_dq_accum(dq_accum, tile_m)
    return (scale * dq_accum[:, :, :sq]).transpose(0, 2, 1, 3).astype(dtype), dq_accum


def make_runner(kcall, scale, causal, tile_m=None, pad_tile=None, stats_block=None):
    @jax.jit
    def run(q, k, v, do):
        f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
        (o32, lse32), vjp32 = jax.vjp(lambda a, b, c: attention(a, b, c, scale, causal),
                                      *f32[:3])
        ref = vjp32((f32[3], jnp.zeros_like(lse32)))
        (_, _), vjp_lo = jax.vjp(lambda a, b, c: attention(a, b, c, scale, causal), q, k, v)
        lo = vjp_lo((do, jnp.zeros(lse32.shape, jnp.float32)))
        # jnp preprocess: what bwd_preprocess.py computes.
        o = o32.astype(q.dtype)
        dpsum = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), o.astype(jnp.float32))
        bsz, sq, hq, d = q.shape
        dpsum, lse_log2 = pad_stats(dpsum, lse32 * LOG2_E, pad_tile, stats_block)
        dq_accum = jnp.zeros((bsz, hq, seqlen_q_padded(sq, pad_tile), d), jnp.float32)
        dq_accum, dk, dv = kcall(q, k, v, do, lse_log2, dpsum, dq_accum)
        dq, dq_accum = jnp_postprocess(dq_accum, sq, scale, q.dtype, tile_m)
        pad_max = jnp.max(jnp.abs(dq_accum[:, :, sq:])) if dq_accum.shape[2] > sq else 0.0
        return (dq, dk, dv), ref, lo, pad_max
    return run


def check_case(run, dtype, b, sq, sk, hq, hkv, d, key):
    ks = jax.random.split(key, 4)
    q = jax.random.normal(ks[0], (b, sq, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, sk, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, sk, hkv, d), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b, sq, hq, d), jnp.float32).astype(dtype)
    got, ref, lo, pad_max = jax.block_until_ready(run(q, k, v, do))
    worst = 0.0
    ok = True
    details = []
    for name, g, r, lw in zip(("dq", "dk", "dv"), got, ref, lo):
        g = np.asarray(g.astype(jnp.float32))
        r = np.asarray(r)
        lw = np.asarray(lw.astype(jnp.float32))
        finite = bool(np.isfinite(g).all())
        err = float(np.max(np.abs(g - r))) if g.size else 0.0
        err_lo = float(np.max(np.abs(lw - r))) if g.size else 0.0
        atol = 1e-3 * max(1.0, float(np.max(np.abs(r))) if r.size else 1.0)
        good = finite and err <= 2 * err_lo + atol
        ok &= good
        worst = max(worst, err / (2 * err_lo + atol))
        details.append(f"{name} err={err:.2e} lowp={err_lo:.2e} {'ok' if good else 'FAIL'}")
    pad_ok = float(pad_max) == 0.0
    ok &= pad_ok
    return ok, worst, "; ".join(details) + ("" if pad_ok else f"; dQaccum pad={pad_max}")


def bench(fn, args, iters=20, samples=7):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / iters)
    return float(np.median(ts))


# Timed problems, (B, S, H) per head dim (--time-size overrides), and the masks timed
# (--causal-only).
TIME_SIZE = {128: (4, 4096, 16), 64: (2, 8192, 32)}
TIME_CAUSAL = (False, True)


def time_one(kcall, causal, rows, variant, d=128):
    # The benchmark family: 16k tokens, hidden 2048.
    b, s, h = TIME_SIZE[d]
    dtype = jnp.bfloat16
    scale = 1.0 / math.sqrt(d)
    ks = jax.random.split(jax.random.PRNGKey(7), 4)
    q, k, v, do = [jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(dtype) for kk in ks]
    lse_log2 = jax.random.normal(ks[0], (b, h, s), jnp.float32) + 10.0
    dpsum = jax.random.normal(ks[1], (b, h, s), jnp.float32)
    pad_tile = q_tile_pad(d, causal, variant)
    dpsum, lse_log2 = pad_stats(dpsum, lse_log2, pad_tile)
    flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)

    @jax.jit
    def main_only(q, k, v, do, lse_log2, dpsum):
        dq_accum = jnp.zeros((b, h, seqlen_q_padded(s, pad_tile), d), jnp.float32)
        return kcall(q, k, v, do, lse_log2, dpsum, dq_accum)

    @jax.jit
    def full(q, k, v, do, o, lse):
        dpsum = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), o.astype(jnp.float32))
        dpsum = jnp.pad(dpsum, ((0, 0), (0, 0), (0, lse.shape[-1] - s)))
        dq_accum = jnp.zeros((b, h, seqlen_q_padded(s, pad_tile), d), jnp.float32)
        dq_accum, dk, dv = kcall(q, k, v, do, lse, dpsum, dq_accum)
        dq, _ = jnp_postprocess(dq_accum, s, scale, q.dtype, flat_tile_m(d, causal, variant))
        return dq, dk, dv

    t_main = bench(main_only, (q, k, v, do, lse_log2, dpsum))
    t_full = bench(full, (q, k, v, do, q, lse_log2))

    def cudnn_fwd(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                            implementation="cudnn")
    try:
        _, vjp_fn = jax.vjp(cudnn_fwd, q, k, v)
        t_cudnn = bench(jax.jit(lambda f, g: f(g)), (vjp_fn, do))
    except Exception as e:  # cuDNN missing is a result to report, not a crash
        log.warning("cuDNN backward unavailable: %s", e)
        t_cudnn = float("nan")
    rows.append((f"time {variant} d{d} bf16 B{b} S{s} H{h} c{int(causal)}",
                 f"main {t_main * 1e3:.3f} ms {flops / t_main / 1e12:.0f} TF/s | "
                 f"main+jnp pre/post {flops / t_full / 1e12:.0f} TF/s | "
                 f"cuDNN bwd {t_cudnn * 1e3:.3f} ms {flops / t_cudnn / 1e12:.0f} TF/s"))
    log.info("%s", rows[-1])


def timing(make_kcall, rows, variants, head_dims=(128, 64)):
    for d in head_dims:
        for variant in variants:
            for causal in TIME_CAUSAL:
                kcall = make_kcall(jnp.bfloat16, d, causal, 1.0 / math.sqrt(d), variant)
                time_one(kcall, causal, rows, variant, d)


def main_kernel_call(make_kcall, d, causal, variant, qkvdo, key):
    """A zero-argument call of the variant's main kernel alone on bf16 (q, k, v, dO)
    with random statistics (LSElog2 around 10; padded to the variant's query tile)
    and dQaccum zeroed per call (clock_probe.py's --bwd-variants use it too)."""
    q = qkvdo[0]
    b, s, h, _ = q.shape
    k_dpsum, k_lse = jax.random.split(key)
    pad_tile = q_tile_pad(d, causal, variant)
    dpsum, lse = pad_stats(jax.random.normal(k_dpsum, (b, h, s), jnp.float32),
                           jax.random.normal(k_lse, (b, h, s), jnp.float32) + 10.0, pad_tile)
    kcall = make_kcall(jnp.bfloat16, d, causal, 1.0 / math.sqrt(d), variant)
    shape = (b, h, seqlen_q_padded(s, pad_tile), d)
    main_only = jax.jit(lambda *a: kcall(*a, jnp.zeros(shape, jnp.float32)))
    return lambda: main_only(*qkvdo, lse, dpsum)


def timing_interleaved(make_kcall, rows, variants, head_dims, rounds):
    """The main kernel of every variant, timed in alternating rounds (ab_timing)."""
    from ab_timing import interleaved, summary

    for d in head_dims:
        b, s, h = TIME_SIZE[d]
        ks = jax.random.split(jax.random.PRNGKey(11), 6)
        q, k, v, do = [jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
                       for kk in ks[:4]]
        for causal in TIME_CAUSAL:
            calls = {variant: main_kernel_call(make_kcall, d, causal, variant, (q, k, v, do),
                                               ks[4])
                     for variant in dict.fromkeys(variants)}  # each variant once, in order
            times = interleaved(calls, jax.block_until_ready, rounds=rounds)
            flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
            for line in summary(times, flops):
                rows.append((f"ab d{d} c{int(causal)} x{rounds}", line))
                log.info("ab d%d causal=%s: %s", d, causal, line)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one shape per config")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--rounds", type=int, default=1,
                    help="> 1: also time the variants' main kernels in this many "
                         "alternating rounds (scripts/ab_timing.py)")
    ap.add_argument("--no-export", action="store_true",
                    help="compile per shape through cutlass_call instead of one export")
    ap.add_argument("--seqlens", default=None,
                    help="comma-separated SqxSk pairs, e.g. 17x17,113x203")
    ap.add_argument("--variants", default="default",
                    help="comma-separated: default (the tile table), m64, m80, m128 (query tile), "
                         "s2, s3 (Q/dO stages), pwg / joint (dQ hand-off per warpgroup "
                         "/ joint), dvlate / dvearly (dV GEMM issued after / before dS^T), "
                         "flat / tma (dQ in flat order by bulk reduce / row-major by TMA "
                         "tensor reduce), lse / nolse (LSElog2 loaded before S^T / after "
                         "dP^T), dps / nodps (Dpsum loaded before / after the dP^T wait), "
                         "dvwait / nodvwait (dK issued after dV is done / at once), "
                         "lpt / nolpt (causal launch order: LPT sections / per head), "
                         "pin / nopin (dP^T wait kept below the exp2s or not), "
                         "splitkv / nosplitkv (K and V on two mbarriers or one), "
                         "pers / nopers (persistent CTAs walking the tiles, or one per tile), "
                         "dtop / nodtop (Dpsum loaded with LSElog2 before S^T or later), "
                         "sbt / nosbt (LSElog2 / Dpsum in by-thread order, as the "
                         "preprocess writes them for stats_by_thread, or in rows), "
                         "elect / noelect (Q / dO stages released by an elect.sync lane "
                         "or the pipeline's lane test), "
                         "hdiv / nohdiv (LPT coordinates from host divisors or run-time "
                         "divisions), shfl / noshfl (each lane loads an eighth of its "
                         "columns' LSElog2 / Dpsum, the rest by shuffles; shfl turns "
                         "stats_by_thread off), red / nored (dQ reduce-added from the "
                         "MMA threads' registers or through SMEM and the dQ warp), "
                         "skipwg / noskipwg (a warpgroup whose keys are all masked for a "
                         "query block skips its GEMMs there, or not), carry / nocarry (the MMA "
                         "walk carries its query block from item to item, or divides the "
                         "item index), "
                         "combined with +, e.g. m80+pwg")
    ap.add_argument("--final", action="store_true",
                    help="trimmed plan: 4097 only for bf16 d128; later variants on few shapes")
    ap.add_argument("--gqa-only", action="store_true", help="skip the Hq == Hkv cases")
    ap.add_argument("--hdims", default="128,64", help="head dims to check and time")
    ap.add_argument("--time-size", default=None,
                    help="B,S,H of the timed problem for every head dim (e.g. 16,1024,16, "
                         "the benchmark's 1k row) instead of the defaults")
    masks = ap.add_mutually_exclusive_group()
    masks.add_argument("--causal-only", action="store_true",
                       help="check and time the causal mask only")
    masks.add_argument("--noncausal-only", action="store_true",
                       help="check and time without the causal mask only")
    ap.add_argument("--budget-s", type=float, default=400.0,
                    help="stop starting new correctness cases after this many seconds")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        handlers=[logging.FileHandler(os.path.join(out_dir, "gpu_check_bwd.log")),
                                  logging.StreamHandler(sys.stderr)])
    log.info("devices: %s", jax.devices())
    t_start = time.time()
    make_kcall = kernel_call if args.no_export else exported_kernel
    rows = []
    seqlens = [(1, 1), (17, 17), (113, 203), (1000, 1000), (4097, 4097)]
    if args.quick:
        seqlens = [(113, 203)]
    if args.seqlens:
        seqlens = [tuple(int(x) for x in p.split("x")) for p in args.seqlens.split(",")]
    heads = ((4, 1),) if args.gqa_only else ((4, 1), (2, 2))
    all_seqlens = seqlens
    plan = []  # (variant, dtype, d, causal, seqlens)
    hdims = tuple(int(x) for x in args.hdims.split(","))
    global TIME_CAUSAL
    if args.time_size:
        size = tuple(int(x) for x in args.time_size.split(","))
        TIME_SIZE.update({d: size for d in hdims})
    if args.causal_only:
        TIME_CAUSAL = (True,)
    if args.noncausal_only:
        TIME_CAUSAL = (False,)
    for variant in args.variants.split(","):
        for dtype in (jnp.bfloat16, jnp.float16):
            for d in hdims:
                for causal in TIME_CAUSAL:
                    sl = all_seqlens
                    if args.final and variant != args.variants.split(",")[0]:
                        # Second variant: its own structure, on fewer shapes.
                        if not (d == 128 and dtype == jnp.bfloat16) and not (
                                d == 64 and dtype == jnp.float16 and causal):
                            continue
                        sl = [(113, 203), (1000, 1000)]
                    elif args.final and not (d == 128 and dtype == jnp.bfloat16):
                        sl = [x for x in all_seqlens if x != (4097, 4097)]
                    plan.append((variant, dtype, d, causal, sl))
    key = jax.random.PRNGKey(0)
    all_ok = True
    for variant, dtype, d, causal, sl in plan:
        scale = 1.0 / math.sqrt(d)
        tag = f"{variant} {dtype.__name__} d{d} c{int(causal)}"
        try:
            run = make_runner(make_kcall(dtype, d, causal, scale, variant), scale, causal,
                              flat_tile_m(d, causal, variant), q_tile_pad(d, causal, variant),
                              stats_block_of(d, causal, variant))
        except Exception as e:
            log.exception("build failed")
            rows.append((tag, f"BUILD FAIL {e}"))
            all_ok = False
            continue
        for sq, sk in sl:
            for hq, hkv in heads:
                if time.time() - t_start > args.budget_s:
                    continue
                key, sub = jax.random.split(key)
                name = f"{tag} {sq}x{sk} h{hq}/{hkv}"
                try:
                    ok, worst, det = check_case(run, dtype, 2, sq, sk, hq, hkv, d, sub)
                except Exception as e:
                    log.exception("case failed")
                    ok, worst, det = False, float("nan"), f"ERROR {e}"
                all_ok &= ok
                log.info("%s %s worst=%.2f %s", name, "PASS" if ok else "FAIL", worst, det)
                rows.append((name, f"{'PASS' if ok else 'FAIL'} {worst:.2f} "
                             + ("" if ok else det)))
    log.info("correctness %s in %.0fs", "ALL PASS" if all_ok else "FAILURES",
             time.time() - t_start)
    if not args.no_time:
        try:
            timing(make_kcall, rows, args.variants.split(","), hdims)
            if args.rounds > 1:
                timing_interleaved(make_kcall, rows, args.variants.split(","), hdims,
                                   args.rounds)
        except Exception:
            log.exception("timing failed")
    print("\n==== sm90 bwd check (worst = err / (2*err_lowp + atol), must be <= 1) ====")
    for name, res in rows:
        print(f"{name:52s} {res}")
    print("ALL PASS" if all_ok else "SOME FAILED")


if __name__ == "__main__":
    main()
