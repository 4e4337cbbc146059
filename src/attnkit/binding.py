"""Binding a spec class to the builder that accepts it and the impl that consumes its metadata.

A backend declares ``builders = (bind_builder(SpecClass, Builder, Impl), ...)``.
``bind_builder`` takes the builder and the impl as *constructors*
(``Callable[[S, ...], ...]``), which both mypy and pyright check against a class's
``__init__``, so these are type errors under either checker:

- a builder or impl whose ``__init__`` does not accept ``SpecClass``
  (``bind_builder(SlidingWindowSpec, MambaOnlyBuilder, ...)``),
- an impl narrowed to a spec class its binding does not guarantee,
- an impl that consumes another builder's metadata.

Binding is by exact kind: ``bind_builder(FullAttentionSpec, ...)`` serves the
``full_attention`` kind only, never ``MLAAttentionSpec`` (a subclass with its own
kind); a backend serving several kinds binds each (``bind_each``). The backend's
``supported_kinds()`` is derived from its bindings, so kinds are declared once.

The same checks run at run time from the annotations, so an untyped plugin fails at
registration with a ``TypeError`` instead of mid-step. The binding hands out no
unchecked constructor: builders and impls are made through ``create`` and
``create_impl``, which check the spec (and the layer parameters) first.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Generic, cast

import torch
from typing_extensions import TypeVar

from .builder import AttentionCGSupport, AttentionMetadataBuilder
from .config import AttentionConfig
from .impl import AttentionImpl, LayerImpl, StateImpl
from .spec import KVCacheSpec, KVCacheSpecKind

__all__ = ["BuilderBinding", "bind_builder", "bind_each"]

S = TypeVar("S", bound=KVCacheSpec)
M = TypeVar("M")
P = TypeVar("P")

BuilderConstructor = Callable[
    [S, Sequence[str], AttentionConfig, torch.device], AttentionMetadataBuilder[M, Any]
]
"""A builder class seen as its constructor: ``(spec, layer_names, config, device)``."""
ImplConstructor = Callable[[S, P], LayerImpl[M, Any, Any]]

"""An impl class seen as its constructor: ``(spec, layer_params)``."""


def _is_subclass(value: object, base: type) -> bool:
    return isinstance(value, type) and issubclass(value, base)


def _classes(hint: object) -> tuple[type, ...] | None:
    """``A`` -> ``(A,)``; ``A | B`` -> ``(A, B)``; anything else (a TypeVar, ``Any``): ``None``."""
    if isinstance(hint, type):
        return (hint,)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if all(isinstance(a, type) for a in args):
            return tuple(a for a in args if isinstance(a, type))
    return None


def _names(classes: tuple[type, ...]) -> str:
    return " | ".join(c.__name__ for c in classes)


@dataclasses.dataclass(frozen=True, eq=False)
class BuilderBinding(Generic[S, M]):
    """A spec class, the builder that accepts it and the impl that consumes its metadata.

    Make one with ``bind_builder``. Attributes other than the methods are for
    introspection (``attnkit backends``, tests); none of them constructs anything.
    """

    spec_type: type[S]
    kind: KVCacheSpecKind
    _builder: type[AttentionMetadataBuilder[M, Any]] = dataclasses.field(repr=False)
    _make_builder: BuilderConstructor[S, M] = dataclasses.field(repr=False)
    _impl: type[LayerImpl[M, Any, Any]] = dataclasses.field(repr=False)
    _params_classes: tuple[type, ...] | None = dataclasses.field(repr=False)

    @property
    def builder_name(self) -> str:
        """The builder class's qualified name."""
        return self._builder.__qualname__

    @property
    def impl_name(self) -> str:
        """The impl class's qualified name."""
        return self._impl.__qualname__

    @property
    def builder_type(self) -> type[object]:
        """The builder class, for identity checks; construct through ``create``."""
        return self._builder

    @property
    def impl_type(self) -> type[object]:
        """The impl class, for identity checks; construct through ``create_impl``."""
        return self._impl

    @property
    def is_state_binding(self) -> bool:
        """Whether the impl is a ``StateImpl`` (takes typed state inputs)."""
        return issubclass(self._impl, StateImpl)

    @property
    def reorder_batch_threshold(self) -> int | None:
        """The builder's ``reorder_batch_threshold``."""
        return self._builder.reorder_batch_threshold

    def get_cudagraph_support(
        self, config: AttentionConfig, kv_cache_spec: KVCacheSpec
    ) -> AttentionCGSupport:
        """The builder's CUDA-graph support for a group with ``kv_cache_spec``."""
        return self._builder.get_cudagraph_support(config, kv_cache_spec)

    def _check_spec(self, kv_cache_spec: KVCacheSpec) -> S:
        if not isinstance(kv_cache_spec, self.spec_type) or kv_cache_spec.kind is not self.kind:
            raise TypeError(
                f"{self.builder_name} is bound to {self.spec_type.__name__} "
                f"(kind={self.kind.value}), got a {type(kv_cache_spec).__name__} "
                f"(kind={kv_cache_spec.kind.value})"
            )
        return kv_cache_spec

    def create(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> AttentionMetadataBuilder[M, Any]:
        """Construct the builder for a group.

        Raises:
            TypeError: if ``kv_cache_spec`` is not a ``spec_type`` of the bound kind.
        """
        return self._make_builder(self._check_spec(kv_cache_spec), layer_names, config, device)

    def create_impl(self, kv_cache_spec: KVCacheSpec, layer_params: object) -> LayerImpl[M, Any, Any]:
        """Construct the impl for one layer of a group.

        Raises:
            TypeError: if the spec is not a ``spec_type`` of the bound kind, or the
                parameters are not of the class the impl declares.
        """
        spec = self._check_spec(kv_cache_spec)
        expected = self._params_classes
        if expected is not None and not isinstance(layer_params, expected):
            raise TypeError(
                f"{self.impl_name} takes layer_params of type {_names(expected)}, "
                f"got {type(layer_params).__name__}"
            )
        return self._impl(spec, layer_params)


def _declared(cls: type, param: str, generic_index: dict[type, int]) -> tuple[type, ...] | None:
    """The classes ``cls`` declares for ``param``: its ``__init__`` annotation, a
    class-level annotation, or the type argument it gives a generic base; the first
    found wins. ``None`` when nothing resolvable is declared (a plugin's forward
    references): then only the static check applies."""
    try:
        init = getattr(cls, "__init__")  # noqa: B009 (mypy rejects .__init__ on a type)
        found = _classes(typing.get_type_hints(init).get(param))
        if found is None:
            found = _classes(typing.get_type_hints(cls).get(param))
    except Exception:  # unresolvable annotations in a plugin: no run-time check
        return None
    if found is not None:
        return found
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(base)
            index = generic_index.get(origin) if isinstance(origin, type) else None
            args = typing.get_args(base)
            if index is not None and len(args) > index:
                return _classes(args[index])
    return None


_BUILDER_SPEC_ARG: dict[type, int] = {AttentionMetadataBuilder: 1}
_IMPL_SPEC_ARG: dict[type, int] = {AttentionImpl: 1, LayerImpl: 1}
_IMPL_PARAMS_ARG: dict[type, int] = {AttentionImpl: 2, StateImpl: 1}


def bind_builder(
    spec_type: type[S],
    builder_cls: BuilderConstructor[S, M],
    impl_cls: ImplConstructor[S, P, M],
) -> BuilderBinding[S, M]:
    """Bind ``builder_cls`` and ``impl_cls`` to the specs of class ``spec_type`` (its kind).

    Statically, mypy and pyright reject a builder or impl whose ``__init__`` does not
    accept ``spec_type`` and an impl whose metadata type is not the builder's. At run
    time the same is checked from the annotations, for plugins never type-checked.

    Raises:
        TypeError: if the arguments are not a concrete spec class, a builder and an
            impl, or the annotations say the builder or impl accepts a spec class that
            ``spec_type`` is not.
    """
    # Checked at run time too: plugins reach here without having been type-checked.
    given: tuple[object, object, object] = (spec_type, builder_cls, impl_cls)
    if not _is_subclass(given[0], KVCacheSpec):
        raise TypeError(f"bind_builder: spec_type must be a subclass of KVCacheSpec, got {given[0]!r}")
    given_builder, given_impl = given[1], given[2]
    if not (
        isinstance(given_builder, type) and issubclass(given_builder, AttentionMetadataBuilder)
    ):
        raise TypeError(
            "bind_builder: builder_cls must be a subclass of AttentionMetadataBuilder, "
            f"got {given_builder!r}"
        )
    if not (isinstance(given_impl, type) and issubclass(given_impl, LayerImpl)):
        raise TypeError(
            f"bind_builder: impl_cls must be a subclass of AttentionImpl or StateImpl, got {given_impl!r}"
        )
    # The classes themselves, typed by what the static signature already guarantees
    # (isinstance cannot recover their type arguments).
    builder = cast("type[AttentionMetadataBuilder[M, Any]]", given_builder)
    impl = cast("type[LayerImpl[M, Any, Any]]", given_impl)
    kind = getattr(spec_type, "kind", None)
    if not isinstance(kind, KVCacheSpecKind):
        raise TypeError(
            f"bind_builder: spec_type must be a concrete spec class with a kind, got "
            f"{spec_type.__name__}; bind each concrete class (bind_each)"
        )
    for what, cls, accepted in (
        ("builder", builder, _declared(builder, "kv_cache_spec", _BUILDER_SPEC_ARG)),
        ("impl", impl, _declared(impl, "kv_cache_spec", _IMPL_SPEC_ARG)),
    ):
        if accepted is not None and not issubclass(spec_type, accepted):
            raise TypeError(
                f"bind_builder: the {what} {cls.__qualname__} accepts {_names(accepted)} specs, "
                f"so it cannot be bound to {spec_type.__name__}"
            )
    return BuilderBinding(
        spec_type=spec_type,
        kind=kind,
        _builder=builder,
        _make_builder=builder_cls,
        _impl=impl,
        _params_classes=_declared(impl, "layer_params", _IMPL_PARAMS_ARG),
    )


def bind_each(
    spec_types: Sequence[type[S]],
    builder_cls: BuilderConstructor[S, M],
    impl_cls: ImplConstructor[S, P, M],
) -> tuple[BuilderBinding[S, M], ...]:
    """``bind_builder`` for each spec class of ``spec_types``, with one builder and impl.

    ``builders = bind_each((FullAttentionSpec, SlidingWindowSpec), MyBuilder, MyImpl)``
    """
    return tuple(bind_builder(t, builder_cls, impl_cls) for t in spec_types)
