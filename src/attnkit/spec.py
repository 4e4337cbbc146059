"""KV-cache specs: what one layer keeps between steps.

A spec is a frozen, keyword-only dataclass. Each concrete class carries its kind as
the class variable ``kind``, so routing reads ``spec.kind`` and never needs an
``isinstance`` chain::

    >>> import torch
    >>> from attnkit import FullAttentionSpec, KVCacheSpecKind
    >>> spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    >>> spec.kind is KVCacheSpecKind.FULL_ATTENTION
    True
    >>> spec.page_size_bytes  # 2 (K and V) * 16 tokens * 8 heads * 128 * 2 bytes
    65536

``AttentionSpec`` and ``MambaSpec`` are siblings under ``KVCacheSpec``: code that
accepts any layer's spec takes ``KVCacheSpec``; only code that needs attention
fields takes ``AttentionSpec``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import ClassVar, Literal, TypeVar, get_args

import torch
from typing_extensions import override

from ._validation import check_positive_int, dtype_name, is_positive_int
from .errors import ArgumentTypeError, InvalidArgumentError

__all__ = [
    "ATTENTION_SPEC_CLASSES",
    "DYNAMIC_KV_CACHE_DTYPES",
    "KV_CACHE_DTYPES",
    "MODEL_DTYPES",
    "AttentionSpec",
    "AttentionType",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "FullAttentionSpec",
    "IndexerSpec",
    "KVCacheDType",
    "KVCacheSpec",
    "KVCacheSpecKind",
    "MLAAttentionSpec",
    "MambaSpec",
    "MambaType",
    "SinkFullAttentionSpec",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "get_attn_spec_kind",
    "spec_class_for_kind",
]


class KVCacheSpecKind(str, enum.Enum):
    """The closed set of layer kinds a backend can be routed by.

    A ``str`` enum, so ``KVCacheSpecKind("sliding_window")`` parses user input and
    ``kind.value`` prints it.
    """

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    ENCODER_ONLY_ATTENTION = "encoder_only_attention"
    CROSS_ATTENTION = "cross_attention"
    MAMBA = "mamba"
    INDEXER = "indexer"

    @override
    def __str__(self) -> str:
        return self.value


class AttentionType(str, enum.Enum):
    """Which tokens a layer's queries attend to (a layer signal, see ``get_attn_spec_kind``)."""

    DECODER = "decoder"
    """Causal self-attention over a cached context."""
    ENCODER = "encoder"
    """Bidirectional self-attention of an encoder-decoder model's encoder (no cache)."""
    ENCODER_ONLY = "encoder_only"
    """Bidirectional self-attention of an encoder-only model (no cache)."""
    ENCODER_DECODER = "encoder_decoder"
    """Cross-attention from decoder queries to cached encoder keys and values."""

    @override
    def __str__(self) -> str:
        return self.value


KVCacheDType = Literal[
    "auto",
    "float32",
    "float16",
    "bfloat16",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_e4m3_per_token_head",
    "int8_per_token_head",
]
"""Storage dtype of a KV cache; ``"auto"`` stores in the model dtype.

The ``*_per_token_head`` dtypes quantise each (token, head) vector with its own float32
scale, computed when the token is written (``absmax / qmax``) and kept in a second
cache tensor beside the values (``AttentionSpec.kv_scale_dtype``)."""

DYNAMIC_KV_CACHE_DTYPES: frozenset[KVCacheDType] = frozenset(
    {"fp8_e4m3_per_token_head", "int8_per_token_head"}
)
"""The cache dtypes with a scale per (token, head), written by the KV write."""

MambaType = Literal["mamba1", "mamba2", "gdn", "linear", "short_conv"]
"""The state-space or linear-attention family of a ``MambaSpec`` layer."""

MODEL_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16, torch.bfloat16})
"""Dtypes a model's activations (and so its queries) may have."""

KV_CACHE_DTYPES: tuple[KVCacheDType, ...] = get_args(KVCacheDType)

_KV_CACHE_TORCH_DTYPE: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8_e4m3_per_token_head": torch.float8_e4m3fn,
    "int8_per_token_head": torch.int8,
}
_STATE_DTYPES: frozenset[torch.dtype] = MODEL_DTYPES
_MAMBA_TYPES: tuple[MambaType, ...] = get_args(MambaType)


_check_positive_int = check_positive_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Base of every layer's cache spec.

    Attributes:
        block_size: tokens per cache block (page). For ``MambaSpec`` a request's whole
            state lives in one block, whatever its length.
    """

    kind: ClassVar[KVCacheSpecKind]
    block_size: int

    def __post_init__(self) -> None:
        if type(self) in _ABSTRACT_SPECS:
            raise ArgumentTypeError(
                f"{type(self).__name__} is abstract; construct one of its concrete "
                f"subclasses ({', '.join(sorted(c.__name__ for c in _concrete_specs()))})"
            )
        _check_positive_int(type(self).__name__, "block_size", self.block_size)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer's cache."""
        raise NotImplementedError  # every concrete class overrides it

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Upper bound on the cache bytes one request of this layer can hold at once.

        Args:
            max_model_len: the longest context a request may reach.
            max_num_batched_tokens: the most tokens scheduled in one step (a request
                may append that many before its oldest tokens can be released).
        """
        _check_positive_int("max_memory_usage_bytes", "max_model_len", max_model_len)
        _check_positive_int(
            "max_memory_usage_bytes", "max_num_batched_tokens", max_num_batched_tokens
        )
        return self._max_blocks(max_model_len, max_num_batched_tokens) * self.page_size_bytes

    def _max_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return math.ceil(max_model_len / self.block_size)

    @classmethod
    def merge(cls: type[_SpecT], specs: Sequence[_SpecT]) -> _SpecT:
        """Return the one spec that every layer of a group shares.

        Raises:
            ValueError: if ``specs`` is empty, or two specs differ; the message names
                the first differing field and both values.
        """
        if not specs:
            raise InvalidArgumentError(f"{cls.__name__}.merge needs at least one spec, got none")
        first = specs[0]
        for index, other in enumerate(specs[1:], start=1):
            if type(other) is not type(first):
                raise InvalidArgumentError(
                    f"cannot merge specs: spec 0 is {type(first).__name__} "
                    f"(kind={first.kind}) but spec {index} is {type(other).__name__} "
                    f"(kind={other.kind})"
                )
            for field in dataclasses.fields(first):
                mine, theirs = getattr(first, field.name), getattr(other, field.name)
                if mine != theirs:
                    raise InvalidArgumentError(
                        f"cannot merge specs: field {field.name!r} differs between spec 0 "
                        f"({mine!r}) and spec {index} ({theirs!r})"
                    )
        return first


_SpecT = TypeVar("_SpecT", bound=KVCacheSpec)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """Base of attention layers' specs: per layer ``[num_blocks, 2, block_size, Hkv, D]``.

    Attributes:
        num_kv_heads: key/value heads (Hkv).
        head_size: per-head dimension (D).
        dtype: the model dtype (queries, keys, values).
        kv_cache_dtype: storage dtype of the cache; ``"auto"`` means ``dtype``.
        mm_prefix: queries also see every key of their own image range
            (``ScheduledRequest.mm_prefix_ranges``; Gemma 3, PaliGemma), a sliding
            window still bounding the look-back (``Mask.mm_prefix``). Only the kinds
            whose class sets ``takes_mm_prefix`` (full, sliding window).
    """

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    kv_cache_dtype: KVCacheDType = "auto"
    mm_prefix: bool = False
    takes_mm_prefix: ClassVar[bool] = False
    """Whether this kind's masks take bidirectional image ranges (``mm_prefix``)."""

    @override
    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _check_positive_int(owner, "num_kv_heads", self.num_kv_heads)
        _check_positive_int(owner, "head_size", self.head_size)
        dtype: object = self.dtype
        if not isinstance(dtype, torch.dtype) or dtype not in MODEL_DTYPES:
            supported = ", ".join(sorted(dtype_name(d) for d in MODEL_DTYPES))
            raise InvalidArgumentError(
                f"{owner}.dtype must be a torch.dtype among ({supported}), got {self.dtype!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidArgumentError(
                f"{owner}.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if not isinstance(self.mm_prefix, bool):
            raise ArgumentTypeError(
                f"{owner}.mm_prefix must be a bool, got {self.mm_prefix!r} "
                f"({type(self.mm_prefix).__name__})"
            )
        if self.mm_prefix and not self.takes_mm_prefix:
            raise InvalidArgumentError(
                f"{owner}.mm_prefix=True: kind {self.kind.value} takes no bidirectional "
                f"image ranges (full_attention and sliding_window do)"
            )

    @property
    def cache_torch_dtype(self) -> torch.dtype:
        """The torch dtype the cache is stored in (``kv_cache_dtype`` resolved)."""
        if self.kv_cache_dtype == "auto":
            return self.dtype
        return _KV_CACHE_TORCH_DTYPE[self.kv_cache_dtype]

    @property
    def dynamic_kv_scales(self) -> bool:
        """Whether the cache keeps a float32 scale per (token, head) of K and of V (the
        ``*_per_token_head`` dtypes): a second cache tensor ``[num_blocks, 2,
        block_size, Hkv]`` in the same page."""
        return self.kv_cache_dtype in DYNAMIC_KV_CACHE_DTYPES

    @property
    def _kv_planes(self) -> int:
        """How many per-token vectors of ``head_size`` a head stores: K and V."""
        return 2

    @property
    @override
    def page_size_bytes(self) -> int:
        values = (
            self._kv_planes
            * self.block_size
            * self.num_kv_heads
            * self.head_size
            * self.cache_torch_dtype.itemsize
        )
        if not self.dynamic_kv_scales:
            return values
        # The scales follow the values in the page, 16-byte aligned (the buffers' rule).
        scales = self._kv_planes * self.block_size * self.num_kv_heads * 4
        return -(-values // 16) * 16 + scales


@dataclasses.dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over the whole context."""

    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.FULL_ATTENTION
    takes_mm_prefix: ClassVar[bool] = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with ``sink_len`` extra sink-token slots kept in front of the context."""

    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.SINK_FULL_ATTENTION
    takes_mm_prefix: ClassVar[bool] = False
    sink_len: int

    @override
    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int(type(self).__name__, "sink_len", self.sink_len)

    @override
    def _max_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return math.ceil((max_model_len + self.sink_len) / self.block_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one compressed latent per token, ``[num_blocks, block_size, D]``.

    ``num_kv_heads`` must be 1 (the latent is shared by every head).
    """

    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.MLA_ATTENTION
    takes_mm_prefix: ClassVar[bool] = False
    num_kv_heads: int = 1

    @override
    def __post_init__(self) -> None:
        super().__post_init__()
        _check_mla_heads(self)

    @property
    @override
    def _kv_planes(self) -> int:
        return 1


def _check_mla_heads(spec: AttentionSpec) -> None:
    if spec.num_kv_heads != 1:
        raise InvalidArgumentError(
            f"{type(spec).__name__}.num_kv_heads must be 1 (the MLA latent is shared by "
            f"every head), got {spec.num_kv_heads}"
        )
    if spec.dynamic_kv_scales:
        raise InvalidArgumentError(
            f"{type(spec).__name__}.kv_cache_dtype {spec.kv_cache_dtype!r} is not supported: "
            f"a latent shared by every head keeps one per-tensor scale (use 'fp8_e4m3' "
            f"with AttentionLayerParams.k_scale)"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Causal attention to the last ``sliding_window`` tokens (the query's own included)."""

    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.SLIDING_WINDOW
    takes_mm_prefix: ClassVar[bool] = True
    sliding_window: int

    @override
    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int(type(self).__name__, "sliding_window", self.sliding_window)

    @override
    def _max_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        # While a step appends up to max_num_batched_tokens tokens, the first of them
        # still sees sliding_window - 1 older ones; one more block covers a window
        # that starts mid-block.
        live = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return min(math.ceil(live / self.block_size) + 1, math.ceil(max_model_len / self.block_size))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """Sliding-window attention over an MLA latent cache (``num_kv_heads`` is 1)."""

    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.SLIDING_WINDOW_MLA
    takes_mm_prefix: ClassVar[bool] = False
    num_kv_heads: int = 1

    @override
    def __post_init__(self) -> None:
        super().__post_init__()
        _check_mla_heads(self)

    @property
    @override
    def _kv_planes(self) -> int:
        return 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Causal attention within fixed chunks of ``attention_chunk_size`` tokens (Llama 4 style)."""

    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION
    attention_chunk_size: int

    @override
    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int(type(self).__name__, "attention_chunk_size", self.attention_chunk_size)

    @override
    def _max_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        # A step can begin at the end of one chunk and run into the next: the older
        # chunk's tokens stay live until the step ends.
        live = min(self.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return min(math.ceil(live / self.block_size) + 1, math.ceil(max_model_len / self.block_size))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Bidirectional attention that keeps no cache between steps."""

    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.ENCODER_ONLY_ATTENTION

    @override
    def _max_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder queries attending to cached encoder keys/values (up to ``max_model_len`` of them)."""

    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.CROSS_ATTENTION


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexerSpec(AttentionSpec):
    """DeepSeek sparse attention's index-key cache (DeepSeek-V3.2): one fp8 key of
    ``head_size`` (the index head dim) per token with one float32 scale per
    ``scale_block`` values, ``[num_blocks, block_size, head_size + head_size //
    scale_block * 4]`` uint8 (132 bytes a token at 128).

    It pairs with the model's MLA layers of the same ``block_size``: its selection
    (``index_topk`` positions per query token) is read by their sparse MLA. ``dtype`` is
    the model dtype of the index queries and keys; ``kv_cache_dtype`` is the values'
    format, always ``"fp8_e4m3"``; ``num_kv_heads`` is 1 (one index key per token).
    """

    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.INDEXER
    num_kv_heads: int = 1
    head_size: int = 128
    kv_cache_dtype: KVCacheDType = "fp8_e4m3"
    index_topk: int = 2048
    scale_block: int = 128

    @override
    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _check_mla_heads(self)
        _check_positive_int(owner, "index_topk", self.index_topk)
        _check_positive_int(owner, "scale_block", self.scale_block)
        if self.head_size % self.scale_block:
            raise InvalidArgumentError(
                f"{owner}.head_size must be a multiple of scale_block={self.scale_block} "
                f"(one scale per block of values), got {self.head_size}"
            )
        if self.kv_cache_dtype != "fp8_e4m3":
            raise InvalidArgumentError(
                f"{owner}.kv_cache_dtype must be 'fp8_e4m3' (index keys are stored as fp8 "
                f"with a float32 scale per {self.scale_block} values), got {self.kv_cache_dtype!r}"
            )

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's index row: the fp8 values, then the float32 scales."""
        return self.head_size + self.head_size // self.scale_block * 4

    @property
    @override
    def cache_torch_dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    @override
    def page_size_bytes(self) -> int:
        return self.block_size * self.row_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """State-space or linear-attention layer: fixed-size states, one block per request.

    Attributes:
        shapes: one shape per state tensor (for Mamba2: the conv state ``(C, W-1)``
            and the SSM state ``(H, P, N)``); the cache holds ``[num_blocks, *shape]``.
        dtypes: one dtype per state tensor.
        mamba_type: the layer family.
    """

    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.MAMBA
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    mamba_type: MambaType = "mamba2"

    @override
    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        shapes: object = self.shapes
        if not isinstance(shapes, tuple) or not shapes:
            raise InvalidArgumentError(f"{owner}.shapes must be a non-empty tuple of shapes, got {shapes!r}")
        for i, shape in enumerate(shapes):
            if not isinstance(shape, tuple) or not shape or not all(map(is_positive_int, shape)):
                raise InvalidArgumentError(
                    f"{owner}.shapes[{i}] must be a non-empty tuple of positive ints, got {shape!r}"
                )
        dtypes: object = self.dtypes
        if not isinstance(dtypes, tuple) or len(dtypes) != len(shapes):
            raise InvalidArgumentError(
                f"{owner}.dtypes must be a tuple with one dtype per shape "
                f"({len(shapes)}), got {dtypes!r}"
            )
        for i, dtype in enumerate(dtypes):
            if not isinstance(dtype, torch.dtype) or dtype not in _STATE_DTYPES:
                supported = ", ".join(sorted(dtype_name(d) for d in _STATE_DTYPES))
                raise InvalidArgumentError(
                    f"{owner}.dtypes[{i}] must be a torch.dtype among ({supported}), got {dtype!r}"
                )
        if self.mamba_type not in _MAMBA_TYPES:
            raise InvalidArgumentError(
                f"{owner}.mamba_type must be one of {_MAMBA_TYPES}, got {self.mamba_type!r}"
            )

    @property
    @override
    def page_size_bytes(self) -> int:
        return sum(
            math.prod(shape) * dtype.itemsize
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    @override
    def _max_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return 1


_ABSTRACT_SPECS: frozenset[type[KVCacheSpec]] = frozenset({KVCacheSpec, AttentionSpec})


def _concrete_specs() -> list[type[KVCacheSpec]]:
    found: list[type[KVCacheSpec]] = []
    pending: list[type[KVCacheSpec]] = [KVCacheSpec]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls not in _ABSTRACT_SPECS and cls.__module__ == __name__:
            found.append(cls)
    return found


ATTENTION_SPEC_CLASSES: tuple[type[AttentionSpec], ...] = (
    FullAttentionSpec,
    SinkFullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SlidingWindowMLASpec,
    ChunkedLocalAttentionSpec,
    EncoderOnlyAttentionSpec,
    CrossAttentionSpec,
)
"""Every concrete attention spec class, one per attention kind (for ``bind_each``)."""

_SPEC_CLASS_BY_KIND: dict[KVCacheSpecKind, type[KVCacheSpec]] = {
    cls.kind: cls for cls in _concrete_specs()
}
# Every kind has exactly one spec class of this module.
assert set(_SPEC_CLASS_BY_KIND) == set(KVCacheSpecKind), "a KVCacheSpecKind has no spec class"
assert {c.kind for c in ATTENTION_SPEC_CLASSES} == set(KVCacheSpecKind) - {
    KVCacheSpecKind.MAMBA,
    KVCacheSpecKind.INDEXER,  # no attention of its own: it selects what MLA reads
}


def spec_class_for_kind(kind: KVCacheSpecKind) -> type[KVCacheSpec]:
    """The spec class attnkit defines for ``kind`` (``SLIDING_WINDOW`` -> ``SlidingWindowSpec``)."""
    return _SPEC_CLASS_BY_KIND[KVCacheSpecKind(kind)]


def get_attn_spec_kind(
    *,
    attn_type: AttentionType = AttentionType.DECODER,
    use_mla: bool = False,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    sink_len: int | None = None,
) -> KVCacheSpecKind:
    """Derive an attention layer's kind from the signals a model definition gives.

    The rules, in order:

    * ``ENCODER`` and ``ENCODER_ONLY`` layers keep no cache: ``encoder_only_attention``.
    * ``ENCODER_DECODER`` layers: ``cross_attention``.
    * Decoder layers: MLA with a window is ``sliding_window_mla``, MLA alone
      ``mla_attention``; a chunk size gives ``chunked_local_attention``; a window
      ``sliding_window``; sink tokens ``sink_full_attention``; else ``full_attention``.

    Combinations no spec class describes raise instead of picking one silently: a
    window, chunk, sinks or MLA on a non-decoder layer; a window together with a
    chunk; sinks together with a window, a chunk or MLA; MLA with a chunk.

    Raises:
        ValueError: for a combination above, or a window/chunk/sink length < 1.
    """
    attn_type = AttentionType(attn_type)
    if not isinstance(use_mla, bool):
        raise InvalidArgumentError(f"get_attn_spec_kind: use_mla must be a bool, got {use_mla!r}")
    for name, value in (
        ("sliding_window", sliding_window),
        ("attention_chunk_size", attention_chunk_size),
        ("sink_len", sink_len),
    ):
        if value is not None:
            _check_positive_int("get_attn_spec_kind", name, value)
    signals = {
        "use_mla": use_mla,
        "sliding_window": sliding_window is not None,
        "attention_chunk_size": attention_chunk_size is not None,
        "sink_len": sink_len is not None,
    }
    given = sorted(name for name, present in signals.items() if present)

    def conflict(reason: str) -> ValueError:
        return ValueError(
            f"get_attn_spec_kind: no spec kind for attn_type={attn_type.value} with "
            f"{', '.join(given) or 'no other signal'}: {reason}"
        )

    if attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY, AttentionType.ENCODER_DECODER):
        if given:
            raise conflict(f"{attn_type.value} layers take none of {given}")
        if attn_type is AttentionType.ENCODER_DECODER:
            return KVCacheSpecKind.CROSS_ATTENTION
        return KVCacheSpecKind.ENCODER_ONLY_ATTENTION
    if sink_len is not None and len(given) > 1:
        raise conflict("sink tokens combine with no other signal")
    if sliding_window is not None and attention_chunk_size is not None:
        raise conflict("a layer is either sliding-window or chunked-local, not both")
    if use_mla:
        if attention_chunk_size is not None:
            raise conflict("MLA has no chunked-local variant")
        if sliding_window is not None:
            return KVCacheSpecKind.SLIDING_WINDOW_MLA
        return KVCacheSpecKind.MLA_ATTENTION
    if attention_chunk_size is not None:
        return KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION
    if sliding_window is not None:
        return KVCacheSpecKind.SLIDING_WINDOW
    if sink_len is not None:
        return KVCacheSpecKind.SINK_FULL_ATTENTION
    return KVCacheSpecKind.FULL_ATTENTION
