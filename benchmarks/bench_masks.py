"""Masked and modified attention speed: jax_fa4's kernels against flash-attn-4
(PyTorch) and cuDNN (jax.nn.dot_product_attention) where they take the same mask and
score modifier, all in one process, timed as bench_attention.py times (alternating
rounds, settling, medians; see its docstring). bf16, hidden 2048 (16 heads of 128
unless a row says otherwise).

Cases:
  lengths      B=2 x 8k, causal, key lengths (8192, 4096)      vs cuDNN
  window 8k    B=2 x 8k, causal, window (1024, 0)              vs cuDNN, flash-attn-4
  window 32k   B=1 x 32k, causal, window (1024, 0)             vs cuDNN, flash-attn-4
  packed       B=2 x 8k rows of 8 documents of 1k, causal      vs flash-attn-4 varlen
               (cu_seqlens) and jax_fa4's plain causal over the whole rows
  chunk        Sq = 1k queries against Sk = 8k keys, B=2,       vs flash-attn-4 causal
               bottom-right causal (chunked prefill)            (its causal is bottom-right)
  sinks        B=2 x 8k, 32 query heads of 64 on 4 KV heads,    vs flash-attn-4
               causal, window (128, 0), sinks (GPT-OSS's shape) (learnable_sink)
  softcap      B=2 x 8k, causal, softcap 30 (Gemma 2)           vs flash-attn-4 (softcap)
  hdim96       B=2 x 8k, causal, 16 heads of 96                 vs cuDNN, flash-attn-4
  hdim192      B=2 x 8k, causal, 16 heads of 192                vs cuDNN, flash-attn-4
  mla          B=2 x 8k, causal, 16 heads of (192, 128)         vs flash-attn-4 (jax.nn
               (DeepSeek's)                                     takes no other v dim)
  short32      4096 sequences of 32, causal, 16 heads of 64     vs cuDNN, flash-attn-4
  short128     1024 sequences of 128, causal, 16 heads of 128   vs cuDNN, flash-attn-4
  padded128    1024 sequences of 128 with lengths in [32, 128],  vs cuDNN (query / key
               not causal, 12 heads of 64 (BERT-base's)         lengths)
  cross128     B=16, 4096 queries against 128 keys with key     vs cuDNN (key lengths)
               lengths in [8, 128], 10 heads of 64 (text
               conditioning)
  vit197       256 x 197 tokens, 12 heads of 64, no mask        vs cuDNN, flash-attn-4
               (ViT-B/16 at 224 px)
  clip257      128 x 257 tokens, 16 heads of 64 (ViT-L/14)      vs cuDNN, flash-attn-4
  vit577       64 x 577 tokens, 12 heads of 64 (ViT-B/16, 384)  vs cuDNN, flash-attn-4
  whisper      16 x 1500 tokens, 20 heads of 64 (Whisper's      vs cuDNN, flash-attn-4
               encoder)

TFLOP/s count the visible (query, key) pairs: forward 2 * H * (D + Dv) * pairs,
backward 2.5x.
Writes bench_masks_<date>.csv to --out (default ./bench_out).

    python benchmarks/bench_masks.py [--out DIR] [--peers fa4,cudnn] [--cases lengths,...]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import inspect
import os
import sys
from dataclasses import dataclass, field

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_attention import (  # noqa: E402
    MiB,
    Prepared,
    measure_rounds,
    prepare_jax,
    release_torch_memory,
)

import jax_fa4  # noqa: E402
from jax_fa4.reference import Masks, visible  # noqa: E402

HEADS, HDIM = 16, 128


@dataclass
class Case:
    name: str
    b: int
    sq: int
    sk: int
    # jax_fa4.attention's mask arguments; jax.nn's for cuDNN (None: cuDNN has none).
    ours: dict
    cudnn: dict | None = None
    # flash-attn-4: "func" (flash_attn_func with these kwargs), "varlen" (documents of
    # ``doc`` tokens through flash_attn_varlen_func), or None.
    fa4: str | None = None
    fa4_kwargs: dict = field(default_factory=dict)
    doc: int = 0
    # Also time jax_fa4 with plain causal on the same shape ("plain").
    plain: bool = False
    heads: int = HEADS
    kv_heads: int = HEADS
    hdim: int = HDIM
    hdim_v: int | None = None  # None: hdim


def cases() -> list[Case]:
    docs = np.repeat(np.arange(8, dtype=np.int32), 1024)[None].repeat(2, 0)
    lengths = np.array([8192, 4096], np.int32)
    sinks = np.linspace(-1.0, 2.0, 32, dtype=np.float32)
    rng = np.random.default_rng(0)
    padded = rng.integers(32, 129, 1024).astype(np.int32)
    prompts = rng.integers(8, 129, 16).astype(np.int32)
    return [
        Case("lengths", 2, 8192, 8192, dict(causal=True, kv_lengths=lengths),
             cudnn=dict(is_causal=True, key_value_seq_lengths=lengths)),
        Case("window8k", 2, 8192, 8192, dict(causal=True, window=(1024, 0)),
             cudnn=dict(is_causal=True, local_window_size=(1024, 0)), fa4="func",
             fa4_kwargs=dict(causal=True, window_size=(1024, 0))),
        Case("window32k", 1, 32768, 32768, dict(causal=True, window=(1024, 0)),
             cudnn=dict(is_causal=True, local_window_size=(1024, 0)), fa4="func",
             fa4_kwargs=dict(causal=True, window_size=(1024, 0))),
        Case("packed", 2, 8192, 8192, dict(causal=True, q_segment_ids=docs), fa4="varlen",
             doc=1024, plain=True),
        Case("chunk", 2, 1024, 8192, dict(causal="bottom_right"), fa4="func",
             fa4_kwargs=dict(causal=True)),
        Case("sinks", 2, 8192, 8192, dict(causal=True, window=(128, 0), sinks=sinks),
             fa4="func", fa4_kwargs=dict(causal=True, window_size=(128, 0),
                                         learnable_sink=sinks),
             heads=32, kv_heads=4, hdim=64),
        Case("softcap", 2, 8192, 8192, dict(causal=True, softcap=30.0), fa4="func",
             fa4_kwargs=dict(causal=True, softcap=30.0)),
        Case("hdim96", 2, 8192, 8192, dict(causal=True), cudnn=dict(is_causal=True),
             fa4="func", fa4_kwargs=dict(causal=True), hdim=96),
        Case("hdim192", 2, 8192, 8192, dict(causal=True), cudnn=dict(is_causal=True),
             fa4="func", fa4_kwargs=dict(causal=True), hdim=192),
        Case("mla", 2, 8192, 8192, dict(causal=True), fa4="func",
             fa4_kwargs=dict(causal=True), hdim=192, hdim_v=128),
        Case("short32", 4096, 32, 32, dict(causal=True), cudnn=dict(is_causal=True),
             fa4="func", fa4_kwargs=dict(causal=True), hdim=64),
        Case("short128", 1024, 128, 128, dict(causal=True), cudnn=dict(is_causal=True),
             fa4="func", fa4_kwargs=dict(causal=True)),
        Case("padded128", 1024, 128, 128, dict(q_lengths=padded, kv_lengths=padded),
             cudnn=dict(query_seq_lengths=padded, key_value_seq_lengths=padded),
             heads=12, kv_heads=12, hdim=64),
        Case("cross128", 16, 4096, 128, dict(kv_lengths=prompts),
             cudnn=dict(key_value_seq_lengths=prompts), heads=10, kv_heads=10, hdim=64),
        *(Case(name, b, s, s, {}, cudnn={}, fa4="func", fa4_kwargs=dict(causal=False),
               heads=h, kv_heads=h, hdim=64)
          for name, b, s, h in (("vit197", 256, 197, 12), ("clip257", 128, 257, 16),
                                ("vit577", 64, 577, 12), ("whisper", 16, 1500, 20))),
    ]


def visible_pairs(c: Case) -> int:
    """Visible (query, key) pairs of the case, counted with the reference's rule."""
    kw = c.ours
    causal = kw.get("causal", False)
    m = Masks(None if "q_lengths" not in kw else jnp.asarray(kw["q_lengths"]),
              None if "kv_lengths" not in kw else jnp.asarray(kw["kv_lengths"]),
              None if "q_segment_ids" not in kw else jnp.asarray(kw["q_segment_ids"]),
              None if "q_segment_ids" not in kw else jnp.asarray(kw["q_segment_ids"]))
    step = min(c.sq, 1024)

    @jax.jit
    def count(i0, m):
        vis = visible(i0 + jnp.arange(step), jnp.arange(c.sk), c.sq, c.sk,
                      causal=bool(causal), bottom_right=causal == "bottom_right",
                      window=kw.get("window"), masks=m)
        return jnp.broadcast_to(vis, (c.b, *vis.shape[1:])).sum()

    # Rows past sq in the last step are not visible (the reference's i < q length).
    return sum(int(count(i0, m)) for i0 in range(0, c.sq, step))


def _with_arrays(kw, call):
    """(the array arguments of ``kw`` by name, ``attn(q, k, v, causal, *arrays)``
    calling ``call(q, k, v, **kw)`` with them): ``prepare_jax`` passes the arrays
    to its jitted functions as arguments."""
    arrays = {n: jnp.asarray(x) for n, x in kw.items() if isinstance(x, np.ndarray)}
    rest = {n: x for n, x in kw.items() if n not in arrays}

    def attn(q, k, v, _, *values):
        return call(q, k, v, **rest, **dict(zip(arrays, values)))

    return arrays, attn


def prepare_fa4(c: Case, q, k, v) -> Prepared:
    """flash-attn-4 (PyTorch) on the case's mask, ready to time, with its peak memory."""
    import torch
    from flash_attn.cute import interface

    tq, tk, tv = (torch.from_numpy(np.array(x.astype(jnp.float32))).cuda().bfloat16()
                  for x in (q, k, v))
    if c.fa4 == "varlen":
        # The batch's rows as one sequence of documents.
        tq, tk, tv = (t.reshape(-1, *t.shape[2:]) for t in (tq, tk, tv))
        n = tq.shape[0] // c.doc
        cu = torch.arange(0, (n + 1) * c.doc, c.doc, dtype=torch.int32, device="cuda")
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
        params = inspect.signature(interface.flash_attn_varlen_func).parameters
        if "max_seqlen_q" in params:
            kw.update(max_seqlen_q=c.doc, max_seqlen_k=c.doc)
        func = interface.flash_attn_varlen_func
    else:
        kw, func = dict(c.fa4_kwargs), interface.flash_attn_func
        kw = {n: torch.from_numpy(x).cuda() if isinstance(x, np.ndarray) else x
              for n, x in kw.items()}
    for t in (tq, tk, tv):
        t.requires_grad_(True)

    def fwd():
        out = func(tq, tk, tv, **kw)
        return out[0] if isinstance(out, tuple) else out

    dout = torch.randn_like(fwd())
    torch.autograd.grad(fwd(), (tq, tk, tv), dout)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(fwd(), (tq, tk, tv), dout)
    torch.cuda.synchronize()
    mem = {"peak_mib": (torch.cuda.max_memory_allocated() - before) / MiB}
    del grads
    out = fwd()
    return Prepared(fwd, lambda: torch.autograd.grad(out, (tq, tk, tv), dout,
                                                     retain_graph=True),
                    lambda _: torch.cuda.synchronize(), mem)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_out", help="folder for the CSV (default ./bench_out)")
    p.add_argument("--peers", default="fa4,cudnn", help="fa4 (flash-attn-4, PyTorch), cudnn")
    p.add_argument("--cases", default="", help="only these cases (names, comma-separated)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--settle-ms", type=float, default=200.0)
    args = p.parse_args(argv)
    peers = set(args.peers.split(",")) if args.peers else set()
    os.makedirs(args.out, exist_ok=True)
    chosen = [c for c in cases() if not args.cases or c.name in args.cases.split(",")]
    rows = []
    for i, c in enumerate(chosen):
        kq, kk, kv = jax.random.split(jax.random.key(i), 3)
        dv = c.hdim_v or c.hdim
        q = jax.random.normal(kq, (c.b, c.sq, c.heads, c.hdim), jnp.bfloat16)
        k = jax.random.normal(kk, (c.b, c.sk, c.kv_heads, c.hdim), jnp.bfloat16)
        v = jax.random.normal(kv, (c.b, c.sk, c.kv_heads, dv), jnp.bfloat16)
        # Mask arrays are arguments of the timed functions, as in a training step
        # that gets them with its batch: their passes to the kernels' intervals
        # are timed with the attention.
        impls = {"jax_fa4": _with_arrays(c.ours, lambda q, k, v, **kw: jax_fa4.attention(
            q, k, v, implementation="cute", **kw))}
        if c.plain:
            impls["jax_fa4_plain"] = ({}, lambda q, k, v, _: jax_fa4.attention(
                q, k, v, causal=True, implementation="cute"))
        if c.cudnn is not None and "cudnn" in peers:
            impls["cudnn"] = _with_arrays(c.cudnn, lambda q, k, v, **kw:
                                          jax.nn.dot_product_attention(
                                              q, k, v, implementation="cudnn", **kw))
        preps = {}
        for name, (arrays, attn) in impls.items():
            print(f"[{i + 1}/{len(chosen)}] {c.name}: {name} (set up) ...", flush=True)
            try:
                preps[name] = prepare_jax(attn, q, k, v, None, data=tuple(arrays.values()))
            except Exception as e:  # noqa: BLE001 - report and continue with the others
                print(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        if c.fa4 is not None and "fa4" in peers:
            try:
                preps["fa4_torch"] = prepare_fa4(c, q, k, v)
            except Exception as e:  # noqa: BLE001
                print(f"  fa4_torch failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        results = measure_rounds(preps, args.iters, args.rounds, args.settle_ms / 1e3)
        pairs = visible_pairs(c)
        for name, (tf, tb, mem, rf, rb) in results.items():
            rows.append(dict(case=c.name, impl=name, batch=c.b, seqlen_q=c.sq, seqlen_k=c.sk,
                             fwd_ms=tf * 1e3, bwd_ms=tb * 1e3,
                             fwd_tflops=2.0 * c.heads * (c.hdim + dv) * pairs / tf / 1e12,
                             bwd_tflops=5.0 * c.heads * (c.hdim + dv) * pairs / tb / 1e12,
                             temp_mib=mem.get("temp_mib"), peak_mib=mem.get("peak_mib"),
                             fwd_range=rf, bwd_range=rb))
        del preps
        if "fa4" in peers:
            release_torch_memory()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    path = os.path.join(args.out, f"bench_masks_{stamp}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["case"])
        w.writeheader()
        w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    print("\ncase       impl          fwd TF/s  bwd TF/s   fwd ms   bwd ms  | jax_fa4's "
          "speed-up fwd / bwd | temp/peak MiB | range f% b%")
    by = {(r["case"], r["impl"]): r for r in rows}
    for r in rows:
        ours = by[(r["case"], "jax_fa4")]
        ratio = (f"{r['fwd_ms'] / ours['fwd_ms']:6.3f} {r['bwd_ms'] / ours['bwd_ms']:6.3f}"
                 if r["impl"] != "jax_fa4" else " " * 13)
        mem = r["temp_mib"] if r["temp_mib"] is not None else r["peak_mib"]
        print(f"{r['case']:<10} {r['impl']:<13} {r['fwd_tflops']:8.1f} {r['bwd_tflops']:8.1f} "
              f"{r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f}  | {ratio:>27} | "
              f"{'-' if mem is None else f'{mem:.0f}':>13} | "
              f"{100 * r['fwd_range']:4.1f} {100 * r['bwd_range']:4.1f}")
    print(f"csv: {path}")
    return rows


if __name__ == "__main__":
    main()
