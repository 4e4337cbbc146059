"""``cpu_attn``: attention over the paged K/V planes on CPU through attnkit's CPU engines
(a native paged-decode kernel, blocked matrix products for prefills); the first choice on
CPU.

Importing this package builds nothing; the native library is built (once per machine,
cached on disk) when selection first asks whether it can, or a step first runs it.
"""

from __future__ import annotations

from .backend import (
    NATIVE_MAX_QUERY,
    CpuAttentionBackend,
    CpuAttentionImpl,
    CpuAttentionMetadata,
    CpuAttentionMetadataBuilder,
)

__all__ = [
    "NATIVE_MAX_QUERY",
    "CpuAttentionBackend",
    "CpuAttentionImpl",
    "CpuAttentionMetadata",
    "CpuAttentionMetadataBuilder",
]
