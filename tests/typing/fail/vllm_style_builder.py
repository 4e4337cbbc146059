"""The vLLM spelling of a narrowed builder: a class-level ``kv_cache_spec: MambaSpec``
and an ``__init__`` that takes ``MambaSpec``.

mypy accepts it: the attribute is a covariant override of the base's read-only
``kv_cache_spec`` property, and everything below type-checks. pyright does not let a
variable override a property and reports ``reportIncompatibleMethodOverride`` on the
annotation: that is the documented pyright limitation of this spelling (see
``attnkit.builder``), so the case lives here, with pyright's error expected and
nothing else reported by either checker. Under pyright, use the generic spelling
``AttentionMetadataBuilder[Meta, MambaSpec]`` (tests/typing/pass/mamba_builders.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from typing_extensions import assert_type, override

from attnkit import AttentionCGSupport, AttentionConfig, KVCacheSpec, MambaSpec, MambaType
from attnkit.backend_api import (
    AttentionMetadataBuilder,
    BuilderBinding,
    CommonAttentionMetadata,
    bind_builder,
)

from ._common import MambaImpl, MambaMeta


class VllmStyleMambaBuilder(AttentionMetadataBuilder[MambaMeta]):
    """Narrowed the way vLLM builders are written: class-level annotation + __init__."""

    kv_cache_spec: MambaSpec  # E: - | pyright: reportIncompatibleMethodOverride
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
    ) -> MambaMeta:
        assert_type(self.kv_cache_spec, MambaSpec)
        assert_type(self.kv_cache_spec.mamba_type, MambaType)
        return MambaMeta(state_indices=torch.zeros(1, dtype=torch.int32))


def widest(builder: AttentionMetadataBuilder[MambaMeta]) -> None:
    assert_type(builder.kv_cache_spec, KVCacheSpec)


def check(spec: MambaSpec, config: AttentionConfig, cm: CommonAttentionMetadata) -> None:
    builder = VllmStyleMambaBuilder(spec, ["l1"], config, torch.device("cpu"))
    assert_type(builder.kv_cache_spec, MambaSpec)
    assert_type(builder.build(0, cm), MambaMeta)
    widest(builder)  # usable wherever the widest contract is expected
    binding = bind_builder(MambaSpec, VllmStyleMambaBuilder, MambaImpl)
    assert_type(binding, BuilderBinding[MambaSpec, MambaMeta])
