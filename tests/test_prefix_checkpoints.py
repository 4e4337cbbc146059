"""State checkpoints (``state_checkpoints="step_end"``): a step that ends a prompt's
tokens on a checkpoint boundary keeps a copy of every state layer's state, and a later
request with that prefix starts from it. Hits change no output on a hybrid model
(state, full and sliding-window layers) against the same sequences alone with caching
off; rejected calls change nothing; broken variants (a checkpoint taken one step late,
a hit that does not restore the state) are caught."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pydantic
import pytest
import torch

from attnkit import (
    AttentionConfig,
    InvalidArgumentError,
    OutOfBlocksError,
    PrefixMatch,
    ScheduledRequest,
    StalePrefixError,
)
from attnkit.kv_cache import CheckpointStore, _prefix
from attnkit.planner import PrefixPlan, plan_model
from attnkit.planner import _plan as planner_plan
from attnkit.prefix_cache import prefix_granularity
from attnkit.runtime import AttentionRuntime
from attnkit.testing.tolerances import tolerance_for
from test_prefix_runtime import Driver, make_runtime, manager_state, model, off_outputs, tokens

HYBRID = ("full", "gdn", "window")


def state_of(runtime: AttentionRuntime) -> tuple[object, ...]:
    """``manager_state`` with the checkpoint stores' names and the pinned pages."""
    stores = tuple(
        None if st is None else (tuple(st.block_of.items()), tuple(sorted(st._pinned)))
        for st in runtime.manager.checkpoint_stores
    )
    return (*manager_state(runtime), stores)


def run_a(d: Driver, chunks: Sequence[int]) -> None:
    """Request ``a``: 70 prompt tokens in ``chunks``, three decodes, freed with its
    tokens."""
    runtime = d.runtime
    d.tokens["a"] = tokens(70, seed=1)
    first, *rest = chunks
    d.step([("a", first)], {"a": runtime.match_prefix(d.tokens["a"])})
    for n in rest:
        d.step([("a", n)], {})
    for t in (5, 9, 11):  # three decodes (the tokens a sampler would pick)
        d.tokens["a"].append(t)
        d.step([("a", 1)], {})
    runtime.free(["a"], token_ids={"a": d.tokens["a"]})


def checkpoint_scenario(prefer: str, layout: tuple[str, ...] = HYBRID) -> None:
    m = model(layout)
    runtime = make_runtime(m, prefer=prefer, state_checkpoints="step_end")
    assert runtime.checkpoint_interval == 16
    tol = tolerance_for(torch.float32)
    d = Driver(m, runtime)
    run_a(d, (32, 32, 6))  # steps end at 32 and 64: two checkpoints per state group
    assert runtime.prefix_cache_stats().checkpoints == 2 * sum(
        st is not None for st in runtime.manager.checkpoint_stores
    )
    d.tokens["b"] = d.tokens["a"][:60] + tokens(6, seed=2)
    d.tokens["c"] = [*d.tokens["a"], 7, 7, 7, 7, 7]
    d.tokens["d"] = list(d.tokens["c"])
    hits: dict[str, PrefixMatch] = {"b": runtime.match_prefix(d.tokens["b"])}
    shared = runtime.match_prefix(d.tokens["c"])
    hits["c"] = hits["d"] = shared  # parallel sampling: both restore one checkpoint
    # b: attention holds blocks 0..2 (48 tokens), the state only a checkpoint at 32.
    assert hits["b"].num_tokens == 32, hits["b"].explain()
    assert "no state checkpoint at token" in hits["b"].explain()
    assert hits["b"].checkpoint_junction == 48
    assert shared.num_tokens == 64, shared.explain()
    served = {rid: match.num_tokens for rid, match in hits.items()}
    # b's first chunk ends at the junction (48), so it leaves the checkpoint there.
    d.step([("b", 16), ("c", 14), ("d", 14)], hits)
    d.step([("b", 66 - 48)], {})
    d.tokens["e"] = d.tokens["a"][:60] + tokens(9, seed=3)
    hits["e"] = runtime.match_prefix(d.tokens["e"])
    served["e"] = hits["e"].num_tokens
    assert served["e"] == 48, hits["e"].explain()
    d.step([("e", len(d.tokens["e"]) - 48)], {"e": hits["e"]})
    expected = off_outputs(m, prefer, {rid: d.tokens[rid] for rid in "bcde"})
    for rid in "bcde":
        rows = sorted(d.out[rid])
        assert rows == list(range(served[rid], len(d.tokens[rid])))
        got = torch.stack([d.out[rid][i] for i in rows])
        torch.testing.assert_close(got, expected[rid][served[rid] :], atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("prefer", ["reference", "default"])
def test_checkpoint_hits_change_no_output(prefer: str) -> None:
    checkpoint_scenario(prefer)


def test_every_state_type_restores() -> None:
    """Mamba2, Mamba1, linear attention and short conv (with full attention) too."""
    checkpoint_scenario("reference", ("full", "mamba", "mamba1", "linear", "short_conv"))


_take = _prefix.PrefixCache._take_checkpoints
_restore = _prefix.PrefixCache.restore


def _one_step_late(self: _prefix.PrefixCache) -> None:
    """Takes each step's checkpoints at the commit after next (the state has advanced)."""
    late: list[Any] = getattr(self, "_late", [])
    self._late = list(self.pending_checkpoints)  # type: ignore[attr-defined]  # test-only stash
    self.pending_checkpoints[:] = late
    _take(self)


def _no_restore(self: _prefix.PrefixCache, hits: Any, rows: Any) -> None:
    """A hit that leaves the new request's state page as it was."""
    for _, store in self._stores:
        store.unpin()


@pytest.mark.parametrize(
    ("name", "broken"), [("_take_checkpoints", _one_step_late), ("restore", _no_restore)]
)
def test_broken_checkpoints_are_caught(
    monkeypatch: pytest.MonkeyPatch, name: str, broken: Any
) -> None:
    monkeypatch.setattr(_prefix.PrefixCache, name, broken)
    with pytest.raises(AssertionError):
        checkpoint_scenario("reference")


def test_discard_step_takes_no_checkpoint() -> None:
    m = model(HYBRID)
    runtime = make_runtime(m, state_checkpoints="step_end")
    prompt = tokens(40, seed=4)
    runtime.begin_step([ScheduledRequest("a", 32, prefix=runtime.match_prefix(prompt))])
    runtime.discard_step()  # the model call failed: the state holds nothing valid
    assert runtime.match_prefix(prompt).num_tokens == 0
    assert runtime.prefix_cache_stats().checkpoints == 0


def test_out_of_blocks_with_a_checkpoint_hit_changes_nothing() -> None:
    m = model(("gdn", "full"))
    runtime = make_runtime(m, state_checkpoints="step_end", pages=12)
    d = Driver(m, runtime)
    d.tokens["a"] = tokens(65, seed=5)
    d.step([("a", 64)], {"a": runtime.match_prefix(d.tokens["a"])})
    d.step([("a", 1)], {})  # the checkpoint at 64 is taken at this step's begin
    runtime.free(["a"])
    prompt = d.tokens["a"][:64] + tokens(800, seed=6)
    match = runtime.match_prefix(prompt)
    assert match.num_tokens == 64, match.explain()
    before = state_of(runtime), runtime.prefix_cache_stats()
    with pytest.raises(OutOfBlocksError, match="state checkpoints they restore from: 1"):
        runtime.begin_step([ScheduledRequest("b", 800, prefix=match)])
    assert (state_of(runtime), runtime.prefix_cache_stats()) == before
    d.tokens["b"] = prompt
    d.step([("b", 16)], {"b": match})
    assert runtime.manager.num_tokens("b") == 80


def test_an_evicted_checkpoint_is_refused_and_changes_nothing() -> None:
    m = model(("gdn", "full"))
    runtime = make_runtime(m, state_checkpoints="step_end", pages=12)
    d = Driver(m, runtime)
    d.tokens["a"] = tokens(33, seed=7)
    d.step([("a", 32)], {"a": runtime.match_prefix(d.tokens["a"])})
    runtime.free(["a"])  # commits: the checkpoint at 32 is taken
    match = runtime.match_prefix(d.tokens["a"])
    assert match.num_tokens == 32, match.explain()
    store = runtime.manager.checkpoint_stores[0]
    assert isinstance(store, CheckpointStore)
    (page,) = store.name_of
    runtime.manager.pool.take(len(runtime.manager.pool._free))  # the pool runs dry
    # The next take reclaims the least recently idle page: evict until it is the checkpoint.
    while page in runtime.manager.pool.idle:
        runtime.manager.pool.take(1)
    before = state_of(runtime)
    with pytest.raises(StalePrefixError, match="state checkpoint at token 32"):
        runtime.begin_step([ScheduledRequest("a2", 1, prefix=match)])
    assert state_of(runtime) == before


def test_reset_drops_the_checkpoints() -> None:
    m = model(HYBRID)
    runtime = make_runtime(m, state_checkpoints="step_end")
    d = Driver(m, runtime)
    d.tokens["a"] = tokens(40, seed=8)
    d.step([("a", 32)], {"a": runtime.match_prefix(d.tokens["a"])})
    assert runtime.match_prefix(d.tokens["a"]).num_tokens == 32
    free = len(runtime.manager.pool._free)
    assert runtime.reset_prefix_cache() >= 1
    assert runtime.prefix_cache_stats().checkpoints == 0
    assert len(runtime.manager.pool._free) > free  # the checkpoint pages went back
    assert runtime.match_prefix(d.tokens["a"]).num_tokens == 0


def test_memory_report_and_stats_count_checkpoints() -> None:
    m = model(HYBRID)
    runtime = make_runtime(m, state_checkpoints="step_end")
    d = Driver(m, runtime)
    d.tokens["a"] = tokens(40, seed=9)
    d.step([("a", 16)], {"a": runtime.match_prefix(d.tokens["a"])})
    d.step([("a", 16)], {})
    runtime.free(["a"])
    report = runtime.memory_report()
    state = report.groups[1]
    assert (state.cached_blocks, state.cached_free_blocks) == (2, 2)
    assert state.cached_bytes == 2 * runtime.page_size_bytes
    assert "state checkpoints: 2 page(s)" in report.describe()
    assert "2 state checkpoints" in str(runtime.prefix_cache_stats())


def test_the_config_is_checked() -> None:
    with pytest.raises(pydantic.ValidationError, match="every_block' is not supported"):
        AttentionConfig(prefix_caching={"state_checkpoints": "every_block"})
    with pytest.raises(pydantic.ValidationError, match="checkpoint_interval must be an int >= 1"):
        AttentionConfig(prefix_caching={"checkpoint_interval": 0})
    with pytest.raises(pydantic.ValidationError):
        AttentionConfig(prefix_caching={"state_checkpoints": "often"})
    m = model(HYBRID)
    with pytest.raises(
        InvalidArgumentError,
        match=r"checkpoint_interval must be a multiple of every attention group's kernel "
        r"block size .* got 24; not a multiple of group 0 \(full_attention\): 16",
    ):
        make_runtime(m, state_checkpoints="step_end", checkpoint_interval=24)
    wide = make_runtime(m, state_checkpoints="step_end", checkpoint_interval=32)
    assert wide.checkpoint_interval == 32
    assert str(wide.manager.prefix.granularity if wide.manager.prefix else None).startswith(
        "minimum cacheable prefix 32 tokens"
    )
    assert make_runtime(m).checkpoint_interval is None  # "none": no checkpoints
    config = AttentionConfig(prefix_caching={"enabled": True, "state_checkpoints": "step_end"})
    assert "state checkpoints step_end" in config.describe()


# ---------------------------------------------------------------------------- the plan


def plan_says_what_the_runtime_does(layout: tuple[str, ...], policy: str) -> None:
    """``plan_model``'s minimum cacheable prefix is what a runtime built with the same
    config serves: a prompt one token past the minimum hits exactly the minimum once a
    request computed it (in a chunk ending there); with no minimum, nothing hits."""
    m = model(layout)
    config = AttentionConfig(prefix_caching={"enabled": True, "state_checkpoints": policy})
    prefix = plan_model(m.specs, config, device="cpu").prefix
    assert prefix is not None
    runtime = make_runtime(m, state_checkpoints=policy)
    d = Driver(m, runtime)
    length = prefix.minimum or 32
    d.tokens["a"] = tokens(length + 1, seed=10)
    d.step([("a", length)], {"a": runtime.match_prefix(d.tokens["a"])})
    d.step([("a", 1)], {})
    served = runtime.match_prefix(d.tokens["a"]).num_tokens
    assert served == (prefix.minimum or 0)
    if prefix.minimum is not None and prefix.minimum > 1:
        shorter = runtime.match_prefix(d.tokens["a"][: prefix.minimum])
        assert shorter.num_tokens == 0  # below the minimum nothing hits
        assert "minimum cacheable prefix" in shorter.explain()
    else:
        assert prefix.why_none is not None


PLAN_CASES = [
    (("full", "window"), "none"),
    (HYBRID, "none"),
    (HYBRID, "step_end"),
    (("gdn", "mamba"), "step_end"),
]


@pytest.mark.parametrize(("layout", "policy"), PLAN_CASES)
def test_the_plan_states_the_minimum_cacheable_prefix(layout: tuple[str, ...], policy: str) -> None:
    plan_says_what_the_runtime_does(layout, policy)


def test_a_plan_that_forgets_the_policy_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: a plan that claims the attention groups' minimum whatever
    the state layers keep."""
    real = planner_plan._prefix_plan

    def forgetful(specs: Any, config: AttentionConfig, block: int) -> PrefixPlan:
        honest = real(specs, config, block)
        return dataclasses.replace(honest, minimum=prefix_granularity(specs).minimum, why_none=None)

    monkeypatch.setattr(planner_plan, "_prefix_plan", forgetful)
    with pytest.raises(AssertionError):
        plan_says_what_the_runtime_does(HYBRID, "none")


def test_the_plan_report_names_the_policy() -> None:
    m = model(HYBRID)
    off = plan_model(m.specs, AttentionConfig(), device="cpu")
    assert off.prefix is not None
    assert off.prefix.minimum is None
    assert "state_checkpoints is 'none'" in (off.prefix.why_none or "")
    assert off.prefix.minimum_with_checkpoints == 16
    on = plan_model(
        m.specs,
        AttentionConfig(
            prefix_caching={"state_checkpoints": "step_end", "checkpoint_interval": 32}
        ),
        device="cpu",
        num_blocks=64,
    )
    assert on.prefix is not None
    assert (on.prefix.minimum, on.prefix.checkpoint_interval) == (32, 32)
    assert on.prefix.checkpoint_bytes == on.bytes_per_block  # one state group: one block
    assert on.to_json()["prefix_cache"] == dataclasses.asdict(on.prefix)
