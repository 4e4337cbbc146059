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
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction

import torch

from ._validation import is_positive_int
from .builder import AttentionCGSupport
from .capabilities import KVCacheLayout
from .config import AttentionConfig
from .devices import parse_device
from .errors import ArgumentTypeError, InvalidArgumentError, NoBackendError, Rejection
from .kv_cache import (
    BufferSetName,
    KVCacheGroup,
    buffer_set_of,
    buffers_per_set,
    num_blocks_for_budget,
    unified_groups,
)
from .models import LayerInfo, ModelLayout
from .params import LayerParams
from .registry import BackendRegistry
from .runtime import default_layer_params, group_features, group_num_heads
from .selector import Selection, select_backend
from .spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

__all__ = [
    "PLAN_JSON_KEYS",
    "GroupPlan",
    "LayerPlan",
    "ModelPlan",
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
)
"""The top-level keys of ``ModelPlan.to_json()``, in the order it writes them."""


@dataclasses.dataclass(frozen=True)
class ModelPlan:
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
        num_blocks: the pool's blocks, the null block included (``None``: no budget).
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

    @property
    def bytes_per_block(self) -> int:
        """What one block id costs: a page in every layer buffer of every set."""
        return self.page_size_bytes * sum(self.buffers.values())

    @property
    def blocks_per_request(self) -> int:
        """The most blocks one request of ``max_model_len`` tokens holds, all groups."""
        return sum(g.blocks_per_request for g in self.groups)

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
        """Context tokens the pool holds at the per-request cost of ``max_model_len``
        tokens (``None`` without a budget, or when the model caches nothing)."""
        usable = self.usable_blocks
        if usable is None or self.blocks_per_request == 0:
            return None
        return usable * self.max_model_len // self.blocks_per_request

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
        bounded = isinstance(spec, SlidingWindowSpec | ChunkedLocalAttentionSpec)
        cap = blocks * spec.page_size_bytes * layers if bounded else None
        return blocks, per_token, cap
    return blocks, 0, None


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
            token or concurrency counts.

    Raises:
        ArgumentTypeError / InvalidArgumentError: bad arguments, or a budget that
            holds fewer than 2 blocks (the message says how many bytes 2 need).
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
    if memory_bytes is not None:
        num_blocks = num_blocks_for_budget(groups, page, memory_bytes, layouts)
    elif num_blocks is not None:
        memory_bytes = num_blocks * page * sum(buffers.values())
    group_of = {name: g.group_id for g in groups for name in g.layer_names}
    layers: list[LayerPlan] = []
    for name, spec in specs.items():
        layers.append(
            LayerPlan(
                name=name,
                kind=spec.kind.value,
                spec_class=type(spec).__name__,
                mamba_type=spec.mamba_type if isinstance(spec, MambaSpec) else None,
                sliding_window=(
                    spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
                ),
                attention_chunk_size=(
                    spec.attention_chunk_size
                    if isinstance(spec, ChunkedLocalAttentionSpec)
                    else None
                ),
                group=group_of[name],
            )
        )
    kv_per_token = sum(
        s.page_size_bytes // s.block_size
        for s in specs.values()
        if isinstance(s, AttentionSpec)
        and not isinstance(s, EncoderOnlyAttentionSpec | CrossAttentionSpec)
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
    )


def format_bytes(value: int) -> str:
    """``1073741824`` -> ``1.00 GiB``; below 1 KiB, ``512 B``."""
    scaled, unit = float(value), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if scaled < 1024:
            break
        scaled, unit = scaled / 1024, bigger
    return f"{value} B" if unit == "B" else f"{scaled:.2f} {unit}"
