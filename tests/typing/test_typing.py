"""The typing contract under mypy --strict (pass cases clean, fail cases exactly the
tagged errors) and, where Node.js is available, under pyright strict."""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

import check_cases  # noqa: E402  (lives beside this file)
import check_launchers  # noqa: E402

pytestmark = pytest.mark.typing


def test_pass_cases_type_check_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    from mypy import api

    monkeypatch.chdir(ROOT)
    stdout, stderr, status = api.run(
        ["--config-file", "pyproject.toml", "--no-error-summary", "src", "tests/typing/pass"]
    )
    assert (status, stdout, stderr) == (0, "", "")


def test_fail_cases_report_exactly_the_tagged_mypy_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert check_cases.check(("mypy",)) == []


def _pyright_available() -> bool:
    try:
        import pyright  # noqa: F401
    except ImportError:
        return False
    return shutil.which("node") is not None


@pytest.mark.skipif(
    not _pyright_available(), reason="pyright strict needs the pyright package and Node.js"
)
def test_cases_report_exactly_the_tagged_pyright_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """pyright over fail/ and pass/ together (about 10 s); nox -s typecheck also runs it
    over the whole project."""
    monkeypatch.chdir(ROOT)
    assert check_cases.check(("pyright",)) == []


def test_tags_are_parsed(tmp_path: Path) -> None:
    case = tmp_path / "case.py"
    case.write_text(
        "x: int = 'a'  # E: assignment | pyright: reportAssignmentType\n"
        "y = 1\n"
        "z = f()  # E: name-defined, misc | pyright: -\n"
        "class B(A):  # E: - | pyright: reportUndefinedVariable, reportUntypedBaseClass\n"
    )
    found = check_cases.expected_errors(tmp_path, root=tmp_path)
    assert sorted(found["mypy"].elements()) == [
        ("case.py", 1, "assignment"),
        ("case.py", 3, "misc"),
        ("case.py", 3, "name-defined"),
    ]
    assert sorted(found["pyright"].elements()) == [
        ("case.py", 1, "reportAssignmentType"),
        ("case.py", 4, "reportUndefinedVariable"),
        ("case.py", 4, "reportUntypedBaseClass"),
    ]


@pytest.mark.parametrize(
    "line",
    [
        "x = 1  # E: assignment",  # no pyright half
        "x = 1  # E: | pyright: reportAssignmentType",  # empty mypy half
        "x = 1  # E: assignment | pyright: assignment",  # a mypy code as a pyright rule
        "x = 1  # E: reportAssignmentType | pyright: -",  # a pyright rule as a mypy code
    ],
)
def test_malformed_tags_are_rejected(tmp_path: Path, line: str) -> None:
    (tmp_path / "case.py").write_text(line + "\n")
    with pytest.raises(check_cases.TagError, match=r"case\.py:1"):
        check_cases.expected_errors(tmp_path, root=tmp_path)


def test_every_triton_launcher_is_annotated() -> None:
    assert check_launchers.unannotated() == []


def test_the_launcher_check_covers_every_triton_module() -> None:
    """The check reads the modules from mypy's override, and every module that defines a
    ``@triton.jit`` kernel is among them (a kernel module outside the override would
    fail mypy strict; one inside it is checked here)."""
    files, stale = check_launchers.relaxed_modules()
    assert stale == []
    src = check_launchers.SRC / "attnkit"

    def defines_a_kernel(path: Path) -> bool:
        tree = ast.parse(path.read_text())
        return any(
            isinstance(node, ast.FunctionDef) and check_launchers._is_triton_kernel(node)
            for node in ast.walk(tree)
        )

    jit = {p for p in src.rglob("*.py") if defines_a_kernel(p)}
    assert jit
    assert jit <= set(files)


def test_launcher_module_patterns_follow_mypy(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    for rel in ("a/triton.py", "a/reference.py", "b/c/triton.py", "_t/__init__.py", "_t/x.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("")
    files, stale = check_launchers.relaxed_modules(
        ["pkg.*.triton", "pkg._t.*", "pkg.gone"], src=tmp_path
    )
    assert [f.relative_to(pkg).as_posix() for f in files] == [
        "_t/__init__.py",
        "_t/x.py",
        "a/triton.py",
        "b/c/triton.py",
    ]
    assert stale == ["pkg.gone"]


def test_launcher_check_finds_an_unannotated_launcher(tmp_path: Path) -> None:
    (tmp_path / "kernels.py").write_text(
        "import triton\n"
        "@triton.jit\n"
        "def _kernel(x_ptr, n):\n"
        "    pass\n"
        "def launch(x: int, *, grid) -> None:\n"
        "    def helper(meta):\n"
        "        return meta\n"
        "class Workspace:\n"
        "    def size(self) -> int:\n"
        "        return 0\n"
    )
    assert check_launchers.unannotated([tmp_path / "kernels.py"], root=tmp_path) == [
        "kernels.py:5: launch (missing: grid)",
        "kernels.py:6: helper (missing: meta, return)",
    ]
