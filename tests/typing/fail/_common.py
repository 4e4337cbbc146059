"""Well-typed pieces the fail cases misuse (this file itself must type-check cleanly)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from typing_extensions import override

from attnkit import (
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    FullAttentionSpec,
    MambaSpec,
)


@dataclasses.dataclass(frozen=True)
class MambaMeta:
    state_indices: torch.Tensor


@dataclasses.dataclass(frozen=True)
class AttnMeta:
    seq_lens: torch.Tensor


class MambaBuilder(AttentionMetadataBuilder[MambaMeta, MambaSpec]):
    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> MambaMeta:
        return MambaMeta(state_indices=common_attn_metadata.seq_lens)


class FullBuilder(AttentionMetadataBuilder[AttnMeta, FullAttentionSpec]):
    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AttnMeta:
        return AttnMeta(seq_lens=common_attn_metadata.seq_lens)


class MambaImpl(AttentionImpl[MambaMeta]):
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


class AttnImpl(AttentionImpl[AttnMeta]):
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
