"""Gated DeltaNet (gated delta rule) kernels with states in a cache: chunked prefill, decode.

The definition, the chunked (WY / UT-transform) form and the cache conventions are those
of the torch oracle :mod:`attnkit.kernels.torch.gated_delta` (read its module doc first;
the math is from S. Yang, J. Kautz and A. Hatamizadeh, "Gated Delta Networks: Improving
Mamba2 with Delta Rule", ICLR 2025, arXiv:2412.06464, and S. Yang et al.,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length", NeurIPS
2024, arXiv:2406.06484). The launchers here have the same names and signatures.

Shapes: ``T`` tokens, ``B`` requests, ``H`` heads, ``K`` key dim (``<= 256``), ``V`` value
dim, ``S`` cache slots. ``q``/``k`` ``[*, H, K]``, ``v``/``out`` ``[*, H, V]``,
``g``/``beta`` ``[*, H]`` (float32, float16 or bfloat16, any strides; ``q`` and ``k``
already L2-normalised by the model), ``states`` float32 ``[S, H, K, V]`` with any strides
(a view into a larger page is fine). Everything is computed in float32; the output has
the dtype of ``v``.

Kernel design
-------------
The columns of a head's ``[K, V]`` state evolve independently (the update reads
``S^T k`` column by column), so each program owns one request, one head and one block of
``BLOCK_V`` value columns: grid ``B x H x cdiv(V, BLOCK_V)``. It keeps its
``[K, BLOCK_V]`` float32 state slice in registers for the whole request.

``chunk_gated_delta_rule_varlen`` walks the request's chunks *sequentially* inside the
program (chunks start at the request's first token). Per chunk, with ``C`` rows:

1. load ``q``, ``k`` ``[C, K]``, ``v`` ``[C, BLOCK_V]``, ``g``, ``beta``; padding rows past
   the request's end read ``g = beta = 0`` and zero vectors, so they change nothing;
2. ``G = cumsum(g)``, the decay mask ``exp(G_i - G_j)`` (``j <= i``) and the strictly
   lower ``A = beta_i exp(G_i - G_j) (k_i . k_j)`` from one ``k k^T`` dot;
3. ``Tm = (I + A)^-1`` by forward substitution, one row per step (``C - 1`` dependent
   steps of ``O(C^2)`` vector work); then ``U = Tm (beta v)`` and
   ``W = Tm (beta exp(G) k)`` as dots;
4. ``D = U - W S``, ``O = scale (exp(G) q S + (q k^T * mask) D)``, and
   ``S <- exp(G_last) S + (exp(G_last - G) k)^T D``: all dots.

Trade-off: one program per (request, head, value block) needs no second pass, no
inter-chunk state buffer in memory and no extra launches, and every state is read once
and written once. The price is parallelism: a long request's chunks run one after
another in a single program, so a batch with few requests and heads leaves most of a
GPU idle, and the forward substitution is ``C`` short dependent steps per chunk. A
production kernel splits this into several launches (per-chunk ``U``/``W`` in parallel
over all chunks, a light sequential state pass, then per-chunk outputs in parallel) and
inverts ``I + A`` blockwise; this one favours simplicity. The value-block split also
recomputes ``Tm``, ``U``'s left factor and ``W`` once per value block (cheap next to the
state work for ``BLOCK_V = 64``). Dots run in IEEE float32 (no TF32): the chunked form
subtracts ``W S`` from ``U``, and TF32 rounding there would be visible at float32
tolerances; 16-bit inputs are widened to float32 on load.

``fused_recurrent_gated_delta_rule_update`` is one step of the definition per program,
with elementwise ops and row/column reductions (no dots).

No launcher reads a device value back to the host: index tensors are checked for
dtype, shape and device only, and their values must satisfy the oracle's conventions
(offsets non-decreasing from 0 to ``T``; slots distinct and in ``[0, S)``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.kernels._checks import check_distinct_output, check_has_slots
from attnkit.kernels._state_common import (
    check_scale,
    check_slot_tensor,
    check_states,
    check_varlen_tensors,
    flags_as_bytes,
)
from attnkit.kernels.torch.gated_delta import _alloc_out, _check_chunk_size, _check_gdn_inputs

__all__ = ["chunk_gated_delta_rule_varlen", "fused_recurrent_gated_delta_rule_update"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# tl.dot needs every extent >= 16, so the chunk is one of these; the torch oracle
# accepts any chunk size >= 1.
_SUPPORTED_CHUNK_SIZES = (16, 32, 64)
_MAX_KEY_DIM = 256
_MIN_DOT_DIM = 16


@triton.jit
def _chunk_gated_delta_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    out_ptr,
    states_ptr,
    query_start_loc_ptr,
    state_indices_ptr,
    has_initial_state_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_qk,
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
    stride_ot,
    stride_oh,
    stride_ov,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_sv,
    stride_qsl,
    stride_si,
    stride_his,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    KEY_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tl.static_assert(KEY_PAD >= KEY_DIM)
    tl.static_assert(CHUNK >= 16)
    tl.static_assert(KEY_PAD >= 16)
    tl.static_assert(BLOCK_V >= 16)
    request = tl.program_id(0)
    head = tl.program_id(1)
    v_block = tl.program_id(2)

    start = tl.load(query_start_loc_ptr + request * stride_qsl)
    end = tl.load(query_start_loc_ptr + (request + 1) * stride_qsl)
    # int64 before multiplying by strides: S * H * K * V may exceed 2**31 elements.
    slot = tl.load(state_indices_ptr + request * stride_si).to(tl.int64)
    has_init = tl.load(has_initial_state_ptr + request * stride_his) != 0

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
    # Without an initial state the slot is never read (it may hold garbage, even NaN):
    # no key row is in range then. (A bound rather than ``mask & has_init``: the
    # interpreter rejects a mask built from a scalar bool.)
    rows_to_read = tl.where(has_init, KEY_DIM, 0)
    init_mask = (dims_k[:, None] < rows_to_read) & v_valid[None, :]
    state = tl.load(state_ptrs, mask=init_mask, other=0.0)

    rows = tl.arange(0, CHUNK)
    causal = rows[:, None] >= rows[None, :]
    strictly_lower = rows[:, None] > rows[None, :]
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for chunk_start in range(start, end, CHUNK):
        token = chunk_start + rows
        row_valid = token < end
        token = token.to(tl.int64)
        qk_mask = row_valid[:, None] & k_valid[None, :]
        v_mask = row_valid[:, None] & v_valid[None, :]
        q = tl.load(
            q_ptr + token[:, None] * stride_qt + head * stride_qh + dims_k[None, :] * stride_qk,
            mask=qk_mask,
            other=0.0,
        ).to(tl.float32)
        k = tl.load(
            k_ptr + token[:, None] * stride_kt + head * stride_kh + dims_k[None, :] * stride_kk,
            mask=qk_mask,
            other=0.0,
        ).to(tl.float32)
        v = tl.load(
            v_ptr + token[:, None] * stride_vt + head * stride_vh + dims_v[None, :] * stride_vv,
            mask=v_mask,
            other=0.0,
        ).to(tl.float32)
        g = tl.load(g_ptr + token * stride_gt + head * stride_gh, mask=row_valid, other=0.0)
        beta = tl.load(beta_ptr + token * stride_bt + head * stride_bh, mask=row_valid, other=0.0)
        g = g.to(tl.float32)
        beta = beta.to(tl.float32)

        # Decays inside the chunk. Above the diagonal the difference is positive (and
        # could overflow): select -inf there before exp, never multiply by a mask.
        cum = tl.cumsum(g, 0)
        cum_last = tl.sum(tl.where(rows == CHUNK - 1, cum, 0.0), 0)
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))

        # The UT transform: Tm = (I + A)^-1 with A strictly lower triangular. Row i of Tm
        # is e_i - sum_{j<i} A_ij Tm_j; rows j >= i are still e_j when row i is built,
        # and A_ij = 0 there, so summing over every j is exact.
        kk = tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION)
        a = tl.where(strictly_lower, beta[:, None] * kk * decay, 0.0)
        t_inv = eye
        for i in range(1, CHUNK):
            a_row = tl.sum(tl.where(rows[:, None] == i, a, 0.0), 0)  # A[i, :]
            update = tl.sum(a_row[:, None] * t_inv, 0)  # sum_j A_ij Tm[j, :]
            t_inv = tl.where(rows[:, None] == i, t_inv - update[None, :], t_inv)

        from_start = tl.exp(cum)
        u = tl.dot(t_inv, v * beta[:, None], input_precision=DOT_PRECISION)
        w = tl.dot(t_inv, k * (beta * from_start)[:, None], input_precision=DOT_PRECISION)
        delta = u - tl.dot(w, state, input_precision=DOT_PRECISION)  # [CHUNK, BLOCK_V]

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay
        o = from_start[:, None] * tl.dot(q, state, input_precision=DOT_PRECISION)
        o = scale * (o + tl.dot(scores, delta, input_precision=DOT_PRECISION))
        tl.store(
            out_ptr + token[:, None] * stride_ot + head * stride_oh + dims_v[None, :] * stride_ov,
            o.to(out_ptr.dtype.element_ty),
            mask=v_mask,
        )

        k_to_end = k * tl.exp(cum_last - cum)[:, None]
        state = tl.exp(cum_last) * state + tl.dot(
            tl.trans(k_to_end), delta, input_precision=DOT_PRECISION
        )

    tl.store(state_ptrs, state, mask=state_mask)


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
    q = tl.load(q_ptr + request * stride_qb + head * stride_qh + dims_k * stride_qk, mask=k_valid)
    k = tl.load(k_ptr + request * stride_kb + head * stride_kh + dims_k * stride_kk, mask=k_valid)
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


# ----------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------


def _check_triton_inputs(
    q: object,
    k: object,
    v: object,
    g: object,
    beta: object,
    scale: object,
    states: object,
    *,
    lead: str,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor
]:
    q, k, v, g, beta = _check_gdn_inputs(q, k, v, g, beta, lead=lead)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name}: expected dtype in {_SUPPORTED_DTYPES}, got {t.dtype}")
    key_dim = k.shape[2]
    if not 1 <= key_dim <= _MAX_KEY_DIM:
        raise ValueError(f"k: expected key dim K in [1, {_MAX_KEY_DIM}], got {key_dim}")
    if v.shape[2] < 1:
        raise ValueError(f"v: expected value dim V >= 1, got {v.shape[2]}")
    return q, k, v, g, beta, check_scale(scale), check_states(states, k, v)


def _blocks(key_dim: int, value_dim: int) -> tuple[int, int]:
    """``(KEY_PAD, BLOCK_V)``: powers of two, at least 16 (tl.dot's minimum extent).

    The ``[KEY_PAD, BLOCK_V]`` float32 state slice stays in registers for a whole
    request: at most 64 columns, and at most 8192 elements (32 KiB; 128 x 64, 256 x 32).
    """
    key_pad = max(_MIN_DOT_DIM, triton.next_power_of_2(key_dim))
    block_v = min(max(_MIN_DOT_DIM, triton.next_power_of_2(value_dim)), 64, 8192 // key_pad)
    return key_pad, block_v


def chunk_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    query_start_loc: torch.Tensor,
    states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int = 64,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked gated delta rule over a varlen batch, reading/writing cached states.

    Same contract as the torch oracle of the same name, except that ``chunk_size`` must
    be 16, 32 or 64 and the index tensors' values are trusted (not read back). Returns
    ``out`` (allocated when None); rows past ``query_start_loc[-1]`` are left untouched.
    ``out`` must not be ``q``, ``k``, ``v`` or ``states`` (programs of other value
    blocks still read the inputs).
    """
    q, k, v, g, beta, scale, states = _check_triton_inputs(
        q, k, v, g, beta, scale, states, lead="T"
    )
    chunk_size = _check_chunk_size(chunk_size, _SUPPORTED_CHUNK_SIZES)
    qsl, slots, flags = check_varlen_tensors(
        query_start_loc, state_indices, has_initial_state, device=q.device
    )
    batch = qsl.numel() - 1
    check_has_slots("states", states, batch)
    out = _alloc_out(out, v, "T")
    check_distinct_output("out", out, {"q": q, "k": k, "v": v, "states": states})
    if batch == 0:
        return out

    key_dim, value_dim = k.shape[2], v.shape[2]
    key_pad, block_v = _blocks(key_dim, value_dim)
    grid = (batch, k.shape[1], triton.cdiv(value_dim, block_v))
    _chunk_gated_delta_kernel[grid](
        q_ptr=q,
        k_ptr=k,
        v_ptr=v,
        g_ptr=g,
        beta_ptr=beta,
        out_ptr=out,
        states_ptr=states,
        query_start_loc_ptr=qsl,
        state_indices_ptr=slots,
        has_initial_state_ptr=flags_as_bytes(flags),
        scale=scale,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_qk=q.stride(2),
        stride_kt=k.stride(0),
        stride_kh=k.stride(1),
        stride_kk=k.stride(2),
        stride_vt=v.stride(0),
        stride_vh=v.stride(1),
        stride_vv=v.stride(2),
        stride_gt=g.stride(0),
        stride_gh=g.stride(1),
        stride_bt=beta.stride(0),
        stride_bh=beta.stride(1),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_ov=out.stride(2),
        stride_ss=states.stride(0),
        stride_sh=states.stride(1),
        stride_sk=states.stride(2),
        stride_sv=states.stride(3),
        stride_qsl=qsl.stride(0),
        stride_si=slots.stride(0),
        stride_his=flags.stride(0),
        KEY_DIM=key_dim,
        VALUE_DIM=value_dim,
        KEY_PAD=key_pad,
        BLOCK_V=block_v,
        CHUNK=chunk_size,
        # fp32 operands would otherwise default to TF32 on NVIDIA (see the module doc).
        DOT_PRECISION="ieee",
        num_warps=8 if key_pad * block_v >= 8192 else 4,
        # Explicit, not Triton's default: Triton 3.9 warns when the option is left unset
        # (its default flips in 3.10), and the test suite turns warnings into errors.
        enable_fp_fusion=True,
    )
    return out


def fused_recurrent_gated_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    states: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step for ``B`` requests, each continuing from its cache slot.

    Same contract as the torch oracle of the same name, except that ``state_indices``'
    values are trusted (not read back). Returns ``out`` (allocated when None), which
    must not be ``q``, ``k``, ``v`` or ``states``.
    """
    q, k, v, g, beta, scale, states = _check_triton_inputs(
        q, k, v, g, beta, scale, states, lead="B"
    )
    batch = q.shape[0]
    slots = check_slot_tensor(state_indices, batch=batch, device=q.device)
    check_has_slots("states", states, batch)
    out = _alloc_out(out, v, "B")
    check_distinct_output("out", out, {"q": q, "k": k, "v": v, "states": states})
    if batch == 0:
        return out

    key_dim, value_dim = k.shape[2], v.shape[2]
    key_pad, block_v = _blocks(key_dim, value_dim)
    grid = (batch, k.shape[1], triton.cdiv(value_dim, block_v))
    _recurrent_update_kernel[grid](
        q_ptr=q,
        k_ptr=k,
        v_ptr=v,
        g_ptr=g,
        beta_ptr=beta,
        out_ptr=out,
        states_ptr=states,
        state_indices_ptr=slots,
        scale=scale,
        stride_qb=q.stride(0),
        stride_qh=q.stride(1),
        stride_qk=q.stride(2),
        stride_kb=k.stride(0),
        stride_kh=k.stride(1),
        stride_kk=k.stride(2),
        stride_vb=v.stride(0),
        stride_vh=v.stride(1),
        stride_vv=v.stride(2),
        stride_gb=g.stride(0),
        stride_gh=g.stride(1),
        stride_bb=beta.stride(0),
        stride_bh=beta.stride(1),
        stride_ob=out.stride(0),
        stride_oh=out.stride(1),
        stride_ov=out.stride(2),
        stride_ss=states.stride(0),
        stride_sh=states.stride(1),
        stride_sk=states.stride(2),
        stride_sv=states.stride(3),
        stride_si=slots.stride(0),
        KEY_DIM=key_dim,
        VALUE_DIM=value_dim,
        KEY_PAD=key_pad,
        BLOCK_V=block_v,
        num_warps=8 if key_pad * block_v >= 8192 else 4,
        enable_fp_fusion=True,
    )
    return out
