"""The Triton paged-attention kernels on a decode context-parallel shard
(``plan_paged_attention(context_shard=(rank, size), global_seq_lens=...)``).

For each rank the test builds the shard as the runtime would (position ``p`` of a
request at local index ``p // size`` of rank ``p % size``, blocks shuffled, every other
slot NaN), runs the kernel with ``lse``, and checks two things against independent
computations written here in float64: each rank's partial equals dense attention over
the positions it holds (causal by global positions, ALiBi by global distance), and the
ranks' partials merged by their lses equal dense attention over the whole context.
"""

from __future__ import annotations

import random

import pytest
import torch

from attnkit.kernels.attention.triton import paged_attention
from attnkit.kernels.attention.triton_plan import plan_paged_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HQ, HKV, D, BS = 4, 2, 32, 16


def dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    slopes: torch.Tensor | None,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of q ``[Tq, Hq, D]`` over k/v ``[Tk, Hkv, D]`` at the given
    positions; returns (out, lse) with lse -inf and out 0 for rows that see nothing."""
    group = HQ // HKV
    kk = k.double().repeat_interleave(group, 1)
    vv = v.double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        s = s + slopes.double()[:, None, None] * (k_pos[None, None, :] - q_pos[None, :, None])
    s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    lse = torch.logsumexp(s, -1)  # [H, Tq]
    w = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", w, vv)
    return out, lse.T


@pytest.mark.parametrize(
    ("size", "q_lens", "totals", "splits", "features"),
    [
        (2, [1, 1, 1], [37, 5, 64], 0, ()),
        (3, [1, 1], [50, 2], 3, ("alibi",)),
        (4, [6, 1, 9], [41, 23, 9], 0, ("alibi", "softcap")),
        (2, [1], [1], 0, ()),
    ],
    ids=["decode-2", "split-kv-3-alibi", "chunks-4-alibi-softcap", "first-token"],
)
def test_shard_partials_merge_to_full_attention(
    size: int, q_lens: list[int], totals: list[int], splits: int, features: tuple[str, ...]
) -> None:
    gen = torch.Generator().manual_seed(sum(totals) + size)
    n = len(q_lens)
    keys = [torch.randn(t, HKV, D, generator=gen) for t in totals]
    values = [torch.randn(t, HKV, D, generator=gen) for t in totals]
    query = torch.randn(sum(q_lens), HQ, D, generator=gen)
    scale = D**-0.5
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(HQ)]) if "alibi" in features else None
    softcap = 8.0 if "softcap" in features else None
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    outs, lses = [], []
    for rank in range(size):
        local = [len(range(rank, t, size)) for t in totals]
        width = max(1, max(-(-c // BS) for c in local))
        num_blocks = 1 + n * width
        cache = torch.full((num_blocks, 2, BS, HKV, D), float("nan"))
        free = list(range(1, num_blocks))
        random.Random(rank).shuffle(free)
        table = torch.zeros(n, width, dtype=torch.int32)
        for b in range(n):
            for j in range(-(-local[b] // BS)):
                table[b, j] = free.pop()
            positions = list(range(rank, totals[b], size))
            for j, p in enumerate(positions):
                blk, off = int(table[b, j // BS]), j % BS
                cache[blk, 0, off] = keys[b][p]
                cache[blk, 1, off] = values[b][p]
        plan = plan_paged_attention(
            qsl.to(DEVICE),
            torch.tensor(local, dtype=torch.int32, device=DEVICE),
            table.to(DEVICE),
            max_query_len=max(q_lens),
            max_seq_len=max(local),
            block_size=BS,
            num_kv_heads=HKV,
            num_splits=splits,
            context_shard=(rank, size),
            global_seq_lens=torch.tensor(totals, dtype=torch.int32, device=DEVICE),
        )
        lse = torch.empty(sum(q_lens), HQ, device=DEVICE)
        out = paged_attention(
            query.to(DEVICE),
            cache.to(DEVICE),
            plan,
            scale=scale,
            alibi_slopes=slopes.to(DEVICE) if slopes is not None else None,
            logits_soft_cap=softcap,
            lse=lse,
        ).cpu()
        # Each rank's partial: attention over the positions it holds.
        for b in range(n):
            rows = slice(int(qsl[b]), int(qsl[b + 1]))
            q_pos = torch.arange(totals[b] - q_lens[b], totals[b])
            k_pos = torch.arange(rank, totals[b], size)
            want, want_lse = dense(
                query[rows], keys[b][k_pos], values[b][k_pos], q_pos, k_pos, scale, slopes, softcap
            )
            torch.testing.assert_close(out[rows].double(), want, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(lse.cpu()[rows].double(), want_lse, atol=2e-5, rtol=2e-5)
        outs.append(out.double())
        lses.append(lse.cpu().double())
    total_lse = torch.logsumexp(torch.stack(lses), 0)
    merged = sum(
        torch.exp(part_lse - total_lse)[..., None] * o
        for o, part_lse in zip(outs, lses, strict=True)
    )
    for b in range(n):
        rows = slice(int(qsl[b]), int(qsl[b + 1]))
        q_pos = torch.arange(totals[b] - q_lens[b], totals[b])
        want, _ = dense(
            query[rows], keys[b], values[b], q_pos, torch.arange(totals[b]), scale, slopes, softcap
        )
        torch.testing.assert_close(merged[rows], want, atol=2e-5, rtol=2e-5)


def test_shard_arguments_are_checked() -> None:
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    table = torch.ones(1, 1, dtype=torch.int32)
    kw = {"max_query_len": 1, "max_seq_len": 3, "block_size": BS, "num_kv_heads": HKV}
    with pytest.raises(ValueError, match=r"0 <= rank < size, got \(2, 2\)"):
        plan_paged_attention(qsl, lens, table, **kw, context_shard=(2, 2), global_seq_lens=lens)
    with pytest.raises(ValueError, match="global_seq_lens"):
        plan_paged_attention(qsl, lens, table, **kw, context_shard=(0, 2), global_seq_lens=None)
    with pytest.raises(ValueError, match="shards are of full attention"):
        plan_paged_attention(
            qsl, lens, table, **kw, sliding_window=4, context_shard=(0, 2), global_seq_lens=lens
        )
    with pytest.raises(ValueError, match="expected None without context_shard"):
        plan_paged_attention(qsl, lens, table, **kw, global_seq_lens=lens)


def test_sharded_launch_shape_halves_rows_only_at_head_256() -> None:
    """16-bit shards of head 256 take half the rows (the measured spill-free shape);
    decode tiles keep the 16-row minimum of the dots; below 256 only the split-KV
    pipeline depth changes."""
    from attnkit.kernels.attention.triton_plan import _launch_shape

    base = _launch_shape(256, 64, 32, 4, fp32=False, fp8_kv=False)
    shard = _launch_shape(256, 64, 32, 4, fp32=False, fp8_kv=False, sharded=True)
    assert (base.rows_q, shard.rows_q) == (16, 8)
    decode = _launch_shape(256, 16, 1, 4, fp32=False, fp8_kv=False, sharded=True)
    assert decode.rows_q * 4 >= 16
    narrow = _launch_shape(128, 64, 32, 4, fp32=False, fp8_kv=False, sharded=True)
    plain = _launch_shape(128, 64, 32, 4, fp32=False, fp8_kv=False)
    # Only the split-KV pipeline depth differs below head 256 (2 stages for shards).
    assert (narrow.rows_q, narrow.tile_n, narrow.num_warps, narrow.num_stages) == (
        plain.rows_q,
        plain.tile_n,
        plain.num_warps,
        plain.num_stages,
    )
    assert (narrow.split_num_stages, plain.split_num_stages) == (2, 3)
