"""The native paged decode's grouped rows: consecutive work items of one request (a
verify step's rows, a draft tree's runs) computed as one matrix per K/V head.

Checked against the float64 oracle of ``test_cpu_decode`` and a masked oracle written
here (draft trees), against the same tokens decoded one at a time (bit for bit), on
every instruction-set copy this CPU runs, and with two deliberately broken builds of the
kernel (rows of different requests grouped; the last, partial block of rows dropped)
that these checks must catch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_cpu_decode import TOL, _request_items, make_case, oracle

from attnkit.kernels.attention import cpu_native as _native
from attnkit.kernels.attention.cpu_decode import (
    native_problem,
    paged_attention_requests,
    paged_attention_rows,
)

_PROBLEM = native_problem()
if _PROBLEM is not None and _PROBLEM.startswith("no C compiler"):  # pragma: no cover
    pytest.skip(f"native CPU kernels unavailable: {_PROBLEM}", allow_module_level=True)

D = 64
BS = 16


def _copies(dtype: torch.dtype) -> list[str]:
    """The decode copies this CPU runs for ``dtype`` at head size D, by the ISA cap that
    selects each (``""``: no cap)."""
    lib = _native.load_paged_decode()
    code = {torch.float32: 0, torch.bfloat16: 1}[dtype]
    best = lib.decode_isa(code, D)
    caps = [""]
    if best == "amxbf16":
        caps.append("avx512bf16")
    return caps


def _cap_ids(dtype: torch.dtype) -> list[tuple[torch.dtype, str]]:
    return [(dtype, cap) for cap in _copies(dtype)]


COPIES = [*_cap_ids(torch.float32), *_cap_ids(torch.bfloat16)]
COPY_IDS = [f"{str(dt).split('.')[-1]}-{cap or 'best'}" for dt, cap in COPIES]


def _use(monkeypatch: pytest.MonkeyPatch, cap: str) -> None:
    if cap:
        monkeypatch.setenv("ATTNKIT_CPU_ISA", cap)
    else:
        monkeypatch.delenv("ATTNKIT_CPU_ISA", raising=False)


class Step:
    """A verify-like step: every request has ``qlen`` queries at the end of ``seq``
    tokens, keys written for every position its rows see, NaN everywhere else."""

    def __init__(
        self,
        dtype: torch.dtype,
        hq: int,
        hkv: int,
        qlen: int,
        seq: list[int],
        window: int | None = None,
        seed: int = 0,
        d: int = D,
        bs: int = BS,
    ) -> None:
        self.d, self.bs = d, bs
        self.qsl = [0]
        for _ in seq:
            self.qsl.append(self.qsl[-1] + qlen)
        self.seq = seq
        self.window = window
        self.items = _request_items(self.qsl, seq, list(range(len(seq))), True, window, None)
        _, reqs, starts, ends, _ = self.items
        ranges = []
        for b in range(len(seq)):
            mine = [i for i, r in enumerate(reqs) if r == b]
            ranges.append((min(starts[i] for i in mine), max(ends[i] for i in mine)))
        width = max(seq) // bs + 2
        self.q, self.k, self.v, self.table = make_case(
            dtype=dtype, hq=hq, hkv=hkv, d=d, bs=bs, ranges=ranges, width=width, seed=seed
        )
        gen = torch.Generator().manual_seed(seed + 1)
        self.q = torch.randn(self.qsl[-1] + 1, hq, d, generator=gen).to(dtype)
        self.hq = hq
        self.dtype = dtype

    def run(
        self,
        *,
        cap: float | None = None,
        slopes: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        threads: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.full_like(self.q, 7.0)
        lse = torch.full((self.q.shape[0], self.hq), 9.0)
        paged_attention_requests(
            self.q, self.k, self.v, self.table,
            torch.tensor(self.qsl, dtype=torch.int32), torch.tensor(self.seq, dtype=torch.int32),
            None, block_size=self.bs, causal=True, window=self.window, chunk=None,
            scale=self.d**-0.5, output=out, soft_cap=cap, alibi_slopes=slopes, sinks=sinks, lse=lse,
            num_threads=threads,
        )  # fmt: skip
        return out, lse

    def check(
        self,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        cap: float | None = None,
        slopes: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Every row against the float64 oracle; the row past the step untouched."""
        rows, reqs, starts, ends, qpos = self.items
        want_lse: dict[int, torch.Tensor] = {}
        want = oracle(
            self.q, self.k, self.v, self.table, rows, reqs, starts, ends, qpos, self.bs,
            self.d**-0.5, cap, slopes, sinks, want_lse,
        )  # fmt: skip
        tol = TOL[self.dtype]
        for row in rows:
            got = out[row].double()
            assert torch.isfinite(got).all(), f"row {row} has non-finite values"
            err = (got - want[row]).abs().max().item()
            assert err <= tol, f"row {row}: max error {err} > {tol}"
            torch.testing.assert_close(lse[row].double(), want_lse[row], atol=1e-4, rtol=1e-5)
        last = self.q.shape[0] - 1
        assert bool((out[last] == 7.0).all())
        assert bool((lse[last] == 9.0).all())


SHAPES = [(8, 8), (8, 2), (16, 2)]  # GQA groups 1, 4, 8
SHAPE_IDS = ["g1", "g4", "g8"]


@pytest.mark.parametrize(("dtype", "cap_name"), COPIES, ids=COPY_IDS)
@pytest.mark.parametrize(("hq", "hkv"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("qlen", range(1, 9))
def test_grouped_rows_match_the_oracle(
    dtype: torch.dtype, cap_name: str, hq: int, hkv: int, qlen: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """1..8 query rows per request, plain, windowed, soft-capped with ALiBi, and with
    sinks, at 1 and 2 threads; contexts cross blocks, start mid-block (windows) and hold
    NaN wherever no row looks."""
    _use(monkeypatch, cap_name)
    seq = [37 + qlen, 20 + qlen, qlen, 50 + qlen]
    slopes = torch.rand(hq, generator=torch.Generator().manual_seed(4))
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(6)) * 3
    plain = Step(dtype, hq, hkv, qlen, seq)
    for threads in (1, 2):
        plain.check(*plain.run(threads=threads))
    plain.check(*plain.run(cap=2.0, slopes=slopes), cap=2.0, slopes=slopes)
    plain.check(*plain.run(sinks=sinks, threads=2), sinks=sinks)
    windowed = Step(dtype, hq, hkv, qlen, seq, window=7, seed=2)
    windowed.check(*windowed.run(threads=2))
    windowed.check(*windowed.run(sinks=sinks, cap=3.0), sinks=sinks, cap=3.0)


@pytest.mark.parametrize(("dtype", "cap_name"), COPIES, ids=COPY_IDS)
@pytest.mark.parametrize(("d", "bs"), [(128, 16), (96, 32), (256, 16), (32, 24), (64, 8)])
def test_head_and_block_sizes(
    dtype: torch.dtype, cap_name: str, d: int, bs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Grouped rows at other head sizes and at block sizes that split the aligned
    16-key windows (24, 8): tiles then end at block ends inside a window."""
    _use(monkeypatch, cap_name)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(6))
    for qlen in (3, 8):
        step = Step(dtype, 8, 2, qlen, [41 + qlen, 18 + qlen, 70 + qlen], d=d, bs=bs)
        step.check(*step.run(threads=2))
        windowed = Step(dtype, 8, 2, qlen, [41 + qlen, 70 + qlen], window=11, d=d, bs=bs)
        windowed.check(*windowed.run(sinks=sinks, cap=2.0), sinks=sinks, cap=2.0)


@pytest.mark.parametrize(("dtype", "cap_name"), COPIES, ids=COPY_IDS)
@pytest.mark.parametrize(("hq", "hkv"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("window", [None, 7])
def test_verify_rows_are_their_decodes_bit_for_bit(
    dtype: torch.dtype, cap_name: str, hq: int, hkv: int, window: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A verify step's rows (5 and 8 per request) equal the same tokens decoded one at a
    time, each decode seeing its position's keys: outputs and lse, bit for bit."""
    _use(monkeypatch, cap_name)
    slopes = torch.rand(hq, generator=torch.Generator().manual_seed(4))
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(6))
    for qlen in (5, 8):
        seq = [37 + qlen, 20 + qlen, qlen, 70 + qlen]
        step = Step(dtype, hq, hkv, qlen, seq, window=window)
        for cap, sl, sk in ((None, None, None), (2.0, slopes, sinks)):
            out, lse = step.run(cap=cap, slopes=sl, sinks=sk, threads=2)
            for t in range(qlen):
                rows = [step.qsl[b] + t for b in range(len(seq))]
                q1 = step.q[rows].contiguous()
                o1 = torch.empty_like(q1)
                l1 = torch.empty(len(rows), hq)
                paged_attention_requests(
                    q1, step.k, step.v, step.table,
                    torch.arange(len(seq) + 1, dtype=torch.int32),
                    torch.tensor([s - qlen + t + 1 for s in seq], dtype=torch.int32),
                    None, block_size=BS, causal=True, window=window, chunk=None,
                    scale=D**-0.5, output=o1, lse=l1, num_threads=1, soft_cap=cap,
                    alibi_slopes=sl, sinks=sk,
                )  # fmt: skip
                assert torch.equal(o1, out[rows]), (qlen, t, cap)
                assert torch.equal(l1, lse[rows]), (qlen, t, cap)


def _tree_oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table_row: torch.Tensor,
    visible: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[Hq, D] output and [Hq] lse (float64) of one query over the given logical keys."""
    hq = q.shape[0]
    g = hq // k.shape[1]
    pos = torch.tensor(visible)
    phys = table_row.long()[pos // BS] * BS + pos % BS
    out = torch.zeros(hq, q.shape[1], dtype=torch.float64)
    lse = torch.zeros(hq, dtype=torch.float64)
    for h in range(hq):
        kk = k[phys, h // g].double()
        vv = v[phys, h // g].double()
        sc = scale * (kk @ q[h].double())
        lse[h] = torch.logsumexp(sc, 0)
        out[h] = torch.softmax(sc, 0) @ vv
    return out, lse


@pytest.mark.parametrize(("dtype", "cap_name"), COPIES, ids=COPY_IDS)
@pytest.mark.parametrize(("hq", "hkv"), SHAPES, ids=SHAPE_IDS)
def test_draft_tree_runs(
    dtype: torch.dtype, cap_name: str, hq: int, hkv: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draft tree's rows as the backend hands them over: one work item per run of keys
    a draft sees (the context, then its ancestors and itself), consecutive items of one
    request with ranges that touch, overlap or stand apart; each item against the
    oracle, and the runs merged by their lse against the draft's masked softmax."""
    _use(monkeypatch, cap_name)
    first = 45
    parents = [-1, -1, 0, 1, 2, 1, 4]  # draft i's parent (-1: the context's last token)
    drafts = len(parents)
    seen: list[set[int]] = []
    for i, p in enumerate(parents):
        seen.append({i} | (seen[p] if p >= 0 else set()))
    items: list[tuple[int, int, int, int]] = []  # (draft, start, end, query position)
    for i in range(drafts):
        j = 0
        runs = [(0, first)]
        while j <= i:
            if j not in seen[i]:
                j += 1
                continue
            lo = j
            while j <= i and j in seen[i]:
                j += 1
            runs.append((first + lo, first + j))
        if runs[1][0] == first:  # the first run joins the context
            runs = [(0, runs[1][1]), *runs[2:]]
        items.extend((i, s, e, first + i) for s, e in runs)
    n = len(items)
    _, k, v, table = make_case(
        dtype=dtype, hq=hq, hkv=hkv, d=D, bs=BS, ranges=[(0, first + drafts)], width=4
    )
    qd = torch.randn(drafts, hq, D, generator=torch.Generator().manual_seed(9)).to(dtype)
    q = qd[[it[0] for it in items]].contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(n, hq)
    paged_attention_rows(
        q, k, v, table, torch.arange(n, dtype=torch.int64),
        torch.zeros(n, dtype=torch.int32),
        torch.tensor([it[1] for it in items], dtype=torch.int32),
        torch.tensor([it[2] for it in items], dtype=torch.int32),
        torch.tensor([it[3] for it in items], dtype=torch.int32),
        block_size=BS, scale=D**-0.5, output=out, lse=lse, num_threads=2,
    )  # fmt: skip
    tol = TOL[dtype]
    for r, (i, s, e, _) in enumerate(items):
        want, want_lse = _tree_oracle(qd[i], k, v, table[0], list(range(s, e)), D**-0.5)
        assert (out[r].double() - want).abs().max().item() <= tol, items[r]
        torch.testing.assert_close(lse[r].double(), want_lse, atol=1e-4, rtol=1e-5)
    for i in range(drafts):
        mine = [r for r, it in enumerate(items) if it[0] == i]
        ls = lse[mine].double()
        top = ls.max(0).values
        w = torch.exp(ls - top)
        merged = (w[..., None] * out[mine].double()).sum(0) / w.sum(0)[:, None]
        visible = list(range(first)) + [first + j for j in sorted(seen[i])]
        want, _ = _tree_oracle(qd[i], k, v, table[0], visible, D**-0.5)
        assert (merged - want).abs().max().item() <= tol, i


# ---------------------------------------------------------------- broken builds


def _build_with(define: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Load a copy of the kernel library built with ``-D<define>`` for this test."""
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_native, "_DEFINES", (define,))  # compiled here, never prebuilt
    monkeypatch.setattr(_native, "_STATE", [])
    _native.load_paged_decode()


def _verify_case(dtype: torch.dtype, qlen: int, window: int | None = None) -> None:
    step = Step(dtype, 8, 2, qlen, [37 + qlen, 20 + qlen, 50 + qlen, 33 + qlen], window=window)
    step.check(*step.run())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("define", "qlen"),
    [("ATTNKIT_TEST_GROUP_ANY_REQUEST", 1), ("ATTNKIT_TEST_DROP_PARTIAL_ROWS", 5)],
    ids=["rows-of-two-requests", "last-partial-row-block"],
)
def test_the_checks_catch_broken_groups(
    define: str, qlen: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The oracle check above fails on a kernel built to group rows of different
    requests (a decode step's rows then read the first request's blocks), or to drop
    the rows of a group's last, partial block of rows (5 rows x 4 heads: 20 rows)."""
    if _native.load_paged_decode().decode_isa(1, D) == "vector8":  # pragma: no cover
        pytest.skip("this CPU runs no grouped copy: the broken builds change nothing here")
    caps = _copies(torch.bfloat16)
    for cap in caps:  # the good build passes the case on every copy
        _use(monkeypatch, cap)
        _verify_case(torch.bfloat16, qlen)
    _build_with(define, tmp_path, monkeypatch)
    for cap in caps:
        _use(monkeypatch, cap)
        with pytest.raises(AssertionError):
            _verify_case(torch.bfloat16, qlen)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("define", "window"),
    [("ATTNKIT_TEST_GROUP_ANY_REQUEST", None), ("ATTNKIT_TEST_GROUP_ANY_START", 7)],
    ids=["rows-of-two-requests", "rows-of-two-starts"],
)
def test_the_checks_catch_broken_8_lane_groups(
    define: str, window: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on the 8-lane copy (float32 here), whose groups also need one key start:
    a kernel built to group rows of different requests, or rows whose windows start at
    different keys (the later rows then see keys before their window), is caught."""
    _use(monkeypatch, "")
    _verify_case(torch.float32, 5, window)
    _build_with(define, tmp_path, monkeypatch)
    with pytest.raises(AssertionError):
        _verify_case(torch.float32, 5, window)
