"""The DSA kernels, the torch references and the Triton kernels (under the interpreter
on CPU) alike, against float64 oracles written here, loop by loop: the fp8 index rows,
the KV write, indexer logits, top-k (ties, short contexts, windows, -1 padding,
shuffled blocks, NaN-filled caches, chunked prefill) and sparse MLA."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit.kernels.dsa.reference as reference_ops
from attnkit.kernels.dsa.contract import index_row_bytes
from attnkit.kernels.dsa.reference import (
    dequantize_index_rows,
    indexer_logits,
    quantize_index_keys,
    sparse_mla_attention,
    topk_select,
    write_index_cache,
)

D = 128
OPS = ("write_index_cache", "indexer_logits", "topk_select", "sparse_mla_attention")


@pytest.fixture(autouse=True, params=["reference", "triton"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on both implementations (the module's op names rebound)."""
    if request.param == "triton":
        ops = pytest.importorskip("attnkit.kernels.dsa.triton")
    else:
        ops = reference_ops
    for name in OPS:
        monkeypatch.setitem(globals(), name, getattr(ops, name))
    return str(request.param)


def oracle_quantize(key: list[float]) -> tuple[list[float], float]:
    """One 128-value block: the power-of-two scale and the values it divides."""
    amax = max(abs(x) for x in key)
    scale = 1.0 if amax == 0 else 2.0 ** math.ceil(math.log2(amax / 448.0))
    return [x / scale for x in key], scale


def test_row_is_132_bytes_and_roundtrips_exactly_representable_values() -> None:
    assert index_row_bytes(128) == 132
    assert index_row_bytes(256) == 264
    # Values an e4m3 holds exactly once divided by their power-of-two scale.
    key = torch.tensor([(i % 15 - 7) * 0.25 for i in range(D)], dtype=torch.float32)
    row = quantize_index_keys(key[None])
    assert row.shape == (1, 132)
    assert row.dtype == torch.uint8
    values, scale = oracle_quantize(key.tolist())
    assert float(row[0, 128:].view(torch.float32)) == scale
    assert torch.equal(dequantize_index_rows(row)[0], key)
    assert values[0] * scale == key[0].item()


def test_zero_block_has_scale_one() -> None:
    row = quantize_index_keys(torch.zeros(1, D))
    assert float(row[0, 128:].view(torch.float32)) == 1.0
    assert torch.equal(dequantize_index_rows(row), torch.zeros(1, D))


def test_quantisation_error_is_within_e4m3_half_ulp() -> None:
    torch.manual_seed(0)
    keys = torch.randn(16, 256) * 3
    back = dequantize_index_rows(quantize_index_keys(keys))
    for t in range(16):
        for blk in range(2):
            vals = keys[t, blk * 128 : (blk + 1) * 128].double().tolist()
            _, scale = oracle_quantize(vals)
            err = (back[t, blk * 128 : (blk + 1) * 128].double() - torch.tensor(vals)).abs()
            # e4m3 has 3 mantissa bits: relative error <= 2^-4 in the normal range.
            bound = torch.tensor(vals).abs() * 2.0**-4 + scale * 2.0**-9
            assert bool((err <= bound).all())


def _paged(num_blocks: int, bs: int, width: int, fill: float | None = None) -> torch.Tensor:
    cache = torch.zeros(num_blocks, bs, width, dtype=torch.uint8)
    if fill is not None:  # NaN rows: fp8 NaN is 0x7F, fp32 NaN scale
        cache[..., :D] = 0x7F
        cache[..., D:] = torch.full((num_blocks, bs, (width - D) // 4), math.nan).view(torch.uint8)
    return cache


class Batch:
    """A random paged batch: per request ``(context, query_len)``, shuffled blocks, a
    NaN-filled index cache except for the written slots."""

    def __init__(self, reqs: list[tuple[int, int]], *, bs: int = 4, heads: int = 3, seed: int = 0,
                 keys: torch.Tensor | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.bs, self.reqs = bs, reqs
        need = [math.ceil(c / bs) for c, _ in reqs]
        width = max(need)
        total = sum(need) + 3
        perm = (torch.randperm(total - 1, generator=g) + 1).tolist()  # block 0 stays null
        self.table = torch.zeros(len(reqs), width, dtype=torch.int32)
        it = iter(perm)
        for b, n in enumerate(need):
            for j in range(n):
                self.table[b, j] = next(it)
        self.cache = _paged(total, bs, index_row_bytes(D), fill=math.nan)
        self.keys = [keys[b] if keys is not None else torch.randn(c, D, generator=g) for b, (c, _) in enumerate(reqs)]
        for b, (c, _) in enumerate(reqs):
            slots = torch.tensor([self.slot(b, p) for p in range(c)], dtype=torch.int64)
            write_index_cache(self.keys[b], self.cache, slots)
        self.seq_lens = torch.tensor([c for c, _ in reqs], dtype=torch.int32)
        qlens = [q for _, q in reqs]
        self.qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
        self.q = torch.randn(sum(qlens), heads, D, generator=g)
        self.w = torch.randn(sum(qlens), heads, generator=g)
        self.tokens = [(b, c - q + i) for b, (c, q) in enumerate(reqs) for i in range(q)]

    def slot(self, b: int, p: int) -> int:
        return int(self.table[b, p // self.bs]) * self.bs + p % self.bs

    def oracle_scores(self, t: int, window: int | None = None) -> dict[int, float]:
        b, p = self.tokens[t]
        k = dequantize_index_rows(quantize_index_keys(self.keys[b])).double()  # the stored keys
        lo = 0 if window is None else max(0, p - window + 1)
        out = {}
        for s in range(lo, p + 1):
            total = 0.0
            for j in range(self.q.shape[1]):
                dot = float(self.q[t, j].double() @ k[s])
                total += float(self.w[t, j]) * max(dot, 0.0)
            out[s] = total
        return out

    def logits(self, window: int | None = None) -> torch.Tensor:
        return indexer_logits(self.q, self.w, self.cache, query_start_loc=self.qsl, seq_lens=self.seq_lens,
                              block_table=self.table, max_seq_len=int(self.seq_lens.max()), window=window)

    def select(self, logits: torch.Tensor, topk: int, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return topk_select(logits, query_start_loc=self.qsl, seq_lens=self.seq_lens, block_table=self.table,
                           block_size=self.bs, topk=topk, window=window)


def oracle_topk(scores: dict[int, float], k: int) -> list[int]:
    """The documented rule: highest score first, ties to the earlier position; returned
    in ascending position order."""
    ranked = sorted(scores, key=lambda s: (-scores[s], s))
    return sorted(ranked[:k])


@pytest.mark.parametrize("window", [None, 5])
def test_indexer_logits_match_the_float64_oracle_over_shuffled_nan_filled_blocks(window: int | None) -> None:
    batch = Batch([(9, 1), (3, 3), (14, 5)])  # decode, whole prefill, chunked prefill
    got = batch.logits(window)
    assert got.shape == (len(batch.tokens), 14)
    assert got.dtype == torch.float32
    for t in range(len(batch.tokens)):
        want = batch.oracle_scores(t, window)
        for s in range(14):
            if s in want:
                assert abs(float(got[t, s]) - want[s]) <= 1e-4 * (1 + abs(want[s]))
            else:
                assert got[t, s] == -math.inf


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("topk", [1, 4, 7, 64])
def test_topk_matches_the_oracle_with_slots_and_padding(topk: int, window: int | None) -> None:
    batch = Batch([(9, 1), (3, 3), (14, 5), (1, 1)], seed=3)
    idx, lens = batch.select(batch.logits(window), topk, window)
    assert idx.shape == (len(batch.tokens), topk)
    assert idx.dtype == torch.int32
    assert lens.dtype == torch.int32
    for t, (b, _) in enumerate(batch.tokens):
        keep = oracle_topk(batch.oracle_scores(t, window), topk)
        want = [batch.slot(b, s) for s in keep] + [-1] * (topk - len(keep))
        assert idx[t].tolist() == want
        assert int(lens[t]) == len(keep)


def test_ties_go_to_the_earlier_position() -> None:
    # Every key equal: every visible score is the same number (a float dot may round
    # it by position, so the scores here are the same tensor entry repeated), and the
    # earliest positions are kept.
    same = torch.ones(10, D)
    batch = Batch([(10, 2)], keys=torch.stack([same]), seed=1)
    visible = batch.logits()
    tied = torch.where(torch.isfinite(visible), visible[:, :1], visible)
    idx, lens = batch.select(tied, 3)
    for t, (b, _p) in enumerate(batch.tokens):
        assert idx[t].tolist() == [batch.slot(b, s) for s in (0, 1, 2)]
        assert int(lens[t]) == 3
    # Hand-made logits: two tied scores straddling the cut.
    logits = torch.tensor([[1.0, 5.0, 3.0, 5.0, 3.0, 0.0, 3.0, -1.0, 0.0, 0.0]] * 2)
    idx, _ = batch.select(logits, 3)
    assert idx[0].tolist() == [batch.slot(0, s) for s in (1, 2, 3)]


def test_context_shorter_than_k_keeps_everything() -> None:
    batch = Batch([(5, 5)], seed=2)
    idx, lens = batch.select(batch.logits(), 8)
    for t, (b, p) in enumerate(batch.tokens):
        assert int(lens[t]) == p + 1
        assert idx[t].tolist() == [batch.slot(b, s) for s in range(p + 1)] + [-1] * (8 - p - 1)


def test_nan_visible_score_is_lowest() -> None:
    batch = Batch([(4, 1)])
    logits = torch.tensor([[2.0, math.nan, 1.0, 3.0]])
    idx, _ = batch.select(logits, 3)
    assert idx[0].tolist() == [batch.slot(0, s) for s in (0, 2, 3)]


def test_an_off_by_one_topk_is_caught() -> None:
    """Control: a selection that keeps one position too few (or sees one too far) does
    not pass the oracle comparison used above."""
    batch = Batch([(14, 5)], seed=5)
    logits = batch.logits()
    idx, _lens = batch.select(logits, 4)

    def agrees(got: torch.Tensor) -> bool:
        for t, (b, _) in enumerate(batch.tokens):
            keep = oracle_topk(batch.oracle_scores(t), 4)
            if got[t].tolist() != [batch.slot(b, s) for s in keep] + [-1] * (4 - len(keep)):
                return False
        return True

    assert agrees(idx)
    short, _ = batch.select(logits, 3)  # k - 1, padded to k
    padded = torch.cat([short, torch.full((short.shape[0], 1), -1, dtype=torch.int32)], dim=1)
    assert not agrees(padded)
    # A causal horizon one too far: each query also sees its successor.
    prefill = Batch([(6, 6)], seed=6)
    want = [[prefill.slot(0, s) for s in range(p + 1)] + [-1] * (8 - p - 1) for p in range(5)]
    good = prefill.select(prefill.logits(), 8)[0][:5]
    assert good.tolist() == want
    late_qsl, late_lens = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    late = indexer_logits(prefill.q[:5], prefill.w[:5], prefill.cache, query_start_loc=late_qsl,
                          seq_lens=late_lens, block_table=prefill.table, max_seq_len=6)
    broken = topk_select(late, query_start_loc=late_qsl, seq_lens=late_lens, block_table=prefill.table,
                         block_size=prefill.bs, topk=8)[0]
    assert broken.tolist() != want


def oracle_sparse_mla(q: torch.Tensor, latents: torch.Tensor, slots: list[int], rank: int, scale: float) -> torch.Tensor:
    heads = q.shape[0]
    out = torch.zeros(heads, rank, dtype=torch.float64)
    if not slots:
        return out
    for h in range(heads):
        logits = [float(q[h].double() @ latents[s].double()) * scale for s in slots]
        m = max(logits)
        ws = [math.exp(x - m) for x in logits]
        z = sum(ws)
        for w, s in zip(ws, slots, strict=False):
            out[h] += (w / z) * latents[s, :rank].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_mla_matches_the_oracle_and_ignores_padding_and_nan_slots(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    nb, bs, dim, rank, heads, k = 6, 4, 24, 16, 3, 5
    cache = torch.randn(nb, bs, dim).to(dtype)
    cache[0] = math.nan  # the null block and a stale slot: never selected
    cache[3, 2] = math.nan
    flat = cache.view(-1, dim)
    selections = [[5, 9, 17], [4, 5, 6, 7, 8], [], [21]]
    idx = torch.full((4, k), -1, dtype=torch.int32)
    for t, sel in enumerate(selections):
        idx[t, : len(sel)] = torch.tensor(sel, dtype=torch.int32)
    idx[3, 1] = 14  # past the valid count: not read (slot 14 is NaN)
    lens = torch.tensor([len(s) for s in selections], dtype=torch.int32)
    q = torch.randn(4, heads, dim).to(dtype)
    lse = torch.empty(4, heads)
    out = sparse_mla_attention(q, cache, idx, lens, kv_lora_rank=rank, scale=0.2, lse=lse)
    assert out.shape == (4, heads, rank)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for t, sel in enumerate(selections):
        want = oracle_sparse_mla(q[t], flat, sel, rank, 0.2)
        assert torch.allclose(out[t].double(), want, atol=tol, rtol=tol)
    assert bool(torch.isinf(lse[2]).all())
    assert bool(torch.isfinite(lse[[0, 1, 3]]).all())


def test_chunked_prefill_equals_one_prefill() -> None:
    """The same request prefilled in one step or in two chunks selects the same slots."""
    keys = torch.randn(1, 12, D)
    whole = Batch([(12, 12)], keys=keys, seed=7)
    first = Batch([(7, 7)], keys=keys[:, :7], seed=7)
    idx_whole, _ = whole.select(whole.logits(), 4)
    # Chunk 2 over the same cache and table as the whole prefill, its 5 last queries.
    logits2 = indexer_logits(whole.q[7:], whole.w[7:], whole.cache, query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
                             seq_lens=torch.tensor([12], dtype=torch.int32), block_table=whole.table, max_seq_len=12)
    idx2, _ = topk_select(logits2, query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
                          seq_lens=torch.tensor([12], dtype=torch.int32), block_table=whole.table,
                          block_size=whole.bs, topk=4)
    assert torch.equal(idx2, idx_whole[7:])
    assert first.logits().shape == (7, 7)


def test_write_matches_the_oracle_codec_bit_for_bit() -> None:
    """Scales from the oracle's power-of-two rule, values torch's e4m3 cast of x / scale."""
    torch.manual_seed(3)
    keys = torch.randn(6, 256) * torch.tensor([1e-3, 1.0, 7.0, 300.0, 448.0, 1e4])[:, None]
    keys[1] = 0.0
    keys[4, :128] = 448.0  # an exact power of two of 448: scale 1
    cache = _paged(2, 4, index_row_bytes(256))
    write_index_cache(keys, cache, torch.arange(6))
    rows = cache.view(-1, 264)[:6]
    for t in range(6):
        for blk in range(2):
            vals = keys[t, blk * 128 : (blk + 1) * 128].double().tolist()
            scaled, scale = oracle_quantize(vals)
            assert float(rows[t, 256 + 4 * blk : 260 + 4 * blk].view(torch.float32)) == scale
            want = torch.tensor(scaled, dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
            assert torch.equal(rows[t, blk * 128 : (blk + 1) * 128], want)


def test_write_skips_minus_one_slots() -> None:
    cache = _paged(2, 2, 132)
    before = cache.clone()
    write_index_cache(torch.randn(2, 1, D), cache, torch.tensor([-1, 3]))
    assert torch.equal(cache.view(-1, 132)[:3], before.view(-1, 132)[:3])
    assert not torch.equal(cache.view(-1, 132)[3], before.view(-1, 132)[3])
