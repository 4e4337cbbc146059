"""Split-KV ("flash-decoding") paged attention for decode-heavy batches.

When a batch has few requests with long contexts, one program per (request, kv head)
leaves most of the GPU idle while each program walks thousands of keys. Split-KV
decoding (the Flash-Decoding idea: Dao, Haziza, Massa, Sizov, 2023, "Flash-Decoding
for long-context inference") also splits each request's keys into ``num_splits``
chunks of consecutive cache blocks:

* stage 1, grid ``(B * query tiles, Hkv, num_splits)``: each program runs the usual
  online softmax over one chunk and writes a float32 partial output (already divided by
  its own denominator) and the chunk's natural-log lse into scratch buffers;
* stage 2, grid ``(T, Hq)``: each (token, head) merges its ``num_splits`` partials by
  log-sum-exp weighting and adds the attention-sink logit, once, to the denominator.

A chunk that holds no key visible to a row (the chunk is empty because there are more
splits than blocks, or a window / chunked-local mask hides all of it) leaves partial
output 0 and lse ``-inf`` for that row, which the merge ignores.

Shapes and conventions are those of :mod:`attnkit.kernels.triton.unified_attention`
and the oracle :func:`attnkit.kernels.torch.attention.paged_attention` (masks,
soft-cap, ALiBi, sinks, lse, ``k_scale`` / ``v_scale``):

* ``query`` ``[T, Hq, D]`` any strides; ``output`` ``[T, Hq, D]`` query dtype;
  ``lse`` float32 ``[T, Hq]``.
* ``kv_cache`` ``[NB, 2, BS, Hkv, D]`` contiguous, the query dtype or
  ``torch.float8_e4m3fn`` (widened to the query dtype in the kernel; ``k_scale`` /
  ``v_scale`` then carry the quantisation scales);
* ``query_start_loc`` int32 ``[B + 1]``, ``seq_lens`` int32 ``[B]`` (including the
  queries), ``block_table`` int32 ``[B, MB]``.

Rows of ``output`` / ``lse`` at or past ``query_start_loc[B]`` are left untouched.

Workspace (the scratch between the stages), see :class:`SplitKVWorkspace`:

* ``partial_out`` float32 ``[S, T', Hq, D]`` with ``S >= num_splits``, ``T' >= T``;
* ``partial_lse`` float32 ``[S, T', Hq]``, same ``S`` and ``T'``.

With ``output``, ``lse`` (if wanted) and ``workspace`` given, and ``k_scale`` /
``v_scale`` given as floats or device tensors, the launcher allocates nothing and
never reads device memory back to the host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

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
    load_kv_tile,
    mask_scores,
    online_softmax_update,
)

__all__ = [
    "SplitKVWorkspace",
    "choose_num_splits",
    "split_kv_decode",
    "split_kv_workspace",
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Quantised caches: keys/values stored as x / scale and widened in the kernel.
_FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)
_SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)
_MIN_HEAD_DIM = 16
_MAX_HEAD_DIM = 256
# Split-KV is a decode path: every query token of a request gets its own copy of the
# partial outputs, so long prefills belong in unified_attention. 16 covers speculative
# decoding's draft lengths.
MAX_QUERY_LEN = 16
# Stage 2 holds all partials of one (token, head) in one [S, D] tile.
MAX_NUM_SPLITS = 256
# Rows (query tokens x heads of one kv group) per program: same limits and reasons as
# unified_attention (fp32 accumulator of D=256 without spills; tl.dot needs M >= 16).
_MAX_ROWS = 64
_MIN_ROWS = 16

# choose_num_splits: never give a split fewer tokens than this (the merge and the
# per-split prologue would dominate) ...
_MIN_TOKENS_PER_SPLIT = 256
# ... nor more splits than this (stage-2 tile size and scratch traffic).
_MAX_AUTO_SPLITS = 32


# ------------------------------------------------------------------------ stage 1


@triton.jit
def _split_kv_partial_kernel(
    query_ptr,
    cache_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    alibi_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sm_scale,
    k_scale_value,
    v_scale_value,
    soft_cap,
    window,
    chunk,
    tiles_per_request,
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
    BLOCK_SIZE: tl.constexpr,
    KV_TILE: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    K_SCALE_FROM_PTR: tl.constexpr,
    V_SCALE_FROM_PTR: tl.constexpr,
    CAST_KV: tl.constexpr,
    FP8_BITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    # Padded extents exist because tl.arange needs powers of two; loads and stores mask
    # the padding lanes (dims >= HEAD_DIM, heads >= GROUP, tokens >= q_len).
    tl.static_assert(HEAD_DIM_PAD >= HEAD_DIM)
    tl.static_assert(GROUP_PAD >= GROUP)
    tl.static_assert(HEAD_DIM_PAD >= 16)
    tl.static_assert(KV_TILE >= 16)
    tl.static_assert(IS_CAUSAL or not (USE_WINDOW or USE_CHUNK))
    tl.static_assert(not (USE_WINDOW and USE_CHUNK))
    # Row r of the tile is (query token r // GROUP_PAD, query head r % GROUP_PAD of this
    # kv head's group): one K/V load serves every query head sharing the kv head.
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453

    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    request = tile_id // tiles_per_request
    tile = tile_id % tiles_per_request

    q_start = tl.load(query_start_loc_ptr + request)
    q_len = tl.load(query_start_loc_ptr + request + 1) - q_start
    tile_start = tile * BLOCK_Q
    # The grid is sized by max_query_len; shorter requests leave trailing tiles empty,
    # and their rows belong to no token, so there is nothing to write.
    if tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + request)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = tile_start + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_valid = (q_idx < q_len) & (head_in_group < GROUP)
    q_head = kv_head * GROUP + head_in_group
    q_pos = context_len + q_idx
    # int64 before multiplying by strides: S * T * Hq * D may exceed 2**31 elements.
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

    # Scales in device memory are read here, never by the host (CUDA graphs replay
    # with new values).
    k_scale = k_scale_value
    if K_SCALE_FROM_PTR:
        k_scale = tl.load(k_scale_ptr)
    v_scale = v_scale_value
    if V_SCALE_FROM_PTR:
        v_scale = tl.load(v_scale_ptr)
    # Natural-log score scale; k_scale multiplies every key, so it folds in here.
    qk_scale = sm_scale * k_scale
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + q_head * stride_alibi, mask=row_valid, other=0.0)
        slope = slope.to(tl.float32)

    # Keys any row of this tile can see: [kv_begin, kv_end).
    first_q_pos = context_len + tile_start
    last_q_pos = context_len + tl.minimum(tile_start + BLOCK_Q, q_len) - 1
    kv_end = last_q_pos + 1 if IS_CAUSAL else seq_len
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(first_q_pos - window + 1, 0)
    if USE_CHUNK:
        kv_begin = tl.maximum((first_q_pos // chunk) * chunk, 0)
    # This program's split: blocks [split_first, split_end) of the tile's block range,
    # the range cut into num_splits nearly equal runs of consecutive blocks (sizes differ
    # by at most one; with more splits than blocks some runs are empty).
    first_block = kv_begin // BLOCK_SIZE
    num_blocks = tl.maximum((kv_end + BLOCK_SIZE - 1) // BLOCK_SIZE - first_block, 0)
    split_first = first_block + (num_blocks * split) // num_splits
    split_end = first_block + (num_blocks * (split + 1)) // num_splits
    lo = tl.maximum(split_first * BLOCK_SIZE, kv_begin)
    hi = tl.minimum(split_end * BLOCK_SIZE, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    offs_n = tl.arange(0, KV_TILE)
    table_row = block_table_ptr + request.to(tl.int64) * stride_bt
    head_offsets = kv_head * stride_ch + dims[None, :] * stride_cd
    # KV_TILE keys per step, gathered through the block table one key at a time.
    for tile_lo in range(lo, hi, KV_TILE):
        k_pos = tile_lo + offs_n
        # Only keys in [lo, hi) are read. Outside it a slot may hold anything (stale
        # data, NaN, a released block behind a window): loading it as 0 matters because
        # p = 0 times NaN would still be NaN.
        k_valid = k_pos < hi
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
        k = load_kv_tile(k_ptrs, kv_mask, FP8_BITS)
        v = load_kv_tile(k_ptrs + stride_ckv, kv_mask, FP8_BITS)
        if CAST_KV:
            # fp8 cache: widen to the query dtype (exact for e4m3) before both dots,
            # so P is rounded to the query dtype below, never to fp8.
            k = k.to(query_ptr.dtype.element_ty)
            v = v.to(query_ptr.dtype.element_ty)
        if DOT_IN_FP32:
            k = k.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if USE_SOFT_CAP:
            # cap * tanh(s / cap), with tanh from one exp of a non-positive argument.
            x = s / soft_cap
            e = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - e) / (1.0 + e)
            s = soft_cap * tl.where(x < 0.0, -th, th)
        if USE_ALIBI:
            s += slope[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
        # log2 domain from here: exp2 is the native instruction.
        s = s * LOG2E
        s = mask_scores(
            s, row_valid, k_valid, q_pos, k_pos, window, chunk, IS_CAUSAL, USE_WINDOW, USE_CHUNK
        )
        # v has the query dtype here (after any widening); p is rounded to it.
        m_i, l_i, acc = online_softmax_update(
            s, v, m_i, l_i, acc, v.dtype, DOT_PRECISION, DOT_IN_FP32
        )

    # A row that saw no key in this split (l_i == 0) gets output 0 and lse -inf.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (v_scale / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    split64 = split.to(tl.int64)
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


# ------------------------------------------------------------------------ stage 2


@triton.jit
def _split_kv_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    output_ptr,
    lse_ptr,
    sinks_ptr,
    query_start_loc_ptr,
    num_requests,
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
    stride_lset,
    stride_lseh,
    stride_sinks,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_SINKS: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    # The grid covers every row of query; padding rows past the last request are left
    # untouched (their partials were never written).
    if token >= tl.load(query_start_loc_ptr + num_requests):
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
    if WRITE_LSE:
        total = tl.where(empty, neg_inf, shift + tl.log(tl.where(empty, 1.0, denom)))
        tl.store(lse_ptr + token64 * stride_lset + head * stride_lseh, total)


# The Triton interpreter stores bfloat16 as uint16 and its tl.dot multiplies those bit
# patterns (triton-lang/triton#11584). Under the interpreter only, bf16 dot operands are
# upcast after the same rounding the GPU path applies.
# It also decodes the e4m3fn NaN pattern (0x7F / 0xFF) as +-480 (measured on triton
# 3.9), which would hide a kernel reading an unwritten NaN slot. Under the interpreter
# only, an fp8 cache is passed as a uint8 view (same storage, no copy) and decoded by
# e4m3_bits_to_f32 (in _attention_common); compiled kernels keep Triton's native fp8
# conversion. This is the choice unified_attention makes too.
_INTERPRETED = isinstance(_split_kv_partial_kernel, InterpretedFunction)


# ------------------------------------------------------------------------ helpers


class SplitKVWorkspace(NamedTuple):
    """Scratch between the two stages of :func:`split_kv_decode`.

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


def choose_num_splits(
    num_reqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    block_size: int,
    num_sms: int = 132,
) -> int:
    """Pick ``num_splits`` for :func:`split_kv_decode` (a host-side heuristic).

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


def _check_float_arg(name: str, value: object, *, positive: bool) -> float:
    checked = check_finite_float(name, value)
    if positive and checked <= 0:
        raise ValueError(f"{name}: expected a float > 0, got {value!r}")
    return checked


def _check_head_vector(name: str, t: object, num_q_heads: int, device: torch.device) -> None:
    t = require_tensor(name, t, f"a float torch.Tensor [{num_q_heads}] ([Hq]) or None")
    if t.dim() != 1 or t.shape[0] != num_q_heads:
        raise ValueError(f"{name}: expected shape [{num_q_heads}] ([Hq]), got {tuple(t.shape)}")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name}: expected dtype in {_SUPPORTED_DTYPES}, got {t.dtype}")
    check_device(name, t, device)


def _check_kv_scale(
    name: str, value: float | torch.Tensor | None, device: torch.device
) -> float | torch.Tensor:
    if value is None:
        return 1.0
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name}: expected a one-element tensor, got shape {tuple(value.shape)}"
            )
        if value.dtype != torch.float32:
            raise ValueError(f"{name}: expected dtype torch.float32, got {value.dtype}")
        check_device(name, value, device)
        return value
    return _check_float_arg(name, value, positive=True)


def _check_output_like(
    name: str,
    t: object,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    t = require_tensor(name, t, f"a {dtype} torch.Tensor {list(shape)} or None")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    check_device(name, t, device)
    return t


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


# ------------------------------------------------------------------------ launcher


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
    output: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: SplitKVWorkspace | None = None,
) -> torch.Tensor:
    """Split-KV attention of a decode batch over the paged ``kv_cache``.

    Args:
        query: ``[T, Hq, D]`` float32/float16/bfloat16, any strides.
        kv_cache: ``[NB, 2, BS, Hkv, D]``, contiguous, the query dtype or
            ``torch.float8_e4m3fn`` (then ``k_scale`` and ``v_scale`` are required);
            ``BS in (16, 32, 64, 128)``, ``16 <= D <= 256``. This step's K/V must
            already be written.
        query_start_loc, seq_lens, block_table: int32 batch metadata (module docstring).
        max_seq_len: bound on every ``seq_lens[b]``; checks the block-table width.
        scale: multiplies ``q . k``.
        num_splits: key chunks per request, ``1 <= num_splits <= 256`` (see
            :func:`choose_num_splits`).
        max_query_len: bound on every request's query count, ``<= 16`` (1 for plain
            decode, more for speculative decoding, 0 launches nothing). It sizes the
            grid: the extra rows of a request with more queries would be merged from
            stale scratch, i.e. wrong. Longer prefills belong in ``unified_attention``.
        causal, sliding_window, chunk_size, logits_soft_cap, alibi_slopes, sinks: as
            for :func:`attnkit.kernels.torch.attention.paged_attention`; the two
            ``[Hq]`` tensors may be any float dtype.
        k_scale, v_scale: multiply the cached keys / values; None (1.0), a float, or a
            float32 one-element device tensor (read by the kernel, never by the host, so
            a CUDA graph replays with new values).
        output: optional ``[T, Hq, D]`` of the query dtype to write into.
        lse: optional float32 ``[T, Hq]`` to receive the natural-log lse (sink
            included); not computed when not given.
        workspace: optional scratch (:class:`SplitKVWorkspace`,
            :func:`split_kv_workspace`); allocated per call when not given.

    Returns:
        ``output`` (allocated when not given). Rows at or past ``query_start_loc[B]``
        of ``output`` and ``lse`` are left untouched.
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
    if kv_cache.dtype not in (query.dtype, *_FP8_CACHE_DTYPES):
        raise ValueError(
            f"kv_cache: expected dtype {query.dtype} (the query dtype) or one of "
            f"{_FP8_CACHE_DTYPES}, got {kv_cache.dtype}"
        )
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
    max_query_len = check_int_arg("max_query_len", max_query_len, 0, MAX_QUERY_LEN)
    max_seq_len = check_int_arg("max_seq_len", max_seq_len, 0)
    if causal and max_seq_len < max_query_len:
        raise ValueError(
            f"max_seq_len: expected an int >= {max_query_len} (max_query_len; seq_lens "
            f"include the queries), got {max_seq_len}"
        )
    check_block_table_width(block_table, block_size, max_seq_len)
    num_splits = check_int_arg("num_splits", num_splits, 1, MAX_NUM_SPLITS)
    scale = _check_float_arg("scale", scale, positive=False)
    if sliding_window is not None and chunk_size is not None:
        raise ValueError(
            "sliding_window and chunk_size: expected at most one, got "
            f"sliding_window={sliding_window} and chunk_size={chunk_size}"
        )
    if sliding_window is not None:
        sliding_window = check_int_arg("sliding_window", sliding_window, 1)
        if not causal:
            raise ValueError("sliding_window: requires causal=True")
    if chunk_size is not None:
        chunk_size = check_int_arg("chunk_size", chunk_size, 1)
        if not causal:
            raise ValueError("chunk_size: requires causal=True")
    if logits_soft_cap is not None:
        logits_soft_cap = _check_float_arg("logits_soft_cap", logits_soft_cap, positive=True)
    if alibi_slopes is not None:
        _check_head_vector("alibi_slopes", alibi_slopes, num_q_heads, device)
    if sinks is not None:
        _check_head_vector("sinks", sinks, num_q_heads, device)
    k_scale_arg = _check_kv_scale("k_scale", k_scale, device)
    v_scale_arg = _check_kv_scale("v_scale", v_scale, device)
    is_fp8 = kv_cache.dtype in _FP8_CACHE_DTYPES
    if is_fp8 and (k_scale is None or v_scale is None):
        missing = "k_scale" if k_scale is None else "v_scale"
        raise ValueError(
            f"{missing}: expected a float or a one-element torch.float32 tensor with a "
            f"{kv_cache.dtype} kv_cache, got None"
        )

    if output is None:
        output = torch.empty_like(query)
    else:
        output = _check_output_like("output", output, tuple(query.shape), query.dtype, device)
    if lse is not None:
        lse = _check_output_like("lse", lse, (num_tokens, num_q_heads), torch.float32, device)
    if workspace is None:
        if num_tokens == 0 or num_requests == 0 or max_query_len == 0:
            return output
        workspace = split_kv_workspace(num_splits, num_tokens, num_q_heads, head_dim, device=device)
    else:
        workspace = _check_workspace(
            workspace, num_splits, num_tokens, num_q_heads, head_dim, device
        )
    if num_tokens == 0 or num_requests == 0 or max_query_len == 0:
        return output
    part_out, part_lse = workspace

    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # Query tokens per program: all of a request's queries when the tile stays within
    # _MAX_ROWS rows, raised so the tile has at least _MIN_ROWS rows for tl.dot.
    block_q = triton.next_power_of_2(max_query_len)
    block_q = min(block_q, max(1, _MAX_ROWS // group_pad))
    block_q = max(block_q, _MIN_ROWS // group_pad, 1)
    tiles_per_request = triton.cdiv(max_query_len, block_q)
    # Keys per inner step, gathered through the block table one key at a time, so a
    # step may span several small blocks or part of a large one: a [KV_TILE, D] tile of
    # K and of V sits in registers next to the [BLOCK_M, D] fp32 accumulator, so it
    # shrinks for the widest heads (64 x 128 or 32 x 256 elements).
    kv_tile = 64 if head_dim_pad <= 128 else 32
    # A scale given as a tensor is read by the kernel; the float slot is then unused
    # (and vice versa: seq_lens stands in for the unread pointer).
    k_scale_ptr = k_scale_arg if isinstance(k_scale_arg, torch.Tensor) else seq_lens
    v_scale_ptr = v_scale_arg if isinstance(v_scale_arg, torch.Tensor) else seq_lens
    k_scale_value = k_scale_arg if isinstance(k_scale_arg, float) else 1.0
    v_scale_value = v_scale_arg if isinstance(v_scale_arg, float) else 1.0
    fp8_bits = is_fp8 and _INTERPRETED

    _split_kv_partial_kernel[(num_requests * tiles_per_request, num_kv_heads, num_splits)](
        query_ptr=query,
        # A uint8 view shares the storage (no copy); see the note on _INTERPRETED.
        cache_ptr=kv_cache.view(torch.uint8) if fp8_bits else kv_cache,
        part_out_ptr=part_out,
        part_lse_ptr=part_lse,
        query_start_loc_ptr=query_start_loc,
        seq_lens_ptr=seq_lens,
        block_table_ptr=block_table,
        alibi_ptr=alibi_slopes if alibi_slopes is not None else seq_lens,
        k_scale_ptr=k_scale_ptr,
        v_scale_ptr=v_scale_ptr,
        sm_scale=scale,
        k_scale_value=k_scale_value,
        v_scale_value=v_scale_value,
        soft_cap=logits_soft_cap if logits_soft_cap is not None else 1.0,
        window=sliding_window if sliding_window is not None else 0,
        chunk=chunk_size if chunk_size is not None else 1,
        tiles_per_request=tiles_per_request,
        num_splits=num_splits,
        stride_qt=query.stride(0),
        stride_qh=query.stride(1),
        stride_qd=query.stride(2),
        stride_ps=part_out.stride(0),
        stride_pt=part_out.stride(1),
        stride_ph=part_out.stride(2),
        stride_pd=part_out.stride(3),
        stride_ls=part_lse.stride(0),
        stride_lt=part_lse.stride(1),
        stride_lh=part_lse.stride(2),
        stride_cb=kv_cache.stride(0),
        stride_ckv=kv_cache.stride(1),
        stride_cs=kv_cache.stride(2),
        stride_ch=kv_cache.stride(3),
        stride_cd=kv_cache.stride(4),
        stride_bt=block_table.stride(0),
        stride_alibi=alibi_slopes.stride(0) if alibi_slopes is not None else 0,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_SIZE=block_size,
        KV_TILE=kv_tile,
        IS_CAUSAL=causal,
        USE_WINDOW=sliding_window is not None,
        USE_CHUNK=chunk_size is not None,
        USE_SOFT_CAP=logits_soft_cap is not None,
        USE_ALIBI=alibi_slopes is not None,
        K_SCALE_FROM_PTR=isinstance(k_scale_arg, torch.Tensor),
        V_SCALE_FROM_PTR=isinstance(v_scale_arg, torch.Tensor),
        CAST_KV=kv_cache.dtype != query.dtype,
        FP8_BITS=fp8_bits,
        # fp32 inputs would otherwise default to TF32 on NVIDIA; no effect on 16-bit.
        DOT_PRECISION="ieee",
        DOT_IN_FP32=_INTERPRETED and query.dtype == torch.bfloat16,
        # The [64, 256] fp32 accumulator alone is 128 registers a thread with 4 warps.
        num_warps=8 if head_dim_pad >= 256 else 4,
        # Explicit: Triton 3.9 warns when it is left unset (the default flips in 3.10).
        enable_fp_fusion=True,
    )
    # Without lse the merge kernel never touches lse_ptr; part_lse stands in for it.
    lse_out = lse if lse is not None else part_lse
    _split_kv_merge_kernel[(num_tokens, num_q_heads)](
        part_out_ptr=part_out,
        part_lse_ptr=part_lse,
        output_ptr=output,
        lse_ptr=lse_out,
        sinks_ptr=sinks if sinks is not None else seq_lens,
        query_start_loc_ptr=query_start_loc,
        num_requests=num_requests,
        num_splits=num_splits,
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
        stride_lset=lse.stride(0) if lse is not None else 0,
        stride_lseh=lse.stride(1) if lse is not None else 0,
        stride_sinks=sinks.stride(0) if sinks is not None else 0,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        USE_SINKS=sinks is not None,
        WRITE_LSE=lse is not None,
        enable_fp_fusion=True,
    )
    return output
