"""The reference backend's indexer path (DeepSeek sparse attention): the builder passes
the step's tensors through; the impl writes the index keys and selects with the torch
oracles of :mod:`attnkit.kernels.dsa.reference`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from typing_extensions import override

from ...builder import AttentionCGSupport, AttentionMetadataBuilder
from ...config import AttentionConfig
from ...errors import InvalidArgumentError
from ...impl import IndexerImpl
from ...kernels.dsa.reference import indexer_logits, topk_select, write_index_cache
from ...kinds import rules_for
from ...metadata import CommonAttentionMetadata, SparseSelection
from ...params import AttentionLayerParams
from ...spec import IndexerSpec

__all__ = ["IndexerMetadata", "ReferenceIndexerBuilder", "ReferenceIndexerImpl"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexerMetadata:
    """One indexer group's step (``CommonAttentionMetadata``'s tensors, no copies).

    Attributes:
        max_seq_len: the longest context of the step (from the host lengths).
        window: the paired MLA layers' window, else ``None``.
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_seq_len: int
    window: int | None = None


class ReferenceIndexerBuilder(AttentionMetadataBuilder[IndexerMetadata, IndexerSpec]):
    """Builds ``IndexerMetadata``."""

    cudagraph_support = AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: IndexerSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        self.window = rules_for(kv_cache_spec).mask(kv_cache_spec).window

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> IndexerMetadata:
        cm = common_attn_metadata
        longest = int(cm.seq_lens_cpu.max()) if cm.seq_lens_cpu.numel() else 1
        return IndexerMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            max_seq_len=max(1, longest),
            window=self.window,
        )


class ReferenceIndexerImpl(IndexerImpl[IndexerMetadata, AttentionLayerParams]):
    """Writes index keys, scores every visible position, keeps the top ``index_topk``."""

    @override
    def select(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: IndexerMetadata,
        selection: SparseSelection,
        paired_block_table: torch.Tensor | None = None,
    ) -> SparseSelection:
        md, spec = attn_metadata, self.kv_cache_spec
        n = md.num_actual_tokens
        if len(kv_cache) != 1:
            raise InvalidArgumentError(
                f"ReferenceIndexerImpl.select: kv_cache must hold one tensor (the index "
                f"cache), got {len(kv_cache)}"
            )
        if selection.topk != spec.index_topk or selection.indices.shape[0] < n:
            raise InvalidArgumentError(
                f"ReferenceIndexerImpl.select: selection must have topk={spec.index_topk} "
                f"(the spec's index_topk) and at least {n} rows, got "
                f"{tuple(selection.indices.shape)}"
            )
        if tuple(weights.shape[:2]) != (query.shape[0], query.shape[1]):
            raise InvalidArgumentError(
                f"ReferenceIndexerImpl.select: weights must be [T, H] = "
                f"[{query.shape[0]}, {query.shape[1]}] (one per query and index head), got "
                f"{list(weights.shape)}"
            )
        write_index_cache(key[:n], kv_cache[0], md.slot_mapping[:n])
        logits = indexer_logits(
            query[:n],
            weights[:n],
            kv_cache[0],
            query_start_loc=md.query_start_loc,
            seq_lens=md.seq_lens,
            block_table=md.block_table,
            max_seq_len=md.max_seq_len,
            window=md.window,
        )
        indices, lens = topk_select(
            logits,
            query_start_loc=md.query_start_loc,
            seq_lens=md.seq_lens,
            block_table=md.block_table if paired_block_table is None else paired_block_table,
            block_size=spec.block_size,
            topk=spec.index_topk,
            window=md.window,
        )
        out = selection.rows(n)
        out.indices.copy_(indices)
        out.lens.copy_(lens)
        return out
