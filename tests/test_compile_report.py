"""benchmarks/compile_report.py on one small variant (merge_attn_states) for sm_90.

Runs the report as a subprocess: the kernels must be imported compiled, not under the
Triton interpreter that the test session enables (TRITON_INTERPRET is fixed when a
kernel module is imported). Ahead-of-time compilation for NVIDIA needs no GPU, only
the ptxas / cuobjdump that Triton's NVIDIA backend ships.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "compile_report.py"


def _missing_nvidia_tools() -> str | None:
    try:
        import triton
    except ImportError:
        return "triton is not installed"
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for tool in ("ptxas", "cuobjdump"):
        if not os.access(bin_dir / tool, os.X_OK):
            return f"Triton's NVIDIA backend tool {tool} is missing ({bin_dir / tool})"
    return None


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
