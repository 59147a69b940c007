"""The masked kernels on a machine without a GPU: every mask lowers to the sm_90a
kernels (forward + the three backward kernels) through the public API, the causal
modes, windows and lengths share one compiled kernel per direction and head dim
(the intervals are data, rules/ranges.py), and the builds hold what keeps them
fast: no local memory, the interval test as one unsigned compare. The
deterministic backward takes masks too (its walks and ordered dQ adds, Note
[Masked dQ order]). The sm_100a kernels are compiled, not run on
hardware."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import jax_fa4
from jax_fa4.ffi import cutlass_available

pytestmark = pytest.mark.skipif(cutlass_available() is not None, reason="no CuTe DSL")

CALL = "CuteDSLRT_NvJaxCutlassCall"
B, SQ, SK, HQ, HKV = 2, 113, 203, 4, 2


def _structs(d, sq=SQ, sk=SK):
    return (jax.ShapeDtypeStruct((B, sq, HQ, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, sk, HKV, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, sk, HKV, d), jnp.bfloat16))


def _step(implementation="cute", deterministic=False, **masks):
    def loss(q, k, v, lengths, seg_q, seg_k):
        kw = dict(masks)
        kw.update({n: a for n, a in (("kv_lengths", lengths), ("q_segment_ids", seg_q),
                                     ("kv_segment_ids", seg_k)) if kw.pop(n, False)})
        out, lse = jax_fa4.attention(q, k, v, return_lse=True, implementation=implementation,
                                     deterministic=deterministic, **kw)
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()
    return jax.grad(loss, argnums=(0, 1, 2))


def _lower(fn, d, sq=SQ, sk=SK):
    i32 = jnp.int32
    args = _structs(d, sq, sk) + (jax.ShapeDtypeStruct((B,), i32),
                                  jax.ShapeDtypeStruct((B, sq), i32),
                                  jax.ShapeDtypeStruct((B, sk), i32))
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("d", [128])
def test_masks_lower_to_the_sm90_kernels_one_build_for_all(monkeypatch, kernel_calls, d):
    """Lengths + causal, a window, bottom-right causal: four custom calls each, and
    the same forward and backward main kernel for all three."""
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_90a")
    for masks in (dict(causal=True, kv_lengths=True), dict(window=(17, 3)),
                  dict(causal="bottom_right")):
        assert _lower(_step(**masks), d).count(CALL) == 4
    keys = [k for k, _ in kernel_calls]
    fwd = {k for k in keys if k.kind == "fwd"}
    main = {k for k in keys if k.kind == "bwd"}
    assert len(fwd) == len(main) == 1
    assert next(iter(fwd)).masked and not next(iter(fwd)).segments
    assert not next(iter(fwd)).causal  # causal travels in the intervals


@pytest.mark.parametrize("arch,d", [("sm_90a", 64), ("sm_90a", 128), ("sm_90a", 192),
                                    ("sm_90a", 256), ("sm_100a", 128), ("sm_100a", 256)])
def test_deterministic_masks_lower_to_the_kernel(monkeypatch, kernel_calls, arch, d):
    """deterministic=True with masks: four custom calls, the main one the masked
    deterministic kernel (kind "bwd_det"), which takes after mdQaccum one semaphore
    per query block of its masked tiles, then the intervals, the segment ids, and
    last each key block's walk (B, ceil(Sk / tile_n), 5). sm_100a: compiled, not
    run on hardware."""
    monkeypatch.setenv("JAX_FA4_ARCH", arch)
    from jax_fa4.rules.plan import bwd_plan

    calls = kernel_calls
    masks = dict(causal="bottom_right", window=(40, None), kv_lengths=True,
                 q_segment_ids=True, kv_segment_ids=True)
    assert _lower(_step(deterministic=True, **masks), d).count(CALL) == 4
    assert [k.kind for k, _ in calls] == ["fwd", "bwd_pre", "bwd_det", "bwd_post"]
    key, inputs = calls[2]
    assert key.masked and key.segments and not key.causal
    plan = bwd_plan(arch, "bfloat16", d, d, False, d**-0.5, True, True, True, True)
    tile_n, tile_m = plan.walk_tiles
    assert plan.sem_tile_m == tile_m
    if arch == "sm_90a" and d <= 128:
        from jax_fa4.kernels.sm90_bwd import bwd_tiles

        assert tile_m == bwd_tiles(d, False, masked=True).tile_m
    i32 = jnp.dtype(jnp.int32)
    assert inputs[7:] == [(plan.semaphores(B, SQ, HQ).shape, i32), ((B, SK, 2), i32),
                          ((B, SQ), i32), ((B, SK), i32), ((B, -(-SK // tile_n), 5), i32)]
    assert bwd_plan(arch, "bfloat16", d, d, False, 0.1, True, True).walk_tiles is None
    # The default masked kernel takes its walks too (Note [Block walks]), but for the
    # wide sm_90a one, which reduces the keys' intervals itself.
    default = bwd_plan(arch, "bfloat16", d, d, False, 0.1, False, True, True).walk_tiles
    assert default == (None if arch == "sm_90a" and d > 128 else (tile_n, tile_m))


@pytest.mark.parametrize("arch,d,group,pack", [
    ("sm_90a", 64, 8, 8), ("sm_90a", 64, 3, 3), ("sm_90a", 128, 3, 1), ("sm_90a", 128, 1, 1),
    ("sm_100a", 64, 8, 8), ("sm_100a", 128, 3, 1)])
def test_masked_forward_packs_gqa_heads_that_divide_its_tiles(arch, d, group, pack):
    """Note [Packed GQA]: the masked forward takes a group's query heads into one
    tile where the group divides tile_m (sm_90a: 192 at hdim 64, 128 at 128; sm_100a:
    128); the plain kernels do not pack."""
    from jax_fa4.rules.plan import fwd_plan

    assert fwd_plan(arch, "bfloat16", d, d, True, 0.1, masked=True,
                    group=group).key.pack_gqa == pack
    assert fwd_plan(arch, "bfloat16", d, d, True, 0.1, group=group).key.pack_gqa == 1


@pytest.mark.parametrize("arch,d,group,rows,split,short", [
    ("sm_90a", 64, 1, 113, False, True), ("sm_90a", 64, 1, 128, False, True),
    ("sm_90a", 64, 4, 29, False, True), ("sm_90a", 64, 8, 1, False, True),
    ("sm_90a", 64, 8, 16, False, True), ("sm_90a", 64, 8, 17, False, False),
    ("sm_90a", 64, 1, 129, False, False), ("sm_90a", 64, 3, 40, False, False),
    ("sm_90a", 64, 1, 113, True, False), ("sm_90a", 64, 1, 0, False, False),
    ("sm_90a", 128, 1, 113, False, False), ("sm_100a", 64, 1, 113, False, False)])
def test_masked_forward_fits_short_rows(arch, d, group, rows, split, short):
    """``short_tiles``: the sm_90a masked forward at head dim 64 runs tiles of at
    most 128 rows (with the packed GQA heads, a group that divides 128; decode
    too) on 128-row tiles; longer ones, a group of 3, split keys, unknown rows,
    other head dims and sm_100a keep the table's row."""
    from jax_fa4.kernels.sm90_fwd import make_fwd_sm90
    from jax_fa4.rules.plan import fwd_plan

    key = fwd_plan(arch, "bfloat16", d, d, False, 0.1, masked=True, group=group,
                   split_kv=split, rows=rows).key
    assert key.short_tiles == short
    assert not fwd_plan(arch, "bfloat16", d, d, True, 0.1, group=group, rows=rows
                        ).key.short_tiles
    if arch == "sm_90a":
        kernel = make_fwd_sm90(jnp.bfloat16, d, d, False, masked=True,
                               pack_gqa=key.pack_gqa, split_kv=split, short=short)
        assert kernel.tile_m == (128 if short else 192 if d == 64 else 128)
        assert kernel.tiles.q_in_regs == short


def test_short_rows_lower_to_the_short_forward(monkeypatch, kernel_calls):
    """50 query rows of 2 heads per KV head at hdim 64 (100 rows a tile) with key
    lengths: the forward's key has the short tiles; 200 rows do not."""
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_90a")
    for sq, short in ((50, True), (100, False)):
        kernel_calls.clear()
        assert _lower(_step(kv_lengths=True), 64, sq=sq).count(CALL) == 4
        fwd = [k for k, _ in kernel_calls if k.kind == "fwd"]
        assert len(fwd) == 1 and fwd[0].short_tiles == short and fwd[0].pack_gqa == 2


def test_masks_lower_to_the_sm100_kernels(monkeypatch):
    """Compiled, not run on hardware."""
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_100a")
    masks = dict(causal="bottom_right", kv_lengths=True, q_segment_ids=True,
                 kv_segment_ids=True)
    assert _lower(_step(**masks), 128).count(CALL) == 4


def test_short_masked_forward_build(tmp_path):
    """The short rows' tiles (``short_tiles``): Q as the register operand of its
    wgmmas, 4 query heads packed into 116 rows, no local memory."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from kernel_compile import dump_options, lower_masked, read_dump

    lower_masked("sm_90a", "fwd", jnp.bfloat16, 64, shape=(2, 29, 203, 4, 1), short=True,
                 compile_options=dump_options(pathlib.Path(tmp_path)))
    ptx = read_dump(pathlib.Path(tmp_path), "ptx")
    assert ptx is not None and "setp.lt.u32 p, t," in ptx
    # S = Q K^T (N = 128 keys; O += P V has N = 64) with Q from registers: its
    # wgmma's A operand is a register list, not a descriptor.
    qk = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16"
                    r" +\{[^}]*\}, *(\S)", ptx)
    assert qk and set(qk) == {"{"}, qk[:4]
    sass = read_dump(pathlib.Path(tmp_path), "sass")
    if sass is None:
        pytest.skip("the DSL wrote no SASS (disassembler unavailable to it)")
    assert not re.search(r"\b(LDL|STL)\b", sass)


# (arch, direction, head dim, segment ids): each masked kernel class once.
BUILDS = [("sm_90a", "fwd", 64, False), ("sm_90a", "fwd", 256, True),
          ("sm_90a", "bwd", 128, False), ("sm_90a", "bwd", 256, True),
          ("sm_100a", "fwd", 128, False), ("sm_100a", "bwd", 64, True)]


@pytest.mark.parametrize("arch,direction,d,segments", BUILDS,
                         ids=["-".join(map(str, b)) for b in BUILDS])
def test_masked_builds(tmp_path, arch, direction, d, segments):
    """The interval test is one unsigned compare per score (``keep_inside`` in
    kernels/mask.py), the tensor-core instructions of the architecture are there,
    and the sm90 builds without segment ids use no local memory (the hdim-128
    backward's MMA warpgroups have no register to spare)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from kernel_compile import dump_options, lower_masked, read_dump

    lower_masked(arch, direction, jnp.bfloat16, d, segments,
                 compile_options=dump_options(pathlib.Path(tmp_path)))
    ptx = read_dump(pathlib.Path(tmp_path), "ptx")
    assert ptx is not None
    assert "setp.lt.u32 p, t," in ptx
    assert ("wgmma.mma_async" if arch == "sm_90a" else "tcgen05.mma") in ptx
    sass = read_dump(pathlib.Path(tmp_path), "sass")
    if sass is None:
        pytest.skip("the DSL wrote no SASS (disassembler unavailable to it)")
    assert re.search(r"\bHGMMA\." if arch == "sm_90a" else r"\bUTC\w*MMA", sass)
    if direction == "fwd":
        # 4 query heads on 1 KV head packed into the tiles (Note [Packed GQA]): Q
        # loads and O stores as (head dim, group, positions, heads, batch) boxes.
        assert re.search(r"cp\.async\.bulk\.tensor\.5d\.shared::cta\.global", ptx)
        assert re.search(r"cp\.async\.bulk\.tensor\.5d\.global\.shared::cta", ptx)
    local = len(re.findall(r"\b(LDL|STL)\b", sass))
    if not segments and arch == "sm_90a":
        assert local == 0
    elif not segments:
        # The sm100 causal forward's softmax warps already spill a little (19).
        assert local <= 40, local


# (arch, head dim, segment ids): the deterministic masked builds read below.
DET_BUILDS = [("sm_90a", 64, True), ("sm_90a", 128, False), ("sm_100a", 128, False)]


@pytest.mark.parametrize("arch,d,segments", DET_BUILDS,
                         ids=["-".join(map(str, b)) for b in DET_BUILDS])
def test_deterministic_masked_builds(tmp_path, arch, d, segments):
    """The deterministic masked backward (Note [Masked dQ order]): its dQ adds wait
    for their rank with an acquire spin, land, then release the next key block,
    in that order; the rank is one warp reduction (redux.sync) of the lanes'
    counts; the sm90 builds use no local memory (the dQ warp's 24 registers hold
    the rank's loop) and read nothing global before the PDL wait, the sm100 one
    hardly any local memory (as its plain deterministic build). sm_100a: compiled,
    not run on hardware."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from kernel_compile import (
        assert_pdl_chained,
        assert_semaphore_order,
        dump_options,
        dumped_sass,
        lower_masked,
    )

    lower_masked(arch, "bwd", jnp.bfloat16, d, segments, deterministic=True,
                 compile_options=dump_options(pathlib.Path(tmp_path)))
    sass = dumped_sass(pathlib.Path(tmp_path))
    lines = [ln.strip() for ln in sass.splitlines()]
    assert_semaphore_order(lines, r"UBLKRED\.G\.S\.ADD\.F32" if arch == "sm_90a"
                           else r"UTMAREDG")
    assert re.search(r"\bREDUX\.SUM\.S32\b", sass), "no warp reduction of the rank"
    spin = [i for i, ln in enumerate(lines) if re.search(r"LDG\.E\.STRONG\.GPU", ln)]
    assert any(re.search(r"\bBRA\b", ln) for ln in lines[spin[-1]:spin[-1] + 8]), "no spin"
    local = len(re.findall(r"\b(LDL|STL)\b", sass))
    if arch == "sm_90a":
        assert local == 0
        assert_pdl_chained(sass)  # the walks too are read after the preprocess
    else:
        assert local <= 16, local


@pytest.mark.parametrize("arch,d", [("sm_90a", 128), ("sm_90a", 64), ("sm_100a", 128)])
def test_split_key_builds(tmp_path, arch, d):
    """The split-keys forward (Note [Split keys] in kernels/sm90_fwd.py): its float32
    partials leave the registers as vector stores straight to global memory (no O
    TMA store), and the sm90 builds use no local memory. sm_100a: compiled, not
    run on hardware."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from kernel_compile import dump_options, lower_masked, read_dump

    lower_masked(arch, "fwd", jnp.bfloat16, d, shape=(2, 3, 1000, 8, 2), splits=3,
                 compile_options=dump_options(pathlib.Path(tmp_path)))
    ptx = read_dump(pathlib.Path(tmp_path), "ptx")
    vector = r"st\.global\.v2\.b32" if arch == "sm_90a" else r"st\.global\.v4\.b64"
    # Every O element of a thread's fragment in vectors: sm90, d / 2 floats (a
    # warpgroup's 128 threads hold 64 rows), 2 per store; sm100, a row of each of
    # the 2 tiles, 8 per store.
    stores = len(re.findall(vector, ptx))
    assert stores == (d // 4 if arch == "sm_90a" else 2 * d // 8), stores
    assert not re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx)
    sass = read_dump(pathlib.Path(tmp_path), "sass")
    if sass is None:
        pytest.skip("the DSL wrote no SASS (disassembler unavailable to it)")
    if arch == "sm_90a":
        assert not re.findall(r"\b(LDL|STL)\b", sass)


@pytest.mark.parametrize("arch,d,page_size", [("sm_90a", 128, 16), ("sm_90a", 64, 64),
                                              ("sm_90a", 256, 16), ("sm_100a", 128, 256),
                                              ("sm_100a", 128, 32), ("sm_100a", 256, 16)])
def test_paged_builds(tmp_path, arch, d, page_size):
    """The forward that reads a paged cache in place (Note [Paged KV] in
    kernels/sm90_fwd.py), with split keys: K and V arrive as 4-D TMA boxes of the
    pools; a block of several pages takes its page ids from the load warp's lanes
    by shuffle, one box load per page piece in a run-time loop (on sm_90a with no
    local memory; sm_100a: Note [Page pieces], compiled, not run on hardware)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from kernel_compile import dump_options, lower_masked, read_dump

    lower_masked(arch, "fwd", jnp.bfloat16, d, shape=(2, 3, 1000, 8, 2), splits=3,
                 page_size=page_size, compile_options=dump_options(pathlib.Path(tmp_path)))
    ptx = read_dump(pathlib.Path(tmp_path), "ptx")
    assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::cta\.global", ptx)
    if arch == "sm_90a":
        assert "shfl.sync.idx" in ptx
        sass = read_dump(pathlib.Path(tmp_path), "sass")
        if sass is None:
            pytest.skip("the DSL wrote no SASS (disassembler unavailable to it)")
        assert not re.findall(r"\b(LDL|STL)\b", sass)
