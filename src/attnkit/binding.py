"""Binding a spec class to the builder that accepts it and the impl that consumes its metadata.

A backend declares ``builders = (bind_builder(SpecClass, Builder, Impl), ...)``.
``bind_builder`` takes the builder and the impl as *constructors*
(``Callable[[S, ...], ...]``), which both mypy and pyright check against a class's
``__init__``, so these are type errors under either checker, in a class body too:

- a builder or impl whose ``__init__`` does not accept ``SpecClass``
  (``bind_builder(SlidingWindowSpec, MambaOnlyBuilder, ...)``),
- an impl narrowed to a spec class its binding does not guarantee,
- an impl that consumes another builder's metadata.

``AttentionBackend.builders`` is declared ``tuple[Binding, ...]``, a type without type
variables: a checker solves a call's type variables from the declared type of its
target first, and a declared ``BuilderBinding[Any, Any]`` would solve them to ``Any``
and check nothing. ``bind_builder``'s result is the generic ``BuilderBinding[S, M]``,
a ``Binding``.

Binding is by exact kind: ``bind_builder(FullAttentionSpec, ...)`` serves the
``full_attention`` kind only, never ``MLAAttentionSpec`` (a subclass with its own
kind); a backend serving several kinds binds each (``bind_each``). The backend's
``supported_kinds()`` is derived from its bindings, so kinds are declared once.

The same checks run at run time from the annotations, so an untyped plugin fails at
registration with a ``TypeError`` instead of mid-step. A binding keeps only the checked
constructors and hands out none: the classes it exposes are ``type[object]`` (for
identity), and builders and impls are made through ``create`` and ``create_impl``,
which check the spec (and the layer parameters) first. Pass builder classes around as
``BuilderConstructor[S, M]``, never as ``type[AttentionMetadataBuilder[M]]``: calling
that is checked against the base class's ``__init__``, which takes any spec.
"""

from __future__ import annotations

import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, cast

import torch
from typing_extensions import TypeVar, final, override

from .builder import AttentionCGSupport, AttentionMetadataBuilder
from .config import AttentionConfig
from .impl import AttentionImpl, LayerImpl, StateImpl
from .spec import KVCacheSpec, KVCacheSpecKind

__all__ = [
    "Binding",
    "BuilderBinding",
    "BuilderConstructor",
    "ImplConstructor",
    "bind_builder",
    "bind_each",
]

S = TypeVar("S", bound=KVCacheSpec)
M = TypeVar("M")
P = TypeVar("P")

BuilderConstructor = Callable[
    [S, Sequence[str], AttentionConfig, torch.device], AttentionMetadataBuilder[M, Any]
]
"""A builder class seen as its constructor: ``(spec, layer_names, config, device)``.

Both checkers match a class against it by its ``__init__``, so a builder that does not
take ``S`` is a type error where a ``type[AttentionMetadataBuilder[M]]`` would pass."""
ImplConstructor = Callable[[S, P], LayerImpl[M, Any, Any]]
"""An impl class seen as its constructor: ``(spec, layer_params)``."""


class _BuilderClass(Protocol):
    """What a binding reads from its builder class: class-level facts, no constructor."""

    @property
    def reorder_batch_threshold(self) -> int | None: ...

    def get_cudagraph_support(
        self, config: AttentionConfig, kv_cache_spec: KVCacheSpec
    ) -> AttentionCGSupport: ...


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


class Binding(ABC):
    """A binding seen without its type parameters: what ``AttentionBackend.builders`` holds.

    Non-generic on purpose, so that ``builders = (bind_builder(...),)`` in a class body
    is checked (see the module docstring). The only implementation is
    ``BuilderBinding``, made by ``bind_builder``; a ``Binding`` is never constructed
    directly (it is abstract). The attributes other than ``create`` and ``create_impl``
    are for selection and introspection (``attnkit backends``, tests).
    """

    @property
    @abstractmethod
    def spec_type(self) -> type[KVCacheSpec]:
        """The spec class bound: specs of its class and kind are served."""

    @property
    @abstractmethod
    def kind(self) -> KVCacheSpecKind:
        """The kind of ``spec_type``."""

    @property
    @abstractmethod
    def builder_type(self) -> type[object]:
        """The builder class, for identity checks; construct through ``create``."""

    @property
    @abstractmethod
    def impl_type(self) -> type[object]:
        """The impl class, for identity checks; construct through ``create_impl``."""

    @property
    @abstractmethod
    def reorder_batch_threshold(self) -> int | None:
        """The builder's ``reorder_batch_threshold``."""

    @abstractmethod
    def get_cudagraph_support(
        self, config: AttentionConfig, kv_cache_spec: KVCacheSpec
    ) -> AttentionCGSupport:
        """The builder's CUDA-graph support for a group with ``kv_cache_spec``."""

    @abstractmethod
    def create(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> AttentionMetadataBuilder[Any, Any]:
        """Construct the builder for a group.

        Raises:
            TypeError: if ``kv_cache_spec`` is not a ``spec_type`` of the bound kind.
        """

    @abstractmethod
    def create_impl(self, kv_cache_spec: KVCacheSpec, layer_params: object) -> LayerImpl[Any, Any, Any]:
        """Construct the impl for one layer of a group.

        Raises:
            TypeError: if the spec is not a ``spec_type`` of the bound kind, or the
                parameters are not of the class the impl declares.
        """

    @property
    def builder_name(self) -> str:
        """The builder class's qualified name."""
        return self.builder_type.__qualname__

    @property
    def impl_name(self) -> str:
        """The impl class's qualified name."""
        return self.impl_type.__qualname__

    @property
    def is_state_binding(self) -> bool:
        """Whether the impl is a ``StateImpl`` (takes typed state inputs)."""
        return issubclass(self.impl_type, StateImpl)


@final
class BuilderBinding(Binding, Generic[S, M]):
    """A spec class, the builder that accepts it and the impl that consumes its metadata.

    ``bind_builder(spec_type, builder_cls, impl_cls)`` makes one; so does this
    constructor, with the same arguments and checks. ``S`` is the spec class, ``M``
    the metadata the builder makes and the impl consumes.

    Raises:
        TypeError: if the arguments are not a concrete spec class, a builder and an
            impl, or the annotations say the builder or impl accepts a spec class that
            ``spec_type`` is not.
    """

    def __init__(
        self,
        spec_type: type[S],
        builder_cls: BuilderConstructor[S, M],
        impl_cls: ImplConstructor[S, P, M],
    ) -> None:
        # Checked at run time too: plugins reach here without having been type-checked.
        given: tuple[object, object, object] = (spec_type, builder_cls, impl_cls)
        if not _is_subclass(given[0], KVCacheSpec):
            raise TypeError(
                f"bind_builder: spec_type must be a subclass of KVCacheSpec, got {given[0]!r}"
            )
        if not _is_subclass(given[1], AttentionMetadataBuilder):
            raise TypeError(
                "bind_builder: builder_cls must be a subclass of AttentionMetadataBuilder, "
                f"got {given[1]!r}"
            )
        if not _is_subclass(given[2], LayerImpl):
            raise TypeError(
                f"bind_builder: impl_cls must be a subclass of AttentionImpl or StateImpl, got {given[2]!r}"
            )
        # The classes, as far as they are read (isinstance cannot recover type arguments).
        builder = cast("type[AttentionMetadataBuilder[Any, Any]]", given[1])
        impl = cast("type[object]", given[2])
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
        self._spec_type = spec_type
        self._kind = kind
        # The constructors are kept as the checked callables; the classes only as what
        # is read from them (identity, names, class-level facts), never called.
        self._make_builder: BuilderConstructor[S, M] = builder_cls
        self._make_impl: Callable[[S, Any], LayerImpl[M, Any, Any]] = impl_cls
        self._builder_type: type[object] = builder
        self._builder_class: _BuilderClass = builder
        self._impl_type: type[object] = impl
        self._params_classes = _declared(impl, "layer_params", _IMPL_PARAMS_ARG)

    @override
    def __repr__(self) -> str:
        return (
            f"BuilderBinding({self._spec_type.__name__}, {self.builder_name}, {self.impl_name})"
        )

    @property
    @override
    def spec_type(self) -> type[S]:
        return self._spec_type

    @property
    @override
    def kind(self) -> KVCacheSpecKind:
        return self._kind

    @property
    @override
    def builder_type(self) -> type[object]:
        return self._builder_type

    @property
    @override
    def impl_type(self) -> type[object]:
        return self._impl_type

    @property
    @override
    def reorder_batch_threshold(self) -> int | None:
        return self._builder_class.reorder_batch_threshold

    @override
    def get_cudagraph_support(
        self, config: AttentionConfig, kv_cache_spec: KVCacheSpec
    ) -> AttentionCGSupport:
        return self._builder_class.get_cudagraph_support(config, kv_cache_spec)

    def _check_spec(self, kv_cache_spec: KVCacheSpec) -> S:
        if not isinstance(kv_cache_spec, self._spec_type) or kv_cache_spec.kind is not self._kind:
            raise TypeError(
                f"{self.builder_name} is bound to {self._spec_type.__name__} "
                f"(kind={self._kind.value}), got a {type(kv_cache_spec).__name__} "
                f"(kind={kv_cache_spec.kind.value})"
            )
        return kv_cache_spec

    @override
    def create(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> AttentionMetadataBuilder[M, Any]:
        return self._make_builder(self._check_spec(kv_cache_spec), layer_names, config, device)

    @override
    def create_impl(self, kv_cache_spec: KVCacheSpec, layer_params: object) -> LayerImpl[M, Any, Any]:
        spec = self._check_spec(kv_cache_spec)
        expected = self._params_classes
        if expected is not None and not isinstance(layer_params, expected):
            raise TypeError(
                f"{self.impl_name} takes layer_params of type {_names(expected)}, "
                f"got {type(layer_params).__name__}"
            )
        return self._make_impl(spec, layer_params)


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
    return BuilderBinding(spec_type, builder_cls, impl_cls)


def bind_each(
    spec_types: Sequence[type[S]],
    builder_cls: BuilderConstructor[S, M],
    impl_cls: ImplConstructor[S, P, M],
) -> tuple[BuilderBinding[S, M], ...]:
    """``bind_builder`` for each spec class of ``spec_types``, with one builder and impl.

    ``builders = bind_each((FullAttentionSpec, SlidingWindowSpec), MyBuilder, MyImpl)``
    """
    return tuple(BuilderBinding(t, builder_cls, impl_cls) for t in spec_types)
