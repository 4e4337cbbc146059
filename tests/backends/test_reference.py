"""The reference backend against dense, cache-free float64 computations.

The reference backend is the oracle for every other backend, so here it is checked
against computations that share none of its code: for each request the test builds
the whole key/value sequence and the mask explicitly, in float64, with plain loops.
Batches are built by hand over several steps (prefill in chunks, then decodes, the
test appending block-table entries as a runtime would), physical blocks are handed
out in a shuffled order (block 0 is the null block), caches start as NaN and output
buffers are NaN, so a row that is not written or a slot read before it is written
shows up as NaN.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections.abc import Sequence

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
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    GatedDeltaNetInputs,
    GatedDeltaNetLayerParams,
    IndexerSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    Mamba2Inputs,
    Mamba2LayerParams,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    select_backend,
)
from attnkit.backend_api import BackendRequest, CommonAttentionMetadata
from attnkit.backends.reference import (
    ReferenceAttentionBuilder,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
    ReferenceBackend,
    ReferenceStateBuilder,
    ReferenceStateImpl,
    ReferenceStateMetadata,
)

CPU = torch.device("cpu")
CONFIG = AttentionConfig.model_validate({}, context={"known_backends": []})
NAN = float("nan")

TOL: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 2.5e-2, "rtol": 2.5e-2},
}
"""Output vs the float64 oracle, per model dtype (the output is rounded to it)."""

MAMBA_TOL_FACTOR = 4.0
"""Mamba2 rounds the conv output to the model dtype before the SSD: a few more ulps."""

MLA_KINDS = frozenset({KVCacheSpecKind.MLA_ATTENTION, KVCacheSpecKind.SLIDING_WINDOW_MLA})
WINDOW_KINDS = frozenset({KVCacheSpecKind.SLIDING_WINDOW, KVCacheSpecKind.SLIDING_WINDOW_MLA})
BIDIRECTIONAL_KINDS = frozenset(
    {KVCacheSpecKind.ENCODER_ONLY_ATTENTION, KVCacheSpecKind.CROSS_ATTENTION}
)

# A ragged multi-step schedule: steps[s][r] = new tokens of request r at step s (0: not
# scheduled). Request 0 prefills in two chunks then decodes; request 1 decodes from
# step 1 and verifies 2 tokens at the end; request 2 arrives at step 1.
MIXED = ((7, 3, 0), (5, 1, 9), (1, 1, 4), (1, 2, 1))


# ----------------------------------------------------------------------------------
# The dense float64 oracle (no cache, no kernel code)
# ----------------------------------------------------------------------------------


def dense_oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: Sequence[int],
    causal: bool,
    scale: float,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    alibi: Sequence[float] | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 ``[Tq, Hq, Dv]``: query ``t`` at position ``q_positions[t]`` over keys at ``0..Tk-1``.

    ``q`` ``[Tq, Hq, D]``, ``k`` ``[Tk, Hkv, D]``, ``v`` ``[Tk, Hkv, Dv]``.
    """
    q, k, v = q.double(), k.double(), v.double()
    num_q, num_heads, _ = q.shape
    num_keys, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(num_q, num_heads, v.shape[-1], dtype=torch.float64)
    for t in range(num_q):
        i = q_positions[t]
        visible = []
        for j in range(num_keys):
            ok = True
            if causal:
                ok = j <= i
                if window is not None:
                    ok = ok and i - j < window
                if chunk is not None:
                    ok = ok and j // chunk == i // chunk
            visible.append(ok)
        mask = torch.tensor(visible, dtype=torch.bool)
        for h in range(num_heads):
            kv_head = h // group
            scores = (k[:, kv_head] @ q[t, h]) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if alibi is not None:
                scores = scores + alibi[h] * (torch.arange(num_keys, dtype=torch.float64) - i)
            scores = scores.masked_fill(~mask, -math.inf)
            if sinks is not None:
                scores = torch.cat([scores, sinks[h : h + 1].double()])
            probs = torch.softmax(scores, dim=0)[:num_keys]
            out[t, h] = probs @ v[:, kv_head]
    return out


# ----------------------------------------------------------------------------------
# Attention harness
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttnCase:
    kind: KVCacheSpecKind
    steps: tuple[tuple[int, ...], ...] = MIXED
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 8
    block_size: int = 4
    dtype: torch.dtype = torch.float32
    kv_cache_dtype: str = "auto"
    window: int | None = None
    chunk: int | None = None
    sink_len: int = 0
    v_head_size: int | None = None
    mla_value: bool = False
    encoder_lens: tuple[int, ...] = ()
    softcap: float | None = None
    alibi: bool = False
    sinks: bool = False
    scale: float | None = None
    pad: int = 2
    strided: bool = False


def make_spec(case: AttnCase) -> AttentionSpec:
    common = {
        "block_size": case.block_size,
        "head_size": case.head_size,
        "dtype": case.dtype,
        "kv_cache_dtype": case.kv_cache_dtype,
    }
    kind = case.kind
    if kind is KVCacheSpecKind.MLA_ATTENTION:
        return MLAAttentionSpec(**common)
    if kind is KVCacheSpecKind.SLIDING_WINDOW_MLA:
        assert case.window is not None
        return SlidingWindowMLASpec(**common, sliding_window=case.window)
    common["num_kv_heads"] = case.num_kv_heads
    if kind is KVCacheSpecKind.FULL_ATTENTION:
        return FullAttentionSpec(**common)
    if kind is KVCacheSpecKind.SLIDING_WINDOW:
        assert case.window is not None
        return SlidingWindowSpec(**common, sliding_window=case.window)
    if kind is KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION:
        assert case.chunk is not None
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=case.chunk)
    if kind is KVCacheSpecKind.SINK_FULL_ATTENTION:
        return SinkFullAttentionSpec(**common, sink_len=case.sink_len)
    if kind is KVCacheSpecKind.ENCODER_ONLY_ATTENTION:
        return EncoderOnlyAttentionSpec(**common)
    assert kind is KVCacheSpecKind.CROSS_ATTENTION
    return CrossAttentionSpec(**common)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def make_caches(
    spec: KVCacheSpec,
    num_blocks: int,
    dtypes: Sequence[torch.dtype],
    *,
    strided: bool,
    device: torch.device = CPU,
) -> list[torch.Tensor]:
    """NaN-filled caches; ``strided``: views into one larger page per block, as a runtime
    that packs several tensors into one page hands them out (non-contiguous)."""
    shapes = ReferenceBackend.get_kv_cache_shapes(num_blocks, spec)
    if not strided:
        return [
            torch.full(s, NAN, dtype=d, device=device) for s, d in zip(shapes, dtypes, strict=True)
        ]
    # Page layout: [16 spare bytes | tensor 0 | tensor 1 | ... | 16 spare bytes], each
    # tensor aligned to 16 bytes.
    sizes = [math.prod(s[1:]) * d.itemsize for s, d in zip(shapes, dtypes, strict=True)]
    offsets, pos = [], 16
    for size in sizes:
        offsets.append(pos)
        pos += -(-size // 16) * 16
    page = torch.zeros(num_blocks, pos + 16, dtype=torch.uint8, device=device)
    views = []
    for shape, dtype, off, size in zip(shapes, dtypes, offsets, sizes, strict=True):
        view = page[:, off : off + size].view(dtype).view(num_blocks, *shape[1:])
        assert not view.is_contiguous()
        view.fill_(NAN)
        views.append(view)
    return views


def release_dead_blocks(case: AttnCase, table: list[int], seq_len: int, pool: list[int]) -> None:
    """Blocks no later query can see go back to the pool and read as 0 (the null block)."""
    if case.kind in WINDOW_KINDS:
        assert case.window is not None
        first_live = seq_len - case.window + 1  # the next query sits at position seq_len
    elif case.kind is KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION:
        assert case.chunk is not None
        first_live = (seq_len // case.chunk) * case.chunk
    else:
        return
    for i, block in enumerate(table):
        if block != 0 and (i + 1) * case.block_size <= first_live:
            pool.append(block)
            table[i] = 0


def slot_of(table: list[int], position: int, block_size: int) -> int:
    return table[position // block_size] * block_size + position % block_size


def run_attention_case(case: AttnCase, seed: int = 0, device: torch.device = CPU) -> None:
    """Run ``case`` step by step through the backend and check every output row.

    Inputs are made on the CPU (same values on every device) and moved to ``device``.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    kind = case.kind
    spec = make_spec(case)
    is_mla = kind in MLA_KINDS
    heads, kv_heads, d = case.num_heads, spec.num_kv_heads, case.head_size
    dv = case.v_head_size if case.v_head_size is not None else d
    scale = case.scale if case.scale is not None else d**-0.5
    alibi = tuple(2.0 ** -(h + 1) for h in range(heads)) if case.alibi else None
    sinks = randn(gen, heads) if case.sinks else None
    sink_key = randn(gen, case.sink_len, kv_heads, d, dtype=case.dtype) if case.sink_len else None
    sink_value = randn(gen, case.sink_len, kv_heads, d, dtype=case.dtype) if case.sink_len else None
    params = AttentionLayerParams(
        num_heads=heads,
        scale=case.scale,
        logits_soft_cap=case.softcap,
        alibi_slopes=alibi,
        sinks=sinks,
        v_head_size=case.v_head_size,
        sink_key=sink_key,
        sink_value=sink_value,
    )
    assert not ReferenceBackend.not_supported_reasons(
        BackendRequest(spec=spec, device=CPU, features=params.features, num_heads=heads)
    )
    binding = ReferenceBackend.get_binding(spec)
    builder = binding.create(spec, ["layers.0.attn"], CONFIG, device)
    impl = binding.create_impl(spec, params)

    num_reqs = len(case.steps[0])
    lengths = [sum(step[r] for step in case.steps) for r in range(num_reqs)]
    q_all = [randn(gen, n, heads, d, dtype=case.dtype) for n in lengths]
    k_all = [randn(gen, n, kv_heads, d, dtype=case.dtype) for n in lengths]  # MLA: latents
    v_all = [randn(gen, n, kv_heads, d, dtype=case.dtype) for n in lengths]
    enc_lens = case.encoder_lens or (0,) * num_reqs
    enc_k = [randn(gen, e, kv_heads, d, dtype=case.dtype) for e in enc_lens]
    enc_v = [randn(gen, e, kv_heads, d, dtype=case.dtype) for e in enc_lens]

    # What the oracle reads: keys/values as the cache stores them.
    def stored(t: torch.Tensor) -> torch.Tensor:
        return t.to(spec.cache_torch_dtype).double()

    bs = case.block_size
    cached = [case.sink_len + n for n in lengths] if not case.encoder_lens else list(enc_lens)
    num_blocks = sum(-(-n // bs) for n in cached) + 4
    pool = list(range(1, num_blocks))  # block 0 is never handed out
    rng.shuffle(pool)
    cache_dtypes = [spec.cache_torch_dtype] * (
        0 if kind is KVCacheSpecKind.ENCODER_ONLY_ATTENTION else 1
    )
    caches = make_caches(spec, num_blocks, cache_dtypes, strided=case.strided, device=device)
    for cache in caches:
        # The null block reads as zeros (see test_nan_in_the_null_block_does_not_leak).
        cache[0] = 0
    tables: list[list[int]] = [[] for _ in range(num_reqs)]
    done = [0] * num_reqs

    def grow(r: int, tokens: int) -> None:
        while len(tables[r]) * bs < tokens:
            tables[r].append(pool.pop())

    for s, step in enumerate(case.steps):
        batch = [r for r in range(num_reqs) if step[r] > 0]
        if s % 2:
            batch.reverse()  # no order is assumed
        q_rows, k_rows, v_rows, slots, seq_lens = [], [], [], [], []
        enc_k_rows, enc_v_rows, enc_slots = [], [], []
        for r in batch:
            n, start = step[r], done[r]
            q_rows.append(q_all[r][start : start + n])
            k_rows.append(k_all[r][start : start + n])
            v_rows.append(v_all[r][start : start + n])
            if kind is KVCacheSpecKind.ENCODER_ONLY_ATTENTION:
                assert start == 0, "an encoder-only request is encoded in one step"
                seq_lens.append(n)
                slots.extend([-1] * n)
            elif kind is KVCacheSpecKind.CROSS_ATTENTION:
                seq_lens.append(enc_lens[r])
                slots.extend([-1] * n)
                if start == 0:
                    grow(r, enc_lens[r])
                    enc_k_rows.append(enc_k[r])
                    enc_v_rows.append(enc_v[r])
                    enc_slots.extend(slot_of(tables[r], p, bs) for p in range(enc_lens[r]))
            else:
                first = case.sink_len + start
                grow(r, first + n)
                seq_lens.append(first + n)
                slots.extend(slot_of(tables[r], first + t, bs) for t in range(n))
        num_tokens = sum(step[r] for r in batch)
        pad_q = randn(gen, case.pad, heads, d, dtype=case.dtype)
        query = torch.cat([*q_rows, pad_q])
        key: torch.Tensor | None
        value: torch.Tensor | None
        if kind is KVCacheSpecKind.CROSS_ATTENTION:
            key = torch.cat(enc_k_rows) if enc_k_rows else None
            value = torch.cat(enc_v_rows) if enc_v_rows else None
            width = max(num_tokens + case.pad, len(enc_slots))
            slot_mapping = enc_slots + [-1] * (width - len(enc_slots))
        else:
            pad_kv = randn(gen, case.pad, kv_heads, d, dtype=case.dtype)
            key = torch.cat([*k_rows, pad_kv])
            value = torch.cat([*v_rows, pad_kv])
            if is_mla:
                key = key[:, :1]
                value = key if case.mla_value else None
            slot_mapping = slots + [-1] * case.pad
        block_table = (
            [[] for _ in batch]
            if kind is KVCacheSpecKind.ENCODER_ONLY_ATTENTION
            else [list(tables[r]) for r in batch]
        )
        cm = CommonAttentionMetadata.from_lists(
            query_lens=[step[r] for r in batch],
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
            device=device,
            causal=kind not in BIDIRECTIONAL_KINDS,
        )
        md = builder.build(0, cm)
        assert md.query_start_loc is cm.query_start_loc
        assert md.slot_mapping is cm.slot_mapping
        output = torch.full(
            (num_tokens + case.pad, heads, dv), NAN, dtype=case.dtype, device=device
        )
        query = query.to(device)
        key = key.to(device) if key is not None else None
        value = value.to(device) if value is not None else None
        assert impl.forward(query, key, value, caches, md, output) is output
        output = output.cpu()

        row = 0
        for r in batch:
            n, start = step[r], done[r]
            got = output[row : row + n].double()
            row += n
            q = q_all[r][start : start + n]
            options = {
                "scale": scale,
                "softcap": case.softcap,
                "alibi": alibi,
                "sinks": sinks,
                "window": case.window,
                "chunk": case.chunk,
            }
            if kind is KVCacheSpecKind.ENCODER_ONLY_ATTENTION:
                want = dense_oracle(
                    q,
                    k_all[r][:n].double(),
                    v_all[r][:n].double(),
                    q_positions=range(n),
                    causal=False,
                    **options,
                )
            elif kind is KVCacheSpecKind.CROSS_ATTENTION:
                e = enc_lens[r]
                want = dense_oracle(
                    q,
                    stored(enc_k[r]),
                    stored(enc_v[r]),
                    q_positions=range(e - n, e),
                    causal=False,
                    **options,
                )
            elif is_mla:
                latents = stored(k_all[r][: start + n, :1])
                want = dense_oracle(
                    q,
                    latents,
                    latents[..., :dv],
                    q_positions=range(start, start + n),
                    causal=True,
                    **options,
                )
            else:
                keys, values = stored(k_all[r][: start + n]), stored(v_all[r][: start + n])
                if case.sink_len:
                    assert sink_key is not None
                    assert sink_value is not None
                    keys = torch.cat([stored(sink_key), keys])
                    values = torch.cat([stored(sink_value), values])
                first = case.sink_len + start
                want = dense_oracle(
                    q,
                    keys,
                    values,
                    q_positions=range(first, first + n),
                    causal=True,
                    **options,
                )
            torch.testing.assert_close(
                got, want, **TOL[case.dtype], msg=lambda m, r=r, s=s: f"step {s} request {r}: {m}"
            )
        assert bool((output[num_tokens:] == 0).all()), "padding rows must be zeroed"

        for r in batch:
            done[r] += step[r]
            if kind not in BIDIRECTIONAL_KINDS:
                release_dead_blocks(case, tables[r], case.sink_len + done[r], pool)


F = KVCacheSpecKind
ATTENTION_CASES = [
    # full attention, GQA / MHA / MQA, dtypes, block sizes
    pytest.param(AttnCase(F.FULL_ATTENTION), id="full-gqa-fp32"),
    pytest.param(AttnCase(F.FULL_ATTENTION, num_kv_heads=4), id="full-mha"),
    pytest.param(AttnCase(F.FULL_ATTENTION, num_kv_heads=1), id="full-mqa"),
    pytest.param(AttnCase(F.FULL_ATTENTION, dtype=torch.float16), id="full-fp16"),
    pytest.param(AttnCase(F.FULL_ATTENTION, dtype=torch.bfloat16), id="full-bf16"),
    pytest.param(
        AttnCase(F.FULL_ATTENTION, dtype=torch.float32, kv_cache_dtype="float16"),
        id="full-fp32-with-fp16-cache",
    ),
    pytest.param(
        AttnCase(F.FULL_ATTENTION, dtype=torch.bfloat16, kv_cache_dtype="float32"),
        id="full-bf16-with-fp32-cache",
    ),
    pytest.param(AttnCase(F.FULL_ATTENTION, block_size=1), id="full-block-1"),
    pytest.param(AttnCase(F.FULL_ATTENTION, block_size=32), id="full-block-wider-than-seqs"),
    pytest.param(AttnCase(F.FULL_ATTENTION, strided=True), id="full-strided-cache"),
    pytest.param(AttnCase(F.FULL_ATTENTION, scale=0.7, head_size=5), id="full-scale-odd-head"),
    # score modifiers
    pytest.param(AttnCase(F.FULL_ATTENTION, softcap=2.0, scale=1.0), id="softcap"),
    pytest.param(AttnCase(F.FULL_ATTENTION, alibi=True), id="alibi"),
    pytest.param(AttnCase(F.FULL_ATTENTION, sinks=True), id="per-head-sinks"),
    pytest.param(
        AttnCase(F.SLIDING_WINDOW, window=4, softcap=3.0, alibi=True, sinks=True, num_kv_heads=1),
        id="window-softcap-alibi-sinks-mqa",
    ),
    pytest.param(
        AttnCase(F.FULL_ATTENTION, softcap=2.5, sinks=True, dtype=torch.float16),
        id="softcap-sinks-fp16",
    ),
    # sliding window
    pytest.param(AttnCase(F.SLIDING_WINDOW, window=3), id="window-3"),
    pytest.param(AttnCase(F.SLIDING_WINDOW, window=1), id="window-1"),
    pytest.param(AttnCase(F.SLIDING_WINDOW, window=64), id="window-longer-than-seqs"),
    pytest.param(AttnCase(F.SLIDING_WINDOW, window=5, block_size=2), id="window-5-block-2"),
    pytest.param(AttnCase(F.SLIDING_WINDOW, window=6, dtype=torch.float16), id="window-fp16"),
    # chunked local
    pytest.param(AttnCase(F.CHUNKED_LOCAL_ATTENTION, chunk=4), id="chunk-4-aligned"),
    pytest.param(AttnCase(F.CHUNKED_LOCAL_ATTENTION, chunk=3), id="chunk-3-unaligned"),
    pytest.param(AttnCase(F.CHUNKED_LOCAL_ATTENTION, chunk=1), id="chunk-1"),
    pytest.param(
        AttnCase(F.CHUNKED_LOCAL_ATTENTION, chunk=5, dtype=torch.bfloat16, alibi=True),
        id="chunk-5-bf16-alibi",
    ),
    # sink tokens
    pytest.param(AttnCase(F.SINK_FULL_ATTENTION, sink_len=3), id="sink-tokens-3"),
    pytest.param(AttnCase(F.SINK_FULL_ATTENTION, sink_len=4), id="sink-tokens-one-block"),
    pytest.param(
        AttnCase(F.SINK_FULL_ATTENTION, sink_len=5, block_size=2, num_kv_heads=1, strided=True),
        id="sink-tokens-5-mqa-strided",
    ),
    pytest.param(
        AttnCase(F.SINK_FULL_ATTENTION, sink_len=2, dtype=torch.float16, alibi=True),
        id="sink-tokens-fp16-alibi",
    ),
    # MLA
    pytest.param(
        AttnCase(F.MLA_ATTENTION, head_size=12, v_head_size=8), id="mla-values-first-8-of-12"
    ),
    pytest.param(AttnCase(F.MLA_ATTENTION, mla_value=True), id="mla-value-is-latent"),
    pytest.param(
        AttnCase(F.MLA_ATTENTION, head_size=12, v_head_size=4, strided=True, dtype=torch.float16),
        id="mla-fp16-strided",
    ),
    pytest.param(
        AttnCase(F.SLIDING_WINDOW_MLA, window=4, head_size=10, v_head_size=6, scale=0.3),
        id="sliding-window-mla",
    ),
    pytest.param(
        AttnCase(F.SLIDING_WINDOW_MLA, window=1, block_size=3, sinks=True),
        id="sliding-window-mla-window-1-sinks",
    ),
    # encoder-only: each request whole, in one step
    pytest.param(
        AttnCase(F.ENCODER_ONLY_ATTENTION, steps=((5, 1, 0), (0, 0, 7))),
        id="encoder-only",
    ),
    pytest.param(
        AttnCase(
            F.ENCODER_ONLY_ATTENTION,
            steps=((6, 2, 9),),
            num_kv_heads=1,
            softcap=2.0,
            sinks=True,
            dtype=torch.bfloat16,
        ),
        id="encoder-only-mqa-softcap-sinks-bf16",
    ),
    # cross attention: encoder states written on a request's first step only
    pytest.param(
        AttnCase(
            F.CROSS_ATTENTION, steps=((4, 3, 0), (1, 1, 5), (1, 2, 1)), encoder_lens=(12, 7, 9)
        ),
        id="cross",
    ),
    pytest.param(
        AttnCase(
            F.CROSS_ATTENTION,
            steps=((2, 0), (1, 3), (1, 1)),
            encoder_lens=(5, 11),
            num_kv_heads=1,
            block_size=3,
            dtype=torch.float16,
            sinks=True,
        ),
        id="cross-mqa-fp16-sinks",
    ),
]


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_matches_dense_oracle(case: AttnCase) -> None:
    run_attention_case(case)


def test_every_attention_kind_is_covered() -> None:
    covered = {p.values[0].kind for p in ATTENTION_CASES}
    # The indexer scores and selects (tests/kernels/test_dsa_reference.py); it attends to nothing.
    assert covered == set(KVCacheSpecKind) - {KVCacheSpecKind.MAMBA, KVCacheSpecKind.INDEXER}


@st.composite
def ragged_cases(draw: st.DrawFn) -> AttnCase:
    kind = draw(
        st.sampled_from(
            [
                F.FULL_ATTENTION,
                F.SLIDING_WINDOW,
                F.CHUNKED_LOCAL_ATTENTION,
                F.SINK_FULL_ATTENTION,
                F.MLA_ATTENTION,
                F.SLIDING_WINDOW_MLA,
            ]
        )
    )
    num_reqs = draw(st.integers(1, 3))
    num_steps = draw(st.integers(1, 3))
    steps = tuple(tuple(draw(st.integers(0, 6)) for _ in range(num_reqs)) for _ in range(num_steps))
    if not any(any(step) for step in steps):
        steps = ((1,) * num_reqs, *steps[1:])
    num_kv_heads, num_heads = draw(st.sampled_from([(1, 1), (1, 3), (2, 2), (2, 4)]))
    window = draw(st.integers(1, 8)) if kind in WINDOW_KINDS else None
    return AttnCase(
        kind,
        steps=steps,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=draw(st.sampled_from([2, 4])),
        block_size=draw(st.sampled_from([1, 2, 3, 4, 8])),
        window=window,
        chunk=draw(st.integers(1, 8)) if kind is F.CHUNKED_LOCAL_ATTENTION else None,
        sink_len=draw(st.integers(1, 5)) if kind is F.SINK_FULL_ATTENTION else 0,
        pad=draw(st.integers(0, 2)),
        softcap=draw(st.sampled_from([None, 1.5])),
        sinks=draw(st.booleans()),
    )


@settings(max_examples=40, deadline=None, derandomize=True)
@given(case=ragged_cases(), seed=st.integers(0, 2**16))
def test_ragged_attention_batches_match_dense_oracle(case: AttnCase, seed: int) -> None:
    run_attention_case(case, seed)


# ----------------------------------------------------------------------------------
# Mamba2
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MambaCase:
    steps: tuple[tuple[int, ...], ...] = MIXED
    num_heads: int = 4
    head_dim: int = 3
    n_groups: int = 2
    d_state: int = 5
    conv_width: int = 4
    chunk_size: int = 4
    dtype: torch.dtype = torch.float32
    conv_bias: bool = True
    skip_d: bool = True
    dt_bias: bool = True
    dt_softplus: bool = True
    pad: int = 2
    strided: bool = False


def make_mamba_params(case: MambaCase, gen: torch.Generator) -> Mamba2LayerParams:
    h, g, n = case.num_heads, case.n_groups, case.d_state
    conv_dim = h * case.head_dim + 2 * g * n
    return Mamba2LayerParams(
        num_heads=h,
        head_dim=case.head_dim,
        n_groups=g,
        d_state=n,
        conv_weight=randn(gen, conv_dim, case.conv_width) * 0.5,
        conv_bias=randn(gen, conv_dim) * 0.1 if case.conv_bias else None,
        A=-torch.rand(h, generator=gen) - 0.2,
        D=randn(gen, h) if case.skip_d else None,
        dt_bias=randn(gen, h) * 0.5 if case.dt_bias else None,
        dt_softplus=case.dt_softplus,
        chunk_size=case.chunk_size,
    )


def mamba2_oracle(
    p: Mamba2LayerParams, xbc: torch.Tensor, dt: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole sequence, token by token from zero state, float64.

    Returns ``y`` ``[L, H, P]``, the final SSM state ``[H, P, N]`` and the final conv
    state ``[C, W-1]`` (the last ``W-1`` inputs, oldest first).
    """
    h, hp, gn = p.num_heads, p.num_heads * p.head_dim, p.n_groups * p.d_state
    width = p.conv_kernel
    weight = p.conv_weight.double()
    bias = p.conv_bias.double() if p.conv_bias is not None else torch.zeros(p.conv_dim)
    a = p.A.double()
    history = torch.zeros(width - 1, p.conv_dim, dtype=torch.float64)
    state = torch.zeros(h, p.head_dim, p.d_state, dtype=torch.float64)
    ys = []
    for t in range(xbc.shape[0]):
        window = torch.cat([history, xbc[t : t + 1].double()])  # [W, C], oldest first
        history = window[1:]
        conv = (window.T * weight).sum(dim=1) + bias
        conv = conv * torch.sigmoid(conv)  # SiLU
        x = conv[:hp].reshape(h, p.head_dim)
        b = conv[hp : hp + gn].reshape(p.n_groups, p.d_state)
        c = conv[hp + gn :].reshape(p.n_groups, p.d_state)
        step = dt[t].double() + (p.dt_bias.double() if p.dt_bias is not None else 0.0)
        if p.dt_softplus:
            step = torch.log1p(torch.exp(step))
        y = torch.zeros(h, p.head_dim, dtype=torch.float64)
        for head in range(h):
            g = head // (h // p.n_groups)
            state[head] = torch.exp(step[head] * a[head]) * state[head] + step[head] * torch.outer(
                x[head], b[g]
            )
            y[head] = state[head] @ c[g]
            if p.D is not None:
                y[head] += p.D[head].double() * x[head]
        ys.append(y)
    return torch.stack(ys), state, history.T


def run_mamba_case(case: MambaCase, seed: int = 0, device: torch.device = CPU) -> None:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    params = make_mamba_params(case, gen)
    on_device = {
        f.name: getattr(params, f.name).to(device)
        for f in dataclasses.fields(params)
        if isinstance(getattr(params, f.name), torch.Tensor)
    }
    spec = MambaSpec(block_size=16, shapes=params.state_shapes, dtypes=(case.dtype, torch.float32))
    assert not ReferenceBackend.not_supported_reasons(BackendRequest(spec=spec, device=CPU))
    binding = ReferenceBackend.get_binding(spec)
    builder = binding.create(spec, ["layers.0.mixer"], CONFIG, device)
    assert isinstance(builder, ReferenceStateBuilder)
    impl = binding.create_impl(spec, dataclasses.replace(params, **on_device))

    num_reqs = len(case.steps[0])
    lengths = [sum(step[r] for step in case.steps) for r in range(num_reqs)]
    xbc_all = [randn(gen, n, params.conv_dim, dtype=case.dtype) for n in lengths]
    dt_all = [randn(gen, n, params.num_heads, dtype=case.dtype) * 0.5 for n in lengths]
    if not case.dt_softplus:
        dt_all = [t.abs() + 0.05 for t in dt_all]
    oracle = [mamba2_oracle(params, x, t) for x, t in zip(xbc_all, dt_all, strict=True)]

    num_blocks = num_reqs + 3
    pool = list(range(1, num_blocks))
    rng.shuffle(pool)
    caches = make_caches(spec, num_blocks, spec.dtypes, strided=case.strided, device=device)
    blocks = [pool.pop() for _ in range(num_reqs)]
    done = [0] * num_reqs
    tol = {k: v * MAMBA_TOL_FACTOR for k, v in TOL[case.dtype].items()}
    for s, step in enumerate(case.steps):
        batch = [r for r in range(num_reqs) if step[r] > 0]
        if s % 2:
            batch.reverse()
        num_tokens = sum(step[r] for r in batch)
        xbc = torch.cat(
            [xbc_all[r][done[r] : done[r] + step[r]] for r in batch]
            + [randn(gen, case.pad, params.conv_dim, dtype=case.dtype)]
        )
        dt = torch.cat(
            [dt_all[r][done[r] : done[r] + step[r]] for r in batch]
            + [randn(gen, case.pad, params.num_heads, dtype=case.dtype)]
        )
        cm = CommonAttentionMetadata.from_lists(
            query_lens=[step[r] for r in batch],
            seq_lens=[done[r] + step[r] for r in batch],
            block_table=[[blocks[r]] for r in batch],
            slot_mapping=[-1] * (num_tokens + case.pad),
            device=device,
        )
        md = builder.build(0, cm)
        assert md.has_initial_state.tolist() == [done[r] > 0 for r in batch]
        output = torch.full(
            (num_tokens + case.pad, params.num_heads, params.head_dim),
            NAN,
            dtype=case.dtype,
            device=device,
        )
        inputs = Mamba2Inputs(xBC=xbc.to(device), dt=dt.to(device))
        assert impl.forward(inputs, caches, md, output) is output
        output = output.cpu()
        row = 0
        for r in batch:
            n = step[r]
            want = oracle[r][0][done[r] : done[r] + n]
            torch.testing.assert_close(
                output[row : row + n].double(),
                want,
                **tol,
                msg=lambda m, r=r, s=s: f"step {s} request {r}: {m}",
            )
            row += n
            done[r] += n
        assert bool((output[num_tokens:] == 0).all()), "padding rows must be zeroed"

    conv_states, ssm_states = (c.cpu() for c in caches)
    for r in range(num_reqs):
        _, final_state, final_conv = oracle[r]
        torch.testing.assert_close(ssm_states[blocks[r]].double(), final_state, **tol)
        # The conv state holds raw inputs: exact in the model dtype.
        torch.testing.assert_close(conv_states[blocks[r]].double(), final_conv, atol=0.0, rtol=0.0)


MAMBA_CASES = [
    pytest.param(MambaCase(), id="mixed-fp32"),
    pytest.param(MambaCase(strided=True), id="mixed-strided-state-views"),
    pytest.param(MambaCase(dtype=torch.float16, strided=True), id="fp16-strided"),
    pytest.param(MambaCase(dtype=torch.bfloat16), id="bf16"),
    pytest.param(MambaCase(n_groups=1, conv_width=2, chunk_size=3), id="one-group-width-2-chunk-3"),
    pytest.param(
        MambaCase(conv_bias=False, skip_d=False, dt_bias=False, dt_softplus=False, chunk_size=64),
        id="no-bias-no-D-no-softplus-one-chunk",
    ),
    pytest.param(
        MambaCase(steps=((1, 1, 1), (1, 1, 1), (2, 1, 1)), chunk_size=1, pad=0),
        id="decodes-only-chunk-1",
    ),
]


@pytest.mark.parametrize("case", MAMBA_CASES)
def test_mamba2_matches_token_by_token_recurrence(case: MambaCase) -> None:
    run_mamba_case(case)


# ----------------------------------------------------------------------------------
# Gated DeltaNet with fewer key heads than value heads (Qwen3-Next)
# ----------------------------------------------------------------------------------


def gdn_oracle(
    p: GatedDeltaNetLayerParams, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet layer's core over one whole sequence, token by token from zero
    states, float64, written from the layer's definition: causal conv (SiLU) over
    ``qkv = q [Hk*K] | k [Hk*K] | v [H*V]``, q and k L2-normalised per key head, then the
    gated delta rule per value head ``h`` with query/key head ``h // (H // Hk)``.

    Returns ``o`` ``[L, H, V]``, the final delta-rule state ``[H, K, V]`` and the final
    conv state ``[C, W-1]``.
    """
    hk, h, kd, vd = p.key_heads, p.num_heads, p.key_dim, p.value_dim
    width = int(p.conv_weight.shape[1])
    weight = p.conv_weight.double()
    bias = p.conv_bias.double() if p.conv_bias is not None else torch.zeros(p.conv_dim)
    scale = p.scale if p.scale is not None else kd**-0.5
    history = torch.zeros(width - 1, p.conv_dim, dtype=torch.float64)
    state = torch.zeros(h, kd, vd, dtype=torch.float64)
    outs = []
    for t in range(qkv.shape[0]):
        window = torch.cat([history, qkv[t : t + 1].double()])  # [W, C], oldest first
        history = window[1:]
        conv = (window.T * weight).sum(dim=1) + bias
        conv = conv * torch.sigmoid(conv)  # SiLU
        q = conv[: hk * kd].reshape(hk, kd)
        k = conv[hk * kd : 2 * hk * kd].reshape(hk, kd)
        v = conv[2 * hk * kd :].reshape(h, vd)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        o = torch.zeros(h, vd, dtype=torch.float64)
        for head in range(h):
            j = head // (h // hk)  # the key head this value head shares
            decayed = torch.exp(g[t, head].double()) * state[head]
            u = v[head] - decayed.T @ k[j]
            state[head] = decayed + beta[t, head].double() * torch.outer(k[j], u)
            o[head] = scale * (state[head].T @ q[j])
        outs.append(o)
    return torch.stack(outs), state, history.T


# Steps of (tokens per request): prefill chunks over several chunks, decodes, mixed.
GDN_STEPS = ((9, 5, 0), (1, 1, 6), (1, 1, 1), (4, 1, 1))


@pytest.mark.parametrize(
    ("key_heads", "heads", "strided"),
    [
        pytest.param(2, 4, False, id="Hk2-H4"),
        pytest.param(1, 3, True, id="Hk1-H3-strided"),
        pytest.param(2, 2, False, id="Hk2-H2-plain"),
    ],
)
def test_gdn_shared_key_heads_match_token_by_token_layer(
    key_heads: int, heads: int, strided: bool
) -> None:
    """The reference backend runs a GDN layer whose q/k have fewer heads than v (split
    ``qkv`` as ``Hk*K | Hk*K | H*V``) over prefills and decodes, as the float64 layer
    definition does; the states left in the cache are the definition's."""
    gen = torch.Generator().manual_seed(7 + heads)
    key_dim, value_dim, width, chunk = 8, 6, 4, 4
    conv_dim = 2 * key_heads * key_dim + heads * value_dim
    params = GatedDeltaNetLayerParams(
        num_heads=heads,
        num_key_heads=key_heads,
        key_dim=key_dim,
        value_dim=value_dim,
        conv_weight=randn(gen, conv_dim, width) * 0.5,
        conv_bias=randn(gen, conv_dim) * 0.1,
        chunk_size=chunk,
    )
    assert params.conv_dim == conv_dim
    assert params.state_shapes == ((conv_dim, width - 1), (heads, key_dim, value_dim))
    spec = MambaSpec(
        block_size=16,
        shapes=params.state_shapes,
        dtypes=(torch.float32, torch.float32),
        mamba_type="gdn",
    )
    binding = ReferenceBackend.get_binding(spec)
    builder = binding.create(spec, ["layers.0.linear_attn"], CONFIG, CPU)
    impl = binding.create_impl(spec, params)

    num_reqs = len(GDN_STEPS[0])
    lengths = [sum(step[r] for step in GDN_STEPS) for r in range(num_reqs)]
    qkv_all = [randn(gen, n, conv_dim) for n in lengths]
    g_all = [torch.nn.functional.logsigmoid(randn(gen, n, heads) + 2.0) for n in lengths]
    beta_all = [torch.sigmoid(randn(gen, n, heads)) for n in lengths]
    oracle = [gdn_oracle(params, *parts) for parts in zip(qkv_all, g_all, beta_all, strict=True)]
    blocks = [3, 1, 4]
    caches = make_caches(spec, 6, spec.dtypes, strided=strided)
    done = [0] * num_reqs
    pad = 2
    for s, step in enumerate(GDN_STEPS):
        batch = [r for r in range(num_reqs) if step[r] > 0]
        num_tokens = sum(step[r] for r in batch)

        cm = CommonAttentionMetadata.from_lists(
            query_lens=[step[r] for r in batch],
            seq_lens=[done[r] + step[r] for r in batch],
            block_table=[[blocks[r]] for r in batch],
            slot_mapping=[-1] * (num_tokens + pad),
        )
        md = builder.build(0, cm)
        qkv, g, beta = (
            torch.cat(
                [*(parts[r][done[r] : done[r] + step[r]] for r in batch), randn(gen, pad, cols)]
            )
            for parts, cols in ((qkv_all, conv_dim), (g_all, heads), (beta_all, heads))
        )
        inputs = GatedDeltaNetInputs(qkv=qkv, g=g, beta=beta)
        output = torch.full((num_tokens + pad, heads, value_dim), NAN)
        assert impl.forward(inputs, caches, md, output) is output
        row = 0
        for r in batch:
            n = step[r]
            torch.testing.assert_close(
                output[row : row + n].double(),
                oracle[r][0][done[r] : done[r] + n],
                **TOL[torch.float32],
                msg=lambda m, r=r, s=s: f"step {s} request {r}: {m}",
            )
            row += n
            done[r] += n
        assert bool((output[num_tokens:] == 0).all()), "padding rows must be zeroed"
    conv_states, states = caches
    for r in range(num_reqs):
        _, final_state, final_conv = oracle[r]
        torch.testing.assert_close(states[blocks[r]].double(), final_state, **TOL[torch.float32])
        torch.testing.assert_close(conv_states[blocks[r]].double(), final_conv, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "case",
    [
        p
        for p in ATTENTION_CASES
        if p.id
        in {
            "full-gqa-fp32",
            "full-bf16",
            "full-strided-cache",
            "window-3",
            "chunk-4-aligned",
            "sink-tokens-3",
            "mla-values-first-8-of-12",
            "encoder-only",
            "cross",
        }
    ],
)
def test_attention_on_cuda(case: AttnCase) -> None:
    run_attention_case(case, device=torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", MAMBA_CASES[:4])
def test_mamba2_on_cuda(case: MambaCase) -> None:
    run_mamba_case(case, device=torch.device("cuda"))


# ----------------------------------------------------------------------------------
# Declarations, binding, selection
# ----------------------------------------------------------------------------------


def spec_for_kind(kind: KVCacheSpecKind) -> KVCacheSpec:
    if kind is KVCacheSpecKind.MAMBA:
        return MambaSpec(
            block_size=16, shapes=((10, 3), (2, 3, 4)), dtypes=(torch.bfloat16, torch.float32)
        )
    if kind is KVCacheSpecKind.INDEXER:
        return IndexerSpec(block_size=16, dtype=torch.bfloat16)
    return make_spec(
        AttnCase(
            kind, window=4, chunk=8, sink_len=4, head_size=64, block_size=16, dtype=torch.bfloat16
        )
    )


def test_declarations_are_valid() -> None:
    assert ReferenceBackend.declaration_problems() == []
    assert ReferenceBackend.name == "reference"
    assert ReferenceBackend.description
    assert ReferenceBackend.supported_kinds() == frozenset(KVCacheSpecKind)
    assert AttentionFeature.RETURN_LSE in ReferenceBackend.supported_features  # forward_lse


@pytest.mark.parametrize("kind", list(KVCacheSpecKind), ids=lambda k: k.value)
def test_serves_every_kind_on_cpu(kind: KVCacheSpecKind) -> None:
    spec = spec_for_kind(kind)
    features = (
        frozenset()
        if kind in (KVCacheSpecKind.MAMBA, KVCacheSpecKind.INDEXER)
        else frozenset(
            {
                AttentionFeature.LOGITS_SOFT_CAP,
                AttentionFeature.ATTENTION_SINKS,
                AttentionFeature.ALIBI,
            }
        )
    )
    request = BackendRequest(spec=spec, device=CPU, features=features, num_heads=8)
    assert ReferenceBackend.not_supported_reasons(request) == []
    registry = BackendRegistry(
        builtins={"reference": "attnkit.backends.reference:ReferenceBackend"},
        discover_plugins=False,
    )
    selection = select_backend(spec, CONFIG, device="cpu", registry=registry)
    assert selection.backend is ReferenceBackend


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        pytest.param(
            BackendRequest(
                spec=MLAAttentionSpec(
                    block_size=16, head_size=64, dtype=torch.float16, kv_cache_dtype="fp8_e4m3"
                ),
                device=CPU,
            ),
            "kv_cache_dtype=fp8_e4m3 is not supported for mla_attention layers",
            id="fp8-mla-cache",
        ),
        pytest.param(
            BackendRequest(
                spec=FullAttentionSpec(
                    block_size=16,
                    num_kv_heads=2,
                    head_size=64,
                    dtype=torch.float16,
                    kv_cache_dtype="fp8_e5m2",
                ),
                device=CPU,
            ),
            "kv_cache_dtype=fp8_e5m2 not supported",
            id="fp8-e5m2-cache",
        ),
        pytest.param(
            BackendRequest(
                spec=MambaSpec(
                    block_size=16, shapes=((4, 3),), dtypes=(torch.float32,), mamba_type="mamba1"
                ),
                device=CPU,
            ),
            r"mamba1 shapes must be \(\(D, W-1\), \(D, N\)\), got \(\(4, 3\),\)",
            id="mamba1-one-state",
        ),
        pytest.param(
            BackendRequest(
                spec=MambaSpec(
                    block_size=16,
                    shapes=((10, 3), (2, 3, 4)),
                    dtypes=(torch.float16, torch.float16),
                ),
                device=CPU,
            ),
            "ssm state dtype .* must be float32, got float16",
            id="mamba2-fp16-ssm-state",
        ),
        pytest.param(
            BackendRequest(
                spec=MambaSpec(block_size=16, shapes=((10, 3),), dtypes=(torch.float32,)),
                device=CPU,
            ),
            r"mamba2 shapes must be \(\(C, W-1\), \(H, P, N\)\)",
            id="mamba2-one-state",
        ),
        pytest.param(
            BackendRequest(
                spec=FullAttentionSpec(
                    block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
                ),
                device=torch.device("meta"),
            ),
            "device=meta not supported",
            id="meta-device",
        ),
    ],
)
def test_honest_rejections(request_: BackendRequest, reason: str) -> None:
    reasons = ReferenceBackend.not_supported_reasons(request_)
    assert len(reasons) == 1
    assert re.search(reason, reasons[0]), reasons


def test_bindings_pick_the_builder_per_family() -> None:
    mamba_spec = spec_for_kind(KVCacheSpecKind.MAMBA)
    attn_spec = spec_for_kind(KVCacheSpecKind.SLIDING_WINDOW)
    mamba_builder = ReferenceBackend.get_binding(mamba_spec).create(mamba_spec, ["m"], CONFIG, CPU)
    attn_builder = ReferenceBackend.get_binding(attn_spec).create(attn_spec, ["a"], CONFIG, CPU)
    assert isinstance(mamba_builder, ReferenceStateBuilder)
    assert isinstance(mamba_builder.kv_cache_spec, MambaSpec)
    assert isinstance(attn_builder, ReferenceAttentionBuilder)
    assert isinstance(attn_builder.kv_cache_spec, SlidingWindowSpec)
    for kind in KVCacheSpecKind:
        spec = spec_for_kind(kind)
        binding = ReferenceBackend.get_binding(spec)
        assert binding.kind is kind
        assert binding.get_cudagraph_support(CONFIG, spec) is AttentionCGSupport.NEVER
    # A builder bound to MambaSpec refuses an attention spec at the checked entry point.
    mamba_binding = ReferenceBackend.get_binding(mamba_spec)
    with pytest.raises(TypeError, match="MambaSpec"):
        mamba_binding.create(attn_spec, ["a"], CONFIG, CPU)


def test_cudagraph_capture_is_refused() -> None:
    builder = ReferenceAttentionBuilder(FULL, ["a"], CONFIG, CPU)
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[1], seq_lens=[1], block_table=[[1]], slot_mapping=[16]
    )
    with pytest.raises(RuntimeError, match="NEVER"):
        builder.build_for_cudagraph_capture(cm)


# ----------------------------------------------------------------------------------
# Builder outputs
# ----------------------------------------------------------------------------------


def test_sink_slots_only_for_new_requests() -> None:
    spec = SinkFullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=4, dtype=torch.float32, sink_len=6
    )
    builder = ReferenceAttentionBuilder(spec, ["a"], CONFIG, CPU)
    # request 0 is new (context before the step = 6 = sink_len), request 1 is not, request 2 is new
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[3, 1, 2],
        seq_lens=[9, 12, 8],
        block_table=[[5, 2, 9], [7, 3, 4], [8, 6]],
        slot_mapping=[10, 11, 36, 19, 26, 27],
    )
    md = builder.build(0, cm)
    assert isinstance(md, ReferenceAttentionMetadata)
    assert md.sink_len == 6
    assert md.sink_slot_mapping is not None
    assert md.sink_slot_mapping.dtype == torch.int64
    assert md.sink_slot_mapping.tolist() == [20, 21, 22, 23, 8, 9, 32, 33, 34, 35, 24, 25]
    assert md.block_table is cm.block_table_tensor
    assert md.seq_lens is cm.seq_lens
    # No new request: no sink slots.
    later = CommonAttentionMetadata.from_lists(
        query_lens=[1], seq_lens=[12], block_table=[[7, 3, 4]], slot_mapping=[19]
    )
    assert builder.build(0, later).sink_slot_mapping is None


def test_mamba_metadata_is_views_of_the_batch() -> None:
    spec = spec_for_kind(KVCacheSpecKind.MAMBA)
    assert isinstance(spec, MambaSpec)
    builder = ReferenceStateBuilder(spec, ["m"], CONFIG, CPU)
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[1, 4, 3], seq_lens=[9, 4, 5], block_table=[[3], [1], [2]], slot_mapping=[-1] * 8
    )
    md = builder.build(0, cm)
    assert isinstance(md, ReferenceStateMetadata)
    assert md.query_start_loc is cm.query_start_loc
    assert md.state_indices.dtype == torch.int32
    assert md.state_indices.tolist() == [3, 1, 2]
    assert md.state_indices.data_ptr() == cm.block_table_tensor.data_ptr()  # a view
    assert md.has_initial_state.dtype == torch.bool
    assert md.has_initial_state.tolist() == [True, False, True]


# ----------------------------------------------------------------------------------
# Error paths
# ----------------------------------------------------------------------------------

FULL = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)
PARAMS = AttentionLayerParams(num_heads=4)


def full_step() -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    list[torch.Tensor],
    ReferenceAttentionMetadata,
    torch.Tensor,
]:
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[3], seq_lens=[3], block_table=[[2]], slot_mapping=[8, 9, 10]
    )
    md = ReferenceAttentionBuilder(FULL, ["a"], CONFIG, CPU).build(0, cm)
    return (
        torch.randn(3, 4, 8),
        torch.randn(3, 2, 8),
        torch.randn(3, 2, 8),
        [torch.zeros(4, 2, 4, 2, 8)],
        md,
        torch.empty(3, 4, 8),
    )


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        pytest.param(
            {"query": torch.randn(3, 2, 8)},
            ValueError,
            r"query must be float32 \[T, Hq, D\]=\[\*, 4, 8\], got float32 \[3, 2, 8\]",
            id="query-heads",
        ),
        pytest.param(
            {"query": torch.randn(3, 4, 8, dtype=torch.float16)},
            ValueError,
            "query must be float32 .* got float16",
            id="query-dtype",
        ),
        pytest.param(
            {"query": torch.randn(2, 4, 8)},
            ValueError,
            "query must have at least num_actual_tokens=3 rows",
            id="query-rows",
        ),
        pytest.param(
            {"key": None},
            TypeError,
            r"key must be a torch.Tensor float32 \[T, Hkv, D\]=\[3, 2, 8\] on cpu, got None",
            id="key-none",
        ),
        pytest.param(
            {"value": torch.randn(3, 1, 8)},
            ValueError,
            r"value must be float32 \[T, Hkv, D\]=\[3, 2, 8\] on cpu, got float32 \[3, 1, 8\]",
            id="value-heads",
        ),
        pytest.param(
            {"output": torch.empty(3, 4, 4)},
            ValueError,
            r"output must be float32 \[T, Hq, Dv\]=\[3, 4, 8\]",
            id="output-shape",
        ),
        pytest.param(
            {"kv_cache": [torch.zeros(4, 2, 8, 2, 8)]},
            ValueError,
            r"kv_cache\[0\] must be float32 \[NB, 2, BS, Hkv, D\]=\[\*, 2, 4, 2, 8\]",
            id="cache-block-size",
        ),
        pytest.param(
            {"kv_cache": [torch.zeros(4, 2, 4, 2, 8, dtype=torch.float16)]},
            ValueError,
            "kv_cache.* got float16",
            id="cache-dtype",
        ),
        pytest.param(
            {"kv_cache": []}, ValueError, "kv_cache must hold 1 tensor, got 0", id="no-cache"
        ),
        pytest.param(
            {"attn_metadata": object()},
            TypeError,
            "attn_metadata must be ReferenceAttentionMetadata, got object",
            id="metadata-type",
        ),
    ],
)
def test_attention_forward_rejects_bad_inputs(
    change: dict[str, object], error: type[Exception], match: str
) -> None:
    impl = ReferenceAttentionImpl(FULL, PARAMS)
    names = ("query", "key", "value", "kv_cache", "attn_metadata", "output")
    args: dict[str, object] = dict(zip(names, full_step(), strict=True))
    args.update(change)
    with pytest.raises(error, match=match):
        impl.forward(**args)  # type: ignore[arg-type]  # test input built loosely or wrong on purpose


def test_attention_forward_rejects_out_of_range_slots() -> None:
    query, key, value, cache, _, output = full_step()
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[3], seq_lens=[3], block_table=[[2]], slot_mapping=[8, 9, 99]
    )
    md = ReferenceAttentionBuilder(FULL, ["a"], CONFIG, CPU).build(0, cm)
    with pytest.raises(ValueError, match="slot_mapping"):
        ReferenceAttentionImpl(FULL, PARAMS).forward(query, key, value, cache, md, output)


MLA = MLAAttentionSpec(block_size=4, head_size=8, dtype=torch.float32)
SINK = SinkFullAttentionSpec(
    block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32, sink_len=2
)


@pytest.mark.parametrize(
    ("spec", "params", "match"),
    [
        pytest.param(
            FULL,
            None,
            r"ReferenceAttentionImpl takes layer_params of type AttentionLayerParams, got NoneType",
            id="no-params",
        ),
        pytest.param(
            FULL,
            Mamba2LayerParams(
                num_heads=2,
                head_dim=2,
                n_groups=1,
                d_state=2,
                conv_weight=torch.zeros(8, 3),
                A=torch.zeros(2),
            ),
            r"ReferenceAttentionImpl takes layer_params of type AttentionLayerParams, "
            r"got Mamba2LayerParams",
            id="mamba-params",
        ),
        pytest.param(
            spec_for_kind(KVCacheSpecKind.MAMBA),
            PARAMS,
            r"bound to FullAttentionSpec \(kind=full_attention\), got a MambaSpec \(kind=mamba\)",
            id="mamba-spec",
        ),
        pytest.param(
            MLA,
            AttentionLayerParams(num_heads=2),
            r"bound to FullAttentionSpec \(kind=full_attention\), got a MLAAttentionSpec "
            r"\(kind=mla_attention\)",
            id="mla-spec-on-full-binding",
        ),
    ],
)
def test_attention_binding_refuses_wrong_types(
    spec: KVCacheSpec, params: object, match: str
) -> None:
    """Impls take non-None params of their declared class and a spec of the bound kind:
    the binding checks both before constructing anything."""
    binding = ReferenceBackend.get_binding(FULL)
    assert binding.impl_type is ReferenceAttentionImpl
    with pytest.raises(TypeError, match=match):
        binding.create_impl(spec, params)


@pytest.mark.parametrize(
    ("spec", "params", "error", "match"),
    [
        pytest.param(
            FULL,
            AttentionLayerParams(num_heads=3),
            ValueError,
            "num_heads=3 must be a multiple of .* num_kv_heads=2",
            id="heads",
        ),
        pytest.param(
            FULL,
            AttentionLayerParams(num_heads=4, v_head_size=4),
            ValueError,
            "v_head_size must be None or head_size=8",
            id="v-head-size-non-mla",
        ),
        pytest.param(
            MLA,
            AttentionLayerParams(num_heads=4, v_head_size=9),
            ValueError,
            "v_head_size must be <= the latent width head_size=8, got 9",
            id="v-head-size-mla",
        ),
        pytest.param(
            SINK,
            PARAMS,
            ValueError,
            r"needs layer_params.sink_key and sink_value .*=\[2, 2, 8\], got None",
            id="sink-missing",
        ),
        pytest.param(
            SINK,
            AttentionLayerParams(
                num_heads=4, sink_key=torch.zeros(3, 2, 8), sink_value=torch.zeros(3, 2, 8)
            ),
            ValueError,
            r"sink_key .* \[sink_len, Hkv, D\]=\[2, 2, 8\], got float32 \[3, 2, 8\]",
            id="sink-length",
        ),
        pytest.param(
            FULL,
            AttentionLayerParams(
                num_heads=4, sink_key=torch.zeros(2, 2, 8), sink_value=torch.zeros(2, 2, 8)
            ),
            ValueError,
            "only used by sink_full_attention layers",
            id="sink-on-full",
        ),
    ],
)
def test_attention_impl_rejects_bad_layers(
    spec: KVCacheSpec, params: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ReferenceAttentionImpl(spec, params)  # type: ignore[arg-type]  # test input built loosely or wrong on purpose


@pytest.mark.parametrize(
    ("spec", "cm", "match"),
    [
        pytest.param(
            FULL,
            CommonAttentionMetadata.from_lists(
                query_lens=[1], seq_lens=[1], block_table=[[1]], slot_mapping=[4], causal=False
            ),
            "common_attn_metadata.causal must be True for full_attention layers, got False",
            id="causal-full",
        ),
        pytest.param(
            CrossAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32),
            CommonAttentionMetadata.from_lists(
                query_lens=[1], seq_lens=[3], block_table=[[1]], slot_mapping=[4]
            ),
            "common_attn_metadata.causal must be False for cross_attention layers, got True",
            id="causal-cross",
        ),
        pytest.param(
            EncoderOnlyAttentionSpec(
                block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32
            ),
            CommonAttentionMetadata.from_lists(
                query_lens=[2], seq_lens=[5], block_table=[[]], slot_mapping=[-1, -1], causal=False
            ),
            "request 0 has seq_lens=5 and query length 2",
            id="encoder-only-partial",
        ),
        pytest.param(
            SINK,
            CommonAttentionMetadata.from_lists(
                query_lens=[2], seq_lens=[3], block_table=[[1]], slot_mapping=[5, 6]
            ),
            r"seq_lens must count the sink_len=2 sink tokens, but request 0 has seq_lens - query_lens = 1 < 2",
            id="sink-not-counted",
        ),
        pytest.param(
            SinkFullAttentionSpec(
                block_size=2, num_kv_heads=2, head_size=8, dtype=torch.float32, sink_len=3
            ),
            CommonAttentionMetadata.from_lists(
                query_lens=[0], seq_lens=[3], block_table=[[1]], slot_mapping=[]
            ),
            "block_table_tensor must cover the 3 sink slots",
            id="sink-table-short",
        ),
    ],
)
def test_attention_builder_rejects_bad_batches(
    spec: AttentionSpec, cm: CommonAttentionMetadata, match: str
) -> None:
    builder = ReferenceAttentionBuilder(spec, ["a"], CONFIG, CPU)
    with pytest.raises(ValueError, match=match):
        builder.build(0, cm)


def test_mla_and_cross_forward_errors() -> None:
    impl = ReferenceAttentionImpl(MLA, AttentionLayerParams(num_heads=2))
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[2], seq_lens=[2], block_table=[[1]], slot_mapping=[4, 5]
    )
    md = ReferenceAttentionBuilder(MLA, ["a"], CONFIG, CPU).build(0, cm)
    q, out, cache = torch.randn(2, 2, 8), torch.empty(2, 2, 8), [torch.zeros(3, 4, 8)]
    with pytest.raises(ValueError, match=r"key \(the new latents\) must be float32 \[T, 1, D\]"):
        impl.forward(q, torch.randn(2, 2, 8), None, cache, md, out)
    with pytest.raises(ValueError, match=r"kv_cache\[0\] must be float32 \[NB, BS, D\]"):
        impl.forward(q, torch.randn(2, 1, 8), None, [torch.zeros(3, 2, 4, 1, 8)], md, out)

    cross = CrossAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cross_impl = ReferenceAttentionImpl(cross, AttentionLayerParams(num_heads=2))
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[2], seq_lens=[6], block_table=[[1, 2]], slot_mapping=[4, 5], causal=False
    )
    md = ReferenceAttentionBuilder(cross, ["a"], CONFIG, CPU).build(0, cm)
    cache = [torch.zeros(3, 2, 4, 1, 8)]
    with pytest.raises(
        ValueError, match="key and value must both be the encoder states or both be None"
    ):
        cross_impl.forward(q, torch.randn(6, 1, 8), None, cache, md, out)
    with pytest.raises(
        ValueError, match="slot_mapping must have an entry for each of the E=6 encoder tokens"
    ):
        cross_impl.forward(q, torch.randn(6, 1, 8), torch.randn(6, 1, 8), cache, md, out)

    enc = EncoderOnlyAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[2], seq_lens=[2], block_table=[[]], slot_mapping=[-1, -1], causal=False
    )
    md = ReferenceAttentionBuilder(enc, ["a"], CONFIG, CPU).build(0, cm)
    with pytest.raises(ValueError, match=r"kv_cache must be empty .* got 1 tensors"):
        ReferenceAttentionImpl(enc, AttentionLayerParams(num_heads=2)).forward(
            q, torch.randn(2, 1, 8), torch.randn(2, 1, 8), cache, md, out
        )


def mamba_setup() -> tuple[MambaSpec, Mamba2LayerParams, ReferenceStateMetadata, dict[str, object]]:
    params = make_mamba_params(MambaCase(), torch.Generator().manual_seed(0))
    spec = MambaSpec(
        block_size=16, shapes=params.state_shapes, dtypes=(torch.float32, torch.float32)
    )
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[3], seq_lens=[3], block_table=[[1]], slot_mapping=[-1, -1, -1]
    )
    md = ReferenceStateBuilder(spec, ["m"], CONFIG, CPU).build(0, cm)
    c = params.conv_dim
    args: dict[str, object] = {
        "inputs": Mamba2Inputs(xBC=torch.randn(3, c), dt=torch.randn(3, 4)),
        "kv_cache": [torch.zeros(2, c, 3), torch.zeros(2, 4, 3, 5)],
        "attn_metadata": md,
        "output": torch.empty(3, 4, 3),
    }
    return spec, params, md, args


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        pytest.param(
            {"inputs": Mamba2Inputs(xBC=torch.randn(3, 7), dt=torch.randn(3, 4))},
            ValueError,
            r"inputs\.xBC must be float32 \[T, C\]=\[\*, 32\], got float32 \[3, 7\]",
            id="xbc-channels",
        ),
        pytest.param(
            {
                "inputs": Mamba2Inputs(
                    xBC=torch.randn(3, 32, dtype=torch.float16), dt=torch.randn(3, 4)
                )
            },
            ValueError,
            r"inputs\.xBC must be float32 .* got float16",
            id="xbc-dtype",
        ),
        pytest.param(
            {"inputs": Mamba2Inputs(xBC=torch.randn(2, 32), dt=torch.randn(2, 4))},
            ValueError,
            r"inputs\.xBC must have at least num_actual_tokens=3 rows, got float32 \[2, 32\]",
            id="xbc-rows",
        ),
        pytest.param(
            {"inputs": Mamba2Inputs(xBC=torch.randn(3, 32), dt=torch.randn(3, 2))},
            ValueError,
            r"inputs\.dt must be \[T, H\]=\[3, 4\] on cpu, got float32 \[3, 2\]",
            id="dt-heads",
        ),
        pytest.param(
            {
                "inputs": Mamba2Inputs(
                    xBC=torch.randn(3, 32), dt=torch.ones(3, 4, dtype=torch.int64)
                )
            },
            ValueError,
            r"inputs\.dt must be a floating-point tensor, got int64 \[3, 4\]",
            id="dt-integer",
        ),
        pytest.param(
            {"output": torch.empty(3, 4, 2)},
            ValueError,
            r"output \(y\) must be float32 \[T, H, P\]=\[3, 4, 3\]",
            id="output-shape",
        ),
        pytest.param(
            {"kv_cache": [torch.zeros(2, 32, 3)]},
            ValueError,
            "kv_cache must hold 2 tensors",
            id="one-state",
        ),
        pytest.param(
            {"kv_cache": [torch.zeros(2, 32, 2), torch.zeros(2, 4, 3, 5)]},
            ValueError,
            r"kv_cache\[0\] \(conv state\) must be float32 \[NB, C, W-1\]=\[\*, 32, 3\]",
            id="conv-state-shape",
        ),
        pytest.param(
            {"kv_cache": [torch.zeros(2, 32, 3), torch.zeros(2, 4, 3, 5, dtype=torch.float16)]},
            ValueError,
            r"kv_cache\[1\] \(ssm state\) must be float32 .* got float16",
            id="ssm-state-dtype",
        ),
        pytest.param(
            {"attn_metadata": None},
            TypeError,
            "attn_metadata must be ReferenceStateMetadata, got NoneType",
            id="metadata-type",
        ),
    ],
)
def test_mamba_forward_rejects_bad_inputs(
    change: dict[str, object], error: type[Exception], match: str
) -> None:
    spec, params, _, args = mamba_setup()
    args.update(change)
    with pytest.raises(error, match=match):
        ReferenceStateImpl(spec, params).forward(**args)  # type: ignore[arg-type]  # test input built loosely or wrong on purpose


def test_mamba_impl_and_builder_reject_bad_layers() -> None:
    spec, params, _, _ = mamba_setup()
    # Types are the binding's to check, before any impl is constructed.
    binding = ReferenceBackend.get_binding(spec)
    assert binding.impl_type is ReferenceStateImpl
    with pytest.raises(
        TypeError,
        match=r"ReferenceStateImpl takes layer_params of type Mamba1LayerParams \| "
        r"Mamba2LayerParams \| "
        r"GatedDeltaNetLayerParams \| LinearAttentionLayerParams \| ShortConvLayerParams, "
        r"got AttentionLayerParams",
    ):
        binding.create_impl(spec, PARAMS)
    with pytest.raises(
        TypeError,
        match=r"ReferenceStateBuilder is bound to MambaSpec \(kind=mamba\), "
        r"got a FullAttentionSpec \(kind=full_attention\)",
    ):
        binding.create_impl(FULL, params)
    with pytest.raises(TypeError, match=r"takes layer_params of type .* got NoneType"):
        binding.create_impl(spec, None)
    wrong = MambaSpec(
        block_size=16, shapes=((32, 3), (4, 3, 6)), dtypes=(torch.float32, torch.float32)
    )
    with pytest.raises(
        ValueError,
        match=r"kv_cache_spec.shapes must be layer_params.state_shapes=\(\(32, 3\), \(4, 3, 5\)\)",
    ):
        ReferenceStateImpl(wrong, params)
    fp16_ssm = MambaSpec(
        block_size=16, shapes=params.state_shapes, dtypes=(torch.float32, torch.float16)
    )
    with pytest.raises(ValueError, match=r"ssm state dtype .* must be float32"):
        ReferenceStateImpl(fp16_ssm, params)
    mamba1 = MambaSpec(
        block_size=16, shapes=params.state_shapes, dtypes=spec.dtypes, mamba_type="mamba1"
    )
    with pytest.raises(
        ValueError,
        match=r"ReferenceStateImpl: kv_cache_spec.mamba_type must be 'mamba2', got 'mamba1'",
    ):
        ReferenceStateImpl(mamba1, params)
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[1], seq_lens=[1], block_table=[[]], slot_mapping=[-1]
    )
    with pytest.raises(ValueError, match="block_table_tensor must have a column 0"):
        ReferenceStateBuilder(spec, ["m"], CONFIG, CPU).build(0, cm)
    other_device = dataclasses.replace(params, A=params.A.to("meta"))
    _, _, _, args = mamba_setup()
    with pytest.raises(ValueError, match=r"layer_params\.A must be on the inputs' device cpu"):
        ReferenceStateImpl(spec, other_device).forward(**args)  # type: ignore[arg-type]  # test input built loosely or wrong on purpose


def test_state_impl_takes_only_its_types_inputs() -> None:
    """The one state impl runs a Mamba2 layer as the token-by-token definition does, and
    refuses another type's inputs (same row count) instead of reading them as xBC and dt."""
    spec, params, md, _ = mamba_setup()
    impl = ReferenceBackend.get_binding(spec).create_impl(spec, params)
    assert isinstance(impl, ReferenceStateImpl)
    gen = torch.Generator().manual_seed(3)
    inputs = Mamba2Inputs(
        xBC=torch.randn(3, params.conv_dim, generator=gen),
        dt=torch.randn(3, params.num_heads, generator=gen),
    )

    def caches() -> list[torch.Tensor]:
        return [torch.zeros(2, params.conv_dim, 3), torch.zeros(2, 4, 3, 5)]

    got_caches = caches()
    got = impl.forward(inputs, got_caches, md, torch.full((3, 4, 3), NAN))
    # One request of 3 tokens from zero state, its states in block 1.
    want, final_state, final_conv = mamba2_oracle(params, inputs.xBC, inputs.dt)
    tol = {k: v * MAMBA_TOL_FACTOR for k, v in TOL[torch.float32].items()}
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(got_caches[1][1].double(), final_state, **tol)
    torch.testing.assert_close(got_caches[0][1].double(), final_conv, atol=0.0, rtol=0.0)

    gdn = GatedDeltaNetInputs(
        qkv=torch.randn(3, params.conv_dim), g=torch.randn(3, 4), beta=torch.randn(3, 4)
    )
    untouched = caches()
    output = torch.full((3, 4, 3), NAN)
    with pytest.raises(
        TypeError,
        match=r"ReferenceStateImpl: a mamba2 layer takes Mamba2Inputs, got GatedDeltaNetInputs",
    ):
        impl.forward(gdn, untouched, md, output)
    assert bool(output.isnan().all())
    assert all(bool((t == 0).all()) for t in untouched)


def test_nan_in_the_null_block_does_not_leak() -> None:
    spec = SlidingWindowSpec(
        block_size=2, num_kv_heads=1, head_size=4, dtype=torch.float32, sliding_window=2
    )
    impl = ReferenceAttentionImpl(spec, AttentionLayerParams(num_heads=1))
    cache = torch.full((3, 2, 2, 1, 4), NAN)
    cache[2] = 0  # the live block; block 0, the null block, stays NaN
    # The query at position 5 sees positions 4 and 5 (block 2); blocks 0-1 were released.
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[1], seq_lens=[6], block_table=[[0, 0, 2]], slot_mapping=[5]
    )
    md = ReferenceAttentionBuilder(spec, ["a"], CONFIG, CPU).build(0, cm)
    kv = torch.randn(1, 1, 4)
    out = impl.forward(torch.randn(1, 1, 4), kv, kv, [cache], md, torch.empty(1, 1, 4))
    assert not bool(out.isnan().any())


def test_nan_in_a_visible_slot_propagates() -> None:
    impl = ReferenceAttentionImpl(FULL, PARAMS)
    cache = torch.full((3, 2, 4, 2, 8), NAN)  # slot 8 (block 2, offset 0) is never written
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[1], seq_lens=[2], block_table=[[2]], slot_mapping=[9]
    )
    md = ReferenceAttentionBuilder(FULL, ["a"], CONFIG, CPU).build(0, cm)
    kv = torch.randn(1, 2, 8)
    out = impl.forward(torch.randn(1, 4, 8), kv, kv, [cache], md, torch.empty(1, 4, 8))
    assert bool(out.isnan().all())


def test_fp8_cache_with_scales_matches_dense_on_dequantised_values() -> None:
    """The cache stores key / k_scale in fp8 (saturated at 448); attention reads it back
    times the scale. The oracle is dense attention over the same quantise-dequantise
    round trip, computed here by hand."""
    spec = FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32, kv_cache_dtype="fp8_e4m3"
    )
    params = AttentionLayerParams(num_heads=2, k_scale=0.01, v_scale=0.02)
    impl = ReferenceAttentionImpl(spec, params)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(6, 2, 8, generator=gen)
    k = torch.randn(6, 1, 8, generator=gen) * 4  # some saturate: |k| / 0.01 > 448
    v = torch.randn(6, 1, 8, generator=gen)
    cache = torch.zeros((4, 2, 4, 1, 8), dtype=torch.float8_e4m3fn)
    table = [[3, 1]]
    slots = [table[0][p // 4] * 4 + p % 4 for p in range(6)]
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[6], seq_lens=[6], block_table=table, slot_mapping=slots
    )
    md = ReferenceAttentionBuilder(spec, ["a"], CONFIG, CPU).build(0, cm)
    out = impl.forward(q, k, v, [cache], md, torch.full((6, 2, 8), NAN))

    def round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale

    kq, vq = round_trip(k, 0.01), round_trip(v, 0.02)
    scores = torch.einsum("thd,shd->hts", q.double(), kq.expand(6, 2, 8)) * 8**-0.5
    scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    expected = torch.einsum("hts,shd->thd", scores.softmax(-1), vq.expand(6, 2, 8))
    assert bool((k.abs() / 0.01 > 448).any())  # saturation is exercised
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
