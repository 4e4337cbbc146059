"""Run mypy and pyright over tests/typing/fail (and pass) and compare their errors with
the tags.

Every line that must fail carries one tag naming what each checker reports there::

    head_bytes(spec)  # E: arg-type | pyright: reportArgumentType
    builder.kv_cache_spec = mamba  # E: misc, assignment | pyright: reportAttributeAccessIssue
    kv_cache_spec: MambaSpec  # E: - | pyright: reportIncompatibleMethodOverride

Left of ``|``: the mypy error codes; right of ``pyright:``: the pyright rules. Several
are comma-separated (a code listed twice is expected twice); ``-`` means that checker
reports nothing on the line (the two checkers do not always report an error on the
same line, or at all). Both halves are required. For each checker, any error in
fail/ or pass/ that no tag names (pass/ has none), or a tagged error it no longer
reports, fails the check.

Usable as a script::

    python tests/typing/check_cases.py                    # both checkers
    python tests/typing/check_cases.py --checker mypy     # one of them

and from the test suite (``check(("mypy",))``). pyright runs as ``python -m pyright``
from the running interpreter's environment, which it also resolves imports from (the
project's ``[tool.pyright]`` settings, with that environment as the venv); it needs
Node.js, which the pyright package finds or fetches itself.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FAIL_DIR = HERE / "fail"
PASS_DIR = HERE / "pass"
CASE_DIRS = (FAIL_DIR, PASS_DIR)
CHECKERS = ("mypy", "pyright")

TAG_START = re.compile(r"#\s*E:")
TAG = re.compile(r"#\s*E:\s*(?P<mypy>[^|#]*?)\s*\|\s*pyright:\s*(?P<pyright>[^|#]*?)\s*$")
CODE = {"mypy": re.compile(r"^[a-z][a-z0-9-]*$"), "pyright": re.compile(r"^report[A-Z][A-Za-z]*$")}

Key = tuple[str, int, str]


class TagError(ValueError):
    """A malformed ``# E:`` tag (the message names the file and line)."""


def _codes(checker: str, text: str, where: str) -> list[str]:
    if text == "-":
        return []
    codes = [c.strip() for c in text.split(",")]
    bad = [c for c in codes if not CODE[checker].match(c)]
    if bad:
        raise TagError(f"{where}: not {checker} codes: {', '.join(map(repr, bad))}")
    return codes


def expected_errors(folder: Path = FAIL_DIR, root: Path = ROOT) -> dict[str, Counter[Key]]:
    """checker -> (file relative to ``root``, line, code) for every tag in the folder.

    Raises:
        TagError: a line has ``# E:`` without both halves, or a code that is not one.
    """
    found: dict[str, Counter[Key]] = {checker: Counter() for checker in CHECKERS}
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            if not TAG_START.search(line):
                continue
            where = f"{rel}:{lineno}"
            match = TAG.search(line)
            if match is None:
                raise TagError(
                    f"{where}: a tag must read '# E: <mypy codes or -> | pyright: <rules or ->'"
                )
            for checker in CHECKERS:
                for code in _codes(checker, match.group(checker), where):
                    found[checker][(rel, lineno, code)] += 1
    return found


def _mypy_errors(folders: Sequence[Path]) -> tuple[Counter[Key], list[str]]:
    from mypy import api

    stdout, stderr, _status = api.run(
        [
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--output",
            "json",
            "--no-error-summary",
            *(os.path.relpath(folder, ROOT) for folder in folders),
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


def pyright_config(directory: Path) -> Path:
    """A pyright config in ``directory`` extending the project's ``[tool.pyright]`` with
    the running interpreter's environment as the venv (imports resolve from it)."""
    prefix = Path(sys.prefix)
    config = directory / "pyrightconfig.json"
    config.write_text(
        json.dumps(
            {
                "extends": str(ROOT / "pyproject.toml"),
                "venvPath": str(prefix.parent),
                "venv": prefix.name,
            }
        )
    )
    return config


def run_pyright(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m pyright -p <config> *args`` from the running environment."""
    with tempfile.TemporaryDirectory() as tmp:
        config = pyright_config(Path(tmp))
        return subprocess.run(
            [sys.executable, "-m", "pyright", "-p", str(config), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )


def _pyright_errors(folders: Sequence[Path]) -> tuple[Counter[Key], list[str]]:
    result = run_pyright("--outputjson", *map(str, folders))
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(
            f"pyright failed to run (exit {result.returncode}):\n{result.stdout}{result.stderr}"
        ) from None
    found: Counter[Key] = Counter()
    messages: list[str] = []
    for diagnostic in report["generalDiagnostics"]:
        if diagnostic["severity"] not in ("error", "warning"):
            continue
        file = Path(diagnostic["file"]).resolve().relative_to(ROOT).as_posix()
        line = int(diagnostic["range"]["start"]["line"]) + 1
        rule = str(diagnostic.get("rule", "(no rule)"))
        key = (file, line, rule)
        found[key] += 1
        first = str(diagnostic["message"]).splitlines()[0]
        messages.append(f"{file}:{line}: [{rule}] {first}")
    return found, messages


def actual_errors(
    checker: str, folders: Sequence[Path] = CASE_DIRS
) -> tuple[Counter[Key], list[str]]:
    """What ``checker`` reports for the folders, with the messages for the report."""
    if checker == "mypy":
        return _mypy_errors(folders)
    if checker == "pyright":
        return _pyright_errors(folders)
    raise ValueError(f"unknown checker {checker!r}; choose from {', '.join(CHECKERS)}")


def check(checkers: Sequence[str] = CHECKERS) -> list[str]:
    """Every difference between the tags and the checkers' errors; empty when they agree."""
    os.chdir(ROOT)  # mypy reports paths relative to the working directory
    tags = [expected_errors(folder) for folder in CASE_DIRS]
    problems: list[str] = []
    for checker in checkers:
        expected = sum((t[checker] for t in tags), Counter[Key]())
        actual, messages = actual_errors(checker)
        problems += [
            f"{checker}: expected [{code}] at {file}:{line}, but it is not reported"
            for (file, line, code) in sorted((expected - actual).elements())
        ]
        problems += [
            f"{checker}: unexpected [{code}] at {file}:{line}: "
            + next((m for m in messages if m.startswith(f"{file}:{line}: [{code}]")), "")
            for (file, line, code) in sorted((actual - expected).elements())
        ]
        if not expected:
            problems.append(f"{checker}: no '# E:' tags name an error under {FAIL_DIR}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--checker", choices=[*CHECKERS, "all"], default="all")
    args = parser.parse_args(argv)
    checkers = CHECKERS if args.checker == "all" else (args.checker,)
    try:
        problems = check(checkers)
    except TagError as exc:
        problems = [f"bad tag: {exc}"]
    for problem in problems:
        print(problem)
    if not problems:
        expected = expected_errors()
        counts = ", ".join(f"{c}: {sum(expected[c].values())}" for c in checkers)
        print(f"typing fail cases: every expected error reported, nothing else ({counts})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
