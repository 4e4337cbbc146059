"""What every ``attnkit`` subcommand shares: the exit statuses, the output streams
(reports on stdout; notes and errors on stderr), the dtype names and the CONFIG check."""

from __future__ import annotations

import dataclasses
import os
from typing import TextIO

import torch

from ..errors import InvalidArgumentError

EXIT_FAILED = 1
"""``plan``: a layer has no backend (without ``--report-only``); ``demo``: a step failed
its check."""
EXIT_USAGE = 2
"""A user error: bad options, or a configuration attnkit rejects."""


@dataclasses.dataclass
class Streams:
    prog: str
    out: TextIO
    err: TextIO

    def note(self, text: str) -> None:
        self.err.write(f"{self.prog}: note: {text}\n")

    def error(self, text: str) -> None:
        """``prog: error: <first line>``, then the other lines as they are."""
        first, *rest = text.splitlines() or [""]
        self.err.write(f"{self.prog}: error: {first}\n" + "".join(f"{line}\n" for line in rest))


def check_config_path(path: str) -> None:
    if not os.path.exists(path):
        raise InvalidArgumentError(
            f"CONFIG must be a config.json or a directory holding one; {path!r} does not exist"
        )


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
