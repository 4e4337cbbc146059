"""Causal depthwise 1-D convolution with per-request cached states (Triton).

Same semantics, signatures and cache conventions as the torch oracle
:mod:`attnkit.kernels.conv1d.reference` (read its module docstring first), plus an optional
``out=`` tensor:

* ``x``: ``[T, C]`` (varlen) or ``[B, C]`` (decode), any strides; float32, float16 or
  bfloat16. ``weight``: ``[C, W]``; ``bias``: ``[C]`` or None (any of those dtypes, read
  as float32). Accumulation is float32; the output has the dtype of ``x``.
* ``conv_states``: ``[S, C, W-1]``, dtype of ``x``, **any strides** (the runtime hands in
  views into larger pages). Slot ``s`` holds the last ``W-1`` inputs, oldest first.
* ``query_start_loc`` int32 ``[B+1]``, ``state_indices`` int32 ``[B]``,
  ``has_initial_state`` bool ``[B]``.

The launchers check shapes, dtypes and devices, but never read device values back to
the host (no synchronisation, CUDA-graph friendly): the *values* of
``query_start_loc`` (0 first, ``T`` last, non-decreasing) and ``state_indices``
(distinct, in ``[0, S)``) are the caller's responsibility, as in the oracle's contract.
``out`` must not overlap ``x`` or ``conv_states``.

Decomposition
-------------
``causal_conv1d_varlen`` runs two kernels, in stream order:

1. ``_conv1d_varlen_kernel``, grid ``(cdiv(T, BLOCK_T), cdiv(C, BLOCK_C))``: tiles of
   *global* token rows, so no program is wasted on padding whatever the mix of request
   lengths, and the grid needs no host-side maximum length. Each token finds its request
   by a vectorised binary search over ``query_start_loc``; a tile may straddle several
   requests. Tap ``k`` of token ``t`` (``rel = t - start`` within its request) reads
   ``x[t - (W-1) + k]`` when ``rel - (W-1) + k >= 0`` and otherwise entry
   ``rel + k`` of the request's cached state (0 without an initial state).
   The taps are a loop, not unrolled: unrolled, the compiler issues the loads of all
   ``W`` taps (two gathers each) up front, and registers grew with ``W`` (250-254 at
   ``W = 4``, ``BLOCK_T x BLOCK_C = 32 x 128``, 4 warps). Looped, with 8 warps (16 elements
   per thread), the kernel needs about 125 registers whatever ``W``.
2. ``_conv1d_state_kernel``, grid ``(B, cdiv(C, BLOCK_C))``: writes the last ``W-1``
   entries of ``[old state (or zeros), new tokens]`` back into each request's slot. It
   must run after kernel 1, which still reads the old states; within one program every
   load precedes a barrier and every store follows it, since a short request shifts
   its own slot in place.

``causal_conv1d_update`` is one kernel, grid ``(B, cdiv(C, BLOCK_C))``: the window is
the slot's ``W-1`` entries plus the new token; the slot is shifted in place (loads,
barrier, stores).
"""

from __future__ import annotations

from typing import Literal

import triton
import triton.language as tl
from torch import Tensor

from attnkit.kernels._checks import (
    alloc_out,
    check_distinct_output,
    check_dtype,
    check_has_slots,
    check_slot_tensor,
    check_tensor,
    check_varlen_tensors,
)
from attnkit.kernels._triton.varlen import find_segment, search_iters
from attnkit.kernels.conv1d.contract import check_conv_params

__all__ = ["causal_conv1d_update", "causal_conv1d_varlen"]

_MAX_BLOCK_T = 32
_MAX_BLOCK_C = 128
# Warps of _conv1d_varlen_kernel: 16 elements of the [BLOCK_T, BLOCK_C] tile per thread.
_VARLEN_WARPS = 8


# ----------------------------------------------------------------------------------
# Device helpers (shared with ``mamba2``)
# ----------------------------------------------------------------------------------


@triton.jit
def _silu(y):
    return y * tl.sigmoid(y)


# ----------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------


@triton.jit
def _conv1d_varlen_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    state_ptr,
    qsl_ptr,
    slot_ptr,
    init_ptr,
    out_ptr,
    num_tokens,
    num_channels,
    num_requests,
    num_search_iters,
    stride_xt,
    stride_xc,
    stride_wc,
    stride_wk,
    stride_bias,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_qsl,
    stride_slot,
    stride_init,
    stride_ot,
    stride_oc,
    WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_valid = tokens < num_tokens
    c_valid = channels < num_channels

    request = find_segment(qsl_ptr, stride_qsl, num_requests, tokens, num_search_iters)
    start = tl.load(qsl_ptr + request * stride_qsl, mask=t_valid, other=0)
    # int64 before multiplying by strides: a slot times a page stride may pass 2**31.
    slot = tl.load(slot_ptr + request * stride_slot, mask=t_valid, other=0).to(tl.int64)
    has_init = tl.load(init_ptr + request * stride_init, mask=t_valid, other=0) != 0
    rel = tokens - start  # position of the token within its request

    state_rows = state_ptr + slot[:, None] * stride_ss + channels[None, :] * stride_sc
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for k in range(WIDTH):  # a loop on purpose: see the module doc
        back = WIDTH - 1 - k  # tap k reads the input `back` tokens earlier
        w_k = tl.load(weight_ptr + channels * stride_wc + k * stride_wk, mask=c_valid, other=0.0)
        in_request = rel >= back
        x_mask = (t_valid & in_request)[:, None] & c_valid[None, :]
        src = (tokens - back).to(tl.int64)
        x_k = tl.load(
            x_ptr + src[:, None] * stride_xt + channels[None, :] * stride_xc,
            mask=x_mask,
            other=0.0,
        )
        # Entry rel + k of the cached state (oldest first) precedes the request's tokens.
        s_mask = (t_valid & ~in_request & has_init)[:, None] & c_valid[None, :]
        s_k = tl.load(state_rows + (rel + k)[:, None] * stride_sk, mask=s_mask, other=0.0)
        u = tl.where(in_request[:, None], x_k, s_k).to(tl.float32)
        acc += w_k.to(tl.float32)[None, :] * u
    if HAS_BIAS:
        bias = tl.load(bias_ptr + channels * stride_bias, mask=c_valid, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if SILU:
        acc = _silu(acc)
    rows = tokens.to(tl.int64)
    tl.store(
        out_ptr + rows[:, None] * stride_ot + channels[None, :] * stride_oc,
        acc.to(out_ptr.dtype.element_ty),
        mask=t_valid[:, None] & c_valid[None, :],
    )


@triton.jit
def _conv1d_state_kernel(
    x_ptr,
    state_ptr,
    qsl_ptr,
    slot_ptr,
    init_ptr,
    num_channels,
    stride_xt,
    stride_xc,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_qsl,
    stride_slot,
    stride_init,
    WIDTH: tl.constexpr,
    STATE_PAD: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    request = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_valid = channels < num_channels
    start = tl.load(qsl_ptr + request * stride_qsl)
    length = tl.load(qsl_ptr + (request + 1) * stride_qsl) - start
    slot = tl.load(slot_ptr + request * stride_slot).to(tl.int64)
    # Entries of the old state that are read: W-1 with an initial state, else none (a
    # count rather than a scalar bool, which the interpreter mishandles in masks).
    init_len = (WIDTH - 1) * tl.load(init_ptr + request * stride_init).to(tl.int32)

    # New entry j is entry i = length + j of the stream [old state (W-1), tokens (length)].
    j = tl.arange(0, STATE_PAD)
    j_valid = j < WIDTH - 1
    i = length + j
    from_state = i < WIDTH - 1
    state_rows = state_ptr + slot * stride_ss + channels[:, None] * stride_sc
    old = tl.load(
        state_rows + i[None, :] * stride_sk,
        mask=c_valid[:, None] & (j_valid & (i < init_len))[None, :],
        other=0.0,
    )
    src = (start + i - (WIDTH - 1)).to(tl.int64)
    new = tl.load(
        x_ptr + src[None, :] * stride_xt + channels[:, None] * stride_xc,
        mask=c_valid[:, None] & (j_valid & ~from_state)[None, :],
        other=0.0,
    )
    value = tl.where(from_state[None, :], old, new)
    # A request shorter than W-1 tokens shifts its slot in place: entries read above are
    # written below by other threads, so every load must complete before any store.
    tl.debug_barrier()
    tl.store(
        state_rows + j[None, :] * stride_sk,
        value.to(state_ptr.dtype.element_ty),
        mask=c_valid[:, None] & j_valid[None, :],
    )


@triton.jit
def _conv1d_update_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    state_ptr,
    slot_ptr,
    out_ptr,
    num_channels,
    stride_xb,
    stride_xc,
    stride_wc,
    stride_wk,
    stride_bias,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_slot,
    stride_ob,
    stride_oc,
    WIDTH: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    row = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_valid = channels < num_channels
    slot = tl.load(slot_ptr + row * stride_slot).to(tl.int64)
    x_new = tl.load(x_ptr + row * stride_xb + channels * stride_xc, mask=c_valid, other=0.0)

    # window[:, k] = [state (W-1 entries), new token][k]; new_state[:, k] = window[:, k + 1].
    k = tl.arange(0, WIDTH_PAD)
    state_rows = state_ptr + slot * stride_ss + channels[:, None] * stride_sc
    window = tl.load(
        state_rows + k[None, :] * stride_sk,
        mask=c_valid[:, None] & (k < WIDTH - 1)[None, :],
        other=0.0,
    )
    window = tl.where((k == WIDTH - 1)[None, :], x_new[:, None], window)
    shifted = tl.load(
        state_rows + (k + 1)[None, :] * stride_sk,
        mask=c_valid[:, None] & (k + 1 < WIDTH - 1)[None, :],
        other=0.0,
    )
    shifted = tl.where((k + 1 == WIDTH - 1)[None, :], x_new[:, None], shifted)

    weight = tl.load(
        weight_ptr + channels[:, None] * stride_wc + k[None, :] * stride_wk,
        mask=c_valid[:, None] & (k < WIDTH)[None, :],
        other=0.0,
    )
    y = tl.sum(weight.to(tl.float32) * window.to(tl.float32), axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + channels * stride_bias, mask=c_valid, other=0.0).to(tl.float32)
    if SILU:
        y = _silu(y)
    # The slot is shifted in place: entries read above are written below by other
    # threads, so every load must complete before any store.
    tl.debug_barrier()
    tl.store(
        state_rows + k[None, :] * stride_sk,
        shifted.to(state_ptr.dtype.element_ty),
        mask=c_valid[:, None] & (k < WIDTH - 1)[None, :],
    )
    tl.store(
        out_ptr + row * stride_ob + channels * stride_oc,
        y.to(out_ptr.dtype.element_ty),
        mask=c_valid,
    )


# ----------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------


def _channel_block(channels: int) -> int:
    return min(_MAX_BLOCK_C, int(triton.next_power_of_2(max(channels, 1))))


def causal_conv1d_varlen(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    conv_states: Tensor,
    query_start_loc: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    activation: Literal["silu"] | None = "silu",
    out: Tensor | None = None,
) -> Tensor:
    """Causal depthwise conv over a varlen batch, reading and writing cached states.

    Semantics of :func:`attnkit.kernels.conv1d.reference.causal_conv1d_varlen`; ``out``
    (``[T, C]``, dtype of ``x``, any strides) receives the result when given.
    Returns ``[T, C]`` in the dtype of ``x``.
    """
    x = check_tensor("x", x, layout="[T, C]", shape=(None, None), device=None)
    check_dtype("x", x)
    weight, bias, conv_states = check_conv_params(x, weight, bias, conv_states, activation)
    check_dtype("weight", weight)
    check_dtype("bias", bias)
    qsl, slots, flags = check_varlen_tensors(
        query_start_loc, state_indices, has_initial_state, device=x.device, num_tokens=x.shape[0]
    )
    batch = qsl.shape[0] - 1
    check_has_slots("conv_states", conv_states, batch)
    result = alloc_out(out, x, "[T, C]")
    # Kernel 2 reads x again after kernel 1 has written the outputs.
    check_distinct_output("out", result, {"x": x, "conv_states": conv_states})

    num_tokens, channels = x.shape
    width = weight.shape[1]
    block_c = _channel_block(channels)
    if num_tokens > 0 and channels > 0:
        block_t = min(_MAX_BLOCK_T, triton.next_power_of_2(num_tokens))
        _conv1d_varlen_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(channels, block_c))](
            x,
            weight,
            bias,
            conv_states,
            qsl,
            slots,
            flags,
            result,
            num_tokens,
            channels,
            batch,
            search_iters(batch),
            x.stride(0),
            x.stride(1),
            weight.stride(0),
            weight.stride(1),
            bias.stride(0) if bias is not None else 0,
            conv_states.stride(0),
            conv_states.stride(1),
            conv_states.stride(2),
            qsl.stride(0),
            slots.stride(0),
            flags.stride(0),
            result.stride(0),
            result.stride(1),
            WIDTH=width,
            BLOCK_T=block_t,
            BLOCK_C=block_c,
            HAS_BIAS=bias is not None,
            SILU=activation == "silu",
            num_warps=_VARLEN_WARPS,
            # Explicit: Triton 3.9 warns when it is unset (the default flips in 3.10).
            enable_fp_fusion=True,
        )
    if batch > 0 and channels > 0 and width > 1:
        # After the conv kernel (stream order): it reads the states this one replaces.
        _conv1d_state_kernel[(batch, triton.cdiv(channels, block_c))](
            x,
            conv_states,
            qsl,
            slots,
            flags,
            channels,
            x.stride(0),
            x.stride(1),
            conv_states.stride(0),
            conv_states.stride(1),
            conv_states.stride(2),
            qsl.stride(0),
            slots.stride(0),
            flags.stride(0),
            WIDTH=width,
            STATE_PAD=triton.next_power_of_2(width - 1),
            BLOCK_C=block_c,
            enable_fp_fusion=True,
        )
    return result


def causal_conv1d_update(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    conv_states: Tensor,
    state_indices: Tensor,
    activation: Literal["silu"] | None = "silu",
    out: Tensor | None = None,
) -> Tensor:
    """One decode step: one new token per request, states shifted in place.

    Semantics of :func:`attnkit.kernels.conv1d.reference.causal_conv1d_update`; ``out``
    (``[B, C]``, dtype of ``x``, any strides) receives the result when given.
    Returns ``[B, C]`` in the dtype of ``x``.
    """
    x = check_tensor("x", x, layout="[B, C]", shape=(None, None), device=None)
    check_dtype("x", x)
    weight, bias, conv_states = check_conv_params(x, weight, bias, conv_states, activation)
    check_dtype("weight", weight)
    check_dtype("bias", bias)
    batch, channels = x.shape
    slots = check_slot_tensor(state_indices, batch=batch, device=x.device)
    check_has_slots("conv_states", conv_states, batch)
    result = alloc_out(out, x, "[B, C]")
    if batch == 0 or channels == 0:
        return result
    width = weight.shape[1]
    block_c = _channel_block(channels)
    _conv1d_update_kernel[(batch, triton.cdiv(channels, block_c))](
        x,
        weight,
        bias,
        conv_states,
        slots,
        result,
        channels,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        bias.stride(0) if bias is not None else 0,
        conv_states.stride(0),
        conv_states.stride(1),
        conv_states.stride(2),
        slots.stride(0),
        result.stride(0),
        result.stride(1),
        WIDTH=width,
        WIDTH_PAD=triton.next_power_of_2(width),
        BLOCK_C=block_c,
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
        enable_fp_fusion=True,
    )
    return result
