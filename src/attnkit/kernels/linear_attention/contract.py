"""Contract of the linear attention op (shared by the torch oracle and Triton).

The checks read tensor metadata only (shape, dtype, device), never values, so the Triton
launchers can use them under CUDA graphs; ``decay >= 0`` and the cache lists' values are
checked by the oracle alone.
"""

from __future__ import annotations

from torch import Tensor

from attnkit.kernels._checks import check_float, check_tensor

__all__ = ["alloc_out", "check_decay_shape", "check_out", "check_qkv"]


def check_qkv(q: object, k: object, v: object, *, lead: str) -> tuple[Tensor, Tensor, Tensor]:
    """``q``/``k`` ``[lead, H, K]`` and ``v`` ``[lead, H, V]``, one floating dtype."""
    q = check_tensor("q", q, layout=f"[{lead}, H, K]", shape=(None, None, None), device=None)
    check_float("q", q)
    n_lead, heads, key_dim = q.shape
    k = check_tensor(
        "k", k, layout=f"[{lead}, H, K]", shape=(n_lead, heads, key_dim), device=q.device
    )
    v = check_tensor("v", v, layout=f"[{lead}, H, V]", shape=(n_lead, heads, None), device=q.device)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected the dtype of q ({q.dtype}), got {t.dtype}")
    if key_dim < 1 or v.shape[2] < 1:
        raise ValueError(
            f"q, v: expected head dims K >= 1 and V >= 1, got K = {key_dim}, V = {v.shape[2]}"
        )
    return q, k, v


def check_decay_shape(decay: object, q: Tensor) -> Tensor:
    """``decay``: ``[H]`` floating, on the device of ``q`` (values not read)."""
    decay = check_tensor("decay", decay, layout="[H]", shape=(q.shape[1],), device=q.device)
    check_float("decay", decay)
    return decay


def check_out(out: object, q: Tensor, v: Tensor, *, lead: str) -> Tensor:
    """``out`` ``[lead, H, V]`` with the leading dim of ``q``, dtype of ``q``, any strides."""
    shape = (q.shape[0], q.shape[1], v.shape[2])
    out = check_tensor("out", out, layout=f"[{lead}, H, V]", shape=shape, device=q.device)
    if out.dtype != q.dtype:
        raise ValueError(f"out: expected the dtype of q ({q.dtype}), got {out.dtype}")
    return out


def alloc_out(out: object, q: Tensor, v: Tensor, *, lead: str) -> Tensor:
    """``out`` checked by :func:`check_out`, or a new ``[lead, H, V]`` tensor when None."""
    if out is None:
        return q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    return check_out(out, q, v, lead=lead)
