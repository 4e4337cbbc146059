"""``attnkit.integrations.transformers``: tiny random transformers models served through
the engine must reproduce transformers' own eager attention at every engine step.

The models are built here from transformers config objects (no download), with a
window of 6 and a Llama 4 chunk of 8, so prompts of 5-13 tokens chunked by a budget of
7 and 6 decodes cross window, chunk and block boundaries. The reference is a copy of the
model taken before ``attach``, run by transformers with ``attn_implementation="eager"``
over each request's whole sequence; each engine step's rows are compared with the rows
of the same positions.

Negative controls: the same runs against a reference with one convention changed (the
window, the sinks, Gemma 2's scale or soft-cap, Llama 4's chunk or its NoPE temperature
tuning) must miss by far more than the tolerance, so each convention is visible in the
data the positive tests check.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from attnkit import AttentionConfig, ScheduledRequest, StaleStepError
from attnkit.errors import InvalidArgumentError
from attnkit.integrations.engine import Engine, EngineResult, SamplingParams

tf = pytest.importorskip("transformers")

from attnkit.integrations.transformers import (  # noqa: E402  (after the importorskip)
    MissingDependencyError,
    StaleParametersError,
    TransformersAttachment,
    UnsupportedModelError,
    attach,
)

ATOL = 1e-4  # float32 (attnkit.testing.tolerances); the runs land near 1e-5
WINDOW, CHUNK = 6, 8
COMMON: dict[str, object] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "initializer_range": 0.2,  # large enough that attention patterns matter
}
TWO_KINDS = {"layer_types": ["sliding_attention", "full_attention"]}


def _config(family: str) -> object:
    """A tiny config of each family: layer 0 windowed (or chunked), layer 1 full, where
    the family has both kinds."""
    if family == "llama":
        return tf.LlamaConfig(**COMMON)
    if family == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=WINDOW)
    if family in ("qwen2", "qwen3"):
        # use_sliding_window with max_window_layers=1: layer 1 windowed, layer 0 full.
        cls = tf.Qwen2Config if family == "qwen2" else tf.Qwen3Config
        return cls(**COMMON, sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1)
    if family == "gemma2":
        return tf.Gemma2Config(
            **COMMON, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0
        )
    if family == "gemma3_text":
        return tf.Gemma3TextConfig(
            **COMMON, **TWO_KINDS, sliding_window=WINDOW, query_pre_attn_scalar=24
        )
    if family == "gpt_oss":
        return tf.GptOssConfig(
            **COMMON, **TWO_KINDS, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2
        )
    assert family == "llama4_text"
    return tf.Llama4TextConfig(
        **COMMON,
        attention_chunk_size=CHUNK,
        no_rope_layers=[1, 0],  # layer 0 RoPE + chunked, layer 1 NoPE + full
        num_local_experts=2,
        intermediate_size_mlp=64,
        floor_scale=4,  # temperature tuning changes the NoPE queries from position 3 on
        attn_scale=0.5,
    )


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gpt_oss", "llama4_text")


def _model(family: str, seed: int = 0) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager")
        with torch.no_grad():
            for module in model.modules():
                sinks = getattr(module, "sinks", None)
                if isinstance(sinks, torch.Tensor):
                    sinks.normal_(0.0, 1.0)  # at the scores' scale: sinks take real mass
    return model.eval()


PROMPT_LENS = (13, 5, 11)
BUDGET = 7
# The Triton interpreter runs every launch in Python: its runs are kept short (two
# requests, 10 + 2 and 4 + 2 tokens, still crossing the window and the chunk).
TRITON_PROMPT_LENS = (10, 4)
TRITON_NEW_TOKENS = 2
TRITON_BUDGET = 6


def _requests(
    engine: Engine,
    prefix: str = "r",
    max_new: int = 6,
    prompt_lens: tuple[int, ...] = PROMPT_LENS,
) -> None:
    g = torch.Generator().manual_seed(0)
    for i, n in enumerate(prompt_lens):
        prompt = torch.randint(3, 96, (n,), generator=g).tolist()
        temperature = 0.8 if i == 1 else 0.0  # one sampled request among greedy ones
        engine.add_request(
            f"{prefix}{i}",
            prompt,
            SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=i),
            arrival_step=engine.step_index + i,
        )


def _attach(model: torch.nn.Module, backend: str) -> TransformersAttachment:
    block_size = 16 if backend == "triton_attn" else 4  # triton_attn takes 16 and up
    return attach(
        model,
        config=AttentionConfig(backend=backend),
        num_blocks=12 if block_size == 16 else 40,
        block_size=block_size,
        cache_fill=float("nan"),
    )


@dataclasses.dataclass
class Served:
    reference: torch.nn.Module
    attached: TransformersAttachment
    result: EngineResult


@functools.cache
def _served(family: str, backend: str) -> Served:
    model = _model(family)
    reference = copy.deepcopy(model)
    attached = _attach(model, backend)
    budget = TRITON_BUDGET if backend == "triton_attn" else BUDGET
    engine = Engine(attached, max_tokens_per_step=budget, keep_logits=True)
    if backend == "triton_attn":
        _requests(engine, max_new=TRITON_NEW_TOKENS, prompt_lens=TRITON_PROMPT_LENS)
    else:
        _requests(engine)
    return Served(reference, attached, engine.run())


def _eager_error(
    reference: torch.nn.Module, result: EngineResult, steps: Callable[[int], bool] = lambda s: True
) -> tuple[float, float]:
    """Max |engine logit - eager logit| over the chosen steps, and max |eager logit|."""
    cache: dict[str, torch.Tensor] = {}
    worst = largest = 0.0
    for step in result.steps:
        if not steps(step.step):
            continue
        assert step.logits is not None
        for rid, rows in step.logits.items():
            if rid not in cache:
                ids = torch.tensor([result.tokens[rid][:-1]])
                with torch.no_grad():
                    cache[rid] = reference(input_ids=ids, use_cache=False).logits[0].float()
            expected = cache[rid][rows.start : rows.start + rows.logits.shape[0]]
            worst = max(worst, float((rows.logits.float() - expected).abs().max()))
            largest = max(largest, float(expected.abs().max()))
    return worst, largest


@pytest.mark.parametrize("backend", ["reference", "triton_attn"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_step_matches_eager(family: str, backend: str) -> None:
    served = _served(family, backend)
    error, _ = _eager_error(served.reference, served.result)
    assert error < ATOL
    steps = served.result.steps
    # The run chunked prompts and interleaved decodes with other requests' prompts.
    assert all(s.num_tokens <= BUDGET for s in steps)
    assert any(0 < n < len(served.result.tokens[r]) - 3 for s in steps for r, n in s.scheduled)
    assert any(s.num_decode_tokens and s.num_prefill_tokens for s in steps)
    longest = max(len(t) for t in served.result.tokens.values())
    # Sequences cross the window and the chunk (twice on reference).
    assert longest > (2 * CHUNK if backend == "reference" else CHUNK) > WINDOW
    assert {served.attached.runtime.backend_for(n).name for n in served.attached.layers} == {
        backend
    }


def _set_on(model: torch.nn.Module, attribute: str, value: object) -> None:
    for module in model.modules():
        if hasattr(module, attribute) and not isinstance(module, torch.nn.ModuleList):
            setattr(module, attribute, value)


def _drop_sinks(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.fill_(float("-inf"))  # exp(-inf) = 0: no sink mass


NEGATIVE_CONTROLS: dict[str, tuple[str, Callable[[torch.nn.Module], None]]] = {
    "mistral-window": ("mistral", lambda m: setattr(m.config, "sliding_window", WINDOW - 1)),
    "qwen2-window": ("qwen2", lambda m: setattr(m.config, "sliding_window", WINDOW - 1)),
    "gemma2-window": ("gemma2", lambda m: setattr(m.config, "sliding_window", WINDOW - 1)),
    "gemma3-window": ("gemma3_text", lambda m: setattr(m.config, "sliding_window", WINDOW - 1)),
    "gpt_oss-window": ("gpt_oss", lambda m: setattr(m.config, "sliding_window", WINDOW - 1)),
    "gpt_oss-dropped-sinks": ("gpt_oss", _drop_sinks),
    # Llama's head_dim ** -0.5 instead of query_pre_attn_scalar ** -0.5.
    "gemma2-scale": ("gemma2", lambda m: _set_on(m, "scaling", 16**-0.5)),
    "gemma2-no-softcap": ("gemma2", lambda m: _set_on(m, "attn_logit_softcapping", None)),
    "llama4-chunk": ("llama4_text", lambda m: setattr(m.config, "attention_chunk_size", 2 * CHUNK)),
    "llama4-no-temperature": (
        "llama4_text",
        lambda m: _set_on(m, "attn_temperature_tuning", False),
    ),
}


@pytest.mark.parametrize("control", NEGATIVE_CONTROLS)
def test_a_changed_convention_misses_eager(control: str) -> None:
    family, change = NEGATIVE_CONTROLS[control]
    served = _served(family, "reference")
    wrong = copy.deepcopy(served.reference)
    change(wrong)
    error, _ = _eager_error(wrong, served.result)
    assert error > 1000 * ATOL


def test_preemption_recomputes_and_stays_right() -> None:
    roomy = _served("gpt_oss", "reference")
    model = _model("gpt_oss")
    attached = attach(
        model, config=AttentionConfig(backend="reference"), num_blocks=12, block_size=4
    )
    engine = Engine(attached, max_tokens_per_step=BUDGET, keep_logits=True)
    _requests(engine)
    tight = engine.run()
    assert tight.num_preemptions > 0
    assert tight.outputs == roomy.result.outputs  # recompute changes no token
    error, _ = _eager_error(roomy.reference, tight)
    assert error < ATOL


def test_layer_parameters_come_from_the_model() -> None:
    gemma = _served("gemma2", "reference").attached.layers["model.layers.0.self_attn"]
    assert gemma.params.scale == 24**-0.5  # query_pre_attn_scalar, not head_dim
    assert gemma.params.logits_soft_cap == 5.0
    assert gemma.spec.kind.value == "sliding_window"
    qwen = _served("qwen2", "reference").attached.layers
    assert [b.spec.kind.value for b in qwen.values()] == ["full_attention", "sliding_window"]
    llama4 = _served("llama4_text", "reference").attached.layers
    chunked = llama4["model.layers.0.self_attn"].spec
    assert chunked.kind.value == "chunked_local_attention"
    assert getattr(chunked, "attention_chunk_size", None) == CHUNK
    assert llama4["model.layers.1.self_attn"].spec.kind.value == "full_attention"
    oss = _served("gpt_oss", "reference")
    sinks = oss.attached.layers["model.layers.0.self_attn"].sinks
    module_sinks = oss.attached.model.get_submodule("model.layers.0.self_attn").sinks
    assert sinks is not None
    assert torch.equal(sinks, module_sinks.detach().float())


def test_model_to_another_dtype_rebuilds_and_stays_right() -> None:
    model = _model("gpt_oss", seed=1)
    reference32 = copy.deepcopy(model)
    attached = _attach(model, "reference")
    engine = Engine(attached, max_tokens_per_step=BUDGET, keep_logits=True)
    _requests(engine)
    before = [engine.step() for _ in range(4)]
    # Mid-run: the model moves to bfloat16 with requests in flight.
    model.to(torch.bfloat16)
    rest = engine.run()
    assert attached.rebuilds == 1
    assert attached.runtime.layer_params  # a new runtime, in bfloat16
    assert all(spec.dtype == torch.bfloat16 for spec in (b.spec for b in attached.layers.values()))
    result = EngineResult(rest.outputs, rest.tokens, before + rest.steps)
    error32, _ = _eager_error(reference32, result, lambda s: s < 4)
    assert error32 < ATOL
    reference16 = copy.deepcopy(reference32).to(torch.bfloat16)
    error16, largest = _eager_error(reference16, result, lambda s: s >= 4)
    assert error16 < 0.05 * largest  # bfloat16 logits: a few ulps of the largest
    # Back to float32 (weights now rounded to bfloat16 values): exact again.
    model.to(torch.float32)
    _requests(engine, prefix="again")
    again = engine.run()
    assert attached.rebuilds == 2
    error, _ = _eager_error(reference16.to(torch.float32), again)
    assert error < ATOL


def test_sinks_changed_in_place_are_read_on_every_call() -> None:
    model = _model("gpt_oss", seed=2)
    reference = copy.deepcopy(model)
    attached = _attach(model, "reference")
    engine = Engine(attached, max_tokens_per_step=BUDGET, keep_logits=True)
    _requests(engine)
    engine.run()
    with torch.no_grad():
        for m in (model, reference):
            for module in m.modules():
                if isinstance(getattr(module, "sinks", None), torch.Tensor):
                    module.sinks.add_(2.0)
    _requests(engine, prefix="after")
    after = engine.run()
    assert attached.rebuilds == 0  # same dtype and device: nothing to rebuild
    error, _ = _eager_error(reference, after)
    assert error < ATOL


def test_a_changed_scale_is_refused_per_call_and_rebuilt_per_step() -> None:
    model = _model("gemma2", seed=3)
    reference = copy.deepcopy(model)
    attached = _attach(model, "reference")
    for m in (model, reference):
        m.get_submodule("model.layers.0.self_attn").scaling = 0.3
    # Driven by hand without prepare_step: the call's scale is not the runtime's.
    runtime = attached.runtime
    batch = runtime.begin_step([ScheduledRequest("x", 3)])
    with pytest.raises(
        StaleParametersError,
        match=r"model\.layers\.0\.self_attn: the module passed scaling=0\.3, the runtime was "
        r"built with 0\.204",
    ):
        attached(batch, torch.tensor([5, 6, 7]), torch.arange(3))
    runtime.free(["x"])
    # Through the engine, prepare_step sees the change and rebuilds.
    engine = Engine(attached, max_tokens_per_step=BUDGET, keep_logits=True)
    _requests(engine)
    result = engine.run()
    assert attached.rebuilds == 1
    assert attached.layers["model.layers.0.self_attn"].params.scale == 0.3
    error, _ = _eager_error(reference, result)
    assert error < ATOL


def test_the_attached_model_runs_only_in_steps_and_detaches() -> None:
    model = _model("llama", seed=4)
    reference = copy.deepcopy(model)
    attached = _attach(model, "reference")
    ids = torch.tensor([[4, 8, 15, 16, 23]])
    with pytest.raises(StaleStepError, match="attached to attnkit and runs only in engine steps"):
        model(input_ids=ids)
    attached.detach()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def _bamba() -> torch.nn.Module:
    config = tf.BambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4,
        mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16,
    )  # fmt: skip
    return tf.AutoModelForCausalLM.from_config(config).eval()


def _deepseek() -> torch.nn.Module:
    config = tf.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8,
        q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
        n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1,
    )  # fmt: skip
    return tf.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(_bamba, r"layer model\.layers\.0\.mamba is a mamba2 state layer", id="bamba"),
        pytest.param(
            _deepseek, r"model\.layers\.0\.self_attn is multi-head latent attention", id="mla"
        ),
    ],
)
def test_unservable_layers_are_named(make: Callable[[], torch.nn.Module], message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        attach(make(), num_blocks=8)


def test_bad_arguments_are_named() -> None:
    model = _model("llama", seed=5)
    with pytest.raises(
        InvalidArgumentError, match="exactly one of num_blocks and memory_budget_bytes"
    ):
        attach(model)
    with pytest.raises(InvalidArgumentError, match=r"device='cuda', but the model is on cpu"):
        attach(model, num_blocks=8, device="cuda")
    model.train()
    with pytest.raises(InvalidArgumentError, match=r"training mode .* model\.eval\(\)"):
        attach(model, num_blocks=8)


def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(MissingDependencyError, match=r"pip install 'attnkit\[transformers\]'"):
        attach(torch.nn.Linear(2, 2), num_blocks=8)


def test_importing_attnkit_does_not_import_transformers() -> None:
    code = (
        "import sys, attnkit, attnkit.integrations.engine, attnkit.integrations.transformers\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------- torch.compile


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_compiled_attachment_matches_eager_as_one_graph(family: str) -> None:
    """``attached.compile(fullgraph=True)``: the whole model traces as one graph (a
    break would raise), the attention layers as ``attnkit::runtime_forward`` nodes, and
    every step's logits match transformers' own eager model (chunked prompts, decodes
    and a sampled request interleaved; gemma2: sliding windows and soft-caps)."""
    torch._dynamo.reset()
    model = _model(family)
    reference = copy.deepcopy(model)
    attached = _attach(model, "reference")
    attached.compile(backend="aot_eager", fullgraph=True, dynamic=True)
    engine = Engine(attached, max_tokens_per_step=BUDGET, keep_logits=True)
    _requests(engine)
    result = engine.run()
    error, _ = _eager_error(reference, result)
    assert error < ATOL


def test_compiling_without_the_operator_breaks_the_graph() -> None:
    """The broken variant: the model compiled without ``compile()``'s traced layers
    (the interface then looks the module up in its weak map, through the runtime's host
    code) cannot trace as one graph."""
    torch._dynamo.reset()
    attached = _attach(_model("llama"), "reference")
    attached._compiled = torch.compile(attached.model, backend="aot_eager", fullgraph=True)
    engine = Engine(attached, max_tokens_per_step=BUDGET)
    _requests(engine, max_new=1)
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):
        engine.run()


def test_compile_refuses_packed_linears() -> None:
    attached = attach(_model("llama"), num_blocks=40, block_size=4, pack_linears=True)
    with pytest.raises(InvalidArgumentError, match="linears='packed'"):
        attached.compile()
