"""The combined hit over a model's groups, and the model's granularity.

A prompt of ``n`` tokens can hit at most ``n - 1`` tokens (its last token is always
computed, so its logits exist). Each group serves the longest prefix ``<=`` a candidate
that its kind's rule allows (``KindRules.prefix_hit``); the combined hit is the longest
prefix every group serves, found as a fixed point: every group answers the first
candidate alone (its own hit), the candidate becomes the smallest answer, and the
groups are asked again until none lowers it. It only falls and each answer is the
largest servable length below the candidate, so it stops at the longest length all
groups serve, whatever the groups' order and however many there are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Container, Iterable, Sequence

from typing_extensions import override

from .._validation import is_nonnegative_int, is_positive_int
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..kinds import (
    BelowMinimum,
    BlockLookup,
    BlockNotCached,
    MissCause,
    NeverHits,
    PrefixMiss,
    TokenLayout,
    rules_for,
)
from ..spec import KVCacheSpec

__all__ = [
    "GroupHit",
    "GroupLookup",
    "PrefixGranularity",
    "PrefixHit",
    "checkpoint_interval_for",
    "find_prefix_hit",
    "miss_causes",
    "prefix_granularity",
]


@dataclasses.dataclass(frozen=True)
class PrefixGranularity:
    """Where a model's hits can end: ``minimum`` is the shortest prefix every group can
    serve (its **minimum cacheable prefix**); ``None`` when no prefix can hit, with
    ``never`` saying why.

    Attributes:
        minimum: the minimum cacheable prefix in tokens, or ``None``.
        layouts: the distinct token layouts the groups name blocks in.
        never: why nothing can hit (a kind that never hits, block grids that never
            meet), else ``None``.
    """

    minimum: int | None
    layouts: tuple[TokenLayout, ...]
    never: NeverHits | None = None

    @override
    def __str__(self) -> str:
        if self.minimum is None:
            return f"no prefix is cacheable: {self.never}"
        grids = "; ".join(str(layout) for layout in self.layouts) or "state checkpoints"
        return f"minimum cacheable prefix {self.minimum} tokens ({grids})"


def _first_common_end(grids: Sequence[TokenLayout]) -> int | None:
    """The smallest ``L >= 1`` on which every grid ends a block, or ``None``."""
    if not grids:
        return 1
    widest = max(grids, key=lambda g: g.block_size)
    period = math.lcm(*(g.block_size for g in grids))
    for k in range(1, period // widest.block_size + 2 + widest.shift // widest.block_size):
        length = k * widest.block_size - widest.shift
        if length >= 1 and all(g.ends_a_block(length) for g in grids):
            return length
    return None


def prefix_granularity(
    specs: Iterable[KVCacheSpec], *, checkpoint_interval: int | None = None
) -> PrefixGranularity:
    """The granularity of a model's prefix cache, from its groups' specs: a hit must
    end on a block boundary of every attention group (the next token starts a fresh
    block), and, given a state checkpoint interval, on a checkpoint.

    Raises:
        InvalidArgumentError: a ``checkpoint_interval`` that is not a positive int.
    """
    if checkpoint_interval is not None and not is_positive_int(checkpoint_interval):
        raise InvalidArgumentError(
            f"checkpoint_interval must be a positive int or None, got {checkpoint_interval!r}"
        )
    layouts: list[TokenLayout] = []
    grids: list[TokenLayout] = []
    never: NeverHits | None = None
    count = 0
    for spec in specs:
        count += 1
        rules = rules_for(spec)
        why = rules.prefix_never_hits(spec)
        if why is not None:
            never = never or NeverHits(rules.kind.value, why)
            continue
        layout = rules.prefix_layout(spec)
        if layout is None:  # a state group: its checkpoints decide
            if checkpoint_interval is not None:
                grids.append(TokenLayout(checkpoint_interval))
            continue
        if layout not in layouts:
            layouts.append(layout)
        grids.append(layout)
    if not count:
        never = NeverHits("a model without cached layers", "it has no KV-cache groups")
    if never is not None:
        return PrefixGranularity(None, tuple(layouts), never)
    minimum = _first_common_end(grids)
    if minimum is None:
        return PrefixGranularity(
            None,
            tuple(layouts),
            NeverHits(
                "this model",
                f"its groups' blocks never end together ({'; '.join(map(str, grids))})",
            ),
        )
    return PrefixGranularity(minimum, tuple(layouts))


def checkpoint_interval_for(specs: Iterable[KVCacheSpec], interval: int | None = None) -> int:
    """The state checkpoint interval of a model: ``interval`` checked, or by default the
    least common multiple of its cacheable attention groups' block sizes (its minimum
    cacheable prefix without state layers: a hit ends on a block boundary of each
    attention group, so no shorter spacing could serve more hits); with no attention
    group, of its state groups' ``block_size``.

    Raises:
        InvalidArgumentError: ``interval`` is not a multiple of every cacheable
            attention group's block size (the message names
            ``prefix_caching.checkpoint_interval`` and the groups).
    """
    sizes: dict[str, int] = {}
    state: list[int] = []
    for i, spec in enumerate(specs):
        rules = rules_for(spec)
        if rules.prefix_never_hits(spec) is not None:
            continue
        if rules.prefix_layout(spec) is None:
            state.append(spec.block_size)
        else:
            sizes[f"group {i} ({spec.kind.value})"] = spec.block_size
    if interval is None:
        return math.lcm(*sizes.values()) if sizes else math.lcm(*state) if state else 1
    bad = {label: size for label, size in sizes.items() if interval % size}
    if bad:
        listed = ", ".join(f"{label}: {size}" for label, size in bad.items())
        raise InvalidArgumentError(
            f"prefix_caching.checkpoint_interval must be a multiple of every attention "
            f"group's kernel block size (a hit ends on a block boundary of each), got "
            f"{interval}; not a multiple of {listed} (least common multiple "
            f"{math.lcm(*sizes.values())})"
        )
    return interval


@dataclasses.dataclass(frozen=True)
class GroupLookup:
    """One group's side of a lookup.

    Attributes:
        spec: the group's spec.
        cached: which of the request's blocks the group holds, in its kind's
            ``prefix_layout`` (a bool per block, or ``cached(block)``); for a state
            group, by length (``KindRules.prefix_unit``).
        label: how reports name the group (default ``"group i (kind)"``).
        miss_cause: why block ``b`` is not cached, when the caller can tell
            (``miss_causes``); asked only for the block a reason names.
    """

    spec: KVCacheSpec
    cached: BlockLookup
    label: str = ""
    miss_cause: Callable[[int], MissCause | None] | None = None


@dataclasses.dataclass(frozen=True)
class GroupHit:
    """A group's own answer to the first candidate.

    Attributes:
        label: the group's name in reports.
        kind: its spec kind's value.
        length: the longest prefix the group alone serves (``<=`` the candidate).
        reason: why that is shorter than the candidate, else ``None``.
    """

    label: str
    kind: str
    length: int
    reason: PrefixMiss | None

    @override
    def __str__(self) -> str:
        return f"{self.label}: {self.length}" + (f" ({self.reason})" if self.reason else "")


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """The result of a lookup: the hit, each group's own hit, and why it is not longer.

    Attributes:
        num_tokens: the prompt's tokens.
        candidate: the longest hit asked for (``num_tokens - 1`` unless capped).
        length: the tokens every group serves: the request starts with this many
            computed tokens.
        groups: each group's own hit, in the order given.
        limiting: the index of the group that set ``length``, or ``None`` when the model
            as a whole did (below the minimum cacheable prefix, no cacheable prefix) or
            nothing limited it.
        reason: why ``length`` is below ``candidate``, else ``None``.
        minimum: the model's minimum cacheable prefix (``None``: nothing can hit).
        rounds: how many times the groups were asked (a measure of the fixed point).
    """

    num_tokens: int
    candidate: int
    length: int
    groups: tuple[GroupHit, ...]
    limiting: int | None
    reason: PrefixMiss | None
    minimum: int | None
    rounds: int = 1

    def explain(self) -> str:
        """One line: the hit and, when it is short, which group limited it and why."""
        head = f"prefix hit {self.length} of {self.num_tokens} prompt tokens"
        if self.reason is None:
            if self.num_tokens and self.length == self.num_tokens - 1:
                return f"{head} (all but the last, which is always computed)"
            return head
        if self.limiting is None:
            return f"{head}: {self.reason}"
        return f"{head}: limited by {self.groups[self.limiting].label}: {self.reason}"

    @override
    def __str__(self) -> str:
        return self.explain()


def miss_causes(
    names: Sequence[bytes],
    *,
    evicted: Container[bytes] = frozenset(),
    salt_free_first: bytes | None = None,
    cached_salt_free_firsts: Container[bytes] = frozenset(),
) -> Callable[[int], MissCause]:
    """A ``GroupLookup.miss_cause`` from what a cache remembers: block 0 is cached
    under another salt when the request's salt-free name of its first block
    (``salt_free_first``) is among the salt-free names of cached first blocks;
    otherwise a block was evicted when its name is among the recently ``evicted`` ones,
    and never computed if not."""

    def cause(block: int) -> MissCause:
        if block == 0 and salt_free_first is not None and salt_free_first in cached_salt_free_firsts:
            return "other_salt"
        if 0 <= block < len(names) and names[block] in evicted:
            return "evicted"
        return "never_computed"

    return cause


def _refined(reason: PrefixMiss | None, group: GroupLookup) -> PrefixMiss | None:
    if isinstance(reason, BlockNotCached) and reason.cause is None and group.miss_cause:
        cause = group.miss_cause(reason.block)
        if cause is not None:
            return dataclasses.replace(reason, cause=cause)
    return reason


def find_prefix_hit(
    groups: Sequence[GroupLookup],
    num_tokens: int,
    *,
    max_length: int | None = None,
    granularity: PrefixGranularity | None = None,
) -> PrefixHit:
    """The longest prefix of a ``num_tokens``-token prompt every group serves.

    Args:
        groups: every KV-cache group of the model, with what each has cached.
        num_tokens: the prompt's length; at most ``num_tokens - 1`` tokens hit.
        max_length: a lower cap on the hit, if any.
        granularity: ``prefix_granularity`` of the groups' specs, when the caller keeps
            it (computed otherwise).

    Raises:
        ArgumentTypeError: a group that is not a ``GroupLookup``.
        InvalidArgumentError: a negative ``num_tokens`` or ``max_length``.
    """
    for i, g in enumerate(groups):
        if not isinstance(g, GroupLookup):
            raise ArgumentTypeError(f"groups[{i}] must be a GroupLookup, got {type(g).__name__}")
    for name, value in (("num_tokens", num_tokens), ("max_length", max_length)):
        if value is not None and not is_nonnegative_int(value):
            raise InvalidArgumentError(f"{name} must be an int >= 0, got {value!r}")
    candidate = max(num_tokens - 1, 0)
    if max_length is not None:
        candidate = min(candidate, max_length)
    if granularity is None:
        granularity = prefix_granularity(g.spec for g in groups)
    rules = [rules_for(g.spec) for g in groups]
    labels = [g.label or f"group {i} ({g.spec.kind.value})" for i, g in enumerate(groups)]

    def serve(i: int, length: int) -> tuple[int, PrefixMiss | None]:
        return rules[i].prefix_hit(groups[i].spec, groups[i].cached, length)

    alone = [serve(i, candidate) for i in range(len(groups))]
    own = tuple(
        GroupHit(labels[i], g.spec.kind.value, n, _refined(r, g))
        for i, (g, (n, r)) in enumerate(zip(groups, alone, strict=True))
    )

    def result(length: int, limiting: int | None, reason: PrefixMiss | None, rounds: int) -> PrefixHit:
        return PrefixHit(
            num_tokens, candidate, length, own, limiting, reason, granularity.minimum, rounds
        )

    if granularity.minimum is None:
        never = next((i for i, (_, r) in enumerate(alone) if isinstance(r, NeverHits)), None)
        return result(0, never, own[never].reason if never is not None else granularity.never, 1)
    if candidate < granularity.minimum:
        below = BelowMinimum(candidate, granularity.minimum) if candidate or num_tokens else None
        return result(0, None, below, 1)
    if not groups:
        return result(candidate, None, None, 1)
    limiting = min(range(len(groups)), key=lambda i: alone[i][0])
    length = alone[limiting][0]
    reason: PrefixMiss | None = alone[limiting][1]
    if length == candidate:
        return result(length, None, None, 1)
    asked = [candidate] * len(groups)  # the candidate each group last answered
    asked[limiting] = length  # its answer is its own fixed point
    rounds = 1
    changed = True
    while changed and length > 0:
        changed = False
        rounds += 1
        for i in range(len(groups)):
            if asked[i] == length:
                continue
            served, why = serve(i, length)
            asked[i] = served
            if served < length:
                length, reason, limiting, changed = served, why, i, True
    return result(length, limiting, _refined(reason, groups[limiting]), rounds)
