"""Paged attention for mixed batches: prefill, chunked prefill and decode in one launch.

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

Semantics are those of the torch oracle ``attnkit.kernels.torch.attention``: query ``t``
(0-based within its request) sits at absolute position ``i = seq_len - q_len + t`` (also
when ``causal=False``, where ``q_len > seq_len`` is allowed and ``i`` may be negative;
it then only matters to ALiBi). Query head ``h`` reads kv head ``h // G``. Key ``j`` is
visible iff ``j < seq_len`` and, when causal, ``j <= i``; a sliding window ``W`` adds
``i - j < W`` and a local-attention chunk ``C`` adds ``j // C == i // C``. Scores are
``s = scale * k_scale * (q . k)``, then ``cap * tanh(s / cap)``, then
``+ slope[h] * (j - i)``; a sink adds ``exp(sink[h])`` to each row's softmax
denominator with no value. ``lse`` is the natural-log log-sum-exp of the row, sink
included (``-inf`` for a row that sees nothing and has no sink).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from attnkit.kernels._checks import KernelTypeError, check_bool, describe, require_tensor
from attnkit.kernels.triton._attention_common import (
    check_batch_metadata,
    check_block_table_width,
    check_device,
    check_finite_float,
    check_int_arg,
    check_paged_kv_cache,
    check_scale_tensor,
    load_kv_tile,
    mask_scores,
    online_softmax_update,
)

__all__ = ["unified_attention"]

# Query (and output) dtypes; the cache has the query dtype or _FP8_DTYPE.
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP8_DTYPE = torch.float8_e4m3fn
_SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)
_MIN_HEAD_DIM = 16
_MAX_HEAD_DIM = 256
# Rows (query tokens x heads of one group) per program. 64 keeps the fp32 accumulator
# of the largest head size (256) without register spills in an sm_90 compile; 16 is the
# smallest M that tl.dot accepts on every target (older Triton releases require it).
_MAX_ROWS = 64
_MIN_ROWS = 16


@triton.jit
def _tanh(x):
    # Triton has no portable tanh. exp2 of a non-positive argument never overflows, so
    # this is finite for every finite x and saturates to +-1 for large |x|.
    t = tl.exp2(-2.885390081777927 * tl.abs(x))  # exp(-2|x|); the constant is 2 * log2(e)
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _unified_attention_kernel(
    query_ptr,
    cache_ptr,
    output_ptr,
    lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    alibi_slopes_ptr,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    softcap,
    window,
    chunk,
    tiles_per_request,
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
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_SINKS: tl.constexpr,
    STORE_LSE: tl.constexpr,
    USE_K_SCALE: tl.constexpr,
    USE_V_SCALE: tl.constexpr,
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
    # Each row of the tile is one (query token, query head of this kv group) pair, so
    # one K/V tile load serves all GROUP heads that share the kv head.
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453

    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = tile_id // tiles_per_request
    tile = tile_id % tiles_per_request

    q_start = tl.load(query_start_loc_ptr + request)
    q_len = tl.load(query_start_loc_ptr + request + 1) - q_start
    tile_start = tile * BLOCK_Q
    # The grid is sized by the longest request; shorter ones leave trailing tiles empty.
    if tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + request)
    # Negative for a non-causal request with more queries than keys (cross attention).
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = tile_start + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_valid = (q_idx < q_len) & (head_in_group < GROUP)
    q_head = kv_head * GROUP + head_in_group
    q_pos = context_len + q_idx
    # int64 before multiplying by strides: T * Hq * D may exceed 2**31 elements.
    q_token = (q_start + q_idx).to(tl.int64)

    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
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

    # Per-tensor quantisation scales live in device memory (a CUDA graph replays with
    # new values). k_scale is folded into the score scale, v_scale applied to the final
    # output: both are exact rewrites of "dequantise, then attend" up to rounding.
    qk_scale = scale
    if USE_K_SCALE:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    if not USE_SOFTCAP:
        # Scores are kept in the log2 domain (exp2 is the native instruction).
        qk_scale = qk_scale * LOG2E
    if USE_ALIBI:
        slope = tl.load(alibi_slopes_ptr + q_head * stride_alibi, mask=row_valid, other=0.0)
        slope = slope.to(tl.float32) * LOG2E

    # Key range [kv_begin, kv_end) that at least one row of this tile can see: the loop
    # skips tiles no row needs, and every key outside it is loaded as 0. The lower
    # bound matters beyond speed: a block wholly before it may have been released and
    # now read as the null block, whose contents are arbitrary (NaN in tests). Starting
    # the loop at kv_begin's tile already avoids such blocks (a tile never straddles
    # two blocks); zeroing keys below kv_begin as well keeps that true whatever the
    # tiling.
    first_q_pos = context_len + tile_start
    last_q_pos = context_len + tl.minimum(tile_start + BLOCK_Q, q_len) - 1
    kv_end = tl.minimum(last_q_pos + 1, seq_len) if IS_CAUSAL else seq_len
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

    # Keys are visited in tiles of TILE_N <= BLOCK_SIZE slots that never straddle two
    # blocks. For large blocks (64, 128) with large head sizes a whole block of K and V
    # would not fit in registers next to the [BLOCK_M, D] accumulator; sub-tiles keep the
    # working set bounded independently of the cache's block size.
    offs_n = tl.arange(0, TILE_N)
    table_row = block_table_ptr + request.to(tl.int64) * stride_bt
    slot_offsets = offs_n[:, None] * stride_cs + kv_head * stride_ch + dims[None, :] * stride_cd
    for kv_tile in range(kv_begin // TILE_N, tl.cdiv(kv_end, TILE_N)):
        tile_pos = kv_tile * TILE_N
        # int64: NB * 2 * BS * Hkv * D may exceed 2**31 elements.
        physical_block = tl.load(table_row + tile_pos // BLOCK_SIZE).to(tl.int64)
        k_pos = tile_pos + offs_n
        k_needed = (k_pos >= kv_begin) & (k_pos < kv_end)
        kv_mask = k_needed[:, None] & dim_valid[None, :]
        k_ptrs = (
            cache_ptr
            + physical_block * stride_cb
            + (tile_pos % BLOCK_SIZE) * stride_cs
            + slot_offsets
        )
        # Dot operands take the dtype of q: a no-op for a cache of the query dtype, and
        # exact for fp8 values (e4m3 fits in fp16, bf16 and fp32).
        k = load_kv_tile(k_ptrs, kv_mask, FP8_BITS).to(q.dtype)
        v = load_kv_tile(k_ptrs + stride_ckv, kv_mask, FP8_BITS).to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if USE_SOFTCAP:
            s = (softcap * _tanh(s / softcap)) * LOG2E
        if USE_ALIBI:
            s += slope[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
        s = mask_scores(
            s, row_valid, k_needed, q_pos, k_pos, window, chunk, IS_CAUSAL, USE_WINDOW, USE_CHUNK
        )
        # v already has q's dtype (float32 under DOT_IN_FP32); p is rounded to the
        # query dtype either way.
        m_i, l_i, acc = online_softmax_update(
            s, v, m_i, l_i, acc, query_ptr.dtype.element_ty, DOT_PRECISION, DOT_IN_FP32
        )

    # l_i == 0 only for rows that see no key and have no sink (padding rows, or an empty
    # non-causal context): their output is 0 and their lse -inf, as in the oracle.
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if USE_V_SCALE:
        out = out * tl.load(v_scale_ptr)
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


# The Triton interpreter stores bfloat16 as uint16 and its tl.dot multiplies those bit
# patterns (triton-lang/triton#11584; upstream: bf16 is unsupported there and should be
# cast to float32). Under the interpreter only, bf16 dot operands are upcast after the
# same rounding the GPU path applies; compiled kernels keep native bf16 dots.
#
# fp8 under the interpreter: it stores float8 tensors as raw uint8 and converts them with
# a generic bit-manipulation routine that decodes e4m3fn's NaN pattern (0x7F) as 480 and
# whose float32 -> fp8 rounding is wrong for about one value in ten (mantissa carries,
# ties, subnormals; measured against torch on triton 3.9). A NaN in an unwritten slot
# must stay NaN so the tests catch a kernel that reads one, so under the interpreter the
# cache is passed as a uint8 view and decoded exactly by e4m3_bits_to_f32 (in
# _attention_common; integer ops only: exact, and checked against torch for all 256
# patterns). Compiled kernels keep
# the fp8 tensor and Triton's native conversion (hardware cvt on sm_89+); the FP8_BITS
# branch is a constexpr, so it costs them nothing.
_INTERPRETED = isinstance(_unified_attention_kernel, InterpretedFunction)


def _check_softcap(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KernelTypeError(
            f"logits_soft_cap: expected a finite float > 0 or None, got {describe(value)}"
        )
    if not math.isfinite(value) or not value > 0:
        raise ValueError(f"logits_soft_cap: expected a finite float > 0 or None, got {value!r}")
    return float(value)


def _check_float32_tensor(
    name: str, t: object, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """A float32 tensor of exactly ``shape`` on ``device`` (any strides)."""
    if not isinstance(t, torch.Tensor):
        raise KernelTypeError(f"{name}: expected a torch.Tensor or None, got {describe(t)}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name}: expected dtype torch.float32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    check_device(name, t, device)
    return t


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` ``[T, Hq, D]`` over the paged ``kv_cache``.

    The new tokens' K/V must already be in the cache (see ``write_kv_cache``). Returns
    ``output`` (allocated when not given); when ``lse`` (float32 ``[T, Hq]``) is given,
    the natural-log log-sum-exp of every row is written to it. Rows of ``output`` and
    ``lse`` past ``query_start_loc[-1]`` are left untouched.

    ``max_query_len`` / ``max_seq_len`` must bound the true per-request values: they size
    the grid, and the launcher never reads tensor values back to the host to check them.
    With ``causal=True`` every request needs ``q_len <= seq_len``; with ``causal=False``
    (encoder or cross attention) a request may have more queries than keys.

    ``sliding_window`` (``W >= 1``) and ``chunk_size`` (``C >= 1``) need ``causal=True``
    and exclude each other. ``alibi_slopes`` and ``sinks`` are float32 ``[Hq]``.
    ``k_scale`` / ``v_scale`` are one-element float32 tensors: required with a
    ``torch.float8_e4m3fn`` cache (which stores ``key / k_scale``), optional otherwise
    (the cached keys / values are multiplied by them either way).
    """
    query = require_tensor("query", query, "a torch.Tensor [T, Hq, D]")
    if query.dim() != 3:
        raise ValueError(f"query: expected shape [T, Hq, D], got {tuple(query.shape)}")
    if query.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"query: expected dtype in {_SUPPORTED_DTYPES}, got {query.dtype}")
    num_tokens, num_q_heads, head_dim = query.shape
    device = query.device

    kv_cache = require_tensor("kv_cache", kv_cache, "a torch.Tensor [NB, 2, BS, Hkv, D]")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache: expected shape [NB, 2, BS, Hkv, D], got {tuple(kv_cache.shape)}"
        )
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if kv_cache.dtype not in (query.dtype, _FP8_DTYPE):
        raise ValueError(
            f"kv_cache: expected dtype {query.dtype} (the query dtype) or {_FP8_DTYPE}, "
            f"got {kv_cache.dtype}"
        )
    is_fp8 = kv_cache.dtype == _FP8_DTYPE
    check_paged_kv_cache(
        kv_cache,
        num_q_heads,
        head_dim,
        device,
        block_sizes=_SUPPORTED_BLOCK_SIZES,
        min_head_dim=_MIN_HEAD_DIM,
        max_head_dim=_MAX_HEAD_DIM,
    )
    num_requests = check_batch_metadata(seq_lens, query_start_loc, block_table, device)

    causal = check_bool("causal", causal)
    max_query_len = check_int_arg("max_query_len", max_query_len, 0)
    # Only causal requests must hold their queries among their keys.
    max_seq_len = check_int_arg("max_seq_len", max_seq_len, max_query_len if causal else 0)
    check_block_table_width(block_table, block_size, max_seq_len)
    scale = check_finite_float("scale", scale)
    if sliding_window is not None:
        sliding_window = check_int_arg("sliding_window", sliding_window, 1)
    if chunk_size is not None:
        chunk_size = check_int_arg("chunk_size", chunk_size, 1)
    if sliding_window is not None and chunk_size is not None:
        raise ValueError(
            f"sliding_window, chunk_size: expected at most one of them, got "
            f"sliding_window={sliding_window} and chunk_size={chunk_size}"
        )
    if not causal and (sliding_window is not None or chunk_size is not None):
        name = "sliding_window" if sliding_window is not None else "chunk_size"
        raise ValueError(f"{name}: expected None with causal=False (needs causal attention)")
    if logits_soft_cap is not None:
        logits_soft_cap = _check_softcap(logits_soft_cap)
    if alibi_slopes is not None:
        _check_float32_tensor("alibi_slopes", alibi_slopes, (num_q_heads,), device)
    if sinks is not None:
        _check_float32_tensor("sinks", sinks, (num_q_heads,), device)
    if k_scale is not None:
        check_scale_tensor("k_scale", k_scale, device, "query")
    if v_scale is not None:
        check_scale_tensor("v_scale", v_scale, device, "query")
    if is_fp8 and (k_scale is None or v_scale is None):
        missing = "k_scale" if k_scale is None else "v_scale"
        raise ValueError(
            f"{missing}: expected a one-element torch.float32 tensor with a "
            f"{_FP8_DTYPE} kv_cache, got None"
        )
    if lse is not None:
        _check_float32_tensor("lse", lse, (num_tokens, num_q_heads), device)

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

    if num_tokens == 0 or num_requests == 0 or max_query_len == 0:
        return output

    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # Query tokens per program: enough for the longest request when it is short (decode
    # batches), capped so the tile stays at most _MAX_ROWS rows unless one group alone
    # is wider, and raised so the tile has at least _MIN_ROWS rows for tl.dot.
    block_q = triton.next_power_of_2(max_query_len)
    block_q = min(block_q, max(1, _MAX_ROWS // group_pad))
    block_q = max(block_q, _MIN_ROWS // group_pad, 1)
    # Keys per inner-loop step: a [TILE_N, D] tile of K and of V sits in registers next
    # to the [BLOCK_M, D] fp32 accumulator, so the tile shrinks as D grows (64 x 128 or
    # 32 x 256 16-bit elements, 16 KiB each) and never exceeds one cache block.
    tile_n = min(block_size, 64 if head_dim_pad <= 128 else 32)
    # Grid: axis 0 walks (request, query tile) pairs with every request given the tile
    # count of the longest one, so a program finds its request by one division instead
    # of searching query_start_loc; tiles past a request's end exit at once. Axis 1 is
    # the kv head, and the program covers all query heads of that head's group.
    tiles_per_request = triton.cdiv(max_query_len, block_q)
    grid = (num_requests * tiles_per_request, num_kv_heads)
    fp8_bits = is_fp8 and _INTERPRETED

    _unified_attention_kernel[grid](
        query_ptr=query,
        # A uint8 view shares the storage (no copy); see the note on _INTERPRETED.
        cache_ptr=kv_cache.view(torch.uint8) if fp8_bits else kv_cache,
        output_ptr=output,
        lse_ptr=lse,
        query_start_loc_ptr=query_start_loc,
        seq_lens_ptr=seq_lens,
        block_table_ptr=block_table,
        alibi_slopes_ptr=alibi_slopes,
        sinks_ptr=sinks,
        k_scale_ptr=k_scale,
        v_scale_ptr=v_scale,
        scale=scale,
        softcap=logits_soft_cap if logits_soft_cap is not None else 0.0,
        window=sliding_window if sliding_window is not None else 0,
        chunk=chunk_size if chunk_size is not None else 1,
        tiles_per_request=tiles_per_request,
        stride_qt=query.stride(0),
        stride_qh=query.stride(1),
        stride_qd=query.stride(2),
        stride_ot=output.stride(0),
        stride_oh=output.stride(1),
        stride_od=output.stride(2),
        stride_lt=lse.stride(0) if lse is not None else 0,
        stride_lh=lse.stride(1) if lse is not None else 0,
        stride_cb=kv_cache.stride(0),
        stride_ckv=kv_cache.stride(1),
        stride_cs=kv_cache.stride(2),
        stride_ch=kv_cache.stride(3),
        stride_cd=kv_cache.stride(4),
        stride_bt=block_table.stride(0),
        stride_alibi=alibi_slopes.stride(0) if alibi_slopes is not None else 0,
        stride_sinks=sinks.stride(0) if sinks is not None else 0,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        IS_CAUSAL=causal,
        USE_WINDOW=sliding_window is not None,
        USE_CHUNK=chunk_size is not None,
        USE_SOFTCAP=logits_soft_cap is not None,
        USE_ALIBI=alibi_slopes is not None,
        USE_SINKS=sinks is not None,
        STORE_LSE=lse is not None,
        USE_K_SCALE=k_scale is not None,
        USE_V_SCALE=v_scale is not None,
        FP8_BITS=fp8_bits,
        # fp32 inputs would otherwise default to TF32 on NVIDIA, far outside fp32
        # tolerances; the setting has no effect on 16-bit operands.
        DOT_PRECISION="ieee",
        DOT_IN_FP32=_INTERPRETED and query.dtype == torch.bfloat16,
        # The [64, 256] fp32 accumulator alone is 128 registers a thread with 4 warps.
        num_warps=8 if head_dim_pad >= 256 else 4,
        # Explicit, not Triton's default: Triton 3.9 warns when the option is left unset
        # (its default flips in 3.10), and the test suite turns warnings into errors.
        enable_fp_fusion=True,
    )
    return output
