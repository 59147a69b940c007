"""Flax integration: nnx and linen attention modules on jax_fa4.flax.attention_fn."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import optax
import pytest

flax = pytest.importorskip("flax")
from conftest import max_err  # noqa: E402
from flax import linen, nnx  # noqa: E402

import jax_fa4.flax  # noqa: E402


def _nnx_pair(**kwargs):
    common = dict(num_heads=4, in_features=32, qkv_features=32, decode=False, **kwargs)
    ours = nnx.MultiHeadAttention(
        **common, attention_fn=jax_fa4.flax.attention_fn, rngs=nnx.Rngs(0)
    )
    theirs = nnx.MultiHeadAttention(**common, rngs=nnx.Rngs(0))
    return ours, theirs


@pytest.mark.parametrize("causal", [False, True])
def test_nnx_matches_flax_attention(causal):
    ours, theirs = _nnx_pair()
    x = jax.random.normal(jax.random.key(1), (2, 3, 13, 32))  # two batch dims
    got = ours(x, is_causal=causal)
    want = theirs(x, is_causal=causal)
    assert max_err(got, want) < 1e-5


def test_nnx_mask_and_dropout_go_to_reference_logged(caplog):
    from jax_fa4.rules import primitives

    primitives._logged.clear()
    ours, theirs = _nnx_pair(dropout_rate=0.5)
    x = jax.random.normal(jax.random.key(2), (2, 9, 32))
    mask = jax.random.bernoulli(jax.random.key(3), 0.7, (2, 4, 9, 9)).at[..., 0].set(True)
    with caplog.at_level(logging.WARNING, logger="jax_fa4"):
        got = ours(x, mask=mask, deterministic=True)
    assert any("mask" in r.getMessage() for r in caplog.records)
    assert max_err(got, theirs(x, mask=mask, deterministic=True)) < 1e-5
    # Active dropout: reference path with Flax's dropout (same rng -> same result).
    got = ours(x, deterministic=False, rngs=nnx.Rngs(dropout=7))
    want = theirs(x, deterministic=False, rngs=nnx.Rngs(dropout=7))
    assert max_err(got, want) < 1e-5


def test_linen_matches_and_takes_is_causal_partial():
    attn_fn = functools.partial(jax_fa4.flax.attention_fn, is_causal=True)
    ours = linen.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, attention_fn=attn_fn)
    theirs = linen.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)
    x = jax.random.normal(jax.random.key(4), (3, 11, 16))
    params = theirs.init(jax.random.key(0), x)
    mask = linen.make_causal_mask(jnp.ones((3, 11)))
    got = ours.apply(params, x)
    want = theirs.apply(params, x, mask=mask)
    assert max_err(got, want) < 1e-5


def test_deterministic_backward_through_nnx(monkeypatch):
    """attention_fn(deterministic_backward=True) reaches the kernel config: the nnx
    module's gradient, cross-lowered for sm_90a, runs the deterministic backward
    (its int32 semaphores appear), and the default does not."""
    from jax_fa4.ffi import cutlass_available

    if cutlass_available() is not None:
        pytest.skip("no CuTe DSL")
    monkeypatch.setenv("JAX_FA4_ARCH", "sm_90a")

    def lowered(**kw):
        fn = functools.partial(jax_fa4.flax.attention_fn, implementation="cute", **kw)
        mha = nnx.MultiHeadAttention(num_heads=2, in_features=64, qkv_features=256,
                                     decode=False, attention_fn=fn, dtype=jnp.bfloat16,
                                     rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(mha)

        def loss(state, x):
            out = nnx.merge(graphdef, state)(x, is_causal=True)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        # 300 tokens: longer than the short sequences the lowering packs into rows.
        x = jax.ShapeDtypeStruct((2, 300, 64), jnp.bfloat16)
        return jax.jit(jax.grad(loss)).trace(state, x).lower(
            lowering_platforms=("cuda",)).as_text()

    sem = "tensor<2x2x5xi32>"  # (B, Hq, ceil(300 / 64)): head dim 128, 64-row tiles
    assert sem in lowered(deterministic_backward=True)
    assert sem not in lowered()


def test_nnx_train_step_lowers_loss():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.MultiHeadAttention(
                num_heads=2, in_features=16, decode=False,
                attention_fn=jax_fa4.flax.attention_fn, rngs=rngs,
            )
            self.out = nnx.Linear(16, 16, rngs=rngs)

        def __call__(self, x):
            return self.out(self.attn(x, is_causal=True))

    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(5), (4, 10, 16))
    y = jnp.cumsum(x, axis=1) / jnp.arange(1, 11)[None, :, None]  # causal running mean

    @nnx.jit
    def step(model, opt):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt)) for _ in range(15)]
    assert losses[-1] < 0.7 * losses[0], losses


def test_linen_train_step_lowers_loss():
    model = linen.MultiHeadDotProductAttention(
        num_heads=2, qkv_features=16, out_features=16, attention_fn=jax_fa4.flax.attention_fn
    )
    x = jax.random.normal(jax.random.key(6), (4, 10, 16))
    y = jnp.mean(x, axis=1, keepdims=True) + 0 * x
    params = model.init(jax.random.key(0), x)
    tx = optax.adam(1e-2)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, state = tx.update(grads, state)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(15):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0], losses


def test_example_trains():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "examples" / "train_tiny_transformer.py"
    spec = importlib.util.spec_from_file_location("train_tiny_transformer", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    losses = mod.main(["--steps", "12", "--seq", "32", "--dim", "64", "--heads", "2"])
    assert losses[-1] < losses[0]


def test_generate_example_decodes_through_the_paged_cache():
    """examples/generate.py: the paged-cache generation equals recomputing every
    step without a cache, and the trained model continues its motifs."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "examples" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = mod.main(["--new", "6"])
    assert result["tokens"].shape == (4, 6)
    assert result["cache_matches"]
    assert result["accuracy"] > 0.5


def test_softcap_binds_into_attention_fn():
    """Gemma 2's capped logits in a Flax module: softcap bound with
    functools.partial gives jax_fa4.attention(softcap=...); with a dense mask it
    raises (Flax's reference path has no cap)."""
    def module(attention_fn):
        return nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=32,
                                      decode=False, attention_fn=attention_fn,
                                      rngs=nnx.Rngs(0))

    def direct(cap):
        return lambda q, k, v, is_causal, **_: jax_fa4.attention(q, k, v, causal=is_causal,
                                                                 softcap=cap)

    ours = module(functools.partial(jax_fa4.flax.attention_fn, softcap=1.5))
    x = 3.0 * jax.random.normal(jax.random.key(5), (2, 13, 32))
    got = ours(x, is_causal=True)  # nnx passes is_causal through
    assert max_err(got, module(direct(1.5))(x, is_causal=True)) < 1e-6
    assert max_err(got, module(direct(None))(x, is_causal=True)) > 1e-3  # the cap counts
    with pytest.raises(ValueError, match="softcap and sinks do not combine with mask"):
        ours(x, mask=jnp.ones((2, 4, 13, 13), bool))


def test_nnx_module_learns_sinks():
    """MultiHeadAttention(sinks=True): a [num_heads] float32 parameter (zeros) that
    reaches jax_fa4.attention(sinks=...) and gets a gradient."""
    common = dict(num_heads=4, in_features=32, qkv_features=32, decode=False)
    ours = jax_fa4.flax.MultiHeadAttention(**common, sinks=True, rngs=nnx.Rngs(0))
    assert ours.sinks.value.shape == (4,) and ours.sinks.value.dtype == jnp.float32
    ours.sinks.value = jnp.array([0.5, -1.0, 2.0, 0.0], jnp.float32)
    x = jax.random.normal(jax.random.key(6), (2, 13, 32))

    def direct(q, k, v, is_causal, **_):
        return jax_fa4.attention(q, k, v, causal=is_causal, sinks=ours.sinks.value)

    want = nnx.MultiHeadAttention(**common, attention_fn=direct, rngs=nnx.Rngs(0))
    got = ours(x, is_causal=True)
    assert max_err(got, want(x, is_causal=True)) < 1e-6
    plain = jax_fa4.flax.MultiHeadAttention(**common, rngs=nnx.Rngs(0))
    assert plain.sinks is None and max_err(got, plain(x, is_causal=True)) > 1e-3

    grads = nnx.grad(lambda m: jnp.sum(m(x, is_causal=True) ** 2))(ours)
    assert float(jnp.max(jnp.abs(grads.sinks.value))) > 1e-4
