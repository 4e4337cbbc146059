"""Argument checks shared by every kernel launcher (private to the kernels package).

Kernel modules may not import :mod:`attnkit.errors`, so launchers raise builtin
exceptions. Every check here reads tensor *metadata* only (type, shape, dtype, device,
strides, data pointer): never a tensor value, so nothing synchronises with the device
and the launchers stay usable under CUDA graphs.

Messages follow one pattern, ``"<argument>: expected <what is allowed>, got <what was
given>"``, with :func:`describe` for the given value.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping

from torch import Tensor

__all__ = [
    "KernelTypeError",
    "check_bool",
    "check_chunk_size",
    "check_distinct_output",
    "check_finite_float",
    "check_has_slots",
    "check_int_arg",
    "describe",
    "require_tensor",
]

_REPR = reprlib.Repr()
_REPR.maxstring = 40
_REPR.maxother = 40
_REPR.maxlist = 4
_REPR.maxtuple = 4


class KernelTypeError(TypeError, ValueError):
    """An argument of the wrong Python type (a list for a tensor, a float for an int).

    A :class:`TypeError`, and also a :class:`ValueError` because launchers raised
    ``ValueError`` for these before: ``except ValueError`` callers keep working.
    """


def describe(value: object) -> str:
    """What was given, for an error message.

    ``"torch.float32 [3, 4, 16] on cpu"`` for a tensor, ``"list [0.0, 0.0]"`` for
    anything else (the type name and a short repr), ``"None"`` for None.
    """
    if isinstance(value, Tensor):
        return f"{value.dtype} {list(value.shape)} on {value.device}"
    if value is None:
        return "None"
    return f"{type(value).__name__} {_REPR.repr(value)}"


def require_tensor(name: str, value: object, expected: str = "a torch.Tensor") -> Tensor:
    """``value`` itself when it is a tensor; else :class:`KernelTypeError`.

    ``expected`` describes what the argument must be (``"a torch.Tensor [T, Hq, D]"``).
    """
    if not isinstance(value, Tensor):
        raise KernelTypeError(f"{name}: expected {expected}, got {describe(value)}")
    return value


def check_bool(name: str, value: object) -> bool:
    """A real ``bool`` (an int, a string or None is refused, not read as truthy)."""
    if not isinstance(value, bool):
        raise KernelTypeError(f"{name}: expected a bool, got {describe(value)}")
    return value


def check_int_arg(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """An ``int`` (not a bool) in ``[minimum, maximum]``."""
    # bool is an int subclass; reject it so a stray True is not read as 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise KernelTypeError(f"{name}: expected an int, got {describe(value)}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: expected an int <= {maximum}, got {value}")
    return value


def check_finite_float(name: str, value: object) -> float:
    """A finite Python ``float`` or ``int`` (not a bool), returned as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KernelTypeError(f"{name}: expected a finite float, got {describe(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite float, got {value!r}")
    return float(value)


def check_chunk_size(value: object) -> int:
    """An ``int >= 1`` chunk size (the message shows the value first: ``got 2.0 (float)``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise KernelTypeError(
            f"chunk_size: expected an int >= 1, got {value!r} ({type(value).__name__})"
        )
    if value < 1:
        raise ValueError(f"chunk_size: expected an int >= 1, got {value!r}")
    return value


def check_has_slots(name: str, states: Tensor, batch: int) -> None:
    """A state cache ``[S, ...]`` with at least one slot when there are requests.

    The slot values are not read (no device sync), but a cache of zero slots cannot
    hold any request's state: every slot index would address memory outside it.
    """
    if batch > 0 and states.shape[0] == 0:
        raise ValueError(
            f"{name}: expected at least one slot (S >= 1) for B = {batch} requests, "
            f"got {describe(states)}"
        )


def check_distinct_output(name: str, out: Tensor, inputs: Mapping[str, Tensor | None]) -> None:
    """``out`` is none of ``inputs`` (same first element): these kernels read inputs
    after they write outputs, so writing over an input gives wrong results.

    Only exact aliasing (``out=x``, or a view starting at ``x``'s first element) is
    caught, by a pointer comparison; partial overlaps stay the caller's duty.
    """
    if out.numel() == 0:
        return
    pointer = out.data_ptr()
    for other, t in inputs.items():
        if t is not None and t.numel() > 0 and t.device == out.device and t.data_ptr() == pointer:
            raise ValueError(
                f"{name}: expected a tensor that does not overlap {other}, got "
                f"{describe(out)} sharing its memory with {other} ({describe(t)})"
            )
