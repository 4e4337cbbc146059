"""The documented idiom, ``builders = (bind_builder(...),)`` in a backend's class body,
is checked as a call outside a class body is.

``AttentionBackend.builders`` is declared ``tuple[Binding, ...]`` (no type variables),
so neither checker solves ``bind_builder``'s type variables from the declared type:
they come from the arguments, and a mismatch is reported on the ``builders`` line.
(Declared ``tuple[BuilderBinding[Any, Any], ...]``, both solved them to ``Any`` and
reported none of these.)
"""

from __future__ import annotations

from attnkit import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from attnkit.backend_api import AttentionBackend, bind_builder, bind_each

from ._common import (
    AnyAttentionBuilder,
    AttnImpl,
    FullBuilder,
    FullOnlyImpl,
    MambaBuilder,
    MambaMetaAttnImpl,
)
from .vllm_style_builder import VllmStyleMambaBuilder


class WrongMetadata(AttentionBackend):
    name = "wrong_metadata"
    # The impl consumes MambaMeta; the builder makes AttnMeta.
    builders = (bind_builder(FullAttentionSpec, FullBuilder, MambaMetaAttnImpl),)  # E: misc | pyright: reportArgumentType


class BuilderRefusesTheSpec(AttentionBackend):
    name = "builder_refuses_the_spec"
    # FullBuilder's __init__ takes FullAttentionSpec, not SlidingWindowSpec.
    builders = (bind_builder(SlidingWindowSpec, FullBuilder, AttnImpl),)  # E: arg-type | pyright: reportArgumentType


class ImplRefusesTheSpec(AttentionBackend):
    name = "impl_refuses_the_spec"
    # The impl is narrowed to FullAttentionSpec; the binding hands it sliding-window specs.
    builders = (bind_builder(SlidingWindowSpec, AnyAttentionBuilder, FullOnlyImpl),)  # E: arg-type | pyright: reportArgumentType


class SecondBindingWrong(AttentionBackend):
    name = "second_binding_wrong"
    builders = (
        bind_builder(FullAttentionSpec, FullBuilder, AttnImpl),
        # The second binding of a tuple is checked as the first is.
        bind_builder(SlidingWindowSpec, FullBuilder, AttnImpl),  # E: arg-type | pyright: reportArgumentType
    )


class BindEachWrong(AttentionBackend):
    name = "bind_each_wrong"
    # bind_each checks every spec class against both.
    builders = bind_each((FullAttentionSpec, SlidingWindowSpec), AnyAttentionBuilder, FullOnlyImpl)  # E: arg-type | pyright: reportArgumentType


class SplatWrong(AttentionBackend):
    name = "splat_wrong"
    builders = (
        *bind_each((FullAttentionSpec, SlidingWindowSpec), AnyAttentionBuilder, AttnImpl),
        bind_builder(MambaSpec, MambaBuilder, MambaMetaAttnImpl),  # E: arg-type | pyright: reportArgumentType
    )


class VllmStyleWrongSpec(AttentionBackend):
    name = "vllm_style_wrong_spec"
    # A vLLM-style builder (class-level kv_cache_spec: MambaSpec and an __init__ that
    # takes MambaSpec) is checked by its __init__ as well.
    builders = (bind_builder(FullAttentionSpec, VllmStyleMambaBuilder, MambaMetaAttnImpl),)  # E: arg-type | pyright: reportArgumentType
