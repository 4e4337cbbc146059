"""The reference backend's indexer path (DeepSeek sparse attention): the shared builder
passes the step's tensors through; the impl writes the index keys and selects with the
torch oracles of :mod:`attnkit.kernels.dsa.reference`."""

from __future__ import annotations

from ...kernels.dsa.reference import indexer_logits, topk_select, write_index_cache
from .._indexer import IndexerBuilder, IndexerKernelImpl, IndexerMetadata

__all__ = ["IndexerMetadata", "ReferenceIndexerBuilder", "ReferenceIndexerImpl"]

ReferenceIndexerBuilder = IndexerBuilder
"""Builds ``IndexerMetadata`` (the builder every built-in indexer shares)."""


class ReferenceIndexerImpl(IndexerKernelImpl):
    """Writes index keys, scores every visible position, keeps the top ``index_topk``
    (the torch oracles)."""

    _write = staticmethod(write_index_cache)
    _logits = staticmethod(indexer_logits)
    _topk = staticmethod(topk_select)
