"""Whether attnkit's Triton kernels can run on a device here (shared by the Triton backends)."""

from __future__ import annotations

import os
import sys

import torch

# Values triton itself reads as "on" for TRITON_INTERPRET (case-insensitive).
_TRUTHY = frozenset({"1", "true", "on", "yes", "y"})
INTERPRETER_REASON = (
    "device=cpu needs the Triton interpreter (set TRITON_INTERPRET=1 before importing triton)"
)
KERNELS_COMPILED_REASON = (
    "device=cpu needs the Triton interpreter, but attnkit's Triton kernels were already "
    "imported without it (set TRITON_INTERPRET=1 before importing triton)"
)


# The kernels' interpreter shim: it records, once per process, how triton.jit defined
# every kernel (attnkit.kernels._triton.interpret.INTERPRETED).
_INTERPRET_MODULE = "attnkit.kernels._triton.interpret"


def triton_cpu_reasons(device: torch.device) -> list[str]:
    """On CPU the kernels run only under the interpreter (read from the environment now)."""
    if device.type != "cpu":
        return []
    if os.environ.get("TRITON_INTERPRET", "").lower() not in _TRUTHY:
        return [INTERPRETER_REASON]
    # triton.jit picks interpreter or compiler when a kernel is defined, so kernels
    # imported before the variable was set stay compiled (and cannot run on CPU).
    shim = sys.modules.get(_INTERPRET_MODULE)
    if shim is not None and getattr(shim, "INTERPRETED", True) is False:
        return [KERNELS_COMPILED_REASON]
    return []
