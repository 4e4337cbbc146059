"""``AttentionRuntime``: the per-step driver an engine uses.

Built once from the model's layer specs, it groups layers, unifies page sizes, selects
a backend per group, makes one builder per group and one impl per layer, and
allocates the paged cache. Each step::

    step = runtime.begin_step([ScheduledRequest("a", 7), ScheduledRequest("b", 1)],
                              finished=["c"])
    # lay out the step's tokens in step.order (decodes first when a backend asks)
    out = runtime.forward("layers.0", q, k, v)                         # attention
    y = runtime.forward_state("layers.1", Mamba2Inputs(xBC=xbc, dt=dt))  # a state layer
    mamba = runtime.state_layer("layers.1", Mamba2Inputs)    # or a typed handle:
    y = mamba.forward(Mamba2Inputs(xBC=xbc, dt=dt))          # mypy checks the input class

``begin_step`` builds ``CommonAttentionMetadata`` and each group's backend metadata
exactly once; every ``forward`` of the step reuses it.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar, cast

import numpy as np
import torch

from ._boundary import AttentionInputs, StateLayerInputs, copy_back, input_device
from ._validation import is_nonnegative_int, is_positive_int
from .backend import AnyBinding, AttentionBackend
from .builder import AttentionCGSupport, AttentionMetadataBuilder
from .capabilities import AttentionFeature, KVCacheLayout
from .config import AttentionConfig
from .devices import check_device_available, parse_device
from .errors import (
    ArgumentTypeError,
    DuplicateRequestError,
    EngineLimitError,
    InvalidArgumentError,
    StaleStepError,
    UnknownLayerError,
)
from .impl import AttentionImpl, StateImpl
from .kinds import Ints, KindRules, ShardedRules, StepLens, StepTokens, rules_for, spans
from .kv_cache import (
    BufferSetName,
    KVCacheGroup,
    KVCacheManager,
    allocate_kv_cache_tensors,
    buffer_set_of,
    buffers_per_set,
    num_blocks_for_budget,
    unified_groups,
)
from .metadata import CommonAttentionMetadata, host_to_device
from .parallel import (
    ContextParallel,
    ContextParallelMismatchError,
    merge_partials,
    step_fingerprint,
)
from .params import AttentionLayerParams, LayerParams, StateLayerParams
from .registry import BackendRegistry
from .selector import Selection, select_backend
from .spec import (
    AttentionSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
)
from .state_inputs import StateInputs
from .state_types import state_type_of

__all__ = [
    "AttentionRuntime",
    "GroupMemory",
    "MemoryReport",
    "RoutingRow",
    "ScheduledRequest",
    "StateLayer",
    "StepBatch",
]

InputsT = TypeVar("InputsT", bound=StateInputs)

_LOG = logging.getLogger(__name__)

# torch.from_numpy, typed: torch leaves its parameter unannotated (pyright: Unknown).
_from_numpy: Callable[[np.ndarray[Any, Any]], torch.Tensor] = torch.from_numpy  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    """One request of a step.

    Attributes:
        req_id: the engine's id; a new id starts a request.
        num_new_tokens: tokens scheduled this step (a prompt chunk, or 1 to decode).
        encoder_len: for models with cross-attention layers, the request's encoder
            tokens (given on its first step).
    """

    req_id: str
    num_new_tokens: int
    encoder_len: int = 0

    def __post_init__(self) -> None:
        # Checked here, where the engine makes it, so begin_step need not re-check
        # every field of every request on the hot path.
        if not isinstance(self.req_id, str):
            raise ArgumentTypeError(
                f"ScheduledRequest.req_id must be a str, got {self.req_id!r} "
                f"({type(self.req_id).__name__})"
            )
        if not self.req_id:
            raise InvalidArgumentError("ScheduledRequest.req_id must be a non-empty str, got ''")
        if not is_positive_int(self.num_new_tokens):
            raise InvalidArgumentError(
                f"request {self.req_id!r}: num_new_tokens must be an int >= 1, "
                f"got {self.num_new_tokens!r}"
            )
        if not is_nonnegative_int(self.encoder_len):
            raise InvalidArgumentError(
                f"request {self.req_id!r}: encoder_len must be an int >= 0, got {self.encoder_len!r}"
            )


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """What ``begin_step`` decided.

    Attributes:
        order: request ids in batch order; the step's tokens must be laid out in it.
        query_lens: new tokens per request, in ``order``.
        num_tokens: total tokens of the step.
        encoder_order: requests whose encoder K/V are written this step, in order.
    """

    order: tuple[str, ...]
    query_lens: tuple[int, ...]
    num_tokens: int
    encoder_order: tuple[str, ...]

    def token_slices(self) -> dict[str, slice]:
        """Request id -> the rows of the step's token tensors that belong to it."""
        slices: dict[str, slice] = {}
        start = 0
        for rid, n in zip(self.order, self.query_lens, strict=True):
            slices[rid] = slice(start, start + n)
            start += n
        return slices


@dataclasses.dataclass(frozen=True)
class RoutingRow:
    """One line of the routing table: layer -> kind -> group -> backend."""

    layer: str
    kind: KVCacheSpecKind
    group_id: int
    backend: str
    source: str


@dataclasses.dataclass(frozen=True)
class GroupMemory:
    """One group's share of the KV cache (a row of ``MemoryReport.groups``).

    Attributes:
        group_id, kind, backend: as in the routing table.
        layout: the cache layout its backend declares (``AttentionBackend.kv_cache_layout``).
        buffer_set: the set of layer buffers its layers view (``"page_major"`` or
            ``"planes"``); ``None`` for a group that keeps no cache (encoder-only).
        num_layers: its layers.
        bytes: what its layers' views span, ``num_layers * num_blocks * page``; shared
            with the other groups of its set (the set's bytes count once in
            ``MemoryReport.total_bytes``).
    """

    group_id: int
    kind: KVCacheSpecKind
    backend: str
    layout: KVCacheLayout
    buffer_set: BufferSetName | None
    num_layers: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Where the KV cache's bytes go (``AttentionRuntime.memory_report()``).

    Groups of one buffer set alias its layer buffers (block ownership keeps them
    apart); page-major and planes views cannot alias each other, so a model whose
    groups use both sets pays for both.

    Attributes:
        num_blocks, page_size_bytes: the pool's geometry (null block included).
        groups: one row per group, in group order.
        buffers: buffer set -> its layer buffers (sets in use only).
        set_bytes: buffer set -> its bytes, ``buffers * num_blocks * page``.
        total_bytes: the cache's bytes, the sum of ``set_bytes``.
        extra_bytes: what a second set costs at this ``num_blocks``: ``total_bytes``
            minus one set of the larger buffer count (0 with one set).
        num_blocks_one_set: blocks the same budget would hold if every group shared
            one set (``num_blocks`` when there is one set).
    """

    num_blocks: int
    page_size_bytes: int
    groups: tuple[GroupMemory, ...]
    buffers: Mapping[BufferSetName, int]
    set_bytes: Mapping[BufferSetName, int]
    total_bytes: int
    extra_bytes: int
    num_blocks_one_set: int

    def describe(self) -> str:
        """The report as text (what the runtime logs at construction)."""
        lines = [
            f"KV cache: {self.total_bytes} B = {self.num_blocks} blocks x page "
            f"{self.page_size_bytes} B x {sum(self.buffers.values())} layer buffer(s) "
            f"in {len(self.buffers)} set(s)"
        ]
        for g in self.groups:
            where = (
                f"buffer set {g.buffer_set}, {g.bytes} B in {g.num_layers} view(s)"
                if g.buffer_set is not None
                else "no cache"
            )
            lines.append(
                f"  group {g.group_id} ({g.kind.value}, backend {g.backend}, "
                f"{g.num_layers} layer(s)): layout {g.layout}, {where}"
            )
        for name, count in self.buffers.items():
            lines.append(f"  set {name}: {count} buffer(s), {self.set_bytes[name]} B")
        if self.extra_bytes:
            lines.append(
                f"  page-major and planes views cannot alias: the second set costs "
                f"{self.extra_bytes} B; one shared set would hold {self.num_blocks_one_set} "
                f"blocks in this budget instead of {self.num_blocks}"
            )
        return "\n".join(lines)


@dataclasses.dataclass
class _Group:
    group: KVCacheGroup
    selection: Selection
    binding: AnyBinding
    builder: AttentionMetadataBuilder[Any, Any]
    metadata: Any = None
    common: CommonAttentionMetadata | None = None


class AttentionRuntime:
    """Drives attention for a model through attnkit's groups, backends and cache.

    Args:
        layer_specs: layer name -> its cache spec, in model order.
        config: backend choices.
        device: the compute device.
        memory_budget_bytes: bytes for the KV cache; ``num_blocks`` follows.
        layer_params: layer name -> ``AttentionLayerParams`` / ``Mamba2LayerParams``;
            attention layers default to ``AttentionLayerParams(num_heads=num_kv_heads)``.
        registry, capability, priority: passed to ``select_backend``.
        cache_fill: fill the cache at allocation (tests pass ``float("nan")`` so a
            kernel that reads an unwritten slot is caught); ``None`` leaves it as is.
        context_parallel: make this runtime one rank of a decode context-parallel
            group (``attnkit.parallel``): the caches of context-sharded kinds
            (``KindRules.context_sharded``)
            hold this rank's share of every request's tokens, their groups are served
            by backends with the ``context_parallel`` feature, and each such layer's
            ``forward`` merges the ranks' partial results (one all-gather). Every rank
            must make the same calls with the same inputs. ``None``: one device.

    Backends are selected first, then the pool is sized for the buffer sets their
    cache layouts need (``kv_cache``, "Memory"), then the cache is allocated; the
    ``memory_report()`` is logged once (``attnkit.runtime``, INFO).

    Raises:
        NoBackendError / BackendNotSupportedError: a group cannot be served.
        ValueError: bad specs, params or budget (the message names which).
    """

    def __init__(
        self,
        layer_specs: Mapping[str, KVCacheSpec],
        config: AttentionConfig,
        *,
        device: torch.device | str,
        memory_budget_bytes: int,
        layer_params: Mapping[str, LayerParams] | None = None,
        registry: BackendRegistry | None = None,
        capability: tuple[int, int] | None = None,
        priority: Mapping[str, Sequence[str]] | None = None,
        cache_fill: float | None = None,
        context_parallel: ContextParallel | None = None,
    ) -> None:
        _check_constructor_args(layer_specs, config, layer_params, memory_budget_bytes, cache_fill)
        cp: object = context_parallel
        if cp is not None and not isinstance(cp, ContextParallel):
            raise ArgumentTypeError(
                f"context_parallel must be a ContextParallel or None, got {type(cp).__name__}"
            )
        self.context_parallel = context_parallel
        self._cp_step = 0
        self.device = parse_device(device)
        check_device_available(self.device)
        self.config = config
        params = dict(layer_params or {})
        unknown = sorted(set(params) - set(layer_specs))
        if unknown:
            raise InvalidArgumentError(
                f"layer_params names layers that layer_specs lacks: {unknown}; "
                f"layers: {', '.join(layer_specs)}"
            )
        groups, self.page_size_bytes = unified_groups(layer_specs)
        self.layer_params: dict[str, LayerParams | None] = {
            name: params.get(name, default_layer_params(spec)) for name, spec in layer_specs.items()
        }
        for name, spec in layer_specs.items():
            _check_params(name, spec, self.layer_params[name])
        self._groups: list[_Group] = []
        self._layer_group: dict[str, int] = {}
        # Select first (selection does not depend on the pool's size), then size the
        # pool for the buffer sets the backends' layouts need, then shapes and buffers.
        # Groups whose cache is sharded across the context-parallel ranks.
        self._sharded: frozenset[int] = frozenset(
            g.group_id
            for g in groups
            if context_parallel is not None
            and context_parallel.world_size > 1
            and rules_for(g.spec).context_sharded
        )
        for group in groups:
            layer_params_of_group = [self.layer_params[n] for n in group.layer_names]
            features = group_features(layer_params_of_group)
            if group.group_id in self._sharded:
                features |= {AttentionFeature.CONTEXT_PARALLEL}
            selection = select_backend(
                group.spec,
                config,
                device=self.device,
                capability=capability,
                features=features,
                num_heads=group_num_heads(layer_params_of_group),
                registry=registry,
                priority=priority,
            )
            binding = selection.backend.get_binding(group.spec)
            builder = binding.create(group.spec, group.layer_names, config, self.device)
            self._groups.append(_Group(group, selection, binding, builder))
            for name in group.layer_names:
                self._layer_group[name] = group.group_id
        self.layouts: dict[int, KVCacheLayout] = {
            e.group.group_id: e.selection.backend.kv_cache_layout for e in self._groups
        }
        """Group id -> the cache layout its backend declared."""
        self.memory_budget_bytes = memory_budget_bytes
        self.num_blocks = num_blocks_for_budget(
            groups, self.page_size_bytes, memory_budget_bytes, self.layouts
        )
        shapes: dict[int, tuple[tuple[int, ...], ...]] = {
            e.group.group_id: (
                e.selection.backend.get_kv_cache_shapes(self.num_blocks, e.group.spec)
                if e.group.has_cache
                else ()
            )
            for e in self._groups
        }
        self._attention_impls: dict[str, AttentionImpl[Any, Any, Any]] = {}
        self._state_impls: dict[str, StateImpl[Any, Any, Any]] = {}
        for entry in self._groups:
            for name in entry.group.layer_names:
                impl = entry.binding.create_impl(entry.group.spec, self.layer_params[name])
                if isinstance(impl, StateImpl):
                    self._state_impls[name] = impl
                elif isinstance(impl, AttentionImpl):
                    self._attention_impls[name] = impl
                else:
                    raise TypeError(
                        f"backend {entry.selection.backend_name!r} made a "
                        f"{type(impl).__name__} for {name!r}: impls must subclass "
                        f"AttentionImpl or StateImpl"
                    )
        # What each layer's forward takes, checked on every call before its backend runs.
        where = input_device(self.device)
        self._attention_inputs = {
            name: AttentionInputs(name, impl.kv_cache_spec, impl.layer_params, where)
            for name, impl in self._attention_impls.items()
        }
        self._state_inputs = {
            name: StateLayerInputs(name, impl.kv_cache_spec, impl.layer_params, where)
            for name, impl in self._state_impls.items()
        }
        self.kv_caches = allocate_kv_cache_tensors(
            groups,
            shapes,
            num_blocks=self.num_blocks,
            page_size_bytes=self.page_size_bytes,
            device=self.device,
            fill=cache_fill,
            layouts=self.layouts,
        )
        _LOG.info("%s", self.memory_report().describe())
        self._rules_of: dict[int, KindRules[Any]] = {g.group_id: rules_for(g.spec) for g in groups}
        if context_parallel is not None:
            for gid in self._sharded:
                self._rules_of[gid] = ShardedRules(
                    self._rules_of[gid], context_parallel.rank, context_parallel.world_size
                )
        self.manager = KVCacheManager(
            groups, self.num_blocks, rules=[self._rules_of[g.group_id] for g in groups]
        )
        thresholds = {
            t for e in self._groups if (t := e.binding.reorder_batch_threshold) is not None
        }
        self._thresholds = tuple(sorted(thresholds))
        self._reads_encoder = any(rules_for(g.spec).writes == "encoder" for g in groups)
        # One admission check per kind (rules objects are shared per kind).
        self._kind_rules = list({id(r): r for r in self._rules_of.values()}.values())
        self._step: StepBatch | None = None
        self._encoder_tokens = 0  # the encoder tokens cross-attention layers write this step
        self._stale: str | None = "forward() called before begin_step()"
        self._step_rows_version = -1
        self._last_ids: list[str] = []
        self._last_rows: Ints = np.zeros(0, dtype=np.int64)
        self._last_rows_version = -1

    # ------------------------------------------------------------------ introspection

    @property
    def groups(self) -> tuple[KVCacheGroup, ...]:
        return tuple(e.group for e in self._groups)

    @property
    def selections(self) -> tuple[Selection, ...]:
        return tuple(e.selection for e in self._groups)

    def routing_table(self) -> list[RoutingRow]:
        """Every layer with its kind, group and backend, in model order."""
        rows = [
            RoutingRow(
                name, e.group.kind, e.group.group_id, e.selection.backend_name, e.selection.source
            )
            for e in self._groups
            for name in e.group.layer_names
        ]
        order = {name: i for i, name in enumerate(self.layer_params)}
        return sorted(rows, key=lambda r: order[r.layer])

    def memory_report(self) -> MemoryReport:
        """Each group's layout, buffer set and bytes, and what a second set costs."""
        page, blocks = self.page_size_bytes, self.num_blocks
        buffers = buffers_per_set(self.groups, self.layouts)
        set_bytes: dict[BufferSetName, int] = {
            name: count * blocks * page for name, count in buffers.items()
        }
        total = sum(set_bytes.values())
        largest = max(buffers.values(), default=0)
        extra = total - largest * blocks * page
        one_set = self.memory_budget_bytes // (largest * page) if extra else blocks
        rows = tuple(
            GroupMemory(
                group_id=e.group.group_id,
                kind=e.group.kind,
                backend=e.selection.backend_name,
                layout=self.layouts[e.group.group_id],
                buffer_set=(
                    buffer_set_of(self.layouts[e.group.group_id]) if e.group.has_cache else None
                ),
                num_layers=len(e.group.layer_names),
                bytes=len(e.group.layer_names) * blocks * page if e.group.has_cache else 0,
            )
            for e in self._groups
        )
        return MemoryReport(
            num_blocks=blocks,
            page_size_bytes=page,
            groups=rows,
            buffers=buffers,
            set_bytes=set_bytes,
            total_bytes=total,
            extra_bytes=extra,
            num_blocks_one_set=one_set,
        )

    def backend_for(self, layer_name: str) -> type[AttentionBackend]:
        return self._groups[self._group_id(layer_name)].selection.backend

    def metadata_for(self, layer_name: str) -> Any:
        """The backend metadata the current step built for ``layer_name``'s group.

        Raises:
            StaleStepError: no step yet, or requests of the step were freed since.
        """
        group = self._groups[self._group_id(layer_name)]
        self._check_step_live()
        return group.metadata

    def cudagraph_support(self) -> tuple[AttentionCGSupport, str]:
        """The model's CUDA-graph support: the minimum over its groups, and who limits it."""
        levels = [
            (
                e.binding.get_cudagraph_support(self.config, e.group.spec),
                f"group {e.group.group_id} ({e.group.kind.value}, backend {e.selection.backend_name})",
            )
            for e in self._groups
        ]
        level, who = min(levels, key=lambda item: item[0])
        return level, who

    def _group_id(self, layer_name: str) -> int:
        try:
            return self._layer_group[layer_name]
        except (KeyError, TypeError):  # TypeError: an unhashable name
            raise UnknownLayerError(
                f"unknown layer {layer_name!r}; layers: {', '.join(self._layer_group)}"
            ) from None

    # ------------------------------------------------------------------ per step

    def begin_step(
        self, scheduled: Sequence[ScheduledRequest], *, finished: Iterable[str] = ()
    ) -> StepBatch:
        """Free finished requests, make room for the scheduled ones, build all metadata.

        All or nothing: when it raises, nothing changed (finished requests included),
        so the same call can be retried.

        Raises:
            ArgumentTypeError: ``scheduled`` is not a sequence of ``ScheduledRequest``,
                or ``finished`` not an iterable of ids (a bare string is refused).
            UnknownRequestError: ``finished`` names a request that is not live.
            DuplicateRequestError: a request scheduled twice or finished twice.
            EngineLimitError: more requests than ``config.max_num_reqs``, more tokens
                than ``config.max_num_batched_tokens``, or a request longer than
                ``config.max_model_len``.
            InvalidArgumentError: an encoder-only request split over steps, a new
                cross-attention request without encoder tokens.
            OutOfBlocksError: the cache cannot hold the step.
        """
        finished = self._check_ids("finished", finished)
        _check_types(scheduled)
        ids: list[str] = list(map(_REQ_ID, scheduled))
        if self.context_parallel is not None:
            self._check_ranks_agree(scheduled, finished)
        # The steady state schedules the same requests as the last step: their rows
        # are known (and their ids unique) while no request gained or lost a row.
        cached = (
            not finished
            and self.manager.rows_version == self._last_rows_version
            and ids == self._last_ids
        )
        if not cached:
            _check_unique(ids)
        count = len(ids)
        limits = self.config
        if count > limits.max_num_reqs:
            raise EngineLimitError(
                f"the step schedules {count} requests; AttentionConfig.max_num_reqs="
                f"{limits.max_num_reqs} allows at most that many per step"
            )
        counts = np.fromiter(map(_NUM_NEW, scheduled), dtype=np.int64, count=count)
        step_tokens = int(counts.sum())
        if step_tokens > limits.max_num_batched_tokens:
            raise EngineLimitError(
                f"the step schedules {step_tokens} tokens; AttentionConfig."
                f"max_num_batched_tokens={limits.max_num_batched_tokens} allows at most "
                f"that many per step"
            )
        encoder = (
            np.fromiter(map(_ENCODER_LEN, scheduled), dtype=np.int64, count=count)
            if self._reads_encoder
            else np.zeros(count, dtype=np.int64)
        )
        # Not mutated below unless a request is new or finished (then not cached).
        rows = self._last_rows if cached else self.manager.lookup_rows(ids)
        given_ids, given_rows, version = ids, rows, self.manager.rows_version
        if finished:
            # Finished requests are freed only once the step is known to fit; an id
            # finished and scheduled again starts anew.
            gone = set(finished)
            for i, req_id in enumerate(ids):
                if req_id in gone:
                    rows[i] = -1
        lens = self.manager.step_lens(rows, counts, encoder)
        longest = int(lens.total.max()) if count else 0
        if longest > limits.max_model_len:
            index = int(lens.total.argmax())
            raise EngineLimitError(
                f"request {ids[index]!r} would reach {longest} tokens "
                f"({int(lens.computed[index])} cached + {int(lens.query[index])} new); "
                f"AttentionConfig.max_model_len={limits.max_model_len}"
            )
        for rules in self._kind_rules:
            problem = rules.admission_problems(lens)
            if problem is not None:
                index, why = problem
                raise InvalidArgumentError(f"request {ids[index]!r} {why}")
        if self._thresholds:
            # Stable: for every builder's threshold, continuing requests at or under it
            # come first. A new request is never a decode (nothing cached to extend).
            key = sum((lens.is_new | (lens.query > t)).astype(np.int64) for t in self._thresholds)
            order = np.argsort(key, kind="stable")
            if (order != np.arange(order.size)).any():
                ids = [ids[i] for i in order.tolist()]
                rows = rows[order]
                lens = StepLens(lens.computed[order], lens.query[order], lens.encoder[order])
        rows = self.manager.allocate_rows(ids, rows, lens, finished=finished)
        if self.manager.rows_version == version:  # no request gained or lost a row
            self._last_ids, self._last_rows = given_ids, given_rows
            self._last_rows_version = version
        shared = _SharedStep(lens, rows, self._to_device)
        try:
            for entry in self._groups:
                entry.common = self._common_metadata(entry.group, rows, lens, shared)
                entry.metadata = entry.builder.build(0, entry.common)
        except BaseException as exc:
            # The cache already holds the step (builders run on its tables): a builder
            # that fails here is a backend bug. No layer may run on half-built metadata.
            self._stale = (
                f"begin_step() failed while building metadata ({type(exc).__name__}: "
                f"{exc}); the step's blocks are allocated, call begin_step() again"
            )
            self._step_rows_version = self.manager.rows_version
            raise
        query_lens = tuple(lens.query.tolist())
        self._stale = None
        self._step_rows_version = self.manager.rows_version
        encoder_order: tuple[str, ...] = ()
        self._encoder_tokens = 0
        if self._reads_encoder:
            writers = np.flatnonzero(lens.is_new & (lens.encoder > 0))
            encoder_order = tuple(ids[int(i)] for i in writers)
            self._encoder_tokens = int(lens.encoder[writers].sum())
        self._step = StepBatch(
            order=tuple(ids),
            query_lens=query_lens,
            num_tokens=shared.num_tokens,
            encoder_order=encoder_order,
        )
        return self._step

    def _common_metadata(
        self, group: KVCacheGroup, rows: Ints, lens: StepLens, shared: _SharedStep
    ) -> CommonAttentionMetadata:
        """The group's view of the step (see "Per-group metadata" in docs/architecture.md)."""
        spec = group.spec
        rules = self._rules_of[group.group_id]
        num_reqs = rows.size
        if rules.has_cache and num_reqs:
            width = self.manager.step_width(group.group_id)
            persistent = self.manager.table_array(group.group_id)
            first = int(rows[0])
            if shared.rows_contiguous:
                # The batch holds consecutive rows in order (the steady state): a view of
                # the persistent table, no copy. Valid until the next begin_step.
                table = persistent[first : first + num_reqs, :width]
            else:
                table = persistent[rows, :width]
        else:
            # No request (a step that only finishes requests) or no cache: an empty
            # table, one column wide for cached kinds (state builders read column 0).
            table = np.zeros((num_reqs, 1 if rules.has_cache else 0), dtype=np.int32)
        # The kind writes its own slots (the step's tokens, the encoder's, a shard's).
        slots = rules.slot_mapping(spec, table, shared, lens)
        shard = rules.context_shard
        global_lens: torch.Tensor | None = None
        if shard is not None:
            global_lens = _from_numpy(rules.global_seq_lens(spec, lens).astype(np.int32))
        seq_cpu, max_seq_len = shared.seq_lens(rules.seq_lens(spec, lens))
        return CommonAttentionMetadata(
            query_start_loc=shared.query_start_loc_device,
            query_start_loc_cpu=shared.query_start_loc,
            seq_lens=self._to_device(seq_cpu),
            seq_lens_cpu=seq_cpu,
            num_reqs=num_reqs,
            num_actual_tokens=shared.num_tokens,
            max_query_len=shared.max_query_len,
            max_seq_len=max_seq_len,
            block_table_tensor=self._to_device(_from_numpy(table)),
            slot_mapping=self._to_device(_from_numpy(slots)),
            causal=rules.causal,
            num_computed_tokens_cpu=shared.computed,
            context_shard=shard,
            global_seq_lens_cpu=global_lens,
            validate=False,
        )

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the runtime's device, without a wait (``host_to_device``)."""
        if self.device.type == "cpu":
            return t
        return host_to_device(t, self.device)

    def _current_step(self) -> StepBatch:
        if self._step is None:
            raise StaleStepError("forward() called before begin_step()")
        return self._step

    def _check_step_live(self) -> None:
        """Raise ``StaleStepError`` unless the current step's metadata still holds."""
        if self._stale is None and self.manager.rows_version != self._step_rows_version:
            self._stale = (
                "requests gained or lost their cache since begin_step() (through the "
                "manager); call begin_step() again"
            )
        if self._stale is not None:
            raise StaleStepError(self._stale)

    def forward(
        self,
        layer_name: str,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one attention layer of the current step.

        query ``[T, Hq, D]`` (with ``layer_params.mla_projection``: the un-absorbed
        ``[T, Hq, N + P]``), key/value ``[T, Hkv, D]`` with the query's ``T`` (MLA: key
        the new latents ``[T, 1, D]``, value ``None`` or the same; cross-attention: the
        encoder states ``[E, Hkv, D]`` of ``StepBatch.encoder_order``, ``E`` their
        encoder tokens, or ``None`` when no request is new); ``T`` is at least the
        step's tokens (rows past them are padding). Every tensor has the spec's dtype
        and is on the runtime's device. Returns ``output`` ``[T, Hq, Dv]`` (``Dv`` is
        ``layer_params.v_head_size`` or the head size), a new tensor when ``None``.
        State layers take typed inputs: ``forward_state`` or ``state_layer``.

        The call is checked before any backend runs, so a rejected call changes
        nothing. Any strided view is accepted: a tensor whose last dimension is not
        unit-stride is copied once into a contiguous tensor (an ``output`` of that
        kind is written through a contiguous buffer); other views, such as slices of
        a fused QKV projection, reach the backend without a copy.

        Raises:
            ArgumentTypeError: ``layer_name`` is a state layer, or an argument is not a
                tensor.
            InvalidArgumentError: a tensor's rank, rows, sizes, dtype or device does
                not fit the layer and the step (the message names the argument).
            StaleStepError: no step yet, or the step's requests were freed since.
        """
        name: object = layer_name  # untyped callers may pass anything
        impl = self._attention_impls.get(layer_name) if isinstance(name, str) else None
        if impl is None:
            self._group_id(layer_name)  # unknown layers: the error lists the layers
            raise ArgumentTypeError(
                f"{layer_name} is a state layer: call forward_state({layer_name!r}, "
                f"{self._state_impls[layer_name].layer_params.inputs_type.__name__}(...))"
            )
        self._check_step_live()
        query, key, value, out, caller = self._attention_inputs[layer_name].check(
            query, key, value, output, self._current_step().num_tokens, self._encoder_tokens
        )
        entry = self._groups[self._layer_group[layer_name]]
        caches = self.kv_caches.get(layer_name, ())
        if entry.group.group_id not in self._sharded:
            result = impl.forward(query, key, value, caches, entry.metadata, out)
        else:
            result = self._forward_sharded(impl, query, key, value, caches, entry.metadata, out)
        return result if caller is None else copy_back(result, caller)

    def _forward_sharded(
        self,
        impl: AttentionImpl[Any, Any, Any],
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        caches: Sequence[torch.Tensor],
        metadata: Any,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """This rank's partial attention, then one all-gather of ``(output, lse)`` and the
        merge (``attnkit.parallel``)."""
        cp = self.context_parallel
        assert cp is not None  # only sharded groups come here
        n = self._current_step().num_tokens
        lse = torch.empty(query.shape[0], query.shape[1], dtype=torch.float32, device=query.device)
        partial = output.new_empty(output.shape)
        impl.forward_partial(query, key, value, caches, metadata, partial, lse)
        # Rows past the step's tokens (padding) are not exchanged.
        packed = torch.cat([partial[:n].float().flatten(1), lse[:n]], dim=1)
        gathered = cp.communicator.all_gather(packed)
        width = partial[:n].flatten(1).shape[1]
        shape = (n, *output.shape[1:])
        outs = [g[:, :width].reshape(shape) for g in gathered]
        lses = [g[:, width:] for g in gathered]
        merge_partials(outs, lses, output[:n])
        return output

    def _check_ranks_agree(
        self, scheduled: Sequence[ScheduledRequest], finished: Sequence[str]
    ) -> None:
        """All-gather this step's fingerprint; raise on every rank when they differ."""
        cp = self.context_parallel
        assert cp is not None
        schedule = [(r.req_id, r.num_new_tokens, r.encoder_len) for r in scheduled]
        mine = step_fingerprint(self._cp_step, schedule, finished)
        probe = torch.tensor([self._cp_step, mine], dtype=torch.int64, device=self.device)
        seen = [(int(t[0]), int(t[1])) for t in cp.communicator.all_gather(probe)]
        if len(set(seen)) != 1:
            steps = [s for s, _ in seen]
            odd = [r for r, fp in enumerate(seen) if fp != seen[cp.rank]]
            raise ContextParallelMismatchError(
                f"context-parallel rank {cp.rank} of {cp.world_size}: the ranks were given "
                f"different steps (step counters {steps}; ranks {odd} differ from this "
                f"one, which scheduled {schedule} and finished {sorted(finished)}); every "
                f"rank must call begin_step with the same requests in the same order"
            )
        self._cp_step += 1

    def forward_state(
        self, layer_name: str, inputs: StateInputs, *, output: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run one state layer of the current step with its type's inputs.

        ``inputs`` is the input class of the layer's type (``Mamba2Inputs``,
        ``GatedDeltaNetInputs``, ``LinearAttentionInputs``, ``ShortConvInputs``); the
        result has ``layer_params.output_shape(T)``. ``state_layer`` gives a handle
        whose ``forward`` the type checker checks too.

        Checked before any backend runs, as ``forward`` is: each field has the widths
        its type declares (``StateType.input_widths``) and at least the step's tokens
        as rows, the dtype the type asks for, and the runtime's device; the same
        stride rule applies (a field whose last dimension is not unit-stride is copied
        once).

        Raises:
            ArgumentTypeError: an attention layer, or inputs of another layer type.
            InvalidArgumentError: a field's rank, rows, widths, dtype or device, or the
                output's, does not fit (the message names ``inputs.<field>``).
            StaleStepError: no step yet, or the step's requests were freed since.
        """
        name: object = layer_name  # untyped callers may pass anything
        impl = self._state_impls.get(layer_name) if isinstance(name, str) else None
        if impl is None:
            self._group_id(layer_name)
            raise ArgumentTypeError(
                f"{layer_name} is an attention layer: call forward({layer_name!r}, query, key, value)"
            )
        self._check_step_live()
        inputs, out, caller = self._state_inputs[layer_name].check(
            inputs, output, self._current_step().num_tokens
        )
        entry = self._groups[self._layer_group[layer_name]]
        result = impl.forward(inputs, self.kv_caches.get(layer_name, ()), entry.metadata, out)
        return result if caller is None else copy_back(result, caller)

    def state_layer(self, layer_name: str, inputs_type: type[InputsT]) -> StateLayer[InputsT]:
        """A typed handle on a state layer: ``forward`` takes ``inputs_type`` only.

        Raises:
            TypeError: the layer is not a state layer taking ``inputs_type``.
        """
        impl = self._state_impls.get(layer_name)
        if impl is None:
            self._group_id(layer_name)
            raise ArgumentTypeError(f"{layer_name} is an attention layer, not a state layer")
        expected = impl.layer_params.inputs_type
        if inputs_type is not expected:
            raise ArgumentTypeError(
                f"{layer_name} is a {impl.kv_cache_spec.mamba_type} layer taking "
                f"{expected.__name__}, not {getattr(inputs_type, '__name__', inputs_type)}"
            )
        return StateLayer(self, layer_name, inputs_type)

    def free(self, req_ids: Iterable[str]) -> None:
        """Release finished requests now (``begin_step(finished=...)`` does the same).

        All or nothing: every id is checked before any is freed. Freeing a request of
        the current step makes the step's metadata stale: ``forward`` then raises
        ``StaleStepError`` instead of writing into blocks that are back in the pool.

        Raises:
            ArgumentTypeError: ``req_ids`` is a bare string or holds a non-string.
            UnknownRequestError: an id is not live (the message says whether it was
                already freed or never scheduled).
            DuplicateRequestError: an id given twice.
        """
        ids = self._check_ids("req_ids", req_ids)
        step = self._step
        for req_id in ids:
            self.manager.free_request(req_id)
        if step is not None and self._stale is None:
            hit = set(ids).intersection(step.order)
            if hit:
                self._stale = (
                    f"request(s) {sorted(hit)} of the current step were freed after "
                    f"begin_step(); its metadata would write into blocks back in the pool. "
                    f"Call begin_step() again"
                )
            else:  # unrelated requests: the step's metadata still holds
                self._step_rows_version = self.manager.rows_version

    def _check_ids(self, argument: str, req_ids: Iterable[str]) -> list[str]:
        """``req_ids`` as a list of live, distinct ids, or an error naming ``argument``."""
        given: object = req_ids  # untyped callers reach here too
        if isinstance(given, str | bytes) or not isinstance(given, Iterable):
            raise ArgumentTypeError(
                f"{argument} must be an iterable of request ids (e.g. a list of str), "
                f"got {req_ids!r}"
            )
        ids: list[object] = list(cast("Iterable[object]", given))
        for req_id in ids:
            if not isinstance(req_id, str):
                raise ArgumentTypeError(
                    f"{argument} must hold request ids (str), got {req_id!r} "
                    f"({type(req_id).__name__})"
                )
            if req_id not in self.manager:
                raise self.manager.unknown_request(req_id)
        checked = cast("list[str]", ids)
        if len(set(checked)) != len(checked):
            twice = sorted({r for r in checked if checked.count(r) > 1})
            raise DuplicateRequestError(f"{argument} names request(s) {twice} twice")
        return checked

    def block_table(self, layer_name: str, req_id: str) -> list[int]:
        """``req_id``'s blocks in ``layer_name``'s group (null entries are released blocks).

        Raises:
            UnknownLayerError / UnknownRequestError: an unknown layer or request.
        """
        return self.manager.block_table(self._group_id(layer_name), req_id)


@dataclasses.dataclass(frozen=True)
class StateLayer(Generic[InputsT]):
    """A state layer of a runtime, typed by the input class it takes.

    Made by ``AttentionRuntime.state_layer(name, Mamba2Inputs)``; passing another
    input class to ``forward`` is a type error (and a ``TypeError`` at run time).
    """

    runtime: AttentionRuntime
    layer_name: str
    inputs_type: type[InputsT]

    def forward(self, inputs: InputsT, *, output: torch.Tensor | None = None) -> torch.Tensor:
        """``runtime.forward_state(layer_name, inputs, output=output)``."""
        return self.runtime.forward_state(self.layer_name, inputs, output=output)


_REQ_ID = operator.attrgetter("req_id")
_NUM_NEW = operator.attrgetter("num_new_tokens")
_ENCODER_LEN = operator.attrgetter("encoder_len")


class _SharedStep(StepTokens):
    """What every group's metadata shares in a step: offsets, token positions, lengths."""

    def __init__(
        self, lens: StepLens, rows: Ints, to_device: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        n = rows.size
        self.rows_contiguous = bool(
            n and rows[-1] - rows[0] == n - 1 and (rows[1:] == rows[:-1] + 1).all()
        )
        qsl = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lens.query, out=qsl[1:])
        self.query_start_loc = _from_numpy(qsl)
        self.query_start_loc_device = to_device(self.query_start_loc)
        self.computed = _from_numpy(lens.computed.astype(np.int32))
        num_tokens = int(qsl[-1])
        if num_tokens == n:  # every request decodes one token (each has >= 1)
            self.max_query_len = 1 if n else 0
            super().__init__(_arange(n), lens.computed)
        else:
            self.max_query_len = int(lens.query.max())
            # Request index and (unshifted) position of every token of the step.
            super().__init__(*spans(lens.query, lens.computed))
        self._seq: list[tuple[Ints, torch.Tensor, int]] = []

    def seq_lens(self, values: Ints) -> tuple[torch.Tensor, int]:
        """``values`` as an int32 CPU tensor and its maximum, made once per array per step
        (groups of the same kind rules share the step's ``total`` array)."""
        for array, tensor, largest in self._seq:
            if array is values:
                return tensor, largest
        tensor = _from_numpy(values.astype(np.int32))
        largest = int(values.max()) if values.size else 0
        self._seq.append((values, tensor, largest))
        return tensor, largest


_ARANGE: list[Ints] = [np.arange(1024)]
_ARANGE[0].flags.writeable = False


def _arange(n: int) -> Ints:
    """``np.arange(n)`` as a read-only view of a cached array (decode steps use it)."""
    if n > _ARANGE[0].size:
        grown = np.arange(max(n, 2 * _ARANGE[0].size))
        grown.flags.writeable = False
        _ARANGE[0] = grown
    return _ARANGE[0][:n]


def _check_constructor_args(
    layer_specs: object,
    config: object,
    layer_params: object,
    memory_budget_bytes: object,
    cache_fill: object,
) -> None:
    """The runtime's arguments, by type, before anything is built (untyped callers)."""
    if not isinstance(layer_specs, Mapping) or not layer_specs:
        raise ArgumentTypeError(
            f"layer_specs must be a non-empty mapping of layer name -> KVCacheSpec, got "
            f"{layer_specs!r}"
        )
    for name, spec in cast("Mapping[object, object]", layer_specs).items():
        if not isinstance(name, str) or not isinstance(spec, KVCacheSpec):
            raise ArgumentTypeError(
                f"layer_specs must map layer names (str) to KVCacheSpec, got "
                f"{name!r}: {type(spec).__name__}"
            )
    if not isinstance(config, AttentionConfig):
        raise ArgumentTypeError(
            f"config must be an AttentionConfig, got {type(config).__name__} "
            f"(build one with AttentionConfig(...) or AttentionConfig.model_validate(...))"
        )
    if layer_params is not None and not isinstance(layer_params, Mapping):
        raise ArgumentTypeError(
            f"layer_params must be a mapping of layer name -> LayerParams or None, got "
            f"{type(layer_params).__name__}"
        )
    if not is_positive_int(memory_budget_bytes):
        raise InvalidArgumentError(
            f"memory_budget_bytes must be a positive int, got {memory_budget_bytes!r}"
        )
    if cache_fill is not None and (
        not isinstance(cache_fill, int | float) or isinstance(cache_fill, bool)
    ):
        raise ArgumentTypeError(f"cache_fill must be a float or None, got {cache_fill!r}")


def _check_types(scheduled: Sequence[ScheduledRequest]) -> None:
    """``scheduled`` must be a sequence whose entries are ``ScheduledRequest`` (or a
    subclass): their own checks ran."""
    given_object: object = scheduled  # untyped callers reach here too
    if not isinstance(given_object, Sequence) or isinstance(given_object, str | bytes):
        raise ArgumentTypeError(
            f"scheduled must be a sequence (e.g. a list) of ScheduledRequest, got "
            f"{type(given_object).__name__}"
            + (" (wrap it in a list)" if isinstance(given_object, ScheduledRequest) else "")
        )
    types = set(map(type, scheduled)) - {ScheduledRequest}
    if types and not all(issubclass(t, ScheduledRequest) for t in types):
        given: Sequence[object] = scheduled  # untyped callers reach here too
        bad = next(r for r in given if not isinstance(r, ScheduledRequest))
        raise ArgumentTypeError(f"scheduled must hold ScheduledRequest objects, got {bad!r}")


def _check_unique(ids: list[str]) -> None:
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        for req_id in ids:
            if req_id in seen:
                raise DuplicateRequestError(f"request {req_id!r} is scheduled twice in one step")
            seen.add(req_id)


def default_layer_params(spec: KVCacheSpec) -> LayerParams | None:
    """The params a layer gets when the engine passes none: attention layers
    ``AttentionLayerParams(num_heads=num_kv_heads)``, state layers none."""
    if isinstance(spec, AttentionSpec):
        return AttentionLayerParams(num_heads=spec.num_kv_heads)
    return None


def group_features(params: Sequence[LayerParams | None]) -> frozenset[AttentionFeature]:
    """The features a group's backend is asked for: the union over its layers' params
    (what ``AttentionRuntime`` and ``attnkit.planner`` pass to ``select_backend``)."""
    found: set[AttentionFeature] = set()
    for p in params:
        if isinstance(p, AttentionLayerParams):
            found |= p.features
    return frozenset(found)


def group_num_heads(params: Sequence[LayerParams | None]) -> int | None:
    """The query heads a group's backend is asked about: its first attention layer's."""
    heads = [p.num_heads for p in params if isinstance(p, AttentionLayerParams)]
    return heads[0] if heads else None


def _check_params(name: str, spec: KVCacheSpec, params: LayerParams | None) -> None:
    """A layer's params must fit its spec; each layer is checked (selection asks once per group)."""
    if isinstance(spec, AttentionSpec):
        if not isinstance(params, AttentionLayerParams):
            raise InvalidArgumentError(
                f"layer_params[{name!r}] must be AttentionLayerParams for a {type(spec).__name__}, "
                f"got {type(params).__name__}"
            )
        if params.num_heads % spec.num_kv_heads:
            raise InvalidArgumentError(
                f"layer_params[{name!r}].num_heads={params.num_heads} is not a multiple of the "
                f"spec's num_kv_heads={spec.num_kv_heads}"
            )
    elif isinstance(spec, MambaSpec):
        state_type = state_type_of(spec)
        layout = state_type.layout_problem(spec.shapes)
        if layout is not None:  # no backend could run it: said before any is selected
            raise InvalidArgumentError(f"layer_specs[{name!r}]: {layout}")
        expected: type[StateLayerParams] = state_type.params_type
        if not isinstance(params, expected):
            raise InvalidArgumentError(
                f"layer_params[{name!r}] must be {expected.__name__} for a {spec.mamba_type} "
                f"layer, got {type(params).__name__}"
            )
        if params.state_shapes != spec.shapes:
            raise InvalidArgumentError(
                f"layer_params[{name!r}].state_shapes={params.state_shapes} do not match the "
                f"spec's shapes={spec.shapes}"
            )
