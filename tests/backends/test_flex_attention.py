"""The ``flex_attention`` backend against the reference backend, and its planning and
compile-failure paths.

Every schedule runs through an ``AttentionRuntime`` with ``flex_attention`` (planes
layout) on both CPU paths (``cpu_path="engines"``: the native kernel and blocked
products; ``"flex"``: compiled FlexAttention) and one with ``reference`` (interleaved
layout, pure torch): caches start as NaN (block 0 zero), block pools are shuffled with
one seed, so tables are neither contiguous nor ordered, and every side gets identical
inputs.

Compiling a FlexAttention shape costs ~10 s on a 2-core CPU, so every runtime here shares
one spec geometry (Hkv 2, D 16, block 16, one memory budget) and pins the buckets
(``batch_buckets=(8,)``, ``query_buckets=(64,)``): every kind reuses the same two compiled
kernels (decode, prefill), which dynamo keeps across tests in the process.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    ScheduledRequest,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    select_backend,
)
from attnkit.backends.flex_attention import (
    NATIVE_MAX_QUERY,
    FlexAttentionBackend,
    FlexAttentionImpl,
    FlexAttentionMetadata,
    FlexAttentionOptions,
    FlexCompileError,
    _compile,
    compile_records,
)
from attnkit.backends.flex_attention._plan import bucket_for, plan_call

HKV, D, BS = 2, 16, 16
NUM_PAGES = 64
"""One memory budget for every runtime: the planes' length is part of the compiled shape."""
OPTIONS = {"flex_attention": {"batch_buckets": (8,), "query_buckets": (64,)}}
PATHS = ("engines", "flex")
# (atol, rtol): float32 differs by summation order only; bf16 outputs are rounded.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float16: (2e-3, 2e-3),
}

Step = Sequence[tuple[str, int, int]]
"""One step: ``(request id, new tokens, encoder tokens)`` per scheduled request."""

# Prompts that cross blocks and query blocks (32 tokens), chunked prefill, decodes,
# a finish, and a request that arrives late.
RAGGED: tuple[Step, ...] = (
    (("a", 37, 0), ("b", 5, 0)),
    (("a", 1, 0), ("b", 1, 0), ("c", 20, 0)),
    (("a", 1, 0), ("b", 1, 0), ("c", 30, 0)),
    (("a", 1, 0), ("c", 1, 0), ("d", 64, 0)),
    (("a", 1, 0), ("c", 1, 0), ("d", 1, 0)),
)
ENCODER: tuple[Step, ...] = ((("a", 37, 0), ("b", 5, 0), ("c", 20, 0)), (("d", 64, 0),))
CROSS: tuple[Step, ...] = (
    (("a", 3, 40), ("b", 1, 17), ("e", 19, 18)),  # e: more queries than encoder tokens
    (("a", 1, 0), ("b", 1, 0), ("c", 20, 33)),
    (("a", 1, 0), ("b", 1, 0), ("c", 1, 0)),
)


def _spec(kind: str, dtype: torch.dtype = torch.float32) -> AttentionSpec:
    if kind == "window":  # crosses block edges
        return SlidingWindowSpec(
            block_size=BS, num_kv_heads=HKV, head_size=D, dtype=dtype, sliding_window=21
        )
    if kind == "chunked":  # not a block multiple
        return ChunkedLocalAttentionSpec(
            block_size=BS, num_kv_heads=HKV, head_size=D, dtype=dtype, attention_chunk_size=24
        )
    if kind == "sink":
        return SinkFullAttentionSpec(
            block_size=BS, num_kv_heads=HKV, head_size=D, dtype=dtype, sink_len=3
        )
    classes: dict[str, type[AttentionSpec]] = {
        "full": FullAttentionSpec,
        "encoder": EncoderOnlyAttentionSpec,
        "cross": CrossAttentionSpec,
    }
    return classes[kind](block_size=BS, num_kv_heads=HKV, head_size=D, dtype=dtype)


def _params(
    spec: AttentionSpec,
    num_heads: int = 4,
    logits_soft_cap: float | None = None,
    alibi_slopes: tuple[float, ...] | None = None,
) -> AttentionLayerParams:
    sink_key = sink_value = None
    if isinstance(spec, SinkFullAttentionSpec):
        gen = torch.Generator().manual_seed(7)
        shape = (spec.sink_len, spec.num_kv_heads, spec.head_size)
        sink_key = torch.randn(*shape, generator=gen).to(spec.dtype)
        sink_value = torch.randn(*shape, generator=gen).to(spec.dtype)
    return AttentionLayerParams(
        num_heads=num_heads,
        logits_soft_cap=logits_soft_cap,
        alibi_slopes=alibi_slopes,
        sink_key=sink_key,
        sink_value=sink_value,
    )


def _runtime(
    backend: str, spec: AttentionSpec, params: AttentionLayerParams, cpu_path: str = "engines"
) -> AttentionRuntime:
    options = {"flex_attention": {**OPTIONS["flex_attention"], "cpu_path": cpu_path}}
    config = AttentionConfig(backend_per_kind={spec.kind: backend}, backend_options=options)
    rt = AttentionRuntime(
        {"layer": spec},
        config,
        device="cpu",
        memory_budget_bytes=spec.page_size_bytes * NUM_PAGES,
        layer_params={"layer": params},
        cache_fill=float("nan"),
    )
    random.Random(0).shuffle(rt.manager.pool._free)
    return rt


def _run(
    backend: str,
    spec: AttentionSpec,
    params: AttentionLayerParams,
    steps: Sequence[Step],
    cpu_path: str = "engines",
) -> Iterator[dict[str, torch.Tensor]]:
    """Each step's output per request."""
    rt = _runtime(backend, spec, params, cpu_path)
    gen = torch.Generator().manual_seed(0)
    live: set[str] = set()
    for step in steps:
        finished = sorted(live - {rid for rid, _, _ in step})
        live -= set(finished)
        live |= {rid for rid, _, _ in step}
        inputs = {
            rid: (
                torch.randn(n, params.num_heads, D, generator=gen).to(spec.dtype),
                torch.randn(max(n, enc), HKV, D, generator=gen).to(spec.dtype),
                torch.randn(max(n, enc), HKV, D, generator=gen).to(spec.dtype),
                enc,
            )
            for rid, n, enc in step
        }
        batch = rt.begin_step([ScheduledRequest(r, n, e) for r, n, e in step], finished=finished)
        q = torch.cat([inputs[r][0] for r in batch.order])
        if isinstance(spec, CrossAttentionSpec):
            enc_rows = [inputs[r] for r in batch.encoder_order]
            k = torch.cat([x[1][: x[3]] for x in enc_rows]) if enc_rows else None
            v = torch.cat([x[2][: x[3]] for x in enc_rows]) if enc_rows else None
        else:
            n_of = {r: n for r, n, _ in step}
            k = torch.cat([inputs[r][1][: n_of[r]] for r in batch.order])
            v = torch.cat([inputs[r][2][: n_of[r]] for r in batch.order])
        out = rt.forward("layer", q, k, v)
        yield {rid: out[rows].clone() for rid, rows in batch.token_slices().items()}


def _compare(
    spec: AttentionSpec, params: AttentionLayerParams, steps: Sequence[Step], cpu_path: str
) -> None:
    atol, rtol = TOLERANCES[spec.dtype]
    pairs = zip(
        _run("flex_attention", spec, params, steps, cpu_path),
        _run("reference", spec, params, steps),
        strict=True,
    )
    for i, (got, want) in enumerate(pairs):
        assert got.keys() == want.keys()
        for rid, expected in want.items():
            assert not expected.isnan().any()
            torch.testing.assert_close(
                got[rid], expected, atol=atol, rtol=rtol, msg=f"step {i} {rid}"
            )


@pytest.fixture(autouse=True)
def _no_recorded_failure() -> Iterator[None]:
    _compile.forget_failures()
    yield
    _compile.forget_failures()


# ------------------------------------------------------------------ against reference


@pytest.mark.parametrize("cpu_path", PATHS)
@pytest.mark.parametrize("kind", ["full", "window", "chunked", "sink"])
def test_paged_kinds_match_reference(kind: str, cpu_path: str) -> None:
    spec = _spec(kind)
    _compare(spec, _params(spec), RAGGED, cpu_path)


@pytest.mark.parametrize("cpu_path", PATHS)
def test_cross_attention_matches_reference(cpu_path: str) -> None:
    spec = _spec("cross")
    _compare(spec, _params(spec), CROSS, cpu_path)


@pytest.mark.parametrize("cpu_path", PATHS)
def test_encoder_only_matches_reference(cpu_path: str) -> None:
    spec = _spec("encoder")
    _compare(spec, _params(spec), ENCODER, cpu_path)


@pytest.mark.parametrize("cpu_path", PATHS)
def test_soft_cap_and_alibi_match_reference(cpu_path: str) -> None:
    spec = _spec("window")
    slopes = tuple(2.0 ** (-(i + 1) / 2) for i in range(4))
    _compare(spec, _params(spec, logits_soft_cap=1.5, alibi_slopes=slopes), RAGGED, cpu_path)


@pytest.mark.parametrize(
    ("dtype", "cpu_path"),
    # One half dtype on the compiled path: each dtype is one more compile (~10 s).
    [(torch.bfloat16, "engines"), (torch.float16, "engines"), (torch.bfloat16, "flex")],
)
def test_half_dtypes_match_reference(dtype: torch.dtype, cpu_path: str) -> None:
    spec = _spec("full", dtype)
    _compare(spec, _params(spec), RAGGED[:1] + RAGGED[3:4], cpu_path)


@pytest.mark.parametrize("cpu_path", PATHS)
def test_one_query_head_per_kv_head_decodes(cpu_path: str) -> None:
    # G = 1: one query row per K/V head, which the call pads to two rows (see _rows).
    spec = _spec("chunked")
    steps = [(("a", 1, 0), ("b", 1, 0))] * 3 + [(("a", 1, 0), ("b", 1, 0), ("c", 1, 0))] * 30
    _compare(spec, _params(spec, num_heads=HKV), steps, cpu_path)


def test_engines_split_short_and_long_runs() -> None:
    """Query runs of up to NATIVE_MAX_QUERY tokens (speculative decoding) take the native
    kernel, one work item per token with its own key range; longer ones the blocked
    products: both within one step, against the reference."""
    spec = _spec("window")
    steps: tuple[Step, ...] = (
        (("a", 40, 0), ("b", 2, 0)),
        (("a", NATIVE_MAX_QUERY, 0), ("b", NATIVE_MAX_QUERY + 1, 0), ("c", 3, 0)),
        (("a", 1, 0), ("b", NATIVE_MAX_QUERY, 0), ("c", 33, 0)),
    )
    _compare(spec, _params(spec), steps, "engines")
    rt = _runtime("flex_attention", spec, _params(spec))
    rt.begin_step([ScheduledRequest("a", 3), ScheduledRequest("b", 9)])
    md = rt.metadata_for("layer")
    assert isinstance(md, FlexAttentionMetadata)
    assert md.cpu is not None
    assert md.calls == ()
    assert md.cpu.native
    assert md.cpu.native_requests is not None
    assert md.cpu.native_requests.tolist() == [0]  # a's three tokens
    assert md.cpu.prefill_requests.tolist() == [1]
    assert md.cpu.prefill_lens.tolist() == [9]
    # A decode step: the native kernel takes the whole step, nothing planned.
    rt.begin_step([ScheduledRequest("a", 1), ScheduledRequest("b", 1)])
    md = rt.metadata_for("layer")
    assert isinstance(md, FlexAttentionMetadata)
    assert md.cpu is not None
    assert md.cpu.native
    assert md.cpu.native_requests is None
    assert len(md.cpu.prefill_requests) == 0


def test_steps_reuse_compiled_kernels() -> None:
    spec = _spec("full")
    params = _params(spec)
    steps = list(RAGGED)
    run = _run("flex_attention", spec, params, steps + steps[1:2], "flex")
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


# ------------------------------------------------------------------ selection and failures


def test_default_cpu_priority_selects_it_first_for_the_kinds_it_serves() -> None:
    config = AttentionConfig()
    chosen = select_backend(_spec("window"), config, device="cpu")
    assert chosen.backend_name == "flex_attention"
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    chosen = select_backend(mla, config, device="cpu")
    assert chosen.backend_name == "reference"
    odd = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    chosen = select_backend(odd, config, device="cpu")
    assert chosen.backend_name == "reference"
    assert any("head_size=8 not supported" in r for x in chosen.rejected for r in x.reasons)


def test_no_c_compiler_for_the_cpu_engines_falls_through_with_a_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from attnkit.kernels.attention import cpu_native as _native

    # A fresh process's view: nothing built yet, an empty cache, no usable compiler.
    monkeypatch.setattr(_native, "_STATE", [])
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "attnkit-no-such-compiler")
    reasons = FlexAttentionBackend.environment_reasons(torch.device("cpu"))
    assert any("native kernel is unavailable" in r and "CC=" in r for r in reasons), reasons
    chosen = select_backend(_spec("full"), AttentionConfig(), device="cpu")
    assert chosen.backend_name == "reference"
    (flex,) = [r for r in chosen.rejected if r.backend == "flex_attention"]
    assert any("attnkit-no-such-compiler" in r for r in flex.reasons)


def test_missing_cpp_compiler_is_a_reason_for_compiled_flex() -> None:
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.cxx": ("attnkit-no-such-compiler",)}):
        reasons = _compile.environment_problems(torch.device("cpu"))
    assert any("needs a C++ compiler" in r for r in reasons)


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
    rt = AttentionRuntime(
        {"layer": spec},
        AttentionConfig(backend_options={"flex_attention": {"cpu_path": "flex"}}),
        device="cpu",
        memory_budget_bytes=spec.page_size_bytes * 16,
        layer_params={"layer": AttentionLayerParams(num_heads=4)},
    )
    assert rt.routing_table()[0].backend == "flex_attention"
    rt.begin_step([ScheduledRequest("a", 5)])
    q, kv = torch.randn(5, 4, 32), torch.randn(5, HKV, 32)
    with pytest.raises(FlexCompileError, match="forced inductor failure") as err:
        rt.forward("layer", q, kv, kv)
    assert "does not fall back to the uncompiled kernel" in str(err.value)
    chosen = select_backend(spec, AttentionConfig(), device="cpu")
    assert chosen.backend_name == "reference"
    (flex,) = [r for r in chosen.rejected if r.backend == "flex_attention"]
    assert any("compiling FlexAttention failed earlier" in r for r in flex.reasons)
    # Named explicitly, it is an error with the same reason, never a silent fallback.
    with pytest.raises(Exception, match="failed earlier"):
        select_backend(spec, AttentionConfig(backend="flex_attention"), device="cpu")


def test_undeclared_features_are_refused_at_construction() -> None:
    spec = _spec("full")
    with pytest.raises(ValueError, match="attention_sinks"):
        FlexAttentionImpl(spec, AttentionLayerParams(num_heads=4, sinks=torch.zeros(4)))
    with pytest.raises(ValueError, match="return_lse"):
        FlexAttentionImpl(spec, AttentionLayerParams(num_heads=4, return_lse=True))
    sink = _spec("sink")
    with pytest.raises(ValueError, match="sink_key"):
        FlexAttentionImpl(sink, AttentionLayerParams(num_heads=4))


def test_planes_layout_and_bad_cache_argument() -> None:
    spec = _spec("full")
    assert FlexAttentionBackend.get_kv_cache_shapes(4, spec) == ((64, HKV, D), (64, HKV, D))
    rt = _runtime("flex_attention", spec, _params(spec))
    rt.begin_step([ScheduledRequest("a", 3)])
    impl = FlexAttentionImpl(spec, _params(spec))
    md = rt.metadata_for("layer")
    q, kv = torch.randn(3, 4, D), torch.randn(3, HKV, D)
    with pytest.raises(ValueError, match="kv_cache must hold 2 tensors"):
        impl.forward(q, kv, kv, [torch.zeros(4, 2, BS, HKV, D)], md, torch.empty_like(q))


def test_demo_with_flex_first_passes_its_dense_checks() -> None:
    """``attnkit demo --prefer flex``: full and window layers on flex_attention, the state
    layers on the reference; every step within the demo's tolerance of its dense check."""
    import io

    from attnkit.demo import run_demo

    out = io.StringIO()
    result = run_demo(out=out, prefer="flex", decode_steps=2)
    text = out.getvalue()
    assert result.passed, text
    assert "full_attention    group 0 (block_size 32) -> flex_attention" in text
    assert "sliding_window" in text
    assert "-> reference" in text  # the Mamba2 layers
