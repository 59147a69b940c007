"""Static parameters: what the primitives carry and what keys a compiled kernel.

`AttentionConfig` travels with every `fa4_fwd` / `fa4_bwd` bind as one frozen,
hashable value (never a loose tuple of positional params: a forgotten field
would silently reuse the wrong binary). `KernelKey` is the compile key of one
CuTe DSL kernel: one binary per key serves every batch size, sequence length
and head count.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax.numpy as jnp

IMPLEMENTATIONS = (None, "cute", "reference")

# The softmax runs in base 2 (exp2 on the GPU); LSE is reported in natural log.
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# Head dims and dtypes the kernels of each architecture take (q/k head dim, v head dim).
KERNEL_DTYPES = ("bfloat16", "float16")
KERNEL_HEAD_DIMS = {
    "sm_90a": ((64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)),
    # Compiled, not run on hardware: no Blackwell GPU has been available.
    "sm_100a": ((64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)),
}

# Environment override of the kernel architecture, for lowering on a machine
# without a GPU (CI cross-compiles) or to force one target: "sm_90a" / "sm_100a".
ARCH_ENV = "JAX_FA4_ARCH"
DEFAULT_CROSS_ARCH = "sm_90a"


CAUSAL_MODES = (False, True, "top_left", "bottom_right")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Static parameters of one attention call.

    Attributes:
      scale: the softmax scale applied to q.k.
      causal: causal masking (query i sees key j iff j <= i + offset).
      implementation: None (kernel where supported, else the logged reference
        path), "cute" (kernel or error) or "reference".
      deterministic: a backward whose gradients are bitwise reproducible (each
        query block's dQ partials are added in a fixed key-block order).
      bottom_right: the causal / window diagonal's offset is Lk - Lq (each
        sequence's own lengths), so the last query meets the last key; else 0.
      window: (left, right) keys on either side of the diagonal, None for an
        unbounded side; None: no window.
      q_lengths, kv_lengths, segments: which per-batch mask arrays the primitives
        take after their other operands, in this order: q_lengths [B],
        kv_lengths [B], q_segment_ids [B, Sq] and kv_segment_ids [B, Sk].
      softcap: c > 0: each scaled logit s becomes c * tanh(s / c) before the
        softmax; None: off.
      sinks: the forward takes one more operand after the mask arrays, the sink
        logits [B, Hq] float32, which join every row's softmax denominator. (The
        backward needs no operand for them: its P = exp(S - lse) with the lse
        that includes them.)
      num_splits: the forward's splits of the key range (split keys, Note [Split
        keys] in kernels/sm90_fwd.py): None to choose from the shapes, 1 for none.
      paged: (forward only) key and value are page pools [pages, page_size, Hkv,
        D], and the forward takes a page table [B, pages per sequence] int32 after
        the mask arrays, before the sinks (Note [Paged KV] in kernels/sm90_fwd.py).
    """

    scale: float
    causal: bool
    implementation: str | None = None
    deterministic: bool = False
    bottom_right: bool = False
    window: tuple[int | None, int | None] | None = None
    q_lengths: bool = False
    kv_lengths: bool = False
    segments: bool = False
    softcap: float | None = None
    sinks: bool = False
    num_splits: int | None = None
    paged: bool = False

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}"
            )
        n = self.num_splits
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"num_splits must be None or an int >= 1, got {n!r}")

    @property
    def num_mask_operands(self) -> int:
        return int(self.q_lengths) + int(self.kv_lengths) + 2 * int(self.segments)

    @property
    def masked(self) -> bool:
        """Any mask beyond plain top-left causal."""
        return bool(self.bottom_right or self.window is not None or self.num_mask_operands)

    def mask_features(self) -> list[str]:
        """The masks this call uses beyond plain causal, by their argument names."""
        names = []
        if self.causal and self.bottom_right:
            names.append("causal='bottom_right'")
        for name, on in (("window", self.window is not None), ("q_lengths", self.q_lengths),
                         ("kv_lengths", self.kv_lengths), ("segment ids", self.segments)):
            if on:
                names.append(name)
        return names


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """The compile key of one kernel: a new key means a new cute.compile.

    Everything that changes a compiled kernel is a field here (the launch plan,
    ``rules/plan.py``, builds each kernel from its key alone)."""

    kind: str  # "fwd", "bwd_pre", "bwd", "bwd_det" (deterministic), "bwd_post"
    arch: str  # "sm_90a", "sm_100a"
    dtype: str  # "bfloat16" / "float16"
    head_dim: int
    head_dim_v: int
    causal: bool
    scale: float
    # bwd_pre: LSElog2 / Dpsum written in the main kernel's by-thread order of
    # blocks of this many rows (``stat_position``); 0: row order.
    stat_block: int = 0
    # bwd_post: dQaccum read in the flat order of query tiles of this many rows
    # (Note [Flat dQ accumulator]); 0: row-major.
    dq_tile_m: int = 0
    # bwd_pre: subtract dLSE, the cotangent of the returned LSE, from Dpsum; False:
    # that cotangent is a symbolic zero and the preprocess takes no dLSE operand.
    dlse: bool = True
    # fwd / bwd: the call takes per-row key (per-key query) intervals that carry
    # every mask (rules/ranges.py; causal is then False), and with ``segments`` the
    # segment ids too.
    masked: bool = False
    segments: bool = False
    # fwd: the call takes the sink logits (B, Hq) float32 after the mask operands.
    sinks: bool = False
    # fwd / bwd: scaled logits capped to c * tanh(s / c) (Note [Softcap in the
    # kernels]); None: no softcap.
    softcap: float | None = None
    # fwd: query heads per KV head packed into one tile's rows (Note [Packed GQA] in
    # kernels/sm90_fwd.py); 1: none.
    pack_gqa: int = 1
    # fwd: K and V are page pools of pages of this many keys, read in place (Note
    # [Paged KV] in kernels/sm90_fwd.py); 0: contiguous.
    page_size: int = 0
    # fwd: O and LSE are float32 partials of splits of the key blocks, B x splits of
    # them, combined after the kernel (Note [Split keys] in kernels/sm90_fwd.py). The
    # split count is data: one kernel serves every count.
    split_kv: bool = False
    # bwd_pre / bwd: every query block meets one key block, so the main kernel writes
    # dQ itself: no fp32 accumulator (the preprocess writes none), no postprocess
    # (Note [One key block per query block] in kernels/sm90_bwd.py).
    dq_store: bool = False
    # fwd (sm_90a, masked, head dims up to 64): each tile's query rows fit the short
    # row of the tile table, 128 rows instead of 192 (``short_tiles`` in
    # kernels/sm90_fwd.py).
    short_tiles: bool = False


def page_size_error(page_size: int, tile_n: int) -> str | None:
    """Why a forward of ``tile_n``-key blocks cannot read pages of ``page_size`` keys
    in place, or None: a page must hold whole blocks, or a block whole pages of at
    least the 8 rows of a swizzle atom."""
    if page_size >= tile_n and page_size % tile_n == 0:
        return None
    if page_size < tile_n and tile_n % page_size == 0 and page_size % 8 == 0:
        return None
    return (f"pages of {page_size} keys do not tile the kernel's blocks of {tile_n} keys "
            "(a page must hold whole blocks, or a block whole pages of 8 keys or more)")


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
