"""The tolerances of the conformance kit, in one place.

A backend's output is compared with the ``reference`` backend's with
``torch.testing.assert_close`` semantics: an element passes when
``|actual - expected| <= atol + rtol * |expected|``. The tolerance depends on the
model dtype; a quantised cache (fp8) widens it, because the two backends may round
the same scores differently after dequantisation. State layers (``mamba`` kind) keep
float32 states and are held to the float32 row of their output dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from typing_extensions import override

from ..spec import KVCacheDType

__all__ = ["FP8_CACHE_TOLERANCE", "TOLERANCES", "Tolerance", "tolerance_for"]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|``, element by element."""

    atol: float
    rtol: float

    @override
    def __str__(self) -> str:
        return f"atol={self.atol:g}, rtol={self.rtol:g}"


TOLERANCES: Mapping[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=4e-3, rtol=4e-3),
    torch.bfloat16: Tolerance(atol=2.5e-2, rtol=2.5e-2),
}
"""Model dtype -> the tolerance of outputs computed in it (cache stored as the model)."""

FP8_CACHE_TOLERANCE = Tolerance(atol=4e-2, rtol=4e-2)
"""Any model dtype over an fp8 cache: the cache's rounding dominates."""


def tolerance_for(dtype: torch.dtype, kv_cache_dtype: KVCacheDType = "auto") -> Tolerance:
    """The tolerance of a layer computing in ``dtype`` over a ``kv_cache_dtype`` cache.

    A cache narrower than the model (``float16`` or ``bfloat16`` under ``float32``)
    takes the cache dtype's row; fp8 and int8 caches take ``FP8_CACHE_TOLERANCE``.
    """
    if kv_cache_dtype.startswith("fp8") or kv_cache_dtype == "int8_per_token_head":
        return FP8_CACHE_TOLERANCE
    own = TOLERANCES[dtype]
    if kv_cache_dtype in ("float16", "bfloat16"):
        cache = TOLERANCES[torch.float16 if kv_cache_dtype == "float16" else torch.bfloat16]
        return Tolerance(atol=max(own.atol, cache.atol), rtol=max(own.rtol, cache.rtol))
    return own
