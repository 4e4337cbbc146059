"""Hugging Face ``config.json`` -> attnkit layer specs.

``layout_from_hf_config`` reads a model's ``config.json`` (a path to the file, to the
directory holding it, or the already-parsed mapping) and returns a ``ModelLayout``: one
``LayerInfo`` per cached sub-layer, in model order, named after the model's own module
(``model.layers.3.self_attn``, ``model.layers.4.mamba``), each with its
``KVCacheSpec`` and the facts an engine needs to build the layer's parameters::

    >>> import attnkit
    >>> layout = attnkit.layout_from_hf_config({
    ...     "model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 2,
    ...     "num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": 4096,
    ...     "torch_dtype": "bfloat16"})
    >>> list(layout.layers)
    ['model.layers.0.self_attn', 'model.layers.1.self_attn']
    >>> layout.layers["model.layers.0.self_attn"].spec.kind.value
    'sliding_window'
    >>> layout.kv_bytes_per_token()  # 2 layers * 2 (K, V) * 8 heads * 128 * 2 bytes
    8192

Each family follows the rule of its transformers configuration class (named in the
family's reader below and in docs/models.md): ``layer_types`` when the file has it,
else the family's own keys. A key a family needs and the file lacks is an error naming
the key and the family; defaults are taken only where the transformers configuration
class documents one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import ClassVar, Literal, cast

import torch

from ._validation import (
    check_positive_int,
    dtype_name,
    is_int,
    is_nonnegative_int,
    is_positive_int,
)
from .errors import ArgumentTypeError, InvalidArgumentError
from .kinds import rules_for
from .params import (
    AttentionLayerParams,
    GatedDeltaNetLayerParams,
    LinearAttentionLayerParams,
    Mamba1LayerParams,
    Mamba2LayerParams,
    ShortConvLayerParams,
    StateLayerParams,
)
from .spec import (
    KV_CACHE_DTYPES,
    MODEL_DTYPES,
    AttentionSpec,
    AttentionType,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheDType,
    KVCacheSpec,
    MambaSpec,
    MambaType,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from .state_types import state_type_of

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "GatedDeltaNetDims",
    "LayerInfo",
    "LinearAttentionDims",
    "MLADims",
    "Mamba1Dims",
    "Mamba2Dims",
    "ModelLayout",
    "ShortConvDims",
    "StateDims",
    "layout_from_hf_config",
    "lightning_attention_decay",
]


# --------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLADims:
    """Multi-head latent attention sizes (DeepSeek V2/V3).

    The cache holds one latent of ``kv_lora_rank + qk_rope_head_dim`` per token; the
    values are the latent's first ``kv_lora_rank`` channels once the up-projections are
    absorbed into the queries and the output.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width before absorption: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_size(self) -> int:
        """Width of the cached latent: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mamba1Dims:
    """A Mamba (1) mixer (Jamba): ``d_inner`` channels, each with its own SSM state.

    Its state shapes are ``Mamba1LayerParams.state_shapes`` for the same sizes;
    ``LayerInfo.state_params`` builds that class from the layer's weights.
    """

    mamba_type: ClassVar[Literal["mamba1"]] = "mamba1"
    d_inner: int
    d_state: int
    d_conv: int
    dt_rank: int | None

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((d_inner, d_conv - 1), (d_inner, d_state))``: conv state and SSM state."""
        return Mamba1LayerParams.state_shapes_for(
            d_inner=self.d_inner, d_state=self.d_state, conv_kernel=self.d_conv
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mamba2Dims:
    """A Mamba2 mixer: H heads of dim P, G groups, state size N, conv width W.

    Its state shapes are ``Mamba2LayerParams.state_shapes`` for the same sizes.
    """

    mamba_type: ClassVar[Literal["mamba2"]] = "mamba2"
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    chunk_size: int | None

    @property
    def conv_dim(self) -> int:
        """C = H*P + 2*G*N, the channels of x, B and C that go through the conv."""
        return self.state_shapes[0][0]

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((C, W - 1), (H, P, N))``."""
        return Mamba2LayerParams.state_shapes_for(
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            n_groups=self.n_groups,
            d_state=self.d_state,
            conv_kernel=self.d_conv,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedDeltaNetDims:
    """A Gated DeltaNet layer (Qwen3-Next): key and value heads may differ in number.

    The conv runs over q, k and v: ``C = 2 * Hk * K + Hv * V``; the delta-rule state is
    ``(Hv, K, V)`` (q and k are repeated to the value heads).
    """

    mamba_type: ClassVar[Literal["gdn"]] = "gdn"
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        """C = 2*Hk*K + Hv*V."""
        return self.state_shapes[0][0]

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((C, W - 1), (Hv, K, V))``."""
        return GatedDeltaNetLayerParams.state_shapes_for(
            num_heads=self.num_value_heads,
            num_key_heads=self.num_key_heads,
            key_dim=self.key_head_dim,
            value_dim=self.value_head_dim,
            conv_kernel=self.conv_kernel,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearAttentionDims:
    """A lightning (linear) attention layer (MiniMax): one ``(D, D)`` state per head.

    ``layer_index`` (the decoder layer's index among all ``num_layers``) fixes the
    layer's per-head decay rates, which are derived, not stored in the checkpoint: see
    :meth:`decay`. ``None`` when the layout was built without them.
    """

    mamba_type: ClassVar[Literal["linear"]] = "linear"
    num_heads: int
    head_dim: int
    layer_index: int | None = None
    num_layers: int | None = None

    def decay(self) -> torch.Tensor:
        """The layer's ``[H]`` float32 decay rates (``LinearAttentionLayerParams.decay``):
        :func:`lightning_attention_decay` of its head count and depth.

        Raises:
            InvalidArgumentError: the dims carry no layer position.
        """
        if self.layer_index is None or self.num_layers is None:
            raise InvalidArgumentError(
                "LinearAttentionDims.decay: needs layer_index and num_layers, got "
                f"layer_index={self.layer_index!r}, num_layers={self.num_layers!r}"
            )
        return lightning_attention_decay(self.num_heads, self.layer_index, self.num_layers)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((H, D, D),)``."""
        return LinearAttentionLayerParams.state_shapes_for(
            num_heads=self.num_heads, key_dim=self.head_dim, value_dim=self.head_dim
        )


def lightning_attention_decay(num_heads: int, layer_index: int, num_layers: int) -> torch.Tensor:
    """Per-head decay rates of a MiniMax lightning-attention layer, ``[num_heads]`` float32.

    The state of head ``h`` is multiplied by ``exp(-rate_h)`` per token, with ALiBi-style
    geometric base rates scaled down linearly with depth (MiniMax-01, arXiv:2501.08313;
    the rule of transformers' MiniMax lightning attention):
    ``rate_h = b ** (h + 1) * (1 - i / (L - 1 + 1e-5) + 1e-5)`` with ``b = 2 ** (-8 / H)``,
    ``i = layer_index`` and ``L = num_layers``. The first layer decays fastest; the
    last decays at ``1e-5``-ish rates (nearly no forgetting).

    Raises:
        InvalidArgumentError: ``num_heads`` or ``num_layers`` not a positive int, or
            ``layer_index`` not in ``[0, num_layers)``.
    """
    for name, value in (("num_heads", num_heads), ("num_layers", num_layers)):
        if not is_positive_int(value):
            raise InvalidArgumentError(
                f"lightning_attention_decay: {name} must be a positive int, got {value!r}"
            )
    if not is_nonnegative_int(layer_index) or layer_index >= num_layers:
        raise InvalidArgumentError(
            f"lightning_attention_decay: layer_index must be an int in [0, {num_layers}), "
            f"got {layer_index!r}"
        )
    exponent = torch.arange(1, num_heads + 1, dtype=torch.float64)
    base = 2.0 ** (-8.0 / num_heads)
    depth = 1.0 - layer_index / (num_layers - 1 + 1e-5) + 1e-5
    rates: torch.Tensor = torch.pow(base, exponent) * depth
    return rates.to(torch.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShortConvDims:
    """An LFM2 short-conv layer: a depthwise conv of width ``conv_kernel`` over ``channels``."""

    mamba_type: ClassVar[Literal["short_conv"]] = "short_conv"
    channels: int
    conv_kernel: int

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((C, W - 1),)``."""
        return ShortConvLayerParams.state_shapes_for(
            channels=self.channels, conv_kernel=self.conv_kernel
        )


StateDims = Mamba1Dims | Mamba2Dims | GatedDeltaNetDims | LinearAttentionDims | ShortConvDims
"""The sizes of a state layer, one record per ``mamba_type``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerInfo:
    """One cached sub-layer of a model: its spec and what its parameters need.

    Attributes:
        spec: the layer's cache spec.
        attn_type: for attention layers, which tokens the queries see (decoder
            self-attention, encoder, encoder-only, cross-attention); ``None`` for state
            layers.
        num_heads: query heads of an attention layer; ``None`` for state layers.
        sliding_window: the window of a sliding-window layer (tokens, the query's own
            included), else ``None``.
        attention_chunk_size: the chunk of a chunked-local layer, else ``None``.
        logits_soft_cap: soft-cap of the attention scores, or ``None``.
        has_sinks: the layer has learned per-head sink logits (gpt-oss); they are
            weights, so ``attention_params`` takes them.
        scale: softmax scale of an attention layer (see each family's rule); ``None``
            for state layers.
        use_rope: whether the layer applies rotary embeddings: ``False`` for Llama 4's
            NoPE layers and for state layers, ``True`` for other attention layers.
        mla: MLA sizes of an MLA layer, else ``None``.
        state: sizes of a state layer, else ``None``.
    """

    spec: KVCacheSpec
    attn_type: AttentionType | None = None
    num_heads: int | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    logits_soft_cap: float | None = None
    has_sinks: bool = False
    scale: float | None = None
    use_rope: bool = True
    mla: MLADims | None = None
    state: StateDims | None = None

    @property
    def is_attention(self) -> bool:
        """Whether the layer is an attention layer (its spec is an ``AttentionSpec``)."""
        return isinstance(self.spec, AttentionSpec)

    def attention_params(
        self,
        *,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> AttentionLayerParams:
        """The ``AttentionLayerParams`` of this attention layer.

        Args:
            sinks: float32 ``[num_heads]`` learned sink logits, required exactly when
                ``has_sinks`` (they are checkpoint weights, not config values).
            k_scale, v_scale: fp8 cache scales (see ``AttentionLayerParams``).

        Raises:
            InvalidArgumentError: for a state layer, or ``sinks`` given to a layer
                without sinks (or missing for one with them).
        """
        if self.num_heads is None:
            raise InvalidArgumentError(
                f"attention_params: this is a {self._kind_name()} layer, not an attention "
                f"layer; use state_params"
            )
        if self.has_sinks and sinks is None:
            raise InvalidArgumentError(
                "attention_params: this layer has learned sinks; pass sinks=<float32 "
                f"[{self.num_heads}] tensor from the checkpoint>, got None"
            )
        if not self.has_sinks and sinks is not None:
            raise InvalidArgumentError(
                "attention_params: this layer has no learned sinks, got sinks="
                f"{list(sinks.shape)} tensor"
            )
        return AttentionLayerParams(
            num_heads=self.num_heads,
            scale=self.scale,
            logits_soft_cap=self.logits_soft_cap,
            sinks=sinks,
            v_head_size=self.mla.kv_lora_rank if self.mla is not None else None,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def state_params(
        self,
        *,
        conv_weight: torch.Tensor | None = None,
        conv_bias: torch.Tensor | None = None,
        A: torch.Tensor | None = None,
        D: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        decay: torch.Tensor | None = None,
        x_proj_weight: torch.Tensor | None = None,
        dt_proj_weight: torch.Tensor | None = None,
        dt_norm_weight: torch.Tensor | None = None,
        B_norm_weight: torch.Tensor | None = None,
        C_norm_weight: torch.Tensor | None = None,
    ) -> StateLayerParams:
        """The parameter object of this state layer, sizes from the config, weights given.

        Which weights each type takes: Mamba (1) ``conv_weight`` ``[D, W]``,
        ``x_proj_weight`` ``[R + 2N, D]``, ``dt_proj_weight`` ``[D, R]``, ``A`` ``[D, N]``
        (and optionally ``conv_bias``, ``D``, ``dt_bias`` = ``dt_proj``'s bias, and
        Jamba's ``dt_norm_weight``, ``B_norm_weight``, ``C_norm_weight``); Mamba2
        ``conv_weight`` ``[C, W]``, ``A`` ``[H]`` (and optionally ``conv_bias``, ``D``,
        ``dt_bias``); Gated DeltaNet and short conv
        ``conv_weight`` (optionally ``conv_bias``); linear attention optionally ``decay``
        ``[H]`` (default: MiniMax's rule from the layer's depth, ``state.decay()``).
        The result's ``state_shapes`` equal ``spec.shapes``.

        Raises:
            InvalidArgumentError: for an attention layer, a Mamba (1) layer whose
                ``dt_proj_weight`` has not the config's ``dt_rank``, a Gated DeltaNet layer
                whose value head count is not a multiple of its key head count, a missing
                weight, or a weight of another type's.
        """
        dims = self.state
        if dims is None:
            raise InvalidArgumentError(
                f"state_params: this is a {self._kind_name()} layer, not a state layer; "
                f"use attention_params"
            )
        given = {
            "conv_weight": conv_weight,
            "conv_bias": conv_bias,
            "A": A,
            "D": D,
            "dt_bias": dt_bias,
            "decay": decay,
        }
        given.update(
            x_proj_weight=x_proj_weight,
            dt_proj_weight=dt_proj_weight,
            dt_norm_weight=dt_norm_weight,
            B_norm_weight=B_norm_weight,
            C_norm_weight=C_norm_weight,
        )
        params: StateLayerParams
        if isinstance(dims, Mamba1Dims):
            _only(given, set(given) - {"decay"}, "mamba1")
            dt_proj = _needed(dt_proj_weight, "dt_proj_weight", "mamba1")
            if dims.dt_rank is not None and dt_proj.dim() == 2 and dt_proj.shape[1] != dims.dt_rank:
                raise InvalidArgumentError(
                    f"state_params: dt_proj_weight must be [{dims.d_inner}, dt_rank={dims.dt_rank}] "
                    f"for this layer, got {list(dt_proj.shape)}"
                )
            params = Mamba1LayerParams(
                d_inner=dims.d_inner,
                d_state=dims.d_state,
                conv_weight=_needed(conv_weight, "conv_weight", "mamba1"),
                conv_bias=conv_bias,
                x_proj_weight=_needed(x_proj_weight, "x_proj_weight", "mamba1"),
                dt_proj_weight=dt_proj,
                dt_bias=dt_bias,
                A=_needed(A, "A", "mamba1"),
                D=D,
                dt_norm_weight=dt_norm_weight,
                B_norm_weight=B_norm_weight,
                C_norm_weight=C_norm_weight,
            )
        elif isinstance(dims, Mamba2Dims):
            _only(given, {"conv_weight", "conv_bias", "A", "D", "dt_bias"}, "mamba2")
            params = Mamba2LayerParams(
                num_heads=dims.num_heads,
                head_dim=dims.head_dim,
                n_groups=dims.n_groups,
                d_state=dims.d_state,
                conv_weight=_needed(conv_weight, "conv_weight", "mamba2"),
                conv_bias=conv_bias,
                A=_needed(A, "A", "mamba2"),
                D=D,
                dt_bias=dt_bias,
            )
            if dims.chunk_size is not None:
                params = dataclasses.replace(params, chunk_size=dims.chunk_size)
        elif isinstance(dims, GatedDeltaNetDims):
            _only(given, {"conv_weight", "conv_bias"}, "gdn")
            # num_heads is the value (state) head count; q/k have num_key_heads heads,
            # each shared by num_value_heads // num_key_heads value heads.
            params = GatedDeltaNetLayerParams(
                num_heads=dims.num_value_heads,
                num_key_heads=dims.num_key_heads,
                key_dim=dims.key_head_dim,
                value_dim=dims.value_head_dim,
                conv_weight=_needed(conv_weight, "conv_weight", "gdn"),
                conv_bias=conv_bias,
            )
        elif isinstance(dims, LinearAttentionDims):
            _only(given, {"decay"}, "linear")
            params = LinearAttentionLayerParams(
                num_heads=dims.num_heads,
                key_dim=dims.head_dim,
                value_dim=dims.head_dim,
                # Derived from the layer's depth unless given (MiniMax's rule).
                decay=dims.decay() if decay is None else decay,
            )
        else:
            _only(given, {"conv_weight", "conv_bias"}, "short_conv")
            params = ShortConvLayerParams(
                channels=dims.channels,
                conv_weight=_needed(conv_weight, "conv_weight", "short_conv"),
                conv_bias=conv_bias,
            )
        if params.state_shapes != dims.state_shapes:
            raise InvalidArgumentError(
                f"state_params: conv_weight must be [{dims.state_shapes[0][0]}, "
                f"{dims.state_shapes[0][1] + 1}] for this layer, got {params.state_shapes[0]} "
                "as the conv state"
            )
        return params

    def _kind_name(self) -> str:
        if self.state is not None:
            return self.state.mamba_type
        return self.spec.kind.value


def _only(given: Mapping[str, torch.Tensor | None], allowed: set[str], mamba_type: str) -> None:
    extra = sorted(
        name for name, value in given.items() if value is not None and name not in allowed
    )
    if extra:
        raise InvalidArgumentError(
            f"state_params: a {mamba_type} layer takes {sorted(allowed)}, got {extra} too"
        )


def _needed(value: torch.Tensor | None, name: str, mamba_type: str) -> torch.Tensor:
    if value is None:
        raise InvalidArgumentError(f"state_params: a {mamba_type} layer needs {name}, got None")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelLayout:
    """A model's cached sub-layers, in model order.

    Attributes:
        model_type: the config's ``model_type``.
        dtype: the model dtype the specs were built with.
        layers: layer name -> ``LayerInfo`` (read-only, model order).
    """

    model_type: str
    dtype: torch.dtype
    layers: Mapping[str, LayerInfo]

    def specs(self) -> dict[str, KVCacheSpec]:
        """Layer name -> spec, what ``AttentionRuntime`` takes."""
        return {name: info.spec for name, info in self.layers.items()}

    def attention_params(self) -> dict[str, AttentionLayerParams]:
        """Layer name -> ``AttentionLayerParams`` for every attention layer without
        learned sinks (layers with sinks need their weights: call
        ``LayerInfo.attention_params(sinks=...)``)."""
        return {
            name: info.attention_params()
            for name, info in self.layers.items()
            if info.is_attention and not info.has_sinks
        }

    def kv_bytes_per_token(self) -> int:
        """Cache bytes each token of a request's context adds, summed over the layers
        that keep a per-token cache of the decoder's own tokens: every attention layer
        but encoder (no cache) and cross-attention layers (theirs grow with the encoder's
        tokens). Windowed layers count in full (before their blocks are released)."""
        return sum(
            info.spec.page_size_bytes // info.spec.block_size
            for info in self.layers.values()
            if rules_for(info.spec).counts_kv_per_token
        )

    def state_bytes_per_request(self) -> int:
        """Bytes of every state layer's state for one request."""
        return sum(
            info.spec.page_size_bytes
            for info in self.layers.values()
            if isinstance(info.spec, MambaSpec)
        )


# --------------------------------------------------------------------------- config access


_DTYPE_NAMES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class _Config:
    """Typed, checked reads of one family's config mapping; errors name key and family."""

    def __init__(self, data: Mapping[str, object], family: str, where: str = "") -> None:
        self.data = data
        self.family = family
        self.where = where  # "text_config." for nested configs, in messages

    def _missing(self, key: str) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"layout_from_hf_config: a {self.family} config needs key "
            f"{self.where + key!r}, which is missing"
        )

    def _wrong(self, key: str, expected: str, value: object) -> ArgumentTypeError:
        return ArgumentTypeError(
            f"layout_from_hf_config: {self.family} config key {self.where + key!r} must be "
            f"{expected}, got {value!r} ({type(value).__name__})"
        )

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str) -> object:
        if key not in self.data:
            raise self._missing(key)
        return self.data[key]

    def int_(self, key: str, default: int | None = None) -> int:
        if key not in self.data or (self.data[key] is None and default is not None):
            if default is None:
                raise self._missing(key)
            return default
        value = self.data[key]
        if not is_int(value):
            raise self._wrong(key, "a positive int", value)
        if cast("int", value) < 1:
            raise InvalidArgumentError(
                f"layout_from_hf_config: {self.family} config key {self.where + key!r} must "
                f"be a positive int, got {value!r}"
            )
        return cast("int", value)

    def opt_int(self, key: str, default: int | None = None) -> int | None:
        """An int or ``None`` (JSON null); ``default`` when the key is absent."""
        if key not in self.data:
            return default
        if self.data[key] is None:
            return None
        return self.int_(key)

    def index(self, key: str) -> int:
        value = self.raw(key)
        if not is_int(value) or cast("int", value) < 0:
            raise self._wrong(key, "an int >= 0", value)
        return cast("int", value)

    def opt_float(self, key: str, default: float | None = None) -> float | None:
        if key not in self.data:
            return default
        value = self.data[key]
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._wrong(key, "a number or null", value)
        return float(value)

    def bool_(self, key: str, default: bool) -> bool:
        if key not in self.data or self.data[key] is None:
            return default
        value = self.data[key]
        if not isinstance(value, bool):
            raise self._wrong(key, "a bool", value)
        return value

    def str_(self, key: str) -> str:
        value = self.raw(key)
        if not isinstance(value, str):
            raise self._wrong(key, "a string", value)
        return value

    def list_(self, key: str) -> list[object]:
        value = self.raw(key)
        if not isinstance(value, list):
            raise self._wrong(key, "a list", value)
        return cast("list[object]", value)

    def int_list(self, key: str) -> list[int]:
        items = self.list_(key)
        if not all(is_int(v) and cast("int", v) >= 0 for v in items):
            raise self._wrong(key, "a list of ints >= 0", items)
        return cast("list[int]", items)

    def indices(self, key: str, num_layers: int) -> set[int]:
        """A list of layer indices, each below ``num_layers``."""
        found = self.int_list(key)
        bad = [i for i in found if i >= num_layers]
        if bad:
            raise InvalidArgumentError(
                f"layout_from_hf_config: {self.family} config key {self.where + key!r} lists "
                f"layers {bad}, but the model has {num_layers} layers (0..{num_layers - 1})"
            )
        return set(found)

    def layer_types(self, key: str, num_layers: int, allowed: Sequence[str]) -> list[str]:
        """A per-layer list of type names: one per layer, each in ``allowed``."""
        items = self.list_(key)
        if len(items) != num_layers:
            raise InvalidArgumentError(
                f"layout_from_hf_config: {self.family} config key {self.where + key!r} must "
                f"have one entry per layer ({num_layers}), got {len(items)}"
            )
        for i, item in enumerate(items):
            if item not in allowed:
                raise InvalidArgumentError(
                    f"layout_from_hf_config: {self.family} config key {self.where}{key}[{i}] "
                    f"must be one of {list(allowed)}, got {item!r}"
                )
        return cast("list[str]", items)

    def sub(self, key: str) -> _Config:
        value = self.raw(key)
        if not isinstance(value, Mapping):
            raise self._wrong(key, "an object", value)
        return _Config(cast("Mapping[str, object]", value), self.family, f"{self.where}{key}.")

    def dtype(self) -> torch.dtype | None:
        """The checkpoint dtype (``torch_dtype``, or ``dtype`` in newer files), or ``None``."""
        for key in ("torch_dtype", "dtype"):
            value = self.data.get(key)
            if value is None:
                continue
            name = value.removeprefix("torch.") if isinstance(value, str) else None
            if name is None or name not in _DTYPE_NAMES:
                raise InvalidArgumentError(
                    f"layout_from_hf_config: {self.family} config key {self.where + key!r} must "
                    f"name one of {sorted(_DTYPE_NAMES)}, got {value!r}; pass dtype= to "
                    "override it"
                )
            return _DTYPE_NAMES[name]
        return None


# --------------------------------------------------------------------------- layer building


class _Builder:
    """Builds ``LayerInfo`` records for one call (dtype, block size, cache dtype fixed)."""

    def __init__(
        self,
        dtype: torch.dtype,
        block_size: int,
        kv_cache_dtype: KVCacheDType,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.dtype = dtype
        self.state_dtype = state_dtype
        self.block_size = block_size
        self.kv_cache_dtype: KVCacheDType = kv_cache_dtype

    def attention(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        attn_type: AttentionType = AttentionType.DECODER,
        sliding_window: int | None = None,
        attention_chunk_size: int | None = None,
        logits_soft_cap: float | None = None,
        has_sinks: bool = False,
        scale: float | None = None,
        use_rope: bool = True,
    ) -> LayerInfo:
        spec: AttentionSpec
        bs, h, d, dt, kvd = (
            self.block_size,
            num_kv_heads,
            head_size,
            self.dtype,
            self.kv_cache_dtype,
        )
        if attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
            spec = EncoderOnlyAttentionSpec(
                block_size=bs, num_kv_heads=h, head_size=d, dtype=dt, kv_cache_dtype=kvd
            )
        elif attn_type is AttentionType.ENCODER_DECODER:
            spec = CrossAttentionSpec(
                block_size=bs, num_kv_heads=h, head_size=d, dtype=dt, kv_cache_dtype=kvd
            )
        elif attention_chunk_size is not None:
            spec = ChunkedLocalAttentionSpec(
                block_size=bs,
                num_kv_heads=h,
                head_size=d,
                dtype=dt,
                kv_cache_dtype=kvd,
                attention_chunk_size=attention_chunk_size,
            )
        elif sliding_window is not None:
            spec = SlidingWindowSpec(
                block_size=bs,
                num_kv_heads=h,
                head_size=d,
                dtype=dt,
                kv_cache_dtype=kvd,
                sliding_window=sliding_window,
            )
        else:
            spec = FullAttentionSpec(
                block_size=bs, num_kv_heads=h, head_size=d, dtype=dt, kv_cache_dtype=kvd
            )
        return LayerInfo(
            spec=spec,
            attn_type=attn_type,
            num_heads=num_heads,
            sliding_window=sliding_window,
            attention_chunk_size=attention_chunk_size,
            logits_soft_cap=logits_soft_cap,
            has_sinks=has_sinks,
            scale=scale if scale is not None else head_size**-0.5,
            use_rope=use_rope,
        )

    def mla(self, *, num_heads: int, dims: MLADims, scale: float) -> LayerInfo:
        spec = MLAAttentionSpec(
            block_size=self.block_size,
            head_size=dims.latent_size,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        return LayerInfo(
            spec=spec,
            attn_type=AttentionType.DECODER,
            num_heads=num_heads,
            scale=scale,
            mla=dims,
        )

    def state(self, dims: StateDims) -> LayerInfo:
        shapes = dims.state_shapes
        mamba_type: MambaType = dims.mamba_type
        spec = MambaSpec(
            block_size=self.block_size,
            shapes=shapes,
            # Conv states in the model dtype, recurrent states in state_dtype.
            dtypes=state_type_of(mamba_type).state_dtypes(self.dtype, self.state_dtype),
            mamba_type=mamba_type,
        )
        return LayerInfo(spec=spec, state=dims, use_rope=False)


_Layers = Iterator[tuple[str, LayerInfo]]


def _kv_heads(cfg: _Config, num_heads: int) -> int:
    """``num_key_value_heads``; absent or null means ``num_attention_heads`` (multi-head
    attention), as LlamaConfig and the configuration classes derived from it document."""
    return cfg.int_("num_key_value_heads", default=num_heads)


def _head_dim(cfg: _Config, num_heads: int, default: int | None = None) -> int:
    """``head_dim``; absent or null means ``default`` where the family's configuration
    class documents a number, else ``hidden_size // num_attention_heads`` (transformers
    LlamaConfig: head_dim defaults to hidden_size // num_attention_heads)."""
    if cfg.has("head_dim") and cfg.data["head_dim"] is not None:
        return cfg.int_("head_dim")
    if default is not None:
        return default
    hidden = cfg.int_("hidden_size")
    if hidden % num_heads:
        raise InvalidArgumentError(
            f"layout_from_hf_config: {cfg.family} config has no head_dim and hidden_size="
            f"{hidden} is not a multiple of num_attention_heads={num_heads}"
        )
    return hidden // num_heads


class _Decoder:
    """The plain decoder attention sizes most families share."""

    def __init__(self, cfg: _Config, head_dim_default: int | None = None) -> None:
        self.num_layers = cfg.int_("num_hidden_layers")
        self.num_heads = cfg.int_("num_attention_heads")
        self.num_kv_heads = _kv_heads(cfg, self.num_heads)
        self.head_dim = _head_dim(cfg, self.num_heads, head_dim_default)


def _self_attn(prefix: str, i: int) -> str:
    return f"{prefix}.{i}.self_attn"


def _type_list_or(
    cfg: _Config, num_layers: int, allowed: Sequence[str], rule: Callable[[int], str]
) -> list[str]:
    """``layer_types`` when the file has it, else ``rule(i)`` per layer."""
    if cfg.has("layer_types") and cfg.data["layer_types"] is not None:
        return cfg.layer_types("layer_types", num_layers, allowed)
    return [rule(i) for i in range(num_layers)]


# ---- dense decoders --------------------------------------------------------------------


def _llama(cfg: _Config, b: _Builder) -> _Layers:
    """transformers LlamaConfig: every layer full attention; head_dim defaults to
    hidden_size // num_attention_heads; num_key_value_heads to num_attention_heads."""
    d = _Decoder(cfg)
    for i in range(d.num_layers):
        yield (
            _self_attn("model.layers", i),
            b.attention(num_heads=d.num_heads, num_kv_heads=d.num_kv_heads, head_size=d.head_dim),
        )


def _mistral(cfg: _Config, b: _Builder) -> _Layers:
    """transformers MistralConfig: ``sliding_window`` (defaults to 4096; null: none) on
    every layer."""
    d = _Decoder(cfg)
    window = cfg.opt_int("sliding_window", default=4096)
    for i in range(d.num_layers):
        yield (
            _self_attn("model.layers", i),
            b.attention(
                num_heads=d.num_heads,
                num_kv_heads=d.num_kv_heads,
                head_size=d.head_dim,
                sliding_window=window,
            ),
        )


def _qwen(cfg: _Config, b: _Builder, head_dim_default: int | None) -> _Layers:
    """transformers Qwen2Config / Qwen3Config: ``sliding_window`` (4096) applies only when
    ``use_sliding_window`` (defaults to false), and then to layers
    ``i >= max_window_layers`` (28); ``layer_types`` overrides which layers."""
    d = _Decoder(cfg, head_dim_default)
    window: int | None = None
    if cfg.bool_("use_sliding_window", default=False):
        window = cfg.opt_int("sliding_window", default=4096)
    # Qwen2Config documents max_window_layers defaulting to 28.
    max_window_layers = cfg.index("max_window_layers") if cfg.has("max_window_layers") else 28

    def rule(i: int) -> str:
        sliding = window is not None and i >= max_window_layers
        return "sliding_attention" if sliding else "full_attention"

    # With the window off, sliding_window is None and a "sliding_attention" entry of
    # layer_types attends to the whole context, as in transformers.
    types_ = _type_list_or(cfg, d.num_layers, ("full_attention", "sliding_attention"), rule)
    for i, kind in enumerate(types_):
        yield (
            _self_attn("model.layers", i),
            b.attention(
                num_heads=d.num_heads,
                num_kv_heads=d.num_kv_heads,
                head_size=d.head_dim,
                sliding_window=window if kind == "sliding_attention" else None,
            ),
        )


def _gemma(cfg: _Config, b: _Builder, prefix: str, *, gemma3: bool) -> _Layers:
    """transformers Gemma2Config: layer i is sliding when ``(i + 1) % 2`` (even layers);
    Gemma3TextConfig: sliding unless ``(i + 1) % sliding_window_pattern == 0`` (pattern
    defaults to 6); ``layer_types`` overrides both. Both: ``head_dim``, ``sliding_window``
    (4096) and ``query_pre_attn_scalar`` (256) default as documented there; the softmax
    scale is ``query_pre_attn_scalar ** -0.5``; scores soft-capped at
    ``attn_logit_softcapping`` (Gemma2 defaults to 50.0, Gemma3 to none)."""
    d = _Decoder(cfg, head_dim_default=256)
    window = cfg.int_("sliding_window", default=4096)
    scale = cfg.int_("query_pre_attn_scalar", default=256) ** -0.5
    soft_cap = cfg.opt_float("attn_logit_softcapping", default=None if gemma3 else 50.0)
    if gemma3:
        pattern = cfg.int_(
            "sliding_window_pattern", default=cfg.int_("_sliding_window_pattern", default=6)
        )
    else:
        pattern = 2

    def rule(i: int) -> str:
        return "sliding_attention" if (i + 1) % pattern else "full_attention"

    types_ = _type_list_or(cfg, d.num_layers, ("full_attention", "sliding_attention"), rule)
    for i, kind in enumerate(types_):
        yield (
            _self_attn(prefix, i),
            b.attention(
                num_heads=d.num_heads,
                num_kv_heads=d.num_kv_heads,
                head_size=d.head_dim,
                sliding_window=window if kind == "sliding_attention" else None,
                logits_soft_cap=soft_cap,
                scale=scale,
            ),
        )


def _gpt_oss(cfg: _Config, b: _Builder) -> _Layers:
    """transformers GptOssConfig: ``layer_types`` (default: sliding when ``(i + 1) % 2``),
    ``sliding_window`` (128) and ``head_dim`` (64) as documented there; every attention
    layer has learned per-head sinks (``GptOssAttention.sinks``, one logit per head)."""
    d = _Decoder(cfg, head_dim_default=64)
    window = cfg.int_("sliding_window", default=128)

    def rule(i: int) -> str:
        return "sliding_attention" if (i + 1) % 2 else "full_attention"

    types_ = _type_list_or(cfg, d.num_layers, ("full_attention", "sliding_attention"), rule)
    for i, kind in enumerate(types_):
        yield (
            _self_attn("model.layers", i),
            b.attention(
                num_heads=d.num_heads,
                num_kv_heads=d.num_kv_heads,
                head_size=d.head_dim,
                sliding_window=window if kind == "sliding_attention" else None,
                has_sinks=True,
            ),
        )


def _llama4(cfg: _Config, b: _Builder) -> _Layers:
    """transformers Llama4TextConfig: ``no_rope_layers[i]`` is 1 for a RoPE layer, 0 for
    a NoPE layer (an empty or absent list means ``int((i + 1) % no_rope_layer_interval
    != 0)``, the interval defaulting to 4); ``layer_types`` defaults to
    ``chunked_attention`` on RoPE layers and ``full_attention`` on NoPE layers, with
    ``attention_chunk_size`` (8192; null: no chunking). ``head_dim`` defaults to 128.
    The NoPE layers' query temperature tuning is the model's, not the softmax scale's."""
    text = cfg.sub("text_config")
    d = _Decoder(text, head_dim_default=128)
    interval = text.int_("no_rope_layer_interval", default=4)
    no_rope: list[int] = []
    if text.has("no_rope_layers") and text.data["no_rope_layers"]:
        no_rope = text.int_list("no_rope_layers")
        if len(no_rope) != d.num_layers:
            raise InvalidArgumentError(
                f"layout_from_hf_config: llama4 config key 'text_config.no_rope_layers' must "
                f"have one entry per layer ({d.num_layers}), got {len(no_rope)}"
            )
    else:
        no_rope = [int((i + 1) % interval != 0) for i in range(d.num_layers)]
    chunk = text.opt_int("attention_chunk_size", default=8192)
    types_ = _type_list_or(
        text,
        d.num_layers,
        ("chunked_attention", "full_attention"),
        lambda i: "chunked_attention" if no_rope[i] else "full_attention",
    )
    for i, kind in enumerate(types_):
        yield (
            _self_attn("language_model.model.layers", i),
            b.attention(
                num_heads=d.num_heads,
                num_kv_heads=d.num_kv_heads,
                head_size=d.head_dim,
                attention_chunk_size=chunk if kind == "chunked_attention" else None,
                use_rope=bool(no_rope[i]),
            ),
        )


def _yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's yarn attention factor: ``0.1 * mscale * ln(factor) + 1`` for factor > 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _deepseek(cfg: _Config, b: _Builder) -> _Layers:
    """transformers DeepseekV2Config / DeepseekV3Config: every layer is MLA. The cached
    latent is ``kv_lora_rank + qk_rope_head_dim`` wide (one per token, shared by all
    heads). The softmax scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times
    ``mscale**2`` when ``rope_scaling`` is a non-default type with a non-zero
    ``mscale_all_dim`` (DeepseekV3Attention: ``mscale = 0.1 * mscale_all_dim *
    ln(factor) + 1``). The multi-token-prediction layers
    (``num_nextn_predict_layers``) are not part of the model's layers."""
    num_layers = cfg.int_("num_hidden_layers")
    num_heads = cfg.int_("num_attention_heads")
    dims = MLADims(
        kv_lora_rank=cfg.int_("kv_lora_rank"),
        qk_rope_head_dim=cfg.int_("qk_rope_head_dim"),
        qk_nope_head_dim=cfg.int_("qk_nope_head_dim"),
        v_head_dim=cfg.int_("v_head_dim"),
        q_lora_rank=cfg.opt_int("q_lora_rank"),
    )
    scale = dims.qk_head_dim**-0.5
    if cfg.has("rope_scaling") and cfg.data["rope_scaling"] is not None:
        rope = cfg.sub("rope_scaling")
        kind = rope.data.get("rope_type", rope.data.get("type", "default"))
        mscale_all_dim = rope.opt_float("mscale_all_dim", default=0.0)
        if kind != "default" and mscale_all_dim:
            factor = rope.opt_float("factor")
            if factor is None:
                raise rope._missing("factor")
            scale *= _yarn_mscale(factor, mscale_all_dim) ** 2
    for i in range(num_layers):
        yield _self_attn("model.layers", i), b.mla(num_heads=num_heads, dims=dims, scale=scale)


# ---- hybrids ---------------------------------------------------------------------------


def _qwen3_next(cfg: _Config, b: _Builder) -> _Layers:
    """transformers Qwen3NextConfig: ``layer_types`` (default: ``full_attention`` when
    ``(i + 1) % full_attention_interval == 0``, interval 4, else ``linear_attention``, a
    Gated DeltaNet ``linear_attn``); ``head_dim`` defaults to 256."""
    d = _Decoder(cfg, head_dim_default=256)
    interval = cfg.int_("full_attention_interval", default=4)
    types_ = _type_list_or(
        cfg,
        d.num_layers,
        ("full_attention", "linear_attention"),
        lambda i: "linear_attention" if (i + 1) % interval else "full_attention",
    )
    dims: GatedDeltaNetDims | None = None
    if "linear_attention" in types_:
        dims = GatedDeltaNetDims(
            num_key_heads=cfg.int_("linear_num_key_heads"),
            num_value_heads=cfg.int_("linear_num_value_heads"),
            key_head_dim=cfg.int_("linear_key_head_dim"),
            value_head_dim=cfg.int_("linear_value_head_dim"),
            conv_kernel=cfg.int_("linear_conv_kernel_dim"),
        )
    for i, kind in enumerate(types_):
        if kind == "full_attention":
            yield (
                _self_attn("model.layers", i),
                b.attention(
                    num_heads=d.num_heads, num_kv_heads=d.num_kv_heads, head_size=d.head_dim
                ),
            )
        else:
            assert dims is not None
            yield f"model.layers.{i}.linear_attn", b.state(dims)


def _jamba(cfg: _Config, b: _Builder) -> _Layers:
    """transformers JambaConfig: layer i is attention when ``i % attn_layer_period ==
    attn_layer_offset``, else a Mamba (1) mixer of ``d_inner = mamba_expand *
    hidden_size`` channels; attention layers use ``sliding_window`` when it is set."""
    d = _Decoder(cfg)
    period = cfg.int_("attn_layer_period")
    offset = cfg.index("attn_layer_offset")
    window = cfg.opt_int("sliding_window")
    dims = Mamba1Dims(
        d_inner=cfg.int_("mamba_expand") * cfg.int_("hidden_size"),
        d_state=cfg.int_("mamba_d_state"),
        d_conv=cfg.int_("mamba_d_conv"),
        # JambaConfig: mamba_dt_rank "auto" means ceil(hidden_size / 16); not a cache size.
        dt_rank=cfg.opt_int("mamba_dt_rank") if cfg.data.get("mamba_dt_rank") != "auto" else None,
    )
    for i in range(d.num_layers):
        if i % period == offset:
            yield (
                _self_attn("model.layers", i),
                b.attention(
                    num_heads=d.num_heads,
                    num_kv_heads=d.num_kv_heads,
                    head_size=d.head_dim,
                    sliding_window=window,
                ),
            )
        else:
            yield f"model.layers.{i}.mamba", b.state(dims)


def _mamba2_dims(
    cfg: _Config,
    *,
    num_heads: str,
    head_dim: str,
    n_groups: str,
    d_state: str,
    d_conv: str,
    chunk_size: str,
    intermediate: int | None,
) -> Mamba2Dims:
    """Mamba2 sizes from a family's keys; a ``head_dim`` of ``"auto"`` means
    ``intermediate // num_heads`` (BambaConfig, FalconH1Config)."""
    heads = cfg.int_(num_heads)
    if cfg.raw(head_dim) == "auto":
        if intermediate is None:
            raise cfg._wrong(head_dim, "a positive int", "auto")
        p = intermediate // heads
    else:
        p = cfg.int_(head_dim)
    if intermediate is not None and heads * p != intermediate:
        raise InvalidArgumentError(
            f"layout_from_hf_config: {cfg.family} config: {num_heads}={heads} * {head_dim}={p} "
            f"must equal the mamba intermediate size {intermediate}"
        )
    return Mamba2Dims(
        num_heads=heads,
        head_dim=p,
        n_groups=cfg.int_(n_groups),
        d_state=cfg.int_(d_state),
        d_conv=cfg.int_(d_conv),
        chunk_size=cfg.opt_int(chunk_size),
    )


def _bamba(cfg: _Config, b: _Builder) -> _Layers:
    """transformers BambaConfig: attention at ``attn_layer_indices`` (absent or null:
    none), Mamba2 elsewhere, with ``mamba_expand * hidden_size`` inner channels."""
    d = _Decoder(cfg)
    attn = (
        cfg.indices("attn_layer_indices", d.num_layers)
        if cfg.data.get("attn_layer_indices") is not None
        else set[int]()
    )
    dims = _mamba2_dims(
        cfg,
        num_heads="mamba_n_heads",
        head_dim="mamba_d_head",
        n_groups="mamba_n_groups",
        d_state="mamba_d_state",
        d_conv="mamba_d_conv",
        chunk_size="mamba_chunk_size",
        intermediate=cfg.int_("mamba_expand") * cfg.int_("hidden_size"),
    )
    for i in range(d.num_layers):
        if i in attn:
            yield (
                _self_attn("model.layers", i),
                b.attention(
                    num_heads=d.num_heads, num_kv_heads=d.num_kv_heads, head_size=d.head_dim
                ),
            )
        else:
            yield f"model.layers.{i}.mamba", b.state(dims)


_NEMOTRON_PATTERN: Mapping[str, str] = {
    "M": "mamba",
    "*": "attention",
    "-": "mlp",
    "E": "moe",
}
_NEMOTRON_TYPES: Mapping[str, str] = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}


def _nemotron_h(cfg: _Config, b: _Builder) -> _Layers:
    """transformers NemotronHConfig: one block per character of
    ``hybrid_override_pattern`` (``M`` Mamba2, ``*`` attention, ``-`` MLP, ``E`` MoE; the
    pattern's length is the layer count), or ``layers_block_type`` / ``layer_types``
    (``mamba``/``linear_attention``, ``attention``/``full_attention``, ``mlp``, ``moe``).
    Every block's module is ``backbone.layers.{i}.mixer``; MLP and MoE blocks keep no
    cache. Mamba2 sizes: ``mamba_num_heads``, ``mamba_head_dim``, ``n_groups``,
    ``ssm_state_size``, ``conv_kernel``; attention ``head_dim`` (128 documented)."""
    blocks: list[str]
    list_key = next(
        (k for k in ("layers_block_type", "layer_types") if cfg.data.get(k) is not None), None
    )
    if list_key is not None:
        items = cfg.list_(list_key)
        blocks = cfg.layer_types(list_key, len(items), list(_NEMOTRON_TYPES))
        blocks = [_NEMOTRON_TYPES[t] for t in blocks]
    else:
        pattern = cfg.str_("hybrid_override_pattern")
        bad = sorted({c for c in pattern if c not in _NEMOTRON_PATTERN})
        if bad or not pattern:
            raise InvalidArgumentError(
                "layout_from_hf_config: nemotron_h config key 'hybrid_override_pattern' must "
                f"be a non-empty string of {list(_NEMOTRON_PATTERN)}, got {pattern!r}"
            )
        blocks = [_NEMOTRON_PATTERN[c] for c in pattern]
    attention = mamba = None
    if "attention" in blocks:
        num_heads = cfg.int_("num_attention_heads")
        head_dim = (
            cfg.int_("attention_head_dim")
            if cfg.data.get("head_dim") is None and cfg.has("attention_head_dim")
            else _head_dim(cfg, num_heads, default=128)
        )
        attention = (num_heads, _kv_heads(cfg, num_heads), head_dim)
    if "mamba" in blocks:
        mamba = Mamba2Dims(
            num_heads=cfg.int_("mamba_num_heads"),
            head_dim=cfg.int_("mamba_head_dim"),
            n_groups=cfg.int_("n_groups") if cfg.has("n_groups") else cfg.int_("mamba_n_groups"),
            d_state=cfg.int_("ssm_state_size"),
            d_conv=cfg.int_("conv_kernel") if cfg.has("conv_kernel") else cfg.int_("mamba_d_conv"),
            chunk_size=cfg.opt_int("chunk_size", default=cfg.opt_int("mamba_chunk_size")),
        )
    for i, block in enumerate(blocks):
        name = f"backbone.layers.{i}.mixer"
        if block == "attention":
            assert attention is not None
            yield (
                name,
                b.attention(
                    num_heads=attention[0], num_kv_heads=attention[1], head_size=attention[2]
                ),
            )
        elif block == "mamba":
            assert mamba is not None
            yield name, b.state(mamba)


def _lfm2(cfg: _Config, b: _Builder) -> _Layers:
    """transformers Lfm2Config: ``layer_types`` (``full_attention``/``conv``), else
    attention at ``full_attn_idxs`` (absent: every layer) and a short conv of
    ``hidden_size`` channels and width ``conv_L_cache`` elsewhere."""
    d = _Decoder(cfg)
    if cfg.data.get("layer_types") is not None:
        types_ = cfg.layer_types("layer_types", d.num_layers, ("full_attention", "conv"))
    else:
        attn = (
            cfg.indices("full_attn_idxs", d.num_layers)
            if cfg.data.get("full_attn_idxs") is not None
            else set(range(d.num_layers))
        )
        types_ = ["full_attention" if i in attn else "conv" for i in range(d.num_layers)]
    dims = None
    if "conv" in types_:
        dims = ShortConvDims(channels=cfg.int_("hidden_size"), conv_kernel=cfg.int_("conv_L_cache"))
    for i, kind in enumerate(types_):
        if kind == "full_attention":
            yield (
                _self_attn("model.layers", i),
                b.attention(
                    num_heads=d.num_heads, num_kv_heads=d.num_kv_heads, head_size=d.head_dim
                ),
            )
        else:
            assert dims is not None
            yield f"model.layers.{i}.conv", b.state(dims)


def _minimax_layers(cfg: _Config, b: _Builder, types_: Sequence[str]) -> _Layers:
    d = _Decoder(cfg)
    window = cfg.opt_int("sliding_window")
    for i, kind in enumerate(types_):
        dims = LinearAttentionDims(
            num_heads=d.num_heads, head_dim=d.head_dim, layer_index=i, num_layers=len(types_)
        )
        if kind == "full_attention":
            yield (
                _self_attn("model.layers", i),
                b.attention(
                    num_heads=d.num_heads,
                    num_kv_heads=d.num_kv_heads,
                    head_size=d.head_dim,
                    sliding_window=window,
                ),
            )
        else:
            yield _self_attn("model.layers", i), b.state(dims)


def _minimax(cfg: _Config, b: _Builder) -> _Layers:
    """transformers MiniMaxConfig: ``layer_types`` (default: ``full_attention`` when
    ``(i + 1) % 2``, else ``linear_attention``, a lightning attention layer with one
    ``(head_dim, head_dim)`` state per head). Both kinds live at ``self_attn``."""
    num_layers = cfg.int_("num_hidden_layers")
    types_ = _type_list_or(
        cfg,
        num_layers,
        ("full_attention", "linear_attention"),
        lambda i: "full_attention" if (i + 1) % 2 else "linear_attention",
    )
    yield from _minimax_layers(cfg, b, types_)


def _minimax_text_01(cfg: _Config, b: _Builder) -> _Layers:
    """MiniMax-Text-01's own MiniMaxText01Config (remote code): ``attn_type_list[i]`` is 0
    for a lightning (linear) attention layer, 1 for softmax attention."""
    num_layers = cfg.int_("num_hidden_layers")
    flags = cfg.list_("attn_type_list")
    if len(flags) != num_layers or any(f not in (0, 1) or isinstance(f, bool) for f in flags):
        raise InvalidArgumentError(
            "layout_from_hf_config: minimax_text_01 config key 'attn_type_list' must hold one "
            f"0 (linear) or 1 (softmax) per layer ({num_layers}), got {flags!r}"
        )
    types_ = ["full_attention" if f == 1 else "linear_attention" for f in flags]
    yield from _minimax_layers(cfg, b, types_)


def _falcon_h1(cfg: _Config, b: _Builder) -> _Layers:
    """transformers FalconH1Config: every layer runs a Mamba2 mixer (``mamba``) and
    attention (``self_attn``) side by side. Mamba inner size ``mamba_d_ssm`` (null:
    ``mamba_expand * hidden_size``); ``mamba_d_head`` ``"auto"`` is inner //
    ``mamba_n_heads``; attention ``head_dim`` defaults to hidden_size // heads."""
    d = _Decoder(cfg)
    cfg.raw("mamba_d_ssm")  # required: its default changed across transformers versions
    inner = cfg.opt_int("mamba_d_ssm")
    if inner is None:
        inner = cfg.int_("mamba_expand") * cfg.int_("hidden_size")
    dims = _mamba2_dims(
        cfg,
        num_heads="mamba_n_heads",
        head_dim="mamba_d_head",
        n_groups="mamba_n_groups",
        d_state="mamba_d_state",
        d_conv="mamba_d_conv",
        chunk_size="mamba_chunk_size",
        intermediate=inner,
    )
    for i in range(d.num_layers):
        yield f"model.layers.{i}.mamba", b.state(dims)
        yield (
            _self_attn("model.layers", i),
            b.attention(num_heads=d.num_heads, num_kv_heads=d.num_kv_heads, head_size=d.head_dim),
        )


# ---- encoders and encoder-decoders -----------------------------------------------------


def _bert(cfg: _Config, b: _Builder) -> _Layers:
    """transformers BertConfig: ``num_hidden_layers`` bidirectional self-attention layers
    of ``hidden_size // num_attention_heads`` (multi-head: as many KV heads as heads),
    named as in BertForMaskedLM and the other heads (``bert.encoder.layer.{i}.attention.self``)."""
    num_layers = cfg.int_("num_hidden_layers")
    num_heads = cfg.int_("num_attention_heads")
    head_dim = _head_dim(cfg, num_heads)
    for i in range(num_layers):
        yield (
            f"bert.encoder.layer.{i}.attention.self",
            b.attention(
                num_heads=num_heads,
                num_kv_heads=num_heads,
                head_size=head_dim,
                attn_type=AttentionType.ENCODER_ONLY,
            ),
        )


def _t5(cfg: _Config, b: _Builder) -> _Layers:
    """transformers T5Config: ``num_layers`` encoder blocks and ``num_decoder_layers``
    (defaults to ``num_layers``) decoder blocks, ``num_heads`` heads of ``d_kv``. T5
    attention does not scale its scores (the scaling is folded into the weights), so the
    softmax scale is 1.0."""
    enc_layers = cfg.int_("num_layers")
    dec_layers = cfg.int_("num_decoder_layers", default=enc_layers)
    heads = cfg.int_("num_heads")
    d_kv = cfg.int_("d_kv")

    def layer(attn_type: AttentionType) -> LayerInfo:
        return b.attention(
            num_heads=heads, num_kv_heads=heads, head_size=d_kv, attn_type=attn_type, scale=1.0
        )

    for i in range(enc_layers):
        yield f"encoder.block.{i}.layer.0.SelfAttention", layer(AttentionType.ENCODER)
    for i in range(dec_layers):
        yield f"decoder.block.{i}.layer.0.SelfAttention", layer(AttentionType.DECODER)
        yield f"decoder.block.{i}.layer.1.EncDecAttention", layer(AttentionType.ENCODER_DECODER)


def _bart(cfg: _Config, b: _Builder) -> _Layers:
    """transformers BartConfig: ``encoder_layers`` encoder layers of
    ``encoder_attention_heads`` heads and ``decoder_layers`` decoder layers of
    ``decoder_attention_heads`` heads, each of ``d_model // heads``; names as in
    BartForConditionalGeneration (``model.encoder.layers.{i}.self_attn``,
    ``model.decoder.layers.{i}.self_attn`` and ``.encoder_attn``)."""
    d_model = cfg.int_("d_model")

    def heads_and_dim(key: str) -> tuple[int, int]:
        heads = cfg.int_(key)
        if d_model % heads:
            raise InvalidArgumentError(
                f"layout_from_hf_config: bart config: d_model={d_model} is not a multiple of "
                f"{key}={heads}"
            )
        return heads, d_model // heads

    enc_layers = cfg.int_("encoder_layers")
    dec_layers = cfg.int_("decoder_layers")
    enc_heads, enc_dim = heads_and_dim("encoder_attention_heads")
    dec_heads, dec_dim = heads_and_dim("decoder_attention_heads")
    for i in range(enc_layers):
        yield (
            f"model.encoder.layers.{i}.self_attn",
            b.attention(
                num_heads=enc_heads,
                num_kv_heads=enc_heads,
                head_size=enc_dim,
                attn_type=AttentionType.ENCODER,
            ),
        )
    for i in range(dec_layers):
        yield (
            f"model.decoder.layers.{i}.self_attn",
            b.attention(num_heads=dec_heads, num_kv_heads=dec_heads, head_size=dec_dim),
        )
        # Cross-attention: decoder queries (decoder heads) over the encoder's keys/values.
        yield (
            f"model.decoder.layers.{i}.encoder_attn",
            b.attention(
                num_heads=dec_heads,
                num_kv_heads=dec_heads,
                head_size=dec_dim,
                attn_type=AttentionType.ENCODER_DECODER,
            ),
        )


# --------------------------------------------------------------------------- entry point


_Family = Callable[[_Config, _Builder], _Layers]

_FAMILIES: Mapping[str, _Family] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": lambda c, b: _qwen(c, b, None),
    # Qwen3Config documents head_dim defaulting to 128.
    "qwen3": lambda c, b: _qwen(c, b, 128),
    "gemma2": lambda c, b: _gemma(c, b, "model.layers", gemma3=False),
    "gemma3_text": lambda c, b: _gemma(c, b, "model.layers", gemma3=True),
    # Gemma3Config: the text model's keys are under text_config; module names as in
    # Gemma3ForConditionalGeneration.
    "gemma3": lambda c, b: _gemma(
        c.sub("text_config"), b, "model.language_model.layers", gemma3=True
    ),
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "qwen3_next": _qwen3_next,
    "jamba": _jamba,
    "bamba": _bamba,
    "nemotron_h": _nemotron_h,
    "lfm2": _lfm2,
    "minimax": _minimax,
    "minimax_text_01": _minimax_text_01,
    "falcon_h1": _falcon_h1,
    "bert": _bert,
    "t5": _t5,
    "bart": _bart,
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_FAMILIES))
"""The ``model_type`` values ``layout_from_hf_config`` reads."""

_NESTED_TEXT: frozenset[str] = frozenset({"gemma3", "llama4"})


def _load(config_or_path: object) -> Mapping[str, object]:
    if isinstance(config_or_path, Mapping):
        data = cast("Mapping[object, object]", config_or_path)
        bad = [k for k in data if not isinstance(k, str)]
        if bad:
            raise ArgumentTypeError(
                f"layout_from_hf_config: config_or_path keys must be strings, got {bad[0]!r}"
            )
        return cast("Mapping[str, object]", data)
    if not isinstance(config_or_path, str | os.PathLike):
        raise ArgumentTypeError(
            "layout_from_hf_config: config_or_path must be a mapping (a parsed config.json), "
            f"a str or an os.PathLike, got {type(config_or_path).__name__}"
        )
    shown = os.fspath(cast("str | os.PathLike[str]", config_or_path))
    path = Path(shown)
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgumentError(
            f"layout_from_hf_config: config_or_path={shown!r}: cannot read "
            f"{str(path)!r} ({exc.strerror or exc})"
        ) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(
            f"layout_from_hf_config: config_or_path={shown!r}: {str(path)!r} is "
            f"not valid JSON ({exc})"
        ) from exc
    if not isinstance(data, dict):
        raise InvalidArgumentError(
            f"layout_from_hf_config: config_or_path={shown!r}: {str(path)!r} "
            f"must hold a JSON object, got {type(data).__name__}"
        )
    return cast("dict[str, object]", data)


def layout_from_hf_config(
    config_or_path: Mapping[str, object] | str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    block_size: int = 16,
    kv_cache_dtype: KVCacheDType = "auto",
    state_dtype: torch.dtype = torch.float32,
) -> ModelLayout:
    """Read a Hugging Face ``config.json`` into attnkit layer specs.

    Args:
        config_or_path: the parsed config, or a path to ``config.json`` or to the
            directory holding it.
        dtype: the model dtype. ``None`` (default): the config's ``torch_dtype`` (or
            ``dtype``; for ``gemma3`` and ``llama4`` the text config's first, then the
            top level's), else ``torch.float32``, what transformers loads a model in when
            no dtype is asked for.
        block_size: tokens per cache block of every layer.
        kv_cache_dtype: the attention layers' cache storage dtype.
        state_dtype: the dtype of the recurrent state of state layers (the SSM state of
            Mamba1/Mamba2, the delta-rule and linear-attention states), which
            accumulates over the whole sequence: float32 by default, what every built-in
            state backend keeps. Conv states (and short-conv layers) take the model
            dtype.

    Returns:
        A ``ModelLayout``: one entry per cached sub-layer, in model order, named after
        the model's modules. Layers without a cache (Nemotron-H MLP and MoE blocks)
        have none.

    Raises:
        InvalidArgumentError: an unknown ``model_type`` (the message lists the supported
            ones), a key the family needs that the config lacks (naming key and family),
            an unreadable file, a value out of range.
        ArgumentTypeError: a value of the wrong JSON type (naming the key).
    """
    check_positive_int("layout_from_hf_config", "block_size", block_size)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidArgumentError(
            f"layout_from_hf_config: kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
            f"{kv_cache_dtype!r}"
        )
    given_dtype: object = dtype
    if given_dtype is not None and (
        not isinstance(given_dtype, torch.dtype) or given_dtype not in MODEL_DTYPES
    ):
        supported = ", ".join(sorted(dtype_name(d) for d in MODEL_DTYPES))
        raise InvalidArgumentError(
            f"layout_from_hf_config: dtype must be None or a torch.dtype among ({supported}), "
            f"got {dtype!r}"
        )
    data = _load(config_or_path)
    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        raise InvalidArgumentError(
            "layout_from_hf_config: the config needs a string 'model_type' (one of "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}), got {model_type!r}"
        )
    family = _FAMILIES.get(model_type)
    if family is None:
        raise InvalidArgumentError(
            f"layout_from_hf_config: unsupported model_type {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    cfg = _Config(data, model_type)
    if dtype is None:
        found = cfg.sub("text_config").dtype() if model_type in _NESTED_TEXT else None
        if found is None:
            found = cfg.dtype()
        dtype = found if found is not None else torch.float32
    given_state: object = state_dtype
    if not isinstance(given_state, torch.dtype) or given_state not in MODEL_DTYPES:
        supported = ", ".join(sorted(dtype_name(d) for d in MODEL_DTYPES))
        raise InvalidArgumentError(
            f"layout_from_hf_config: state_dtype must be a torch.dtype among ({supported}), "
            f"got {state_dtype!r}"
        )
    builder = _Builder(dtype, block_size, kv_cache_dtype, state_dtype)
    layers: dict[str, LayerInfo] = {}
    for name, info in family(cfg, builder):
        layers[name] = info
    return ModelLayout(model_type=model_type, dtype=dtype, layers=types.MappingProxyType(layers))
