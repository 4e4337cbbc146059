"""Well-typed pieces the fail cases misuse (this file itself must type-check cleanly
under mypy and pyright)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from typing_extensions import override

from attnkit import (
    AttentionLayerParams,
    AttentionSpec,
    FullAttentionSpec,
    Mamba2Inputs,
    Mamba2LayerParams,
    MambaSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from attnkit.backend_api import (
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    StateImpl,
)


@dataclasses.dataclass(frozen=True)
class MambaMeta:
    state_indices: torch.Tensor


@dataclasses.dataclass(frozen=True)
class AttnMeta:
    seq_lens: torch.Tensor


class MambaBuilder(AttentionMetadataBuilder[MambaMeta, MambaSpec]):
    """Accepts MambaSpec only."""

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> MambaMeta:
        return MambaMeta(state_indices=common_attn_metadata.seq_lens)


class FullBuilder(AttentionMetadataBuilder[AttnMeta, FullAttentionSpec]):
    """Accepts FullAttentionSpec (and its subclasses) only."""

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AttnMeta:
        return AttnMeta(seq_lens=common_attn_metadata.seq_lens)


class AnyAttentionBuilder(AttentionMetadataBuilder[AttnMeta, AttentionSpec]):
    """Accepts every attention spec."""

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AttnMeta:
        return AttnMeta(seq_lens=common_attn_metadata.seq_lens)


class AttnImpl(AttentionImpl[AttnMeta, AttentionSpec, AttentionLayerParams]):
    """Consumes AttnMeta; takes any attention spec."""

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: AttnMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return output


class FullOnlyImpl(AttentionImpl[AttnMeta, FullAttentionSpec, AttentionLayerParams]):
    """Consumes AttnMeta; narrowed to FullAttentionSpec."""

    def __init__(self, kv_cache_spec: FullAttentionSpec, layer_params: AttentionLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: AttnMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return output


class SinkOnlyImpl(AttentionImpl[AttnMeta, SinkFullAttentionSpec, AttentionLayerParams]):
    """Consumes AttnMeta; narrowed to SinkFullAttentionSpec (a FullAttentionSpec subclass)."""

    def __init__(
        self, kv_cache_spec: SinkFullAttentionSpec, layer_params: AttentionLayerParams
    ) -> None:
        super().__init__(kv_cache_spec, layer_params)

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: AttnMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return output


class SlidingOnlyImpl(AttentionImpl[AttnMeta, SlidingWindowSpec, AttentionLayerParams]):
    """Consumes AttnMeta; narrowed to SlidingWindowSpec."""

    def __init__(
        self, kv_cache_spec: SlidingWindowSpec, layer_params: AttentionLayerParams
    ) -> None:
        super().__init__(kv_cache_spec, layer_params)

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: AttnMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return output


class MambaImpl(StateImpl[MambaMeta, Mamba2LayerParams, Mamba2Inputs]):
    """Consumes MambaMeta and Mamba2Inputs."""

    def __init__(self, kv_cache_spec: MambaSpec, layer_params: Mamba2LayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)

    @override
    def forward(
        self,
        inputs: Mamba2Inputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: MambaMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return output


class MambaMetaAttnImpl(AttentionImpl[MambaMeta, AttentionSpec, AttentionLayerParams]):
    """An attention impl that consumes MambaMeta (no attention builder makes it)."""

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: MambaMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return output
