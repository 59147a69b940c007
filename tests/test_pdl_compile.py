"""The backward's programmatic dependent launch (PDL) chain, on the CPU.

On sm_90a the preprocess, the main kernel and the postprocess launch with
``use_pdl``: each may start while the kernel before it drains, so each must wait
(``griddepcontrol.wait``, SASS ``ACQBULK``) before its first global-memory access,
and the first two let the next one launch (``griddepcontrol.launch_dependents``,
SASS ``PREEXIT``). These tests read the SASS of every kernel of the chain for that
order, and check which compile keys ask for it.
"""

import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import pytest
from kernel_compile import bwd_structs, dump_options, dumped_sass, lower

from jax_fa4.config import PDL_ENV, AttentionConfig, pdl_enabled
from jax_fa4.rules import kernels_cuda

needs_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed"
)

# Any SASS instruction that reads or writes global memory (per-thread, bulk, TMA,
# atomics), and the PDL wait / trigger.
GLOBAL = re.compile(r"\b(LDG|STG|LDGSTS|LD|ST|ATOM|ATOMG|RED|REDG|UTMALDG|UTMASTG|UTMAREDG|"
                    r"UBLKCP|UBLKRED|UBLKPF)\b")
WAIT, TRIGGER = re.compile(r"\bACQBULK\b"), re.compile(r"\bPREEXIT\b")


def _pdl_order(sass: str) -> tuple[int, int, int, int]:
    """(waits, triggers, global accesses before the first wait, after it)."""
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]
    waits = [i for i, ln in enumerate(lines) if WAIT.search(ln)]
    first = waits[0] if waits else len(lines)
    hits = [i for i, ln in enumerate(lines) if GLOBAL.search(ln)]
    return (len(waits), sum(bool(TRIGGER.search(ln)) for ln in lines),
            sum(i < first for i in hits), sum(i > first for i in hits))


def _assert_chained(sass: str, triggers: bool) -> None:
    waits, trig, before, after = _pdl_order(sass)
    assert waits == 1, f"{waits} griddepcontrol.wait (ACQBULK) in the SASS"
    assert before == 0, f"{before} global-memory instructions before the PDL wait"
    assert after > 0, "no global-memory instruction found after the wait (pattern broken?)"
    assert (trig >= 1) == triggers, f"{trig} launch_dependents (PREEXIT)"


def _key(kind: str, arch: str, causal: bool = False):
    q = jax.ShapeDtypeStruct((1, 8, 2, 128), jnp.bfloat16)
    return kernels_cuda._key(kind, arch, q, q, AttentionConfig(scale=0.1, causal=causal))


def test_the_backward_keys_of_sm90_ask_for_pdl(monkeypatch):
    monkeypatch.delenv(PDL_ENV, raising=False)
    for kind in ("bwd_pre", "bwd_pre_by_thread", "bwd", "bwd_det", "bwd_post"):
        assert _key(kind, "sm_90a").pdl, kind
        assert not _key(kind, "sm_100a").pdl, kind  # compiled, not run on hardware
    assert not _key("fwd", "sm_90a").pdl
    # Keys differ, so a kernel built with PDL is never served for one without.
    monkeypatch.setenv(PDL_ENV, "0")
    assert not pdl_enabled("sm_90a")
    off = _key("bwd", "sm_90a")
    monkeypatch.setenv(PDL_ENV, "1")
    assert off != _key("bwd", "sm_90a")


@pytest.mark.parametrize("kind", ["bwd_pre", "bwd", "bwd_det", "bwd_post"])
def test_the_kernel_factories_pass_the_key_on(monkeypatch, kind):
    """The kernel objects the lowering builds carry the key's choice."""
    pytest.importorskip("cutlass")
    monkeypatch.delenv(PDL_ENV, raising=False)
    make = {"bwd_pre": kernels_cuda._pre_kernel, "bwd": kernels_cuda._bwd_kernel,
            "bwd_det": kernels_cuda._bwd_kernel, "bwd_post": kernels_cuda._post_kernel}[kind]
    assert make(_key(kind, "sm_90a", causal=True)).use_pdl
    monkeypatch.setenv(PDL_ENV, "0")
    assert not make(_key(kind, "sm_90a", causal=True)).use_pdl


def _main_sass(tmp_path, cls_name: str, head_dim: int, causal: bool, use_pdl: bool) -> str:
    import cutlass

    from jax_fa4.kernels import sm90_bwd, sm90_bwd_wide

    cls = getattr(sm90_bwd, cls_name, None) or getattr(sm90_bwd_wide, cls_name)
    ins, outs, aliases = bwd_structs(2, 113, 203, 4, 1, head_dim, jnp.bfloat16)
    if getattr(cls, "takes_dq_semaphores", False):
        tile_m = cls(cutlass.BFloat16, head_dim, head_dim, causal).tile_m
        sem = jax.ShapeDtypeStruct((2, 4, -(-113 // tile_m)), jnp.int32)
        ins, outs, aliases = ins + (sem,), outs + (sem,), {6: 0, 7: 3}
    make = functools.partial(cls, cutlass.BFloat16, head_dim, head_dim, causal, head_dim**-0.5,
                             use_pdl=use_pdl)
    lower(make, "sm_90a", ins, outs, aliases, compile_options=dump_options(tmp_path))
    return dumped_sass(tmp_path)


@needs_cutlass
@pytest.mark.parametrize("cls_name,head_dim,causal", [
    ("FlashBwdSm90", 128, True),
    ("FlashBwdSm90", 64, False),
    ("FlashBwdSm90Deterministic", 128, True),
    ("FlashBwdSm90Wide", 256, True),
])
def test_main_kernel_waits_before_any_global_access(tmp_path, cls_name, head_dim, causal):
    """Every warp role of the main kernel reads Q, K, V, dO and the preprocess's
    outputs, and writes dK, dV and dQaccum, only after the wait."""
    _assert_chained(_main_sass(tmp_path, cls_name, head_dim, causal, True), triggers=True)


@needs_cutlass
def test_main_kernel_without_pdl_has_no_wait(tmp_path):
    waits, trig, before, _ = _pdl_order(_main_sass(tmp_path, "FlashBwdSm90", 128, False, False))
    assert (waits, trig) == (0, 0) and before > 0  # with no wait, every access is before


@needs_cutlass
@pytest.mark.parametrize("stat_block", [None, 64])
def test_preprocess_waits_before_any_global_access(tmp_path, stat_block):
    from jax_fa4.kernels.bwd_preprocess import FlashBwdPreprocess, bwd_workspace_shapes

    b, s, h, d = 2, 203, 3, 128
    ws = bwd_workspace_shapes(b, s, h, d)
    o = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((b, h, s), jnp.float32)
    outs = tuple(jax.ShapeDtypeStruct(*ws[k]) for k in ("Dpsum", "LSElog2", "dQaccum"))
    lower(lambda: FlashBwdPreprocess(jnp.bfloat16, d, d, stat_block=stat_block, use_pdl=True),
          "sm_90a", (o, o, lse, lse), outs, compile_options=dump_options(tmp_path))
    _assert_chained(dumped_sass(tmp_path), triggers=True)


@needs_cutlass
@pytest.mark.parametrize("flat_tile_m,head_dim", [(None, 128), (64, 128), (128, 64)])
def test_postprocess_waits_before_any_global_access(tmp_path, flat_tile_m, head_dim):
    from jax_fa4.kernels.bwd_postprocess import FlashBwdPostprocess
    from jax_fa4.kernels.bwd_preprocess import bwd_workspace_shapes

    shape, f32 = bwd_workspace_shapes(2, 203, 3, head_dim)["dQaccum"]
    out = jax.ShapeDtypeStruct((2, 203, 3, head_dim), jnp.bfloat16)
    lower(lambda: FlashBwdPostprocess(jnp.bfloat16, head_dim, head_dim**-0.5, flat_tile_m,
                                      use_pdl=True),
          "sm_90a", (jax.ShapeDtypeStruct(shape, f32),), (out,),
          compile_options=dump_options(tmp_path))
    # The last kernel of the chain also triggers: harmless, as XLA's kernels after it
    # launch without PDL and wait for it to finish.
    _assert_chained(dumped_sass(tmp_path), triggers=True)
