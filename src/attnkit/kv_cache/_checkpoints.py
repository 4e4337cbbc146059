"""State checkpoints: pages of the pool that keep a copy of a request's state after
``L`` prompt tokens, so a later request with the same first ``L`` tokens starts from it
(``CheckpointStore``, one per state group; docs/prefix-caching.md, "State checkpoints").

A checkpoint page is named by the prefix's block name at ``L`` in the checkpoint
layout (blocks of ``checkpoint_interval`` tokens), under its group's namespace. No
request's table holds it: a hit copies it into the request's own state page, so later
steps never write it. It is always **idle** in the pool's sense (``CachedPool.idle``,
evictable, least recently used first), except while a step that restores from it is
being allocated (pinned, so that step's allocation cannot evict it). So a checkpoint
costs a step nothing in the step check: taking one turns a free or idle page into an
idle one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ._cached import EVICTED_MEMORY, CachedPool

__all__ = ["CheckpointStore"]


class CheckpointStore:
    """One state group's checkpoints (module docstring).

    Attributes:
        pool: the ``CachedPool`` the pages come from.
        namespace: the group's namespace.
        block_of: name -> its page; ``name_of``: the reverse.
        evicted: the last ``EVICTED_MEMORY`` names evicted (oldest first).
        evictions: checkpoints evicted so far; ``taken``: made so far; ``skipped``:
            not made because the pool had no free or idle page.
    """

    def __init__(
        self, pool: CachedPool, namespace: bytes, on_evict: Callable[[int], None] | None = None
    ) -> None:
        self.pool = pool
        self.namespace = namespace
        self.block_of: dict[bytes, int] = {}
        self.name_of: dict[int, bytes] = {}
        self.evicted: dict[bytes, None] = {}
        self.evictions = 0
        self.taken = 0
        self.skipped = 0
        self._on_evict = on_evict
        self._pinned: set[int] = set()
        self.offload_gid: int | None = None
        """The group id evicted checkpoints are offloaded under (``CachedPool.offload_log``)."""

    def num_free(self) -> int:
        """Checkpoints no step is restoring from now (every one between steps)."""
        return len(self.name_of) - len(self._pinned)

    def take(self, name: bytes) -> int | None:
        """A new idle page named ``name`` (the caller copies the state into it), or
        ``None`` when the name is held already or the pool has no free or idle page."""
        if name in self.block_of:
            return None
        if self.pool.num_available < 1:
            self.skipped += 1
            return None
        (page,) = self.pool.take(1)
        self.block_of[name] = page
        self.name_of[page] = name
        self.evicted.pop(name, None)
        self.pool.idle[page] = self
        self.taken += 1
        return page

    def pin(self, pages: Iterable[int]) -> None:
        """Hits restore from ``pages`` in the step being allocated: keep them from
        eviction until ``unpin``."""
        idle = self.pool.idle
        for page in pages:
            if page not in self._pinned:
                self._pinned.add(page)
                del idle[page]

    def unpin(self) -> None:
        """The restores are copied: the pages are idle again, the most recently used."""
        idle = self.pool.idle
        for page in self._pinned:
            idle[page] = self
        self._pinned.clear()

    def drop_page(self, page: int) -> None:
        """The pool reclaims an idle checkpoint page: its name is evicted."""
        name = self.name_of.pop(page)
        del self.block_of[name]
        self.evictions += 1
        if self.offload_gid is not None:
            self.pool.offload_log.append((self.offload_gid, page, name))
        memory = self.evicted
        memory[name] = None
        if len(memory) > EVICTED_MEMORY:
            del memory[next(iter(memory))]
        if self._on_evict is not None:
            self._on_evict(1)

    def discard(self, page: int) -> None:
        """Drop a checkpoint taken for a load that failed (not an eviction): its page
        goes back to the pool unnamed."""
        name = self.name_of.pop(page)
        del self.block_of[name]
        self.pool.idle.pop(page, None)
        self.pool.give_back([page])

    def reset(self) -> int:
        """Drop every checkpoint (its page goes back to the pool). Returns how many."""
        dropped = len(self.name_of)
        idle = self.pool.idle
        pages = list(self.name_of)
        for page in pages:
            idle.pop(page, None)
        self.block_of.clear()
        self.name_of.clear()
        self.evicted.clear()
        self._pinned.clear()
        if pages:
            self.pool.give_back(pages)
        return dropped
