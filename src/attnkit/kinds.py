"""One place per spec kind: every fact that depends on a layer's kind.

Every rule that depends on a layer's kind lives in its ``KindRules``: whether it keeps
a cache, the cache layouts it can take (``KVCacheLayout``) and their shapes, how many
blocks a request's table needs, which blocks no present or future query can see
(released to the pool), the sequence lengths and slot mapping the runtime hands
builders, what a scheduled request must satisfy, the kind's **mask** (``Mask``:
causal or bidirectional, window, chunk, sink tokens), whether its cache holds one
latent per token, what bounds a request's live cache, the plan-time facts (context
sharded or replicated, growth without bound, bytes per token, the tensor-parallel
split), its example specs and layer parameters (the conformance kit, the demo) and its
short name. The block manager (``kv_cache``), the runtime, the planner, the backends,
the kit and the demo all ask ``rules_for(spec)``; adding a kind means one spec class
(``spec.py``) and one ``KindRules`` registered in ``_RULES`` below.

Every per-step method is vectorised over the requests of a step (numpy arrays, one
entry per request): the host path does no per-request Python work for any kind.

Positions: a request's tokens are numbered from 0; a kind may *shift* them (sink
tokens sit in front of every request, so token ``t`` is at position ``sink_len + t``).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from typing_extensions import override

from ._validation import split_or_replicate
from .capabilities import KVCacheLayout
from .errors import InvalidArgumentError
from .spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheDType,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    spec_class_for_kind,
)

__all__ = [
    "CONTEXT_SHARDED_KINDS",
    "Extent",
    "KindRules",
    "Mask",
    "ShardedRules",
    "StepLens",
    "StepTokens",
    "TensorSplit",
    "all_rules",
    "attention_rules",
    "boundary_lengths",
    "rules_for",
    "rules_for_kind",
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

    Attributes:
        causal: queries see only keys at or before their position.
        window: the sliding window (the query's own position included), or ``None``.
        chunk: the attention chunk, or ``None``.
        sink_len: sink tokens in front of every request (0: none).
    """

    causal: bool = True
    window: int | None = None
    chunk: int | None = None
    sink_len: int = 0

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
    index = np.repeat(np.arange(n), counts)
    first = np.cumsum(counts) - counts
    values: Ints = np.arange(total) - first[index] + starts[index]
    return (index if labels is None else labels[index]), values


def slots_of(
    table: npt.NDArray[Any], token_req: Ints, block_idx: Ints, offset: Ints, block_size: int
) -> Ints:
    """Cache slot of each token: its request's block ``block_idx`` and the offset in it
    (``table`` ``[B, MB]``, one row per request of the step)."""
    blocks = table[token_req, block_idx].astype(np.int64)
    if not blocks.all():  # the null block (0) for a live position: a manager bug
        raise AssertionError("a live position maps to the null block")
    slots: Ints = blocks * block_size + offset
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


SA = TypeVar("SA", bound=AttentionSpec)


class _AttentionRules(KindRules[SA]):
    """Attention kinds: heads split by tensor parallelism, specs built from the common
    attention fields (and the kind's ``extent_field``)."""

    counts_kv_per_token = True

    @override
    def tensor_split(self, spec: SA, tp: int, where: str) -> TensorSplit:
        kv, copies = split_or_replicate(spec.num_kv_heads, tp, "K/V heads", where)
        shared = f" (each on {copies} ranks)" if copies > 1 else ""
        return TensorSplit(
            dataclasses.replace(spec, num_kv_heads=kv),
            kv,
            copies,
            f"K/V heads {spec.num_kv_heads} -> {kv} per rank{shared}",
        )

    @override
    def example_spec(
        self,
        *,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: KVCacheDType = "auto",
        extent: int | None = None,
    ) -> SA:
        fields: dict[str, Any] = {
            "block_size": block_size,
            "num_kv_heads": num_kv_heads,
            "head_size": head_size,
            "dtype": dtype,
            "kv_cache_dtype": kv_cache_dtype,
        }
        if self.extent_field is not None:
            if extent is None:
                raise InvalidArgumentError(
                    f"example_spec: kind {self.kind.value} needs extent (its "
                    f"{self.extent_field}), got None"
                )
            fields[self.extent_field] = extent
        return self.spec_class(**fields)


class _PagedRules(_AttentionRules[SA]):
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


class _LatentRules(_AttentionRules[SA]):
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

    @override
    def tensor_split(self, spec: SA, tp: int, where: str) -> TensorSplit:
        # The latent is one vector per token that every head reads: nothing to split.
        return TensorSplit(
            spec,
            1,
            tp,
            f"MLA latent ({spec.head_size} per token) shared by all heads: replicated on "
            f"every tensor-parallel rank",
        )


class _FullRules(_PagedRules[FullAttentionSpec]):
    context_sharded = True
    short_name = "full"


class _SinkRules(_PagedRules[SinkFullAttentionSpec]):
    extent = "sink_len"
    extent_field = "sink_len"
    short_name = "sink_tokens"

    @override
    def shift(self, spec: SinkFullAttentionSpec) -> int:
        return spec.sink_len

    @override
    def mask(self, spec: SinkFullAttentionSpec) -> Mask:
        return Mask(sink_len=spec.sink_len)

    @override
    def example_extents(self, block_size: int) -> tuple[int, ...]:
        bs = block_size
        return tuple(sorted({1, 3, bs - 1, bs, bs + 1} - {0}))

    @override
    def example_layer_params(
        self, spec: SinkFullAttentionSpec, draw: Callable[..., torch.Tensor]
    ) -> dict[str, Any]:
        shape = (spec.sink_len, spec.num_kv_heads, spec.head_size)
        return {"sink_key": draw(*shape), "sink_value": draw(*shape)}


class _MLARules(_LatentRules[MLAAttentionSpec]):
    context_sharded = True
    short_name = "mla"


class _SlidingWindowRules(_PagedRules[SlidingWindowSpec]):
    releases = True
    grows_without_bound = False
    extent = "window"
    extent_field = "sliding_window"
    short_name = "window"

    @override
    def mask(self, spec: SlidingWindowSpec) -> Mask:
        return Mask(window=spec.sliding_window)

    @override
    def first_live_block(self, spec: SlidingWindowSpec, lens: StepLens) -> Ints:
        return _window_first_live_block(spec.sliding_window, spec.block_size, lens)

    @override
    def example_extents(self, block_size: int) -> tuple[int, ...]:
        return tuple(boundary_lengths(block_size, extra=(3, 5)))


class _SlidingWindowMLARules(_LatentRules[SlidingWindowMLASpec]):
    releases = True
    grows_without_bound = False
    extent = "window"
    extent_field = "sliding_window"
    short_name = "mla_window"

    @override
    def mask(self, spec: SlidingWindowMLASpec) -> Mask:
        return Mask(window=spec.sliding_window)

    @override
    def first_live_block(self, spec: SlidingWindowMLASpec, lens: StepLens) -> Ints:
        return _window_first_live_block(spec.sliding_window, spec.block_size, lens)

    @override
    def example_extents(self, block_size: int) -> tuple[int, ...]:
        return tuple(boundary_lengths(block_size, extra=(3, 5)))


class _ChunkedLocalRules(_PagedRules[ChunkedLocalAttentionSpec]):
    releases = True
    grows_without_bound = False
    extent = "chunk"
    extent_field = "attention_chunk_size"
    short_name = "chunked"

    @override
    def mask(self, spec: ChunkedLocalAttentionSpec) -> Mask:
        return Mask(chunk=spec.attention_chunk_size)

    @override
    def first_live_block(self, spec: ChunkedLocalAttentionSpec, lens: StepLens) -> Ints:
        return _chunk_first_live_block(spec.attention_chunk_size, spec.block_size, lens)

    @override
    def example_extents(self, block_size: int) -> tuple[int, ...]:
        return tuple(boundary_lengths(block_size, extra=(4, max(1, block_size // 2))))


class _EncoderOnlyRules(_AttentionRules[EncoderOnlyAttentionSpec]):
    has_cache = False
    causal = False
    writes = "none"
    grows_without_bound = False
    counts_kv_per_token = False
    short_name = "encoder"
    layouts: frozenset[KVCacheLayout] = frozenset({"interleaved", "planes"})  # nothing to lay out

    @override
    def blocks_needed(self, spec: EncoderOnlyAttentionSpec, lens: StepLens) -> Ints:
        return np.zeros_like(lens.computed)

    @override
    def seq_lens(self, spec: EncoderOnlyAttentionSpec, lens: StepLens) -> Ints:
        return lens.query  # a request is encoded whole, in one step

    @override
    def slot_mapping(
        self,
        spec: EncoderOnlyAttentionSpec,
        table: npt.NDArray[Any],
        tokens: StepTokens,
        lens: StepLens,
    ) -> Ints:
        return tokens.unwritten()  # no cache

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
    counts_kv_per_token = False
    short_name = "cross"

    @override
    def blocks_needed(self, spec: CrossAttentionSpec, lens: StepLens) -> Ints:
        return _ceil_div(lens.encoder, spec.block_size)

    @override
    def seq_lens(self, spec: CrossAttentionSpec, lens: StepLens) -> Ints:
        return lens.encoder

    @override
    def slot_mapping(
        self, spec: CrossAttentionSpec, table: npt.NDArray[Any], tokens: StepTokens, lens: StepLens
    ) -> Ints:
        """The slots of the encoder tokens written this step (requests in their first
        step, batch order) first, then -1; ``max(T, E)`` entries."""
        bs = spec.block_size
        slots = tokens.unwritten()
        writers = np.flatnonzero(lens.is_new & (lens.encoder > 0))
        if writers.size:
            counts = lens.encoder[writers]
            owners, pos = spans(counts, np.zeros_like(counts), writers)
            written = slots_of(table, owners, pos // bs, pos % bs, bs)
            if written.size > slots.size:
                slots = np.full(written.size, -1, dtype=np.int64)
            slots[: written.size] = written
        return slots

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
    grows_without_bound = False
    no_planes_because = "a state layer keeps one state per request, not per-token K and V"

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


def _registry(*rules: KindRules[Any]) -> dict[KVCacheSpecKind, KindRules[Any]]:
    """Kind -> its rules; every ``KVCacheSpecKind`` needs exactly one, declared with the
    spec class ``spec.py`` defines for it (checked at import, so a kind without rules
    fails when attnkit is imported, not mid-step)."""
    found: dict[KVCacheSpecKind, KindRules[Any]] = {}
    for r in rules:
        if r.kind in found:
            raise TypeError(f"attnkit.kinds: kind {r.kind.value} has two KindRules")
        if spec_class_for_kind(r.kind) is not r.spec_class:
            raise TypeError(
                f"attnkit.kinds: the rules of kind {r.kind.value} name spec class "
                f"{r.spec_class.__name__}, spec.py defines "
                f"{spec_class_for_kind(r.kind).__name__}"
            )
        found[r.kind] = r
    missing = [k.value for k in KVCacheSpecKind if k not in found]
    if missing:
        raise TypeError(
            f"attnkit.kinds declares no KindRules for kind(s) {', '.join(missing)}: every "
            f"KVCacheSpecKind needs its rules in attnkit/kinds.py (known: "
            f"{', '.join(k.value for k in found)})"
        )
    return {k: found[k] for k in KVCacheSpecKind}  # in the enum's order


_RULES: dict[KVCacheSpecKind, KindRules[Any]] = _registry(
    _FullRules(FullAttentionSpec),
    _SinkRules(SinkFullAttentionSpec),
    _MLARules(MLAAttentionSpec),
    _SlidingWindowRules(SlidingWindowSpec),
    _SlidingWindowMLARules(SlidingWindowMLASpec),
    _ChunkedLocalRules(ChunkedLocalAttentionSpec),
    _EncoderOnlyRules(EncoderOnlyAttentionSpec),
    _CrossRules(CrossAttentionSpec),
    _StateRules(MambaSpec),
)


def rules_for(spec: KVCacheSpec) -> KindRules[Any]:
    """The rules of ``spec``'s kind."""
    return _RULES[spec.kind]


def rules_for_kind(kind: object) -> KindRules[Any]:
    """The rules of ``kind`` (a ``KVCacheSpecKind`` or its value).

    Raises:
        InvalidArgumentError: not a known kind (the message lists the known ones).
    """
    try:
        return _RULES[KVCacheSpecKind(kind)]
    except (ValueError, KeyError):
        raise InvalidArgumentError(
            f"kind must be a KVCacheSpecKind, got {kind!r}; known kinds: "
            f"{', '.join(k.value for k in _RULES)}"
        ) from None


def all_rules() -> tuple[KindRules[Any], ...]:
    """Every kind's rules, in ``KVCacheSpecKind`` order."""
    return tuple(_RULES.values())


def attention_rules() -> tuple[KindRules[Any], ...]:
    """The attention kinds' rules (specs under ``AttentionSpec``), in ``KVCacheSpecKind``
    order."""
    return tuple(r for r in _RULES.values() if issubclass(r.spec_class, AttentionSpec))


CONTEXT_SHARDED_KINDS: frozenset[KVCacheSpecKind] = frozenset(
    r.kind for r in _RULES.values() if r.context_sharded
)
"""Kinds whose cache decode context parallelism shards across ranks (token ``t`` on rank
``t mod N``; ``KindRules.context_sharded``): full and MLA attention, whose caches grow
with the context without bound. Every other kind is replicated on every rank: windows,
chunks and states are bounded per request (sharding would save little and cost a merge
per layer), cross-attention is bounded by the encoder length, and sink tokens
(``sink_full_attention``) would need their sink slots sharded too, which the runtime
does not do yet."""


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
