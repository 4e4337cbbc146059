"""What the runtime reports about itself: the routing table's rows and where the KV
cache's bytes go (``AttentionRuntime.routing_table()``, ``memory_report()``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..capabilities import KVCacheLayout
from ..kv_cache import BufferSetName
from ..offload import ConnectorStats
from ..spec import KVCacheSpecKind


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
        block_size: its kernel block size (the tokens of one block table entry; a state
            group's spec value), ``None`` for a group that keeps no cache.
        blocks_per_page: kernel blocks in one page of the pool (1 for state groups).
        buffer_set: the set of layer buffers its layers view (``"page_major"`` or
            ``"planes"``); ``None`` for a group that keeps no cache (encoder-only).
        num_layers: its layers.
        bytes: what its layers' views span, ``num_layers * num_blocks * page``; shared
            with the other groups of its set (the set's bytes count once in
            ``MemoryReport.total_bytes``).
        cached_blocks: with prefix caching on, its kernel blocks that hold a cached
            prefix block (in use or not); ``None`` for a group that caches nothing or
            with caching off.
        cached_free_blocks: of them, the ones no request holds: memory the cache keeps
            until a step needs it (evictable).
        cached_bytes: the bytes the named blocks hold, over the group's layers.
        block_owner: the group whose block ids it shares (DeepSeek sparse attention's
            indexer: its MLA group), else ``None``. Its layers have buffers of their own
            (not shared with other groups): ``bytes`` is ``num_layers * num_blocks *
            blocks_per_page * page`` of its own page size, and counts in ``total_bytes``.

        For a state group with state checkpoints on, the three count its checkpoints
        (one page each, none held by a request).
    """

    group_id: int
    kind: KVCacheSpecKind
    backend: str
    layout: KVCacheLayout
    block_size: int | None
    blocks_per_page: int
    buffer_set: BufferSetName | None
    num_layers: int
    bytes: int
    cached_blocks: int | None = None
    cached_free_blocks: int | None = None
    cached_bytes: int | None = None
    block_owner: int | None = None


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Where the KV cache's bytes go (``AttentionRuntime.memory_report()``).

    Groups of one buffer set alias its layer buffers (block ownership keeps them
    apart); page-major and planes views cannot alias each other, so a model whose
    groups use both sets pays for both.

    Attributes:
        num_blocks, page_size_bytes: the pool's geometry in pages (null page included).
        groups: one row per group, in group order.
        buffers: buffer set -> its layer buffers (sets in use only).
        set_bytes: buffer set -> its bytes, ``buffers * num_blocks * page``.
        total_bytes: the cache's bytes, the sum of ``set_bytes`` and of the own buffers
            of the groups that share an owner's block ids (``GroupMemory.block_owner``).
        extra_bytes: what a second set costs at this ``num_blocks``: ``total_bytes``
            minus one set of the larger buffer count (0 with one set).
        num_blocks_one_set: blocks the same budget would hold if every group shared
            one set (``num_blocks`` when there is one set).
        draft_state_bytes: the state layers' draft buffers for speculative decoding
            (``num_speculative_tokens`` states per request slot and state layer),
            taken from the budget before the pool is sized; 0 without them.
        offload: with a KV connector, what it holds (pages, bytes, its bound) and has
            moved (docs/offload.md); ``None`` without one.
    """

    num_blocks: int
    page_size_bytes: int
    groups: tuple[GroupMemory, ...]
    buffers: Mapping[BufferSetName, int]
    set_bytes: Mapping[BufferSetName, int]
    total_bytes: int
    extra_bytes: int
    num_blocks_one_set: int
    draft_state_bytes: int = 0
    offload: ConnectorStats | None = None

    def describe(self) -> str:
        """The report as text (what the runtime logs at construction)."""
        lines = [
            f"KV cache: {self.total_bytes} B = {self.num_blocks} blocks x page "
            f"{self.page_size_bytes} B x {sum(self.buffers.values())} layer buffer(s) "
            f"in {len(self.buffers)} set(s)"
        ]
        for g in self.groups:
            blocks = (
                f"block size {g.block_size}, {g.blocks_per_page} per page, "
                if g.blocks_per_page > 1
                else ""
            )
            where = (
                f"{blocks}buffer set {g.buffer_set}, {g.bytes} B in {g.num_layers} view(s)"
                if g.buffer_set is not None
                else "no cache"
            )
            if g.block_owner is not None:
                where = (
                    f"{blocks}own buffers, {g.bytes} B in {g.num_layers} tensor(s), block ids "
                    f"of group {g.block_owner}"
                )
            if g.cached_blocks is not None and g.kind.value == "mamba":
                where += (
                    f", state checkpoints: {g.cached_blocks} page(s) ({g.cached_bytes} B), "
                    f"{g.cached_free_blocks} free"
                )
            elif g.cached_blocks is not None:
                where += (
                    f", prefix cache: {g.cached_blocks} named block(s) ({g.cached_bytes} B), "
                    f"{g.cached_free_blocks} free"
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
        if self.draft_state_bytes:
            lines.append(
                f"  draft states (speculative decoding): {self.draft_state_bytes} B, "
                f"outside the pool"
            )
        if self.offload is not None:
            o = self.offload
            bound = f" of {o.capacity_bytes} B" if o.capacity_bytes is not None else ""
            lines.append(
                f"  offload tier: {o.pages} page(s), {o.bytes} B{bound}; {o.saves} saved, "
                f"{o.loads} loaded ({o.load_failures} failed), {o.evictions} dropped by its LRU"
            )
        return "\n".join(lines)
