"""LFM2-style gated short convolution with per-request state in a cache (Triton).

Semantics, shapes and cache conventions are those of the torch oracle
:mod:`attnkit.kernels.short_conv.reference` (read its module docstring)::

    Bx = b * x;    y = c * (bias + causal_depthwise_conv(Bx))

with ``conv_states`` ``[S, C, W-1]`` (dtype of ``x``, any strides) holding the last
``W-1`` values of ``Bx`` per slot, oldest first. Both gates are fused into the
convolution: ``Bx`` is formed on the fly (rounded to the dtype of ``x``, exactly what
the oracle convolves and stores), the window sum accumulates in float32 and the output
gate is applied before the single rounding to the output dtype.

Kernel design
-------------
:func:`short_conv_varlen` launches one program per (request, tile of ``BLOCK_CH``
channels). The program walks its request in tiles of ``BLOCK_T`` tokens; for each of
the ``W`` taps it loads the tile's inputs shifted by the tap (from ``b``/``x`` for
positions inside the request, from the slot for the ``W-1`` positions before it, or
zeros without an initial state). Only after the last tile does it write the slot's new
content -- the last ``W-1`` entries of ``[old state, Bx]`` -- so every read of the old
state happens first; a barrier separates those reads from the write because a request
shorter than ``W-1`` tokens moves old entries within the slot. Tiles of one request are
not spread over programs (the launcher knows no request lengths: it never reads
``query_start_loc`` back), so the parallelism of a long prefill is ``C / BLOCK_CH``
programs per request.
The taps are a loop rather than unrolled (unrolled, the loads of every tap are issued
up front and registers grow with ``W``: 217-244 at ``W = 3, 4`` with 4 warps), and the
``[BLOCK_T, BLOCK_CH]`` tile is spread over 8 warps: about 100-112 registers.

:func:`short_conv_update` launches one program per (request, channel tile): it loads
the ``W-1`` stored values and the new ``Bx``, writes ``y`` and shifts the slot by one.

The launchers check shapes, dtypes and devices only and never read tensor values back
to the host: ``query_start_loc`` (starts at 0, ends at ``T``, non-decreasing) and
``state_indices`` (distinct, in ``[0, S)``) are trusted; the torch oracle checks them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.kernels._checks import (
    check_distinct_output,
    check_dtype,
    check_has_slots,
    check_slot_tensor,
    check_varlen_tensors,
)
from attnkit.kernels._triton.interpret import INTERPRETED
from attnkit.kernels._triton.rounding import round_bf16
from attnkit.kernels._triton.varlen import flags_as_bytes
from attnkit.kernels.conv1d.contract import check_conv_params
from attnkit.kernels.short_conv.contract import check_gates, check_out

__all__ = ["short_conv_update", "short_conv_varlen"]

# Every tap is unrolled into the kernel; LFM2 uses W = 3.
_MAX_WIDTH = 32
_BLOCK_T = 32
_BLOCK_CH_VARLEN = 64
# Warps of _short_conv_varlen_kernel: 8 elements of the [BLOCK_T, BLOCK_CH] tile each.
_VARLEN_WARPS = 8
_BLOCK_CH_UPDATE = 256


@triton.jit
def _short_conv_varlen_kernel(
    b_ptr,
    c_ptr,
    x_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    states_ptr,
    query_start_loc_ptr,
    state_indices_ptr,
    has_initial_state_ptr,
    stride_bt,
    stride_bc,
    stride_ct,
    stride_cc,
    stride_xt,
    stride_xc,
    stride_wc,
    stride_wk,
    stride_bias,
    stride_ot,
    stride_oc,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_qsl,
    stride_si,
    stride_his,
    CHANNELS: tl.constexpr,
    WIDTH: tl.constexpr,
    STATE_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_CH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EXACT_BF16: tl.constexpr,
):
    tl.static_assert(STATE_PAD >= WIDTH - 1)
    request = tl.program_id(0)
    ch_tile = tl.program_id(1)

    start = tl.load(query_start_loc_ptr + request * stride_qsl)
    length = tl.load(query_start_loc_ptr + (request + 1) * stride_qsl) - start
    # int64 before multiplying by strides: S * C * (W-1) or T * C may exceed 2**31.
    slot = tl.load(state_indices_ptr + request * stride_si).to(tl.int64)
    has_init = tl.load(has_initial_state_ptr + request * stride_his) != 0
    # How many positions before the request's first token come from the slot: all W-1
    # with an initial state, none without (they are zeros and the slot is not read).
    history = tl.where(has_init, WIDTH - 1, 0)

    offs_ch = ch_tile * BLOCK_CH + tl.arange(0, BLOCK_CH)
    ch_valid = offs_ch < CHANNELS
    slot_ptr = states_ptr + slot * stride_ss + offs_ch[None, :] * stride_sc
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_ch * stride_bias, mask=ch_valid, other=0.0).to(tl.float32)

    rows = tl.arange(0, BLOCK_T)
    for t0 in range(0, length, BLOCK_T):
        t = t0 + rows  # positions within the request
        t_valid = t < length
        acc = tl.zeros([BLOCK_T, BLOCK_CH], dtype=tl.float32)
        for tap in range(WIDTH):  # a loop on purpose: see the module doc
            p = t - (WIDTH - 1) + tap  # position of the input this tap reads
            tok = (start + p).to(tl.int64)
            in_mask = ((p >= 0) & t_valid)[:, None] & ch_valid[None, :]
            bv = tl.load(
                b_ptr + tok[:, None] * stride_bt + offs_ch[None, :] * stride_bc,
                mask=in_mask,
                other=0.0,
            )
            xv = tl.load(
                x_ptr + tok[:, None] * stride_xt + offs_ch[None, :] * stride_xc,
                mask=in_mask,
                other=0.0,
            )
            bx = round_bf16(bv.to(tl.float32) * xv.to(tl.float32), EXACT_BF16)
            bx = bx.to(x_ptr.dtype.element_ty)
            hist_mask = ((p < 0) & (p >= -history) & t_valid)[:, None] & ch_valid[None, :]
            hv = tl.load(slot_ptr + (WIDTH - 1 + p)[:, None] * stride_sk, mask=hist_mask, other=0.0)
            # The two masks are disjoint, so one of the two terms is exactly 0.
            u = bx.to(tl.float32) + hv.to(tl.float32)
            w = tl.load(
                weight_ptr + offs_ch * stride_wc + tap * stride_wk, mask=ch_valid, other=0.0
            )
            acc += u * w.to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += bias[None, :]
        tok = (start + t).to(tl.int64)
        io_mask = t_valid[:, None] & ch_valid[None, :]
        cv = tl.load(
            c_ptr + tok[:, None] * stride_ct + offs_ch[None, :] * stride_cc,
            mask=io_mask,
            other=0.0,
        )
        tl.store(
            out_ptr + tok[:, None] * stride_ot + offs_ch[None, :] * stride_oc,
            round_bf16(cv.to(tl.float32) * acc, EXACT_BF16).to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )

    if WIDTH > 1:
        # New content: entry j is stream position p = length - (W-1) + j, taken from the
        # new tokens (p >= 0) or from the old slot (p < 0; zeros without initial state).
        j = tl.arange(0, STATE_PAD)
        j_valid = j < WIDTH - 1
        p = length - (WIDTH - 1) + j
        tok = (start + p).to(tl.int64)
        in_mask = ((p >= 0) & j_valid)[:, None] & ch_valid[None, :]
        bv = tl.load(
            b_ptr + tok[:, None] * stride_bt + offs_ch[None, :] * stride_bc, mask=in_mask, other=0.0
        )
        xv = tl.load(
            x_ptr + tok[:, None] * stride_xt + offs_ch[None, :] * stride_xc, mask=in_mask, other=0.0
        )
        bx = round_bf16(bv.to(tl.float32) * xv.to(tl.float32), EXACT_BF16)
        bx = bx.to(states_ptr.dtype.element_ty)
        hist_mask = ((p < 0) & (p >= -history) & j_valid)[:, None] & ch_valid[None, :]
        hv = tl.load(slot_ptr + (WIDTH - 1 + p)[:, None] * stride_sk, mask=hist_mask, other=0.0)
        new = tl.where(in_mask, bx, hv)
        # Every thread of the program has finished reading the old slot before any
        # thread overwrites it (entries move within the slot for short requests).
        tl.debug_barrier()
        tl.store(slot_ptr + j[:, None] * stride_sk, new, mask=j_valid[:, None] & ch_valid[None, :])


@triton.jit
def _short_conv_update_kernel(
    b_ptr,
    c_ptr,
    x_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    states_ptr,
    state_indices_ptr,
    stride_bb,
    stride_bc,
    stride_cb,
    stride_cc,
    stride_xb,
    stride_xc,
    stride_wc,
    stride_wk,
    stride_bias,
    stride_ob,
    stride_oc,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_si,
    CHANNELS: tl.constexpr,
    WIDTH: tl.constexpr,
    STATE_PAD: tl.constexpr,
    BLOCK_CH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EXACT_BF16: tl.constexpr,
):
    tl.static_assert(STATE_PAD >= WIDTH - 1)
    request = tl.program_id(0).to(tl.int64)
    ch_tile = tl.program_id(1)
    offs_ch = ch_tile * BLOCK_CH + tl.arange(0, BLOCK_CH)
    ch_valid = offs_ch < CHANNELS

    bv = tl.load(b_ptr + request * stride_bb + offs_ch * stride_bc, mask=ch_valid, other=0.0)
    xv = tl.load(x_ptr + request * stride_xb + offs_ch * stride_xc, mask=ch_valid, other=0.0)
    bx = round_bf16(bv.to(tl.float32) * xv.to(tl.float32), EXACT_BF16)
    bx = bx.to(x_ptr.dtype.element_ty)
    w_last = tl.load(
        weight_ptr + offs_ch * stride_wc + (WIDTH - 1) * stride_wk, mask=ch_valid, other=0.0
    )
    acc = bx.to(tl.float32) * w_last.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_ch * stride_bias, mask=ch_valid, other=0.0).to(tl.float32)

    if WIDTH > 1:
        slot = tl.load(state_indices_ptr + request * stride_si).to(tl.int64)
        slot_ptr = states_ptr + slot * stride_ss + offs_ch[None, :] * stride_sc
        j = tl.arange(0, STATE_PAD)
        j_valid = j < WIDTH - 1
        mask = j_valid[:, None] & ch_valid[None, :]
        old = tl.load(slot_ptr + j[:, None] * stride_sk, mask=mask, other=0.0)
        w_hist = tl.load(
            weight_ptr + offs_ch[None, :] * stride_wc + j[:, None] * stride_wk,
            mask=mask,
            other=0.0,
        )
        acc += tl.sum(old.to(tl.float32) * w_hist.to(tl.float32), axis=0)
        # Shift by one: entry j takes entry j+1; the newest entry (j = W-2) is Bx.
        shifted = tl.load(
            slot_ptr + (j + 1)[:, None] * stride_sk,
            mask=(j + 1 < WIDTH - 1)[:, None] & ch_valid[None, :],
            other=0.0,
        )
        new = tl.where((j == WIDTH - 2)[:, None], bx[None, :], shifted)
        # All reads of the old slot complete before any thread overwrites it.
        tl.debug_barrier()
        tl.store(slot_ptr + j[:, None] * stride_sk, new, mask=mask)

    cv = tl.load(c_ptr + request * stride_cb + offs_ch * stride_cc, mask=ch_valid, other=0.0)
    tl.store(
        out_ptr + request * stride_ob + offs_ch * stride_oc,
        round_bf16(cv.to(tl.float32) * acc, EXACT_BF16).to(out_ptr.dtype.element_ty),
        mask=ch_valid,
    )


def _check_all(
    b: object,
    c: object,
    x: object,
    weight: object,
    bias: object,
    conv_states: object,
    out: object,
    *,
    lead: str,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor | None,
    torch.Tensor,
    torch.Tensor,
]:
    b, c, x = check_gates(b, c, x, lead=lead)
    check_dtype("x", x)
    weight, bias, conv_states = check_conv_params(x, weight, bias, conv_states, None)
    if weight.shape[1] > _MAX_WIDTH:
        raise ValueError(
            f"weight: expected kernel width W <= {_MAX_WIDTH}, got shape {list(weight.shape)}"
        )
    out = check_out(out, x, lead=lead) if out is not None else torch.empty_like(x)
    return b, c, x, weight, bias, conv_states, out


def _state_pad(width: int) -> int:
    return max(1, triton.next_power_of_2(width - 1)) if width > 1 else 1


def short_conv_varlen(
    b: torch.Tensor,
    c: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated short conv over a varlen batch, reading and writing cached states.

    Same contract as the torch oracle of the same name, except that nothing is read
    back to the host (``query_start_loc`` and ``state_indices`` are trusted). ``b``,
    ``c``, ``x`` are float32, float16 or bfloat16; ``W <= 32``. Any strides everywhere;
    ``out`` must not be ``b``, ``c``, ``x`` or ``conv_states`` (the kernel reads earlier
    tokens' inputs after writing their outputs), and ``conv_states`` needs a slot
    (``S >= 1``) when there are requests.
    """
    b, c, x, weight, bias, conv_states, y = _check_all(
        b, c, x, weight, bias, conv_states, out, lead="T"
    )
    qsl, si, his = check_varlen_tensors(
        query_start_loc, state_indices, has_initial_state, device=x.device
    )
    batch = qsl.shape[0] - 1
    check_has_slots("conv_states", conv_states, batch)
    # The kernel reads earlier tokens' inputs after it has written their outputs.
    check_distinct_output("out", y, {"b": b, "c": c, "x": x, "conv_states": conv_states})
    channels = x.shape[1]
    width = weight.shape[1]
    if batch == 0 or channels == 0:
        return y
    block_ch = min(_BLOCK_CH_VARLEN, triton.next_power_of_2(channels))
    grid = (batch, triton.cdiv(channels, block_ch))
    _short_conv_varlen_kernel[grid](
        b_ptr=b,
        c_ptr=c,
        x_ptr=x,
        weight_ptr=weight,
        bias_ptr=bias,
        out_ptr=y,
        # With W = 1 the state is empty (maybe without storage); the kernel never
        # touches it then, so any tensor of the right dtype stands in.
        states_ptr=conv_states if width > 1 else x,
        query_start_loc_ptr=qsl,
        state_indices_ptr=si,
        has_initial_state_ptr=flags_as_bytes(his),
        stride_bt=b.stride(0),
        stride_bc=b.stride(1),
        stride_ct=c.stride(0),
        stride_cc=c.stride(1),
        stride_xt=x.stride(0),
        stride_xc=x.stride(1),
        stride_wc=weight.stride(0),
        stride_wk=weight.stride(1),
        stride_bias=bias.stride(0) if bias is not None else 0,
        stride_ot=y.stride(0),
        stride_oc=y.stride(1),
        stride_ss=conv_states.stride(0),
        stride_sc=conv_states.stride(1),
        stride_sk=conv_states.stride(2),
        stride_qsl=qsl.stride(0),
        stride_si=si.stride(0),
        stride_his=his.stride(0),
        CHANNELS=channels,
        WIDTH=width,
        STATE_PAD=_state_pad(width),
        BLOCK_T=_BLOCK_T,
        BLOCK_CH=block_ch,
        HAS_BIAS=bias is not None,
        EXACT_BF16=INTERPRETED and x.dtype == torch.bfloat16,
        num_warps=_VARLEN_WARPS,
        # Explicit, not Triton's default: Triton 3.9 warns when the option is left unset.
        enable_fp_fusion=True,
    )
    return y


def short_conv_update(
    b: torch.Tensor,
    c: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step: one new token per request, states shifted in place.

    Same contract as the torch oracle of the same name; ``state_indices`` (distinct, in
    ``[0, S)``) is trusted, not read back.
    """
    b, c, x, weight, bias, conv_states, y = _check_all(
        b, c, x, weight, bias, conv_states, out, lead="B"
    )
    batch, channels = x.shape
    si = check_slot_tensor(state_indices, batch=batch, device=x.device)
    check_has_slots("conv_states", conv_states, batch)
    width = weight.shape[1]
    if batch == 0 or channels == 0:
        return y
    block_ch = min(_BLOCK_CH_UPDATE, triton.next_power_of_2(channels))
    grid = (batch, triton.cdiv(channels, block_ch))
    _short_conv_update_kernel[grid](
        b_ptr=b,
        c_ptr=c,
        x_ptr=x,
        weight_ptr=weight,
        bias_ptr=bias,
        out_ptr=y,
        states_ptr=conv_states if width > 1 else x,
        state_indices_ptr=si,
        stride_bb=b.stride(0),
        stride_bc=b.stride(1),
        stride_cb=c.stride(0),
        stride_cc=c.stride(1),
        stride_xb=x.stride(0),
        stride_xc=x.stride(1),
        stride_wc=weight.stride(0),
        stride_wk=weight.stride(1),
        stride_bias=bias.stride(0) if bias is not None else 0,
        stride_ob=y.stride(0),
        stride_oc=y.stride(1),
        stride_ss=conv_states.stride(0),
        stride_sc=conv_states.stride(1),
        stride_sk=conv_states.stride(2),
        stride_si=si.stride(0),
        CHANNELS=channels,
        WIDTH=width,
        STATE_PAD=_state_pad(width),
        BLOCK_CH=block_ch,
        HAS_BIAS=bias is not None,
        EXACT_BF16=INTERPRETED and x.dtype == torch.bfloat16,
        num_warps=4,
        enable_fp_fusion=True,
    )
    return y
