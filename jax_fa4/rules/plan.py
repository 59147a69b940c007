"""Launch plans: what one configuration's forward or backward launches.

A plan is built once per configuration (architecture, dtype, head dims, mask,
scale, determinism) and is the only place that asks the kernel modules about
their layout choices: which forward takes a tile counter, in which order the
backward's statistics and dQ accumulator are laid out, what the deterministic
kernel's semaphores and, with masks, its walks cover. It holds the compile key of
every kernel it launches, builds their kernel objects from those keys, and sizes
the workspaces for a call.
The lowering (``kernels_cuda``) reads it as a list of calls.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_fa4.config import KernelKey


def _cutlass_dtype(name: str):
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[name]


@dataclasses.dataclass(frozen=True)
class FwdPlan:
    """The forward: one kernel."""

    key: KernelKey
    # The sm90 causal persistent kernel takes tiles from a global int32 counter,
    # one more operand (zero at launch) aliased to a third output.
    tile_counter: bool

    def build(self):
        k = self.key
        if k.arch == "sm_90a":
            from jax_fa4.kernels.sm90_fwd import make_fwd_sm90 as make
        elif k.arch == "sm_100a":  # compiled, not run on hardware
            from jax_fa4.kernels.sm100_fwd import FlashFwdSm100 as make
        else:
            raise NotImplementedError(f"no forward kernel for {k.arch}")
        extra = {"masked": True, "segments": k.segments} if k.masked else {}
        if k.sinks:
            extra["sinks"] = True
        if k.softcap is not None:
            extra["softcap"] = k.softcap
        if k.pack_gqa > 1:
            extra["pack_gqa"] = k.pack_gqa
        if k.split_kv:
            extra["split_kv"] = True
        if k.page_size:
            extra["page_size"] = k.page_size
        if k.short_tiles:
            extra["short"] = True
        return make(_cutlass_dtype(k.dtype), k.head_dim, k.head_dim_v, k.causal, k.scale,
                    **extra)


@dataclasses.dataclass(frozen=True)
class BwdPlan:
    """The backward: preprocess -> main kernel -> postprocess.

    The preprocess writes Dpsum and LSE in log2 units (in the order the main
    kernel reads them, ``pre.stat_block``) and zeroes the fp32 dQ accumulator;
    the main kernel writes dK and dV and reduce-adds dQ partials into the
    accumulator (in the order ``post.dq_tile_m`` names); the postprocess scales
    and converts it to dQ. On sm_90a the three form one programmatic-dependent-
    launch chain. With ``main.dq_store`` the main kernel writes dQ itself: no
    accumulator, no postprocess (Note [One key block per query block] in
    kernels/sm90_bwd.py).
    """

    pre: KernelKey
    main: KernelKey
    post: KernelKey
    # The deterministic main kernel orders its dQ adds with one int32 semaphore
    # per (batch, head, query block of this many rows), zero at launch; else 0.
    sem_tile_m: int
    # A masked main kernel at head dims up to 128 (sm_100a: at every one; the wide
    # sm_90a kernel: the deterministic one) takes its walks (``key_block_ranges``
    # over blocks of (keys, queries); Note [Block walks] in rules/ranges.py; the
    # deterministic ones rank their dQ adds by them); else None.
    walk_tiles: tuple[int, int] | None = None
    # The CTAs of a key block that add to disjoint head-dim parts of dQ (sm_100a at
    # hdim 256, Note [Head-dim halves]): each part's adds have semaphores of their own.
    sem_parts: int = 1

    @property
    def pdl(self) -> bool:
        return self.main.arch == "sm_90a"

    def workspaces(self, batch: int, seqlen_q: int, heads_q: int):
        """(Dpsum, LSElog2, dQaccum) structs for one call."""
        from jax_fa4.kernels.bwd_preprocess import bwd_workspace_shapes

        ws = bwd_workspace_shapes(batch, seqlen_q, heads_q, self.main.head_dim,
                                  tile_m=self.post.dq_tile_m or None)
        return tuple(jax.ShapeDtypeStruct(*ws[n]) for n in ("Dpsum", "LSElog2", "dQaccum"))

    def semaphores(self, batch: int, seqlen_q: int, heads_q: int):
        """One per query block and head-dim part (``sem_parts``)."""
        blocks = -(-seqlen_q // self.sem_tile_m) * self.sem_parts
        return jax.ShapeDtypeStruct((batch, heads_q, blocks), jnp.int32)

    def build_pre(self):
        from jax_fa4.kernels.bwd_preprocess import FlashBwdPreprocess, FlashBwdPreprocessNoDlse

        k = self.pre
        kernel = FlashBwdPreprocess if k.dlse else FlashBwdPreprocessNoDlse
        return kernel(_cutlass_dtype(k.dtype), k.head_dim_v, k.head_dim,
                      stat_block=k.stat_block or None, use_pdl=self.pdl,
                      zero_dq=not k.dq_store)

    def build_main(self):
        k = self.main
        det = k.kind == "bwd_det"
        if k.arch == "sm_90a" and k.head_dim in (192, 256) and det:
            from jax_fa4.kernels.sm90_bwd_wide import FlashBwdSm90WideDeterministic as Kernel
        elif k.arch == "sm_90a" and k.head_dim in (192, 256):
            from jax_fa4.kernels.sm90_bwd_wide import FlashBwdSm90Wide as Kernel
        elif k.arch == "sm_90a" and det:
            from jax_fa4.kernels.sm90_bwd import FlashBwdSm90Deterministic as Kernel
        elif k.arch == "sm_90a":
            from jax_fa4.kernels.sm90_bwd import FlashBwdSm90 as Kernel
        elif k.arch == "sm_100a" and det:  # compiled, not run on hardware
            from jax_fa4.kernels.sm100_bwd import FlashBwdSm100Deterministic as Kernel
        elif k.arch == "sm_100a":  # compiled, not run on hardware
            from jax_fa4.kernels.sm100_bwd import FlashBwdSm100 as Kernel
        else:
            raise NotImplementedError(f"no backward kernel for {k.arch}")
        extra = {"use_pdl": True} if self.pdl else {}
        if k.masked:
            extra.update(masked=True, segments=k.segments)
        if k.softcap is not None:
            extra["softcap"] = k.softcap
        if k.dq_store:
            extra["dq_store"] = True
        return Kernel(_cutlass_dtype(k.dtype), k.head_dim, k.head_dim_v, k.causal, k.scale,
                      **extra)

    def build_post(self):
        from jax_fa4.kernels.bwd_postprocess import FlashBwdPostprocess

        k = self.post
        return FlashBwdPostprocess(_cutlass_dtype(k.dtype), k.head_dim, k.scale,
                                   k.dq_tile_m or None, use_pdl=self.pdl)


def fwd_tile_shape(arch: str, head_dim: int, head_dim_v: int, masked: bool
                   ) -> tuple[int, int]:
    """(query rows, keys) of one tile of the (masked) forward of ``arch``."""
    if arch == "sm_90a":
        from jax_fa4.kernels.sm90_fwd import fwd_tiles

        tiles = fwd_tiles(head_dim, head_dim_v, False, masked)
        return tiles.tile_m, tiles.tile_n
    # sm_100a: one CTA runs two 128-row tiles, one at head dim 256 (compiled, not
    # run on hardware).
    from jax_fa4.kernels.sm100_fwd import fwd_tiles as sm100_fwd_tiles

    tiles = sm100_fwd_tiles(head_dim, head_dim_v, False)
    return tiles.q_tiles * tiles.tile_m, tiles.tile_n


@functools.cache
def fwd_plan(arch: str, dtype: str, head_dim: int, head_dim_v: int, causal: bool,
             scale: float, masked: bool = False, segments: bool = False,
             sinks: bool = False, softcap: float | None = None,
             group: int = 1, split_kv: bool = False, page_size: int = 0,
             rows: int = 0) -> FwdPlan:
    """``masked``: the kernel takes key intervals that carry every mask, causal
    included (``causal`` is then ignored); ``segments``: and the segment ids;
    ``sinks``: and the sink logits; ``softcap``: the logits' cap, or None;
    ``group``: query heads per KV head, which the masked forward packs into its
    tiles where they divide them (Note [Packed GQA] in kernels/sm90_fwd.py);
    ``split_kv``: the masked forward writes float32 partials of key splits (Note
    [Split keys]), and takes no sinks (the combine adds them); ``page_size``: K and V
    are pools of pages of that many keys, read in place (Note [Paged KV]); ``rows``:
    the call's query rows per (batch, head), which the masked forward at head dims up
    to 64 fits to (``short_tiles``), or 0 where unknown."""
    if masked:
        causal = False
    counter, tile_m, short = False, 128, False
    if arch == "sm_90a":
        from jax_fa4.kernels.sm90_fwd import fwd_tiles, short_tiles

        tiles = fwd_tiles(head_dim, head_dim_v, causal, masked)
        counter = (causal or masked) and tiles.persistent
        tile_m = tiles.tile_m
    pack = group if masked and group > 1 and tile_m % group == 0 else 1
    if arch == "sm_90a":
        short = short_tiles(head_dim, head_dim_v, masked, rows, pack, split_kv)
    key = KernelKey(kind="fwd", arch=arch, dtype=dtype, head_dim=head_dim,
                    head_dim_v=head_dim_v, causal=causal, scale=scale, masked=masked,
                    segments=segments, sinks=sinks and not split_kv, softcap=softcap,
                    pack_gqa=pack, split_kv=split_kv, page_size=page_size,
                    short_tiles=short)
    return FwdPlan(key=key, tile_counter=counter)


@functools.cache
def num_sms() -> int:
    """SMs of GPU 0 (132 where none can be queried, as when cross-compiling)."""
    from jax_fa4.kernels.sm90_fwd import sm_count

    return sm_count()


# Split keys: a tile count that fills this share of the SMs needs no split; at most
# this many splits, each of at least this many key blocks.
_SPLIT_FILL = 0.8
_MAX_SPLITS = 128
_MIN_SPLIT_BLOCKS = 2


def split_count(arch: str, head_dim: int, head_dim_v: int, batch: int, heads: int,
                rows: int, seqlen_k: int, num_sms: int) -> int:
    """Splits of the key range for the masked forward (Note [Split keys] in
    kernels/sm90_fwd.py), from the shapes: ``heads`` x ``rows`` are the tiles' heads
    and rows per head (KV heads x packed rows, or query heads x Sq). Enough splits
    that the tiles fill the SMs in one wave, where the tiles alone leave them idle
    (flash-decoding); 1 where they fill them or the keys are few."""
    tile_m, tile_n = fwd_tile_shape(arch, head_dim, head_dim_v, True)
    tiles = batch * heads * -(-rows // tile_m)
    blocks = -(-seqlen_k // tile_n)
    if tiles >= _SPLIT_FILL * num_sms:
        return 1
    return max(1, min(num_sms // max(tiles, 1), blocks // _MIN_SPLIT_BLOCKS, _MAX_SPLITS))


def dq_store_keys(arch: str, head_dim: int, head_dim_v: int) -> int:
    """Keys per block of the backward of ``arch`` at these head dims if it can store
    the dQ partial of a query block that meets one key block (Note [One key block
    per query block] in kernels/sm90_bwd.py), else 0: the sm_90a kernel at head dims
    up to 128. (The wide sm_90a and the sm_100a kernels always add.)"""
    if arch == "sm_90a" and head_dim in (64, 96, 128) and head_dim_v == head_dim:
        from jax_fa4.kernels.sm90_bwd import FlashBwdSm90

        return FlashBwdSm90.tile_n
    return 0


@functools.cache
def bwd_plan(arch: str, dtype: str, head_dim: int, head_dim_v: int, causal: bool,
             scale: float, deterministic: bool, dlse: bool, masked: bool = False,
             segments: bool = False, softcap: float | None = None,
             one_key_block: bool = False) -> BwdPlan:
    """``dlse``: the preprocess takes LSE's cotangent (False where it is a symbolic
    zero: nothing used the LSE). ``masked`` / ``segments`` / ``softcap``: as
    ``fwd_plan``, for the main kernel (which takes the keys' query intervals).
    ``one_key_block``: every query block meets exactly one block of
    ``dq_store_keys`` keys, which must be nonzero; the main kernel stores its dQ
    partials, which needs no deterministic kernel (Note [One key block per query
    block] in kernels/sm90_bwd.py)."""
    if one_key_block:
        if not dq_store_keys(arch, head_dim, head_dim_v):
            raise ValueError(f"the {arch} backward at head dim {head_dim} adds every dQ "
                             "partial")
        deterministic = False
    if masked:
        causal = False
    stat_block = dq_tile_m = 0
    if arch == "sm_90a" and head_dim in (64, 96, 128):
        from jax_fa4.kernels.sm90_bwd import dq_accum_flat_tile_m, stats_thread_block

        stat_block = stats_thread_block(head_dim, causal, masked) or 0
        dq_tile_m = dq_accum_flat_tile_m(head_dim, causal, masked) or 0
    elif arch == "sm_90a":  # the wide kernel (Note [Wide dQ hand-off])
        from jax_fa4.kernels.sm90_bwd_wide import FlashBwdSm90Wide

        dq_tile_m = FlashBwdSm90Wide.tile_m
    # The semaphores of a deterministic kernel; the walks of a masked one that takes
    # them: every one at head dims up to 128 and on sm_100a, the wide sm_90a kernel
    # only to rank its deterministic dQ adds.
    sem_tile_m, walk_tiles, sem_parts, parts = 0, None, 1, 1
    narrow = head_dim in (64, 96, 128)
    takes_walks = masked and (narrow or arch == "sm_100a" or deterministic)
    if deterministic or takes_walks:
        if arch == "sm_90a" and narrow:
            from jax_fa4.kernels.sm90_bwd import FlashBwdSm90, bwd_tiles

            tile_m, tile_n = bwd_tiles(head_dim, causal, masked).tile_m, FlashBwdSm90.tile_n
        elif arch == "sm_90a":
            from jax_fa4.kernels.sm90_bwd_wide import FlashBwdSm90Wide, wide_tile_n

            tile_m, tile_n = FlashBwdSm90Wide.tile_m, wide_tile_n(head_dim)
        else:
            from jax_fa4.kernels.sm100_bwd import bwd_tiles

            tiles = bwd_tiles(head_dim, causal, head_dim_v)
            tile_m, tile_n = tiles.tile_m, tiles.tile_n
            parts = tiles.dkv_split
        if deterministic:
            sem_tile_m, sem_parts = tile_m, parts
        if takes_walks:
            # Its walks come from the lowering (Note [Block walks] in rules/ranges.py).
            walk_tiles = (tile_n, tile_m)
    common = dict(arch=arch, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v)
    # The pre- and postprocess ignore the mask (and the preprocess the scale): they
    # are keyed by the layouts they share with the main kernel instead.
    return BwdPlan(
        pre=KernelKey(kind="bwd_pre", causal=False, scale=1.0, stat_block=stat_block,
                      dlse=dlse, dq_store=one_key_block, **common),
        main=KernelKey(kind="bwd_det" if deterministic else "bwd", causal=causal, scale=scale,
                       masked=masked, segments=segments, softcap=softcap,
                       dq_store=one_key_block, **common),
        post=KernelKey(kind="bwd_post", causal=False, scale=scale, dq_tile_m=dq_tile_m,
                       **common),
        sem_tile_m=sem_tile_m,
        walk_tiles=walk_tiles,
        sem_parts=sem_parts,
    )
