"""The CUDA lowering of the primitives: which kernels run, in which order.

Forward: one kernel. Backward: preprocess (Dpsum, LSE in log2 units, zeroed
fp32 dQ accumulator, or on sm_90a at head dims 64 / 128 zeroed per-query-block
semaphores instead: Note [dQ store first]) -> main kernel (dK, dV; dQ accumulated
in place) -> postprocess (dQ to 16-bit), or on sm_90a with ``BwdTiles.dq_fold`` /
$JAX_FA4_DQ_FOLD the main kernel writes dQ and no postprocess runs (Note [dQ fold]).
Every tensor crosses the custom call in the `[B, S, H, D]` layout the user gave; no
transposes are added around it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jax_fa4.config import (
    AttentionConfig,
    KernelKey,
    deterministic_bwd_support_error,
    dq_first_max_sq_override,
    dq_fold_override,
    dq_store_first_override,
    dtype_name,
    pdl_enabled,
    prepost_reverse_enabled,
)
from jax_fa4.ffi import cutlass_available, kernel_call

# Per tensor: the dimensions that are compile-time constants (the head dims).
_BSHD = (3,)
_BHS = ()


def unavailable(arch: str) -> str | None:
    """None when the kernels of ``arch`` can be compiled here, else why not."""
    return cutlass_available(arch)


def _key(kind: str, arch: str, q, v, config: AttentionConfig,
         dq_store_first: tuple[bool, int] | None = None,
         dq_fold: int | None = None, dlse: bool = True) -> KernelKey:
    """The compile key of one kernel. dq_store_first: the main kernel's (store first,
    up to which query length) choice, dq_fold: whether it writes dQ, with which
    lag (0: no; Note [dQ fold]); its preprocess follows both (None: the main
    kernels read the tile table, the others say no). dlse: the preprocess takes
    LSE's cotangent (False where it is a symbolic zero)."""
    if dq_store_first is None:
        dq_store_first = (_table_store_first(arch, q, config, kind)
                          if kind in ("bwd", "bwd_det") else (False, 0))
    if dq_fold is None:
        dq_fold = (_table_fold(arch, q, config)
                   if kind == "bwd" and not dq_store_first[0] else 0)
    return KernelKey(
        kind=kind,
        arch=arch,
        dtype=dtype_name(q.dtype),
        head_dim=int(q.shape[-1]),
        head_dim_v=int(v.shape[-1]),
        causal=bool(config.causal),
        scale=float(config.scale),
        # The backward's three kernels form one PDL chain (``cute_utils.pdl_start``).
        pdl=kind != "fwd" and pdl_enabled(arch),
        # The preprocess and the main kernel agree on who zeroes what
        # (Note [dQ store first]); the postprocess is the same either way.
        dq_store_first=dq_store_first[0],
        dq_first_max_sq=dq_store_first[1],
        dq_fold=dq_fold,
        dlse=dlse,
        prepost_reverse=kind in _PREPOST_KINDS and prepost_reverse_enabled(),
    )


_PREPOST_KINDS = ("bwd_pre", "bwd_pre_by_thread", "bwd_post")


def _table_fold(arch: str, q, config: AttentionConfig) -> int:
    """Whether (> 0, the lag) the non-deterministic backward main kernel writes dQ
    (Note [dQ fold]): ``$JAX_FA4_DQ_FOLD`` if set, else the sm90 tile table."""
    d = int(q.shape[-1])
    override = dq_fold_override(arch, d)
    if override is not None:
        return override
    from jax_fa4.kernels.sm90_bwd import bwd_tiles

    return bwd_tiles(d, config.causal).dq_fold


def _table_store_first(arch: str, q, config: AttentionConfig, kind: str) -> tuple[bool, int]:
    """Whether the backward main kernel of ``kind`` stores each query block's first
    dQ partial (Note [dQ store first]), and up to which query length (0: always;
    Note [dQ store first by length], non-deterministic only):
    ``$JAX_FA4_DQ_STORE_FIRST`` if set, else ``$JAX_FA4_DQ_FIRST_MAX_SQ`` if set,
    else the sm90 tile table."""
    d = int(q.shape[-1])
    override = dq_store_first_override(arch, d)
    if override is not None:
        return override, 0
    max_sq = dq_first_max_sq_override()
    if max_sq is not None:
        return kind == "bwd", max_sq if kind == "bwd" else 0
    from jax_fa4.kernels.sm90_bwd import bwd_tiles

    t = bwd_tiles(d, config.causal)
    if t.dq_first_max_seqlen_q:  # by length: the deterministic kernel zeroes and adds
        return (t.dq_store_first, t.dq_first_max_seqlen_q) if kind == "bwd" else (False, 0)
    return t.dq_store_first, 0


def _fwd_kernel(key: KernelKey):
    dtype = _cutlass_dtype(key.dtype)
    if key.arch == "sm_90a":
        from jax_fa4.kernels.sm90_fwd import make_fwd_sm90 as Kernel
    elif key.arch == "sm_100a":  # compiled, not run on hardware
        from jax_fa4.kernels.sm100_fwd import FlashFwdSm100 as Kernel
    else:
        raise NotImplementedError(f"no forward kernel for {key.arch}")
    return Kernel(dtype, key.head_dim, key.head_dim_v, key.causal, key.scale)


def _fwd_takes_tile_counter(key: KernelKey) -> bool:
    """Whether the forward kernel takes a zeroed int32 tile counter after V (the
    sm90 causal persistent kernel's dynamic scheduler)."""
    if key.arch != "sm_90a":
        return False
    from jax_fa4.kernels.sm90_fwd import fwd_tiles

    return key.causal and fwd_tiles(key.head_dim, key.head_dim_v, key.causal).persistent


def _fwd_split_shapes(key: KernelKey, b: int, sq: int, sk: int, hq: int):
    """The counters' and workspace's shapes of the sm90 forward whose tiles split
    the last round (``FlashFwdSm90Split.split_shapes``), else None."""
    if key.arch != "sm_90a" or key.causal:
        return None
    from jax_fa4.kernels.sm90_fwd import FlashFwdSm90Split, fwd_tiles

    tiles = fwd_tiles(key.head_dim, key.head_dim_v, key.causal)
    if not (tiles.persistent and tiles.split_tail):
        return None
    kernel = FlashFwdSm90Split(_cutlass_dtype(key.dtype), key.head_dim, key.head_dim_v,
                               key.causal, key.scale, tiles=tiles)
    return kernel.split_shapes(b, sq, sk, hq)


def _positive_scale(q, config: AttentionConfig):
    """(q, config) with a positive softmax scale, the same scaled scores.

    The kernels take scale > 0: they mask with -inf raw scores and keep the row max
    of the raw q.k, which is the max of the scaled scores only then. A negative
    scale runs as -q with |scale| (negation is exact in 16 bits), one elementwise
    pass over q, and over dq in the backward (``backward`` negates it back)."""
    if config.scale > 0:
        return q, config
    return -q, dataclasses.replace(config, scale=-config.scale)


def forward(q, k, v, *, config: AttentionConfig, arch: str):
    """(out [B,Sq,Hq,Dv], lse [B,Hq,Sq] f32) from the forward kernel."""
    q, config = _positive_scale(q, config)
    b, sq, hq, _ = q.shape
    if b == 0 or hq == 0:  # nothing to compute (a CUDA grid may not be empty)
        return (jax.numpy.zeros((b, sq, hq, v.shape[-1]), q.dtype),
                jax.numpy.zeros((b, hq, sq), jax.numpy.float32))
    key = _key("fwd", arch, q, v, config)
    out_structs = (
        jax.ShapeDtypeStruct((b, sq, hq, v.shape[-1]), q.dtype),
        jax.ShapeDtypeStruct((b, hq, sq), jax.numpy.float32),
    )
    inputs, in_static, out_static, aliases = (q, k, v), (_BSHD, _BSHD, _BSHD), (_BSHD, _BHS), {}
    if _fwd_takes_tile_counter(key):
        # A fresh zero each call (XLA memsets it), updated in place and dropped.
        counter = jax.numpy.zeros((1,), jax.numpy.int32)
        inputs, in_static = inputs + (counter,), in_static + ((0,),)
        out_structs += (jax.ShapeDtypeStruct((1,), jax.numpy.int32),)
        out_static += ((0,),)
        aliases = {3: 2}
    split = _fwd_split_shapes(key, b, sq, k.shape[1], hq)
    if split is not None:
        # The tail tiles' counters (a fresh zero each call, updated in place) and
        # the parts' O and LSE (written before they are read); all dropped.
        counters, part_o, part_lse = split
        inputs += (jax.numpy.zeros(counters, jax.numpy.int32),)
        in_static += ((),)
        out_structs += (jax.ShapeDtypeStruct(part_o, jax.numpy.float32),
                        jax.ShapeDtypeStruct(part_lse, jax.numpy.float32),
                        jax.ShapeDtypeStruct(counters, jax.numpy.int32))
        out_static += ((1, 2), (1, 2), ())
        aliases = {3: 4}
    out, lse = kernel_call(
        key,
        functools.partial(_fwd_kernel, key),
        inputs,
        out_structs,
        in_static=in_static,
        out_static=out_static,
        aliases=aliases,
    )[:2]
    return out, lse


def _cutlass_dtype(name: str):
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[name]


def _stats_block(arch: str, head_dim: int, causal: bool) -> int | None:
    """The block of the by-thread LSElog2 / Dpsum order the backward main kernel
    reads (``stat_position``), or None where it reads them in row order."""
    if arch != "sm_90a" or head_dim not in (64, 128):
        return None
    from jax_fa4.kernels.sm90_bwd import stats_thread_block

    return stats_thread_block(head_dim, causal)


def _pre_kernel(key: KernelKey):
    from jax_fa4.kernels.bwd_preprocess import FlashBwdPreprocess, FlashBwdPreprocessNoDlse

    block = None
    if key.kind == "bwd_pre_by_thread":
        block = _stats_block(key.arch, key.head_dim, key.causal)
    store_first = {}
    if key.dq_fold:  # dQaccum zeroed, and the main kernel's semaphores (Note [dQ fold])
        store_first = {"sem_tile_m": _sem_tile_m(key)}
    elif key.dq_store_first:  # dQaccum is left alone (up to dq_first_max_sq: Note [dQ
        # store first by length]); the main kernel's semaphores zeroed
        store_first = {"zero_dq": False, "sem_tile_m": _sem_tile_m(key),
                       "zero_dq_above": key.dq_first_max_sq}
    kernel = FlashBwdPreprocess if key.dlse else FlashBwdPreprocessNoDlse
    return kernel(_cutlass_dtype(key.dtype), key.head_dim_v, key.head_dim, stat_block=block,
                  use_pdl=key.pdl, reverse_heads=key.prepost_reverse, **store_first)


def _sem_tile_m(key: KernelKey) -> int:
    """The query tile of the backward main kernel's per-query-block dQ semaphores."""
    if key.arch == "sm_90a":
        from jax_fa4.kernels.sm90_bwd import bwd_tiles
    else:
        from jax_fa4.kernels.sm100_bwd import bwd_tiles
    return bwd_tiles(key.head_dim, key.causal).tile_m


def _bwd_kernel(key: KernelKey):
    if key.kind == "bwd_det" and key.arch == "sm_90a":
        from jax_fa4.kernels.sm90_bwd import FlashBwdSm90Deterministic as Kernel
    elif key.kind == "bwd_det" and key.arch == "sm_100a":  # compiled, not run on hardware
        from jax_fa4.kernels.sm100_bwd import FlashBwdSm100Deterministic as Kernel
    elif key.kind == "bwd_det":
        raise NotImplementedError(f"no deterministic backward kernel for {key.arch}")
    elif key.arch == "sm_90a" and key.head_dim == 256:
        from jax_fa4.kernels.sm90_bwd_wide import FlashBwdSm90Wide as Kernel
    elif key.arch == "sm_90a" and key.dq_store_first:
        from jax_fa4.kernels.sm90_bwd import FlashBwdSm90StoreFirst as Kernel
    elif key.arch == "sm_90a" and key.dq_fold:
        from jax_fa4.kernels.sm90_bwd import FlashBwdSm90Fold as Kernel
    elif key.arch == "sm_90a":
        from jax_fa4.kernels.sm90_bwd import FlashBwdSm90 as Kernel
    elif key.arch == "sm_100a":  # compiled, not run on hardware
        from jax_fa4.kernels.sm100_bwd import FlashBwdSm100 as Kernel
    else:
        raise NotImplementedError(f"no backward kernel for {key.arch}")
    extra = {"use_pdl": True} if key.pdl else {}  # sm_90a only (config.pdl_enabled)
    if key.kind == "bwd_det" and key.dq_store_first:  # sm_90a only (dq_store_first_enabled)
        extra["dq_store_first"] = True
    if key.kind == "bwd" and key.dq_first_max_sq:  # FlashBwdSm90StoreFirst, by length
        extra["dq_first_max_seqlen_q"] = key.dq_first_max_sq
    if key.kind == "bwd" and key.dq_fold and not key.dq_store_first:  # FlashBwdSm90Fold
        extra["dq_fold"] = key.dq_fold
    return Kernel(_cutlass_dtype(key.dtype), key.head_dim, key.head_dim_v, key.causal, key.scale,
                  **extra)


def _flat_dq_tile_m(arch: str, head_dim: int, causal: bool) -> int | None:
    """The query tile of the flat dQaccum order the backward main kernel writes
    (Note [Flat dQ accumulator]), or None where it writes row-major."""
    if arch != "sm_90a" or head_dim not in (64, 128):
        return None
    from jax_fa4.kernels.sm90_bwd import dq_accum_flat_tile_m

    return dq_accum_flat_tile_m(head_dim, causal)


def _post_kernel(key: KernelKey):
    from jax_fa4.kernels.bwd_postprocess import FlashBwdPostprocess

    return FlashBwdPostprocess(_cutlass_dtype(key.dtype), key.head_dim, key.scale,
                               _flat_dq_tile_m(key.arch, key.head_dim, key.causal),
                               use_pdl=key.pdl, reverse_heads=key.prepost_reverse)


def backward(q, k, v, out, lse, dout, *dlse, config: AttentionConfig, arch: str):
    """(dq, dk, dv) from the three backward kernels. dlse: LSE's cotangent, or
    nothing where it is a symbolic zero (the preprocess then reads none).

    config.deterministic: the main kernel adds each query block's dQ partials in a
    fixed key-block order through per-block semaphores
    (``FlashBwdSm90Deterministic``; sm_90a, head dims 64 and 128)."""
    deterministic = config.deterministic
    if deterministic:
        err = deterministic_bwd_support_error(arch, q.shape[-1], v.shape[-1])
        if err is not None:
            raise ValueError(err)
    if config.scale < 0:  # as forward: -q with |scale|; dL/dq is minus dL/d(-q)
        neg_q, config = _positive_scale(q, config)
        dq, dk, dv = backward(neg_q, k, v, out, lse, dout, *dlse, config=config, arch=arch)
        return -dq, dk, dv
    from jax_fa4.kernels.bwd_preprocess import bwd_workspace_shapes

    b, sq, hq, d = q.shape
    if b == 0 or hq == 0:  # no query attends to K and V: their gradients are zero
        return tuple(jax.numpy.zeros(x.shape, x.dtype) for x in (q, k, v))
    # An 80-row flat query tile's last block may reach past round_up(Sq, 128).
    ws = bwd_workspace_shapes(b, sq, hq, d, tile_m=_flat_dq_tile_m(arch, d, config.causal))
    ws_structs = tuple(
        jax.ShapeDtypeStruct(ws[name][0], ws[name][1]) for name in ("Dpsum", "LSElog2", "dQaccum")
    )
    main_key = _key("bwd_det" if deterministic else "bwd", arch, q, v, config)
    # Arch-neutral pre/post kernels: key them without the mask and scale they ignore,
    # unless the main kernel's tiles for this mask want the statistics by thread or
    # its query tile sizes the semaphores the preprocess zeroes.
    pre_kind = "bwd_pre" if _stats_block(arch, d, config.causal) is None else "bwd_pre_by_thread"
    pre_causal = pre_kind == "bwd_pre_by_thread" or main_key.dq_store_first
    pre_key = _key(pre_kind, arch, q, v,
                   AttentionConfig(scale=1.0, causal=pre_causal and config.causal),
                   dq_store_first=(main_key.dq_store_first, main_key.dq_first_max_sq),
                   dq_fold=main_key.dq_fold, dlse=bool(dlse))
    pre_outs, pre_static = ws_structs, (_BHS, _BHS, _BSHD)
    pre_sem = main_key.dq_store_first or main_key.dq_fold
    needs_sem = deterministic or pre_sem
    sem_shape = (b, hq, -(-sq // _sem_tile_m(main_key))) if needs_sem else None
    if pre_sem:
        # The main kernel's per-query-block semaphores, zeroed by the preprocess.
        pre_outs += (jax.ShapeDtypeStruct(sem_shape, jax.numpy.int32),)
        pre_static += (_BHS,)
    pre = kernel_call(
        pre_key,
        functools.partial(_pre_kernel, pre_key),
        (out, dout, lse, *dlse),
        pre_outs,
        in_static=(_BSHD, _BSHD, _BHS) + (_BHS,) * len(dlse),
        out_static=pre_static,
    )
    dpsum, lse_log2, dq_accum = pre[:3]
    inputs = (q, k, v, dout, lse_log2, dpsum, dq_accum)
    outs = (ws_structs[2], jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype))
    in_static = (_BSHD, _BSHD, _BSHD, _BSHD, _BHS, _BHS, _BSHD)
    out_static, aliases = (_BSHD, _BSHD, _BSHD), {6: 0}
    if needs_sem:
        # One int32 semaphore per query block, zero at launch (from the preprocess,
        # or a fresh XLA zero), updated in place and dropped.
        sem = pre[3] if pre_sem else jax.numpy.zeros(sem_shape, jax.numpy.int32)
        inputs, in_static = inputs + (sem,), in_static + (_BHS,)
        outs, out_static = outs + (jax.ShapeDtypeStruct(sem_shape, sem.dtype),), out_static + (
            _BHS,)
        aliases[7] = 3
    if main_key.dq_fold:  # the main kernel writes dQ (Note [dQ fold]): no postprocess
        outs, out_static = outs + (jax.ShapeDtypeStruct(q.shape, q.dtype),), out_static + (
            _BSHD,)
    main = kernel_call(
        main_key,
        functools.partial(_bwd_kernel, main_key),
        inputs,
        outs,
        in_static=in_static,
        out_static=out_static,
        aliases=aliases,
    )
    dq_accum, dk, dv = main[:3]
    if main_key.dq_fold:
        return main[4], dk, dv
    # The postprocess reads dQaccum in the order the main kernel's tiles wrote it,
    # which its tile table may choose per mask.
    post_key = _key("bwd_post", arch, q, v,
                    AttentionConfig(scale=config.scale, causal=config.causal))
    (dq,) = kernel_call(
        post_key,
        functools.partial(_post_kernel, post_key),
        (dq_accum,),
        (jax.ShapeDtypeStruct(q.shape, q.dtype),),
        in_static=(_BSHD,),
        out_static=(_BSHD,),
    )
    return dq, dk, dv
