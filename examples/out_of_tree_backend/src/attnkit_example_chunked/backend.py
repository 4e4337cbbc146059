"""A complete third-party backend: declarations, a narrowed builder, and a typed impl.

It serves one kind, ``chunked_local_attention`` (the kind of the one spec class it
binds), with attnkit's pure-torch paged attention kernels. Installed, it is
discovered through its ``attnkit.backends`` entry point and chosen with
``AttentionConfig(backend_per_kind={"chunked_local_attention": "example_chunked_local"})``.
Author-side names come from ``attnkit.backend_api``; specs, layer parameters and the
config from ``attnkit``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from typing_extensions import override

from attnkit import AttentionConfig, AttentionLayerParams, ChunkedLocalAttentionSpec, KVCacheSpec
from attnkit.backend_api import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
    attention_params_problems,
    bind_builder,
)
from attnkit.kernels.attention.reference import paged_attention, write_kv_cache


@dataclasses.dataclass(frozen=True)
class ChunkedLocalMetadata:
    """What the kernels take, as they take it (no conversion in ``forward``)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    chunk_size: int


class ChunkedLocalBuilder(AttentionMetadataBuilder[ChunkedLocalMetadata, ChunkedLocalAttentionSpec]):
    """Narrowed to ``ChunkedLocalAttentionSpec`` by its type parameter: no asserts."""

    @classmethod
    @override
    def get_cudagraph_support(
        cls, config: AttentionConfig, kv_cache_spec: KVCacheSpec
    ) -> AttentionCGSupport:
        # The torch kernels read lengths back to the host: nothing can be captured.
        return AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: ChunkedLocalAttentionSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        self.chunk_size = kv_cache_spec.attention_chunk_size

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ChunkedLocalMetadata:
        cm = common_attn_metadata
        return ChunkedLocalMetadata(
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            num_actual_tokens=cm.num_actual_tokens,
            chunk_size=self.chunk_size,
        )


class ChunkedLocalImpl(
    AttentionImpl[ChunkedLocalMetadata, ChunkedLocalAttentionSpec, AttentionLayerParams]
):
    """Typed by its spec and parameters: attnkit constructs it only with those."""

    def __init__(
        self, kv_cache_spec: ChunkedLocalAttentionSpec, layer_params: AttentionLayerParams
    ) -> None:
        super().__init__(kv_cache_spec, layer_params)
        # The kernel call below passes no soft-cap, ALiBi or sinks: refuse such layers.
        problems = attention_params_problems(
            kv_cache_spec, layer_params, backend=ChunkedLocalBackend.name, supported_features=frozenset()
        )
        if problems:
            raise ValueError("ChunkedLocalImpl: " + "; ".join(problems))
        default_scale = kv_cache_spec.head_size**-0.5
        self.scale = layer_params.scale if layer_params.scale is not None else default_scale

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ChunkedLocalMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        if key is None or value is None:
            raise ValueError("chunked local attention needs key and value tensors")
        (cache,) = kv_cache
        n = attn_metadata.num_actual_tokens
        write_kv_cache(key[:n], value[:n], cache, attn_metadata.slot_mapping[:n])
        return paged_attention(
            query,
            cache,
            query_start_loc=attn_metadata.query_start_loc,
            seq_lens=attn_metadata.seq_lens,
            block_table=attn_metadata.block_table,
            scale=self.scale,
            causal=True,
            chunk_size=attn_metadata.chunk_size,
            output=output,
        )


class ChunkedLocalBackend(AttentionBackend):
    name = "example_chunked_local"
    description = "out-of-tree example: chunked local attention in pure torch"
    supported_devices = frozenset({"cpu", "cuda"})
    supported_block_sizes = (MultipleOf(8),)
    builders = (bind_builder(ChunkedLocalAttentionSpec, ChunkedLocalBuilder, ChunkedLocalImpl),)
