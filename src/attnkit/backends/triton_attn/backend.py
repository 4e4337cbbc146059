"""The ``triton_attn`` backend: causal paged attention with attnkit's Triton kernels.

Serves ``full_attention`` and ``sliding_window`` layers (GQA/MQA included) with
``kernels.triton.kv_write.write_kv_cache`` and
``kernels.triton.unified_attention.unified_attention``. The builder hands the kernels
the step's tensors as they are; ``forward`` launches them without converting anything.

Importing this module does not import triton: the impl imports the kernel modules
when it is constructed. On CPU the kernels run only under the Triton interpreter,
which must be switched on (``TRITON_INTERPRET=1``) before triton is first imported.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from typing_extensions import override

from ...backend import (
    AttentionBackend,
    AttentionFeature,
    AttentionImpl,
    AttentionLayerParams,
    LayerParams,
    SizeRange,
    SizeRule,
    bind_builder,
)
from ...builder import AttentionCGSupport, AttentionMetadataBuilder
from ...config import AttentionConfig
from ...metadata import CommonAttentionMetadata
from ...spec import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    SlidingWindowSpec,
)

__all__ = [
    "TritonAttentionBackend",
    "TritonAttentionImpl",
    "TritonAttentionMetadata",
    "TritonAttentionMetadataBuilder",
]

_KINDS = frozenset({KVCacheSpecKind.FULL_ATTENTION, KVCacheSpecKind.SLIDING_WINDOW})

# What the launcher (``unified_attention``) accepts; kept here as literals because
# reading them from the kernel module would import triton. The test suite checks
# that they still agree with the launcher.
_HEAD_SIZES: SizeRule = (SizeRange(16, 256),)
_BLOCK_SIZES: SizeRule = (16, 32)

# Values triton itself reads as "on" for TRITON_INTERPRET (case-insensitive).
_TRUTHY = frozenset({"1", "true", "on", "yes", "y"})
_KERNEL_MODULE = "attnkit.kernels.triton.unified_attention"
INTERPRETER_REASON = (
    "device=cpu needs the Triton interpreter (set TRITON_INTERPRET=1 before importing triton)"
)
KERNELS_COMPILED_REASON = (
    "device=cpu needs the Triton interpreter, but attnkit's Triton kernels were already "
    "imported without it (set TRITON_INTERPRET=1 before importing triton)"
)


def _check_kind(who: str, spec: KVCacheSpec) -> None:
    # The bindings are to FullAttentionSpec and SlidingWindowSpec, whose subclasses
    # (sink, MLA, sliding-window MLA) match them by isinstance but need other kernels.
    if spec.kind not in _KINDS:
        served = ", ".join(sorted(k.value for k in _KINDS))
        raise TypeError(
            f"{who} serves kinds {served}, got {type(spec).__name__} (kind={spec.kind.value})"
        )


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TritonAttentionMetadata:
    """One group's step, exactly as the Triton kernels take it.

    The tensors are ``CommonAttentionMetadata``'s own (no copies): ``query_start_loc``
    int32 ``[B+1]``, ``seq_lens`` int32 ``[B]``, ``block_table`` int32 ``[B, MB]``,
    ``slot_mapping`` int64 ``[T']``. ``num_actual_tokens`` is ``T`` (rows past it are
    padding: not written to the cache, their output left untouched);
    ``sliding_window`` is the group's window, ``None`` for full attention.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    sliding_window: int | None


class TritonAttentionMetadataBuilder(
    AttentionMetadataBuilder[TritonAttentionMetadata, AttentionSpec]
):
    """Passes the step's tensors through; reads only Python ints (no device sync)."""

    @classmethod
    @override
    def get_cudagraph_support(
        cls, config: AttentionConfig, kv_cache_spec: KVCacheSpec
    ) -> AttentionCGSupport:
        # The launcher sizes its grid from max_query_len, a Python int that changes
        # from step to step in mixed batches, so only batches where it is fixed can be
        # replayed: in a single-token decode batch it is 1, the grid is
        # (requests, kv heads) and every other launch argument (scale, window, strides,
        # constexprs) is fixed per group. max_seq_len is only checked on the host
        # against the block-table width, never passed to the kernel; the kernels read
        # seq_lens, block tables and slots from the tensors, so replays see new values
        # as long as the runtime keeps those tensors at fixed addresses. Uniform
        # multi-token batches (and ALWAYS) are left to later work: not claimed here.
        # Not yet exercised on a GPU in this slice's tests.
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> None:
        _check_kind(type(self).__name__, kv_cache_spec)
        super().__init__(kv_cache_spec, layer_names, config, device)
        self.sliding_window: int | None = (
            kv_cache_spec.sliding_window if isinstance(kv_cache_spec, SlidingWindowSpec) else None
        )

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TritonAttentionMetadata:
        cm = common_attn_metadata
        if not cm.causal:
            raise ValueError(
                f"{type(self).__name__}: the Triton kernels are causal only, got causal=False"
            )
        return TritonAttentionMetadata(
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            num_actual_tokens=cm.num_actual_tokens,
            sliding_window=self.sliding_window,
        )


class TritonAttentionImpl(AttentionImpl[TritonAttentionMetadata]):
    """Writes the step's K/V with ``write_kv_cache``, then runs ``unified_attention``.

    Raises at construction (so a bad layer fails before its first step):
        ValueError: ``layer_params`` is missing, asks for a feature the backend does
            not declare, or does not fit the spec.
        TypeError: the spec or the parameters are of the wrong kind.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, layer_params: LayerParams | None) -> None:
        super().__init__(kv_cache_spec, layer_params)
        who = type(self).__name__
        if not isinstance(kv_cache_spec, AttentionSpec):
            raise TypeError(f"{who} needs an AttentionSpec, got {type(kv_cache_spec).__name__}")
        _check_kind(who, kv_cache_spec)
        if layer_params is None:
            raise ValueError(f"{who} needs AttentionLayerParams (num_heads, scale, ...), got None")
        if not isinstance(layer_params, AttentionLayerParams):
            raise TypeError(f"{who} needs AttentionLayerParams, got {type(layer_params).__name__}")
        unsupported = sorted(
            f.value for f in layer_params.features - TritonAttentionBackend.supported_features
        )
        if unsupported:
            raise ValueError(
                f"{who}: the layer needs {', '.join(unsupported)}, which triton_attn does not "
                f"support (supported features: none)"
            )
        if layer_params.v_head_size not in (None, kv_cache_spec.head_size):
            raise ValueError(
                f"{who}: v_head_size={layer_params.v_head_size} differs from "
                f"head_size={kv_cache_spec.head_size}, which triton_attn does not support"
            )
        if layer_params.sink_key is not None:
            raise ValueError(f"{who}: sink tokens (sink_key/sink_value) are not supported")
        if layer_params.num_heads % kv_cache_spec.num_kv_heads:
            raise ValueError(
                f"{who}: num_heads={layer_params.num_heads} is not a multiple of "
                f"num_kv_heads={kv_cache_spec.num_kv_heads}"
            )
        self.num_heads = layer_params.num_heads
        self.scale: float = (
            layer_params.scale if layer_params.scale is not None else kv_cache_spec.head_size**-0.5
        )
        # Imported here, not at module level: importing the backend must not import
        # triton (and on CPU, triton must be imported after TRITON_INTERPRET is set).
        from ...kernels.triton.kv_write import write_kv_cache
        from ...kernels.triton.unified_attention import unified_attention

        self._write_kv_cache: Callable[..., None] = write_kv_cache
        self._unified_attention: Callable[..., Any] = unified_attention

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: TritonAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        if key is None or value is None:
            raise ValueError(f"{type(self).__name__}.forward needs key and value tensors")
        if len(kv_cache) != 1:
            raise ValueError(
                f"{type(self).__name__}.forward expects one cache tensor per layer, "
                f"got {len(kv_cache)}"
            )
        cache = kv_cache[0]
        m = attn_metadata
        n = m.num_actual_tokens
        self._write_kv_cache(key[:n], value[:n], cache, m.slot_mapping[:n])
        self._unified_attention(
            query,
            cache,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            scale=self.scale,
            sliding_window=m.sliding_window,
            output=output,
        )
        return output


class TritonAttentionBackend(AttentionBackend):
    """Causal paged attention (full and sliding window, GQA/MQA) in Triton."""

    name = "triton_attn"
    description = "Triton paged attention: full and sliding-window causal, GQA/MQA"
    supported_kinds = _KINDS
    supported_devices = frozenset({"cpu", "cuda"})
    supported_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    supported_kv_cache_dtypes = frozenset({"auto"})
    supported_head_sizes = _HEAD_SIZES
    supported_block_sizes = _BLOCK_SIZES
    supported_features = frozenset[AttentionFeature]()  # none of the optional features
    required_packages: ClassVar[Mapping[str, str]] = {"triton": "triton>=3.0"}
    builders = (
        bind_builder(FullAttentionSpec, TritonAttentionMetadataBuilder, TritonAttentionImpl),
        bind_builder(SlidingWindowSpec, TritonAttentionMetadataBuilder, TritonAttentionImpl),
    )

    @classmethod
    @override
    def extra_environment_reasons(cls, device: torch.device) -> list[str]:
        """On CPU, the Triton interpreter must be on (read from the environment now)."""
        if device.type != "cpu":
            return []
        if os.environ.get("TRITON_INTERPRET", "").lower() not in _TRUTHY:
            return [INTERPRETER_REASON]
        # triton.jit picks interpreter or compiler when a kernel is defined, so kernels
        # imported before the variable was set stay compiled (and cannot run on CPU).
        kernels = sys.modules.get(_KERNEL_MODULE)
        if kernels is not None and getattr(kernels, "_INTERPRETED", True) is False:
            return [KERNELS_COMPILED_REASON]
        return []
