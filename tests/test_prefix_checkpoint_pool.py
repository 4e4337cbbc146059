"""State checkpoints in the block manager, against a brute-force model: a hypothesis
state machine drives arrivals with shared prefixes, chunked prefill, finishes, lookups,
discarded steps and resets on pools small enough to evict, with a fake copy of state
pages that moves each page's content (the tokens its state has seen). After every
rule: every checkpoint holds the state its name describes, pages are free, held or
idle and nothing leaks, a step's checkpoints exist unless the pool evicted or skipped
them, and every lookup's hit is what the checkpoints and attention blocks allow; a
hit's state page holds the checkpoint's state; a rejected step changes nothing."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
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

from attnkit import OutOfBlocksError
from attnkit.config import PrefixCachingConfig
from attnkit.kv_cache import (
    NULL_BLOCK,
    CachedPool,
    CheckpointStore,
    KVCacheManager,
    PrefixMatch,
    _cached,
    _manager,
    _prefix,
    group_layers,
)
from attnkit.prefix_cache import TokenLayout, block_names, get_hasher, prefix_root
from test_prefix_pool import MAMBA, full, window

HASHER = get_hasher("sha256")
ROOT = prefix_root(HASHER)
CONFIGS = {
    "full+state": {"a": full(), "s": MAMBA},
    "full+window+state": {"a": full(), "w": window(6), "s": MAMBA},
    "state only": {"s": MAMBA},
}
DOCS = [[int(t) for t in np.random.default_rng(seed).integers(0, 3, size=24)] for seed in (3, 4)]
"""Shared prompt prefixes."""

State = tuple[object, ...]  # a state page's content: the tokens its state has seen


@dataclasses.dataclass
class Req:
    tokens: list[int]
    computed: int
    tainted: bool = False


class CheckpointMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(group_layers({"a": full()}), 4)
        self.reqs: dict[str, Req] = {}
        self.content: dict[int, State] = {}
        self.expected: list[tuple[int, ...]] = []
        self.last_step: list[str] = []
        self.next_id = 0
        self.marker = 0

    @initialize(
        name=st.sampled_from(sorted(CONFIGS)),
        num_blocks=st.sampled_from([7, 10, 16, 40]),
        interval=st.sampled_from([None, 8]),
    )
    def init(self, name: str, num_blocks: int, interval: int | None) -> None:
        config = PrefixCachingConfig(
            enabled=True, state_checkpoints="step_end", checkpoint_interval=interval
        )
        self.mgr = KVCacheManager(group_layers(CONFIGS[name]), num_blocks, prefix_caching=config)
        self.p.copy_states = self.copy
        self.interval = self.p.checkpoint_interval
        # Default: the attention blocks' (4), or with none the state spec's block size (1).
        assert self.interval == (interval or (1 if name == "state only" else 4))
        self.sid = next(i for i, s in enumerate(self.mgr.checkpoint_stores) if s is not None)
        self.num_pages = num_blocks

    # ------------------------------------------------------------------ helpers

    @property
    def p(self) -> _prefix.PrefixCache:
        assert self.mgr.prefix is not None
        return self.mgr.prefix

    @property
    def stores(self) -> list[CheckpointStore]:
        return [s for s in self.mgr.checkpoint_stores if s is not None]

    def copy(self, gid: int, sources: list[int], destinations: list[int]) -> None:
        for src, dst in zip(sources, destinations, strict=True):
            self.content[dst] = self.content.get(src, ("never written", src))

    def state_page(self, rid: str, gid: int | None = None) -> int:
        return self.mgr.block_table(self.sid if gid is None else gid, rid)[0]

    def held_states(self, store: CheckpointStore) -> set[State]:
        return {self.content.get(page, ("none",)) for page in store.name_of}

    def counts(self) -> tuple[int, int]:
        return (
            sum(s.evictions for s in self.stores) + sum(s.skipped for s in self.stores),
            len(self.mgr.pool.idle) if isinstance(self.mgr.pool, CachedPool) else 0,
        )

    def committed(self, before: tuple[int, int]) -> None:
        """After a call that commits the last step: its checkpoints exist, unless a
        checkpoint was evicted or skipped since."""
        if self.counts()[0] == before[0]:
            for store in self.stores:
                for state in self.expected:
                    assert state in self.held_states(store), f"no checkpoint at {len(state)}"
        self.expected = []

    def prompt(self, data: st.DataObject) -> list[int]:
        doc = data.draw(st.sampled_from(DOCS))
        shared = data.draw(st.integers(0, len(doc)))
        own = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=40))
        return doc[:shared] + own

    def brute_hit(self, tokens: list[int], attention: int) -> int:
        """The longest prefix within ``attention`` tokens (what the attention groups
        serve) with a checkpoint in every state group."""
        best = 0
        for length in range(self.interval, min(len(tokens) - 1, attention) + 1, self.interval):
            if all(tuple(tokens[:length]) in self.held_states(s) for s in self.stores):
                best = length
        return best

    def check_match(self, match: PrefixMatch, tokens: list[int]) -> None:
        state_own = match.group_hits[self.sid].length
        assert state_own == self.brute_hit(tokens, len(tokens)), match.explain()
        hit = match.num_tokens
        for store in self.stores:
            assert hit == 0 or tuple(tokens[:hit]) in self.held_states(store), match.explain()
        kinds = [g.kind.value for g in self.mgr.groups]
        if "sliding_window" not in kinds:  # full attention serves every length below its own
            others = [h.length for i, h in enumerate(match.group_hits) if i != self.sid]
            attention = min(others, default=len(tokens))
            assert hit == self.brute_hit(tokens, attention), match.explain()
        else:
            assert hit <= state_own, match.explain()

    def predict_fit(self, chunks: list[tuple[str, int]], match: PrefixMatch | None) -> bool | None:
        """Whether the step fits, counted from the model (``None`` with a window group,
        whose releases the model does not count): every block is a page; a step takes
        one per new attention block and one state page per new request, from the free
        and idle pages less the idle ones its hit takes (attention blocks no live
        request holds, and one checkpoint per state group, kept while it restores)."""
        groups = self.mgr.groups
        if any(g.kind.value == "sliding_window" for g in groups):
            return None
        pool = self.mgr.pool
        assert isinstance(pool, CachedPool)
        held = {
            b
            for rid in self.reqs
            if rid in self.mgr
            for g in groups
            for b in self.mgr.block_table(g.group_id, rid)
        }
        taken = 0
        need = self.need_of(chunks)
        if match is not None:
            taken = self.taken_by(match, held)
        return need <= len(pool._free) + len(pool.idle) - taken

    def need_of(self, chunks: list[tuple[str, int]]) -> int:
        """The pages ``chunks`` take (every block a page): one per new attention block,
        one state page per new request and state group."""
        need = 0
        for rid, n in chunks:
            req = self.reqs[rid]
            new = rid not in self.mgr
            for g in self.mgr.groups:
                if g.kind.value == "mamba":
                    need += 1 if new else 0
                    continue
                bs = g.spec.block_size
                need += -(-(req.computed + n) // bs) - -(-req.computed // bs)
        return need

    def taken_by(self, match: PrefixMatch, held: set[int] | None = None) -> int:
        """The idle pages a hit takes out of the evictable ones: its attention blocks
        no live request holds, and a checkpoint per state group (pinned)."""
        if not match.num_tokens:
            return 0
        groups = self.mgr.groups
        if held is None:
            held = {
                b
                for rid in self.reqs
                if rid in self.mgr
                for g in groups
                for b in self.mgr.block_table(g.group_id, rid)
            }
        taken = 0
        for g in groups:
            if g.kind.value == "mamba":
                taken += 1
            else:
                names = match.block_names(g.group_id)[: match.num_tokens // g.spec.block_size]
                slab = self.mgr.cached_slabs[g.group_id]
                assert slab is not None
                taken += sum(1 for m in names if slab.block_of[m] not in held)
        return taken

    def snapshot(self) -> State:
        pool = self.mgr.pool
        assert isinstance(pool, CachedPool)
        return (
            tuple(pool._free),
            tuple(pool.idle),
            tuple(tuple(s.block_of.items()) for s in self.stores),
            tuple(
                None if s is None else (s.refs.tobytes(), tuple(s.block_of.items()))
                for s in self.mgr.cached_slabs
            ),
            dict(self.content),
            len(self.mgr),
        )

    # ------------------------------------------------------------------ rules

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        tokens = self.prompt(data)
        before = self.counts()
        match = self.p.match(tokens)
        self.committed(before)
        self.check_match(match, tokens)

    @rule(data=st.data(), arrive=st.booleans())
    def step(self, data: st.DataObject, arrive: bool) -> None:
        chunks: list[tuple[str, int]] = []
        matches: list[PrefixMatch | None] = []
        for rid, req in self.reqs.items():
            left = len(req.tokens) - req.computed
            if left and data.draw(st.booleans()):
                chunks.append((rid, data.draw(st.integers(1, left))))
                matches.append(None)
        new: str | None = None
        if arrive or not chunks:
            tokens = self.prompt(data)
            before = self.counts()
            match = self.p.match(tokens)
            self.committed(before)
            self.check_match(match, tokens)
            new = f"r{self.next_id}"
            self.next_id += 1
            self.reqs[new] = Req(tokens, match.num_tokens)
            left = len(tokens) - match.num_tokens
            to = match.checkpoint_junction if data.draw(st.booleans()) else 0
            n = to - match.num_tokens if to > match.num_tokens else data.draw(st.integers(1, left))
            kinds = [g.kind.value for g in self.mgr.groups]
            if (
                match.num_tokens
                and kinds.count("full_attention") == 1
                and "sliding_window" not in kinds
                and data.draw(st.booleans())
            ):  # a chunk that needs every page the step can have, or one more
                pool = self.mgr.pool
                assert isinstance(pool, CachedPool)
                room = len(pool._free) + len(pool.idle) - self.taken_by(match)
                room -= self.need_of(chunks)  # the running requests' chunks
                blocks = room - kinds.count("mamba") + data.draw(st.integers(0, 1))
                if 0 < 4 * blocks <= left:
                    n = 4 * blocks
            chunks.append((new, n))
            matches.append(match)
        before = self.counts()
        if self.p.pending:  # the last step is done (what the step's call does first)
            self.p.commit()
        self.committed(before)
        if self.p.unflushed:
            self.p.flush()
        state = self.snapshot()
        before = self.counts()
        fits = self.predict_fit(chunks, matches[-1] if new is not None else None)
        try:
            self.mgr.allocate_step([(rid, n, 0) for rid, n in chunks], prefixes=matches)
        except OutOfBlocksError:
            if new is not None:
                del self.reqs[new]
            assert self.snapshot() == state, "a rejected step changed the manager"
            assert fits is not True, "a step that fits was refused"
            return
        assert fits is not False, "a step that does not fit was let through"
        self.committed(before)
        if new is not None and matches[-1] is not None and matches[-1].num_tokens:
            hit = matches[-1].num_tokens
            for gid, store in enumerate(self.mgr.checkpoint_stores):
                if store is not None:
                    got = self.content.get(self.state_page(new, gid))
                    assert got == tuple(self.reqs[new].tokens[:hit]), "the hit's state"
                    # Its step never evicts it: it is the most recently used now.
                    assert got in self.held_states(store), "the hit's checkpoint was evicted"
                    page = next(
                        p for p, c in self.content.items() if p in store.name_of and c == got
                    )
                    assert list(self.mgr.pool.idle)[-1] == page or len(self.stores) > 1
        # The model runs the step: each state page has seen the tokens computed.
        for rid, n in chunks:
            req = self.reqs[rid]
            req.computed += n
            for gid, store in enumerate(self.mgr.checkpoint_stores):
                if store is not None:
                    self.content[self.state_page(rid, gid)] = tuple(req.tokens[: req.computed])
            if req.computed % self.interval == 0 and not req.tainted:
                self.expected.append(tuple(req.tokens[: req.computed]))
        self.last_step = [rid for rid, _ in chunks]

    @precondition(lambda self: bool(self.last_step))
    @rule()
    def discard(self) -> None:
        """The model call failed: the step's state pages hold nothing valid."""
        self.p.discard()
        for rid in self.last_step:
            if rid in self.reqs:
                self.reqs[rid].tainted = True
                for gid, store in enumerate(self.mgr.checkpoint_stores):
                    if store is not None:
                        self.marker += 1
                        self.content[self.state_page(rid, gid)] = ("garbage", self.marker)
        self.expected = []
        self.last_step = []

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        before = self.counts()
        self.mgr.free_request(rid)
        self.committed(before)
        del self.reqs[rid]

    @rule()
    def reset(self) -> None:
        self.p.reset()
        self.expected = []
        for req in self.reqs.values():
            req.tainted = True
        assert all(not s.name_of for s in self.stores)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def checkpoints_hold_the_state_their_name_says(self) -> None:
        layout = TokenLayout(self.interval)
        for store in self.stores:
            for name, page in store.block_of.items():
                state = self.content.get(page)
                assert state is not None, "a checkpoint page never written"
                assert all(isinstance(t, int) for t in state), f"a checkpoint of {state}"
                tokens = [int(t) for t in state if isinstance(t, int)]
                assert len(tokens) % self.interval == 0
                assert block_names(tokens, layout, HASHER, ROOT)[-1] == name

    @invariant()
    def pages_are_free_held_or_idle_and_nothing_leaks(self) -> None:
        pool = self.mgr.pool
        assert isinstance(pool, CachedPool)
        held: set[int] = set()
        for rid in self.reqs:
            for group in self.mgr.groups:
                for block in self.mgr.block_table(group.group_id, rid):
                    if block != NULL_BLOCK:
                        page = block // group.blocks_per_page
                        assert page not in pool.idle
                        held.add(page)
        checkpoints = {page for s in self.stores for page in s.name_of}
        assert not checkpoints & held, "a checkpoint page in a table"
        assert checkpoints <= set(pool.idle), "a checkpoint page that is not idle"
        for store in self.stores:
            assert not store._pinned, "a checkpoint left pinned"
        free = set(pool._free)
        assert not free & (held | set(pool.idle))
        assert free | held | set(pool.idle) == set(range(1, self.num_pages)), "a page leaked"


TestCheckpointMachine = CheckpointMachine.TestCase
TestCheckpointMachine.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---------------------------------------------------------------------------- broken variants

_take = _prefix.PrefixCache._take_checkpoints
_check = _cached.check_step


def _one_step_late(self: _prefix.PrefixCache) -> None:
    """Takes each step's checkpoints at the commit after next (the state advanced)."""
    late: list[Any] = getattr(self, "_late", [])
    self._late = list(self.pending_checkpoints)  # type: ignore[attr-defined]  # test-only stash
    self.pending_checkpoints[:] = late
    _take(self)


def _never_taken(self: _prefix.PrefixCache) -> None:
    self.pending_checkpoints.clear()


def _no_restore(self: _prefix.PrefixCache, hits: Any, rows: Any) -> None:
    for _, store in self._stores:
        store.unpin()


def _forgets_the_pins(pool: CachedPool, needs: Any, *, pinned: int = 0) -> None:
    """A step check that counts a hit's pinned checkpoint as evictable."""
    _check(pool, needs)


def _unpinned(self: CheckpointStore, pages: Any) -> None:
    """A hit that leaves its checkpoint evictable while the step is allocated."""


BROKEN: dict[str, tuple[object, str, Any]] = {
    "a checkpoint taken one step late": (_prefix.PrefixCache, "_take_checkpoints", _one_step_late),
    "no checkpoint taken": (_prefix.PrefixCache, "_take_checkpoints", _never_taken),
    "a hit that does not restore the state": (_prefix.PrefixCache, "restore", _no_restore),
    "a hit whose checkpoint can be evicted": (CheckpointStore, "pin", _unpinned),
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_the_machine_catches(broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    owner, name, replacement = BROKEN[broken]
    monkeypatch.setattr(owner, name, replacement)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            CheckpointMachine,
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


def exact_fit_scenario() -> None:
    """A hit on a checkpoint whose step needs every page the pool can give: one more
    page is refused (nothing changes), exactly as many fit."""
    config = PrefixCachingConfig(enabled=True, state_checkpoints="step_end")
    mgr = KVCacheManager(group_layers({"a": full(), "s": MAMBA}), 12, prefix_caching=config)
    assert mgr.prefix is not None
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    mgr.allocate_step([("a", 8, 0)], prefixes=[mgr.prefix.match(prompt)])
    mgr.free_request("a")  # commits: a checkpoint at 8; blocks 0, 1 named; all idle
    pool = mgr.pool
    assert isinstance(pool, CachedPool)
    assert (len(pool._free), len(pool.idle)) == (11 - 3, 3)
    long = [*prompt[:8], *range(40)]  # hits 8: 2 idle blocks and the checkpoint taken
    match = mgr.prefix.match(long)
    assert match.num_tokens == 8
    # Free and idle pages: 8 + 3 = 11, less the 3 the hit takes: 8 = 1 state + 7 blocks.
    before = (tuple(pool._free), tuple(pool.idle))
    with pytest.raises(OutOfBlocksError):
        mgr.allocate_step([("b", 32, 0)], prefixes=[match])  # 8 new blocks
    assert (tuple(pool._free), tuple(pool.idle)) == before
    mgr.allocate_step([("b", 28, 0)], prefixes=[match])  # 7 new blocks
    assert (len(pool._free), len(pool.idle)) == (0, 1)  # the checkpoint, kept


def test_a_hit_step_fits_exactly() -> None:
    exact_fit_scenario()


def test_a_check_that_counts_the_pinned_checkpoint_as_free_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_manager, "check_step", _forgets_the_pins)
    with pytest.raises(AssertionError):
        exact_fit_scenario()
