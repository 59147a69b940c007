"""CPU compile checks for the backward preprocess and postprocess kernels.

Lowers each kernel through cutlass.jax.cutlass_call for sm_90a and sm_100a
(cute.compile runs on the CPU, no GPU needed) and checks that the HLO holds
the custom call. Shapes are dynamic (divisibility 1 on B, S, H), as in use.
"""

import glob
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_compile import dump_options, dumped_sass, lower, read_dump

from jax_fa4.kernels.bwd_postprocess import FlashBwdPostprocess
from jax_fa4.kernels.bwd_preprocess import (
    FlashBwdPreprocess,
    bwd_workspace_shapes,
    stat_order,
    stat_position,
)

needs_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed"
)

ARCHS = ("sm_90a", "sm_100a")
DTYPES = (jnp.bfloat16, jnp.float16)


def test_workspace_shapes():
    ws = bwd_workspace_shapes(2, 203, 3, 64)
    # Row statistics are padded to Sq_pad like the accumulator.
    assert ws["Dpsum"] == ((2, 3, 256), np.dtype(np.float32))
    assert ws["LSElog2"] == ((2, 3, 256), np.dtype(np.float32))
    assert ws["dQaccum"] == ((2, 3, 256, 64), np.dtype(np.float32))
    assert bwd_workspace_shapes(1, 128, 1, 128)["dQaccum"][0] == (1, 1, 128, 128)
    assert bwd_workspace_shapes(1, 1, 1, 128)["dQaccum"][0] == (1, 1, 128, 128)


@needs_cutlass
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_preprocess_compiles(arch, dtype, head_dim):
    batch, seqlen, heads = 2, 203, 3
    ws = bwd_workspace_shapes(batch, seqlen, heads, head_dim)
    o = jax.ShapeDtypeStruct((batch, seqlen, heads, head_dim), dtype)
    lse = jax.ShapeDtypeStruct((batch, heads, seqlen), jnp.float32)
    outs = tuple(jax.ShapeDtypeStruct(*ws[k]) for k in ("Dpsum", "LSElog2", "dQaccum"))
    text = lower(lambda: FlashBwdPreprocess(dtype, head_dim, head_dim), arch,
                 (o, o, lse, lse), outs)
    assert "custom_call" in text


@pytest.mark.parametrize("block", [64, 128])
def test_stat_order_gives_each_thread_conflict_free_chunks(block):
    """stat_position (BwdTiles.stats_by_thread): a permutation inside every block of
    a workspace, under which the columns 8 j + 2 q + e that the sm90 wgmma
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
    for bad in (80, 8):  # not dividing SEQLEN_Q_PAD / dividing it but not a multiple of 16
        with pytest.raises(ValueError, match="statistics block"):
            FlashBwdPreprocess(jnp.bfloat16, 128, 128, stat_block=bad)


def _pre_structs(d: int, batch: int = 2, seqlen: int = 203, heads: int = 3):
    """(O / dO, LSE / dLSE, the preprocess's outputs) of a bf16 problem of head dim d."""
    ws = bwd_workspace_shapes(batch, seqlen, heads, d)
    o = jax.ShapeDtypeStruct((batch, seqlen, heads, d), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((batch, heads, seqlen), jnp.float32)
    return o, lse, tuple(jax.ShapeDtypeStruct(*ws[k]) for k in ("Dpsum", "LSElog2", "dQaccum"))


@needs_cutlass
def test_preprocess_by_thread_order_compiles(tmp_path):
    """The preprocess with a by-thread statistics block (64, the hdim 128 main
    kernel's query tile) lowers for sm_90a with the same stores as in row order:
    8 128-bit zeroing stores of dQaccum and 5 scalar statistic stores per thread
    (LSElog2 and its 4 Dpsum rows), now at the positions of stat_position."""
    d = 128
    o, lse, outs = _pre_structs(d)
    sass = {}
    for block in (None, 64):
        dump = tmp_path / str(block)
        text = lower(lambda block=block: FlashBwdPreprocess(jnp.bfloat16, d, d, stat_block=block),
                     "sm_90a", (o, o, lse, lse), outs, compile_options=dump_options(dump))
        assert "custom_call" in text
        sass[block] = dumped_sass(dump)
    stores = {b: (len(re.findall(r"\bSTG\.E\.128\b", t)), len(re.findall(r"\bSTG\.E\s", t)))
              for b, t in sass.items()}
    assert stores == {None: (8, 5), 64: (8, 5)}, stores


@needs_cutlass
@pytest.mark.parametrize("arch", ARCHS)
def test_preprocess_without_dlse_compiles(tmp_path, arch):
    """FlashBwdPreprocessNoDlse (LSE's cotangent a symbolic zero) takes O, dO and LSE
    only, and drops exactly the dLSE loads: its SASS has 4 global loads fewer than
    the preprocess with dLSE (one per Dpsum row a thread writes), the same stores."""
    from jax_fa4.kernels.bwd_preprocess import FlashBwdPreprocessNoDlse

    d = 128
    o, lse, outs = _pre_structs(d)
    counts = {}
    for name, kernel, ins in (("dlse", FlashBwdPreprocess, (o, o, lse, lse)),
                              ("none", FlashBwdPreprocessNoDlse, (o, o, lse))):
        dump = tmp_path / name
        text = lower(lambda kernel=kernel: kernel(jnp.bfloat16, d, d), arch, ins, outs,
                     compile_options=dump_options(dump))
        assert "custom_call" in text
        sass = dumped_sass(dump)
        counts[name] = (len(re.findall(r"\bLDG\b", sass)), len(re.findall(r"\bSTG\b", sass)))
    assert counts["none"][0] == counts["dlse"][0] - 4, counts
    assert counts["none"][1] == counts["dlse"][1], counts


@needs_cutlass
def test_prepost_reverse_heads(tmp_path, monkeypatch):
    """reverse_heads (Note [Pre / post order]; off): the preprocess (row and by-thread
    statistics) and the postprocess (row and flat dQaccum) read the grid's y and z
    extents (%nctaid) to count heads and batches from the end; in grid order they do
    not. $JAX_FA4_PREPOST_REVERSE sets it in the keys of the pre- and postprocess
    only."""
    from jax_fa4.config import AttentionConfig
    from jax_fa4.kernels.bwd_postprocess import FlashBwdPostprocess
    from jax_fa4.rules.kernels_cuda import _key

    d = 128
    o, lse, outs = _pre_structs(d)
    acc = jax.ShapeDtypeStruct(outs[2].shape, jnp.float32)
    builds = {
        "pre": (lambda **kw: FlashBwdPreprocess(jnp.bfloat16, d, d, **kw), (o, o, lse, lse), outs),
        "pre64": (lambda **kw: FlashBwdPreprocess(jnp.bfloat16, d, d, stat_block=64, **kw),
                  (o, o, lse, lse), outs),
        "post": (lambda **kw: FlashBwdPostprocess(jnp.bfloat16, d, 0.1, **kw), (acc,), (o,)),
        "post64": (lambda **kw: FlashBwdPostprocess(jnp.bfloat16, d, 0.1, 64, **kw), (acc,),
                   (o,)),
    }
    for name, (make, ins, outs_) in builds.items():
        for rev in (False, True):
            dump = tmp_path / f"{name}_{rev}"
            lower(lambda make=make, rev=rev: make(reverse_heads=rev), "sm_90a", ins, outs_,
                  compile_options=dump_options(dump))
            ptx = read_dump(dump, "ptx")
            assert ptx is not None
            got = ("%nctaid.y" in ptx, "%nctaid.z" in ptx)
            assert got == (rev, rev), (name, rev, got)
    q = jax.ShapeDtypeStruct((2, 203, 3, d), jnp.bfloat16)
    cfg = AttentionConfig(scale=0.1, causal=True)
    kinds = ("bwd_pre", "bwd_pre_by_thread", "bwd_post", "bwd", "fwd")
    for env, want in (("1", True), ("0", False), ("", True)):
        monkeypatch.setenv("JAX_FA4_PREPOST_REVERSE", env)
        keys = {kind: _key(kind, "sm_90a", q, q, cfg) for kind in kinds}
        assert {k: v.prepost_reverse for k, v in keys.items()} == {
            kind: want and kind.startswith(("bwd_pre", "bwd_post")) for kind in kinds}


@needs_cutlass
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_postprocess_compiles(arch, dtype, head_dim):
    batch, seqlen, heads = 2, 203, 3
    shape, f32 = bwd_workspace_shapes(batch, seqlen, heads, head_dim)["dQaccum"]
    out = jax.ShapeDtypeStruct((batch, seqlen, heads, head_dim), dtype)
    text = lower(lambda: FlashBwdPostprocess(dtype, head_dim, head_dim**-0.5), arch,
                 (jax.ShapeDtypeStruct(shape, f32),), (out,))
    assert "custom_call" in text


@needs_cutlass
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile_m,head_dim", [(64, 128), (128, 64), (80, 128)])
def test_postprocess_flat_compiles(tmp_path, dtype, tile_m, head_dim):
    """The sm90 backward's flat dQaccum order (Note [Flat dQ accumulator]): each
    thread reads its tile_m * D / 256 floats as coalesced 128-bit loads, writes
    16-bit dQ to SMEM with stmatrix (transposed for the 80-row tile, which holds
    dQ^T's fragments), and one TMA store writes the tile."""
    batch, seqlen, heads = 2, 203, 3
    odd = tile_m if tile_m % 64 else None
    shape, f32 = bwd_workspace_shapes(batch, seqlen, heads, head_dim, odd)["dQaccum"]
    out = jax.ShapeDtypeStruct((batch, seqlen, heads, head_dim), dtype)
    text = lower(lambda: FlashBwdPostprocess(dtype, head_dim, head_dim**-0.5, tile_m), "sm_90a",
                 (jax.ShapeDtypeStruct(shape, f32),), (out,),
                 compile_options=dump_options(tmp_path))
    assert "custom_call" in text
    sass_files = glob.glob(str(tmp_path / "*.sass"))
    if not sass_files:
        pytest.skip("no SASS was dumped (disassembler unavailable to the DSL)")
    sass = open(sass_files[0]).read()
    assert len(re.findall(r"\bLDG\.E\.128\b", sass)) == tile_m * head_dim // 256 // 4
    assert ("STSM.16.MT88" in sass) == (odd is not None)
    assert "STSM" in sass and "UTMASTG" in sass
    assert not re.findall(r"\b(LDL|STL)\b", sass)


@needs_cutlass
def test_postprocess_rejects_a_flat_order_it_cannot_read():
    with pytest.raises(ValueError, match="flat"):
        FlashBwdPostprocess(jnp.bfloat16, 64, 0.1, flat_tile_m=80)
    with pytest.raises(ValueError, match="flat"):
        FlashBwdPostprocess(jnp.bfloat16, 128, 0.1, flat_tile_m=96)
    with pytest.raises(ValueError, match="flat"):
        FlashBwdPostprocess(jnp.bfloat16, 256, 0.1, flat_tile_m=64)


@needs_cutlass
def test_rejects_bad_dtype():
    with pytest.raises(TypeError):
        FlashBwdPreprocess(jnp.float32, 128, 128)
    with pytest.raises(ValueError):
        FlashBwdPostprocess(jnp.bfloat16, 100, 0.1)
