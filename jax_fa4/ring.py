"""Ring attention (context parallelism) over ``jax.shard_map``.

Each device of the mesh axis holds a slice of the sequence of q, k and v. K and V
travel around the ring with ``lax.ppermute``: at hop t device r holds the block of
device (r - t) mod n. Every hop's transfer is issued before that hop's kernel call,
so XLA can run the two at once. The partial (out, lse) of each hop are merged in
float32 through their LSE; the result is attention over the whole sequence.

Causal, contiguous layout (device r holds positions [r c, (r + 1) c)): hop 0 is the
diagonal (causal), a hop whose keys come from an earlier device runs unmasked, and
one whose keys come from a later device is skipped (a conditional with no kernel in
its other branch). Device r then works on r + 1 of the n hops.

Note [Zigzag layout]
~~~~~~~~~~~~~~~~~~~~
With ``load_balance="zigzag"`` the sequence is cut into 2n chunks of c positions and
device r holds chunks r and 2n - 1 - r (``to_zigzag`` / ``from_zigzag`` move a
global array into and out of that layout). At a hop whose keys come from device
s != r, exactly half the work is visible, on every device:
  s < r: both query chunks see key chunk s in full and nothing of chunk 2n - 1 - s;
  s > r: the late query chunk 2n - 1 - r sees both key chunks in full, the early
         query chunk sees neither.
Hop 0 runs the early and the late chunks causally against their own keys and the
late query chunk against the early key chunk in full. Every device does the same
work at every hop (the technique of the zigzag / striped ring attention of
Brandon et al. and Llama 3's context parallelism, written here for shard_map).

Backward (a custom VJP): K and V rotate again, the other way round (the same
rotations as the forward's would be merged with them by XLA, which would keep every
block alive in between); each hop calls the backward kernels
with the final out and LSE (no recomputation of the forward ring): with
P = exp(S - lse) and Dpsum = rowsum(dO * O) - dLSE the per-hop gradients are exact
partials. dQ accumulates where the queries live; dK and dV partials travel with
their K and V block and take one last hop home.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_fa4.api import (
    _check_implementation,
    _check_qkv,
    _check_sinks,
    _resolve_scale,
    _resolve_softcap,
    _sink_gradient,
)
from jax_fa4.config import AttentionConfig
from jax_fa4.reference import like_inputs
from jax_fa4.rules.primitives import fa4_bwd_p, fa4_fwd_p

LOAD_BALANCE = (None, "zigzag")


def _zigzag_chunks(x: jax.Array, num_devices: int, axis: int):
    """x cut into 2n chunks along ``axis``, and the zigzag order of the chunks."""
    n = num_devices
    if x.shape[axis] % (2 * n):
        raise ValueError(f"zigzag needs the sequence ({x.shape[axis]}) to divide into "
                         f"2 x {n} chunks")
    return jnp.split(x, 2 * n, axis=axis), [c for r in range(n) for c in (r, 2 * n - 1 - r)]


def to_zigzag(x: jax.Array, num_devices: int, axis: int = 1) -> jax.Array:
    """A global array in sequence order -> the zigzag order (Note [Zigzag layout]):
    sharding ``axis`` evenly over ``num_devices`` then gives device r the chunks r and
    2n - 1 - r. The sequence length must divide into 2n chunks."""
    chunks, order = _zigzag_chunks(x, num_devices, axis)
    return jnp.concatenate([chunks[c] for c in order], axis=axis)


def from_zigzag(x: jax.Array, num_devices: int, axis: int = 1) -> jax.Array:
    """The inverse of :func:`to_zigzag`."""
    chunks, order = _zigzag_chunks(x, num_devices, axis)
    position = {c: i for i, c in enumerate(order)}
    return jnp.concatenate([chunks[position[c]] for c in range(len(order))], axis=axis)


@dataclasses.dataclass(frozen=True)
class _Ring:
    axis_name: str
    n: int
    causal: bool
    zigzag: bool
    scale: float
    implementation: str | None
    deterministic: bool
    softcap: float | None = None

    def config(self, causal: bool) -> AttentionConfig:
        return AttentionConfig(scale=self.scale, causal=causal,
                               implementation=self.implementation,
                               deterministic=self.deterministic, softcap=self.softcap)

    def rotate(self, *xs, step: int = 1):
        """Each device's arrays to the device ``step`` places on along the ring."""
        perm = [(i, (i + step) % self.n) for i in range(self.n)]
        return tuple(jax.lax.ppermute(x, self.axis_name, perm) for x in xs)


def _merge(o, lse, o_t, lse_t):
    """Two partial results (o f32 [B,S,H,D], lse [B,H,S]) merged through their LSE;
    rows with lse -inf on both sides stay (0, -inf)."""
    new = jnp.logaddexp(lse, lse_t)
    safe = jnp.where(jnp.isneginf(new), 0.0, new)
    w = jnp.swapaxes(jnp.exp(lse - safe), -1, -2)[..., None]
    w_t = jnp.swapaxes(jnp.exp(lse_t - safe), -1, -2)[..., None]
    return o * w + o_t.astype(jnp.float32) * w_t, new


def _empty(q, v, *like):
    """(o, lse) of rows that see no key, varying over the mesh axes of ``like``
    (both branches of a conditional inside shard_map must)."""
    b, s, h, _ = q.shape
    return like_inputs((jnp.zeros((b, s, h, v.shape[-1]), jnp.float32),
                         jnp.full((b, h, s), -jnp.inf, jnp.float32)), q, v, *like)


def _fwd_call(ring: _Ring, q, k, v, causal: bool):
    o, lse = fa4_fwd_p.bind(q, k, v, config=ring.config(causal))
    return o.astype(jnp.float32), lse


def _hop_forward(ring: _Ring, hop: int, q, k, v, src_before):
    """(o f32, lse) of this device's queries against the K / V block it holds at
    ``hop``; ``src_before``: whether that block comes from an earlier device."""
    if not ring.causal:
        return _fwd_call(ring, q, k, v, False)
    if hop == 0:
        if ring.zigzag:
            return _zigzag_diagonal_forward(ring, q, k, v)
        return _fwd_call(ring, q, k, v, True)
    if not ring.zigzag:
        return jax.lax.cond(src_before, lambda: _fwd_call(ring, q, k, v, False),
                            lambda: _empty(q, v, k))
    c = q.shape[1] // 2

    def early_keys():  # both query chunks against the early key chunk
        return _fwd_call(ring, q, k[:, :c], v[:, :c], False)

    def late_queries():  # the late query chunk against both key chunks
        o, lse = _fwd_call(ring, q[:, c:], k, v, False)
        o0, lse0 = _empty(q[:, :c], v, k)
        return jnp.concatenate([o0, o], 1), jnp.concatenate([lse0, lse], -1)

    return jax.lax.cond(src_before, early_keys, late_queries)


def _zigzag_diagonal_forward(ring: _Ring, q, k, v):
    c = q.shape[1] // 2
    o_e, lse_e = _fwd_call(ring, q[:, :c], k[:, :c], v[:, :c], True)
    o_l, lse_l = _fwd_call(ring, q[:, c:], k[:, c:], v[:, c:], True)
    o_x, lse_x = _fwd_call(ring, q[:, c:], k[:, :c], v[:, :c], False)
    o_l, lse_l = _merge(o_l, lse_l, o_x, lse_x)
    return jnp.concatenate([o_e, o_l], 1), jnp.concatenate([lse_e, lse_l], -1)


def _ring_forward(ring: _Ring, q, k, v):
    me = jax.lax.axis_index(ring.axis_name)
    o, lse = _empty(q, v, k)
    for hop in range(ring.n):
        if hop + 1 < ring.n:  # issued before this hop's kernel: the transfer overlaps it
            k_next, v_next = ring.rotate(k, v)
        src_before = (me - hop) % ring.n < me  # the block came from an earlier device
        o_t, lse_t = _hop_forward(ring, hop, q, k, v, src_before)
        o, lse = _merge(o, lse, o_t, lse_t)
        if hop + 1 < ring.n:
            k, v = k_next, v_next
    return o.astype(q.dtype), lse


def _bwd_call(ring: _Ring, q, k, v, out, lse, dout, dlse, causal: bool):
    return tuple(fa4_bwd_p.bind(q, k, v, out, lse, dout, *dlse, config=ring.config(causal)))


def _zeros_like(*xs, like=()):
    return like_inputs(tuple(jnp.zeros(x.shape, x.dtype) for x in xs), *xs, *like)


def _hop_backward(ring: _Ring, hop: int, q, k, v, out, lse, dout, dlse, src_before):
    """(dq, dk, dv) partials of this device's queries against the block it holds."""
    call = functools.partial(_bwd_call, ring)
    if not ring.causal:
        return call(q, k, v, out, lse, dout, dlse, False)
    if hop == 0:
        if ring.zigzag:
            return _zigzag_diagonal_backward(ring, q, k, v, out, lse, dout, dlse)
        return call(q, k, v, out, lse, dout, dlse, True)
    if not ring.zigzag:
        return jax.lax.cond(src_before, lambda: call(q, k, v, out, lse, dout, dlse, False),
                            lambda: _zeros_like(q, k, v, like=(out, dout, *dlse)))
    c = q.shape[1] // 2

    def early_keys():
        dq, dk, dv = call(q, k[:, :c], v[:, :c], out, lse, dout, dlse, False)
        zk, zv = _zeros_like(k[:, c:], v[:, c:], like=(q, dout))
        return dq, jnp.concatenate([dk, zk], 1), jnp.concatenate([dv, zv], 1)

    def late_queries():
        dq, dk, dv = call(q[:, c:], k, v, out[:, c:], lse[..., c:], dout[:, c:],
                          tuple(d[..., c:] for d in dlse), False)
        (zq,) = _zeros_like(q[:, :c], like=(k, dout))
        return jnp.concatenate([zq, dq], 1), dk, dv

    return jax.lax.cond(src_before, early_keys, late_queries)


def _zigzag_diagonal_backward(ring: _Ring, q, k, v, out, lse, dout, dlse):
    c = q.shape[1] // 2
    e, late = slice(None, c), slice(c, None)

    def part(qs, ks, causal):
        return _bwd_call(ring, q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[..., qs],
                         dout[:, qs], tuple(d[..., qs] for d in dlse), causal)

    dq_e, dk_e, dv_e = part(e, e, True)
    dq_l, dk_l, dv_l = part(late, late, True)
    dq_x, dk_x, dv_x = part(late, e, False)
    return (jnp.concatenate([dq_e, dq_l + dq_x], 1), jnp.concatenate([dk_e + dk_x, dk_l], 1),
            jnp.concatenate([dv_e + dv_x, dv_l], 1))


def _ring_backward(ring: _Ring, q, k, v, out, lse, dout, dlse):
    # K / V go round the other way here: the same rotations as the forward's would be
    # merged with them by XLA, which then keeps all n blocks alive from the forward to
    # the backward (the whole sequence's K / V on every device).
    me = jax.lax.axis_index(ring.axis_name)
    f32 = jnp.float32
    dq, dk, dv = like_inputs((jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32),
                               jnp.zeros(v.shape, f32)), q, k, v, dout)
    for hop in range(ring.n):
        if hop + 1 < ring.n:
            k_next, v_next = ring.rotate(k, v, step=-1)
        src_before = (me + hop) % ring.n < me  # this hop's block is that of device me + hop
        dq_t, dk_t, dv_t = _hop_backward(ring, hop, q, k, v, out, lse, dout, dlse, src_before)
        dq = dq + dq_t.astype(f32)
        dk, dv = dk + dk_t.astype(f32), dv + dv_t.astype(f32)
        # dK / dV travel with their block: after the last hop, one more step home.
        dk, dv = ring.rotate(dk, dv, step=-1)
        if hop + 1 < ring.n:
            k, v = k_next, v_next
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _with_sinks(out, lse, sinks):
    """The ring's (out, lse) with the sink logits [Hq] in every row's denominator:
    one more term of the LSE merge, whose value is 0."""
    o, new = _merge(out.astype(jnp.float32), lse, jnp.zeros(out.shape, jnp.float32),
                    jnp.broadcast_to(sinks[None, :, None], lse.shape))
    return o.astype(out.dtype), new


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v, sinks):
    out, lse = _ring_forward(ring, q, k, v)
    return (out, lse) if sinks is None else _with_sinks(out, lse, sinks)


def _ring_fwd(ring, q, k, v, sinks):
    q, k, v = (x.value for x in (q, k, v))  # CustomVJPPrimal (symbolic_zeros)
    sinks = None if sinks is None else sinks.value
    out, lse = _ring_forward(ring, q, k, v)
    if sinks is not None:
        out, lse = _with_sinks(out, lse, sinks)
    return (out, lse), (q, k, v, sinks, out, lse)


def _ring_bwd(ring, residuals, cotangents):
    from jax.custom_derivatives import SymbolicZero

    q, k, v, sinks, out, lse = residuals
    dout, dlse = cotangents
    if isinstance(dout, SymbolicZero):
        dout = jnp.zeros(out.shape, out.dtype)
    dlse = () if isinstance(dlse, SymbolicZero) else (dlse.astype(jnp.float32),)
    # With sinks, the final lse holds them: each hop's P = exp(S - lse) is then the
    # right partial, as on one device (api.py: _sink_gradient).
    grads = _ring_backward(ring, q, k, v, out, lse, dout.astype(out.dtype), dlse)
    if sinks is None:
        return (*grads, None)
    local = _sink_gradient(jnp.broadcast_to(sinks, (q.shape[0], sinks.shape[0])), out, lse,
                           dout, dlse).sum(0)
    return (*grads, jax.lax.psum(local, ring.axis_name))


_ring.defvjp(_ring_fwd, _ring_bwd, symbolic_zeros=True)


def ring_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    axis_name: str,
    causal: bool = False,
    load_balance: str | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    deterministic: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention over a sequence sharded on the mesh axis ``axis_name``; call it
    inside ``jax.shard_map``.

    Args:
      query: this device's ``[B, S_local, Hq, D]``; key, value: ``[B, S_local, Hkv,
        D / Dv]`` (the same positions as the queries).
      axis_name: the mesh axis the sequence is sharded over, in device order.
      causal: top-left causal over the whole sequence.
      load_balance: None (device r holds positions [r S_local, (r + 1) S_local)) or
        "zigzag" (Note [Zigzag layout]; lay arrays out with :func:`to_zigzag`;
        S_local must be even). Causal only changes the work per device.
      scale, softcap, implementation, deterministic: as in :func:`jax_fa4.attention`
        (the cap acts on each score, so every hop applies it).
      sinks: as in :func:`jax_fa4.attention`, the same on every device of the ring
        (its gradient is summed over the ring).
      return_lse: also return the global LSE ``[B, Hq, S_local]`` (float32,
        differentiable).

    Returns:
      ``out [B, S_local, Hq, Dv]``, and with ``return_lse`` ``(out, lse)``.
    """
    _check_qkv(query, key, value)
    if query.ndim != 4:
        raise ValueError("ring_attention takes [B, S_local, H, D] arrays")
    if query.shape[1] != key.shape[1]:
        raise ValueError("ring_attention wants the same local length for queries and keys "
                         f"(self-attention); got {query.shape[1]} and {key.shape[1]}")
    head_dim, head_dim_v = int(query.shape[-1]), int(value.shape[-1])
    _check_implementation(implementation, query.dtype, head_dim, head_dim_v)
    if load_balance not in LOAD_BALANCE:
        raise ValueError(f"load_balance must be one of {LOAD_BALANCE}, got {load_balance!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"ring_attention takes causal=True / False, got {causal!r}")
    zigzag = load_balance == "zigzag"
    if zigzag and query.shape[1] % 2:
        raise ValueError("load_balance='zigzag' needs an even local sequence length (two "
                         f"chunks per device), got {query.shape[1]}")
    n = jax.lax.axis_size(axis_name)
    ring = _Ring(axis_name=axis_name, n=int(n), causal=causal, zigzag=zigzag,
                 scale=_resolve_scale(scale, head_dim), implementation=implementation,
                 deterministic=deterministic, softcap=_resolve_softcap(softcap))
    out, lse = _ring(ring, query, key, value, _check_sinks(sinks, int(query.shape[2])))
    return (out, lse) if return_lse else out
