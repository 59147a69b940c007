"""The backward without a zeroed dQ accumulator (Note [dQ store first]), on the CPU.

On sm_90a at head dims 64 and 128 the main kernel can store each query block's first
dQ partial with a plain bulk copy and add the rest, ordered by per-query-block
semaphores, so the preprocess zeroes those semaphores instead of dQaccum. The tile
table has it off everywhere (measured slower beyond 1k tokens on the H200,
docs/performance.md, twentieth session); JAX_FA4_DQ_STORE_FIRST=1 turns it on. These
tests check which compile keys and kernel objects ask for it, the SASS of both
kernels (bulk copy and bulk reduce in the main kernel; no 128-bit zeroing stores in
the preprocess), and how the lowering wires the semaphores from one kernel to the
next. The GPU tests run it (test_gpu.py: test_backward_dq_store_first_on_poison).
"""

import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import pytest
from kernel_compile import bwd_structs, dump_options, dumped_sass, lower

from jax_fa4.config import (
    DQ_FIRST_MAX_SQ_ENV,
    DQ_STORE_FIRST_ENV,
    AttentionConfig,
    dq_first_max_sq_override,
    dq_store_first_override,
)
from jax_fa4.rules import kernels_cuda

needs_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed"
)

BULK_COPY, BULK_REDUCE = re.compile(r"\bUBLKCP\b"), re.compile(r"\bUBLKRED\b")
STG128 = re.compile(r"\bSTG\.E\.(?:EL\.)?128\b")


def _key(kind: str, arch: str, head_dim: int = 128, causal: bool = False, store_first=None):
    """store_first: a main key (its choice, as backward() passes it on) or None."""
    q = jax.ShapeDtypeStruct((1, 8, 2, head_dim), jnp.bfloat16)
    if store_first is not None:
        store_first = (store_first.dq_store_first, store_first.dq_first_max_sq)
    return kernels_cuda._key(kind, arch, q, q, AttentionConfig(scale=0.1, causal=causal),
                             store_first)


@needs_cutlass
def test_the_keys_follow_the_tile_table_and_the_switch(monkeypatch):
    """Unset, the sm90 tile table decides (off everywhere since the twentieth
    session); JAX_FA4_DQ_STORE_FIRST=1 / 0 turns it on / off at head dims 64 / 128
    on sm_90a, never elsewhere. Keys differ, so the caches keep both builds apart."""
    from jax_fa4.kernels.sm90_bwd import bwd_tiles

    for env in (None, "1", "0"):
        if env is None:
            monkeypatch.delenv(DQ_STORE_FIRST_ENV, raising=False)
        else:
            monkeypatch.setenv(DQ_STORE_FIRST_ENV, env)
        for d in (64, 128):
            assert dq_store_first_override("sm_90a", d) == {None: None, "1": True,
                                                            "0": False}[env]
            assert dq_store_first_override("sm_100a", d) is False
            for causal in (False, True):
                want = bwd_tiles(d, causal).dq_store_first if env is None else env == "1"
                for kind in ("bwd", "bwd_det"):
                    assert _key(kind, "sm_90a", d, causal).dq_store_first == want, (kind, d)
                    assert not _key(kind, "sm_100a", d, causal).dq_store_first, (kind, d)
                # The preprocess follows the main kernel's key (backward() passes it
                # on); the postprocess and the forward are the same either way.
                for kind in ("bwd_pre", "bwd_pre_by_thread", "bwd_post", "fwd"):
                    assert not _key(kind, "sm_90a", d, causal).dq_store_first, (kind, d)
        assert not _key("bwd", "sm_90a", 256).dq_store_first  # row-major accumulator
    monkeypatch.setenv(DQ_STORE_FIRST_ENV, "0")
    off = _key("bwd", "sm_90a", 128, True)
    monkeypatch.setenv(DQ_STORE_FIRST_ENV, "1")
    assert off != _key("bwd", "sm_90a", 128, True)


@needs_cutlass
@pytest.mark.parametrize("d,causal", [(128, True), (128, False), (64, False), (64, True)])
def test_the_factories_build_the_matching_pair(monkeypatch, d, causal):
    """The preprocess zeroes exactly the semaphores the main kernel uses (its query
    tile), and leaves dQaccum alone; with the switch off, both are as before."""
    from jax_fa4.kernels.sm90_bwd import (
        FlashBwdSm90,
        FlashBwdSm90Deterministic,
        FlashBwdSm90StoreFirst,
        bwd_tiles,
    )

    monkeypatch.setenv(DQ_STORE_FIRST_ENV, "1")
    main_key = _key("bwd", "sm_90a", d, causal)
    pre = kernels_cuda._pre_kernel(_key("bwd_pre", "sm_90a", d, causal, main_key))
    main = kernels_cuda._bwd_kernel(main_key)
    det = kernels_cuda._bwd_kernel(_key("bwd_det", "sm_90a", d, causal))
    assert (pre.zero_dq, pre.sem_tile_m) == (False, bwd_tiles(d, causal).tile_m)
    assert type(main) is FlashBwdSm90StoreFirst and main.dq_store_first
    assert main.takes_dq_semaphores and main.tile_m == pre.sem_tile_m
    assert type(det) is FlashBwdSm90Deterministic and det.dq_store_first
    monkeypatch.setenv(DQ_STORE_FIRST_ENV, "0")
    main_key = _key("bwd", "sm_90a", d, causal)
    pre = kernels_cuda._pre_kernel(_key("bwd_pre", "sm_90a", d, causal, main_key))
    main = kernels_cuda._bwd_kernel(main_key)
    det = kernels_cuda._bwd_kernel(_key("bwd_det", "sm_90a", d, causal))
    assert (pre.zero_dq, pre.sem_tile_m) == (True, None)
    assert type(main) is FlashBwdSm90 and not main.dq_store_first
    assert not det.dq_store_first


@needs_cutlass
def test_store_first_needs_the_flat_accumulator_and_a_cta_per_key_block():
    import dataclasses

    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90StoreFirst, bwd_tiles

    t = bwd_tiles(128, False)
    for bad in (dataclasses.replace(t, dq_flat=False), dataclasses.replace(t, persistent=True)):
        with pytest.raises(ValueError, match="dq_store_first"):
            FlashBwdSm90StoreFirst(cutlass.BFloat16, 128, 128, False, 0.1, tiles=bad)


def _main_sass(tmp_path, cls_name: str, head_dim: int, causal: bool) -> str:
    import cutlass

    from jax_fa4.kernels import sm90_bwd

    cls = getattr(sm90_bwd, cls_name)
    ins, outs, aliases = bwd_structs(2, 113, 203, 4, 1, head_dim, jnp.bfloat16)
    if getattr(cls, "takes_dq_semaphores", False):
        tile_m = sm90_bwd.bwd_tiles(head_dim, causal).tile_m
        sem = jax.ShapeDtypeStruct((2, 4, -(-113 // tile_m)), jnp.int32)
        ins, outs, aliases = ins + (sem,), outs + (sem,), {6: 0, 7: 3}
    make = functools.partial(cls, cutlass.BFloat16, head_dim, head_dim, causal, head_dim**-0.5)
    lower(make, "sm_90a", ins, outs, aliases, compile_options=dump_options(tmp_path))
    return dumped_sass(tmp_path)


@needs_cutlass
@pytest.mark.parametrize("cls_name,head_dim,causal", [
    ("FlashBwdSm90StoreFirst", 128, True),
    ("FlashBwdSm90StoreFirst", 64, False),
    ("FlashBwdSm90", 128, True),
])
def test_main_kernel_stores_and_adds(tmp_path, cls_name, head_dim, causal):
    """The store-first kernel has both a plain bulk copy (the first partial) and a
    bulk reduce-add (the others) per dQ part, and one ticket atomic; the default has
    only reduce-adds. The semaphore's atomics (ticket, publish) are ATOMG / RED."""
    sass = _main_sass(tmp_path, cls_name, head_dim, causal)
    copies, reduces = len(BULK_COPY.findall(sass)), len(BULK_REDUCE.findall(sass))
    assert reduces >= 1, "no bulk reduce-add in the SASS (pattern broken?)"
    if cls_name == "FlashBwdSm90StoreFirst":
        assert copies >= 1, "no plain bulk copy of the first dQ partial"
        assert re.search(r"\b(ATOMG|ATOM)\.E\.ADD", sass), "no ticket atomic add"
    else:
        assert copies == 0, f"{copies} plain bulk copies in the add-only kernel"


@needs_cutlass
def test_deterministic_main_kernel_stores_rank_zero(tmp_path):
    """The deterministic kernel with dq_store_first: a bulk copy beside the reduce."""
    import cutlass

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90Deterministic, bwd_tiles

    ins, outs, _ = bwd_structs(2, 113, 203, 4, 1, 128, jnp.bfloat16)
    tile_m = bwd_tiles(128, True).tile_m
    sem = jax.ShapeDtypeStruct((2, 4, -(-113 // tile_m)), jnp.int32)
    make = functools.partial(FlashBwdSm90Deterministic, cutlass.BFloat16, 128, 128, True,
                             128**-0.5, dq_store_first=True)
    lower(make, "sm_90a", ins + (sem,), outs + (sem,), {6: 0, 7: 3},
          compile_options=dump_options(tmp_path))
    sass = dumped_sass(tmp_path)
    assert BULK_COPY.search(sass) and BULK_REDUCE.search(sass)


def _pre_sass(tmp_path, zero_dq: bool, sem_tile_m, zero_dq_above: int = 0):
    from jax_fa4.kernels.bwd_preprocess import FlashBwdPreprocess, bwd_workspace_shapes

    b, s, h, d = 2, 203, 3, 128
    ws = bwd_workspace_shapes(b, s, h, d)
    o = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((b, h, s), jnp.float32)
    outs = tuple(jax.ShapeDtypeStruct(*ws[k]) for k in ("Dpsum", "LSElog2", "dQaccum"))
    if sem_tile_m is not None:
        outs += (jax.ShapeDtypeStruct((b, h, -(-s // sem_tile_m)), jnp.int32),)
    lower(lambda: FlashBwdPreprocess(jnp.bfloat16, d, d, zero_dq=zero_dq,
                                     sem_tile_m=sem_tile_m, zero_dq_above=zero_dq_above),
          "sm_90a", (o, o, lse, lse), outs, compile_options=dump_options(tmp_path))
    return dumped_sass(tmp_path)


@needs_cutlass
def test_preprocess_zeroes_the_semaphores_not_the_accumulator(tmp_path):
    """Default: 8 128-bit zeroing stores per thread (64 rows x 128 floats over 256
    threads). Store first: none, and one more 32-bit store (the semaphore)."""
    zeroing = _pre_sass(tmp_path / "zero", True, None)
    first = _pre_sass(tmp_path / "first", False, 64)
    assert len(STG128.findall(zeroing)) == 8, STG128.findall(zeroing)
    assert len(STG128.findall(first)) == 0, STG128.findall(first)
    stg32 = re.compile(r"\bSTG\.E(?:\.STRONG\.\w+)?\s")
    assert len(stg32.findall(first)) == len(stg32.findall(zeroing)) + 1


@needs_cutlass
def test_preprocess_semaphore_tile_must_be_positive():
    from jax_fa4.kernels.bwd_preprocess import FlashBwdPreprocess

    with pytest.raises(ValueError, match="sem_tile_m"):
        FlashBwdPreprocess(jnp.bfloat16, 128, 128, zero_dq=False, sem_tile_m=0)


@needs_cutlass
@pytest.mark.parametrize("deterministic", [False, True])
def test_the_lowering_passes_the_semaphores_from_pre_to_main(monkeypatch, deterministic):
    """Through the public API (the backward lowered for cuda on this CPU machine):
    the preprocess custom call has a 4th, int32 result, which is the main kernel's
    8th operand; no XLA zero-fill feeds the main kernel. With the switch off the
    deterministic backward gets an XLA zero instead and the default none. Store first
    by length ($JAX_FA4_DQ_FIRST_MAX_SQ) is wired as store first, deterministic
    excepted."""
    import jax_fa4

    def hlo():
        q = jax.ShapeDtypeStruct((2, 203, 4, 128), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((2, 113, 2, 128), jnp.bfloat16)

        def loss(q, k, v):
            out = jax_fa4.attention(q, k, v, causal=True, implementation="cute",
                                    deterministic=deterministic)
            return jnp.sum(out.astype(jnp.float32))

        return (jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k)
                .lower(lowering_platforms=("cuda",)).as_text())

    def calls(text):
        return [ln for ln in text.splitlines() if "stablehlo.custom_call" in ln]

    sem_t = "tensor<2x4x4xi32>"  # (B, Hq, ceil(203 / 64))

    def check_wired(on):
        # forward, preprocess, main, postprocess
        assert len(on) == 4, on
        pre, main = on[1], on[2]
        assert sem_t in pre.split("-> (")[-1], pre[-300:]
        # The main kernel's 8th (last) operand is the preprocess's 4th result.
        name = re.match(r"\s*(%\w+):4 = ", pre).group(1)
        operands = re.search(r"custom_call @\w+\(([^)]*)\)", main).group(1).split(", ")
        assert len(operands) == 8 and operands[7] == f"{name}#3", operands

    def check_apart(off):
        assert sem_t not in off[1], off[1]
        assert (sem_t in off[2]) == deterministic, off[2]

    monkeypatch.delenv(DQ_FIRST_MAX_SQ_ENV, raising=False)
    monkeypatch.setenv(DQ_STORE_FIRST_ENV, "1")
    check_wired(calls(hlo()))
    monkeypatch.setenv(DQ_STORE_FIRST_ENV, "0")
    check_apart(calls(hlo()))
    # Store first by length: wired like store first; the deterministic backward
    # stays add-only (Note [dQ store first by length]).
    monkeypatch.delenv(DQ_STORE_FIRST_ENV)
    monkeypatch.setenv(DQ_FIRST_MAX_SQ_ENV, "2048")
    (check_apart if deterministic else check_wired)(calls(hlo()))


@needs_cutlass
def test_store_first_by_length_keys(monkeypatch):
    """Note [dQ store first by length]: $JAX_FA4_DQ_FIRST_MAX_SQ=N makes the
    non-deterministic sm90 main kernel (and its preprocess, which follows it) a
    store-first build with N in its key; the deterministic one stays add-only.
    $JAX_FA4_DQ_STORE_FIRST wins over it. Bad values raise."""
    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90StoreFirst, bwd_tiles

    monkeypatch.delenv(DQ_STORE_FIRST_ENV, raising=False)
    monkeypatch.delenv(DQ_FIRST_MAX_SQ_ENV, raising=False)
    assert dq_first_max_sq_override() is None
    assert all(bwd_tiles(d, c).dq_first_max_seqlen_q == 0 for d in (64, 128)
               for c in (False, True))
    monkeypatch.setenv(DQ_FIRST_MAX_SQ_ENV, "2048")
    for d in (64, 128):
        main_key = _key("bwd", "sm_90a", d, True)
        assert (main_key.dq_store_first, main_key.dq_first_max_sq) == (True, 2048)
        pre_key = _key("bwd_pre", "sm_90a", d, True, main_key)
        assert (pre_key.dq_store_first, pre_key.dq_first_max_sq) == (True, 2048)
        pre = kernels_cuda._pre_kernel(pre_key)
        assert (pre.zero_dq, pre.zero_dq_above, pre.sem_tile_m) == (
            False, 2048, bwd_tiles(d, True).tile_m)
        main = kernels_cuda._bwd_kernel(main_key)
        assert type(main) is FlashBwdSm90StoreFirst and main.dq_first_max_sq == 2048
        assert main.dq_bufs == 2
        det = _key("bwd_det", "sm_90a", d, True)
        assert (det.dq_store_first, det.dq_first_max_sq) == (False, 0)
        assert not _key("bwd", "sm_100a", d, True).dq_store_first
    monkeypatch.setenv(DQ_STORE_FIRST_ENV, "1")
    assert (_key("bwd", "sm_90a", 128, True).dq_first_max_sq) == 0
    monkeypatch.setenv(DQ_STORE_FIRST_ENV, "0")
    assert not _key("bwd", "sm_90a", 128, True).dq_store_first
    monkeypatch.delenv(DQ_STORE_FIRST_ENV)
    for bad in ("0", "-3", "x"):
        monkeypatch.setenv(DQ_FIRST_MAX_SQ_ENV, bad)
        with pytest.raises(ValueError, match=DQ_FIRST_MAX_SQ_ENV):
            _key("bwd", "sm_90a", 128, True)


@needs_cutlass
def test_store_first_by_length_refusals():
    import cutlass

    from jax_fa4.kernels.bwd_preprocess import FlashBwdPreprocess
    from jax_fa4.kernels.dq_layout import dq_first_by_length
    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90, FlashBwdSm90Deterministic

    assert dq_first_by_length(32, 64, 2048) and not dq_first_by_length(33, 64, 2048)
    with pytest.raises(ValueError, match="dq_first_max_seqlen_q"):
        FlashBwdSm90(cutlass.BFloat16, 128, 128, True, 0.1, dq_first_max_seqlen_q=2048)
    with pytest.raises(ValueError, match="dq_first_max_seqlen_q"):
        FlashBwdSm90Deterministic(cutlass.BFloat16, 128, 128, True, 0.1, dq_store_first=True,
                                  dq_first_max_seqlen_q=2048)
    for kw in ({"zero_dq": True, "sem_tile_m": 64}, {"zero_dq": False}):
        with pytest.raises(ValueError, match="zero_dq_above"):
            FlashBwdPreprocess(jnp.bfloat16, 128, 128, zero_dq_above=2048, **kw)


@needs_cutlass
def test_store_first_by_length_sass(tmp_path):
    """One binary serves both ways: the by-length main kernel has the store-first
    dQ warp (bulk copy, ticket atomic) and the add-only one (reduce-adds) behind a
    run-time test, with the two-buffer hand-off (twice the named-barrier pairs of
    the one-buffer add-only kernel); the preprocess keeps its 8 zeroing stores per
    thread behind a branch and zeroes the semaphores either way."""
    import cutlass

    from jax_fa4.kernels import sm90_bwd

    ins, outs, aliases = bwd_structs(2, 113, 203, 4, 1, 128, jnp.bfloat16)
    tile_m = sm90_bwd.bwd_tiles(128, True).tile_m
    sem = jax.ShapeDtypeStruct((2, 4, -(-113 // tile_m)), jnp.int32)
    got = {}
    for name, make in (
            ("auto", functools.partial(sm90_bwd.FlashBwdSm90StoreFirst, cutlass.BFloat16, 128,
                                       128, True, 0.1, dq_first_max_seqlen_q=2048)),
            ("first", functools.partial(sm90_bwd.FlashBwdSm90StoreFirst, cutlass.BFloat16, 128,
                                        128, True, 0.1))):
        lower(make, "sm_90a", ins + (sem,), outs + (sem,), {6: 0, 7: 3},
              compile_options=dump_options(tmp_path / name))
        sass = dumped_sass(tmp_path / name)
        assert "LDL" not in sass and "STL" not in sass, "local memory spill"
        got[name] = (len(BULK_COPY.findall(sass)), len(BULK_REDUCE.findall(sass)),
                     len(re.findall(r"\b(?:ATOMG|ATOM)\.E\.ADD", sass)))
    # (bulk copies, bulk reduce-adds, ticket atomics): the by-length kernel has the
    # store-first warp's and, besides, the add-only warp's reduce-adds.
    assert got["auto"][0] == got["first"][0] >= 1, got
    assert got["auto"][2] == got["first"][2] >= 1, got
    assert got["auto"][1] > got["first"][1] >= 1, got
    zeroing = _pre_sass(tmp_path / "pre_zero", True, None)
    auto = _pre_sass(tmp_path / "pre_auto", False, 64, zero_dq_above=2048)
    assert len(STG128.findall(auto)) == len(STG128.findall(zeroing)) == 8
    stg32 = re.compile(r"\bSTG\.E(?:\.STRONG\.\w+)?\s")
    assert len(stg32.findall(auto)) == len(stg32.findall(zeroing)) + 1


@needs_cutlass
def test_add_only_two_buffers_sass(tmp_path):
    """BwdTiles.dq_double_add: the add-only kernel with two dQ buffers compiles
    without spills, reduce-adds only, and picks each item's barrier pair at run
    time (buffer it % 2)."""
    import dataclasses

    import cutlass

    from jax_fa4.kernels import sm90_bwd

    ins, outs, aliases = bwd_structs(2, 113, 203, 4, 1, 128, jnp.bfloat16)
    bars = {}
    for two in (False, True):
        # (without the masked-warpgroup skip, which needs one buffer)
        tiles = dataclasses.replace(sm90_bwd.bwd_tiles(128, True), dq_double_add=two,
                                    skip_masked_wg=False, carry_coords=False)
        kernel = sm90_bwd.FlashBwdSm90(cutlass.BFloat16, 128, 128, True, 0.1, tiles=tiles)
        assert kernel.dq_bufs == (2 if two else 1)
        dump = tmp_path / f"two{two}"
        lower(lambda k=kernel: k, "sm_90a", ins, outs, aliases,
              compile_options=dump_options(dump))
        sass = dumped_sass(dump)
        assert "LDL" not in sass and "STL" not in sass, "local memory spill"
        assert BULK_REDUCE.search(sass) and not BULK_COPY.search(sass)
        # dQ hand-off barriers (160 threads: a warpgroup and the dQ warp) with an
        # id in a register (the buffer's pair is chosen at run time) / immediate.
        bars[two] = (len(re.findall(r"BAR\.(?:SYNC|ARV)\S* R\d+, 0xa0", sass)),
                     len(re.findall(r"BAR\.SYNC\S* 0x[23], 0xa0", sass)))
    # One buffer: the dQ warp waits on the fixed full barriers 2 / 3. Two: every
    # wait and more arrives pick their pair (+ dq_buf_bar per buffer) at run time.
    assert bars[False][1] == 2 and bars[True][1] == 0, bars
    assert bars[True][0] > bars[False][0], bars
