"""``Engine`` with prefix caching: every admitted request is looked up and starts from
its hit. The same requests through an engine whose runtime caches and one whose runtime
does not give the same tokens, and logits within the tolerance table; every step's
logits also equal a dense recompute of the demo model (no cache at all). Models with
state layers never hit (no state checkpoints yet) and the stats say why."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from attnkit import AttentionConfig, BackendRegistry
from attnkit.demo import PRIORITIES, DemoModel
from attnkit.errors import ArgumentTypeError
from attnkit.integrations.engine import (
    Engine,
    EngineResult,
    FunctionModel,
    Request,
    SamplingParams,
)
from attnkit.registry import BUILTIN_BACKENDS
from attnkit.runtime import AttentionRuntime, StepBatch
from attnkit.testing.tolerances import tolerance_for
from prefix_variants import misplace_hits

BS = 16
TOL = tolerance_for(torch.float32)


def model(layout: Sequence[str]) -> DemoModel:
    return DemoModel(layout=layout, block_size=BS, window=10, chunk=16, num_kv_heads=1)


def make_runtime(
    m: DemoModel, *, on: bool, prefer: str = "reference", budget: int = 2**22
) -> AttentionRuntime:
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    config = AttentionConfig.model_validate(
        {"prefix_caching": {"enabled": on}, "max_num_batched_tokens": 256},
        context={"registry": reg},
    )
    priority = {"cpu": PRIORITIES[prefer]} if PRIORITIES[prefer] else None
    runtime = AttentionRuntime(
        m.specs,
        config,
        device="cpu",
        memory_budget_bytes=budget,
        layer_params=m.params,
        registry=reg,
        priority=priority,
        cache_fill=float("nan"),  # a read of an unwritten slot poisons the logits
    )
    random.Random(0).shuffle(runtime.manager.pool._free)  # pages in any order
    return runtime


def engine(m: DemoModel, runtime: AttentionRuntime, **options: object) -> Engine:
    def call(batch: StepBatch, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return m.logits(m.forward_step(runtime, token_ids, positions=positions))

    return Engine(FunctionModel(runtime, call), max_tokens_per_step=64, keep_logits=True, **options)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = tokens(50, seed=1)  # a shared system prompt: 3 full blocks and 2 tokens


def run(m: DemoModel, runtime: AttentionRuntime, **options: object) -> tuple[EngineResult, Engine]:
    """Few-shot requests sharing the system prompt, a repeat of one of them, and a
    second turn of a chat that extends the first turn's prompt and answer."""
    e = engine(m, runtime, **options)
    b_prompt = (*SYSTEM, *tokens(21, seed=3))
    e.submit(Request("a", (*SYSTEM, *tokens(9, seed=2)), SamplingParams(max_new_tokens=12)))
    e.submit(Request("b", b_prompt, SamplingParams(max_new_tokens=5), 1))
    e.submit(Request("c", (*SYSTEM, *tokens(3, seed=4)), SamplingParams(max_new_tokens=4), 1))
    steps = [e.step() for _ in range(30)]
    assert "a" not in e._live  # its blocks (prompt and answer) are cached and free now
    answered = (*e._done["a"].tokens, *tokens(7, seed=5))
    e.submit(Request("a2", answered, SamplingParams(max_new_tokens=4)))
    e.submit(Request("b2", b_prompt, SamplingParams(max_new_tokens=5)))
    rest = e.run()
    return EngineResult(rest.outputs, rest.tokens, [*steps, *rest.steps]), e


def max_dense_error(m: DemoModel, e: Engine, result: EngineResult) -> float:
    worst = 0.0
    for step in result.steps:
        assert step.logits is not None
        for rid, rows in step.logits.items():
            full = e._done[rid].tokens
            dense = m.logits(m.forward_dense(torch.tensor(full[:-1])))
            expected = dense[rows.start : rows.start + rows.logits.shape[0]]
            worst = max(worst, float((rows.logits - expected).abs().max()))
    return worst


@pytest.mark.parametrize("prefer", ["reference", "default"])
def test_hits_change_no_output(prefer: str) -> None:
    """Full and sliding-window layers, on the reference and on cpu_attn (the CPU
    default): same tokens, close logits, and the hits really skipped prefill."""
    hit_scenario(prefer)


def test_a_hit_that_reads_the_wrong_blocks_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: the scenario's checks must see it."""
    misplace_hits(monkeypatch)
    with pytest.raises(AssertionError):
        hit_scenario("reference")


def hit_scenario(prefer: str) -> None:
    m = model(("full", "window", "full"))
    on_runtime = make_runtime(m, on=True, prefer=prefer)
    if prefer == "default":
        assert on_runtime.backend_for("layers.0").name == "cpu_attn"
    on, on_engine = run(m, on_runtime)
    off, off_engine = run(m, make_runtime(m, on=False, prefer=prefer))
    assert on.outputs == off.outputs
    assert max_dense_error(m, on_engine, on) < TOL.atol * 10
    # Logits of the rows both computed agree; the hits' rows were not computed.
    off_rows = {
        (s_rid, rows.start + i): row
        for step in off.steps
        for s_rid, rows in (step.logits or {}).items()
        for i, row in enumerate(rows.logits)
    }
    for step in on.steps:
        for rid, rows in (step.logits or {}).items():
            for i, row in enumerate(rows.logits):
                torch.testing.assert_close(
                    row, off_rows[(rid, rows.start + i)], atol=TOL.atol, rtol=TOL.rtol
                )
    stats = on_engine.prefix_stats()
    assert stats.enabled
    assert stats.why_off is None
    assert stats.admissions == 5
    # b and c hit the system prompt's 3 blocks, b2 b's prompt (4 blocks), a2 a's prompt
    # and answer (4 blocks); a hits nothing.
    assert stats.cached_tokens == 48 * 2 + 64 + 64
    saved = sum(s.num_prefill_tokens for s in off.steps) - sum(
        s.num_prefill_tokens for s in on.steps
    )
    assert saved == stats.cached_tokens == sum(s.num_cached_tokens for s in on.steps)
    assert 0 < stats.hit_rate < 1
    assert stats.cache is not None
    assert stats.cache.hit_tokens == stats.cached_tokens
    # Nothing leaked: every block is free (cached or not) once all requests finished.
    assert not on_runtime.manager._rows
    for slab in on_runtime.manager.cached_slabs:
        assert slab is None or int(slab.refs.sum()) == 0
    off_stats = off_engine.prefix_stats()
    assert not off_stats.enabled
    assert off_stats.cached_tokens == 0
    assert off_stats.why_off is not None
    assert "prefix_caching" in off_stats.why_off


def test_the_engine_option_turns_lookups_off() -> None:
    m = model(("full", "window"))
    runtime = make_runtime(m, on=True)
    result, e = run(m, runtime, prefix_caching=False)
    stats = e.prefix_stats()
    assert not stats.enabled
    assert stats.why_off == "turned off: Engine(prefix_caching=False)"
    assert stats.admissions == stats.cached_tokens == 0
    assert runtime.prefix_cache_stats().queries == 0
    assert all(s.num_cached_tokens == 0 for s in result.steps)
    with pytest.raises(ArgumentTypeError, match="prefix_caching must be a bool"):
        engine(m, runtime, prefix_caching="yes")


def test_state_layers_never_hit_and_the_stats_say_why() -> None:
    m = model(("full", "mamba"))
    on, on_engine = run(m, make_runtime(m, on=True))
    off, _ = run(m, make_runtime(m, on=False))
    assert on.outputs == off.outputs
    stats = on_engine.prefix_stats()
    assert stats.enabled
    assert stats.admissions == 5
    assert stats.cached_tokens == 0
    assert all(s.num_cached_tokens == 0 for s in on.steps)
    # The first request finds the cache empty; every later one has its attention
    # blocks cached and is stopped by the state layer alone.
    assert stats.misses == {"BlockNotCached": 1, "NoCheckpoint": 4}
    assert stats.last_miss is not None
    assert "no state checkpoint" in stats.last_miss
    assert max_dense_error(m, on_engine, on) < TOL.atol * 10


def test_preemption_with_hits_keeps_outputs() -> None:
    """A pool too small for every request at once: requests are preempted (their
    blocks freed with their tokens) and recompute from their hits."""
    m = model(("full", "window"))
    roomy, _ = run(m, make_runtime(m, on=False))
    probe = make_runtime(m, on=True)
    per_page = probe.memory_report().total_bytes // probe.num_blocks
    tight_runtime = make_runtime(m, on=True, budget=12 * per_page)
    tight, tight_engine = run(m, tight_runtime)
    assert tight.num_preemptions > 0
    assert tight.outputs == roomy.outputs
    assert max_dense_error(m, tight_engine, tight) < TOL.atol * 10
    assert tight_engine.prefix_stats().cached_tokens > 0
    for slab in tight_runtime.manager.cached_slabs:
        assert slab is None or int(slab.refs.sum()) == 0


def test_a_failing_model_call_caches_nothing_it_wrote() -> None:
    """The step whose model call failed is discarded: a later request with the same
    prompt does not hit the blocks that step would have filled."""
    m = model(("full",))
    runtime = make_runtime(m, on=True)
    fail = [True]

    def call(batch: StepBatch, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if fail[0]:
            fail[0] = False
            raise RuntimeError("boom")
        return m.logits(m.forward_step(runtime, token_ids, positions=positions))

    e = Engine(FunctionModel(runtime, call), max_tokens_per_step=64)
    prompt = tokens(40, seed=9)
    e.add_request("x", prompt, SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="boom"):
        e.step()
    assert runtime.match_prefix(prompt).num_tokens == 0  # nothing named
    e.add_request("y", prompt, SamplingParams(max_new_tokens=2), arrival_step=e.step_index + 3)
    result = e.run()
    assert result.outputs["x"] == result.outputs["y"]
    assert e.prefix_stats().cached_tokens == 32  # y hits what x computed again
