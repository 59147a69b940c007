"""The CUDA path builds on a machine without a GPU: lowering for platform cuda
cross-compiles the kernels (forward and the three backward kernels) for sm_90a
and for sm_100a (compiled, not run on hardware) and emits custom calls that read
and write the [B, S, H, D] layout directly."""

from __future__ import annotations

import re
import struct

import jax
import jax.numpy as jnp
import pytest

import jax_fa4
from jax_fa4.ffi import compile_seconds, cutlass_available

pytestmark = pytest.mark.skipif(cutlass_available() is not None, reason="no CuTe DSL")

CALL = "CuteDSLRT_NvJaxCutlassCall"


def _lower(fn, *structs):
    return jax.jit(fn).trace(*structs).lower(lowering_platforms=("cuda",)).as_text()


def _structs(b, sq, sk, hq, hkv, d, dtype):
    return (
        jax.ShapeDtypeStruct((b, sq, hq, d), dtype),
        jax.ShapeDtypeStruct((b, sk, hkv, d), dtype),
        jax.ShapeDtypeStruct((b, sk, hkv, d), dtype),
    )


# Every (arch, head dim, mask) in bf16; fp16 once per arch (the kernels take the
# dtype as a type parameter; the kernel compile tests cover fp16 builds too).
@pytest.mark.parametrize("arch,d,causal,dtype", [
    (a, d, c, jnp.bfloat16) for a in ("sm_90a", "sm_100a") for d in (64, 128)
    for c in (False, True)] + [(a, 128, True, jnp.float16) for a in ("sm_90a", "sm_100a")])
def test_forward_and_backward_lower_for_cuda(monkeypatch, arch, d, causal, dtype):
    monkeypatch.setenv("JAX_FA4_ARCH", arch)

    def loss(q, k, v):
        out, lse = jax_fa4.attention(q, k, v, causal=causal, return_lse=True, implementation="cute")
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    structs = _structs(2, 113, 203, 8, 2, d, dtype)
    fwd = _lower(lambda q, k, v: jax_fa4.attention(q, k, v, causal=causal), *structs)
    assert fwd.count(CALL) == 1
    # The sm90 causal forward (persistent, dynamic scheduler) takes a zeroed int32
    # tile counter; no other forward has an int32 operand.
    assert ("tensor<1xi32>" in fwd) == (arch == "sm_90a" and causal)
    bwd = _lower(jax.grad(loss, argnums=(0, 1, 2)), *structs)
    # forward + preprocess + main backward + postprocess
    assert bwd.count(CALL) == 4
    # No layout shuffles around the custom calls: the kernels read [B, S, H, D].
    assert "stablehlo.transpose" not in fwd
    assert "stablehlo.transpose" not in bwd


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_backward_without_lse_cotangent_lowers_without_zero_fill(monkeypatch, arch):
    """The pullback of attention without return_lse: LSE's cotangent is a symbolic
    zero, so the lowered backward is the three kernels alone, with no zero-filled
    (B, H, Sq) array; the preprocess takes O, dO and LSE (3 operands), against 4
    (and dLSE) when the caller sends an LSE cotangent."""
    monkeypatch.setenv("JAX_FA4_ARCH", arch)
    structs = _structs(2, 113, 203, 8, 2, 128, jnp.bfloat16)

    def pullback_text(return_lse):
        def fwd(q, k, v):
            return jax.vjp(lambda q, k, v: jax_fa4.attention(
                q, k, v, causal=True, return_lse=return_lse, implementation="cute"), q, k, v)

        out, pull = jax.eval_shape(fwd, *structs)
        return jax.jit(lambda pull, ct: pull(ct)).trace(pull, out).lower(
            lowering_platforms=("cuda",)).as_text()

    calls = re.compile(CALL + r"\w*\(([^)]*)\)")
    text = pullback_text(False)
    operands = [len(c.split(",")) for c in calls.findall(text)]
    assert len(operands) == 3 and operands[0] == 3, operands
    assert "broadcast_in_dim" not in text and "stablehlo.constant" not in text
    operands = [len(c.split(",")) for c in calls.findall(pullback_text(True))]
    assert len(operands) == 3 and operands[0] == 4, operands


@pytest.mark.parametrize("causal", [False, True])
def test_hdim256_lowers_forward_and_backward(monkeypatch, causal):
    """hdim 256 has sm_90a kernels (forward, and the wide backward) and sm_100a ones
    (Note [One Q tile], Note [Head-dim halves]; compiled, not run on hardware)."""
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_90a")
    structs = _structs(2, 113, 203, 4, 2, 256, jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(jax_fa4.attention(q, k, v, causal=causal, implementation="cute"))

    bwd = _lower(jax.grad(loss, argnums=(0, 1, 2)), *structs)
    assert bwd.count(CALL) == 4
    assert "stablehlo.transpose" not in bwd
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_100a")
    assert _lower(loss, *structs).count(CALL) == 1
    bwd = _lower(jax.grad(loss, argnums=(0, 1, 2)), *structs)
    assert bwd.count(CALL) == 4


def test_one_binary_serves_every_shape(monkeypatch):
    """A kernel configuration compiles once; new batch / sequence / head counts reuse it:
    the plain forward's, and the decode-like calls' masked forward (with and without
    split keys, Note [Split keys] in kernels/sm90_fwd.py)."""
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_90a")
    fn = lambda q, k, v: jax_fa4.attention(q, k, v, scale=0.125, implementation="cute")  # noqa: E731
    _lower(fn, *_structs(1, 300, 300, 2, 2, 64, jnp.bfloat16))
    n = len(compile_seconds)
    for shape in [(3, 257, 4097, 4, 1), (2, 1000, 1, 6, 3), (5, 300, 129, 1, 1)]:
        txt = _lower(fn, *_structs(*shape, 64, jnp.bfloat16))
        assert CALL in txt
    assert len(compile_seconds) == n
    # Decode-like calls (a KV head's query rows fit one 192-row tile), 4 query heads
    # per KV head (packed into the tiles: the group size is in the compile key): two
    # kernels, split or not, for every shape.
    for shape in [(3, 17, 4097, 4, 1), (2, 1, 9000, 8, 2), (5, 1, 7, 4, 1), (64, 3, 100, 8, 2)]:
        txt = _lower(fn, *_structs(*shape, 64, jnp.bfloat16))
        assert CALL in txt
    assert len(compile_seconds) == n + 2


def _cubin_sm_versions(hlo_text: str) -> list[int]:
    """SM numbers of the CUDA ELF images (e_machine 190) inside the custom call's object."""
    raw = re.search(r'module = "((?:[^"\\]|\\.)*)"', hlo_text).group(1)
    raw = raw.replace("\\\\", "\\5C").encode("latin1")
    blob = re.sub(rb"\\([0-9A-F]{2})", lambda m: bytes([int(m.group(1), 16)]), raw)
    assert blob.startswith(b"\x7fELF")  # the host object
    sms = []
    for m in re.finditer(rb"\x7fELF", blob):
        machine = struct.unpack_from("<H", blob, m.start() + 18)[0]
        flags = struct.unpack_from("<I", blob, m.start() + 0x30)[0]
        if machine == 190:
            # Old CUDA ELF ABI: SM in bits 0-7; new ABI (sm_100+): bits 8-15.
            sms.append(flags & 0xFF if flags & 0xFF >= 20 else (flags >> 8) & 0xFF)
    return sms


@pytest.mark.parametrize("arch,sm", [("sm_90a", 90), ("sm_100a", 100)])
def test_module_carries_code_for_the_target(monkeypatch, arch, sm):
    monkeypatch.setenv("JAX_FA4_ARCH", arch)
    txt = _lower(
        lambda q, k, v: jax_fa4.attention(q, k, v, scale=0.3, implementation="cute"),
        *_structs(1, 64, 64, 1, 1, 128, jnp.bfloat16),
    )
    assert _cubin_sm_versions(txt) == [sm]


def test_dispatch_by_compute_capability(monkeypatch):
    from jax_fa4.config import arch_from_compute_capability, target_arch

    assert arch_from_compute_capability("9.0") == "sm_90a"
    assert arch_from_compute_capability("10.0") == "sm_100a"
    assert arch_from_compute_capability("8.0") is None
    assert arch_from_compute_capability("12.0") is None
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_100a")
    assert target_arch()[0] == "sm_100a"
    monkeypatch.delenv("JAX_FA4_ARCH")
    assert target_arch()[0] == "sm_90a"  # no GPU here: the cross-compile default


def test_unsupported_arch_env_falls_back_or_raises(monkeypatch):
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_80")
    structs = _structs(1, 16, 16, 1, 1, 64, jnp.bfloat16)
    txt = _lower(lambda q, k, v: jax_fa4.attention(q, k, v), *structs)
    assert CALL not in txt
    with pytest.raises(jax_fa4.KernelUnavailableError, match="sm_80"):
        _lower(lambda q, k, v: jax_fa4.attention(q, k, v, implementation="cute"), *structs)


def test_disk_cache_lets_a_new_process_skip_compilation(monkeypatch, tmp_path):
    import cutlass.jax.compile as cjc

    from jax_fa4.ffi import bridge

    monkeypatch.setenv("JAX_FA4_ARCH", "sm_90a")
    monkeypatch.setenv("JAX_FA4_CACHE_DIR", str(tmp_path))
    fn = lambda q, k, v: jax_fa4.attention(q, k, v, scale=0.0625, implementation="cute")  # noqa: E731
    structs = _structs(1, 64, 64, 1, 1, 64, jnp.float16)
    first = _lower(fn, *structs)
    assert len(list(tmp_path.glob("*.o"))) == 1
    # A "new process": empty in-memory cache, and compiling is forbidden.
    monkeypatch.setattr(bridge, "_compiled", {})

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled although the disk cache holds the kernel")

    monkeypatch.setattr(cjc, "get_or_compile_kernel", no_compile)
    second = _lower(lambda q, k, v: fn(q, k, v), *structs)
    assert second.count(CALL) == 1 and first.count(CALL) == 1


def test_vmap_over_queries_reads_shared_kv_once(monkeypatch):
    """vmap(q) against one K/V folds the vmapped axis into the query heads:
    the kernel reads K and V as given, not `n` broadcast copies."""
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_90a")
    n, (q, k, v) = 3, _structs(2, 64, 203, 4, 2, 64, jnp.bfloat16)
    qs = jax.ShapeDtypeStruct((n,) + q.shape, q.dtype)
    fn = jax.vmap(lambda q, k, v: jax_fa4.attention(q, k, v, implementation="cute"),
                  in_axes=(0, None, None))
    txt = _lower(fn, qs, k, v)
    call = next(line for line in txt.splitlines() if CALL in line)
    assert "(tensor<2x64x12x64xbf16>, tensor<2x203x2x64xbf16>, tensor<2x203x2x64xbf16>)" in call


@pytest.mark.parametrize("shape", [(0, 17, 4, 2), (2, 17, 0, 2)], ids=["batch0", "heads0"])
def test_empty_batch_or_heads_launch_no_kernel(monkeypatch, shape):
    """B = 0 or Hq = 0 (a CUDA grid may not be empty): no custom call; the outputs
    and gradients are empty, or zero for K and V."""
    from jax_fa4.config import AttentionConfig
    from jax_fa4.rules import kernels_cuda

    monkeypatch.setenv("JAX_FA4_ARCH", "sm_90a")
    b, s, hq, hkv = shape
    q = jnp.ones((b, s, hq, 64), jnp.bfloat16)
    k = jnp.full((b, 9, hkv, 64), 2.0, jnp.bfloat16)
    v = jnp.full(k.shape, 3.0, jnp.bfloat16)
    structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]

    def loss(q, k, v):
        return jnp.sum(jax_fa4.attention(q, k, v, causal=True, implementation="cute"))

    assert CALL not in _lower(jax.grad(loss, argnums=(0, 1, 2)), *structs)
    cfg = AttentionConfig(scale=0.125, causal=True)
    out, lse = kernels_cuda.forward(q, k, v, config=cfg, arch="sm_90a")
    assert out.shape == (b, s, hq, 64) and lse.shape == (b, hq, s)
    dq, dk, dv = kernels_cuda.backward(q, k, v, out, lse, out, lse, config=cfg, arch="sm_90a")
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert not jnp.any(dk) and not jnp.any(dv)


@pytest.mark.parametrize("d,causal", [(128, True), (64, False)])
def test_public_deterministic_backward_lowers(monkeypatch, d, causal):
    """attention(deterministic=True): on sm_90a and sm_100a (compiled, not run on
    hardware) the step's main backward kernel is the deterministic one (its int32
    semaphores, one per query tile, appear); at hdim 256 too (sm_100a: one per query
    tile and head-dim half, Note [Head-dim halves])."""
    def step(impl):
        def loss(q, k, v):
            out = jax_fa4.attention(q, k, v, causal=causal, implementation=impl,
                                    deterministic=True)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))

    b, sq, hq = 2, 113, 8
    from jax_fa4.kernels.sm90_bwd import bwd_tiles

    for arch, tile_m in (("sm_90a", bwd_tiles(d, causal).tile_m), ("sm_100a", 128)):
        monkeypatch.setenv("JAX_FA4_ARCH", arch)
        text = _lower(step("cute"), *_structs(b, sq, 203, hq, 2, d, jnp.bfloat16))
        assert text.count(CALL) == 4
        assert f"tensor<{b}x{hq}x{-(-sq // tile_m)}xi32>" in text
    structs = _structs(b, sq, 203, hq, 2, 256, jnp.bfloat16)
    for arch, sems in (("sm_90a", -(-sq // 64)), ("sm_100a", 2 * -(-sq // 64))):
        monkeypatch.setenv("JAX_FA4_ARCH", arch)
        text = _lower(step("cute"), *structs)
        assert text.count(CALL) == 4
        assert f"tensor<{b}x{hq}x{sems}xi32>" in text


def test_launch_plans_key_every_kernel_by_what_changes_it(monkeypatch):
    """The backward's plan keys its pre- and postprocess by the layouts they share
    with the main kernel: on sm_90a the flat dQ accumulator's query tile, and at
    hdim 128 (both masks) the by-thread statistics block; elsewhere row order. The
    lowering launches exactly the plan's keys, and the kernels built from them take
    those layouts."""
    from jax_fa4.config import AttentionConfig
    from jax_fa4.rules import kernels_cuda
    from jax_fa4.rules.plan import bwd_plan, fwd_plan

    layouts = {(a, d, c): (bwd_plan(a, "bfloat16", d, d, c, 0.1, False, False).pre.stat_block,
                           bwd_plan(a, "bfloat16", d, d, c, 0.1, False, False).post.dq_tile_m)
               for a in ("sm_90a", "sm_100a") for d in (64, 128, 256) for c in (False, True)}
    assert layouts == {("sm_90a", 64, False): (0, 128), ("sm_90a", 64, True): (0, 128),
                       ("sm_90a", 128, False): (64, 64), ("sm_90a", 128, True): (64, 64),
                       ("sm_90a", 256, False): (0, 64), ("sm_90a", 256, True): (0, 64),
                       **{("sm_100a", d, c): (0, 0) for d in (64, 128, 256)
                          for c in (False, True)}}
    assert [fwd_plan("sm_90a", "bfloat16", d, d, c, 0.1).tile_counter
            for d in (64, 128, 256) for c in (False, True)] == [False, True, False, True,
                                                               False, False]
    # The plan's pre/post keys do not depend on the mask: one kernel serves both.
    plans = [bwd_plan("sm_90a", "bfloat16", 128, 128, c, 0.1, False, True) for c in (0, 1)]
    assert plans[0].pre == plans[1].pre and plans[0].post == plans[1].post
    assert plans[0].main != plans[1].main

    keys = []
    real_call = kernels_cuda.kernel_call

    def call(key, *args, **kwargs):  # sees every key, compiled before or not
        keys.append(key)
        return real_call(key, *args, **kwargs)

    monkeypatch.setattr(kernels_cuda, "kernel_call", call)
    cfg = AttentionConfig(scale=0.1234, causal=True)

    def grads(q, k, v):
        out, lse = kernels_cuda.forward(q, k, v, config=cfg, arch="sm_90a")
        return kernels_cuda.backward(q, k, v, out, lse, out, lse, config=cfg, arch="sm_90a")

    text = _lower(grads, *_structs(2, 113, 203, 8, 2, 128, jnp.bfloat16))
    assert text.count(CALL) == 4
    plan = bwd_plan("sm_90a", "bfloat16", 128, 128, True, 0.1234, False, True)
    assert keys == [fwd_plan("sm_90a", "bfloat16", 128, 128, True, 0.1234).key,
                    plan.pre, plan.main, plan.post]
    assert plan.build_pre().stat_block == 64


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_negative_scale_runs_as_negated_q(monkeypatch, arch):
    """The kernels take scale > 0 (masked scores are -inf raw scores; the row max
    is of raw q.k). A negative scale lowers as -q with |scale|: every kernel key
    has the positive scale, and the HLO negates q before the forward and backward
    and dq after; a positive scale adds no negate."""
    from jax_fa4.rules import kernels_cuda

    monkeypatch.setenv("JAX_FA4_ARCH", arch)
    scales = []
    real_call = kernels_cuda.kernel_call

    def call(key, *args, **kwargs):
        scales.append((key.kind, key.scale))
        return real_call(key, *args, **kwargs)

    monkeypatch.setattr(kernels_cuda, "kernel_call", call)

    def loss(scale):
        def f(q, k, v):
            out = jax_fa4.attention(q, k, v, scale=scale, causal=True, implementation="cute")
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(f, argnums=(0, 1, 2))

    structs = _structs(2, 113, 203, 4, 2, 64, jnp.bfloat16)
    text = _lower(loss(-0.3), *structs)
    assert text.count(CALL) == 4
    main = {kind: s for kind, s in scales if kind in ("fwd", "bwd", "bwd_post")}
    assert main == {"fwd": 0.3, "bwd": 0.3, "bwd_post": 0.3}, scales
    negates = text.count("stablehlo.negate")
    scales.clear()
    assert "stablehlo.negate" not in _lower(loss(0.3), *structs)
    assert {kind: s for kind, s in scales if kind == "fwd"} == {"fwd": 0.3}
    assert negates == 3, negates  # q before the forward, q before the backward, dq
