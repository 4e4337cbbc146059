"""The pool and the slabs when prefix caching is on: ref-counted kernel blocks that keep
their names once free, and pages that stay with their group while a free block in them
holds a name (``CachedPool``, ``CachedSlab``).

States. A kernel block of a cacheable group is **live** (ref count above 0: that many
table entries hold it) or free; a free block is **named** (it holds a cached prefix
block, reusable by a hit) or not. A page is **pinned** (one of its blocks is live),
**idle** (none is live, one is named: the group keeps it, every block evictable) or
back in the pool. So with one kernel block per page a free unnamed block is a free
page, and a named free block an idle page.

Ref counts. With several kernel blocks per page the slab keeps every block's count
(its pages' live blocks are read from them). With one, a block is live exactly while
it is neither free in the pool nor idle, so the slab keeps only the holders beyond the
first (``extra``): a block nobody shares has ref count 1 implicitly, and taking or
freeing an unshared block writes no count (most steps share nothing). ``refs`` gives
the effective counts either way.

Where a group's new blocks come from, in order (the step check counts exactly this):

1. the free unnamed blocks of its pinned pages;
2. the named free blocks of its pinned pages, least recently freed first (their names
   are evicted): a pinned page's blocks can serve no other group, so the group fills
   its own pages before it takes one (as ``PageSlab`` does);
3. pages: free ones from the pool first, then idle pages of any group, least recently
   idle first (every name in the page is evicted; the page moves to the group).

A request's blocks are freed tail first, so of the blocks (and pages) one free makes
evictable the chain's tail goes first. Nothing here checks its arguments: the block
manager checks a step before it changes anything (``preview``) and tracks which request
holds which kernel block.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt
from typing_extensions import override

from ..errors import OutOfBlocksError
from ._pool import BlockPool, Ints32, PageSlab, pop_top

__all__ = [
    "EVICTED_MEMORY",
    "CachedPool",
    "CachedSlab",
    "GroupNeed",
    "PageKeeper",
    "Preview",
    "check_step",
]

EVICTED_MEMORY = 4096
"""How many evicted names each cached group remembers, so a lookup can say a block was
evicted rather than never computed."""

Ints = npt.NDArray[np.int64]

_FEW = 32
"""Up to this many blocks, a Python loop over a memoryview costs less than one numpy
call (a fancy-index write); past it, numpy."""


class PageKeeper(Protocol):
    """What keeps an idle page (a ``CachedSlab``, or a state group's
    ``CheckpointStore``): it gives the page up when the pool reclaims it."""

    def drop_page(self, page: int) -> None: ...


class CachedPool(BlockPool):
    """The pool of pages when prefix caching is on: ``take`` hands out free pages first,
    then reclaims idle pages (their group's blocks all free, some named), least
    recently idle first, evicting their names.

    Attributes:
        idle: page -> the ``CachedSlab`` (or ``CheckpointStore``) keeping it, least
            recently idle first.
    """

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._idle: dict[int, PageKeeper] = {}
        self._unsorted: list[tuple[CachedSlab, list[int]]] = []
        """Pages given back by ``CachedSlab.give_back``'s common case (one block per
        page, one holder each), in order, not yet sorted into idle (named) and free
        ones: ``sort_given_back`` does it before anything reads either."""
        self._num_unsorted = 0
        self.shared = 0
        """The slabs' ``shared`` summed: 0 when no block has two holders."""
        self.deferred: dict[CachedSlab, None] = {}
        """The slabs holding deferred names (``CachedSlab.defer``)."""
        self.offload_log: list[tuple[int, int, bytes]] = []
        """``(group id, block, name)`` of each block evicted by the current ``take``
        whose keeper offloads (``offload_gid`` set); handed to ``offload_sink`` before
        ``take`` returns, while the blocks still hold their bytes."""
        self.offload_sink: Callable[[list[tuple[int, int, bytes]]], None] | None = None
        """Copies evicted blocks out (the runtime's connector); ``None``: none."""

    def flush_offload(self) -> None:
        """Hand the blocks evicted so far to ``offload_sink`` (before anything can write
        them: the caller has not returned them yet)."""
        log, self.offload_log = self.offload_log, []
        if self.offload_sink is not None:
            self.offload_sink(log)

    # A step's window releases give back a few pages per request. Sorting each into idle
    # or free costs a dict insert per page, paid for the step's sake only if the pages
    # were needed at once; so they wait, in order, until something reads the free pages
    # or the idle ones (a take past the free pages, a lookup's pin, a report, a check
    # that needs the split), and are then sorted as ``give_back`` would have.

    @property
    def idle(self) -> dict[int, PageKeeper]:
        """page -> the ``CachedSlab`` (or ``CheckpointStore``) keeping it, least
        recently idle first."""
        if self._unsorted:
            self.sort_given_back()
        return self._idle

    def give_back_unsorted(self, slab: CachedSlab, blocks: list[int]) -> None:
        """``slab``'s pages, each with one holder that is gone, back in order: free or
        idle as ``slab.named`` says when they are sorted (``sort_given_back``)."""
        self._unsorted.append((slab, blocks))
        self._num_unsorted += len(blocks)

    def sort_given_back(self) -> None:
        """Sort the pages ``give_back_unsorted`` holds: named ones idle, the rest free."""
        unsorted, self._unsorted = self._unsorted, []
        self._num_unsorted = 0
        idle, free = self._idle, self._free
        for slab, blocks in unsorted:
            if slab._marked < len(slab._deferred):
                slab._mark_deferred()
            named = slab._named_mv
            back: list[int] = []
            for block in blocks:
                if named[block]:
                    idle[block] = slab
                else:
                    back.append(block)
            if back:
                free.extend(back)
                if self._in_use_cache is not None:
                    self._mark(back, False)

    @property
    @override
    def num_free_blocks(self) -> int:
        if self._unsorted:
            self.sort_given_back()
        return len(self._free)

    @property
    @override
    def _in_use(self) -> bytearray:
        if self._unsorted:
            self.sort_given_back()
        return super()._in_use

    @override
    def is_allocated(self, block: int) -> bool:
        if self._unsorted:
            self.sort_given_back()
        return super().is_allocated(block)

    @override
    def give_back(self, blocks: Ints32 | list[int]) -> None:
        if self._unsorted:  # (the pages given back before these go first)
            self.sort_given_back()
        super().give_back(blocks)

    @override
    def allocate(self, n: int) -> list[int]:
        if self._unsorted:
            self.sort_given_back()
        return super().allocate(n)

    @property
    def num_available(self) -> int:
        """Pages a step can take: free ones and idle ones."""
        return len(self._free) + len(self._idle) + self._num_unsorted

    @override
    def take(self, n: int) -> list[int]:
        """Take ``n`` pages: free ones, then idle ones (the caller has checked that
        ``num_available >= n``)."""
        free = len(self._free)
        if n <= free:  # (the pages given back unsorted are not needed: they wait)
            # BlockPool.take without its call: every step's growth of every cached group.
            blocks = pop_top(self._free, n)
            if self._in_use_cache is not None:
                self._mark(blocks, True)
            return blocks
        if self._unsorted:
            self.sort_given_back()
            return self.take(n)
        if self.deferred:  # a reclaim evicts names: the deferred ones are made first
            for slab in list(self.deferred):
                slab.settle()
            return self.take(n)
        pages = super().take(free)
        idle = self._idle
        reclaimed = list(itertools.islice(idle, n - free))
        if len(reclaimed) < n - free:
            raise AssertionError(
                f"the step check let through a step the pool cannot hold: {n} page(s) "
                f"asked, {free} free and {len(reclaimed)} idle"
            )
        for page in reclaimed:
            idle.pop(page).drop_page(page)
        if self.offload_log:
            self.flush_offload()
        pages.extend(reclaimed)
        return pages


class Preview:
    """What giving back and touching blocks would change, counted before anything
    changes (``CachedSlab.preview``): free unnamed and named blocks in pinned pages,
    idle pages, and pages back to the pool."""

    __slots__ = ("idle", "named", "pool", "unnamed")

    def __init__(self, unnamed: int = 0, named: int = 0, idle: int = 0, pool: int = 0) -> None:
        self.unnamed, self.named, self.idle, self.pool = unnamed, named, idle, pool


class CachedSlab:
    """One cacheable group's kernel blocks when prefix caching is on (any number ``k``
    of kernel blocks per page, 1 included): the module docstring's states and order.

    Attributes:
        pool: the ``CachedPool``.
        blocks_per_page: ``k``.
        namespace: the group's namespace (a pool key is ``(namespace, name)``; the slab
            is one namespace, so its maps are keyed by name alone).
        refs: int32 ``[num_blocks * k]``, read only: each kernel block's holders (the
            effective counts; with ``k == 1`` made from the manager's tables and
            ``extra``, for checks and reports).
        extra: with ``k == 1``, int32 ``[num_blocks]``, read only: each block's holders
            beyond the first (0 for a block nobody shares, and for every free block).
        named: bool ``[num_blocks * k]``, read only: the blocks that hold a name.
        block_of: name -> its kernel block; ``name_of``: the reverse.
        evicted: the last ``EVICTED_MEMORY`` names evicted (oldest first).
        evictions: names evicted so far.
    """

    def __init__(
        self,
        pool: CachedPool,
        blocks_per_page: int,
        namespace: bytes,
        on_evict: Callable[[int], None] | None = None,
    ) -> None:
        self.pool = pool
        self.blocks_per_page = k = blocks_per_page
        self.namespace = namespace
        size = pool.num_blocks * k
        # k > 1: every kernel block's holders; k == 1: the holders beyond the first.
        self._counts: Ints32 = np.zeros(size, dtype=np.int32)
        self.extra: Ints32 = self._counts
        self._named: npt.NDArray[np.bool_] = np.zeros(size, dtype=np.bool_)
        # Per-block reads and writes from Python go through memoryviews of the same bytes:
        # a step moves a few blocks per group, where one numpy call costs more than a
        # short Python loop.
        self._named_mv: memoryview = self._named.data
        self._refs_by_page: Ints32 = np.reshape(self._counts, (pool.num_blocks, k))
        self.held: Callable[[], Ints32] | None = None
        """With ``k == 1``: the group's table entries that hold a block (non-null, one
        per entry), set by the manager; ``refs`` and ``owned`` read it."""
        self._named_by_page: npt.NDArray[np.bool_] = np.reshape(self._named, (pool.num_blocks, k))
        self._owned: npt.NDArray[np.bool_] = np.zeros(pool.num_blocks, dtype=np.bool_)
        self.block_of: dict[bytes, int] = {}
        self.name_of: dict[int, bytes] = {}
        # k > 1: the free blocks of pinned pages (insertion order: least recent first).
        self._unnamed: dict[int, None] = {}
        self._named_free: dict[int, None] = {}
        self.shared = 0
        """Table entries beyond the first on every block: ``sum(max(0, ref - 1))``."""
        self.evicted: dict[bytes, None] = {}
        self.evictions = 0
        self._on_evict = on_evict
        self._deferred: list[tuple[Ints32, Sequence[bytes], int, bytes | None]] = []
        """Names ``defer`` put off (blocks, chain, first index, salt-free name), in
        order; the blocks' ``named`` entries of the first ``_marked`` are set."""
        self._marked = 0
        self.first_salt_free: dict[bytes, int] = {}
        """The salt-free names of the named first blocks, counted (a lookup tells "cached
        under another salt" from "never computed")."""
        self._salt_free_of: dict[int, bytes] = {}
        self.offload_gid: int | None = None
        """The group id its evicted blocks are offloaded under (``None``: not offloaded;
        ``CachedPool.offload_log``)."""

    # ------------------------------------------------------------------ introspection

    @property
    def named(self) -> npt.NDArray[np.bool_]:
        """bool ``[num_blocks * k]``, read only: the blocks that hold a name (deferred
        ones included)."""
        if self._marked < len(self._deferred):
            self._mark_deferred()
        return self._named

    def _mark_deferred(self) -> None:
        """Set the ``named`` entries of the deferred blocks not marked yet: each reader
        of ``named`` (the sort of given-back pages, a free of shared blocks, a preview)
        asks first, so a deferral costs no scattered writes in the step that makes it
        (the pages a release gives back wait unsorted until something reads them)."""
        deferred = self._deferred
        for ids, _, _, _ in deferred[self._marked :]:
            self._named.put(ids, True)  # (cheaper than an indexed write)
        self._marked = len(deferred)

    @property
    def refs(self) -> Ints32:
        """int32 ``[num_blocks * k]``: each kernel block's holders (a copy). With
        ``k == 1``: 1 + ``extra`` for the blocks the tables hold, ``extra`` elsewhere
        (0 when the slab is right)."""
        if self.blocks_per_page > 1:
            return np.array(self._counts)
        counts: Ints32 = np.array(self._counts)
        if self.held is not None:  # the first holder of every block a table holds
            counts[np.unique(self.held())] += 1
        return counts

    @property
    def owned(self) -> npt.NDArray[np.bool_]:
        """bool ``[num_blocks]``: the pages the slab holds (pinned or idle)."""
        if self.blocks_per_page == 1:
            held: npt.NDArray[np.bool_] = np.logical_or(self.refs > 0, self.named)
            return held
        owned: npt.NDArray[np.bool_] = np.array(self._owned)
        return owned

    @property
    def num_free_unnamed(self) -> int:
        """Free unnamed kernel blocks in the slab's pinned pages."""
        return len(self._unnamed)

    @property
    def num_free_named(self) -> int:
        """Named free kernel blocks in the slab's pinned pages."""
        return len(self._named_free)

    def num_cached_free(self) -> int:
        """Named kernel blocks no request holds (evictable)."""
        if self.blocks_per_page == 1:  # a named free block is an idle page
            return sum(1 for keeper in self.pool.idle.values() if keeper is self)
        return int(np.count_nonzero(self.named & (self._counts == 0)))

    # ------------------------------------------------------------------ names

    def register(
        self,
        blocks: Sequence[int],
        names: Sequence[bytes],
        salt_free_first: bytes | None,
        ids: Ints32 | None = None,
    ) -> None:
        """Name live ``blocks`` (a request's newly computed full blocks, in order). A
        name already held by another block is kept there (this block stays unnamed and
        goes back to the pool once freed). ``salt_free_first``: the salt-free name of
        the chain's first block, when ``blocks[0]`` is it. ``ids``: ``blocks`` as an
        array, when the caller has one."""
        if self._deferred:  # a name goes to the first block that holds it: in order
            self.settle()
        block_of = self.block_of
        if not block_of.keys().isdisjoint(names):
            keep = [(b, n) for b, n in zip(blocks, names, strict=True) if n not in block_of]
            if not keep:
                return
            if salt_free_first is not None and keep[0][0] != blocks[0]:
                salt_free_first = None
            blocks, names, ids = [b for b, _ in keep], [n for _, n in keep], None
        block_of.update(zip(names, blocks, strict=True))
        self.name_of.update(zip(blocks, names, strict=True))
        if ids is not None and len(blocks) > _FEW:
            self._named[ids] = True
        else:
            named = self._named_mv
            for block in blocks:
                named[block] = True
        evicted = self.evicted
        if evicted and not evicted.keys().isdisjoint(names):
            for name in names:
                evicted.pop(name, None)
        if salt_free_first is not None:
            first = blocks[0]
            self._salt_free_of[first] = salt_free_first
            self.first_salt_free[salt_free_first] = self.first_salt_free.get(salt_free_first, 0) + 1

    def defer(
        self, ids: Ints32, chain: Sequence[bytes], start: int, salt_free_first: bytes | None
    ) -> None:
        """``register(ids.tolist(), chain[start : start + ids.size], salt_free_first)``,
        put off until something reads the maps (``settle``): the blocks count as named
        (their ``named`` entries are set before anything reads them:
        ``_mark_deferred``), so a release makes them idle (cached). One block per page
        only. ``chain`` is the request's whole name chain, sliced at ``settle``: a
        slice now would touch every name of it, long out of cache, each step. A name
        another block already holds (found at ``settle``) leaves its block unnamed
        then, and a free one goes back to the pool from the idle pages: a reclaim, a
        lookup, a register and the reports settle first."""
        assert self.blocks_per_page == 1, "deferred names need one block per page"
        self._deferred.append((ids, chain, start, salt_free_first))
        self.pool.deferred[self] = None

    def settle(self) -> None:
        """Make the deferred names (``defer``), in order."""
        idle = self.pool.idle  # (sorted first: a deferred block given back is idle)
        deferred, self._deferred = self._deferred, []
        self._marked = 0
        self.pool.deferred.pop(self, None)
        named = self._named_mv
        for ids, chain, start, salt_free in deferred:
            self._named[ids] = False
            blocks: list[int] = ids.tolist()
            self.register(blocks, chain[start : start + len(blocks)], salt_free, ids)
            # A free block was named when it was freed: it is idle.
            back = [b for b in blocks if not named[b] and b in idle]
            for block in back:  # free and named only for a while: back to the pool
                del idle[block]
            if back:
                self.pool.give_back(back)

    def _unname(self, block: int, *, evicted: bool) -> None:
        name = self.name_of.pop(block)
        del self.block_of[name]
        self._named_mv[block] = False
        salt_free = self._salt_free_of.pop(block, None)
        if salt_free is not None:
            left = self.first_salt_free[salt_free] - 1
            if left:
                self.first_salt_free[salt_free] = left
            else:
                del self.first_salt_free[salt_free]
        if evicted:
            self.evictions += 1
            if self.offload_gid is not None:
                self.pool.offload_log.append((self.offload_gid, block, name))
            memory = self.evicted
            memory[name] = None
            if len(memory) > EVICTED_MEMORY:
                del memory[next(iter(memory))]
            if self._on_evict is not None:
                self._on_evict(1)

    def drop_page(self, page: int) -> None:
        """Give up an idle page (the pool reclaims it for a group): evict its names."""
        k = self.blocks_per_page
        if k == 1:
            self._unname(page, evicted=True)
            return
        start = page * k
        for block in np.flatnonzero(self._named_by_page[page]).tolist():
            self._unname(start + block, evicted=True)
        self._owned[page] = False

    def reset(self) -> int:
        """Drop every name (blocks in use stay in use, unnamed); pages left with no live
        block go back to the pool. Returns the names dropped."""
        if self._deferred:
            self.settle()
        dropped = len(self.name_of)
        for block in list(self.name_of):
            self._unname(block, evicted=False)
        self.evicted.clear()
        k = self.blocks_per_page
        idle = [p for p, slab in self.pool.idle.items() if slab is self]
        for page in idle:
            del self.pool.idle[page]
        if k > 1:
            self._owned[idle] = False
            self._unnamed.update(dict.fromkeys(self._named_free))
            self._named_free.clear()
        if idle:
            self.pool.give_back(idle)
        return dropped

    # ------------------------------------------------------------------ blocks

    def take(self, n: int) -> list[int] | Ints32:
        """Take ``n`` kernel blocks in the module docstring's order (checked by the
        caller): each is live once, unnamed."""
        if n <= 0:
            return []
        k = self.blocks_per_page
        if k == 1:  # a free block has no extra holder: each is live once
            return self.pool.take(n)
        taken: list[int] = []
        unnamed = self._unnamed
        while unnamed and len(taken) < n:
            taken.append(unnamed.popitem()[0])
        named_free = self._named_free
        while named_free and len(taken) < n:
            block = next(iter(named_free))
            del named_free[block]
            self._unname(block, evicted=True)
            taken.append(block)
        if self.pool.offload_log:
            self.pool.flush_offload()
        short = n - len(taken)
        if short:
            pages = self.pool.take(-(-short // k))
            self._owned[pages] = True
            blocks = (np.asarray(pages, dtype=np.int64)[:, None] * k + np.arange(k)).ravel()
            taken.extend(blocks[:short].tolist())
            # The rest are free unnamed blocks of now pinned pages (the next on top).
            unnamed.update(dict.fromkeys(blocks[short:][::-1].tolist()))
        ids = np.array(taken, dtype=np.int32)
        self._counts[ids] = 1
        return ids

    def touch(self, blocks: Ints32 | Sequence[int]) -> None:
        """Add one holder per entry of ``blocks`` (named blocks a hit reads; an entry per
        request, so repeats count): free ones leave the evictable sets."""
        ids = np.asarray(blocks, dtype=np.int64)
        if ids.size == 0:
            return
        uniq, counts = np.unique(ids, return_counts=True)
        k = self.blocks_per_page
        idle = self.pool.idle
        if k == 1:  # a named block is live or idle; a live one holds 1 + extra
            blocks_of: list[int] = uniq.tolist()
            was_idle = np.fromiter(map(idle.__contains__, blocks_of), np.bool_, len(blocks_of))
            before = np.where(was_idle, 0, self._counts[uniq].astype(np.int64) + 1)
            after = before + counts
            self._counts[uniq] = after - 1
        else:
            before = self._counts[uniq].astype(np.int64)
            after = before + counts
            self._counts[uniq] = after
        more = int((np.maximum(after - 1, 0) - np.maximum(before - 1, 0)).sum())
        self.shared += more
        self.pool.shared += more
        revived = uniq[before == 0].tolist()
        if not revived:
            return
        if k == 1:
            for block in revived:
                del idle[block]
            return
        for block in revived:
            page = block // k
            if page in idle:  # the page is pinned again: its free blocks are the group's
                del idle[page]
                row = self._refs_by_page[page]
                for j in np.flatnonzero(row == 0).tolist():
                    free = page * k + j
                    if self._named[free]:
                        self._named_free[free] = None
                    else:
                        self._unnamed[free] = None
            else:
                self._named_free.pop(block, None)

    def give_back(self, blocks: Ints32 | list[int]) -> None:
        """Remove one holder per entry of ``blocks`` (in the order given: a request's
        blocks tail first); blocks left with none are free: named ones stay cached,
        unnamed ones (and pages left with neither) go back."""
        if not self.shared and self.blocks_per_page == 1:
            # Every live block has one holder (no repeats, all freed; no count to
            # change), and a block is its page: the common case (a decode step's window
            # releases, a free).
            given: list[int] = blocks.tolist() if isinstance(blocks, np.ndarray) else blocks
            pool = self.pool
            if not self.name_of and not self._deferred:
                pool.give_back(given)
                return
            # pool.give_back_unsorted(self, given), inlined (every window step): idle
            # or free once read.
            pool._unsorted.append((self, given))
            pool._num_unsorted += len(given)
            return
        ids = np.asarray(blocks, dtype=np.int64)
        if ids.size == 0:
            return
        refs = self._counts
        if self.blocks_per_page == 1:  # some block is shared: ``extra`` counts
            uniq, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
            extra = refs[uniq].astype(np.int64)
            after = extra + 1 - counts  # holders left
            refs[uniq] = np.maximum(after - 1, 0)
            fewer = int((extra - np.maximum(after - 1, 0)).sum())
            self.shared -= fewer
            self.pool.shared -= fewer
            at_zero = ids[(after == 0)[np.reshape(inverse, -1)]]
            freed = np.array(list(dict.fromkeys(at_zero.tolist())), dtype=np.int64)
            if freed.size == 0:
                return
        elif not self.shared:  # every live block has one holder: no repeats, all freed
            refs[ids] = 0
            freed = ids
        else:
            uniq, counts = np.unique(ids, return_counts=True)
            before = refs[uniq].astype(np.int64)
            after = before - counts
            refs[uniq] = after
            fewer = int((np.maximum(before - 1, 0) - np.maximum(after - 1, 0)).sum())
            self.shared -= fewer
            self.pool.shared -= fewer
            at_zero = ids[refs[ids] == 0]
            freed = np.array(list(dict.fromkeys(at_zero.tolist())), dtype=np.int64)
            if freed.size == 0:
                return
        self._freed(freed)

    def _freed(self, freed: Ints) -> None:
        named = self.named[freed]  # (``named``: deferred blocks marked first)
        k = self.blocks_per_page
        if k == 1:
            if not named.any():
                self.pool.give_back(freed.tolist())
                return
            unnamed = freed[~named]
            if unnamed.size:
                self.pool.give_back(unnamed.tolist())
            self.pool.idle.update(dict.fromkeys(freed[named].tolist(), self))
            return
        pages = freed // k
        pinned = self._refs_by_page[pages].any(axis=1)
        for block, is_named in zip(freed[pinned].tolist(), named[pinned].tolist(), strict=True):
            if is_named:
                self._named_free[block] = None
            else:
                self._unnamed[block] = None
        if pinned.all():
            return
        back: list[int] = []
        for page in dict.fromkeys(pages[~pinned].tolist()):  # in the order freed
            start = page * k
            for block in range(start, start + k):  # its older free blocks
                self._unnamed.pop(block, None)
                self._named_free.pop(block, None)
            if self._named_by_page[page].any():
                self.pool.idle[page] = self
            else:
                self._owned[page] = False
                back.append(page)
        if back:
            self.pool.give_back(back)

    def preview(self, ids: Ints, signs: Ints) -> Preview:
        """What adding ``signs[i]`` holders to ``ids[i]`` would change (touches +1, frees
        and releases -1), without changing anything."""
        if ids.size == 0:
            return Preview()
        uniq, inverse = np.unique(ids, return_inverse=True)
        net = np.bincount(inverse, weights=signs, minlength=uniq.size).astype(np.int64)
        named = self.named[uniq]
        k = self.blocks_per_page
        if k == 1:  # given back: live; touched: named, so live or idle
            idle_pages = self.pool.idle
            blocks: list[int] = uniq.tolist()
            was_idle = np.fromiter(map(idle_pages.__contains__, blocks), np.bool_, len(blocks))
            before = np.where(was_idle, 0, self._counts[uniq].astype(np.int64) + 1)
        else:
            before = self._counts[uniq].astype(np.int64)
        after = before + net
        if k == 1:
            idle = int(np.count_nonzero((after == 0) & named)) - int(
                np.count_nonzero((before == 0) & named)
            )
            back = int(np.count_nonzero((before > 0) & (after == 0) & ~named))
            return Preview(idle=idle, pool=back)
        pages, where = np.unique(uniq // k, return_inverse=True)
        rows_before = self._refs_by_page[pages].astype(np.int64)
        rows_after: Ints = np.array(rows_before)
        rows_after[where, uniq % k] += net
        names = self._named_by_page[pages]
        live_before: npt.NDArray[np.bool_] = np.any(rows_before, axis=1)
        live_after: npt.NDArray[np.bool_] = np.any(rows_after, axis=1)

        def free_in_pinned(rows: Ints, live: npt.NDArray[np.bool_], of_named: bool) -> int:
            mask = (rows == 0) & (names if of_named else ~names)
            return int(np.count_nonzero(mask[live]))

        has_name = names.any(axis=1)
        return Preview(
            unnamed=free_in_pinned(rows_after, live_after, False)
            - free_in_pinned(rows_before, live_before, False),
            named=free_in_pinned(rows_after, live_after, True)
            - free_in_pinned(rows_before, live_before, True),
            idle=int(np.count_nonzero(~live_after & has_name))
            - int(np.count_nonzero(~live_before)),
            pool=int(np.count_nonzero(~live_after & ~has_name)),
        )


@dataclasses.dataclass(slots=True)
class GroupNeed:
    """One group's part of a step, for ``check_step``.

    Attributes:
        label: the group in messages (``"group 0 (full_attention)"``).
        new: kernel blocks its tables grow by.
        freed: blocks the step gives back (finished requests' and released ones), an
            entry per holder.
        touched: blocks new requests' hits read, an entry per request.
        cached: its ``CachedSlab``, if it caches; ``slab``: its ``PageSlab``, if its
            page holds several blocks and it does not cache.
    """

    label: str
    new: int
    freed: list[Ints32]
    touched: list[Ints32]
    cached: CachedSlab | None
    slab: PageSlab | None


def check_step(pool: CachedPool, needs: Sequence[GroupNeed], *, pinned: int = 0) -> None:
    """Raise ``OutOfBlocksError`` unless a step fits, with prefix caching on; nothing
    changes either way.

    A cacheable group needs ``ceil(max(0, new - free) / blocks_per_page)`` pages,
    ``free`` being the free blocks (named or not) in its pinned pages once the step's
    hits, releases and finished requests changed their holders (the module docstring's
    order: a group fills its pinned pages first); a group with a ``PageSlab`` as
    without caching; any other one page per block. The step fits when the pages needed
    are at most the free pages plus the idle ones (any group's cached pages, evictable),
    both counted after those changes; ``pinned``: idle checkpoint pages the step's hits
    restore from (kept from eviction while the step is allocated).
    """
    needed = 0
    available = pool.num_available - pinned
    lines: list[str] = []
    for need in needs:
        cached, slab = need.cached, need.slab
        count = sum(int(f.size) for f in need.freed)
        if cached is not None:
            k = cached.blocks_per_page
            if k == 1 and not cached.shared and not need.touched:
                # Every block given back has one holder: it becomes a free or an idle
                # page (the common case: a decode step's window releases).
                available += count
                pages = need.new
            else:
                free = cached.num_free_unnamed + cached.num_free_named
                if count or need.touched:
                    ids = np.concatenate([*need.freed, *need.touched]).astype(np.int64)
                    signs = np.concatenate(
                        [np.full(count, -1, dtype=np.int64)]
                        + [np.ones(t.size, dtype=np.int64) for t in need.touched]
                    )
                    change = cached.preview(ids, signs)
                    available += change.idle + change.pool
                    free += change.unnamed + change.named
                pages = -(-(need.new - free) // k) if need.new > free else 0
        elif slab is not None:
            if need.freed:
                free, emptied = slab.preview_give_back(np.concatenate(need.freed))
            else:
                free, emptied = slab.num_free_blocks, 0
            pages = slab.pages_for(need.new, free)
            available += emptied
        else:
            pages = need.new
            available += count
        if pages:
            lines.append(f"{need.label}: {need.new} kernel block(s) -> {pages} page(s)")
        needed += pages
    if needed <= available:
        return
    raise OutOfBlocksError(
        f"the step needs {needed} new page(s) but only {pool.num_free_blocks} are free "
        f"and {len(pool.idle)} hold only cached blocks (evictable), {available} in all "
        f"once the step's hits"
        + (f" (state checkpoints they restore from: {pinned})" if pinned else "")
        + f", window releases and finished requests count, of "
        f"{pool.num_blocks - 1}; {'; '.join(lines)}; nothing was allocated or freed"
    )
