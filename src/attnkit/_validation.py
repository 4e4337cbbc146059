"""Small input checks shared by the core modules (user input arrives untyped at run time)."""

from __future__ import annotations

from typing import cast

import torch

from .errors import ArgumentTypeError, InvalidArgumentError


def is_int(value: object) -> bool:
    """``value`` is an ``int`` and not a ``bool`` (an ``int`` subclass)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_capability(value: object) -> bool:
    """``value`` is a CUDA compute capability: a ``(major, minor)`` tuple of two ints >= 0."""
    if not isinstance(value, tuple):
        return False
    items = cast("tuple[object, ...]", value)
    return len(items) == 2 and all(is_nonnegative_int(v) for v in items)


def is_positive_int(value: object) -> bool:
    """``value`` is an ``int`` (not a ``bool``, which is an ``int`` subclass) and >= 1."""
    # Inline, not is_int(): ScheduledRequest checks every request with it.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_positive_int(owner: str, name: str, value: object) -> None:
    """Raise ``InvalidArgumentError("{owner}.{name} must be a positive int, got ...")``
    unless it is one."""
    if not is_positive_int(value):
        raise InvalidArgumentError(f"{owner}.{name} must be a positive int, got {value!r}")


def is_nonnegative_int(value: object) -> bool:
    """``value`` is an ``int`` (not a ``bool``) and >= 0."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, for messages."""
    return str(dtype).removeprefix("torch.")


def describe_tensor(t: torch.Tensor) -> str:
    """``"bfloat16 [4, 8] on cpu"``, for messages."""
    return f"{dtype_name(t.dtype)} {list(t.shape)} on {t.device}"


def split_or_replicate(
    count: int, ranks: int, what: str, where: str, caller: str = "plan_model"
) -> tuple[int, int]:
    """``(per rank, ranks holding each)`` of ``count`` heads (groups) over ``ranks``
    tensor-parallel ranks.

    At least as many as ranks: each rank holds ``count / ranks`` (``ranks`` must divide
    them). Fewer: each rank holds one, replicated on ``ranks / count`` ranks (``count``
    must divide ``ranks``); this is how tensor-parallel engines shard grouped-query
    attention (vLLM's ``QKVParallelLinear`` replicates K/V heads so), and Mamba2's B/C
    groups split the same way.

    Raises:
        InvalidArgumentError: the counts do not divide (the message names ``where``).
    """
    if count >= ranks:
        if count % ranks:
            raise InvalidArgumentError(
                f"{caller}: tensor_parallel={ranks} cannot split the {count} {what} of "
                f"{where}: with at least as many {what} as ranks, tensor_parallel must "
                f"divide {count}"
            )
        return count // ranks, 1
    if ranks % count:
        raise InvalidArgumentError(
            f"{caller}: tensor_parallel={ranks} cannot split the {count} {what} of {where}: "
            f"with fewer {what} than ranks, tensor_parallel must be a multiple of {count} "
            f"(each is then replicated on tensor_parallel / {count} ranks)"
        )
    return 1, ranks // count


def check_mm_prefix_ranges(where: str, ranges: object) -> int:
    """Bidirectional image ranges (``ScheduledRequest.mm_prefix_ranges``): a tuple of
    ``(start, end)`` int pairs, ``0 <= start < end``, sorted, not overlapping; else an
    error starting with ``where`` (the argument). Returns the last range's end (0: none)."""
    if not isinstance(ranges, tuple):
        raise ArgumentTypeError(
            f"{where} must be a tuple of (start, end) pairs, got {type(ranges).__name__}"
        )
    items = cast("tuple[object, ...]", ranges)
    previous_end = 0
    for k, pair in enumerate(items):
        if (
            not isinstance(pair, tuple)
            or len(cast("tuple[object, ...]", pair)) != 2
            or not all(is_nonnegative_int(x) for x in cast("tuple[object, ...]", pair))
        ):
            raise InvalidArgumentError(
                f"{where}[{k}] must be a pair (start, end) of ints >= 0, got {pair!r}"
            )
        start, end = cast("tuple[int, int]", pair)
        if end <= start:
            raise InvalidArgumentError(
                f"{where}[{k}] = {pair!r}: a range [start, end) needs start < end"
            )
        if start < previous_end:
            raise InvalidArgumentError(
                f"{where}[{k}] = {pair!r} starts before the previous range ends "
                f"({previous_end}): ranges must be sorted and not overlap"
            )
        previous_end = end
    return previous_end
