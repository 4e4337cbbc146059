"""``flex_attention``: attention over the paged K/V planes: compiled FlexAttention on
CUDA (and on CPU when asked), the CPU engines of ``attnkit.kernels.attention`` on CPU by
default; the first choice on CPU.

Importing this package imports neither dynamo nor inductor; the builder and impl do,
when a step first runs FlexAttention. ``compile_records()`` lists the shapes compiled so far in the
process and what each first call cost.
"""

from __future__ import annotations

from ._compile import CompileRecord, FlexCompileError, compile_records
from .backend import (
    NATIVE_MAX_QUERY,
    CpuPlan,
    FlexAttentionBackend,
    FlexAttentionImpl,
    FlexAttentionMetadata,
    FlexAttentionMetadataBuilder,
    FlexAttentionOptions,
)

__all__ = [
    "NATIVE_MAX_QUERY",
    "CompileRecord",
    "CpuPlan",
    "FlexAttentionBackend",
    "FlexAttentionImpl",
    "FlexAttentionMetadata",
    "FlexAttentionMetadataBuilder",
    "FlexAttentionOptions",
    "FlexCompileError",
    "compile_records",
]
