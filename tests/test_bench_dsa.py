"""benchmarks/bench_kernels.py's DSA part builds on CPU: the case list, the bytes
per token (checked against the formats, written out here) and a --smoke run of the
timed cases on the torch reference kernels."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
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


def test_the_smoke_run_times_the_triton_kernels_under_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bench = _bench()
    args = argparse.Namespace(smoke=True, warmup=0, iters=1)
    results = bench.dsa_results(args, torch.device("cpu"), None)
    assert {r.impl for r in results} == {"reference (torch)", "triton"}


def test_a_triton_selection_that_differs_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the benchmark times nothing whose selection is not the reference's."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from attnkit.kernels.dsa import triton as triton_dsa

    own = triton_dsa.topk_select

    def one_short(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        indices, lens = own(*args, **kwargs)  # type: ignore[arg-type]  # (passed through)
        indices = indices.clone()
        indices[:, 0] = -1
        return indices, lens

    monkeypatch.setattr(triton_dsa, "topk_select", one_short)
    bench = _bench()
    args = argparse.Namespace(smoke=True, warmup=0, iters=1)
    with pytest.raises(AssertionError, match="selection differs"):
        bench.dsa_results(args, torch.device("cpu"), None)
