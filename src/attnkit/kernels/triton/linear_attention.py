"""Linear attention with a constant per-head decay, states in a cache (Triton).

Semantics, shapes and cache conventions are those of the torch oracle
:mod:`attnkit.kernels.torch.linear_attention` (read its module docstring): per head
``h`` with ``lam = exp(-decay[h])``::

    S_t = lam * S_{t-1} + outer(k_t, v_t);    o_t = scale * S_t^T q_t

with float32 states ``[S, H, K, V]`` (any strides) addressed by ``state_indices``.

Kernel design
-------------
:func:`chunk_linear_attention_varlen` launches one program per (request, head, tile of
``BLOCK_V`` value columns): columns of the state are independent, so the ``[K, BLOCK_V]``
slice of the state stays in registers (float32) while the program walks its request's
chunks in order -- the intra/inter-block split of Lightning Attention-2 (Z. Qin et al.,
arXiv:2401.04658). Per chunk of ``n <= chunk_size`` tokens it computes
``(q k^T * M) v`` with the decay mask ``M[i, j] = lam^(i-j)`` (``j <= i``), adds
``lam^(i+1) q S``, stores the outputs and then updates ``S <- lam^n S + (lam^(n-1-j) k)^T v``.
Chunks start at each request's first token of the call, as in the oracle. The chunk is
padded to ``BLOCK_C = max(16, next_pow2(chunk_size))`` rows (masked), so any chunk size
in ``[1, 128]`` works. Long requests are walked sequentially by ``H * cdiv(V, BLOCK_V)``
programs each, as in lightning attention's forward pass.

:func:`linear_attention_decode` launches one program per (request, head, value tile),
loads the state slice, applies one step in registers and writes it back.

The launchers check shapes, dtypes and devices only: they never read tensor values back
to the host (so they are safe under CUDA graphs). ``query_start_loc``,
``state_indices`` and ``decay >= 0`` are therefore trusted; the torch oracle checks them.

Precision: everything is computed in float32. With float32 inputs every dot uses IEEE
float32; with 16-bit inputs the two output dots may use TF32 (their inputs already carry
8 or 11 significant bits), while the state update always uses IEEE float32 because the
state accumulates over the whole sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from attnkit.kernels._checks import check_distinct_output, check_has_slots
from attnkit.kernels._state_common import (
    check_scale,
    check_slot_tensor,
    check_states,
    check_varlen_tensors,
    flags_as_bytes,
)
from attnkit.kernels.torch.linear_attention import (
    _alloc_out,
    _check_chunk_size,
    _check_decay_shape,
    _check_qkv,
)
from attnkit.kernels.triton.short_conv import _round_bf16

__all__ = ["chunk_linear_attention_varlen", "linear_attention_decode"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_KEY_DIM = 256
_MAX_CHUNK_SIZE = 128


@triton.jit
def _chunk_linear_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    decay_ptr,
    o_ptr,
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
    stride_ot,
    stride_oh,
    stride_ov,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_sv,
    stride_decay,
    stride_qsl,
    stride_si,
    stride_his,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OUT_PRECISION: tl.constexpr,
    EXACT_BF16: tl.constexpr,
):
    tl.static_assert(BLOCK_K >= KEY_DIM)
    tl.static_assert(BLOCK_C >= CHUNK)
    # tl.dot needs every dimension >= 16.
    tl.static_assert(BLOCK_K >= 16)
    tl.static_assert(BLOCK_V >= 16)
    tl.static_assert(BLOCK_C >= 16)

    request = tl.program_id(0)
    head = tl.program_id(1)
    v_tile = tl.program_id(2)

    start = tl.load(query_start_loc_ptr + request * stride_qsl)
    end = tl.load(query_start_loc_ptr + (request + 1) * stride_qsl)
    # int64 before multiplying by strides: S * H * K * V may exceed 2**31 elements.
    slot = tl.load(state_indices_ptr + request * stride_si).to(tl.int64)
    has_init = tl.load(has_initial_state_ptr + request * stride_his) != 0
    neg_decay = -tl.load(decay_ptr + head * stride_decay).to(tl.float32)

    offs_k = tl.arange(0, BLOCK_K)
    offs_v = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    k_valid = offs_k < KEY_DIM
    v_valid = offs_v < VALUE_DIM
    state_mask = k_valid[:, None] & v_valid[None, :]
    state_ptrs = (
        states_ptr
        + slot * stride_ss
        + head * stride_sh
        + offs_k[:, None] * stride_sk
        + offs_v[None, :] * stride_sv
    )
    # Without an initial state the slot is not read at all: it may hold anything (NaN).
    # (The flag enters the mask as a row bound: the interpreter rejects a mask made by
    # and-ing a tensor with a scalar flag.)
    init_rows = tl.where(has_init, KEY_DIM, 0)
    init_mask = (offs_k < init_rows)[:, None] & v_valid[None, :]
    state = tl.load(state_ptrs, mask=init_mask, other=0.0)

    rows = tl.arange(0, BLOCK_C)
    pos = rows.to(tl.float32)
    diff = pos[:, None] - pos[None, :]  # i - j
    # lam^(i-j) for j <= i, else 0; each power is one exp. Selected, never multiplied,
    # so the (clamped) upper triangle never matters.
    intra = tl.where(diff >= 0, tl.exp(neg_decay * tl.maximum(diff, 0.0)), 0.0)
    decay_in = tl.exp(neg_decay * (pos + 1.0))  # lam^(i+1)

    for c0 in range(start, end, CHUNK):
        n = tl.minimum(end - c0, CHUNK)
        row_valid = rows < n
        tok = (c0 + rows).to(tl.int64)
        qk_mask = row_valid[:, None] & k_valid[None, :]
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + head * stride_qh + offs_k[None, :] * stride_qk,
            mask=qk_mask,
            other=0.0,
        ).to(tl.float32)
        k = tl.load(
            k_ptr + tok[:, None] * stride_kt + head * stride_kh + offs_k[None, :] * stride_kk,
            mask=qk_mask,
            other=0.0,
        ).to(tl.float32)
        v_mask = row_valid[:, None] & v_valid[None, :]
        v = tl.load(
            v_ptr + tok[:, None] * stride_vt + head * stride_vh + offs_v[None, :] * stride_vv,
            mask=v_mask,
            other=0.0,
        ).to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision=OUT_PRECISION) * intra
        o = tl.dot(scores, v, input_precision=OUT_PRECISION)
        o += tl.dot(q, state, input_precision=OUT_PRECISION) * decay_in[:, None]
        tl.store(
            o_ptr + tok[:, None] * stride_ot + head * stride_oh + offs_v[None, :] * stride_ov,
            _round_bf16(o * scale, EXACT_BF16).to(o_ptr.dtype.element_ty),
            mask=v_mask,
        )

        # lam^(n-1-j) for the chunk's tokens; padding rows get 0, not exp(+large).
        decay_out = tl.where(row_valid, tl.exp(neg_decay * (n - 1 - rows).to(tl.float32)), 0.0)
        k_dec = k * decay_out[:, None]
        state = state * tl.exp(neg_decay * n.to(tl.float32)) + tl.dot(
            tl.trans(k_dec), v, input_precision="ieee"
        )

    tl.store(state_ptrs, state, mask=state_mask)


@triton.jit
def _linear_attention_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    decay_ptr,
    o_ptr,
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
    stride_ob,
    stride_oh,
    stride_ov,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_sv,
    stride_decay,
    stride_si,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    EXACT_BF16: tl.constexpr,
):
    request = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    v_tile = tl.program_id(2)

    slot = tl.load(state_indices_ptr + request * stride_si).to(tl.int64)
    lam = tl.exp(-tl.load(decay_ptr + head * stride_decay).to(tl.float32))

    offs_k = tl.arange(0, BLOCK_K)
    offs_v = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    k_valid = offs_k < KEY_DIM
    v_valid = offs_v < VALUE_DIM
    q = tl.load(
        q_ptr + request * stride_qb + head * stride_qh + offs_k * stride_qk, mask=k_valid, other=0.0
    ).to(tl.float32)
    k = tl.load(
        k_ptr + request * stride_kb + head * stride_kh + offs_k * stride_kk, mask=k_valid, other=0.0
    ).to(tl.float32)
    v = tl.load(
        v_ptr + request * stride_vb + head * stride_vh + offs_v * stride_vv, mask=v_valid, other=0.0
    ).to(tl.float32)

    state_mask = k_valid[:, None] & v_valid[None, :]
    state_ptrs = (
        states_ptr
        + slot * stride_ss
        + head * stride_sh
        + offs_k[:, None] * stride_sk
        + offs_v[None, :] * stride_sv
    )
    state = tl.load(state_ptrs, mask=state_mask, other=0.0)
    state = lam * state + k[:, None] * v[None, :]
    tl.store(state_ptrs, state, mask=state_mask)
    o = tl.sum(state * q[:, None], axis=0) * scale
    tl.store(
        o_ptr + request * stride_ob + head * stride_oh + offs_v * stride_ov,
        _round_bf16(o, EXACT_BF16).to(o_ptr.dtype.element_ty),
        mask=v_valid,
    )


# Under the interpreter bfloat16 outputs are rounded by hand (see _round_bf16).
_INTERPRETED = isinstance(_chunk_linear_attention_kernel, InterpretedFunction)


def _check_common(
    q: object, k: object, v: object, decay: object, scale: object, states: object, *, lead: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor]:
    q, k, v = _check_qkv(q, k, v, lead=lead)
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q: expected dtype in {_SUPPORTED_DTYPES}, got {q.dtype}")
    if q.shape[2] > _MAX_KEY_DIM:
        raise ValueError(f"q: expected head dim K <= {_MAX_KEY_DIM}, got {q.shape[2]}")
    decay = _check_decay_shape(decay, q)
    return q, k, v, decay, check_scale(scale), check_states(states, q, v)


def _blocks(key_dim: int, value_dim: int) -> tuple[int, int]:
    block_k = max(16, triton.next_power_of_2(key_dim))
    # The [BLOCK_K, BLOCK_V] float32 state slice lives in registers: narrower value
    # tiles for wide keys.
    block_v = max(16, min(triton.next_power_of_2(value_dim), 64 if block_k <= 128 else 32))
    return block_k, block_v


def chunk_linear_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    *,
    scale: float,
    query_start_loc: torch.Tensor,
    states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int = 64,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked linear attention over a varlen batch, reading/writing cached states.

    Same contract as the torch oracle of the same name, except that nothing is read
    back to the host: ``query_start_loc`` must be valid (starts at 0, ends at ``T``,
    non-decreasing), ``state_indices`` distinct and in ``[0, S)``, ``decay >= 0``.
    ``q``/``k``/``v`` are float32, float16 or bfloat16 with ``K <= 256``;
    ``chunk_size`` is in ``[1, 128]``. Any strides everywhere; ``out`` must not be
    ``q``, ``k``, ``v`` or ``states``.
    """
    q, k, v, decay, scale, states = _check_common(q, k, v, decay, scale, states, lead="T")
    chunk_size = _check_chunk_size(chunk_size, maximum=_MAX_CHUNK_SIZE)
    qsl, si, his = check_varlen_tensors(
        query_start_loc, state_indices, has_initial_state, device=q.device
    )
    batch = qsl.shape[0] - 1
    check_has_slots("states", states, batch)
    o = _alloc_out(out, q, v, lead="T")
    check_distinct_output("out", o, {"q": q, "k": k, "v": v, "states": states})

    _, heads, key_dim = q.shape
    value_dim = v.shape[2]
    if batch == 0 or heads == 0:
        return o
    block_k, block_v = _blocks(key_dim, value_dim)
    grid = (batch, heads, triton.cdiv(value_dim, block_v))
    _chunk_linear_attention_kernel[grid](
        q_ptr=q,
        k_ptr=k,
        v_ptr=v,
        decay_ptr=decay,
        o_ptr=o,
        states_ptr=states,
        query_start_loc_ptr=qsl,
        state_indices_ptr=si,
        has_initial_state_ptr=flags_as_bytes(his),
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
        stride_ot=o.stride(0),
        stride_oh=o.stride(1),
        stride_ov=o.stride(2),
        stride_ss=states.stride(0),
        stride_sh=states.stride(1),
        stride_sk=states.stride(2),
        stride_sv=states.stride(3),
        stride_decay=decay.stride(0),
        stride_qsl=qsl.stride(0),
        stride_si=si.stride(0),
        stride_his=his.stride(0),
        KEY_DIM=key_dim,
        VALUE_DIM=value_dim,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        CHUNK=chunk_size,
        BLOCK_C=max(16, triton.next_power_of_2(chunk_size)),
        OUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        EXACT_BF16=_INTERPRETED and q.dtype == torch.bfloat16,
        # q, k ([BLOCK_C, BLOCK_K]) and the state slice sit in registers together.
        num_warps=8 if block_k >= 128 else 4,
        # Explicit, not Triton's default: Triton 3.9 warns when the option is left unset.
        enable_fp_fusion=True,
    )
    return o


def linear_attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    *,
    scale: float,
    states: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step for ``B`` requests, each continuing from its cache slot.

    Same contract as the torch oracle of the same name; ``state_indices`` (distinct, in
    ``[0, S)``) and ``decay >= 0`` are trusted, not read back; ``out`` must not be
    ``q``, ``k``, ``v`` or ``states``.
    """
    q, k, v, decay, scale, states = _check_common(q, k, v, decay, scale, states, lead="B")
    batch, heads, key_dim = q.shape
    si = check_slot_tensor(state_indices, batch=batch, device=q.device)
    check_has_slots("states", states, batch)
    o = _alloc_out(out, q, v, lead="B")
    check_distinct_output("out", o, {"q": q, "k": k, "v": v, "states": states})
    value_dim = v.shape[2]
    if batch == 0 or heads == 0:
        return o
    block_k, block_v = _blocks(key_dim, value_dim)
    grid = (batch, heads, triton.cdiv(value_dim, block_v))
    _linear_attention_decode_kernel[grid](
        q_ptr=q,
        k_ptr=k,
        v_ptr=v,
        decay_ptr=decay,
        o_ptr=o,
        states_ptr=states,
        state_indices_ptr=si,
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
        stride_ob=o.stride(0),
        stride_oh=o.stride(1),
        stride_ov=o.stride(2),
        stride_ss=states.stride(0),
        stride_sh=states.stride(1),
        stride_sk=states.stride(2),
        stride_sv=states.stride(3),
        stride_decay=decay.stride(0),
        stride_si=si.stride(0),
        KEY_DIM=key_dim,
        VALUE_DIM=value_dim,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        EXACT_BF16=_INTERPRETED and q.dtype == torch.bfloat16,
        num_warps=4,
        enable_fp_fusion=True,
    )
    return o
