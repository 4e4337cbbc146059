"""Validation shared by the state-layer kernels (private to the kernels package).

Plain Python on tensor metadata, importing neither triton nor attnkit's specs, so the
torch oracles (:mod:`attnkit.kernels.torch.gated_delta`, ``linear_attention``) and the
Triton launchers (``kernels.triton``: gated delta, linear attention, short conv, conv1d,
Mamba2) can all use it. The ``*_tensors`` checks read no device value back to the host
(the Triton launchers' contract); the oracles' checks read the index values and
validate them (:func:`check_state_lists`).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from attnkit.kernels._checks import KernelTypeError, describe, require_tensor

# Tensor checks shared by the oracles and the launchers (public within kernels).


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


def check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise KernelTypeError(f"scale: expected a finite float, got {describe(scale)}")
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float, got {scale!r}")
    return float(scale)


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


def flags_as_bytes(flags: Tensor) -> Tensor:
    """A uint8 view of the bool ``has_initial_state`` (same storage, no copy).

    A byte compared with 0 reads the same under the Triton interpreter and compiled.
    """
    return flags.view(torch.uint8)


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
