"""The builder ABC: construction, CUDA-graph support levels and capture builds."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest
import torch
from typing_extensions import override

from attnkit import (
    AttentionCGSupport,
    AttentionConfig,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
)
from attnkit.backend_api import AttentionMetadataBuilder, CommonAttentionMetadata
from toy_backends import ToyAttentionBuilder, ToyMambaBuilder, ToyMambaMeta, ToyMeta

CONFIG = AttentionConfig.model_validate({}, context={"known_backends": []})
CPU = torch.device("cpu")
FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
MAMBA = MambaSpec(block_size=1, shapes=((4, 3),), dtypes=(torch.float32,))


def batch(query_lens: list[int]) -> CommonAttentionMetadata:
    seq_lens = [q + 3 for q in query_lens]
    slots = list(range(sum(query_lens)))
    return CommonAttentionMetadata.from_lists(
        query_lens=query_lens, seq_lens=seq_lens, block_table=[[1]] * len(query_lens), slot_mapping=slots
    )


def test_cg_support_is_totally_ordered() -> None:
    order = [
        AttentionCGSupport.NEVER,
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE,
        AttentionCGSupport.UNIFORM_BATCH,
        AttentionCGSupport.ALWAYS,
    ]
    for i, low in enumerate(order):
        for high in order[i + 1 :]:
            assert low < high
            assert high > low
            assert low <= high
            assert not high <= low
    assert min(order[::-1]) is AttentionCGSupport.NEVER
    assert max(order) is AttentionCGSupport.ALWAYS
    with pytest.raises(TypeError, match=r"'<' not supported between instances of 'AttentionCGSupport' and 'int'"):
        _ = AttentionCGSupport.NEVER < 1


def test_builder_keeps_its_arguments() -> None:
    builder = ToyAttentionBuilder(FULL, ["layers.0.attn", "layers.2.attn"], CONFIG, CPU)
    assert builder.kv_cache_spec is FULL
    assert builder.layer_names == ("layers.0.attn", "layers.2.attn")
    assert builder.config is CONFIG
    assert builder.device == CPU
    meta = builder.build(0, batch([1, 4]))
    assert isinstance(meta, ToyMeta)
    assert meta.num_reqs == 2


def test_default_cudagraph_support_and_reorder_threshold() -> None:
    class Plain(AttentionMetadataBuilder[int]):
        @override
        def build(
            self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
        ) -> int:
            return common_attn_metadata.num_reqs

    assert Plain.get_cudagraph_support(CONFIG, FULL) is AttentionCGSupport.NEVER
    assert Plain.reorder_batch_threshold is None
    assert ToyMambaBuilder.get_cudagraph_support(CONFIG, MAMBA) is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_abstract_build_cannot_be_skipped() -> None:
    class Lazy(AttentionMetadataBuilder[int]):
        pass

    with pytest.raises(TypeError, match=r"abstract"):
        Lazy(FULL, [], CONFIG, CPU)  # type: ignore[abstract]  # the point of the test


@pytest.mark.parametrize(
    ("support", "query_lens", "allowed"),
    [
        pytest.param(AttentionCGSupport.NEVER, [1, 1], False, id="never-decode"),
        pytest.param(AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, [1, 1, 1], True, id="single-token-decode"),
        pytest.param(AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, [2, 2], False, id="single-token-vs-spec-decode"),
        pytest.param(AttentionCGSupport.UNIFORM_BATCH, [3, 3], True, id="uniform-spec-decode"),
        pytest.param(AttentionCGSupport.UNIFORM_BATCH, [1, 3], False, id="uniform-vs-mixed"),
        pytest.param(AttentionCGSupport.ALWAYS, [1, 7, 2], True, id="always-mixed"),
    ],
)
def test_build_for_cudagraph_capture(
    support: AttentionCGSupport, query_lens: list[int], allowed: bool
) -> None:
    class Declared(ToyAttentionBuilder):
        @classmethod
        @override
        def get_cudagraph_support(cls, config: AttentionConfig, kv_cache_spec: KVCacheSpec) -> AttentionCGSupport:
            return support

    builder = Declared(FULL, ["l0"], CONFIG, CPU)
    cm = batch(query_lens)
    if allowed:
        assert builder.build_for_cudagraph_capture(cm).num_reqs == len(query_lens)
    else:
        with pytest.raises(
            RuntimeError,
            match=re.escape(
                f"Declared cannot capture this batch in a CUDA graph: its support is {support.name} "
                f"and the batch has query lengths {query_lens}"
            ),
        ):
            builder.build_for_cudagraph_capture(cm)


def test_vllm_style_narrowing_keeps_the_spec_readable() -> None:
    # A class-level annotation narrowing the spec (vLLM's spelling; mypy accepts it)
    # must not shadow the base class's read-only property at run time.
    class VllmStyle(AttentionMetadataBuilder[ToyMambaMeta]):
        kv_cache_spec: MambaSpec  # pyright: ignore[reportIncompatibleMethodOverride]  # the spelling under test

        def __init__(
            self, kv_cache_spec: MambaSpec, layer_names: Sequence[str], config: AttentionConfig, device: torch.device
        ) -> None:
            super().__init__(kv_cache_spec, layer_names, config, device)

        @override
        def build(
            self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
        ) -> ToyMambaMeta:
            return ToyMambaMeta(state_indices=torch.arange(common_attn_metadata.num_reqs))

    builder = VllmStyle(MAMBA, ["m"], CONFIG, CPU)
    assert builder.kv_cache_spec is MAMBA
    assert builder.kv_cache_spec.shapes == ((4, 3),)
    with pytest.raises(AttributeError, match=r"has no setter"):
        builder.kv_cache_spec = MAMBA  # read-only, whatever the annotation says


def test_mamba_builder_narrowed_spec_is_usable() -> None:
    builder = ToyMambaBuilder(MAMBA, ["m"], CONFIG, CPU)
    assert builder.kv_cache_spec.shapes == ((4, 3),)
    meta = builder.build_for_cudagraph_capture(batch([1, 1]))
    assert isinstance(meta, ToyMambaMeta)
    assert meta.state_indices.tolist() == [0, 1]
