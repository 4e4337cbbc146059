"""State layers through the runtime: every mamba_type, reference and Triton backends,
checked against a dense recompute of each sequence without any cache."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import (
    AttentionConfig,
    BackendRegistry,
    GatedDeltaNetInputs,
    LinearAttentionInputs,
    Mamba1Inputs,
    Mamba1LayerParams,
    Mamba2Inputs,
    Mamba2LayerParams,
    MambaSpec,
    ShortConvInputs,
    StateLayer,
)
from attnkit.demo import PRIORITIES, DemoModel
from attnkit.kernels.mamba2.reference import ssd_recurrent_reference
from attnkit.registry import BUILTIN_BACKENDS
from attnkit.runtime import AttentionRuntime, ScheduledRequest

TOL = 3e-5
LAYOUTS = {
    "mamba2": ("mamba",),
    "gdn": ("gdn",),
    "linear": ("linear",),
    "short_conv": ("short_conv",),
}
EXPECTED_TRITON = {
    "mamba2": "triton_mamba2",
    "gdn": "triton_gdn",
    "linear": "triton_linear_attn",
    "short_conv": "triton_short_conv",
}


def make_runtime(model: DemoModel, prefer: str, seed: int) -> AttentionRuntime:
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    config = AttentionConfig.model_validate({}, context={"registry": reg})
    priority = {"cpu": PRIORITIES[prefer]} if PRIORITIES[prefer] else None
    runtime = AttentionRuntime(
        model.specs,
        config,
        device="cpu",
        memory_budget_bytes=2**22,
        layer_params=model.params,
        registry=reg,
        priority=priority,
        cache_fill=float("nan"),
    )
    random.Random(seed).shuffle(runtime.manager.pool._free)  # non-contiguous state blocks
    return runtime


def run(
    model: DemoModel, runtime: AttentionRuntime, steps: list[list[tuple[str, list[int]]]]
) -> dict[str, torch.Tensor]:
    outputs: dict[str, list[torch.Tensor]] = {}
    for step in steps:
        batch = runtime.begin_step([ScheduledRequest(rid, len(toks)) for rid, toks in step])
        chunks = dict(step)
        tokens = torch.tensor([t for rid in batch.order for t in chunks[rid]])
        hidden = model.forward_step(runtime, tokens)
        for rid, rows in batch.token_slices().items():
            outputs.setdefault(rid, []).append(hidden[rows])
    return {rid: torch.cat(parts) for rid, parts in outputs.items()}


PROMPT = [(i * 7 + 3) % 64 for i in range(37)]
OTHER = [5, 9, 2, 7, 11]


@pytest.mark.parametrize("prefer", ["reference", "triton"])
@pytest.mark.parametrize("mamba_type", list(LAYOUTS))
def test_state_continuity(mamba_type: str, prefer: str) -> None:
    """One-shot prefill == 3 chunks == token by token, all == dense, decodes mixed in."""
    model = DemoModel(layout=LAYOUTS[mamba_type])
    dense = model.forward_dense(torch.tensor([*PROMPT, 1, 2]))
    dense_other = model.forward_dense(torch.tensor([*OTHER, 4, 6]))
    one_shot = make_runtime(model, prefer, 1)
    backend = one_shot.backend_for("layers.0").name
    assert backend == (EXPECTED_TRITON[mamba_type] if prefer == "triton" else "reference")
    a = run(
        model,
        one_shot,
        [[("p", PROMPT), ("o", OTHER)], [("p", [1]), ("o", [4])], [("p", [2]), ("o", [6])]],
    )
    b = run(
        model,
        make_runtime(model, prefer, 2),
        [
            [("o", OTHER), ("p", PROMPT[:5])],
            [("o", [4]), ("p", PROMPT[5:21])],
            [("p", PROMPT[21:]), ("o", [6])],
            [("p", [1])],
            [("p", [2])],
        ],
    )
    tokens = [*PROMPT, 1, 2]
    c = run(model, make_runtime(model, prefer, 3), [[("p", [t])] for t in tokens])
    for got in (a["p"], b["p"], c["p"]):
        torch.testing.assert_close(got, dense, atol=TOL, rtol=TOL)
    for got in (a["o"], b["o"]):
        torch.testing.assert_close(got, dense_other, atol=TOL, rtol=TOL)


@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_random_varlen_batches_hybrid(data: st.DataObject) -> None:
    """Random schedules mixing new requests, continuing prefills and decodes."""
    prefer = data.draw(st.sampled_from(["reference", "triton"]))
    model = DemoModel(layout=("gdn", "full", "mamba", "short_conv", "linear"))
    runtime = make_runtime(model, prefer, data.draw(st.integers(0, 100)))
    lengths = data.draw(st.lists(st.integers(1, 20), min_size=1, max_size=3))
    prompts = {f"r{i}": [(i * 13 + j * 5) % 64 for j in range(n)] for i, n in enumerate(lengths)}
    done = dict.fromkeys(prompts, 0)
    outputs: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    for _ in range(6):
        step = []
        for rid, prompt in prompts.items():
            left = len(prompt) - done[rid]
            if left and data.draw(st.booleans()):
                take = data.draw(st.integers(1, left))
                step.append((rid, prompt[done[rid] : done[rid] + take]))
        if not step:
            continue
        for rid, chunk in step:
            done[rid] += len(chunk)
        got = run(model, runtime, [step])
        for rid, out in got.items():
            outputs[rid].append(out)
    for rid, parts in outputs.items():
        if parts:
            dense = model.forward_dense(torch.tensor(prompts[rid][: done[rid]]))
            torch.testing.assert_close(torch.cat(parts), dense, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("prefer", ["reference", "triton"])
def test_hybrid_demo_passes(prefer: str) -> None:
    """attnkit demo --model hybrid: Mamba2, Gated DeltaNet, linear attention and short
    conv next to full and sliding-window attention, every step checked densely."""
    import io

    from attnkit.demo import run_demo

    out = io.StringIO()
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    result = run_demo(decode_steps=1, out=out, registry=reg, model_name="hybrid", prefer=prefer)
    text = out.getvalue()
    assert result.passed, text
    assert result.max_error < 2e-5
    expected = (
        EXPECTED_TRITON if prefer == "triton" else dict.fromkeys(EXPECTED_TRITON, "reference")
    )
    for mamba_type, backend in expected.items():
        assert f"mamba({mamba_type})" in text
        assert any(
            f"mamba({mamba_type})" in line and line.rstrip().endswith(f"-> {backend} (priority)")
            for line in text.splitlines()
        )


# ----------------------------------------------------------------------------------
# Typed entry points: forward (attention) / forward_state / state_layer (state layers)
# ----------------------------------------------------------------------------------


def test_each_entry_point_refuses_the_other_kind_of_layer() -> None:
    """forward is for attention layers, forward_state for state layers with their type's
    inputs; every refusal names the right call and leaves the step intact."""
    model = DemoModel(layout=("full", "mamba"))
    runtime = make_runtime(model, "reference", 0)
    prompt = [4, 8, 15]
    runtime.begin_step([ScheduledRequest("a", len(prompt))])
    params = model.params["layers.1"]
    assert isinstance(params, Mamba2LayerParams)
    xbc, dt = torch.randn(3, params.conv_dim), torch.randn(3, params.num_heads)
    q = torch.randn(3, 4, 16)

    with pytest.raises(
        TypeError,
        match=r"^layers\.1 is a state layer: call forward_state\('layers\.1', Mamba2Inputs\(\.\.\.\)\)$",
    ):
        runtime.forward("layers.1", q, q[:, :2], q[:, :2])
    with pytest.raises(
        TypeError,
        match=r"^layers\.0 is an attention layer: call forward\('layers\.0', query, key, value\)$",
    ):
        runtime.forward_state("layers.0", Mamba2Inputs(xBC=xbc, dt=dt))
    with pytest.raises(
        TypeError,
        match=r"^layers\.1 is a mamba2 layer: inputs must be Mamba2Inputs, got GatedDeltaNetInputs$",
    ):
        runtime.forward_state(
            "layers.1", GatedDeltaNetInputs(qkv=xbc, g=dt, beta=torch.rand(3, params.num_heads))
        )
    with pytest.raises(
        ValueError,
        match=r"^layers\.1: inputs\.xBC has 2 rows but the step has 3 tokens; inputs\.xBC must be "
        r"float32 \[T, C\]=\[>=3, 96\] on cpu, got float32 \[2, 96\] on cpu$",
    ):
        runtime.forward_state("layers.1", Mamba2Inputs(xBC=xbc[:2], dt=dt[:2]))
    with pytest.raises(TypeError, match=r"^layers\.0 is an attention layer, not a state layer$"):
        runtime.state_layer("layers.0", Mamba2Inputs)
    unknown = r"unknown layer 'layers\.9'; layers: layers\.0, layers\.1"
    with pytest.raises(KeyError, match=unknown):
        runtime.forward("layers.9", q, q[:, :2], q[:, :2])
    with pytest.raises(KeyError, match=unknown):
        runtime.forward_state("layers.9", Mamba2Inputs(xBC=xbc, dt=dt))
    with pytest.raises(KeyError, match=unknown):
        runtime.state_layer("layers.9", Mamba2Inputs)

    # Nothing refused above touched the caches: the step still matches the dense model.
    hidden = model.forward_step(runtime, torch.tensor(prompt))
    dense = model.forward_dense(torch.tensor(prompt))
    torch.testing.assert_close(hidden, dense, atol=TOL, rtol=TOL)


def _mamba2_dense(p: Mamba2LayerParams, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """One whole sequence, no cache: SiLU causal depthwise conv, then the token-by-token SSD."""
    width = p.conv_weight.shape[1]
    padded = torch.cat([xbc.new_zeros(width - 1, xbc.shape[1]), xbc])
    conv = sum(padded[i : i + xbc.shape[0]] * p.conv_weight[:, i] for i in range(width))
    assert isinstance(conv, torch.Tensor)
    if p.conv_bias is not None:
        conv = conv + p.conv_bias
    conv = F.silu(conv)
    hp, gn = p.num_heads * p.head_dim, p.n_groups * p.d_state
    xs, bs, cs = torch.split(conv, [hp, gn, gn], dim=-1)
    t = xbc.shape[0]
    y, _ = ssd_recurrent_reference(
        xs.reshape(t, p.num_heads, p.head_dim),
        dt,
        p.A,
        bs.reshape(t, p.n_groups, p.d_state),
        cs.reshape(t, p.n_groups, p.d_state),
        D=p.D,
        dt_bias=p.dt_bias,
        dt_softplus=p.dt_softplus,
    )
    return y


def test_state_layer_handle_runs_exactly_like_forward_state() -> None:
    """Twin runtimes fed one schedule: the typed handle's outputs and cached states are
    those of forward_state, bit for bit, and both match a dense recompute per request."""
    model = DemoModel(layout=("mamba",))
    params = model.params["layers.0"]
    assert isinstance(params, Mamba2LayerParams)
    by_name, by_handle = make_runtime(model, "reference", 5), make_runtime(model, "reference", 5)
    handle = by_handle.state_layer("layers.0", Mamba2Inputs)
    assert isinstance(handle, StateLayer)
    assert (handle.layer_name, handle.inputs_type) == ("layers.0", Mamba2Inputs)

    gen = torch.Generator().manual_seed(11)
    lengths = {"p": 13, "o": 6}
    xbc_all = {r: torch.randn(n, params.conv_dim, generator=gen) for r, n in lengths.items()}
    dt_all = {r: torch.randn(n, params.num_heads, generator=gen) * 0.5 for r, n in lengths.items()}
    schedule = [{"p": 9, "o": 4}, {"p": 1, "o": 2}, {"p": 3}]
    done = dict.fromkeys(lengths, 0)
    outputs: dict[str, list[torch.Tensor]] = {r: [] for r in lengths}
    for step in schedule:
        scheduled = [ScheduledRequest(r, n) for r, n in step.items()]
        batch = by_name.begin_step(scheduled)
        assert by_handle.begin_step(scheduled) == batch
        rows = {r: slice(done[r], done[r] + step[r]) for r in batch.order}
        inputs = Mamba2Inputs(
            xBC=torch.cat([xbc_all[r][rows[r]] for r in batch.order]),
            dt=torch.cat([dt_all[r][rows[r]] for r in batch.order]),
        )
        want = by_name.forward_state("layers.0", inputs)
        got = handle.forward(inputs)
        torch.testing.assert_close(got, want, atol=0.0, rtol=0.0)
        for r, part in batch.token_slices().items():
            outputs[r].append(got[part])
            done[r] += step[r]
    for a, b in zip(by_name.kv_caches["layers.0"], by_handle.kv_caches["layers.0"], strict=True):
        torch.testing.assert_close(b, a, atol=0.0, rtol=0.0, equal_nan=True)
    for r, n in lengths.items():
        assert done[r] == n
        dense = _mamba2_dense(params, xbc_all[r], dt_all[r])
        torch.testing.assert_close(torch.cat(outputs[r]), dense, atol=TOL, rtol=TOL)

    # The handle is typed by its input class; another class is refused, at creation
    # and (for an untyped caller) at forward.
    with pytest.raises(
        TypeError,
        match=r"^layers\.0 is a mamba2 layer taking Mamba2Inputs, not GatedDeltaNetInputs$",
    ):
        by_handle.state_layer("layers.0", GatedDeltaNetInputs)
    by_handle.begin_step([ScheduledRequest("p", 1)])
    wrong: Any = GatedDeltaNetInputs(
        qkv=torch.randn(1, params.conv_dim), g=torch.randn(1, 4), beta=torch.randn(1, 4)
    )
    with pytest.raises(TypeError, match=r"inputs must be Mamba2Inputs, got GatedDeltaNetInputs"):
        handle.forward(wrong)


T4 = torch.zeros(4, 8)

INPUT_CASES = [
    pytest.param(Mamba2Inputs, {"xBC": T4, "dt": torch.zeros(4, 2)}, id="mamba2"),
    pytest.param(
        GatedDeltaNetInputs,
        {"qkv": T4, "g": torch.zeros(4, 2), "beta": torch.zeros(4, 2)},
        id="gdn",
    ),
    pytest.param(
        LinearAttentionInputs,
        {"q": torch.zeros(4, 2, 8), "k": torch.zeros(4, 2, 8), "v": torch.zeros(4, 2, 4)},
        id="linear",
    ),
    pytest.param(ShortConvInputs, {"b": T4, "c": T4, "x": T4}, id="short_conv"),
    pytest.param(Mamba1Inputs, {"x": T4}, id="mamba1"),
]


@pytest.mark.parametrize(("cls", "fields"), INPUT_CASES)
def test_state_inputs_check_their_tensors(cls: type[Any], fields: dict[str, torch.Tensor]) -> None:
    name = cls.__name__
    ok = cls(**fields)
    assert (ok.num_rows, ok.device, ok.dtype) == (4, torch.device("cpu"), torch.float32)
    first = next(iter(fields))
    for field in fields:
        for bad, shown in ((None, "NoneType"), (fields[field].tolist(), "list")):
            with pytest.raises(
                TypeError, match=rf"^{name}\.{field} must be a torch\.Tensor, got {shown}$"
            ):
                cls(**{**fields, field: bad})
        if field != first:
            short = fields[field][:3]
            with pytest.raises(
                ValueError,
                match=rf"^{name}\.{field} must have the same rows and device as {first} "
                rf"\(4 on cpu\), got 3 on cpu$",
            ):
                cls(**{**fields, field: short})
        with pytest.raises(ValueError, match=rf"^{name}\.{field} must have a token dimension"):
            cls(**{**fields, field: torch.tensor(1.0)})
    # Keyword-only, and no field beyond the type's own (no stray "value" for Mamba2).
    with pytest.raises(TypeError):
        cls(*fields.values())
    with pytest.raises(TypeError, match="unexpected keyword argument 'value'"):
        cls(**{**fields, "value": T4})
    with pytest.raises(TypeError, match=f"missing 1 required keyword-only argument: '{first}'"):
        cls(**{k: v for k, v in fields.items() if k != first})


# ----------------------------------------------------------------------------------
# Mamba (1): a layer built by hand, against a token-by-token definition of the core.
# ----------------------------------------------------------------------------------

M1_D, M1_N, M1_R, M1_W = 6, 4, 3, 4


def _mamba1_params(seed: int, *, norms: bool) -> Mamba1LayerParams:
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    return Mamba1LayerParams(
        d_inner=M1_D,
        d_state=M1_N,
        conv_weight=rnd(M1_D, M1_W, scale=0.5),
        conv_bias=rnd(M1_D, scale=0.1),
        x_proj_weight=rnd(M1_R + 2 * M1_N, M1_D, scale=0.5),
        dt_proj_weight=rnd(M1_D, M1_R, scale=0.5),
        dt_bias=rnd(M1_D, scale=0.3),
        A=-torch.rand(M1_D, M1_N, generator=gen) - 0.2,
        D=rnd(M1_D),
        dt_norm_weight=torch.rand(M1_R, generator=gen) + 0.5 if norms else None,
        B_norm_weight=torch.rand(M1_N, generator=gen) + 0.5 if norms else None,
        C_norm_weight=torch.rand(M1_N, generator=gen) + 0.5 if norms else None,
    )


def _mamba1_definition(p: Mamba1LayerParams, x: torch.Tensor) -> torch.Tensor:
    """One whole sequence, no cache, token by token (Gu & Dao 2023, Algorithm 2):
    u = silu(causal depthwise conv(x)); dt_low, B, C = x_proj u (RMS-normed when Jamba
    norms are given); dt = softplus(dt_proj dt_low + dt_bias);
    h = exp(dt A) h + dt u B; y = h C + D u."""
    x = x.double()
    width = p.conv_weight.shape[1]
    h = torch.zeros(p.d_inner, p.d_state, dtype=torch.float64)
    history = [torch.zeros(p.d_inner, dtype=torch.float64)] * (width - 1)
    ys = []

    def rms(v: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        if w is None:
            return v
        return v / torch.sqrt((v * v).mean() + p.norm_eps) * w.double()

    for t in range(x.shape[0]):
        history = [*history, x[t]][-width:]
        conv = sum(history[k] * p.conv_weight[:, k].double() for k in range(width))
        assert isinstance(conv, torch.Tensor)
        u = F.silu(conv + p.conv_bias.double()) if p.conv_bias is not None else F.silu(conv)
        proj = p.x_proj_weight.double() @ u
        r = p.dt_rank
        low = rms(proj[:r], p.dt_norm_weight)
        b = rms(proj[r : r + p.d_state], p.B_norm_weight)
        c = rms(proj[r + p.d_state :], p.C_norm_weight)
        dt = p.dt_proj_weight.double() @ low
        if p.dt_bias is not None:
            dt = dt + p.dt_bias.double()
        dt = F.softplus(dt)
        h = torch.exp(dt[:, None] * p.A.double()) * h + (dt * u)[:, None] * b[None, :]
        y = h @ c
        if p.D is not None:
            y = y + p.D.double() * u
        ys.append(y)
    return torch.stack(ys).float()


MAMBA1_BACKENDS = {"reference": ("reference",), "triton_mamba1": ("triton_mamba1", "reference")}


@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize("backend", list(MAMBA1_BACKENDS))
def test_mamba1_layer_over_multi_step_schedules(backend: str, norms: bool) -> None:
    """Chunked prefill continuing from a cached state, decodes, ragged batches, a
    request joining late; unused cache slots are NaN. Every request's outputs equal the
    definition over its whole sequence."""
    params = _mamba1_params(7, norms=norms)
    spec = MambaSpec(
        block_size=1,
        shapes=params.state_shapes,
        dtypes=(torch.float32, torch.float32),
        mamba_type="mamba1",
    )
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    runtime = AttentionRuntime(
        {"mixer": spec},
        AttentionConfig.model_validate({}, context={"registry": reg}),
        device="cpu",
        memory_budget_bytes=2**16,
        layer_params={"mixer": params},
        registry=reg,
        priority={"cpu": MAMBA1_BACKENDS[backend]},
        cache_fill=float("nan"),
    )
    random.Random(3).shuffle(runtime.manager.pool._free)
    assert runtime.backend_for("mixer").name == backend
    layer = runtime.state_layer("mixer", Mamba1Inputs)
    gen = torch.Generator().manual_seed(8)
    lengths = {"p": 14, "o": 7, "q": 5}
    xs = {r: torch.randn(n, M1_D, generator=gen) for r, n in lengths.items()}
    schedule = [
        {"p": 5, "o": 6},
        {"p": 6, "q": 3},  # p continues its prefill from the cached state
        {"o": 1, "p": 1, "q": 1},  # decodes
        {"q": 1, "p": 2},
    ]
    done = dict.fromkeys(lengths, 0)
    outputs: dict[str, list[torch.Tensor]] = {r: [] for r in lengths}
    for step in schedule:
        batch = runtime.begin_step([ScheduledRequest(r, n) for r, n in step.items()])
        x = torch.cat([xs[r][done[r] : done[r] + step[r]] for r in batch.order])
        y = layer.forward(Mamba1Inputs(x=x))
        assert y.shape == (x.shape[0], M1_D)
        for r, rows in batch.token_slices().items():
            outputs[r].append(y[rows])
            done[r] += step[r]
    assert done == lengths
    for r in lengths:
        torch.testing.assert_close(
            torch.cat(outputs[r]), _mamba1_definition(params, xs[r]), atol=TOL, rtol=TOL
        )
