"""Decode speed: one new query per sequence against a KV cache, forward only.
jax_fa4 against cuDNN (jax.nn.dot_product_attention) and flash-attn-4 (PyTorch,
``flash_attn_varlen_func`` with ``seqused_k`` and, paged, ``page_table``), all in one
process, timed in alternating rounds (bench_attention.py's ``interleaved``).

Cases: B in --batches x Sk in --seqlens x --kinds (gqa: 32 query heads on 8 KV
heads, mqa: 32 on 1), head dim 128, bf16, every sequence's cache full (kv_lengths =
Sk, passed as data), and two layouts: contiguous ``[B, Sk, Hkv, D]`` (jax_fa4,
cuDNN, flash-attn-4) and paged (pages of --page-size at shuffled places of a pool;
jax_fa4 and flash-attn-4; cuDNN takes no page table). Cases whose K and V exceed
--max-gib are left out.

Reported per implementation: time, K / V bytes read per second, that as a share of
the copy bandwidth measured in the same process (an XLA negation of a 4 GiB array,
bytes read + written per second), and jax_fa4's speed-up over the peers.
Writes bench_decode_<date>.csv to --out (default ./bench_out).

    python benchmarks/bench_decode.py [--out DIR] [--batches 1,16] [--seqlens 1024,8192]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import inspect
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_attention import interleaved, release_torch_memory, time_calls  # noqa: E402

import jax_fa4  # noqa: E402

HEADS, HDIM = 32, 128
KINDS = {"gqa": 8, "mqa": 1}


def copy_bandwidth(gib: float = 4.0) -> float:
    """Bytes per second of an XLA elementwise pass (read + write) over ``gib`` GiB."""
    n = int(gib * 2**30) // 2
    x = jnp.ones((n,), jnp.bfloat16)
    neg = jax.jit(lambda x: -x)
    t = time_calls(lambda: neg(x), jax.block_until_ready, 10)
    return 2 * n * 2 / t


def _torch(x):
    """The JAX array as a torch tensor on the same memory (no copy)."""
    import torch.utils.dlpack

    return torch.utils.dlpack.from_dlpack(x)


def _fa4(q, k, v, lengths, table=None):
    """flash-attn-4's decode call, or None where its interface lacks the arguments."""
    from flash_attn.cute import interface

    func = interface.flash_attn_varlen_func
    params = inspect.signature(func).parameters
    if "seqused_k" not in params or (table is not None and "page_table" not in params):
        return None
    tq, tk, tv, tl = (_torch(x) for x in (q, k, v, lengths))
    kw = dict(seqused_k=tl)
    if table is not None:
        kw["page_table"] = _torch(table)
    if "max_seqlen_q" in params:
        kw["max_seqlen_q"] = q.shape[1]

    def call():
        out = func(tq, tk, tv, **kw)
        return out[0] if isinstance(out, tuple) else out

    return call


def _torch_sync(_):
    import torch

    torch.cuda.synchronize()


def bench_case(kind, b, sk, args, peers):
    """{impl: seconds} of the contiguous and the paged layout of one case (two
    alternating-round groups, so that each layout's data alone is in memory)."""
    hkv = KINDS[kind]
    kq, kk, kv = jax.random.split(jax.random.key(b * 7 + sk), 3)
    q = jax.random.normal(kq, (b, 1, HEADS, HDIM), jnp.bfloat16)
    lengths = jnp.full((b,), sk, jnp.int32)
    results = {}

    def ours(q, k, v, lengths, table=None):
        return jax_fa4.attention(q, k, v, kv_lengths=lengths, page_table=table,
                                 implementation="cute")

    def run(calls, syncs):
        def sync(out):
            for s in syncs:
                s(out)
        times = interleaved(calls, sync, rounds=args.rounds, inner=args.iters, warmup=1,
                            settle=args.settle_ms / 1e3)
        results.update({n: statistics.median(t) for n, t in times.items()})

    k = jax.random.normal(kk, (b, sk, hkv, HDIM), jnp.bfloat16)
    v = jax.random.normal(kv, (b, sk, hkv, HDIM), jnp.bfloat16)
    f = jax.jit(ours)
    calls = {"jax_fa4": lambda: f(q, k, v, lengths)}
    syncs = [jax.block_until_ready]
    if "cudnn" in peers:
        g = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                  implementation="cudnn"))
        calls["cudnn"] = lambda: g(q, k, v)
    if "fa4" in peers:
        fa4 = _fa4(q, k, v, lengths)
        if fa4 is not None:
            calls["fa4"] = fa4
            syncs.append(_torch_sync)
    run(calls, syncs)
    # Paged: pools of random pages, each sequence's at shuffled places. The
    # contiguous K / V go first, so that the largest caches fit once.
    calls = syncs = k = v = None
    ps = args.page_size
    per_seq = -(-sk // ps)
    table = jax.random.permutation(jax.random.key(1), b * per_seq).astype(jnp.int32)
    table = table.reshape(b, per_seq)
    k = jax.random.normal(kk, (b * per_seq, ps, hkv, HDIM), jnp.bfloat16)
    v = jax.random.normal(kv, (b * per_seq, ps, hkv, HDIM), jnp.bfloat16)
    calls = {"jax_fa4_paged": lambda: f(q, k, v, lengths, table)}
    syncs = [jax.block_until_ready]
    if "fa4" in peers:
        fa4 = _fa4(q, k, v, lengths, table)
        if fa4 is not None:
            calls["fa4_paged"] = fa4
            syncs.append(_torch_sync)
    run(calls, syncs)
    if "fa4" in peers:
        release_torch_memory()
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_out", help="folder for the CSV (default ./bench_out)")
    p.add_argument("--peers", default="fa4,cudnn", help="fa4 (flash-attn-4, PyTorch), cudnn")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--seqlens", default="1024,8192,32768,131072")
    p.add_argument("--kinds", default="gqa,mqa")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--max-gib", type=float, default=40.0, help="largest K + V of a case")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--settle-ms", type=float, default=50.0)
    args = p.parse_args(argv)
    peers = set(args.peers.split(",")) if args.peers else set()
    os.makedirs(args.out, exist_ok=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for kind in args.kinds.split(","):
        for b in map(int, args.batches.split(",")):
            for sk in map(int, args.seqlens.split(",")):
                kv_bytes = 2 * b * sk * KINDS[kind] * HDIM * 2
                if kv_bytes > args.max_gib * 2**30:
                    print(f"{kind} B={b} Sk={sk}: K + V {kv_bytes / 2**30:.0f} GiB, left out")
                    continue
                print(f"{kind} B={b} Sk={sk} ...", flush=True)
                try:
                    times = bench_case(kind, b, sk, args, peers)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"  failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                for impl, t in times.items():
                    rows.append(dict(kind=kind, batch=b, seqlen_k=sk, impl=impl, ms=t * 1e3,
                                     gbps=kv_bytes / t / 1e9, copy_share=kv_bytes / t / bw))
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    path = os.path.join(args.out, f"bench_decode_{stamp}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["kind"])
        w.writeheader()
        w.writerows(rows)
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s\n"
          "kind batch    Sk impl              ms    GB/s  copy%  | jax_fa4's speed-up")
    by = {(r["kind"], r["batch"], r["seqlen_k"], r["impl"]): r for r in rows}
    for r in rows:
        mine = "jax_fa4_paged" if r["impl"].endswith("paged") else "jax_fa4"
        ours = by.get((r["kind"], r["batch"], r["seqlen_k"], mine))
        ratio = (f"{r['ms'] / ours['ms']:6.3f}" if ours and r["impl"] != mine else "")
        print(f"{r['kind']:<4} {r['batch']:5d} {r['seqlen_k']:6d} {r['impl']:<14} "
              f"{r['ms']:8.3f} {r['gbps']:7.0f} {100 * r['copy_share']:5.1f}  | {ratio}")
    print(f"csv: {path}")
    return rows


if __name__ == "__main__":
    main()
