"""The capability vocabulary backends declare and requests ask for.

``AttentionFeature`` names optional score modifications a layer may need;
``MultipleOf`` / ``SizeRange`` / ``SizeRule`` describe the head and block sizes a
backend accepts (``supported_block_sizes = (16, 32, MultipleOf(64))``);
``KVCacheLayout`` names how a backend wants its attention caches laid out. The
backend ABC (``attnkit.backend``) reads these; the layer parameters
(``attnkit.params``) derive the features a layer needs; the kind rules
(``attnkit.kinds``) give each layout's shapes.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal, get_args

from typing_extensions import override

from ._validation import is_positive_int
from .errors import InvalidArgumentError

__all__ = [
    "KV_CACHE_LAYOUTS",
    "AttentionFeature",
    "KVCacheLayout",
    "MultipleOf",
    "SizeRange",
    "SizeRule",
    "format_sizes",
    "size_allowed",
]


class AttentionFeature(str, enum.Enum):
    """Optional score modifications a layer may need from its backend."""

    LOGITS_SOFT_CAP = "logits_soft_cap"
    """``s = cap * tanh(s / cap)`` (Gemma 2)."""
    ATTENTION_SINKS = "attention_sinks"
    """A learned per-head logit in every softmax denominator (gpt-oss)."""
    ALIBI = "alibi"
    """Per-head linear position bias (BLOOM, MPT)."""
    RETURN_LSE = "return_lse"
    """The backend also returns each row's log-sum-exp (for cascades and merges)."""
    CONTEXT_PARALLEL = "context_parallel"
    """The impl runs a decode context-parallel shard (``AttentionImpl.forward_partial``
    honouring ``CommonAttentionMetadata.context_shard``) and returns its log-sum-exp."""
    MLA_PROJECTION = "mla_projection"
    """MLA layers whose impl applies ``W_UK``/``W_UV`` itself (``MLAProjection``): it takes
    the un-absorbed query and returns per-head values, so it may pick the absorbed or the
    up-projected form per step."""
    SPARSE_ATTENTION = "sparse_attention"
    """MLA layers of DeepSeek sparse attention (``AttentionLayerParams.index_topk``): the
    impl attends only to the positions a ``SparseSelection`` names
    (``AttentionImpl.forward_sparse``)."""

    @override
    def __str__(self) -> str:
        return self.value


KVCacheLayout = Literal["interleaved", "planes"]
"""How a backend's attention layers receive their cache (``AttentionBackend.kv_cache_layout``).

``"interleaved"`` (the default): each kind's page-major layout; for K/V attention
kinds one tensor ``[num_blocks, 2, block_size, Hkv, D]`` (K and V of a block side by
side in its page). ``"planes"``: for K/V attention kinds, two token-major tensors, the
K plane and the V plane, each ``[num_blocks * block_size, Hkv, D]``; slot
``s = block * block_size + offset`` is row ``s`` of each plane. Kinds without separate
K and V (MLA latents, state layers) have no planes layout; a backend declaring
``"planes"`` is rejected for them with a reason.
"""

KV_CACHE_LAYOUTS: tuple[KVCacheLayout, ...] = get_args(KVCacheLayout)
"""Every ``KVCacheLayout``, in declaration order."""


@dataclasses.dataclass(frozen=True)
class MultipleOf:
    """A size rule: any positive multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        if not is_positive_int(self.n):
            raise InvalidArgumentError(f"MultipleOf.n must be a positive int, got {self.n!r}")

    @override
    def __str__(self) -> str:
        return f"multiple of {self.n}"


@dataclasses.dataclass(frozen=True)
class SizeRange:
    """A size rule: any size from ``low`` to ``high``, both included."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not (is_positive_int(self.low) and is_positive_int(self.high) and self.low <= self.high):
            raise InvalidArgumentError(
                f"SizeRange needs positive ints with low <= high, got ({self.low!r}, {self.high!r})"
            )

    @override
    def __str__(self) -> str:
        return f"{self.low} to {self.high}"


SizeRule = tuple[int | MultipleOf | SizeRange, ...]
"""Allowed sizes: exact values, ``MultipleOf`` and ``SizeRange`` rules; a size is
allowed if any entry allows it."""


def size_allowed(size: int, rule: SizeRule) -> bool:
    for r in rule:
        if isinstance(r, MultipleOf):
            if size % r.n == 0:
                return True
        elif isinstance(r, SizeRange):
            if r.low <= size <= r.high:
                return True
        elif size == r:
            return True
    return False


def format_sizes(rule: SizeRule) -> str:
    """``(16, 32, MultipleOf(64))`` -> ``"16, 32, multiple of 64"``."""
    return ", ".join(str(r) for r in rule)
