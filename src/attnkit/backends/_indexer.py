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

__all__ = ["LOGITS_BUDGET_BYTES", "IndexerBuilder", "IndexerKernelImpl", "IndexerMetadata"]

LOGITS_BUDGET_BYTES = 256 << 20
"""The most bytes of float32 indexer logits one kernel call makes: a step whose
``tokens x longest context`` logits would exceed it (a long prefill over a long
context: 8k tokens over 128k are 4 GiB) is scored and selected in chunks of query
tokens that fit (at least one token each). ``IndexerKernelImpl.logits_budget_bytes``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexerMetadata:
    """One indexer group's step (``CommonAttentionMetadata``'s tensors, no copies).

    Attributes:
        max_seq_len: the longest context of the step (from the host lengths).
        window: the paired MLA layers' window, else ``None``.
        query_start_loc_cpu, seq_lens_cpu: the host copies (for chunking).
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_seq_len: int
    window: int | None = None
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None


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
            query_start_loc_cpu=cm.query_start_loc_cpu,
            seq_lens_cpu=cm.seq_lens_cpu,
        )


class IndexerKernelImpl(IndexerImpl[IndexerMetadata, AttentionLayerParams]):
    """Writes index keys, scores every visible position, keeps the top ``index_topk``,
    with the kernels a subclass sets in ``_write``, ``_logits`` and ``_topk``."""

    _write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    _logits: Callable[..., torch.Tensor]
    _topk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    logits_budget_bytes: int = LOGITS_BUDGET_BYTES
    """The most bytes of logits one kernel call makes (``LOGITS_BUDGET_BYTES``)."""

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
        # One block table for both groups (shared block ids): the slots the top-k makes
        # from it are the MLA cache's global slot ids, as they are.
        out = selection.rows(n)
        for chunk in _chunks(md, n, self.logits_budget_bytes):
            a, b = chunk.start, chunk.end
            logits = self._logits(
                query[a:b],
                weights[a:b],
                kv_cache[0],
                query_start_loc=chunk.query_start_loc,
                seq_lens=chunk.seq_lens,
                block_table=md.block_table[chunk.requests],
                max_seq_len=chunk.max_seq_len,
                window=md.window,
            )
            indices, lens = self._topk(
                logits,
                query_start_loc=chunk.query_start_loc,
                seq_lens=chunk.seq_lens,
                block_table=md.block_table[chunk.requests],
                block_size=spec.block_size,
                topk=spec.index_topk,
                window=md.window,
            )
            out.indices[a:b].copy_(indices)
            out.lens[a:b].copy_(lens)
        return out


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """Query tokens ``[start, end)`` of a step as a step of their own: the requests they
    belong to (indices into the step's), and those requests' query starts and lengths
    cut to the chunk (a request's length ends at the chunk's last token of it)."""

    start: int
    end: int
    requests: slice | torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int


def _chunks(md: IndexerMetadata, n: int, budget: int) -> list[_Chunk]:
    """The step's ``n`` query tokens in chunks whose logits fit ``budget`` bytes: one
    chunk (the step's own tensors) when they all fit."""
    whole = _Chunk(0, n, slice(None), md.query_start_loc, md.seq_lens, md.max_seq_len)
    rows = max(1, budget // (4 * md.max_seq_len))
    if n <= rows or md.query_start_loc_cpu is None or md.seq_lens_cpu is None:
        return [whole]
    starts = [int(x) for x in md.query_start_loc_cpu]
    lens = [int(x) for x in md.seq_lens_cpu]
    device = md.query_start_loc.device
    chunks: list[_Chunk] = []
    for a in range(0, n, rows):
        b = min(a + rows, n)
        requests: list[int] = []
        cut_starts = [0]
        cut_lens: list[int] = []
        for r, length in enumerate(lens):
            qs, qe = starts[r], starts[r + 1]
            lo, hi = max(qs, a), min(qe, b)
            if lo >= hi:
                continue
            requests.append(r)
            cut_starts.append(cut_starts[-1] + hi - lo)
            cut_lens.append(length - (qe - hi))  # its context up to the chunk's last token
        chunks.append(
            _Chunk(
                a,
                b,
                torch.tensor(requests, dtype=torch.int64, device=device),
                torch.tensor(cut_starts, dtype=md.query_start_loc.dtype, device=device),
                torch.tensor(cut_lens, dtype=md.seq_lens.dtype, device=device),
                max(1, max(cut_lens)),
            )
        )
    return chunks
