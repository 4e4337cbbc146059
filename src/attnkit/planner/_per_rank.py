"""The per-rank plan: each model group split over the tensor-parallel ranks (heads or
state), then the rank's groups built, unified and sized with the runtime's rules
(docs/parallel.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ..capabilities import KVCacheLayout
from ..config import AttentionConfig
from ..errors import InvalidArgumentError
from ..kinds import rules_for
from ..kv_cache import (
    KVCacheGroup,
    buffers_per_set,
    num_blocks_for_budget,
    shared_bytes_per_page,
    unified_groups,
)
from ..params import AttentionLayerParams, LayerParams
from ..spec import AttentionSpec, KVCacheSpec, MambaSpec
from ..state_types import state_type_of
from ._capacity import _max_context, _pages, _rank_kernel_blocks
from ._types import ContextPlacement, GroupSplit, RankGroupPlan, RankPlan

__all__ = ["_rank_plan"]  # plan_model's


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
    spec, where = group.spec, _where(group)
    rules = rules_for(spec)
    context: ContextPlacement = (
        "none" if not group.has_cache else "sharded" if rules.context_sharded else "replicated"
    )
    if isinstance(spec, MambaSpec):
        state, detail = _split_state(spec, tp, where)
        return GroupSplit(group.group_id, state, None, None, None, context, detail)
    assert isinstance(spec, AttentionSpec)  # a spec is an attention or a state spec
    heads: list[int] = []
    per_head_scales = False
    for name in group.layer_names:
        layer = params.get(name)
        if not isinstance(layer, AttentionLayerParams):
            continue
        per_head_scales = per_head_scales or layer.per_head_quant_scales
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
    # Per-head K/V scales go with their heads (rank_layer_params slices them so).
    scales = (
        f"; per-head K/V scales [{spec.num_kv_heads}] -> [{split.kv_heads}] per rank"
        if per_head_scales
        else ""
    )
    return GroupSplit(
        group.group_id,
        split.spec,
        query,
        split.kv_heads,
        split.kv_replicas,
        context,
        f"{shown}{split.detail}{scales}",
    )


def _splitting_sizes(
    groups: Sequence[KVCacheGroup], params: Mapping[str, LayerParams | None]
) -> list[int]:
    """The tensor-parallel sizes that split every group, up to the most query heads of
    a layer (a rank holds at least one; 64 for a model of state layers only)."""
    heads = [p.num_heads for p in params.values() if isinstance(p, AttentionLayerParams)]
    sizes: list[int] = []
    for tp in range(1, max(heads, default=64) + 1):
        try:
            for g in groups:
                _split_group(g, params, tp)
        except InvalidArgumentError:
            continue
        sizes.append(tp)
    return sizes


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
    try:
        splits = tuple(_split_group(g, params, tp) for g in groups)
    except InvalidArgumentError as exc:
        sizes = _splitting_sizes(groups, params)
        if not sizes:
            raise  # no size splits it (a state of a layout attnkit does not know)
        shown = ", ".join(map(str, sizes))
        raise InvalidArgumentError(
            f"{exc} (tensor_parallel sizes that split every layer of this model: {shown})"
        ) from None
    shared = [g for g in groups if g.block_owner is not None]
    if shared and cp > 1:
        g = shared[0]
        raise InvalidArgumentError(
            f"plan_model: context_parallel={cp}: {_where(g)}, of kind {g.kind.value}, shares "
            f"the block ids of group {g.block_owner}, whose cache decode context parallelism would "
            f"shard while its own stays whole; DeepSeek sparse attention does not run with "
            f"context parallelism (plan it with context_parallel=1)"
        )
    model_group = {name: g.group_id for g in groups for name in g.layer_names}
    rank_specs = {name: splits[model_group[name]].spec for name in specs}
    rank_groups, page = unified_groups(rank_specs)
    owners = {
        g.group_id: tuple(dict.fromkeys(model_group[n] for n in g.layer_names)) for g in rank_groups
    }
    # A rank's group runs the backend chosen for its (first) model group.
    rank_layouts: dict[int, KVCacheLayout] = {
        g.group_id: layouts[owners[g.group_id][0]] for g in rank_groups
    }
    planned: list[RankGroupPlan] = []
    for g in rank_groups:
        spec, layers = g.spec, len(g.layer_names)
        kernel = per_token = 0
        cap: int | None = None
        if g.has_cache:
            kernel = _rank_kernel_blocks(
                spec, config.max_model_len, config.max_num_batched_tokens, cp
            )
            if isinstance(spec, AttentionSpec):
                per_token = layers * spec.page_size_bytes // spec.block_size
                if rules_for(spec).bound(spec) is not None:
                    cap = kernel * spec.page_size_bytes * layers
        planned.append(
            RankGroupPlan(
                group=g,
                model_groups=owners[g.group_id],
                layout=rank_layouts[g.group_id],
                context_sharded=g.has_cache and rules_for(spec).context_sharded,
                # (a group sharing its owner's block ids holds no pages of its own)
                blocks_per_request=0
                if g.block_owner is not None
                else _pages(kernel, g.blocks_per_page),
                kernel_blocks_per_request=kernel,
                bytes_per_token=per_token,
                per_request_cap_bytes=cap,
            )
        )
    buffers = buffers_per_set(rank_groups, rank_layouts)
    if memory_bytes is not None:
        num_blocks = num_blocks_for_budget(rank_groups, page, memory_bytes, rank_layouts)
    elif num_blocks is not None:
        memory_bytes = num_blocks * (
            page * sum(buffers.values()) + shared_bytes_per_page(rank_groups)
        )
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
        shared_bytes_per_page=shared_bytes_per_page(rank_groups),
    )
