"""The ``reference`` backend: pure torch, every kind, CPU and CUDA; the oracle for the others."""

from __future__ import annotations

from .attention import ReferenceAttentionBuilder, ReferenceAttentionImpl, ReferenceAttentionMetadata
from .backend import ReferenceBackend
from .mamba2 import ReferenceMamba2Builder, ReferenceMamba2Impl, ReferenceMamba2Metadata

__all__ = [
    "ReferenceAttentionBuilder",
    "ReferenceAttentionImpl",
    "ReferenceAttentionMetadata",
    "ReferenceBackend",
    "ReferenceMamba2Builder",
    "ReferenceMamba2Impl",
    "ReferenceMamba2Metadata",
]
