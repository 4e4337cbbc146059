"""A builder class taken as a constructor is checked against the spec it is called with;
taken as ``type[AttentionMetadataBuilder[M]]`` it is not.

A call through ``type[C]`` is checked against ``C.__init__``, and neither checker
checks a subclass's ``__init__`` against its base's, so a
``type[AttentionMetadataBuilder[M]]`` takes any spec, whatever class it holds. The
binding neither takes nor hands out such a constructor: ``BuilderBinding`` is built
from ``BuilderConstructor`` / ``ImplConstructor`` callables, which both checkers match
against each class's own ``__init__``, and it exposes its classes as ``type[object]``.
A parameter that takes a builder class is typed ``BuilderConstructor[S, M]``.
"""

from __future__ import annotations

from typing import Any

import torch

from attnkit import AttentionConfig, AttentionLayerParams, FullAttentionSpec, SlidingWindowSpec
from attnkit.backend_api import (
    AttentionMetadataBuilder,
    BuilderBinding,
    BuilderConstructor,
    bind_builder,
)

from ._common import AnyAttentionBuilder, AttnImpl, AttnMeta, FullBuilder, FullOnlyImpl

CPU = torch.device("cpu")


def make(
    builder_cls: BuilderConstructor[SlidingWindowSpec, AttnMeta],
    spec: SlidingWindowSpec,
    config: AttentionConfig,
) -> AttentionMetadataBuilder[AttnMeta, Any]:
    return builder_cls(spec, ["l0"], config, CPU)


def make_from_class(
    builder_cls: type[AttentionMetadataBuilder[AttnMeta]],
    spec: SlidingWindowSpec,
    config: AttentionConfig,
) -> AttentionMetadataBuilder[AttnMeta]:
    # The hole, as both checkers have it: nothing is reported here, nor where
    # FullBuilder (which takes FullAttentionSpec only) is passed below.
    return builder_cls(spec, ["l0"], config, CPU)


def check(spec: SlidingWindowSpec, full: FullAttentionSpec, config: AttentionConfig) -> None:
    make(AnyAttentionBuilder, spec, config)
    make(FullBuilder, spec, config)  # E: arg-type | pyright: reportArgumentType
    make_from_class(FullBuilder, spec, config)

    # BuilderBinding's own constructor is bind_builder's, with the same checks.
    BuilderBinding(SlidingWindowSpec, AnyAttentionBuilder, FullOnlyImpl)  # E: arg-type | pyright: reportArgumentType
    BuilderBinding(FullAttentionSpec, AnyAttentionBuilder, AttnImpl)

    # The classes a binding exposes are not constructors.
    binding = bind_builder(FullAttentionSpec, FullBuilder, AttnImpl)
    binding.builder_type(full, ["l0"], config, CPU)  # E: call-arg | pyright: reportCallIssue
    binding.impl_type(full, AttentionLayerParams(num_heads=2))  # E: call-arg | pyright: reportCallIssue
