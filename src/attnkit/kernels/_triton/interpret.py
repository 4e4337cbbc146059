"""Whether attnkit's Triton kernels run under the Triton interpreter (CPU) or compiled.

``triton.jit`` picks interpreter or compiler when a function is defined, from
``TRITON_INTERPRET`` at that moment, and every kernel module imports the shared device
functions of this package, so the choice is made once per process, when the first
kernel module is imported. :data:`INTERPRETED` records it; the launchers read it to take
the interpreter's exact fallbacks (fp8 bit patterns, bfloat16 rounding and dots in
float32, see each kernel module), and the Triton backends read it to refuse a CPU
device when the kernels were compiled.
"""

from __future__ import annotations

import triton
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["INTERPRETED"]


@triton.jit
def _probe():
    pass


INTERPRETED: bool = isinstance(_probe, InterpretedFunction)
"""True when the kernels are Triton interpreter functions (``TRITON_INTERPRET=1`` at import)."""
