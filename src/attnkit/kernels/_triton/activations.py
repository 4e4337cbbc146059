"""Elementwise device functions shared by several Triton kernels."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["softplus"]


@triton.jit
def softplus(x):
    """``torch.nn.functional.softplus`` (beta 1, threshold 20) in float32."""
    z = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + z
    # log1p(z) = log(u) * z / (u - 1) is accurate to a few ulps (Goldberg's trick),
    # where log(u) alone loses the low bits of a small z; u == 1 means log1p(z) = z.
    log1p = tl.where(u == 1.0, z, tl.log(u) * (z / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, log1p)
