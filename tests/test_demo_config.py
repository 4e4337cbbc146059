"""``attnkit demo --config CONFIG``: a real model's layer kinds, shrunk to the first two
layers of each kind in model order, served through the runtime with the dense check.

Every fixture config runs (MLA, chunked-local, learned sinks, encoder-only,
encoder-decoder and Mamba1 layouts included); the dense check is the demo's own
definition of each kind, so a dense path that misses part of a kind's definition fails.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import attnkit.cli._demo as cli_demo
import attnkit.demo as demo
import attnkit.demo._attention as demo_attention
import attnkit.demo._mixer as demo_mixer
import attnkit.demo._state as demo_state
from attnkit import BackendRegistry, InvalidArgumentError, layout_from_hf_config
from attnkit.cli import main
from attnkit.demo import DemoModel, demo_layout, run_demo
from attnkit.models import ModelLayout
from attnkit.params import AttentionLayerParams
from attnkit.registry import BUILTIN_BACKENDS
from attnkit.spec import EncoderOnlyAttentionSpec, KVCacheSpec, MambaSpec

CONFIGS = Path(__file__).resolve().parent / "fixtures" / "model-configs"
FIXTURES = sorted(p.stem for p in CONFIGS.glob("*.json"))

# Synthetic configs of tests/test_models.py: the families without a fixture file.
SYNTHETIC: dict[str, dict[str, Any]] = {
    "llama4": {
        "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text",
            "hidden_size": 5120,
            "num_hidden_layers": 8,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "attention_chunk_size": 8192,
            "no_rope_layer_interval": 4,
        },
        "torch_dtype": "bfloat16",
    },
    "bart": {
        "model_type": "bart",
        "d_model": 768,
        "encoder_layers": 6,
        "decoder_layers": 6,
        "encoder_attention_heads": 12,
        "decoder_attention_heads": 12,
    },
}


def _layout(name: str) -> ModelLayout:
    if name in SYNTHETIC:
        return layout_from_hf_config(SYNTHETIC[name])
    return layout_from_hf_config(CONFIGS / f"{name}.json")


def test_every_fixture_config_is_covered() -> None:
    assert set(EXPECTED_KINDS) | SPARSE == set(FIXTURES) | set(SYNTHETIC)


SPARSE = {"deepseek-v3.2-exp"}
"""Configs with DeepSeek sparse attention: the sparse demo (indexer + sparse MLA)."""


def test_demo_config_of_a_sparse_model_passes_its_dense_oracle() -> None:
    """DeepSeek-V3.2: layer pairs (MLA + indexer) through select and sparse forward, every
    step's selection equal to the oracle's top-k and its output to the masked dense
    attention."""
    status, text, err = _run(["demo", "--config", str(CONFIGS / "deepseek-v3.2-exp.json"), "--steps", "2"])
    assert (status, err) == (0, ""), text
    assert text.startswith("sparse attention (DSA) demo of deepseek_v32: 2 layer pair(s)")
    assert "model.layers.0.self_attn.indexer: indexer -> reference" in text
    steps = [line for line in text.splitlines() if line.startswith("step ")]
    assert len(steps) == 4
    assert all(line.endswith("PASS") for line in steps), text


def test_a_topk_one_short_fails_the_sparse_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: an indexer that keeps one position too few fails the oracle's check."""
    import attnkit.backends.reference.indexer as ref_indexer

    real = ref_indexer.topk_select

    def one_short(logits: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs["topk"] -= 1
        indices, lens = real(logits, **kwargs)
        pad = torch.full((indices.shape[0], 1), -1, dtype=indices.dtype)
        return torch.cat([indices, pad], dim=1), lens

    monkeypatch.setattr(ref_indexer.ReferenceIndexerImpl, "_topk", staticmethod(one_short))
    status, text, err = _run(["demo", "--config", str(CONFIGS / "deepseek-v3.2-exp.json"), "--steps", "1"])
    assert status != 0
    assert "FAIL" in text
    assert "sparse-attention oracle" in err


EXPECTED_KINDS: dict[str, tuple[str, ...]] = {
    # attn_layer_period 8, offset 4 (Bamba): Mamba2 layers 0-3, attention at 4, ...
    "bamba-9b": ("mamba", "mamba", "full", "full"),
    "bert-base-uncased": ("encoder", "encoder"),
    "deepseek-v3": ("mla", "mla"),
    # sliding on even layers, full on odd ones
    "gemma-2-9b-it": ("window", "full", "window", "full"),
    # sliding on even layers, every layer with learned sinks
    "gpt-oss-20b": ("window_sinks", "full_sinks", "window_sinks", "full_sinks"),
    # attn_layer_period 8, offset 4: Mamba (1) layers 0-3, attention at 4, ...
    "jamba-v0.1": ("mamba1", "mamba1", "full", "full"),
    # full_attn_idxs [2, 5, 8, 10, 12, 14]: layers 0, 1 conv, 2 attention, 3 conv, ...
    "lfm2-1.2b": ("short_conv", "short_conv", "full", "full"),
    "llama-3.1-8b": ("full", "full"),
    "mistral-7b-v0.1": ("window", "window"),
    "qwen2.5-7b": ("full", "full"),
    # layer_types: 0-2 linear_attention (GDN), 3 full_attention, ...
    "qwen3-next-80b-a3b-instruct": ("gdn", "gdn", "full", "full"),
    # 6 encoder blocks, then 6 decoder blocks of self-attention + cross-attention
    "t5-small": ("encoder", "encoder", "full", "cross", "full", "cross"),
    # chunked-local RoPE layers, NoPE full attention every 4th layer
    "llama4": ("chunked", "chunked", "full", "full"),
    "bart": ("encoder", "encoder", "full", "cross", "full", "cross"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_KINDS))
def test_demo_layout_keeps_two_layers_per_kind_in_model_order(name: str) -> None:
    assert demo_layout(_layout(name)) == EXPECTED_KINDS[name]


def _signature(spec: KVCacheSpec, sinks: bool) -> tuple[str, str | None, bool]:
    """A layer's kind as the runtime sees it: spec kind, state type, learned sinks."""
    return spec.kind.value, spec.mamba_type if isinstance(spec, MambaSpec) else None, sinks


@pytest.mark.parametrize("name", sorted(EXPECTED_KINDS))
def test_demo_model_layers_have_the_models_kinds_in_order(name: str) -> None:
    """The demo model built from ``demo_layout`` has, layer by layer, the kinds of the
    model's first two layers of each kind (spec kind, state type, sinks), in model order."""
    layout = _layout(name)
    wanted: list[tuple[str, str | None, bool]] = []
    for info in layout.layers.values():
        signature = _signature(info.spec, info.has_sinks)
        if wanted.count(signature) < 2:
            wanted.append(signature)
    model = DemoModel(layout=demo_layout(layout))
    got: list[tuple[str, str | None, bool]] = []
    for name_, spec in model.specs.items():
        params = model.params[name_]
        sinks = isinstance(params, AttentionLayerParams) and params.sinks is not None
        got.append(_signature(spec, sinks))
    assert got == wanted


def _run(argv: list[str], registry: BackendRegistry | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    registry = registry or BackendRegistry(
        builtins={"reference": "attnkit.backends.reference:ReferenceBackend"}, entry_points=[]
    )
    status = main(argv, registry=registry, out=out, err=err)
    return status, out.getvalue(), err.getvalue()


MODES = {
    "bert-base-uncased": "encoder-only",
    "t5-small": "encoder-decoder",
    "bart": "encoder-decoder",
}


@pytest.mark.parametrize("name", sorted(EXPECTED_KINDS))
def test_demo_config_passes_its_dense_check(name: str, tmp_path: Path) -> None:
    """``attnkit demo --config`` on the reference backends: every step within tolerance."""
    if name in SYNTHETIC:
        config = tmp_path / "config.json"
        config.write_text(json.dumps(SYNTHETIC[name]))
    else:
        config = CONFIGS / f"{name}.json"
    status, text, err = _run(["demo", "--config", str(config), "--steps", "1"])
    assert (status, err) == (0, ""), text
    kinds = ", ".join(EXPECTED_KINDS[name])
    assert text.startswith(f"attnkit demo: model {_layout(name).model_type} ({config}: {kinds}), ")
    lines = text.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert steps
    assert all(line.endswith("PASS") for line in steps), text
    # The error figure of each step is printed and within the float32 tolerance.
    errors = [float(m) for m in re.findall(r"max\|err\| (\S+)  ", text)]
    assert len(errors) == len(steps)
    assert all(0 <= e <= 2e-5 for e in errors)
    assert lines[-1].startswith(f"PASS: {len(steps)} steps, ")
    mode = MODES.get(name)
    if mode is None:
        assert not any(line.startswith("mode: ") for line in lines)
        assert not any("encode [" in line for line in steps)
    else:
        assert f"mode: {mode}: " in text
        encoder_steps = [line for line in steps if "  encode [" in line]
        # Each request's prompt (source) is encoded whole, once.
        encoded = re.findall(r"(req-[a-z]+):(\d+)", " ".join(encoder_steps))
        assert sorted(encoded) == [
            ("req-a", "5"),
            ("req-b", "12"),
            ("req-c", "3"),
            ("req-long", "40"),
        ]
        if mode == "encoder-only":
            assert encoder_steps == steps  # no decode steps


def test_demo_config_runs_the_long_prompt_of_an_encoder_whole() -> None:
    """Encoder-only layers take a request in one step: the 40-token prompt exceeds the
    16-token budget and is still encoded in one step, alone."""
    status, text, _ = _run(["demo", "--config", str(CONFIGS / "bert-base-uncased.json")])
    assert status == 0
    assert re.search(r"step  \d  encode \[req-long:40\] ", text), text


@pytest.mark.parametrize(("name", "dtype"), [("deepseek-v3", "float16"), ("t5-small", "bfloat16")])
def test_demo_config_16_bit(name: str, dtype: str) -> None:
    """MLA (absorbed vs unabsorbed) and an encoder-decoder stack in 16-bit dtypes."""
    status, text, err = _run(
        ["demo", "--config", str(CONFIGS / f"{name}.json"), "--steps", "1", "--dtype", dtype]
    )
    assert (status, err) == (0, ""), text


def test_more_layouts_pass() -> None:
    """Kinds no fixture config has: sliding-window MLA, sink tokens, chunked with sinks,
    MLA with sinks, and a decoder with a state layer reading an encoder."""
    registry = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    layouts = [
        ("mla_window", "mla", "sink_tokens", "chunked_sinks", "mla_sinks"),
        ("encoder", "mamba1", "cross"),
    ]
    for layout in layouts:
        out = io.StringIO()
        result = run_demo(
            layout=layout, model_name="mixed", decode_steps=1, out=out, registry=registry
        )
        assert result.passed, out.getvalue()
        assert 0 <= result.max_error <= 2e-5


def _triton_backend(text: str, layer: str) -> str:
    match = re.search(rf"^  {layer} .* -> (\S+) ", text, flags=re.MULTILINE)
    assert match is not None, text
    return match.group(1)


@pytest.mark.parametrize(
    ("layout", "triton_layers"),
    [
        pytest.param(
            ("chunked", "window_sinks", "mamba1"),
            {"layers.0": "triton_attn", "layers.1": "triton_attn", "layers.2": "triton_mamba1"},
            id="chunked-sinks-mamba1",
        ),
        pytest.param(
            ("encoder", "full", "cross"),
            {"layers.0": "triton_attn", "layers.1": "triton_attn", "layers.2": "triton_attn"},
            id="encoder-decoder",
        ),
    ],
)
def test_triton_backends_serve_the_new_kinds(
    layout: tuple[str, ...], triton_layers: dict[str, str]
) -> None:
    """``--prefer triton`` (under the interpreter on CPU): the Triton backends serve
    chunked-local, sinks, Mamba1, encoder-only and cross-attention layers, and pass."""
    registry = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    out = io.StringIO()
    result = run_demo(
        layout=layout,
        model_name="triton",
        decode_steps=1,
        out=out,
        registry=registry,
        prefer="triton",
    )
    text = out.getvalue()
    assert result.passed, text
    for layer, backend in triton_layers.items():
        assert _triton_backend(text, layer) == backend


# ---- the check catches a dense path that misses part of a kind's definition


def _mask_without_chunks(mask: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    return ORIGINAL_MASK(dataclasses.replace(mask, chunk=None), *args, **kwargs)


def _causal_encoder_mask(mask: Any, rows: int, cols: int, **kwargs: Any) -> torch.Tensor:
    return ORIGINAL_MASK(dataclasses.replace(mask, causal=True), rows, cols, **kwargs)


def _attend_without_sinks(*args: Any, **kwargs: Any) -> torch.Tensor:
    return ORIGINAL_ATTEND(*args, **{**kwargs, "sinks": None})


ORIGINAL_MASK = demo_attention._mask
ORIGINAL_ATTEND = demo_attention._attend


@pytest.mark.parametrize(
    ("name", "attribute", "broken"),
    [
        pytest.param("llama4", "_mask", _mask_without_chunks, id="chunked-mask-ignored"),
        pytest.param("bert-base-uncased", "_mask", _causal_encoder_mask, id="encoder-made-causal"),
        pytest.param("gpt-oss-20b", "_attend", _attend_without_sinks, id="sinks-dropped"),
    ],
)
def test_a_broken_dense_path_fails_the_check(
    name: str, attribute: str, broken: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error figure is computed against the dense definition: the run that
    ``test_demo_config_passes_its_dense_check`` passes fails, with an error far above
    the tolerance, once the dense path misses one part of the kind's definition."""
    layout = demo_layout(_layout(name))
    registry = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)

    def run() -> tuple[demo.DemoResult, str]:
        out = io.StringIO()
        result = run_demo(
            layout=layout, model_name=name, decode_steps=1, out=out, registry=registry
        )
        return result, out.getvalue()

    monkeypatch.setattr(demo_attention, attribute, broken)
    bad, text = run()
    assert not bad.passed
    assert bad.max_error > 1e-2  # 500x the tolerance: a real difference, not rounding
    assert "FAIL" in text
    assert text.splitlines()[-1].startswith("FAIL: ")


def test_a_broken_mamba1_recurrence_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mamba1's dense recurrence without the skip term ``D * u``: the check fails."""
    layout = demo_layout(_layout("jamba-v0.1"))
    original = demo_state._Mamba1.dense

    def dense_without_skip(
        self: demo_state._Mamba1,
        h: torch.Tensor,
        ctx: demo_mixer.Context = demo_mixer.NO_CONTEXT,
    ) -> torch.Tensor:
        params = self.params
        assert params.D is not None
        self.params = dataclasses.replace(params, D=torch.zeros_like(params.D))
        try:
            return original(self, h, ctx)
        finally:
            self.params = params

    monkeypatch.setattr(demo_state._Mamba1, "dense", dense_without_skip)
    out = io.StringIO()
    result = run_demo(layout=layout, model_name="jamba", decode_steps=1, out=out)
    assert not result.passed
    assert result.max_error > 1e-2


# ---- what the demo still refuses


def _without(layout: ModelLayout, kind: type) -> ModelLayout:
    layers = {n: i for n, i in layout.layers.items() if not isinstance(i.spec, kind)}
    return ModelLayout(model_type=layout.model_type, dtype=layout.dtype, layers=layers)


def test_demo_layout_refuses_cross_attention_without_an_encoder() -> None:
    decoder_only = _without(_layout("t5-small"), EncoderOnlyAttentionSpec)
    with pytest.raises(InvalidArgumentError) as info:
        demo_layout(decoder_only)
    assert str(info.value) == (
        "the demo cannot run t5 layer 'decoder.block.0.layer.1.EncDecAttention': it is a "
        "cross-attention layer with no encoder-only layer before it: there is no encoder "
        "output for it to read"
    )


def test_demo_layout_refuses_an_encoder_layer_after_decoder_layers() -> None:
    t5 = _layout("t5-small")
    names = list(t5.layers)
    # The first decoder layer, then the encoder, then the rest of the decoder.
    reordered = {n: t5.layers[n] for n in [names[6], *names[:6], *names[7:]]}
    with pytest.raises(InvalidArgumentError) as info:
        demo_layout(ModelLayout(model_type="t5", dtype=t5.dtype, layers=reordered))
    assert str(info.value) == (
        "the demo cannot run t5 layer 'encoder.block.0.layer.0.SelfAttention': it is an "
        "encoder-only layer after a decoder layer (index 0); the demo runs the encoder-only "
        "layers first, as one encoder stack"
    )


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (
            ("full", "mamba_sinks"),
            "unknown layer kind 'mamba_sinks' in layout; use one of full, window, chunked, "
            "sink_tokens, encoder, cross, mla, mla_window, mamba, mamba1, gdn, linear, "
            "short_conv (attention and MLA kinds may end in '_sinks')",
        ),
        (
            ("cross", "full"),
            "layout[0] ('cross') is a cross-attention layer with no encoder-only layer before "
            "it: there is no encoder output for it to read",
        ),
    ],
)
def test_demo_model_refuses_bad_layouts(layout: tuple[str, ...], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        DemoModel(layout=layout)
    assert str(info.value) == message


def test_demo_config_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = CONFIGS / "t5-small.json"
    decoder_only = _without(layout_from_hf_config(config), EncoderOnlyAttentionSpec)

    def layout_without_encoder(path: object) -> ModelLayout:
        return decoder_only

    monkeypatch.setattr(cli_demo, "layout_from_hf_config", layout_without_encoder)
    status, text, err = _run(["demo", "--config", str(config)])
    assert (status, text) == (2, "")
    assert err == (
        "attnkit demo: error: the demo cannot run t5 layer "
        "'decoder.block.0.layer.1.EncDecAttention': it is a cross-attention layer with no "
        "encoder-only layer before it: there is no encoder output for it to read\n"
    )
    missing = tmp_path / "config.json"
    status, text, err = _run(["demo", "--config", str(missing)])
    assert (status, text) == (2, "")
    assert err == (
        "attnkit demo: error: CONFIG must be a config.json or a directory holding one; "
        f"{str(missing)!r} does not exist\n"
    )


def test_demo_runs_a_real_layout() -> None:
    config = CONFIGS / "lfm2-1.2b.json"
    status, text, err = _run(["demo", "--config", str(config), "--steps", "1"])
    assert (status, err) == (0, "")
    assert text.startswith(
        f"attnkit demo: model lfm2 ({config}: short_conv, short_conv, full, full), 4 layers"
    )
    assert "  layers.0   mamba(short_conv) group 0" in text
    assert text.splitlines()[-1].startswith("PASS: ")
