"""The CPU attention paths: ``cpu_attn`` (the CPU default) against in-run baselines on
this machine.

Shapes (issue "A fast CPU path"): 32 query / 8 K/V heads, head size 128, float32, block
size 16, block pools shuffled (tables neither contiguous nor ordered).

* decode: 32 requests x 2k tokens of context (``--quick``: 16 x 1k), one new token each;
* prefill: 4 requests x 512 new tokens, causal, no cached context (``--quick``: 2 x 256).

Each is measured, in the same run, through:

* ``cpu_attn`` (attnkit's CPU engines: the native paged kernel for decodes, blocked
  matrix products for prefills): its builder (once per step, timed apart) and one
  layer's ``forward`` (write the step's K/V into the planes, attend) over the planes
  cache;
* ``flex_attention``: the same through compiled FlexAttention (inductor's CPU kernel),
  for comparison (``--no-compiled`` skips it);
* ``reference``: its builder and ``forward`` over the interleaved cache;
* SDPA: ``torch.nn.functional.scaled_dot_product_attention`` on dense, contiguous K/V
  (``[B, H, S, D]``, GQA through ``enable_gqa``; causal for prefill) - what a dense
  batch costs with no paging at all;
* decode only, a plain read of the same bytes: ``torch.sum`` over contiguous copies of
  the K and V rows the step reads (both planes of exactly those blocks), the bandwidth
  floor. The planes and the copies are allocated the way the runtime allocates caches
  (``attnkit.kv_cache.cache_buffer``: huge pages advised on Linux), so both read
  memory of the same page size.

Reported: medians of timed calls after a warm-up (each first call compiles, its cost
reported apart, with ``compile_records``). The targets are paired: ``cpu_attn`` and
its baseline (the plain read for decode, SDPA causal for prefill) run alternately, one
call each per round (``3 x --reps`` rounds for decode, ``--reps`` for prefill), and the
figure is the median of the per-round ratios, so a change in the machine's load hits
both sides alike; decode is also reported as GB/s of K/V read. Every path runs
with ``--threads`` torch threads (default 1; compiled kernels take the count at compile
time). Targets: decode
>= 60% of the plain read, prefill >= 1.0x SDPA. All figures are this machine's (two
cores here, shared with other jobs): ratios carry over, absolute times do not. Then the
demo (``attnkit demo``: default model, CPU, float32) before and after: every attention
kind forced to ``reference``, then the default selection (``cpu_attn``), each run
twice in the process (the second run finds its kernels compiled), tokens/s.

Determinism (docs/determinism.md; ``--determinism only`` runs nothing else): each CPU
backend at each ``Determinism`` level it declares for full attention against the same
backend with the level off (``none``), in paired alternating rounds, on the decode step
(32 x 2k), a mixed step (24 decodes of 2k context and 4 prompt chunks of 128 new tokens
after 512 cached) and the prefill step (4 x 512). Target on the CPU engines:
batch-invariant at most 1.10x the default.

Quantised caches (``--fp8 only`` runs nothing else): the native decode over the same
32 x 2k step (``--quick``: 16 x 1k) with bf16 queries, reading a bf16 cache against an
fp8 e4m3 cache with per-head scales and an int8 per-token-head cache (rows of
``D + 4`` bytes), in paired alternating rounds (3 x ``--reps``), each checked against a
float64 oracle on its dequantised values; reported: times, their ratio to the bf16
cache, and the K/V bytes each reads.

Absorbed MLA (``--mla only`` runs nothing else): decode steps of 8 requests x 1k
(``--quick``: 4 x 512) over DeepSeek-V3's latent (576 = 512 + 64, 16 heads, bf16)
through the runtime, ``cpu_mla`` against ``reference`` on the same steps in paired
alternating rounds, each checked against a float64 oracle; reported: times, the speedup
and cpu_mla's GFLOP/s.

Side by side with vLLM when ``vllm._custom_ops`` imports (``--vllm no`` skips it, ``only``
runs nothing else): vLLM's CPU attention ops against the engine ``cpu_attn`` runs, on the
same cache contents, in paired rounds, both checked against a float64 oracle
(docs/kernels.md, "Against vLLM's CPU attention"; vLLM is never an attnkit dependency).

    python benchmarks/bench_cpu.py --out bench-results [--quick]
    python benchmarks/bench_cpu.py --vllm only --grid-threads 1,2   # the vLLM table
    python benchmarks/bench_cpu.py --fp8 only --threads 1           # the quantised rows
    python benchmarks/bench_cpu.py --mla only                       # cpu_mla vs reference
"""

from __future__ import annotations

import argparse
import io
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnkit import AttentionConfig, AttentionLayerParams, FullAttentionSpec
from attnkit.backend_api import CommonAttentionMetadata

HQ, HKV, D, BS = 32, 8, 128, 16
TARGET_DECODE_FRACTION = 0.60
TARGET_PREFILL_RATIO = 1.0


def _cache_tensor(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised tensor in a buffer allocated like the runtime's caches."""
    from attnkit.kv_cache import cache_buffer

    nbytes = math.prod(shape) * (torch.finfo(dtype).bits // 8)
    return cache_buffer(nbytes, "cpu").view(dtype).view(shape)


def _median_seconds(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class _Step:
    """One step's batch over a shuffled pool, in both cache layouts with the same bytes."""

    def __init__(self, query_lens: list[int], contexts: list[int], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        self.query_lens, self.seq_lens = (
            query_lens,
            [c + q for c, q in zip(contexts, query_lens, strict=True)],
        )
        blocks = [-(-s // BS) for s in self.seq_lens]
        self.num_blocks = sum(blocks) + 1
        order = rng.permutation(np.arange(1, self.num_blocks))
        width = max(blocks)
        table = np.zeros((len(blocks), width), dtype=np.int32)
        start = 0
        for r, n in enumerate(blocks):
            table[r, :n] = order[start : start + n]
            start += n
        self.table = torch.from_numpy(table)
        rows = self.num_blocks * BS
        # Planes allocated as the runtime allocates caches (kv_cache.cache_buffer: 2 MB
        # aligned, huge pages advised on Linux), then filled.
        self.k_plane = _cache_tensor((rows, HKV, D))
        self.v_plane = _cache_tensor((rows, HKV, D))
        self.k_plane.copy_(torch.randn(rows, HKV, D, generator=gen))
        self.v_plane.copy_(torch.randn(rows, HKV, D, generator=gen))
        # The same bytes, interleaved: [NB, 2, BS, Hkv, D].
        self.interleaved = torch.stack(
            [self.k_plane.view(-1, BS, HKV, D), self.v_plane.view(-1, BS, HKV, D)], dim=1
        )
        qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        slots = []
        for r, (q, s) in enumerate(zip(query_lens, self.seq_lens, strict=True)):
            pos = np.arange(s - q, s)
            slots.append(table[r, pos // BS].astype(np.int64) * BS + pos % BS)
        self.cm = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(qsl),
            query_start_loc_cpu=torch.from_numpy(qsl.copy()),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            seq_lens_cpu=torch.tensor(self.seq_lens, dtype=torch.int32),
            num_reqs=len(query_lens),
            num_actual_tokens=int(qsl[-1]),
            max_query_len=max(query_lens),
            max_seq_len=max(self.seq_lens),
            block_table_tensor=self.table,
            slot_mapping=torch.from_numpy(np.concatenate(slots)),
            num_computed_tokens_cpu=torch.tensor(contexts, dtype=torch.int32),
        )
        t = int(qsl[-1])
        self.q = torch.randn(t, HQ, D, generator=gen)
        self.k = torch.randn(t, HKV, D, generator=gen)
        self.v = torch.randn(t, HKV, D, generator=gen)
        # Dense K/V of each request's whole context, after this step's writes.
        self.k_plane_after = self.k_plane.clone()
        self.v_plane_after = self.v_plane.clone()
        self.k_plane_after[self.cm.slot_mapping] = self.k
        self.v_plane_after[self.cm.slot_mapping] = self.v

    def context_slots(self, r: int) -> torch.Tensor:
        pos = torch.arange(self.seq_lens[r])
        return self.table[r, pos // BS].long() * BS + pos % BS

    def kv_bytes(self) -> int:
        return sum(self.seq_lens) * HKV * D * 4 * 2


def _backend_layer(name: str, config: AttentionConfig | None = None) -> tuple[Any, Any]:
    from attnkit.backends.cpu_attn import CpuAttentionBackend
    from attnkit.backends.flex_attention import FlexAttentionBackend
    from attnkit.backends.reference import ReferenceBackend

    backends = {
        "cpu_attn": CpuAttentionBackend,
        "flex_attention": FlexAttentionBackend,
        "reference": ReferenceBackend,
    }
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    binding = backends[name].get_binding(spec)
    builder = binding.create(spec, ["layer"], config or AttentionConfig(), torch.device("cpu"))
    impl = binding.create_impl(spec, AttentionLayerParams(num_heads=HQ))
    return builder, impl


def _paged(
    name: str, step: _Step, reps: int, config: AttentionConfig | None = None
) -> tuple[dict[str, float], Callable[[], object]]:
    """Build and first-call figures, the output's error, and the forward call itself."""
    builder, impl = _backend_layer(name, config)
    cache: list[torch.Tensor] = (
        [step.interleaved] if name == "reference" else [step.k_plane, step.v_plane]
    )
    out = torch.empty_like(step.q)
    build_s = _median_seconds(lambda: builder.build(0, step.cm), reps)
    md = builder.build(0, step.cm)
    started = time.perf_counter()
    impl.forward(step.q, step.k, step.v, cache, md, out)  # flex: compiles this shape
    first_s = time.perf_counter() - started
    check = _dense_reference(step)
    err = float((out.double() - check.double()).abs().max())

    def forward() -> object:
        return impl.forward(step.q, step.k, step.v, cache, md, out)

    stats = {"build_s": build_s, "first_call_s": first_s, "max_err": err}
    return stats, forward


def _paired(
    fn: Callable[[], object], baseline: Callable[[], object], rounds: int
) -> tuple[float, float, float]:
    """``fn`` and ``baseline`` timed alternately, one call each per round (so both see
    the same machine load): their median times and the median per-round ratio
    ``baseline / fn``."""
    fn()
    baseline()
    times: list[float] = []
    base_times: list[float] = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
        started = time.perf_counter()
        baseline()
        base_times.append(time.perf_counter() - started)
    ratios = [b / a for a, b in zip(times, base_times, strict=True)]
    return statistics.median(times), statistics.median(base_times), statistics.median(ratios)


TARGET_BATCH_INVARIANT_COST = 1.10
DETERMINISM_BACKENDS = ("cpu_attn", "reference")


def _determinism_steps(quick: bool) -> dict[str, _Step]:
    ctx = 1024 if quick else 2048
    decodes = 16 if quick else 32
    return {
        f"decode {decodes} x {ctx // 1024}k": _Step([1] * decodes, [ctx - 1] * decodes),
        "mixed (24 decodes x 2k + 4 chunks of 128 after 512)": _Step(
            [1] * 24 + [128] * 4, [ctx - 1] * 24 + [512] * 4, seed=2
        ),
        f"prefill {2 if quick else 4} x {256 if quick else 512}": _Step(
            [256 if quick else 512] * (2 if quick else 4), [0] * (2 if quick else 4), seed=1
        ),
    }


def _alternating(
    fn: Callable[[], object], baseline: Callable[[], object], rounds: int
) -> tuple[float, float, float]:
    """``fn`` and ``baseline`` one call each per round, the first of the two alternating
    from round to round (so a drift in the machine's load favours neither): their median
    times and the median per-round ratio ``fn / baseline``."""
    fn()
    baseline()
    times: list[float] = []
    base_times: list[float] = []
    for i in range(rounds):
        for call, into in ((fn, times), (baseline, base_times))[:: 1 if i % 2 == 0 else -1]:
            started = time.perf_counter()
            call()
            into.append(time.perf_counter() - started)
    ratios = [a / b for a, b in zip(times, base_times, strict=True)]
    return statistics.median(times), statistics.median(base_times), statistics.median(ratios)


def _determinism_costs(reps: int, quick: bool) -> dict[str, Any]:
    """Each backend's forward at each level it declares for full attention, paired with
    the same backend at ``none``: the median per-round time ratio (level / none)."""
    from attnkit import Determinism
    from attnkit.backends.cpu_attn import CpuAttentionBackend
    from attnkit.backends.reference import ReferenceBackend
    from attnkit.spec import KVCacheSpecKind

    classes = {"cpu_attn": CpuAttentionBackend, "reference": ReferenceBackend}
    rows: list[dict[str, Any]] = []
    for case, step in _determinism_steps(quick).items():
        for name in DETERMINISM_BACKENDS:
            top = classes[name].determinism_for(KVCacheSpecKind.FULL_ATTENTION)
            _, off = _paged(name, step, 1)
            rounds = 3 * reps if name == "cpu_attn" else max(1, reps // 2)
            for level in Determinism:
                if level == Determinism.NONE or level > top:
                    continue
                stats, on = _paged(name, step, 1, AttentionConfig(determinism=level))
                on_s, off_s, cost = _alternating(on, off, rounds)
                rows.append(
                    {
                        "case": case,
                        "backend": name,
                        "level": level.label,
                        "level_s": on_s,
                        "none_s": off_s,
                        "cost": cost,
                        "rounds": rounds,
                        "max_err": stats["max_err"],
                    }
                )
                print(
                    f"  {case:52s} {name:9s} {level.label:21s} {on_s * 1e3:9.2f} ms vs "
                    f"{off_s * 1e3:9.2f} ms off: {cost:.2f}x"
                )
    worst = max(
        (r["cost"] for r in rows if r["backend"] == "cpu_attn" and r["level"] == "batch_invariant"),
        default=float("nan"),
    )
    return {
        "rows": rows,
        "cpu_attn_batch_invariant_worst_cost": worst,
        "target_batch_invariant_cost": TARGET_BATCH_INVARIANT_COST,
    }


def _dense_reference(step: _Step) -> torch.Tensor:
    """float64 causal attention per request, from the dense context (a check, not timed)."""
    rows = []
    g = HQ // HKV
    for r, (q_len, seq) in enumerate(zip(step.query_lens, step.seq_lens, strict=True)):
        slots = step.context_slots(r)
        k = step.k_plane_after[slots].double().repeat_interleave(g, dim=1)  # [S, Hq, D]
        v = step.v_plane_after[slots].double().repeat_interleave(g, dim=1)
        start = int(step.cm.query_start_loc_cpu[r])
        q = step.q[start : start + q_len].double()
        s = torch.einsum("thd,shd->hts", q, k) * D**-0.5
        qpos = torch.arange(seq - q_len, seq)[:, None]
        s = s.masked_fill(torch.arange(seq)[None, :] > qpos, float("-inf"))
        rows.append(torch.einsum("hts,shd->thd", s.softmax(-1), v))
    return torch.cat(rows).float()


def _sdpa(step: _Step) -> Callable[[], object]:
    """SDPA on dense, contiguous per-request K/V (equal lengths: one batched call)."""
    b = len(step.seq_lens)
    seq, q_len = step.seq_lens[0], step.query_lens[0]
    k = torch.stack([step.k_plane_after[step.context_slots(r)] for r in range(b)])
    v = torch.stack([step.v_plane_after[step.context_slots(r)] for r in range(b)])
    k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B, Hkv, S, D]
    q = step.q.view(b, q_len, HQ, D).transpose(1, 2).contiguous()
    causal = q_len > 1 and q_len == seq

    def call() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=True
        )

    return call


def _plain_read(step: _Step) -> Callable[[], object]:
    blocks = torch.unique(step.table[step.table > 0]).long()
    # The rows the step reads, as the planes hold them (blocks are BS rows apart).
    k = step.k_plane.view(-1, BS, HKV, D)
    v = step.v_plane.view(-1, BS, HKV, D)
    # Copies allocated like the caches (the same page size), so the floor is not
    # slowed by TLB misses the planes do not pay.
    contiguous_k = _cache_tensor(tuple(k[blocks].shape))
    contiguous_v = _cache_tensor(tuple(v[blocks].shape))
    torch.index_select(k, 0, blocks, out=contiguous_k)
    torch.index_select(v, 0, blocks, out=contiguous_v)
    return lambda: (contiguous_k.sum(), contiguous_v.sum())


# ------------------------------------------------------------------ vLLM side by side

GRID_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GRID_BLOCK_SIZES = (16, 32, 128)
GRID_MIN_ROUNDS = 15
TARGET_PREFILL_OVER_VLLM = 0.80
TARGET_DECODE_OVER_VLLM = 0.85
TARGET_BF16_DECODE_FRACTION = 0.60
TARGET_THREAD_SCALING = 1.8


@dataclass(frozen=True)
class _Vllm:
    """vLLM's CPU attention ops, loaded the way its CPU platform loads them."""

    ops: Any
    isa_for: Callable[[torch.dtype, int, int], str]
    library: str


def _load_vllm() -> _Vllm | str:
    """vLLM's CPU attention ops, or why they cannot be used (vLLM is not installed:
    the comparison is an optional benchmark environment, see docs/kernels.md)."""
    try:
        import vllm._custom_ops as ops
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception as exc:  # any import failure means: no baseline here
        return f"{type(exc).__name__}: {exc}"
    current_platform.import_kernels()
    if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
        return "vllm is importable but its CPU attention ops are not registered"
    # Which build its platform loads on this CPU (vllm/platforms/cpu.py import_kernels).
    if torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported():
        library = "vllm._C (AVX-512 with AVX512-BF16)"
    elif torch.cpu._is_avx512_supported():
        library = "vllm._C_AVX512 (AVX-512)"
    else:
        library = "vllm._C_AVX2 (AVX2)"
    version = getattr(sys.modules.get("vllm"), "__version__", "?")

    def isa_for(dtype: torch.dtype, block_size: int, head_size: int) -> str:
        return str(_get_attn_isa(dtype, block_size, head_size, "auto"))

    return _Vllm(ops=ops, isa_for=isa_for, library=f"vllm {version}: {library}")


def _attnkit_isa() -> str:
    """What attnkit's native library runs here: the prefill's instruction-set copy
    (chosen at run time) and how the decode kernel was built."""
    from attnkit.kernels.attention.cpu_native import load_paged_decode

    lib = load_paged_decode()
    isa = getattr(lib, "prefill_isa", None)
    prefill = f"prefill {isa}" if isinstance(isa, str) else "prefill: torch matmuls"
    decode_isa = getattr(lib, "decode_isa", None)
    decode = "decode -march=native"
    if callable(decode_isa):
        decode = f"decode fp32 {decode_isa(0, D)}, bf16 {decode_isa(1, D)}"
    return f"native library {lib.path.name} (-march=native build): {prefill}; {decode}"


class _GridCase:
    """One step's paged cache in both layouts (the same values): attnkit's planes
    ``[NB * bs, Hkv, D]`` and vLLM's ``[NB, Hkv, 2 * bs, D]`` (K then V per block and
    head), over a shuffled pool whose block 0 (never in a table) holds NaN."""

    def __init__(
        self, dtype: torch.dtype, bs: int, query_lens: list[int], seq_lens: list[int], seed: int
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        self.dtype, self.bs = dtype, bs
        self.query_lens, self.seq_lens = query_lens, seq_lens
        blocks = [-(-s // bs) for s in seq_lens]
        nb = sum(blocks) + 1
        order = rng.permutation(np.arange(1, nb))
        table = np.zeros((len(blocks), max(blocks)), dtype=np.int32)
        start = 0
        for r, n in enumerate(blocks):
            table[r, :n] = order[start : start + n]
            start += n
        self.table = torch.from_numpy(table)
        self.nb = nb
        esize = torch.finfo(dtype).bits // 8
        shape = (nb * bs, HKV, D)
        self.k_plane = _cache_tensor(shape, dtype)
        self.v_plane = _cache_tensor(shape, dtype)
        self.k_plane.copy_(torch.randn(shape, generator=gen))
        self.v_plane.copy_(torch.randn(shape, generator=gen))
        self.k_plane[:bs] = float("nan")
        self.v_plane[:bs] = float("nan")
        self.kv_vllm = _cache_tensor((nb, HKV, 2 * bs, D), dtype)
        self.key_cache, self.value_cache = self.kv_vllm.chunk(2, dim=2)
        self.vllm_written: str | None = None
        t = sum(query_lens)
        self.q = torch.randn(t, HQ, D, generator=gen).to(dtype)
        self.qsl = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
        self.seq = torch.tensor(seq_lens, dtype=torch.int32)
        self.scale = D**-0.5
        self.kv_bytes = sum(seq_lens) * HKV * D * esize * 2

    def slots(self, r: int) -> torch.Tensor:
        pos = torch.arange(self.seq_lens[r])
        return self.table[r, pos // self.bs].long() * self.bs + pos % self.bs

    def oracle(self) -> torch.Tensor:
        """float64 causal attention per request over its gathered context."""
        rows = []
        g = HQ // HKV
        for r, (q_len, seq) in enumerate(zip(self.query_lens, self.seq_lens, strict=True)):
            k = self.k_plane[self.slots(r)].double().repeat_interleave(g, dim=1)
            v = self.v_plane[self.slots(r)].double().repeat_interleave(g, dim=1)
            start = int(self.qsl[r])
            q = self.q[start : start + q_len].double()
            s = torch.einsum("thd,shd->hts", q, k) * self.scale
            qpos = torch.arange(seq - q_len, seq)[:, None]
            s = s.masked_fill(torch.arange(seq)[None, :] > qpos, float("-inf"))
            rows.append(torch.einsum("hts,shd->thd", s.softmax(-1), v))
        return torch.cat(rows)

    def attnkit(self) -> tuple[Callable[[], object], torch.Tensor]:
        """The engine cpu_attn runs for this step, over the planes (no K/V write)."""
        from attnkit.backends.cpu_attn import NATIVE_MAX_QUERY
        from attnkit.kernels.attention.cpu_decode import paged_attention_requests
        from attnkit.kernels.attention.cpu_prefill import paged_prefill

        out = torch.empty_like(self.q)
        if max(self.query_lens) <= NATIVE_MAX_QUERY:

            def call() -> object:
                paged_attention_requests(
                    self.q, self.k_plane, self.v_plane, self.table, self.qsl, self.seq, None,
                    block_size=self.bs, causal=True, window=None, chunk=None,
                    scale=self.scale, output=out,
                )  # fmt: skip
                return out

            return call, out
        n = len(self.query_lens)
        requests = np.arange(n, dtype=np.int64)
        starts = self.qsl[:-1].numpy().astype(np.int64)
        qlens = np.asarray(self.query_lens, dtype=np.int64)
        seqs = np.asarray(self.seq_lens, dtype=np.int64)

        def prefill() -> object:
            paged_prefill(
                self.q, self.k_plane, self.v_plane, self.table, requests, starts, qlens, seqs,
                block_size=self.bs, causal=True, window=None, chunk=None, scale=self.scale,
                output=out,
            )  # fmt: skip
            return out

        return prefill, out

    def vllm(self, v: _Vllm) -> tuple[Callable[[], object], torch.Tensor, str]:
        """vLLM's op over its cache layout, with the ISA and scheduler its backend uses
        (the scheduler metadata is built once, as its metadata builder does per step)."""
        isa = v.isa_for(self.dtype, self.bs, D)
        if self.vllm_written != isa:
            # vLLM's blocks have an ISA-specific inner layout: its own write op fills
            # them, every slot from the planes (block 0's NaN included).
            slots = torch.arange(self.nb * self.bs, dtype=torch.int64)
            v.ops.cpu_attn_reshape_and_cache(
                self.k_plane, self.v_plane, self.key_cache, self.value_cache, slots, isa
            )
            self.vllm_written = isa
        sched = v.ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(self.query_lens), num_heads=HQ, num_kv_heads=HKV, head_dim=D,
            seq_lens=self.seq, dtype=self.dtype, query_start_loc=self.qsl, causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=True,
        )  # fmt: skip
        out = torch.empty_like(self.q)

        def call() -> object:
            v.ops.cpu_attention_with_kv_cache(
                query=self.q, key_cache=self.key_cache, value_cache=self.value_cache,
                output=out, query_start_loc=self.qsl, seq_lens=self.seq, scale=self.scale,
                causal=True, alibi_slopes=None, sliding_window=-1, block_table=self.table,
                softcap=0.0, scheduler_metadata=sched, s_aux=None,
            )  # fmt: skip
            return out

        return call, out, isa

    def plain_read(self) -> Callable[[], object]:
        """``sum`` over contiguous copies of exactly the K and V blocks the step reads."""
        blocks = torch.unique(self.table[self.table > 0]).long()
        k = self.k_plane.view(-1, self.bs, HKV, D)
        v = self.v_plane.view(-1, self.bs, HKV, D)
        ck = _cache_tensor(tuple(k[blocks].shape), self.dtype)
        cv = _cache_tensor(tuple(v[blocks].shape), self.dtype)
        torch.index_select(k, 0, blocks, out=ck)
        torch.index_select(v, 0, blocks, out=cv)
        # Summed as float32 words whatever the dtype (the same bytes): torch's bfloat16
        # sum with a float32 accumulator reads at about 1 GB/s here, no floor at all.
        fk, fv = ck.view(torch.float32), cv.view(torch.float32)
        return lambda: (fk.sum(), fv.sum())


def _rounds(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Every function once per round, in the same order, after one warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return times


def _vs_vllm(v: _Vllm, threads: list[int], rounds: int, quick: bool) -> dict[str, Any]:
    """attnkit's CPU engines against vLLM's CPU attention on the same cache contents."""
    decode_b, decode_ctx = (8, 1024) if quick else (32, 2048)
    prefill_b, prefill_len = (2, 256) if quick else (4, 512)
    shapes = {
        "decode": ([1] * decode_b, [decode_ctx] * decode_b),
        "prefill": ([prefill_len] * prefill_b, [prefill_len] * prefill_b),
    }
    before = torch.get_num_threads()
    rows: list[dict[str, Any]] = []
    for case_name, (qlens, seqs) in shapes.items():
        for dname, dtype in GRID_DTYPES.items():
            for bs in GRID_BLOCK_SIZES:
                case = _GridCase(dtype, bs, qlens, seqs, seed=bs)
                want = case.oracle()
                ours, ours_out = case.attnkit()
                read = case.plain_read() if case_name == "decode" else None
                for n in threads:
                    torch.set_num_threads(n)
                    # vLLM's scheduler metadata is made for the current thread count.
                    theirs, theirs_out, isa = case.vllm(v)
                    fns: dict[str, Callable[[], object]] = {"attnkit": ours, "vllm": theirs}
                    if read is not None:
                        fns["plain_read"] = read
                    times = _rounds(fns, rounds)
                    row: dict[str, Any] = {
                        "case": case_name, "dtype": dname, "block_size": bs, "threads": n,
                        "vllm_isa": isa, "rounds": rounds,
                        "attnkit_err": float((ours_out.double() - want).abs().max()),
                        "vllm_err": float((theirs_out.double() - want).abs().max()),
                    }  # fmt: skip
                    for name, ts in times.items():
                        row[f"{name}_s"] = statistics.median(ts)
                    row["attnkit_over_vllm"] = statistics.median(
                        a / b for a, b in zip(times["attnkit"], times["vllm"], strict=True)
                    )
                    if "plain_read" in times:
                        row["attnkit_fraction_of_read"] = statistics.median(
                            r / a
                            for a, r in zip(times["attnkit"], times["plain_read"], strict=True)
                        )
                        row["vllm_fraction_of_read"] = statistics.median(
                            r / b for b, r in zip(times["vllm"], times["plain_read"], strict=True)
                        )
                        row["attnkit_gbps"] = case.kv_bytes / 1e9 / row["attnkit_s"]
                        row["vllm_gbps"] = case.kv_bytes / 1e9 / row["vllm_s"]
                        row["plain_read_gbps"] = case.kv_bytes / 1e9 / row["plain_read_s"]
                    rows.append(row)
                    print(_grid_line(row), flush=True)
                del case, ours, read
    torch.set_num_threads(before)
    return {
        "shapes": {
            "decode": f"{decode_b} x {decode_ctx} context, Hq {HQ} / Hkv {HKV}, D {D}",
            "prefill": f"{prefill_b} x {prefill_len} tokens causal, Hq {HQ} / Hkv {HKV}, D {D}",
        },
        "vllm": v.library,
        "attnkit": _attnkit_isa(),
        "rows": rows,
        "scaling": _scaling(rows),
        "targets": {
            "prefill_over_vllm": TARGET_PREFILL_OVER_VLLM,
            "decode_over_vllm": TARGET_DECODE_OVER_VLLM,
            "bf16_decode_fraction_of_read": TARGET_BF16_DECODE_FRACTION,
            "decode_two_thread_speedup": TARGET_THREAD_SCALING,
        },
    }


def _scaling(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Decode's speed-up from 1 to 2 threads per dtype and block size (one run's medians)."""
    out = []
    by_key = {(r["case"], r["dtype"], r["block_size"], r["threads"]): r for r in rows}
    for (case, dname, bs, n), row in by_key.items():
        one = by_key.get((case, dname, bs, 1))
        if case != "decode" or n != 2 or one is None:
            continue
        speedups = {k: one[f"{k}_s"] / row[f"{k}_s"] for k in ("attnkit", "vllm")}
        out.append({"dtype": dname, "block_size": bs, **speedups})
    return out


def _grid_line(r: dict[str, Any]) -> str:
    target = TARGET_DECODE_OVER_VLLM if r["case"] == "decode" else TARGET_PREFILL_OVER_VLLM
    mark = "meets" if r["attnkit_over_vllm"] <= target else "MISSES"
    line = (
        f"  {r['case']:7s} {r['dtype']} bs {r['block_size']:3d} {r['threads']}T: attnkit "
        f"{r['attnkit_s'] * 1e3:7.2f} ms, vllm ({r['vllm_isa']}) {r['vllm_s'] * 1e3:7.2f} ms, "
        f"attnkit/vllm {r['attnkit_over_vllm']:.2f} ({mark} <= {target})"
    )
    if "attnkit_fraction_of_read" in r:
        line += (
            f"; of plain read: attnkit {r['attnkit_fraction_of_read']:.0%}, vllm "
            f"{r['vllm_fraction_of_read']:.0%} ({r['plain_read_gbps']:.1f} GB/s)"
        )
    return line + f"; max |err| vs float64 {r['attnkit_err']:.1e} / {r['vllm_err']:.1e}"


def _quant_decode(reps: int, quick: bool) -> dict[str, Any]:
    """The native decode over bf16, fp8 e4m3 (per-head scales) and int8 per-token-head
    planes holding the same keys (module docstring, "Quantised caches")."""
    from attnkit.kernels.attention.cpu_decode import paged_attention_requests
    from attnkit.kernels.attention.reference import quantise_per_token_head, quantise_static
    from attnkit.kv_cache import cache_buffer

    b, ctx = (16, 1024) if quick else (32, 2048)
    gen = torch.Generator().manual_seed(3)
    width = ctx // BS
    nb = b * width + 1
    rows = nb * BS
    table = (torch.randperm(nb - 1, generator=gen) + 1).reshape(b, width).to(torch.int32)
    k = torch.randn(rows, HKV, D, generator=gen)
    v = torch.randn(rows, HKV, D, generator=gen)
    q = torch.randn(b, HQ, D, generator=gen).to(torch.bfloat16)
    scales = (k.abs().amax(dim=(0, 2)) / 448, v.abs().amax(dim=(0, 2)) / 448)

    def planes(x: torch.Tensor, s: torch.Tensor | None, kind: str) -> torch.Tensor:
        if kind == "bf16":
            stored = x.to(torch.bfloat16)
        elif kind == "fp8_e4m3":
            assert s is not None
            stored = quantise_static(x, s, torch.float8_e4m3fn)
        else:
            val, sc = quantise_per_token_head(x, torch.int8)
            raw = torch.cat([val.view(torch.uint8), sc.view(torch.uint8).reshape(rows, HKV, 4)], -1)
            stored = raw.view(torch.int8)
        buf = cache_buffer(stored.numel() * stored.element_size(), "cpu")
        out = buf.view(stored.dtype).view(stored.shape)
        out.copy_(stored)
        return out

    qsl = torch.arange(b + 1, dtype=torch.int32)
    seq = torch.full((b,), ctx, dtype=torch.int32)
    cases: dict[str, tuple[torch.Tensor, ...]] = {}
    for kind in ("bf16", "fp8_e4m3", "int8_per_token_head"):
        pk = planes(k, scales[0], kind)
        pv = planes(v, scales[1], kind)
        cases[kind] = (pk, pv)
    outs = {kind: torch.empty_like(q) for kind in cases}

    def run(kind: str) -> Callable[[], object]:
        pk, pv = cases[kind]
        static = kind == "fp8_e4m3"

        def call() -> None:
            paged_attention_requests(
                q, pk, pv, table, qsl, seq, None, block_size=BS, causal=True, window=None,
                chunk=None, scale=D**-0.5, output=outs[kind],
                k_scale=scales[0] if static else None, v_scale=scales[1] if static else None,
            )  # fmt: skip

        return call

    def oracle_err(kind: str) -> float:
        from attnkit.kernels.attention.cpu_kv_format import dequantise_rows

        pk, pv = cases[kind]
        if kind == "bf16":
            kd, vd = pk.double(), pv.double()
        else:
            static = kind == "fp8_e4m3"
            kd = dequantise_rows(pk, scales[0] if static else None).double()
            vd = dequantise_rows(pv, scales[1] if static else None).double()
        worst = 0.0
        for r in range(0, b, max(1, b // 4)):  # a few requests: the oracle is slow
            idx = (table[r].long()[:, None] * BS + torch.arange(BS)).flatten()[:ctx]
            kk = kd[idx].repeat_interleave(HQ // HKV, 1)
            vv = vd[idx].repeat_interleave(HQ // HKV, 1)
            sc = torch.einsum("hd,khd->hk", q[r].double(), kk) * D**-0.5
            want = torch.einsum("hk,khd->hd", sc.softmax(-1), vv)
            worst = max(worst, float((outs[kind][r].double() - want).abs().max()))
        return worst

    rounds = 3 * reps
    result: dict[str, Any] = {
        "shape": f"{b} x {ctx} context, Hq {HQ} / Hkv {HKV}, D {D}, bf16 queries",
        "rounds": rounds,
    }
    for kind in ("fp8_e4m3", "int8_per_token_head"):
        t_q, t_bf16, ratio = _paired(run(kind), run("bf16"), rounds)
        kv_bytes = 2 * b * ctx * cases[kind][0][0].numel() * cases[kind][0].element_size()
        result[kind] = {
            "forward_s": t_q,
            "bf16_forward_s": t_bf16,
            "time_over_bf16": 1.0 / ratio,
            "kv_bytes": kv_bytes,
            "bf16_kv_bytes": 2 * b * ctx * HKV * D * 2,
            "max_err": oracle_err(kind),
        }
    result["bf16_max_err"] = oracle_err("bf16")
    return result


def _main_quant(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    reps = args.reps or (3 if args.quick else 5)
    row = _quant_decode(reps, args.quick)
    print(
        f"quantised decode {row['shape']}, {torch.get_num_threads()} thread(s), median of {row['rounds']} paired rounds:"
    )
    for kind in ("fp8_e4m3", "int8_per_token_head"):
        r = row[kind]
        print(
            f"  {kind:20s} {r['forward_s'] * 1e3:7.2f} ms vs bf16 {r['bf16_forward_s'] * 1e3:7.2f} ms: "
            f"{r['time_over_bf16']:.2f}x the time, {r['kv_bytes'] / 1e6:.0f} MB of K/V against "
            f"{r['bf16_kv_bytes'] / 1e6:.0f} MB; max |err| vs float64 {r['max_err']:.1e}"
        )
    print(f"  bf16 max |err| vs float64 {row['bf16_max_err']:.1e}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_cpu_quant.json"
    path.write_text(json.dumps(row, indent=2))
    print(f"wrote {path}")
    return 0


def _mla_decode(reps: int, quick: bool) -> dict[str, Any]:
    """Absorbed MLA decode through the runtime: ``cpu_mla`` against ``reference`` on the
    same steps (DeepSeek-V3's latent, 576 = 512 + 64, 16 heads, bfloat16), in paired
    alternating rounds (the speedup: the median per-round ratio), each side's output
    against a float64 oracle of the last step."""
    from attnkit import AttentionRuntime, MLAAttentionSpec, ScheduledRequest

    b, ctx, heads, d, r = (4, 512, 16, 576, 512) if quick else (8, 1024, 16, 576, 512)
    scale = 192**-0.5
    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    lat = torch.randn(b, ctx + reps + 2, d, generator=gen).to(dt)
    q = torch.randn(b, heads, d, generator=gen).to(dt)

    def runtime(name: str) -> AttentionRuntime:
        spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=d, dtype=dt)
        rt = AttentionRuntime(
            {"l": spec}, AttentionConfig(backend=name), device="cpu",
            memory_budget_bytes=1 << 30,
            layer_params={"l": AttentionLayerParams(num_heads=heads, v_head_size=r, scale=scale)},
        )  # fmt: skip
        step = rt.begin_step([ScheduledRequest(f"r{i}", ctx) for i in range(b)])
        rows = step.token_slices()
        keys = torch.zeros(step.num_tokens, 1, d, dtype=dt)
        for i in range(b):
            keys[rows[f"r{i}"], 0] = lat[i, :ctx]
        rt.forward("l", torch.zeros(step.num_tokens, heads, d, dtype=dt), keys, None)
        return rt

    sides = {name: runtime(name) for name in ("cpu_mla", "reference")}
    seen = dict.fromkeys(sides, ctx)
    outs: dict[str, torch.Tensor] = {}

    def decode(name: str) -> Callable[[], object]:
        def run() -> object:
            rt = sides[name]
            n = seen[name]
            rt.begin_step([ScheduledRequest(f"r{i}", 1) for i in range(b)])
            outs[name] = rt.forward("l", q, lat[:, n : n + 1], None)
            seen[name] = n + 1
            return outs[name]

        return run

    mine, ref, ratio = _alternating(decode("cpu_mla"), decode("reference"), reps)
    errs = {}
    for name, out in outs.items():
        n = seen[name]
        want = torch.stack([
            torch.softmax(scale * q[i].double() @ lat[i, :n].double().T, -1) @ lat[i, :n, :r].double()
            for i in range(b)
        ])  # fmt: skip
        errs[name] = (out.double() - want).abs().max().item()
    flops = 2 * 2 * b * heads * (ctx + reps) * d  # scores and values, a multiply-add each
    return {
        "shape": f"{b} x {ctx}, H {heads}, D {d} / R {r}, bf16",
        "rounds": reps,
        "cpu_mla_s": mine,
        "reference_s": ref,
        "speedup": 1 / ratio,
        "cpu_mla_gflops": flops / mine / 1e9,
        "max_err": errs,
    }


def _main_mla(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    row = _mla_decode(args.reps or (5 if args.quick else 15), args.quick)
    print(
        f"MLA decode {row['shape']}, {torch.get_num_threads()} thread(s), median of "
        f"{row['rounds']} paired rounds: cpu_mla {row['cpu_mla_s'] * 1e3:.2f} ms, reference "
        f"{row['reference_s'] * 1e3:.2f} ms ({row['speedup']:.1f}x); cpu_mla at "
        f"{row['cpu_mla_gflops']:.0f} GFLOP/s; max |err| vs float64 "
        + ", ".join(f"{k} {v:.1e}" for k, v in row["max_err"].items())
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_cpu_mla.json"
    path.write_text(json.dumps(row, indent=2))
    print(f"wrote {path}")
    return 0


def _demo(backend_per_kind: str | None) -> dict[str, float]:
    from attnkit.demo import run_demo

    rows = {}
    for label in ("first_run", "second_run"):
        result = run_demo(backend_per_kind=backend_per_kind, out=io.StringIO())
        rows[f"{label}_tokens_per_s"] = result.tokens / result.seconds
        rows[f"{label}_passed"] = float(result.passed)
    return rows


def main(argv: list[str] | None = None) -> int:
    global BS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--quick", action="store_true", help="the smaller shapes, fewer reps")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--no-demo", action="store_true", help="skip the demo before/after")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for every path (default 1: on a shared 2-core machine each "
        "parallel region of a small op waits milliseconds for a busy core)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="cache block size")
    parser.add_argument(
        "--no-compiled",
        action="store_true",
        help="skip flex_attention (compiled FlexAttention)",
    )
    parser.add_argument(
        "--vllm",
        choices=("auto", "only", "no"),
        default="auto",
        help="vLLM's CPU attention side by side (when vllm is importable): auto (after "
        "the rest), only (nothing else), no",
    )
    parser.add_argument(
        "--grid-threads",
        default="1,2",
        help="thread counts of the vLLM comparison, comma-separated (default 1,2)",
    )
    parser.add_argument(
        "--grid-rounds",
        type=int,
        default=GRID_MIN_ROUNDS,
        help=f"paired rounds per case of the vLLM comparison (default {GRID_MIN_ROUNDS})",
    )
    parser.add_argument(
        "--determinism",
        choices=("auto", "only", "no"),
        default="auto",
        help="each CPU backend's cost at each determinism level it declares: auto (after "
        "the rest), only (nothing else), no",
    )
    parser.add_argument(
        "--fp8",
        choices=("only", "no"),
        default="no",
        help="the native decode over fp8 / int8 caches against a bf16 cache: only "
        "(nothing else), no (default)",
    )
    parser.add_argument(
        "--mla",
        choices=("only", "no"),
        default="no",
        help="absorbed MLA decode, cpu_mla against reference: only (nothing else), no (default)",
    )
    args = parser.parse_args(argv)
    if args.mla == "only":
        BS = args.block_size
        return _main_mla(args)
    if args.fp8 == "only":
        BS = args.block_size
        return _main_quant(args)
    if args.vllm == "only":
        return _main_vllm(args)
    if args.determinism == "only":
        torch.set_num_threads(args.threads)
        BS = args.block_size
        return _main_determinism(args)
    torch.set_num_threads(args.threads)
    BS = args.block_size
    from attnkit.backends.cpu_attn import CpuAttentionBackend
    from attnkit.backends.flex_attention import FlexAttentionBackend, compile_records

    reasons = CpuAttentionBackend.environment_reasons(torch.device("cpu"))
    if reasons:
        print("cpu_attn cannot run here: " + "; ".join(reasons))
        return 0
    flex_reasons = FlexAttentionBackend.environment_reasons(torch.device("cpu"))
    if flex_reasons and not args.no_compiled:
        print("flex_attention cannot run here, skipped: " + "; ".join(flex_reasons))
        args.no_compiled = True
    reps = args.reps or (3 if args.quick else 5)
    decode_b, decode_ctx = (16, 1024) if args.quick else (32, 2048)
    prefill_b, prefill_len = (2, 256) if args.quick else (4, 512)
    results: dict[str, Any] = {"threads": torch.get_num_threads()}

    step = _Step([1] * decode_b, [decode_ctx - 1] * decode_b)
    gb = step.kv_bytes() / 1e9
    rounds = reps * 3
    engines, forward = _paged("cpu_attn", step, reps)
    engines["forward_s"], read_s, fraction = _paired(forward, _plain_read(step), rounds)
    engines["sdpa_s"], sdpa_s, engines_over_sdpa = _paired(forward, _sdpa(step), reps)
    ref, ref_forward = _paged("reference", step, 1)
    ref["forward_s"] = _median_seconds(ref_forward, max(1, reps // 2))
    decode: dict[str, Any] = {
        "shape": f"{decode_b} x {decode_ctx} context, Hq {HQ} / Hkv {HKV}, D {D}, fp32",
        "kv_gb": gb,
        "rounds": rounds,
        "cpu_attn": engines,
        "reference": ref,
        "sdpa_dense_s": sdpa_s,
        "plain_read_s": read_s,
        "cpu_attn_gbps": gb / engines["forward_s"],
        "reference_gbps": gb / ref["forward_s"],
        "sdpa_dense_gbps": gb / sdpa_s,
        "plain_read_gbps": gb / read_s,
        "cpu_attn_fraction_of_read": fraction,
        "cpu_attn_over_sdpa": engines_over_sdpa,
    }
    decode["reference_fraction_of_read"] = read_s / ref["forward_s"]
    decode["cpu_attn_over_reference"] = ref["forward_s"] / engines["forward_s"]
    if not args.no_compiled:
        compiled, compiled_forward = _paged("flex_attention", step, reps)
        compiled["forward_s"] = _median_seconds(compiled_forward, reps, warmup=0)
        decode["flex_attention"] = compiled
        decode["flex_attention_gbps"] = gb / compiled["forward_s"]
        decode["flex_attention_fraction_of_read"] = read_s / compiled["forward_s"]
    results["decode"] = decode
    del step

    step = _Step([prefill_len] * prefill_b, [0] * prefill_b, seed=1)
    engines, forward = _paged("cpu_attn", step, reps)
    engines["forward_s"], sdpa_s, engines_over_sdpa = _paired(forward, _sdpa(step), reps)
    ref, ref_forward = _paged("reference", step, 1)
    ref["forward_s"] = _median_seconds(ref_forward, max(1, reps // 2))
    prefill: dict[str, Any] = {
        "shape": f"{prefill_b} x {prefill_len} tokens causal, Hq {HQ} / Hkv {HKV}, D {D}, fp32",
        "rounds": reps,
        "cpu_attn": engines,
        "reference": ref,
        "sdpa_causal_s": sdpa_s,
        "cpu_attn_over_sdpa": engines_over_sdpa,
        "reference_over_sdpa": sdpa_s / ref["forward_s"],
        "cpu_attn_over_reference": ref["forward_s"] / engines["forward_s"],
    }
    if not args.no_compiled:
        compiled, compiled_forward = _paged("flex_attention", step, reps)
        compiled["forward_s"] = _median_seconds(compiled_forward, reps, warmup=0)
        prefill["flex_attention"] = compiled
        prefill["flex_attention_over_sdpa"] = sdpa_s / compiled["forward_s"]
    results["prefill"] = prefill
    if not args.no_demo:
        everything = ",".join(
            f"{k}=reference" for k in ("full_attention", "sliding_window", "mamba")
        )
        results["demo"] = {"reference": _demo(everything), "default": _demo(None)}
    results["compiles"] = [dataclass_row(r) for r in compile_records()]
    results["targets"] = {
        "decode_fraction_of_plain_read": TARGET_DECODE_FRACTION,
        "prefill_over_sdpa": TARGET_PREFILL_RATIO,
    }

    d, p = results["decode"], results["prefill"]
    print(f"decode {d['shape']} ({d['kv_gb']:.2f} GB of K/V), this machine:")
    for name in ("cpu_attn", "flex_attention", "reference", "sdpa_dense", "plain_read"):
        if f"{name}_gbps" in d:
            print(f"  {name:14s} {d[f'{name}_gbps']:7.2f} GB/s")
    ok = d["cpu_attn_fraction_of_read"] >= TARGET_DECODE_FRACTION
    print(
        f"  cpu_attn / plain read {d['cpu_attn_fraction_of_read']:.0%} "
        f"({'meets' if ok else 'MISSES'} >= {TARGET_DECODE_FRACTION:.0%}); reference "
        f"{d['reference_fraction_of_read']:.0%}; cpu_attn {d['cpu_attn_over_sdpa']:.2f}x SDPA, "
        f"{d['cpu_attn_over_reference']:.0f}x reference; "
        f"build {d['cpu_attn']['build_s'] * 1e3:.2f} ms"
    )
    ok = p["cpu_attn_over_sdpa"] >= TARGET_PREFILL_RATIO
    print(f"prefill {p['shape']}, this machine:")
    print(
        f"  cpu_attn {p['cpu_attn_over_sdpa']:.2f}x SDPA causal ({'meets' if ok else 'MISSES'} "
        f">= {TARGET_PREFILL_RATIO:g}x); reference {p['reference_over_sdpa']:.2f}x; cpu_attn "
        f"{p['cpu_attn_over_reference']:.0f}x reference; "
        f"build {p['cpu_attn']['build_s'] * 1e3:.2f} ms"
    )
    if "flex_attention_over_sdpa" in p:
        print(f"  flex_attention (compiled) {p['flex_attention_over_sdpa']:.2f}x SDPA causal")
    for name, row in (("decode", d), ("prefill", p)):
        for path in ("cpu_attn", "flex_attention", "reference"):
            if path in row:
                print(f"  {name} {path} max |err| vs float64: {row[path]['max_err']:.2e}")
    if "demo" in results:
        for name, row in results["demo"].items():
            print(
                f"demo ({name}): {row['first_run_tokens_per_s']:.0f} tok/s first run, "
                f"{row['second_run_tokens_per_s']:.0f} tok/s second run"
            )
    for row in results["compiles"]:
        print(f"compiled {row['key']}: {row['seconds']:.1f} s (first call)")
    if args.determinism == "auto":
        print(
            f"determinism: each level against none, paired rounds ({torch.get_num_threads()} thread(s))"
        )
        results["determinism"] = _determinism_costs(reps, args.quick)
    if args.vllm == "auto":
        vllm = _load_vllm()
        if isinstance(vllm, str):
            print(f"vLLM's CPU attention not importable, its comparison skipped ({vllm})")
        else:
            results["vs_vllm"] = _run_vs_vllm(vllm, args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_cpu.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")
    return 0


def _main_determinism(args: argparse.Namespace) -> int:
    reps = args.reps or (3 if args.quick else 5)
    print(
        f"determinism: each level against none, paired rounds ({torch.get_num_threads()} thread(s))"
    )
    results = {
        "threads": torch.get_num_threads(),
        "determinism": _determinism_costs(reps, args.quick),
    }
    worst = results["determinism"]["cpu_attn_batch_invariant_worst_cost"]
    ok = worst <= TARGET_BATCH_INVARIANT_COST
    print(
        f"cpu_attn batch_invariant: at most {worst:.2f}x the default "
        f"({'meets' if ok else 'MISSES'} <= {TARGET_BATCH_INVARIANT_COST:.2f}x)"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_cpu_determinism.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")
    return 0


def _run_vs_vllm(vllm: _Vllm, args: argparse.Namespace) -> dict[str, Any]:
    threads = [int(x) for x in str(args.grid_threads).split(",") if x.strip()]
    rounds = max(args.grid_rounds, 1)
    print(f"attnkit against {vllm.library}; attnkit: {_attnkit_isa()}")
    print(f"  paired rounds: {rounds}, medians; threads {threads}")
    out = _vs_vllm(vllm, threads, rounds, args.quick)
    for row in out["scaling"]:
        ok = "meets" if row["attnkit"] >= TARGET_THREAD_SCALING else "MISSES"
        print(
            f"  decode {row['dtype']} bs {row['block_size']:3d}: 2 threads / 1 thread: attnkit "
            f"{row['attnkit']:.2f}x ({ok} >= {TARGET_THREAD_SCALING}), vllm {row['vllm']:.2f}x"
        )
    return out


def _main_vllm(args: argparse.Namespace) -> int:
    vllm = _load_vllm()
    if isinstance(vllm, str):
        print(f"vLLM's CPU attention is not importable here ({vllm})")
        return 1
    results = {"vs_vllm": _run_vs_vllm(vllm, args)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_cpu_vllm.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")
    return 0


def dataclass_row(record: Any) -> dict[str, Any]:
    return {"device_type": record.device_type, "key": record.key, "seconds": record.seconds}


if __name__ == "__main__":
    sys.exit(main())
