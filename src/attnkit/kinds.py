"""One place per spec kind: how its cache grows, what it releases, what builders see.

Every rule that depends on a layer's kind lives in its ``KindRules``: whether it keeps
a cache, the cache layouts it can take (``KVCacheLayout``) and their shapes, how many
blocks a request's table needs, which blocks no present or future query can see
(released to the pool), the sequence lengths, causality and slot positions the
runtime hands builders, and what a scheduled request must satisfy. The block manager
(``kv_cache``), the runtime and the backends' default cache shapes all ask
``rules_for(spec)``; adding a kind means one spec class and one ``KindRules``.

Every method is vectorised over the requests of a step (numpy arrays, one entry per
request): the host path does no per-request Python work for any kind.

Positions: a request's tokens are numbered from 0; a kind may *shift* them (sink
tokens sit in front of every request, so token ``t`` is at position ``sink_len + t``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Generic, Literal, TypeVar

import numpy as np
import numpy.typing as npt
from typing_extensions import override

from .capabilities import KVCacheLayout
from .spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

__all__ = [
    "CONTEXT_SHARDED_KINDS",
    "KindRules",
    "ShardedRules",
    "StepLens",
    "rules_for",
    "spans",
]

Ints = npt.NDArray[np.int64]
S = TypeVar("S", bound=KVCacheSpec)


class StepLens:
    """A step's per-request lengths, shared by every group.

    Attributes:
        computed: tokens each request had in the cache before the step.
        query: tokens scheduled this step.
        encoder: each request's encoder length (cross attention), 0 if none.
        is_new: the request is in its first step.
    """

    __slots__ = ("computed", "encoder", "is_new", "query", "total")

    def __init__(self, computed: Ints, query: Ints, encoder: Ints) -> None:
        self.computed = computed
        self.query = query
        self.encoder = encoder
        self.is_new = computed == 0
        self.total = computed + query
        """Tokens after the step."""


def spans(counts: Ints, starts: Ints, labels: Ints | None = None) -> tuple[Ints, Ints]:
    """Every entry of the spans ``starts[i] .. starts[i] + counts[i] - 1``, flattened in
    order, as ``(label of its span, value)``; labels default to the span index.

    Vectorised; ``counts`` must be >= 1. One entry per span (decodes) takes no repeat.
    """
    n = counts.size
    total = int(counts.sum())
    if total == n:
        return (np.arange(n) if labels is None else labels), starts
    index = np.repeat(np.arange(n), counts)
    first = np.cumsum(counts) - counts
    values: Ints = np.arange(total) - first[index] + starts[index]
    return (index if labels is None else labels[index]), values


def _ceil_div(a: Ints, b: int) -> Ints:
    return -(-a // b)


class KindRules(ABC, Generic[S]):
    """The rules of one kind, for specs of type ``S``. The defaults are those of a
    decoder kind with a growing paged cache (full attention).

    Subclasses override what differs; every method takes the group's (unified) spec.
    """

    has_cache: bool = True
    """Whether the kind keeps anything between steps."""
    causal: bool = True
    """Whether queries see only earlier positions."""
    releases: bool = False
    """Whether blocks can fall out of every future query's view (windows, chunks)."""
    writes: Literal["step", "encoder", "none"] = "step"
    """What the slot mapping holds: the step's new tokens (at their shifted positions),
    the encoder tokens of requests in their first step (then -1), or nothing (-1)."""
    layouts: frozenset[KVCacheLayout] = frozenset({"interleaved"})
    """The cache layouts a backend may declare for this kind (``KVCacheLayout``)."""
    no_planes_because: str = ""
    """Why the kind has no ``"planes"`` layout (for rejection reasons); empty if it has one."""
    latent: bool = False
    """Whether the cache holds one latent per token, read by every head (MLA), instead of
    per-head keys and values."""

    def shift(self, spec: S) -> int:
        """Positions in front of every request's tokens (sink tokens)."""
        return 0

    def blocks_needed(self, spec: S, lens: StepLens) -> Ints:
        """Logical blocks each request's table must have after the step."""
        bs = spec.block_size
        blocks: Ints = (lens.total + (self.shift(spec) + bs - 1)) // bs
        return blocks

    def first_live_block(self, spec: S, lens: StepLens) -> Ints:
        """The first logical block any query of this or a later step can see."""
        return np.zeros_like(lens.computed)

    def seq_lens(self, spec: S, lens: StepLens) -> Ints:
        """What builders see as ``seq_lens``."""
        shift = self.shift(spec)
        return lens.total + shift if shift else lens.total

    @abstractmethod
    def cache_shapes(
        self, spec: S, num_blocks: int, layout: KVCacheLayout = "interleaved"
    ) -> tuple[tuple[int, ...], ...]:
        """The cache tensors of one layer in ``layout`` (one shape per tensor).

        Page-major shapes start with ``num_blocks``; the two planes of the
        ``"planes"`` layout start with ``num_blocks * block_size`` (token-major).

        Raises:
            ValueError: the kind has no such layout (``layouts``).
        """

    def check_layout(self, spec: S, layout: KVCacheLayout) -> None:
        """Raise ``ValueError`` if this kind has no ``layout``."""
        if layout not in self.layouts:
            why = ""
            if layout == "planes" and self.no_planes_because:
                why = f": {self.no_planes_because}"
            raise ValueError(
                f"kind {spec.kind.value} has no {layout!r} cache layout{why} "
                f"(layouts: {', '.join(sorted(self.layouts))})"
            )

    def admission_problems(self, lens: StepLens) -> tuple[int, str] | None:
        """The first request (index) this kind cannot take this step, and why."""
        return None


SA = TypeVar("SA", bound=AttentionSpec)


class _PagedRules(KindRules[SA]):
    """Attention kinds whose pages hold K and V: interleaved
    ``[num_blocks, 2, block_size, Hkv, D]``, or the planes layout: a K plane and a V
    plane, each ``[num_blocks * block_size, Hkv, D]`` (row = slot)."""

    layouts: frozenset[KVCacheLayout] = frozenset({"interleaved", "planes"})

    @override
    def cache_shapes(
        self, spec: SA, num_blocks: int, layout: KVCacheLayout = "interleaved"
    ) -> tuple[tuple[int, ...], ...]:
        self.check_layout(spec, layout)
        if layout == "planes":
            plane = (num_blocks * spec.block_size, spec.num_kv_heads, spec.head_size)
            return (plane, plane)
        return ((num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size),)


class _LatentRules(KindRules[SA]):
    """MLA kinds: one latent per token, no separate values: ``[num_blocks, block_size, D]``
    (already token-major: ``view(-1, D)`` is row = slot, without a copy)."""

    latent = True
    no_planes_because = "an MLA cache holds one latent per token, not separate K and V"

    @override
    def cache_shapes(
        self, spec: SA, num_blocks: int, layout: KVCacheLayout = "interleaved"
    ) -> tuple[tuple[int, ...], ...]:
        self.check_layout(spec, layout)
        return ((num_blocks, spec.block_size, spec.head_size),)


def _window_first_live_block(spec: SlidingWindowSpec, lens: StepLens) -> Ints:
    # The step's first query sits at ``computed`` and sees ``window`` tokens back;
    # later queries see less of the past.
    first = np.maximum(lens.computed - spec.sliding_window + 1, 0)
    return first // spec.block_size


class _SinkRules(_PagedRules[SinkFullAttentionSpec]):
    @override
    def shift(self, spec: SinkFullAttentionSpec) -> int:
        return spec.sink_len


class _SlidingWindowRules(_PagedRules[SlidingWindowSpec]):
    releases = True

    @override
    def first_live_block(self, spec: SlidingWindowSpec, lens: StepLens) -> Ints:
        return _window_first_live_block(spec, lens)


class _SlidingWindowMLARules(_LatentRules[SlidingWindowMLASpec]):
    releases = True

    @override
    def first_live_block(self, spec: SlidingWindowMLASpec, lens: StepLens) -> Ints:
        return _window_first_live_block(spec, lens)


class _ChunkedLocalRules(_PagedRules[ChunkedLocalAttentionSpec]):
    releases = True

    @override
    def first_live_block(self, spec: ChunkedLocalAttentionSpec, lens: StepLens) -> Ints:
        # Queries see only their own chunk: everything before the chunk of the step's
        # first query is dead.
        chunk = spec.attention_chunk_size
        return (lens.computed // chunk) * chunk // spec.block_size


class _EncoderOnlyRules(KindRules[EncoderOnlyAttentionSpec]):
    has_cache = False
    causal = False
    writes = "none"
    layouts: frozenset[KVCacheLayout] = frozenset({"interleaved", "planes"})  # nothing to lay out

    @override
    def blocks_needed(self, spec: EncoderOnlyAttentionSpec, lens: StepLens) -> Ints:
        return np.zeros_like(lens.computed)

    @override
    def seq_lens(self, spec: EncoderOnlyAttentionSpec, lens: StepLens) -> Ints:
        return lens.query  # a request is encoded whole, in one step

    @override
    def cache_shapes(
        self, spec: EncoderOnlyAttentionSpec, num_blocks: int, layout: KVCacheLayout = "interleaved"
    ) -> tuple[tuple[int, ...], ...]:
        self.check_layout(spec, layout)
        return ()

    @override
    def admission_problems(self, lens: StepLens) -> tuple[int, str] | None:
        again = np.flatnonzero(~lens.is_new)
        if again.size:
            return int(again[0]), (
                "was already encoded: encoder-only layers take a request whole, in one step"
            )
        return None


class _CrossRules(_PagedRules[CrossAttentionSpec]):
    causal = False
    writes = "encoder"  # requests in their first step write their encoder tokens

    @override
    def blocks_needed(self, spec: CrossAttentionSpec, lens: StepLens) -> Ints:
        return _ceil_div(lens.encoder, spec.block_size)

    @override
    def seq_lens(self, spec: CrossAttentionSpec, lens: StepLens) -> Ints:
        return lens.encoder

    @override
    def admission_problems(self, lens: StepLens) -> tuple[int, str] | None:
        bad = np.flatnonzero(lens.is_new & (lens.encoder < 1))
        if bad.size:
            i = int(bad[0])
            return i, (
                f"is new and the model has cross-attention layers: encoder_len must be >= 1, "
                f"got {int(lens.encoder[i])}"
            )
        return None


class _StateRules(KindRules[MambaSpec]):
    writes = "none"  # states are written by the kernels, in each request's block
    no_planes_because = "a state layer keeps one state per request, not per-token K and V"

    @override
    def blocks_needed(self, spec: MambaSpec, lens: StepLens) -> Ints:
        return np.ones_like(lens.computed)  # one block holds a request's whole state

    @override
    def cache_shapes(
        self, spec: MambaSpec, num_blocks: int, layout: KVCacheLayout = "interleaved"
    ) -> tuple[tuple[int, ...], ...]:
        self.check_layout(spec, layout)
        return tuple((num_blocks, *shape) for shape in spec.shapes)


_RULES: dict[KVCacheSpecKind, KindRules[Any]] = {
    KVCacheSpecKind.FULL_ATTENTION: _PagedRules[FullAttentionSpec](),
    KVCacheSpecKind.SINK_FULL_ATTENTION: _SinkRules(),
    KVCacheSpecKind.MLA_ATTENTION: _LatentRules[MLAAttentionSpec](),
    KVCacheSpecKind.SLIDING_WINDOW: _SlidingWindowRules(),
    KVCacheSpecKind.SLIDING_WINDOW_MLA: _SlidingWindowMLARules(),
    KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION: _ChunkedLocalRules(),
    KVCacheSpecKind.ENCODER_ONLY_ATTENTION: _EncoderOnlyRules(),
    KVCacheSpecKind.CROSS_ATTENTION: _CrossRules(),
    KVCacheSpecKind.MAMBA: _StateRules(),
}
assert set(_RULES) == set(KVCacheSpecKind), "every kind needs its rules"


def rules_for(spec: KVCacheSpec) -> KindRules[Any]:
    """The rules of ``spec``'s kind."""
    return _RULES[spec.kind]


CONTEXT_SHARDED_KINDS: frozenset[KVCacheSpecKind] = frozenset(
    {KVCacheSpecKind.FULL_ATTENTION, KVCacheSpecKind.MLA_ATTENTION}
)
"""Kinds whose cache decode context parallelism shards across ranks (token ``t`` on rank
``t mod N``): their caches grow with the context without bound. Every other kind is
replicated on every rank: windows, chunks and states are bounded per request (sharding
would save little and cost a merge per layer), cross-attention is bounded by the encoder
length, and sink tokens (``sink_full_attention``) would need their sink slots sharded
too, which the runtime does not do yet."""


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
        self.inner = inner
        self.rank, self.world_size = rank, world_size
        self.has_cache = inner.has_cache
        self.causal = inner.causal
        self.releases = False
        self.writes = "step"
        self.layouts = inner.layouts
        self.no_planes_because = inner.no_planes_because

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
    def blocks_needed(self, spec: Any, lens: StepLens) -> Ints:
        bs = spec.block_size
        blocks: Ints = _ceil_div(self.local_counts(lens.total + self.shift(spec)), bs)
        return blocks

    @override
    def seq_lens(self, spec: Any, lens: StepLens) -> Ints:
        return self.local_counts(self.inner.seq_lens(spec, lens))

    @override
    def cache_shapes(
        self, spec: Any, num_blocks: int, layout: KVCacheLayout = "interleaved"
    ) -> tuple[tuple[int, ...], ...]:
        return self.inner.cache_shapes(spec, num_blocks, layout)

    @override
    def admission_problems(self, lens: StepLens) -> tuple[int, str] | None:
        return self.inner.admission_problems(lens)
