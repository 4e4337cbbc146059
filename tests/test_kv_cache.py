"""Paged KV cache: grouping, page-size unification, block pool, block tables, tensors."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from attnkit import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UnknownRequestError,
)
from attnkit.kv_cache import (
    NULL_BLOCK,
    BlockPool,
    KVCacheGroup,
    KVCacheManager,
    OutOfBlocksError,
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


def test_attention_pages_unify_by_scaling_block_sizes() -> None:
    # full: 2 * 16 * 4 heads * 32 * 4 B = 16384; window: 2 * 16 * 2 * 32 * 4 = 8192.
    groups, page = unify_page_sizes(group_layers({"a": full(heads=4), "b": window(64, heads=2)}))
    assert page == 16384
    assert [g.spec.block_size for g in groups] == [16, 32]
    assert [g.spec.page_size_bytes for g in groups] == [16384, 16384]
    assert groups[1].original_spec.block_size == 16


def test_mamba_state_smaller_than_attention_page_is_padded() -> None:
    # attention page 2*16*2*32*4 = 8192; mamba state 64*2*4 + 4*8*16*4 = 512 + 2048 = 2560.
    groups, page = unify_page_sizes(group_layers({"a": full(), "m": mamba((64, 2))}))
    assert page == 8192
    assert [g.spec.block_size for g in groups] == [16, 1]


def test_mamba_state_larger_than_attention_page_scales_attention() -> None:
    # attention page 8192; mamba state 512*3*4 + 4*8*64*4 = 6144 + 8192 = 14336 -> P = 16384.
    groups, page = unify_page_sizes(group_layers({"a": full(), "m": mamba((512, 3), (4, 8, 64))}))
    assert page == 16384
    assert groups[0].spec.block_size == 32


def test_lcm_of_unrelated_attention_pages() -> None:
    # pages 2*16*3*32*4 = 12288 and 2*16*2*32*4 = 8192: lcm 24576 -> block sizes 32 and 48.
    groups, page = unify_page_sizes(group_layers({"a": full(heads=3), "b": full(heads=2)}))
    assert page == 24576
    assert [g.spec.block_size for g in groups] == [32, 48]


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


class ManagerMachine(RuleBasedStateMachine):
    """Random steps (small and large batches, long prefills) and finishes, checked step
    by step against a per-request reference model, and the persistent arrays against
    ``block_table``."""

    def __init__(self) -> None:
        super().__init__()
        self.groups = machine_groups()
        self.mgr = KVCacheManager(self.groups, num_blocks=2)  # replaced by init_pool
        self.ref: dict[str, RefRequest] = {}
        self.ref_free: set[int] = set()
        self.next_id = 0
        self.peak_live = 0

    @initialize(num_blocks=st.sampled_from([96, 24, 700, 700]))
    def init_pool(self, num_blocks: int) -> None:
        self.mgr = KVCacheManager(self.groups, num_blocks=num_blocks)
        self.ref_free = set(range(1, num_blocks))

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
        for blocks in self.ref.pop(rid).tables:
            for block in blocks:
                if block != NULL_BLOCK:
                    assert block not in self.ref_free
                    self.ref_free.add(block)
        assert rid not in self.mgr
        # The row is zeroed at once, before any reuse.
        rows = np.array([row])
        for g in self.groups:
            assert not self.mgr.table_array(g.group_id)[row].any()
            assert self.mgr.num_blocks_of(g.group_id, rows).tolist() == [0]
        self._compare_with_reference()

    # ------------------------------------------------------------------ the reference step

    def _run_step(self, scheduled: Sequence[tuple[str, int, int]]) -> None:
        # Predict from the reference whether the step fits: the blocks it adds against
        # the free ones plus those the step's windows and chunks release.
        plan: list[tuple[str, int, int]] = []  # (id, tokens after the step, encoder length)
        total_new = total_released = 0
        for rid, n, enc in scheduled:
            req = self.ref.get(rid)
            computed = req.tokens if req else 0
            encoder = req.encoder if req else enc  # given on the first step only
            for g in self.groups:
                table = req.tables[g.group_id] if req else []
                dead = min(ref_dead_blocks(g.spec, computed), len(table))
                total_released += sum(1 for b in table[:dead] if b != NULL_BLOCK)
                need = ref_blocks_needed(g.spec, computed + n, encoder)
                total_new += max(need - len(table), 0)
            plan.append((rid, computed + n, encoder))
        free = len(self.ref_free)
        fits = total_new <= free + total_released
        why = f"needs {total_new} block(s), {free} free + {total_released} released"
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
                        assert table[i] not in self.ref_free
                        self.ref_free.add(table[i])
                        table[i] = NULL_BLOCK
        for rid, tokens, encoder in plan:
            req = self.ref[rid]
            for g in self.groups:
                table = req.tables[g.group_id]
                need = ref_blocks_needed(g.spec, tokens, encoder)
                got = self.mgr.block_table(g.group_id, rid)
                assert len(got) == max(need, len(table)), (rid, g.kind.value)
                for block in got[len(table) :]:  # the manager chose these ids
                    assert block in self.ref_free, f"block {block} handed out but not free"
                    self.ref_free.remove(block)
                    table.append(block)
            req.tokens = tokens
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
        assert self.mgr.pool.num_free_blocks == len(self.ref_free)
        for block in range(1, self.mgr.pool.num_blocks):
            assert self.mgr.pool.is_allocated(block) == (block not in self.ref_free)

    def _snapshot(self) -> Snapshot:
        live = sorted(self.ref)
        rows = {rid: self.mgr.row_of(rid) for rid in live}
        all_rows = np.arange(self.mgr.table_array(0).shape[0], dtype=np.int64)
        return (
            self.mgr.pool.num_free_blocks,
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
        owners: dict[int, str] = {}
        for rid, blocks in self.mgr.owned_blocks().items():
            for block in blocks:
                assert block not in owners, f"block {block} owned by {owners[block]} and {rid}"
                owners[block] = rid
            assert all(self.mgr.pool.is_allocated(b) for b in blocks)
        counted = sum(
            1
            for g in self.groups
            for rid in self.ref
            for b in self.mgr.block_table(g.group_id, rid)
            if b != NULL_BLOCK
        )
        assert counted == len(owners), "a block appears twice in one request's tables"
        assert len(owners) + self.mgr.pool.num_free_blocks == self.mgr.pool.num_blocks - 1

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
