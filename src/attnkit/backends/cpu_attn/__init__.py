"""``cpu_attn``: attention over the paged K/V planes on CPU through attnkit's CPU engines
(the native paged decode and blocked prefill); the first choice on CPU. ``mla`` holds
``cpu_mla``, the same engines for absorbed MLA layers.

Importing this package loads nothing; the native library is loaded (prebuilt, or
compiled once per machine) when selection first asks whether it can, or a step first
runs it.
"""

from __future__ import annotations

from .backend import (
    NATIVE_MAX_QUERY,
    CpuAttentionBackend,
    CpuAttentionImpl,
    CpuAttentionMetadata,
    CpuAttentionMetadataBuilder,
)
from .mla import CpuMLABackend, CpuMLAImpl

__all__ = [
    "NATIVE_MAX_QUERY",
    "CpuAttentionBackend",
    "CpuAttentionImpl",
    "CpuAttentionMetadata",
    "CpuAttentionMetadataBuilder",
    "CpuMLABackend",
    "CpuMLAImpl",
]
