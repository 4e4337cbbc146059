"""AttentionConfig parsing and validation."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from attnkit import (
    AttentionConfig,
    BackendRegistry,
    KVCacheSpecKind,
    default_registry,
    parse_backend_per_kind,
)
from toy_backends import GenericToyBackend, ToyMambaBackend

KNOWN = {"known_backends": ["reference", "triton_attn", "toy_generic"]}
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


def test_names_are_checked_against_the_default_registry() -> None:
    class DefaultToy(GenericToyBackend):
        name = "toy_config_default"

    with pytest.raises(pydantic.ValidationError, match=r"unknown backend 'toy_config_default'"):
        AttentionConfig(backend="toy_config_default")
    default_registry().register(DefaultToy)
    try:
        assert AttentionConfig(backend="toy_config_default").backend == "toy_config_default"
    finally:
        default_registry().unregister("toy_config_default")


def test_frozen_and_strict_fields() -> None:
    cfg = make({"backend": "reference"})
    with pytest.raises(pydantic.ValidationError, match=r"frozen"):
        cfg.backend = "triton_attn"  # type: ignore[misc]  # assignment to a frozen model is the test
    with pytest.raises(pydantic.ValidationError, match=r"Extra inputs are not permitted"):
        make({"backend_per_layer": {}})


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


def test_flash_attn_version() -> None:
    assert make({}).flash_attn_version is None
    assert make({"flash_attn_version": 4}).flash_attn_version == 4
    assert make({"flash_attn_version": 2}).describe().endswith(" flash_attn_version=2")
    with pytest.raises(pydantic.ValidationError, match=r"flash_attn_version\n  Input should be 2 or 4"):
        make({"flash_attn_version": 3})


def test_engine_limits() -> None:
    cfg = make({"max_num_reqs": 8, "max_num_batched_tokens": 64, "max_model_len": 1024})
    assert (cfg.max_num_reqs, cfg.max_num_batched_tokens, cfg.max_model_len) == (8, 64, 1024)
    with pytest.raises(pydantic.ValidationError, match=r"max_num_reqs\n  Input should be greater than or equal to 1"):
        make({"max_num_reqs": 0})
