"""The masked kernels on a machine without a GPU: every mask lowers to the sm_90a
kernels (forward + the three backward kernels) through the public API, the causal
modes, windows and lengths share one compiled kernel per direction and head dim
(the intervals are data, rules/ranges.py), and the builds hold what keeps them
fast: no local memory, the interval test as one unsigned compare. Masks stay on
the logged reference path where no kernel takes them (the deterministic
backward). The sm_100a kernels are compiled, not run on hardware."""

from __future__ import annotations

import logging
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import jax_fa4
from jax_fa4.ffi import cutlass_available

pytestmark = pytest.mark.skipif(cutlass_available() is not None, reason="no CuTe DSL")

CALL = "CuteDSLRT_NvJaxCutlassCall"
B, SQ, SK, HQ, HKV = 2, 113, 203, 4, 2


def _structs(d, sq=SQ, sk=SK):
    return (jax.ShapeDtypeStruct((B, sq, HQ, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, sk, HKV, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, sk, HKV, d), jnp.bfloat16))


def _step(implementation="cute", deterministic=False, **masks):
    def loss(q, k, v, lengths, seg_q, seg_k):
        kw = dict(masks)
        kw.update({n: a for n, a in (("kv_lengths", lengths), ("q_segment_ids", seg_q),
                                     ("kv_segment_ids", seg_k)) if kw.pop(n, False)})
        out, lse = jax_fa4.attention(q, k, v, return_lse=True, implementation=implementation,
                                     deterministic=deterministic, **kw)
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()
    return jax.grad(loss, argnums=(0, 1, 2))


def _lower(fn, d, sq=SQ, sk=SK):
    i32 = jnp.int32
    args = _structs(d, sq, sk) + (jax.ShapeDtypeStruct((B,), i32),
                                  jax.ShapeDtypeStruct((B, sq), i32),
                                  jax.ShapeDtypeStruct((B, sk), i32))
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("d", [128])
def test_masks_lower_to_the_sm90_kernels_one_build_for_all(monkeypatch, d):
    """Lengths + causal, a window, bottom-right causal: four custom calls each, and
    the same forward and backward main kernel for all three."""
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_90a")
    from jax_fa4.rules import kernels_cuda

    keys = []
    real = kernels_cuda.kernel_call

    def call(key, *args, **kwargs):
        keys.append(key)
        return real(key, *args, **kwargs)

    monkeypatch.setattr(kernels_cuda, "kernel_call", call)
    for masks in (dict(causal=True, kv_lengths=True), dict(window=(17, 3)),
                  dict(causal="bottom_right")):
        assert _lower(_step(**masks), d).count(CALL) == 4
    fwd = {k for k in keys if k.kind == "fwd"}
    main = {k for k in keys if k.kind == "bwd"}
    assert len(fwd) == len(main) == 1
    assert next(iter(fwd)).masked and not next(iter(fwd)).segments
    assert not next(iter(fwd)).causal  # causal travels in the intervals


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_deterministic_masks_take_the_logged_reference_backward(monkeypatch, caplog, arch):
    monkeypatch.setenv("JAX_FA4_ARCH", arch)
    why = f"no deterministic {arch} backward kernel takes window"
    with caplog.at_level(logging.INFO, logger="jax_fa4"):
        text = _lower(_step(implementation=None, window=(8, 0), deterministic=True), 64)
    assert text.count(CALL) == 1  # the forward kernel; the backward is pure JAX
    assert any(why in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=why):
        _lower(_step(window=(8, 0), deterministic=True), 64)


def test_masks_lower_to_the_sm100_kernels(monkeypatch):
    """Compiled, not run on hardware."""
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_100a")
    masks = dict(causal="bottom_right", kv_lengths=True, q_segment_ids=True,
                 kv_segment_ids=True)
    assert _lower(_step(**masks), 128).count(CALL) == 4


# (arch, direction, head dim, segment ids): each masked kernel class once.
BUILDS = [("sm_90a", "fwd", 64, False), ("sm_90a", "fwd", 256, True),
          ("sm_90a", "bwd", 128, False), ("sm_90a", "bwd", 256, True),
          ("sm_100a", "fwd", 128, False), ("sm_100a", "bwd", 64, True)]


@pytest.mark.parametrize("arch,direction,d,segments", BUILDS,
                         ids=["-".join(map(str, b)) for b in BUILDS])
def test_masked_builds(tmp_path, arch, direction, d, segments):
    """The interval test is one unsigned compare per score (``keep_inside`` in
    kernels/mask.py), the tensor-core instructions of the architecture are there,
    and the sm90 builds without segment ids use no local memory (the hdim-128
    backward's MMA warpgroups have no register to spare)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from kernel_compile import dump_options, lower_masked, read_dump

    lower_masked(arch, direction, jnp.bfloat16, d, segments,
                 compile_options=dump_options(pathlib.Path(tmp_path)))
    ptx = read_dump(pathlib.Path(tmp_path), "ptx")
    assert ptx is not None
    assert "setp.lt.u32 p, t," in ptx
    assert ("wgmma.mma_async" if arch == "sm_90a" else "tcgen05.mma") in ptx
    sass = read_dump(pathlib.Path(tmp_path), "sass")
    if sass is None:
        pytest.skip("the DSL wrote no SASS (disassembler unavailable to it)")
    assert ("HGMMA" if arch == "sm_90a" else "UTCHMMA") in sass or arch == "sm_100a"
    local = len(re.findall(r"\b(LDL|STL)\b", sass))
    if not segments and arch == "sm_90a":
        assert local == 0
    elif not segments:
        # The sm100 causal forward's softmax warps already spill a little (19).
        assert local <= 40, local
