"""Prefix-cache hit rules: each kind's ``KindRules.prefix_hit``, the combined hit over
groups (``find_prefix_hit``), the granularity and the explanations.

The oracle below is written from the definitions, one position at a time, with no
numpy: a prefix of ``L`` tokens is served by a paged group when ``L`` is 0, or when
``L + shift`` ends a block and every key position ``j < L + shift`` that some query at
or after position ``L + shift`` sees (its mask: causal, window, chunk, sinks) lies in a
cached block; by a state group when a checkpoint after ``L`` tokens exists; never by
encoder-only or cross-attention groups. A group's hit is the largest served length
``<=`` the candidate; the model's is the largest length every group serves, found here
by trying every length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st
from typing_extensions import override

from attnkit import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
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
    BelowMinimum,
    BlockNotCached,
    KindRules,
    NeverHits,
    NoCheckpoint,
    NotFullBlock,
    PrefixMiss,
    ShardedRules,
    TokenLayout,
    _prefix,
    rules_for,
)
from attnkit.prefix_cache import (
    GroupLookup,
    PrefixCacheCounters,
    PrefixCacheStats,
    find_prefix_hit,
    miss_causes,
    prefix_granularity,
)

K = KVCacheSpecKind
PAGED = [
    K.FULL_ATTENTION,
    K.SINK_FULL_ATTENTION,
    K.MLA_ATTENTION,
    K.SLIDING_WINDOW,
    K.SLIDING_WINDOW_MLA,
    K.CHUNKED_LOCAL_ATTENTION,
]
NEVER = [K.ENCODER_ONLY_ATTENTION, K.CROSS_ATTENTION]


def make_spec(kind: KVCacheSpecKind, block_size: int, param: int = 3) -> KVCacheSpec:
    """A spec of ``kind``; ``param`` is its window, chunk or sink length."""
    attn: dict[str, Any] = {"block_size": block_size, "head_size": 8, "dtype": torch.float16}
    if kind is K.FULL_ATTENTION:
        return FullAttentionSpec(num_kv_heads=2, **attn)
    if kind is K.SINK_FULL_ATTENTION:
        return SinkFullAttentionSpec(num_kv_heads=2, sink_len=param, **attn)
    if kind is K.MLA_ATTENTION:
        return MLAAttentionSpec(**attn)
    if kind is K.SLIDING_WINDOW:
        return SlidingWindowSpec(num_kv_heads=2, sliding_window=param, **attn)
    if kind is K.SLIDING_WINDOW_MLA:
        return SlidingWindowMLASpec(sliding_window=param, **attn)
    if kind is K.CHUNKED_LOCAL_ATTENTION:
        return ChunkedLocalAttentionSpec(num_kv_heads=2, attention_chunk_size=param, **attn)
    if kind is K.ENCODER_ONLY_ATTENTION:
        return EncoderOnlyAttentionSpec(num_kv_heads=2, **attn)
    if kind is K.CROSS_ATTENTION:
        return CrossAttentionSpec(num_kv_heads=2, **attn)
    return MambaSpec(block_size=block_size, shapes=((4, 3),), dtypes=(torch.float32,))


# ---------------------------------------------------------------------------- oracle


def ref_shift(spec: KVCacheSpec) -> int:
    return spec.sink_len if isinstance(spec, SinkFullAttentionSpec) else 0


def ref_sees(spec: KVCacheSpec, q: int, j: int) -> bool:
    """Whether a query at position ``q`` sees the key at position ``j <= q``."""
    if isinstance(spec, SlidingWindowSpec):  # SlidingWindowMLASpec too
        return q - j < spec.sliding_window
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return j // spec.attention_chunk_size == q // spec.attention_chunk_size
    return True  # full, MLA, sinks (every query sees the sink slots and the rest)


def ref_needed_blocks(spec: KVCacheSpec, length: int) -> set[int]:
    """Blocks holding a key position before the next query that it or a later one sees."""
    p = length + ref_shift(spec)
    horizon = p + 3 * spec.block_size + 40  # past every window and chunk drawn here
    return {j // spec.block_size for q in range(p, horizon) for j in range(p) if ref_sees(spec, q, j)}


def ref_serves(spec: KVCacheSpec, cached: Sequence[bool], length: int) -> bool:
    if length == 0:
        return True
    if spec.kind in NEVER:
        return False
    if spec.kind is K.MAMBA:
        return length < len(cached) and cached[length]
    if (length + ref_shift(spec)) % spec.block_size:
        return False
    return all(b < len(cached) and cached[b] for b in ref_needed_blocks(spec, length))


def ref_hit(spec: KVCacheSpec, cached: Sequence[bool], length: int) -> int:
    return max(n for n in range(length + 1) if ref_serves(spec, cached, n))


def ref_layout(spec: KVCacheSpec) -> TokenLayout:
    return TokenLayout(spec.block_size, ref_shift(spec))


# ---------------------------------------------------------------------------- strategies


@st.composite
def kind_cases(
    draw: st.DrawFn, kinds: Sequence[KVCacheSpecKind] = (*PAGED, K.MAMBA)
) -> tuple[KVCacheSpec, list[bool], int]:
    """A spec, a cached mask (blocks; lengths for a state group) and a candidate length,
    with windows, chunks and sinks near block edges."""
    kind = draw(st.sampled_from(list(kinds)))
    bs = draw(st.sampled_from([1, 2, 3, 4, 8]))
    param = draw(st.one_of(st.integers(1, 20), st.sampled_from([bs - 1, bs, bs + 1, 2 * bs + 1])))
    spec = make_spec(kind, bs, max(param, 1))
    size = draw(st.integers(0, 70 if kind is K.MAMBA else 14))
    dense = draw(st.floats(0.5, 1.0))
    cached = draw(st.lists(st.floats(0, 1), min_size=size, max_size=size))
    mask = [c < dense for c in cached]
    length = draw(st.integers(0, max(size, 1) * (1 if kind is K.MAMBA else bs) + bs + 2))
    return spec, mask, length


def check_rule(
    hit: Callable[[KVCacheSpec, Any, int], tuple[int, PrefixMiss | None]],
    spec: KVCacheSpec,
    cached: list[bool],
    length: int,
) -> None:
    """The rule's answer, for the array and the lookup forms, against the oracle."""
    expected = ref_hit(spec, cached, length)
    array = np.array(cached, dtype=np.bool_)

    def lookup(i: int) -> bool:
        return i < len(cached) and cached[i]

    for form in (array, lookup):
        served, reason = hit(spec, form, length)
        assert served == expected, (spec, cached, length, form is array)
        assert (reason is None) == (served == length)
        if isinstance(reason, BlockNotCached):  # a block that really is missing
            assert not (reason.block < len(cached) and cached[reason.block])
            assert (reason.start, reason.end) == ref_layout(spec).tokens_of(reason.block)
        if isinstance(reason, NotFullBlock):
            assert served == ref_layout(spec).floor(length)
        if isinstance(reason, NoCheckpoint):
            assert reason.latest == served


# ---------------------------------------------------------------------------- kinds


@settings(max_examples=400, deadline=None)
@given(case=kind_cases())
def test_each_kinds_hit_rule_agrees_with_the_definition(
    case: tuple[KVCacheSpec, list[bool], int],
) -> None:
    spec, cached, length = case
    rules = rules_for(spec)
    check_rule(rules.prefix_hit, spec, cached, length)
    served = ref_hit(spec, cached, length)
    if spec.kind is not K.MAMBA:
        blocks = rules.prefix_blocks(spec, served).tolist()
        assert blocks == sorted(ref_needed_blocks(spec, served)) if served else blocks == []
        assert rules.prefix_layout(spec) == ref_layout(spec)


@pytest.mark.parametrize("kind", PAGED, ids=lambda k: k.value)
def test_every_block_cached_serves_every_block_end(kind: KVCacheSpecKind) -> None:
    spec = make_spec(kind, 4, 6)
    rules = rules_for(spec)
    shift = ref_shift(spec)
    cached = np.ones(10, dtype=np.bool_)
    for length in range(0, 38):
        served, reason = rules.prefix_hit(spec, cached, length)
        assert served == max(0, (length + shift) // 4 * 4 - shift)
        assert isinstance(reason, NotFullBlock) or served == length


def test_a_window_needs_only_the_blocks_it_sees() -> None:
    # Window 6, blocks of 4: a hit of 24 tokens needs positions 19..23 (blocks 4, 5);
    # blocks 0..3 may have been released or evicted.
    spec = make_spec(K.SLIDING_WINDOW, 4, 6)
    cached = np.array([0, 0, 0, 0, 1, 1, 0], dtype=np.bool_)
    assert rules_for(spec).prefix_hit(spec, cached, 27) == (
        24,
        NotFullBlock(27, 24, 6, 4),
    )
    # Block 5 missing too: every shorter hit sees a missing block, down to 0; the
    # reason names the block a hit one block longer needs (a hit of 4 needs block 0).
    cached[5] = False
    served, reason = rules_for(spec).prefix_hit(spec, cached, 27)
    assert (served, reason) == (0, BlockNotCached(0, 0, 4))
    cached[:4] = True  # now 20 is served (positions 15..19: blocks 3, 4); 24 needs block 5
    assert rules_for(spec).prefix_hit(spec, cached, 27) == (20, BlockNotCached(5, 20, 24))
    assert rules_for(spec).prefix_blocks(spec, 24).tolist() == [4, 5]


def test_a_chunk_needs_only_its_current_chunks_blocks() -> None:
    spec = make_spec(K.CHUNKED_LOCAL_ATTENTION, 4, 8)
    rules = rules_for(spec)
    none = np.zeros(6, dtype=np.bool_)
    assert rules.prefix_hit(spec, none, 17)[0] == 16  # a chunk edge: nothing to read
    assert rules.prefix_blocks(spec, 16).tolist() == []
    assert rules.prefix_blocks(spec, 20).tolist() == [4]
    assert rules.prefix_hit(spec, none, 23)[0] == 16


def test_sink_tokens_shift_the_blocks() -> None:
    # Sinks of 3 in blocks of 4: block 0 holds the sinks and token 0, so hits end at
    # 1, 5, 9, ... tokens.
    spec = make_spec(K.SINK_FULL_ATTENTION, 4, 3)
    rules = rules_for(spec)
    assert rules.prefix_layout(spec) == TokenLayout(4, 3)
    cached = np.ones(4, dtype=np.bool_)
    assert [rules.prefix_hit(spec, cached, n)[0] for n in range(12)] == [
        0, 1, 1, 1, 1, 5, 5, 5, 5, 9, 9, 9,
    ]
    assert rules.prefix_hit(spec, np.array([False, True]), 8) == (0, BlockNotCached(0, 0, 1))


@pytest.mark.parametrize("kind", NEVER, ids=lambda k: k.value)
def test_encoder_only_and_cross_attention_never_hit(kind: KVCacheSpecKind) -> None:
    spec = make_spec(kind, 4)
    rules = rules_for(spec)
    served, reason = rules.prefix_hit(spec, np.ones(8, dtype=np.bool_), 20)
    assert served == 0
    assert isinstance(reason, NeverHits)
    assert rules.prefix_layout(spec) is None
    expected = {
        K.ENCODER_ONLY_ATTENTION: "encoder_only_attention never hits the prefix cache: a "
        "request is encoded whole, in one step",
        K.CROSS_ATTENTION: "cross_attention never hits the prefix cache: its cache holds "
        "the encoder's states, which depend on the encoder input",
    }[kind]
    assert str(reason).startswith(expected)
    assert rules.prefix_hit(spec, np.ones(8, dtype=np.bool_), 0) == (0, None)
    with pytest.raises(InvalidArgumentError, match="length must be >= 0, got -2"):
        rules.prefix_hit(spec, np.ones(8, dtype=np.bool_), -2)
    with pytest.raises(InvalidArgumentError, match="reads no cached blocks"):
        rules.prefix_blocks(spec, 4)


def test_a_state_group_needs_a_checkpoint_at_exactly_the_length() -> None:
    spec = make_spec(K.MAMBA, 4)
    rules = rules_for(spec)
    assert rules.prefix_unit == "length"
    assert rules_for(make_spec(K.FULL_ATTENTION, 4)).prefix_unit == "block"
    checkpoints = {8, 16}
    assert rules.prefix_hit(spec, lambda n: n in checkpoints, 16) == (16, None)
    assert rules.prefix_hit(spec, lambda n: n in checkpoints, 20) == (16, NoCheckpoint(20, 16))
    assert rules.prefix_hit(spec, lambda n: False, 5) == (0, NoCheckpoint(5, 0))
    assert str(NoCheckpoint(20, 16)).startswith(
        "no state checkpoint at token 20 (the latest before it is at 16)"
    )
    assert rules.prefix_layout(spec) is None
    assert rules.prefix_blocks(spec, 16).tolist() == []


def test_a_context_parallel_shard_never_hits() -> None:
    spec = make_spec(K.FULL_ATTENTION, 4)
    sharded = ShardedRules(rules_for(spec), 0, 2)
    served, reason = sharded.prefix_hit(spec, np.ones(8, dtype=np.bool_), 20)
    assert served == 0
    assert isinstance(reason, NeverHits)
    assert "context-parallel" in str(reason)


def test_bad_lookups_are_refused() -> None:
    spec = make_spec(K.FULL_ATTENTION, 4)
    rules = rules_for(spec)
    with pytest.raises(InvalidArgumentError, match="cached must be a 1-d bool array"):
        rules.prefix_hit(spec, np.ones(4, dtype=np.int64), 8)
    with pytest.raises(InvalidArgumentError, match="length must be >= 0, got -1"):
        rules.prefix_hit(spec, np.ones(4, dtype=np.bool_), -1)
    with pytest.raises(InvalidArgumentError, match="must end on a block boundary"):
        rules.prefix_blocks(spec, 6)


class _WindowRulesOffByOne(KindRules[SlidingWindowSpec]):
    """A broken window rule: it needs the positions ``L - W .. L - 1`` (one too many)."""

    @override
    def cache_shapes(self, spec: SlidingWindowSpec, num_blocks: int, layout: Any = "interleaved") -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError

    @override
    def prefix_hit(self, spec: SlidingWindowSpec, cached: Any, length: int) -> tuple[int, PrefixMiss | None]:
        wider = dataclasses.replace(spec, sliding_window=spec.sliding_window + 1)
        return rules_for(wider).prefix_hit(wider, cached, length)


class _SinkRulesWithoutShift(KindRules[SinkFullAttentionSpec]):
    """A broken sink rule: full attention over unshifted positions."""

    @override
    def cache_shapes(self, spec: SinkFullAttentionSpec, num_blocks: int, layout: Any = "interleaved") -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError

    @override
    def prefix_hit(self, spec: SinkFullAttentionSpec, cached: Any, length: int) -> tuple[int, PrefixMiss | None]:
        full = make_spec(K.FULL_ATTENTION, spec.block_size)
        return rules_for(full).prefix_hit(full, cached, length)


@pytest.mark.parametrize(
    ("broken", "kind"),
    [
        (_WindowRulesOffByOne(SlidingWindowSpec), K.SLIDING_WINDOW),
        (_SinkRulesWithoutShift(SinkFullAttentionSpec), K.SINK_FULL_ATTENTION),
    ],
    ids=["window-off-by-one", "sinks-unshifted"],
)
def test_the_property_catches_a_broken_rule(broken: KindRules[Any], kind: KVCacheSpecKind) -> None:
    def wrong(case: tuple[KVCacheSpec, list[bool], int]) -> bool:
        try:
            check_rule(broken.prefix_hit, *case)
        except AssertionError:
            return True
        return False

    case = find(kind_cases([kind]), wrong, settings=settings(max_examples=2000))
    with pytest.raises(AssertionError):
        check_rule(broken.prefix_hit, *case)
    check_rule(rules_for(case[0]).prefix_hit, *case)  # the kind's own rule passes it


LOCAL = [K.SLIDING_WINDOW, K.CHUNKED_LOCAL_ATTENTION, K.SLIDING_WINDOW_MLA]


@settings(max_examples=400, deadline=None)
@given(case=kind_cases(LOCAL))
def test_the_counted_form_agrees_with_the_definition(
    case: tuple[KVCacheSpec, list[bool], int],
) -> None:
    """Arrays with more than WALK_MISSES misses are counted, not walked: with the
    threshold below zero every array is, and still gives the definition's hit."""
    spec, cached, length = case
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_prefix, "WALK_MISSES", -1)
        check_rule(rules_for(spec).prefix_hit, spec, cached, length)


def _count_past_the_first_block(
    needs: Any, missed: np.ndarray[Any, Any], k_min: int, k_top: int
) -> int | None:
    """A broken count: the first block a window sees is not checked."""
    before = np.concatenate(([0], np.cumsum(missed)))
    ends = np.arange(k_min, k_top + 1)
    first = np.minimum(needs.lows(ends) + 1, ends)
    served = np.flatnonzero(before[ends] == before[first])
    return int(ends[served[-1]]) if served.size else None


def test_the_property_catches_a_broken_count() -> None:
    def wrong(case: tuple[KVCacheSpec, list[bool], int]) -> bool:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_prefix, "WALK_MISSES", -1)
            patch.setattr(_prefix, "_count_misses", _count_past_the_first_block)
            try:
                check_rule(rules_for(case[0]).prefix_hit, *case)
            except AssertionError:
                return True
        return False

    case = find(kind_cases([K.SLIDING_WINDOW]), wrong, settings=settings(max_examples=2000))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_prefix, "WALK_MISSES", -1)
        check_rule(rules_for(case[0]).prefix_hit, *case)  # the real count passes it


# ---------------------------------------------------------------------------- combined


GROUP_KINDS = [*PAGED, K.MAMBA]


@st.composite
def models(draw: st.DrawFn) -> tuple[list[KVCacheSpec], list[list[bool]], int]:
    """2-4 groups (block sizes sharing factors, so their edges meet), each with its cached
    mask, and a prompt length."""
    n = draw(st.integers(1, 4))
    specs: list[KVCacheSpec] = []
    masks: list[list[bool]] = []
    num_tokens = draw(st.integers(0, 40))
    for _ in range(n):
        kind = draw(st.sampled_from(GROUP_KINDS))
        bs = draw(st.sampled_from([1, 2, 4, 8]))
        param = draw(st.sampled_from([1, 2, 3, 4, 5, 7, 8, 9]))
        spec = make_spec(kind, bs, param)
        size = num_tokens + 1 if kind is K.MAMBA else (num_tokens + ref_shift(spec)) // bs
        dense = draw(st.sampled_from([0.6, 0.85, 0.97, 1.0]))
        mask = [draw(st.floats(0, 1)) < dense for _ in range(size)]
        if kind is K.MAMBA:
            every = draw(st.sampled_from([2, 4, 8]))
            mask = [m and i % every == 0 for i, m in enumerate(mask)]
        specs.append(spec)
        masks.append(mask)
    return specs, masks, num_tokens


def ref_combined(specs: Sequence[KVCacheSpec], masks: Sequence[Sequence[bool]], num_tokens: int) -> int:
    """The longest length every group serves, by trying every length."""
    top = max(num_tokens - 1, 0)
    return max(
        n for n in range(top + 1) if all(ref_serves(s, m, n) for s, m in zip(specs, masks, strict=True))
    )


def ref_minimum(specs: Sequence[KVCacheSpec]) -> int | None:
    """The shortest length >= 1 on every attention group's block edge, by trying."""
    if any(s.kind in NEVER for s in specs):
        return None
    for n in range(1, 4000):
        if all(
            s.kind is K.MAMBA or (n + ref_shift(s)) % s.block_size == 0 for s in specs
        ):
            return n
    return None


@settings(max_examples=400, deadline=None)
@given(model=models())
def test_the_combined_hit_is_the_longest_length_every_group_serves(
    model: tuple[list[KVCacheSpec], list[list[bool]], int],
) -> None:
    specs, masks, num_tokens = model
    groups = [GroupLookup(s, np.array(m, dtype=np.bool_)) for s, m in zip(specs, masks, strict=True)]
    hit = find_prefix_hit(groups, num_tokens)
    expected = ref_combined(specs, masks, num_tokens)
    minimum = ref_minimum(specs)
    assert hit.length == expected
    assert hit.minimum == minimum == prefix_granularity(specs).minimum
    top = max(num_tokens - 1, 0)
    assert hit.candidate == top
    assert [g.length for g in hit.groups] == [
        ref_hit(s, m, top) for s, m in zip(specs, masks, strict=True)
    ]
    if hit.length < top:
        assert hit.reason is not None
    elif top:
        assert hit.reason is None
    if minimum is None:  # groups whose blocks never end together
        assert isinstance(hit.reason, NeverHits)
        assert hit.limiting is None
    elif top < minimum:
        assert isinstance(hit.reason, BelowMinimum) or num_tokens == 0
        assert hit.limiting is None
    elif hit.length < top:
        assert hit.limiting is not None
        assert hit.length <= hit.groups[hit.limiting].length
    # The lookup form gives the same answer.
    lookups = [
        GroupLookup(s, lambda i, m=m: i < len(m) and m[i]) for s, m in zip(specs, masks, strict=True)
    ]
    assert find_prefix_hit(lookups, num_tokens).length == expected


def _one_pass(groups: Sequence[GroupLookup], num_tokens: int) -> int:
    """A broken combination: each group lowers the candidate once, in order (the "full
    attention, then one other" scheme), with no second round."""
    length = max(num_tokens - 1, 0)
    for g in groups:
        length = rules_for(g.spec).prefix_hit(g.spec, g.cached, length)[0]
    return length


def test_the_property_catches_a_single_pass_combination() -> None:
    def wrong(model: tuple[list[KVCacheSpec], list[list[bool]], int]) -> bool:
        specs, masks, num_tokens = model
        groups = [GroupLookup(s, np.array(m, dtype=np.bool_)) for s, m in zip(specs, masks, strict=True)]
        return _one_pass(groups, num_tokens) != ref_combined(specs, masks, num_tokens)

    specs, masks, num_tokens = find(models(), wrong, settings=settings(max_examples=5000))
    groups = [GroupLookup(s, np.array(m, dtype=np.bool_)) for s, m in zip(specs, masks, strict=True)]
    assert find_prefix_hit(groups, num_tokens).length == ref_combined(specs, masks, num_tokens)


def test_a_fixed_point_that_takes_several_rounds() -> None:
    # Full attention in blocks of 8, a window of 3 in blocks of 2 whose block 5
    # (tokens 10, 11) is missing, a state group with checkpoints every 4 tokens.
    full = make_spec(K.FULL_ATTENTION, 8)
    window = make_spec(K.SLIDING_WINDOW, 2, 3)
    state = make_spec(K.MAMBA, 4)
    groups = [
        GroupLookup(full, np.ones(4, dtype=np.bool_), label="full"),
        GroupLookup(window, np.array([i != 5 for i in range(16)]), label="window"),
        GroupLookup(state, lambda n: n % 4 == 0 and n != 24, label="state"),
    ]
    hit = find_prefix_hit(groups, 30)
    # full alone: 24; window alone: 28 (needs blocks 12, 13); state alone: 28.
    assert [g.length for g in hit.groups] == [24, 28, 28]
    # 24 has no checkpoint -> 20; 20 is not a full block of 8 -> 16; 16 needs blocks 7
    # of the window (fine) and a checkpoint at 16 (fine).
    assert hit.length == 16
    assert hit.rounds >= 2
    assert hit.limiting == 0
    assert hit.reason == NotFullBlock(20, 16, 2, 8)
    assert hit.explain() == (
        "prefix hit 16 of 30 prompt tokens: limited by full: tokens 16..19 do not fill "
        "block 2 (8 tokens): only full blocks are cached"
    )


# ---------------------------------------------------------------------------- explanations


def test_granularity_of_hybrid_and_sink_models() -> None:
    full16, window32 = make_spec(K.FULL_ATTENTION, 16), make_spec(K.SLIDING_WINDOW, 32, 100)
    state = make_spec(K.MAMBA, 16)
    g = prefix_granularity([full16, window32, state])
    assert g.minimum == 32
    assert str(g) == "minimum cacheable prefix 32 tokens (blocks of 16; blocks of 32)"
    assert prefix_granularity([full16, state], checkpoint_interval=48).minimum == 48
    # Sinks of 4 in blocks of 16 end at 12, 28, ...; full attention in blocks of 16 at
    # 16, 32, ...: they never meet.
    never = prefix_granularity([full16, make_spec(K.SINK_FULL_ATTENTION, 16, 4)])
    assert never.minimum is None
    assert str(never) == (
        "no prefix is cacheable: this model never hits the prefix cache: its groups' blocks "
        "never end together (blocks of 16; blocks of 16, shifted by 4)"
    )
    cross = prefix_granularity([full16, make_spec(K.CROSS_ATTENTION, 16)])
    assert cross.minimum is None
    assert isinstance(cross.never, NeverHits)
    assert cross.never.who == "cross_attention"
    with pytest.raises(InvalidArgumentError, match="checkpoint_interval must be a positive int"):
        prefix_granularity([state], checkpoint_interval=0)


def test_a_short_prompt_is_below_the_minimum() -> None:
    big = make_spec(K.FULL_ATTENTION, 528)
    hit = find_prefix_hit([GroupLookup(big, np.ones(4, dtype=np.bool_))], 300)
    assert (hit.length, hit.limiting, hit.minimum) == (0, None, 528)
    assert hit.reason == BelowMinimum(299, 528)
    assert str(hit) == (
        "prefix hit 0 of 300 prompt tokens: 299 cacheable tokens (a prompt's last token is "
        "always recomputed) are below this model's minimum cacheable prefix of 528 tokens"
    )
    # the group alone says why too
    assert hit.groups[0].reason == NotFullBlock(299, 0, 0, 528)


def test_a_model_that_never_hits_names_the_group() -> None:
    decoder, cross = make_spec(K.FULL_ATTENTION, 4), make_spec(K.CROSS_ATTENTION, 4)
    hit = find_prefix_hit(
        [GroupLookup(decoder, np.ones(8, dtype=np.bool_)), GroupLookup(cross, np.ones(8, dtype=np.bool_))],
        20,
    )
    assert (hit.length, hit.limiting, hit.minimum) == (0, 1, None)
    assert str(hit).startswith(
        "prefix hit 0 of 20 prompt tokens: limited by group 1 (cross_attention): "
        "cross_attention never hits the prefix cache"
    )


def test_a_full_hit_and_the_last_token() -> None:
    spec = make_spec(K.FULL_ATTENTION, 4)
    hit = find_prefix_hit([GroupLookup(spec, np.ones(8, dtype=np.bool_))], 17)
    assert (hit.length, hit.reason, hit.limiting) == (16, None, None)
    assert str(hit) == "prefix hit 16 of 17 prompt tokens (all but the last, which is always computed)"
    assert find_prefix_hit([GroupLookup(spec, np.ones(8, dtype=np.bool_))], 17, max_length=9).length == 8


def test_miss_causes_tell_evicted_never_computed_and_salt_apart() -> None:
    spec = make_spec(K.FULL_ATTENTION, 4)
    names = [b"n0", b"n1", b"n2", b"n3"]
    cached = np.array([True, False, True, True])

    def lookup(**kw: Any) -> str:
        group = GroupLookup(spec, cached, label="attn", miss_cause=miss_causes(names, **kw))
        return str(find_prefix_hit([group], 17))

    assert lookup().endswith(
        "limited by attn: block 1 (tokens 4..7) was never computed: no earlier request had "
        "this prefix"
    )
    assert lookup(evicted={b"n1"}).endswith(
        "block 1 (tokens 4..7) was evicted: a larger cache keeps blocks longer"
    )
    cached[0] = False
    assert lookup(salt_free_first=b"s0", cached_salt_free_firsts={b"s0"}).endswith(
        "block 0 (tokens 0..3) is cached under a different cache salt: requests share "
        "blocks only with the same cache_salt"
    )
    assert lookup(salt_free_first=b"s0", cached_salt_free_firsts={b"other"}).endswith(
        "block 0 (tokens 0..3) was never computed: no earlier request had this prefix"
    )
    assert str(BlockNotCached(0, 0, 0)) == "block 0 (sink slots) is not cached"


def test_bad_arguments_of_a_lookup() -> None:
    spec = make_spec(K.FULL_ATTENTION, 4)
    with pytest.raises(InvalidArgumentError, match="num_tokens must be an int >= 0, got -3"):
        find_prefix_hit([GroupLookup(spec, np.ones(1, dtype=np.bool_))], -3)
    with pytest.raises(TypeError, match=r"groups\[0\] must be a GroupLookup, got tuple"):
        find_prefix_hit([(spec, np.ones(1, dtype=np.bool_))], 3)


def test_counters() -> None:
    counters = PrefixCacheCounters()
    spec = make_spec(K.FULL_ATTENTION, 4)
    counters.record(find_prefix_hit([GroupLookup(spec, np.ones(8, dtype=np.bool_))], 17))
    counters.record(find_prefix_hit([GroupLookup(spec, np.zeros(8, dtype=np.bool_))], 10))
    counters.record_evictions(3)
    stats = counters.stats()
    assert stats == PrefixCacheStats(queries=2, query_tokens=27, hits=1, hit_tokens=16, evictions=3)
    assert stats.hit_rate == 0.5
    assert stats.token_hit_rate == pytest.approx(16 / 27)
    assert str(stats) == (
        "prefix cache: 1/2 lookups hit (50.0%), 16/27 tokens served (59.3%), 3 evictions, "
        "0 cached blocks (0 free)"
    )
    with pytest.raises(InvalidArgumentError, match="hit_tokens <= num_tokens"):
        counters.record_query(3, 4)
    with pytest.raises(InvalidArgumentError, match="count must be >= 0"):
        counters.record_evictions(-1)
    counters.reset()
    assert counters.stats() == PrefixCacheStats()
    assert PrefixCacheStats().hit_rate == 0.0


@settings(max_examples=300, deadline=None)
@given(
    bs=st.sampled_from([1, 2, 4]),
    sink_len=st.integers(1, 9),
    local=st.one_of(st.tuples(st.just("window"), st.integers(1, 12)), st.tuples(st.just("chunk"), st.integers(1, 12))),
    cached=st.lists(st.booleans(), max_size=16),
    length=st.integers(0, 70),
)
def test_a_window_or_chunk_with_sinks_serves_the_same_from_an_array_and_a_lookup(
    bs: int, sink_len: int, local: tuple[str, int], cached: list[bool], length: int
) -> None:
    """No built-in kind has sinks and a window or chunk, but the rule takes them: the
    array's walk over its sorted misses, the lookup's walk and the definition agree
    (every sink block before the visible run, and the run, cached)."""
    from attnkit.kinds._prefix import paged_hit

    kind, extent = local
    window = extent if kind == "window" else None
    chunk = extent if kind == "chunk" else None
    layout = TokenLayout(bs, sink_len)

    def visible(k: int) -> set[int]:
        p = k * bs  # the next query's position
        lo = max(0, p - extent + 1) if window is not None else p // extent * extent
        first = lo // bs
        return set(range(min(-(-sink_len // bs), first))) | set(range(first, k))

    def serves(n: int) -> bool:
        if n == 0:
            return True
        if (n + sink_len) % bs:
            return False
        k = (n + sink_len) // bs
        return all(b < len(cached) and cached[b] for b in visible(k))

    expected = max(n for n in range(length + 1) if serves(n))
    array = np.array(cached, dtype=np.bool_)
    for form in (array, lambda b: b < len(cached) and cached[b]):
        served, _ = paged_hit(layout, form, length, window=window, chunk=chunk, sink_len=sink_len)
        assert served == expected, (bs, sink_len, local, cached, length, form is array)
