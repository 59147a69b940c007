"""CPU compile checks for the sm90 backward main kernel (kernels/sm90_bwd.py).

Lowers FlashBwdSm90 through cutlass.jax.cutlass_call for sm_90a (cute.compile runs
on the CPU, no GPU needed) with dynamic B, S, H (divisibility 1) and checks that the
HLO holds the custom call. For every configuration of the tile table it also reads
the SASS: wgmma (HGMMA) present and not serialised, no local-memory spills,
setmaxnreg kept, dK/dV stored by TMA; and where ptxas is on PATH, that ptxas
reports no wgmma advisory (C75xx) and no spills.
"""

import glob
import importlib.util
import re
import shutil
import subprocess

import jax.numpy as jnp
import pytest
from kernel_compile import (
    assert_semaphore_order,
    bwd_structs,
    dump_options,
    dumped_sass,
    exp2s_between_waits,
    lower,
    lower_bwd,
)

needs_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed"
)


def _knob_sass(dump, head_dim: int, causal: bool, **knobs) -> str:
    """The SASS of FlashBwdSm90 with the table's tiles for (head_dim, causal) but
    ``knobs`` replaced (bf16, GQA, lengths no tile multiples), checked for what
    every configuration must keep: no local-memory spill, no serialised wgmma."""
    import dataclasses

    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90, bwd_tiles, without_masked_wg_conflicts

    # The table's masked-warpgroup skip (hdim 128 causal) gives way to knobs that
    # rule it out.
    tiles = without_masked_wg_conflicts(dataclasses.replace(bwd_tiles(head_dim, causal),
                                                            **knobs))
    ins, outs, aliases = bwd_structs(2, 113, 203, 4, 1, head_dim, jnp.bfloat16)
    lower(lambda: FlashBwdSm90(cutlass.BFloat16, head_dim, head_dim, causal, head_dim**-0.5,
                               tiles=tiles),
          "sm_90a", ins, outs, aliases, compile_options=dump_options(dump))
    sass = dumped_sass(dump)
    assert not re.findall(r"\b(LDL|STL)\b", sass), "local-memory spill"
    assert len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", sass)) <= 4
    return sass


def _knob_counts(tmp_path, count, head_dim: int, causal: bool, knob: str) -> dict:
    """count(SASS) of the table's kernel (``_knob_sass``) with BwdTiles.<knob> off and
    on; both without the masked-warpgroup skip (hdim 128 causal), whose peeled first
    item would otherwise be in one build and not the other where the knob rules it
    out (test_bwd_red_skip_compile.py checks the skip)."""
    plain = {"skip_masked_wg": False, "carry_coords": False}
    return {on: count(_knob_sass(tmp_path / f"{knob}_{on}", head_dim, causal,
                                 **{**plain, knob: on}))
            for on in (False, True)}


def _lower_bwd(dtype, head_dim: int, causal: bool, compile_options: str | None = None) -> str:
    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90

    return lower_bwd(
        FlashBwdSm90, "sm_90a", dtype, head_dim, causal, compile_options=compile_options
    )


@needs_cutlass
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bwd_compiles(head_dim, causal):
    text = _lower_bwd(jnp.bfloat16, head_dim, causal)
    assert "custom_call" in text


@needs_cutlass
@pytest.mark.parametrize("head_dim,tile_m,dq_per_wg,stages,flat",
                         [(128, 80, False, 2, False), (128, 80, True, 2, False),
                          (128, 64, False, 2, True), (128, 64, True, 2, False),
                          (64, 128, False, 2, False), (64, 128, True, 2, False),
                          (128, 64, True, 3, True), (64, 64, True, 3, True)])
def test_bwd_tile_variants_compile(head_dim, tile_m, dq_per_wg, stages, flat):
    """The tuning table's alternatives: 80-row query tiles (dQ computed transposed),
    the per-warpgroup or joint dQ hand-off, the flat dQ order with bulk reduces or the
    row-major one with TMA tensor reduces, 3 Q/dO stages (226 of the 227 KiB of
    SMEM), causal (diagonal masking) on an odd GQA shape."""
    import dataclasses

    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90, bwd_tiles, without_masked_wg_conflicts

    # By-thread statistics need 64- or 128-row tiles; the masked-warpgroup skip the
    # flat dQ order.
    tiles = without_masked_wg_conflicts(dataclasses.replace(
        bwd_tiles(head_dim, True), tile_m=tile_m, dq_per_wg=dq_per_wg, stages_qdo=stages,
        dq_flat=flat, stats_by_thread=bwd_tiles(head_dim, True).stats_by_thread
        and tile_m in (64, 128)))
    ins, outs, aliases = bwd_structs(2, 113, 203, 4, 1, head_dim, jnp.bfloat16)
    text = lower(lambda: FlashBwdSm90(cutlass.BFloat16, head_dim, head_dim, True,
                                      head_dim**-0.5, tiles=tiles),
                 "sm_90a", ins, outs, aliases)
    assert "custom_call" in text


@needs_cutlass
def test_bwd_refuses_more_smem_than_a_cta_has():
    """hdim 64 with 128-row query tiles and 3 Q/dO stages needs 233 KB > 227 KiB."""
    import dataclasses

    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90, bwd_tiles

    tiles = dataclasses.replace(bwd_tiles(64, False), stages_qdo=3)
    ins, outs, aliases = bwd_structs(2, 113, 203, 4, 1, 64, jnp.bfloat16)
    with pytest.raises(Exception, match="bytes of SMEM"):
        lower(lambda: FlashBwdSm90(cutlass.BFloat16, 64, 64, False, 0.125, tiles=tiles),
              "sm_90a", ins, outs, aliases)


@needs_cutlass
def test_bwd_rejects_80_row_tiles_below_hdim_128():
    import dataclasses

    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90, bwd_tiles

    with pytest.raises(ValueError, match="head_dim 128"):
        FlashBwdSm90(cutlass.BFloat16, 64, 64, False, 0.1,
                     tiles=dataclasses.replace(bwd_tiles(64, False), tile_m=80))


@needs_cutlass
def test_bwd_80_row_tiles_store_ds_keys_contiguous(tmp_path):
    """80-row query tiles (flash-attn-4's non-causal hdim 128 choice) compute dQ^T =
    K^T dS^T. dS goes to SMEM transposed (st.matrix .trans) with the keys
    contiguous, so its 256-byte rows take the 128-byte swizzle (80 queries
    contiguous got 32 bytes and measured 10% slower), and the dQ^T partial keeps
    the flat order: 10 conflict-free 128-bit stores per thread, one bulk reduce per
    warpgroup, no spills. (Causal keeps 64-row tiles, as flash-attn-4 does; its
    80-row variant spills one register.)"""
    import dataclasses

    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90, bwd_tiles

    tiles = dataclasses.replace(bwd_tiles(128, False), tile_m=80, dq_flat=True,
                                stats_by_thread=False)
    ins, outs, aliases = bwd_structs(2, 113, 203, 4, 1, 128, jnp.bfloat16)
    lower(lambda: FlashBwdSm90(cutlass.BFloat16, 128, 128, False, 128**-0.5, tiles=tiles),
          "sm_90a", ins, outs, aliases, compile_options=dump_options(tmp_path))
    sass = dumped_sass(tmp_path)
    assert len(re.findall(r"\bSTSM\.16\.MT88\.4\b", sass)) == 5, "dS^T not stored transposed"
    assert len(re.findall(r"\bSTS\.128\b", sass)) == 10
    assert len(re.findall(r"\bUBLKRED\.G\.S\.ADD\.F32", sass)) == 2
    assert not re.findall(r"\b(LDL|STL)\b", sass), "local-memory spill"
    assert len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", sass)) <= 4, "serialised wgmma"


@needs_cutlass
def test_bwd_compiles_fp16():
    assert "custom_call" in _lower_bwd(jnp.float16, 128, True)


@needs_cutlass
def test_bwd_rejects_unsupported_head_dim():
    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90

    with pytest.raises(ValueError):
        FlashBwdSm90(cutlass.BFloat16, 96, 96, False, 0.1)


@needs_cutlass
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bwd_sass(tmp_path, head_dim, causal):
    _lower_bwd(jnp.bfloat16, head_dim, causal, compile_options=dump_options(tmp_path))
    sass = dumped_sass(tmp_path)
    assert "HGMMA" in sass, "wgmma missing: the GEMMs fell back to a slower path"
    assert "USETMAXREG" in sass, "setmaxnreg was dropped"
    spills = sum(line.count("LDL") + line.count("STL") for line in sass.splitlines())
    # A handful of spilled scalars outside the GEMMs is tolerated; arrays in
    # local memory are not.
    assert spills <= 16, f"{spills} local-memory instructions in the SASS"
    # dK and dV leave by TMA store from SMEM, not by per-thread global stores (which
    # cost about a tenth of the MMA warps' time, docs/performance.md).
    assert sass.count("UTMASTG") >= 2, "the dK/dV epilogue lost its TMA stores"
    plain_stores = [ln for ln in sass.splitlines() if " STG." in ln or "\tSTG." in ln]
    assert not plain_stores, f"plain global stores in the main kernel: {plain_stores[:3]}"
    # Serialised wgmmas (ptxas C7512, "insufficient register resources") carry a
    # completion wait on every HGMMA; healthy code waits once per GEMM (5 per
    # block) and at the end of a block. hdim 64 with dV issued before dS^T was
    # serialised and ran 21% slower on the H200.
    hgmma = len(re.findall(r"\bHGMMA\.", sass))
    waits_all = len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", sass))
    assert waits_all <= 4, f"{waits_all} full wgmma waits for {hgmma} HGMMAs: serialised"
    # The table's dQ hand-off: each thread stores its 32 dQ floats as 8 conflict-free
    # 128-bit stores in register order, and the dQ warp adds each warpgroup's part
    # with one 1-D bulk reduce (Note [Flat dQ accumulator]). 64-bit stores into a
    # swizzled row-major tile took twice the SMEM wavefronts (docs/performance.md).
    from jax_fa4.kernels.sm90_bwd import bwd_tiles

    tiles = bwd_tiles(head_dim, causal)
    assert tiles.dq_flat
    stores = tiles.tile_m * head_dim // 256 // 4  # 4 floats per 128-bit store
    # The masked warpgroup's peeled first item (hdim 128 causal) has its own copy.
    stores *= 2 if tiles.skip_masked_wg else 1
    assert len(re.findall(r"\bSTS\.128\b", sass)) == stores, "the dQ partial lost its STS.128"
    assert not re.findall(r"\bSTS\.64\b", sass), "64-bit SMEM stores are back"
    assert len(re.findall(r"\bUBLKRED\.G\.S\.ADD\.F32", sass)) == 2, "one bulk reduce per part"
    assert "UTMAREDG" not in sass, "the dQ partial went back to a TMA tensor reduce"

    if shutil.which("ptxas") is None:
        pytest.skip("ptxas not on PATH")
    ptx = sorted(glob.glob(str(tmp_path / "*.ptx")))
    assert ptx, "no PTX was dumped"
    proc = subprocess.run(["ptxas", "-v", "-arch=sm_90a", ptx[0], "-o", ptx[0] + ".cubin"],
                          capture_output=True, text=True, check=False)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    assert "(C75" not in report, report


@needs_cutlass
@pytest.mark.parametrize("head_dim,causal", [(128, True), (64, False)])
def test_bwd_deterministic_compiles_with_ordered_dq_adds(tmp_path, head_dim, causal):
    """FlashBwdSm90Deterministic (behind attention(deterministic=True)): the dQ warp
    spins on its query block's semaphore with acquire loads, adds the partials with
    bulk reduces only after that, waits for them to land (not only to read SMEM),
    then releases the next key block with a GPU-scope release increment."""
    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90, FlashBwdSm90Deterministic

    dump = tmp_path / "dump"
    text = lower_bwd(FlashBwdSm90Deterministic, "sm_90a", jnp.bfloat16, head_dim, causal,
                     compile_options=dump_options(dump))
    assert "custom_call" in text
    assert re.search(r"tensor<2x4x\d+xi32>", text), "no (B, Hq, num_m) int32 semaphores"
    with pytest.raises(Exception, match="semaphores"):  # the plain class refuses the knob
        lower_bwd(lambda *a: FlashBwdSm90(*a, deterministic=True), "sm_90a", jnp.bfloat16,
                  head_dim, causal)
    lines = [ln.strip() for ln in dumped_sass(dump).splitlines()]
    sass = "\n".join(lines)
    assert "LDL" not in sass and "STL" not in sass, "local memory spill"

    assert_semaphore_order(lines, r"UBLKRED\.G\.S\.ADD\.F32")
    assert sass.count("UBLKRED") == 2  # one per warpgroup part, as without the knob


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (113, 203), (1000, 1000), (4096, 4096), (777, 1500),
                                   (2000, 129)])
@pytest.mark.parametrize("tile_m", [64, 128])
def test_deterministic_order_is_a_deadlock_free_permutation(causal, sq, sk, tile_m):
    """The deterministic backward's order (det_key_block, det_add_rank, the
    functions the kernel calls): for every query block the key blocks reaching it
    take ranks 0..count-1 exactly once, so every spin ends and every partial is
    added once; a CTA waits (rank > 0) only on the key block one rank earlier,
    which launches earlier (lower blockIdx.x); and, causal, that block reached the
    query block in fewer steps of its own walk, so it is not behind."""
    from jax_fa4.kernels.dq_layout import det_add_rank, det_key_block

    tile_n = 128
    num_n, num_m = -(-sk // tile_n), -(-sq // tile_m)
    launch = {det_key_block(x, num_n, causal): x for x in range(num_n)}
    assert sorted(launch) == list(range(num_n))
    for m in range(num_m):
        # Key blocks with a key that some query of block m sees (top-left causal).
        reach = [n for n in range(num_n)
                 if not causal or n * tile_n <= (m + 1) * tile_m - 1]
        ranks = {det_add_rank(m, n, num_n, tile_m, tile_n, causal): n for n in reach}
        assert sorted(ranks) == list(range(len(reach))), (m, ranks)
        for r in range(1, len(reach)):
            n, prev = ranks[r], ranks[r - 1]
            assert launch[prev] < launch[n]
            if causal:  # steps into its walk (which starts at n * tile_n // tile_m)
                assert m - prev * tile_n // tile_m <= m - n * tile_n // tile_m


@needs_cutlass
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bwd_dv_done_before_dk_knob(tmp_path, head_dim):
    """BwdTiles.dv_done_before_dk (flash-attn-4's order; in the table at hdim 64
    causal, where it measured 2.7% faster): one more partial wgmma wait per block,
    between the dQ GEMM and dK's register-A GEMM, and still no spills or
    serialised wgmmas."""
    from jax_fa4.kernels.sm90_bwd import bwd_tiles

    assert [bwd_tiles(d, c).dv_done_before_dk for d in (64, 128) for c in (False, True)] == [
        False, True, False, False]
    counts = _knob_counts(
        tmp_path, lambda sass: len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass)),
        head_dim, False, "dv_done_before_dk")
    assert counts[True] == counts[False] + 1, counts


@needs_cutlass
def test_bwd_pin_dp_wait_knob(tmp_path):
    """BwdTiles.pin_dp_wait (off in the table: level to 0.965x on the H200, ninth
    session): at hdim 128 all 32 exp2s of P^T sit between the wait for S^T and the
    wait for dP^T, which ptxas otherwise hoists to right after the S^T wait (at
    most one exp2 before it); no spills, no serialised wgmma."""
    from jax_fa4.kernels.sm90_bwd import bwd_tiles

    assert not any(bwd_tiles(d, c).pin_dp_wait for d in (64, 128) for c in (False, True))
    between = _knob_counts(tmp_path, lambda sass: max(exp2s_between_waits(sass)), 128, False,
                           "pin_dp_wait")
    assert between[True] == 32 and between[False] <= 1, between


@needs_cutlass
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bwd_split_kv_knob(tmp_path, head_dim):
    """BwdTiles.split_kv: K and V on two mbarriers (V issued after the first Q / dO
    item). The MMA warpgroups then wait for V in the walk, between the S^T and the
    dP^T GEMMs (one more mbarrier wait, no spills, no serialised wgmma), and the
    K/V pipeline gets two stages."""
    def waits_and_split(sass: str):
        # The walk: the first S^T GEMM's 8 / 4 HGMMAs, then the dP^T GEMM's; with the
        # knob an mbarrier wait sits between them.
        hgmma_then_wait = re.search(r"HGMMA[^\n]*\n(?:(?!HGMMA)[^\n]*\n)*?[^\n]*"
                                    r"SYNCS\.PHASECHK[^\n]*\n(?:(?!HGMMA)[^\n]*\n)*?"
                                    r"[^\n]*HGMMA", sass)
        return (len(re.findall(r"SYNCS\.PHASECHK\.TRANS64\.TRYWAIT", sass)),
                hgmma_then_wait is not None)

    waits = _knob_counts(tmp_path, waits_and_split, head_dim, True, "split_kv")
    assert waits[True][0] > waits[False][0], waits
    assert waits[True][1] and not waits[False][1], waits


@needs_cutlass
@pytest.mark.parametrize("head_dim,causal", [(128, True), (128, False), (64, True)])
def test_bwd_persistent_knob(tmp_path, head_dim, causal):
    """BwdTiles.persistent (off in the table: level non-causal, 0.75x causal at 1k on
    the H200, ninth session): one CTA per SM walks the tiles with its pipeline
    states carried along; the walk's GEMMs are traced once (same HGMMA count as the
    grid kernel), no spills, no serialised wgmma. It refuses the deterministic mode,
    split_kv and the row-major dQ."""
    import dataclasses

    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90, FlashBwdSm90Deterministic, bwd_tiles

    assert not any(bwd_tiles(d, c).persistent for d in (64, 128) for c in (False, True))
    hgmma = _knob_counts(tmp_path, lambda sass: len(re.findall(r"\bHGMMA\.", sass)),
                         head_dim, causal, "persistent")
    assert hgmma[True] == hgmma[False], hgmma
    pers = dataclasses.replace(bwd_tiles(128, True), persistent=True)
    for bad, cls in ((pers, FlashBwdSm90Deterministic),
                     (dataclasses.replace(pers, split_kv=True), FlashBwdSm90),
                     (dataclasses.replace(pers, dq_flat=False), FlashBwdSm90)):
        with pytest.raises(ValueError, match="persistent"):
            cls(cutlass.BFloat16, 128, 128, True, tiles=bad)


@pytest.mark.parametrize("num_n,kv_heads,batch", [(8, 4, 3), (1, 1, 1), (5, 16, 2)])
def test_bwd_persistent_tile_coord_covers_every_tile(num_n, kv_heads, batch):
    """Without LPT the persistent walk's tile t is (t % num_n, head, batch) with key
    blocks fastest, then heads: every (key block, kv head, batch) exactly once, in
    the per-head grid's launch order."""
    pytest.importorskip("cutlass")
    import types

    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90

    kern = FlashBwdSm90(cutlass.BFloat16, 128, 128, False)
    assert not kern.lpt
    mK = types.SimpleNamespace(shape=(num_n * 128, 128, kv_heads, batch))
    order = [kern.tile_coord(t, num_n, None, mK) for t in range(num_n * kv_heads * batch)]
    assert order == [(n, h, b) for b in range(batch) for h in range(kv_heads)
                     for n in range(num_n)]


@pytest.mark.parametrize("num_n,kv_heads,batch,section", [(8, 4, 3, 8), (16, 16, 16, 32),
                                                          (5, 3, 1, 2), (1, 1, 1, 1)])
def test_bwd_lpt_key_block_order(num_n, kv_heads, batch, section):
    """BwdTiles.lpt launches every (key block, kv head, batch) once, and within an
    L2 section of heads key block 0 (the longest under the causal mask) of every
    head first, then key block 1, and so on."""
    from jax_fa4.kernels.sm90_bwd import lpt_key_block

    num_hb = kv_heads * batch
    order = [lpt_key_block(t, num_n, kv_heads, num_hb, section) for t in range(num_n * num_hb)]
    assert sorted(order) == [(n, h, b) for n in range(num_n) for h in range(kv_heads)
                             for b in range(batch)]
    per_section = {}
    for n, h, b in order:
        per_section.setdefault((b * kv_heads + h) // section, []).append(n)
    for blocks in per_section.values():
        assert blocks == sorted(blocks), blocks  # longest first within the section
        assert blocks[0] == 0


@pytest.mark.parametrize("num_n,kv_heads,batch,q_blocks", [
    (8, 4, 3, 16), (16, 16, 16, 16), (5, 3, 1, 2048), (1, 1, 1, 1), (17, 5, 7, 64),
    (16, 12, 3, 128)])
def test_bwd_lpt_host_divisors_give_the_same_order(num_n, kv_heads, batch, q_blocks):
    """BwdTiles.lpt_host_div: the divisors set up per launch (lpt_divisors) give each
    CTA the coordinates lpt_coord computes with run-time divisions, short last
    sections included (sections of 1 to 64 heads, from the L2 size)."""
    from jax_fa4.kernels.sm90_bwd import lpt_divisors, lpt_key_block, lpt_key_block_fast
    from jax_fa4.kernels.sm90_fwd import lpt_section_size

    q_block_bytes = 64 * (256 * 2 + 4 * 128 + 8)
    section = lpt_section_size(q_blocks, 1, q_block_bytes)
    divs = lpt_divisors(num_n, q_blocks, kv_heads, batch, q_block_bytes)
    num_hb = kv_heads * batch
    assert [lpt_key_block_fast(t, *divs) for t in range(num_n * num_hb)] == [
        lpt_key_block(t, num_n, kv_heads, num_hb, section) for t in range(num_n * num_hb)]


@needs_cutlass
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_dpsum_top_in_table_at_hdim128(tmp_path, causal):
    """BwdTiles.dpsum_top (the table's at hdim 128, +1-5% on the H200, tenth
    session): the walk loads Dpsum's 16 columns with LSElog2's right after the Q /
    dO wait, so 32 floats of shared-memory loads precede the first S^T wgmma
    instead of 16 (with the table's stats_by_thread as LDS.128, in row order as
    LDS.64); no spills or serialised wgmma (_knob_sass). At hdim 64 (32 columns) it
    is off."""
    from jax_fa4.kernels.sm90_bwd import bwd_tiles

    assert [bwd_tiles(d, c).dpsum_top for d in (64, 128) for c in (False, True)] == [
        False, False, True, True]

    def loads_before_first_gemm(sass: str) -> int:
        head = sass.split("HGMMA", 1)[0]
        after_wait = head.rsplit("SYNCS.PHASECHK.TRANS64.TRYWAIT", 1)[1]
        return (2 * len(re.findall(r"\bLDS\.64\b", after_wait))
                + 4 * len(re.findall(r"\bLDS\.128\b", after_wait)))

    counts = _knob_counts(tmp_path, loads_before_first_gemm, 128, causal, "dpsum_top")
    assert counts == {False: 16, True: 32}, counts


@needs_cutlass
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_elect_release_in_table(tmp_path, causal):
    """BwdTiles.elect_release (the table's at hdim 128 since the eleventh session and
    at hdim 64 since the twelfth; checked here at hdim 128): the MMA
    warpgroups release each Q / dO stage from an ELECT lane, so the walk (first to
    last wgmma) reads no thread index (S2R SR_TID), which ptxas re-reads there for
    the pipeline's own lane test; no spills or serialised wgmma (_knob_sass)."""
    from jax_fa4.kernels.sm90_bwd import bwd_tiles

    assert all(bwd_tiles(d, c).elect_release for d in (64, 128) for c in (False, True))

    def walk_counts(sass: str) -> tuple[int, int]:
        walk = sass[sass.index("HGMMA"):sass.rindex("HGMMA")]
        return (len(re.findall(r"\bS2R R\d+, SR_TID", walk)),
                len(re.findall(r"\bELECT\b", walk)))

    counts = _knob_counts(tmp_path, walk_counts, 128, causal, "elect_release")
    assert counts == {False: (1, 0), True: (0, 1)}, counts


@needs_cutlass
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bwd_stats_by_thread_knob(tmp_path, head_dim):
    """BwdTiles.stats_by_thread (the table's at hdim 128, twelfth session): with the
    row statistics in stat_position's order each thread loads its chunks with 128-bit
    LDS,
    half the loads of the row order's pairs: at hdim 128 (causal, table: both
    loaded before the first S^T wgmma) 4 + 4 LDS.128 instead of 8 + 8 LDS.64 there;
    at hdim 64 (32 columns, loaded in the step) 16 instead of 32 in the kernel.
    No spills or serialised wgmma (_knob_sass)."""
    from jax_fa4.kernels.sm90_bwd import bwd_tiles, stats_thread_block

    assert [stats_thread_block(d, c) for d in (64, 128) for c in (False, True)] == [
        None, None, 64, 64]
    assert bwd_tiles(head_dim, True).stats_by_thread == (head_dim == 128)

    def loads(sass: str) -> tuple[int, int]:
        if head_dim == 128:
            head = sass.split("HGMMA", 1)[0]
            sass = head.rsplit("SYNCS.PHASECHK.TRANS64.TRYWAIT", 1)[1]
        return (len(re.findall(r"\bLDS\.64\b", sass)), len(re.findall(r"\bLDS\.128\b", sass)))

    counts = _knob_counts(tmp_path, loads, head_dim, True, "stats_by_thread")
    expect = {128: {False: (16, 0), True: (0, 8)}, 64: {False: (32, 0), True: (0, 16)}}
    assert counts == expect[head_dim], counts


@needs_cutlass
def test_bwd_lpt_host_div_knob(tmp_path):
    """BwdTiles.lpt_host_div (off in the table: level on the H200, tenth session):
    the hdim 128 causal kernel (LPT order) then finds its coordinates
    with no run-time integer division before the CTA's first barrier: the
    reciprocals of run-time divisors (I2F.RP) there drop from 3 (kv heads, shared by
    the GQA group and the head / batch split; section tiles; heads of the section)
    to the one for the GQA group."""
    from jax_fa4.kernels.sm90_bwd import bwd_tiles

    assert not any(bwd_tiles(d, c).lpt_host_div for d in (64, 128) for c in (False, True))

    def divisions_before_first_barrier(sass: str) -> int:
        head = sass.split("BAR.SYNC.DEFER_BLOCKING 0x0", 1)[0]
        return len(re.findall(r"\bI2F\.RP\b", head))

    counts = _knob_counts(tmp_path, divisions_before_first_barrier, 128, True, "lpt_host_div")
    assert counts == {False: 3, True: 1}, counts


@needs_cutlass
def test_bwd_lpt_in_table_for_hdim128_causal_only():
    """The table launches in LPT order at hdim 128 causal (4k +4-6% on the H200,
    eighth session) and not at hdim 64, where it measured 4-6% slower; the
    deterministic backward keeps its own order."""
    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90, FlashBwdSm90Deterministic, bwd_tiles

    assert [bwd_tiles(d, c).lpt for d in (64, 128) for c in (False, True)] == [
        False, False, False, True]
    assert FlashBwdSm90(cutlass.BFloat16, 128, 128, True).lpt
    assert not FlashBwdSm90(cutlass.BFloat16, 128, 128, False).lpt
    assert not FlashBwdSm90Deterministic(cutlass.BFloat16, 128, 128, True).lpt



@needs_cutlass
@pytest.mark.parametrize("head_dim,tile_m", [(64, 128), (128, 64)])
def test_bwd_stats_shuffle_columns_match_the_wgmma_layout(head_dim, tile_m):
    """BwdTiles.stats_shuffle's column formula: ``stat_part_query(c, lane)`` is the
    query of column c of S^T in the kernel's own S^T tiled MMA (``acc_mn_view`` of
    its partition of an identity tensor) for all 256 MMA threads; and the part a
    lane loads (``stat_part_base`` + ``stat_part_offset(i)``) is the queries of its
    columns per * (lane // 4) + i, so the 8 lanes of one lane-in-quad position hold
    each of their columns exactly once."""
    import dataclasses

    import cutlass
    import cutlass.cute as cute

    from jax_fa4.ffi.bridge import pinned_arch
    from jax_fa4.kernels.sm90_bwd import (
        FlashBwdSm90,
        bwd_tiles,
        stat_part_base,
        stat_part_offset,
        stat_part_query,
    )
    from jax_fa4.kernels.softmax import acc_mn_view

    tiles = dataclasses.replace(bwd_tiles(head_dim, False), tile_m=tile_m,
                                stats_by_thread=False, stats_shuffle=True)
    kernel = FlashBwdSm90(cutlass.BFloat16, head_dim, head_dim, False, tiles=tiles)
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


@needs_cutlass
@pytest.mark.parametrize("head_dim,causal", [(64, False), (128, True)])
def test_bwd_stats_shuffle_knob(tmp_path, head_dim, causal):
    """BwdTiles.stats_shuffle (the table's at hdim 64 non-causal only): each lane
    loads an eighth of its columns' LSElog2 and Dpsum (LDS.64 pairs: 2 + 2 at hdim
    64, 1 + 1 at hdim 128) and shuffles each column's value from the lane that
    loaded it (one SHFL.IDX per column and statistic), where with it off it loads every
    column (row order at hdim 64: 16 + 16 LDS.64; by thread at hdim 128: 4 + 4
    LDS.128). No spills or serialised wgmma (_knob_sass). Refused with the by-thread
    order or 80-row tiles."""
    import dataclasses

    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90, bwd_tiles

    assert [bwd_tiles(d, c).stats_shuffle for d in (64, 128) for c in (False, True)] == [
        True, False, False, False]
    n_cols = bwd_tiles(head_dim, causal).tile_m // 4

    def counts(sass: str) -> tuple[int, int, int]:
        return (len(re.findall(r"\bSHFL\.IDX\b", sass)), len(re.findall(r"\bLDS\.64\b", sass)),
                len(re.findall(r"\bLDS\.128\b", sass)))

    off = counts(_knob_sass(tmp_path / "off", head_dim, causal, stats_shuffle=False))
    on = counts(_knob_sass(tmp_path / "on", head_dim, causal, stats_shuffle=True,
                           stats_by_thread=False))
    assert off[0] <= 1 and on[0] == off[0] + 2 * n_cols, (off, on)
    assert off[1:] == ((2 * n_cols // 2, 0) if head_dim == 64 else (0, 8)), off
    assert on[1:] == (2 * n_cols // 16, 0), on
    for over in ({"stats_by_thread": True}, {"tile_m": 80, "stats_by_thread": False}):
        tiles = dataclasses.replace(bwd_tiles(128, False), stats_shuffle=True, **over)
        with pytest.raises(ValueError, match="stats_shuffle"):
            FlashBwdSm90(cutlass.BFloat16, 128, 128, False, tiles=tiles)
