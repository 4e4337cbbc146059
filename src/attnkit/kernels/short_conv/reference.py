"""LFM2-style gated short convolution with per-request state in a cache (pure torch).

The short-convolution block of Liquid AI's LFM2 models (see Liquid AI's LFM2 technical
notes) projects its input to three streams ``b``, ``c``, ``x`` and computes::

    Bx = b * x                                   # elementwise input gate
    y  = c * causal_depthwise_conv(Bx)           # elementwise output gate

with a depthwise kernel of width ``W`` (``[C, W]``), an optional bias and no
activation. These functions cover that core (the input and output projections are
ordinary matmuls outside). They are oracles for faster kernels: the convolution is
:func:`attnkit.kernels.conv1d.reference.causal_conv1d_varlen` /
:func:`~attnkit.kernels.conv1d.reference.causal_conv1d_update` with ``activation=None``
applied to ``Bx``, and the output gate is applied afterwards.

Shape letters
-------------
``T`` total tokens, ``B`` requests, ``C`` channels, ``W`` kernel width (``W >= 1``),
``S`` state slots in the cache.

Conventions
-----------
Exactly those of :mod:`attnkit.kernels.conv1d.reference`, with ``Bx`` as the conv input:

* ``conv_states``: ``[S, C, W-1]`` in the dtype of ``x``, any strides. Slot ``s`` holds
  the last ``W-1`` values of ``Bx`` seen by its request, oldest first. ``Bx`` is rounded
  to the dtype of ``x`` before it is convolved or stored, so keeping it in that dtype is
  lossless.
* ``query_start_loc`` int32 ``[B+1]``, ``state_indices`` int32 ``[B]`` (distinct slots),
  ``has_initial_state`` bool ``[B]`` (False: the previous inputs are zeros and the old
  slot content is ignored, then overwritten).
* After a call each request's slot holds the last ``W-1`` entries of
  ``[previous state (or zeros), Bx of its new tokens]``; a request shorter than ``W-1``
  shifts its old state only partly out, and a zero-length request stores its initial
  state (zeros when ``has_initial_state`` is False).

For token ``t`` and channel ``ch``, with ``u`` the request's ``Bx`` stream (previous
values prepended)::

    y[t, ch] = c[t, ch] * (bias[ch] + sum_{k=0}^{W-1} weight[ch, k] * u[t - (W-1) + k, ch])

``b``, ``c`` and ``x`` share one floating dtype, which is the dtype of ``y``.
"""

from __future__ import annotations

from torch import Tensor

from attnkit.kernels.conv1d.contract import check_conv_params
from attnkit.kernels.conv1d.reference import causal_conv1d_update, causal_conv1d_varlen
from attnkit.kernels.short_conv.contract import check_gates, check_out

__all__ = ["short_conv_update", "short_conv_varlen"]


# ----------------------------------------------------------------------------------
# Helpers (the checks are the op's contract: attnkit.kernels.short_conv.contract).
# ----------------------------------------------------------------------------------


def _gate_input(b: Tensor, x: Tensor) -> Tensor:
    """``Bx`` rounded to the dtype of ``x`` (the value convolved and stored)."""
    return (b.float() * x.float()).to(x.dtype)


def _gate_output(c: Tensor, y: Tensor, out: Tensor | None, x: Tensor) -> Tensor:
    gated = (c.float() * y.float()).to(x.dtype)
    if out is None:
        return gated
    out.copy_(gated)
    return out


# ----------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------


def short_conv_varlen(
    b: Tensor,
    c: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    conv_states: Tensor,
    query_start_loc: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    out: Tensor | None = None,
) -> Tensor:
    """Gated short conv over a varlen batch, reading and writing cached states.

    Args:
        b, c, x: ``[T, C]`` input gate, output gate and input, one floating dtype.
        weight: ``[C, W]`` depthwise kernel; ``weight[ch, W-1]`` multiplies the current token.
        bias: ``[C]`` or None.
        conv_states: ``[S, C, W-1]``, dtype of ``x``, any strides; updated in place.
        query_start_loc: int32 ``[B+1]`` cumulative token offsets.
        state_indices: int32 ``[B]`` cache slot of each request (distinct, in ``[0, S)``).
        has_initial_state: bool ``[B]``; False means start from zeros.
        out: optional ``[T, C]`` output (dtype of ``x``, any strides).

    Returns:
        ``y`` ``[T, C]`` in the dtype of ``x`` (``out`` when given).
    """
    b, c, x = check_gates(b, c, x, lead="T")
    check_conv_params(x, weight, bias, conv_states, None)
    if out is not None:
        out = check_out(out, x, lead="T")
    y = causal_conv1d_varlen(
        _gate_input(b, x),
        weight,
        bias,
        conv_states=conv_states,
        query_start_loc=query_start_loc,
        state_indices=state_indices,
        has_initial_state=has_initial_state,
        activation=None,
    )
    return _gate_output(c, y, out, x)


def short_conv_update(
    b: Tensor,
    c: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    conv_states: Tensor,
    state_indices: Tensor,
    out: Tensor | None = None,
) -> Tensor:
    """One decode step: one new token per request, states shifted in place.

    Args:
        b, c, x: ``[B, C]``; row ``r`` belongs to the request in slot ``state_indices[r]``.
        weight, bias, conv_states: as in :func:`short_conv_varlen`.
        state_indices: int32 ``[B]`` cache slots (distinct, in ``[0, S)``); every request
            continues from its slot's content.
        out: optional ``[B, C]`` output (dtype of ``x``, any strides).

    Returns:
        ``y`` ``[B, C]`` in the dtype of ``x`` (``out`` when given).
    """
    b, c, x = check_gates(b, c, x, lead="B")
    check_conv_params(x, weight, bias, conv_states, None)
    if out is not None:
        out = check_out(out, x, lead="B")
    y = causal_conv1d_update(
        _gate_input(b, x),
        weight,
        bias,
        conv_states=conv_states,
        state_indices=state_indices,
        activation=None,
    )
    return _gate_output(c, y, out, x)
