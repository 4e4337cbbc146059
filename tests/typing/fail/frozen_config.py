"""A validated config is read-only: its mappings cannot be changed behind validation."""

from __future__ import annotations

from attnkit import AttentionConfig, KVCacheSpecKind


def misuse(config: AttentionConfig) -> None:
    config.backend_per_kind[KVCacheSpecKind.MAMBA] = "x"  # E: index | pyright: reportIndexIssue
    config.backend_options["flash_attn"] = {}  # E: index | pyright: reportIndexIssue
