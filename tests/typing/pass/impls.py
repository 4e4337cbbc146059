"""An AttentionImpl and a StateImpl read their typed spec and parameters with no
isinstance; bind_builder / bind_each carry the metadata type."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from typing_extensions import assert_type, override

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    FullAttentionSpec,
    GatedDeltaNetInputs,
    GatedDeltaNetLayerParams,
    KVCacheSpecKind,
    MambaSpec,
    SlidingWindowSpec,
)
from attnkit.backend_api import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    BuilderBinding,
    CommonAttentionMetadata,
    StateImpl,
    bind_builder,
    bind_each,
)


@dataclasses.dataclass(frozen=True)
class WindowMeta:
    seq_lens: torch.Tensor
    window: int


@dataclasses.dataclass(frozen=True)
class GdnMeta:
    state_indices: torch.Tensor


class WindowBuilder(AttentionMetadataBuilder[WindowMeta, SlidingWindowSpec]):
    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> WindowMeta:
        assert_type(self.kv_cache_spec.sliding_window, int)
        return WindowMeta(
            seq_lens=common_attn_metadata.seq_lens, window=self.kv_cache_spec.sliding_window
        )


class WindowImpl(AttentionImpl[WindowMeta, SlidingWindowSpec, AttentionLayerParams]):
    def __init__(self, kv_cache_spec: SlidingWindowSpec, layer_params: AttentionLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        # Typed reads, no isinstance: the spec is a SlidingWindowSpec.
        self.left = kv_cache_spec.sliding_window - 1
        self.scale = layer_params.scale or kv_cache_spec.head_size**-0.5

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: WindowMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        assert_type(self.kv_cache_spec, SlidingWindowSpec)
        assert_type(self.kv_cache_spec.sliding_window, int)
        assert_type(self.layer_params, AttentionLayerParams)
        assert_type(self.layer_params.num_heads, int)
        assert_type(self.layer_params.logits_soft_cap, float | None)
        assert_type(attn_metadata.window, int)
        return output


class GdnBuilder(AttentionMetadataBuilder[GdnMeta, MambaSpec]):
    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> GdnMeta:
        return GdnMeta(state_indices=common_attn_metadata.seq_lens)


class GdnImpl(StateImpl[GdnMeta, GatedDeltaNetLayerParams, GatedDeltaNetInputs]):
    @override
    def forward(
        self,
        inputs: GatedDeltaNetInputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: GdnMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        assert_type(self.kv_cache_spec, MambaSpec)
        assert_type(self.layer_params, GatedDeltaNetLayerParams)
        assert_type(inputs.qkv, torch.Tensor)
        assert_type(inputs.beta, torch.Tensor)
        assert_type(attn_metadata.state_indices, torch.Tensor)
        return output


class AnyFullBuilder(AttentionMetadataBuilder[WindowMeta, FullAttentionSpec]):
    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> WindowMeta:
        return WindowMeta(seq_lens=common_attn_metadata.seq_lens, window=0)


class MyBackend(AttentionBackend):
    name = "my_backend"
    builders = (
        bind_builder(SlidingWindowSpec, WindowBuilder, WindowImpl),
        bind_builder(MambaSpec, GdnBuilder, GdnImpl),
    )


def check(spec: SlidingWindowSpec, cm: CommonAttentionMetadata) -> None:
    window = bind_builder(SlidingWindowSpec, WindowBuilder, WindowImpl)
    assert_type(window, BuilderBinding[SlidingWindowSpec, WindowMeta])
    assert_type(bind_builder(MambaSpec, GdnBuilder, GdnImpl), BuilderBinding[MambaSpec, GdnMeta])
    config = AttentionConfig()
    builder = window.create(spec, ["layers.0"], config, torch.device("cpu"))
    assert_type(builder.build(0, cm), WindowMeta)

    # An impl taking any AttentionSpec can be bound to each concrete class at once.
    class AnyImpl(AttentionImpl[WindowMeta]):
        @override
        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor | None,
            value: torch.Tensor | None,
            kv_cache: Sequence[torch.Tensor],
            attn_metadata: WindowMeta,
            output: torch.Tensor,
        ) -> torch.Tensor:
            return output

    several = bind_each((FullAttentionSpec,), AnyFullBuilder, AnyImpl)
    assert_type(several, tuple[BuilderBinding[FullAttentionSpec, WindowMeta], ...])
    assert_type(MyBackend.supported_kinds(), frozenset[KVCacheSpecKind])
