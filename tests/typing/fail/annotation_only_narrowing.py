"""A builder narrowed by a class-level annotation alone, without an ``__init__`` that
takes the narrower spec: a hole mypy has and pyright does not.

mypy accepts the annotation (a covariant override of the read-only ``kv_cache_spec``
property) and checks construction against the inherited ``__init__``, which takes any
``KVCacheSpec``: it reports neither the construction with a mamba spec nor the binding
to ``SlidingWindowSpec`` below. pyright reports the annotation itself
(``reportIncompatibleMethodOverride``, as for the vLLM spelling,
vllm_style_builder.py) and then nothing else. At run time ``bind_builder`` reads the
annotation and refuses the binding (``TypeError`` at import). Narrow with the type
parameter (``AttentionMetadataBuilder[Meta, Spec]``), or give the ``__init__`` the
narrower spec as the vLLM spelling does.
"""

from __future__ import annotations

import torch
from typing_extensions import override

from attnkit import AttentionConfig, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from attnkit.backend_api import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    bind_builder,
)

from ._common import AttnImpl, AttnMeta


class AnnotatedOnlyBuilder(AttentionMetadataBuilder[AttnMeta]):
    kv_cache_spec: FullAttentionSpec  # E: - | pyright: reportIncompatibleMethodOverride

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AttnMeta:
        return AttnMeta(seq_lens=common_attn_metadata.seq_lens)


def construct(spec: MambaSpec, config: AttentionConfig) -> None:
    AnnotatedOnlyBuilder(spec, ["l0"], config, torch.device("cpu"))


class AnnotatedOnlyBackend(AttentionBackend):
    name = "annotated_only"
    builders = (bind_builder(SlidingWindowSpec, AnnotatedOnlyBuilder, AttnImpl),)
