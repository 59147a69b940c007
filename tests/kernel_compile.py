"""Shared by the kernel compile tests: lower one CuTe DSL kernel for platform cuda
on this CPU machine, for a given target, with dynamic batch / sequence / head
extents, and read its PTX / SASS dumps.

The DSL keeps one compile target per process; `lower` pins it for the one
compile and restores it, so test modules can run in any order in one pytest process.
"""

from __future__ import annotations

import glob
import pathlib
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jax_fa4.ffi.bridge import pinned_arch


def spec(struct):
    """Divisibility 1 on batch / sequence / head extents; head dim (last) static."""
    from cutlass.jax import TensorSpec

    # Without explicit 1s the bridge would assume the example extents divide
    # every run-time extent.
    rank = len(struct.shape)
    last = struct.shape[-1] if rank == 4 else 1
    return TensorSpec(divisibility=(1,) * (rank - 1) + (last,))


def lower(
    make_kernel: Callable[[], object],
    arch: str,
    inputs: Sequence[jax.ShapeDtypeStruct],
    outputs: Sequence[jax.ShapeDtypeStruct],
    aliases: dict[int, int] | None = None,
    compile_options: str | None = None,
) -> str:
    """Compile ``make_kernel()`` for ``arch`` through cutlass_call; the lowered HLO text."""
    from cutlass.jax import cutlass_call

    with pinned_arch(arch):
        call = cutlass_call(
            make_kernel(),
            output_shape_dtype=tuple(outputs),
            input_spec=[spec(s) for s in inputs],
            output_spec=[spec(s) for s in outputs],
            input_output_aliases=aliases or {},
            compile_options=compile_options,
        )
        return jax.jit(call).trace(*inputs).lower(lowering_platforms=("cuda",)).as_text()


def fwd_structs(b, sq, sk, hq, hkv, d, dtype):
    """Forward operands (q, k, v) and results (out, lse)."""
    sds = jax.ShapeDtypeStruct
    ins = (sds((b, sq, hq, d), dtype), sds((b, sk, hkv, d), dtype), sds((b, sk, hkv, d), dtype))
    outs = (sds((b, sq, hq, d), dtype), sds((b, hq, sq), jnp.float32))
    return ins, outs


def lower_fwd_sm90(dtype, d: int, causal: bool, shape=(2, 113, 203, 8, 2), tiles=None,
                   compile_options: str | None = None) -> str:
    """Lower the sm90 forward (``make_fwd_sm90``) for (B, Sq, Sk, Hq, Hkv) as the
    FFI layer calls it: the causal persistent kernel also takes the int32 tile
    counter after V, aliased to a third output."""
    from jax_fa4.kernels.sm90_fwd import FlashFwdSm90Dynamic, make_fwd_sm90

    ins, outs = fwd_structs(*shape, d, dtype)
    aliases = {}
    if isinstance(make_fwd_sm90(dtype, d, d, causal, tiles=tiles), FlashFwdSm90Dynamic):
        cnt = jax.ShapeDtypeStruct((1,), jnp.int32)
        ins, outs, aliases = ins + (cnt,), outs + (cnt,), {3: 2}
    return lower(lambda: make_fwd_sm90(dtype, d, d, causal, tiles=tiles), "sm_90a", ins, outs,
                 aliases=aliases, compile_options=compile_options)


def bwd_structs(b, sq, sk, hq, hkv, d, dtype, dv=None):
    """Backward main-kernel operands, results and the dQ-accumulator alias (``dv``:
    V's head dim, default ``d``)."""
    sds = jax.ShapeDtypeStruct
    dv = d if dv is None else dv
    sq_pad = (sq + 127) // 128 * 128
    q, do = sds((b, sq, hq, d), dtype), sds((b, sq, hq, dv), dtype)
    k, v = sds((b, sk, hkv, d), dtype), sds((b, sk, hkv, dv), dtype)
    stat = sds((b, hq, sq_pad), jnp.float32)  # LSElog2 / Dpsum, padded like dQaccum
    dq_accum = sds((b, hq, sq_pad, d), jnp.float32)
    return (q, k, v, do, stat, stat, dq_accum), (dq_accum, k, v), {6: 0}


def lower_bwd(kernel_cls, arch: str, dtype, head_dim: int, causal: bool,
              shape=(2, 113, 203, 4, 1), compile_options: str | None = None,
              head_dim_v: int | None = None, **kernel_kwargs) -> str:
    """Lower a backward main kernel (sm90 or sm100 class, built with
    ``kernel_kwargs`` such as use_pdl) for (B, Sq, Sk, Hq, Hkv).

    The default shape has GQA (4 query heads per kv head) and lengths that are
    not tile multiples.
    """
    import cutlass

    cute_dtype = {jnp.bfloat16: cutlass.BFloat16, jnp.float16: cutlass.Float16}[dtype]
    dv = head_dim if head_dim_v is None else head_dim_v
    ins, outs, aliases = bwd_structs(*shape, head_dim, dtype, dv)
    if kernel_kwargs.get("dq_store"):
        # No accumulator: dQ itself is the first output.
        ins, outs, aliases = ins[:6], (ins[0],) + outs[1:], {}
    if getattr(kernel_cls, "takes_dq_semaphores", False):
        # (B, Hq, ceil(Sq / tile_m) x parts) int32 after mdQaccum, aliased to a 4th output.
        b, sq, _, hq, _ = shape
        kernel = kernel_cls(cute_dtype, head_dim, dv, causal)
        # One per query block and head-dim part (sm_100a at 256: Note [Head-dim halves]).
        parts = getattr(kernel, "split", 1)
        sem = jax.ShapeDtypeStruct((b, hq, -(-sq // kernel.tile_m) * parts), jnp.int32)
        ins, outs, aliases = ins + (sem,), outs + (sem,), {6: 0, 7: 3}
    return lower(
        lambda: kernel_cls(cute_dtype, head_dim, dv, causal, head_dim**-0.5,
                           **kernel_kwargs),
        arch, ins, outs, aliases, compile_options,
    )


def dump_options(folder: pathlib.Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    return f"--keep-ptx --keep-sass --dump-dir={folder}"


def read_dump(folder: pathlib.Path, ext: str) -> str | None:
    """The text of the first ``*.ext`` file the DSL dumped, or None."""
    files = sorted(glob.glob(str(folder / f"*.{ext}")))
    if not files:
        return None
    with open(files[0]) as f:
        return f.read()


def dumped_sass(folder: pathlib.Path) -> str:
    """The SASS the DSL dumped to ``folder``; skips the test when it wrote none
    (it writes SASS only when it finds nvdisasm, pip nvidia-cuda-nvdisasm)."""
    import pytest

    sass = read_dump(folder, "sass")
    if sass is None:
        pytest.skip("the DSL wrote no SASS (disassembler unavailable to it)")
    return sass


def count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


def assert_semaphore_order(lines: list[str], reduce_pattern: str) -> None:
    """The deterministic backward's dQ adds in the SASS ``lines``: an acquire spin
    (strong GPU-scope load), then the reduce-adds (``reduce_pattern``), a wait for
    them to land, a GPU-scope fence, and the release increment, in that order."""
    def first(pattern, after=0):
        hit = next((i for i, ln in enumerate(lines) if i >= after and re.search(pattern, ln)),
                   None)
        assert hit is not None, f"no {pattern!r} after line {after} of the SASS"
        return hit

    spin = first(r"LDG\.E\.STRONG\.GPU")
    reduce0 = first(reduce_pattern, spin)
    landed = first(r"DEPBAR\.LE SB0, 0x0", reduce0)
    release = first(r"MEMBAR\.ALL\.GPU", landed)
    first(r"REDG\.E\.ADD\.STRONG\.GPU|ATOMG\.E\.ADD\.STRONG\.GPU", release)


# Any SASS instruction that reads or writes global memory (per-thread, bulk, TMA,
# atomics).
_GLOBAL_ACCESS = re.compile(r"\b(LDG|STG|LDGSTS|LD|ST|ATOM|ATOMG|RED|REDG|UTMALDG|UTMASTG|"
                            r"UTMAREDG|UBLKCP|UBLKRED|UBLKPF)\b")


def assert_pdl_chained(sass: str) -> None:
    """A kernel of the backward's programmatic-dependent-launch chain: it may start
    while the kernel before it drains, so it waits for it (griddepcontrol.wait, SASS
    ``ACQBULK``) once, before its first global-memory access, and lets the next one
    launch (griddepcontrol.launch_dependents, ``PREEXIT``)."""
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]
    waits = [i for i, ln in enumerate(lines) if re.search(r"\bACQBULK\b", ln)]
    assert len(waits) == 1, f"{len(waits)} griddepcontrol.wait (ACQBULK) in the SASS"
    accesses = [i for i, ln in enumerate(lines) if _GLOBAL_ACCESS.search(ln)]
    before = sum(i < waits[0] for i in accesses)
    assert before == 0, f"{before} global-memory instructions before the PDL wait"
    assert accesses, "no global-memory instruction found (pattern broken?)"
    assert any(re.search(r"\bPREEXIT\b", ln) for ln in lines), "no launch_dependents"


def exp2s_between_waits(sass: str) -> list[int]:
    """For each partial wgmma wait (``WARPGROUP.DEPBAR.LE gsb0, 0x1``: one group
    still in flight), the number of exp2s before the next full wait (``0x0``): the
    exp2 work that overlaps the last wgmma group (the forward's P V, Note [P V
    wait])."""
    lines = sass.splitlines()
    out = []
    for i, line in enumerate(lines):
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            n = 0
            for later in lines[i + 1:]:
                if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in later:
                    break
                n += "MUFU.EX2" in later
            out.append(n)
    return out


def lower_masked(arch: str, direction: str, dtype, head_dim: int, segments: bool = False,
                 shape=(2, 113, 203, 4, 1), compile_options: str | None = None,
                 deterministic: bool = False, splits: int = 1, page_size: int = 0,
                 short: bool = False) -> str:
    """Lower a masked kernel of ``arch`` (``direction`` "fwd" or "bwd"), which takes
    the key (query) intervals after its other operands, and with ``segments`` the
    ids, as the FFI layer calls it (rules/kernels_cuda.py). ``deterministic`` (a
    backward): the deterministic kernel, which also takes the semaphores after
    mdQaccum (aliased to a fourth output). A backward that ``takes_walks`` (the
    deterministic ones and sm_90a's up to hdim 128) takes the key blocks' walks last.
    ``splits`` > 1 (a forward): the split-keys kernel, whose O and LSE are float32
    partials with B x splits batches. ``page_size`` (a forward): K and V are pools of
    pages of that many keys (Sk of them, so one page per key of the shape), and the
    kernel takes a page table (B, ceil(Sk / page_size)) after the intervals.
    ``short`` (an sm_90a forward): the tile table's row for few rows per tile
    (``short_tiles`` in kernels/sm90_fwd.py)."""
    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90, FlashBwdSm90Deterministic
    from jax_fa4.kernels.sm90_bwd_wide import FlashBwdSm90Wide, FlashBwdSm90WideDeterministic
    from jax_fa4.kernels.sm90_fwd import make_fwd_sm90
    from jax_fa4.kernels.sm100_bwd import FlashBwdSm100, FlashBwdSm100Deterministic
    from jax_fa4.kernels.sm100_fwd import FlashFwdSm100
    from jax_fa4.rules.plan import fwd_plan

    b, sq, sk, hq, hkv = shape
    sds = jax.ShapeDtypeStruct
    cute_dtype = {jnp.bfloat16: cutlass.BFloat16, jnp.float16: cutlass.Float16}[dtype]
    kw = dict(masked=True, segments=segments)
    aliases = {}
    if direction == "fwd":
        ins, outs = fwd_structs(*shape, head_dim, dtype)
        if splits > 1:
            kw["split_kv"] = True
            outs = (sds((b * splits, sq, hq, head_dim), jnp.float32),
                    sds((b * splits, hq, sq), jnp.float32))
        # The query heads of a KV head packed into the tiles, as the plan has it (Note
        # [Packed GQA]).
        kw["pack_gqa"] = fwd_plan(arch, jnp.dtype(dtype).name, head_dim, head_dim, False,
                                  1.0, masked=True, group=hq // hkv).key.pack_gqa
        if arch == "sm_90a":
            if short:
                kw["short"] = True

            def make():
                return make_fwd_sm90(dtype, head_dim, head_dim, False, **kw)
        else:
            def make():
                return FlashFwdSm100(dtype, head_dim, head_dim, False, **kw)
        if page_size:
            kw["page_size"] = page_size
            pool = sds((sk, page_size, hkv, head_dim), dtype)
            ins = (ins[0], pool, pool)
        ranges = sds((b, sq, 2), jnp.int32)
        if make().takes_tile_counter:
            # The counter rides in an extra batch entry of the intervals (Note [Counter
            # in the intervals]).
            ranges = sds((b + 1, sq, 2), jnp.int32)
            outs, aliases = outs + (ranges,), {3: 2}
        ins = ins + (ranges,)
        if page_size:
            ins = ins + (sds((b, -(-sk // page_size)), jnp.int32),)
    else:
        ins, outs, aliases = bwd_structs(*shape, head_dim, dtype)
        if arch == "sm_90a" and head_dim in (192, 256):
            cls = FlashBwdSm90WideDeterministic if deterministic else FlashBwdSm90Wide
            kw["use_pdl"] = True
        elif arch == "sm_90a":
            cls = FlashBwdSm90Deterministic if deterministic else FlashBwdSm90
            kw["use_pdl"] = True
        else:
            cls = FlashBwdSm100Deterministic if deterministic else FlashBwdSm100

        def make():
            return cls(cute_dtype, head_dim, head_dim, False, head_dim**-0.5, **kw)
        if deterministic:
            parts = getattr(make(), "split", 1)
            sem = sds((b, hq, -(-sq // make().tile_m) * parts), jnp.int32)
            ins, outs, aliases = ins + (sem,), outs + (sem,), {6: 0, 7: 3}
        ins = ins + (sds((b, sk, 2), jnp.int32),)
    if segments:
        ins = ins + (sds((b, sq), jnp.int32), sds((b, sk), jnp.int32))
    if direction == "bwd" and make().takes_walks:
        ins = ins + (sds((b, -(-sk // make().tile_n), 5), jnp.int32),)
    return lower(make, arch, ins, outs, aliases, compile_options)
