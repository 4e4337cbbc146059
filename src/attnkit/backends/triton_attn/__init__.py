"""``triton_attn``: paged attention with Triton kernels (full, sliding-window, chunked-local,
encoder-only and cross attention).

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
