"""What the indexer paths of the built-in backends share (DeepSeek sparse attention):
the metadata (``CommonAttentionMetadata``'s tensors, no copies), its builder, and the
impl's ``select`` over three kernels (the index-key write, the logits, the top-k), which
each backend supplies: the torch oracles (``reference``) or the Triton kernels
(``triton_mla``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from typing_extensions import override

from ..builder import AttentionCGSupport, AttentionMetadataBuilder
from ..config import AttentionConfig
from ..errors import InvalidArgumentError
from ..impl import IndexerImpl
from ..kinds import rules_for
from ..metadata import CommonAttentionMetadata, SparseSelection
from ..params import AttentionLayerParams
from ..spec import IndexerSpec

__all__ = ["IndexerBuilder", "IndexerKernelImpl", "IndexerMetadata"]


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


class IndexerBuilder(AttentionMetadataBuilder[IndexerMetadata, IndexerSpec]):
    """Builds ``IndexerMetadata``; the logits' width follows the step's longest context,
    so a captured graph would not fit the next step."""

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


class IndexerKernelImpl(IndexerImpl[IndexerMetadata, AttentionLayerParams]):
    """Writes index keys, scores every visible position, keeps the top ``index_topk``,
    with the kernels a subclass sets in ``_write``, ``_logits`` and ``_topk``."""

    _write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    _logits: Callable[..., torch.Tensor]
    _topk: Callable[..., tuple[torch.Tensor, torch.Tensor]]

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
        where = f"{type(self).__name__}.select"
        if len(kv_cache) != 1:
            raise InvalidArgumentError(
                f"{where}: kv_cache must hold one tensor (the index cache), got {len(kv_cache)}"
            )
        if selection.topk != spec.index_topk or selection.indices.shape[0] < n:
            raise InvalidArgumentError(
                f"{where}: selection must have topk={spec.index_topk} "
                f"(the spec's index_topk) and at least {n} rows, got "
                f"{tuple(selection.indices.shape)}"
            )
        if tuple(weights.shape[:2]) != (query.shape[0], query.shape[1]):
            raise InvalidArgumentError(
                f"{where}: weights must be [T, H] = "
                f"[{query.shape[0]}, {query.shape[1]}] (one per query and index head), got "
                f"{list(weights.shape)}"
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
