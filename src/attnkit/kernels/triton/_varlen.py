"""Device and launcher helpers shared by the varlen state-layer kernels (conv1d, Mamba2).

``find_segment`` maps a flat index (token or chunk) to its request by binary search over
cumulative offsets on the device; ``search_iters`` sizes that search from shapes only.
The launcher helpers check the supported input dtypes and an optional ``out`` tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnkit.kernels._state_common import check_tensor

__all__ = [
    "SUPPORTED_DTYPES",
    "alloc_out",
    "check_dtype",
    "check_out",
    "find_segment",
    "search_iters",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def find_segment(offsets_ptr, stride, num_segments, target, search_iters):
    """Segment ``b`` with ``offsets[b] <= target < offsets[b + 1]`` (scalar or vector).

    ``offsets`` has ``num_segments + 1`` non-decreasing entries starting at or below
    ``target``. Empty segments (equal neighbours) are never returned. A target at or
    past ``offsets[num_segments]`` yields ``num_segments``; callers mask it out. Loads
    stay inside ``offsets[1 : num_segments + 1]`` whatever the values.
    ``search_iters >= bit_length(num_segments)`` iterations suffice.
    """
    # Binary search for the first k in [1, num_segments] with offsets[k] > target.
    lo = target * 0 + 1
    hi = target * 0 + num_segments
    for _ in range(search_iters):
        mid = (lo + hi) // 2
        value = tl.load(offsets_ptr + mid * stride)
        right = value <= target
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo - 1


def search_iters(num_segments: int) -> int:
    """Binary-search steps for :func:`find_segment` over ``num_segments`` segments."""
    return max(num_segments, 1).bit_length()


def check_dtype(name: str, t: Tensor | None) -> None:
    """Reject dtypes the kernels do not read (shared with ``mamba2``)."""
    if t is not None and t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: expected dtype in {SUPPORTED_DTYPES}, got {t.dtype}")


def check_out(out: object, like: Tensor, layout: str) -> Tensor | None:
    """``out`` is None or a tensor of the shape, dtype and device of ``like`` (= x)."""
    if out is None:
        return None
    out = check_tensor("out", out, layout=layout, shape=tuple(like.shape), device=like.device)
    if out.dtype != like.dtype:
        raise ValueError(f"out: expected the dtype of x ({like.dtype}), got {out.dtype}")
    return out


def alloc_out(out: object, like: Tensor, layout: str) -> Tensor:
    """``out`` checked by :func:`check_out`, or a new tensor like ``like`` when None."""
    result = check_out(out, like, layout)
    return torch.empty_like(like) if result is None else result
