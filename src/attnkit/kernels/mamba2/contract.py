"""The Mamba2 (SSD) contract: operand checks shared by the torch oracle
(:mod:`attnkit.kernels.mamba2.reference`) and the Triton launchers
(:mod:`attnkit.kernels.mamba2.triton`).

Shape letters as in the oracle's module docstring: ``x`` ``[lead, H, P]`` (``lead`` is
``T``, ``B`` or ``L``), ``dt`` ``[lead, H]``, ``A``/``D``/``dt_bias`` ``[H]``, ``B``/``C``
``[lead, G, N]`` with ``G`` dividing ``H``, ``ssm_states`` ``[S, H, P, N]`` float32. Every
operand may have any floating dtype and any strides; the checks read metadata only (no
device value goes back to the host).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.kernels._checks import check_float, check_tensor

__all__ = ["check_ssm_inputs", "check_ssm_states"]


def check_ssm_inputs(
    x: Tensor,
    dt: object,
    A: object,
    B: object,
    C: object,
    D: object,
    dt_bias: object,
    *,
    lead: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Validate the SSM operands; ``lead`` names the first dim of ``x`` (``T``/``B``/``L``).

    Returns ``(dt, A, B, C, D, dt_bias)`` typed as tensors (``D``/``dt_bias`` may be None).
    """
    x = check_tensor("x", x, layout=f"[{lead}, H, P]", shape=(None, None, None), device=None)
    check_float("x", x)
    n_lead, heads, _ = x.shape
    dev = x.device
    dt = check_tensor("dt", dt, layout=f"[{lead}, H]", shape=(n_lead, heads), device=dev)
    A = check_tensor("A", A, layout="[H]", shape=(heads,), device=dev)
    B = check_tensor("B", B, layout=f"[{lead}, G, N]", shape=(n_lead, None, None), device=dev)
    groups, state = B.shape[1], B.shape[2]
    C = check_tensor("C", C, layout=f"[{lead}, G, N]", shape=(n_lead, groups, state), device=dev)
    if groups < 1 or heads % groups != 0:
        raise ValueError(
            f"B: expected the number of groups G to divide the number of heads H, got "
            f"G = {groups}, H = {heads}"
        )
    if D is not None:
        D = check_tensor("D", D, layout="[H]", shape=(heads,), device=dev)
    if dt_bias is not None:
        dt_bias = check_tensor("dt_bias", dt_bias, layout="[H]", shape=(heads,), device=dev)
    for name, t in (("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            check_float(name, t)
    return dt, A, B, C, D, dt_bias


def check_ssm_states(ssm_states: object, x: Tensor, state_size: int) -> Tensor:
    """Validate the state cache: float32 ``[S, H, P, N]`` on the device of ``x``."""
    heads, head_dim = x.shape[1], x.shape[2]
    ssm_states = check_tensor(
        "ssm_states",
        ssm_states,
        layout="[S, H, P, N]",
        shape=(None, heads, head_dim, state_size),
        device=x.device,
    )
    if ssm_states.dtype != torch.float32:
        raise ValueError(f"ssm_states: expected dtype torch.float32, got {ssm_states.dtype}")
    return ssm_states
