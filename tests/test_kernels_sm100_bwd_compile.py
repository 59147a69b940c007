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
@pytest.mark.parametrize("head_dim", [64, 128])
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
@pytest.mark.parametrize("head_dim", [128])  # hdim 64's tiles are the same construction
def test_operand_views_alias(head_dim):
    """Every SMEM tile is written once and read by two MMAs through two layouts
    (K-major and MN-major, or the compute warps' (key, query) view): check on a
    sample of elements that both layouts put each logical element at the same
    offset, so the second reader sees what the writer stored."""
    with pinned_arch("sm_100a"):
        _check_operand_views(head_dim)


def _check_operand_views(head_dim: int) -> None:
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils

    from jax_fa4.kernels.sm100_bwd import FlashBwdSm100, _rows_cols

    step = 37  # a prime stride through the tile keeps the check to a few seconds

    @cute.jit
    def check(d: cutlass.Constexpr[int]):
        kernel = FlashBwdSm100(cutlass.BFloat16, d, d, True, 0.1)
        (ms, mdp, mdv, mdk, mdq), tl = kernel._tiled_mmas()
        dt = cutlass.BFloat16

        def first_stage(layout):
            return cute.slice_(layout.outer, (None, None, None, 0))

        def operand(mma, tiler, side):
            make = sm100_utils.make_smem_layout_a if side == "A" else \
                sm100_utils.make_smem_layout_b
            return make(mma, tl[tiler], dt, 1)

        def coords(mma, side, shape):
            thr = mma.get_slice(0)
            part = thr.partition_A if side == "A" else thr.partition_B
            return part(cute.make_identity_tensor(shape))

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
@pytest.mark.parametrize("head_dim,causal", [(128, True), (64, False)])
def test_bwd_deterministic_compiles_with_ordered_dq_adds(tmp_path, head_dim, causal):
    """FlashBwdSm100Deterministic (compiled, not run on hardware): the reduce
    warps' leader spins on its query block's semaphore with acquire loads, issues
    the TMA reduce-adds only after that, waits for them to land, then releases the
    next key block with a GPU-scope release increment; the plain class refuses
    the knob without the semaphores."""
    import re

    from kernel_compile import assert_semaphore_order, dump_options, dumped_sass

    from jax_fa4.kernels.sm100_bwd import FlashBwdSm100, FlashBwdSm100Deterministic

    text = lower_bwd(FlashBwdSm100Deterministic, "sm_100a", jnp.bfloat16, head_dim, causal,
                     compile_options=dump_options(tmp_path / "dump"))
    assert re.search(r"tensor<2x4x1xi32>", text), "no (B, Hq, num_m) int32 semaphores"
    with pytest.raises(Exception, match="semaphores"):
        lower_bwd(lambda *a: FlashBwdSm100(*a, deterministic=True), "sm_100a", jnp.bfloat16,
                  head_dim, causal)
    lines = [ln.strip() for ln in dumped_sass(tmp_path / "dump").splitlines()]
    assert_semaphore_order(lines, r"UTMAREDG")
    spills = sum(ln.count("LDL") + ln.count("STL") for ln in lines)
    assert spills <= 16, f"{spills} local-memory instructions in the SASS"


@needs_cutlass
@pytest.mark.parametrize("masked", [False, True])
def test_bwd_mla_head_dims(tmp_path, masked):
    """DeepSeek's (192, 128) (Note [Wide sm100 backward]): dV and dK in the first
    320 tensor-memory columns, S^T, dP^T and dQ over the rest; P^T and dS^T in one
    SMEM tile (the build is refused past the SMEM limit); per item the MMAs of S^T
    (12 K-steps of 16), dP^T (8), dV (8), dK (8) and dQ (8); local memory as hdim
    128's build; plain (causal) and masked (intervals and walks)."""
    import cutlass
    import jax
    from kernel_compile import bwd_structs, dump_options, lower

    from jax_fa4.kernels.sm100_bwd import FlashBwdSm100

    shape = (2, 113, 203, 4, 1)
    ins, outs, aliases = bwd_structs(*shape, 192, jnp.bfloat16, 128)
    if masked:  # the keys' query intervals, then the key blocks' walks
        ins = ins + (jax.ShapeDtypeStruct((2, 203, 2), jnp.int32),
                     jax.ShapeDtypeStruct((2, 2, 5), jnp.int32))

    def make():
        return FlashBwdSm100(cutlass.BFloat16, 192, 128, not masked, 0.1, masked=masked)

    with pinned_arch("sm_100a"):
        kernel = make()
    assert kernel.tiles.wide and (kernel.tile_m, kernel.tile_n) == (128, 128)
    assert (kernel.tmem_dv, kernel.tmem_dk, kernel.tmem_s, kernel.tmem_dp,
            kernel.tmem_dq) == (0, 128, 320, 320, 320)
    assert "custom_call" in lower(make, "sm_100a", ins, outs, aliases,
                                  dump_options(tmp_path))
    sass_files = glob.glob(str(tmp_path / "*.sass"))
    if not sass_files:
        pytest.skip("no SASS was dumped (disassembler unavailable to the DSL)")
    with open(sass_files[0]) as f:
        sass = f.read()
    mmas = sum(line.count("UTCHMMA") for line in sass.splitlines())
    assert mmas == 12 + 8 + 8 + 8 + 8
    spills = sum(line.count("LDL") + line.count("STL") for line in sass.splitlines())
    assert spills <= 7, f"{spills} local-memory instructions in the SASS"
