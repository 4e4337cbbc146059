"""``attnkit demo --context-parallel N``: the demo on N local gloo processes, each rank
checking every step against its dense recompute (the same model's layers run densely
over each request's whole sequence, with no cache or backend; see attnkit.demo)."""

from __future__ import annotations

import io

import pytest

from attnkit.cli import main
from attnkit.demo import run_demo_context_parallel
from attnkit.errors import InvalidArgumentError


def test_two_ranks_pass_and_report_each_rank() -> None:
    out = io.StringIO()
    result = run_demo_context_parallel(2, out=out, decode_steps=2)
    text = out.getvalue()
    assert result.passed, text
    assert "context parallel: rank 0 of 2" in text
    assert "peak KV-cache blocks per rank: rank 0: " in text
    assert ", rank 1: " in text
    assert result.steps > 0
    assert result.max_error < 2e-5


def test_cli_four_ranks_on_an_mla_model(capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSeek-V3's layout (MLA layers, sharded) across 4 ranks."""
    code = main(
        [
            "demo",
            "--context-parallel",
            "4",
            "--steps",
            "2",
            "--config",
            "tests/fixtures/model-configs/deepseek-v3.json",
        ]
    )
    text = capsys.readouterr().out
    assert code == 0, text
    assert "context parallel: rank 0 of 4" in text
    assert "mla_attention" in text
    assert text.count("rank ") >= 4


def test_bad_rank_counts() -> None:
    with pytest.raises(InvalidArgumentError, match=r"an int >= 1, got 0"):
        run_demo_context_parallel(0, out=io.StringIO())
    with pytest.raises(InvalidArgumentError, match="registry, context_parallel and out"):
        run_demo_context_parallel(2, out=io.StringIO(), registry=None)
    with pytest.raises(SystemExit):
        main(["demo", "--context-parallel", "0"])
