"""Small backends for tests of the contract. They compute nothing real: their builders
record what they were given, so tests can see which backend served which group."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from typing_extensions import override

from attnkit import (
    AttentionCGSupport,
    AttentionConfig,
    AttentionFeature,
    AttentionSpec,
    FullAttentionSpec,
    Mamba2Inputs,
    Mamba2LayerParams,
    MambaSpec,
    SlidingWindowSpec,
)
from attnkit.backend_api import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
    SizeRule,
    StateImpl,
    bind_builder,
    bind_each,
)


@dataclasses.dataclass(frozen=True)
class ToyMeta:
    backend: str
    num_reqs: int
    seq_lens: torch.Tensor


class ToyAttentionBuilder(AttentionMetadataBuilder[ToyMeta, AttentionSpec]):
    backend_name = "toy"
    cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ToyMeta:
        return ToyMeta(
            backend=self.backend_name,
            num_reqs=common_attn_metadata.num_reqs,
            seq_lens=common_attn_metadata.seq_lens,
        )


class ToyImpl(AttentionImpl[ToyMeta]):
    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ToyMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return output.copy_(query)


@dataclasses.dataclass(frozen=True)
class ToyMambaMeta:
    state_indices: torch.Tensor


class ToyMambaBuilder(AttentionMetadataBuilder[ToyMambaMeta, MambaSpec]):
    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(
        self,
        kv_cache_spec: MambaSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ToyMambaMeta:
        return ToyMambaMeta(state_indices=torch.arange(common_attn_metadata.num_reqs))


class ToyMambaImpl(StateImpl[ToyMambaMeta, Mamba2LayerParams, Mamba2Inputs]):
    @override
    def forward(
        self,
        inputs: Mamba2Inputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ToyMambaMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return output


class GenericToyBackend(AttentionBackend):
    """Serves full and sliding-window attention anywhere, head sizes 64/128, block 16|32."""

    name = "toy_generic"
    supported_devices = frozenset({"cpu", "cuda"})
    supported_head_sizes: ClassVar[SizeRule | None] = (64, 128)
    supported_block_sizes: ClassVar[SizeRule | None] = (16, 32)
    supported_dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    builders = bind_each((FullAttentionSpec, SlidingWindowSpec), ToyAttentionBuilder, ToyImpl)


class FastCudaBackend(AttentionBackend):
    """CUDA only, sm80+, fp16/bf16, head sizes multiple of 32 up to the rule, softcap."""

    name = "toy_fast_cuda"
    supported_devices = frozenset({"cuda"})
    min_compute_capability = (8, 0)
    supported_dtypes = frozenset({torch.float16, torch.bfloat16})
    supported_kv_cache_dtypes = frozenset({"auto", "fp8_e4m3"})
    supported_head_sizes = (MultipleOf(32),)
    supported_block_sizes = (16, MultipleOf(64))
    supported_features = frozenset({AttentionFeature.LOGITS_SOFT_CAP})
    builders = bind_each((FullAttentionSpec, SlidingWindowSpec), ToyAttentionBuilder, ToyImpl)


class FullOnlyBackend(AttentionBackend):
    name = "toy_full_only"
    builders = (bind_builder(FullAttentionSpec, ToyAttentionBuilder, ToyImpl),)


class SlidingOnlyBackend(AttentionBackend):
    name = "toy_sliding_only"
    builders = (bind_builder(SlidingWindowSpec, ToyAttentionBuilder, ToyImpl),)


class ToyMambaBackend(AttentionBackend):
    name = "toy_mamba"
    supported_mamba_types = frozenset({"mamba2"})
    builders = (bind_builder(MambaSpec, ToyMambaBuilder, ToyMambaImpl),)


class NeedsMissingPackage(AttentionBackend):
    name = "toy_needs_pkg"
    required_packages: ClassVar[Mapping[str, str]] = {"attnkit_test_missing_pkg": "attnkit-test-missing-pkg>=1"}
    builders = (bind_builder(FullAttentionSpec, ToyAttentionBuilder, ToyImpl),)


ALL_TOY_BACKENDS: tuple[type[AttentionBackend], ...] = (
    GenericToyBackend,
    FastCudaBackend,
    FullOnlyBackend,
    SlidingOnlyBackend,
    ToyMambaBackend,
    NeedsMissingPackage,
)
