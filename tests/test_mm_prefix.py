"""Bidirectional image ranges (``AttentionSpec.mm_prefix``, ``ScheduledRequest.
mm_prefix_ranges``): every backend that declares the feature against a float64 oracle
written here from the rule, on the image positions' outputs (not end logits); a control
that fails when the ranges are ignored; the window clamp (Gemma 4); the refusals."""

from __future__ import annotations

import os

import pytest
import torch

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    FullAttentionSpec,
    ScheduledRequest,
    SlidingWindowSpec,
)
from attnkit.capabilities import AttentionFeature
from attnkit.errors import AttnkitError, InvalidArgumentError
from attnkit.registry import default_registry

HQ, HKV, D, BS = 4, 2, 32, 16
BUDGET = 8 << 20


def oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranges: list[tuple[int, int]],
    window: int | None,
) -> torch.Tensor:
    """One request's whole prompt in float64: a dense mask from the rule
    (causal OR query and key in one range) AND window (transformers' Gemma 3 / Gemma 4
    sliding layers: AND(sliding_window, OR(causal, blockwise)))."""
    n = q.shape[0]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    mask = j <= i
    for s, e in ranges:
        mask |= (i >= s) & (i < e) & (j >= s) & (j < e)
    if window is not None:
        mask &= (i - j) < window
    g = HQ // HKV
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    s_ = torch.einsum("qhd,khd->hqk", q.double(), kk) * D**-0.5
    s_ = s_.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s_, dim=-1), vv)


def _spec(window: int | None, mm: bool) -> FullAttentionSpec | SlidingWindowSpec:
    if window is None:
        return FullAttentionSpec(
            block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32, mm_prefix=mm
        )
    return SlidingWindowSpec(
        block_size=BS,
        num_kv_heads=HKV,
        head_size=D,
        dtype=torch.float32,
        sliding_window=window,
        mm_prefix=mm,
    )


def _runtime(backend: str, window: int | None, mm: bool = True) -> AttentionRuntime:
    return AttentionRuntime(
        {"layer": _spec(window, mm)},
        AttentionConfig(backend=backend, max_mm_prefix_ranges=4),
        device="cpu",
        memory_budget_bytes=BUDGET,
        layer_params={"layer": AttentionLayerParams(num_heads=HQ)},
        cache_fill=float("nan"),
    )


# Prompt of 40 tokens: text, an image [5, 22), text, an image [27, 35), text.
N = 40
RANGES = [(5, 22), (27, 35)]
# Chunks that never end inside a range; the second starts inside none.
CHUNKS = [22, 13, 5]


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(N, HQ, D, generator=gen),
        torch.randn(N, HKV, D, generator=gen),
        torch.randn(N, HKV, D, generator=gen),
    )


def _run(
    runtime: AttentionRuntime,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranges: list[tuple[int, int]],
    chunks: list[int],
) -> torch.Tensor:
    """The prompt in ``chunks``, a second short request beside it, and the outputs."""
    out = torch.full_like(q, float("nan"))
    done = 0
    other_q = torch.randn(3, HQ, D)
    other_kv = torch.randn(3, HKV, D)
    for step, n in enumerate(chunks):
        scheduled = [
            ScheduledRequest(
                "img", n, mm_prefix_ranges=tuple(ranges) if step == 0 and ranges else ()
            )
        ]
        if step == 0:
            scheduled.append(ScheduledRequest("txt", 3))
        batch = runtime.begin_step(scheduled)
        rows = batch.token_slices()
        total = batch.num_tokens
        qs = torch.zeros(total, HQ, D)
        ks = torch.zeros(total, HKV, D)
        vs = torch.zeros(total, HKV, D)
        qs[rows["img"]] = q[done : done + n]
        ks[rows["img"]] = k[done : done + n]
        vs[rows["img"]] = v[done : done + n]
        if "txt" in rows:
            qs[rows["txt"]], ks[rows["txt"]], vs[rows["txt"]] = other_q, other_kv, other_kv
        result = runtime.forward("layer", qs, ks, vs)
        out[done : done + n] = result[rows["img"]]
        done += n
    return out


def _image_rows() -> torch.Tensor:
    return torch.tensor([p for s, e in RANGES for p in range(s, e)])


def _backends() -> list[object]:
    found: list[object] = ["reference", "cpu_attn"]
    if os.environ.get("TRITON_INTERPRET") == "1":
        found.append("triton_attn")
    found.append(pytest.param("flex_attention", marks=pytest.mark.slow))
    return found


@pytest.mark.parametrize("window", [None, 8], ids=["full", "window8"])
@pytest.mark.parametrize("backend", _backends())
def test_image_positions_match_the_oracle(backend: str, window: int | None) -> None:
    q, k, v = _inputs()
    want = oracle(q, k, v, RANGES, window)
    got = _run(_runtime(backend, window), q, k, v, RANGES, CHUNKS)
    img = _image_rows()
    err = (got.double() - want).abs().max().item()
    img_err = (got[img].double() - want[img]).abs().max().item()
    assert img_err < 2e-5, f"{backend}: image positions off by {img_err}"
    assert err < 2e-5, f"{backend}: some position off by {err}"


@pytest.mark.parametrize("backend", ["reference", "cpu_attn"])
def test_control_ignoring_the_ranges_is_caught(backend: str) -> None:
    """The broken variant: the same layer with the ranges ignored (causal only) is far
    from the oracle on the image positions, so the test above can see the difference."""
    q, k, v = _inputs()
    want = oracle(q, k, v, RANGES, None)
    broken = _run(_runtime(backend, None, mm=False), q, k, v, [], CHUNKS)
    img = _image_rows()
    err = (broken[img].double() - want[img]).abs().max().item()
    assert err > 1e-1, err
    # Outside the images, causal rows before the first image are the same.
    assert (broken[:5].double() - want[:5]).abs().max().item() < 2e-5


def test_window_clamp_differs_from_dropping_or_ignoring_the_window() -> None:
    """Gemma 4 (sliding layers): a range longer than the window is clamped to it (the
    look-back stays bounded), neither dropped (plain causal window) nor kept whole
    (every key of the range, ignoring the window)."""
    q, k, v = _inputs(1)
    got = _run(_runtime("reference", 8), q, k, v, RANGES, CHUNKS)
    img = _image_rows()
    clamped = oracle(q, k, v, RANGES, 8)
    dropped = oracle(q, k, v, [], 8)
    n = N
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    whole_mask = (j <= i) & ((i - j) < 8)
    for s, e in RANGES:
        whole_mask |= (i >= s) & (i < e) & (j >= s) & (j < e)
    g = HQ // HKV
    scores = torch.einsum(
        "qhd,khd->hqk", q.double(), k.double().repeat_interleave(g, dim=1)
    ) * D**-0.5
    weights = torch.softmax(scores.masked_fill(~whole_mask[None], float("-inf")), dim=-1)
    whole = torch.einsum("hqk,khd->qhd", weights, v.double().repeat_interleave(g, dim=1))
    assert (got[img].double() - clamped[img]).abs().max() < 2e-5
    assert (got[img].double() - dropped[img]).abs().max() > 1e-1
    assert (got[img].double() - whole[img]).abs().max() > 1e-1


@pytest.mark.parametrize("backend", _backends())
def test_decodes_after_an_image_prompt_are_causal(backend: str) -> None:
    """After the prompt, decode steps see the whole context, the images included, and
    the ranges no longer extend any row."""
    q, k, v = _inputs(2)
    runtime = _runtime(backend, 8)
    _run(runtime, q[:35], k[:35], v[:35], RANGES, [22, 13])
    want = oracle(q, k, v, RANGES, 8)
    for p in range(35, N):
        runtime.begin_step([ScheduledRequest("img", 1)])
        out = runtime.forward("layer", q[p : p + 1], k[p : p + 1], v[p : p + 1])
        assert (out.double() - want[p : p + 1]).abs().max() < 2e-5, p


def test_metadata_carries_fixed_shape_ranges() -> None:
    runtime = _runtime("reference", None)
    runtime.begin_step(
        [ScheduledRequest("a", 22, mm_prefix_ranges=((5, 22), (27, 35))), ScheduledRequest("b", 2)]
    )
    common = runtime._groups[0].common
    assert common is not None
    assert common.mm_prefix_ranges_cpu is not None
    assert common.mm_prefix_counts_cpu is not None
    assert tuple(common.mm_prefix_ranges_cpu.shape) == (2, 4, 2)
    order = list(runtime._step.order) if runtime._step is not None else []
    a = order.index("a")
    assert common.mm_prefix_ranges_cpu[a, :2].tolist() == [[5, 22], [27, 35]]
    assert common.mm_prefix_counts_cpu.tolist()[a] == 2
    assert common.mm_prefix_counts_cpu.tolist()[1 - a] == 0


def _state(runtime: AttentionRuntime) -> tuple[object, ...]:
    m = runtime.manager
    return (m.rows_version, tuple(sorted(m.pool._free)), dict(runtime._mm._live) if runtime._mm else None)


@pytest.mark.parametrize(
    ("first", "bad", "needle"),
    [
        (None, ScheduledRequest("a", 10, mm_prefix_ranges=((5, 22),)), "strictly inside image range"),
        ((22, ((5, 22), (27, 35))), ScheduledRequest("a", 8), "[27, 35)"),
        (
            None,
            ScheduledRequest("a", 4, mm_prefix_ranges=((0, 1), (1, 2), (2, 3), (3, 4), (4, 5))),
            "max_mm_prefix_ranges=4",
        ),
    ],
    ids=["first-chunk-cuts", "later-chunk-cuts", "too-many"],
)
def test_refusals_name_request_and_range_and_change_nothing(
    first: tuple[int, tuple[tuple[int, int], ...]] | None, bad: ScheduledRequest, needle: str
) -> None:
    runtime = _runtime("reference", None)
    if first is not None:
        n, ranges = first
        runtime.begin_step([ScheduledRequest("a", n, mm_prefix_ranges=ranges)])
    before = _state(runtime)
    with pytest.raises(InvalidArgumentError) as info:
        runtime.begin_step([bad])
    assert "'a'" in str(info.value)
    assert needle in str(info.value)
    assert _state(runtime) == before


def test_bad_ranges_are_refused_where_the_engine_makes_them() -> None:
    cases = [
        (((5, 3),), "start < end"),
        (((0, 4), (3, 6)), "sorted and not overlap"),
        (((0, -1),), "ints >= 0"),
        ([(0, 4)], "tuple"),
    ]
    for ranges, needle in cases:
        with pytest.raises(AttnkitError) as info:
            ScheduledRequest("x", 4, mm_prefix_ranges=ranges)  # type: ignore[arg-type]  # a list on purpose
        assert needle in str(info.value)
        assert "mm_prefix_ranges" in str(info.value)


def test_ranges_without_a_layer_that_takes_them_are_refused() -> None:
    runtime = _runtime("reference", None, mm=False)
    with pytest.raises(InvalidArgumentError, match="no layer of this runtime takes image"):
        runtime.begin_step([ScheduledRequest("a", 4, mm_prefix_ranges=((0, 4),))])


def test_spec_refuses_mm_prefix_on_kinds_without_it() -> None:
    from attnkit import ChunkedLocalAttentionSpec

    with pytest.raises(InvalidArgumentError, match="chunked_local_attention takes no"):
        ChunkedLocalAttentionSpec(
            block_size=16,
            num_kv_heads=1,
            head_size=16,
            dtype=torch.float32,
            attention_chunk_size=8,
            mm_prefix=True,
        )


def test_selection_refuses_a_backend_without_the_feature() -> None:
    reg = default_registry()
    spec = _spec(None, True)
    for name in reg.names():
        backend = reg.get(name)
        if spec.kind not in backend.supported_kinds():
            continue
        from attnkit.backend import BackendRequest

        reasons = backend.not_supported_reasons(BackendRequest(spec=spec, device=torch.device("cpu")))
        mentions = any("mm_prefix" in r for r in reasons)
        assert mentions == (AttentionFeature.MM_PREFIX not in backend.supported_features), name


# ------------------------------------------------------------------ the engine


def _engine_model(prefix: bool) -> tuple[object, AttentionRuntime]:
    from attnkit.integrations.engine import Engine, FunctionModel

    runtime = AttentionRuntime(
        {"layer": _spec(None, True)},
        AttentionConfig(
            backend="cpu_attn",
            max_mm_prefix_ranges=4,
            prefix_caching={"enabled": prefix},
        ),
        device="cpu",
        memory_budget_bytes=BUDGET,
        layer_params={"layer": AttentionLayerParams(num_heads=HQ)},
        cache_fill=float("nan"),
    )
    emb = torch.randn(64, HQ * D, generator=torch.Generator().manual_seed(3))
    head = torch.randn(HQ * D, 64, generator=torch.Generator().manual_seed(4))

    def call(batch: object, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = emb[token_ids]
        q = x.view(-1, HQ, D)
        kv = x.view(-1, HQ, D)[:, :HKV]
        return runtime.forward("layer", q, kv, kv).reshape(-1, HQ * D) @ head

    return Engine(FunctionModel(runtime, call), max_tokens_per_step=12), runtime


def test_engine_never_splits_an_image_range() -> None:
    from attnkit.integrations.engine import SamplingParams

    engine, _ = _engine_model(prefix=False)
    assert hasattr(engine, "run")
    prompt = list(range(1, 31))
    ranges = ((3, 13), (14, 18), (20, 30))
    engine.add_request("a", prompt, SamplingParams(max_new_tokens=2), mm_prefix_ranges=ranges)  # type: ignore[attr-defined]
    result = engine.run()  # type: ignore[attr-defined]
    done = 0
    for step in result.steps:
        for rid, n in step.scheduled:
            assert rid == "a"
            end = done + n
            assert not any(s < end < e for s, e in ranges), (done, n)
            done = end
    assert len(result.outputs["a"]) == 2


def test_engine_shortens_a_prefix_hit_that_ends_inside_a_range() -> None:
    from attnkit.integrations.engine import SamplingParams

    engine, runtime = _engine_model(prefix=True)
    prompt = list(range(1, 25))
    ranges = ((12, 22),)  # a hit of one block (16 tokens) would end inside it
    engine.add_request("a", prompt, SamplingParams(max_new_tokens=1), mm_prefix_ranges=ranges)  # type: ignore[attr-defined]
    engine.run()  # type: ignore[attr-defined]
    assert runtime.match_prefix(prompt).num_tokens == 16  # cached: the hit would cut the range
    engine.add_request("b", prompt, SamplingParams(max_new_tokens=1), mm_prefix_ranges=ranges)  # type: ignore[attr-defined]
    result = engine.run()  # type: ignore[attr-defined]
    assert len(result.outputs["b"]) == 1
    # b computed its whole prompt (the hit was shortened to 0 tokens: blocks of 16).
    b_steps = [n for step in result.steps for rid, n in step.scheduled if rid == "b"]
    assert sum(b_steps) == len(prompt)


def test_engine_refuses_ranges_outside_the_prompt_or_the_step() -> None:
    from attnkit.errors import EngineLimitError

    engine, _ = _engine_model(prefix=False)
    with pytest.raises(InvalidArgumentError, match="past the prompt's 5 tokens"):
        engine.add_request("a", [1, 2, 3, 4, 5], mm_prefix_ranges=((2, 7),))  # type: ignore[attr-defined]
    with pytest.raises(EngineLimitError, match="max_tokens_per_step=12"):
        engine.add_request("b", list(range(30)), mm_prefix_ranges=((2, 20),))  # type: ignore[attr-defined]


def test_runtime_refuses_a_prefix_hit_inside_a_range_and_changes_nothing() -> None:
    _, runtime = _engine_model(prefix=True)
    prompt = list(range(1, 41))
    first = runtime.match_prefix(prompt)
    runtime.begin_step([ScheduledRequest("a", 40, prefix=first, mm_prefix_ranges=((12, 22),))])
    runtime.free(["a"], token_ids={"a": prompt})
    match = runtime.match_prefix(prompt)
    assert match.num_tokens == 32
    ok = runtime.match_prefix(prompt)
    before = _state(runtime)
    with pytest.raises(InvalidArgumentError, match=r"prefix hit \(prefix.num_tokens=16\)"):
        runtime.begin_step(
            [ScheduledRequest("b", 24, prefix=runtime.match_prefix(prompt[:17]), mm_prefix_ranges=((12, 22),))]
        )
    assert _state(runtime) == before
    # The hit of 32 ends after the range: served.
    runtime.begin_step([ScheduledRequest("b", 8, prefix=ok, mm_prefix_ranges=((12, 22),))])


def test_kernel_arguments_for_ranges_are_checked() -> None:
    from attnkit.kernels.attention.reference import dense_attention, paged_attention

    q = torch.zeros(4, 2, 16)
    kv = torch.zeros(4, 1, 16)
    with pytest.raises(ValueError, match="mm_prefix_ranges needs causal attention without chunk"):
        dense_attention(q, kv, kv, scale=1.0, chunk_size=2, mm_prefix_ranges=torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match=r"mm_prefix_ranges must be an integer tensor \[R, 2\]"):
        dense_attention(q, kv, kv, scale=1.0, mm_prefix_ranges=torch.tensor([0, 2]))
    cache = torch.zeros(2, 2, 4, 1, 16)
    with pytest.raises(ValueError, match=r"mm_prefix_ranges must be an integer tensor \[B=1, R, 2\]"):
        paged_attention(
            q,
            cache,
            query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
            seq_lens=torch.tensor([4], dtype=torch.int32),
            block_table=torch.tensor([[1]], dtype=torch.int32),
            scale=1.0,
            mm_prefix_ranges=torch.zeros(2, 1, 2, dtype=torch.int32),
        )


# ------------------------------------------------------------------ model families

_TEXT = {
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "hidden_size": 64,
    "sliding_window": 16,
}


def _marks(config: dict[str, object]) -> list[tuple[str, bool]]:
    from attnkit.models import layout_from_hf_config

    layout = layout_from_hf_config(config)
    return [(type(i.spec).__name__, getattr(i.spec, "mm_prefix", False)) for i in layout.layers.values()]


def test_families_that_attend_to_images_bidirectionally_are_marked() -> None:
    gemma3 = _marks({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", **_TEXT}})
    assert [kind for kind, _ in gemma3] == ["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"]
    assert all(mark for _, mark in gemma3)  # every layer, full ones included
    text_only = _marks({"model_type": "gemma3_text", **_TEXT})
    assert not any(mark for _, mark in text_only)
    pali2 = _marks({"model_type": "paligemma", "text_config": {"model_type": "gemma2", **_TEXT}})
    assert len(pali2) == 6
    assert all(mark for _, mark in pali2)
    pali1 = _marks({"model_type": "paligemma", "text_config": {"model_type": "gemma", **_TEXT}})
    assert pali1 == [("FullAttentionSpec", True)] * 6


def test_the_window_only_rule_marks_sliding_layers_only() -> None:
    """Gemma 4's rule (its full-attention layers stay causal), on the Gemma reader."""
    from attnkit.models._config import _Builder, _Config
    from attnkit.models._dense import _gemma

    cfg = _Config({"model_type": "gemma3_text", **_TEXT}, "gemma3_text")
    layers = list(_gemma(cfg, _Builder(torch.float32, 16, "auto"), "m", gemma3=True, mm_prefix="window"))
    marks = [(type(i.spec).__name__, i.spec.mm_prefix) for _, i in layers]  # type: ignore[attr-defined]
    assert marks == [("SlidingWindowSpec", True)] * 5 + [("FullAttentionSpec", False)]


_GEMMA4 = {
    "model_type": "gemma4_text",
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_global_key_value_heads": 1,
    "head_dim": 32,
    "global_head_dim": 64,
    "hidden_size": 128,
    "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "use_bidirectional_attention": "vision",
}


def test_gemma4_marks_its_window_layers_only_with_their_own_head_sizes() -> None:
    """Gemma 4 (``use_bidirectional_attention: "vision"``): image ranges on the sliding
    layers, clamped by their window; the full layers stay causal and have their own
    head size and K/V head count (``global_head_dim``, ``num_global_key_value_heads``)."""
    from attnkit.models import layout_from_hf_config

    layout = layout_from_hf_config({"model_type": "gemma4", "text_config": _GEMMA4})
    from attnkit.spec import AttentionSpec

    rows = []
    for name, info in layout.layers.items():
        spec = info.spec
        assert isinstance(spec, AttentionSpec)
        rows.append((name, type(spec).__name__, spec.mm_prefix, spec.head_size, spec.num_kv_heads))
    assert rows == [
        ("model.language_model.layers.0.self_attn", "SlidingWindowSpec", True, 32, 4),
        ("model.language_model.layers.1.self_attn", "FullAttentionSpec", False, 64, 1),
        ("model.language_model.layers.2.self_attn", "SlidingWindowSpec", True, 32, 4),
        ("model.language_model.layers.3.self_attn", "FullAttentionSpec", False, 64, 1),
    ]
    assert {i.scale for i in layout.layers.values()} == {1.0}  # the q/k norms scale
    assert [i.sliding_window for i in layout.layers.values()] == [16, None, 16, None]
    # The control: without the flag no layer takes ranges.
    plain = _marks({**_GEMMA4, "use_bidirectional_attention": None})
    assert not any(mark for _, mark in plain)
    text = _marks(_GEMMA4)  # gemma4_text with the flag: the same rule
    assert [mark for _, mark in text] == [True, False, True, False]


def test_gemma4_refuses_what_it_cannot_describe() -> None:
    from attnkit import InvalidArgumentError
    from attnkit.models import layout_from_hf_config

    with pytest.raises(InvalidArgumentError, match=r"'text_config.num_kv_shared_layers' is 2"):
        layout_from_hf_config(
            {"model_type": "gemma4", "text_config": {**_GEMMA4, "num_kv_shared_layers": 2}}
        )
    with pytest.raises(InvalidArgumentError, match=r"'use_bidirectional_attention' must be"):
        layout_from_hf_config({**_GEMMA4, "use_bidirectional_attention": True})
    with pytest.raises(InvalidArgumentError, match=r"needs key 'layer_types'"):
        layout_from_hf_config({k: v for k, v in _GEMMA4.items() if k != "layer_types"})


def test_molmo2_and_bagel_mark_every_layer() -> None:
    """vLLM's ``is_mm_prefix_lm`` families beside Gemma 3 and PaliGemma: Molmo2 (its
    ``text_config``) and Bagel (a Qwen2 ``llm_config``)."""
    text = {k: v for k, v in _TEXT.items() if k != "sliding_window"}
    molmo = _marks({"model_type": "molmo2", "text_config": text})
    assert molmo == [("FullAttentionSpec", True)] * 6
    bagel = _marks({"model_type": "bagel", "llm_config": {"model_type": "qwen2", **text}})
    assert bagel == [("FullAttentionSpec", True)] * 6
    plain_qwen = _marks({"model_type": "qwen2", **text})  # the same decoder, text only
    assert plain_qwen == [("FullAttentionSpec", False)] * 6
