"""The block pool: a fixed set of block ids, of which id 0 (the null block) is never
handed out."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import NoReturn, SupportsIndex, cast

import numpy as np
import numpy.typing as npt

from .._validation import is_nonnegative_int, is_positive_int
from ..errors import ArgumentTypeError, InvalidArgumentError, OutOfBlocksError

NULL_BLOCK = 0


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
        free = self._free
        if n == 1:  # one decode growing: the common case
            blocks = [free.pop()]
        elif n > 0:
            blocks = free[: -n - 1 : -1]  # the top n, top first
            del free[-n:]
        else:
            return []
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


def _block_id(block: object) -> int:
    """``block`` as a Python int: ints and numpy integers are ids, nothing else is."""
    given = f"{block!r} ({type(block).__name__})"
    if isinstance(block, bool | np.bool_) or not isinstance(block, int | np.integer):
        raise ArgumentTypeError(f"block ids must be ints, got {given}")
    return operator.index(cast("SupportsIndex", block))
