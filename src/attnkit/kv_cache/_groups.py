"""Grouping and page-size unification: layers with equal specs share a ``KVCacheGroup``,
and every group's page is brought to the one unified page ``P``: an attention group's
page holds ``blocks_per_page`` kernel blocks of its declared block size, a state page
is padded (``attnkit.kv_cache``'s docstring states the rule)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from ..errors import InvalidArgumentError
from ..kinds import rules_for
from ..spec import AttentionSpec, KVCacheSpec, KVCacheSpecKind, MambaSpec

_ALIGN = 16  # byte alignment of each state tensor inside a page


@dataclasses.dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one spec, and so one block table per request.

    A group that shares another's block ids (``block_owner``) comes after every group
    that owns its blocks, so the block manager's groups are ``groups[:n]``.

    Attributes:
        group_id: index of the group.
        spec: the spec the layers declared, which the backends see: its ``block_size``
            is the kernel block size (the tokens of one block table entry).
        layer_names: the group's layers, in model order.
        blocks_per_page: kernel blocks in one page of the pool (``P /
            spec.page_size_bytes`` for an attention group once pages are unified; 1 for
            state groups, groups without cache and before unification). Kernel block
            ``j`` of page ``p`` is kernel block ``p * blocks_per_page + j``.
    """

    group_id: int
    spec: KVCacheSpec
    layer_names: tuple[str, ...]
    blocks_per_page: int = 1
    block_owner: int | None = None
    """The group whose block ids this one shares (its kind's ``shares_blocks_with``:
    DeepSeek sparse attention's indexer and its MLA group), else ``None``. Such a group
    allocates nothing: a request's table in it is the owner's table, and its layers'
    tensors, with their own page size, are indexed by the owner's kernel block ids
    (``blocks_per_page`` is the owner's)."""

    @property
    def kind(self) -> KVCacheSpecKind:
        return self.spec.kind

    @property
    def page_tokens(self) -> int:
        """Tokens one page holds in an attention group: ``blocks_per_page *
        block_size`` (for a state group, its spec's ``block_size``)."""
        return self.blocks_per_page * self.spec.block_size

    @property
    def has_cache(self) -> bool:
        """Whether the group keeps anything between steps (encoder-only layers do not)."""
        return rules_for(self.spec).has_cache


def group_layers(layer_specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroup]:
    """Group layers with equal specs, in order of first appearance, then pair each group
    whose kind shares block ids (``KindRules.shares_blocks_with``) with its owner: the
    one cached group of such a kind and the same block size. Groups that own their
    blocks come first (in order of appearance), the sharing ones after them.

    Raises:
        ValueError: if there are no layers, a value is not a ``KVCacheSpec``, or a
            sharing group has no owner or several candidates.
    """
    if not layer_specs:
        raise InvalidArgumentError("layer_specs must name at least one layer, got none")
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        if not isinstance(spec, KVCacheSpec):
            raise InvalidArgumentError(
                f"layer_specs[{name!r}] must be a KVCacheSpec, got {type(spec).__name__}"
            )
        by_spec.setdefault(spec, []).append(name)
    return _pair_blocks(
        [
            KVCacheGroup(group_id=i, spec=spec, layer_names=tuple(names))
            for i, (spec, names) in enumerate(by_spec.items())
        ]
    )


def _pair_blocks(groups: list[KVCacheGroup]) -> list[KVCacheGroup]:
    """Each sharing group with its owner (``group_layers``), owners first, renumbered."""
    owner_of: dict[int, int] = {}
    for group in groups:
        kinds = rules_for(group.spec).shares_blocks_with
        if not kinds:
            continue
        bs = group.spec.block_size
        candidates = [
            g
            for g in groups
            if g.kind in kinds
            and g.has_cache
            and g.spec.block_size == bs
            and not rules_for(g.spec).shares_blocks_with
        ]
        if len(candidates) != 1:
            wanted = " or ".join(sorted(k.value for k in kinds))
            found = (
                "none"
                if not candidates
                else "; ".join(
                    f"{g.layer_names[0]!r} ({len(g.layer_names)} layer(s))" for g in candidates
                )
            )
            raise InvalidArgumentError(
                f"layer_specs: layer {group.layer_names[0]!r} ({group.kind.value}) shares block "
                f"ids with the model's {wanted} layers of block_size={bs}, which must form "
                f"one group (equal specs); found {found}"
            )
        owner_of[group.group_id] = candidates[0].group_id
    if not owner_of:
        return groups
    order = [g for g in groups if g.group_id not in owner_of]
    order += [g for g in groups if g.group_id in owner_of]
    new_id = {g.group_id: i for i, g in enumerate(order)}
    return [
        dataclasses.replace(
            g,
            group_id=new_id[g.group_id],
            block_owner=new_id[owner_of[g.group_id]] if g.group_id in owner_of else None,
        )
        for g in order
    ]


def unify_page_sizes(groups: Sequence[KVCacheGroup]) -> tuple[list[KVCacheGroup], int]:
    """Apply the unification rule of the package docstring.

    Returns:
        The groups, each attention group with its ``blocks_per_page`` (its spec, and so
        its kernel block size, unchanged), and the unified page size ``P`` in bytes (0
        when no group keeps a cache).
    """
    cached = [g for g in groups if g.has_cache]
    # A group sharing its owner's block ids has its own buffers (``_buffers``): only the
    # owner's page takes part.
    attention_pages = [
        g.spec.page_size_bytes
        for g in cached
        if isinstance(g.spec, AttentionSpec) and g.block_owner is None
    ]
    mamba_pages = [g.spec.page_size_bytes for g in cached if isinstance(g.spec, MambaSpec)]
    largest_state = max(mamba_pages, default=0)
    if attention_pages:
        lcm = math.lcm(*attention_pages)
        page = lcm * max(1, math.ceil(largest_state / lcm))
    else:
        page = _round_up(largest_state, _ALIGN)
    unified: list[KVCacheGroup] = []
    for group in groups:
        spec = group.spec
        per_page = 1
        if group.has_cache and isinstance(spec, AttentionSpec):
            owner = spec if group.block_owner is None else groups[group.block_owner].spec
            per_page = page // owner.page_size_bytes
        unified.append(dataclasses.replace(group, blocks_per_page=per_page))
    return unified, page


def unified_groups(layer_specs: Mapping[str, KVCacheSpec]) -> tuple[list[KVCacheGroup], int]:
    """``group_layers`` then ``unify_page_sizes``: the groups (with their kernel blocks
    per page) and the unified page size ``P``.

    The one code path from layer specs to the groups the cache is built for:
    ``AttentionRuntime`` and ``attnkit.planner.plan_model`` both call it, so the block
    size and blocks per page a plan shows are the ones the runtime runs.

    Raises:
        InvalidArgumentError: as ``group_layers``.
    """
    return unify_page_sizes(group_layers(layer_specs))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
