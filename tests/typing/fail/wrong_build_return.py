"""build() must return the metadata type the builder declares."""

from __future__ import annotations

from typing_extensions import override

from attnkit import AttentionMetadataBuilder, CommonAttentionMetadata, MambaSpec

from ._common import AttnMeta, MambaMeta


class ConfusedBuilder(AttentionMetadataBuilder[MambaMeta, MambaSpec]):
    @override
    def build(  # E: override
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AttnMeta:
        return AttnMeta(seq_lens=common_attn_metadata.seq_lens)


class NotASpec(AttentionMetadataBuilder[MambaMeta, int]):  # E: type-var
    pass
