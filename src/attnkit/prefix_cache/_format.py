"""The canonical bytes every prefix-cache name is a hash of (docs/prefix-caching.md,
"The byte format"): the type-tagged value encoding, token ids as little-endian
``uint32``, the multimodal inputs (``MultimodalInput``) and their extra keys.

Everything here is stable across processes, platforms and Python versions: no
``pickle``, no ``hash()``, fixed widths and byte order, lengths before every
variable-sized field.
"""

from __future__ import annotations

import array
import dataclasses
import math
import struct
import sys
from collections.abc import Iterable, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch

from ..errors import ArgumentTypeError, InvalidArgumentError

__all__ = [
    "FORMAT_VERSION",
    "MAX_TOKEN_ID",
    "MultimodalInput",
    "Tokens",
    "as_token_array",
    "check_mm_inputs",
    "encode_value",
    "mm_extra_key",
]

FORMAT_VERSION = 1
"""The version of the byte format, in every root and namespace (a change of format
changes every name)."""

MAX_TOKEN_ID = 0xFFFF_FFFF
"""Token ids are serialized as ``uint32``."""

EXTRA_MULTIMODAL = 1
"""The tag of a multimodal input's extra key."""

Tokens = Sequence[int] | npt.NDArray[np.integer[Any]]
"""Token ids: a sequence of ints (a list, an ``array.array``) or an integer array."""

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_LE = sys.byteorder == "little"
_ARRAY_U4 = array.array("I").itemsize == 4


def _sized(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def encode_value(value: object, where: str = "value") -> bytes:
    """The canonical, type-tagged bytes of ``value``: ``N`` (None), ``B`` + 1 byte
    (bool), ``I`` + int64 (int), ``F`` + float64 (float), ``S`` + u32 length + UTF-8
    (str, enum values included), ``Y`` + u32 length + bytes, ``D`` + u32 length + name
    (``torch.dtype``, e.g. ``torch.bfloat16``), ``T`` + dtype + u32 rank + u64 per
    dimension + u32 length + the elements' little-endian bytes (a tensor, read on the
    host), ``L`` + u32 count + each item (tuple or list). Integers are little-endian.

    Raises:
        ArgumentTypeError: a type outside this list (the message names ``where``).
        InvalidArgumentError: an int outside int64, a float that is not finite.
    """
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"B" + (b"\x01" if value else b"\x00")
    if isinstance(value, int | np.integer):
        number = int(cast(Any, value))
        if not -(2**63) <= number < 2**63:
            raise InvalidArgumentError(f"{where} must fit in int64, got {number}")
        return b"I" + _I64.pack(number)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgumentError(f"{where} must be finite, got {value!r}")
        return b"F" + _F64.pack(value)
    if isinstance(value, str):
        return b"S" + _sized(value.encode("utf-8"))
    if isinstance(value, bytes):
        return b"Y" + _sized(value)
    if isinstance(value, torch.dtype):
        return b"D" + _sized(str(value).encode("ascii"))
    if isinstance(value, torch.Tensor):
        return b"T" + _tensor_bytes(value)
    if isinstance(value, tuple | list):
        items = cast("Sequence[object]", value)
        parts = [encode_value(v, f"{where}[{i}]") for i, v in enumerate(items)]
        return b"L" + _U32.pack(len(parts)) + b"".join(parts)
    raise ArgumentTypeError(
        f"{where} must be None, a bool, int, float, str, bytes, torch.dtype, tensor, or a "
        f"tuple or list of them, got {type(value).__name__}"
    )


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    host = tensor.detach().to("cpu").contiguous().reshape(-1)
    raw = host.view(torch.uint8).numpy().tobytes() if host.numel() else b""
    if not _LE and host.element_size() > 1:  # the format is little-endian everywhere
        raw = host.view(torch.uint8).reshape(-1, host.element_size()).flip(1).numpy().tobytes()
    shape = b"".join(_U64.pack(d) for d in tensor.shape)
    return (
        _sized(str(tensor.dtype).encode("ascii")) + _U32.pack(tensor.dim()) + shape + _sized(raw)
    )


def _bad_token(items: Iterable[object], where: str) -> InvalidArgumentError | ArgumentTypeError:
    """The error naming the first token id that is not one (the slow path of a refusal)."""
    for i, t in enumerate(items):
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            return ArgumentTypeError(
                f"{where}[{i}] must be an int token id, got {type(t).__name__} {t!r}"
            )
        number = int(cast(Any, t))
        if not 0 <= number <= MAX_TOKEN_ID:
            return InvalidArgumentError(
                f"{where}[{i}] must be a token id in 0..{MAX_TOKEN_ID} (uint32), got {number}"
            )
    return InvalidArgumentError(f"{where} must hold token ids in 0..{MAX_TOKEN_ID} (uint32)")


def as_token_array(token_ids: Tokens, where: str = "token_ids") -> npt.NDArray[np.uint32]:
    """``token_ids`` as a 1-d little-endian ``uint32`` array (no copy when it is one).

    Raises:
        ArgumentTypeError: not a sequence of ints or an integer array.
        InvalidArgumentError: an id outside ``0 .. 2**32 - 1``.
    """
    if isinstance(token_ids, np.ndarray):
        given: npt.NDArray[Any] = token_ids
        if given.ndim != 1 or given.dtype.kind not in "iu":
            raise ArgumentTypeError(
                f"{where} must be a 1-d integer array, got a {given.ndim}-d {given.dtype} array"
            )
        if given.size and (int(given.min()) < 0 or int(given.max()) > MAX_TOKEN_ID):
            raise _bad_token(given.tolist(), where)
        return given.astype("<u4", copy=False)
    if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence | array.array):
        raise ArgumentTypeError(
            f"{where} must be a sequence of ints or an integer array, got "
            f"{type(token_ids).__name__}"
        )
    if isinstance(token_ids, array.array) and token_ids.typecode == "I" and _ARRAY_U4:
        packed = token_ids
    elif _ARRAY_U4:
        try:
            packed = array.array("I", token_ids)  # checks the range and the type, in C
        except (OverflowError, TypeError):
            raise _bad_token(token_ids, where) from None
    else:  # no 4-byte C unsigned int: through int64
        try:
            wide = np.asarray(token_ids, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):
            raise _bad_token(token_ids, where) from None
        return as_token_array(wide, where)
    return np.frombuffer(packed, dtype=np.uint32).astype("<u4", copy=False)


@dataclasses.dataclass(frozen=True)
class MultimodalInput:
    """A multimodal input of a prompt: its placeholder tokens ``start .. end - 1`` and
    the hash of its content (an image's, an audio clip's), which names every block the
    range overlaps (and so, through the chain, every later one).

    Attributes:
        start, end: the token range, ``0 <= start < end``.
        mm_hash: the content's hash, a non-empty ``str`` or ``bytes``.
    """

    start: int
    end: int
    mm_hash: str | bytes

    def __post_init__(self) -> None:
        _check_mm(self.start, self.end, self.mm_hash, "MultimodalInput")


def _check_mm(start: object, end: object, mm_hash: object, where: str) -> None:
    for name, value in (("start", start), ("end", end)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentTypeError(f"{where}.{name} must be an int, got {type(value).__name__}")
    assert isinstance(start, int)
    assert isinstance(end, int)
    if start < 0:
        raise InvalidArgumentError(f"{where}.start must be >= 0, got {start}")
    if end <= start:
        raise InvalidArgumentError(
            f"{where} must have start < end, got start={start}, end={end}"
        )
    if not isinstance(mm_hash, str | bytes) or not mm_hash:
        raise InvalidArgumentError(
            f"{where}.mm_hash must be a non-empty str or bytes, got {mm_hash!r}"
        )


def check_mm_inputs(
    mm_inputs: Iterable[MultimodalInput | tuple[int, int, str | bytes]],
    num_tokens: int,
    where: str = "mm_inputs",
) -> tuple[MultimodalInput, ...]:
    """The inputs as ``MultimodalInput``, checked against a prompt of ``num_tokens``
    tokens and sorted by ``(start, end, mm_hash)`` (the canonical order of extra keys).

    Raises:
        ArgumentTypeError: an entry that is not a ``MultimodalInput`` or a
            ``(start, end, mm_hash)`` tuple.
        InvalidArgumentError: a range that is empty, negative or past the prompt.
    """
    found: list[MultimodalInput] = []
    for i, item in enumerate(mm_inputs):
        here = f"{where}[{i}]"
        entry: object = item
        if isinstance(item, MultimodalInput):
            mm = item
        elif isinstance(entry, tuple) and len(entry) == 3:
            _check_mm(item[0], item[1], item[2], here)
            mm = MultimodalInput(item[0], item[1], item[2])
        else:
            raise ArgumentTypeError(
                f"{here} must be a MultimodalInput or a (start, end, mm_hash) tuple, got "
                f"{item!r}"
            )
        if mm.end > num_tokens:
            raise InvalidArgumentError(
                f"{here} must lie within the prompt's {num_tokens} tokens, got "
                f"start={mm.start}, end={mm.end}"
            )
        found.append(mm)
    return tuple(sorted(found, key=lambda m: (m.start, m.end, encode_value(m.mm_hash))))


def mm_extra_key(mm: MultimodalInput) -> bytes:
    """A multimodal input's extra key: tag ``1``, u32 payload length, then the payload
    ``u64 start``, ``u64 end``, ``encode_value(mm_hash)``."""
    payload = _U64.pack(mm.start) + _U64.pack(mm.end) + encode_value(mm.mm_hash)
    return bytes([EXTRA_MULTIMODAL]) + _sized(payload)
