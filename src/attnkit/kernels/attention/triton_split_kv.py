"""``split_kv_decode``: split-KV ("flash-decoding") paged attention for decode batches.

When a batch has few requests with long contexts, one program per (query tile, kv head)
leaves most of the GPU idle while each program walks thousands of keys; split-KV also
splits each request's keys into ``num_splits`` runs of consecutive cache blocks and
merges the partial results by log-sum-exp (Dao, Haziza, Massa, Sizov, 2023,
"Flash-Decoding for long-context inference").

A thin wrapper over :mod:`attnkit.kernels.attention.triton`: it plans the step
with the given ``num_splits`` and launches it. Callers that run many layers over one
batch should build the plan once (``num_splits=None`` lets it choose with
:func:`choose_num_splits`) and call ``paged_attention`` per layer. Shapes, semantics,
the workspace and the grid are described there.
"""

from __future__ import annotations

import torch

from attnkit.kernels._checks import check_int_arg
from attnkit.kernels.attention.triton import FP8_DTYPE, check_kv_cache, check_query, paged_attention
from attnkit.kernels.attention.triton_plan import (
    MAX_HEAD_DIM,
    MAX_NUM_SPLITS,
    MIN_HEAD_DIM,
    SPLIT_KV_MAX_QUERY_LEN,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_DTYPES,
    SplitKVWorkspace,
    choose_num_splits,
    plan_paged_attention,
    split_kv_workspace,
)

__all__ = [
    "MAX_NUM_SPLITS",
    "MAX_QUERY_LEN",
    "SplitKVWorkspace",
    "choose_num_splits",
    "split_kv_decode",
    "split_kv_workspace",
]

MAX_QUERY_LEN = SPLIT_KV_MAX_QUERY_LEN
"""Most queries per request on this path (decode and short speculative steps)."""

# The launcher's limits, as the paged_attention module declares them.
_SUPPORTED_DTYPES = SUPPORTED_DTYPES
_FP8_CACHE_DTYPES = (FP8_DTYPE,)
_SUPPORTED_BLOCK_SIZES = SUPPORTED_BLOCK_SIZES
_MIN_HEAD_DIM = MIN_HEAD_DIM
_MAX_HEAD_DIM = MAX_HEAD_DIM


def split_kv_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_seq_len: int,
    scale: float,
    num_splits: int,
    max_query_len: int = 1,
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
    workspace: SplitKVWorkspace | None = None,
    split_tokens: int | None = None,
) -> torch.Tensor:
    """Split-KV attention of a decode batch over the paged ``kv_cache``.

    Args:
        query: ``[T, Hq, D]`` float32/float16/bfloat16, any strides.
        kv_cache: ``[NB, 2, BS, Hkv, D]``, contiguous, the query dtype or
            ``torch.float8_e4m3fn`` (then ``k_scale`` and ``v_scale`` are required);
            ``BS in (16, 32, 64, 128)``, ``16 <= D <= 256``. This step's K/V must
            already be written.
        query_start_loc, seq_lens, block_table: int32 batch metadata.
        max_seq_len: bound on every ``seq_lens[b]``; checks the block-table width.
        scale: multiplies ``q . k``.
        num_splits: key chunks per request, ``1 <= num_splits <= 256`` (see
            :func:`choose_num_splits`).
        max_query_len: bound on every request's query count, ``<= 16`` (1 for plain
            decode, more for speculative decoding, 0 launches nothing). Longer prefills
            belong in ``unified_attention``.
        causal, sliding_window, chunk_size, logits_soft_cap, alibi_slopes, sinks: as
            for :func:`attnkit.kernels.attention.reference.paged_attention`; the two
            ``[Hq]`` tensors may be float32, float16 or bfloat16.
        k_scale, v_scale: multiply the cached keys / values; None (1.0), a float > 0, or
            a float32 one-element device tensor (read by the kernel, never by the host,
            so a CUDA graph replays with new values).
        output: optional ``[T, Hq, D]`` of the query dtype to write into.
        lse: optional float32 ``[T, Hq]`` to receive the natural-log lse (sink
            included); not computed when not given.
        workspace: optional scratch (:class:`SplitKVWorkspace`,
            :func:`split_kv_workspace`); allocated per call when not given.
        split_tokens: keys per split (a multiple of the block size); ``num_splits`` is
            then a bound (``num_splits * split_tokens >= max_seq_len``) and a request's
            result does not depend on the rest of the batch when ``num_splits`` is the
            same every call (see :func:`plan_paged_attention`).

    Returns:
        ``output`` (allocated when not given). Rows at or past ``query_start_loc[B]``
        of ``output`` and ``lse`` are left untouched.
    """
    query = check_query(query)
    kv_cache = check_kv_cache(kv_cache, query, int8=kv_scales is not None)
    num_splits = check_int_arg("num_splits", num_splits, 1, MAX_NUM_SPLITS)
    max_query_len = check_int_arg("max_query_len", max_query_len, 0, MAX_QUERY_LEN)
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
        num_splits=num_splits,
        device=query.device,
        split_tokens=split_tokens,
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
        workspace=workspace,
    )
