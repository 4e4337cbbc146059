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

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.kernels._checks import (
    check_has_initial_state,
    check_query_start_loc,
    check_state_indices,
    check_tensor,
)
from attnkit.kernels.conv1d.contract import check_conv_params

__all__ = ["causal_conv1d_update", "causal_conv1d_varlen"]

# ----------------------------------------------------------------------------------
# Helpers (the shape/dtype checks are the op's contract, attnkit.kernels.conv1d.contract,
# shared with the Triton launchers).
# ----------------------------------------------------------------------------------


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
    x = check_tensor("x", x, layout="[T, C]", shape=(None, None), device=None)
    weight, bias, conv_states = check_conv_params(x, weight, bias, conv_states, activation)
    offsets = check_query_start_loc(query_start_loc, num_tokens=x.shape[0], device=x.device)
    batch = len(offsets) - 1
    slots = check_state_indices(
        state_indices, batch=batch, num_slots=conv_states.shape[0], device=x.device
    )
    flags = check_has_initial_state(has_initial_state, batch=batch, device=x.device)

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
    x = check_tensor("x", x, layout="[B, C]", shape=(None, None), device=None)
    weight, bias, conv_states = check_conv_params(x, weight, bias, conv_states, activation)
    check_state_indices(
        state_indices, batch=x.shape[0], num_slots=conv_states.shape[0], device=x.device
    )
    idx = state_indices.long()
    window = torch.cat([conv_states[idx].float(), x.float().unsqueeze(-1)], dim=-1)  # [B, C, W]
    y = (window * weight.float()).sum(dim=-1)  # [B, C]
    if bias is not None:
        y = y + bias.float()
    conv_states[idx] = window[..., 1:].to(conv_states.dtype)
    return _apply_activation(y, activation).to(x.dtype)
