"""The native CPU paged-decode kernel against a float64 oracle written here."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from attnkit.kernels.attention import cpu_native as _native
from attnkit.kernels.attention.cpu_decode import native_problem, paged_attention_rows

_PROBLEM = native_problem()
if _PROBLEM is not None and _PROBLEM.startswith("no C compiler"):  # pragma: no cover
    pytest.skip(f"native CPU kernels unavailable: {_PROBLEM}", allow_module_level=True)

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    rows: list[int],
    requests: list[int],
    starts: list[int],
    ends: list[int],
    qpos: list[int],
    bs: int,
    scale: float,
    cap: float | None = None,
    slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    lse: dict[int, torch.Tensor] | None = None,
    key_map: tuple[int, int] = (1, 0),
) -> dict[int, torch.Tensor]:
    """Row -> [Hq, D] float64: gather the visible keys by the table, masked softmax (a
    sink logit per head joins the denominator); ``lse`` receives row -> [Hq] log-sum-exp."""
    _, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out: dict[int, torch.Tensor] = {}
    width = table.shape[1] * bs
    for row, b, s0, e0, qp in zip(rows, requests, starts, ends, qpos, strict=True):
        pos = torch.arange(width)
        phys = table[b].long()[pos // bs] * bs + pos % bs
        kk = k[phys].double()  # [width, Hkv, D]: every position, masked below
        vv = v[phys].double()
        visible = (pos >= s0) & (pos < e0)
        res = torch.zeros(hq, d, dtype=torch.float64)
        row_lse = torch.full((hq,), -math.inf, dtype=torch.float64)
        for h in range(hq):
            kh = torch.where(visible[:, None], kk[:, h // g], 0.0)
            vh = torch.where(visible[:, None], vv[:, h // g], 0.0)
            sc = scale * (kh @ q[row, h].double())
            if cap is not None:
                sc = cap * torch.tanh(sc / cap)
            if slopes is not None:
                sc = sc + float(slopes[h]) * (pos * key_map[0] + key_map[1] - qp).double()
            sc = torch.where(visible, sc, -math.inf)
            if sinks is not None:  # one more logit, with no value
                sc = torch.cat([sc, sinks[h : h + 1].double()])
                vh = torch.cat([vh, torch.zeros(1, d, dtype=torch.float64)])
            row_lse[h] = torch.logsumexp(sc, 0)
            if bool(torch.isfinite(row_lse[h])):
                res[h] = torch.softmax(sc, 0) @ vh
        out[row] = res
        if lse is not None:
            lse[row] = row_lse
    return out


def make_case(
    *,
    dtype: torch.dtype,
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    ranges: list[tuple[int, int]],
    width: int,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v, table) with shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    b = len(ranges)
    nb = b * width + 3
    k = torch.randn(nb * bs, hkv, d, generator=gen).to(dtype)
    v = torch.randn(nb * bs, hkv, d, generator=gen).to(dtype)
    table = torch.randperm(nb, generator=gen)[: b * width].to(torch.int32).view(b, width)
    # NaN in every cache row no work item can see (blocks outside the table, and the
    # positions of each request outside its range): they must not leak.
    visible = torch.zeros(nb * bs, dtype=torch.bool)
    for i, (s0, e0) in enumerate(ranges):
        for p in range(s0, e0):
            visible[int(table[i, p // bs]) * bs + p % bs] = True
    k[~visible] = float("nan")
    v[~visible] = float("nan")
    t = b + 2
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    return q, k, v, table


def run_case(
    dtype: torch.dtype,
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    ranges: list[tuple[int, int]],
    *,
    width: int = 5,
    cap: float | None = None,
    alibi: bool = False,
    threads: int = 1,
    strided: bool = False,
    sinks: bool = False,
    with_lse: bool = False,
    key_map: tuple[int, int] = (1, 0),
) -> None:
    q, k, v, table = make_case(dtype=dtype, hq=hq, hkv=hkv, d=d, bs=bs, ranges=ranges, width=width)
    n = len(ranges)
    rows = list(range(n + 1, 1, -1))[:n]  # not the identity: rows [n+1 .. 2]
    requests = list(range(n))
    starts = [r[0] for r in ranges]
    ends = [r[1] for r in ranges]
    qpos = [max(e - 1, 0) * key_map[0] + key_map[1] for e in ends]
    slopes = torch.rand(hq, generator=torch.Generator().manual_seed(3)) if alibi else None
    if strided:  # views of bigger tensors: head and token strides that are not compact
        qbig = torch.zeros(q.shape[0], hq + 3, d + 5, dtype=dtype)
        qbig[:, 1 : hq + 1, 2 : d + 2] = q
        q = qbig[:, 1 : hq + 1, 2 : d + 2]
        obig = torch.full((q.shape[0] * 2, hq, d + 7), 7.0, dtype=dtype)
        out = obig[::2, :, 3 : d + 3]
    else:
        out = torch.full_like(q, 7.0)
    before = out.clone()
    scale = d**-0.5
    sink_t = torch.randn(hq, generator=torch.Generator().manual_seed(6)) * 3 if sinks else None
    # A strided view (every other column of a bigger tensor), pre-filled to show which
    # entries are written.
    lse_big = torch.full((q.shape[0], 2 * hq), 9.0)
    lse_t = lse_big[:, ::2] if with_lse else None
    paged_attention_rows(
        q,
        k,
        v,
        table,
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(requests, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(ends, dtype=torch.int32),
        torch.tensor(qpos, dtype=torch.int32),
        block_size=bs,
        scale=scale,
        output=out,
        soft_cap=cap,
        alibi_slopes=slopes,
        sinks=sink_t,
        lse=lse_t,
        num_threads=threads,
        key_stride=key_map[0],
        key_offset=key_map[1],
    )
    want_lse: dict[int, torch.Tensor] = {}
    want = oracle(
        q,
        k,
        v,
        table,
        rows,
        requests,
        starts,
        ends,
        qpos,
        bs,
        scale,
        cap,
        slopes,
        sink_t,
        want_lse,
        key_map,
    )
    tol = TOL[dtype]
    if with_lse:
        assert (lse_big[:, 1::2] == 9.0).all()  # the other columns are untouched
        for row in range(q.shape[0]):
            if row in want_lse:
                torch.testing.assert_close(
                    lse_big[row, ::2].double(), want_lse[row], atol=1e-4, rtol=1e-5
                )
            else:
                assert (lse_big[row] == 9.0).all()
    for row in range(q.shape[0]):
        if row in want:
            got = out[row].double()
            assert torch.isfinite(got).all(), f"row {row} has non-finite values"
            err = (got - want[row]).abs().max().item()
            assert err <= tol, f"row {row}: max error {err} > {tol}"
        else:  # rows no work item names are untouched
            assert torch.equal(out[row], before[row])
    if strided:
        assert (obig[1::2] == 7.0).all()
        assert (obig[::2, :, :3] == 7.0).all()
        assert (obig[::2, :, d + 3 :] == 7.0).all()


RAGGED_16 = [(0, 80), (0, 1), (5, 37), (33, 33), (16, 48), (70, 75)]
RAGGED_32 = [(0, 160), (3, 100), (64, 65), (0, 0), (31, 129)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hkv"), [(8, 2), (4, 4), (8, 8), (8, 1)])
@pytest.mark.parametrize("d", [64, 128, 40])
def test_matches_oracle(dtype: torch.dtype, hq: int, hkv: int, d: int) -> None:
    run_case(dtype, hq, hkv, d, 16, RAGGED_16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [128, 36])
def test_block_size_32(dtype: torch.dtype, d: int) -> None:
    run_case(dtype, 8, 2, d, 32, RAGGED_32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [64, 40])
def test_soft_cap_and_alibi(dtype: torch.dtype, d: int) -> None:
    run_case(dtype, 8, 2, d, 16, RAGGED_16, cap=3.0)
    run_case(dtype, 8, 2, d, 16, RAGGED_16, alibi=True)
    run_case(dtype, 8, 2, d, 16, RAGGED_16, cap=2.0, alibi=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_strided_query_output_and_threads(dtype: torch.dtype, threads: int) -> None:
    run_case(dtype, 8, 2, 64, 16, RAGGED_16, strided=True, threads=threads)
    run_case(dtype, 6, 3, 40, 32, RAGGED_32, strided=True, threads=threads)


# Every head size the CPU default declares beyond the classic ones: multiples of 16,
# and Gemma 4's 512 (its full-attention layers' global_head_dim).
HEAD_SIZES = [*range(32, 257, 16), 512]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", HEAD_SIZES)
def test_every_head_size(d: int, dtype: torch.dtype, threads: int) -> None:
    run_case(dtype, 8, 2, d, 16, RAGGED_16, threads=threads)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 80, 40])
def test_sinks_and_lse(d: int, dtype: torch.dtype, threads: int) -> None:
    # RAGGED_16 has an empty range: zeros, and the lse is the sink logit (or -inf).
    run_case(dtype, 8, 2, d, 16, RAGGED_16, sinks=True, with_lse=True, threads=threads)
    run_case(dtype, 8, 2, d, 16, RAGGED_16, with_lse=True, threads=threads)
    run_case(dtype, 8, 2, d, 16, RAGGED_16, sinks=True, threads=threads)
    run_case(dtype, 6, 3, d, 32, RAGGED_32, sinks=True, with_lse=True, cap=2.0, alibi=True,
             threads=threads, strided=True)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("key_map", [(2, 1), (3, 0), (4, 3)])
def test_alibi_at_a_shard_s_key_positions(dtype: torch.dtype, key_map: tuple[int, int]) -> None:
    """A context-parallel shard: logical key p is global position p * world + rank."""
    for d in (128, 40):
        run_case(dtype, 8, 2, d, 16, RAGGED_16, alibi=True, sinks=True, with_lse=True,
                 key_map=key_map, threads=2)  # fmt: skip


def test_the_oracle_catches_a_dropped_sink() -> None:
    """The sink test is not vacuous: without the sink the outputs differ from the oracle's."""
    q, k, v, table = make_case(
        dtype=torch.float32, hq=4, hkv=2, d=32, bs=16, ranges=[(0, 20)], width=2
    )
    out = torch.zeros_like(q)
    args = _index_args([0], [0], [0], [20], [19])
    paged_attention_rows(q, k, v, table, *args, block_size=16, scale=0.2, output=out)
    sinks = torch.full((4,), 2.0)
    want = oracle(q, k, v, table, [0], [0], [0], [20], [19], 16, 0.2, sinks=sinks)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out[0].double(), want[0], atol=1e-4, rtol=1e-4)


def test_threads_split_heads_of_few_items() -> None:
    # one work item, two threads: the kv heads are split between tasks
    run_case(torch.float32, 16, 8, 64, 16, [(3, 75)], threads=2)
    run_case(torch.float32, 16, 8, 64, 16, [(3, 75), (0, 0)], threads=2)


def test_large_scores_stay_finite() -> None:
    # a big scale: the online softmax must rescale, not overflow
    q, k, v, table = make_case(
        dtype=torch.float32, hq=4, hkv=2, d=64, bs=16, ranges=[(0, 64)], width=4
    )
    out = torch.zeros_like(q)
    args = _index_args([0], [0], [0], [64], [63])
    paged_attention_rows(q, k, v, table, *args, block_size=16, scale=30.0, output=out)
    want = oracle(q, k, v, table, [0], [0], [0], [64], [63], 16, 30.0)
    assert (out[0].double() - want[0]).abs().max().item() < 1e-4


def test_empty_work_list_is_a_no_op() -> None:
    q = torch.randn(2, 4, 16)
    out = torch.full_like(q, 3.0)
    k = torch.randn(32, 2, 16)
    args = _index_args([], [], [], [], [])
    table = torch.zeros(1, 2, dtype=torch.int32)
    paged_attention_rows(q, k, k.clone(), table, *args, block_size=16, scale=1.0, output=out)
    assert (out == 3.0).all()


# ---- errors ------------------------------------------------------------------------------


def _index_args(
    rows: list[int], req: list[int], ks: list[int], ke: list[int], qp: list[int]
) -> tuple[torch.Tensor, ...]:
    return (
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(req, dtype=torch.int32),
        torch.tensor(ks, dtype=torch.int32),
        torch.tensor(ke, dtype=torch.int32),
        torch.tensor(qp, dtype=torch.int32),
    )


def _good() -> dict[str, object]:
    q = torch.randn(3, 4, 16)
    k = torch.randn(64, 2, 16)  # 4 blocks of 16
    return {
        "query": q,
        "k_plane": k,
        "v_plane": k.clone(),
        "block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        "rows": torch.tensor([0, 2], dtype=torch.int64),
        "requests": torch.tensor([0, 1], dtype=torch.int32),
        "key_start": torch.tensor([0, 4], dtype=torch.int32),
        "key_end": torch.tensor([20, 32], dtype=torch.int32),
        "query_pos": torch.tensor([19, 31], dtype=torch.int32),
        "block_size": 16,
        "scale": 0.25,
        "output": torch.zeros(3, 4, 16),
    }


def _call(**overrides: object) -> None:
    kw = _good()
    kw.update(overrides)
    paged_attention_rows(**kw)  # type: ignore[arg-type]  # deliberately wrong values


def test_good_arguments_pass() -> None:
    _call()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"query": torch.randn(3, 4, 16, dtype=torch.float64)}, r"query: expected dtype"),
        ({"query": torch.randn(3, 4)}, r"query: expected a tensor \[T, Hq, D\]"),
        ({"query": [1.0]}, r"query: expected a torch.Tensor"),
        ({"query": torch.randn(3, 16, 4).transpose(1, 2)}, r"query: expected a contiguous last"),
        ({"k_plane": torch.randn(64, 2, 16, dtype=torch.bfloat16)}, r"k_plane: expected dtype"),
        ({"k_plane": torch.randn(64, 2, 8)}, r"k_plane: expected head size D = 16"),
        ({"k_plane": torch.randn(64, 3, 16)}, r"k_plane: expected Hkv >= 1 dividing"),
        ({"v_plane": torch.randn(48, 2, 16)}, r"v_plane: expected the shape of k_plane"),
        (
            {"v_plane": torch.randn(64, 16, 2).transpose(1, 2)},
            r"v_plane: expected a contiguous last",
        ),
        ({"block_table": torch.zeros(2, 2, dtype=torch.int64)}, r"block_table: expected an int32"),
        (
            {"block_table": torch.zeros(2, 4, dtype=torch.int32)[:, ::2]},
            r"block_table: expected a contiguous last",
        ),
        ({"rows": torch.tensor([0, 2], dtype=torch.int32)}, r"rows: expected a torch.int64"),
        ({"requests": torch.tensor([0], dtype=torch.int32)}, r"requests: expected 2 entries"),
        ({"key_start": torch.tensor([0, 4])}, r"key_start: expected a torch.int32"),
        ({"key_end": torch.zeros(4, dtype=torch.int32)[::2]}, r"key_end: expected a contiguous"),
        ({"query_pos": torch.zeros(2, 1, dtype=torch.int32)}, r"query_pos: expected a torch.int32"),
        ({"block_size": 0}, r"block_size: expected an int >= 1"),
        ({"block_size": 16.0}, r"block_size: expected an int"),
        ({"scale": float("nan")}, r"scale: expected a finite float"),
        ({"soft_cap": -1.0}, r"soft_cap: expected a finite float > 0"),
        ({"alibi_slopes": torch.zeros(3)}, r"alibi_slopes: expected a float32 tensor \[4\]"),
        (
            {"alibi_slopes": torch.zeros(4, dtype=torch.float64)},
            r"alibi_slopes: expected a float32",
        ),
        (
            {"output": torch.zeros(3, 4, 16, dtype=torch.float16)},
            r"output: expected a torch.float32",
        ),
        (
            {"output": torch.zeros(2, 4, 16)},
            r"output: expected a torch.float32 tensor \[3, 4, 16\]",
        ),
        ({"num_threads": 0}, r"num_threads: expected an int >= 1"),
        ({"sinks": torch.zeros(3)}, r"sinks: expected a float32 tensor \[4\]"),
        ({"sinks": torch.zeros(4, dtype=torch.bfloat16)}, r"sinks: expected a float32"),
        (
            {"lse": torch.zeros(3, 4, dtype=torch.float64)},
            r"lse: expected a float32 tensor \[3, 4\]",
        ),
        ({"lse": torch.zeros(2, 4)}, r"lse: expected a float32 tensor \[3, 4\]"),
    ],
)
def test_metadata_errors(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _call(**overrides)


def test_output_may_not_be_a_plane() -> None:
    kw = _good()
    k = torch.randn(3, 4, 16)
    with pytest.raises(
        ValueError, match=r"output: expected a tensor that does not overlap k_plane"
    ):
        _call(k_plane=k[:, :2], v_plane=k[:, 2:], output=k)
    del kw


def test_meta_device_refused() -> None:
    with pytest.raises(ValueError, match=r"query: expected a tensor \[T, Hq, D\] on cpu"):
        _call(query=torch.empty(3, 4, 16, device="meta"))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            {"block_table": torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)},
            r"block_table: expected physical blocks in \[0, 4\) \(R // block_size\), got 4 at "
            r"block_table\[1, 1\] \(work item 1\)",
        ),
        (
            {"block_table": torch.tensor([[-1, 1], [2, 3]], dtype=torch.int32)},
            r"block_table: expected physical blocks in \[0, 4\).*got -1 at block_table\[0, 0\]",
        ),
        (
            {"key_end": torch.tensor([20, 33], dtype=torch.int32)},
            r"key_end: expected values <= W \* block_size = 32 \(the block_table width\), got 33 "
            r"at key_end\[1\] \(request 1\)",
        ),
        (
            {"key_start": torch.tensor([-1, 4], dtype=torch.int32)},
            r"key_start: expected values >= 0, got -1 at key_start\[0\] \(request 0\)",
        ),
        (
            {"key_start": torch.tensor([0, 10], dtype=torch.int32),
             "key_end": torch.tensor([20, 9], dtype=torch.int32)},
            r"key_end: expected values >= key_start, got key_end\[1\] = 9 < key_start\[1\] = 10",
        ),
        (
            {"rows": torch.tensor([0, 3])},
            r"rows: expected query rows in \[0, 3\), got 3 at rows\[1\]",
        ),
        (
            {"requests": torch.tensor([0, 2], dtype=torch.int32)},
            r"requests: expected block_table rows in \[0, 2\), got 2 at requests\[1\]",
        ),
    ],
)  # fmt: skip
def test_index_value_errors(overrides: dict[str, object], match: str) -> None:
    out = torch.full((3, 4, 16), 5.0)
    with pytest.raises(ValueError, match=match):
        _call(output=out, **overrides)
    assert (out == 5.0).all()  # nothing written before the check


def test_unused_bad_blocks_are_not_read() -> None:
    # a bad entry past the visible range is never looked up
    _call(block_table=torch.tensor([[0, 99], [2, 3]], dtype=torch.int32),
          key_end=torch.tensor([16, 32], dtype=torch.int32))  # fmt: skip


def test_unavailable_library_raises_runtime_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "_STATE", ["no C compiler found (set CC, ...)"])
    assert native_problem() == "no C compiler found (set CC, ...)"
    with pytest.raises(RuntimeError, match=r"unavailable: no C compiler found"):
        _call()


def test_build_caches_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="attnkit.kernels.attention.cpu_native"):
        first = _native._build()
    assert first.path.parent == tmp_path / "cpu-kernels"
    assert [p.name for p in first.path.parent.iterdir()] == [first.path.name]  # no temp left
    assert any("compiled paged_decode.c" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="attnkit.kernels.attention.cpu_native"):
        second = _native._build()
    assert second.path == first.path
    assert not any("compiled" in r.getMessage() for r in caplog.records)  # a cache hit


def test_bad_compiler_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "attnkit-no-such-compiler")
    with pytest.raises(_native._BuildError, match=r"CC='attnkit-no-such-compiler' is not"):
        _native._build()


# ---------------------------------------------------------------- by request


def _request_items(
    qsl: list[int],
    seq: list[int],
    served: list[int],
    causal: bool,
    window: int | None,
    chunk: int | None,
) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """The work items the request entry point must plan, computed here from the mask
    definitions (rows, requests, starts, ends, positions)."""
    rows, reqs, starts, ends, qpos = [], [], [], [], []
    for r in served:
        qlen = qsl[r + 1] - qsl[r]
        for t in range(qlen):
            qp = seq[r] - qlen + t
            visible = [
                p
                for p in range(seq[r])
                if not causal
                or (
                    p <= qp
                    and (window is None or qp - p < window)
                    and (chunk is None or p // chunk == qp // chunk)
                )
            ]
            rows.append(qsl[r] + t)
            reqs.append(r)
            starts.append(visible[0] if visible else 0)
            ends.append(visible[-1] + 1 if visible else 0)
            qpos.append(qp)
    return rows, reqs, starts, ends, qpos


@pytest.mark.parametrize(
    ("causal", "window", "chunk", "served"),
    [
        (True, None, None, None),
        (True, 7, None, [2, 0]),
        (True, None, 12, None),
        (False, None, None, [1, 3]),
    ],
    ids=["causal-all", "window-some", "chunk", "bidirectional-some"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_requests_entry_plans_the_items_itself(
    causal: bool, window: int | None, chunk: int | None, served: list[int] | None,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    hq, hkv, d, bs, width = 8, 2, 32, 16, 4
    qlens = [1, 3, 1, 4]
    seq = [37, 20, 1, 50] if causal else [37, 20, 9, 2]  # bidirectional: qlen may exceed seq
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    reqs = served if served is not None else list(range(len(qlens)))
    rows, items, starts, ends, qpos = _request_items(qsl, seq, reqs, causal, window, chunk)
    ranges = [(0, s) for s in seq]
    q, k, v, table = make_case(dtype=dtype, hq=hq, hkv=hkv, d=d, bs=bs, ranges=ranges, width=width)
    q = torch.randn(qsl[-1] + 2, hq, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    out = torch.full_like(q, 7.0)
    slopes = torch.rand(hq, generator=torch.Generator().manual_seed(4))
    from attnkit.kernels.attention.cpu_decode import paged_attention_requests

    paged_attention_requests(
        q, k, v, table,
        torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq, dtype=torch.int32),
        None if served is None else torch.tensor(served, dtype=torch.int32),
        block_size=bs, causal=causal, window=window, chunk=chunk, scale=d**-0.5,
        output=out, soft_cap=2.0, alibi_slopes=slopes, num_threads=2,
    )  # fmt: skip
    want = oracle(q, k, v, table, rows, items, starts, ends, qpos, bs, d**-0.5, 2.0, slopes)
    for row in range(q.shape[0]):
        if row in want:
            torch.testing.assert_close(
                out[row].double(), want[row], atol=TOL[dtype], rtol=TOL[dtype], msg=f"row {row}"
            )
        else:  # rows of unserved requests and past the batch: untouched
            assert bool((out[row] == 7.0).all()), row


def test_requests_entry_errors_name_the_argument_and_request() -> None:
    from attnkit.kernels.attention.cpu_decode import paged_attention_requests

    q, k, v, table = make_case(
        dtype=torch.float32, hq=4, hkv=2, d=16, bs=16, ranges=[(0, 20), (0, 5)], width=2
    )
    out = torch.zeros_like(q)

    def call(qsl: list[int], seq: list[int], **kw: object) -> None:
        args: dict[str, object] = {
            "block_size": 16, "causal": True, "window": None, "chunk": None,
            "scale": 0.25, "output": out,
        }  # fmt: skip
        args.update(kw)
        served = args.pop("requests", None)
        paged_attention_requests(
            q, k, v, table, torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(seq, dtype=torch.int32), served, **args,
        )  # fmt: skip

    with pytest.raises(ValueError, match=r"^seq_lens: expected seq_lens\[r\] >= 0 and, when"):
        call([0, 1, 3], [20, 1])  # request 1: 2 queries, 1 key
    with pytest.raises(ValueError, match=r"^query_start_loc: expected .* request 1$"):
        call([0, 2, 1], [20, 5])
    with pytest.raises(ValueError, match=r"^seq_lens: expected lengths <= W \* block_size = 32"):
        call([0, 1, 2], [33, 5])
    with pytest.raises(ValueError, match=r"^requests: expected requests in \[0, 2\), got 5"):
        call([0, 1, 2], [20, 5], requests=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^query_start_loc: expected a torch.int32 tensor \[N\]"):
        paged_attention_requests(
            q, k, v, table, torch.tensor([0, 1, 2]), torch.tensor([20, 5], dtype=torch.int32),
            None, block_size=16, causal=True, window=None, chunk=None, scale=0.25, output=out,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"^window: expected None when causal is False"):
        call([0, 1, 2], [20, 5], causal=False, window=4)
    bad = table.clone()
    bad[0, 1] = 999
    with pytest.raises(
        ValueError,
        match=r"^block_table: expected physical blocks .* got 999 at block_table\[0, 1\]",
    ):
        paged_attention_requests(
            q, k, v, bad, torch.tensor([0, 1, 2], dtype=torch.int32),
            torch.tensor([20, 5], dtype=torch.int32), None, block_size=16, causal=True,
            window=None, chunk=None, scale=0.25, output=out,
        )  # fmt: skip


# ---------------------------------------------------------------- instruction-set copies


@pytest.mark.parametrize(
    ("isa", "want"),
    [
        # the 16-lane copy (bf16 with D % 32 and AVX512-BF16), else run_task
        ("avx512bf16", {(0, 128): "vector8", (1, 128): "avx512bf16", (1, 80): "vector8"}),
        ("avx512", {(0, 128): "vector8", (1, 128): "vector8", (2, 128): "vector8"}),
        ("avx2", {(0, 128): "vector8", (1, 128): "vector8"}),
    ],
)
def test_every_instruction_set_copy(
    isa: str, want: dict[tuple[int, int], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each decode copy this CPU runs (ATTNKIT_CPU_ISA caps the choice), on head sizes
    that take it and that do not, with every score option, sinks and the lse."""
    from attnkit.kernels.attention.cpu_prefill_native import prefill_isa

    monkeypatch.setenv("ATTNKIT_CPU_ISA", isa)
    if prefill_isa() != isa:
        pytest.skip(f"this CPU does not run the {isa} copy (it runs {prefill_isa()})")
    lib = _native.load_paged_decode()
    for (code, d), name in want.items():
        assert lib.decode_isa(code, d) == name, (code, d)
    for dtype in (torch.float32, torch.bfloat16):
        for d in (128, 80, 32, 256):
            for threads in (1, 2):
                run_case(dtype, 8, 2, d, 16, RAGGED_16, threads=threads)
            run_case(dtype, 6, 3, d, 32, RAGGED_32, sinks=True, with_lse=True, cap=2.0,
                     alibi=True, strided=True)  # fmt: skip
        run_case(dtype, 8, 8, 64, 16, RAGGED_16, sinks=True, with_lse=True)  # G = 1
        run_case(dtype, 16, 2, 64, 16, RAGGED_16)  # G = 8


# ------------------------------------------------------------ fp16 conversions


def _fp16_step(seed: int) -> tuple[torch.Tensor, ...]:
    """A float16 decode step over a shuffled paged cache: query, planes, table, offsets,
    lengths."""
    gen = torch.Generator().manual_seed(seed)
    b, ctx, hq, hkv, d, bs = 3, 70, 8, 2, 80, 16
    nb = b * -(-ctx // bs) + 1
    q = torch.randn(b, hq, d, generator=gen).half()
    kp = torch.randn(nb * bs, hkv, d, generator=gen).half()
    vp = torch.randn(nb * bs, hkv, d, generator=gen).half()
    table = torch.randperm(nb, generator=gen)[: b * -(-ctx // bs)].to(torch.int32).view(b, -1)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    seq = torch.tensor([ctx, ctx - 9, 33], dtype=torch.int32)
    return q, kp, vp, table.contiguous(), qsl, seq


def _fp16_decode(step: tuple[torch.Tensor, ...]) -> torch.Tensor:
    from attnkit.kernels.attention.cpu_decode import paged_attention_requests

    q, kp, vp, table, qsl, seq = step
    out = torch.empty_like(q)
    paged_attention_requests(
        q, kp, vp, table, qsl, seq, None, block_size=16, causal=True, window=None,
        chunk=None, scale=0.125, output=out,
    )  # fmt: skip
    return out


@pytest.mark.slow
def test_fp16_rows_convert_the_same_without_f16c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float16 K/V rows go to float32 eight at a time by F16C where the CPU has it, else
    one by one: both are exact, so a build without the F16C path gives the same bits on
    the same step (decode here; the prefill's rows use the same conversion)."""
    step = _fp16_step(0)
    got = _fp16_decode(step)
    q, kp, vp, table, _, seq = step
    ends = [int(n) for n in seq]
    want = oracle(q, kp, vp, table, [0, 1, 2], [0, 1, 2], [0, 0, 0], ends,
                  [n - 1 for n in ends], 16, 0.125)  # fmt: skip
    for r in range(3):  # the F16C build against the float64 oracle
        assert (got[r].double() - want[r]).abs().max().item() < 2e-3
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_native, "_DEFINES", ("ATTNKIT_TEST_NO_F16C",))
    monkeypatch.setattr(_native, "_STATE", [])
    assert torch.equal(_fp16_decode(step), got)
