"""Mamba2 selective state-space (SSD) kernels with per-request cached states (Triton).

Same semantics, signatures and cache conventions as the torch oracle
:mod:`attnkit.kernels.torch.mamba2` (read its module docstring first), plus an optional
``out=`` tensor. The math is that of the state-space duality (SSD) of T. Dao and A. Gu,
"Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured
State Space Duality", ICML 2024 (arXiv:2405.21060), with a scalar decay per head::

    dt'[t, h]  = softplus(dt[t, h] + dt_bias[h])   (or without softplus / bias)
    state_t    = exp(dt'[t, h] A[h]) state_{t-1} + dt'[t, h] outer(x[t, h], B[t, g])
    y[t, h]    = state_t C[t, g] + D[h] x[t, h]

* ``x`` ``[T, H, P]`` (or ``[B, H, P]`` for decode): float32, float16 or bfloat16, any
  strides. ``dt``, ``A``, ``B``, ``C``, ``D``, ``dt_bias``: any of those dtypes, any
  strides, read as float32. All arithmetic is float32; ``y`` has the dtype of ``x``.
* ``ssm_states`` ``[S, H, P, N]`` float32, **any strides** (views into larger pages),
  updated in place.
* ``query_start_loc`` int32 ``[B+1]``, ``state_indices`` int32 ``[B]``,
  ``has_initial_state`` bool ``[B]``. The launchers check shapes, dtypes and devices but
  never read device values back to the host, so their *values* (offsets from 0 to ``T``,
  non-decreasing; distinct slots in ``[0, S)``) are the caller's responsibility.
  ``out`` must not overlap the inputs or ``ssm_states``.

Decomposition of :func:`ssd_chunked_varlen`
--------------------------------------------
Chunks of ``Q = chunk_size`` tokens are aligned to each request's first token, so
request ``b`` has ``cdiv(L_b, Q)`` chunks and the batch at most
``K = min(T, (T + B (Q - 1)) // Q)`` of them: every grid below is sized from shapes
only. The chunk offsets per request (``cu_chunks``, int32 ``[B+1]``) are computed on the
device with torch ops (no synchronisation); a chunk program finds its request by binary
search over them, and programs past the batch's real chunk count exit at once.

1. ``_ssd_chunk_cumsum_kernel`` (grid ``K x H-tiles``): ``dt'`` and the inclusive
   cumulative log-decay ``cum[t] = sum_{s = chunk start}^{t} dt'[s] A`` within each chunk,
   both ``[T, H]`` float32, indexed by token (chunks partition the tokens).
2. ``_ssd_chunk_state_kernel`` (grid ``K x H x (P, N)-tiles``): the state each chunk
   would leave from a zero start, ``sum_j exp(cum[last] - cum[j]) dt'[j] x[j] B[j]^T``,
   into a ``[K, H, P, N]`` float32 workspace.
3. ``_ssd_state_passing_kernel`` (grid ``B x H x (P, N)-tiles``): the only sequential
   part, one short loop over a request's chunks: starting from the cached state (or
   zeros), it replaces each chunk's entry of the workspace by the state *entering* that
   chunk and carries ``s <- exp(cum[last]) s + chunk_state``; the final state goes back
   to the request's slot.
4. ``_ssd_chunk_output_kernel`` (grid ``K * cdiv(Q, BLOCK_T) x H x P-tiles``): per tile of
   output rows ``i``, the inter-chunk term ``exp(cum[i]) C[i] . s_entry`` plus the
   intra-chunk quadratic form ``sum_{j <= i} (C[i] . B[j]) exp(cum[i] - cum[j]) dt'[j]
   x[j]`` (the segment-sum decay mask of the paper), plus ``D x``.

Trade-offs: the decays use differences of float32 cumulative sums within one chunk
(the oracle sums each segment directly); the difference is far below the test
tolerances for chunk sizes used in practice. Every ``tl.dot`` takes float32 operands with
IEEE precision, which keeps the oracle's float32 accuracy but forgoes 16-bit tensor-core
throughput. The workspace holds ``K`` float32 states of ``H x P x N``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnkit.kernels._checks import (
    check_bool,
    check_chunk_size,
    check_distinct_output,
    check_has_slots,
    check_int_arg,
    describe,
    require_tensor,
)
from attnkit.kernels._state_common import check_slot_tensor, check_varlen_tensors
from attnkit.kernels.torch.mamba2 import _check_ssm_inputs, _check_ssm_states
from attnkit.kernels.triton._varlen import alloc_out, check_dtype, find_segment, search_iters

__all__ = ["selective_state_update", "ssd_chunk_offsets", "ssd_chunked_varlen"]

_MAX_BLOCK_P = 64
_MAX_BLOCK_N = 64
_MAX_BLOCK_T = 64
_MIN_DOT = 16  # the smallest tl.dot extent on every target
_MAX_CUMSUM_TILE = 4096  # elements of the [chunk, heads] tile of the cumsum kernel


# ----------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------


@triton.jit
def _softplus(x):
    """``torch.nn.functional.softplus`` (beta 1, threshold 20) in float32."""
    z = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + z
    # log1p(z) = log(u) * z / (u - 1) is accurate to a few ulps (Goldberg's trick),
    # where log(u) alone loses the low bits of a small z; u == 1 means log1p(z) = z.
    log1p = tl.where(u == 1.0, z, tl.log(u) * (z / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _chunk_bounds(qsl_ptr, stride_qsl, cu_ptr, num_requests, num_search_iters, chunk, chunk_size):
    """Request and token range ``[start, end)`` of global chunk ``chunk`` (a real one)."""
    request = find_segment(cu_ptr, 1, num_requests, chunk, num_search_iters)
    first = tl.load(cu_ptr + request)
    start = tl.load(qsl_ptr + request * stride_qsl) + (chunk - first) * chunk_size
    end = tl.minimum(start + chunk_size, tl.load(qsl_ptr + (request + 1) * stride_qsl))
    return request, start, end


# ----------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------


@triton.jit
def _ssd_chunk_cumsum_kernel(
    dt_ptr,
    dt_bias_ptr,
    A_ptr,
    qsl_ptr,
    cu_ptr,
    dtp_ptr,
    cum_ptr,
    num_heads,
    num_requests,
    num_search_iters,
    chunk_size,
    stride_dt_t,
    stride_dt_h,
    stride_dt_bias,
    stride_A,
    stride_qsl,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    CHUNK_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    chunk = tl.program_id(0)
    if chunk >= tl.load(cu_ptr + num_requests):
        return
    _, start, end = _chunk_bounds(
        qsl_ptr, stride_qsl, cu_ptr, num_requests, num_search_iters, chunk, chunk_size
    )
    tokens = start + tl.arange(0, CHUNK_PAD)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_valid = heads < num_heads
    mask = (tokens < end)[:, None] & h_valid[None, :]
    rows = tokens.to(tl.int64)
    dt = tl.load(
        dt_ptr + rows[:, None] * stride_dt_t + heads[None, :] * stride_dt_h, mask=mask, other=0.0
    ).to(tl.float32)
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + heads * stride_dt_bias, mask=h_valid, other=0.0)
        dt += bias.to(tl.float32)[None, :]
    if DT_SOFTPLUS:
        dt = _softplus(dt)
    A = tl.load(A_ptr + heads * stride_A, mask=h_valid, other=0.0).to(tl.float32)
    cum = tl.cumsum(tl.where(mask, dt * A[None, :], 0.0), axis=0)
    offsets = rows[:, None] * num_heads + heads[None, :]
    tl.store(dtp_ptr + offsets, dt, mask=mask)
    tl.store(cum_ptr + offsets, cum, mask=mask)


@triton.jit
def _ssd_chunk_state_kernel(
    x_ptr,
    B_ptr,
    dtp_ptr,
    cum_ptr,
    qsl_ptr,
    cu_ptr,
    states_ptr,
    head_dim,
    state_size,
    num_heads,
    heads_per_group,
    num_requests,
    num_search_iters,
    chunk_size,
    stride_xt,
    stride_xh,
    stride_xp,
    stride_Bt,
    stride_Bg,
    stride_Bn,
    stride_qsl,
    stride_wk,
    stride_wh,
    stride_wp,
    stride_wn,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    chunk = tl.program_id(0)
    if chunk >= tl.load(cu_ptr + num_requests):
        return
    _, start, end = _chunk_bounds(
        qsl_ptr, stride_qsl, cu_ptr, num_requests, num_search_iters, chunk, chunk_size
    )
    head = tl.program_id(1)
    group = head // heads_per_group
    n_tiles = tl.cdiv(state_size, BLOCK_N)
    dims = (tl.program_id(2) // n_tiles) * BLOCK_P + tl.arange(0, BLOCK_P)
    states = (tl.program_id(2) % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    p_valid = dims < head_dim
    n_valid = states < state_size

    cum_last = tl.load(cum_ptr + (end - 1).to(tl.int64) * num_heads + head)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        tokens = t0 + tl.arange(0, BLOCK_T)
        t_valid = tokens < end
        rows = tokens.to(tl.int64)
        cum = tl.load(cum_ptr + rows * num_heads + head, mask=t_valid, other=0.0)
        dtp = tl.load(dtp_ptr + rows * num_heads + head, mask=t_valid, other=0.0)
        # dt'[j] exp(cum[last] - cum[j]): token j's weight in the chunk's final state.
        weight = dtp * tl.exp(tl.where(t_valid, cum_last - cum, float("-inf")))
        x = tl.load(
            x_ptr + rows[:, None] * stride_xt + head * stride_xh + dims[None, :] * stride_xp,
            mask=t_valid[:, None] & p_valid[None, :],
            other=0.0,
        ).to(tl.float32)
        b = tl.load(
            B_ptr + rows[:, None] * stride_Bt + group * stride_Bg + states[None, :] * stride_Bn,
            mask=t_valid[:, None] & n_valid[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(tl.trans(x * weight[:, None]), b, input_precision="ieee")
    tl.store(
        states_ptr
        + chunk.to(tl.int64) * stride_wk
        + head * stride_wh
        + dims[:, None] * stride_wp
        + states[None, :] * stride_wn,
        acc,
        mask=p_valid[:, None] & n_valid[None, :],
    )


@triton.jit
def _ssd_state_passing_kernel(
    ssm_ptr,
    states_ptr,
    cum_ptr,
    qsl_ptr,
    cu_ptr,
    slot_ptr,
    init_ptr,
    head_dim,
    state_size,
    num_heads,
    chunk_size,
    stride_ss,
    stride_sh,
    stride_sp,
    stride_sn,
    stride_wk,
    stride_wh,
    stride_wp,
    stride_wn,
    stride_qsl,
    stride_slot,
    stride_init,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    n_tiles = tl.cdiv(state_size, BLOCK_N)
    dims = (tl.program_id(2) // n_tiles) * BLOCK_P + tl.arange(0, BLOCK_P)
    states = (tl.program_id(2) % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    p_valid = dims < head_dim
    n_valid = states < state_size
    mask = p_valid[:, None] & n_valid[None, :]

    start = tl.load(qsl_ptr + request * stride_qsl)
    end = tl.load(qsl_ptr + (request + 1) * stride_qsl)
    first_chunk = tl.load(cu_ptr + request)
    slot = tl.load(slot_ptr + request * stride_slot).to(tl.int64)
    # Rows of the cached state that are read: all with an initial state, else none (the
    # slot may hold garbage, even NaN, which must not leak in through a multiply).
    init_rows = head_dim * tl.load(init_ptr + request * stride_init).to(tl.int32)
    ssm_ptrs = (
        ssm_ptr
        + slot * stride_ss
        + head * stride_sh
        + dims[:, None] * stride_sp
        + states[None, :] * stride_sn
    )
    state = tl.load(ssm_ptrs, mask=(dims < init_rows)[:, None] & n_valid[None, :], other=0.0)
    work_ptrs = (
        states_ptr + head * stride_wh + dims[:, None] * stride_wp + states[None, :] * stride_wn
    )
    for c in range(0, tl.cdiv(end - start, chunk_size)):
        ptrs = work_ptrs + (first_chunk + c).to(tl.int64) * stride_wk
        contribution = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, state, mask=mask)  # the state entering this chunk
        last = tl.minimum(start + (c + 1) * chunk_size, end) - 1
        total = tl.load(cum_ptr + last.to(tl.int64) * num_heads + head)
        state = tl.exp(total) * state + contribution
    tl.store(ssm_ptrs, state, mask=mask)


@triton.jit
def _ssd_chunk_output_kernel(
    x_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    dtp_ptr,
    cum_ptr,
    states_ptr,
    qsl_ptr,
    cu_ptr,
    out_ptr,
    head_dim,
    state_size,
    num_heads,
    heads_per_group,
    num_requests,
    num_search_iters,
    chunk_size,
    tiles_per_chunk,
    stride_xt,
    stride_xh,
    stride_xp,
    stride_Bt,
    stride_Bg,
    stride_Bn,
    stride_Ct,
    stride_Cg,
    stride_Cn,
    stride_D,
    stride_wk,
    stride_wh,
    stride_wp,
    stride_wn,
    stride_qsl,
    stride_ot,
    stride_oh,
    stride_op,
    HAS_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    N_PAD: tl.constexpr,
):
    chunk = tl.program_id(0) // tiles_per_chunk
    if chunk >= tl.load(cu_ptr + num_requests):
        return
    _, start, end = _chunk_bounds(
        qsl_ptr, stride_qsl, cu_ptr, num_requests, num_search_iters, chunk, chunk_size
    )
    i0 = start + (tl.program_id(0) % tiles_per_chunk) * BLOCK_T
    if i0 >= end:
        return
    head = tl.program_id(1)
    group = head // heads_per_group
    dims = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_valid = dims < head_dim
    states = tl.arange(0, N_PAD)
    n_valid = states < state_size

    rows_i = i0 + tl.arange(0, BLOCK_T)
    i_valid = rows_i < end
    ri = rows_i.to(tl.int64)
    cum_i = tl.load(cum_ptr + ri * num_heads + head, mask=i_valid, other=0.0)
    c_i = tl.load(
        C_ptr + ri[:, None] * stride_Ct + group * stride_Cg + states[None, :] * stride_Cn,
        mask=i_valid[:, None] & n_valid[None, :],
        other=0.0,
    ).to(tl.float32)

    # Inter-chunk term: the state entering the chunk, decayed to row i, read out by C[i].
    entry = tl.load(
        states_ptr
        + chunk.to(tl.int64) * stride_wk
        + head * stride_wh
        + dims[:, None] * stride_wp
        + states[None, :] * stride_wn,
        mask=p_valid[:, None] & n_valid[None, :],
        other=0.0,
    )
    acc = tl.dot(c_i, tl.trans(entry), input_precision="ieee") * tl.exp(cum_i)[:, None]

    # Intra-chunk term over source tiles up to the diagonal one.
    for j0 in range(start, i0 + BLOCK_T, BLOCK_T):
        rows_j = j0 + tl.arange(0, BLOCK_T)
        j_valid = rows_j < end
        rj = rows_j.to(tl.int64)
        b_j = tl.load(
            B_ptr + rj[:, None] * stride_Bt + group * stride_Bg + states[None, :] * stride_Bn,
            mask=j_valid[:, None] & n_valid[None, :],
            other=0.0,
        ).to(tl.float32)
        cum_j = tl.load(cum_ptr + rj * num_heads + head, mask=j_valid, other=0.0)
        dtp_j = tl.load(dtp_ptr + rj * num_heads + head, mask=j_valid, other=0.0)
        scores = tl.dot(c_i, tl.trans(b_j), input_precision="ieee")  # [i, j] = C[i] . B[j]
        causal = (rows_j[None, :] <= rows_i[:, None]) & j_valid[None, :]
        # exp(a[j+1] + ... + a[i]) on and below the diagonal, exactly 0 above it.
        decay = tl.exp(tl.where(causal, cum_i[:, None] - cum_j[None, :], float("-inf")))
        x_j = tl.load(
            x_ptr + rj[:, None] * stride_xt + head * stride_xh + dims[None, :] * stride_xp,
            mask=j_valid[:, None] & p_valid[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(scores * decay * dtp_j[None, :], x_j, input_precision="ieee")

    io_mask = i_valid[:, None] & p_valid[None, :]
    if HAS_D:
        x_i = tl.load(
            x_ptr + ri[:, None] * stride_xt + head * stride_xh + dims[None, :] * stride_xp,
            mask=io_mask,
            other=0.0,
        ).to(tl.float32)
        acc += tl.load(D_ptr + head * stride_D).to(tl.float32) * x_i
    tl.store(
        out_ptr + ri[:, None] * stride_ot + head * stride_oh + dims[None, :] * stride_op,
        acc.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


@triton.jit
def _selective_state_update_kernel(
    x_ptr,
    dt_ptr,
    dt_bias_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    ssm_ptr,
    slot_ptr,
    out_ptr,
    head_dim,
    state_size,
    heads_per_group,
    stride_xb,
    stride_xh,
    stride_xp,
    stride_dt_b,
    stride_dt_h,
    stride_dt_bias,
    stride_A,
    stride_Bb,
    stride_Bg,
    stride_Bn,
    stride_Cb,
    stride_Cg,
    stride_Cn,
    stride_D,
    stride_ss,
    stride_sh,
    stride_sp,
    stride_sn,
    stride_slot,
    stride_ob,
    stride_oh,
    stride_op,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    HAS_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    N_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    group = head // heads_per_group
    dims = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    states = tl.arange(0, N_PAD)
    p_valid = dims < head_dim
    n_valid = states < state_size
    slot = tl.load(slot_ptr + row * stride_slot).to(tl.int64)

    dt = tl.load(dt_ptr + row * stride_dt_b + head * stride_dt_h).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + head * stride_dt_bias).to(tl.float32)
    if DT_SOFTPLUS:
        dt = _softplus(dt)
    decay = tl.exp(dt * tl.load(A_ptr + head * stride_A).to(tl.float32))
    x = tl.load(
        x_ptr + row * stride_xb + head * stride_xh + dims * stride_xp, mask=p_valid, other=0.0
    ).to(tl.float32)
    b = tl.load(
        B_ptr + row * stride_Bb + group * stride_Bg + states * stride_Bn, mask=n_valid, other=0.0
    ).to(tl.float32)
    c = tl.load(
        C_ptr + row * stride_Cb + group * stride_Cg + states * stride_Cn, mask=n_valid, other=0.0
    ).to(tl.float32)

    mask = p_valid[:, None] & n_valid[None, :]
    ssm_ptrs = (
        ssm_ptr
        + slot * stride_ss
        + head * stride_sh
        + dims[:, None] * stride_sp
        + states[None, :] * stride_sn
    )
    state = tl.load(ssm_ptrs, mask=mask, other=0.0)
    state = decay * state + (dt * x)[:, None] * b[None, :]
    tl.store(ssm_ptrs, state, mask=mask)
    y = tl.sum(state * c[None, :], axis=1)
    if HAS_D:
        y += tl.load(D_ptr + head * stride_D).to(tl.float32) * x
    tl.store(
        out_ptr + row * stride_ob + head * stride_oh + dims * stride_op,
        y.to(out_ptr.dtype.element_ty),
        mask=p_valid,
    )


# ----------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------


def _check_dtypes(**tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        check_dtype(name, t)


def _stride(t: Tensor | None, dim: int = 0) -> int:
    return t.stride(dim) if t is not None else 0


def _dot_block(extent: int, cap: int) -> int:
    """Power-of-two tile for a ``tl.dot`` extent: at least 16, at most ``cap``."""
    return max(_MIN_DOT, min(cap, int(triton.next_power_of_2(max(extent, 1)))))


def _effective_chunk(chunk_size: int, num_tokens: int) -> int:
    # A chunk longer than the whole batch is one chunk per request either way.
    return min(chunk_size, max(num_tokens, 1))


def _check_cu_chunks(cu_chunks: object, batch: int, device: torch.device) -> Tensor:
    """int32 ``[B+1]`` on ``device`` with unit stride (the kernels index it directly)."""
    cu_chunks = require_tensor(
        "cu_chunks", cu_chunks, f"an int32 torch.Tensor [B+1]=[{batch + 1}] or None"
    )
    if (
        cu_chunks.dtype != torch.int32
        or tuple(cu_chunks.shape) != (batch + 1,)
        or cu_chunks.device != device
    ):
        raise ValueError(
            f"cu_chunks: expected int32 [B+1]=[{batch + 1}] on {device}, got "
            f"{cu_chunks.dtype} {list(cu_chunks.shape)} on {cu_chunks.device}"
        )
    if batch > 0 and cu_chunks.stride(0) != 1:
        raise ValueError(
            f"cu_chunks: expected unit stride, got stride {cu_chunks.stride(0)} "
            f"({describe(cu_chunks)})"
        )
    return cu_chunks


def ssd_chunk_offsets(query_start_loc: Tensor, num_tokens: int, chunk_size: int) -> Tensor:
    """int32 ``[B+1]`` cumulative chunk counts of a varlen batch (chunks start at each
    request's first token): the chunk bookkeeping ``ssd_chunked_varlen`` takes.

    Device ops only (no host read); compute it once per step and pass it to every layer.
    ``query_start_loc`` is int32 ``[B+1]`` (``B >= 0``), ``num_tokens`` the batch's
    ``T >= 0`` and ``chunk_size >= 1``; only their metadata is checked.
    """
    query_start_loc = require_tensor(
        "query_start_loc", query_start_loc, "an int32 torch.Tensor [B+1]"
    )
    if query_start_loc.dtype != torch.int32 or query_start_loc.dim() != 1:
        raise ValueError(
            f"query_start_loc: expected an int32 tensor [B+1], got {describe(query_start_loc)}"
        )
    if query_start_loc.shape[0] < 1:
        raise ValueError(
            f"query_start_loc: expected shape [B+1] with B >= 0, got {describe(query_start_loc)}"
        )
    num_tokens = check_int_arg("num_tokens", num_tokens, 0)
    chunk_size = check_chunk_size(chunk_size)
    q = _effective_chunk(chunk_size, num_tokens)
    lengths = query_start_loc[1:] - query_start_loc[:-1]
    offsets = torch.zeros(
        query_start_loc.shape[0], dtype=torch.int32, device=query_start_loc.device
    )
    torch.cumsum(
        torch.div(lengths + (q - 1), q, rounding_mode="floor"),
        0,
        dtype=torch.int32,
        out=offsets[1:],
    )
    return offsets


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
    out: Tensor | None = None,
    cu_chunks: Tensor | None = None,
) -> Tensor:
    """Chunked SSD over a varlen batch, reading/writing per-request states in the cache.

    Semantics of :func:`attnkit.kernels.torch.mamba2.ssd_chunked_varlen`; ``out``
    (``[T, H, P]``, dtype of ``x``, any strides) receives the result when given.
    ``cu_chunks``: the batch's chunk bookkeeping from :func:`ssd_chunk_offsets` for the
    same ``query_start_loc``, ``T`` and ``chunk_size``, planned once per step and shared
    by every layer; computed here when ``None`` (given, it is int32 ``[B+1]`` with unit
    stride on the device of ``x``). ``out`` must not be ``x``, ``B``, ``C``, ``dt`` or
    ``ssm_states``. Returns ``y`` ``[T, H, P]`` in the dtype of ``x``.
    """
    dt, A, B, C, D, dt_bias = _check_ssm_inputs(x, dt, A, B, C, D, dt_bias, lead="T")
    _check_dtypes(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias)
    ssm_states = _check_ssm_states(ssm_states, x, B.shape[-1])
    chunk_size = check_chunk_size(chunk_size)
    dt_softplus = check_bool("dt_softplus", dt_softplus)
    num_tokens, heads, head_dim = x.shape
    qsl, slots, flags = check_varlen_tensors(
        query_start_loc, state_indices, has_initial_state, device=x.device, num_tokens=num_tokens
    )
    batch = qsl.shape[0] - 1
    check_has_slots("ssm_states", ssm_states, batch)
    result = alloc_out(out, x, "[T, H, P]")
    check_distinct_output(
        "out", result, {"x": x, "B": B, "C": C, "dt": dt, "ssm_states": ssm_states}
    )
    if cu_chunks is not None:
        cu_chunks = _check_cu_chunks(cu_chunks, batch, x.device)
    groups, state_size = B.shape[1], B.shape[2]
    if batch == 0 or heads == 0 or head_dim == 0 or state_size == 0:
        # Nothing to compute (a zero-size state has nothing to carry); y is all D x.
        if num_tokens > 0:
            y = x.float() * (D.float()[:, None] if D is not None else 0.0)
            result.copy_(y.to(x.dtype))
        return result

    q = _effective_chunk(chunk_size, num_tokens)
    max_chunks = min(num_tokens, (num_tokens + batch * (q - 1)) // q)
    dev = x.device
    if cu_chunks is None:
        cu_chunks = ssd_chunk_offsets(qsl, num_tokens, chunk_size)
    # Workspaces: dt' and the within-chunk cumulative log-decay per token, and one state
    # per chunk (at least one row each so that every pointer is valid).
    dtp = torch.empty(max(num_tokens, 1), heads, dtype=torch.float32, device=dev)
    cum = torch.empty_like(dtp)
    work = torch.empty(
        max(max_chunks, 1), heads, head_dim, state_size, dtype=torch.float32, device=dev
    )
    iters = search_iters(batch)
    heads_per_group = heads // groups

    block_p = _dot_block(head_dim, _MAX_BLOCK_P)
    block_n = _dot_block(state_size, _MAX_BLOCK_N)
    pn_tiles = triton.cdiv(head_dim, block_p) * triton.cdiv(state_size, block_n)
    block_t = _dot_block(q, _MAX_BLOCK_T)
    common = dict(num_requests=batch, num_search_iters=iters, chunk_size=q)

    if max_chunks > 0:
        chunk_pad = triton.next_power_of_2(q)
        block_h = max(1, min(triton.next_power_of_2(heads), _MAX_CUMSUM_TILE // chunk_pad))
        _ssd_chunk_cumsum_kernel[(max_chunks, triton.cdiv(heads, block_h))](
            dt,
            dt_bias,
            A,
            qsl,
            cu_chunks,
            dtp,
            cum,
            num_heads=heads,
            stride_dt_t=dt.stride(0),
            stride_dt_h=dt.stride(1),
            stride_dt_bias=_stride(dt_bias),
            stride_A=A.stride(0),
            stride_qsl=qsl.stride(0),
            HAS_DT_BIAS=dt_bias is not None,
            DT_SOFTPLUS=bool(dt_softplus),
            CHUNK_PAD=chunk_pad,
            BLOCK_H=block_h,
            enable_fp_fusion=True,
            **common,
        )
        _ssd_chunk_state_kernel[(max_chunks, heads, pn_tiles)](
            x,
            B,
            dtp,
            cum,
            qsl,
            cu_chunks,
            work,
            head_dim=head_dim,
            state_size=state_size,
            num_heads=heads,
            heads_per_group=heads_per_group,
            stride_xt=x.stride(0),
            stride_xh=x.stride(1),
            stride_xp=x.stride(2),
            stride_Bt=B.stride(0),
            stride_Bg=B.stride(1),
            stride_Bn=B.stride(2),
            stride_qsl=qsl.stride(0),
            stride_wk=work.stride(0),
            stride_wh=work.stride(1),
            stride_wp=work.stride(2),
            stride_wn=work.stride(3),
            BLOCK_T=block_t,
            BLOCK_P=block_p,
            BLOCK_N=block_n,
            enable_fp_fusion=True,
            **common,
        )
    _ssd_state_passing_kernel[(batch, heads, pn_tiles)](
        ssm_states,
        work,
        cum,
        qsl,
        cu_chunks,
        slots,
        flags,
        head_dim=head_dim,
        state_size=state_size,
        num_heads=heads,
        chunk_size=q,
        stride_ss=ssm_states.stride(0),
        stride_sh=ssm_states.stride(1),
        stride_sp=ssm_states.stride(2),
        stride_sn=ssm_states.stride(3),
        stride_wk=work.stride(0),
        stride_wh=work.stride(1),
        stride_wp=work.stride(2),
        stride_wn=work.stride(3),
        stride_qsl=qsl.stride(0),
        stride_slot=slots.stride(0),
        stride_init=flags.stride(0),
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        enable_fp_fusion=True,
    )
    if max_chunks > 0:
        tiles_per_chunk = triton.cdiv(q, block_t)
        _ssd_chunk_output_kernel[
            (max_chunks * tiles_per_chunk, heads, triton.cdiv(head_dim, block_p))
        ](
            x,
            B,
            C,
            D,
            dtp,
            cum,
            work,
            qsl,
            cu_chunks,
            result,
            head_dim=head_dim,
            state_size=state_size,
            num_heads=heads,
            heads_per_group=heads_per_group,
            tiles_per_chunk=tiles_per_chunk,
            stride_xt=x.stride(0),
            stride_xh=x.stride(1),
            stride_xp=x.stride(2),
            stride_Bt=B.stride(0),
            stride_Bg=B.stride(1),
            stride_Bn=B.stride(2),
            stride_Ct=C.stride(0),
            stride_Cg=C.stride(1),
            stride_Cn=C.stride(2),
            stride_D=_stride(D),
            stride_wk=work.stride(0),
            stride_wh=work.stride(1),
            stride_wp=work.stride(2),
            stride_wn=work.stride(3),
            stride_qsl=qsl.stride(0),
            stride_ot=result.stride(0),
            stride_oh=result.stride(1),
            stride_op=result.stride(2),
            HAS_D=D is not None,
            BLOCK_T=block_t,
            BLOCK_P=block_p,
            N_PAD=max(_MIN_DOT, triton.next_power_of_2(state_size)),
            enable_fp_fusion=True,
            **common,
        )
    return result


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
    out: Tensor | None = None,
) -> Tensor:
    """One decode step for ``B`` requests, each continuing from its cache slot.

    Semantics of :func:`attnkit.kernels.torch.mamba2.selective_state_update`; ``out``
    (``[B, H, P]``, dtype of ``x``, any strides) receives the result when given.
    Returns ``y`` ``[B, H, P]`` in the dtype of ``x``.

    Grid ``(B, H, cdiv(P, BLOCK_P))``: each program owns a ``[BLOCK_P, N]`` tile of one
    request's state for one head, updates it in place and reads ``y`` out of it.
    """
    dt, A, B, C, D, dt_bias = _check_ssm_inputs(x, dt, A, B, C, D, dt_bias, lead="B")
    _check_dtypes(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias)
    ssm_states = _check_ssm_states(ssm_states, x, B.shape[-1])
    dt_softplus = check_bool("dt_softplus", dt_softplus)
    batch, heads, head_dim = x.shape
    slots = check_slot_tensor(state_indices, batch=batch, device=x.device)
    check_has_slots("ssm_states", ssm_states, batch)
    result = alloc_out(out, x, "[B, H, P]")
    if batch == 0 or heads == 0 or head_dim == 0:
        return result
    groups, state_size = B.shape[1], B.shape[2]
    block_p = min(_MAX_BLOCK_P, triton.next_power_of_2(head_dim))
    _selective_state_update_kernel[(batch, heads, triton.cdiv(head_dim, block_p))](
        x,
        dt,
        dt_bias,
        A,
        B,
        C,
        D,
        ssm_states,
        slots,
        result,
        head_dim=head_dim,
        state_size=state_size,
        heads_per_group=heads // groups,
        stride_xb=x.stride(0),
        stride_xh=x.stride(1),
        stride_xp=x.stride(2),
        stride_dt_b=dt.stride(0),
        stride_dt_h=dt.stride(1),
        stride_dt_bias=_stride(dt_bias),
        stride_A=A.stride(0),
        stride_Bb=B.stride(0),
        stride_Bg=B.stride(1),
        stride_Bn=B.stride(2),
        stride_Cb=C.stride(0),
        stride_Cg=C.stride(1),
        stride_Cn=C.stride(2),
        stride_D=_stride(D),
        stride_ss=ssm_states.stride(0),
        stride_sh=ssm_states.stride(1),
        stride_sp=ssm_states.stride(2),
        stride_sn=ssm_states.stride(3),
        stride_slot=slots.stride(0),
        stride_ob=result.stride(0),
        stride_oh=result.stride(1),
        stride_op=result.stride(2),
        HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=bool(dt_softplus),
        HAS_D=D is not None,
        BLOCK_P=block_p,
        N_PAD=triton.next_power_of_2(max(state_size, 1)),
        enable_fp_fusion=True,
    )
    return result
