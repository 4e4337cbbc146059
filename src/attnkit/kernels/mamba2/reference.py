"""Mamba2 selective state-space (SSD) reference kernels with states in a cache (pure torch).

The math is that of Mamba2's state-space duality (SSD), T. Dao and A. Gu, "Transformers
are SSMs: Generalized Models and Efficient Algorithms Through Structured State Space
Duality", ICML 2024 (arXiv:2405.21060), with a scalar decay ``A`` per head. These
functions are oracles for faster kernels: written for clarity, accumulating in float32,
and casting outputs back to the dtype of ``x``.

Shape letters
-------------
``T`` total tokens in a batch, ``B`` requests (in ``[B, ...]`` shapes), ``H`` heads,
``P`` head dim, ``G`` groups of the ``B``/``C`` projections (``H % G == 0``; head ``h``
uses group ``h // (H // G)``), ``N`` state size, ``S`` state slots in the cache. ``L`` is
the length of one sequence.

Definition
----------
With ``dt'[t, h] = softplus(dt[t, h] + dt_bias[h])`` if ``dt_softplus`` else
``dt[t, h] + dt_bias[h]`` (``dt_bias`` optional, i.e. 0), for each token ``t`` and head
``h`` (``g`` its group)::

    state_t = exp(dt'[t, h] * A[h]) * state_{t-1} + dt'[t, h] * outer(x[t, h], B[t, g])
    y[t, h] = state_t @ C[t, g] + D[h] * x[t, h]           # D optional, i.e. 0

``state`` is ``[H, P, N]`` per sequence. :func:`ssd_recurrent_reference` evaluates this
token by token and *is* the definition; :func:`ssd_chunked_varlen` computes the same
thing with the chunked SSD algorithm and :func:`selective_state_update` does one step.

Cache conventions
-----------------
* ``ssm_states``: ``[S, H, P, N]``, **float32** (required: the state accumulates over the
  whole sequence, so it is kept at full precision whatever the dtype of ``x``).
  Updated in place.
* ``query_start_loc`` int32 ``[B+1]`` (cumulative offsets, starting at 0, ending at
  ``T``, non-decreasing), ``state_indices`` int32 ``[B]`` (distinct slots in
  ``[0, S)``), ``has_initial_state`` bool ``[B]`` (False: start from zeros and ignore the
  slot's old content) -- same as in :mod:`attnkit.kernels.conv1d.reference`.
* After a call each request's slot holds its state after its last token; a zero-length
  request stores its initial state (zeros when ``has_initial_state`` is False).
* Chunks are aligned to the first token of each request in the call (not to absolute
  positions in the sequence); the result does not depend on ``chunk_size`` up to
  rounding.

Every ``dt``, ``A``, ``B``, ``C``, ``D`` and ``dt_bias`` may have any floating dtype;
all are read as float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.kernels._checks import (
    check_bool,
    check_chunk_size,
    check_float,
    check_has_initial_state,
    check_query_start_loc,
    check_state_indices,
    check_tensor,
)
from attnkit.kernels.mamba2.contract import check_ssm_inputs, check_ssm_states

__all__ = ["selective_state_update", "ssd_chunked_varlen", "ssd_recurrent_reference"]


# ----------------------------------------------------------------------------------
# Validation and shared pieces
# ----------------------------------------------------------------------------------


def _discretize_dt(dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool) -> Tensor:
    """``dt'`` in float32, same shape as ``dt`` (``[..., H]``)."""
    out = dt.float()
    if dt_bias is not None:
        out = out + dt_bias.float()
    return F.softplus(out) if dt_softplus else out


def _expand_groups(t: Tensor, heads: int) -> Tensor:
    """``[..., G, N]`` -> float32 ``[..., H, N]``: head ``h`` gets group ``h // (H // G)``."""
    return t.float().repeat_interleave(heads // t.shape[-2], dim=-2)


def _skip(y: Tensor, x: Tensor, D: Tensor | None) -> Tensor:
    """Add the ``D`` skip connection (float32)."""
    return y if D is None else y + D.float()[:, None] * x.float()


def _segsum(a: Tensor) -> Tensor:
    """Segment sums of log-decays: ``[..., Q]`` -> ``[..., Q, Q]``.

    ``out[..., i, j] = a[..., j+1] + ... + a[..., i]`` for ``i >= j`` (0 on the diagonal)
    and ``-inf`` for ``i < j``, so ``exp(out)`` is the causal decay mask from position
    ``j`` to position ``i``. Each entry is summed directly rather than as a difference of
    cumulative sums, which would lose precision when the sums grow large.
    """
    q = a.shape[-1]
    ones = torch.ones(q, q, dtype=torch.bool, device=a.device)
    strictly_below = ones.tril(-1)
    # terms[..., i, j] = a[..., i] where i > j: column j collects a[j+1:], row by row.
    terms = a.unsqueeze(-1).expand(*a.shape, q).masked_fill(~strictly_below, 0.0)
    return terms.cumsum(dim=-2).masked_fill(~ones.tril(), float("-inf"))


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    """Append ``rows`` zero rows along dim 0."""
    if rows == 0:
        return t
    return torch.cat([t, t.new_zeros(rows, *t.shape[1:])], dim=0)


def _ssd_chunked_one(
    x: Tensor, dtp: Tensor, A: Tensor, Bh: Tensor, Ch: Tensor, state0: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Chunked SSD for one sequence, all float32, without the ``D`` term.

    ``x`` ``[L, H, P]``, ``dtp`` ``[L, H]`` (discretised), ``A`` ``[H]``, ``Bh``/``Ch``
    ``[L, H, N]`` (expanded to heads), ``state0`` ``[H, P, N]``. Returns ``y`` ``[L, H, P]``
    and the final state ``[H, P, N]``.

    The sequence is cut into ``nc`` chunks of ``q`` tokens (the tail is padded with
    ``dt' = 0`` tokens, which leave the state unchanged and add nothing). Then:

    1. within each chunk, the quadratic ("attention-like") form
       ``y_i = sum_{j<=i} (C_i . B_j) exp(a_{j+1} + ... + a_i) dt'_j x_j``;
    2. the state each chunk would produce from zero, at its end;
    3. the inter-chunk recurrence ``s_c = exp(sum_c a) s_{c-1} + chunk_state_c``, done as
       one matrix product with the segment-sum mask over chunk totals;
    4. the contribution of each chunk's incoming state, ``exp(a_0 + ... + a_i) C_i . s``.
    """
    length, heads, head_dim = x.shape
    q = min(chunk_size, max(length, 1))
    n_chunks = -(-length // q)
    pad = n_chunks * q - length
    n = Bh.shape[-1]
    xc = _pad_rows(x, pad).view(n_chunks, q, heads, head_dim)
    dtc = _pad_rows(dtp, pad).view(n_chunks, q, heads)
    Bc = _pad_rows(Bh, pad).view(n_chunks, q, heads, n)
    Cc = _pad_rows(Ch, pad).view(n_chunks, q, heads, n)

    log_decay = (dtc * A).permute(0, 2, 1)  # [nc, H, q]
    decay = torch.exp(_segsum(log_decay))  # [nc, H, q(i), q(j)]
    x_dt = xc * dtc.unsqueeze(-1)  # [nc, q, H, P]

    # 1. Intra-chunk output (diagonal blocks of the SSD matrix).
    scores = torch.einsum("cihn,cjhn->chij", Cc, Bc) * decay
    y_intra = torch.einsum("chij,cjhp->cihp", scores, x_dt)

    # 2. State at the end of each chunk from that chunk's tokens alone.
    decay_to_end = decay[..., -1, :]  # [nc, H, q(j)] = exp(a_{j+1} + ... + a_{q-1})
    chunk_states = torch.einsum("chj,cjhp,cjhn->chpn", decay_to_end, x_dt, Bc)

    # 3. Pass states across chunks: entry 0 is the initial state, entry c+1 the state
    #    after chunk c; a chunk's total log-decay moves a state over the whole chunk.
    totals = torch.cat([log_decay.new_zeros(1, heads), log_decay.sum(dim=-1)])  # [nc+1, H]
    chunk_decay = torch.exp(_segsum(totals.T))  # [H, nc+1, nc+1]
    states = torch.cat([state0.unsqueeze(0), chunk_states])  # [nc+1, H, P, N]
    states = torch.einsum("hij,jhpn->ihpn", chunk_decay, states)

    # 4. Output from the state entering each chunk, decayed to each position.
    decay_from_start = torch.exp(log_decay.cumsum(dim=-1)).permute(0, 2, 1)  # [nc, q, H]
    y_inter = torch.einsum("cihn,chpn->cihp", Cc, states[:-1]) * decay_from_start.unsqueeze(-1)

    y = (y_intra + y_inter).reshape(n_chunks * q, heads, head_dim)[:length]
    return y, states[-1]


# ----------------------------------------------------------------------------------
# Public kernels
# ----------------------------------------------------------------------------------


def ssd_recurrent_reference(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The definition: the token-by-token recurrence for one sequence (see module doc).

    Args:
        x: ``[L, H, P]``.
        dt: ``[L, H]``.
        A: ``[H]`` (typically negative).
        B, C: ``[L, G, N]``.
        D, dt_bias: ``[H]`` or None.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        initial_state: ``[H, P, N]`` (any floating dtype) or None for zeros.

    Returns:
        ``(y, final_state)``: ``y`` ``[L, H, P]`` in the dtype of ``x`` and the state after
        the last token, ``[H, P, N]`` float32.
    """
    dt, A, B, C, D, dt_bias = check_ssm_inputs(x, dt, A, B, C, D, dt_bias, lead="L")
    dt_softplus = check_bool("dt_softplus", dt_softplus)
    length, heads, head_dim = x.shape
    n = B.shape[-1]
    if initial_state is None:
        state = torch.zeros(heads, head_dim, n, dtype=torch.float32, device=x.device)
    else:
        init = check_tensor(
            "initial_state",
            initial_state,
            layout="[H, P, N]",
            shape=(heads, head_dim, n),
            device=x.device,
        )
        check_float("initial_state", init)
        state = init.float()
    dtp = _discretize_dt(dt, dt_bias, dt_softplus)  # [L, H]
    decay = torch.exp(dtp * A.float())  # [L, H]
    Bh, Ch, x32 = _expand_groups(B, heads), _expand_groups(C, heads), x.float()
    ys: list[torch.Tensor] = []
    for t in range(length):
        update = (dtp[t, :, None] * x32[t]).unsqueeze(-1) * Bh[t, :, None, :]  # [H, P, N]
        state = decay[t, :, None, None] * state + update
        ys.append(torch.einsum("hpn,hn->hp", state, Ch[t]))
    y = torch.stack(ys) if ys else x32.new_zeros(0, heads, head_dim)
    return _skip(y, x32, D).to(x.dtype), state


def ssd_chunked_varlen(
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
    chunk_size: int,
) -> Tensor:
    """Chunked SSD over a varlen batch, reading/writing per-request states in the cache.

    Args:
        x: ``[T, H, P]``.
        dt: ``[T, H]``.
        A: ``[H]``.
        B, C: ``[T, G, N]``.
        D, dt_bias: ``[H]`` or None.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        query_start_loc: int32 ``[B+1]``.
        ssm_states: ``[S, H, P, N]`` float32, updated in place.
        state_indices: int32 ``[B]``.
        has_initial_state: bool ``[B]``.
        chunk_size: tokens per chunk, ``>= 1``.

    Returns:
        ``y`` ``[T, H, P]`` in the dtype of ``x``.
    """
    dt, A, B, C, D, dt_bias = check_ssm_inputs(x, dt, A, B, C, D, dt_bias, lead="T")
    ssm_states = check_ssm_states(ssm_states, x, B.shape[-1])
    chunk_size = check_chunk_size(chunk_size)
    dt_softplus = check_bool("dt_softplus", dt_softplus)
    offsets = check_query_start_loc(query_start_loc, num_tokens=x.shape[0], device=x.device)
    batch = len(offsets) - 1
    slots = check_state_indices(
        state_indices, batch=batch, num_slots=ssm_states.shape[0], device=x.device
    )
    flags = check_has_initial_state(has_initial_state, batch=batch, device=x.device)

    heads = x.shape[1]
    dtp = _discretize_dt(dt, dt_bias, dt_softplus)
    A32 = A.float()
    Bh, Ch, x32 = _expand_groups(B, heads), _expand_groups(C, heads), x.float()
    y = torch.empty_like(x)
    for start, end, slot, has_init in zip(offsets[:-1], offsets[1:], slots, flags, strict=True):
        state0 = ssm_states[slot] if has_init else torch.zeros_like(ssm_states[slot])
        y_req, final = _ssd_chunked_one(
            x32[start:end], dtp[start:end], A32, Bh[start:end], Ch[start:end], state0, chunk_size
        )
        y[start:end] = _skip(y_req, x32[start:end], D).to(x.dtype)
        ssm_states[slot] = final
    return y


def selective_state_update(
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
        x: ``[B, H, P]``.
        dt: ``[B, H]``.
        A: ``[H]``.
        B, C: ``[B, G, N]``.
        D, dt_bias: ``[H]`` or None.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        ssm_states: ``[S, H, P, N]`` float32, updated in place.
        state_indices: int32 ``[B]`` (distinct, in ``[0, S)``).

    Returns:
        ``y`` ``[B, H, P]`` in the dtype of ``x``.
    """
    dt, A, B, C, D, dt_bias = check_ssm_inputs(x, dt, A, B, C, D, dt_bias, lead="B")
    ssm_states = check_ssm_states(ssm_states, x, B.shape[-1])
    dt_softplus = check_bool("dt_softplus", dt_softplus)
    check_state_indices(
        state_indices, batch=x.shape[0], num_slots=ssm_states.shape[0], device=x.device
    )
    heads = x.shape[1]
    idx = state_indices.long()
    dtp = _discretize_dt(dt, dt_bias, dt_softplus)  # [B, H]
    decay = torch.exp(dtp * A.float())  # [B, H]
    Bh, Ch, x32 = _expand_groups(B, heads), _expand_groups(C, heads), x.float()
    update = (dtp.unsqueeze(-1) * x32).unsqueeze(-1) * Bh.unsqueeze(-2)  # [B, H, P, N]
    state = decay[..., None, None] * ssm_states[idx] + update
    ssm_states[idx] = state
    y = torch.einsum("bhpn,bhn->bhp", state, Ch)
    return _skip(y, x32, D).to(x.dtype)
