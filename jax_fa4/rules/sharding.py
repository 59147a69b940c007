"""Sharding rules: under jit with sharded inputs, attention runs per device.

Attention is independent across batch entries and across (query-head group,
kv head) pairs, so both the batch and the head dimensions can stay sharded;
sequence and head dims must be whole on each device: a sequence-sharded input
raises an error that names ``jax_fa4.ring_attention``, the shard_map program for
sequence shards.

The rule is attached inside each primitive's lowering, as JAX's own cuDNN
attention does: vmap and autodiff act on the primitives first, and only the
final computation (kernel call or reference) is wrapped in
`custom_partitioning`. Under SPMD partitioning XLA asks `_partition` for the
operand shardings it wants and calls the wrapped computation on local shards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Operands: q [B,S,H,D], k [B,T,K,D], v [B,T,K,E] (+ out, lse, dout for the backward),
# then the mask arrays the config names (q / kv lengths [B], q / kv segment ids [B,S] /
# [B,T]: they shard with the batch), then the forward's sinks [B,H] (with the batch
# and the heads), or the backward's dlse [B,H,S] unless LSE's cotangent is a
# symbolic zero. Results: out, lse / dq, dk, dv.
_QKV = ("b s h d", "b t k d", "b t k e")
_BWD_EXTRA = ("b s h e", "b h s", "b s h e")
# In order of first appearance in the rules (the verifier wants them sorted).
_REPLICATED_FACTORS = ("s", "d", "t", "e")
_PAGED_REPLICATED_FACTORS = ("s", "d", "p", "r", "e", "n")


def _mask_factors(config) -> tuple[str, ...]:
    return (("b",) * config.q_lengths + ("b",) * config.kv_lengths
            + ("b s", "b t") * config.segments)


def _rule(kind: str, config, dlse: bool) -> str:
    if kind == "fwd":
        sinks = ("b h",) if config.sinks else ()
        # Paged: K / V are pools [pages, page rows, k, d] that every batch entry reads
        # through its row of the page table [b, n].
        qkv, table = (("b s h d", "p r k d", "p r k e"), ("b n",)) if config.paged else (_QKV, ())
        return ", ".join(qkv + _mask_factors(config) + table + sinks) + " -> b s h e, b h s"
    args = _QKV + _BWD_EXTRA + _mask_factors(config) + (("b h s",) if dlse else ())
    return ", ".join(args) + " -> b s h d, b t k d, b t k e"


def _specs(kind: str, config, dlse: bool, batch, heads):
    bshd = P(batch, None, heads, None)
    bhs = P(batch, heads, None)
    masks = ((P(batch),) * config.q_lengths + (P(batch),) * config.kv_lengths
             + (P(batch, None),) * (2 * config.segments))
    if kind == "fwd":
        sinks = (P(batch, heads),) if config.sinks else ()
        if config.paged:
            pool = P(None, None, heads, None)
            return (bshd, pool, pool) + masks + (P(batch, None),) + sinks, (bshd, bhs)
        return (bshd, bshd, bshd) + masks + sinks, (bshd, bhs)
    return (bshd,) * 4 + (bhs, bshd) + masks + ((bhs,) if dlse else ()), (bshd,) * 3


def _axes_size(mesh, axes) -> int:
    if axes is None:
        return 1
    names = axes if isinstance(axes, tuple) else (axes,)
    size = 1
    for n in names:
        size *= mesh.shape[n]
    return size


def _plan(mesh, arg_shapes):
    """(batch axes, head axes) to keep sharded, read off the query's sharding."""
    q, k = arg_shapes[0], arg_shapes[1]

    def spec_of(x):
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        return tuple(spec) + (None,) * (4 - len(spec)) if spec is not None else (None,) * 4

    spec = spec_of(q)
    if spec[1] is not None or spec_of(k)[1] is not None:
        # Gathering K / V and Q onto every device would compute every query on every
        # device (and, at long sequences, run out of memory with no word why).
        raise ValueError(
            "jax_fa4.attention: the sequence dimension of query / key / value is sharded "
            f"(query {spec_of(q)}, key {spec_of(k)}); attention under jit keeps batch and "
            "head sharding only. For sequence (context) parallelism call "
            "jax_fa4.ring_attention inside jax.shard_map.")
    batch, heads = spec[0], spec[2]
    if batch is not None and q.shape[0] % _axes_size(mesh, batch):
        batch = None
    # A head sharding must split query heads and kv heads alike, so that each
    # device keeps whole GQA groups.
    if heads is not None:
        n = _axes_size(mesh, heads)
        if q.shape[2] % n or k.shape[2] % n:
            heads = None
    return batch, heads


def _make(impl: Callable, specs_fn, rule: str, n_args: int, replicated: tuple[str, ...]):
    @functools.partial(custom_partitioning, static_argnums=(n_args,))
    def call(*args):
        *arrays, static = args
        return tuple(impl(*arrays, **dict(static)))

    def partition(static, mesh, arg_shapes, result_shape):
        batch, heads = _plan(mesh, arg_shapes)
        arg_specs, out_specs = specs_fn(batch, heads)

        def lower(*arrays):
            return tuple(impl(*arrays, **dict(static)))

        return (
            mesh,
            lower,
            tuple(NamedSharding(mesh, s) for s in out_specs),
            tuple(NamedSharding(mesh, s) for s in arg_specs),
        )

    def infer(static, mesh, arg_shapes, result_shape):
        del static, result_shape
        _, out_specs = specs_fn(*_plan(mesh, arg_shapes))
        return tuple(NamedSharding(mesh, s) for s in out_specs)

    call.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=rule,
        need_replication_factors=replicated,
    )
    return call


@functools.cache
def _partitioned(kind: str, config, dlse: bool, impl: Callable) -> Callable:
    n_args = 3 + config.num_mask_operands + config.paged + config.sinks if kind == "fwd" else (
        6 + config.num_mask_operands + dlse)
    specs_fn = functools.partial(_specs, kind, config, dlse)
    replicated = _PAGED_REPLICATED_FACTORS if config.paged else _REPLICATED_FACTORS
    return _make(impl, specs_fn, _rule(kind, config, dlse), n_args, replicated)


def partitioned(kind: str, mask_config, dlse: bool, impl: Callable, **static) -> Callable:
    """``impl(*arrays, **static)`` with the attention sharding rule attached, for the
    operands of ``kind`` ("fwd" / "bwd") that ``mask_config`` (the AttentionConfig) and
    ``dlse`` name.

    ``static`` values must be hashable (the config and the kernel arch).
    """
    call = _partitioned(kind, mask_config, dlse, impl)
    frozen = tuple(sorted(static.items()))
    return lambda *arrays: call(*arrays, frozen)
