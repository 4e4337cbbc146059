"""Tests for the CPU prefill engine (``attnkit.kernels.attention.cpu_prefill.paged_prefill``).

Every case is checked against ``oracle`` below: float64, one query row at a time, with the
visibility rule written out per key position, reading only the keys the row can see. The
engine's inputs hide everything else: plane slots and key/value rows outside the keys some
query of the request can see hold NaN, block-table entries the engine must not read hold
-1, and output rows not served hold a sentinel that must survive.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from attnkit.kernels.attention.cpu_prefill import paged_prefill

TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}
SENTINEL = 7.25


# --------------------------------------------------------------------------- oracle


def visible(qp: int, p: int, seq: int, causal: bool, window: int | None, chunk: int | None) -> bool:
    if p < 0 or p >= seq:
        return False
    if not causal:
        return True
    if p > qp:
        return False
    if window is not None and qp - p >= window:
        return False
    return not (chunk is not None and p // chunk != qp // chunk)


def oracle(
    q: Tensor,  # [L, Hq, D] float64
    k: Tensor,  # [seq, Hkv, D] float64 (NaN where no query of the request looks)
    v: Tensor,
    seq: int,
    *,
    causal: bool,
    window: int | None,
    chunk: int | None,
    scale: float,
    soft_cap: float | None,
    slopes: Tensor | None,
    sinks: Tensor | None = None,
    lse: Tensor | None = None,
) -> Tensor:
    """``[L, Hq, D]``; ``lse`` (``[L, Hq]`` float64) receives the log-sum-exp, a sink
    logit per head (``sinks``) included."""
    length, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    out = torch.zeros(length, hq, d, dtype=torch.float64)
    for t in range(length):
        qp = seq - length + t
        keys = [p for p in range(seq) if visible(qp, p, seq, causal, window, chunk)]
        if not keys:
            if lse is not None:
                lse[t] = -math.inf if sinks is None else sinks.double()
            continue
        for h in range(hq):
            kh = k[keys, h // group]  # [n, D]
            vh = v[keys, h // group]
            s = (kh @ q[t, h]) * scale
            if soft_cap is not None:
                s = soft_cap * torch.tanh(s / soft_cap)
            if slopes is not None:
                s = s + float(slopes[h]) * (torch.tensor(keys, dtype=torch.float64) - qp)
            if sinks is not None:  # one more logit, with no value
                s = torch.cat([s, sinks[h : h + 1].double()])
                vh = torch.cat([vh, torch.zeros(1, d, dtype=torch.float64)])
            if lse is not None:
                lse[t, h] = torch.logsumexp(s, 0)
            w = torch.softmax(s, 0)
            out[t, h] = w @ vh
    return out


# --------------------------------------------------------------------------- harness


@dataclass
class Req:
    qlen: int
    seq: int
    # The engine gets key/value (a fresh prompt, seq == qlen); when any request of a case
    # has it, key/value are passed and every request with seq == qlen reads them.
    from_key: bool = False


@dataclass
class Case:
    reqs: list[Req]
    hq: int = 4
    hkv: int = 2
    d: int = 16
    block_size: int = 4
    causal: bool = True
    window: int | None = None
    chunk: int | None = None
    soft_cap: float | None = None
    alibi: bool = False
    dtype: torch.dtype = torch.float32
    sinks: bool = False
    with_lse: bool = False
    threads: int | None = None
    kwargs: dict[str, Any] = field(default_factory=dict[str, Any])


def first_visible(req: Req, c: Case) -> int:
    """Lowest key position some query of the request sees."""
    if not c.causal:
        return 0
    qp0 = req.seq - req.qlen
    if c.window is not None:
        return max(0, qp0 - c.window + 1)
    if c.chunk is not None:
        return (qp0 // c.chunk) * c.chunk
    return 0


def build(c: Case, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    n = len(c.reqs)
    bs = c.block_size
    # Query rows: one padding row before each request and two at the end.
    starts: list[int] = []
    row = 0
    for r in c.reqs:
        row += 1
        starts.append(row)
        row += r.qlen
    total = row + 2
    q = torch.randn(total, c.hq, c.d, generator=gen, dtype=torch.float64)
    key = torch.full((total, c.hkv, c.d), math.nan, dtype=torch.float64)
    value = key.clone()
    width = max([-(-r.seq // bs) for r in c.reqs] + [1]) + 1
    n_blocks = sum(-(-r.seq // bs) for r in c.reqs) + 3
    k_plane = torch.full((n_blocks * bs, c.hkv, c.d), math.nan, dtype=torch.float64)
    v_plane = k_plane.clone()
    table = torch.full((n + 1, width), -1, dtype=torch.int32)
    rows = rng.permutation(n + 1)[:n]
    free = list(rng.permutation(n_blocks))
    keys: list[Tensor] = []
    values: list[Tensor] = []
    any_key = any(r.from_key for r in c.reqs)
    for i, r in enumerate(c.reqs):
        lo = first_visible(r, c)
        kr = torch.randn(r.seq, c.hkv, c.d, generator=gen, dtype=torch.float64)
        vr = torch.randn(r.seq, c.hkv, c.d, generator=gen, dtype=torch.float64)
        kr[:lo] = math.nan
        vr[:lo] = math.nan
        keys.append(kr)
        values.append(vr)
        if any_key and r.seq == r.qlen:
            key[starts[i] : starts[i] + r.qlen] = kr
            value[starts[i] : starts[i] + r.qlen] = vr
            continue
        for j in range(lo // bs, -(-r.seq // bs)):
            blk = int(free.pop())
            table[rows[i], j] = blk
            p = torch.arange(j * bs, min(r.seq, (j + 1) * bs))
            k_plane[blk * bs + p % bs] = kr[p]
            v_plane[blk * bs + p % bs] = vr[p]
    slopes = torch.rand(c.hq, generator=gen, dtype=torch.float32) if c.alibi else None
    sinks = torch.randn(c.hq, generator=gen, dtype=torch.float32) * 3 if c.sinks else None
    cast = {name: t.to(c.dtype) for name, t in [("q", q), ("key", key), ("value", value)]}
    return {
        "query": cast["q"],
        "key": cast["key"],
        "value": cast["value"],
        "k_plane": k_plane.to(c.dtype),
        "v_plane": v_plane.to(c.dtype),
        "block_table": table,
        "requests": rows.astype(np.int64),
        "query_start": np.array(starts, dtype=np.int64),
        "query_lens": np.array([r.qlen for r in c.reqs], dtype=np.int64),
        "seq_lens": np.array([r.seq for r in c.reqs], dtype=np.int64),
        "keys": keys,
        "values": values,
        "slopes": slopes,
        "sinks": sinks,
    }


def run_case(c: Case, seed: int = 0) -> None:
    data = build(c, seed)
    scale = c.d**-0.5
    output = torch.full_like(data["query"], SENTINEL)
    # A strided lse (every other column of a bigger tensor), pre-filled with the sentinel.
    lse_big = torch.full((output.shape[0], 2 * c.hq), SENTINEL)
    lse = lse_big[:, ::2] if c.with_lse else None
    any_key = any(r.from_key for r in c.reqs)
    all_key = all(r.from_key for r in c.reqs)
    threads = torch.get_num_threads()
    if c.threads is not None:
        torch.set_num_threads(c.threads)
    try:
        _call_engine(c, data, all_key, any_key, scale, output, lse)
    finally:
        torch.set_num_threads(threads)
    _check(c, data, scale, output, lse_big)


def _call_engine(
    c: Case,
    data: dict[str, Any],
    all_key: bool,
    any_key: bool,
    scale: float,
    output: Tensor,
    lse: Tensor | None,
) -> None:
    paged_prefill(
        data["query"],
        None if all_key else data["k_plane"],
        None if all_key else data["v_plane"],
        None if all_key else data["block_table"],
        data["requests"],
        data["query_start"],
        data["query_lens"],
        data["seq_lens"],
        block_size=c.block_size,
        causal=c.causal,
        window=c.window,
        chunk=c.chunk,
        scale=scale,
        output=output,
        soft_cap=c.soft_cap,
        alibi_slopes=data["slopes"],
        key=data["key"] if any_key else None,
        value=data["value"] if any_key else None,
        sinks=data["sinks"],
        lse=lse,
        **c.kwargs,
    )


def _check(c: Case, data: dict[str, Any], scale: float, output: Tensor, lse_big: Tensor) -> None:
    served = torch.zeros(output.shape[0], dtype=torch.bool)
    tol = TOLERANCE[c.dtype]
    q64 = data["query"].double()
    for i, r in enumerate(c.reqs):
        s = int(data["query_start"][i])
        served[s : s + r.qlen] = True
        # The oracle reads the same rounded values the engine got.
        k64 = data["keys"][i].to(c.dtype).double()
        v64 = data["values"][i].to(c.dtype).double()
        want_lse = torch.zeros(r.qlen, c.hq, dtype=torch.float64)
        want = oracle(
            q64[s : s + r.qlen],
            k64,
            v64,
            r.seq,
            causal=c.causal,
            window=c.window,
            chunk=c.chunk,
            scale=scale,
            soft_cap=c.soft_cap,
            slopes=data["slopes"],
            sinks=data["sinks"],
            lse=want_lse,
        )
        got = output[s : s + r.qlen].double()
        assert torch.isfinite(got).all(), f"request {i}: non-finite output"
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=f"request {i}")
        if c.with_lse:
            torch.testing.assert_close(
                lse_big[s : s + r.qlen, ::2].double(), want_lse, atol=1e-4, rtol=1e-5,
                msg=f"request {i}: lse",
            )  # fmt: skip
    assert (output[~served] == SENTINEL).all(), "rows not served were written"
    assert (lse_big[~served] == SENTINEL).all(), "lse rows not served were written"
    assert (lse_big[:, 1::2] == SENTINEL).all(), "lse columns outside the view were written"


DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16"),
]


# --------------------------------------------------------------------------- cases


@pytest.mark.parametrize("dtype", DTYPES)
def test_fresh_prompts_from_key_value(dtype: torch.dtype) -> None:
    run_case(Case([Req(1, 1, True), Req(37, 37, True), Req(70, 70, True)], dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fresh_prompts_from_planes(dtype: torch.dtype) -> None:
    run_case(Case([Req(37, 37), Req(5, 5), Req(66, 66)], dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_over_context(dtype: torch.dtype) -> None:
    # Mixed: prompt chunks over a context, a decode-like row, and a fresh prompt from key.
    run_case(Case([Req(20, 83), Req(1, 9), Req(33, 33, True), Req(40, 41)], dtype=dtype))


@pytest.mark.parametrize("window", [1, 5, 17, 40])
@pytest.mark.parametrize("query_block", [None, 8])
def test_sliding_window(window: int, query_block: int | None) -> None:
    kwargs: dict[str, Any] = {} if query_block is None else {"query_block": query_block}
    reqs = [Req(30, 75), Req(45, 45, True), Req(19, 19), Req(3, 50)]
    run_case(Case(reqs, window=window, block_size=4, kwargs=kwargs))


@pytest.mark.parametrize("chunk", [1, 6, 16])
@pytest.mark.parametrize("query_block", [None, 8])
def test_chunked_local(chunk: int, query_block: int | None) -> None:
    kwargs: dict[str, Any] = {} if query_block is None else {"query_block": query_block}
    reqs = [Req(30, 75), Req(45, 45, True), Req(19, 19), Req(3, 50)]
    run_case(Case(reqs, chunk=chunk, block_size=4, kwargs=kwargs))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bidirectional(dtype: torch.dtype) -> None:
    # Encoder-only (seq == qlen, from key and from the planes), cross attention with more
    # and with fewer queries than keys, and a request with no key at all (zeros).
    reqs = [Req(21, 21, True), Req(13, 13), Req(40, 11), Req(7, 30), Req(3, 0)]
    run_case(Case(reqs, causal=False, dtype=dtype, kwargs={"query_block": 8}))


def test_bidirectional_empty_request_outputs_zeros() -> None:
    c = Case([Req(4, 0), Req(3, 5)], causal=False)
    run_case(c)


@pytest.mark.parametrize("causal", [True, False])
def test_soft_cap(causal: bool) -> None:
    reqs = [Req(30, 30, True), Req(12, 40)]
    run_case(Case(reqs, causal=causal, soft_cap=0.7, d=32, kwargs={"query_block": 8}))


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Case([Req(30, 30, True), Req(12, 40)]), id="causal"),
        pytest.param(Case([Req(30, 70)], window=9), id="window"),
        pytest.param(Case([Req(30, 70)], chunk=12), id="chunk"),
        pytest.param(Case([Req(25, 9), Req(6, 20)], causal=False), id="cross"),
        pytest.param(Case([Req(30, 70)], soft_cap=2.0), id="soft-cap"),
    ],
)
def test_alibi(case: Case) -> None:
    case.alibi = True
    case.kwargs = {"query_block": 8}
    run_case(case)


@pytest.mark.parametrize(
    ("hq", "hkv"), [pytest.param(6, 6, id="mha"), pytest.param(6, 1, id="mqa"), (8, 2)]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_layouts(hq: int, hkv: int, dtype: torch.dtype) -> None:
    run_case(Case([Req(23, 23, True), Req(9, 30)], hq=hq, hkv=hkv, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_head_size(dtype: torch.dtype) -> None:
    run_case(Case([Req(17, 17, True), Req(9, 26)], d=40, dtype=dtype, window=11))


# Every head size the CPU default declares beyond the classic ones: multiples of 16,
# and Gemma 4's 512 (its full-attention layers' global_head_dim).
HEAD_SIZES = [*range(32, 257, 16), 512]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_SIZES)
def test_every_head_size(d: int, dtype: torch.dtype, threads: int) -> None:
    reqs = [Req(19, 19, True), Req(9, 26), Req(21, 21)]
    run_case(Case(reqs, hq=4, hkv=2, d=d, block_size=16, dtype=dtype, threads=threads))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Case([Req(30, 30, True), Req(12, 40), Req(9, 9)]), id="causal"),
        pytest.param(Case([Req(30, 70)], window=9, kwargs={"query_block": 8}), id="window"),
        pytest.param(Case([Req(30, 70)], chunk=12, kwargs={"key_chunk": 16}), id="online"),
        pytest.param(Case([Req(25, 9), Req(6, 20), Req(3, 0)], causal=False), id="cross-and-empty"),
        pytest.param(Case([Req(30, 70)], soft_cap=2.0, alibi=True), id="cap-alibi"),
    ],
)
def test_sinks_and_lse(case: Case, dtype: torch.dtype, threads: int) -> None:
    for sinks, with_lse in ((True, True), (False, True), (True, False)):
        c = Case(
            case.reqs, causal=case.causal, window=case.window, chunk=case.chunk,
            soft_cap=case.soft_cap, alibi=case.alibi, kwargs=case.kwargs, dtype=dtype,
            sinks=sinks, with_lse=with_lse, threads=threads, d=32,
        )  # fmt: skip
        run_case(c)


def test_the_oracle_catches_a_dropped_sink() -> None:
    """The sink cases are not vacuous: the engine run without its sink misses the
    oracle's output."""
    c = Case([Req(12, 40)], sinks=True)
    data = build(c)
    data["sinks"] = data["sinks"] + 4.0  # the oracle's sinks, not the engine's
    output = torch.full_like(data["query"], SENTINEL)
    lse_big = torch.full((output.shape[0], 2 * c.hq), SENTINEL)
    c_engine = Case(c.reqs)  # no sinks given to the engine
    _call_engine(c_engine, {**data, "sinks": None}, False, False, c.d**-0.5, output, None)
    with pytest.raises(AssertionError):
        _check(c, data, c.d**-0.5, output, lse_big)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Case([Req(12, 90), Req(20, 20, True)]), id="causal"),
        # window 5 over chunks of 3 keys: some rows see nothing in a key chunk.
        pytest.param(Case([Req(12, 90)], window=5), id="window"),
        pytest.param(Case([Req(12, 90)], chunk=13), id="chunk"),
        pytest.param(Case([Req(12, 90), Req(30, 7)], causal=False), id="bidirectional"),
        pytest.param(Case([Req(12, 90)], soft_cap=1.5, alibi=True), id="cap-alibi"),
        pytest.param(Case([Req(12, 90)], dtype=torch.bfloat16), id="bf16"),
    ],
)
def test_key_chunks_online_softmax(case: Case) -> None:
    case.kwargs = {"query_block": 4, "key_chunk": 3}
    run_case(case)
    case.kwargs = {"query_block": 5, "key_chunk": 16}
    run_case(case, seed=1)


def test_strided_inputs_and_more_threads() -> None:
    # Planes and query with row / head strides (last dim contiguous), 2 threads.
    c = Case([Req(20, 44), Req(30, 30)], kwargs={"query_block": 8})
    data = build(c)
    wide = torch.full((data["k_plane"].shape[0], 2, c.hkv, c.d), math.nan)
    wide[:, 1] = data["k_plane"]
    k_plane = wide[:, 1]
    wide_v = wide.clone()
    wide_v[:, 1] = data["v_plane"]
    v_plane = wide_v[:, 1]
    q_wide = torch.zeros(data["query"].shape[0], c.hq, 2, c.d)
    q_wide[:, :, 0] = data["query"]
    query = q_wide[:, :, 0]
    output = torch.full((query.shape[0], c.hq, 3, c.d), SENTINEL)[:, :, 1]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        paged_prefill(
            query,
            k_plane,
            v_plane,
            data["block_table"],
            data["requests"],
            data["query_start"],
            data["query_lens"],
            data["seq_lens"],
            block_size=c.block_size,
            causal=True,
            window=None,
            chunk=None,
            scale=0.3,
            output=output,
            query_block=8,
        )
    finally:
        torch.set_num_threads(threads)
    for i, r in enumerate(c.reqs):
        s = int(data["query_start"][i])
        want = oracle(
            data["query"][s : s + r.qlen].double(),
            data["keys"][i],
            data["values"][i],
            r.seq,
            causal=True,
            window=None,
            chunk=None,
            scale=0.3,
            soft_cap=None,
            slopes=None,
        )
        torch.testing.assert_close(output[s : s + r.qlen].double(), want, atol=2e-5, rtol=2e-5)


def test_no_requests_writes_nothing() -> None:
    q = torch.randn(3, 2, 8)
    out = torch.full_like(q, SENTINEL)
    empty = np.zeros(0, dtype=np.int64)
    paged_prefill(
        q, None, None, None, empty, empty, empty, empty,
        block_size=4, causal=True, window=None, chunk=None, scale=1.0, output=out,
    )  # fmt: skip
    assert (out == SENTINEL).all()


# --------------------------------------------------------------------------- errors


def _base() -> tuple[dict[str, Any], dict[str, Any]]:
    """Valid arguments: one chunked-prefill request from the planes and one fresh prompt
    from key/value; blocks of 4."""
    c = Case([Req(5, 9), Req(4, 4, True)])
    data = build(c)
    args: dict[str, Any] = {
        "query": data["query"],
        "k_plane": data["k_plane"],
        "v_plane": data["v_plane"],
        "block_table": data["block_table"],
        "requests": data["requests"],
        "query_start": data["query_start"],
        "query_lens": data["query_lens"],
        "seq_lens": data["seq_lens"],
    }
    kwargs: dict[str, Any] = {
        "block_size": 4,
        "causal": True,
        "window": None,
        "chunk": None,
        "scale": 0.25,
        "output": torch.full_like(data["query"], SENTINEL),
        "key": data["key"],
        "value": data["value"],
    }
    return args, kwargs


def _bad_table(args: dict[str, Any], kw: dict[str, Any], value: int) -> None:
    t = args["block_table"].clone()
    t[int(args["requests"][0]), 1] = value
    args["block_table"] = t


ERRORS: list[Any] = [
    ("query-type", lambda a, k: a.update(query=[1.0]), TypeError, "query: expected a torch.Tensor [T, Hq, D], got list"),
    ("query-ndim", lambda a, k: a.update(query=a["query"][0]), ValueError, "query: expected a torch.Tensor [T, Hq, D], got torch.float32 [4, 16]"),
    ("query-dtype", lambda a, k: a.update(query=a["query"].double()), ValueError, "query: expected dtype float32, bfloat16 or float16"),
    ("query-device", lambda a, k: a.update(query=torch.empty(a["query"].shape, device="meta")), ValueError, "query: expected a CPU tensor"),
    ("query-stride", lambda a, k: a.update(query=a["query"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "query: expected a contiguous last dimension"),
    ("query-gqa", lambda a, k: (a.update(query=a["query"][:, :3]), k.update(output=k["output"][:, :3])), ValueError, "query: expected Hq a multiple of Hkv = 2"),
    ("output-shape", lambda a, k: k.update(output=k["output"][1:]), ValueError, "output: expected shape"),
    ("output-dtype", lambda a, k: k.update(output=k["output"].half()), ValueError, "output: expected dtype torch.float32"),
    ("output-alias", lambda a, k: k.update(output=a["query"]), ValueError, "output: expected a tensor that does not overlap query"),
    ("planes-half", lambda a, k: a.update(v_plane=None), ValueError, "k_plane, v_plane: expected both tensors or both None"),
    ("plane-dtype", lambda a, k: a.update(k_plane=a["k_plane"].half()), ValueError, "k_plane: expected dtype torch.float32"),
    ("plane-head-size", lambda a, k: a.update(k_plane=a["k_plane"][..., :8], v_plane=a["v_plane"][..., :8]), ValueError, "k_plane: expected head size D = 16"),
    ("v-plane-shape", lambda a, k: a.update(v_plane=a["v_plane"][:-4]), ValueError, "v_plane: expected shape"),
    ("key-half", lambda a, k: k.update(value=None), ValueError, "key, value: expected both tensors or both None"),
    ("key-shape", lambda a, k: k.update(key=k["key"][1:], value=k["value"][1:]), ValueError, "key: expected shape"),
    ("key-heads", lambda a, k: k.update(key=k["key"][:, :1], value=k["value"][:, :1]), ValueError, "key: expected shape"),
    ("value-shape", lambda a, k: k.update(value=k["value"][:, :1]), ValueError, "value: expected shape"),
    ("alibi-dtype", lambda a, k: k.update(alibi_slopes=torch.ones(4, dtype=torch.float64)), ValueError, "alibi_slopes: expected dtype torch.float32"),
    ("alibi-shape", lambda a, k: k.update(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes: expected a float32 tensor [4]"),
    ("block-size", lambda a, k: k.update(block_size=0), ValueError, "block_size: expected an int >= 1, got 0"),
    ("causal-type", lambda a, k: k.update(causal=1), TypeError, "causal: expected a bool"),
    ("window", lambda a, k: k.update(window=0), ValueError, "window: expected an int >= 1, got 0"),
    ("chunk", lambda a, k: k.update(chunk=2.0), TypeError, "chunk: expected an int"),
    ("window-and-chunk", lambda a, k: k.update(window=4, chunk=4), ValueError, "window, chunk: expected at most one"),
    ("window-bidirectional", lambda a, k: k.update(window=4, causal=False), ValueError, "window: expected None with causal=False"),
    ("chunk-bidirectional", lambda a, k: k.update(chunk=4, causal=False), ValueError, "chunk: expected None with causal=False"),
    ("scale", lambda a, k: k.update(scale=math.nan), ValueError, "scale: expected a finite float"),
    ("soft-cap", lambda a, k: k.update(soft_cap=0.0), ValueError, "soft_cap: expected a finite float > 0"),
    ("query-block", lambda a, k: k.update(query_block=0), ValueError, "query_block: expected an int >= 1"),
    ("key-chunk", lambda a, k: k.update(key_chunk=0), ValueError, "key_chunk: expected an int >= 1"),
    ("requests-type", lambda a, k: a.update(requests=[0, 1]), TypeError, "requests: expected a 1-D int64 numpy array, got list"),
    ("requests-dtype", lambda a, k: a.update(requests=a["requests"].astype(np.float64)), ValueError, "requests: expected a 1-D int64 numpy array, got a 1-D float64"),
    ("seq-lens-length", lambda a, k: a.update(seq_lens=a["seq_lens"][:1]), ValueError, "seq_lens: expected 2 entries"),
    ("query-lens-zero", lambda a, k: a.update(query_lens=np.array([0, 4])), ValueError, "query_lens: expected every entry >= 1, got 0 at [0]"),
    ("query-start", lambda a, k: a.update(query_start=np.array([1, 20])), ValueError, "query_start: expected query rows"),
    ("seq-negative", lambda a, k: a.update(seq_lens=np.array([-1, 4]), query_lens=np.array([5, 4])), ValueError, "seq_lens: expected every entry >= 0, got -1"),
    ("seq-below-qlen", lambda a, k: a.update(seq_lens=np.array([4, 4])), ValueError, "seq_lens: expected seq >= qlen with causal=True"),
    ("planes-missing", lambda a, k: a.update(k_plane=None, v_plane=None), ValueError, "k_plane: expected the K/V planes (request 0"),
    ("table-missing", lambda a, k: a.update(block_table=None), ValueError, "block_table: expected an int32 tensor [B, W] (request 0"),
    ("table-dtype", lambda a, k: a.update(block_table=a["block_table"].long()), ValueError, "block_table: expected dtype torch.int32"),
    ("table-narrow", lambda a, k: a.update(block_table=a["block_table"][:, :2]), ValueError, "block_table: expected at least 3 columns"),
    ("request-row", lambda a, k: a.update(requests=np.array([7, 0])), ValueError, "requests: expected block-table rows in [0, 3), got 7 at [0]"),
    ("block-negative", lambda a, k: _bad_table(a, k, -1), ValueError, "block_table: expected physical blocks in [0, 7)"),
    ("block-too-big", lambda a, k: _bad_table(a, k, 7), ValueError, "got 7 at ["),
]  # fmt: skip


@pytest.mark.parametrize(
    ("mutate", "exc", "message"), [pytest.param(*e[1:], id=e[0]) for e in ERRORS]
)
def test_errors(mutate: Any, exc: type[Exception], message: str) -> None:
    args, kwargs = _base()
    mutate(args, kwargs)
    output = kwargs["output"]
    before = output.clone() if isinstance(output, Tensor) else None
    with pytest.raises(exc, match=re.escape(message)):
        paged_prefill(**args, **kwargs)
    query = args["query"]
    if before is not None and not (isinstance(query, Tensor) and output is query):
        assert torch.equal(output, before), "an error left output partly written"


def test_base_arguments_are_valid() -> None:
    args, kwargs = _base()
    paged_prefill(**args, **kwargs)
    assert torch.isfinite(kwargs["output"][1:6]).all()


# --------------------------------------------------------------------------- engines


ISA_CASES = [
    pytest.param(Case([Req(30, 30, True), Req(12, 40), Req(70, 70)], d=128), id="causal"),
    pytest.param(
        Case([Req(30, 70)], window=9, d=80, dtype=torch.bfloat16, sinks=True, with_lse=True),
        id="window-sinks-lse",
    ),
    pytest.param(
        Case([Req(25, 9), Req(6, 20), Req(3, 0)], causal=False, d=48, dtype=torch.float16),
        id="cross",
    ),
    pytest.param(
        Case([Req(40, 90)], chunk=12, soft_cap=2.0, alibi=True, d=64, dtype=torch.bfloat16),
        id="chunk-cap-alibi",
    ),
]


# The tiles copy (amxbf16) takes bf16 with head sizes that are multiples of 16 in blocks
# of whole 16-row tiles where G divides 16 and lcm(G, 16) rows otherwise (at most 128),
# else blocks whose last tile of rows is partial: every shape of it, on bf16.
AMX_CASES = [
    pytest.param(Case([Req(37, 37, True), Req(20, 75), Req(1, 33)], hq=8, hkv=2, d=128, block_size=16, dtype=torch.bfloat16), id="g4-d128"),
    pytest.param(Case([Req(29, 61)], hq=3, hkv=1, d=48, dtype=torch.bfloat16, sinks=True, with_lse=True), id="g3-d48-sinks-lse"),
    pytest.param(Case([Req(40, 40, True), Req(9, 50)], hq=2, hkv=2, d=256, dtype=torch.bfloat16, window=13), id="g1-d256-window"),
    pytest.param(Case([Req(21, 44)], hq=18, hkv=1, d=96, dtype=torch.bfloat16, chunk=10), id="g18-d96-chunk"),
    pytest.param(Case([Req(17, 30)], hq=9, hkv=1, d=32, dtype=torch.bfloat16, soft_cap=3.0, alibi=True), id="g9-d32-cap-alibi"),
    pytest.param(Case([Req(25, 9), Req(6, 20)], causal=False, hq=12, hkv=2, d=112, dtype=torch.bfloat16), id="g6-d112-cross"),
    pytest.param(Case([Req(33, 33, True)], hq=4, hkv=2, d=40, dtype=torch.bfloat16), id="d40-not-tiles"),
    pytest.param(Case([Req(50, 90)], hq=8, hkv=2, d=64, dtype=torch.bfloat16, kwargs={"query_block": 3}), id="query-block-3"),
    pytest.param(Case([Req(40, 600), Req(300, 300, True)], hq=8, hkv=2, d=64, block_size=16, dtype=torch.bfloat16), id="many-key-chunks"),
]  # fmt: skip


@pytest.mark.parametrize("isa", ["amxbf16", "avx512bf16", "avx512", "avx2", "generic"])
@pytest.mark.parametrize("case", ISA_CASES + AMX_CASES)
def test_every_instruction_set_copy(isa: str, case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each copy of the native compute this CPU runs, chosen with ATTNKIT_CPU_ISA."""
    from attnkit.kernels.attention.cpu_prefill_native import prefill_isa

    monkeypatch.setenv("ATTNKIT_CPU_ISA", isa)
    if prefill_isa() != isa:
        pytest.skip(f"this CPU does not run the {isa} copy (it runs {prefill_isa()})")
    for threads in (1, 2):
        case.threads = threads
        run_case(case)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("define", "case"),
    [
        # causal: a row sees its next key; keys in several chunks
        ("ATTNKIT_TEST_AMX_MASK_PAST_END", AMX_CASES[0].values[0]),
        ("ATTNKIT_TEST_AMX_NO_RESCALE", AMX_CASES[-1].values[0]),
    ],
    ids=["mask-one-key-past-the-end", "no-rescale-between-chunks"],
)
def test_the_checks_catch_a_broken_tiles_copy(
    define: str, case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The oracle check fails on the tiles copy built to let a row see one key past its
    visible ones (a causal row its next token), or to skip the rescale of a row's
    accumulator when a later chunk raises its max."""
    from attnkit.kernels.attention import cpu_native as _native
    from attnkit.kernels.attention.cpu_prefill_native import prefill_isa

    monkeypatch.delenv("ATTNKIT_CPU_ISA", raising=False)
    if prefill_isa() != "amxbf16":
        pytest.skip(f"this CPU does not run the amxbf16 copy (it runs {prefill_isa()})")
    run_case(case)  # the good build passes
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_native, "_DEFINES", (define,))  # compiled here, never prebuilt
    monkeypatch.setattr(_native, "_STATE", [])
    assert prefill_isa() == "amxbf16"
    with pytest.raises(AssertionError):
        run_case(case)


@pytest.mark.parametrize("case", ISA_CASES)
def test_torch_engine(case: Case) -> None:
    """The second implementation (blocked torch products) on the same cases."""
    case.kwargs = {**case.kwargs, "engine": "torch"}
    run_case(case)


def test_unknown_engine_is_refused() -> None:
    with pytest.raises(ValueError, match=r"engine: expected 'native' or 'torch', got 'gpu'"):
        run_case(Case([Req(3, 3)], kwargs={"engine": "gpu"}))


def test_the_chosen_copy_is_the_best_this_cpu_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnkit.kernels.attention.cpu_prefill_native import prefill_isa

    monkeypatch.delenv("ATTNKIT_CPU_ISA", raising=False)
    flags = _cpu_flags()
    want = "generic"
    if {"avx2", "fma", "f16c"} <= flags:
        want = "avx2"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        want = "avx512"
        if "avx512_bf16" in flags:
            want = "avx512bf16"
            if {"amx_bf16", "amx_tile"} <= flags and _amx_granted():
                want = "amxbf16"
    assert prefill_isa() == want
    monkeypatch.setenv("ATTNKIT_CPU_ISA", "generic")
    assert prefill_isa() == "generic"
    monkeypatch.setenv("ATTNKIT_CPU_ISA", "no-such-isa")  # not a cap: the best one
    assert prefill_isa() == want


def _amx_granted() -> bool:
    """Whether Linux grants this process the AMX tile data (arch_prctl
    ARCH_REQ_XCOMP_PERM, asked here independently of the library)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    return int(libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata)) == 0


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.split(":", 1)[0].strip() in ("flags", "Features"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
