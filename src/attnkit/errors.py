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
    "ArgumentTypeError",
    "AttnkitError",
    "BackendNotSupportedError",
    "ContextParallelMismatchError",
    "DeviceUnavailableError",
    "DuplicateBackendError",
    "DuplicateRequestError",
    "EngineLimitError",
    "InvalidArgumentError",
    "InvalidBackendError",
    "MissingDependencyError",
    "NoBackendError",
    "OutOfBlocksError",
    "PluginError",
    "Rejection",
    "StalePrefixError",
    "StaleStepError",
    "UnknownBackendError",
    "UnknownLayerError",
    "UnknownRequestError",
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


class MissingDependencyError(AttnkitError, ImportError):
    """An optional dependency is missing or too old; the message names the extra that
    installs it (``pip install 'attnkit[xxhash]'``)."""


class InvalidArgumentError(AttnkitError, ValueError):
    """An argument of the right type with a value attnkit does not take (out of range,
    not one of the allowed names). The message names the argument, the value given and
    what is allowed."""


class ArgumentTypeError(AttnkitError, TypeError):
    """An argument of the wrong type. The message names the argument, the type given
    and the type expected."""


class UnknownRequestError(AttnkitError, KeyError):
    """A request id that is not live: never scheduled, or already freed (the message
    says which)."""

    @override
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownLayerError(AttnkitError, KeyError):
    """A layer name the runtime does not have; the message lists its layers."""

    @override
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DuplicateRequestError(AttnkitError, ValueError):
    """A request id given twice in one call (scheduled twice, finished twice)."""


class EngineLimitError(AttnkitError, ValueError):
    """A step breaks one of ``AttentionConfig``'s engine limits (``max_model_len``,
    ``max_num_batched_tokens``, ``max_num_reqs``). Nothing was changed."""


class ContextParallelMismatchError(AttnkitError, RuntimeError):
    """The ranks of a decode context-parallel group were given different steps (raised on
    every rank, before anything changed)."""


class StaleStepError(AttnkitError, RuntimeError):
    """Step metadata used when it no longer describes the cache: before the first
    ``begin_step``, or after requests of the step were freed."""


class StalePrefixError(AttnkitError, RuntimeError):
    """A prefix match (``match_prefix``) scheduled after blocks it hits were evicted or
    the prefix cache was reset, or on another runtime. Nothing was changed: match the
    prompt again."""


class DeviceUnavailableError(AttnkitError, RuntimeError):
    """A device that does not exist on this machine (no CUDA, or an index past the
    device count)."""


class PluginError(AttnkitError, RuntimeError):
    """A backend plugin failed (on import, in its declarations or in a hook); the
    message names the plugin and what it raised."""
