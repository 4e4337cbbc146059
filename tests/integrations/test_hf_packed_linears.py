"""``attach(..., linears=...)``: the model's CPU linears run on oneDNN during the
attachment's steps, and only then: on the weights themselves (the default) or on packed
copies (``pack_linears=True``); a changed, replaced or cast weight is taken again before
the next step; ``detach`` and ``compile`` give every linear its own forward back.

The reference is the model's own ``F.linear`` (a deep copy of it, never attached)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from attnkit.errors import ArgumentTypeError, InvalidArgumentError
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


# ------------------------------------------------------- the default: no copies


def _plain_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward
    ]


def test_the_default_runs_onednn_on_the_models_own_weights() -> None:
    model = tiny_model("llama", seed=4).eval()
    reference = copy.deepcopy(model)
    attached = attach(model, num_blocks=64, block_size=4)
    assert attached.linears_mode == "onednn"
    assert attached.linears is not None
    assert attached.linears.num_packed == len(_plain_linears(model))
    assert attached.linears.packed_bytes == 0  # no copy
    served = {e.packed.data_ptr() for e in attached.linears._entries if e.packed is not None}
    assert served == {m.weight.data_ptr() for m in _plain_linears(model)}
    with torch.no_grad():
        eager = reference(input_ids=torch.tensor([PROMPTS[0]])).logits[0]
    got = _step_logits(attached)
    assert (got - eager).abs().max().item() < 1e-4 * max(1.0, eager.abs().max().item())
    outputs = _engine_outputs(attached)
    for i, p in enumerate(PROMPTS):
        assert outputs[f"r{i}"] == _greedy(reference, p, 5)


def test_module_linears_leave_every_linear_alone() -> None:
    model = tiny_model("llama", seed=4).eval()
    attached = attach(model, num_blocks=64, block_size=4, linears="module")
    assert attached.linears_mode == "module"
    assert attached.linears is None
    assert not any("forward" in m.__dict__ for m in _plain_linears(model))


def test_a_linear_with_a_forward_of_its_own_keeps_it() -> None:
    """llama4's router is an ``nn.Linear`` whose forward also returns its top-k."""
    model = tiny_model("llama4_text", seed=4).eval()
    attached = attach(model, num_blocks=64, block_size=4)
    assert attached.linears is not None
    every = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(_plain_linears(model)) < len(every)  # (the router is one)
    assert attached.linears.num_packed == len(_plain_linears(model))
    assert not any(
        "forward" in m.__dict__ for m in every if type(m).forward is not torch.nn.Linear.forward
    )


def _cast_and_back(attached: Any, model: torch.nn.Module) -> float:
    """Steps in float32, then bfloat16, then float32 again (weights now rounded): the
    last step's largest error against the model's own forward, relative."""
    _step_logits(attached)
    model.to(torch.bfloat16)
    _step_logits(attached)
    model.to(torch.float32)
    got = _step_logits(attached)
    with attached.eager() as eager_model, torch.no_grad():
        eager = eager_model(input_ids=torch.tensor([PROMPTS[0]])).logits[0]
    return float((got - eager).abs().max().item() / max(1.0, eager.abs().max().item()))


@pytest.mark.parametrize("mode", ["onednn", "packed"])
def test_a_model_cast_and_back_serves_its_new_weights(mode: str) -> None:
    model = tiny_model("llama", seed=4).eval()
    attached = attach(model, num_blocks=64, block_size=4, linears=mode)  # type: ignore[arg-type]  # (a parametrized literal)
    assert _cast_and_back(attached, model) < 1e-4


def test_a_refresh_blind_to_new_data_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: a cast keeps the parameter and its version; a refresh that reads only
    those serves the weights from before the cast."""

    def blind(self: _linears._Entry) -> None:
        weight = self.module.weight
        if weight is self.source and weight._version == self.version:
            return
        _own_refresh(self)

    monkeypatch.setattr(_linears._Entry, "refresh", blind)
    model = tiny_model("llama", seed=4).eval()
    attached = attach(model, num_blocks=64, block_size=4, linears="onednn")
    assert _cast_and_back(attached, model) > 1e-3


def test_compile_runs_the_modules_own_linears() -> None:
    model = tiny_model("llama", seed=4).eval()
    attached = attach(model, num_blocks=64, block_size=4)
    attached.compile(backend="eager")
    assert attached.linears_mode == "module"
    assert attached.linears is None
    assert not any("forward" in m.__dict__ for m in _plain_linears(model))


def test_bad_linears_choices_are_refused() -> None:
    model = tiny_model("llama", seed=4).eval()
    with pytest.raises(InvalidArgumentError, match="linears must be one of 'auto', 'onednn'"):
        attach(model, num_blocks=64, block_size=4, linears="fast")  # type: ignore[arg-type]  # (the wrong value on purpose)
    with pytest.raises(InvalidArgumentError, match="pack_linears=True is linears='packed'"):
        attach(model, num_blocks=64, block_size=4, linears="module", pack_linears=True)
    assert not any("forward" in m.__dict__ for m in _plain_linears(model))
