"""``triton_mla``: multi-head latent attention (MLA, DeepSeek-V2/V3) with Triton kernels.

Importing this package does not import triton; the builder and impl do, when they are
constructed. ``backend`` describes the backend and its modules.
"""

from __future__ import annotations

from .backend import TritonMLABackend
from .builder import (
    DECODE_THRESHOLD,
    MLAPrefillMetadata,
    TritonMLAMetadata,
    TritonMLAMetadataBuilder,
)
from .costs import MLAPrefillCosts, TritonMLAOptions, mla_prefill_costs
from .impl import TritonMLAImpl

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
