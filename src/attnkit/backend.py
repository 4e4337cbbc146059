"""Backend and impl ABCs, declared capabilities, and the typed builder binding.

A backend is a class whose capabilities are class variables. Support is a list of
reasons, never a bare bool: ``not_supported_reasons(request)`` is computed from the
declarations alone (plus the ``extra_not_supported_reasons`` hook for conditions no
declaration can express), so a declaration cannot lie::

    class MyBackend(AttentionBackend):
        name = "my_backend"
        supported_kinds = frozenset({KVCacheSpecKind.FULL_ATTENTION})
        supported_devices = frozenset({"cuda"})
        supported_head_sizes = (64, 128, 256)
        supported_block_sizes = (MultipleOf(16),)
        builders = (bind_builder(FullAttentionSpec, MyBuilder, MyImpl),)

``bind_builder`` ties a spec type to the builder that accepts it and the impl that
consumes the builder's metadata; binding a builder to a spec type its ``__init__``
does not accept, or an impl to another builder's metadata, is a type error.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import inspect
import math
import typing
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Generic, Protocol

import torch
from typing_extensions import TypeVar, override

from ._validation import is_positive_int
from .builder import AttentionCGSupport, AttentionMetadataBuilder
from .config import AttentionConfig
from .spec import (
    MODEL_DTYPES,
    AttentionSpec,
    KVCacheDType,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
    MambaType,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    spec_class_for_kind,
)

__all__ = [
    "STATE_PARAMS_BY_TYPE",
    "AnyBuilderBinding",
    "AttentionBackend",
    "AttentionFeature",
    "AttentionImpl",
    "AttentionLayerParams",
    "BackendRequest",
    "BuilderBinding",
    "BuilderClass",
    "GatedDeltaNetLayerParams",
    "LayerParams",
    "LinearAttentionLayerParams",
    "Mamba2LayerParams",
    "MultipleOf",
    "ShortConvLayerParams",
    "SizeRange",
    "SizeRule",
    "StateLayerParams",
    "attention_params_problems",
    "bind_builder",
    "format_sizes",
]

S = TypeVar("S", bound=KVCacheSpec)
S_contra = TypeVar("S_contra", bound=KVCacheSpec, contravariant=True)
M = TypeVar("M")
M_co = TypeVar("M_co", covariant=True)
M_contra = TypeVar("M_contra", contravariant=True)


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

    @override
    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class MultipleOf:
    """A size rule: any positive multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        if not is_positive_int(self.n):
            raise ValueError(f"MultipleOf.n must be a positive int, got {self.n!r}")

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
            raise ValueError(
                f"SizeRange needs positive ints with low <= high, got ({self.low!r}, {self.high!r})"
            )

    @override
    def __str__(self) -> str:
        return f"{self.low} to {self.high}"


SizeRule = tuple[int | MultipleOf | SizeRange, ...]
"""Allowed sizes: exact values, ``MultipleOf`` and ``SizeRange`` rules; a size is
allowed if any entry allows it."""


def _size_allowed(size: int, rule: SizeRule) -> bool:
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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionLayerParams:
    """What one attention layer needs beyond its cache spec.

    Attributes:
        num_heads: query heads (Hq); a multiple of the spec's ``num_kv_heads``.
        scale: softmax scale; ``None`` means ``head_size ** -0.5``.
        logits_soft_cap: soft-cap of the scores, or ``None``.
        alibi_slopes: one ALiBi slope per query head, or ``None``.
        sinks: float32 ``[Hq]`` learned sink logits, or ``None``.
        return_lse: whether the layer needs the log-sum-exp back.
        v_head_size: width of the values when it differs from the keys (MLA: the
            latent's first ``v_head_size`` channels are the values); ``None``: the
            spec's ``head_size``.
        sink_key, sink_value: ``[sink_len, Hkv, D]`` learned sink tokens of a
            ``sink_full_attention`` layer, written in front of every request's context.
        k_scale, v_scale: per-tensor scales of an fp8 cache: the cache stores
            ``key / k_scale`` (and ``value / v_scale``); 1.0 for other caches.
    """

    num_heads: int
    scale: float | None = None
    logits_soft_cap: float | None = None
    alibi_slopes: tuple[float, ...] | None = None
    sinks: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    return_lse: bool = False
    v_head_size: int | None = None
    sink_key: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    sink_value: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if not is_positive_int(self.num_heads):
            raise ValueError(
                f"AttentionLayerParams.num_heads must be a positive int, got {self.num_heads!r}"
            )
        if self.scale is not None and not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(
                f"AttentionLayerParams.scale must be a finite float > 0, got {self.scale!r}"
            )
        if self.logits_soft_cap is not None and not (
            math.isfinite(self.logits_soft_cap) and self.logits_soft_cap > 0
        ):
            raise ValueError(
                f"AttentionLayerParams.logits_soft_cap must be a finite float > 0 or None, "
                f"got {self.logits_soft_cap!r}"
            )
        if self.alibi_slopes is not None and len(self.alibi_slopes) != self.num_heads:
            raise ValueError(
                f"AttentionLayerParams.alibi_slopes must have num_heads={self.num_heads} "
                f"entries, got {len(self.alibi_slopes)}"
            )
        if self.sinks is not None and tuple(self.sinks.shape) != (self.num_heads,):
            raise ValueError(
                f"AttentionLayerParams.sinks must have shape [num_heads={self.num_heads}], "
                f"got {list(self.sinks.shape)}"
            )
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if not (isinstance(value, float | int) and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"AttentionLayerParams.{name} must be a finite float > 0, got {value!r}"
                )
        if self.v_head_size is not None and not is_positive_int(self.v_head_size):
            raise ValueError(
                f"AttentionLayerParams.v_head_size must be a positive int or None, got {self.v_head_size!r}"
            )
        if (self.sink_key is None) != (self.sink_value is None):
            raise ValueError("AttentionLayerParams.sink_key and sink_value must be given together")
        if (
            self.sink_key is not None
            and self.sink_value is not None
            and (self.sink_key.dim() != 3 or self.sink_key.shape != self.sink_value.shape)
        ):
            raise ValueError(
                f"AttentionLayerParams.sink_key and sink_value must both be [sink_len, Hkv, D], "
                f"got {list(self.sink_key.shape)} and {list(self.sink_value.shape)}"
            )

    @property
    def features(self) -> frozenset[AttentionFeature]:
        """The optional features these parameters ask a backend for."""
        wanted = {
            AttentionFeature.LOGITS_SOFT_CAP: self.logits_soft_cap is not None,
            AttentionFeature.ALIBI: self.alibi_slopes is not None,
            AttentionFeature.ATTENTION_SINKS: self.sinks is not None,
            AttentionFeature.RETURN_LSE: self.return_lse,
        }
        return frozenset(f for f, on in wanted.items() if on)


def attention_params_problems(
    spec: AttentionSpec,
    params: AttentionLayerParams,
    *,
    backend: str,
    supported_features: frozenset[AttentionFeature],
) -> list[str]:
    """What keeps a backend whose impls take plain K/V heads from running a layer.

    For impls to check at construction, so a bad layer fails before its first step:
    features the backend does not declare, values narrower than keys (MLA), sink
    tokens, and a query-head count that is not a multiple of the KV heads.
    """
    problems: list[str] = []
    unsupported = sorted(f.value for f in params.features - supported_features)
    if unsupported:
        supported = ", ".join(sorted(f.value for f in supported_features)) or "none"
        problems.append(
            f"the layer needs {', '.join(unsupported)}, which {backend} does not support "
            f"(supported features: {supported})"
        )
    if params.v_head_size not in (None, spec.head_size):
        problems.append(
            f"v_head_size={params.v_head_size} differs from head_size={spec.head_size}, "
            f"which {backend} does not support"
        )
    if params.sink_key is not None:
        problems.append("sink tokens (sink_key/sink_value) are not supported")
    if params.num_heads % spec.num_kv_heads:
        problems.append(
            f"num_heads={params.num_heads} is not a multiple of num_kv_heads={spec.num_kv_heads}"
        )
    return problems


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Mamba2LayerParams:
    """Weights and sizes of a Mamba2 layer's state-space core (conv1d + SSD).

    The model keeps the projections, gating and norm; the backend runs the part that
    reads and writes the cached states. Letters: H heads, P head dim, G groups, N state
    size, W conv width, C = H*P + 2*G*N conv channels.

    Attributes:
        num_heads, head_dim, n_groups, d_state: H, P, G, N.
        conv_weight: ``[C, W]`` depthwise conv weight; conv_bias ``[C]`` or ``None``.
        A: ``[H]`` (negative) decay rates; D ``[H]`` skip or ``None``; dt_bias ``[H]``
            or ``None``.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        chunk_size: SSD chunk length for prefill.

    Spec shapes for such a layer: ``MambaSpec(shapes=params.state_shapes, ...)``.
    """

    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None = None
    A: torch.Tensor
    D: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    dt_softplus: bool = True
    chunk_size: int = 64

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "n_groups", "d_state", "chunk_size"):
            if not is_positive_int(getattr(self, name)):
                raise ValueError(
                    f"Mamba2LayerParams.{name} must be a positive int, got {getattr(self, name)!r}"
                )
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"Mamba2LayerParams.num_heads={self.num_heads} must be a multiple of n_groups={self.n_groups}"
            )
        if self.conv_weight.dim() != 2 or self.conv_weight.shape[0] != self.conv_dim:
            raise ValueError(
                f"Mamba2LayerParams.conv_weight must be [conv_dim={self.conv_dim}, W], "
                f"got {list(self.conv_weight.shape)}"
            )
        for name, shape in (
            ("conv_bias", (self.conv_dim,)),
            ("A", (self.num_heads,)),
            ("D", (self.num_heads,)),
            ("dt_bias", (self.num_heads,)),
        ):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(
                    f"Mamba2LayerParams.{name} must have shape {list(shape)}, got {list(value.shape)}"
                )

    @property
    def conv_dim(self) -> int:
        """C = H*P + 2*G*N: the channels of x, B and C that go through the conv."""
        return self.num_heads * self.head_dim + 2 * self.n_groups * self.d_state

    @property
    def conv_kernel(self) -> int:
        """W, the conv width."""
        return int(self.conv_weight.shape[1])

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((C, W-1), (H, P, N))``: the conv state and the SSM state of one request."""
        return (
            (self.conv_dim, self.conv_kernel - 1),
            (self.num_heads, self.head_dim, self.d_state),
        )

    def output_shape(self, num_tokens: int) -> tuple[int, ...]:
        """``y`` of a step: ``[T, H, P]``."""
        return (num_tokens, self.num_heads, self.head_dim)


def _check_state_params(owner: str, obj: object, ints: Sequence[str]) -> None:
    for name in ints:
        if not is_positive_int(getattr(obj, name)):
            raise ValueError(f"{owner}.{name} must be a positive int, got {getattr(obj, name)!r}")


def _check_conv_weight(
    owner: str, weight: torch.Tensor, bias: torch.Tensor | None, channels: int
) -> None:
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(
            f"{owner}.conv_weight must be [channels={channels}, W >= 1], got {list(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"{owner}.conv_bias must have shape [{channels}], got {list(bias.shape)}")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class GatedDeltaNetLayerParams:
    """A Gated DeltaNet layer's core: short conv over q/k/v, then the gated delta rule.

    Letters: H heads, K key dim, V value dim, W conv width, C = 2*H*K + H*V.
    ``forward`` takes ``query = qkv [T, C]`` (q, k, v concatenated, before the conv),
    ``key = g [T, H]`` (log decay, <= 0), ``value = beta [T, H]`` and writes
    ``o [T, H, V]``. After the conv (SiLU) q and k are L2-normalised per head, as
    Gated DeltaNet layers do (Yang et al. 2025).

    Attributes:
        num_heads, key_dim, value_dim: H, K, V.
        conv_weight: ``[C, W]``; conv_bias ``[C]`` or ``None``.
        scale: multiplies ``S^T q``; ``None`` means ``K ** -0.5``.
        chunk_size: chunk length of the prefill algorithm.
    """

    num_heads: int
    key_dim: int
    value_dim: int
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None = None
    scale: float | None = None
    chunk_size: int = 64

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_state_params(owner, self, ("num_heads", "key_dim", "value_dim", "chunk_size"))
        _check_conv_weight(owner, self.conv_weight, self.conv_bias, self.conv_dim)

    @property
    def conv_dim(self) -> int:
        return self.num_heads * (2 * self.key_dim + self.value_dim)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((C, W-1), (H, K, V))``: conv state and delta-rule state."""
        return (
            (self.conv_dim, int(self.conv_weight.shape[1]) - 1),
            (self.num_heads, self.key_dim, self.value_dim),
        )

    def output_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (num_tokens, self.num_heads, self.value_dim)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class LinearAttentionLayerParams:
    """A linear-attention layer with per-head decay (lightning attention).

    ``forward`` takes ``query = q [T, H, K]``, ``key = k``, ``value = v [T, H, V]`` and
    writes ``o [T, H, V]``; the state ``S_t = exp(-decay_h) S_{t-1} + k_t v_t^T``.

    Attributes:
        num_heads, key_dim, value_dim: H, K, V.
        decay: ``[H]`` non-negative decay rates.
        scale: ``None`` means ``K ** -0.5``.
        chunk_size: chunk length of the prefill algorithm.
    """

    num_heads: int
    key_dim: int
    value_dim: int
    decay: torch.Tensor
    scale: float | None = None
    chunk_size: int = 64

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_state_params(owner, self, ("num_heads", "key_dim", "value_dim", "chunk_size"))
        if tuple(self.decay.shape) != (self.num_heads,) or bool((self.decay < 0).any()):
            raise ValueError(
                f"{owner}.decay must be [num_heads={self.num_heads}] and >= 0, got "
                f"{list(self.decay.shape)} with min {float(self.decay.min()) if self.decay.numel() else 'n/a'}"
            )

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.num_heads, self.key_dim, self.value_dim),)

    def output_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (num_tokens, self.num_heads, self.value_dim)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ShortConvLayerParams:
    """An LFM2-style short-conv layer's core: ``y = c * conv(b * x)`` with a conv state.

    ``forward`` takes ``query = b [T, C]``, ``key = c [T, C]``, ``value = x [T, C]`` and
    writes ``y [T, C]``.

    Attributes:
        channels: C.
        conv_weight: ``[C, W]``; conv_bias ``[C]`` or ``None``.
    """

    channels: int
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_state_params(owner, self, ("channels",))
        _check_conv_weight(owner, self.conv_weight, self.conv_bias, self.channels)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.channels, int(self.conv_weight.shape[1]) - 1),)

    def output_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (num_tokens, self.channels)


StateLayerParams = (
    Mamba2LayerParams | GatedDeltaNetLayerParams | LinearAttentionLayerParams | ShortConvLayerParams
)
"""Parameters of a ``MambaSpec`` layer, one type per ``mamba_type``."""

STATE_PARAMS_BY_TYPE: Mapping[str, type] = {
    "mamba2": Mamba2LayerParams,
    "gdn": GatedDeltaNetLayerParams,
    "linear": LinearAttentionLayerParams,
    "short_conv": ShortConvLayerParams,
}
"""``MambaSpec.mamba_type`` -> the parameter class its layers take."""

LayerParams = AttentionLayerParams | StateLayerParams
"""Per-layer parameters an impl is built with."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendRequest:
    """What a backend is asked to serve: one group's spec, on one device.

    Attributes:
        spec: the group's cache spec.
        device: where it runs.
        capability: CUDA compute capability ``(major, minor)``; ``None`` off CUDA or
            when unknown (a backend with a minimum capability then says so).
        features: optional features the group's layers need.
        num_heads: query heads, if known (checked against ``num_kv_heads``).
        config: the config the selection runs under, for backends whose support
            depends on a setting (e.g. ``flash_attn_version``); ``None`` if unknown.
    """

    spec: KVCacheSpec
    device: torch.device
    capability: tuple[int, int] | None = None
    features: frozenset[AttentionFeature] = frozenset()
    num_heads: int | None = None
    config: AttentionConfig | None = None


class BuilderClass(Protocol[S_contra, M_co]):
    """A builder class seen as its constructor: spec -> builder producing ``M_co``.

    A class matches when its ``__init__`` accepts ``S_contra`` as the spec, so a
    builder that narrows its spec to ``MambaSpec`` does not match ``AttentionSpec``.
    """

    def __call__(
        self,
        kv_cache_spec: S_contra,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
        /,
    ) -> AttentionMetadataBuilder[M_co, Any]: ...

    def get_cudagraph_support(
        self, config: AttentionConfig, kv_cache_spec: KVCacheSpec
    ) -> AttentionCGSupport: ...


class AttentionImpl(ABC, Generic[M_contra]):
    """Runs one layer with the metadata its backend's builder made (no per-call planning).

    Args:
        kv_cache_spec: the layer's spec.
        layer_params: the layer's parameters (``AttentionLayerParams`` for attention,
            ``Mamba2LayerParams`` for Mamba2 layers), or ``None`` if it needs none.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, layer_params: LayerParams | None) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_params = layer_params

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: M_contra,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Write this step's new K/V (or state) into ``kv_cache`` and the result into ``output``.

        Attention: query ``[T, Hq, D]``, key/value ``[T, Hkv, D]`` (``None`` for a
        cross-attention step that writes no encoder tokens), output ``[T, Hq, Dv]``.
        Mamba2: query is ``xBC`` ``[T, C]`` (before the conv), key is ``dt``
        ``[T, H]``, value is ``None``, output is ``y`` ``[T, H, P]`` (before gating).
        ``kv_cache`` holds one tensor per shape of ``get_kv_cache_shapes``. Returns
        ``output``.
        """


class AnyBuilderBinding(ABC):
    """A ``BuilderBinding`` with its type parameters erased: what a backend's
    ``builders`` tuple holds.

    Declaring ``builders`` with this non-generic type (rather than
    ``BuilderBinding[Any, Any]``) matters: it gives ``bind_builder(...)`` no ``Any``
    to infer from, so a mismatched binding in a class body is still a type error.
    """

    spec_type: type[KVCacheSpec]
    impl_cls: type[AttentionImpl[Any]]

    @property
    @abstractmethod
    def builder_cls(self) -> type[AttentionMetadataBuilder[Any, Any]]:
        """The builder class itself."""

    @abstractmethod
    def create(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> AttentionMetadataBuilder[Any, Any]:
        """Construct the builder for a group (checks the spec type)."""

    @abstractmethod
    def create_impl(
        self, kv_cache_spec: KVCacheSpec, layer_params: LayerParams | None
    ) -> AttentionImpl[Any]:
        """Construct the impl for one layer of a group."""


@dataclasses.dataclass(frozen=True)
class BuilderBinding(AnyBuilderBinding, Generic[S, M]):
    """A spec type, the builder that accepts it and the impl that consumes its metadata.

    Make one with ``bind_builder``; construct builders through ``create``, which checks
    the spec at run time the way ``bind_builder`` checked it statically.
    """

    spec_type: type[S]
    factory: BuilderClass[S, M]
    impl_cls: type[AttentionImpl[M]]

    @property
    @override
    def builder_cls(self) -> type[AttentionMetadataBuilder[M, Any]]:
        cls: object = self.factory
        # bind_builder accepts builder classes only.
        assert isinstance(cls, type)
        assert issubclass(cls, AttentionMetadataBuilder)
        return cls

    @override
    def create(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> AttentionMetadataBuilder[M, Any]:
        """Construct the builder for a group.

        Raises:
            TypeError: if ``kv_cache_spec`` is not a ``spec_type``.
        """
        if not isinstance(kv_cache_spec, self.spec_type):
            raise TypeError(
                f"{self.builder_cls.__qualname__} is bound to {self.spec_type.__name__}, "
                f"got a {type(kv_cache_spec).__name__} (kind={kv_cache_spec.kind})"
            )
        return self.factory(kv_cache_spec, layer_names, config, device)

    @override
    def create_impl(
        self, kv_cache_spec: KVCacheSpec, layer_params: LayerParams | None
    ) -> AttentionImpl[M]:
        return self.impl_cls(kv_cache_spec, layer_params)


def bind_builder(
    spec_type: type[S],
    builder_cls: BuilderClass[S, M],
    impl_cls: type[AttentionImpl[M]],
) -> BuilderBinding[S, M]:
    """Bind ``builder_cls`` (and ``impl_cls``) to the specs of type ``spec_type``.

    Statically, mypy rejects a builder whose ``__init__`` does not accept ``spec_type``
    and an impl whose metadata type differs from the builder's. At run time the same
    is checked from the annotations, for plugins that were never type-checked.

    Raises:
        TypeError: if the classes are not a builder and an impl, or the builder's
            annotations say it accepts a spec type that ``spec_type`` is not.
    """
    # Checked at run time too: plugins reach here without having been type-checked.
    given: tuple[object, object, object] = (spec_type, builder_cls, impl_cls)
    for value, base, what in zip(
        given,
        (KVCacheSpec, AttentionMetadataBuilder, AttentionImpl),
        ("spec_type", "builder_cls", "impl_cls"),
        strict=True,
    ):
        if not (isinstance(value, type) and issubclass(value, base)):
            raise TypeError(
                f"bind_builder: {what} must be a subclass of {base.__name__}, got {value!r}"
            )
    accepted = _accepted_spec_type(given[1])
    if accepted is not None and not issubclass(spec_type, accepted):
        raise TypeError(
            f"bind_builder: {getattr(builder_cls, '__qualname__', builder_cls)} accepts {accepted.__name__} specs, "
            f"so it cannot be bound to {spec_type.__name__}"
        )
    return BuilderBinding(spec_type, builder_cls, impl_cls)


def _accepted_spec_type(builder_cls: object) -> type | None:
    """The narrowest spec type the builder's annotations name, or ``None`` if unknown."""
    if not isinstance(builder_cls, type):
        return None
    found: list[type] = []
    try:
        init_hints = typing.get_type_hints(getattr(builder_cls, "__init__"))  # noqa: B009 (mypy rejects .__init__ on a type)
        class_hints = typing.get_type_hints(builder_cls)
    except Exception:  # unresolvable annotations (a plugin's forward refs): no check
        return None
    for hint in (init_hints.get("kv_cache_spec"), class_hints.get("kv_cache_spec")):
        if isinstance(hint, type) and issubclass(hint, KVCacheSpec):
            found.append(hint)
    for base in getattr(builder_cls, "__orig_bases__", ()):
        if typing.get_origin(base) is AttentionMetadataBuilder:
            args = typing.get_args(base)
            if len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], KVCacheSpec):
                found.append(args[1])
    if not found:
        return None
    # The most derived of the declared types is what the builder really requires.
    return max(found, key=lambda t: len(t.__mro__))


class AttentionBackend(ABC):
    """A named set of kernels with declared capabilities.

    Subclasses set the class variables below and ``builders``; they are validated when
    registered (``attnkit.registry``). Everything a backend says about support comes
    from ``not_supported_reasons``.
    """

    name: ClassVar[str]
    """Registry name, e.g. ``"triton_attn"``."""
    supported_kinds: ClassVar[frozenset[KVCacheSpecKind]]
    """Spec kinds served; each must be covered by one of ``builders``."""
    builders: ClassVar[tuple[AnyBuilderBinding, ...]]
    """Builder/impl per spec type; the most specific matching binding is used."""
    supported_devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    """Device types (``torch.device.type``)."""
    min_compute_capability: ClassVar[tuple[int, int] | None] = None
    """On CUDA, the oldest compute capability served."""
    max_compute_capability: ClassVar[tuple[int, int] | None] = None
    """On CUDA, the newest compute capability served."""
    supported_dtypes: ClassVar[frozenset[torch.dtype]] = MODEL_DTYPES
    """Model dtypes of attention layers."""
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto"})
    """Cache storage dtypes of attention layers."""
    supported_head_sizes: ClassVar[SizeRule | None] = None
    """Head sizes of attention layers; ``None``: any."""
    supported_block_sizes: ClassVar[SizeRule | None] = None
    """Block sizes of attention layers; ``None``: any."""
    supported_features: ClassVar[frozenset[AttentionFeature]] = frozenset()
    """Optional features served."""
    supported_mamba_types: ClassVar[frozenset[MambaType]] = frozenset()
    """``MambaSpec.mamba_type`` values served (for the ``mamba`` kind)."""
    required_packages: ClassVar[Mapping[str, str]] = {}
    """Import name -> pip requirement of optional packages the backend needs."""
    description: ClassVar[str] = ""
    """One line for ``attnkit backends``."""

    @classmethod
    def not_supported_reasons(cls, request: BackendRequest) -> list[str]:
        """Every reason this backend cannot serve ``request``; empty if it can."""
        spec = request.spec
        reasons = cls.environment_reasons(request.device, request.capability)
        if spec.kind not in cls.supported_kinds:
            # The decisive reason; field-by-field reasons for a kind the backend does
            # not serve would only be noise.
            reasons.append(
                f"kind={spec.kind.value} not supported "
                f"(supported: {', '.join(sorted(k.value for k in cls.supported_kinds))})"
            )
            return reasons
        if cls.find_binding(spec) is None:
            reasons.append(f"no builder is bound to {type(spec).__name__}")
        if isinstance(spec, AttentionSpec):
            reasons.extend(cls._attention_reasons(spec, request))
        elif isinstance(spec, MambaSpec) and spec.mamba_type not in cls.supported_mamba_types:
            supported = ", ".join(sorted(cls.supported_mamba_types)) or "none"
            reasons.append(f"mamba_type={spec.mamba_type} not supported (supported: {supported})")
        missing = sorted(request.features - cls.supported_features)
        if missing:
            supported = ", ".join(sorted(f.value for f in cls.supported_features)) or "none"
            for feature in missing:
                reasons.append(f"feature {feature.value} not supported (supported: {supported})")
        reasons.extend(cls.extra_not_supported_reasons(request))
        return reasons

    @classmethod
    def _attention_reasons(cls, spec: AttentionSpec, request: BackendRequest) -> list[str]:
        reasons: list[str] = []
        if spec.dtype not in cls.supported_dtypes:
            supported = ", ".join(sorted(_dtype_name(d) for d in cls.supported_dtypes))
            reasons.append(
                f"dtype={_dtype_name(spec.dtype)} not supported (supported: {supported})"
            )
        if spec.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            supported = ", ".join(sorted(cls.supported_kv_cache_dtypes))
            reasons.append(
                f"kv_cache_dtype={spec.kv_cache_dtype} not supported (supported: {supported})"
            )
        if cls.supported_head_sizes is not None and not _size_allowed(
            spec.head_size, cls.supported_head_sizes
        ):
            reasons.append(
                f"head_size={spec.head_size} not supported "
                f"(supported: {format_sizes(cls.supported_head_sizes)})"
            )
        if cls.supported_block_sizes is not None and not _size_allowed(
            spec.block_size, cls.supported_block_sizes
        ):
            reasons.append(
                f"block_size={spec.block_size} not supported "
                f"(supported: {format_sizes(cls.supported_block_sizes)})"
            )
        if request.num_heads is not None and request.num_heads % spec.num_kv_heads != 0:
            reasons.append(
                f"num_heads={request.num_heads} is not a multiple of "
                f"num_kv_heads={spec.num_kv_heads}"
            )
        return reasons

    @classmethod
    def environment_reasons(
        cls, device: torch.device, capability: tuple[int, int] | None = None
    ) -> list[str]:
        """Reasons independent of any spec: device type, compute capability, packages."""
        reasons: list[str] = []
        if device.type not in cls.supported_devices:
            reasons.append(
                f"device={device.type} not supported "
                f"(supported: {', '.join(sorted(cls.supported_devices))})"
            )
        elif device.type == "cuda":
            low, high = cls.min_compute_capability, cls.max_compute_capability
            if (low is not None or high is not None) and capability is None:
                reasons.append("compute capability unknown (pass capability=(major, minor))")
            elif capability is not None and low is not None and capability < low:
                reasons.append(
                    f"compute capability {capability[0]}.{capability[1]} < minimum {low[0]}.{low[1]}"
                )
            elif capability is not None and high is not None and capability > high:
                reasons.append(
                    f"compute capability {capability[0]}.{capability[1]} > maximum {high[0]}.{high[1]}"
                )
        for module, requirement in cls.required_packages.items():
            if importlib.util.find_spec(module) is None:
                reasons.append(
                    f"required package {module!r} is not installed (pip install '{requirement}')"
                )
        reasons.extend(cls.extra_environment_reasons(device))
        return reasons

    @classmethod
    def extra_environment_reasons(cls, device: torch.device) -> list[str]:
        """Hook: environment conditions no declaration expresses (e.g. an interpreter flag)."""
        return []

    @classmethod
    def extra_not_supported_reasons(cls, request: BackendRequest) -> list[str]:
        """Hook: spec-dependent conditions no declaration expresses. Default: none."""
        return []

    @classmethod
    def supports(cls, request: BackendRequest) -> bool:
        """``not cls.not_supported_reasons(request)``."""
        return not cls.not_supported_reasons(request)

    @classmethod
    def find_binding(cls, spec: KVCacheSpec) -> AnyBuilderBinding | None:
        """The most specific binding whose spec type ``spec`` is an instance of."""
        matches = [b for b in cls.builders if isinstance(spec, b.spec_type)]
        if not matches:
            return None
        return max(matches, key=lambda b: len(b.spec_type.__mro__))

    @classmethod
    def get_binding(cls, spec: KVCacheSpec) -> AnyBuilderBinding:
        """Like ``find_binding`` but raises ``TypeError`` naming the bound spec types."""
        binding = cls.find_binding(spec)
        if binding is None:
            bound = ", ".join(b.spec_type.__name__ for b in cls.builders) or "none"
            raise TypeError(
                f"backend {cls.name!r} has no builder for {type(spec).__name__} (bound: {bound})"
            )
        return binding

    @classmethod
    def get_kv_cache_shapes(cls, num_blocks: int, spec: KVCacheSpec) -> tuple[tuple[int, ...], ...]:
        """One shape per cache tensor of a layer with ``spec``.

        Default: attention ``[num_blocks, 2, block_size, Hkv, D]``; MLA
        ``[num_blocks, block_size, D]``; Mamba ``[num_blocks, *shape]`` per state;
        encoder-only layers keep no cache (no tensors). Override for another layout.
        """
        if not is_positive_int(num_blocks):
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if isinstance(spec, MambaSpec):
            return tuple((num_blocks, *shape) for shape in spec.shapes)
        if spec.kind is KVCacheSpecKind.ENCODER_ONLY_ATTENTION:
            return ()
        if isinstance(spec, MLAAttentionSpec | SlidingWindowMLASpec):
            return ((num_blocks, spec.block_size, spec.head_size),)
        if isinstance(spec, AttentionSpec):
            return ((num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size),)
        raise TypeError(f"no default cache layout for {type(spec).__name__}")

    @classmethod
    def declaration_problems(cls) -> list[str]:
        """What is wrong with this class's declarations (empty when it is a valid backend).

        Checked when the backend is registered.
        """
        problems: list[str] = []
        if inspect.isabstract(cls):
            problems.append(f"{cls.__qualname__} is abstract")
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name.isidentifier():
            problems.append(f"name must be an identifier string, got {name!r}")
        kinds = getattr(cls, "supported_kinds", None)
        builders = getattr(cls, "builders", None)
        if (
            not isinstance(kinds, frozenset)
            or not kinds
            or not all(isinstance(k, KVCacheSpecKind) for k in kinds)
        ):
            problems.append(
                f"supported_kinds must be a non-empty frozenset of KVCacheSpecKind, got {kinds!r}"
            )
            kinds = frozenset()
        if not isinstance(builders, tuple) or not all(
            isinstance(b, AnyBuilderBinding) for b in builders
        ):
            problems.append(
                f"builders must be a tuple of bind_builder(...) results, got {builders!r}"
            )
            builders = ()
        for kind in sorted(kinds, key=lambda k: k.value):
            spec_cls = spec_class_for_kind(kind)
            if not any(issubclass(spec_cls, b.spec_type) for b in builders):
                problems.append(
                    f"kind {kind.value} is declared but no builder is bound to "
                    f"{spec_cls.__name__} or a base of it"
                )
        if KVCacheSpecKind.MAMBA in kinds and not cls.supported_mamba_types:
            problems.append("kind mamba is declared but supported_mamba_types is empty")
        for attr in ("supported_head_sizes", "supported_block_sizes"):
            rule = getattr(cls, attr)
            if rule is not None and (
                not isinstance(rule, tuple)
                or not rule
                or not all(
                    isinstance(r, MultipleOf | SizeRange)
                    or (isinstance(r, int) and not isinstance(r, bool) and r > 0)
                    for r in rule
                )
            ):
                problems.append(
                    f"{attr} must be None or a non-empty tuple of positive ints/MultipleOf, got {rule!r}"
                )
        return problems
