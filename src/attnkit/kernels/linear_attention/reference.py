"""Linear attention with a constant per-head decay, states in a cache (pure torch).

This is the recurrence behind lightning attention (Z. Qin et al., "Lightning
Attention-2: A Free Lunch for Handling Unlimited Sequence Lengths in Large Language
Models", 2024, arXiv:2401.04658) as used by MiniMax-01 (arXiv:2501.08313): causal linear
attention whose state decays by a fixed factor per head (the ALiBi-like slopes of those
papers). These functions are oracles for faster kernels: written for clarity,
accumulating in float32, and casting outputs back to the dtype of ``q``.

Shape letters
-------------
``T`` total tokens in a batch, ``B`` requests (in ``[B, ...]`` shapes), ``H`` heads,
``K`` key/query head dim, ``V`` value head dim, ``S`` state slots in the cache. ``L`` is
the length of one sequence.

Definition
----------
Each head ``h`` keeps a state ``S_h`` in ``R^{K x V}`` (float32). With
``lam_h = exp(-decay[h])`` (``decay >= 0``, so ``0 < lam_h <= 1``), for each token ``t``::

    S_t = lam_h * S_{t-1} + outer(k_t, v_t)          # [K, V]
    o_t = scale * S_t^T q_t                          # [V]

:func:`linear_attention_recurrent_reference` evaluates this token by token and *is* the
definition. :func:`chunk_linear_attention_varlen` computes the same thing chunk by chunk
(the intra/inter-block split of Lightning Attention-2): for a chunk of ``n`` tokens
entering with state ``S`` and 0-based positions ``i, j`` within the chunk::

    o_i   = scale * (lam^(i+1) S^T q_i + sum_{j<=i} lam^(i-j) (q_i . k_j) v_j)
    S_out = lam^n S + sum_j lam^(n-1-j) outer(k_j, v_j)

and :func:`linear_attention_decode` does one step.

Cache conventions
-----------------
* ``states``: ``[S, H, K, V]``, **float32**, any strides (the runtime hands out strided
  views into larger pages). Updated in place.
* ``query_start_loc`` int32 ``[B+1]`` (cumulative offsets, starting at 0, ending at
  ``T``, non-decreasing), ``state_indices`` int32 ``[B]`` (distinct slots in ``[0, S)``),
  ``has_initial_state`` bool ``[B]`` (False: start from zeros and ignore the slot's old
  content) -- as in :mod:`attnkit.kernels.conv1d.reference`.
* After a call each request's slot holds its state after its last token; a zero-length
  request stores its initial state (zeros when ``has_initial_state`` is False). Slots
  not named in ``state_indices`` are never touched.
* Chunks are aligned to the first token of each request in the call (not to absolute
  positions in the sequence); the result does not depend on ``chunk_size`` up to
  rounding.

``q``, ``k`` and ``v`` share one floating dtype; ``decay`` may have any floating dtype
and is read as float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.kernels._checks import (
    check_chunk_size,
    check_finite_float,
    check_float,
    check_state_indices,
    check_state_lists,
    check_states,
    check_tensor,
)
from attnkit.kernels.linear_attention.contract import (
    alloc_out,
    check_decay_shape,
    check_qkv,
)

__all__ = [
    "chunk_linear_attention_varlen",
    "linear_attention_decode",
    "linear_attention_recurrent_reference",
]


# ----------------------------------------------------------------------------------
# Validation (the shape/dtype checks are the op's contract,
# attnkit.kernels.linear_attention.contract, shared with the Triton launchers; the
# value checks below read tensors back and are the oracle's alone).
# ----------------------------------------------------------------------------------


def _check_decay_values(decay: Tensor) -> None:
    """Reads ``decay`` back to the host: for the torch oracles only."""
    if not bool(torch.isfinite(decay).all()) or bool((decay < 0).any()):
        raise ValueError(f"decay: expected finite values >= 0, got {decay.tolist()}")  # pyright: ignore[reportUnknownMemberType]  # torch types tolist() as a bare List


# ----------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------


def _chunk_step(
    q: Tensor, k: Tensor, v: Tensor, log_lam: Tensor, state: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """One chunk of ``n`` tokens, all float32 (see the module doc for the formulas).

    ``q``/``k`` ``[n, H, K]``, ``v`` ``[n, H, V]``, ``log_lam`` ``[H]`` (``-decay``),
    ``state`` ``[H, K, V]``. Returns ``o`` ``[n, H, V]`` and the state after the chunk.
    """
    n = q.shape[0]
    pos = torch.arange(n, device=q.device, dtype=torch.float32)
    diff = pos[:, None] - pos[None, :]  # [n(i), n(j)] = i - j
    causal = diff >= 0
    # lam^(i-j) on and below the diagonal, 0 above; each power is one exp (no products
    # of rounded powers), and the clamp keeps the masked entries from overflowing.
    mask = torch.exp(log_lam[:, None, None] * diff.clamp(min=0)) * causal  # [H, n, n]
    scores = torch.einsum("ihk,jhk->hij", q, k) * mask
    o_intra = torch.einsum("hij,jhv->ihv", scores, v)
    decay_in = torch.exp(log_lam[None, :] * (pos[:, None] + 1))  # [n, H] = lam^(i+1)
    o_inter = torch.einsum("ihk,hkv->ihv", q, state) * decay_in[..., None]
    decay_out = torch.exp(log_lam[None, :] * (n - 1 - pos[:, None]))  # [n, H] = lam^(n-1-j)
    new_state = torch.exp(log_lam * n)[:, None, None] * state + torch.einsum(
        "jhk,jhv->hkv", k * decay_out[..., None], v
    )
    return scale * (o_intra + o_inter), new_state


def linear_attention_recurrent_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    decay: Tensor,
    *,
    scale: float,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The definition: the token-by-token recurrence for one sequence (see module doc).

    Args:
        q, k: ``[L, H, K]``.
        v: ``[L, H, V]``.
        decay: ``[H]``, finite and ``>= 0``; ``lam = exp(-decay)``.
        scale: output scale (typically ``K ** -0.5`` or 1).
        initial_state: ``[H, K, V]`` (any floating dtype) or None for zeros.

    Returns:
        ``(o, final_state)``: ``o`` ``[L, H, V]`` in the dtype of ``q`` and the state after
        the last token, ``[H, K, V]`` float32.
    """
    q, k, v = check_qkv(q, k, v, lead="L")
    decay = check_decay_shape(decay, q)
    _check_decay_values(decay)
    scale = check_finite_float("scale", scale)
    length, heads, key_dim = q.shape
    value_dim = v.shape[2]
    if initial_state is None:
        state = q.new_zeros(heads, key_dim, value_dim, dtype=torch.float32)
    else:
        init = check_tensor(
            "initial_state",
            initial_state,
            layout="[H, K, V]",
            shape=(heads, key_dim, value_dim),
            device=q.device,
        )
        check_float("initial_state", init)
        state = init.float()
    lam = torch.exp(-decay.float())[:, None, None]  # [H, 1, 1]
    q32, k32, v32 = q.float(), k.float(), v.float()
    outs: list[torch.Tensor] = []
    for t in range(length):
        state = lam * state + k32[t, :, :, None] * v32[t, :, None, :]
        outs.append(scale * torch.einsum("hkv,hk->hv", state, q32[t]))
    o = torch.stack(outs) if outs else q32.new_zeros(0, heads, value_dim)
    return o.to(q.dtype), state


def chunk_linear_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    decay: Tensor,
    *,
    scale: float,
    query_start_loc: Tensor,
    states: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    chunk_size: int = 64,
    out: Tensor | None = None,
) -> Tensor:
    """Chunked linear attention over a varlen batch, reading/writing cached states.

    Args:
        q, k: ``[T, H, K]``.
        v: ``[T, H, V]``.
        decay: ``[H]``, finite and ``>= 0``.
        scale: output scale.
        query_start_loc: int32 ``[B+1]``.
        states: ``[S, H, K, V]`` float32, any strides; updated in place.
        state_indices: int32 ``[B]``.
        has_initial_state: bool ``[B]``.
        chunk_size: tokens per chunk, ``>= 1``.
        out: optional ``[T, H, V]`` output (dtype of ``q``, any strides).

    Returns:
        ``o`` ``[T, H, V]`` in the dtype of ``q`` (``out`` when given).
    """
    q, k, v = check_qkv(q, k, v, lead="T")
    decay = check_decay_shape(decay, q)
    _check_decay_values(decay)
    scale = check_finite_float("scale", scale)
    states = check_states(states, q, v)
    chunk_size = check_chunk_size(chunk_size)
    offsets, slots, flags = check_state_lists(
        query_start_loc,
        state_indices,
        has_initial_state,
        num_tokens=q.shape[0],
        num_slots=states.shape[0],
        device=q.device,
    )
    o = alloc_out(out, q, v, lead="T")

    log_lam = -decay.float()
    q32, k32, v32 = q.float(), k.float(), v.float()
    for start, end, slot, has_init in zip(offsets[:-1], offsets[1:], slots, flags, strict=True):
        state = states[slot].clone() if has_init else torch.zeros_like(states[slot])
        for c0 in range(start, end, chunk_size):
            c1 = min(c0 + chunk_size, end)
            o_chunk, state = _chunk_step(q32[c0:c1], k32[c0:c1], v32[c0:c1], log_lam, state, scale)
            o[c0:c1] = o_chunk.to(o.dtype)
        states[slot] = state
    return o


def linear_attention_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    decay: Tensor,
    *,
    scale: float,
    states: Tensor,
    state_indices: Tensor,
    out: Tensor | None = None,
) -> Tensor:
    """One decode step for ``B`` requests, each continuing from its cache slot.

    Args:
        q, k: ``[B, H, K]``.
        v: ``[B, H, V]``.
        decay: ``[H]``, finite and ``>= 0``.
        scale: output scale.
        states: ``[S, H, K, V]`` float32, any strides; updated in place.
        state_indices: int32 ``[B]`` (distinct, in ``[0, S)``).
        out: optional ``[B, H, V]`` output (dtype of ``q``, any strides).

    Returns:
        ``o`` ``[B, H, V]`` in the dtype of ``q`` (``out`` when given).
    """
    q, k, v = check_qkv(q, k, v, lead="B")
    decay = check_decay_shape(decay, q)
    _check_decay_values(decay)
    scale = check_finite_float("scale", scale)
    states = check_states(states, q, v)
    check_state_indices(state_indices, batch=q.shape[0], num_slots=states.shape[0], device=q.device)
    o = alloc_out(out, q, v, lead="B")
    idx = state_indices.long()
    lam = torch.exp(-decay.float())[None, :, None, None]  # [1, H, 1, 1]
    state = lam * states[idx] + k.float()[..., :, None] * v.float()[..., None, :]
    states[idx] = state
    o.copy_(scale * torch.einsum("bhkv,bhk->bhv", state, q.float()))
    return o
