"""``unified_attention``: paged attention of a mixed batch (prefill, chunked prefill and
decode) in one launch of the one-pass kernel.

A thin wrapper over :mod:`attnkit.kernels.attention.triton`: it plans the step
(:func:`~attnkit.kernels.attention.triton_plan.plan_paged_attention` with
``num_splits=0``) and launches it
(:func:`~attnkit.kernels.attention.triton.paged_attention`). Callers that run many
layers over one batch should build the plan once and call ``paged_attention`` per layer
(the ``triton_attn`` backend does); shapes, semantics and the grid are described there.
"""

from __future__ import annotations

import torch

from attnkit.kernels.attention.triton import FP8_DTYPE, check_kv_cache, check_query, paged_attention
from attnkit.kernels.attention.triton_plan import (
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_DTYPES,
    plan_paged_attention,
)

__all__ = ["unified_attention"]

# The launcher's limits, as the paged_attention module declares them.
_SUPPORTED_DTYPES = SUPPORTED_DTYPES
_FP8_DTYPE = FP8_DTYPE
_SUPPORTED_BLOCK_SIZES = SUPPORTED_BLOCK_SIZES
_MIN_HEAD_DIM = MIN_HEAD_DIM
_MAX_HEAD_DIM = MAX_HEAD_DIM


def unified_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` ``[T, Hq, D]`` over the paged ``kv_cache`` (one-pass kernel).

    The new tokens' K/V must already be in the cache (see ``write_kv_cache``). Returns
    ``output`` (allocated when not given); when ``lse`` (float32 ``[T, Hq]``) is given,
    the natural-log log-sum-exp of every row is written to it. Rows of ``output`` and
    ``lse`` past ``query_start_loc[-1]`` are left untouched.

    ``max_query_len`` / ``max_seq_len`` must bound the true per-request values: they size
    the grid, and the launcher never reads tensor values back to the host to check them.
    With ``causal=True`` every request needs ``q_len <= seq_len``; with ``causal=False``
    (encoder or cross attention) a request may have more queries than keys.

    ``sliding_window`` (``W >= 1``) and ``chunk_size`` (``C >= 1``) need ``causal=True``
    and exclude each other. ``alibi_slopes`` and ``sinks`` are ``[Hq]`` (float32,
    float16 or bfloat16). ``k_scale`` / ``v_scale``: None, a float > 0 or a one-element
    float32 device tensor; required with a ``torch.float8_e4m3fn`` cache (which stores
    ``key / k_scale``), optional otherwise (the cached keys / values are multiplied by
    them either way).
    """
    query = check_query(query)
    kv_cache = check_kv_cache(kv_cache, query, int8=kv_scales is not None)
    plan = plan_paged_attention(
        query_start_loc,
        seq_lens,
        block_table,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        block_size=kv_cache.shape[2],
        num_kv_heads=kv_cache.shape[3],
        causal=causal,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        num_tokens=query.shape[0],
        num_splits=0,
        device=query.device,
    )
    return paged_attention(
        query,
        kv_cache,
        plan,
        scale=scale,
        logits_soft_cap=logits_soft_cap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_scales=kv_scales,
        output=output,
        lse=lse,
    )
