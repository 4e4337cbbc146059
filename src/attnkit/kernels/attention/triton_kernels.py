"""The paged-attention kernels (``@triton.jit``): the one-pass kernel and the two stages
of split-KV (partial attention per split, then the merge). Their launcher, the plan and
the grid are described in :mod:`attnkit.kernels.attention.triton`; the key tile both
kernels share is :func:`attnkit.kernels.attention.triton_tile.attend_kv_tile`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnkit.kernels._triton.varlen import find_segment
from attnkit.kernels.attention.triton_tile import attend_kv_tile

# Kernels whose work is matrix products (q k^T, p v): with 16-bit inputs they must run on tensor
# cores (benchmarks/compile_report.py fails a 16-bit variant without MMA instructions).
TENSOR_CORE_KERNELS = ("_unified_attention_kernel", "_split_kv_partial_kernel")


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
    draft_anc_ptr,
    draft_counts_ptr,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    key_ends_ptr,
    scale,
    k_scale,
    v_scale,
    kv_scales_ptr,
    stride_sb,
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
    PER_HEAD_SCALES: tl.constexpr,
    DYN_SCALES: tl.constexpr,
    USE_TREE: tl.constexpr = False,
    MM_PREFIX: tl.constexpr = False,
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
    # A block's scales are [2, BLOCK_SIZE, Hkv], contiguous (the launcher checks it).
    num_kv_heads = tl.num_programs(1)
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

    # Quantisation scales: a float argument, or read from device memory (a CUDA graph
    # replays with new values), one per tensor or (PER_HEAD_SCALES) one per K/V head. k_scale is folded into the score scale,
    # v_scale applied to the final output: both are exact rewrites of "dequantise, then
    # attend" up to rounding.
    k_scale_value = k_scale
    if K_SCALE_FROM_PTR:
        k_scale_value = tl.load(k_scale_ptr + kv_head * PER_HEAD_SCALES)
    v_scale_value = v_scale
    if V_SCALE_FROM_PTR:
        v_scale_value = tl.load(v_scale_ptr + kv_head * PER_HEAD_SCALES)
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
        # A draft tree: each row's ancestor bitmask, and where the request's drafts start.
        tree_lo = tl.zeros([BLOCK_M], dtype=tl.int32)
        tree_hi = tl.zeros([BLOCK_M], dtype=tl.int32)
        tree_first = seq_len
        if USE_TREE:
            anc = tl.load(draft_anc_ptr + q_token, mask=row_valid, other=0)
            tree_lo = (anc & 0xFFFFFFFF).to(tl.int32)
            tree_hi = (anc >> 32).to(tl.int32)
            tree_first = seq_len - tl.load(draft_counts_ptr + request)

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
        # Bidirectional image ranges: each row's last visible key (its range's end), so
        # the rows' keys stay one contiguous run.
        q_last = q_pos
        if MM_PREFIX:
            q_last = tl.load(key_ends_ptr + q_token, mask=row_valid, other=0) - 1
            q_last = tl.maximum(q_last, q_pos)
            kv_end = tl.minimum(tl.maximum(kv_end, tl.max(tl.where(row_valid, q_last, 0)) + 1), seq_len)
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
            # Per-token-head scales of the tile's keys (read only under DYN_SCALES).
            s_ptrs = (
                kv_scales_ptr
                + physical_block * stride_sb
                + ((tile_pos % BLOCK_SIZE) + offs_n) * num_kv_heads
                + kv_head
            )
            m_i, l_i, acc = attend_kv_tile(
                q,
                k_ptrs,
                kv_mask,
                stride_ckv,
                k_at,
                k_needed,
                q_pos,
                q_last,
                row_valid,
                m_i,
                l_i,
                acc,
                qk_scale,
                softcap,
                slope,
                window,
                chunk,
                s_ptrs,
                BLOCK_SIZE * num_kv_heads,
                IS_CAUSAL,
                USE_WINDOW,
                USE_CHUNK,
                USE_SOFTCAP,
                USE_ALIBI,
                FP8_BITS,
                query_ptr.dtype.element_ty,
                DOT_PRECISION,
                DOT_IN_FP32,
                tree_lo,
                tree_hi,
                tree_first,
                USE_TREE,
                DYN_SCALES,
                MM_PREFIX,
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
    draft_anc_ptr,
    draft_counts_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    k_scale,
    v_scale,
    kv_scales_ptr,
    stride_sb,
    softcap,
    window,
    chunk,
    num_reqs,
    search_iters,
    num_splits,
    split_blocks,
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
    PER_HEAD_SCALES: tl.constexpr,
    DYN_SCALES: tl.constexpr,
    USE_TREE: tl.constexpr = False,
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
    # A block's scales are [2, BLOCK_SIZE, Hkv], contiguous (the launcher checks it).
    num_kv_heads = tl.num_programs(1)
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
        k_scale_value = tl.load(k_scale_ptr + kv_head * PER_HEAD_SCALES)
    v_scale_value = v_scale
    if V_SCALE_FROM_PTR:
        v_scale_value = tl.load(v_scale_ptr + kv_head * PER_HEAD_SCALES)
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
        # A draft tree: each row's ancestor bitmask, and where the request's drafts start.
        tree_lo = tl.zeros([BLOCK_M], dtype=tl.int32)
        tree_hi = tl.zeros([BLOCK_M], dtype=tl.int32)
        tree_first = seq_len
        if USE_TREE:
            anc = tl.load(draft_anc_ptr + q_token, mask=row_valid, other=0)
            tree_lo = (anc & 0xFFFFFFFF).to(tl.int32)
            tree_hi = (anc >> 32).to(tl.int32)
            tree_first = seq_len - tl.load(draft_counts_ptr + request)

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
        # differ by at most one; with more splits than blocks some runs are empty), or,
        # with split_blocks > 0, runs of split_blocks blocks each (the last ones empty):
        # then a row's partition follows its own keys only, never the batch.
        first_block = kv_begin // BLOCK_SIZE
        num_blocks = tl.maximum((kv_end + BLOCK_SIZE - 1) // BLOCK_SIZE - first_block, 0)
        split_first = first_block + (num_blocks * split) // num_splits
        split_end = first_block + (num_blocks * (split + 1)) // num_splits
        if split_blocks > 0:
            split_first = first_block + split * split_blocks
            split_end = tl.minimum(split_first + split_blocks, first_block + num_blocks)
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
            s_ptrs = (
                kv_scales_ptr
                + physical_block * stride_sb
                + (k_pos % BLOCK_SIZE) * num_kv_heads
                + kv_head
            )
            m_i, l_i, acc = attend_kv_tile(
                q,
                k_ptrs,
                kv_mask,
                stride_ckv,
                k_at,
                k_valid,
                q_pos,
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
                s_ptrs,
                BLOCK_SIZE * num_kv_heads,
                IS_CAUSAL,
                USE_WINDOW,
                USE_CHUNK,
                USE_SOFTCAP,
                USE_ALIBI,
                FP8_BITS,
                query_ptr.dtype.element_ty,
                DOT_PRECISION,
                DOT_IN_FP32,
                tree_lo,
                tree_hi,
                tree_first,
                USE_TREE,
                DYN_SCALES,
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
