"""``Engine`` on a hybrid model (state, full and sliding-window layers) with state
checkpoints (``state_checkpoints="step_end"``): prefill chunks end on checkpoint
boundaries, so later requests sharing a prefix hit; the same requests through an
engine whose runtime does not cache give the same tokens, and every step's logits equal
a dense recompute of the demo model."""

from __future__ import annotations

import random
from typing import Any

import pytest
from test_engine_prefix import SYSTEM, TOL, max_dense_error, model, run, tokens

from attnkit import AttentionConfig, BackendRegistry
from attnkit.demo import PRIORITIES, DemoModel
from attnkit.integrations import engine as engine_module
from attnkit.integrations.engine import Engine, FunctionModel, Request, SamplingParams
from attnkit.registry import BUILTIN_BACKENDS
from attnkit.runtime import AttentionRuntime

HYBRID = ("full", "gdn", "window")


def make_runtime(m: DemoModel, *, on: bool, prefer: str = "reference") -> AttentionRuntime:
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    caching = {"enabled": on, "state_checkpoints": "step_end"} if on else {}
    config = AttentionConfig.model_validate(
        {"prefix_caching": caching, "max_num_batched_tokens": 256}, context={"registry": reg}
    )
    priority = {"cpu": PRIORITIES[prefer]} if PRIORITIES[prefer] else None
    runtime = AttentionRuntime(
        m.specs,
        config,
        device="cpu",
        memory_budget_bytes=2**22,
        layer_params=m.params,
        registry=reg,
        priority=priority,
        cache_fill=float("nan"),  # a read of an unwritten slot poisons the logits
    )
    random.Random(0).shuffle(runtime.manager.pool._free)  # pages in any order
    return runtime


def checkpoint_scenario(prefer: str) -> None:
    m = model(HYBRID)
    runtime = make_runtime(m, on=True, prefer=prefer)
    on, on_engine = run(m, runtime)
    off, _ = run(m, make_runtime(m, on=False, prefer=prefer))
    assert on.outputs == off.outputs
    assert max_dense_error(m, on_engine, on) < TOL.atol * 10
    # a's first chunk ends on the boundary at 48 (of its 59 tokens), so b and c, which
    # share the 50-token system prompt, start from the checkpoint there.
    assert [s.num_cached_tokens for s in on.steps[1:3]] == [96, 0]
    assert on.steps[0].scheduled == (("a", 48),)
    stats = on_engine.prefix_stats()
    assert stats.admissions == 5
    assert stats.cached_tokens > 96  # the second turn and the repeat hit further
    assert runtime.prefix_cache_stats().checkpoints > 0


@pytest.mark.parametrize("prefer", ["reference", "default"])
def test_hybrid_hits_change_no_output(prefer: str) -> None:
    checkpoint_scenario(prefer)


def test_chunks_that_ignore_the_boundaries_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: chunks as without checkpoints leave none at 48."""

    def unaligned(live: Any, start: int, n: int, interval: int | None) -> int:
        return n

    monkeypatch.setattr(engine_module, "_aligned", unaligned)
    with pytest.raises(AssertionError):
        checkpoint_scenario("reference")


def test_the_first_chunk_ends_at_the_junction() -> None:
    """A request whose attention blocks are cached past its last checkpoint ends its
    first chunk there, so the next one with that prefix hits all of it."""
    m = model(HYBRID)
    runtime = make_runtime(m, on=True)

    def call(batch: Any, token_ids: Any, positions: Any) -> Any:
        return m.logits(m.forward_step(runtime, token_ids, positions=positions))

    e = Engine(FunctionModel(runtime, call), max_tokens_per_step=256)
    shared = (*SYSTEM, *tokens(14, seed=6))  # 64 tokens
    e.submit(Request("x", (*shared, *tokens(40, seed=7)), SamplingParams(max_new_tokens=1)))
    e.run()  # one chunk of 104 ends at 96: a checkpoint at 96 only
    junction = runtime.match_prefix((*shared, *tokens(20, seed=8)))
    assert (junction.num_tokens, junction.checkpoint_junction) == (0, 64), junction.explain()
    e.submit(Request("y", (*shared, *tokens(20, seed=8)), SamplingParams(max_new_tokens=1)))
    result = e.run()
    assert result.steps[0].scheduled == (("y", 64),)  # ends at the junction
    assert runtime.match_prefix((*shared, *tokens(5, seed=9))).num_tokens == 64
