"""Triton kernel: merge two partial attentions over disjoint key sets by log-sum-exp.

Semantics, shapes and the ``-inf`` rules are those of the pure-torch reference
:func:`attnkit.kernels.merge.reference.merge_attn_states` (its module docstring):

* ``lse = log(exp(lse_a) + exp(lse_b))``, natural log, computed after subtracting the
  larger of the two;
* ``out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b``, in float32;
* a side with lse ``-inf`` contributes nothing (its ``out`` row is not even read);
  both ``-inf`` gives output 0 and lse ``-inf``.

Used by cascade (shared-prefix) attention; split-KV decoding has its own S-way merge in
(``_split_kv_merge_kernel`` in :mod:`attnkit.kernels.attention.triton`) because it also folds in attention sinks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.kernels.merge.contract import check_merge_inputs

__all__ = ["merge_attn_states"]

# Elements of one [heads, D] tile per program: big enough that a D=128 row batch
# amortises the per-program lse loads, small enough to stay in registers.
_TILE_ELEMENTS = 2048


@triton.jit
def _merge_attn_states_kernel(
    out_a_ptr,
    lse_a_ptr,
    out_b_ptr,
    lse_b_ptr,
    output_ptr,
    output_lse_ptr,
    num_heads,
    stride_at,
    stride_ah,
    stride_ad,
    stride_bt,
    stride_bh,
    stride_bd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lat,
    stride_lah,
    stride_lbt,
    stride_lbh,
    stride_lot,
    stride_loh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < num_heads
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    neg_inf = float("-inf")
    lse_a = tl.load(lse_a_ptr + token * stride_lat + heads * stride_lah, mask=head_valid)
    lse_b = tl.load(lse_b_ptr + token * stride_lbt + heads * stride_lbh, mask=head_valid)
    row_max = tl.maximum(lse_a, lse_b)
    # Both sides empty: shift by 0 so exp(-inf - -inf) never makes NaN.
    shift = tl.where(row_max == neg_inf, 0.0, row_max)
    weight_a = tl.exp(lse_a - shift)
    weight_b = tl.exp(lse_b - shift)
    denom = weight_a + weight_b

    # An empty side is never read: its rows may hold anything, NaN included.
    use_a = head_valid & (lse_a != neg_inf)
    use_b = head_valid & (lse_b != neg_inf)
    out_a = tl.load(
        out_a_ptr + token * stride_at + heads[:, None] * stride_ah + dims[None, :] * stride_ad,
        mask=use_a[:, None] & dim_valid[None, :],
        other=0.0,
    ).to(tl.float32)
    out_b = tl.load(
        out_b_ptr + token * stride_bt + heads[:, None] * stride_bh + dims[None, :] * stride_bd,
        mask=use_b[:, None] & dim_valid[None, :],
        other=0.0,
    ).to(tl.float32)
    empty = denom == 0.0
    inv = 1.0 / tl.where(empty, 1.0, denom)
    merged = (out_a * (weight_a * inv)[:, None]) + (out_b * (weight_b * inv)[:, None])
    tl.store(
        output_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od,
        merged.to(output_ptr.dtype.element_ty),
        mask=head_valid[:, None] & dim_valid[None, :],
    )
    if WRITE_LSE:
        merged_lse = tl.where(empty, neg_inf, shift + tl.log(tl.where(empty, 1.0, denom)))
        tl.store(
            output_lse_ptr + token * stride_lot + heads * stride_loh, merged_lse, mask=head_valid
        )


def merge_attn_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    output: torch.Tensor | None = None,
    output_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Merge two partial attentions over disjoint key sets.

    Args:
        out_a: ``[T, H, D]`` (float32, float16 or bfloat16, any strides).
        lse_a: float32 ``[T, H]`` natural-log lse of ``out_a``'s keys; ``-inf`` = none.
        out_b: ``[T, H, D]``, same dtype as ``out_a``.
        lse_b: float32 ``[T, H]``.
        output: optional ``[T, H, D]`` float tensor (any supported float dtype) to write
            into; it may be ``out_a`` or ``out_b`` itself (each element is read before it
            is written, by the same program).
        output_lse: optional float32 ``[T, H]`` for the merged lse; may be ``lse_a`` or
            ``lse_b``. Nothing is allocated for it when it is not given.

    Returns:
        ``output`` (allocated like ``out_a`` when not given).
    """
    check_merge_inputs(out_a, lse_a, out_b, lse_b, output, output_lse)
    if output is None:
        output = torch.empty_like(out_a)
    num_tokens, num_heads, head_dim = out_a.shape
    if num_tokens == 0 or num_heads == 0 or head_dim == 0:
        return output
    head_dim_pad = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, _TILE_ELEMENTS // head_dim_pad))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    # Without output_lse the kernel never touches that pointer; lse_a stands in for it.
    lse_out = output_lse if output_lse is not None else lse_a
    _merge_attn_states_kernel[grid](
        out_a_ptr=out_a,
        lse_a_ptr=lse_a,
        out_b_ptr=out_b,
        lse_b_ptr=lse_b,
        output_ptr=output,
        output_lse_ptr=lse_out,
        num_heads=num_heads,
        stride_at=out_a.stride(0),
        stride_ah=out_a.stride(1),
        stride_ad=out_a.stride(2),
        stride_bt=out_b.stride(0),
        stride_bh=out_b.stride(1),
        stride_bd=out_b.stride(2),
        stride_ot=output.stride(0),
        stride_oh=output.stride(1),
        stride_od=output.stride(2),
        stride_lat=lse_a.stride(0),
        stride_lah=lse_a.stride(1),
        stride_lbt=lse_b.stride(0),
        stride_lbh=lse_b.stride(1),
        stride_lot=lse_out.stride(0),
        stride_loh=lse_out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_H=block_h,
        WRITE_LSE=output_lse is not None,
        enable_fp_fusion=True,
    )
    return output
