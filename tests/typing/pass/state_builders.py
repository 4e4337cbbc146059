"""The state backends' builders are narrowed to MambaSpec (no asserts) and their
build() returns the metadata their impls consume."""

from __future__ import annotations

import torch
from typing_extensions import assert_type

from attnkit import AttentionConfig, CommonAttentionMetadata, MambaSpec
from attnkit.backends.reference.mamba2 import ReferenceMamba2Builder, ReferenceMamba2Metadata
from attnkit.backends.triton_state import TritonStateMetadata, TritonStateMetadataBuilder


def check(spec: MambaSpec, config: AttentionConfig, cm: CommonAttentionMetadata) -> None:
    device = torch.device("cpu")
    triton_builder = TritonStateMetadataBuilder(spec, ["layers.1"], config, device)
    assert_type(triton_builder.kv_cache_spec, MambaSpec)
    assert_type(triton_builder.build(0, cm), TritonStateMetadata)
    assert_type(triton_builder.build_for_cudagraph_capture(cm), TritonStateMetadata)
    assert_type(triton_builder.build(0, cm).num_decodes, int)
    reference_builder = ReferenceMamba2Builder(spec, ["layers.1"], config, device)
    assert_type(reference_builder.kv_cache_spec, MambaSpec)
    assert_type(reference_builder.build(0, cm), ReferenceMamba2Metadata)
