"""What the kinds' prefix-cache hit rules share: ``TokenLayout`` (how a kind lays a
request's tokens into blocks), ``BlockLookup`` (which of a request's blocks a group has
cached), the rules derived from a kind's mask (``paged_hit``, ``paged_blocks``) and the
state kind's (``checkpoint_hit``), and why a prefix is not served: ``PrefixMiss`` and its
kinds, each one line a user can act on.

A hit of ``L`` tokens means the request starts with ``L`` computed tokens whose cache it
reads from shared blocks; its next token (position ``L``) is computed, so a hit must end
on a block boundary of every attention group (that token starts a fresh block) and the
blocks the next queries can still see must be cached. Which blocks those are follows
from the kind's mask (``Mask``): every earlier block for full attention; for a window
``W`` the blocks holding positions ``L - W + 1 .. L - 1``; for a chunk ``C`` those of the
current chunk, ``(L // C) * C .. L - 1``; the sink slots always (they sit in block 0).
Later queries see no further back than the one at ``L``, so it alone decides.
"""

from __future__ import annotations

import bisect
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Literal, TypeAlias, cast

import numpy as np
import numpy.typing as npt
from typing_extensions import override

from .._validation import check_positive_int
from ..errors import ArgumentTypeError, InvalidArgumentError

__all__ = [  # what the kinds' modules and the package use
    "BelowMinimum",
    "BlockLookup",
    "BlockNotCached",
    "MissCause",
    "NeverHits",
    "NoCheckpoint",
    "NotFullBlock",
    "PrefixMiss",
    "TokenLayout",
    "_check_length",
    "checkpoint_hit",
    "paged_blocks",
    "paged_hit",
]

BlockLookup: TypeAlias = npt.NDArray[np.bool_] | Callable[[int], bool]
"""Which of a request's blocks a group holds: a bool per block of the group's layout
(entries past the end count as not cached), or a lookup ``cached(block) -> bool``. The
state kind reads it by length instead: entry (or argument) ``L`` says whether a state
checkpoint after ``L`` tokens exists (``KindRules.prefix_unit``)."""

MissCause = Literal["never_computed", "evicted", "other_salt"]
"""Why a block is not cached, when the caller can tell: no request computed it, it was
evicted, or it is cached under another cache salt."""


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """How a group lays a request's tokens into blocks: block ``b`` holds positions
    ``b * block_size .. (b + 1) * block_size - 1``, and token ``t`` sits at position
    ``shift + t`` (sink tokens fill the first ``shift`` positions), so block 0 holds
    ``block_size - shift`` tokens (none while ``shift >= block_size``).

    Attributes:
        block_size: positions per block (the kernels' block size).
        shift: positions in front of the request's tokens (``sink_len``; 0 for most kinds).
    """

    block_size: int
    shift: int = 0

    def __post_init__(self) -> None:
        check_positive_int("TokenLayout", "block_size", self.block_size)
        shift: object = self.shift
        if isinstance(shift, bool) or not isinstance(shift, int) or shift < 0:
            raise InvalidArgumentError(f"TokenLayout.shift must be an int >= 0, got {shift!r}")

    def full_blocks(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens fill completely."""
        return (num_tokens + self.shift) // self.block_size

    def tokens_of(self, block: int) -> tuple[int, int]:
        """The tokens ``start .. end - 1`` block ``block`` holds (``start == end`` for a
        block of sink slots only)."""
        end = max(0, (block + 1) * self.block_size - self.shift)
        return min(end, max(0, block * self.block_size - self.shift)), end

    def floor(self, length: int) -> int:
        """The longest prefix ``<= length`` that ends on a block boundary (0 if none)."""
        aligned = (length + self.shift) // self.block_size * self.block_size - self.shift
        return max(aligned, 0)

    def ends_a_block(self, length: int) -> bool:
        """Whether a prefix of ``length >= 1`` tokens ends on a block boundary."""
        return (length + self.shift) % self.block_size == 0

    @override
    def __str__(self) -> str:
        shifted = f", shifted by {self.shift}" if self.shift else ""
        return f"blocks of {self.block_size}{shifted}"


class PrefixMiss(ABC):
    """Why a group (or the model) serves less of a prompt than asked.

    ``explain()`` (and ``str()``) is one line a user can act on.
    """

    @abstractmethod
    def explain(self) -> str:
        """The reason in words."""

    @override
    def __str__(self) -> str:
        return self.explain()


@dataclasses.dataclass(frozen=True)
class NotFullBlock(PrefixMiss):
    """The prompt's tail does not fill a block: only full blocks are cached.

    Attributes:
        length: the tokens asked for.
        served: where the last full block ends.
        block: the block the tail falls in.
        block_size: the group's block size.
    """

    length: int
    served: int
    block: int
    block_size: int

    @override
    def explain(self) -> str:
        return (
            f"tokens {self.served}..{self.length - 1} do not fill block {self.block} "
            f"({self.block_size} tokens): only full blocks are cached"
        )


@dataclasses.dataclass(frozen=True)
class BlockNotCached(PrefixMiss):
    """A block the hit needs is not in the cache.

    Attributes:
        block: its index in the group's layout.
        start, end: the tokens ``start .. end - 1`` it holds.
        cause: why, when the caller could tell (``MissCause``), else ``None``.
    """

    block: int
    start: int
    end: int
    cause: MissCause | None = None

    @override
    def explain(self) -> str:
        tokens = f"tokens {self.start}..{self.end - 1}" if self.end > self.start else "sink slots"
        what = f"block {self.block} ({tokens})"
        if self.cause == "evicted":
            return f"{what} was evicted: a larger cache keeps blocks longer"
        if self.cause == "never_computed":
            return f"{what} was never computed: no earlier request had this prefix"
        if self.cause == "other_salt":
            return (
                f"{what} is cached under a different cache salt: requests share blocks "
                f"only with the same cache_salt"
            )
        return f"{what} is not cached"


@dataclasses.dataclass(frozen=True)
class NoCheckpoint(PrefixMiss):
    """No state checkpoint at the length asked (state layers resume only from one).

    Attributes:
        length: the tokens asked for.
        latest: the longest shorter prefix with a checkpoint (0: none).
    """

    length: int
    latest: int

    @override
    def explain(self) -> str:
        below = f"the latest before it is at {self.latest}" if self.latest else "none before it"
        return (
            f"no state checkpoint at token {self.length} ({below}): state layers resume "
            f"only from a checkpoint (the checkpoint policy decides where they are taken)"
        )


@dataclasses.dataclass(frozen=True)
class NeverHits(PrefixMiss):
    """A kind (or a model) that never serves a cached prefix.

    Attributes:
        who: the kind's name (``"cross_attention"``) or what else never hits.
        why: the reason in words.
    """

    who: str
    why: str

    @override
    def explain(self) -> str:
        return f"{self.who} never hits the prefix cache: {self.why}"


@dataclasses.dataclass(frozen=True)
class BelowMinimum(PrefixMiss):
    """The prompt is shorter than the model's minimum cacheable prefix.

    Attributes:
        length: the tokens that could hit (the prompt less its last token).
        minimum: the shortest prefix every group can serve.
    """

    length: int
    minimum: int

    @override
    def explain(self) -> str:
        return (
            f"{self.length} cacheable tokens (a prompt's last token is always recomputed) "
            f"are below this model's minimum cacheable prefix of {self.minimum} tokens"
        )


# ---------------------------------------------------------------------------- rules


def _check_length(length: object) -> int:
    if isinstance(length, bool) or not isinstance(length, int | np.integer):
        raise ArgumentTypeError(f"prefix_hit: length must be an int, got {type(length).__name__}")
    number = int(cast(Any, length))
    if number < 0:
        raise InvalidArgumentError(f"prefix_hit: length must be >= 0, got {number}")
    return number


def _as_mask_array(cached: npt.NDArray[np.bool_], size: int) -> npt.NDArray[np.bool_]:
    """``cached`` as a bool array of exactly ``size`` entries (missing ones False)."""
    if cached.ndim != 1 or cached.dtype != np.bool_:
        raise InvalidArgumentError(
            f"prefix_hit: cached must be a 1-d bool array (or a callable), got a "
            f"{cached.ndim}-d {cached.dtype} array"
        )
    if cached.size >= size:
        return cached[:size]
    out = np.zeros(size, dtype=np.bool_)
    out[: cached.size] = cached
    return out


class _Needs:
    """The blocks a hit needs, as a kind's mask says, for a hit ending at block ``k``
    (so the next query sits at position ``k * block_size``): ``[low(k), k)`` plus the
    sink blocks ``[0, min(sink_blocks, k))``."""

    def __init__(
        self, layout: TokenLayout, window: int | None, chunk: int | None, sink_len: int
    ) -> None:
        self.bs = layout.block_size
        self.window, self.chunk = window, chunk
        self.sink_blocks = -(-sink_len // self.bs)
        self.local = self.window is not None or self.chunk is not None

    def low_of(self, k: int) -> int:
        """``low(k)``: the first block a query at position ``k * block_size`` sees."""
        p = k * self.bs
        lo = 0
        if self.window is not None:
            lo = max(lo, p - self.window + 1)
        if self.chunk is not None:
            lo = max(lo, p // self.chunk * self.chunk)
        return lo // self.bs

    def lows(self, ends: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``low(k)`` of every ``k`` in ``ends`` (as :meth:`low_of`)."""
        p = ends * self.bs
        lo = np.zeros_like(p)
        if self.window is not None:
            lo = np.maximum(lo, p - self.window + 1)
        if self.chunk is not None:
            lo = np.maximum(lo, p // self.chunk * self.chunk)
        return lo // self.bs

    def blocks(self, k: int) -> npt.NDArray[np.int64]:
        lo = self.low_of(k)
        sinks = min(self.sink_blocks, lo)
        if not sinks:
            return np.arange(lo, k, dtype=np.int64)
        return np.concatenate([np.arange(sinks, dtype=np.int64), np.arange(lo, k, dtype=np.int64)])


def _highest_miss(needs: _Needs, k: int, cached: BlockLookup) -> int:
    """The highest block the hit ending at block ``k`` needs that is not cached (one
    must exist: the caller saw that hit refused)."""
    if callable(cached):
        for b in reversed(needs.blocks(k).tolist()):
            if not cached(b):
                return int(b)
    else:
        blocks = needs.blocks(k)
        missing = blocks[~_as_mask_array(cached, k)[blocks]]
        if missing.size:
            return int(missing[-1])
    raise AssertionError("a refused hit needs a block that is not cached")


WALK_MISSES = 48
"""An array with at most this many misses is walked (a step per miss it passes, each a
bisection); with more, every candidate end is checked at once (a few array passes,
whatever the misses). Measured here (window 64, blocks of 16): the walk about 0.6 us a
step, the count 29 us over 64 blocks and 44 us over 512 (a walk over 512 misses: 315
us)."""


def _walk_misses(needs: _Needs, misses: list[int], k_min: int, k_top: int) -> int | None:
    """The lookup's walk over the sorted misses: a hit ending at ``end`` is refused by
    the highest miss in ``[low(end), end)``, else by the highest one in the sink blocks
    before ``low(end)``; the next candidate ends at that miss."""
    end = k_top
    while end >= k_min:
        lo = needs.low_of(end)
        at = bisect.bisect_left(misses, end) - 1  # the highest miss below end
        if at < 0 or misses[at] < lo:
            at = bisect.bisect_left(misses, min(needs.sink_blocks, lo)) - 1
            if at < 0:
                return end
        end = misses[at]
    return None


def _count_misses(
    needs: _Needs, missed: npt.NDArray[np.bool_], k_min: int, k_top: int
) -> int | None:
    """The same end by counting (``missed``: a bool per block): a hit ending at block
    ``e`` is served when no block of ``[low(e), e)`` misses, nor a sink block before
    ``low(e)`` (``before[i]``: the misses in ``[0, i)``); the longest served."""
    before = np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(missed, dtype=np.int64)))
    ends = np.arange(k_min, k_top + 1, dtype=np.int64)
    lows = needs.lows(ends)
    sinks = np.minimum(needs.sink_blocks, lows)
    served = np.flatnonzero((before[ends] == before[lows]) & (before[sinks] == 0))
    return int(ends[served[-1]]) if served.size else None


def paged_hit(
    layout: TokenLayout,
    cached: BlockLookup,
    length: int,
    *,
    window: int | None = None,
    chunk: int | None = None,
    sink_len: int = 0,
) -> tuple[int, PrefixMiss | None]:
    """The longest prefix ``<= length`` a paged group serves, and why it is shorter.

    A prefix of ``L >= 1`` tokens is served when it ends on a block boundary of
    ``layout`` and every block its next query can see is cached (the kind's mask:
    ``window``, ``chunk``, ``sink_len``; module docstring); 0 is always served.

    ``cached`` is a bool per block or a lookup. Full attention's hit ends at the first
    miss (a lookup asks blocks left to right up to it). With windows and chunks a lookup
    walks right to left: a miss at block ``m`` refuses every hit ending past ``m`` that
    still sees it, so the next candidate ends at ``m``, and each block is asked once
    (plus the few the reason's block is found among); an array's misses are walked the
    same way, or its candidates all checked at once against a running count of its
    misses when it has more than ``WALK_MISSES``.
    The reason for a shorter hit: the tail is not a full block, or the highest missing
    block a hit one block longer would need.
    """
    length = _check_length(length)
    top = layout.floor(length)
    bs, shift = layout.block_size, layout.shift
    if top == 0:
        if length == 0:
            return 0, None
        return 0, NotFullBlock(length, 0, (length + shift) // bs, bs)
    needs = _Needs(layout, window, chunk, sink_len)
    k_top = (top + shift) // bs
    k_min = shift // bs + 1  # the first block end with at least one token before it
    best: int | None
    if not callable(cached) and not needs.local:
        # Every block before the hit's end is needed: the hit ends at the first miss.
        held = _as_mask_array(cached, k_top)
        first_miss = k_top if held.all() else int(held.argmin())
        best = first_miss if first_miss >= k_min else None
    elif not callable(cached):
        missed = ~_as_mask_array(cached, k_top)
        misses = np.flatnonzero(missed)
        if misses.size <= WALK_MISSES:
            best = _walk_misses(needs, misses.tolist(), k_min, k_top)
        else:
            best = _count_misses(needs, missed, k_min, k_top)
    elif not needs.local:
        first_miss = 0
        while first_miss < k_top and cached(first_miss):
            first_miss += 1
        best = first_miss if first_miss >= k_min else None
    else:
        k: int = k_top
        best = None
        while k >= k_min:
            lo = needs.low_of(k)
            found = next((b for b in range(k - 1, lo - 1, -1) if not cached(b)), None)
            if found is None:
                found = next(
                    (b for b in range(min(needs.sink_blocks, lo) - 1, -1, -1) if not cached(b)),
                    None,
                )
            if found is None:
                best = k
                break
            k = found
    if best == k_top:
        if top == length:
            return top, None
        return top, NotFullBlock(length, top, k_top, bs)
    refused = k_min if best is None else best + 1
    block = _highest_miss(needs, refused, cached)
    start, end = layout.tokens_of(block)
    return (0 if best is None else best * bs - shift), BlockNotCached(block, start, end)


def paged_blocks(
    layout: TokenLayout,
    length: int,
    *,
    window: int | None = None,
    chunk: int | None = None,
    sink_len: int = 0,
) -> npt.NDArray[np.int64]:
    """The blocks (sorted indices in ``layout``) a hit of ``length`` tokens reads: the
    ones ``paged_hit`` requires; the request's other blocks before them stay null.

    Raises:
        InvalidArgumentError: ``length`` does not end on a block boundary.
    """
    length = _check_length(length)
    if length == 0:
        return np.zeros(0, dtype=np.int64)
    if not layout.ends_a_block(length):
        raise InvalidArgumentError(
            f"prefix_blocks: length must end on a block boundary ({layout}), got {length}"
        )
    return _Needs(layout, window, chunk, sink_len).blocks((length + layout.shift) // layout.block_size)


def checkpoint_hit(cached: BlockLookup, length: int) -> tuple[int, PrefixMiss | None]:
    """The longest prefix ``<= length`` a state group serves: one with a state checkpoint
    after it (``cached[L]`` / ``cached(L)``); 0 is always served. A lookup is asked from
    ``length`` down; an array is searched at once."""
    length = _check_length(length)
    if length == 0:
        return 0, None
    if callable(cached):
        found = next((n for n in range(length, 0, -1) if cached(n)), 0)
    else:
        hits = np.flatnonzero(_as_mask_array(cached, length + 1)[1:])
        found = int(hits[-1]) + 1 if hits.size else 0
    return found, (None if found == length else NoCheckpoint(length, found))
