"""Plan a step of paged attention once, for every layer: the batch metadata checked, the
path chosen (one pass or split-KV), the query-tile grid laid out; the split-KV workspace;
the launch shapes (tiles, warps, stages) per head size and dtype. Described in
:mod:`attnkit.kernels.attention.triton`, whose launchers take the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import triton

from attnkit.kernels._checks import (
    FLOAT_DTYPES,
    KernelTypeError,
    check_device,
    check_int_arg,
    describe,
    require_tensor,
)
from attnkit.kernels._triton.varlen import search_iters
from attnkit.kernels.attention.contract import (
    check_batch_metadata,
    check_block_table_width,
    check_index_tensor,
    check_mask_options,
    check_shard_lens,
)

__all__ = [
    "AUTO_SPLIT_MAX_QUERY_LEN",
    "BLOCK_Q_MAX",
    "MAX_HEAD_DIM",
    "MAX_NUM_SPLITS",
    "MIN_HEAD_DIM",
    "SPLIT_KV_MAX_QUERY_LEN",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_DTYPES",
    "LaunchShape",
    "PagedAttentionPlan",
    "SplitKVWorkspace",
    "choose_num_splits",
    "count_query_tiles",
    "plan_paged_attention",
    "split_kv_workspace",
]

SUPPORTED_DTYPES = FLOAT_DTYPES
"""Query (and output) dtypes; the cache has the query dtype or :data:`FP8_DTYPE`."""
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
BLOCK_Q_MAX = 32
"""Most query tokens of one request per program (the plan's ``block_q``)."""
SPLIT_KV_MAX_QUERY_LEN = 16
"""Most queries per request on the split-KV path: every query token gets its own copy
of the partial outputs, so long prefills belong in the one-pass kernel. 16 covers
speculative decoding's draft lengths."""
AUTO_SPLIT_MAX_QUERY_LEN = 1
"""The automatic choice (``num_splits=None``) considers split-KV for plain decode only."""
MAX_NUM_SPLITS = 256
"""Stage 2 holds all partials of one (token, head) in one ``[S, D]`` tile."""

# Rows (query tokens x query heads of one kv group) per inner step. 64 keeps the fp32
# accumulator of the largest head size (256) without register spills; 16 is the smallest
# M that tl.dot accepts on every target.
_MAX_ROWS = 64
_MAX_ROWS_FP32 = 32  # float32 dots run on the FMA units: see _launch_shape
_MIN_ROWS = 16
# choose_num_splits: never give a split fewer tokens than this (the merge and the
# per-split prologue would dominate) ...
_MIN_TOKENS_PER_SPLIT = 256
# ... nor more splits than this (stage-2 tile size and scratch traffic).
_MAX_AUTO_SPLITS = 32


# ------------------------------------------------------------------------ plan


@dataclasses.dataclass(frozen=True, eq=False)
class PagedAttentionPlan:
    """One step's validated batch metadata and launch layout (see :func:`plan_paged_attention`).

    Attributes:
        query_start_loc, seq_lens, block_table: the step's int32 metadata, checked.
        tile_offsets: int32 ``[B + 1]`` on the device: ``tile_offsets[b]`` is the first
            query tile of request ``b`` (``cdiv(q_len, block_q)`` tiles each).
        device: where every tensor of the step lives.
        num_reqs, max_query_len, max_seq_len: ``B`` and the bounds the caller gave.
        block_size, num_kv_heads: of the cache every layer of the step must use.
        causal, sliding_window, chunk_size: the mask.
        block_q: query tokens per tile (a power of two, at most :data:`BLOCK_Q_MAX`).
        num_tiles: programs along grid axis 0: the exact tile count when
            ``exact_grid``, else a bound that depends on shapes only.
        exact_grid: whether ``num_tiles`` came from the host copy of the offsets.
        num_splits: 0 for the one-pass kernel, ``S >= 1`` for split-KV with ``S`` splits.
        split_blocks: 0: each request's keys cut into ``num_splits`` nearly equal runs;
            ``n > 0``: runs of ``n`` blocks each (``split_tokens``), ``num_splits`` a
            bound only.
        search_iters: binary-search steps over ``tile_offsets``.
        context_shard: ``(rank, size)`` when the cache is a decode context-parallel
            shard (local key ``j`` at position ``j * size + rank``); ``None`` otherwise.
        global_seq_lens: int32 ``[B]`` every request's whole length with
            ``context_shard`` (``seq_lens`` are then the shard's counts).
        shard_lens: int32 ``[2B]``, ``seq_lens`` then ``global_seq_lens``: what the
            kernels read as their lengths on a shard (one argument, as unsharded).
        mm_prefix_key_ends: int32 ``[T]``: each query token's visible keys end
            (exclusive) under bidirectional image ranges, or ``None`` (causal).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    tile_offsets: torch.Tensor
    device: torch.device
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    num_kv_heads: int
    causal: bool
    sliding_window: int | None
    chunk_size: int | None
    block_q: int
    num_tiles: int
    exact_grid: bool
    num_splits: int
    search_iters: int
    context_shard: tuple[int, int] | None = None
    split_blocks: int = 0
    global_seq_lens: torch.Tensor | None = None
    shard_lens: torch.Tensor | None = None
    mm_prefix_key_ends: torch.Tensor | None = None


def count_query_tiles(query_lens: Sequence[int], block_q: int) -> int:
    """Tiles of ``block_q`` query tokens a batch with these query lengths has."""
    return sum(-(-q // block_q) for q in query_lens)


def _block_q(max_query_len: int) -> int:
    return min(int(triton.next_power_of_2(max(max_query_len, 1))), BLOCK_Q_MAX)


def _tile_bound(num_tokens: int | None, num_reqs: int, max_query_len: int, block_q: int) -> int:
    """Most tiles a batch of these shapes can have (each holds 1 to ``block_q`` tokens)."""
    bound = num_reqs * -(-max_query_len // block_q)
    if num_tokens is not None:
        bound = min(bound, num_tokens, (num_tokens + num_reqs * (block_q - 1)) // block_q)
    return bound


def choose_num_splits(
    num_reqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    block_size: int,
    num_sms: int = 132,
) -> int:
    """Pick ``num_splits`` for the split-KV path (a host-side heuristic).

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


def _device_tile_offsets(
    query_start_loc: torch.Tensor, num_reqs: int, block_q: int, out: torch.Tensor | None
) -> torch.Tensor:
    """``tile_offsets`` computed on the device with torch ops (no host read)."""
    if out is None:
        out = torch.empty(num_reqs + 1, dtype=torch.int32, device=query_start_loc.device)
    out[:1].zero_()
    if num_reqs:
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        tiles = torch.div(q_lens + (block_q - 1), block_q, rounding_mode="floor")
        torch.cumsum(tiles, 0, dtype=torch.int32, out=out[1:])
    return out


def plan_paged_attention(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    block_size: int,
    num_kv_heads: int,
    causal: bool = True,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    num_tokens: int | None = None,
    num_splits: int | None = 0,
    num_sms: int = 1,
    device: torch.device | None = None,
    query_start_loc_cpu: torch.Tensor | None = None,
    copy_to_device: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None,
    tile_offsets_out: torch.Tensor | None = None,
    context_shard: tuple[int, int] | None = None,
    global_seq_lens: torch.Tensor | None = None,
    block_q: int | None = None,
    split_tokens: int | None = None,
    mm_prefix_key_ends: torch.Tensor | None = None,
) -> PagedAttentionPlan:
    """Validate a step's batch metadata once and lay out its launches.

    Args:
        query_start_loc, seq_lens, block_table: int32 ``[B + 1]``, ``[B]``, ``[B, MB]``
            on ``device`` (unit last stride).
        max_query_len, max_seq_len: bounds on every request's query count and context
            length (the launcher never reads tensor values to check them). With
            ``causal=True`` ``max_seq_len >= max_query_len``.
        block_size, num_kv_heads: of the paged cache (every layer's cache must match).
        causal, sliding_window, chunk_size: the mask (rules in
            :func:`attnkit.kernels.attention.contract.check_mask_options`).
        num_tokens: a bound on ``query_start_loc[B]`` (the step's token count); tightens
            the shape-only grid bound. None: the bound uses ``max_query_len`` only.
        num_splits: 0 for the one-pass kernel; ``1 <= S <= 256`` for split-KV with ``S``
            splits (needs ``max_query_len <= 16``); None to choose: split-KV with
            :func:`choose_num_splits` splits when the batch is causal plain decode
            (``max_query_len <= 1``) and that heuristic asks for more than one split.
        num_sms: streaming multiprocessors the automatic choice fills.
        device: where the tensors must be (default: ``query_start_loc``'s device).
        query_start_loc_cpu: the same offsets on the CPU (int32 ``[B + 1]``; the values
            must equal ``query_start_loc``'s, which is not checked). With it the
            tile offsets are computed on the host, copied with ``copy_to_device`` (default
            ``Tensor.to``) and the grid is exact; without it they are computed on the
            device and the grid is the shape-only bound (what a CUDA graph needs).
        tile_offsets_out: int32 ``[B + 1]`` buffer on ``device`` to write the tile offsets
            into (fixed addresses for CUDA graphs); a new tensor when None.
        context_shard: ``(rank, size)`` for a decode context-parallel shard: ``seq_lens``
            and the block table hold the shard's keys (local key ``j`` at position ``j *
            size + rank``); causal full attention only (no window or chunk). The
            kernels then return the shard's partial attention, to be merged by lse.
        global_seq_lens: int32 ``[B]`` on ``device``: every request's whole length
            (where its queries sit); required with ``context_shard``.
        block_q: query tokens per tile, a power of two ``<= BLOCK_Q_MAX``; None: the
            smallest power of two holding ``max_query_len`` (capped). A batch-invariant
            caller fixes it, so that no request's tiles depend on the batch's longest
            query run.
        split_tokens: with ``num_splits >= 1``: every split covers this many keys (a
            multiple of ``block_size``) from a row's first visible block, and
            ``num_splits`` only bounds them (``num_splits * split_tokens >=
            max_seq_len``): a fixed split size rather than a fixed number of splits,
            so a request's partition, hence its bits, do not depend on the batch (give
            the same ``num_splits`` every step, e.g. from the longest context served:
            the merge's reduction has that many slots). None: ``num_splits`` nearly
            equal runs.
        mm_prefix_key_ends: int32 ``[T' >= T]`` on ``device``: query token ``t`` sees
            keys up to ``mm_prefix_key_ends[t] - 1`` instead of its own position
            (bidirectional image ranges; each ``>= its position + 1``, never past its
            ``seq_len``; a window still bounds the look-back); causal only, no chunk,
            the one-pass kernel only (``num_splits`` 0 or None).

    Raises:
        ValueError (TypeError too for wrong Python types): naming the argument.
    """
    if device is None:
        device = require_tensor(
            "query_start_loc", query_start_loc, "an int32 torch.Tensor [B + 1]"
        ).device
    elif not isinstance(device, torch.device):
        raise KernelTypeError(f"device: expected a torch.device or None, got {describe(device)}")
    num_reqs = check_batch_metadata(seq_lens, query_start_loc, block_table, device, of="plan")
    causal, sliding_window, chunk_size = check_mask_options(causal, sliding_window, chunk_size)
    max_query_len = check_int_arg("max_query_len", max_query_len, 0)
    context_shard, global_seq_lens = _check_shard(
        context_shard, global_seq_lens, num_reqs, device, causal, sliding_window, chunk_size
    )
    # Only causal requests must hold their queries among their keys (a shard holds a
    # share of them).
    least = max_query_len if causal and context_shard is None else 0
    max_seq_len = check_int_arg("max_seq_len", max_seq_len, least)
    block_size = check_int_arg("block_size", block_size, 1)
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"kv_cache: expected block size in {SUPPORTED_BLOCK_SIZES}, got {block_size}"
        )
    num_kv_heads = check_int_arg("num_kv_heads", num_kv_heads, 1)
    check_block_table_width(block_table, block_size, max_seq_len)
    if num_tokens is not None:
        num_tokens = check_int_arg("num_tokens", num_tokens, 0)
    num_sms = check_int_arg("num_sms", num_sms, 1)
    if mm_prefix_key_ends is not None:
        ends = require_tensor(
            "mm_prefix_key_ends", mm_prefix_key_ends, "an int32 torch.Tensor [T] or None"
        )
        if ends.dtype != torch.int32 or ends.dim() != 1 or not ends.is_contiguous():
            raise ValueError(
                f"mm_prefix_key_ends: expected a contiguous int32 tensor [T], got {describe(ends)}"
            )
        check_device("mm_prefix_key_ends", ends, device, "plan")
        if num_tokens is not None and ends.shape[0] < num_tokens:
            raise ValueError(
                f"mm_prefix_key_ends: expected at least num_tokens={num_tokens} entries, "
                f"got {describe(ends)}"
            )
        if not causal or chunk_size is not None or context_shard is not None:
            raise ValueError(
                "mm_prefix_key_ends: needs causal attention without chunk_size or "
                f"context_shard, got causal={causal}, chunk_size={chunk_size}, "
                f"context_shard={context_shard}"
            )
        if num_splits:
            raise ValueError(
                f"num_splits: the one-pass kernel serves mm_prefix_key_ends, got {num_splits}"
            )
        num_splits = 0
    if num_splits is None:
        splits = 0
        if causal and num_reqs and 0 < max_query_len <= AUTO_SPLIT_MAX_QUERY_LEN:
            chosen = choose_num_splits(num_reqs, num_kv_heads, max_seq_len, block_size, num_sms)
            splits = chosen if chosen > 1 else 0
        num_splits = splits
    else:
        num_splits = check_int_arg("num_splits", num_splits, 0, MAX_NUM_SPLITS)
        if num_splits and max_query_len > SPLIT_KV_MAX_QUERY_LEN:
            raise ValueError(
                f"max_query_len: expected an int <= {SPLIT_KV_MAX_QUERY_LEN} with "
                f"num_splits={num_splits} (split-KV is a decode path), got {max_query_len}"
            )

    split_blocks = 0
    if split_tokens is not None:
        split_tokens = check_int_arg("split_tokens", split_tokens, block_size)
        if split_tokens % block_size:
            raise ValueError(
                f"split_tokens: expected a multiple of block_size={block_size}, got {split_tokens}"
            )
        if not num_splits:
            raise ValueError(
                f"split_tokens: needs num_splits >= 1 (the bound on splits), got "
                f"num_splits={num_splits}"
            )
        if num_splits * split_tokens < max_seq_len:
            raise ValueError(
                f"num_splits: {num_splits} splits of split_tokens={split_tokens} keys cover "
                f"{num_splits * split_tokens}, less than max_seq_len={max_seq_len}"
            )
        split_blocks = split_tokens // block_size
    if block_q is None:
        block_q = _block_q(max_query_len)
    else:
        block_q = check_int_arg("block_q", block_q, 1, BLOCK_Q_MAX)
        if block_q & (block_q - 1):
            raise ValueError(f"block_q: expected a power of two <= {BLOCK_Q_MAX}, got {block_q}")
    bound = _tile_bound(num_tokens, num_reqs, max_query_len, block_q)
    if tile_offsets_out is not None:
        out_buf = require_tensor(
            "tile_offsets_out", tile_offsets_out, "an int32 torch.Tensor [B + 1] or None"
        )
        if (
            out_buf.dtype != torch.int32
            or tuple(out_buf.shape) != (num_reqs + 1,)
            or not out_buf.is_contiguous()
        ):
            raise ValueError(
                f"tile_offsets_out: expected a contiguous torch.int32 tensor [{num_reqs + 1}], "
                f"got {describe(out_buf)}"
            )
        check_device("tile_offsets_out", out_buf, device, "plan")
    exact = query_start_loc_cpu is not None
    if query_start_loc_cpu is not None:
        qsl_cpu = require_tensor(
            "query_start_loc_cpu", query_start_loc_cpu, "an int32 CPU torch.Tensor [B + 1]"
        )
        if (
            qsl_cpu.dtype != torch.int32
            or tuple(qsl_cpu.shape) != (num_reqs + 1,)
            or qsl_cpu.device.type != "cpu"
        ):
            raise ValueError(
                f"query_start_loc_cpu: expected an int32 CPU tensor [{num_reqs + 1}], "
                f"got {describe(qsl_cpu)}"
            )
        host = torch.zeros(num_reqs + 1, dtype=torch.int32)
        if num_reqs:
            lens = qsl_cpu[1:].to(torch.int64) - qsl_cpu[:-1].to(torch.int64)
            if bool((lens < 0).any()):
                raise ValueError(
                    "query_start_loc_cpu: expected non-decreasing offsets, got "
                    f"{[int(x) for x in qsl_cpu]}"
                )
            host[1:] = torch.cumsum(
                torch.div(lens + block_q - 1, block_q, rounding_mode="floor"), 0
            )
        num_tiles = int(host[-1])
        if tile_offsets_out is not None:
            tile_offsets = tile_offsets_out
            tile_offsets.copy_(host, non_blocking=True)
        elif copy_to_device is not None:
            tile_offsets = copy_to_device(host, device)
        else:
            tile_offsets = host.to(device)
    else:
        num_tiles = bound
        tile_offsets = _device_tile_offsets(query_start_loc, num_reqs, block_q, tile_offsets_out)
    if max_query_len == 0:
        num_tiles = 0
    return PagedAttentionPlan(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        tile_offsets=tile_offsets,
        device=device,
        num_reqs=num_reqs,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        causal=causal,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        block_q=block_q,
        num_tiles=num_tiles,
        exact_grid=exact,
        num_splits=num_splits,
        search_iters=search_iters(num_reqs),
        context_shard=context_shard,
        split_blocks=split_blocks,
        global_seq_lens=global_seq_lens,
        shard_lens=(torch.cat([seq_lens, global_seq_lens]) if global_seq_lens is not None else None),
        mm_prefix_key_ends=mm_prefix_key_ends,
    )


def _check_shard(
    context_shard: object,
    global_seq_lens: object,
    num_reqs: int,
    device: torch.device,
    causal: bool,
    sliding_window: int | None,
    chunk_size: int | None,
) -> tuple[tuple[int, int] | None, torch.Tensor | None]:
    """``(context_shard, global_seq_lens)`` checked: both or neither; a shard only of a
    causal, unwindowed, unchunked step."""
    shard = check_shard_lens(context_shard, global_seq_lens)
    if shard is None:
        return None, None
    if not causal or sliding_window is not None or chunk_size is not None:
        raise ValueError(
            "context_shard: expected a causal step without sliding_window or chunk_size "
            f"(shards are of full attention), got causal={causal}, "
            f"sliding_window={sliding_window}, chunk_size={chunk_size}"
        )
    totals = check_index_tensor("global_seq_lens", global_seq_lens, (num_reqs,), device, "plan")
    return shard, totals


# ------------------------------------------------------------------------ workspace


class SplitKVWorkspace(NamedTuple):
    """Scratch between the two split-KV stages.

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


# ------------------------------------------------------------------------ launch


def _rows_q(block_q: int, group_pad: int, max_rows: int = _MAX_ROWS) -> int:
    """Query tokens per inner step: the tile's ``block_q`` while the step stays within
    ``max_rows`` rows (unless one group alone is wider), at least ``_MIN_ROWS`` rows."""
    rows_q = min(block_q, max(1, max_rows // group_pad))
    return max(rows_q, _MIN_ROWS // group_pad, 1)


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchShape:
    """Register-tile choices of one launch (``_launch_shape``)."""

    rows_q: int
    """Query tokens per inner step (``ROWS_Q``; ``rows_q * GROUP_PAD`` rows)."""
    tile_n: int
    """Keys per inner step (``TILE_N``)."""
    num_warps: int
    num_stages: int
    """Software-pipelining depth of the one-pass kernel's K/V loads (Triton's CUDA
    default is 3)."""
    split_num_stages: int
    """The same for the split-KV partial kernel (its per-key gather pipelines
    differently)."""
    split_num_warps: int = 0
    """Warps of the split-KV partial kernel; 0: ``num_warps``."""


def _launch_shape(
    head_dim_pad: int,
    block_size: int,
    block_q: int,
    group_pad: int,
    *,
    fp32: bool,
    fp8_kv: bool,
    sharded: bool = False,
) -> LaunchShape:
    """Tile and warp choices that keep every declared variant free of register spills.

    A ``[TILE_N, D]`` tile of K and of V sits in registers next to the ``[M, D]`` fp32
    accumulator (``M = ROWS_Q * GROUP_PAD`` rows).

    * 16-bit operands (tensor cores): up to 64 rows; 64 keys for heads up to 64, 32
      above (never more than a cache block: the one-pass kernel's tiles do not straddle
      blocks). Heads of 128 and more get 8 warps, which halves every thread's share of
      the accumulator and of the tiles: with 4 warps the ``D = 128`` variants came within
      a few registers of the 255 limit on sm_80 (246) and the fp8-cache one spilled 8
      bytes on sm_100.
    * float32 operands run IEEE dots on the FMA units, whose operand layout keeps a
      thread's rows of ``q`` and columns of ``k`` over the whole ``D`` in registers: at 64
      rows and 32-64 keys every head size from 32 up spilled (up to 1.2 KB at ``D =
      256``). Here: at most 32 rows, 16 keys, and 8 warps at ``D = 256`` or once the
      ``[M, D]`` tile reaches 8192 elements (4 warps below: 8 warps at ``M = 16, D =
      128`` spilled 32 bytes on sm_90; 4 warps at ``D = 256`` spilled 8-40 bytes on
      sm_90/100 where 8 warps need 80 registers).
    * Pipeline stages: ptxas sometimes settles on a low register target (48-128) and
      spills 8-16 bytes for one stage count and not another, so each choice is the
      measured clean one. float32, one-pass kernel: 3 stages (2 spilled at ``D`` 64 on
      sm_100, 1 at ``D`` 16-96), but 1 at ``D = 256`` and over an fp8 cache from ``D =
      128`` (2-3 stages: 200-300 bytes at ``D = 128``, 32 registers and a 3 KB spill at
      ``D = 256``, sm_90/100). float32 split-KV: 1 stage (2-3 spilled 8-24 bytes on
      sm_80). 16-bit: 3 stages, but 2 for the ``D = 16`` prefill tile (3 spilled 16
      bytes on sm_100; 2 stages spill at the ``D = 16`` decode tile instead).

    * Context-parallel shards (``sharded``) add the position arithmetic of their keys:
      16-bit heads of 256 at 64 rows then spilled 48 bytes at 255 registers on sm_100,
      so shards of that width take half the rows (32), and 2 stages over a cache of the
      model dtype (3 spilled 8 bytes on sm_90 at block 64; 2 spill 8-16 bytes over fp8
      at block 16, which keeps 3: one of those, bf16 prefill over fp8 at block 16, still
      spills 8 bytes on sm_90, the one spilling variant of the ``--full`` report, left
      as measured rather than fitted to ptxas's choice). Their split-KV partial kernel
      spilled 8-16 bytes at low register targets (64-128) with the unsharded choices:
      16-bit and float32 up to ``D = 64`` take 2 stages there, float32 over an fp8 cache
      at ``D = 256`` 4 warps (each measured clean on sm_80/90/100; 2 stages spilled 224
      bytes for float32 over fp8 at ``D = 128``, 4 warps 16 at ``D = 256`` without fp8).

    Figures from the ``--full`` compile report (``benchmarks/compile_report.py``); with
    these choices no declared variant spills on sm_80/90/100.
    """
    if fp32:
        rows_q = _rows_q(block_q, group_pad, _MAX_ROWS_FP32)
        tile_n = 16
        wide = head_dim_pad >= 256
        num_warps = 8 if wide or rows_q * group_pad * head_dim_pad >= 8192 else 4
        num_stages = 1 if wide or (fp8_kv and head_dim_pad >= 128) else 3
        split_num_stages = 1
        if sharded and wide and fp8_kv:
            return LaunchShape(
                rows_q, min(tile_n, block_size), num_warps, num_stages, 1, split_num_warps=4
            )
        if sharded and head_dim_pad <= 64:
            split_num_stages = 2
    else:
        rows_q = _rows_q(block_q, group_pad)
        shard_256 = sharded and head_dim_pad >= 256
        if shard_256:
            rows_q = max(rows_q // 2, _MIN_ROWS // group_pad, 1)
        tile_n = 64 if head_dim_pad <= 64 else 32
        num_warps = 8 if head_dim_pad >= 128 else 4
        num_stages = 2 if head_dim_pad == 16 and rows_q * group_pad > _MIN_ROWS else 3
        if shard_256 and not fp8_kv:
            num_stages = 2
        split_num_stages = 2 if sharded else 3
    return LaunchShape(rows_q, min(tile_n, block_size), num_warps, num_stages, split_num_stages)
