"""The CTA timeline of the sm90 backward (Note [CTA timeline], sm90_bwd.py) on the
CPU: the traced kernels compile with their clock reads and leave the untraced
kernel alone; scripts/cta_timeline.py's analysis on a timeline whose answers are
known. The GPU runs it through scripts/cta_timeline.py (a diagnostic, no GPU test).
"""

import dataclasses
import functools
import importlib.util
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_compile import bwd_structs, dump_options, dumped_sass, lower

needs_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed"
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))


def _halves(t: int) -> tuple[int, int]:
    """t as the kernel stores it: int32 bit patterns of the low and high halves."""
    lo = np.array(t & 0xFFFFFFFF, np.uint32).view(np.int32)
    return int(lo), int(t >> 32)


def test_analysis_of_a_known_timeline():
    """Two SMs, four CTAs each; CTA i starts at 10 us x (i // 2) + 0.5 us on SM i % 2
    and lasts 1 us + 1 us per item (items 2 + i); its producer warps end 0.3 us
    before its MMA warps. The times cross a step of the high half (low halves near
    2^32, negative as int32), so the halves' reassembly is checked too."""
    import cta_timeline as ct

    base = (5 << 32) - 20_000
    tr = np.zeros((8, ct.TRACE_COLS), np.int32)
    for i in range(8):
        start = base + (i // 2) * 10_000 + 500
        items = 2 + i
        end = start + 1000 + 1000 * items
        tr[i, 0], tr[i, 2], tr[i, 5] = i % 2, i, items
        tr[i, 6], tr[i, 7] = _halves(start)
        for w in range(ct.NUM_WARPS):
            e = end - (0 if w >= 4 else 300)
            tr[i, ct.TRACE_WARP_END + 2 * w], tr[i, ct.TRACE_WARP_END + 2 * w + 1] = _halves(e)
    summary, records = ct.analyse(tr)
    # Last CTA: starts 30.5 us after the first start (0.5 us), lasts 10 us.
    assert summary["span_us"] == pytest.approx(40.0)
    assert summary["fixed_us"] == pytest.approx(1.0) and summary["item_us"] == pytest.approx(1.0)
    busy = sum(1000 + 1000 * (2 + i) for i in range(8)) / (2 * 40_000)
    assert summary["busy"] == pytest.approx(busy)
    assert summary["after_mma_us_mean"] == pytest.approx(0.0)
    assert [r["items"] for r in records] == list(range(2, 10))
    assert records[0]["start_ns"] == 0 and records[7]["end_ns"] == 40_000
    # SM 0's last CTA (i = 6) starts 30 us after the first start and lasts 9 us;
    # SM 1's ends at 40.
    assert summary["first_sm_done"] == pytest.approx(39_000 / 40_000)


@needs_cutlass
def test_traced_kernels_compile_and_refuse():
    """trace=True: two clock reads (the start by thread 0, one end per warp) and the
    SM id; the plain and the folding kernel; refused with the persistent walk and
    without its operand."""
    import cutlass

    from jax_fa4.kernels import sm90_bwd

    b, sq, sk, hq, hkv, d = 2, 113, 203, 4, 1, 128
    ins, outs, aliases = bwd_structs(b, sq, sk, hq, hkv, d, jnp.bfloat16)
    trace = jax.ShapeDtypeStruct((-(-sk // 128) * hkv * b, sm90_bwd.TRACE_COLS), jnp.int32)
    plain = functools.partial(sm90_bwd.FlashBwdSm90, cutlass.BFloat16, d, d, True, 0.1,
                              trace=True)
    assert "custom_call" in lower(plain, "sm_90a", ins, outs + (trace,), aliases)
    with pytest.raises(Exception, match="mTrace"):
        lower(plain, "sm_90a", ins, outs, aliases)
    with pytest.raises(ValueError, match="trace"):
        sm90_bwd.FlashBwdSm90(cutlass.BFloat16, d, d, True, 0.1, trace=True,
                              tiles=dataclasses.replace(sm90_bwd.bwd_tiles(d, True),
                                                        persistent=True, skip_masked_wg=False))


@needs_cutlass
def test_traced_fold_sass(tmp_path):
    """The folding kernel with trace: the clock reads are there, nothing spills."""
    import cutlass

    from jax_fa4.kernels import sm90_bwd

    b, sq, sk, hq, hkv, d = 2, 113, 203, 4, 1, 128
    ins, outs, _ = bwd_structs(b, sq, sk, hq, hkv, d, jnp.bfloat16)
    tm = sm90_bwd.bwd_tiles(d, True).tile_m
    sem = jax.ShapeDtypeStruct((b, hq, -(-sq // tm)), jnp.int32)
    dq = jax.ShapeDtypeStruct((b, sq, hq, d), jnp.bfloat16)
    trace = jax.ShapeDtypeStruct((-(-sk // 128) * hkv * b, sm90_bwd.TRACE_COLS), jnp.int32)
    make = functools.partial(sm90_bwd.FlashBwdSm90Fold, cutlass.BFloat16, d, d, True, 0.1,
                             trace=True)
    lower(make, "sm_90a", ins + (sem,), outs + (sem, dq, trace), {6: 0, 7: 3},
          compile_options=dump_options(tmp_path))
    sass = dumped_sass(tmp_path)
    assert len(re.findall(r"SR_GLOBALTIMER", sass)) == 2
    assert re.search(r"SR_VIRTUALSMID|SR_SMID", sass)
    assert not re.search(r"\b(LDL|STL)\b", sass)
