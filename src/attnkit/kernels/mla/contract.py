"""The contract of MLA attention in its absorbed form over a latent paged cache: the
argument rules any implementation of the op shares (the Triton launcher
:mod:`attnkit.kernels.mla.triton`, and a torch side that reads the same cache).

Multi-head latent attention (DeepSeek-AI, 2024, "DeepSeek-V2", section 2.1) caches one
latent per token: ``D = R + P`` channels, the compressed key/value ``c`` (``R =
kv_lora_rank`` channels) followed by the decoupled rotary key ``k_pe`` (``P =
qk_rope_head_dim``, shared by all heads). With the key up-projection absorbed into the
query (``q_nope @ W_UK`` per head), attention is multi-query attention with one key head
of width ``D`` and one value head of width ``R``:

* ``query`` ``[T, H, D]``: per head the absorbed ``q_nope @ W_UK`` (``R`` channels) then
  ``q_pe`` (``P`` channels);
* ``latent_cache`` ``[NB, BS, D]``: position ``p`` of request ``b`` in block
  ``block_table[b, p // BS]`` at offset ``p % BS``; the latent is every head's key and
  its first ``R`` channels the value;
* ``output`` ``[T, H, R]`` (the caller applies ``W_UV``); ``lse`` float32 ``[T, H]``.

Scores are ``scale * kv_scale * (q . latent)``; the cache stores ``latent / kv_scale``
(an fp8 e4m3 cache needs ``kv_scale``; with any other cache it defaults to 1).

Shape letters: ``T`` query tokens, ``H`` heads, ``D`` latent width, ``R`` kv_lora_rank,
``P = D - R`` rope channels, ``NB`` blocks, ``BS`` block size. Every check reads metadata
only (no device value goes back to the host) and raises ``ValueError`` (and
``TypeError`` for a wrong Python type, see
:class:`~attnkit.kernels._checks.KernelTypeError`) naming the argument, what is allowed
and what was given.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.kernels._checks import check_device, check_int_arg, describe, require_tensor
from attnkit.kernels.attention.contract import FP8_DTYPE, check_kv_scale

__all__ = [
    "FP8_DTYPE",
    "MLA_DTYPES",
    "check_kv_lora_rank",
    "check_latent_cache",
    "check_latents",
    "check_mla_kv_scale",
    "check_mla_lse",
    "check_mla_output",
    "check_mla_query",
    "check_slot_mapping",
]

MLA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Query, output and latent dtypes; the cache has the query dtype or :data:`FP8_DTYPE`."""


def check_mla_query(query: object, device: torch.device | None = None) -> Tensor:
    """``query`` ``[T, H, D]`` of a dtype in :data:`MLA_DTYPES` (any strides) on ``device``."""
    query = require_tensor("query", query, "a torch.Tensor [T, H, D] (absorbed queries)")
    if query.dim() != 3:
        raise ValueError(f"query: expected shape [T, H, D], got {tuple(query.shape)}")
    if query.dtype not in MLA_DTYPES:
        raise ValueError(f"query: expected dtype in {MLA_DTYPES}, got {query.dtype}")
    if query.shape[1] == 0:
        raise ValueError(f"query: expected at least one head (H >= 1), got {describe(query)}")
    check_device("query", query, device, "plan")
    return query


def check_latent_cache(latent_cache: object, query: Tensor) -> Tensor:
    """``latent_cache`` ``[NB, BS, D]``, contiguous, ``NB, BS >= 1``, the query's ``D``,
    dtype the query dtype or :data:`FP8_DTYPE`, on the query device."""
    cache = require_tensor("latent_cache", latent_cache, "a torch.Tensor [NB, BS, D]")
    if cache.dim() != 3:
        raise ValueError(f"latent_cache: expected shape [NB, BS, D], got {tuple(cache.shape)}")
    if cache.shape[2] != query.shape[2]:
        raise ValueError(
            f"latent_cache: expected latent width D={query.shape[2]} (the query's last dim), "
            f"got {cache.shape[2]}"
        )
    if cache.dtype not in (query.dtype, FP8_DTYPE):
        raise ValueError(
            f"latent_cache: expected dtype {query.dtype} (the query dtype) or {FP8_DTYPE}, "
            f"got {cache.dtype}"
        )
    check_device("latent_cache", cache, query.device)
    if cache.shape[0] == 0 or cache.shape[1] == 0:
        raise ValueError(
            f"latent_cache: expected at least one block of at least one slot, got {describe(cache)}"
        )
    if not cache.is_contiguous():
        raise ValueError(
            "latent_cache: expected a contiguous tensor, got a non-contiguous one "
            f"({describe(cache)}, strides {tuple(cache.stride())})"
        )
    return cache


def check_kv_lora_rank(kv_lora_rank: object, latent_dim: int) -> int:
    """``1 <= R <= D``: the values are the first ``R`` of the ``D`` latent channels."""
    rank = check_int_arg("kv_lora_rank", kv_lora_rank, 1)
    if rank > latent_dim:
        raise ValueError(
            f"kv_lora_rank: expected an int <= the latent width D={latent_dim} "
            f"(D = kv_lora_rank + rope channels), got {rank}"
        )
    return rank


def check_mla_kv_scale(
    kv_scale: object, cache_dtype: torch.dtype, device: torch.device | None
) -> float | Tensor | None:
    """``kv_scale``: None, a float > 0 or a one-element float32 device tensor; required
    with an :data:`FP8_DTYPE` cache (which stores ``latent / kv_scale``)."""
    value = check_kv_scale("kv_scale", kv_scale, device)
    if value is None and cache_dtype == FP8_DTYPE:
        raise ValueError(
            f"kv_scale: expected a float > 0 or a one-element torch.float32 tensor with a "
            f"{FP8_DTYPE} latent_cache, got None"
        )
    return value


def check_mla_output(output: object, query: Tensor, kv_lora_rank: int) -> Tensor | None:
    """None, or ``output`` ``[T, H, R]`` of the query dtype on the query device."""
    if output is None:
        return None
    num_tokens, num_heads = query.shape[0], query.shape[1]
    want = (num_tokens, num_heads, kv_lora_rank)
    output = require_tensor("output", output, f"a torch.Tensor [T, H, R]={list(want)} or None")
    if tuple(output.shape) != want:
        raise ValueError(
            f"output: expected shape [T, H, R]={list(want)} (R = kv_lora_rank), "
            f"got {list(output.shape)}"
        )
    if output.dtype != query.dtype:
        raise ValueError(
            f"output: expected dtype {query.dtype} (the query dtype), got {output.dtype}"
        )
    check_device("output", output, query.device)
    return output


def check_mla_lse(lse: object, query: Tensor) -> Tensor | None:
    """None, or ``lse`` float32 ``[T, H]`` on the query device."""
    if lse is None:
        return None
    want = [query.shape[0], query.shape[1]]
    lse = require_tensor("lse", lse, f"a torch.float32 tensor [T, H]={want} or None")
    if list(lse.shape) != want:
        raise ValueError(f"lse: expected shape [T, H]={want}, got {list(lse.shape)}")
    if lse.dtype != torch.float32:
        raise ValueError(f"lse: expected dtype torch.float32, got {lse.dtype}")
    check_device("lse", lse, query.device)
    return lse


def check_latents(latents: object, latent_cache: Tensor) -> Tensor:
    """New latents ``[T, D]`` (or ``[T, 1, D]``) for ``latent_cache``, returned as
    ``[T, D]`` (a view). Dtype: the cache dtype, or any of :data:`MLA_DTYPES` for an
    :data:`FP8_DTYPE` cache."""
    dim = latent_cache.shape[2]
    latents = require_tensor("latents", latents, f"a torch.Tensor [T, D={dim}]")
    if latents.dim() == 3 and latents.shape[1] == 1:
        latents = latents[:, 0]
    if latents.dim() != 2 or latents.shape[1] != dim:
        raise ValueError(
            f"latents: expected shape [T, {dim}] or [T, 1, {dim}] (D of latent_cache), "
            f"got {tuple(latents.shape)}"
        )
    if latent_cache.dtype == FP8_DTYPE:
        if latents.dtype not in MLA_DTYPES:
            raise ValueError(
                f"latents: expected dtype in {MLA_DTYPES} for a {FP8_DTYPE} latent_cache, "
                f"got {latents.dtype}"
            )
    elif latents.dtype != latent_cache.dtype:
        raise ValueError(
            f"latents: expected dtype {latent_cache.dtype} (the latent_cache dtype), "
            f"got {latents.dtype}"
        )
    check_device("latents", latents, latent_cache.device, "latent_cache")
    return latents


def check_slot_mapping(slot_mapping: object, num_tokens: int, device: torch.device) -> Tensor:
    """``slot_mapping`` int32/int64 ``[T]`` on ``device``, unit stride (``-1``: skip)."""
    slots = require_tensor("slot_mapping", slot_mapping, "an int32/int64 torch.Tensor [T]")
    if slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping: expected dtype torch.int32 or torch.int64, got {slots.dtype}"
        )
    if slots.dim() != 1 or slots.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping: expected shape [{num_tokens}] (one slot per latent), "
            f"got {tuple(slots.shape)}"
        )
    check_device("slot_mapping", slots, device, "latent_cache")
    if num_tokens > 1 and slots.stride(0) != 1:
        raise ValueError(
            f"slot_mapping: expected unit stride, got stride {slots.stride(0)} ({describe(slots)})"
        )
    return slots
