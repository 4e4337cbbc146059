"""The block manager's steady state: decode steps of the same requests that change no
table skip the per-group plan (``KVCacheManager._look_ahead``). On random schedules the
manager with it must end every step exactly where a manager without it does."""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest
import torch

from attnkit import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from attnkit.config import PrefixCachingConfig
from attnkit.kv_cache import KVCacheGroup, KVCacheManager, OutOfBlocksError, group_layers
from attnkit.kv_cache._cached import CachedPool
from attnkit.kv_cache._prefix import PrefixCache

F32 = torch.float32


def specs() -> dict[str, Any]:
    return {
        "full": FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=F32),
        # Same block size as "full": its tables grow alike (a growth twin).
        "full2": FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=F32),
        "full8": FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=8, dtype=F32),
        "win": SlidingWindowSpec(
            block_size=4, num_kv_heads=1, head_size=8, dtype=F32, sliding_window=5
        ),
        "chunk": ChunkedLocalAttentionSpec(
            block_size=4, num_kv_heads=1, head_size=8, dtype=F32, attention_chunk_size=8
        ),
        "sink": SinkFullAttentionSpec(
            block_size=4, num_kv_heads=1, head_size=8, dtype=F32, sink_len=3
        ),
        "m": MambaSpec(block_size=4, shapes=((2, 2),), dtypes=(F32,)),
    }


def groups() -> list[KVCacheGroup]:
    return group_layers(specs())


def state(mgr: KVCacheManager) -> tuple[object, ...]:
    """Everything a step can change: tables, lengths, widths, the pool's free list."""
    ids = sorted(mgr._rows)
    return (
        {rid: mgr.row_of(rid) for rid in ids},
        {(g.group_id, rid): mgr.block_table(g.group_id, rid) for g in mgr.groups for rid in ids},
        {rid: mgr.num_tokens(rid) for rid in ids},
        [mgr.step_width(g.group_id) for g in mgr.groups],
        list(mgr.pool._free),
        # The cached pages in eviction order, each with its group.
        [(page, mgr.cached_slabs.index(keeper)) for page, keeper in idle_pages(mgr).items()],
    )


def idle_pages(mgr: KVCacheManager) -> dict[int, Any]:
    idle: dict[int, Any] = getattr(mgr.pool, "idle", {})
    return idle


class Schedule:
    """A random schedule over live requests: each ``next()`` step decodes them all,
    and at times one arrives with a prompt chunk, one finishes, or one runs a chunk."""

    def __init__(self, seed: int, *, max_live: int, repeat_chunks: bool = False) -> None:
        self.rng = random.Random(seed)
        self.live: list[str] = []
        self.max_live = max_live
        self._serial = 0
        # With repeat_chunks, a chunk goes on for a few steps at the same size (a
        # prompt's chunks beside decodes): request -> (tokens, steps left).
        self.repeat_chunks = repeat_chunks
        self._chunking: dict[str, tuple[int, int]] = {}

    def next(self) -> tuple[list[str], dict[str, int], float]:
        """The step's finished requests, its chunks (request -> tokens) and its roll."""
        rng, live = self.rng, self.live
        roll = rng.random()
        finished: list[str] = []
        chunk: dict[str, int] = {}
        if not live or (roll < 0.04 and len(live) < self.max_live):
            self._serial += 1
            live.append(f"r{self._serial}")
            chunk[live[-1]] = rng.randrange(1, 20)
        elif roll < 0.07 and len(live) > 1:
            finished.append(live.pop(rng.randrange(len(live))))
        elif roll < 0.10:
            chunk[rng.choice(live)] = rng.randrange(2, 9)
        if self.repeat_chunks:
            for rid, (tokens, left) in list(self._chunking.items()):
                if rid not in live or left == 0:
                    del self._chunking[rid]
                elif rid not in chunk:
                    chunk[rid] = tokens
                    self._chunking[rid] = (tokens, left - 1)
            for rid, tokens in chunk.items():
                if rid not in self._chunking and tokens > 1:
                    self._chunking[rid] = (tokens, rng.randrange(0, 8))
        return finished, chunk, roll


def drive(
    seed: int,
    *,
    caching: bool,
    steps: int = 400,
    hint: tuple[int, int] | None = None,
    steady_max: int | None = None,
    repeat_chunks: bool = False,
) -> int:
    """Run one random schedule on a manager with the steady state and one without;
    compare them after every step. Returns the steps the steady state took (with
    ``steady_max``, the first manager's ``_steady_max``: the steps its decode runs
    took, batches larger than it being planned as runs). ``hint``: the first one's
    ``table_hint`` (the second's tables start small and grow)."""
    config = PrefixCachingConfig(enabled=True) if caching else None
    fast = KVCacheManager(groups(), num_blocks=4096, prefix_caching=config, table_hint=hint)
    slow = KVCacheManager(groups(), num_blocks=4096, prefix_caching=config)
    slow._steady_max = 0
    slow._plan_runs = False
    if steady_max is not None:
        fast._steady_max = steady_max
    schedule = Schedule(seed, max_live=3, repeat_chunks=repeat_chunks)
    rng, live = schedule.rng, schedule.live
    rows: dict[int, Any] = {id(fast): None, id(slow): None}  # kept while the batch is
    taken = 0
    for _ in range(steps):
        finished, chunk, _ = schedule.next()
        batch = [(rid, chunk.get(rid, 1), 0) for rid in live]
        arrived = any(rid in chunk and rid not in fast for rid in live)
        if repeat_chunks:  # the rows are kept over chunks, as the runtime keeps them
            changed = bool(finished) or arrived or rng.random() < 0.05
        else:
            changed = bool(finished or chunk) or rng.random() < 0.05
        for mgr in (fast, slow):
            ids = [rid for rid, _, _ in batch]
            kept = rows[id(mgr)]
            if changed or kept is None:
                kept = mgr.lookup_rows(ids)
                for i, rid in enumerate(ids):
                    if rid in finished:
                        kept[i] = -1
            num_new = np.array([n for _, n, _ in batch], dtype=np.int64)
            lens = mgr.step_lens(kept, num_new, np.zeros_like(num_new))
            before = mgr._steady_left
            run = mgr._run
            run_step = -1 if run is None else run.step
            mgr.allocate_rows(ids, kept, lens, finished=finished)
            if mgr is fast and steady_max is None and mgr._steady_left == before - 1 and before:
                taken += 1
            # (with repeat_chunks: the run steps that ran a chunk)
            if (
                mgr is fast
                and steady_max is not None
                and run is not None
                and (chunk or not repeat_chunks)
            ):
                taken += mgr._run is run and run.step == run_step + 1
            rows[id(mgr)] = None if (bool(chunk) and not repeat_chunks) or finished else kept
        assert state(fast) == state(slow)
        if hint is not None and not caching:  # the blocks the tables hold, read one by one
            held = {
                g.group_id: {b for rid in fast._rows for b in fast.block_table(g.group_id, rid)}
                - {0}
                for g in fast.groups
            }
            assert fast.owned_pages() == held
    return taken


@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix-caching"])
@pytest.mark.parametrize("seed", range(6))
def test_the_steady_state_ends_every_step_where_the_full_step_does(
    seed: int, caching: bool
) -> None:
    taken = drive(seed, caching=caching)
    assert taken > 20  # the steady state ran


def test_a_look_ahead_one_step_too_far_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken variant: the steady state lasts one step past the last one that changes
    no table, so that step grows no block where it must."""
    look_ahead = KVCacheManager._look_ahead

    def too_far(self: KVCacheManager, rows: Any, lens: Any) -> None:
        look_ahead(self, rows, lens)
        if self._steady_rows is not None:
            self._steady_left += 1

    def every_seed() -> None:
        for seed in range(6):
            drive(seed, caching=False)

    monkeypatch.setattr(KVCacheManager, "_look_ahead", too_far)
    with pytest.raises(AssertionError):
        every_seed()


@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix-caching"])
@pytest.mark.parametrize("seed", range(6))
def test_decode_runs_end_every_step_where_the_full_step_does(seed: int, caching: bool) -> None:
    """Batches larger than the steady state's bound (here 1 request) take planned decode
    runs: every group's releases and growth of each step, planned at once."""
    taken = drive(seed, caching=caching, steady_max=1)
    assert taken > 100  # the runs ran


def test_a_run_step_that_does_not_fit_raises_and_changes_nothing() -> None:
    """A run's step that needs more blocks than the pool has free (its releases counted)
    goes to the full step, which refuses it as it would without runs, changing
    nothing; freed blocks let the same step through."""
    managers = []
    for runs in (True, False):
        mgr = KVCacheManager(groups(), num_blocks=64)
        mgr._steady_max, mgr._plan_runs = 1, runs
        managers.append(mgr)
    ids = ["a", "b", "c"]
    for mgr in managers:
        mgr.allocate_step([(rid, 3, 0) for rid in ids])
        mgr.allocate_step([(rid, 1, 0) for rid in ids])  # plans the run (with runs)
    fast, slow = managers
    assert fast._run is not None
    held = {id(mgr): mgr.pool.allocate(mgr.pool.num_free_blocks) for mgr in managers}
    rows = {id(mgr): mgr.lookup_rows(ids) for mgr in managers}
    for _ in range(8):  # to the next step that needs a block in some group
        need = {
            id(mgr): mgr.step_lens(rows[id(mgr)], np.ones(3, np.int64), np.zeros(3, np.int64))
            for mgr in managers
        }
        before = [state(mgr) for mgr in managers]
        assert fast._run is not None  # (the step is the run's to take, if it fits)
        refused = []
        for mgr in managers:
            try:
                mgr.allocate_rows(ids, rows[id(mgr)], need[id(mgr)])
            except OutOfBlocksError:
                refused.append(mgr)
        assert state(fast) == state(slow)
        if refused:
            assert refused == managers
            assert [state(mgr) for mgr in managers] == before
            break
    else:
        raise AssertionError("no step needed a block")
    for mgr in managers:
        mgr.pool.free(held[id(mgr)])
        lens = mgr.step_lens(rows[id(mgr)], np.ones(3, np.int64), np.zeros(3, np.int64))
        mgr.allocate_rows(ids, rows[id(mgr)], lens)
    assert state(fast) == state(slow)


@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix-caching"])
@pytest.mark.parametrize("seed", range(6))
def test_runs_of_repeated_chunks_end_every_step_where_the_full_step_does(
    seed: int, caching: bool
) -> None:
    """A step that repeats the last one's new tokens (chunks of one size beside
    decodes) plans a run too, whatever the batch's size."""
    taken = drive(seed, caching=caching, steady_max=1, repeat_chunks=True)
    assert taken > 10  # steps with a chunk the runs took


def test_a_run_is_not_taken_on_rows_refilled_in_place() -> None:
    """A caller that refills its rows array in place (the same object, another
    request's row, with the same lengths) gets the full step for those rows, not the
    run planned for the old ones (which would grow the old request's table)."""
    managers = []
    for runs in (True, False):
        mgr = KVCacheManager(groups(), num_blocks=512)
        mgr._steady_max, mgr._plan_runs = 1, runs
        managers.append(mgr)
    zeros, ones = np.zeros(3, np.int64), np.ones(3, np.int64)
    for mgr in managers:
        mgr.allocate_step([("a", 7, 0), ("b", 7, 0), ("c", 7, 0), ("d", 8, 0)])
        rows = mgr.lookup_rows(["a", "b", "c"])
        mgr.allocate_rows(["a", "b", "c"], rows, mgr.step_lens(rows, ones, zeros))
        assert (mgr._run is not None) is mgr._plan_runs
        rows[2] = mgr.row_of("d")  # the same array: d (8 tokens, as c has now) for c
        lens = mgr.step_lens(rows, ones, zeros)  # each needs a third block of 4
        mgr.allocate_rows(["a", "b", "d"], rows, lens)
    assert managers[0].run_serial != managers[0].step_serial  # the full step took it
    assert state(managers[0]) == state(managers[1])


def _broken_runs(monkeypatch: pytest.MonkeyPatch, breaks: Any) -> None:
    plan = KVCacheManager._plan_run

    def broken(self: KVCacheManager, rows: Any, lens: Any) -> None:
        plan(self, rows, lens)
        if self._run is not None:
            breaks(self._run)

    def every_seed() -> None:
        for seed in range(6):
            drive(seed, caching=False, steady_max=1)

    monkeypatch.setattr(KVCacheManager, "_plan_run", broken)
    with pytest.raises(AssertionError):
        every_seed()


def test_a_run_that_skips_its_releases_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken variant: a run plans the growth but forgets the windows' and chunks'
    releases, so their blocks stay in the tables."""

    def forget(run: Any) -> None:
        run.releases = [None] * len(run.releases)
        run.released = [0] * len(run.released)

    _broken_runs(monkeypatch, forget)


def test_a_run_that_grows_a_step_late_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken variant: each step of a run fills the entries planned for the step before
    (the first step none), so a table lacks the block its new token goes to."""

    def late(run: Any) -> None:
        shifted: set[int] = set()  # (a growth twin shares its twin's entries)
        for entries in run.grows:
            if entries is not None and id(entries) not in shifted:
                shifted.add(id(entries))
                entries.bounds[:] = [0, *entries.bounds[:-1]]
                entries.row_bounds[:] = [0, *entries.row_bounds[:-1]]

    _broken_runs(monkeypatch, late)


# ----------------------------------------------- runs over prompts being named

DOCS = [[int(t) for t in np.random.default_rng(seed).integers(0, 4, size=48)] for seed in (3, 4)]
"""Shared prompt prefixes: arrivals hit the blocks of earlier requests."""


def canon(mgr: KVCacheManager) -> tuple[object, dict[int, int]]:
    """``state`` up to the blocks' ids, and that numbering: each block by its first
    place in the requests' tables. Pages count as available (free or cached): a name
    deferred in one manager and already made in the other (``CachedSlab.defer``) can
    leave a duplicate's page cached in the first until the names are made (``names``),
    and the two give pages back in other orders."""
    order: dict[int, int] = {}
    ids = sorted(mgr._rows)
    tables = {
        (g.group_id, rid): [b and order.setdefault(b, len(order) + 1) for b in table]
        for g in mgr.groups
        for rid in ids
        for table in [mgr.block_table(g.group_id, rid)]
    }
    pool = mgr.pool
    assert isinstance(pool, CachedPool)
    view = (
        {rid: mgr.row_of(rid) for rid in ids},
        tables,
        {rid: mgr.num_tokens(rid) for rid in ids},
        [mgr.step_width(g.group_id) for g in mgr.groups],
        pool.num_available,
    )
    return view, order


def names(mgr: KVCacheManager) -> tuple[object, ...]:
    """With every name made (a commit and a flush): ``canon``, the free pages, the
    cached ones (least recent first) and every cached group's map, blocks numbered as
    ``canon`` does (cached pages after the tables' blocks)."""
    assert mgr.prefix is not None
    mgr.prefix.commit()
    mgr.prefix.flush()
    view, order = canon(mgr)
    idle = [
        (mgr.cached_slabs.index(k), order.setdefault(page, len(order) + 1))
        for page, k in idle_pages(mgr).items()
    ]
    maps = {
        gid: {name: order[block] for name, block in slab.block_of.items()}
        for gid, slab in enumerate(mgr.cached_slabs)
        if slab is not None
    }
    return view, mgr.pool.num_free_blocks, idle, maps


def drive_tracked(seed: int, *, steps: int = 300) -> int:
    """Requests started from prefix matches (their prompt blocks named as they fill),
    each prompt in chunks of one size beside the others' decodes, on a manager with
    runs and one without (whose path the prefix machine of ``test_prefix_pool`` checks
    against a model); arrivals that hit earlier prompts, finishes, frees with tokens,
    discarded steps. After every step both hold the same tables, lengths and pages
    available; at random points, with every name made, the same free and cached pages
    and maps (``names``; blocks compared up to their ids), and a lookup's hits per
    group. Returns the run steps whose releases named blocks."""
    config = PrefixCachingConfig(enabled=True)
    spec_of = specs()
    layers = {k: spec_of[k] for k in ("full", "win", "chunk", "sink")}
    fast = KVCacheManager(group_layers(layers), num_blocks=700, prefix_caching=config)
    slow = KVCacheManager(group_layers(layers), num_blocks=700, prefix_caching=config)
    fast._steady_max = slow._steady_max = 1
    slow._plan_runs = False
    managers = (fast, slow)
    rng = random.Random(seed)
    prompts: dict[str, list[int]] = {}
    chunk: dict[str, int] = {}
    live: list[str] = []
    kept: dict[int, Any] = {id(fast): None, id(slow): None}
    serial = named_steps = 0

    def prompt() -> list[int]:
        doc = rng.choice(DOCS + [p for p in list(prompts.values())[-3:]])
        keep = rng.choice([len(doc), rng.randrange(len(doc) + 1)])
        return doc[:keep] + [rng.randrange(4) for _ in range(rng.randrange(1, 40))]

    for _ in range(steps):
        roll = rng.random()
        finished: list[str] = []
        arrivals: dict[str, list[int]] = {}
        if not live or (roll < 0.06 and len(live) < 4):
            serial += 1
            rid = f"r{serial}"
            arrivals[rid] = prompts[rid] = prompt()
            chunk[rid] = rng.randrange(2, 9)
        elif roll < 0.09 and len(live) > 1:
            finished.append(live.pop(rng.randrange(len(live))))
        elif roll < 0.11 and len(live) > 1:  # a free with its tokens, between steps
            rid = live.pop(rng.randrange(len(live)))
            held = fast.num_tokens(rid)
            tokens = prompts[rid] + [1] * (held - len(prompts[rid]))
            for mgr in managers:
                mgr.free_request(rid, tokens if held >= len(prompts[rid]) else None)
                kept[id(mgr)] = None
        elif roll < 0.20:  # a lookup: the same hit in both, group by group
            tokens = prompt()
            hits = [mgr.prefix.match(tokens) for mgr in managers if mgr.prefix is not None]
            assert [h.num_tokens for h in hits[:1]] == [h.num_tokens for h in hits[1:]]
            assert hits[0].group_hits == hits[1].group_hits
        elif roll < 0.25:
            assert names(fast) == names(slow)
        matches: dict[int, list[Any]] = {}
        for mgr in managers:
            assert mgr.prefix is not None
            matches[id(mgr)] = [mgr.prefix.match(arrivals[r]) for r in arrivals]
        live.extend(arrivals)
        batch: list[tuple[str, int]] = []
        for rid in live:
            start = fast.num_tokens(rid) if rid in fast else matches[id(fast)][0].num_tokens
            left = len(prompts[rid]) - start
            batch.append((rid, min(chunk[rid], left) if left > 0 else 1))
        ids = [rid for rid, _ in batch]
        num_new = np.array([n for _, n in batch], dtype=np.int64)
        took: list[bool] = []
        for mgr in managers:
            rows = kept[id(mgr)]
            if rows is None or arrivals or finished:
                rows = mgr.lookup_rows(ids)
                for i, rid in enumerate(ids):
                    if rid in finished:
                        rows[i] = -1
            start = np.array([m.num_tokens for m in matches[id(mgr)]] or [0], dtype=np.int64)
            new = rows < 0
            starts = np.zeros(len(ids), dtype=np.int64)
            starts[new] = start[: int(new.sum())]
            lens = mgr.step_lens(rows, num_new, np.zeros_like(num_new), starts)
            prefixes = [
                matches[id(mgr)][list(arrivals).index(r)] if r in arrivals else None for r in ids
            ]
            run = mgr._run
            names_before = bool(run is not None and run.release_names)
            try:
                mgr.allocate_rows(
                    ids, rows, lens, finished=finished, prefixes=prefixes if arrivals else None
                )
            except OutOfBlocksError:
                took.append(False)
                kept[id(mgr)] = None
                continue
            took.append(True)
            kept[id(mgr)] = rows
            if mgr is fast and names_before and mgr._run is run:
                named_steps += 1
        assert took[0] == took[1]
        if not took[0]:
            for rid in arrivals:  # refused: they arrive again later
                live.remove(rid)
            continue
        if rng.random() < 0.03:  # the step's model call failed
            for mgr in managers:
                assert mgr.prefix is not None
                mgr.prefix.discard()
        assert canon(fast)[0] == canon(slow)[0]
    assert names(fast) == names(slow)
    return named_steps


@pytest.mark.parametrize("seed", range(8))
def test_runs_over_named_prompts_end_every_step_where_the_full_step_does(seed: int) -> None:
    """Runs name a tracked prompt's blocks as they release them, and skip the commits
    that would only move watermarks: every page ends up free or cached as without runs,
    under the same names."""
    assert drive_tracked(seed) > 5


def _every_tracked_seed() -> None:
    for seed in range(8):
        drive_tracked(seed)


def test_a_run_whose_releases_name_nothing_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken variant: a run's releases give a prompt's blocks back unnamed (free, not
    cached)."""
    monkeypatch.setattr(PrefixCache, "defer_released", lambda self, gid, dead, names: None)
    with pytest.raises(AssertionError):
        _every_tracked_seed()


def test_a_run_that_leaves_commits_unmarking_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken variant: after a run, a row's commits still mark nothing, so the full
    step's window releases give its named blocks back free."""

    def forget(self: PrefixCache) -> None:
        self._release_rows = []

    monkeypatch.setattr(PrefixCache, "end_release_names", forget)
    with pytest.raises(AssertionError):
        _every_tracked_seed()


def test_a_discard_that_drops_the_skipped_commits_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Broken variant: a step discarded after commits a run skipped loses the names of
    the tokens those steps computed."""
    discard = PrefixCache.discard

    def broken(self: PrefixCache) -> None:
        self.lagging = False
        discard(self)

    monkeypatch.setattr(PrefixCache, "discard", broken)
    with pytest.raises(AssertionError):
        _every_tracked_seed()


# ------------------------------------------------------------- presized tables


@pytest.mark.parametrize("hint", [(8, 1024), (2, 16)], ids=["presized", "outgrown"])
@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix-caching"])
def test_presized_tables_end_every_step_where_grown_tables_do(
    hint: tuple[int, int], caching: bool
) -> None:
    """``table_hint`` changes where the tables start, never what they hold: a manager
    given one (large enough, or outgrown by the schedule) ends every step where a
    manager whose tables start at 16 x 16 and grow does."""
    for seed in range(2):
        drive(seed, caching=caching, hint=hint)


def test_a_table_hint_sizes_the_tables_once() -> None:
    """Within the hint no table is ever copied: the arrays made at construction are
    the ones the last step writes."""
    mgr = KVCacheManager(groups(), num_blocks=4096, table_hint=(8, 1024))
    full = next(
        g.group_id
        for g in mgr.groups
        if g.spec.block_size == 4 and g.kind.value == "full_attention"
    )
    made = [t.table for t in mgr._tables]
    assert made[full].shape == (8, 1024 // 4)
    for step in range(300):
        ids = [f"r{i}" for i in range(8)]
        rows = mgr.lookup_rows(ids)
        num_new = np.full(8, 3 if step == 0 else 1, dtype=np.int64)
        mgr.allocate_rows(ids, rows, mgr.step_lens(rows, num_new, np.zeros_like(num_new)))
    assert mgr.num_tokens("r0") == 302
    assert all(t.table is m for t, m in zip(mgr._tables, made, strict=True))


@pytest.mark.parametrize("cap", [1 << 20, 4096, 64])
def test_presizing_stays_within_its_byte_bound(cap: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``TABLE_PRESIZE_BYTES`` a table starts smaller (16 rows of the hint's width,
    else 16 x 16), never bigger than the bound or than the plain start."""
    from attnkit.kv_cache import _manager

    monkeypatch.setattr(_manager, "TABLE_PRESIZE_BYTES", cap)
    mgr = KVCacheManager(groups(), num_blocks=4096, table_hint=(64, 4096))
    for tables in mgr._tables:
        assert tables.table.nbytes <= max(cap, 16 * 16 * 4)
        assert tables.table.shape[0] in (64, 16)


# ------------------------------------------------- the runtime's steady decode slots


def _runtime_specs() -> dict[str, Any]:
    """The attention kinds of ``specs`` with one block size (every slot rule)."""
    return {
        name: spec for name, spec in specs().items() if name in ("full", "win", "chunk", "sink")
    }


def drive_runtime_slots(seed: int, steps: int = 300, *, repeat_chunks: bool = False) -> int:
    """Random schedules (decodes, chunks, arrivals, finishes, a manager call behind the
    runtime's back) through a runtime; after every step each group's offsets and
    computed tokens must be those of the schedule (counted here), and its slot mapping
    the slot of each token read from its block table (block ``pos // bs`` of the
    request's row, offset ``pos % bs``; ``pos`` shifted by a sink kind's sink tokens).
    Returns the group-steps whose slots came from the last step's (with
    ``repeat_chunks``, chunks that go on at one size: the steps with a chunk that a run
    of the manager took)."""
    from attnkit import AttentionConfig, AttentionLayerParams, AttentionRuntime, ScheduledRequest

    specs = _runtime_specs()
    sinks = torch.zeros(3, 1, 8)
    rt = AttentionRuntime(
        specs,
        AttentionConfig(backend="reference"),
        device="cpu",
        memory_budget_bytes=1 << 22,
        layer_params={"sink": AttentionLayerParams(num_heads=1, sink_key=sinks, sink_value=sinks)},
    )
    made = 0
    slots_of = rt._slots

    def counting(gid: int, rules: Any, spec: Any, table: Any, shared: Any, lens: Any) -> Any:
        nonlocal made
        last = rt._decode_slots.get(gid)
        made += int(shared.steady and last is not None and last[0] == shared.serial - 1)
        return slots_of(gid, rules, spec, table, shared, lens)

    rt._slots = counting  # type: ignore[method-assign]  # counts the reuses
    if repeat_chunks:
        rt.manager._steady_max = 1  # (batches of 2 or more take runs)
    schedule = Schedule(seed, max_live=4, repeat_chunks=repeat_chunks)
    live = schedule.live
    held: dict[str, int] = {}  # tokens each request holds, counted from the schedule
    runs = 0
    for _ in range(steps):
        finished, chunk, roll = schedule.next()
        if not finished and not chunk and roll < 0.11:
            # behind the runtime's back: the manager steps one request
            rid = schedule.rng.choice(live)
            rt.manager.allocate_step([(rid, 1, 0)])
            held[rid] = held.get(rid, 0) + 1
        for rid in finished:
            del held[rid]
        batch = rt.begin_step(
            [ScheduledRequest(r, chunk.get(r, 1)) for r in live], finished=finished
        )
        runs += bool(chunk) and rt.manager.run_serial == rt.manager.step_serial
        new = [chunk.get(r, 1) for r in batch.order]
        offsets = [0, *itertools.accumulate(new)]
        had = [held.get(r, 0) for r in batch.order]
        for r, n in zip(batch.order, new, strict=True):
            held[r] = held.get(r, 0) + n
        for entry in rt._groups:
            cm, spec = entry.common, entry.group.spec
            assert cm is not None
            assert cm.query_start_loc_cpu.tolist() == offsets
            assert cm.num_computed_tokens_cpu is not None
            assert cm.num_computed_tokens_cpu.tolist() == had
            table = cm.block_table_tensor.numpy()
            bs = spec.block_size
            shift = getattr(spec, "sink_len", 0)
            want: list[int] = []
            qsl = cm.query_start_loc_cpu.tolist()
            for b, computed in enumerate(cm.num_computed_tokens_cpu.tolist()):
                for t in range(qsl[b + 1] - qsl[b]):
                    pos = computed + t + shift
                    want.append(int(table[b, pos // bs]) * bs + pos % bs)
            assert cm.slot_mapping[: batch.num_tokens].tolist() == want, entry.group.kind
    return runs if repeat_chunks else made


@pytest.mark.parametrize("seed", range(4))
def test_the_steps_of_runs_have_the_schedule_s_offsets_and_slots(seed: int) -> None:
    """A step a run of the manager takes reuses the last step's offsets and each
    token's request, its positions moved on by its request's new tokens."""
    assert drive_runtime_slots(seed, repeat_chunks=True) > 5  # steps with a chunk


def test_runs_steps_whose_positions_stay_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken variant: a run's step takes the last step's token positions as they are
    (not moved on), so its slots are the last step's."""
    from attnkit.runtime import _step

    monkeypatch.setattr(
        _step._SharedStep, "step_of_token", lambda self, lens: np.zeros_like(self.token_req)
    )

    def every_seed() -> None:
        for seed in range(4):
            drive_runtime_slots(seed, repeat_chunks=True)

    with pytest.raises(AssertionError):
        every_seed()


@pytest.mark.parametrize("seed", range(4))
def test_steady_decode_slots_are_the_table_s_slots(seed: int) -> None:
    assert drive_runtime_slots(seed) > 50  # the last step's slots were reused


def test_steady_slots_taken_without_the_steady_state_are_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Broken variant: the last step's slots plus one whenever a decode step follows
    one, the steady state or not: a decode crossing a block boundary writes past its
    block."""
    real = KVCacheManager.allocate_rows

    def always_steady(self: KVCacheManager, *args: Any, **kwargs: Any) -> Any:
        rows = real(self, *args, **kwargs)
        self.steady_serial = self.step_serial
        return rows

    monkeypatch.setattr(KVCacheManager, "allocate_rows", always_steady)

    def every_seed() -> None:
        for seed in range(4):
            drive_runtime_slots(seed)

    with pytest.raises(AssertionError):
        every_seed()


def test_slots_of_a_step_the_runtime_did_not_see_are_not_reused() -> None:
    """The manager stepped behind the runtime's back, on the runtime's own rows (a
    steady step of its own): the runtime's next step is steady too, but its last
    slots are two allocations old, so they are not the base of this step's."""
    from attnkit import AttentionConfig, AttentionRuntime, ScheduledRequest

    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=F32)
    rt = AttentionRuntime(
        {"full": spec}, AttentionConfig(backend="reference"), device="cpu",
        memory_budget_bytes=1 << 20,
    )  # fmt: skip
    rt.begin_step([ScheduledRequest("a", 5)])
    rt.begin_step([ScheduledRequest("a", 1)])  # token 5, the look-ahead made (to 8)
    rows = rt._last_rows
    one = np.ones(1, dtype=np.int64)
    rt.manager.allocate_rows(["a"], rows, rt.manager.step_lens(rows, one, np.zeros_like(one)))
    assert rt.manager.steady_serial == rt.manager.step_serial  # it took the steady state
    rt.begin_step([ScheduledRequest("a", 1)])
    assert rt.manager.steady_serial == rt.manager.step_serial
    # Token 7 of "a" (token 6 went behind the runtime's back): block 1, offset 3.
    table = rt.block_table("full", "a")
    assert rt._groups[0].common.slot_mapping.tolist() == [table[1] * 4 + 3]
