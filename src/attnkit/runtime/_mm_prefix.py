"""Bidirectional image ranges (``ScheduledRequest.mm_prefix_ranges``): the runtime keeps
each request's ranges while some of them are still ahead of its cache, refuses a step
that would cut one (a chunk boundary or a prefix hit strictly inside it), and lays out
the step's ranges for the groups whose layers take them (``Mask.mm_prefix``): int32
``[B, R, 2]`` padded with ``(0, 0)``, ``R = config.max_mm_prefix_ranges``, plus the
count per request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ..kinds import Ints, StepLens
from ._requests import ScheduledRequest

__all__ = ["MMPrefixRanges", "StepRanges"]

StepRanges = dict[str, Ints]
"""Request id -> its ranges ``[n, 2]`` (int64) that some query of the step may need."""


def _cut(ranges: Ints, at: int) -> int | None:
    """The index of the range ``at`` falls strictly inside, or ``None``."""
    inside = np.flatnonzero((ranges[:, 0] < at) & (at < ranges[:, 1]))
    return int(inside[0]) if inside.size else None


def _span(ranges: Ints, k: int) -> str:
    return f"[{int(ranges[k, 0])}, {int(ranges[k, 1])})"


class MMPrefixRanges:
    """The live requests' image ranges; checks a step and makes its metadata tensors."""

    def __init__(self, max_ranges: int, max_model_len: int) -> None:
        self.max_ranges = max_ranges
        self.max_model_len = max_model_len
        # Only requests with a range not yet wholly in the cache: decodes cost nothing.
        self._live: dict[str, Ints] = {}

    def step(
        self,
        scheduled: Sequence[ScheduledRequest],
        ids: Sequence[str],
        rows: Ints,
        lens: StepLens,
    ) -> StepRanges:
        """The step's ranges (scheduled order), after checking them; changes nothing.

        Raises:
            InvalidArgumentError: too many ranges, a range past ``max_model_len``, a
                prefix hit or the step's end strictly inside a range (naming the
                request and the range).
        """
        found: StepRanges = {}
        new: list[int] = np.flatnonzero(rows < 0).tolist()
        for i in new:  # new requests bring their ranges
            given = scheduled[i].mm_prefix_ranges
            if not given:
                continue
            rid = ids[i]
            if len(given) > self.max_ranges:
                raise InvalidArgumentError(
                    f"request {rid!r}: mm_prefix_ranges has {len(given)} ranges; "
                    f"AttentionConfig.max_mm_prefix_ranges={self.max_ranges} allows at "
                    f"most that many"
                )
            ranges: Ints = np.array([list(pair) for pair in given], dtype=np.int64)
            if int(ranges[-1, 1]) > self.max_model_len:
                raise InvalidArgumentError(
                    f"request {rid!r}: mm_prefix_ranges[{len(given) - 1}] = "
                    f"{_span(ranges, len(given) - 1)} ends past AttentionConfig."
                    f"max_model_len={self.max_model_len}"
                )
            hit = int(lens.computed[i])
            k = _cut(ranges, hit) if hit else None
            if k is not None:
                raise InvalidArgumentError(
                    f"request {rid!r}: its prefix hit (prefix.num_tokens={hit}) ends "
                    f"strictly inside image range mm_prefix_ranges[{k}] = {_span(ranges, k)}; "
                    f"a range is computed whole: match at most {int(ranges[k, 0])} tokens "
                    f"(or all of it)"
                )
            found[rid] = ranges
        if not found and not self._live:
            return found
        index = {rid: i for i, rid in enumerate(ids)}
        for rid, ranges in self._live.items():
            j = index.get(rid)
            if j is not None and rid not in found and rows[j] >= 0:
                found[rid] = ranges
        for rid, ranges in found.items():
            i = index[rid]
            end = int(lens.total[i])
            k = _cut(ranges, end)
            if k is not None:
                raise InvalidArgumentError(
                    f"request {rid!r}: the step ends at token {end} ({int(lens.computed[i])} "
                    f"computed + {int(lens.query[i])} new), strictly inside image range "
                    f"mm_prefix_ranges[{k}] = {_span(ranges, k)}; a range is scheduled "
                    f"whole: end the chunk at {int(ranges[k, 0])} or at {int(ranges[k, 1])} "
                    f"or later"
                )
        return found

    def commit(self, found: StepRanges, ids: Sequence[str], lens: StepLens) -> None:
        """Keep the ranges still ahead of each request's cache after the step."""
        if not found:
            return
        position = {rid: i for i, rid in enumerate(ids)}
        for rid, ranges in found.items():
            if int(lens.total[position[rid]]) < int(ranges[-1, 1]):
                self._live[rid] = ranges
            else:
                self._live.pop(rid, None)

    def forget(self, req_ids: Sequence[str]) -> None:
        """Drop finished requests."""
        if self._live:
            for rid in req_ids:
                self._live.pop(rid, None)

    def metadata(
        self,
        found: StepRanges,
        ids: Sequence[str],
        lens: StepLens,
        to_device: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ranges on the device, ranges on the CPU, counts)`` in batch order: each
        request's ranges that end after its cached tokens (the ones its queries can be
        in), padded with ``(0, 0)``."""
        b = len(ids)
        table = np.zeros((b, self.max_ranges, 2), dtype=np.int32)
        counts = np.zeros(b, dtype=np.int32)
        for i, rid in enumerate(ids):
            ranges = found.get(rid)
            if ranges is None:
                continue
            ahead = ranges[ranges[:, 1] > lens.computed[i]]
            table[i, : len(ahead)] = ahead
            counts[i] = len(ahead)
        cpu = torch.as_tensor(table)
        return to_device(cpu), cpu, torch.as_tensor(counts)
