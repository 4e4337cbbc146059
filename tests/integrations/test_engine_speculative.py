"""``Engine`` with prompt-lookup drafting (``PromptLookup``) and greedy verification: the
tokens equal greedy decoding without drafts on the demo models (attention only, and a
hybrid with a Gated DeltaNet and a Mamba2 layer, whose states are rolled back) and on
the transformers families; the steps without drafts still match a dense recompute;
an engine that keeps more drafts than the model agrees with is caught."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from test_engine_prefix import TOL, model

from attnkit import AttentionConfig, BackendRegistry
from attnkit.demo import PRIORITIES, DemoModel
from attnkit.errors import InvalidArgumentError
from attnkit.integrations import engine as engine_module
from attnkit.integrations.engine import (
    Engine,
    EngineResult,
    FunctionModel,
    PromptLookup,
    SamplingParams,
)
from attnkit.registry import BUILTIN_BACKENDS
from attnkit.runtime import AttentionRuntime, StepBatch

K = 4
LAYOUTS = {
    "attention": ("full", "window"),
    "hybrid": ("full", "gdn", "window", "mamba"),
}


def make_runtime(m: DemoModel, prefer: str, k: int) -> AttentionRuntime:
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    config = AttentionConfig.model_validate(
        {"max_num_batched_tokens": 256, "num_speculative_tokens": k, "max_num_reqs": 8},
        context={"registry": reg},
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
    random.Random(0).shuffle(runtime.manager.pool._free)
    return runtime


def prompts() -> dict[str, list[int]]:
    """Repetitive text: short patterns repeated, which prompt lookup drafts from."""
    g = torch.Generator().manual_seed(3)
    out: dict[str, list[int]] = {}
    for i, (width, times) in enumerate([(5, 6), (3, 9), (7, 4)]):
        pattern = torch.randint(0, 64, (width,), generator=g).tolist()
        out[f"r{i}"] = pattern * times
    return out


def serve(m: DemoModel, prefer: str, drafter: PromptLookup | None) -> tuple[EngineResult, Engine]:
    runtime = make_runtime(m, prefer, K)

    def call(batch: StepBatch, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return m.logits(m.forward_step(runtime, token_ids, positions=positions))

    e = Engine(
        FunctionModel(runtime, call), max_tokens_per_step=64, keep_logits=True, speculative=drafter
    )
    for rid, prompt in prompts().items():
        e.add_request(rid, prompt, SamplingParams(max_new_tokens=20))
    return e.run(), e


def dense_error_without_drafts(m: DemoModel, e: Engine, result: EngineResult) -> float:
    """The steps that verified no draft against a dense recompute (a verify step's
    rows past its accepted drafts saw rejected tokens, so they are left out)."""
    worst = 0.0
    for step in result.steps:
        if step.num_draft_tokens or step.logits is None:
            continue
        for rid, rows in step.logits.items():
            full = e._done[rid].tokens
            dense = m.logits(m.forward_dense(torch.tensor(full[:-1])))
            expected = dense[rows.start : rows.start + rows.logits.shape[0]]
            worst = max(worst, float((rows.logits - expected).abs().max()))
    return worst


@pytest.mark.parametrize("prefer", ["reference", "default"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_drafting_keeps_greedy_tokens(layout: str, prefer: str) -> None:
    m = model(LAYOUTS[layout])
    plain, _ = serve(m, prefer, None)
    drafted, e = serve(m, prefer, PromptLookup(K))
    assert drafted.outputs == plain.outputs
    stats = e.speculative_stats()
    assert stats.draft_tokens > 0
    assert stats.accepted_tokens > 0, "repetitive prompts: some drafts are right"
    assert stats.tokens_per_step > 1.0
    assert 0.0 < stats.acceptance_rate <= 1.0
    assert len(drafted.steps) < len(plain.steps)
    assert dense_error_without_drafts(m, e, drafted) < TOL.atol * 10
    assert sum(s.num_accepted_tokens for s in drafted.steps) == stats.accepted_tokens


def test_keeping_unverified_drafts_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that keeps every draft (no verification) changes the tokens."""
    original = engine_module.Engine._verify

    def trusting(self: Engine, runtime: Any, batch: Any, logits: torch.Tensor) -> Any:
        verified = original(self, runtime, batch, logits)
        return {rid: [*self._live[rid].drafts, picks[-1]] for rid, picks in verified.items()}

    m = model(LAYOUTS["attention"])
    plain, _ = serve(m, "reference", None)
    monkeypatch.setattr(engine_module.Engine, "_verify", trusting)
    drafted, _ = serve(m, "reference", PromptLookup(K))
    assert drafted.outputs != plain.outputs


def test_prompt_lookup_drafts_what_followed_the_last_ngram() -> None:
    lookup = PromptLookup(num_draft_tokens=3, max_ngram=2)
    assert lookup.propose([1, 2, 3, 4, 9, 1, 2], 8) == [3, 4, 9]
    assert lookup.propose([1, 2, 3, 4, 9, 1, 2], 2) == [3, 4]
    assert lookup.propose([5, 6, 7], 8) == []
    # The latest occurrence wins; an n-gram of 1 when 2 does not occur.
    assert lookup.propose([4, 1, 4, 2, 8, 4], 8) == [2, 8, 4]
    with pytest.raises(InvalidArgumentError, match="min_ngram"):
        PromptLookup(min_ngram=4, max_ngram=2)


def test_drafts_beyond_the_runtime_limit_are_refused() -> None:
    m = model(LAYOUTS["attention"])
    runtime = make_runtime(m, "reference", 2)
    with pytest.raises(InvalidArgumentError, match="num_speculative_tokens=2"):
        Engine(FunctionModel(runtime, lambda b, t, p: t), speculative=PromptLookup(3))


# ------------------------------------------------------- transformers families


@pytest.mark.parametrize("backend", ["reference", "cpu_attn"])
@pytest.mark.parametrize(
    "family",
    ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gpt_oss", "llama4_text"],
)
def test_transformers_families_keep_greedy_tokens(family: str, backend: str) -> None:
    pytest.importorskip("transformers")
    from test_hf_attach import _model

    from attnkit.integrations.transformers import attach

    pattern = [7, 19, 33, 4, 52]
    outputs = []
    for drafter in (None, PromptLookup(K)):
        attached = attach(
            _model(family),
            config=AttentionConfig(backend=backend, num_speculative_tokens=K),
            num_blocks=40,
            block_size=4 if backend == "reference" else 16,
            cache_fill=float("nan"),
        )
        e = Engine(attached, max_tokens_per_step=16, speculative=drafter)
        e.add_request("a", pattern * 3, SamplingParams(max_new_tokens=10))
        e.add_request("b", [9, 9, 9, 9, 9, 9], SamplingParams(max_new_tokens=8))
        outputs.append(e.run().outputs)
        if drafter is not None:
            assert e.speculative_stats().draft_tokens > 0
    assert outputs[0] == outputs[1]
