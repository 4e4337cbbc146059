"""The rules of the state kind (``mamba``): one block per request holds its whole state,
written by the kernels, never by the slot mapping."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import override

from ..capabilities import KVCacheLayout
from ..spec import MambaSpec
from ._base import Ints, KindRules, StepLens, StepTokens
from ._prefix import BlockLookup, PrefixMiss, TokenLayout, checkpoint_hit

__all__ = ["_StateRules"]  # registered by _registry


class _StateRules(KindRules[MambaSpec]):
    writes = "none"  # states are written by the kernels, in each request's block
    grows_without_bound = False
    no_planes_because = "a state layer keeps one state per request, not per-token K and V"
    prefix_unit = "length"  # a hit needs a checkpoint of the state after exactly L tokens

    @override
    def blocks_needed(self, spec: MambaSpec, lens: StepLens) -> Ints:
        return np.ones_like(lens.computed)  # one block holds a request's whole state

    @override
    def slot_mapping(
        self, spec: MambaSpec, table: npt.NDArray[Any], tokens: StepTokens, lens: StepLens
    ) -> Ints:
        return tokens.unwritten()

    @override
    def cache_shapes(
        self, spec: MambaSpec, num_blocks: int, layout: KVCacheLayout = "interleaved"
    ) -> tuple[tuple[int, ...], ...]:
        self.check_layout(spec, layout)
        return tuple((num_blocks, *shape) for shape in spec.shapes)

    @override
    def prefix_layout(self, spec: MambaSpec) -> TokenLayout | None:
        return None  # one state per request, not blocks of tokens

    @override
    def prefix_hit(
        self, spec: MambaSpec, cached: BlockLookup, length: int
    ) -> tuple[int, PrefixMiss | None]:
        """The longest prefix ``<= length`` with a state checkpoint after it: ``cached``
        is indexed by length (``cached[L]`` / ``cached(L)``: a checkpoint after ``L``
        tokens exists)."""
        return checkpoint_hit(cached, length)

    @override
    def prefix_blocks(self, spec: MambaSpec, length: int) -> Ints:
        return np.zeros(0, dtype=np.int64)  # a hit copies a checkpoint, it reads no block
