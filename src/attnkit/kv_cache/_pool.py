"""The block pool and the slabs: the pool is a fixed set of page ids, of which id 0 (the
null page) is never handed out; a ``PageSlab`` hands out one group's kernel blocks from
the pages it takes from the pool (two-level allocation, ``blocks_per_page > 1``)."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import NoReturn, SupportsIndex, cast

import numpy as np
import numpy.typing as npt

from .._validation import is_nonnegative_int, is_positive_int
from ..errors import ArgumentTypeError, InvalidArgumentError, OutOfBlocksError

NULL_BLOCK = 0


def pop_top(stack: list[int], n: int) -> list[int]:
    """The top ``n`` ids of ``stack`` (``n <= len(stack)``), top first, popped."""
    if n == 1:  # one decode growing: the common case
        return [stack.pop()]
    if n <= 0:
        return []
    blocks = stack[: -n - 1 : -1]
    del stack[-n:]
    return blocks


class BlockPool:
    """A fixed set of block ids; id 0 (the null block) is never handed out.

    The public ``allocate``/``free`` check their arguments and either succeed whole or
    raise and change nothing. The block manager uses the batched, unchecked
    ``take``/``give_back`` on its hot path, for blocks whose ownership it tracks
    itself; its own invariants are checked by the state-machine test.

    The free ids are a Python list used as a stack (slice deletion and ``extend`` run
    in C, whatever the count). Which ids are handed out is a ``bytearray`` built the
    first time a checked call needs it, then kept current; it is read per id from
    Python for a few ids and through a numpy view of the same bytes for many, and a
    pool driven only by the manager's fast path never pays for it.
    """

    _SMALL = 16
    """Up to this many ids, the checked calls loop in Python; above, they vectorise."""

    def __init__(self, num_blocks: int) -> None:
        if not is_positive_int(num_blocks) or num_blocks < 2:
            raise InvalidArgumentError(
                f"num_blocks must be an int >= 2 (block 0 is reserved), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        # Stacked high to low, so low ids are handed out first (readable tests).
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))
        self._in_use_cache: bytearray | None = None
        self._in_use_view: npt.NDArray[np.bool_] = np.zeros(0, dtype=np.bool_)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def _in_use(self) -> bytearray:
        if self._in_use_cache is None:
            in_use = bytearray(b"\x01") * self.num_blocks
            view = np.frombuffer(in_use, dtype=np.bool_)
            view[NULL_BLOCK] = False
            view[self._free] = False
            self._in_use_cache, self._in_use_view = in_use, view
        return self._in_use_cache

    def _mark(self, blocks: list[int], value: bool) -> None:
        """Record ``blocks`` as handed out (``True``) or free, if the map exists."""
        in_use = self._in_use_cache
        if in_use is None:
            return
        if len(blocks) <= self._SMALL:
            flag = 1 if value else 0
            for block in blocks:
                in_use[block] = flag
        else:
            self._in_use_view[blocks] = value

    def is_allocated(self, block: int) -> bool:
        return 0 < block < self.num_blocks and bool(self._in_use[block])

    def take(self, n: int) -> list[int]:
        """Take ``n`` free blocks (the caller has checked that ``n`` are free)."""
        blocks = pop_top(self._free, n)
        if self._in_use_cache is not None:
            self._mark(blocks, True)
        return blocks

    def give_back(self, blocks: Ints32 | list[int]) -> None:
        """Return blocks the caller owns (no checks)."""
        given: list[int] = blocks.tolist() if isinstance(blocks, np.ndarray) else blocks
        self._free.extend(given)
        if self._in_use_cache is not None:
            self._mark(given, False)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks.

        Raises:
            OutOfBlocksError: if fewer than ``n`` are free (the pool is unchanged).
        """
        if not is_nonnegative_int(n):
            raise InvalidArgumentError(f"n must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise OutOfBlocksError(
                f"need {n} free block(s) but only {len(self._free)} of "
                f"{self.num_blocks - 1} are free"
            )
        return self.take(n)

    def free(self, blocks: Iterable[int]) -> None:
        """Return blocks to the pool.

        Raises:
            ValueError: for the null block, an id out of range, a block that is not
                allocated, or one given twice (the pool is unchanged).
        """
        given = list(blocks)
        count = len(given)
        if count == 0:
            return
        in_use = self._in_use_cache if self._in_use_cache is not None else self._in_use
        if count <= self._SMALL:
            limit = self.num_blocks
            for block in given:
                if type(block) is not int or not 0 < block < limit or not in_use[block]:
                    # Rare: convert numpy ids, then find the culprit (or free them).
                    given = [_block_id(b) for b in given]
                    if any(not 0 < b < limit or not in_use[b] for b in given):
                        self._reject(given, in_use)
                    break
            if count > 1 and len(set(given)) != count:
                self._reject(given, in_use)
        else:
            if not set(map(type, given)) <= {int}:
                given = [_block_id(b) for b in given]
            arr = np.array(given, dtype=np.int64)
            if (
                arr.min() < 1
                or arr.max() >= self.num_blocks
                or len(set(given)) != len(given)
                or not self._in_use_view[arr].all()
            ):
                self._reject(given, in_use)
        self.give_back(given)

    def _reject(self, given: list[int], in_use: bytearray) -> NoReturn:
        """Raise for the first block of ``given`` that cannot be freed."""
        seen: set[int] = set()
        for block in given:
            if not 0 < block < self.num_blocks:
                raise InvalidArgumentError(
                    f"cannot free block {block!r}: ids run from 1 to {self.num_blocks - 1}"
                )
            if block in seen:
                raise InvalidArgumentError(f"cannot free block {block}: it is given twice")
            if not in_use[block]:
                raise InvalidArgumentError(
                    f"cannot free block {block}: it is not allocated (double free?)"
                )
            seen.add(block)
        raise AssertionError("_reject called for blocks that can all be freed")


Ints32 = npt.NDArray[np.int32]

_MAX_ID = 2**31 - 1  # block tables are int32


class PageSlab:
    """One group's kernel blocks inside the pages it holds: the second level of the
    allocation, for an attention group whose page holds ``k = blocks_per_page > 1``
    kernel blocks.

    Kernel block ``b`` is sub-block ``b % k`` of page ``b // k``. The group takes a
    page from the pool only when none of its pages has a free kernel block left, and
    gives a page back to the pool as soon as every kernel block in it is free, so a page
    belongs to one group at a time and a page the pool hands out holds no live block.
    The kernel blocks of page 0 (the null page) are never handed out.

    Like ``BlockPool.take`` / ``give_back``, ``take`` and ``give_back`` check nothing:
    the block manager checks a step first (``pages_for``, ``preview_give_back``) and
    tracks which request holds which kernel block.

    A kernel block is live while its ref count is above 0 (``refs``; a table entry
    holds one); a page's live blocks are read from its row of ``refs`` (``k``
    entries), so taking a block writes one count and nothing per page. The free kernel
    blocks are an int32 stack (``_stack[:_top]``) with lazy deletion: when a page goes
    back to the pool, its free kernel blocks stay on the stack but no longer count (the
    slab does not own their page) and are dropped as they are popped; a kernel block is
    on the stack at most once (``_listed``), so the stack never outgrows
    ``num_blocks * k`` and every pop is paid for by one earlier push. While no entry is
    stale (``_stale``, the usual case) a pop checks nothing.

    Attributes:
        pool: the pool of pages.
        blocks_per_page: ``k``.
        refs: int32 ``[num_blocks * k]``, read only: the holders of each kernel block
            (0: free).
        owned: bool ``[num_blocks]``, read only: the pages the slab holds.
        num_free_blocks: free kernel blocks in the slab's pages.
        num_pages: pages the slab holds.
    """

    def __init__(self, pool: BlockPool, blocks_per_page: int) -> None:
        if not is_positive_int(blocks_per_page):
            raise InvalidArgumentError(
                f"blocks_per_page must be a positive int, got {blocks_per_page!r}"
            )
        if pool.num_blocks * blocks_per_page > _MAX_ID:
            raise InvalidArgumentError(
                f"{pool.num_blocks} pages x {blocks_per_page} kernel blocks per page "
                f"exceed the int32 ids of block tables ({_MAX_ID})"
            )
        self.pool = pool
        self.blocks_per_page = blocks_per_page
        size = pool.num_blocks * blocks_per_page
        self.refs: Ints32 = np.zeros(size, dtype=np.int32)
        self._refs_by_page: Ints32 = np.reshape(self.refs, (pool.num_blocks, blocks_per_page))
        self.owned: npt.NDArray[np.bool_] = np.zeros(pool.num_blocks, dtype=np.bool_)
        self.num_free_blocks = 0
        self.num_pages = 0
        self._stack: Ints32 = np.zeros(size, dtype=np.int32)
        self._top: int = 0
        self._listed: npt.NDArray[np.bool_] = np.zeros(size, dtype=np.bool_)
        self._listed_by_page: npt.NDArray[np.bool_] = np.reshape(
            self._listed, (pool.num_blocks, blocks_per_page)
        )
        self._stale = 0  # entries on the stack whose page the slab does not hold

    def live_blocks(self, pages: npt.ArrayLike) -> npt.NDArray[np.intp]:
        """Live kernel blocks (ref count above 0) in each of ``pages``."""
        rows = self._refs_by_page[np.asarray(pages, dtype=np.int64)]
        counts: npt.NDArray[np.intp] = np.count_nonzero(rows, axis=-1)
        return counts

    def pages_for(self, n: int, free: int | None = None) -> int:
        """Pages ``take(n)`` takes from the pool when the slab's pages hold ``free``
        free kernel blocks (default: now): ``ceil(max(0, n - free) / k)``."""
        short = n - (self.num_free_blocks if free is None else free)
        return -(-short // self.blocks_per_page) if short > 0 else 0

    def preview_give_back(self, blocks: Ints32 | list[int]) -> tuple[int, int]:
        """``(free kernel blocks in the slab's pages, pages back to the pool)`` once
        ``blocks`` (held once each, distinct) were given back; nothing changes."""
        ids = np.asarray(blocks, dtype=np.int64)
        if ids.size == 0:
            return self.num_free_blocks, 0
        pages, counts = np.unique(ids // self.blocks_per_page, return_counts=True)
        emptied = int(np.count_nonzero(self.live_blocks(pages) == counts))
        return self.num_free_blocks + ids.size - emptied * self.blocks_per_page, emptied

    def take(self, n: int) -> Ints32:
        """Take ``n`` free kernel blocks: every free one in the slab's pages first, then
        from ``pages_for(n)`` new pages (the caller has checked that the pool has them).
        Blocks of a new page come out in order (``p * k``, ``p * k + 1``, ...)."""
        if n <= 0:
            return np.zeros(0, dtype=np.int32)
        if n <= self.num_free_blocks:
            taken = self._pop(n)
        elif self.num_free_blocks:
            # The slab's own free blocks first (fewer half-used pages), then new pages.
            held = self._pop(self.num_free_blocks)
            taken = np.concatenate((held, self._new_pages(n - int(held.size))))
        else:
            taken = self._new_pages(n)
        if n == 1:  # one decode crossing a block boundary: the common case
            self.refs[int(taken[0])] = 1
        else:
            self.refs[taken] = 1
        self.num_free_blocks -= n
        return taken

    def _pop(self, n: int) -> Ints32:
        """Pop ``n`` free kernel blocks of the slab's pages off the stack (top first),
        dropping the stale entries above them (blocks of pages given back)."""
        stack: Ints32 = self._stack
        owned, listed = self.owned, self._listed
        k = self.blocks_per_page
        top = self._top
        if n == 1:
            while True:
                top -= 1
                block = int(stack[top])
                listed[block] = False
                if owned[block // k]:
                    break
                self._stale -= 1
            self._top = top
            return np.array([block], dtype=np.int32)
        if not self._stale:  # every entry is a free block of the slab's pages
            taken: Ints32 = np.array(stack[top - n : top][::-1])
            listed[taken] = False
            self._top = top - n
            return taken
        parts: list[Ints32] = []
        need = chunk = n
        while need:
            # Pop the top ``chunk`` entries (doubling past stale ones), keep the valid.
            count = min(max(chunk, need), top)
            popped: Ints32 = stack[top - count : top][::-1]  # top first
            valid: Ints32 = popped[owned[popped // k]]
            top -= count
            listed[popped] = False
            found = int(valid.size)
            self._stale -= count - found
            if found > need:  # push back the deepest valid ones not needed
                extra: Ints32 = valid[need:][::-1]
                stack[top : top + found - need] = extra
                top += found - need
                listed[extra] = True
                valid = valid[:need]
                found = need
            parts.append(valid)
            need -= found
            chunk *= 2
        self._top = top
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def give_back(self, blocks: Ints32 | list[int]) -> None:
        """Free kernel blocks the caller holds (no checks); pages whose kernel blocks
        are then all free go back to the pool."""
        k = self.blocks_per_page
        if isinstance(blocks, list):
            if not blocks:
                return
            ids = np.array(blocks, dtype=np.int32)
        else:
            if blocks.size == 0:
                return
            ids = blocks.astype(np.int32, copy=False)
        self.num_free_blocks += ids.size
        if ids.size == 1:
            block = int(ids[0])
            page = block // k
            self.refs[block] = 0
            if self._refs_by_page[page].any():
                self._push(ids)
            else:
                self._return_pages(np.array([page], dtype=np.int64))
            return
        self.refs[ids] = 0
        pages = ids // k
        kept = self._refs_by_page[pages].any(axis=1)  # the page still has a live block
        if kept.all():
            self._push(ids)
            return
        self._push(ids[kept])
        self._return_pages(np.unique(pages[~kept]).astype(np.int64))

    def _push(self, ids: Ints32) -> None:
        top, count = self._top, int(ids.size)
        self._stack[top : top + count] = ids
        self._top = top + count
        self._listed[ids] = True

    def _new_pages(self, n: int) -> Ints32:
        """Take the pages that hold ``n`` kernel blocks from the pool (the slab has no
        free block left): their first ``n`` blocks, in order; the rest become free."""
        k = self.blocks_per_page
        count = -(-n // k)
        pages = np.array(self.pool.take(count), dtype=np.int64)
        self.owned[pages] = True
        self.num_pages += count
        self.num_free_blocks += count * k
        if self._stale:
            revived = int(self._listed_by_page[pages].sum())
            if revived:  # blocks still on the stack from the pages' last stay: valid again
                self._stale -= revived
                blocks = (pages[:, None] * k + np.arange(k)).ravel()[::-1].astype(np.int32)
                self._push(blocks[~self._listed[blocks]])
                return self._pop(n)
        if count == 1:
            start = int(pages[0]) * k
            blocks = np.arange(start, start + k, dtype=np.int32)
        else:
            blocks = (pages[:, None] * k + np.arange(k)).ravel().astype(np.int32)
        self._push(blocks[n:][::-1])  # the next block of the last page on top
        return blocks[:n]

    def _return_pages(self, pages: npt.NDArray[np.int64]) -> None:
        """Give pages whose kernel blocks are all free back to the pool."""
        self.owned[pages] = False
        self._stale += int(self._listed_by_page[pages].sum())
        self.num_pages -= pages.size
        self.num_free_blocks -= pages.size * self.blocks_per_page
        self.pool.give_back(pages.tolist())


def _block_id(block: object) -> int:
    """``block`` as a Python int: ints and numpy integers are ids, nothing else is."""
    given = f"{block!r} ({type(block).__name__})"
    if isinstance(block, bool | np.bool_) or not isinstance(block, int | np.integer):
        raise ArgumentTypeError(f"block ids must be ints, got {given}")
    return operator.index(cast("SupportsIndex", block))
