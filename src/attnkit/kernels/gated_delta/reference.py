"""Gated DeltaNet (gated delta rule) reference kernels with states in a cache (pure torch).

The recurrence is that of S. Yang, J. Kautz and A. Hatamizadeh, "Gated Delta Networks:
Improving Mamba2 with Delta Rule", ICLR 2025 (arXiv:2412.06464). The chunked form uses
the WY / UT-transform representation of products of Householder-like matrices from
S. Yang et al., "Parallelizing Linear Transformers with the Delta Rule over Sequence
Length", NeurIPS 2024 (arXiv:2406.06484), extended with the per-token decay. These
functions are oracles for faster kernels: written for clarity, accumulating in float32,
and casting outputs back to the dtype of ``v``.

Shape letters
-------------
``T`` total tokens in a batch, ``B`` requests, ``H`` (value) heads, ``Hk`` query/key
heads (``H`` a multiple of ``Hk``), ``K`` key (and query) head dim, ``V`` value head dim,
``S`` state slots in the cache, ``L`` the length of one sequence.

Definition
----------
Each head ``h`` carries a state ``S_h`` of shape ``[K, V]`` (float32). For each token
``t``, with ``alpha_t = exp(g[t, h])`` (``g <= 0`` is the log decay) and
``beta_t = beta[t, h]`` in ``(0, 1)`` (the write strength)::

    S'  = alpha_t * S_{t-1}
    u_t = v_t - S'^T k_t                     # [V]: what the decayed state mispredicts
    S_t = S' + beta_t * outer(k_t, u_t)      # [K, V]
    o_t = scale * S_t^T q_t                  # [V]

i.e. ``S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``. ``q`` and ``k``
are used exactly as given: the model L2-normalises them (per head, over ``K``) before
calling these kernels, and nothing here normalises again. Inputs ``q``/``k``
``[*, Hk, K]``, ``v`` ``[*, H, V]``, ``g``/``beta`` ``[*, H]`` may have any floating dtype
and are read as float32; the output has the dtype of ``v``.
:func:`gated_delta_rule_recurrent_reference` evaluates this token by token and *is* the
definition.

Shared key heads (Qwen3-Next: ``Hk = 16``, ``H = 32``): value head ``h`` uses query/key
head ``h // (H // Hk)``, i.e. each key head serves ``H // Hk`` consecutive value heads,
and the state, ``g``, ``beta`` and the output are per value head. The functions here
expand ``q`` and ``k`` to ``H`` heads (``repeat_interleave`` over the head dim) and then
run the per-head definition; ``Hk = H`` is the plain case.

Chunked form
------------
Cut a sequence into chunks of ``C`` tokens. Within one chunk (positions ``i, j`` in
``[0, C)``), let ``G_i = g_0 + ... + g_i`` (cumulative log decay inside the chunk),
``S_0`` the state entering the chunk and ``d_i = beta_i u_i`` the column actually
written at token ``i``. Unrolling the recurrence gives
``S_i = exp(G_i) S_0 + sum_{j<=i} exp(G_i - G_j) k_j d_j^T``, and substituting it into
``u_i`` gives the unit lower-triangular system::

    d_i + sum_{j<i} beta_i exp(G_i - G_j) (k_i . k_j) d_j
        = beta_i v_i - beta_i exp(G_i) S_0^T k_i

i.e. ``(I + A) D = diag(beta) V - diag(beta exp(G)) K S_0`` with ``A`` strictly lower
triangular. With ``Tm = (I + A)^-1`` (the UT transform), the pseudo-values
``U = Tm diag(beta) V`` and ``W = Tm diag(beta exp(G)) K`` depend on the chunk alone, and
``D = U - W S_0``. Then::

    O     = scale * (diag(exp(G)) Q S_0 + (Q K^T * M) D),  M_ij = exp(G_i - G_j) [j <= i]
    S_out = exp(G_{C-1}) S_0 + (diag(exp(G_{C-1} - G)) K)^T D

The intra-chunk work is matrix products; only ``S`` passes sequentially from chunk to
chunk. A chunk of ``C = 1`` is the recurrence itself.

Cache conventions
-----------------
* ``states``: ``[S, H, K, V]``, **float32**, updated in place. It may be a
  non-contiguous strided view (e.g. into a larger page of a hybrid cache); only the
  slots named in ``state_indices`` are read or written.
* ``query_start_loc`` int32 ``[B+1]``, ``state_indices`` int32 ``[B]`` (distinct, in
  ``[0, S)``), ``has_initial_state`` bool ``[B]`` (False: start from zeros and ignore
  the slot's old content) -- as in :mod:`attnkit.kernels.conv1d.reference` and
  :mod:`attnkit.kernels.mamba2.reference`.
* After a call each request's slot holds its state after its last token; a zero-length
  request stores its initial state (zeros when ``has_initial_state`` is False).
* Chunks are aligned to the first token of each request in the call (not to absolute
  positions in the sequence); the result does not depend on ``chunk_size`` up to
  rounding.
"""

from __future__ import annotations

import math
from typing import cast

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
from attnkit.kernels.gated_delta.contract import (
    alloc_out,
    check_gdn_inputs,
    head_group,
)

__all__ = [
    "chunk_gated_delta_rule_varlen",
    "fused_recurrent_gated_delta_rule_update",
    "gated_delta_rule_recurrent_reference",
    "l2_normalize",
]


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """Normalise the last dimension to unit L2 norm, in float32: how Gated DeltaNet
    layers prepare q and k before the delta rule (the kernels take them as given)."""
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)


def _share_key_heads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``q``/``k`` ``[*, Hk, K]`` expanded to the ``H`` heads of ``v``: value head ``h``
    gets key head ``h // (H // Hk)`` (unchanged when ``Hk = H``)."""
    group = head_group(k, v)
    if group == 1:
        return q, k
    return q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)


# ----------------------------------------------------------------------------------
# Chunked form for one sequence
# ----------------------------------------------------------------------------------


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    """Append ``rows`` zero rows along dim 0."""
    if rows == 0:
        return t
    return torch.cat([t, t.new_zeros(rows, *t.shape[1:])], dim=0)


def _chunked_one(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state0: Tensor,
    scale: float,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """Chunked gated delta rule for one sequence, all float32 (see the module doc).

    ``q``/``k`` ``[L, H, K]``, ``v`` ``[L, H, V]``, ``g``/``beta`` ``[L, H]``, ``state0``
    ``[H, K, V]``. Returns ``o`` ``[L, H, V]`` and the final state ``[H, K, V]``.

    The tail is padded with ``g = beta = 0`` tokens (and zero ``q``/``k``/``v``): they
    neither decay nor write the state, so they change nothing. Every chunk's ``U``,
    ``W`` and masked ``Q K^T`` are computed at once; the loop over chunks only carries
    the state.
    """
    length = q.shape[0]
    if length == 0:
        return v.new_zeros(v.shape), state0
    c = min(chunk_size, length)
    n_chunks = -(-length // c)
    pad = n_chunks * c - length

    def chunks(t: Tensor) -> Tensor:
        """``[L, H, ...]`` -> ``[nc, H, c, ...]``."""
        t = _pad_rows(t, pad)
        return t.view(n_chunks, c, *t.shape[1:]).transpose(1, 2)

    qc, kc, vc, gc, bc = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    cum = gc.cumsum(dim=-1)  # [nc, H, c]: G_i
    ones = torch.ones(c, c, dtype=torch.bool, device=q.device)
    causal, strict = ones.tril(), ones.tril(-1)
    # exp(G_i - G_j) for j <= i, exactly 0 above the diagonal (masked before exp, where
    # the difference is positive and could overflow).
    decay = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, -math.inf))

    kk = kc @ kc.transpose(-1, -2)  # [nc, H, c, c]
    a = (bc[..., :, None] * kk * decay).masked_fill(~strict, 0.0)
    system = a + torch.eye(c, dtype=a.dtype, device=a.device)
    rhs = torch.cat([bc[..., None] * vc, (bc * torch.exp(cum))[..., None] * kc], dim=-1)
    # torch.linalg declares solve_triangular without a signature (pyright: Unknown).
    solved = cast(
        torch.Tensor,
        torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True),  # pyright: ignore[reportUnknownMemberType]
    )
    u, w = torch.split(solved, [vc.shape[-1], kc.shape[-1]], dim=-1)  # [nc, H, c, V], [nc, H, c, K]

    scores = (qc @ kc.transpose(-1, -2)) * decay  # [nc, H, c, c], causal
    from_start = torch.exp(cum)[..., None]  # [nc, H, c, 1]: exp(G_i)
    to_end = torch.exp(cum[..., -1:] - cum)[..., None] * kc  # [nc, H, c, K]
    total = torch.exp(cum[..., -1])[..., None, None]  # [nc, H, 1, 1]

    state = state0
    outs: list[torch.Tensor] = []
    for i in range(n_chunks):
        delta = u[i] - w[i] @ state  # [H, c, V]
        outs.append(scale * (from_start[i] * (qc[i] @ state) + scores[i] @ delta))
        state = total[i] * state + to_end[i].transpose(-1, -2) @ delta
    o = torch.stack(outs).transpose(1, 2).reshape(n_chunks * c, *v.shape[1:])[:length]
    return o, state


# ----------------------------------------------------------------------------------
# Public kernels
# ----------------------------------------------------------------------------------


def gated_delta_rule_recurrent_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The definition: the token-by-token recurrence for one sequence (see module doc).

    Args:
        q, k: ``[L, Hk, K]`` (already L2-normalised by the caller).
        v: ``[L, H, V]``, ``H`` a multiple of ``Hk``.
        g: ``[L, H]`` log decay (``<= 0``).
        beta: ``[L, H]`` write strength in ``(0, 1)``.
        scale: output scale (typically ``K ** -0.5``).
        initial_state: ``[H, K, V]`` (any floating dtype) or None for zeros.

    Returns:
        ``(o, final_state)``: ``o`` ``[L, H, V]`` in the dtype of ``v`` and the state
        after the last token, ``[H, K, V]`` float32.
    """
    q, k, v, g, beta = check_gdn_inputs(q, k, v, g, beta, lead="L")
    scale = check_finite_float("scale", scale)
    q, k = _share_key_heads(q, k, v)
    length, heads, key_dim = k.shape
    value_dim = v.shape[2]
    if initial_state is None:
        state = torch.zeros(heads, key_dim, value_dim, dtype=torch.float32, device=k.device)
    else:
        init = check_tensor(
            "initial_state",
            initial_state,
            layout="[H, K, V]",
            shape=(heads, key_dim, value_dim),
            device=k.device,
        )
        check_float("initial_state", init)
        state = init.float()
    q32, k32, v32 = q.float(), k.float(), v.float()
    alpha, b32 = torch.exp(g.float()), beta.float()
    outs: list[torch.Tensor] = []
    for t in range(length):
        state = alpha[t, :, None, None] * state
        u = v32[t] - torch.einsum("hkv,hk->hv", state, k32[t])
        state = state + b32[t, :, None, None] * k32[t, :, :, None] * u[:, None, :]
        outs.append(scale * torch.einsum("hkv,hk->hv", state, q32[t]))
    o = torch.stack(outs) if outs else v32.new_zeros(0, heads, value_dim)
    return o.to(v.dtype), state


def chunk_gated_delta_rule_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float,
    query_start_loc: Tensor,
    states: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    chunk_size: int = 64,
    out: Tensor | None = None,
) -> Tensor:
    """Chunked gated delta rule over a varlen batch, reading/writing cached states.

    Args:
        q, k: ``[T, Hk, K]``.
        v: ``[T, H, V]``, ``H`` a multiple of ``Hk``.
        g, beta: ``[T, H]``.
        scale: output scale.
        query_start_loc: int32 ``[B+1]``.
        states: ``[S, H, K, V]`` float32 (any strides), updated in place.
        state_indices: int32 ``[B]``.
        has_initial_state: bool ``[B]``.
        chunk_size: tokens per chunk, ``>= 1``.
        out: ``[T, H, V]`` in the dtype of ``v`` to write into, or None to allocate.

    Returns:
        ``o`` ``[T, H, V]`` in the dtype of ``v`` (``out`` when given).
    """
    q, k, v, g, beta = check_gdn_inputs(q, k, v, g, beta, lead="T")
    scale = check_finite_float("scale", scale)
    states = check_states(states, k, v)
    chunk_size = check_chunk_size(chunk_size)
    offsets, slots, flags = check_state_lists(
        query_start_loc,
        state_indices,
        has_initial_state,
        num_tokens=q.shape[0],
        num_slots=states.shape[0],
        device=q.device,
    )
    o = alloc_out(out, v, "T")

    q, k = _share_key_heads(q, k, v)
    q32, k32, v32, g32, b32 = q.float(), k.float(), v.float(), g.float(), beta.float()
    for start, end, slot, has_init in zip(offsets[:-1], offsets[1:], slots, flags, strict=True):
        state0 = states[slot].clone() if has_init else torch.zeros_like(states[slot])
        o_req, final = _chunked_one(
            q32[start:end],
            k32[start:end],
            v32[start:end],
            g32[start:end],
            b32[start:end],
            state0,
            scale,
            chunk_size,
        )
        o[start:end] = o_req.to(o.dtype)
        states[slot] = final
    return o


def fused_recurrent_gated_delta_rule_update(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float,
    states: Tensor,
    state_indices: Tensor,
    out: Tensor | None = None,
) -> Tensor:
    """One decode step for ``B`` requests, each continuing from its cache slot.

    Args:
        q, k: ``[B, Hk, K]``.
        v: ``[B, H, V]``, ``H`` a multiple of ``Hk``.
        g, beta: ``[B, H]``.
        scale: output scale.
        states: ``[S, H, K, V]`` float32 (any strides), updated in place.
        state_indices: int32 ``[B]`` (distinct, in ``[0, S)``).
        out: ``[B, H, V]`` in the dtype of ``v``, or None to allocate.

    Returns:
        ``o`` ``[B, H, V]`` in the dtype of ``v`` (``out`` when given).
    """
    q, k, v, g, beta = check_gdn_inputs(q, k, v, g, beta, lead="B")
    scale = check_finite_float("scale", scale)
    states = check_states(states, k, v)
    check_state_indices(state_indices, batch=q.shape[0], num_slots=states.shape[0], device=q.device)
    o = alloc_out(out, v, "B")
    idx = state_indices.long()
    q, k = _share_key_heads(q, k, v)
    q32, k32 = q.float(), k.float()
    state = torch.exp(g.float())[..., None, None] * states[idx]  # [B, H, K, V]
    u = v.float() - torch.einsum("bhkv,bhk->bhv", state, k32)
    state = state + beta.float()[..., None, None] * k32[..., :, None] * u[..., None, :]
    states[idx] = state
    o.copy_(scale * torch.einsum("bhkv,bhk->bhv", state, q32))
    return o
