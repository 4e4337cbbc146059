"""The CPU engines over 8-bit K/V planes: fp8 e4m3 with a per-tensor or per-head scale,
fp8 e5m2 per head, and the per-token-head fp8 e4m3 / int8 planes whose rows carry their
float32 scales (``[R, Hkv, D + 4]``).

The oracle is float64 attention written here over the values the test itself stored and
dequantises itself (``stored * scale``). Every case runs both engines (the paged decode
over decode rows and short runs, the blocked prefill over chunks with a context), one and
two threads, shuffled block tables and planes whose unused slots are all bits set (NaN
values, NaN scales). The control: heads whose magnitudes differ by 100x, where a
per-tensor fp8 scale visibly loses accuracy and per-head scales do not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from attnkit.kernels.attention import cpu_decode, cpu_prefill
from attnkit.kernels.attention.cpu_decode import native_problem, paged_attention_requests
from attnkit.kernels.attention.cpu_kv_format import KVFormat
from attnkit.kernels.attention.cpu_prefill import paged_prefill

pytestmark = pytest.mark.skipif(
    native_problem() is not None, reason=f"native CPU kernels unavailable: {native_problem()}"
)

HKV, HQ, BS = 2, 4, 16
QMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}

# (name, storage dtype, scales): "tensor" one scale, "head" one per K/V head, "token"
# one per (token, head) kept in the row.
FORMATS = [
    ("fp8_e4m3-tensor", torch.float8_e4m3fn, "tensor"),
    ("fp8_e4m3-head", torch.float8_e4m3fn, "head"),
    ("fp8_e5m2-head", torch.float8_e5m2, "head"),
    ("fp8_e4m3-token", torch.float8_e4m3fn, "token"),
    ("int8-token", torch.int8, "token"),
]


# ----------------------------------------------------------------- the test's own quantiser


def _store(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` saturated to the format's range and cast (int8: rounded to nearest)."""
    y = (x / scale).clamp(-QMAX[dtype], QMAX[dtype])
    return torch.round(y).to(dtype) if dtype == torch.int8 else y.to(dtype)


@dataclass
class Planes:
    k: torch.Tensor  # the planes the engines read
    v: torch.Tensor
    k_deq: torch.Tensor  # float64 [R, Hkv, D]: what the oracle reads
    v_deq: torch.Tensor
    k_scale: torch.Tensor | None  # static scales [Hkv] (None: in the rows)
    v_scale: torch.Tensor | None


def _planes(
    kf: torch.Tensor, vf: torch.Tensor, dtype: torch.dtype, mode: str, written: torch.Tensor
) -> Planes:
    """8-bit planes holding ``kf``/``vf`` ``[R, Hkv, D]`` at the ``written`` rows; every
    other row is all bits set (NaN in fp8 and in a float32 scale)."""
    r, hkv, d = kf.shape
    cols = d + 4 if mode == "token" else d
    out: list[torch.Tensor] = []
    deq: list[torch.Tensor] = []
    statics: list[torch.Tensor | None] = []
    for x in (kf, vf):
        plane = torch.full((r, hkv, cols), 0xFF, dtype=torch.uint8)
        if mode == "token":
            s = x.abs().amax(-1) / QMAX[dtype]  # [R, Hkv]
            s = torch.where(s > 0, s, torch.ones_like(s))
            stored = _store(x, dtype, s[..., None])
            plane[:, :, :d] = stored.view(torch.uint8)
            plane[:, :, d:] = s.contiguous().view(torch.uint8).reshape(r, hkv, 4)
            deq.append(stored.double() * s.double()[..., None])
            statics.append(None)
        else:
            if mode == "tensor":
                s = (x.abs().amax() / QMAX[dtype]).expand(hkv).contiguous()
            else:
                s = x.abs().amax(dim=(0, 2)) / QMAX[dtype]
            stored = _store(x, dtype, s[None, :, None])
            plane[:, :, :] = stored.view(torch.uint8)
            deq.append(stored.double() * s.double()[None, :, None])
            statics.append(s.float().contiguous())
        keep = torch.zeros(r, dtype=torch.bool)
        keep[written] = True
        plane[~keep] = 0xFF
        out.append(plane.view(dtype))
    return Planes(out[0], out[1], deq[0], deq[1], statics[0], statics[1])


# ----------------------------------------------------------------- the float64 oracle


def _oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    qsl: list[int],
    seqs: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal float64 attention of each request's queries (its last positions) over its
    keys, read through the block table from the dequantised planes."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    g = q.shape[1] // k.shape[1]
    for b, seq in enumerate(seqs):
        pos = torch.arange(seq)
        rows = table[b, pos // BS].long() * BS + pos % BS
        kk = k[rows].repeat_interleave(g, dim=1)
        vv = v[rows].repeat_interleave(g, dim=1)
        qq = q[qsl[b] : qsl[b + 1]].double()
        qlen = qq.shape[0]
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        i = torch.arange(seq - qlen, seq)[:, None]
        s = s.masked_fill(pos[None, :] > i, float("-inf"))
        out[qsl[b] : qsl[b + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    return out


# ----------------------------------------------------------------- the engines


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


Engine = Callable[..., torch.Tensor]


def _decode(q, planes, table, qsl, seqs, scale):  # type: ignore[no-untyped-def]  # test helper
    out = torch.full_like(q, float("nan"))
    paged_attention_requests(
        q, planes.k, planes.v, table,
        torch.tensor(qsl, dtype=torch.int32), torch.tensor(seqs, dtype=torch.int32), None,
        block_size=BS, causal=True, window=None, chunk=None, scale=scale, output=out,
        k_scale=planes.k_scale, v_scale=planes.v_scale,
    )  # fmt: skip
    return out


def _prefill(q, planes, table, qsl, seqs, scale):  # type: ignore[no-untyped-def]  # test helper
    out = torch.full_like(q, float("nan"))
    n = len(seqs)
    paged_prefill(
        q, planes.k, planes.v, table,
        np.arange(n, dtype=np.int64), np.array(qsl[:-1], dtype=np.int64),
        np.diff(np.array(qsl, dtype=np.int64)), np.array(seqs, dtype=np.int64),
        block_size=BS, causal=True, window=None, chunk=None, scale=scale, output=out,
        k_scale=planes.k_scale, v_scale=planes.v_scale,
    )  # fmt: skip
    return out


ENGINES: dict[str, tuple[Engine, tuple[int, ...]]] = {
    # decode rows and runs of up to 4 queries / prefill chunks after a context
    "decode": (_decode, (1, 3, 1, 4)),
    "prefill": (_prefill, (37, 20, 64, 5)),
}


def _case(
    dtype: torch.dtype,
    mode: str,
    d: int,
    qlens: tuple[int, ...],
    seed: int,
    mags: tuple[float, ...] = (1.0, 1.0),
    q_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, Planes, torch.Tensor, list[int], list[int], torch.Tensor]:
    """Queries, planes with a shuffled block table, and the float64 oracle; also the
    unquantised float64 attention (the control's truth)."""
    g = torch.Generator().manual_seed(seed)
    hkv = len(mags)
    seqs = [ql + c for ql, c in zip(qlens, (70, 18, 41, 100), strict=True)]
    width = max(-(-s // BS) for s in seqs)
    nb = len(seqs) * width + 3
    perm = torch.randperm(nb - 1, generator=g)[: len(seqs) * width] + 1
    table = perm.reshape(len(seqs), width).to(torch.int32)
    r = nb * BS
    m = torch.tensor(mags)[None, :, None]
    kf = torch.randn(r, hkv, d, generator=g) * m
    vf = torch.randn(r, hkv, d, generator=g) * m
    written = torch.cat(
        [
            table[b, torch.arange(s) // BS].long() * BS + torch.arange(s) % BS
            for b, s in enumerate(seqs)
        ]
    )
    planes = _planes(kf, vf, dtype, mode, written)
    qsl = [0, *np.cumsum(qlens).tolist()]
    qm = torch.tensor(mags).repeat_interleave(HQ // HKV)[None, :, None]
    q = (torch.randn(qsl[-1], hkv * HQ // HKV, d, generator=g) / qm).to(q_dtype)
    exact = _oracle(q, kf.double(), vf.double(), table, qsl, seqs, d**-0.5)
    return q, planes, table, qsl, seqs, exact


def _errors(out: torch.Tensor, held: torch.Tensor) -> tuple[float, float]:
    diff = (out.double() - held).abs()
    return float(diff.max()), float((diff / held.abs().clamp_min(1e-3)).max())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("d", [64, 128, 80])
@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize(("name", "dtype", "mode"), FORMATS, ids=[f[0] for f in FORMATS])
def test_engines_match_the_float64_oracle_on_dequantised_values(
    name: str, dtype: torch.dtype, mode: str, engine: str, d: int, threads: int
) -> None:
    run, qlens = ENGINES[engine]
    q, planes, table, qsl, seqs, _ = _case(dtype, mode, d, qlens, seed=d + threads)
    held = _oracle(q, planes.k_deq, planes.v_deq, table, qsl, seqs, d**-0.5)
    with _threads(threads):
        out = run(q, planes, table, qsl, seqs, d**-0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), held, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize(("name", "dtype", "mode"), FORMATS[1:], ids=[f[0] for f in FORMATS[1:]])
def test_bf16_queries_over_8_bit_planes(
    name: str, dtype: torch.dtype, mode: str, engine: str
) -> None:
    run, qlens = ENGINES[engine]
    q, planes, table, qsl, seqs, _ = _case(dtype, mode, 128, qlens, seed=5, q_dtype=torch.bfloat16)
    held = _oracle(q, planes.k_deq, planes.v_deq, table, qsl, seqs, 128**-0.5)
    out = run(q, planes, table, qsl, seqs, 128**-0.5)
    torch.testing.assert_close(out.double(), held, atol=1e-2, rtol=1.6e-2)


# ----------------------------------------------------------------- the control


MAGS = (1.0, 1e-2, 1e-4, 1e-6)  # adjacent K/V heads differ by 100x


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_per_head_scales_keep_the_small_head_where_a_per_tensor_scale_loses_it(engine: str) -> None:
    run, qlens = ENGINES[engine]
    errs: dict[str, list[float]] = {}
    for mode in ("head", "tensor"):
        q, planes, table, qsl, seqs, exact = _case(
            torch.float8_e4m3fn, mode, 64, qlens, seed=11, mags=MAGS
        )
        out = run(q, planes, table, qsl, seqs, 64**-0.5).double()
        # per K/V head: the relative error of its query heads' outputs
        per_q = ((out - exact).norm(dim=(0, 2)) / exact.norm(dim=(0, 2))).tolist()
        errs[mode] = [max(per_q[2 * h : 2 * h + 2]) for h in range(len(MAGS))]
    # Per head: every head at fp8's own accuracy. Per tensor: the smaller heads' values
    # fall to e4m3's subnormals (or to zero) and lose most of their bits.
    assert max(errs["head"]) < 0.06, errs
    assert errs["tensor"][2] > 1.5 * errs["head"][2], errs
    assert errs["tensor"][3] > 0.5, errs


# ----------------------------------------------------------------- broken variants


def _patched_format(
    monkeypatch: pytest.MonkeyPatch, change: Callable[[KVFormat], KVFormat]
) -> None:
    """Both wrappers hand the native code a changed format (a broken engine's view)."""
    for module in (cpu_decode, cpu_prefill):
        real = module.kv_format

        def broken(*args: object, _real: Callable[..., KVFormat] = real) -> KVFormat:
            return change(_real(*args))

        monkeypatch.setattr(module, "kv_format", broken)


def _ignore_scale(f: KVFormat) -> KVFormat:
    ones = None if f.k_scale is None else torch.ones_like(f.k_scale)
    return KVFormat(f.code, ones, ones)


def _head_zero_scale(f: KVFormat) -> KVFormat:
    assert f.k_scale is not None
    assert f.v_scale is not None
    return KVFormat(
        f.code,
        f.k_scale[:1].expand_as(f.k_scale).contiguous(),
        f.v_scale[:1].expand_as(f.v_scale).contiguous(),
    )


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("change", [_ignore_scale, _head_zero_scale])
def test_an_engine_that_misreads_static_scales_is_caught(
    engine: str, change: Callable[[KVFormat], KVFormat], monkeypatch: pytest.MonkeyPatch
) -> None:
    _patched_format(monkeypatch, change)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        test_engines_match_the_float64_oracle_on_dequantised_values(
            "fp8_e4m3-head", torch.float8_e4m3fn, "head", engine, 64, 1
        )


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_an_engine_that_reads_the_wrong_tokens_scale_is_caught(engine: str) -> None:
    """A broken engine reads each row's scale from the next row: the planes it sees
    have their scale bytes shifted by one slot."""
    run, qlens = ENGINES[engine]
    d = 64
    q, planes, table, qsl, seqs, _ = _case(torch.int8, "token", d, qlens, seed=3)
    held = _oracle(q, planes.k_deq, planes.v_deq, table, qsl, seqs, d**-0.5)

    def shifted(p: torch.Tensor) -> torch.Tensor:
        raw = p.view(torch.uint8).clone()
        raw[:, :, d:] = torch.roll(raw[:, :, d:], -1, dims=0)
        return raw.view(p.dtype)

    broken = Planes(shifted(planes.k), shifted(planes.v), planes.k_deq, planes.v_deq, None, None)
    out = run(q, broken, table, qsl, seqs, d**-0.5)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(out.double(), held, atol=2e-5, rtol=1e-4)
    # the same check passes on the planes as written
    torch.testing.assert_close(
        run(q, planes, table, qsl, seqs, d**-0.5).double(), held, atol=2e-5, rtol=1e-4
    )


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8], ids=str)
def test_every_byte_reads_as_its_exact_value(dtype: torch.dtype, engine: str) -> None:
    """Every byte of the format (NaNs aside) as the one value of a single key (zero
    keys): the output is exactly the byte's value times the scale, 0.75 (exact)."""
    run, _ = ENGINES[engine]
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    d = 16
    for b in torch.nonzero(~values.isnan()).flatten().tolist():
        k = torch.zeros(BS, HKV, d, dtype=torch.uint8).view(dtype)
        v = torch.full((BS, HKV, d), b, dtype=torch.uint8).view(dtype)
        scale = torch.full((HKV,), 0.75)
        planes = Planes(k, v, k.double(), v.double(), scale, scale)
        q = torch.zeros(1, HQ, d)
        out = run(q, planes, torch.zeros(1, 1, dtype=torch.int32), [0, 1], [1], 1.0)
        assert torch.equal(out.flatten(), (values[b] * 0.75).expand(HQ * d)), b


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_misread_format_is_caught(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken engine that reads e4m3 bytes as e5m2."""
    _patched_format(monkeypatch, lambda f: KVFormat(4, f.k_scale, f.v_scale))
    with pytest.raises(AssertionError):
        test_every_byte_reads_as_its_exact_value(torch.float8_e4m3fn, engine)


# ----------------------------------------------------------------- bad input


def test_bad_plane_formats_name_the_argument() -> None:
    q = torch.zeros(1, HQ, 64)
    out = torch.empty_like(q)
    table = torch.zeros(1, 1, dtype=torch.int32)
    qsl, seq = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    kw = {
        "block_size": BS,
        "causal": True,
        "window": None,
        "chunk": None,
        "scale": 1.0,
        "output": out,
    }
    fp8 = torch.zeros(BS, HKV, 64, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"k_plane: expected \[R, Hkv, D \+ 4\]"):
        paged_attention_requests(q, fp8, fp8, table, qsl, seq, None, **kw)  # type: ignore[arg-type]  # kw is untyped on purpose
    with pytest.raises(ValueError, match=r"k_scale: expected a float32 tensor \[2\]"):
        paged_attention_requests(
            q, fp8, fp8, table, qsl, seq, None, k_scale=torch.ones(3), v_scale=torch.ones(2), **kw
        )  # type: ignore[arg-type]  # as above
    with pytest.raises(
        ValueError, match=r"k_scale: expected a float32 tensor \[2\] on cpu of finite scales > 0"
    ):
        paged_attention_requests(
            q,
            fp8,
            fp8,
            table,
            qsl,
            seq,
            None,
            k_scale=torch.tensor([1.0, 0.0]),
            v_scale=torch.ones(2),
            **kw,
        )  # type: ignore[arg-type]  # as above
    with pytest.raises(ValueError, match=r"k_scale, v_scale: expected both tensors or both None"):
        paged_attention_requests(q, fp8, fp8, table, qsl, seq, None, k_scale=torch.ones(2), **kw)  # type: ignore[arg-type]  # as above
    f32 = torch.zeros(BS, HKV, 64)
    with pytest.raises(ValueError, match=r"k_scale: expected None for torch.float32 planes"):
        paged_attention_requests(
            q, f32, f32, table, qsl, seq, None, k_scale=torch.ones(2), v_scale=torch.ones(2), **kw
        )  # type: ignore[arg-type]  # as above
    f16 = torch.zeros(BS, HKV, 64, dtype=torch.float16)
    with pytest.raises(
        ValueError,
        match=r"k_plane: expected dtype torch.float32 \(the query's\) or an 8-bit format",
    ):
        paged_attention_requests(q, f16, f16, table, qsl, seq, None, **kw)  # type: ignore[arg-type]  # as above
    with pytest.raises(ValueError, match=r"k_plane: expected \[R, Hkv, D \+ 4\]"):
        paged_prefill(
            q, fp8, fp8, table, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64),
            np.ones(1, dtype=np.int64), np.ones(1, dtype=np.int64), **kw,  # type: ignore[arg-type]  # as above
        )  # fmt: skip


# ----------------------------------------------------------------- log-sum-exp


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize(("name", "dtype", "mode"), FORMATS[1:], ids=[f[0] for f in FORMATS[1:]])
def test_lse_over_8_bit_planes_matches_the_float64_oracle(
    name: str, dtype: torch.dtype, mode: str, engine: str
) -> None:
    """The engines' log-sum-exp (context parallelism merges partials by it) over the
    dequantised keys."""
    _, qlens = ENGINES[engine]
    d = 64
    q, planes, table, qsl, seqs, _ = _case(dtype, mode, d, qlens, seed=9)
    lse = torch.full((q.shape[0], q.shape[1]), float("nan"))
    out = torch.full_like(q, float("nan"))
    kw = {"k_scale": planes.k_scale, "v_scale": planes.v_scale, "lse": lse, "output": out}
    if engine == "decode":
        paged_attention_requests(
            q, planes.k, planes.v, table, torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(seqs, dtype=torch.int32), None, block_size=BS, causal=True,
            window=None, chunk=None, scale=d**-0.5, **kw,  # type: ignore[arg-type]  # kw's values are typed per key
        )  # fmt: skip
    else:
        paged_prefill(
            q, planes.k, planes.v, table, np.arange(len(seqs), dtype=np.int64),
            np.array(qsl[:-1], dtype=np.int64), np.diff(np.array(qsl, dtype=np.int64)),
            np.array(seqs, dtype=np.int64), block_size=BS, causal=True, window=None,
            chunk=None, scale=d**-0.5, **kw,  # type: ignore[arg-type]  # as above
        )  # fmt: skip
    want = torch.empty(lse.shape, dtype=torch.float64)
    g = HQ // HKV
    for b, seq in enumerate(seqs):
        pos = torch.arange(seq)
        rows = table[b, pos // BS].long() * BS + pos % BS
        kk = planes.k_deq[rows].repeat_interleave(g, dim=1)
        qq = q[qsl[b] : qsl[b + 1]].double()
        s = torch.einsum("qhd,khd->qhk", qq, kk) * d**-0.5
        i = torch.arange(seq - qq.shape[0], seq)[:, None, None]
        s = s.masked_fill(pos[None, None, :] > i, float("-inf"))
        want[qsl[b] : qsl[b + 1]] = torch.logsumexp(s, dim=-1)
    torch.testing.assert_close(lse.double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_an_lse_over_unscaled_keys_is_caught(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _patched_format(monkeypatch, _ignore_scale)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        test_lse_over_8_bit_planes_matches_the_float64_oracle(
            "fp8_e4m3-head", torch.float8_e4m3fn, "head", engine
        )
