"""Pairwise combinations: rows in which every pair of values of two dimensions appears.

``pairwise(dims, valid, first=...)`` returns rows (one value per dimension) such that
for any two dimensions ``i < j`` and values ``a`` of ``i``, ``b`` of ``j``, some row
holds both, unless no valid row can (the pair is returned as uncovered). Rows are
built greedily and deterministically: the seed rows given first, then, while a pair
is uncovered, a row that starts from the first uncovered pair (in dimension order,
then value order) and fills each other dimension, in order, with the value that
covers most still-uncovered pairs with the values already chosen (ties: the earlier
value), among those ``valid`` accepts with the dimensions not yet chosen at their
first value; a pair no row completes that way is uncovered. ``valid`` sees whole rows; its answers are cached.

A greedy pairwise set has about ``|A| * |B|`` rows for the two largest dimensions
``A`` and ``B``, against ``prod(|D|)`` for every combination.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

__all__ = ["pairwise"]

V = TypeVar("V", bound=Hashable)

Pair = tuple[int, int, int, int]
"""``(dimension i, value index in i, dimension j, value index in j)``, ``i < j``."""


def pairwise(
    dims: Sequence[Sequence[V]],
    valid: Callable[[tuple[V, ...]], bool],
    *,
    first: Sequence[tuple[V, ...]] = (),
) -> tuple[list[tuple[V, ...]], list[tuple[int, V, int, V]]]:
    """Rows covering every pair ``valid`` allows, and the pairs no valid row holds
    (``(dimension, value, dimension, value)``). ``first``: rows to take as they are
    (those ``valid`` accepts), before any other."""
    seen: dict[tuple[V, ...], bool] = {}

    def ok(row: tuple[V, ...]) -> bool:
        if row not in seen:
            seen[row] = valid(row)
        return seen[row]

    n = len(dims)
    uncovered: set[Pair] = {
        (i, a, j, b)
        for i in range(n)
        for j in range(i + 1, n)
        for a in range(len(dims[i]))
        for b in range(len(dims[j]))
    }

    def cover(indices: Sequence[int]) -> None:
        for i in range(n):
            for j in range(i + 1, n):
                uncovered.discard((i, indices[i], j, indices[j]))

    def as_row(indices: Sequence[int | None]) -> tuple[V, ...]:
        return tuple(dims[d][0 if k is None else k] for d, k in enumerate(indices))

    def gain(chosen: Sequence[int | None], d: int, k: int) -> int:
        """Uncovered pairs value ``k`` of dimension ``d`` covers with the chosen values."""
        return sum(
            ((e, c, d, k) if e < d else (d, k, e, c)) in uncovered
            for e, c in enumerate(chosen)
            if c is not None
        )

    rows: list[tuple[V, ...]] = []
    for row in first:
        if ok(row) and row not in rows:
            rows.append(row)
            cover([list(dims[d]).index(v) for d, v in enumerate(row)])

    def complete(seed: Pair) -> list[int] | None:
        """A valid row holding ``seed``'s pair, filled greedily; ``None`` if none is found."""
        i, a, j, b = seed
        chosen: list[int | None] = [None] * n
        chosen[i], chosen[j] = a, b
        for d in range(n):
            if chosen[d] is not None:
                continue
            gains = [gain(chosen, d, k) for k in range(len(dims[d]))]
            for k in sorted(range(len(dims[d])), key=lambda k: (-gains[k], k)):
                chosen[d] = k
                if ok(as_row(chosen)):
                    break
            else:
                return None
        indices = [0 if k is None else k for k in chosen]
        return indices if ok(as_row(indices)) else None

    impossible: list[Pair] = []
    while uncovered:
        seed = min(uncovered)
        found = complete(seed)
        if found is None:
            uncovered.discard(seed)
            impossible.append(seed)
        else:
            rows.append(as_row(found))
            cover(found)
    missing = [(i, dims[i][a], j, dims[j][b]) for i, a, j, b in sorted(impossible)]
    return rows, missing
