"""The ``triton_attn`` backend, through its own builder and impl, against the torch oracle.

Every step runs twice: through ``TritonAttentionBackend``'s builder and impl (Triton
``write_kv_cache`` + ``unified_attention``), and through the pure-torch oracle
(``kernels.torch.attention.write_kv_cache`` + ``paged_attention``) on a copy of the same
cache and inputs. Outputs must agree within the dtype's tolerance and the written caches
bit for bit. Without CUDA, ``tests/conftest.py`` turns the Triton interpreter on, which
is slow: shapes stay small.
"""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import (
    AttentionCGSupport,
    AttentionConfig,
    AttentionFeature,
    AttentionLayerParams,
    AttentionSpec,
    BackendRequest,
    ChunkedLocalAttentionSpec,
    CommonAttentionMetadata,
    FullAttentionSpec,
    KVCacheSpecKind,
    Mamba2LayerParams,
    SinkFullAttentionSpec,
    SizeRange,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from attnkit.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from attnkit.kernels.torch.attention import paged_attention
from attnkit.kernels.torch.attention import write_kv_cache as torch_write_kv_cache

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONFIG = AttentionConfig()

# (atol, rtol) between the Triton output and the oracle's, both rounded to the dtype
# (the kernel tests' bounds against a float64 oracle; the worst cases seen here use
# under a third of them). fp32: accumulation order only. fp16/bf16: the kernel rounds
# the softmax weights to the dtype before P.V, the oracle does not.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Integer views for bitwise comparison of caches (NaN payloads included).
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def make_spec(
    *, block_size: int, dtype: torch.dtype, num_kv_heads: int, head_size: int, window: int | None
) -> AttentionSpec:
    if window is None:
        return FullAttentionSpec(
            block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
        )
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        sliding_window=window,
    )


def make_layer(
    spec: AttentionSpec, num_heads: int
) -> tuple[TritonAttentionMetadataBuilder, TritonAttentionImpl]:
    binding = TritonAttentionBackend.get_binding(spec)
    builder = binding.create(spec, ["layers.0"], CONFIG, DEVICE)
    impl = binding.create_impl(spec, AttentionLayerParams(num_heads=num_heads))
    assert isinstance(builder, TritonAttentionMetadataBuilder)
    assert isinstance(impl, TritonAttentionImpl)
    return builder, impl


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    bits = BITS[actual.dtype]
    assert torch.equal(actual.view(bits), expected.view(bits)), "caches differ"


def run_step(
    *,
    builder: TritonAttentionMetadataBuilder,
    impl: TritonAttentionImpl,
    cache: torch.Tensor,
    ref_cache: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    table: list[list[int]],
    oracle_table: list[list[int]],
    slots: list[int],
    num_heads: int,
    window: int | None,
    gen: torch.Generator,
    num_padding: int = 0,
) -> None:
    """One step through the backend and through the oracle; compare outputs and caches.

    ``table`` is what the runtime hands the builder (released blocks read 0);
    ``oracle_table`` keeps every block a request ever had, for the oracle, which reads
    a request's whole context and would turn a NaN null block into NaN outputs.
    """
    _, _, _, num_kv_heads, head_size = cache.shape
    dtype = cache.dtype
    n = sum(query_lens)
    total = n + num_padding
    cm = CommonAttentionMetadata.from_lists(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=slots + [-1] * num_padding,
        device=DEVICE,
    )
    query = torch.randn(total, num_heads, head_size, generator=gen).to(DEVICE, dtype)
    key = torch.randn(total, num_kv_heads, head_size, generator=gen).to(DEVICE, dtype)
    value = torch.randn(total, num_kv_heads, head_size, generator=gen).to(DEVICE, dtype)
    output = torch.full_like(query, float("nan"))

    meta = builder.build(0, cm)
    returned = impl.forward(query, key, value, [cache], meta, output)
    assert returned is output

    slot_tensor = cm.slot_mapping[:n]
    torch_write_kv_cache(key[:n], value[:n], ref_cache, slot_tensor)
    width = max((len(row) for row in oracle_table), default=0)
    oracle_bt = torch.zeros(len(oracle_table), width, dtype=torch.int32)
    for i, row in enumerate(oracle_table):
        oracle_bt[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    expected = paged_attention(
        query[:n],
        ref_cache,
        query_start_loc=cm.query_start_loc,
        seq_lens=cm.seq_lens,
        block_table=oracle_bt.to(DEVICE),
        scale=impl.scale,
        sliding_window=window,
    )

    assert_same_bits(cache, ref_cache)
    atol, rtol = TOLERANCES[dtype]
    assert not output[:n].isnan().any(), "some output rows were never written"
    torch.testing.assert_close(output[:n], expected, atol=atol, rtol=rtol)
    # Padding rows (past num_actual_tokens) are neither written to the cache nor output.
    assert output[n:].isnan().all()


# ------------------------------------------------------------------ multi-step

# Per step: request -> new tokens. "a" is prefilled in three chunks, then decodes; "b"
# finishes after step 2 and "d" (33 tokens, past a 32-token block) reuses its freed
# blocks, whose stale K/V must stay invisible. Requests run in dict order.
SCHEDULE: list[dict[str, int]] = [
    {"a": 16, "b": 5},
    {"b": 1, "a": 13, "c": 9},
    {"b": 1, "c": 1, "a": 11},
    {"a": 1, "c": 1, "d": 33},
    {"a": 1, "c": 1, "d": 1},
    {"d": 1, "a": 1},
]
FINISHED_AFTER = {2: ["b"]}
NUM_BLOCKS = 14


def _multi_step_case(
    kind: str, window: int | None, bs: int, dtype: torch.dtype, hq: int, hkv: int, d: int
) -> Any:
    return pytest.param(
        window,
        bs,
        dtype,
        hq,
        hkv,
        d,
        id=f"{kind}-bs{bs}-{DTYPE_NAMES[dtype]}-Hq{hq}-Hkv{hkv}-D{d}",
    )


MULTI_STEP_CASES = [
    _multi_step_case("full", None, 16, torch.float32, 4, 2, 32),
    _multi_step_case("full", None, 32, torch.float16, 4, 2, 32),
    _multi_step_case("full", None, 16, torch.bfloat16, 4, 2, 32),
    _multi_step_case("full-mqa", None, 16, torch.float16, 4, 1, 48),
    _multi_step_case("window1", 1, 16, torch.float32, 4, 2, 32),
    _multi_step_case("window1", 1, 32, torch.bfloat16, 2, 2, 16),
    _multi_step_case("window7", 7, 16, torch.float16, 4, 2, 32),
    _multi_step_case("window1000", 1000, 32, torch.float32, 4, 2, 32),
]


@pytest.mark.parametrize(("window", "bs", "dtype", "hq", "hkv", "d"), MULTI_STEP_CASES)
def test_chunked_prefill_then_decode_matches_oracle(
    window: int | None, bs: int, dtype: torch.dtype, hq: int, hkv: int, d: int
) -> None:
    spec = make_spec(block_size=bs, dtype=dtype, num_kv_heads=hkv, head_size=d, window=window)
    builder, impl = make_layer(spec, hq)
    gen = torch.Generator().manual_seed(1234)
    rng = random.Random(bs * 1000 + (window or 0))
    free = list(range(1, NUM_BLOCKS))  # block 0 is the null block: never handed out
    rng.shuffle(free)
    cache = torch.full((NUM_BLOCKS, 2, bs, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
    ref_cache = cache.clone()

    blocks: dict[str, list[int]] = {}  # every block a request got, in logical order
    released: dict[str, int] = {}  # leading logical blocks read as 0 (out of the window)
    seq: dict[str, int] = {}
    for step, new_tokens in enumerate(SCHEDULE):
        query_lens: list[int] = []
        seq_lens: list[int] = []
        table: list[list[int]] = []
        oracle_table: list[list[int]] = []
        slots: list[int] = []
        for req, q_len in new_tokens.items():
            context = seq.get(req, 0)
            seq_len = context + q_len
            owned = blocks.setdefault(req, [])
            while len(owned) * bs < seq_len:  # the caller grows the table
                owned.append(free.pop())
            if window is not None:
                # Keys below context - window + 1 are out of every query's window.
                first_needed = max(context - window + 1, 0) // bs
                released[req] = max(released.get(req, 0), first_needed)
            cut = released.get(req, 0)
            table.append([0] * cut + owned[cut:])
            oracle_table.append(list(owned))
            slots.extend(owned[p // bs] * bs + p % bs for p in range(context, seq_len))
            query_lens.append(q_len)
            seq_lens.append(seq_len)
            seq[req] = seq_len
        run_step(
            builder=builder,
            impl=impl,
            cache=cache,
            ref_cache=ref_cache,
            query_lens=query_lens,
            seq_lens=seq_lens,
            table=table,
            oracle_table=oracle_table,
            slots=slots,
            num_heads=hq,
            window=window,
            gen=gen,
            num_padding=3,
        )
        for req in FINISHED_AFTER.get(step, []):
            # Freed blocks go back to the front of the queue: "d" reuses them.
            free.extend(blocks.pop(req))
            del seq[req]
    if window == 1 and bs == 16:
        assert released["a"] > 0, "the scenario should release blocks out of the window"


@settings(max_examples=8, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), min_size=1, max_size=4),
    block_size=st.sampled_from([16, 32]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    window=st.sampled_from([None, 1, 5, 64]),
    heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]),
    seed=st.integers(0, 2**16),
)
def test_ragged_batches_match_oracle(
    requests: list[tuple[int, int]],
    block_size: int,
    dtype: torch.dtype,
    window: int | None,
    heads: tuple[int, int],
    seed: int,
) -> None:
    """One step of (context, new tokens) requests over a cache that already holds the context."""
    hq, hkv = heads
    head_size = 16
    spec = make_spec(
        block_size=block_size, dtype=dtype, num_kv_heads=hkv, head_size=head_size, window=window
    )
    builder, impl = make_layer(spec, hq)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + q) // block_size) for c, q in requests]
    num_blocks = 1 + sum(needed)
    physical = list(range(1, num_blocks))
    random.Random(seed).shuffle(physical)
    cache = torch.full(
        (num_blocks, 2, block_size, hkv, head_size), float("nan"), dtype=dtype, device=DEVICE
    )
    table: list[list[int]] = []
    slots: list[int] = []
    context_slots: list[int] = []
    for (context, q_len), count in zip(requests, needed, strict=True):
        row = [physical.pop() for _ in range(count)]
        table.append(row)
        context_slots.extend(
            row[p // block_size] * block_size + p % block_size for p in range(context)
        )
        slots.extend(
            row[p // block_size] * block_size + p % block_size
            for p in range(context, context + q_len)
        )
    # Earlier steps' K/V, written the same way into both caches.
    prior = torch.tensor(context_slots, dtype=torch.int64, device=DEVICE)
    prior_k = torch.randn(len(context_slots), hkv, head_size, generator=gen).to(DEVICE, dtype)
    prior_v = torch.randn(len(context_slots), hkv, head_size, generator=gen).to(DEVICE, dtype)
    torch_write_kv_cache(prior_k, prior_v, cache, prior)
    run_step(
        builder=builder,
        impl=impl,
        cache=cache,
        ref_cache=cache.clone(),
        query_lens=[q for _, q in requests],
        seq_lens=[c + q for c, q in requests],
        table=table,
        oracle_table=table,
        slots=slots,
        num_heads=hq,
        window=window,
        gen=gen,
        num_padding=seed % 3,
    )


# ------------------------------------------------------------------ builder


def _batch() -> CommonAttentionMetadata:
    return CommonAttentionMetadata.from_lists(
        query_lens=[1, 4],
        seq_lens=[17, 4],
        block_table=[[3, 1], [2]],
        slot_mapping=[17, 32, 33, 34, 35, -1],
        device=DEVICE,
    )


@pytest.mark.parametrize(
    ("window", "expected_window"),
    [pytest.param(None, None, id="full"), pytest.param(9, 9, id="window9")],
)
def test_build_passes_the_batch_through_unchanged(
    window: int | None, expected_window: int | None
) -> None:
    spec = make_spec(
        block_size=16, dtype=torch.float16, num_kv_heads=2, head_size=64, window=window
    )
    builder, _ = make_layer(spec, 4)
    cm = _batch()
    meta = builder.build(0, cm)
    assert isinstance(meta, TritonAttentionMetadata)
    assert [f.name for f in dataclasses.fields(meta)] == [
        "query_start_loc",
        "seq_lens",
        "block_table",
        "slot_mapping",
        "max_query_len",
        "max_seq_len",
        "num_actual_tokens",
        "sliding_window",
    ]
    # The very tensors of the batch: no copies, no conversions.
    assert meta.query_start_loc is cm.query_start_loc
    assert meta.seq_lens is cm.seq_lens
    assert meta.block_table is cm.block_table_tensor
    assert meta.slot_mapping is cm.slot_mapping
    assert (meta.max_query_len, meta.max_seq_len, meta.num_actual_tokens) == (4, 17, 5)
    assert meta.sliding_window == expected_window
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.max_query_len = 1  # type: ignore[misc]


def test_build_rejects_a_non_causal_batch() -> None:
    spec = make_spec(block_size=16, dtype=torch.float16, num_kv_heads=2, head_size=64, window=None)
    builder, _ = make_layer(spec, 4)
    cm = dataclasses.replace(_batch(), causal=False)
    with pytest.raises(ValueError, match="causal only"):
        builder.build(0, cm)


def test_cudagraph_support_is_single_token_decode() -> None:
    for window in (None, 4):
        spec = make_spec(
            block_size=16, dtype=torch.float16, num_kv_heads=2, head_size=64, window=window
        )
        builder, _ = make_layer(spec, 4)
        support = TritonAttentionMetadataBuilder.get_cudagraph_support(CONFIG, spec)
        assert support is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        decode = CommonAttentionMetadata.from_lists(
            query_lens=[1, 1],
            seq_lens=[17, 4],
            block_table=[[3, 1], [2]],
            slot_mapping=[17, 35],
            device=DEVICE,
        )
        assert builder.build_for_cudagraph_capture(decode).max_query_len == 1
        with pytest.raises(RuntimeError, match="UNIFORM_SINGLE_TOKEN_DECODE"):
            builder.build_for_cudagraph_capture(_batch())


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(
            SinkFullAttentionSpec(
                block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sink_len=4
            ),
            id="sink_full",
        ),
        pytest.param(
            SlidingWindowMLASpec(
                block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16, sliding_window=8
            ),
            id="sliding_window_mla",
        ),
    ],
)
def test_subclass_specs_matching_a_binding_are_refused(spec: AttentionSpec) -> None:
    binding = TritonAttentionBackend.get_binding(spec)  # found through isinstance
    with pytest.raises(TypeError, match=f"kind={spec.kind.value}"):
        binding.create(spec, ["layers.0"], CONFIG, DEVICE)
    with pytest.raises(TypeError, match=f"kind={spec.kind.value}"):
        binding.create_impl(spec, AttentionLayerParams(num_heads=2))


# ------------------------------------------------------------------ impl


SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)


@pytest.mark.parametrize(
    ("params", "error", "match"),
    [
        pytest.param(None, ValueError, "needs AttentionLayerParams", id="no-params"),
        pytest.param(
            Mamba2LayerParams(
                num_heads=1,
                head_dim=1,
                n_groups=1,
                d_state=1,
                conv_weight=torch.zeros(3, 4),
                A=-torch.ones(1),
            ),
            TypeError,
            "got Mamba2LayerParams",
            id="mamba2-params",
        ),
        pytest.param(
            AttentionLayerParams(num_heads=4, logits_soft_cap=30.0),
            ValueError,
            "logits_soft_cap, which triton_attn does not support",
            id="softcap",
        ),
        pytest.param(
            AttentionLayerParams(num_heads=2, alibi_slopes=(0.5, 0.25)),
            ValueError,
            "alibi",
            id="alibi",
        ),
        pytest.param(
            AttentionLayerParams(num_heads=2, sinks=torch.zeros(2)),
            ValueError,
            "attention_sinks",
            id="sinks",
        ),
        pytest.param(
            AttentionLayerParams(num_heads=2, return_lse=True),
            ValueError,
            "return_lse",
            id="return-lse",
        ),
        pytest.param(
            AttentionLayerParams(num_heads=2, v_head_size=32),
            ValueError,
            "v_head_size=32",
            id="v-head-size",
        ),
        pytest.param(
            AttentionLayerParams(num_heads=3), ValueError, "not a multiple", id="num-heads"
        ),
    ],
)
def test_impl_rejects_unusable_layer_params(
    params: AttentionLayerParams | Mamba2LayerParams | None, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        TritonAttentionBackend.get_binding(SPEC).create_impl(SPEC, params)


def test_impl_scale_defaults_to_inverse_sqrt_head_size() -> None:
    binding = TritonAttentionBackend.get_binding(SPEC)
    impl = binding.create_impl(SPEC, AttentionLayerParams(num_heads=4))
    assert isinstance(impl, TritonAttentionImpl)
    assert impl.scale == 64**-0.5
    impl = binding.create_impl(SPEC, AttentionLayerParams(num_heads=4, scale=0.2))
    assert isinstance(impl, TritonAttentionImpl)
    assert impl.scale == 0.2


def test_forward_needs_key_and_value() -> None:
    _, impl = make_layer(SPEC, 4)
    cache = torch.zeros(2, 2, 16, 2, 64, dtype=torch.float16, device=DEVICE)
    meta = TritonAttentionMetadataBuilder(SPEC, ["l"], CONFIG, DEVICE).build(0, _batch())
    query = torch.zeros(6, 4, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="needs key and value"):
        impl.forward(query, None, None, [cache], meta, torch.empty_like(query))


# ------------------------------------------------------------------ declarations


def _reasons(
    spec: AttentionSpec | None = None,
    *,
    device: str = "cpu",
    features: frozenset[AttentionFeature] = frozenset(),
) -> list[str]:
    spec = spec or SPEC
    return TritonAttentionBackend.not_supported_reasons(
        BackendRequest(spec=spec, device=torch.device(device), features=features)
    )


def test_declarations_are_valid() -> None:
    assert TritonAttentionBackend.declaration_problems() == []
    assert TritonAttentionBackend.name == "triton_attn"
    assert TritonAttentionBackend.supported_kinds == {
        KVCacheSpecKind.FULL_ATTENTION,
        KVCacheSpecKind.SLIDING_WINDOW,
    }


def test_declarations_agree_with_the_kernel_launcher() -> None:
    from attnkit.kernels.triton import unified_attention as launcher

    low, high = launcher._MIN_HEAD_DIM, launcher._MAX_HEAD_DIM
    assert TritonAttentionBackend.supported_head_sizes == (SizeRange(low, high),)
    assert TritonAttentionBackend.supported_block_sizes == launcher._SUPPORTED_BLOCK_SIZES
    assert TritonAttentionBackend.supported_dtypes == frozenset(launcher._SUPPORTED_DTYPES)


def test_supported_specs_have_no_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for bs in (16, 32):
            for head_size in (16, 80, 256):
                for window in (None, 1):
                    spec = make_spec(
                        block_size=bs,
                        dtype=dtype,
                        num_kv_heads=1,
                        head_size=head_size,
                        window=window,
                    )
                    assert _reasons(spec) == []


ALL_HEAD_SIZES = "16 to 256"


@pytest.mark.parametrize(
    ("spec", "features", "expected"),
    [
        pytest.param(
            FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16),
            frozenset(),
            [f"head_size=8 not supported (supported: {ALL_HEAD_SIZES})"],
            id="head-size-8",
        ),
        pytest.param(
            FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=512, dtype=torch.float16),
            frozenset(),
            [f"head_size=512 not supported (supported: {ALL_HEAD_SIZES})"],
            id="head-size-512",
        ),
        pytest.param(
            FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=torch.float16),
            frozenset(),
            ["block_size=64 not supported (supported: 16, 32)"],
            id="block-size-64",
        ),
        pytest.param(
            FullAttentionSpec(
                block_size=16,
                num_kv_heads=2,
                head_size=64,
                dtype=torch.float16,
                kv_cache_dtype="fp8_e4m3",
            ),
            frozenset(),
            ["kv_cache_dtype=fp8_e4m3 not supported (supported: auto)"],
            id="fp8-kv-cache",
        ),
        pytest.param(
            SPEC,
            frozenset({AttentionFeature.LOGITS_SOFT_CAP}),
            ["feature logits_soft_cap not supported (supported: none)"],
            id="feature-softcap",
        ),
        pytest.param(
            ChunkedLocalAttentionSpec(
                block_size=16,
                num_kv_heads=2,
                head_size=64,
                dtype=torch.float16,
                attention_chunk_size=64,
            ),
            frozenset(),
            [
                "kind=chunked_local_attention not supported "
                "(supported: full_attention, sliding_window)"
            ],
            id="kind-chunked-local",
        ),
    ],
)
def test_not_supported_reasons_are_exact(
    monkeypatch: pytest.MonkeyPatch,
    spec: AttentionSpec,
    features: frozenset[AttentionFeature],
    expected: list[str],
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _reasons(spec, features=features) == expected


INTERPRETER_REASON = (
    "device=cpu needs the Triton interpreter (set TRITON_INTERPRET=1 before importing triton)"
)


@pytest.mark.parametrize(
    ("value", "rejected"),
    [
        pytest.param(None, True, id="unset"),
        pytest.param("0", True, id="zero"),
        pytest.param("1", False, id="one"),
        pytest.param("true", False, id="true"),
    ],
)
def test_cpu_needs_the_interpreter(
    monkeypatch: pytest.MonkeyPatch, value: str | None, rejected: bool
) -> None:
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    # Read when asked, not at import time.
    assert _reasons() == ([INTERPRETER_REASON] if rejected else [])
    assert (
        INTERPRETER_REASON in TritonAttentionBackend.environment_reasons(torch.device("cpu"))
    ) is rejected
    # CUDA has no such condition.
    assert INTERPRETER_REASON not in _reasons(device="cuda")


def test_kernels_imported_without_the_interpreter_are_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class CompiledKernels:
        _INTERPRETED = False

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "attnkit.kernels.triton.unified_attention", CompiledKernels)
    (reason,) = _reasons()
    assert reason.startswith("device=cpu needs the Triton interpreter, but attnkit's Triton")


def test_importing_the_backend_does_not_import_triton() -> None:
    code = textwrap.dedent(
        """
        import sys
        import torch
        import attnkit
        from attnkit import AttentionConfig, BackendRequest, CommonAttentionMetadata
        from attnkit import FullAttentionSpec
        from attnkit.backends.triton_attn import TritonAttentionBackend

        spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16)
        TritonAttentionBackend.not_supported_reasons(
            BackendRequest(spec=spec, device=torch.device("cpu"))
        )
        builder = TritonAttentionBackend.get_binding(spec).create(
            spec, ["l"], AttentionConfig(), torch.device("cpu")
        )
        builder.build(0, CommonAttentionMetadata.from_lists(
            query_lens=[2], seq_lens=[2], block_table=[[1]], slot_mapping=[16, 17]
        ))
        loaded = sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))
        print(loaded)
        """
    )
    env: Mapping[str, str] = dict(os.environ)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# ------------------------------------------------------------------ CUDA graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_step_replays_in_a_cuda_graph() -> None:
    """A captured single-token decode step, replayed with new lengths, slots and inputs."""
    dev = torch.device("cuda")
    dtype, bs, hq, hkv, d, num_reqs, width = torch.float16, 16, 4, 2, 64, 3, 4
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=hkv, head_size=d, dtype=dtype)
    binding = TritonAttentionBackend.get_binding(spec)
    builder = binding.create(spec, ["l"], CONFIG, dev)
    impl = binding.create_impl(spec, AttentionLayerParams(num_heads=hq))
    num_blocks = 1 + num_reqs * width
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(num_blocks, 2, bs, hkv, d, generator=gen).to(dev, dtype)
    # Fixed-address buffers, refilled before every replay.
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32, device=dev)
    seq_lens = torch.zeros(num_reqs, dtype=torch.int32, device=dev)
    table = torch.zeros(num_reqs, width, dtype=torch.int32, device=dev)
    slots = torch.zeros(num_reqs, dtype=torch.int64, device=dev)
    query = torch.zeros(num_reqs, hq, d, dtype=dtype, device=dev)
    key = torch.zeros(num_reqs, hkv, d, dtype=dtype, device=dev)
    value = torch.zeros(num_reqs, hkv, d, dtype=dtype, device=dev)
    output = torch.zeros(num_reqs, hq, d, dtype=dtype, device=dev)

    def fill(lens: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        rows = torch.randperm(num_blocks - 1, generator=g)[: num_reqs * width] + 1
        rows = rows.reshape(num_reqs, width).to(torch.int32)
        table.copy_(rows)
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        last = torch.tensor(lens) - 1
        slots.copy_(rows[torch.arange(num_reqs), last // bs].long() * bs + last % bs)
        query.copy_(torch.randn(num_reqs, hq, d, generator=g))
        key.copy_(torch.randn(num_reqs, hkv, d, generator=g))
        value.copy_(torch.randn(num_reqs, hkv, d, generator=g))

    capture_lens = [width * bs] * num_reqs
    fill(capture_lens, 1)
    qsl_cpu = qsl.cpu()
    cm = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.cpu(),
        num_reqs=num_reqs,
        num_actual_tokens=num_reqs,
        max_query_len=1,
        max_seq_len=width * bs,
        block_table_tensor=table,
        slot_mapping=slots,
    )
    meta = builder.build_for_cudagraph_capture(cm)
    impl.forward(query, key, value, [cache], meta, output)  # compiles the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(query, key, value, [cache], meta, output)

    for seed, lens in ((2, [5, 17, 1]), (3, [64, 2, 33])):
        fill(lens, seed)
        ref_cache = cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        torch_write_kv_cache(key, value, ref_cache, slots)
        expected = paged_attention(
            query,
            ref_cache,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=table,
            scale=d**-0.5,
        )
        assert_same_bits(cache, ref_cache)
        atol, rtol = TOLERANCES[dtype]
        torch.testing.assert_close(output, expected, atol=atol, rtol=rtol)
