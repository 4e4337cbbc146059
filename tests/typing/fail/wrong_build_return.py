"""build() must return the metadata type the builder declares; the spec type argument
must be a KVCacheSpec."""

from __future__ import annotations

from typing_extensions import override

from attnkit import MambaSpec
from attnkit.backend_api import AttentionMetadataBuilder, CommonAttentionMetadata

from ._common import AttnMeta, MambaMeta


class ConfusedBuilder(AttentionMetadataBuilder[MambaMeta, MambaSpec]):
    @override
    def build(  # E: override | pyright: reportIncompatibleMethodOverride
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AttnMeta:
        return AttnMeta(seq_lens=common_attn_metadata.seq_lens)


class NotASpec(AttentionMetadataBuilder[MambaMeta, int]):  # E: type-var | pyright: reportInvalidTypeArguments
    pass
