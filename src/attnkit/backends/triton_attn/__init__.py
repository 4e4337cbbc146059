"""``triton_attn``: causal paged attention (full and sliding window) with Triton kernels.

Importing this package does not import triton; the impl does, when it is constructed.
"""

from __future__ import annotations

from .backend import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

__all__ = [
    "TritonAttentionBackend",
    "TritonAttentionImpl",
    "TritonAttentionMetadata",
    "TritonAttentionMetadataBuilder",
]
