"""Rounding helpers shared by the Triton kernels (device functions)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["round_bf16"]


@triton.jit
def round_bf16(x, ENABLE: tl.constexpr):
    """Round float32 ``x`` to the nearest bfloat16 value (ties to even), kept as float32.

    Only enabled under the Triton interpreter, whose float32 -> bfloat16 conversion
    truncates instead of rounding to nearest; a following ``.to(tl.bfloat16)`` of the
    rounded value is then exact (bfloat16 subnormals, below 1.2e-38, still flush to
    zero there). Its ``tl.dot`` also misreads bfloat16 operands, so there the kernels
    keep a rounded operand in float32 and multiply in float32: what a bfloat16
    tensor-core product with float32 accumulation computes (products of two bfloat16
    values are exact in float32). NaN stays NaN; overflow rounds to inf. Compiled
    kernels convert with the hardware's round-to-nearest.
    """
    if ENABLE:
        bits = x.to(tl.uint32, bitcast=True)
        sign = bits & 0x80000000
        # Magnitude bits only, so the carry never overflows 32 bits (NaN kept below).
        mag = bits & 0x7FFFFFFF
        mag = (mag + 0x7FFF + ((mag >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, (sign | mag).to(tl.float32, bitcast=True))
    return x
