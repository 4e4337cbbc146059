"""The documented idiom, ``builders = (bind_builder(...),)`` in a backend's class body,
with a builder narrowed either way: the generic spelling
(``AttentionMetadataBuilder[Meta, Spec]``) and the vLLM spelling (a class-level
``kv_cache_spec: Spec`` and an ``__init__`` that takes ``Spec``).

Both checkers solve each ``bind_builder`` from its arguments here (``builders`` is
declared with the non-generic ``Binding``), so these pass because they are right:
tests/typing/fail/class_body_binding.py has the same declarations with one piece
wrong, each reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from typing_extensions import override

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionSpec,
    FullAttentionSpec,
    Mamba2Inputs,
    Mamba2LayerParams,
    MambaSpec,
    SlidingWindowSpec,
)
from attnkit.backend_api import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    Binding,
    CommonAttentionMetadata,
    StateImpl,
    bind_builder,
    bind_each,
)


@dataclasses.dataclass(frozen=True)
class PagedMeta:
    seq_lens: torch.Tensor


@dataclasses.dataclass(frozen=True)
class StateMeta:
    state_indices: torch.Tensor


class PagedBuilder(AttentionMetadataBuilder[PagedMeta, AttentionSpec]):
    """The generic spelling: the spec narrowed through the type parameter."""

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> PagedMeta:
        return PagedMeta(seq_lens=common_attn_metadata.seq_lens)


class PagedImpl(AttentionImpl[PagedMeta, AttentionSpec, AttentionLayerParams]):
    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: PagedMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return output


class WindowImpl(AttentionImpl[PagedMeta, SlidingWindowSpec, AttentionLayerParams]):
    def __init__(self, kv_cache_spec: SlidingWindowSpec, layer_params: AttentionLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        self.window = kv_cache_spec.sliding_window

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: PagedMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return output


class VllmStyleStateBuilder(AttentionMetadataBuilder[StateMeta]):
    """The vLLM spelling: a class-level annotation and an ``__init__`` taking MambaSpec."""

    kv_cache_spec: MambaSpec  # pyright: ignore[reportIncompatibleMethodOverride]  # pyright lets no attribute narrow a property: the spelling's documented pyright limit (fail/vllm_style_builder.py)

    def __init__(
        self,
        kv_cache_spec: MambaSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> StateMeta:
        return StateMeta(state_indices=common_attn_metadata.seq_lens)


class StateImplForMamba2(StateImpl[StateMeta, Mamba2LayerParams, Mamba2Inputs]):
    @override
    def forward(
        self,
        inputs: Mamba2Inputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: StateMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return output


class OneBinding(AttentionBackend):
    name = "one_binding"
    builders = (bind_builder(FullAttentionSpec, PagedBuilder, PagedImpl),)


class SeveralBindings(AttentionBackend):
    name = "several_bindings"
    supported_mamba_types = frozenset({"mamba2"})
    builders = (
        bind_builder(FullAttentionSpec, PagedBuilder, PagedImpl),
        bind_builder(SlidingWindowSpec, PagedBuilder, WindowImpl),
        bind_builder(MambaSpec, VllmStyleStateBuilder, StateImplForMamba2),
    )


class EachAndOne(AttentionBackend):
    name = "each_and_one"
    supported_mamba_types = frozenset({"mamba2"})
    builders = (
        *bind_each((FullAttentionSpec, SlidingWindowSpec), PagedBuilder, PagedImpl),
        bind_builder(MambaSpec, VllmStyleStateBuilder, StateImplForMamba2),
    )


class EachOnly(AttentionBackend):
    name = "each_only"
    builders = bind_each((FullAttentionSpec, SlidingWindowSpec), PagedBuilder, PagedImpl)


# What the runtime reads: the bindings without their type parameters.
runtime_view: tuple[Binding, ...] = SeveralBindings.builders
