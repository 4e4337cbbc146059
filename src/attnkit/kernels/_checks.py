"""Argument and tensor checks shared by every op's contract, reference and launchers.

The one home of the kernels' check helpers (private to the kernels package): Python
types and numbers, tensors (rank, sizes, dtype, device, strides, aliasing) and the
varlen state batch of the state ops (``query_start_loc``, ``state_indices``,
``has_initial_state``, ``states``). Plain Python on tensor metadata; importing it
imports neither triton nor attnkit's specs.

Kernel modules may not import :mod:`attnkit.errors`, so launchers raise builtin
exceptions. Every check reads tensor *metadata* only (type, shape, dtype, device,
strides, data pointer), never a tensor value, so nothing synchronises with the device
and the launchers stay usable under CUDA graphs; the exceptions are the references'
``check_state_lists`` family, which read the index values and validate them.

Messages follow one pattern, ``"<argument>: expected <what is allowed>, got <what was
given>"``, with :func:`describe` for the given value.
"""

from __future__ import annotations

import itertools
import math
import reprlib
from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = [
    "FLOAT_DTYPES",
    "KernelTypeError",
    "alloc_out",
    "check_bool",
    "check_chunk_size",
    "check_device",
    "check_distinct_output",
    "check_dtype",
    "check_finite_float",
    "check_float",
    "check_has_initial_state",
    "check_has_slots",
    "check_index",
    "check_int_arg",
    "check_last_dim_contiguous",
    "check_out",
    "check_query_start_loc",
    "check_slot_tensor",
    "check_state_indices",
    "check_state_lists",
    "check_states",
    "check_tensor",
    "check_varlen_tensors",
    "describe",
    "fmt_shape",
    "require_tensor",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The floating dtypes the Triton kernels read and write."""

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


def check_chunk_size(
    value: object, *, allowed: tuple[int, ...] | None = None, maximum: int | None = None
) -> int:
    """An ``int >= 1`` chunk size (the message shows the value first: ``got 2.0 (float)``),
    one of ``allowed`` and ``<= maximum`` when given (a Triton launcher's sizes)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise KernelTypeError(
            f"chunk_size: expected an int >= 1, got {value!r} ({type(value).__name__})"
        )
    if value < 1:
        raise ValueError(f"chunk_size: expected an int >= 1, got {value!r}")
    if allowed is not None and value not in allowed:
        raise ValueError(f"chunk_size: expected one of {allowed}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"chunk_size: expected an int <= {maximum}, got {value}")
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


# --------------------------------------------------------------------------- tensors


def fmt_shape(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"


def check_tensor(
    name: str,
    t: object,
    *,
    layout: str,
    shape: tuple[int | None, ...],
    device: torch.device | None,
) -> Tensor:
    """Check that ``t`` is a tensor of the given rank and sizes (``None`` = any size).

    ``device=None`` skips the device check (used for ``x``, which defines the device).
    """
    t = require_tensor(name, t, f"a torch.Tensor {layout}")
    if t.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(t.shape, shape, strict=True)
    ):
        raise ValueError(
            f"{name}: expected shape {layout} = {fmt_shape(shape)}, got {list(t.shape)}"
        )
    if device is not None and t.device != device:
        raise ValueError(
            f"{name}: expected a tensor on device {device}, got device {t.device} ({describe(t)})"
        )
    return t


def check_float(name: str, t: Tensor) -> None:
    if not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point dtype, got {t.dtype}")


def check_device(name: str, t: Tensor, device: torch.device | None, of: str = "query") -> None:
    """``t`` on ``device`` (no check when None), described as "the ``of`` device"."""
    if device is not None and t.device != device:
        raise ValueError(
            f"{name}: expected device {device} (the {of} device), got {t.device} ({describe(t)})"
        )


def check_dtype(
    name: str, t: Tensor | None, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
) -> None:
    """``t`` (None: nothing to check) has a dtype in ``dtypes`` (the kernels' dtypes)."""
    if t is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {dtypes}, got {t.dtype}")


def check_last_dim_contiguous(name: str, t: Tensor) -> None:
    """Unit stride in the last dimension (a native kernel walks it with a plain pointer)."""
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected a contiguous last dimension (stride 1), got strides "
            f"{list(t.stride())} for {describe(t)}"
        )


def check_out(out: object, like: Tensor, layout: str) -> Tensor | None:
    """``out`` is None or a tensor of the shape, dtype and device of ``like`` (= x)."""
    if out is None:
        return None
    out = check_tensor("out", out, layout=layout, shape=tuple(like.shape), device=like.device)
    if out.dtype != like.dtype:
        raise ValueError(f"out: expected the dtype of x ({like.dtype}), got {out.dtype}")
    return out


def alloc_out(out: object, like: Tensor, layout: str) -> Tensor:
    """``out`` checked by :func:`check_out`, or a new tensor like ``like`` when None."""
    result = check_out(out, like, layout)
    return torch.empty_like(like) if result is None else result


# --------------------------------------------------------------------------- varlen state batches


def check_index(
    name: str, t: object, *, length: int | None, dtype: torch.dtype, device: torch.device
) -> Tensor:
    layout = "[B+1]" if name == "query_start_loc" else "[B]"
    t = check_tensor(name, t, layout=layout, shape=(length,), device=device)
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    return t


def check_query_start_loc(
    query_start_loc: object, *, num_tokens: int, device: torch.device
) -> list[int]:
    """Validate ``query_start_loc`` and return it as a Python list of offsets."""
    qsl = check_index(
        "query_start_loc", query_start_loc, length=None, dtype=torch.int32, device=device
    )
    if qsl.numel() < 1:
        raise ValueError("query_start_loc: expected shape [B+1] with B >= 0, got [0]")
    offsets: list[int] = qsl.tolist()  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]  # torch types tolist() as a bare List
    if offsets[0] != 0:
        raise ValueError(f"query_start_loc: expected first offset 0, got {offsets[0]}")
    if offsets[-1] != num_tokens:
        raise ValueError(
            f"query_start_loc: expected last offset to equal the number of tokens T = "
            f"{num_tokens}, got {offsets[-1]}"
        )
    if any(b < a for a, b in itertools.pairwise(offsets)):
        raise ValueError(f"query_start_loc: expected non-decreasing offsets, got {offsets}")
    return offsets


def check_state_indices(
    state_indices: object, *, batch: int, num_slots: int, device: torch.device
) -> list[int]:
    """Validate ``state_indices`` (int32 ``[B]``, in range, distinct); return a list."""
    si = check_index("state_indices", state_indices, length=batch, dtype=torch.int32, device=device)
    slots: list[int] = si.tolist()  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]  # torch types tolist() as a bare List
    bad = [s for s in slots if not 0 <= s < num_slots]
    if bad:
        raise ValueError(
            f"state_indices: expected slots in [0, S) = [0, {num_slots}), got out-of-range "
            f"values {bad}"
        )
    if len(set(slots)) != len(slots):
        raise ValueError(f"state_indices: expected distinct slots within one call, got {slots}")
    return slots


def check_has_initial_state(
    has_initial_state: object, *, batch: int, device: torch.device
) -> list[bool]:
    his = check_index(
        "has_initial_state", has_initial_state, length=batch, dtype=torch.bool, device=device
    )
    flags: list[bool] = his.tolist()  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]  # torch types tolist() as a bare List
    return flags


def check_states(states: object, qk: Tensor, v: Tensor) -> Tensor:
    """float32 ``states`` ``[S, H, K, V]`` (any strides) for ``qk`` ``[*, Hk, K]`` and ``v``
    ``[*, H, V]``: one state per value head (Gated DeltaNet's key heads may be fewer)."""
    states = check_tensor(
        "states",
        states,
        layout="[S, H, K, V]",
        shape=(None, v.shape[1], qk.shape[2], v.shape[2]),
        device=qk.device,
    )
    if states.dtype != torch.float32:
        raise ValueError(f"states: expected dtype torch.float32, got {states.dtype}")
    return states


def check_slot_tensor(state_indices: object, *, batch: int, device: torch.device) -> Tensor:
    """int32 ``state_indices`` ``[B]``; its values are trusted (not read back)."""
    return check_index(
        "state_indices", state_indices, length=batch, dtype=torch.int32, device=device
    )


def check_varlen_tensors(
    query_start_loc: object,
    state_indices: object,
    has_initial_state: object,
    *,
    device: torch.device,
    num_tokens: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(query_start_loc, state_indices, has_initial_state)`` of a varlen call.

    int32 ``[B+1]``, int32 ``[B]`` and bool ``[B]``; no value is read back. With
    ``num_tokens``, a batch of no request (``[1]`` offsets) is rejected when there are
    tokens to place.
    """
    qsl = check_index(
        "query_start_loc", query_start_loc, length=None, dtype=torch.int32, device=device
    )
    if qsl.numel() < 1:
        raise ValueError("query_start_loc: expected shape [B+1] with B >= 0, got [0]")
    batch = qsl.shape[0] - 1
    if num_tokens is not None and batch == 0 and num_tokens > 0:
        raise ValueError(
            f"query_start_loc: expected at least one request for T = {num_tokens} tokens, "
            "got shape [1]"
        )
    slots = check_slot_tensor(state_indices, batch=batch, device=device)
    flags = check_index(
        "has_initial_state", has_initial_state, length=batch, dtype=torch.bool, device=device
    )
    return qsl, slots, flags


def check_state_lists(
    query_start_loc: object,
    state_indices: object,
    has_initial_state: object,
    *,
    num_tokens: int,
    num_slots: int,
    device: torch.device,
) -> tuple[list[int], list[int], list[bool]]:
    """The oracles' varlen checks, values included: offsets, slots and flags as lists."""
    offsets = check_query_start_loc(query_start_loc, num_tokens=num_tokens, device=device)
    batch = len(offsets) - 1
    slots = check_state_indices(state_indices, batch=batch, num_slots=num_slots, device=device)
    flags = check_has_initial_state(has_initial_state, batch=batch, device=device)
    return offsets, slots, flags
