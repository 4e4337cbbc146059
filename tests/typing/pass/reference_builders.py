"""The reference backend's builders and impls: narrowed spec, parameter and metadata
types, no asserts."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import assert_type

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    Mamba2LayerParams,
    MambaSpec,
    MambaType,
    SlidingWindowSpec,
    StateLayerParams,
)
from attnkit.backend_api import (
    AttentionMetadataBuilder,
    BuilderBinding,
    CommonAttentionMetadata,
    bind_builder,
)
from attnkit.backends.reference import (
    ReferenceAttentionBuilder,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
    ReferenceStateBuilder,
    ReferenceStateImpl,
    ReferenceStateMetadata,
)


def check(
    attn_spec: AttentionSpec,
    mamba_spec: MambaSpec,
    cm: CommonAttentionMetadata,
    params: AttentionLayerParams,
    mamba2_params: Mamba2LayerParams,
) -> None:
    config = AttentionConfig.model_validate({}, context={"known_backends": []})
    device = torch.device("cpu")

    attn = ReferenceAttentionBuilder(attn_spec, ["l0"], config, device)
    assert_type(attn.kv_cache_spec, AttentionSpec)
    assert_type(attn.kv_cache_spec.head_size, int)
    assert_type(attn.build(0, cm), ReferenceAttentionMetadata)
    assert_type(attn.build(0, cm).sink_slot_mapping, torch.Tensor | None)
    assert_type(attn.build_for_cudagraph_capture(cm), ReferenceAttentionMetadata)

    state = ReferenceStateBuilder(mamba_spec, ["l1"], config, device)
    assert_type(state.kv_cache_spec, MambaSpec)
    assert_type(state.kv_cache_spec.mamba_type, MambaType)
    assert_type(state.build(0, cm), ReferenceStateMetadata)
    assert_type(state.build(0, cm).state_indices, torch.Tensor)

    # The metadata type is covariant, and so is the (read-only) spec type, so code
    # holding builders of any group can take AttentionMetadataBuilder[object].
    any_group: list[AttentionMetadataBuilder[object, KVCacheSpec]] = [attn, state]
    assert_type(any_group[0].kv_cache_spec, KVCacheSpec)
    assert_type(any_group[1].build(0, cm), object)

    impl = ReferenceAttentionImpl(attn_spec, params)
    assert_type(impl.kv_cache_spec, AttentionSpec)
    assert_type(impl.layer_params, AttentionLayerParams)
    dispatcher = ReferenceStateImpl(mamba_spec, mamba2_params)
    assert_type(dispatcher.layer_params, StateLayerParams)

    # The bindings carry the spec and metadata types.
    b_full = bind_builder(FullAttentionSpec, ReferenceAttentionBuilder, ReferenceAttentionImpl)
    assert_type(b_full, BuilderBinding[FullAttentionSpec, ReferenceAttentionMetadata])
    b_window = bind_builder(SlidingWindowSpec, ReferenceAttentionBuilder, ReferenceAttentionImpl)
    assert_type(b_window, BuilderBinding[SlidingWindowSpec, ReferenceAttentionMetadata])
    b_state = bind_builder(MambaSpec, ReferenceStateBuilder, ReferenceStateImpl)
    assert_type(b_state, BuilderBinding[MambaSpec, ReferenceStateMetadata])
    assert_type(
        b_state.create(mamba_spec, ["l1"], config, device).build(0, cm), ReferenceStateMetadata
    )
    bindings: list[BuilderBinding[Any, Any]] = [b_full, b_state]
    assert_type(bindings[0].spec_type, type[Any])
