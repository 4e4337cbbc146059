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
* ``query_start_loc``: int32 ``[B + 1]``; request ``b`` owns query rows
  ``query_start_loc[b] : query_start_loc[b + 1]``.
* ``seq_lens``: int32 ``[B]``; context length of request ``b`` *including* its queries.
* ``block_table``: int32 ``[B, MB]``; position ``p`` of request ``b`` lives in block
  ``block_table[b, p // BS]`` at offset ``p % BS``.

Query ``t`` (0-based within its request) sits at absolute position
``seq_len - q_len + t``. Query head ``h`` reads kv head ``h // G``. Key ``j`` is visible
to query position ``i`` iff ``j <= i`` (causal) and, with a sliding window ``W``,
``i - j < W`` (``W`` counts the query itself).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["unified_attention"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SUPPORTED_BLOCK_SIZES = (16, 32)
_MIN_HEAD_DIM = 16
_MAX_HEAD_DIM = 256
# Rows (query tokens x heads of one group) per program. 64 keeps the fp32 accumulator
# of the largest head size (256) without register spills in an sm_90 compile; 16 is the
# smallest M that tl.dot accepts on every target (older Triton releases require it).
_MAX_ROWS = 64
_MIN_ROWS = 16
_LOG2E = 1.4426950408889634


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _unified_attention_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    query_ptr,
    cache_ptr,
    output_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    qk_scale,
    window,
    tiles_per_request,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    # Padded extents exist because tl.arange needs powers of two; every load and store
    # below masks the padding lanes (dims >= HEAD_DIM, heads >= GROUP).
    tl.static_assert(HEAD_DIM_PAD >= HEAD_DIM)
    tl.static_assert(GROUP_PAD >= GROUP)
    # The K dimension of both dots (HEAD_DIM_PAD for q.k, BLOCK_SIZE for p.v) must be
    # >= 16 for 16-bit operands on NVIDIA.
    tl.static_assert(HEAD_DIM_PAD >= 16)
    tl.static_assert(BLOCK_SIZE >= 16)
    # A sliding window bounds the look-back; without causality it would also need a
    # look-ahead bound, which this kernel does not implement.
    tl.static_assert(IS_CAUSAL or not USE_WINDOW)
    # Each row of the tile is one (query token, query head of this kv group) pair, so
    # one K/V tile load serves all GROUP heads that share the kv head.
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD

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

    # Key positions this tile can see, so the loop skips blocks no row needs.
    last_q_pos = context_len + tl.minimum(tile_start + BLOCK_Q, q_len) - 1
    kv_end = last_q_pos + 1 if IS_CAUSAL else seq_len
    kv_begin = tl.maximum(context_len + tile_start - window + 1, 0) if USE_WINDOW else 0
    first_block = kv_begin // BLOCK_SIZE
    end_block = (kv_end + BLOCK_SIZE - 1) // BLOCK_SIZE

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    offs_n = tl.arange(0, BLOCK_SIZE)
    table_row = block_table_ptr + request.to(tl.int64) * stride_bt
    tile_offsets = offs_n[:, None] * stride_cs + kv_head * stride_ch + dims[None, :] * stride_cd
    for logical_block in range(first_block, end_block):
        # int64: NB * 2 * BS * Hkv * D may exceed 2**31 elements.
        physical_block = tl.load(table_row + logical_block).to(tl.int64)
        k_pos = logical_block * BLOCK_SIZE + offs_n
        # Slots past seq_len in the last block hold stale or uninitialised data (even
        # NaN); loading them as 0 matters because p = 0 times NaN would still be NaN.
        k_valid = k_pos < seq_len
        kv_mask = k_valid[:, None] & dim_valid[None, :]
        k_ptrs = cache_ptr + physical_block * stride_cb + tile_offsets
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(k_ptrs + stride_ckv, mask=kv_mask, other=0.0)

        if DOT_IN_FP32:
            k = k.to(tl.float32)
        # log2 domain: exp2 is the native instruction and qk_scale carries log2(e).
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = row_valid[:, None] & k_valid[None, :]
        if IS_CAUSAL:
            visible = visible & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row can see nothing in this block (window edge, padding rows); keep its
        # max finite so exp2(-inf - -inf) never produces NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        # Rounding p to the cache dtype is what the tensor-core path does; kept under
        # DOT_IN_FP32 too so both paths see the same rounding.
        p_op = p.to(v.dtype)
        if DOT_IN_FP32:
            p_op = p_op.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_op, v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Only padding rows end with l_i == 0 (every real query sees at least itself), and
    # their output is masked off; the guard just keeps the division finite.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        output_ptr
        + q_token[:, None] * stride_ot
        + q_head[:, None] * stride_oh
        + dims[None, :] * stride_od,
        out.to(output_ptr.dtype.element_ty),
        mask=io_mask,
    )


# The Triton interpreter stores bfloat16 as uint16 and its tl.dot multiplies those bit
# patterns (triton-lang/triton#11584; upstream: bf16 is unsupported there and should be
# cast to float32). Under the interpreter only, bf16 dot operands are upcast after the
# same rounding the GPU path applies; compiled kernels keep native bf16 dots.
_INTERPRETED = isinstance(_unified_attention_kernel, InterpretedFunction)


def _check_int_arg(name: str, value: object, minimum: int) -> int:
    # bool is an int subclass; reject it so a stray True is not read as 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def _check_scale(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"scale: expected a finite float, got {value!r}")
    return float(value)


def _check_index_tensor(
    name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device
) -> None:
    if t.dtype != torch.int32:
        raise ValueError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if t.dim() != len(shape) or any(
        want >= 0 and got != want for want, got in zip(shape, t.shape, strict=True)
    ):
        pretty = ", ".join("*" if s < 0 else str(s) for s in shape)
        raise ValueError(f"{name}: expected shape [{pretty}], got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (the query device), got {t.device}")
    # The kernel indexes the last dim with unit stride; checked here rather than
    # copied so a caller's per-step metadata never silently allocates.
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected unit stride in the last dim, got strides {tuple(t.stride())}"
        )


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
    sliding_window: int | None = None,
    output: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, Hq, D]`` over the paged ``kv_cache``.

    The new tokens' K/V must already be in the cache (see ``write_kv_cache``). Returns
    ``output`` (allocated when not given). Rows of ``output`` past
    ``query_start_loc[-1]`` are left untouched. ``max_query_len`` / ``max_seq_len``
    must bound the true per-request values: they size the grid, and the launcher never
    reads tensor values back to the host to check them.
    """
    if query.dim() != 3:
        raise ValueError(f"query: expected shape [T, Hq, D], got {tuple(query.shape)}")
    if query.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"query: expected dtype in {_SUPPORTED_DTYPES}, got {query.dtype}")
    num_tokens, num_q_heads, head_dim = query.shape
    device = query.device

    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache: expected shape [NB, 2, BS, Hkv, D], got {tuple(kv_cache.shape)}"
        )
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if kv_cache.dtype != query.dtype:
        raise ValueError(
            f"kv_cache: expected dtype {query.dtype} (the query dtype), got {kv_cache.dtype}"
        )
    if kv_cache.device != device:
        raise ValueError(
            f"kv_cache: expected device {device} (the query device), got {kv_cache.device}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache: expected a contiguous tensor, got a non-contiguous one")
    if cache_head_dim != head_dim:
        raise ValueError(
            f"kv_cache: expected head size {head_dim} (the query head size), got {cache_head_dim}"
        )
    if block_size not in _SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"kv_cache: expected block size in {_SUPPORTED_BLOCK_SIZES}, got {block_size}"
        )
    if not _MIN_HEAD_DIM <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(
            f"query: expected head size in [{_MIN_HEAD_DIM}, {_MAX_HEAD_DIM}], got {head_dim}"
        )
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"kv_cache: expected a kv head count dividing the {num_q_heads} query heads, "
            f"got {num_kv_heads}"
        )

    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens: expected shape [B], got {tuple(seq_lens.shape)}")
    num_requests = seq_lens.shape[0]
    _check_index_tensor("seq_lens", seq_lens, (num_requests,), device)
    _check_index_tensor("query_start_loc", query_start_loc, (num_requests + 1,), device)
    _check_index_tensor("block_table", block_table, (num_requests, -1), device)

    max_query_len = _check_int_arg("max_query_len", max_query_len, 0)
    max_seq_len = _check_int_arg("max_seq_len", max_seq_len, max_query_len)
    if block_table.shape[1] * block_size < max_seq_len:
        raise ValueError(
            f"block_table: expected at least {triton.cdiv(max_seq_len, block_size)} columns "
            f"for max_seq_len={max_seq_len} at block size {block_size}, "
            f"got {block_table.shape[1]}"
        )
    scale = _check_scale(scale)
    if sliding_window is not None:
        sliding_window = _check_int_arg("sliding_window", sliding_window, 1)

    if output is None:
        output = torch.empty_like(query)
    else:
        if tuple(output.shape) != tuple(query.shape):
            raise ValueError(
                f"output: expected shape {tuple(query.shape)} (the query shape), "
                f"got {tuple(output.shape)}"
            )
        if output.dtype != query.dtype:
            raise ValueError(
                f"output: expected dtype {query.dtype} (the query dtype), got {output.dtype}"
            )
        if output.device != device:
            raise ValueError(
                f"output: expected device {device} (the query device), got {output.device}"
            )

    if num_tokens == 0 or num_requests == 0 or max_query_len == 0:
        return output

    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # Query tokens per program: enough for the longest request when it is short (decode
    # batches), capped so the tile stays at most _MAX_ROWS rows unless one group alone
    # is wider, and raised so the tile has at least _MIN_ROWS rows for tl.dot.
    block_q = triton.next_power_of_2(max_query_len)
    block_q = min(block_q, max(1, _MAX_ROWS // group_pad))
    block_q = max(block_q, _MIN_ROWS // group_pad, 1)
    # Grid: axis 0 walks (request, query tile) pairs with every request given the tile
    # count of the longest one, so a program finds its request by one division instead
    # of searching query_start_loc; tiles past a request's end exit at once. Axis 1 is
    # the kv head, and the program covers all query heads of that head's group.
    tiles_per_request = triton.cdiv(max_query_len, block_q)
    grid = (num_requests * tiles_per_request, num_kv_heads)

    _unified_attention_kernel[grid](
        query_ptr=query,
        cache_ptr=kv_cache,
        output_ptr=output,
        query_start_loc_ptr=query_start_loc,
        seq_lens_ptr=seq_lens,
        block_table_ptr=block_table,
        qk_scale=scale * _LOG2E,
        window=sliding_window if sliding_window is not None else 0,
        tiles_per_request=tiles_per_request,
        stride_qt=query.stride(0),
        stride_qh=query.stride(1),
        stride_qd=query.stride(2),
        stride_ot=output.stride(0),
        stride_oh=output.stride(1),
        stride_od=output.stride(2),
        stride_cb=kv_cache.stride(0),
        stride_ckv=kv_cache.stride(1),
        stride_cs=kv_cache.stride(2),
        stride_ch=kv_cache.stride(3),
        stride_cd=kv_cache.stride(4),
        stride_bt=block_table.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_SIZE=block_size,
        IS_CAUSAL=True,
        USE_WINDOW=sliding_window is not None,
        # fp32 inputs would otherwise default to TF32 on NVIDIA, far outside fp32
        # tolerances; the setting has no effect on 16-bit operands.
        DOT_PRECISION="ieee",
        DOT_IN_FP32=_INTERPRETED and query.dtype == torch.bfloat16,
        # Explicit, not Triton's default: Triton 3.9 warns when the option is left unset
        # (its default flips in 3.10), and the test suite turns warnings into errors.
        enable_fp_fusion=True,
    )
    return output
