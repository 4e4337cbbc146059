"""What one ``AttentionRuntime.forward`` costs around the backend: the per-layer overhead.

A small decode step (4 requests, 40 tokens cached each; full attention, Hq 8, Hkv 2,
D 64, float32) and many ``forward`` calls on it, with ``output`` given and with
``output=None``. Backends: a no-op one defined here (its impl returns ``output``
untouched, so the figure is the runtime's own per-call work: the input checks and the
dispatch) and the CPU default, ``cpu_attn`` (the CPU engines). Reported per case:
microseconds per call, the minimum and the median over rounds.

To compare two trees, run it under each and alternate the runs on the same machine::

    PYTHONPATH=before/src python benchmarks/bench_forward.py
    PYTHONPATH=src python benchmarks/bench_forward.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

import torch
from typing_extensions import override

import attnkit
from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    FullAttentionSpec,
    ScheduledRequest,
)
from attnkit.backend_api import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    bind_builder,
)
from attnkit.registry import BUILTIN_BACKENDS, BackendRegistry


class NoopBuilder(AttentionMetadataBuilder[int, FullAttentionSpec]):
    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> int:
        return common_attn_metadata.num_actual_tokens


class NoopImpl(AttentionImpl[int]):
    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: int,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return output


class NoopBackend(AttentionBackend):
    name = "bench_noop"
    supported_devices = frozenset({"cpu"})
    supported_dtypes = frozenset({torch.float32})
    builders = (bind_builder(FullAttentionSpec, NoopBuilder, NoopImpl),)


def decode_runtime(backend: str) -> AttentionRuntime:
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    reg.register(NoopBackend)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    runtime = AttentionRuntime(
        {"l": spec},
        AttentionConfig.model_validate({"backend": backend}, context={"registry": reg}),
        device="cpu",
        memory_budget_bytes=1 << 24,
        layer_params={"l": AttentionLayerParams(num_heads=8)},
        registry=reg,
    )
    runtime.begin_step([ScheduledRequest(f"r{i}", 40) for i in range(4)])
    runtime.begin_step([ScheduledRequest(f"r{i}", 1) for i in range(4)])
    return runtime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000, help="forward calls per round")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 8, 64, generator=gen)
    k = torch.randn(4, 2, 64, generator=gen)
    v = torch.randn(4, 2, 64, generator=gen)
    out = torch.empty(4, 8, 64)
    report: dict[str, object] = {"attnkit": attnkit.__file__}
    for backend in ("bench_noop", "cpu_attn"):
        forward = decode_runtime(backend).forward
        calls = args.calls if backend == "bench_noop" else max(args.calls // 20, 1)
        for case, given in (("output given", out), ("output=None", None)):
            for _ in range(calls // 4 + 1):  # warm up
                forward("l", q, k, v, output=given)
            per_call = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                for _ in range(calls):
                    forward("l", q, k, v, output=given)
                per_call.append((time.perf_counter() - start) / calls * 1e6)
            report[f"{backend}, {case}"] = {
                "min_us": round(min(per_call), 3),
                "median_us": round(statistics.median(per_call), 3),
            }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
