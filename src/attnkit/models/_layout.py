"""The public layout types: ``ModelLayout``, one ``LayerInfo`` per cached sub-layer, and
the sizes of each state layer type (``Mamba2Dims``, ...), with the layer parameters they
build."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar, Literal

import torch

from .._validation import is_nonnegative_int, is_positive_int
from ..errors import InvalidArgumentError
from ..kinds import rules_for
from ..params import (
    AttentionLayerParams,
    GatedDeltaNetLayerParams,
    LinearAttentionLayerParams,
    Mamba1LayerParams,
    Mamba2LayerParams,
    ShortConvLayerParams,
    StateLayerParams,
)
from ..spec import AttentionSpec, AttentionType, KVCacheSpec, MambaSpec


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
        index_topk: an MLA layer of DeepSeek sparse attention: the positions per query
            its indexer keeps (``AttentionLayerParams.index_topk``), else ``None``.
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
    index_topk: int | None = None

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
            index_topk=self.index_topk,
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
