"""Static parameters: what the primitives carry and what keys a compiled kernel.

`AttentionConfig` travels with every `fa4_fwd` / `fa4_bwd` bind as one frozen,
hashable value (never a loose tuple of positional params: a forgotten field
would silently reuse the wrong binary). `KernelKey` is the compile key of one
CuTe DSL kernel: one binary per key serves every batch size, sequence length
and head count.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

IMPLEMENTATIONS = (None, "cute", "reference")

# Head dims and dtypes the kernels of each architecture take (q/k head dim, v head dim).
KERNEL_DTYPES = ("bfloat16", "float16")
KERNEL_HEAD_DIMS = {
    "sm_90a": ((64, 64), (128, 128), (256, 256)),
    # Compiled, not run on hardware: no Blackwell GPU has been available.
    "sm_100a": ((64, 64), (128, 128)),
}

# Environment override of the kernel architecture, for lowering on a machine
# without a GPU (CI cross-compiles) or to force one target: "sm_90a" / "sm_100a".
ARCH_ENV = "JAX_FA4_ARCH"
DEFAULT_CROSS_ARCH = "sm_90a"


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Static parameters of one attention call.

    Attributes:
      scale: the softmax scale applied to q.k.
      causal: top-left causal masking (query i sees key j iff j <= i).
      implementation: None (kernel where supported, else the logged reference
        path), "cute" (kernel or error) or "reference".
      deterministic: a backward whose gradients are bitwise reproducible (each
        query block's dQ partials are added in a fixed key-block order).
    """

    scale: float
    causal: bool
    implementation: str | None = None
    deterministic: bool = False

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}"
            )


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """The compile key of one kernel: a new key means a new cute.compile."""

    # "fwd", "bwd_pre" (or "bwd_pre_by_thread": statistics in the main kernel's
    # by-thread order), "bwd", "bwd_det" (deterministic), "bwd_post"
    kind: str
    arch: str  # "sm_90a", "sm_100a"
    dtype: str  # "bfloat16" / "float16"
    head_dim: int
    head_dim_v: int
    causal: bool
    scale: float
    # The backward's kernels chained with programmatic dependent launch
    # (``pdl_enabled``): each starts while its predecessor drains and waits on the
    # GPU before it touches memory.
    pdl: bool = False
    # The sm90 backward main kernel stores each query block's first dQ partial, so
    # the preprocess zeroes its semaphores instead of dQaccum (BwdTiles.dq_store_first,
    # ``dq_store_first_override``; Note [dQ store first] in kernels/dq_layout.py).
    dq_store_first: bool = False
    # With dq_store_first (not deterministic): store first only up to this query
    # length, a run-time choice in one binary (BwdTiles.dq_first_max_seqlen_q, Note
    # [dQ store first by length]); 0: everywhere.
    dq_first_max_sq: int = 0
    # > 0: the sm90 backward main kernel writes dQ itself, counting each item this
    # many items after its adds (BwdTiles.dq_fold, ``dq_fold_override``; Note [dQ
    # fold] in kernels/dq_layout.py): its preprocess also zeroes the per-query-block
    # semaphores, and no postprocess runs. 0: off.
    dq_fold: int = 0
    # The backward preprocess subtracts dLSE, the cotangent of the returned LSE,
    # from Dpsum; False: that cotangent is a symbolic zero (nothing used the LSE), and
    # the preprocess takes no dLSE operand. True for every other kernel.
    dlse: bool = True
    # The backward preprocess and postprocess walk (batch, head) from the last to the
    # first (Note [Pre / post order] in kernels/bwd_preprocess.py;
    # ``prepost_reverse_enabled``, on unless $JAX_FA4_PREPOST_REVERSE=0). False for
    # every other kernel.
    prepost_reverse: bool = False


# "0" launches the backward's kernels without programmatic dependent launch (a
# diagnostic switch: kernels compiled either way are cached under different keys).
PDL_ENV = "JAX_FA4_PDL"

# "1": the backward takes a zero-filled LSE cotangent even where it is a symbolic
# zero (nothing used the LSE), as before the twenty-fifth session: an XLA zero fill
# of (B, Hq, Sq) floats and the preprocess that reads it. A diagnostic switch for
# A/B runs (bench peer ``dlsezeros``); read when the backward is traced.
DLSE_ZEROS_ENV = "JAX_FA4_DLSE_ZEROS"

# The backward's preprocess and postprocess walk (batch, head) from the last to the
# first (Note [Pre / post order] in kernels/bwd_preprocess.py); "0" walks them in grid
# order, for A/B runs (bench peer ``prefwd``); kernels built either way are cached
# under their own keys.
PREPOST_REVERSE_ENV = "JAX_FA4_PREPOST_REVERSE"


def prepost_reverse_enabled() -> bool:
    """Unless ``$JAX_FA4_PREPOST_REVERSE`` is "0" (on by default since the
    twenty-sixth session: 0.1-0.5% faster backward on the H200)."""
    return os.environ.get(PREPOST_REVERSE_ENV, "") != "0"


def pdl_enabled(arch: str) -> bool:
    """Whether the backward's sm_90a kernels launch with programmatic dependent
    launch: on unless ``$JAX_FA4_PDL`` is "0". Off on sm_100a (compiled, not run on
    hardware), where the chain has never been run."""
    return arch == "sm_90a" and os.environ.get(PDL_ENV, "1") != "0"


# "1" / "0": the sm90 backward at head dims 64 / 128 stores each query block's first
# dQ partial (Note [dQ store first]) / zeroes dQaccum in the preprocess, whatever its
# tile table says (``BwdTiles.dq_store_first``, off everywhere: measured slower beyond
# 1k tokens). An A/B switch; kernels built either way are cached under their own keys.
DQ_STORE_FIRST_ENV = "JAX_FA4_DQ_STORE_FIRST"


def dq_store_first_override(arch: str, head_dim: int) -> bool | None:
    """``$JAX_FA4_DQ_STORE_FIRST`` for a backward that can store first (sm_90a, head
    dims 64 and 128: the flat dQ accumulator): True ("1"), False ("0", and where it
    cannot), None (unset: the tile table decides)."""
    if arch != "sm_90a" or head_dim not in (64, 128):
        return False
    return {"1": True, "0": False}.get(os.environ.get(DQ_STORE_FIRST_ENV, ""))


# A positive integer N: the non-deterministic sm90 backward at head dims 64 / 128
# stores each query block's first dQ partial where the query length is at most N and
# adds into a zeroed dQaccum elsewhere, chosen at run time in one binary (Note [dQ
# store first by length]); unless $JAX_FA4_DQ_STORE_FIRST is set, which wins. An A/B
# switch like that one.
DQ_FIRST_MAX_SQ_ENV = "JAX_FA4_DQ_FIRST_MAX_SQ"


def dq_first_max_sq_override() -> int | None:
    """``$JAX_FA4_DQ_FIRST_MAX_SQ`` as a positive int, None when unset or empty;
    anything else raises."""
    raw = os.environ.get(DQ_FIRST_MAX_SQ_ENV, "")
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"${DQ_FIRST_MAX_SQ_ENV} must be a positive integer, got {raw!r}")
    return value


# "1" to "8" / "0": the non-deterministic sm90 backward at head dims 64 / 128 converts
# each query block's dQ in the main kernel, counting an item's adds that many items
# later (Note [dQ fold]) / in the postprocess, whatever its tile table says
# (``BwdTiles.dq_fold``). Store first, when chosen, wins. An A/B switch like the two
# above.
DQ_FOLD_ENV = "JAX_FA4_DQ_FOLD"


def dq_fold_override(arch: str, head_dim: int) -> int | None:
    """``$JAX_FA4_DQ_FOLD`` for a backward that can fold (sm_90a, head dims 64 and
    128): the lag 1-8, 0 (off: "0", and where it cannot fold), None (unset or empty:
    the table). Anything else raises."""
    if arch != "sm_90a" or head_dim not in (64, 128):
        return 0
    raw = os.environ.get(DQ_FOLD_ENV, "")
    if not raw:
        return None
    if raw not in {str(i) for i in range(9)}:
        raise ValueError(f"${DQ_FOLD_ENV} must be 0 (off) or a lag from 1 to 8, got {raw!r}")
    return int(raw)


def dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def kernel_support_error(arch: str, dtype, head_dim: int, head_dim_v: int) -> str | None:
    """Why no kernel of ``arch`` takes this problem, or None if one does."""
    if arch not in KERNEL_HEAD_DIMS:
        return f"no jax_fa4 kernel for architecture {arch}"
    if dtype_name(dtype) not in KERNEL_DTYPES:
        return f"dtype {dtype_name(dtype)} has no kernel (supported: {', '.join(KERNEL_DTYPES)})"
    if (head_dim, head_dim_v) not in KERNEL_HEAD_DIMS[arch]:
        dims = ", ".join(f"{d}" if d == dv else f"({d}, {dv})" for d, dv in KERNEL_HEAD_DIMS[arch])
        return (
            f"head dims (qk={head_dim}, v={head_dim_v}) have no {arch} kernel "
            f"(supported: {dims})"
        )
    return None


# The (head dim, head dim v) pairs with a deterministic backward kernel, per arch.
DETERMINISTIC_BWD_HEAD_DIMS = {
    "sm_90a": ((64, 64), (128, 128)),
    # Compiled, not run on hardware: no Blackwell GPU has been available.
    "sm_100a": ((64, 64), (128, 128)),
}


def deterministic_bwd_support_error(arch: str, head_dim: int, head_dim_v: int) -> str | None:
    """Why no deterministic backward kernel of ``arch`` takes these head dims, or None."""
    dims = DETERMINISTIC_BWD_HEAD_DIMS.get(arch, ())
    if (head_dim, head_dim_v) in dims:
        return None
    have = ", ".join(f"{d}" for d, _ in dims) or "none"
    return (f"no deterministic backward kernel for head dims ({head_dim}, {head_dim_v}) "
            f"on {arch} (head dims with one: {have})")


def any_kernel_support_error(dtype, head_dim: int, head_dim_v: int) -> str | None:
    """None if some architecture's kernel takes this problem, else the reason."""
    errors = [kernel_support_error(a, dtype, head_dim, head_dim_v) for a in KERNEL_HEAD_DIMS]
    if any(e is None for e in errors):
        return None
    return errors[0]


def arch_from_compute_capability(cc: str | None) -> str | None:
    """Map a device compute capability ("9.0", "10.0") to a kernel target."""
    if cc is None:
        return None
    return {"9.0": "sm_90a", "10.0": "sm_100a"}.get(str(cc))


def target_arch() -> tuple[str | None, str]:
    """The kernel architecture to lower CUDA code for, and where it came from.

    The environment override wins; else the first visible CUDA device's
    compute capability; with no CUDA device visible (cross-compiling for
    cuda from a CPU machine) the default cross target.
    """
    env = os.environ.get(ARCH_ENV)
    if env:
        return env, f"${ARCH_ENV}"
    import jax

    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        devices = []
    if devices:
        cc = getattr(devices[0], "compute_capability", None)
        return arch_from_compute_capability(cc), f"device compute capability {cc}"
    return DEFAULT_CROSS_ARCH, "no CUDA device visible (cross-compile default)"
