"""The ``attnkit`` command.

``attnkit backends``  every registered backend, what it serves, and whether it can run
                      here (with the reasons when it cannot).
``attnkit plan``      a capacity plan for a model's ``config.json`` (or an example
                      layout): layer -> kind -> group -> backend, with every skipped
                      candidate and why; the unified page and block sizes the runtime
                      runs; bytes per token and per request; blocks, tokens and
                      concurrent requests that fit in ``--gpu-memory``.
``attnkit demo``      serve a tiny hybrid model (full, sliding-window and Mamba2 layers,
                      or with ``--config`` a real model's layer kinds, shrunk: any kind,
                      encoder-only and encoder-decoder models included) through the
                      runtime, checking every step against a dense recompute; with
                      ``--hf-family NAME`` a tiny transformers model through the engine
                      loop, checking every step against transformers' eager attention.

Output and exit status: reports go to stdout, errors to stderr. A user error (a bad
option value, an unknown backend or kind, a backend that cannot serve what was asked,
an absent device) prints ``attnkit <command>: error: <what is wrong>`` (a
``NoBackendError`` follows with its reasons, one per line) and exits with status 2,
without a traceback; ``--debug`` lets the exception propagate with its traceback
instead. Status 1: ``plan`` found a layer with no backend (unless ``--report-only``),
or ``demo`` failed its check against the dense recompute. Option names are never
abbreviated.
"""

from __future__ import annotations

from ._backends import BackendRow, backend_rows
from ._backends import cmd_backends as cmd_backends
from ._common import EXIT_FAILED, EXIT_USAGE
from ._demo import DEMO_MAX_STEPS
from ._demo import cmd_demo as cmd_demo
from ._main import main
from ._parser import build_parser
from ._parser import int_range as int_range
from ._plan import EXAMPLE_MODELS, example_model
from ._plan import cmd_plan as cmd_plan

__all__ = [
    "DEMO_MAX_STEPS",
    "EXAMPLE_MODELS",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "BackendRow",
    "backend_rows",
    "build_parser",
    "example_model",
    "main",
]
