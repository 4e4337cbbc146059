"""The conformance kit on DeepSeek sparse attention: a backend that declares the
``indexer`` kind has its selections checked against reference's (an indexer and its
sparse MLA layer, NaN-filled caches, a chunked prefill, decodes, a request shorter
than ``index_topk``); broken variants (a top-k one short, a causal horizon one too far)
are caught."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from typing_extensions import override

from attnkit import IndexerSpec
from attnkit.backend_api import (
    AttentionBackend,
    CommonAttentionMetadata,
    SparseSelection,
    bind_builder,
)
from attnkit.backends.reference.backend import ReferenceBackend
from attnkit.backends.reference.indexer import (
    IndexerMetadata,
    ReferenceIndexerBuilder,
    ReferenceIndexerImpl,
)
from attnkit.testing import ConformanceReport, check_backend


class _Toy(AttentionBackend):
    supported_devices = frozenset({"cpu"})
    supported_block_sizes = None
    supported_head_sizes = None
    supported_kv_cache_dtypes = frozenset({"auto", "fp8_e4m3"})
    supported_dtypes = frozenset({torch.float32, torch.bfloat16})


class ToyIndexer(_Toy):
    """The reference indexer under another name: passes."""

    name = "toy_indexer"
    builders = (bind_builder(IndexerSpec, ReferenceIndexerBuilder, ReferenceIndexerImpl),)


class _OneShort(ReferenceIndexerImpl):
    """Keeps topk - 1 positions: drops the last of each full row."""

    @override
    def select(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: IndexerMetadata,
        selection: SparseSelection,
    ) -> SparseSelection:
        out = super().select(query, key, weights, kv_cache, attn_metadata, selection)
        full = out.lens == out.topk
        last = out.indices[:, -1]
        last.copy_(torch.where(full, torch.full_like(last, -1), last))
        out.lens.copy_(torch.where(full, out.lens - 1, out.lens))
        return out


class TopkOneShort(_Toy):
    name = "toy_topk_one_short"
    builders = (bind_builder(IndexerSpec, ReferenceIndexerBuilder, _OneShort),)


class _SeesItsSuccessorBuilder(ReferenceIndexerBuilder):
    """Every query one position later than it is: it sees the next slot too."""

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> IndexerMetadata:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        return IndexerMetadata(
            num_actual_tokens=md.num_actual_tokens,
            query_start_loc=md.query_start_loc,
            seq_lens=md.seq_lens + 1,
            block_table=md.block_table,
            slot_mapping=md.slot_mapping,
            max_seq_len=md.max_seq_len + 1,
            window=md.window,
        )


class SeesItsSuccessor(_Toy):
    name = "toy_sees_successor"
    builders = (bind_builder(IndexerSpec, _SeesItsSuccessorBuilder, ReferenceIndexerImpl),)


def _failed(report: ConformanceReport) -> dict[str, str]:
    return {r.capability: r.detail for r in report.failures()}


def _sparse(report: ConformanceReport) -> list[str]:
    return [r.capability for r in report.results if r.capability.startswith("sparse_attention")]


def test_the_reference_and_a_correct_indexer_pass_the_sparse_cases() -> None:
    for backend in (ReferenceBackend, ToyIndexer):
        report = check_backend(backend, kinds=["indexer"])
        report.assert_ok()
        cases = _sparse(report)
        assert len(cases) >= 2, report.describe()
        assert all(report.result(c).status == "passed" for c in cases), report.describe()


def test_a_topk_one_short_is_caught() -> None:
    failures = _failed(check_backend(TopkOneShort, kinds=["indexer"]))
    assert failures, "the kit passed a top-k that keeps one position too few"
    assert all("selection" in detail for detail in failures.values()), failures


def test_a_causal_horizon_one_too_far_is_caught() -> None:
    failures = _failed(check_backend(SeesItsSuccessor, kinds=["indexer"]))
    assert failures, "the kit passed an indexer that sees the next position"
    assert all("selection" in detail for detail in failures.values()), failures


def test_triton_mla_passes_the_sparse_cases_under_the_interpreter() -> None:
    """triton_mla's Triton indexer and sparse MLA (kernels.dsa.triton) against reference."""
    pytest.importorskip("triton")
    from attnkit.backends.triton_mla import TritonMLABackend

    report = check_backend(TritonMLABackend, kinds=["indexer"])
    report.assert_ok()
    cases = _sparse(report)
    assert len(cases) == 6, report.describe()
    assert all(report.result(c).status == "passed" for c in cases), report.describe()
