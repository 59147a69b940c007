"""CPU compile checks for the sm100 backward main kernel (kernels/sm100_bwd.py).

Lowers FlashBwdSm100 through cutlass.jax.cutlass_call for sm_100a (cute.compile runs
on the CPU, no Blackwell GPU needed) with dynamic B, S, H (divisibility 1) and
checks that the HLO holds the custom call. For one configuration it also reads the
PTX and SASS: tcgen05 MMA / TMEM instructions, setmaxnreg and mbarrier waits.
These are compile checks only: the kernel has not run on hardware.
"""

import glob
import importlib.util

import jax.numpy as jnp
import pytest
from kernel_compile import lower_bwd

from jax_fa4.ffi.bridge import pinned_arch

needs_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed"
)


def _lower_bwd(dtype, head_dim: int, causal: bool, shape=(2, 113, 203, 4, 1),
               compile_options: str | None = None) -> str:
    from jax_fa4.kernels.sm100_bwd import FlashBwdSm100

    return lower_bwd(FlashBwdSm100, "sm_100a", dtype, head_dim, causal, shape, compile_options)


@needs_cutlass
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bwd_compiles(head_dim, causal):
    # GQA (4 query heads per kv head) and lengths that are not tile multiples.
    text = _lower_bwd(jnp.bfloat16, head_dim, causal)
    assert "custom_call" in text


@needs_cutlass
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_bwd_compiles_fp16(head_dim):
    assert "custom_call" in _lower_bwd(jnp.float16, head_dim, True)


@needs_cutlass
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (3, 4097, 17, 6, 2), (1, 17, 4097, 2, 2)])
def test_bwd_compiles_odd_shapes(shape):
    assert "custom_call" in _lower_bwd(jnp.bfloat16, 64, True, shape=shape)


@needs_cutlass
def test_bwd_rejects_unsupported_head_dim():
    with pinned_arch("sm_100a"):
        import cutlass

        from jax_fa4.kernels.sm100_bwd import FlashBwdSm100

        with pytest.raises(ValueError):
            FlashBwdSm100(cutlass.BFloat16, 160, 160, False, 0.1)


@needs_cutlass
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bwd_ptx_sass(tmp_path, head_dim):
    _lower_bwd(jnp.bfloat16, head_dim, True,
               compile_options=f"--keep-ptx --keep-sass --dump-dir={tmp_path}")
    ptx_files = glob.glob(str(tmp_path / "*.ptx"))
    assert ptx_files, "no PTX was dumped"
    with open(ptx_files[0]) as f:
        ptx = f.read()
    for needle in ("tcgen05.mma", "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld",
                   "tcgen05.commit", "setmaxnreg", "mbarrier.try_wait",
                   "cp.reduce.async.bulk.tensor", "cp.async.bulk.tensor"):
        assert needle in ptx, f"{needle} missing from the PTX"
    sass_files = glob.glob(str(tmp_path / "*.sass"))
    if not sass_files:
        pytest.skip("no SASS was dumped (disassembler unavailable to the DSL)")
    with open(sass_files[0]) as f:
        sass = f.read()
    assert "UTCHMMA" in sass or "UTCQMMA" in sass or "UTCMMA" in sass, "tcgen05.mma missing"
    assert "USETMAXREG" in sass, "setmaxnreg was dropped"
    spills = sum(line.count("LDL") + line.count("STL") for line in sass.splitlines())
    assert spills <= 16, f"{spills} local-memory instructions in the SASS"


@needs_cutlass
@pytest.mark.parametrize("head_dim", [128, 192])  # hdim 64's: the same construction
def test_operand_views_alias(head_dim):
    """Every SMEM tile is written once and read by two MMAs through two layouts
    (K-major and MN-major, or the compute warps' (key, query) view): check on a
    sample of elements that both layouts put each logical element at the same
    offset, so the second reader sees what the writer stored."""
    with pinned_arch("sm_100a"):
        _check_operand_views(head_dim)


def _operand_layout(mma, tiler, side: str):
    """The one-stage SMEM layout of an MMA's A or B operand tile (bf16)."""
    import cutlass
    import cutlass.utils.blackwell_helpers as sm100_utils

    make = sm100_utils.make_smem_layout_a if side == "A" else sm100_utils.make_smem_layout_b
    return make(mma, tiler, cutlass.BFloat16, 1)


def _first_stage(layout):
    import cutlass.cute as cute

    return cute.slice_(layout.outer, (None, None, None, 0))


def _operand_coords(mma, side: str, shape):
    """The (row, column) coordinates of an A or B operand tile in MMA order."""
    import cutlass.cute as cute

    thr = mma.get_slice(0)
    part = thr.partition_A if side == "A" else thr.partition_B
    return part(cute.make_identity_tensor(shape))


def _check_operand_views(head_dim: int) -> None:
    import cutlass
    import cutlass.cute as cute

    from jax_fa4.kernels.sm100_bwd import FlashBwdSm100, _rows_cols

    step = 37  # a prime stride through the tile keeps the check to a few seconds

    @cute.jit
    def check(d: cutlass.Constexpr[int]):
        kernel = FlashBwdSm100(cutlass.BFloat16, d, d, True, 0.1)
        (ms, mdp, mdv, mdk, mdq), tl = kernel._tiled_mmas()
        dt = cutlass.BFloat16

        def operand(mma, tiler, side):
            return _operand_layout(mma, tl[tiler], side)

        first_stage, coords = _first_stage, _operand_coords

        # (writer layout, reader layout): the reader sees the tile transposed.
        pairs = [
            ((ms, "s", "A"), (mdq, "dq", "B"), (128, d)),  # K / K^T
            ((ms, "s", "B"), (mdk, "dk", "B"), (128, d)),  # Q / Q^T
            ((mdp, "dp", "B"), (mdv, "dv", "B"), (128, d)),  # dO / dO^T
            ((mdk, "dk", "A"), (mdq, "dq", "A"), (128, 128)),  # dS^T / dS
        ]
        for (m1, t1, s1), (m2, t2, s2), shape in pairs:
            l1, l2 = operand(m1, t1, s1), operand(m2, t2, s2)
            assert str(l1.inner) == str(l2.inner)
            o1, o2 = first_stage(l1), first_stage(l2)
            c1 = coords(m1, s1, shape)
            c2 = coords(m2, s2, (shape[1], shape[0]))
            where = {}
            for i in cutlass.range_constexpr(cute.size(o1)):
                where[c1[i]] = o1(i)
            for i in cutlass.range_constexpr(0, cute.size(o2), step):
                r, c = c2[i]
                assert where[(c, r)] == o2(i)
        # The compute warps' (key, query) views against the MMA's own A partition.
        for mma, tiler in ((mdv, "dv"), (mdk, "dk")):
            o = first_stage(operand(mma, tiler, "A"))
            rc = _rows_cols(cute.make_tensor(cute.make_ptr(dt, 0, cute.AddressSpace.smem), o),
                            128, 128)
            c = coords(mma, "A", (128, 128))
            for i in cutlass.range_constexpr(0, cute.size(o), step):
                assert cute.crd2idx(cute.idx2crd(i, o.shape), o) == \
                    cute.crd2idx(c[i], rc.layout)

    check(head_dim)


@needs_cutlass
@pytest.mark.parametrize("head_dim,dv,causal", [(128, 128, True), (64, 64, False),
                                               (192, 128, True)])
def test_bwd_deterministic_compiles_with_ordered_dq_adds(tmp_path, head_dim, dv, causal):
    """FlashBwdSm100Deterministic (compiled, not run on hardware): the reduce
    warps' leader spins on its query block's semaphore with acquire loads, issues
    the TMA reduce-adds only after that, waits for them to land, then releases the
    next key block with a GPU-scope release increment; the plain class refuses
    the knob without the semaphores. (192, 128) stages dQ as hdim 128 does."""
    import re

    from kernel_compile import assert_semaphore_order, dump_options, dumped_sass

    from jax_fa4.kernels.sm100_bwd import FlashBwdSm100, FlashBwdSm100Deterministic

    text = lower_bwd(FlashBwdSm100Deterministic, "sm_100a", jnp.bfloat16, head_dim, causal,
                     compile_options=dump_options(tmp_path / "dump"), head_dim_v=dv)
    assert re.search(r"tensor<2x4x1xi32>", text), "no (B, Hq, num_m) int32 semaphores"
    with pytest.raises(Exception, match="semaphores"):
        lower_bwd(lambda *a: FlashBwdSm100(*a, deterministic=True), "sm_100a", jnp.bfloat16,
                  head_dim, causal, head_dim_v=dv)
    lines = [ln.strip() for ln in dumped_sass(tmp_path / "dump").splitlines()]
    assert_semaphore_order(lines, r"UTMAREDG")
    spills = sum(ln.count("LDL") + ln.count("STL") for ln in lines)
    assert spills <= 16, f"{spills} local-memory instructions in the SASS"


@needs_cutlass
@pytest.mark.parametrize("head_dim,causal,masked", [(192, True, False), (256, True, False),
                                                    (256, False, True)])
def test_bwd_deterministic_orders_register_adds(tmp_path, head_dim, causal, masked):
    """The deterministic backward at 192 and 256 (compiled, not run on hardware),
    whose reduce warps add dQ from registers (red.global.add): an acquire spin on the
    query block's semaphore before the first add, then after the item's adds a
    GPU-scope fence and the release increment; as many adds as the default build.
    At 256 each head-dim half has its own semaphores: (B, Hq, 2 ceil(Sq / 64))."""
    import re

    from kernel_compile import count, dump_options, dumped_sass, lower_masked

    from jax_fa4.kernels.sm100_bwd import FlashBwdSm100, FlashBwdSm100Deterministic

    def build(det, folder):
        opts = dump_options(tmp_path / folder)
        if masked:
            text = lower_masked("sm_100a", "bwd", jnp.bfloat16, head_dim, segments=True,
                                deterministic=det, compile_options=opts)
        else:
            text = lower_bwd(FlashBwdSm100Deterministic if det else FlashBwdSm100,
                             "sm_100a", jnp.bfloat16, head_dim, causal, compile_options=opts)
        return text, dumped_sass(tmp_path / folder)

    text, sass = build(True, "det")
    sems = -(-113 // 64) * 2 if head_dim == 256 else 1
    assert f"tensor<2x4x{sems}xi32>" in text
    lines = [ln.strip() for ln in sass.splitlines()]

    def first(pattern, after=0):
        hit = next((i for i, ln in enumerate(lines) if i >= after and re.search(pattern, ln)),
                   None)
        assert hit is not None, f"no {pattern!r} after line {after} of the SASS"
        return hit

    add = r"REDG\.E\.ADD\.F32"
    release = first(r"(REDG|ATOMG)\.E\.ADD\.STRONG\.GPU",
                    first(r"MEMBAR\.(ALL\.)?GPU", first(add, first(r"LDG\.E\.STRONG\.GPU"))))
    assert release > first(add)
    assert count(add, sass) == count(add, build(False, "default")[1]) > 0


@needs_cutlass
@pytest.mark.parametrize("dv,masked", [(128, False), (128, True), (192, False), (192, True)])
def test_bwd_head_dim_192(tmp_path, dv, masked):
    """Head dim 192 and DeepSeek's (192, 128) (Note [Wide sm100 backward]): dV and dK
    in the first tensor-memory columns, S^T, dP^T and dQ over the rest (dQ in two
    passes, 128 + 64 columns, at 192); P^T and dS^T in one SMEM tile (the build is
    refused past the SMEM limit); per item the MMAs of S^T and dP^T (K-steps of 16
    over 192 / dv), dV, dK and dQ (8 each, twice for dQ at 192); at 192 dQ leaves by
    vector red.global.add from registers (no staging tile, no TMA reduce); plain
    (causal) and masked (intervals and walks). Local memory: hdim 128's 7
    instructions at (192, 128), at most 29 at 192 (the reduce warps' loop values)."""
    import cutlass
    import jax
    from kernel_compile import bwd_structs, dump_options, lower

    from jax_fa4.kernels.sm100_bwd import FlashBwdSm100

    shape = (2, 113, 203, 4, 1)
    ins, outs, aliases = bwd_structs(*shape, 192, jnp.bfloat16, dv)
    if masked:  # the keys' query intervals, then the key blocks' walks
        ins = ins + (jax.ShapeDtypeStruct((2, 203, 2), jnp.int32),
                     jax.ShapeDtypeStruct((2, 2, 5), jnp.int32))

    def make():
        return FlashBwdSm100(cutlass.BFloat16, 192, dv, not masked, 0.1, masked=masked)

    with pinned_arch("sm_100a"):
        kernel = make()
    assert kernel.tiles.wide and (kernel.tile_m, kernel.tile_n) == (128, 128)
    assert (kernel.tmem_dv, kernel.tmem_dk, kernel.tmem_s, kernel.tmem_dp,
            kernel.tmem_dq) == (0, dv, dv + 192, dv + 192, dv + 192)
    assert kernel.dq_passes == (((0, 192),) if dv == 128 else ((0, 128), (128, 64)))
    assert kernel.tiles.dq_direct == (dv == 192)
    assert "custom_call" in lower(make, "sm_100a", ins, outs, aliases,
                                  dump_options(tmp_path))
    sass_files = glob.glob(str(tmp_path / "*.sass"))
    if not sass_files:
        pytest.skip("no SASS was dumped (disassembler unavailable to the DSL)")
    with open(sass_files[0]) as f:
        sass = f.read()
    lines = sass.splitlines()
    mmas = sum(line.count("UTCHMMA") for line in lines)
    assert mmas == 12 + dv // 16 + 8 + 8 + 8 * len(kernel.dq_passes)
    reds = sum("REDG.E.ADD.F32x4" in line for line in lines)
    tma_reduces = sum("UTMAREDG" in line for line in lines)
    if dv == 192:
        assert (reds, tma_reduces) == (192 // 4, 0)  # one vector red per 4 columns
    else:
        assert reds == 0 and tma_reduces > 0
    spills = sum(line.count("LDL") + line.count("STL") for line in lines)
    assert spills <= (7 if dv == 128 else 29), f"{spills} local-memory instructions"


@needs_cutlass
def test_dq_pass_views_alias_k():
    """At 192 each dQ pass reads K^T's rows [c0, c0 + width) through a layout of its
    own width at c0 * tile_n elements from K (``_dq_pass_views``): every element of
    the pass view is where the whole tile's K^T layout puts it, and the swizzle is
    the same."""
    with pinned_arch("sm_100a"):
        _check_dq_pass_views()


def _check_dq_pass_views() -> None:
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils

    from jax_fa4.kernels.sm100_bwd import FlashBwdSm100

    @cute.jit
    def check():
        kernel = FlashBwdSm100(cutlass.BFloat16, 192, 192, True, 0.1)
        (_, _, _, _, mdq), tl = kernel._tiled_mmas()
        dt, tn = cutlass.BFloat16, kernel.tile_n
        full = sm100_utils.make_smem_layout_b(mdq, tl["dq"], dt, 1)
        o_full = cute.slice_(full.outer, (None, None, None, 0))
        c_full = mdq.get_slice(0).partition_B(cute.make_identity_tensor((192, tn)))
        where = {}
        for i in cutlass.range_constexpr(cute.size(o_full)):
            where[c_full[i]] = o_full(i)
        for c0, w in kernel.dq_passes:
            mma = kernel._dq_mma(w)
            lw = sm100_utils.make_smem_layout_b(mma, (kernel.tile_m, w, tn), dt, 1)
            assert str(lw.inner) == str(full.inner)
            o = cute.slice_(lw.outer, (None, None, None, 0))
            c = mma.get_slice(0).partition_B(cute.make_identity_tensor((w, tn)))
            for i in cutlass.range_constexpr(cute.size(o)):
                r, k = c[i]
                assert where[(r + c0, k)] == o(i) + c0 * tn

    cute.compile(check)


@needs_cutlass
@pytest.mark.parametrize("masked", [False, True])
def test_bwd_head_dim_256(tmp_path, masked):
    """Head dim 256 (Note [Head-dim halves]): two CTAs per key block, 64-query blocks;
    tensor memory S^T, dP^T, the dV and dK halves, then dQ^T (448 of 512 columns);
    per item the MMAs of S^T and dP^T over all 256 columns (16 K-steps each), the dV
    and dK halves (4 each, over 64 queries) and dQ^T (8, over 128 keys); dQ leaves
    by scalar red.global.add from registers, one per query and thread (no staging
    tile, no TMA reduce); plain (causal) and masked (intervals and walks); no local
    memory."""
    import cutlass
    import jax
    from kernel_compile import bwd_structs, dump_options, dumped_sass, lower

    from jax_fa4.kernels.sm100_bwd import FlashBwdSm100

    shape = (2, 113, 203, 4, 1)
    ins, outs, aliases = bwd_structs(*shape, 256, jnp.bfloat16, 256)
    if masked:  # the keys' query intervals, then the key blocks' walks
        ins = ins + (jax.ShapeDtypeStruct((2, 203, 2), jnp.int32),
                     jax.ShapeDtypeStruct((2, 2, 5), jnp.int32))

    def make():
        return FlashBwdSm100(cutlass.BFloat16, 256, 256, not masked, 0.1, masked=masked)

    with pinned_arch("sm_100a"):
        kernel = make()
    assert (kernel.split, kernel.dq_t, kernel.tile_m, kernel.tile_n) == (2, True, 64, 128)
    assert (kernel.tmem_s, kernel.tmem_dp, kernel.tmem_dv, kernel.tmem_dk,
            kernel.tmem_dq) == (0, 64, 128, 256, 384)
    assert not kernel.dq_aliases_dp and kernel.tiles.dq_direct
    assert "custom_call" in lower(make, "sm_100a", ins, outs, aliases,
                                  dump_options(tmp_path))
    lines = dumped_sass(tmp_path).splitlines()
    assert sum(line.count("UTCHMMA") for line in lines) == 16 + 16 + 4 + 4 + 8
    reds = sum("REDG.E.ADD.F32" in line and "F32x" not in line for line in lines)
    assert reds == 64  # 2 chunks of 32 queries
    assert not any("UTMAREDG" in line for line in lines)
    spills = sum(line.count("LDL") + line.count("STL") for line in lines)
    assert spills == 0, f"{spills} local-memory instructions"


@needs_cutlass
def test_head_dim_halves_alias_the_tiles():
    """With head-dim halves each CTA's MMAs read Q^T, dO^T and K^T of its own 128
    columns through layouts of that width at part * 128 x rows elements from the
    whole tile (``_as_view``'s offset), and dQ^T reads dS from the dS^T tile: every
    element of each view is where the writer's layout (TMA's or the compute warps')
    puts it, for both halves, with the same swizzle."""
    with pinned_arch("sm_100a"):
        _check_half_views()


def _check_half_views() -> None:
    import cutlass
    import cutlass.cute as cute

    from jax_fa4.kernels.sm100_bwd import FlashBwdSm100, _rows_cols

    step = 29

    @cute.jit
    def check():
        kernel = FlashBwdSm100(cutlass.BFloat16, 256, 256, True, 0.1)
        (ms, mdp, mdv, mdk, mdq), tl = kernel._tiled_mmas()
        dt, tm, tn, dp = cutlass.BFloat16, kernel.tile_m, kernel.tile_n, kernel.d_part

        def layout(mma, tiler, side):
            return _operand_layout(mma, tl[tiler], side)

        coords = _operand_coords

        # (writer, its (rows, cols), reader, its (rows, cols), rows of the writer per
        # reader column block): reader element (r, c) of half h is the writer's
        # (c, h * dp + r); dS has one "half", the whole tile.
        views = [
            ((ms, "s", "A"), (tn, 256), (mdq, "dq", "A"), (dp, tn), tn),  # K / K^T half
            ((ms, "s", "B"), (tm, 256), (mdk, "dk", "B"), (dp, tm), tm),  # Q / Q^T half
            ((mdp, "dp", "B"), (tm, 256), (mdv, "dv", "B"), (dp, tm), tm),  # dO / dO^T
            ((mdk, "dk", "A"), (tn, tm), (mdq, "dq", "B"), (tm, tn), 0),  # dS^T / dS
        ]
        for (m1, t1, s1), shape1, (m2, t2, s2), shape2, rows in views:
            l1, l2 = layout(m1, t1, s1), layout(m2, t2, s2)
            assert str(l1.inner) == str(l2.inner)
            o1, o2 = _first_stage(l1), _first_stage(l2)
            c1, c2 = coords(m1, s1, shape1), coords(m2, s2, shape2)
            where = {}
            for i in cutlass.range_constexpr(cute.size(o1)):
                where[c1[i]] = o1(i)
            for h in cutlass.range_constexpr(2 if rows else 1):
                for i in cutlass.range_constexpr(h, cute.size(o2), step):
                    r, c = c2[i]
                    assert where[(c, h * dp + r)] == o2(i) + h * dp * rows
        # The compute warps' (key, query) views of P^T and dS^T.
        for mma, tiler in ((mdv, "dv"), (mdk, "dk")):
            o = _first_stage(layout(mma, tiler, "A"))
            rc = _rows_cols(cute.make_tensor(cute.make_ptr(dt, 0, cute.AddressSpace.smem), o),
                            tn, tm)
            c = coords(mma, "A", (tn, tm))
            for i in cutlass.range_constexpr(0, cute.size(o), step):
                assert cute.crd2idx(cute.idx2crd(i, o.shape), o) == \
                    cute.crd2idx(c[i], rc.layout)

    cute.compile(check)
