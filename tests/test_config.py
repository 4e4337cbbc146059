"""AttentionConfig parsing and validation."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

import attnkit
from attnkit import (
    AttentionConfig,
    AttnkitError,
    BackendNotSupportedError,
    BackendOptions,
    BackendRegistry,
    FullAttentionSpec,
    KVCacheSpecKind,
    MambaSpec,
    Rejection,
    default_registry,
    parse_backend_per_kind,
    select_backend,
)
from attnkit.backends.flash_attn import FlashAttentionOptions
from toy_backends import GenericToyBackend, ToyMambaBackend

KNOWN = {"known_backends": ["reference", "triton_attn", "toy_generic"]}
FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
MAMBA = MambaSpec(block_size=1, shapes=((4, 3),), dtypes=(torch.float32,))
VALID_KINDS = (
    "full_attention, sliding_window, chunked_local_attention, sink_full_attention, "
    "mla_attention, sliding_window_mla, encoder_only_attention, cross_attention, mamba"
)


def make(data: dict[str, Any], context: dict[str, Any] | None = None) -> AttentionConfig:
    return AttentionConfig.model_validate(data, context=context if context is not None else KNOWN)


def test_defaults() -> None:
    cfg = make({})
    assert cfg.backend is None
    assert cfg.backend_per_kind == {}
    assert cfg.plugins is None


@pytest.mark.parametrize(
    "value",
    [
        pytest.param({"sliding_window": "triton_attn", "full_attention": "reference"}, id="dict-of-strings"),
        pytest.param(
            {KVCacheSpecKind.SLIDING_WINDOW: "triton_attn", KVCacheSpecKind.FULL_ATTENTION: "reference"},
            id="dict-of-kinds",
        ),
        pytest.param("sliding_window=triton_attn,full_attention=reference", id="cli-string"),
        pytest.param(" sliding_window = triton_attn , full_attention=reference, ", id="cli-spaces"),
    ],
)
def test_backend_per_kind_forms(value: object) -> None:
    cfg = make({"backend_per_kind": value})
    assert cfg.backend_per_kind == {
        KVCacheSpecKind.SLIDING_WINDOW: "triton_attn",
        KVCacheSpecKind.FULL_ATTENTION: "reference",
    }
    assert all(type(k) is KVCacheSpecKind for k in cfg.backend_per_kind)


@pytest.mark.parametrize("kind", [k.value for k in KVCacheSpecKind])
def test_every_kind_is_addressable(kind: str) -> None:
    cfg = make({"backend_per_kind": f"{kind}=toy_generic"})
    assert cfg.backend_per_kind == {KVCacheSpecKind(kind): "toy_generic"}


def test_unknown_kind_lists_valid_kinds() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        make({"backend_per_kind": {"sliding": "triton_attn"}})
    assert f"backend_per_kind: unknown kind 'sliding'; valid kinds: {VALID_KINDS}" in str(info.value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param("sliding_window", "backend_per_kind entry 'sliding_window' must look like 'kind=backend'", id="no-equals"),
        pytest.param(
            "mamba=reference,mamba=triton_attn", "backend_per_kind: kind 'mamba' is given twice", id="twice"
        ),
        pytest.param({"mamba": 3}, "backend_per_kind['mamba'] must be a backend name, got 3", id="not-a-name"),
        pytest.param("mamba=", "backend_per_kind['mamba'] must be a backend name, got ''", id="empty-name"),
        pytest.param(["mamba"], "backend_per_kind must be a mapping or a 'kind=backend,...' string, got list", id="list"),
    ],
)
def test_bad_backend_per_kind(value: object, message: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        make({"backend_per_kind": value})
    assert message in str(info.value)


def test_unknown_backend_lists_registered_from_context_names() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        make({"backend": "flash"})
    assert "backend: unknown backend 'flash'; registered backends: reference, toy_generic, triton_attn" in str(info.value)
    with pytest.raises(pydantic.ValidationError) as info:
        make({"backend_per_kind": "mamba=mamba_ssm"})
    assert (
        "backend_per_kind['mamba']: unknown backend 'mamba_ssm'; registered backends: "
        "reference, toy_generic, triton_attn"
    ) in str(info.value)


def test_names_are_checked_against_a_registry_in_context() -> None:
    reg = BackendRegistry(discover_plugins=False)
    reg.register(ToyMambaBackend)
    cfg = make({"backend_per_kind": {"mamba": "toy_mamba"}}, context={"registry": reg})
    assert cfg.backend_per_kind[KVCacheSpecKind.MAMBA] == "toy_mamba"
    with pytest.raises(pydantic.ValidationError, match=r"unknown backend 'toy_generic'; registered backends: toy_mamba"):
        make({"backend": "toy_generic"}, context={"registry": reg})


def test_construction_checks_no_registry_and_selection_reports_unknown_names() -> None:
    # Constructing a config checks only the name's form; whether the backend exists
    # is for selection to say, against the registry it uses.
    cfg = AttentionConfig(backend="nonexistent")
    assert cfg.backend == "nonexistent"
    reg = BackendRegistry(discover_plugins=False)
    reg.register(GenericToyBackend)
    reg.register(ToyMambaBackend)
    with pytest.raises(
        BackendNotSupportedError,
        match=r"^backend 'nonexistent' was requested by AttentionConfig\.backend but cannot serve "
        r"FullAttentionSpec\(.*\n  - unknown backend 'nonexistent'; registered backends: "
        r"toy_generic, toy_mamba\n",
    ) as info:
        select_backend(FULL, cfg, device="cpu", registry=reg)
    assert isinstance(info.value, AttnkitError)
    assert info.value.rejected == (
        Rejection("nonexistent", ("unknown backend 'nonexistent'; registered backends: toy_generic, toy_mamba",)),
    )
    per_kind = AttentionConfig(backend_per_kind={"mamba": "nonexistent"})
    with pytest.raises(
        BackendNotSupportedError,
        match=r"requested by AttentionConfig\.backend_per_kind\['mamba'\] .*\n  - unknown backend "
        r"'nonexistent'; registered backends: toy_generic, toy_mamba\n",
    ):
        select_backend(MAMBA, per_kind, device="cpu", registry=reg)


def test_names_are_resolved_in_the_default_registry_at_selection() -> None:
    class DefaultToy(GenericToyBackend):
        name = "toy_config_default"

    cfg = AttentionConfig(backend="toy_config_default")  # constructs before it is registered
    with pytest.raises(BackendNotSupportedError, match=r"unknown backend 'toy_config_default'"):
        select_backend(FULL, cfg, device="cpu")
    default_registry().register(DefaultToy)
    try:
        assert select_backend(FULL, cfg, device="cpu").backend is DefaultToy
    finally:
        default_registry().unregister("toy_config_default")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        pytest.param("bad name", "backend must be a backend name, got 'bad name'", id="backend"),
        pytest.param("", "backend must be a backend name, got ''", id="empty"),
    ],
)
def test_backend_name_syntax_is_checked_at_construction(name: str, message: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        AttentionConfig(backend=name)
    assert message in str(info.value)


def test_frozen_and_strict_fields() -> None:
    cfg = make({"backend": "reference"})
    with pytest.raises(pydantic.ValidationError, match=r"frozen"):
        cfg.backend = "triton_attn"
    with pytest.raises(pydantic.ValidationError, match=r"backend_per_layer\n  Extra inputs are not permitted"):
        make({"backend_per_layer": {}})
    with pytest.raises(pydantic.ValidationError, match=r"Extra inputs are not permitted"):
        AttentionConfig(backend_per_layer={})  # type: ignore[call-arg]  # an unknown setting is the test


def test_plugins_allowlist_parses() -> None:
    assert make({"plugins": "a, b,"}).plugins == frozenset({"a", "b"})
    assert make({"plugins": ["a"]}).plugins == frozenset({"a"})
    assert make({"plugins": ""}).plugins == frozenset()


def test_describe() -> None:
    cfg = make({"backend": "reference", "backend_per_kind": "mamba=toy_generic"})
    assert cfg.describe() == "backend=reference backend_per_kind={mamba: toy_generic} plugins=None"


def test_parse_backend_per_kind_function() -> None:
    assert parse_backend_per_kind("") == {}
    assert parse_backend_per_kind("cross_attention=x") == {KVCacheSpecKind.CROSS_ATTENTION: "x"}
    with pytest.raises(ValueError, match=r"unknown kind 'full'; valid kinds: full_attention, "):
        parse_backend_per_kind({"full": "x"})


def test_round_trip_through_json() -> None:
    cfg = make({"backend_per_kind": "sliding_window=triton_attn", "plugins": ["p"]})
    again = AttentionConfig.model_validate_json(cfg.model_dump_json(), context=KNOWN)
    assert again == cfg


def test_backend_per_kind_constructor_forms() -> None:
    # Each form the docs show, passed to the constructor (so each also type-checks).
    expected = {KVCacheSpecKind.FULL_ATTENTION: "reference"}
    assert AttentionConfig(backend_per_kind="full_attention=reference").backend_per_kind == expected
    assert AttentionConfig(backend_per_kind={"full_attention": "reference"}).backend_per_kind == expected
    assert (
        AttentionConfig(backend_per_kind={KVCacheSpecKind.FULL_ATTENTION: "reference"}).backend_per_kind
        == expected
    )
    assert AttentionConfig().backend_per_kind == {}
    with pytest.raises(pydantic.ValidationError) as info:
        AttentionConfig(backend_per_kind="full=reference")
    assert f"backend_per_kind: unknown kind 'full'; valid kinds: {VALID_KINDS}" in str(info.value)


def test_backend_options_absent_gives_the_defaults() -> None:
    options = AttentionConfig().options_for("flash_attn", FlashAttentionOptions)
    assert options == FlashAttentionOptions()
    assert options.version is None


@pytest.mark.parametrize("version", [2, 4])
def test_backend_options_as_a_mapping(version: int) -> None:
    raw = {"version": version}
    cfg = AttentionConfig(backend_options={"flash_attn": raw})
    raw["version"] = 3  # the config keeps its own copy
    options = cfg.options_for("flash_attn", FlashAttentionOptions)
    assert type(options) is FlashAttentionOptions
    assert options.version == version
    assert cfg.describe().endswith(" backend_options=['flash_attn']")


def test_backend_options_typed() -> None:
    given = FlashAttentionOptions(version=4)
    cfg = AttentionConfig(backend_options={"flash_attn": given})
    assert cfg.options_for("flash_attn", FlashAttentionOptions) is given
    # Options of other backends are not the flash_attn backend's business.
    assert AttentionConfig(backend_options={"other": {"x": 1}}).options_for(
        "flash_attn", FlashAttentionOptions
    ) == FlashAttentionOptions()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        pytest.param(
            {"version": 3},
            "backend_options['flash_attn'] is not valid FlashAttentionOptions: version: Input should be 2 or 4",
            id="bad-value",
        ),
        pytest.param(
            {"versoin": 2},
            "backend_options['flash_attn'] is not valid FlashAttentionOptions: versoin: Extra inputs are not permitted",
            id="unknown-field",
        ),
        pytest.param(
            {"version": 3, "window": 1},
            "backend_options['flash_attn'] is not valid FlashAttentionOptions: version: Input should be 2 "
            "or 4; window: Extra inputs are not permitted",
            id="every-bad-field",
        ),
    ],
)
def test_bad_backend_options_name_the_backend_and_field(raw: dict[str, object], message: str) -> None:
    cfg = AttentionConfig(backend_options={"flash_attn": raw})  # validated when the backend reads it
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        cfg.options_for("flash_attn", FlashAttentionOptions)


def test_backend_options_of_another_class_are_a_type_error() -> None:
    class OtherOptions(BackendOptions):
        depth: int = 1

    cfg = AttentionConfig(backend_options={"flash_attn": OtherOptions()})
    with pytest.raises(
        TypeError,
        match=r"^backend_options\['flash_attn'\] is a OtherOptions; backend 'flash_attn' takes "
        r"FlashAttentionOptions$",
    ):
        cfg.options_for("flash_attn", FlashAttentionOptions)


def test_backend_options_keys_are_backend_names() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        AttentionConfig(backend_options={"not a name": {}})
    assert "backend_options key must be a backend name, got 'not a name'" in str(info.value)
    with pytest.raises(pydantic.ValidationError) as info:
        make({"backend_options": {"flash_attn": {"version": 2}}})
    assert "backend_options key: unknown backend 'flash_attn'; registered backends: reference, toy_generic, triton_attn" in str(
        info.value
    )


def test_backend_options_survive_a_json_round_trip() -> None:
    cfg = AttentionConfig(
        backend_options={"flash_attn": FlashAttentionOptions(version=2), "other": {"depth": 3}}
    )
    dumped = json.loads(cfg.model_dump_json())
    assert dumped["backend_options"] == {"flash_attn": {"version": 2}, "other": {"depth": 3}}
    again = AttentionConfig.model_validate_json(cfg.model_dump_json())
    assert again.options_for("flash_attn", FlashAttentionOptions) == FlashAttentionOptions(version=2)


def test_config_module_imports_no_registry() -> None:
    # attnkit.config is imported by the registry's own modules; it must not import the
    # registry back. Load it under a bare ``attnkit`` package (no __init__ imports) and
    # look at what it pulled in, and at what constructing a config pulls in.
    code = (
        "import os, sys, types\n"
        "pkg = types.ModuleType('attnkit'); pkg.__path__ = [os.environ['ATTNKIT_SRC']]\n"
        "sys.modules['attnkit'] = pkg\n"
        "import attnkit.config\n"
        "cfg = attnkit.config.AttentionConfig(backend='nonexistent', backend_per_kind='mamba=x')\n"
        "print(sorted(m for m in sys.modules if m.startswith('attnkit.')))\n"
    )
    result = _run_python(code)
    loaded = ast.literal_eval(result.stdout.strip())
    assert "attnkit.config" in loaded
    assert not {"attnkit.registry", "attnkit.backend", "attnkit.selector", "attnkit.runtime"} & set(loaded), loaded


def test_constructing_a_config_creates_no_registry() -> None:
    code = (
        "import attnkit, attnkit.registry as r\n"
        "cfg = attnkit.AttentionConfig(backend='nonexistent', backend_per_kind={'mamba': 'elsewhere'})\n"
        "assert cfg.backend == 'nonexistent'\n"
        "print(r._default is None)\n"
    )
    assert _run_python(code).stdout.strip() == "True"


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter; ``ATTNKIT_SRC`` is the attnkit package folder."""
    package = Path(attnkit.__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=str(package.parent), ATTNKIT_SRC=str(package))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)


def test_engine_limits() -> None:
    cfg = make({"max_num_reqs": 8, "max_num_batched_tokens": 64, "max_model_len": 1024})
    assert (cfg.max_num_reqs, cfg.max_num_batched_tokens, cfg.max_model_len) == (8, 64, 1024)
    with pytest.raises(pydantic.ValidationError, match=r"max_num_reqs\n  Input should be greater than or equal to 1"):
        make({"max_num_reqs": 0})
