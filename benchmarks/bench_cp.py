"""Decode context parallelism: what a rank pays per step against one device, same run.

The model: 4 full-attention layers (8 query / 2 KV heads of 64, float32, block 16),
served by the reference backend. Step: a decode of 16 requests over 1024 cached tokens
each (the cache filled by prefill steps first, untimed). For N = 2 and 4 local ranks
(``torch.distributed`` with gloo, one process each, on this machine's cores) and for
one process without context parallelism, each timed step is ``begin_step`` plus every
layer's ``forward`` (median of the repetitions).

Reported per N:
- ``bytes_per_step``: what each rank receives in the layers' all-gathers, counted from
  the shapes (``(N - 1) x tokens x heads x (head size + 1) x 4`` bytes per layer) plus
  the step fingerprint (``(N - 1) x 16`` bytes); and what an all-reduce pair would move
  instead (``2 (N - 1) / N`` of one partial per layer, in two collectives), for the
  choice documented in ``attnkit/parallel.py``;
- ``merge_us``: the host cost of ``merge_partials`` over N partials of one layer,
  timed alone in the same process;
- ``step_ratio``: a rank's step time over the single process's (> 1: slower). On CPU
  with N processes sharing two cores this is a harness figure, not a speed-up claim;
  the point of DCP is memory (each rank holds ``1 / N`` of the sharded caches), and its
  speed is a GPU question (``gpu_check.sh`` runs this with NCCL when the machine has
  more than one GPU).

    python benchmarks/bench_cp.py --out bench-results [--quick] [--backend nccl]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    ContextParallel,
    FullAttentionSpec,
)
from attnkit.parallel import merge_partials
from attnkit.runtime import ScheduledRequest

LAYERS, HQ, HKV, D, BS = 4, 8, 2, 64, 16


def _runtime(cp: ContextParallel | None, device: str) -> AttentionRuntime:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    names = [f"layers.{i}" for i in range(LAYERS)]
    return AttentionRuntime(
        dict.fromkeys(names, spec),
        AttentionConfig(backend_per_kind={"full_attention": "reference"}),
        device=device,
        memory_budget_bytes=256 * 2**20,
        layer_params=dict.fromkeys(names, AttentionLayerParams(num_heads=HQ)),
        context_parallel=cp,
    )


def _step(rt: AttentionRuntime, scheduled: list[ScheduledRequest], device: str) -> float:
    start = time.perf_counter()
    batch = rt.begin_step(scheduled)
    t = batch.num_tokens
    gen = torch.Generator().manual_seed(t)
    q = torch.randn(t, HQ, D, generator=gen).to(device)
    k = torch.randn(t, HKV, D, generator=gen).to(device)
    v = torch.randn(t, HKV, D, generator=gen).to(device)
    for i in range(LAYERS):
        rt.forward(f"layers.{i}", q, k, v)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _measure(cp: ContextParallel | None, args: argparse.Namespace, device: str) -> float:
    # One intra-op thread in every process (the single one too): N ranks share the cores.
    torch.set_num_threads(1)
    rt = _runtime(cp, device)
    ids = [f"r{i}" for i in range(args.requests)]
    for _ in range(args.context // 256):  # prefill in 256-token chunks (untimed)
        _step(rt, [ScheduledRequest(r, 256) for r in ids], device)
    times = [_step(rt, [ScheduledRequest(r, 1) for r in ids], device) for _ in range(args.reps)]
    return statistics.median(times)


def _rank(rank: int, world: int, tmp: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    device = f"cuda:{rank}" if args.backend == "nccl" else "cpu"
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        args.backend,
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        seconds = _measure(ContextParallel.from_process_group(), args, device)
        Path(tmp, f"rank{rank}.json").write_text(json.dumps({"seconds": seconds}))
    finally:
        dist.destroy_process_group()


def _merge_us(world: int, tokens: int) -> float:
    gen = torch.Generator().manual_seed(0)
    outs = [torch.randn(tokens, HQ, D, generator=gen) for _ in range(world)]
    lses = [torch.randn(tokens, HQ, generator=gen) for _ in range(world)]
    target = torch.empty(tokens, HQ, D)
    times = []
    for _ in range(50):
        start = time.perf_counter()
        merge_partials(outs, lses, target)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-results", type=Path)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, N = 2 only")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    args.reps = 3 if args.quick else 7
    if args.backend == "nccl" and torch.cuda.device_count() < 2:
        print(f"bench_cp: --backend nccl needs >= 2 GPUs, found {torch.cuda.device_count()}")
        return 0
    from torch.multiprocessing.spawn import spawn

    device = "cuda:0" if args.backend == "nccl" else "cpu"
    single = _measure(None, args, device)
    rows: list[dict[str, Any]] = []
    worlds = [2] if args.quick else [2, 4]
    if args.backend == "nccl":
        worlds = [w for w in worlds if w <= torch.cuda.device_count()]
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            spawn(_rank, args=(world, tmp, args), nprocs=world, join=True)
            ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
        slowest = max(r["seconds"] for r in ranks)
        tokens = args.requests
        partial = tokens * HQ * (D + 1) * 4
        rows.append(
            {
                "world": world,
                "bytes_per_step": LAYERS * (world - 1) * partial + (world - 1) * 16,
                "all_reduce_bytes_per_step": int(LAYERS * 2 * (world - 1) / world * partial),
                "merge_us": _merge_us(world, tokens),
                "step_ratio": slowest / single,
            }
        )
    report = {
        "backend": args.backend,
        "case": f"{LAYERS} layers, {HQ}/{HKV} heads x {D}, {args.requests} requests x "
        f"{args.context} tokens, decode",
        "single_process_step_ms": single * 1e3 if args.backend == "nccl" else None,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_cp.json").write_text(json.dumps(report, indent=2))
    print(f"bench_cp ({args.backend}): {report['case']}")
    for r in rows:
        print(
            f"  N={r['world']}: {r['bytes_per_step']} B received per rank per step "
            f"(all-reduce pair: {r['all_reduce_bytes_per_step']} B), merge {r['merge_us']:.0f} us, "
            f"rank step / single step = {r['step_ratio']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
