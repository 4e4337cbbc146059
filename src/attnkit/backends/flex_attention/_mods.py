"""FlexAttention's per-step functions for a paged step: the ``mask_mod`` and
``score_mod`` (one of each for every kind, their terms read from tensors, so one compiled
kernel serves every kind and every constant of one shape), the query rows and block lists
as the compiled kernel wants them, and the buffers every layer shares.

Letters as in ``_plan``: ``Bb`` padded requests of a call, ``G`` query heads per K/V
head, ``NQB`` sparse query blocks, ``NB`` cache blocks, ``BS`` the cache block size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["make_image_mask_mod", "make_mask_mod", "make_score_mod", "pad_blocks", "query_rows", "workspace"]


def query_rows(query_len: int, group: int) -> int:
    # One query row per K/V head would select inductor's CPU decoding template, which
    # walks every listed block once per partition of the whole plane when the mask
    # depends on the request; two rows (one padding) keep the block-sparse template.
    return max(query_len * group, 2)


def pad_blocks(blocks: torch.Tensor, width: int) -> torch.Tensor:
    """``[Bb, 1, NQB, W]`` -> ``[Bb, 1, NQB, width]``: the compiled CPU kernel asserts
    that the index tensor spans the whole key sequence (``NB`` blocks)."""
    out = blocks.new_zeros((*blocks.shape[:-1], width))
    out[..., : min(blocks.shape[-1], width)] = blocks[..., :width]
    return out


def make_mask_mod(
    p2l: torch.Tensor,
    info: torch.Tensor,
    limits: torch.Tensor,
    group: int,
    block_size: int,
    q_last: torch.Tensor | None = None,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The step's ``mask_mod``: one function for every kind (the kind's terms come
    from ``limits``), so one compiled kernel serves every kind of one shape. With
    ``q_last`` (int32 ``[Bb, Lb]``, bidirectional image ranges) a query sees keys up
    to its ``q_last`` instead of its own position (``make_image_mask_mod``)."""
    if q_last is not None:
        return make_image_mask_mod(p2l, info, limits, group, block_size, q_last)

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        t = q_idx // group
        logical = p2l[kv_idx // block_size]
        pos = logical * block_size + kv_idx % block_size
        qp = info[b, 0] + t
        future, window, chunk, offset = limits[0], limits[1], limits[2], limits[3]
        return (
            (t < info[b, 1])
            & (logical >= 0)
            & (pos < info[b, 2])
            & (pos <= qp + future)
            & (qp - pos < window)
            & ((pos + offset) // chunk == (qp + offset) // chunk)
        )

    return mask_mod


def make_image_mask_mod(
    p2l: torch.Tensor,
    info: torch.Tensor,
    limits: torch.Tensor,
    group: int,
    block_size: int,
    q_last: torch.Tensor,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The ``mask_mod`` of a step with a query inside an image range (``Mask.mm_prefix``):
    the causal term reads each query's last visible key (its range's end; its own
    position outside every range); the window's lower edge stays."""

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        t = q_idx // group
        logical = p2l[kv_idx // block_size]
        pos = logical * block_size + kv_idx % block_size
        qp = info[b, 0] + t
        window = limits[1]
        return (
            (t < info[b, 1])
            & (logical >= 0)
            & (pos < info[b, 2])
            & (pos <= q_last[b, t])
            & (qp - pos < window)
        )

    return mask_mod


def make_score_mod(
    p2l: torch.Tensor,
    info: torch.Tensor,
    group: int,
    block_size: int,
    soft_cap: torch.Tensor | None,
    slopes: torch.Tensor | None,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The layer's ``score_mod``: soft-cap ``cap * tanh(s / cap)``, then ALiBi
    ``s + slope[head] * (j - i)`` (the reference's order and sign)."""

    def score_mod(
        score: torch.Tensor,
        b: torch.Tensor,
        h: torch.Tensor,
        q_idx: torch.Tensor,
        kv_idx: torch.Tensor,
    ) -> torch.Tensor:
        if soft_cap is not None:
            score = soft_cap * torch.tanh(score / soft_cap)
        if slopes is not None:
            head = h * group + q_idx % group
            pos = p2l[kv_idx // block_size] * block_size + kv_idx % block_size
            qp = info[b, 0] + q_idx // group
            score = score + slopes[head] * (pos - qp)
        return score

    return score_mod


_workspaces: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}


def workspace(name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A flat buffer of at least ``numel`` elements, shared by every layer (layers run
    one after another) and grown when a step needs more: the query and output copies of
    a prefill are tens of MB, and a fresh allocation of that size costs page faults on
    every layer."""
    key = (name, like.device, like.dtype)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(
            max(numel, int(buf.numel() * 1.5) if buf is not None else 0),
            dtype=like.dtype,
            device=like.device,
        )
        _workspaces[key] = buf
    return buf[:numel]
