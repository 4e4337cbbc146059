"""A varlen batch on the device, shared by the Triton kernels of several ops.

``find_segment`` maps a flat index (token, chunk or query tile) to its request by binary
search over cumulative offsets on the device; ``search_iters`` sizes that search from
shapes only; ``chunk_bounds`` is the token range of one chunk of a batch whose chunks
start at each request's first token. ``flags_as_bytes`` is the launchers' view of a
bool flag tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["chunk_bounds", "find_segment", "flags_as_bytes", "search_iters"]


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


@triton.jit
def chunk_bounds(qsl_ptr, stride_qsl, cu_ptr, num_requests, num_search_iters, chunk, chunk_size):
    """Request and token range ``[start, end)`` of global chunk ``chunk`` (a real one).

    ``cu_ptr`` holds the cumulative chunk counts per request (``[B + 1]``), ``qsl_ptr``
    the cumulative token offsets; a request's chunks but its last are full.
    """
    request = find_segment(cu_ptr, 1, num_requests, chunk, num_search_iters)
    first = tl.load(cu_ptr + request)
    start = tl.load(qsl_ptr + request * stride_qsl) + (chunk - first) * chunk_size
    end = tl.minimum(start + chunk_size, tl.load(qsl_ptr + (request + 1) * stride_qsl))
    return request, start, end


def search_iters(num_segments: int) -> int:
    """Binary-search steps for :func:`find_segment` over ``num_segments`` segments."""
    return max(num_segments, 1).bit_length()


def flags_as_bytes(flags: Tensor) -> Tensor:
    """A uint8 view of the bool ``has_initial_state`` (same storage, no copy).

    A byte compared with 0 reads the same under the Triton interpreter and compiled.
    """
    return flags.view(torch.uint8)
