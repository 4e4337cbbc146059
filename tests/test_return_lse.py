"""Layers built with ``return_lse``: ``runtime.forward(..., lse=)`` writes each row's
natural-log sum of exp beside its output, on ``reference`` and on ``cpu_attn`` (the CPU
default), checked against a float64 oracle over chunked prefills and decodes of two
requests at once (NaN-filled caches), with per-head sinks and without; a kernel that
drops the window from the lse's keys is caught; bad ``lse`` arguments are refused and
change nothing."""

from __future__ import annotations

import pytest
import torch

from attnkit import (
    AttentionConfig,
    AttentionFeature,
    AttentionLayerParams,
    AttentionRuntime,
    ChunkedLocalAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    InvalidArgumentError,
    ScheduledRequest,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from attnkit.backends.cpu_attn import CpuAttentionBackend, CpuAttentionImpl
from attnkit.spec import AttentionSpec

HQ, HKV, D, BS = 4, 2, 16, 16
BUDGET = 1 << 22
WINDOW, CHUNK = 12, 16
# Request "a": a 40-token prompt in chunks of 24 and 16, then 3 decodes; "b": 5 tokens
# beside a's first chunk, then decodes.
STEPS: list[dict[str, int]] = [{"a": 24, "b": 5}, {"a": 16, "b": 1}, {"a": 1, "b": 1}, {"a": 1}, {"a": 1, "b": 1}]


def _spec(kind: str) -> AttentionSpec:
    common = {"block_size": BS, "num_kv_heads": HKV, "head_size": D, "dtype": torch.float32}
    if kind == "window":
        return SlidingWindowSpec(**common, sliding_window=WINDOW)  # type: ignore[arg-type]  # the shared fields
    if kind == "chunk":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=CHUNK)  # type: ignore[arg-type]  # the shared fields
    return FullAttentionSpec(**common)  # type: ignore[arg-type]  # the shared fields


def _runtime(backend: str, kind: str, sinks: torch.Tensor | None) -> AttentionRuntime:
    params = AttentionLayerParams(num_heads=HQ, return_lse=True, sinks=sinks)
    return AttentionRuntime(
        {"layer": _spec(kind)},
        AttentionConfig(backend=backend),
        device="cpu",
        memory_budget_bytes=BUDGET,
        layer_params={"layer": params},
        cache_fill=float("nan"),
    )


def oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kind: str,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention of the last ``len(q)`` positions of one request over its
    ``len(k)`` keys: the output ``[T, Hq, D]`` and the lse ``[T, Hq]``."""
    t, n = q.shape[0], k.shape[0]
    kd = k.double().repeat_interleave(HQ // HKV, dim=1)
    vd = v.double().repeat_interleave(HQ // HKV, dim=1)
    pos = torch.arange(n - t, n)[:, None]
    keys = torch.arange(n)[None, :]
    seen = keys <= pos
    if kind == "window":
        seen &= keys > pos - WINDOW
    if kind == "chunk":
        seen &= keys >= pos - pos % CHUNK
    scores = torch.einsum("qhd,khd->hqk", q.double(), kd) * D**-0.5
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(HQ, t, 1)
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), vd)
    return out, lse.T


def _run(backend: str, kind: str, sinks: torch.Tensor | None) -> tuple[float, float]:
    """The steps through the runtime; the worst output and lse errors against the oracle."""
    gen = torch.Generator().manual_seed(7)
    total = {r: sum(s.get(r, 0) for s in STEPS) for r in ("a", "b")}
    q = {r: torch.randn(n, HQ, D, generator=gen) for r, n in total.items()}
    k = {r: torch.randn(n, HKV, D, generator=gen) for r, n in total.items()}
    v = {r: torch.randn(n, HKV, D, generator=gen) for r, n in total.items()}
    rt = _runtime(backend, kind, sinks)
    done = dict.fromkeys(total, 0)
    out_err = lse_err = 0.0
    for step in STEPS:
        batch = rt.begin_step([ScheduledRequest(r, n) for r, n in step.items()])
        rows = batch.token_slices()
        qs = torch.zeros(batch.num_tokens, HQ, D)
        ks = torch.zeros(batch.num_tokens, HKV, D)
        vs = torch.zeros(batch.num_tokens, HKV, D)
        for r, n in step.items():
            qs[rows[r]] = q[r][done[r] : done[r] + n]
            ks[rows[r]] = k[r][done[r] : done[r] + n]
            vs[rows[r]] = v[r][done[r] : done[r] + n]
        lse = torch.full((batch.num_tokens, HQ), float("nan"))
        out = rt.forward("layer", qs, ks, vs, lse=lse)
        for r, n in step.items():
            end = done[r] + n
            want, want_lse = oracle(q[r][done[r] : end], k[r][:end], v[r][:end], kind, sinks)
            out_err = max(out_err, (out[rows[r]].double() - want).abs().max().item())
            lse_err = max(lse_err, (lse[rows[r]].double() - want_lse).abs().max().item())
            done[r] = end
    return out_err, lse_err


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("kind", ["full", "window", "chunk"])
@pytest.mark.parametrize("backend", ["reference", "cpu_attn"])
def test_lse_matches_the_float64_oracle(backend: str, kind: str, sinks: bool) -> None:
    sink_logits = torch.linspace(-1.0, 2.0, HQ) if sinks else None
    out_err, lse_err = _run(backend, kind, sink_logits)
    assert out_err < 2e-5, f"{backend} {kind}: output off by {out_err}"
    assert lse_err < 2e-5, f"{backend} {kind}: lse off by {lse_err}"


def test_an_lse_over_keys_outside_the_window_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: cpu_attn's work items start every row at key 0 (the window
    ignored), which the oracle comparison above must see."""
    items = CpuAttentionImpl._lse_items

    def from_zero(self: CpuAttentionImpl, m: object) -> tuple[torch.Tensor, ...]:
        rows, req, starts, ends, pos = items(self, m)  # type: ignore[arg-type]  # the metadata passed on
        return rows, req, torch.zeros_like(starts), ends, pos

    monkeypatch.setattr(CpuAttentionImpl, "_lse_items", from_zero)
    _, lse_err = _run("cpu_attn", "window", None)
    assert lse_err > 1e-2


def test_the_cpu_default_returns_the_lse_for_the_kinds_it_serves() -> None:
    """cpu_attn is the CPU default for return_lse layers of the kinds it serves; a
    sink-token or encoder-only layer with return_lse goes to reference, with a reason."""
    assert AttentionFeature.RETURN_LSE in CpuAttentionBackend.supported_features
    for kind in ("full", "window", "chunk"):
        default = AttentionRuntime(
            {"layer": _spec(kind)},
            AttentionConfig(),
            device="cpu",
            memory_budget_bytes=BUDGET,
            layer_params={"layer": AttentionLayerParams(num_heads=HQ, return_lse=True)},
        )
        assert default.backend_for("layer").name == "cpu_attn"
    common = {"block_size": BS, "num_kv_heads": HKV, "head_size": D, "dtype": torch.float32}
    sink_kv = {"sink_key": torch.randn(4, HKV, D), "sink_value": torch.randn(4, HKV, D)}
    for spec, extra in (
        (SinkFullAttentionSpec(**common, sink_len=4), sink_kv),  # type: ignore[arg-type]  # the shared fields
        (EncoderOnlyAttentionSpec(**common), {}),  # type: ignore[arg-type]  # the shared fields
    ):
        params = AttentionLayerParams(num_heads=HQ, return_lse=True, **extra)  # type: ignore[arg-type]  # the sink tensors
        with pytest.raises(ValueError, match="return_lse not supported for kind"):
            CpuAttentionImpl(spec, params)
        default = AttentionRuntime(
            {"layer": spec},
            AttentionConfig(),
            device="cpu",
            memory_budget_bytes=BUDGET,
            layer_params={"layer": params},
        )
        assert default.backend_for("layer").name == "reference"
        reasons = [r for sel in default.selections for x in sel.rejected for r in x.reasons]
        assert any("return_lse not supported for kind" in r for r in reasons), reasons


def test_bad_lse_arguments_are_refused_and_change_nothing() -> None:
    rt = _runtime("cpu_attn", "full", None)
    batch = rt.begin_step([ScheduledRequest("a", 3)])
    q, kv = torch.randn(3, HQ, D), torch.randn(3, HKV, D)
    before = [c.clone() for c in rt.kv_caches["layer"]]
    for bad, match in (
        (torch.zeros(3, HQ, dtype=torch.float64), r"lse must be a float32 tensor \[3, 4\]"),
        (torch.zeros(2, HQ), r"lse must be a float32 tensor \[3, 4\]"),
        ([0.0] * 3, r"lse must be a float32 tensor"),
    ):
        with pytest.raises((InvalidArgumentError, TypeError), match=match):
            rt.forward("layer", q, kv, kv, lse=bad)  # type: ignore[arg-type]  # wrong on purpose
    after = rt.kv_caches["layer"]
    # Nothing written (the caches are NaN-filled: NaN compares equal to NaN here).
    assert all(
        torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
        for a, b in zip(before, after, strict=True)
    )
    plain = AttentionRuntime(
        {"layer": _spec("full")},
        AttentionConfig(backend="cpu_attn"),
        device="cpu",
        memory_budget_bytes=BUDGET,
        layer_params={"layer": AttentionLayerParams(num_heads=HQ)},
    )
    plain.begin_step([ScheduledRequest("a", 3)])
    with pytest.raises(InvalidArgumentError, match=r"built with layer_params.return_lse=True"):
        plain.forward("layer", q, kv, kv, lse=torch.zeros(3, HQ))
    assert batch.num_tokens == 3
