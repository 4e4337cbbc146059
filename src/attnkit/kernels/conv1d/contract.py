"""Contract of the causal depthwise conv1d op (shared by the torch oracle and Triton).

The checks read tensor metadata only (shape, dtype, device), never values, so the Triton
launchers can use them under CUDA graphs; the value checks of the cache lists live in
:mod:`attnkit.kernels._checks` and are run by the oracle alone.
"""

from __future__ import annotations

from torch import Tensor

from attnkit.kernels._checks import KernelTypeError, check_float, check_tensor, describe

__all__ = ["ACTIVATIONS", "check_activation", "check_conv_params"]

ACTIVATIONS = ("silu", None)
"""The activations the op applies after the convolution (None: identity)."""


def check_activation(activation: object) -> None:
    """``activation`` is ``"silu"`` or None."""
    if activation is not None and not isinstance(activation, str):
        raise KernelTypeError(f"activation: expected 'silu' or None, got {describe(activation)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected 'silu' or None, got {activation!r}")


def check_conv_params(
    x: Tensor, weight: object, bias: object, conv_states: object, activation: object
) -> tuple[Tensor, Tensor | None, Tensor]:
    """``weight`` ``[C, W]`` (``W >= 1``), ``bias`` ``[C]`` or None, ``conv_states``
    ``[S, C, W-1]`` in the dtype of ``x``, all on the device of ``x`` (whose last dim is
    ``C``); ``activation`` as :func:`check_activation`. Returns the three tensors."""
    channels = x.shape[-1]
    check_float("x", x)
    weight = check_tensor(
        "weight", weight, layout="[C, W]", shape=(channels, None), device=x.device
    )
    check_float("weight", weight)
    width = weight.shape[1]
    if width < 1:
        raise ValueError(f"weight: expected kernel width W >= 1, got shape {list(weight.shape)}")
    if bias is not None:
        bias = check_tensor("bias", bias, layout="[C]", shape=(channels,), device=x.device)
        check_float("bias", bias)
    conv_states = check_tensor(
        "conv_states",
        conv_states,
        layout="[S, C, W-1]",
        shape=(None, channels, width - 1),
        device=x.device,
    )
    if conv_states.dtype != x.dtype:
        raise ValueError(
            f"conv_states: expected the dtype of x ({x.dtype}), got {conv_states.dtype}"
        )
    check_activation(activation)
    return weight, bias, conv_states
