"""The capability vocabulary backends declare and requests ask for.

``AttentionFeature`` names optional score modifications a layer may need;
``MultipleOf`` / ``SizeRange`` / ``SizeRule`` describe the head and block sizes a
backend accepts (``supported_block_sizes = (16, 32, MultipleOf(64))``);
``KVCacheLayout`` names how a backend wants its attention caches laid out;
``Determinism`` the ordered levels of bitwise reproducibility a backend guarantees
per kind and a config asks for (docs/determinism.md). The
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
from .errors import ArgumentTypeError, InvalidArgumentError

__all__ = [
    "KV_CACHE_LAYOUTS",
    "AttentionFeature",
    "Determinism",
    "KVCacheLayout",
    "MultipleOf",
    "SizeRange",
    "SizeRule",
    "format_sizes",
    "size_allowed",
]


class Determinism(enum.IntEnum):
    """How far a backend's output rows are reproducible bit for bit; each level includes
    every level below it (docs/determinism.md).

    A backend declares the strongest level it keeps, per kind
    (``AttentionBackend.determinism_for``), in the mode the config asks for
    (``AttentionConfig(determinism=...)``: a builder may then pick a slower, invariant
    path); selection refuses a backend whose level is below the config's, with the
    reason. ``attnkit.testing.check_invariance`` checks a declared level bit for bit.
    Levels compare as ordered (``Determinism.BATCH_INVARIANT >= Determinism.RUN_TO_RUN``);
    ``Determinism.parse("batch_invariant")`` reads a name.
    """

    NONE = 0
    """Nothing promised."""
    RUN_TO_RUN = 1
    """The same step (the same requests, in the same order, with the same inputs and
    cache) gives the same bits, run after run, on one device and build."""
    BATCH_INVARIANT = 2
    """A request's rows do not depend on the other requests of its step: alone, or
    among any others in any order, the same bits."""
    PREFILL_DECODE = 3
    """Also: a token's row computed as a decode (one query) equals its row computed as
    part of a prefill of the whole sequence."""
    CHUNKING_INVARIANT = 4
    """Also: a request's rows do not depend on how its prompt is cut into chunks over
    steps (any chunk sizes)."""
    PREFIX_HIT_INVARIANT = 5
    """Also: the rows after a prefix-cache hit equal those of a request that computed
    the prefix itself (the cached keys and values read back exactly as written)."""

    @property
    def label(self) -> str:
        """The level's name as configs and reports write it: ``"batch_invariant"``."""
        return self.name.lower()

    @classmethod
    def parse(cls, value: object, *, argument: str = "determinism") -> Determinism:
        """A level from a ``Determinism`` or its name (``"batch_invariant"``, any case,
        ``-`` for ``_``).

        Raises:
            InvalidArgumentError: an unknown name (the message lists the levels).
            ArgumentTypeError: neither a ``Determinism`` nor a str (a bare int or bool
                is refused: say the level's name).
        """
        if isinstance(value, Determinism):
            return value
        levels = ", ".join(level.label for level in cls)
        if isinstance(value, str):
            key = value.strip().lower().replace("-", "_")
            for level in cls:
                if level.label == key:
                    return level
            raise InvalidArgumentError(
                f"{argument} must be one of {levels}; got {value!r}"
            )
        raise ArgumentTypeError(
            f"{argument} must be a Determinism or one of {levels}; got {value!r} "
            f"({type(value).__name__})"
        )


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
    PER_HEAD_QUANT_SCALES = "per_head_quant_scales"
    """An fp8 cache quantised with one static scale per K/V head (``k_scale`` /
    ``v_scale`` tuples of ``AttentionLayerParams``): the KV write divides and the
    attention multiplies by the head's own scale."""

    MM_PREFIX = "mm_prefix"
    """Bidirectional image ranges (``AttentionSpec.mm_prefix``, Gemma 3, PaliGemma):
    queries of a request's image range see all of it, a sliding window still bounding
    the look-back (``Mask.mm_prefix``, ``CommonAttentionMetadata.mm_prefix_ranges``). Asked by the
    spec, so selection refuses a backend without it for such a group."""

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
