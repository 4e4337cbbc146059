"""``triton_mla``: multi-head latent attention (MLA, DeepSeek-V2/V3) with Triton kernels.

Importing this package does not import triton; the builder and impl do, when they are
constructed.
"""

from __future__ import annotations

from .backend import (
    DECODE_THRESHOLD,
    MLAPrefillCosts,
    MLAPrefillMetadata,
    TritonMLABackend,
    TritonMLAImpl,
    TritonMLAMetadata,
    TritonMLAMetadataBuilder,
    TritonMLAOptions,
    mla_prefill_costs,
)

__all__ = [
    "DECODE_THRESHOLD",
    "MLAPrefillCosts",
    "MLAPrefillMetadata",
    "TritonMLABackend",
    "TritonMLAImpl",
    "TritonMLAMetadata",
    "TritonMLAMetadataBuilder",
    "TritonMLAOptions",
    "mla_prefill_costs",
]
