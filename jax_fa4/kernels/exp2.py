"""Software exp2 for the forward softmax (FA4's MUFU offload).

Three implementations of exactly the same float32 arithmetic live here:

* ``exp2_poly_x2``: the Blackwell device helper, used inside a ``@cute.kernel``
  trace (packed ``f32x2`` FMAs, two values at a time; sm_100 only).
* ``exp2_poly``: the same steps for one value in scalar PTX, for any arch (Hopper
  has no packed f32x2 arithmetic). No kernel uses it: it runs the arithmetic on a
  Hopper GPU, against the mirror (tests/test_gpu.py).
* ``exp2_poly_numpy``: a host mirror in numpy float32, step by step, so the
  error claims below are tested on the CPU (tests/test_exp2_poly.py).

All three read their constants from this module only.

Note [Software exp2]
~~~~~~~~~~~~~~~~~~~~
On sm_100 the MUFU unit does 16 ex2 per clock per SM, while the FMA pipes do
128 FMAs per clock. In FA4's forward at head dims <= 128 the softmax warps are
MUFU-bound, so a fraction of each row's exp2 calls (a per-config knob, 12.5% to
25%) is computed with FMAs instead and the two units work in parallel. The Hopper
forward's softmax is bound by issue and latency, not by MUFU, so it uses MUFU only.

The softmax arguments are ``x = s * c - m_ref * c``: at most 0 with a fresh
row max and at most 8 while the max is stale (Note [Lazy rescale] in
softmax.py), so the helper must serve ``-inf <= x <= 8``; nothing below relies
on the sign of x, only on ``x < 127``:

1. Clamp: ``x = max(x, -127)`` so the exponent arithmetic below cannot wrap
   (-inf from the masking becomes -127).
2. Cody-Waite range reduction with one constant: ``t = x + 1.5 * 2^23``
   rounded toward -inf (``add.rm``). t lies in [2^23, 2^24) where the float32
   ulp is 1, so ``t = 1.5 * 2^23 + floor(x)`` exactly and the low mantissa bits
   of t hold ``n = floor(x)`` in two's complement. ``t - 1.5 * 2^23 = n`` is
   exact (Sterbenz); ``f = x - n`` is exact except for -1 < x < 0, where x has
   a finer grid than f and f is rounded once (by < 2^-24, and up to 1.0 for
   x > -2^-25, which the polynomial still maps to 2^1 within its error).
3. ``2^f`` by a degree-3 polynomial in Horner form,
   ``1 + f (c1 + f (c2 + f c3))`` with FA4's minimax coefficients
   (``EXP2_POLY``), relative error <= 8.8e-5 on [0, 1].
4. Scale by ``2^n``: add ``n << 23`` to the bit pattern of ``2^f`` (an integer
   add into the exponent field). Because the bits of ``1.5 * 2^23`` shifted left
   by 23 are 0 mod 2^32, ``n << 23 == bits(t) << 23``: one shift, no subtract.
5. Flush: below -126 the result would leave the normal range (step 4 would
   build a subnormal or, at exactly -127, zero), so ``x < -126`` gives 0. A
   softmax term below 2^-126 of the row maximum cannot change a 16-bit P nor
   the float32 row sum.

Why it is safe: measured with the numpy mirror on 10^6 uniform inputs in
[-126, 0], the maximum relative error is 8.8e-5, below bf16's half ulp
(2^-9 = 1.95e-3) by a factor 22 and below fp16's (2^-12 = 2.4e-4) as well. P is
rounded to 16 bits right after, so the polynomial changes the bf16 value of P
in about 1% of the elements (when 2^x lies within 9e-5 relative of a rounding
boundary), and then by exactly one ulp; the float32 row sum sees a relative
perturbation <= 8.8e-5 per term. The test pins: max relative error < 1.2e-4,
never more than one bf16 ulp from the bf16-rounded exact exp2, equal for >= 98.5%.
"""

from __future__ import annotations

import numpy as np
from cutlass import Float32, cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# Horner coefficients of 2^f on [0, 1), constant term first (FA4's degree-3 minimax).
EXP2_POLY = (
    1.0,
    0.695146143436431884765625,
    0.227564394474029541015625,
    0.077119089663028717041015625,
)
# x is clamped here before the range reduction (keeps n << 23 from wrapping).
EXP2_CLAMP = -127.0
# Results for x below this are flushed to 0 (outside the normal float32 range).
EXP2_FLUSH_BELOW = -126.0
# 1.5 * 2^23: adding it (rounding down) leaves floor(x) in the low mantissa bits.
EXP2_ROUND_MAGIC = 12582912.0


# ---------------------------------------------------------------- device side
@dsl_user_op
def _scale_by_pow2(t: Float32, p: Float32, *, loc=None, ip=None) -> Float32:
    """bits(p) + (bits(t) << 23): multiply 2^f by 2^floor(x) in the exponent field."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(t).ir_value(loc=loc, ip=ip), Float32(p).ir_value(loc=loc, ip=ip)],
            "{\n\t"
            ".reg .b32 tb, pb, eb;\n\t"
            "mov.b32 tb, $1;\n\t"
            "mov.b32 pb, $2;\n\t"
            "shl.b32 eb, tb, 23;\n\t"
            # add.s32 lowers to an ALU op, leaving the FMA pipe to the polynomial.
            "add.s32 $0, eb, pb;\n\t"
            "}\n",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def exp2_poly_x2(x: Float32, y: Float32) -> tuple[Float32, Float32]:
    """2^x and 2^y for -inf <= x, y < 127 on the FMA pipe (Note [Software exp2])."""
    xc = cute.arch.fmax(x, Float32(EXP2_CLAMP))
    yc = cute.arch.fmax(y, Float32(EXP2_CLAMP))
    magic = Float32(EXP2_ROUND_MAGIC)
    t = cute.arch.add_packed_f32x2((xc, yc), (magic, magic), rnd="rm")
    n = cute.arch.sub_packed_f32x2(t, (magic, magic))
    f = cute.arch.sub_packed_f32x2((xc, yc), n)
    c0, c1, c2, c3 = (Float32(c) for c in EXP2_POLY)
    p = cute.arch.fma_packed_f32x2(f, (c3, c3), (c2, c2))
    p = cute.arch.fma_packed_f32x2(p, f, (c1, c1))
    p = cute.arch.fma_packed_f32x2(p, f, (c0, c0))
    rx = _scale_by_pow2(t[0], p[0])
    ry = _scale_by_pow2(t[1], p[1])
    lo = Float32(EXP2_FLUSH_BELOW)
    rx = Float32(0.0) if xc < lo else rx
    ry = Float32(0.0) if yc < lo else ry
    return rx, ry


def _f32_hex(v: float) -> str:
    """A float32 constant as a PTX immediate (0fXXXXXXXX), exact."""
    return f"0f{int(np.array(v, dtype=np.float32).view(np.uint32)):08X}"


# Steps 1-5 of Note [Software exp2] for one value. Every rounding mode is
# explicit (.rn / .rm), so ptxas cannot contract or reorder them: the result is
# bit for bit what exp2_poly_numpy forms (up to the mirror's documented
# double-rounding caveat in the fma).
_EXP2_POLY_PTX = (
    "{\n\t"
    ".reg .f32 xc, t, n, f, p;\n\t"
    ".reg .b32 tb, pb;\n\t"
    ".reg .pred small;\n\t"
    f"max.f32 xc, $1, {_f32_hex(EXP2_CLAMP)};\n\t"
    f"add.rm.f32 t, xc, {_f32_hex(EXP2_ROUND_MAGIC)};\n\t"
    f"sub.rn.f32 n, t, {_f32_hex(EXP2_ROUND_MAGIC)};\n\t"
    "sub.rn.f32 f, xc, n;\n\t"
    f"fma.rn.f32 p, f, {_f32_hex(EXP2_POLY[3])}, {_f32_hex(EXP2_POLY[2])};\n\t"
    f"fma.rn.f32 p, p, f, {_f32_hex(EXP2_POLY[1])};\n\t"
    f"fma.rn.f32 p, p, f, {_f32_hex(EXP2_POLY[0])};\n\t"
    "mov.b32 tb, t;\n\t"
    "mov.b32 pb, p;\n\t"
    "shl.b32 tb, tb, 23;\n\t"
    "add.s32 pb, pb, tb;\n\t"
    f"setp.lt.f32 small, xc, {_f32_hex(EXP2_FLUSH_BELOW)};\n\t"
    "selp.b32 $0, 0, pb, small;\n\t"
    "}\n"
)


@dsl_user_op
def exp2_poly(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x for -inf <= x < 127 on the FMA and ALU pipes, one value (Note [Software
    exp2]); any arch."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            _EXP2_POLY_PTX,
            "=r,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


# ------------------------------------------------------------------ host side
def exp2_poly_numpy(x: np.ndarray) -> np.ndarray:
    """Numpy float32 mirror of ``exp2_poly_x2``, one device step per line.

    x: any shape, cast to float32. ``np.floor`` stands in for the round-down add:
    for |x| <= 127 the device's ``t = x + 1.5*2^23 (rm)`` equals
    ``1.5*2^23 + floor(x)`` exactly, which is what is formed here.
    """
    f32 = np.float32
    x = np.asarray(x, dtype=f32)
    magic = f32(EXP2_ROUND_MAGIC)
    xc = np.maximum(x, f32(EXP2_CLAMP))
    t = (magic + np.floor(xc)).astype(f32)
    n = (t - magic).astype(f32)
    f = (xc - n).astype(f32)
    c0, c1, c2, c3 = (f32(c) for c in EXP2_POLY)
    # The device fma rounds once; here the float64 product is exact and the sum is
    # rounded to float64, then to float32. That double rounding can differ from
    # the fma in the last float32 bit on rare ties (~1e-7 relative), far below
    # the 1e-4 level the tests check.
    p = (f.astype(np.float64) * c3 + c2).astype(f32)
    p = (p.astype(np.float64) * f + c1).astype(f32)
    p = (p.astype(np.float64) * f + c0).astype(f32)
    bits = p.view(np.uint32) + (t.view(np.uint32) << np.uint32(23))
    out = bits.astype(np.uint32).view(f32)
    return np.where(xc < f32(EXP2_FLUSH_BELOW), f32(0.0), out).astype(f32)


__all__ = [
    "EXP2_CLAMP",
    "EXP2_FLUSH_BELOW",
    "EXP2_POLY",
    "EXP2_ROUND_MAGIC",
    "exp2_poly",
    "exp2_poly_numpy",
    "exp2_poly_x2",
]
