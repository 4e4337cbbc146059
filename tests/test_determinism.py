"""Determinism levels: declared per backend and kind, asked for by the config, and
refused by selection (with the reason, never a silent fallback) when a backend declares
less than the config asks for."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import ClassVar

import pydantic
import pytest
import torch

from attnkit import (
    AttentionConfig,
    ChunkedLocalAttentionSpec,
    Determinism,
    FullAttentionSpec,
    NoBackendError,
    SinkFullAttentionSpec,
    select_backend,
)
from attnkit.backend_api import AttentionBackend
from attnkit.backends.cpu_attn import CpuAttentionBackend
from attnkit.backends.reference import ReferenceBackend
from attnkit.cli import main
from attnkit.errors import ArgumentTypeError, BackendNotSupportedError, InvalidArgumentError
from attnkit.registry import BUILTIN_BACKENDS, BackendRegistry, default_registry
from attnkit.spec import KVCacheSpecKind

FULL = KVCacheSpecKind.FULL_ATTENTION
LEVELS = list(Determinism)


def spec(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.float32
    )


def builtin(name: str) -> type[AttentionBackend]:
    return default_registry().get(name)


# ---------------------------------------------------------------- the levels


def test_levels_are_ordered_each_including_the_ones_below() -> None:
    assert [level.label for level in LEVELS] == [
        "none",
        "run_to_run",
        "batch_invariant",
        "prefill_decode",
        "chunking_invariant",
        "prefix_hit_invariant",
    ]
    assert sorted(LEVELS) == LEVELS
    assert Determinism.BATCH_INVARIANT > Determinism.RUN_TO_RUN > Determinism.NONE


def test_a_level_is_read_by_name() -> None:
    assert Determinism.parse("batch_invariant") is Determinism.BATCH_INVARIANT
    assert Determinism.parse("Prefix-Hit-Invariant") is Determinism.PREFIX_HIT_INVARIANT
    with pytest.raises(InvalidArgumentError, match="determinism must be one of none, run_to_run"):
        Determinism.parse("bitwise")
    # An int or a bool says nothing a reader can check: the name is asked for.
    with pytest.raises(ArgumentTypeError, match=r"got True \(bool\)"):
        Determinism.parse(True)
    with pytest.raises(ArgumentTypeError, match=r"got 2 \(int\)"):
        Determinism.parse(2)


def test_the_config_takes_a_level_and_writes_its_name() -> None:
    assert AttentionConfig().determinism is Determinism.NONE
    config = AttentionConfig(determinism="batch_invariant")
    assert config.determinism is Determinism.BATCH_INVARIANT
    assert config.model_dump()["determinism"] == "batch_invariant"
    assert AttentionConfig.model_validate(config.model_dump()) == config
    assert "determinism=batch_invariant" in config.describe()
    with pytest.raises(pydantic.ValidationError, match="determinism must be one of"):
        AttentionConfig(determinism="always")
    with pytest.raises(pydantic.ValidationError, match="determinism must be a Determinism"):
        AttentionConfig.model_validate({"determinism": 3})


def test_a_kind_not_declared_has_run_to_run_when_deterministic_else_none() -> None:
    reference, flex = builtin("reference"), builtin("flex_attention")
    assert reference.determinism_for(FULL) is Determinism.BATCH_INVARIANT
    assert reference.determinism_for(KVCacheSpecKind.MAMBA) is Determinism.RUN_TO_RUN
    assert flex.determinism_for(FULL) is Determinism.NONE


def test_declarations_are_checked() -> None:
    class Claims(ReferenceBackend):
        name = "claims"
        deterministic = False
        determinism: ClassVar[Mapping[KVCacheSpecKind, Determinism]] = {
            FULL: Determinism.BATCH_INVARIANT
        }

    assert Claims.declaration_problems() == []
    assert Claims.determinism_for(FULL) is Determinism.NONE  # deterministic=False voids it

    class NotAMapping(CpuAttentionBackend):
        name = "not_a_mapping"
        determinism = Determinism.BATCH_INVARIANT  # type: ignore[assignment]  # the mistake under test

    assert any(
        p.startswith("determinism must be a mapping of KVCacheSpecKind -> Determinism")
        for p in NotAMapping.declaration_problems()
    )


# ---------------------------------------------------------------- selection


def test_selection_refuses_a_backend_below_the_level_with_the_reason() -> None:
    config = AttentionConfig(backend="reference", determinism="prefill_decode")
    with pytest.raises(BackendNotSupportedError) as caught:
        select_backend(spec(), config, device="cpu")
    assert (
        "determinism=prefill_decode not kept for kind=full_attention (declared: batch_invariant)"
        in str(caught.value)
    )


def test_the_priority_list_skips_weaker_backends_and_says_so() -> None:
    chunked = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, attention_chunk_size=64
    )
    # cpu_attn keeps prefix_hit_invariant on chunked-local layers, reference batch_invariant.
    chosen = select_backend(chunked, AttentionConfig(determinism="prefix_hit_invariant"), device="cpu")
    assert chosen.backend_name == "cpu_attn"
    chosen = select_backend(spec(), AttentionConfig(determinism="prefix_hit_invariant"), device="cpu")
    assert chosen.backend_name == "cpu_attn"
    # reference first in the list: skipped at a level above its own, with the reason.
    chosen = select_backend(
        chunked,
        AttentionConfig(determinism="chunking_invariant"),
        device="cpu",
        priority={"cpu": ["reference", "cpu_attn"]},
    )
    assert chosen.backend_name == "cpu_attn"
    text = chosen.explain()
    assert "determinism=chunking_invariant not kept for kind=chunked_local_attention " in text
    assert "(declared: batch_invariant)" in text


def test_a_level_no_backend_keeps_for_the_kind_is_refused_with_every_reason() -> None:
    # No backend keeps batch invariance on sink-token layers on CPU (reference and
    # cpu_attn: run_to_run): selection fails, naming each candidate's reason.
    sink = SinkFullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, sink_len=4
    )
    assert select_backend(sink, AttentionConfig(determinism="run_to_run"), device="cpu")
    with pytest.raises(NoBackendError) as caught:
        select_backend(sink, AttentionConfig(determinism="batch_invariant"), device="cpu")
    text = str(caught.value)
    for name in ("cpu_attn", "reference"):
        assert f"`{name}` is not supported because:" in text
    assert "determinism=batch_invariant not kept for kind=sink_full_attention" in text


# ---------------------------------------------------------------- the command line


def _cli(argv: list[str]) -> str:
    out, err = io.StringIO(), io.StringIO()
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    assert main(argv, registry=reg, out=out, err=err) == 0, err.getvalue()
    return out.getvalue()


def test_backends_lists_each_backends_levels_per_kind() -> None:
    text = _cli(["backends"])
    assert (
        "    determinism: prefix_hit_invariant (chunked_local_attention, full_attention, "
        "sliding_window); run_to_run (cross_attention, encoder_only_attention, "
        "sink_full_attention)\n"
    ) in text
    rows = {r["name"]: r for r in json.loads(_cli(["backends", "--json"]))["backends"]}
    assert rows["reference"]["determinism"]["full_attention"] == "batch_invariant"
    assert rows["flex_attention"]["determinism"]["full_attention"] == "none"


def test_plan_plans_under_a_level_and_shows_each_groups_level() -> None:
    text = _cli(["plan", "--example", "llama4", "--determinism", "chunking_invariant"])
    assert "determinism=chunking_invariant)" in text.splitlines()[0]
    assert "  -> cpu_attn (chosen by priority; determinism: prefix_hit_invariant)\n" in text
