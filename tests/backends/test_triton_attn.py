"""The ``triton_attn`` backend, through its own builder and impl, against the reference backend.

Every step runs twice: through ``TritonAttentionBackend``'s builder and impl (Triton
``write_kv_cache`` + ``unified_attention`` or ``split_kv_decode``), and through
``ReferenceBackend``'s builder and impl (pure torch, float32 accumulation) on a copy of
the same inputs and cache. Outputs must agree within the tolerance of the dtype (or of
the fp8 cache) and the written caches bit for bit; rows past ``num_actual_tokens`` must
stay untouched. Caches start as NaN except the null block 0 (zero), so a kernel that
reads a slot it should not turns the output NaN.

Without CUDA, ``tests/conftest.py`` turns the Triton interpreter on, which is slow:
shapes stay small. The ``gpu`` tests at the end run realistic sizes and real CUDA graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
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
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpecKind,
    Mamba2LayerParams,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from attnkit.backend_api import (
    AttentionImpl,
    AttentionMetadataBuilder,
    BackendRequest,
    CommonAttentionMetadata,
    SizeRange,
)
from attnkit.backends.reference import ReferenceBackend
from attnkit.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from attnkit.kernels.attention.reference import write_kv_cache as torch_write_kv_cache

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONFIG = AttentionConfig()
FP8 = torch.float8_e4m3fn
FULL = KVCacheSpecKind.FULL_ATTENTION
WINDOW = KVCacheSpecKind.SLIDING_WINDOW
CHUNKED = KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION
ENCODER = KVCacheSpecKind.ENCODER_ONLY_ATTENTION
CROSS = KVCacheSpecKind.CROSS_ATTENTION

# (atol, rtol) between the backend's output and the reference backend's, keyed by what
# limits accuracy: the query dtype, or FP8 for an fp8 cache (the kernel tests' bounds
# against the float32 oracle). fp32: accumulation order only. fp16/bf16: both outputs
# are rounded to the dtype and the kernel rounds the softmax weights to it before P.V.
# fp8: both sides read the same e4m3 values (quantisation error does not count), but
# the kernel folds k_scale into the score scale and applies v_scale afterwards.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    FP8: (2e-2, 2e-2),
}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# ------------------------------------------------------------------ layers


@dataclasses.dataclass(frozen=True)
class Case:
    """One layer: its spec (kind, sizes, dtypes) and its parameters (features)."""

    kind: KVCacheSpecKind = FULL
    dtype: torch.dtype = torch.float16
    block_size: int = 16
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 32
    window: int | None = None
    chunk: int | None = None
    soft_cap: float | None = None
    alibi: bool = False
    sinks: bool = False
    fp8_scales: tuple[float, float] | None = None  # (k_scale, v_scale) of an fp8 cache
    query_gain: float = 1.0  # > 1: large logits

    @property
    def cache_dtype(self) -> torch.dtype:
        return FP8 if self.fp8_scales is not None else self.dtype

    @property
    def tolerance(self) -> tuple[float, float]:
        # Encoder-only layers keep no cache: an fp8 cache dtype quantises nothing.
        fp8 = self.fp8_scales is not None and self.kind is not ENCODER
        return TOLERANCES[FP8 if fp8 else self.dtype]

    @property
    def k_scale(self) -> float:
        return self.fp8_scales[0] if self.fp8_scales is not None else 1.0

    @property
    def v_scale(self) -> float:
        return self.fp8_scales[1] if self.fp8_scales is not None else 1.0

    def spec(self) -> AttentionSpec:
        common: dict[str, Any] = {
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": self.dtype,
            "kv_cache_dtype": "fp8_e4m3" if self.fp8_scales is not None else "auto",
        }
        if self.kind is WINDOW:
            assert self.window is not None
            return SlidingWindowSpec(sliding_window=self.window, **common)
        if self.kind is CHUNKED:
            assert self.chunk is not None
            return ChunkedLocalAttentionSpec(attention_chunk_size=self.chunk, **common)
        if self.kind is ENCODER:
            return EncoderOnlyAttentionSpec(**common)
        if self.kind is CROSS:
            return CrossAttentionSpec(**common)
        return FullAttentionSpec(**common)

    def params(self) -> AttentionLayerParams:
        hq = self.num_heads
        return AttentionLayerParams(
            num_heads=hq,
            logits_soft_cap=self.soft_cap,
            alibi_slopes=tuple(2.0 ** -(h + 1) for h in range(hq)) if self.alibi else None,
            sinks=torch.linspace(-1.0, 2.0, hq, device=DEVICE) if self.sinks else None,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )


@dataclasses.dataclass
class Layer:
    """The backend's builder and impl for one layer, and the reference backend's."""

    case: Case
    builder: TritonAttentionMetadataBuilder
    impl: TritonAttentionImpl
    ref_builder: AttentionMetadataBuilder[Any, Any]
    ref_impl: AttentionImpl[Any]


def make_layer(case: Case, config: AttentionConfig = CONFIG) -> Layer:
    spec, params = case.spec(), case.params()
    binding = TritonAttentionBackend.get_binding(spec)
    builder = binding.create(spec, ["layers.0"], config, DEVICE)
    impl = binding.create_impl(spec, params)
    assert isinstance(builder, TritonAttentionMetadataBuilder)
    assert isinstance(impl, TritonAttentionImpl)
    ref_binding = ReferenceBackend.get_binding(spec)
    return Layer(
        case=case,
        builder=builder,
        impl=impl,
        ref_builder=ref_binding.create(spec, ["layers.0"], config, DEVICE),
        ref_impl=ref_binding.create_impl(spec, params),
    )


def new_cache(case: Case, num_blocks: int) -> torch.Tensor:
    """NaN everywhere but the null block 0, which is zero (never handed out)."""
    shape = (num_blocks, 2, case.block_size, case.num_kv_heads, case.head_size)
    cache = torch.full(shape, float("nan"), dtype=case.cache_dtype, device=DEVICE)
    cache[0] = 0
    return cache


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, gain: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * gain).to(DEVICE, dtype)


def make_inputs(
    case: Case, num_tokens: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hq, hkv, d = case.num_heads, case.num_kv_heads, case.head_size
    query = randn(gen, num_tokens, hq, d, dtype=case.dtype, gain=case.query_gain)
    key = randn(gen, num_tokens, hkv, d, dtype=case.dtype)
    value = randn(gen, num_tokens, hkv, d, dtype=case.dtype)
    return query, key, value


def write_context(
    case: Case, caches: Sequence[torch.Tensor], slots: list[int], gen: torch.Generator
) -> None:
    """Earlier steps' keys/values, written the same way into every cache."""
    _, key, value = make_inputs(case, len(slots), gen)
    slot_tensor = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    for cache in caches:
        torch_write_kv_cache(
            key, value, cache, slot_tensor, k_scale=case.k_scale, v_scale=case.v_scale
        )


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8)), "caches differ"


def clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def run_step(
    layer: Layer,
    cm: CommonAttentionMetadata,
    *,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    cache: torch.Tensor | None,
    ref_cache: torch.Tensor | None,
    meta: TritonAttentionMetadata | None = None,
    guard: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> TritonAttentionMetadata:
    """One step through the backend and the reference backend; compare outputs and caches.

    ``cache is None``: an encoder-only layer (``kv_cache=[]``). ``meta``: metadata built
    beforehand (CUDA-graph builds); otherwise ``builder.build``. ``guard``: a context
    around the backend's ``forward`` alone.
    """
    n = cm.num_actual_tokens
    if meta is None:
        meta = layer.builder.build(0, cm)
    output = torch.full_like(query, float("nan"))
    kv_cache = [] if cache is None else [cache]
    with guard():
        returned = layer.impl.forward(query, key, value, kv_cache, meta, output)
    assert returned is output

    ref_kv_cache = [] if ref_cache is None else [ref_cache]
    expected = torch.full_like(query, float("nan"))
    layer.ref_impl.forward(
        query.clone(),
        clone(key),
        clone(value),
        ref_kv_cache,
        layer.ref_builder.build(0, cm),
        expected,
    )

    if cache is not None:
        assert ref_cache is not None
        assert_same_bits(cache, ref_cache)
    assert not output[:n].isnan().any(), "some output rows were never written"
    atol, rtol = layer.case.tolerance
    torch.testing.assert_close(output[:n].float(), expected[:n].float(), atol=atol, rtol=rtol)
    # Padding rows (past num_actual_tokens) are neither written to the cache nor output.
    assert output[n:].isnan().all()
    return meta


def first_visible(case: Case, context: int) -> int:
    """The first key position any query of a step starting at ``context`` can see."""
    if case.window is not None:
        return max(context - case.window + 1, 0)
    if case.chunk is not None:
        return context // case.chunk * case.chunk
    return 0


def slot_of(row: Sequence[int], position: int, block_size: int) -> int:
    return row[position // block_size] * block_size + position % block_size


# ------------------------------------------------------------------ multi-step, causal kinds

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
NUM_PADDING = 3


def case_param(id: str, **fields: Any) -> Any:
    return pytest.param(Case(**fields), id=id)


F32, F16, B16 = torch.float32, torch.float16, torch.bfloat16

MULTI_STEP_CASES = [
    case_param("full-bs16-fp32-gqa", dtype=F32),
    case_param("full-bs32-fp16-gqa", block_size=32),
    case_param("full-bs64-bf16-mqa-D48", block_size=64, dtype=B16, num_kv_heads=1, head_size=48),
    case_param("full-bs128-fp16-gqa4", block_size=128, num_heads=8, num_kv_heads=2),
    case_param("window1-bs16-fp32", kind=WINDOW, window=1, dtype=F32),
    case_param("window7-bs16-bf16", kind=WINDOW, window=7, dtype=B16),
    case_param("window1000-bs32-fp16", kind=WINDOW, window=1000, block_size=32),
    case_param("chunk16-bs16-fp16", kind=CHUNKED, chunk=16),
    case_param(
        "chunk24-bs32-fp32-mqa", kind=CHUNKED, chunk=24, block_size=32, dtype=F32, num_kv_heads=1
    ),
    case_param("softcap-fp16-large-logits", soft_cap=20.0, query_gain=8.0),
    case_param("alibi-fp32", dtype=F32, alibi=True),
    case_param("alibi-window5-bf16", kind=WINDOW, window=5, dtype=B16, alibi=True),
    case_param("sinks-fp16", sinks=True),
    case_param(
        "sinks-chunk32-bs64-bf16", kind=CHUNKED, chunk=32, block_size=64, dtype=B16, sinks=True
    ),
    case_param("fp8-fp16-bs16", fp8_scales=(0.25, 2.0)),
    case_param(
        "fp8-bf16-bs32-window9-alibi",
        kind=WINDOW,
        window=9,
        block_size=32,
        dtype=B16,
        alibi=True,
        fp8_scales=(4.0, 0.5),
    ),
    case_param(
        "fp8-fp32-bs128-softcap-sinks",
        block_size=128,
        dtype=F32,
        soft_cap=10.0,
        sinks=True,
        fp8_scales=(0.5, 0.25),
    ),
]


@pytest.mark.parametrize("case", MULTI_STEP_CASES)
def test_chunked_prefill_then_decode_matches_reference(case: Case) -> None:
    layer = make_layer(case)
    bs = case.block_size
    gen = torch.Generator().manual_seed(1234)
    rng = random.Random(bs * 1000 + (case.window or 0) + (case.chunk or 0))
    free = list(range(1, NUM_BLOCKS))  # block 0 is the null block: never handed out
    rng.shuffle(free)
    cache = new_cache(case, NUM_BLOCKS)
    ref_cache = cache.clone()

    blocks: dict[str, list[int]] = {}  # every block a request got, in logical order
    released: dict[str, int] = {}  # leading logical blocks read as 0 (out of the window/chunk)
    seq: dict[str, int] = {}
    for step, new_tokens in enumerate(SCHEDULE):
        query_lens: list[int] = []
        seq_lens: list[int] = []
        table: list[list[int]] = []
        slots: list[int] = []
        for req, q_len in new_tokens.items():
            context = seq.get(req, 0)
            seq_len = context + q_len
            owned = blocks.setdefault(req, [])
            while len(owned) * bs < seq_len:  # the caller grows the table
                owned.append(free.pop())
            cut = released[req] = max(released.get(req, 0), first_visible(case, context) // bs)
            table.append([0] * cut + owned[cut:])
            slots.extend(slot_of(owned, p, bs) for p in range(context, seq_len))
            query_lens.append(q_len)
            seq_lens.append(seq_len)
            seq[req] = seq_len
        cm = CommonAttentionMetadata.from_lists(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_table=table,
            slot_mapping=slots + [-1] * NUM_PADDING,
            device=DEVICE,
        )
        query, key, value = make_inputs(case, len(slots) + NUM_PADDING, gen)
        meta = run_step(
            layer, cm, query=query, key=key, value=value, cache=cache, ref_cache=ref_cache
        )
        assert meta.num_splits == 0  # num_sms is 1 off CUDA: the unified kernel
        for req in FINISHED_AFTER.get(step, []):
            # Freed blocks go back to the end of the queue: "d" reuses them.
            free.extend(blocks.pop(req))
            del seq[req]
    if case.window == 1 or case.chunk == 16:
        assert released["a"] > 0, "the scenario should release blocks out of the window"


# ------------------------------------------------------------------ cross attention

ENCODER_LENS = {"a": 20, "b": 5, "c": 17}
# Per step: request -> new decoder tokens. A request's first step writes its encoder
# states; "b" brings 9 decoder tokens against 5 encoder tokens; "c" reuses "a"'s blocks.
CROSS_SCHEDULE: list[dict[str, int]] = [
    {"a": 3},
    {"a": 1, "b": 9},
    {"b": 1, "a": 1},
    {"b": 1, "c": 2},
]
CROSS_FINISHED_AFTER = {2: ["a"]}

CROSS_CASES = [
    case_param("cross-fp16-gqa", kind=CROSS),
    case_param(
        "cross-bf16-bs32-softcap-alibi-sinks",
        kind=CROSS,
        block_size=32,
        dtype=B16,
        soft_cap=15.0,
        alibi=True,
        sinks=True,
    ),
    case_param("cross-fp8-fp32-mqa", kind=CROSS, dtype=F32, num_kv_heads=1, fp8_scales=(0.5, 2.0)),
]


@pytest.mark.parametrize("case", CROSS_CASES)
def test_cross_attention_steps_match_reference(case: Case) -> None:
    layer = make_layer(case)
    bs = case.block_size
    gen = torch.Generator().manual_seed(99)
    free = list(range(1, NUM_BLOCKS))
    random.Random(7).shuffle(free)
    cache = new_cache(case, NUM_BLOCKS)
    ref_cache = cache.clone()
    blocks: dict[str, list[int]] = {}
    for step, new_tokens in enumerate(CROSS_SCHEDULE):
        query_lens = list(new_tokens.values())
        num_tokens = sum(query_lens) + NUM_PADDING
        encoder_slots: list[int] = []
        for req in new_tokens:
            if req not in blocks:  # first step: write the encoder states
                e = ENCODER_LENS[req]
                blocks[req] = [free.pop() for _ in range(-(-e // bs))]
                encoder_slots.extend(slot_of(blocks[req], p, bs) for p in range(e))
        num_encoder = len(encoder_slots)
        cm = CommonAttentionMetadata.from_lists(
            query_lens=query_lens,
            seq_lens=[ENCODER_LENS[req] for req in new_tokens],
            block_table=[blocks[req] for req in new_tokens],
            slot_mapping=encoder_slots + [-1] * max(num_tokens - num_encoder, 0),
            device=DEVICE,
            causal=False,
        )
        query, _, _ = make_inputs(case, num_tokens, gen)
        key: torch.Tensor | None = None
        value: torch.Tensor | None = None
        if num_encoder:
            _, key, value = make_inputs(case, num_encoder, gen)
        if step == 1:
            assert cm.num_actual_tokens > num_encoder  # more decoder than encoder tokens
        meta = run_step(
            layer, cm, query=query, key=key, value=value, cache=cache, ref_cache=ref_cache
        )
        assert meta.causal is False
        for req in CROSS_FINISHED_AFTER.get(step, []):
            free.extend(blocks.pop(req))


# ------------------------------------------------------------------ encoder-only

# Steps of query lengths (a request is encoded whole in one step): the second grows the
# scratch cache, the third reuses it; a request with no tokens is skipped.
ENCODER_STEPS = [[5, 17, 1], [40, 0, 3], [2]]

ENCODER_CASES = [
    case_param("encoder-fp32-gqa", kind=ENCODER, dtype=F32),
    case_param(
        "encoder-bf16-mqa-softcap-alibi-sinks",
        kind=ENCODER,
        dtype=B16,
        num_kv_heads=1,
        soft_cap=15.0,
        alibi=True,
        sinks=True,
        query_gain=4.0,
    ),
    # No cache, so nothing is quantised: the fp8 cache dtype must not change the output.
    case_param("encoder-fp16-D80-fp8-spec", kind=ENCODER, head_size=80, fp8_scales=(0.5, 2.0)),
]


@pytest.mark.parametrize("case", ENCODER_CASES)
def test_encoder_only_steps_match_reference(case: Case) -> None:
    layer = make_layer(case)
    gen = torch.Generator().manual_seed(5)
    for lens in ENCODER_STEPS:
        num_tokens = sum(lens) + NUM_PADDING
        cm = CommonAttentionMetadata.from_lists(
            query_lens=lens,
            seq_lens=lens,
            block_table=[[] for _ in lens],
            slot_mapping=[-1] * num_tokens,
            device=DEVICE,
            causal=False,
        )
        query, key, value = make_inputs(case, num_tokens, gen)
        meta = run_step(layer, cm, query=query, key=key, value=value, cache=None, ref_cache=None)
        assert meta.causal is False
        assert meta.scratch_num_blocks == sum(-(-n // 16) for n in lens)


# ------------------------------------------------------------------ split-KV decode

# Decode-only batches of 2 requests over 1 kv head: with num_sms=132 the heuristic
# splits a context of 801 tokens into 3 (256 tokens a split at least).
SPLIT_CONTEXTS = [800, 516]
SPLIT_CASES = [
    case_param("split-fp16", num_heads=2, num_kv_heads=1),
    case_param(
        "split-window100-bf16", kind=WINDOW, window=100, dtype=B16, num_heads=2, num_kv_heads=1
    ),
    case_param(
        "split-sinks-alibi-fp32", dtype=F32, sinks=True, alibi=True, num_heads=4, num_kv_heads=1
    ),
    case_param(
        "split-fp8-fp16-softcap-bs32",
        block_size=32,
        soft_cap=10.0,
        num_heads=2,
        num_kv_heads=1,
        fp8_scales=(0.5, 2.0),
    ),
]


def decode_batch(
    case: Case, contexts: Sequence[int], caches: Sequence[torch.Tensor], seed: int
) -> CommonAttentionMetadata:
    """A decode step (one new token each) after ``contexts`` tokens already in ``caches``."""
    bs = case.block_size
    num_blocks = caches[0].shape[0]
    physical = list(range(1, num_blocks))
    random.Random(seed).shuffle(physical)
    gen = torch.Generator().manual_seed(seed)
    table: list[list[int]] = []
    context_slots: list[int] = []
    slots: list[int] = []
    for context in contexts:
        row = [physical.pop() for _ in range(-(-(context + 1) // bs))]
        cut = first_visible(case, context) // bs
        table.append([0] * cut + row[cut:])
        context_slots.extend(slot_of(row, p, bs) for p in range(context))
        slots.append(slot_of(row, context, bs))
    write_context(case, caches, context_slots, gen)
    return CommonAttentionMetadata.from_lists(
        query_lens=[1] * len(contexts),
        seq_lens=[c + 1 for c in contexts],
        block_table=table,
        slot_mapping=[*slots, -1],
        device=DEVICE,
    )


def blocks_for(case: Case, contexts: Sequence[int]) -> int:
    return 1 + sum(-(-(c + 1) // case.block_size) for c in contexts)


def forbid(*_: Any, **__: Any) -> Any:
    raise AssertionError("this path must not run")


class ForbiddenKernel:
    """Stands in for a ``@triton.jit`` kernel that must not be launched."""

    def __getitem__(self, grid: object) -> Any:
        return forbid


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_split_kv_decode_matches_reference(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = make_layer(case)
    cache = new_cache(case, blocks_for(case, SPLIT_CONTEXTS))
    ref_cache = cache.clone()
    cm = decode_batch(case, SPLIT_CONTEXTS, [cache, ref_cache], seed=3)
    assert layer.builder.build(0, cm).num_splits == 0  # num_sms is 1 off CUDA
    layer.builder.num_sms = 132
    meta = layer.builder.build(0, cm)
    assert meta.num_splits == meta.plan.num_splits == 3
    from attnkit.kernels.attention import triton as paged_attention

    # Only the split-KV kernels may run.
    monkeypatch.setattr(paged_attention, "_unified_attention_kernel", ForbiddenKernel())
    query, key, value = make_inputs(
        case, cm.slot_mapping.shape[0], torch.Generator().manual_seed(4)
    )
    run_step(
        layer, cm, query=query, key=key, value=value, cache=cache, ref_cache=ref_cache, meta=meta
    )


@pytest.mark.parametrize(
    ("kind", "query_lens", "expected"),
    [
        pytest.param(FULL, [1, 1], 3, id="decode"),
        pytest.param(FULL, [1, 2], 0, id="speculative-2-tokens"),
        pytest.param(CROSS, [1, 1], 0, id="cross"),
    ],
)
def test_split_kv_is_chosen_for_causal_single_token_decodes(
    kind: KVCacheSpecKind, query_lens: list[int], expected: int
) -> None:
    spec = Case(kind=kind, num_kv_heads=1).spec()
    builder = TritonAttentionBackend.get_binding(spec).create(spec, ["l"], CONFIG, DEVICE)
    assert isinstance(builder, TritonAttentionMetadataBuilder)
    builder.num_sms = 132
    width = -(-801 // 16)
    cm = CommonAttentionMetadata.from_lists(
        query_lens=query_lens,
        seq_lens=[801, 517],
        block_table=[list(range(1, width + 1))] * 2,
        slot_mapping=[-1] * sum(query_lens),
        device=DEVICE,
        causal=kind is not CROSS,
    )
    assert builder.build(0, cm).num_splits == expected


# ------------------------------------------------------------------ CUDA graphs (mechanics, CPU)

GRAPH_CONFIG = AttentionConfig(max_num_reqs=4, max_num_batched_tokens=16, max_model_len=128)
GRAPH_BLOCKS = 24


def mixed_batch(
    case: Case,
    query_lens: list[int],
    seq_lens: list[int],
    caches: Sequence[torch.Tensor],
    *,
    seed: int,
    num_padding: int,
) -> CommonAttentionMetadata:
    """A batch over shuffled blocks whose contexts are already in ``caches``."""
    bs = case.block_size
    physical = list(range(1, caches[0].shape[0]))
    random.Random(seed).shuffle(physical)
    gen = torch.Generator().manual_seed(seed)
    table: list[list[int]] = []
    context_slots: list[int] = []
    slots: list[int] = []
    for q_len, seq_len in zip(query_lens, seq_lens, strict=True):
        row = [physical.pop() for _ in range(-(-seq_len // bs))]
        context = seq_len - q_len
        cut = first_visible(case, context) // bs
        table.append([0] * cut + row[cut:])
        context_slots.extend(slot_of(row, p, bs) for p in range(context))
        slots.extend(slot_of(row, p, bs) for p in range(context, seq_len))
    write_context(case, caches, context_slots, gen)
    return CommonAttentionMetadata.from_lists(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=slots + [-1] * num_padding,
        device=DEVICE,
    )


TENSOR_FIELDS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
GRAPH_CASES = [
    case_param("full-fp16-gqa", dtype=F16),
    case_param("window6-bf16-alibi", kind=WINDOW, window=6, dtype=B16, alibi=True),
    case_param(
        "chunk32-fp8-fp32-sinks",
        kind=CHUNKED,
        chunk=32,
        dtype=F32,
        sinks=True,
        fp8_scales=(0.5, 2.0),
    ),
]


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_cudagraph_builds_reuse_fixed_addresses(case: Case) -> None:
    """Two batches of one shape (3 requests, 6 tokens + 2 padding) through the same buffers."""
    layer = make_layer(case, GRAPH_CONFIG)
    cache = new_cache(case, GRAPH_BLOCKS)
    ref_cache = cache.clone()
    gen = torch.Generator().manual_seed(11)

    cm1 = mixed_batch(case, [1, 3, 2], [17, 3, 40], [cache, ref_cache], seed=1, num_padding=2)
    captured = layer.builder.build_for_cudagraph_capture(cm1)
    addresses = {name: getattr(captured, name).data_ptr() for name in TENSOR_FIELDS}
    query, key, value = make_inputs(case, 8, gen)
    run_step(
        layer,
        cm1,
        query=query,
        key=key,
        value=value,
        cache=cache,
        ref_cache=ref_cache,
        meta=captured,
    )

    # Same shape, other lengths and blocks (and a wider block table).
    cm2 = mixed_batch(case, [2, 1, 3], [5, 100, 3], [cache, ref_cache], seed=2, num_padding=2)
    replay = layer.builder.build_for_cudagraph_capture(cm2)
    for name in TENSOR_FIELDS:
        assert getattr(replay, name).data_ptr() == addresses[name], name
    assert torch.equal(replay.query_start_loc, cm2.query_start_loc)
    assert torch.equal(replay.seq_lens, cm2.seq_lens)
    width = cm2.block_table_tensor.shape[1]
    assert width > cm1.block_table_tensor.shape[1]
    assert replay.block_table.shape == (3, 128 // case.block_size)  # the buffer's full width
    assert torch.equal(replay.block_table[:, :width], cm2.block_table_tensor)
    assert torch.equal(replay.slot_mapping, cm2.slot_mapping)
    # Everything but the tensors' contents depends on the batch's shape only.
    scalars = [f.name for f in dataclasses.fields(replay) if f.name not in (*TENSOR_FIELDS, "plan")]
    assert {n: getattr(replay, n) for n in scalars} == {n: getattr(captured, n) for n in scalars}
    # The plan too: its grid is the shape-only bound, its tile offsets a fixed buffer
    # recomputed on the device for each batch.
    plan_tensors = ("query_start_loc", "seq_lens", "block_table", "tile_offsets")
    plan_scalars = [f.name for f in dataclasses.fields(replay.plan) if f.name not in plan_tensors]
    assert {n: getattr(replay.plan, n) for n in plan_scalars} == {
        n: getattr(captured.plan, n) for n in plan_scalars
    }
    assert not replay.plan.exact_grid
    assert replay.plan.tile_offsets.data_ptr() == captured.plan.tile_offsets.data_ptr()
    # 2, 1, 3 query tokens in tiles of block_q: the offsets count each request's tiles.
    block_q = replay.plan.block_q
    tiles = [0]
    for q_len in (2, 1, 3):
        tiles.append(tiles[-1] + -(-q_len // block_q))
    assert replay.plan.tile_offsets.tolist() == tiles
    assert replay.plan.num_tiles >= tiles[-1]
    assert (replay.max_query_len, replay.max_seq_len, replay.num_splits) == (6, 128, 0)

    # Replaying the captured metadata object runs the second batch.
    query, key, value = make_inputs(case, 8, gen)
    run_step(
        layer,
        cm2,
        query=query,
        key=key,
        value=value,
        cache=cache,
        ref_cache=ref_cache,
        meta=captured,
    )


def test_cudagraph_build_of_a_step_longer_than_max_model_len() -> None:
    """40 tokens (4 prefills of 10) under max_model_len=32: the query bound stays valid."""
    case = Case(dtype=F32, num_kv_heads=1, num_heads=2, head_size=16)
    config = AttentionConfig(max_num_reqs=4, max_num_batched_tokens=64, max_model_len=32)
    layer = make_layer(case, config)
    cache = new_cache(case, 8)
    ref_cache = cache.clone()
    cm = mixed_batch(case, [10] * 4, [10] * 4, [cache, ref_cache], seed=5, num_padding=1)
    meta = layer.builder.build_for_cudagraph_capture(cm)
    assert meta.max_query_len <= meta.max_seq_len == 32
    query, key, value = make_inputs(case, 41, torch.Generator().manual_seed(6))
    run_step(
        layer, cm, query=query, key=key, value=value, cache=cache, ref_cache=ref_cache, meta=meta
    )


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "setting"),
    [
        pytest.param([1] * 5, [1] * 5, "max_num_reqs", id="requests"),
        pytest.param([9, 8], [9, 8], "max_num_batched_tokens", id="tokens"),
        pytest.param([1], [129], "max_model_len", id="block-table-width"),
    ],
)
def test_cudagraph_build_over_the_limits_raises(
    query_lens: list[int], seq_lens: list[int], setting: str
) -> None:
    layer = make_layer(Case(), GRAPH_CONFIG)
    cm = CommonAttentionMetadata.from_lists(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_table=[[1] * -(-s // 16) for s in seq_lens],
        slot_mapping=[-1] * sum(query_lens),
        device=DEVICE,
    )
    with pytest.raises(RuntimeError, match=f"raise AttentionConfig\\.{setting}$"):
        layer.builder.build_for_cudagraph_capture(cm)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        pytest.param(FULL, AttentionCGSupport.ALWAYS, id="full"),
        pytest.param(WINDOW, AttentionCGSupport.ALWAYS, id="sliding_window"),
        pytest.param(CHUNKED, AttentionCGSupport.ALWAYS, id="chunked_local"),
        pytest.param(ENCODER, AttentionCGSupport.NEVER, id="encoder_only"),
        pytest.param(CROSS, AttentionCGSupport.NEVER, id="cross"),
    ],
)
def test_cudagraph_support_per_kind(kind: KVCacheSpecKind, expected: AttentionCGSupport) -> None:
    case = Case(kind=kind, window=4, chunk=32)
    spec = case.spec()
    assert TritonAttentionMetadataBuilder.get_cudagraph_support(CONFIG, spec) is expected
    if expected is AttentionCGSupport.NEVER:
        layer = make_layer(case, GRAPH_CONFIG)
        cm = CommonAttentionMetadata.from_lists(
            query_lens=[2],
            seq_lens=[2],
            block_table=[[]] if kind is ENCODER else [[1]],
            slot_mapping=[-1, -1],
            device=DEVICE,
            causal=False,
        )
        with pytest.raises(RuntimeError, match=f"{kind.value} layers cannot be captured"):
            layer.builder.build_for_cudagraph_capture(cm)


ALLOCATORS = ("empty", "zeros", "full", "tensor", "empty_like")


@pytest.mark.parametrize(
    ("case", "split", "batches"),
    [
        pytest.param(
            Case(alibi=True, sinks=True, fp8_scales=(0.5, 2.0), num_heads=2, num_kv_heads=1),
            False,
            [[40, 3], [20, 33]],
            id="unified-fp8-alibi-sinks",
        ),
        pytest.param(
            Case(sinks=True, fp8_scales=(0.5, 2.0), num_heads=2, num_kv_heads=1),
            True,
            [[800, 516], [780, 530]],
            id="split-fp8-sinks",
        ),
        pytest.param(
            Case(kind=ENCODER, alibi=True), False, [[20, 5], [9, 16]], id="encoder-only-alibi"
        ),
    ],
)
def test_second_forward_allocates_nothing(
    case: Case, split: bool, batches: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a first step, a step of the same shape allocates nothing in ``forward``.

    ``batches``: the decode contexts of the two steps (encoder-only: the query lengths).
    """
    layer = make_layer(case)
    layer.builder.num_sms = 132

    @contextlib.contextmanager
    def no_allocation() -> Any:
        with monkeypatch.context() as patch:
            for name in ALLOCATORS:
                patch.setattr(torch, name, forbid)
            yield

    for step, lens in enumerate(batches):
        cache: torch.Tensor | None = None
        ref_cache: torch.Tensor | None = None
        if case.kind is ENCODER:
            cm = CommonAttentionMetadata.from_lists(
                query_lens=lens,
                seq_lens=lens,
                block_table=[[] for _ in lens],
                slot_mapping=[-1] * (sum(lens) + 1),
                device=DEVICE,
                causal=False,
            )
        else:
            cache = new_cache(case, blocks_for(case, [800, 800]))
            ref_cache = cache.clone()
            cm = decode_batch(case, lens, [cache, ref_cache], seed=step)
        meta = layer.builder.build(0, cm)
        assert (meta.num_splits > 1) is split
        query, key, value = make_inputs(
            case, cm.slot_mapping.shape[0], torch.Generator().manual_seed(20 + step)
        )
        run_step(
            layer,
            cm,
            query=query,
            key=key,
            value=value,
            cache=cache,
            ref_cache=ref_cache,
            meta=meta,
            guard=no_allocation if step else contextlib.nullcontext,
        )


# ------------------------------------------------------------------ ragged batches (hypothesis)


@settings(max_examples=8, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), min_size=1, max_size=4),
    kind=st.sampled_from([FULL, WINDOW, CHUNKED]),
    span=st.sampled_from([1, 5, 16, 64]),
    block_size=st.sampled_from([16, 32, 64, 128]),
    dtype=st.sampled_from([F32, F16, B16]),
    heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]),
    features=st.sets(st.sampled_from(["softcap", "alibi", "sinks", "fp8"])),
    seed=st.integers(0, 2**16),
)
def test_ragged_batches_match_reference(
    requests: list[tuple[int, int]],
    kind: KVCacheSpecKind,
    span: int,
    block_size: int,
    dtype: torch.dtype,
    heads: tuple[int, int],
    features: set[str],
    seed: int,
) -> None:
    """One step of (context, new tokens) requests over a cache that already holds the context."""
    case = Case(
        kind=kind,
        dtype=dtype,
        block_size=block_size,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_size=16,
        window=span if kind is WINDOW else None,
        chunk=span if kind is CHUNKED else None,
        soft_cap=12.0 if "softcap" in features else None,
        alibi="alibi" in features,
        sinks="sinks" in features,
        fp8_scales=(0.5, 1.5) if "fp8" in features else None,
    )
    layer = make_layer(case)
    num_padding = seed % 3
    caches = [new_cache(case, 1 + sum(-(-(c + q) // block_size) for c, q in requests))]
    caches.append(caches[0].clone())
    cm = mixed_batch(
        case,
        [q for _, q in requests],
        [c + q for c, q in requests],
        caches,
        seed=seed,
        num_padding=num_padding,
    )
    query, key, value = make_inputs(
        case, cm.num_actual_tokens + num_padding, torch.Generator().manual_seed(seed)
    )
    run_step(layer, cm, query=query, key=key, value=value, cache=caches[0], ref_cache=caches[1])


# ------------------------------------------------------------------ builder


def _batch(causal: bool = True) -> CommonAttentionMetadata:
    return CommonAttentionMetadata.from_lists(
        query_lens=[1, 4],
        seq_lens=[17, 4],
        block_table=[[3, 1], [2]],
        slot_mapping=[17, 32, 33, 34, 35, -1],
        device=DEVICE,
        causal=causal,
    )


METADATA_FIELDS = [
    "query_start_loc",
    "seq_lens",
    "block_table",
    "slot_mapping",
    "max_query_len",
    "max_seq_len",
    "num_actual_tokens",
    "causal",
    "sliding_window",
    "chunk_size",
    "num_splits",
    "plan",
    "scratch_block_table",
    "scratch_slot_mapping",
    "scratch_num_blocks",
    "draft_ancestors",
    "draft_counts",
]


@pytest.mark.parametrize(
    ("case", "causal"),
    [
        pytest.param(Case(), True, id="full"),
        pytest.param(Case(kind=WINDOW, window=9), True, id="window9"),
        pytest.param(Case(kind=CHUNKED, chunk=32), True, id="chunk32"),
        pytest.param(Case(kind=CROSS), False, id="cross"),
    ],
)
def test_build_passes_the_batch_through_unchanged(case: Case, causal: bool) -> None:
    builder = make_layer(case).builder
    builder.num_sms = 132  # the split path stays off for a batch with a prefill
    cm = _batch(causal)
    meta = builder.build(0, cm)
    assert isinstance(meta, TritonAttentionMetadata)
    assert [f.name for f in dataclasses.fields(meta)] == METADATA_FIELDS
    # The very tensors of the batch: no copies, no conversions.
    assert meta.query_start_loc is cm.query_start_loc
    assert meta.seq_lens is cm.seq_lens
    assert meta.block_table is cm.block_table_tensor
    assert meta.slot_mapping is cm.slot_mapping
    assert (meta.max_query_len, meta.max_seq_len, meta.num_actual_tokens) == (4, 17, 5)
    assert meta.causal is causal
    assert (meta.sliding_window, meta.chunk_size) == (case.window, case.chunk)
    assert meta.num_splits == 0
    # The plan holds the same tensors, validated once for every layer of the group, and
    # the exact query-tile grid from the CPU offsets: block_q 4, one tile per request.
    plan = meta.plan
    assert plan.query_start_loc is cm.query_start_loc
    assert plan.seq_lens is cm.seq_lens
    assert plan.block_table is cm.block_table_tensor
    assert (plan.num_splits, plan.block_q, plan.num_tiles, plan.exact_grid) == (0, 4, 2, True)
    assert plan.tile_offsets.tolist() == [0, 1, 2]
    assert (meta.scratch_block_table, meta.scratch_slot_mapping) == (None, None)
    assert meta.scratch_num_blocks == 0
    assert (meta.draft_ancestors, meta.draft_counts) == (None, None)  # no draft tree
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.max_query_len = 1  # type: ignore[misc]  # deliberate misuse under test


def test_encoder_only_build_lays_out_a_scratch_cache() -> None:
    builder = make_layer(Case(kind=ENCODER)).builder
    lens = [5, 17, 0, 1, 32]
    cm = CommonAttentionMetadata.from_lists(
        query_lens=lens,
        seq_lens=lens,
        block_table=[[] for _ in lens],
        slot_mapping=[-1] * (sum(lens) + 2),
        device=DEVICE,
        causal=False,
    )
    meta = builder.build(0, cm)
    assert meta.query_start_loc is cm.query_start_loc
    assert meta.seq_lens is cm.seq_lens
    assert meta.slot_mapping is cm.slot_mapping
    assert meta.causal is False
    assert meta.num_splits == 0
    assert meta.scratch_block_table is not None
    assert meta.scratch_slot_mapping is not None
    assert meta.scratch_block_table.dtype == torch.int32
    assert meta.scratch_slot_mapping.dtype == torch.int64
    needed = [-(-n // 16) for n in lens]
    assert meta.scratch_num_blocks == sum(needed) == 6
    table = meta.scratch_block_table.tolist()
    slots = meta.scratch_slot_mapping.tolist()
    assert len(table) == len(lens)
    assert len(table[0]) == max(needed)
    assert len(slots) == sum(lens)
    used = [table[b][i] for b in range(len(lens)) for i in range(needed[b])]
    assert sorted(used) == list(range(6)), "each request gets blocks of its own"
    start = 0
    for b, n in enumerate(lens):
        assert slots[start : start + n] == [slot_of(table[b], p, 16) for p in range(n)]
        start += n


@pytest.mark.parametrize(
    ("case", "causal", "match"),
    [
        pytest.param(Case(), False, "a full_attention group needs causal=True", id="full"),
        pytest.param(
            Case(kind=ENCODER),
            True,
            "a encoder_only_attention group needs causal=False",
            id="encoder-only",
        ),
        pytest.param(
            Case(kind=CROSS), True, "a cross_attention group needs causal=False", id="cross"
        ),
    ],
)
def test_build_rejects_the_wrong_causality(case: Case, causal: bool, match: str) -> None:
    builder = make_layer(case).builder
    with pytest.raises(ValueError, match=f"{match}, got causal={causal}"):
        builder.build(0, _batch(causal))


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
            MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16),
            id="mla",
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
    # Binding is by exact kind: a subclass of a bound spec class finds no binding...
    assert TritonAttentionBackend.find_binding(spec) is None
    with pytest.raises(
        TypeError,
        match=f"backend 'triton_attn' has no builder for {type(spec).__name__}",
    ):
        TritonAttentionBackend.get_binding(spec)
    why = _reasons(spec)
    assert any(r.startswith(f"kind={spec.kind.value} not supported") for r in why), why
    # ...and the binding of its parent class (matched by isinstance) refuses it.
    (binding,) = [
        b
        for b in TritonAttentionBackend.builders
        if isinstance(spec, b.spec_type) and b.kind is not spec.kind
    ]
    with pytest.raises(TypeError, match=f"kind={spec.kind.value}"):
        binding.create(spec, ["layers.0"], CONFIG, DEVICE)
    with pytest.raises(TypeError, match=f"kind={spec.kind.value}"):
        binding.create_impl(spec, AttentionLayerParams(num_heads=2))


# ------------------------------------------------------------------ impl


SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
SUPPORTED_FEATURES = "alibi, attention_sinks, context_parallel, logits_soft_cap, mm_prefix, per_head_quant_scales"


@pytest.mark.parametrize(
    ("params", "error", "match"),
    [
        pytest.param(
            None,
            TypeError,
            "TritonAttentionImpl takes layer_params of type AttentionLayerParams, got NoneType",
            id="no-params",
        ),
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
            AttentionLayerParams(num_heads=2, return_lse=True),
            ValueError,
            "TritonAttentionImpl: the layer needs return_lse, which triton_attn does not "
            f"support \\(supported features: {SUPPORTED_FEATURES}\\)",
            id="return-lse",
        ),
        pytest.param(
            AttentionLayerParams(num_heads=2, v_head_size=32),
            ValueError,
            "v_head_size=32",
            id="v-head-size",
        ),
        pytest.param(
            AttentionLayerParams(
                num_heads=2, sink_key=torch.zeros(4, 2, 64), sink_value=torch.zeros(4, 2, 64)
            ),
            ValueError,
            "sink tokens",
            id="sink-tokens",
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


def test_impl_accepts_every_declared_feature() -> None:
    spec = dataclasses.replace(SPEC, kv_cache_dtype="fp8_e4m3")
    params = AttentionLayerParams(
        num_heads=4,
        logits_soft_cap=30.0,
        alibi_slopes=(0.5,) * 4,
        sinks=torch.zeros(4),
        k_scale=(1.0,) * spec.num_kv_heads,
    )
    # context_parallel is asked by the runtime for a sharded group, mm_prefix by the
    # spec, not by params.
    assert params.features | {AttentionFeature.CONTEXT_PARALLEL, AttentionFeature.MM_PREFIX} == (
        TritonAttentionBackend.supported_features
    )
    impl = TritonAttentionBackend.get_binding(spec).create_impl(spec, params)
    assert isinstance(impl, TritonAttentionImpl)


def test_impl_scale_defaults_to_inverse_sqrt_head_size() -> None:
    binding = TritonAttentionBackend.get_binding(SPEC)
    impl = binding.create_impl(SPEC, AttentionLayerParams(num_heads=4))
    assert isinstance(impl, TritonAttentionImpl)
    assert impl.scale == 64**-0.5
    impl = binding.create_impl(SPEC, AttentionLayerParams(num_heads=4, scale=0.2))
    assert isinstance(impl, TritonAttentionImpl)
    assert impl.scale == 0.2


@pytest.mark.parametrize(
    ("case", "with_kv", "num_caches", "match"),
    [
        pytest.param(Case(), False, 1, "forward needs key and value", id="full-no-kv"),
        pytest.param(
            Case(kind=ENCODER), False, 0, "forward needs key and value", id="encoder-no-kv"
        ),
        pytest.param(Case(), True, 0, "expects one cache tensor per layer, got 0", id="no-cache"),
        pytest.param(Case(), True, 2, "expects one cache tensor per layer, got 2", id="two-caches"),
    ],
)
def test_forward_rejects_missing_inputs(
    case: Case, with_kv: bool, num_caches: int, match: str
) -> None:
    layer = make_layer(case)
    causal = case.kind is not ENCODER
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[2],
        seq_lens=[2],
        block_table=[[1]] if causal else [[]],
        slot_mapping=[16, 17] if causal else [-1, -1],
        device=DEVICE,
        causal=causal,
    )
    meta = layer.builder.build(0, cm)
    query, key, value = make_inputs(case, 2, torch.Generator().manual_seed(0))
    caches = [new_cache(case, 2) for _ in range(num_caches)]
    output = torch.full_like(query, float("nan"))
    if not with_kv:
        key = value = None
    with pytest.raises(ValueError, match=match):
        layer.impl.forward(query, key, value, caches, meta, output)
    assert output.isnan().all()


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


@pytest.mark.parametrize(
    ("kv_cache_dtype", "capability", "refused"),
    [
        ("fp8_e4m3", (8, 0), True),
        ("fp8_e4m3", (8, 6), True),
        ("fp8_e4m3", (8, 9), False),
        ("fp8_e4m3", (9, 0), False),
        ("fp8_e4m3", (10, 0), False),
        ("fp8_e4m3", None, False),  # unknown capability: nothing to judge
        ("auto", (8, 0), False),
    ],
)
def test_fp8_e4m3_cache_needs_sm89_on_cuda(
    kv_cache_dtype: str, capability: tuple[int, int] | None, refused: bool
) -> None:
    """Triton has the e4m3 type only from sm_89 (an sm_80 compile fails): an A100 with an
    fp8_e4m3 cache is refused with the reason, not routed to kernels that cannot build."""
    spec = dataclasses.replace(SPEC, kv_cache_dtype=kv_cache_dtype)
    reasons = TritonAttentionBackend.not_supported_reasons(
        BackendRequest(spec=spec, device=torch.device("cuda"), capability=capability)
    )
    expected = (
        [
            f"kv_cache_dtype='fp8_e4m3' needs compute capability >= 8.9 (Triton has no e4m3 "
            f"type before sm_89), got {capability[0]}.{capability[1]}"
        ]
        if refused and capability is not None
        else []
    )
    assert [r for r in reasons if "fp8" in r] == expected
    # On CPU (the interpreter) the fp8 cache stays served.
    assert not [
        r
        for r in TritonAttentionBackend.not_supported_reasons(
            BackendRequest(spec=spec, device=torch.device("cpu"))
        )
        if "fp8" in r
    ]


def test_declarations_are_valid() -> None:
    assert TritonAttentionBackend.declaration_problems() == []
    assert TritonAttentionBackend.name == "triton_attn"
    assert TritonAttentionBackend.supported_kinds() == {FULL, WINDOW, CHUNKED, ENCODER, CROSS}
    assert TritonAttentionBackend.supported_features == {
        AttentionFeature.LOGITS_SOFT_CAP,
        AttentionFeature.ALIBI,
        AttentionFeature.ATTENTION_SINKS,
        AttentionFeature.CONTEXT_PARALLEL,
        AttentionFeature.MM_PREFIX,
        AttentionFeature.PER_HEAD_QUANT_SCALES,
    }
    assert TritonAttentionBackend.supported_kv_cache_dtypes == {
        "auto",
        "fp8_e4m3",
        "fp8_e4m3_per_token_head",
        "int8_per_token_head",
    }
    assert TritonAttentionBackend.supported_block_sizes == (16, 32, 64, 128)
    assert TritonAttentionBackend.supported_devices == {"cpu", "cuda"}


def test_declarations_agree_with_the_kernel_launchers() -> None:
    from attnkit.backends.triton_attn import backend
    from attnkit.kernels.attention import triton_kv_write as kv_write
    from attnkit.kernels.attention import triton_plan as pa
    from attnkit.kernels.attention.contract import FP8_DTYPE

    low, high = pa.MIN_HEAD_DIM, pa.MAX_HEAD_DIM
    assert TritonAttentionBackend.supported_head_sizes == (SizeRange(low, high),)
    assert TritonAttentionBackend.supported_block_sizes == pa.SUPPORTED_BLOCK_SIZES
    assert TritonAttentionBackend.supported_dtypes == frozenset(pa.SUPPORTED_DTYPES)
    assert TritonAttentionBackend.supported_dtypes == frozenset(kv_write._SUPPORTED_DTYPES)
    assert FP8_DTYPE == kv_write._FP8_DTYPE == FP8
    assert backend._SCRATCH_BLOCK_SIZE in pa.SUPPORTED_BLOCK_SIZES
    assert 1 <= pa.AUTO_SPLIT_MAX_QUERY_LEN <= pa.SPLIT_KV_MAX_QUERY_LEN


def test_supported_specs_have_no_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for kind in (FULL, WINDOW, CHUNKED, ENCODER, CROSS):
        for dtype in (F32, F16, B16):
            for bs in (16, 32, 64, 128):
                for head_size in (16, 80, 256):
                    for fp8 in (None, (1.0, 1.0)):
                        case = Case(
                            kind=kind,
                            dtype=dtype,
                            block_size=bs,
                            num_kv_heads=1,
                            head_size=head_size,
                            window=1,
                            chunk=64,
                            fp8_scales=fp8,
                        )
                        features = case.params().features | {
                            AttentionFeature.ALIBI,
                            AttentionFeature.ATTENTION_SINKS,
                            AttentionFeature.LOGITS_SOFT_CAP,
                        }
                        assert _reasons(case.spec(), features=frozenset(features)) == []


ALL_HEAD_SIZES = "16 to 256"
ALL_KINDS = (
    "chunked_local_attention, cross_attention, encoder_only_attention, full_attention, "
    "sliding_window"
)


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
            FullAttentionSpec(block_size=8, num_kv_heads=2, head_size=64, dtype=torch.float16),
            frozenset(),
            ["block_size=8 not supported (supported: 16, 32, 64, 128)"],
            id="block-size-8",
        ),
        pytest.param(
            FullAttentionSpec(block_size=256, num_kv_heads=2, head_size=64, dtype=torch.float16),
            frozenset(),
            ["block_size=256 not supported (supported: 16, 32, 64, 128)"],
            id="block-size-256",
        ),
        pytest.param(
            FullAttentionSpec(
                block_size=16,
                num_kv_heads=2,
                head_size=64,
                dtype=torch.float16,
                kv_cache_dtype="fp8_e5m2",
            ),
            frozenset(),
            [
                "kv_cache_dtype=fp8_e5m2 not supported (supported: auto, fp8_e4m3, "
                "fp8_e4m3_per_token_head, int8_per_token_head)"
            ],
            id="fp8-e5m2-kv-cache",
        ),
        pytest.param(
            FullAttentionSpec(
                block_size=16,
                num_kv_heads=2,
                head_size=64,
                dtype=torch.float16,
                kv_cache_dtype="float32",
            ),
            frozenset(),
            [
                "kv_cache_dtype=float32 not supported (supported: auto, fp8_e4m3, "
                "fp8_e4m3_per_token_head, int8_per_token_head)"
            ],
            id="float32-kv-cache",
        ),
        pytest.param(
            SPEC,
            frozenset({AttentionFeature.RETURN_LSE}),
            [f"feature return_lse not supported (supported: {SUPPORTED_FEATURES})"],
            id="feature-return-lse",
        ),
        pytest.param(
            SinkFullAttentionSpec(
                block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sink_len=4
            ),
            frozenset(),
            [f"kind=sink_full_attention not supported (supported: {ALL_KINDS})"],
            id="kind-sink-full",
        ),
        pytest.param(
            MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16),
            frozenset(),
            [f"kind=mla_attention not supported (supported: {ALL_KINDS})"],
            id="kind-mla",
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
        INTERPRETED = False

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "attnkit.kernels._triton.interpret", CompiledKernels)
    assert _reasons() == [
        "device=cpu needs the Triton interpreter, but attnkit's Triton kernels were already "
        "imported without it (set TRITON_INTERPRET=1 before importing triton)"
    ]


def test_importing_the_backend_does_not_import_triton() -> None:
    """Selecting the backend (import, reasons, bindings) never imports triton; only
    constructing a builder or impl does."""
    code = textwrap.dedent(
        """
        import sys
        import torch
        import attnkit
        from attnkit import EncoderOnlyAttentionSpec, FullAttentionSpec
        from attnkit.backend_api import BackendRequest
        from attnkit.backends.triton_attn import (
            TritonAttentionBackend,
            TritonAttentionMetadataBuilder,
        )

        for spec in (
            FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16),
            EncoderOnlyAttentionSpec(
                block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16
            ),
        ):
            TritonAttentionBackend.not_supported_reasons(
                BackendRequest(spec=spec, device=torch.device("cpu"))
            )
            TritonAttentionBackend.get_binding(spec)
            TritonAttentionMetadataBuilder.get_cudagraph_support(attnkit.AttentionConfig(), spec)
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


# ------------------------------------------------------------------ GPU, realistic sizes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_LAYER: dict[str, Any] = {"num_heads": 32, "num_kv_heads": 8, "head_size": 128}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("case", "query_lens", "seq_lens", "split"),
    [
        pytest.param(
            Case(dtype=B16, **GPU_LAYER),
            [1] * 64,
            [4096 - 37 * b for b in range(64)],
            False,
            id="decode-B64-ctx4k-bf16",
        ),
        pytest.param(
            Case(dtype=B16, fp8_scales=(0.05, 0.02), **GPU_LAYER),
            [1] * 64,
            [4096 - 37 * b for b in range(64)],
            False,
            id="decode-B64-ctx4k-fp8",
        ),
        pytest.param(
            Case(kind=WINDOW, window=1024, dtype=B16, sinks=True, **GPU_LAYER),
            [1] * 4,
            [8192, 5000, 300, 8000],
            True,
            id="decode-split-window-sinks-bf16",
        ),
        pytest.param(
            Case(dtype=B16, **GPU_LAYER),
            [2048, 1024, 1],
            [2048, 3072, 2500],
            False,
            id="prefill-2k-bf16",
        ),
        pytest.param(
            Case(dtype=B16, fp8_scales=(0.05, 0.02), alibi=True, **GPU_LAYER),
            [2048, 1024, 1],
            [2048, 3072, 2500],
            False,
            id="prefill-2k-fp8-alibi",
        ),
    ],
)
def test_realistic_sizes_match_reference_on_gpu(
    case: Case, query_lens: list[int], seq_lens: list[int], split: bool
) -> None:
    layer = make_layer(case)
    layer.builder.num_sms = 132  # an H100/H200, whatever the device: B=4 splits, B=64 not
    cache = new_cache(case, 1 + sum(-(-s // case.block_size) for s in seq_lens))
    ref_cache = cache.clone()
    cm = mixed_batch(case, query_lens, seq_lens, [cache, ref_cache], seed=0, num_padding=5)
    meta = layer.builder.build(0, cm)
    assert (meta.num_splits > 1) is split
    query, key, value = make_inputs(
        case, cm.slot_mapping.shape[0], torch.Generator().manual_seed(1)
    )
    run_step(
        layer, cm, query=query, key=key, value=value, cache=cache, ref_cache=ref_cache, meta=meta
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Case(dtype=F16, **GPU_LAYER), id="full-fp16"),
        pytest.param(
            Case(
                kind=WINDOW,
                window=300,
                dtype=B16,
                fp8_scales=(0.05, 0.02),
                alibi=True,
                sinks=True,
                **GPU_LAYER,
            ),
            id="window-fp8-alibi-sinks",
        ),
    ],
)
def test_decode_step_replays_in_a_cuda_graph(case: Case) -> None:
    """A decode step captured with torch.cuda.graph, replayed with new lengths and slots."""
    num_reqs, num_padding = 8, 0
    layer = make_layer(case)
    num_blocks = 1 + num_reqs * (1024 // case.block_size)
    cache = new_cache(case, num_blocks)
    hq, hkv, d = case.num_heads, case.num_kv_heads, case.head_size
    # Inputs at fixed addresses, refilled before every replay.
    query = torch.zeros(num_reqs, hq, d, dtype=case.dtype, device=DEVICE)
    key = torch.zeros(num_reqs, hkv, d, dtype=case.dtype, device=DEVICE)
    value = torch.zeros(num_reqs, hkv, d, dtype=case.dtype, device=DEVICE)
    output = torch.zeros_like(query)

    def refill(seq_lens: list[int], seed: int) -> CommonAttentionMetadata:
        cm = mixed_batch(
            case, [1] * num_reqs, seq_lens, [cache], seed=seed, num_padding=num_padding
        )
        new = make_inputs(case, num_reqs, torch.Generator().manual_seed(seed))
        for static, fresh in zip((query, key, value), new, strict=True):
            static.copy_(fresh)
        return cm

    cm = refill([1024] * num_reqs, seed=1)
    meta = layer.builder.build_for_cudagraph_capture(cm)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels, makes the constants
        layer.impl.forward(query, key, value, [cache], meta, output)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.impl.forward(query, key, value, [cache], meta, output)

    for seed, seq_lens in (
        (2, [5, 17, 1, 1000, 64, 33, 512, 2]),
        (3, [1024, 2, 300, 7, 16, 17, 999, 1]),
    ):
        cm = refill(seq_lens, seed)
        replayed = layer.builder.build_for_cudagraph_capture(cm)
        assert replayed.block_table.data_ptr() == meta.block_table.data_ptr()
        ref_cache = cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        expected = torch.full_like(query, float("nan"))
        layer.ref_impl.forward(
            query.clone(),
            key.clone(),
            value.clone(),
            [ref_cache],
            layer.ref_builder.build(0, cm),
            expected,
        )
        assert_same_bits(cache, ref_cache)
        atol, rtol = case.tolerance
        torch.testing.assert_close(output.float(), expected.float(), atol=atol, rtol=rtol)
