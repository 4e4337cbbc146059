"""Capacity planning: a model's layers -> groups, backends, and what fits in memory.

``plan_model`` answers, for a model (a ``ModelLayout`` from ``layout_from_hf_config``,
or layer specs) on a device, without allocating anything: which backend serves each
layer and why the others were skipped, the groups and the unified page size (the
block sizes the runtime will run), the bytes a token and a request cost, and how many
blocks, tokens and requests of ``max_model_len`` tokens fit in a memory budget::

    layout = attnkit.layout_from_hf_config("path/to/model")
    plan = plan_model(layout, AttentionConfig(max_model_len=8192), device="cpu",
                      memory_bytes=parse_memory_size("80GiB"))
    plan.groups[0].spec.block_size, plan.num_blocks, plan.max_concurrency

It shares the runtime's code paths: ``kv_cache.unified_groups`` for grouping and
page-size unification, ``select_backend`` with the features and head counts the
runtime asks for (``runtime.group_features``), and ``kv_cache.num_blocks_for_budget``
for the pool. The arithmetic (docs/models.md, "Capacity planning"):

* a block id names one page of ``P`` bytes in every layer buffer of every buffer set
  in use, so a block costs ``bytes_per_block = P * buffers`` and the pool holds
  ``num_blocks = memory // bytes_per_block`` blocks, block 0 (the null block) included;
* a request of up to ``max_model_len`` tokens holds at most
  ``blocks_per_request = sum over cached groups of spec.max_memory_usage_bytes(...) /
  page`` blocks: ``ceil(max_model_len / block_size)`` for full attention, the window
  (or chunk) plus one step of ``max_num_batched_tokens`` tokens for windowed
  (chunked) layers, one block for a state layer;
* ``max_concurrency = (num_blocks - 1) // blocks_per_request``;
  ``tokens_that_fit = (num_blocks - 1) * max_model_len // blocks_per_request`` (the
  context tokens the pool holds at that per-request cost; for a model of full
  attention layers only, ``(num_blocks - 1) * block_size``).

With ``tensor_parallel`` and ``context_parallel`` ranks, ``ModelPlan.per_rank`` repeats
the arithmetic for one rank (docs/architecture.md, "Parallel planning"): each group's
heads or state split over the tensor-parallel ranks (K/V heads replicated when fewer
than the ranks, MLA latents on every rank), the rank's specs grouped and unified as
the runtime does, full and MLA caches sharded token by token over the
context-parallel ranks (every other kind replicated), and the budget taken as each
rank's.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Literal, Protocol

import torch
from typing_extensions import override

from ._validation import is_positive_int
from .builder import AttentionCGSupport
from .capabilities import KVCacheLayout
from .config import AttentionConfig
from .devices import parse_device
from .errors import ArgumentTypeError, InvalidArgumentError, NoBackendError, Rejection
from .kinds import rules_for
from .kv_cache import (
    BufferSetName,
    KVCacheGroup,
    buffer_set_of,
    buffers_per_set,
    num_blocks_for_budget,
    unified_groups,
)
from .models import LayerInfo, ModelLayout
from .params import AttentionLayerParams, LayerParams
from .registry import BackendRegistry
from .runtime import default_layer_params, group_features, group_num_heads
from .selector import Selection, select_backend
from .spec import AttentionSpec, KVCacheSpec, MambaSpec
from .state_types import state_type_of

__all__ = [
    "PER_RANK_JSON_KEYS",
    "PLAN_JSON_KEYS",
    "ContextPlacement",
    "GroupPlan",
    "GroupSplit",
    "LayerPlan",
    "ModelPlan",
    "RankGroupPlan",
    "RankPlan",
    "format_bytes",
    "parse_memory_size",
    "plan_model",
]

_UNITS: Mapping[str, int] = {
    "B": 1,
    "KB": 10**3,
    "kB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)")


def parse_memory_size(text: str, *, argument: str = "memory") -> int:
    """Bytes from ``"80GiB"``, ``"500MB"``, ``"1.5 TiB"`` or a plain byte count ``"4096"``.

    Units (case as written): B, kB/KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB
    (powers of 1024). The result must be a whole number of bytes, at least 1.

    Raises:
        ArgumentTypeError: ``text`` is not a str.
        InvalidArgumentError: anything else (the message names ``argument``, the units
            and the text given).
    """
    if not isinstance(text, str):
        raise ArgumentTypeError(
            f"{argument} must be a str such as '80GiB', got {text!r} ({type(text).__name__})"
        )
    units = ", ".join(_UNITS)
    expected = f"a size such as 80GiB, 500MB or 4096 (bytes); units: {units}"
    match = _SIZE.fullmatch(text.strip())
    if match is None or match.group(2) not in {*_UNITS, ""}:
        raise InvalidArgumentError(f"{argument} must be {expected}; got {text!r}")
    value = Fraction(match.group(1)) * _UNITS[match.group(2) or "B"]
    if value.denominator != 1:
        raise InvalidArgumentError(
            f"{argument} must be a whole number of bytes, got {text!r} (= {float(value):g} bytes)"
        )
    if value < 1:
        raise InvalidArgumentError(f"{argument} must be at least 1 byte, got {text!r}")
    return int(value)


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
        blocks_per_request: the most blocks one request of ``max_model_len`` tokens
            holds in this group (0 for a group without cache).
        bytes_per_token: cache bytes a token adds to this group's layers (0 for state
            and encoder-only groups; cross-attention counts encoder tokens).
        per_request_cap_bytes: for windowed and chunked-local groups, the most bytes a
            request's tokens keep in the group's layers: ``blocks_per_request`` pages
            per layer; ``None`` for groups that grow with the request.
        cudagraph_support: the builder's CUDA-graph support, ``None`` without a backend.
    """

    group: KVCacheGroup
    selection: Selection | None
    rejected: tuple[Rejection, ...]
    error: str | None
    layout: KVCacheLayout
    blocks_per_request: int
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
            its own page, see ``RankPlan.groups``).
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
    rule, so its page, block sizes and even its groups may differ from the model's: two
    groups whose specs become equal once split (2 and 4 K/V heads at
    ``tensor_parallel=4``) are one group on a rank.

    Attributes:
        group: the rank's group (its spec unified to the rank's page).
        model_groups: the model's groups whose layers it holds.
        layout: the cache layout of the backend chosen for the model group.
        context_sharded: context parallelism shards its tokens.
        blocks_per_request: the most blocks a request of ``max_model_len`` tokens holds
            in this group on the busiest rank (rank 0 for a sharded group:
            ``ceil(max_model_len / context_parallel)`` tokens).
        bytes_per_token: cache bytes a token adds to this group's layers on a rank
            that holds it.
        per_request_cap_bytes: as ``GroupPlan.per_request_cap_bytes``, per rank.
    """

    group: KVCacheGroup
    model_groups: tuple[int, ...]
    layout: KVCacheLayout
    context_sharded: bool
    blocks_per_request: int
    bytes_per_token: int
    per_request_cap_bytes: int | None

    def describe(self) -> str:
        """``group 0 (full_attention)``, or ``rank group 0 (full_attention; model groups
        0, 2)`` when it differs from the model's group of the same number."""
        if self.model_groups == (self.group.group_id,):
            return f"group {self.group.group_id} ({self.group.kind.value})"
        owners = ", ".join(map(str, self.model_groups))
        return (
            f"rank group {self.group.group_id} ({self.group.kind.value}; "
            f"model groups {owners})"
        )


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


class _HoldsBlocks(Protocol):
    @property
    def blocks_per_request(self) -> int: ...


class _PoolCapacity:
    """Capacity figures shared by ``ModelPlan`` (one device) and ``RankPlan`` (one rank):
    both have a unified page, layer buffers, groups with their blocks per request, a
    pool and the request length the figures are for."""

    page_size_bytes: int
    buffers: Mapping[BufferSetName, int]
    num_blocks: int | None
    max_model_len: int

    def _capacity_groups(self) -> Sequence[_HoldsBlocks]:
        raise NotImplementedError

    @property
    def bytes_per_block(self) -> int:
        """What one block id costs: a page in every layer buffer of every set."""
        return self.page_size_bytes * sum(self.buffers.values())

    @property
    def blocks_per_request(self) -> int:
        """The most blocks one request of ``max_model_len`` tokens holds, all groups (on
        the busiest rank, for a ``RankPlan``)."""
        return sum(g.blocks_per_request for g in self._capacity_groups())

    @property
    def bytes_per_request(self) -> int:
        """``blocks_per_request * bytes_per_block``: a request's share of the pool."""
        return self.blocks_per_request * self.bytes_per_block

    @property
    def usable_blocks(self) -> int | None:
        """Blocks requests can hold: all but the null block."""
        return None if self.num_blocks is None else self.num_blocks - 1

    @property
    def max_concurrency(self) -> int | None:
        """Requests of ``max_model_len`` tokens that fit at once (``None`` without a
        budget, or when the model caches nothing)."""
        usable = self.usable_blocks
        if usable is None or self.blocks_per_request == 0:
            return None
        return usable // self.blocks_per_request

    @property
    def tokens_that_fit(self) -> int | None:
        """Context tokens the pool holds (the ranks together, for a ``RankPlan``) at the
        per-request cost of ``max_model_len`` tokens (``None`` as ``max_concurrency``)."""
        usable = self.usable_blocks
        if usable is None or self.blocks_per_request == 0:
            return None
        return usable * self.max_model_len // self.blocks_per_request


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
                    "page_size_bytes": g.group.spec.page_size_bytes if g.group.has_cache else 0,
                    "bytes_per_token": g.bytes_per_token,
                    "blocks_per_request": g.blocks_per_request,
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
)
"""The top-level keys of ``ModelPlan.to_json()``, in the order it writes them."""


@dataclasses.dataclass(frozen=True)
class ModelPlan(_PoolCapacity):
    """What ``plan_model`` found (see the module docstring for the arithmetic).

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
                    "declared_block_size": g.group.original_spec.block_size,
                    "page_size_bytes": spec.page_size_bytes if g.group.has_cache else 0,
                    "bytes_per_token": g.bytes_per_token,
                    "blocks_per_request": g.blocks_per_request,
                    "per_request_cap_bytes": g.per_request_cap_bytes,
                    "backend": g.backend_name,
                    "chosen_by": g.selection.source if g.selection is not None else None,
                    "layout": g.layout,
                    "buffer_set": g.buffer_set,
                    "cudagraph_support": (
                        g.cudagraph_support.name if g.cudagraph_support is not None else None
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
        }
        assert tuple(data) == PLAN_JSON_KEYS
        return data


def _layer_params(info: LayerInfo) -> LayerParams | None:
    """The params an engine would pass for a layer, as far as selection is concerned.

    Learned sinks are checkpoint weights; a zero placeholder of the right shape stands
    for them, so the backend is asked for the sinks feature as it will be at run time.
    State layers pass none (selection does not read state params).
    """
    if not info.is_attention or info.num_heads is None:
        return None
    sinks = torch.zeros(info.num_heads, dtype=torch.float32) if info.has_sinks else None
    return info.attention_params(sinks=sinks)


def _group_costs(group: KVCacheGroup, config: AttentionConfig) -> tuple[int, int, int | None]:
    """``(blocks_per_request, bytes_per_token, per_request_cap_bytes)`` of a group."""
    if not group.has_cache:
        return 0, 0, None
    spec = group.spec  # unified: an attention group's page is exactly P
    blocks = (
        spec.max_memory_usage_bytes(config.max_model_len, config.max_num_batched_tokens)
        // spec.page_size_bytes
    )
    layers = len(group.layer_names)
    if isinstance(spec, AttentionSpec):
        per_token = layers * spec.page_size_bytes // spec.block_size
        bounded = rules_for(spec).bound(spec) is not None
        cap = blocks * spec.page_size_bytes * layers if bounded else None
        return blocks, per_token, cap
    return blocks, 0, None


def _check_ranks(name: str, value: object) -> int:
    """``tensor_parallel`` / ``context_parallel``: an int >= 1."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentTypeError(
            f"plan_model: {name} must be an int >= 1 (ranks), got {value!r} "
            f"({type(value).__name__})"
        )
    if value < 1:
        raise InvalidArgumentError(f"plan_model: {name} must be an int >= 1 (ranks), got {value}")
    return value


def _where(group: KVCacheGroup) -> str:
    """``layer 'x' (group 0, 32 layers)``: how a split error names a group."""
    count = len(group.layer_names)
    layers = f", {count} layers" if count > 1 else ""
    return f"layer {group.layer_names[0]!r} (group {group.group_id}{layers})"


def _split_state(spec: MambaSpec, tp: int, where: str) -> tuple[MambaSpec, str]:
    """A state layer's spec on one of ``tp`` ranks, and the split in words: its type's
    rule (``StateType.split_shapes``; an error names the layer)."""
    shapes, detail = state_type_of(spec).split_shapes(spec.shapes, tp, where=where)
    return dataclasses.replace(spec, shapes=shapes), detail


def _split_group(
    group: KVCacheGroup, params: Mapping[str, LayerParams | None], tp: int
) -> GroupSplit:
    """How ``tp`` tensor-parallel ranks split a model group (context placement by kind)."""
    spec, where = group.original_spec, _where(group)
    rules = rules_for(spec)
    context: ContextPlacement = (
        "none" if not group.has_cache else "sharded" if rules.context_sharded else "replicated"
    )
    if isinstance(spec, MambaSpec):
        state, detail = _split_state(spec, tp, where)
        return GroupSplit(group.group_id, state, None, None, None, context, detail)
    assert isinstance(spec, AttentionSpec)  # a spec is an attention or a state spec
    heads: list[int] = []
    for name in group.layer_names:
        layer = params.get(name)
        if not isinstance(layer, AttentionLayerParams):
            continue
        if layer.num_heads % tp:
            raise InvalidArgumentError(
                f"plan_model: tensor_parallel={tp} does not divide the {layer.num_heads} "
                f"query heads of layer {name!r} ({spec.kind.value}); each rank must hold "
                f"whole heads"
            )
        heads.append(layer.num_heads // tp)
    query = heads[0] if heads else None
    shown = f"query heads {query * tp} -> {query} per rank; " if query is not None else ""
    split = rules.tensor_split(spec, tp, where)
    return GroupSplit(
        group.group_id,
        split.spec,
        query,
        split.kv_heads,
        split.kv_replicas,
        context,
        f"{shown}{split.detail}",
    )


def _rank_blocks(spec: KVCacheSpec, max_model_len: int, batched: int, cp: int) -> int:
    """The most blocks one request of ``max_model_len`` tokens holds in a group of
    ``spec`` (a unified, cached spec) on the busiest of ``cp`` context-parallel ranks.

    Sharded kinds hold ``ceil(tokens / cp)`` slots on rank 0; replicated ones what the
    spec says for the whole request.
    """
    if rules_for(spec).context_sharded:
        local = -(-max_model_len // cp)
        return -(-local // spec.block_size)
    return spec.max_memory_usage_bytes(max_model_len, batched) // spec.page_size_bytes


def _max_context(
    groups: Sequence[KVCacheGroup], batched: int, cp: int, usable: int
) -> int | None:
    """The longest request ``usable`` blocks hold on each rank (binary search over the
    length: every group's blocks grow monotonically with it); ``None`` when every
    length fits (no cached group grows without bound, and the bounded ones fit)."""
    cached = [g.spec for g in groups if g.has_cache]
    growing = [s.block_size for s in cached if rules_for(s).grows_without_bound]

    def blocks(length: int) -> int:
        return sum(_rank_blocks(s, length, batched, cp) for s in cached)

    if blocks(1) > usable:
        return 0
    if growing:
        # At ``high`` tokens the growing group of the smallest blocks alone holds at
        # least usable + 1 of them.
        high = cp * min(growing) * (usable + 1)
    else:
        # Windows and chunks stop growing once a request passes window (chunk) + one
        # step + one block; states never grow.
        spans = [
            bound + batched + s.block_size
            for s in cached
            if (bound := rules_for(s).bound(s)) is not None
        ]
        high = 1 + max(spans, default=0)
        if blocks(high) <= usable:
            return None
    low = 1
    assert blocks(high) > usable
    while high - low > 1:
        middle = (low + high) // 2
        if blocks(middle) <= usable:
            low = middle
        else:
            high = middle
    return low


def _rank_plan(
    specs: Mapping[str, KVCacheSpec],
    params: Mapping[str, LayerParams | None],
    groups: Sequence[KVCacheGroup],
    layouts: Mapping[int, KVCacheLayout],
    config: AttentionConfig,
    *,
    tp: int,
    cp: int,
    memory_bytes: int | None,
    num_blocks: int | None,
) -> RankPlan:
    """The per-rank plan: split every model group, then group, unify and size the
    rank's cache with the runtime's own rules (``unified_groups``, ``buffers_per_set``,
    ``num_blocks_for_budget``), ``memory_bytes`` / ``num_blocks`` being the rank's."""
    splits = tuple(_split_group(g, params, tp) for g in groups)
    model_group = {name: g.group_id for g in groups for name in g.layer_names}
    rank_specs = {name: splits[model_group[name]].spec for name in specs}
    rank_groups, page = unified_groups(rank_specs)
    owners = {
        g.group_id: tuple(dict.fromkeys(model_group[n] for n in g.layer_names))
        for g in rank_groups
    }
    # A rank's group runs the backend chosen for its (first) model group.
    rank_layouts: dict[int, KVCacheLayout] = {
        g.group_id: layouts[owners[g.group_id][0]] for g in rank_groups
    }
    planned: list[RankGroupPlan] = []
    for g in rank_groups:
        spec, layers = g.spec, len(g.layer_names)
        blocks = per_token = 0
        cap: int | None = None
        if g.has_cache:
            blocks = _rank_blocks(spec, config.max_model_len, config.max_num_batched_tokens, cp)
            if isinstance(spec, AttentionSpec):
                per_token = layers * spec.page_size_bytes // spec.block_size
                if rules_for(spec).bound(spec) is not None:
                    cap = blocks * spec.page_size_bytes * layers
        planned.append(
            RankGroupPlan(
                group=g,
                model_groups=owners[g.group_id],
                layout=rank_layouts[g.group_id],
                context_sharded=g.has_cache and rules_for(spec).context_sharded,
                blocks_per_request=blocks,
                bytes_per_token=per_token,
                per_request_cap_bytes=cap,
            )
        )
    buffers = buffers_per_set(rank_groups, rank_layouts)
    if memory_bytes is not None:
        num_blocks = num_blocks_for_budget(rank_groups, page, memory_bytes, rank_layouts)
    elif num_blocks is not None:
        memory_bytes = num_blocks * page * sum(buffers.values())
    kv_per_token = sum(
        s.page_size_bytes // s.block_size
        for s in rank_specs.values()
        if rules_for(s).counts_kv_per_token
    )
    longest = (
        None
        if num_blocks is None
        else _max_context(rank_groups, config.max_num_batched_tokens, cp, num_blocks - 1)
    )
    return RankPlan(
        tensor_parallel=tp,
        context_parallel=cp,
        max_model_len=config.max_model_len,
        splits=splits,
        groups=tuple(planned),
        page_size_bytes=page,
        buffers=buffers,
        kv_bytes_per_token=kv_per_token,
        state_bytes_per_request=sum(
            s.page_size_bytes for s in rank_specs.values() if isinstance(s, MambaSpec)
        ),
        context_tokens=-(-config.max_model_len // cp),
        memory_bytes=memory_bytes,
        num_blocks=num_blocks,
        max_context_tokens=longest,
    )


def plan_model(
    model: ModelLayout | Mapping[str, KVCacheSpec],
    config: AttentionConfig,
    *,
    device: torch.device | str,
    capability: tuple[int, int] | None = None,
    hypothetical_device: bool = False,
    registry: BackendRegistry | None = None,
    priority: Mapping[str, Sequence[str]] | None = None,
    layer_params: Mapping[str, LayerParams] | None = None,
    memory_bytes: int | None = None,
    num_blocks: int | None = None,
    tensor_parallel: int = 1,
    context_parallel: int = 1,
) -> ModelPlan:
    """Plan a model's cache and backends on ``device`` (nothing is allocated).

    Args:
        model: a ``ModelLayout`` (its attention layers' params come from the config:
            head counts, soft-caps, sinks) or layer name -> spec (attention layers then
            get ``AttentionLayerParams(num_heads=num_kv_heads)``, as in the runtime).
        config: backend choices and the limits ``max_model_len`` and
            ``max_num_batched_tokens`` the per-request bound uses.
        device, capability, hypothetical_device, registry, priority: as
            ``select_backend``.
        layer_params: params that replace the derived ones, per layer.
        memory_bytes: the KV-cache budget; or ``num_blocks``: the pool's size (the null
            block included, >= 2). At most one; with neither, the plan has no block,
            token or concurrency counts. With parallelism, each rank's.
        tensor_parallel, context_parallel: ranks that shard the model's heads and
            its context (``ModelPlan.per_rank``; docs/architecture.md, "Parallel
            planning"). Query heads split evenly; K/V heads split, or replicate when
            fewer than the ranks; MLA latents replicate; state heads split. Full and
            MLA caches shard their tokens over the context-parallel ranks; the others
            (windows, chunks, states, cross-attention, sink layers) replicate.

    Raises:
        ArgumentTypeError / InvalidArgumentError: bad arguments, a budget that
            holds fewer than 2 blocks (the message says how many bytes 2 need), or a
            ``tensor_parallel`` that does not split a layer's heads or state exactly
            (the message names the layer).
        Selection's argument errors; a group no backend serves is not an error (it is
        recorded in ``GroupPlan.error``).
    """
    if not isinstance(config, AttentionConfig):
        raise ArgumentTypeError(
            f"plan_model: config must be an AttentionConfig, got {type(config).__name__}"
        )
    if memory_bytes is not None and num_blocks is not None:
        raise InvalidArgumentError(
            f"plan_model: give memory_bytes or num_blocks, not both; got "
            f"memory_bytes={memory_bytes!r} and num_blocks={num_blocks!r}"
        )
    if num_blocks is not None and (not is_positive_int(num_blocks) or num_blocks < 2):
        raise InvalidArgumentError(
            f"plan_model: num_blocks must be an int >= 2 (block 0 is the null block), "
            f"got {num_blocks!r}"
        )
    tp = _check_ranks("tensor_parallel", tensor_parallel)
    cp = _check_ranks("context_parallel", context_parallel)
    parsed_device = parse_device(device, argument="device")
    if isinstance(model, ModelLayout):
        specs = model.specs()
        params: dict[str, LayerParams | None] = {
            n: _layer_params(i) for n, i in model.layers.items()
        }
    elif isinstance(model, Mapping):
        specs = dict(model)
        # A value that is not a spec is refused by unified_groups below, by name.
        params = {n: default_layer_params(s) for n, s in specs.items()}
    else:
        raise ArgumentTypeError(
            "plan_model: model must be a ModelLayout or a mapping of layer name -> "
            f"KVCacheSpec, got {type(model).__name__}"
        )
    for name, given in (layer_params or {}).items():
        if name not in specs:
            raise InvalidArgumentError(
                f"plan_model: layer_params names layer {name!r}, which the model lacks"
            )
        params[name] = given
    groups, page = unified_groups(specs)
    planned: list[GroupPlan] = []
    for group in groups:
        group_params = [params.get(n) for n in group.layer_names]
        selection: Selection | None = None
        error: str | None = None
        rejected: tuple[Rejection, ...]
        try:
            selection = select_backend(
                group.spec,
                config,
                device=parsed_device,
                capability=capability,
                features=group_features(group_params),
                num_heads=group_num_heads(group_params),
                registry=registry,
                priority=priority,
                hypothetical_device=hypothetical_device,
            )
            rejected = selection.rejected
        except NoBackendError as exc:
            error, rejected = str(exc), exc.rejected
        layout: KVCacheLayout = (
            selection.backend.kv_cache_layout if selection is not None else "interleaved"
        )
        cg = (
            selection.backend.get_binding(group.spec).get_cudagraph_support(config, group.spec)
            if selection is not None
            else None
        )
        blocks, per_token, cap = _group_costs(group, config)
        planned.append(
            GroupPlan(group, selection, rejected, error, layout, blocks, per_token, cap, cg)
        )
    layouts: dict[int, KVCacheLayout] = {g.group.group_id: g.layout for g in planned}
    buffers = buffers_per_set(groups, layouts)
    # Split first: a tensor_parallel that splits no layer is the user's first problem.
    per_rank = _rank_plan(
        specs,
        params,
        groups,
        layouts,
        config,
        tp=tp,
        cp=cp,
        memory_bytes=memory_bytes,
        num_blocks=num_blocks,
    )
    if memory_bytes is not None:
        try:
            num_blocks = num_blocks_for_budget(groups, page, memory_bytes, layouts)
        except InvalidArgumentError:
            if per_rank.world_size == 1:
                raise
            # The budget is a rank's: the whole model on one device need not fit in it.
            num_blocks = None
    elif num_blocks is not None:
        memory_bytes = num_blocks * page * sum(buffers.values())
    group_of = {name: g.group_id for g in groups for name in g.layer_names}
    layers: list[LayerPlan] = []
    for name, spec in specs.items():
        mask = rules_for(spec).mask(spec)
        layers.append(
            LayerPlan(
                name=name,
                kind=spec.kind.value,
                spec_class=type(spec).__name__,
                mamba_type=spec.mamba_type if isinstance(spec, MambaSpec) else None,
                sliding_window=mask.window,
                attention_chunk_size=mask.chunk,
                group=group_of[name],
            )
        )
    kv_per_token = sum(
        s.page_size_bytes // s.block_size for s in specs.values() if rules_for(s).counts_kv_per_token
    )
    state = sum(s.page_size_bytes for s in specs.values() if isinstance(s, MambaSpec))
    return ModelPlan(
        model_type=model.model_type if isinstance(model, ModelLayout) else None,
        dtype=model.dtype if isinstance(model, ModelLayout) else None,
        device=parsed_device,
        capability=capability,
        max_model_len=config.max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        layers=tuple(layers),
        groups=tuple(planned),
        page_size_bytes=page,
        buffers=buffers,
        kv_bytes_per_token=kv_per_token,
        state_bytes_per_request=state,
        memory_bytes=memory_bytes,
        num_blocks=num_blocks,
        per_rank=per_rank,
    )


def format_bytes(value: int) -> str:
    """``1073741824`` -> ``1.00 GiB``; below 1 KiB, ``512 B``."""
    scaled, unit = float(value), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if scaled < 1024:
            break
        scaled, unit = scaled / 1024, bigger
    return f"{value} B" if unit == "B" else f"{scaled:.2f} {unit}"
