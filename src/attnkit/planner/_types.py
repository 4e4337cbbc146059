"""The plan types ``plan_model`` returns: ``ModelPlan`` (its layers, groups and pool),
``RankPlan`` (one rank's share under tensor and context parallelism) and their rows,
with the JSON keys ``attnkit plan --json`` writes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from typing_extensions import override

from ..builder import AttentionCGSupport
from ..capabilities import KVCacheLayout
from ..errors import Rejection
from ..kv_cache import BufferSetName, KVCacheGroup, buffer_set_of
from ..selector import Selection
from ..spec import KVCacheSpec, MambaSpec
from ._capacity import _HoldsBlocks, _PoolCapacity


@dataclasses.dataclass(frozen=True)
class PrefixPlan:
    """What prefix caching can serve on a model under the config's prefix-caching
    section (docs/prefix-caching.md).

    Attributes:
        enabled: whether the config turns prefix caching on.
        state_checkpoints: the state checkpoint policy.
        state_groups: groups of state layers (a hit needs a checkpoint in each).
        checkpoint_interval: the checkpoints' spacing under the policy (``None``: no
            state groups, or ``"none"``).
        minimum: the model's minimum cacheable prefix under the policy, in tokens
            (``None``: no prefix can hit, ``why_none`` says why).
        why_none: why no prefix can hit, else ``None``.
        minimum_with_checkpoints: on a model with state groups, the minimum with
            ``"step_end"`` checkpoints at the default interval (what turning them on
            would give).
        checkpoint_bytes: what one checkpoint boundary takes from the pool: a block
            per state group (0 without state groups).
    """

    enabled: bool
    state_checkpoints: str
    state_groups: int
    checkpoint_interval: int | None
    minimum: int | None
    why_none: str | None
    minimum_with_checkpoints: int | None
    checkpoint_bytes: int

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One layer of a plan (a row of the layer table).

    Attributes:
        name: the layer, as the model names it.
        kind: its spec's kind (``KVCacheSpecKind`` value).
        spec_class: its spec's class name.
        mamba_type: a state layer's type (``mamba2``, ``gdn``, ...), else ``None``.
        sliding_window, attention_chunk_size: a windowed / chunked-local layer's
            window or chunk (tokens), else ``None``.
        group: the KV-cache group it belongs to.
    """

    name: str
    kind: str
    spec_class: str
    mamba_type: str | None
    sliding_window: int | None
    attention_chunk_size: int | None
    group: int


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """One KV-cache group: its unified spec, its backend (or why none), its costs.

    Attributes:
        group: the runtime's group.
        selection: the chosen backend, or ``None`` when none can serve.
        rejected: every candidate skipped, with its reasons.
        error: why no backend serves (the ``NoBackendError`` message), else ``None``.
        layout: the cache layout of the chosen backend (``"interleaved"`` without one).
        blocks_per_request: the most pages (the pool's blocks) one request of
            ``max_model_len`` tokens holds in this group, alone in its pages:
            ``ceil(kernel_blocks_per_request / blocks_per_page)`` (0 for a group without
            cache).
        kernel_blocks_per_request: the most kernel blocks (of the group's block size)
            such a request holds in the group.
        bytes_per_token: cache bytes a token adds to this group's layers (0 for state
            and encoder-only groups; cross-attention counts encoder tokens).
        per_request_cap_bytes: for windowed and chunked-local groups, the most bytes a
            request's tokens keep in the group's layers: ``kernel_blocks_per_request``
            kernel blocks per layer; ``None`` for groups that grow with the request.
        cudagraph_support: the builder's CUDA-graph support, ``None`` without a backend.
    """

    group: KVCacheGroup
    selection: Selection | None
    rejected: tuple[Rejection, ...]
    error: str | None
    layout: KVCacheLayout
    blocks_per_request: int
    kernel_blocks_per_request: int
    bytes_per_token: int
    per_request_cap_bytes: int | None
    cudagraph_support: AttentionCGSupport | None

    @property
    def backend_name(self) -> str | None:
        return self.selection.backend_name if self.selection is not None else None

    @property
    def buffer_set(self) -> BufferSetName | None:
        """The layer buffers the group's cache views; ``None`` for a group without cache."""
        return buffer_set_of(self.layout) if self.group.has_cache else None

    def describe(self) -> str:
        """``group 1 (full_attention, backend reference)``: how the plan names it."""
        return (
            f"group {self.group.group_id} ({self.group.kind.value}, "
            f"backend {self.backend_name or 'none'})"
        )


ContextPlacement = Literal["sharded", "replicated", "none"]
"""Where context parallelism puts a group's cache: its tokens spread over the ranks
(``sharded``), all of it on every rank (``replicated``), or no cache (``none``)."""


@dataclasses.dataclass(frozen=True)
class GroupSplit:
    """How tensor and context parallelism lay one group of the model over the ranks.

    Attributes:
        group_id: the model's group (an index of ``ModelPlan.groups``).
        spec: what each rank's layers of the group declare: K/V heads or state shapes
            divided by tensor parallelism, the declared block size (each rank unifies
            its own page, so its kernel blocks per page, see ``RankPlan.groups``).
        query_heads: query heads per rank of the group's first attention layer
            (``None`` for state groups, or when no layer's params give a head count).
        kv_heads: K/V heads per rank (1 for an MLA latent); ``None`` for state groups.
        kv_replicas: tensor-parallel ranks that hold each K/V head: 1 when the heads
            are split, ``tensor_parallel // kv_heads`` when there are fewer K/V heads
            than ranks, ``tensor_parallel`` for an MLA latent (shared by every head);
            ``None`` for state groups.
        context: ``"sharded"`` (token ``t`` lives on context-parallel rank ``t mod
            N``), ``"replicated"`` (every context-parallel rank holds it all) or
            ``"none"`` (the group keeps no cache).
        detail: the split in words, for the report.
    """

    group_id: int
    spec: KVCacheSpec
    query_heads: int | None
    kv_heads: int | None
    kv_replicas: int | None
    context: ContextPlacement
    detail: str


@dataclasses.dataclass(frozen=True)
class RankGroupPlan:
    """A KV-cache group of one rank: what the runtime of each rank would build.

    Each rank groups and unifies its own specs (``GroupSplit.spec``) with the runtime's
    rule, so its page, kernel blocks per page and even its groups may differ from the
    model's: two
    groups whose specs become equal once split (2 and 4 K/V heads at
    ``tensor_parallel=4``) are one group on a rank.

    Attributes:
        group: the rank's group (its kernel blocks per page from the rank's page).
        model_groups: the model's groups whose layers it holds.
        layout: the cache layout of the backend chosen for the model group.
        context_sharded: context parallelism shards its tokens.
        blocks_per_request: the most pages a request of ``max_model_len`` tokens holds
            in this group on the busiest rank (rank 0 for a sharded group:
            ``ceil(max_model_len / context_parallel)`` tokens), alone in its pages.
        kernel_blocks_per_request: the same in kernel blocks.
        bytes_per_token: cache bytes a token adds to this group's layers on a rank
            that holds it.
        per_request_cap_bytes: as ``GroupPlan.per_request_cap_bytes``, per rank.
    """

    group: KVCacheGroup
    model_groups: tuple[int, ...]
    layout: KVCacheLayout
    context_sharded: bool
    blocks_per_request: int
    kernel_blocks_per_request: int
    bytes_per_token: int
    per_request_cap_bytes: int | None

    def describe(self) -> str:
        """``group 0 (full_attention)``, or ``rank group 0 (full_attention; model groups
        0, 2)`` when it differs from the model's group of the same number."""
        if self.model_groups == (self.group.group_id,):
            return f"group {self.group.group_id} ({self.group.kind.value})"
        owners = ", ".join(map(str, self.model_groups))
        return f"rank group {self.group.group_id} ({self.group.kind.value}; model groups {owners})"


PER_RANK_JSON_KEYS: tuple[str, ...] = (
    "tensor_parallel",
    "context_parallel",
    "world_size",
    "context_tokens",
    "splits",
    "groups",
    "page_size_bytes",
    "buffers",
    "bytes_per_block",
    "kv_bytes_per_token",
    "state_bytes_per_request",
    "blocks_per_request",
    "bytes_per_request",
    "memory_bytes",
    "num_blocks",
    "usable_blocks",
    "tokens_that_fit",
    "max_concurrency",
    "max_context_tokens",
)
"""The keys of ``RankPlan.to_json()`` (``ModelPlan.to_json()["per_rank"]``), in order."""


@dataclasses.dataclass(frozen=True)
class RankPlan(_PoolCapacity):
    """What one of ``tensor_parallel * context_parallel`` ranks holds and fits.

    The budget (``memory_bytes`` or ``num_blocks``) is each rank's own. Every request
    has a share on every rank: tensor-parallel ranks hold its K/V heads (or state
    heads) split or replicated, context-parallel ranks its tokens of sharded groups.
    So ``max_concurrency`` and ``tokens_that_fit`` count the requests and context
    tokens the whole set of ranks serves. With ``tensor_parallel`` and
    ``context_parallel`` 1 every figure equals the model's.

    Attributes:
        tensor_parallel, context_parallel: the ranks along each dimension.
        max_model_len: the request length the per-request figures are for.
        splits: one per model group, in group order.
        groups: the rank's groups.
        page_size_bytes: the rank's unified page.
        buffers: the rank's layer buffers per set.
        kv_bytes_per_token: bytes a token adds on a rank that holds it, over the
            layers that cache the decoder's tokens (as ``ModelPlan.kv_bytes_per_token``).
        state_bytes_per_request: the rank's share of a request's states (unpadded).
        context_tokens: tokens of a ``max_model_len`` request the busiest rank holds in
            a sharded group: ``ceil(max_model_len / context_parallel)``.
        memory_bytes, num_blocks: each rank's budget and pool (``None``: no budget).
        max_context_tokens: the longest request the rank's pool holds when it is alone
            (``max_model_len`` aside); ``None`` without a budget, or when no cached
            group grows with the context (any length then fits once the bounded
            caches do).
        shared_bytes_per_page: as ``ModelPlan.shared_bytes_per_page``, the rank's.
    """

    tensor_parallel: int
    context_parallel: int
    max_model_len: int
    splits: tuple[GroupSplit, ...]
    groups: tuple[RankGroupPlan, ...]
    page_size_bytes: int
    buffers: Mapping[BufferSetName, int]
    kv_bytes_per_token: int
    state_bytes_per_request: int
    context_tokens: int
    memory_bytes: int | None
    num_blocks: int | None
    max_context_tokens: int | None
    shared_bytes_per_page: int = 0

    @property
    def world_size(self) -> int:
        """``tensor_parallel * context_parallel``: the ranks one model instance spans."""
        return self.tensor_parallel * self.context_parallel

    @override
    def _capacity_groups(self) -> Sequence[_HoldsBlocks]:
        return self.groups

    def to_json(self) -> dict[str, object]:
        """The rank's figures as JSON-ready data, keys in ``PER_RANK_JSON_KEYS`` order."""
        data: dict[str, object] = {
            "tensor_parallel": self.tensor_parallel,
            "context_parallel": self.context_parallel,
            "world_size": self.world_size,
            "context_tokens": self.context_tokens,
            "splits": [
                {
                    "group": s.group_id,
                    "query_heads": s.query_heads,
                    "kv_heads": s.kv_heads,
                    "kv_replicas": s.kv_replicas,
                    "state_shapes": (
                        [list(shape) for shape in s.spec.shapes]
                        if isinstance(s.spec, MambaSpec)
                        else None
                    ),
                    "page_size_bytes": s.spec.page_size_bytes,
                    "context": s.context,
                    "detail": s.detail,
                }
                for s in self.splits
            ],
            "groups": [
                {
                    "group": g.group.group_id,
                    "kind": g.group.kind.value,
                    "spec": type(g.group.spec).__name__,
                    "model_groups": list(g.model_groups),
                    "num_layers": len(g.group.layer_names),
                    "block_size": g.group.spec.block_size,
                    "blocks_per_page": g.group.blocks_per_page,
                    "page_size_bytes": (
                        g.group.spec.page_size_bytes * g.group.blocks_per_page
                        if g.group.has_cache
                        else 0
                    ),
                    "bytes_per_token": g.bytes_per_token,
                    "blocks_per_request": g.blocks_per_request,
                    "kernel_blocks_per_request": g.kernel_blocks_per_request,
                    "per_request_cap_bytes": g.per_request_cap_bytes,
                    "context_sharded": g.context_sharded,
                    "layout": g.layout,
                }
                for g in self.groups
            ],
            "page_size_bytes": self.page_size_bytes,
            "buffers": dict(sorted(self.buffers.items())),
            "bytes_per_block": self.bytes_per_block,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "state_bytes_per_request": self.state_bytes_per_request,
            "blocks_per_request": self.blocks_per_request,
            "bytes_per_request": self.bytes_per_request,
            "memory_bytes": self.memory_bytes,
            "num_blocks": self.num_blocks,
            "usable_blocks": self.usable_blocks,
            "tokens_that_fit": self.tokens_that_fit,
            "max_concurrency": self.max_concurrency,
            "max_context_tokens": self.max_context_tokens,
        }
        assert tuple(data) == PER_RANK_JSON_KEYS
        return data


PLAN_JSON_KEYS: tuple[str, ...] = (
    "model_type",
    "source",
    "device",
    "capability",
    "dtype",
    "max_model_len",
    "max_num_batched_tokens",
    "layers",
    "groups",
    "page_size_bytes",
    "buffers",
    "bytes_per_block",
    "kv_bytes_per_token",
    "state_bytes_per_request",
    "blocks_per_request",
    "bytes_per_request",
    "memory_bytes",
    "num_blocks",
    "usable_blocks",
    "tokens_that_fit",
    "max_concurrency",
    "cudagraph_support",
    "cudagraph_limited_by",
    "unserved_groups",
    "tensor_parallel",
    "context_parallel",
    "per_rank",
    "prefix_cache",
)
"""The top-level keys of ``ModelPlan.to_json()``, in the order it writes them."""


@dataclasses.dataclass(frozen=True)
class ModelPlan(_PoolCapacity):
    """What ``plan_model`` found (the ``attnkit.planner`` docstring gives the arithmetic).

    Attributes:
        model_type: the config's ``model_type`` (``None`` for bare specs).
        dtype: the model dtype of a ``ModelLayout`` (``None`` for bare specs).
        device, capability: what was planned for.
        max_model_len, max_num_batched_tokens: the config's limits used per request.
        layers: one row per layer, in model order.
        groups: one per KV-cache group, in group order.
        page_size_bytes: the unified page ``P`` (0 when nothing is cached).
        buffers: buffer set -> layer buffers in it (``kv_cache.buffers_per_set``).
        kv_bytes_per_token: bytes a token adds over the layers that cache the
            decoder's tokens (every attention layer but encoder-only and cross).
            Windowed and chunked layers count in full here; their per-request cap is
            ``GroupPlan.per_request_cap_bytes``.
        state_bytes_per_request: the state layers' states of one request (unpadded).
        memory_bytes: the budget (``None`` when neither it nor ``num_blocks`` was
            given); with ``num_blocks`` given, ``num_blocks * bytes_per_block``.
        num_blocks: the pool's blocks, the null block included (``None``: no budget,
            or, planning for several ranks, a rank's budget that holds fewer than 2
            blocks of the whole model).
        per_rank: what each rank holds and fits with ``tensor_parallel`` and
            ``context_parallel`` (the same figures when both are 1). The figures above
            are the whole model's on one device with the same budget.
        prefix: the model's minimum cacheable prefix and state checkpoint cost
            (``PrefixPlan``).
        draft_state_bytes: the state layers' draft buffers for speculative decoding
            (``config.num_speculative_tokens`` states per request slot,
            ``max_num_reqs``, and state layer), taken from ``memory_bytes`` before
            the pool is sized (0 without drafts or state layers).
        shared_bytes_per_page: what a page costs beyond the layer buffers: the own
            buffers of the groups that share an owner's block ids (DeepSeek sparse
            attention's index cache; ``kv_cache.shared_bytes_per_page``).
    """

    model_type: str | None
    dtype: torch.dtype | None
    device: torch.device
    capability: tuple[int, int] | None
    max_model_len: int
    max_num_batched_tokens: int
    layers: tuple[LayerPlan, ...]
    groups: tuple[GroupPlan, ...]
    page_size_bytes: int
    buffers: Mapping[BufferSetName, int]
    kv_bytes_per_token: int
    state_bytes_per_request: int
    memory_bytes: int | None
    num_blocks: int | None
    per_rank: RankPlan
    prefix: PrefixPlan | None = None
    draft_state_bytes: int = 0
    shared_bytes_per_page: int = 0

    @property
    def tensor_parallel(self) -> int:
        """Tensor-parallel ranks planned for (1: none)."""
        return self.per_rank.tensor_parallel

    @property
    def context_parallel(self) -> int:
        """Context-parallel ranks planned for (1: none)."""
        return self.per_rank.context_parallel

    @override
    def _capacity_groups(self) -> Sequence[_HoldsBlocks]:
        return self.groups

    @property
    def unserved(self) -> tuple[GroupPlan, ...]:
        """Groups no backend can serve."""
        return tuple(g for g in self.groups if g.selection is None)

    def cudagraph(self) -> tuple[AttentionCGSupport, str] | None:
        """The model's CUDA-graph support (the minimum over its groups) and the group
        that limits it, as ``AttentionRuntime.cudagraph_support``; ``None`` when a
        group has no backend."""
        levels: list[tuple[AttentionCGSupport, str]] = []
        for g in self.groups:
            if g.cudagraph_support is None:
                return None
            levels.append((g.cudagraph_support, g.describe()))
        return min(levels, key=lambda item: item[0]) if levels else None

    def to_json(self, source: str | None = None) -> dict[str, object]:
        """The plan as JSON-ready data, keys in ``PLAN_JSON_KEYS`` order (docs/models.md
        documents each key)."""
        cg = self.cudagraph()
        groups: list[dict[str, object]] = []
        for g in self.groups:
            spec = g.group.spec
            groups.append(
                {
                    "group": g.group.group_id,
                    "kind": g.group.kind.value,
                    "spec": type(spec).__name__,
                    "layers": list(g.group.layer_names),
                    "block_size": spec.block_size,
                    "blocks_per_page": g.group.blocks_per_page,
                    "page_size_bytes": (
                        spec.page_size_bytes * g.group.blocks_per_page if g.group.has_cache else 0
                    ),
                    "block_owner": g.group.block_owner,
                    "bytes_per_token": g.bytes_per_token,
                    "blocks_per_request": g.blocks_per_request,
                    "kernel_blocks_per_request": g.kernel_blocks_per_request,
                    "per_request_cap_bytes": g.per_request_cap_bytes,
                    "backend": g.backend_name,
                    "chosen_by": g.selection.source if g.selection is not None else None,
                    "layout": g.layout,
                    "buffer_set": g.buffer_set,
                    "cudagraph_support": (
                        g.cudagraph_support.name if g.cudagraph_support is not None else None
                    ),
                    "determinism": (
                        g.selection.backend.determinism_for(g.group.kind).label
                        if g.selection is not None
                        else None
                    ),
                    "skipped": [
                        {"backend": r.backend, "reasons": list(r.reasons)} for r in g.rejected
                    ],
                    "error": g.error,
                }
            )
        data: dict[str, object] = {
            "model_type": self.model_type,
            "source": source,
            "device": str(self.device),
            "capability": (
                f"{self.capability[0]}.{self.capability[1]}" if self.capability else None
            ),
            "dtype": str(self.dtype).removeprefix("torch.") if self.dtype is not None else None,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "layers": [
                {
                    "name": layer.name,
                    "kind": layer.kind,
                    "mamba_type": layer.mamba_type,
                    "sliding_window": layer.sliding_window,
                    "attention_chunk_size": layer.attention_chunk_size,
                    "group": layer.group,
                    "backend": self.groups[layer.group].backend_name,
                }
                for layer in self.layers
            ],
            "groups": groups,
            "page_size_bytes": self.page_size_bytes,
            "buffers": dict(sorted(self.buffers.items())),
            "bytes_per_block": self.bytes_per_block,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "state_bytes_per_request": self.state_bytes_per_request,
            "blocks_per_request": self.blocks_per_request,
            "bytes_per_request": self.bytes_per_request,
            "memory_bytes": self.memory_bytes,
            "num_blocks": self.num_blocks,
            "usable_blocks": self.usable_blocks,
            "tokens_that_fit": self.tokens_that_fit,
            "max_concurrency": self.max_concurrency,
            "cudagraph_support": cg[0].name if cg is not None else None,
            "cudagraph_limited_by": cg[1] if cg is not None else None,
            "unserved_groups": [g.group.group_id for g in self.unserved],
            "tensor_parallel": self.tensor_parallel,
            "context_parallel": self.context_parallel,
            "per_rank": self.per_rank.to_json(),
            "prefix_cache": self.prefix.to_json() if self.prefix is not None else None,
        }
        assert tuple(data) == PLAN_JSON_KEYS
        return data
