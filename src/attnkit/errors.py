"""attnkit's exceptions: one family under ``AttnkitError``.

Every exception attnkit defines derives from ``AttnkitError`` *and* from the builtin
it resembles, so an engine can catch the whole family in one clause while existing
``except ValueError`` / ``except KeyError`` clauses keep working::

    try:
        runtime.begin_step(batch)
    except attnkit.OutOfBlocksError:
        ...                      # preempt a request and retry
    except attnkit.AttnkitError as exc:
        log.error("attnkit rejected the step: %s", exc)

This module imports nothing from attnkit: every other module may raise these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from typing_extensions import override

__all__ = [
    "AttnkitError",
    "BackendNotSupportedError",
    "DuplicateBackendError",
    "InvalidBackendError",
    "NoBackendError",
    "OutOfBlocksError",
    "Rejection",
    "UnknownBackendError",
]


class AttnkitError(Exception):
    """Base of every exception attnkit raises on purpose."""


class UnknownBackendError(AttnkitError, KeyError):
    """No backend of that name is registered. The message lists the registered ones."""

    @override
    def __str__(self) -> str:
        # KeyError's own __str__ would repr() the message, quoting it.
        return str(self.args[0]) if self.args else ""


class DuplicateBackendError(AttnkitError, ValueError):
    """Two sources register the same backend name; the message names both."""


class InvalidBackendError(AttnkitError, TypeError):
    """A class offered as a backend breaks the backend contract; the message says how."""


@dataclasses.dataclass(frozen=True)
class Rejection:
    """A candidate backend that could not serve, and every reason why."""

    backend: str
    reasons: tuple[str, ...]

    @override
    def __str__(self) -> str:
        return f"{self.backend}: " + "; ".join(self.reasons)


class NoBackendError(AttnkitError, RuntimeError):
    """No candidate can serve a spec. The message lists every candidate and reason."""

    def __init__(self, message: str, rejected: Sequence[Rejection]) -> None:
        super().__init__(message)
        self.rejected: tuple[Rejection, ...] = tuple(rejected)


class BackendNotSupportedError(NoBackendError):
    """A backend the user named explicitly cannot serve the spec."""


class OutOfBlocksError(AttnkitError, RuntimeError):
    """The pool has fewer free blocks than a step needs. Nothing was changed."""
