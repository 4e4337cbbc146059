"""Prefix caching through ``attach`` + ``Engine``: hits change no output, on every family
the transformers integration serves.

Each family's tiny random model (``test_hf_attach``'s configs: a window of 6, Llama 4's
chunk of 8, block 4) serves the same requests twice, through a runtime with prefix
caching on and one with it off: a first request, a second sharing its first 14 prompt
tokens, and a repeat of the first prompt, admitted once the first request's prompt
blocks are named (so they hit the shared blocks through every kind's hit rule: full
attention, the window, the chunk, sinks). Greedy tokens must be identical, every step's
logits must be transformers' eager logits within the tolerance table (the reference is
the model's own eager attention over each whole sequence), and the cached run must
really start requests from hits (tokens served from the cache, prefill skipped).
"""

from __future__ import annotations

import copy

import pytest
import torch

from attnkit import AttentionConfig
from attnkit.integrations.engine import Engine, EngineResult, SamplingParams
from prefix_variants import misplace_hits

tf = pytest.importorskip("transformers")

from test_hf_attach import FAMILIES, _model  # noqa: E402  (the family configs, after the skip)

from attnkit.integrations.transformers import (  # noqa: E402  (after the importorskip)
    TransformersAttachment,
    attach,
    check_against_eager,
)

BUDGET = 7  # tokens per step: prompts are chunked
SHARED = 14  # the shared prompt prefix: 3 full blocks of 4 and 2 tokens


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 96, (SHARED,), generator=g).tolist()
    first = [*shared, *torch.randint(3, 96, (5,), generator=g).tolist()]
    second = [*shared, *torch.randint(3, 96, (3,), generator=g).tolist()]
    return {"a": first, "b": second, "c": list(first)}


def _serve(model: torch.nn.Module, *, caching: bool) -> tuple[EngineResult, Engine]:
    attached = attach(
        model,
        config=AttentionConfig(backend="reference", prefix_caching={"enabled": caching}),
        num_blocks=40,
        block_size=4,
        cache_fill=float("nan"),  # a read of an unwritten slot poisons the logits
    )
    engine = Engine(attached, max_tokens_per_step=BUDGET, keep_logits=True)
    prompts = _prompts()
    engine.add_request("a", prompts["a"], SamplingParams(max_new_tokens=4))
    # Admitted after "a"'s 19-token prompt ran (3 steps of at most 7 tokens).
    for rid in ("b", "c"):
        engine.add_request(rid, prompts[rid], SamplingParams(max_new_tokens=4), arrival_step=4)
    return engine.run(), engine


def hit_scenario(family: str) -> None:
    model = _model(family)
    on, on_engine = _serve(copy.deepcopy(model), caching=True)
    off, off_engine = _serve(model, caching=False)
    assert on.outputs == off.outputs  # greedy: the same tokens
    attached = on_engine.model
    assert isinstance(attached, TransformersAttachment)
    check = check_against_eager(attached, on)
    assert check.passed, (family, check)
    assert check_against_eager(off_engine.model, off).passed  # type: ignore[arg-type]
    stats = on_engine.prefix_stats()
    assert stats.enabled, stats.why_off
    assert stats.cache is not None
    assert stats.cache.hits >= 2, (family, stats)  # "b" and "c" start from hits
    assert stats.cached_tokens >= 2 * 12, (family, stats)  # the shared prefix's 3 blocks
    saved = sum(s.num_prefill_tokens for s in off.steps) - sum(
        s.num_prefill_tokens for s in on.steps
    )
    assert saved == stats.cached_tokens == sum(s.num_cached_tokens for s in on.steps)
    assert off_engine.prefix_stats().cached_tokens == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_hits_change_no_output(family: str) -> None:
    hit_scenario(family)


def test_a_hit_that_reads_the_wrong_blocks_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: the checks above must see a hit pointing at the wrong
    blocks."""
    misplace_hits(monkeypatch)
    with pytest.raises(AssertionError):
        hit_scenario("llama")
