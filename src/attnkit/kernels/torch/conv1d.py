"""Causal depthwise 1-D convolution with per-request state in a cache (pure torch).

This is the reference ("oracle") for the short convolution that precedes the SSM in a
Mamba2 layer. It is written for clarity: every request of a varlen batch is handled by
one vectorised block of torch code, accumulation is float32, and the output is cast
back to the dtype of ``x``.

Shape letters
-------------
``T`` total tokens in the batch, ``B`` requests, ``C`` channels, ``W`` kernel width
(``W >= 1``), ``S`` state slots in the cache.

Conventions
-----------
* ``query_start_loc``: int32 ``[B+1]``, cumulative token offsets; request ``b`` owns
  tokens ``query_start_loc[b]:query_start_loc[b+1]`` of ``x``. It must start at 0, end
  at ``T`` and never decrease (zero-length requests are allowed).
* ``state_indices``: int32 ``[B]``, the cache slot of each request. Slots must be in
  ``[0, S)`` and distinct within one call.
* ``has_initial_state``: bool ``[B]``. If False the request starts from zeros and the
  old content of its slot is ignored (then overwritten); if True it starts from the
  slot's content.
* ``conv_states``: ``[S, C, W-1]`` with the same dtype as ``x``. Slot ``s`` holds the
  last ``W-1`` inputs seen by the request living there, oldest first (so
  ``conv_states[s, :, -1]`` is the most recent input). Inputs are stored as given, before
  any convolution, so keeping them in the input dtype is lossless.

The convolution of channel ``c`` at a token ``t`` (with the request's previous inputs
prepended, zeros if there is no initial state) is::

    out[t, c] = act(bias[c] + sum_{k=0}^{W-1} weight[c, k] * u[t - (W-1) + k, c])

where ``u`` is the request's input stream and ``act`` is SiLU or the identity.
After a call, each request's slot holds the last ``W-1`` entries of
``[previous state (or zeros), new tokens]``; a request shorter than ``W-1`` tokens
therefore shifts its old state only partly out. A zero-length request leaves its
slot equal to its initial state (zeros when ``has_initial_state`` is False).
"""

from __future__ import annotations

import itertools
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.kernels._checks import KernelTypeError, describe, require_tensor

__all__ = ["causal_conv1d_update", "causal_conv1d_varlen"]

_ACTIVATIONS = ("silu", None)


# ----------------------------------------------------------------------------------
# Validation helpers (shared with ``mamba2``; private to the kernels package).
# ----------------------------------------------------------------------------------


def _fmt_shape(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"


def _check_tensor(
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
            f"{name}: expected shape {layout} = {_fmt_shape(shape)}, got {list(t.shape)}"
        )
    if device is not None and t.device != device:
        raise ValueError(
            f"{name}: expected a tensor on device {device}, got device {t.device} ({describe(t)})"
        )
    return t


def _check_float(name: str, t: Tensor) -> None:
    if not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point dtype, got {t.dtype}")


def _check_index(
    name: str, t: object, *, length: int | None, dtype: torch.dtype, device: torch.device
) -> Tensor:
    layout = "[B+1]" if name == "query_start_loc" else "[B]"
    t = _check_tensor(name, t, layout=layout, shape=(length,), device=device)
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    return t


def _check_query_start_loc(
    query_start_loc: object, *, num_tokens: int, device: torch.device
) -> list[int]:
    """Validate ``query_start_loc`` and return it as a Python list of offsets."""
    qsl = _check_index(
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


def _check_state_indices(
    state_indices: object, *, batch: int, num_slots: int, device: torch.device
) -> list[int]:
    """Validate ``state_indices`` (int32 ``[B]``, in range, distinct); return a list."""
    si = _check_index(
        "state_indices", state_indices, length=batch, dtype=torch.int32, device=device
    )
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


def _check_has_initial_state(
    has_initial_state: object, *, batch: int, device: torch.device
) -> list[bool]:
    his = _check_index(
        "has_initial_state", has_initial_state, length=batch, dtype=torch.bool, device=device
    )
    flags: list[bool] = his.tolist()  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]  # torch types tolist() as a bare List
    return flags


def _check_activation(activation: object) -> None:
    if activation is not None and not isinstance(activation, str):
        raise KernelTypeError(f"activation: expected 'silu' or None, got {describe(activation)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation: expected 'silu' or None, got {activation!r}")


def _check_conv_params(
    x: Tensor, weight: object, bias: object, conv_states: object, activation: object
) -> tuple[Tensor, Tensor | None, Tensor]:
    channels = x.shape[-1]
    _check_float("x", x)
    weight = _check_tensor(
        "weight", weight, layout="[C, W]", shape=(channels, None), device=x.device
    )
    _check_float("weight", weight)
    width = weight.shape[1]
    if width < 1:
        raise ValueError(f"weight: expected kernel width W >= 1, got shape {list(weight.shape)}")
    if bias is not None:
        bias = _check_tensor("bias", bias, layout="[C]", shape=(channels,), device=x.device)
        _check_float("bias", bias)
    conv_states = _check_tensor(
        "conv_states",
        conv_states,
        layout="[S, C, W-1]",
        shape=(None, channels, width - 1),
        device=x.device,
    )
    if conv_states.dtype != x.dtype:
        raise ValueError(
            f"conv_states: expected the dtype of x ({x.dtype}), got {conv_states.dtype}"
        )
    _check_activation(activation)
    return weight, bias, conv_states


def _apply_activation(y: Tensor, activation: Literal["silu"] | None) -> Tensor:
    return F.silu(y) if activation == "silu" else y


# ----------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------


def causal_conv1d_varlen(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    conv_states: Tensor,
    query_start_loc: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    activation: Literal["silu"] | None = "silu",
) -> Tensor:
    """Causal depthwise conv over a varlen batch, reading and writing cached states.

    Args:
        x: ``[T, C]`` inputs of all requests, concatenated.
        weight: ``[C, W]`` depthwise kernel; ``weight[c, W-1]`` multiplies the current token.
        bias: ``[C]`` or None.
        conv_states: ``[S, C, W-1]``, dtype of ``x``; updated in place (see module doc).
        query_start_loc: int32 ``[B+1]`` cumulative token offsets.
        state_indices: int32 ``[B]`` cache slot of each request (distinct, in ``[0, S)``).
        has_initial_state: bool ``[B]``; False means start from zeros.
        activation: ``"silu"`` or None.

    Returns:
        ``[T, C]`` in the dtype of ``x``.
    """
    x = _check_tensor("x", x, layout="[T, C]", shape=(None, None), device=None)
    weight, bias, conv_states = _check_conv_params(x, weight, bias, conv_states, activation)
    offsets = _check_query_start_loc(query_start_loc, num_tokens=x.shape[0], device=x.device)
    batch = len(offsets) - 1
    slots = _check_state_indices(
        state_indices, batch=batch, num_slots=conv_states.shape[0], device=x.device
    )
    flags = _check_has_initial_state(has_initial_state, batch=batch, device=x.device)

    width = weight.shape[1]
    w32 = weight.float()  # [C, W]
    b32 = bias.float() if bias is not None else None
    out = torch.empty_like(x)
    for start, end, slot, has_init in zip(offsets[:-1], offsets[1:], slots, flags, strict=True):
        prev = conv_states[slot].float().T  # [W-1, C], oldest first
        if not has_init:
            prev = torch.zeros_like(prev)
        stream = torch.cat([prev, x[start:end].float()], dim=0)  # [W-1+L, C]
        if end > start:
            # windows[t, c, k] = stream[t + k, c]: the W inputs ending at token t.
            windows = stream.unfold(0, width, 1)  # [L, C, W]
            y = (windows * w32).sum(dim=-1)  # [L, C]
            if b32 is not None:
                y = y + b32
            out[start:end] = _apply_activation(y, activation).to(x.dtype)
        conv_states[slot] = stream[stream.shape[0] - (width - 1) :].T.to(conv_states.dtype)
    return out


def causal_conv1d_update(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    conv_states: Tensor,
    state_indices: Tensor,
    activation: Literal["silu"] | None = "silu",
) -> Tensor:
    """One decode step: one new token per request, states shifted in place.

    Args:
        x: ``[B, C]``, token ``b`` belongs to the request in slot ``state_indices[b]``.
        weight, bias, conv_states, activation: as in :func:`causal_conv1d_varlen`.
        state_indices: int32 ``[B]`` cache slots (distinct, in ``[0, S)``); every request
            continues from its slot's content.

    Returns:
        ``[B, C]`` in the dtype of ``x``.
    """
    x = _check_tensor("x", x, layout="[B, C]", shape=(None, None), device=None)
    weight, bias, conv_states = _check_conv_params(x, weight, bias, conv_states, activation)
    _check_state_indices(
        state_indices, batch=x.shape[0], num_slots=conv_states.shape[0], device=x.device
    )
    idx = state_indices.long()
    window = torch.cat([conv_states[idx].float(), x.float().unsqueeze(-1)], dim=-1)  # [B, C, W]
    y = (window * weight.float()).sum(dim=-1)  # [B, C]
    if bias is not None:
        y = y + bias.float()
    conv_states[idx] = window[..., 1:].to(conv_states.dtype)
    return _apply_activation(y, activation).to(x.dtype)
