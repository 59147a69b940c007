"""Check and time the sm90 forward kernel on a Hopper GPU.

Builds FlashFwdSm90 through cutlass.jax.cutlass_call (explicit TensorSpecs with
divisibility 1 on batch, sequence and heads), runs it under jax.jit, and checks
out and LSE against an f32 reference on upcast inputs: the kernel's max error
must be at most 2x the error of the same math done in the input precision,
plus a small atol. Output buffers are prefilled with NaN (aliased inputs), so
an unwritten element fails. Then times hdim 128 bf16 B=4 S=4096 H=16 (causal
and not) against cuDNN via jax.nn.dot_product_attention.

--hdim256 checks head dim 256 only (tile 128 x 80, not yet run on a GPU when
it was added) and times it at B=2 S=8192 H=8 (16k tokens, hidden 2048).

Usage: python scripts/gpu_check_fwd.py [--quick] [--no-time] [--no-check] [--serial] [--wide]
       [--hdim64 | --hdim256]
Writes a log to $OUT/fwd_check.log when OUT is set, else ./fwd_check.log.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# Importable from a plain checkout: python scripts/gpu_check_fwd.py.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from cutlass.jax import TensorSpec, cutlass_call  # noqa: E402

from jax_fa4.kernels.sm90_fwd import (  # noqa: E402
    FlashFwdSm90Dynamic,
    FlashFwdSm90Split,
    fwd_tiles,
    make_fwd_sm90,
)

log = logging.getLogger("gpu_check_fwd")

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
ATOL_OUT = 2e-3
ATOL_LSE = 2e-3

# (B, Sq, Sk, Hq, Hkv): the odd shapes the rules ask for.
SHAPES_FULL = [
    (2, 1, 1, 4, 4),
    (2, 17, 17, 8, 2),
    (2, 113, 203, 4, 4),
    (2, 203, 113, 8, 2),
    (2, 1000, 1000, 8, 2),
    (1, 4097, 4097, 4, 1),
]
SHAPES_SHORT = [(2, 17, 17, 8, 2), (2, 113, 203, 4, 4), (2, 1000, 1000, 8, 2)]


def fwd_call(dtype, d: int, causal: bool, shape, poison: bool, tiles=None):
    """A jitted f(q, k, v[, o0, lse0]) -> (o, lse) through cutlass_call. The causal
    persistent kernel also gets a zeroed tile counter (after V, aliased to a third
    output that is dropped); the split tail its zeroed counters (after V, aliased
    to the last output) and the parts' O and LSE (outputs after lse), all dropped."""
    b, sq, sk, hq, _ = shape
    kernel = make_fwd_sm90(dtype, d, d, causal, tiles=tiles)
    dynamic = isinstance(kernel, FlashFwdSm90Dynamic)
    split = kernel.split_shapes(b, sq, sk, hq) if isinstance(kernel, FlashFwdSm90Split) else None
    spec = TensorSpec(divisibility=(1, 1, 1, d))
    lse_spec = TensorSpec(divisibility=(1, 1, 1))
    out_sd = [
        jax.ShapeDtypeStruct((b, sq, hq, d), dtype),
        jax.ShapeDtypeStruct((b, hq, sq), jnp.float32),
    ]
    in_spec, out_spec, aliases = [spec, spec, spec], [spec, lse_spec], {}
    if dynamic:
        out_sd.append(jax.ShapeDtypeStruct((1,), jnp.int32))
        in_spec.append(TensorSpec(divisibility=(1,)))
        out_spec.append(TensorSpec(divisibility=(1,)))
        aliases[3] = 2
    if split:
        out_sd += [jax.ShapeDtypeStruct(split[1], jnp.float32),
                   jax.ShapeDtypeStruct(split[2], jnp.float32),
                   jax.ShapeDtypeStruct(split[0], jnp.int32)]
        in_spec.append(TensorSpec(divisibility=(1,)))
        out_spec += [TensorSpec(divisibility=(1, 1, 1))] * 2 + [TensorSpec(divisibility=(1,))]
        aliases[3] = 4
    if poison:
        aliases.update({len(in_spec): 0, len(in_spec) + 1: 1})
        in_spec += [spec, lse_spec]
    call = cutlass_call(kernel, output_shape_dtype=tuple(out_sd), input_spec=in_spec,
                        output_spec=out_spec, input_output_aliases=aliases)

    def f(q, k, v, *outs):
        counter = (jnp.zeros((1,), jnp.int32),) if dynamic else ()
        if split:
            counter = (jnp.zeros(split[0], jnp.int32),)
        return call(q, k, v, *counter, *outs)[:2]

    return jax.jit(f)


def reference(q, k, v, causal: bool, scale: float, dtype):
    """Attention in `dtype` arithmetic (f32 for the reference): (out, lse)."""
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, g, axis=2)
    v = jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(dtype) * jnp.asarray(scale, dtype)
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        keep = jnp.arange(sq)[:, None] >= jnp.arange(sk)[None, :]
        s = jnp.where(keep, s, jnp.asarray(-jnp.inf, dtype))
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None]).astype(dtype)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v).astype(dtype)
    return o, lse


# --tiles knobs: name -> (Sm90FwdTiles field, value).
KNOBS = {"pers": ("persistent", True), "nopers": ("persistent", False),
         "lpt": ("lpt", True), "nolpt": ("lpt", False), "oq": ("separate_o", False),
         "prune": ("prune_diagonal_loop", True), "noprune": ("prune_diagonal_loop", False),
         "merge": ("merge_diagonal_loop", True), "pin": ("pin_pv_wait", True),
         "nopin": ("pin_pv_wait", False), "nomerge": ("merge_diagonal_loop", False),
         "elect": ("elect_release", True), "noelect": ("elect_release", False),
         "rsa": ("rescale_always", True), "norsa": ("rescale_always", False),
         "ssc": ("short_softmax_chain", True), "nossc": ("short_softmax_chain", False),
         "split": ("split_tail", True), "nosplit": ("split_tail", False),
         "pinp": ("pin_p", True), "nopinp": ("pin_p", False),
         "bits": ("mask_bitmask", True), "nobits": ("mask_bitmask", False),
         "qfm": ("quad_fmax", True), "noqfm": ("quad_fmax", False),
         "rfm": ("row_fmax", True), "norfm": ("row_fmax", False),
         "qreg": ("q_in_regs", True), "noqreg": ("q_in_regs", False),
         "mc2": ("cluster_m", 2), "mc1": ("cluster_m", 1)}


def tile_variant(spec: str) -> dict:
    """The Sm90FwdTiles overrides of a --tiles variant such as "st3+oq" (see --tiles)."""
    over = {}
    for knob in spec.split("+"):
        if knob.startswith("n") and knob[1:].isdigit():
            over["tile_n"] = int(knob[1:])
        elif knob.startswith("sw") and knob[2:].isdigit():
            over["sw_exp2_per_32"] = int(knob[2:])
        elif knob.startswith("rs") and knob[2:].isdigit():
            over["row_sum_chains"] = int(knob[2:])
        elif knob.startswith("st"):
            over["num_stages"] = int(knob[2:])
        elif knob in KNOBS:
            over[KNOBS[knob][0]] = KNOBS[knob][1]
        else:
            raise ValueError(f"unknown tile knob {knob!r}")
    return over


def resolve(overrides, d: int, causal: bool):
    """The tiles of a variant (a dict of Sm90FwdTiles fields over the table's entry
    for this head dim and mask); None for the default; False where the variant
    does not serve the mask (lpt, merge: causal only; split_tail: non-causal only;
    cluster_m 2: not with the causal dynamic scheduler)."""
    if overrides is None:
        return None
    tiles = dataclasses.replace(fwd_tiles(d, d, causal), **overrides)
    if "cluster_m" not in overrides and (tiles.split_tail or tiles.elect_release
                                         or (causal and tiles.persistent)):
        # None of them serves the table's K/V multicast (the causal persistent
        # forward is the dynamic scheduler): one CTA per cluster then.
        tiles = dataclasses.replace(tiles, cluster_m=1)
    if (tiles.lpt or tiles.merge_diagonal_loop) and not causal:
        return False
    if causal and (tiles.split_tail or (tiles.cluster_m > 1 and tiles.persistent)):
        return False
    return tiles


def check_one(dname, d, causal, shape, key, tiles=None):
    dtype = DTYPES[dname]
    b, sq, sk, hq, hkv = shape
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, sq, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, sk, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, sk, hkv, d), jnp.float32).astype(dtype)
    o0 = jnp.full((b, sq, hq, d), jnp.nan, dtype)
    lse0 = jnp.full((b, hq, sq), jnp.nan, jnp.float32)
    t0 = time.perf_counter()
    f = fwd_call(dtype, d, causal, shape, poison=True, tiles=tiles)
    o, lse = jax.block_until_ready(f(q, k, v, o0, lse0))
    elapsed = time.perf_counter() - t0
    scale = 1.0 / math.sqrt(d)
    with jax.default_matmul_precision("highest"):
        o_ref, lse_ref = reference(q, k, v, causal, scale, jnp.float32)
        o_low, lse_low = reference(q, k, v, causal, scale, dtype)
    o32 = o.astype(jnp.float32)
    finite = bool(jnp.all(jnp.isfinite(o32))) and bool(jnp.all(jnp.isfinite(lse)))
    err_o = float(jnp.max(jnp.abs(o32 - o_ref)))
    err_o_low = float(jnp.max(jnp.abs(o_low.astype(jnp.float32) - o_ref)))
    err_l = float(jnp.max(jnp.abs(lse - lse_ref)))
    err_l_low = float(jnp.max(jnp.abs(lse_low.astype(jnp.float32) - lse_ref)))
    ok = finite and err_o <= 2 * err_o_low + ATOL_OUT and err_l <= 2 * err_l_low + ATOL_LSE
    return ok, finite, err_o, err_o_low, err_l, err_l_low, elapsed


def bench(fn, args, reps: int = 5, inner: int = 20) -> float:
    """Median seconds per call: `inner` async calls per rep, synchronized once."""
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(inner)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def time_one(causal: bool, key, tiles=None, with_cudnn=True, b=4, s=4096, h=16, d=128):
    dtype = jnp.bfloat16
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, s, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, h, d), jnp.float32).astype(dtype)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    f = fwd_call(dtype, d, causal, (b, s, s, h, h), poison=False, tiles=tiles)
    t_fa = bench(f, (q, k, v))
    cudnn = jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"
        )
    )
    try:
        if not with_cudnn:
            raise RuntimeError("skipped")
        t_cu = bench(cudnn, (q, k, v))
    except Exception as e:  # noqa: BLE001 (cuDNN may be missing: report, keep timing)
        if with_cudnn:
            log.warning("cuDNN failed: %s", e)
        t_cu = float("nan")
    # Same inputs: the two agree (cuDNN as a second opinion on big shapes).
    o_fa, _ = f(q, k, v)
    diff = (
        float("nan")
        if math.isnan(t_cu)
        else float(jnp.max(jnp.abs(o_fa.astype(jnp.float32) - cudnn(q, k, v).astype(jnp.float32))))
    )
    return t_fa, flops / t_fa / 1e12, t_cu, flops / t_cu / 1e12, diff


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="short shape list everywhere")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument(
        "--serial",
        action="store_true",
        help="also check and time the variant without intra-warpgroup overlap",
    )
    ap.add_argument("--wide", action="store_true", help="also time tile_n = 176")
    ap.add_argument("--no-check", action="store_true", help="timing only")
    ap.add_argument("--rounds", type=int, default=1,
                    help="> 1: also time the timed variants in this many alternating "
                         "rounds (scripts/ab_timing.py), each against its own spread")
    ap.add_argument(
        "--tiles",
        default="",
        help="comma-separated tile variants of the timed head dim, each checked (bf16, short "
        "shapes) and timed: n<N> (tile_n N), st<S> (K/V stages S), pers (persistent CTAs; "
        "causal: dynamic tile counter), lpt (longest-first tile order, causal only), "
        "nopers / nolpt (those off), oq (persistent O in the Q buffer), prune / noprune "
        "(non-causal: the diagonal loop left out / traced), merge / nomerge (causal: one loop, "
        "masking by a run-time test), elect / noelect (stages released by an elect.sync lane "
        "or the pipeline's lane test), rsa / norsa (O rescaled in every step / behind the lazy "
        "rescale's branch), pin / nopin (P V wait kept below the exp2s or not), ssc / nossc "
        "(the softmax's short max chain or the reduction's), sw<K> (K of every 32 exp2s of P in "
        "software), rs<K> (P's row sum in K chains), split / nosplit (non-causal: the grid's "
        "last round split along the keys), "
        "pinp / nopinp (P's conversions kept in the step or folded into the loop header), "
        "bits / nobits (causal: diagonal blocks masked by a keep bitmask per row), "
        "qfm / noqfm (the row max's quad shuffles with fmax or NaN-propagating), "
        "rfm / norfm (the thread's columns max-reduced with fmax in four chains or not), "
        "qreg / noqreg (Q as the register operand of S = Q K^T, hdim 128), "
        "mc2 / mc1 (K/V multicast in clusters of 2 CTAs, or none; causal with a CTA per "
        "tile only, e.g. hdim 256 or mc2+nopers), "
        "joined with +",
    )
    ap.add_argument(
        "--wg2",
        action="store_true",
        help="check (hdim 64 only) and time 128 x 128 tiles with 2 consumer WGs",
    )
    ap.add_argument(
        "--hdim64", action="store_true", help="time hdim 64 (B=2 S=8192 H=32) instead of hdim 128"
    )
    ap.add_argument(
        "--hdim256",
        action="store_true",
        help="check hdim 256 only (instead of 128 and 64) and time it (B=2 S=8192 H=8)",
    )
    ap.add_argument("--time-size", default="",
                    help="B,S,H of the timed problem instead of the head dim's default "
                         "(e.g. 16,1024,16 for the 1k row of the benchmark)")
    args = ap.parse_args()
    if args.hdim256 and (args.hdim64 or args.wg2 or args.wide):
        # tile_n 176 or 3 consumer warpgroups do not fit hdim 256 in SMEM / registers.
        ap.error("--hdim256 does not combine with --hdim64, --wg2 or --wide")
    out_dir = os.environ.get("OUT", ".")
    logging.basicConfig(
        level=logging.INFO,
        format="%(message)s",
        handlers=[
            logging.StreamHandler(sys.stdout),
            logging.FileHandler(os.path.join(out_dir, "fwd_check.log"), mode="w"),
        ],
    )
    log.info("jax %s, devices %s", jax.__version__, jax.devices())
    key = jax.random.PRNGKey(0)
    rows = []
    d_main = 256 if args.hdim256 else 128  # gets the full shape list and the serial variant
    head_dims = (256,) if args.hdim256 else (128, 64)
    configs = [(dn, d, c) for d in head_dims for dn in ("bf16", "fp16") for c in (False, True)]
    variants = [("overlap", None)]
    if args.serial:
        variants.append(("serial", {"intra_wg_overlap": False}))
    # The 2-consumer-warpgroup 128 x 128 tile: the hdim 64 default before the
    # 3-warpgroup 192 x 128 one.
    wg2 = {"tile_m": 128, "num_consumer_wg": 2, "consumer_regs": 240, "producer_regs": 24}
    if args.wg2:
        variants = [("wg2", wg2)]
    d_var = 64 if args.hdim64 else d_main
    extra = [(spec, tile_variant(spec)) for spec in args.tiles.split(",") if spec]
    if extra:  # check the variants only (the default's checks are the GPU tests)
        variants = extra
    n_fail = 0
    for vname, over in variants if not args.no_check else []:
        for dn, d, causal in configs:
            if vname == "serial" and (dn, d) != ("bf16", d_main):
                continue  # the fallback variant: one config is enough
            if vname == "wg2" and d != 64:
                continue
            if vname in dict(extra) and (dn, d) != ("bf16", d_var):
                continue
            tiles = resolve(over, d, causal)
            if tiles is False:
                continue  # lpt: causal only
            full = not args.quick and dn == "bf16" and d == d_main and vname == "overlap"
            full = full and not extra
            shapes = SHAPES_FULL if full else SHAPES_SHORT
            if vname == "wg2" and dn == "fp16":
                shapes = shapes[-1:]  # keep the device run short: bf16 covers the shapes
            for shape in shapes:
                key, sub = jax.random.split(key)
                tag = f"{vname} {dn} d{d} causal={int(causal)} {shape}"
                try:
                    ok, fin, eo, eol, el, ell, dt = check_one(dn, d, causal, shape, sub, tiles)
                except Exception:  # noqa: BLE001 (report and go on to the next check)
                    log.error("%s EXCEPTION\n%s", tag, traceback.format_exc())
                    n_fail += 1
                    rows.append((tag, "EXC"))
                    continue
                n_fail += not ok
                status = "ok" if ok else ("FAIL" if fin else "FAIL(nonfinite)")
                line = (
                    f"{tag:52s} {status:16s} out {eo:.2e} (low {eol:.2e}) "
                    f"lse {el:.2e} (low {ell:.2e}) {dt:.1f}s"
                )
                log.info(line)
                rows.append((tag, status))
    perf = []
    if not args.no_time:
        if args.hdim256:
            size = dict(b=2, s=8192, h=8, d=256)
        elif args.hdim64:
            size = dict(b=2, s=8192, h=32, d=64)
        else:
            size = dict(b=4, s=4096, h=16, d=128)
        if args.time_size:
            b_, s_, h_ = (int(x) for x in args.time_size.split(","))
            size.update(b=b_, s=s_, h=h_)
        d_t = size["d"]
        timed = [("default", None, True)]
        if args.serial:
            timed.append(("serial", {"intra_wg_overlap": False}, False))
        if args.wg2:
            timed.append(("wg2", wg2, False))
        if args.wide:
            timed.append(("n176", {"tile_n": 176}, False))
        timed += [(spec, over, False) for spec, over in extra]
        for vname, over, with_cudnn in timed:
            for causal in (False, True):
                tiles = resolve(over, d_t, causal)
                if tiles is False:
                    continue
                key, sub = jax.random.split(key)
                try:
                    res = time_one(causal, sub, tiles, with_cudnn, **size)
                    perf.append((vname, causal, *res))
                    # Logged at once too: a run cut short still shows what it timed.
                    log.info(
                        "timed %s causal=%s: %.3f ms %.1f TFLOP/s (cuDNN %.3f ms %.1f)",
                        vname,
                        causal,
                        res[0] * 1e3,
                        res[1],
                        res[2] * 1e3,
                        res[3],
                    )
                except Exception:  # noqa: BLE001 (report and go on to the next check)
                    log.error(
                        "timing %s causal=%s EXCEPTION\n%s", vname, causal, traceback.format_exc()
                    )
        if args.rounds > 1:
            from ab_timing import interleaved, summary

            b_, s_, h_ = size["b"], size["s"], size["h"]
            ks = jax.random.split(jax.random.PRNGKey(3), 3)
            q, k, v = (jax.random.normal(kk, (b_, s_, h_, d_t), jnp.float32).astype(jnp.bfloat16)
                       for kk in ks)
            for causal in (False, True):
                calls = {}
                for vname, over, _ in timed:
                    tiles = resolve(over, d_t, causal)
                    if tiles is False:
                        continue
                    f = fwd_call(jnp.bfloat16, d_t, causal, (b_, s_, s_, h_, h_), poison=False,
                                 tiles=tiles)
                    calls[vname] = (lambda f=f: f(q, k, v))
                times = interleaved(calls, jax.block_until_ready, rounds=args.rounds)
                flops = 4 * b_ * h_ * s_ * s_ * d_t / (2 if causal else 1)
                for line in summary(times, flops):
                    log.info("ab causal=%s x%d: %s", causal, args.rounds, line)
    log.info("")
    log.info("correctness: %d checks, %d failed", len(rows), n_fail)
    if perf:
        log.info(
            "bf16 %-24s | ours ms  TFLOP/s | cuDNN ms  TFLOP/s | max|diff|",
            "d{d} B={b} S={s} H={h}".format(**size),
        )
        for vname, causal, t_fa, tf_fa, t_cu, tf_cu, diff in perf:
            log.info(
                "%-8s causal=%-5s          | %7.3f %7.1f | %8.3f %7.1f | %.2e",
                vname,
                causal,
                t_fa * 1e3,
                tf_fa,
                t_cu * 1e3,
                tf_cu,
                diff,
            )
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
