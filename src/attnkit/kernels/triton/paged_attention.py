"""Paged attention for mixed batches: one plan per step, one launcher per layer.

A step's attention runs in two calls:

1. :func:`plan_paged_attention` (once per step, from the batch metadata) validates the
   metadata, chooses the path (the one-pass kernel, or split-KV "flash-decoding" for
   decode batches with few requests and long contexts), and lays out the grid: the
   cumulative count of query tiles per request (``tile_offsets``, int32 ``[B + 1]`` on
   the device) and how many programs to launch. It returns a frozen
   :class:`PagedAttentionPlan`.
2. :func:`paged_attention` (once per layer) validates only the layer's tensors (query,
   cache, output, per-head vectors, scales) against the plan and launches the kernels.

Shapes (fixed letters used throughout ``attnkit.kernels``):

* ``T``   total query tokens in the batch
* ``B``   requests
* ``Hq``  query heads; ``Hkv`` key/value heads (``Hq % Hkv == 0``); ``G = Hq // Hkv``
* ``D``   head size
* ``NB``  physical blocks; ``BS`` tokens per block; ``MB`` block-table width

Tensors:

* ``query``: ``[T, Hq, D]``, any strides. ``output``: ``[T, Hq, D]``, same dtype.
* ``kv_cache``: ``[NB, 2, BS, Hkv, D]``, contiguous; index 0 of dim 1 keys, 1 values.
  Either the query dtype or ``torch.float8_e4m3fn`` (then with ``k_scale``/``v_scale``).
* ``query_start_loc``: int32 ``[B + 1]``; request ``b`` owns query rows
  ``query_start_loc[b] : query_start_loc[b + 1]``.
* ``seq_lens``: int32 ``[B]``; context length of request ``b`` *including* its queries.
* ``block_table``: int32 ``[B, MB]``; position ``p`` of request ``b`` lives in block
  ``block_table[b, p // BS]`` at offset ``p % BS``.
* ``lse`` (optional output): float32 ``[T, Hq]``, any strides.

Semantics are those of the torch oracle :func:`attnkit.kernels.torch.attention.paged_attention`
(and the argument rules those of :mod:`attnkit.kernels.contracts.attention`): query ``t``
(0-based within its request) sits at absolute position ``i = seq_len - q_len + t`` (also
when ``causal=False``, where ``q_len > seq_len`` is allowed and ``i`` may be negative;
it then only matters to ALiBi). Query head ``h`` reads kv head ``h // G``. Key ``j`` is
visible iff ``j < seq_len`` and, when causal, ``j <= i``; a sliding window ``W`` adds
``i - j < W`` and a local-attention chunk ``C`` adds ``j // C == i // C``. Scores are
``s = scale * k_scale * (q . k)``, then ``cap * tanh(s / cap)``, then
``+ slope[h] * (j - i)``; a sink adds ``exp(sink[h])`` to each row's softmax
denominator with no value. ``lse`` is the natural-log log-sum-exp of the row, sink
included (``-inf`` for a row that sees nothing and has no sink). Rows of ``output`` and
``lse`` at or past ``query_start_loc[B]`` are left untouched.

Grid. Axis 0 walks the batch's *query tiles*: request ``b`` has
``cdiv(q_len_b, BLOCK_Q)`` tiles and ``tile_offsets`` their running sum; a program finds
its request by binary search over ``tile_offsets`` (``find_segment``) and exits at once
when its index is past ``tile_offsets[B]``. The plan launches exactly
``tile_offsets[B]`` programs when the builder hands it the host copy of the offsets
(``query_start_loc_cpu``), and otherwise the shape-only bound
``min(T, (T + B * (BLOCK_Q - 1)) // BLOCK_Q, B * cdiv(max_query_len, BLOCK_Q))`` (each
tile holds at least one and at most ``BLOCK_Q`` tokens), which keeps a CUDA graph valid
for every batch of the captured shape. Axis 1 is the kv head: a program covers every
query head of that head's group, so one K/V tile load serves ``G`` heads. Split-KV adds
axis 2 (the split) and a merge kernel over ``(T, Hq)``.

Split-KV (Flash-Decoding: Dao, Haziza, Massa, Sizov, 2023, "Flash-Decoding for
long-context inference"): stage 1 runs the online softmax over one of ``num_splits``
runs of consecutive cache blocks and writes a float32 partial output (already divided
by its own denominator) and its lse into a :class:`SplitKVWorkspace`; stage 2 merges
the partials of each (token, head) by log-sum-exp weighting and adds the sink logit
once. A split that sees no key leaves output 0 and lse ``-inf``, which the merge
ignores.

With the plan built, and ``output``, ``lse`` (if wanted) and ``workspace`` given, the
launcher allocates nothing and never reads device memory back to the host, so it can be
captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from attnkit.kernels._checks import (
    FLOAT_DTYPES,
    KernelTypeError,
    check_device,
    check_dtype,
    check_finite_float,
    check_int_arg,
    describe,
    require_tensor,
)
from attnkit.kernels._triton.interpret import INTERPRETED
from attnkit.kernels._triton.varlen import find_segment, search_iters
from attnkit.kernels.contracts.attention import (
    FP8_DTYPE,
    check_batch_metadata,
    check_block_table_width,
    check_cache_layout,
    check_head_vector,
    check_index_tensor,
    check_kv_scale,
    check_logits_soft_cap,
    check_mask_options,
    check_query_layout,
    check_shard_lens,
)
from attnkit.kernels.triton._attention_common import attend_kv_tile

__all__ = [
    "AUTO_SPLIT_MAX_QUERY_LEN",
    "BLOCK_Q_MAX",
    "FP8_DTYPE",
    "MAX_HEAD_DIM",
    "MAX_NUM_SPLITS",
    "MIN_HEAD_DIM",
    "SPLIT_KV_MAX_QUERY_LEN",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_DTYPES",
    "PagedAttentionPlan",
    "SplitKVWorkspace",
    "choose_num_splits",
    "count_query_tiles",
    "merge_split_kv",
    "paged_attention",
    "plan_paged_attention",
    "split_kv_workspace",
]

# Kernels whose work is matrix products (q k^T, p v): with 16-bit inputs they must run on tensor
# cores (benchmarks/compile_report.py fails a 16-bit variant without MMA instructions).
TENSOR_CORE_KERNELS = ("_unified_attention_kernel", "_split_kv_partial_kernel")

SUPPORTED_DTYPES = FLOAT_DTYPES
"""Query (and output) dtypes; the cache has the query dtype or :data:`FP8_DTYPE`."""
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
BLOCK_Q_MAX = 32
"""Most query tokens of one request per program (the plan's ``block_q``)."""
SPLIT_KV_MAX_QUERY_LEN = 16
"""Most queries per request on the split-KV path: every query token gets its own copy
of the partial outputs, so long prefills belong in the one-pass kernel. 16 covers
speculative decoding's draft lengths."""
AUTO_SPLIT_MAX_QUERY_LEN = 1
"""The automatic choice (``num_splits=None``) considers split-KV for plain decode only."""
MAX_NUM_SPLITS = 256
"""Stage 2 holds all partials of one (token, head) in one ``[S, D]`` tile."""

# Rows (query tokens x query heads of one kv group) per inner step. 64 keeps the fp32
# accumulator of the largest head size (256) without register spills; 16 is the smallest
# M that tl.dot accepts on every target.
_MAX_ROWS = 64
_MAX_ROWS_FP32 = 32  # float32 dots run on the FMA units: see _launch_shape
_MIN_ROWS = 16
# choose_num_splits: never give a split fewer tokens than this (the merge and the
# per-split prologue would dominate) ...
_MIN_TOKENS_PER_SPLIT = 256
# ... nor more splits than this (stage-2 tile size and scratch traffic).
_MAX_AUTO_SPLITS = 32


# ------------------------------------------------------------------------ device


@triton.jit
def _find_tile(tile_offsets_ptr, num_reqs, search_iters, tile_id):
    """``(request, tile within it)`` of program ``tile_id``; request ``num_reqs`` for a
    program past the last tile (the caller exits)."""
    request = find_segment(tile_offsets_ptr, 1, num_reqs, tile_id, search_iters)
    first = tl.load(tile_offsets_ptr + tl.minimum(request, num_reqs))
    return request, tile_id - first


@triton.jit
def _unified_attention_kernel(
    query_ptr,
    cache_ptr,
    output_ptr,
    lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    tile_offsets_ptr,
    alibi_slopes_ptr,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    k_scale,
    v_scale,
    softcap,
    window,
    chunk,
    num_reqs,
    search_iters,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    stride_alibi,
    stride_sinks,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    ROWS_Q: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    SHARDED: tl.constexpr,
    SHARD_RANK: tl.constexpr,
    SHARD_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_SINKS: tl.constexpr,
    STORE_LSE: tl.constexpr,
    K_SCALE_FROM_PTR: tl.constexpr,
    V_SCALE_FROM_PTR: tl.constexpr,
    FP8_BITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    # Padded extents exist because tl.arange needs powers of two; every load and store
    # below masks the padding lanes (dims >= HEAD_DIM, heads >= GROUP).
    tl.static_assert(HEAD_DIM_PAD >= HEAD_DIM)
    tl.static_assert(GROUP_PAD >= GROUP)
    # The K dimension of both dots (HEAD_DIM_PAD for q.k, TILE_N for p.v) must be
    # >= 16 for 16-bit operands on NVIDIA.
    tl.static_assert(HEAD_DIM_PAD >= 16)
    tl.static_assert(TILE_N >= 16)
    # Key tiles never straddle two cache blocks: one block-table read per tile.
    tl.static_assert(BLOCK_SIZE % TILE_N == 0)
    # A window or chunk bounds the look-back relative to the query position; without
    # causality it would also need a look-ahead bound, which is not implemented.
    tl.static_assert(IS_CAUSAL or not (USE_WINDOW or USE_CHUNK))
    tl.static_assert(not (USE_WINDOW and USE_CHUNK))
    # A context-parallel shard (SHARDED) holds keys j at positions j * SHARD_SIZE +
    # SHARD_RANK of causal full-attention layers: no window or chunk.
    tl.static_assert(not SHARDED or (IS_CAUSAL and not (USE_WINDOW or USE_CHUNK)))
    # Each row of a step is one (query token, query head of this kv group) pair, so one
    # K/V tile load serves all GROUP heads that share the kv head.
    BLOCK_M: tl.constexpr = ROWS_Q * GROUP_PAD
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453

    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    # The grid may be an upper bound on the tile count (CUDA graphs): extra programs exit.
    if tile_id >= tl.load(tile_offsets_ptr + num_reqs):
        return
    request, tile = _find_tile(tile_offsets_ptr, num_reqs, search_iters, tile_id)

    q_start = tl.load(query_start_loc_ptr + request)
    q_len = tl.load(query_start_loc_ptr + request + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + request)
    # Negative for a non-causal request with more queries than keys (cross attention).
    context_len = seq_len - q_len
    if SHARDED:
        # seq_len counts this shard's keys; queries sit at the request's global positions,
        # from the whole lengths the launcher puts after the local ones.
        context_len = tl.load(seq_lens_ptr + num_reqs + request) - q_len
    tile_start = tile * BLOCK_Q
    tile_end = tl.minimum(tile_start + BLOCK_Q, q_len)

    rows = tl.arange(0, BLOCK_M)
    head_in_group = rows % GROUP_PAD
    q_head = kv_head * GROUP + head_in_group
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    # Per-tensor quantisation scales: a float argument, or read from device memory (a
    # CUDA graph replays with new values). k_scale is folded into the score scale,
    # v_scale applied to the final output: both are exact rewrites of "dequantise, then
    # attend" up to rounding.
    k_scale_value = k_scale
    if K_SCALE_FROM_PTR:
        k_scale_value = tl.load(k_scale_ptr)
    v_scale_value = v_scale
    if V_SCALE_FROM_PTR:
        v_scale_value = tl.load(v_scale_ptr)
    qk_scale = scale * k_scale_value
    if not USE_SOFTCAP:
        # Scores are kept in the log2 domain (exp2 is the native instruction).
        qk_scale = qk_scale * LOG2E
    slope = 0.0  # unread without ALiBi
    if USE_ALIBI:
        slope = tl.load(
            alibi_slopes_ptr + q_head * stride_alibi, mask=head_in_group < GROUP, other=0.0
        )
        slope = slope.to(tl.float32) * LOG2E
    offs_n = tl.arange(0, TILE_N)
    table_row = block_table_ptr + request.to(tl.int64) * stride_bt
    slot_offsets = offs_n[:, None] * stride_cs + kv_head * stride_ch + dims[None, :] * stride_cd

    # The tile's BLOCK_Q tokens in steps of ROWS_Q tokens (ROWS_Q * GROUP_PAD rows): the
    # plan fixes BLOCK_Q for all layers, the layer's group size fixes ROWS_Q, so the
    # register footprint stays bounded whatever the group. One step when ROWS_Q >= BLOCK_Q.
    for step_start in range(tile_start, tile_end, ROWS_Q):
        q_idx = step_start + rows // GROUP_PAD
        row_valid = (q_idx < tile_end) & (head_in_group < GROUP)
        q_pos = context_len + q_idx
        # int64 before multiplying by strides: T * Hq * D may exceed 2**31 elements.
        q_token = (q_start + q_idx).to(tl.int64)
        io_mask = row_valid[:, None] & dim_valid[None, :]
        q = tl.load(
            query_ptr
            + q_token[:, None] * stride_qt
            + q_head[:, None] * stride_qh
            + dims[None, :] * stride_qd,
            mask=io_mask,
            other=0.0,
        )
        if DOT_IN_FP32:
            q = q.to(tl.float32)

        # Key range [kv_begin, kv_end) that at least one row of this step can see: the
        # loop skips tiles no row needs, and every key outside it is loaded as 0. The
        # lower bound matters beyond speed: a block wholly before it may have been
        # released and now read as the null block, whose contents are arbitrary (NaN in
        # tests). Starting the loop at kv_begin's tile already avoids such blocks (a tile
        # never straddles two blocks); zeroing keys below kv_begin as well keeps that
        # true whatever the tiling.
        first_q_pos = context_len + step_start
        last_q_pos = context_len + tl.minimum(step_start + ROWS_Q, tile_end) - 1
        kv_end = tl.minimum(last_q_pos + 1, seq_len) if IS_CAUSAL else seq_len
        if SHARDED:
            # Local keys at positions <= last_q_pos: floor((last_q_pos - rank) / size) + 1
            # (the numerator stays > 0: last_q_pos >= 0 and rank < size).
            kv_end = tl.minimum((last_q_pos - SHARD_RANK + SHARD_SIZE) // SHARD_SIZE, seq_len)
        kv_begin = 0
        if USE_WINDOW:
            kv_begin = tl.maximum(first_q_pos - window + 1, 0)
        if USE_CHUNK:
            kv_begin = (tl.maximum(first_q_pos, 0) // chunk) * chunk

        # The sink is a logit with no value: start each row's running max at it, with a
        # running denominator of exp2(sink - sink) = 1.
        if USE_SINKS:
            sink = tl.load(sinks_ptr + q_head * stride_sinks, mask=row_valid, other=float("-inf"))
            m_i = sink.to(tl.float32) * LOG2E
            l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

        # Keys are visited in tiles of TILE_N <= BLOCK_SIZE slots that never straddle
        # two blocks. For large blocks (64, 128) with large head sizes a whole block of K
        # and V would not fit in registers next to the [BLOCK_M, D] accumulator; sub-tiles
        # keep the working set bounded independently of the cache's block size.
        for kv_tile in range(kv_begin // TILE_N, tl.cdiv(kv_end, TILE_N)):
            tile_pos = kv_tile * TILE_N
            # int64: NB * 2 * BS * Hkv * D may exceed 2**31 elements.
            physical_block = tl.load(table_row + tile_pos // BLOCK_SIZE).to(tl.int64)
            k_pos = tile_pos + offs_n
            k_needed = (k_pos >= kv_begin) & (k_pos < kv_end)
            # Positions for the mask and ALiBi: local slot j is position j * size + rank.
            k_at = k_pos * SHARD_SIZE + SHARD_RANK if SHARDED else k_pos
            kv_mask = k_needed[:, None] & dim_valid[None, :]
            k_ptrs = (
                cache_ptr
                + physical_block * stride_cb
                + (tile_pos % BLOCK_SIZE) * stride_cs
                + slot_offsets
            )
            m_i, l_i, acc = attend_kv_tile(
                q,
                k_ptrs,
                kv_mask,
                stride_ckv,
                k_at,
                k_needed,
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
                IS_CAUSAL,
                USE_WINDOW,
                USE_CHUNK,
                USE_SOFTCAP,
                USE_ALIBI,
                FP8_BITS,
                query_ptr.dtype.element_ty,
                DOT_PRECISION,
                DOT_IN_FP32,
            )

        # l_i == 0 only for rows that see no key and have no sink (padding rows, or an
        # empty non-causal context): their output is 0 and their lse -inf, as in the
        # oracle.
        seen = l_i > 0.0
        out = acc * (v_scale_value / tl.where(seen, l_i, 1.0))[:, None]
        tl.store(
            output_ptr
            + q_token[:, None] * stride_ot
            + q_head[:, None] * stride_oh
            + dims[None, :] * stride_od,
            out.to(output_ptr.dtype.element_ty),
            mask=io_mask,
        )
        if STORE_LSE:
            lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
            tl.store(lse_ptr + q_token * stride_lt + q_head * stride_lh, lse, mask=row_valid)


@triton.jit
def _split_kv_partial_kernel(
    query_ptr,
    cache_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    tile_offsets_ptr,
    alibi_slopes_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    k_scale,
    v_scale,
    softcap,
    window,
    chunk,
    num_reqs,
    search_iters,
    num_splits,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_pd,
    stride_ls,
    stride_lt,
    stride_lh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    stride_alibi,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    ROWS_Q: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    SHARDED: tl.constexpr,
    SHARD_RANK: tl.constexpr,
    SHARD_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    K_SCALE_FROM_PTR: tl.constexpr,
    V_SCALE_FROM_PTR: tl.constexpr,
    FP8_BITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    # Padded extents exist because tl.arange needs powers of two; loads and stores mask
    # the padding lanes (dims >= HEAD_DIM, heads >= GROUP, tokens past the tile).
    tl.static_assert(HEAD_DIM_PAD >= HEAD_DIM)
    tl.static_assert(GROUP_PAD >= GROUP)
    tl.static_assert(HEAD_DIM_PAD >= 16)
    tl.static_assert(TILE_N >= 16)
    tl.static_assert(IS_CAUSAL or not (USE_WINDOW or USE_CHUNK))
    tl.static_assert(not (USE_WINDOW and USE_CHUNK))
    # A context-parallel shard (SHARDED) holds keys j at positions j * SHARD_SIZE +
    # SHARD_RANK of causal full-attention layers: no window or chunk.
    tl.static_assert(not SHARDED or (IS_CAUSAL and not (USE_WINDOW or USE_CHUNK)))
    # Row r of a step is (query token r // GROUP_PAD, query head r % GROUP_PAD of this kv
    # head's group): one K/V load serves every query head sharing the kv head.
    BLOCK_M: tl.constexpr = ROWS_Q * GROUP_PAD
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453

    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if tile_id >= tl.load(tile_offsets_ptr + num_reqs):
        return
    request, tile = _find_tile(tile_offsets_ptr, num_reqs, search_iters, tile_id)

    q_start = tl.load(query_start_loc_ptr + request)
    q_len = tl.load(query_start_loc_ptr + request + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + request)
    context_len = seq_len - q_len
    if SHARDED:
        # seq_len counts this shard's keys; queries sit at the request's global positions,
        # from the whole lengths the launcher puts after the local ones.
        context_len = tl.load(seq_lens_ptr + num_reqs + request) - q_len
    tile_start = tile * BLOCK_Q
    tile_end = tl.minimum(tile_start + BLOCK_Q, q_len)

    rows = tl.arange(0, BLOCK_M)
    head_in_group = rows % GROUP_PAD
    q_head = kv_head * GROUP + head_in_group
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    # Scales in device memory are read here, never by the host (CUDA graphs replay
    # with new values).
    k_scale_value = k_scale
    if K_SCALE_FROM_PTR:
        k_scale_value = tl.load(k_scale_ptr)
    v_scale_value = v_scale
    if V_SCALE_FROM_PTR:
        v_scale_value = tl.load(v_scale_ptr)
    # k_scale multiplies every key, so it folds into the score scale; scores are in the
    # log2 domain (exp2 is the native instruction) except under a soft-cap, which
    # applies to natural-log scores (see attend_kv_tile).
    qk_scale = scale * k_scale_value
    if not USE_SOFTCAP:
        qk_scale = qk_scale * LOG2E
    slope = 0.0  # unread without ALiBi
    if USE_ALIBI:
        slope = tl.load(
            alibi_slopes_ptr + q_head * stride_alibi, mask=head_in_group < GROUP, other=0.0
        )
        slope = slope.to(tl.float32) * LOG2E
    offs_n = tl.arange(0, TILE_N)
    table_row = block_table_ptr + request.to(tl.int64) * stride_bt
    head_offsets = kv_head * stride_ch + dims[None, :] * stride_cd
    split64 = split.to(tl.int64)

    for step_start in range(tile_start, tile_end, ROWS_Q):
        q_idx = step_start + rows // GROUP_PAD
        row_valid = (q_idx < tile_end) & (head_in_group < GROUP)
        q_pos = context_len + q_idx
        # int64 before multiplying by strides: S * T * Hq * D may exceed 2**31 elements.
        q_token = (q_start + q_idx).to(tl.int64)
        io_mask = row_valid[:, None] & dim_valid[None, :]
        q = tl.load(
            query_ptr
            + q_token[:, None] * stride_qt
            + q_head[:, None] * stride_qh
            + dims[None, :] * stride_qd,
            mask=io_mask,
            other=0.0,
        )
        if DOT_IN_FP32:
            q = q.to(tl.float32)

        # Keys any row of this step can see: [kv_begin, kv_end).
        first_q_pos = context_len + step_start
        last_q_pos = context_len + tl.minimum(step_start + ROWS_Q, tile_end) - 1
        kv_end = last_q_pos + 1 if IS_CAUSAL else seq_len
        if SHARDED:
            # Local keys at positions <= last_q_pos (see the one-pass kernel).
            kv_end = tl.minimum((last_q_pos - SHARD_RANK + SHARD_SIZE) // SHARD_SIZE, seq_len)
        kv_begin = 0
        if USE_WINDOW:
            kv_begin = tl.maximum(first_q_pos - window + 1, 0)
        if USE_CHUNK:
            kv_begin = tl.maximum((first_q_pos // chunk) * chunk, 0)
        # This program's split: blocks [split_first, split_end) of the step's block
        # range, cut into num_splits nearly equal runs of consecutive blocks (sizes
        # differ by at most one; with more splits than blocks some runs are empty).
        first_block = kv_begin // BLOCK_SIZE
        num_blocks = tl.maximum((kv_end + BLOCK_SIZE - 1) // BLOCK_SIZE - first_block, 0)
        split_first = first_block + (num_blocks * split) // num_splits
        split_end = first_block + (num_blocks * (split + 1)) // num_splits
        lo = tl.maximum(split_first * BLOCK_SIZE, kv_begin)
        hi = tl.minimum(split_end * BLOCK_SIZE, kv_end)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

        # TILE_N keys per step, gathered through the block table one key at a time.
        for tile_lo in range(lo, hi, TILE_N):
            k_pos = tile_lo + offs_n
            # Only keys in [lo, hi) are read. Outside it a slot may hold anything (stale
            # data, NaN, a released block behind a window): loading it as 0 matters
            # because p = 0 times NaN would still be NaN.
            k_valid = k_pos < hi
            k_at = k_pos * SHARD_SIZE + SHARD_RANK if SHARDED else k_pos
            physical_block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(
                tl.int64
            )
            kv_mask = k_valid[:, None] & dim_valid[None, :]
            k_ptrs = (
                cache_ptr
                + physical_block[:, None] * stride_cb
                + (k_pos % BLOCK_SIZE)[:, None] * stride_cs
                + head_offsets
            )
            m_i, l_i, acc = attend_kv_tile(
                q,
                k_ptrs,
                kv_mask,
                stride_ckv,
                k_at,
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
                IS_CAUSAL,
                USE_WINDOW,
                USE_CHUNK,
                USE_SOFTCAP,
                USE_ALIBI,
                FP8_BITS,
                query_ptr.dtype.element_ty,
                DOT_PRECISION,
                DOT_IN_FP32,
            )

        # A row that saw no key in this split (l_i == 0) gets output 0 and lse -inf.
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc * (v_scale_value / l_safe)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
        tl.store(
            part_out_ptr
            + split64 * stride_ps
            + q_token[:, None] * stride_pt
            + q_head[:, None] * stride_ph
            + dims[None, :] * stride_pd,
            out,
            mask=io_mask,
        )
        tl.store(
            part_lse_ptr + split64 * stride_ls + q_token * stride_lt + q_head * stride_lh,
            lse,
            mask=row_valid,
        )


@triton.jit
def _split_kv_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    output_ptr,
    lse_ptr,
    sinks_ptr,
    query_start_loc_ptr,
    num_reqs,
    num_splits,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_pd,
    stride_ls,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    stride_od,
    stride_olt,
    stride_olh,
    stride_sinks,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_SINKS: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    # The grid covers every row of query; padding rows past the last request are left
    # untouched (their partials were never written).
    if token >= tl.load(query_start_loc_ptr + num_reqs):
        return
    token64 = token.to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < num_splits
    splits64 = splits.to(tl.int64)
    neg_inf = float("-inf")
    lse_s = tl.load(
        part_lse_ptr + splits64 * stride_ls + token64 * stride_lt + head * stride_lh,
        mask=split_valid,
        other=neg_inf,
    )
    row_max = tl.max(lse_s, 0)
    if USE_SINKS:
        # The sink is one more softmax logit with no value: it joins the denominator
        # here, once, never per split.
        sink = tl.load(sinks_ptr + head * stride_sinks).to(tl.float32)
        row_max = tl.maximum(row_max, sink)
    shift = tl.where(row_max == neg_inf, 0.0, row_max)
    weights = tl.exp(lse_s - shift)
    denom = tl.sum(weights, 0)
    if USE_SINKS:
        denom += tl.exp(sink - shift)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    # Splits that saw nothing are not read at all.
    used = split_valid & (lse_s != neg_inf)
    partial = tl.load(
        part_out_ptr
        + splits64[:, None] * stride_ps
        + token64 * stride_pt
        + head * stride_ph
        + dims[None, :] * stride_pd,
        mask=used[:, None] & dim_valid[None, :],
        other=0.0,
    )
    empty = denom == 0.0
    inv = 1.0 / tl.where(empty, 1.0, denom)
    out = tl.sum(partial * (weights * inv)[:, None], 0)
    tl.store(
        output_ptr + token64 * stride_ot + head * stride_oh + dims * stride_od,
        out.to(output_ptr.dtype.element_ty),
        mask=dim_valid,
    )
    if STORE_LSE:
        total = tl.where(empty, neg_inf, shift + tl.log(tl.where(empty, 1.0, denom)))
        tl.store(lse_ptr + token64 * stride_olt + head * stride_olh, total)


# The Triton interpreter stores bfloat16 as uint16 and its tl.dot multiplies those bit
# patterns (triton-lang/triton#11584; upstream: bf16 is unsupported there and should be
# cast to float32). Under the interpreter only, bf16 dot operands are upcast after the
# same rounding the GPU path applies; compiled kernels keep native bf16 dots.
#
# fp8 under the interpreter (attnkit.kernels._triton.fp8): a NaN in an unwritten slot
# must stay NaN so the tests catch a kernel that reads one, so under the interpreter the
# cache is passed as a uint8 view and decoded exactly by e4m3_bits_to_f32 (integer ops
# only: exact, and checked against torch for all 256 patterns). Compiled kernels keep
# the fp8 tensor and Triton's native conversion (hardware cvt on sm_89+); the FP8_BITS
# branch is a constexpr, so it costs them nothing.


# ------------------------------------------------------------------------ plan


@dataclasses.dataclass(frozen=True, eq=False)
class PagedAttentionPlan:
    """One step's validated batch metadata and launch layout (see :func:`plan_paged_attention`).

    Attributes:
        query_start_loc, seq_lens, block_table: the step's int32 metadata, checked.
        tile_offsets: int32 ``[B + 1]`` on the device: ``tile_offsets[b]`` is the first
            query tile of request ``b`` (``cdiv(q_len, block_q)`` tiles each).
        device: where every tensor of the step lives.
        num_reqs, max_query_len, max_seq_len: ``B`` and the bounds the caller gave.
        block_size, num_kv_heads: of the cache every layer of the step must use.
        causal, sliding_window, chunk_size: the mask.
        block_q: query tokens per tile (a power of two, at most :data:`BLOCK_Q_MAX`).
        num_tiles: programs along grid axis 0: the exact tile count when
            ``exact_grid``, else a bound that depends on shapes only.
        exact_grid: whether ``num_tiles`` came from the host copy of the offsets.
        num_splits: 0 for the one-pass kernel, ``S >= 1`` for split-KV with ``S`` splits.
        search_iters: binary-search steps over ``tile_offsets``.
        context_shard: ``(rank, size)`` when the cache is a decode context-parallel
            shard (local key ``j`` at position ``j * size + rank``); ``None`` otherwise.
        global_seq_lens: int32 ``[B]`` every request's whole length with
            ``context_shard`` (``seq_lens`` are then the shard's counts).
        shard_lens: int32 ``[2B]``, ``seq_lens`` then ``global_seq_lens``: what the
            kernels read as their lengths on a shard (one argument, as unsharded).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    tile_offsets: torch.Tensor
    device: torch.device
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    num_kv_heads: int
    causal: bool
    sliding_window: int | None
    chunk_size: int | None
    block_q: int
    num_tiles: int
    exact_grid: bool
    num_splits: int
    search_iters: int
    context_shard: tuple[int, int] | None = None
    global_seq_lens: torch.Tensor | None = None
    shard_lens: torch.Tensor | None = None


def count_query_tiles(query_lens: Sequence[int], block_q: int) -> int:
    """Tiles of ``block_q`` query tokens a batch with these query lengths has."""
    return sum(-(-q // block_q) for q in query_lens)


def _block_q(max_query_len: int) -> int:
    return min(int(triton.next_power_of_2(max(max_query_len, 1))), BLOCK_Q_MAX)


def _tile_bound(num_tokens: int | None, num_reqs: int, max_query_len: int, block_q: int) -> int:
    """Most tiles a batch of these shapes can have (each holds 1 to ``block_q`` tokens)."""
    bound = num_reqs * -(-max_query_len // block_q)
    if num_tokens is not None:
        bound = min(bound, num_tokens, (num_tokens + num_reqs * (block_q - 1)) // block_q)
    return bound


def choose_num_splits(
    num_reqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    block_size: int,
    num_sms: int = 132,
) -> int:
    """Pick ``num_splits`` for the split-KV path (a host-side heuristic).

    Stage 1 runs ``num_reqs * num_kv_heads`` programs per split (one query tile per
    request, the decode case). The heuristic:

    1. if those already fill the ``num_sms`` SMs, return 1 (splitting only adds merge
       traffic);
    2. else take the fewest splits that give at least one program per SM,
       ``ceil(num_sms / (num_reqs * num_kv_heads))``;
    3. cap it so every split keeps at least ``max(256, block_size)`` tokens (whole
       blocks) of the longest context, and at 32 splits; never below 1.

    Example: 1 request, 8 kv heads, 32k context, 132 SMs (H100/H200) -> 17 splits of
    about 1900 tokens; 64 requests x 8 kv heads -> 1.
    """
    num_reqs = check_int_arg("num_reqs", num_reqs, 0)
    num_kv_heads = check_int_arg("num_kv_heads", num_kv_heads, 1)
    max_seq_len = check_int_arg("max_seq_len", max_seq_len, 0)
    block_size = check_int_arg("block_size", block_size, 1)
    num_sms = check_int_arg("num_sms", num_sms, 1)
    programs = num_reqs * num_kv_heads
    if programs == 0 or programs >= num_sms:
        return 1
    wanted = -(-num_sms // programs)
    tokens_per_split = max(_MIN_TOKENS_PER_SPLIT, block_size)
    by_length = max_seq_len // tokens_per_split
    return max(1, min(wanted, by_length, _MAX_AUTO_SPLITS))


def _device_tile_offsets(
    query_start_loc: torch.Tensor, num_reqs: int, block_q: int, out: torch.Tensor | None
) -> torch.Tensor:
    """``tile_offsets`` computed on the device with torch ops (no host read)."""
    if out is None:
        out = torch.empty(num_reqs + 1, dtype=torch.int32, device=query_start_loc.device)
    out[:1].zero_()
    if num_reqs:
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        tiles = torch.div(q_lens + (block_q - 1), block_q, rounding_mode="floor")
        torch.cumsum(tiles, 0, dtype=torch.int32, out=out[1:])
    return out


def plan_paged_attention(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    block_size: int,
    num_kv_heads: int,
    causal: bool = True,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    num_tokens: int | None = None,
    num_splits: int | None = 0,
    num_sms: int = 1,
    device: torch.device | None = None,
    query_start_loc_cpu: torch.Tensor | None = None,
    copy_to_device: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None,
    tile_offsets_out: torch.Tensor | None = None,
    context_shard: tuple[int, int] | None = None,
    global_seq_lens: torch.Tensor | None = None,
) -> PagedAttentionPlan:
    """Validate a step's batch metadata once and lay out its launches.

    Args:
        query_start_loc, seq_lens, block_table: int32 ``[B + 1]``, ``[B]``, ``[B, MB]``
            on ``device`` (unit last stride).
        max_query_len, max_seq_len: bounds on every request's query count and context
            length (the launcher never reads tensor values to check them). With
            ``causal=True`` ``max_seq_len >= max_query_len``.
        block_size, num_kv_heads: of the paged cache (every layer's cache must match).
        causal, sliding_window, chunk_size: the mask (rules in
            :func:`attnkit.kernels.contracts.attention.check_mask_options`).
        num_tokens: a bound on ``query_start_loc[B]`` (the step's token count); tightens
            the shape-only grid bound. None: the bound uses ``max_query_len`` only.
        num_splits: 0 for the one-pass kernel; ``1 <= S <= 256`` for split-KV with ``S``
            splits (needs ``max_query_len <= 16``); None to choose: split-KV with
            :func:`choose_num_splits` splits when the batch is causal plain decode
            (``max_query_len <= 1``) and that heuristic asks for more than one split.
        num_sms: streaming multiprocessors the automatic choice fills.
        device: where the tensors must be (default: ``query_start_loc``'s device).
        query_start_loc_cpu: the same offsets on the CPU (int32 ``[B + 1]``; the values
            must equal ``query_start_loc``'s, which is not checked). With it the
            tile offsets are computed on the host, copied with ``copy_to_device`` (default
            ``Tensor.to``) and the grid is exact; without it they are computed on the
            device and the grid is the shape-only bound (what a CUDA graph needs).
        tile_offsets_out: int32 ``[B + 1]`` buffer on ``device`` to write the tile offsets
            into (fixed addresses for CUDA graphs); a new tensor when None.
        context_shard: ``(rank, size)`` for a decode context-parallel shard: ``seq_lens``
            and the block table hold the shard's keys (local key ``j`` at position ``j *
            size + rank``); causal full attention only (no window or chunk). The
            kernels then return the shard's partial attention, to be merged by lse.
        global_seq_lens: int32 ``[B]`` on ``device``: every request's whole length
            (where its queries sit); required with ``context_shard``.

    Raises:
        ValueError (TypeError too for wrong Python types): naming the argument.
    """
    if device is None:
        device = require_tensor(
            "query_start_loc", query_start_loc, "an int32 torch.Tensor [B + 1]"
        ).device
    elif not isinstance(device, torch.device):
        raise KernelTypeError(f"device: expected a torch.device or None, got {describe(device)}")
    num_reqs = check_batch_metadata(seq_lens, query_start_loc, block_table, device, of="plan")
    causal, sliding_window, chunk_size = check_mask_options(causal, sliding_window, chunk_size)
    max_query_len = check_int_arg("max_query_len", max_query_len, 0)
    context_shard, global_seq_lens = _check_shard(
        context_shard, global_seq_lens, num_reqs, device, causal, sliding_window, chunk_size
    )
    # Only causal requests must hold their queries among their keys (a shard holds a
    # share of them).
    least = max_query_len if causal and context_shard is None else 0
    max_seq_len = check_int_arg("max_seq_len", max_seq_len, least)
    block_size = check_int_arg("block_size", block_size, 1)
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"kv_cache: expected block size in {SUPPORTED_BLOCK_SIZES}, got {block_size}"
        )
    num_kv_heads = check_int_arg("num_kv_heads", num_kv_heads, 1)
    check_block_table_width(block_table, block_size, max_seq_len)
    if num_tokens is not None:
        num_tokens = check_int_arg("num_tokens", num_tokens, 0)
    num_sms = check_int_arg("num_sms", num_sms, 1)
    if num_splits is None:
        splits = 0
        if causal and num_reqs and 0 < max_query_len <= AUTO_SPLIT_MAX_QUERY_LEN:
            chosen = choose_num_splits(num_reqs, num_kv_heads, max_seq_len, block_size, num_sms)
            splits = chosen if chosen > 1 else 0
        num_splits = splits
    else:
        num_splits = check_int_arg("num_splits", num_splits, 0, MAX_NUM_SPLITS)
        if num_splits and max_query_len > SPLIT_KV_MAX_QUERY_LEN:
            raise ValueError(
                f"max_query_len: expected an int <= {SPLIT_KV_MAX_QUERY_LEN} with "
                f"num_splits={num_splits} (split-KV is a decode path), got {max_query_len}"
            )

    block_q = _block_q(max_query_len)
    bound = _tile_bound(num_tokens, num_reqs, max_query_len, block_q)
    if tile_offsets_out is not None:
        out_buf = require_tensor(
            "tile_offsets_out", tile_offsets_out, "an int32 torch.Tensor [B + 1] or None"
        )
        if (
            out_buf.dtype != torch.int32
            or tuple(out_buf.shape) != (num_reqs + 1,)
            or not out_buf.is_contiguous()
        ):
            raise ValueError(
                f"tile_offsets_out: expected a contiguous torch.int32 tensor [{num_reqs + 1}], "
                f"got {describe(out_buf)}"
            )
        check_device("tile_offsets_out", out_buf, device, "plan")
    exact = query_start_loc_cpu is not None
    if query_start_loc_cpu is not None:
        qsl_cpu = require_tensor(
            "query_start_loc_cpu", query_start_loc_cpu, "an int32 CPU torch.Tensor [B + 1]"
        )
        if (
            qsl_cpu.dtype != torch.int32
            or tuple(qsl_cpu.shape) != (num_reqs + 1,)
            or qsl_cpu.device.type != "cpu"
        ):
            raise ValueError(
                f"query_start_loc_cpu: expected an int32 CPU tensor [{num_reqs + 1}], "
                f"got {describe(qsl_cpu)}"
            )
        host = torch.zeros(num_reqs + 1, dtype=torch.int32)
        if num_reqs:
            lens = qsl_cpu[1:].to(torch.int64) - qsl_cpu[:-1].to(torch.int64)
            if bool((lens < 0).any()):
                raise ValueError(
                    "query_start_loc_cpu: expected non-decreasing offsets, got "
                    f"{[int(x) for x in qsl_cpu]}"
                )
            host[1:] = torch.cumsum(
                torch.div(lens + block_q - 1, block_q, rounding_mode="floor"), 0
            )
        num_tiles = int(host[-1])
        if tile_offsets_out is not None:
            tile_offsets = tile_offsets_out
            tile_offsets.copy_(host, non_blocking=True)
        elif copy_to_device is not None:
            tile_offsets = copy_to_device(host, device)
        else:
            tile_offsets = host.to(device)
    else:
        num_tiles = bound
        tile_offsets = _device_tile_offsets(query_start_loc, num_reqs, block_q, tile_offsets_out)
    if max_query_len == 0:
        num_tiles = 0
    return PagedAttentionPlan(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        tile_offsets=tile_offsets,
        device=device,
        num_reqs=num_reqs,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        causal=causal,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        block_q=block_q,
        num_tiles=num_tiles,
        exact_grid=exact,
        num_splits=num_splits,
        search_iters=search_iters(num_reqs),
        context_shard=context_shard,
        global_seq_lens=global_seq_lens,
        shard_lens=(torch.cat([seq_lens, global_seq_lens]) if global_seq_lens is not None else None),
    )


def _check_shard(
    context_shard: object,
    global_seq_lens: object,
    num_reqs: int,
    device: torch.device,
    causal: bool,
    sliding_window: int | None,
    chunk_size: int | None,
) -> tuple[tuple[int, int] | None, torch.Tensor | None]:
    """``(context_shard, global_seq_lens)`` checked: both or neither; a shard only of a
    causal, unwindowed, unchunked step."""
    shard = check_shard_lens(context_shard, global_seq_lens)
    if shard is None:
        return None, None
    if not causal or sliding_window is not None or chunk_size is not None:
        raise ValueError(
            "context_shard: expected a causal step without sliding_window or chunk_size "
            f"(shards are of full attention), got causal={causal}, "
            f"sliding_window={sliding_window}, chunk_size={chunk_size}"
        )
    totals = check_index_tensor("global_seq_lens", global_seq_lens, (num_reqs,), device, "plan")
    return shard, totals


# ------------------------------------------------------------------------ workspace


class SplitKVWorkspace(NamedTuple):
    """Scratch between the two split-KV stages.

    ``partial_out``: float32 ``[S, T', Hq, D]``; ``partial_lse``: float32 ``[S, T', Hq]``;
    ``S >= num_splits`` and ``T' >= T`` (a buffer sized for the largest batch serves
    every smaller one). Any strides. Contents on entry do not matter.
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor


def split_kv_workspace(
    num_splits: int,
    num_tokens: int,
    num_q_heads: int,
    head_dim: int,
    *,
    device: torch.device | str | None = None,
) -> SplitKVWorkspace:
    """Allocate a :class:`SplitKVWorkspace` for up to ``num_splits`` x ``num_tokens``."""
    num_splits = check_int_arg("num_splits", num_splits, 1)
    num_tokens = check_int_arg("num_tokens", num_tokens, 0)
    num_q_heads = check_int_arg("num_q_heads", num_q_heads, 1)
    head_dim = check_int_arg("head_dim", head_dim, 1)
    if device is not None and not isinstance(device, (str, torch.device)):
        raise KernelTypeError(
            f"device: expected a torch.device, a device string or None, got {describe(device)}"
        )
    try:
        device = torch.device(device) if isinstance(device, str) else device
    except RuntimeError as exc:
        raise ValueError(
            f"device: expected a device string such as 'cuda:0', got {device!r}"
        ) from exc
    return SplitKVWorkspace(
        partial_out=torch.empty(
            (num_splits, num_tokens, num_q_heads, head_dim), dtype=torch.float32, device=device
        ),
        partial_lse=torch.empty(
            (num_splits, num_tokens, num_q_heads), dtype=torch.float32, device=device
        ),
    )


def _check_workspace(
    workspace: object,
    num_splits: int,
    num_tokens: int,
    num_q_heads: int,
    head_dim: int,
    device: torch.device,
) -> SplitKVWorkspace:
    if not isinstance(workspace, tuple) or len(workspace) != 2:
        raise KernelTypeError(
            "workspace: expected a SplitKVWorkspace(partial_out, partial_lse), "
            f"got {describe(workspace)}"
        )
    part_out, part_lse = workspace
    for name, t, tail in (
        ("partial_out", part_out, (num_q_heads, head_dim)),
        ("partial_lse", part_lse, (num_q_heads,)),
    ):
        want = f"[S >= {num_splits}, T >= {num_tokens}, {', '.join(map(str, tail))}]"
        if not isinstance(t, torch.Tensor):
            raise KernelTypeError(f"workspace.{name}: expected a tensor, got {describe(t)}")
        if (
            t.dim() != 2 + len(tail)
            or t.shape[0] < num_splits
            or t.shape[1] < num_tokens
            or tuple(t.shape[2:]) != tail
        ):
            raise ValueError(f"workspace.{name}: expected shape {want}, got {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise ValueError(f"workspace.{name}: expected dtype torch.float32, got {t.dtype}")
        check_device(f"workspace.{name}", t, device)
    return SplitKVWorkspace(part_out, part_lse)


# ------------------------------------------------------------------------ per-layer checks


def check_query(query: object, device: torch.device | None = None) -> torch.Tensor:
    """``query`` ``[T, Hq, D]`` of a supported dtype (and head size), on ``device``."""
    query = check_query_layout(query)
    check_dtype("query", query, SUPPORTED_DTYPES)
    check_device("query", query, device, "plan")
    return query


def check_kv_cache(
    kv_cache: object,
    query: torch.Tensor,
    *,
    block_size: int | None = None,
    num_kv_heads: int | None = None,
) -> torch.Tensor:
    """A paged cache the kernels read for ``query`` (and, when given, of the plan's
    ``block_size`` / ``num_kv_heads``)."""
    kv_cache = check_cache_layout(kv_cache, query)
    if kv_cache.dtype not in (query.dtype, FP8_DTYPE):
        raise ValueError(
            f"kv_cache: expected dtype {query.dtype} (the query dtype) or {FP8_DTYPE}, "
            f"got {kv_cache.dtype}"
        )
    num_blocks, _, cache_block_size, cache_kv_heads, _ = kv_cache.shape
    head_dim = query.shape[2]
    check_device("kv_cache", kv_cache, query.device)
    if num_blocks == 0:
        raise ValueError(
            f"kv_cache: expected at least one block (NB >= 1), got {describe(kv_cache)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError(
            "kv_cache: expected a contiguous tensor, got a non-contiguous one "
            f"({describe(kv_cache)}, strides {tuple(kv_cache.stride())})"
        )
    if cache_block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"kv_cache: expected block size in {SUPPORTED_BLOCK_SIZES}, got {cache_block_size}"
        )
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"query: expected head size in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}"
        )
    if block_size is not None and cache_block_size != block_size:
        raise ValueError(
            f"kv_cache: expected block size {block_size} (the plan's block_size), "
            f"got {cache_block_size}"
        )
    if num_kv_heads is not None and cache_kv_heads != num_kv_heads:
        raise ValueError(
            f"kv_cache: expected {num_kv_heads} kv heads (the plan's num_kv_heads), "
            f"got {cache_kv_heads}"
        )
    return kv_cache


def _check_like(
    name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, of: str
) -> torch.Tensor:
    t = require_tensor(name, t, f"a {of} torch.Tensor or None")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    check_device(name, t, device)
    return t


# ------------------------------------------------------------------------ launch


def _rows_q(block_q: int, group_pad: int, max_rows: int = _MAX_ROWS) -> int:
    """Query tokens per inner step: the tile's ``block_q`` while the step stays within
    ``max_rows`` rows (unless one group alone is wider), at least ``_MIN_ROWS`` rows."""
    rows_q = min(block_q, max(1, max_rows // group_pad))
    return max(rows_q, _MIN_ROWS // group_pad, 1)


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchShape:
    """Register-tile choices of one launch (``_launch_shape``)."""

    rows_q: int
    """Query tokens per inner step (``ROWS_Q``; ``rows_q * GROUP_PAD`` rows)."""
    tile_n: int
    """Keys per inner step (``TILE_N``)."""
    num_warps: int
    num_stages: int
    """Software-pipelining depth of the one-pass kernel's K/V loads (Triton's CUDA
    default is 3)."""
    split_num_stages: int
    """The same for the split-KV partial kernel (its per-key gather pipelines
    differently)."""
    split_num_warps: int = 0
    """Warps of the split-KV partial kernel; 0: ``num_warps``."""


def _launch_shape(
    head_dim_pad: int,
    block_size: int,
    block_q: int,
    group_pad: int,
    *,
    fp32: bool,
    fp8_kv: bool,
    sharded: bool = False,
) -> LaunchShape:
    """Tile and warp choices that keep every declared variant free of register spills.

    A ``[TILE_N, D]`` tile of K and of V sits in registers next to the ``[M, D]`` fp32
    accumulator (``M = ROWS_Q * GROUP_PAD`` rows).

    * 16-bit operands (tensor cores): up to 64 rows; 64 keys for heads up to 64, 32
      above (never more than a cache block: the one-pass kernel's tiles do not straddle
      blocks). Heads of 128 and more get 8 warps, which halves every thread's share of
      the accumulator and of the tiles: with 4 warps the ``D = 128`` variants came within
      a few registers of the 255 limit on sm_80 (246) and the fp8-cache one spilled 8
      bytes on sm_100.
    * float32 operands run IEEE dots on the FMA units, whose operand layout keeps a
      thread's rows of ``q`` and columns of ``k`` over the whole ``D`` in registers: at 64
      rows and 32-64 keys every head size from 32 up spilled (up to 1.2 KB at ``D =
      256``). Here: at most 32 rows, 16 keys, and 8 warps at ``D = 256`` or once the
      ``[M, D]`` tile reaches 8192 elements (4 warps below: 8 warps at ``M = 16, D =
      128`` spilled 32 bytes on sm_90; 4 warps at ``D = 256`` spilled 8-40 bytes on
      sm_90/100 where 8 warps need 80 registers).
    * Pipeline stages: ptxas sometimes settles on a low register target (48-128) and
      spills 8-16 bytes for one stage count and not another, so each choice is the
      measured clean one. float32, one-pass kernel: 3 stages (2 spilled at ``D`` 64 on
      sm_100, 1 at ``D`` 16-96), but 1 at ``D = 256`` and over an fp8 cache from ``D =
      128`` (2-3 stages: 200-300 bytes at ``D = 128``, 32 registers and a 3 KB spill at
      ``D = 256``, sm_90/100). float32 split-KV: 1 stage (2-3 spilled 8-24 bytes on
      sm_80). 16-bit: 3 stages, but 2 for the ``D = 16`` prefill tile (3 spilled 16
      bytes on sm_100; 2 stages spill at the ``D = 16`` decode tile instead).

    * Context-parallel shards (``sharded``) add the position arithmetic of their keys:
      16-bit heads of 256 at 64 rows then spilled 48 bytes at 255 registers on sm_100,
      so shards of that width take half the rows (32), and 2 stages over a cache of the
      model dtype (3 spilled 8 bytes on sm_90 at block 64; 2 spill 8-16 bytes over fp8
      at block 16, which keeps 3: one of those, bf16 prefill over fp8 at block 16, still
      spills 8 bytes on sm_90, the one spilling variant of the ``--full`` report, left
      as measured rather than fitted to ptxas's choice). Their split-KV partial kernel
      spilled 8-16 bytes at low register targets (64-128) with the unsharded choices:
      16-bit and float32 up to ``D = 64`` take 2 stages there, float32 over an fp8 cache
      at ``D = 256`` 4 warps (each measured clean on sm_80/90/100; 2 stages spilled 224
      bytes for float32 over fp8 at ``D = 128``, 4 warps 16 at ``D = 256`` without fp8).

    Figures from the ``--full`` compile report (``benchmarks/compile_report.py``); with
    these choices no declared variant spills on sm_80/90/100.
    """
    if fp32:
        rows_q = _rows_q(block_q, group_pad, _MAX_ROWS_FP32)
        tile_n = 16
        wide = head_dim_pad >= 256
        num_warps = 8 if wide or rows_q * group_pad * head_dim_pad >= 8192 else 4
        num_stages = 1 if wide or (fp8_kv and head_dim_pad >= 128) else 3
        split_num_stages = 1
        if sharded and wide and fp8_kv:
            return LaunchShape(
                rows_q, min(tile_n, block_size), num_warps, num_stages, 1, split_num_warps=4
            )
        if sharded and head_dim_pad <= 64:
            split_num_stages = 2
    else:
        rows_q = _rows_q(block_q, group_pad)
        shard_256 = sharded and head_dim_pad >= 256
        if shard_256:
            rows_q = max(rows_q // 2, _MIN_ROWS // group_pad, 1)
        tile_n = 64 if head_dim_pad <= 64 else 32
        num_warps = 8 if head_dim_pad >= 128 else 4
        num_stages = 2 if head_dim_pad == 16 and rows_q * group_pad > _MIN_ROWS else 3
        if shard_256 and not fp8_kv:
            num_stages = 2
        split_num_stages = 2 if sharded else 3
    return LaunchShape(rows_q, min(tile_n, block_size), num_warps, num_stages, split_num_stages)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: PagedAttentionPlan,
    *,
    scale: float,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: SplitKVWorkspace | None = None,
) -> torch.Tensor:
    """Attention of ``query`` ``[T, Hq, D]`` over the paged ``kv_cache`` for a planned step.

    The new tokens' K/V must already be in the cache (see ``write_kv_cache``). Checks
    only the layer's own arguments (the plan checked the metadata) and launches the
    plan's path.

    Args:
        query: ``[T, Hq, D]`` float32/float16/bfloat16, any strides, on the plan device.
        kv_cache: ``[NB, 2, BS, Hkv, D]`` contiguous, the query dtype or
            ``torch.float8_e4m3fn``; ``BS`` and ``Hkv`` those of the plan.
        plan: from :func:`plan_paged_attention`.
        scale: multiplies ``q . k``.
        logits_soft_cap, alibi_slopes, sinks: as for the oracle; the two ``[Hq]``
            vectors may be float32, float16 or bfloat16.
        k_scale, v_scale: multiply the cached keys / values: None (1.0), a float > 0, or
            a one-element float32 device tensor (read by the kernel, never by the host).
            Required with an fp8 cache (which stores ``key / k_scale``).
        output: optional ``[T, Hq, D]`` of the query dtype to write into.
        lse: optional float32 ``[T, Hq]`` to receive the natural-log lse (sink included).
        workspace: split-KV scratch (:func:`split_kv_workspace`); allocated per call when
            the plan uses split-KV and none is given; ignored otherwise.

    Returns:
        ``output`` (allocated when not given).
    """
    if not isinstance(plan, PagedAttentionPlan):
        raise KernelTypeError(
            f"plan: expected a PagedAttentionPlan (plan_paged_attention), got {describe(plan)}"
        )
    device = plan.device
    query = check_query(query, device)
    kv_cache = check_kv_cache(
        kv_cache, query, block_size=plan.block_size, num_kv_heads=plan.num_kv_heads
    )
    num_tokens, num_q_heads, head_dim = query.shape
    scale = check_finite_float("scale", scale)
    logits_soft_cap = check_logits_soft_cap(logits_soft_cap)
    alibi_slopes = check_head_vector("alibi_slopes", alibi_slopes, num_q_heads, device)
    sinks = check_head_vector("sinks", sinks, num_q_heads, device)
    k_scale = check_kv_scale("k_scale", k_scale, device)
    v_scale = check_kv_scale("v_scale", v_scale, device)
    is_fp8 = kv_cache.dtype == FP8_DTYPE
    if is_fp8 and (k_scale is None or v_scale is None):
        missing = "k_scale" if k_scale is None else "v_scale"
        raise ValueError(
            f"{missing}: expected a float or a one-element torch.float32 tensor with a "
            f"{FP8_DTYPE} kv_cache, got None"
        )
    if lse is not None:
        lse = _check_like(
            "lse",
            lse,
            (num_tokens, num_q_heads),
            torch.float32,
            device,
            f"float32 [T, Hq]=[{num_tokens}, {num_q_heads}]",
        )
    if output is None:
        output = torch.empty_like(query)
    else:
        output = require_tensor("output", output, "a torch.Tensor [T, Hq, D] or None")
        if tuple(output.shape) != tuple(query.shape):
            raise ValueError(
                f"output: expected shape {tuple(query.shape)} (the query shape), "
                f"got {tuple(output.shape)}"
            )
        if output.dtype != query.dtype:
            raise ValueError(
                f"output: expected dtype {query.dtype} (the query dtype), got {output.dtype}"
            )
        check_device("output", output, device)
    if plan.num_splits and workspace is not None:
        workspace = _check_workspace(
            workspace, plan.num_splits, num_tokens, num_q_heads, head_dim, device
        )
    if num_tokens == 0 or plan.num_tiles == 0:
        return output

    group = num_q_heads // plan.num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    shape = _launch_shape(
        head_dim_pad,
        plan.block_size,
        plan.block_q,
        group_pad,
        fp32=query.dtype == torch.float32,
        fp8_kv=is_fp8,
        sharded=plan.context_shard is not None,
    )
    fp8_bits = is_fp8 and INTERPRETED
    # A uint8 view shares the storage (no copy); see the note on INTERPRETED.
    cache_arg = kv_cache.view(torch.uint8) if fp8_bits else kv_cache
    # Scales given as tensors are read by the kernel (the float slot is then unused);
    # floats travel as arguments (seq_lens stands in for the unread pointer).
    k_ptr = k_scale if isinstance(k_scale, torch.Tensor) else plan.seq_lens
    v_ptr = v_scale if isinstance(v_scale, torch.Tensor) else plan.seq_lens
    k_value = k_scale if isinstance(k_scale, float) else 1.0
    v_value = v_scale if isinstance(v_scale, float) else 1.0
    common = {
        "query_ptr": query,
        "cache_ptr": cache_arg,
        "query_start_loc_ptr": plan.query_start_loc,
        # A shard's whole lengths follow its local ones ([2B]; no extra kernel argument).
        "seq_lens_ptr": plan.shard_lens if plan.shard_lens is not None else plan.seq_lens,
        "block_table_ptr": plan.block_table,
        "tile_offsets_ptr": plan.tile_offsets,
        "alibi_slopes_ptr": alibi_slopes if alibi_slopes is not None else plan.seq_lens,
        "k_scale_ptr": k_ptr,
        "v_scale_ptr": v_ptr,
        "scale": scale,
        "k_scale": k_value,
        "v_scale": v_value,
        "softcap": logits_soft_cap if logits_soft_cap is not None else 1.0,
        "window": plan.sliding_window if plan.sliding_window is not None else 0,
        "chunk": plan.chunk_size if plan.chunk_size is not None else 1,
        "num_reqs": plan.num_reqs,
        "search_iters": plan.search_iters,
        "stride_qt": query.stride(0),
        "stride_qh": query.stride(1),
        "stride_qd": query.stride(2),
        "stride_cb": kv_cache.stride(0),
        "stride_ckv": kv_cache.stride(1),
        "stride_cs": kv_cache.stride(2),
        "stride_ch": kv_cache.stride(3),
        "stride_cd": kv_cache.stride(4),
        "stride_bt": plan.block_table.stride(0),
        "stride_alibi": alibi_slopes.stride(0) if alibi_slopes is not None else 0,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": head_dim_pad,
        "GROUP": group,
        "GROUP_PAD": group_pad,
        "BLOCK_Q": plan.block_q,
        "ROWS_Q": shape.rows_q,
        "BLOCK_SIZE": plan.block_size,
        "TILE_N": shape.tile_n,
        "IS_CAUSAL": plan.causal,
        "SHARDED": plan.context_shard is not None,
        # Constexprs: one compilation per rank of a group (a handful), and no extra
        # runtime arguments in unsharded launches.
        "SHARD_RANK": plan.context_shard[0] if plan.context_shard is not None else 0,
        "SHARD_SIZE": plan.context_shard[1] if plan.context_shard is not None else 1,
        "USE_WINDOW": plan.sliding_window is not None,
        "USE_CHUNK": plan.chunk_size is not None,
        "USE_SOFTCAP": logits_soft_cap is not None,
        "USE_ALIBI": alibi_slopes is not None,
        "K_SCALE_FROM_PTR": isinstance(k_scale, torch.Tensor),
        "V_SCALE_FROM_PTR": isinstance(v_scale, torch.Tensor),
        "FP8_BITS": fp8_bits,
        # fp32 inputs would otherwise default to TF32 on NVIDIA, far outside fp32
        # tolerances; the setting has no effect on 16-bit operands (tensor cores).
        "DOT_PRECISION": "ieee",
        "DOT_IN_FP32": INTERPRETED and query.dtype == torch.bfloat16,
        "num_warps": shape.num_warps,
        # Explicit, not Triton's default: Triton 3.9 warns when the option is left unset
        # (its default flips in 3.10), and the test suite turns warnings into errors.
        "enable_fp_fusion": True,
    }
    if not plan.num_splits:
        _unified_attention_kernel[(plan.num_tiles, plan.num_kv_heads)](
            output_ptr=output,
            lse_ptr=lse if lse is not None else output,
            sinks_ptr=sinks if sinks is not None else plan.seq_lens,
            stride_ot=output.stride(0),
            stride_oh=output.stride(1),
            stride_od=output.stride(2),
            stride_lt=lse.stride(0) if lse is not None else 0,
            stride_lh=lse.stride(1) if lse is not None else 0,
            stride_sinks=sinks.stride(0) if sinks is not None else 0,
            USE_SINKS=sinks is not None,
            STORE_LSE=lse is not None,
            num_stages=shape.num_stages,
            **common,
        )
        return output

    if workspace is None:
        workspace = split_kv_workspace(
            plan.num_splits, num_tokens, num_q_heads, head_dim, device=device
        )
    part_out, part_lse = workspace
    _split_kv_partial_kernel[(plan.num_tiles, plan.num_kv_heads, plan.num_splits)](
        part_out_ptr=part_out,
        part_lse_ptr=part_lse,
        num_splits=plan.num_splits,
        stride_ps=part_out.stride(0),
        stride_pt=part_out.stride(1),
        stride_ph=part_out.stride(2),
        stride_pd=part_out.stride(3),
        stride_ls=part_lse.stride(0),
        stride_lt=part_lse.stride(1),
        stride_lh=part_lse.stride(2),
        num_stages=shape.split_num_stages,
        **{**common, "num_warps": shape.split_num_warps or shape.num_warps},
    )
    merge_split_kv(workspace, output, plan, lse=lse, sinks=sinks)
    return output


def merge_split_kv(
    workspace: SplitKVWorkspace,
    output: torch.Tensor,
    plan: PagedAttentionPlan,
    *,
    lse: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stage 2 of split-KV: merge the ``plan.num_splits`` partials of every (token, head).

    ``workspace`` holds stage 1's float32 partial outputs (each divided by its own
    denominator) and natural-log lse per split; a split with lse ``-inf`` saw nothing
    and is not read. Each (token, head) of ``output`` ``[T, H, Dv]`` gets the
    lse-weighted sum of its partials (``Dv`` is the partials' width, which is the value
    width: the head size for paged attention, ``kv_lora_rank`` for absorbed MLA); a sink
    logit (``sinks`` ``[H]``) joins the denominator once. ``lse`` (float32 ``[T, H]``)
    receives the merged log-sum-exp. Rows at or past ``query_start_loc[B]`` are left
    untouched. Allocates nothing and reads no device value back to the host.

    Args:
        workspace: stage 1's scratch, ``[S >= num_splits, T' >= T, H, Dv]`` and
            ``[S, T', H]``, float32.
        output: ``[T, H, Dv]`` float32/float16/bfloat16, any strides.
        plan: the step's split-KV plan (``plan.num_splits >= 1``).
        lse: optional float32 ``[T, H]``, any strides.
        sinks: optional ``[H]`` sink logits (float32/float16/bfloat16/float64).

    Returns:
        ``output``.
    """
    if not isinstance(plan, PagedAttentionPlan):
        raise KernelTypeError(
            f"plan: expected a PagedAttentionPlan (plan_paged_attention), got {describe(plan)}"
        )
    if not plan.num_splits:
        raise ValueError(
            "plan: expected a split-KV plan (num_splits >= 1), got one with num_splits=0"
        )
    device = plan.device
    output = require_tensor("output", output, "a torch.Tensor [T, H, Dv]")
    if output.dim() != 3 or 0 in output.shape[1:]:
        raise ValueError(f"output: expected shape [T, H >= 1, Dv >= 1], got {tuple(output.shape)}")
    check_dtype("output", output, SUPPORTED_DTYPES)
    check_device("output", output, device)
    num_tokens, num_heads, head_dim = output.shape
    part_out, part_lse = _check_workspace(
        workspace, plan.num_splits, num_tokens, num_heads, head_dim, device
    )
    if lse is not None:
        lse = _check_like(
            "lse",
            lse,
            (num_tokens, num_heads),
            torch.float32,
            device,
            f"float32 [T, H]=[{num_tokens}, {num_heads}]",
        )
    sinks = check_head_vector("sinks", sinks, num_heads, device)
    if num_tokens == 0:
        return output
    _split_kv_merge_kernel[(num_tokens, num_heads)](
        part_out_ptr=part_out,
        part_lse_ptr=part_lse,
        output_ptr=output,
        # Without lse the merge kernel never touches lse_ptr; part_lse stands in for it.
        lse_ptr=lse if lse is not None else part_lse,
        sinks_ptr=sinks if sinks is not None else plan.seq_lens,
        query_start_loc_ptr=plan.query_start_loc,
        num_reqs=plan.num_reqs,
        num_splits=plan.num_splits,
        stride_ps=part_out.stride(0),
        stride_pt=part_out.stride(1),
        stride_ph=part_out.stride(2),
        stride_pd=part_out.stride(3),
        stride_ls=part_lse.stride(0),
        stride_lt=part_lse.stride(1),
        stride_lh=part_lse.stride(2),
        stride_ot=output.stride(0),
        stride_oh=output.stride(1),
        stride_od=output.stride(2),
        stride_olt=lse.stride(0) if lse is not None else 0,
        stride_olh=lse.stride(1) if lse is not None else 0,
        stride_sinks=sinks.stride(0) if sinks is not None else 0,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        SPLITS_PAD=triton.next_power_of_2(plan.num_splits),
        USE_SINKS=sinks is not None,
        STORE_LSE=lse is not None,
        enable_fp_fusion=True,
    )
    return output
