"""A builder that does not implement build() cannot be instantiated."""

from __future__ import annotations

import torch

from attnkit import AttentionConfig, MambaSpec
from attnkit.backend_api import AttentionMetadataBuilder


class LazyBuilder(AttentionMetadataBuilder[int, MambaSpec]):
    pass


def make(spec: MambaSpec, config: AttentionConfig) -> None:
    LazyBuilder(spec, [], config, torch.device("cpu"))  # E: abstract | pyright: reportAbstractUsage
