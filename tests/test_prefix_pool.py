"""The prefix cache inside the block manager: ref-counted kernel blocks that keep their
names once free, eviction, hits that start a new request, and a state machine that
drives arrivals with shared prefixes, chunked prefill, decodes, finishes, evictions,
resets and discarded steps against a brute-force model of the cache."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from attnkit import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    InvalidArgumentError,
    KVCacheSpec,
    MambaSpec,
    OutOfBlocksError,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    StalePrefixError,
)
from attnkit.config import PrefixCachingConfig
from attnkit.kinds import rules_for
from attnkit.kv_cache import (
    NULL_BLOCK,
    CachedPool,
    CachedSlab,
    KVCacheGroup,
    KVCacheManager,
    PrefixMatch,
    _cached,
    _prefix,
    group_layers,
)
from attnkit.prefix_cache import TokenLayout, block_names, get_hasher, prefix_root

ON = PrefixCachingConfig(enabled=True)
HASHER = get_hasher("sha256")


def full(block_size: int = 4, heads: int = 1) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=8, dtype=torch.float32
    )


def window(w: int, block_size: int = 4) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=w
    )


def chunk(c: int, block_size: int = 4) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float32,
        attention_chunk_size=c,
    )


def sinks(sink_len: int, block_size: int = 4) -> SinkFullAttentionSpec:
    return SinkFullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32, sink_len=sink_len
    )


MAMBA = MambaSpec(block_size=1, shapes=((4, 3),), dtypes=(torch.float32,))


def manager(
    specs: dict[str, KVCacheSpec], num_blocks: int, per_page: Sequence[int] | None = None
) -> KVCacheManager:
    groups = group_layers(specs)
    if per_page is not None:
        groups = [
            dataclasses.replace(g, blocks_per_page=k) for g, k in zip(groups, per_page, strict=True)
        ]
    return KVCacheManager(groups, num_blocks, prefix_caching=ON)


def cached(mgr: KVCacheManager, gid: int) -> CachedSlab:
    slab = mgr.cached_slabs[gid]
    assert slab is not None
    return slab


def prefix(mgr: KVCacheManager) -> _prefix.PrefixCache:
    assert mgr.prefix is not None
    return mgr.prefix


def run(mgr: KVCacheManager, rid: str, n: int, match: PrefixMatch | None = None) -> None:
    mgr.allocate_step([(rid, n, 0)], prefixes=[match])


# ---------------------------------------------------------------------------- examples


def test_caching_off_keeps_the_plain_pool_and_refuses_a_match() -> None:
    groups = group_layers({"a": full()})
    off = KVCacheManager(groups, 8)
    assert off.prefix is None
    assert off.cached_slabs == (None,)
    assert type(off.pool).__name__ == "BlockPool"
    on = manager({"a": full()}, 8)
    match = prefix(on).match([1, 2, 3, 4, 5])
    with pytest.raises(InvalidArgumentError, match="prefix caching is off"):
        off.allocate_step([("a", 5, 0)], prefixes=[match])


def test_a_second_request_hits_the_first_ones_full_prompt_blocks() -> None:
    mgr = manager({"a": full()}, 16)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks of 4
    first = prefix(mgr).match(prompt)
    assert first.num_tokens == 0
    run(mgr, "r1", 13, first)
    again = prefix(mgr).match(prompt)  # commits r1's step first
    # 12 tokens are cached; the last prompt token is always computed, so 12 of 13 hit.
    assert (again.num_tokens, again.num_prompt_tokens) == (12, 13)
    run(mgr, "r2", 1, again)
    t1, t2 = mgr.block_table(0, "r1"), mgr.block_table(0, "r2")
    assert t2[:3] == t1[:3]
    assert t2[3] != t1[3]
    slab = cached(mgr, 0)
    assert [int(slab.refs[b]) for b in t1] == [2, 2, 2, 1]
    assert slab.shared == 3
    assert mgr.num_tokens("r2") == 13


def test_a_prompt_that_fills_its_blocks_still_computes_its_last_token() -> None:
    mgr = manager({"a": full()}, 16)
    prompt = list(range(8))
    run(mgr, "r1", 8, prefix(mgr).match(prompt))
    again = prefix(mgr).match(prompt)
    assert again.num_tokens == 4  # not 8: block 1 holds the last token, which runs again
    assert "always computed" in again.explain() or again.reason is not None


def test_free_named_blocks_stay_cached_and_are_evicted_lru_tail_first() -> None:
    mgr = manager({"a": full()}, 9)  # 8 usable pages
    p = prefix(mgr)
    run(mgr, "old", 9, p.match(list(range(100, 109))))  # blocks: 3 (2 full)
    run(mgr, "new", 9, p.match(list(range(200, 209))))
    old, new = mgr.block_table(0, "old"), mgr.block_table(0, "new")
    mgr.free_request("old")  # its partial block 2 goes back; 0 and 1 stay cached
    mgr.free_request("new")
    pool = mgr.pool
    assert isinstance(pool, CachedPool)
    assert pool.num_free_blocks == 8 - 4
    assert len(pool.idle) == 4
    # Least recently freed first, and within a request its chain's tail first.
    assert list(pool.idle) == [old[1], old[0], new[1], new[0]]
    run(mgr, "big", 24)  # 6 blocks: the 4 free pages, then the 2 oldest cached ones
    taken = set(mgr.block_table(0, "big"))
    assert {old[0], old[1]} <= taken
    assert not {new[0], new[1]} & taken
    assert p.stats().evictions == 2
    hit = p.match(list(range(200, 209)))
    assert hit.num_tokens == 8
    missed = p.match(list(range(100, 109)))
    assert missed.num_tokens == 0
    assert "was evicted" in missed.explain()


def window_releases_scenario() -> None:
    """Two requests decode past a window of 4 in lockstep; each release of a named block
    (the prompt's) makes it idle, least recently released first, whenever the pool is
    next read; the unnamed ones (decoded tokens) go back free."""
    mgr = manager({"w": window(4)}, 40)
    p = prefix(mgr)
    prompts = {"a": list(range(100, 113)), "b": list(range(200, 213))}  # 3 full blocks
    mgr.allocate_step(
        [(r, 13, 0) for r in prompts], prefixes=[p.match(t) for t in prompts.values()]
    )
    tables = {r: mgr.block_table(0, r) for r in prompts}
    order: list[int] = []
    for _ in range(13):  # (the prompts' blocks get their names at the first)
        before = {r: mgr.block_table(0, r) for r in prompts}
        mgr.allocate_step([(r, 1, 0) for r in prompts])
        for r in prompts:  # released this step: a then b, each row's in column order
            after = mgr.block_table(0, r)
            order += [b for b, c in zip(before[r], after, strict=False) if b and not c]
    pool = mgr.pool
    assert isinstance(pool, CachedPool)
    named = [b for r in prompts for b in tables[r][:3]]
    assert set(pool.idle) == set(named)
    assert list(pool.idle) == [b for b in order if b in named]
    assert pool.num_free_blocks == 39 - len(named) - sum(
        1 for r in prompts for b in mgr.block_table(0, r) if b
    )
    for tokens in prompts.values():
        assert p.match([*tokens, 0]).num_tokens == 12


def test_window_releases_are_cached_in_the_order_released() -> None:
    window_releases_scenario()


@pytest.mark.parametrize(
    "broken", ["released pages idle newest first", "released named pages freed"]
)
def test_a_broken_sort_of_released_pages_is_caught(
    broken: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, name, replacement = BROKEN_SORT[broken]
    monkeypatch.setattr(owner, name, replacement)
    with pytest.raises(AssertionError):
        window_releases_scenario()


def test_a_hit_on_a_free_cached_block_counts_against_the_budget() -> None:
    """The hit's blocks leave the evictable pages: a step that needs them as well as
    new pages fails, and changes nothing."""
    hit_budget_scenario()


def test_a_check_that_forgets_the_hits_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: the step check counts the hit's free cached blocks as
    evictable too. The scenario above must fail under it."""
    monkeypatch.setattr(_cached.CachedSlab, "preview", _check_ignores_hits)
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        hit_budget_scenario()


def hit_budget_scenario() -> None:
    mgr = manager({"a": full()}, 5)  # 4 usable pages
    p = prefix(mgr)
    prompt = list(range(50, 59))
    run(mgr, "r1", 9, p.match(prompt))  # 3 pages, 2 named
    mgr.free_request("r1")
    assert mgr.pool.num_free_blocks == 2
    assert isinstance(mgr.pool, CachedPool)
    match = p.match([*prompt[:8], 1, 2, 3, 4, 5, 6, 7, 8, 9])  # hits 8, needs 3 more
    assert match.num_tokens == 8
    before = (list(mgr.pool._free), dict(mgr.pool.idle), cached(mgr, 0).refs.tobytes())
    with pytest.raises(OutOfBlocksError, match="hold only cached blocks"):
        run(mgr, "r2", 9, match)  # 2 free pages; the 2 cached ones are the hit's own
    assert (list(mgr.pool._free), dict(mgr.pool.idle), cached(mgr, 0).refs.tobytes()) == before
    assert "r2" not in mgr
    run(mgr, "r2", 8, match)  # 2 new pages fit
    assert cached(mgr, 0).refs[mgr.block_table(0, "r2")].tolist() == [1, 1, 1, 1]


def test_an_evicted_hit_is_refused_and_changes_nothing() -> None:
    mgr = manager({"a": full()}, 4)  # 3 usable pages
    p = prefix(mgr)
    prompt = list(range(30, 39))
    run(mgr, "r1", 9, p.match(prompt))
    mgr.free_request("r1")
    match = p.match(prompt)
    assert match.num_tokens == 8
    run(mgr, "other", 12)  # takes every page: the two cached ones are evicted
    snapshot = (list(mgr.pool._free), mgr.block_table(0, "other"), len(mgr))
    with pytest.raises(StalePrefixError, match=r"block 0 \(tokens 0..3\).*was evicted"):
        run(mgr, "r2", 1, match)
    assert (list(mgr.pool._free), mgr.block_table(0, "other"), len(mgr)) == snapshot


def deferred_duplicate_refusal_scenario() -> None:
    """Two requests compute the same prompt in one step over a window group, whose
    names are deferred: the second's blocks are duplicates, idle once released until
    the names are settled, when they go back free. A step refused while that is still
    pending changes neither the free list nor the idle pages."""
    mgr = manager({"w": window(4)}, 24)
    p = prefix(mgr)
    late = p.match(list(range(500, 600)))  # (matched now: a lookup settles the names)
    prompt = list(range(100, 113))  # 3 full blocks
    mgr.allocate_step([(r, 13, 0) for r in "ab"], prefixes=[p.match(prompt)] * 2)
    for _ in range(8):  # the window moves past the prompt: its blocks are released
        mgr.allocate_step([(r, 1, 0) for r in "ab"])
    pool = mgr.pool
    assert isinstance(pool, CachedPool)
    assert p.needs_flush, "the scenario needs names still deferred"
    pool.sort_given_back()  # (the released pages sorted, as any read of the pool does)
    before = (list(pool._free), list(pool.idle), cached(mgr, 0).refs.tobytes())
    with pytest.raises(OutOfBlocksError, match="nothing was allocated or freed"):
        mgr.allocate_step([("c", 100, 0)], prefixes=[late])
    assert (list(pool._free), list(pool.idle), cached(mgr, 0).refs.tobytes()) == before
    assert "c" not in mgr
    p.flush()  # settled: b's duplicates are free, a's blocks stay cached
    assert p.match([*prompt, 0]).num_tokens == 12


def test_a_refused_step_leaves_deferred_duplicates_where_they_are() -> None:
    deferred_duplicate_refusal_scenario()


def test_a_step_that_settles_names_before_its_check_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broken variant: the names are settled before the step is checked (a refused
    step then moves the duplicates' pages from idle to free)."""
    check = KVCacheManager._check_cached

    def settle_first(self: KVCacheManager, *args: Any, **kwargs: Any) -> None:
        assert self.prefix is not None
        self.prefix.flush()
        check(self, *args, **kwargs)

    monkeypatch.setattr(KVCacheManager, "_check_cached", settle_first)
    with pytest.raises(AssertionError):
        deferred_duplicate_refusal_scenario()


def test_a_match_of_another_cache_is_refused() -> None:
    one, two = manager({"a": full()}, 8), manager({"a": full()}, 8)
    with pytest.raises(StalePrefixError, match="another runtime"):
        run(two, "r", 3, prefix(one).match([1, 2, 3]))


def test_parallel_sampling_shares_the_prompt_blocks() -> None:
    mgr = manager({"a": full()}, 16)
    p = prefix(mgr)
    prompt = list(range(17))
    run(mgr, "base", 17, p.match(prompt))
    match = p.match(prompt)
    mgr.allocate_step([(f"s{i}", 1, 0) for i in range(3)], prefixes=[match] * 3)
    tables = [mgr.block_table(0, f"s{i}") for i in range(3)]
    assert all(t[:4] == mgr.block_table(0, "base")[:4] for t in tables)
    assert cached(mgr, 0).refs[tables[0][:4]].tolist() == [4] * 4
    for i in range(3):
        mgr.free_request(f"s{i}")
    assert cached(mgr, 0).refs[tables[0][:4]].tolist() == [1] * 4
    assert cached(mgr, 0).shared == 0


def step_finishing(mgr: KVCacheManager, rid: str, n: int, finished: str) -> None:
    """A step of ``n`` tokens for ``rid`` that finishes ``finished`` (the runtime's call)."""
    rows = mgr.lookup_rows([rid])
    lens = mgr.step_lens(rows, np.array([n]), np.zeros(1, dtype=np.int64), None)
    mgr.allocate_rows([rid], rows, lens, finished=[finished])


def shared_finish_scenario() -> None:
    """Two samples share a prompt's two full blocks with the request that computed it
    (no new request in the later steps, so they take the plain step path). A step that
    finishes one sample frees only its own page, never the shared ones: growing the
    other sample by two pages does not fit and changes nothing; by one page it fits."""
    mgr = manager({"a": full()}, 6)  # 5 usable pages
    p = prefix(mgr)
    prompt = list(range(9))  # 2 full blocks and 1 token
    run(mgr, "base", 9, p.match(prompt))  # 3 pages
    match = p.match(prompt)
    assert match.num_tokens == 8
    mgr.allocate_step([("s0", 1, 0), ("s1", 1, 0)], prefixes=[match, match])  # 1 page each
    assert mgr.pool.num_free_blocks == 0
    shared = mgr.block_table(0, "base")[:2]
    assert cached(mgr, 0).refs[shared].tolist() == [3, 3]
    before = (list(mgr.pool._free), mgr.block_table(0, "s0"), mgr.block_table(0, "s1"))
    with pytest.raises(OutOfBlocksError, match="nothing was allocated or freed"):
        step_finishing(mgr, "s1", 8, "s0")  # 2 new pages; s0 gives back 1
    assert (list(mgr.pool._free), mgr.block_table(0, "s0"), mgr.block_table(0, "s1")) == before
    step_finishing(mgr, "s1", 4, "s0")  # 1 new page: s0's own
    assert "s0" not in mgr
    assert mgr.block_table(0, "s1")[:2] == shared
    assert len(mgr.block_table(0, "s1")) == 4
    assert cached(mgr, 0).refs[shared].tolist() == [2, 2]
    assert mgr.pool.num_free_blocks == 0


def test_a_finished_sharer_frees_only_its_own_pages() -> None:
    shared_finish_scenario()


def test_a_step_check_that_counts_shared_blocks_as_freed_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broken variant: the plain step check runs as if no block were shared, so a
    finished sample's shared blocks count as pages it frees."""
    allocate = KVCacheManager.allocate_rows

    def unshared(self: KVCacheManager, *args: Any, **kwargs: Any) -> Any:
        pool = self.pool
        assert isinstance(pool, CachedPool)
        held, pool.shared = pool.shared, 0
        try:
            return allocate(self, *args, **kwargs)
        finally:
            pool.shared += held

    monkeypatch.setattr(KVCacheManager, "allocate_rows", unshared)
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        shared_finish_scenario()


def test_salts_never_share_blocks() -> None:
    mgr = manager({"a": full()}, 16)
    p = prefix(mgr)
    prompt = list(range(13))
    run(mgr, "a", 13, p.match(prompt, cache_salt="tenant-a"))
    assert p.match(prompt, cache_salt="tenant-a").num_tokens == 12
    other = p.match(prompt, cache_salt="tenant-b")
    assert other.num_tokens == 0
    assert "different cache salt" in other.explain()
    assert p.match(prompt).num_tokens == 0  # no salt is a salt of its own


def test_generated_blocks_are_named_at_free_with_the_tokens() -> None:
    mgr = manager({"a": full()}, 16)
    p = prefix(mgr)
    prompt = list(range(6))
    run(mgr, "a", 6, p.match(prompt))
    for _ in range(5):
        run(mgr, "a", 1)  # decodes: 11 tokens computed, nothing hashed
    tokens = [*prompt, 40, 41, 42, 43, 44, 45]  # the last was sampled, never computed
    assert len(cached(mgr, 0).name_of) == 1
    with pytest.raises(
        InvalidArgumentError, match=r"token_ids\['a'\] must be the request's tokens"
    ):
        mgr.free_request("a", [9, *tokens[1:]])
    assert "a" in mgr
    mgr.free_request("a", tokens)
    assert len(cached(mgr, 0).name_of) == 2  # blocks 0 and 1 (tokens 0..7)
    assert p.match([*tokens, 7]).num_tokens == 8


def test_discard_names_nothing_of_the_step_and_never_names_its_requests() -> None:
    mgr = manager({"a": full()}, 16)
    p = prefix(mgr)
    prompt = list(range(20))
    run(mgr, "a", 8, p.match(prompt))
    p.discard()  # the model call failed
    run(mgr, "a", 12)
    p.commit()
    assert cached(mgr, 0).name_of == {}
    mgr.free_request("a", prompt)
    assert p.match(prompt).num_tokens == 0


def test_reset_drops_every_name_and_keeps_blocks_in_use() -> None:
    mgr = manager({"a": full()}, 16)
    p = prefix(mgr)
    prompt = list(range(9))
    run(mgr, "a", 9, p.match(prompt))
    run(mgr, "b", 9, p.match(list(range(50, 59))))
    mgr.free_request("b")
    held = mgr.block_table(0, "a")
    assert p.reset() == 4
    assert cached(mgr, 0).name_of == {}
    assert mgr.pool.num_free_blocks == 15 - 3
    assert cached(mgr, 0).refs[held].tolist() == [1, 1, 1]
    assert p.match(prompt).num_tokens == 0
    run(mgr, "a", 4)
    p.commit()
    assert cached(mgr, 0).name_of == {}  # a request live at the reset is never named


def test_a_sliding_window_hit_needs_only_the_last_window() -> None:
    mgr = manager({"f": full(), "w": window(5)}, 32)
    p = prefix(mgr)
    prompt = list(range(25))
    run(mgr, "a", 25, p.match(prompt))
    match = p.match(prompt)
    assert match.num_tokens == 24
    run(mgr, "b", 1, match)
    # The window's query at 24 sees keys 20..24: of the cached blocks only block 5
    # (20..23); blocks 0..4 stay null, block 6 is new. Full attention reads all six.
    win = mgr.block_table(1, "b")
    assert win[:6] == [NULL_BLOCK] * 5 + [mgr.block_table(1, "a")[5]]
    assert win[6] not in mgr.block_table(1, "a")
    assert mgr.block_table(0, "b")[:6] == mgr.block_table(0, "a")[:6]


def deferred_twins_scenario() -> None:
    """Two requests compute the same prompt in the same steps; their window group's
    names are deferred at each commit and the window frees blocks before they are made.
    Once made (a report reads the maps), the first request's blocks hold the names and
    are cached when free; the second's, duplicates, are unnamed and back in the pool."""
    mgr = manager({"w": window(5)}, 32)
    p = prefix(mgr)
    prompt = list(range(40, 56))  # 16 tokens: 4 full blocks of 4
    ma, mb = p.match(prompt), p.match(prompt)
    assert ma.num_tokens == mb.num_tokens == 0
    mgr.allocate_step([("a", 8, 0), ("b", 8, 0)], prefixes=[ma, mb])
    first = {rid: mgr.block_table(0, rid)[:4] for rid in ("a", "b")}
    mgr.allocate_step([("a", 8, 0), ("b", 8, 0)])
    first = {rid: first[rid] + mgr.block_table(0, rid)[2:4] for rid in first}
    for _ in range(6):  # decodes: nothing reads the maps, the window frees blocks 0..3
        mgr.allocate_step([("a", 1, 0), ("b", 1, 0)])
    slab = cached(mgr, 0)
    pool = mgr.pool
    assert isinstance(pool, CachedPool)
    a_blocks, b_blocks = first["a"][:4], first["b"][:4]
    assert mgr.block_table(0, "a")[:4] == [NULL_BLOCK] * 4  # all four released
    # Reading the free pages sorts what the window gave back (named: idle) before the
    # names are made: the settle must then send the duplicates' idle blocks back.
    assert pool.num_free_blocks < 31
    p.stats()  # reads the maps: the deferred names are made
    names = block_names(prompt, TokenLayout(4), HASHER, prefix_root(HASHER))
    assert slab.block_of == dict(zip(names, a_blocks, strict=True))
    assert set(np.flatnonzero(slab.named).tolist()) == set(a_blocks)
    assert set(pool.idle) == set(a_blocks)
    for block in b_blocks:
        assert not pool.is_allocated(block), f"duplicate block {block} not back in the pool"
    live = {b for rid in ("a", "b") for b in mgr.block_table(0, rid) if b != NULL_BLOCK}
    assert pool.num_free_blocks == 31 - len(live) - len(a_blocks)
    assert p.match(prompt).num_tokens == 12  # the window's last blocks before 12: cached


def test_deferred_window_names_are_made_as_if_at_once() -> None:
    deferred_twins_scenario()


def chunked_window_prompt_scenario() -> None:
    """A 64-token prompt in chunks of 8 over a window of 8 (blocks of 4), with full
    attention beside it. The window group's names wait until the coming step's
    release can reach them: then every waiting block is marked named at once. Written
    out: before step k + 1 the request holds ``c = 8 (k + 1)`` tokens and that step's
    release front is ``(c - 7) // 4``; the names of blocks ``0 .. c // 4 - 1`` are
    marked when the front is past the marked ones, i.e. before every second step.
    Every block the window releases is then cached, and the whole prompt hits."""
    mgr = manager({"f": full(), "w": window(8)}, 64)
    p = prefix(mgr)
    prompt = list(range(300, 364))
    mgr.allocate_step([("a", 8, 0)], prefixes=[p.match(prompt)])
    slab = cached(mgr, 1)
    marked = 0
    released: list[int] = []
    seen: dict[int, int] = {}  # logical block -> its kernel block, released ones too
    for k in range(1, 8):
        held = 8 * k
        if (held - 7) // 4 > marked:
            marked = held // 4
        before = mgr.block_table(1, "a")
        seen.update((i, b) for i, b in enumerate(before) if b != NULL_BLOCK)
        mgr.allocate_step([("a", 8, 0)])
        after = mgr.block_table(1, "a")
        released += [b for i, b in enumerate(before) if b != NULL_BLOCK and after[i] == NULL_BLOCK]
        # The commit at the start of that step marked exactly the blocks written out
        # (a released block keeps its mark: it is idle, not free).
        got = {i for i, b in seen.items() if slab.named[b]}
        assert got == set(range(marked)), f"step {k}: marked blocks {sorted(got)}"
    p.stats()  # reads the maps: every deferred name is made
    names = block_names(prompt, TokenLayout(4), HASHER, prefix_root(HASHER))
    assert {slab.block_of.get(n) for n in names[: len(released)]} == set(released)
    assert len(released) == 12  # the step at 56 sees from token 49 on: blocks 12 ..
    assert p.match(prompt).num_tokens == 60  # (the last token is always recomputed)


def test_a_window_groups_names_wait_until_a_step_can_release_them() -> None:
    chunked_window_prompt_scenario()


def _reach_too_late(self: Any, spec: Any, block: int) -> int:
    """A window said to release a block one step later than it does: the step that
    releases it finds it unmarked, and it is lost to the cache."""
    return int(_release_reach(self, spec, block)) + 8


def _reach_at_once(self: Any, spec: Any, block: int) -> int:
    """Marks at every commit: safe, but the eager rule this replaced (a mark per step);
    the scenario's written-out order of marks must see it."""
    return 0


_release_reach = type(rules_for(window(8))).release_reach


@pytest.mark.parametrize("broken", ["a reach one step late", "a reach at once"])
def test_a_broken_release_reach_is_caught(broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    reaches = {"a reach one step late": _reach_too_late, "a reach at once": _reach_at_once}
    monkeypatch.setattr(type(rules_for(window(8))), "release_reach", reaches[broken])
    with pytest.raises(AssertionError):
        chunked_window_prompt_scenario()


@pytest.mark.parametrize(
    "broken", ["a duplicate kept idle at the settle", "deferred names not marked"]
)
def test_a_broken_deferral_is_caught(broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    owner, name, replacement = BROKEN_DEFERRAL[broken]
    monkeypatch.setattr(owner, name, replacement)
    # KeyError: the settle finds a free block outside the idle pages it must be in.
    with pytest.raises((AssertionError, KeyError)):
        deferred_twins_scenario()


def test_pages_of_several_blocks_go_back_only_once_every_block_is_free_and_unnamed() -> None:
    mgr = manager({"a": full(), "b": full(heads=2)}, 6, per_page=[2, 1])
    p = prefix(mgr)
    run(mgr, "x", 7, p.match(list(range(7))))  # group 0: blocks 0, 1 in one page
    table = mgr.block_table(0, "x")
    page = table[0] // 2
    assert table[1] // 2 == page
    mgr.free_request("x")  # block 0 named (tokens 0..3), block 1 partial: the page idles
    pool = mgr.pool
    assert isinstance(pool, CachedPool)
    assert page in pool.idle
    assert pool.is_allocated(page)
    p.reset()
    assert page not in pool.idle
    assert not pool.is_allocated(page)


# ---------------------------------------------------------------------------- the model

Meaning = tuple[Any, ...]
"""What a block holds: ``(salt, tokens up to its end)``, or a marker for bytes no name
may describe (a discarded step, weights reset)."""


def layout_of(spec: KVCacheSpec) -> tuple[int, int] | None:
    """``(block size, shift)`` of a kind that caches, written out here."""
    if isinstance(spec, SinkFullAttentionSpec):
        return spec.block_size, spec.sink_len
    if isinstance(spec, FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec):
        return spec.block_size, 0
    return None


def block_end(layout: tuple[int, int], b: int) -> int:
    bs, shift = layout
    return max(0, (b + 1) * bs - shift)


def visible_blocks(spec: KVCacheSpec, L: int) -> set[int]:
    """The blocks the query at position ``L`` reads: every key position it sees."""
    layout = layout_of(spec)
    assert layout is not None
    bs, shift = layout
    if isinstance(spec, SlidingWindowSpec):
        first = max(0, L - spec.sliding_window + 1)
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        first = L // spec.attention_chunk_size * spec.attention_chunk_size
    else:
        first = 0
    blocks = {(pos + shift) // bs for pos in range(first, L)}
    blocks |= {slot // bs for slot in range(shift)}  # sink slots: always seen
    return blocks


def blocks_needed(spec: KVCacheSpec, tokens: int) -> int:
    if isinstance(spec, MambaSpec):
        return 1
    layout = layout_of(spec)
    assert layout is not None
    bs, shift = layout
    return -(-(tokens + shift) // bs)


def dead_blocks(spec: KVCacheSpec, computed: int) -> int:
    """Leading blocks no query at or after ``computed`` sees."""
    if isinstance(spec, SlidingWindowSpec):
        first_key = max(0, computed - spec.sliding_window + 1)
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        first_key = computed - computed % spec.attention_chunk_size
    else:
        return 0
    return first_key // spec.block_size


CONFIGS: dict[str, dict[str, KVCacheSpec]] = {
    "full+window+chunk": {"f": full(), "w": window(5), "c": chunk(8)},
    "two block sizes": {"f": full(), "g": full(8, heads=2)},
    "sinks": {"f": full(), "s": sinks(4), "w": window(9)},
    "sinks shifted": {"s": sinks(6)},
    "hybrid": {"f": full(), "m": MAMBA},
}


@dataclasses.dataclass
class MReq:
    tokens: list[int]  # prompt, then the tokens generated so far
    prompt_len: int
    salt: str | None
    computed: int
    tracked: bool
    tainted: bool
    tables: list[list[int]]


DOCS = [[int(t) for t in np.random.default_rng(seed).integers(0, 3, size=26)] for seed in (1, 2)]
"""Shared prompt prefixes (system prompts, documents)."""


class PrefixMachine(RuleBasedStateMachine):
    """Steps, finishes, lookups, discards and resets on a small pool, checked against a
    model: requests' tables and tokens, each block's content (``Meaning``), and names
    computed from the tokens (``block_names``, tested on its own). After every rule:
    every name in the cache names what its block holds, ref counts are the tables'
    holders, pages are free, pinned or idle as their blocks say, nothing leaks; each
    step fits exactly when the model's page count says so (a rejected one changes
    nothing) and frees and evicts no more than needed; each lookup's hit, for every
    group and every candidate length, is what the cached contents allow."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr = manager({"a": full()}, 4)
        self.groups: list[KVCacheGroup] = []
        self.reqs: dict[str, MReq] = {}
        self.content: dict[tuple[int, int], Meaning | None] = {}
        self.meanings: dict[tuple[int, bytes], Meaning] = {}
        self.pending: list[tuple[int, int, Meaning]] = []
        self.last_step: list[str] = []
        self.saved: list[tuple[PrefixMatch, list[int], str | None]] = []
        self.past: list[list[int]] = []
        self.next_id = 0
        self.marker = 0

    @initialize(
        name=st.sampled_from(sorted(CONFIGS)),
        num_blocks=st.sampled_from([14, 28, 48, 96]),
        data=st.data(),
    )
    def init(self, name: str, num_blocks: int, data: st.DataObject) -> None:
        groups = group_layers(CONFIGS[name])
        if data.draw(st.booleans()):
            groups = [
                dataclasses.replace(g, blocks_per_page=data.draw(st.sampled_from([1, 2, 3])))
                if not isinstance(g.spec, MambaSpec)
                else g
                for g in groups
            ]
        self.groups = groups
        self.mgr = KVCacheManager(groups, num_blocks, prefix_caching=ON)
        self.num_pages = num_blocks

    # ------------------------------------------------------------------ helpers

    @property
    def p(self) -> _prefix.PrefixCache:
        return prefix(self.mgr)

    def cached_groups(self) -> list[int]:
        return [g.group_id for g in self.groups if self.mgr.cached_slabs[g.group_id] is not None]

    def meaning(self, req: MReq, gid: int, b: int) -> Meaning:
        layout = layout_of(self.groups[gid].spec)
        assert layout is not None
        if req.tainted:
            self.marker += 1
            return ("garbage", self.marker)
        return (req.salt, tuple(req.tokens[: block_end(layout, b)]))

    def learn_names(self, tokens: list[int], salt: str | None) -> None:
        """The name of every full block of ``tokens`` in every cached group's layout."""
        root = prefix_root(HASHER, cache_salt=salt)
        for gid in self.cached_groups():
            layout = layout_of(self.groups[gid].spec)
            assert layout is not None
            names = block_names(tokens, TokenLayout(*layout), HASHER, root)
            for b, name in enumerate(names):
                self.meanings[(gid, name)] = (salt, tuple(tokens[: block_end(layout, b)]))

    def cached_meanings(self, gid: int) -> set[Meaning]:
        return {self.meanings[(gid, name)] for name in cached(self.mgr, gid).block_of}

    def commit(self, flush: bool = True) -> None:
        """The last step is done: its prompt blocks get their names (or keep a
        duplicate), checked once every named block is in its group's map (``flush``;
        else they stay lazily named, as between two steps)."""
        self.p.commit()
        if not flush:
            self.pending = []
            return
        self.p.flush()
        for gid, block, meaning in self.pending:
            slab = cached(self.mgr, gid)
            name = slab.name_of.get(block)
            if name is not None:
                assert self.meanings[(gid, name)] == meaning
            else:  # a duplicate: the name stays with the block that had it
                assert any(self.meanings.get((gid, n)) == meaning for n in slab.block_of), (
                    f"group {gid}: block {block} was not named, nor its content cached"
                )
        self.pending = []

    def prompt(self, data: st.DataObject) -> tuple[list[int], str | None]:
        base = data.draw(st.sampled_from([*DOCS, *self.past[-3:]]))
        keep = data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
        tail = data.draw(st.lists(st.integers(0, 2), max_size=5))
        tokens = base[:keep] + tail or [0]
        salt = data.draw(st.sampled_from([None, None, "s"]))
        return tokens, salt

    # ------------------------------------------------------------------ lookups

    def brute_hit(self, tokens: list[int], salt: str | None) -> tuple[int, list[list[int]]]:
        """The combined hit and, per group, the longest servable length at or below
        every candidate ``L`` (0 .. len - 1), from the cached contents."""
        n = len(tokens)
        per_group: list[list[int]] = []
        for g in self.groups:
            layout = layout_of(g.spec)
            served = [True] + [False] * (n - 1)
            if layout is not None and self.mgr.cached_slabs[g.group_id] is not None:
                have = self.cached_meanings(g.group_id)
                bs, shift = layout
                for L in range(1, n):
                    if (L + shift) % bs:
                        continue
                    served[L] = all(
                        (salt, tuple(tokens[: block_end(layout, b)])) in have
                        for b in visible_blocks(g.spec, L)
                    )
            best, out = 0, []
            for L in range(n):
                best = L if served[L] else best
                out.append(best)
            per_group.append(out)
        combined = max(
            (L for L in range(n) if all(per_group[g][L] == L for g in range(len(self.groups)))),
            default=0,
        )
        return combined, per_group

    def check_match(self, match: PrefixMatch, tokens: list[int], salt: str | None) -> None:
        combined, per_group = self.brute_hit(tokens, salt)
        assert match.num_tokens == combined, (match.explain(), combined)
        assert match.num_prompt_tokens == len(tokens)
        for g, expected in zip(self.groups, per_group, strict=True):
            own = match.group_hits[g.group_id]
            assert own.length == expected[-1], (g.kind.value, own, expected)
            held = match.cached_blocks(g.group_id)
            if held is None:
                continue
            rules = rules_for(g.spec)
            for L in range(len(tokens)):
                assert rules.prefix_hit(g.spec, held, L)[0] == expected[L], (g.kind.value, L)

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        self.commit()
        tokens, salt = self.prompt(data)
        match = self.p.match(tokens, cache_salt=salt)
        self.learn_names(tokens, salt)
        self.check_match(match, tokens, salt)
        self.saved.append((match, tokens, salt))
        self.last_step = []

    # ------------------------------------------------------------------ steps

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        self.commit()
        self.make_step(data, arrive=True, exact=True)

    @rule(data=st.data())
    def lazy_step(self, data: st.DataObject) -> None:
        """A step while blocks are named lazily (not yet in their groups' maps): the
        blocks a release frees get their names first. No lookup in it (a lookup
        puts every name in its map); the step check's page counts are not predicted."""
        self.commit(flush=False)
        self.make_step(data, arrive=False, exact=False)

    @rule(data=st.data(), count=st.integers(2, 4))
    def lazy_steps(self, data: st.DataObject, count: int) -> None:
        """A few steps in a row with nothing read in between: the names a window's
        group defers stay deferred across them (the releases of later steps free
        blocks named only for a while)."""
        for _ in range(count):
            self.lazy_step(data)

    def make_step(self, data: st.DataObject, *, arrive: bool, exact: bool) -> None:
        live = sorted(self.reqs)
        chosen = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=3)) if live else []
        scheduled: list[tuple[str, int]] = []
        for rid in chosen:
            req = self.reqs[rid]
            left = req.prompt_len - req.computed
            n = data.draw(st.integers(1, max(1, left))) if left > 0 else 1
            scheduled.append((rid, n))
        arrivals: dict[str, tuple[list[int], str | None, PrefixMatch | None]] = {}
        for _ in range(data.draw(st.integers(0, 2 if arrive else 0))):
            kind = data.draw(st.sampled_from(["new", "new", "saved", "twin", "plain"]))
            rid = f"r{self.next_id}"
            self.next_id += 1
            if kind == "saved" and self.saved:
                match, tokens, salt = data.draw(st.sampled_from(self.saved[-4:]))
            elif kind == "twin" and arrivals:  # parallel sampling: one match, two requests
                tokens, salt, match = next(iter(arrivals.values()))
            else:
                tokens, salt = self.prompt(data)
                match = None
                if kind != "plain":
                    match = self.p.match(tokens, cache_salt=salt)
                    self.learn_names(tokens, salt)
                    self.check_match(match, tokens, salt)
            start = match.num_tokens if match is not None else 0
            left = len(tokens) - start
            n = data.draw(st.one_of(st.just(left), st.integers(1, left)))
            arrivals[rid] = (tokens, salt, match)
            scheduled.append((rid, n))
        order = data.draw(st.permutations(scheduled))
        # As an engine does: a refused step goes again without its last request.
        while order and not self.run_step(order, arrivals, exact=exact):
            dropped = order.pop()[0]
            arrivals = {r: a for r, a in arrivals.items() if r != dropped}

    @rule(data=st.data())
    def another_step(self, data: st.DataObject) -> None:
        """Steps are the machine's main move: a second rule makes them twice as likely."""
        self.step(data)

    def run_step(
        self,
        scheduled: Sequence[tuple[str, int]],
        arrivals: dict[str, tuple[list[int], str | None, PrefixMatch | None]],
        *,
        exact: bool = True,
    ) -> bool:
        """Run one step; whether the manager took it. ``exact``: every named block is
        in its map, so the step check is predicted to the page."""
        mgr = self.mgr
        groups = self.groups
        # ---- the model's view of the step
        stale = False
        hit_tables: dict[str, list[list[int]]] = {}
        for rid, (tokens, salt, match) in arrivals.items():
            if match is None or match.num_tokens == 0:
                continue
            L = match.num_tokens
            root = prefix_root(HASHER, cache_salt=salt)
            tables: list[list[int]] = []
            for g in groups:
                layout = layout_of(g.spec)
                slab = mgr.cached_slabs[g.group_id]
                assert layout is not None, "a hit past a group that cannot"
                assert slab is not None, "a hit past a group that cannot"
                names = block_names(tokens, TokenLayout(*layout), HASHER, root)
                width = (L + layout[1]) // layout[0]
                need = visible_blocks(g.spec, L)
                read = rules_for(g.spec).prefix_blocks(g.spec, L).tolist()
                assert set(read) == need, (g.kind.value, L, read, need)
                table = [NULL_BLOCK] * width
                for b in sorted(need):
                    block = slab.block_of.get(names[b])
                    if block is None:
                        stale = True
                        break
                    table[b] = block
                tables.append(table)
            hit_tables[rid] = tables
        computed_before: dict[str, int] = {}
        for rid, _ in scheduled:
            if rid in self.reqs:
                computed_before[rid] = self.reqs[rid].computed
            else:
                match = arrivals[rid][2]
                computed_before[rid] = match.num_tokens if match is not None else 0
        # Holders after hits and releases.
        tables_after: dict[str, list[list[int]]] = {
            rid: [list(t) for t in req.tables] for rid, req in self.reqs.items()
        }
        for rid, _ in scheduled:
            if rid not in tables_after:
                tables_after[rid] = hit_tables.get(rid, [[] for _ in groups])
        need = [0] * len(groups)
        for rid, n in scheduled:
            for g in groups:
                table = tables_after[rid][g.group_id]
                dead = min(dead_blocks(g.spec, computed_before[rid]), len(table))
                for i in range(dead):
                    table[i] = NULL_BLOCK
                need[g.group_id] += max(
                    0, blocks_needed(g.spec, computed_before[rid] + n) - len(table)
                )
        fits, free_after, idle_after = self.predict(tables_after, need)
        before = self.snapshot(names=exact)
        prefixes = [arrivals[rid][2] if rid in arrivals else None for rid, _ in scheduled]
        try:
            mgr.allocate_step([(rid, n, 0) for rid, n in scheduled], prefixes=prefixes)
        except StalePrefixError:
            assert stale, "refused a match whose blocks are all cached"
            assert self.snapshot(names=exact) == before, "StalePrefixError changed the manager"
            return False
        except OutOfBlocksError:
            assert not stale, "took a stale match"
            assert not fits or not exact, "refused a step that fits"
            assert self.snapshot(names=exact) == before, "OutOfBlocksError changed the manager"
            return False
        assert not stale, "took a stale match"
        pool = mgr.pool
        assert isinstance(pool, CachedPool)
        if exact:
            assert fits, "took a step that does not fit"
            assert pool.num_free_blocks == free_after, "took more free pages than needed"
            assert len(pool.idle) == idle_after, "evicted more cached pages than needed"
        # ---- the model follows the manager
        for rid, (tokens, salt, match) in arrivals.items():
            tables = hit_tables.get(rid, [[] for _ in groups])
            self.reqs[rid] = MReq(
                list(tokens),
                len(tokens),
                salt,
                match.num_tokens if match is not None else 0,
                match is not None,
                False,
                [list(t) for t in tables],
            )
            for g, table in zip(groups, tables, strict=True):  # a hit reads the right bytes
                for b, block in enumerate(table):
                    if block != NULL_BLOCK:
                        assert self.content.get((g.group_id, block)) == self.meaning(
                            self.reqs[rid], g.group_id, b
                        ), f"a hit on group {g.group_id} block {block} reads other bytes"
        self.pending = []
        for rid, _ in scheduled:  # releases first (a new block may be one just released)
            req = self.reqs[rid]
            for g in groups:
                table = req.tables[g.group_id]
                dead = min(dead_blocks(g.spec, req.computed), len(table))
                for i in range(dead):
                    table[i] = NULL_BLOCK
        holders = self.holders()
        for rid, n in scheduled:
            req = self.reqs[rid]
            before_n = req.computed
            while len(req.tokens) < before_n + n:  # decodes: a generated token
                req.tokens.append(len(req.tokens) % 3)
            for g in groups:
                gid = g.group_id
                table = req.tables[gid]
                got = mgr.block_table(gid, rid)
                assert got[: len(table)] == table, (rid, g.kind.value, got, table)
                for block in got[len(table) :]:
                    assert holders.get((gid, block), 0) == 0, (
                        f"block {(gid, block)} handed out twice"
                    )
                    self.content[(gid, block)] = None
                table.extend(got[len(table) :])
            req.computed = before_n + n
            self.last_step.append(rid)
            for g in groups:
                gid = g.group_id
                layout = layout_of(g.spec)
                slab = mgr.cached_slabs[gid]
                if layout is None or slab is None:
                    continue
                bs, shift = layout
                table = req.tables[gid]
                # The blocks this step writes are the request's own: one holder, no name.
                for pos in range(before_n, req.computed):
                    block = table[(pos + shift) // bs]
                    assert slab.refs[block] == 1, (gid, block)
                    assert not slab.named[block], (gid, block)
                first = (before_n + shift) // bs if before_n else 0
                end = (req.computed + shift) // bs
                for b in range(first, end):
                    block = table[b]
                    if block == NULL_BLOCK:
                        continue
                    self.content[(gid, block)] = self.meaning(req, gid, b)
                    if req.tracked and not req.tainted and block_end(layout, b) <= req.prompt_len:
                        self.pending.append((gid, block, self.content[(gid, block)]))
        self.last_step = [rid for rid, _ in scheduled]
        return True

    def holders(self) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = {}
        for req in self.reqs.values():
            for gid, table in enumerate(req.tables):
                for block in table:
                    if block != NULL_BLOCK:
                        out[(gid, block)] = out.get((gid, block), 0) + 1
        return out

    def page_states(
        self, holders: dict[tuple[int, int], int]
    ) -> tuple[dict[int, int], set[int], dict[int, tuple[int, int]]]:
        """Page -> its owning group, the idle pages, and per cached group (free unnamed,
        free named) blocks in its pinned pages; from the holders given and the names."""
        owner: dict[int, int] = {}
        live: set[int] = set()
        for (gid, block), count in holders.items():
            if count:
                page = block // self.groups[gid].blocks_per_page
                assert owner.setdefault(page, gid) == gid, f"page {page} held by two groups"
                live.add(page)
        for gid in self.cached_groups():
            k = self.groups[gid].blocks_per_page
            for block in cached(self.mgr, gid).name_of:
                page = block // k
                assert owner.setdefault(page, gid) == gid, f"page {page} held by two groups"
        idle = set(owner) - live
        free: dict[int, tuple[int, int]] = {}
        for gid in self.cached_groups():
            k = self.groups[gid].blocks_per_page
            names = cached(self.mgr, gid).name_of
            unnamed = named = 0
            for page in live:
                if owner[page] != gid:
                    continue
                for block in range(page * k, page * k + k):
                    if holders.get((gid, block), 0):
                        continue
                    if block in names:
                        named += 1
                    else:
                        unnamed += 1
            free[gid] = (unnamed, named)
        return owner, idle, free

    def predict(
        self, tables_after: dict[str, list[list[int]]], need: list[int]
    ) -> tuple[bool, int, int]:
        """Whether the step fits, and the free and idle pages it leaves."""
        holders: dict[tuple[int, int], int] = {}
        for tables in tables_after.values():
            for gid, table in enumerate(tables):
                for block in table:
                    if block != NULL_BLOCK:
                        holders[(gid, block)] = holders.get((gid, block), 0) + 1
        owner, idle, free = self.page_states(holders)
        pages = 0
        for g in self.groups:
            k = g.blocks_per_page
            if g.group_id in free:
                short = need[g.group_id] - sum(free[g.group_id])
            else:
                mine = [p for p, o in owner.items() if o == g.group_id]
                used = sum(1 for (gid, _), c in holders.items() if gid == g.group_id and c)
                short = need[g.group_id] - (len(mine) * k - used)
            pages += -(-short // k) if short > 0 else 0
        free_pages = self.num_pages - 1 - len(owner)
        fits = pages <= free_pages + len(idle)
        return fits, max(0, free_pages - pages), len(idle) - max(0, pages - free_pages)

    def snapshot(self, *, names: bool = True) -> tuple[object, ...]:
        """The manager's state (``names``: with the groups' maps; a step may put lazily
        named blocks into them before it is refused)."""
        mgr = self.mgr
        pool = mgr.pool
        assert isinstance(pool, CachedPool)
        idle = tuple(pool.idle)  # read first: it sorts the pages given back unsorted
        return (
            tuple(pool._free),
            idle,
            len(mgr),
            {
                (g.group_id, rid): mgr.block_table(g.group_id, rid)
                for g in self.groups
                for rid in self.reqs
            },
            tuple(
                None
                if s is None
                else (
                    s.refs.tobytes(),
                    tuple(s.block_of.items()) if names else (),
                    tuple(s._unnamed) if names else (),
                    tuple(s._named_free) if names else (),
                )
                for s in mgr.cached_slabs
            ),
            tuple(None if s is None else (s.refs.tobytes(), s.owned.tobytes()) for s in mgr.slabs),
        )

    # ------------------------------------------------------------------ other rules

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data(), with_tokens=st.booleans())
    def finish(self, data: st.DataObject, with_tokens: bool) -> None:
        self.commit()
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs.pop(rid)
        self.mgr.free_request(rid, req.tokens if with_tokens else None)
        if with_tokens and req.tracked and not req.tainted:
            self.past.append(list(req.tokens))
            self.learn_names(req.tokens, req.salt)
            for gid in self.cached_groups():
                layout = layout_of(self.groups[gid].spec)
                assert layout is not None
                slab = cached(self.mgr, gid)
                first = (req.prompt_len + layout[1]) // layout[0]
                end = (req.computed + layout[1]) // layout[0]
                for b in range(first, end):
                    block = req.tables[gid][b]
                    if block == NULL_BLOCK:
                        continue
                    meaning = self.content[(gid, block)]
                    name = slab.name_of.get(block)
                    if name is not None:
                        assert self.meanings[(gid, name)] == meaning
                    else:
                        assert any(self.meanings.get((gid, n)) == meaning for n in slab.block_of)
        self.last_step = []

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data(), with_tokens=st.booleans())
    def lazy_finish(self, data: st.DataObject, with_tokens: bool) -> None:
        """A free while the request's blocks are named lazily: they get into their
        groups' maps as they are freed."""
        self.commit(flush=False)
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs.pop(rid)
        self.mgr.free_request(rid, req.tokens if with_tokens else None)
        if with_tokens and req.tracked and not req.tainted:
            self.past.append(list(req.tokens))
            self.learn_names(req.tokens, req.salt)
        self.last_step = []

    @precondition(lambda self: bool(self.last_step))
    @rule()
    def discard(self) -> None:
        """The last step's model call failed: nothing it wrote is ever named."""
        self.p.discard()
        for gid, block, _ in self.pending:
            self.marker += 1
            self.content[(gid, block)] = ("garbage", self.marker)
        self.pending = []
        for rid in self.last_step:
            if rid in self.reqs:
                self.reqs[rid].tainted = True
        self.last_step = []

    @rule(now=st.integers(0, 3))
    def reset(self, now: int) -> None:
        """Weights changed (one draw in four: a reset empties the cache)."""
        if now:
            return
        self.commit()
        self.p.reset()
        for key in self.content:
            self.marker += 1
            self.content[key] = ("stale", self.marker)
        for req in self.reqs.values():
            req.tainted = True
        self.last_step = []

    # ------------------------------------------------------------------ invariants

    def settled(self) -> None:
        """Make the names a step deferred (the maps an observer reads: a lookup, a
        report and a reclaim settle them first)."""
        for gid in self.cached_groups():
            cached(self.mgr, gid).settle()

    @invariant()
    def names_describe_their_blocks(self) -> None:
        self.settled()
        for gid in self.cached_groups():
            slab = cached(self.mgr, gid)
            assert {b: n for n, b in slab.block_of.items()} == slab.name_of
            assert set(np.flatnonzero(slab.named).tolist()) == set(slab.name_of)
            k = self.groups[gid].blocks_per_page
            for name, block in slab.block_of.items():
                assert block // k != NULL_BLOCK, "a block of the null page is named"
                assert (gid, name) in self.meanings, "a name no request's tokens make"
                assert self.content.get((gid, block)) == self.meanings[(gid, name)], (
                    f"group {gid}: block {block} is named for bytes it does not hold"
                )

    @invariant()
    def ref_counts_are_the_tables_holders(self) -> None:
        self.settled()
        holders = self.holders()
        for rid, req in self.reqs.items():
            assert self.mgr.num_tokens(rid) == req.computed
            for g in self.groups:
                assert self.mgr.block_table(g.group_id, rid) == req.tables[g.group_id]
        for gid in self.cached_groups():
            slab = cached(self.mgr, gid)
            want = np.zeros_like(slab.refs)
            for (g, block), count in holders.items():
                if g == gid:
                    want[block] = count
            assert np.array_equal(slab.refs, want), f"group {gid}: ref counts are not the holders"
            assert slab.shared == int(np.maximum(want - 1, 0).sum())

    @invariant()
    def pages_are_free_pinned_or_idle_and_nothing_leaks(self) -> None:
        self.settled()
        holders = self.holders()
        owner, idle, free = self.page_states(holders)
        pool = self.mgr.pool
        assert isinstance(pool, CachedPool)
        assert pool.num_free_blocks == self.num_pages - 1 - len(owner), "a page leaked"
        for page in range(1, self.num_pages):
            assert pool.is_allocated(page) == (page in owner), page
        assert set(pool.idle) == idle
        for page, slab in pool.idle.items():
            assert slab is self.mgr.cached_slabs[owner[page]]
        for gid in self.cached_groups():
            slab = cached(self.mgr, gid)
            assert (slab.num_free_unnamed, slab.num_free_named) == free[gid]
            assert set(np.flatnonzero(slab.owned).tolist()) == {
                p for p, o in owner.items() if o == gid
            }


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(
    max_examples=80,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---------------------------------------------------------------------------- broken variants


def _forget_a_ref(self: CachedSlab, blocks: Any) -> None:
    """A touch that forgets the hit's holder on its first block."""
    ids = np.asarray(blocks, dtype=np.int64)
    _touch(self, ids[1:] if ids.size > 1 else ids)


def _named_when_partial(self: _prefix.PrefixCache) -> None:
    """A cache that counts one more token as filled than a step computed: the block
    that token would close is named while its last slot is unwritten."""
    held = self.row_tokens
    self.row_tokens = held + 1
    try:
        _commit(self)
    finally:
        self.row_tokens = held


_touch = _cached.CachedSlab.touch
_commit = _prefix.PrefixCache.commit


def _idle_before_free(self: CachedPool, n: int) -> list[int]:
    """A pool that evicts cached pages before it uses free ones."""
    idle = self.idle
    count = min(n, len(idle))
    reclaimed = list(idle)[:count]
    for page in reclaimed:
        idle.pop(page).drop_page(page)
    return reclaimed + _cached.BlockPool.take(self, n - count)


_match = _prefix.PrefixCache.match
_give_back = _cached.CachedSlab.give_back


def _give_back_forgets_sharers(self: CachedSlab, blocks: Any) -> None:
    """A give back that, while blocks are shared, drops the holders beyond the first
    of the blocks given back (a block one request still holds looks unshared, one
    both still hold looks held once)."""
    if self.blocks_per_page == 1 and self.shared:
        self.extra[np.asarray(blocks, dtype=np.int64)] = 0
    _give_back(self, blocks)


_preview = _cached.CachedSlab.preview
_register = _cached.CachedSlab.register


def _settle_keeps_duplicates_idle(self: CachedSlab) -> None:
    """A settle that leaves a duplicate's free block among the idle (cached) pages."""
    self.pool.sort_given_back()
    deferred, self._deferred = self._deferred, []
    self._marked = 0
    self.pool.deferred.pop(self, None)
    for ids, chain, start, salt_free in deferred:
        self.named[ids] = False
        _register(self, ids.tolist(), chain[start : start + ids.size], salt_free, ids)


def _defer_marks_nothing(self: CachedSlab) -> None:
    """A deferral whose blocks are never marked named: a release before the settle
    gives them back to the pool, and the settle names free blocks."""
    self._marked = len(self._deferred)


def _hit_past_the_block(self: _prefix.PrefixCache, *args: Any, **kwargs: Any) -> PrefixMatch:
    """A lookup whose hit runs one token into the next block."""
    match = _match(self, *args, **kwargs)
    if match.hit.length:
        match.hit = dataclasses.replace(match.hit, length=match.hit.length + 1)
    return match


def _check_ignores_hits(self: CachedSlab, ids: Any, signs: Any) -> _cached.Preview:
    """A step check that forgets that a hit takes its free cached blocks out of the
    evictable ones."""
    keep = signs < 0
    return _preview(self, ids[keep], signs[keep])


def _sort_newest_first(self: CachedPool) -> None:
    """A sort of the given-back pages that makes the last released idle first: the
    least recently used cached blocks are no longer the first evicted."""
    self._unsorted.reverse()
    for _, blocks in self._unsorted:
        blocks.reverse()
    _sort_given_back(self)


def _sort_forgets_names(self: CachedPool) -> None:
    """A sort of the given-back pages that frees every one, named or not."""
    for _, blocks in self._unsorted:
        self._free.extend(blocks)
        if self._in_use_cache is not None:
            self._mark(blocks, False)
    self._unsorted, self._num_unsorted = [], 0


_sort_given_back = CachedPool.sort_given_back

BROKEN_SORT: dict[str, tuple[object, str, Callable[..., Any]]] = {
    "released pages idle newest first": (CachedPool, "sort_given_back", _sort_newest_first),
    "released named pages freed": (CachedPool, "sort_given_back", _sort_forgets_names),
}

BROKEN: dict[str, tuple[object, str, Callable[..., Any]]] = {
    "a hit that is not a whole block": (_prefix.PrefixCache, "match", _hit_past_the_block),
    "a hit that forgets a ref": (_cached.CachedSlab, "touch", _forget_a_ref),
    "a give back that forgets the sharers": (
        _cached.CachedSlab,
        "give_back",
        _give_back_forgets_sharers,
    ),
    "a partial block named": (_prefix.PrefixCache, "commit", _named_when_partial),
    "cached pages evicted before free ones": (_cached.CachedPool, "take", _idle_before_free),
}
BROKEN_DEFERRAL: dict[str, tuple[object, str, Callable[..., Any]]] = {
    "a duplicate kept idle at the settle": (
        _cached.CachedSlab,
        "settle",
        _settle_keeps_duplicates_idle,
    ),
    "deferred names not marked": (_cached.CachedSlab, "_mark_deferred", _defer_marks_nothing),
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_the_machine_catches(broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    owner, name, replacement = BROKEN[broken]
    monkeypatch.setattr(owner, name, replacement)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            PrefixMachine,
            settings=settings(
                max_examples=300,
                stateful_step_count=25,
                deadline=None,
                derandomize=True,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
                print_blob=False,
            ),
        )


def test_the_config_names_the_hashes_the_names_can_use() -> None:
    from typing import get_args

    from attnkit.config import PrefixHashName
    from attnkit.prefix_cache import HASH_NAMES

    assert get_args(PrefixHashName) == HASH_NAMES
