"""Validation shared by the state-layer kernels (private to the kernels package).

Plain Python on tensor metadata, importing neither triton nor attnkit's specs, so the
torch oracles (:mod:`attnkit.kernels.torch.gated_delta`, ``linear_attention``) and the
Triton launchers (``kernels.triton``: gated delta, linear attention, short conv, conv1d,
Mamba2) can all use it. The ``*_tensors`` checks read no device value back to the host
(the Triton launchers' contract); the oracles' checks read the index values and
validate them (:func:`check_state_lists`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit.kernels._checks import KernelTypeError, describe
from attnkit.kernels.torch.conv1d import (
    _check_has_initial_state,
    _check_index,
    _check_query_start_loc,
    _check_state_indices,
    _check_tensor,
)


def check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise KernelTypeError(f"scale: expected a finite float, got {describe(scale)}")
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float, got {scale!r}")
    return float(scale)


def check_states(states: object, qk: Tensor, v: Tensor) -> Tensor:
    """float32 ``states`` ``[S, H, K, V]`` (any strides) for ``qk`` ``[*, H, K]``, ``v``."""
    states = _check_tensor(
        "states",
        states,
        layout="[S, H, K, V]",
        shape=(None, qk.shape[1], qk.shape[2], v.shape[2]),
        device=qk.device,
    )
    if states.dtype != torch.float32:
        raise ValueError(f"states: expected dtype torch.float32, got {states.dtype}")
    return states


def check_slot_tensor(state_indices: object, *, batch: int, device: torch.device) -> Tensor:
    """int32 ``state_indices`` ``[B]``; its values are trusted (not read back)."""
    return _check_index(
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
    qsl = _check_index(
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
    flags = _check_index(
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
    offsets = _check_query_start_loc(query_start_loc, num_tokens=num_tokens, device=device)
    batch = len(offsets) - 1
    slots = _check_state_indices(state_indices, batch=batch, num_slots=num_slots, device=device)
    flags = _check_has_initial_state(has_initial_state, batch=batch, device=device)
    return offsets, slots, flags
