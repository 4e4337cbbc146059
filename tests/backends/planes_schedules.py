"""Schedules for the backends over the K/V planes (``cpu_attn``, ``flex_attention``),
run against the reference backend (imported by their test modules).

Every schedule runs through an ``AttentionRuntime`` with the backend under test (planes
layout) and one with ``reference`` (interleaved layout, pure torch): caches start as NaN
(block 0 zero), block pools are shuffled with one seed, so tables are neither contiguous
nor ordered, and every side gets identical inputs.

Every runtime shares one spec geometry (Hkv 2, D 16, block 16) and one memory budget: the
planes' length is part of a compiled FlexAttention shape, so flex_attention's tests reuse
the same compiled kernels across kinds.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

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
    ScheduledRequest,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

HKV, D, BS = 2, 16, 16
NUM_PAGES = 64
"""One memory budget for every runtime: the planes' length is part of the compiled shape."""
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
# G = 1 (one query head per K/V head), decodes only, a request joining late.
DECODES: tuple[Step, ...] = (
    *[(("a", 1, 0), ("b", 1, 0))] * 3,
    *[(("a", 1, 0), ("b", 1, 0), ("c", 1, 0))] * 30,
)


def spec_of(kind: str, dtype: torch.dtype = torch.float32) -> AttentionSpec:
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


def params_of(
    spec: AttentionSpec,
    num_heads: int = 4,
    logits_soft_cap: float | None = None,
    alibi_slopes: tuple[float, ...] | None = None,
    sinks: torch.Tensor | None = None,
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
        sinks=sinks,
    )


def make_runtime(
    backend: str,
    spec: AttentionSpec,
    params: AttentionLayerParams,
    options: Mapping[str, Any] | None = None,
) -> AttentionRuntime:
    config = AttentionConfig(
        backend_per_kind={spec.kind: backend}, backend_options=dict(options or {})
    )
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


def run_steps(
    backend: str,
    spec: AttentionSpec,
    params: AttentionLayerParams,
    steps: Sequence[Step],
    options: Mapping[str, Any] | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Each step's output per request."""
    rt = make_runtime(backend, spec, params, options)
    gen = torch.Generator().manual_seed(0)
    live: set[str] = set()
    for step in steps:
        finished = sorted(live - {rid for rid, _, _ in step})
        live -= set(finished)
        live |= {rid for rid, _, _ in step}
        inputs = {
            rid: (
                torch.randn(n, params.num_heads, spec.head_size, generator=gen).to(spec.dtype),
                torch.randn(max(n, enc), spec.num_kv_heads, spec.head_size, generator=gen).to(
                    spec.dtype
                ),
                torch.randn(max(n, enc), spec.num_kv_heads, spec.head_size, generator=gen).to(
                    spec.dtype
                ),
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


def compare_with_reference(
    backend: str,
    spec: AttentionSpec,
    params: AttentionLayerParams,
    steps: Sequence[Step],
    options: Mapping[str, Any] | None = None,
) -> None:
    atol, rtol = TOLERANCES[spec.dtype]
    pairs = zip(
        run_steps(backend, spec, params, steps, options),
        run_steps("reference", spec, params, steps),
        strict=True,
    )
    for i, (got, want) in enumerate(pairs):
        assert got.keys() == want.keys()
        for rid, expected in want.items():
            assert not expected.isnan().any()
            torch.testing.assert_close(
                got[rid], expected, atol=atol, rtol=rtol, msg=f"step {i} {rid}"
            )
