"""Pieces shared by the paged-attention kernels and their launchers (private).

Device functions (``@triton.jit``, called from :mod:`.paged_attention`):

* :func:`e4m3_bits_to_f32` / :func:`load_kv_tile`: the exact fp8 e4m3fn decoder used
  under the Triton interpreter, and the masked K/V tile load around it;
* :func:`mask_scores`: the causal / sliding-window / chunked-local visibility mask;
* :func:`online_softmax_update`: one step of the online softmax and of the ``P @ V``
  accumulation;
* :func:`attend_kv_tile`: one key tile of either paged-attention kernel (load K/V,
  score, soft-cap, ALiBi, mask, online softmax); the kernels differ only in how they
  address the tile (one block per tile, or a per-key gather across blocks).

Launcher-side argument checks (plain Python) are shared by :mod:`.paged_attention` and
:mod:`.kv_write`; their error messages are part of the public behaviour. The op's own
argument rules (mask options, soft-cap, per-head vectors, scales) live in
:mod:`attnkit.kernels.contracts.attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.kernels._checks import (
    KernelTypeError,
    check_finite_float,
    check_int_arg,
    describe,
)
from attnkit.kernels.contracts.attention import (
    check_batch_layout,
    check_device,
    check_index_layout,
)

__all__ = [
    "attend_kv_tile",
    "check_batch_metadata",
    "check_block_table_width",
    "check_device",
    "check_finite_float",
    "check_index_tensor",
    "check_int_arg",
    "check_scale_tensor",
    "e4m3_bits_to_f32",
    "load_kv_tile",
    "mask_scores",
    "online_softmax_update",
    "tanh",
]

# ------------------------------------------------------------------------ device


@triton.jit
def e4m3_bits_to_f32(bits):
    """Decode float8 e4m3fn bit patterns (uint8) to float32 with integer ops, exactly.

    e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; S.1111.111 is
    NaN; exponent 0 holds the subnormals ``m * 2**-9``. Used under the interpreter only
    (see the ``_INTERPRETED`` notes in the kernel modules).
    """
    b = bits.to(tl.uint32)
    sign = b >> 7
    exponent = (b >> 3) & 0xF
    mantissa = b & 0x7
    # Normal numbers: rebias the exponent (127 - 7 = 120) and widen the mantissa.
    normal = ((sign << 31) | ((exponent + 120) << 23) | (mantissa << 20)).to(
        tl.float32, bitcast=True
    )
    subnormal = mantissa.to(tl.float32) * 0.001953125  # 2**-9, exact
    subnormal = tl.where(sign == 1, -subnormal, subnormal)
    value = tl.where(exponent == 0, subnormal, normal)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def load_kv_tile(ptrs, mask, FP8_BITS: tl.constexpr, DTYPE: tl.constexpr):
    """A K or V tile as ``DTYPE`` (the dot operand dtype; exact for e4m3 values, which
    fit in float16, bfloat16 and float32)."""
    # Masked-off slots read as exactly 0 (never as whatever the slot holds: it may be a
    # NaN from an unwritten tail or a released block, and 0 * NaN is NaN).
    if FP8_BITS:
        tile = e4m3_bits_to_f32(tl.load(ptrs, mask=mask, other=0))
    else:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile.to(DTYPE)


@triton.jit
def tanh(x):
    """tanh from one exp2 of a non-positive argument: finite for every finite ``x``,
    saturating to +-1 (Triton has no portable tanh)."""
    t = tl.exp2(-2.885390081777927 * tl.abs(x))  # exp(-2|x|); the constant is 2 * log2(e)
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def mask_scores(
    s,
    row_valid,
    k_valid,
    q_pos,
    k_pos,
    window,
    chunk,
    IS_CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
):
    """``s`` ``[M, N]`` with every score a row may not see set to ``-inf``."""
    visible = row_valid[:, None] & k_valid[None, :]
    if IS_CAUSAL:
        visible = visible & (k_pos[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
    if USE_CHUNK:
        # Both positions are >= 0 here (causal keeps j <= i), so // is the floor.
        visible = visible & (k_pos[None, :] // chunk == q_pos[:, None] // chunk)
    # Select, never multiply: a masked score may be NaN (garbage key) or inf.
    return tl.where(visible, s, float("-inf"))


@triton.jit
def online_softmax_update(
    s,
    v,
    m_i,
    l_i,
    acc,
    P_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """Fold one tile of log2-domain scores ``s`` and values ``v`` into the running row
    max ``m_i``, denominator ``l_i`` and output ``acc``; returns the new three."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row can see nothing in this tile (window edge, padding rows); keep its
    # max finite so exp2(-inf - -inf) never produces NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    # p is rounded to P_DTYPE (the query dtype) as the tensor-core P.V product does;
    # kept under DOT_IN_FP32 too so the interpreter rounds the same.
    p_op = p.to(P_DTYPE)
    if DOT_IN_FP32:
        p_op = p_op.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p_op, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def attend_kv_tile(
    q,
    k_ptrs,
    kv_mask,
    stride_ckv,
    k_pos,
    k_valid,
    q_pos,
    row_valid,
    m_i,
    l_i,
    acc,
    qk_scale,
    softcap,
    slope,
    window,
    chunk,
    IS_CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    FP8_BITS: tl.constexpr,
    P_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """One key tile of the online softmax: load K (``k_ptrs``) and V (``k_ptrs +
    stride_ckv``) under ``kv_mask``, score, modify, mask and fold into ``(m_i, l_i,
    acc)``; returns the new three.

    ``qk_scale`` multiplies ``q . k``: in the log2 domain (``scale * k_scale * log2(e)``)
    without a soft-cap, in the natural one with it (the cap applies to natural-log
    scores and the result is moved to log2 here). ``slope`` is the ALiBi slope per row
    times log2(e) (unused without ALiBi). ``k_valid`` ``[N]`` marks keys in the range
    the caller may read; ``mask_scores`` adds the per-row visibility.
    """
    LOG2E: tl.constexpr = 1.4426950408889634
    # Dot operands take the dtype of q: a no-op for a cache of the query dtype, and
    # exact for fp8 values (e4m3 fits in fp16, bf16 and fp32).
    k = load_kv_tile(k_ptrs, kv_mask, FP8_BITS, q.dtype)
    v = load_kv_tile(k_ptrs + stride_ckv, kv_mask, FP8_BITS, q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if USE_SOFTCAP:
        s = (softcap * tanh(s / softcap)) * LOG2E
    if USE_ALIBI:
        s += slope[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
    s = mask_scores(
        s, row_valid, k_valid, q_pos, k_pos, window, chunk, IS_CAUSAL, USE_WINDOW, USE_CHUNK
    )
    # v has q's dtype (float32 under DOT_IN_FP32); p is rounded to P_DTYPE either way.
    return online_softmax_update(s, v, m_i, l_i, acc, P_DTYPE, DOT_PRECISION, DOT_IN_FP32)


# ------------------------------------------------------------------------ launchers


def check_index_tensor(
    name: str, t: object, shape: tuple[int, ...], device: torch.device, of: str = "query"
) -> torch.Tensor:
    """An int32 tensor of ``shape`` (``-1``: any size) on ``device``, unit last stride."""
    t = check_index_layout(name, t, shape)
    check_device(name, t, device, of)
    # The kernels index the last dim with unit stride; checked here rather than copied
    # so a caller's per-step metadata never silently allocates.
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected unit stride in the last dim, got strides {tuple(t.stride())}"
        )
    return t


def check_scale_tensor(name: str, t: object, device: torch.device, of: str) -> torch.Tensor:
    """A one-element float32 tensor (shape ``[]`` or ``[1]``) on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise KernelTypeError(
            f"{name}: expected a one-element torch.float32 tensor or None, got {describe(t)}"
        )
    if t.dtype != torch.float32 or t.numel() != 1 or t.dim() > 1:
        raise ValueError(
            f"{name}: expected a one-element torch.float32 tensor of shape [] or [1], "
            f"got {t.dtype} {list(t.shape)}"
        )
    check_device(name, t, device, of)
    return t


def check_batch_metadata(
    seq_lens: object,
    query_start_loc: object,
    block_table: object,
    device: torch.device,
    of: str = "query",
) -> int:
    """The op's metadata layout (:func:`~attnkit.kernels.contracts.attention.check_batch_layout`)
    plus what the kernels need: every tensor on ``device`` (called "the ``of`` device")
    with unit last stride; returns ``B``."""
    num_requests = check_batch_layout(query_start_loc, seq_lens, block_table)
    for name, t in (
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
        ("block_table", block_table),
    ):
        assert isinstance(t, torch.Tensor)  # checked by check_batch_layout
        check_index_tensor(name, t, tuple(t.shape), device, of)
    return num_requests


def check_block_table_width(block_table: torch.Tensor, block_size: int, max_seq_len: int) -> None:
    if block_table.shape[1] * block_size < max_seq_len:
        raise ValueError(
            f"block_table: expected at least {triton.cdiv(max_seq_len, block_size)} columns "
            f"for max_seq_len={max_seq_len} at block size {block_size}, "
            f"got {block_table.shape[1]}"
        )
