"""Pure-torch reference attention over a paged KV cache: the oracle for every backend.

Everything here is written for clarity and correctness first. Scores, softmax and the
weighted sum of values are computed in float32 whatever the input dtype; the output is
cast back to the query dtype at the end. Work is vectorised per request (one matrix of
scores per request), never per token. Nothing here knows attnkit's own types: the
functions take tensors and plain Python numbers.

Shapes, batch metadata, positions, masks, scores, sinks, lse and scales follow the
op's contract (:mod:`attnkit.kernels.attention.contract`, its module docstring).
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch
from torch import Tensor

from attnkit.kernels._checks import KernelTypeError, check_bool, check_finite_float, describe
from attnkit.kernels.attention.contract import (
    DYNAMIC_QMAX,
    check_batch_layout,
    check_cache_layout,
    check_draft_tree,
    check_head_vector,
    check_kv_scale,
    check_kv_scales_cache,
    check_logits_soft_cap,
    check_mask_options,
    check_query_layout,
    check_shard_lens,
)

__all__ = [
    "dense_attention",
    "gather_kv",
    "gather_kv_scales",
    "paged_attention",
    "quantise_per_token_head",
    "quantise_static",
    "write_kv_cache",
]


# --------------------------------------------------------------------------- helpers


def _describe(t: Tensor) -> str:
    """``"torch.int64 [5]"``: dtype and shape, for error messages."""
    return f"{t.dtype} {list(t.shape)}"


def _tensor(name: str, value: object, expected: str) -> Tensor:
    """``value`` when it is a tensor, else a ``TypeError`` naming ``name``."""
    if not isinstance(value, Tensor):
        raise KernelTypeError(f"{name} must be {expected}, got {describe(value)}")
    return value


def _check_float(name: str, value: object, *, positive: bool = False) -> float:
    """A finite Python number (``> 0`` with ``positive``), returned as a float."""
    allowed = "a finite float > 0" if positive else "a finite float"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KernelTypeError(f"{name} must be {allowed}, got {describe(value)}")
    if not math.isfinite(value) or (positive and not value > 0):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def _check_options(
    *,
    num_q_heads: int,
    scale: object,
    causal: object,
    sliding_window: object,
    chunk_size: object,
    logits_soft_cap: object,
    alibi_slopes: object,
    sinks: object,
) -> None:
    """Validate the mask and score options shared by both attention entry points: the
    op's contract (:mod:`attnkit.kernels.attention.contract`), which the Triton
    launcher enforces too."""
    check_finite_float("scale", scale)
    check_mask_options(causal, sliding_window, chunk_size)
    check_logits_soft_cap(logits_soft_cap)
    # Any device: the oracle moves the vectors to the query's device itself.
    check_head_vector("alibi_slopes", alibi_slopes, num_q_heads, None)
    check_head_vector("sinks", sinks, num_q_heads, None)


def _visible_keys(
    q_positions: Tensor,
    k_positions: Tensor,
    *,
    causal: bool,
    sliding_window: int | None,
    chunk_size: int | None,
    mm_prefix_ranges: Tensor | None = None,
) -> Tensor:
    """Boolean ``[Tq, Tk]`` mask: ``True`` where query ``t`` may attend to key ``j``."""
    i = q_positions.to(torch.int64)[:, None]  # [Tq, 1] query positions
    j = k_positions.to(torch.int64)[None, :]  # [1, Tk] key positions
    num_keys = j.shape[1]
    visible = torch.ones(i.shape[0], num_keys, dtype=torch.bool, device=q_positions.device)
    if causal:
        seen = j <= i
        if mm_prefix_ranges is not None:
            seen |= _same_range(i, j, mm_prefix_ranges)
        visible &= seen
        if sliding_window is not None:
            visible &= (i - j) < sliding_window
        if chunk_size is not None:
            visible &= torch.div(j, chunk_size, rounding_mode="floor") == torch.div(
                i, chunk_size, rounding_mode="floor"
            )
    return visible


def _check_ranges(ranges: object, *, causal: bool, chunk_size: int | None) -> Tensor | None:
    if ranges is None:
        return None
    if not isinstance(ranges, Tensor) or ranges.is_floating_point() or ranges.dim() != 2 or (
        ranges.shape[1] != 2
    ):
        raise ValueError(
            f"mm_prefix_ranges must be an integer tensor [R, 2] or None, got {describe(ranges)}"
        )
    if not causal or chunk_size is not None:
        raise ValueError(
            "mm_prefix_ranges needs causal attention without chunk_size (got "
            f"causal={causal}, chunk_size={chunk_size})"
        )
    return ranges


def _same_range(i: Tensor, j: Tensor, ranges: Tensor) -> Tensor:
    """``[Tq, Tk]``: query and key in one range ``[start, end)`` of ``ranges`` ``[R, 2]``
    (an empty pair such as ``(0, 0)`` holds nothing)."""
    start = ranges[:, 0].to(device=i.device, dtype=torch.int64)[None, None, :]
    end = ranges[:, 1].to(device=i.device, dtype=torch.int64)[None, None, :]
    qi, kj = i[:, :, None], j[:, :, None]  # [Tq, 1, 1], [1, Tk, 1]
    return ((start <= qi) & (qi < end) & (start <= kj) & (kj < end)).any(dim=-1)


# --------------------------------------------------------------------------- cache I/O


_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _scale_arg(name: str, value: object, num_kv_heads: int) -> float | Tensor:
    """A float > 0, or a float32 per-head ``[Hkv]`` (or one-element) tensor, any device;
    a tensor's values are read back and must be finite and > 0."""
    checked = check_kv_scale(name, value, None, num_kv_heads=num_kv_heads)
    if checked is None:
        return 1.0
    if isinstance(checked, Tensor):
        bad = ~(torch.isfinite(checked) & (checked > 0))
        if bool(bad.any()):
            i = int(torch.nonzero(bad.reshape(-1))[0, 0])
            raise ValueError(
                f"{name}: expected finite scales > 0, got {float(checked.reshape(-1)[i])!r} "
                f"at index {i}"
            )
        return checked if checked.numel() > 1 else float(checked.reshape(-1)[0])
    return float(checked)


def _per_head(scale: float | Tensor, device: torch.device) -> float | Tensor:
    """A scale broadcast over ``[T, Hkv, D]``: a float, or ``[1, Hkv, 1]``."""
    if isinstance(scale, Tensor):
        return scale.to(device=device, dtype=torch.float32).reshape(1, -1, 1)
    return scale


def quantise_per_token_head(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(stored, scales)`` of ``x`` ``[T, Hkv, D]`` in ``dtype`` (a key of
    :data:`~attnkit.kernels.attention.contract.DYNAMIC_QMAX`) with one float32 scale per
    (token, head): ``s = amax(|x|) / QMAX`` (1.0 for an all-zero vector), stored
    ``x / s`` (int8: rounded half to even, clamped to +-127)."""
    qmax = DYNAMIC_QMAX[dtype]
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    scaled = (xf / scales[..., None]).clamp(-qmax, qmax)
    if dtype == torch.int8:
        scaled = torch.round(scaled)
    return scaled.to(dtype), scales


def quantise_static(x: Tensor, scale: float | Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` ``[T, Hkv, D]`` as a cache of ``dtype`` stores it with a static scale:
    ``x / scale`` in float32 (a float32 ``[Hkv]`` tensor divides head ``n`` by
    ``scale[n]``; 1.0 divides nothing), saturated to the largest finite value of an fp8
    ``dtype`` (a cast past it would give NaN: e4m3fn has no infinity), then cast."""
    new = x if isinstance(scale, float) and scale == 1.0 else x.float() / _per_head(scale, x.device)
    if dtype in _FP8_MAX:
        limit = _FP8_MAX[dtype]
        new = new.float().clamp(-limit, limit)
    return new.to(dtype)


def write_kv_cache(
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    *,
    k_scale: float | Tensor = 1.0,
    v_scale: float | Tensor = 1.0,
    kv_scales: Tensor | None = None,
) -> None:
    """Write new tokens' keys and values into the paged cache, in place.

    Args:
        key: ``[T, Hkv, D]`` keys of the new tokens.
        value: ``[T, Hkv, D]`` values of the new tokens.
        kv_cache: ``[NB, 2, BS, Hkv, D]`` paged cache, modified in place.
        slot_mapping: int64 ``[T]``; token ``t`` goes to block ``slot // BS``, offset
            ``slot % BS``. Slots equal to ``-1`` (padding tokens) are skipped.
        k_scale: stored key is ``key / k_scale`` cast to the cache dtype; a float32
            ``[Hkv]`` tensor divides head ``n`` by ``k_scale[n]``.
        v_scale: stored value is ``value / v_scale`` cast to the cache dtype (likewise).
        kv_scales: float32 ``[NB, 2, BS, Hkv]`` per-token-head scales of an fp8 e4m3 or
            int8 cache, written here (the contract's "Per-token-head scales"); the
            static scales must then be 1.0.
    """
    key = _tensor("key", key, "a tensor of shape [T, Hkv, D]")
    value = _tensor("value", value, "a tensor of shape [T, Hkv, D]")
    kv_cache = _tensor("kv_cache", kv_cache, "a tensor of shape [NB, 2, BS, Hkv, D]")
    slot_mapping = _tensor("slot_mapping", slot_mapping, "an int64 tensor of shape [T]")
    # Divided by: 0 would store inf, NaN would store NaN.
    if not isinstance(k_scale, Tensor):
        k_scale = _check_float("k_scale", k_scale, positive=True)
    if not isinstance(v_scale, Tensor):
        v_scale = _check_float("v_scale", v_scale, positive=True)
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must have shape [NB, 2, BS, Hkv, D], got {_describe(kv_cache)}")
    num_blocks, _, block_size, num_kv_heads, head_size = kv_cache.shape
    k_scale = _scale_arg("k_scale", k_scale, num_kv_heads)
    v_scale = _scale_arg("v_scale", v_scale, num_kv_heads)
    kv_scales = check_kv_scales_cache(kv_scales, kv_cache)
    if kv_scales is not None and not (
        isinstance(k_scale, float) and k_scale == 1.0 and isinstance(v_scale, float) and v_scale == 1.0
    ):
        raise ValueError(
            "k_scale, v_scale: expected 1.0 with kv_scales (the write computes a scale per "
            f"token and head), got k_scale={k_scale!r} and v_scale={v_scale!r}"
        )
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_size):
        raise ValueError(
            f"key must have shape [T, Hkv, D]=[T, {num_kv_heads}, {head_size}] "
            f"to match kv_cache, got {_describe(key)}"
        )
    if value.shape != key.shape:
        raise ValueError(
            f"value must have the shape of key {list(key.shape)}, got {_describe(value)}"
        )
    num_tokens = key.shape[0]
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"slot_mapping must be int64 of shape [T]=[{num_tokens}], got {_describe(slot_mapping)}"
        )
    valid = slot_mapping != -1
    slots = slot_mapping[valid]
    if slots.numel() > 0:
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= num_blocks * block_size:
            raise ValueError(
                f"slot_mapping entries must be -1 or in [0, NB*BS)=[0, {num_blocks * block_size}), "
                f"got values in [{lo}, {hi}]"
            )
    slots = slots.to(kv_cache.device)
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    valid = valid.to(key.device)
    if kv_scales is not None:
        stored_k, scales_k = quantise_per_token_head(key[valid], kv_cache.dtype)
        stored_v, scales_v = quantise_per_token_head(value[valid], kv_cache.dtype)
        kv_cache[blocks, 0, offsets] = stored_k.to(kv_cache.device)
        kv_cache[blocks, 1, offsets] = stored_v.to(kv_cache.device)
        kv_scales[blocks, 0, offsets] = scales_k.to(kv_scales.device)
        kv_scales[blocks, 1, offsets] = scales_v.to(kv_scales.device)
        return
    new_k = quantise_static(key[valid], k_scale, kv_cache.dtype)
    new_v = quantise_static(value[valid], v_scale, kv_cache.dtype)
    kv_cache[blocks, 0, offsets] = new_k.to(kv_cache.device)
    kv_cache[blocks, 1, offsets] = new_v.to(kv_cache.device)


def gather_kv_scales(kv_scales: Tensor, block_table_row: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """One request's first ``seq_len`` per-token-head K and V scales, each
    ``[seq_len, Hkv]``, out of ``kv_scales`` ``[NB, 2, BS, Hkv]`` (unchecked: the
    caller has checked the table as for :func:`gather_kv`)."""
    _, _, block_size, num_kv_heads = kv_scales.shape
    num_needed = -(-seq_len // block_size)
    blocks = block_table_row[:num_needed].to(device=kv_scales.device, dtype=torch.int64)
    rows = kv_scales[blocks]  # [n, 2, BS, Hkv]
    k = rows[:, 0].reshape(num_needed * block_size, num_kv_heads)[:seq_len]
    v = rows[:, 1].reshape(num_needed * block_size, num_kv_heads)[:seq_len]
    return k, v


def gather_kv(kv_cache: Tensor, block_table_row: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """Read one request's first ``seq_len`` keys and values out of the paged cache.

    Args:
        kv_cache: ``[NB, 2, BS, Hkv, D]`` paged cache.
        block_table_row: integer ``[max_blocks]``; only the first
            ``ceil(seq_len / BS)`` entries are read.
        seq_len: number of context tokens to read.

    Returns:
        ``(key, value)``, each ``[seq_len, Hkv, D]`` in the cache dtype (fresh tensors).

    Raises:
        TypeError / ValueError: an argument of the wrong type or shape, a ``seq_len``
            the row cannot hold, or a needed entry that is not a block of the cache
            (the entries are read back to the host to check them).
    """
    kv_cache = _tensor("kv_cache", kv_cache, "a tensor of shape [NB, 2, BS, Hkv, D]")
    row = _tensor("block_table_row", block_table_row, "an integer tensor of shape [max_blocks]")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[2] == 0:
        raise ValueError(
            f"kv_cache must have shape [NB, 2, BS, Hkv, D] with BS >= 1, got {_describe(kv_cache)}"
        )
    if row.dim() != 1 or row.is_floating_point() or row.is_complex() or row.dtype == torch.bool:
        raise ValueError(
            f"block_table_row must be an integer tensor of shape [max_blocks], got {_describe(row)}"
        )
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise KernelTypeError(f"seq_len must be an int >= 0, got {describe(seq_len)}")
    num_blocks, _, block_size, _, _ = kv_cache.shape
    if not 0 <= seq_len <= row.shape[0] * block_size:
        raise ValueError(
            f"seq_len must be an int in [0, {row.shape[0] * block_size}] (max_blocks * BS), "
            f"got {seq_len}"
        )
    needed = row[: -(-seq_len // block_size)]
    if needed.numel() > 0:
        lo, hi = int(needed.min()), int(needed.max())
        if lo < 0 or hi >= num_blocks:
            raise ValueError(
                f"block_table_row entries must be physical block indices in [0, NB)=[0, "
                f"{num_blocks}), got values in [{lo}, {hi}]"
            )
    return _gather_kv(kv_cache, row, seq_len)


def _gather_kv(kv_cache: Tensor, block_table_row: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """:func:`gather_kv` without the checks (``paged_attention`` has made them)."""
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    num_needed = -(-seq_len // block_size)  # ceil division
    blocks = block_table_row[:num_needed].to(device=kv_cache.device, dtype=torch.int64)
    kv = kv_cache[blocks]  # [n, 2, BS, Hkv, D]: advanced indexing copies
    key = kv[:, 0].reshape(num_needed * block_size, num_kv_heads, head_size)[:seq_len]
    value = kv[:, 1].reshape(num_needed * block_size, num_kv_heads, head_size)[:seq_len]
    return key, value


# --------------------------------------------------------------------------- dense


@overload
def dense_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scale: float,
    causal: bool = ...,
    q_positions: Tensor | None = ...,
    k_positions: Tensor | None = ...,
    sliding_window: int | None = ...,
    chunk_size: int | None = ...,
    logits_soft_cap: float | None = ...,
    alibi_slopes: Tensor | None = ...,
    sinks: Tensor | None = ...,
    draft_visible: Tensor | None = ...,
    mm_prefix_ranges: Tensor | None = ...,
    return_lse: Literal[False] = ...,
) -> Tensor: ...


@overload
def dense_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scale: float,
    causal: bool = ...,
    q_positions: Tensor | None = ...,
    k_positions: Tensor | None = ...,
    sliding_window: int | None = ...,
    chunk_size: int | None = ...,
    logits_soft_cap: float | None = ...,
    alibi_slopes: Tensor | None = ...,
    sinks: Tensor | None = ...,
    draft_visible: Tensor | None = ...,
    mm_prefix_ranges: Tensor | None = ...,
    return_lse: Literal[True],
) -> tuple[Tensor, Tensor]: ...


@overload
def dense_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scale: float,
    causal: bool = ...,
    q_positions: Tensor | None = ...,
    k_positions: Tensor | None = ...,
    sliding_window: int | None = ...,
    chunk_size: int | None = ...,
    logits_soft_cap: float | None = ...,
    alibi_slopes: Tensor | None = ...,
    sinks: Tensor | None = ...,
    draft_visible: Tensor | None = ...,
    mm_prefix_ranges: Tensor | None = ...,
    return_lse: bool,
) -> Tensor | tuple[Tensor, Tensor]: ...


def dense_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scale: float,
    causal: bool = True,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    draft_visible: Tensor | None = None,
    mm_prefix_ranges: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of one sequence's queries over its keys and values (no cache).

    Args:
        query: ``[Tq, Hq, D]``.
        key: ``[Tk, Hkv, D]``; key ``j`` sits at position ``j``.
        value: ``[Tk, Hkv, D]``.
        scale: multiplies ``q . k``.
        causal: see the module docstring for every mask and score option.
        q_positions: integer ``[Tq]`` absolute query positions; by default the last
            ``Tq`` positions of the keys, ``Tk - Tq + t``.
        k_positions: integer ``[Tk]`` absolute key positions; by default ``0 .. Tk - 1``.
            A context-parallel shard holds every ``N``-th position; a draft tree's
            drafts sit at their depths, siblings at one position.
        sliding_window: window length ``W >= 1`` (needs ``causal``), or None.
        chunk_size: local-attention chunk length ``C >= 1`` (needs ``causal``), or None.
        logits_soft_cap: ``cap > 0`` for ``cap * tanh(s / cap)``, or None.
        alibi_slopes: float ``[Hq]`` slopes, or None.
        sinks: float ``[Hq]`` sink logits, or None.
        draft_visible: bool ``[Tq, Tk]``, a draft tree's mask (``_draft_tree_visible``)
            ANDed into the others, or None.
        mm_prefix_ranges: integer ``[R, 2]`` bidirectional ranges ``[start, end)`` of
            positions (needs ``causal``; no ``chunk_size``): a query inside one also
            sees the later keys of it (``j <= i`` or both in one range), a window
            still bounding the look-back ``i - j < sliding_window``. Empty pairs
            (``(0, 0)``) pad. None: none.
        return_lse: also return the float32 ``[Tq, Hq]`` log-sum-exp.

    Returns:
        ``out`` ``[Tq, Hq, D]`` in the query dtype, or ``(out, lse)`` if ``return_lse``.
    """
    query = _tensor("query", query, "a tensor of shape [Tq, Hq, D]")
    key = _tensor("key", key, "a tensor of shape [Tk, Hkv, D]")
    value = _tensor("value", value, "a tensor of shape [Tk, Hkv, D]")
    return_lse = check_bool("return_lse", return_lse)
    if query.dim() != 3:
        raise ValueError(f"query must have shape [Tq, Hq, D], got {_describe(query)}")
    if key.dim() != 3:
        raise ValueError(f"key must have shape [Tk, Hkv, D], got {_describe(key)}")
    if value.shape != key.shape:
        raise ValueError(
            f"value must have the shape of key {list(key.shape)}, got {_describe(value)}"
        )
    num_queries, num_q_heads, head_size = query.shape
    num_keys, num_kv_heads, _ = key.shape
    if key.shape[2] != head_size:
        raise ValueError(f"head sizes differ: query has D={head_size} but key has D={key.shape[2]}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"query heads Hq={num_q_heads} must be a multiple of kv heads Hkv={num_kv_heads}"
        )
    _check_options(
        num_q_heads=num_q_heads,
        scale=scale,
        causal=causal,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        logits_soft_cap=logits_soft_cap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
    )
    device = query.device
    if q_positions is None:
        q_positions = torch.arange(num_keys - num_queries, num_keys, device=device)
    elif not isinstance(q_positions, Tensor):
        raise KernelTypeError(
            f"q_positions must be an integer tensor of shape [Tq]=[{num_queries}] or None, "
            f"got {describe(q_positions)}"
        )
    elif q_positions.shape != (num_queries,) or q_positions.is_floating_point():
        raise ValueError(
            f"q_positions must be an integer tensor of shape [Tq]=[{num_queries}], "
            f"got {_describe(q_positions)}"
        )
    positions = q_positions.to(device=device, dtype=torch.int64)
    if k_positions is None:
        key_positions = torch.arange(num_keys, device=device, dtype=torch.int64)
    elif not isinstance(k_positions, Tensor):
        raise KernelTypeError(
            f"k_positions must be an integer tensor of shape [Tk]=[{num_keys}] or None, "
            f"got {describe(k_positions)}"
        )
    elif k_positions.shape != (num_keys,) or k_positions.is_floating_point():
        raise ValueError(
            f"k_positions must be an integer tensor of shape [Tk]=[{num_keys}], "
            f"got {_describe(k_positions)}"
        )
    else:
        key_positions = k_positions.to(device=device, dtype=torch.int64)
    group = num_q_heads // num_kv_heads

    # Scores [Hkv, G, Tq, Tk] in float32, without materialising repeated kv heads:
    # query head h = n * G + g reads kv head n.
    ranges = _check_ranges(mm_prefix_ranges, causal=causal, chunk_size=chunk_size)
    visible = _visible_keys(
        positions,
        key_positions,
        causal=causal,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        mm_prefix_ranges=ranges,
    )
    if draft_visible is not None:
        if draft_visible.shape != visible.shape or draft_visible.dtype != torch.bool:
            raise ValueError(
                f"draft_visible must be bool of shape [Tq, Tk]={list(visible.shape)}, got "
                f"{_describe(draft_visible)}"
            )
        visible &= draft_visible.to(visible.device)
    # Keys no query may see are zeroed, not just given weight 0: their slots may hold
    # anything (a released block reads as the null block, a block's tail was never
    # written), and 0 * NaN would still be NaN. A NaN in a *visible* slot stays and
    # reaches the output, so a kernel bug that reads unwritten memory shows.
    unseen = ~visible.any(dim=0)[:, None, None]  # [Tk, 1, 1]
    q = query.float().reshape(num_queries, num_kv_heads, group, head_size)
    k = key.to(device=device, dtype=torch.float32).masked_fill(unseen, 0.0)
    v = value.to(device=device, dtype=torch.float32).masked_fill(unseen, 0.0)
    scores = torch.einsum("qngd,knd->ngqk", q, k) * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    if alibi_slopes is not None:
        distance = (key_positions[None, :] - positions[:, None]).float()  # [Tq, Tk]: j - i
        slopes = alibi_slopes.to(device=device, dtype=torch.float32)
        scores = scores + slopes.reshape(num_kv_heads, group, 1, 1) * distance
    scores = scores.masked_fill(~visible, float("-inf"))

    # One extra column per row: the sink logit, or -inf (weight 0) without sinks. It
    # also keeps the row maximum well defined when Tk == 0.
    if sinks is not None:
        extra = sinks.to(device=device, dtype=torch.float32).reshape(num_kv_heads, group, 1, 1)
    else:
        extra = torch.full((num_kv_heads, group, 1, 1), float("-inf"), device=device)
    logits = torch.cat([scores, extra.expand(-1, -1, num_queries, 1)], dim=-1)

    row_max = logits.amax(dim=-1, keepdim=True)
    # A row with no visible key and no sink has max -inf; shift by 0 to avoid NaN.
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(logits - row_max)  # masked keys -> exactly 0
    denom = weights.sum(dim=-1, keepdim=True)  # [Hkv, G, Tq, 1]
    weighted = torch.einsum("ngqk,knd->ngqd", weights[..., :num_keys], v)
    # Only a row that sees nothing (denominator exactly 0) is defined as 0; NaN stays NaN.
    out = torch.where(denom == 0, torch.zeros_like(weighted), weighted / denom)
    out = out.permute(2, 0, 1, 3).reshape(num_queries, num_q_heads, head_size)
    out = out.to(query.dtype)
    if not return_lse:
        return out
    lse = (row_max + torch.log(denom)).squeeze(-1)  # log(0) = -inf for empty rows
    lse = lse.permute(2, 0, 1).reshape(num_queries, num_q_heads)
    return out, lse


# --------------------------------------------------------------------------- paged


def _draft_tree_positions(ancestors: Tensor, num_drafts: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """One request's query and key positions under its draft tree: a draft sits at the
    root's position plus its depth (the ancestor bits of its own row, itself included),
    not at its slot; every other token at its slot. Windows, chunks and ALiBi then
    measure a draft's distances along its own path."""
    q_len = ancestors.shape[0]
    first = seq_len - num_drafts
    bits = torch.arange(63, device=ancestors.device)
    rows = ancestors.to(torch.int64)[q_len - num_drafts :]
    depth = ((rows[:, None] >> bits[None, :]) & 1).sum(dim=1)
    keys = torch.arange(seq_len, device=ancestors.device, dtype=torch.int64)
    keys[first:] = first - 1 + depth.to(keys.device)
    return keys[seq_len - q_len :].clone(), keys


def _draft_tree_visible(ancestors: Tensor, num_drafts: int, seq_len: int) -> Tensor:
    """Bool ``[q_len, seq_len]``: where one request's query rows may look under its draft
    tree (its last ``num_drafts`` keys only where the row's ancestor bit is set)."""
    first = seq_len - num_drafts
    j = torch.arange(seq_len, device=ancestors.device)
    bit = (j - first).clamp(min=0)
    seen = (ancestors.to(torch.int64)[:, None] >> bit[None, :]) & 1
    return (j[None, :] < first) | (seen == 1)


def _check_shard(
    context_shard: object, global_seq_lens: object, seq_lens: Tensor
) -> tuple[int, int, list[int]] | None:
    """``(rank, world_size, global lengths)`` of a context-parallel shard, checked
    against the local ``seq_lens`` (``ceil((L - rank) / world_size)`` each); None
    without a shard."""
    shard = check_shard_lens(context_shard, global_seq_lens)
    if shard is None:
        return None
    rank, world = shard
    totals_t = _tensor("global_seq_lens", global_seq_lens, "an integer tensor [B]")
    if totals_t.shape != seq_lens.shape or totals_t.is_floating_point():
        raise ValueError(
            f"global_seq_lens must be an integer tensor of seq_lens' shape "
            f"{list(seq_lens.shape)}, got {_describe(totals_t)}"
        )
    totals: list[int] = totals_t.tolist()  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]  # torch types tolist() as a bare List
    local: list[int] = seq_lens.tolist()  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]  # torch types tolist() as a bare List
    for b, (total, held) in enumerate(zip(totals, local, strict=True)):
        want = max(0, -(-(total - rank) // world))
        if held != want:
            raise ValueError(
                f"seq_lens[{b}]={held} must be the shard's share of global_seq_lens[{b}]="
                f"{total} on rank {rank} of {world}: ceil((L - rank) / world_size) = {want}"
            )
    return rank, world, totals


def _check_paged_inputs(
    query: Tensor,
    kv_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    output: Tensor | None,
    *,
    causal: bool = True,
) -> None:
    """Validate shapes, dtypes and per-request consistency of a paged batch.

    Non-causal batches (cross attention) may have more queries than keys. The oracle
    reads the metadata's values back to the host to check them (unlike the kernels).
    """
    # The op's layout rules (shared with the Triton launcher).
    query = check_query_layout(query)
    kv_cache = check_cache_layout(kv_cache, query)
    num_reqs = check_batch_layout(query_start_loc, seq_lens, block_table)
    if output is not None:
        output = _tensor("output", output, "a tensor of shape [T, Hq, D] or None")
    num_tokens = query.shape[0]
    num_blocks, _, block_size, _, _ = kv_cache.shape
    if output is not None and (
        output.shape != query.shape or output.dtype != query.dtype or output.device != query.device
    ):
        raise ValueError(
            f"output must match query ({_describe(query)} on {query.device}), "
            f"got {_describe(output)} on {output.device}"
        )

    qsl = query_start_loc.to(torch.int64).cpu()
    lens = seq_lens.to(torch.int64).cpu()
    if int(qsl[0]) != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
    q_lens = qsl[1:] - qsl[:-1]
    if bool((q_lens < 0).any()):
        b = int(torch.nonzero(q_lens < 0)[0, 0])
        raise ValueError(
            f"query_start_loc must be non-decreasing, got query_start_loc[{b}]={int(qsl[b])} "
            f"> query_start_loc[{b + 1}]={int(qsl[b + 1])}"
        )
    if int(qsl[-1]) > num_tokens:
        raise ValueError(
            f"query_start_loc[{num_reqs}]={int(qsl[-1])} exceeds the number of query tokens "
            f"T={num_tokens}"
        )
    if bool((lens < 0).any()):
        b = int(torch.nonzero(lens < 0)[0, 0])
        raise ValueError(f"seq_lens[{b}] must be >= 0, got {int(lens[b])}")
    if causal and bool((q_lens > lens).any()):
        b = int(torch.nonzero(q_lens > lens)[0, 0])
        raise ValueError(
            f"request {b} has q_len={int(q_lens[b])} query tokens but seq_lens[{b}]="
            f"{int(lens[b])}; seq_lens must include the query tokens"
        )
    max_blocks = block_table.shape[1]
    needed = torch.div(lens + block_size - 1, block_size, rounding_mode="floor")
    if bool((needed > max_blocks).any()):
        b = int(torch.nonzero(needed > max_blocks)[0, 0])
        raise ValueError(
            f"block_table[{b}] has {max_blocks} blocks but seq_lens[{b}]={int(lens[b])} "
            f"needs {int(needed[b])} with block_size={block_size}"
        )
    table = block_table.to(torch.int64).cpu()
    used = torch.arange(max_blocks)[None, :] < needed[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        b, i = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(
            f"block_table[{b}, {i}]={int(table[b, i])} is not a physical block index "
            f"in [0, NB)=[0, {num_blocks})"
        )


@overload
def paged_attention(
    query: Tensor,
    kv_cache: Tensor,
    *,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    scale: float,
    causal: bool = ...,
    sliding_window: int | None = ...,
    chunk_size: int | None = ...,
    logits_soft_cap: float | None = ...,
    alibi_slopes: Tensor | None = ...,
    sinks: Tensor | None = ...,
    mm_prefix_ranges: Tensor | None = ...,
    k_scale: float | Tensor = ...,
    v_scale: float | Tensor = ...,
    kv_scales: Tensor | None = ...,
    context_shard: tuple[int, int] | None = ...,
    global_seq_lens: Tensor | None = ...,
    draft_ancestors: Tensor | None = ...,
    draft_counts: Tensor | None = ...,
    output: Tensor | None = ...,
    return_lse: Literal[False] = ...,
) -> Tensor: ...


@overload
def paged_attention(
    query: Tensor,
    kv_cache: Tensor,
    *,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    scale: float,
    causal: bool = ...,
    sliding_window: int | None = ...,
    chunk_size: int | None = ...,
    logits_soft_cap: float | None = ...,
    alibi_slopes: Tensor | None = ...,
    sinks: Tensor | None = ...,
    mm_prefix_ranges: Tensor | None = ...,
    k_scale: float | Tensor = ...,
    v_scale: float | Tensor = ...,
    kv_scales: Tensor | None = ...,
    context_shard: tuple[int, int] | None = ...,
    global_seq_lens: Tensor | None = ...,
    draft_ancestors: Tensor | None = ...,
    draft_counts: Tensor | None = ...,
    output: Tensor | None = ...,
    return_lse: Literal[True],
) -> tuple[Tensor, Tensor]: ...


@overload
def paged_attention(
    query: Tensor,
    kv_cache: Tensor,
    *,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    scale: float,
    causal: bool = ...,
    sliding_window: int | None = ...,
    chunk_size: int | None = ...,
    logits_soft_cap: float | None = ...,
    alibi_slopes: Tensor | None = ...,
    sinks: Tensor | None = ...,
    mm_prefix_ranges: Tensor | None = ...,
    k_scale: float | Tensor = ...,
    v_scale: float | Tensor = ...,
    kv_scales: Tensor | None = ...,
    context_shard: tuple[int, int] | None = ...,
    global_seq_lens: Tensor | None = ...,
    draft_ancestors: Tensor | None = ...,
    draft_counts: Tensor | None = ...,
    output: Tensor | None = ...,
    return_lse: bool,
) -> Tensor | tuple[Tensor, Tensor]: ...


def paged_attention(
    query: Tensor,
    kv_cache: Tensor,
    *,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    mm_prefix_ranges: Tensor | None = None,
    k_scale: float | Tensor = 1.0,
    v_scale: float | Tensor = 1.0,
    kv_scales: Tensor | None = None,
    context_shard: tuple[int, int] | None = None,
    global_seq_lens: Tensor | None = None,
    draft_ancestors: Tensor | None = None,
    draft_counts: Tensor | None = None,
    output: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of a ragged batch of requests over the paged KV cache.

    Each request's context is gathered through its block table and handed to
    :func:`dense_attention` with its queries at the last ``q_len`` positions.

    Args:
        query: ``[T, Hq, D]``; rows ``qsl[B]:T`` are padding.
        kv_cache: ``[NB, 2, BS, Hkv, D]``; this step's K/V must already be written.
        query_start_loc: int32 ``[B+1]``.
        seq_lens: int32 ``[B]``, context lengths including this step's queries.
        block_table: int32 ``[B, max_blocks]``.
        scale, causal, sliding_window, chunk_size, logits_soft_cap, alibi_slopes, sinks:
            as for :func:`dense_attention`.
        k_scale: multiplies the float32-cast cached keys; a float32 ``[Hkv]`` tensor
            multiplies head ``n``'s by ``k_scale[n]``.
        v_scale: multiplies the float32-cast cached values (likewise).
        kv_scales: float32 ``[NB, 2, BS, Hkv]`` per-token-head scales of an fp8 e4m3 or
            int8 cache: each cached vector is multiplied by its own scale.
        context_shard: ``(rank, world_size)`` when the cache holds one context-parallel
            shard: request position ``p`` lives on rank ``p % world_size`` at local
            index ``p // world_size``, so ``seq_lens`` are the local counts and local key
            ``j`` sits at position ``j * world_size + rank``. The result is the shard's
            partial attention (rows that see no local key: 0, lse ``-inf``), to be
            merged with the other ranks' by their log-sum-exps. Needs
            ``global_seq_lens``.
        global_seq_lens: int ``[B]`` every request's whole length (queries included),
            which places its queries; with ``context_shard`` only.
        draft_ancestors, draft_counts: a verify step's draft trees (the contract's
            "Draft trees"): int64 ``[T]`` per query row the drafts it sees, int32 ``[B]``
            each request's drafts; or None.
        mm_prefix_ranges: int ``[B, R, 2]``: request ``b``'s bidirectional ranges (as
            for :func:`dense_attention`, padded with ``(0, 0)``), or None.
        output: optional ``[T, Hq, D]`` tensor of the query dtype to write into (and
            return); padding rows are set to 0.
        return_lse: also return the float32 ``[T, Hq]`` log-sum-exp (``-inf`` on padding).

    Returns:
        ``out`` ``[T, Hq, D]`` in the query dtype, or ``(out, lse)`` if ``return_lse``.
    """
    causal = check_bool("causal", causal)
    return_lse = check_bool("return_lse", return_lse)
    shard = _check_shard(context_shard, global_seq_lens, seq_lens)
    _check_paged_inputs(
        query,
        kv_cache,
        query_start_loc,
        seq_lens,
        block_table,
        output,
        causal=causal and shard is None,
    )
    _check_options(
        num_q_heads=query.shape[1],
        scale=scale,
        causal=causal,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        logits_soft_cap=logits_soft_cap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
    )
    # The contract's rules: a float > 0 or a per-head [Hkv] tensor (any device here).
    num_kv_heads = kv_cache.shape[3]
    k_scale = _scale_arg("k_scale", k_scale, num_kv_heads)
    v_scale = _scale_arg("v_scale", v_scale, num_kv_heads)
    kv_scales = check_kv_scales_cache(kv_scales, kv_cache)
    num_tokens, num_q_heads, _ = query.shape
    tree = check_draft_tree(
        draft_ancestors, draft_counts, num_tokens, seq_lens.shape[0], causal and shard is None
    )
    given_ranges: object = mm_prefix_ranges  # untyped callers may pass anything
    if given_ranges is not None and (
        not isinstance(given_ranges, Tensor)
        or given_ranges.dim() != 3
        or given_ranges.shape[0] != seq_lens.shape[0]
        or given_ranges.shape[2] != 2
    ):
        raise ValueError(
            f"mm_prefix_ranges must be an integer tensor [B={seq_lens.shape[0]}, R, 2] or "
            f"None, got {describe(mm_prefix_ranges)}"
        )
    if output is None:
        output = torch.empty_like(query)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), device=query.device)

    starts: list[int] = query_start_loc.tolist()  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]  # torch types tolist() as a bare List
    lens: list[int] = seq_lens.tolist()  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]  # torch types tolist() as a bare List
    output[starts[-1] :] = 0  # padding rows
    totals = shard[2] if shard is not None else lens
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        if q_end == q_start:
            continue
        key, value = _gather_kv(kv_cache, block_table[b], seq_len)
        q_positions = k_positions = None
        draft_visible = None
        if tree is not None and int(tree[1][b]) > 0:
            rows, drafts = tree[0][q_start:q_end], int(tree[1][b])
            draft_visible = _draft_tree_visible(rows, drafts, seq_len)
            q_positions, k_positions = _draft_tree_positions(rows, drafts, seq_len)
        if shard is not None:
            rank, world, _ = shard
            q_positions = torch.arange(totals[b] - (q_end - q_start), totals[b])
            k_positions = torch.arange(seq_len) * world + rank
        if kv_scales is not None:
            ks, vs = gather_kv_scales(kv_scales, block_table[b], seq_len)
            key_f = key.float() * ks.to(key.device)[..., None]
            value_f = value.float() * vs.to(value.device)[..., None]
        else:
            key_f = key.float() * _per_head(k_scale, key.device)
            value_f = value.float() * _per_head(v_scale, value.device)
        out_b, lse_b = dense_attention(
            query[q_start:q_end],
            key_f,
            value_f,
            scale=scale,
            causal=causal,
            q_positions=q_positions,
            k_positions=k_positions,
            sliding_window=sliding_window,
            chunk_size=chunk_size,
            logits_soft_cap=logits_soft_cap,
            alibi_slopes=alibi_slopes,
            sinks=sinks,
            draft_visible=draft_visible,
            mm_prefix_ranges=None if mm_prefix_ranges is None else mm_prefix_ranges[b],
            return_lse=True,
        )
        output[q_start:q_end] = out_b
        lse[q_start:q_end] = lse_b
    if return_lse:
        return output, lse
    return output
