"""``triton_mla``'s indexer (DeepSeek sparse attention): the builder passes the step's
tensors through; the impl writes the index keys, scores and selects with the Triton
kernels of :mod:`attnkit.kernels.dsa.triton`. Kernel launches only, no device reads."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from typing_extensions import override

from ...builder import AttentionCGSupport, AttentionMetadataBuilder
from ...config import AttentionConfig
from ...impl import IndexerImpl
from ...kinds import rules_for
from ...metadata import CommonAttentionMetadata, SparseSelection
from ...params import AttentionLayerParams
from ...spec import IndexerSpec

__all__ = ["TritonIndexerBuilder", "TritonIndexerImpl", "TritonIndexerMetadata"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonIndexerMetadata:
    """One indexer group's step: ``CommonAttentionMetadata``'s tensors (no copies) and
    the longest context, from the host lengths."""

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_seq_len: int
    window: int | None = None


class TritonIndexerBuilder(AttentionMetadataBuilder[TritonIndexerMetadata, IndexerSpec]):
    """Builds ``TritonIndexerMetadata``; the logits' width follows the step's longest
    context, so a captured graph would not fit the next step."""

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
    ) -> TritonIndexerMetadata:
        cm = common_attn_metadata
        longest = int(cm.seq_lens_cpu.max()) if cm.seq_lens_cpu.numel() else 1
        return TritonIndexerMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            max_seq_len=max(1, longest),
            window=self.window,
        )


class TritonIndexerImpl(IndexerImpl[TritonIndexerMetadata, AttentionLayerParams]):
    """``write_index_cache``, ``indexer_logits`` and ``topk_select`` (Triton)."""

    def __init__(self, kv_cache_spec: IndexerSpec, layer_params: AttentionLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        # Imported here: importing the backend must not import triton.
        from ...kernels.dsa.triton import indexer_logits, topk_select, write_index_cache

        self._write = write_index_cache
        self._logits = indexer_logits
        self._topk = topk_select

    @override
    def select(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: TritonIndexerMetadata,
        selection: SparseSelection,
        paired_block_table: torch.Tensor | None = None,
    ) -> SparseSelection:
        md, spec = attn_metadata, self.kv_cache_spec
        n = md.num_actual_tokens
        if len(kv_cache) != 1:
            raise ValueError(
                f"TritonIndexerImpl.select: kv_cache must hold 1 tensor (the index cache), "
                f"got {len(kv_cache)}"
            )
        self._write(key[:n], kv_cache[0], md.slot_mapping[:n])
        logits = self._logits(
            query[:n],
            weights[:n],
            kv_cache[0],
            query_start_loc=md.query_start_loc,
            seq_lens=md.seq_lens,
            block_table=md.block_table,
            max_seq_len=md.max_seq_len,
            window=md.window,
        )
        indices, lens = self._topk(
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
