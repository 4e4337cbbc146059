"""Input checks shared by the reference impls: every message names the argument, what
was expected and what was given."""

from __future__ import annotations

import torch

from ..._validation import describe_tensor, dtype_name

__all__ = ["check_tensor", "describe"]


def describe(t: object) -> str:
    """``"float16 [3, 4, 64] on cpu"`` for a tensor, ``"None"``, or the type name."""
    if t is None:
        return "None"
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    return describe_tensor(t)


def check_tensor(
    owner: str,
    name: str,
    t: object,
    *,
    layout: str,
    shape: tuple[int | None, ...],
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check ``t`` against a shape (``None`` = any size), an optional dtype and device.

    Raises:
        TypeError: ``t`` is not a tensor.
        ValueError: its rank, sizes, dtype or device differ; the message reads
            ``"{owner}: {name} must be float16 [T, Hq, D]=[*, 4, 64] on cpu, got ..."``.
    """
    want = f"{layout}=[{', '.join('*' if d is None else str(d) for d in shape)}]"
    if dtype is not None:
        want = f"{dtype_name(dtype)} {want}"
    if device is not None:
        want = f"{want} on {device}"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor {want}, got {describe(t)}")
    if (
        t.dim() != len(shape)
        or any(w is not None and g != w for g, w in zip(t.shape, shape, strict=True))
        or (dtype is not None and t.dtype != dtype)
        or (device is not None and t.device != device)
    ):
        raise ValueError(f"{owner}: {name} must be {want}, got {describe(t)}")
    return t
