"""A builder's and an impl's kv_cache_spec (and an impl's layer_params) are read-only."""

from __future__ import annotations

from attnkit import AttentionLayerParams, FullAttentionSpec, MambaSpec

from ._common import AttnImpl, FullBuilder


def misuse(
    builder: FullBuilder,
    impl: AttnImpl,
    full: FullAttentionSpec,
    mamba: MambaSpec,
    params: AttentionLayerParams,
) -> None:
    builder.kv_cache_spec = full  # E: misc | pyright: reportAttributeAccessIssue
    builder.kv_cache_spec = mamba  # E: misc, assignment | pyright: reportAttributeAccessIssue
    impl.kv_cache_spec = full  # E: misc | pyright: reportAttributeAccessIssue
    impl.layer_params = params  # E: misc | pyright: reportAttributeAccessIssue
