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
  strides, read as float32. All arithmetic is float32 (the matrix products of 16-bit
  inputs run on tensor cores with float32 accumulation: see "Precision" below); ``y``
  has the dtype of ``x``.
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
   into a ``[K, H, P, N]`` float32 workspace: one ``(weighted x)^T B`` product per tile
   of ``BLOCK_T`` tokens.
3. ``_ssd_state_passing_kernel`` (grid ``B x H x (P, N)-tiles``): the only sequential
   part, one short loop over a request's chunks: starting from the cached state (or
   zeros), it replaces each chunk's entry of the workspace by the state *entering* that
   chunk and carries ``s <- exp(cum[last]) s + chunk_state``; the final state goes back
   to the request's slot.
4. ``_ssd_chunk_output_kernel`` (grid ``K * cdiv(Q, BLOCK_T) x H x P-tiles``): per tile of
   output rows ``i``, the inter-chunk term ``exp(cum[i]) C[i] . s_entry`` plus the
   intra-chunk quadratic form ``sum_{j <= i} (C[i] . B[j]) exp(cum[i] - cum[j]) dt'[j]
   x[j]`` (the segment-sum decay mask of the paper), plus ``D x``. Both ``C[i] . s_entry``
   and the scores ``C[i] . B[j]`` are accumulated over tiles of ``BLOCK_N`` state
   columns, so no ``[BLOCK_T, N]`` tile is ever held whole: register use does not grow
   with ``N``.

Precision (tensor cores)
------------------------
The launcher picks a ``DOT_MODE`` per call from the dtypes (``_dot_mode``): when ``x``,
``B`` and ``C`` share a 16-bit dtype (fp16 ``1`` or bf16 ``2``) every ``tl.dot`` of the
chunk-state and chunk-output kernels runs on tensor cores (HMMA / HGMMA) with float32
accumulation; otherwise (float32 or mixed inputs, mode ``0``) the dots take float32
operands with IEEE precision (no TF32, which the interpreter cannot test). The decays,
``dt'``, the states and all elementwise work stay float32 in every mode.

In 16-bit mode one operand of each product is raw input, exact in its dtype (``x``,
``B``, ``C``); the other is computed in float32 (the decay-weighted ``x`` of the chunk
state, the entering state ``s_entry``, the decayed scores ``(C . B) exp(..) dt'``).
Rounding that one to 16 bits would cost a relative ``2**-9`` (bf16) / ``2**-12`` (fp16)
per term, and the output sums many terms that can cancel: measured below it needed a
tolerance of up to 3e-1 (bf16) / 4e-2 (fp16) on ``y``. So the derived operand ``v`` is
split as ``hi = rnd(v)``, ``lo = rnd(v - hi)`` (``v - hi`` is exact in float32) and both
halves are multiplied on the tensor cores: ``hi + lo`` carries about 16 (bf16) / 22
(fp16) significant bits, and the product with an exact 16-bit operand is then nearly as
accurate as the float32 dot, for twice the (cheap) tensor-core work of those products;
``C . B`` needs no split. In fp16 a derived tile can exceed the fp16 range (a large
cached state, large scores); such a tile is first scaled by a factor ``s <= 1`` (its
peak brought to ``2**14``) and the accumulator is kept in units of the latest ``s``
(rescaled when ``s`` changes, like the running maximum of online softmax); tiles in
range are not scaled. bf16 has float32's range.

Measured under the interpreter (which honours the casts; bfloat16 products are
emulated exactly, see ``round_bf16``) against the float32 oracle on the same
rounded inputs, ``x``, ``B``, ``C`` ~ N(0, 1) (and a 3x / 30x-state case),
``dt' = softplus(N(0, 1) - 1.5 + bias)``, ``A`` in ``[-4.5, -0.5]``, ``P = 64``,
``N = 64 / 128``, chunks 64 / 128, cached initial states: the tolerance ``t`` (as
``atol = rtol = t``) the outputs need is 4.8e-4 (fp16) and 3.8e-3 (bf16), one rounding
of the output, as with float32 dots (single-rounded operands: 3.9e-2 / 3.4e-1); the
float32 states need 1.4e-5 (float32 dots: 2e-6). The project's tolerances
(``attnkit.testing.tolerances``) are 4e-3 (fp16) and 2.5e-2 (bf16).

Tiles (``_STATE_TILES``, ``_OUTPUT_TILES``; caps, shrunk to small problems) were chosen
from the compile report so that nothing spills on sm_80 / sm_90 / sm_100 whatever
``P`` and ``N`` (they only change grid and loop counts): in 16-bit modes the chunk
state uses ``BLOCK_T = BLOCK_P = BLOCK_N = 64`` and the chunk output ``BLOCK_T = 64``,
``BLOCK_P`` up to 128 (a head dim of 128 in one program, which computes its row tile's
scores once), ``BLOCK_N = 32``; float32 mode uses ``BLOCK_T = BLOCK_N = 32``,
``BLOCK_P = 64``. All with 8 warps (4 for the float32 chunk state) and 2 pipeline
stages. Checked for ``P`` 64 / 128, ``N`` 64 / 128 / 256, chunks 128 / 256.

Trade-offs: the decays use differences of float32 cumulative sums within one chunk
(the oracle sums each segment directly); the difference is far below the test
tolerances for chunk sizes used in practice. The workspace holds ``K`` float32 states
of ``H x P x N``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnkit.kernels._checks import (
    alloc_out,
    check_bool,
    check_chunk_size,
    check_distinct_output,
    check_dtype,
    check_has_slots,
    check_int_arg,
    check_slot_tensor,
    check_varlen_tensors,
    describe,
    require_tensor,
)
from attnkit.kernels._triton.activations import softplus
from attnkit.kernels._triton.interpret import INTERPRETED
from attnkit.kernels._triton.rounding import round_bf16
from attnkit.kernels._triton.varlen import chunk_bounds, search_iters
from attnkit.kernels.contracts.mamba2 import check_ssm_inputs, check_ssm_states

__all__ = ["selective_state_update", "ssd_chunk_offsets", "ssd_chunked_varlen"]

# Kernels whose work is matrix products: with 16-bit inputs they must run on tensor
# cores (benchmarks/compile_report.py fails a 16-bit variant without MMA instructions).
TENSOR_CORE_KERNELS = ("_ssd_chunk_state_kernel", "_ssd_chunk_output_kernel")

_MAX_BLOCK_P = 64  # the decode kernel's head-dim tile ...
_MAX_UPDATE_TILE = 8192  # ... and its cap on BLOCK_P x N (float32 state elements)
_MIN_DOT = 16  # the smallest tl.dot extent on every target
_MAX_CUMSUM_TILE = 4096  # elements of the [chunk, heads] tile of the cumsum kernel


# ----------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------


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
    _, start, end = chunk_bounds(
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
        dt = softplus(dt)
    A = tl.load(A_ptr + heads * stride_A, mask=h_valid, other=0.0).to(tl.float32)
    cum = tl.cumsum(tl.where(mask, dt * A[None, :], 0.0), axis=0)
    offsets = rows[:, None] * num_heads + heads[None, :]
    tl.store(dtp_ptr + offsets, dt, mask=mask)
    tl.store(cum_ptr + offsets, cum, mask=mask)


@triton.jit
def _dot_operand(v, DOT_MODE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Float32 ``v`` as a ``tl.dot`` operand of the precision ``DOT_MODE`` selects.

    ``_DOT_FP32``: ``v`` itself (IEEE float32 dot). ``_DOT_FP16``: rounded to float16 (a
    derived operand is not bounded by the fp16 inputs: callers scale it by
    :func:`_fp16_scale` first). ``_DOT_BF16``: rounded to bfloat16 (float32's range).
    """
    if DOT_MODE == 1:
        return v.to(tl.float16)
    elif DOT_MODE == 2:
        if EMULATE_BF16:
            return round_bf16(v, True)
        else:
            return v.to(tl.bfloat16)
    else:
        return v


@triton.jit
def _mma(a, b, acc, DOT_MODE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``acc + a @ b`` with float32 accumulation: IEEE float32 for ``_DOT_FP32`` (and for
    bfloat16 values held in float32 when ``EMULATE_BF16``), else a 16-bit tensor-core
    product of ``a`` and ``b`` (both of the inputs' 16-bit dtype)."""
    if DOT_MODE == 0 or EMULATE_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _fp16_scale(v):
    """A factor ``s <= 1`` with ``|s v| <= 2**14``, so ``s v`` rounds to float16 without
    overflow. It is 1 (no scaling) unless ``v`` holds values beyond ``2**14``: in the
    normal range the fp16 operand is ``v`` rounded once."""
    peak = tl.max(tl.max(tl.abs(v), axis=1), axis=0)
    return 16384.0 / tl.maximum(peak, 16384.0)


@triton.jit
def _dot_split(
    a, b, acc, A_DERIVED: tl.constexpr, DOT_MODE: tl.constexpr, EMULATE_BF16: tl.constexpr
):
    """``acc + a @ b`` (float32) where one operand (``a`` if ``A_DERIVED`` else ``b``) is
    float32 computed in the kernel and the other is raw input of the 16-bit ``DOT_MODE``.

    For 16-bit modes the derived operand ``v`` is split as ``hi + lo``, ``hi = rnd(v)``,
    ``lo = rnd(v - hi)`` (``v - hi`` is exact in float32), and both halves go through
    the tensor cores: ``hi + lo`` carries twice the 16-bit significand, and the raw
    operand is exact, so the product keeps about 16 (bf16) or 22 (fp16) bits.
    """
    if DOT_MODE == 0:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif A_DERIVED:
        hi = _dot_operand(a, DOT_MODE, EMULATE_BF16)
        lo = _dot_operand(a - hi.to(tl.float32), DOT_MODE, EMULATE_BF16)
        acc = _mma(hi, b, acc, DOT_MODE, EMULATE_BF16)
        acc = _mma(lo, b, acc, DOT_MODE, EMULATE_BF16)
    else:
        hi = _dot_operand(b, DOT_MODE, EMULATE_BF16)
        lo = _dot_operand(b - hi.to(tl.float32), DOT_MODE, EMULATE_BF16)
        acc = _mma(a, hi, acc, DOT_MODE, EMULATE_BF16)
        acc = _mma(a, lo, acc, DOT_MODE, EMULATE_BF16)
    return acc


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
    DOT_MODE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    chunk = tl.program_id(0)
    if chunk >= tl.load(cu_ptr + num_requests):
        return
    _, start, end = chunk_bounds(
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
    scale = tl.full([], 1.0, tl.float32)  # fp16 only: acc holds the state times `scale`
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
        )
        b = tl.load(
            B_ptr + rows[:, None] * stride_Bt + group * stride_Bg + states[None, :] * stride_Bn,
            mask=t_valid[:, None] & n_valid[None, :],
            other=0.0,
        )
        xw = x.to(tl.float32) * weight[:, None]
        if DOT_MODE == 1:
            s = _fp16_scale(xw)
            acc = acc * (s / scale)
            scale = s
            xw = xw * s
        acc = _dot_split(tl.trans(xw), b, acc, True, DOT_MODE, EMULATE_BF16)
    if DOT_MODE == 1:
        acc = acc / scale
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
    DOT_MODE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    chunk = tl.program_id(0) // tiles_per_chunk
    if chunk >= tl.load(cu_ptr + num_requests):
        return
    _, start, end = chunk_bounds(
        qsl_ptr, stride_qsl, cu_ptr, num_requests, num_search_iters, chunk, chunk_size
    )
    i0 = start + (tl.program_id(0) % tiles_per_chunk) * BLOCK_T
    if i0 >= end:
        return
    head = tl.program_id(1)
    group = head // heads_per_group
    dims = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_valid = dims < head_dim

    rows_i = i0 + tl.arange(0, BLOCK_T)
    i_valid = rows_i < end
    ri = rows_i.to(tl.int64)
    cum_i = tl.load(cum_ptr + ri * num_heads + head, mask=i_valid, other=0.0)
    c_ptrs = C_ptr + ri[:, None] * stride_Ct + group * stride_Cg
    entry_ptrs = (
        states_ptr + chunk.to(tl.int64) * stride_wk + head * stride_wh + dims[:, None] * stride_wp
    )

    # Inter-chunk term: the state entering the chunk read out by C[i], over state tiles,
    # then decayed to row i.
    acc = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float32)
    scale = tl.full([], 1.0, tl.float32)  # fp16 only: acc holds the output times `scale`
    for n0 in range(0, state_size, BLOCK_N):
        states = n0 + tl.arange(0, BLOCK_N)
        n_valid = states < state_size
        c_i = tl.load(
            c_ptrs + states[None, :] * stride_Cn,
            mask=i_valid[:, None] & n_valid[None, :],
            other=0.0,
        )
        entry = tl.load(
            entry_ptrs + states[None, :] * stride_wn,
            mask=p_valid[:, None] & n_valid[None, :],
            other=0.0,
        )
        if DOT_MODE == 1:
            s = _fp16_scale(entry)
            acc = acc * (s / scale)
            scale = s
            entry = entry * s
        acc = _dot_split(c_i, tl.trans(entry), acc, False, DOT_MODE, EMULATE_BF16)
    acc = acc * tl.exp(cum_i)[:, None]

    # Intra-chunk term over source tiles up to the diagonal one.
    for j0 in range(start, i0 + BLOCK_T, BLOCK_T):
        rows_j = j0 + tl.arange(0, BLOCK_T)
        j_valid = rows_j < end
        rj = rows_j.to(tl.int64)
        # scores[i, j] = C[i] . B[j], over state tiles.
        scores = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        for n0 in range(0, state_size, BLOCK_N):
            states = n0 + tl.arange(0, BLOCK_N)
            n_valid = states < state_size
            c_i = tl.load(
                c_ptrs + states[None, :] * stride_Cn,
                mask=i_valid[:, None] & n_valid[None, :],
                other=0.0,
            )
            b_j = tl.load(
                B_ptr + rj[:, None] * stride_Bt + group * stride_Bg + states[None, :] * stride_Bn,
                mask=j_valid[:, None] & n_valid[None, :],
                other=0.0,
            )
            scores = _mma(c_i, tl.trans(b_j), scores, DOT_MODE, EMULATE_BF16)
        cum_j = tl.load(cum_ptr + rj * num_heads + head, mask=j_valid, other=0.0)
        dtp_j = tl.load(dtp_ptr + rj * num_heads + head, mask=j_valid, other=0.0)
        causal = (rows_j[None, :] <= rows_i[:, None]) & j_valid[None, :] & i_valid[:, None]
        # exp(a[j+1] + ... + a[i]) on and below the diagonal, exactly 0 above it (and in
        # padding rows, whose cum_i = 0 could overflow the exp and, in fp16 mode, the
        # tile's scale).
        decay = tl.exp(tl.where(causal, cum_i[:, None] - cum_j[None, :], float("-inf")))
        weights = scores * decay * dtp_j[None, :]
        x_j = tl.load(
            x_ptr + rj[:, None] * stride_xt + head * stride_xh + dims[None, :] * stride_xp,
            mask=j_valid[:, None] & p_valid[None, :],
            other=0.0,
        )
        if DOT_MODE == 1:
            s = _fp16_scale(weights)
            acc = acc * (s / scale)
            scale = s
            weights = weights * s
        acc = _dot_split(weights, x_j, acc, True, DOT_MODE, EMULATE_BF16)
    if DOT_MODE == 1:
        acc = acc / scale

    io_mask = i_valid[:, None] & p_valid[None, :]
    if HAS_D:
        x_i = tl.load(
            x_ptr + ri[:, None] * stride_xt + head * stride_xh + dims[None, :] * stride_xp,
            mask=io_mask,
            other=0.0,
        ).to(tl.float32)
        acc += tl.load(D_ptr + head * stride_D).to(tl.float32) * x_i
    if EMULATE_BF16:
        acc = round_bf16(acc, True)  # the interpreter's own cast would truncate
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
        dt = softplus(dt)
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


_DOT_FP32 = 0
_DOT_FP16 = 1
_DOT_BF16 = 2
_DOT_MODES = {torch.float16: _DOT_FP16, torch.bfloat16: _DOT_BF16}


def _dot_mode(x: Tensor, B: Tensor, C: Tensor) -> int:
    """The ``DOT_MODE`` of the chunk kernels: 16-bit operands (tensor cores) when ``x``,
    ``B`` and ``C`` share a 16-bit dtype, else IEEE float32 dots."""
    if x.dtype == B.dtype == C.dtype:
        return _DOT_MODES.get(x.dtype, _DOT_FP32)
    return _DOT_FP32


class _Tiles(NamedTuple):
    """Tile sizes (caps, before fitting to the problem) and warps of one chunk kernel."""

    block_t: int
    block_p: int
    block_n: int
    num_warps: int
    num_stages: int


# Tile caps per dot mode, (BLOCK_T, BLOCK_P, BLOCK_N, warps, stages); chosen from the
# compile report so that no variant spills on sm_80 / sm_90 / sm_100 (module doc).
_STATE_TILES = {
    _DOT_FP32: _Tiles(32, 64, 32, 4, 2),
    _DOT_FP16: _Tiles(64, 64, 64, 8, 2),
    _DOT_BF16: _Tiles(64, 64, 64, 8, 2),
}
_OUTPUT_TILES = {
    _DOT_FP32: _Tiles(32, 64, 32, 8, 2),
    _DOT_FP16: _Tiles(64, 128, 32, 8, 2),
    _DOT_BF16: _Tiles(64, 128, 32, 8, 2),
}


def _fit(tiles: _Tiles, q: int, head_dim: int, state_size: int) -> _Tiles:
    """``tiles`` shrunk to the problem (powers of two, at least the smallest dot)."""
    return _Tiles(
        _dot_block(q, tiles.block_t),
        _dot_block(head_dim, tiles.block_p),
        _dot_block(state_size, tiles.block_n),
        tiles.num_warps,
        tiles.num_stages,
    )


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
    dt, A, B, C, D, dt_bias = check_ssm_inputs(x, dt, A, B, C, D, dt_bias, lead="T")
    _check_dtypes(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias)
    ssm_states = check_ssm_states(ssm_states, x, B.shape[-1])
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

    dot_mode = _dot_mode(x, B, C)
    emulate_bf16 = INTERPRETED and dot_mode == _DOT_BF16
    st = _fit(_STATE_TILES[dot_mode], q, head_dim, state_size)
    ot = _fit(_OUTPUT_TILES[dot_mode], q, head_dim, state_size)
    pn_tiles = triton.cdiv(head_dim, st.block_p) * triton.cdiv(state_size, st.block_n)
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
            DOT_MODE=dot_mode,
            EMULATE_BF16=emulate_bf16,
            BLOCK_T=st.block_t,
            BLOCK_P=st.block_p,
            BLOCK_N=st.block_n,
            num_warps=st.num_warps,
            num_stages=st.num_stages,
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
        BLOCK_P=st.block_p,
        BLOCK_N=st.block_n,
        enable_fp_fusion=True,
    )
    if max_chunks > 0:
        tiles_per_chunk = triton.cdiv(q, ot.block_t)
        _ssd_chunk_output_kernel[
            (max_chunks * tiles_per_chunk, heads, triton.cdiv(head_dim, ot.block_p))
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
            DOT_MODE=dot_mode,
            EMULATE_BF16=emulate_bf16,
            BLOCK_T=ot.block_t,
            BLOCK_P=ot.block_p,
            BLOCK_N=ot.block_n,
            num_warps=ot.num_warps,
            num_stages=ot.num_stages,
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
    dt, A, B, C, D, dt_bias = check_ssm_inputs(x, dt, A, B, C, D, dt_bias, lead="B")
    _check_dtypes(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias)
    ssm_states = check_ssm_states(ssm_states, x, B.shape[-1])
    dt_softplus = check_bool("dt_softplus", dt_softplus)
    batch, heads, head_dim = x.shape
    slots = check_slot_tensor(state_indices, batch=batch, device=x.device)
    check_has_slots("ssm_states", ssm_states, batch)
    result = alloc_out(out, x, "[B, H, P]")
    if batch == 0 or heads == 0 or head_dim == 0:
        return result
    groups, state_size = B.shape[1], B.shape[2]
    n_pad = triton.next_power_of_2(max(state_size, 1))
    # The [BLOCK_P, N] float32 state tile lives in registers: at most 8192 elements
    # (64 x 128) per program keeps it spill-free for any N (d_state 256 -> BLOCK_P 32).
    block_p = max(1, min(_MAX_BLOCK_P, triton.next_power_of_2(head_dim), _MAX_UPDATE_TILE // n_pad))
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
        N_PAD=n_pad,
        enable_fp_fusion=True,
    )
    return result
