"""The ``reference`` backend: pure torch, every kind, CPU and CUDA; the oracle for the others."""

from __future__ import annotations

from .attention import ReferenceAttentionBuilder, ReferenceAttentionImpl, ReferenceAttentionMetadata
from .backend import ReferenceBackend
from .mamba2 import ReferenceMamba2Impl, ReferenceStateBuilder, ReferenceStateMetadata
from .state import (
    ReferenceGatedDeltaNetImpl,
    ReferenceLinearAttentionImpl,
    ReferenceShortConvImpl,
    ReferenceStateImpl,
)

__all__ = [
    "ReferenceAttentionBuilder",
    "ReferenceAttentionImpl",
    "ReferenceAttentionMetadata",
    "ReferenceBackend",
    "ReferenceGatedDeltaNetImpl",
    "ReferenceLinearAttentionImpl",
    "ReferenceMamba2Impl",
    "ReferenceShortConvImpl",
    "ReferenceStateBuilder",
    "ReferenceStateImpl",
    "ReferenceStateMetadata",
]
