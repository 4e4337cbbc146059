"""The Gated DeltaNet kernels (``@triton.jit``): the three launches of the chunked prefill
(chunk preparation, state pass, chunk output) and the decode step. The launchers and the
design notes (launches, precision, measurements) are in
:mod:`attnkit.kernels.gated_delta.triton`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnkit.kernels._triton.rounding import round_bf16
from attnkit.kernels._triton.varlen import chunk_bounds

# Kernels whose work is matrix products: with 16-bit inputs they must run on tensor
# cores (benchmarks/compile_report.py checks it). The decode kernel has no dots.
TENSOR_CORE_KERNELS = (
    "_gdn_chunk_prep_kernel",
    "_gdn_state_pass_kernel",
    "_gdn_chunk_output_kernel",
)


# ----------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------


@triton.jit
def _load_rows(base, token, stride_t, dims, stride_d, row_valid, num_dims):
    """``[rows, dims]`` tile of a ``[T, *]`` operand (zeros past either bound), float32."""
    mask = row_valid[:, None] & (dims < num_dims)[None, :]
    ptrs = base + token[:, None] * stride_t + dims[None, :] * stride_d
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _as_dot_operand(x, dot_dtype: tl.constexpr, ROUND_BF16: tl.constexpr):
    """``x`` (float32) as a ``tl.dot`` operand of the compute dtype.

    ``ROUND_BF16`` (interpreter only): the interpreter's ``tl.dot`` multiplies bfloat16
    tensors as raw 16-bit integers, so there the operand stays float32 but is rounded to
    the nearest bfloat16 (ties to even) by hand: the same values a bfloat16 dot with
    float32 accumulation multiplies on a GPU.
    """
    if ROUND_BF16:
        return round_bf16(x, True)
    else:
        return x.to(dot_dtype)


@triton.jit
def _load_init_tile(
    state_base, stride_sk, stride_sv, k_tile, dims_v, v_valid, rows_to_read, BLOCK_K: tl.constexpr
):
    """Rows ``k_tile * BLOCK_K + [0, BLOCK_K)`` of a slot's state; rows at or past
    ``rows_to_read`` (all of them without an initial state) read 0, never memory."""
    dims_k = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
    ptrs = state_base + dims_k[:, None] * stride_sk + dims_v[None, :] * stride_sv
    return tl.load(ptrs, mask=(dims_k[:, None] < rows_to_read) & v_valid[None, :], other=0.0)


@triton.jit
def _store_state_tile(
    state_base, stride_sk, stride_sv, k_tile, dims_v, v_valid, tile, key_dim, BLOCK_K: tl.constexpr
):
    dims_k = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
    ptrs = state_base + dims_k[:, None] * stride_sk + dims_v[None, :] * stride_sv
    tl.store(
        ptrs, tile.to(ptrs.dtype.element_ty), mask=(dims_k < key_dim)[:, None] & v_valid[None, :]
    )


@triton.jit
def _w_times_state(
    w_base,
    stride_wr,
    rows,
    k_tile,
    state_tile,
    key_dim,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """``W[:, tile] @ S[tile, :]``: ``W`` is stored in the compute dtype."""
    dims_k = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
    w = tl.load(
        w_base + rows[:, None] * stride_wr + dims_k[None, :],
        mask=(dims_k < key_dim)[None, :],
        other=0.0,
    )
    return tl.dot(
        w, _as_dot_operand(state_tile, w.dtype, ROUND_BF16), input_precision=DOT_PRECISION
    )


@triton.jit
def _advance_state_tile(
    state_tile,
    k_base,
    token,
    stride_kt,
    stride_kk,
    row_valid,
    k_tile,
    key_dim,
    to_end,
    total,
    delta,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """``exp(G_last) S[tile] + (diag(exp(G_last - G)) K[:, tile])^T D``."""
    dims_k = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
    k = _load_rows(k_base, token, stride_kt, dims_k, stride_kk, row_valid, key_dim)
    k_to_end = _as_dot_operand(k * to_end[:, None], delta.dtype, ROUND_BF16)
    return total * state_tile + tl.dot(tl.trans(k_to_end), delta, input_precision=DOT_PRECISION)


# ----------------------------------------------------------------------------------
# Chunked prefill kernels
# ----------------------------------------------------------------------------------


@triton.jit
def _gdn_chunk_prep_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    qsl_ptr,
    cu_ptr,
    cum_ptr,
    w_ptr,
    u_ptr,
    num_requests,
    num_search_iters,
    stride_kt,
    stride_kh,
    stride_kk,
    stride_vt,
    stride_vh,
    stride_vv,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    stride_qsl,
    stride_cum_c,
    stride_cum_h,
    stride_w_c,
    stride_w_h,
    stride_w_r,
    stride_u_c,
    stride_u_h,
    stride_u_r,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_K_TILES: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HEAD_GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Per chunk: cumulative gates, ``Tm = (I + A)^-1``, ``W`` and ``U`` (step 1)."""
    tl.static_assert(CHUNK >= 16)
    tl.static_assert(BLOCK_K >= 16)
    tl.static_assert(BLOCK_V >= 16)
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    if chunk >= tl.load(cu_ptr + num_requests):
        return
    _, start, end = chunk_bounds(
        qsl_ptr, stride_qsl, cu_ptr, num_requests, num_search_iters, chunk, CHUNK
    )
    dot_dtype = w_ptr.dtype.element_ty
    rows = tl.arange(0, CHUNK)
    token = start + rows
    row_valid = token < end
    token = token.to(tl.int64)
    # Value head ``head`` reads key head ``head // HEAD_GROUP`` (shared key heads).
    k_base = k_ptr + (head // HEAD_GROUP) * stride_kh
    v_base = v_ptr + head * stride_vh
    ws = chunk.to(tl.int64)

    kk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for k_tile in range(NUM_K_TILES):
        dims_k = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
        k = _load_rows(k_base, token, stride_kt, dims_k, stride_kk, row_valid, KEY_DIM)
        k = _as_dot_operand(k, dot_dtype, ROUND_BF16)
        kk += tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION)

    g = tl.load(g_ptr + token * stride_gt + head * stride_gh, mask=row_valid, other=0.0)
    beta = tl.load(beta_ptr + token * stride_bt + head * stride_bh, mask=row_valid, other=0.0)
    g = g.to(tl.float32)
    beta = beta.to(tl.float32)
    cum = tl.cumsum(g, 0)
    tl.store(cum_ptr + ws * stride_cum_c + head * stride_cum_h + rows, cum)

    # Above the diagonal G_i - G_j is positive (and could overflow): select -inf there
    # before exp, never multiply by a mask.
    causal = rows[:, None] >= rows[None, :]
    decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
    a = tl.where(rows[:, None] > rows[None, :], beta[:, None] * kk * decay, 0.0)
    # Tm = (I + A)^-1, A strictly lower triangular: row i of Tm is e_i - sum_{j<i} A_ij
    # Tm_j. Rows j >= i are still e_j when row i is built and A_ij = 0 there, so the
    # sum may run over every j.
    t_inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, CHUNK):
        a_row = tl.sum(tl.where(rows[:, None] == i, a, 0.0), 0)  # A[i, :]
        update = tl.sum(a_row[:, None] * t_inv, 0)  # sum_j A_ij Tm[j, :]
        t_inv = tl.where(rows[:, None] == i, t_inv - update[None, :], t_inv)
    t_dot = _as_dot_operand(t_inv, dot_dtype, ROUND_BF16)

    k_scale = beta * tl.exp(cum)
    w_base = w_ptr + ws * stride_w_c + head * stride_w_h
    for k_tile in range(NUM_K_TILES):
        dims_k = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
        k = _load_rows(k_base, token, stride_kt, dims_k, stride_kk, row_valid, KEY_DIM)
        w = tl.dot(
            t_dot,
            _as_dot_operand(k * k_scale[:, None], dot_dtype, ROUND_BF16),
            input_precision=DOT_PRECISION,
        )
        tl.store(
            w_base + rows[:, None] * stride_w_r + dims_k[None, :],
            _as_dot_operand(w, dot_dtype, ROUND_BF16),
            mask=(dims_k < KEY_DIM)[None, :],
        )
    u_base = u_ptr + ws * stride_u_c + head * stride_u_h
    for v_start in range(0, VALUE_DIM, BLOCK_V):
        dims_v = v_start + tl.arange(0, BLOCK_V)
        v = _load_rows(v_base, token, stride_vt, dims_v, stride_vv, row_valid, VALUE_DIM)
        u = tl.dot(
            t_dot,
            _as_dot_operand(v * beta[:, None], dot_dtype, ROUND_BF16),
            input_precision=DOT_PRECISION,
        )
        tl.store(
            u_base + rows[:, None] * stride_u_r + dims_v[None, :],
            u,
            mask=(dims_v < VALUE_DIM)[None, :],
        )


@triton.jit
def _gdn_state_pass_kernel(
    k_ptr,
    states_ptr,
    qsl_ptr,
    cu_ptr,
    state_indices_ptr,
    has_initial_state_ptr,
    cum_ptr,
    w_ptr,
    u_ptr,
    h_ptr,
    d_ptr,
    stride_kt,
    stride_kh,
    stride_kk,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_sv,
    stride_qsl,
    stride_si,
    stride_his,
    stride_cum_c,
    stride_cum_h,
    stride_w_c,
    stride_w_h,
    stride_w_r,
    stride_u_c,
    stride_u_h,
    stride_u_r,
    stride_h_c,
    stride_h_h,
    stride_h_k,
    stride_d_c,
    stride_d_h,
    stride_d_r,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_K_TILES: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HEAD_GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Per (request, head, value block), sequential over the request's chunks (step 2)."""
    tl.static_assert(NUM_K_TILES == 1 or NUM_K_TILES == 2 or NUM_K_TILES == 4)
    request = tl.program_id(0)
    head = tl.program_id(1)
    v_block = tl.program_id(2)
    first_chunk = tl.load(cu_ptr + request)
    last_chunk = tl.load(cu_ptr + request + 1)
    start = tl.load(qsl_ptr + request * stride_qsl)
    end = tl.load(qsl_ptr + (request + 1) * stride_qsl)
    # int64 before multiplying by strides: S * H * K * V may exceed 2**31 elements.
    slot = tl.load(state_indices_ptr + request * stride_si).to(tl.int64)
    has_init = tl.load(has_initial_state_ptr + request * stride_his) != 0
    dot_dtype = w_ptr.dtype.element_ty

    dims_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    v_valid = dims_v < VALUE_DIM
    rows = tl.arange(0, CHUNK)
    state_base = states_ptr + slot * stride_ss + head * stride_sh
    k_base = k_ptr + (head // HEAD_GROUP) * stride_kh
    # Without an initial state the slot is never read (it may hold garbage, even NaN):
    # no key row is in range then. (A bound rather than ``mask & has_init``: the
    # interpreter rejects a mask built from a scalar bool.)
    rows_to_read = tl.where(has_init, KEY_DIM, 0)
    s0 = _load_init_tile(
        state_base, stride_sk, stride_sv, 0, dims_v, v_valid, rows_to_read, BLOCK_K
    )
    s1 = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    s3 = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    if NUM_K_TILES >= 2:
        s1 = _load_init_tile(
            state_base, stride_sk, stride_sv, 1, dims_v, v_valid, rows_to_read, BLOCK_K
        )
    if NUM_K_TILES >= 4:
        s2 = _load_init_tile(
            state_base, stride_sk, stride_sv, 2, dims_v, v_valid, rows_to_read, BLOCK_K
        )
        s3 = _load_init_tile(
            state_base, stride_sk, stride_sv, 3, dims_v, v_valid, rows_to_read, BLOCK_K
        )

    # The loop counter is a chunk of this request; the workspace row is int64 (a
    # batch's NC * H * K * V may exceed 2**31 elements).
    first_ws = first_chunk.to(tl.int64)
    for i in range(0, last_chunk - first_chunk):
        ws = first_ws + i
        token = start + i * CHUNK + rows
        row_valid = token < end
        token = token.to(tl.int64)
        w_base = w_ptr + ws * stride_w_c + head * stride_w_h
        h_base = h_ptr + ws * stride_h_c + head * stride_h_h

        # D = U - W S with the entering state, which is also what step 3 reads.
        u = tl.load(
            u_ptr
            + ws * stride_u_c
            + head * stride_u_h
            + rows[:, None] * stride_u_r
            + dims_v[None, :],
            mask=v_valid[None, :],
            other=0.0,
        )
        delta = u - _w_times_state(
            w_base, stride_w_r, rows, 0, s0, KEY_DIM, BLOCK_K, DOT_PRECISION, ROUND_BF16
        )
        _store_state_tile(
            h_base,
            stride_h_k,
            1,
            0,
            dims_v,
            v_valid,
            _as_dot_operand(s0, dot_dtype, ROUND_BF16),
            KEY_DIM,
            BLOCK_K,
        )
        if NUM_K_TILES >= 2:
            delta -= _w_times_state(
                w_base, stride_w_r, rows, 1, s1, KEY_DIM, BLOCK_K, DOT_PRECISION, ROUND_BF16
            )
            _store_state_tile(
                h_base,
                stride_h_k,
                1,
                1,
                dims_v,
                v_valid,
                _as_dot_operand(s1, dot_dtype, ROUND_BF16),
                KEY_DIM,
                BLOCK_K,
            )
        if NUM_K_TILES >= 4:
            delta -= _w_times_state(
                w_base, stride_w_r, rows, 2, s2, KEY_DIM, BLOCK_K, DOT_PRECISION, ROUND_BF16
            )
            delta -= _w_times_state(
                w_base, stride_w_r, rows, 3, s3, KEY_DIM, BLOCK_K, DOT_PRECISION, ROUND_BF16
            )
            _store_state_tile(
                h_base,
                stride_h_k,
                1,
                2,
                dims_v,
                v_valid,
                _as_dot_operand(s2, dot_dtype, ROUND_BF16),
                KEY_DIM,
                BLOCK_K,
            )
            _store_state_tile(
                h_base,
                stride_h_k,
                1,
                3,
                dims_v,
                v_valid,
                _as_dot_operand(s3, dot_dtype, ROUND_BF16),
                KEY_DIM,
                BLOCK_K,
            )
        delta = _as_dot_operand(delta, dot_dtype, ROUND_BF16)
        tl.store(
            d_ptr
            + ws * stride_d_c
            + head * stride_d_h
            + rows[:, None] * stride_d_r
            + dims_v[None, :],
            delta,
            mask=v_valid[None, :],
        )

        cum_base = cum_ptr + ws * stride_cum_c + head * stride_cum_h
        cum = tl.load(cum_base + rows)
        cum_last = tl.load(cum_base + CHUNK - 1)
        to_end = tl.exp(cum_last - cum)
        total = tl.exp(cum_last)
        s0 = _advance_state_tile(
            s0,
            k_base,
            token,
            stride_kt,
            stride_kk,
            row_valid,
            0,
            KEY_DIM,
            to_end,
            total,
            delta,
            BLOCK_K,
            DOT_PRECISION,
            ROUND_BF16,
        )
        if NUM_K_TILES >= 2:
            s1 = _advance_state_tile(
                s1,
                k_base,
                token,
                stride_kt,
                stride_kk,
                row_valid,
                1,
                KEY_DIM,
                to_end,
                total,
                delta,
                BLOCK_K,
                DOT_PRECISION,
                ROUND_BF16,
            )
        if NUM_K_TILES >= 4:
            s2 = _advance_state_tile(
                s2,
                k_base,
                token,
                stride_kt,
                stride_kk,
                row_valid,
                2,
                KEY_DIM,
                to_end,
                total,
                delta,
                BLOCK_K,
                DOT_PRECISION,
                ROUND_BF16,
            )
            s3 = _advance_state_tile(
                s3,
                k_base,
                token,
                stride_kt,
                stride_kk,
                row_valid,
                3,
                KEY_DIM,
                to_end,
                total,
                delta,
                BLOCK_K,
                DOT_PRECISION,
                ROUND_BF16,
            )

    _store_state_tile(state_base, stride_sk, stride_sv, 0, dims_v, v_valid, s0, KEY_DIM, BLOCK_K)
    if NUM_K_TILES >= 2:
        _store_state_tile(
            state_base, stride_sk, stride_sv, 1, dims_v, v_valid, s1, KEY_DIM, BLOCK_K
        )
    if NUM_K_TILES >= 4:
        _store_state_tile(
            state_base, stride_sk, stride_sv, 2, dims_v, v_valid, s2, KEY_DIM, BLOCK_K
        )
        _store_state_tile(
            state_base, stride_sk, stride_sv, 3, dims_v, v_valid, s3, KEY_DIM, BLOCK_K
        )


@triton.jit
def _gdn_chunk_output_kernel(
    q_ptr,
    k_ptr,
    out_ptr,
    qsl_ptr,
    cu_ptr,
    cum_ptr,
    h_ptr,
    d_ptr,
    scale,
    num_requests,
    num_search_iters,
    stride_qt,
    stride_qh,
    stride_qk,
    stride_kt,
    stride_kh,
    stride_kk,
    stride_ot,
    stride_oh,
    stride_ov,
    stride_qsl,
    stride_cum_c,
    stride_cum_h,
    stride_h_c,
    stride_h_h,
    stride_h_k,
    stride_d_c,
    stride_d_h,
    stride_d_r,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_K_TILES: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HEAD_GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Per (chunk, head, value block): the chunk's outputs (step 3)."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    v_block = tl.program_id(2)
    if chunk >= tl.load(cu_ptr + num_requests):
        return
    _, start, end = chunk_bounds(
        qsl_ptr, stride_qsl, cu_ptr, num_requests, num_search_iters, chunk, CHUNK
    )
    dot_dtype = d_ptr.dtype.element_ty
    rows = tl.arange(0, CHUNK)
    token = start + rows
    row_valid = token < end
    token = token.to(tl.int64)
    ws = chunk.to(tl.int64)
    dims_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    v_valid = dims_v < VALUE_DIM
    q_base = q_ptr + (head // HEAD_GROUP) * stride_qh
    k_base = k_ptr + (head // HEAD_GROUP) * stride_kh
    h_base = h_ptr + ws * stride_h_c + head * stride_h_h

    scores = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    inter = tl.zeros([CHUNK, BLOCK_V], dtype=tl.float32)
    for k_tile in range(NUM_K_TILES):
        dims_k = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
        q = _load_rows(q_base, token, stride_qt, dims_k, stride_qk, row_valid, KEY_DIM)
        k = _load_rows(k_base, token, stride_kt, dims_k, stride_kk, row_valid, KEY_DIM)
        q = _as_dot_operand(q, dot_dtype, ROUND_BF16)
        scores += tl.dot(
            q, tl.trans(_as_dot_operand(k, dot_dtype, ROUND_BF16)), input_precision=DOT_PRECISION
        )
        h = tl.load(
            h_base + dims_k[:, None] * stride_h_k + dims_v[None, :],
            mask=(dims_k < KEY_DIM)[:, None] & v_valid[None, :],
            other=0.0,
        )
        inter += tl.dot(q, h, input_precision=DOT_PRECISION)

    cum = tl.load(cum_ptr + ws * stride_cum_c + head * stride_cum_h + rows)
    causal = rows[:, None] >= rows[None, :]
    decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
    delta = tl.load(
        d_ptr + ws * stride_d_c + head * stride_d_h + rows[:, None] * stride_d_r + dims_v[None, :],
        mask=v_valid[None, :],
        other=0.0,
    )
    intra = tl.dot(
        _as_dot_operand(scores * decay, dot_dtype, ROUND_BF16), delta, input_precision=DOT_PRECISION
    )
    o = scale * (tl.exp(cum)[:, None] * inter + intra)
    tl.store(
        out_ptr + token[:, None] * stride_ot + head * stride_oh + dims_v[None, :] * stride_ov,
        o.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & v_valid[None, :],
    )


# ----------------------------------------------------------------------------------
# Decode kernel
# ----------------------------------------------------------------------------------


@triton.jit
def _recurrent_update_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    out_ptr,
    states_ptr,
    state_indices_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_qk,
    stride_kb,
    stride_kh,
    stride_kk,
    stride_vb,
    stride_vh,
    stride_vv,
    stride_gb,
    stride_gh,
    stride_bb,
    stride_bh,
    stride_ob,
    stride_oh,
    stride_ov,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_sv,
    stride_si,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    KEY_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HEAD_GROUP: tl.constexpr,
):
    tl.static_assert(KEY_PAD >= KEY_DIM)
    request = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    v_block = tl.program_id(2)

    slot = tl.load(state_indices_ptr + request * stride_si).to(tl.int64)
    dims_k = tl.arange(0, KEY_PAD)
    k_valid = dims_k < KEY_DIM
    dims_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    v_valid = dims_v < VALUE_DIM
    state_mask = k_valid[:, None] & v_valid[None, :]
    state_ptrs = (
        states_ptr
        + slot * stride_ss
        + head * stride_sh
        + dims_k[:, None] * stride_sk
        + dims_v[None, :] * stride_sv
    )
    key_head = head // HEAD_GROUP  # the query/key head this value head shares
    q = tl.load(
        q_ptr + request * stride_qb + key_head * stride_qh + dims_k * stride_qk, mask=k_valid
    )
    k = tl.load(
        k_ptr + request * stride_kb + key_head * stride_kh + dims_k * stride_kk, mask=k_valid
    )
    v = tl.load(v_ptr + request * stride_vb + head * stride_vh + dims_v * stride_vv, mask=v_valid)
    g = tl.load(g_ptr + request * stride_gb + head * stride_gh).to(tl.float32)
    beta = tl.load(beta_ptr + request * stride_bb + head * stride_bh).to(tl.float32)
    q = tl.where(k_valid, q.to(tl.float32), 0.0)
    k = tl.where(k_valid, k.to(tl.float32), 0.0)
    v = tl.where(v_valid, v.to(tl.float32), 0.0)

    state = tl.load(state_ptrs, mask=state_mask, other=0.0) * tl.exp(g)
    u = v - tl.sum(state * k[:, None], 0)  # [BLOCK_V]
    state = state + beta * k[:, None] * u[None, :]
    o = scale * tl.sum(state * q[:, None], 0)
    tl.store(state_ptrs, state, mask=state_mask)
    tl.store(
        out_ptr + request * stride_ob + head * stride_oh + dims_v * stride_ov,
        o.to(out_ptr.dtype.element_ty),
        mask=v_valid,
    )
