"""Mamba (1) selective-scan reference kernels with states in a cache (pure torch).

The math is the selective state-space model (S6) of A. Gu and T. Dao, "Mamba:
Linear-Time Sequence Modeling with Selective State Spaces", arXiv:2312.00752
(Algorithm 2, zero-order-hold discretisation of ``A`` and the simplified Euler step of
``B``). Every channel has its own diagonal ``A`` row and its own state. These
functions are oracles for faster kernels: written for clarity, accumulating in float32,
and casting outputs back to the dtype of ``x``.

Shape letters
-------------
``T`` total tokens in a batch, ``B`` requests (in ``[B, ...]`` shapes), ``D`` channels
(``d_inner``), ``N`` state size, ``R`` dt rank, ``S`` state slots in the cache.

Definition
----------
With ``dt'[t, d] = softplus(dt[t, d] + dt_bias[d])`` if ``dt_softplus`` else
``dt[t, d] + dt_bias[d]`` (``dt_bias`` optional, i.e. 0), for each token ``t``::

    h_t[d, n] = exp(dt'[t, d] * A[d, n]) * h_{t-1}[d, n] + dt'[t, d] * B[t, n] * x[t, d]
    y[t, d]   = sum_n C[t, n] * h_t[d, n] + D[d] * x[t, d]        # D optional, i.e. 0

``h`` is ``[D, N]`` per sequence. ``x`` here is the scan's input, i.e. *after* the
layer's causal conv (the conv is :mod:`attnkit.kernels.conv1d.reference`).

Cache conventions
-----------------
* ``ssm_states``: ``[S, D, N]``, **float32**, updated in place.
* ``query_start_loc`` int32 ``[B+1]``, ``state_indices`` int32 ``[B]`` (distinct slots in
  ``[0, S)``), ``has_initial_state`` bool ``[B]`` (False: start from zeros and ignore the
  slot's old content) -- as in :mod:`attnkit.kernels.conv1d.reference`.
* After a call each request's slot holds its state after its last token; a zero-length
  request stores its initial state (zeros when ``has_initial_state`` is False).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.kernels._checks import (
    check_bool,
    check_has_initial_state,
    check_query_start_loc,
    check_state_indices,
    check_tensor,
)
from attnkit.kernels.mamba1.contract import check_scan_inputs, check_scan_states

__all__ = ["discretize_dt", "mamba1_projections", "selective_scan_update", "selective_scan_varlen"]


def discretize_dt(dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool) -> Tensor:
    """``dt'`` in float32, same shape as ``dt`` (``[..., D]``)."""
    out = dt.float()
    if dt_bias is not None:
        out = out + dt_bias.float()
    return F.softplus(out) if dt_softplus else out


def _rms_norm(t: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    if weight is None:
        return t
    return t * torch.rsqrt(t.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()


def mamba1_projections(
    u: Tensor,
    x_proj_weight: Tensor,
    dt_proj_weight: Tensor,
    *,
    dt_norm_weight: Tensor | None = None,
    B_norm_weight: Tensor | None = None,
    C_norm_weight: Tensor | None = None,
    norm_eps: float = 1e-6,
) -> tuple[Tensor, Tensor, Tensor]:
    """``dt`` (before ``dt_bias``), ``B`` and ``C`` of each token from the convolved ``u``.

    Args:
        u: ``[T, D]``, the conv's output.
        x_proj_weight: ``[R + 2N, D]``; dt_proj_weight: ``[D, R]``.
        dt_norm_weight, B_norm_weight, C_norm_weight: RMSNorm weights (Jamba) or None.

    Returns:
        float32 ``(dt [T, D], B [T, N], C [T, N])``.
    """
    u = check_tensor("u", u, layout="[T, D]", shape=(None, None), device=None)
    channels = u.shape[1]
    dt_proj_weight = check_tensor(
        "dt_proj_weight", dt_proj_weight, layout="[D, R]", shape=(channels, None), device=u.device
    )
    rank = dt_proj_weight.shape[1]
    x_proj_weight = check_tensor(
        "x_proj_weight",
        x_proj_weight,
        layout="[R + 2N, D]",
        shape=(None, channels),
        device=u.device,
    )
    rest = x_proj_weight.shape[0] - rank
    if rest < 2 or rest % 2:
        raise ValueError(
            f"x_proj_weight: expected R + 2N rows with R = {rank} (dt_proj_weight's columns), "
            f"got {x_proj_weight.shape[0]}"
        )
    n = rest // 2
    proj = u.float() @ x_proj_weight.float().T  # [T, R + 2N]
    dt_low, B, C = torch.split(proj, [rank, n, n], dim=-1)
    dt_low = _rms_norm(dt_low, dt_norm_weight, norm_eps)
    B = _rms_norm(B, B_norm_weight, norm_eps)
    C = _rms_norm(C, C_norm_weight, norm_eps)
    return dt_low @ dt_proj_weight.float().T, B, C


def _step(
    state: Tensor, x: Tensor, dtp: Tensor, A: Tensor, B: Tensor, C: Tensor
) -> tuple[Tensor, Tensor]:
    """One token for a batch of states: ``state`` ``[..., D, N]``, ``x``/``dtp`` ``[..., D]``,
    ``A`` ``[D, N]``, ``B``/``C`` ``[..., N]``; all float32. Returns ``(y without D, state)``."""
    decay = torch.exp(dtp.unsqueeze(-1) * A)
    state = decay * state + (dtp * x).unsqueeze(-1) * B.unsqueeze(-2)
    return (state * C.unsqueeze(-2)).sum(dim=-1), state


def selective_scan_varlen(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    query_start_loc: Tensor,
    ssm_states: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
) -> Tensor:
    """The selective scan over a varlen batch, reading/writing per-request states.

    Args:
        x: ``[T, D]`` (after the conv).
        dt: ``[T, D]`` (before ``dt_bias``).
        A: ``[D, N]``.
        B, C: ``[T, N]``.
        D, dt_bias: ``[D]`` or None.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        query_start_loc: int32 ``[B+1]``.
        ssm_states: ``[S, D, N]`` float32, updated in place.
        state_indices: int32 ``[B]``.
        has_initial_state: bool ``[B]``.

    Returns:
        ``y`` ``[T, D]`` in the dtype of ``x``.
    """
    x, dt, A, B, C, D, dt_bias = check_scan_inputs(x, dt, A, B, C, D, dt_bias, lead="T")
    ssm_states = check_scan_states(ssm_states, x, A.shape[1])
    dt_softplus = check_bool("dt_softplus", dt_softplus)
    offsets = check_query_start_loc(query_start_loc, num_tokens=x.shape[0], device=x.device)
    batch = len(offsets) - 1
    slots = check_state_indices(
        state_indices, batch=batch, num_slots=ssm_states.shape[0], device=x.device
    )
    flags = check_has_initial_state(has_initial_state, batch=batch, device=x.device)

    dtp = discretize_dt(dt, dt_bias, dt_softplus)
    A32, B32, C32, x32 = A.float(), B.float(), C.float(), x.float()
    y32 = torch.zeros_like(x32)
    for start, end, slot, has_init in zip(offsets[:-1], offsets[1:], slots, flags, strict=True):
        state = ssm_states[slot].clone() if has_init else torch.zeros_like(ssm_states[slot])
        for t in range(start, end):
            y32[t], state = _step(state, x32[t], dtp[t], A32, B32[t], C32[t])
        ssm_states[slot] = state
    if D is not None:
        y32 = y32 + D.float() * x32
    return y32.to(x.dtype)


def selective_scan_update(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    ssm_states: Tensor,
    state_indices: Tensor,
) -> Tensor:
    """One decode step for ``B`` requests, each continuing from its cache slot.

    Args:
        x, dt: ``[B, D]``. A: ``[D, N]``. B, C: ``[B, N]``. D, dt_bias: ``[D]`` or None.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        ssm_states: ``[S, D, N]`` float32, updated in place.
        state_indices: int32 ``[B]`` (distinct, in ``[0, S)``).

    Returns:
        ``y`` ``[B, D]`` in the dtype of ``x``.
    """
    x, dt, A, B, C, D, dt_bias = check_scan_inputs(x, dt, A, B, C, D, dt_bias, lead="B")
    ssm_states = check_scan_states(ssm_states, x, A.shape[1])
    dt_softplus = check_bool("dt_softplus", dt_softplus)
    check_state_indices(
        state_indices, batch=x.shape[0], num_slots=ssm_states.shape[0], device=x.device
    )
    idx = state_indices.long()
    x32 = x.float()
    dtp = discretize_dt(dt, dt_bias, dt_softplus)
    y32, state = _step(ssm_states[idx], x32, dtp, A.float(), B.float(), C.float())
    ssm_states[idx] = state
    if D is not None:
        y32 = y32 + D.float() * x32
    return y32.to(x.dtype)
