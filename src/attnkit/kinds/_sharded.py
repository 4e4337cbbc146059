"""A sharded kind's rules on one context-parallel rank (``ShardedRules``): the kind's own
rules, with a rank's share of every request's positions."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import override

from ..capabilities import KVCacheLayout
from ._base import Ints, KindRules, Mask, StepLens, StepTokens, TensorSplit, _ceil_div, slots_of


class ShardedRules(KindRules[Any]):
    """A sharded kind's rules on one context-parallel rank: position ``p`` of a request
    lives on rank ``p % world_size`` at local index ``p // world_size``; the rank's
    table holds its positions only, and builders see the local counts as ``seq_lens``.

    Attributes:
        inner: the kind's own rules (cache shapes, layouts, causality).
        rank, world_size: this rank and the group's size.
    """

    def __init__(self, inner: KindRules[Any], rank: int, world_size: int) -> None:
        if inner.releases or inner.writes != "step":
            raise ValueError(
                "only kinds that write every step's tokens and never release blocks can be "
                "sharded by context"
            )
        super().__init__(inner.spec_class)
        self.inner = inner
        self.rank, self.world_size = rank, world_size
        self.context_shard = (rank, world_size)
        self.has_cache = inner.has_cache
        self.causal = inner.causal
        self.releases = False
        self.writes = "step"
        self.layouts = inner.layouts
        self.no_planes_because = inner.no_planes_because
        self.latent = inner.latent
        self.context_sharded = True
        self.grows_without_bound = inner.grows_without_bound
        self.counts_kv_per_token = inner.counts_kv_per_token
        self.extent, self.extent_field = inner.extent, inner.extent_field
        self.short_name = inner.short_name

    def local_counts(self, totals: Ints) -> Ints:
        """Positions ``< totals`` this rank holds: ``ceil((L - rank) / world_size)``."""
        counts: Ints = np.maximum(totals - self.rank + self.world_size - 1, 0) // self.world_size
        return counts

    def owned(self, positions: Ints) -> tuple[Ints, Ints]:
        """``(mask of positions this rank holds, their local indices)``."""
        mask: Ints = positions % self.world_size == self.rank
        local: Ints = positions // self.world_size
        return mask, local

    @override
    def shift(self, spec: Any) -> int:
        return self.inner.shift(spec)

    @override
    def mask(self, spec: Any) -> Mask:
        return self.inner.mask(spec)

    @override
    def blocks_needed(self, spec: Any, lens: StepLens) -> Ints:
        bs = spec.block_size
        blocks: Ints = _ceil_div(self.local_counts(lens.total + self.shift(spec)), bs)
        return blocks

    @override
    def seq_lens(self, spec: Any, lens: StepLens) -> Ints:
        return self.local_counts(self.inner.seq_lens(spec, lens))

    @override
    def global_seq_lens(self, spec: Any, lens: StepLens) -> Ints:
        return self.inner.seq_lens(spec, lens)

    @override
    def slot_mapping(
        self, spec: Any, table: npt.NDArray[Any], tokens: StepTokens, lens: StepLens
    ) -> Ints:
        """Only the positions this rank holds are written, at their local index."""
        bs = spec.block_size
        positions = tokens.token_pos + self.shift(spec)
        mine, local = self.owned(positions)
        slots = tokens.unwritten()
        if mine.any():
            block_idx, offset = np.divmod(local[mine], bs)
            slots[mine] = slots_of(table, tokens.token_req[mine], block_idx, offset, bs)
        return slots

    @override
    def cache_shapes(
        self, spec: Any, num_blocks: int, layout: KVCacheLayout = "interleaved"
    ) -> tuple[tuple[int, ...], ...]:
        return self.inner.cache_shapes(spec, num_blocks, layout)

    @override
    def admission_problems(self, lens: StepLens) -> tuple[int, str] | None:
        return self.inner.admission_problems(lens)

    @override
    def tensor_split(self, spec: Any, tp: int, where: str) -> TensorSplit:
        return self.inner.tensor_split(spec, tp, where)

    @override
    def prefix_never_hits(self, spec: Any) -> str | None:
        # A rank's blocks hold every world_size-th position, not a run of tokens.
        return "a context-parallel rank's blocks hold every n-th token, not a prefix's blocks"
