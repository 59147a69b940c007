"""Per-CTA timeline of the sm90 backward main kernel on the GPU machine (Note [CTA
timeline] in jax_fa4/kernels/sm90_bwd.py).

The kernel is built with ``trace=True``: every CTA records its SM, its work item
(key block, kv head, batch, number of walk items), its start and, per warp, the time
that warp finished its role. Per case and variant this prints:
- the span of the kernel and how busy the SMs were in it (sum of CTA lengths over
  SMs x span), the gaps between one SM's CTAs, and when the SMs ran out of work
  (the tail);
- a least-squares fit of CTA length against its number of items, length = a + b x
  items: a is the fixed cost of a CTA (start, K / V wait, epilogue), b one item;
- with the fold, how long the CTAs lived after their MMA warpgroups were done.
It writes one CSV of CTAs per case and variant to --out.

Variants: ``table`` (FlashBwdSm90 with the tile table) and ``fold`` (FlashBwdSm90Fold,
Note [dQ fold]). Inputs are random bf16 with LSElog2 = 20 and Dpsum = 0 everywhere
(finite, and the kernel's time does not depend on the values).

Usage (device): python scripts/cta_timeline.py [--cases 128:1024:1,128:16384:1]
    [--variants table,fold] [--runs 5] [--tokens 16384] [--hidden 2048] [--out DIR]
"""

import argparse
import csv
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from cutlass.jax import TensorSpec, cutlass_call  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from jax_fa4.kernels.bwd_preprocess import seqlen_q_padded  # noqa: E402
from jax_fa4.kernels.sm90_bwd import (  # noqa: E402
    TRACE_COLS,
    TRACE_WARP_END,
    FlashBwdSm90,
    FlashBwdSm90Fold,
    bwd_tiles,
)

NUM_WARPS = 12  # one producer warpgroup, two MMA warpgroups


def traced_call(d: int, causal: bool, variant: str):
    """f(q, k, v, do) -> the kernel's trace rows (int32, (CTAs, TRACE_COLS))."""
    scale = d ** -0.5
    fold = variant == "fold"
    if variant not in ("table", "fold"):
        raise ValueError(f"unknown variant {variant!r} (table, fold)")
    kernel = (FlashBwdSm90Fold if fold else FlashBwdSm90)(
        cutlass.BFloat16, d, d, causal, scale, trace=True)
    tile_m, tile_n = kernel.tile_m, kernel.tile_n
    s4 = TensorSpec(divisibility=(1, 1, 1, d))
    s3 = TensorSpec(divisibility=(1, 1, 1))
    s2 = TensorSpec(divisibility=(1, 1))

    def f(q, k, v, do):
        b, sq, hq, _ = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        sqp = seqlen_q_padded(sq, tile_m if tile_m % 64 else None)
        lse = jnp.full((b, hq, sqp), 20.0, jnp.float32)
        dpsum = jnp.zeros((b, hq, sqp), jnp.float32)
        acc = jnp.zeros((b, hq, sqp, d), jnp.float32)
        rows = -(-sk // tile_n) * hkv * b
        sds = jax.ShapeDtypeStruct
        trace = sds((rows, TRACE_COLS), jnp.int32)
        out = (sds(acc.shape, jnp.float32), sds(k.shape, k.dtype), sds(v.shape, v.dtype))
        if not fold:
            res = cutlass_call(kernel, output_shape_dtype=out + (trace,),
                               input_spec=[s4, s4, s4, s4, s3, s3, s4],
                               output_spec=[s4, s4, s4, s2],
                               input_output_aliases={6: 0})(q, k, v, do, lse, dpsum, acc)
            return res[-1]
        sem = jnp.zeros((b, hq, -(-sq // tile_m)), jnp.int32)
        res = cutlass_call(kernel,
                           output_shape_dtype=out + (sds(sem.shape, jnp.int32),
                                                     sds(q.shape, q.dtype), trace),
                           input_spec=[s4, s4, s4, s4, s3, s3, s4, s3],
                           output_spec=[s4, s4, s4, s3, s4, s2],
                           input_output_aliases={6: 0, 7: 3})(q, k, v, do, lse, dpsum, acc,
                                                              sem)
        return res[-1]
    return jax.jit(f)


def times(tr: np.ndarray, col: int) -> np.ndarray:
    """The int64 nanosecond time in columns col (low half), col + 1 (high half)."""
    lo = tr[:, col].astype(np.int64) & 0xFFFFFFFF
    return (tr[:, col + 1].astype(np.int64) << 32) | lo


def analyse(tr: np.ndarray) -> tuple[dict, list[dict]]:
    """Summary figures (ns and fractions) and one record per CTA."""
    start = times(tr, 6)
    ends = np.stack([times(tr, TRACE_WARP_END + 2 * w) for w in range(NUM_WARPS)], axis=1)
    end = ends.max(axis=1)
    mma_end = ends[:, 4:].max(axis=1)
    t0 = start.min()
    span = end.max() - t0
    dur = end - start
    sm = tr[:, 0]
    items = tr[:, 5]
    sms = np.unique(sm)
    gaps, last_end = [], []
    for s in sms:
        idx = np.where(sm == s)[0]
        order = idx[np.argsort(start[idx])]
        gaps.extend((start[order[1:]] - end[order[:-1]]).tolist())
        last_end.append(end[order[-1]] - t0)
    gaps = np.asarray(gaps if gaps else [0])
    last_end = np.sort(np.asarray(last_end))
    a_fix, b_item = (np.polyfit(items, dur, 1)[::-1] if len(np.unique(items)) > 1
                     else (float("nan"), float(dur.mean() / max(items.mean(), 1))))
    summary = {
        "ctas": len(tr), "sms": len(sms), "span_us": span / 1e3,
        "busy": dur.sum() / (len(sms) * span),
        "gap_median_us": float(np.median(gaps)) / 1e3, "gap_share": gaps.sum() / (len(sms) * span),
        "first_sm_done": last_end[0] / span, "tenth_sm_done": last_end[len(last_end) // 10] / span,
        "fixed_us": a_fix / 1e3, "item_us": b_item / 1e3,
        "fixed_share": a_fix * len(tr) / dur.sum() if np.isfinite(a_fix) else float("nan"),
        "after_mma_us_mean": float((end - mma_end).mean()) / 1e3,
        "after_mma_us_p90": float(np.percentile(end - mma_end, 90)) / 1e3,
    }
    records = [{"row": i, "sm": int(sm[i]), "n_block": int(tr[i, 2]), "head_kv": int(tr[i, 3]),
                "batch": int(tr[i, 4]), "items": int(items[i]), "start_ns": int(start[i] - t0),
                "mma_end_ns": int(mma_end[i] - t0), "end_ns": int(end[i] - t0)}
               for i in range(len(tr))]
    return summary, records


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="128:1024:1,128:16384:1",
                    help="hdim:seqlen:causal, comma-separated")
    ap.add_argument("--variants", default="table,fold")
    ap.add_argument("--runs", type=int, default=5, help="calls; the last one's trace is read")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per batch (B = tokens / S)")
    ap.add_argument("--hidden", type=int, default=2048, help="heads = hidden / hdim")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    for case in filter(None, args.cases.split(",")):
        d, s, c = (int(x) for x in case.split(":"))
        b, h = max(args.tokens // s, 1), args.hidden // d
        ks = jax.random.split(jax.random.PRNGKey(5), 4)
        q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
                       for kk in ks)
        t = bwd_tiles(d, bool(c))
        print(f"d{d} s{s} {'causal' if c else 'non-causal'} B={b} H={h}: tile "
              f"{t.tile_m}x{t.tile_n}", flush=True)
        for variant in filter(None, args.variants.split(",")):
            f = traced_call(d, bool(c), variant)
            for _ in range(args.runs):
                tr = f(q, k, v, do)
            tr = np.asarray(jax.block_until_ready(tr))
            summary, records = analyse(tr)
            print(f"  {variant:6s} " + "  ".join(
                f"{key} {val:.3f}" if isinstance(val, float) else f"{key} {val}"
                for key, val in summary.items()), flush=True)
            path = os.path.join(args.out, f"cta_timeline_d{d}_s{s}_c{c}_{variant}.csv")
            with open(path, "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(records[0]))
                w.writeheader()
                w.writerows(records)
    print("fixed: a of length = a + b x items; busy: CTA time / (SMs x span); "
          "first_sm_done / tenth_sm_done: when the first / tenth-percentile SM ran out "
          "of CTAs, as a fraction of the span", flush=True)


if __name__ == "__main__":
    main()
