"""The paged-attention contract: argument rules shared by the torch oracle
(:mod:`attnkit.kernels.attention.reference`) and the Triton launchers
(:mod:`attnkit.kernels.attention.triton`, ``kv_write``), and the launchers' own
metadata rules (devices, strides, scale tensors).

``query`` ``[T, Hq, D]``, ``kv_cache`` ``[NB, 2, BS, Hkv, D]``, ``query_start_loc`` int32
``[B + 1]``, ``seq_lens`` int32 ``[B]``, ``block_table`` int32 ``[B, MB]`` (the letters
and conventions below). The rules here are the op's semantics (which mask
options combine, what a soft-cap, an ALiBi slope vector, a sink vector or a quantisation
scale may be); each side adds its own limits on top (the Triton kernels support only
some block and head sizes, the oracle reads metadata values back to check them). Every
check reads metadata only (no device value goes back to the host) and raises
``ValueError`` (``TypeError`` as well for a wrong Python type, see
:class:`~attnkit.kernels._checks.KernelTypeError`) with the argument's name, what is
allowed and what was given.

Shape letters used in the docstrings:

* ``T``   total query tokens in the batch (all requests, plus trailing padding tokens)
* ``B``   requests in the batch
* ``Hq``  query heads; ``Hkv`` key/value heads; ``D`` head size
* ``NB``  physical blocks in the cache; ``BS`` tokens per block

Conventions
-----------

Paged KV cache
    ``kv_cache`` is ``[NB, 2, BS, Hkv, D]``; index 0 of dim 1 holds keys, index 1 values.
    Block 0 is by convention a null block that real requests never use, but nothing
    here assumes anything about it.

Batch metadata
    ``query_start_loc`` int32 ``[B+1]`` holds cumulative query-token offsets starting at
    0: the queries of request ``b`` are rows ``qsl[b]:qsl[b+1]`` of ``query``. Rows from
    ``qsl[B]`` up to ``T`` are padding tokens; their output is 0 and their lse ``-inf``.
    ``seq_lens`` int32 ``[B]`` is each request's whole context length *including* this
    step's query tokens. ``block_table`` int32 ``[B, max_blocks]`` maps logical block
    ``i`` of request ``b`` to physical block ``block_table[b, i]``: token position ``p``
    lives at ``kv_cache[block_table[b, p // BS], :, p % BS]``. Entries past the
    ``ceil(seq_len / BS)`` blocks a request needs are never read.
    ``slot_mapping`` int64 ``[T]`` gives the physical slot ``block * BS + offset`` that
    each new token's key and value are written to; ``-1`` marks a padding token that is
    not written. Slots other than ``-1`` must be distinct.

Query positions
    The ``q_len = qsl[b+1] - qsl[b]`` queries of request ``b`` are the last ``q_len``
    positions of its context: query ``t`` (0-based within the request) sits at absolute
    position ``i = seq_len - q_len + t``. Keys sit at positions ``j = 0 .. seq_len-1``.

Grouped-query attention
    ``Hq`` is a multiple of ``Hkv``; query head ``h`` reads kv head ``h // (Hq // Hkv)``
    (MQA is ``Hkv == 1``).

Masks
    ``causal=True``: query ``i`` sees keys ``j <= i``. ``causal=False`` (bidirectional
    encoder attention, cross attention): a query sees every key of its request.
    ``sliding_window=W`` (``W >= 1``) further requires ``i - j < W``; the window counts
    the query token itself, so ``W=1`` sees only itself. ``chunk_size=C`` (chunked local
    attention) further requires ``j // C == i // C``. Both need ``causal=True`` and at
    most one of them may be given.

Draft trees
    ``draft_ancestors`` int64 ``[T]`` with ``draft_counts`` int32 ``[B]`` (both or
    neither, ``causal=True``): request ``b``'s last ``n = draft_counts[b]`` positions
    are draft tokens, and query row ``t`` sees key ``j >= seq_len - n`` only where bit
    ``j - (seq_len - n)`` of ``draft_ancestors[t]`` is set (its ancestors and itself);
    earlier keys follow the causal mask. Rows that are no draft hold 0. A draft's
    position is the root's (``seq_len - n - 1``) plus its depth (the bits set in its own
    row), not its slot: windows, chunks and ALiBi distances are measured in those
    positions, along the draft's own path.

Scores
    ``s = scale * (q . k)``; then, with ``logits_soft_cap=cap``, ``s = cap * tanh(s / cap)``;
    then, with ``alibi_slopes``, ``s += slope[h] * (j - i)`` (``<= 0`` for past keys);
    then masked keys get ``-inf``.

Attention sinks
    ``sinks`` ``[Hq]`` holds one learned logit per head, used as is (not scaled, capped
    or biased). It joins each row's softmax denominator but has no value vector, so it
    only absorbs probability mass.

Log-sum-exp
    ``lse[t, h]`` (float32, natural log) is the log of row ``(t, h)``'s softmax
    denominator, sink included, so that ``out = sum_j exp(s_j - lse) * v_j``. A row that
    sees no key at all (only possible for invalid or empty input) gets output 0 and
    lse ``-inf``; with a sink the denominator is ``exp(sink)``, so its lse is ``sinks[h]``.

Quantisation scales
    ``k_scale`` / ``v_scale`` multiply the cached keys / values after they are cast to
    float32, and the oracle's ``write_kv_cache`` divides by them before casting to the
    cache dtype. With the default 1.0 they change nothing. A float32 ``[Hkv]`` tensor
    holds one scale per K/V head: head ``n``'s keys are multiplied by ``k_scale[n]``.

Per-token-head scales
    ``kv_scales`` float32 ``[NB, 2, BS, Hkv]`` beside the cache holds one scale per
    cached (K or V, token, head) vector. The write computes it from the vector:
    ``s = amax(|x|) / QMAX`` (``1.0`` for an all-zero vector; ``QMAX`` 448 for
    ``float8_e4m3fn``, 127 for ``int8``) and stores ``x / s`` (int8: rounded to nearest,
    ties to even); a read multiplies the stored vector by ``s``. Static ``k_scale`` /
    ``v_scale`` are then 1.0.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor

from attnkit.kernels._checks import (
    KernelTypeError,
    check_bool,
    check_device,
    check_int_arg,
    describe,
    require_tensor,
)

__all__ = [
    "DYNAMIC_QMAX",
    "FP8_DTYPE",
    "HEAD_VECTOR_DTYPES",
    "check_batch_layout",
    "check_batch_metadata",
    "check_block_table_width",
    "check_cache_layout",
    "check_context_shard",
    "check_draft_tree",
    "check_head_scale",
    "check_head_vector",
    "check_index_layout",
    "check_index_tensor",
    "check_kv_scale",
    "check_kv_scales_cache",
    "check_logits_soft_cap",
    "check_mask_options",
    "check_num_heads",
    "check_query_layout",
    "check_scale_tensor",
    "check_shard_lens",
]

FP8_DTYPE = torch.float8_e4m3fn
"""The quantised cache dtype; such a cache stores ``key / k_scale`` and ``value / v_scale``."""

DYNAMIC_QMAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
"""Cache dtypes with per-token-head scales and the largest magnitude each stores."""

HEAD_VECTOR_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
"""Dtypes of the per-head ``alibi_slopes`` and ``sinks`` vectors (read as float32)."""


def check_context_shard(context_shard: object) -> tuple[int, int] | None:
    """A decode context-parallel shard ``(rank, size)`` with ``0 <= rank < size``, or
    None: local key ``j`` of each request sits at position ``j * size + rank``."""
    if context_shard is None:
        return None
    given: object = context_shard  # for the message (narrowed below)
    if not (
        isinstance(context_shard, tuple)
        and len(context_shard) == 2  # pyright: ignore[reportUnknownArgumentType]
        and all(isinstance(v, int) and not isinstance(v, bool) for v in context_shard)  # pyright: ignore[reportUnknownVariableType]
    ):
        raise KernelTypeError(
            f"context_shard: expected a (rank, size) tuple of ints or None, got {describe(given)}"
        )
    rank, size = cast("tuple[int, int]", context_shard)
    if not 0 <= rank < size:
        raise ValueError(f"context_shard: expected 0 <= rank < size, got ({rank}, {size})")
    return rank, size


def check_shard_lens(context_shard: object, global_seq_lens: object) -> tuple[int, int] | None:
    """The shard (:func:`check_context_shard`); ``global_seq_lens`` (every request's whole
    length, which places its queries) is given with a shard only. Each side checks the
    tensor itself (the plan its layout, the oracle its values against ``seq_lens``)."""
    shard = check_context_shard(context_shard)
    if shard is None and global_seq_lens is not None:
        raise ValueError(
            "global_seq_lens: expected None without context_shard, "
            f"got {describe(global_seq_lens)}"
        )
    return shard


def check_mask_options(
    causal: object, sliding_window: object, chunk_size: object
) -> tuple[bool, int | None, int | None]:
    """The mask options: ``sliding_window`` ``W >= 1`` and ``chunk_size`` ``C >= 1`` each
    need ``causal=True`` (they bound the look-back from the query position) and exclude
    each other. Returns them checked."""
    causal = check_bool("causal", causal)
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
    return causal, sliding_window, chunk_size


def check_logits_soft_cap(value: object) -> float | None:
    """None, or a finite ``cap > 0`` (``cap * tanh(s / cap)``; inf would give ``inf * 0``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KernelTypeError(
            f"logits_soft_cap: expected a finite float > 0 or None, got {describe(value)}"
        )
    if not math.isfinite(value) or not value > 0:
        raise ValueError(f"logits_soft_cap: expected a finite float > 0 or None, got {value!r}")
    return float(value)


def check_num_heads(num_q_heads: int, num_kv_heads: int) -> None:
    """Grouped-query attention: ``Hkv`` divides ``Hq`` (query head ``h`` reads ``h // G``)."""
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"kv_cache: expected a kv head count dividing the {num_q_heads} query heads, "
            f"got {num_kv_heads}"
        )


def check_head_vector(
    name: str, t: object, num_q_heads: int, device: torch.device | None
) -> Tensor | None:
    """None, or a ``[Hq]`` tensor of a dtype in :data:`HEAD_VECTOR_DTYPES` (any stride)
    on ``device``: the ALiBi slopes and the attention-sink logits."""
    if t is None:
        return None
    t = require_tensor(name, t, f"a float torch.Tensor [Hq]=[{num_q_heads}] or None")
    if t.dim() != 1 or t.shape[0] != num_q_heads:
        raise ValueError(f"{name}: expected shape [{num_q_heads}], got {list(t.shape)}")
    if t.dtype not in HEAD_VECTOR_DTYPES:
        raise ValueError(f"{name}: expected dtype in {HEAD_VECTOR_DTYPES}, got {t.dtype}")
    check_device(name, t, device)
    return t


def check_kv_scale(
    name: str,
    value: object,
    device: torch.device | None,
    *,
    allow_tensor: bool = True,
    num_kv_heads: int | None = None,
) -> float | Tensor | None:
    """A quantisation scale (``k_scale`` / ``v_scale``): None (1.0), a finite float > 0,
    or (``allow_tensor``) a one-element float32 tensor of shape ``[]`` or ``[1]`` on
    ``device``, read by the kernel and never by the host (a CUDA graph replays with new
    values); with ``num_kv_heads``, also a per-head float32 ``[Hkv]`` tensor
    (:func:`check_head_scale`)."""
    if value is None:
        return None
    if (
        isinstance(value, Tensor)
        and allow_tensor
        and num_kv_heads is not None
        and value.dim() == 1
        and value.numel() != 1
    ):
        return check_head_scale(name, value, num_kv_heads, device)
    if isinstance(value, Tensor) and allow_tensor:
        return check_scale_tensor(name, value, device, "query")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        allowed = (
            "a float > 0, a one-element torch.float32 tensor or None"
            if allow_tensor
            else "a float > 0"
        )
        raise KernelTypeError(f"{name}: expected {allowed}, got {describe(value)}")
    if not math.isfinite(value) or not value > 0:
        raise ValueError(f"{name}: expected a float > 0, got {value!r}")
    return float(value)


def check_head_scale(name: str, t: Tensor, num_kv_heads: int, device: torch.device | None) -> Tensor:
    """A per-head quantisation scale: float32 ``[Hkv]`` on ``device`` (any device when
    None), unit stride. Its values (which no launch reads back) must be finite and > 0."""
    if t.dtype != torch.float32 or t.dim() != 1 or t.shape[0] != num_kv_heads:
        raise ValueError(
            f"{name}: expected a torch.float32 tensor of shape [] or [1] (per tensor) or "
            f"[Hkv]=[{num_kv_heads}] (per K/V head), got {t.dtype} {list(t.shape)}"
        )
    if num_kv_heads > 1 and t.stride(0) != 1:
        raise ValueError(f"{name}: expected unit stride, got strides {tuple(t.stride())}")
    if device is not None:
        check_device(name, t, device, "query")
    return t


def check_kv_scales_cache(kv_scales: object, kv_cache: Tensor) -> Tensor | None:
    """None (no per-token-head scales: the cache dtype must not need them), or the
    float32 ``[NB, 2, BS, Hkv]`` scales of a ``kv_cache`` of a :data:`DYNAMIC_QMAX`
    dtype, on its device."""
    if kv_scales is None:
        if kv_cache.dtype == torch.int8:
            raise ValueError(
                "kv_scales: expected the float32 [NB, 2, BS, Hkv] per-token-head scales of "
                "an int8 kv_cache, got None"
            )
        return None
    kv_scales = require_tensor("kv_scales", kv_scales, "a float32 torch.Tensor [NB, 2, BS, Hkv]")
    if kv_cache.dtype not in DYNAMIC_QMAX:
        raise ValueError(
            f"kv_scales: expected None for a {kv_cache.dtype} kv_cache (per-token-head "
            f"scales quantise to {tuple(DYNAMIC_QMAX)}), got {describe(kv_scales)}"
        )
    want = tuple(kv_cache.shape[:4])
    if kv_scales.dtype != torch.float32 or tuple(kv_scales.shape) != want:
        raise ValueError(
            f"kv_scales: expected torch.float32 {list(want)} (kv_cache's [NB, 2, BS, Hkv]), "
            f"got {kv_scales.dtype} {list(kv_scales.shape)}"
        )
    check_device("kv_scales", kv_scales, kv_cache.device, "kv_cache")
    return kv_scales


def check_query_layout(query: object) -> Tensor:
    """``query`` is a ``[T, Hq, D]`` tensor."""
    query = require_tensor("query", query, "a torch.Tensor [T, Hq, D]")
    if query.dim() != 3:
        raise ValueError(f"query: expected shape [T, Hq, D], got {tuple(query.shape)}")
    return query


def check_cache_layout(kv_cache: object, query: Tensor) -> Tensor:
    """``kv_cache`` is a ``[NB, 2, BS, Hkv, D]`` tensor with the query's head size and a
    kv head count dividing the query's (any dtype: each side adds its dtype rule)."""
    kv_cache = require_tensor("kv_cache", kv_cache, "a torch.Tensor [NB, 2, BS, Hkv, D]")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache: expected shape [NB, 2, BS, Hkv, D], got {tuple(kv_cache.shape)}"
        )
    head_dim, cache_head_dim = query.shape[2], kv_cache.shape[4]
    if cache_head_dim != head_dim:
        raise ValueError(
            f"kv_cache: expected head size {head_dim} (the query head size), got {cache_head_dim}"
        )
    check_num_heads(query.shape[1], kv_cache.shape[3])
    return kv_cache


def check_draft_tree(
    draft_ancestors: object, draft_counts: object, num_tokens: int, num_reqs: int, causal: bool
) -> tuple[Tensor, Tensor] | None:
    """A draft tree's masks: ``draft_ancestors`` int64 ``[T']`` (a row per query token
    at least; the caller's contract, not read back) and ``draft_counts`` int32 ``[B]``,
    both or neither, with ``causal=True``; ``None`` without a tree."""
    if draft_ancestors is None and draft_counts is None:
        return None
    if draft_ancestors is None or draft_counts is None:
        missing = "draft_ancestors" if draft_ancestors is None else "draft_counts"
        raise ValueError(f"{missing}: expected a tensor with the other draft-tree argument, got None")
    if not causal:
        raise ValueError("draft_ancestors: expected None with causal=False (drafts are causal)")
    anc = require_tensor("draft_ancestors", draft_ancestors, "an int64 torch.Tensor [T]")
    # A capture buffer may be longer than the step; its rows past the queries are unread.
    if anc.dtype != torch.int64 or anc.dim() != 1 or anc.shape[0] < min(num_tokens, 1):
        raise ValueError(
            f"draft_ancestors: expected int64 of shape [T'] (a row per query token, "
            f"T={num_tokens}), got {describe(anc)}"
        )
    counts = check_index_layout("draft_counts", draft_counts, (num_reqs,))
    return anc, counts


def check_index_layout(name: str, t: object, shape: tuple[int, ...]) -> Tensor:
    """An int32 tensor of ``shape`` (``-1``: any size)."""
    pretty = ", ".join("*" if s < 0 else str(s) for s in shape)
    t = require_tensor(name, t, f"an int32 torch.Tensor [{pretty}]")
    if t.dtype != torch.int32:
        raise ValueError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if t.dim() != len(shape) or any(
        want >= 0 and got != want for want, got in zip(shape, t.shape, strict=True)
    ):
        raise ValueError(f"{name}: expected shape [{pretty}], got {tuple(t.shape)}")
    return t


def check_batch_layout(query_start_loc: object, seq_lens: object, block_table: object) -> int:
    """The batch metadata: ``seq_lens`` int32 ``[B]``, ``query_start_loc`` int32
    ``[B + 1]``, ``block_table`` int32 ``[B, MB]``; returns ``B``. (Their values, which
    neither side's launch reads back, are the caller's contract: offsets from 0 and
    non-decreasing, ``0 <= q_len <= seq_len`` when causal, enough table columns.)"""
    seq_lens = require_tensor("seq_lens", seq_lens, "an int32 torch.Tensor [B]")
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens: expected shape [B], got {tuple(seq_lens.shape)}")
    num_reqs: int = seq_lens.shape[0]
    check_index_layout("seq_lens", seq_lens, (num_reqs,))
    check_index_layout("query_start_loc", query_start_loc, (num_reqs + 1,))
    check_index_layout("block_table", block_table, (num_reqs, -1))
    return num_reqs


# --------------------------------------------------------------------------- launchers
# What the Triton launchers add on top (they read no metadata value back): devices,
# unit last strides, one-element scale tensors, enough block-table columns.


def check_index_tensor(
    name: str, t: object, shape: tuple[int, ...], device: torch.device, of: str = "query"
) -> Tensor:
    """An int32 tensor of ``shape`` (``-1``: any size) on ``device``, unit last stride."""
    t = check_index_layout(name, t, shape)
    check_device(name, t, device, of)
    # The kernels index the last dim with unit stride; checked here rather than copied
    # so a caller's per-step metadata never silently allocates.
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected unit stride in the last dim, got strides {tuple(t.stride())}"
        )
    return t


def check_scale_tensor(name: str, t: object, device: torch.device | None, of: str) -> Tensor:
    """A one-element float32 tensor (shape ``[]`` or ``[1]``) on ``device``."""
    if not isinstance(t, Tensor):
        raise KernelTypeError(
            f"{name}: expected a one-element torch.float32 tensor or None, got {describe(t)}"
        )
    if t.dtype != torch.float32 or t.numel() != 1 or t.dim() > 1:
        raise ValueError(
            f"{name}: expected a one-element torch.float32 tensor of shape [] or [1], "
            f"got {t.dtype} {list(t.shape)}"
        )
    check_device(name, t, device, of)
    return t


def check_batch_metadata(
    seq_lens: object,
    query_start_loc: object,
    block_table: object,
    device: torch.device,
    of: str = "query",
) -> int:
    """The op's metadata layout (:func:`check_batch_layout`) plus what the kernels need:
    every tensor on ``device`` (called "the ``of`` device") with unit last stride;
    returns ``B``."""
    num_requests = check_batch_layout(query_start_loc, seq_lens, block_table)
    for name, t in (
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
        ("block_table", block_table),
    ):
        assert isinstance(t, Tensor)  # checked by check_batch_layout
        check_index_tensor(name, t, tuple(t.shape), device, of)
    return num_requests


def check_block_table_width(block_table: Tensor, block_size: int, max_seq_len: int) -> None:
    """``block_table`` has the columns ``max_seq_len`` keys need at ``block_size``."""
    if block_table.shape[1] * block_size < max_seq_len:
        raise ValueError(
            f"block_table: expected at least {-(-max_seq_len // block_size)} columns "
            f"for max_seq_len={max_seq_len} at block size {block_size}, "
            f"got {block_table.shape[1]}"
        )
