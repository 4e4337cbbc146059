"""mypy --strict over the pass cases (must be clean) and the fail cases (must report
exactly the tagged errors)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

import check_cases  # noqa: E402  (lives beside this file)

pytestmark = pytest.mark.typing


def test_pass_cases_type_check_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    from mypy import api

    monkeypatch.chdir(ROOT)
    stdout, stderr, status = api.run(
        ["--config-file", "pyproject.toml", "--no-error-summary", "src", "tests/typing/pass"]
    )
    assert (status, stdout, stderr) == (0, "", "")


def test_fail_cases_report_exactly_the_tagged_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert check_cases.check() == []


def test_tags_are_parsed(tmp_path: Path) -> None:
    case = tmp_path / "case.py"
    case.write_text("x: int = 'a'  # E: assignment\ny = 1\nz = f()  # E: name-defined, misc\n")
    found = check_cases.expected_errors(tmp_path, root=tmp_path)
    assert sorted(found.elements()) == [
        ("case.py", 1, "assignment"),
        ("case.py", 3, "misc"),
        ("case.py", 3, "name-defined"),
    ]
