"""Mamba (1) selective-scan kernels with per-request cached states (Triton).

Same semantics, signatures and cache conventions as the torch oracle
:mod:`attnkit.kernels.mamba1.reference` (read its module docstring first), plus an optional
``out=`` tensor. The math is the selective state-space model of A. Gu and T. Dao,
"Mamba: Linear-Time Sequence Modeling with Selective State Spaces", arXiv:2312.00752
(Algorithm 2)::

    dt'[t, d]  = softplus(dt[t, d] + dt_bias[d])   (or without softplus / bias)
    h_t[d, n]  = exp(dt'[t, d] A[d, n]) h_{t-1}[d, n] + dt'[t, d] B[t, n] x[t, d]
    y[t, d]    = sum_n C[t, n] h_t[d, n] + D[d] x[t, d]

* ``x``, ``dt`` ``[T, D]`` (``[B, D]`` for decode), ``A`` ``[D, N]``, ``B``/``C``
  ``[T, N]``, ``D``/``dt_bias`` ``[D]``: float32, float16 or bfloat16, any strides, read
  as float32; ``y`` has the dtype of ``x``.
* ``ssm_states`` ``[S, D, N]`` float32, any strides, updated in place.
* ``query_start_loc`` int32 ``[B+1]``, ``state_indices`` int32 ``[B]``,
  ``has_initial_state`` bool ``[B]``. The launchers check shapes, dtypes and devices but
  never read device values back to the host, so their values are the caller's
  responsibility. ``out`` must not overlap the inputs or ``ssm_states``.

Decomposition
-------------
Every channel ``d`` has its own ``[N]`` state row and its own ``A`` row, so channels are
independent: :func:`selective_scan_varlen` runs a grid of ``B x cdiv(D, BLOCK_D)``
programs, each holding one request's ``[BLOCK_D, N]`` float32 state tile in registers
and walking that request's tokens in order (the recurrence is sequential in time; a
chunked/parallel scan would trade that for more work and is left for later). Per token
the work is elementwise (a decay, an outer product of ``dt' x`` with ``B``) plus a row
reduction against ``C``. :func:`selective_scan_update` is the same step for one token
per request.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from attnkit.kernels._checks import (
    alloc_out,
    check_bool,
    check_distinct_output,
    check_dtype,
    check_has_slots,
    check_slot_tensor,
    check_varlen_tensors,
)
from attnkit.kernels._triton.activations import softplus
from attnkit.kernels._triton.varlen import flags_as_bytes
from attnkit.kernels.mamba1.contract import check_scan_inputs, check_scan_states

__all__ = ["selective_scan_update", "selective_scan_varlen"]

# No kernel here multiplies matrices: per token the scan is elementwise work on the
# [BLOCK_D, N] state tile plus one row reduction, so nothing could run on tensor cores
# (benchmarks/compile_report.py has no MMA instructions to look for).
TENSOR_CORE_KERNELS: tuple[str, ...] = ()

_MAX_BLOCK_D = 64  # channels per program ...
_MAX_STATE_TILE = 4096  # ... capped so BLOCK_D x N float32 elements stay in registers
# (with the decay tile beside it: 8192 spilled 8-104 B on sm_80-sm_100)


@triton.jit
def _scan_token(
    state,
    a,
    dt_bias,
    skip,
    x_ptr,
    dt_ptr,
    B_ptr,
    C_ptr,
    out_ptr,
    token,
    dims,
    states,
    d_valid,
    n_valid,
    stride_xt,
    stride_xd,
    stride_dtt,
    stride_dtd,
    stride_Bt,
    stride_Bn,
    stride_Ct,
    stride_Cn,
    stride_ot,
    stride_od,
    DT_SOFTPLUS: tl.constexpr,
    HAS_D: tl.constexpr,
):
    """One token of one request for a ``[BLOCK_D, N_PAD]`` state tile; stores ``y``.
    ``token`` is an int64 index (the loop bounds are loaded as int64)."""
    x = tl.load(x_ptr + token * stride_xt + dims * stride_xd, mask=d_valid, other=0.0).to(
        tl.float32
    )
    dt = tl.load(dt_ptr + token * stride_dtt + dims * stride_dtd, mask=d_valid, other=0.0).to(
        tl.float32
    )
    dt = dt + dt_bias
    if DT_SOFTPLUS:
        dt = softplus(dt)
    b = tl.load(B_ptr + token * stride_Bt + states * stride_Bn, mask=n_valid, other=0.0).to(
        tl.float32
    )
    c = tl.load(C_ptr + token * stride_Ct + states * stride_Cn, mask=n_valid, other=0.0).to(
        tl.float32
    )
    state = tl.exp(dt[:, None] * a) * state + (dt * x)[:, None] * b[None, :]
    y = tl.sum(state * c[None, :], axis=1)
    if HAS_D:
        y += skip * x
    tl.store(
        out_ptr + token * stride_ot + dims * stride_od,
        y.to(out_ptr.dtype.element_ty),
        mask=d_valid,
    )
    return state


@triton.jit
def _selective_scan_kernel(
    x_ptr,
    dt_ptr,
    dt_bias_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    ssm_ptr,
    qsl_ptr,
    slot_ptr,
    flag_ptr,
    out_ptr,
    channels,
    state_size,
    stride_xt,
    stride_xd,
    stride_dtt,
    stride_dtd,
    stride_dt_bias,
    stride_Ad,
    stride_An,
    stride_Bt,
    stride_Bn,
    stride_Ct,
    stride_Cn,
    stride_D,
    stride_ss,
    stride_sd,
    stride_sn,
    stride_qsl,
    stride_slot,
    stride_flag,
    stride_ot,
    stride_od,
    VARLEN: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    HAS_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    N_PAD: tl.constexpr,
):
    """Grid ``(B, cdiv(D, BLOCK_D))``. ``VARLEN``: request ``b`` owns tokens
    ``qsl[b]:qsl[b+1]`` and starts from its slot only when its flag is set; otherwise
    (decode) request ``b`` is token ``b`` and always continues from its slot."""
    request = tl.program_id(0)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    states = tl.arange(0, N_PAD)
    d_valid = dims < channels
    n_valid = states < state_size
    mask = d_valid[:, None] & n_valid[None, :]
    slot = tl.load(slot_ptr + request * stride_slot).to(tl.int64)
    ssm_ptrs = ssm_ptr + slot * stride_ss + dims[:, None] * stride_sd + states[None, :] * stride_sn

    a = tl.load(
        A_ptr + dims[:, None] * stride_Ad + states[None, :] * stride_An, mask=mask, other=0.0
    ).to(tl.float32)
    dt_bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + dims * stride_dt_bias, mask=d_valid, other=0.0).to(
            tl.float32
        )
    skip = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_D:
        skip = tl.load(D_ptr + dims * stride_D, mask=d_valid, other=0.0).to(tl.float32)

    if VARLEN:
        start = tl.load(qsl_ptr + request * stride_qsl).to(tl.int64)
        end = tl.load(qsl_ptr + (request + 1) * stride_qsl).to(tl.int64)
        has_init = tl.load(flag_ptr + request * stride_flag) != 0
        state = tl.zeros([BLOCK_D, N_PAD], dtype=tl.float32)
        if has_init:
            state = tl.load(ssm_ptrs, mask=mask, other=0.0)
    else:
        start = request.to(tl.int64)
        end = start + 1
        state = tl.load(ssm_ptrs, mask=mask, other=0.0)

    for token in range(start, end):
        state = _scan_token(
            state,
            a,
            dt_bias,
            skip,
            x_ptr,
            dt_ptr,
            B_ptr,
            C_ptr,
            out_ptr,
            token,
            dims,
            states,
            d_valid,
            n_valid,
            stride_xt,
            stride_xd,
            stride_dtt,
            stride_dtd,
            stride_Bt,
            stride_Bn,
            stride_Ct,
            stride_Cn,
            stride_ot,
            stride_od,
            DT_SOFTPLUS,
            HAS_D,
        )
    tl.store(ssm_ptrs, state, mask=mask)


def _stride(t: Tensor | None, dim: int = 0) -> int:
    return t.stride(dim) if t is not None else 0


def _launch(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    ssm_states: Tensor,
    slots: Tensor,
    result: Tensor,
    *,
    batch: int,
    qsl: Tensor | None,
    flags: Tensor | None,
) -> None:
    channels, state_size = A.shape
    n_pad = triton.next_power_of_2(max(state_size, 1))
    block_d = max(1, min(_MAX_BLOCK_D, triton.next_power_of_2(channels), _MAX_STATE_TILE // n_pad))
    varlen = qsl is not None and flags is not None
    _selective_scan_kernel[(batch, triton.cdiv(channels, block_d))](
        x,
        dt,
        dt_bias,
        A,
        B,
        C,
        D,
        ssm_states,
        qsl if qsl is not None else slots,
        slots,
        flags if flags is not None else slots,
        result,
        channels=channels,
        state_size=state_size,
        stride_xt=x.stride(0),
        stride_xd=x.stride(1),
        stride_dtt=dt.stride(0),
        stride_dtd=dt.stride(1),
        stride_dt_bias=_stride(dt_bias),
        stride_Ad=A.stride(0),
        stride_An=A.stride(1),
        stride_Bt=B.stride(0),
        stride_Bn=B.stride(1),
        stride_Ct=C.stride(0),
        stride_Cn=C.stride(1),
        stride_D=_stride(D),
        stride_ss=ssm_states.stride(0),
        stride_sd=ssm_states.stride(1),
        stride_sn=ssm_states.stride(2),
        stride_qsl=qsl.stride(0) if qsl is not None else 0,
        stride_slot=slots.stride(0),
        stride_flag=flags.stride(0) if flags is not None else 0,
        stride_ot=result.stride(0),
        stride_od=result.stride(1),
        VARLEN=varlen,
        HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=bool(dt_softplus),
        HAS_D=D is not None,
        BLOCK_D=block_d,
        N_PAD=n_pad,
        # 16 state elements per thread for the largest tile, whatever N is.
        num_warps=8 if block_d * n_pad >= 2048 else 4,
    )


def _checked(
    x: object,
    dt: object,
    A: object,
    B: object,
    C: object,
    D: object,
    dt_bias: object,
    ssm_states: object,
    dt_softplus: object,
    lead: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor, bool]:
    xt, dtt, At, Bt, Ct, Dt, bias = check_scan_inputs(x, dt, A, B, C, D, dt_bias, lead=lead)
    for name, t in (
        ("x", xt),
        ("dt", dtt),
        ("A", At),
        ("B", Bt),
        ("C", Ct),
        ("D", Dt),
        ("dt_bias", bias),
    ):
        check_dtype(name, t)
    states = check_scan_states(ssm_states, xt, At.shape[1])
    return xt, dtt, At, Bt, Ct, Dt, bias, states, check_bool("dt_softplus", dt_softplus)


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
    out: Tensor | None = None,
) -> Tensor:
    """The selective scan over a varlen batch, states read and written in the cache.

    Semantics of :func:`attnkit.kernels.mamba1.reference.selective_scan_varlen`; ``out``
    (``[T, D]``, dtype of ``x``, any strides) receives the result when given.
    Returns ``y`` ``[T, D]`` in the dtype of ``x``.
    """
    x, dt, A, B, C, D, dt_bias, ssm_states, dt_softplus = _checked(
        x, dt, A, B, C, D, dt_bias, ssm_states, dt_softplus, "T"
    )
    qsl, slots, flags = check_varlen_tensors(
        query_start_loc, state_indices, has_initial_state, device=x.device, num_tokens=x.shape[0]
    )
    batch = slots.shape[0]
    check_has_slots("ssm_states", ssm_states, batch)
    result = alloc_out(out, x, "[T, D]")
    check_distinct_output("out", result, {"x": x, "dt": dt, "B": B, "C": C})
    if batch == 0 or x.shape[1] == 0:
        return result
    _launch(
        x,
        dt,
        A,
        B,
        C,
        D,
        dt_bias,
        dt_softplus,
        ssm_states,
        slots,
        result,
        batch=batch,
        qsl=qsl,
        flags=flags_as_bytes(flags),
    )
    return result


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
    out: Tensor | None = None,
) -> Tensor:
    """One decode step for ``B`` requests, each continuing from its cache slot.

    Semantics of :func:`attnkit.kernels.mamba1.reference.selective_scan_update`; ``out``
    (``[B, D]``, dtype of ``x``, any strides) receives the result when given.
    Returns ``y`` ``[B, D]`` in the dtype of ``x``.
    """
    x, dt, A, B, C, D, dt_bias, ssm_states, dt_softplus = _checked(
        x, dt, A, B, C, D, dt_bias, ssm_states, dt_softplus, "B"
    )
    batch = x.shape[0]
    slots = check_slot_tensor(state_indices, batch=batch, device=x.device)
    check_has_slots("ssm_states", ssm_states, batch)
    result = alloc_out(out, x, "[B, D]")
    check_distinct_output("out", result, {"x": x, "dt": dt, "B": B, "C": C})
    if batch == 0 or x.shape[1] == 0:
        return result
    _launch(
        x,
        dt,
        A,
        B,
        C,
        D,
        dt_bias,
        dt_softplus,
        ssm_states,
        slots,
        result,
        batch=batch,
        qsl=None,
        flags=None,
    )
    return result
