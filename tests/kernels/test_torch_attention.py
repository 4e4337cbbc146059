"""Tests for the pure-torch reference attention (``attnkit.kernels.attention.reference``).

``dense_attention`` is checked against ``naive_attention`` below: an independent,
deliberately slow oracle with explicit Python loops over queries, heads and keys, float64
math and the mask rules written out one by one. ``paged_attention`` is checked against
``dense_attention`` on ragged batches whose blocks are scattered over a shuffled cache,
and against the naive oracle in a hypothesis test.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from attnkit.kernels.attention.reference import (
    dense_attention,
    gather_kv,
    paged_attention,
    write_kv_cache,
)

# atol = rtol for comparing an output of this dtype with a reference.
TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
# lse is always float32 and computed from the same (rounded) inputs as the reference.
LSE_TOLERANCE = 1e-5


def assert_close(actual: Tensor, expected: Tensor, tol: float) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol)


# --------------------------------------------------------------------------- naive oracle


def naive_visible(
    i: int, j: int, *, causal: bool, sliding_window: int | None, chunk_size: int | None
) -> bool:
    """May the query at position ``i`` see the key at position ``j``?"""
    if not causal:
        return True
    if j > i:
        return False
    if sliding_window is not None and i - j >= sliding_window:
        return False
    return not (chunk_size is not None and j // chunk_size != i // chunk_size)


def naive_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scale: float,
    causal: bool = True,
    q_positions: list[int] | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Loop-by-loop float64 attention: returns (out [Tq, Hq, D], lse [Tq, Hq])."""
    q = query.double().tolist()
    k = key.double().tolist()
    v = value.double().tolist()
    num_queries, num_q_heads, head_size = query.shape
    num_keys, num_kv_heads, _ = key.shape
    group = num_q_heads // num_kv_heads
    positions = (
        list(range(num_keys - num_queries, num_keys)) if q_positions is None else q_positions
    )
    slopes = None if alibi_slopes is None else alibi_slopes.double().tolist()
    sink_logits = None if sinks is None else sinks.double().tolist()

    out = [[[0.0] * head_size for _ in range(num_q_heads)] for _ in range(num_queries)]
    lse = [[-math.inf] * num_q_heads for _ in range(num_queries)]
    for t in range(num_queries):
        i = positions[t]
        for h in range(num_q_heads):
            kv_head = h // group
            logits: list[float] = []
            values: list[list[float]] = []
            for j in range(num_keys):
                if not naive_visible(
                    i, j, causal=causal, sliding_window=sliding_window, chunk_size=chunk_size
                ):
                    continue
                s = scale * sum(q[t][h][x] * k[j][kv_head][x] for x in range(head_size))
                if logits_soft_cap is not None:
                    s = logits_soft_cap * math.tanh(s / logits_soft_cap)
                if slopes is not None:
                    s += slopes[h] * (j - i)
                logits.append(s)
                values.append(v[j][kv_head])
            denominator_logits = logits + ([sink_logits[h]] if sink_logits is not None else [])
            if not denominator_logits:
                continue  # sees nothing: output 0, lse -inf
            m = max(denominator_logits)
            denom = sum(math.exp(s - m) for s in denominator_logits)
            for x in range(head_size):
                out[t][h][x] = (
                    sum(math.exp(s - m) * val[x] for s, val in zip(logits, values, strict=True))
                    / denom
                )
            lse[t][h] = m + math.log(denom)
    return (
        torch.tensor(out, dtype=torch.float64).reshape(num_queries, num_q_heads, head_size),
        torch.tensor(lse, dtype=torch.float64).reshape(num_queries, num_q_heads),
    )


# --------------------------------------------------------------------------- dense vs naive


@dataclass(frozen=True)
class DenseCase:
    num_queries: int
    num_keys: int
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 8
    query_gain: float = 1.0  # multiplies the random queries: large gain -> large logits
    options: dict[str, Any] = field(default_factory=dict)
    q_positions: list[int] | None = None


DENSE_CASES = [
    pytest.param(DenseCase(8, 8), id="causal-prefill-Tq8-Tk8"),
    pytest.param(DenseCase(3, 10), id="causal-chunked-prefill-Tq3-Tk10"),
    pytest.param(DenseCase(1, 12), id="decode-Tq1-Tk12"),
    pytest.param(DenseCase(6, 6, options={"causal": False}), id="bidirectional-Tq6-Tk6"),
    pytest.param(DenseCase(7, 4, options={"causal": False}), id="cross-Tq7-Tk4"),
    pytest.param(DenseCase(8, 8, options={"sliding_window": 1}), id="window-W1"),
    pytest.param(DenseCase(5, 11, options={"sliding_window": 3}), id="window-W3"),
    pytest.param(DenseCase(6, 9, options={"sliding_window": 100}), id="window-W-over-seq"),
    pytest.param(DenseCase(10, 10, options={"chunk_size": 4}), id="chunked-local-C4"),
    pytest.param(DenseCase(1, 11, options={"chunk_size": 3}), id="chunked-local-C3-decode"),
    pytest.param(
        DenseCase(6, 9, query_gain=40.0, options={"logits_soft_cap": 5.0}),
        id="softcap-large-logits",
    ),
    pytest.param(DenseCase(6, 9, options={"alibi": True}), id="alibi"),
    pytest.param(DenseCase(5, 5, options={"alibi": True, "causal": False}), id="alibi-bidir"),
    pytest.param(DenseCase(6, 9, options={"sinks": True}), id="sinks"),
    pytest.param(DenseCase(6, 9, options={"sinks": True, "sliding_window": 2}), id="sinks-W2"),
    pytest.param(DenseCase(5, 7, num_q_heads=6, num_kv_heads=2), id="gqa-Hq6-Hkv2"),
    pytest.param(DenseCase(5, 7, num_q_heads=4, num_kv_heads=1), id="mqa-Hq4-Hkv1"),
    pytest.param(DenseCase(4, 6, num_q_heads=3, num_kv_heads=3), id="mha-Hq3"),
    pytest.param(
        DenseCase(
            7,
            13,
            num_q_heads=6,
            num_kv_heads=2,
            query_gain=5.0,
            options={"logits_soft_cap": 8.0, "alibi": True, "sinks": True, "sliding_window": 4},
        ),
        id="all-features-gqa-window",
    ),
    pytest.param(
        DenseCase(4, 12, options={"chunk_size": 5, "alibi": True}, q_positions=[2, 5, 9, 11]),
        id="explicit-q-positions",
    ),
]


def make_dense_inputs(case: DenseCase, dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen)

    options = dict(case.options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(case.num_q_heads, generator=gen) + 0.1
    if options.pop("sinks", False):
        options["sinks"] = 2.0 * randn(case.num_q_heads)
    return {
        "query": (case.query_gain * randn(case.num_queries, case.num_q_heads, case.head_size)).to(
            dtype
        ),
        "key": randn(case.num_keys, case.num_kv_heads, case.head_size).to(dtype),
        "value": randn(case.num_keys, case.num_kv_heads, case.head_size).to(dtype),
        "scale": case.head_size**-0.5,
        **options,
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DENSE_CASES)
def test_dense_matches_naive(case: DenseCase, dtype: torch.dtype) -> None:
    inputs = make_dense_inputs(case, dtype)
    positions = None if case.q_positions is None else torch.tensor(case.q_positions)
    out, lse = dense_attention(**inputs, q_positions=positions, return_lse=True)
    expected_out, expected_lse = naive_attention(**inputs, q_positions=case.q_positions)
    assert out.dtype == dtype
    assert out.shape == (case.num_queries, case.num_q_heads, case.head_size)
    assert lse.dtype == torch.float32
    assert lse.shape == (case.num_queries, case.num_q_heads)
    assert_close(out, expected_out, TOLERANCE[dtype])
    assert_close(lse, expected_lse, LSE_TOLERANCE)
    # Without return_lse the same output comes back alone.
    assert torch.equal(dense_attention(**inputs, q_positions=positions), out)


def test_dense_softcap_saturates() -> None:
    """With huge logits the capped scores stay within [-cap, cap]: lse <= cap + log(Tk)."""
    inputs = make_dense_inputs(DenseCase(4, 6, query_gain=1e4), torch.float32)
    _, lse = dense_attention(**inputs, logits_soft_cap=3.0, causal=False, return_lse=True)
    assert torch.isfinite(lse).all()
    assert (lse <= 3.0 + math.log(6) + 1e-5).all()


def test_dense_rows_without_keys() -> None:
    """A query that sees no key gets output 0 and lse -inf (or the sink logit with sinks)."""
    inputs = make_dense_inputs(DenseCase(2, 4), torch.float32)
    positions = torch.tensor([-1, 0])  # position -1 precedes every key
    out, lse = dense_attention(**inputs, q_positions=positions, return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(lse[0], torch.full_like(lse[0], -math.inf))
    assert torch.isfinite(lse[1]).all()

    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, lse = dense_attention(**inputs, q_positions=positions, sinks=sinks, return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(lse[0], sinks)

    empty = torch.empty(0, 2, 8)
    out, lse = dense_attention(inputs["query"], empty, empty, scale=1.0, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, -math.inf))


def test_dense_sinks_absorb_mass() -> None:
    """A very large sink takes (almost) all the probability mass: output -> 0."""
    inputs = make_dense_inputs(DenseCase(3, 5), torch.float32)
    out = dense_attention(**inputs, sinks=torch.full((4,), 60.0))
    assert out.abs().max() < 1e-20


# --------------------------------------------------------------------------- paged batches


@dataclass
class PagedBatch:
    query: Tensor  # [T, Hq, D]; the last rows past query_start_loc[-1] are padding
    kv_cache: Tensor
    query_start_loc: Tensor
    seq_lens: Tensor
    block_table: Tensor
    keys: list[Tensor]  # each request's whole context, [seq_len, Hkv, D], in the cache dtype
    values: list[Tensor]

    def kernel_args(self) -> dict[str, Any]:
        return {
            "kv_cache": self.kv_cache,
            "query_start_loc": self.query_start_loc,
            "seq_lens": self.seq_lens,
            "block_table": self.block_table,
        }


def slot_of(block_table: Tensor, b: int, position: int, block_size: int) -> int:
    return int(block_table[b, position // block_size]) * block_size + position % block_size


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    num_padding_tokens: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    seed: int = 0,
) -> PagedBatch:
    """Scatter each request's context over a shuffled cache and write it as an engine would.

    The cache starts full of NaN (any stray read poisons the output), block 0 is never
    handed out, physical blocks are a random permutation, and unused block-table entries
    hold an out-of-range id (reading one raises). The cached prefix is written in one
    ``write_kv_cache`` call, this step's tokens (plus padding slots -1) in a second one.
    """
    assert len(q_lens) == len(seq_lens)
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(seq_lens)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_needed) + 3  # null block + used + a few spare
    free_blocks = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    unused_id = num_blocks + 1000
    block_table = torch.full((num_reqs, max([*blocks_needed, 1]) + 1), unused_id, dtype=torch.int32)
    for b, n in enumerate(blocks_needed):
        for i in range(n):
            block_table[b, i] = free_blocks.pop()

    kv_cache = torch.full(
        (num_blocks, 2, block_size, num_kv_heads, head_size), math.nan, dtype=dtype
    )
    keys = [torch.randn(s, num_kv_heads, head_size, generator=gen).to(dtype) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_size, generator=gen).to(dtype) for s in seq_lens]

    def write(positions: list[range], num_padding: int) -> None:
        slots = [
            slot_of(block_table, b, p, block_size) for b, ps in enumerate(positions) for p in ps
        ]
        new_k = [keys[b][ps.start : ps.stop] for b, ps in enumerate(positions)]
        new_v = [values[b][ps.start : ps.stop] for b, ps in enumerate(positions)]
        pad = torch.randn(num_padding, num_kv_heads, head_size, generator=gen).to(dtype)
        write_kv_cache(
            torch.cat([*new_k, pad]),
            torch.cat([*new_v, pad]),
            kv_cache,
            torch.tensor(slots + [-1] * num_padding, dtype=torch.int64),
            k_scale=k_scale,
            v_scale=v_scale,
        )

    write([range(0, s - q) for q, s in zip(q_lens, seq_lens, strict=True)], 0)  # earlier steps
    write(
        [range(s - q, s) for q, s in zip(q_lens, seq_lens, strict=True)], num_padding_tokens
    )  # this step

    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    num_tokens = starts[-1] + num_padding_tokens
    return PagedBatch(
        query=torch.randn(num_tokens, num_q_heads, head_size, generator=gen).to(dtype),
        kv_cache=kv_cache,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        keys=keys,
        values=values,
    )


def dense_reference(batch: PagedBatch, **options: Any) -> tuple[Tensor, Tensor]:
    """Per-request dense_attention on the uncached contexts; padding rows 0 / -inf."""
    num_tokens, num_q_heads, head_size = batch.query.shape
    out = torch.zeros(num_tokens, num_q_heads, head_size, dtype=torch.float64)
    lse = torch.full((num_tokens, num_q_heads), -math.inf, dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    for b in range(len(batch.keys)):
        rows = slice(starts[b], starts[b + 1])
        if rows.start == rows.stop:
            continue
        out_b, lse_b = dense_attention(
            batch.query[rows], batch.keys[b], batch.values[b], return_lse=True, **options
        )
        out[rows], lse[rows] = out_b.double(), lse_b.double()
    return out, lse


PAGED_LAYOUTS = [
    # q_lens, seq_lens, Hq, Hkv, D, block_size
    pytest.param([1, 1, 1, 1], [17, 1, 64, 40], 4, 4, 64, 16, id="decode-B4-H4-D64-bs16"),
    pytest.param([1, 1, 1], [33, 95, 2], 8, 2, 64, 32, id="decode-B3-H8kv2-D64-bs32"),
    pytest.param([9, 16, 33], [9, 16, 33], 4, 2, 32, 16, id="prefill-B3-H4kv2-D32-bs16"),
    pytest.param([5, 20, 3], [40, 70, 64], 8, 2, 32, 32, id="chunked-prefill-B3-H8kv2-D32-bs32"),
    pytest.param([1, 12, 0, 7, 1], [30, 12, 20, 50, 1], 8, 2, 64, 16, id="mixed-B5-H8kv2-D64-bs16"),
    pytest.param([1, 24, 6, 1], [65, 24, 47, 32], 4, 1, 64, 32, id="mixed-mqa-B4-H4kv1-D64-bs32"),
    pytest.param(
        [3, 16, 1, 17, 2], [15, 16, 17, 32, 33], 4, 2, 16, 16, id="block-edges-B5-H4kv2-D16-bs16"
    ),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("q_lens", "seq_lens", "num_q_heads", "num_kv_heads", "head_size", "block_size"),
    PAGED_LAYOUTS,
)
def test_paged_matches_dense(
    q_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
) -> None:
    batch = make_paged_batch(
        q_lens,
        seq_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        num_padding_tokens=3,
    )
    scale = head_size**-0.5
    output = torch.full_like(batch.query, math.nan)
    out, lse = paged_attention(
        batch.query, **batch.kernel_args(), scale=scale, output=output, return_lse=True
    )
    assert out is output
    assert not out.isnan().any()
    assert lse.dtype == torch.float32
    assert lse.shape == batch.query.shape[:2]
    expected_out, expected_lse = dense_reference(batch, scale=scale)
    assert_close(out, expected_out, TOLERANCE[dtype])
    assert_close(lse, expected_lse, LSE_TOLERANCE)
    # Padding rows: zero output, -inf lse.
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))
    assert torch.isneginf(lse[-3:]).all()
    # Allocating the output gives the same result.
    assert torch.equal(paged_attention(batch.query, **batch.kernel_args(), scale=scale), out)


PAGED_OPTIONS = [
    pytest.param({"causal": False}, id="bidirectional"),
    pytest.param({"sliding_window": 1}, id="window-W1"),
    pytest.param({"sliding_window": 7}, id="window-W7"),
    pytest.param({"sliding_window": 1000}, id="window-W-over-seq"),
    pytest.param({"chunk_size": 8}, id="chunked-local-C8"),
    pytest.param({"logits_soft_cap": 2.0}, id="softcap"),
    pytest.param({"alibi": True}, id="alibi"),
    pytest.param({"sinks": True}, id="sinks"),
    pytest.param(
        {"alibi": True, "sinks": True, "logits_soft_cap": 4.0, "sliding_window": 9}, id="combined"
    ),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", PAGED_OPTIONS)
def test_paged_options_match_dense(options: dict[str, Any], dtype: torch.dtype) -> None:
    batch = make_paged_batch(
        [1, 10, 4, 1],
        [26, 10, 35, 9],
        num_q_heads=6,
        num_kv_heads=2,
        head_size=32,
        block_size=16,
        dtype=dtype,
        seed=1,
    )
    gen = torch.Generator().manual_seed(2)
    options = dict(options, scale=32**-0.5)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(6, generator=gen)
    if options.pop("sinks", False):
        options["sinks"] = torch.randn(6, generator=gen)
    output = torch.full_like(batch.query, math.nan)
    out, lse = paged_attention(
        batch.query, **batch.kernel_args(), output=output, return_lse=True, **options
    )
    assert not out.isnan().any()
    expected_out, expected_lse = dense_reference(batch, **options)
    assert_close(out, expected_out, TOLERANCE[dtype])
    assert_close(lse, expected_lse, LSE_TOLERANCE)


def test_paged_kv_scales() -> None:
    """k_scale/v_scale undo the division done by write_kv_cache (exact for powers of two)."""
    batch = make_paged_batch(
        [1, 6],
        [20, 6],
        num_q_heads=4,
        num_kv_heads=2,
        head_size=16,
        block_size=16,
        k_scale=4.0,
        v_scale=0.5,
    )
    assert torch.equal(gather_kv(batch.kv_cache, batch.block_table[0], 20)[0], batch.keys[0] / 4)
    out = paged_attention(batch.query, **batch.kernel_args(), scale=0.25, k_scale=4.0, v_scale=0.5)
    expected_out, _ = dense_reference(batch, scale=0.25)
    assert_close(out, expected_out, TOLERANCE[torch.float32])


def test_paged_matches_naive() -> None:
    """The whole paged path against the independent oracle, not only against dense."""
    batch = make_paged_batch(
        [1, 5, 3],
        [9, 5, 11],
        num_q_heads=4,
        num_kv_heads=2,
        head_size=8,
        block_size=4,
        num_padding_tokens=1,
    )
    out = paged_attention(batch.query, **batch.kernel_args(), scale=0.3, sliding_window=6)
    starts = batch.query_start_loc.tolist()
    for b in range(3):
        rows = slice(starts[b], starts[b + 1])
        expected, _ = naive_attention(
            batch.query[rows], batch.keys[b], batch.values[b], scale=0.3, sliding_window=6
        )
        assert_close(out[rows], expected, TOLERANCE[torch.float32])


def test_gather_kv_reads_the_context() -> None:
    batch = make_paged_batch(
        [2, 1], [35, 4], num_q_heads=2, num_kv_heads=2, head_size=4, block_size=8
    )
    for b, seq_len in enumerate([35, 4]):
        key, value = gather_kv(batch.kv_cache, batch.block_table[b], seq_len)
        assert torch.equal(key, batch.keys[b])
        assert torch.equal(value, batch.values[b])


# --------------------------------------------------------------------------- hypothesis


@st.composite
def ragged_configs(draw: st.DrawFn) -> dict[str, Any]:
    num_kv_heads = draw(st.sampled_from([1, 2]))
    num_q_heads = num_kv_heads * draw(st.sampled_from([1, 2]))
    seq_lens = draw(st.lists(st.integers(1, 14), min_size=1, max_size=3))
    q_lens = [draw(st.integers(0, s)) for s in seq_lens]
    causal = draw(st.booleans())
    mask = draw(st.sampled_from(["none", "window", "chunk"])) if causal else "none"
    return {
        "q_lens": q_lens,
        "seq_lens": seq_lens,
        "num_q_heads": num_q_heads,
        "num_kv_heads": num_kv_heads,
        "head_size": draw(st.sampled_from([4, 8])),
        "block_size": draw(st.sampled_from([1, 4, 16])),
        "num_padding_tokens": draw(st.integers(0, 2)),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "causal": causal,
        "sliding_window": draw(st.integers(1, 16)) if mask == "window" else None,
        "chunk_size": draw(st.integers(1, 8)) if mask == "chunk" else None,
        "logits_soft_cap": draw(st.none() | st.floats(0.5, 30.0)),
        "alibi": draw(st.booleans()),
        "sinks": draw(st.booleans()),
    }


@settings(max_examples=40, deadline=None, database=None)
@given(config=ragged_configs())
def test_paged_matches_naive_hypothesis(config: dict[str, Any]) -> None:
    layout_keys = ("q_lens", "seq_lens", "num_q_heads", "num_kv_heads", "head_size")
    batch = make_paged_batch(
        *(config[k] for k in ("q_lens", "seq_lens")),
        **{k: config[k] for k in layout_keys[2:]},
        block_size=config["block_size"],
        num_padding_tokens=config["num_padding_tokens"],
        seed=config["seed"],
    )
    gen = torch.Generator().manual_seed(config["seed"])
    num_q_heads = config["num_q_heads"]
    options: dict[str, Any] = {
        "scale": config["head_size"] ** -0.5,
        "causal": config["causal"],
        "sliding_window": config["sliding_window"],
        "chunk_size": config["chunk_size"],
        "logits_soft_cap": config["logits_soft_cap"],
        "alibi_slopes": torch.rand(num_q_heads, generator=gen) if config["alibi"] else None,
        "sinks": torch.randn(num_q_heads, generator=gen) if config["sinks"] else None,
    }
    output = torch.full_like(batch.query, math.nan)
    out, lse = paged_attention(
        batch.query, **batch.kernel_args(), output=output, return_lse=True, **options
    )
    assert not out.isnan().any()
    starts = batch.query_start_loc.tolist()
    for b in range(len(batch.keys)):
        rows = slice(starts[b], starts[b + 1])
        expected_out, expected_lse = naive_attention(
            batch.query[rows], batch.keys[b], batch.values[b], **options
        )
        assert_close(out[rows], expected_out, TOLERANCE[torch.float32])
        assert_close(lse[rows], expected_lse, LSE_TOLERANCE)
    assert torch.equal(out[starts[-1] :], torch.zeros_like(out[starts[-1] :]))


# --------------------------------------------------------------------------- write_kv_cache


def test_write_kv_cache_skips_padding_and_scales() -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.full((4, 2, 8, 2, 4), 7.0)
    key = torch.randn(4, 2, 4, generator=gen)
    value = torch.randn(4, 2, 4, generator=gen)
    slots = torch.tensor([9, -1, 31, 0], dtype=torch.int64)
    write_kv_cache(key, value, cache, slots, k_scale=2.0, v_scale=0.25)
    expected = torch.full_like(cache, 7.0)
    for t, slot in enumerate(slots.tolist()):
        if slot != -1:
            expected[slot // 8, 0, slot % 8] = key[t] / 2.0
            expected[slot // 8, 1, slot % 8] = value[t] / 0.25
    assert torch.equal(cache, expected)


def test_write_kv_cache_casts_to_cache_dtype() -> None:
    cache = torch.zeros(2, 2, 4, 1, 4, dtype=torch.bfloat16)
    key = torch.randn(1, 1, 4)
    write_kv_cache(key, key, cache, torch.tensor([5]))
    assert torch.equal(cache[1, 0, 1], key[0].to(torch.bfloat16))


WRITE_ERRORS = [
    pytest.param(
        {"slot_mapping": torch.tensor([0, 1, 2], dtype=torch.int32)},
        r"slot_mapping must be int64 of shape \[T\]=\[3\], got torch.int32 \[3\]",
        id="slots-int32",
    ),
    pytest.param(
        {"slot_mapping": torch.tensor([0, 1, 16])},
        r"slot_mapping entries must be -1 or in \[0, NB\*BS\)=\[0, 16\), got values in \[0, 16\]",
        id="slot-out-of-range",
    ),
    pytest.param(
        {"slot_mapping": torch.tensor([0, -2, 1])},
        r"got values in \[-2, 1\]",
        id="slot-negative",
    ),
    pytest.param(
        {"key": torch.zeros(3, 2, 8)},
        r"key must have shape \[T, Hkv, D\]=\[T, 2, 4\] to match kv_cache, got torch.float32 \[3, 2, 8\]",
        id="key-head-size",
    ),
    pytest.param(
        {"value": torch.zeros(2, 2, 4)},
        r"value must have the shape of key \[3, 2, 4\], got torch.float32 \[2, 2, 4\]",
        id="value-shape",
    ),
    pytest.param(
        {"kv_cache": torch.zeros(4, 3, 4, 2, 4)},
        r"kv_cache must have shape \[NB, 2, BS, Hkv, D\], got torch.float32 \[4, 3, 4, 2, 4\]",
        id="cache-not-kv",
    ),
]


@pytest.mark.parametrize(("overrides", "match"), WRITE_ERRORS)
def test_write_kv_cache_errors(overrides: dict[str, Tensor], match: str) -> None:
    args: dict[str, Any] = {
        "key": torch.zeros(3, 2, 4),
        "value": torch.zeros(3, 2, 4),
        "kv_cache": torch.zeros(4, 2, 4, 2, 4),
        "slot_mapping": torch.tensor([0, 1, 2]),
    }
    args.update(overrides)
    with pytest.raises(ValueError, match=match):
        write_kv_cache(**args)


# --------------------------------------------------------------------------- error paths


def valid_paged_call() -> dict[str, Any]:
    """Keyword arguments of a valid paged_attention call: seq_lens [5, 20, 70], bs 16."""
    batch = make_paged_batch(
        [1, 4, 2], [5, 20, 70], num_q_heads=4, num_kv_heads=2, head_size=8, block_size=16
    )
    return {"query": batch.query, **batch.kernel_args(), "scale": 1.0}


Mutation = Callable[[dict[str, Any]], None]


def _set(**values: Any) -> Mutation:
    return lambda call: call.update(values)


def _apply(name: str, fn: Callable[[Tensor], Tensor]) -> Mutation:
    return lambda call: call.update({name: fn(call[name])})


PAGED_ERRORS = [
    pytest.param(
        _apply("query_start_loc", lambda t: t.long()),
        r"query_start_loc: expected dtype torch.int32, got torch.int64",
        id="qsl-int64",
    ),
    pytest.param(
        _apply("query_start_loc", lambda t: t[:3]),
        r"query_start_loc: expected shape [4], got (3,)",
        id="qsl-length",
    ),
    pytest.param(
        _apply("seq_lens", lambda t: t.long()),
        r"seq_lens: expected dtype torch.int32, got torch.int64",
        id="seq-lens-int64",
    ),
    pytest.param(
        _apply("block_table", lambda t: t.long()),
        r"block_table: expected dtype torch.int32, got torch.int64",
        id="block-table-int64",
    ),
    pytest.param(
        _apply("block_table", lambda t: t[:2]),
        r"block_table: expected shape [3, *], got (2, 6)",
        id="block-table-rows",
    ),
    pytest.param(
        _apply("block_table", lambda t: t[:, :3]),
        r"block_table[2] has 3 blocks but seq_lens[2]=70 needs 5 with block_size=16",
        id="block-table-too-short",
    ),
    pytest.param(
        _apply("block_table", lambda t: t.index_fill(1, torch.tensor([1]), 99)),
        r"block_table[1, 1]=99 is not a physical block index in [0, NB)=[0, 12)",
        id="block-id-out-of-range",
    ),
    pytest.param(
        _apply("block_table", lambda t: t.index_fill(1, torch.tensor([4]), -1)),
        r"block_table[2, 4]=-1 is not a physical block index",
        id="block-id-negative",
    ),
    pytest.param(
        _apply("query", lambda t: t[:, :3]),
        r"kv_cache: expected a kv head count dividing the 3 query heads, got 2",
        id="heads-not-multiple",
    ),
    pytest.param(
        _apply("query", lambda t: t[..., :4]),
        r"kv_cache: expected head size 4 (the query head size), got 8",
        id="head-size-differs",
    ),
    pytest.param(
        _apply("query", lambda t: t[0]),
        r"query: expected shape [T, Hq, D], got (4, 8)",
        id="query-rank",
    ),
    pytest.param(
        _apply("kv_cache", lambda t: t[:, 0]),
        r"kv_cache: expected shape [NB, 2, BS, Hkv, D], got (12, 16, 2, 8)",
        id="cache-rank",
    ),
    pytest.param(
        _set(seq_lens=torch.tensor([5, 3, 70], dtype=torch.int32)),
        r"request 1 has q_len=4 query tokens but seq_lens[1]=3",
        id="q-len-over-seq-len",
    ),
    pytest.param(
        _set(seq_lens=torch.tensor([5, 20, -1], dtype=torch.int32)),
        r"seq_lens[2] must be >= 0, got -1",
        id="seq-len-negative",
    ),
    pytest.param(
        _set(query_start_loc=torch.tensor([1, 1, 5, 7], dtype=torch.int32)),
        r"query_start_loc[0] must be 0, got 1",
        id="qsl-start",
    ),
    pytest.param(
        _set(query_start_loc=torch.tensor([0, 3, 2, 7], dtype=torch.int32)),
        r"query_start_loc must be non-decreasing, got query_start_loc[1]=3 > query_start_loc[2]=2",
        id="qsl-decreasing",
    ),
    pytest.param(
        _set(query_start_loc=torch.tensor([0, 1, 5, 8], dtype=torch.int32)),
        r"query_start_loc[3]=8 exceeds the number of query tokens T=7",
        id="qsl-past-T",
    ),
    pytest.param(
        lambda call: call.update(output=torch.empty(7, 4, 8, dtype=torch.float16)),
        r"output must match query (torch.float32 [7, 4, 8] on cpu), got torch.float16 [7, 4, 8]",
        id="output-dtype",
    ),
    pytest.param(
        lambda call: call.update(output=torch.empty(6, 4, 8)),
        r"output must match query (torch.float32 [7, 4, 8] on cpu), got torch.float32 [6, 4, 8]",
        id="output-shape",
    ),
    pytest.param(
        _set(causal=False, sliding_window=4),
        r"sliding_window: expected None with causal=False",
        id="window-not-causal",
    ),
    pytest.param(
        _set(causal=False, chunk_size=4),
        r"chunk_size: expected None with causal=False",
        id="chunk-not-causal",
    ),
    pytest.param(
        _set(sliding_window=4, chunk_size=8),
        r"sliding_window, chunk_size: expected at most one of them, got sliding_window=4 and "
        r"chunk_size=8",
        id="window-and-chunk",
    ),
    pytest.param(
        _set(sliding_window=0),
        r"sliding_window: expected an int >= 1, got 0",
        id="window-zero",
    ),
    pytest.param(_set(chunk_size=0), r"chunk_size: expected an int >= 1, got 0", id="chunk-zero"),
    pytest.param(
        _set(logits_soft_cap=0.0),
        r"logits_soft_cap: expected a finite float > 0 or None, got 0.0",
        id="softcap-zero",
    ),
    pytest.param(
        _set(alibi_slopes=torch.zeros(2)),
        r"alibi_slopes: expected shape [4], got [2]",
        id="alibi-shape",
    ),
    pytest.param(
        _set(sinks=torch.zeros(4, dtype=torch.int64)),
        r"sinks: expected dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64), "
        r"got torch.int64",
        id="sinks-dtype",
    ),
]


@pytest.mark.parametrize(("mutate", "message"), PAGED_ERRORS)
def test_paged_attention_errors(mutate: Mutation, message: str) -> None:
    call = valid_paged_call()
    paged_attention(**call)  # the unmodified call is valid
    mutate(call)
    with pytest.raises(ValueError, match=re.escape(message)):
        paged_attention(**call)


DENSE_ERRORS = [
    pytest.param(
        {"query": torch.zeros(4, 8)},
        r"query must have shape [Tq, Hq, D], got torch.float32 [4, 8]",
        id="query-rank",
    ),
    pytest.param(
        {"key": torch.zeros(5, 8)},
        r"key must have shape [Tk, Hkv, D], got torch.float32 [5, 8]",
        id="key-rank",
    ),
    pytest.param(
        {"value": torch.zeros(6, 2, 8)},
        r"value must have the shape of key [5, 2, 8], got torch.float32 [6, 2, 8]",
        id="value-shape",
    ),
    pytest.param(
        {"key": torch.zeros(5, 2, 4), "value": torch.zeros(5, 2, 4)},
        r"head sizes differ: query has D=8 but key has D=4",
        id="head-size",
    ),
    pytest.param(
        {"key": torch.zeros(5, 3, 8), "value": torch.zeros(5, 3, 8)},
        r"query heads Hq=4 must be a multiple of kv heads Hkv=3",
        id="heads-not-multiple",
    ),
    pytest.param(
        {"q_positions": torch.tensor([0.0, 1.0, 2.0])},
        r"q_positions must be an integer tensor of shape [Tq]=[3], got torch.float32 [3]",
        id="positions-float",
    ),
    pytest.param(
        {"q_positions": torch.tensor([0, 1])},
        r"q_positions must be an integer tensor of shape [Tq]=[3], got torch.int64 [2]",
        id="positions-length",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), DENSE_ERRORS)
def test_dense_attention_errors(overrides: dict[str, Tensor], message: str) -> None:
    args: dict[str, Any] = {
        "query": torch.zeros(3, 4, 8),
        "key": torch.zeros(5, 2, 8),
        "value": torch.zeros(5, 2, 8),
        "scale": 1.0,
    }
    dense_attention(**args)  # the unmodified call is valid
    args.update(overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        dense_attention(**args)
