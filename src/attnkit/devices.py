"""Devices at the boundary: parse what the user gave, and say why one is unusable.

``parse_device`` turns a ``torch.device`` or a string into a ``torch.device`` of a
type attnkit serves (``cpu``, ``cuda``), with attnkit errors for anything else;
``device_problem`` says why a parsed device cannot be used on this machine (no CUDA,
an index past the device count), for backends to report as a rejection reason and for
the runtime and the CLI to raise as ``DeviceUnavailableError``.
"""

from __future__ import annotations

from typing import cast

import torch

from .errors import ArgumentTypeError, DeviceUnavailableError, InvalidArgumentError

__all__ = [
    "CUDA_CAPABILITIES",
    "SUPPORTED_DEVICE_TYPES",
    "check_device_available",
    "device_problem",
    "parse_device",
]

SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")
"""Device types attnkit runs on."""

CUDA_CAPABILITIES: tuple[tuple[int, int], ...] = (
    (3, 0), (3, 2), (3, 5), (3, 7),
    (5, 0), (5, 2), (5, 3),
    (6, 0), (6, 1), (6, 2),
    (7, 0), (7, 2), (7, 5),
    (8, 0), (8, 6), (8, 7), (8, 9),
    (9, 0),
    (10, 0), (10, 1), (10, 3),
    (11, 0),
    (12, 0), (12, 1),
)  # fmt: skip
"""The compute capabilities of NVIDIA's CUDA GPUs (Kepler to Blackwell), in order: what
``attnkit plan --capability`` accepts for a device it plans for without having one."""


def parse_device(value: object, *, argument: str = "device") -> torch.device:
    """``value`` (a ``torch.device`` or a string such as ``"cuda:1"``) as a ``torch.device``.

    Does not check that the device exists (``device_problem`` does).

    Raises:
        ArgumentTypeError: ``value`` is neither a ``torch.device`` nor a string.
        InvalidArgumentError: the string is not a device, or its type is not one of
            ``SUPPORTED_DEVICE_TYPES``.
    """
    allowed = "'cpu', 'cuda' or 'cuda:N'"
    if isinstance(value, torch.device):
        device = value
    elif isinstance(value, str):
        try:
            device = torch.device(value)
        except (RuntimeError, ValueError):
            raise InvalidArgumentError(f"{argument} must be {allowed}, got {value!r}") from None
    else:
        raise ArgumentTypeError(
            f"{argument} must be a torch.device or a string such as {allowed}, "
            f"got {value!r} ({type(value).__name__})"
        )
    if device.type not in SUPPORTED_DEVICE_TYPES:
        raise InvalidArgumentError(
            f"{argument} must be {allowed}, got {str(device)!r} "
            f"(attnkit runs on {', '.join(SUPPORTED_DEVICE_TYPES)})"
        )
    return device


def device_problem(device: torch.device) -> str | None:
    """Why ``device`` cannot be used on this machine, or ``None`` if it can."""
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        why = (
            "this torch build has no CUDA support"
            if torch.version.cuda is None
            else "no CUDA device is visible"
        )
        return f"device {str(device)!r} is not available: {why}"
    count = torch.cuda.device_count()
    # None for a bare "cuda", although torch's stubs type it as int.
    index = cast("int | None", device.index)
    if index is not None and index >= count:
        return (
            f"device {str(device)!r} does not exist: {count} CUDA device(s) are visible "
            f"(cuda:0 to cuda:{count - 1})"
        )
    return None


def check_device_available(device: torch.device) -> None:
    """Raise ``DeviceUnavailableError`` with ``device_problem``'s reason, if any."""
    problem = device_problem(device)
    if problem is not None:
        raise DeviceUnavailableError(problem)
