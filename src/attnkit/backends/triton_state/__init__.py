"""Triton backends for state layers (``MambaSpec``): one per ``mamba_type``.

``triton_mamba1``, ``triton_mamba2``, ``triton_gdn``, ``triton_linear_attn`` and ``triton_short_conv``
share one builder (narrowed to ``MambaSpec``) whose metadata splits each step into
decodes (one token, the ``*_update`` kernels) and prefills (the varlen kernels).
Importing this package does not import triton.
"""

from __future__ import annotations

from .backend import (
    TritonGatedDeltaNetBackend,
    TritonGatedDeltaNetImpl,
    TritonLinearAttentionBackend,
    TritonLinearAttentionImpl,
    TritonMamba1Backend,
    TritonMamba1Impl,
    TritonMamba2Backend,
    TritonMamba2Impl,
    TritonShortConvBackend,
    TritonShortConvImpl,
    TritonStateMetadata,
    TritonStateMetadataBuilder,
)

__all__ = [
    "TritonGatedDeltaNetBackend",
    "TritonGatedDeltaNetImpl",
    "TritonLinearAttentionBackend",
    "TritonLinearAttentionImpl",
    "TritonMamba1Backend",
    "TritonMamba1Impl",
    "TritonMamba2Backend",
    "TritonMamba2Impl",
    "TritonShortConvBackend",
    "TritonShortConvImpl",
    "TritonStateMetadata",
    "TritonStateMetadataBuilder",
]
