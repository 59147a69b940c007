"""The layouts of kernels/dq_layout.py: the flat dQ accumulator order (Note [Flat dQ
accumulator]) and the deterministic backwards' order of dQ adds.

The flat formula is for host-side checks; the kernels never use it (the
postprocess rebuilds the dQ GEMM's register fragment instead). These tests pin it
to the wgmma accumulator layout: to the PTX ISA's documented fragment and, where
the CuTe DSL is installed, to the DSL's own partition of the backward's dQ tiled
MMA.
"""

import importlib.util

import numpy as np
import pytest

from jax_fa4.kernels.dq_layout import (
    det_add_rank,
    det_key_block,
    flat_dq_rowcol,
    unflatten_dq_accum,
)

# (tile_m, head_dim)
CONFIGS = [(64, 128), (128, 64), (64, 64), (128, 128), (64, 96), (64, 192), (64, 256)]


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


def test_rejects_tiles_without_whole_atoms():
    with pytest.raises(ValueError):
        flat_dq_rowcol(80, 128)
    with pytest.raises(ValueError):
        flat_dq_rowcol(64, 100)


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                    reason="nvidia-cutlass-dsl not installed")
@pytest.mark.parametrize("tile_m,head_dim,wide", [(64, 128, False), (128, 64, False),
                                                  (64, 192, True), (64, 256, True)])
@pytest.mark.filterwarnings("ignore:This static loop")
def test_flat_order_matches_the_dsl_partition(tile_m, head_dim, wide):
    """Trace the backward's dQ tiled MMA (the wide kernel's own at 192 / 256, Note
    [Wide dQ hand-off]): register v of MMA thread t must hold the element the flat
    formula puts at w P + (v // 4) 512 + 4 (t % 128) + v % 4, the spot that
    thread's 128-bit store writes and the postprocess's namesake thread reads."""
    import cutlass
    import cutlass.cute as cute

    from jax_fa4.ffi.bridge import pinned_arch
    from jax_fa4.kernels.sm90_bwd_common import dq_tiled_mma

    found = {}
    mn = (tile_m, head_dim)

    @cute.jit
    def walk():
        if cutlass.const_expr(wide):
            from jax_fa4.kernels.sm90_bwd_wide import FlashBwdSm90Wide

            mma = FlashBwdSm90Wide(cutlass.BFloat16, head_dim)._tiled_mmas()[3]
            assert FlashBwdSm90Wide.tile_m == tile_m
        else:
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
        assert (int(r), int(c)) == (rows[f], cols[f]), (t, v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (113, 203), (1000, 1000), (4096, 4096), (777, 1500),
                                   (2000, 129)])
@pytest.mark.parametrize("tile_m", [64, 128])
def test_deterministic_order_is_a_deadlock_free_permutation(causal, sq, sk, tile_m):
    """The deterministic backward's order (det_key_block, det_add_rank, the
    functions the kernels call): for every query block the key blocks reaching it
    take ranks 0..count-1 exactly once, so every spin ends and every partial is
    added once; a CTA waits (rank > 0) only on the key block one rank earlier,
    which launches earlier (lower blockIdx.x); and, causal, that block reached the
    query block in fewer steps of its own walk, so it is not behind."""
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
