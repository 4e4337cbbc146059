"""The ``cpu_mla`` backend (absorbed MLA on the CPU engines) through the runtime, against
a float64 oracle written here: DeepSeek-V3's latent (R = 512, rope 64, D = 576, scale
192^-0.5) and small shapes, full and sliding-window MLA, over chunked prefills beside
decodes (both engines) on NaN-filled caches, in float32 and bfloat16. The cache must
hold exactly the latents written. A value read past R, and a latent write that skips a
token, are shown to be caught; layers asking for what it does not serve are refused
with reasons, and the CPU default routes MLA layers to it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnkit import (
    AttentionConfig,
    AttentionFeature,
    AttentionLayerParams,
    AttentionRuntime,
    MLAAttentionSpec,
    ScheduledRequest,
    SlidingWindowMLASpec,
)
from attnkit.backends._planes import PlanesWrites
from attnkit.backends.cpu_attn import CpuMLAImpl
from attnkit.selector import select_backend
from attnkit.spec import AttentionSpec, KVCacheDType

BS = 16
WINDOW = 20
# "a": a 45-token prompt in chunks of 29 and 16 (the prefill engine), then decodes; "b":
# 3 tokens (the decode kernel's runs) beside a's first chunk, then decodes; "c" arrives
# late with 2.
STEPS: list[dict[str, int]] = [
    {"a": 29, "b": 3},
    {"a": 16, "b": 1},
    {"a": 1, "b": 1, "c": 2},
    {"a": 1, "c": 1},
    {"a": 1, "b": 1, "c": 1},
]
TOL = {torch.float32: 3e-5, torch.bfloat16: 3e-2}


def _spec(kind: str, d: int, dtype: torch.dtype, kv: KVCacheDType = "auto") -> AttentionSpec:
    if kind == "window":
        return SlidingWindowMLASpec(
            block_size=BS, num_kv_heads=1, head_size=d, dtype=dtype, sliding_window=WINDOW,
            kv_cache_dtype=kv,
        )  # fmt: skip
    return MLAAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=d, dtype=dtype, kv_cache_dtype=kv
    )  # type: ignore[arg-type]  # a KVCacheDType literal


def oracle(
    q: torch.Tensor, latents: torch.Tensor, r: int, scale: float, window: int | None
) -> torch.Tensor:
    """Float64 absorbed MLA of the last ``len(q)`` positions of one request over its
    latents: scores against the whole latent, values its first ``r`` channels."""
    t, n = q.shape[0], latents.shape[0]
    lat = latents.double()
    pos = torch.arange(n - t, n)[:, None]
    keys = torch.arange(n)[None, :]
    seen = keys <= pos
    if window is not None:
        seen &= keys > pos - window
    scores = torch.einsum("qhd,kd->hqk", q.double(), lat) * scale
    p = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return torch.einsum("hqk,kd->qhd", p, lat[:, :r])


def _fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an fp8 e4m3 latent cache stores: ``x / scale`` saturated to +-448, rounded."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def _run(
    kind: str,
    heads: int,
    d: int,
    r: int,
    dtype: torch.dtype,
    backend: str = "cpu_mla",
    fp8_scale: float | None = None,
) -> float:
    """The steps through the runtime; the worst error against the oracle. Checks that
    the cache holds every latent written, bit for bit."""
    scale = 192**-0.5 if d == 576 else d**-0.5
    gen = torch.Generator().manual_seed(11)
    total = {name: sum(s.get(name, 0) for s in STEPS) for name in ("a", "b", "c")}
    q = {n: torch.randn(t, heads, d, generator=gen).to(dtype) for n, t in total.items()}
    lat = {n: torch.randn(t, 1, d, generator=gen).to(dtype) for n, t in total.items()}
    rt = AttentionRuntime(
        {"layer": _spec(kind, d, dtype, "auto" if fp8_scale is None else "fp8_e4m3")},
        AttentionConfig(backend=backend),
        device="cpu",
        memory_budget_bytes=1 << 24,
        layer_params={
            "layer": AttentionLayerParams(
                num_heads=heads,
                v_head_size=r,
                scale=scale,
                **({} if fp8_scale is None else {"k_scale": fp8_scale, "v_scale": fp8_scale}),
            )
        },
        cache_fill=float("nan"),
    )
    assert rt.backend_for("layer").name == backend
    done = dict.fromkeys(total, 0)
    worst = 0.0
    window = WINDOW if kind == "window" else None
    for step in STEPS:
        batch = rt.begin_step([ScheduledRequest(n, t) for n, t in step.items()])
        rows = batch.token_slices()
        qs = torch.zeros(batch.num_tokens, heads, d, dtype=dtype)
        ks = torch.zeros(batch.num_tokens, 1, d, dtype=dtype)
        for n, t in step.items():
            qs[rows[n]] = q[n][done[n] : done[n] + t]
            ks[rows[n]] = lat[n][done[n] : done[n] + t]
        out = rt.forward("layer", qs, ks, None)
        assert out.shape == (batch.num_tokens, heads, r)
        for n, t in step.items():
            end = done[n] + t
            seen = lat[n][:end, 0]
            if fp8_scale is not None:  # what attention sees: the stored values
                seen = _fp8(seen, fp8_scale).double() * fp8_scale
            want = oracle(q[n][done[n] : end], seen, r, scale, window)
            worst = max(worst, (out[rows[n]].double() - want).abs().max().item())
            done[n] = end
    cache = rt.kv_caches["layer"][0].reshape(-1, d)
    for n, t in total.items():
        table = torch.tensor(rt.block_table("layer", n))
        pos = torch.arange(t)
        blocks = table[pos // BS]
        live = blocks != 0  # a window layer gives blocks past its window back (block 0)
        stored = cache[blocks[live] * BS + pos[live] % BS]
        want = lat[n][live, 0] if fp8_scale is None else _fp8(lat[n][live, 0], fp8_scale)
        assert torch.equal(stored.view(torch.uint8), want.view(torch.uint8)), (
            f"request {n}: the cache lost latents"
        )
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["full", "window"])
@pytest.mark.parametrize(
    ("heads", "d", "r"), [(4, 576, 512), (8, 48, 32)], ids=["deepseek", "small"]
)
def test_matches_the_float64_oracle(
    kind: str, heads: int, d: int, r: int, dtype: torch.dtype
) -> None:
    err = _run(kind, heads, d, r, dtype)
    assert err < TOL[dtype], f"{kind} {d}/{r} {dtype}: off by {err}"


def test_values_read_past_the_rank_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: the last R channels of the engines' rows kept (the rope part
    read as values) instead of the first."""
    monkeypatch.setattr(CpuMLAImpl, "_values", lambda self, rows: rows[..., -self.kv_lora_rank :])
    assert _run("full", 4, 576, 512, torch.float32) > 1e-2


def test_a_latent_write_that_skips_a_token_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: the last new latent of each step is not written (the cache
    keeps NaN there, which the oracle comparison or the cache check must see)."""
    write = CpuMLAImpl._write_latents

    def skip_last(
        self: CpuMLAImpl, plane: torch.Tensor, key: torch.Tensor, writes: PlanesWrites
    ) -> None:
        assert writes.slots is not None
        write(self, plane, key, dataclasses.replace(writes, slots=writes.slots[:-1]))

    monkeypatch.setattr(CpuMLAImpl, "_write_latents", skip_last)
    with pytest.raises(AssertionError, match="the cache lost latents"):
        _run("full", 4, 576, 512, torch.float32)


def test_the_cpu_default_routes_mla_to_it() -> None:
    spec = _spec("full", 576, torch.bfloat16)
    chosen = select_backend(spec, AttentionConfig(), device="cpu")
    assert chosen.backend_name == "cpu_mla"
    window = select_backend(_spec("window", 576, torch.bfloat16), AttentionConfig(), device="cpu")
    assert window.backend_name == "cpu_mla"


@pytest.mark.parametrize(
    ("features", "reason"),
    [
        (frozenset({AttentionFeature.SPARSE_ATTENTION}), "feature sparse_attention not supported"),
    ],
)
def test_what_it_does_not_serve_goes_to_reference(
    features: frozenset[AttentionFeature], reason: str
) -> None:
    spec = _spec("full", 576, torch.bfloat16)
    chosen = select_backend(spec, AttentionConfig(), device="cpu", features=features)
    assert chosen.backend_name == "reference"
    (mine,) = [r for r in chosen.rejected if r.backend == "cpu_mla"]
    assert any(reason in x for x in mine.reasons), mine.reasons


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["full", "window"])
def test_an_fp8_latent_cache_matches_the_oracle_on_its_stored_values(
    kind: str, dtype: torch.dtype
) -> None:
    """fp8 e4m3 latents (stored ``latent / k_scale``; the oracle attends the dequantised
    values); a power-of-two scale keeps the test's own quantiser exact."""
    assert (
        select_backend(
            _spec(kind, 576, torch.bfloat16, "fp8_e4m3"), AttentionConfig(), device="cpu"
        ).backend_name
        == "cpu_mla"
    )
    err = _run(kind, 4, 576, 512, dtype, fp8_scale=0.25)
    assert err < TOL[dtype], err


def test_an_fp8_cache_read_without_its_scale_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: the engines given no latent scale (the stored values read as
    if they were the latents)."""
    init = CpuMLAImpl.__init__

    def no_scale(self: CpuMLAImpl, *args: object) -> None:
        init(self, *args)  # type: ignore[arg-type]  # passed on
        self._latent_scale = torch.ones(1)

    monkeypatch.setattr(CpuMLAImpl, "__init__", no_scale)
    assert _run("full", 4, 576, 512, torch.bfloat16, fp8_scale=0.25) > 0.1


def test_a_rank_wider_than_the_latent_is_refused_at_construction() -> None:
    with pytest.raises(
        ValueError,
        match=r"CpuMLAImpl: v_head_size \(the kv_lora_rank\) must be at most the latent width head_size=48, got 64",
    ):
        CpuMLAImpl(
            _spec("full", 48, torch.float32), AttentionLayerParams(num_heads=4, v_head_size=64)
        )
