"""``plan_model``: a model's groups, their backends and costs, and what fits in a
budget, on one device and per rank."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .._validation import is_positive_int
from ..capabilities import KVCacheLayout
from ..config import AttentionConfig
from ..devices import parse_device
from ..errors import ArgumentTypeError, InvalidArgumentError, NoBackendError, Rejection
from ..kinds import rules_for
from ..kv_cache import (
    buffers_per_set,
    num_blocks_for_budget,
    shared_bytes_per_page,
    unified_groups,
)
from ..models import LayerInfo, ModelLayout
from ..params import LayerParams
from ..prefix_cache import checkpoint_interval_for, prefix_granularity
from ..registry import BackendRegistry
from ..runtime import default_layer_params, draft_state_bytes, group_features, group_num_heads
from ..selector import Selection, select_backend
from ..spec import KVCacheSpec, MambaSpec
from ._capacity import _group_costs
from ._per_rank import _rank_plan
from ._types import GroupPlan, LayerPlan, ModelPlan, PrefixPlan


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
            its context (``ModelPlan.per_rank``; docs/parallel.md). Query heads
            split evenly; K/V heads split, or replicate when
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
        blocks, kernel, per_token, cap = _group_costs(group, config)
        planned.append(
            GroupPlan(group, selection, rejected, error, layout, blocks, kernel, per_token, cap, cg)
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
    drafts = draft_state_bytes(groups, config.num_speculative_tokens, config.max_num_reqs)
    if memory_bytes is not None:
        try:
            num_blocks = num_blocks_for_budget(groups, page, memory_bytes - drafts, layouts)
        except InvalidArgumentError:
            if per_rank.world_size == 1:
                raise
            # The budget is a rank's: the whole model on one device need not fit in it.
            num_blocks = None
    elif num_blocks is not None:
        memory_bytes = num_blocks * (page * sum(buffers.values()) + shared_bytes_per_page(groups))
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
        s.page_size_bytes // s.block_size
        for s in specs.values()
        if rules_for(s).counts_kv_per_token
    )
    state = sum(s.page_size_bytes for s in specs.values() if isinstance(s, MambaSpec))
    prefix = _prefix_plan([g.spec for g in groups], config, page * sum(buffers.values()))
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
        prefix=prefix,
        draft_state_bytes=drafts,
        shared_bytes_per_page=shared_bytes_per_page(groups),
    )


def _prefix_plan(specs: Sequence[KVCacheSpec], config: AttentionConfig, block: int) -> PrefixPlan:
    """The minimum cacheable prefix under the config's state checkpoint policy (and
    with checkpoints on, for a model with state groups), and a checkpoint's cost."""
    caching = config.prefix_caching
    state = sum(
        1
        for s in specs
        if rules_for(s).prefix_layout(s) is None and rules_for(s).prefix_never_hits(s) is None
    )
    natural = checkpoint_interval_for(specs) if state else None
    with_checkpoints = (
        prefix_granularity(specs, checkpoint_interval=natural).minimum if state else None
    )
    interval: int | None = None
    if state and caching.state_checkpoints != "none":
        interval = checkpoint_interval_for(specs, caching.checkpoint_interval)
    granularity = prefix_granularity(specs, checkpoint_interval=interval)
    minimum = granularity.minimum
    why = str(granularity.never) if granularity.never is not None else None
    if state and interval is None and minimum is not None:
        minimum = None
        why = (
            "state layers keep no checkpoints (prefix_caching.state_checkpoints is "
            "'none'), and every hit needs one in each state group"
        )
    return PrefixPlan(
        enabled=caching.enabled,
        state_checkpoints=caching.state_checkpoints,
        state_groups=state,
        checkpoint_interval=interval,
        minimum=minimum,
        why_none=why,
        minimum_with_checkpoints=with_checkpoints,
        checkpoint_bytes=state * block,
    )
