"""Head dims beyond 64 / 128 / 256: 96 (forward and backward kernels on sm_90a, and
on sm_100a compiled, not run on hardware) and 192, (192, 128) (sm_90a forward and
backward kernels; sm_100a, compiled, not run on hardware: forward and backward
kernels at 192, (192, 128) and 256).
On CPU: which kernels the lowering builds and what it logs or raises; on the GPU
(``-m gpu``): the kernels against the f32 reference by the 2x rule, outputs
poisoned, with GQA, odd lengths, masks and rows that see no key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_2x, rand_qkv

import jax_fa4
from jax_fa4 import reference
from jax_fa4.config import kernel_support_error
from jax_fa4.ffi import poison_outputs

CALL = "CuteDSLRT_NvJaxCutlassCall"


@pytest.mark.parametrize("arch,d,dv,ok", [
    ("sm_90a", 96, 96, True), ("sm_90a", 192, 192, True), ("sm_90a", 192, 128, True),
    ("sm_90a", 160, 160, False), ("sm_90a", 128, 64, False), ("sm_100a", 96, 96, True),
    ("sm_100a", 192, 128, True), ("sm_100a", 192, 192, True), ("sm_100a", 256, 256, True),
    ("sm_100a", 160, 160, False)])
def test_head_dim_tables(arch, d, dv, ok):
    err = kernel_support_error(arch, jnp.bfloat16, d, dv)
    assert (err is None) == ok
    assert ok or f"(qk={d}, v={dv}) have no {arch} kernel" in err


def _lower(fn, *structs):
    return jax.jit(fn).trace(*structs).lower(lowering_platforms=("cuda",)).as_text()


def _structs(d, dv, hq=4, hkv=2):
    sds = jax.ShapeDtypeStruct
    return (sds((2, 200, hq, d), jnp.bfloat16), sds((2, 333, hkv, d), jnp.bfloat16),
            sds((2, 333, hkv, dv), jnp.bfloat16))


def test_sm100_head_dim_256_lowers_forward_and_backward_kernels(monkeypatch, kernel_calls):
    """sm_100a at head dim 256 (compiled, not run on hardware): the forward kernel
    (plain, masked, split keys) and the backward's three (Note [Head-dim halves] in
    kernels/sm100_bwd.py), causal, windowed, with softcap and segment ids, GQA, and
    through the returned LSE, and the deterministic backward (its register adds
    ordered per head-dim half)."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_100a")
    d = dv = 256
    sds = jax.ShapeDtypeStruct
    decode = (sds((2, 1, 8, d), jnp.bfloat16), sds((2, 5000, 2, d), jnp.bfloat16),
              sds((2, 5000, 2, dv), jnp.bfloat16))
    text = _lower(lambda q, k, v: jax_fa4.attention(q, k, v, implementation="cute"), *decode)
    assert text.count(CALL) == 1
    ids = jnp.repeat(jnp.arange(2, dtype=jnp.int32), 167)[None].repeat(2, 0)
    for kw in (dict(causal=True), dict(window=(64, 0)), dict(causal=True, softcap=30.0),
               dict(causal=True, q_segment_ids=ids[:, :200], kv_segment_ids=ids[:, :333])):
        def loss(q, k, v, kw=kw):
            out, lse = jax_fa4.attention(q, k, v, implementation="cute", return_lse=True,
                                         **kw)
            return out.astype(jnp.float32).sum() + lse.sum()

        kernel_calls.clear()
        text = _lower(jax.grad(loss, argnums=(0, 1, 2)), *_structs(d, dv))
        assert text.count(CALL) == 4, kw  # forward, preprocess, main, postprocess
        main = [key for key, _ in kernel_calls if key.kind == "bwd"]
        assert [(key.arch, key.head_dim) for key in main] == [("sm_100a", 256)], kw
    kernel_calls.clear()
    assert _lower(jax.grad(lambda q, k, v: jax_fa4.attention(
        q, k, v, causal=True, deterministic=True, implementation="cute").astype(
            jnp.float32).sum(), argnums=(0, 1, 2)), *_structs(d, dv)).count(CALL) == 4
    assert [key.kind for key, _ in kernel_calls][2] == "bwd_det"


@pytest.mark.parametrize("dv", [128, 192])
def test_sm100_hdim_192_runs_every_kernel(monkeypatch, dv):
    """sm_100a (compiled, not run on hardware), 192 and DeepSeek's (192, 128):
    forward, preprocess, backward (Note [Wide sm100 backward]) and postprocess
    kernels, causal and masked (the walks from the lowering), and deterministic."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_100a")

    def grad(**kw):
        return jax.grad(lambda q, k, v: jax_fa4.attention(
            q, k, v, implementation="cute", **kw).astype(jnp.float32).sum(),
            argnums=(0, 1, 2))

    for kw in (dict(causal=True), dict(window=(64, 0))):
        assert _lower(grad(**kw), *_structs(192, dv)).count(CALL) == 4, kw
    assert _lower(grad(causal=True, deterministic=True), *_structs(192, dv)).count(CALL) == 4


def test_hdim_96_runs_every_kernel(monkeypatch):
    """Forward, preprocess, backward and postprocess kernels, causal and with a
    window (the masked kernels), deterministic too."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_90a")
    for kw in (dict(causal=True), dict(window=(64, 0)), dict(deterministic=True)):
        text = _lower(jax.grad(lambda q, k, v, kw=kw: jax_fa4.attention(
            q, k, v, implementation="cute", **kw).astype(jnp.float32).sum(),
            argnums=(0, 1, 2)), *_structs(96, 96))
        assert text.count(CALL) == 4, kw


@pytest.mark.parametrize("dv", [192, 128])
def test_hdim_192_runs_every_kernel(monkeypatch, kernel_calls, dv):
    """(192, 192) and DeepSeek's (192, 128): forward, preprocess, backward (the wide
    kernel, Note [Wide dK and dV]) and postprocess, plain and masked, and the
    deterministic backward (FlashBwdSm90WideDeterministic), plain and masked."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_90a")
    structs = _structs(192, dv)

    def grad(**kw):
        return jax.grad(lambda q, k, v: jax_fa4.attention(
            q, k, v, causal=True, implementation="cute", **kw).astype(jnp.float32).sum(),
            argnums=(0, 1, 2))

    for kw in (dict(), dict(window=(64, 0)), dict(deterministic=True),
               dict(window=(64, 0), deterministic=True)):
        kernel_calls.clear()
        assert _lower(grad(**kw), *structs).count(CALL) == 4, kw
        kinds = [key.kind for key, _ in kernel_calls]
        assert kinds == ["fwd", "bwd_pre", "bwd_det" if kw.get("deterministic") else "bwd",
                         "bwd_post"], kw


@pytest.mark.parametrize("arch,direction", [("sm_90a", "fwd"), ("sm_90a", "bwd"),
                                            ("sm_100a", "fwd"), ("sm_100a", "bwd")])
def test_hdim_96_builds(tmp_path, arch, direction):
    """hdim 96's kernels: the tensor-core instructions of the architecture and no
    local memory, except the sm_100a forward's softmax warps, which spill as at hdim
    128 (19 instructions); the sm_90a forward writes P to SMEM with stmatrix (Note
    [P through SMEM]) and its P V wgmma (m64n96, k = 128 keys) reads it there.
    sm_100a: compiled, not run on hardware."""
    pytest.importorskip("cutlass")
    import re

    from kernel_compile import dump_options, dumped_sass, fwd_structs, lower, lower_bwd

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90
    from jax_fa4.kernels.sm90_fwd import make_fwd_sm90
    from jax_fa4.kernels.sm100_bwd import FlashBwdSm100
    from jax_fa4.kernels.sm100_fwd import FlashFwdSm100

    opts = dump_options(tmp_path)
    if direction == "bwd":
        cls = FlashBwdSm90 if arch == "sm_90a" else FlashBwdSm100
        lower_bwd(cls, arch, jnp.bfloat16, 96, True, compile_options=opts)
    else:
        ins, outs = fwd_structs(2, 113, 203, 4, 2, 96, jnp.bfloat16)
        make = (lambda: make_fwd_sm90(jnp.bfloat16, 96, 96, False)) if arch == "sm_90a" else (
            lambda: FlashFwdSm100(jnp.bfloat16, 96, 96, False))
        lower(make, arch, ins, outs, compile_options=opts)
    sass = dumped_sass(tmp_path)
    assert re.search(r"\bHGMMA\." if arch == "sm_90a" else r"\bUTC\w*MMA", sass)
    local = len(re.findall(r"\b(LDL|STL)\b", sass))
    assert local <= (19 if (arch, direction) == ("sm_100a", "fwd") else 0), local
    if (arch, direction) == ("sm_90a", "fwd"):
        assert re.search(r"\bSTSM\.16\.M88\.4\b", sass)
        # A from SMEM: the operands by descriptor right after D (a register A would
        # come first: "HGMMA... R88, R24, gdesc[...]").
        pv = re.findall(r"HGMMA\.64x96x16\.F32\.BF16 [^;\n]*", sass)
        assert pv and all(re.match(r"\S+ R\d+, gdesc\[", x) for x in pv), pv[:2]


def _ref(q, k, v, kw, dtype):
    masks = reference.Masks(None, None if "kv_lengths" not in kw else jnp.asarray(
        kw["kv_lengths"]), None, None)
    return reference.attention_dense(
        q, k, v, scale=q.shape[-1] ** -0.5, causal=kw.get("causal", False),
        window=kw.get("window"), masks=masks, compute_dtype=dtype)


def _kernel_kw(kw):
    return {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}


GPU_CASES = [
    (96, 96, dict(causal=True), True),
    (96, 96, dict(), True),
    (96, 96, dict(causal=True, window=(100, 0), kv_lengths=np.array([333, 0], np.int32)),
     True),
    (96, 96, dict(causal=True, deterministic=True), True),
    (192, 192, dict(causal=True), True),
    (192, 192, dict(), True),
    (192, 128, dict(causal=True), True),
    (192, 128, dict(window=(50, 20), kv_lengths=np.array([333, 0], np.int32)), True),
    (192, 192, dict(causal=True, deterministic=True), True),
    (192, 128, dict(window=(50, 20), kv_lengths=np.array([333, 0], np.int32),
                    deterministic=True), True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv,kw,bwd", GPU_CASES)
def test_gpu_head_dims(d, dv, kw, bwd):
    """Out and lse (and, where a backward kernel exists, every gradient) by the 2x
    rule, kernels only; rows that see no key: out 0, lse -inf, no NaN."""
    kw = dict(kw)
    det = kw.pop("deterministic", False)
    b, sq, sk, hq, hkv = 2, 300, 333, 4, 2
    q, k, v = rand_qkv(d + dv, b, sq, sk, hq, hkv, d, dv)

    def attn(q, k, v):
        return jax_fa4.attention(q, k, v, return_lse=True, implementation="cute",
                                 deterministic=det, **_kernel_kw(kw))

    with poison_outputs():
        out, lse = jax.jit(attn)(q, k, v)
    hi = _ref(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), kw,
              jnp.float32)
    lo = _ref(q, k, v, kw, jnp.bfloat16)
    assert_close_2x(out, hi[0], lo[0], atol=1e-3, name="out")
    lse, hi_lse, lo_lse = (np.asarray(x, np.float64) for x in (lse, hi[1], lo[1]))
    empty = np.isneginf(hi_lse)
    assert np.array_equal(np.isneginf(lse), empty) and not np.isnan(lse).any()
    assert_close_2x(lse[~empty], hi_lse[~empty], lo_lse[~empty], atol=1e-3, name="lse")
    if not bwd:
        return
    kd = jax.random.split(jax.random.key(3), 2)
    dout = jax.random.normal(kd[0], (b, sq, hq, dv))
    dlse = jnp.where(jnp.asarray(empty), 0.0, jax.random.normal(kd[1], (b, hq, sq)))

    def vjp_of(f):
        (o, l), pullback = jax.vjp(f, q, k, v)
        return pullback((dout.astype(o.dtype), dlse))

    with poison_outputs():
        got = jax.jit(lambda: vjp_of(attn))()
    want_hi = vjp_of(lambda q, k, v: _ref(q.astype(jnp.float32), k.astype(jnp.float32),
                                          v.astype(jnp.float32), kw, jnp.float32))
    want_lo = vjp_of(lambda q, k, v: _ref(q, k, v, kw, jnp.bfloat16))
    for name, g, h, lw in zip(("dq", "dk", "dv"), got, want_hi, want_lo):
        assert_close_2x(g, h, lw, atol=2e-3, name=name)
