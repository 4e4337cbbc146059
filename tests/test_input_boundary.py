"""The runtime's input boundary: every ``forward`` / ``forward_state`` call is checked
against the layer and the step before any backend runs (``attnkit.runtime._boundary``).

Each finding of the issue ("validation is per backend") runs against every built-in
backend that serves the kind on CPU: ``reference``, ``cpu_attn`` (the CPU default,
attnkit's CPU engines) and ``triton_attn`` under the Triton interpreter for the
attention kinds, ``triton_mla`` for MLA, ``triton_mamba2`` for the state finding. A
refused call raises an attnkit error naming the caller's argument and leaves the cache
bytes as they were. A recording toy backend behind the runtime shows the checks run
before any backend (it is never called) and what the stride rule hands a backend.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from typing_extensions import override

from attnkit import (
    ArgumentTypeError,
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    AttnkitError,
    BackendRegistry,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    InvalidArgumentError,
    Mamba2Inputs,
    Mamba2LayerParams,
    MambaSpec,
    MLAAttentionSpec,
    MLAProjection,
    ScheduledRequest,
    SinkFullAttentionSpec,
)
from attnkit.backend import AttentionBackend, BackendRequest
from attnkit.backend_api import (
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    bind_builder,
)
from attnkit.registry import BUILTIN_BACKENDS
from attnkit.spec import AttentionSpec, KVCacheSpec
from attnkit.state_types import state_type_of

F32 = torch.float32
CPU = torch.device("cpu")
BS, HKV, HQ, D = 16, 2, 4, 16
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=F32)
PARAMS = AttentionLayerParams(num_heads=HQ)
ATTENTION_BACKENDS = ["reference", "cpu_attn", "triton_attn"]
"""The built-in backends that serve full attention on CPU."""
R = ScheduledRequest


def registry() -> BackendRegistry:
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    reg.register(RecordingBackend)
    return reg


def make_runtime(backend: str, spec: KVCacheSpec = FULL, params: Any = PARAMS) -> AttentionRuntime:
    reg = registry()
    config = AttentionConfig.model_validate({"backend": backend}, context={"registry": reg})
    runtime = AttentionRuntime(
        {"layer": spec},
        config,
        device="cpu",
        memory_budget_bytes=1 << 20,
        layer_params={"layer": params},
        registry=reg,
        cache_fill=float("nan"),
    )
    assert runtime.routing_table()[0].backend == backend
    return runtime


def cache_bytes(runtime: AttentionRuntime) -> list[torch.Tensor]:
    """The layer's cache as bytes (the unwritten cache holds NaN, which never equals)."""
    return [t.view(torch.uint8).clone() for t in runtime.kv_caches.get("layer", ())]


def unchanged(runtime: AttentionRuntime, before: Sequence[torch.Tensor]) -> bool:
    after = cache_bytes(runtime)
    return len(after) == len(before) and all(
        torch.equal(a, b) for a, b in zip(after, before, strict=True)
    )


def qkv(
    rows: int, gen: torch.Generator, heads: int = HQ, kv_heads: int = HKV, width: int = D
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.randn(rows, heads, width, generator=gen),
        torch.randn(rows, kv_heads, D, generator=gen),
        torch.randn(rows, kv_heads, D, generator=gen),
    )


def four_token_step(runtime: AttentionRuntime) -> None:
    """A decode of a request with 5 tokens cached and a 3-token prompt: 4 tokens."""
    runtime.begin_step([R("a", 5)])
    gen = torch.Generator().manual_seed(9)
    runtime.forward("layer", *qkv(5, gen))
    batch = runtime.begin_step([R("a", 1), R("b", 3)])
    assert batch.num_tokens == 4


def refused(
    runtime: AttentionRuntime, error: type[Exception], match: str, *args: Any, **kwargs: Any
) -> str:
    """Call ``forward`` expecting ``error``; the cache must be as it was. The message."""
    before = cache_bytes(runtime)
    with pytest.raises(error, match=match) as info:
        runtime.forward("layer", *args, **kwargs)
    assert isinstance(info.value, AttnkitError)
    assert unchanged(runtime, before), "a refused call wrote into the cache"
    message = str(info.value)
    assert "slot_mapping" not in message  # an internal tensor, never the caller's
    return message


# ------------------------------------------------------------------ finding 1 and 5


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_a_key_shorter_than_the_step_is_refused_naming_key(backend: str) -> None:
    """The CPU engines used to accept ``k[:3]`` for a 4-token step and return finite
    numbers; triton_attn blamed ``slot_mapping``. Every backend now gets the same
    error, naming the argument, before anything is written."""
    runtime = make_runtime(backend)
    four_token_step(runtime)
    q, k, v = qkv(4, torch.Generator().manual_seed(1))
    want = r"float32 \[T, Hkv, D\]=\[4, 2, 16\] on cpu"
    refused(
        runtime,
        InvalidArgumentError,
        rf"^layer: key has 3 rows but the step has 4 tokens; key must be {want}, "
        r"got float32 \[3, 2, 16\] on cpu$",
        q,
        k[:3],
        v[:3],
    )
    refused(
        runtime,
        InvalidArgumentError,
        rf"^layer: value has 3 rows but the step has 4 tokens; value must be {want}, ",
        q,
        k,
        v[:3],
    )
    # Padded rows: key and value have the query's rows.
    pad = torch.zeros(2, HKV, D)
    refused(
        runtime,
        InvalidArgumentError,
        r"^layer: key has 4 rows but the query has 6 \(the step 4 tokens\); key must be "
        r"float32 \[T, Hkv, D\]=\[6, 2, 16\]",
        torch.cat([q, torch.zeros(2, HQ, D)]),
        k,
        torch.cat([v, pad]),
    )
    # The step still runs, and nothing the refused calls passed was written.
    out = runtime.forward("layer", q, k, v)
    assert out.isfinite().all()


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize(
    ("change", "match"),
    [
        pytest.param(
            {"query": torch.randn(3, HQ, D)},
            r"^layer: query has 3 rows but the step has 4 tokens; query must be float32 "
            r"\[T, Hq, D\]=\[>=4, 4, 16\] on cpu, got float32 \[3, 4, 16\] on cpu$",
            id="query-rows",
        ),
        pytest.param(
            {"query": torch.randn(4, 2, D)},
            r"^layer: query has Hq=2, the layer takes 4 \(layer_params.num_heads\); ",
            id="query-heads",
        ),
        pytest.param(
            {"key": torch.randn(4, 1, D)},
            r"^layer: key has Hkv=1, the layer takes 2 \(the spec's num_kv_heads\); ",
            id="key-heads",
        ),
        pytest.param(
            {"value": torch.randn(4, HKV, 8)},
            r"^layer: value has D=8, the layer takes 16 \(the spec's head_size\); ",
            id="value-width",
        ),
        pytest.param(
            {"key": torch.randn(4, HKV, D, dtype=torch.float16)},
            r"^layer: key is float16, the layer's dtype float32; key must be float32 ",
            id="key-dtype",
        ),
        pytest.param(
            {"key": torch.randn(4, HKV * D)},
            r"^layer: key has 2 dimension\(s\), not 3; ",
            id="key-rank",
        ),
        pytest.param(
            {"value": None},
            r"^layer: value must be float32 \[T, Hkv, D\]=\[4, 2, 16\] on cpu, got None$",
            id="value-none",
        ),
        pytest.param(
            {"output": torch.empty(3, HQ, D)},
            r"^layer: output has 3 rows but the query has 4; output must be float32 "
            r"\[T, Hq, Dv\]=\[4, 4, 16\] on cpu, got float32 \[3, 4, 16\] on cpu$",
            id="output-rows",
        ),
        pytest.param(
            {"output": torch.empty(4, HQ, D, dtype=torch.bfloat16)},
            r"^layer: output is bfloat16, the layer's dtype float32; ",
            id="output-dtype",
        ),
    ],
)
def test_each_argument_is_checked_against_the_layer(
    backend: str, change: dict[str, Any], match: str
) -> None:
    runtime = make_runtime(backend)
    four_token_step(runtime)
    q, k, v = qkv(4, torch.Generator().manual_seed(2))
    args: dict[str, Any] = {"query": q, "key": k, "value": v, "output": None}
    args.update(change)
    refused(runtime, InvalidArgumentError, match, **args)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_types_are_checked_naming_the_argument(backend: str) -> None:
    runtime = make_runtime(backend)
    four_token_step(runtime)
    q, k, v = qkv(4, torch.Generator().manual_seed(3))
    refused(
        runtime,
        ArgumentTypeError,
        r"^layer: key must be a torch.Tensor \[T, Hkv, D\], got list$",
        q,
        [0.0],
        v,
    )
    refused(
        runtime,
        ArgumentTypeError,
        r"^layer: value must be a torch.Tensor \[T, Hkv, D\], got ndarray$",
        q,
        k,
        v.numpy(),
    )


# ------------------------------------------------------------------ finding 2


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("argument", ["query", "key", "value", "output"])
def test_a_tensor_on_the_meta_device_is_refused_naming_it(backend: str, argument: str) -> None:
    """A meta key used to reach ``index_copy`` and leak torch's RuntimeError."""
    runtime = make_runtime(backend)
    four_token_step(runtime)
    q, k, v = qkv(4, torch.Generator().manual_seed(4))
    args: dict[str, Any] = {"query": q, "key": k, "value": v, "output": torch.empty(4, HQ, D)}
    args[argument] = args[argument].to("meta")
    message = refused(
        runtime,
        InvalidArgumentError,
        rf"^layer: {argument} is on meta, the runtime on cpu; {argument} must be float32 "
        rf"\[T, (Hq|Hkv), (D|Dv)\]=\[.*\] on cpu, got float32 \[.*\] on meta$",
        **args,
    )
    assert "index_copy" not in message


# ------------------------------------------------------------------ finding 3


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One request's causal attention by the definition, in float64: the ``Tq`` queries
    are the last positions of the ``Tk`` keys (GQA by repeating K/V heads)."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * q.shape[-1] ** -0.5
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(k.shape[0] - q.shape[0])
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), vv)


def last_dim_strided(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` in a view whose last dimension has stride 2."""
    base = torch.full((*t.shape, 2), float("nan"), dtype=t.dtype)
    base[..., 0] = t
    view = base[..., 0]
    assert view.stride(-1) == 2
    torch.testing.assert_close(view, t, rtol=0, atol=0, equal_nan=True)
    return view


def transposed(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` ``[T, H, D]`` in a view with strides ``(H*D, 1, H)``."""
    view = t.transpose(1, 2).contiguous().transpose(1, 2)
    assert view.stride(-1) == t.shape[1] > 1
    torch.testing.assert_close(view, t, rtol=0, atol=0, equal_nan=True)
    return view


def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``q, k, v`` as slices of one fused projection ``[T, (Hq + 2 Hkv) * D]``: rows
    strided, last dimension unit-stride."""
    rows = q.shape[0]
    qkv_ = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qw, kw = q.shape[1] * D, k.shape[1] * D
    views = (
        qkv_[:, :qw].view(rows, -1, D),
        qkv_[:, qw : qw + kw].view(rows, -1, D),
        qkv_[:, qw + kw :].view(rows, -1, D),
    )
    assert not any(x.is_contiguous() for x in views)
    return views


STEPS = [[("a", 5), ("b", 3)], [("a", 1), ("b", 1)], [("a", 2), ("c", 17)]]


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("layout", ["last-dim-stride-2", "transposed", "fused-qkv"])
def test_strided_views_give_the_dense_result(backend: str, layout: str) -> None:
    """The CPU engines used to refuse views with a non-unit last stride; every backend now
    takes any view and gives what the dense definition gives, as the contiguous
    tensors do (output a strided view too)."""
    plain, strided = make_runtime(backend), make_runtime(backend)
    gen = torch.Generator().manual_seed(5)
    keys: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for step in STEPS:
        batch = plain.begin_step([R(r, n) for r, n in step])
        assert strided.begin_step([R(r, n) for r, n in step]) == batch
        n_of = dict(step)
        per = {r: qkv(n_of[r], gen) for r in batch.order}
        q, k, v = (torch.cat([per[r][i] for r in batch.order]) for i in range(3))
        if layout == "fused-qkv":
            views = fused(q, k, v)
            out_view = torch.full((q.shape[0], HQ, D), float("nan"))
        else:
            make = last_dim_strided if layout == "last-dim-stride-2" else transposed
            views = (make(q), make(k), make(v))
            out_view = make(torch.full((q.shape[0], HQ, D), float("nan")))
        expected = plain.forward("layer", q, k, v)
        got = strided.forward("layer", *views, output=out_view)
        assert got is out_view  # the caller's output holds the result
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        for rid, rows in batch.token_slices().items():
            keys.setdefault(rid, []).append((per[rid][1], per[rid][2]))
            kk = torch.cat([x[0] for x in keys[rid]])
            vv = torch.cat([x[1] for x in keys[rid]])
            torch.testing.assert_close(
                got[rows].double(), dense(per[rid][0], kk, vv), atol=1e-5, rtol=1e-5
            )


# ------------------------------------------------------------------ other kinds


SINK = SinkFullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=F32, sink_len=3)
SINK_PARAMS = AttentionLayerParams(
    num_heads=HQ, sink_key=torch.randn(3, HKV, D), sink_value=torch.randn(3, HKV, D)
)
ENCODER = EncoderOnlyAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=F32)


@pytest.mark.parametrize(
    ("spec", "params", "backend"),
    [
        *(
            pytest.param(SINK, SINK_PARAMS, b, id=f"sink-{b}")
            for b in ("reference", "cpu_attn")
        ),
        *(pytest.param(ENCODER, PARAMS, b, id=f"encoder-only-{b}") for b in ATTENTION_BACKENDS),
    ],
)
def test_sink_and_encoder_only_layers_take_the_steps_keys(
    spec: AttentionSpec, params: AttentionLayerParams, backend: str
) -> None:
    runtime = make_runtime(backend, spec, params)
    runtime.begin_step([R("a", 3), R("b", 1)])
    q, k, v = qkv(4, torch.Generator().manual_seed(6))
    refused(
        runtime,
        InvalidArgumentError,
        r"^layer: key has 3 rows but the step has 4 tokens; ",
        q,
        k[:3],
        v[:3],
    )
    refused(
        runtime,
        InvalidArgumentError,
        r"^layer: value must be float32 \[T, Hkv, D\]=\[4, 2, 16\] on cpu, got None$",
        q,
        k,
        None,
    )
    refused(
        runtime,
        InvalidArgumentError,
        r"^layer: key is on meta, the runtime on cpu; ",
        q,
        k.to("meta"),
        v,
    )
    assert runtime.forward("layer", q, k, v).isfinite().all()


CROSS = CrossAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=F32)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_cross_attention_takes_the_encoder_states_of_the_new_requests(backend: str) -> None:
    """Key/value are ``[E, Hkv, D]``, E the encoder tokens of StepBatch.encoder_order
    (the reference backend used to blame ``slot_mapping`` for a mismatch)."""
    runtime = make_runtime(backend, CROSS)
    gen = torch.Generator().manual_seed(7)
    batch = runtime.begin_step([R("a", 2, encoder_len=6), R("b", 1, encoder_len=3)])
    assert batch.encoder_order == ("a", "b")
    q = torch.randn(3, HQ, D, generator=gen)
    k, v = torch.randn(9, HKV, D, generator=gen), torch.randn(9, HKV, D, generator=gen)
    state = r"the step's new requests \(StepBatch.encoder_order\) have 9 encoder tokens"
    refused(
        runtime,
        InvalidArgumentError,
        rf"^layer: key \(encoder states\) has 8 rows but {state}; key \(encoder states\) must "
        r"be float32 \[E, Hkv, D\]=\[9, 2, 16\] on cpu, got float32 \[8, 2, 16\] on cpu$",
        q,
        k[:8],
        v[:8],
    )
    refused(
        runtime,
        InvalidArgumentError,
        rf"^layer: {state} for cross-attention layers to write: key and value must be float32 \[E, Hkv, D\]=\[9, 2, 16\] on cpu, got None$",
        q,
        None,
        None,
    )
    refused(
        runtime,
        InvalidArgumentError,
        r"^layer: key and value must both be the encoder states or both be None, got key float32 \[9, 2, 16\] on cpu and value None$",
        q,
        k,
        None,
    )
    refused(
        runtime,
        InvalidArgumentError,
        r"^layer: value \(encoder states\) is on meta, the runtime on cpu; ",
        q,
        k,
        v.to("meta"),
    )
    assert runtime.forward("layer", q, k, v).isfinite().all()
    runtime.begin_step([R("a", 1), R("b", 1)])
    q2 = torch.randn(2, HQ, D, generator=gen)
    refused(
        runtime,
        InvalidArgumentError,
        r"^layer: key \(encoder states\) has 9 rows but no request of the step is new "
        r"\(StepBatch.encoder_order is empty\): pass key=None and value=None; ",
        q2,
        k,
        v,
    )
    assert runtime.forward("layer", q2, None, None).isfinite().all()


R_LORA, ROPE, NOPE, V_DIM = 12, 4, 8, 8


def mla_projection(gen: torch.Generator) -> MLAProjection:
    return MLAProjection(
        w_uk=torch.randn(HQ, R_LORA, NOPE, generator=gen) * 0.3,
        w_uv=torch.randn(HQ, R_LORA, V_DIM, generator=gen) * 0.3,
    )


@pytest.mark.parametrize("backend", ["reference", "triton_mla"])
@pytest.mark.parametrize("projected", [False, True], ids=["absorbed", "mla-projection"])
def test_mla_layers_take_latents_and_the_query_width_of_their_params(
    backend: str, projected: bool
) -> None:
    """MLA: key ``[T, 1, D]`` (the new latents), value None or the same; with
    ``mla_projection`` the query is un-absorbed, ``[T, Hq, N + P]``."""
    gen = torch.Generator().manual_seed(8)
    width = R_LORA + ROPE  # the latent, D = R + rope
    spec = MLAAttentionSpec(block_size=BS, head_size=width, dtype=F32)
    params = (
        AttentionLayerParams(num_heads=HQ, mla_projection=mla_projection(gen))
        if projected
        else AttentionLayerParams(num_heads=HQ, v_head_size=R_LORA)
    )
    runtime = make_runtime(backend, spec, params)
    runtime.begin_step([R("a", 3), R("b", 1)])
    q_width = NOPE + ROPE if projected else width
    q = torch.randn(4, HQ, q_width, generator=gen)
    latents = torch.randn(4, 1, width, generator=gen)
    refused(
        runtime,
        InvalidArgumentError,
        r"^layer: key \(the new latents\) has 3 rows but the step has 4 tokens; key \(the new latents\) must be float32 \[T, Hkv, D\]=\[4, 1, 16\] on cpu",
        q,
        latents[:3],
        None,
    )
    refused(
        runtime,
        InvalidArgumentError,
        r"^layer: value \(None or the latents again\) has D=8, the layer takes 16 ",
        q,
        latents,
        latents[:, :, :8],
    )
    wrong = torch.randn(4, HQ, width if projected else NOPE + ROPE, generator=gen)
    source = (
        r"N \+ P=16, the layer takes 12 \(mla_projection's qk_nope_head_dim 8 \+ rope 4: the "
        r"un-absorbed query\)"
        if projected
        else r"D=12, the layer takes 16 \(the spec's head_size\)"
    )
    refused(runtime, InvalidArgumentError, rf"^layer: query has {source}; ", wrong, latents, None)
    v_out = V_DIM if projected else R_LORA
    refused(
        runtime,
        InvalidArgumentError,
        rf"^layer: output has Dv={width}, the layer takes {v_out} ",
        q,
        latents,
        None,
        output=torch.empty(4, HQ, width),
    )
    out = runtime.forward("layer", q, latents, None)
    assert out.shape == (4, HQ, v_out)
    assert out.isfinite().all()


# ------------------------------------------------------------------ finding 4: state layers

STATE_BACKENDS = ["reference", "triton_mamba2"]


def mamba2_params() -> Mamba2LayerParams:
    params = state_type_of("mamba2").example(torch.Generator().manual_seed(0), CPU)
    assert isinstance(params, Mamba2LayerParams)
    return params


@pytest.mark.parametrize("backend", STATE_BACKENDS)
def test_a_mamba2_spec_whose_shapes_are_not_a_mamba2_state_is_refused(backend: str) -> None:
    """triton_mamba2 used to accept ``((8, 3), (5,))``; the runtime refuses it naming the
    spec and its shapes, and each backend's own selection gives the same reason."""
    spec = MambaSpec(block_size=BS, shapes=((8, 3), (5,)), dtypes=(F32, F32), mamba_type="mamba2")
    reason = "mamba2 shapes must be ((C, W-1), (H, P, N)), got ((8, 3), (5,))"
    with pytest.raises(
        InvalidArgumentError, match="^" + re.escape(f"layer_specs['layer']: {reason}") + "$"
    ):
        make_runtime(backend, spec, mamba2_params())
    backend_cls = registry().get(backend)
    assert reason in backend_cls.not_supported_reasons(BackendRequest(spec=spec, device=CPU))


def mamba2_runtime(backend: str) -> tuple[AttentionRuntime, Mamba2LayerParams]:
    params = mamba2_params()
    spec = MambaSpec(
        block_size=BS,
        shapes=params.state_shapes,
        dtypes=state_type_of("mamba2").state_dtypes(F32),
        mamba_type="mamba2",
    )
    return make_runtime(backend, spec, params), params


def mamba2_inputs(params: Mamba2LayerParams, rows: int, seed: int) -> Mamba2Inputs:
    inputs = state_type_of("mamba2").example_inputs(
        params, rows, torch.Generator().manual_seed(seed), CPU
    )
    assert isinstance(inputs, Mamba2Inputs)
    return inputs


@pytest.mark.parametrize("backend", STATE_BACKENDS)
def test_state_inputs_are_checked_against_the_types_widths(backend: str) -> None:
    runtime, params = mamba2_runtime(backend)
    runtime.begin_step([R("a", 3), R("b", 1)])
    good = mamba2_inputs(params, 4, 1)
    c, h = params.conv_dim, params.num_heads
    cases: list[tuple[Mamba2Inputs, dict[str, Any], str]] = [
        (
            Mamba2Inputs(xBC=good.xBC[:3], dt=good.dt[:3]),
            {},
            rf"^layer: inputs\.xBC has 3 rows but the step has 4 tokens; inputs\.xBC must be float32 \[T, C\]=\[>=4, {c}\] on cpu, got float32 \[3, {c}\] on cpu$",
        ),
        (
            Mamba2Inputs(xBC=good.xBC[:, 1:], dt=good.dt),
            {},
            rf"^layer: inputs\.xBC has C={c - 1}, the layer takes {c} ",
        ),
        (
            Mamba2Inputs(xBC=good.xBC, dt=good.dt[:, :1]),
            {},
            rf"^layer: inputs\.dt has H=1, the layer takes {h} ",
        ),
        (
            Mamba2Inputs(xBC=good.xBC.half(), dt=good.dt.half()),
            {},
            r"^layer: inputs\.xBC is float16, the layer's dtype float32; ",
        ),
        (
            Mamba2Inputs(xBC=good.xBC, dt=good.dt.to(torch.int32)),
            {},
            r"^layer: inputs\.dt is int32, not a floating-point tensor; ",
        ),
        (
            Mamba2Inputs(xBC=good.xBC.to("meta"), dt=good.dt.to("meta")),
            {},
            r"^layer: inputs\.xBC is on meta, the runtime on cpu; ",
        ),
        (
            good,
            {"output": torch.empty(3, h, params.head_dim)},
            rf"^layer: output \(y\) has 3 rows but the inputs have 4; output \(y\) must be float32 \[T, H, P\]=\[4, {h}, {params.head_dim}\] on cpu",
        ),
    ]
    for inputs, extra, match in cases:
        before = cache_bytes(runtime)
        with pytest.raises(InvalidArgumentError, match=match):
            runtime.forward_state("layer", inputs, **extra)
        assert unchanged(runtime, before)
    with pytest.raises(
        ArgumentTypeError, match=r"^layer: output must be a torch.Tensor or None, got list$"
    ):
        runtime.forward_state("layer", good, output=[0.0])  # type: ignore[arg-type]  # the wrong type is the test


@pytest.mark.parametrize("backend", STATE_BACKENDS)
def test_strided_state_inputs_give_the_references_result(backend: str) -> None:
    runtime, params = mamba2_runtime(backend)
    oracle, _ = mamba2_runtime("reference")
    for step, seed in (([R("a", 5), R("b", 3)], 1), ([R("a", 1), R("b", 1)], 2)):
        runtime.begin_step(step)
        oracle.begin_step(step)
        n = sum(r.num_new_tokens for r in step)
        inputs = mamba2_inputs(params, n, seed)
        view = Mamba2Inputs(xBC=last_dim_strided(inputs.xBC), dt=last_dim_strided(inputs.dt))
        got = runtime.forward_state("layer", view)
        torch.testing.assert_close(got, oracle.forward_state("layer", inputs), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ the boundary runs first


@dataclasses.dataclass
class Received:
    """What the recording impl was handed, call by call."""

    calls: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]] = (
        dataclasses.field(default_factory=list)
    )


RECEIVED = Received()


class RecordingBuilder(AttentionMetadataBuilder[int, FullAttentionSpec]):
    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> int:
        return common_attn_metadata.num_actual_tokens


class RecordingImpl(AttentionImpl[int]):
    """Accepts anything (no checks of its own, as a careless plugin would): records its
    arguments and writes 1 into the output."""

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: int,
        output: torch.Tensor,
    ) -> torch.Tensor:
        RECEIVED.calls.append((query, key, value, output))
        return output.fill_(1.0)


class RecordingBackend(AttentionBackend):
    name = "recording"
    supported_devices = frozenset({"cpu"})
    supported_dtypes = frozenset({F32})
    builders = (bind_builder(FullAttentionSpec, RecordingBuilder, RecordingImpl),)


@pytest.fixture
def received() -> Iterator[Received]:
    RECEIVED.calls.clear()
    yield RECEIVED
    RECEIVED.calls.clear()


def test_a_backend_that_accepts_short_keys_is_never_called_with_them(
    received: Received,
) -> None:
    """The broken variant: an impl that would take ``k[:3]`` for a 4-token step (called
    directly, it does). Behind the runtime the call is refused before it runs."""
    runtime = make_runtime("recording")
    four_token_step(runtime)
    received.calls.clear()
    q, k, v = qkv(4, torch.Generator().manual_seed(10))
    impl = runtime._attention_impls["layer"]
    impl.forward(q, k[:3], v[:3], (), 4, torch.empty(4, HQ, D))  # the impl alone accepts it
    assert len(received.calls) == 1
    received.calls.clear()
    refused(
        runtime,
        InvalidArgumentError,
        r"^layer: key has 3 rows but the step has 4 tokens",
        q,
        k[:3],
        v[:3],
    )
    refused(runtime, InvalidArgumentError, r"^layer: key is on meta", q, k.to("meta"), v)
    assert received.calls == []


def test_the_stride_rule_copies_only_views_with_a_strided_last_dimension(
    received: Received,
) -> None:
    runtime = make_runtime("recording")
    four_token_step(runtime)
    q, k, v = qkv(4, torch.Generator().manual_seed(11))
    # Contiguous tensors and views of a fused projection reach the backend as given.
    for args in ((q, k, v), fused(q, k, v)):
        received.calls.clear()
        out = torch.zeros(4, HQ, D)
        assert runtime.forward("layer", *args, output=out) is out
        ((got_q, got_k, got_v, got_out),) = received.calls
        assert all(
            a is b for a, b in zip((got_q, got_k, got_v, got_out), (*args, out), strict=True)
        )
    # A strided last dimension: one contiguous copy each; the output comes back through
    # a contiguous buffer into the caller's view.
    received.calls.clear()
    views = (transposed(q), last_dim_strided(k), last_dim_strided(v))
    out_view = transposed(torch.zeros(4, HQ, D))
    assert runtime.forward("layer", *views, output=out_view) is out_view
    ((got_q, got_k, got_v, got_out),) = received.calls
    assert got_k is not None
    assert got_v is not None
    for given, got in zip((*views, out_view), (got_q, got_k, got_v, got_out), strict=True):
        assert got is not given
        assert got.is_contiguous()
    for given, got in zip(views, (got_q, got_k, got_v), strict=True):
        assert torch.equal(got, given)
    assert (out_view == 1).all()
