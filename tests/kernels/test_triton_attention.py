"""Triton ``write_kv_cache`` and ``unified_attention`` against plain-torch oracles.

On a machine without CUDA, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` and the
kernels run on CPU tensors under the Triton interpreter, which is slow: shapes here are
kept small on purpose.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from attnkit.kernels.triton.kv_write import write_kv_cache
from attnkit.kernels.triton.unified_attention import unified_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (atol, rtol) against a float64 oracle fed the same rounded inputs. float32: the
# kernel's accumulation order differs from the oracle's, a few ulps over <= 100 keys.
# float16/bfloat16: the output is rounded to the dtype and the softmax weights are
# rounded to it before the P.V product, about one ulp each.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# --------------------------------------------------------------------------- fixtures


@dataclass
class Batch:
    """A ragged batch whose whole context (new tokens included) is already cached."""

    query: torch.Tensor  # [T, Hq, D]
    kv_cache: torch.Tensor  # [NB, 2, BS, Hkv, D]
    keys: list[torch.Tensor]  # per request [seq_len, Hkv, D], as written into the cache
    values: list[torch.Tensor]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, MB]
    q_lens: list[int]
    ctx_lens: list[int]
    scale: float

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens)

    @property
    def max_seq_len(self) -> int:
        return max(q + c for q, c in zip(self.q_lens, self.ctx_lens, strict=True))


def make_batch(
    q_lens: Sequence[int],
    ctx_lens: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 3,
) -> Batch:
    """Build a batch with shuffled physical blocks and a NaN-filled cache.

    Block 0 stays the null block; every slot that no request owns (including the tail
    of each request's last block and block 0) holds NaN, so reading one shows up.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + spare_blocks
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()

    max_blocks = max(blocks_per_req) + 1  # one unused column, pointing at block 0
    block_table = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
    cache = torch.full(
        (num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
    )
    keys, values = [], []
    for b, (seq_len, nblk) in enumerate(zip(seq_lens, blocks_per_req, strict=True)):
        blocks = [physical.pop() for _ in range(nblk)]
        block_table[b, :nblk] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(seq_len)
        blk = block_table[b, pos // block_size].long()
        cache[blk, 0, pos % block_size] = k
        cache[blk, 1, pos % block_size] = v
        keys.append(k)
        values.append(v)

    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    query = torch.randn(int(qsl[-1]), num_q_heads, head_dim, generator=gen).to(dtype)
    return Batch(
        query=query.to(DEVICE),
        kv_cache=cache.to(DEVICE),
        keys=keys,
        values=values,
        query_start_loc=qsl.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=block_table.to(DEVICE),
        q_lens=list(q_lens),
        ctx_lens=list(ctx_lens),
        scale=head_dim**-0.5,
    )


def reference_attention(batch: Batch, sliding_window: int | None) -> torch.Tensor:
    """Straightforward float64 causal attention, one request at a time."""
    cache = batch.kv_cache.cpu().double()
    query = batch.query.cpu().double()
    table = batch.block_table.cpu().long()
    block_size = cache.shape[2]
    group = query.shape[1] // cache.shape[3]
    out = torch.empty_like(query)
    start = 0
    for b, (q_len, ctx) in enumerate(zip(batch.q_lens, batch.ctx_lens, strict=True)):
        seq_len = q_len + ctx
        # Gather this request's context by walking its block table.
        pos = torch.arange(seq_len)
        blk = table[b, pos // block_size]
        k = cache[blk, 0, pos % block_size]  # [S, Hkv, D]
        v = cache[blk, 1, pos % block_size]
        k = k.repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v.repeat_interleave(group, dim=1)

        q = query[start : start + q_len]  # [Q, Hq, D]
        q_pos = torch.arange(ctx, seq_len)[:, None]
        k_pos = pos[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, v)
        start += q_len
    return out


def assert_close_to_reference(out: torch.Tensor, batch: Batch, sliding_window: int | None) -> None:
    expected = reference_attention(batch, sliding_window)
    atol, rtol = TOLERANCES[out.dtype]
    assert not out.isnan().any(), "some output rows were never written"
    torch.testing.assert_close(out.cpu().double(), expected, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- oracle self-check


def test_reference_gathers_what_make_batch_wrote() -> None:
    batch = make_batch(
        [2, 3],
        [17, 0],
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=16,
        block_size=16,
        dtype=torch.float32,
    )
    table = batch.block_table.cpu().long()
    cache = batch.kv_cache.cpu()
    for b, k in enumerate(batch.keys):
        pos = torch.arange(k.shape[0])
        torch.testing.assert_close(cache[table[b, pos // 16], 0, pos % 16], k, atol=0, rtol=0)
    # Block 0 is never handed out and stays NaN, as do slots past a request's end.
    assert table[:, :-1].ne(0).sum() == 2 + 1
    assert cache[0].isnan().all()
    assert cache[table[0, 1], :, 3:].isnan().all()


# ------------------------------------------------------------------ unified_attention

# decode, full prefill, chunked prefill, context exactly at a block boundary (bs 16),
# single-token prefill.
MIXED_Q = [1, 20, 7, 3, 1]
MIXED_CTX = [36, 0, 33, 16, 0]


def _case(
    q_lens: list[int],
    ctx_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    window: int | None = None,
    *,
    kind: str,
) -> Any:
    wid = "" if window is None else f"-W{window}"
    return pytest.param(
        q_lens,
        ctx_lens,
        hq,
        hkv,
        d,
        bs,
        dtype,
        window,
        id=f"{kind}-B{len(q_lens)}-Hq{hq}-Hkv{hkv}-D{d}-bs{bs}-{DTYPE_NAMES[dtype]}{wid}",
    )


ATTENTION_CASES = [
    _case(MIXED_Q, MIXED_CTX, 4, 2, 64, 16, torch.float32, kind="mixed"),
    _case(MIXED_Q, MIXED_CTX, 4, 2, 64, 16, torch.float16, kind="mixed"),
    _case(MIXED_Q, MIXED_CTX, 4, 2, 64, 16, torch.bfloat16, kind="mixed"),
    _case(MIXED_Q, MIXED_CTX, 4, 1, 128, 32, torch.float16, kind="mixed-mqa"),
    _case(MIXED_Q, MIXED_CTX, 6, 2, 64, 32, torch.float32, kind="mixed-group3"),
    _case([2, 5], [30, 11], 2, 2, 80, 16, torch.float32, kind="headdim80"),
    _case([1, 1, 1], [0, 31, 64], 8, 2, 64, 32, torch.bfloat16, kind="decode"),
    # 70 queries with G=2 -> 32 tokens per tile: three tiles, the last one partial.
    _case([70, 1], [5, 40], 2, 1, 32, 16, torch.float32, kind="long-prefill"),
    _case(MIXED_Q, MIXED_CTX, 4, 2, 64, 16, torch.float32, 1, kind="window"),
    _case(MIXED_Q, MIXED_CTX, 4, 2, 64, 16, torch.float16, 5, kind="window"),
    _case(MIXED_Q, MIXED_CTX, 4, 2, 64, 32, torch.float32, 16, kind="window"),
    _case([70, 1], [5, 40], 2, 1, 32, 16, torch.float32, 20, kind="window-long"),
    _case(MIXED_Q, MIXED_CTX, 4, 2, 64, 16, torch.float32, 1000, kind="window-huge"),
    _case(MIXED_Q, MIXED_CTX, 2, 1, 128, 16, torch.bfloat16, 7, kind="window"),
    # Request 0's window starts on the last slot of a block (36 - 22 + 1 = 15): an
    # off-by-one in the first block the loop visits drops that key.
    _case([1, 1, 4], [36, 20, 30], 4, 2, 64, 16, torch.float32, 22, kind="window-edge"),
]


@pytest.mark.parametrize(
    ("q_lens", "ctx_lens", "hq", "hkv", "d", "bs", "dtype", "window"), ATTENTION_CASES
)
def test_unified_attention_matches_reference(
    q_lens: list[int],
    ctx_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    window: int | None,
) -> None:
    batch = make_batch(
        q_lens,
        ctx_lens,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        dtype=dtype,
    )
    output = torch.full_like(batch.query, float("nan"))
    returned = unified_attention(
        batch.query,
        batch.kv_cache,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        scale=batch.scale,
        sliding_window=window,
        output=output,
    )
    assert returned is output
    assert_close_to_reference(output, batch, window)


def test_window_huge_equals_no_window() -> None:
    batch = make_batch(
        MIXED_Q,
        MIXED_CTX,
        num_q_heads=2,
        num_kv_heads=2,
        head_dim=16,
        block_size=16,
        dtype=torch.float32,
    )
    kwargs: dict[str, Any] = dict(
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        scale=batch.scale,
    )
    plain = unified_attention(batch.query, batch.kv_cache, **kwargs)
    windowed = unified_attention(
        batch.query, batch.kv_cache, sliding_window=batch.max_seq_len, **kwargs
    )
    torch.testing.assert_close(windowed, plain, atol=0, rtol=0)


def test_strided_query_output_and_untouched_padding_rows() -> None:
    """Query/output as views into wider buffers; rows past query_start_loc[-1] stay put."""
    hq, hkv, d = 4, 2, 32
    batch = make_batch(
        [3, 1],
        [10, 20],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=16,
        dtype=torch.float16,
    )
    num_real = batch.query.shape[0]
    num_padded = num_real + 2
    # A fused qkv buffer: query is a non-contiguous view of its first Hq heads.
    qkv = torch.randn(num_padded, hq + 2 * hkv, d, device=DEVICE).to(torch.float16)
    qkv[:num_real, :hq] = batch.query
    query = qkv[:, :hq]
    out_buffer = torch.full(
        (num_padded, hq, 2 * d), float("nan"), dtype=torch.float16, device=DEVICE
    )
    output = out_buffer[:, :, :d]
    assert not query.is_contiguous()
    assert not output.is_contiguous()
    unified_attention(
        query,
        batch.kv_cache,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        scale=batch.scale,
        output=output,
    )
    assert_close_to_reference(output[:num_real], batch, None)
    assert output[num_real:].isnan().all()
    assert out_buffer[:, :, d:].isnan().all()


def test_allocates_output_when_not_given() -> None:
    batch = make_batch(
        [2],
        [3],
        num_q_heads=1,
        num_kv_heads=1,
        head_dim=16,
        block_size=16,
        dtype=torch.bfloat16,
    )
    out = unified_attention(
        batch.query,
        batch.kv_cache,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        max_query_len=2,
        max_seq_len=5,
        scale=batch.scale,
    )
    assert out.shape == batch.query.shape
    assert out.dtype == torch.bfloat16
    assert_close_to_reference(out, batch, None)


def test_empty_batch_returns_without_launch() -> None:
    cache = torch.zeros(2, 2, 16, 1, 16, device=DEVICE)
    out = unified_attention(
        torch.empty(0, 1, 16, device=DEVICE),
        cache,
        query_start_loc=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.zeros(0, dtype=torch.int32, device=DEVICE),
        block_table=torch.zeros(0, 1, dtype=torch.int32, device=DEVICE),
        max_query_len=0,
        max_seq_len=0,
        scale=1.0,
    )
    assert out.shape == (0, 1, 16)


@settings(max_examples=10, deadline=None)
@given(
    data=st.data(),
    num_kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]),
    block_size=st.sampled_from([16, 32]),
    window=st.one_of(st.none(), st.integers(min_value=1, max_value=40)),
)
def test_unified_attention_random_ragged_batches(
    data: st.DataObject,
    num_kv_heads: int,
    group: int,
    block_size: int,
    window: int | None,
) -> None:
    num_requests = data.draw(st.integers(min_value=1, max_value=4), label="B")
    q_lens = data.draw(
        st.lists(st.integers(1, 18), min_size=num_requests, max_size=num_requests),
        label="q_lens",
    )
    ctx_lens = data.draw(
        st.lists(st.integers(0, 40), min_size=num_requests, max_size=num_requests),
        label="ctx_lens",
    )
    batch = make_batch(
        q_lens,
        ctx_lens,
        num_q_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        block_size=block_size,
        dtype=torch.float32,
        seed=data.draw(st.integers(0, 2**16), label="seed"),
    )
    output = torch.full_like(batch.query, float("nan"))
    unified_attention(
        batch.query,
        batch.kv_cache,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        scale=batch.scale,
        sliding_window=window,
        output=output,
    )
    assert_close_to_reference(output, batch, window)


# --------------------------------------------------------------------- write_kv_cache


def _reference_write(
    cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    expected = cache.clone()
    block_size = cache.shape[2]
    keep = (slots >= 0) & (slots < cache.shape[0] * block_size)
    s = slots[keep]
    expected[s // block_size, 0, s % block_size] = key[keep]
    expected[s // block_size, 1, s % block_size] = value[keep]
    return expected


def _random_slots(num_tokens: int, num_blocks: int, block_size: int, seed: int) -> torch.Tensor:
    """Distinct slots outside block 0, every third token marked as padding (-1)."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:num_tokens]
    slots = slots + block_size
    slots[::3] = -1
    return slots


@pytest.mark.parametrize(
    ("hkv", "d", "bs", "dtype"),
    [
        pytest.param(2, 64, 16, torch.float32, id="Hkv2-D64-bs16-fp32"),
        pytest.param(1, 128, 32, torch.float16, id="Hkv1-D128-bs32-fp16"),
        pytest.param(3, 80, 16, torch.bfloat16, id="Hkv3-D80-bs16-bf16"),
    ],
)
def test_write_kv_cache_matches_index_put(hkv: int, d: int, bs: int, dtype: torch.dtype) -> None:
    num_tokens, num_blocks = 11, 4
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(num_blocks, 2, bs, hkv, d, generator=gen).to(dtype)
    key = torch.randn(num_tokens, hkv, d, generator=gen).to(dtype)
    value = torch.randn(num_tokens, hkv, d, generator=gen).to(dtype)
    slots = _random_slots(num_tokens, num_blocks, bs, seed=2)
    expected = _reference_write(cache, key, value, slots)

    cache_dev = cache.to(DEVICE)
    write_kv_cache(key.to(DEVICE), value.to(DEVICE), cache_dev, slots.to(DEVICE))
    assert torch.equal(cache_dev.cpu(), expected)
    # Padding tokens wrote nothing: the cache differs from the start only at real slots.
    changed = (cache_dev.cpu() != cache).flatten(2).any(-1).any(1).flatten()
    assert set(changed.nonzero().flatten().tolist()) <= set(slots[slots >= 0].tolist())


def test_write_kv_cache_strided_inputs_and_out_of_range_slots() -> None:
    hkv, d, bs, num_blocks = 2, 32, 16, 3
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 1 + 2 * hkv, d, generator=gen)
    key, value = qkv[:, 1 : 1 + hkv], qkv[:, 1 + hkv :]
    assert not key.is_contiguous()
    cache = torch.randn(num_blocks, 2, bs, hkv, d, generator=gen)
    slots = torch.tensor([17, -1, num_blocks * bs, 40, -5], dtype=torch.int64)
    expected = _reference_write(cache, key, value, slots)
    cache_dev = cache.to(DEVICE)
    write_kv_cache(key.to(DEVICE), value.to(DEVICE), cache_dev, slots.to(DEVICE))
    assert torch.equal(cache_dev.cpu(), expected)


def test_write_then_attend() -> None:
    """Context prefilled in the cache, this step's tokens written by the kernel."""
    hq, hkv, d, bs = 4, 2, 32, 16
    batch = make_batch(
        [1, 6],
        [20, 9],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        dtype=torch.float16,
    )
    table = batch.block_table.cpu().long()
    new_k, new_v, slot_list = [], [], []
    for b, (q_len, ctx) in enumerate(zip(batch.q_lens, batch.ctx_lens, strict=True)):
        pos = torch.arange(ctx, ctx + q_len)
        slot_list.append(table[b, pos // bs] * bs + pos % bs)
        new_k.append(batch.keys[b][ctx:])
        new_v.append(batch.values[b][ctx:])
    slots = torch.cat(slot_list)
    # Forget the new tokens, then let write_kv_cache put them back.
    cache = batch.kv_cache.cpu()
    cache[slots // bs, :, slots % bs] = float("nan")
    batch.kv_cache = cache.to(DEVICE)
    write_kv_cache(
        torch.cat(new_k).to(DEVICE),
        torch.cat(new_v).to(DEVICE),
        batch.kv_cache,
        slots.to(DEVICE),
    )
    out = unified_attention(
        batch.query,
        batch.kv_cache,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        scale=batch.scale,
    )
    assert_close_to_reference(out, batch, None)


# --------------------------------------------------------------------- validation

_Kwargs = dict[str, Any]


def _valid_attention_args() -> _Kwargs:
    batch = make_batch(
        [2, 1],
        [3, 4],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=16,
        dtype=torch.float32,
    )
    return dict(
        query=batch.query,
        kv_cache=batch.kv_cache,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        scale=batch.scale,
    )


def _set(**changes: Callable[[_Kwargs], Any]) -> Callable[[_Kwargs], None]:
    def mutate(args: _Kwargs) -> None:
        for name, make in changes.items():
            args[name] = make(args)

    return mutate


META = torch.device("meta")

ATTENTION_ERRORS = [
    pytest.param(_set(query=lambda a: a["query"][0]), "query: expected shape", id="query-2d"),
    pytest.param(
        _set(query=lambda a: a["query"].double(), kv_cache=lambda a: a["kv_cache"].double()),
        "query: expected dtype",
        id="query-fp64",
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"][:, 0]), "kv_cache: expected shape", id="cache-4d"
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"].half()),
        "kv_cache: expected dtype torch.float32",
        id="cache-dtype",
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"].to(META)),
        "kv_cache: expected device",
        id="cache-device",
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"].transpose(3, 2).contiguous().transpose(3, 2)),
        "kv_cache: expected a contiguous",
        id="cache-noncontiguous",
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"][..., :8].contiguous()),
        "kv_cache: expected head size 16",
        id="cache-headdim",
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"][:, :, :8].contiguous()),
        "kv_cache: expected block size",
        id="blocksize-8",
    ),
    pytest.param(
        _set(
            query=lambda a: a["query"][..., :8],
            kv_cache=lambda a: a["kv_cache"][..., :8].contiguous(),
        ),
        r"query: expected head size in \[16, 256\]",
        id="headdim-8",
    ),
    pytest.param(
        _set(query=lambda a: a["query"][:, :3]),
        "kv_cache: expected a kv head count dividing",
        id="heads-not-divisible",
    ),
    pytest.param(
        _set(seq_lens=lambda a: a["seq_lens"].long()),
        "seq_lens: expected dtype torch.int32",
        id="seq-lens-int64",
    ),
    pytest.param(
        _set(seq_lens=lambda a: a["seq_lens"][None]),
        r"seq_lens: expected shape \[B\]",
        id="seq-lens-2d",
    ),
    pytest.param(
        _set(query_start_loc=lambda a: a["query_start_loc"][:-1]),
        r"query_start_loc: expected shape \[3\]",
        id="qsl-length",
    ),
    pytest.param(
        _set(query_start_loc=lambda a: a["query_start_loc"].to(META)),
        "query_start_loc: expected device",
        id="qsl-device",
    ),
    pytest.param(
        _set(block_table=lambda a: a["block_table"][:1]),
        r"block_table: expected shape \[2, \*\]",
        id="table-rows",
    ),
    pytest.param(
        _set(block_table=lambda a: a["block_table"].repeat(1, 2)[:, ::2]),
        "block_table: expected unit stride",
        id="table-strided",
    ),
    pytest.param(
        _set(max_seq_len=lambda a: 100),
        "block_table: expected at least 7 columns",
        id="table-too-narrow",
    ),
    pytest.param(
        _set(max_query_len=lambda a: -1),
        "max_query_len: expected an int >= 0",
        id="max-query-len-negative",
    ),
    pytest.param(
        _set(max_query_len=lambda a: 2.0),
        "max_query_len: expected an int, got float",
        id="max-query-len-float",
    ),
    pytest.param(
        _set(max_seq_len=lambda a: 1),
        "max_seq_len: expected an int >= 2",
        id="max-seq-len-below-query",
    ),
    pytest.param(
        _set(scale=lambda a: float("nan")), "scale: expected a finite float", id="scale-nan"
    ),
    pytest.param(
        _set(sliding_window=lambda a: 0), "sliding_window: expected an int >= 1", id="window-zero"
    ),
    pytest.param(
        _set(sliding_window=lambda a: True),
        "sliding_window: expected an int, got bool",
        id="window-bool",
    ),
    pytest.param(
        _set(output=lambda a: torch.empty_like(a["query"][:1])),
        "output: expected shape",
        id="output-shape",
    ),
    pytest.param(
        _set(output=lambda a: torch.empty_like(a["query"]).half()),
        "output: expected dtype",
        id="output-dtype",
    ),
    pytest.param(
        _set(output=lambda a: torch.empty_like(a["query"], device=META)),
        "output: expected device",
        id="output-device",
    ),
]


@pytest.mark.parametrize(("mutate", "match"), ATTENTION_ERRORS)
def test_unified_attention_rejects(mutate: Callable[[_Kwargs], None], match: str) -> None:
    args = _valid_attention_args()
    mutate(args)
    query, kv_cache = args.pop("query"), args.pop("kv_cache")
    with pytest.raises(ValueError, match=match):
        unified_attention(query, kv_cache, **args)


def _valid_write_args() -> _Kwargs:
    return dict(
        key=torch.zeros(3, 2, 16, device=DEVICE),
        value=torch.zeros(3, 2, 16, device=DEVICE),
        kv_cache=torch.zeros(2, 2, 16, 2, 16, device=DEVICE),
        slot_mapping=torch.tensor([16, -1, 17], device=DEVICE),
    )


WRITE_ERRORS = [
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"][:, 0]), "kv_cache: expected shape", id="cache-4d"
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"].long()), "kv_cache: expected dtype in", id="cache-int"
    ),
    pytest.param(
        _set(kv_cache=lambda a: a["kv_cache"].transpose(3, 2).contiguous().transpose(3, 2)),
        "kv_cache: expected a contiguous",
        id="cache-noncontiguous",
    ),
    pytest.param(
        _set(key=lambda a: a["key"][:, :1]), r"key: expected shape \[T, 2, 16\]", id="key-heads"
    ),
    pytest.param(
        _set(value=lambda a: a["value"].half()),
        "value: expected dtype torch.float32",
        id="value-dtype",
    ),
    pytest.param(_set(key=lambda a: a["key"].to(META)), "key: expected device", id="key-device"),
    pytest.param(
        _set(value=lambda a: a["value"][:2]), "value: expected 3 tokens", id="value-tokens"
    ),
    pytest.param(
        _set(slot_mapping=lambda a: a["slot_mapping"].int()),
        "slot_mapping: expected dtype torch.int64",
        id="slots-int32",
    ),
    pytest.param(
        _set(slot_mapping=lambda a: a["slot_mapping"][:2]),
        r"slot_mapping: expected shape \[3\]",
        id="slots-length",
    ),
    pytest.param(
        _set(slot_mapping=lambda a: a["slot_mapping"].to(META)),
        "slot_mapping: expected device",
        id="slots-device",
    ),
]


@pytest.mark.parametrize(("mutate", "match"), WRITE_ERRORS)
def test_write_kv_cache_rejects(mutate: Callable[[_Kwargs], None], match: str) -> None:
    args = _valid_write_args()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        write_kv_cache(**args)
