"""Memory sizes in words: ``parse_memory_size`` (``"80GiB"`` -> bytes) and
``format_bytes`` (bytes -> ``"1.00 GiB"``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction

from ..errors import ArgumentTypeError, InvalidArgumentError

_UNITS: Mapping[str, int] = {
    "B": 1,
    "KB": 10**3,
    "kB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)")


def parse_memory_size(text: str, *, argument: str = "memory") -> int:
    """Bytes from ``"80GiB"``, ``"500MB"``, ``"1.5 TiB"`` or a plain byte count ``"4096"``.

    Units (case as written): B, kB/KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB
    (powers of 1024). The result must be a whole number of bytes, at least 1.

    Raises:
        ArgumentTypeError: ``text`` is not a str.
        InvalidArgumentError: anything else (the message names ``argument``, the units
            and the text given).
    """
    if not isinstance(text, str):
        raise ArgumentTypeError(
            f"{argument} must be a str such as '80GiB', got {text!r} ({type(text).__name__})"
        )
    units = ", ".join(_UNITS)
    expected = f"a size such as 80GiB, 500MB or 4096 (bytes); units: {units}"
    if text.strip().startswith("-"):
        raise InvalidArgumentError(f"{argument} must be positive, got {text!r}")
    match = _SIZE.fullmatch(text.strip())
    if match is None or match.group(2) not in {*_UNITS, ""}:
        raise InvalidArgumentError(f"{argument} must be {expected}; got {text!r}")
    value = Fraction(match.group(1)) * _UNITS[match.group(2) or "B"]
    if value.denominator != 1:
        raise InvalidArgumentError(
            f"{argument} must be a whole number of bytes, got {text!r} (= {float(value):g} bytes)"
        )
    if value < 1:
        raise InvalidArgumentError(f"{argument} must be at least 1 byte, got {text!r}")
    return int(value)


def format_bytes(value: int) -> str:
    """``1073741824`` -> ``1.00 GiB``; below 1 KiB, ``512 B``."""
    scaled, unit = float(value), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if scaled < 1024:
            break
        scaled, unit = scaled / 1024, bigger
    return f"{value} B" if unit == "B" else f"{scaled:.2f} {unit}"
