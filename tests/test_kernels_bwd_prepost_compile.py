"""CPU compile checks for the backward preprocess and postprocess kernels
(kernels/bwd_preprocess.py, kernels/bwd_postprocess.py).

Each build the lowering ships (rules/plan.py) is lowered once through
cutlass.jax.cutlass_call (cute.compile runs on the CPU), on dynamic shapes
(divisibility 1 on B, S, H) as in use: on sm_90a with programmatic dependent launch
and the main kernel's layouts (by-thread statistics at hdim 128, the flat dQ
accumulator at hdim 64 / 128), on sm_100a without either. The checks read the SASS
and PTX. The workspace and statistics layouts are checked in plain Python.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_compile import assert_pdl_chained, count, dump_options, dumped_sass, lower, read_dump

from jax_fa4.kernels.bwd_preprocess import (
    FlashBwdPreprocess,
    bwd_workspace_shapes,
    stat_order,
    stat_position,
)

needs_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed"
)

B, SQ, H = 2, 203, 3


def _structs(d: int, dtype=jnp.bfloat16):
    """(O / dO, LSE / dLSE, the workspaces) of a problem of head dim d."""
    ws = bwd_workspace_shapes(B, SQ, H, d)
    o = jax.ShapeDtypeStruct((B, SQ, H, d), dtype)
    lse = jax.ShapeDtypeStruct((B, H, SQ), jnp.float32)
    return o, lse, tuple(jax.ShapeDtypeStruct(*ws[k]) for k in ("Dpsum", "LSElog2", "dQaccum"))


def _plan(arch: str, d: int, dlse: bool = True, dtype: str = "bfloat16",
          one_key_block: bool = False):
    from jax_fa4.rules.plan import bwd_plan

    return bwd_plan(arch, dtype, d, d, False, d**-0.5, False, dlse,
                    one_key_block=one_key_block)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """build(kernel, arch, head_dim, dlse=True, dtype=bf16, one_key_block=False) ->
    (SASS, PTX) of the plan's "pre" or "post" kernel, compiled once."""
    cache = {}

    def get(kernel: str, arch: str, d: int, dlse: bool = True, dtype=jnp.bfloat16,
            one_key_block: bool = False):
        key = (kernel, arch, d, dlse, jnp.dtype(dtype).name, one_key_block)
        if key not in cache:
            plan = _plan(arch, d, dlse, jnp.dtype(dtype).name, one_key_block)
            o, lse, ws = _structs(d, dtype)
            if kernel == "pre":
                # No accumulator where the main kernel writes dQ itself.
                outs = ws[:2] if one_key_block else ws
                make, ins = plan.build_pre, (o, o, lse) + (lse,) * dlse
            else:
                make, ins, outs = plan.build_post, (ws[2],), (o,)
            dump = tmp_path_factory.mktemp("-".join(map(str, key)))
            assert "custom_call" in lower(make, arch, ins, outs,
                                          compile_options=dump_options(dump))
            cache[key] = dumped_sass(dump), read_dump(dump, "ptx")
        return cache[key]

    return get


def _assert_reversed_walk(ptx: str) -> None:
    """Note [Pre / post order]: (batch, head) counted from the end of the grid."""
    assert "%nctaid.y" in ptx and "%nctaid.z" in ptx


@needs_cutlass
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_preprocess(build, head_dim):
    """The sm_90a preprocess, with the LSE's cotangent and without it
    (FlashBwdPreprocessNoDlse, one Dpsum load fewer per row a thread writes), writes
    its statistics in the main kernel's order (by thread at hdim 128, stat_position)
    with the same stores, zeroes dQaccum with 128-bit stores (tile_m * D / 4 / 256
    per thread), waits for the kernel before it and walks (batch, head) last first."""
    from jax_fa4.kernels.bwd_preprocess import preprocess_tiling

    assert _plan("sm_90a", head_dim).pre.stat_block == (64 if head_dim == 128 else 0)
    tile_m, threads = preprocess_tiling(head_dim)
    rows = -(-tile_m // (threads // (head_dim // 8)))  # O / dO rows per thread
    counts = {}
    for dlse in (True, False):
        sass, ptx = build("pre", "sm_90a", head_dim, dlse)
        assert_pdl_chained(sass)
        _assert_reversed_walk(ptx)
        assert not count(r"\b(LDL|STL)\b", sass)
        counts[dlse] = (count(r"\bLDG\b", sass), count(r"\bSTG\.E\.128\b", sass),
                        count(r"\bSTG\.E\s", sass))
    zeroing = tile_m * head_dim // 4 // threads
    assert counts[True][1:] == counts[False][1:] == (zeroing, 1 + rows), counts
    assert counts[False][0] == counts[True][0] - rows, counts


@needs_cutlass
@pytest.mark.parametrize("head_dim", [64, 128])
def test_preprocess_of_a_stored_dq(build, head_dim):
    """Note [One key block per query block]: the preprocess of a backward whose main
    kernel writes dQ itself has no accumulator to zero (no 128-bit stores), the same
    statistics."""
    sass, _ = build("pre", "sm_90a", head_dim, False, one_key_block=True)
    zeroing, _ = build("pre", "sm_90a", head_dim, False)
    assert_pdl_chained(sass)
    assert count(r"\bSTG\.E\.128\b", zeroing) and not count(r"\bSTG\.E\.128\b", sass)
    assert count(r"\bSTG\.E\s", sass) == count(r"\bSTG\.E\s", zeroing)
    assert count(r"\bLDG\b", sass) == count(r"\bLDG\b", zeroing)


@needs_cutlass
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_postprocess(build, head_dim):
    """The sm_90a postprocess reads the flat dQ accumulator of the main kernel's
    query tile (Note [Flat dQ accumulator]; the wide kernel's at 192 / 256) as
    coalesced 128-bit loads, tile_m * D / 256 floats per thread, and writes the
    16-bit tile by stmatrix and one TMA store. It waits for the main kernel and
    walks (batch, head) last first."""
    sass, ptx = build("post", "sm_90a", head_dim)
    assert_pdl_chained(sass)
    _assert_reversed_walk(ptx)
    assert not count(r"\b(LDL|STL)\b", sass)
    tile_m = _plan("sm_90a", head_dim).post.dq_tile_m
    assert tile_m == {64: 128, 128: 64, 192: 64, 256: 64}[head_dim]
    assert count(r"\bLDG\.E\.128\b", sass) == tile_m * head_dim // 256 // 4
    assert "STSM" in sass and "UTMASTG" in sass


@needs_cutlass
@pytest.mark.parametrize("kernel", ["pre", "post"])
def test_sm100_builds_launch_plainly(build, kernel):
    """sm_100a (compiled, not run on hardware): row-order statistics and a row-major
    accumulator, no PDL wait."""
    sass, ptx = build(kernel, "sm_100a", 128)
    assert "ACQBULK" not in sass and "griddepcontrol" not in ptx
    _assert_reversed_walk(ptx)


@needs_cutlass
def test_fp16_builds(build):
    for kernel in ("pre", "post"):
        sass, _ = build(kernel, "sm_90a", 128, dtype=jnp.float16)
        assert_pdl_chained(sass)


@needs_cutlass
def test_rejects_what_it_has_no_build_for():
    from jax_fa4.kernels.bwd_postprocess import FlashBwdPostprocess

    for tile_m, d in ((80, 128), (96, 128), (128, 256), (128, 192)):
        with pytest.raises(ValueError, match="flat"):
            FlashBwdPostprocess(jnp.bfloat16, d, 0.1, flat_tile_m=tile_m)
    with pytest.raises(TypeError):
        FlashBwdPreprocess(jnp.float32, 128, 128)
    with pytest.raises(ValueError):
        FlashBwdPostprocess(jnp.bfloat16, 100, 0.1)
    for bad in (80, 8):  # not dividing SEQLEN_Q_PAD / dividing it but not a multiple of 16
        with pytest.raises(ValueError, match="statistics block"):
            FlashBwdPreprocess(jnp.bfloat16, 128, 128, stat_block=bad)


def test_workspace_shapes():
    ws = bwd_workspace_shapes(2, 203, 3, 64)
    # Row statistics are padded to Sq_pad like the accumulator.
    assert ws["Dpsum"] == ((2, 3, 256), np.dtype(np.float32))
    assert ws["LSElog2"] == ((2, 3, 256), np.dtype(np.float32))
    assert ws["dQaccum"] == ((2, 3, 256, 64), np.dtype(np.float32))
    assert bwd_workspace_shapes(1, 128, 1, 128)["dQaccum"][0] == (1, 1, 128, 128)
    assert bwd_workspace_shapes(1, 1, 1, 128, tile_m=64)["dQaccum"][0] == (1, 1, 128, 128)
    with pytest.raises(ValueError):  # a query tile must be a whole block of Sq_pad
        bwd_workspace_shapes(1, 1, 1, 128, tile_m=80)


@pytest.mark.parametrize("block", [64, 128])
def test_stat_order_gives_each_thread_conflict_free_chunks(block):
    """stat_position (by-thread statistics): a permutation inside every block of a
    workspace, under which the columns 8 j + 2 q + e that the sm90 wgmma
    accumulator gives lane quad q, taken in the thread's register order (e fastest,
    then j), come in chunks of 4 contiguous floats (one 128-bit load each), and
    chunk k of the four quads together fills positions 16 k .. 16 k + 15 of the
    block (64 contiguous bytes: no two quads on the same banks)."""
    sqp = 2 * 128
    order = stat_order(sqp, block)
    assert sorted(order) == list(range(sqp))
    assert all(r // block == p // block for p, r in enumerate(order))  # stays in its block
    assert stat_position(np.arange(sqp), None).tolist() == list(range(sqp))
    for base in (0, block):
        for k in range(block // 16):
            chunks = []
            for q in range(4):
                cols = [base + 8 * j + 2 * q + e for j in range(block // 8) for e in (0, 1)]
                pos = [stat_position(c, block) for c in cols[4 * k: 4 * k + 4]]
                assert pos == list(range(pos[0], pos[0] + 4)) and pos[0] % 4 == 0, pos
                chunks += pos
            assert sorted(chunks) == list(range(base + 16 * k, base + 16 * k + 16))


def test_padded_rows_cover_whole_query_tiles():
    from jax_fa4.kernels.bwd_preprocess import SEQLEN_Q_PAD, seqlen_q_padded

    for seqlen in (1, 113, 128, 1000, 4097, 16384):
        assert seqlen_q_padded(seqlen) == -(-seqlen // SEQLEN_Q_PAD) * SEQLEN_Q_PAD
    # Every query tile of the main kernels (64 or 128 rows) is a whole block.
    assert SEQLEN_Q_PAD % 128 == 0
