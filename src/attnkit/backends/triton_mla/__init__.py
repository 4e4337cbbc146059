"""``triton_mla``: multi-head latent attention (MLA, DeepSeek-V2/V3) with Triton kernels.

Importing this package does not import triton; the builder and impl do, when they are
constructed.
"""

from __future__ import annotations

from .backend import (
    TritonMLABackend,
    TritonMLAImpl,
    TritonMLAMetadata,
    TritonMLAMetadataBuilder,
)

__all__ = [
    "TritonMLABackend",
    "TritonMLAImpl",
    "TritonMLAMetadata",
    "TritonMLAMetadataBuilder",
]
