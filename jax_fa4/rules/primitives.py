"""The `fa4_fwd` and `fa4_bwd` primitives and all their rules, registered here.

* abstract eval: shapes and dtypes;
* batching: any vmap axis of any operand folds into the batch dimension;
* lowering: CUDA -> our CuTe DSL kernels through `jax_fa4.ffi` when the target
  architecture has a kernel for the problem; every other platform (and CUDA
  without a kernel) -> the blockwise pure-JAX reference, logged once.
The VJP (a `jax.custom_vjp` over the two primitives) lives in `jax_fa4.api`.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_fa4 import reference
from jax_fa4.config import (
    AttentionConfig,
    kernel_support_error,
    target_arch,
)
from jax_fa4.rules import kernels_cuda, sharding
from jax_fa4.rules.ranges import mask_arrays, masked_kernel_error

logger = logging.getLogger("jax_fa4")
_logged: set[str] = set()


def log_once(message: str) -> None:
    """Log a fallback reason once per process (visible, never silent)."""
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


fa4_fwd_p = Primitive("fa4_fwd")
fa4_fwd_p.multiple_results = True
fa4_bwd_p = Primitive("fa4_bwd")
fa4_bwd_p.multiple_results = True


def _impl(prim, *args, config):
    # Eager calls run the same compiled path as jit.
    return jax.jit(functools.partial(prim.bind, config=config))(*args)


fa4_fwd_p.def_impl(functools.partial(_impl, fa4_fwd_p))
fa4_bwd_p.def_impl(functools.partial(_impl, fa4_bwd_p))

# The lowering attaches a custom_partitioning rule (sharding.py), which needs
# the device assignment while lowering. JAX has no public way to ask for it;
# its own cuDNN attention primitives register the same way.
from jax._src import dispatch as _dispatch  # noqa: E402

_dispatch.prim_requires_devices_during_lowering.add(fa4_fwd_p)
_dispatch.prim_requires_devices_during_lowering.add(fa4_bwd_p)


# ----------------------------------------------------------------------------
# Abstract evaluation


def _varying(aval) -> frozenset:
    mat = getattr(aval, "manual_axis_type", None)
    return mat.varying if mat is not None else frozenset(getattr(aval, "vma", ()) or ())


def _aval(shape, dtype, *like):
    """A result aval that varies over the shard_map axes its operands vary over.

    (The field holding those axes is `manual_axis_type` in JAX 0.10 and `vma`
    before; copy whichever the operand has.)
    """
    src = max(like, key=lambda a: len(_varying(a)))
    if not _varying(src):
        return jax.core.ShapedArray(shape, dtype)
    # A varying aval needs the mesh; the result's rank differs from the
    # operand's, so give it a replicated spec of its own rank.
    sharding = jax.sharding.NamedSharding(src.sharding.mesh, jax.sharding.PartitionSpec())
    for attr in ("manual_axis_type", "vma"):
        if hasattr(src, attr):
            return jax.core.ShapedArray(
                shape, dtype, sharding=sharding, **{attr: getattr(src, attr)}
            )
    return jax.core.ShapedArray(shape, dtype)


@fa4_fwd_p.def_abstract_eval
def _fwd_abstract(q, k, v, *masks, config: AttentionConfig):
    # masks: the per-batch mask arrays the config names, then the page table, then the
    # sinks (AttentionConfig).
    n = config.num_mask_operands + config.paged + config.sinks
    if len(masks) != n:
        raise TypeError(f"fa4_fwd takes {3 + n} operands, got {3 + len(masks)}")
    b, sq, hq, _ = q.shape
    out = _aval((b, sq, hq, v.shape[-1]), q.dtype, q, k, v)
    lse = _aval((b, hq, sq), jnp.float32, q, k, v)
    return out, lse


@fa4_bwd_p.def_abstract_eval
def _bwd_abstract(q, k, v, out, lse, dout, *rest, config: AttentionConfig):
    # rest: the mask arrays, then LSE's cotangent unless it is a symbolic zero (api.py).
    n = 6 + config.num_mask_operands
    if len(rest) not in (n - 6, n - 5):
        raise TypeError(f"fa4_bwd takes {n} or {n + 1} operands, got {6 + len(rest)}")
    operands = (q, k, v, out, lse, dout, *rest)
    return (
        _aval(q.shape, q.dtype, *operands),
        _aval(k.shape, k.dtype, *operands),
        _aval(v.shape, v.dtype, *operands),
    )


# ----------------------------------------------------------------------------
# Batching: fold the vmapped axis into the batch dimension (axis 0 of every
# operand and result), so the kernels see one larger batch.


def _fold(x, bdim, size):
    if bdim is None:
        x = jnp.broadcast_to(x, (size,) + x.shape)
    else:
        x = jnp.moveaxis(x, bdim, 0)
    return x.reshape((size * x.shape[1],) + x.shape[2:])


def _unfold(x, size):
    return x.reshape((size, x.shape[0] // size) + x.shape[1:])


def _batch_rule(prim, args, dims, *, config):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if prim is fa4_fwd_p and all(d is None for d in dims[1:]):
        return _fwd_batch_shared_kv(args, dims[0], size, config)
    if config.paged:
        # The pools hold every sequence's pages: the vmapped sequences index them
        # through their page tables, which fold into the batch with the queries.
        if dims[1] is not None or dims[2] is not None:
            raise NotImplementedError("jax_fa4.attention with a page_table: vmap over the "
                                      "page pools is not supported; vmap the queries, "
                                      "page tables and lengths over one pool")
        folded = [a if i in (1, 2) else _fold(a, d, size)
                  for i, (a, d) in enumerate(zip(args, dims))]
        results = prim.bind(*folded, config=config)
        return [_unfold(r, size) for r in results], [0] * len(results)
    folded = [_fold(a, d, size) for a, d in zip(args, dims)]
    results = prim.bind(*folded, config=config)
    return [_unfold(r, size) for r in results], [0] * len(results)


def _fwd_batch_shared_kv(args, q_dim, size, config):
    """vmap over queries against one K/V: fold the vmapped axis into the query heads.

    Query head h reads kv head h // G. Ordering the folded heads as
    (kv head, vmapped index, group member) keeps that rule with group size
    size * G, so K and V are read as they are instead of copied `size` times.
    (Forward only: in the backward, per-index dK / dV must not be summed.)
    """
    q, k, v, *masks = args  # the masks depend on (batch, query, key) only: shared too
    n, (b, sq, hq, d) = size, q.shape[:q_dim] + q.shape[q_dim + 1 :]
    hkv, g = k.shape[2], hq // k.shape[2]
    q = jnp.moveaxis(q, q_dim, 0).reshape(n, b, sq, hkv, g, d)
    q = q.transpose(1, 2, 3, 0, 4, 5).reshape(b, sq, hkv * n * g, d)
    if config.sinks:  # [B, Hq] -> the folded heads' order
        sinks = masks[-1].reshape(b, hkv, 1, g)
        masks[-1] = jnp.broadcast_to(sinks, (b, hkv, n, g)).reshape(b, hkv * n * g)
    out, lse = fa4_fwd_p.bind(q, k, v, *masks, config=config)
    dv = out.shape[-1]
    out = out.reshape(b, sq, hkv, n, g, dv).transpose(3, 0, 1, 2, 4, 5)
    lse = lse.reshape(b, hkv, n, g, sq).transpose(2, 0, 1, 3, 4)
    return [out.reshape(n, b, sq, hq, dv), lse.reshape(n, b, hq, sq)], [0, 0]


batching.primitive_batchers[fa4_fwd_p] = functools.partial(_batch_rule, fa4_fwd_p)
batching.primitive_batchers[fa4_bwd_p] = functools.partial(_batch_rule, fa4_bwd_p)


# ----------------------------------------------------------------------------
# Lowering


def _mask_kwargs(config: AttentionConfig, masks) -> dict:
    return dict(causal=config.causal, bottom_right=config.bottom_right, window=config.window,
                masks=mask_arrays(config, masks), softcap=config.softcap)


def _reference_fwd(q, k, v, *operands, config):
    if config.paged:  # the pages gathered into contiguous keys
        n = config.num_mask_operands
        k, v = reference.gather_pages(k, v, operands[n])
        operands = operands[:n] + operands[n + 1:]
    return reference.attention_blockwise(q, k, v, scale=config.scale,
                                         sinks=operands[-1] if config.sinks else None,
                                         **_mask_kwargs(config, operands))


def _reference_bwd(q, k, v, out, lse, dout, *rest, config):
    n = config.num_mask_operands
    masks, dlse = rest[:n], rest[n:]
    return reference.attention_bwd_blockwise(
        q, k, v, out, lse, dout, dlse[0] if dlse else None, scale=config.scale,
        **_mask_kwargs(config, masks))


class KernelUnavailableError(ValueError):
    """implementation="cute" was asked for where no kernel can run."""


def _no_kernel(config: AttentionConfig, why: str) -> None:
    if config.implementation == "cute":
        raise KernelUnavailableError(f"jax_fa4: implementation='cute' but {why}")
    if config.implementation is None:
        log_once(f"jax_fa4: {why}; using the reference path (pure JAX, slower)")


def _kernel_problem(ctx, config, kind) -> tuple[str | None, str | None]:
    """(arch, None) when a kernel serves this lowering, else (None, reason)."""
    if config.implementation == "reference":
        return None, "reference requested"
    q, _, v = ctx.avals_in[:3]
    arch, source = target_arch()
    if arch is None:
        return None, f"no kernel for this GPU ({source})"
    err = kernel_support_error(arch, q.dtype, q.shape[-1], v.shape[-1])
    if err is None and config.masked:
        err = masked_kernel_error(arch, kind, config)
    if err is None:
        err = kernels_cuda.unavailable(arch)
    return (arch, None) if err is None else (None, err)


def _make_lowering(kind, reference_fn, kernel_fn, platform):
    def lower(ctx, args, fn, config, **static):
        # The sharding rule wraps only the final computation (sharding.py); a
        # backward without LSE's cotangent has one operand fewer.
        dlse = kind == "bwd" and len(args) > 6 + config.num_mask_operands
        call = sharding.partitioned(kind, config, dlse, fn, config=config, **static)
        return mlir.lower_fun(call, multiple_results=True)(ctx, *args)

    def lowering(ctx, *args, config):
        if platform != "cuda":
            if config.implementation != "reference":
                _no_kernel(config, f"no jax_fa4 kernel on platform {platform}")
            return lower(ctx, args, reference_fn, config=config)
        arch, why = _kernel_problem(ctx, config, kind)
        if arch is None:
            if config.implementation != "reference":
                _no_kernel(config, why)
            return lower(ctx, args, reference_fn, config=config)
        return lower(ctx, args, kernel_fn, config=config, arch=arch)

    return lowering


for _platform in ("cpu", "cuda", "rocm", "tpu"):
    mlir.register_lowering(
        fa4_fwd_p,
        _make_lowering("fwd", _reference_fwd, kernels_cuda.forward, _platform),
        platform=_platform,
    )
    mlir.register_lowering(
        fa4_bwd_p,
        _make_lowering("bwd", _reference_bwd, kernels_cuda.backward, _platform),
        platform=_platform,
    )
