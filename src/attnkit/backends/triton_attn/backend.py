"""The ``triton_attn`` backend: paged attention with attnkit's Triton kernels.

Serves full, sliding-window, chunked-local, encoder-only and cross attention (GQA/MQA,
soft-cap, ALiBi, per-head sinks, fp8_e4m3 caches with per-tensor scales) with
``kernels.attention.triton_kv_write.write_kv_cache`` and ``kernels.attention.triton``:
one launch for mixed prefill, chunked prefill and decode or, for decode batches with few
sequences and long contexts, split-KV (flash-decoding: the context is split across
programs and the partial results merged by log-sum-exp).

The builder plans the step once (``plan_paged_attention``: metadata validation, the
path and its number of splits, the query-tile grid) from the step's tensors as they are
(eager, with the exact tile count from the CPU offsets) or from copies in fixed-address
buffers (``build_for_cudagraph_capture``, with a grid that depends on the batch's shape
only); ``forward`` launches ``paged_attention`` with that plan for every layer without
converting anything, syncing the device or, once warmed up, allocating.

Importing this module does not import triton: the builder and impl import the kernel
modules when they are constructed. On CPU the kernels run only under the Triton
interpreter, which must be switched on (``TRITON_INTERPRET=1``) before triton is first
imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
from typing_extensions import override

from ...backend import AttentionBackend, BackendRequest, DraftTreeSupport
from ...binding import bind_each
from ...builder import AttentionCGSupport, AttentionMetadataBuilder
from ...capabilities import AttentionFeature, Determinism, SizeRange, SizeRule
from ...config import MAX_DRAFT_TREE_TOKENS, AttentionConfig
from ...impl import AttentionImpl
from ...kinds import rules_for
from ...metadata import CommonAttentionMetadata, host_to_device, mm_prefix_key_ends
from ...params import AttentionLayerParams, attention_params_problems
from ...spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheDType,
    KVCacheSpec,
    KVCacheSpecKind,
    SlidingWindowSpec,
)
from .._triton_env import triton_cpu_reasons
from .._triton_paged import (
    FP8_E4M3_MIN_CAPABILITY,
    GraphBuffers,
    fp8_e4m3_capability_reasons,
    num_sms,
)

if TYPE_CHECKING:  # the kernel modules import triton; annotations only
    from ...kernels.attention.triton_plan import PagedAttentionPlan, SplitKVWorkspace

__all__ = [
    "FP8_E4M3_MIN_CAPABILITY",
    "TritonAttentionBackend",
    "TritonAttentionImpl",
    "TritonAttentionMetadata",
    "TritonAttentionMetadataBuilder",
]

# What the launchers accept; kept here as literals because reading them from the
# kernel modules would import triton. The test suite checks they still agree.
_HEAD_SIZES: SizeRule = (SizeRange(16, 256),)
_BLOCK_SIZES: SizeRule = (16, 32, 64, 128)
# The encoder-only path writes a step's keys/values into a scratch paged cache of
# this block size (the kernels attend over paged caches only).
_SCRATCH_BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TritonAttentionMetadata:
    """One group's step, exactly as the Triton kernels take it.

    Attributes:
        query_start_loc: int32 ``[B+1]``.
        seq_lens: int32 ``[B]`` (encoder-only: the query lengths).
        block_table: int32 ``[B, MB]``.
        slot_mapping: int64 ``[T']``; -1 = padding (cross attention: the first ``E``
            entries are the encoder tokens written this step).
        max_query_len, max_seq_len: bounds that size the grid (Python ints).
        num_actual_tokens: ``T``; rows past it are padding.
        causal: False for encoder-only and cross attention.
        sliding_window, chunk_size: the group's mask, or ``None``.
        num_splits: 0 for the unified kernel; ``S >= 2`` for the split-KV decode path
            (the plan's choice, repeated here).
        plan: the step's ``PagedAttentionPlan`` (validated metadata, path, grid); every
            layer of the group launches with it.
        scratch_block_table, scratch_slot_mapping, scratch_num_blocks: encoder-only
            layers: where each token's key/value go in the per-step scratch cache.
        draft_ancestors, draft_counts: the step's draft trees
            (``CommonAttentionMetadata.draft_tree``; in CUDA-graph builds, views of the
            builder's fixed buffers), else ``None``.

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
    causal: bool = True
    sliding_window: int | None = None
    chunk_size: int | None = None
    num_splits: int = 0
    plan: PagedAttentionPlan
    scratch_block_table: torch.Tensor | None = None
    scratch_slot_mapping: torch.Tensor | None = None
    scratch_num_blocks: int = 0
    draft_ancestors: torch.Tensor | None = None
    draft_counts: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class _ScratchLayout:
    """Where an encoder-only step's keys/values go in the per-step scratch cache
    (the metadata's ``scratch_*`` fields; empty for every other kind)."""

    block_table: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    num_blocks: int = 0


@dataclasses.dataclass(frozen=True)
class _DeviceConstants:
    """A layer's constants on its device: fp8 scales (``None`` unless the cache is
    fp8), ALiBi slopes and sink logits (``None`` when the layer has none)."""

    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    alibi_slopes: torch.Tensor | None
    sinks: torch.Tensor | None


class TritonAttentionMetadataBuilder(
    AttentionMetadataBuilder[TritonAttentionMetadata, AttentionSpec]
):
    """Eager ``build`` passes the step's tensors through (reads only Python ints and the
    CPU offsets, no device sync, no per-request loop) and plans the step;
    ``build_for_cudagraph_capture`` copies them into fixed-address buffers first.

    Attributes:
        num_sms: streaming multiprocessors of the device (1 off CUDA); the split-KV
            heuristic fills them.
    """

    @classmethod
    @override
    def get_cudagraph_support(
        cls, config: AttentionConfig, kv_cache_spec: KVCacheSpec
    ) -> AttentionCGSupport:
        # Causal kinds: ALWAYS. Graph builds copy the step into fixed-address buffers
        # and pass grid bounds that depend only on the captured batch's shape
        # (max_query_len = its token count, the block table's full width), so any batch
        # of that shape replays; the kernels read every per-request value (offsets,
        # lengths, blocks, slots, fp8 scales) from tensors and skip empty tiles.
        # Encoder-only layers use a per-step scratch cache sized by the step, and cross
        # attention writes a varying number of encoder tokens: neither is captured.
        if rules_for(kv_cache_spec).mask(kv_cache_spec).causal:
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
        self.kind = spec.kind
        rules = rules_for(spec)
        mask = rules.mask(spec)
        self.causal = mask.causal
        self.sliding_window, self.chunk_size = mask.window, mask.chunk
        self.mm_prefix = mask.mm_prefix
        # No cache (encoder-only): the step's own keys/values, in a scratch cache.
        self.scratch = not rules.has_cache
        self.num_sms: int = num_sms(device)
        # Batch-invariant and above: the one-pass kernel for every step (no split-KV,
        # whose split count the heuristic takes from the batch) and query tiles of a
        # fixed size (not from the batch's longest query run), so a request's programs
        # and their key walk do not depend on the other requests of the step.
        self.invariant = config.determinism >= Determinism.BATCH_INVARIANT
        # Imported here (after selection): importing the backend must not import triton.
        # Assigned unannotated, so the attribute keeps the function's own signature.
        from ...kernels.attention.triton_plan import BLOCK_Q_MAX, plan_paged_attention

        self._plan_paged_attention = plan_paged_attention
        self._invariant_block_q = BLOCK_Q_MAX
        self._graph: GraphBuffers | None = None
        self._tree: tuple[torch.Tensor, torch.Tensor] | None = None

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TritonAttentionMetadata:
        cm = common_attn_metadata
        if cm.causal != self.causal:
            raise ValueError(
                f"{type(self).__name__}: a {self.kind.value} group needs causal={self.causal}, "
                f"got causal={cm.causal}"
            )
        scratch = (
            self._scratch_layout(cm)
            if self.scratch
            else _ScratchLayout()
        )
        # Encoder-only layers attend over the per-step scratch cache.
        scratch_table = scratch.block_table
        # Image ranges: each query's last visible key, planned once for every layer.
        key_ends = mm_prefix_key_ends(cm) if self.mm_prefix else None
        plan = self._plan_paged_attention(
            cm.query_start_loc,
            cm.seq_lens,
            scratch_table if scratch_table is not None else cm.block_table_tensor,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            block_size=(
                _SCRATCH_BLOCK_SIZE if scratch_table is not None else self.kv_cache_spec.block_size
            ),
            num_kv_heads=self.kv_cache_spec.num_kv_heads,
            causal=self.causal,
            sliding_window=self.sliding_window,
            chunk_size=self.chunk_size,
            num_tokens=cm.num_actual_tokens,
            # Split-KV for causal plain decode when the heuristic fills more SMs with it.
            num_splits=0 if self.invariant or key_ends is not None else None,
            block_q=self._invariant_block_q if self.invariant else None,
            num_sms=self.num_sms,
            query_start_loc_cpu=cm.query_start_loc_cpu,
            copy_to_device=host_to_device,
            # A decode context-parallel shard (full attention): local keys, global
            # query positions (CommonAttentionMetadata.context_shard).
            context_shard=cm.context_shard,
            global_seq_lens=(
                host_to_device(cm.global_seq_lens_cpu, self.device)
                if cm.global_seq_lens_cpu is not None and cm.context_shard is not None
                else None
            ),
            mm_prefix_key_ends=(
                host_to_device(torch.as_tensor(key_ends.astype(np.int32)), self.device)
                if key_ends is not None
                else None
            ),
        )
        return TritonAttentionMetadata(
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            num_actual_tokens=cm.num_actual_tokens,
            causal=self.causal,
            sliding_window=self.sliding_window,
            chunk_size=self.chunk_size,
            num_splits=plan.num_splits,
            plan=plan,
            scratch_block_table=scratch.block_table,
            scratch_slot_mapping=scratch.slot_mapping,
            scratch_num_blocks=scratch.num_blocks,
            draft_ancestors=None if cm.draft_tree is None else cm.draft_tree.ancestors,
            draft_counts=None if cm.draft_tree is None else cm.draft_tree.num_drafts,
        )

    def _scratch_layout(self, cm: CommonAttentionMetadata) -> _ScratchLayout:
        """Blocks of a per-step scratch cache for encoder-only layers, from the CPU offsets."""
        bs = _SCRATCH_BLOCK_SIZE
        qsl = cm.query_start_loc_cpu.to(torch.int64)
        lens = qsl[1:] - qsl[:-1]
        blocks_per_req = (lens + bs - 1) // bs
        first_block = torch.zeros_like(blocks_per_req)
        first_block[1:] = torch.cumsum(blocks_per_req, 0)[:-1]
        width = int(blocks_per_req.max()) if cm.num_reqs else 0
        table = first_block[:, None] + torch.arange(width)[None, :]
        token = torch.arange(cm.num_actual_tokens)
        req = torch.repeat_interleave(torch.arange(cm.num_reqs), lens)
        offset = token - qsl[req]
        slots = (first_block[req] + offset // bs) * bs + offset % bs
        device = cm.query_start_loc.device
        return _ScratchLayout(
            block_table=host_to_device(table.to(torch.int32), device),
            slot_mapping=host_to_device(slots, device),
            num_blocks=int(blocks_per_req.sum()),
        )

    @override
    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> TritonAttentionMetadata:
        """Copy the step into fixed-address buffers; call it for the capture and before
        every replay of a batch of the same shape (``num_reqs`` and token count).

        Raises:
            RuntimeError: for a kind that cannot be captured, or a step larger than the
                config's ``max_num_reqs`` / ``max_num_batched_tokens`` /
                ``max_model_len``.
        """
        cm = common_attn_metadata
        if not self.causal:
            raise RuntimeError(
                f"{type(self).__name__}: {self.kind.value} layers cannot be captured in a CUDA graph"
            )
        if cm.context_shard is not None:
            raise RuntimeError(
                f"{type(self).__name__}: a decode context-parallel shard cannot be captured in a "
                f"CUDA graph yet (its metadata is not copied into the graph buffers)"
            )
        if self.mm_prefix and mm_prefix_key_ends(cm) is not None:
            raise RuntimeError(
                f"{type(self).__name__}: a step with a query inside an image range "
                f"(mm_prefix_ranges) is not captured in a CUDA graph; run it eagerly"
            )
        step = self._graph_buffers().load(type(self).__name__, cm)
        tree = self._tree_buffers(cm)
        # The tile offsets are computed on the device into a fixed buffer, and the grid
        # is the plan's shape-only bound, so every batch of this shape replays.
        plan = self._plan_paged_attention(
            step.query_start_loc,
            step.seq_lens,
            step.block_table,
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            block_size=self.kv_cache_spec.block_size,
            num_kv_heads=self.kv_cache_spec.num_kv_heads,
            causal=True,
            sliding_window=self.sliding_window,
            chunk_size=self.chunk_size,
            num_tokens=step.num_tokens,
            num_splits=0,
            tile_offsets_out=step.tile_offsets,
            block_q=self._invariant_block_q if self.invariant else None,
        )
        return TritonAttentionMetadata(
            query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens,
            block_table=step.block_table,
            slot_mapping=step.slot_mapping,
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            num_actual_tokens=cm.num_actual_tokens,
            causal=True,
            sliding_window=self.sliding_window,
            chunk_size=self.chunk_size,
            num_splits=0,
            plan=plan,
            draft_ancestors=tree[0],
            draft_counts=tree[1],
        )

    def _tree_buffers(
        self, cm: CommonAttentionMetadata
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A capture build's draft tree in fixed buffers (``max_num_batched_tokens`` rows
        of ancestors, ``max_num_reqs`` counts; rows past the step are zero), or nothing
        without a tree."""
        tree = cm.draft_tree
        if tree is None:
            return None, None
        if self._tree is None:
            self._tree = (
                torch.zeros(self.config.max_num_batched_tokens, dtype=torch.int64, device=self.device),
                torch.zeros(self.config.max_num_reqs, dtype=torch.int32, device=self.device),
            )
        anc, counts = self._tree
        anc.zero_()
        counts.zero_()
        anc[: tree.ancestors.shape[0]].copy_(tree.ancestors, non_blocking=True)
        counts[: tree.num_drafts.shape[0]].copy_(tree.num_drafts, non_blocking=True)
        return anc, counts[: cm.num_reqs]

    def _graph_buffers(self) -> GraphBuffers:
        if self._graph is None:
            self._graph = GraphBuffers.allocate(
                self.config, self.kv_cache_spec.block_size, self.device
            )
        return self._graph


_FEATURES = frozenset(
    {
        AttentionFeature.LOGITS_SOFT_CAP,
        AttentionFeature.ALIBI,
        AttentionFeature.ATTENTION_SINKS,
        AttentionFeature.CONTEXT_PARALLEL,
        AttentionFeature.PER_HEAD_QUANT_SCALES,
        # Asked by a spec with mm_prefix (bidirectional image ranges), never by params.
        AttentionFeature.MM_PREFIX,
    }
)


class TritonAttentionImpl(
    AttentionImpl[TritonAttentionMetadata, AttentionSpec, AttentionLayerParams]
):
    """Writes the step's K/V with ``write_kv_cache``, then runs ``paged_attention`` with
    the step's plan (the one-pass kernel, or split-KV when the plan chose it).

    Raises at construction (so a bad layer fails before its first step):
        ValueError: ``layer_params`` asks for a feature the backend does not declare,
            or does not fit the spec.
    """

    def __init__(self, kv_cache_spec: AttentionSpec, layer_params: AttentionLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        who = type(self).__name__
        problems = attention_params_problems(
            kv_cache_spec, layer_params, backend="triton_attn", supported_features=_FEATURES
        )
        if problems:
            raise ValueError(f"{who}: " + "; ".join(problems))
        self.num_heads = layer_params.num_heads
        self.scale: float = (
            layer_params.scale if layer_params.scale is not None else kv_cache_spec.head_size**-0.5
        )
        self.fp8 = kv_cache_spec.kv_cache_dtype == "fp8_e4m3"
        # fp8_e4m3_per_token_head / int8_per_token_head: scales in kv_cache[1].
        self.dynamic_scales = kv_cache_spec.dynamic_kv_scales
        rules = rules_for(kv_cache_spec)
        self._has_cache = rules.has_cache
        self._encoder_keys = rules.writes == "encoder"  # cross attention
        # Device copies of the layer's constants, made on the first forward (the device
        # is not known before) and reused, so later steps and graph replays allocate
        # nothing.
        self._constants: _DeviceConstants | None = None
        self._workspace: SplitKVWorkspace | None = None
        self._scratch: torch.Tensor | None = None
        # Imported here, not at module level: importing the backend must not import
        # triton (and on CPU, triton must be imported after TRITON_INTERPRET is set).
        # Assigned unannotated, so each attribute keeps the launcher's own signature and
        # every call below is checked against it.
        from ...kernels.attention.triton import paged_attention
        from ...kernels.attention.triton_kv_write import write_kv_cache
        from ...kernels.attention.triton_plan import split_kv_workspace

        self._write_kv_cache = write_kv_cache
        self._paged_attention = paged_attention
        self._split_kv_workspace = split_kv_workspace

    def _device_constants(self, device: torch.device) -> _DeviceConstants:
        if self._constants is None:
            p = self.layer_params

            def scalar(value: float | tuple[float, ...]) -> torch.Tensor:
                # [1] per tensor, [Hkv] per K/V head: the kernels take either.
                values = value if isinstance(value, tuple) else (value,)
                return torch.tensor(values, dtype=torch.float32, device=device)

            # Per-head scales: both [Hkv] (a per-tensor partner repeated), as the
            # kernels read both the same way.
            k_scale, v_scale = (
                p.head_scales(self.kv_cache_spec.num_kv_heads)
                if p.per_head_quant_scales
                else (p.k_scale, p.v_scale)
            )
            self._constants = _DeviceConstants(
                k_scale=scalar(k_scale) if self.fp8 else None,
                v_scale=scalar(v_scale) if self.fp8 else None,
                alibi_slopes=(
                    torch.tensor(p.alibi_slopes, dtype=torch.float32, device=device)
                    if p.alibi_slopes is not None
                    else None
                ),
                sinks=(
                    p.sinks.to(device=device, dtype=torch.float32) if p.sinks is not None else None
                ),
            )
        return self._constants

    def _split_workspace(
        self, num_splits: int, num_tokens: int, head_size: int, device: torch.device
    ) -> SplitKVWorkspace:
        """Scratch of the split path, grown when a step needs more (reused otherwise)."""
        ws = self._workspace
        if ws is None or ws[0].shape[0] < num_splits or ws[0].shape[1] < num_tokens:
            splits = max(num_splits, ws[0].shape[0] if ws else 0)
            tokens = max(num_tokens, ws[0].shape[1] if ws else 0)
            ws = self._split_kv_workspace(splits, tokens, self.num_heads, head_size, device=device)
            self._workspace = ws
        return ws

    @override
    def forward_partial(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: TritonAttentionMetadata,
        output: torch.Tensor,
        lse: torch.Tensor,
    ) -> torch.Tensor:
        """``forward`` over a decode context-parallel shard, with the partial's lse (the
        plan carries the shard; a sink logit joins rank 0's softmax only)."""
        if attn_metadata.plan.context_shard is None:
            raise ValueError(
                f"{type(self).__name__}.forward_partial: the step's plan has no context_shard "
                f"(the group is not sharded by context); call forward"
            )
        return self._run(query, key, value, kv_cache, attn_metadata, output, lse)

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: TritonAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        shard = getattr(getattr(attn_metadata, "plan", None), "context_shard", None)
        if shard is not None:
            raise ValueError(
                f"{type(self).__name__}.forward: the group is sharded by context "
                f"(context_shard={shard}); its result is partial, call forward_partial"
            )
        return self._run(query, key, value, kv_cache, attn_metadata, output, None)

    def _run(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: TritonAttentionMetadata,
        output: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> torch.Tensor:
        m = attn_metadata
        n = m.num_actual_tokens
        consts = self._device_constants(query.device)
        k_scale, v_scale = consts.k_scale, consts.v_scale
        kv_scales: torch.Tensor | None = None  # per-token-head scales, in kv_cache[1]
        if not self._has_cache:
            if key is None or value is None:
                raise ValueError(f"{type(self).__name__}.forward needs key and value tensors")
            cache = self._scratch_cache(m, key)
            # The builder sets it for this kind (and plans over the scratch block table).
            assert m.scratch_slot_mapping is not None
            # The scratch cache holds the step's own keys/values in the model dtype: an
            # encoder-only layer keeps no cache, so an fp8 kv_cache_dtype quantises nothing.
            k_scale = v_scale = None
            self._write_kv_cache(
                key[:n], value[:n], cache, m.scratch_slot_mapping, k_scale=None, v_scale=None
            )
        else:
            want = 2 if self.dynamic_scales else 1
            if len(kv_cache) != want:
                what = "one cache tensor" if want == 1 else "two cache tensors (values, scales)"
                raise ValueError(
                    f"{type(self).__name__}.forward expects {what} per layer, "
                    f"got {len(kv_cache)}"
                )
            cache = kv_cache[0]
            kv_scales = kv_cache[1] if self.dynamic_scales else None
            if self._encoder_keys:
                if key is not None and value is not None:  # encoder states, first steps only
                    e = key.shape[0]
                    self._write_kv_cache(
                        key,
                        value,
                        cache,
                        m.slot_mapping[:e],
                        k_scale=k_scale,
                        v_scale=v_scale,
                        kv_scales=kv_scales,
                    )
            else:
                if key is None or value is None:
                    raise ValueError(f"{type(self).__name__}.forward needs key and value tensors")
                self._write_kv_cache(
                    key[:n],
                    value[:n],
                    cache,
                    m.slot_mapping[:n],
                    k_scale=k_scale,
                    v_scale=v_scale,
                    kv_scales=kv_scales,
                )
        plan = m.plan
        workspace = (
            self._split_workspace(
                plan.num_splits, query.shape[0], self.kv_cache_spec.head_size, query.device
            )
            if plan.num_splits
            else None
        )
        shard = plan.context_shard
        self._paged_attention(
            query,
            cache,
            plan,
            scale=self.scale,
            logits_soft_cap=self.layer_params.logits_soft_cap,
            alibi_slopes=consts.alibi_slopes,
            # A sink logit joins exactly one softmax denominator: rank 0's on a shard.
            sinks=consts.sinks if shard is None or shard[0] == 0 else None,
            k_scale=k_scale,
            v_scale=v_scale,
            output=output,
            lse=lse,
            workspace=workspace,
            draft_ancestors=m.draft_ancestors,
            draft_counts=m.draft_counts,
            kv_scales=kv_scales,
        )
        return output

    def _scratch_cache(self, m: TritonAttentionMetadata, key: torch.Tensor) -> torch.Tensor:
        """A paged cache for one encoder-only step (grown when needed, reused otherwise)."""
        shape = (
            m.scratch_num_blocks,
            2,
            _SCRATCH_BLOCK_SIZE,
            self.kv_cache_spec.num_kv_heads,
            self.kv_cache_spec.head_size,
        )
        dtype = self.kv_cache_spec.dtype
        if (
            self._scratch is None
            or self._scratch.shape[0] < shape[0]
            or self._scratch.dtype != dtype
        ):
            self._scratch = torch.zeros(shape, dtype=dtype, device=key.device)
        return self._scratch


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton: every causal and bidirectional kind but sinks tokens and MLA."""

    name = "triton_attn"
    description = (
        "Triton paged attention: full, sliding-window, chunked-local, encoder-only and cross; "
        "GQA/MQA, soft-cap, ALiBi, sinks, fp8 KV (per-tensor or per-head scales), "
        "per-token-head fp8/int8 KV; split-KV decode"
    )
    supported_devices = frozenset({"cpu", "cuda"})
    supported_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset(
        {"auto", "fp8_e4m3", "fp8_e4m3_per_token_head", "int8_per_token_head"}
    )
    supported_head_sizes = _HEAD_SIZES
    supported_block_sizes = _BLOCK_SIZES
    supported_features = _FEATURES
    required_packages: ClassVar[Mapping[str, str]] = {"triton": "triton>=3.0"}
    # No atomics: the same launch gives the same bits. At batch_invariant the builder
    # takes the one-pass kernel with fixed query tiles for every step (split-KV off), so
    # a request's programs do not depend on its step's other requests; checked bit for
    # bit under the interpreter (tests/test_invariance.py). Not prefill = decode: a
    # token's row is computed in query tiles that start where its chunk starts.
    deterministic = True
    determinism: ClassVar[Mapping[KVCacheSpecKind, Determinism]] = {
        KVCacheSpecKind.FULL_ATTENTION: Determinism.BATCH_INVARIANT,
        KVCacheSpecKind.SLIDING_WINDOW: Determinism.BATCH_INVARIANT,
        KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION: Determinism.BATCH_INVARIANT,
    }
    draft_trees: ClassVar[DraftTreeSupport | None] = DraftTreeSupport(
        kinds=frozenset({KVCacheSpecKind.FULL_ATTENTION}),
        max_width=MAX_DRAFT_TREE_TOKENS,
        max_depth=MAX_DRAFT_TREE_TOKENS,
        how="an int64 ancestor bitmask per query row, applied in the key tile of the "
        "one-pass and split-KV kernels",
    )
    builders = bind_each(
        (
            FullAttentionSpec,
            SlidingWindowSpec,
            ChunkedLocalAttentionSpec,
            EncoderOnlyAttentionSpec,
            CrossAttentionSpec,
        ),
        TritonAttentionMetadataBuilder,
        TritonAttentionImpl,
    )

    @classmethod
    @override
    def extra_environment_reasons(cls, device: torch.device) -> list[str]:
        """On CPU, the Triton interpreter must be on (read from the environment now)."""
        return triton_cpu_reasons(device)

    @classmethod
    @override
    def extra_not_supported_reasons(cls, request: BackendRequest) -> list[str]:
        """fp8_e4m3 caches need compute capability >= 8.9 on CUDA (see
        ``fp8_e4m3_capability_reasons``)."""
        return fp8_e4m3_capability_reasons(request)
