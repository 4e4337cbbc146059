"""The ``triton_mla`` backend, through its own builder and impl, against the reference backend.

Every step runs twice: through ``TritonMLABackend``'s builder and impl (Triton
``write_mla_latents`` + ``mla_attention``) and through ``ReferenceBackend``'s MLA path
(pure torch, float32 accumulation: the latent cache read as a one-head cache whose key
is the whole latent and whose value is its first ``R`` channels) on a copy of the same
inputs and cache. Outputs must agree within the tolerance of the dtype and the written
caches bit for bit; rows past ``num_actual_tokens`` must stay untouched. Caches start
as NaN except the null block 0 (zero), so a kernel that reads a slot it should not
turns the output NaN.

fp8 caches: the reference backend does not serve them, so its side runs the same layer
with a model-dtype cache fed the latents as the fp8 cache holds them (quantised here, in
torch: ``latent / k_scale`` saturated to +-448 and rounded to e4m3, then times
``k_scale``; with power-of-two scales every step is exact), and the fp8 cache, read back
times ``k_scale``, must equal that cache bit for bit.

Without CUDA, ``tests/conftest.py`` turns the Triton interpreter on, which is slow:
shapes stay small (``R=32``, rope 16, 8 heads), with one DeepSeek-V3-sized case
(``R=512``, rope 64) at 4 heads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
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
    BackendRegistry,
    KVCacheSpecKind,
    MLAAttentionSpec,
    NoBackendError,
    SlidingWindowMLASpec,
    layout_from_hf_config,
)
from attnkit.backend_api import (
    AttentionImpl,
    AttentionMetadataBuilder,
    BackendRequest,
    CommonAttentionMetadata,
)
from attnkit.backends.reference import ReferenceBackend
from attnkit.backends.triton_mla import (
    DECODE_THRESHOLD,
    TritonMLABackend,
    TritonMLAImpl,
    TritonMLAMetadata,
    TritonMLAMetadataBuilder,
)
from attnkit.cli import main
from attnkit.registry import BUILTIN_BACKENDS
from attnkit.selector import DEFAULT_PRIORITY, select_backend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONFIG = AttentionConfig()
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
MLA = KVCacheSpecKind.MLA_ATTENTION
SWMLA = KVCacheSpecKind.SLIDING_WINDOW_MLA
F32, F16, B16 = torch.float32, torch.float16, torch.bfloat16
CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "model-configs"

# (atol, rtol) between the backend's output and the reference backend's, keyed by the
# query dtype. fp32: accumulation order only (over up to 576 channels). fp16/bf16: both
# outputs are rounded to the dtype and the kernel rounds the softmax weights to it
# before P.V. An fp8 cache adds nothing: both sides read the same (dequantised) values.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


# ------------------------------------------------------------------ layers


@dataclasses.dataclass(frozen=True)
class Case:
    """One MLA layer: kind, sizes, dtypes and parameters.

    ``rank`` is ``R`` (kv_lora_rank, the value width), ``rope`` the rotary channels:
    the latent is ``D = R + rope`` wide. ``whole_latent``: ``v_head_size=None`` (the
    values are the whole latent). ``k_scale``: an fp8_e4m3 cache with that scale.
    """

    kind: KVCacheSpecKind = MLA
    dtype: torch.dtype = F16
    block_size: int = 16
    num_heads: int = 8
    rank: int = 32
    rope: int = 16
    window: int | None = None
    k_scale: float | None = None
    scale: float | None = None
    whole_latent: bool = False
    pass_value: bool = False  # pass the latents as ``value`` too
    query_gain: float = 1.0

    @property
    def head_size(self) -> int:
        return self.rank + self.rope

    @property
    def value_size(self) -> int:
        return self.head_size if self.whole_latent else self.rank

    @property
    def fp8(self) -> bool:
        return self.k_scale is not None

    @property
    def cache_dtype(self) -> torch.dtype:
        return FP8 if self.fp8 else self.dtype

    @property
    def tolerance(self) -> tuple[float, float]:
        return TOLERANCES[self.dtype]

    def spec(self, *, reference: bool = False) -> AttentionSpec:
        """The layer's spec; ``reference``: the same with a model-dtype cache."""
        common: dict[str, Any] = {
            "block_size": self.block_size,
            "head_size": self.head_size,
            "dtype": self.dtype,
            "kv_cache_dtype": "fp8_e4m3" if self.fp8 and not reference else "auto",
        }
        if self.kind is SWMLA:
            assert self.window is not None
            return SlidingWindowMLASpec(sliding_window=self.window, **common)
        return MLAAttentionSpec(**common)

    def params(self) -> AttentionLayerParams:
        return AttentionLayerParams(
            num_heads=self.num_heads,
            scale=self.scale,
            v_head_size=None if self.whole_latent else self.rank,
            k_scale=self.k_scale if self.k_scale is not None else 1.0,
        )


@dataclasses.dataclass
class Layer:
    """The backend's builder and impl for one layer, and the reference backend's."""

    case: Case
    builder: TritonMLAMetadataBuilder
    impl: TritonMLAImpl
    ref_builder: AttentionMetadataBuilder[Any, Any]
    ref_impl: AttentionImpl[Any]


def make_layer(case: Case, config: AttentionConfig = CONFIG) -> Layer:
    spec, params = case.spec(), case.params()
    binding = TritonMLABackend.get_binding(spec)
    builder = binding.create(spec, ["layers.0"], config, DEVICE)
    impl = binding.create_impl(spec, params)
    assert isinstance(builder, TritonMLAMetadataBuilder)
    assert isinstance(impl, TritonMLAImpl)
    ref_spec = case.spec(reference=True)
    ref_binding = ReferenceBackend.get_binding(ref_spec)
    ref_params = dataclasses.replace(params, k_scale=1.0)
    return Layer(
        case=case,
        builder=builder,
        impl=impl,
        ref_builder=ref_binding.create(ref_spec, ["layers.0"], config, DEVICE),
        ref_impl=ref_binding.create_impl(ref_spec, ref_params),
    )


@dataclasses.dataclass
class Caches:
    """The backend's latent cache and the reference's (model dtype), NaN but block 0."""

    test: torch.Tensor
    ref: torch.Tensor


def new_caches(case: Case, num_blocks: int) -> Caches:
    shape = (num_blocks, case.block_size, case.head_size)
    test = torch.full(shape, float("nan"), dtype=case.cache_dtype, device=DEVICE)
    test[0] = 0
    ref = torch.full(shape, float("nan"), dtype=case.dtype, device=DEVICE)
    ref[0] = 0
    return Caches(test, ref)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, gain: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * gain).to(DEVICE, dtype)


def as_cached(case: Case, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``latents`` as the backend's cache stores them, and as the reference sees them.

    fp8: ``latent / k_scale`` saturated and rounded to e4m3 (stored), and that times
    ``k_scale`` in the model dtype (exact for power-of-two scales).
    """
    if case.k_scale is None:
        return latents, latents
    stored = (latents.float() / case.k_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return stored, (stored.float() * case.k_scale).to(case.dtype)


def make_inputs(
    case: Case, num_tokens: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The absorbed query ``[T, H, D]`` and the new latents ``[T, 1, D]``."""
    query = randn(
        gen, num_tokens, case.num_heads, case.head_size, dtype=case.dtype, gain=case.query_gain
    )
    latents = randn(gen, num_tokens, 1, case.head_size, dtype=case.dtype)
    return query, latents


def write_context(case: Case, caches: Caches, slots: list[int], gen: torch.Generator) -> None:
    """Earlier steps' latents, written with plain indexing into both caches."""
    if not slots:
        return
    _, latents = make_inputs(case, len(slots), gen)
    stored, seen = as_cached(case, latents[:, 0])
    slot = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    bs = case.block_size
    caches.test[slot // bs, slot % bs] = stored
    caches.ref[slot // bs, slot % bs] = seen


def assert_caches_agree(case: Case, caches: Caches) -> None:
    if case.k_scale is None:
        assert torch.equal(caches.test.view(torch.uint8), caches.ref.view(torch.uint8)), (
            "caches differ"
        )
    else:
        read_back = caches.test.float() * case.k_scale
        torch.testing.assert_close(read_back, caches.ref.float(), atol=0, rtol=0, equal_nan=True)


def run_step(
    layer: Layer,
    cm: CommonAttentionMetadata,
    *,
    query: torch.Tensor,
    latents: torch.Tensor,
    caches: Caches,
    meta: TritonMLAMetadata | None = None,
    guard: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> TritonMLAMetadata:
    """One step through the backend and the reference backend; compare outputs and caches.

    ``meta``: metadata built beforehand (CUDA-graph builds); otherwise ``builder.build``.
    ``guard``: a context around the backend's ``forward`` alone.
    """
    case = layer.case
    n = cm.num_actual_tokens
    if meta is None:
        meta = layer.builder.build(0, cm)
    out_shape = (query.shape[0], case.num_heads, case.value_size)
    output = torch.full(out_shape, float("nan"), dtype=case.dtype, device=DEVICE)
    value = latents if case.pass_value else None
    with guard():
        returned = layer.impl.forward(query, latents, value, [caches.test], meta, output)
    assert returned is output

    _, seen = as_cached(case, latents)
    expected = torch.full_like(output, float("nan"))
    layer.ref_impl.forward(
        query.clone(), seen.clone(), None, [caches.ref], layer.ref_builder.build(0, cm), expected
    )

    assert_caches_agree(case, caches)
    assert not output[:n].isnan().any(), "some output rows were never written"
    atol, rtol = case.tolerance
    torch.testing.assert_close(output[:n].float(), expected[:n].float(), atol=atol, rtol=rtol)
    # Padding rows (past num_actual_tokens) are neither written to the cache nor output.
    assert output[n:].isnan().all()
    return meta


def first_visible(case: Case, context: int) -> int:
    """The first key position any query of a step starting at ``context`` can see."""
    if case.window is not None:
        return max(context - case.window + 1, 0)
    return 0


def slot_of(row: Sequence[int], position: int, block_size: int) -> int:
    return row[position // block_size] * block_size + position % block_size


def case_param(id: str, **fields: Any) -> Any:
    return pytest.param(Case(**fields), id=id)


# ------------------------------------------------------------------ multi-step

# Per step: request -> new tokens. "a" is prefilled in three chunks, then decodes; "b"
# finishes after step 2 and "d" (33 tokens, past a 32-token block) reuses its freed
# blocks, whose stale latents must stay invisible. Requests run in dict order, so
# decodes and prefills are mixed in every order.
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

MULTI_STEP_CASES = [
    case_param("mla-bs16-fp32", dtype=F32),
    case_param("mla-bs32-fp16-value-given", block_size=32, pass_value=True),
    case_param("mla-bs64-bf16-H1", block_size=64, dtype=B16, num_heads=1),
    case_param("mla-fp16-scale0.3-large-logits", scale=0.3, query_gain=4.0),
    case_param("mla-fp32-whole-latent-values", dtype=F32, whole_latent=True),
    case_param("swmla1-bs16-fp32", kind=SWMLA, window=1, dtype=F32),
    case_param("swmla7-bs16-bf16", kind=SWMLA, window=7, dtype=B16),
    case_param("swmla1000-bs32-fp16", kind=SWMLA, window=1000, block_size=32),
    case_param("fp8-fp16-bs16", k_scale=0.25),
    case_param("fp8-bf16-swmla9-bs32", kind=SWMLA, window=9, block_size=32, dtype=B16, k_scale=2.0),
    case_param("fp8-fp32-bs64", block_size=64, dtype=F32, k_scale=0.5),
]


def run_schedule(
    case: Case, schedule: list[dict[str, int]], finished: dict[int, list[str]], num_blocks: int
) -> dict[str, int]:
    """Run ``schedule`` over shuffled blocks; returns the released leading blocks per request."""
    layer = make_layer(case)
    bs = case.block_size
    gen = torch.Generator().manual_seed(1234)
    rng = random.Random(bs * 1000 + (case.window or 0))
    free = list(range(1, num_blocks))  # block 0 is the null block: never handed out
    rng.shuffle(free)
    caches = new_caches(case, num_blocks)

    blocks: dict[str, list[int]] = {}  # every block a request got, in logical order
    released: dict[str, int] = {}  # leading logical blocks read as 0 (out of the window)
    seq: dict[str, int] = {}
    for step, new_tokens in enumerate(schedule):
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
        query, latents = make_inputs(case, len(slots) + NUM_PADDING, gen)
        meta = run_step(layer, cm, query=query, latents=latents, caches=caches)
        assert meta.num_splits == 0  # num_sms is 1 off CUDA: the one-pass kernel
        for req in finished.get(step, []):
            # Freed blocks go back to the end of the queue: "d" reuses them.
            free.extend(blocks.pop(req))
            del seq[req]
    return released


@pytest.mark.parametrize("case", MULTI_STEP_CASES)
def test_chunked_prefill_then_decode_matches_reference(case: Case) -> None:
    released = run_schedule(case, SCHEDULE, FINISHED_AFTER, NUM_BLOCKS)
    if case.window == 1:
        assert released["a"] > 0, "the scenario should release blocks out of the window"


@pytest.mark.parametrize(
    "case",
    [
        case_param(
            "deepseek-v3-dims-bf16", dtype=B16, num_heads=4, rank=512, rope=64, scale=0.1352337789
        ),
        case_param(
            "deepseek-v3-dims-fp8-fp16-swmla",
            kind=SWMLA,
            window=20,
            num_heads=4,
            rank=512,
            rope=64,
            k_scale=0.5,
        ),
    ],
)
def test_deepseek_v3_latent_width_matches_reference(case: Case) -> None:
    """R=512 + rope 64 (D=576), DeepSeek-V3's split and scale, over a prefill in two
    chunks and a decode next to a short prefill."""
    schedule = [{"a": 24, "b": 3}, {"b": 1, "a": 9}, {"a": 1, "b": 2}]
    run_schedule(case, schedule, {}, 8)


# ------------------------------------------------------------------ split-KV decode


def decode_batch(
    case: Case, contexts: Sequence[int], caches: Caches, seed: int, num_padding: int = 1
) -> CommonAttentionMetadata:
    """A decode step (one new token each) after ``contexts`` tokens already in ``caches``."""
    bs = case.block_size
    physical = list(range(1, caches.test.shape[0]))
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
        slot_mapping=[*slots, *([-1] * num_padding)],
        device=DEVICE,
    )


def blocks_for(case: Case, contexts: Sequence[int]) -> int:
    return 1 + sum(-(-(c + 1) // case.block_size) for c in contexts)


# Long enough for 3 splits of >= 256 tokens at 132 SMs (choose_num_splits).
SPLIT_CONTEXTS = [800, 516]
SPLIT_CASES = [
    case_param("mla-fp16", num_heads=4),
    case_param("swmla50-fp32", kind=SWMLA, window=50, dtype=F32, num_heads=4),
    case_param("fp8-bf16-bs32", block_size=32, dtype=B16, num_heads=4, k_scale=0.25),
]


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_split_kv_decode_matches_reference(case: Case) -> None:
    layer = make_layer(case)
    caches = new_caches(case, blocks_for(case, SPLIT_CONTEXTS))
    cm = decode_batch(case, SPLIT_CONTEXTS, caches, seed=3)
    assert layer.builder.build(0, cm).num_splits == 0  # num_sms is 1 off CUDA
    layer.builder.num_sms = 132
    meta = layer.builder.build(0, cm)
    assert meta.num_splits == meta.plan.num_splits == 3
    query, latents = make_inputs(case, cm.slot_mapping.shape[0], torch.Generator().manual_seed(4))
    run_step(layer, cm, query=query, latents=latents, caches=caches, meta=meta)


@pytest.mark.parametrize(
    ("query_lens", "split"),
    [
        pytest.param([1, 1], True, id="decode"),
        pytest.param([1, 2], False, id="speculative-2-tokens"),
    ],
)
def test_split_kv_is_chosen_for_single_token_decodes(query_lens: list[int], split: bool) -> None:
    spec = Case().spec()
    builder = TritonMLABackend.get_binding(spec).create(spec, ["l"], CONFIG, DEVICE)
    assert isinstance(builder, TritonMLAMetadataBuilder)
    builder.num_sms = 132
    width = -(-801 // 16)
    cm = CommonAttentionMetadata.from_lists(
        query_lens=query_lens,
        seq_lens=[801, 517],
        block_table=[list(range(1, width + 1))] * 2,
        slot_mapping=[-1] * sum(query_lens),
        device=DEVICE,
    )
    assert (builder.build(0, cm).num_splits > 1) is split


# ------------------------------------------------------------------ ragged batches


def mixed_batch(
    case: Case,
    query_lens: list[int],
    seq_lens: list[int],
    caches: Caches,
    *,
    seed: int,
    num_padding: int,
) -> CommonAttentionMetadata:
    """A batch over shuffled blocks whose contexts are already in ``caches``."""
    bs = case.block_size
    physical = list(range(1, caches.test.shape[0]))
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


@settings(max_examples=6, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), min_size=1, max_size=4),
    kind=st.sampled_from([MLA, SWMLA]),
    window=st.sampled_from([1, 5, 16, 64]),
    block_size=st.sampled_from([16, 32, 64]),
    dtype=st.sampled_from([F32, F16, B16]),
    num_heads=st.sampled_from([1, 2, 8]),
    fp8=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_ragged_batches_match_reference(
    requests: list[tuple[int, int]],
    kind: KVCacheSpecKind,
    window: int,
    block_size: int,
    dtype: torch.dtype,
    num_heads: int,
    fp8: bool,
    seed: int,
) -> None:
    """One step of (context, new tokens) requests over a cache that already holds the
    context: empty requests, pure decodes and prefills in any order."""
    case = Case(
        kind=kind,
        dtype=dtype,
        block_size=block_size,
        num_heads=num_heads,
        rank=16,
        rope=16,
        window=window if kind is SWMLA else None,
        k_scale=0.5 if fp8 else None,
    )
    layer = make_layer(case)
    num_padding = seed % 3
    caches = new_caches(case, 1 + sum(-(-(c + q) // block_size) for c, q in requests))
    cm = mixed_batch(
        case,
        [q for _, q in requests],
        [c + q for c, q in requests],
        caches,
        seed=seed,
        num_padding=num_padding,
    )
    query, latents = make_inputs(
        case, cm.num_actual_tokens + num_padding, torch.Generator().manual_seed(seed)
    )
    run_step(layer, cm, query=query, latents=latents, caches=caches)


# ------------------------------------------------------------------ CUDA graphs (mechanics)

GRAPH_CONFIG = AttentionConfig(max_num_reqs=4, max_num_batched_tokens=16, max_model_len=128)
GRAPH_BLOCKS = 24
TENSOR_FIELDS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")


@pytest.mark.parametrize(
    "case",
    [
        case_param("mla-fp16", num_heads=4),
        case_param("fp8-swmla6-bf16", kind=SWMLA, window=6, dtype=B16, num_heads=4, k_scale=0.5),
    ],
)
def test_cudagraph_builds_reuse_fixed_addresses(case: Case) -> None:
    """Two batches of one shape (3 requests, 6 tokens + 2 padding) through the same buffers."""
    layer = make_layer(case, GRAPH_CONFIG)
    caches = new_caches(case, GRAPH_BLOCKS)
    gen = torch.Generator().manual_seed(11)

    cm1 = mixed_batch(case, [1, 3, 2], [17, 3, 40], caches, seed=1, num_padding=2)
    captured = layer.builder.build_for_cudagraph_capture(cm1)
    addresses = {name: getattr(captured, name).data_ptr() for name in TENSOR_FIELDS}
    query, latents = make_inputs(case, 8, gen)
    run_step(layer, cm1, query=query, latents=latents, caches=caches, meta=captured)

    # Same shape, other lengths and blocks (and a wider block table).
    cm2 = mixed_batch(case, [2, 1, 3], [5, 100, 3], caches, seed=2, num_padding=2)
    replay = layer.builder.build_for_cudagraph_capture(cm2)
    for name in TENSOR_FIELDS:
        assert getattr(replay, name).data_ptr() == addresses[name], name
    width = cm2.block_table_tensor.shape[1]
    assert width > cm1.block_table_tensor.shape[1]
    assert replay.block_table.shape == (3, 128 // case.block_size)  # the buffer's full width
    assert torch.equal(replay.block_table[:, :width], cm2.block_table_tensor)
    assert torch.equal(replay.slot_mapping, cm2.slot_mapping)
    # Everything but the tensors' contents depends on the batch's shape only.
    scalars = [f.name for f in dataclasses.fields(replay) if f.name not in (*TENSOR_FIELDS, "plan")]
    assert {n: getattr(replay, n) for n in scalars} == {n: getattr(captured, n) for n in scalars}
    plan_tensors = ("query_start_loc", "seq_lens", "block_table", "tile_offsets")
    plan_scalars = [f.name for f in dataclasses.fields(replay.plan) if f.name not in plan_tensors]
    assert {n: getattr(replay.plan, n) for n in plan_scalars} == {
        n: getattr(captured.plan, n) for n in plan_scalars
    }
    assert not replay.plan.exact_grid
    assert replay.plan.tile_offsets.data_ptr() == captured.plan.tile_offsets.data_ptr()
    assert (replay.max_query_len, replay.max_seq_len, replay.num_splits) == (6, 128, 0)

    # Replaying the captured metadata object runs the second batch.
    query, latents = make_inputs(case, 8, gen)
    run_step(layer, cm2, query=query, latents=latents, caches=caches, meta=captured)


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


@pytest.mark.parametrize("kind", [MLA, SWMLA], ids=lambda k: k.value)
def test_cudagraph_support_is_always(kind: KVCacheSpecKind) -> None:
    spec = Case(kind=kind, window=4).spec()
    support = TritonMLABackend.get_binding(spec).get_cudagraph_support(CONFIG, spec)
    assert support is AttentionCGSupport.ALWAYS


ALLOCATORS = ("empty", "zeros", "full", "tensor", "empty_like", "zeros_like", "full_like")


def forbid(*_: Any, **__: Any) -> Any:
    raise AssertionError("this path must not run")


@pytest.mark.parametrize(
    ("case", "split", "batches"),
    [
        pytest.param(Case(num_heads=2, k_scale=0.5), False, [[40, 3], [20, 33]], id="one-pass-fp8"),
        pytest.param(
            Case(num_heads=2, k_scale=0.5), True, [[800, 516], [780, 530]], id="split-fp8"
        ),
    ],
)
def test_second_forward_allocates_nothing(
    case: Case, split: bool, batches: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a first step, a step of the same shape allocates nothing in ``forward``: the
    fp8 scale tensor and the split-KV workspace are made once."""
    layer = make_layer(case)
    layer.builder.num_sms = 132

    @contextlib.contextmanager
    def no_allocation() -> Any:
        with monkeypatch.context() as patch:
            for name in ALLOCATORS:
                patch.setattr(torch, name, forbid)
            yield

    for step, lens in enumerate(batches):
        caches = new_caches(case, blocks_for(case, [800, 800]))
        cm = decode_batch(case, lens, caches, seed=step)
        meta = layer.builder.build(0, cm)
        assert (meta.num_splits > 1) is split
        query, latents = make_inputs(
            case, cm.slot_mapping.shape[0], torch.Generator().manual_seed(20 + step)
        )
        run_step(
            layer,
            cm,
            query=query,
            latents=latents,
            caches=caches,
            meta=meta,
            guard=no_allocation if step else contextlib.nullcontext,
        )


# ------------------------------------------------------------------ builder


def test_build_passes_the_batch_through_unchanged() -> None:
    case = Case(kind=SWMLA, window=9)
    layer = make_layer(case)
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[1, 4],
        seq_lens=[17, 4],
        block_table=[[3, 1], [2]],
        slot_mapping=[17, 32, 33, 34, 35, -1],
        device=DEVICE,
    )
    meta = layer.builder.build(0, cm)
    assert meta.query_start_loc is cm.query_start_loc
    assert meta.seq_lens is cm.seq_lens
    assert meta.block_table is cm.block_table_tensor
    assert meta.slot_mapping is cm.slot_mapping
    assert (meta.max_query_len, meta.max_seq_len, meta.num_actual_tokens) == (4, 17, 5)
    assert meta.sliding_window == meta.plan.sliding_window == 9
    assert (meta.plan.num_kv_heads, meta.plan.causal, meta.plan.chunk_size) == (1, True, None)
    assert meta.plan.block_size == case.block_size
    # Decodes first: request 0 continues 16 cached tokens with one; request 1 is new.
    assert TritonMLAMetadataBuilder.reorder_batch_threshold == DECODE_THRESHOLD
    assert (meta.num_decodes, meta.num_decode_tokens) == (1, 1)
    assert meta.decode_plan is not None
    assert meta.decode_plan.num_reqs == 1
    assert meta.prefill is not None
    assert meta.prefill.block_ids.tolist() == [2]  # request 1's only block
    assert (meta.prefill.num_tokens, meta.prefill.context_tokens) == (4, case.block_size)
    assert meta.prefill.pairs == 1 + 2 + 3 + 4  # causal, all inside the window of 9
    assert meta.prefill.plan.block_table.tolist() == [[0]]


def test_build_rejects_a_non_causal_batch() -> None:
    layer = make_layer(Case())
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[2],
        seq_lens=[2],
        block_table=[[1]],
        slot_mapping=[16, 17],
        device=DEVICE,
        causal=False,
    )
    match = r"^TritonMLAMetadataBuilder: a mla_attention group needs causal=True, got causal=False$"
    with pytest.raises(ValueError, match=match):
        layer.builder.build(0, cm)
    with pytest.raises(ValueError, match=match):
        layer.builder.build_for_cudagraph_capture(cm)


# ------------------------------------------------------------------ impl: layer params


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        pytest.param(
            {"logits_soft_cap": 30.0},
            "the layer needs logits_soft_cap, which triton_mla does not support "
            "(supported features: mla_projection, sparse_attention)",
            id="soft-cap",
        ),
        pytest.param(
            {"alibi_slopes": tuple([0.5] * 8)},
            "the layer needs alibi, which triton_mla does not support (supported features: mla_projection, sparse_attention)",
            id="alibi",
        ),
        pytest.param(
            {"sinks": torch.zeros(8)},
            "the layer needs attention_sinks, which triton_mla does not support "
            "(supported features: mla_projection, sparse_attention)",
            id="sink-logits",
        ),
        pytest.param(
            {"return_lse": True},
            "the layer needs return_lse, which triton_mla does not support "
            "(supported features: mla_projection, sparse_attention)",
            id="return-lse",
        ),
        pytest.param(
            {"v_head_size": 49},
            "v_head_size (the kv_lora_rank) must be at most the latent width head_size=48, got 49",
            id="values-wider-than-the-latent",
        ),
        pytest.param(
            {"sink_key": torch.zeros(2, 1, 48), "sink_value": torch.zeros(2, 1, 48)},
            "sink tokens (sink_key/sink_value) are not supported",
            id="sink-tokens",
        ),
    ],
)
def test_impl_rejects_unusable_layer_params(changes: dict[str, Any], message: str) -> None:
    case = Case()
    params = dataclasses.replace(case.params(), **changes)
    with pytest.raises(ValueError, match=r"^TritonMLAImpl: ") as info:
        TritonMLAImpl(case.spec(), params)
    assert str(info.value) == f"TritonMLAImpl: {message}"


def test_impl_scale_and_rank_defaults() -> None:
    """Scale: ``layer_params.scale``, else ``D ** -0.5`` over the whole latent (as the
    reference backend); rank: ``v_head_size``, else the whole latent."""
    spec = Case(rank=512, rope=64).spec()
    impl = TritonMLAImpl(spec, AttentionLayerParams(num_heads=4, v_head_size=512))
    assert impl.scale == pytest.approx(576**-0.5)
    assert impl.kv_lora_rank == 512
    impl = TritonMLAImpl(spec, AttentionLayerParams(num_heads=4, scale=0.135))
    assert impl.scale == 0.135
    assert impl.kv_lora_rank == 576


# ------------------------------------------------------------------ impl: forward inputs


def _forward_args(case: Case) -> dict[str, Any]:
    layer = make_layer(case)
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[2], seq_lens=[2], block_table=[[1]], slot_mapping=[16, 17], device=DEVICE
    )
    query, latents = make_inputs(case, 2, torch.Generator().manual_seed(0))
    return {
        "impl": layer.impl,
        "query": query,
        "key": latents,
        "value": None,
        "kv_cache": [new_caches(case, 2).test],
        "attn_metadata": layer.builder.build(0, cm),
        "output": torch.empty(2, case.num_heads, case.rank, dtype=case.dtype, device=DEVICE),
    }


OWNER = "TritonMLAImpl.forward (mla_attention)"


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        pytest.param(
            lambda a: a.update(key=None),
            TypeError,
            f"{OWNER}: key (the new latents) must be a torch.Tensor [T, 1, D], got None",
            id="no-latents",
        ),
        pytest.param(
            lambda a: a.update(kv_cache=[*a["kv_cache"], *a["kv_cache"]]),
            ValueError,
            f"{OWNER}: kv_cache must hold 1 tensor, got 2",
            id="two-caches",
        ),
        pytest.param(
            lambda a: a.update(kv_cache=[torch.zeros(2, 2, 16, 1, 48, dtype=F16, device=DEVICE)]),
            ValueError,
            f"{OWNER}: kv_cache[0] must be float16 [NB, BS, D]=[*, 16, 48] on {DEVICE}, "
            f"got float16 [2, 2, 16, 1, 48] on {DEVICE}",
            id="kv-cache-layout",
        ),
        pytest.param(
            lambda a: a.update(kv_cache=[a["kv_cache"][0].float()]),
            ValueError,
            f"{OWNER}: kv_cache[0] must be float16 [NB, BS, D]=[*, 16, 48] on {DEVICE}, "
            f"got float32 [2, 16, 48] on {DEVICE}",
            id="kv-cache-dtype",
        ),
        pytest.param(
            lambda a: a.update(attn_metadata=object()),
            TypeError,
            f"{OWNER}: attn_metadata must be TritonMLAMetadata, got object",
            id="metadata-type",
        ),
    ],
)
def test_forward_rejects_bad_inputs(
    change: Callable[[dict[str, Any]], None], error: type[Exception], message: str
) -> None:
    """The impl's own rules (its metadata, the latent cache); the query, latents and
    output are checked by the runtime before it runs (the next test)."""
    args = _forward_args(Case())
    change(args)
    impl = args.pop("impl")
    with pytest.raises(error) as info:
        impl.forward(**args)
    assert str(info.value) == message


def _on(device: torch.device) -> str:
    """The device as the runtime names it (a bare ``cuda`` gets its index)."""
    return str(torch.empty(0, device=device).device)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param(
            lambda a: a.update(key=a["query"]),
            "mla: key (the new latents) has Hkv=8, the layer takes 1 (one latent per token, "
            "read by every head); key (the new latents) must be float16 [T, Hkv, D]=[2, 1, 48] "
            "on {dev}, got float16 [2, 8, 48] on {dev}",
            id="per-head-keys",
        ),
        pytest.param(
            lambda a: a.update(value=a["key"][:, :, :32]),
            "mla: value (None or the latents again) has D=32, the layer takes 48 (the spec's "
            "head_size); value (None or the latents again) must be float16 [T, Hkv, D]="
            "[2, 1, 48] on {dev}, got float16 [2, 1, 32] on {dev}",
            id="value-planes",
        ),
        pytest.param(
            lambda a: a.update(query=a["query"].float()),
            "mla: query is float32, the layer's dtype float16; query must be float16 "
            "[T, Hq, D]=[>=2, 8, 48] on {dev}, got float32 [2, 8, 48] on {dev}",
            id="query-dtype",
        ),
        pytest.param(
            lambda a: a.update(query=a["query"][:, :, :32]),
            "mla: query has D=32, the layer takes 48 (the spec's head_size); query must be "
            "float16 [T, Hq, D]=[>=2, 8, 48] on {dev}, got float16 [2, 8, 32] on {dev}",
            id="query-not-absorbed",
        ),
        pytest.param(
            lambda a: a.update(output=torch.empty(2, 8, 48, dtype=F16, device=DEVICE)),
            "mla: output has Dv=48, the layer takes 32 (layer_params.v_head_size); output must "
            "be float16 [T, Hq, Dv]=[2, 8, 32] on {dev}, got float16 [2, 8, 48] on {dev}",
            id="output-as-wide-as-the-latent",
        ),
        pytest.param(
            lambda a: a.update(query=a["query"][:1], key=a["key"][:1], output=a["output"][:1]),
            "mla: query has 1 rows but the step has 2 tokens; query must be float16 "
            "[T, Hq, D]=[>=2, 8, 48] on {dev}, got float16 [1, 8, 48] on {dev}",
            id="too-few-rows",
        ),
        pytest.param(
            lambda a: a.update(key=None),
            "mla: key (the new latents) must be float16 [T, Hkv, D]=[2, 1, 48] on {dev}, got None",
            id="no-latents",
        ),
    ],
)
def test_the_runtime_rejects_bad_inputs_before_the_impl_runs(
    change: Callable[[dict[str, Any]], None], message: str
) -> None:
    """Query, latents and output are checked against the layer by the runtime (the
    messages name the caller's argument); the cache is left as it was."""
    from attnkit import AttentionRuntime, InvalidArgumentError
    from attnkit.runtime import ScheduledRequest

    case = Case()
    reg = _registry()
    config = AttentionConfig.model_validate({"backend": "triton_mla"}, context={"registry": reg})
    rt = AttentionRuntime(
        {"mla": case.spec()},
        config,
        device=DEVICE,
        memory_budget_bytes=2**20,
        layer_params={"mla": case.params()},
        registry=reg,
        cache_fill=float("nan"),
    )
    assert rt.routing_table()[0].backend == "triton_mla"
    rt.begin_step([ScheduledRequest("a", 2)])
    query, latents = make_inputs(case, 2, torch.Generator().manual_seed(0))
    args: dict[str, Any] = {
        "query": query,
        "key": latents,
        "value": None,
        "output": torch.empty(2, case.num_heads, case.rank, dtype=case.dtype, device=DEVICE),
    }
    change(args)
    before = rt.kv_caches["mla"][0].view(torch.uint8).clone()
    with pytest.raises(InvalidArgumentError) as info:
        rt.forward("mla", **args)
    assert str(info.value) == message.format(dev=_on(DEVICE))
    assert torch.equal(rt.kv_caches["mla"][0].view(torch.uint8), before)


# ------------------------------------------------------------------ declarations, selection


def _request(**changes: Any) -> BackendRequest:
    spec_fields = {
        k: changes.pop(k)
        for k in list(changes)
        if k in ("block_size", "head_size", "dtype", "kv_cache_dtype")
    }
    spec = MLAAttentionSpec(**{"block_size": 16, "head_size": 576, "dtype": B16, **spec_fields})
    return BackendRequest(
        spec=spec,
        device=torch.device(changes.pop("device", "cuda")),
        capability=changes.pop("capability", (9, 0)),
        **changes,
    )


def test_declarations_are_valid() -> None:
    assert TritonMLABackend.declaration_problems() == []
    assert TritonMLABackend.supported_kinds() == {MLA, SWMLA, KVCacheSpecKind.INDEXER}
    assert BUILTIN_BACKENDS["triton_mla"] == "attnkit.backends.triton_mla:TritonMLABackend"
    cuda = DEFAULT_PRIORITY["cuda"]
    assert cuda.index("triton_mla") == cuda.index("triton_attn") + 1 < cuda.index("reference")
    assert "triton_mla" not in DEFAULT_PRIORITY["cpu"]


def test_supported_requests_have_no_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for dtype in (F32, F16, B16):
        for block_size in (16, 32, 64, 128):
            for head_size in (16, 48, 576, 1024):
                for kv in ("auto", "fp8_e4m3"):
                    request = _request(
                        dtype=dtype,
                        block_size=block_size,
                        head_size=head_size,
                        kv_cache_dtype=kv,
                        num_heads=128,
                    )
                    assert TritonMLABackend.not_supported_reasons(request) == []
    sliding = SlidingWindowMLASpec(block_size=16, head_size=48, dtype=F16, sliding_window=128)
    assert (
        TritonMLABackend.not_supported_reasons(
            BackendRequest(spec=sliding, device=torch.device("cpu"))
        )
        == []
    )


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        pytest.param(
            {"block_size": 8},
            "block_size=8 not supported (supported: 16, 32, 64, 128)",
            id="block-8",
        ),
        pytest.param(
            {"head_size": 1040},
            "head_size=1040 not supported (supported: 16 to 1024)",
            id="head-1040",
        ),
        pytest.param(
            {"kv_cache_dtype": "fp8_e4m3", "capability": (8, 0)},
            "kv_cache_dtype='fp8_e4m3' needs compute capability >= 8.9 (Triton has no e4m3 "
            "type before sm_89), got 8.0",
            id="fp8-on-sm80",
        ),
        pytest.param(
            {"features": frozenset({AttentionFeature.LOGITS_SOFT_CAP})},
            "feature logits_soft_cap not supported (supported: mla_projection, sparse_attention)",
            id="soft-cap",
        ),
    ],
)
def test_not_supported_reasons_are_exact(changes: dict[str, Any], reason: str) -> None:
    assert TritonMLABackend.not_supported_reasons(_request(**changes)) == [reason]


@pytest.mark.parametrize("value", ["", "0", "false"])
def test_cpu_needs_the_interpreter(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert TritonMLABackend.not_supported_reasons(_request(device="cpu", capability=None)) == [
        "device=cpu needs the Triton interpreter (set TRITON_INTERPRET=1 before importing triton)"
    ]


def test_importing_the_backend_does_not_import_triton() -> None:
    code = textwrap.dedent(
        """
        import sys
        import attnkit.backends.triton_mla as b
        assert b.TritonMLABackend.name == "triton_mla"
        bad = sorted(m for m in sys.modules if m == "triton" or m.startswith("triton.")
                     or m.startswith("attnkit.kernels.mla.triton"))
        assert not bad, bad
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def _registry() -> BackendRegistry:
    return BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_default_priority_routes_deepseek_v3_to_triton_mla_on_a_hypothetical_gpu() -> None:
    """On an H100 (9.0), planned from this CPU machine: DeepSeek-V3's 61 MLA layers (one
    576-wide latent, 128 heads) go to triton_mla, ahead of reference; with an fp8 cache on
    an A100 (8.0) triton_mla says why not."""
    reg = _registry()
    config = AttentionConfig.model_validate({}, context={"registry": reg})
    layout = layout_from_hf_config(CONFIGS / "deepseek-v3.json")
    specs = {info.spec for info in layout.layers.values()}
    assert specs == {MLAAttentionSpec(block_size=16, head_size=576, dtype=B16)}
    params = next(iter(layout.layers.values())).attention_params()
    assert (params.num_heads, params.v_head_size) == (128, 512)
    (spec,) = specs
    chosen = select_backend(
        spec,
        config,
        device="cuda",
        capability=(9, 0),
        registry=reg,
        hypothetical_device=True,
        features=params.features,
        num_heads=params.num_heads,
    )
    assert chosen.backend_name == "triton_mla"
    fp8 = dataclasses.replace(spec, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(NoBackendError) as info:
        select_backend(
            fp8, config, device="cuda", capability=(8, 0), registry=reg, hypothetical_device=True
        )
    rejected = {r.backend: r.reasons for r in info.value.rejected}
    assert list(rejected["triton_mla"]) == [
        "kv_cache_dtype='fp8_e4m3' needs compute capability >= 8.9 (Triton has no e4m3 type "
        "before sm_89), got 8.0"
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_attnkit_plan_routes_deepseek_v3_to_triton_mla() -> None:
    out, err = io.StringIO(), io.StringIO()
    argv = [
        "plan",
        str(CONFIGS / "deepseek-v3.json"),
        "--device",
        "cuda",
        "--capability",
        "9.0",
        "--json",
    ]
    status = main(argv, registry=_registry(), out=out, err=err)
    assert status == 0, err.getvalue()
    plan = json.loads(out.getvalue())
    backends = {layer["backend"] for layer in plan["layers"]}
    assert backends == {"triton_mla"}
    assert len(plan["layers"]) == 61


def test_cpu_routing_is_unchanged() -> None:
    """On CPU triton_mla is not in the priority list: MLA layers go to cpu_mla (the CPU
    engines) without the Triton interpreter being asked."""
    reg = _registry()
    config = AttentionConfig.model_validate({}, context={"registry": reg})
    spec = MLAAttentionSpec(block_size=16, head_size=48, dtype=F16)
    assert select_backend(spec, config, device="cpu", registry=reg).backend_name == "cpu_mla"


def test_declarations_agree_with_the_kernel_launchers() -> None:
    from attnkit.backends.triton_mla import backend
    from attnkit.capabilities import SizeRange
    from attnkit.kernels.mla import triton as mla_attention

    assert backend._BLOCK_SIZES == mla_attention.SUPPORTED_BLOCK_SIZES
    assert (SizeRange(16, mla_attention.MAX_LATENT_DIM),) == backend._HEAD_SIZES


# ------------------------------------------------------------------ through the runtime


def test_runtime_routes_mla_kinds_to_triton_mla_and_matches_reference() -> None:
    """An ``AttentionRuntime`` with ``backend_per_kind`` naming triton_mla for both MLA
    kinds (shuffled block pools, NaN-filled caches) against one on the reference backend:
    chunked prefills, decodes and a finished request whose blocks are reused."""
    from attnkit import AttentionRuntime
    from attnkit.runtime import ScheduledRequest

    reg = _registry()
    rank, rope, heads = 32, 16, 4
    d = rank + rope
    specs = {
        "layers.0": MLAAttentionSpec(block_size=16, head_size=d, dtype=F16),
        "layers.1": SlidingWindowMLASpec(block_size=16, head_size=d, dtype=F16, sliding_window=7),
    }
    params = {name: AttentionLayerParams(num_heads=heads, v_head_size=rank) for name in specs}

    def runtime(per_kind: dict[str, str], seed: int) -> AttentionRuntime:
        config = AttentionConfig.model_validate(
            {"backend_per_kind": per_kind}, context={"registry": reg}
        )
        rt = AttentionRuntime(
            specs,
            config,
            device=DEVICE,
            memory_budget_bytes=2**20,
            layer_params=params,
            registry=reg,
            cache_fill=float("nan"),
        )
        random.Random(seed).shuffle(rt.manager.pool._free)
        return rt

    test = runtime({"mla_attention": "triton_mla", "sliding_window_mla": "triton_mla"}, 1)
    ref = runtime({"mla_attention": "reference", "sliding_window_mla": "reference"}, 2)
    assert {row.backend for row in test.routing_table()} == {"triton_mla"}
    steps: list[tuple[dict[str, int], list[str]]] = [
        ({"a": 20, "b": 5}, []),
        ({"a": 1, "b": 9, "c": 3}, []),
        ({"c": 1, "a": 1, "b": 1}, []),
        ({"a": 1, "d": 17}, ["b", "c"]),
        ({"d": 1, "a": 1}, []),
    ]
    gen = torch.Generator().manual_seed(7)
    for scheduled, finished in steps:
        requests = [ScheduledRequest(rid, n) for rid, n in scheduled.items()]
        batch = test.begin_step(requests, finished=finished)
        assert ref.begin_step(requests, finished=finished).order == batch.order
        for name in specs:
            query = randn(gen, batch.num_tokens, heads, d, dtype=F16)
            latents = randn(gen, batch.num_tokens, 1, d, dtype=F16)
            got = test.forward(name, query, latents, None)
            expected = ref.forward(name, query.clone(), latents.clone(), None)
            assert got.shape == (batch.num_tokens, heads, rank)
            torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


def test_conformance_kit_passes_for_both_mla_kinds() -> None:
    """The conformance kit's checks of what triton_mla declares, for both MLA kinds
    (CUDA-graph builds included). The fp8 cache is skipped by the kit (the reference
    backend does not serve fp8 MLA), and checked in this file against dequantised
    latents."""
    from attnkit.testing import check_backend

    report = check_backend(
        _registry().get("triton_mla"), kinds=["mla_attention", "sliding_window_mla"]
    )
    report.assert_ok()
    passed = {r.capability for r in report.results if r.status == "passed"}
    assert {
        "kind=mla_attention",
        "kind=sliding_window_mla",
        "long_context dtype=float16 (mla_attention)",
        "long_context dtype=bfloat16 (sliding_window_mla)",
        "cudagraph=ALWAYS (mla_attention)",
        "cudagraph=ALWAYS (sliding_window_mla)",
    } <= passed
    # Sizes and dtypes are varied on both kinds, not only the first.
    choices = [r.choice for r in report.results if r.status == "passed" and r.choice is not None]
    for kind in ("mla_attention", "sliding_window_mla"):
        mine = [c for c in choices if c.kind.value == kind]
        assert {64, 80, 96} <= {c.head_size for c in mine}, kind
        assert {64, 128} <= {c.block_size for c in mine}, kind
        assert {torch.float16, torch.bfloat16} <= {c.dtype for c in mine}, kind
        assert any(c.scale is not None for c in mine), kind
