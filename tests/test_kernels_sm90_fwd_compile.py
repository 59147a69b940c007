"""CPU-only compile checks of the sm90 forward's shipped builds (no GPU needed).

Every row of the tile table (``fwd_tiles``: head dim 64 / 128 / 256, causal or not)
is lowered once for sm_90a in bf16, and one row in fp16, through
cutlass.jax.cutlass_call as the FFI layer calls it (dynamic batch / sequence / head
extents); the tests read the build's HLO, PTX and SASS, and ptxas's report on the
PTX, and check that the machine code holds what the row selects.
"""

from __future__ import annotations

import dataclasses
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
    read_dump,
)

from jax_fa4.kernels.sm90_fwd import (  # noqa: E402
    FlashFwdSm90,
    FlashFwdSm90Dynamic,
    Sm90FwdTiles,
    fwd_tiles,
    make_fwd_sm90,
)

# (head dim, causal, dtype): the table's rows in bf16, one in fp16.
BUILDS = [(64, False, "bfloat16"), (64, True, "bfloat16"), (128, False, "bfloat16"),
          (128, True, "bfloat16"), (256, False, "bfloat16"), (256, True, "bfloat16"),
          (128, True, "float16")]
_IDS = [f"d{d}-{'causal' if c else 'full'}-{t}" for d, c, t in BUILDS]
# The builds with the merged causal KV loop.
_MERGED = [k for k in BUILDS if k[1] and fwd_tiles(k[0], k[0], True).merge_diagonal_loop]


@dataclasses.dataclass(frozen=True)
class Build:
    d: int
    causal: bool
    dtype: str
    tiles: Sm90FwdTiles
    hlo: str
    ptx: str
    sass: str
    ins: list  # the SASS instructions, in order
    ptxas: str | None  # ptxas -v's report on the PTX; None without ptxas


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Compiles a build on first use, once for the whole module."""
    cache = {}

    def get(key) -> Build:
        if key not in cache:
            d, causal, dtype = key
            dump = tmp_path_factory.mktemp(f"fwd{d}{'c' if causal else ''}{dtype}")
            hlo = lower_fwd_sm90(jnp.dtype(dtype), d, causal, compile_options=dump_options(dump))
            sass = dumped_sass(dump)
            ptx = read_dump(dump, "ptx")
            report = None
            if shutil.which("ptxas"):
                report = subprocess.run(
                    ["ptxas", "-arch=sm_90a", "-v", glob.glob(str(dump / "*.ptx"))[0], "-o",
                     str(dump / "k.cubin")], capture_output=True, text=True, check=True).stderr
            ins = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
            cache[key] = Build(d, causal, dtype, fwd_tiles(d, d, causal), hlo, ptx, sass, ins,
                               report)
        return cache[key]

    return get


@pytest.fixture(params=BUILDS, ids=_IDS)
def build(request, builds) -> Build:
    return builds(request.param)


def _loops(b: Build) -> int:
    """KV loops after the first block: a diagonal one and the rest, or one (the
    non-causal kernel, whose diagonal loop never runs, and the merged causal one)."""
    return 1 if not b.causal or b.tiles.merge_diagonal_loop else 2


def test_fwd_tiles_head_dims():
    assert fwd_tiles(256, 256, False).tile_n == 80
    assert fwd_tiles(128, 128, True).tile_n == 128
    assert fwd_tiles(64, 64, True).tile_m == 192
    # hdim 96: flash-attn-4's 192 x 128 with P through SMEM (Note [P through SMEM]).
    for causal in (False, True):
        t = fwd_tiles(96, 96, causal)
        assert (t.tile_m, t.tile_n, t.p_in_smem, t.consumer_regs) == (192, 128, True, 160)
    assert not any(fwd_tiles(d, d, c).p_in_smem for d in (64, 128, 192, 256)
                   for c in (False, True))
    assert fwd_tiles(192, 192, True).tile_n == fwd_tiles(192, 128, False).tile_n == 112
    for d, dv in [(256, 128), (160, 160), (128, 192)]:
        with pytest.raises(ValueError):
            fwd_tiles(d, dv, False)


def test_fwd_custom_call_and_operands(build):
    """The causal persistent kernel is FlashFwdSm90Dynamic: its call takes the int32
    tile counter after V, aliased to a third output; the others take q, k, v."""
    dynamic = build.causal and build.tiles.persistent
    kernel = make_fwd_sm90(jnp.dtype(build.dtype), build.d, build.d, build.causal)
    assert isinstance(kernel, FlashFwdSm90Dynamic) == dynamic
    assert "CuteDSLRT_NvJaxCutlassCall" in build.hlo
    alias = re.search(r"output_operand_alias<output_tuple_indices = \[(\d)\], operand_index = "
                      r"(\d)", build.hlo)
    assert (alias.groups() if alias else None) == (("2", "3") if dynamic else None)


def test_fwd_wgmma(build):
    """S = Q K^T is 64 x tile_n per warpgroup in D / 16 HGMMAs, O += P V 64 x Dv in
    tile_n / 16, once for the first block, once per KV loop and once for the last
    P V; one partial wgmma wait (S ready, P V in flight) per loop. No spills,
    setmaxnreg honoured, and ptxas neither serialises the wgmmas nor fences them
    (no C75xx advisory)."""
    t, d = build.tiles, build.d
    suffix = ".BF16" if build.dtype == "bfloat16" else ""
    hgmma = re.findall(r"HGMMA\.64x(\d+)x16\.F32" + re.escape(suffix) + r" ", build.sass)
    n = _loops(build) + 1
    want = {str(t.tile_n): n * d // 16}
    want[str(d)] = want.get(str(d), 0) + n * t.tile_n // 16
    got = {}
    for width in hgmma:
        got[width] = got.get(width, 0) + 1
    assert got == want, (got, want)
    assert len(exp2s_between_waits(build.sass)) == _loops(build)
    assert not re.findall(r"\b(LDL|STL)\b", build.sass), "local-memory spill"
    assert build.sass.count("USETMAXREG") == 2
    if build.ptxas is None:
        pytest.skip("no ptxas for the advisories")
    assert "C7508" not in build.ptxas, "setmaxnreg ignored"
    assert "0 bytes spill stores" in build.ptxas
    assert not [ln for ln in build.ptxas.splitlines() if "(C75" in ln], build.ptxas


def test_fwd_tile_walk(build):
    """Persistent CTAs: the dynamic scheduler (causal) claims tiles with one global
    atomic add; O has its own SMEM buffer, so the O store is waited for only
    before the next tile's epilogue writes it and once before the CTA exits. One CTA
    per tile: O goes out through the Q buffer, waited for right after the store."""
    lines = build.sass.splitlines()
    dynamic = build.causal and build.tiles.persistent
    assert build.sass.count("ATOMG.E.ADD") == (1 if dynamic else 0)
    stores = [i for i, ln in enumerate(lines) if "UTMASTG" in ln]
    waits = [i for i, ln in enumerate(lines) if "DEPBAR.LE SB0, 0x0" in ln]
    epilogue = [i for i, ln in enumerate(lines) if "BAR.SYNC.DEFER_BLOCKING 0x1," in ln]
    assert stores and epilogue
    if build.tiles.persistent:
        assert len(waits) == 2 and waits[0] < epilogue[0] and waits[1] > stores[-1], waits
    else:
        assert len(waits) == 1 and stores[-1] < waits[0] < stores[-1] + 12, waits


def test_fwd_kv_multicast(build):
    """cluster_m 2 (Note [K/V multicast]): every K / V load is a multicast TMA and
    Q's stay plain, consumers release K / V stages on both CTAs' barriers (remote
    arrives), and the CTAs meet at a cluster barrier at the start and before they
    exit. cluster_m 1: none of that."""
    # The load warp copies Q at one site and K / V at four (first K, the loop's K
    # and V, last V), each in D / 64 TMA boxes (128-byte swizzle, 16-bit values).
    boxes = build.d // 64
    loads = re.findall(r"UTMALDG\.\w+(\.MULTICAST)? ", build.sass)
    multicast = sum(bool(x) for x in loads)
    plain = len(loads) - multicast
    remote = len(re.findall(r"SYNCS\.ARRIVE\.TRANS64\.RED", build.sass))
    barriers = (build.sass.count("UCGABAR_ARV"), build.sass.count("UCGABAR_WAIT"))
    if build.tiles.cluster_m == 2:
        assert (plain, multicast, barriers) == (boxes, 4 * boxes, (2, 2)) and remote > 0
    else:
        assert (plain, multicast, remote, barriers) == (5 * boxes, 0, 0, (0, 0))


def test_fwd_q_operand(build):
    """q_in_regs: no HGMMA reads its A operand from SMEM (Q comes from registers,
    loaded by D / 16 LDSM.x4 a tile: 64 x D 16-bit values per warpgroup); else
    every S = Q K^T HGMMA reads Q from SMEM. P V always takes P from registers."""
    a_ops = re.findall(r"HGMMA\.64x\d+x16\.F32\S* \S+, (\S+)", build.sass)
    from_smem = sum(op.startswith("gdesc") for op in a_ops)
    ldsm = len(re.findall(r"LDSM\.16\.M88\.4 ", build.sass))
    if build.tiles.q_in_regs:
        assert (from_smem, ldsm) == (0, build.d // 16)
    else:
        assert (from_smem, ldsm) == ((_loops(build) + 1) * build.d // 16, 0)


def _header_conversions(ptx: str) -> int:
    """The most cvt.rn.*16x2.f32 that directly follow the label of a loop header in
    the PTX (a label that a later branch jumps back to; ``.pragma`` lines between
    them allowed)."""
    most = 0
    for m in re.finditer(r"^(\$L__BB\d+_\d+):$", ptx, flags=re.M):
        if not re.search(r"\bbra(\.uni)?\s+" + re.escape(m.group(1)) + ";", ptx[m.end():]):
            continue  # not jumped to from below: not a loop header
        lines = [x.strip() for x in ptx[m.end():].splitlines()[1:80]]
        lines = [x for x in lines if not x.startswith(".pragma")]
        n = 0
        while n < len(lines) and re.match(r"cvt\.rn\.(bf|f)16x2\.f32", lines[n]):
            n += 1
        most = max(most, n)
    return most


def _steps(b: Build) -> list[list[str]]:
    """The instructions of each overlapped step: from its partial wgmma wait (S
    ready) to the next HGMMA issue after the softmax."""
    starts = [i for i, x in enumerate(b.ins) if "DEPBAR.LE gsb0, 0x1" in x]
    return [b.ins[s:next(i for i in range(s + 100, len(b.ins))
                         if b.ins[i].startswith("HGMMA")) + 1] for s in starts]


def test_fwd_softmax_step(build):
    """The softmax's shape in SASS, by the row's choices: the row max's quad
    shuffles reduce with plain fmax (no FSETP.NAN); the causal diagonal mask by a
    keep bitmask (mask_bitmask) moves bits into predicates (R2P), the compare
    mask none; P's conversions stay out of the loop header where pin_p holds them
    in the step (Note [P conversion in the loop header]); with P's row sum in
    chains (row_sum_chains) a row's first exp2 follows a few of its exponent FFMAs,
    not all of them (Note [Row sum in chains])."""
    t = build.tiles
    assert "FSETP.NAN" not in build.sass
    assert (build.sass.count("R2P ") > 0) == (build.causal and t.mask_bitmask)
    header = _header_conversions(build.ptx)
    assert header == 0 if t.pin_p else header > 0, header
    if t.row_sum_chains:
        for step in _steps(build):
            first = next(i for i, x in enumerate(step) if x.startswith("FFMA"))
            mufu = next(i for i in range(first, len(step)) if step[i].startswith("MUFU"))
            assert sum(x.startswith("FFMA") for x in step[first:mufu]) <= 8, step


@pytest.mark.parametrize("key", _MERGED, ids=[f"d{d}" for d, _, _ in _MERGED])
def test_fwd_merged_loop_pins_pv_wait(builds, key):
    """The merged causal loop (merge_diagonal_loop) keeps every exp2 of its step
    (two rows of tile_n / 4 elements and their two row scales) above the P V wait,
    where the mask test's join would pull the wait above all of them (Note [P V
    wait])."""
    build = builds(key)
    assert exp2s_between_waits(build.sass) == [build.tiles.tile_n // 2 + 2]


def test_fwd_refusals():
    """Tiles the kernel cannot run are refused when it is built (or traced)."""
    t128 = fwd_tiles(128, 128, False)
    for bad in ({"tile_m": 64}, {"cluster_m": 3}):
        with pytest.raises(ValueError, match="tile_m|cluster_m"):
            FlashFwdSm90(jnp.bfloat16, 128, 128, False, tiles=dataclasses.replace(t128, **bad))
    # The dynamic scheduler hands out single tiles: no K/V multicast.
    with pytest.raises(ValueError, match="K/V multicast"):
        make_fwd_sm90(jnp.bfloat16, 128, 128, True,
                      tiles=dataclasses.replace(fwd_tiles(128, 128, True), cluster_m=2))
    for d in (64, 256):
        with pytest.raises(ValueError, match="q_in_regs"):
            FlashFwdSm90(jnp.bfloat16, d, d, False,
                         tiles=dataclasses.replace(fwd_tiles(d, d, False), q_in_regs=True))
    with pytest.raises(ValueError, match="causal persistent"):
        FlashFwdSm90Dynamic(jnp.bfloat16, 128, 128, False)
    # The plain class does not trace the causal persistent kernel (no counter).
    ins, outs = fwd_structs(2, 113, 203, 8, 2, 128, jnp.bfloat16)
    with pytest.raises(Exception, match="tile counter"):
        lower(lambda: FlashFwdSm90(jnp.bfloat16, 128, 128, True), "sm_90a", ins, outs)


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


def test_fwd_lpt_section_sizes():
    """Heads per L2 section (K and V of a section fit in 50 MiB): hdim 128 at 4k
    tokens is 2 MiB per head -> 16; a GQA group of 4 shares it -> 64 (the cap);
    16k tokens (8 MiB) -> 4; hdim 256 at 8k (8 MiB) -> 4; past 400 KV blocks of 128
    (51200 tokens) one head per section."""
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


@pytest.mark.parametrize("batch,rows", [(1, 1), (1, 63), (3, 7), (2, 8192), (256, 4),
                                        (4096, 32), (1, 1 << 20)])
def test_span_samples_stay_inside_the_intervals(batch, rows):
    """The 32 interval rows a masked forward's load warp reads for its key span
    (Note [Sections of masked tiles]) are rows of the intervals, spread over the
    whole batch once there are 32 rows or more."""
    from jax_fa4.kernels.sm90_fwd import span_sample

    picks = [span_sample(lane, batch, rows) for lane in range(32)]
    assert all(0 <= b < batch and 0 <= r < rows for b, r in picks)
    if batch * rows >= 32:
        flat = [b * rows + r for b, r in picks]
        assert len(set(flat)) == 32
        assert flat[0] < batch * rows // 32 + 1 and flat[-1] >= batch * rows * 31 // 32


def test_masked_sections_follow_the_key_span():
    """Packed documents of 1k (and a window of 1024) in 8k rows read about 9 key
    blocks a tile: sections of 64 heads, as 1k rows get; a causal 8k row, lengths
    or not, keeps the whole row's 8 (hdim 128, tiles 128 x 128)."""
    from jax_fa4.kernels.sm90_fwd import lpt_section_size, span_blocks

    t = fwd_tiles(128, 128, True, masked=True)

    def section(span, seqlen_k=8192):
        blocks = span_blocks(span, seqlen_k, t.tile_m, t.tile_n)
        return lpt_section_size(blocks, 1, t.tile_n * 2 * 128 * 2)

    assert span_blocks(1024, 8192, 128, 128) == 9
    assert section(1024) == 64
    assert section(1025) == 64
    assert section(8192) == 8
    assert section(4096) == 16
    assert section(0) == 64
    assert span_blocks(8192, 300, 128, 128) == 3


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
