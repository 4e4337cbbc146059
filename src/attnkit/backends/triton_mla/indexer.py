"""``triton_mla``'s indexer (DeepSeek sparse attention): the builder passes the step's
tensors through; the impl writes the index keys, scores and selects with the Triton
kernels of :mod:`attnkit.kernels.dsa.triton`. Kernel launches only, no device reads."""

from __future__ import annotations

from ...params import AttentionLayerParams
from ...spec import IndexerSpec
from .._indexer import IndexerBuilder, IndexerKernelImpl, IndexerMetadata

__all__ = ["TritonIndexerBuilder", "TritonIndexerImpl", "TritonIndexerMetadata"]

TritonIndexerMetadata = IndexerMetadata
TritonIndexerBuilder = IndexerBuilder
"""Builds ``IndexerMetadata`` (the builder every built-in indexer shares)."""


class TritonIndexerImpl(IndexerKernelImpl):
    """``write_index_cache``, ``indexer_logits`` and ``topk_select`` (Triton)."""

    def __init__(self, kv_cache_spec: IndexerSpec, layer_params: AttentionLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        # Imported here: importing the backend must not import triton.
        from ...kernels.dsa.triton import indexer_logits, topk_select, write_index_cache

        self._write = write_index_cache
        self._logits = indexer_logits
        self._topk = topk_select
