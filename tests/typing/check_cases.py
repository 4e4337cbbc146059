"""Run mypy over tests/typing/fail and compare its errors with the tags in the files.

A line tagged ``# E: code`` (or ``# E: code-a, code-b``) must produce exactly those
mypy error codes; any other error in the folder, or a tagged error that disappears,
fails the check. Usable as a script (``python tests/typing/check_cases.py``) and
from the test suite.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

from mypy import api

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FAIL_DIR = HERE / "fail"
TAG = re.compile(r"#\s*E:\s*([a-z0-9-]+(?:\s*,\s*[a-z0-9-]+)*)\s*$")

Key = tuple[str, int, str]


def expected_errors(folder: Path = FAIL_DIR, root: Path = ROOT) -> Counter[Key]:
    """(file relative to ``root``, line, code) for every tag in the folder."""
    found: Counter[Key] = Counter()
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            match = TAG.search(line)
            if match:
                for code in match.group(1).split(","):
                    found[(rel, lineno, code.strip())] += 1
    return found


def actual_errors(folder: Path = FAIL_DIR) -> tuple[Counter[Key], list[str]]:
    """mypy's errors for the folder, with the messages for the report."""
    stdout, stderr, _status = api.run(
        [
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--output",
            "json",
            "--no-error-summary",
            str(folder.relative_to(ROOT)),
        ]
    )
    if stderr.strip():
        raise RuntimeError(f"mypy failed to run:\n{stderr}")
    found: Counter[Key] = Counter()
    messages: list[str] = []
    for line in stdout.splitlines():
        if not line.startswith("{"):
            raise RuntimeError(f"unexpected mypy output line: {line}")
        error = json.loads(line)
        if error["severity"] != "error":
            continue
        key = (Path(error["file"]).as_posix(), int(error["line"]), str(error["code"]))
        found[key] += 1
        messages.append(f"{key[0]}:{key[1]}: [{key[2]}] {error['message']}")
    return found, messages


def check() -> list[str]:
    """Every difference between tags and mypy's errors; empty when they agree."""
    import os

    os.chdir(ROOT)  # mypy reports paths relative to the working directory
    expected = expected_errors()
    actual, messages = actual_errors()
    problems = [
        f"expected [{code}] at {file}:{line}, but mypy no longer reports it"
        for (file, line, code) in sorted((expected - actual).elements())
    ]
    problems += [
        f"unexpected [{code}] at {file}:{line}: "
        + next((m for m in messages if m.startswith(f"{file}:{line}: [{code}]")), "")
        for (file, line, code) in sorted((actual - expected).elements())
    ]
    if not expected:
        problems.append(f"no '# E: code' tags found under {FAIL_DIR}")
    return problems


def main() -> int:
    problems = check()
    for problem in problems:
        print(problem)
    if not problems:
        print(f"typing fail cases: {sum(expected_errors().values())} expected errors, all reported")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
