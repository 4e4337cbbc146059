"""``attnkit demo --config CONFIG``: a real model's layer kinds, shrunk to the first two
layers of each kind in model order, served through the runtime with the dense check."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from attnkit import BackendRegistry, InvalidArgumentError, layout_from_hf_config
from attnkit.cli import main
from attnkit.demo import demo_layout

CONFIGS = Path(__file__).resolve().parent / "fixtures" / "model-configs"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # layer_types: 0-2 linear_attention (GDN), 3 full_attention, ...
        ("qwen3-next-80b-a3b-instruct", ("gdn", "gdn", "full", "full")),
        # sliding on even layers, full on odd ones
        ("gemma-2-9b-it", ("window", "full", "window", "full")),
        # full_attn_idxs [2, 5, 8, 10, 12, 14]: layers 0, 1 conv, 2 attention, 3 conv, ...
        ("lfm2-1.2b", ("short_conv", "short_conv", "full", "full")),
        ("llama-3.1-8b", ("full", "full")),
    ],
)
def test_demo_layout_keeps_two_layers_per_kind_in_model_order(
    name: str, expected: tuple[str, ...]
) -> None:
    assert demo_layout(layout_from_hf_config(CONFIGS / f"{name}.json")) == expected


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("deepseek-v3", "deepseek_v3 layer 'model.layers.0.self_attn' is mla_attention"),
        ("jamba-v0.1", "jamba layer 'model.layers.0.mamba' is mamba (mamba1)"),
    ],
)
def test_demo_layout_refuses_kinds_it_cannot_run(name: str, what: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        demo_layout(layout_from_hf_config(CONFIGS / f"{name}.json"))
    assert str(info.value).endswith(what)


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    registry = BackendRegistry(
        builtins={"reference": "attnkit.backends.reference:ReferenceBackend"}, entry_points=[]
    )
    status = main(argv, registry=registry, out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def test_demo_runs_a_real_layout() -> None:
    config = CONFIGS / "lfm2-1.2b.json"
    status, text, err = _run(["demo", "--config", str(config), "--steps", "1"])
    assert (status, err) == (0, "")
    assert text.startswith(
        f"attnkit demo: model lfm2 ({config}: short_conv, short_conv, full, full), 4 layers"
    )
    assert "  layers.0   mamba(short_conv) group 0" in text
    assert text.splitlines()[-1].startswith("PASS: ")


def test_demo_config_errors(tmp_path: Path) -> None:
    status, text, err = _run(["demo", "--config", str(CONFIGS / "deepseek-v3.json")])
    assert (status, text) == (2, "")
    assert err == (
        "attnkit demo: error: the demo runs full-attention, sliding-window, mamba2, gdn, "
        "linear and short_conv layers; deepseek_v3 layer 'model.layers.0.self_attn' is "
        "mla_attention\n"
    )
    missing = tmp_path / "config.json"
    status, text, err = _run(["demo", "--config", str(missing)])
    assert (status, text) == (2, "")
    assert err == (
        "attnkit demo: error: CONFIG must be a config.json or a directory holding one; "
        f"{str(missing)!r} does not exist\n"
    )
