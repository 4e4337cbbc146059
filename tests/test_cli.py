"""The ``attnkit`` command: ``backends`` and ``plan``."""

from __future__ import annotations

import io
import json
from importlib.metadata import EntryPoint

import pytest

from attnkit import BackendRegistry, KVCacheSpecKind
from attnkit.backend_api import ENTRY_POINT_GROUP
from attnkit.cli import EXAMPLE_MODELS, example_model, main
from toy_backends import FastCudaBackend, GenericToyBackend, ToyMambaBackend


def registry(with_broken_plugin: bool = False) -> BackendRegistry:
    eps = [EntryPoint("broken_plugin", "attnkit_no_such_module:B", ENTRY_POINT_GROUP)] if with_broken_plugin else []
    reg = BackendRegistry(entry_points=eps, allowlist=None)
    for backend in (GenericToyBackend, ToyMambaBackend, FastCudaBackend):
        reg.register(backend)
    return reg


def run(argv: list[str], reg: BackendRegistry) -> tuple[int, str]:
    out = io.StringIO()
    status = main(argv, registry=reg, out=out)
    return status, out.getvalue()


def test_backends_lists_availability_and_exclusions() -> None:
    status, text = run(["backends"], registry(with_broken_plugin=True))
    assert status == 0
    assert "  toy_generic [registered] available\n    kinds: full_attention, sliding_window\n" in text
    assert "  toy_fast_cuda [registered] unavailable\n" in text
    assert "    - device=cpu not supported (supported: cuda)\n" in text
    assert "  broken_plugin [plugin] unavailable\n" in text
    assert "    - excluded: ModuleNotFoundError: No module named 'attnkit_no_such_module'\n" in text


def test_backends_json_on_cuda() -> None:
    status, text = run(["backends", "--json", "--device", "cuda"], registry())
    assert status == 0
    data = json.loads(text)
    assert data["device"] == "cuda"
    rows = {r["name"]: r for r in data["backends"]}
    assert rows["toy_fast_cuda"]["reasons"] == ["compute capability unknown (pass capability=(major, minor))"]
    assert rows["toy_generic"]["available"] is True
    # The kinds listed are those the backend binds, nothing more.
    assert rows["toy_generic"]["kinds"] == ["full_attention", "sliding_window"]
    assert rows["toy_mamba"]["kinds"] == ["mamba"]


def test_backends_lists_the_kinds_each_builtin_binds() -> None:
    reg = BackendRegistry(
        builtins={"reference": "attnkit.backends.reference:ReferenceBackend"}, discover_plugins=False
    )
    status, text = run(["backends", "--json"], reg)
    assert status == 0
    (row,) = json.loads(text)["backends"]
    assert row["name"] == "reference"
    assert row["kinds"] == sorted(k.value for k in KVCacheSpecKind)
    status, text = run(["backends"], reg)
    assert "    kinds: " + ", ".join(sorted(k.value for k in KVCacheSpecKind)) + "\n" in text


def test_backends_with_none_registered() -> None:
    assert run(["backends"], BackendRegistry(discover_plugins=False)) == (0, "no backends are registered\n")


def test_plan_routes_groups_and_explains() -> None:
    status, text = run(["plan", "--model", "hybrid"], registry())
    assert status == 0
    assert "layers.0: full_attention (FullAttentionSpec)\n  -> toy_generic (chosen by priority)\n" in text
    assert "layers.1, layers.3, layers.5: mamba (MambaSpec)\n  -> toy_mamba (chosen by priority)\n" in text
    # Alphabetical fallback order: toy_fast_cuda and toy_generic are tried first.
    assert "     skipped toy_fast_cuda: device=cpu not supported (supported: cuda)" in text
    assert "layers.4: chunked_local_attention (ChunkedLocalAttentionSpec)\n  NO BACKEND\n" in text
    assert text.endswith("\n1 group(s) have no backend\n")


def test_plan_strict_fails_on_unserved_layers() -> None:
    status, _ = run(["plan", "--model", "hybrid", "--strict"], registry())
    assert status == 1
    status, _ = run(["plan", "--model", "gemma2", "--strict"], registry())
    assert status == 0


def test_plan_per_kind_override_and_explicit_failure() -> None:
    status, text = run(
        ["plan", "--model", "gemma2", "--device", "cuda", "--capability", "9.0",
         "--backend-per-kind", "sliding_window=toy_fast_cuda"],
        registry(),
    )
    assert status == 0
    assert "layers.0, layers.2, layers.4: sliding_window (SlidingWindowSpec)\n  -> toy_fast_cuda (chosen by backend_per_kind)" in text
    status, text = run(
        ["plan", "--model", "gemma2", "--backend-per-kind", "sliding_window=toy_fast_cuda"], registry()
    )
    assert "NO BACKEND" in text
    assert "backend 'toy_fast_cuda' was requested by AttentionConfig.backend_per_kind['sliding_window']" in text
    assert "- device=cpu not supported (supported: cuda)" in text


def test_plan_bad_config_is_a_usage_error() -> None:
    status, text = run(["plan", "--backend-per-kind", "slidingwindow=toy_generic"], registry())
    assert status == 2
    assert text.startswith("error: backend_per_kind: unknown kind 'slidingwindow'; valid kinds: full_attention,")
    status, text = run(["plan", "--backend", "nope"], registry())
    assert (status, text) == (2, "error: backend: unknown backend 'nope'; registered backends: toy_fast_cuda, toy_generic, toy_mamba\n")


def test_plan_rejects_bad_capability(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--capability", "9"], registry=registry())
    assert info.value.code == 2
    assert "--capability must look like 9.0, got '9'" in capsys.readouterr().err


def test_example_models() -> None:
    for name in EXAMPLE_MODELS:
        layers = example_model(name)
        assert layers
        assert all(key.startswith("layers.") for key in layers)
    kinds = [s.kind.value for s in example_model("llama4").values()]
    assert kinds == ["chunked_local_attention"] * 3 + ["full_attention"] + ["chunked_local_attention"] * 3 + ["full_attention"]
    with pytest.raises(ValueError, match=r"unknown example model 'gpt'; choose one of hybrid, llama, gemma2, llama4"):
        example_model("gpt")
