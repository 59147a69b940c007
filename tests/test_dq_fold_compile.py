"""The backward that writes dQ in its main kernel (Note [dQ fold]), on the CPU.

On sm_90a at head dims 64 and 128 the non-deterministic main kernel can count, per
query block, the key blocks whose dQ partials have landed; the one that completes
the count converts the block to dQ, so no postprocess runs. The tile table has it
off (measured 0.89-0.93x on the H200, docs/performance.md, twenty-second session);
JAX_FA4_DQ_FOLD=N turns it on with lag N. These tests check the keys and kernel
objects that ask for it, the refusals, the SASS (bulk loads of the staged block,
one acquire-release count, 32-bit dQ stores, no spills) and how the lowering wires
the semaphores and the dQ result. The GPU tests run it (test_gpu.py:
test_backward_dq_fold).
"""

import dataclasses
import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import pytest
from kernel_compile import bwd_structs, dump_options, dumped_sass, lower

from jax_fa4.config import (
    DQ_FIRST_MAX_SQ_ENV,
    DQ_FOLD_ENV,
    DQ_STORE_FIRST_ENV,
    AttentionConfig,
    dq_fold_override,
)
from jax_fa4.rules import kernels_cuda

needs_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed"
)


def _key(kind: str, arch: str, head_dim: int = 128, causal: bool = True):
    q = jax.ShapeDtypeStruct((1, 8, 2, head_dim), jnp.bfloat16)
    return kernels_cuda._key(kind, arch, q, q, AttentionConfig(scale=0.1, causal=causal))


@pytest.fixture
def clean_env(monkeypatch):
    for name in (DQ_FOLD_ENV, DQ_STORE_FIRST_ENV, DQ_FIRST_MAX_SQ_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@needs_cutlass
def test_the_keys_follow_the_table_and_the_switch(clean_env):
    """Unset, the table decides (off); JAX_FA4_DQ_FOLD=N gives the non-deterministic
    sm90 main key at head dims 64 / 128 lag N, and its preprocess key follows; the
    deterministic kernel, sm_100a, hdim 256 and the other kernels never fold; store
    first wins. Bad values raise."""
    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90, FlashBwdSm90Fold, bwd_tiles

    assert all(bwd_tiles(d, c).dq_fold == 0 for d in (64, 128) for c in (False, True))
    assert dq_fold_override("sm_90a", 128) is None
    assert _key("bwd", "sm_90a").dq_fold == 0
    assert type(kernels_cuda._bwd_kernel(_key("bwd", "sm_90a"))) is FlashBwdSm90
    for lag in ("1", "3"):
        clean_env.setenv(DQ_FOLD_ENV, lag)
        for d in (64, 128):
            for causal in (False, True):
                main = _key("bwd", "sm_90a", d, causal)
                assert main.dq_fold == int(lag), (d, causal)
                pre = kernels_cuda._key("bwd_pre", "sm_90a",
                                        jax.ShapeDtypeStruct((1, 8, 2, d), jnp.bfloat16),
                                        jax.ShapeDtypeStruct((1, 8, 2, d), jnp.bfloat16),
                                        AttentionConfig(scale=1.0, causal=causal),
                                        (False, 0), main.dq_fold)
                p = kernels_cuda._pre_kernel(pre)
                assert (p.zero_dq, p.sem_tile_m) == (True, bwd_tiles(d, causal).tile_m)
                k = kernels_cuda._bwd_kernel(main)
                assert type(k) is FlashBwdSm90Fold and k.dq_fold == int(lag)
                assert _key("bwd_det", "sm_90a", d, causal).dq_fold == 0
                assert _key("bwd", "sm_100a", d, causal).dq_fold == 0
                for kind in ("bwd_pre", "bwd_post", "fwd"):
                    assert _key(kind, "sm_90a", d, causal).dq_fold == 0
        assert _key("bwd", "sm_90a", 256).dq_fold == 0
    # Keys differ, so the caches keep the builds apart.
    assert _key("bwd", "sm_90a") != dataclasses.replace(_key("bwd", "sm_90a"), dq_fold=2)
    clean_env.setenv(DQ_STORE_FIRST_ENV, "1")  # store first wins
    main = _key("bwd", "sm_90a")
    assert main.dq_store_first and main.dq_fold == 0
    clean_env.delenv(DQ_STORE_FIRST_ENV)
    for bad in ("9", "-1", "yes"):
        clean_env.setenv(DQ_FOLD_ENV, bad)
        with pytest.raises(ValueError, match=DQ_FOLD_ENV):
            _key("bwd", "sm_90a")


@needs_cutlass
def test_refusals():
    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90, FlashBwdSm90Fold, bwd_tiles

    t = bwd_tiles(128, True)
    with pytest.raises(ValueError, match="lag"):
        FlashBwdSm90Fold(cutlass.BFloat16, 128, 128, True, 0.1, dq_fold=0)
    with pytest.raises(ValueError, match="lag"):
        FlashBwdSm90(cutlass.BFloat16, 128, 128, True, 0.1, dq_fold=9)
    for kw in ({"deterministic": True}, {"dq_store_first": True},
               {"tiles": dataclasses.replace(t, dq_flat=False)},
               {"tiles": dataclasses.replace(t, persistent=True)},
               {"tiles": dataclasses.replace(t, tile_m=80)}):
        with pytest.raises(ValueError, match="dq_fold"):
            FlashBwdSm90(cutlass.BFloat16, 128, 128, True, 0.1, dq_fold=1, **kw)


def _fold_sass(tmp_path, head_dim: int, causal: bool, lag: int) -> str:
    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90Fold, bwd_tiles

    b, sq, sk, hq, hkv = 2, 113, 203, 4, 1
    ins, outs, _ = bwd_structs(b, sq, sk, hq, hkv, head_dim, jnp.bfloat16)
    tile_m = bwd_tiles(head_dim, causal).tile_m
    sem = jax.ShapeDtypeStruct((b, hq, -(-sq // tile_m)), jnp.int32)
    dq = jax.ShapeDtypeStruct((b, sq, hq, head_dim), jnp.bfloat16)
    make = functools.partial(FlashBwdSm90Fold, cutlass.BFloat16, head_dim, head_dim, causal,
                             head_dim**-0.5, dq_fold=lag)
    lower(make, "sm_90a", ins + (sem,), outs + (sem, dq), {6: 0, 7: 3},
          compile_options=dump_options(tmp_path))
    return dumped_sass(tmp_path)


@needs_cutlass
@pytest.mark.parametrize("head_dim,causal,lag", [(128, True, 1), (64, False, 3)])
def test_fold_kernel_sass(tmp_path, head_dim, causal, lag):
    """The staged block arrives by 1-D bulk loads (one per piece: 2 at hdim 64,
    whose tile_m 128 leaves SMEM for half a block), the count is one GPU-scope
    acquire-release atomic add, each converter lane writes 2 x 16 packed dQ words
    per piece row group (32-bit STG, 32 in all), and nothing spills (the converter
    runs in 24 registers). The dQ warp waits for the bulk adds lag items back."""
    sass = _fold_sass(tmp_path, head_dim, causal, lag)
    pieces = 2 if head_dim == 64 else 1
    assert len(re.findall(r"\bUBLKCP\.S\.G\b", sass)) == pieces
    assert len(re.findall(r"\bUBLKRED\.G\.S\.ADD\.F32", sass)) == 2  # the two dQ parts
    assert len(re.findall(r"\bATOMG\.E\.ADD\.STRONG\.GPU\b", sass)) == 1
    assert "MEMBAR.ALL.GPU" in sass  # the count's release
    assert len(re.findall(r"\bSTG\.E\s", sass)) == 32
    assert len(re.findall(r"F2FP\.BF16\.F32\.PACK_AB", sass)) >= 32
    assert not re.search(r"\b(LDL|STL)\b", sass), "the fold kernel spills"
    assert re.search(rf"DEPBAR\.LE SB0, {hex(2 * lag)}\b", sass), "no wait lag items back"
    # One global proxy fence per staged load (warp 3); none on the dQ warp, whose
    # observed completions already imply it (Note [dQ fold]).
    assert sass.count("FENCE.VIEW.ASYNC.G") == pieces


@needs_cutlass
def test_the_lowering_wires_the_fold(clean_env):
    """Through the public API (the backward lowered for cuda on this CPU machine),
    with JAX_FA4_DQ_FOLD=1: forward, preprocess and main kernel only; the
    preprocess's 4th result (int32 semaphores) is the main kernel's 8th operand, and
    the main kernel's 5th result, dQ in q's layout, is the gradient. Off: four
    custom calls, the last one producing dQ."""
    import jax_fa4

    def calls():
        q = jax.ShapeDtypeStruct((2, 203, 4, 128), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((2, 113, 2, 128), jnp.bfloat16)

        def loss(q, k, v):
            out = jax_fa4.attention(q, k, v, causal=True, implementation="cute")
            return jnp.sum(out.astype(jnp.float32))

        text = (jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k)
                .lower(lowering_platforms=("cuda",)).as_text())
        return [ln for ln in text.splitlines() if "stablehlo.custom_call" in ln]

    dq_t = "tensor<2x203x4x128xbf16>"
    clean_env.setenv(DQ_FOLD_ENV, "1")
    on = calls()
    assert len(on) == 3, on
    pre, main = on[1], on[2]
    assert "tensor<2x4x4xi32>" in pre.split("-> (")[-1]
    name = re.match(r"\s*(%\w+):4 = ", pre).group(1)
    operands = re.search(r"custom_call @\w+\(([^)]*)\)", main).group(1).split(", ")
    assert len(operands) == 8 and operands[7] == f"{name}#3", operands
    results = main.split("-> (")[-1]
    assert results.count("tensor<") == 5 and results.rstrip(")").endswith(dq_t), results
    clean_env.setenv(DQ_FOLD_ENV, "0")
    off = calls()
    assert len(off) == 4 and off[3].rstrip().endswith(f"-> {dq_t}"), off[3][-200:]
