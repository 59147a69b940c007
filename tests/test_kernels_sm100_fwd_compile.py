"""CPU-only compile checks of the sm100 forward kernel (no GPU needed).

Lowers the kernel for sm_100a through cutlass.jax.cutlass_call, as the FFI layer
does, with dynamic batch / sequence / head extents (divisibility 1), and checks
that the custom call is in the HLO. One configuration is also dumped to PTX and
SASS to check the Blackwell instructions FA4's design relies on (tcgen05 MMA,
TMEM alloc / ld / st, setmaxnreg, mbarrier waits) and the 512-thread launch.
The kernel has been compiled, not run: no Blackwell GPU was available.
"""

from __future__ import annotations

import glob
import importlib.util
import re

import pytest

if importlib.util.find_spec("cutlass") is None:
    pytest.skip("nvidia-cutlass-dsl is not installed", allow_module_level=True)

jax = pytest.importorskip("jax")
jnp = jax.numpy

from kernel_compile import fwd_structs, lower  # noqa: E402

from jax_fa4.ffi.bridge import pinned_arch  # noqa: E402


@pytest.fixture(autouse=True)
def sm100():
    """Pin the DSL to sm_100a for one test; yield (cutlass.jax, kernel module)."""
    with pinned_arch("sm_100a"):
        import cutlass.jax as cutlass_jax

        from jax_fa4.kernels import sm100_fwd

        yield cutlass_jax, sm100_fwd


def _lower(sm100, dtype, d: int, causal: bool, shape=(2, 113, 203, 8, 2), compile_options=None):
    """Lower the forward for (B, Sq, Sk, Hq, Hkv); returns the HLO text."""
    ins, outs = fwd_structs(*shape, d, dtype)
    return lower(lambda: sm100[1].FlashFwdSm100(dtype, d, d, causal), "sm_100a", ins, outs,
                 compile_options=compile_options)


@pytest.mark.parametrize(
    "shape",
    [
        (1, 1, 1, 1, 1),  # seqlen 1
        (2, 4097, 1000, 4, 1),  # MQA, one row past a multiple of 256, Sq > Sk
    ],
)
def test_fwd_odd_shapes_lower(sm100, shape):
    # Every (head dim, mask) row in bf16 lowers in tests/test_lowering.py; here both
    # dtypes at odd shapes (GQA / MQA, tails, seqlen 1, Sq > Sk).
    assert "custom_call" in _lower(sm100, jnp.bfloat16, 128, True, shape)
    assert "custom_call" in _lower(sm100, jnp.float16, 64, False, shape)


def test_tile_table(sm100):
    fwd_tiles = sm100[1].fwd_tiles
    t128, t64 = fwd_tiles(128, 128, False), fwd_tiles(64, 64, True)
    assert (t128.tile_m, t128.tile_n, t64.tile_m, t64.tile_n) == (128, 128, 128, 128)
    assert t128.kv_stages >= 3 and t64.kv_stages > t128.kv_stages
    assert (t128.softmax_regs, t128.correction_regs, t128.other_regs) == (192, 80, 48)
    # 4 warpgroups share 64K registers: softmax x2, correction, the rest.
    assert 128 * (2 * t128.softmax_regs + t128.correction_regs + t128.other_regs) == 65536
    with pytest.raises(ValueError):
        fwd_tiles(128, 64, False)
    with pytest.raises(ValueError):
        fwd_tiles(160, 160, False)


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


def test_fwd_ptx_and_sass(sm100, tmp_path):
    dump = tmp_path / "dump"
    dump.mkdir()
    _lower(
        sm100,
        jnp.bfloat16,
        128,
        True,
        compile_options=f"--keep-ptx --keep-sass --dump-dir={dump}",
    )
    ptx_files = glob.glob(str(dump / "*.ptx"))
    assert ptx_files, "no PTX dumped"
    with open(ptx_files[0]) as f:
        ptx = f.read()
    for needle in (
        "tcgen05.mma",
        "tcgen05.alloc",
        "tcgen05.dealloc",
        "tcgen05.ld",
        "tcgen05.st",
        "tcgen05.commit",
        "setmaxnreg",
        "mbarrier.try_wait",
        "cp.async.bulk.tensor",
    ):
        assert needle in ptx, needle
    assert re.search(r"\.(reqntid|maxntid) 512\b", ptx), "kernel must launch 512 threads"
    # hdim 128: 8 k-blocks per MMA; S0, S1 first, then (PV, QK) x 2 per block, last PV x 2.
    assert _count(r"tcgen05\.mma\.", ptx) == 8 * 8
    assert _count(r"setmaxnreg\.(inc|dec)", ptx) == 3
    # Software exp2: the round-down add of the range reduction is there.
    assert "add.rm" in ptx

    sass_files = glob.glob(str(dump / "*.sass"))
    if not sass_files:
        pytest.skip("the DSL wrote no SASS (disassembler unavailable to it)")
    with open(sass_files[0]) as f:
        sass = f.read()
    assert re.search(r"UTC[A-Z]*MMA", sass), "no tcgen05 MMA in SASS"
    assert "LDTM" in sass and "STTM" in sass
    assert "USETMAXREG" in sass


# ------------------------------------------------------------- host model
# A numpy model of the per-row algorithm the kernel runs (same block order,
# kv_block_schedule, masking rule, lazy rescale, software exp2 split, 16-bit P,
# fp32 O and row sum, final 1/row_sum and LSE), checked against exact attention.
# It validates the algorithm and the schedule arithmetic on the CPU; the
# kernel's synchronisation is checked by reading (see sm100_fwd's docstring).


def _model_forward(q, k, v, causal, softmax_scale, sw_per_32, exp2_mod, schedule):
    """q (Sq, D), k (Sk, D), v (Sk, Dv) float32 -> (out (Sq, Dv), lse (Sq,), rescales)."""
    import ml_dtypes
    import numpy as np

    f32 = np.float32
    tm = tn = 128
    sq, sk = q.shape[0], k.shape[0]
    c = f32(softmax_scale * 1.4426950408889634)
    out = np.full((sq, v.shape[1]), np.nan, f32)
    lse = np.full(sq, np.nan, f32)
    rescales = 0

    def rows_of(a, start, n):
        block = np.zeros((n, a.shape[1]), f32)
        stop = min(start + n, a.shape[0])
        if stop > start:
            block[: stop - start] = a[start:stop]
        return block

    sw_cols = (np.arange(tn) % 32) >= 32 - sw_per_32
    for m in range(-(-sq // (2 * tm))):
        n_blocks, n_masked = schedule(m, sk, causal, 2 * tm, tn)
        for tile in range(2):
            row0 = m * 2 * tm + tile * tm
            rows = row0 + np.arange(tm)
            qt = rows_of(q, row0, tm)
            m_ref = np.full(tm, -np.inf, f32)
            l_sum = np.zeros(tm, f32)
            o = np.zeros((tm, v.shape[1]), f32)
            for t in range(n_blocks):
                nb = n_blocks - 1 - t
                kb, vb = rows_of(k, nb * tn, tn), rows_of(v, nb * tn, tn)
                s = (qt @ kb.T).astype(f32)
                if t < n_masked:
                    limit = np.full(tm, sk - nb * tn)
                    if causal:
                        limit = np.minimum(limit, rows + 1 - nb * tn)
                    s[np.arange(tn)[None, :] >= limit[:, None]] = -np.inf
                blk_max = s.max(axis=1)
                cand = np.maximum(m_ref, blk_max)
                with np.errstate(invalid="ignore"):
                    moved = (cand - m_ref) * c > f32(8.0)
                new_ref = np.where(moved, cand, m_ref)
                safe = np.where(new_ref == -np.inf, f32(0.0), new_ref).astype(f32)
                with np.errstate(invalid="ignore"):
                    o_scale = np.where(moved, np.exp2((m_ref - safe) * c), f32(1.0)).astype(f32)
                if t > 0:
                    rescales += int(np.any(o_scale != 1.0))
                x = (s * c + (-safe * c)[:, None]).astype(f32)
                p = np.exp2(x).astype(f32)
                p[:, sw_cols] = exp2_mod.exp2_poly_numpy(x[:, sw_cols])
                l_sum = (l_sum * o_scale + p.sum(axis=1, dtype=f32)).astype(f32)
                p16 = p.astype(ml_dtypes.bfloat16).astype(f32)
                o = (o * o_scale[:, None] + p16 @ vb).astype(f32)
                m_ref = new_ref
            empty = l_sum == 0
            inv = np.where(empty, f32(0.0), f32(1.0) / np.where(empty, 1, l_sum)).astype(f32)
            m_safe = np.where(m_ref == -np.inf, f32(0.0), m_ref)
            row_lse = np.where(
                empty, -np.inf, (m_safe * c + np.log2(np.where(empty, 1, l_sum))) * np.log(2.0)
            )
            valid = rows < sq
            out[rows[valid]] = (o * inv[:, None])[valid]
            lse[rows[valid]] = row_lse[valid]
    return out, lse, rescales


def _exact_attention(q, k, v, causal, softmax_scale):
    import numpy as np

    s = (q.astype(np.float64) @ k.astype(np.float64).T) * softmax_scale
    if causal:
        s = np.where(np.arange(k.shape[0])[None, :] <= np.arange(q.shape[0])[:, None], s, -np.inf)
    mx = s.max(axis=1, keepdims=True)
    e = np.exp(s - mx)
    den = e.sum(axis=1, keepdims=True)
    return (e / den) @ v.astype(np.float64), (mx + np.log(den))[:, 0]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (113, 203), (300, 40), (600, 700)])
def test_host_model_matches_attention(sm100, sq, sk, causal):
    import ml_dtypes
    import numpy as np

    from jax_fa4.kernels import exp2 as exp2_mod

    sm100_fwd = sm100[1]
    d = 64
    rng = np.random.default_rng(sq * 1000 + sk)

    def bf16(a):
        return a.astype(ml_dtypes.bfloat16).astype(np.float32)

    # Keys grow with their index reversed, so blocks processed later (lower
    # indices) raise the row max: exercises both lazy-rescale paths.
    ramp = np.linspace(3.0, 0.0, sk, dtype=np.float32)[:, None]
    q = bf16(rng.standard_normal((sq, d), dtype=np.float32) + 1.0)
    k = bf16(rng.standard_normal((sk, d), dtype=np.float32) + ramp)
    v = bf16(rng.standard_normal((sk, d), dtype=np.float32))
    scale = 1.0 / np.sqrt(d)
    tiles = sm100_fwd.fwd_tiles(d, d, causal)
    out, lse, _ = _model_forward(
        q, k, v, causal, scale, tiles.sw_exp2_per_32, exp2_mod, sm100_fwd.kv_block_schedule
    )
    ref_out, ref_lse = _exact_attention(q, k, v, causal, scale)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    assert np.max(np.abs(out - ref_out)) < 2e-2
    assert np.max(np.abs(lse - ref_lse)) < 1e-3


def test_host_model_rescales_when_max_moves(sm100):
    import numpy as np

    from jax_fa4.kernels import exp2 as exp2_mod

    sm100_fwd = sm100[1]
    sq = sk = 512
    d = 64
    rng = np.random.default_rng(7)
    u = np.full(d, 0.5, np.float32)  # a direction shared by every query
    q = rng.standard_normal((sq, d), dtype=np.float32) + u
    k = rng.standard_normal((sk, d), dtype=np.float32)
    # Block 0 (processed last) scores ~ 4 |u|^2 / sqrt(d) = 8 higher: > 8 log2 units.
    k[:128] += 4.0 * u
    v = rng.standard_normal((sk, d), dtype=np.float32)
    out, lse, rescales = _model_forward(
        q, k, v, False, 1.0 / np.sqrt(d), 8, exp2_mod, sm100_fwd.kv_block_schedule
    )
    ref_out, ref_lse = _exact_attention(q, k, v, False, 1.0 / np.sqrt(d))
    assert rescales > 0
    assert np.max(np.abs(out - ref_out)) < 2e-2
    assert np.max(np.abs(lse - ref_lse)) < 1e-3


def _wide_build(sm100, tmp_path, d: int, dv: int):
    """(the byte counts the load barriers expect, local-memory instructions or None
    where the DSL wrote no SASS) of the causal bf16 forward at head dims (d, dv)."""
    from kernel_compile import dump_options, read_dump

    sds = jax.ShapeDtypeStruct
    b, sq, sk, hq, hkv = 2, 300, 700, 4, 2
    ins = (sds((b, sq, hq, d), jnp.bfloat16), sds((b, sk, hkv, d), jnp.bfloat16),
           sds((b, sk, hkv, dv), jnp.bfloat16))
    outs = (sds((b, sq, hq, dv), jnp.bfloat16), sds((b, hq, sq), jnp.float32))
    lower(lambda: sm100[1].FlashFwdSm100(jnp.bfloat16, d, dv, True), "sm_100a", ins, outs,
          compile_options=dump_options(tmp_path))
    ptx = read_dump(tmp_path, "ptx")
    # The byte counts the mbarrier arrivals expect: registers set from immediates.
    expected = {re.escape(r) for r in re.findall(
        r"expect_tx\.shared\.b64 [^,]+, \[[^\]]+\], (%r\d+);", ptx)}
    tx = {int(v) for r, v in re.findall(r"mov\.b32\s+(%r\d+), (\d+);", ptx)
          if re.escape(r) in expected}
    sass = read_dump(tmp_path, "sass")
    return tx, None if sass is None else len(re.findall(r"\b(LDL|STL)\b", sass))


def test_deepseek_dims_forward(sm100, tmp_path):
    """(192, 128): V tiles take K-sized slots of the ring, and each V load expects its
    own 32 KiB (K and Q tiles 48 KiB); 2 ring stages; the MMA warp's 80 registers
    (with Q's descriptors rebuilt per block, Note [Descriptors per block]) and
    the softmax warps' 176 share the 64K, and the build keeps its local memory
    near the hdim-128 build's. Compiled, not run on hardware."""
    t = sm100[1].fwd_tiles(192, 128, True)
    assert (t.kv_stages, t.softmax_regs, t.correction_regs, t.other_regs) == (2, 176, 80, 80)
    assert 2 * t.softmax_regs + t.correction_regs + t.other_regs == 512
    tx, local = _wide_build(sm100, tmp_path, 192, 128)
    assert tx == {32768, 49152}, tx
    if local is None:
        pytest.skip("the DSL wrote no SASS (disassembler unavailable to it)")
    assert local <= 45


@pytest.mark.parametrize("d,q_tiles,tile_n,stages,tx_kv,tx_q,local_max", [
    (192, 2, 64, 5, 24576, 49152, 30), (256, 1, 64, 4, 32768, 65536, 10)])
def test_wide_head_dim_forward(sm100, tmp_path, d, q_tiles, tile_n, stages, tx_kv, tx_q,
                               local_max):
    """Head dims 192 and 256 (Dv = D). 192: O0 and O1 take 384 of the 512
    tensor-memory columns, so S0 and S1 take 64 each: 64-key blocks, 5 ring
    stages. 256: one 128-row Q tile per CTA (Note [One Q tile]), S0 and O0 in 320
    columns, 64-key blocks, 4 stages beside Q. Each load expects its own bytes (K
    / V, Q tiles). Compiled, not run on hardware."""
    t = sm100[1].fwd_tiles(d, d, False)
    assert (t.q_tiles, t.tile_m, t.tile_n, t.kv_stages) == (q_tiles, 128, tile_n, stages)
    assert q_tiles * (t.tile_n + d) <= 512
    assert 2 * t.softmax_regs + t.correction_regs + t.other_regs <= 512
    tx, local = _wide_build(sm100, tmp_path, d, d)
    assert tx == {tx_kv, tx_q}, tx
    if local is None:
        pytest.skip("the DSL wrote no SASS (disassembler unavailable to it)")
    assert local <= local_max
