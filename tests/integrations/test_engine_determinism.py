"""``Engine(determinism=...)``: the level reaches the schedule. Below chunking
invariance a request's prompt is cut at fixed positions whatever else runs, so one
request's logits are the same bits alone and among others (a sliding-window layer on
cpu_attn at batch_invariant, whose blocked prefill walks a chunk's keys from its first
row's window); with the level off the budget the others leave moves its cuts, and the
bits differ (the control)."""

from __future__ import annotations

import pytest
import torch

from attnkit import AttentionConfig, AttentionLayerParams, SlidingWindowSpec
from attnkit.errors import InvalidArgumentError
from attnkit.integrations.engine import Engine, FunctionModel, Request, SamplingParams
from attnkit.runtime import AttentionRuntime, StepBatch

VOCAB, HEADS, KV_HEADS, D = 64, 4, 2, 64
SPEC = SlidingWindowSpec(
    block_size=16, num_kv_heads=KV_HEADS, head_size=D, dtype=torch.float32, sliding_window=40
)
_gen = torch.Generator().manual_seed(0)
TABLES = [torch.randn(VOCAB, h, D, generator=_gen) for h in (HEADS, KV_HEADS, KV_HEADS)]
POSITIONS = torch.randn(512, HEADS, D, generator=_gen)


def runtime(level: str) -> AttentionRuntime:
    config = AttentionConfig(
        backend="cpu_attn", determinism=level, max_num_batched_tokens=64, max_num_reqs=8
    )
    return AttentionRuntime(
        {"layers.0": SPEC},
        config,
        device="cpu",
        memory_budget_bytes=SPEC.page_size_bytes * 128,
        layer_params={"layers.0": AttentionLayerParams(num_heads=HEADS)},
    )


def engine(rt: AttentionRuntime, level: str) -> Engine:
    """One attention layer over row-wise inputs (table lookups, no matrix products), its
    output's first VOCAB values as the logits: the engine sees attention's bits only."""

    def call(batch: StepBatch, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        p = POSITIONS[positions]
        q, k, v = (t[token_ids] + p[:, : t.shape[1]] for t in TABLES)
        out = rt.forward("layers.0", q, k, v)
        return out.reshape(out.shape[0], -1)[:, :VOCAB]

    return Engine(FunctionModel(rt, call), keep_logits=True, determinism=level)


def target_rows(level: str, others: int) -> dict[int, torch.Tensor]:
    rt = runtime(level)
    e = engine(rt, level)
    prompt = torch.randint(0, VOCAB, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    # The others leave 2 tokens of the first step's budget of 64: with the level off the
    # target's prompt is cut 2 + 61 + 27 among them and 64 + 26 alone.
    for i, n in enumerate((10, 23, 29)[:others]):
        other = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(9 + i))
        e.submit(Request(f"o{i}", tuple(other.tolist()), SamplingParams(max_new_tokens=6)))
    e.submit(Request("x", tuple(prompt), SamplingParams(max_new_tokens=6)))
    result = e.run()
    rows: dict[int, torch.Tensor] = {}
    for step in result.steps:
        got = (step.logits or {}).get("x")
        if got is not None:
            for i in range(got.logits.shape[0]):
                rows[got.start + i] = got.logits[i]
    assert len(rows) == 90 + 6 - 1
    return rows


def differing(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> list[int]:
    return [p for p in sorted(a) if not torch.equal(a[p], b[p])]


def test_batch_invariant_engine_cuts_prompts_at_fixed_positions() -> None:
    alone = target_rows("batch_invariant", others=0)
    assert differing(target_rows("batch_invariant", others=3), alone) == []


def test_without_the_level_the_cuts_follow_the_others_and_the_bits_differ() -> None:
    alone = target_rows("none", others=0)
    assert differing(target_rows("none", others=3), alone) != []


def test_the_runtime_must_keep_the_engines_level() -> None:
    rt = runtime("none")
    with pytest.raises(InvalidArgumentError, match="determinism=batch_invariant needs a runtime"):
        engine(rt, "batch_invariant")
    e = engine(runtime("batch_invariant"), "batch_invariant")
    assert e.chunk_tokens == 57  # 64 - 8 + 1: beside a decode of each of 7 others
    assert e.prefix_stats().why_off is not None
