"""Paged KV cache: grouping, page-size unification, block pool, block tables, tensors."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

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
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UnknownRequestError,
)
from attnkit.capabilities import KVCacheLayout
from attnkit.kinds import rules_for
from attnkit.kv_cache import (
    NULL_BLOCK,
    BlockPool,
    KVCacheGroup,
    KVCacheManager,
    OutOfBlocksError,
    PageSlab,
    _pool,
    allocate_kv_cache_tensors,
    group_layers,
    num_blocks_for_budget,
    unify_page_sizes,
)


def full(heads: int = 2, head_size: int = 32, block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=torch.float32
    )


def window(w: int, heads: int = 2, block_size: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=heads,
        head_size=32,
        dtype=torch.float32,
        sliding_window=w,
    )


def mamba(conv: tuple[int, int] = (64, 3), ssm: tuple[int, int, int] = (4, 8, 16)) -> MambaSpec:
    return MambaSpec(block_size=1, shapes=(conv, ssm), dtypes=(torch.float32, torch.float32))


# ---------------------------------------------------------------------------- grouping


def test_equal_specs_share_a_group_in_first_appearance_order() -> None:
    groups = group_layers(
        {
            "l0": full(),
            "l1": window(8),
            "l2": full(),
            "l3": mamba(),
            "l4": window(8),
            "l5": window(16),
        }
    )
    assert [(g.group_id, g.kind.value, g.layer_names) for g in groups] == [
        (0, "full_attention", ("l0", "l2")),
        (1, "sliding_window", ("l1", "l4")),
        (2, "mamba", ("l3",)),
        (3, "sliding_window", ("l5",)),
    ]


def test_group_layers_errors() -> None:
    with pytest.raises(ValueError, match=r"layer_specs must name at least one layer, got none"):
        group_layers({})
    with pytest.raises(ValueError, match=r"layer_specs\['x'\] must be a KVCacheSpec, got int"):
        group_layers({"x": 3})  # type: ignore[dict-item]  # the wrong type is the test


# ---------------------------------------------------------------------------- unification


def test_attention_pages_unify_into_kernel_blocks_per_page() -> None:
    # full: 2 * 16 * 4 heads * 32 * 4 B = 16384; window: 2 * 16 * 2 * 32 * 4 = 8192.
    groups, page = unify_page_sizes(group_layers({"a": full(heads=4), "b": window(64, heads=2)}))
    assert page == 16384
    # Block sizes stay as declared (the kernels' blocks); a page holds 1 and 2 of them.
    assert [g.spec.block_size for g in groups] == [16, 16]
    assert [g.blocks_per_page for g in groups] == [1, 2]
    assert [g.page_tokens for g in groups] == [16, 32]
    assert [g.spec.page_size_bytes * g.blocks_per_page for g in groups] == [16384, 16384]


def test_mamba_state_smaller_than_attention_page_is_padded() -> None:
    # attention page 2*16*2*32*4 = 8192; mamba state 64*2*4 + 4*8*16*4 = 512 + 2048 = 2560.
    groups, page = unify_page_sizes(group_layers({"a": full(), "m": mamba((64, 2))}))
    assert page == 8192
    assert [g.spec.block_size for g in groups] == [16, 1]
    assert [g.blocks_per_page for g in groups] == [1, 1]


def test_mamba_state_larger_than_attention_page_puts_blocks_in_a_page() -> None:
    # attention page 8192; mamba state 512*3*4 + 4*8*64*4 = 6144 + 8192 = 14336 -> P = 16384.
    groups, page = unify_page_sizes(group_layers({"a": full(), "m": mamba((512, 3), (4, 8, 64))}))
    assert page == 16384
    assert groups[0].spec.block_size == 16
    assert (groups[0].blocks_per_page, groups[1].blocks_per_page) == (2, 1)


def test_lcm_of_unrelated_attention_pages() -> None:
    # pages 2*16*3*32*4 = 12288 and 2*16*2*32*4 = 8192: lcm 24576 -> 2 and 3 blocks a page.
    groups, page = unify_page_sizes(group_layers({"a": full(heads=3), "b": full(heads=2)}))
    assert page == 24576
    assert [g.spec.block_size for g in groups] == [16, 16]
    assert [g.blocks_per_page for g in groups] == [2, 3]


def test_mamba_only_and_encoder_only() -> None:
    groups, page = unify_page_sizes(group_layers({"m": mamba((10, 3))}))
    assert page == math.ceil((10 * 3 * 4 + 4 * 8 * 16 * 4) / 16) * 16
    enc = EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    groups, page = unify_page_sizes(group_layers({"e": enc}))
    assert page == 0
    assert not groups[0].has_cache


def test_num_blocks_for_budget() -> None:
    groups = group_layers({"a": full(), "b": full(), "m": mamba()})
    # Two layers share group 0, so each block id costs 2 pages.
    assert num_blocks_for_budget(groups, 8192, 10 * 2 * 8192 + 5) == 10
    with pytest.raises(
        ValueError,
        match=r"memory_budget_bytes=16384 holds 1 block\(s\) of 16384 bytes .* at least 2 are needed",
    ):
        num_blocks_for_budget(groups, 8192, 16384)
    with pytest.raises(ValueError, match=r"memory_budget_bytes must be a positive int, got 0"):
        num_blocks_for_budget(groups, 8192, 0)


# ---------------------------------------------------------------------------- block pool


def test_block_pool_basics() -> None:
    pool = BlockPool(5)
    first = pool.allocate(3)
    assert first == [1, 2, 3]
    assert pool.num_free_blocks == 1
    with pytest.raises(OutOfBlocksError, match=r"need 2 free block\(s\) but only 1 of 4 are free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.free([2])
    assert sorted(pool.allocate(2)) == [2, 4]
    assert not pool.is_allocated(NULL_BLOCK)


@pytest.mark.parametrize(
    ("blocks", "match"),
    [
        pytest.param([0], r"cannot free block 0: ids run from 1 to 4", id="null-block"),
        pytest.param([7], r"cannot free block 7: ids run from 1 to 4", id="out-of-range"),
        pytest.param(
            [3], r"cannot free block 3: it is not allocated \(double free\?\)", id="not-allocated"
        ),
        pytest.param([1, 1], r"cannot free block 1: it is given twice", id="twice"),
    ],
)
def test_block_pool_free_errors_change_nothing(blocks: list[int], match: str) -> None:
    pool = BlockPool(5)
    pool.allocate(2)
    with pytest.raises(ValueError, match=match):
        pool.free(blocks)
    assert pool.num_free_blocks == 2
    assert pool.is_allocated(1)
    assert pool.is_allocated(2)


@pytest.mark.parametrize("size", [3, 40], ids=["per-id-checks", "vectorised-checks"])
@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        pytest.param(0, ValueError, r"cannot free block 0: ids run from 1 to 99", id="null"),
        pytest.param(
            100, ValueError, r"cannot free block 100: ids run from 1 to 99", id="out-of-range"
        ),
        pytest.param(-3, ValueError, r"cannot free block -3: ids run from 1 to 99", id="negative"),
        pytest.param("7", TypeError, r"block ids must be ints, got '7' \(str\)", id="str"),
        pytest.param(2.0, TypeError, r"block ids must be ints, got 2.0 \(float\)", id="float"),
        pytest.param(True, TypeError, r"block ids must be ints, got True \(bool\)", id="bool"),
        pytest.param(99, ValueError, r"cannot free block 99: it is not allocated", id="free-id"),
        pytest.param("dup", ValueError, r"it is given twice", id="twice"),
    ],
)
def test_block_pool_checked_free_at_both_sizes(
    size: int, bad: object, error: type[Exception], match: str
) -> None:
    """The small (per-id) and large (vectorised) checks reject the same inputs, and a
    rejected free changes nothing (checked against a set kept beside the pool)."""
    pool = BlockPool(100)
    held = set(pool.allocate(60))
    pool.free([7])  # the in-use map now exists; its updates are checked too
    held.discard(7)
    pool.give_back(pool.take(2))  # the fast path keeps the map current as well
    given: list[object] = sorted(held)[: size - 1]
    given.append(given[0] if bad == "dup" else bad)
    with pytest.raises(error, match=match):
        pool.free(given)  # type: ignore[arg-type]  # bad ids on purpose
    assert pool.num_free_blocks == 100 - 1 - len(held)
    assert {b for b in range(100) if pool.is_allocated(b)} == held
    pool.free(sorted(held)[:size])
    assert {b for b in range(100) if pool.is_allocated(b)} == set(sorted(held)[size:])


def test_block_pool_frees_numpy_ids() -> None:
    pool = BlockPool(10)
    taken = pool.allocate(4)
    pool.free(np.array(taken[:2], dtype=np.int32))  # ids read out of a block table
    assert [b for b in range(10) if pool.is_allocated(b)] == taken[2:]


def test_block_pool_rejects_tiny_pool() -> None:
    with pytest.raises(
        ValueError, match=r"num_blocks must be an int >= 2 \(block 0 is reserved\), got 1"
    ):
        BlockPool(1)


# ---------------------------------------------------------------------------- page slabs


def test_a_slab_page_goes_back_to_the_pool_only_when_all_its_kernel_blocks_are_free() -> None:
    pool = BlockPool(4)  # pages 1, 2, 3; kernel blocks 3k .. 3k+2 of page k
    slab = PageSlab(pool, 3)
    first = slab.take(2).tolist()
    assert first == [3, 4]  # page 1, in order
    assert (pool.num_free_blocks, slab.num_pages, slab.num_free_blocks) == (2, 1, 1)
    second = slab.take(2).tolist()  # the last block of page 1, then a new page
    assert sorted(second) == [5, 6]
    assert (pool.num_free_blocks, slab.num_pages, slab.num_free_blocks) == (1, 2, 2)
    slab.give_back([3, 4])  # page 1 still holds block 5
    assert pool.is_allocated(1)
    assert (pool.num_free_blocks, slab.num_pages, slab.num_free_blocks) == (1, 2, 4)
    slab.give_back(np.array([5], dtype=np.int32))  # its last live block: page 1 goes back
    assert not pool.is_allocated(1)
    assert (pool.num_free_blocks, slab.num_pages, slab.num_free_blocks) == (2, 1, 2)
    assert slab.live_blocks([0, 1, 2, 3]).tolist() == [0, 0, 1, 0]
    assert np.flatnonzero(slab.refs).tolist() == [6]


@pytest.mark.parametrize("at_once", [False, True], ids=["one-at-a-time", "at-once"])
def test_a_slab_never_hands_out_blocks_of_a_page_it_gave_back(at_once: bool) -> None:
    """Page 1's free kernel blocks stay on the slab's stack, above page 2's, once page 1
    is back in the pool and another group holds it: the slab must skip them."""
    pool = BlockPool(4)  # pages 1, 2, 3; kernel blocks 4k .. 4k+3 of page k
    slab = PageSlab(pool, 4)
    assert slab.take(8).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    slab.give_back([8, 9, 10])  # page 2 keeps block 11
    slab.give_back([4, 5, 6])  # page 1 keeps block 7
    slab.give_back([7])  # page 1 is empty: back to the pool
    assert (pool.num_free_blocks, slab.num_pages, slab.num_free_blocks) == (2, 1, 3)
    assert pool.take(1) == [1]  # another group holds page 1 now
    if at_once:  # past the stale entries, then one found beyond the need goes back
        taken = slab.take(2).tolist() + slab.take(1).tolist()
    else:
        taken = [int(slab.take(1)[0]) for _ in range(3)]
    assert sorted(taken) == [8, 9, 10]  # page 2's, never page 1's
    assert (pool.num_free_blocks, slab.num_pages, slab.num_free_blocks) == (1, 1, 0)
    stacked = slab._stack[: slab._top].tolist()
    assert len(stacked) == len(set(stacked)) == int(slab._listed.sum())  # once each, at most
    # Page 1 comes back to the pool, then to the slab: its blocks serve again, once each.
    pool.give_back([1])
    slab.give_back(taken)
    slab.give_back([11])
    assert pool.num_free_blocks == 3
    again = slab.take(12).tolist()
    assert sorted(again) == list(range(4, 16))
    stacked = slab._stack[: slab._top].tolist()
    assert len(stacked) == len(set(stacked)) == int(slab._listed.sum())


def test_pages_for_and_preview_give_back_change_nothing() -> None:
    pool = BlockPool(10)
    slab = PageSlab(pool, 4)
    held = slab.take(6).tolist()  # pages 1 (4 blocks) and 2 (2 blocks): 2 free
    assert [slab.pages_for(n) for n in (0, 2, 3, 6, 7)] == [0, 0, 1, 1, 2]
    assert slab.pages_for(3, free=6) == 0
    state = (pool.num_free_blocks, slab.num_free_blocks, slab.refs.tobytes(), slab._top)
    # Giving back page 2's two blocks empties it (it goes back); page 1's two do not.
    page_1, page_2 = [b for b in held if b // 4 == 1], [b for b in held if b // 4 == 2]
    assert slab.preview_give_back(page_2) == (2 + 2 - 4, 1)
    assert slab.preview_give_back(page_1[:2]) == (2 + 2, 0)
    assert slab.preview_give_back([]) == (2, 0)
    assert (pool.num_free_blocks, slab.num_free_blocks, slab.refs.tobytes(), slab._top) == state


def test_slab_arguments() -> None:
    with pytest.raises(ValueError, match=r"blocks_per_page must be a positive int, got 0"):
        PageSlab(BlockPool(4), 0)
    with pytest.raises(ValueError, match=r"exceed the int32 ids of block tables"):
        PageSlab(BlockPool(2**20), 2**12)
    groups = group_layers({"m": mamba()})
    with pytest.raises(
        ValueError, match=r"group 0 \(mamba\): blocks_per_page must be 1 for a group whose block"
    ):
        KVCacheManager([dataclasses.replace(groups[0], blocks_per_page=2)], num_blocks=4)


def hybrid_groups(per_page: int) -> list[KVCacheGroup]:
    """Full attention (blocks of 4 tokens) whose page holds ``per_page`` blocks, and a
    state layer (one page per request)."""
    groups = group_layers({"a": full(block_size=4), "m": mamba()})
    return [dataclasses.replace(groups[0], blocks_per_page=per_page), groups[1]]


def test_a_step_that_needs_one_page_more_than_is_free_fails_and_changes_nothing() -> None:
    mgr = KVCacheManager(hybrid_groups(3), num_blocks=6)  # 5 usable pages
    # "a": 8 tokens = 2 kernel blocks (page 1, one free block left) + a state page.
    mgr.allocate_step([("a", 8, 0)])
    assert mgr.pool.num_free_blocks == 3
    slab = mgr.slabs[0]
    assert slab is not None
    assert slab.num_free_blocks == 1
    before = (
        list(mgr.pool._free),
        slab._stack[: slab._top].tobytes(),
        slab.refs.tobytes(),
        mgr.block_table(0, "a"),
        mgr.num_tokens("a"),
    )
    # "b": 28 tokens = 7 kernel blocks: 1 free in page 1, 6 more in 2 pages; + 1 state
    # page: 3 pages, 3 free. "a" grows by one block (4 more tokens) too: one block more
    # than page 1 and the 2 new pages hold, so a fourth page.
    with pytest.raises(
        OutOfBlocksError,
        match=(
            r"the step needs 4 new page\(s\) but only 3 are free \(\+0 given back by window "
            r"releases and finished requests\) of 5; group 0 \(full_attention\): 8 kernel "
            r"block\(s\) of 4 tokens, 1 free in its 1 page\(s\) of 3 -> 3 page\(s\); "
            r"group 1 \(mamba\): 1 page\(s\); nothing was allocated or freed"
        ),
    ):
        mgr.allocate_step([("a", 4, 0), ("b", 28, 0)])
    after = (
        list(mgr.pool._free),
        slab._stack[: slab._top].tobytes(),
        slab.refs.tobytes(),
        mgr.block_table(0, "a"),
        mgr.num_tokens("a"),
    )
    assert after == before
    assert "b" not in mgr
    # Without "a"'s growth the pages hold it exactly.
    mgr.allocate_step([("b", 28, 0)])
    assert mgr.pool.num_free_blocks == 0
    assert slab.num_free_blocks == 0


def test_a_finished_request_gives_its_pages_to_the_step() -> None:
    """All or nothing with finished requests: their kernel blocks count as free, and the
    pages they empty as free pages; a step too big even so changes nothing."""
    mgr = KVCacheManager(hybrid_groups(2), num_blocks=6)
    mgr.allocate_step([("a", 12, 0)])  # 3 kernel blocks in 2 pages + 1 state page
    mgr.allocate_step([("b", 4, 0)])  # page 2's second block + 1 state page
    assert mgr.pool.num_free_blocks == 1
    slab = mgr.slabs[0]
    assert slab is not None
    # Finishing "a" frees 3 blocks: page 1 empties, page 2 keeps "b"'s; + its state page.
    # "c": 20 tokens = 5 blocks: 1 free in page 2, 4 in 2 pages; + 1 state page = 3 of
    # 1 + 2 free pages.
    mgr.allocate_rows(
        ["c"],
        np.array([-1]),
        mgr.step_lens(np.array([-1]), np.array([20]), np.array([0])),
        finished=["a"],
    )
    assert "a" not in mgr
    assert mgr.pool.num_free_blocks == 0
    # "d": 12 tokens = 3 blocks: 1 free in page 2 once "b" finishes, 2 in a new page; +
    # 1 state page: 2 pages, but finishing "b" gives back only its state page (page 2
    # keeps "c"'s block).
    state = (list(mgr.pool._free), slab.refs.tobytes(), sorted(mgr.owned_blocks()))
    with pytest.raises(OutOfBlocksError, match=r"needs 2 new page\(s\) but only 0 are free"):
        mgr.allocate_rows(
            ["d"],
            np.array([-1]),
            mgr.step_lens(np.array([-1]), np.array([12]), np.array([0])),
            finished=["b"],
        )
    assert (list(mgr.pool._free), slab.refs.tobytes(), sorted(mgr.owned_blocks())) == state
    assert "b" in mgr


def test_kernel_blocks_of_a_request_fill_pages_in_order() -> None:
    """A prefill's kernel blocks come out page by page, in order inside each page; no
    kernel block of the null page is ever handed out."""
    mgr = KVCacheManager(hybrid_groups(4), num_blocks=8)
    mgr.allocate_step([("a", 4 * 9, 0)])  # 9 kernel blocks: pages 1, 2 and one of page 3
    table = mgr.block_table(0, "a")
    pages = [b // 4 for b in table]
    assert pages == [1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert [b % 4 for b in table] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert mgr.block_table(1, "a") == [4]  # the state page after them
    assert mgr.owned_pages() == {0: {1, 2, 3}, 1: {4}}


# ---------------------------------------------------------------------------- manager


def manager_groups() -> list[KVCacheGroup]:
    specs = {
        "full": FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32),
        "win": SlidingWindowSpec(
            block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=5
        ),
        "chunk": ChunkedLocalAttentionSpec(
            block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32, attention_chunk_size=8
        ),
        "sink": SinkFullAttentionSpec(
            block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32, sink_len=3
        ),
        "m": MambaSpec(block_size=4, shapes=((2, 2),), dtypes=(torch.float32,)),
    }
    return group_layers(specs)


def test_tables_grow_and_windows_release() -> None:
    mgr = KVCacheManager(manager_groups(), num_blocks=64)
    mgr.allocate_step([("r", 6, 0)])
    full_g, win_g, chunk_g, sink_g, mamba_g = range(5)
    assert len(mgr.block_table(full_g, "r")) == 2  # 6 tokens / 4
    assert len(mgr.block_table(sink_g, "r")) == 3  # 3 sink + 6 tokens = 9 -> 3 blocks
    assert len(mgr.block_table(mamba_g, "r")) == 1
    mgr.allocate_step([("r", 5, 0)])  # positions 6..10; window 5 -> first live key 2
    assert mgr.num_tokens("r") == 11
    assert len(mgr.block_table(full_g, "r")) == 3
    assert (
        mgr.block_table(win_g, "r")[0] != NULL_BLOCK
    )  # block 0 holds positions 0..3, 2 and 3 live
    mgr.allocate_step([("r", 1, 0)])  # position 11: first live 7 -> block 0 (0..3) dead
    table = mgr.block_table(win_g, "r")
    assert table[0] == NULL_BLOCK
    assert all(b != NULL_BLOCK for b in table[1:])
    # chunk 8: position 11 is in chunk [8, 16): blocks 0 and 1 (0..7) are dead.
    chunk_table = mgr.block_table(chunk_g, "r")
    assert chunk_table[:2] == [NULL_BLOCK, NULL_BLOCK]
    assert len(mgr.block_table(mamba_g, "r")) == 1
    owned = mgr.owned_blocks()["r"]
    assert len(owned) == mgr.pool.num_blocks - 1 - mgr.pool.num_free_blocks
    mgr.free_request("r")
    assert mgr.pool.num_free_blocks == 63
    with pytest.raises(UnknownRequestError, match=r"request 'r' was already freed"):
        mgr.num_tokens("r")
    with pytest.raises(UnknownRequestError, match=r"unknown request 'q': it was never scheduled"):
        mgr.num_tokens("q")


def test_out_of_blocks_leaves_everything_unchanged() -> None:
    mgr = KVCacheManager(manager_groups(), num_blocks=12)
    mgr.allocate_step([("a", 4, 0)])  # full 1, win 1, chunk 1, sink 2, mamba 1 = 6 blocks
    before = (
        mgr.pool.num_free_blocks,
        {g: mgr.block_table(g, "a") for g in range(5)},
        mgr.num_tokens("a"),
    )
    with pytest.raises(
        OutOfBlocksError, match=r"the step needs \d+ new block\(s\) but only 5 are free"
    ):
        mgr.allocate_step([("a", 4, 0), ("b", 8, 0)])
    after = (
        mgr.pool.num_free_blocks,
        {g: mgr.block_table(g, "a") for g in range(5)},
        mgr.num_tokens("a"),
    )
    assert after == before
    assert "b" not in mgr


def machine_groups() -> list[KVCacheGroup]:
    """``manager_groups`` (ids 0-4) and kinds at other boundaries: cross attention,
    encoder-only (no cache), a window of one token over blocks of two (many blocks per
    request: table-width growth), and chunks of 6 over blocks of 4 (not a multiple)."""
    extra = {
        "cross": CrossAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32),
        "enc": EncoderOnlyAttentionSpec(
            block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32
        ),
        "win1": SlidingWindowMLASpec(
            block_size=2, head_size=8, dtype=torch.float32, sliding_window=1
        ),
        "chunk6": ChunkedLocalAttentionSpec(
            block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32, attention_chunk_size=6
        ),
    }
    base = manager_groups()
    more = group_layers({**{g.layer_names[0]: g.spec for g in base}, **extra})
    assert [g.spec for g in more[: len(base)]] == [g.spec for g in base]
    return more


# The reference model: one request at a time, plain lists, a set of free block ids.


def ref_blocks_needed(spec: KVCacheSpec, tokens: int, encoder: int) -> int:
    """Entries a request's table has after a step that leaves it with ``tokens`` tokens."""
    if isinstance(spec, EncoderOnlyAttentionSpec):
        return 0
    if isinstance(spec, MambaSpec):
        return 1
    occupied = encoder if isinstance(spec, CrossAttentionSpec) else tokens
    if isinstance(spec, SinkFullAttentionSpec):
        occupied += spec.sink_len  # sink slots in front of the tokens
    blocks = 0
    while blocks * spec.block_size < occupied:
        blocks += 1
    return blocks


def ref_dead_blocks(spec: KVCacheSpec, computed: int) -> int:
    """Leading logical blocks no query at position >= ``computed`` can see: every key
    they hold is before the first key the step's first query sees."""
    if isinstance(spec, SlidingWindowSpec):  # SlidingWindowMLASpec too
        first_key = max(0, computed - spec.sliding_window + 1)
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        first_key = computed - computed % spec.attention_chunk_size
    else:
        return 0
    dead = 0
    while (dead + 1) * spec.block_size <= first_key:  # the block's last key < first_key
        dead += 1
    return dead


@dataclasses.dataclass
class RefRequest:
    tokens: int
    encoder: int
    tables: list[list[int]]  # per group; NULL_BLOCK for released entries


Snapshot = tuple[object, ...]
Key = tuple[int, int]  # (group id, kernel block)


def paged(group: KVCacheGroup) -> bool:
    """Whether a group's page may hold several of its blocks (its blocks are per-token
    K/V or latents; a state fills its page, encoder-only layers keep nothing)."""
    return not isinstance(group.spec, MambaSpec | EncoderOnlyAttentionSpec)


class ManagerMachine(RuleBasedStateMachine):
    """Random steps (small and large batches, long prefills) and finishes, checked step
    by step against a per-request reference model of kernel blocks inside pages, and
    the persistent arrays against ``block_table``.

    The reference keeps the live ``(group, kernel block)`` pairs only; everything else
    follows from them: a page is held by the group that has a live kernel block in it
    (at most one group), and is free otherwise. A step fits when, after its releases,
    every group's new kernel blocks fit in the free kernel blocks of the pages it holds
    plus the fewest whole pages that hold the rest, out of the free pages.
    """

    def __init__(self) -> None:
        super().__init__()
        self.groups = machine_groups()
        self.mgr = KVCacheManager(self.groups, num_blocks=2)  # replaced by init_pool
        self.ref: dict[str, RefRequest] = {}
        self.live: dict[Key, str] = {}  # (group, kernel block) -> the request holding it
        self.num_pages = 2
        self.next_id = 0
        self.peak_live = 0

    @initialize(num_blocks=st.sampled_from([96, 24, 700, 700]), data=st.data())
    def init_pool(self, num_blocks: int, data: st.DataObject) -> None:
        # Half the runs: every paged group's page holds 1, 2, 3 or 5 of its blocks.
        if data.draw(st.booleans()):
            self.groups = [
                dataclasses.replace(g, blocks_per_page=data.draw(st.sampled_from([1, 2, 3, 5])))
                if paged(g)
                else g
                for g in self.groups
            ]
        self.mgr = KVCacheManager(self.groups, num_blocks=num_blocks)
        self.num_pages = num_blocks

    # ------------------------------------------------------------------ rules

    def _new_ids(self, count: int) -> list[str]:
        ids = [f"r{self.next_id + i}" for i in range(count)]
        self.next_id += count
        return ids

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        live = sorted(self.ref)
        chosen = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=3)) if live else []
        # Continuing requests pass an encoder length too: only the first step's counts.
        scheduled = [
            (rid, data.draw(st.integers(1, 9)), data.draw(st.integers(0, 3))) for rid in chosen
        ]
        for rid in self._new_ids(data.draw(st.integers(0, 2))):
            scheduled.append((rid, data.draw(st.integers(1, 12)), data.draw(st.integers(0, 9))))
        self._run_step(data.draw(st.permutations(scheduled)))

    @rule(data=st.data())
    def big_step(self, data: st.DataObject) -> None:
        """Up to 20 requests at once, some new: rows grow past the initial 16."""
        live = sorted(self.ref)
        chosen = (
            data.draw(st.lists(st.sampled_from(live), unique=True, max_size=19)) if live else []
        )
        scheduled = [(rid, data.draw(st.integers(1, 5)), 0) for rid in chosen]
        new = data.draw(st.integers(1, 20 - len(chosen)))
        for rid in self._new_ids(new):
            scheduled.append((rid, data.draw(st.integers(1, 6)), data.draw(st.integers(0, 6))))
        self._run_step(data.draw(st.permutations(scheduled)))

    @rule(data=st.data())
    def long_prefill(self, data: st.DataObject) -> None:
        """A long chunk for a new or a live request: tables grow wider than 16 blocks."""
        live = sorted(self.ref)
        continuing = data.draw(st.booleans())
        rid = data.draw(st.sampled_from(live)) if live and continuing else self._new_ids(1)[0]
        self._run_step([(rid, data.draw(st.integers(30, 90)), data.draw(st.integers(0, 40)))])

    @precondition(lambda self: bool(self.ref))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.ref)))
        row = self.mgr.row_of(rid)
        self.mgr.free_request(rid)
        for g, blocks in zip(self.groups, self.ref.pop(rid).tables, strict=True):
            for block in blocks:
                if block != NULL_BLOCK:
                    assert self.live.pop((g.group_id, block)) == rid
        assert rid not in self.mgr
        # The row is zeroed at once, before any reuse.
        rows = np.array([row])
        for g in self.groups:
            assert not self.mgr.table_array(g.group_id)[row].any()
            assert self.mgr.num_blocks_of(g.group_id, rows).tolist() == [0]
        self._compare_with_reference()

    # ------------------------------------------------------------------ the reference

    def _page(self, key: Key) -> int:
        gid, block = key
        return block // self.groups[gid].blocks_per_page

    def _held_pages(self, live: Sequence[Key]) -> dict[int, int]:
        """Page -> the group holding it (a live kernel block in it)."""
        held: dict[int, int] = {}
        for key in live:
            page = self._page(key)
            assert held.setdefault(page, key[0]) == key[0], f"page {page} held by two groups"
        return held

    def _free_in_pages(self, gid: int, live: Sequence[Key], held: dict[int, int]) -> int:
        """Free kernel blocks in the pages group ``gid`` holds."""
        pages = sum(1 for owner in held.values() if owner == gid)
        return pages * self.groups[gid].blocks_per_page - sum(1 for g, _ in live if g == gid)

    def _run_step(self, scheduled: Sequence[tuple[str, int, int]]) -> None:
        # Predict from the reference whether the step fits, in pages, once the step's
        # windows and chunks released their blocks.
        plan: list[tuple[str, int, int]] = []  # (id, tokens after the step, encoder length)
        need = [0] * len(self.groups)
        released: set[Key] = set()
        for rid, n, enc in scheduled:
            req = self.ref.get(rid)
            computed = req.tokens if req else 0
            encoder = req.encoder if req else enc  # given on the first step only
            for g in self.groups:
                table = req.tables[g.group_id] if req else []
                dead = min(ref_dead_blocks(g.spec, computed), len(table))
                released.update((g.group_id, b) for b in table[:dead] if b != NULL_BLOCK)
                wanted = ref_blocks_needed(g.spec, computed + n, encoder)
                need[g.group_id] += max(wanted - len(table), 0)
            plan.append((rid, computed + n, encoder))
        live = [key for key in self.live if key not in released]
        held = self._held_pages(live)
        free_pages = self.num_pages - 1 - len(held)
        pages = [
            -(
                -max(0, need[g.group_id] - self._free_in_pages(g.group_id, live, held))
                // g.blocks_per_page
            )
            for g in self.groups
        ]
        fits = sum(pages) <= free_pages
        why = f"needs {pages} page(s) for {need} block(s), {free_pages} pages free after releases"
        before = self._snapshot()
        try:
            self.mgr.allocate_step(scheduled)
        except OutOfBlocksError:
            assert not fits, f"refused a step that fits: {why}"
            assert self._snapshot() == before, "OutOfBlocksError changed the manager"
            return
        assert fits, f"took a step that does not fit: {why}"
        # Releases first (every request), then growth: new blocks may reuse released ones.
        for rid, _, encoder in plan:
            req = self.ref.setdefault(rid, RefRequest(0, encoder, [[] for _ in self.groups]))
            for g in self.groups:
                table = req.tables[g.group_id]
                dead = min(ref_dead_blocks(g.spec, req.tokens), len(table))
                for i in range(dead):
                    if table[i] != NULL_BLOCK:
                        assert self.live.pop((g.group_id, table[i])) == rid
                        table[i] = NULL_BLOCK
        taken: dict[int, set[int]] = {g.group_id: set() for g in self.groups}  # new pages
        for rid, tokens, encoder in plan:
            req = self.ref[rid]
            for g in self.groups:
                table = req.tables[g.group_id]
                wanted = ref_blocks_needed(g.spec, tokens, encoder)
                got = self.mgr.block_table(g.group_id, rid)
                assert len(got) == max(wanted, len(table)), (rid, g.kind.value)
                for block in got[len(table) :]:  # the manager chose these ids
                    key = (g.group_id, block)
                    assert key not in self.live, f"kernel block {key} handed out twice"
                    page = self._page(key)
                    assert page != NULL_BLOCK, f"kernel block {key} lies in the null page"
                    owner = held.get(page)
                    assert owner in (None, g.group_id), f"{key}: page {page} is group {owner}'s"
                    if owner is None:
                        taken[g.group_id].add(page)
                    self.live[key] = rid
                    table.append(block)
            req.tokens = tokens
        # A group takes a page only once the pages it holds have no free kernel block.
        assert [len(taken[g.group_id]) for g in self.groups] == pages, (taken, pages)
        self.peak_live = max(self.peak_live, len(self.ref))
        self._compare_with_reference()

    def _compare_with_reference(self) -> None:
        assert len(self.mgr) == len(self.ref)
        for rid, req in self.ref.items():
            assert rid in self.mgr
            assert self.mgr.num_tokens(rid) == req.tokens
            assert self.mgr.encoder_len(rid) == req.encoder
            for g in self.groups:
                table = self.mgr.block_table(g.group_id, rid)
                # Same entries in the same places: the same set of blocks, same nulls.
                assert table == req.tables[g.group_id], (rid, g.kind.value)
        # Pages: held exactly while a kernel block in them is live, free otherwise.
        held = self._held_pages(list(self.live))
        pool = self.mgr.pool
        assert pool.num_free_blocks == self.num_pages - 1 - len(held)
        for page in range(1, pool.num_blocks):
            assert pool.is_allocated(page) == (page in held), page
        for g, slab in zip(self.groups, self.mgr.slabs, strict=True):
            assert (slab is None) == (g.blocks_per_page == 1)
            if slab is None:
                continue
            mine = {b for gid, b in self.live if gid == g.group_id}
            pages = {p for p, owner in held.items() if owner == g.group_id}
            assert set(np.flatnonzero(slab.owned).tolist()) == pages
            assert slab.num_pages == len(pages)
            assert set(np.flatnonzero(slab.refs).tolist()) == mine
            assert slab.num_free_blocks == len(pages) * g.blocks_per_page - len(mine)
            # The free-block stack: each block at most once; every free block of the
            # slab's pages on it; the others (blocks of pages given back) counted stale.
            stacked = slab._stack[: slab._top].tolist()
            assert len(stacked) == len(set(stacked)) == int(slab._listed.sum())
            free = {
                p * g.blocks_per_page + j for p in pages for j in range(g.blocks_per_page)
            } - mine
            assert free <= set(stacked)
            assert slab._stale == len(set(stacked) - free)
            counts = np.bincount(
                np.array(sorted(mine), dtype=np.int64) // g.blocks_per_page,
                minlength=pool.num_blocks,
            )
            assert np.array_equal(slab.live_blocks(np.arange(pool.num_blocks)), counts)

    def _snapshot(self) -> Snapshot:
        live = sorted(self.ref)
        rows = {rid: self.mgr.row_of(rid) for rid in live}
        all_rows = np.arange(self.mgr.table_array(0).shape[0], dtype=np.int64)
        return (
            self.mgr.pool.num_free_blocks,
            tuple(self.mgr.pool._free),
            tuple(b for b in range(self.mgr.pool.num_blocks) if self.mgr.pool.is_allocated(b)),
            len(self.mgr),
            rows,
            {rid: (self.mgr.num_tokens(rid), self.mgr.encoder_len(rid)) for rid in live},
            tuple(
                (
                    self.mgr.table_array(g.group_id).shape,
                    self.mgr.table_array(g.group_id).tobytes(),
                    self.mgr.num_blocks_of(g.group_id, all_rows).tolist(),
                )
                for g in self.groups
            ),
            {
                (g.group_id, rid): self.mgr.block_table(g.group_id, rid)
                for g in self.groups
                for rid in live
            },
            tuple(
                None
                if slab is None
                else (
                    slab.num_free_blocks,
                    slab.num_pages,
                    slab.refs.tobytes(),
                    slab.owned.tobytes(),
                    slab._stack[: slab._top].tobytes(),
                )
                for slab in self.mgr.slabs
            ),
        )

    # ------------------------------------------------------------------ invariants

    @invariant()
    def persistent_arrays_agree_with_block_table(self) -> None:
        """Each group's persistent array is exactly the live requests' ``block_table``s
        at their rows, zero-padded; every other row (never used, or finished) is all
        zero with no blocks, so a reused row starts clean."""
        rows = {rid: self.mgr.row_of(rid) for rid in self.ref}
        assert len(set(rows.values())) == len(rows), "two live requests share a row"
        assert self.mgr.lookup_rows([*rows, "nobody"]).tolist() == [*rows.values(), -1]
        for g in self.groups:
            array = self.mgr.table_array(g.group_id)
            assert array.dtype == np.int32
            num_rows = array.shape[0]
            assert all(0 <= row < num_rows for row in rows.values())
            expected = np.zeros_like(array)
            expected_counts = np.zeros(num_rows, dtype=np.int64)
            for rid, row in rows.items():
                table = self.mgr.block_table(g.group_id, rid)
                expected[row, : len(table)] = table
                expected_counts[row] = len(table)
            assert np.array_equal(array, expected), (
                f"group {g.group_id}: the persistent array disagrees with block_table "
                "(or a row no request holds is not zeroed)"
            )
            counts = self.mgr.num_blocks_of(g.group_id, np.arange(num_rows, dtype=np.int64))
            assert counts.tolist() == expected_counts.tolist()
            if self.peak_live <= 16:
                assert num_rows == 16, "rows grew while at most 16 requests were ever live"

    @invariant()
    def no_block_owned_twice_or_leaked(self) -> None:
        owners: dict[Key, str] = {}
        for rid, blocks in self.mgr.owned_blocks().items():
            for key in blocks:
                assert key not in owners, f"kernel block {key} owned by {owners[key]} and {rid}"
                owners[key] = rid
        assert owners == self.live
        counted = sum(
            1
            for g in self.groups
            for rid in self.ref
            for b in self.mgr.block_table(g.group_id, rid)
            if b != NULL_BLOCK
        )
        assert counted == len(owners), "a block appears twice in one request's tables"
        pages = self.mgr.owned_pages()
        held = [p for group_pages in pages.values() for p in group_pages]
        assert len(held) == len(set(held)), "a page is held by two groups"
        assert all(self.mgr.pool.is_allocated(p) for p in held)
        assert len(held) + self.mgr.pool.num_free_blocks == self.mgr.pool.num_blocks - 1

    @invariant()
    def tables_cover_every_visible_position(self) -> None:
        for rid, req in self.ref.items():
            n = req.tokens
            assert self.mgr.num_tokens(rid) == n
            full_t, win_t, chunk_t, sink_t, mamba_t = (
                self.mgr.block_table(g, rid) for g in range(5)
            )
            assert len(full_t) == math.ceil(n / 4)
            assert NULL_BLOCK not in full_t
            assert len(sink_t) == math.ceil((n + 3) / 4)
            assert NULL_BLOCK not in sink_t
            assert len(mamba_t) == 1
            # The last query (position n-1) sees keys from n-5 on; those blocks are held.
            assert all(b != NULL_BLOCK for b in win_t[max(0, n - 5) // 4 :])
            assert all(b != NULL_BLOCK for b in chunk_t[((n - 1) // 8 * 8) // 4 :])


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


def test_the_machine_catches_a_page_given_back_while_one_of_its_blocks_is_live(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A deliberately broken slab: a page goes back to the pool as soon as only one of its
    kernel blocks is live. The machine (its reference of pages) must catch it."""
    give_back = _pool.PageSlab.give_back

    def early_give_back(self: PageSlab, blocks: _pool.Ints32 | list[int]) -> None:
        give_back(self, blocks)
        pages = np.unique(np.asarray(blocks, dtype=np.int64) // self.blocks_per_page)
        early = pages[self.owned[pages] & (self.live_blocks(pages) == 1)]
        # The bug: the pool gets the page back while one of its kernel blocks is live
        # (and could hand it to another group).
        self.pool.give_back(early.tolist())

    monkeypatch.setattr(_pool.PageSlab, "give_back", early_give_back)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            ManagerMachine,
            settings=settings(
                max_examples=200,
                stateful_step_count=30,
                deadline=None,
                derandomize=True,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
                print_blob=False,
            ),
        )


# ---------------------------------------------------------------------------- tensors


def test_tensors_alias_across_groups_and_states_do_not_overlap() -> None:
    groups, page = unify_page_sizes(
        group_layers({"a0": full(), "m0": mamba((64, 2)), "a1": full()})
    )
    shapes = {0: ((6, 2, 16, 2, 32),), 1: ((6, 64, 2), (6, 4, 8, 16))}
    caches = allocate_kv_cache_tensors(
        groups,
        shapes,
        num_blocks=6,
        page_size_bytes=page,
        device=torch.device("cpu"),
        fill=float("nan"),
    )
    (a0,), (a1,), (conv, ssm) = caches["a0"], caches["a1"], caches["m0"]
    assert a0.shape == (6, 2, 16, 2, 32)
    assert conv.shape == (6, 64, 2)
    assert ssm.shape == (6, 4, 8, 16)
    assert bool(torch.isnan(a0[1:]).all())
    assert bool(torch.isnan(ssm[1:]).all())
    # Layer 0 of each group shares one buffer: the same block id, the same bytes.
    assert a0.untyped_storage().data_ptr() == conv.untyped_storage().data_ptr()
    assert a1.untyped_storage().data_ptr() != a0.untyped_storage().data_ptr()
    # Within a Mamba page the two states are disjoint, and blocks do not overlap.
    conv[3].fill_(1.0)
    assert bool(torch.isnan(ssm[1:]).all())
    assert bool(torch.isnan(conv[2]).all())
    assert bool(torch.isnan(conv[4]).all())
    ssm[3].fill_(2.0)
    assert bool((conv[3] == 1.0).all())


@pytest.mark.parametrize("layout", ["interleaved", "planes", "mla"])
def test_kernel_block_views_address_the_bytes_of_their_page(layout: str) -> None:
    """Kernel block ``j`` of page ``p`` is the ``j``-th ``P / k`` bytes of page ``p``
    (of each plane's half for planes): written through the layer's kernel-block view,
    exactly those bytes of the layer buffer change, and a state layer viewing the same
    buffer sees them in page ``p`` only."""
    attention: KVCacheSpec = (
        MLAAttentionSpec(block_size=16, head_size=64, dtype=torch.float32)
        if layout == "mla"
        else full(heads=1)  # 2 * 16 * 1 * 32 * 4 = 4096 B
    )
    # The state: 512*3*4 + 4*8*64*4 = 14336 B -> P = 16384 B = 4 attention blocks.
    groups, page = unify_page_sizes(
        group_layers({"a": attention, "m": mamba((512, 3), (4, 8, 64))})
    )
    k = groups[0].blocks_per_page
    assert (page, k) == (16384, 4)
    nb = 5
    kind_layout: KVCacheLayout = "planes" if layout == "planes" else "interleaved"
    shapes = {
        0: rules_for(attention).cache_shapes(attention, nb * k, kind_layout),
        1: ((nb, 512, 3), (nb, 4, 8, 64)),
    }
    layouts: dict[int, KVCacheLayout] = {0: kind_layout}
    caches = allocate_kv_cache_tensors(
        groups,
        shapes,
        num_blocks=nb,
        page_size_bytes=page,
        device=torch.device("cpu"),
        fill=0.0,
        layouts=layouts,
    )
    tensors = caches["a"]
    raw = torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage())
    assert raw.numel() == nb * page
    states = caches["m"]
    shares = layout != "planes"  # page-major views alias the state layer's buffer
    assert (states[0].untyped_storage().data_ptr() == raw.data_ptr()) == shares
    share = page // k
    for p in range(1, nb):
        for j in range(k):
            block = p * k + j
            for t in tensors:
                t.zero_()
            if layout == "planes":
                key, value = tensors
                key[block * 16 : (block + 1) * 16] = 1.5
                value[block * 16 : (block + 1) * 16] = -2.5
                k_at = p * page // 2 + j * share // 2
                v_at = nb * page // 2 + k_at
                expected = {(k_at, k_at + share // 2, 1.5), (v_at, v_at + share // 2, -2.5)}
            else:
                tensors[0][block] = 1.5
                start = p * page + j * share
                expected = {(start, start + share, 1.5)}
            written = torch.zeros(nb * page, dtype=torch.bool)
            for start, stop, value in expected:
                assert bool((raw[start:stop].view(torch.float32) == value).all()), (p, j)
                written[start:stop] = True
            assert not bool(raw[~written].any()), (p, j)  # nothing else changed
            if shares:  # the state layer's page p holds the bytes, no other page does
                touched = {q for q in range(nb) for s in states if bool(s[q].any())}
                assert touched == {p}, (p, j, touched)


def test_tensor_layout_errors() -> None:
    groups, page = unify_page_sizes(group_layers({"a": full()}))
    with pytest.raises(
        ValueError, match=r"cache shape \(5, 2, 16, 2, 32\) must start with num_blocks=6"
    ):
        allocate_kv_cache_tensors(
            groups,
            {0: ((5, 2, 16, 2, 32),)},
            num_blocks=6,
            page_size_bytes=page,
            device=torch.device("cpu"),
        )
    with pytest.raises(ValueError, match=r"needs 16384 bytes per block but pages are 8192 bytes"):
        allocate_kv_cache_tensors(
            groups,
            {0: ((6, 2, 16, 4, 32),)},
            num_blocks=6,
            page_size_bytes=page,
            device=torch.device("cpu"),
        )


def test_null_block_is_zero_even_after_a_fill() -> None:
    groups, page = unify_page_sizes(group_layers({"a0": full(), "m0": mamba((64, 2))}))
    shapes = {0: ((4, 2, 16, 2, 32),), 1: ((4, 64, 2), (4, 4, 8, 16))}
    caches = allocate_kv_cache_tensors(
        groups,
        shapes,
        num_blocks=4,
        page_size_bytes=page,
        device=torch.device("cpu"),
        fill=float("nan"),
    )
    (a0,), (conv, ssm) = caches["a0"], caches["m0"]
    assert bool((a0[NULL_BLOCK] == 0).all())
    assert bool((conv[NULL_BLOCK] == 0).all())
    assert bool((ssm[NULL_BLOCK] == 0).all())
    assert bool(torch.isnan(a0[1:]).all())


def test_cache_buffers_are_huge_page_aligned_on_a_linux_cpu() -> None:
    """Big CPU cache buffers start on a 2 MB boundary (where huge pages were advised);
    small ones are plain allocations; either way the size is exactly what was asked."""
    import sys

    from attnkit.kv_cache import cache_buffer

    big = cache_buffer(5 * (1 << 20) + 3, "cpu")
    assert big.dtype == torch.uint8
    assert big.shape == (5 * (1 << 20) + 3,)
    if sys.platform.startswith("linux"):
        assert big.data_ptr() % (1 << 21) == 0
    big.fill_(7)  # writable over its whole length
    assert int(big[-1]) == 7
    small = cache_buffer(4096, "cpu")
    assert small.shape == (4096,)
