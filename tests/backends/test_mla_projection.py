"""MLA layers with ``mla_projection``: the impl applies ``W_UK``/``W_UV`` itself.

The backends that declare the ``mla_projection`` feature (``reference`` and ``cpu_mla``,
always absorbed; ``triton_mla``, absorbed decodes and a prefill part in either form) run
through ``AttentionRuntime`` and are held against an oracle written here: float64,
request by request, in the **up-projected** form straight from the definition (keys
``[c W_UK, k_pe]`` and values ``c W_UV`` per head for every cached position, causal and
windowed softmax), fed the latents as the cache holds them. Neither backend's code is
used by the oracle. Caches start NaN-filled and block pools are shuffled.

The Triton interpreter is slow: 4 heads, ``R = 32``, rope 16, ``N = V = 16``.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from attnkit import (
    AttentionConfig,
    AttentionFeature,
    AttentionLayerParams,
    AttentionRuntime,
    BackendRegistry,
    FullAttentionSpec,
    InvalidArgumentError,
    MLAAttentionSpec,
    MLAProjection,
    SlidingWindowMLASpec,
)
from attnkit.backend_api import BackendRequest
from attnkit.backends.cpu_attn import CpuMLABackend
from attnkit.backends.reference import ReferenceBackend
from attnkit.backends.triton_mla import (
    DECODE_THRESHOLD,
    TritonMLABackend,
    TritonMLAImpl,
    TritonMLAMetadata,
    mla_prefill_costs,
)
from attnkit.runtime import ScheduledRequest

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32, F16, B16 = torch.float32, torch.float16, torch.bfloat16
FP8 = torch.float8_e4m3fn
HEADS, RANK, ROPE, NOPE, VDIM = 4, 32, 16, 16, 16
D = RANK + ROPE
# Against a float64 oracle: fp32 is accumulation order only; fp16/bf16 round the
# inputs of every matmul (the absorbed query, the up-projected K/V, the softmax weights).
TOLERANCES = {F32: (3e-5, 3e-5), F16: (4e-3, 4e-3), B16: (3e-2, 3e-2)}


def _registry() -> BackendRegistry:
    reg = BackendRegistry()
    reg.register(ReferenceBackend)
    reg.register(TritonMLABackend)
    reg.register(CpuMLABackend)
    return reg


def _projection(gen: torch.Generator, dtype: torch.dtype, heads: int = HEADS) -> MLAProjection:
    w_uk = torch.randn(heads, RANK, NOPE, generator=gen) * RANK**-0.5
    w_uv = torch.randn(heads, RANK, VDIM, generator=gen) * RANK**-0.5
    return MLAProjection(w_uk=w_uk.to(DEVICE, dtype), w_uv=w_uv.to(DEVICE, dtype))


@dataclasses.dataclass
class History:
    """Every latent a request has cached (as the cache holds it), in position order."""

    latents: list[torch.Tensor] = dataclasses.field(default_factory=list)

    @property
    def length(self) -> int:
        return sum(t.shape[0] for t in self.latents)


def oracle(
    query: torch.Tensor,
    cached: torch.Tensor,
    proj: MLAProjection,
    *,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """One request's step in float64: ``query [q, H, N + P]`` at the last ``q`` positions
    of ``cached [L, D]``; returns ``[q, H, V]``."""
    q64, c64 = query.double(), cached.double()
    length, new = c64.shape[0], q64.shape[0]
    c, pe = c64[:, :RANK], c64[:, RANK:]
    heads = q64.shape[1]
    k_nope = torch.einsum("lr,hrn->lhn", c, proj.w_uk.double())
    keys = torch.cat([k_nope, pe[:, None, :].expand(length, heads, pe.shape[1])], dim=-1)
    values = torch.einsum("lr,hrv->lhv", c, proj.w_uv.double())
    scores = torch.einsum("qhd,lhd->hql", q64, keys) * scale
    pos_q = torch.arange(length - new, length)[:, None]
    pos_k = torch.arange(length)[None, :]
    visible = pos_k <= pos_q
    if window is not None:
        visible &= pos_k > pos_q - window
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hql,lhv->qhv", weights, values)


def quantise_e4m3(latents: torch.Tensor, k_scale: float) -> torch.Tensor:
    """What an fp8 cache holds, read back: ``latent / k_scale`` saturated to +-448 and
    rounded to e4m3 by torch's own cast, times ``k_scale``."""
    stored = (latents.float() / k_scale).clamp(-448.0, 448.0).to(FP8)
    return (stored.float() * k_scale).to(latents.dtype)


def make_runtime(
    backend: str,
    spec: MLAAttentionSpec | SlidingWindowMLASpec,
    params: AttentionLayerParams,
    *,
    seed: int,
    options: dict[str, Any] | None = None,
) -> AttentionRuntime:
    kind = spec.kind.value
    config = AttentionConfig.model_validate(
        {
            "backend_per_kind": {kind: backend},
            "backend_options": {backend: options} if options else {},
        },
        context={"registry": _registry()},
    )
    rt = AttentionRuntime(
        {"mla": spec},
        config,
        device=DEVICE,
        memory_budget_bytes=2**20,
        layer_params={"mla": params},
        registry=_registry(),
        cache_fill=float("nan"),
    )
    random.Random(seed).shuffle(rt.manager.pool._free)
    return rt


# Mixed steps: chunked prefills crossing block and window edges, decodes, short
# continuations (<= DECODE_THRESHOLD: decodes), a finished request whose blocks return.
SCHEDULE: list[tuple[dict[str, int], list[str]]] = [
    ({"a": 37, "b": 5}, []),
    ({"b": 1, "a": 20, "c": 18}, []),
    ({"c": 1, "a": 1, "b": 3, "d": 40}, []),
    ({"a": 1, "d": 17, "e": 2}, ["b", "c"]),
    ({"d": 1, "a": 1, "e": 33}, []),
]


def run_schedule(
    backend: str,
    spec: MLAAttentionSpec | SlidingWindowMLASpec,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    options: dict[str, Any] | None = None,
    k_scale: float = 1.0,
    spy: list[TritonMLAMetadata] | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (got, expected) per request and step."""
    gen = torch.Generator().manual_seed(seed)
    proj = _projection(gen, dtype)
    params = AttentionLayerParams(num_heads=HEADS, mla_projection=proj, k_scale=k_scale)
    rt = make_runtime(backend, spec, params, seed=seed + 1, options=options)
    scale = (NOPE + ROPE) ** -0.5
    window = spec.sliding_window if isinstance(spec, SlidingWindowMLASpec) else None
    fp8 = spec.kv_cache_dtype == "fp8_e4m3"
    history: dict[str, History] = {}
    for scheduled, finished in SCHEDULE:
        for rid in finished:
            history.pop(rid, None)
        batch = rt.begin_step(
            [ScheduledRequest(r, n) for r, n in scheduled.items()], finished=finished
        )
        if spy is not None:
            md = rt._groups[0].metadata
            assert isinstance(md, TritonMLAMetadata)
            spy.append(md)
        queries = {
            r: torch.randn(n, HEADS, NOPE + ROPE, generator=gen).to(DEVICE, dtype)
            for r, n in scheduled.items()
        }
        latents = {
            r: torch.randn(n, D, generator=gen).to(DEVICE, dtype) for r, n in scheduled.items()
        }
        query = torch.cat([queries[r] for r in batch.order])
        key = torch.cat([latents[r] for r in batch.order])[:, None, :]
        out = rt.forward("mla", query, key, None)
        assert out.shape == (batch.num_tokens, HEADS, VDIM)
        slices = batch.token_slices()
        for rid in batch.order:
            hist = history.setdefault(rid, History())
            new = latents[rid]
            hist.latents.append(quantise_e4m3(new, k_scale) if fp8 else new)
            cached = torch.cat(hist.latents)
            expected = oracle(queries[rid], cached, proj, scale=scale, window=window)
            yield out[slices[rid]], expected


def assert_matches(pairs: Iterator[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> int:
    atol, rtol = TOLERANCES[dtype]
    count = 0
    for got, expected in pairs:
        assert not got.isnan().any()
        torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol)
        count += 1
    return count


SPECS = {
    "mla": lambda dtype, bs: MLAAttentionSpec(block_size=bs, head_size=D, dtype=dtype),
    "window": lambda dtype, bs: SlidingWindowMLASpec(
        block_size=bs, head_size=D, dtype=dtype, sliding_window=21
    ),
}


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("dtype", [F32, B16])
def test_reference_projection_matches_the_up_projected_oracle(
    kind: str, dtype: torch.dtype
) -> None:
    assert assert_matches(run_schedule("reference", SPECS[kind](dtype, 16), dtype), dtype) == 15


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("dtype", [F32, B16])
def test_cpu_mla_projection_matches_the_up_projected_oracle(kind: str, dtype: torch.dtype) -> None:
    """cpu_mla (the CPU engines, absorbed around them) against the same oracle."""
    assert assert_matches(run_schedule("cpu_mla", SPECS[kind](dtype, 16), dtype), dtype) == 15


def test_cpu_mla_projection_absorbing_one_heads_weights_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broken variant: every head's query absorbed with head 0's ``W_UK``."""
    from attnkit.backends.cpu_attn import CpuMLAImpl

    absorbed = CpuMLAImpl._absorbed

    def head_zero(self: CpuMLAImpl, query: torch.Tensor) -> torch.Tensor:
        proj = self.projection
        assert proj is not None
        wrong = dataclasses.replace(proj, w_uk=proj.w_uk[:1].expand_as(proj.w_uk))
        monkeypatch.setattr(self, "projection", wrong)
        try:
            return absorbed(self, query)
        finally:
            monkeypatch.setattr(self, "projection", proj)

    monkeypatch.setattr(CpuMLAImpl, "_absorbed", head_zero)
    with pytest.raises(AssertionError):
        assert_matches(run_schedule("cpu_mla", SPECS["mla"](F32, 16), F32), F32)


def test_cpu_mla_projection_fp8_latent_cache_matches_the_oracle() -> None:
    spec = MLAAttentionSpec(block_size=16, head_size=D, dtype=F16, kv_cache_dtype="fp8_e4m3")
    assert assert_matches(run_schedule("cpu_mla", spec, F16, k_scale=0.5), F16) == 15


@pytest.mark.parametrize(
    ("kind", "dtype", "form", "block_size"),
    [
        ("mla", F32, "absorbed", 16),
        ("mla", F32, "up_projected", 16),
        ("mla", F16, "up_projected", 32),
        ("mla", B16, "auto", 16),
        ("window", F32, "absorbed", 16),
        ("window", F32, "up_projected", 16),
        ("window", B16, "up_projected", 16),
    ],
)
def test_triton_projection_matches_the_oracle_in_each_form(
    kind: str, dtype: torch.dtype, form: str, block_size: int
) -> None:
    spy: list[TritonMLAMetadata] = []
    spec = SPECS[kind](dtype, block_size)
    pairs = run_schedule("triton_mla", spec, dtype, options={"prefill_form": form}, spy=spy)
    assert assert_matches(pairs, dtype) == 15
    # Every step of the schedule has a prefill part; decodes lead where there are any.
    assert all(md.prefill is not None and md.prefill.form == form for md in spy)
    assert [md.num_decodes for md in spy] == [0, 1, 3, 1, 2]


def test_triton_projection_fp8_latent_cache_matches_the_oracle() -> None:
    """The up-projected path dequantises the gathered fp8 blocks (k_scale 0.5)."""
    spec = MLAAttentionSpec(block_size=16, head_size=D, dtype=F16, kv_cache_dtype="fp8_e4m3")
    for form in ("absorbed", "up_projected"):
        pairs = run_schedule("triton_mla", spec, F16, options={"prefill_form": form}, k_scale=0.5)
        assert assert_matches(pairs, F16) == 15


def test_the_forms_are_actually_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """'up_projected' runs the decodes absorbed and the prefills up-projected; 'absorbed'
    never up-projects; counted on the impl's two paths."""
    calls: list[tuple[str, int]] = []
    up, absorbed = TritonMLAImpl._up_projected, TritonMLAImpl._absorbed

    def count_up(self: TritonMLAImpl, query: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(("up", query.shape[0]))
        return up(self, query, *args)

    def count_absorbed(self: TritonMLAImpl, query: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(("absorbed", query.shape[0]))
        return absorbed(self, query, *args)

    monkeypatch.setattr(TritonMLAImpl, "_up_projected", count_up)
    monkeypatch.setattr(TritonMLAImpl, "_absorbed", count_absorbed)
    spec = SPECS["mla"](F32, 16)
    list(run_schedule("triton_mla", spec, F32, options={"prefill_form": "up_projected"}))
    # Step 3: decodes c, a (1 token each) and b (3 <= DECODE_THRESHOLD), prefill d (40).
    assert calls[3:5] == [("absorbed", 5), ("up", 40)]
    assert calls[0] == ("up", 42)  # step 1: all prefills (a: 37, b: 5 new)
    calls.clear()
    list(run_schedule("triton_mla", spec, F32, options={"prefill_form": "absorbed"}))
    assert all(kind == "absorbed" for kind, _ in calls)
    assert len(calls) == 5


def test_prefill_layout_skips_blocks_before_the_window() -> None:
    """A prefill chunk at positions 60..79 with window 21 needs keys from position 40: the
    gather leaves out blocks 0 and 1 (positions 0..31) and keeps blocks 2..4."""
    spec = SlidingWindowMLASpec(block_size=16, head_size=D, dtype=F32, sliding_window=21)
    gen = torch.Generator().manual_seed(3)
    params = AttentionLayerParams(num_heads=HEADS, mla_projection=_projection(gen, F32))
    rt = make_runtime("triton_mla", spec, params, seed=5)
    rt.begin_step([ScheduledRequest("a", 60)])
    rt.forward(
        "mla",
        torch.randn(60, HEADS, NOPE + ROPE, device=DEVICE),
        torch.randn(60, 1, D, device=DEVICE),
        None,
    )
    rt.begin_step([ScheduledRequest("a", 20)])
    md = rt._groups[0].metadata
    assert isinstance(md, TritonMLAMetadata)
    assert md.prefill is not None
    table = rt._groups[0].common.block_table_tensor[0]
    assert md.prefill.block_ids.tolist() == table[2:5].tolist()
    assert md.prefill.context_tokens == 3 * 16
    # Query at position p sees min(p + 1, 21) keys: 20 queries x 21 keys.
    assert md.prefill.pairs == 20 * 21


def test_prefill_costs_by_hand() -> None:
    """DeepSeek-V3 widths: R 512, rope 64, N 128, V 128. Absorbed: R (N + V) = 131072 per
    query token and 512 + 64 + 512 = 1088 per pair; up-projected: 131072 per context row
    and 2 x 256 (192 padded) = 512 per pair."""
    widths = {"kv_lora_rank": 512, "rope_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
    fresh = mla_prefill_costs(
        pairs=4096 * 4097 // 2, num_tokens=4096, context_tokens=4096, **widths
    )
    assert fresh.absorbed == 4096 * 131072 + (4096 * 4097 // 2) * 1088
    assert fresh.up_projected == 4096 * 131072 + (4096 * 4097 // 2) * 512
    # A 64-token chunk over 8k cached tokens: each key is seen by 64 queries, so
    # up-projecting 8k+ rows costs more than absorbing 64 queries.
    pairs = 64 * 8192 + 64 * 65 // 2
    chunk = mla_prefill_costs(pairs=pairs, num_tokens=64, context_tokens=8192 + 64, **widths)
    assert chunk.absorbed == 64 * 131072 + pairs * 1088
    assert chunk.up_projected == (8192 + 64) * 131072 + pairs * 512
    assert chunk.absorbed < chunk.up_projected
    # Crossover near 131072 / (1088 - 512) ~ 228 queries per key.
    for q, up_wins in ((200, False), (260, True)):
        pairs = q * 8192 + q * (q + 1) // 2
        c = mla_prefill_costs(pairs=pairs, num_tokens=q, context_tokens=8192 + q, **widths)
        assert (c.up_projected < c.absorbed) is up_wins


def test_auto_picks_by_cost_for_the_layer_widths(monkeypatch: pytest.MonkeyPatch) -> None:
    """'auto' asks mla_prefill_costs with this layer's widths; a layer whose N + P is
    outside the paged kernel's head sizes stays absorbed, and forcing it raises."""
    gen = torch.Generator().manual_seed(0)
    spec = MLAAttentionSpec(block_size=16, head_size=D, dtype=F32)
    impl = TritonMLAImpl(
        spec, AttentionLayerParams(num_heads=HEADS, mla_projection=_projection(gen, F32))
    )
    assert impl.up_projection_possible
    assert impl.query_size == NOPE + ROPE
    from attnkit.backends.triton_mla import MLAPrefillMetadata

    def prefill(pairs: int, tokens: int, ctx: int, form: Any = "auto") -> MLAPrefillMetadata:
        return MLAPrefillMetadata(
            block_ids=torch.zeros(1, dtype=torch.int64),
            plan=None,  # type: ignore[arg-type]  # not read by the choice
            num_tokens=tokens,
            pairs=pairs,
            context_tokens=ctx,
            form=form,
        )

    # Small widths: R (N + V) = 1024, absorbed pair 32 + 16 + 32 = 80, up pair 2 x 32.
    big = prefill(pairs=512 * 513 // 2, tokens=512, ctx=512)
    assert impl.prefers_up_projection(big)  # 512*1024 + p*64 < 512*1024 + p*80
    small = prefill(pairs=20 * 1000, tokens=20, ctx=1008)
    assert not impl.prefers_up_projection(small)  # 1008*1024 + ... > 20*1024 + ...
    narrow = MLAProjection(w_uk=torch.randn(HEADS, RANK, 8), w_uv=torch.randn(HEADS, RANK, 8))
    wide = TritonMLAImpl(
        MLAAttentionSpec(block_size=16, head_size=RANK + 4, dtype=F32),
        AttentionLayerParams(num_heads=HEADS, mla_projection=narrow),
    )
    assert wide.query_size == 12
    assert not wide.up_projection_possible
    assert not wide.prefers_up_projection(big)
    with pytest.raises(ValueError, match=r"prefill_form='up_projected'.*N \+ P = 12"):
        wide.prefers_up_projection(prefill(1, 1, 16, form="up_projected"))


def test_decode_threshold_orders_short_continuations_first() -> None:
    """The runtime puts continuing requests of <= DECODE_THRESHOLD tokens first."""
    spec = SPECS["mla"](F32, 16)
    gen = torch.Generator().manual_seed(0)
    params = AttentionLayerParams(num_heads=HEADS, mla_projection=_projection(gen, F32))
    rt = make_runtime("triton_mla", spec, params, seed=0)
    rt.begin_step([ScheduledRequest("a", 30), ScheduledRequest("b", 30)])
    batch = rt.begin_step(
        [
            ScheduledRequest("c", 5),
            ScheduledRequest("a", DECODE_THRESHOLD + 1),
            ScheduledRequest("b", DECODE_THRESHOLD),
        ]
    )
    assert list(batch.order) == ["b", "c", "a"]
    md = rt._groups[0].metadata
    assert isinstance(md, TritonMLAMetadata)
    assert (md.num_decodes, md.num_decode_tokens) == (1, DECODE_THRESHOLD)
    assert md.prefill is not None
    assert md.prefill.num_tokens == 5 + DECODE_THRESHOLD + 1


def test_from_kv_b_proj_splits_per_head_views() -> None:
    """``kv_b_proj`` ``[H (N + V), R]``: row ``h (N + V) + i`` is head h's k_nope channel i
    (i < N) or value channel i - N; the split must reproduce ``c @ W^T`` per head."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(HEADS * (NOPE + VDIM), RANK, generator=gen)
    proj = MLAProjection.from_kv_b_proj(
        weight, num_heads=HEADS, qk_nope_head_dim=NOPE, v_head_dim=VDIM
    )
    c = torch.randn(5, RANK, generator=gen)
    full = (c @ weight.T).view(5, HEADS, NOPE + VDIM)
    torch.testing.assert_close(torch.einsum("sr,hrn->shn", c, proj.w_uk), full[..., :NOPE])
    torch.testing.assert_close(torch.einsum("sr,hrv->shv", c, proj.w_uv), full[..., NOPE:])
    assert proj.w_uk.data_ptr() == weight.data_ptr()  # views, no copy
    assert (proj.num_heads, proj.kv_lora_rank, proj.qk_nope_head_dim, proj.v_head_dim) == (
        HEADS,
        RANK,
        NOPE,
        VDIM,
    )
    with pytest.raises(InvalidArgumentError, match=r"num_heads \* \(qk_nope_head_dim"):
        MLAProjection.from_kv_b_proj(weight, num_heads=3, qk_nope_head_dim=NOPE, v_head_dim=VDIM)


def test_params_with_a_projection() -> None:
    gen = torch.Generator().manual_seed(2)
    proj = _projection(gen, F32)
    params = AttentionLayerParams(num_heads=HEADS, mla_projection=proj)
    assert params.v_head_size == VDIM
    assert AttentionFeature.MLA_PROJECTION in params.features
    with pytest.raises(InvalidArgumentError, match="num_heads=8 heads"):
        AttentionLayerParams(num_heads=8, mla_projection=proj)
    with pytest.raises(InvalidArgumentError, match="v_head_size must be None or the projection's"):
        AttentionLayerParams(num_heads=HEADS, mla_projection=proj, v_head_size=RANK)
    with pytest.raises(InvalidArgumentError, match="must share H, R"):
        MLAProjection(w_uk=torch.randn(HEADS, RANK, NOPE), w_uv=torch.randn(HEADS, RANK + 1, VDIM))
    with pytest.raises(InvalidArgumentError, match=r"floating-point \[H, R, N or V\]"):
        MLAProjection(w_uk=torch.zeros(HEADS, RANK, dtype=torch.int64), w_uv=torch.randn(1, 1, 1))


@pytest.mark.parametrize("backend", ["reference", "triton_mla"])
def test_impls_reject_projections_that_do_not_fit(backend: str) -> None:
    gen = torch.Generator().manual_seed(4)
    from attnkit.backends.reference.attention import ReferenceAttentionImpl

    impl_cls: Any = {"reference": ReferenceAttentionImpl, "triton_mla": TritonMLAImpl}[backend]
    cases = [
        (
            MLAAttentionSpec(block_size=16, head_size=D, dtype=F16),
            _projection(gen, F32),
            "model dtype",
        ),
        (
            MLAAttentionSpec(block_size=16, head_size=16, dtype=F32),
            _projection(gen, F32),
            "at most the latent width",
        ),
    ]
    for spec, proj, message in cases:
        with pytest.raises(ValueError, match=message):
            impl_cls(spec, AttentionLayerParams(num_heads=HEADS, mla_projection=proj))


def test_selection_needs_the_feature() -> None:
    """A backend that does not declare mla_projection is not chosen for such a layer."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=F16)
    request = BackendRequest(
        spec=spec, device=DEVICE, features=frozenset({AttentionFeature.MLA_PROJECTION})
    )
    from attnkit.backends.triton_attn import TritonAttentionBackend

    reasons = TritonAttentionBackend.not_supported_reasons(request)
    assert any("mla_projection" in r for r in reasons)
    assert AttentionFeature.MLA_PROJECTION in TritonMLABackend.supported_features
    assert AttentionFeature.MLA_PROJECTION in ReferenceBackend.supported_features


def test_weights_on_another_device_are_refused() -> None:
    gen = torch.Generator().manual_seed(6)
    proj = _projection(gen, F32)
    meta = MLAProjection(w_uk=proj.w_uk.to("meta"), w_uv=proj.w_uv.to("meta"))
    spec = SPECS["mla"](F32, 16)
    params = AttentionLayerParams(num_heads=HEADS, mla_projection=meta)
    for backend in ("reference", "triton_mla"):
        rt = make_runtime(backend, spec, params, seed=0)
        rt.begin_step([ScheduledRequest("a", 3)])
        with pytest.raises(ValueError, match="must be on the query's device"):
            rt.forward(
                "mla",
                torch.randn(3, HEADS, NOPE + ROPE, device=DEVICE),
                torch.randn(3, 1, D, device=DEVICE),
                None,
            )


def test_cost_model_agrees_with_counted_flops() -> None:
    """The cost formula against FLOPs counted from the shapes of the matmuls each form
    runs (unpadded widths equal padded ones here: every width a power of two)."""
    r, p, n, v = 64, 16, 48, 32  # N + P = 64: no padding
    q_tokens, ctx_rows, pairs = 10, 48, 300
    counted_absorbed = q_tokens * n * r + q_tokens * r * v + pairs * (r + p) + pairs * r
    counted_up = ctx_rows * r * n + ctx_rows * r * v + pairs * (n + p) + pairs * (n + p)
    got = mla_prefill_costs(
        pairs=pairs,
        num_tokens=q_tokens,
        context_tokens=ctx_rows,
        kv_lora_rank=r,
        rope_dim=p,
        qk_nope_head_dim=n,
        v_head_dim=v,
    )
    assert got.absorbed == counted_absorbed
    assert got.up_projected == counted_up
    assert math.isclose(got.absorbed / got.up_projected, counted_absorbed / counted_up)


@pytest.mark.parametrize("form", ["absorbed", "up_projected"])
def test_padding_rows_are_left_untouched(form: str) -> None:
    """Rows past the step's tokens (CUDA-graph padding) are neither attended nor
    written, in either form; the real rows still match the oracle."""
    gen = torch.Generator().manual_seed(8)
    proj = _projection(gen, F32)
    spec = SPECS["mla"](F32, 16)
    params = AttentionLayerParams(num_heads=HEADS, mla_projection=proj)
    rt = make_runtime("triton_mla", spec, params, seed=9, options={"prefill_form": form})
    rt.begin_step([ScheduledRequest("a", 19)])
    query = torch.randn(19 + 3, HEADS, NOPE + ROPE, generator=gen).to(DEVICE)
    latents = torch.randn(19 + 3, D, generator=gen).to(DEVICE)
    output = torch.full((19 + 3, HEADS, VDIM), 7.0, device=DEVICE)
    rt.forward("mla", query, latents[:, None, :], None, output=output)
    assert bool((output[19:] == 7.0).all())
    expected = oracle(query[:19], latents[:19], proj, scale=(NOPE + ROPE) ** -0.5, window=None)
    torch.testing.assert_close(output[:19].double(), expected, atol=3e-5, rtol=3e-5)
