"""Per-head static KV scales and per-token-head dynamic scales (fp8 e4m3, int8).

Every kernel output is checked against a float64 oracle written here, over values the
test dequantises itself; the control compares per-head against per-tensor scales on
heads whose magnitudes differ by 100x from one head to the next.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnkit import AttentionConfig, FullAttentionSpec, MLAAttentionSpec
from attnkit.backend import BackendRequest
from attnkit.backends.cpu_attn import CpuAttentionBackend
from attnkit.backends.flex_attention import FlexAttentionBackend
from attnkit.backends.reference import ReferenceBackend
from attnkit.backends.triton_attn import TritonAttentionBackend
from attnkit.backends.triton_mla import TritonMLABackend
from attnkit.capabilities import AttentionFeature
from attnkit.errors import AttnkitError, InvalidArgumentError
from attnkit.kernels.attention import reference as ref
from attnkit.params import AttentionLayerParams, rank_layer_params
from attnkit.planner import plan_model
from attnkit.registry import BUILTIN_BACKENDS, BackendRegistry
from attnkit.runtime import AttentionRuntime, ScheduledRequest

H, D, BS = 4, 32, 8
MAGS_FP8 = (1.0, 1e-2, 1e-4, 1e-6)  # adjacent heads differ by 100x
MAGS_INT8 = (1.0, 0.1 ** (2 / 3), 0.1 ** (4 / 3), 1e-2)  # 100x across the heads


# ----------------------------------------------------------------- the test's own oracle


def _fp8_dequant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 values an e4m3 cache holds for ``x / scale`` (scale broadcast over x)."""
    return (x.double() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale


def _int8_token_head_dequant(x: torch.Tensor) -> torch.Tensor:
    """float64 values of a per-(token, head) int8 round trip: the float32 scale
    absmax / 127, x / s in float32 rounded half to even."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round((xf / s).clamp(-127, 127)).double() * s.double()


def _fp8_token_head_dequant(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True) / 448
    s = torch.where(s > 0, s, torch.ones_like(s))
    stored = (xf / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return stored.double() * s.double()


def _attend64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal float64 attention of the last ``len(q)`` positions over ``k``/``v``."""
    tq, tk = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    i = torch.arange(tk - tq, tk)[:, None]
    j = torch.arange(tk)[None, :]
    s = s.masked_fill(j > i, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)


def _rel_err_per_head(out: torch.Tensor, exact: torch.Tensor) -> list[float]:
    diff = (out.double() - exact).norm(dim=(0, 2))
    return (diff / exact.norm(dim=(0, 2))).tolist()


def _inputs(mags: tuple[float, ...], tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    m = torch.tensor(mags)[None, :, None]
    k = torch.randn(tokens, H, D, generator=g) * m
    v = torch.randn(tokens, H, D, generator=g) * m
    q = torch.randn(tokens, H, D, generator=g) / m  # scores O(1) on every head
    return q, k, v


def _paged_run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_dtype: torch.dtype,
    *,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    dynamic: bool = False,
    attention=ref.paged_attention,
    write=ref.write_kv_cache,
) -> torch.Tensor:
    """One prefill of one request through a shuffled paged cache."""
    t = k.shape[0]
    nblk = -(-t // BS)
    num_blocks = nblk + 3
    cache = torch.full((num_blocks, 2, BS, H, D), float("nan")).to(cache_dtype) if cache_dtype != torch.int8 else torch.full((num_blocks, 2, BS, H, D), -1, dtype=torch.int8)
    scales = torch.full((num_blocks, 2, BS, H), float("nan")) if dynamic else None
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(7))[:nblk] + 1
    table = perm.to(torch.int32)[None, :]
    pos = torch.arange(t)
    slots = (perm[pos // BS] * BS + pos % BS).to(torch.int64)
    kw = {"kv_scales": scales} if dynamic else {"k_scale": k_scale, "v_scale": v_scale}
    write(k, v, cache, slots, **kw)
    return attention(
        q,
        cache,
        query_start_loc=torch.tensor([0, t], dtype=torch.int32),
        seq_lens=torch.tensor([t], dtype=torch.int32),
        block_table=table,
        scale=D**-0.5,
        **kw,
    )


# ----------------------------------------------------------------- static per-head fp8


def test_per_head_fp8_matches_float64_oracle_and_beats_per_tensor() -> None:
    q, k, v = _inputs(MAGS_FP8, 24, seed=1)
    ks = k.abs().amax(dim=(0, 2)) / 448
    vs = v.abs().amax(dim=(0, 2)) / 448
    exact = _attend64(q, k, v, D**-0.5)
    per_head = _paged_run(q, k, v, torch.float8_e4m3fn, k_scale=ks, v_scale=vs)
    per_tensor = _paged_run(
        q, k, v, torch.float8_e4m3fn, k_scale=float(ks.max()), v_scale=float(vs.max())
    )
    # The kernel is exact attention over what the cache holds (the test's dequantisation).
    held = _attend64(q, _fp8_dequant(k, ks[None, :, None]), _fp8_dequant(v, vs[None, :, None]), D**-0.5)
    torch.testing.assert_close(per_head.double(), held, atol=1e-5, rtol=1e-4)
    e_head = _rel_err_per_head(per_head, exact)
    e_tensor = _rel_err_per_head(per_tensor, exact)
    print(f"fp8 per-head rel. error per head {e_head}, per-tensor {e_tensor}")
    assert max(e_head) < 0.08
    assert e_tensor[3] > 0.5  # the control: head 3 flushes to zero under one scale
    assert e_tensor[3] > 10 * e_head[3]


def test_kernel_reading_head_0_scale_for_all_heads_is_caught() -> None:
    """A deliberately broken read (head 0's scale for every head) fails the oracle check."""
    q, k, v = _inputs(MAGS_FP8, 16, seed=2)
    ks = k.abs().amax(dim=(0, 2)) / 448
    vs = v.abs().amax(dim=(0, 2)) / 448

    def broken(query: torch.Tensor, cache: torch.Tensor, **kw: object) -> torch.Tensor:
        k_scale, v_scale = kw.pop("k_scale"), kw.pop("v_scale")
        assert isinstance(k_scale, torch.Tensor)
        assert isinstance(v_scale, torch.Tensor)
        return ref.paged_attention(
            query, cache, k_scale=k_scale[:1].expand(H).contiguous(),
            v_scale=v_scale[:1].expand(H).contiguous(), **kw,  # type: ignore[arg-type]  # test-only forwarding
        )

    out = _paged_run(q, k, v, torch.float8_e4m3fn, k_scale=ks, v_scale=vs, attention=broken)
    held = _attend64(q, _fp8_dequant(k, ks[None, :, None]), _fp8_dequant(v, vs[None, :, None]), D**-0.5)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(out.double(), held, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------- dynamic per-token-head


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_per_token_head_round_trip_matches_float64_oracle(dtype: torch.dtype) -> None:
    q, k, v = _inputs(MAGS_INT8, 21, seed=3)
    k[5, 2] = 0.0  # an all-zero vector: scale 1.0, stored zeros
    deq = _int8_token_head_dequant if dtype == torch.int8 else _fp8_token_head_dequant
    out = _paged_run(q, k, v, dtype, dynamic=True)
    held = _attend64(q, deq(k), deq(v), D**-0.5)
    torch.testing.assert_close(out.double(), held, atol=1e-5, rtol=1e-4)
    exact = _attend64(q, k, v, D**-0.5)
    e = _rel_err_per_head(out, exact)
    print(f"{dtype} per-token-head rel. error per head {e}")
    assert max(e) < (0.02 if dtype == torch.int8 else 0.08)


def test_int8_per_token_head_beats_a_per_tensor_int8_control() -> None:
    """The control is the test's own per-tensor int8 quantiser (attnkit has no such mode)."""
    q, k, v = _inputs(MAGS_INT8, 24, seed=4)
    exact = _attend64(q, k, v, D**-0.5)
    out = _paged_run(q, k, v, torch.int8, dynamic=True)

    def per_tensor(x: torch.Tensor) -> torch.Tensor:
        s = x.double().abs().max() / 127
        return torch.round((x.double() / s).clamp(-127, 127)) * s

    control = _attend64(q, per_tensor(k), per_tensor(v), D**-0.5)
    e_dyn, e_ctl = _rel_err_per_head(out, exact), _rel_err_per_head(control, exact)
    print(f"int8 per-token-head {e_dyn}, per-tensor int8 control {e_ctl}")
    assert max(e_dyn) < 0.02
    assert e_ctl[3] > 0.5


def test_a_write_that_keeps_head_0_scale_is_caught() -> None:
    """Broken variant of the dynamic write: every head stored with head 0's scale."""
    q, k, v = _inputs(MAGS_INT8, 16, seed=5)

    def broken_write(key, value, cache, slots, *, kv_scales):  # type: ignore[no-untyped-def]  # test double
        ref.write_kv_cache(key, value, cache, slots, kv_scales=kv_scales)
        blocks, offs = slots // BS, slots % BS
        kv_scales[blocks, :, offs] = kv_scales[blocks, :, offs][..., :1].expand(-1, 2, H)

    out = _paged_run(q, k, v, torch.int8, dynamic=True, write=broken_write)
    held = _attend64(q, _int8_token_head_dequant(k), _int8_token_head_dequant(v), D**-0.5)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(out.double(), held, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------- through the runtime


def _runtime(spec: FullAttentionSpec, params: AttentionLayerParams, backend: str) -> AttentionRuntime:
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    return AttentionRuntime(
        {"l0": spec},
        AttentionConfig(backend=backend),
        device="cpu",
        memory_budget_bytes=1 << 20,
        layer_params={"l0": params},
        registry=reg,
        cache_fill=float("nan"),
    )


def _run_runtime(runtime: AttentionRuntime, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A prefill of all but the last token, then a decode of it."""
    t = q.shape[0]
    runtime.begin_step([ScheduledRequest("r", t - 1)])
    first = runtime.forward("l0", q[: t - 1], k[: t - 1], v[: t - 1])
    runtime.begin_step([ScheduledRequest("r", 1)])
    last = runtime.forward("l0", q[t - 1 :], k[t - 1 :], v[t - 1 :])
    return torch.cat([first, last])


@pytest.mark.parametrize("backend", ["reference", "triton_attn", "cpu_attn"])
def test_runtime_per_head_fp8_layer(backend: str) -> None:
    q, k, v = _inputs(MAGS_FP8, 19, seed=6)
    ks = (k.abs().amax(dim=(0, 2)) / 448).tolist()
    vs = (v.abs().amax(dim=(0, 2)) / 448).tolist()
    spec = FullAttentionSpec(block_size=16, num_kv_heads=H, head_size=D, dtype=torch.float32, kv_cache_dtype="fp8_e4m3")
    params = AttentionLayerParams(num_heads=H, k_scale=tuple(ks), v_scale=tuple(vs))
    assert AttentionFeature.PER_HEAD_QUANT_SCALES in params.features
    out = _run_runtime(_runtime(spec, params, backend), q, k, v)
    kt, vt = torch.tensor(ks, dtype=torch.float64), torch.tensor(vs, dtype=torch.float64)
    held = _attend64(q, _fp8_dequant(k, kt[None, :, None]), _fp8_dequant(v, vt[None, :, None]), D**-0.5)
    torch.testing.assert_close(out.double(), held, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "triton_attn"])
@pytest.mark.parametrize("kv_cache_dtype", ["int8_per_token_head", "fp8_e4m3_per_token_head"])
def test_runtime_per_token_head_layer(kv_cache_dtype: str, backend: str) -> None:
    q, k, v = _inputs(MAGS_INT8, 19, seed=8)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=H, head_size=D, dtype=torch.float32, kv_cache_dtype=kv_cache_dtype)  # type: ignore[arg-type]  # parametrised Literal
    runtime = _runtime(spec, AttentionLayerParams(num_heads=H), backend)
    values, scales = runtime.kv_caches["l0"]
    assert scales.dtype == torch.float32
    assert tuple(scales.shape) == (values.shape[0], 2, 16, H)
    # The page holds the values and their scales (the memory report's unit).
    assert spec.page_size_bytes == 2 * 16 * H * D * 1 + 2 * 16 * H * 4
    out = _run_runtime(runtime, q, k, v)
    deq = _int8_token_head_dequant if kv_cache_dtype.startswith("int8") else _fp8_token_head_dequant
    held = _attend64(q, deq(k), deq(v), D**-0.5)
    torch.testing.assert_close(out.double(), held, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------- splits and capabilities


def test_tensor_parallel_split_slices_scales_with_the_heads() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=D, dtype=torch.float16, kv_cache_dtype="fp8_e4m3")
    params = AttentionLayerParams(num_heads=8, k_scale=(1.0, 2.0, 3.0, 4.0), v_scale=(5.0, 6.0, 7.0, 8.0))
    two = [rank_layer_params(params, spec, tensor_parallel=2, rank=r) for r in range(2)]
    assert [(p.num_heads, p.k_scale, p.v_scale) for p in two] == [
        (4, (1.0, 2.0), (5.0, 6.0)),
        (4, (3.0, 4.0), (7.0, 8.0)),
    ]
    # Fewer K/V heads than ranks: head n sits on ranks 2n, 2n + 1, and so does its scale.
    eight = [rank_layer_params(params, spec, tensor_parallel=8, rank=r).k_scale for r in range(8)]
    assert eight == [(1.0,), (1.0,), (2.0,), (2.0,), (3.0,), (3.0,), (4.0,), (4.0,)]
    plan = plan_model(
        {"l0": spec}, AttentionConfig(), device="cpu", layer_params={"l0": params},
        tensor_parallel=2, memory_bytes=1 << 24,
    )
    assert "per-head K/V scales [4] -> [2] per rank" in str(plan.to_json())


def test_capability_reasons() -> None:
    per_head = frozenset({AttentionFeature.PER_HEAD_QUANT_SCALES})
    full = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float16, kv_cache_dtype="fp8_e4m3")
    cpu = torch.device("cpu")
    assert ReferenceBackend.not_supported_reasons(BackendRequest(spec=full, device=cpu, features=per_head)) == []
    assert CpuAttentionBackend.not_supported_reasons(BackendRequest(spec=full, device=cpu, features=per_head)) == []
    reasons = FlexAttentionBackend.not_supported_reasons(BackendRequest(spec=full, device=cpu, features=per_head))
    assert any("feature per_head_quant_scales not supported" in r for r in reasons)
    mla = MLAAttentionSpec(block_size=16, head_size=64, dtype=torch.float16, kv_cache_dtype="fp8_e4m3")
    reasons = TritonMLABackend.not_supported_reasons(BackendRequest(spec=mla, device=cpu, features=per_head))
    assert any("MLA latent is shared by every head" in r for r in reasons)
    dyn = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float16, kv_cache_dtype="int8_per_token_head")
    assert CpuAttentionBackend.not_supported_reasons(BackendRequest(spec=dyn, device=cpu)) == []
    reasons = FlexAttentionBackend.not_supported_reasons(BackendRequest(spec=dyn, device=cpu))
    assert any("kv_cache_dtype=int8_per_token_head not supported" in r for r in reasons)
    assert AttentionFeature.PER_HEAD_QUANT_SCALES in TritonAttentionBackend.supported_features
    assert TritonAttentionBackend.not_supported_reasons(BackendRequest(spec=dyn, device=cpu)) == []


# ----------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"k_scale": (1.0, -2.0)}, r"AttentionLayerParams\.k_scale\[1\] must be a finite float > 0"),
        ({"v_scale": (1.0, math.nan)}, r"AttentionLayerParams\.v_scale\[1\] must be a finite float > 0"),
        ({"k_scale": ()}, r"AttentionLayerParams\.k_scale must be a finite float > 0 or a tuple"),
        ({"v_scale": 0.0}, r"AttentionLayerParams\.v_scale must be a finite float > 0"),
        ({"k_scale": "1"}, r"AttentionLayerParams\.k_scale must be"),
    ],
)
def test_bad_scale_values(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        AttentionLayerParams(num_heads=4, **kwargs)  # type: ignore[arg-type]  # bad input on purpose


def test_bad_scale_shape_and_cache_dtype_name_the_argument() -> None:
    fp8 = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=D, dtype=torch.float32, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(InvalidArgumentError, match=r"layer_params\['l0'\]\.k_scale must have one scale per K/V head \(num_kv_heads=4\), got 3"):
        _runtime(fp8, AttentionLayerParams(num_heads=4, k_scale=(1.0, 1.0, 1.0)), "reference")
    auto = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=D, dtype=torch.float32)
    with pytest.raises(InvalidArgumentError, match=r"layer_params\['l0'\]\.v_scale holds per-head scales, which need kv_cache_dtype='fp8_e4m3'"):
        _runtime(auto, AttentionLayerParams(num_heads=4, v_scale=(1.0,) * 4), "reference")
    dyn = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=D, dtype=torch.float32, kv_cache_dtype="int8_per_token_head")
    with pytest.raises(InvalidArgumentError, match=r"layer_params\['l0'\]\.k_scale=2\.0: a 'int8_per_token_head' cache computes"):
        _runtime(dyn, AttentionLayerParams(num_heads=4, k_scale=2.0), "reference")
    with pytest.raises(InvalidArgumentError, match=r"MLAAttentionSpec\.kv_cache_dtype 'int8_per_token_head' is not supported"):
        MLAAttentionSpec(block_size=16, head_size=64, dtype=torch.float16, kv_cache_dtype="int8_per_token_head")


def test_bad_kernel_scale_arguments() -> None:
    q, k, v = _inputs(MAGS_FP8, 8, seed=9)
    with pytest.raises(ValueError, match=r"k_scale: expected a torch\.float32 tensor of shape \[\] or \[1\] \(per tensor\) or \[Hkv\]=\[4\]"):
        _paged_run(q, k, v, torch.float8_e4m3fn, k_scale=torch.ones(3), v_scale=1.0)
    with pytest.raises(ValueError, match=r"v_scale: expected finite scales > 0, got -1\.0 at index 2"):
        _paged_run(q, k, v, torch.float8_e4m3fn, v_scale=torch.tensor([1.0, 1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match=r"kv_scales: expected the float32 \[NB, 2, BS, Hkv\] per-token-head scales of an int8 kv_cache, got None"):
        _paged_run(q, k, v, torch.int8)
    assert issubclass(InvalidArgumentError, AttnkitError)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_triton_per_token_head_write_matches_the_test_quantiser(dtype: torch.dtype) -> None:
    from attnkit.kernels.attention.triton_kv_write import write_kv_cache

    _, k, v = _inputs(MAGS_INT8, 13, seed=10)
    k[3, 1] = 0.0
    num_blocks = 4
    cache = torch.zeros((num_blocks, 2, BS, H, D), dtype=dtype)
    scales = torch.full((num_blocks, 2, BS, H), float("nan"))
    slots = torch.randperm(num_blocks * BS, generator=torch.Generator().manual_seed(1))[:13]
    skipped = int(slots[4])
    slots[4] = -1  # a padding token is not written
    write_kv_cache(k, v, cache, slots, kv_scales=scales)
    deq = _int8_token_head_dequant if dtype == torch.int8 else _fp8_token_head_dequant
    for t in range(13):
        if t == 4:
            continue
        b, o = int(slots[t]) // BS, int(slots[t]) % BS
        for plane, x in ((0, k), (1, v)):
            held = cache[b, plane, o].double() * scales[b, plane, o].double()[:, None]
            torch.testing.assert_close(held, deq(x[t : t + 1])[0], atol=0, rtol=0)
    b4, o4 = skipped // BS, skipped % BS
    assert torch.isnan(scales[b4, :, o4]).all()


def test_triton_per_head_write_divides_each_head_by_its_scale() -> None:
    from attnkit.kernels.attention.triton_kv_write import write_kv_cache

    _, k, v = _inputs(MAGS_FP8, 9, seed=11)
    ks = k.abs().amax(dim=(0, 2)) / 448
    vs = v.abs().amax(dim=(0, 2)) / 448
    cache = torch.zeros((2, 2, BS, H, D), dtype=torch.float8_e4m3fn)
    slots = torch.arange(9, dtype=torch.int64)
    write_kv_cache(k, v, cache, slots, k_scale=ks, v_scale=vs)
    got_k = cache[:, 0].reshape(-1, H, D)[:9].double() * ks.double()[None, :, None]
    torch.testing.assert_close(got_k, _fp8_dequant(k, ks.double()[None, :, None]), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"k_scale: expected a torch\.float32 tensor of shape"):
        write_kv_cache(k, v, cache, slots, k_scale=torch.ones(3), v_scale=vs)


@pytest.mark.parametrize("num_splits", [0, 3], ids=["one-pass", "split-kv"])
@pytest.mark.parametrize("mode", ["per-head-fp8", "token-head-int8", "token-head-fp8"])
def test_triton_decode_reads_scales_on_both_paths(mode: str, num_splits: int) -> None:
    """A decode over a shuffled, NaN-filled cache: one-pass and split-KV kernels."""
    from attnkit.kernels.attention.triton import paged_attention
    from attnkit.kernels.attention.triton_kv_write import write_kv_cache
    from attnkit.kernels.attention.triton_plan import plan_paged_attention

    bs, t = 16, 70
    mags = MAGS_FP8 if mode == "per-head-fp8" else MAGS_INT8
    q, k, v = _inputs(mags, t, seed=12)
    nblk = -(-t // bs)
    num_blocks = nblk + 2
    dtype = torch.int8 if mode == "token-head-int8" else torch.float8_e4m3fn
    if dtype == torch.int8:
        cache = torch.full((num_blocks, 2, bs, H, D), -1, dtype=torch.int8)
    else:
        cache = torch.full((num_blocks, 2, bs, H, D), float("nan")).to(dtype)
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(3))[:nblk] + 1
    pos = torch.arange(t)
    slots = (perm[pos // bs] * bs + pos % bs).to(torch.int64)
    kw: dict[str, torch.Tensor] = {}
    if mode == "per-head-fp8":
        ks = k.abs().amax(dim=(0, 2)) / 448
        vs = v.abs().amax(dim=(0, 2)) / 448
        kw = {"k_scale": ks, "v_scale": vs}
        held_k = _fp8_dequant(k, ks.double()[None, :, None])
        held_v = _fp8_dequant(v, vs.double()[None, :, None])
    else:
        kw = {"kv_scales": torch.full((num_blocks, 2, bs, H), float("nan"))}
        deq = _int8_token_head_dequant if dtype == torch.int8 else _fp8_token_head_dequant
        held_k, held_v = deq(k), deq(v)
    write_kv_cache(k, v, cache, slots, **kw)
    plan = plan_paged_attention(
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([t], dtype=torch.int32),
        perm.to(torch.int32)[None, :],
        max_query_len=1,
        max_seq_len=t,
        block_size=bs,
        num_kv_heads=H,
        num_splits=num_splits,
        device=torch.device("cpu"),
    )
    assert plan.num_splits == num_splits
    out = paged_attention(q[-1:], cache, plan, scale=D**-0.5, **kw)
    held = _attend64(q[-1:], held_k, held_v, D**-0.5)
    torch.testing.assert_close(out.double(), held, atol=1e-5, rtol=1e-4)


def test_triton_kernel_reading_head_0_scale_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-pass kernel launched without PER_HEAD_SCALES over [Hkv] scales (it then
    reads head 0's scale for every head) fails the oracle check the real launch passes."""
    import attnkit.kernels.attention.triton as launcher

    real = launcher._unified_attention_kernel

    class HeadZeroScale:
        def __getitem__(self, grid: object) -> object:
            def launch(**kwargs: object) -> object:
                assert kwargs["PER_HEAD_SCALES"] is True
                return real[grid](**{**kwargs, "PER_HEAD_SCALES": False})

            return launch

    monkeypatch.setattr(launcher, "_unified_attention_kernel", HeadZeroScale())
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        test_triton_decode_reads_scales_on_both_paths("per-head-fp8", 0)


def test_backends_command_shows_the_capability() -> None:
    import io

    from attnkit.cli import main

    out, err = io.StringIO(), io.StringIO()
    assert main(["backends", "--device", "cpu"], out=out, err=err) == 0
    text = out.getvalue()
    triton = text[text.index("  triton_attn ") :].split("\n  triton_gdn")[0]
    assert "per_head_quant_scales" in triton.split("features:")[1].split("\n")[0]
    assert "int8_per_token_head" in triton.split("kv cache dtypes:")[1].split("\n")[0]
    cpu = text[text.index("  cpu_attn ") :].split("\n  flash_attn")[0]
    assert "per_head_quant_scales" in cpu.split("features:")[1].split("\n")[0]
    assert "int8_per_token_head" in cpu.split("kv cache dtypes:")[1].split("\n")[0]
    flex = text[text.index("  flex_attention ") :].split("\n  reference")[0]
    assert "features: alibi" in flex
    assert "per_head_quant_scales" not in flex


def test_prefix_caching_names_per_head_scales() -> None:
    """Per-head scales enter a group's prefix-cache namespace (other scales: other bytes)."""
    from attnkit.prefix_cache import group_namespace

    spec = FullAttentionSpec(block_size=16, num_kv_heads=H, head_size=D, dtype=torch.float32, kv_cache_dtype="fp8_e4m3")
    a = group_namespace(spec, k_scales=[torch.tensor((1.0, 2.0, 3.0, 4.0), dtype=torch.float64)], v_scales=[1.0])
    b = group_namespace(spec, k_scales=[torch.tensor((1.0, 2.0, 3.0, 5.0), dtype=torch.float64)], v_scales=[1.0])
    assert a != b
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    runtime = AttentionRuntime(
        {"l0": spec},
        AttentionConfig(backend="reference", prefix_caching={"enabled": True}),
        device="cpu",
        memory_budget_bytes=1 << 20,
        layer_params={"l0": AttentionLayerParams(num_heads=H, k_scale=(0.5,) * H, v_scale=(0.25,) * H)},
        registry=reg,
    )
    q, k, v = _inputs(MAGS_FP8, 17, seed=13)
    _run_runtime(runtime, q, k, v)
