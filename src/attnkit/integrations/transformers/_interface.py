"""transformers' side of the adapter: the import (a clear error when transformers is
missing or old), the adapter's errors, and the function registered in
``AttentionInterface``, which hands each call to its module's handler."""

from __future__ import annotations

import importlib
import re
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from ...errors import AttnkitError, MissingDependencyError

ATTENTION_IMPLEMENTATION = "attnkit"
"""The name ``attach`` registers in transformers' ``AttentionInterface``."""

MIN_TRANSFORMERS_VERSION = (5, 0)
"""The oldest transformers release this adapter is written for (``AttentionInterface``
with per-call keyword parameters, ``set_attn_implementation``, v5 module layout)."""


_EXTRA_HINT = "pip install 'attnkit[transformers]'"


class UnsupportedModelError(AttnkitError, ValueError):
    """The model has a layer (or a convention) attnkit cannot serve through transformers'
    attention interface; the message names the layer and why."""


class StaleParametersError(AttnkitError, RuntimeError):
    """A layer's parameters (scale, window, soft-cap, dtype, device) differ from those
    the runtime was built with; the message names the layer and both values."""


def import_transformers() -> Any:
    """transformers, imported on first use; a clear error when it is missing or old."""
    try:
        module = importlib.import_module("transformers")
    except ImportError as exc:
        raise MissingDependencyError(
            f"attnkit.integrations.transformers needs the transformers package "
            f"(>= {'.'.join(map(str, MIN_TRANSFORMERS_VERSION))}): {_EXTRA_HINT}"
        ) from exc
    version = str(getattr(module, "__version__", "0"))
    found = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    if found < MIN_TRANSFORMERS_VERSION:
        raise MissingDependencyError(
            f"attnkit.integrations.transformers needs transformers >= "
            f"{'.'.join(map(str, MIN_TRANSFORMERS_VERSION))}, found {version}: "
            f"pip install -U 'attnkit[transformers]'"
        )
    return module


HANDLERS: weakref.WeakKeyDictionary[torch.nn.Module, _Handler] = weakref.WeakKeyDictionary()
"""Attention module -> who serves it (the probe, or an attachment)."""


class _Handler(Protocol):
    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: object,
        kwargs: Mapping[str, object],
    ) -> torch.Tensor: ...


def _attention_function(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: object,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``"attnkit"``: finds the module's handler (while
    ``torch.compile`` traces, the attachment's traced one, a plain attribute: Dynamo
    cannot trace the weak map)."""
    if torch.compiler.is_compiling():
        traced: Any = module.__dict__.get("_attnkit_traced")
        if traced is not None:
            return traced(query, key, value, attention_mask, kwargs), None
    handler = HANDLERS.get(module)
    if handler is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} (layer_idx={getattr(module, 'layer_idx', '?')}) called "
            f"attention implementation {ATTENTION_IMPLEMENTATION!r} but is not attached: "
            f"attach the model with attnkit.integrations.transformers.attach(model, ...)"
        )
    return handler(module, query, key, value, attention_mask, kwargs), None


def register(tf: Any) -> None:
    interface = tf.AttentionInterface
    interface.register(ATTENTION_IMPLEMENTATION, _attention_function)


def set_implementation(model: Any, name: str) -> None:
    """``model.set_attn_implementation(name)`` (a transformers method; torch types module
    attributes as tensors or modules, so the model is ``Any`` here)."""
    model.set_attn_implementation(name)
