"""The CuTe DSL kernels on an sm_90a GPU against the f32 reference.

Rule: the kernel's error vs the f32 reference is at most 2x the error of the
same math done in the input precision, plus a small atol. Every kernel output
is poisoned (NaN-filled before the kernel runs), so an element a kernel fails
to write fails the test.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_close_2x, rand_qkv

import jax_fa4
from jax_fa4 import reference
from jax_fa4.ffi import poison_outputs

pytestmark = pytest.mark.gpu

CALL = "CuteDSLRT_NvJaxCutlassCall"
SHAPES = [  # B, Sq, Sk, Hq, Hkv
    (1, 1, 1, 1, 1),
    (2, 17, 17, 4, 4),
    (2, 113, 203, 4, 1),
    (2, 203, 113, 2, 2),
    (1, 1000, 1000, 4, 2),
    (1, 4097, 4097, 2, 1),
]
DTYPES = [jnp.bfloat16, jnp.float16]
# (shape, head dim): every shape at hdim 64 and 128; hdim 256 without the
# longest one, to keep the device run short.
CASES = [(s, d) for d in (64, 128) for s in SHAPES] + [(s, 256) for s in SHAPES[:-1]]


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


def _grads_under_env(monkeypatch, var: str, values, grads, args, calls: int = 1):
    """{value: [grads(*args) of each call]} with $var set to each value in turn; a new
    jit function per value (lowered under that setting), every output poisoned."""
    runs = {}
    for value in values:
        monkeypatch.setenv(var, value)
        fn = jax.jit(grads)
        with poison_outputs():
            runs[value] = [jax.block_until_ready(fn(*args)) for _ in range(calls)]
    return runs


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
        assert fn.lower().as_text().count(CALL) == 4
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
    if deterministic and d == 256:
        pytest.skip("no deterministic hdim 256 backward")
    q, k, v = rand_qkv(sq + 5 * d, b, sq, sk, hq, hkv, d)
    dout, _ = _cotangents(sq + 2, b, sq, hq, d)

    def grads(q, k, v, dout):
        out, pullback = jax.vjp(lambda q, k, v: jax_fa4.attention(
            q, k, v, causal=causal, implementation="cute", deterministic=deterministic),
            q, k, v)
        return pullback(dout.astype(out.dtype))

    fn = jax.jit(grads)
    hlo = fn.lower(q, k, v, dout).as_text()
    assert hlo.count(CALL) == 4
    zero_fill = [ln for ln in hlo.splitlines()
                 if "broadcast_in_dim" in ln and f"tensor<{b}x{hq}x{sq}xf32>" in ln]
    assert not zero_fill, zero_fill
    with poison_outputs():
        got = fn(q, k, v, dout)
    _assert_grads_2x(got, q, k, v, dout, jnp.zeros((b, hq, sq), jnp.float32), causal)


@pytest.mark.parametrize("shape,d,causal", [
    ((2, 1000, 1000, 8, 2), 128, True), ((1, 2000, 1999, 4, 4), 128, False),
    ((2, 777, 1500, 6, 2), 64, True), ((1, 1, 1, 1, 1), 64, False),
    ((1, 4096, 4096, 4, 4), 128, True), ((1, 3000, 3000, 4, 2), 64, False),
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

    from jax_fa4.kernels.sm90_bwd import bwd_tiles

    tile_m = bwd_tiles(d, causal).tile_m  # one semaphore per query block
    hlo = grads.lower(q, k, v, dout, dlse).as_text()
    assert f"tensor<{b}x{hq}x{-(-sq // tile_m)}xi32>" in hlo
    with poison_outputs():
        runs = [jax.block_until_ready(grads(q, k, v, dout, dlse)) for _ in range(3)]
    for name, i in (("dq", 0), ("dk", 1), ("dv", 2)):
        for r in runs[1:]:
            assert bool(jnp.all(r[i] == runs[0][i])), f"{name} differs between runs"
    _assert_grads_2x(runs[0], q, k, v, dout, dlse, causal)


@pytest.mark.parametrize("shape,d,causal", [
    ((2, 1000, 1000, 8, 2), 128, True), ((1, 777, 4097, 2, 1), 64, False),
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_store_first_switch(monkeypatch, shape, d, causal, deterministic):
    """JAX_FA4_DQ_STORE_FIRST=1 (Note [dQ store first]; off in the tile table): the
    preprocess zeroes the main kernel's semaphores instead of dQaccum, which the main
    kernel never reads before writing. Through the public API: the 2x rule, and with
    deterministic=True bitwise equal over two runs and to the zeroing backward's."""
    from jax_fa4.config import DQ_STORE_FIRST_ENV

    b, sq, sk, hq, hkv = shape
    q, k, v = rand_qkv(sq + 5 * d, b, sq, sk, hq, hkv, d)
    dout, dlse = _cotangents(sq + 2, b, sq, hq, d)

    runs = _grads_under_env(monkeypatch, DQ_STORE_FIRST_ENV, ("1", "0"),
                            _api_grads(causal, deterministic), (q, k, v, dout, dlse), calls=2)
    if deterministic:
        for i, name in enumerate(("dq", "dk", "dv")):
            for r in (runs["1"][1], runs["0"][0]):
                assert bool(jnp.all(r[i] == runs["1"][0][i])), f"{name} differs"
    _assert_grads_2x(runs["1"][0], q, k, v, dout, dlse, causal)


@pytest.mark.parametrize("shape,d,causal", [
    ((2, 1000, 1000, 8, 2), 128, True), ((3, 777, 1500, 6, 2), 64, False),
    ((2, 300, 200, 4, 2), 256, True), ((1, 1, 1, 1, 1), 128, False),
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_prepost_reversed(monkeypatch, shape, d, causal, deterministic):
    """JAX_FA4_PREPOST_REVERSE=1 / 0 (Note [Pre / post order]; passed on the H200,
    twenty-sixth session): the preprocess and postprocess walk (batch, head) from the
    last to the first (the default) / in grid order.
    Through the public API with an LSE cotangent: the 2x rule, outputs poisoned;
    deterministic gradients bitwise equal to the grid-order ones."""
    from jax_fa4.config import PREPOST_REVERSE_ENV

    b, sq, sk, hq, hkv = shape
    if deterministic and d == 256:
        pytest.skip("no deterministic hdim 256 backward")
    q, k, v = rand_qkv(sq + 7 * d, b, sq, sk, hq, hkv, d)
    dout, dlse = _cotangents(sq + 3, b, sq, hq, d)
    runs = _grads_under_env(monkeypatch, PREPOST_REVERSE_ENV, ("1", "0"),
                            _api_grads(causal, deterministic), (q, k, v, dout, dlse))
    if deterministic:
        for i, name in enumerate(("dq", "dk", "dv")):
            assert bool(jnp.all(runs["1"][0][i] == runs["0"][0][i])), f"{name} differs"
    _assert_grads_2x(runs["1"][0], q, k, v, dout, dlse, causal)


@pytest.mark.parametrize("shape,d,causal,max_sq", [
    ((2, 1000, 1000, 8, 2), 128, True, 2048),  # 16 query tiles of 64: store first
    ((2, 1000, 1000, 8, 2), 128, True, 960),  # 1024 > 960: zero and add (two buffers)
    ((1, 777, 4097, 2, 1), 64, False, 768),  # 7 tiles of 128 = 896 > 768: add
    ((1, 777, 4097, 2, 1), 64, False, 896),  # 896 <= 896: store first
    ((3, 1, 1, 4, 4), 128, True, 64),  # one row, one tile: store first
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_backward_store_first_by_length(monkeypatch, shape, d, causal, max_sq):
    """JAX_FA4_DQ_FIRST_MAX_SQ (Note [dQ store first by length]; not yet run when
    added): one main-kernel binary that stores first where the query tiles cover
    at most max_sq rows and otherwise adds into the dQaccum its preprocess zeroed
    then, through two dQ buffers. Both sides of the boundary at both head dims,
    with every output poisoned: the 2x rule."""
    from jax_fa4.config import DQ_FIRST_MAX_SQ_ENV, DQ_STORE_FIRST_ENV

    monkeypatch.delenv(DQ_STORE_FIRST_ENV, raising=False)
    monkeypatch.setenv(DQ_FIRST_MAX_SQ_ENV, str(max_sq))
    b, sq, sk, hq, hkv = shape
    q, k, v = rand_qkv(sq + 7 * d, b, sq, sk, hq, hkv, d)
    dout, dlse = _cotangents(sq + 3, b, sq, hq, d)

    grads = _api_grads(causal)

    with poison_outputs():
        got = jax.block_until_ready(jax.jit(grads)(q, k, v, dout, dlse))
    _assert_grads_2x(got, q, k, v, dout, dlse, causal)


@pytest.mark.parametrize("shape,d,causal", [
    ((2, 1000, 1000, 8, 2), 128, True),  # GQA, a partial last block, tiles of 64
    ((2, 1000, 1000, 8, 2), 128, False),
    ((1, 777, 4097, 2, 1), 64, False),  # Sk > Sq, tiles of 128 (two staged pieces)
    ((2, 1200, 333, 4, 4), 64, True),  # Sq > Sk: the query blocks of key block 0 only
    ((3, 1, 1, 4, 4), 128, True),  # one row, one key block
    ((1, 4096, 4096, 16, 16), 128, True),  # many CTAs per query block
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
@pytest.mark.parametrize("lag", ["1", "3"])
def test_backward_dq_fold(monkeypatch, shape, d, causal, lag):
    """JAX_FA4_DQ_FOLD=1 (Note [dQ fold]): the last key block to add into a query
    block converts it, so dQ comes from the main kernel and no postprocess runs.
    Every output is poisoned (NaN), so a query block nobody converted, or a row
    written twice from a partial sum, fails the 2x rule; run twice, since the
    converting CTA changes from run to run. lag: the dQ warp hands an item on that
    many items after its adds."""
    from jax_fa4.config import DQ_FIRST_MAX_SQ_ENV, DQ_FOLD_ENV, DQ_STORE_FIRST_ENV

    monkeypatch.delenv(DQ_STORE_FIRST_ENV, raising=False)
    monkeypatch.delenv(DQ_FIRST_MAX_SQ_ENV, raising=False)
    monkeypatch.setenv(DQ_FOLD_ENV, lag)
    b, sq, sk, hq, hkv = shape
    q, k, v = rand_qkv(sq + 11 * d, b, sq, sk, hq, hkv, d)
    dout, dlse = _cotangents(sq + 5, b, sq, hq, d)

    grads = _api_grads(causal)

    fn = jax.jit(grads)
    # forward, preprocess, main kernel: no postprocess
    assert fn.lower(q, k, v, dout, dlse).as_text().count("stablehlo.custom_call") == 3
    with poison_outputs():
        runs = [jax.block_until_ready(fn(q, k, v, dout, dlse)) for _ in range(2)]
    for got in runs:
        _assert_grads_2x(got, q, k, v, dout, dlse, causal)


def test_vmap_of_grad_on_kernel():
    q, k, v = rand_qkv(11, 2, 130, 130, 4, 2, 64)
    qs = jnp.stack([q, (q.astype(jnp.float32) * 0.5).astype(q.dtype), -q])

    def loss(attn):
        return lambda q, k, v: jnp.sum(attn(q, k, v)[0].astype(jnp.float32) ** 2)

    cute = lambda q, k, v: _fwd(q, k, v, True)  # noqa: E731
    got = jax.jit(jax.vmap(jax.grad(loss(cute), argnums=(0, 1, 2)), in_axes=(0, None, None)))(
        qs, k, v
    )
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

    losses = [float(step(model, opt)) for _ in range(20)]
    assert all(jnp.isfinite(jnp.array(losses)))
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("shape,d,parts", [
    ((1, 1500, 1500, 18, 6), 128, 3),  # 216 tiles: 84 left, 3 parts; GQA; Sk % 128 != 0
    ((1, 1000, 1000, 20, 20), 128, 2),  # 160 tiles: 28 left, parts of 4 key blocks
    ((1, 4096, 4096, 34, 34), 128, 4),  # 1088 tiles: 8 rounds and 32 left
    ((1, 2000, 1999, 14, 7), 64, 4),  # 192-row tiles: 154, 22 left
    ((2, 113, 203, 4, 4), 128, 1),  # fewer tiles than SMs: nothing to split
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_forward_split_tail(shape, d, parts):
    """Sm90FwdTiles.split_tail (Note [Split tail]), through the kernel alone: the
    tiles of the grid's last round in 2-4 parts along the keys, merged by the part
    that counts in last. O and LSE (poisoned) against the f32 reference, 2x rule;
    each tail tile's counter ends at the number of parts."""
    from cutlass.jax import TensorSpec, cutlass_call

    from jax_fa4.kernels.sm90_fwd import (
        FlashFwdSm90Split,
        fwd_tiles,
        make_fwd_sm90,
        split_tail_parts,
    )

    b, sq, sk, hq, hkv = shape
    dtype = jnp.bfloat16
    # Without the table's K/V multicast, which the split tail does not serve.
    tiles = dataclasses.replace(fwd_tiles(d, d, False), split_tail=True, cluster_m=1)
    kernel = make_fwd_sm90(dtype, d, d, False, tiles=tiles)
    assert isinstance(kernel, FlashFwdSm90Split)
    total = -(-sq // tiles.tile_m) * hq * b
    assert split_tail_parts(total, min(total, kernel.num_sms), -(-sk // tiles.tile_n)) == parts
    counters, part_o, part_lse = kernel.split_shapes(b, sq, sk, hq)
    spec = TensorSpec(divisibility=(1, 1, 1, d))
    lse_spec = TensorSpec(divisibility=(1, 1, 1))
    ws_spec = TensorSpec(divisibility=(1, 1, 1))
    one = TensorSpec(divisibility=(1,))
    out_sd = (jax.ShapeDtypeStruct((b, sq, hq, d), dtype),
              jax.ShapeDtypeStruct((b, hq, sq), jnp.float32),
              jax.ShapeDtypeStruct(part_o, jnp.float32),
              jax.ShapeDtypeStruct(part_lse, jnp.float32),
              jax.ShapeDtypeStruct(counters, jnp.int32))
    call = jax.jit(cutlass_call(
        kernel, output_shape_dtype=out_sd,
        input_spec=[spec, spec, spec, one, spec, lse_spec],
        output_spec=[spec, lse_spec, ws_spec, ws_spec, one],
        input_output_aliases={3: 4, 4: 0, 5: 1}))
    q, k, v = rand_qkv(sq + d, b, sq, sk, hq, hkv, d, dtype=dtype)
    out, lse, _, _, count = call(q, k, v, jnp.zeros(counters, jnp.int32),
                                 jnp.full((b, sq, hq, d), jnp.nan, dtype),
                                 jnp.full((b, hq, sq), jnp.nan, jnp.float32))
    tail = total - (total // min(total, kernel.num_sms)) * min(total, kernel.num_sms)
    if parts > 1:  # every tail tile counted in once per part
        assert count.tolist() == [parts] * tail, count
    else:
        assert count.tolist() == [0], count
    hi = _ref(q, k, v, False, jnp.float32)
    lo = _ref(q, k, v, False, dtype)
    assert_close_2x(out, hi[0], lo[0], atol=1e-3, name="out")
    assert_close_2x(lse, hi[1], lo[1], atol=1e-3, name="lse")


_KNOBS = {  # name: (causal, Sm90FwdTiles overrides)
    "persistent": (False, {"persistent": True}),
    "lpt": (True, {"lpt": True, "persistent": False}),
    "dynamic": (True, {"persistent": True, "lpt": False}),
    "dynamic_lpt": (True, {"persistent": True, "lpt": True}),
    # hdim 256: persistent CTAs with O in the Q buffer (no SMEM for a separate one).
    "persistent_o_in_q": (False, {"persistent": True, "separate_o": False}),
    # The dynamic scheduler does not serve the table's K/V multicast at hdim 256
    # causal (cluster_m 2 since the twenty-second session).
    "dynamic_o_in_q": (True, {"persistent": True, "separate_o": False, "cluster_m": 1}),
    # FA4's software exp2 for a quarter of P's elements (Note [Software exp2]).
    "sw_exp2": (False, {"sw_exp2_per_32": 8}),
    "sw_exp2_causal": (True, {"sw_exp2_per_32": 8}),
    # Diagonal blocks masked through a keep bitmask per row (TileMask(bitmask=True)).
    "bitmask": (True, {"mask_bitmask": True}),
    # The row max's quad shuffles NaN-propagating (quad_fmax=False), as before the
    # table took quad_fmax.
    "nan_quad_max": (False, {"quad_fmax": False}),
    "nan_quad_max_causal": (True, {"quad_fmax": False}),
    # The thread's columns max-reduced with fmax in four chains (row_fmax).
    "row_fmax": (False, {"row_fmax": True}),
    "row_fmax_causal": (True, {"row_fmax": True}),
    # P's row sum in 8 / 2 chains (Note [Row sum in chains]).
    "row_sum_chains": (False, {"row_sum_chains": 8}),
    "row_sum_chains_causal": (True, {"row_sum_chains": 8}),
    "row_sum_chains2_causal": (True, {"row_sum_chains": 2}),
    # Q as the register operand of S = Q K^T (hdim 128).
    "q_in_regs": (False, {"q_in_regs": True}),
    "q_in_regs_causal": (True, {"q_in_regs": True}),
    # K/V multicast in clusters of 2 CTAs (Note [K/V multicast]).
    "multicast": (False, {"cluster_m": 2}),
    # Causal, one CTA per tile: the cluster walks its last block's keys.
    "multicast_causal": (True, {"cluster_m": 2, "persistent": False}),
    "multicast_causal_per_head": (True, {"cluster_m": 2, "persistent": False, "lpt": False}),
}


@pytest.mark.parametrize("knob,shape,d", [
    ("persistent", (1, 1, 1, 1, 1), 128), ("persistent", (2, 113, 203, 4, 4), 128),
    ("persistent", (2, 2000, 2000, 8, 2), 128), ("persistent", (2, 2000, 1999, 8, 2), 64),
    ("lpt", (1, 1, 1, 1, 1), 128), ("lpt", (3, 700, 700, 5, 5), 128),
    ("lpt", (2, 2000, 2000, 8, 2), 128), ("lpt", (1, 20000, 20000, 5, 5), 128),
    ("lpt", (2, 2000, 1999, 6, 2), 64), ("lpt", (1, 1500, 1500, 3, 3), 256),
    ("dynamic", (1, 1, 1, 1, 1), 128), ("dynamic", (2, 113, 203, 4, 4), 128),
    ("dynamic", (3, 3000, 3000, 8, 2), 128), ("dynamic", (2, 2000, 1999, 6, 2), 64),
    ("dynamic_lpt", (3, 3000, 3000, 8, 2), 128), ("dynamic_lpt", (2, 4000, 4000, 6, 2), 64),
    ("persistent_o_in_q", (2, 3000, 2999, 8, 2), 256), ("persistent_o_in_q", (1, 1, 1, 1, 1), 256),
    ("dynamic_o_in_q", (2, 3000, 3000, 8, 2), 256), ("dynamic_o_in_q", (1, 130, 200, 3, 1), 256),
    ("sw_exp2", (2, 1000, 999, 8, 2), 128), ("sw_exp2", (2, 113, 203, 4, 4), 64),
    ("sw_exp2_causal", (2, 2000, 2000, 8, 2), 128), ("sw_exp2_causal", (1, 300, 200, 2, 1), 256),
    ("bitmask", (1, 1, 1, 1, 1), 128), ("bitmask", (2, 1000, 999, 8, 2), 128),
    ("bitmask", (2, 2000, 1999, 6, 2), 64), ("bitmask", (1, 300, 200, 2, 1), 256),
    ("bitmask", (2, 203, 1113, 4, 4), 128),
    ("nan_quad_max", (2, 1000, 999, 8, 2), 128),
    ("nan_quad_max_causal", (2, 2000, 1999, 6, 2), 64),
    ("row_fmax", (2, 1000, 999, 8, 2), 128), ("row_fmax_causal", (2, 2000, 1999, 6, 2), 64),
    ("row_fmax_causal", (1, 300, 200, 2, 1), 256),
    ("row_sum_chains", (2, 2000, 1999, 6, 2), 64), ("row_sum_chains", (2, 1000, 999, 8, 2), 128),
    ("row_sum_chains_causal", (2, 2000, 1999, 6, 2), 64),
    ("row_sum_chains_causal", (1, 300, 200, 2, 1), 256),
    ("row_sum_chains2_causal", (2, 203, 1113, 4, 4), 64),
    ("q_in_regs", (1, 1, 1, 1, 1), 128), ("q_in_regs", (2, 1000, 999, 8, 2), 128),
    ("q_in_regs", (2, 2000, 2000, 8, 2), 128), ("q_in_regs_causal", (2, 113, 203, 4, 4), 128),
    ("q_in_regs_causal", (3, 3000, 3000, 8, 2), 128),
    ("multicast", (1, 1, 1, 1, 1), 128), ("multicast", (2, 1000, 999, 8, 2), 128),
    ("multicast", (1, 4097, 4097, 4, 1), 128), ("multicast", (3, 3000, 3000, 8, 2), 128),
    ("multicast", (2, 2000, 1999, 6, 2), 64), ("multicast", (2, 1000, 999, 8, 2), 256),
    ("multicast", (1, 300, 200, 2, 1), 256),
    ("multicast_causal", (1, 300, 200, 2, 1), 256),
    ("multicast_causal", (2, 1000, 1000, 8, 2), 256),
    ("multicast_causal", (1, 20000, 20000, 5, 5), 128),
    ("multicast_causal", (2, 203, 1113, 4, 4), 128),
    ("multicast_causal_per_head", (3, 700, 700, 5, 5), 128),
    ("multicast_causal_per_head", (1, 1500, 1500, 3, 3), 256),
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_forward_tile_order_knobs(knob, shape, d):
    """Knobs of the forward's tile order, through the kernel alone.

    persistent (non-causal): from one tile to more tiles than SMs (256 at
    2000 x 2000), so every CTA walks several tiles and reuses its pipelines,
    ping-pong turns and O buffer. lpt (causal, FA4's longest-first order over L2
    sections of heads): one section holding all heads (64 at 700 tokens), and at
    20000 tokens sections of 4 heads with one head left over. dynamic (causal
    persistent CTAs taking tiles from a zeroed global counter, per-head or LPT
    order): 576 and 504 tiles over 132 CTAs, GQA, Sq != Sk, one tile. *_o_in_q
    (hdim 256, not yet run): persistent CTAs whose O leaves through the Q buffer,
    384 tiles, so the next tile's Q must wait for the O store. sw_exp2: every
    fourth exp2 of P from the polynomial, both masks, hdim 64 / 128 / 256. bitmask
    (causal): the diagonal blocks masked by a 32-bit keep mask per row, at 64 / 128
    / 256 (20 elements a row), Sk below, at and above Sq. nan_quad_max: the row
    max's quad shuffles NaN-propagating (the table uses fmax, quad_fmax). row_fmax
    (not yet run when added): the thread's columns max-reduced with fmax in four
    chains, the old max folded in before the shuffles; hdim 64 / 128 / 256.
    row_sum_chains (passed on the H200, twenty-sixth session, after the hdim 256
    case's fix: 20 elements a row in 8 chains): P's row sum in 8 (or 2) chains, hdim
    64 / 128 / 256, Sk below, at and above Sq.
    q_in_regs (hdim 128, not yet run when added): Q loaded into registers once per
    tile (ldmatrix) as the A operand of S = Q K^T, the Q buffer released at once;
    one tile, fewer and more tiles than SMs, both masks. multicast (not yet run
    when added): clusters of 2 CTAs sharing each K / V block through multicast
    TMA, at hdim 64 / 128 (persistent) and 256 (one CTA per tile); odd query-block
    counts (1, 33, 11, 3), where the last cluster's second CTA runs past the end,
    and 192 cluster units over 66 clusters. multicast_causal (not yet run when
    added): causal with a CTA per tile, in clusters of 2; the CTA of the lower
    query block releases the stages of the keys past its diagonal unread; LPT
    order over clusters (sections of heads at 20000 tokens) and per head; Sk above
    and below Sq, odd block counts."""
    from cutlass.jax import TensorSpec, cutlass_call

    from jax_fa4.kernels.sm90_fwd import FlashFwdSm90Dynamic, fwd_tiles, make_fwd_sm90

    b, sq, sk, hq, hkv = shape
    causal, over = _KNOBS[knob]
    dtype = jnp.bfloat16
    tiles = dataclasses.replace(fwd_tiles(d, d, causal), **over)
    kernel = make_fwd_sm90(dtype, d, d, causal, tiles=tiles)
    dynamic = isinstance(kernel, FlashFwdSm90Dynamic)
    if "persistent" in over:  # the other knobs keep the table's tile order
        assert dynamic == knob.startswith("dynamic")
    spec = TensorSpec(divisibility=(1, 1, 1, d))
    lse_spec = TensorSpec(divisibility=(1, 1, 1))
    one = TensorSpec(divisibility=(1,))
    out_sd = (jax.ShapeDtypeStruct((b, sq, hq, d), dtype),
              jax.ShapeDtypeStruct((b, hq, sq), jnp.float32),
              jax.ShapeDtypeStruct((1,), jnp.int32))
    n_in = 4 if dynamic else 3
    call = jax.jit(cutlass_call(
        kernel, output_shape_dtype=out_sd[:3 if dynamic else 2],
        input_spec=[spec, spec, spec] + [one] * dynamic + [spec, lse_spec],
        output_spec=[spec, lse_spec] + [one] * dynamic,
        input_output_aliases={n_in: 0, n_in + 1: 1, **({3: 2} if dynamic else {})}))
    q, k, v = rand_qkv(sq + d, b, sq, sk, hq, hkv, d, dtype=dtype)
    counter = (jnp.zeros((1,), jnp.int32),) if dynamic else ()
    res = call(q, k, v, *counter, jnp.full((b, sq, hq, d), jnp.nan, dtype),
               jnp.full((b, hq, sq), jnp.nan, jnp.float32))
    out, lse = res[:2]
    if dynamic:  # one claim per tile run: the counter ends at the tile count
        assert int(res[2][0]) == -(-sq // tiles.tile_m) * hq * b, int(res[2][0])
    hi = _ref(q, k, v, causal, jnp.float32)
    lo = _ref(q, k, v, causal, dtype)
    assert_close_2x(out, hi[0], lo[0], atol=1e-3, name="out")
    assert_close_2x(lse, hi[1], lo[1], atol=1e-3, name="lse")


@pytest.mark.parametrize("d,causal,shape", [
    (64, False, (2, 1000, 999, 4, 1)), (64, False, (1, 1, 1, 1, 1)),
    (64, True, (2, 113, 203, 2, 2)), (64, True, (1, 1500, 1500, 4, 4)),
    (128, True, (2, 1000, 1000, 4, 2)), (128, False, (1, 17, 17, 2, 2)),
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_backward_stats_shuffle_knob(d, causal, shape):
    """BwdTiles.stats_shuffle (the table's at hdim 64 non-causal; variant shfl turns it
    on in the other configurations too): each lane loads an
    eighth of its columns' LSElog2 / Dpsum and shuffles the rest from the lanes that
    loaded them. The main kernel alone (scripts/gpu_check_bwd.py's variant shfl,
    jnp pre- and postprocess): dq, dk, dv against the f32 reference by the 2x rule,
    the padded dQaccum rows untouched; GQA, Sq != Sk, one row, both masks."""
    import math
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import gpu_check_bwd as g

    scale = 1.0 / math.sqrt(d)
    run = g.make_runner(g.kernel_call(jnp.bfloat16, d, causal, scale, "shfl"), scale, causal,
                        g.flat_tile_m(d, causal, "shfl"), g.q_tile_pad(d, causal, "shfl"),
                        g.stats_block_of(d, causal, "shfl"))
    b, sq, sk, hq, hkv = shape
    ok, worst, detail = g.check_case(run, jnp.bfloat16, b, sq, sk, hq, hkv, d,
                                     jax.random.PRNGKey(sq + d))
    assert ok, detail


@pytest.mark.parametrize("d,causal,variant,shape", [
    (128, True, "first", (2, 1000, 1000, 4, 2)), (128, False, "first", (2, 203, 113, 4, 1)),
    (128, True, "first", (1, 1, 1, 1, 1)), (64, False, "first", (2, 1000, 999, 4, 1)),
    (64, True, "first", (2, 113, 203, 2, 2)), (64, True, "first", (1, 1500, 1500, 4, 4)),
    (128, False, "first+m80+dq1", (1, 4097, 4097, 2, 2)),
    (128, False, "first+rot", (2, 1000, 999, 4, 2)),
    (64, False, "first+dq1", (1, 777, 4097, 2, 1)),
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_backward_dq_store_first_on_poison(d, causal, variant, shape):
    """FlashBwdSm90StoreFirst (Note [dQ store first]) alone, on a dQaccum filled with
    NaN and zeroed semaphores (scripts/gpu_check_bwd.py's variant first, jnp pre- and
    postprocess): every query block's first partial must be stored, not added (else
    the NaN stays), so dq, dk, dv pass the 2x rule against the f32 reference; the
    rows of the last block past Sq are stored zeros; the rows past the last block are
    left untouched. GQA, Sq != Sk, one row, both masks, 64 / 80-row tiles, one or two
    dQ buffers, the non-causal walk rotated or not."""
    _check_main_kernel_variant(d, causal, variant, shape, seed=sq_seed(shape, d) + 1)


def sq_seed(shape, d: int) -> int:
    return shape[1] + d


def _check_main_kernel_variant(d, causal, variant, shape, seed):
    """The backward main kernel of a scripts/gpu_check_bwd.py variant alone (jnp pre-
    and postprocess): dq, dk, dv by the 2x rule, padding rows as that script checks."""
    import math
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import gpu_check_bwd as g

    scale = 1.0 / math.sqrt(d)
    run = g.make_runner(g.kernel_call(jnp.bfloat16, d, causal, scale, variant), scale, causal,
                        g.flat_tile_m(d, causal, variant), g.q_tile_pad(d, causal, variant),
                        g.stats_block_of(d, causal, variant))
    b, sq, sk, hq, hkv = shape
    ok, worst, detail = g.check_case(run, jnp.bfloat16, b, sq, sk, hq, hkv, d,
                                     jax.random.PRNGKey(seed))
    assert ok, detail


@pytest.mark.parametrize("d,causal,shape", [
    (128, True, (2, 1000, 1000, 4, 2)), (128, True, (2, 113, 203, 4, 1)),
    (128, True, (1, 777, 150, 2, 2)), (128, False, (2, 300, 150, 4, 1)),
    (128, True, (1, 1, 1, 1, 1)), (128, True, (1, 4097, 4097, 2, 2)),
    (64, True, (2, 1000, 1000, 4, 2)), (64, False, (1, 500, 1050, 2, 1)),
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_backward_skip_masked_warpgroup(d, causal, shape):
    """BwdTiles.skip_masked_wg (variant skipwg; Note [Masked warpgroup]; the table's
    at hdim 128 causal, with carry_coords): a warpgroup whose 64 keys are all masked
    for a query block (causal: after its last query, at hdim 128 warpgroup 1 on each
    key block's first query block; or past seqlen_k: last key blocks of 22 and 26
    keys) skips its GEMMs and stores zeros as its half of dS^T. The main kernel
    alone: dq, dk, dv by the 2x rule; Sq above, below and equal to Sk, GQA, one row."""
    _check_main_kernel_variant(d, causal, "skipwg", shape, seed=sq_seed(shape, d) + 7)


@pytest.mark.parametrize("d,causal,variant,shape", [
    (128, True, "carry", (2, 1000, 1000, 4, 2)), (128, False, "carry", (2, 203, 113, 4, 1)),
    (64, True, "carry", (2, 1500, 1500, 6, 2)), (128, True, "skipwg+carry", (1, 1, 1, 1, 1)),
    (128, True, "skipwg+carry", (3, 777, 1500, 6, 2)),
    (128, True, "skipwg+carry", (2, 1000, 1000, 4, 2)),
    (128, False, "skipwg+carry", (2, 300, 150, 4, 1)),
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_backward_carried_coords(d, causal, variant, shape):
    """BwdTiles.carry_coords (variant carry; the table's at hdim 128 causal): the MMA walk
    carries its query block from item to item, wrapping at the end of each query
    head of the GQA group (groups of 1, 2 and 3 heads here), alone (hdim 128
    non-causal, hdim 64) and with the masked warpgroup's first item peeled (hdim 128
    causal, where the table has both: the walk then starts at item 1, or at 0 where
    nothing is masked). The main kernel alone, by the 2x rule."""
    _check_main_kernel_variant(d, causal, variant, shape, seed=sq_seed(shape, d) + 9)


@pytest.mark.parametrize("d,causal,variant,shape", [
    (128, True, "red", (2, 1000, 1000, 4, 2)), (128, False, "red", (2, 203, 113, 4, 1)),
    (128, True, "red", (1, 1, 1, 1, 1)), (64, False, "red", (2, 1000, 999, 4, 1)),
    (64, True, "red", (2, 113, 203, 2, 2)), (128, False, "red+s3", (1, 4097, 4097, 2, 2)),
    (64, True, "red+s3", (1, 1500, 1500, 4, 4)), (128, True, "red+s3", (3, 777, 1500, 6, 2)),
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_backward_dq_from_registers(d, causal, variant, shape):
    """BwdTiles.dq_red (variant red; Note [dQ from registers]; off in the table):
    the MMA threads reduce-add dQ into the flat accumulator with 128-bit reductions,
    no SMEM dQ buffer; with s3 a third Q / dO stage in the freed SMEM. The main
    kernel alone: dq, dk, dv by the 2x rule, the padding rows of dQaccum
    untouched; GQA, Sq != Sk, one row, both masks."""
    _check_main_kernel_variant(d, causal, variant, shape, seed=sq_seed(shape, d) + 5)


@pytest.mark.parametrize("d,causal,shape", [
    (128, True, (2, 1000, 1000, 4, 2)), (128, False, (2, 203, 113, 4, 1)),
    (64, False, (1, 777, 4097, 2, 1)), (64, True, (1, 1, 1, 1, 1)),
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_backward_add_two_buffers(d, causal, shape):
    """BwdTiles.dq_double_add (variant add2; not yet run when added): the add-only
    main kernel with two dQ SMEM buffers, item it in buffer it % 2, alone on a
    zeroed dQaccum: the 2x rule. Both masks and head dims, GQA, Sq != Sk, one row
    (one item: buffer 1 never used)."""
    _check_main_kernel_variant(d, causal, "add2", shape, seed=sq_seed(shape, d) + 2)


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
        assert fn.lower().as_text().count(CALL) == 4
        (out, lse), grads = fn()
    (hi_out, hi_lse), hi = ref(jnp.float32)
    (lo_out, lo_lse), lo = ref(jnp.bfloat16)
    assert_close_2x(out, hi_out, lo_out, atol=1e-3, name="out")
    assert_close_2x(lse, hi_lse, lo_lse, atol=1e-3, name="lse")
    for name, g, h, lw in zip(("dq", "dk", "dv"), grads, hi, lo):
        assert_close_2x(g, h, lw, atol=2e-3, name=name)


@pytest.mark.parametrize("d,causal", [(128, True), (64, False), (256, True)])
def test_backward_pdl_chain(monkeypatch, d, causal):
    """The backward's kernels launched with programmatic dependent launch (the
    default on sm_90a) give bitwise the gradients of the same kernels launched
    without it (JAX_FA4_PDL=0), in a chain of four steps where each step's dO and q
    come from the step before through XLA kernels: a kernel that read its inputs
    before its predecessor finished would differ. The deterministic backward makes
    the two bitwise comparable (hdim 256 has none: it compares its own runs, and
    the first step with the 2x rule). Each lowering's kernel keys say which
    launch it got."""
    from jax_fa4.config import PDL_ENV
    from jax_fa4.ffi import bridge

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
    runs = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv(PDL_ENV, pdl)
        fn = jax.jit(lambda q, dout: chain(q, dout))  # a new function: lowered again
        with poison_outputs():
            runs[pdl] = [jax.tree.leaves(jax.block_until_ready(fn(q, dout))) for _ in range(3)]
        # The switch reached the lowering: its backward keys were compiled.
        assert {(key.kind, key.pdl) for key in bridge.compile_seconds
                if key.head_dim == d and key.kind.startswith("bwd")} >= {
            ("bwd_det" if det else "bwd", pdl == "1"), ("bwd_post", pdl == "1")}
    for a, b_ in zip(runs["1"][0], runs["0"][0]):
        assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32))))
        if det:  # the same arithmetic in the same order, launched either way
            assert bool(jnp.all(a == b_)), "PDL changed the deterministic gradients"
        else:
            err = jnp.max(jnp.abs(a.astype(jnp.float32) - b_.astype(jnp.float32)))
            assert float(err) <= 0.02 * float(jnp.max(jnp.abs(b_.astype(jnp.float32))))
    if det:
        for pdl in ("1", "0"):
            assert all(bool(jnp.all(a == b_)) for r in runs[pdl][1:]
                       for a, b_ in zip(r, runs[pdl][0])), f"runs differ, JAX_FA4_PDL={pdl}"
    _assert_grads_2x(runs["1"][0][:3], q, k, v, dout, dlse, causal)


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
