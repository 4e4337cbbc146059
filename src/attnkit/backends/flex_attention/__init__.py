"""``flex_attention``: compiled FlexAttention over the paged K/V planes, on CUDA and, when
selected by name, on CPU (where the default is ``cpu_attn``).

Importing this package imports neither dynamo nor inductor; the builder and impl do,
when a step first runs FlexAttention. ``compile_records()`` lists the shapes compiled so far in the
process and what each first call cost.
"""

from __future__ import annotations

from ._compile import CompileRecord, FlexCompileError, compile_records
from .backend import (
    FlexAttentionBackend,
    FlexAttentionImpl,
    FlexAttentionMetadata,
    FlexAttentionMetadataBuilder,
    FlexAttentionOptions,
)

__all__ = [
    "CompileRecord",
    "FlexAttentionBackend",
    "FlexAttentionImpl",
    "FlexAttentionMetadata",
    "FlexAttentionMetadataBuilder",
    "FlexAttentionOptions",
    "FlexCompileError",
    "compile_records",
]
