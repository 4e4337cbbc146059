"""Backend selection: spec + config + device -> ``Selection``.

Candidates for a spec of kind ``k``, in order:

1. ``config.backend_per_kind[k]`` if set: the only candidate. If it cannot serve,
   ``BackendNotSupportedError`` with its reasons (no silent fallback).
2. ``config.backend`` if set and the backend declares kind ``k``: the only candidate,
   with the same rule. A global backend that does not declare ``k`` (say
   ``triton_attn`` for a hybrid model's ``mamba`` layers) is recorded as a rejection
   and the priority list serves ``k``.
3. The device's priority list (``DEFAULT_PRIORITY``), then every other registered
   backend by name: the first with no reasons wins.

Every candidate is also asked ``device_reasons`` (``attnkit.devices.device_problem``
by default), so a device absent on this machine (``"cuda"`` without CUDA, ``"cuda:7"``
on a one-GPU host) rejects every backend with that reason.

A candidate's hooks run behind the plugin guard (``attnkit.registry.call_backend_code``):
what a plugin raises (``SystemExit`` included) or returns in place of a list of
reasons makes it a rejection naming the plugin and the exception, never an error of
``select_backend``. A plugin that failed to load is a rejection carrying its
``PluginError`` message. Built-in backends' exceptions propagate (they are bugs).

The result depends only on the arguments (and the installed packages the backends
check); nothing is cached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, TypeGuard, cast

import torch

from ._validation import is_capability, is_int
from .backend import AttentionBackend, BackendRequest
from .capabilities import AttentionFeature
from .config import AttentionConfig
from .devices import SUPPORTED_DEVICE_TYPES, device_problem, parse_device
from .errors import (
    ArgumentTypeError,
    BackendNotSupportedError,
    InvalidArgumentError,
    NoBackendError,
    PluginError,
    Rejection,
    UnknownBackendError,
)
from .registry import BackendRegistry, RegistryEntry, call_backend_code, default_registry
from .spec import KVCacheSpec, KVCacheSpecKind

__all__ = [
    "DEFAULT_PRIORITY",
    "BackendNotSupportedError",
    "NoBackendError",
    "Rejection",
    "Selection",
    "select_backend",
]

DEFAULT_PRIORITY: Mapping[str, tuple[str, ...]] = {
    "cuda": (
        "flash_attn",
        "triton_attn",
        "triton_mla",
        "triton_mamba1",
        "triton_mamba2",
        "triton_gdn",
        "triton_linear_attn",
        "triton_short_conv",
        "flex_attention",
        "reference",
    ),
    # cpu_attn first on CPU: its engines (a native paged kernel for decodes, blocked
    # matrix products for prefills) meet benchmarks/bench_cpu.py's targets and compile
    # nothing per shape; cpu_mla runs the same engines for absorbed MLA; reference
    # stays the oracle and the fallback for what they do not serve (MLA projections,
    # sparse attention, fp8 latents, state layers). flex_attention is left out: on CPU
    # it is slower and compiles each new shape for seconds; it runs there when named
    # (AttentionConfig.backend or backend_per_kind).
    "cpu": ("cpu_attn", "cpu_mla", "reference", "triton_attn"),
}
"""Device type -> backend names tried first, fastest valid choice first."""

SelectionSource = Literal["backend_per_kind", "backend", "priority"]


@dataclasses.dataclass(frozen=True)
class Selection:
    """The chosen backend for one spec, with how and why.

    Attributes:
        backend: the chosen class.
        kind: the spec's kind.
        source: which rule chose it.
        rejected: every candidate tried before it and why it could not serve.
        request: what the backends were asked.
    """

    backend: type[AttentionBackend]
    kind: KVCacheSpecKind
    source: SelectionSource
    rejected: tuple[Rejection, ...]
    request: BackendRequest

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def explain(self) -> str:
        """Multi-line account: the choice, then each rejected candidate with reasons."""
        lines = [f"{self.kind.value}: {self.backend.name} (chosen by {self.source})"]
        lines.extend(f"  skipped {r}" for r in self.rejected)
        return "\n".join(lines)


def _describe_request(request: BackendRequest) -> str:
    spec = request.spec
    fields = ", ".join(
        f"{f.name}={getattr(spec, f.name)!r}" for f in dataclasses.fields(spec)
    )
    extra = ""
    if request.features:
        extra += f", features={sorted(f.value for f in request.features)}"
    if request.capability is not None:
        extra += f", capability={request.capability[0]}.{request.capability[1]}"
    return f"{type(spec).__name__}({fields}) on {request.device}{extra}"


def _show(value: object) -> str:
    """``repr(value)`` (cut to 120 characters) and its type, for messages."""
    try:
        text = repr(value)
    except Exception:
        text = "<unprintable>"
    if len(text) > 120:
        text = text[:117] + "..."
    return f"{text} ({type(value).__name__})"


_CAPABILITY_FORM = "None or a (major, minor) tuple of two ints >= 0, e.g. (9, 0)"
_FEATURE_NAMES = ", ".join(f.value for f in AttentionFeature)


def _check_capability(capability: object) -> tuple[int, int] | None:
    if capability is None:
        return None
    if is_capability(capability):
        return cast("tuple[int, int]", capability)
    if not isinstance(capability, tuple):
        raise ArgumentTypeError(f"capability must be {_CAPABILITY_FORM}; got {_show(capability)}")
    items = cast("tuple[object, ...]", capability)
    if len(items) != 2:
        raise InvalidArgumentError(
            f"capability must be {_CAPABILITY_FORM}; got {items!r} ({len(items)} item(s))"
        )
    if not all(is_int(v) for v in items):
        raise ArgumentTypeError(
            f"capability must be {_CAPABILITY_FORM}; got {items!r} "
            f"(items of type {', '.join(type(v).__name__ for v in items)})"
        )
    major, minor = cast("tuple[int, int]", items)
    if major < 0 or minor < 0:
        raise InvalidArgumentError(f"capability must be {_CAPABILITY_FORM}; got {items!r}")
    return major, minor


def _check_features(features: object) -> frozenset[AttentionFeature]:
    allowed = f"an iterable of AttentionFeature (or their names: {_FEATURE_NAMES})"
    if isinstance(features, str | bytes) or not isinstance(features, Iterable):
        raise ArgumentTypeError(
            f"features must be {allowed}, e.g. frozenset({{AttentionFeature.ALIBI}}); "
            f"got {_show(features)}"
        )
    result: set[AttentionFeature] = set()
    for item in cast("Iterable[object]", features):
        if isinstance(item, AttentionFeature):
            result.add(item)
        elif isinstance(item, str):
            try:
                result.add(AttentionFeature(item))
            except ValueError:
                raise InvalidArgumentError(
                    f"features: unknown feature {item!r}; valid features: {_FEATURE_NAMES}"
                ) from None
        else:
            raise ArgumentTypeError(f"features must be {allowed}; got an item {_show(item)}")
    return frozenset(result)


def _check_num_heads(num_heads: object) -> int | None:
    if num_heads is None:
        return None
    if not is_int(num_heads):
        raise ArgumentTypeError(f"num_heads must be None or a positive int, got {_show(num_heads)}")
    value = cast("int", num_heads)
    if value < 1:
        raise InvalidArgumentError(f"num_heads must be None or a positive int, got {value!r}")
    return value


def _check_priority(priority: object) -> Mapping[str, tuple[str, ...]] | None:
    if priority is None:
        return None
    form = (
        "None or a mapping of device type "
        f"({', '.join(map(repr, SUPPORTED_DEVICE_TYPES))}) -> sequence of backend names"
    )
    if not isinstance(priority, Mapping):
        raise ArgumentTypeError(f"priority must be {form}; got {_show(priority)}")
    checked: dict[str, tuple[str, ...]] = {}
    for key, names in cast("Mapping[object, object]", priority).items():
        if not isinstance(key, str):
            raise ArgumentTypeError(f"priority must be {form}; got a key {_show(key)}")
        if key not in SUPPORTED_DEVICE_TYPES:
            raise InvalidArgumentError(f"priority must be {form}; got a key {key!r}")
        if isinstance(names, str | bytes) or not isinstance(names, Sequence):
            raise ArgumentTypeError(
                f"priority[{key!r}] must be a sequence of backend names, e.g. "
                f"('reference',); got {_show(names)}"
            )
        items = tuple(cast("Sequence[object]", names))
        bad = [item for item in items if not isinstance(item, str)]
        if bad:
            raise ArgumentTypeError(
                f"priority[{key!r}] must be a sequence of backend names (str); "
                f"got an item {_show(bad[0])}"
            )
        checked[key] = cast("tuple[str, ...]", items)
    return checked


def _is_reasons(value: object) -> TypeGuard[list[str] | tuple[str, ...]]:
    return isinstance(value, list | tuple) and all(
        isinstance(r, str) for r in cast("Sequence[object]", value)
    )


def _reasons_problem(entry: RegistryEntry, what: str, reasons: object) -> str | None:
    """Why ``reasons`` (what ``what`` returned) is not a list of str, if it is not."""
    if _is_reasons(reasons):
        return None
    return f"{entry.label()} returned {_show(reasons)} from {what}; expected a list of str"


def _blocked_by_config(name: str, is_plugin: bool, config: AttentionConfig) -> str | None:
    if is_plugin and config.plugins is not None and name not in config.plugins:
        return f"plugin {name!r} is not in AttentionConfig.plugins={sorted(config.plugins)}"
    return None


def _reasons_for(
    name: str,
    request: BackendRequest,
    config: AttentionConfig,
    registry: BackendRegistry,
    *,
    ask_device: bool = True,
) -> tuple[type[AttentionBackend] | None, tuple[str, ...]]:
    try:
        entry = registry.entry(name)
    except PluginError as exc:
        blocked = _blocked_by_config(name, True, config)
        return None, (blocked or str(exc),)
    except UnknownBackendError as exc:
        return None, (str(exc),)
    blocked = _blocked_by_config(name, entry.origin == "plugin", config)
    if blocked is not None:
        return None, (blocked,)
    try:
        backend = registry.get(name)
    except (UnknownBackendError, PluginError) as exc:
        return None, (str(exc),)
    try:
        reasons: object = call_backend_code(
            entry, "not_supported_reasons()", lambda: backend.not_supported_reasons(request)
        )
        device: object = (
            call_backend_code(
                entry, "device_reasons()", lambda: backend.device_reasons(request.device)
            )
            if ask_device
            else []
        )
    except PluginError as exc:
        return None, (str(exc),)
    problem = _reasons_problem(entry, "not_supported_reasons()", reasons) or _reasons_problem(
        entry, "device_reasons()", device
    )
    if problem is not None:
        return None, (problem,)
    given = cast("Sequence[str]", reasons)
    missing = [r for r in cast("Sequence[str]", device) if r not in given]
    return backend, (*missing, *given)


def _declared_kinds(
    name: str, config: AttentionConfig, registry: BackendRegistry
) -> frozenset[KVCacheSpecKind] | None:
    """The kinds ``name`` declares; ``None`` when they cannot be read (unknown name, a
    plugin the config blocks or that failed): the explicit path then reports why."""
    try:
        entry = registry.entry(name)
        if _blocked_by_config(name, entry.origin == "plugin", config) is not None:
            return None
        backend = registry.get(name)
        kinds: object = call_backend_code(entry, "supported_kinds()", backend.supported_kinds)
    except (UnknownBackendError, PluginError):
        return None
    if not isinstance(kinds, frozenset):
        return None  # not_supported_reasons reports what is wrong with the plugin
    return frozenset(kinds)


def select_backend(
    spec: KVCacheSpec,
    config: AttentionConfig,
    *,
    device: torch.device | str,
    capability: tuple[int, int] | None = None,
    features: Iterable[AttentionFeature] = frozenset(),
    num_heads: int | None = None,
    registry: BackendRegistry | None = None,
    priority: Mapping[str, Sequence[str]] | None = None,
    hypothetical_device: bool = False,
) -> Selection:
    """Choose the backend for ``spec`` on ``device`` under ``config``.

    Every argument is checked first, before any backend is asked.

    Args:
        spec: the group's spec; its ``kind`` routes it.
        config: backend choices.
        device: the compute device (``torch.device`` or a string such as ``"cuda:1"``).
            A device absent here is not an error of its own: every candidate is
            rejected with the reason (``NoBackendError``).
        capability: CUDA compute capability ``(major, minor)``; ``None`` reads it from
            ``device`` when it is a CUDA device present here.
        features: optional features the group's layers need (``AttentionFeature``
            members, or their names such as ``"alibi"``).
        num_heads: query heads, if known.
        registry: where names are looked up (default: ``default_registry()``).
        priority: device type -> names, replacing ``DEFAULT_PRIORITY``.
        hypothetical_device: plan for a device this machine may not have (``attnkit
            plan --device cuda --capability 9.0`` on a laptop): backends are not asked
            whether the device exists (``device_reasons``); everything else, installed
            packages included, is checked as usual. Needs ``capability`` for CUDA.

    Raises:
        ArgumentTypeError: an argument of the wrong type (the message names it, the
            value given and what is allowed).
        InvalidArgumentError: an argument of the right type with a value not allowed
            (a device type attnkit does not run on, a capability that is not two
            ints >= 0, an unknown feature name, ``num_heads`` < 1, a priority key
            that is not a device type).
        BackendNotSupportedError: a backend named for this kind cannot serve it
            (unknown, a plugin that failed with its ``PluginError`` message, or its
            reasons).
        NoBackendError: no candidate can serve it.
    """
    if not isinstance(spec, KVCacheSpec):
        raise ArgumentTypeError(
            "spec must be a KVCacheSpec (e.g. FullAttentionSpec, SlidingWindowSpec, "
            f"MambaSpec), got {_show(spec)}"
        )
    if not isinstance(config, AttentionConfig):
        raise ArgumentTypeError(
            f"config must be an AttentionConfig, got {_show(config)}; build one with "
            "AttentionConfig(...) or AttentionConfig.model_validate({...})"
        )
    parsed_device = parse_device(device, argument="device")
    capability = _check_capability(capability)
    checked_features = _check_features(features)
    num_heads = _check_num_heads(num_heads)
    if registry is not None and not isinstance(registry, BackendRegistry):
        raise ArgumentTypeError(
            f"registry must be None or a BackendRegistry, got {_show(registry)}"
        )
    checked_priority = _check_priority(priority)
    if not isinstance(hypothetical_device, bool):
        raise ArgumentTypeError(
            f"hypothetical_device must be a bool, got {_show(hypothetical_device)}"
        )
    if hypothetical_device and parsed_device.type == "cuda" and capability is None:
        raise InvalidArgumentError(
            "hypothetical_device=True for a CUDA device needs its capability, e.g. "
            "capability=(9, 0), got capability=None"
        )

    if (
        capability is None
        and parsed_device.type == "cuda"
        and device_problem(parsed_device) is None
    ):
        capability = torch.cuda.get_device_capability(parsed_device)
    registry = registry if registry is not None else default_registry()
    request = BackendRequest(
        spec=spec,
        device=parsed_device,
        capability=capability,
        features=checked_features,
        num_heads=num_heads,
        config=config,
    )
    kind = spec.kind
    rejected: list[Rejection] = []

    explicit: tuple[str, SelectionSource] | None = None
    if kind in config.backend_per_kind:
        explicit = (config.backend_per_kind[kind], "backend_per_kind")
    elif config.backend is not None:
        declared = _declared_kinds(config.backend, config, registry)
        if declared is None or kind in declared:
            # Unknown, blocked or failed names are reported by the explicit path.
            explicit = (config.backend, "backend")
        else:
            rejected.append(
                Rejection(
                    config.backend,
                    (
                        f"config.backend={config.backend!r} does not serve kind={kind.value}; "
                        f"using the {parsed_device.type} priority list for this kind",
                    ),
                )
            )

    if explicit is not None:
        name, source = explicit
        backend, reasons = _reasons_for(
            name, request, config, registry, ask_device=not hypothetical_device
        )
        if backend is not None and not reasons:
            return Selection(backend, kind, source, tuple(rejected), request)
        setting = (
            f"backend_per_kind[{kind.value!r}]" if source == "backend_per_kind" else "backend"
        )
        rejected.append(Rejection(name, reasons))
        raise BackendNotSupportedError(
            f"backend {name!r} was requested by AttentionConfig.{setting} but cannot serve "
            f"{_describe_request(request)}:\n"
            + "\n".join(f"  - {r}" for r in reasons)
            + "\nHINT: choose another backend for this kind, or drop the setting to let "
            "attnkit choose.",
            rejected,
        )

    # Plugins that failed to load stay candidates (rejected with their failure), so a
    # selection reads the same before and after the first one that loaded them.
    available = set(registry.names()) | set(registry.failures())
    chosen = checked_priority if checked_priority is not None else DEFAULT_PRIORITY
    order = list(chosen.get(parsed_device.type, ()))
    order += [n for n in sorted(available) if n not in order]
    for name in order:
        if name not in available:
            continue  # a priority name that is not installed here
        backend, reasons = _reasons_for(
            name, request, config, registry, ask_device=not hypothetical_device
        )
        if backend is not None and not reasons:
            return Selection(backend, kind, "priority", tuple(rejected), request)
        rejected.append(Rejection(name, reasons))
    listing = "\n".join(
        f"  `{r.backend}` is not supported because:\n" + "\n".join(f"    {x}" for x in r.reasons)
        for r in rejected
    ) or "  (no backend is registered)"
    raise NoBackendError(
        f"no backend can serve {_describe_request(request)}:\n{listing}\n"
        f"HINT: `attnkit backends` lists every backend and what it serves.",
        rejected,
    )
