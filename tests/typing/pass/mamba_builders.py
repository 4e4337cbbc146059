"""Builders that narrow their spec to ``MambaSpec``, both ways, with no assert."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from typing_extensions import assert_type, override

from attnkit import (
    AttentionCGSupport,
    AttentionConfig,
    AttentionImpl,
    AttentionMetadataBuilder,
    BuilderBinding,
    CommonAttentionMetadata,
    KVCacheSpec,
    MambaSpec,
    MambaType,
    bind_builder,
)


@dataclasses.dataclass(frozen=True)
class MyMeta:
    state_indices: torch.Tensor
    num_prefills: int


class GenericMambaBuilder(AttentionMetadataBuilder[MyMeta, MambaSpec]):
    """Narrowed through the second type parameter."""

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> MyMeta:
        assert_type(self.kv_cache_spec, MambaSpec)
        # MambaSpec-only fields are reachable without an isinstance check.
        num_states = len(self.kv_cache_spec.shapes)
        return MyMeta(
            state_indices=torch.zeros(common_attn_metadata.num_reqs + num_states, dtype=torch.int32),
            num_prefills=0,
        )


class VllmStyleMambaBuilder(AttentionMetadataBuilder[MyMeta]):
    """Narrowed the way vLLM builders are written: class-level annotation + __init__."""

    kv_cache_spec: MambaSpec
    reorder_batch_threshold = 1

    def __init__(
        self,
        kv_cache_spec: MambaSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        self.conv_shape = kv_cache_spec.shapes[0]

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
        return MyMeta(state_indices=torch.zeros(1, dtype=torch.int32), num_prefills=0)


class MyImpl(AttentionImpl[MyMeta]):
    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: MyMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        assert_type(attn_metadata.num_prefills, int)
        return output


def check(spec: MambaSpec, cm: CommonAttentionMetadata) -> None:
    config = AttentionConfig.model_validate({}, context={"known_backends": []})
    device = torch.device("cpu")
    generic = GenericMambaBuilder(spec, ["l0"], config, device)
    assert_type(generic.kv_cache_spec, MambaSpec)
    assert_type(generic.build(0, cm), MyMeta)
    assert_type(generic.build_for_cudagraph_capture(cm), MyMeta)

    vllm_style = VllmStyleMambaBuilder(spec, ["l1"], config, device)
    assert_type(vllm_style.kv_cache_spec, MambaSpec)
    assert_type(vllm_style.build(0, cm), MyMeta)

    # A builder is usable wherever the widest contract is expected.
    widest: AttentionMetadataBuilder[MyMeta] = vllm_style
    assert_type(widest.kv_cache_spec, KVCacheSpec)

    # Both styles bind to MambaSpec, and the binding carries the metadata type.
    b1 = bind_builder(MambaSpec, GenericMambaBuilder, MyImpl)
    assert_type(b1, BuilderBinding[MambaSpec, MyMeta])
    b2 = bind_builder(MambaSpec, VllmStyleMambaBuilder, MyImpl)
    assert_type(b2, BuilderBinding[MambaSpec, MyMeta])
    assert_type(b2.create(spec, ["l1"], config, device).build(0, cm), MyMeta)
