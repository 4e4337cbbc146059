"""benchmarks/bench_kernels.py's DSA part builds on CPU: the case list, the bytes
per token (checked against the formats, written out here) and a --smoke run of the
timed cases on the torch reference kernels."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_kernels.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_kernels_dsa", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_cases_are_v32_sizes_and_the_bytes_follow_the_formats() -> None:
    bench = _bench()
    contexts = {c for _, c in bench.dsa_cases(False)}
    assert contexts == {32768, 65536, 131072}
    assert (bench.DSA_HEADS, bench.DSA_TOPK, bench.DSA_INDEX_HEADS) == (128, 2048, 64)
    row = bench.dsa_bytes_per_token(131072)
    assert row["indexer_bytes"] == 131072 * (128 + 4)  # fp8 values + one fp32 scale
    assert row["sparse_mla_bytes"] == 2048 * 576 * 2  # bf16 latents
    assert row["dense_mla_bytes"] == 131072 * 576 * 2
    assert abs(row["dsa_over_dense"] - (131072 * 132 + 2048 * 1152) / (131072 * 1152)) < 1e-12


def test_the_timed_cases_run_with_smoke_on_cpu() -> None:
    bench = _bench()
    args = argparse.Namespace(smoke=True, warmup=0, iters=1)
    results = bench.dsa_results(args, torch.device("cpu"), None)
    assert {r.kind for r in results} == {"dsa-indexer", "dsa-sparse-mla"}
    assert all(r.ms is not None and r.ms > 0 for r in results)
