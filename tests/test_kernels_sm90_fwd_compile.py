"""CPU-only compile checks of the sm90 forward kernel (no GPU needed).

Lowers the kernel for sm_90a through cutlass.jax.cutlass_call, as the FFI layer
does, with dynamic batch / sequence / head extents (divisibility 1), and checks
that the custom call is in the HLO. A few configurations (hdim 128 and 256) are
also disassembled to check that they use wgmma (HGMMA), do not spill, honour
setmaxnreg, and that ptxas does not serialise or fence the wgmmas (no C75xx).
"""

from __future__ import annotations

import glob
import re
import shutil
import subprocess

import pytest

cutlass = pytest.importorskip("cutlass")
cutlass_jax = pytest.importorskip("cutlass.jax")
jax = pytest.importorskip("jax")
jnp = jax.numpy

from kernel_compile import (  # noqa: E402
    dump_options,
    dumped_sass,
    exp2s_between_waits,
    fwd_structs,
    lower,
    lower_fwd_sm90,
)

from jax_fa4.kernels.sm90_fwd import FlashFwdSm90, fwd_tiles  # noqa: E402


def _lower(dtype, d: int, causal: bool, shape=(2, 113, 203, 8, 2), compile_options=None):
    """Lower the forward for (B, Sq, Sk, Hq, Hkv) for sm_90a; returns the HLO text."""
    return lower_fwd_sm90(dtype, d, causal, shape, compile_options=compile_options)


@pytest.mark.parametrize(
    "dtype,d,causal",
    [
        (jnp.bfloat16, 128, False),
        (jnp.bfloat16, 128, True),
        (jnp.float16, 64, False),
        (jnp.bfloat16, 64, True),
        (jnp.float16, 128, True),
        (jnp.bfloat16, 256, False),
        (jnp.bfloat16, 256, True),
        (jnp.float16, 256, False),
        (jnp.float16, 256, True),
    ],
)
def test_fwd_lowers_to_custom_call(dtype, d, causal):
    text = _lower(dtype, d, causal)
    assert "custom_call" in text


@pytest.mark.parametrize("d", [128, 256])
def test_fwd_odd_shapes_lower(d):
    # seqlen 1 and a long odd length: same binary, dynamic extents.
    for shape in [(1, 1, 1, 1, 1), (2, 4097, 4097, 4, 1)]:
        assert "custom_call" in _lower(jnp.bfloat16, d, True, shape)


@pytest.mark.parametrize("d,causal", [(128, False), (256, False), (256, True)])
def test_fwd_sass_uses_wgmma(tmp_path, d, causal):
    # The DSL writes SASS only when it finds nvdisasm (pip nvidia-cuda-nvdisasm).
    dump = tmp_path / "dump"
    _lower(jnp.bfloat16, d, causal, compile_options=dump_options(dump))
    sass = dumped_sass(dump)
    # S = Q K^T is 64 x tile_n per warpgroup, O += P V is 64 x d.
    tile_n = fwd_tiles(d, d, causal).tile_n
    assert f"HGMMA.64x{tile_n}x16.F32.BF16" in sass
    assert f"HGMMA.64x{d}x16.F32.BF16" in sass
    assert "LDL" not in sass and "STL" not in sass, "local memory spill"
    assert "USETMAXREG" in sass
    ptx_files = glob.glob(str(dump / "*.ptx"))
    if ptx_files and shutil.which("ptxas"):
        res = subprocess.run(
            ["ptxas", "-arch=sm_90a", "-v", ptx_files[0], "-o", str(tmp_path / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
        assert "C7508" not in res.stderr, "setmaxnreg ignored"
        assert "0 bytes spill stores" in res.stderr
        # C7510 / C7519 ...: ptxas serialised the wgmmas or injected
        # warpgroup.arrive between them (e.g. P repacked between P V wgmmas).
        advisories = [line for line in res.stderr.splitlines() if "(C75" in line]
        assert not advisories, advisories[:2]


def test_fwd_tiles_head_dims():
    assert fwd_tiles(256, 256, False).tile_n == 80
    assert fwd_tiles(128, 128, True).tile_n == 128
    for d, dv in [(192, 192), (256, 128), (160, 160)]:
        with pytest.raises(ValueError):
            fwd_tiles(d, dv, False)


@pytest.mark.parametrize("d", [64, 128])
def test_fwd_persistent_knob_compiles(tmp_path, d):
    """Persistent CTAs (Sm90FwdTiles.persistent, in the table for hdim 64 / 128): O has its own
    SMEM buffer, and the thread that stores O waits for the previous tile's store
    to have read it before the consumers write it again, not right after the store."""
    import dataclasses

    # One CTA per cluster: with K/V multicast (the table's at 128) every thread
    # also meets the cluster barrier before EXIT (test_fwd_kv_multicast_knob).
    tiles = dataclasses.replace(fwd_tiles(d, d, False), persistent=True, cluster_m=1)
    ins, outs = fwd_structs(2, 113, 203, 8, 2, d, jnp.bfloat16)
    dump = tmp_path / "dump"
    text = lower(lambda: FlashFwdSm90(jnp.bfloat16, d, d, False, tiles=tiles), "sm_90a", ins,
                 outs, compile_options=dump_options(dump))
    assert "custom_call" in text
    sass = dumped_sass(dump)
    lines = sass.splitlines()
    assert "LDL" not in sass and "STL" not in sass, "local memory spill"
    store = max(i for i, ln in enumerate(lines) if "UTMASTG" in ln)
    epi_bar = [i for i, ln in enumerate(lines) if "BAR.SYNC.DEFER_BLOCKING 0x1," in ln]
    waits = [i for i, ln in enumerate(lines) if "DEPBAR.LE SB0, 0x0" in ln]
    assert epi_bar and waits
    # A read-wait before the first epilogue barrier, none between a store and the
    # next instruction block of the loop (only the one before EXIT after the loop).
    assert any(w < epi_bar[0] for w in waits), "no wait for the previous O store"
    exits = [i for i, ln in enumerate(lines) if "EXIT" in ln and i > store]
    assert all(w > exits[0] for w in waits if w > store), "O store waited at once"


def test_fwd_persistent_knob_refusals():
    """The causal persistent kernel is FlashFwdSm90Dynamic (it takes the tile
    counter): the plain class refuses to trace it, the dynamic class refuses
    non-causal tiles; hdim 256 has no SMEM for a separate O buffer."""
    import dataclasses

    from jax_fa4.kernels.sm90_fwd import FlashFwdSm90Dynamic, make_fwd_sm90

    causal_pers = dataclasses.replace(fwd_tiles(128, 128, True), persistent=True)
    assert isinstance(make_fwd_sm90(jnp.bfloat16, 128, 128, True, tiles=causal_pers),
                      FlashFwdSm90Dynamic)
    assert not isinstance(make_fwd_sm90(jnp.bfloat16, 128, 128, False), FlashFwdSm90Dynamic)
    ins, outs = fwd_structs(2, 113, 203, 8, 2, 128, jnp.bfloat16)
    with pytest.raises(Exception, match="tile counter"):
        lower(lambda: FlashFwdSm90(jnp.bfloat16, 128, 128, True, tiles=causal_pers), "sm_90a",
              ins, outs)
    with pytest.raises(ValueError, match="causal persistent"):
        FlashFwdSm90Dynamic(jnp.bfloat16, 128, 128, False,
                            tiles=dataclasses.replace(causal_pers, lpt=False))
    tiles = dataclasses.replace(fwd_tiles(256, 256, False), persistent=True)
    ins, outs = fwd_structs(2, 113, 203, 8, 2, 256, jnp.bfloat16)
    with pytest.raises(Exception, match="bytes of SMEM"):
        lower(lambda: FlashFwdSm90(jnp.bfloat16, 256, 256, False, tiles=tiles), "sm_90a", ins,
              outs)


@pytest.mark.parametrize("d,lpt", [(128, False), (64, True)])
def test_fwd_dynamic_scheduler_compiles(tmp_path, d, lpt):
    """The causal persistent forward (FlashFwdSm90Dynamic): q, k, v, then the int32
    tile counter aliased to a third output. The load warp claims tiles with one
    global atomic add per tile (ATOMG.E.ADD) and hands them to the consumers
    through SMEM; no spills, no wgmma serialisation."""
    import dataclasses

    tiles = dataclasses.replace(fwd_tiles(d, d, True), persistent=True, lpt=lpt)
    dump = tmp_path / "dump"
    text = lower_fwd_sm90(jnp.bfloat16, d, True, tiles=tiles,
                          compile_options=dump_options(dump))
    assert "custom_call" in text
    sass = dumped_sass(dump)
    assert sass.count("ATOMG.E.ADD") == 1, "one claim site in the load warp"
    assert "LDL" not in sass and "STL" not in sass, "local memory spill"
    assert f"HGMMA.64x{d}x16.F32.BF16" in sass
    ptx_files = glob.glob(str(dump / "*.ptx"))
    if ptx_files and shutil.which("ptxas"):
        res = subprocess.run(["ptxas", "-arch=sm_90a", "-v", ptx_files[0], "-o",
                              str(tmp_path / "k.cubin")], capture_output=True, text=True,
                             check=True)
        assert "0 bytes spill stores" in res.stderr
        assert not [ln for ln in res.stderr.splitlines() if "(C75" in ln]


@pytest.mark.parametrize("num_m,heads,batch,section", [
    (1, 1, 1, 1), (32, 16, 4, 16), (32, 16, 4, 64), (7, 5, 3, 4), (5, 3, 1, 2), (9, 1, 6, 1)])
def test_lpt_tile_order(num_m, heads, batch, section):
    """lpt_tile is a bijection onto (m_block, head, batch); within each section of
    heads the query blocks run longest (last) first, every head of the section
    per block, and sections go in head order."""
    from jax_fa4.kernels.sm90_fwd import lpt_tile

    num_hb = heads * batch
    order = [lpt_tile(t, num_m, heads, num_hb, section) for t in range(num_m * num_hb)]
    assert sorted(order) == sorted((m, h, b) for m in range(num_m) for h in range(heads)
                                   for b in range(batch))
    hb = [b * heads + h for _, h, b in order]
    for start in range(0, num_hb, section):
        size = min(section, num_hb - start)
        chunk = order[start * num_m:(start + size) * num_m]
        longest_first = [num_m - 1 - j for j in range(num_m) for _ in range(size)]
        assert [m for m, _, _ in chunk] == longest_first
        assert hb[start * num_m:(start + size) * num_m] == list(range(start, start + size)) * num_m


@pytest.mark.parametrize("total,grid,n_blocks,parts", [
    (2048, 132, 128, 3),  # hdim 128 at every benchmark row: 68 tiles left, a 2/3 tail
    (2048, 132, 32, 3),
    (2048, 132, 8, 1),  # 1k tokens: parts of 4 blocks would need S = 2, which saves nothing
    (2752, 132, 64, 1),  # hdim 64 at 8k: 112 tiles left, no S shortens the tail
    (1056, 132, 32, 1),  # no partial round
    (16, 16, 128, 1),  # fewer tiles than SMs: one round
    (160, 132, 8, 2), (216, 132, 12, 3), (154, 132, 16, 4), (1088, 132, 32, 4),
])
def test_split_tail_plan(total, grid, n_blocks, parts):
    """split_tail_parts picks the S (2-4) whose tail, ceil(S R / G) / S tiles, is
    shortest, with parts of at least _SPLIT_MIN_BLOCKS key blocks; and the unit
    order covers every key block of every tile exactly once, each part a
    contiguous range, the parts of a tail tile on different CTAs of one round."""
    from jax_fa4.kernels.sm90_fwd import split_tail_parts, split_tail_units, split_unit

    got = split_tail_parts(total, grid, n_blocks)
    assert got == parts
    full, units = split_tail_units(total, grid, got)
    assert full % grid == 0 or got == 1
    cover = {}
    for u in range(units):
        tile, lo, hi, is_part, v = split_unit(u, full, got, n_blocks)
        assert is_part == (u >= full) and 0 <= lo < hi <= n_blocks
        if is_part:
            assert v == u - full and tile == full + v // got
        else:
            assert (tile, lo, hi) == (u, 0, n_blocks)
        cover.setdefault(tile, []).extend(range(lo, hi))
    assert sorted(cover) == list(range(total))
    assert all(sorted(b) == list(range(n_blocks)) for b in cover.values())
    # The tail's length in tiles on the busiest CTA: ceil(S R / G) / S.
    per_cta = [0.0] * grid
    for u in range(units):
        per_cta[u % grid] += 1.0 if u < full else 1.0 / got
    if got == 1:  # the plain round robin
        assert (full, units, max(per_cta)) == (total, total, -(-total // grid))
    else:  # whole rounds, then a tail shorter than one tile
        tail = -(-(total - full) * got // grid) / got
        assert max(per_cta) == pytest.approx(full // grid + tail) and tail < 1.0


def _knob_sass(tmp_path, name: str, d: int, causal: bool, **knobs) -> tuple:
    """(dump folder, SASS) of the bf16 forward with Sm90FwdTiles knobs over the
    table's entry for (d, causal); asserts that it does not spill."""
    import dataclasses

    tiles = dataclasses.replace(fwd_tiles(d, d, causal), **knobs)
    dump = tmp_path / name
    lower_fwd_sm90(jnp.bfloat16, d, causal, tiles=tiles, compile_options=dump_options(dump))
    sass = dumped_sass(dump)
    assert "LDL" not in sass and "STL" not in sass, "local memory spill"
    return dump, sass


@pytest.mark.parametrize("d", [64, 128])
def test_fwd_split_tail_knob(tmp_path, d):
    """Sm90FwdTiles.split_tail (Note [Split tail]) compiles for the persistent
    non-causal forward: one GPU-scope atomic add (a part counting in), GPU-scope
    fences around it, no spill, and the wgmmas as asynchronous as the table's
    (as many full waits, ``DEPBAR.LE gsb0, 0x0``); the table's kernel has no
    atomic. A causal or non-persistent kernel refuses the knob."""
    import dataclasses

    from jax_fa4.kernels.sm90_fwd import FlashFwdSm90Split, make_fwd_sm90

    got = {}
    for on in (False, True):
        # K/V multicast (the table's at 128) does not serve the split tail.
        _, sass = _knob_sass(tmp_path, f"split_{on}", d, False, split_tail=on, cluster_m=1)
        got[on] = (sass.count("ATOMG.E.ADD.STRONG.GPU"), "MEMBAR.ALL.GPU" in sass,
                   sass.count("DEPBAR.LE gsb0, 0x0"))
    assert got[False][:2] == (0, False) and got[True][:2] == (1, True), got
    assert got[True][2] == got[False][2], got
    assert isinstance(make_fwd_sm90(jnp.bfloat16, d, d, False, tiles=dataclasses.replace(
        fwd_tiles(d, d, False), split_tail=True, cluster_m=1)), FlashFwdSm90Split)
    for causal, over in ((True, {}), (False, {"persistent": False})):
        tiles = dataclasses.replace(fwd_tiles(d, d, causal), split_tail=True, **over)
        with pytest.raises(ValueError, match="split_tail"):
            make_fwd_sm90(jnp.bfloat16, d, d, causal, tiles=tiles)


def test_fwd_lpt_section_sizes():
    """Heads per L2 section (K and V of a section fit in 50 MiB): hdim 128 at 4k
    tokens is 2 MiB per head -> 16; a GQA group of 4 shares it -> 64 (the cap);
    16k tokens (8 MiB) -> 4;
    hdim 256 at 8k (8 MiB) -> 4; past 400 KV blocks of 128 (51200 tokens) one head
    per section."""
    from jax_fa4.kernels.sm90_fwd import lpt_section_size

    def section(seqlen_k, d, group):
        tile_n = fwd_tiles(d, d, True).tile_n
        return lpt_section_size(-(-seqlen_k // tile_n), group, tile_n * 2 * d * 2)

    assert section(4096, 128, 1) == 16
    assert section(4096, 128, 4) == 64
    assert section(1024, 128, 1) == 64
    assert section(16384, 128, 1) == 4
    assert section(8192, 256, 1) == 4
    assert section(8192, 64, 1) == 16
    assert section(60000, 128, 1) == 1


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fwd_lpt_knob_compiles(tmp_path, d):
    """The causal LPT order (Sm90FwdTiles.lpt) lowers for every head dim; it changes
    only the CTA's coordinates, so the kernel keeps its wgmma shapes and no spills."""
    import dataclasses

    tiles = dataclasses.replace(fwd_tiles(d, d, True), lpt=True, persistent=False)
    ins, outs = fwd_structs(2, 113, 203, 8, 2, d, jnp.bfloat16)
    dump = tmp_path / "dump"
    text = lower(lambda: FlashFwdSm90(jnp.bfloat16, d, d, True, tiles=tiles), "sm_90a", ins,
                 outs, compile_options=dump_options(dump))
    assert "custom_call" in text
    with pytest.raises(ValueError, match="causal forward only"):
        FlashFwdSm90(jnp.bfloat16, d, d, False, tiles=tiles)
    sass = dumped_sass(dump)
    assert "LDL" not in sass and "STL" not in sass, "local memory spill"
    assert f"HGMMA.64x{fwd_tiles(d, d, True).tile_n}x16.F32.BF16" in sass


@pytest.mark.parametrize("causal", [False, True])
def test_fwd_hdim256_persistent_o_in_q_compiles(tmp_path, causal):
    """hdim 256 persistent CTAs (a knob, not yet run): O stays in the Q buffer
    (separate_o=False), which fits in SMEM where a separate O buffer does not;
    static round robin or (causal) the dynamic scheduler. No spills, and the O
    store's SMEM read is waited for in the loop (Q is released after it)."""
    import dataclasses

    # One CTA per cluster: the dynamic scheduler (causal) does not serve the
    # table's K/V multicast.
    tiles = dataclasses.replace(fwd_tiles(256, 256, causal), persistent=True,
                                separate_o=False, cluster_m=1 if causal else 2)
    dump = tmp_path / "dump"
    text = lower_fwd_sm90(jnp.bfloat16, 256, causal, tiles=tiles,
                          compile_options=dump_options(dump))
    assert "custom_call" in text
    sass = dumped_sass(dump)
    lines = sass.splitlines()
    assert "LDL" not in sass and "STL" not in sass, "local memory spill"
    assert sass.count("ATOMG.E.ADD") == (1 if causal else 0)
    store = max(i for i, ln in enumerate(lines) if "UTMASTG" in ln)
    waits = [i for i, ln in enumerate(lines) if "DEPBAR.LE SB0, 0x0" in ln]
    assert any(store < w < store + 12 for w in waits), "O store not waited for in the loop"


@pytest.mark.parametrize("prune,causal,steps", [(True, False, 1), (False, False, 2),
                                                 (True, True, 2)])
def test_fwd_prune_diagonal_loop_traces_one_step_less(monkeypatch, prune, causal, steps):
    """Sm90FwdTiles.prune_diagonal_loop: a non-causal kernel leaves out the
    diagonal-block loop (it never runs there), so the step is traced once per
    trace instead of twice; causal kernels keep it. The table prunes at hdim 256,
    whose compile is over the 3 s target, and not at 64 / 128."""
    import dataclasses

    assert fwd_tiles(256, 256, False).prune_diagonal_loop
    assert not fwd_tiles(128, 128, False).prune_diagonal_loop
    assert not fwd_tiles(64, 64, False).prune_diagonal_loop
    traced = []
    original = FlashFwdSm90._overlapped_step

    def counting(self, *args, **kwargs):
        traced.append(kwargs.get("mask_causal"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FlashFwdSm90, "_overlapped_step", counting)
    tiles = dataclasses.replace(fwd_tiles(256, 256, causal), prune_diagonal_loop=prune,
                                merge_diagonal_loop=False)
    assert "custom_call" in lower_fwd_sm90(jnp.bfloat16, 256, causal, tiles=tiles)
    # cutlass_call traces the kernel twice (cache key, then compile).
    assert len(traced) == 2 * steps, traced
    assert traced.count(True) == (0 if prune and not causal else len(traced) // 2)


@pytest.mark.parametrize("d", [128, 256])
def test_fwd_merge_diagonal_loop_and_pin_pv_wait(tmp_path, monkeypatch, d):
    """Sm90FwdTiles.merge_diagonal_loop (causal): every block after the first goes
    through one loop whose step masks by a run-time test, so the step is traced
    once instead of twice (the causal compile was 15-32% faster on the CPU
    machine, docs/performance.md) and its GEMMs appear in the SASS once less, with
    no spills. Alone, ptxas puts the P V wait at the branch join, above every
    exp2; pin_pv_wait keeps all of the step's exp2s above it (Note [P V wait]).
    The table merges and pins at hdim 256 causal only."""
    import dataclasses
    import re

    assert fwd_tiles(256, 256, True).merge_diagonal_loop and fwd_tiles(256, 256, True).pin_pv_wait
    for dd, causal in ((256, False), (128, True), (128, False), (64, True)):
        t = fwd_tiles(dd, dd, causal)
        assert not (t.merge_diagonal_loop or t.pin_pv_wait), (dd, causal)
    traced = []
    original = FlashFwdSm90._overlapped_step

    def counting(self, *args, **kwargs):
        traced.append(kwargs.get("mask_if") is not None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FlashFwdSm90, "_overlapped_step", counting)
    hgmma, under = {}, {}
    for merge, pin in ((False, False), (True, False), (True, True)):
        traced.clear()
        # pin_p off: at hdim 128 ptxas then sinks some exp2s below the pin (59 of 66
        # above it); pin_p is not the table's at hdim 256, where these two are.
        tiles = dataclasses.replace(fwd_tiles(d, d, True), merge_diagonal_loop=merge,
                                    pin_pv_wait=pin, pin_p=False)
        dump = tmp_path / f"{merge}{pin}"
        assert "custom_call" in lower_fwd_sm90(jnp.bfloat16, d, True, tiles=tiles,
                                               compile_options=dump_options(dump))
        assert traced == ([True] * 2 if merge else [False] * 4), traced  # two traces each
        sass = dumped_sass(dump)
        assert not re.findall(r"\b(LDL|STL)\b", sass), "local-memory spill"
        hgmma[merge, pin] = len(re.findall(r"\bHGMMA\.", sass))
        under[merge, pin] = exp2s_between_waits(sass)
    assert hgmma[True, True] == hgmma[True, False] < hgmma[False, False], hgmma
    # Each step's exp2s: 2 per score pair over tile_n columns, plus the row scales.
    per_step = {128: 66, 256: 42}[d]
    assert under[True, False] == [0], under  # the wait lands at the join
    assert under[True, True] == [per_step], under
    assert 0 < min(under[False, False]) < per_step, under  # ptxas hoists it part way


def test_fwd_elect_release_knob(tmp_path):
    """Sm90FwdTiles.elect_release (off: 0.975-1.005x on the H200, eleventh session):
    the consumers release K / V / Q stages from an ELECT lane, so no lane test
    (``tid & 31`` into a predicate) is left between the first and last wgmma,
    where the table's kernel has some; both without spills."""
    import re

    def lane_tests(on: bool) -> int:
        _, sass = _knob_sass(tmp_path, f"elect_{on}", 128, False, elect_release=on,
                             cluster_m=1)
        walk = sass[sass.index("HGMMA"):sass.rindex("HGMMA")]
        assert ("ELECT" in walk) == on
        return len(re.findall(r"LOP3\.LUT P\d, RZ, R\d+, 0x1f,", walk))

    assert not fwd_tiles(128, 128, False).elect_release
    assert lane_tests(False) > 0
    assert lane_tests(True) == 0


def _fwd_step(tmp_path, name: str, causal: bool = False, **knobs) -> tuple[str, list[str]]:
    """(whole SASS, instructions of the last overlapped step: from its S-ready wait
    on) of the hdim 128 forward with Sm90FwdTiles knobs over the table's; no
    spills."""
    import re

    _, sass = _knob_sass(tmp_path, name, 128, causal, **knobs)
    ins = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
    start = max(i for i, x in enumerate(ins) if "DEPBAR.LE gsb0, 0x1" in x)
    return sass, ins[start:]


def test_fwd_rescale_always_knob(tmp_path):
    """Sm90FwdTiles.rescale_always (off: 0.954-0.969x at hdim 128, 4k / 16k, on the
    H200, twelfth session): O is multiplied by the row scales in every step, so the
    step loses the lazy rescale's branch (one BSSY fewer in the kernel) and P's
    16-bit conversions interleave with the exp2s (the first F2FP comes before the
    step's last MUFU instead of after all of them)."""
    assert not any(fwd_tiles(d, d, c).rescale_always for d in (64, 128, 256)
                   for c in (False, True))
    shapes = {}
    for on in (False, True):
        # Without pin_p, which interleaves the conversions in the table's kernel.
        sass, step = _fwd_step(tmp_path, f"rsa_{on}", rescale_always=on, pin_p=False)
        mufu = [i for i, x in enumerate(step) if x.startswith("MUFU.EX2")]
        f2fp = [i for i, x in enumerate(step) if x.startswith("F2FP")]
        shapes[on] = (sass.count("BSSY"), f2fp[0] < mufu[-1])
    assert shapes[True] == (shapes[False][0] - 1, True) and not shapes[False][1], shapes


def _header_conversions(ptx: str) -> int:
    """The most cvt.rn.bf16x2.f32 that directly follow the label of a loop header
    in the PTX (a label that a later branch jumps back to; a ``.pragma`` line
    between them allowed)."""
    import re

    most = 0
    for m in re.finditer(r"^(\$L__BB\d+_\d+):$", ptx, flags=re.M):
        if not re.search(r"\bbra(\.uni)?\s+" + re.escape(m.group(1)) + ";", ptx[m.end():]):
            continue  # not jumped to from below: not a loop header
        lines = [x.strip() for x in ptx[m.end():].splitlines()[1:80]]
        lines = [x for x in lines if not x.startswith(".pragma")]
        n = 0
        while n < len(lines) and lines[n].startswith("cvt.rn.bf16x2.f32"):
            n += 1
        most = max(most, n)
    return most


@pytest.mark.parametrize("d", [64, 128])
def test_fwd_pin_p_keeps_conversions_in_the_step(tmp_path, d):
    """Sm90FwdTiles.pin_p (the table's at hdim 64 and 128; 0.994-1.023x under the
    power cap on the H200, fifteenth session): without it LLVM folds P's
    conversions through the KV loop's phi and runs all 32 in the loop header (32
    cvt.rn.bf16x2 right after a label in the PTX; in SASS every F2FP after the
    step's last MUFU). With it the PTX header has none, and in SASS most F2FPs
    come before the step's last MUFU (interleaved with the exp2s), its length
    within 2 instructions of the unpinned one, with no spill and as many HGMMAs."""

    from kernel_compile import read_dump

    assert all(fwd_tiles(dd, dd, c).pin_p == (dd <= 128) for dd in (64, 128, 256)
               for c in (False, True))
    got = {}
    for on in (False, True):
        dump, sass = _knob_sass(tmp_path, f"pin_{on}", d, True, pin_p=on)
        ins = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
        start = max(i for i, x in enumerate(ins) if "DEPBAR.LE gsb0, 0x1" in x)
        end = next(i for i in range(start, len(ins)) if ins[i].startswith("HGMMA"))
        step = ins[start:end]
        last_mufu = max(i for i, x in enumerate(step) if x.startswith("MUFU.EX2"))
        early = sum(x.startswith("F2FP") for x in step[:last_mufu])
        got[on] = (_header_conversions(read_dump(dump, "ptx")), early, len(step),
                   sass.count("HGMMA"))
    hdr_off, early_off, len_off, mma_off = got[False]
    hdr_on, early_on, len_on, mma_on = got[True]
    assert hdr_off >= 32 and hdr_on == 0, got
    assert early_off == 0 and early_on >= 24, got
    assert abs(len_on - len_off) <= 2 and mma_on == mma_off, got


def test_fwd_short_softmax_chain_knob(tmp_path):
    """Sm90FwdTiles.short_softmax_chain (off: 0.946-1.008x on the H200, thirteenth
    session): the row max
    uses plain FMNMX (no FMNMX.NAN, no FSETP.NAN selects in the quad shuffles),
    and from the step's last max shuffle to its first FFMA fewer than half the
    instructions stand (Note [Short max chain]); both masks, no spills."""
    from jax_fa4.kernels.softmax import OnlineSoftmax

    assert not any(fwd_tiles(d, d, c).short_softmax_chain for d in (64, 128, 256)
                   for c in (False, True))
    with pytest.raises(ValueError, match="positive scale"):
        OnlineSoftmax(-0.1, 2, short_chain=True)
    for causal in (False, True):
        got = {}
        for on in (False, True):
            # Without pin_p, quad_fmax and q_in_regs (the knob was first timed
            # without them, thirteenth session).
            sass, step = _fwd_step(tmp_path, f"ssc_{causal}_{on}", causal,
                                   short_softmax_chain=on, pin_p=False, quad_fmax=False,
                                   q_in_regs=False)
            last_shfl = max(i for i, x in enumerate(step[:200]) if x.startswith("SHFL.BFLY"))
            first_ffma = next(i for i, x in enumerate(step)
                              if i > last_shfl and x.startswith("FFMA"))
            got[on] = (sass.count("FMNMX.NAN") > 0, sass.count("FSETP.NAN") > 0,
                       first_ffma - last_shfl)
        assert got[False][:2] == (True, True) and got[True][:2] == (False, False), got
        assert 2 * got[True][2] < got[False][2], got


@pytest.mark.parametrize("causal", [False, True])
def test_fwd_sw_exp2_knob(tmp_path, causal):
    """Sm90FwdTiles.sw_exp2_per_32 (FA4's software exp2, Note [Software exp2]; off:
    0.87-0.97x on the H200, thirteenth session): with
    8 of every 32, a step of the hdim 128 kernel (2 rows of 32 columns per thread)
    has 16 MUFU.EX2 fewer and 16 round-down adds (the polynomial's range
    reduction) instead; off, none; no spills either way."""
    from jax_fa4.kernels.softmax import OnlineSoftmax

    assert not any(fwd_tiles(d, d, c).sw_exp2_per_32 for d in (64, 128, 256)
                   for c in (False, True))
    with pytest.raises(ValueError, match="sw_exp2_per_32"):
        OnlineSoftmax(0.1, 2, sw_exp2_per_32=3)
    got = {}
    for sw in (0, 8):
        _, step = _fwd_step(tmp_path, f"sw_{causal}_{sw}", causal, sw_exp2_per_32=sw)
        # The step ends at its first O-scale / P V issue: count up to the P V wgmma.
        end = next(i for i, x in enumerate(step) if x.startswith("HGMMA"))
        body = step[:end]
        got[sw] = (sum(x.startswith("MUFU.EX2") for x in body),
                   sum(x.startswith("FADD.RM") for x in body))
    assert got[0][1] == 0 and got[8][1] == 16, got
    assert got[0][0] - got[8][0] == 16, got


@pytest.mark.parametrize("n_cols", [20, 32, 64])
def test_mask_keep_bits_match_the_column_compare(n_cols):
    """TileMask(bitmask=True)'s arithmetic, on plain ints: for every column limit
    (negative, inside and past the row, as the thread offsets and the diagonal
    give), the keep bits (``visible_elements``, then ``keep_shift`` with PTX's
    clamped shift) keep exactly the elements whose accumulator column is below it."""
    from jax_fa4.kernels.mask import acc_column, keep_shift, visible_elements

    assert [acc_column(e) for e in range(6)] == [0, 1, 8, 9, 16, 17]
    for limit in range(-40, 8 * n_cols + 40):
        visible = visible_elements(limit)
        for e in range(n_cols):
            word, bit = divmod(e, 32)
            keep = (0xFFFFFFFF >> min(keep_shift(visible, word), 32)) >> bit & 1
            assert bool(keep) == (acc_column(e) < limit), (limit, e, visible)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fwd_mask_bitmask_knob(tmp_path, d):
    """Sm90FwdTiles.mask_bitmask (causal; the table's at hdim 64 since the
    seventeenth session, off at 128 / 256): the diagonal blocks' mask compiles to
    R2P predicate moves (none without it), the masked step (the first S-ready
    wait's) is shorter, no spill, as many HGMMAs."""
    table = {(dd, c): fwd_tiles(dd, dd, c).mask_bitmask for dd in (64, 128, 256)
             for c in (False, True)}
    assert table == {(dd, c): dd == 64 and c for dd, c in table}, table
    got = {}
    for on in (False, True):
        _, sass = _knob_sass(tmp_path, f"bits_{on}", d, True, mask_bitmask=on)
        ins = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
        starts = [i for i, x in enumerate(ins) if "DEPBAR.LE gsb0, 0x1" in x]
        end = next(i for i in range(starts[0], len(ins)) if ins[i].startswith("HGMMA"))
        got[on] = (sass.count("R2P "), end - starts[0], sass.count("HGMMA"))
    assert got[False][0] == 0 and got[True][0] > 0, got
    assert got[True][1] < got[False][1] and got[True][2] == got[False][2], got


def test_fwd_quad_fmax_knob(tmp_path):
    """Sm90FwdTiles.quad_fmax (the table's at every head dim since the sixteenth
    session): the row max's quad shuffles reduce with FMNMX, so the step loses the
    NaN-propagating compares (FSETP.NAN) and is shorter, with no spill and as many
    HGMMAs."""
    assert all(fwd_tiles(d, d, c).quad_fmax for d in (64, 128, 256) for c in (False, True))
    got = {}
    for on in (False, True):
        sass, step = _fwd_step(tmp_path, f"qfm_{on}", quad_fmax=on)
        got[on] = (sum(x.startswith("FSETP.NAN") for x in step), len(step),
                   sass.count("HGMMA"))
    assert got[False][0] >= 2 and got[True][0] == 0, got
    assert got[True][1] < got[False][1] and got[True][2] == got[False][2], got


@pytest.mark.parametrize("d,causal", [(128, False), (256, True)])
def test_fwd_row_fmax_knob(tmp_path, d, causal):
    """Sm90FwdTiles.row_fmax (off: level on the H200, seventeenth session): the
    thread's columns of a row reduce with FMNMX in four chains instead of
    TensorSSA.reduce's FMNMX.NAN, so the kernel has no FMNMX.NAN left; the step is
    no longer, with no spill and as many HGMMAs."""
    assert not any(fwd_tiles(dd, dd, c).row_fmax for dd in (64, 128, 256) for c in (False, True))
    got = {}
    for on in (False, True):
        _, sass = _knob_sass(tmp_path, f"rfm_{d}_{causal}_{on}", d, causal, row_fmax=on)
        ins = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
        start = max(i for i, x in enumerate(ins) if "DEPBAR.LE gsb0, 0x1" in x)
        end = next(i for i in range(start + 100, len(ins)) if ins[i].startswith("HGMMA"))
        got[on] = (sass.count("FMNMX.NAN"), end - start, sass.count("HGMMA"))
    assert got[False][0] > 0 and got[True][0] == 0, got
    assert got[True][1] <= got[False][1] and got[True][2] == got[False][2], got


def _exp2_order(step: list[str]) -> tuple[int, int]:
    """(FFMAs from a step's first FFMA to the first MUFU after it, MUFUs before the
    step's P V wait) of one step's instructions (from its S-ready wait on)."""
    f0 = next(i for i, x in enumerate(step) if x.startswith("FFMA"))
    m = next(i for i in range(f0, len(step)) if step[i].startswith("MUFU"))
    pv = next(i for i, x in enumerate(step) if i > 0 and x.startswith("WARPGROUP.DEPBAR"))
    return (sum(x.startswith("FFMA") for x in step[f0:m]),
            sum(x.startswith("MUFU") for x in step[:pv]))


@pytest.mark.parametrize("causal", [False, True])
def test_fwd_row_sum_chains_knob(tmp_path, causal):
    """Sm90FwdTiles.row_sum_chains (k = 2 in the table at hdim 64 non-causal; Note
    [Row sum in chains]),
    hdim 64: with P's row sum in one chain (the table's) the last step issues all
    32 exponent FFMAs of a row before its first exp2; in 8 chains the first exp2
    follows at most 8 of them and the P V wait still follows some exp2s; the step
    is no longer, as many HGMMAs, no spill. Bad chain counts are refused."""
    import re

    from jax_fa4.kernels.softmax import OnlineSoftmax

    assert {(d, c): fwd_tiles(d, d, c).row_sum_chains for d in (64, 128, 256)
            for c in (False, True)} == {(64, False): 2, (64, True): 0, (128, False): 0,
                                        (128, True): 0, (256, False): 0, (256, True): 0}
    got = {}
    for k in (0, 8):
        _, sass = _knob_sass(tmp_path, f"rsc_{causal}_{k}", 64, causal, row_sum_chains=k)
        ins = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
        start = max(i for i, x in enumerate(ins) if "DEPBAR.LE gsb0, 0x1" in x)
        end = next(i for i in range(start + 100, len(ins)) if ins[i].startswith("HGMMA"))
        step = ins[start:end + 1]
        got[k] = (*_exp2_order(step), len(step), sass.count("HGMMA"))
    assert got[0][0] == 32 and got[8][0] <= 8, got
    assert got[8][1] >= 1, got
    assert got[8][2] <= got[0][2] and got[8][3] == got[0][3], got
    for bad in (3, 16, -1):
        with pytest.raises(ValueError, match="row_sum_chains"):
            OnlineSoftmax(1.0, 2, row_sum_chains=bad)
    with pytest.raises(ValueError, match="do not combine"):
        OnlineSoftmax(1.0, 2, row_sum_chains=2, sw_exp2_per_32=4)


@pytest.mark.parametrize("causal", [False, True])
def test_fwd_q_in_regs_knob(tmp_path, causal):
    """Sm90FwdTiles.q_in_regs (the table's at hdim 128 non-causal since the
    seventeenth session; off causal), hdim 128: every
    S = Q K^T HGMMA takes Q from registers (the only SMEM descriptor is K's), loaded
    by 8 LDSM.x4 (64 x 128 bf16 per warpgroup, 32 registers a thread); as many
    HGMMAs, no spill. Refused where it would not fit."""
    from jax_fa4.kernels.sm90_fwd import FlashFwdSm90

    table = {(d, c): fwd_tiles(d, d, c).q_in_regs for d in (64, 128, 256)
             for c in (False, True)}
    assert table == {(d, c): d == 128 and not c for d, c in table}, table
    assert not fwd_tiles(128, 64, False).q_in_regs  # D == Dv == 128 only
    got = {}
    for on in (False, True):
        _, sass = _knob_sass(tmp_path, f"qreg_{causal}_{on}", 128, causal, q_in_regs=on)
        hgmma = re.findall(r"HGMMA\.64x128x16\.F32\.BF16 ([^;]*);", sass)
        got[on] = (sum(h.split(", ")[1].startswith("gdesc") for h in hgmma),
                   sum(h.split(", ")[1].startswith("R") for h in hgmma),
                   len(hgmma), len(re.findall(r"LDSM\.16\.M88\.4 ", sass)))
    # (HGMMAs with A from SMEM, A from registers, all, LDSM.x4)
    assert got[False][0] > 0 and got[False][3] == 0, got
    assert got[True][0] == 0 and got[True][1] == got[True][2] == got[False][2], got
    assert got[True][3] == 8, got
    import dataclasses

    for d in (64, 256):
        with pytest.raises(ValueError, match="q_in_regs"):
            FlashFwdSm90(jnp.bfloat16, d, d, causal,
                         tiles=dataclasses.replace(fwd_tiles(d, d, causal), q_in_regs=True))


@pytest.mark.parametrize("d", [128, 256])
def test_fwd_kv_multicast_knob(tmp_path, d):
    """Sm90FwdTiles.cluster_m (Note [K/V multicast]; the table's at hdim 128 / 256
    non-causal since the twenty-first session, hdim 256 causal since the
    twenty-second): with 2, every K / V load is a
    multicast TMA (UTMALDG ... MULTICAST) and Q's stay plain, consumer releases of
    K / V stages go to both CTAs' barriers (remote arrives, .RED), and the CTAs
    meet at a cluster barrier at the start and before they exit; with 1 none of
    that. No spills, as many HGMMAs. Refused where the cluster's CTAs would not
    walk the same key blocks."""
    import dataclasses

    from jax_fa4.kernels.sm90_fwd import make_fwd_sm90

    table = {(x, c): fwd_tiles(x, x, c).cluster_m for x in (64, 128, 256)
             for c in (False, True)}
    assert table == {(x, c): 2 if (x >= 128 and not c) or x == 256 else 1
                     for x, c in table}, table
    got = {}
    for c in (1, 2):
        _, sass = _knob_sass(tmp_path, f"mc{c}_{d}", d, False, cluster_m=c)
        loads = re.findall(r"UTMALDG\.\w+(\.MULTICAST)? ", sass)
        got[c] = (sum(bool(x) for x in loads), sum(not x for x in loads),
                  len(re.findall(r"SYNCS\.ARRIVE\.TRANS64\.RED", sass)),
                  sass.count("UCGABAR_ARV"), sass.count("UCGABAR_WAIT"),
                  len(re.findall(r"HGMMA\.", sass)))
    # (multicast loads, plain loads, remote arrives, cluster arrives, waits, HGMMAs)
    assert got[1][0] == got[1][2] == got[1][3] == got[1][4] == 0, got
    # Q stays a plain load; each K / V load of the one-CTA kernel is now multicast.
    assert got[2][0] == got[1][1] - got[2][1], got
    assert got[2][1] > 0 and got[2][2] > 0, got
    assert got[2][3] == got[2][4] == 2, got
    assert got[2][5] == got[1][5], got
    base = fwd_tiles(d, d, False)
    for bad in ({"cluster_m": 3}, {"cluster_m": 2, "elect_release": True},
                {"cluster_m": 2, "split_tail": True, "persistent": True}):
        with pytest.raises(ValueError, match="cluster_m|K/V multicast"):
            make_fwd_sm90(jnp.bfloat16, d, d, False, tiles=dataclasses.replace(base, **bad))
    # Causal: the dynamic scheduler (hdim 128's persistent CTAs) refuses it.
    causal_tiles = dataclasses.replace(fwd_tiles(d, d, True), cluster_m=2)
    if causal_tiles.persistent:
        with pytest.raises(ValueError, match="K/V multicast"):
            make_fwd_sm90(jnp.bfloat16, d, d, True, tiles=causal_tiles)


@pytest.mark.parametrize("d,over", [(256, {}), (128, {"persistent": False}),
                                    (128, {"persistent": False, "lpt": False})])
def test_fwd_kv_multicast_causal_compiles(tmp_path, d, over):
    """Causal K/V multicast with a CTA per tile (Note [K/V multicast]; off in the
    table, not yet run when added): the K / V loads are multicast, the skipped
    stages' releases add remote arrives but no HGMMA, no spills; in both launch
    orders (LPT over clusters, per head)."""
    got = {}
    for c in (1, 2):
        _, sass = _knob_sass(tmp_path, f"mcc{c}_{d}_{len(over)}", d, True, cluster_m=c, **over)
        got[c] = (len(re.findall(r"UTMALDG\.\w+\.MULTICAST ", sass)),
                  len(re.findall(r"SYNCS\.ARRIVE\.TRANS64\.RED", sass)),
                  sass.count("UCGABAR_WAIT"), len(re.findall(r"HGMMA\.", sass)))
    assert got[1][:3] == (0, 0, 0), got
    assert got[2][0] > 0 and got[2][1] > 0 and got[2][2] == 2, got
    assert got[2][3] == got[1][3], got
