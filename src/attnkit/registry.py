"""Backend registry: built-ins, ``register_backend``, and entry-point plugins.

Plugins are packages that declare an entry point in the group ``attnkit.backends``
whose value is their backend class::

    [project.entry-points."attnkit.backends"]
    my_backend = "my_package.backend:MyBackend"

Discovery reads entry-point *metadata* only; a plugin is imported the first time its
backend is asked for (``get``, ``load_all``). A plugin that fails to import, is not a
valid backend, or clashes with an existing name is excluded: the error is kept as a
reason (``excluded()``) and logged, never raised from ``import attnkit``.

Which plugins may load: ``ATTNKIT_PLUGINS`` (comma-separated names; unset = all,
empty = none) filters discovery; ``AttentionConfig.plugins`` narrows it further for
one selection.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata as importlib_metadata
from typing import Literal, TypeVar

from .backend import AttentionBackend
from .errors import DuplicateBackendError, InvalidBackendError, UnknownBackendError

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendRegistry",
    "DuplicateBackendError",
    "InvalidBackendError",
    "RegistryEntry",
    "UnknownBackendError",
    "default_registry",
    "register_backend",
]

ENTRY_POINT_GROUP = "attnkit.backends"

logger = logging.getLogger(__name__)

B = TypeVar("B", bound=type[AttentionBackend])

BUILTIN_BACKENDS: Mapping[str, str] = {
    "reference": "attnkit.backends.reference:ReferenceBackend",
    "triton_attn": "attnkit.backends.triton_attn:TritonAttentionBackend",
    "flash_attn": "attnkit.backends.flash_attn:FlashAttentionBackend",
    "triton_mamba2": "attnkit.backends.triton_state:TritonMamba2Backend",
    "triton_gdn": "attnkit.backends.triton_state:TritonGatedDeltaNetBackend",
    "triton_linear_attn": "attnkit.backends.triton_state:TritonLinearAttentionBackend",
    "triton_short_conv": "attnkit.backends.triton_state:TritonShortConvBackend",
}
"""Name -> ``module:Class`` of the backends shipped with attnkit (imported on first use)."""


@dataclasses.dataclass
class RegistryEntry:
    """One registered or discovered backend.

    Attributes:
        name: the registry name.
        origin: ``builtin``, ``registered`` (``register_backend``) or ``plugin``.
        source: where it comes from (``module:Class`` or the entry point and its
            distribution).
        backend: the class, once loaded.
        error: why it is excluded, if it is.
    """

    name: str
    origin: Literal["builtin", "registered", "plugin"]
    source: str
    backend: type[AttentionBackend] | None = None
    error: str | None = None
    _loader: Callable[[], object] | None = dataclasses.field(default=None, repr=False)


def _class_source(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _check_backend_class(obj: object) -> type[AttentionBackend]:
    if not (inspect.isclass(obj) and issubclass(obj, AttentionBackend)):
        raise InvalidBackendError(f"{obj!r} is not an AttentionBackend subclass")
    problems = obj.declaration_problems()
    if problems:
        raise InvalidBackendError(
            f"{_class_source(obj)} is not a valid backend: " + "; ".join(problems)
        )
    return obj


class BackendRegistry:
    """Name -> backend class.

    Args:
        builtins: name -> ``module:Class`` of built-in backends.
        discover_plugins: read the ``attnkit.backends`` entry points.
        allowlist: plugin names that may load; ``None`` reads ``ATTNKIT_PLUGINS``
            (unset: all).
        entry_points: the entry points to use instead of the installed ones (tests).
    """

    def __init__(
        self,
        *,
        builtins: Mapping[str, str] | None = None,
        discover_plugins: bool = True,
        allowlist: Iterable[str] | None = None,
        entry_points: Iterable[importlib_metadata.EntryPoint] | None = None,
    ) -> None:
        self._entries: dict[str, RegistryEntry] = {}
        self._excluded: dict[str, RegistryEntry] = {}
        self._lock = threading.RLock()
        self._allowlist = frozenset(allowlist) if allowlist is not None else env_plugin_allowlist()
        for name, path in (builtins or {}).items():
            self._entries[name] = RegistryEntry(
                name=name, origin="builtin", source=path, _loader=_path_loader(path)
            )
        if discover_plugins:
            eps = (
                list(entry_points)
                if entry_points is not None
                else list(importlib_metadata.entry_points(group=ENTRY_POINT_GROUP))
            )
            for ep in sorted(eps, key=lambda e: (e.name, _ep_source(e))):
                self._add_plugin(ep)

    def _add_plugin(self, ep: importlib_metadata.EntryPoint) -> None:
        source = _ep_source(ep)
        entry = RegistryEntry(name=ep.name, origin="plugin", source=source, _loader=ep.load)
        if self._allowlist is not None and ep.name not in self._allowlist:
            entry.error = (
                f"plugin {ep.name!r} is not in the allowlist ATTNKIT_PLUGINS="
                f"{','.join(sorted(self._allowlist))!r}"
            )
            self._exclude(entry, log=False)
            return
        existing = self._entries.get(ep.name)
        if existing is not None:
            entry.error = (
                f"duplicate backend name {ep.name!r}: {source} clashes with "
                f"{existing.origin} {existing.source}"
            )
            self._exclude(entry)
            return
        self._entries[ep.name] = entry

    def _exclude(self, entry: RegistryEntry, *, log: bool = True) -> None:
        if self._entries.get(entry.name) is entry:
            del self._entries[entry.name]
        self._excluded[f"{entry.name} ({entry.source})"] = entry
        if log:
            logger.warning("attnkit: excluded backend plugin %s: %s", entry.name, entry.error)

    def register(self, backend: B, *, replace: bool = False) -> B:
        """Register a backend class under its ``name``; usable as a decorator.

        Raises:
            InvalidBackendError: if the class breaks the backend contract.
            DuplicateBackendError: if the name is taken (unless ``replace``); the
                message names both sources.
        """
        cls = _check_backend_class(backend)
        source = _class_source(cls)
        with self._lock:
            existing = self._entries.get(cls.name)
            if existing is not None and not replace:
                if existing.backend is cls:
                    return backend
                raise DuplicateBackendError(
                    f"duplicate backend name {cls.name!r}: {source} clashes with "
                    f"{existing.origin} {existing.source}"
                )
            self._entries[cls.name] = RegistryEntry(
                name=cls.name, origin="registered", source=source, backend=cls
            )
        return backend

    def unregister(self, name: str) -> None:
        """Remove a backend registered with ``register`` (tests and reloads)."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise self._unknown(name)
            if entry.origin != "registered":
                raise ValueError(f"backend {name!r} is a {entry.origin} and cannot be unregistered")
            del self._entries[name]

    def names(self) -> list[str]:
        """Names of every registered or discovered (not excluded) backend, sorted."""
        with self._lock:
            return sorted(self._entries)

    def entry(self, name: str) -> RegistryEntry:
        """The entry of ``name`` (loaded or not). Raises ``UnknownBackendError``."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise self._unknown(name)
            return entry

    def get(self, name: str) -> type[AttentionBackend]:
        """The backend class of ``name``, importing a plugin on first use.

        Raises:
            UnknownBackendError: if no backend has that name, or its plugin was
                excluded while loading (the message gives why).
        """
        with self._lock:
            entry = self.entry(name)
            if entry.backend is None:
                self._load(entry)
            if entry.backend is None:
                raise self._unknown(name)
            return entry.backend

    def _load(self, entry: RegistryEntry) -> None:
        assert entry._loader is not None  # only loaded entries lack a loader
        try:
            cls = _check_backend_class(entry._loader())
            if cls.name != entry.name:
                raise InvalidBackendError(
                    f"entry point {entry.name!r} loads a backend named {cls.name!r}; "
                    f"the two names must match"
                )
        except Exception as exc:
            entry.error = f"{type(exc).__name__}: {exc}"
            if entry.origin == "builtin":
                raise
            self._exclude(entry)
            return
        entry.backend = cls

    def load_all(self) -> list[RegistryEntry]:
        """Load every entry; return all entries, excluded ones last (for listings)."""
        with self._lock:
            for name in list(self._entries):
                entry = self._entries[name]
                if entry.backend is None:
                    self._load(entry)
            return [self._entries[n] for n in sorted(self._entries)] + list(self._excluded.values())

    def excluded(self) -> dict[str, str]:
        """``"name (source)"`` -> why each excluded plugin was left out."""
        with self._lock:
            return {key: entry.error or "" for key, entry in self._excluded.items()}

    def _unknown(self, name: str) -> UnknownBackendError:
        known = ", ".join(sorted(self._entries)) or "none"
        message = f"unknown backend {name!r}; registered backends: {known}"
        reasons = [e.error for e in self._excluded.values() if e.name == name and e.error]
        if reasons:
            message += f". A plugin named {name!r} was excluded: " + "; ".join(reasons)
        return UnknownBackendError(message)


def _path_loader(path: str) -> Callable[[], object]:
    module, _, attr = path.partition(":")

    def load() -> object:
        return getattr(importlib.import_module(module), attr)

    return load


def _ep_source(ep: importlib_metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    dist_name = getattr(dist, "name", None) if dist is not None else None
    where = f" from distribution {dist_name!r}" if dist_name else ""
    return f"entry point {ep.name} = {ep.value}{where}"


def env_plugin_allowlist() -> frozenset[str] | None:
    """``ATTNKIT_PLUGINS`` as a set (unset: ``None``, every plugin; empty: none)."""
    raw = os.environ.get("ATTNKIT_PLUGINS")
    if raw is None:
        return None
    return frozenset(p.strip() for p in raw.split(",") if p.strip())


_default: BackendRegistry | None = None
_default_lock = threading.Lock()


def default_registry() -> BackendRegistry:
    """The process-wide registry: built-ins and installed plugins, discovered on first call."""
    global _default
    with _default_lock:
        if _default is None:
            _default = BackendRegistry(builtins=BUILTIN_BACKENDS)
        return _default


def register_backend(backend: B, *, replace: bool = False) -> B:
    """Register ``backend`` in the default registry (also works as a class decorator)."""
    return default_registry().register(backend, replace=replace)
