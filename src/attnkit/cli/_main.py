"""``main``: the ``attnkit`` command's entry point (parse, run the subcommand, report a
user error as one line and exit status 2)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

import pydantic

from ..errors import AttnkitError
from ..registry import BackendRegistry, default_registry
from ._backends import cmd_backends
from ._common import EXIT_USAGE, Streams
from ._demo import cmd_demo
from ._parser import parse_args
from ._plan import cmd_plan

_COMMANDS: dict[str, Callable[[argparse.Namespace, BackendRegistry, Streams], int]] = {
    "backends": cmd_backends,
    "plan": cmd_plan,
    "demo": cmd_demo,
}


def _message(exc: AttnkitError | pydantic.ValidationError) -> str:
    if isinstance(exc, pydantic.ValidationError):
        return "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
    return str(exc) or type(exc).__name__


def main(
    argv: Sequence[str] | None = None,
    *,
    registry: BackendRegistry | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Entry point of the ``attnkit`` command; returns the exit status.

    Bad command lines exit through argparse (``SystemExit(2)``, the message on
    stderr). Otherwise: 0 on success, ``EXIT_FAILED`` (1), or ``EXIT_USAGE`` (2) for a
    user error (an ``AttnkitError`` or a rejected configuration), reported as one line
    on ``err`` (a ``NoBackendError``'s reasons follow) unless ``--debug`` re-raises it.
    """
    args = parse_args(argv)
    io = Streams(
        f"attnkit {args.command}",
        out if out is not None else sys.stdout,
        err if err is not None else sys.stderr,
    )
    try:
        registry = registry if registry is not None else default_registry()
        return _COMMANDS[args.command](args, registry, io)
    except (AttnkitError, pydantic.ValidationError) as exc:
        if args.debug:
            raise
        io.error(_message(exc))
        return EXIT_USAGE
