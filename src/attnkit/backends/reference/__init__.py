"""The ``reference`` backend: pure torch, every kind, CPU and CUDA; the oracle for the others."""

from __future__ import annotations

from .attention import ReferenceAttentionBuilder, ReferenceAttentionImpl, ReferenceAttentionMetadata
from .backend import ReferenceBackend
from .state import ReferenceStateBuilder, ReferenceStateImpl, ReferenceStateMetadata

__all__ = [
    "ReferenceAttentionBuilder",
    "ReferenceAttentionImpl",
    "ReferenceAttentionMetadata",
    "ReferenceBackend",
    "ReferenceStateBuilder",
    "ReferenceStateImpl",
    "ReferenceStateMetadata",
]
