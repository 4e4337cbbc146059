"""The key tile shared by the paged-attention kernels (device functions, ``@triton.jit``).

* :func:`load_kv_tile`: the masked K/V tile load (fp8 bit patterns decoded exactly
  under the Triton interpreter, :func:`attnkit.kernels._triton.fp8.e4m3_bits_to_f32`);
* :func:`mask_scores`: the causal / sliding-window / chunked-local visibility mask;
* :func:`mask_draft_tree`: a verify step's draft-tree mask (the contract's "Draft trees");
* :func:`online_softmax_update`: one step of the online softmax and of the ``P @ V``
  accumulation;
* :func:`attend_kv_tile`: one key tile of either paged-attention kernel (load K/V,
  score, soft-cap, ALiBi, mask, online softmax); the kernels differ only in how they
  address the tile (one block per tile, or a per-key gather across blocks).

The launchers' argument checks live in the op's contract,
:mod:`attnkit.kernels.attention.contract`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnkit.kernels._triton.fp8 import e4m3_bits_to_f32

__all__ = [
    "attend_kv_tile",
    "load_kv_tile",
    "mask_draft_tree",
    "mask_scores",
    "online_softmax_update",
    "tanh",
]


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
def mask_draft_tree(s, anc_lo, anc_hi, k_pos, tree_first):
    """``s`` ``[M, N]`` with the draft keys (positions ``>= tree_first``) a row's
    ancestor bitmask does not name set to ``-inf``; the int64 mask comes as its two
    int32 halves ``anc_lo``, ``anc_hi`` ``[M]`` (32-bit shifts over the tile keep the
    register footprint of the decode kernels)."""
    bit = tl.maximum(k_pos - tree_first, 0)
    word = tl.where(bit[None, :] < 32, anc_lo[:, None], anc_hi[:, None])
    named = ((word >> (bit[None, :] & 31)) & 1) != 0
    return tl.where((k_pos[None, :] < tree_first) | named, s, float("-inf"))


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
    stride_skv,
    IS_CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    FP8_BITS: tl.constexpr,
    P_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    tree_lo,
    tree_hi,
    tree_first,
    USE_TREE: tl.constexpr,
    DYN_SCALES: tl.constexpr,
    MM_PREFIX: tl.constexpr = False,
):
    """One key tile of the online softmax: load K (``k_ptrs``) and V (``k_ptrs +
    stride_ckv``) under ``kv_mask``, score, modify, mask and fold into ``(m_i, l_i,
    acc)``; returns the new three.

    ``qk_scale`` multiplies ``q . k``: in the log2 domain (``scale * k_scale * log2(e)``)
    without a soft-cap, in the natural one with it (the cap applies to natural-log
    scores and the result is moved to log2 here). ``slope`` is the ALiBi slope per row
    times log2(e) (unused without ALiBi). ``k_valid`` ``[N]`` marks keys in the range
    the caller may read; ``mask_scores`` adds the per-row visibility (with ``MM_PREFIX``,
    bidirectional image ranges, a row sees keys up to ``q_last``, its range's last key,
    instead of ``q_pos``; the window's lower edge still follows ``q_pos``), and with
    ``USE_TREE`` ``mask_draft_tree`` the draft tree's (``tree_lo``, ``tree_hi`` ``[M]``
    the int32 halves of each row's ancestor bitmask, ``tree_first`` the request's first
    draft position).

    ``DYN_SCALES``: the cache holds per-token-head scales, K's at ``s_ptrs`` ``[N]`` and
    V's ``stride_skv`` further. Key ``n``'s scale multiplies score column ``n`` (the
    stored key, fp8 or int8, stays an exact dot operand); the values are dequantised in
    float32 before the ``P @ V`` product.
    """
    LOG2E: tl.constexpr = 1.4426950408889634
    # Dot operands take the dtype of q: a no-op for a cache of the query dtype, and
    # exact for fp8 values (e4m3 fits in fp16, bf16 and fp32).
    k = load_kv_tile(k_ptrs, kv_mask, FP8_BITS, q.dtype)
    v = load_kv_tile(k_ptrs + stride_ckv, kv_mask, FP8_BITS, q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if DYN_SCALES:
        # Keys outside k_valid read scale 0 (their slots may hold NaN scales).
        k_s = tl.load(s_ptrs, mask=k_valid, other=0.0)
        v_s = tl.load(s_ptrs + stride_skv, mask=k_valid, other=0.0)
        s = s * k_s[None, :]
        v = (v.to(tl.float32) * v_s[:, None]).to(q.dtype)
    if USE_SOFTCAP:
        s = (softcap * tanh(s / softcap)) * LOG2E
    if USE_ALIBI:
        s += slope[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
    if MM_PREFIX:
        tl.static_assert(IS_CAUSAL and not USE_CHUNK)
        seen = row_valid[:, None] & k_valid[None, :] & (k_pos[None, :] <= q_last[:, None])
        if USE_WINDOW:
            seen = seen & (q_pos[:, None] - k_pos[None, :] < window)
        s = tl.where(seen, s, float("-inf"))
    else:
        s = mask_scores(
            s, row_valid, k_valid, q_pos, k_pos, window, chunk, IS_CAUSAL, USE_WINDOW, USE_CHUNK
        )
    if USE_TREE:
        s = mask_draft_tree(s, tree_lo, tree_hi, k_pos, tree_first)
    # v has q's dtype (float32 under DOT_IN_FP32); p is rounded to P_DTYPE either way.
    return online_softmax_update(s, v, m_i, l_i, acc, P_DTYPE, DOT_PRECISION, DOT_IN_FP32)
