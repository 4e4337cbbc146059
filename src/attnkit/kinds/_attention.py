"""The attention kinds' rules: one ``KindRules`` subclass per attention kind (paged K/V,
MLA latents, windows, chunks, sinks, encoder-only and cross attention), registered in
``ATTENTION_RULES`` at the end of this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from typing_extensions import override

from .._validation import split_or_replicate
from ..capabilities import KVCacheLayout
from ..errors import InvalidArgumentError
from ..spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    IndexerSpec,
    KVCacheDType,
    KVCacheSpecKind,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from ._base import (
    Ints,
    KindRules,
    Mask,
    StepLens,
    StepTokens,
    TensorSplit,
    _ceil_div,
    _chunk_first_live_block,
    _window_first_live_block,
    boundary_lengths,
    slots_of,
    spans,
)

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
    def check_layout(self, spec: SA, layout: KVCacheLayout) -> None:
        super().check_layout(spec, layout)
        values = 2 * spec.block_size * spec.num_kv_heads * spec.head_size
        if layout == "planes" and spec.dynamic_kv_scales and values % 16:
            # Each plane row carries its heads' scales, so a page's K rows and V rows fill
            # its two halves only when the values need no alignment padding.
            raise ValueError(
                f"kind {spec.kind.value} with kv_cache_dtype={spec.kv_cache_dtype} has a "
                f"'planes' cache layout only when 2 * block_size * num_kv_heads * head_size "
                f"is a multiple of 16, got {values} (layouts: interleaved)"
            )

    @override
    def cache_shapes(
        self, spec: SA, num_blocks: int, layout: KVCacheLayout = "interleaved"
    ) -> tuple[tuple[int, ...], ...]:
        self.check_layout(spec, layout)
        if layout == "planes":
            # Per-token-head scales: each head's values, then its float32 scale's bytes.
            extra = torch.float32.itemsize if spec.dynamic_kv_scales else 0
            plane = (num_blocks * spec.block_size, spec.num_kv_heads, spec.head_size + extra)
            return (plane, plane)
        values = (num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size)
        if spec.dynamic_kv_scales:
            # The float32 scale of each (block, K or V, offset, head) vector, in the same
            # page after the values (spec.page_size_bytes counts both).
            return (values, (num_blocks, 2, spec.block_size, spec.num_kv_heads))
        return (values,)


class _TokenRowRules(_AttentionRules[SA]):
    """Kinds that cache one row per token, read by every head, so tensor parallelism
    replicates it: ``[num_blocks, block_size, row_width(spec)]`` (already token-major:
    ``view(-1, W)`` is row = slot, without a copy). MLA latents (``latent``) and DSA
    index keys (a quantised row of ``row_bytes``) differ only in the facts below."""

    tp_replicated = True
    no_planes_because = "an MLA cache holds one latent per token, not separate K and V"
    row_detail = "MLA latent ({width} per token) shared by all heads"
    """How ``tensor_split`` names the row (``{width}``: ``row_width(spec)``)."""

    def row_width(self, spec: SA) -> int:
        """The last dim of the cache: the row's elements (MLA: the latent width)."""
        return spec.head_size

    @override
    def cache_shapes(
        self, spec: SA, num_blocks: int, layout: KVCacheLayout = "interleaved"
    ) -> tuple[tuple[int, ...], ...]:
        self.check_layout(spec, layout)
        return ((num_blocks, spec.block_size, self.row_width(spec)),)

    @override
    def tensor_split(self, spec: SA, tp: int, where: str) -> TensorSplit:
        # One row per token that every head reads: nothing to split.
        detail = self.row_detail.format(width=self.row_width(spec))
        return TensorSplit(spec, 1, tp, f"{detail}: replicated on every tensor-parallel rank")


class _FullRules(_PagedRules[FullAttentionSpec]):
    context_sharded = True
    short_name = "full"

    @override
    def mask(self, spec: FullAttentionSpec) -> Mask:
        return Mask(mm_prefix=spec.mm_prefix)


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


class _MLARules(_TokenRowRules[MLAAttentionSpec]):
    latent = True
    context_sharded = True
    short_name = "mla"


def _window_release_reach(window: int, block_size: int, block: int) -> int:
    """The fewest tokens held at whose step ``_window_first_live_block`` passes
    ``block``: the step's first query sees from ``computed - window + 1`` on."""
    return (block + 1) * block_size + window - 1


def _chunk_release_reach(chunk: int, block_size: int, block: int) -> int:
    """The fewest tokens held at whose step ``_chunk_first_live_block`` passes
    ``block``: the first multiple of ``chunk`` at or past the block's end."""
    return -(-(block + 1) * block_size // chunk) * chunk


class _SlidingWindowRules(_PagedRules[SlidingWindowSpec]):
    releases = True
    grows_without_bound = False
    extent = "window"
    extent_field = "sliding_window"
    short_name = "window"

    @override
    def mask(self, spec: SlidingWindowSpec) -> Mask:
        return Mask(window=spec.sliding_window, mm_prefix=spec.mm_prefix)

    @override
    def first_live_block(self, spec: SlidingWindowSpec, lens: StepLens) -> Ints:
        return _window_first_live_block(spec.sliding_window, spec.block_size, lens)

    @override
    def release_reach(self, spec: SlidingWindowSpec, block: int) -> int:
        return _window_release_reach(spec.sliding_window, spec.block_size, block)

    @override
    def example_extents(self, block_size: int) -> tuple[int, ...]:
        return tuple(boundary_lengths(block_size, extra=(3, 5)))


class _SlidingWindowMLARules(_TokenRowRules[SlidingWindowMLASpec]):
    latent = True
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
    def release_reach(self, spec: SlidingWindowMLASpec, block: int) -> int:
        return _window_release_reach(spec.sliding_window, spec.block_size, block)

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
    def release_reach(self, spec: ChunkedLocalAttentionSpec, block: int) -> int:
        return _chunk_release_reach(spec.attention_chunk_size, spec.block_size, block)

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
    def prefix_never_hits(self, spec: EncoderOnlyAttentionSpec) -> str | None:
        return "a request is encoded whole, in one step, and nothing is kept for another"

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
    def prefix_never_hits(self, spec: CrossAttentionSpec) -> str | None:
        return (
            "its cache holds the encoder's states, which depend on the encoder input, not "
            "on the decoder's tokens"
        )

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


class _IndexerRules(_TokenRowRules[IndexerSpec]):
    """DeepSeek sparse attention's index keys: one fp8 row (values, then float32 scales)
    per token, ``[num_blocks, block_size, row_bytes]`` uint8. Causal over the whole
    context, like the MLA layers it selects for; it grows as they do."""

    no_planes_because = "an index cache holds one quantised row per token, not K and V"
    row_detail = "index keys ({width} B per token) read by every indexer head"
    # The selection's global slot ids are the MLA cache's: one table for both.
    shares_blocks_with = frozenset({KVCacheSpecKind.MLA_ATTENTION})

    @override
    def row_width(self, spec: IndexerSpec) -> int:
        return spec.row_bytes

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
    ) -> IndexerSpec:
        # The index key width is a multiple of the scale block; the selection is narrow
        # enough that short examples have both kept and dropped positions.
        return IndexerSpec(
            block_size=block_size,
            head_size=128 * max(1, head_size // 128),
            dtype=dtype,
            index_topk=max(1, block_size // 2),
        )


ATTENTION_RULES: tuple[KindRules[Any], ...] = (
    _FullRules(FullAttentionSpec),
    _SinkRules(SinkFullAttentionSpec),
    _MLARules(MLAAttentionSpec),
    _SlidingWindowRules(SlidingWindowSpec),
    _SlidingWindowMLARules(SlidingWindowMLASpec),
    _ChunkedLocalRules(ChunkedLocalAttentionSpec),
    _EncoderOnlyRules(EncoderOnlyAttentionSpec),
    _CrossRules(CrossAttentionSpec),
    _IndexerRules(IndexerSpec),
)
"""The attention kinds' rules, one per kind (``_registry`` checks them at import)."""
