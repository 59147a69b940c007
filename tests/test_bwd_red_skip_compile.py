"""Three sm90 backward knobs, on the CPU (measured on the H200 in the twenty-third
and twenty-fourth sessions, docs/performance.md; dq_red is off in the tile table,
skip_masked_wg with carry_coords is the table's at hdim 128 causal):

- ``BwdTiles.dq_red`` (Note [dQ from registers], dq_layout.py): the MMA threads
  reduce-add dQ into the flat accumulator with 128-bit reductions; no SMEM dQ
  buffer, no bulk reduce.
- ``BwdTiles.skip_masked_wg`` (Note [Masked warpgroup], sm90_bwd.py): the walk's
  first item is peeled off the loop for a warpgroup whose keys it masks entirely,
  which then runs only its dQ GEMM there.
- ``BwdTiles.carry_coords``: the MMA walk carries its query block from item to item.

The checks: the table, the refusals, and the SASS of each build (instruction counts
that only the knob explains, no spills). The GPU tests run them (test_gpu.py:
test_backward_dq_from_registers, test_backward_skip_masked_warpgroup,
test_backward_carried_coords; the table's kernel in every backward test).
"""

import dataclasses
import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import pytest
from kernel_compile import bwd_structs, dump_options, dumped_sass, lower

needs_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed"
)


@needs_cutlass
def test_table_and_refusals():
    import cutlass

    from jax_fa4.kernels.sm90_bwd import (
        FlashBwdSm90,
        FlashBwdSm90Deterministic,
        FlashBwdSm90StoreFirst,
        bwd_tiles,
    )

    for d in (64, 128):
        for causal in (False, True):
            t = bwd_tiles(d, causal)
            on = (d, causal) == (128, True)
            assert (t.dq_red, t.skip_masked_wg, t.carry_coords) == (False, on, on), (d, causal)
    # Built from the table, the store-first and fold kernels drop the skip (which
    # needs the add-only hand-off); the deterministic one keeps it.
    for kernel in (FlashBwdSm90StoreFirst(cutlass.BFloat16, 128, 128, True, 0.1),
                   FlashBwdSm90(cutlass.BFloat16, 128, 128, True, 0.1, dq_fold=1)):
        assert not kernel.tiles.skip_masked_wg and kernel.tiles.carry_coords
    assert FlashBwdSm90Deterministic(cutlass.BFloat16, 128, 128, True,
                                     0.1).tiles.skip_masked_wg
    t = dataclasses.replace(bwd_tiles(128, True), skip_masked_wg=False, carry_coords=False)
    red = dataclasses.replace(t, dq_red=True)
    for kw in ({"deterministic": True}, {"dq_store_first": True}, {"dq_fold": 1},
               {"tiles": dataclasses.replace(red, dq_flat=False)},
               {"tiles": dataclasses.replace(red, persistent=True)},
               {"tiles": dataclasses.replace(red, dq_double_add=True)}):
        kw = {"tiles": red, **kw}
        with pytest.raises(ValueError, match="dq_red"):
            FlashBwdSm90(cutlass.BFloat16, 128, 128, True, 0.1, **kw)
    skip = dataclasses.replace(t, skip_masked_wg=True)
    for over in ({"split_kv": True}, {"persistent": True}, {"dq_flat": False},
                 {"dq_red": True}, {"dq_double_add": True}):
        with pytest.raises(ValueError, match="skip_masked_wg"):
            FlashBwdSm90(cutlass.BFloat16, 128, 128, True, 0.1,
                         tiles=dataclasses.replace(skip, **over))
    with pytest.raises(ValueError, match="skip_masked_wg"):
        FlashBwdSm90(cutlass.BFloat16, 128, 128, True, 0.1, tiles=skip, dq_store_first=True)


def _sass(tmp_path, head_dim: int, causal: bool, deterministic: bool = False, **over) -> str:
    """The SASS of the backward main kernel with the table's tiles, ``over``
    replaced; deterministic: FlashBwdSm90Deterministic (its semaphores after
    dQaccum)."""
    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90, FlashBwdSm90Deterministic, bwd_tiles

    b, sq, sk, hq, hkv = 2, 113, 203, 4, 1
    ins, outs, _ = bwd_structs(b, sq, sk, hq, hkv, head_dim, jnp.bfloat16)
    tiles = dataclasses.replace(bwd_tiles(head_dim, causal), **over)
    cls = FlashBwdSm90Deterministic if deterministic else FlashBwdSm90
    make = functools.partial(cls, cutlass.BFloat16, head_dim, head_dim, causal,
                             head_dim**-0.5, tiles=tiles)
    aliases = {6: 0}
    if deterministic:
        sem = jax.ShapeDtypeStruct((b, hq, -(-sq // tiles.tile_m)), jnp.int32)
        ins, outs, aliases = ins + (sem,), outs + (sem,), {6: 0, 7: 3}
    lower(make, "sm_90a", ins, outs, aliases, compile_options=dump_options(tmp_path))
    return dumped_sass(tmp_path)


@needs_cutlass
@pytest.mark.parametrize("head_dim,causal", [(128, True), (64, False)])
def test_dq_from_registers_sass(tmp_path, head_dim, causal):
    """8 REDG.E.ADD.F32x4 per thread and query block (32 dQ floats a thread, 4 per
    reduction), no bulk reduce and no 128-bit SMEM store of dQ, no spills; the 32
    wgmma instructions of the walk and epilogue are all there."""
    sass = _sass(tmp_path, head_dim, causal, dq_red=True, skip_masked_wg=False)
    assert len(re.findall(r"\bREDG\.E\.ADD\.F32x4\b", sass)) == 8
    assert not re.search(r"\bUBLKRED\b", sass)
    assert not re.search(r"\bSTS\.128\b", sass)
    assert len(re.findall(r"\bHGMMA\.", sass)) == 32
    assert not re.search(r"\b(LDL|STL)\b", sass), "the dq_red kernel spills"


@needs_cutlass
def test_masked_warpgroup_sass(tmp_path):
    """hdim 128 causal: the peeled first item adds one dQ GEMM (8 HGMMA k-steps of
    16 over 128 keys) to the walk's 32 wgmma instructions and a second copy of the
    dQ hand-off (8 more 128-bit SMEM stores, 16 in all); the two bulk reduces stay;
    no spills. The table's kernel (skip with carry_coords) and the deterministic
    one have it; without the skip neither."""
    base = _sass(tmp_path / "base", 128, True, skip_masked_wg=False, carry_coords=False)
    sass = _sass(tmp_path / "skip", 128, True)
    hgmma = lambda s: len(re.findall(r"\bHGMMA\.", s))  # noqa: E731
    sts = lambda s: len(re.findall(r"\bSTS\.128\b", s))  # noqa: E731
    assert (hgmma(base), sts(base)) == (32, 8)
    assert (hgmma(sass), sts(sass)) == (40, 16)
    assert len(re.findall(r"\bUBLKRED\.G\.S\.ADD\.F32", sass)) == 2
    assert not re.search(r"\b(LDL|STL)\b", sass), "the skip_masked_wg kernel spills"
    det = _sass(tmp_path / "det", 128, True, deterministic=True)
    assert (hgmma(det), sts(det)) == (40, 16)
    assert not re.search(r"\b(LDL|STL)\b", det), "the deterministic skip kernel spills"


def _normalized(sass: str) -> list[str]:
    """SASS lines with addresses, labels, registers and immediates replaced."""
    out = []
    for line in sass.splitlines():
        line = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line)
        line = re.sub(r"\.L_x_\d+", "L", line)
        line = re.sub(r"\bU?R\d+\b", "R", line)
        line = re.sub(r"\bU?P\d\b", "P", line)
        line = re.sub(r"0x[0-9a-f]+", "X", line).strip()
        if line and not line.startswith((".", "//")):
            out.append(line)
    return out


@needs_cutlass
def test_carried_coordinates_sass(tmp_path):
    """BwdTiles.carry_coords: from item 0 the table's kernel already carries the
    walk's query block (LLVM strength-reduces it // num_m), so carrying it by hand
    leaves the SASS the same up to register names; with skip_masked_wg (a walk
    from a run-time item) it removes a run-time division, which shows as fewer
    MUFU.RCP than without it. Both refuse the rotated and the persistent walk."""
    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90, bwd_tiles

    base = _sass(tmp_path / "base", 128, True, skip_masked_wg=False, carry_coords=False)
    carry = _sass(tmp_path / "carry", 128, True, skip_masked_wg=False)
    assert _normalized(carry) == _normalized(base)
    skip = _sass(tmp_path / "skip", 128, True, carry_coords=False)
    both = _sass(tmp_path / "both", 128, True)  # the table's
    rcp = lambda s: len(re.findall(r"\bMUFU\.RCP\b", s))  # noqa: E731
    assert rcp(both) < rcp(skip), (rcp(both), rcp(skip))
    assert not re.search(r"\b(LDL|STL)\b", both)
    t = bwd_tiles(128, False)
    for over in ({"rotate_walk": True}, {"persistent": True}):
        with pytest.raises(ValueError, match="carry_coords"):
            FlashBwdSm90(cutlass.BFloat16, 128, 128, False, 0.1,
                         tiles=dataclasses.replace(t, carry_coords=True, **over))
