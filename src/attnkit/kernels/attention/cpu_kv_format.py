"""The K/V plane formats the CPU engines read, checked once for both wrappers.

A plane ``[R, Hkv, D]`` holds the query's dtype, or an 8-bit format (fp8 e4m3fn, fp8
e5m2, int8) dequantised by the engines as ``stored * scale`` in float32:

* a static scale per K/V head: ``k_scale`` / ``v_scale`` float32 ``[Hkv]`` (a per-tensor
  scale is the same value for every head);
* a scale per token and head (``k_scale`` / ``v_scale`` ``None``): the plane is
  ``[R, Hkv, D + 4]``, each head's ``D`` bytes followed by the 4 bytes of its float32
  scale (:data:`ROW_SCALE_BYTES`), so a row (a slot) carries its scales wherever it is
  copied, offloaded or sharded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.kernels._checks import check_last_dim_contiguous, describe, require_tensor

__all__ = ["KV8_CODES", "ROW_SCALE_BYTES", "KVFormat", "dequantise_rows", "kv_format"]

KV8_CODES: dict[torch.dtype, int] = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 4, torch.int8: 5}
"""The 8-bit plane dtypes and their codes in the native library (``half_float.h``)."""
ROW_SCALE_BYTES = 4
"""Bytes of the float32 scale after each head's values in a per-token-head plane."""
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class KVFormat:
    """The planes' format: the native code, the static scales (or ``None``: in the rows)."""

    code: int
    k_scale: Tensor | None
    v_scale: Tensor | None

    @property
    def quantised(self) -> bool:
        return self.code in KV8_CODES.values()

    def args(self) -> tuple[int, int | None, int | None]:
        """``kv_dtype, k_scale, v_scale`` as the native entry points take them."""
        k, v = self.k_scale, self.v_scale
        return self.code, None if k is None else k.data_ptr(), None if v is None else v.data_ptr()


def _scale(name: str, value: object, hkv: int) -> Tensor:
    want = f"a float32 tensor [{hkv}] on cpu of finite scales > 0 (one per K/V head)"
    t = require_tensor(name, value, want)
    if t.dim() != 1 or t.shape[0] != hkv or t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name}: expected {want}, got {describe(t)}")
    check_last_dim_contiguous(name, t)
    bad = ~(torch.isfinite(t) & (t > 0))
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"{name}: expected {want}, got {float(t[i])!r} at index {i}")
    return t


def kv_format(
    query_dtype: torch.dtype, k: Tensor, v: Tensor, d: int, k_scale: object, v_scale: object
) -> KVFormat:
    """The format of planes ``k`` / ``v`` (already checked 3-D, CPU, last dim contiguous)
    for a query of ``query_dtype`` and head size ``d``; ``ValueError`` naming the
    argument when they do not fit."""
    hkv = k.shape[1]
    if k.dtype == query_dtype:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is not None:
                raise ValueError(
                    f"{name}: expected None for {k.dtype} planes (scales are for 8-bit "
                    f"planes), got {describe(s)}"
                )
        if k.shape[2] != d:
            raise ValueError(
                f"k_plane: expected head size D = {d} (the query's), got {describe(k)}"
            )
        return KVFormat(_DTYPE_CODES[query_dtype], None, None)
    if k.dtype not in KV8_CODES:
        raise ValueError(
            f"k_plane: expected dtype {query_dtype} (the query's) or an 8-bit format "
            f"(torch.float8_e4m3fn, torch.float8_e5m2, torch.int8), got {describe(k)}"
        )
    if v.dtype != k.dtype:
        raise ValueError(f"v_plane: expected dtype {k.dtype} (as k_plane), got {describe(v)}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError(
            f"k_scale, v_scale: expected both tensors or both None, got k_scale "
            f"{describe(k_scale)} and v_scale {describe(v_scale)}"
        )
    if k_scale is None:
        if k.shape[2] != d + ROW_SCALE_BYTES:
            raise ValueError(
                f"k_plane: expected [R, Hkv, D + {ROW_SCALE_BYTES}] = [R, {hkv}, "
                f"{d + ROW_SCALE_BYTES}] (each head's values, then its float32 scale) without "
                f"k_scale, got {describe(k)}"
            )
        return KVFormat(KV8_CODES[k.dtype], None, None)
    if k.shape[2] != d:
        raise ValueError(
            f"k_plane: expected head size D = {d} (the query's) with per-head k_scale, "
            f"got {describe(k)}"
        )
    return KVFormat(
        KV8_CODES[k.dtype], _scale("k_scale", k_scale, hkv), _scale("v_scale", v_scale, hkv)
    )


def dequantise_rows(rows: Tensor, scale: Tensor | None) -> Tensor:
    """Float32 values of plane rows ``[n, Hkv, D]`` (or ``[n, Hkv, D + 4]`` with their
    scales) of an 8-bit plane, as the engines compute them: ``stored * scale``."""
    if scale is not None:
        return rows.float() * scale[None, :, None]
    d = rows.shape[2] - ROW_SCALE_BYTES
    scales = rows[..., d:].contiguous().view(torch.float32)  # [n, Hkv, 1]
    return rows[..., :d].float() * scales
