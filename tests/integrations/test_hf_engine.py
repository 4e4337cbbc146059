"""The engine loop (``attnkit.integrations.engine``) on a toy model, without transformers.

The toy model is written here: token and position embeddings, one full-attention and
one sliding-window layer served by ``runtime.forward``, and a dense recompute of the
same model over a whole sequence (causal softmax with the window, written out in torch).
Every step's logits must equal the dense recompute at the same positions, whatever the
engine did (chunked prefill, interleaving, preemption and recompute).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import pytest
import torch

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    FullAttentionSpec,
    KVCacheSpec,
    OutOfBlocksError,
    SlidingWindowSpec,
    StepBatch,
)
from attnkit.errors import DuplicateRequestError, EngineLimitError, InvalidArgumentError
from attnkit.integrations.engine import (
    Engine,
    EngineResult,
    FunctionModel,
    Request,
    SamplingParams,
)

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD = 40, 16, 2, 1, 8
WINDOW, BLOCK = 5, 4
ATOL = 1e-4


def _specs() -> dict[str, KVCacheSpec]:
    common = {"block_size": BLOCK, "num_kv_heads": KV_HEADS, "head_size": HEAD}
    return {
        "full": FullAttentionSpec(**common, dtype=torch.float32),
        "win": SlidingWindowSpec(**common, dtype=torch.float32, sliding_window=WINDOW),
    }


class ToyModel:
    """Embeddings -> [full, window] attention with residuals -> logits."""

    def __init__(self, runtime: AttentionRuntime, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * scale

        self.runtime = runtime
        self.embed = rand(VOCAB, HIDDEN)
        self.pos = rand(64, HIDDEN, scale=0.5)
        self.layers = {
            name: (
                rand(HIDDEN, HEADS * HEAD, scale=0.5),
                rand(HIDDEN, KV_HEADS * HEAD, scale=0.5),
                rand(HIDDEN, KV_HEADS * HEAD, scale=0.5),
                rand(HEADS * HEAD, HIDDEN, scale=0.3),
            )
            for name in ("full", "win")
        }
        self.out = rand(HIDDEN, VOCAB, scale=0.5)
        self.calls = 0

    def step(
        self, batch: StepBatch, token_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        self.calls += 1
        h = self.embed[token_ids] + self.pos[positions]
        for name, (wq, wk, wv, wo) in self.layers.items():
            q = (h @ wq).view(-1, HEADS, HEAD)
            k = (h @ wk).view(-1, KV_HEADS, HEAD)
            v = (h @ wv).view(-1, KV_HEADS, HEAD)
            h = h + self.runtime.forward(name, q, k, v).reshape(-1, HEADS * HEAD) @ wo
        return h @ self.out

    def dense(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits of one whole sequence, attention written out densely."""
        ids = torch.tensor(list(tokens))
        n = ids.numel()
        h = self.embed[ids] + self.pos[torch.arange(n)]
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        for name, (wq, wk, wv, wo) in self.layers.items():
            q = (h @ wq).view(n, HEADS, HEAD)
            k = (h @ wk).view(n, KV_HEADS, HEAD).repeat_interleave(HEADS // KV_HEADS, 1)
            v = (h @ wv).view(n, KV_HEADS, HEAD).repeat_interleave(HEADS // KV_HEADS, 1)
            allowed = j <= i
            if name == "win":  # the query and the WINDOW - 1 tokens before it
                allowed &= j > i - WINDOW
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD)
            scores = scores.masked_fill(~allowed, float("-inf"))
            o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
            h = h + o.reshape(n, HEADS * HEAD) @ wo
        return h @ self.out


@dataclasses.dataclass
class Setup:
    runtime: AttentionRuntime
    toy: ToyModel
    begin_steps: list[int]


def _setup(num_blocks: int, *, max_num_batched_tokens: int = 64) -> Setup:
    specs = _specs()
    page = max(s.page_size_bytes for s in specs.values())
    runtime = AttentionRuntime(
        specs,
        AttentionConfig(backend="reference", max_num_batched_tokens=max_num_batched_tokens),
        device="cpu",
        memory_budget_bytes=num_blocks * page,
        layer_params={name: AttentionLayerParams(num_heads=HEADS) for name in specs},
        cache_fill=float("nan"),
    )
    assert runtime.num_blocks == num_blocks
    calls: list[int] = []
    begin = runtime.begin_step

    def counted(*args: object, **kwargs: object) -> StepBatch:
        calls.append(1)
        return begin(*args, **kwargs)  # type: ignore[arg-type]

    runtime.begin_step = counted  # type: ignore[method-assign]
    return Setup(runtime, ToyModel(runtime), calls)


PROMPTS = {
    "a": [5, 9, 3, 22, 17, 8, 30, 2, 11, 4, 19],
    "b": [7, 7, 12, 1, 33, 26, 15, 9],
    "c": [3, 14, 15, 9, 26, 5, 35, 8, 9, 7],
}


def _run(setup: Setup, budget: int, *, max_new: int = 7, stagger: bool = True) -> EngineResult:
    engine = Engine(
        FunctionModel(setup.runtime, setup.toy.step), max_tokens_per_step=budget, keep_logits=True
    )
    for i, (rid, prompt) in enumerate(PROMPTS.items()):
        engine.add_request(
            rid, prompt, SamplingParams(max_new_tokens=max_new), arrival_step=i if stagger else 0
        )
    return engine.run()


def _max_error(toy: ToyModel, result: EngineResult) -> float:
    dense = {rid: toy.dense(tokens[:-1]) for rid, tokens in result.tokens.items()}
    worst = 0.0
    for step in result.steps:
        assert step.logits is not None
        for rid, rows in step.logits.items():
            expected = dense[rid][rows.start : rows.start + rows.logits.shape[0]]
            worst = max(worst, float((rows.logits - expected).abs().max()))
    return worst


def test_interleaved_chunked_prefill_matches_the_dense_model() -> None:
    setup = _setup(num_blocks=64)
    result = _run(setup, budget=6)
    assert _max_error(setup.toy, result) < ATOL
    # Chunked: no step over budget, and prompts longer than it were split.
    assert all(s.num_tokens <= 6 for s in result.steps)
    first_a = [n for s in result.steps for rid, n in s.scheduled if rid == "a"][:2]
    assert first_a == [6, 5]
    # Interleaved: some step mixes a decode with another request's prompt chunk.
    assert any(s.num_decode_tokens and s.num_prefill_tokens for s in result.steps)
    # One runtime step and one model call per engine step that ran tokens.
    running = [s for s in result.steps if s.scheduled]
    assert len(setup.begin_steps) == len(running) == setup.toy.calls
    assert {rid: len(t) for rid, t in result.outputs.items()} == {"a": 7, "b": 7, "c": 7}
    # Every request freed its blocks at the end (the null block is never free).
    assert result.steps[-1].num_free_blocks == setup.runtime.num_blocks - 1


def test_arrivals_wait_for_their_step() -> None:
    setup = _setup(num_blocks=64)
    result = _run(setup, budget=32)
    started = {rid: s.step for s in result.steps for rid in s.admitted}
    assert started == {"a": 0, "b": 1, "c": 2}


def test_preemption_recomputes_and_keeps_greedy_outputs() -> None:
    roomy = _run(_setup(num_blocks=64), budget=8, stagger=False)
    tight_setup = _setup(num_blocks=12)
    tight = _run(tight_setup, budget=8, stagger=False)
    assert tight.num_preemptions > 0
    assert tight.outputs == roomy.outputs
    assert _max_error(tight_setup.toy, tight) < ATOL
    preempted = next(s for s in tight.steps if s.preempted)
    victim = preempted.preempted[0]
    # The victim comes back later as a new admission (recompute from position 0).
    later = [s for s in tight.steps if s.step > preempted.step and victim in s.admitted]
    assert later
    assert later[0].logits is not None
    assert later[0].logits[victim].start == 0


def test_a_request_that_cannot_fit_alone_is_an_error() -> None:
    setup = _setup(num_blocks=3)
    engine = Engine(FunctionModel(setup.runtime, setup.toy.step), max_tokens_per_step=16)
    engine.add_request("big", list(range(1, 16)), SamplingParams(max_new_tokens=2))
    with pytest.raises(OutOfBlocksError, match=r"'big'.*nothing left to preempt"):
        engine.run()


def test_sampling_is_seeded_per_request() -> None:
    def sample(with_others: bool) -> list[int]:
        setup = _setup(num_blocks=64)
        engine = Engine(FunctionModel(setup.runtime, setup.toy.step), max_tokens_per_step=8)
        engine.add_request(
            "s", PROMPTS["a"], SamplingParams(max_new_tokens=8, temperature=1.5, seed=7)
        )
        if with_others:
            engine.add_request("o", PROMPTS["b"], SamplingParams(max_new_tokens=3, temperature=1.0))
        return engine.run().outputs["s"]

    alone = sample(False)
    assert alone == sample(True)
    # The draw is not greedy: some token differs from the argmax path.
    setup = _setup(num_blocks=64)
    greedy = Engine(FunctionModel(setup.runtime, setup.toy.step)).run(
        [Request("s", tuple(PROMPTS["a"]), SamplingParams(max_new_tokens=8))]
    )
    assert greedy.outputs["s"] != alone


def test_stop_tokens_end_a_request() -> None:
    setup = _setup(num_blocks=64)
    free = _run(setup, budget=16, stagger=False)
    stop = free.outputs["a"][2]
    setup = _setup(num_blocks=64)
    engine = Engine(FunctionModel(setup.runtime, setup.toy.step))
    engine.add_request("a", PROMPTS["a"], SamplingParams(max_new_tokens=7, stop_token_ids=(stop,)))
    out = engine.run().outputs["a"]
    assert out == free.outputs["a"][: free.outputs["a"].index(stop) + 1]


def test_bad_requests_and_limits_are_named() -> None:
    setup = _setup(num_blocks=64, max_num_batched_tokens=32)
    model = FunctionModel(setup.runtime, setup.toy.step)
    with pytest.raises(
        InvalidArgumentError, match=r"max_tokens_per_step must be an int in \[1, 32\]"
    ):
        Engine(model, max_tokens_per_step=33)
    engine = Engine(model)
    engine.add_request("x", [1, 2])
    with pytest.raises(DuplicateRequestError, match="'x' was already added"):
        engine.add_request("x", [3])
    with pytest.raises(InvalidArgumentError, match="prompt must be a non-empty tuple"):
        engine.add_request("empty", [])
    with pytest.raises(InvalidArgumentError, match="temperature must be a finite float >= 0"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(InvalidArgumentError, match="max_new_tokens must be an int >= 1"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(EngineLimitError, match="max_model_len"):
        engine.add_request(
            "long", [1] * 10, SamplingParams(max_new_tokens=setup.runtime.config.max_model_len)
        )


def test_a_failing_model_leaves_the_engine_consistent() -> None:
    setup = _setup(num_blocks=64)
    fail = [True]

    def flaky(batch: StepBatch, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if fail[0] and batch.num_tokens > 1:
            fail[0] = False
            raise RuntimeError("boom")
        return setup.toy.step(batch, ids, pos)

    engine = Engine(FunctionModel(setup.runtime, flaky), max_tokens_per_step=8, keep_logits=True)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, SamplingParams(max_new_tokens=4))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    result = engine.run()
    assert _max_error(setup.toy, result) < ATOL
    assert setup.runtime.manager.pool.num_free_blocks == setup.runtime.num_blocks - 1
