"""CPU compile checks for the sm90 backward main kernels (kernels/sm90_bwd.py at hdim
64 / 128, kernels/sm90_bwd_wide.py at hdim 256).

Every build the lowering ships (rules/plan.py: the tile table's kernel, the
deterministic one, the wide one, each causal or not) is lowered once per module
through cutlass.jax.cutlass_call for sm_90a, as the lowering builds it (with
programmatic dependent launch), on a GQA shape whose lengths are no tile multiples;
cute.compile runs on the CPU. The checks read its SASS (and ptxas's report on its
PTX): wgmma present and not serialised, no local memory, the PDL wait before any
global access, and what each table row chose. Layout formulas the kernels rely on
are checked against the DSL's own partitions while tracing.
"""

import importlib.util
import re
import shutil
import subprocess

import jax.numpy as jnp
import pytest
from kernel_compile import (
    assert_pdl_chained,
    assert_semaphore_order,
    bwd_structs,
    count,
    dump_options,
    dumped_sass,
    lower,
    lower_bwd,
)

needs_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed"
)

# The wide kernel's dK / dV epilogue unrolls a 64-iteration static loop.
pytestmark = pytest.mark.filterwarnings("ignore:This static loop")

TABLE = [(64, False), (64, True), (128, False), (128, True)]
WIDE = 256
# One query block's wgmma instructions per warpgroup, table kernel: S^T, dP^T, dV, dK
# and dQ (8 + 8 + 4 + 4 + 8 at hdim 128, 4 + 4 + 8 + 8 + 8 at hdim 64); wide: S and
# dP 16 each (m64n32, k = 256), dV^T and dK^T 8 each, dQ 4.
HGMMA_PER_BLOCK = 32
HGMMA_PER_BLOCK_WIDE = 16 + 16 + 8 + 8 + 4


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """build(kind, head_dim, causal, dtype=bf16) -> (HLO text, SASS, ptxas report) of a
    shipped sm90 backward main kernel ("table", "det", "wide", "wide_det", or "store":
    the table's with ``dq_store``), compiled once."""
    cache = {}

    def get(kind: str, head_dim: int, causal: bool, dtype=jnp.bfloat16):
        key = (kind, head_dim, causal, jnp.dtype(dtype).name)
        if key not in cache:
            from jax_fa4.kernels import sm90_bwd, sm90_bwd_wide

            cls = {"table": sm90_bwd.FlashBwdSm90, "det": sm90_bwd.FlashBwdSm90Deterministic,
                   "wide": sm90_bwd_wide.FlashBwdSm90Wide,
                   "wide_det": sm90_bwd_wide.FlashBwdSm90WideDeterministic,
                   "store": sm90_bwd.FlashBwdSm90}[kind]
            extra = {"dq_store": True} if kind == "store" else {}
            dump = tmp_path_factory.mktemp("-".join(map(str, key)))
            text = lower_bwd(cls, "sm_90a", dtype, head_dim, causal,
                             compile_options=dump_options(dump), use_pdl=True, **extra)
            cache[key] = (text, dumped_sass(dump), _ptxas_report(dump))
        return cache[key]

    return get


def _ptxas_report(dump) -> str | None:
    """ptxas -v on the dumped PTX (None without ptxas on PATH)."""
    if shutil.which("ptxas") is None:
        return None
    ptx = sorted(dump.glob("*.ptx"))
    assert ptx, "no PTX was dumped"
    proc = subprocess.run(["ptxas", "-v", "-arch=sm_90a", str(ptx[0]), "-o",
                           str(ptx[0]) + ".cubin"], capture_output=True, text=True, check=False)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    return report


def _assert_healthy(sass: str, report: str | None, hgmma: int) -> None:
    """wgmma throughout (``hgmma`` instructions: no fallback, no second copy of a
    GEMM), setmaxnreg kept, no local memory, and no serialised wgmma: ptxas serialises
    every wgmma (C7512 and kin, "insufficient register resources") by waiting for
    each one to complete, where a healthy walk waits for all of them at most 3 times
    (the last dK, the epilogue, a peeled item)."""
    assert count(r"\bHGMMA\.", sass) == hgmma
    assert "USETMAXREG" in sass, "setmaxnreg was dropped"
    assert not count(r"\b(LDL|STL)\b", sass), "local-memory spill"
    assert count(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", sass) <= 3, "serialised wgmma"
    if report is not None:
        assert "(C75" not in report, report
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        assert spills and all(s == ("0", "0") for s in spills), report


@needs_cutlass
@pytest.mark.parametrize("head_dim,causal", TABLE)
def test_table_kernel(build, head_dim, causal):
    """FlashBwdSm90 as the tile table builds it (bwd_tiles), as the SASS shows:

    - dK and dV leave by TMA store from SMEM, dQ partials by the flat hand-off (Note
      [Flat dQ accumulator]): conflict-free 128-bit SMEM stores in register order
      and one 1-D bulk reduce per warpgroup part, no TMA tensor reduce, no per-thread
      global stores;
    - the Q / dO stages are released from an ELECT lane: the walk reads no thread
      index;
    - BwdTiles.stats: "rows" loads each column's LSElog2 and Dpsum in pairs (LDS.64),
      "by_thread" four at a time (LDS.128), "shuffle" an eighth of them and one
      SHFL.IDX per column and statistic;
    - dv_done_before_dk: one more partial wgmma wait per query block;
    - skip_masked_wg: the peeled first item has its own dQ GEMM and hand-off;
    - lpt: a 1-D grid (the kernel reads no blockIdx.y / z)."""
    from jax_fa4.kernels.sm90_bwd import bwd_tiles

    text, sass, report = build("table", head_dim, causal)
    t = bwd_tiles(head_dim, causal)
    assert "custom_call" in text
    peeled = 8 if t.skip_masked_wg else 0  # the dQ GEMM of Note [Masked warpgroup]
    _assert_healthy(sass, report, HGMMA_PER_BLOCK + peeled)
    assert_pdl_chained(sass)

    assert count("UTMASTG", sass) == 2 * (head_dim // 64), "dK / dV: one TMA box per 64 columns"
    assert not count(r"\bSTG\.", sass), "per-thread global stores in the main kernel"
    stores = t.tile_m * head_dim // 256 // 4 * (2 if t.skip_masked_wg else 1)
    assert count(r"\bSTS\.128\b", sass) == stores, "the dQ partial lost its 128-bit stores"
    assert not count(r"\bSTS\.64\b", sass)
    assert count(r"\bUBLKRED\.G\.S\.ADD\.F32", sass) == 2, "one bulk reduce per part"
    assert "UTMAREDG" not in sass

    walk = sass[sass.index("HGMMA"):sass.rindex("HGMMA")]
    assert count(r"\bELECT\b", walk) == 1 and not count(r"\bS2R R\d+, SR_TID", walk)

    n_cols = t.tile_m // 4  # a thread's S^T columns
    loads = (count(r"\bLDS\.64\b", sass), count(r"\bLDS\.128\b", sass),
             count(r"\bSHFL\.IDX\b", walk))
    assert loads == {"rows": (n_cols, 0, 0), "by_thread": (0, n_cols // 2, 0),
                     "shuffle": (n_cols // 8, 0, 2 * n_cols)}[t.stats], loads

    partial_waits = count(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass)
    assert partial_waits == 2 + t.dv_done_before_dk

    grid_yz = count(r"SR_CTAID\.[YZ]", sass)
    assert (grid_yz == 0) == t.lpt, grid_yz


@needs_cutlass
@pytest.mark.parametrize("head_dim,causal", [(64, False), (128, True)])
def test_stored_dq_kernel(build, head_dim, causal):
    """``dq_store`` (Note [One key block per query block]): the table kernel with dQ's
    tile rounded into SMEM by stmatrix and stored by TMA (as many boxes as dK's), no
    bulk reduce, no flat hand-off; the rest as the table kernel (the same GEMMs, no
    per-thread global stores)."""
    from jax_fa4.kernels.sm90_bwd import bwd_tiles

    _, sass, report = build("store", head_dim, causal)
    _, table, _ = build("table", head_dim, causal)
    peeled = 8 if bwd_tiles(head_dim, causal).skip_masked_wg else 0
    _assert_healthy(sass, report, HGMMA_PER_BLOCK + peeled)
    assert_pdl_chained(sass)
    assert "UBLKRED" not in sass and count(r"\bUBLKRED\.G\.S\.ADD\.F32", table) == 2
    dk_boxes = count("UTMASTG", table) // 2
    assert count("UTMASTG", sass) == count("UTMASTG", table) + dk_boxes
    assert count("STSM", sass) > count("STSM", table)
    assert not count(r"\bSTS\.128\b", sass) and not count(r"\bSTG\.", sass)


@needs_cutlass
@pytest.mark.parametrize("head_dim,causal", TABLE)
def test_deterministic_kernel(build, head_dim, causal):
    """FlashBwdSm90Deterministic (attention(deterministic=True)) takes the (B, Hq,
    num_m) int32 semaphores, and its dQ warp spins on its query block's semaphore
    with acquire loads, adds the partials with bulk reduces only after that, waits
    for them to land (not only to read SMEM), then releases the next key block with
    a GPU-scope release increment."""
    from jax_fa4.kernels.sm90_bwd import bwd_tiles

    text, sass, report = build("det", head_dim, causal)
    assert re.search(r"tensor<2x4x\d+xi32>", text), "no (B, Hq, num_m) int32 semaphores"
    peeled = 8 if bwd_tiles(head_dim, causal).skip_masked_wg else 0
    _assert_healthy(sass, report, HGMMA_PER_BLOCK + peeled)
    assert_pdl_chained(sass)
    assert_semaphore_order([ln.strip() for ln in sass.splitlines()], r"UBLKRED\.G\.S\.ADD\.F32")
    assert count("UBLKRED", sass) == 2


@needs_cutlass
@pytest.mark.parametrize("causal", [False, True])
def test_wide_kernel(build, causal):
    """FlashBwdSm90Wide (hdim 256): all five GEMMs of a query block on wgmma, the dQ
    partial by the flat hand-off (Note [Wide dQ hand-off]), dK / dV by predicated
    per-thread stores (Note [Wide shared memory] leaves no SMEM to stage them)."""
    text, sass, report = build("wide", WIDE, causal)
    assert "custom_call" in text
    _assert_healthy(sass, report, HGMMA_PER_BLOCK_WIDE)
    assert_pdl_chained(sass)
    _assert_flat_dq(sass, 64 * WIDE)


@needs_cutlass
@pytest.mark.parametrize("causal", [False, True])
def test_wide_deterministic_kernel(build, causal):
    """FlashBwdSm90WideDeterministic (hdim 256, deterministic=True): the wide kernel's
    GEMMs and flat dQ hand-off, with the deterministic kernel's semaphores and order
    of dQ adds (acquire spin, both parts' bulk reduces, wait until they land, GPU-scope
    release)."""
    text, sass, report = build("wide_det", WIDE, causal)
    assert re.search(r"tensor<2x4x\d+xi32>", text), "no (B, Hq, num_m) int32 semaphores"
    _assert_healthy(sass, report, HGMMA_PER_BLOCK_WIDE)
    assert_pdl_chained(sass)
    _assert_flat_dq(sass, 64 * WIDE)
    assert_semaphore_order([ln.strip() for ln in sass.splitlines()], r"UBLKRED\.G\.S\.ADD\.F32")
    # The default wide kernel neither waits nor releases.
    assert not count(r"LDG\.E\.STRONG\.GPU", build("wide", WIDE, causal)[1])


def _assert_flat_dq(sass: str, tile_floats: int):
    """Note [Wide dQ hand-off]: the dQ partial leaves the registers by 128-bit SMEM
    stores only (4 floats per thread each) and SMEM by one 1-D bulk reduce per
    warpgroup part, no TMA tensor reduce."""
    assert count(r"\bSTS\.128\b", sass) == tile_floats // 256 // 4
    assert not count(r"\bSTS(\.64)?\s", sass)
    assert count(r"\bUBLKRED\.G\.S\.ADD\.F32", sass) == 2, "one bulk reduce per part"
    assert "UTMAREDG" not in sass


@needs_cutlass
@pytest.mark.parametrize("dv,masked", [(192, False), (128, False), (128, True)])
def test_wide_kernel_at_192(tmp_path, dv, masked):
    """FlashBwdSm90Wide at 192 and (192, 128): 96-key blocks, dK^T / dV^T split
    between the warpgroups along the keys (Note [Wide dK and dV]): per query block S
    and dP (m64n48, k = 192 / dv), dV^T and dK^T (three or two m64 atoms of n48, k =
    64) and dQ (m64n96, k = 96), as the SASS shows, with no local memory and the
    shared memory Note [Wide shared memory] counts (refused at compile time past the
    limit)."""
    import cutlass
    import jax

    from jax_fa4.kernels.sm90_bwd_wide import FlashBwdSm90Wide

    shape = (2, 113, 203, 4, 1)
    ins, outs, aliases = bwd_structs(*shape, 192, jnp.bfloat16, dv)
    if masked:  # the keys' query intervals after mdQaccum
        ins = ins + (jax.ShapeDtypeStruct((shape[0], shape[2], 2), jnp.int32),)

    def make():
        return FlashBwdSm90Wide(cutlass.BFloat16, 192, dv, not masked, 0.1, use_pdl=True,
                                masked=masked)

    text = lower(make, "sm_90a", ins, outs, aliases, dump_options(tmp_path))
    assert "custom_call" in text
    sass = dumped_sass(tmp_path)
    _assert_healthy(sass, _ptxas_report(tmp_path), 12 + dv // 16 + dv // 16 + 12 + 6)
    _assert_flat_dq(sass, 64 * 192)
    kernel = make()
    # Two Q stages; two of dO at (192, 128), one of its own at 192 (Note [Split Q and dO
    # stages]).
    assert (kernel.tile_n, kernel.stages_qdo, kernel.stages_do, kernel.p_buffers) == (
        96, 2, 2 if dv == 128 else 1, 1)
    assert kernel.split_qdo == (dv == 192)
    # dQ before dK^T, its hand-off under dK^T (Note [Wide GEMM order]).
    assert kernel.dq_first


@needs_cutlass
@pytest.mark.parametrize("kind,head_dim,causal", [("table", 128, True), ("wide", WIDE, False),
                                                   ("store", 64, False)])
def test_fp16_builds(build, kind, head_dim, causal):
    text, sass, report = build(kind, head_dim, causal, jnp.float16)
    assert "custom_call" in text
    _assert_healthy(sass, report, HGMMA_PER_BLOCK_WIDE if kind == "wide" else
                    HGMMA_PER_BLOCK + (8 if causal else 0))


@needs_cutlass
def test_the_sm90_plan_chains_its_kernels():
    """rules/plan.py builds the sm_90a backward's three kernels with PDL (this file
    and test_kernels_bwd_prepost_compile.py read its SASS), the sm_100a ones without."""
    from jax_fa4.rules.plan import bwd_plan

    for arch, pdl in (("sm_90a", True), ("sm_100a", False)):
        for det in (False, True):
            plan = bwd_plan(arch, "bfloat16", 128, 128, True, 0.1, det, True)
            kernels = [plan.build_pre(), plan.build_post()]
            if arch == "sm_90a":
                kernels.append(plan.build_main())
            assert [k.use_pdl for k in kernels] == [pdl] * len(kernels), (arch, det)


@needs_cutlass
def test_refuses_what_it_has_no_build_for():
    import cutlass

    from jax_fa4.kernels.sm90_bwd import BwdTiles, FlashBwdSm90
    from jax_fa4.kernels.sm90_bwd_wide import FlashBwdSm90Wide

    for cls, d, dv in ((FlashBwdSm90, 160, 160), (FlashBwdSm90, 128, 64),
                       (FlashBwdSm90Wide, 128, 128), (FlashBwdSm90Wide, 256, 128)):
        with pytest.raises(ValueError, match="head dims"):
            cls(cutlass.BFloat16, d, dv)
    with pytest.raises(TypeError):
        FlashBwdSm90Wide(cutlass.Float32, 256)
    for bad in ({"tile_m": 80}, {"tile_m": 128, "stats": "by_thread"}, {"stats": "cols"}):
        with pytest.raises(ValueError):
            BwdTiles(**{"tile_m": 64, **bad})
    wide = FlashBwdSm90Wide(cutlass.Float16, 256)
    assert wide.head_dim_v == 256 and not wide.causal and wide.softmax_scale == 1 / 16


def test_tile_table_and_the_layouts_it_asks_for():
    """Every (head dim, mask) has a row; the pre- and postprocess layouts the lowering
    asks for (stats_thread_block, dq_accum_flat_tile_m) follow it."""
    pytest.importorskip("cutlass")
    from jax_fa4.kernels.sm90_bwd import bwd_tiles, dq_accum_flat_tile_m, stats_thread_block

    for d, causal in TABLE:
        t = bwd_tiles(d, causal)
        assert t.tile_m == {64: 128, 128: 64}[d]
        assert dq_accum_flat_tile_m(d, causal) == t.tile_m
        assert stats_thread_block(d, causal) == (t.tile_m if t.stats == "by_thread" else None)
        assert t.skip_masked_wg == t.carry_coords == (d == 128 and causal)
        assert not t.lpt or causal
    with pytest.raises(ValueError):
        bwd_tiles(256, False)


@pytest.mark.parametrize("num_n,kv_heads,batch,section", [(8, 4, 3, 8), (16, 16, 16, 32),
                                                          (5, 3, 1, 2), (1, 1, 1, 1)])
def test_lpt_order_covers_every_key_block_longest_first(num_n, kv_heads, batch, section):
    """BwdTiles.lpt launches every (key block, kv head, batch) once, and within an
    L2 section of heads key block 0 (the longest under the causal mask) of every
    head first, then key block 1, and so on."""
    pytest.importorskip("cutlass")
    from jax_fa4.kernels.sm90_bwd import lpt_key_block

    num_hb = kv_heads * batch
    order = [lpt_key_block(t, num_n, kv_heads, num_hb, section) for t in range(num_n * num_hb)]
    assert sorted(order) == [(n, h, b) for n in range(num_n) for h in range(kv_heads)
                             for b in range(batch)]
    per_section = {}
    for n, h, b in order:
        per_section.setdefault((b * kv_heads + h) // section, []).append(n)
    for blocks in per_section.values():
        assert blocks == sorted(blocks), blocks
        assert blocks[0] == 0


@needs_cutlass
def test_stats_shuffle_columns_match_the_wgmma_layout():
    """Statistics by shuffle (hdim 64 non-causal, 128-row tiles): ``stat_part_query(c,
    lane)`` is the query of column c of S^T in the kernel's own S^T tiled MMA for all
    256 MMA threads, and the part a lane loads (``stat_part_base`` +
    ``stat_part_offset(i)``) is the queries of its columns per * (lane // 4) + i, so
    the 8 lanes of one lane-in-quad position hold each of their columns once."""
    import cutlass
    import cutlass.cute as cute

    from jax_fa4.ffi.bridge import pinned_arch
    from jax_fa4.kernels.sm90_bwd import (
        FlashBwdSm90,
        stat_part_base,
        stat_part_offset,
        stat_part_query,
    )
    from jax_fa4.kernels.softmax import acc_mn_view

    kernel = FlashBwdSm90(cutlass.BFloat16, 64, 64, False)
    assert kernel.tiles.stats == "shuffle"
    tile_m = kernel.tile_m
    found = {}

    @cute.jit
    def walk():
        mma_sdp = kernel._tiled_mmas()[0]
        ident = cute.make_identity_tensor((kernel.tile_n, tile_m))
        for t in cutlass.range_constexpr(256):
            tScS = acc_mn_view(mma_sdp.get_slice(t).partition_C(ident))
            for c in cutlass.range_constexpr(cute.size(tScS, mode=[1])):
                found[(t, c)] = tScS[0, c][1]

    with pinned_arch("sm_90a"):
        walk()
    n_cols = tile_m // 4
    assert len(found) == 256 * n_cols
    for (t, c), query in found.items():
        assert int(query) == stat_part_query(c, t % 32), (t, c, query)
    per = n_cols // 8
    for lane in range(32):
        assert [stat_part_base(lane, n_cols) + stat_part_offset(i) for i in range(per)] == [
            stat_part_query(per * (lane // 4) + i, lane) for i in range(per)]
    for q in range(4):
        held = sorted(stat_part_base(lane, n_cols) + stat_part_offset(i)
                      for lane in range(q, 32, 4) for i in range(per))
        assert held == sorted(stat_part_query(c, q) for c in range(n_cols)), q
