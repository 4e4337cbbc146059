"""``AttentionRuntime.forward`` as a torch operator, for models under ``torch.compile``.

Dynamo cannot trace the runtime's host code (dictionaries of layers, NumPy step
metadata, the per-call checks); a model that calls ``runtime.forward`` inside a
compiled region breaks its graph at every attention layer. ``AttentionRuntime.forward_op`` calls it
through ``torch.ops.attnkit.runtime_forward`` instead: the operator takes the runtime's
name and the layer's as strings (constants of the traced graph), declares the output it
writes, and has a fake implementation, so the layer is one opaque node and the rest of
the model (projections, norms, the MLP) compiles around it. At run time the node calls
``runtime.forward`` of the runtime's current step, checks and all: the engine keeps
calling ``begin_step`` outside the compiled region, and one compiled graph serves
every step.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from ..errors import StaleStepError

__all__ = ["SCHEMA", "register_runtime"]

SCHEMA = (
    "runtime_forward(str runtime, str layer, Tensor query, Tensor key, Tensor value, "
    "Tensor(a!) output) -> ()"
)
"""The operator's schema (``attnkit::`` namespace)."""

# name -> AttentionRuntime (Any: this module sits below the runtime class)
_RUNTIMES: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_COUNTER = itertools.count()


def register_runtime(runtime: object) -> str:
    """A new runtime's name for the operator (kept while the runtime lives). Given at
    construction: tracing reads it as a plain attribute (``_op_name``)."""
    name = f"runtime{next(_COUNTER)}"
    _RUNTIMES[name] = runtime
    return name


def _runtime_forward(
    runtime: str,
    layer: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
) -> None:
    rt = _RUNTIMES.get(runtime)
    if rt is None:
        raise StaleStepError(
            f"attnkit::runtime_forward: runtime {runtime!r} no longer exists (a compiled "
            f"graph outlived its runtime; compile the model again for the new one)"
        )
    rt.forward(layer, query, key, value, output=output)


def _runtime_forward_fake(*args: object) -> None:
    """Nothing to compute while tracing: the node writes only ``output``."""
    return None


# torch leaves Library and its methods unannotated; what they register is checked by
# tests/test_compile.py (the schema, fullgraph tracing, outputs against an oracle).
_library: Any = torch.library
_LIB = _library.Library("attnkit", "FRAGMENT")
_LIB.define(SCHEMA)
_LIB.impl("runtime_forward", _runtime_forward, "CompositeExplicitAutograd")
_library.register_fake("attnkit::runtime_forward", _runtime_forward_fake, lib=_LIB)
