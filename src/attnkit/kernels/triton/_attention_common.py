"""Pieces shared by the paged-attention kernels and their launchers (private).

Device functions (``@triton.jit``, called from :mod:`.unified_attention` and
:mod:`.split_kv_decode`):

* :func:`e4m3_bits_to_f32` / :func:`load_kv_tile`: the exact fp8 e4m3fn decoder used
  under the Triton interpreter, and the masked K/V tile load around it;
* :func:`mask_scores`: the causal / sliding-window / chunked-local visibility mask;
* :func:`online_softmax_update`: one step of the online softmax and of the ``P @ V``
  accumulation.

Score modifications (soft-cap, ALiBi) stay in each kernel: the two apply the log2(e)
factor at different points, so one shared version would change one kernel's rounding.

Launcher-side argument checks (plain Python) are shared by those launchers and
:mod:`.kv_write`; their error messages are part of the public behaviour.
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
    require_tensor,
)

__all__ = [
    "check_batch_metadata",
    "check_block_table_width",
    "check_device",
    "check_finite_float",
    "check_index_tensor",
    "check_int_arg",
    "check_paged_kv_cache",
    "check_scale_tensor",
    "e4m3_bits_to_f32",
    "load_kv_tile",
    "mask_scores",
    "online_softmax_update",
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
def load_kv_tile(ptrs, mask, FP8_BITS: tl.constexpr):
    # Masked-off slots read as exactly 0 (never as whatever the slot holds: it may be a
    # NaN from an unwritten tail or a released block, and 0 * NaN is NaN).
    if FP8_BITS:
        tile = e4m3_bits_to_f32(tl.load(ptrs, mask=mask, other=0))
    else:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile


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


# ------------------------------------------------------------------------ launchers


def check_device(name: str, t: torch.Tensor, device: torch.device, of: str = "query") -> None:
    """``t`` on ``device``, described in the error as "the ``of`` device"."""
    if t.device != device:
        raise ValueError(
            f"{name}: expected device {device} (the {of} device), got {t.device} ({describe(t)})"
        )


def check_index_tensor(
    name: str, t: object, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """An int32 tensor of ``shape`` (``-1``: any size) on ``device``, unit last stride."""
    pretty = ", ".join("*" if s < 0 else str(s) for s in shape)
    t = require_tensor(name, t, f"an int32 torch.Tensor [{pretty}]")
    if t.dtype != torch.int32:
        raise ValueError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if t.dim() != len(shape) or any(
        want >= 0 and got != want for want, got in zip(shape, t.shape, strict=True)
    ):
        raise ValueError(f"{name}: expected shape [{pretty}], got {tuple(t.shape)}")
    check_device(name, t, device)
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


def check_paged_kv_cache(
    kv_cache: torch.Tensor,
    num_q_heads: int,
    head_dim: int,
    device: torch.device,
    *,
    block_sizes: tuple[int, ...],
    min_head_dim: int,
    max_head_dim: int,
) -> None:
    """The checks on a ``[NB, 2, BS, Hkv, D]`` cache that follow its dtype check."""
    num_blocks, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    check_device("kv_cache", kv_cache, device)
    if num_blocks == 0:
        raise ValueError(
            f"kv_cache: expected at least one block (NB >= 1), got {describe(kv_cache)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError(
            "kv_cache: expected a contiguous tensor, got a non-contiguous one "
            f"({describe(kv_cache)}, strides {tuple(kv_cache.stride())})"
        )
    if cache_head_dim != head_dim:
        raise ValueError(
            f"kv_cache: expected head size {head_dim} (the query head size), got {cache_head_dim}"
        )
    if block_size not in block_sizes:
        raise ValueError(f"kv_cache: expected block size in {block_sizes}, got {block_size}")
    if not min_head_dim <= head_dim <= max_head_dim:
        raise ValueError(
            f"query: expected head size in [{min_head_dim}, {max_head_dim}], got {head_dim}"
        )
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"kv_cache: expected a kv head count dividing the {num_q_heads} query heads, "
            f"got {num_kv_heads}"
        )


def check_batch_metadata(
    seq_lens: object,
    query_start_loc: object,
    block_table: object,
    device: torch.device,
) -> int:
    """Check ``seq_lens`` ``[B]``, ``query_start_loc`` ``[B + 1]``, ``block_table``
    ``[B, MB]`` (int32, on ``device``); returns ``B``."""
    seq_lens = require_tensor("seq_lens", seq_lens, "an int32 torch.Tensor [B]")
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens: expected shape [B], got {tuple(seq_lens.shape)}")
    num_requests: int = seq_lens.shape[0]
    check_index_tensor("seq_lens", seq_lens, (num_requests,), device)
    check_index_tensor("query_start_loc", query_start_loc, (num_requests + 1,), device)
    check_index_tensor("block_table", block_table, (num_requests, -1), device)
    return num_requests


def check_block_table_width(block_table: torch.Tensor, block_size: int, max_seq_len: int) -> None:
    if block_table.shape[1] * block_size < max_seq_len:
        raise ValueError(
            f"block_table: expected at least {triton.cdiv(max_seq_len, block_size)} columns "
            f"for max_seq_len={max_seq_len} at block size {block_size}, "
            f"got {block_table.shape[1]}"
        )
