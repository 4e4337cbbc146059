"""The base of every kind's rules: ``KindRules`` (the defaults of a decoder kind with a
growing paged cache), the ``Mask`` and ``TensorSplit`` it answers with, the step's
lengths and tokens (``StepLens``, ``StepTokens``) and the vectorised helpers the kinds
share (``spans``, ``slots_of``, the first live block of a window or a chunk).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from ..capabilities import KVCacheLayout
from ..errors import InvalidArgumentError
from ..spec import KVCacheDType, KVCacheSpec, KVCacheSpecKind
from ._prefix import (
    BlockLookup,
    NeverHits,
    PrefixMiss,
    TokenLayout,
    _check_length,
    paged_blocks,
    paged_hit,
)

__all__ = [  # what the package and the kinds' modules use, the shared helpers included
    "Extent",
    "Ints",
    "KindRules",
    "Mask",
    "StepLens",
    "StepTokens",
    "TensorSplit",
    "_ceil_div",
    "_chunk_first_live_block",
    "_window_first_live_block",
    "boundary_lengths",
    "slots_of",
    "spans",
]

Ints = npt.NDArray[np.int64]
S = TypeVar("S", bound=KVCacheSpec)

Extent = Literal["window", "chunk", "sink_len"]
"""What a kind's one length parameter is, in ``Mask``'s words: a sliding window, an
attention chunk, or sink tokens."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mask:
    """Which keys a query sees, as a layer kind defines it (``rules.mask(spec)``).

    A query at position ``p`` sees the key at position ``j`` when ``j <= p`` (causal),
    ``p - j < window`` (a window), and ``j // chunk == p // chunk`` (a chunk); a
    bidirectional query sees every key of its request. ``sink_len`` sink tokens sit at
    positions ``0 .. sink_len - 1`` in front of every request (the request's tokens
    are shifted by it) and every query sees them.

    With ``mm_prefix``, a query inside one of its request's image ranges ``[s, e)``
    (``ScheduledRequest.mm_prefix_ranges``) also sees the later keys of that range: the
    causal term becomes ``j <= p`` or ``s <= p, j < e``, and a window still bounds
    the look-back (``p - j < window``), so a range longer than the window is clamped to
    it, never dropped (transformers' Gemma 3 and Gemma 4 sliding layers: AND(window,
    OR(causal, same image))). Since a range is scheduled whole, the keys after ``p`` it
    adds are written in the same step, so a query's visible keys stay one contiguous
    run ending at ``metadata.mm_prefix_key_ends``.

    Attributes:
        causal: queries see only keys at or before their position.
        window: the sliding window (the query's own position included), or ``None``.
        chunk: the attention chunk, or ``None``.
        sink_len: sink tokens in front of every request (0: none).
        mm_prefix: bidirectional image ranges (the spec's ``mm_prefix``).
    """

    causal: bool = True
    window: int | None = None
    chunk: int | None = None
    sink_len: int = 0
    mm_prefix: bool = False

    @property
    def bidirectional(self) -> bool:
        """Queries see every key of their request (encoder-only and cross attention)."""
        return not self.causal


@dataclasses.dataclass(frozen=True)
class TensorSplit:
    """How tensor parallelism splits one attention spec over its ranks.

    Attributes:
        spec: what each rank's layers declare (K/V heads divided; an MLA latent whole).
        kv_heads: K/V heads per rank (1 for an MLA latent).
        kv_replicas: ranks that hold each K/V head (``tensor_parallel`` for a latent).
        detail: the split in words (``"K/V heads 8 -> 2 per rank"``), for reports.
    """

    spec: KVCacheSpec
    kv_heads: int
    kv_replicas: int
    detail: str


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


class StepTokens:
    """A step's tokens, shared by every group: each token's request (its index in the
    batch) and its unshifted position, in batch order.

    Attributes:
        token_req, token_pos: int64 ``[T]``.
        num_tokens: ``T``.
    """

    def __init__(self, token_req: Ints, token_pos: Ints) -> None:
        self.token_req, self.token_pos = token_req, token_pos
        self.num_tokens = int(token_req.size)
        self._coords: dict[tuple[int, int], tuple[Ints, Ints]] = {}

    def block_coords(self, shift: int, block_size: int) -> tuple[Ints, Ints]:
        """Each token's logical block and offset in it, made once per geometry per step."""
        key = (shift, block_size)
        found = self._coords.get(key)
        if found is None:
            positions = self.token_pos + shift if shift else self.token_pos
            if block_size & (block_size - 1) == 0:  # a power of two (positions >= 0)
                found = (positions >> (block_size.bit_length() - 1), positions & (block_size - 1))
            else:
                found = np.divmod(positions, block_size)
            self._coords[key] = found
        return found

    def unwritten(self) -> Ints:
        """A slot mapping that writes nothing: ``-1`` for every token."""
        return np.full(self.num_tokens, -1, dtype=np.int64)


def spans(counts: Ints, starts: Ints, labels: Ints | None = None) -> tuple[Ints, Ints]:
    """Every entry of the spans ``starts[i] .. starts[i] + counts[i] - 1``, flattened in
    order, as ``(label of its span, value)``; labels default to the span index.

    Vectorised; ``counts`` must be >= 1. One entry per span (decodes) takes no repeat.
    """
    n = counts.size
    total = int(counts.sum())
    if total == n:
        return (np.arange(n) if labels is None else labels), starts
    owners: Ints = (np.arange(n) if labels is None else labels).repeat(counts)
    # Entry k of span i is starts[i] + (k - first[i]), first[i] its index in the output.
    first = counts.cumsum()
    first -= counts
    values: Ints = np.arange(total) + (starts - first).repeat(counts)
    return owners, values


def slots_of(
    table: npt.NDArray[Any], token_req: Ints, block_idx: Ints, offset: Ints, block_size: int
) -> Ints:
    """Cache slot of each token: its request's block ``block_idx`` and the offset in it
    (``table`` ``[B, MB]``, one row per request of the step)."""
    blocks = table[token_req, block_idx]
    if np.count_nonzero(blocks) != blocks.size:  # a null block (0) for a live position:
        # a manager bug
        raise AssertionError("a live position maps to the null block")
    slots: Ints = np.multiply(blocks, block_size, dtype=np.int64)
    slots += offset
    return slots


def boundary_lengths(block_size: int, *, extra: tuple[int, ...] = ()) -> list[int]:
    """Lengths at and around block boundaries: 1, bs-1, bs, bs+1, 2bs-1, 2bs, 2bs+1."""
    found = {1, 2, *extra}
    for m in (1, 2):
        found.update({m * block_size - 1, m * block_size, m * block_size + 1})
    return sorted(n for n in found if n >= 1)


def _ceil_div(a: Ints, b: int) -> Ints:
    return -(-a // b)


def _window_first_live_block(window: int, block_size: int, lens: StepLens) -> Ints:
    # The step's first query sits at ``computed`` and sees ``window`` tokens back;
    # later queries see less of the past.
    first = np.maximum(lens.computed - window + 1, 0)
    return first // block_size


def _chunk_first_live_block(chunk: int, block_size: int, lens: StepLens) -> Ints:
    # Queries see only their own chunk: everything before the chunk of the step's
    # first query is dead.
    return (lens.computed // chunk) * chunk // block_size


class KindRules(ABC, Generic[S]):
    """The rules of one kind, for specs of type ``S``. The defaults are those of a
    decoder kind with a growing paged cache (full attention).

    Subclasses override what differs; every method takes the group's (unified) spec.

    Args:
        spec_class: the kind's spec class (its ``kind`` is this rules' kind).

    Attributes:
        spec_class, kind: the kind's spec class and its ``KVCacheSpecKind``.
    """

    has_cache: bool = True
    """Whether the kind keeps anything between steps."""
    causal: bool = True
    """Whether queries see only earlier positions (``mask(spec).causal``)."""
    releases: bool = False
    """Whether blocks can fall out of every future query's view (windows, chunks)."""
    writes: Literal["step", "encoder", "none"] = "step"
    """What the slot mapping holds (``slot_mapping``): the step's new tokens (at their
    shifted positions), the encoder tokens of requests in their first step (then -1),
    or nothing (-1)."""
    layouts: frozenset[KVCacheLayout] = frozenset({"interleaved"})
    """The cache layouts a backend may declare for this kind (``KVCacheLayout``)."""
    no_planes_because: str = ""
    """Why the kind has no ``"planes"`` layout (for rejection reasons); empty if it has one."""
    latent: bool = False
    """Whether the cache holds one latent per token, read by every head (MLA), instead of
    per-head keys and values."""
    tp_replicated: bool = False
    """Whether every tensor-parallel rank holds the same cache bytes for the same tokens
    (one row per token that every head reads: MLA latents, DSA index keys), so an
    offloaded page is shared by the ranks (``attnkit.PageSharing``)."""
    shares_blocks_with: frozenset[KVCacheSpecKind] = frozenset()
    """The kinds whose block ids a group of this kind shares (``KVCacheGroup.block_owner``):
    grouping pairs it with the one cached group of such a kind and its block size, whose
    tables it reads and in whose kernel blocks its tensors sit (DeepSeek sparse
    attention's index keys beside the MLA latents they select from). Empty: the group
    allocates its own blocks."""
    context_sharded: bool = False
    """Whether decode context parallelism shards the cache over its ranks (token ``t`` on
    rank ``t mod N``); every other kind is replicated on each rank."""
    grows_without_bound: bool = True
    """Whether a request's blocks grow with its length without bound (the planner bounds
    cross-attention's encoder tokens by the same length)."""
    counts_kv_per_token: bool = False
    """Whether the kind counts toward "KV bytes per token": a per-token cache of the
    decoder's own tokens (not encoder-only layers, no cache, nor cross attention,
    whose cache grows with the encoder's tokens, nor states)."""
    extent: Extent | None = None
    """What the kind's one length parameter is (``Mask``'s words), if it has one."""
    extent_field: str | None = None
    """The spec field that holds it (``"sliding_window"``), if the kind has one."""
    short_name: str | None = None
    """The kind's name in the demo's layouts (``"window"``), if it has one."""
    context_shard: tuple[int, int] | None = None
    """``(rank, world_size)`` of a context-parallel shard (``ShardedRules``), else ``None``."""
    prefix_unit: Literal["block", "length"] = "block"
    """What the prefix-cache lookup ``prefix_hit`` takes is indexed by: the group's blocks
    in its ``prefix_layout``, or prefix lengths (a state checkpoint after ``L`` tokens)."""

    def __init__(self, spec_class: type[S]) -> None:
        self.spec_class = spec_class
        self.kind = spec_class.kind

    def shift(self, spec: S) -> int:
        """Positions in front of every request's tokens (sink tokens)."""
        return 0

    def mask(self, spec: S) -> Mask:
        """Which keys a query of ``spec``'s layers sees."""
        return Mask(causal=self.causal)

    def bound(self, spec: S) -> int | None:
        """The window or chunk that bounds a request's live cache; ``None`` if nothing
        does (the kind releases no blocks)."""
        if not self.releases:
            return None
        mask = self.mask(spec)
        return mask.window if mask.window is not None else mask.chunk

    def bound_label(self, spec: S) -> str | None:
        """``"window 4096"`` / ``"chunk 8192"``: ``bound`` in words, for reports."""
        bound = self.bound(spec)
        if bound is None:
            return None
        return f"{'window' if self.mask(spec).window is not None else 'chunk'} {bound}"

    def keeps_default(self, rule: str) -> bool:
        """Whether this kind's ``rule`` (a method name, e.g. ``"slot_mapping"``) is
        ``KindRules``' own, not an override: callers that know the default's result
        (groups growing alike, steady slots) may then compute it their own way."""
        return next(c for c in type(self).__mro__ if rule in c.__dict__) is KindRules

    def blocks_needed(self, spec: S, lens: StepLens) -> Ints:
        """Logical blocks each request's table must have after the step."""
        bs = spec.block_size
        blocks: Ints = (lens.total + (self.shift(spec) + bs - 1)) // bs
        return blocks

    def first_live_block(self, spec: S, lens: StepLens) -> Ints:
        """The first logical block any query of this or a later step can see: for a
        releasing kind, from its mask's window or chunk; else block 0."""
        if self.releases:
            mask = self.mask(spec)
            if mask.window is not None:
                return _window_first_live_block(mask.window, spec.block_size, lens)
            if mask.chunk is not None:
                return _chunk_first_live_block(mask.chunk, spec.block_size, lens)
        return np.zeros_like(lens.computed)

    def release_reach(self, spec: S, block: int) -> int:
        """The fewest tokens a request must hold (``computed`` at its next step) for that
        step to release its logical block ``block`` (``first_live_block > block``);
        ``first_live_block`` grows with ``computed``. The prefix cache marks a
        releasing group's names only once a step can release them. The default, 0,
        says any step may release any block (names are marked at every commit); the
        window and chunk kinds give the exact figure."""
        return 0

    def seq_lens(self, spec: S, lens: StepLens) -> Ints:
        """What builders see as ``seq_lens``."""
        shift = self.shift(spec)
        return lens.total + shift if shift else lens.total

    def global_seq_lens(self, spec: S, lens: StepLens) -> Ints:
        """The requests' whole lengths (``seq_lens`` before any context sharding)."""
        return self.seq_lens(spec, lens)

    def slot_mapping(
        self, spec: S, table: npt.NDArray[Any], tokens: StepTokens, lens: StepLens
    ) -> Ints:
        """The step's slot mapping (int64, -1 = do not write), from the group's block
        ``table`` ``[B, MB]`` (a row per request of the step), the step's tokens and
        lengths: here, the slot of each new token at its shifted position."""
        bs = spec.block_size
        block_idx, offset = tokens.block_coords(self.shift(spec), bs)
        return slots_of(table, tokens.token_req, block_idx, offset, bs)

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

    def tensor_split(self, spec: S, tp: int, where: str) -> TensorSplit:
        """What each of ``tp`` tensor-parallel ranks holds of an attention spec.

        Raises:
            InvalidArgumentError: the heads do not split (the message names ``where``),
                or the kind is not an attention kind.
        """
        raise InvalidArgumentError(
            f"plan_model: kind {self.kind.value} of {where} has no attention heads to split"
        )

    def prefix_never_hits(self, spec: S) -> str | None:
        """Why this kind can never serve a cached prefix, in words; ``None`` if it can.
        Here: a kind without a cache, or a bidirectional one (a key's value would depend
        on tokens after it)."""
        if not self.has_cache:
            return "its layers keep no cache between steps"
        if not self.causal:
            return "its queries see every key of the request, so no prefix stands alone"
        return None

    def prefix_layout(self, spec: S) -> TokenLayout | None:
        """How the kind lays a request's tokens into blocks: the layout its cached blocks
        are named in and a hit must end on a boundary of (``spec.block_size``, shifted by
        ``shift``); ``None`` for a kind that never hits or whose cache is not in blocks of
        tokens."""
        if self.prefix_never_hits(spec) is not None:
            return None
        return TokenLayout(spec.block_size, self.shift(spec))

    def prefix_hit(
        self, spec: S, cached: BlockLookup, length: int
    ) -> tuple[int, PrefixMiss | None]:
        """The longest prefix ``<= length`` tokens this group can serve from the cache,
        and why it is shorter (``None`` when it is ``length``).

        Here, from the kind's ``mask``: the hit ends on a block boundary of
        ``prefix_layout`` and every block a query after it can see is cached
        (``cached``: a bool per block of the layout, or a lookup ``cached(block)``); a
        kind that never hits serves 0 (``NeverHits``). 0 is always served.
        """
        layout = self.prefix_layout(spec)
        if layout is None:
            if _check_length(length) == 0:
                return 0, None
            why = self.prefix_never_hits(spec)
            return 0, NeverHits(self.kind.value, why or "its cache is not named by tokens")
        mask = self.mask(spec)
        return paged_hit(
            layout, cached, length, window=mask.window, chunk=mask.chunk, sink_len=mask.sink_len
        )

    def prefix_blocks(self, spec: S, length: int) -> Ints:
        """The blocks of ``prefix_layout`` (sorted indices) a hit of ``length`` tokens
        reads; the request's other blocks before them stay the null block.

        Raises:
            InvalidArgumentError: ``length`` does not end on a block boundary, or the
                kind never hits.
        """
        layout = self.prefix_layout(spec)
        if layout is None:
            raise InvalidArgumentError(
                f"prefix_blocks: kind {self.kind.value} reads no cached blocks of tokens"
            )
        mask = self.mask(spec)
        return paged_blocks(
            layout, length, window=mask.window, chunk=mask.chunk, sink_len=mask.sink_len
        )

    def example_spec(
        self,
        *,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: KVCacheDType = "auto",
        extent: int | None = None,
    ) -> S:
        """A spec of this kind (the conformance kit's and the demo's layers); ``extent``
        is the window, chunk or sink length of a kind with one (``extent_field``).

        Raises:
            InvalidArgumentError: the kind is not an attention kind, or ``extent`` is
                missing for a kind that needs one.
        """
        raise InvalidArgumentError(
            f"kind {self.kind.value} has no example attention spec (state layers' specs "
            f"come from their state type)"
        )

    def example_extents(self, block_size: int) -> tuple[int, ...]:
        """The extents (``extent``) the conformance kit draws for a block size: lengths
        at and around block edges; none for a kind without one."""
        return tuple(boundary_lengths(block_size)) if self.extent is not None else ()

    def example_layer_params(self, spec: S, draw: Callable[..., torch.Tensor]) -> dict[str, Any]:
        """Layer parameters the kind needs beyond the common ones, as
        ``AttentionLayerParams`` keywords; tensors come from ``draw(*shape)``."""
        return {}
