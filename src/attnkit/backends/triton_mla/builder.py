"""``triton_mla``'s metadata and its builder: one plan of the step over the latent cache,
and, for layers with ``mla_projection``, the decodes' plan and the prefill part laid out
for the up-projected form (``TritonMLAMetadata``, ``MLAPrefillMetadata``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch
from typing_extensions import override

from ...builder import AttentionCGSupport, AttentionMetadataBuilder
from ...config import AttentionConfig
from ...kinds import rules_for
from ...metadata import CommonAttentionMetadata, host_to_device
from ...spec import AttentionSpec, KVCacheSpec
from .._triton_paged import GraphBuffers, num_sms
from .costs import PrefillForm, TritonMLAOptions

if TYPE_CHECKING:  # the kernel modules import triton; annotations only
    from ...kernels.attention.triton_plan import PagedAttentionPlan

Ints = npt.NDArray[np.int64]
# torch.from_numpy, typed: torch leaves its parameter unannotated (pyright: Unknown).
_from_numpy: Callable[[npt.NDArray[Any]], torch.Tensor] = torch.from_numpy  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]


DECODE_THRESHOLD = 16
"""Requests with at most this many new tokens over cached context are decodes: they come
first in the batch and always run absorbed. At ``q`` queries per key the absorbed form
costs ``q * 1088`` multiply-adds per (key, head) at DeepSeek-V3's widths, the
up-projected one ``131072 + q * 512`` (docs/backends.md): at 16 (speculative
verification, a chunk's last few tokens) absorbed is 7x cheaper."""


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class MLAPrefillMetadata:
    """The prefill part of a step (requests ``[num_decodes, B)``, tokens
    ``[num_decode_tokens, T)``), laid out for the up-projected form.

    Attributes:
        block_ids: int64 ``[NBt]``: the latent-cache blocks the prefills read, request
            by request (blocks wholly before every query's window are left out); the
            impl gathers them into a temporary ``[NBt, BS, D]``.
        plan: paged-attention plan of the prefills over the temporary up-projected
            cache: block table rows index ``block_ids`` positions, query offsets
            rebased to 0. Planned with one KV head; the impl sets its head count.
        num_tokens: the prefills' query tokens.
        pairs, context_tokens: the cost terms of :func:`mla_prefill_costs`.
        form: ``TritonMLAOptions.prefill_form``.
    """

    block_ids: torch.Tensor
    plan: PagedAttentionPlan
    num_tokens: int
    pairs: int
    context_tokens: int
    form: PrefillForm = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TritonMLAMetadata:
    """One MLA group's step, exactly as the Triton kernels take it.

    Attributes:
        query_start_loc: int32 ``[B+1]``.
        seq_lens: int32 ``[B]``.
        block_table: int32 ``[B, MB]``.
        slot_mapping: int64 ``[T']``; -1 = padding.
        max_query_len, max_seq_len: bounds that size the grid (Python ints).
        num_actual_tokens: ``T``; rows past it are padding.
        sliding_window: the group's window, or ``None``.
        num_splits: 0 for the one-pass kernel, ``S >= 2`` for split-KV decode (the
            plan's choice, repeated here).
        plan: the step's ``PagedAttentionPlan`` (validated metadata, path, grid); every
            layer of the group launches with it.
        num_decodes, num_decode_tokens: the leading decode requests (at most
            ``DECODE_THRESHOLD`` new tokens over cached context) and their tokens.
        decode_plan: a plan of the decodes alone, when the step has decodes and
            prefills (for projected layers whose prefills run up-projected).
        prefill: the prefill part laid out for the up-projected form, or ``None``
            (no prefill request).

    In eager builds the tensors are ``CommonAttentionMetadata``'s own (no copies); in
    CUDA-graph builds they are views of the builder's fixed-address buffers, valid
    until its next build.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    sliding_window: int | None = None
    num_splits: int = 0
    plan: PagedAttentionPlan
    num_decodes: int = 0
    num_decode_tokens: int = 0
    decode_plan: PagedAttentionPlan | None = None
    prefill: MLAPrefillMetadata | None = None


def _window_pairs(end: Ints, window: int | None) -> Ints:
    """``sum(min(k, window) for k in 1..end)`` per entry: keys seen by the queries at
    positions ``0..end-1``."""
    if window is None:
        pairs: Ints = end * (end + 1) // 2
        return pairs
    inside = np.minimum(end, window)
    pairs = inside * (inside + 1) // 2 + np.maximum(end - window, 0) * window
    return pairs


class TritonMLAMetadataBuilder(AttentionMetadataBuilder[TritonMLAMetadata, AttentionSpec]):
    """Plans an MLA group's step: ``plan_paged_attention`` with one KV head and the
    group's window.

    Eager ``build`` passes the step's tensors through (reads only Python ints and the
    CPU offsets: no device sync, no per-request loop); ``build_for_cudagraph_capture``
    copies them into fixed-address buffers first.

    Batches come decodes first (``reorder_batch_threshold = DECODE_THRESHOLD``): the
    one-pass kernel itself takes any order, but layers with ``mla_projection`` run the
    decodes and the prefills in different forms, so a step with prefills also gets a
    plan of the decodes alone and the prefill part's layout (``MLAPrefillMetadata``).
    The split is counted, not trusted: decodes are the leading requests with at most
    ``DECODE_THRESHOLD`` new tokens and cached context, so a batch in any order stays
    correct (a late decode is handled as a prefill).

    Attributes:
        num_sms: streaming multiprocessors of the device (1 off CUDA); the split-KV
            heuristic fills them.
    """

    reorder_batch_threshold: ClassVar[int | None] = DECODE_THRESHOLD

    @classmethod
    @override
    def get_cudagraph_support(
        cls, config: AttentionConfig, kv_cache_spec: KVCacheSpec
    ) -> AttentionCGSupport:
        # ALWAYS: graph builds copy the step into fixed-address buffers and plan with
        # grid bounds that depend only on the captured batch's shape (max_query_len = its
        # token count, the block table's full width, tile offsets computed on the
        # device), so any batch of that shape replays; the kernels read every
        # per-request value (offsets, lengths, blocks, slots, the fp8 scale) from
        # tensors and skip empty tiles.
        if rules_for(kv_cache_spec).latent:
            return AttentionCGSupport.ALWAYS
        return AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        spec = kv_cache_spec
        self.sliding_window = rules_for(spec).mask(spec).window
        self.num_sms: int = num_sms(device)
        self.prefill_form: PrefillForm = config.options_for(
            "triton_mla", TritonMLAOptions
        ).prefill_form
        # Imported here (after selection): importing the backend must not import triton.
        # Assigned unannotated, so the attribute keeps the function's own signature.
        from ...kernels.attention.triton_plan import plan_paged_attention

        self._plan_paged_attention = plan_paged_attention
        self._graph: GraphBuffers | None = None

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TritonMLAMetadata:
        cm = common_attn_metadata
        if not cm.causal:
            raise ValueError(
                f"{type(self).__name__}: a {self.kv_cache_spec.kind.value} group needs "
                f"causal=True, got causal={cm.causal}"
            )
        plan = self._plan_requests(cm, cm.num_reqs, cm.max_query_len, cm.max_seq_len)
        query_lens = cm.query_lens_cpu.numpy()
        seq_lens = cm.seq_lens_cpu.numpy()
        is_decode = (query_lens <= DECODE_THRESHOLD) & (seq_lens > query_lens)
        # The leading run of decodes (the runtime orders them first).
        num_decodes = int(np.argmin(is_decode)) if not is_decode.all() else cm.num_reqs
        if num_decodes == cm.num_reqs:
            return TritonMLAMetadata(
                query_start_loc=cm.query_start_loc,
                seq_lens=cm.seq_lens,
                block_table=cm.block_table_tensor,
                slot_mapping=cm.slot_mapping,
                max_query_len=cm.max_query_len,
                max_seq_len=cm.max_seq_len,
                num_actual_tokens=cm.num_actual_tokens,
                sliding_window=self.sliding_window,
                num_splits=plan.num_splits,
                plan=plan,
                num_decodes=num_decodes,
                num_decode_tokens=cm.num_actual_tokens,
            )
        num_decode_tokens = int(cm.query_start_loc_cpu[num_decodes])
        decode_plan = None
        if num_decodes:
            nd = num_decodes
            decode_plan = self._plan_requests(
                cm, nd, int(query_lens[:nd].max()), int(seq_lens[:nd].max())
            )
        return TritonMLAMetadata(
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            num_actual_tokens=cm.num_actual_tokens,
            sliding_window=self.sliding_window,
            num_splits=plan.num_splits,
            plan=plan,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            decode_plan=decode_plan,
            prefill=self._prefill(cm, num_decodes, num_decode_tokens, query_lens, seq_lens),
        )

    def _plan_requests(
        self, cm: CommonAttentionMetadata, count: int, max_query_len: int, max_seq_len: int
    ) -> PagedAttentionPlan:
        """The plan of the step's first ``count`` requests over the latent cache (split-KV
        for plain decode when the heuristic fills more SMs with it)."""
        return self._plan_paged_attention(
            cm.query_start_loc[: count + 1],
            cm.seq_lens[:count],
            cm.block_table_tensor[:count],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_size=self.kv_cache_spec.block_size,
            num_kv_heads=1,
            causal=True,
            sliding_window=self.sliding_window,
            num_tokens=int(cm.query_start_loc_cpu[count]),
            num_splits=None,
            num_sms=self.num_sms,
            query_start_loc_cpu=cm.query_start_loc_cpu[: count + 1],
            copy_to_device=host_to_device,
        )

    def _prefill(
        self,
        cm: CommonAttentionMetadata,
        num_decodes: int,
        num_decode_tokens: int,
        query_lens: Ints,
        seq_lens: Ints,
    ) -> MLAPrefillMetadata:
        """Lay out requests ``[num_decodes, B)`` for the up-projected form: which latent
        blocks to gather (host arithmetic, one gather index copy), a block table over the
        gathered blocks and the plan over it."""
        nd, bs, window = num_decodes, self.kv_cache_spec.block_size, self.sliding_window
        q = query_lens[nd:].astype(np.int64)
        s = seq_lens[nd:].astype(np.int64)
        ctx = s - q
        num_blocks = -(-s // bs)
        # Blocks wholly before the first query's window hold no key any query sees.
        first = np.maximum(ctx - window + 1, 0) // bs if window is not None else np.zeros_like(s)
        counts = num_blocks - first
        starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        total = int(counts.sum())
        rows = np.repeat(np.arange(nd, cm.num_reqs, dtype=np.int64), counts)
        cols = np.arange(total, dtype=np.int64) - np.repeat(starts - first, counts)
        width = int(num_blocks.max())
        # Row i, column j -> gathered block starts[i] + (j - first[i]), clamped into the
        # request's own range (columns before `first` are never read by the kernel).
        j = np.arange(width, dtype=np.int64)[None, :]
        table = starts[:, None] + np.minimum(
            np.maximum(j - first[:, None], 0), (counts - 1)[:, None]
        )
        index = _from_numpy(np.stack([rows, cols]))
        index = host_to_device(index, self.device)
        block_ids = cm.block_table_tensor[index[0], index[1]].to(torch.int64)
        qsl_cpu = (cm.query_start_loc_cpu[nd:] - num_decode_tokens).to(torch.int32)
        plan = self._plan_paged_attention(
            host_to_device(qsl_cpu.clone(), self.device),
            cm.seq_lens[nd:],
            host_to_device(_from_numpy(table.astype(np.int32)), self.device),
            max_query_len=int(q.max()),
            max_seq_len=int(s.max()),
            block_size=bs,
            num_kv_heads=1,
            causal=True,
            sliding_window=window,
            num_tokens=int(q.sum()),
            num_splits=0,
            query_start_loc_cpu=qsl_cpu,
            copy_to_device=host_to_device,
        )
        pairs = int((_window_pairs(s, window) - _window_pairs(ctx, window)).sum())
        return MLAPrefillMetadata(
            block_ids=block_ids,
            plan=plan,
            num_tokens=int(q.sum()),
            pairs=pairs,
            context_tokens=total * bs,
            form=self.prefill_form,
        )

    @override
    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> TritonMLAMetadata:
        """Copy the step into fixed-address buffers; call it for the capture and before
        every replay of a batch of the same shape (``num_reqs`` and token count).

        Raises:
            ValueError: a non-causal batch.
            RuntimeError: a step larger than the config's ``max_num_reqs`` /
                ``max_num_batched_tokens`` / ``max_model_len``.
        """
        cm = common_attn_metadata
        if not cm.causal:
            raise ValueError(
                f"{type(self).__name__}: a {self.kv_cache_spec.kind.value} group needs "
                f"causal=True, got causal={cm.causal}"
            )
        step = self._graph_buffers().load(type(self).__name__, cm)
        # Tile offsets computed on the device into a fixed buffer; the grid is the
        # plan's shape-only bound, so every batch of this shape replays.
        plan = self._plan_paged_attention(
            step.query_start_loc,
            step.seq_lens,
            step.block_table,
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            block_size=self.kv_cache_spec.block_size,
            num_kv_heads=1,
            causal=True,
            sliding_window=self.sliding_window,
            num_tokens=step.num_tokens,
            num_splits=0,
            tile_offsets_out=step.tile_offsets,
        )
        return TritonMLAMetadata(
            query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens,
            block_table=step.block_table,
            slot_mapping=step.slot_mapping,
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            num_actual_tokens=cm.num_actual_tokens,
            sliding_window=self.sliding_window,
            num_splits=0,
            plan=plan,
            num_decodes=cm.num_reqs,
            num_decode_tokens=cm.num_actual_tokens,
        )

    def _graph_buffers(self) -> GraphBuffers:
        if self._graph is None:
            self._graph = GraphBuffers.allocate(
                self.config, self.kv_cache_spec.block_size, self.device
            )
        return self._graph
