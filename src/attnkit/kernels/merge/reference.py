"""Pure-torch reference for merging two partial attentions by their log-sum-exp.

Two attentions of the same queries over *disjoint* key sets ``A`` and ``B`` (for
example a shared prefix and each request's own suffix in cascade attention, or two
chunks of one long context in split-KV decoding) combine into the attention over
``A | B``. With ``out_x`` the softmax-weighted values over ``X`` and ``lse_x`` the
natural-log log-sum-exp of ``X``'s scores (the convention of
:mod:`attnkit.kernels.attention.reference`):

* ``lse = log(exp(lse_a) + exp(lse_b))``
* ``out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b``

Both are computed after subtracting ``max(lse_a, lse_b)``, so no exponent overflows.
A side whose lse is ``-inf`` (it saw no key) contributes nothing, whatever its ``out``
holds (even NaN); when both are ``-inf`` the merged row is 0 with lse ``-inf``. A NaN
lse is not hidden: it reaches the output.

Shapes: ``out_*`` ``[T, H, D]`` (any float dtype, both the same), ``lse_*`` float32
``[T, H]``. Arithmetic is float32; the output takes ``output``'s dtype (by default the
dtype of ``out_a``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.kernels.merge.contract import check_merge_inputs

__all__ = ["merge_attn_states"]


def merge_attn_states(
    out_a: Tensor,
    lse_a: Tensor,
    out_b: Tensor,
    lse_b: Tensor,
    *,
    output: Tensor | None = None,
    output_lse: Tensor | None = None,
) -> Tensor:
    """Merge two partial attentions over disjoint key sets (see the module docstring).

    Args:
        out_a: ``[T, H, D]`` attention output over key set A.
        lse_a: float32 ``[T, H]`` natural-log log-sum-exp over A (``-inf``: A is empty).
        out_b: ``[T, H, D]``, same dtype as ``out_a``, over key set B.
        lse_b: float32 ``[T, H]`` over B.
        output: optional ``[T, H, D]`` float tensor to write into (and return); it may
            alias ``out_a`` or ``out_b``.
        output_lse: optional float32 ``[T, H]`` to receive the merged lse; it may
            alias ``lse_a`` or ``lse_b``.

    Returns:
        ``output``, allocated like ``out_a`` when not given.
    """
    check_merge_inputs(out_a, lse_a, out_b, lse_b, output, output_lse)
    neg_inf = float("-inf")
    row_max = torch.maximum(lse_a, lse_b)
    # Both sides empty: shift by 0 so exp(-inf - -inf) never makes NaN.
    shift = torch.where(row_max == neg_inf, torch.zeros_like(row_max), row_max)
    weight_a = torch.exp(lse_a - shift)
    weight_b = torch.exp(lse_b - shift)
    denom = weight_a + weight_b
    # An empty side is dropped outright rather than weighted by 0: its out may be NaN.
    part_a = torch.where((lse_a == neg_inf)[..., None], 0.0, weight_a[..., None] * out_a.float())
    part_b = torch.where((lse_b == neg_inf)[..., None], 0.0, weight_b[..., None] * out_b.float())
    empty = denom == 0
    merged = (part_a + part_b) / torch.where(empty, torch.ones_like(denom), denom)[..., None]
    merged_lse = torch.where(empty, torch.full_like(denom, neg_inf), shift + torch.log(denom))
    if output is None:
        output = torch.empty_like(out_a)
    output.copy_(merged)
    if output_lse is not None:
        output_lse.copy_(merged_lse)
    return output
