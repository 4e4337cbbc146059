"""float8 e4m3fn on the device: the exact decoder and encoder, and the saturation.

e4m3fn has 1 sign, 4 exponent (bias 7) and 3 mantissa bits, no infinities; S.1111.111
is NaN and exponent 0 holds the subnormals ``m * 2**-9``.

The Triton interpreter stores float8 tensors as raw uint8 and converts them with a
generic bit-manipulation routine that decodes e4m3fn's NaN pattern (0x7F) as 480 and
whose float32 -> fp8 rounding is wrong for about one value in ten (mantissa carries,
ties, subnormals; measured against torch on triton 3.9). Under the interpreter the
kernels therefore read and write an fp8 cache through a uint8 view with
:func:`e4m3_bits_to_f32` and :func:`f32_to_e4m3_bits` (integer ops only: exact, and
bit-identical to torch's cast, which the tests check for every pattern); compiled
kernels keep the fp8 tensor and Triton's native conversion (hardware cvt on sm_89+)
behind the same constexpr flag (``FP8_BITS``), which costs them nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["e4m3_bits_to_f32", "f32_to_e4m3_bits", "saturate_e4m3"]


@triton.jit
def e4m3_bits_to_f32(bits):
    """Decode float8 e4m3fn bit patterns (uint8) to float32 with integer ops, exactly."""
    b = bits.to(tl.uint32)
    sign = b >> 7
    exponent = (b >> 3) & 0xF
    mantissa = b & 0x7
    # Normal numbers: rebias the exponent (127 - 7 = 120) and widen the mantissa.
    normal = ((sign << 31) | ((exponent + 120) << 23) | (mantissa << 20)).to(
        tl.float32, bitcast=True
    )
    subnormal = mantissa.to(tl.float32) * 0.001953125  # 2**-9, exact
    subnormal = tl.where(sign == 1, -subnormal, subnormal)
    value = tl.where(exponent == 0, subnormal, normal)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def f32_to_e4m3_bits(x):
    """float32 -> float8 e4m3fn bit pattern (uint8), round to nearest even, saturating
    to +-448 (e4m3fn has no infinity); NaN stays NaN (0x7F | sign).

    Integer arithmetic only, so under the interpreter it stores what torch's cast and
    the hardware conversion store.
    """
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000
    # Saturate: everything at or above 448 (0x43E00000) encodes as 0x7E.
    mag = tl.minimum(mag, 0x43E00000)
    # Normal range (|x| >= 2**-6): keep 3 of float32's 23 mantissa bits, rounding the 20
    # dropped bits to nearest with ties to the even kept value, then rebias the exponent
    # (127 -> 7, i.e. subtract 120 << 3 from the code).
    dropped = mag & 0xFFFFF
    kept = mag >> 20
    round_up = (dropped > 0x80000) | ((dropped == 0x80000) & ((kept & 1) == 1))
    normal = kept + round_up.to(tl.uint32) - (120 << 3)
    # Subnormal range (|x| < 2**-6): the code is |x| / 2**-9 rounded to an integer
    # (8 is the smallest normal's code, reached by rounding up). 2**23 + y rounds y in
    # [0, 2**23) to an integer with ties to even in float32 arithmetic.
    tiny = mag < 0x3C800000
    y = tl.where(tiny, mag, 0).to(tl.float32, bitcast=True) * 512.0
    sub = ((y + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(tiny, sub, normal)
    code = tl.where(is_nan, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def saturate_e4m3(x):
    """float32 ``x`` clamped to the finite e4m3fn range ``[-448, 448]``: a value rounding
    past 464 would become NaN. NaN itself passes through (min/max alone would drop it)."""
    clamped = tl.minimum(tl.maximum(x, -448.0), 448.0)
    return tl.where(x != x, x, clamped)
