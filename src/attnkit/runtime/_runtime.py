"""``AttentionRuntime``: construction (groups, selection, builders, impls, the cache)
and introspection (routing, memory, CUDA-graph support, block tables), with the typed
state-layer handle ``StateLayer``. The per-step path is ``_step``, the layer calls
``_forward``."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from ..backend import AttentionBackend
from ..builder import AttentionCGSupport
from ..capabilities import AttentionFeature, KVCacheLayout
from ..config import AttentionConfig
from ..devices import check_device_available, parse_device
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..impl import AttentionImpl, StateImpl
from ..kinds import ShardedRules, rules_for
from ..kv_cache import (
    BufferSetName,
    CachedPool,
    KVCacheGroup,
    KVCacheManager,
    allocate_kv_cache_tensors,
    buffer_set_of,
    buffers_per_set,
    num_blocks_for_budget,
    shared_bytes_per_page,
    unified_groups,
)
from ..metadata import hosts_to_device
from ..offload import ConnectorStats, KVConnector
from ..parallel import ContextParallel
from ..params import LayerParams
from ..registry import BackendRegistry
from ..selector import Selection, select_backend
from ..spec import KVCacheSpec
from ..state_inputs import StateInputs
from ._base import _Group
from ._boundary import AttentionInputs, StateLayerInputs, input_device
from ._checks import (
    check_constructor_args,
    check_params,
    default_layer_params,
    group_features,
    group_num_heads,
)
from ._forward import LayerCalls
from ._mm_prefix import MMPrefixRanges
from ._offload import Offloader
from ._ops import register_runtime
from ._pages import PageSharing, TensorParallelRank, check_tensor_parallel, page_sharing
from ._prefix import PrefixCalls, group_namespaces
from ._reports import GroupMemory, MemoryReport, RoutingRow
from ._spec import draft_state_bytes
from ._step import StepHost

InputsT = TypeVar("InputsT", bound=StateInputs)

# The package's logger (``attnkit.runtime``), the name the docs give.
_LOG = logging.getLogger("attnkit.runtime")


class AttentionRuntime(StepHost, LayerCalls, PrefixCalls):
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
        kv_connector: where evicted prefix-cache blocks and state checkpoints go
            (``attnkit.offload``: ``HostMemoryTier``, ``FileTier`` or an external
            store), and where a lookup loads them back from (docs/offload.md). Needs
            prefix caching on. ``None``: evicted blocks are gone.
        tensor_parallel: this process's tensor-parallel rank, for canonical page ids
            (``page_descriptors``; the connector's keys). ``None``: one device.

    With ``config.prefix_caching`` enabled, requests that share a prompt prefix share
    its cached blocks: ``match_prefix`` looks a prompt up, ``ScheduledRequest(...,
    prefix=match)`` starts a request from its hit, ``free(..., token_ids=...)`` caches
    its generated blocks too (docs/prefix-caching.md, "The runtime").

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
        kv_connector: KVConnector | None = None,
        tensor_parallel: TensorParallelRank | None = None,
    ) -> None:
        check_constructor_args(layer_specs, config, layer_params, memory_budget_bytes, cache_fill)
        connector: object = kv_connector
        if connector is not None and not isinstance(connector, KVConnector):
            raise ArgumentTypeError(
                f"kv_connector must be a KVConnector (attnkit.offload) or None, got "
                f"{type(connector).__name__}"
            )
        if kv_connector is not None and not config.prefix_caching.enabled:
            raise InvalidArgumentError(
                "kv_connector needs prefix caching (evicted blocks are found again by their "
                "names): build the runtime with AttentionConfig(prefix_caching={'enabled': "
                "True}), or pass kv_connector=None"
            )
        self.tensor_parallel = check_tensor_parallel(tensor_parallel)
        cp: object = context_parallel
        if cp is not None and not isinstance(cp, ContextParallel):
            raise ArgumentTypeError(
                f"context_parallel must be a ContextParallel or None, got {type(cp).__name__}"
            )
        self.context_parallel = context_parallel
        self._cp_step = 0
        self.device = parse_device(device)
        check_device_available(self.device)
        self._send_to_device = (
            None
            if self.device.type == "cpu"
            else functools.partial(hosts_to_device, device=self.device)
        )
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
            check_params(name, spec, self.layer_params[name])
        self._groups = []
        self._layer_group = {}
        # Select first (selection does not depend on the pool's size), then size the
        # pool for the buffer sets the backends' layouts need, then shapes and buffers.
        # Groups whose cache is sharded across the context-parallel ranks.
        self._sharded = frozenset(
            g.group_id
            for g in groups
            if context_parallel is not None
            and context_parallel.world_size > 1
            and rules_for(g.spec).context_sharded
        )
        self._table_group = {
            g.group_id: g.group_id if g.block_owner is None else g.block_owner for g in groups
        }
        shared = [g for g in groups if g.block_owner is not None]
        if shared and context_parallel is not None and context_parallel.world_size > 1:
            g = shared[0]
            raise InvalidArgumentError(
                f"context_parallel: group {g.group_id} ({g.kind.value}, layer "
                f"{g.layer_names[0]!r}) shares the block ids of group {g.block_owner}, whose "
                f"cache decode context parallelism would shard over {context_parallel.world_size} "
                f"ranks while its own stays whole; DeepSeek sparse attention does not run "
                f"with context parallelism: pass context_parallel=None"
            )
        if self._sharded and config.prefix_caching.enabled:
            raise InvalidArgumentError(
                "config.prefix_caching: prefix caching does not run with decode context "
                "parallelism (a rank's blocks hold every n-th token, so no prefix ever "
                "hits); turn one of them off"
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
        # The state layers' draft buffers (speculative decoding) come out of the budget.
        self.draft_state_bytes = draft_state_bytes(
            groups, config.num_speculative_tokens, config.max_num_reqs
        )
        if self.draft_state_bytes >= memory_budget_bytes:
            raise InvalidArgumentError(
                f"memory_budget_bytes={memory_budget_bytes} does not hold the state layers' "
                f"draft buffers ({self.draft_state_bytes} B for AttentionConfig."
                f"num_speculative_tokens={config.num_speculative_tokens} x max_num_reqs="
                f"{config.max_num_reqs}); raise the budget or lower either"
            )
        self.num_blocks = num_blocks_for_budget(
            groups, self.page_size_bytes, memory_budget_bytes - self.draft_state_bytes, self.layouts
        )
        # Backends see kernel blocks: a page of the pool holds blocks_per_page of them.
        shapes: dict[int, tuple[tuple[int, ...], ...]] = {
            e.group.group_id: (
                e.selection.backend.get_kv_cache_shapes(
                    self.num_blocks * e.group.blocks_per_page, e.group.spec
                )
                if e.group.has_cache
                else ()
            )
            for e in self._groups
        }
        self._attention_impls = {}
        self._state_impls = {}
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
        self._allocate_draft_states()
        self._verify = None
        _LOG.info("%s", self.memory_report().describe())
        self._rules_of = {g.group_id: rules_for(g.spec) for g in groups}
        if context_parallel is not None:
            for gid in self._sharded:
                self._rules_of[gid] = ShardedRules(
                    self._rules_of[gid], context_parallel.rank, context_parallel.world_size
                )
        caching = config.prefix_caching
        # The manager keeps the tables of the groups that own their blocks (they come
        # first); a group sharing an owner's block ids reads the owner's.
        owning = [g for g in groups if g.block_owner is None]
        self.manager = KVCacheManager(
            owning,
            self.num_blocks,
            rules=[self._rules_of[g.group_id] for g in owning],
            prefix_caching=caching if caching.enabled else None,
            table_hint=(config.max_num_reqs, config.max_model_len),
            namespaces=(
                group_namespaces(
                    groups,
                    self.layer_params,
                    self.layouts,
                    revision=caching.model_revision,
                    hash_name=caching.hash,
                )[: len(owning)]
                if caching.enabled
                else None
            ),
        )
        if self.manager.prefix is not None:
            self.manager.prefix.copy_states = self._copy_states
        self._offloader = None
        if kv_connector is not None:
            self._offloader = self._attach_connector(kv_connector)
        thresholds = {
            t for e in self._groups if (t := e.binding.reorder_batch_threshold) is not None
        }
        self._thresholds = tuple(sorted(thresholds))
        self._reads_encoder = any(rules_for(g.spec).writes == "encoder" for g in groups)
        # Groups whose layers take image ranges (AttentionSpec.mm_prefix), and the
        # requests' ranges when some group does.
        self._mm_groups = frozenset(
            g.group_id for g in groups if rules_for(g.spec).mask(g.spec).mm_prefix
        )
        self._mm = (
            MMPrefixRanges(config.max_mm_prefix_ranges, config.max_model_len)
            if self._mm_groups
            else None
        )
        # One admission check per kind (rules objects are shared per kind).
        self._kind_rules = list({id(r): r for r in self._rules_of.values()}.values())
        self._step = None
        self._encoder_tokens = 0  # the encoder tokens cross-attention layers write this step
        self._stale = "forward() called before begin_step()"
        self._step_rows_version = -1
        self._last_ids = []
        self._last_rows = np.zeros(0, dtype=np.int64)
        self._last_rows_version = -1
        self._contiguous_rows = None  # the last step's rows (and their contiguity)
        self._last_contiguous = False
        self._decode_qsl = None  # 0..B, the offsets of a step of B one-token queries
        self._last_shared = None  # the last step's shared arrays (a run's step reuses them)
        # Groups whose slots are the kinds' default (a token's block and offset in it):
        # every token has one (CommonAttentionMetadata.slots_written), and in the
        # steady decode state a step's slots are the last step's, plus one.
        self._slot_steps = frozenset(
            gid for gid, rules in self._rules_of.items() if rules.keeps_default("slot_mapping")
        )
        self._decode_slots = {}  # group id -> (manager step serial, a decode step's slots)
        # The name torch.ops.attnkit.runtime_forward knows this runtime by (_ops).
        self._op_name = register_runtime(self)

    def _attach_connector(self, connector: KVConnector) -> Offloader:
        """Offload every group that names blocks (or keeps checkpoints) to ``connector``:
        the pool hands its evicted blocks to the ``Offloader``, lookups load from it."""
        manager, prefix = self.manager, self.manager.prefix
        assert prefix is not None
        layers: dict[int, tuple[str, ...]] = {}
        blocks: dict[int, int] = {}
        namespaces: dict[int, bytes] = {}
        sharing: dict[int, PageSharing] = {}
        for group in self.groups[: len(manager.groups)]:
            gid = group.group_id
            keeper = manager.cached_slabs[gid] or manager.checkpoint_stores[gid]
            if keeper is None:
                continue
            # A page carries the bytes of the groups sharing its block ids too.
            layers[gid] = self._block_layers(gid)
            blocks[gid] = self.num_blocks * group.blocks_per_page
            namespaces[gid] = keeper.namespace
            sharing[gid] = page_sharing(
                group.spec, self.tensor_parallel, context_sharded=gid in self._sharded
            )
            keeper.offload_gid = gid
        offloader = Offloader(
            connector, self.kv_caches, layers, blocks, namespaces, sharing, prefix.counters
        )
        pool = manager.pool
        assert isinstance(pool, CachedPool)
        pool.offload_sink = offloader.save
        prefix.offload = offloader
        return offloader

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
        """Each group's layout, buffer set and bytes, and what a second set costs; with
        prefix caching on, the blocks each group's cache keeps named (and how many of
        them no request holds)."""
        page, blocks = self.page_size_bytes, self.num_blocks
        buffers = buffers_per_set(self.groups, self.layouts)
        set_bytes: dict[BufferSetName, int] = {
            name: count * blocks * page for name, count in buffers.items()
        }
        # The groups sharing an owner's block ids keep buffers of their own.
        shared = shared_bytes_per_page(self.groups)
        total = sum(set_bytes.values()) + blocks * shared
        largest = max(buffers.values(), default=0)
        extra = total - largest * blocks * page - blocks * shared
        one_set = self.memory_budget_bytes // (largest * page + shared) if extra else blocks
        rows = tuple(
            GroupMemory(
                group_id=e.group.group_id,
                kind=e.group.kind,
                backend=e.selection.backend_name,
                layout=self.layouts[e.group.group_id],
                block_size=e.group.spec.block_size if e.group.has_cache else None,
                blocks_per_page=e.group.blocks_per_page,
                buffer_set=(
                    buffer_set_of(self.layouts[e.group.group_id]) if e.group.has_cache else None
                ),
                num_layers=len(e.group.layer_names),
                bytes=(
                    0
                    if not e.group.has_cache
                    else len(e.group.layer_names) * blocks * page
                    if e.group.block_owner is None
                    else blocks * shared_bytes_per_page([e.group])
                ),
                block_owner=e.group.block_owner,
                **self._cached_memory(e.group),
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
            draft_state_bytes=self.draft_state_bytes,
            offload=self._offload_stats(),
        )

    def _offload_stats(self) -> ConnectorStats | None:
        """The connector's stats (the runtime logs a report before it is attached)."""
        offloader: Offloader | None = getattr(self, "_offloader", None)
        return None if offloader is None else offloader.stats()

    def _copy_states(self, group_id: int, sources: list[int], destinations: list[int]) -> None:
        """Copy state pages ``sources`` to ``destinations`` in every state tensor of
        every layer of group ``group_id`` (state checkpoints: taken and restored)."""
        offloader = self._offloader
        if offloader is not None and offloader.needs_fence:
            offloader.fence()  # a destination may be a page just evicted: copied out first
        src = torch.tensor(sources, dtype=torch.long, device=self.device)
        dst = torch.tensor(destinations, dtype=torch.long, device=self.device)
        for name in self._groups[group_id].group.layer_names:
            for tensor in self.kv_caches[name]:
                tensor.index_copy_(0, dst, tensor.index_select(0, src))

    def _cached_memory(self, group: KVCacheGroup) -> dict[str, int]:
        """A group's ``GroupMemory`` prefix-cache fields (none when it caches nothing;
        the manager is not made yet when the runtime logs its first report)."""
        manager: KVCacheManager | None = getattr(self, "manager", None)
        if manager is None or manager.prefix is None or group.block_owner is not None:
            return {}  # (a group sharing an owner's block ids: its names are the owner's)
        if manager.prefix.needs_flush:
            manager.prefix.flush()
        store = manager.checkpoint_stores[group.group_id]
        if store is not None:  # a state group's checkpoints: one page each
            return {
                "cached_blocks": len(store.name_of),
                "cached_free_blocks": store.num_free(),
                "cached_bytes": len(store.name_of) * self.page_size_bytes * len(group.layer_names),
            }
        slab = manager.cached_slabs[group.group_id]
        if slab is None:
            return {}
        named = len(slab.name_of)
        block_bytes = self.page_size_bytes // group.blocks_per_page
        # A named block holds the rows of the groups sharing its ids too (their own
        # buffers, one kernel block of their page per layer).
        beside = sum(
            e.group.spec.page_size_bytes * len(e.group.layer_names)
            for e in self._groups
            if e.group.block_owner == group.group_id
        )
        return {
            "cached_blocks": named,
            "cached_free_blocks": slab.num_cached_free(),
            "cached_bytes": named * (block_bytes * len(group.layer_names) + beside),
        }

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

    def block_table(self, layer_name: str, req_id: str) -> list[int]:
        """``req_id``'s blocks in ``layer_name``'s group (null entries are released blocks).

        Raises:
            UnknownLayerError / UnknownRequestError: an unknown layer or request.
        """
        return self.manager.block_table(self._table_gid(layer_name), req_id)


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
