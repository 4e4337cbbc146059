"""``flash_attn``: flash-attn 2 or 4 varlen kernels over attnkit's paged cache.

Importing this package does not import flash-attn; the impl does, on its first
``forward``. Which version runs, and every rule that depends on it, is decided in
``_versions.choose_version``.
"""

from __future__ import annotations

from ._versions import VersionChoice, choose_version
from .backend import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
    FlashAttentionOptions,
)

__all__ = [
    "FlashAttentionBackend",
    "FlashAttentionImpl",
    "FlashAttentionMetadata",
    "FlashAttentionMetadataBuilder",
    "FlashAttentionOptions",
    "VersionChoice",
    "choose_version",
]
