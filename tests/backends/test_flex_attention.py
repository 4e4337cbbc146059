"""The ``flex_attention`` backend (compiled FlexAttention, here on CPU, where it runs
when named) against the reference backend, and its planning and compile-failure paths.

The schedules and the comparison are ``planes_schedules``'s: NaN-filled caches,
shuffled pools, identical inputs on both sides.

Compiling a FlexAttention shape costs ~10 s on a 2-core CPU, so every runtime here shares
one spec geometry (Hkv 2, D 16, block 16, one memory budget) and pins the buckets
(``batch_buckets=(8,)``, ``query_buckets=(64,)``): every kind reuses the same two compiled
kernels (decode, prefill), which dynamo keeps across tests in the process.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch
from planes_schedules import (
    BS,
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
    run_steps,
    spec_of,
)

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    AttentionSpec,
    BackendNotSupportedError,
    FullAttentionSpec,
    ScheduledRequest,
    select_backend,
)
from attnkit.backends.flex_attention import (
    FlexAttentionBackend,
    FlexAttentionImpl,
    FlexAttentionOptions,
    FlexCompileError,
    _compile,
    compile_records,
)
from attnkit.backends.flex_attention._plan import bucket_for, plan_call

NAME = "flex_attention"
OPTIONS = {NAME: {"batch_buckets": (8,), "query_buckets": (64,)}}


def _compare(spec: AttentionSpec, params: AttentionLayerParams, steps: Sequence[Step]) -> None:
    compare_with_reference(NAME, spec, params, steps, OPTIONS)


@pytest.fixture(autouse=True)
def _no_recorded_failure() -> Iterator[None]:
    _compile.forget_failures()
    yield
    _compile.forget_failures()


# ------------------------------------------------------------------ against reference


@pytest.mark.parametrize("kind", ["full", "window", "chunked", "sink"])
def test_paged_kinds_match_reference(kind: str) -> None:
    spec = spec_of(kind)
    _compare(spec, params_of(spec), RAGGED)


def test_cross_attention_matches_reference() -> None:
    spec = spec_of("cross")
    _compare(spec, params_of(spec), CROSS)


def test_encoder_only_matches_reference() -> None:
    spec = spec_of("encoder")
    _compare(spec, params_of(spec), ENCODER)


def test_soft_cap_and_alibi_match_reference() -> None:
    spec = spec_of("window")
    slopes = tuple(2.0 ** (-(i + 1) / 2) for i in range(4))
    _compare(spec, params_of(spec, logits_soft_cap=1.5, alibi_slopes=slopes), RAGGED)


def test_bfloat16_matches_reference() -> None:
    # One half dtype: each dtype is one more compile (~10 s).
    spec = spec_of("full", torch.bfloat16)
    _compare(spec, params_of(spec), RAGGED[:1] + RAGGED[3:4])


def test_one_query_head_per_kv_head_decodes() -> None:
    # G = 1: one query row per K/V head, which the call pads to two rows (see _mods.query_rows).
    spec = spec_of("chunked")
    _compare(spec, params_of(spec, num_heads=HKV), DECODES)


def test_steps_reuse_compiled_kernels() -> None:
    spec = spec_of("full")
    params = params_of(spec)
    steps = list(RAGGED)
    run = run_steps(NAME, spec, params, steps + steps[1:2], OPTIONS)
    for _ in steps:
        next(run)
    # Same buckets as an earlier step: dynamo must not compile again.
    with torch._dynamo.config.patch(error_on_recompile=True):
        next(run)
    assert any("q=[8,2,128,16]" in r.key for r in compile_records())


# ------------------------------------------------------------------ planning


def _brute_force_blocks(
    qpos0: int,
    qlen: int,
    seq: int,
    rows: range,
    causal: bool,
    window: int | None,
    chunk: int | None,
) -> tuple[set[int], set[int]]:
    """(blocks some query of ``rows`` sees, blocks every query of ``rows`` sees whole)."""
    keys = np.arange(seq)
    seen = []
    for t in rows:
        if t >= qlen:
            continue
        qp = qpos0 + t
        ok = np.ones(seq, dtype=bool)
        if causal:
            ok &= keys <= qp
            if window is not None:
                ok &= qp - keys < window
            if chunk is not None:
                ok &= keys // chunk == qp // chunk
        seen.append(ok)
    if not seen:
        return set(), set()
    nblocks = -(-seq // BS)
    padded = np.zeros((len(seen), nblocks * BS), dtype=bool)
    padded[:, :seq] = np.array(seen)
    per_block = padded.reshape(len(seen), nblocks, BS)
    some = {int(b) for b in np.nonzero(per_block.any(axis=(0, 2)))[0]}
    whole = {int(b) for b in np.nonzero(per_block.all(axis=(0, 2)))[0]}
    return some, whole


@pytest.mark.parametrize(
    ("causal", "window", "chunk"),
    [(True, None, None), (True, 21, None), (True, None, 24), (True, None, 16), (False, None, None)],
    ids=["causal", "window", "chunk", "chunk-at-block", "bidirectional"],
)
def test_plan_lists_exactly_the_visible_blocks(
    causal: bool, window: int | None, chunk: int | None
) -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        b = int(rng.integers(1, 5))
        qlens = rng.integers(1, 80, size=b)
        extra = rng.integers(0, 90, size=b)
        seq = qlens + extra if causal else rng.integers(0, 70, size=b)
        starts = np.concatenate([[0], np.cumsum(qlens)[:-1]])
        reqs = np.arange(b, dtype=np.int64)
        plan = plan_call(
            reqs, query_start=starts, query_lens=qlens, seq_lens=seq, batch=8, query_len=128,
            group=1, q_block=32, block_size=BS, causal=causal, window=window, chunk=chunk,
        )  # fmt: skip
        for r, j in itertools.product(range(b), range(plan.kv_num.shape[1])):
            some, whole = _brute_force_blocks(
                int(seq[r] - qlens[r]), int(qlens[r]), int(seq[r]),
                range(32 * j, 32 * (j + 1)), causal, window, chunk,
            )  # fmt: skip
            partial = set(plan.kv_logical[r, j, : plan.kv_num[r, j]].tolist())
            full = set(plan.full_logical[r, j, : plan.full_num[r, j]].tolist())
            assert not partial & full
            assert partial | full == some, (r, j)
            assert full <= whole, (r, j)
        assert (plan.kv_num[b:] == 0).all()
        assert (plan.full_num[b:] == 0).all()
        # Every real query token is written back once, to its own row.
        assert sorted(plan.out_dest.tolist()) == list(range(int(qlens.sum())))


def test_bucket_for() -> None:
    assert bucket_for(3, None) == 4
    assert bucket_for(3, None, 8) == 8
    assert bucket_for(9, None, 8) == 16
    assert bucket_for(5, (4, 6, 12)) == 6
    assert bucket_for(13, (4, 6, 12)) == 16  # past the largest: the next power of two
    assert bucket_for(2, (4, 6, 12), 5) == 6


def test_options_reject_unordered_buckets() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        FlexAttentionOptions(batch_buckets=(8, 4))
    with pytest.raises(ValueError, match="strictly increasing"):
        FlexAttentionOptions(query_buckets=(0, 16))


def test_cpu_path_is_refused_naming_the_backend_that_took_it_over() -> None:
    config = AttentionConfig(backend_options={NAME: {"cpu_path": "engines"}})
    with pytest.raises(
        ValueError, match=r"cpu_path is no longer a flex_attention option: .* the cpu_attn backend"
    ):
        config.options_for(NAME, FlexAttentionOptions)
    # Any other unknown field keeps pydantic's own message.
    config = AttentionConfig(backend_options={NAME: {"cpu_paths": "engines"}})
    with pytest.raises(ValueError, match="cpu_paths: Extra inputs are not permitted"):
        config.options_for(NAME, FlexAttentionOptions)


# ------------------------------------------------------------------ selection and failures


def test_on_cpu_it_runs_when_named_and_is_not_in_the_default_order() -> None:
    spec = spec_of("window")
    chosen = select_backend(spec, AttentionConfig(), device="cpu")
    assert chosen.backend_name == "cpu_attn"
    assert all(r.backend != NAME for r in chosen.rejected)
    chosen = select_backend(spec, AttentionConfig(backend=NAME), device="cpu")
    assert (chosen.backend_name, chosen.source) == (NAME, "backend")
    per_kind = AttentionConfig(backend_per_kind={spec.kind: NAME})
    chosen = select_backend(spec, per_kind, device="cpu")
    assert (chosen.backend_name, chosen.source) == (NAME, "backend_per_kind")
    # Named on CPU, it compiles FlexAttention: the step plans FlexAttention calls.
    rt = make_runtime(NAME, spec, params_of(spec), OPTIONS)
    rt.begin_step([ScheduledRequest("a", 3), ScheduledRequest("b", 1)])
    md = rt.metadata_for("layer")
    assert [(c.batch, c.query_len) for c in md.calls] == [(8, 1), (8, 64)]


def test_missing_cpp_compiler_is_a_reason_for_compiled_flex() -> None:
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.cxx": ("attnkit-no-such-compiler",)}):
        reasons = FlexAttentionBackend.environment_reasons(torch.device("cpu"))
        assert any("needs a C++ compiler" in r for r in reasons), reasons
        # Named on CPU, it is refused with that reason.
        with pytest.raises(BackendNotSupportedError, match=r"needs a C\+\+ compiler"):
            select_backend(spec_of("full"), AttentionConfig(backend=NAME), device="cpu")
    assert FlexAttentionBackend.environment_reasons(torch.device("cpu")) == []


def test_compile_failure_raises_is_recorded_and_selection_falls_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(device_type: str) -> object:
        def fail(*args: object, **kwargs: object) -> torch.Tensor:
            raise RuntimeError("forced inductor failure")

        return fail

    monkeypatch.setattr(_compile, "_compile", broken)
    # Head size 32: a shape no other test compiled, so this call is its first.
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=32, dtype=torch.float32)
    named = AttentionConfig(backend_per_kind={spec.kind: NAME})
    rt = AttentionRuntime(
        {"layer": spec},
        named,
        device="cpu",
        memory_budget_bytes=spec.page_size_bytes * 16,
        layer_params={"layer": AttentionLayerParams(num_heads=4)},
    )
    assert rt.routing_table()[0].backend == NAME
    rt.begin_step([ScheduledRequest("a", 5)])
    q, kv = torch.randn(5, 4, 32), torch.randn(5, HKV, 32)
    with pytest.raises(FlexCompileError, match="forced inductor failure") as err:
        rt.forward("layer", q, kv, kv)
    assert "does not fall back to the uncompiled kernel" in str(err.value)
    # In an order that lists it (the demo's --prefer flex), selection moves on.
    order = {"cpu": (NAME, "reference")}
    chosen = select_backend(spec, AttentionConfig(), device="cpu", priority=order)
    assert chosen.backend_name == "reference"
    (flex,) = [r for r in chosen.rejected if r.backend == NAME]
    assert any("compiling FlexAttention failed earlier" in r for r in flex.reasons)
    # Named explicitly, it is an error with the same reason, never a silent fallback.
    with pytest.raises(Exception, match="failed earlier"):
        select_backend(spec, named, device="cpu")
    # The CPU default does not depend on it.
    assert select_backend(spec, AttentionConfig(), device="cpu").backend_name == "cpu_attn"


def test_undeclared_features_are_refused_at_construction() -> None:
    spec = spec_of("full")
    with pytest.raises(ValueError, match="attention_sinks"):
        FlexAttentionImpl(spec, AttentionLayerParams(num_heads=4, sinks=torch.zeros(4)))
    with pytest.raises(ValueError, match="return_lse"):
        FlexAttentionImpl(spec, AttentionLayerParams(num_heads=4, return_lse=True))
    sink = spec_of("sink")
    with pytest.raises(ValueError, match="sink_key"):
        FlexAttentionImpl(sink, AttentionLayerParams(num_heads=4))


def test_planes_layout_and_bad_cache_argument() -> None:
    spec = spec_of("full")
    assert FlexAttentionBackend.get_kv_cache_shapes(4, spec) == ((64, HKV, D), (64, HKV, D))
    rt = make_runtime(NAME, spec, params_of(spec), OPTIONS)
    rt.begin_step([ScheduledRequest("a", 3)])
    impl = FlexAttentionImpl(spec, params_of(spec))
    md = rt.metadata_for("layer")
    q, kv = torch.randn(3, 4, D), torch.randn(3, HKV, D)
    with pytest.raises(ValueError, match="kv_cache must hold 2 tensors"):
        impl.forward(q, kv, kv, [torch.zeros(4, 2, BS, HKV, D)], md, torch.empty_like(q))


def test_demo_with_flex_first_passes_its_dense_checks() -> None:
    """``attnkit demo --prefer flex``: full and window layers on compiled FlexAttention
    (three shapes compile on CPU), the state layers on the reference; every step within
    the demo's tolerance of its dense check."""
    import io

    from attnkit.demo import run_demo

    out = io.StringIO()
    result = run_demo(out=out, prefer="flex", decode_steps=2)
    text = out.getvalue()
    assert result.passed, text
    assert "full_attention    group 0 (block_size 16, 2 per page) -> flex_attention" in text
    assert "sliding_window" in text
    assert "-> reference" in text  # the Mamba2 layers
