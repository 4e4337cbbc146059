"""The Mamba (1) selective-scan contract: operand checks shared by the torch oracle
(:mod:`attnkit.kernels.mamba1.reference`) and the Triton launchers
(:mod:`attnkit.kernels.mamba1.triton`).

Shape letters as in the oracle's module docstring: ``x`` and ``dt`` ``[lead, D]``
(``lead`` is ``T``, ``B`` or ``L``), ``A`` ``[D, N]``, ``B``/``C`` ``[lead, N]``,
``D_skip``/``dt_bias`` ``[D]``, ``ssm_states`` ``[S, D, N]`` float32. Every operand may have
any floating dtype and any strides; the checks read metadata only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.kernels._checks import check_float, check_tensor

__all__ = ["check_scan_inputs", "check_scan_states"]


def check_scan_inputs(
    x: object,
    dt: object,
    A: object,
    B: object,
    C: object,
    D: object,
    dt_bias: object,
    *,
    lead: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Validate the scan operands; ``lead`` names the first dim of ``x`` (``T``/``B``/``L``).

    Returns ``(x, dt, A, B, C, D, dt_bias)`` typed as tensors (``D``/``dt_bias`` may be None).
    """
    x = check_tensor("x", x, layout=f"[{lead}, D]", shape=(None, None), device=None)
    check_float("x", x)
    n_lead, channels = x.shape
    dev = x.device
    dt = check_tensor("dt", dt, layout=f"[{lead}, D]", shape=(n_lead, channels), device=dev)
    A = check_tensor("A", A, layout="[D, N]", shape=(channels, None), device=dev)
    state = A.shape[1]
    B = check_tensor("B", B, layout=f"[{lead}, N]", shape=(n_lead, state), device=dev)
    C = check_tensor("C", C, layout=f"[{lead}, N]", shape=(n_lead, state), device=dev)
    if D is not None:
        D = check_tensor("D", D, layout="[D]", shape=(channels,), device=dev)
    if dt_bias is not None:
        dt_bias = check_tensor("dt_bias", dt_bias, layout="[D]", shape=(channels,), device=dev)
    for name, t in (("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            check_float(name, t)
    return x, dt, A, B, C, D, dt_bias


def check_scan_states(ssm_states: object, x: Tensor, state_size: int) -> Tensor:
    """Validate the state cache: float32 ``[S, D, N]`` on the device of ``x``."""
    ssm_states = check_tensor(
        "ssm_states",
        ssm_states,
        layout="[S, D, N]",
        shape=(None, x.shape[1], state_size),
        device=x.device,
    )
    if ssm_states.dtype != torch.float32:
        raise ValueError(f"ssm_states: expected dtype torch.float32, got {ssm_states.dtype}")
    return ssm_states
