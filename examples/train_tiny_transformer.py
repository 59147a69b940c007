"""Train a tiny Flax nnx transformer whose attention runs on jax_fa4.

On an H100/H200 the attention runs the CuTe DSL kernels; anywhere else the
reference path (logged once). The task is next-token prediction on sequences
that repeat a random motif, which a causal transformer learns in a few steps.

    python examples/train_tiny_transformer.py [--steps 30] [--seq 128]
"""

from __future__ import annotations

import argparse
import logging
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jax_fa4
import jax_fa4.flax


class Block(nnx.Module):
    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads,
            in_features=dim,
            decode=False,
            dtype=jnp.bfloat16,
            attention_fn=jax_fa4.flax.attention_fn,
            rngs=rngs,
        )
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x), is_causal=True).astype(x.dtype)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TinyTransformer(nnx.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, max_len: int, *, rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (max_len, dim)))
        self.blocks = nnx.List([Block(dim, heads, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_batch(key, batch: int, seq: int, vocab: int, motif: int = 8):
    motifs = jax.random.randint(key, (batch, motif), 0, vocab)
    reps = -(-seq // motif) + 1
    tokens = jnp.tile(motifs, (1, reps))[:, : seq + 1]
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model, inputs, targets):
    logits = model(inputs).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@nnx.jit
def train_step(model, optimizer, inputs, targets):
    loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
    optimizer.update(model, grads)
    return loss


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)  # head dim 64: a kernel shape
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}: {jax.devices()[0].device_kind}")
    vocab = 64
    model = TinyTransformer(vocab, args.dim, args.heads, args.layers, args.seq, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    key = jax.random.key(1)
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        key, sub = jax.random.split(key)
        inputs, targets = make_batch(sub, args.batch, args.seq, vocab)
        loss = float(train_step(model, optimizer, inputs, targets))
        losses.append(loss)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss:.4f}  ({time.perf_counter() - t0:.1f} s)")
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses


if __name__ == "__main__":
    main()
