"""The engine asks the model only for the logits it samples or verifies from
(``StepModel.__call__(..., logits_rows)``): the LM head of an attached transformers
model runs on those rows, and the tokens equal greedy decoding written out here."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from attnkit import AttentionConfig
from attnkit.errors import InvalidArgumentError
from attnkit.integrations.engine import (
    Engine,
    FunctionModel,
    PromptLookup,
    Request,
    SamplingParams,
    StepStats,
)
from attnkit.integrations.transformers import attach, tiny_model

PROMPT_LENS = (13, 5, 11)
NEW = 4


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by the model's own forward over the whole sequence each time."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([tokens])).logits
            tokens.append(int(torch.argmax(logits[0, -1])))
    return tokens[len(prompt) :]


def _count_rows(model: torch.nn.Module) -> list[int]:
    """Rows the LM head sees per call, recorded by a forward hook."""
    rows: list[int] = []
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Module)

    def hook(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])

    head.register_forward_pre_hook(hook)
    return rows


def _run(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=NEW))
    return {k: list(v) for k, v in engine.run().outputs.items()}


def test_the_lm_head_runs_only_on_the_rows_that_sample() -> None:
    model = tiny_model("llama", seed=1).eval()
    reference = copy.deepcopy(model)
    rows = _count_rows(model)
    engine = Engine(attach(model, num_blocks=64, block_size=4), max_tokens_per_step=8)
    rows.clear()  # (attach probes the model once)
    outputs = _run(engine, _prompts())
    # One row per sampled token: every mid-prompt chunk and every prompt token but the
    # last are left out of the LM head (the prompts here are 29 tokens in chunks of 8).
    assert sum(rows) == NEW * len(PROMPT_LENS)
    for i, prompt in enumerate(_prompts()):
        assert outputs[f"r{i}"] == _greedy(reference, prompt, NEW)


def test_a_verify_step_asks_for_every_row_it_checks() -> None:
    model = tiny_model("llama", seed=2).eval()
    reference = copy.deepcopy(model)
    rows = _count_rows(model)
    attached = attach(
        model, num_blocks=96, block_size=4, config=AttentionConfig(num_speculative_tokens=3)
    )
    engine = Engine(attached, max_tokens_per_step=32, speculative=PromptLookup(3, min_ngram=1))
    rows.clear()  # (attach probes the model once)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]  # repetitive: lookups draft
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=8))
    result = engine.run()
    stats = engine.speculative_stats()
    assert stats.draft_tokens > 0
    # A verify step checks its root and each draft: 1 + k rows; others one.
    expected = sum(
        (1 + s.num_draft_tokens) if s.num_draft_tokens else len(s.sampled) for s in result.steps
    )
    assert sum(rows) == expected
    assert list(result.outputs["r"]) == _greedy(reference, prompt, 8)


def test_keep_logits_asks_for_every_row() -> None:
    model = tiny_model("llama", seed=1).eval()
    rows = _count_rows(model)
    engine = Engine(attach(model, num_blocks=64, block_size=4), keep_logits=True)
    rows.clear()  # (attach probes the model once)
    _run(engine, _prompts())
    total = sum(PROMPT_LENS) + (NEW - 1) * len(PROMPT_LENS)  # every token computed once
    assert sum(rows) == total


def test_a_lost_row_map_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: reading the model's rows as if they were the step's (the map ignored)
    does not give greedy decoding (an index past the rows, or other tokens)."""
    monkeypatch.setattr(Engine, "_row", lambda self, step_row: step_row)
    model = tiny_model("llama", seed=1).eval()
    reference = copy.deepcopy(model)
    engine = Engine(attach(model, num_blocks=64, block_size=4), max_tokens_per_step=8)
    try:
        outputs = _run(engine, _prompts())
    except IndexError:
        return
    assert any(outputs[f"r{i}"] != _greedy(reference, p, NEW) for i, p in enumerate(_prompts()))


def test_a_model_that_ignores_the_rows_is_refused() -> None:
    model = tiny_model("llama", seed=1).eval()
    attached = attach(model, num_blocks=64, block_size=4)
    runtime = attached.prepare_step()

    def every_row(batch: object, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return attached(batch, ids, pos)  # type: ignore[arg-type]  # (a StepBatch: the engine's)

    class AllRows:
        def prepare_step(self) -> object:
            return attached.prepare_step()

        def __call__(
            self, batch: object, ids: torch.Tensor, pos: torch.Tensor, rows: object = None
        ) -> torch.Tensor:
            return every_row(batch, ids, pos)

    del runtime
    engine = Engine(AllRows())  # type: ignore[arg-type]  # (structurally a StepModel)
    engine.add_request("r", _prompts()[0], SamplingParams(max_new_tokens=2))
    with pytest.raises(
        InvalidArgumentError, match=r"returned 13 rows .*asked for 1 \(logits_rows\)"
    ):
        engine.run()


def test_bad_logits_rows_are_named() -> None:
    model = tiny_model("llama", seed=1).eval()
    attached = attach(model, num_blocks=64, block_size=4)
    runtime = attached.prepare_step()
    from attnkit import ScheduledRequest

    batch = runtime.begin_step([ScheduledRequest("r", 5)])
    ids, pos = torch.arange(3, 8), torch.arange(5)
    with pytest.raises(InvalidArgumentError, match="logits_rows must be int64"):
        attached(batch, ids, pos, torch.tensor([4.0]))
    with pytest.raises(InvalidArgumentError, match="row out of range"):
        attached(batch, ids, pos, torch.tensor([5]))
    assert attached(batch, ids, pos, torch.tensor([1, 4])).shape[0] == 2


def test_a_function_model_gets_its_rows_cut() -> None:
    model = tiny_model("llama", seed=1).eval()
    attached = attach(model, num_blocks=64, block_size=4)
    runtime = attached.prepare_step()
    calls: list[int] = []

    def function(batch: object, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        calls.append(ids.numel())
        return torch.arange(ids.numel(), dtype=torch.float32)[:, None].repeat(1, 3)

    wrapped = FunctionModel(runtime, function)  # type: ignore[arg-type]  # (loosely typed)
    from attnkit import ScheduledRequest

    batch = runtime.begin_step([ScheduledRequest("r", 6)])
    out = wrapped(batch, torch.arange(6), torch.arange(6), torch.tensor([2, 5]))
    assert out[:, 0].tolist() == [2.0, 5.0]
    assert calls == [6]


def _tie_prone_run(requests: list[Request]) -> tuple[list[list[list[float]]], list[StepStats]]:
    """``requests`` through an engine whose logits take three values (rows tie often):
    the logits of every model call, and the steps."""
    model = tiny_model("llama", seed=1).eval()
    attached = attach(model, num_blocks=64, block_size=4)
    runtime = attached.prepare_step()
    calls: list[list[list[float]]] = []

    def function(batch: object, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(int(pos.sum()) + 31 * ids.numel())
        logits = torch.randint(0, 3, (ids.numel(), 7), generator=gen).float()
        calls.append(logits.tolist())
        return logits

    engine = Engine(FunctionModel(runtime, function))  # type: ignore[arg-type]  # (loosely typed)
    steps = list(engine.run(requests).steps)
    return calls, steps


def test_greedy_picks_are_each_row_s_first_maximum() -> None:
    """A step's greedy requests are picked in one argmax over their rows: each gets its
    own row's first maximum (ties included), beside a sampled request."""
    requests = [
        Request(f"g{i}", tuple(range(1, 4 + i)), SamplingParams(max_new_tokens=5)) for i in range(3)
    ]
    requests.append(Request("s", (1, 2, 3), SamplingParams(max_new_tokens=5, temperature=1.0)))
    calls, steps = _tie_prone_run(requests)
    ran = [s for s in steps if s.num_tokens]
    assert len(ran) == len(calls)
    checked = 0
    for stats, logits in zip(ran, calls, strict=True):
        row = 0
        for rid, n in stats.scheduled:
            row += n
            if rid in stats.sampled and rid != "s":
                last = logits[row - 1]
                assert stats.sampled[rid] == last.index(max(last)), (stats.step, rid)
                checked += 1
    assert checked == 15  # three greedy requests, five tokens each


def test_a_last_maximum_pick_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken variant: greedy picks that take a row's last maximum on a tie."""
    picks = Engine._greedy_picks

    def last_maximum(self: Engine, slices: Any, verified: Any, logits: torch.Tensor) -> Any:
        flipped = picks(self, slices, verified, logits.flip(-1))
        return {rid: logits.shape[-1] - 1 - t for rid, t in flipped.items()}

    monkeypatch.setattr(Engine, "_greedy_picks", last_maximum)
    with pytest.raises(AssertionError):
        test_greedy_picks_are_each_row_s_first_maximum()
