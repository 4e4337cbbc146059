"""The state backends' builders are narrowed to MambaSpec (no asserts), their build()
returns the metadata their impls consume, and each impl takes its own inputs."""

from __future__ import annotations

import torch
from typing_extensions import assert_type

from attnkit import (
    AttentionConfig,
    GatedDeltaNetLayerParams,
    Mamba2Inputs,
    Mamba2LayerParams,
    MambaSpec,
)
from attnkit.backend_api import BuilderBinding, CommonAttentionMetadata, bind_builder
from attnkit.backends.reference import ReferenceStateBuilder, ReferenceStateMetadata
from attnkit.backends.triton_state import (
    TritonGatedDeltaNetImpl,
    TritonMamba2Impl,
    TritonStateMetadata,
    TritonStateMetadataBuilder,
)


def check(
    spec: MambaSpec,
    config: AttentionConfig,
    cm: CommonAttentionMetadata,
    mamba2: Mamba2LayerParams,
    gdn: GatedDeltaNetLayerParams,
    xbc: torch.Tensor,
    dt: torch.Tensor,
) -> None:
    device = torch.device("cpu")
    triton_builder = TritonStateMetadataBuilder(spec, ["layers.1"], config, device)
    assert_type(triton_builder.kv_cache_spec, MambaSpec)
    meta = triton_builder.build(0, cm)
    assert_type(meta, TritonStateMetadata)
    assert_type(triton_builder.build_for_cudagraph_capture(cm), TritonStateMetadata)
    assert_type(meta.num_decodes, int)
    assert_type(meta.chunk_offsets, dict[int, torch.Tensor])
    reference_builder = ReferenceStateBuilder(spec, ["layers.1"], config, device)
    assert_type(reference_builder.kv_cache_spec, MambaSpec)
    assert_type(reference_builder.build(0, cm), ReferenceStateMetadata)

    impl = TritonMamba2Impl(spec, mamba2)
    assert_type(impl.layer_params, Mamba2LayerParams)
    out = impl.forward(Mamba2Inputs(xBC=xbc, dt=dt), [xbc, xbc], meta, xbc)
    assert_type(out, torch.Tensor)
    assert_type(TritonGatedDeltaNetImpl(spec, gdn).layer_params, GatedDeltaNetLayerParams)
    assert_type(
        bind_builder(MambaSpec, TritonStateMetadataBuilder, TritonMamba2Impl),
        BuilderBinding[MambaSpec, TritonStateMetadata],
    )
