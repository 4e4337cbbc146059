"""The ``attnkit`` command, in process: ``backends``, ``plan``, and ``run_demo``'s
argument checks (the catalogue of bad command lines, run as subprocesses, is
tests/test_bad_inputs_cli.py)."""

from __future__ import annotations

import io
import json
import re
from importlib.metadata import EntryPoint
from typing import Any

import pydantic
import pytest
import torch

from attnkit import (
    ArgumentTypeError,
    BackendRegistry,
    DeviceUnavailableError,
    InvalidArgumentError,
    KVCacheSpecKind,
)
from attnkit.backend_api import ENTRY_POINT_GROUP
from attnkit.cli import EXAMPLE_MODELS, example_model, main
from attnkit.demo import run_demo
from attnkit.devices import device_problem
from toy_backends import FastCudaBackend, GenericToyBackend, ToyMambaBackend

CUDA_PROBLEM = device_problem(torch.device("cuda"))
"""Why "cuda" is absent here (None on a CUDA machine)."""
NOTE = "showing what attnkit reports for it"


def registry(with_broken_plugin: bool = False) -> BackendRegistry:
    eps = (
        [EntryPoint("broken_plugin", "attnkit_no_such_module:B", ENTRY_POINT_GROUP)]
        if with_broken_plugin
        else []
    )
    reg = BackendRegistry(entry_points=eps, allowlist=None)
    for backend in (GenericToyBackend, ToyMambaBackend, FastCudaBackend):
        reg.register(backend)
    return reg


def run(argv: list[str], reg: BackendRegistry) -> tuple[int, str]:
    """Status and stdout; asserts that nothing went to stderr."""
    status, text, err = run_both(argv, reg)
    assert err == ""
    return status, text


def run_both(argv: list[str], reg: BackendRegistry) -> tuple[int, str, str]:
    """Status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    status = main(argv, registry=reg, out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def test_backends_lists_availability_and_exclusions() -> None:
    status, text = run(["backends"], registry(with_broken_plugin=True))
    assert status == 0
    assert (
        "  toy_generic [registered] available\n    kinds: full_attention, sliding_window\n" in text
    )
    assert "  toy_fast_cuda [registered] unavailable\n" in text
    assert "    - device=cpu not supported (supported: cuda)\n" in text
    assert "  broken_plugin [plugin] unavailable\n" in text
    assert "    - excluded: ModuleNotFoundError: No module named 'attnkit_no_such_module'\n" in text


def test_backends_json_on_cuda() -> None:
    status, text, err = run_both(["backends", "--json", "--device", "cuda"], registry())
    assert status == 0
    data = json.loads(text)
    assert data["device"] == "cuda"
    rows = {r["name"]: r for r in data["backends"]}
    # Where CUDA is absent, every row says so, and a note on stderr too.
    absent = [CUDA_PROBLEM] if CUDA_PROBLEM is not None else []
    assert err == "".join(f"attnkit backends: note: {p}; {NOTE}\n" for p in absent)
    assert rows["toy_fast_cuda"]["reasons"] == [
        "compute capability unknown (pass capability=(major, minor))",
        *absent,
    ]
    assert rows["toy_generic"]["reasons"] == absent
    assert rows["toy_generic"]["available"] is (CUDA_PROBLEM is None)
    # The kinds listed are those the backend binds, nothing more.
    assert rows["toy_generic"]["kinds"] == ["full_attention", "sliding_window"]
    assert rows["toy_mamba"]["kinds"] == ["mamba"]


def test_backends_lists_the_kinds_each_builtin_binds() -> None:
    reg = BackendRegistry(
        builtins={"reference": "attnkit.backends.reference:ReferenceBackend"},
        discover_plugins=False,
    )
    status, text = run(["backends", "--json"], reg)
    assert status == 0
    (row,) = json.loads(text)["backends"]
    assert row["name"] == "reference"
    assert row["kinds"] == sorted(k.value for k in KVCacheSpecKind)
    status, text = run(["backends"], reg)
    assert "    kinds: " + ", ".join(sorted(k.value for k in KVCacheSpecKind)) + "\n" in text


def test_backends_says_which_native_library_the_cpu_engines_run() -> None:
    from attnkit.kernels.attention.cpu_native import load_paged_decode
    from attnkit.registry import BUILTIN_BACKENDS

    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    lib = load_paged_decode()
    status, text = run(["backends"], reg)
    assert status == 0
    for name in ("cpu_attn", "cpu_mla"):
        block = re.split(r"\n  (?=\S)", text.split(f"  {name} [builtin]", 1)[1])[0]
        assert f"    runs with: {lib.origin} {lib.variant} library {lib.path} ({lib.why})" in block
        assert f"OpenMP runtime {lib.openmp_runtime}" in block
        assert f"prefill {lib.prefill_isa}; decode float32 {lib.decode_isa(0, 128)}" in block
    status, text = run(["backends", "--json"], reg)
    rows = {r["name"]: r for r in json.loads(text)["backends"]}
    assert rows["cpu_attn"]["notes"][0] == lib.describe()
    assert rows["reference"]["notes"] == []


def test_a_plugin_whose_notes_raise_gets_a_reason() -> None:
    """environment_notes runs behind the plugin guard like the other hooks: what it
    raises becomes a reason on its row, not an error of the listing."""

    class NoisyNotes(GenericToyBackend):
        name = "toy_noisy_notes"

        @classmethod
        def environment_notes(cls, device: torch.device) -> list[str]:
            raise RuntimeError("probe failed")

    reg = BackendRegistry(allowlist=None)
    reg.register(NoisyNotes)
    status, text = run(["backends"], reg)
    assert status == 0
    assert "toy_noisy_notes [registered] unavailable" in text
    assert "environment_notes()" in text
    assert "probe failed" in text


def test_backends_names_the_default_on_the_device() -> None:
    from attnkit.registry import BUILTIN_BACKENDS

    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    status, text = run(["backends"], reg)
    assert status == 0
    assert text.startswith(
        "backends on cpu:\n  default on cpu: cpu_attn, then cpu_mla, reference, triton_attn (each "
        "layer gets the first that serves it)\n"
    )
    assert "  cpu_attn [builtin] available (default on cpu)\n" in text
    assert "  reference [builtin] available\n" in text
    assert text.count("(default on cpu)") == 1
    status, text = run(["backends", "--json"], reg)
    assert json.loads(text)["default_order"] == ["cpu_attn", "cpu_mla", "reference", "triton_attn"]
    # Only registered names count: without cpu_attn, reference is the default here.
    reg = BackendRegistry(
        builtins={"reference": BUILTIN_BACKENDS["reference"]}, discover_plugins=False
    )
    status, text = run(["backends"], reg)
    assert "  default on cpu: reference (each layer gets the first that serves it)\n" in text
    assert "  reference [builtin] available (default on cpu)\n" in text
    # A registry with none of the priority list's backends names no default.
    status, text = run(["backends"], registry())
    assert "default on" not in text


def test_backends_with_none_registered() -> None:
    reg = BackendRegistry(discover_plugins=False)
    assert run(["backends"], reg) == (0, "no backends are registered\n")


def test_a_failing_plugin_hook_is_a_row_not_an_error() -> None:
    class Broken(GenericToyBackend):
        name = "toy_broken_hooks"

        @classmethod
        def device_reasons(cls, device: torch.device) -> list[str]:
            raise RuntimeError("probe failed")

    reg = registry()
    reg.register(Broken)
    status, text = run(["backends", "--json"], reg)
    assert status == 0
    row = {r["name"]: r for r in json.loads(text)["backends"]}["toy_broken_hooks"]
    assert row["available"] is False
    (reason,) = row["reasons"]
    assert re.fullmatch(
        r"registered backend 'toy_broken_hooks' \(.*\) failed in device_reasons\(\): "
        r"RuntimeError: probe failed",
        reason,
    ), reason
    assert row["kinds"] == ["full_attention", "sliding_window"]


def test_plan_routes_groups_and_explains() -> None:
    status, text, err = run_both(["plan", "--model", "llama4", "--report-only"], registry())
    assert (status, err) == (0, "")
    assert (
        "layers.3, layers.7: full_attention (FullAttentionSpec)\n"
        "  -> toy_generic (chosen by priority; determinism: none)\n"
        # Alphabetical fallback order: toy_fast_cuda is tried first.
        "     skipped toy_fast_cuda: device=cpu not supported (supported: cuda)\n"
        "  group 1: block size 16, 2 layer(s), layout interleaved, "
        # ceil(32768 / 16) = 2048 blocks at the default max_model_len
        "at most 2048 block(s) per request\n"
    ) in text
    assert (
        "layers.0, layers.1, ..., layers.6 (6 layers): chunked_local_attention "
        "(ChunkedLocalAttentionSpec)\n  NO BACKEND\n"
    ) in text
    assert "  layers.3  full_attention           -      -       -      1      toy_generic\n" in text
    assert "  layers.0  chunked_local_attention  -      -       8192   0      NONE\n" in text
    assert text.endswith("\n1 group(s) have no backend\n")


def test_plan_shows_the_block_size_the_runtime_runs() -> None:
    """The hybrid example's Mamba2 state (2147840 B) sets the unified page: attention
    pages of 65536 B fit 33 times (65536 * 33 = 2162688 >= 2147840), so a page holds 33
    kernel blocks of 16 tokens, and the toy attention backend (16 or 32) serves them."""
    status, text, err = run_both(["plan", "--model", "hybrid", "--report-only"], registry())
    assert (status, err) == (0, "")
    assert "groups (unified page 2162688 B):\n" in text
    assert (
        "layers.1, layers.3, layers.5: mamba (MambaSpec)\n  -> toy_mamba (chosen by priority; determinism: none)\n"
        in text
    )
    assert (
        "layers.0: full_attention (FullAttentionSpec)\n  -> toy_generic (chosen by priority; determinism: none)\n"
        in text
    )
    # ceil(32768 / 16) = 2048 kernel blocks, ceil(2048 / 33) = 63 pages.
    assert (
        "  group 0: block size 16, 33 per page of 528 tokens, 1 layer(s), layout interleaved, "
        "at most 2048 kernel block(s) in 63 page(s) per request\n"
    ) in text
    assert text.endswith("\n1 group(s) have no backend\n")  # chunked-local: no toy serves it


@pytest.mark.parametrize("flags", [[], ["--strict"]], ids=["default", "strict"])
def test_plan_fails_on_unserved_layers(flags: list[str]) -> None:
    status, text, err = run_both(["plan", "--model", "llama4", *flags], registry())
    assert status == 1
    # The same report as --report-only on stdout; the verdict on stderr.
    assert text == run(["plan", "--model", "llama4", "--report-only"], registry())[1]
    assert err == (
        "attnkit plan: error: no backend for 1 of 2 layer group(s): "
        "layers.0, layers.1, ..., layers.6 (6 layers) (chunked_local_attention) "
        "(the report on stdout says why; --report-only exits 0)\n"
    )
    assert run(["plan", "--model", "gemma2", *flags], registry())[0] == 0


def test_plan_per_kind_override_and_explicit_failure() -> None:
    status, text = run(
        ["plan", "--model", "gemma2", "--backend-per-kind", "sliding_window=toy_generic"],
        registry(),
    )
    assert status == 0
    assert (
        "layers.0, layers.2, layers.4: sliding_window (SlidingWindowSpec)\n"
        "  -> toy_generic (chosen by backend_per_kind; determinism: none)"
    ) in text
    status, text = run(
        [
            "plan",
            "--model",
            "gemma2",
            "--report-only",
            "--backend-per-kind",
            "sliding_window=toy_fast_cuda",
        ],
        registry(),
    )
    assert status == 0
    assert "NO BACKEND" in text
    assert (
        "backend 'toy_fast_cuda' was requested by "
        "AttentionConfig.backend_per_kind['sliding_window']"
    ) in text
    assert "- device=cpu not supported (supported: cuda)" in text


@pytest.mark.skipif(CUDA_PROBLEM is None, reason="CUDA is available here")
def test_plan_on_an_absent_device_reports_it() -> None:
    """Without a capability there is nothing to plan for: every backend is rejected
    with the device reason."""
    status, text, err = run_both(
        [
            "plan",
            "--model",
            "llama",
            "--device",
            "cuda",
            "--backend-per-kind",
            "full_attention=toy_fast_cuda",
        ],
        registry(),
    )
    assert status == 1
    assert f"    - {CUDA_PROBLEM}\n" in text
    assert err.startswith(
        f"attnkit plan: note: {CUDA_PROBLEM}; pass --capability X.Y to plan for it as a "
        "hypothetical device\n"
    )
    assert "attnkit plan: error: no backend for 1 of 1 layer group(s)" in err


@pytest.mark.skipif(CUDA_PROBLEM is None, reason="CUDA is available here")
def test_plan_for_a_gpu_this_machine_lacks() -> None:
    """With --capability, an absent CUDA device is planned for as hypothetical
    hardware: the routing a GPU machine would get (the toy CUDA backend serves)."""
    status, text, err = run_both(
        [
            "plan",
            "--model",
            "llama",
            "--device",
            "cuda",
            "--capability",
            "9.0",
            "--backend-per-kind",
            "full_attention=toy_fast_cuda",
        ],
        registry(),
    )
    assert status == 0
    assert "  -> toy_fast_cuda (chosen by backend_per_kind; determinism: none)" in text
    assert CUDA_PROBLEM is not None  # the skipif above
    assert CUDA_PROBLEM not in text
    assert err == (
        f"attnkit plan: note: {CUDA_PROBLEM}; planning for it as a hypothetical device of "
        "capability 9.0 (installed packages still count)\n"
    )


def test_plan_bad_config_is_a_usage_error() -> None:
    status, text, err = run_both(
        ["plan", "--backend-per-kind", "slidingwindow=toy_generic"], registry()
    )
    assert (status, text) == (2, "")
    assert err.startswith(
        "attnkit plan: error: backend_per_kind: unknown kind 'slidingwindow'; "
        "valid kinds: full_attention,"
    )
    assert err.count("\n") == 1
    status, text, err = run_both(["plan", "--backend", "nope"], registry())
    assert (status, text, err) == (
        2,
        "",
        "attnkit plan: error: backend: unknown backend 'nope'; "
        "registered backends: toy_fast_cuda, toy_generic, toy_mamba\n",
    )


@pytest.mark.parametrize(
    "argv",
    [["--debug", "plan", "--backend", "nope"], ["plan", "--debug", "--backend", "nope"]],
    ids=["global", "after-the-command"],
)
def test_debug_reraises_user_errors(argv: list[str]) -> None:
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(pydantic.ValidationError, match="unknown backend 'nope'"):
        main(argv, registry=registry(), out=out, err=err)
    assert (out.getvalue(), err.getvalue()) == ("", "")


def test_plan_rejects_bad_capability(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--capability", "9"], registry=registry())
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "attnkit plan: error: argument --capability: must look like 9.0 "
        "(MAJOR.MINOR, digits only), got '9'\n"
        "see 'attnkit plan --help'\n"
    )


@pytest.mark.parametrize(
    "command", [[], ["backends"], ["plan"], ["demo"]], ids=["attnkit", "backends", "plan", "demo"]
)
def test_help_is_plain_text_and_short(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"], registry=registry())
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: attnkit {' '.join(command)}".rstrip() + " [-h]")
    assert "``" not in text  # no reST markup
    # The JSON keys are documented in docs/models.md, not listed in --help.
    assert "per_request_cap_bytes" not in text
    assert len(text.splitlines()) < 100


def test_example_models() -> None:
    for name in EXAMPLE_MODELS:
        layers = example_model(name)
        assert layers
        assert all(key.startswith("layers.") for key in layers)
    kinds = [s.kind.value for s in example_model("llama4").values()]
    assert kinds == (["chunked_local_attention"] * 3 + ["full_attention"]) * 2
    with pytest.raises(
        ValueError,
        match=r"unknown example model 'gpt'; choose one of hybrid, llama, gemma2, llama4",
    ):
        example_model("gpt")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        pytest.param(
            {"decode_steps": 0},
            InvalidArgumentError,
            r"^decode_steps must be an int >= 1, got 0$",
            id="steps-0",
        ),
        pytest.param(
            {"decode_steps": True},
            ArgumentTypeError,
            r"^decode_steps must be an int >= 1, got True \(bool\)$",
            id="steps-bool",
        ),
        pytest.param(
            {"token_budget": -1},
            InvalidArgumentError,
            r"^token_budget must be an int >= 1, got -1$",
            id="budget",
        ),
        pytest.param(
            {"dtype": torch.int8},
            InvalidArgumentError,
            r"^dtype must be one of torch.float32, torch.float16, torch.bfloat16, "
            r"got torch.int8$",
            id="dtype",
        ),
        pytest.param(
            {"dtype": "float16"},
            ArgumentTypeError,
            r"^dtype must be a torch.dtype, got 'float16' \(str\)$",
            id="dtype-str",
        ),
        pytest.param(
            {"model_name": "big"},
            InvalidArgumentError,
            r"^unknown model 'big'; choose one of default, hybrid$",
            id="model",
        ),
        pytest.param(
            {"prefer": "fast"},
            InvalidArgumentError,
            r"^prefer must be one of default, reference, triton, flex, got 'fast'$",
            id="prefer",
        ),
        pytest.param(
            {"device": "tpu"},
            InvalidArgumentError,
            r"^device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'",
            id="tpu",
        ),
        pytest.param(
            {"device": "cuda"},
            DeviceUnavailableError,
            re.escape(str(CUDA_PROBLEM)),
            marks=pytest.mark.skipif(CUDA_PROBLEM is None, reason="CUDA is available here"),
            id="absent-cuda",
        ),
    ],
)
def test_run_demo_rejects_bad_arguments_before_running(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    out = io.StringIO()
    with pytest.raises(error, match=match):
        run_demo(out=out, registry=registry(), **kwargs)
    assert out.getvalue() == ""  # nothing ran
