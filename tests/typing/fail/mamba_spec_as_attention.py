"""A MambaSpec is not an AttentionSpec: they are siblings under KVCacheSpec."""

from __future__ import annotations

import torch

from attnkit import AttentionConfig, AttentionSpec, MambaSpec

from ._common import FullBuilder


def head_bytes(spec: AttentionSpec) -> int:
    return spec.num_kv_heads * spec.head_size


def misuse(spec: MambaSpec, config: AttentionConfig) -> None:
    head_bytes(spec)  # E: arg-type | pyright: reportArgumentType
    # A builder narrowed to FullAttentionSpec refuses a MambaSpec at construction.
    FullBuilder(spec, ["layer.0"], config, torch.device("cpu"))  # E: arg-type | pyright: reportArgumentType
    print(spec.head_size)  # E: attr-defined | pyright: reportAttributeAccessIssue, reportUnknownMemberType, reportUnknownArgumentType
