"""AttentionRuntime: routing, multi-step equivalence, cache use, errors."""

from __future__ import annotations

import dataclasses
import io
import random
from typing import Any

import pytest
import torch

from attnkit import (
    AttentionCGSupport,
    AttentionConfig,
    AttentionLayerParams,
    BackendRegistry,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from attnkit.demo import DemoModel, run_demo
from attnkit.kernels.attention.reference import dense_attention
from attnkit.kv_cache import OutOfBlocksError
from attnkit.registry import BUILTIN_BACKENDS
from attnkit.runtime import AttentionRuntime, ScheduledRequest


def builtin_registry() -> BackendRegistry:
    return BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)


def make_runtime(
    model: DemoModel, per_kind: str = "", *, budget: int = 2**20, shuffle: int | None = 0
) -> AttentionRuntime:
    reg = builtin_registry()
    config = AttentionConfig.model_validate(
        {"backend_per_kind": per_kind}, context={"registry": reg}
    )
    runtime = AttentionRuntime(
        model.specs,
        config,
        device="cpu",
        memory_budget_bytes=budget,
        layer_params=model.params,
        registry=reg,
        cache_fill=float("nan"),
    )
    if shuffle is not None:
        # Hand out physical blocks in a random order, so nothing can rely on contiguity.
        random.Random(shuffle).shuffle(runtime.manager.pool._free)
    return runtime


def run_steps(
    model: DemoModel, runtime: AttentionRuntime, steps: list[list[tuple[str, list[int]]]]
) -> dict[str, torch.Tensor]:
    """Feed explicit token chunks per step; return each request's outputs, concatenated."""
    outputs: dict[str, list[torch.Tensor]] = {}
    for step in steps:
        batch = runtime.begin_step([ScheduledRequest(rid, len(toks)) for rid, toks in step])
        chunks = dict(step)
        tokens = torch.tensor([t for rid in batch.order for t in chunks[rid]])
        hidden = model.forward_step(runtime, tokens)
        for rid, rows in batch.token_slices().items():
            outputs.setdefault(rid, []).append(hidden[rows])
    return {rid: torch.cat(parts) for rid, parts in outputs.items()}


HYBRID = ("full", "mamba", "window", "mamba", "full")


def test_chunked_prefill_in_three_chunks_equals_one_shot_and_dense() -> None:
    model = DemoModel(layout=HYBRID, window=5)
    prompt = torch.randint(0, 64, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    other = [7, 8, 9, 10]
    one_shot = run_steps(
        model,
        make_runtime(model, shuffle=1),
        [[("p", prompt), ("o", other)], [("p", [5]), ("o", [6])]],
    )
    chunked = run_steps(
        model,
        make_runtime(model, shuffle=2),
        [
            [("p", prompt[:6]), ("o", other)],
            [("p", prompt[6:15]), ("o", [6])],
            [("p", prompt[15:])],
            [("p", [5])],
        ],
    )
    torch.testing.assert_close(chunked["p"], one_shot["p"], atol=2e-5, rtol=2e-5)
    dense = model.forward_dense(torch.tensor([*prompt, 5]))
    torch.testing.assert_close(one_shot["p"], dense, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(
        one_shot["o"], model.forward_dense(torch.tensor([*other, 6])), atol=2e-5, rtol=2e-5
    )


@pytest.mark.parametrize(
    ("full_backend", "window_backend"),
    [
        pytest.param("reference", "triton_attn", id="full-reference-window-triton"),
        pytest.param("triton_attn", "reference", id="full-triton-window-reference"),
    ],
)
def test_routing_is_causal(full_backend: str, window_backend: str) -> None:
    from attnkit.backends.reference import ReferenceAttentionMetadata
    from attnkit.backends.triton_attn import TritonAttentionMetadata

    metadata_type = {
        "reference": ReferenceAttentionMetadata,
        "triton_attn": TritonAttentionMetadata,
    }
    model = DemoModel(layout=("full", "window"), window=4)
    runtime = make_runtime(model, f"full_attention={full_backend},sliding_window={window_backend}")
    rows = {r.layer: (r.kind.value, r.backend, r.source) for r in runtime.routing_table()}
    assert rows == {
        "layers.0": ("full_attention", full_backend, "backend_per_kind"),
        "layers.1": ("sliding_window", window_backend, "backend_per_kind"),
    }
    prompt = [1, 2, 3, 4, 5, 6, 7]
    out = run_steps(model, runtime, [[("r", prompt)]])
    # The metadata each layer consumed came from the backend the mapping named.
    assert type(runtime.metadata_for("layers.0")) is metadata_type[full_backend]
    assert type(runtime.metadata_for("layers.1")) is metadata_type[window_backend]
    assert runtime.backend_for("layers.1").name == window_backend
    torch.testing.assert_close(
        out["r"], model.forward_dense(torch.tensor(prompt)), atol=2e-5, rtol=2e-5
    )


def test_cudagraph_support_is_the_minimum_and_names_the_group() -> None:
    model = DemoModel(layout=("full", "mamba"))
    runtime = make_runtime(model)
    level, who = runtime.cudagraph_support()
    assert level is AttentionCGSupport.NEVER
    # The CPU default for attention (cpu_attn, the CPU engines) never captures graphs.
    assert who.startswith("group 0 (full_attention, backend cpu_attn)")


def test_out_of_blocks_leaves_the_runtime_usable() -> None:
    model = DemoModel(layout=("full",), block_size=16)
    # Page: 2 * 16 * 2 heads * 16 * 4 B = 4096 B; 4 blocks = null + 3 usable (48 tokens).
    runtime = make_runtime(model, budget=4 * 4096, shuffle=None)
    assert runtime.num_blocks == 4
    run_steps(model, runtime, [[("a", list(range(20)))]])
    free_before = runtime.manager.pool.num_free_blocks
    with pytest.raises(OutOfBlocksError, match=r"nothing was allocated"):
        runtime.begin_step([ScheduledRequest("a", 1), ScheduledRequest("b", 40)])
    assert runtime.manager.pool.num_free_blocks == free_before
    assert runtime.manager.num_tokens("a") == 20
    out = run_steps(model, runtime, [[("a", [3])]])
    dense = model.forward_dense(torch.tensor([*range(20), 3]))[-1:]
    torch.testing.assert_close(out["a"], dense, atol=2e-5, rtol=2e-5)
    runtime.begin_step([], finished=["a"])
    assert runtime.manager.pool.num_free_blocks == 3


def test_a_rejected_step_keeps_its_finished_requests() -> None:
    model = DemoModel(layout=("full",), block_size=16)
    runtime = make_runtime(model, budget=4 * 4096, shuffle=None)  # 3 usable blocks
    run_steps(model, runtime, [[("a", list(range(20))), ("c", list(range(5)))]])
    table_a = runtime.block_table("layers.0", "a")
    free_before = runtime.manager.pool.num_free_blocks
    # Even with a's two blocks back, b needs 4 blocks: rejected, and a stays.
    with pytest.raises(OutOfBlocksError, match=r"\+2 held by finished requests"):
        runtime.begin_step([ScheduledRequest("b", 60)], finished=["a"])
    # A request scheduled twice is rejected before anything changes, however often.
    for _ in range(2):
        with pytest.raises(ValueError, match=r"request 'x' is scheduled twice"):
            runtime.begin_step([ScheduledRequest("x", 1), ScheduledRequest("x", 1)], finished=["a"])
    assert runtime.manager.pool.num_free_blocks == free_before
    assert runtime.block_table("layers.0", "a") == table_a
    assert runtime.manager.num_tokens("a") == 20
    # The same finish with a step that fits: a's blocks serve b at once.
    step = runtime.begin_step([ScheduledRequest("b", 30)], finished=["a"])
    assert step.order == ("b",)
    assert "a" not in runtime.manager
    assert sorted(runtime.block_table("layers.0", "b")) == sorted(table_a)
    # An id finished and scheduled in one step starts anew.
    runtime.begin_step([ScheduledRequest("c", 2)], finished=["c"])
    assert runtime.manager.num_tokens("c") == 2


def test_offsets_follow_every_change_of_batch_shape() -> None:
    """Decode steps reuse one ``0..B`` offsets tensor while ``B`` holds: steps of other
    sizes and chunked steps in between get their own, and each step's offsets are the
    running sum of its query lengths (in the step's order), counted here."""
    runtime = small_runtime()
    schedules = [
        {"a": 5, "b": 3},
        {"a": 1, "b": 1},
        {"a": 1, "b": 1},
        {"a": 1, "b": 1, "c": 4},
        {"a": 1, "b": 1, "c": 1},
        {"a": 1, "b": 1},
        {"a": 2, "b": 1},
        {"a": 1, "b": 1},
        {"a": 1},
        {"a": 1, "b": 1},
    ]
    seen: list[torch.Tensor] = []
    for sched in schedules:
        live = set(sched)
        gone = [r for r in ("a", "b", "c") if r in runtime.manager and r not in live]
        step = runtime.begin_step([ScheduledRequest(r, n) for r, n in sched.items()], finished=gone)
        qsl = runtime._groups[0].common.query_start_loc_cpu
        running = [0]
        for rid in step.order:
            running.append(running[-1] + sched[rid])
        assert qsl.tolist() == running
        assert list(step.query_lens) == [sched[r] for r in step.order]
        seen.append(qsl)
    # Every earlier step's offsets still read as they were made (none was overwritten).
    for tensor, sched in zip(seen, schedules, strict=True):
        assert int(tensor[-1]) == sum(sched.values())


def test_repeated_schedules_follow_frees_and_reuse_of_rows() -> None:
    """The same id list step after step (the steady state begin_step caches) stays
    right across frees, finishes, new requests taking freed rows, and manager calls
    made behind the runtime's back; counts kept here are the reference."""
    runtime = small_runtime()
    tokens: dict[str, int] = {}

    def step(ids: list[str], finished: tuple[str, ...] = ()) -> None:
        for rid in finished:
            tokens.pop(rid)
        runtime.begin_step([ScheduledRequest(r, 1) for r in ids], finished=finished)
        for rid in ids:
            tokens[rid] = tokens.get(rid, 0) + 1
        seq = runtime._groups[0].common.seq_lens_cpu.tolist()
        assert seq == [tokens[r] for r in ids]
        assert {r: runtime.manager.num_tokens(r) for r in tokens} == tokens

    for _ in range(3):
        step(["a", "b", "c"])
    runtime.free(["b"])
    tokens.pop("b")
    step(["a", "b", "c"])  # b starts anew
    step(["a", "b", "c"])
    step(["a", "b", "c"], finished=("a",))  # a starts anew in the same step
    step(["a", "b", "c"])
    runtime.manager.free_request("c")  # behind the runtime's back
    tokens.pop("c")
    step(["a", "b", "c"])
    runtime.free(["a", "b", "c"])
    tokens.clear()
    step(["c", "b", "a"])  # fresh rows, reverse order
    step(["c", "b", "a"])


@dataclasses.dataclass(frozen=True)
class TaggedRequest(ScheduledRequest):
    tag: str = ""


def small_runtime() -> AttentionRuntime:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32)
    return AttentionRuntime(
        {"l0": spec}, AttentionConfig(), device="cpu", memory_budget_bytes=64 * spec.page_size_bytes
    )


def test_begin_step_takes_a_scheduled_request_subclass() -> None:
    runtime = small_runtime()
    batch = runtime.begin_step([TaggedRequest("a", 3, tag="x"), ScheduledRequest("b", 2)])
    assert batch.order == ("a", "b")
    assert runtime.manager.num_tokens("a") == 3


def test_begin_step_rejects_other_objects_with_type_error_and_changes_nothing() -> None:
    runtime = small_runtime()
    free = runtime.manager.pool.num_free_blocks
    bad: list[object] = [ScheduledRequest("a", 1), ("b", 1)]
    with pytest.raises(
        TypeError, match=r"scheduled must hold ScheduledRequest objects, got \('b', 1\)"
    ):
        runtime.begin_step(bad)  # type: ignore[arg-type]  # the wrong type is the test
    assert runtime.manager.pool.num_free_blocks == free
    assert "a" not in runtime.manager


def test_begin_step_and_forward_errors() -> None:
    model = DemoModel(layout=("full",))
    runtime = make_runtime(model)
    with pytest.raises(RuntimeError, match=r"forward\(\) called before begin_step\(\)"):
        runtime.forward("layers.0", torch.zeros(1, 4, 16))
    with pytest.raises(ValueError, match=r"request 'x' is scheduled twice in one step"):
        runtime.begin_step([ScheduledRequest("x", 1), ScheduledRequest("x", 2)])
    with pytest.raises(ValueError, match=r"request 'x': num_new_tokens must be an int >= 1, got 0"):
        runtime.begin_step([ScheduledRequest("x", 0)])
    runtime.begin_step([ScheduledRequest("x", 3)])
    with pytest.raises(KeyError, match=r"unknown layer 'layers.9'; layers: layers.0"):
        runtime.forward("layers.9", torch.zeros(3, 4, 16))
    with pytest.raises(ValueError, match=r"layers.0: query has 2 rows but the step has 3 tokens"):
        runtime.forward("layers.0", torch.zeros(2, 4, 16))
    with pytest.raises(KeyError, match=r"unknown request 'nope'"):
        runtime.begin_step([], finished=["nope"])


def test_layer_params_are_checked_against_specs() -> None:
    reg = builtin_registry()
    config = AttentionConfig.model_validate({}, context={"registry": reg})
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32)
    with pytest.raises(
        ValueError,
        match=r"layer_params\['a'\].num_heads=3 is not a multiple of the spec's num_kv_heads=2",
    ):
        AttentionRuntime(
            {"a": spec},
            config,
            device="cpu",
            memory_budget_bytes=2**20,
            layer_params={"a": AttentionLayerParams(num_heads=3)},
            registry=reg,
        )
    with pytest.raises(
        ValueError, match=r"layer_params names layers that layer_specs lacks: \['b'\]"
    ):
        AttentionRuntime(
            {"a": spec},
            config,
            device="cpu",
            memory_budget_bytes=2**20,
            layer_params={"b": AttentionLayerParams(num_heads=2)},
            registry=reg,
        )
    model = DemoModel(layout=("mamba",))
    with pytest.raises(
        ValueError,
        match=r"layer_params\['layers.0'\] must be Mamba2LayerParams for a mamba2 layer, got NoneType",
    ):
        AttentionRuntime(model.specs, config, device="cpu", memory_budget_bytes=2**20, registry=reg)


def test_encoder_only_layers_see_the_whole_request_bidirectionally() -> None:
    reg = builtin_registry()
    config = AttentionConfig.model_validate({}, context={"registry": reg})
    spec = EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    runtime = AttentionRuntime(
        {"enc": spec},
        config,
        device="cpu",
        memory_budget_bytes=2**16,
        layer_params={"enc": AttentionLayerParams(num_heads=2)},
        registry=reg,
    )
    batch = runtime.begin_step([ScheduledRequest("a", 5), ScheduledRequest("b", 3)])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(8, 2, 8, generator=gen),
        torch.randn(8, 1, 8, generator=gen),
        torch.randn(8, 1, 8, generator=gen),
    )
    out = runtime.forward("enc", q, k, v)
    for rid, rows in batch.token_slices().items():
        expected = _naive(q[rows], k[rows], v[rows], causal=False)
        torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5, msg=rid)
    with pytest.raises(
        ValueError,
        match=r"request 'a' was already encoded: encoder-only layers take a request whole",
    ):
        runtime.begin_step([ScheduledRequest("a", 1)])


def test_cross_attention_writes_encoder_states_once_then_reads_them() -> None:
    reg = builtin_registry()
    config = AttentionConfig.model_validate({}, context={"registry": reg})
    spec = CrossAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)
    runtime = AttentionRuntime(
        {"x": spec},
        config,
        device="cpu",
        memory_budget_bytes=2**16,
        layer_params={"x": AttentionLayerParams(num_heads=2)},
        registry=reg,
        cache_fill=float("nan"),
    )
    gen = torch.Generator().manual_seed(1)
    enc = {
        "a": (torch.randn(6, 1, 8, generator=gen), torch.randn(6, 1, 8, generator=gen)),
        "b": (torch.randn(9, 1, 8, generator=gen), torch.randn(9, 1, 8, generator=gen)),
    }
    with pytest.raises(
        ValueError,
        match=r"request 'a' is new and the model has cross-attention layers: encoder_len must be >= 1",
    ):
        runtime.begin_step([ScheduledRequest("a", 2)])
    batch = runtime.begin_step(
        [ScheduledRequest("a", 2, encoder_len=6), ScheduledRequest("b", 1, encoder_len=9)]
    )
    assert batch.encoder_order == ("a", "b")
    k = torch.cat([enc[r][0] for r in batch.encoder_order])
    v = torch.cat([enc[r][1] for r in batch.encoder_order])
    q1 = torch.randn(3, 2, 8, generator=gen)
    out1 = runtime.forward("x", q1, k, v)
    batch2 = runtime.begin_step([ScheduledRequest("a", 1), ScheduledRequest("b", 1)])
    assert batch2.encoder_order == ()
    q2 = torch.randn(2, 2, 8, generator=gen)
    out2 = runtime.forward("x", q2, None, None)
    for batch_, q, out in ((batch, q1, out1), (batch2, q2, out2)):
        for rid, rows in batch_.token_slices().items():
            expected = _naive(q[rows], enc[rid][0], enc[rid][1], causal=False)
            torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """Attention of one request by the definition, in float64 (GQA by repeating heads)."""
    groups = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(groups, dim=1)
    vv = v.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * q.shape[-1] ** -0.5
    if causal:
        offset = k.shape[0] - q.shape[0]
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(offset)
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), vv)


def test_dense_helper_matches_the_definition() -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(3, 2, 8, generator=gen),
        torch.randn(5, 1, 8, generator=gen),
        torch.randn(5, 1, 8, generator=gen),
    )
    torch.testing.assert_close(
        dense_attention(q, k, v, scale=8**-0.5, causal=True).double(),
        _naive(q, k, v, causal=True),
        atol=1e-6,
        rtol=1e-6,
    )


@pytest.mark.parametrize(
    "per_kind",
    [
        pytest.param(None, id="default"),
        pytest.param(
            "full_attention=triton_attn,sliding_window=triton_attn", id="triton-for-attention"
        ),
    ],
)
def test_demo_passes(per_kind: str | None) -> None:
    out = io.StringIO()
    result = run_demo(
        backend_per_kind=per_kind, decode_steps=2, out=out, registry=builtin_registry()
    )
    text = out.getvalue()
    assert result.passed, text
    assert "FAIL" not in text
    expected_backend = "triton_attn" if per_kind else "cpu_attn"
    # The Mamba2 state fills two attention pages: a page holds two blocks of 16 tokens.
    assert f"full_attention    group 0 (block_size 16, 2 per page) -> {expected_backend}" in text
    assert "mamba(mamba2)     group 1 (block_size 16) -> reference" in text
    assert result.max_error < 2e-5


def test_slots_written_marks_the_kinds_whose_every_token_gets_a_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``CommonAttentionMetadata.slots_written`` is set for the kinds whose slots are the
    default ones (full attention, a window) and not for cross attention (its slots hold
    -1 past the encoder tokens); where it is set, every token's slot is its block's."""
    from attnkit.backend_api import CommonAttentionMetadata
    from attnkit.backends.reference.attention import ReferenceAttentionBuilder

    seen: dict[str, list[CommonAttentionMetadata]] = {}
    checked: list[CommonAttentionMetadata] = []
    build = ReferenceAttentionBuilder.build

    def spy(
        self: ReferenceAttentionBuilder,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> object:
        cm = common_attn_metadata
        seen.setdefault(self.kind.value, []).append(cm)
        if cm.slots_written:  # (the table is a view valid until the next step: read now)
            # Each token's slot, from its request's table and its position (the
            # definition).
            qsl, seq = cm.query_start_loc_cpu.tolist(), cm.seq_lens_cpu.tolist()
            want = [
                int(cm.block_table_tensor[b, p // 4]) * 4 + p % 4
                for b in range(cm.num_reqs)
                for p in range(seq[b] - (qsl[b + 1] - qsl[b]), seq[b])
            ]
            assert cm.slot_mapping[: cm.num_actual_tokens].tolist() == want
            assert min(want) >= 4  # block 0 is the null block
            checked.append(cm)
        return build(self, common_prefix_len, cm, fast_build)

    monkeypatch.setattr(ReferenceAttentionBuilder, "build", spy)
    kw: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float32}
    specs: dict[str, KVCacheSpec] = {
        "full": FullAttentionSpec(block_size=4, **kw),
        "window": SlidingWindowSpec(block_size=4, sliding_window=6, **kw),
        "cross": CrossAttentionSpec(block_size=4, **kw),
    }
    runtime = AttentionRuntime(
        specs,
        AttentionConfig(backend="reference"),
        device="cpu",
        memory_budget_bytes=2**18,
        layer_params={name: AttentionLayerParams(num_heads=2) for name in specs},
    )
    runtime.begin_step(
        [ScheduledRequest("a", 5, encoder_len=3), ScheduledRequest("b", 2, encoder_len=4)]
    )
    for _ in range(5):  # decodes (the steady path's slots included)
        runtime.begin_step([ScheduledRequest("a", 1), ScheduledRequest("b", 1)])
    assert {kind: {cm.slots_written for cm in cms} for kind, cms in seen.items()} == {
        "full_attention": {True},
        "sliding_window": {True},
        "cross_attention": {False},
    }
    assert len(checked) == 12  # 6 steps x 2 groups
