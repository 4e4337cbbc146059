"""The reference backend's builders: narrowed spec types and metadata types, no asserts."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import assert_type

from attnkit import (
    AttentionConfig,
    AttentionMetadataBuilder,
    AttentionSpec,
    BuilderBinding,
    CommonAttentionMetadata,
    MambaSpec,
    MambaType,
    bind_builder,
)
from attnkit.backends.reference import (
    ReferenceAttentionBuilder,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
    ReferenceMamba2Builder,
    ReferenceMamba2Impl,
    ReferenceMamba2Metadata,
)


def check(attn_spec: AttentionSpec, mamba_spec: MambaSpec, cm: CommonAttentionMetadata) -> None:
    config = AttentionConfig.model_validate({}, context={"known_backends": []})
    device = torch.device("cpu")

    attn = ReferenceAttentionBuilder(attn_spec, ["l0"], config, device)
    assert_type(attn.kv_cache_spec, AttentionSpec)
    assert_type(attn.kv_cache_spec.head_size, int)
    assert_type(attn.build(0, cm), ReferenceAttentionMetadata)
    assert_type(attn.build(0, cm).sink_slot_mapping, torch.Tensor | None)
    assert_type(attn.build_for_cudagraph_capture(cm), ReferenceAttentionMetadata)

    mamba = ReferenceMamba2Builder(mamba_spec, ["l1"], config, device)
    assert_type(mamba.kv_cache_spec, MambaSpec)
    assert_type(mamba.kv_cache_spec.mamba_type, MambaType)
    assert_type(mamba.build(0, cm), ReferenceMamba2Metadata)
    assert_type(mamba.build(0, cm).state_indices, torch.Tensor)

    # The metadata type is covariant; the spec type stays MambaSpec (it is invariant:
    # kv_cache_spec is a mutable attribute), so code holding builders of any group
    # takes AttentionMetadataBuilder[object, Any] rather than [..., KVCacheSpec].
    wider: AttentionMetadataBuilder[object, MambaSpec] = mamba
    assert_type(wider.kv_cache_spec, MambaSpec)
    any_group: AttentionMetadataBuilder[object, Any] = attn
    assert_type(any_group.build(0, cm), object)

    # The bindings carry the spec and metadata types.
    b_attn = bind_builder(AttentionSpec, ReferenceAttentionBuilder, ReferenceAttentionImpl)
    assert_type(b_attn, BuilderBinding[AttentionSpec, ReferenceAttentionMetadata])
    b_mamba = bind_builder(MambaSpec, ReferenceMamba2Builder, ReferenceMamba2Impl)
    assert_type(b_mamba, BuilderBinding[MambaSpec, ReferenceMamba2Metadata])
    assert_type(
        b_mamba.create(mamba_spec, ["l1"], config, device).build(0, cm), ReferenceMamba2Metadata
    )
