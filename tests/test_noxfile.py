"""noxfile.py: the sessions that need torch share one environment.

Each session function is called with a stand-in for ``nox.Session`` that records what
it installs and runs, so the check needs no nox run (and no download).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nox")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import noxfile  # noqa: E402  (the repository root is not on the path by default)

sys.path.remove(str(ROOT))

SHARED = ["tests", "typecheck", "soak", "bench", "compile_report"]


@pytest.fixture(autouse=True)
def _in_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # bench lists benchmarks/, as nox runs it, from the root


class FakeVenv:
    def __init__(self, location: Path) -> None:
        self.location = str(location)


class FakeSession:
    """What a session body touches: records installs and runs."""

    def __init__(self, envdir: Path, name: str, backend: str = "virtualenv") -> None:
        self.venv_backend = backend
        self.virtualenv = FakeVenv(envdir / name)
        self.bin = str(envdir / name / "bin")
        self.posargs: list[str] = []
        self.calls: list[tuple[str, tuple[str, ...], dict[str, Any]]] = []
        self.created: list[Path] = []

    def run_install(self, *args: str, **kwargs: Any) -> None:
        self.calls.append(("run_install", args, kwargs))
        if args[1:3] == ("-m", "virtualenv"):  # make the interpreter it would make
            python = Path(args[-1]) / "bin" / "python"
            python.parent.mkdir(parents=True)
            python.touch()
            self.created.append(Path(args[-1]))

    def run(self, *args: str, **kwargs: Any) -> None:
        self.calls.append(("run", args, kwargs))

    def install(self, *args: str, **kwargs: Any) -> None:
        self.calls.append(("install", args, kwargs))


@pytest.mark.parametrize("name", SHARED)
def test_torch_sessions_run_in_the_shared_environment(name: str, tmp_path: Path) -> None:
    shared = tmp_path / "dev"
    session = FakeSession(tmp_path, name)
    getattr(noxfile, name)(session)
    assert session.created == [shared]
    kinds = [kind for kind, _, _ in session.calls]
    installs = [args for kind, args, _ in session.calls if kind == "run_install"][1:]
    runs = [(args, kwargs) for kind, args, kwargs in session.calls if kind == "run"]
    assert "install" not in kinds  # nothing into the session's own environment
    # torch first, pinned, then the project with every extra a shared session needs
    assert installs == [
        (str(shared / "bin" / "python"), "-m", "pip", "install", "torch==2.13.0"),
        (str(shared / "bin" / "python"), "-m", "pip", "install", "-e", ".[dev,transformers]"),
    ]
    assert runs
    for args, kwargs in runs:
        assert Path(args[0]).parent == shared / "bin"
        assert kwargs["env"]["VIRTUAL_ENV"] == str(shared)
        assert kwargs["env"]["PATH"].startswith(str(shared / "bin"))


def test_a_second_session_reuses_the_environment(tmp_path: Path) -> None:
    noxfile.tests(FakeSession(tmp_path, "tests"))
    session = FakeSession(tmp_path, "typecheck")
    noxfile.typecheck(session)
    assert session.created == []  # made once, by the first


def test_under_no_venv_the_current_environment_is_used(tmp_path: Path) -> None:
    session = FakeSession(tmp_path, "tests", backend="none")
    noxfile.tests(session)
    assert [(kind, args) for kind, args, _ in session.calls] == [
        ("install", ("torch==2.13.0",)),
        ("install", ("-e", ".[dev,transformers]")),
        ("run", ("pytest", "-q", "-n", "auto")),
    ]


def test_the_torch_spec_takes_pip_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    monkeypatch.setattr(noxfile, "TORCH_SPEC", cpu)
    session = FakeSession(tmp_path, "bench")
    noxfile.bench(session)
    installs = [args for kind, args, _ in session.calls if kind == "run_install"]
    assert installs[1][4:] == ("torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu")


def test_lint_keeps_its_own_small_environment(tmp_path: Path) -> None:
    session = FakeSession(tmp_path, "lint")
    noxfile.lint(session)
    assert [(kind, args) for kind, args, _ in session.calls] == [
        ("install", ("ruff>=0.6",)),
        ("run", ("ruff", "check", ".")),
    ]
