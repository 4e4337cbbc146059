"""The capacity arithmetic (the package docstring gives the formulas): the figures a
plan derives from its page, buffers and pool (``_PoolCapacity``), a group's costs per
request and per token, and the longest request a rank's pool holds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from ..config import AttentionConfig
from ..kinds import rules_for
from ..kv_cache import BufferSetName, KVCacheGroup
from ..spec import AttentionSpec, KVCacheSpec

__all__ = [  # what the plan types, the per-rank plan and plan_model use
    "_HoldsBlocks",
    "_PoolCapacity",
    "_group_costs",
    "_max_context",
    "_pages",
    "_rank_blocks",
    "_rank_kernel_blocks",
]


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
    shared_bytes_per_page: int

    def _capacity_groups(self) -> Sequence[_HoldsBlocks]:
        raise NotImplementedError

    @property
    def bytes_per_block(self) -> int:
        """What one block id costs: a page in every layer buffer of every set, and the
        bytes of the groups sharing its block ids (``kv_cache.shared_bytes_per_page``)."""
        return self.page_size_bytes * sum(self.buffers.values()) + self.shared_bytes_per_page

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


def _group_costs(group: KVCacheGroup, config: AttentionConfig) -> tuple[int, int, int, int | None]:
    """``(blocks_per_request, kernel_blocks_per_request, bytes_per_token,
    per_request_cap_bytes)`` of a group: pages (the pool's blocks) and kernel blocks."""
    if not group.has_cache:
        return 0, 0, 0, None
    spec = group.spec  # the declared spec: kernel blocks; a page holds blocks_per_page
    kernel = (
        spec.max_memory_usage_bytes(config.max_model_len, config.max_num_batched_tokens)
        // spec.page_size_bytes
    )
    # A group sharing its owner's block ids holds no pages of its own: its kernel
    # blocks are the owner's ids (its bytes are in ``shared_bytes_per_page``).
    pages = 0 if group.block_owner is not None else _pages(kernel, group.blocks_per_page)
    layers = len(group.layer_names)
    if isinstance(spec, AttentionSpec):
        per_token = layers * spec.page_size_bytes // spec.block_size
        bounded = rules_for(spec).bound(spec) is not None
        cap = kernel * spec.page_size_bytes * layers if bounded else None
        return pages, kernel, per_token, cap
    return pages, kernel, 0, None


def _pages(kernel_blocks: int, blocks_per_page: int) -> int:
    """Pages that hold ``kernel_blocks`` of a group (a request alone in its pages)."""
    return -(-kernel_blocks // blocks_per_page)


def _rank_kernel_blocks(spec: KVCacheSpec, max_model_len: int, batched: int, cp: int) -> int:
    """The most kernel blocks one request of ``max_model_len`` tokens holds in a group
    of ``spec`` (a cached spec) on the busiest of ``cp`` context-parallel ranks.

    Sharded kinds hold ``ceil(tokens / cp)`` slots on rank 0; replicated ones what the
    spec says for the whole request.
    """
    if rules_for(spec).context_sharded:
        local = -(-max_model_len // cp)
        return -(-local // spec.block_size)
    return spec.max_memory_usage_bytes(max_model_len, batched) // spec.page_size_bytes


def _rank_blocks(group: KVCacheGroup, max_model_len: int, batched: int, cp: int) -> int:
    """``_rank_kernel_blocks`` in pages (the pool's blocks)."""
    kernel = _rank_kernel_blocks(group.spec, max_model_len, batched, cp)
    return _pages(kernel, group.blocks_per_page)


def _max_context(groups: Sequence[KVCacheGroup], batched: int, cp: int, usable: int) -> int | None:
    """The longest request ``usable`` pages hold on each rank (binary search over the
    length: every group's pages grow monotonically with it); ``None`` when every
    length fits (no cached group grows without bound, and the bounded ones fit)."""
    cached = [g for g in groups if g.has_cache and g.block_owner is None]
    growing = [g.page_tokens for g in cached if rules_for(g.spec).grows_without_bound]

    def blocks(length: int) -> int:
        return sum(_rank_blocks(g, length, batched, cp) for g in cached)

    if blocks(1) > usable:
        return 0
    if growing:
        # At ``high`` tokens the growing group of the smallest pages alone holds at
        # least usable + 1 of them.
        high = cp * min(growing) * (usable + 1)
    else:
        # Windows and chunks stop growing once a request passes window (chunk) + one
        # step + one page; states never grow.
        spans = [
            bound + batched + g.page_tokens
            for g in cached
            if (bound := rules_for(g.spec).bound(g.spec)) is not None
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
