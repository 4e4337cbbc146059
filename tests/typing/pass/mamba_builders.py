"""A builder narrowed to ``MambaSpec`` through its type parameter, with no assert.

(The vLLM spelling, a class-level ``kv_cache_spec: MambaSpec``, is checked in
tests/typing/fail/vllm_style_builder.py: mypy accepts it, pyright reports it.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from typing_extensions import assert_type, override

from attnkit import (
    AttentionCGSupport,
    AttentionConfig,
    KVCacheSpec,
    Mamba2Inputs,
    Mamba2LayerParams,
    MambaSpec,
    MambaType,
)
from attnkit.backend_api import (
    AttentionMetadataBuilder,
    BuilderBinding,
    CommonAttentionMetadata,
    StateImpl,
    bind_builder,
)


@dataclasses.dataclass(frozen=True)
class MyMeta:
    state_indices: torch.Tensor
    num_prefills: int


class GenericMambaBuilder(AttentionMetadataBuilder[MyMeta, MambaSpec]):
    """Narrowed through the second type parameter."""

    reorder_batch_threshold = 1

    @classmethod
    @override
    def get_cudagraph_support(
        cls, config: AttentionConfig, kv_cache_spec: KVCacheSpec
    ) -> AttentionCGSupport:
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> MyMeta:
        assert_type(self.kv_cache_spec, MambaSpec)
        assert_type(self.kv_cache_spec.mamba_type, MambaType)
        # MambaSpec-only fields are reachable without an isinstance check.
        num_states = len(self.kv_cache_spec.shapes)
        return MyMeta(
            state_indices=torch.zeros(common_attn_metadata.num_reqs + num_states, dtype=torch.int32),
            num_prefills=0,
        )


class MyMamba2Impl(StateImpl[MyMeta, Mamba2LayerParams, Mamba2Inputs]):
    @override
    def forward(
        self,
        inputs: Mamba2Inputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: MyMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        assert_type(attn_metadata.num_prefills, int)
        assert_type(self.kv_cache_spec, MambaSpec)
        assert_type(self.layer_params, Mamba2LayerParams)
        assert_type(self.layer_params.num_heads, int)
        assert_type(inputs.xBC, torch.Tensor)
        return output


def widest(builder: AttentionMetadataBuilder[MyMeta]) -> None:
    # A builder is usable wherever the widest contract is expected.
    assert_type(builder.kv_cache_spec, KVCacheSpec)


def check(spec: MambaSpec, cm: CommonAttentionMetadata) -> None:
    config = AttentionConfig.model_validate({}, context={"known_backends": []})
    device = torch.device("cpu")
    generic = GenericMambaBuilder(spec, ["l0"], config, device)
    assert_type(generic.kv_cache_spec, MambaSpec)
    assert_type(generic.build(0, cm), MyMeta)
    assert_type(generic.build_for_cudagraph_capture(cm), MyMeta)
    widest(generic)

    # The binding carries the spec and metadata types through create().
    binding = bind_builder(MambaSpec, GenericMambaBuilder, MyMamba2Impl)
    assert_type(binding, BuilderBinding[MambaSpec, MyMeta])
    assert_type(binding.create(spec, ["l0"], config, device).build(0, cm), MyMeta)
    assert_type(binding.reorder_batch_threshold, int | None)
