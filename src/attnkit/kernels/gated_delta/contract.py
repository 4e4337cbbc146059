"""The Gated DeltaNet (gated delta rule) contract: operand checks shared by the torch
oracle (:mod:`attnkit.kernels.gated_delta.reference`) and the Triton launchers
(:mod:`attnkit.kernels.gated_delta.triton`).

Shape letters as in the oracle's module docstring: ``q``/``k`` ``[lead, Hk, K]``, ``v`` and
``out`` ``[lead, H, V]``, ``g``/``beta`` ``[lead, H]`` (``lead`` is ``T``, ``B`` or ``L``),
where the ``H`` value heads are a multiple of the ``Hk`` key heads (value head ``h``
reads key head ``h // (H // Hk)``).
Every operand may have any floating dtype and any strides; the checks read metadata only
(no device value goes back to the host).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.kernels._checks import check_float, check_tensor

__all__ = ["alloc_out", "check_gdn_inputs", "check_out", "head_group"]


def check_gdn_inputs(
    q: object, k: object, v: object, g: object, beta: object, *, lead: str
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Validate the operands; ``lead`` names the first dim (``T``/``B``/``L``).

    ``q``/``k`` have ``Hk`` heads, ``v``/``g``/``beta`` ``H`` heads, ``H`` a multiple of
    ``Hk``. Returns ``(q, k, v, g, beta)`` typed as tensors.
    """
    q = check_tensor("q", q, layout=f"[{lead}, Hk, K]", shape=(None, None, None), device=None)
    n_lead, key_heads, key_dim = q.shape
    dev = q.device
    k = check_tensor(
        "k", k, layout=f"[{lead}, Hk, K]", shape=(n_lead, key_heads, key_dim), device=dev
    )
    v = check_tensor("v", v, layout=f"[{lead}, H, V]", shape=(n_lead, None, None), device=dev)
    heads = v.shape[1]
    if key_heads == 0 or heads % key_heads != 0:
        raise ValueError(
            f"v: expected a head count H that is a multiple of the key heads "
            f"Hk = {key_heads} of q and k, got H = {heads} (v shape {list(v.shape)})"
        )
    g = check_tensor("g", g, layout=f"[{lead}, H]", shape=(n_lead, heads), device=dev)
    beta = check_tensor("beta", beta, layout=f"[{lead}, H]", shape=(n_lead, heads), device=dev)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_float(name, t)
    return q, k, v, g, beta


def head_group(k: Tensor, v: Tensor) -> int:
    """``H // Hk``: how many consecutive value heads share one key head (after
    :func:`check_gdn_inputs`)."""
    return v.shape[1] // max(k.shape[1], 1)


def check_out(out: object, v: Tensor, lead: str) -> Tensor:
    """``out`` is a tensor of the shape, dtype and device of ``v``."""
    out = check_tensor("out", out, layout=f"[{lead}, H, V]", shape=tuple(v.shape), device=v.device)
    if out.dtype != v.dtype:
        raise ValueError(f"out: expected dtype {v.dtype} (the dtype of v), got {out.dtype}")
    return out


def alloc_out(out: object, v: Tensor, lead: str) -> Tensor:
    """``out`` checked by :func:`check_out`, or a new tensor like ``v`` when None."""
    return torch.empty_like(v) if out is None else check_out(out, v, lead)

