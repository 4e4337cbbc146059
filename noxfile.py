"""Developer sessions: ``nox -s tests``, ``typecheck``, ``lint``, ``soak``, ``bench``,
``compile``.

Every session installs torch first, pinned to the CPU build this project tests with,
so pip never resolves ``torch>=2.4`` to a multi-GB CUDA build by itself. On a GPU
machine set ``ATTNKIT_TORCH_SPEC`` (e.g. ``ATTNKIT_TORCH_SPEC="torch==2.13.0"`` from
a CUDA index, or ``ATTNKIT_TORCH_SPEC=skip`` to use a torch already installed with
``nox --no-venv``).
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = os.environ.get("ATTNKIT_NOX_PYTHON", "3.11")
TORCH_SPEC = os.environ.get("ATTNKIT_TORCH_SPEC", "torch==2.13.0")
EXAMPLE = "examples/out_of_tree_backend"
PYRIGHT = "pyright==1.1.414"


def _install(session: nox.Session, *extra: str, extras: str = "dev") -> None:
    if TORCH_SPEC != "skip":
        session.install(TORCH_SPEC)
    session.install("-e", f".[{extras}]", *extra)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Unit, kernel (Triton interpreter on CPU) and typing tests, with the transformers
    extra (tests/integrations check attnkit against transformers' eager attention)."""
    _install(session, extras="dev,transformers")
    env = {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    # One worker per core (pytest-xdist); arguments after `--` replace these.
    session.run("pytest", *(session.posargs or ["-q", "-n", "auto"]), env=env)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict, then pyright strict, over src, tests/typing/pass and examples; then
    the fail cases under each checker and the Triton launchers' annotations.

    pyright (pinned; its wheel bundles the type checker, Node.js must be on PATH) runs
    through tests/typing/run_pyright.py, so it resolves imports from this session's
    environment rather than the project's .venv.
    """
    _install(session, "-e", EXAMPLE, PYRIGHT)
    session.run("mypy")
    session.run("python", "tests/typing/run_pyright.py")
    session.run("python", "tests/typing/check_cases.py")
    session.run("python", "tests/typing/check_launchers.py")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """The runtime soak, tests/test_soak.py, at ATTNKIT_SOAK_STEPS=5000 steps per seed."""
    _install(session)
    env = {
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1"),
        "ATTNKIT_SOAK_STEPS": "5000",
    }
    session.run("pytest", *(session.posargs or ["-q"]), "tests/test_soak.py", env=env)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks that run on this machine; results are ratios to an in-run baseline."""
    _install(session)
    out = os.environ.get("ATTNKIT_BENCH_OUT", "bench-results")
    # On CPU the Triton kernels exist only under the interpreter; GPU benchmarks skip
    # with a printed reason there (benchmarks/gpu_check.sh runs them on a GPU).
    env = {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    for script in sorted(os.listdir("benchmarks")):
        if script.startswith("bench_") and script.endswith(".py"):
            session.run("python", f"benchmarks/{script}", "--out", out, env=env)


@nox.session(python=PYTHON, name="compile")
def compile_report(session: nox.Session) -> None:
    """Ahead-of-time compile report of the Triton kernels for sm_80 / sm_90 / sm_100 (no
    GPU needed): registers, spills, shared memory, tensor-core instructions per variant.

    Arguments after ``--`` go to benchmarks/compile_report.py (e.g. ``-- --full`` or
    ``-- --report-only``); the report lands in ``$ATTNKIT_BENCH_OUT/compile``.
    """
    _install(session)
    out = os.environ.get("ATTNKIT_BENCH_OUT", "bench-results")
    # Compiled kernels, never the interpreter: the report compiles what a GPU would run.
    env = {"TRITON_INTERPRET": "0"}
    args = session.posargs or []
    session.run("python", "benchmarks/compile_report.py", "--out", f"{out}/compile", *args, env=env)
    if not args:
        # The compile-marked tests (left out of `nox -s tests`): the default set's
        # report checked row by row, families and MMA rule included.
        session.run("pytest", "-q", "-m", "compile", "tests/test_compile_report.py", env=env)
