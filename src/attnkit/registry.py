"""Backend registry: built-ins, ``register_backend``, and entry-point plugins.

Plugins are packages that declare an entry point in the group ``attnkit.backends``
whose value is their backend class::

    [project.entry-points."attnkit.backends"]
    my_backend = "my_package.backend:MyBackend"

Discovery reads entry-point *metadata* only; a plugin is imported the first time its
backend is asked for (``get``, ``load_all``). A plugin that fails to import, is not a
valid backend, or clashes with an existing name is excluded: the error is kept as a
reason (``excluded()``) and logged, never raised from ``import attnkit``.

Plugin code runs behind a guard wherever it runs: its import, the checks of its
declarations (``declaration_problems``, ``supported_kinds()``, ``environment_reasons``)
and, in selection, its hooks (``call_backend_code``). Anything it raises, ``SystemExit``
included, becomes a reason naming the plugin and the exception; only
``KeyboardInterrupt`` (and ``GeneratorExit``) pass through. Naming a plugin that
failed (``get``, ``entry``, selection) raises ``PluginError`` with its failure, not
"unknown backend". A built-in backend's exceptions are bugs and propagate.

Which plugins may load: ``ATTNKIT_PLUGINS`` (comma-separated names; unset = all,
empty = none) filters discovery; ``AttentionConfig.plugins`` narrows it further for
one selection.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata as importlib_metadata
from typing import Literal, TypeGuard, TypeVar, cast

import torch

from .backend import AttentionBackend
from .errors import (
    ArgumentTypeError,
    DuplicateBackendError,
    InvalidArgumentError,
    InvalidBackendError,
    PluginError,
    UnknownBackendError,
)
from .spec import KVCacheSpecKind

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendRegistry",
    "DuplicateBackendError",
    "InvalidBackendError",
    "RegistryEntry",
    "UnknownBackendError",
    "call_backend_code",
    "default_registry",
    "describe_exception",
    "register_backend",
]

ENTRY_POINT_GROUP = "attnkit.backends"

logger = logging.getLogger(__name__)

B = TypeVar("B", bound=type[AttentionBackend])
T = TypeVar("T")

PASS_THROUGH: tuple[type[BaseException], ...] = (KeyboardInterrupt, GeneratorExit)
"""What plugin code may raise through attnkit; anything else it raises becomes a reason."""

BUILTIN_BACKENDS: Mapping[str, str] = {
    "reference": "attnkit.backends.reference:ReferenceBackend",
    "cpu_attn": "attnkit.backends.cpu_attn:CpuAttentionBackend",
    "cpu_mla": "attnkit.backends.cpu_attn:CpuMLABackend",
    "triton_attn": "attnkit.backends.triton_attn:TritonAttentionBackend",
    "triton_mla": "attnkit.backends.triton_mla:TritonMLABackend",
    "flash_attn": "attnkit.backends.flash_attn:FlashAttentionBackend",
    "flex_attention": "attnkit.backends.flex_attention:FlexAttentionBackend",
    "triton_mamba1": "attnkit.backends.triton_state:TritonMamba1Backend",
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
        failed: the plugin's own code failed (import, declarations), as opposed to an
            exclusion by the allowlist or a duplicate name.
    """

    name: str
    origin: Literal["builtin", "registered", "plugin"]
    source: str
    backend: type[AttentionBackend] | None = None
    error: str | None = None
    failed: bool = False
    _loader: Callable[[], object] | None = dataclasses.field(default=None, repr=False)

    def label(self) -> str:
        """``plugin 'name' (source)`` for messages; ``backend 'name' (...)`` otherwise."""
        what = "plugin" if self.origin == "plugin" else f"{self.origin} backend"
        return f"{what} {self.name!r} ({self.source})"


def describe_exception(exc: BaseException) -> str:
    """``"ValueError: message"`` (the type alone when the message is empty); a
    ``SystemExit`` says that ``sys.exit`` was called, with its code."""
    if isinstance(exc, SystemExit):
        return f"SystemExit: sys.exit({exc.code!r}) was called"
    try:
        text = str(exc)
    except Exception:  # an exception whose __str__ fails: its type still says much
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def call_backend_code(entry: RegistryEntry, what: str, call: Callable[[], T]) -> T:
    """``call()``, code of ``entry``'s backend class (a hook such as
    ``not_supported_reasons``), behind the plugin guard.

    Raises:
        PluginError: ``entry`` is not a built-in and its code raised anything but
            ``KeyboardInterrupt`` / ``GeneratorExit`` (``SystemExit`` included); the
            message names the backend, ``what`` and the exception. A built-in's own
            exceptions propagate unchanged: they are bugs in attnkit.
    """
    if entry.origin == "builtin":
        return call()
    try:
        return call()
    except PASS_THROUGH:
        raise
    except BaseException as exc:
        raise PluginError(f"{entry.label()} failed in {what}: {describe_exception(exc)}") from exc


def _safe_repr(obj: object) -> str:
    try:
        text = repr(obj)
    except Exception:
        return f"<{type(obj).__name__} object (its repr() raised)>"
    return text if len(text) <= 200 else text[:197] + "..."


def _class_source(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _is_str_list(value: object) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(
        isinstance(v, str) for v in cast("list[object]", value)
    )


def _check_backend_class(obj: object) -> type[AttentionBackend]:
    """``obj`` as a valid backend class.

    Runs the class's declaration code (``declaration_problems``, ``supported_kinds()``,
    ``environment_reasons`` on each device type, what listings call) and checks what
    it returns.

    Raises:
        InvalidBackendError: ``obj`` is not a valid backend, or its code raised (the
            message names the step and the exception; ``KeyboardInterrupt`` and
            ``GeneratorExit`` pass through).
    """
    step = "the subclass check"
    try:
        if not (inspect.isclass(obj) and issubclass(obj, AttentionBackend)):
            raise InvalidBackendError(f"{_safe_repr(obj)} is not an AttentionBackend subclass")
        cls: type[AttentionBackend] = obj
        step = "declaration_problems()"
        problems: object = cls.declaration_problems()
        if not _is_str_list(problems):
            raise InvalidBackendError(
                f"{_class_source(cls)}.declaration_problems() must return a list of str, "
                f"got {_safe_repr(problems)}"
            )
        if problems:
            raise InvalidBackendError(
                f"{_class_source(cls)} is not a valid backend: "
                + "; ".join(problems)
            )
        step = "supported_kinds()"
        kinds: object = cls.supported_kinds()
        if not (
            isinstance(kinds, frozenset)
            and all(isinstance(k, KVCacheSpecKind) for k in cast("frozenset[object]", kinds))
        ):
            raise InvalidBackendError(
                f"{_class_source(cls)}.supported_kinds() must return a frozenset of "
                f"KVCacheSpecKind, got {_safe_repr(kinds)}"
            )
        for device_type in ("cpu", "cuda"):
            step = f"environment_reasons(torch.device({device_type!r}))"
            reasons: object = cls.environment_reasons(torch.device(device_type))
            if not _is_str_list(reasons):
                raise InvalidBackendError(
                    f"{_class_source(cls)}.{step} must return a list of str, "
                    f"got {_safe_repr(reasons)}"
                )
    except PASS_THROUGH:
        raise
    except InvalidBackendError:
        raise
    except BaseException as exc:
        where = _class_source(obj) if inspect.isclass(obj) else _safe_repr(obj)
        raise InvalidBackendError(
            f"{where} raised {describe_exception(exc)} in {step}"
        ) from exc
    return cls


class BackendRegistry:
    """Name -> backend class.

    Args:
        builtins: name -> ``module:Class`` of built-in backends.
        discover_plugins: read the ``attnkit.backends`` entry points.
        allowlist: plugin names that may load; ``None`` reads ``ATTNKIT_PLUGINS``
            (unset: all).
        entry_points: the entry points to use instead of the installed ones (tests).

    Lookups (``get``, ``entry``) raise ``UnknownBackendError`` for a name nothing
    registered (with close matches, and why a plugin of that name was excluded by the
    allowlist), and ``PluginError`` for a plugin whose own code failed (its import
    error, or what its declarations raised). Nothing a plugin raises escapes as
    anything else.

    Raises:
        ArgumentTypeError: an argument of the wrong type.
    """

    def __init__(
        self,
        *,
        builtins: Mapping[str, str] | None = None,
        discover_plugins: bool = True,
        allowlist: Iterable[str] | None = None,
        entry_points: Iterable[importlib_metadata.EntryPoint] | None = None,
    ) -> None:
        _check_arguments(builtins, discover_plugins, allowlist, entry_points)
        self._entries: dict[str, RegistryEntry] = {}
        self._excluded: dict[str, RegistryEntry] = {}
        self._lock = threading.RLock()
        self._allowlist = (
            _allowlist_names(allowlist) if allowlist is not None else env_plugin_allowlist()
        )
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
            InvalidBackendError: if ``backend`` is not a class, or breaks the backend
                contract (also when its declaration code raises: the message names
                the exception).
            DuplicateBackendError: if the name is taken (unless ``replace``); the
                message names both sources.
            ArgumentTypeError: ``replace`` is not a bool.
        """
        if not isinstance(replace, bool):
            raise ArgumentTypeError(
                f"replace must be a bool, got {_safe_repr(replace)} ({type(replace).__name__})"
            )
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
        """Remove a backend registered with ``register`` (tests and reloads).

        Raises:
            ArgumentTypeError: ``name`` is not a str.
            UnknownBackendError: no backend has that name (``PluginError`` for a
                plugin that failed to load).
            InvalidArgumentError: the backend is a built-in or a plugin.
        """
        _check_name_argument(name)
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise self._unknown(name)
            if entry.origin != "registered":
                raise InvalidArgumentError(
                    f"backend {name!r} is a {entry.origin} and cannot be unregistered "
                    f"(only backends added with register() can be)"
                )
            del self._entries[name]

    def names(self) -> list[str]:
        """Names of every registered or discovered (not excluded) backend, sorted."""
        with self._lock:
            return sorted(self._entries)

    def entry(self, name: str) -> RegistryEntry:
        """The entry of ``name`` (loaded or not).

        Raises:
            ArgumentTypeError: ``name`` is not a str.
            UnknownBackendError: no backend has that name.
            PluginError: the plugin of that name failed to load (the message gives
                its failure).
        """
        _check_name_argument(name)
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise self._unknown(name)
            return entry

    def get(self, name: str) -> type[AttentionBackend]:
        """The backend class of ``name``, importing a plugin on first use.

        Raises:
            ArgumentTypeError: ``name`` is not a str.
            UnknownBackendError: no backend has that name (the message lists the
                registered ones, close matches, and an allowlist exclusion).
            PluginError: the plugin of that name failed to load, now or before (the
                message names it and what it raised; it is then excluded).
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
        if entry.origin == "builtin":
            # A broken built-in is a bug in attnkit: let it raise.
            entry.backend = self._checked(entry, _check_backend_class(entry._loader()))
            return
        try:
            loaded = entry._loader()
        except PASS_THROUGH:
            raise
        except BaseException as exc:
            self._fail(entry, describe_exception(exc))
            return
        try:
            cls = self._checked(entry, _check_backend_class(loaded))
        except InvalidBackendError as exc:
            self._fail(entry, describe_exception(exc))
            return
        entry.backend = cls

    @staticmethod
    def _checked(entry: RegistryEntry, cls: type[AttentionBackend]) -> type[AttentionBackend]:
        if cls.name != entry.name:
            raise InvalidBackendError(
                f"entry point {entry.name!r} loads a backend named {cls.name!r}; "
                f"the two names must match"
            )
        return cls

    def _fail(self, entry: RegistryEntry, error: str) -> None:
        entry.error = error
        entry.failed = True
        self._exclude(entry)

    def load_all(self) -> list[RegistryEntry]:
        """Load every entry; return all entries, excluded ones last (for listings).

        A plugin that fails is excluded (its reason in ``error``), never raised.
        """
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

    def failures(self) -> dict[str, str]:
        """Name -> the ``PluginError`` message of each plugin whose own code failed
        (import, declarations) and that no other backend of its name replaced."""
        with self._lock:
            return {
                entry.name: _failure_message(entry)
                for entry in self._excluded.values()
                if entry.failed and entry.name not in self._entries
            }

    def _unknown(self, name: str) -> UnknownBackendError | PluginError:
        for entry in self._excluded.values():
            if entry.name == name and entry.failed:
                return PluginError(_failure_message(entry))
        known = ", ".join(sorted(self._entries)) or "none"
        message = f"unknown backend {name!r}; registered backends: {known}"
        close = difflib.get_close_matches(name, sorted(self._entries), n=3, cutoff=0.75)
        if close:
            message += f". Did you mean {' or '.join(map(repr, close))}?"
        reasons = [e.error for e in self._excluded.values() if e.name == name and e.error]
        if reasons:
            message += f". A plugin named {name!r} was excluded: " + "; ".join(reasons)
        return UnknownBackendError(message)


def _failure_message(entry: RegistryEntry) -> str:
    return f"{entry.label()} failed to load and is excluded: {entry.error}"


def _check_name_argument(name: object) -> None:
    if not isinstance(name, str):
        raise ArgumentTypeError(
            f"name must be a backend name (a str), got {_safe_repr(name)} ({type(name).__name__})"
        )


def _allowlist_names(allowlist: Iterable[str]) -> frozenset[str]:
    items = list(cast("Iterable[object]", allowlist))
    bad = [_safe_repr(n) for n in items if not isinstance(n, str)]
    if bad:
        raise ArgumentTypeError(f"allowlist must hold plugin names (str), got {', '.join(bad)}")
    return frozenset(cast("list[str]", items))


def _is_str_mapping(value: object) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and isinstance(v, str)
        for k, v in cast("Mapping[object, object]", value).items()
    )


def _check_arguments(
    builtins: object, discover_plugins: object, allowlist: object, entry_points: object
) -> None:
    if builtins is not None and not _is_str_mapping(builtins):
        raise ArgumentTypeError(
            "builtins must be None or a mapping of name -> 'module:Class' strings, "
            f"got {_safe_repr(builtins)}"
        )
    if not isinstance(discover_plugins, bool):
        raise ArgumentTypeError(
            f"discover_plugins must be a bool, got {_safe_repr(discover_plugins)} "
            f"({type(discover_plugins).__name__})"
        )
    if allowlist is not None and (
        isinstance(allowlist, str | bytes) or not isinstance(allowlist, Iterable)
    ):
        raise ArgumentTypeError(
            "allowlist must be None or an iterable of plugin names (e.g. ['my_backend']), "
            f"got {_safe_repr(allowlist)} ({type(allowlist).__name__})"
        )
    if entry_points is not None and not isinstance(entry_points, Iterable):
        raise ArgumentTypeError(
            "entry_points must be None or an iterable of importlib.metadata.EntryPoint, "
            f"got {_safe_repr(entry_points)} ({type(entry_points).__name__})"
        )


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
