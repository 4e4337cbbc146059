"""Pure-torch oracles of DeepSeek sparse attention (the formats and rules are in
:mod:`attnkit.kernels.dsa.contract`). They run on any device, accumulate in float32 and
are written for clarity: the reference backend, the demo and the tests run them.

* ``quantize_index_keys`` / ``dequantize_index_rows``: keys <-> fp8 rows with scales;
* ``write_index_cache``: the step's index keys into their slots (``-1``: skip);
* ``indexer_logits``: ``[T, L]`` float32 scores of every position a token may see
  (``-inf`` elsewhere), ``L`` the batch's longest context;
* ``topk_select``: the selection (global slot ids ``[T, topk]`` int32, ``-1`` padded,
  and the valid counts) from the logits;
* ``sparse_mla_attention``: absorbed MLA over the selected latents (decode and prefill
  alike: each token brings its own selection).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit.kernels._checks import check_tensor
from attnkit.kernels.dsa.contract import (
    FP8_MAX,
    INDEX_DTYPES,
    SCALE_BLOCK,
    check_logits_args,
    check_sparse_mla_args,
    check_topk_args,
    check_write_args,
    index_head_dim_of,
    index_row_bytes,
)

__all__ = [
    "dequantize_index_rows",
    "indexer_logits",
    "quantize_index_keys",
    "sparse_mla_attention",
    "token_positions",
    "topk_select",
    "write_index_cache",
]

_FP8 = torch.float8_e4m3fn


def quantize_index_keys(keys: Tensor) -> Tensor:
    """``keys`` ``[..., D]`` (float) -> uint8 rows ``[..., index_row_bytes(D)]``."""
    keys = check_tensor(
        "keys", keys, layout="[..., D]", shape=(*([None] * keys.dim()),), device=None
    )
    if keys.dtype not in INDEX_DTYPES:
        raise ValueError(f"keys: expected dtype in {INDEX_DTYPES}, got {keys.dtype}")
    dim = keys.shape[-1]
    index_row_bytes(dim)
    lead = keys.shape[:-1]
    blocks = keys.float().reshape(*lead, dim // SCALE_BLOCK, SCALE_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # ceil(log2(x)) exactly, from x = m * 2**e with m in [0.5, 1): e, less one when x
    # is a power of two (m == 0.5); a float log2 can round across the integer.
    mantissa, exponent = torch.frexp(torch.clamp(amax, min=1e-30) / FP8_MAX)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    scale = torch.where(
        amax > 0, torch.ldexp(torch.ones_like(amax), exponent), torch.ones_like(amax)
    )
    values = (blocks / scale).to(_FP8).reshape(*lead, dim)
    scales = scale.reshape(*lead, dim // SCALE_BLOCK).contiguous()
    return torch.cat([values.view(torch.uint8), scales.view(torch.uint8)], dim=-1)


def dequantize_index_rows(rows: Tensor) -> Tensor:
    """uint8 rows ``[..., W]`` -> float32 keys ``[..., D]`` (``value * scale``, exact)."""
    width = rows.shape[-1]
    dim = index_head_dim_of(width)
    values = rows[..., :dim].contiguous().view(_FP8).float()
    scales = rows[..., dim:].contiguous().view(torch.float32)
    blocks = values.reshape(*rows.shape[:-1], dim // SCALE_BLOCK, SCALE_BLOCK)
    return (blocks * scales.unsqueeze(-1)).reshape(*rows.shape[:-1], dim)


def write_index_cache(keys: Tensor, index_cache: Tensor, slot_mapping: Tensor) -> None:
    """Quantise ``keys`` ``[T, D]`` (or ``[T, 1, D]``) into ``index_cache`` at
    ``slot_mapping`` ``[T]`` (int64; ``-1``: not written)."""
    keys, cache, slots = check_write_args(keys, index_cache, slot_mapping)
    keep = slots >= 0
    flat = cache.view(-1, cache.shape[2])
    flat[slots[keep]] = quantize_index_keys(keys[keep])


def token_positions(query_start_loc: Tensor, seq_lens: Tensor) -> tuple[Tensor, Tensor]:
    """Per query token: its request and its position (``seq_len - query_len + i``)."""
    qlens = query_start_loc[1:] - query_start_loc[:-1]
    req = torch.repeat_interleave(torch.arange(qlens.numel(), device=qlens.device), qlens)
    first = (seq_lens - qlens).long()
    pos = (
        torch.arange(req.numel(), device=req.device) - query_start_loc[:-1].long()[req] + first[req]
    )
    return req, pos


def _visible(pos: Tensor, length: int, window: int | None) -> Tensor:
    cols = torch.arange(length, device=pos.device)
    seen = cols[None, :] <= pos[:, None]
    if window is not None:
        seen &= cols[None, :] > pos[:, None] - window
    return seen


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
    """Scores ``[T, max_seq_len]`` float32: ``sum_j w[t, j] relu(q[t, j] . k[s])`` for
    every position ``s`` token ``t`` sees, ``-inf`` elsewhere (never-written or released
    slots are never read into a visible score)."""
    q, weights, cache, length = check_logits_args(q, weights, index_cache, max_seq_len, window)
    bs = cache.shape[1]
    req, pos = token_positions(query_start_loc, seq_lens)
    cols = torch.arange(length, device=q.device)
    table = block_table.long()
    width = table.shape[1] * bs
    clipped = torch.clamp(cols, max=max(width - 1, 0))
    slots = table[:, clipped // bs] * bs + clipped % bs  # [B, L]
    keys = dequantize_index_rows(cache.view(-1, cache.shape[2])[slots])  # [B, L, D]
    scores = torch.einsum("thd,tld->thl", q.float(), keys[req])
    logits = (torch.relu(scores) * weights.float()[:, :, None]).sum(dim=1)
    seen = _visible(pos, length, window) & (cols[None, :] < width)
    return torch.where(seen, logits, torch.full_like(logits, -math.inf))


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
    """The selection from ``logits`` ``[T, L]``: global slots ``[T, topk]`` int32 of the
    kept positions in ascending order, ``-1`` padded, and their counts ``[T]`` int32.

    Kept: the ``topk`` visible positions of highest score, ties to the earlier position,
    all visible ones when fewer (the count is ``min(topk, visible)``)."""
    logits, bs, k = check_topk_args(logits, block_size, topk, window)
    tokens, length = logits.shape
    _, pos = token_positions(query_start_loc, seq_lens)
    req, _ = token_positions(query_start_loc, seq_lens)
    seen = _visible(pos, length, window)
    low = torch.finfo(torch.float32).min
    key = torch.nan_to_num(logits.float(), nan=low, posinf=low, neginf=low)
    key = torch.where(seen, key, torch.full_like(key, -math.inf))
    # A stable sort keeps equal scores in position order: ties go to the earlier one.
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    counts = torch.clamp(seen.sum(dim=1), max=k)
    width = min(k, length)
    chosen = order[:, :width]
    live = torch.arange(width, device=logits.device)[None, :] < counts[:, None]
    chosen = torch.where(live, chosen, torch.full_like(chosen, length))  # padding sorts last
    chosen = torch.sort(chosen, dim=1).values
    live = chosen < length
    safe = torch.where(live, chosen, torch.zeros_like(chosen))
    table = block_table.long()
    slots = table[req[:, None], safe // bs] * bs + safe % bs
    out = torch.full((tokens, k), -1, dtype=torch.int32, device=logits.device)
    out[:, :width] = torch.where(live, slots, torch.full_like(slots, -1)).to(torch.int32)
    return out, counts.to(torch.int32)


def sparse_mla_attention(
    query: Tensor,
    latent_cache: Tensor,
    indices: Tensor,
    lens: Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    kv_scale: float = 1.0,
    output: Tensor | None = None,
    lse: Tensor | None = None,
) -> Tensor:
    """Absorbed MLA of ``query`` ``[T, H, D]`` over the latents ``latent_cache.view(-1,
    D)[indices[t, :lens[t]]]``; entries at ``-1`` or past ``lens`` are not read. A token
    with nothing selected gets zeros (and ``lse = -inf``). Output ``[T, H, R]``."""
    cache, idx, counts, rank = check_sparse_mla_args(
        query, latent_cache, indices, lens, kv_lora_rank, output, lse
    )
    dim = query.shape[2]
    flat = cache.reshape(-1, dim)
    cols = torch.arange(idx.shape[1], device=query.device)
    live = (idx >= 0) & (cols[None, :] < counts[:, None])
    safe = torch.where(live, idx, torch.zeros_like(idx)).long()
    kv = flat[safe].float() * kv_scale  # [T, K, D]
    kv = torch.where(live[:, :, None], kv, torch.zeros_like(kv))  # unread slots may hold NaN
    scores = torch.einsum("thd,tkd->thk", query.float(), kv) * scale
    scores = torch.where(live[:, None, :], scores, torch.full_like(scores, -math.inf))
    row_max = scores.amax(dim=2, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    total = p.sum(dim=2, keepdim=True)
    out = torch.einsum("thk,tkr->thr", p / torch.clamp(total, min=1e-30), kv[:, :, :rank])
    if lse is not None:
        lse.copy_((torch.log(total) + row_max)[:, :, 0])
    if output is None:
        return out.to(query.dtype)
    output.copy_(out)
    return output
