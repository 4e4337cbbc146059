"""Host-side planning of one step for FlexAttention over a paged K/V plane.

Pure numpy on the CPU copies of the batch (``query_start_loc_cpu``, ``seq_lens_cpu``):
no attnkit types, no device tensors, no per-request Python loop. The builder turns the
result into device tensors once per step; every layer of the group reuses them.

Letters: ``B`` requests of the step, ``Bb`` the padded batch of one call (a bucket),
``Lb`` its padded query length (a bucket), ``G`` query heads per K/V head, ``R = Lb * G``
query rows per K/V head (GQA packed: row ``t * G + g`` is token ``t``, head ``g`` of the
group, so each K/V tile is read once for the whole group), ``QB`` query rows per sparse
block, ``BS`` the cache block size (the sparse KV block), ``NQB = ceil(R / QB)``.

Masks (positions are absolute in the request's context, keys at ``0 .. seq - 1``, the
query token ``t`` at ``qpos0 + t`` with ``qpos0 = seq - qlen``):

* causal: ``pos <= qp``; with a window ``W``: ``qp - pos < W``; with a chunk ``C``:
  ``pos // C == qp // C``;
* bidirectional (encoder-only, cross): every ``pos < seq``.

For each request and query block the plan lists the logical KV blocks some query of
the block can see, split into *full* blocks (every real query of the block sees every
key of it: FlexAttention skips the mask there) and *partial* ones (the mask decides
per element). Blocks no query sees are not listed, so they are never read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = [
    "NO_LIMIT",
    "CallPlan",
    "Ints",
    "bucket_for",
    "lower_bound",
    "plan_call",
]

Ints = npt.NDArray[np.int64]

NO_LIMIT = 1 << 30
"""Stands for "no window", "no chunk" and "no causal limit" in int32 mask arithmetic
(``qp + NO_LIMIT`` and ``pos // NO_LIMIT`` stay exact in int32 for contexts < 2**30)."""


def bucket_for(size: int, buckets: Sequence[int] | None, minimum: int = 1) -> int:
    """The smallest declared bucket ``>= size``; past the largest (or with no buckets
    declared), the next power of two ``>= max(size, minimum)``.

    Every distinct bucket is one compiled kernel, so sizes are rounded up to a few.
    """
    for b in buckets or ():
        if b >= size and b >= minimum:
            return b
    want = max(size, minimum, 1)
    return 1 << (want - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """One FlexAttention call: a subset of the step's requests, padded to a bucket.

    Attributes:
        requests: ``[n]`` the step's request indices this call serves, in padded order.
        batch: ``Bb`` (>= n).
        query_len: ``Lb`` (>= every served request's query length).
        q_source: ``[Bb * Lb]`` the step's token each padded query slot reads (0 for
            padding slots, whose rows are never written back).
        out_batch, out_token, out_dest: for each real query token of the call, its padded
            request slot, its index within the request and its row in the step.
        info: int32 ``[Bb, 3]``: per padded request ``(qpos0, qlen, seq)``; padding
            requests are ``(0, 0, 0)`` and see nothing.
        kv_num, kv_logical: partial blocks: int32 ``[Bb, NQB]`` counts and
            ``[Bb, NQB, P]`` logical block indices (0-padded).
        full_num, full_logical: the same for full blocks (``[Bb, NQB, F]``).
        q_last: int32 ``[Bb, Lb]``: with ``key_ends``, each query slot's last visible
            key (bidirectional image ranges; its position outside them), else ``None``.
    """

    requests: Ints
    batch: int
    query_len: int
    q_source: Ints
    out_batch: Ints
    out_token: Ints
    out_dest: Ints
    info: npt.NDArray[np.int32]
    kv_num: npt.NDArray[np.int32]
    kv_logical: Ints
    full_num: npt.NDArray[np.int32]
    full_logical: Ints
    q_last: npt.NDArray[np.int32] | None = None


def lower_bound(qp: Ints, window: int | None, chunk: int | None) -> Ints:
    """The first key position a causal query at ``qp`` may see."""
    if window is not None:
        return np.maximum(qp - window + 1, 0)
    if chunk is not None:
        return (qp // chunk) * chunk
    return np.zeros_like(qp)


def _ragged(start: Ints, count: Ints, width: int) -> Ints:
    """``[..., width]``: ``start + w`` where ``w < count``, else 0."""
    w = np.arange(width, dtype=np.int64)
    out = start[..., None] + w
    return np.where(w < count[..., None], out, 0)


def plan_call(
    requests: Ints,
    *,
    query_start: Ints,
    query_lens: Ints,
    seq_lens: Ints,
    batch: int,
    query_len: int,
    group: int,
    q_block: int,
    block_size: int,
    causal: bool,
    window: int | None,
    chunk: int | None,
    key_ends: Ints | None = None,
) -> CallPlan:
    """Plan one call over ``requests`` (indices into the step's per-request arrays).

    Args:
        requests: the requests served, ``n <= batch`` of them, each with >= 1 query.
        query_start, query_lens, seq_lens: ``[B]`` the step's offsets and lengths.
        batch, query_len: the call's buckets ``Bb``, ``Lb``.
        group: ``G``; q_block: ``QB``; block_size: ``BS``.
        causal, window, chunk: the mask.
        key_ends: ``[T]`` each step token's visible keys end (bidirectional image
            ranges, causal without chunk only; ``group`` 1): a query sees keys up to
            ``key_ends - 1`` instead of its own position.
    """
    n = len(requests)
    qlen = query_lens[requests]
    seq = seq_lens[requests]
    qpos0 = seq - qlen
    rows = query_len * group
    nqb = -(-rows // q_block)

    # Query slots: padded request i, token t -> the step's token.
    tok = np.arange(query_len, dtype=np.int64)
    real = tok[None, :] < qlen[:, None]  # [n, Lb]
    src: Ints = np.zeros((batch, query_len), dtype=np.int64)
    src[:n] = np.where(real, query_start[requests][:, None] + tok[None, :], 0)
    out_batch, out_token = np.nonzero(real)
    out_dest = query_start[requests][out_batch] + out_token

    info = np.zeros((batch, 3), dtype=np.int32)
    info[:n, 0] = qpos0
    info[:n, 1] = qlen
    info[:n, 2] = seq

    # Tokens of each query block (a token's G rows may straddle two blocks).
    j = np.arange(nqb, dtype=np.int64)
    t_lo = (j * q_block) // group  # [NQB]
    t_hi = ((j + 1) * q_block - 1) // group
    t_hi_r = np.minimum(t_hi[None, :], qlen[:, None] - 1)  # [n, NQB]
    t_lo_r = np.broadcast_to(t_lo[None, :], t_hi_r.shape)
    live = t_lo_r <= t_hi_r
    qp_lo = qpos0[:, None] + t_lo_r
    qp_hi = qpos0[:, None] + t_hi_r
    last = seq[:, None] - 1
    u0: Ints
    u1: Ints
    f0: Ints
    f1: Ints
    q_last: npt.NDArray[np.int32] | None = None
    if causal:
        u0 = lower_bound(qp_lo, window, chunk)
        u1 = np.minimum(qp_hi, last)
        f0 = lower_bound(qp_hi, window, chunk)
        f1 = np.minimum(qp_lo, last)
        if key_ends is not None:
            q_last, hi, lo = _image_bounds(key_ends, src[:n], real, qpos0, nqb * q_block, q_block)
            q_last_full = np.zeros((batch, query_len), dtype=np.int32)
            q_last_full[:n] = q_last
            q_last = q_last_full
            u1 = np.minimum(np.maximum(u1, hi), last)
            f1 = np.minimum(np.minimum(f1, lo), last)
        if chunk is not None:
            # Queries in two chunks share no key.
            f1 = np.where(qp_lo // chunk == qp_hi // chunk, f1, -1)
    else:
        u0 = np.zeros(qp_lo.shape, dtype=np.int64)
        u1 = np.broadcast_to(last, qp_lo.shape).astype(np.int64)
        f0 = np.array(u0, dtype=np.int64)
        f1 = np.array(u1, dtype=np.int64)
    live &= u1 >= u0
    ub0 = np.where(live, u0 // block_size, 0)
    ub1 = np.where(live, u1 // block_size, -1)
    fb0 = -(-f0 // block_size)
    fb1 = (f1 + 1) // block_size - 1
    has_full = live & (f1 >= f0) & (fb1 >= fb0)
    fb0 = np.where(has_full, fb0, 0)
    fb1 = np.where(has_full, fb1, -1)
    full_count = fb1 - fb0 + 1
    # Partial blocks: the union minus the full range (at most two runs).
    a0 = ub0
    a1 = np.where(has_full, fb0 - 1, ub1)
    b0 = np.where(has_full, fb1 + 1, 0)
    b1 = np.where(has_full, ub1, -1)
    a_count = np.maximum(a1 - a0 + 1, 0)
    b_count = np.maximum(b1 - b0 + 1, 0)
    part_count = a_count + b_count

    p_width = max(int(part_count.max(initial=0)), 1)
    f_width = max(int(full_count.max(initial=0)), 1)
    w = np.arange(p_width, dtype=np.int64)
    in_a = w < a_count[..., None]
    part = np.where(in_a, a0[..., None] + w, b0[..., None] + (w - a_count[..., None]))
    part = np.where(w < part_count[..., None], part, 0)
    full = _ragged(fb0, full_count, f_width)

    kv_num = np.zeros((batch, nqb), dtype=np.int32)
    kv_num[:n] = part_count
    full_num = np.zeros((batch, nqb), dtype=np.int32)
    full_num[:n] = full_count
    kv_logical = np.zeros((batch, nqb, p_width), dtype=np.int64)
    kv_logical[:n] = part
    full_logical = np.zeros((batch, nqb, f_width), dtype=np.int64)
    full_logical[:n] = full
    return CallPlan(
        requests=requests.astype(np.int64),
        batch=batch,
        query_len=query_len,
        q_source=np.ravel(src),
        out_batch=out_batch.astype(np.int64),
        out_token=out_token.astype(np.int64),
        out_dest=out_dest.astype(np.int64),
        info=info,
        kv_num=kv_num,
        kv_logical=kv_logical,
        full_num=full_num,
        full_logical=full_logical,
        q_last=q_last,
    )


def _image_bounds(
    key_ends: Ints, src: Ints, real: npt.NDArray[np.bool_], qpos0: Ints, width: int, q_block: int
) -> tuple[npt.NDArray[np.int32], Ints, Ints]:
    """Each real query slot's last visible key ``[n, Lb]``, and per query block the
    largest and the smallest of them ``[n, NQB]`` (the blocks some query sees, and those
    every query sees)."""
    n, lb = int(real.shape[0]), int(real.shape[1])
    pos = qpos0[:, None] + np.arange(lb, dtype=np.int64)[None, :]
    q_last = np.where(real, key_ends[src] - 1, pos)
    padded_hi = np.full((n, width), -1, dtype=np.int64)
    padded_lo = np.full((n, width), np.iinfo(np.int64).max, dtype=np.int64)
    padded_hi[:, :lb] = np.where(real, q_last, -1)
    padded_lo[:, :lb] = np.where(real, q_last, np.iinfo(np.int64).max)
    blocks = (n, width // q_block, q_block)
    hi: Ints = np.reshape(padded_hi, blocks).max(axis=2)
    lo: Ints = np.reshape(padded_lo, blocks).min(axis=2)
    return q_last.astype(np.int32), hi, lo
