"""Ring attention over every local device: forward and backward of one long causal
sequence, sharded along the sequence with zigzag load balancing.

    python examples/ring_attention.py                # the GPUs here, or 8 CPU devices
    python examples/ring_attention.py --seq 65536    # longer (on GPUs)

On a machine without GPUs it runs on 8 virtual CPU devices (the reference path per
hop); on GPUs each hop runs the jax_fa4 kernels. It checks the result against
single-device attention where that fits, and prints the time of one step.
"""

from __future__ import annotations

import argparse
import os
import time

# Eight CPU devices stand in where there are no GPUs (read when JAX starts).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_fa4  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=None, help="global sequence length")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--cpu", action="store_true", help="8 CPU devices even with a GPU")
    args = p.parse_args()

    devices = jax.devices("cpu") if args.cpu else jax.devices()
    n = len(devices)
    on_gpu = devices[0].platform == "gpu"
    seq = args.seq or (16384 if on_gpu else 1024)
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    mesh = Mesh(np.array(devices), ("sp",))
    print(f"{n} {devices[0].platform} devices, sequence {seq} ({seq // n} per device), "
          f"{args.heads} heads x {args.head_dim}, causal, zigzag")

    key = jax.random.split(jax.random.key(0), 3)
    shape = (1, seq, args.heads, args.head_dim)
    q, k, v = (jax.random.normal(kk, shape, jnp.float32).astype(dtype) for kk in key)

    spec = P(None, "sp")
    ring = jax.shard_map(
        lambda q, k, v: jax_fa4.ring_attention(q, k, v, axis_name="sp", causal=True,
                                               load_balance="zigzag"),
        mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)

    def loss(q, k, v):
        return jnp.sum(ring(q, k, v).astype(jnp.float32) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    sharding = jax.sharding.NamedSharding(mesh, spec)
    qz, kz, vz = (jax.device_put(jax_fa4.to_zigzag(x, n), sharding) for x in (q, k, v))
    value, grads = jax.block_until_ready(step(qz, kz, vz))
    t0 = time.perf_counter()
    for _ in range(3):
        value, grads = jax.block_until_ready(step(qz, kz, vz))
    dt = (time.perf_counter() - t0) / 3
    print(f"loss {float(value):.4f}; one forward + backward step {dt * 1e3:.1f} ms")

    if seq <= 16384:  # single-device attention for comparison
        want = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(jax_fa4.attention(
            q, k, v, causal=True).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))(q, k, v)
        dq = jax_fa4.from_zigzag(grads[0], n)
        rel = float(jnp.max(jnp.abs(dq.astype(jnp.float32) - want[1][0].astype(jnp.float32)))
                    / jnp.max(jnp.abs(want[1][0].astype(jnp.float32))))
        print(f"single device: loss {float(want[0]):.4f}; max |dq difference| / max |dq| "
              f"{rel:.2e}")


if __name__ == "__main__":
    main()
