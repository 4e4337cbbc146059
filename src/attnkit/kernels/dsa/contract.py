"""The contract of DeepSeek sparse attention's ops (DeepSeek-AI, 2025, "DeepSeek-V3.2-Exp").

**The index cache.** Each token keeps one index key of ``D`` channels (``D =
index_head_dim``, 128 in V3.2), stored as a row of ``index_row_bytes(D)`` bytes: ``D``
fp8 e4m3 values then one float32 scale per :data:`SCALE_BLOCK` values (``D / 128 * 4``
bytes; 132 bytes per token for ``D = 128``). A scale is a power of two (an exponent
only, as the ue8m0 scales of the published kernels), ``2 ** ceil(log2(amax / 448))`` of
its block (1 for an all-zero block), so dequantising ``value * scale`` is exact. The
cache is ``uint8`` ``[NB, BS, W]``, ``W = index_row_bytes(D)``; position ``p`` of request
``b`` is in block ``block_table[b, p // BS]`` at offset ``p % BS``.

**The score.** ``I[t, s] = sum_j weights[t, j] * relu(q[t, j] . k[s])`` over the ``H``
indexer heads (64 in V3.2); any softmax scale is the caller's, folded into ``weights``.

**The selection.** Each query token keeps the ``topk`` positions of highest score among
those it may see (causal: ``s <= p``; with a window ``w``: ``s > p - w``), all of them
when fewer are visible, returned as **global slot ids** of the paired MLA cache
(``block * BS + offset``) in ascending position order, ``-1`` padded to ``topk``, with
the count of valid entries per token. **Ties** (equal scores) go to the **earlier
position**; a NaN or infinite score of a visible position counts as the lowest finite
score (so it is kept only when fewer than ``topk`` others are visible).

Checks read metadata only and raise ``ValueError`` (``TypeError`` for a wrong Python
type) naming the argument, what is allowed and what was given.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.kernels._checks import check_device, check_int_arg, check_tensor, describe

__all__ = [
    "FP8_MAX",
    "INDEX_DTYPES",
    "SCALE_BLOCK",
    "check_index_cache",
    "check_logits_args",
    "check_selection",
    "check_sparse_mla_args",
    "check_topk_args",
    "check_unit_last_dim",
    "check_write_args",
    "index_row_bytes",
]

SCALE_BLOCK = 128
"""Values per fp32 scale in an index row."""

FP8_MAX = 448.0
"""The largest finite float8 e4m3 (``torch.float8_e4m3fn``) value."""

INDEX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes of index queries, keys and weights."""


def index_row_bytes(index_head_dim: int, scale_block: int = SCALE_BLOCK) -> int:
    """Bytes of one token's index row: ``D`` fp8 values and ``D / scale_block`` fp32 scales."""
    dim = check_int_arg("index_head_dim", index_head_dim, 1)
    block = check_int_arg("scale_block", scale_block, 1)
    if dim % block:
        raise ValueError(f"index_head_dim: expected a multiple of scale_block={block}, got {dim}")
    return dim + dim // block * 4


def index_head_dim_of(row_bytes: int) -> int:
    """The ``D`` whose row is ``row_bytes`` wide (``row = D * 132 / 128``)."""
    if row_bytes % (SCALE_BLOCK + 4):
        raise ValueError(
            f"index_cache: expected a row width that is a multiple of {SCALE_BLOCK + 4} "
            f"(D fp8 bytes + D/{SCALE_BLOCK} fp32 scales), got {row_bytes}"
        )
    return row_bytes // (SCALE_BLOCK + 4) * SCALE_BLOCK


def check_index_cache(index_cache: object, device: torch.device | None = None) -> Tensor:
    """``index_cache`` uint8 ``[NB, BS, W]``, contiguous, ``W = index_row_bytes(D)``."""
    cache = require_cache(index_cache)
    check_device("index_cache", cache, device)
    index_head_dim_of(cache.shape[2])
    return cache


def require_cache(index_cache: object) -> Tensor:
    cache = check_tensor(
        "index_cache",
        index_cache,
        layout="[NB, BS, W] uint8",
        shape=(None, None, None),
        device=None,
    )
    if cache.dtype != torch.uint8:
        raise ValueError(f"index_cache: expected dtype torch.uint8, got {cache.dtype}")
    if cache.shape[0] == 0 or cache.shape[1] == 0:
        raise ValueError(
            f"index_cache: expected at least one block of one slot, got {describe(cache)}"
        )
    if not cache.is_contiguous():
        raise ValueError(
            f"index_cache: expected a contiguous tensor, got strides {tuple(cache.stride())}"
        )
    return cache


def check_selection(
    indices: object, lens: object, *, num_tokens: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """``indices`` int32 ``[T, K]`` (global slots, -1 padded) and ``lens`` int32 ``[T]``."""
    idx = check_tensor(
        "indices", indices, layout="[T, topk]", shape=(num_tokens, None), device=device
    )
    if idx.dtype != torch.int32:
        raise ValueError(f"indices: expected dtype torch.int32, got {idx.dtype}")
    if idx.shape[1] == 0:
        raise ValueError(f"indices: expected topk >= 1 columns, got {describe(idx)}")
    counts = check_tensor("lens", lens, layout="[T]", shape=(num_tokens,), device=device)
    if counts.dtype != torch.int32:
        raise ValueError(f"lens: expected dtype torch.int32, got {counts.dtype}")
    return idx, counts


def check_unit_last_dim(name: str, tensor: Tensor) -> None:
    """A launcher's layout need: ``tensor``'s last dimension has unit stride (a kernel
    limit, not the op's: the references take any strides)."""
    if tensor.dim() and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected a contiguous last dimension, got strides {tensor.stride()}"
        )


def _check_index_dtype(name: str, tensor: Tensor) -> None:
    if tensor.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name}: expected dtype in {INDEX_DTYPES}, got {tensor.dtype}")


def _check_window(window: int | None) -> None:
    if window is not None:
        check_int_arg("window", window, 1)


def check_write_args(
    keys: object, index_cache: object, slot_mapping: object
) -> tuple[Tensor, Tensor, Tensor]:
    """``write_index_cache``'s arguments: ``keys`` ``[T, D]`` (or ``[T, 1, D]``, squeezed)
    of an index dtype, the cache (``check_index_cache``), ``slot_mapping`` int64 ``[T]``.
    Returns ``(keys [T, D], cache, slots)``."""
    cache = check_index_cache(index_cache)
    if isinstance(keys, Tensor) and keys.dim() == 3 and keys.shape[1] == 1:
        keys = keys[:, 0]
    dim = index_head_dim_of(cache.shape[2])
    rows = check_tensor("keys", keys, layout="[T, D]", shape=(None, dim), device=cache.device)
    _check_index_dtype("keys", rows)
    slots = check_tensor(
        "slot_mapping", slot_mapping, layout="[T]", shape=(rows.shape[0],), device=cache.device
    )
    if slots.dtype != torch.int64:
        raise ValueError(f"slot_mapping: expected dtype torch.int64, got {slots.dtype}")
    return rows, cache, slots


def check_logits_args(
    q: Tensor, weights: object, index_cache: object, max_seq_len: object, window: int | None
) -> tuple[Tensor, Tensor, Tensor, int]:
    """``indexer_logits``' arguments: ``q`` ``[T, H, D]`` of an index dtype, ``weights``
    ``[T, H]``, the cache on ``q``'s device, ``max_seq_len >= 1``, ``window`` ``None`` or
    ``>= 1``. Returns ``(q, weights, cache, max_seq_len)``."""
    cache = check_index_cache(index_cache, q.device)
    dim = index_head_dim_of(cache.shape[2])
    q = check_tensor("q", q, layout="[T, H, D]", shape=(None, None, dim), device=None)
    _check_index_dtype("q", q)
    tokens, heads = q.shape[0], q.shape[1]
    w = check_tensor("weights", weights, layout="[T, H]", shape=(tokens, heads), device=q.device)
    length = check_int_arg("max_seq_len", max_seq_len, 1)
    _check_window(window)
    return q, w, cache, length


def check_topk_args(
    logits: object, block_size: object, topk: object, window: int | None
) -> tuple[Tensor, int, int]:
    """``topk_select``'s arguments: ``logits`` ``[T, L]``, ``block_size >= 1``, ``topk >=
    1``, ``window`` ``None`` or ``>= 1``. Returns ``(logits, block_size, topk)``."""
    k = check_int_arg("topk", topk, 1)
    bs = check_int_arg("block_size", block_size, 1)
    scores = check_tensor("logits", logits, layout="[T, L]", shape=(None, None), device=None)
    _check_window(window)
    return scores, bs, k


def check_sparse_mla_args(
    query: Tensor,
    latent_cache: object,
    indices: object,
    lens: object,
    kv_lora_rank: object,
    output: object,
    lse: object,
) -> tuple[Tensor, Tensor, Tensor, int]:
    """``sparse_mla_attention``'s arguments: ``query`` ``[T, H, D]``, ``latent_cache``
    ``[NB, BS, D]`` on its device, ``1 <= kv_lora_rank <= D``, the selection
    (``check_selection``), ``output`` ``[T, H, R]`` and ``lse`` ``[T, H]`` when given.
    Returns ``(cache, indices, lens, kv_lora_rank)``."""
    if query.dim() != 3:
        raise ValueError(f"query: expected shape [T, H, D], got {tuple(query.shape)}")
    tokens, heads, dim = query.shape
    cache = check_tensor(
        "latent_cache",
        latent_cache,
        layout="[NB, BS, D]",
        shape=(None, None, dim),
        device=query.device,
    )
    check_device("latent_cache", cache, query.device)
    rank = check_int_arg("kv_lora_rank", kv_lora_rank, 1, dim)
    idx, counts = check_selection(indices, lens, num_tokens=tokens, device=query.device)
    if output is not None:
        check_tensor(
            "output", output, layout="[T, H, R]", shape=(tokens, heads, rank), device=query.device
        )
    if lse is not None:
        check_tensor("lse", lse, layout="[T, H]", shape=(tokens, heads), device=query.device)
    return cache, idx, counts, rank
