"""``attnkit.kinds``: each kind's rules against a scalar, per-request definition.

The reference below is written from the kinds' meaning, one request at a time, with
no numpy: a request's tokens sit at positions ``shift + t``; a block is needed when it
holds an occupied position; a query at position ``p`` of a sliding window ``w`` sees
keys ``p - w + 1 .. p``, of a chunked-local layer the keys of its own chunk up to
``p``; a block is live when some query of this step (or a later one) sees a key in
it. ``rules_for(spec)``'s vectorised methods must agree with it for every request of
hypothesis-generated steps, with windows, chunks, sinks and block sizes near each
other's boundaries.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit.kinds._registry as kinds_module
from attnkit import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    IndexerSpec,
    InvalidArgumentError,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from attnkit.kinds import (
    CONTEXT_SHARDED_KINDS,
    Mask,
    ShardedRules,
    StepLens,
    StepTokens,
    TensorSplit,
    all_rules,
    attention_rules,
    rules_for,
    rules_for_kind,
    spans,
)

K = KVCacheSpecKind
HEADS, HEAD_SIZE = 2, 8

# ---------------------------------------------------------------------------- reference
# One request at a time, from the definitions in the module docstring.

DECODER_KINDS = {
    K.FULL_ATTENTION,
    K.SINK_FULL_ATTENTION,
    K.MLA_ATTENTION,
    K.SLIDING_WINDOW,
    K.SLIDING_WINDOW_MLA,
    K.CHUNKED_LOCAL_ATTENTION,
    K.INDEXER,
}
PAGED_KINDS = {
    K.FULL_ATTENTION,
    K.SINK_FULL_ATTENTION,
    K.SLIDING_WINDOW,
    K.CHUNKED_LOCAL_ATTENTION,
    K.CROSS_ATTENTION,
}
LATENT_KINDS = {K.MLA_ATTENTION, K.SLIDING_WINDOW_MLA}
RELEASING_KINDS = {K.SLIDING_WINDOW, K.SLIDING_WINDOW_MLA, K.CHUNKED_LOCAL_ATTENTION}


def ref_shift(spec: KVCacheSpec) -> int:
    return spec.sink_len if isinstance(spec, SinkFullAttentionSpec) else 0


def blocks_holding(num_positions: int, block_size: int) -> int:
    """Blocks that positions ``0 .. num_positions - 1`` occupy (counted, not divided)."""
    blocks = 0
    while blocks * block_size < num_positions:
        blocks += 1
    return blocks


def ref_blocks_needed(spec: KVCacheSpec, computed: int, query: int, encoder: int) -> int:
    if spec.kind is K.ENCODER_ONLY_ATTENTION:
        return 0  # nothing is kept
    if spec.kind is K.MAMBA:
        return 1  # the whole state in one block
    if spec.kind is K.CROSS_ATTENTION:
        return blocks_holding(encoder, spec.block_size)
    return blocks_holding(ref_shift(spec) + computed + query, spec.block_size)


def lowest_visible_key(spec: KVCacheSpec, p: int) -> int:
    """The lowest key position a query at position ``p`` sees."""
    if isinstance(spec, SlidingWindowSpec):  # also SlidingWindowMLASpec
        return max(0, p - (spec.sliding_window - 1))
    if isinstance(spec, ChunkedLocalAttentionSpec):
        chunk_start = p
        while chunk_start % spec.attention_chunk_size:
            chunk_start -= 1
        return chunk_start
    return 0


def ref_first_live_block(spec: KVCacheSpec, computed: int, query: int) -> int:
    """The lowest block holding a key that a query of this step or a later one sees."""
    if spec.kind not in RELEASING_KINDS:
        return 0
    # This step's queries are computed .. computed+query-1; later ones come after, and
    # see no further back than these (checked a few positions past the step).
    queries = range(computed, computed + query + 3)
    return min(lowest_visible_key(spec, p) for p in queries) // spec.block_size


def ref_seq_len(spec: KVCacheSpec, computed: int, query: int, encoder: int) -> int:
    if spec.kind is K.ENCODER_ONLY_ATTENTION:
        return query  # the request is encoded whole, in this step
    if spec.kind is K.CROSS_ATTENTION:
        return encoder  # queries see every encoder token
    return ref_shift(spec) + computed + query


def ref_writes(spec: KVCacheSpec) -> str:
    if spec.kind in DECODER_KINDS:
        return "step"
    if spec.kind is K.CROSS_ATTENTION:
        return "encoder"
    return "none"


def ref_cache_shapes(spec: KVCacheSpec, num_blocks: int) -> tuple[tuple[int, ...], ...]:
    if isinstance(spec, MambaSpec):
        return tuple((num_blocks, *shape) for shape in spec.shapes)
    if spec.kind is K.ENCODER_ONLY_ATTENTION:
        return ()
    if isinstance(spec, IndexerSpec):  # 128 fp8 bytes + one fp32 scale per 128 values
        return ((num_blocks, spec.block_size, spec.head_size + spec.head_size // 128 * 4),)
    assert isinstance(
        spec,
        FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec | CrossAttentionSpec,
    )
    if spec.kind in LATENT_KINDS:
        return ((num_blocks, spec.block_size, spec.head_size),)
    return ((num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size),)


def ref_admission(
    spec: KVCacheSpec, computed: list[int], encoder: list[int]
) -> tuple[int, str] | None:
    """The first request the kind refuses, and a phrase its reason must contain."""
    for i, (c, e) in enumerate(zip(computed, encoder, strict=True)):
        if spec.kind is K.ENCODER_ONLY_ATTENTION and c > 0:
            return i, "was already encoded"
        if spec.kind is K.CROSS_ATTENTION and c == 0 and e < 1:
            return i, f"encoder_len must be >= 1, got {e}"
    return None


# ---------------------------------------------------------------------------- specs


def make_spec(kind: KVCacheSpecKind, block_size: int, param: int) -> KVCacheSpec:
    """A spec of ``kind``; ``param`` is its window, chunk or sink length where it has one."""
    attn: dict[str, Any] = {
        "block_size": block_size,
        "head_size": HEAD_SIZE,
        "dtype": torch.float16,
    }
    if kind is K.FULL_ATTENTION:
        return FullAttentionSpec(num_kv_heads=HEADS, **attn)
    if kind is K.SINK_FULL_ATTENTION:
        return SinkFullAttentionSpec(num_kv_heads=HEADS, sink_len=param, **attn)
    if kind is K.MLA_ATTENTION:
        return MLAAttentionSpec(**attn)
    if kind is K.SLIDING_WINDOW:
        return SlidingWindowSpec(num_kv_heads=HEADS, sliding_window=param, **attn)
    if kind is K.SLIDING_WINDOW_MLA:
        return SlidingWindowMLASpec(sliding_window=param, **attn)
    if kind is K.CHUNKED_LOCAL_ATTENTION:
        return ChunkedLocalAttentionSpec(num_kv_heads=HEADS, attention_chunk_size=param, **attn)
    if kind is K.ENCODER_ONLY_ATTENTION:
        return EncoderOnlyAttentionSpec(num_kv_heads=HEADS, **attn)
    if kind is K.CROSS_ATTENTION:
        return CrossAttentionSpec(num_kv_heads=HEADS, **attn)
    if kind is K.INDEXER:
        # param is no extent of the kind; the example keeps half a block per query
        return IndexerSpec(
            block_size=block_size, dtype=torch.float16, index_topk=max(1, block_size // 2)
        )
    return MambaSpec(
        block_size=block_size,
        shapes=((param, 3), (2, param, 4)),
        dtypes=(torch.float32, torch.bfloat16),
    )


def test_every_kind_is_covered() -> None:
    assert {make_spec(k, 4, 3).kind for k in KVCacheSpecKind} == set(KVCacheSpecKind)


@st.composite
def near(draw: st.DrawFn, anchor: int) -> int:
    """A positive int at or next to ``anchor`` or one of its small multiples."""
    base = anchor * draw(st.sampled_from([1, 1, 2, 3]))
    return max(1, base + draw(st.integers(-1, 1)))


@st.composite
def specs(draw: st.DrawFn, kind: KVCacheSpecKind) -> KVCacheSpec:
    block_size = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16]))
    param = draw(st.one_of(near(block_size), st.integers(1, 40)))
    return make_spec(kind, block_size, param)


@st.composite
def step_lens(draw: st.DrawFn, spec: KVCacheSpec) -> tuple[list[int], list[int], list[int]]:
    """Per-request (computed, query, encoder), with lengths at and next to the spec's
    boundaries: multiples of the block size, window or chunk, and (windows) the
    positions whose first visible key starts a block (``k * block_size + w - 1``)."""
    n = draw(st.integers(0, 8))
    periods, offsets = [spec.block_size], [0]
    if isinstance(spec, SlidingWindowSpec):
        periods.append(spec.sliding_window)
        offsets.append(spec.sliding_window - 1)
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        periods.append(spec.attention_chunk_size)
    elif isinstance(spec, SinkFullAttentionSpec):
        offsets.append(spec.block_size - spec.sink_len % spec.block_size)

    def at(k: int, period: int, offset: int, d: int) -> int:
        return max(0, k * period + offset + d)

    boundary = st.builds(
        at,
        st.integers(0, 4),
        st.sampled_from(periods),
        st.sampled_from(offsets),
        st.integers(-1, 1),
    )
    computed = draw(
        st.lists(st.one_of(st.just(0), boundary, st.integers(0, 70)), min_size=n, max_size=n)
    )
    positive = st.one_of(st.just(1), boundary.map(lambda v: max(1, v)), st.integers(1, 40))
    query = draw(st.lists(positive, min_size=n, max_size=n))
    encoder = draw(st.lists(st.one_of(st.just(0), positive), min_size=n, max_size=n))
    return computed, query, encoder


def as_lens(computed: list[int], query: list[int], encoder: list[int]) -> StepLens:
    def arr(values: list[int]) -> np.ndarray[Any, np.dtype[np.int64]]:
        return np.array(values, dtype=np.int64)

    return StepLens(arr(computed), arr(query), arr(encoder))


def per_request(result: np.ndarray[Any, Any], n: int) -> list[int]:
    """A rules method's result as a list, after checking it is one int per request."""
    assert isinstance(result, np.ndarray)
    assert result.shape == (n,)
    assert np.issubdtype(result.dtype, np.integer)
    values: list[int] = result.tolist()
    return values


# ---------------------------------------------------------------------------- properties


@pytest.mark.parametrize("kind", list(KVCacheSpecKind), ids=lambda k: k.value)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_rules_agree_with_the_scalar_definition(kind: KVCacheSpecKind, data: st.DataObject) -> None:
    spec = data.draw(specs(kind), label="spec")
    computed, query, encoder = data.draw(step_lens(spec), label="computed, query, encoder")
    n = len(computed)
    rules = rules_for(spec)
    lens = as_lens(computed, query, encoder)
    rows = list(zip(computed, query, encoder, strict=True))

    assert per_request(rules.blocks_needed(spec, lens), n) == [
        ref_blocks_needed(spec, c, q, e) for c, q, e in rows
    ]
    assert per_request(rules.first_live_block(spec, lens), n) == [
        ref_first_live_block(spec, c, q) for c, q, _ in rows
    ]
    assert per_request(rules.seq_lens(spec, lens), n) == [
        ref_seq_len(spec, c, q, e) for c, q, e in rows
    ]
    problem = rules.admission_problems(lens)
    expected = ref_admission(spec, computed, encoder)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None
        assert problem[0] == expected[0]
        assert expected[1] in problem[1]
    # The inputs are not modified.
    assert lens.computed.tolist() == computed
    assert lens.query.tolist() == query


@pytest.mark.parametrize("kind", list(KVCacheSpecKind), ids=lambda k: k.value)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_rules_constants_and_cache_shapes(kind: KVCacheSpecKind, data: st.DataObject) -> None:
    spec = data.draw(specs(kind), label="spec")
    num_blocks = data.draw(st.integers(2, 10_000), label="num_blocks")
    rules = rules_for(spec)
    assert rules.shift(spec) == ref_shift(spec)
    assert rules.writes == ref_writes(spec)
    assert rules.has_cache is (kind is not K.ENCODER_ONLY_ATTENTION)
    assert rules.causal is (kind not in {K.ENCODER_ONLY_ATTENTION, K.CROSS_ATTENTION})
    assert rules.releases is (kind in RELEASING_KINDS)
    assert rules.cache_shapes(spec, num_blocks) == ref_cache_shapes(spec, num_blocks)


@pytest.mark.parametrize("kind", list(KVCacheSpecKind), ids=lambda k: k.value)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_release_reach_is_the_first_step_that_releases_the_block(
    kind: KVCacheSpecKind, data: st.DataObject
) -> None:
    """``release_reach(spec, b)``: the fewest tokens held at whose step block ``b`` is
    no longer live (the reference's first live block, by brute force); 0 where a kind
    releases nothing, which only makes the prefix cache mark its names early."""
    check_release_reach(data.draw(specs(kind), label="spec"))


def check_release_reach(spec: KVCacheSpec) -> None:
    rules = rules_for(spec)
    for block in range(6):
        got = rules.release_reach(spec, block)
        if spec.kind not in RELEASING_KINDS:
            assert got == 0
            continue
        first = next(c for c in range(10_000) if ref_first_live_block(spec, c, 1) > block)
        assert got == first, f"block {block}"


def test_a_release_reach_one_token_early_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = make_spec(K.SLIDING_WINDOW, 4, 6)
    rules = type(rules_for(spec))
    real = rules.release_reach
    monkeypatch.setattr(rules, "release_reach", lambda self, sp, b: real(self, sp, b) - 1)
    with pytest.raises(AssertionError):
        check_release_reach(spec)


@pytest.mark.parametrize("kind", list(KVCacheSpecKind), ids=lambda k: k.value)
def test_a_step_of_no_requests(kind: KVCacheSpecKind) -> None:
    spec = make_spec(kind, 4, 3)
    rules = rules_for(spec)
    lens = as_lens([], [], [])
    for method in (rules.blocks_needed, rules.first_live_block, rules.seq_lens):
        assert per_request(method(spec, lens), 0) == []
    assert rules.admission_problems(lens) is None


# ---------------------------------------------------------------------------- readable cases
# Hand-computed: (spec, computed, query) -> (blocks needed, first live block, seq_len).


def window(w: int, block_size: int) -> SlidingWindowSpec:
    spec = make_spec(K.SLIDING_WINDOW, block_size, w)
    assert isinstance(spec, SlidingWindowSpec)
    return spec


def chunked(c: int, block_size: int) -> ChunkedLocalAttentionSpec:
    spec = make_spec(K.CHUNKED_LOCAL_ATTENTION, block_size, c)
    assert isinstance(spec, ChunkedLocalAttentionSpec)
    return spec


BOUNDARY_CASES = [
    # Sliding window w, block size 4: the step's first query at position `computed`
    # sees keys computed-w+1 .. computed.
    pytest.param(window(5, 4), 0, 6, 2, 0, 6, id="window-new-request-keeps-all"),
    pytest.param(window(5, 4), 4, 1, 2, 0, 5, id="window-first-key-0-block-0"),
    pytest.param(window(5, 4), 7, 1, 2, 0, 8, id="window-first-key-3-last-of-block-0"),
    pytest.param(window(5, 4), 8, 1, 3, 1, 9, id="window-first-key-4-starts-block-1"),
    pytest.param(window(5, 4), 11, 1, 3, 1, 12, id="window-first-key-7-last-of-block-1"),
    pytest.param(window(5, 4), 12, 1, 4, 2, 13, id="window-first-key-8-starts-block-2"),
    pytest.param(window(5, 4), 8, 9, 5, 1, 17, id="window-prefill-chunk-first-query-rules"),
    pytest.param(window(4, 4), 7, 1, 2, 1, 8, id="window-equals-block-first-key-4"),
    pytest.param(window(4, 4), 6, 1, 2, 0, 7, id="window-equals-block-first-key-3"),
    pytest.param(window(1, 4), 8, 1, 3, 2, 9, id="window-1-sees-only-itself-new-block"),
    pytest.param(window(1, 4), 7, 1, 2, 1, 8, id="window-1-last-slot-of-block-1"),
    pytest.param(window(100, 4), 50, 1, 13, 0, 51, id="window-longer-than-context"),
    pytest.param(window(3, 1), 5, 2, 7, 3, 7, id="window-block-size-1"),
    # Chunked local c, block size 4: queries see their own chunk only.
    pytest.param(chunked(8, 4), 7, 1, 2, 0, 8, id="chunk-last-query-of-chunk-0"),
    pytest.param(chunked(8, 4), 8, 1, 3, 2, 9, id="chunk-first-query-of-chunk-1"),
    pytest.param(chunked(8, 4), 15, 1, 4, 2, 16, id="chunk-last-query-of-chunk-1"),
    pytest.param(chunked(8, 4), 16, 1, 5, 4, 17, id="chunk-first-query-of-chunk-2"),
    pytest.param(chunked(8, 4), 6, 4, 3, 0, 10, id="chunk-step-crosses-a-chunk-boundary"),
    pytest.param(chunked(2, 4), 5, 1, 2, 1, 6, id="chunk-smaller-than-block"),
    pytest.param(chunked(2, 4), 3, 1, 1, 0, 4, id="chunk-smaller-than-block-keeps-block-0"),
    pytest.param(chunked(6, 4), 6, 1, 2, 1, 7, id="chunk-not-a-multiple-of-block"),
    pytest.param(chunked(6, 4), 11, 1, 3, 1, 12, id="chunk-not-a-multiple-end-of-chunk-1"),
    pytest.param(chunked(6, 4), 12, 1, 4, 3, 13, id="chunk-not-a-multiple-chunk-2"),
    # Sink tokens sit in front: sink 3, block size 4.
    pytest.param(make_spec(K.SINK_FULL_ATTENTION, 4, 3), 0, 1, 1, 0, 4, id="sink-fills-block-0"),
    pytest.param(make_spec(K.SINK_FULL_ATTENTION, 4, 3), 1, 1, 2, 0, 5, id="sink-spills-to-1"),
    pytest.param(make_spec(K.SINK_FULL_ATTENTION, 4, 4), 0, 4, 2, 0, 8, id="sink-of-a-block"),
    # Full attention: a block per block_size tokens.
    pytest.param(make_spec(K.FULL_ATTENTION, 4, 0), 3, 1, 1, 0, 4, id="full-exactly-one-block"),
    pytest.param(make_spec(K.FULL_ATTENTION, 4, 0), 4, 1, 2, 0, 5, id="full-one-past-a-block"),
]


@pytest.mark.parametrize(
    ("spec", "computed", "query", "blocks", "first_live", "seq_len"), BOUNDARY_CASES
)
def test_window_chunk_and_sink_boundaries(
    spec: KVCacheSpec, computed: int, query: int, blocks: int, first_live: int, seq_len: int
) -> None:
    rules = rules_for(spec)
    lens = as_lens([computed], [query], [0])
    got = (
        int(rules.blocks_needed(spec, lens)[0]),
        int(rules.first_live_block(spec, lens)[0]),
        int(rules.seq_lens(spec, lens)[0]),
    )
    assert got == (blocks, first_live, seq_len)
    # The scalar reference agrees with the hand-computed figures too.
    assert (
        ref_blocks_needed(spec, computed, query, 0),
        ref_first_live_block(spec, computed, query),
        ref_seq_len(spec, computed, query, 0),
    ) == (blocks, first_live, seq_len)


ADMISSION_CASES = [
    pytest.param(
        K.ENCODER_ONLY_ATTENTION,
        [0, 0, 5, 7],
        [0, 0, 0, 0],
        (2, "was already encoded"),
        id="encoder-only-second-step",
    ),
    pytest.param(K.ENCODER_ONLY_ATTENTION, [0, 0], [0, 0], None, id="encoder-only-all-new"),
    pytest.param(
        K.CROSS_ATTENTION,
        [3, 0, 0],
        [0, 4, 0],
        (2, "encoder_len must be >= 1, got 0"),
        id="cross-new-without-encoder",
    ),
    pytest.param(
        K.CROSS_ATTENTION, [3, 0], [0, 1], None, id="cross-continuing-needs-no-encoder-len"
    ),
    pytest.param(K.SLIDING_WINDOW, [5, 0], [0, 0], None, id="window-takes-anything"),
    pytest.param(K.MAMBA, [5, 0], [0, 0], None, id="mamba-takes-anything"),
]


@pytest.mark.parametrize(("kind", "computed", "encoder", "expected"), ADMISSION_CASES)
def test_admission_problems_cases(
    kind: KVCacheSpecKind,
    computed: list[int],
    encoder: list[int],
    expected: tuple[int, str] | None,
) -> None:
    spec = make_spec(kind, 4, 3)
    problem = rules_for(spec).admission_problems(as_lens(computed, [1] * len(computed), encoder))
    assert ref_admission(spec, computed, encoder) == expected
    if expected is None:
        assert problem is None
    else:
        assert problem is not None
        assert problem[0] == expected[0]
        assert expected[1] in problem[1]


# ---------------------------------------------------------------------------- what a kind declares
# Each kind's facts, written out by hand: its mask for a spec of parameter ``p`` (the
# window, chunk or sink length), and its constants.


def ref_mask(kind: KVCacheSpecKind, p: int) -> Mask:
    if kind in (K.ENCODER_ONLY_ATTENTION, K.CROSS_ATTENTION):
        return Mask(causal=False)  # every key of the request (or of its encoder)
    if kind in (K.SLIDING_WINDOW, K.SLIDING_WINDOW_MLA):
        return Mask(causal=True, window=p)
    if kind is K.CHUNKED_LOCAL_ATTENTION:
        return Mask(causal=True, chunk=p)
    if kind is K.SINK_FULL_ATTENTION:
        return Mask(causal=True, sink_len=p)
    return Mask(causal=True)  # full and MLA attention; states see the past only


# kind: (latent, context_sharded, grows_without_bound, counts_kv_per_token, short_name)
FACTS: dict[KVCacheSpecKind, tuple[bool, bool, bool, bool, str | None]] = {
    K.FULL_ATTENTION: (False, True, True, True, "full"),
    K.SINK_FULL_ATTENTION: (False, False, True, True, "sink_tokens"),
    K.MLA_ATTENTION: (True, True, True, True, "mla"),
    K.SLIDING_WINDOW: (False, False, False, True, "window"),
    K.SLIDING_WINDOW_MLA: (True, False, False, True, "mla_window"),
    K.CHUNKED_LOCAL_ATTENTION: (False, False, False, True, "chunked"),
    K.ENCODER_ONLY_ATTENTION: (False, False, False, False, "encoder"),
    K.CROSS_ATTENTION: (False, False, True, False, "cross"),
    K.MAMBA: (False, False, False, False, None),
    K.INDEXER: (False, False, True, True, None),
}
# kind: (extent, extent_field, bound label of a spec of parameter 7)
EXTENTS: dict[KVCacheSpecKind, tuple[str | None, str | None, str | None]] = {
    K.SINK_FULL_ATTENTION: ("sink_len", "sink_len", None),
    K.SLIDING_WINDOW: ("window", "sliding_window", "window 7"),
    K.SLIDING_WINDOW_MLA: ("window", "sliding_window", "window 7"),
    K.CHUNKED_LOCAL_ATTENTION: ("chunk", "attention_chunk_size", "chunk 7"),
}


@pytest.mark.parametrize("kind", list(KVCacheSpecKind), ids=lambda k: k.value)
def test_each_kind_declares_its_mask_and_facts(kind: KVCacheSpecKind) -> None:
    spec = make_spec(kind, 4, 7)
    rules = rules_for(spec)
    mask = rules.mask(spec)
    assert mask == ref_mask(kind, 7)
    assert mask.bidirectional is (kind in (K.ENCODER_ONLY_ATTENTION, K.CROSS_ATTENTION))
    assert mask.causal is rules.causal  # the metadata's causal flag is the mask's
    assert rules.shift(spec) == mask.sink_len  # positions shift by the sink tokens
    assert (
        rules.latent,
        rules.context_sharded,
        rules.grows_without_bound,
        rules.counts_kv_per_token,
        rules.short_name,
    ) == FACTS[kind]
    extent, field, label = EXTENTS.get(kind, (None, None, None))
    assert (rules.extent, rules.extent_field, rules.bound_label(spec)) == (extent, field, label)
    assert rules.bound(spec) == (7 if label is not None else None)
    assert rules.kind is kind
    assert rules_for_kind(kind) is rules
    assert rules_for_kind(kind.value) is rules


def test_rules_cover_every_kind_in_order() -> None:
    assert [r.kind for r in all_rules()] == list(KVCacheSpecKind)
    assert [r.kind for r in attention_rules()] == [k for k in KVCacheSpecKind if k is not K.MAMBA]
    assert {k.value for k in CONTEXT_SHARDED_KINDS} == {"full_attention", "mla_attention"}


def test_an_unknown_kind_is_an_error_naming_the_known_ones() -> None:
    with pytest.raises(InvalidArgumentError, match=r"got 'sparse'; known kinds: full_attention, "):
        rules_for_kind("sparse")
    with pytest.raises(InvalidArgumentError, match="cross_attention, mamba"):
        rules_for_kind(3)


def test_the_import_check_names_a_kind_without_rules() -> None:
    """The registry attnkit.kinds builds at import: the broken variants are refused, naming
    the kind (so a kind added to spec.py alone fails at ``import attnkit``)."""
    every = list(kinds_module._RULES.values())
    assert kinds_module._registry(*every) == kinds_module._RULES
    without = [r for r in every if r.kind is not K.CROSS_ATTENTION]
    with pytest.raises(TypeError, match=r"no KindRules for kind\(s\) cross_attention"):
        kinds_module._registry(*without)
    with pytest.raises(TypeError, match="kind full_attention has two KindRules"):
        kinds_module._registry(*every, every[0])

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Elsewhere(FullAttentionSpec):  # full_attention, but not spec.py's class
        pass

    wrong = type(every[0])(Elsewhere)
    with pytest.raises(TypeError, match=r"name spec class Elsewhere, spec\.py defines Full"):
        kinds_module._registry(wrong, *every[1:])


# ---------------------------------------------------------------------------- slot mapping
# Per token, in Python: a step kind writes each new token at its shifted position; cross
# attention writes the encoder tokens of new requests first; the others write nothing.


def ref_slots(
    spec: KVCacheSpec,
    table: list[list[int]],
    computed: list[int],
    query: list[int],
    encoder: list[int],
    shard: tuple[int, int] | None = None,
) -> list[int]:
    bs, shift = spec.block_size, ref_shift(spec)
    tokens = [
        (i, c + t) for i, (c, q) in enumerate(zip(computed, query, strict=True)) for t in range(q)
    ]
    if spec.kind in (K.ENCODER_ONLY_ATTENTION, K.MAMBA):
        return [-1] * len(tokens)
    if spec.kind is K.CROSS_ATTENTION:
        written = [
            table[i][e // bs] * bs + e % bs
            for i in range(len(computed))
            if computed[i] == 0
            for e in range(encoder[i])
        ]
        return written + [-1] * (max(len(tokens), len(written)) - len(written))
    slots = []
    for i, pos in tokens:
        p = shift + pos
        if shard is not None:
            rank, world = shard
            if p % world != rank:
                slots.append(-1)
                continue
            p //= world  # the rank's local index
        slots.append(table[i][p // bs] * bs + p % bs)
    return slots


def step_tokens(computed: list[int], query: list[int]) -> StepTokens:
    req = [i for i, q in enumerate(query) for _ in range(q)]
    pos = [c + t for c, q in zip(computed, query, strict=True) for t in range(q)]
    return StepTokens(np.array(req, dtype=np.int64), np.array(pos, dtype=np.int64))


def random_table(data: st.DataObject, n: int, width: int) -> list[list[int]]:
    """Distinct, shuffled block ids >= 1 (0 is the null block)."""
    ids = data.draw(st.permutations(range(1, n * width + 1)), label="block ids")
    return [list(ids[i * width : (i + 1) * width]) for i in range(n)]


@pytest.mark.parametrize("kind", list(KVCacheSpecKind), ids=lambda k: k.value)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_slot_mapping_agrees_with_a_per_token_loop(
    kind: KVCacheSpecKind, data: st.DataObject
) -> None:
    spec = data.draw(specs(kind), label="spec")
    computed, query, encoder = data.draw(step_lens(spec), label="computed, query, encoder")
    n, bs = len(computed), spec.block_size
    totals = [ref_shift(spec) + c + q for c, q in zip(computed, query, strict=True)]
    longest = max([*totals, *encoder, 1])
    width = longest // bs + 1
    table = random_table(data, n, width)
    rules = rules_for(spec)
    got = rules.slot_mapping(
        spec,
        np.array(table, dtype=np.int32).reshape(n, width),
        step_tokens(computed, query),
        as_lens(computed, query, encoder),
    )
    assert got.dtype == np.int64
    assert got.tolist() == ref_slots(spec, table, computed, query, encoder)


@pytest.mark.parametrize(
    "kind", [K.FULL_ATTENTION, K.SINK_FULL_ATTENTION, K.MLA_ATTENTION], ids=lambda k: k.value
)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_sharded_slot_mapping_writes_the_ranks_positions(
    kind: KVCacheSpecKind, data: st.DataObject
) -> None:
    spec = data.draw(specs(kind), label="spec")
    computed, query, encoder = data.draw(step_lens(spec), label="computed, query, encoder")
    world = data.draw(st.integers(1, 4), label="world_size")
    rank = data.draw(st.integers(0, world - 1), label="rank")
    n, bs = len(computed), spec.block_size
    totals = [ref_shift(spec) + c + q for c, q in zip(computed, query, strict=True)]
    longest = max([*totals, 1])
    width = longest // bs + 1
    table = random_table(data, n, width)
    rules = ShardedRules(rules_for(spec), rank, world)
    lens = as_lens(computed, query, encoder)
    got = rules.slot_mapping(
        spec, np.array(table, dtype=np.int32).reshape(n, width), step_tokens(computed, query), lens
    )
    assert got.tolist() == ref_slots(spec, table, computed, query, encoder, shard=(rank, world))
    assert rules.context_shard == (rank, world)
    assert rules.global_seq_lens(spec, lens).tolist() == [
        ref_seq_len(spec, c, q, e) for c, q, e in zip(computed, query, encoder, strict=True)
    ]


def test_a_slot_on_the_null_block_is_a_manager_bug() -> None:
    spec = make_spec(K.FULL_ATTENTION, 4, 0)
    table = np.array([[5, 0]], dtype=np.int32)  # block 1 of the request never allocated
    with pytest.raises(AssertionError, match="null block"):
        rules_for(spec).slot_mapping(spec, table, step_tokens([3], [2]), as_lens([3], [2], [0]))


# ---------------------------------------------------------------------------- tensor parallelism


@pytest.mark.parametrize(
    ("kind", "heads", "tp", "kv", "replicas", "detail"),
    [
        pytest.param(K.FULL_ATTENTION, 8, 4, 2, 1, "K/V heads 8 -> 2 per rank", id="split"),
        pytest.param(K.SLIDING_WINDOW, 8, 8, 1, 1, "K/V heads 8 -> 1 per rank", id="one-each"),
        pytest.param(
            K.CROSS_ATTENTION,
            2,
            8,
            1,
            4,
            "K/V heads 2 -> 1 per rank (each on 4 ranks)",
            id="replicated",
        ),
        pytest.param(K.ENCODER_ONLY_ATTENTION, 4, 1, 4, 1, "K/V heads 4 -> 4 per rank", id="tp1"),
    ],
)
def test_tensor_split_of_kv_heads(
    kind: KVCacheSpecKind, heads: int, tp: int, kv: int, replicas: int, detail: str
) -> None:
    spec = make_spec(kind, 16, 64)
    assert isinstance(spec, AttentionSpec)
    spec = dataclasses.replace(spec, num_kv_heads=heads)
    split = rules_for(spec).tensor_split(spec, tp, "layer 'x'")
    assert split == TensorSplit(dataclasses.replace(spec, num_kv_heads=kv), kv, replicas, detail)


@pytest.mark.parametrize("kind", [K.MLA_ATTENTION, K.SLIDING_WINDOW_MLA], ids=lambda k: k.value)
def test_tensor_split_replicates_a_latent(kind: KVCacheSpecKind) -> None:
    spec = make_spec(kind, 16, 64)
    split = rules_for(spec).tensor_split(spec, 8, "layer 'x'")
    assert split == TensorSplit(
        spec,
        1,
        8,
        f"MLA latent ({HEAD_SIZE} per token) shared by all heads: replicated on every "
        f"tensor-parallel rank",
    )


@pytest.mark.parametrize(
    ("heads", "tp", "match"),
    [
        pytest.param(3, 2, "cannot split the 3 K/V heads of layer 'x'.*divide 3", id="more"),
        pytest.param(2, 3, "cannot split the 2 K/V heads of layer 'x'.*multiple of 2", id="fewer"),
    ],
)
def test_tensor_split_refuses_heads_that_do_not_divide(heads: int, tp: int, match: str) -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=8, dtype=torch.float16)
    with pytest.raises(InvalidArgumentError, match=match):
        rules_for(spec).tensor_split(spec, tp, "layer 'x'")


def test_a_state_kind_has_no_attention_split() -> None:
    spec = make_spec(K.MAMBA, 4, 3)
    with pytest.raises(InvalidArgumentError, match="mamba of layer 'x' has no attention heads"):
        rules_for(spec).tensor_split(spec, 2, "layer 'x'")


# ---------------------------------------------------------------------------- examples


ATTENTION_KINDS = [k for k in KVCacheSpecKind if k is not K.MAMBA]


@pytest.mark.parametrize("kind", ATTENTION_KINDS, ids=lambda k: k.value)
def test_example_spec_is_the_kinds_spec(kind: KVCacheSpecKind) -> None:
    rules = rules_for_kind(kind)
    heads = 1 if FACTS[kind][0] else HEADS  # a latent has one "head"
    spec = rules.example_spec(
        block_size=4, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.float16, extent=3
    )
    assert spec == make_spec(kind, 4, 3)  # the extent lands in the kind's own field
    assert type(spec) is type(make_spec(kind, 4, 3))
    fp8 = rules.example_spec(
        block_size=4,
        num_kv_heads=heads,
        head_size=HEAD_SIZE,
        dtype=torch.float16,
        kv_cache_dtype="fp8_e4m3",
        extent=3,
    )
    assert fp8.kv_cache_dtype == "fp8_e4m3"


def test_example_spec_needs_the_extent_of_a_kind_with_one() -> None:
    with pytest.raises(InvalidArgumentError, match="sliding_window needs extent"):
        rules_for_kind(K.SLIDING_WINDOW).example_spec(
            block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16
        )
    with pytest.raises(InvalidArgumentError, match="come from their state type"):
        rules_for_kind(K.MAMBA).example_spec(
            block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16
        )


def test_example_extents_sit_at_block_edges() -> None:
    assert rules_for_kind(K.FULL_ATTENTION).example_extents(4) == ()
    assert rules_for_kind(K.SLIDING_WINDOW).example_extents(4) == (1, 2, 3, 4, 5, 7, 8, 9)
    assert rules_for_kind(K.SLIDING_WINDOW_MLA).example_extents(16) == (
        1,
        2,
        3,
        5,
        15,
        16,
        17,
        31,
        32,
        33,
    )
    assert rules_for_kind(K.CHUNKED_LOCAL_ATTENTION).example_extents(16) == (
        1,
        2,
        4,
        8,
        15,
        16,
        17,
        31,
        32,
        33,
    )
    assert rules_for_kind(K.SINK_FULL_ATTENTION).example_extents(4) == (1, 3, 4, 5)


def test_example_layer_params_of_sink_tokens() -> None:
    spec = make_spec(K.SINK_FULL_ATTENTION, 4, 3)
    shapes: list[tuple[int, ...]] = []

    def draw(*shape: int) -> torch.Tensor:
        shapes.append(shape)
        return torch.zeros(shape)

    extra = rules_for(spec).example_layer_params(spec, draw)
    assert sorted(extra) == ["sink_key", "sink_value"]
    assert shapes == [(3, HEADS, HEAD_SIZE)] * 2  # [sink_len, Hkv, D], key then value
    full = make_spec(K.FULL_ATTENTION, 4, 3)
    assert rules_for(full).example_layer_params(full, draw) == {}


# ---------------------------------------------------------------- one row per token


def _token_row_facts() -> list[str]:
    """What the kinds caching one row per token answer, against figures written here:
    MLA latents (576 wide, bf16), sliding-window MLA, DSA index rows (128 + 4 B)."""
    mla = MLAAttentionSpec(block_size=16, head_size=576, dtype=torch.bfloat16)
    window = SlidingWindowMLASpec(
        block_size=16, head_size=576, dtype=torch.bfloat16, sliding_window=64
    )
    index = IndexerSpec(block_size=16, dtype=torch.bfloat16)
    expected = [
        (mla, (7, 16, 576), True, "MLA latent (576 per token) shared by all heads"),
        (window, (7, 16, 576), True, "MLA latent (576 per token) shared by all heads"),
        (index, (7, 16, 132), False, "index keys (132 B per token) read by every indexer head"),
    ]
    problems: list[str] = []
    for spec, shape, latent, detail in expected:
        rules = rules_for(spec)
        split = rules.tensor_split(spec, 4, "x")
        got = (
            rules.cache_shapes(spec, 7),
            rules.latent,
            rules.tp_replicated,
            (split.spec, split.kv_heads, split.kv_replicas, split.detail),
        )
        want = (
            (shape,),
            latent,
            True,
            (spec, 1, 4, f"{detail}: replicated on every tensor-parallel rank"),
        )
        if got != want:
            problems.append(f"{spec.kind.value}: {got} != {want}")
        with pytest.raises(ValueError, match=r"one (latent|quantised row) per token"):
            rules.cache_shapes(spec, 7, "planes")
    return problems


def test_token_row_kinds_answer_as_before_the_merge() -> None:
    assert _token_row_facts() == []


def test_broken_token_row_width_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnkit.kinds import _attention

    # The indexer's rows measured as the MLA's: its head size, not its row bytes.
    monkeypatch.setattr(_attention._IndexerRules, "row_width", _attention._TokenRowRules.row_width)
    assert [p.split(":")[0] for p in _token_row_facts()] == ["indexer"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 9), st.integers(0, 50), st.integers(0, 99)), max_size=12),
    st.booleans(),
)
def test_spans_lists_every_entry_of_every_span(
    rows: list[tuple[int, int, int]], labelled: bool
) -> None:
    """``spans`` against the spans written out one entry at a time."""
    counts = np.array([c for c, _, _ in rows], dtype=np.int64)
    starts = np.array([s for _, s, _ in rows], dtype=np.int64)
    labels = np.array([lab for _, _, lab in rows], dtype=np.int64)
    owners, values = spans(counts, starts, labels if labelled else None)
    want_owners = [lab if labelled else i for i, (c, _, lab) in enumerate(rows) for _ in range(c)]
    want_values = [s + k for c, s, _ in rows for k in range(c)]
    assert owners.tolist() == want_owners
    assert values.tolist() == want_values
