"""benchmarks/compile_report.py on one small variant (merge_attn_states) for sm_90.

Runs the report as a subprocess: the kernels must be imported compiled, not under the
Triton interpreter that the test session enables (TRITON_INTERPRET is fixed when a
kernel module is imported). Ahead-of-time compilation for NVIDIA needs no GPU, only
the ptxas / cuobjdump that Triton's NVIDIA backend ships.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "compile_report.py"


def _missing_nvidia_tools() -> str | None:
    """The report's own answer (``missing_tools``), once Triton itself imports."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    reason: str | None = _load_report_module().missing_tools()
    return reason


@pytest.mark.slow
def test_compile_report_one_variant(tmp_path: Path) -> None:
    if reason := _missing_nvidia_tools():
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # a real compile, not a hit
    args = ["--only", "merge_attn_states", "--targets", "90", "--jobs", "1"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS merge_attn_states" in proc.stdout

    report = json.loads((tmp_path / "out" / "compile_report.json").read_text())
    (row,) = report["rows"]
    assert row["status"] == "ok", row["error"]
    assert row["function"] == "_merge_attn_states_kernel"
    assert row["target"] == 90
    assert 0 < row["registers"] <= 255
    assert row["spill_bytes"] == 0
    assert row["smem_limit"] == 227 * 1024
    assert 0 <= row["shared_bytes"] <= row["smem_limit"]
    assert row["num_warps"] in (1, 2, 4, 8, 16)
    assert "HEAD_DIM=128" in row["config"]

    markdown = (tmp_path / "out" / "compile_report.md").read_text()
    rows = [line for line in markdown.splitlines() if "`_merge_attn_states_kernel`" in line]
    assert len(rows) == 1
    assert "| sm_90 |" in rows[0]
    assert "| ok |" in rows[0]
    assert f"| {row['registers']} |" in rows[0]


def _load_report_module() -> Any:
    spec = importlib.util.spec_from_file_location("attnkit_compile_report", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def test_declared_variants_follow_the_backend_capability_rule() -> None:
    """fp8_e4m3 KV is declared from sm_89 on (triton_attn's own rule), so the report
    neither compiles nor fails it on sm_80, and still compiles it on sm_90 / sm_100."""
    from attnkit.backends.triton_attn.backend import FP8_E4M3_MIN_CAPABILITY

    report = _load_report_module()
    fp8 = {"dtype": "bf16", "kv": "fp8", "block": 16, "head": 128}
    same = {**fp8, "kv": "same"}
    first = FP8_E4M3_MIN_CAPABILITY[0] * 10 + FP8_E4M3_MIN_CAPABILITY[1]
    for family in ("unified_attention", "split_kv_decode", "kv_write"):
        (reason,) = report.undeclared_reasons(family, fp8, 80)
        assert "fp8_e4m3" in reason
        assert "8.9" in reason
        assert report.undeclared_reasons(family, fp8, first) == []
        assert report.undeclared_reasons(family, fp8, 90) == []
        assert report.undeclared_reasons(family, same, 80) == []
    # MLA asks triton_mla, which declares fp8 latents from the same capability.
    mla_fp8 = {"dtype": "bf16", "kv": "fp8", "block": 64, "q_len": 1, "splits": 4}
    (reason,) = report.undeclared_reasons("mla_attention", mla_fp8, 80)
    assert "fp8_e4m3" in reason
    assert "8.9" in reason
    assert report.undeclared_reasons("mla_attention", mla_fp8, first) == []
    assert report.undeclared_reasons("mla_attention", {**mla_fp8, "kv": "same"}, 80) == []
    # A head size the backend does not declare is undeclared on every target.
    assert report.undeclared_reasons("unified_attention", {**same, "head": 512}, 90)
    # State-layer families have no capability rule.
    assert report.undeclared_reasons("mamba2", {"dtype": "bf16"}, 80) == []


def test_undeclared_rows_are_reported_not_failed() -> None:
    report = _load_report_module()
    row = report.Row("kv_write", "_write_kv_cache_kernel", 80, "cfg", ["case"])
    row.status, row.error = "undeclared", "needs 8.9"
    assert not row.failed
    assert "not declared: needs 8.9" in report.markdown_row(row)
    (line,) = report.summaries([row], [])
    assert line.startswith("PASS kv_write")
    assert "1 not declared" in line
    broken = report.Row("kv_write", "_write_kv_cache_kernel", 90, "cfg", ["case"])
    broken.status, broken.error = "error", "boom"
    assert broken.failed
    assert report.summaries([broken], [])[0].startswith("FAIL kv_write")


def test_declared_matrix_kernels_must_use_tensor_cores() -> None:
    report = _load_report_module()
    row = report.Row("mamba2", "_ssd_chunk_state_kernel", 90, "cfg", ["case"])
    row.needs_tensor_cores = True
    assert row.failed  # compiled fine, but no MMA instruction
    assert "0 NO-TC" in report.markdown_row(row)
    assert "1 without required tensor-core ops" in report.summaries([row], [])[0]
    row.tensor_core_ops = 12
    assert not row.failed
    row.needs_tensor_cores, row.tensor_core_ops = False, 0  # e.g. an elementwise kernel
    assert not row.failed


@pytest.mark.compile
def test_default_set_compiles_cleanly(tmp_path: Path) -> None:
    """The declared default set of every kernel family: no compile error, no spill, no
    shared memory over the limit, and MMA instructions wherever a module declares
    them, on sm_80, sm_90 and sm_100 (the full set runs in ``nox -s compile -- --full``)."""
    if reason := _missing_nvidia_tools():
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=1200,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "compile_report.json").read_text())
    rows = report["rows"]
    assert {r["target"] for r in rows} == {80, 90, 100}
    compiled = [r for r in rows if r["status"] == "ok"]
    assert all(r["spill_bytes"] == 0 for r in compiled)
    assert all(r["shared_bytes"] <= r["smem_limit"] for r in compiled)
    assert all(r["tensor_core_ops"] > 0 for r in compiled if r["needs_tensor_cores"])
    # Every family ran, and the matrix-product kernels were held to the MMA rule.
    families = {r["kernel"] for r in rows}
    assert {"unified_attention", "split_kv_decode", "mamba2", "gated_delta"} <= families
    assert any(r["needs_tensor_cores"] for r in compiled)
    assert all(r["status"] in ("ok", "undeclared") for r in rows)
