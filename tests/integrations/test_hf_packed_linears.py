"""``attach(..., pack_linears=True)``: the model's CPU linears run on oneDNN-packed
copies of their weights during the attachment's steps, and only then; a changed weight
is packed again before the next step; ``detach`` takes every copy away.

The reference is the model's own ``F.linear`` (a deep copy of it, never attached)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from attnkit.errors import ArgumentTypeError
from attnkit.integrations.engine import Engine, SamplingParams
from attnkit.integrations.transformers import _linears, attach, tiny_model

pytestmark = pytest.mark.skipif(
    _linears.packing_problem() is not None,
    reason=f"torch cannot pack linears here: {_linears.packing_problem()}",
)

PROMPTS = ([5, 9, 13, 7, 21, 30, 4, 4, 17], [40, 41, 3], [8] * 6)


def _greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(torch.argmax(model(input_ids=torch.tensor([tokens])).logits[0, -1])))
    return tokens[len(prompt) :]


def _engine_outputs(attached: object, n: int = 5) -> dict[str, list[int]]:
    engine = Engine(attached, max_tokens_per_step=8)  # type: ignore[arg-type]  # (an attachment)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=n))
    return {k: list(v) for k, v in engine.run().outputs.items()}


def _step_logits(attached: object) -> torch.Tensor:
    engine = Engine(attached, keep_logits=True)  # type: ignore[arg-type]  # (an attachment)
    engine.add_request("r", PROMPTS[0], SamplingParams(max_new_tokens=1))
    logits = engine.run().steps[0].logits
    assert logits is not None
    return logits["r"].logits


def test_packed_steps_match_the_models_own_linears() -> None:
    model = tiny_model("llama", seed=4).eval()
    reference = copy.deepcopy(model)
    attached = attach(model, num_blocks=64, block_size=4, pack_linears=True)
    assert attached.linears is not None
    linears = sum(isinstance(m, torch.nn.Linear) for m in reference.modules())
    assert attached.linears.num_packed == linears  # every projection and the LM head
    with torch.no_grad():
        eager = reference(input_ids=torch.tensor([PROMPTS[0]])).logits[0]
    got = _step_logits(attached)
    error = (got - eager).abs().max().item()
    assert error < 1e-4 * max(1.0, eager.abs().max().item())
    outputs = _engine_outputs(attached)
    for i, p in enumerate(PROMPTS):
        assert outputs[f"r{i}"] == _greedy(reference, p, 5)


def test_outside_a_step_the_model_runs_its_own_linears() -> None:
    model = tiny_model("llama", seed=4).eval()
    reference = copy.deepcopy(model)
    attached = attach(model, num_blocks=64, block_size=4, pack_linears=True)
    x = torch.randn(3, 32)
    head = model.get_output_embeddings()
    own = reference.get_output_embeddings()
    assert isinstance(head, torch.nn.Module)
    assert isinstance(own, torch.nn.Module)
    with torch.no_grad():
        assert torch.equal(head(x), own(x))  # bitwise: F.linear, not the packed copy
    del attached


def _change_a_weight(model: torch.nn.Module) -> None:
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Linear)
    with torch.no_grad():
        head.weight.mul_(-1.5)  # in place: the same tensor, a new version


def test_a_weight_changed_in_place_is_packed_again() -> None:
    model = tiny_model("llama", seed=4).eval()
    attached = attach(model, num_blocks=64, block_size=4, pack_linears=True)
    before = _step_logits(attached)
    _change_a_weight(model)
    after = _step_logits(attached)
    with attached.eager() as eager_model, torch.no_grad():  # (its own linears, outside a step)
        eager = eager_model(input_ids=torch.tensor([PROMPTS[0]])).logits[0]
    assert (after - eager).abs().max().item() < 1e-4 * max(1.0, eager.abs().max().item())
    assert (after - before).abs().max().item() > 0.1  # the change is visible


def test_a_refresh_that_never_packs_again_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: serving the first packed copy after the weight changed is stale."""
    monkeypatch.setattr(_linears._Entry, "refresh", _refresh_once)
    model = tiny_model("llama", seed=4).eval()
    attached = attach(model, num_blocks=64, block_size=4, pack_linears=True)
    _step_logits(attached)
    _change_a_weight(model)
    after = _step_logits(attached)
    with attached.eager() as eager_model, torch.no_grad():  # (its own linears, outside a step)
        eager = eager_model(input_ids=torch.tensor([PROMPTS[0]])).logits[0]
    assert (after - eager).abs().max().item() > 0.1


_own_refresh = _linears._Entry.refresh


def _refresh_once(self: _linears._Entry) -> None:
    if self.packed is None and self.source is None:
        _own_refresh(self)


def test_detach_takes_the_packed_copies_away() -> None:
    model = tiny_model("llama", seed=4).eval()
    attached = attach(model, num_blocks=64, block_size=4, pack_linears=True)
    assert attached.linears is not None
    assert attached.linears.packed_bytes > 0
    attached.detach()
    assert attached.linears.num_packed == 0
    assert not any(
        "forward" in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear)
    )


@pytest.mark.skipif(
    not torch.cpu._is_avx512_bf16_supported(), reason="this CPU has no AVX-512 BF16"
)
def test_bfloat16_linears_are_packed_where_the_cpu_has_bf16() -> None:
    model = tiny_model("llama", seed=4, dtype=torch.bfloat16).eval()
    reference = copy.deepcopy(model)
    attached = attach(model, num_blocks=64, block_size=4, pack_linears=True)
    assert attached.linears is not None
    assert attached.linears.num_packed > 0
    with torch.no_grad():
        eager = reference(input_ids=torch.tensor([PROMPTS[0]])).logits[0].float()
    got = _step_logits(attached).float()
    # bf16 GEMMs in another order: a few bf16 ulps of the largest logit.
    assert (got - eager).abs().max().item() < 0.05 * max(1.0, eager.abs().max().item())


def test_pack_linears_must_be_a_bool() -> None:
    model = tiny_model("llama", seed=4).eval()
    with pytest.raises(ArgumentTypeError, match="pack_linears must be a bool, got 'yes'"):
        attach(model, num_blocks=64, block_size=4, pack_linears="yes")  # type: ignore[arg-type]  # (the wrong type on purpose)
