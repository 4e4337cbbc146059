"""Triton kernels of DeepSeek sparse attention (formats and rules:
:mod:`attnkit.kernels.dsa.contract`; the torch oracles: :mod:`attnkit.kernels.dsa.reference`).

* ``write_index_cache``: grid ``(T,)``; a token's key in blocks of 128 values, each
  block's power-of-two scale from its float32 bits (``ceil(log2(amax / 448))`` exactly),
  the values encoded with the exact e4m3 codec (integer ops, as under the interpreter).
* ``indexer_logits``: grid ``(T, L / BLOCK_N)``; the token's index queries ``[H, D]``
  against ``BLOCK_N`` index rows gathered through the block table, one dot per scale
  block (the scale multiplies the block's scores), ``relu``, the head weights, the sum
  over heads; positions the token does not see are ``-inf`` and their rows are never
  read (a released or never-written slot may hold NaN).
* ``topk_select``: grid ``(T,)``; a radix select over the scores' order-preserving
  integer keys finds the ``k``-th best score in 32 counting passes, then one pass in
  position order keeps every better position and the earliest equal ones (ties to the
  earlier position), writing global slots in ascending order and ``-1`` after them.
* ``sparse_mla_attention``: grid ``(T, H / BLOCK_H)``; the token's selected latents in
  tiles of ``BLOCK_K`` slots, the score split at the rope boundary (``q[:R] . c + q[R:]
  . pe``), an online softmax, the values the latents' first ``R`` channels. Decode and
  prefill alike: each query token carries its own selection.

Under the interpreter (CPU tests) the dots run in float32 (its bfloat16 dot is wrong,
see :mod:`attnkit.kernels.mla.triton`); compiled 16-bit dots run on tensor cores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnkit.kernels._triton.fp8 import e4m3_bits_to_f32, f32_to_e4m3_bits
from attnkit.kernels._triton.interpret import INTERPRETED
from attnkit.kernels._triton.varlen import find_segment, search_iters
from attnkit.kernels.dsa.contract import (
    SCALE_BLOCK,
    check_logits_args,
    check_sparse_mla_args,
    check_topk_args,
    check_unit_last_dim,
    check_write_args,
    index_head_dim_of,
)

__all__ = ["indexer_logits", "sparse_mla_attention", "topk_select", "write_index_cache"]

TENSOR_CORE_KERNELS = ("_indexer_logits_kernel", "_sparse_mla_kernel")

_FLOAT32_MIN = -3.4028234663852886e38


# ------------------------------------------------------------------------ device


@triton.jit
def _write_index_kernel(
    keys_ptr,
    cache_ptr,
    scales_ptr,
    slot_mapping_ptr,
    num_slots,
    stride_kt,
    ROW_BYTES: tl.constexpr,
    DIM: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        blocks = tl.arange(0, NUM_BLOCKS)
        cols = tl.arange(0, SCALE_BLOCK)
        dims = blocks[:, None] * SCALE_BLOCK + cols[None, :]
        x = tl.load(keys_ptr + token * stride_kt + dims).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        # ceil(log2(amax / 448)) from the float32 bits: the exponent, plus one unless
        # the mantissa is zero (an exact power of two).
        ratio = tl.maximum(amax, 1e-30) / 448.0
        bits = ratio.to(tl.uint32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF).to(tl.int32) - 127
        exponent += ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = ((exponent + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        scale = tl.where(amax > 0, scale, 1.0)
        values = f32_to_e4m3_bits(x / scale[:, None])
        tl.store(cache_ptr + slot * ROW_BYTES + dims, values)
        tl.store(scales_ptr + slot * (ROW_BYTES // 4) + DIM // 4 + blocks, scale)


@triton.jit
def _position(qsl_ptr, seq_lens_ptr, num_reqs, token, SEARCH: tl.constexpr):
    """The token's request and its position in it."""
    req = find_segment(qsl_ptr, 1, num_reqs, token, SEARCH)
    start = tl.load(qsl_ptr + req)
    qlen = tl.load(qsl_ptr + req + 1) - start
    pos = tl.load(seq_lens_ptr + req) - qlen + (token - start)
    return req, pos


@triton.jit
def _indexer_logits_kernel(
    q_ptr,
    w_ptr,
    cache_ptr,
    scales_ptr,
    qsl_ptr,
    seq_lens_ptr,
    table_ptr,
    out_ptr,
    num_reqs,
    num_heads,
    max_seq_len,
    window,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_tb,
    table_width,
    stride_ot,
    ROW_BYTES: tl.constexpr,
    DIM: tl.constexpr,
    NUM_SCALES: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SEARCH: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    req, pos = _position(qsl_ptr, seq_lens_ptr, num_reqs, token, SEARCH)
    seen = (cols <= pos) & (cols < max_seq_len) & (cols < table_width * BLOCK_SIZE)
    if HAS_WINDOW:
        seen &= cols > pos - window
    heads = tl.arange(0, HEADS_PAD)
    hmask = heads < num_heads
    block = tl.load(table_ptr + req * stride_tb + cols // BLOCK_SIZE, mask=seen, other=0)
    slots = block.to(tl.int64) * BLOCK_SIZE + cols % BLOCK_SIZE
    d = tl.arange(0, SCALE_BLOCK)
    scores = tl.zeros([HEADS_PAD, BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(NUM_SCALES):
        q = tl.load(
            q_ptr + token * stride_qt + heads[:, None] * stride_qh + j * SCALE_BLOCK + d[None, :],
            mask=hmask[:, None],
            other=0.0,
        )
        raw = tl.load(
            cache_ptr + slots[:, None] * ROW_BYTES + j * SCALE_BLOCK + d[None, :],
            mask=seen[:, None],
            other=0,
        )
        k = e4m3_bits_to_f32(raw)
        if DOT_IN_FP32:
            part = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
        elif q.dtype == tl.float32:
            part = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            # e4m3 values are exact in either 16-bit dtype: the dot's operands lose nothing.
            part = tl.dot(q, tl.trans(k.to(q.dtype)))
        scale = tl.load(scales_ptr + slots * (ROW_BYTES // 4) + DIM // 4 + j, mask=seen, other=0.0)
        scores += part * scale[None, :]
    w = tl.load(w_ptr + token * stride_wt + heads, mask=hmask, other=0.0).to(tl.float32)
    logits = tl.sum(tl.maximum(scores, 0.0) * w[:, None], axis=0)
    logits = tl.where(seen, logits, float("-inf"))
    tl.store(out_ptr + token * stride_ot + cols, logits, mask=cols < max_seq_len)


@triton.jit
def _order_key(x):
    """Unsigned keys ordered as the float32 values (NaN and infinities made the lowest)."""
    x = tl.where((x != x) | (tl.abs(x) == float("inf")), -3.4028234663852886e38, x)
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)


@triton.jit
def _topk_kernel(
    logits_ptr,
    qsl_ptr,
    seq_lens_ptr,
    table_ptr,
    idx_ptr,
    lens_ptr,
    num_reqs,
    length,
    window,
    topk,
    stride_lt,
    stride_tb,
    stride_it,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SEARCH: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    req, pos = _position(qsl_ptr, seq_lens_ptr, num_reqs, token, SEARCH)
    lo = pos * 0
    if HAS_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    hi = tl.minimum(pos + 1, length)  # visible: lo <= s < hi
    visible = tl.maximum(hi - lo, 0)
    keep_n = tl.minimum(visible, topk)
    # Radix select: the largest key tau with at least keep_n visible keys >= tau.
    tau = tl.zeros([], dtype=tl.uint32)
    bit = tl.full([], 0x80000000, tl.uint32)
    for _ in range(32):
        cand = tau | bit
        bit = bit >> 1
        count = tl.zeros([], dtype=tl.int32)
        for start in range(0, length, BLOCK_L):
            cols = start + tl.arange(0, BLOCK_L)
            seen = (cols >= lo) & (cols < hi)
            x = tl.load(logits_ptr + token * stride_lt + cols, mask=seen, other=0.0)
            key = _order_key(x)
            count += tl.sum((seen & (key >= cand)).to(tl.int32), axis=0)
        tau = tl.where(count >= keep_n, cand, tau)
    greater = tl.zeros([], dtype=tl.int32)
    for start in range(0, length, BLOCK_L):
        cols = start + tl.arange(0, BLOCK_L)
        seen = (cols >= lo) & (cols < hi)
        x = tl.load(logits_ptr + token * stride_lt + cols, mask=seen, other=0.0)
        greater += tl.sum((seen & (_order_key(x) > tau)).to(tl.int32), axis=0)
    equal_wanted = keep_n - greater
    # Padding first, then the kept positions in ascending order (they land below keep_n).
    for start in range(0, topk, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        tl.store(
            idx_ptr + token * stride_it + k,
            tl.full([BLOCK_K], -1, tl.int32),
            mask=(k < topk) & (k >= keep_n),
        )
    written = tl.zeros([], dtype=tl.int32)
    equal_seen = tl.zeros([], dtype=tl.int32)
    for start in range(0, length, BLOCK_L):
        cols = start + tl.arange(0, BLOCK_L)
        seen = (cols >= lo) & (cols < hi)
        x = tl.load(logits_ptr + token * stride_lt + cols, mask=seen, other=0.0)
        key = _order_key(x)
        equal = seen & (key == tau)
        equal_rank = equal_seen + tl.cumsum(equal.to(tl.int32), axis=0) - 1
        keep = seen & ((key > tau) | (equal & (equal_rank < equal_wanted)))
        place = written + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        block = tl.load(table_ptr + req * stride_tb + cols // BLOCK_SIZE, mask=keep, other=0)
        slot = block * BLOCK_SIZE + cols % BLOCK_SIZE
        tl.store(idx_ptr + token * stride_it + place, slot.to(tl.int32), mask=keep)
        written += tl.sum(keep.to(tl.int32), axis=0)
        equal_seen += tl.sum(equal.to(tl.int32), axis=0)
    tl.store(lens_ptr + token, keep_n.to(tl.int32))


@triton.jit
def _sparse_mla_kernel(
    q_ptr,
    cache_ptr,
    idx_ptr,
    lens_ptr,
    out_ptr,
    lse_ptr,
    scale,
    num_heads,
    topk,
    stride_qt,
    stride_qh,
    stride_it,
    stride_ot,
    stride_oh,
    LATENT: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_LSE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    r = tl.arange(0, RANK_PAD)
    p = tl.arange(0, ROPE_PAD)
    rmask, pmask = r < RANK, p < ROPE
    q_row = q_ptr + token * stride_qt + heads[:, None] * stride_qh
    q_nope = tl.load(q_row + r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    q_pe = tl.load(q_row + RANK + p[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0)
    if DOT_IN_FP32:
        q_nope = q_nope.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    valid_n = tl.load(lens_ptr + token)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], dtype=tl.float32)
    for start in range(0, topk, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + token * stride_it + k, mask=k < topk, other=-1)
        valid = (idx >= 0) & (k < valid_n)
        row = cache_ptr + tl.where(valid, idx, 0).to(tl.int64)[:, None] * LATENT
        c = tl.load(row + r[None, :], mask=valid[:, None] & rmask[None, :], other=0.0)
        pe = tl.load(row + RANK + p[None, :], mask=valid[:, None] & pmask[None, :], other=0.0)
        if DOT_IN_FP32:
            c = c.to(tl.float32)
            pe = pe.to(tl.float32)
        if c.dtype == tl.float32:
            s = tl.dot(q_nope, tl.trans(c), input_precision="ieee")
            s += tl.dot(q_pe, tl.trans(pe), input_precision="ieee")
        else:
            s = tl.dot(q_nope, tl.trans(c))
            s += tl.dot(q_pe, tl.trans(pe))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        prob = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        if c.dtype == tl.float32:
            acc = acc * alpha[:, None] + tl.dot(prob, c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(prob.to(c.dtype), c)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_row = out_ptr + token * stride_ot + heads[:, None] * stride_oh
    tl.store(
        o_row + r[None, :], out.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & rmask[None, :]
    )
    if HAS_LSE:
        lse = tl.where(l_i > 0, tl.log(tl.where(l_i > 0, l_i, 1.0)) + m_i, float("-inf"))
        tl.store(lse_ptr + token * num_heads + heads, lse, mask=hmask)


# ------------------------------------------------------------------------ launch


def write_index_cache(keys: Tensor, index_cache: Tensor, slot_mapping: Tensor) -> None:
    """As :func:`attnkit.kernels.dsa.reference.write_index_cache` (bit for bit)."""
    keys, cache, slots = check_write_args(keys, index_cache, slot_mapping)
    check_unit_last_dim("keys", keys)
    dim = index_head_dim_of(cache.shape[2])
    if keys.shape[0] == 0:
        return
    _write_index_kernel[(keys.shape[0],)](
        keys,
        cache,
        cache.view(torch.float32),
        slots,
        cache.shape[0] * cache.shape[1],
        keys.stride(0),
        ROW_BYTES=cache.shape[2],
        DIM=dim,
        NUM_BLOCKS=dim // SCALE_BLOCK,
        SCALE_BLOCK=SCALE_BLOCK,
    )


def indexer_logits(
    q: Tensor,
    weights: Tensor,
    index_cache: Tensor,
    *,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    max_seq_len: int,
    window: int | None = None,
) -> Tensor:
    """As :func:`attnkit.kernels.dsa.reference.indexer_logits` (float32 ``[T, max_seq_len]``)."""
    q, weights, cache, length = check_logits_args(q, weights, index_cache, max_seq_len, window)
    check_unit_last_dim("q", q)
    dim = index_head_dim_of(cache.shape[2])
    tokens, heads = q.shape[0], q.shape[1]
    num_reqs = seq_lens.shape[0]
    out = torch.empty(tokens, length, dtype=torch.float32, device=q.device)
    if tokens == 0:
        return out
    block_n = 64
    _indexer_logits_kernel[(tokens, triton.cdiv(length, block_n))](
        q,
        weights,
        cache,
        cache.view(torch.float32),
        query_start_loc,
        seq_lens,
        block_table,
        out,
        num_reqs,
        heads,
        length,
        window or 0,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        block_table.stride(0),
        block_table.shape[1],
        out.stride(0),
        ROW_BYTES=cache.shape[2],
        DIM=dim,
        NUM_SCALES=dim // SCALE_BLOCK,
        SCALE_BLOCK=SCALE_BLOCK,
        BLOCK_SIZE=cache.shape[1],
        HEADS_PAD=max(16, triton.next_power_of_2(heads)),
        BLOCK_N=block_n,
        HAS_WINDOW=window is not None,
        SEARCH=search_iters(num_reqs),
        DOT_IN_FP32=INTERPRETED,
        num_warps=8,
    )
    return out


def topk_select(
    logits: Tensor,
    *,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    block_size: int,
    topk: int,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """As :func:`attnkit.kernels.dsa.reference.topk_select` (the same slots, in the same
    order, ties to the earlier position)."""
    logits, bs, k = check_topk_args(logits, block_size, topk, window)
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits: expected contiguous rows of torch.float32, got {logits.dtype}")
    tokens, length = logits.shape
    indices = torch.empty(tokens, k, dtype=torch.int32, device=logits.device)
    lens = torch.empty(tokens, dtype=torch.int32, device=logits.device)
    if tokens == 0:
        return indices, lens
    num_reqs = seq_lens.shape[0]
    _topk_kernel[(tokens,)](
        logits,
        query_start_loc,
        seq_lens,
        block_table,
        indices,
        lens,
        num_reqs,
        length,
        window or 0,
        k,
        logits.stride(0),
        block_table.stride(0),
        indices.stride(0),
        BLOCK_SIZE=bs,
        BLOCK_L=1024,
        BLOCK_K=256,
        HAS_WINDOW=window is not None,
        SEARCH=search_iters(num_reqs),
        num_warps=4,
    )
    return indices, lens


def sparse_mla_attention(
    query: Tensor,
    latent_cache: Tensor,
    indices: Tensor,
    lens: Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    output: Tensor | None = None,
    lse: Tensor | None = None,
) -> Tensor:
    """As :func:`attnkit.kernels.dsa.reference.sparse_mla_attention` (a latent cache of
    the query dtype; ``lse`` float32 ``[T, H]`` when given)."""
    cache, idx, counts, rank = check_sparse_mla_args(
        query, latent_cache, indices, lens, kv_lora_rank, output, lse
    )
    tokens, heads, dim = query.shape
    # The kernel's own limits: a contiguous cache of the query dtype, unit-stride rows.
    if cache.dtype != query.dtype or not cache.is_contiguous():
        raise ValueError(
            f"latent_cache: expected a contiguous tensor of the query dtype {query.dtype}, "
            f"got {cache.dtype}"
        )
    check_unit_last_dim("query", query)
    if idx.stride(1) != 1:
        raise ValueError(f"indices: expected contiguous rows, got strides {idx.stride()}")
    out = (
        output
        if output is not None
        else torch.empty(tokens, heads, rank, dtype=query.dtype, device=query.device)
    )
    if tokens == 0:
        return out
    # As triton_mla's decode shape (its compile report at D = 576): up to 32 rows of
    # heads, 16 latents a tile, 8 warps, 2 stages for a wide latent; float32 one stage.
    rank_pad = max(16, triton.next_power_of_2(rank))
    fp32 = query.dtype == torch.float32
    block_h = 16 if fp32 else min(32, max(16, triton.next_power_of_2(heads)))
    block_k = 16 if fp32 or rank_pad >= 256 else 32
    num_warps = 8 if rank_pad >= 256 else 4
    _sparse_mla_kernel[(tokens, triton.cdiv(heads, block_h))](
        query,
        cache,
        idx,
        counts,
        out,
        lse if lse is not None else out,
        float(scale),
        heads,
        idx.shape[1],
        query.stride(0),
        query.stride(1),
        idx.stride(0),
        out.stride(0),
        out.stride(1),
        LATENT=dim,
        RANK=rank,
        ROPE=dim - rank,
        RANK_PAD=rank_pad,
        ROPE_PAD=max(16, triton.next_power_of_2(dim - rank)),
        BLOCK_H=block_h,
        BLOCK_K=block_k,
        HAS_LSE=lse is not None,
        DOT_IN_FP32=INTERPRETED,
        num_warps=num_warps,
        num_stages=1 if fp32 else 2,
    )
    return out
