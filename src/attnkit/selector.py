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

The result depends only on the arguments (and the installed packages the backends
check); nothing is cached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from .backend import AttentionBackend, BackendRequest
from .capabilities import AttentionFeature
from .config import AttentionConfig
from .errors import BackendNotSupportedError, NoBackendError, Rejection, UnknownBackendError
from .registry import BackendRegistry, default_registry
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
        "triton_mamba2",
        "triton_gdn",
        "triton_linear_attn",
        "triton_short_conv",
        "reference",
    ),
    "cpu": ("reference", "triton_attn"),
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


def _reasons_for(
    name: str, request: BackendRequest, config: AttentionConfig, registry: BackendRegistry
) -> tuple[type[AttentionBackend] | None, tuple[str, ...]]:
    try:
        entry = registry.entry(name)
    except UnknownBackendError as exc:
        return None, (str(exc),)
    if entry.origin == "plugin" and config.plugins is not None and name not in config.plugins:
        return None, (
            f"plugin {name!r} is not in AttentionConfig.plugins={sorted(config.plugins)}",
        )
    try:
        backend = registry.get(name)
    except UnknownBackendError as exc:
        return None, (str(exc),)
    return backend, tuple(backend.not_supported_reasons(request))


def select_backend(
    spec: KVCacheSpec,
    config: AttentionConfig,
    *,
    device: torch.device | str,
    capability: tuple[int, int] | None = None,
    features: frozenset[AttentionFeature] = frozenset(),
    num_heads: int | None = None,
    registry: BackendRegistry | None = None,
    priority: Mapping[str, Sequence[str]] | None = None,
) -> Selection:
    """Choose the backend for ``spec`` on ``device`` under ``config``.

    Args:
        spec: the group's spec; its ``kind`` routes it.
        config: backend choices.
        device: the compute device.
        capability: CUDA compute capability; ``None`` reads it from ``device`` when it
            is a CUDA device.
        features: optional features the group's layers need.
        num_heads: query heads, if known.
        registry: where names are looked up (default: ``default_registry()``).
        priority: device type -> names, replacing ``DEFAULT_PRIORITY``.

    Raises:
        BackendNotSupportedError: a backend named for this kind cannot serve it.
        NoBackendError: no candidate can serve it.
    """
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
    device = torch.device(device)
    if capability is None and device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
    registry = registry if registry is not None else default_registry()
    request = BackendRequest(
        spec=spec,
        device=device,
        capability=capability,
        features=features,
        num_heads=num_heads,
        config=config,
    )
    kind = spec.kind
    rejected: list[Rejection] = []

    explicit: tuple[str, SelectionSource] | None = None
    if kind in config.backend_per_kind:
        explicit = (config.backend_per_kind[kind], "backend_per_kind")
    elif config.backend is not None:
        try:
            declared = registry.get(config.backend).supported_kinds()
        except UnknownBackendError:
            declared = frozenset({kind})  # let the explicit path report the unknown name
        if kind in declared:
            explicit = (config.backend, "backend")
        else:
            rejected.append(
                Rejection(
                    config.backend,
                    (
                        f"config.backend={config.backend!r} does not serve kind={kind.value}; "
                        f"using the {device.type} priority list for this kind",
                    ),
                )
            )

    if explicit is not None:
        name, source = explicit
        backend, reasons = _reasons_for(name, request, config, registry)
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

    order = list((priority if priority is not None else DEFAULT_PRIORITY).get(device.type, ()))
    order += [n for n in registry.names() if n not in order]
    for name in order:
        if name not in registry.names():
            continue  # a priority name that is not installed here
        backend, reasons = _reasons_for(name, request, config, registry)
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
