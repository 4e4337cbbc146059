"""Typed per-step inputs of state layers (``MambaSpec`` layers), one class per type.

Attention layers take ``query, key, value``; a state layer takes the one input class
of its ``mamba_type``, so swapping two tensors or passing a Gated DeltaNet input to a
Mamba2 layer is a type error, not a silently wrong answer::

    y = runtime.forward_state("layers.1", Mamba2Inputs(xBC=xbc, dt=dt))

Letters as in ``attnkit.params``: T tokens of the step, H heads, C conv channels,
K key dim, V value dim. Every tensor has the step's ``T`` rows (or more: rows past
the step's tokens are padding and produce zeros).
"""

from __future__ import annotations

import dataclasses

import torch

from .errors import ArgumentTypeError, InvalidArgumentError

__all__ = [
    "GatedDeltaNetInputs",
    "LinearAttentionInputs",
    "Mamba1Inputs",
    "Mamba2Inputs",
    "ShortConvInputs",
    "StateInputs",
]


def _check_tensors(owner: str, tensors: dict[str, object]) -> None:
    rows: int | None = None
    device: torch.device | None = None
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ArgumentTypeError(f"{owner}.{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.dim() < 1:
            raise InvalidArgumentError(f"{owner}.{name} must have a token dimension, got a 0-d tensor")
        if rows is None:
            rows, device = value.shape[0], value.device
        elif value.shape[0] != rows or value.device != device:
            first = next(iter(tensors))
            raise InvalidArgumentError(
                f"{owner}.{name} must have the same rows and device as {first} "
                f"({rows} on {device}), got {value.shape[0]} on {value.device}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Mamba1Inputs:
    """A Mamba (1) layer's step: ``x [T, d_inner]``, the x half of ``in_proj``, before the conv.

    The layer writes ``y [T, d_inner]``, the selective scan's output before the ``z``
    gate: the model applies ``y * silu(z)`` and ``out_proj`` itself. ``dt``, ``B`` and
    ``C`` are not inputs: Mamba (1) computes them from the *convolved* ``x`` (``x_proj``,
    ``dt_proj``), which only exists inside the layer, so the backend applies those
    projections (their weights are in ``Mamba1LayerParams``).
    """

    x: torch.Tensor

    def __post_init__(self) -> None:
        _check_tensors(type(self).__name__, {"x": self.x})

    @property
    def num_rows(self) -> int:
        return int(self.x.shape[0])

    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the layer's output."""
        return self.x.dtype


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Mamba2Inputs:
    """A Mamba2 layer's step: ``xBC [T, C]`` (x, B and C before the conv) and ``dt [T, H]``.

    The layer writes ``y [T, H, P]`` (before gating and norm).
    """

    xBC: torch.Tensor
    dt: torch.Tensor

    def __post_init__(self) -> None:
        _check_tensors(type(self).__name__, {"xBC": self.xBC, "dt": self.dt})

    @property
    def num_rows(self) -> int:
        return int(self.xBC.shape[0])

    @property
    def device(self) -> torch.device:
        return self.xBC.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the layer's output."""
        return self.xBC.dtype


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class GatedDeltaNetInputs:
    """A Gated DeltaNet layer's step: ``qkv [T, C]`` (before the conv), ``g [T, H]`` (log
    decay, <= 0) and ``beta [T, H]``. The layer writes ``o [T, H, V]``."""

    qkv: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    def __post_init__(self) -> None:
        _check_tensors(type(self).__name__, {"qkv": self.qkv, "g": self.g, "beta": self.beta})

    @property
    def num_rows(self) -> int:
        return int(self.qkv.shape[0])

    @property
    def device(self) -> torch.device:
        return self.qkv.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the layer's output."""
        return self.qkv.dtype


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class LinearAttentionInputs:
    """A linear-attention layer's step: ``q, k [T, H, K]`` and ``v [T, H, V]``.
    The layer writes ``o [T, H, V]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self) -> None:
        _check_tensors(type(self).__name__, {"q": self.q, "k": self.k, "v": self.v})

    @property
    def num_rows(self) -> int:
        return int(self.q.shape[0])

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the layer's output."""
        return self.q.dtype


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ShortConvInputs:
    """An LFM2 short-conv layer's step: gates ``b, c [T, C]`` and ``x [T, C]``;
    the layer writes ``y = c * conv(b * x)`` ``[T, C]``."""

    b: torch.Tensor
    c: torch.Tensor
    x: torch.Tensor

    def __post_init__(self) -> None:
        _check_tensors(type(self).__name__, {"b": self.b, "c": self.c, "x": self.x})

    @property
    def num_rows(self) -> int:
        return int(self.b.shape[0])

    @property
    def device(self) -> torch.device:
        return self.b.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the layer's output."""
        return self.b.dtype


StateInputs = (
    Mamba1Inputs | Mamba2Inputs | GatedDeltaNetInputs | LinearAttentionInputs | ShortConvInputs
)
"""The input of any state layer; each ``mamba_type`` takes exactly one of these."""
