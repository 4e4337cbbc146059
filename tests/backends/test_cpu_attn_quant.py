"""``cpu_attn`` over quantised caches (fp8 e4m3 / e5m2 with static scales, per-head
e4m3, per-token-head fp8 e4m3 and int8), through the runtime: prefills, a chunk with a
context, decodes, against a float64 oracle over the values the test quantises itself;
the KV write is the reference backend's, byte for byte; and the CPU default selects
``cpu_attn`` for these layers.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    FullAttentionSpec,
    ScheduledRequest,
    select_backend,
)
from attnkit.backends import _planes
from attnkit.kernels.attention.cpu_decode import native_problem

pytestmark = pytest.mark.skipif(
    native_problem() is not None, reason=f"native CPU kernels unavailable: {native_problem()}"
)

HKV, HQ, BS = 2, 4, 16
QMAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
TORCH = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8_e4m3_per_token_head": torch.float8_e4m3fn,
    "int8_per_token_head": torch.int8,
}
K_SCALES = (0.004, 0.4)  # per head, 100x apart
V_SCALES = (0.003, 0.3)
MAGS = (1.0, 100.0)  # the heads' magnitudes follow their scales

# (request, new tokens) per step: prompts over several blocks, a chunked prefill whose
# second chunk has a context, decodes and short runs, a late request.
STEPS: tuple[tuple[tuple[str, int], ...], ...] = (
    (("a", 37), ("b", 5)),
    (("a", 1), ("b", 3), ("c", 20)),
    (("a", 1), ("b", 1), ("c", 30)),
    (("a", 1), ("c", 1), ("d", 40)),
)


def _layer(
    kv_cache_dtype: str, d: int, per_head: bool
) -> tuple[FullAttentionSpec, AttentionLayerParams]:
    spec = FullAttentionSpec(
        block_size=BS, num_kv_heads=HKV, head_size=d, dtype=torch.float32,
        kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]  # parametrised Literal
    )  # fmt: skip
    if kv_cache_dtype.endswith("per_token_head"):
        return spec, AttentionLayerParams(num_heads=HQ)
    if per_head:
        return spec, AttentionLayerParams(num_heads=HQ, k_scale=K_SCALES, v_scale=V_SCALES)
    return spec, AttentionLayerParams(num_heads=HQ, k_scale=0.2, v_scale=0.15)


def _dequant(
    x: torch.Tensor, kv_cache_dtype: str, scale: float | tuple[float, ...]
) -> torch.Tensor:
    """float64 values the cache holds for ``x`` ``[T, Hkv, D]`` (the test's quantiser):
    static ``x / s`` in float32 saturated and cast; per token and head ``s = amax / qmax``
    (int8: ``x / s`` rounded half to even)."""
    dtype = TORCH[kv_cache_dtype]
    xf = x.float()
    if kv_cache_dtype.endswith("per_token_head"):
        qmax = 127.0 if dtype == torch.int8 else 448.0
        s = xf.abs().amax(-1, keepdim=True) / qmax
        s = torch.where(s > 0, s, torch.ones_like(s))
        y = (xf / s).clamp(-qmax, qmax)
        stored = torch.round(y).to(dtype) if dtype == torch.int8 else y.to(dtype)
        return stored.double() * s.double()
    st = (
        torch.tensor(scale, dtype=torch.float32).reshape(1, -1, 1)
        if isinstance(scale, tuple)
        else torch.tensor(scale)
    )
    q = QMAX[kv_cache_dtype]
    return (xf / st).clamp(-q, q).to(dtype).double() * st.double()


def _runtime(
    backend: str, spec: FullAttentionSpec, params: AttentionLayerParams
) -> AttentionRuntime:
    rt = AttentionRuntime(
        {"layer": spec},
        AttentionConfig(backend_per_kind={spec.kind: backend}),
        device="cpu",
        memory_budget_bytes=spec.page_size_bytes * 24,
        layer_params={"layer": params},
        cache_fill=float("nan"),
    )
    random.Random(0).shuffle(rt.manager.pool._free)  # shuffled blocks
    return rt


def _inputs(
    steps: Sequence[tuple[tuple[str, int], ...]], d: int
) -> list[dict[str, tuple[torch.Tensor, ...]]]:
    gen = torch.Generator().manual_seed(d)
    m = torch.tensor(MAGS)[None, :, None]
    qm = torch.tensor(MAGS).repeat_interleave(HQ // HKV)[None, :, None]
    return [
        {
            rid: (
                torch.randn(n, HQ, d, generator=gen) / qm,
                torch.randn(n, HKV, d, generator=gen) * m,
                torch.randn(n, HKV, d, generator=gen) * m,
            )
            for rid, n in step
        }
        for step in steps
    ]


def _run(
    rt: AttentionRuntime, inputs: list[dict[str, tuple[torch.Tensor, ...]]]
) -> list[dict[str, torch.Tensor]]:
    outs: list[dict[str, torch.Tensor]] = []
    live: set[str] = set()
    for step in inputs:
        finished = sorted(live - set(step))
        live = (live - set(finished)) | set(step)
        batch = rt.begin_step(
            [ScheduledRequest(r, x[0].shape[0]) for r, x in step.items()], finished=finished
        )
        q, k, v = (torch.cat([step[r][i] for r in batch.order]) for i in range(3))
        out = rt.forward("layer", q, k, v)
        outs.append({rid: out[rows].clone() for rid, rows in batch.token_slices().items()})
    return outs


def _oracle(
    inputs: list[dict[str, tuple[torch.Tensor, ...]]],
    kv_cache_dtype: str,
    params: AttentionLayerParams,
    d: int,
) -> list[dict[str, torch.Tensor]]:
    """Causal float64 attention of each step's queries over the request's dequantised keys."""
    keys: dict[str, list[torch.Tensor]] = {}
    vals: dict[str, list[torch.Tensor]] = {}
    outs: list[dict[str, torch.Tensor]] = []
    for step in inputs:
        got: dict[str, torch.Tensor] = {}
        for rid, (q, k, v) in step.items():
            keys.setdefault(rid, []).append(_dequant(k, kv_cache_dtype, params.k_scale))
            vals.setdefault(rid, []).append(_dequant(v, kv_cache_dtype, params.v_scale))
            kk = torch.cat(keys[rid]).repeat_interleave(HQ // HKV, dim=1)
            vv = torch.cat(vals[rid]).repeat_interleave(HQ // HKV, dim=1)
            n, t = q.shape[0], kk.shape[0]
            s = torch.einsum("qhd,khd->hqk", q.double(), kk) * d**-0.5
            s = s.masked_fill(
                torch.arange(t)[None, :] > torch.arange(t - n, t)[:, None], float("-inf")
            )
            got[rid] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
        outs.append(got)
    return outs


CASES = [
    pytest.param("fp8_e4m3", False, id="fp8_e4m3-per-tensor"),
    pytest.param("fp8_e4m3", True, id="fp8_e4m3-per-head"),
    pytest.param("fp8_e5m2", False, id="fp8_e5m2-per-tensor"),
    pytest.param("fp8_e4m3_per_token_head", False, id="fp8_e4m3-per-token-head"),
    pytest.param("int8_per_token_head", False, id="int8-per-token-head"),
]


@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize(("kv_cache_dtype", "per_head"), CASES)
def test_runtime_matches_the_float64_oracle(kv_cache_dtype: str, per_head: bool, d: int) -> None:
    spec, params = _layer(kv_cache_dtype, d, per_head)
    inputs = _inputs(STEPS, d)
    got = _run(_runtime("cpu_attn", spec, params), inputs)
    for i, (out, held) in enumerate(
        zip(got, _oracle(inputs, kv_cache_dtype, params, d), strict=True)
    ):
        for rid, want in held.items():
            torch.testing.assert_close(
                out[rid].double(), want, atol=2e-5, rtol=1e-4, msg=f"step {i} {rid}"
            )


def _cache_rows(
    rt: AttentionRuntime, backend: str, rid: str, n: int, d: int
) -> tuple[torch.Tensor, ...]:
    """The bytes of request ``rid``'s first ``n`` K and V rows ``[n, Hkv, D]`` and their
    per-token-head scale bytes ``[n, Hkv, 4]`` (empty for static scales)."""
    caches = rt.kv_caches["layer"]
    table = torch.tensor(rt.manager.block_table(0, rid), dtype=torch.int64)
    pos = torch.arange(n)
    blocks, offs = table[pos // BS], pos % BS
    if backend == "cpu_attn":
        slots = blocks * BS + offs
        k, v = (p.view(torch.uint8)[slots] for p in caches)
        return k[..., :d], v[..., :d], k[..., d:], v[..., d:]
    values = caches[0].view(torch.uint8)
    k, v = values[blocks, 0, offs], values[blocks, 1, offs]
    if len(caches) == 1:
        empty = torch.zeros(n, HKV, 0, dtype=torch.uint8)
        return k, v, empty, empty
    scales = caches[1]
    ks, vs = (
        scales[blocks, i, offs].contiguous().view(torch.uint8).reshape(n, HKV, 4) for i in (0, 1)
    )
    return k, v, ks, vs


# The reference backend does not declare fp8_e5m2: its write kernel is compared below.
@pytest.mark.parametrize(
    ("kv_cache_dtype", "per_head"), [c for c in CASES if c.id != "fp8_e5m2-per-tensor"]
)
def test_kv_write_is_the_reference_write_byte_for_byte(kv_cache_dtype: str, per_head: bool) -> None:
    d = 64
    spec, params = _layer(kv_cache_dtype, d, per_head)
    inputs = _inputs(STEPS, d)
    rts = {b: _runtime(b, spec, params) for b in ("cpu_attn", "reference")}
    for rt in rts.values():
        _run(rt, inputs)
    lengths = {"a": 40, "c": 51, "d": 40}  # the live requests after the last step
    for rid, n in lengths.items():
        mine = _cache_rows(rts["cpu_attn"], "cpu_attn", rid, n, d)
        theirs = _cache_rows(rts["reference"], "reference", rid, n, d)
        for what, a, b in zip(("K", "V", "K scales", "V scales"), mine, theirs, strict=True):
            assert torch.equal(a, b), f"{kv_cache_dtype} request {rid}: {what} differ"


def test_fp8_e5m2_write_is_the_reference_kernel_write() -> None:
    from attnkit.kernels.attention.reference import write_kv_cache

    spec, params = _layer("fp8_e5m2", 64, False)
    x = torch.randn(20, HKV, 64) * 1e4  # some values saturate: past 57344 * 0.2
    quant = _planes.PlanesQuant.of(spec, params)
    assert quant is not None
    cache = torch.zeros(2, 2, BS, HKV, 64, dtype=torch.float8_e5m2)
    slots = torch.arange(20, dtype=torch.int64)
    write_kv_cache(x, x, cache, slots, k_scale=0.2, v_scale=0.15)
    k = cache[:, 0].reshape(-1, HKV, 64)[:20]
    v = cache[:, 1].reshape(-1, HKV, 64)[:20]
    assert torch.equal(quant.stored(x, False).view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(quant.stored(x, True).view(torch.uint8), v.view(torch.uint8))
    assert bool(quant.stored(x, False).float().abs().eq(57344.0).any())  # saturated, not NaN


def test_a_write_that_quantises_differently_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken writes: int8 rows truncated instead of rounded; static scales of head 0
    for every head. The byte comparison (and the oracle) catch both."""
    real = _planes.PlanesQuant.stored

    def truncating(self: _planes.PlanesQuant, x: torch.Tensor, value: bool) -> torch.Tensor:
        rows = real(self, x, value)
        d = x.shape[-1]
        raw = rows.view(torch.uint8).clone()
        s = raw[..., d:].contiguous().view(torch.float32)
        raw[..., :d] = (
            torch.trunc((x.float() / s).clamp(-127, 127)).to(torch.int8).view(torch.uint8)
        )
        return raw.view(rows.dtype)

    monkeypatch.setattr(_planes.PlanesQuant, "stored", truncating)
    with pytest.raises(AssertionError, match="K differ"):
        test_kv_write_is_the_reference_write_byte_for_byte("int8_per_token_head", False)

    def head_zero(self: _planes.PlanesQuant, x: torch.Tensor, value: bool) -> torch.Tensor:
        s = self.v_scale if value else self.k_scale
        assert isinstance(s, torch.Tensor)
        return real(
            _planes.PlanesQuant(self.dtype, s[:1].expand_as(s), s[:1].expand_as(s), False), x, value
        )

    monkeypatch.setattr(_planes.PlanesQuant, "stored", head_zero)
    with pytest.raises(AssertionError, match="K differ"):
        test_kv_write_is_the_reference_write_byte_for_byte("fp8_e4m3", True)
    with pytest.raises(AssertionError, match=r"step \d+ [a-d]"):  # the oracle's message
        test_runtime_matches_the_float64_oracle("fp8_e4m3", True, 64)


@pytest.mark.parametrize("kv_cache_dtype", sorted(TORCH))
def test_the_cpu_default_serves_quantised_layers(kv_cache_dtype: str) -> None:
    spec, params = _layer(kv_cache_dtype, 128, per_head=kv_cache_dtype == "fp8_e4m3")
    chosen = select_backend(spec, AttentionConfig(), device="cpu", features=params.features)
    assert chosen.backend_name == "cpu_attn"


def test_per_token_head_planes_carry_their_scales_in_the_page() -> None:
    spec, _ = _layer("int8_per_token_head", 64, False)
    rt = _runtime("cpu_attn", spec, AttentionLayerParams(num_heads=HQ))
    k, v = rt.kv_caches["layer"]
    assert k.dtype == v.dtype == torch.int8
    assert tuple(k.shape[1:]) == (HKV, 64 + 4)  # each head's values, then its scale
    # a block's K rows and V rows fill the page the memory report counts
    assert 2 * BS * k[0].numel() == spec.page_size_bytes
    # unwritten slots: every bit set (NaN scales)
    assert bool(k[BS:].view(torch.uint8).eq(0xFF).all())


def test_page_descriptors_and_slot_copies_carry_the_row_scales() -> None:
    """A per-token-head plane row is a slot's values and scales: the page descriptors
    describe K and V rows that fill the page, and a slot copy (a speculative accept)
    moves a row's scales with its values."""
    from attnkit.runtime._spec import _copy_slots

    d = 64
    spec, params = _layer("fp8_e4m3_per_token_head", d, False)
    rt = _runtime("cpu_attn", spec, params)
    (group,) = rt.page_descriptors().groups
    k_desc, v_desc = group.tensors
    assert (k_desc.role, v_desc.role) == ("k", "v")
    assert k_desc.block_bytes == v_desc.block_bytes == BS * HKV * (d + 4)
    assert k_desc.block_bytes + v_desc.block_bytes == spec.page_size_bytes
    k, _ = rt.kv_caches["layer"]
    raw = torch.randint(0, 255, (k.shape[0], HKV, d + 4), dtype=torch.uint8)
    k.view(torch.uint8).copy_(raw)
    src, dst = torch.tensor([17, 40]), torch.tensor([3, 90])
    _copy_slots(k, src, dst, BS, True)
    assert torch.equal(k.view(torch.uint8)[dst], raw[src])
    assert torch.equal(k.view(torch.uint8)[5], raw[5])  # other rows untouched


@pytest.mark.parametrize(("kv_cache_dtype", "per_head"), [CASES[1], CASES[4]])
def test_context_parallel_ranks_reproduce_one_device(kv_cache_dtype: str, per_head: bool) -> None:
    """Two context-parallel ranks (each holding every other token, quantised by its own
    write) merge to one device's output: the scales travel with their tokens."""
    from attnkit import ContextParallel
    from test_context_parallel import run_ranks

    d = 64
    spec, params = _layer(kv_cache_dtype, d, per_head)
    inputs = _inputs(STEPS, d)

    def make(cp: ContextParallel | None) -> AttentionRuntime:
        rt = AttentionRuntime(
            {"layer": spec},
            AttentionConfig(backend_per_kind={spec.kind: "cpu_attn"}),
            device="cpu",
            memory_budget_bytes=spec.page_size_bytes * 24,
            layer_params={"layer": params},
            cache_fill=float("nan"),
            context_parallel=cp,
        )
        random.Random(0 if cp is None else cp.rank + 1).shuffle(rt.manager.pool._free)
        return rt

    expected = _run(make(None), inputs)
    ranks = run_ranks(2, lambda rank, cp: _run(make(cp), inputs))
    for got in ranks:
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            for rid in e:
                torch.testing.assert_close(
                    g[rid], e[rid], atol=2e-5, rtol=1e-4, msg=f"step {i} {rid}"
                )


def test_a_shard_read_without_its_scales_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken forward_partial whose kernel call drops the per-head scales (ones)."""
    from attnkit.kernels.attention import cpu_decode

    real = cpu_decode.paged_attention_rows

    def unscaled(*args: Any, **kwargs: Any) -> None:
        if kwargs.get("k_scale") is not None:
            kwargs["k_scale"] = torch.ones_like(kwargs["k_scale"])
        real(*args, **kwargs)

    monkeypatch.setattr(cpu_decode, "paged_attention_rows", unscaled)
    with pytest.raises(AssertionError, match=r"step \d+ [a-d]"):
        test_context_parallel_ranks_reproduce_one_device("fp8_e4m3", True)
