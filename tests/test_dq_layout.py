"""The flat dQ accumulator order (Note [Flat dQ accumulator], kernels/dq_layout.py).

The host formula is what scripts/gpu_check_bwd.py uses to read the main kernel's
dQaccum; the kernels themselves never use it (the postprocess rebuilds the dQ
GEMM's register fragment instead). These tests pin the formula to the wgmma
accumulator layout: to the PTX ISA's documented fragment and, where the CuTe DSL is
installed, to the DSL's own partition of the backward's dQ tiled MMA.
"""

import importlib.util

import numpy as np
import pytest

from jax_fa4.kernels.dq_layout import flat_dq_rowcol, unflatten_dq_accum

# (tile_m, head_dim); 80 computes dQ^T (hdim 128, non-causal)
CONFIGS = [(64, 128), (128, 64), (64, 64), (128, 128), (80, 128)]


@pytest.mark.parametrize("tile_m,head_dim", CONFIGS)
def test_flat_order_is_a_permutation_of_the_block(tile_m, head_dim):
    rows, cols = flat_dq_rowcol(tile_m, head_dim)
    assert rows.min() == 0 and rows.max() == tile_m - 1
    assert cols.min() == 0 and cols.max() == head_dim - 1
    assert len(np.unique(rows * head_dim + cols)) == tile_m * head_dim


def test_flat_order_follows_the_wgmma_fragment():
    """PTX ISA, wgmma D fragment of a 64xN f32 accumulator: lane l of warp w holds
    (16 w + l / 4, 2 (l % 4)) and the next column, then the same 8 rows down, then
    the next 8 columns."""
    rows, cols = flat_dq_rowcol(64, 128)  # two warpgroups side by side along d
    at = {(int(r), int(c)): f for f, (r, c) in enumerate(zip(rows, cols))}
    # Thread 0, registers 0..3: (0,0) (0,1) (8,0) (8,1), one 16-byte chunk.
    assert [at[(0, 0)], at[(0, 1)], at[(8, 0)], at[(8, 1)]] == [0, 1, 2, 3]
    # Thread 1 holds columns 2, 3 of row 0: the next chunk.
    assert at[(0, 2)] == 4
    # Thread 4 starts row 1; thread 32 (warp 1) row 16.
    assert at[(1, 0)] == 16 and at[(16, 0)] == 128
    # Registers 4..7 of thread 0 are columns 8, 9: one 128-thread stride on.
    assert at[(0, 8)] == 512
    # Warpgroup 1 owns columns 64..127 and the second half of the block.
    assert at[(0, 64)] == 64 * 64
    rows, cols = flat_dq_rowcol(128, 64)  # two warpgroups stacked along m
    assert (rows[64 * 64], cols[64 * 64]) == (64, 0)


def test_flat_order_of_the_transposed_dq():
    """80-row tiles hold dQ^T = K^T dS^T: the fragment's rows are dQ's columns (d),
    its columns dQ's rows (queries); warpgroup w owns d in [64 w, 64 w + 64)."""
    rows, cols = flat_dq_rowcol(80, 128)
    at = {(int(r), int(c)): f for f, (r, c) in enumerate(zip(rows, cols))}
    # Thread 0, registers 0..3: dQ^T (0,0) (0,1) (8,0) (8,1) = dQ (0,0) (1,0) (0,8) (1,8).
    assert [at[(0, 0)], at[(1, 0)], at[(0, 8)], at[(1, 8)]] == [0, 1, 2, 3]
    assert at[(2, 0)] == 4 and at[(0, 1)] == 16 and at[(8, 0)] == 512
    assert at[(0, 64)] == 64 * 80  # warpgroup 1


@pytest.mark.parametrize("tile_m,head_dim", CONFIGS)
def test_unflatten_inverts_the_order(tile_m, head_dim):
    rng = np.random.default_rng(0)
    b, h, s_pad = 2, 3, 640
    dense = rng.standard_normal((b, h, s_pad, head_dim)).astype(np.float32)
    rows, cols = flat_dq_rowcol(tile_m, head_dim)
    blocks = dense.reshape(b, h, s_pad // tile_m, tile_m, head_dim)
    flat = blocks[:, :, :, rows, cols].reshape(dense.shape)
    assert not np.array_equal(flat, dense)
    np.testing.assert_array_equal(unflatten_dq_accum(flat, tile_m), dense)


def test_unflatten_keeps_the_rows_past_the_last_80_row_tile():
    """Sq = 4096 with 80-row tiles: Sq_pad = 4224 (seqlen_q_padded) holds 52 whole
    tiles and 64 padding rows, which stay where they are."""
    from jax_fa4.kernels.bwd_preprocess import seqlen_q_padded

    s_pad = seqlen_q_padded(4096, 80)
    assert s_pad == 4224 and s_pad % 128 == 0 and s_pad >= 52 * 80
    rng = np.random.default_rng(1)
    dense = rng.standard_normal((1, 1, s_pad, 128)).astype(np.float32)
    rows, cols = flat_dq_rowcol(80, 128)
    flat = dense.copy()
    tiles = dense[0, 0, :52 * 80].reshape(52, 80, 128)
    flat[0, 0, :52 * 80] = tiles[:, rows, cols].reshape(-1, 128)
    np.testing.assert_array_equal(unflatten_dq_accum(flat, 80), dense)


@pytest.mark.parametrize("seqlen", [1, 80, 113, 128, 1000, 1024, 4096, 4097, 16384])
def test_padded_rows_cover_whole_query_tiles(seqlen):
    from jax_fa4.kernels.bwd_preprocess import SEQLEN_Q_PAD, seqlen_q_padded

    plain = seqlen_q_padded(seqlen)
    assert plain == -(-seqlen // SEQLEN_Q_PAD) * SEQLEN_Q_PAD
    assert seqlen_q_padded(seqlen, 64) == seqlen_q_padded(seqlen, 128) == plain
    odd = seqlen_q_padded(seqlen, 80)
    assert odd % SEQLEN_Q_PAD == 0 and odd >= -(-seqlen // 80) * 80
    assert odd - plain in (0, SEQLEN_Q_PAD)  # at most one more 128-row block


def test_rejects_tiles_without_whole_atoms():
    with pytest.raises(ValueError):
        flat_dq_rowcol(80, 64)
    with pytest.raises(ValueError):
        flat_dq_rowcol(64, 100)


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                    reason="nvidia-cutlass-dsl not installed")
@pytest.mark.parametrize("tile_m,head_dim", [(64, 128), (128, 64), (80, 128)])
@pytest.mark.filterwarnings("ignore:This static loop")
def test_flat_order_matches_the_dsl_partition(tile_m, head_dim):
    """Trace the backward's dQ tiled MMA: register v of MMA thread t must hold the
    element the flat formula puts at w P + (v // 4) 512 + 4 (t % 128) + v % 4, the
    spot that thread's 128-bit store writes."""
    import cutlass
    import cutlass.cute as cute

    from jax_fa4.ffi.bridge import pinned_arch
    from jax_fa4.kernels.sm90_bwd_common import dq_mma_shape, dq_tiled_mma

    found = {}
    mn = dq_mma_shape(tile_m, head_dim)  # (head_dim, tile_m) for dQ^T

    @cute.jit
    def walk():
        mma = dq_tiled_mma(cutlass.BFloat16, tile_m, head_dim)
        ident = cute.make_identity_tensor(mn)
        for t in cutlass.range_constexpr(256):
            thr = mma.get_slice(t)
            coords = thr.partition_C(ident)
            n = cute.size(thr.partition_shape_C(mn))
            for v in cutlass.range_constexpr(n):
                found[(t, v)] = coords[v]

    with pinned_arch("sm_90a"):
        walk()
    rows, cols = flat_dq_rowcol(tile_m, head_dim)
    per_thread = tile_m * head_dim // 256
    assert len(found) == 256 * per_thread
    for (t, v), (r, c) in found.items():
        w, tl = divmod(t, 128)
        f = w * tile_m * head_dim // 2 + (v // 4) * 512 + 4 * tl + v % 4
        if mn[0] != tile_m:  # dQ^T: (row, col) of the fragment = (col, row) of dQ
            r, c = c, r
        assert (int(r), int(c)) == (rows[f], cols[f]), (t, v)
