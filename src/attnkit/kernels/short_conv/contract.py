"""Contract of the gated short convolution op (shared by the torch oracle and Triton).

The checks read tensor metadata only (shape, dtype, device), never values. The
convolution's own parameters (``weight``, ``bias``, ``conv_states``) follow
:func:`attnkit.kernels.conv1d.contract.check_conv_params`.
"""

from __future__ import annotations

from torch import Tensor

from attnkit.kernels._checks import check_float, check_tensor

__all__ = ["check_gates", "check_out"]


def check_gates(b: object, c: object, x: object, *, lead: str) -> tuple[Tensor, Tensor, Tensor]:
    """``b``, ``c``, ``x``: ``[lead, C]``, one floating dtype, one device."""
    x = check_tensor("x", x, layout=f"[{lead}, C]", shape=(None, None), device=None)
    check_float("x", x)
    shape = (x.shape[0], x.shape[1])
    b = check_tensor("b", b, layout=f"[{lead}, C]", shape=shape, device=x.device)
    c = check_tensor("c", c, layout=f"[{lead}, C]", shape=shape, device=x.device)
    for name, t in (("b", b), ("c", c)):
        if t.dtype != x.dtype:
            raise ValueError(f"{name}: expected the dtype of x ({x.dtype}), got {t.dtype}")
    return b, c, x


def check_out(out: object, x: Tensor, *, lead: str) -> Tensor:
    """``out``: ``[lead, C]`` like ``x`` (shape, dtype, device), any strides."""
    out = check_tensor(
        "out", out, layout=f"[{lead}, C]", shape=(x.shape[0], x.shape[1]), device=x.device
    )
    if out.dtype != x.dtype:
        raise ValueError(f"out: expected the dtype of x ({x.dtype}), got {out.dtype}")
    return out
