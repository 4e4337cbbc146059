"""``AttentionConfig``: how an engine chooses backends.

>>> from attnkit import AttentionConfig, KVCacheSpecKind
>>> cfg = AttentionConfig.model_validate(
...     {"backend_per_kind": "sliding_window=triton_attn,full_attention=reference"},
...     context={"known_backends": ["reference", "triton_attn"]},
... )
>>> cfg.backend_per_kind[KVCacheSpecKind.SLIDING_WINDOW]
'triton_attn'

Backend names are checked against the backends that exist. By default that is
``attnkit.registry.default_registry()`` (built-ins, registered backends and
discovered plugins); pass ``context={"registry": reg}`` or
``context={"known_backends": [...]}`` to validate against another set.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from .spec import KVCacheSpecKind

__all__ = ["AttentionConfig", "parse_backend_per_kind"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_VALID_KINDS = ", ".join(k.value for k in KVCacheSpecKind)


def parse_backend_per_kind(value: str | Mapping[str, str] | Mapping[KVCacheSpecKind, str]) -> dict[KVCacheSpecKind, str]:
    """Parse ``"kind=backend,kind=backend"`` (CLI style) or a mapping into kind -> backend.

    Raises:
        ValueError: on an unknown kind (the message lists the valid kinds), a kind
            given twice, or an entry without ``=``.
    """
    items: list[tuple[object, object]]
    if isinstance(value, str):
        items = []
        for part in (p.strip() for p in value.split(",")):
            if not part:
                continue
            if "=" not in part:
                raise ValueError(
                    f"backend_per_kind entry {part!r} must look like 'kind=backend' "
                    f"(e.g. 'sliding_window=triton_attn')"
                )
            kind, _, backend = part.partition("=")
            items.append((kind.strip(), backend.strip()))
    elif isinstance(value, Mapping):
        items = list(value.items())
    else:
        raise ValueError(
            f"backend_per_kind must be a mapping or a 'kind=backend,...' string, "
            f"got {type(value).__name__}"
        )
    parsed: dict[KVCacheSpecKind, str] = {}
    for raw_kind, raw_backend in items:
        try:
            kind = KVCacheSpecKind(raw_kind)
        except ValueError:
            raise ValueError(
                f"backend_per_kind: unknown kind {raw_kind!r}; valid kinds: {_VALID_KINDS}"
            ) from None
        if kind in parsed:
            raise ValueError(f"backend_per_kind: kind {kind.value!r} is given twice")
        if not isinstance(raw_backend, str) or not _NAME.match(raw_backend):
            raise ValueError(
                f"backend_per_kind[{kind.value!r}] must be a backend name, got {raw_backend!r}"
            )
        parsed[kind] = raw_backend
    return parsed


def _known_backends(info: ValidationInfo) -> Collection[str]:
    context = info.context if isinstance(info.context, Mapping) else {}
    known = context.get("known_backends")
    if known is not None:
        return frozenset(known)
    registry = context.get("registry")
    if registry is None:
        # Imported here, not at module level: the registry sits above config in
        # the layering (backends import config), so config only reaches it when
        # it has a name to check.
        from .registry import default_registry

        registry = default_registry()
    names: Collection[str] = registry.names()
    return names


def _check_known(name: str, what: str, info: ValidationInfo) -> None:
    known = _known_backends(info)
    if name not in known:
        listed = ", ".join(sorted(known)) or "none"
        raise ValueError(f"{what}: unknown backend {name!r}; registered backends: {listed}")


class AttentionConfig(BaseModel):
    """Backend choice for a model.

    Attributes:
        backend: a backend for every kind it declares it serves (kinds it does not
            serve fall through to the device's priority list, with the reason kept).
        backend_per_kind: kind -> backend; wins over ``backend`` for that kind.
            Accepts ``{"sliding_window": "triton_attn"}`` or
            ``"sliding_window=triton_attn,full_attention=reference"``.
        plugins: allowlist of entry-point plugin backends that may be loaded for
            this config (``None``: every plugin the environment allows; see
            ``ATTNKIT_PLUGINS``).
        flash_attn_version: which flash-attn the ``flash_attn`` backend drives:
            2 (``flash_attn``), 4 (``flash_attn.cute``, the ``flash-attn-4`` wheel), or
            ``None`` to choose by the device's compute capability.
        max_num_reqs, max_num_batched_tokens, max_model_len: the engine's limits per
            step and per request; builders size their fixed-address (CUDA-graph)
            buffers from them.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str | None = None
    backend_per_kind: dict[KVCacheSpecKind, str] = Field(default_factory=dict)
    plugins: frozenset[str] | None = None
    flash_attn_version: Literal[2, 4] | None = None
    max_num_reqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    max_model_len: int = Field(default=32768, ge=1)

    @field_validator("backend_per_kind", mode="before")
    @classmethod
    def _parse_per_kind(cls, value: Any) -> dict[KVCacheSpecKind, str]:
        return parse_backend_per_kind(value)

    @field_validator("plugins", mode="before")
    @classmethod
    def _parse_plugins(cls, value: Any) -> Any:
        if isinstance(value, str):
            return frozenset(p.strip() for p in value.split(",") if p.strip())
        return value

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            _check_known(value, "backend", info)
        return value

    @field_validator("backend_per_kind")
    @classmethod
    def _check_per_kind(
        cls, value: dict[KVCacheSpecKind, str], info: ValidationInfo
    ) -> dict[KVCacheSpecKind, str]:
        for kind, name in value.items():
            _check_known(name, f"backend_per_kind[{kind.value!r}]", info)
        return value

    def describe(self) -> str:
        """One line for logs: ``backend=None backend_per_kind={sliding_window: triton_attn}``."""
        per_kind = ", ".join(f"{k.value}: {v}" for k, v in self.backend_per_kind.items())
        text = f"backend={self.backend} backend_per_kind={{{per_kind}}} plugins={self.plugins}"
        if self.flash_attn_version is not None:
            text += f" flash_attn_version={self.flash_attn_version}"
        return text


def env_plugin_allowlist() -> frozenset[str] | None:
    """``ATTNKIT_PLUGINS`` as a set (unset: ``None``, every plugin; empty: none)."""
    raw = os.environ.get("ATTNKIT_PLUGINS")
    if raw is None:
        return None
    return frozenset(p.strip() for p in raw.split(",") if p.strip())
