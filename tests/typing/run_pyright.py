"""Run pyright (strict, the project's ``[tool.pyright]``) with imports resolved from the
running interpreter's environment rather than the ``.venv`` the settings name.

``python tests/typing/run_pyright.py`` checks the project (src, tests/typing/pass, the
example backend); extra arguments go to pyright. ``nox -s typecheck`` runs it in its
own environment; in the project's .venv, ``.venv/bin/pyright`` does the same.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from check_cases import run_pyright


def main(argv: Sequence[str] | None = None) -> int:
    result = run_pyright(*(sys.argv[1:] if argv is None else argv))
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
