"""The Mamba2 SSD kernels (``@triton.jit``): the four phases of the chunked prefill and the
decode step. The launchers, the tile choices and the design notes (phases, precision,
measurements) are in :mod:`attnkit.kernels.mamba2.triton`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnkit.kernels._triton.activations import softplus
from attnkit.kernels._triton.rounding import round_bf16
from attnkit.kernels._triton.varlen import chunk_bounds

# Kernels whose work is matrix products: with 16-bit inputs they must run on tensor
# cores (benchmarks/compile_report.py fails a 16-bit variant without MMA instructions).
TENSOR_CORE_KERNELS = ("_ssd_chunk_state_kernel", "_ssd_chunk_output_kernel")


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
