"""The CuTe DSL kernels on an sm_90a GPU against the f32 reference.

Rule: the kernel's error vs the f32 reference is at most 2x the error of the
same math done in the input precision, plus a small atol. Every kernel output
is poisoned (NaN-filled before the kernel runs), so an element a kernel fails
to write fails the test.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_close_2x, rand_qkv

import jax_fa4
from jax_fa4 import reference
from jax_fa4.config import AttentionConfig
from jax_fa4.ffi import poison_outputs
from jax_fa4.rules.kernels_cuda import stores_dq

pytestmark = pytest.mark.gpu


def _fresh(f):
    """f jitted anew: its first call inside ``poison_outputs`` lowers it again, with
    the poisoned outputs, where a call of an already lowered jit of f would take the
    unpoisoned lowering from JAX's cache."""
    return jax.jit(lambda *args: f(*args))

CALL = "CuteDSLRT_NvJaxCutlassCall"


def _calls(b, sq, sk, d):
    """Kernel calls of a forward + backward step: the forward, the preprocess, the
    main kernel and the postprocess, none where the main kernel writes dQ itself
    (Note [One key block per query block] in kernels/sm90_bwd.py)."""
    config = AttentionConfig(scale=1.0, causal=True)
    return 3 if stores_dq(config, "sm_90a", b, sq, sk, d, d) else 4


SHAPES = [  # B, Sq, Sk, Hq, Hkv
    (1, 1, 1, 1, 1),
    (2, 17, 17, 4, 4),
    (2, 113, 203, 4, 1),
    (2, 203, 113, 2, 2),
    (1, 1000, 1000, 4, 2),
    (1, 4097, 4097, 2, 1),
]
DTYPES = [jnp.bfloat16, jnp.float16]
# (shape, head dim): every shape at hdim 64 and 128; hdims 96 and 256 without the
# longest one, to keep the device run short.
CASES = ([(s, d) for d in (64, 128) for s in SHAPES]
         + [(s, d) for d in (96, 256) for s in SHAPES[:-1]])


def _case_id(case):
    shape, d = case
    return "x".join(map(str, shape)) + f"-d{d}"


def _fwd(q, k, v, causal):
    return jax_fa4.attention(q, k, v, causal=causal, return_lse=True, implementation="cute")


def _ref(q, k, v, causal, dtype):
    """(out, lse) of the dense reference. Above 2^30 scores (20000 x 20000 x 5
    heads: 8 GiB of f32 at once, which ran out of memory beside 6 other test
    workers on the H200) it runs one kv head and its query heads at a time."""
    ref = functools.partial(reference.attention_dense, scale=q.shape[-1] ** -0.5,
                            causal=causal, compute_dtype=dtype)
    b, sq, hq, _ = q.shape
    hkv = k.shape[2]
    if b * hq * sq * k.shape[1] <= 1 << 30 or hkv == 1 and hq == 1:
        return ref(q, k, v)
    g = hq // hkv
    parts = [ref(q[:, :, h * g:(h + 1) * g], k[:, :, h:h + 1], v[:, :, h:h + 1])
             for h in range(hkv)]
    return (jnp.concatenate([p[0] for p in parts], axis=2),
            jnp.concatenate([p[1] for p in parts], axis=1))


def _cotangents(seed, b, sq, hq, dv):
    kd = jax.random.split(jax.random.key(seed), 2)
    return jax.random.normal(kd[0], (b, sq, hq, dv)), jax.random.normal(kd[1], (b, hq, sq))


def _api_grads(causal: bool, deterministic: bool = False):
    """(q, k, v, dout, dlse) -> (dq, dk, dv) through the public API with the kernels
    (implementation="cute"), cotangents for the output and the LSE."""
    def grads(q, k, v, dout, dlse):
        (out, lse), pullback = jax.vjp(lambda q, k, v: jax_fa4.attention(
            q, k, v, causal=causal, return_lse=True, implementation="cute",
            deterministic=deterministic), q, k, v)
        return pullback((dout.astype(out.dtype), dlse))
    return grads


def _assert_grads_2x(got, q, k, v, dout, dlse, causal):
    """(dq, dk, dv) of attention(q, k, v) with cotangents (dout, dlse) against the
    f32 reference's, by the 2x rule (the same math in q's dtype as the low side)."""
    def vjp_of(f):
        (out, lse), pullback = jax.vjp(f, q, k, v)
        return pullback((dout.astype(out.dtype), dlse))

    hi = vjp_of(lambda q, k, v: _ref(q.astype(jnp.float32), k.astype(jnp.float32),
                                     v.astype(jnp.float32), causal, jnp.float32))
    lo = vjp_of(lambda q, k, v: _ref(q, k, v, causal, q.dtype))
    for name, g, h, lw in zip(("dq", "dk", "dv"), got, hi, lo):
        assert_close_2x(g, h, lw, atol=2e-3, name=name)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_forward(case, causal, dtype):
    shape, d = case
    b, sq, sk, hq, hkv = shape
    q, k, v = rand_qkv(sq * 7 + d, b, sq, sk, hq, hkv, d, dtype=dtype)
    fn = jax.jit(functools.partial(_fwd, causal=causal))
    with poison_outputs():
        assert CALL in fn.lower(q, k, v).as_text()
        out, lse = fn(q, k, v)
    hi = _ref(q, k, v, causal, jnp.float32)
    lo = _ref(q, k, v, causal, dtype)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert_close_2x(out, hi[0], lo[0], atol=1e-3, name="out")
    assert_close_2x(lse, hi[1], lo[1], atol=1e-3, name="lse")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_backward(case, causal, dtype):
    shape, d = case
    b, sq, sk, hq, hkv = shape
    q, k, v = rand_qkv(sq * 5 + d + 1, b, sq, sk, hq, hkv, d, dtype=dtype)
    dout, dlse = _cotangents(sk, b, sq, hq, d)

    def vjp_of(f):
        (out, lse), pullback = jax.vjp(f, q, k, v)
        return pullback((dout.astype(out.dtype), dlse))

    fn = jax.jit(lambda: vjp_of(functools.partial(_fwd, causal=causal)))
    with poison_outputs():
        assert fn.lower().as_text().count(CALL) == _calls(b, sq, sk, d)
        got = fn()
    hi = vjp_of(lambda q, k, v: _ref(q.astype(jnp.float32), k.astype(jnp.float32),
                                     v.astype(jnp.float32), causal, jnp.float32))
    lo = vjp_of(lambda q, k, v: _ref(q, k, v, causal, dtype))
    for name, g, h, lw in zip(("dq", "dk", "dv"), got, hi, lo):
        assert g.dtype == dtype
        assert_close_2x(g, h, lw, atol=2e-3, name=name)


@pytest.mark.parametrize("shape,d,causal", [
    ((2, 1000, 1000, 8, 2), 128, True), ((1, 2000, 1999, 4, 4), 128, False),
    ((2, 777, 1500, 6, 2), 64, True), ((1, 1, 1, 1, 1), 64, False),
    ((1, 1500, 1500, 4, 2), 256, True),
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_without_lse_cotangent(shape, d, causal, deterministic):
    """attention without return_lse: LSE's cotangent is a symbolic zero, so the
    backward runs its three kernels alone (no zero-filled dLSE; the preprocess
    without the dLSE term, FlashBwdPreprocessNoDlse). dq, dk, dv by the 2x rule
    against the reference's with a zero LSE cotangent; outputs poisoned."""
    b, sq, sk, hq, hkv = shape
    q, k, v = rand_qkv(sq + 5 * d, b, sq, sk, hq, hkv, d)
    dout, _ = _cotangents(sq + 2, b, sq, hq, d)

    def grads(q, k, v, dout):
        out, pullback = jax.vjp(lambda q, k, v: jax_fa4.attention(
            q, k, v, causal=causal, implementation="cute", deterministic=deterministic),
            q, k, v)
        return pullback(dout.astype(out.dtype))

    fn = jax.jit(grads)
    hlo = fn.lower(q, k, v, dout).as_text()
    assert hlo.count(CALL) == _calls(b, sq, sk, d)
    zero_fill = [ln for ln in hlo.splitlines()
                 if "broadcast_in_dim" in ln and f"tensor<{b}x{hq}x{sq}xf32>" in ln]
    assert not zero_fill, zero_fill
    with poison_outputs():
        got = _fresh(grads)(q, k, v, dout)
    _assert_grads_2x(got, q, k, v, dout, jnp.zeros((b, hq, sq), jnp.float32), causal)


@pytest.mark.parametrize("shape,d,causal", [
    ((2, 1000, 1000, 8, 2), 128, True), ((1, 2000, 1999, 4, 4), 128, False),
    ((2, 777, 1500, 6, 2), 64, True), ((1, 1, 1, 1, 1), 64, False),
    ((1, 4096, 4096, 4, 4), 128, True), ((1, 3000, 3000, 4, 2), 64, False),
    ((1, 1500, 1500, 4, 2), 256, True), ((2, 1000, 1100, 4, 4), 192, False),
    ((1, 2000, 2000, 4, 2), 192, True),
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_backward_deterministic(shape, d, causal):
    """attention(deterministic=True): dQ, dK and dV bitwise equal over three runs,
    and within the 2x rule of the f32 reference; the lowered step carries the
    deterministic kernel's int32 semaphores. A hang here is the semaphore order
    failing."""
    b, sq, sk, hq, hkv = shape
    q, k, v = rand_qkv(sq + 3 * d, b, sq, sk, hq, hkv, d)
    dout, dlse = _cotangents(sq + 1, b, sq, hq, d)

    grads = jax.jit(_api_grads(causal, deterministic=True))

    from jax_fa4.rules.plan import bwd_plan

    # One semaphore per query block, none where the main kernel writes dQ itself
    # (one partial per query block: reproducible as it is).
    stored = _calls(b, sq, sk, d) == 3
    plan = bwd_plan("sm_90a", "bfloat16", d, d, causal, d**-0.5, True, True,
                    one_key_block=stored)
    hlo = grads.lower(q, k, v, dout, dlse).as_text()
    assert bool(plan.sem_tile_m) != stored
    if plan.sem_tile_m:
        assert f"tensor<{b}x{hq}x{-(-sq // plan.sem_tile_m)}xi32>" in hlo
    with poison_outputs():
        poisoned = _fresh(grads)
        runs = [jax.block_until_ready(poisoned(q, k, v, dout, dlse)) for _ in range(3)]
    for name, i in (("dq", 0), ("dk", 1), ("dv", 2)):
        for r in runs[1:]:
            assert bool(jnp.all(r[i] == runs[0][i])), f"{name} differs between runs"
    _assert_grads_2x(runs[0], q, k, v, dout, dlse, causal)


def test_vmap_of_grad_on_kernel():
    q, k, v = rand_qkv(11, 2, 130, 130, 4, 2, 64)
    qs = jnp.stack([q, (q.astype(jnp.float32) * 0.5).astype(q.dtype), -q])

    def loss(attn):
        return lambda q, k, v: jnp.sum(attn(q, k, v)[0].astype(jnp.float32) ** 2)

    cute = lambda q, k, v: _fwd(q, k, v, True)  # noqa: E731
    with poison_outputs():
        got = jax.jit(jax.vmap(jax.grad(loss(cute), argnums=(0, 1, 2)),
                               in_axes=(0, None, None)))(qs, k, v)
    for i in range(3):
        hi = jax.grad(loss(lambda q, k, v: _ref(q, k, v, True, jnp.float32)), argnums=(0, 1, 2))(
            qs[i].astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
        )
        lo = jax.grad(loss(lambda q, k, v: _ref(q, k, v, True, jnp.bfloat16)), argnums=(0, 1, 2))(
            qs[i], k, v
        )
        for g, h, lw in zip(got, hi, lo):
            assert_close_2x(g[i], h, lw, atol=5e-3)


def test_flax_nnx_train_step_on_kernel():
    import optax
    from flax import nnx

    import jax_fa4.flax

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.MultiHeadAttention(
                num_heads=2, in_features=128, decode=False, dtype=jnp.bfloat16,
                attention_fn=functools.partial(jax_fa4.flax.attention_fn, implementation="cute"),
                rngs=rngs,
            )

        def __call__(self, x):
            return self.attn(x, is_causal=True).astype(jnp.float32)

    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(5), (4, 256, 128))
    y = jnp.cumsum(x, axis=1) / jnp.arange(1, 257)[None, :, None]

    @nnx.jit
    def step(model, opt):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        return loss

    with poison_outputs():
        losses = [float(step(model, opt)) for _ in range(20)]
    assert all(jnp.isfinite(jnp.array(losses)))
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("d,causal", [(128, True), (64, False)])
def test_negative_scale(d, causal):
    """A negative softmax scale (the kernels run it as -q with |scale|): forward and
    gradients against the f32 reference with that scale. The scores are large
    (inputs x 4, scale -1): taken as a max of raw q.k with -inf masking, the
    exponents would overflow and the masked entries turn to inf."""
    b, sq, sk, hq, hkv = 2, 203, 113, 4, 2
    q, k, v = rand_qkv(d + 3, b, sq, sk, hq, hkv, d, dtype=jnp.bfloat16)
    q, k = (q * 4).astype(jnp.bfloat16), (k * 4).astype(jnp.bfloat16)
    scale = -1.0
    dout, dlse = _cotangents(d, b, sq, hq, d)

    def vjp_of(f):
        (out, lse), pullback = jax.vjp(f, q, k, v)
        return (out, lse), pullback((dout.astype(out.dtype), dlse))

    def ref(dtype):
        return vjp_of(lambda q, k, v: reference.attention_dense(
            q.astype(dtype), k.astype(dtype), v.astype(dtype), scale=scale, causal=causal,
            compute_dtype=dtype))

    fn = jax.jit(lambda: vjp_of(lambda q, k, v: jax_fa4.attention(
        q, k, v, scale=scale, causal=causal, return_lse=True, implementation="cute")))
    with poison_outputs():
        assert fn.lower().as_text().count(CALL) == _calls(b, sq, sk, d)
        (out, lse), grads = fn()
    (hi_out, hi_lse), hi = ref(jnp.float32)
    (lo_out, lo_lse), lo = ref(jnp.bfloat16)
    assert_close_2x(out, hi_out, lo_out, atol=1e-3, name="out")
    assert_close_2x(lse, hi_lse, lo_lse, atol=1e-3, name="lse")
    for name, g, h, lw in zip(("dq", "dk", "dv"), grads, hi, lo):
        assert_close_2x(g, h, lw, atol=2e-3, name=name)


@pytest.mark.parametrize("d,causal", [(128, True), (64, False), (256, True)])
def test_backward_chain_of_steps(d, causal):
    """The backward's three kernels form a programmatic-dependent-launch chain on
    sm_90a: each starts while its predecessor drains and waits before it reads. In a
    chain of four steps, where each step's dO and q come from the step before through
    XLA kernels, a kernel that read its inputs early would give gradients that vary
    from run to run or are wrong. With the deterministic backward (taken here at hdim
    64 and 128) the three runs must be bitwise equal; every run's first step meets
    the 2x rule."""
    b, s, h = 2, 1000, 4
    q, k, v = rand_qkv(d + 11, b, s, s, h, h, d, dtype=jnp.bfloat16)
    dout, dlse = _cotangents(d + 12, b, s, h, d)
    det = d != 256

    def step(q, dout):
        (out, lse), pullback = jax.vjp(lambda q, k, v: jax_fa4.attention(
            q, k, v, causal=causal, return_lse=True, implementation="cute",
            deterministic=det), q, k, v)
        return out, pullback((dout, dlse))

    def chain(q, dout):
        grads = []
        for _ in range(4):
            out, g = step(q, dout)
            grads.append(g)
            dout = (0.5 * dout + g[0] * 64).astype(dout.dtype)
            q = (q - 0.25 * out).astype(q.dtype)
        return grads

    dout = dout.astype(jnp.bfloat16)
    fn = jax.jit(chain)
    with poison_outputs():
        runs = [jax.tree.leaves(jax.block_until_ready(fn(q, dout))) for _ in range(3)]
    for r in runs:
        assert all(bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))) for a in r)
        _assert_grads_2x(r[:3], q, k, v, dout, dlse, causal)
    if det:
        assert all(bool(jnp.all(a == b_)) for r in runs[1:] for a, b_ in zip(r, runs[0])), (
            "deterministic gradients differ between runs")


def test_exp2_poly_matches_host_mirror():
    """The scalar software exp2 (``exp2_poly``, Note [Software exp2]) on the GPU
    against its numpy mirror: inputs over the softmax's whole domain (-inf, the
    flush edge, -126..8, integers and values just below them); the results must
    agree to one float32 ulp (the mirror's documented fma double rounding) and
    lie within 1.2e-4 relative of exact 2^x."""
    import numpy as np
    from cutlass.jax import TensorSpec, cutlass_call
    from exp2_launcher import exp2_poly_launcher

    from jax_fa4.kernels.exp2 import exp2_poly_numpy

    n = 1 << 16
    rng = np.random.default_rng(7)
    x = rng.uniform(-126.0, 8.0, n).astype(np.float32)
    edge = np.array([-np.inf, -200.0, -127.0, -126.5, -126.0, -125.99, -1e-30, 0.0, 1e-30,
                     0.5, 1.0, 7.999], np.float32)
    ints = np.arange(-126, 8, dtype=np.float32)
    x[: edge.size] = edge
    x[edge.size: edge.size + ints.size] = ints
    x[edge.size + ints.size: edge.size + 2 * ints.size] = np.nextafter(ints, np.float32(-1e9))

    spec = TensorSpec(divisibility=(1,))
    # The output is a NaN-filled buffer aliased in: an element the kernel skips fails.
    call = jax.jit(cutlass_call(
        exp2_poly_launcher(n), output_shape_dtype=jax.ShapeDtypeStruct((n,), jnp.float32),
        input_spec=[spec, spec], output_spec=[spec], input_output_aliases={1: 0}))
    got = np.asarray(call(jnp.asarray(x), jnp.full((n,), jnp.nan, jnp.float32)))
    want = exp2_poly_numpy(x)
    ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1, (x[ulps.argmax()], got[ulps.argmax()], want[ulps.argmax()])
    assert got[0] == 0.0 and got[1] == 0.0  # -inf and below the clamp flush to 0
    exact = np.exp2(x.astype(np.float64))
    normal = x >= -126.0
    rel = np.abs(got[normal] - exact[normal]) / exact[normal]
    assert rel.max() < 1.2e-4, rel.max()
