"""The ``cpu_attn`` backend (attnkit's CPU engines: the native paged-decode kernel and
blocked prefill products) against the reference backend, its step split, its
selection as the CPU default, and its reasons.

The schedules and the comparison are ``planes_schedules``'s: NaN-filled caches,
shuffled pools, identical inputs on both sides.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from planes_schedules import (
    CROSS,
    DECODES,
    ENCODER,
    HKV,
    RAGGED,
    D,
    Step,
    compare_with_reference,
    make_runtime,
    params_of,
    spec_of,
)

from attnkit import (
    AttentionConfig,
    AttentionFeature,
    AttentionLayerParams,
    AttentionRuntime,
    BackendNotSupportedError,
    FullAttentionSpec,
    MLAAttentionSpec,
    ScheduledRequest,
    select_backend,
)
from attnkit.backends._planes import PlanesWrites
from attnkit.backends.cpu_attn import (
    NATIVE_MAX_QUERY,
    CpuAttentionBackend,
    CpuAttentionImpl,
    CpuAttentionMetadata,
    CpuAttentionMetadataBuilder,
)

NAME = "cpu_attn"

# ------------------------------------------------------------------ against reference


@pytest.mark.parametrize("kind", ["full", "window", "chunked", "sink"])
def test_paged_kinds_match_reference(kind: str) -> None:
    spec = spec_of(kind)
    compare_with_reference(NAME, spec, params_of(spec), RAGGED)


def test_cross_attention_matches_reference() -> None:
    spec = spec_of("cross")
    compare_with_reference(NAME, spec, params_of(spec), CROSS)


def test_encoder_only_matches_reference() -> None:
    spec = spec_of("encoder")
    compare_with_reference(NAME, spec, params_of(spec), ENCODER)


def test_soft_cap_and_alibi_match_reference() -> None:
    spec = spec_of("window")
    slopes = tuple(2.0 ** (-(i + 1) / 2) for i in range(4))
    params = params_of(spec, logits_soft_cap=1.5, alibi_slopes=slopes)
    compare_with_reference(NAME, spec, params, RAGGED)


@pytest.mark.parametrize("kind", ["full", "window", "cross", "encoder"])
def test_per_head_sinks_match_reference(kind: str) -> None:
    """gpt-oss's sink logits, on both engines (RAGGED has decodes and long runs)."""
    spec = spec_of(kind)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(2)) * 2
    steps = {"cross": CROSS, "encoder": ENCODER}.get(kind, RAGGED)
    compare_with_reference(NAME, spec, params_of(spec, sinks=sinks), steps)


@pytest.mark.parametrize("head_size", [32, 80, 96, 112, 160, 192, 256, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_sizes_match_reference(head_size: int, dtype: torch.dtype) -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=HKV, head_size=head_size, dtype=dtype)
    assert select_backend(spec, AttentionConfig(), device="cpu").backend_name == NAME
    compare_with_reference(NAME, spec, params_of(spec), RAGGED[:1] + RAGGED[3:4])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_match_reference(dtype: torch.dtype) -> None:
    spec = spec_of("full", dtype)
    compare_with_reference(NAME, spec, params_of(spec), RAGGED[:1] + RAGGED[3:4])


def test_one_query_head_per_kv_head_decodes() -> None:
    spec = spec_of("chunked")
    compare_with_reference(NAME, spec, params_of(spec, num_heads=HKV), DECODES)


def test_short_and_long_runs_split_between_the_engines() -> None:
    """Query runs of up to NATIVE_MAX_QUERY tokens (speculative decoding) take the native
    kernel, one work item per token with its own key range; longer ones the blocked
    products: both within one step, against the reference."""
    spec = spec_of("window")
    steps: tuple[Step, ...] = (
        (("a", 40, 0), ("b", 2, 0)),
        (("a", NATIVE_MAX_QUERY, 0), ("b", NATIVE_MAX_QUERY + 1, 0), ("c", 3, 0)),
        (("a", 1, 0), ("b", NATIVE_MAX_QUERY, 0), ("c", 33, 0)),
    )
    compare_with_reference(NAME, spec, params_of(spec), steps)
    rt = make_runtime(NAME, spec, params_of(spec))
    rt.begin_step([ScheduledRequest("a", 3), ScheduledRequest("b", 9)])
    md = rt.metadata_for("layer")
    assert isinstance(md, CpuAttentionMetadata)
    assert md.native
    assert md.native_requests is not None
    assert md.native_requests.tolist() == [0]  # a's three tokens
    assert md.prefill_requests.tolist() == [1]
    assert md.prefill_lens.tolist() == [9]
    # A decode step: the native kernel takes the whole step, nothing planned.
    rt.begin_step([ScheduledRequest("a", 1), ScheduledRequest("b", 1)])
    md = rt.metadata_for("layer")
    assert isinstance(md, CpuAttentionMetadata)
    assert md.native
    assert md.native_requests is None
    assert len(md.prefill_requests) == 0


def _fields(md: CpuAttentionMetadata) -> dict[str, object]:
    """Every field, tensors and arrays as lists (``None`` kept), for comparing."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(md):
        value = getattr(md, f.name)
        if f.name == "writes":
            value = _fields_of_writes(value)
        elif isinstance(value, torch.Tensor | np.ndarray):
            value = (str(value.dtype), value.tolist())
        out[f.name] = value
    return out


def _fields_of_writes(writes: PlanesWrites) -> dict[str, object]:
    return {
        f.name: None if getattr(writes, f.name) is None else getattr(writes, f.name).tolist()
        for f in dataclasses.fields(writes)
    }


@pytest.mark.parametrize("kind", ["full", "window", "chunked", "sink", "cross"])
def test_build_makes_what_the_planned_path_makes(kind: str) -> None:
    """``build`` (what the runtime calls) gives, field by field, the metadata of the
    planned path (``_build``) on decode and short multi-token steps; a step with an
    unwritten token (-1 slot) keeps its write rows."""
    spec = spec_of(kind)
    rt = make_runtime(NAME, spec, params_of(spec))
    enc = 5 if kind == "cross" else 0
    schedules = [
        [ScheduledRequest("a", 7, encoder_len=enc), ScheduledRequest("b", 30, encoder_len=enc)],
        *([[ScheduledRequest("a", 1), ScheduledRequest("b", 1)]] * 20),
        [ScheduledRequest("a", NATIVE_MAX_QUERY), ScheduledRequest("b", 2)],
        [ScheduledRequest("b", 1)],
    ]
    for scheduled in schedules:
        rt.begin_step(scheduled)
        entry = rt._groups[0]
        builder, common = entry.builder, entry.common
        assert isinstance(builder, CpuAttentionMetadataBuilder)
        assert _fields(builder.build(0, common)) == _fields(builder._build(common))
    # The runtime's default slots write every token (cross attention's: not known).
    assert common.slots_written is (kind != "cross")
    slots = common.slot_mapping.clone()
    slots[0] = -1
    if common.slots_written:  # a hole under the runtime's promise is refused
        with pytest.raises(ValueError, match=r"slots_written=True, but slot_mapping\[0\] is -1"):
            dataclasses.replace(common, slot_mapping=slots)
    holed = dataclasses.replace(common, slot_mapping=slots, slots_written=False, validate=False)
    md = builder.build(0, holed)
    assert _fields(md) == _fields(builder._build(holed))
    if kind != "cross":  # (cross attention writes encoder tokens only: nothing here)
        assert md.writes.rows is not None
        assert md.writes.rows.tolist() == list(range(1, common.num_actual_tokens))


def _two_group_runtime() -> AttentionRuntime:
    specs = {"full": spec_of("full"), "win": spec_of("window")}
    return AttentionRuntime(
        specs,
        AttentionConfig(backend=NAME),
        device="cpu",
        memory_budget_bytes=spec_of("full").page_size_bytes * 256,
        layer_params={name: params_of(spec) for name, spec in specs.items()},
    )


def test_a_step_is_split_once_for_all_its_groups() -> None:
    """On a mixed step the second group's builder takes the first one's split (the
    same arrays), which is what it would plan itself."""
    rt = _two_group_runtime()
    rt.begin_step([ScheduledRequest("a", 9), ScheduledRequest("b", 3)])
    rt.begin_step([ScheduledRequest("a", 1), ScheduledRequest("b", 20)])
    (first, second) = (rt._groups[0], rt._groups[1])
    one, two = first.metadata, second.metadata
    assert isinstance(one, CpuAttentionMetadata)
    assert isinstance(two, CpuAttentionMetadata)
    assert two.prefill_requests is one.prefill_requests
    assert two.native_requests is one.native_requests
    assert one.prefill_requests.tolist() == [1]
    assert one.prefill_lens.tolist() == [20]
    alone = dataclasses.replace(second.common, step_id=None, validate=False)
    assert _fields(second.builder.build(0, alone)) == _fields(two)


def test_a_step_with_the_last_offsets_takes_the_last_split_with_its_own_lengths() -> None:
    """The steps of a run (the same new tokens, further on each step) have the same
    offsets: the builder takes the last step's shares between the engines and this
    step's lengths, which is what it plans with no split made before."""
    from attnkit.backends.cpu_attn import backend as cpu_backend

    rt = _two_group_runtime()
    rt.begin_step([ScheduledRequest("a", 9), ScheduledRequest("b", 3)])
    seen: list[dict[str, object]] = []
    for _ in range(4):  # the same mixed step: request b's prompt in chunks of 20
        rt.begin_step([ScheduledRequest("a", 1), ScheduledRequest("b", 20)])
        entry = rt._groups[0]
        md = entry.metadata
        assert isinstance(md, CpuAttentionMetadata)
        cpu_backend._SPLIT[0] = None  # nothing to take: planned from the step alone
        alone = entry.builder.build(0, dataclasses.replace(entry.common, validate=False))
        assert _fields(md) == _fields(alone)
        seen.append(_fields(md))
    assert [f["prefill_seq"] for f in seen] == [
        ("int64", [23 + 20 * i]) for i in range(4)
    ]  # b's context after each chunk: its own lengths, not the first split's


def test_a_split_taken_with_its_old_lengths_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken variant: a step with the last offsets takes the last split whole (its
    lengths too), so the blocked prefill reads the context as it was a step ago."""
    from attnkit.backends.cpu_attn import backend as cpu_backend

    def stale(self: Any, cm: Any, seq: Any) -> Any:  # the last split, its lengths kept
        return dataclasses.replace(
            self, step_id=cm.step_id, qsl_cpu=cm.query_start_loc_cpu, seq_cpu=cm.seq_lens_cpu
        )

    monkeypatch.setattr(cpu_backend._Split, "for_step", stale)
    with pytest.raises(AssertionError):
        test_a_step_with_the_last_offsets_takes_the_last_split_with_its_own_lengths()


def test_a_refilled_step_is_planned_again() -> None:
    """An engine that refills its offsets and lengths in place and gives the step a
    new id (or none) gets the new step's split, not the one planned before."""
    rt = _two_group_runtime()
    rt.begin_step([ScheduledRequest("a", 9), ScheduledRequest("b", 3)])
    rt.begin_step([ScheduledRequest("a", 1), ScheduledRequest("b", 20)])
    entry = rt._groups[0]
    common, builder = entry.common, entry.builder
    assert common.step_id is not None
    before = builder.build(0, common)
    assert isinstance(before, CpuAttentionMetadata)
    assert before.prefill_lens.tolist() == [20]
    # The same tensors refilled: both runs longer than the native kernel takes.
    b = NATIVE_MAX_QUERY + 1
    assert 21 - b > NATIVE_MAX_QUERY
    common.query_start_loc_cpu.copy_(torch.tensor([0, 21 - b, 21], dtype=torch.int32))
    for step_id in (common.step_id + 1, None):
        again = dataclasses.replace(common, step_id=step_id, validate=False)
        md = builder.build(0, again)
        assert isinstance(md, CpuAttentionMetadata)
        assert md.prefill_requests.tolist() == [0, 1]
        assert md.prefill_lens.tolist() == [21 - b, b]


# ------------------------------------------------------------------ selection and reasons


def test_the_cpu_default_for_the_kinds_it_serves_and_the_others_for_the_rest() -> None:
    config = AttentionConfig()
    chosen = select_backend(spec_of("window"), config, device="cpu")
    assert chosen.backend_name == NAME
    assert chosen.source == "priority"
    assert chosen.rejected == ()
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    chosen = select_backend(mla, config, device="cpu")
    assert chosen.backend_name == "cpu_mla"  # the same engines, for MLA latents
    (skipped,) = [r for r in chosen.rejected if r.backend == NAME]
    assert any("kind=mla_attention not supported" in r for r in skipped.reasons)
    odd = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    chosen = select_backend(odd, config, device="cpu")
    assert chosen.backend_name == "reference"
    assert any("head_size=8 not supported" in r for x in chosen.rejected for r in x.reasons)
    # flex_attention is not in the CPU order: neither chosen nor asked by default.
    assert all(r.backend != "flex_attention" for r in chosen.rejected)


def test_no_c_compiler_for_the_native_kernel_falls_through_with_a_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from attnkit.kernels.attention import cpu_native as _native

    # A fresh process's view of a source install: nothing built yet, no prebuilt
    # library, an empty cache, no usable compiler.
    monkeypatch.setattr(_native, "_STATE", [])
    monkeypatch.setattr(_native, "_PREBUILT_DIR", tmp_path)
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "attnkit-no-such-compiler")
    reasons = CpuAttentionBackend.environment_reasons(torch.device("cpu"))
    assert any("native kernel is unavailable" in r and "CC=" in r for r in reasons), reasons
    chosen = select_backend(spec_of("full"), AttentionConfig(), device="cpu")
    assert chosen.backend_name == "reference"
    (engines,) = [r for r in chosen.rejected if r.backend == NAME]
    assert any("attnkit-no-such-compiler" in r for r in engines.reasons)
    assert any("no prebuilt library is packaged" in r for r in engines.reasons)


def test_on_cuda_its_reasons_say_it_is_cpu_only() -> None:
    reasons = CpuAttentionBackend.environment_reasons(torch.device("cuda"))
    assert reasons == [
        "device=cuda not supported (supported: cpu)",
        "cpu_attn is CPU-only: its engines are a native C kernel and CPU matrix products",
    ]
    config = AttentionConfig(backend_per_kind={"full_attention": NAME})
    with pytest.raises(BackendNotSupportedError, match="cpu_attn is CPU-only"):
        select_backend(
            spec_of("full"), config, device="cuda", capability=(9, 0), hypothetical_device=True
        )


# ------------------------------------------------------------------ construction and calls


def test_undeclared_features_are_refused_at_construction() -> None:
    spec = spec_of("full")
    CpuAttentionImpl(spec, AttentionLayerParams(num_heads=4, sinks=torch.zeros(4)))  # declared
    with pytest.raises(ValueError, match="sparse_attention"):
        CpuAttentionImpl(spec, AttentionLayerParams(num_heads=4, index_topk=8))
    sink = spec_of("sink")
    with pytest.raises(ValueError, match="sink_key"):
        CpuAttentionImpl(sink, AttentionLayerParams(num_heads=4))


def test_planes_layout_and_bad_cache_argument() -> None:
    spec = spec_of("full")
    assert CpuAttentionBackend.get_kv_cache_shapes(4, spec) == ((64, HKV, D), (64, HKV, D))
    rt = make_runtime(NAME, spec, params_of(spec))
    rt.begin_step([ScheduledRequest("a", 3)])
    impl = CpuAttentionImpl(spec, params_of(spec))
    md = rt.metadata_for("layer")
    q, kv = torch.randn(3, 4, D), torch.randn(3, HKV, D)
    with pytest.raises(ValueError, match="kv_cache must hold 2 tensors"):
        impl.forward(q, kv, kv, [torch.zeros(4, 2, 16, HKV, D)], md, torch.empty_like(q))
    with pytest.raises(TypeError, match="attn_metadata must be CpuAttentionMetadata"):
        impl.forward(q, kv, kv, [], object(), torch.empty_like(q))  # type: ignore[arg-type]  # the wrong metadata on purpose


def test_context_parallel_calls_are_checked() -> None:
    """A sharded step must go through forward_partial, a plain one through forward, and
    forward_partial's lse must be [T, Hq] float32 (tests/test_context_parallel.py runs
    the ranks against one device)."""
    import dataclasses

    spec = spec_of("full")
    rt = make_runtime(NAME, spec, params_of(spec))
    rt.begin_step([ScheduledRequest("a", 3)])
    impl = CpuAttentionImpl(spec, params_of(spec))
    md = rt.metadata_for("layer")
    assert isinstance(md, CpuAttentionMetadata)
    assert md.shard is None
    q, kv = torch.randn(3, 4, D), torch.randn(3, HKV, D)
    cache = [torch.zeros(64, HKV, D), torch.zeros(64, HKV, D)]
    lse = torch.empty(3, 4)
    with pytest.raises(ValueError, match=r"no context_shard .* call forward$"):
        impl.forward_partial(q, kv, kv, cache, md, torch.empty_like(q), lse)
    items = tuple(torch.zeros(3, dtype=torch.int64 if i == 0 else torch.int32) for i in range(5))
    sharded = dataclasses.replace(md, shard=(0, 2), shard_items=items)
    with pytest.raises(ValueError, match=r"sharded by context \(context_shard=\(0, 2\)\)"):
        impl.forward(q, kv, kv, cache, sharded, torch.empty_like(q))
    with pytest.raises(ValueError, match=r"lse must be a float32 cpu tensor \[3, 4\]"):
        impl.forward_partial(q, kv, kv, cache, sharded, torch.empty_like(q), torch.empty(3, 2))
    assert AttentionFeature.CONTEXT_PARALLEL in CpuAttentionBackend.supported_features


# ------------------------------------------------------------------ prepared planes


def _planes_swap_scenario() -> None:
    """One impl, one step's metadata, two sets of planes: the decode kernel's checked
    layer constants (``PreparedPlanes``) are prepared again for the second set, whose
    scaled keys and values it must read (each output against a float64 oracle)."""
    from planes_schedules import BS, NUM_PAGES

    spec = spec_of("full")
    params = params_of(spec)
    rt = make_runtime(NAME, spec, params)
    rt.begin_step([ScheduledRequest("a", 5)])  # a short run: the native kernel's
    md = rt.metadata_for("layer")
    assert isinstance(md, CpuAttentionMetadata)
    assert md.native
    impl = CpuAttentionImpl(spec, params)
    torch.manual_seed(3)
    q, k, v = torch.randn(5, 4, D), torch.randn(5, HKV, D), torch.randn(5, HKV, D)
    for factor in (1.0, 3.0):
        planes = [torch.zeros(NUM_PAGES * BS, HKV, D), torch.zeros(NUM_PAGES * BS, HKV, D)]
        out = impl.forward(q, k * factor, v * factor, planes, md, torch.empty_like(q))
        qd, kd, vd = q.double(), (k * factor).double(), (v * factor).double()
        kd, vd = kd.repeat_interleave(2, dim=1), vd.repeat_interleave(2, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qd, kd) * impl.scale
        scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
        want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vd)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_the_decode_kernel_prepares_again_for_other_planes() -> None:
    _planes_swap_scenario()


def test_prepared_planes_kept_for_other_planes_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: the preparation is never renewed, so the second forward
    reads the first planes."""
    from attnkit.kernels.attention.cpu_decode import PreparedPlanes

    monkeypatch.setattr(PreparedPlanes, "serves", lambda self, *args: True)
    with pytest.raises(AssertionError):
        _planes_swap_scenario()


def test_the_prepared_decode_checks_the_query_and_output() -> None:
    from planes_schedules import BS, NUM_PAGES

    spec = spec_of("full")
    rt = make_runtime(NAME, spec, params_of(spec))
    rt.begin_step([ScheduledRequest("a", 2)])
    md = rt.metadata_for("layer")
    impl = CpuAttentionImpl(spec, params_of(spec))
    planes = [torch.zeros(NUM_PAGES * BS, HKV, D), torch.zeros(NUM_PAGES * BS, HKV, D)]
    q, kv = torch.randn(2, 4, D), torch.randn(2, HKV, D)
    impl.forward(q, kv, kv, planes, md, torch.empty_like(q))  # prepared for float32 [*, 4, D]
    with pytest.raises(ValueError, match=r"output: expected a torch.float32 tensor \[2, 4, 16\]"):
        impl.forward(q, kv, kv, planes, md, torch.empty(4, 2, D).transpose(0, 1)[:, :, :8])
    with pytest.raises(
        ValueError, match=r"output: expected a tensor that does not overlap k_plane"
    ):
        impl.forward(q, kv, kv, planes, md, planes[0].view(-1)[: 2 * 4 * D].view(2, 4, D))
