"""The reference backend's state layers other than Mamba2: Gated DeltaNet, linear
attention with decay, and LFM2-style short convolution, plus the impl that picks the
right one by ``MambaSpec.mamba_type``.

Like the Mamba2 path, every request of a step (decode or prefill) goes through the
varlen torch kernels, starting from its cached state when it has context before the
step. Each impl takes its type's input class (``attnkit.state_inputs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import override

from ...impl import StateImpl
from ...kernels.conv1d.reference import causal_conv1d_varlen
from ...kernels.gated_delta.reference import chunk_gated_delta_rule_varlen, l2_normalize
from ...kernels.linear_attention.reference import chunk_linear_attention_varlen
from ...kernels.short_conv.reference import short_conv_varlen
from ...params import (
    GatedDeltaNetLayerParams,
    LinearAttentionLayerParams,
    Mamba1LayerParams,
    ShortConvLayerParams,
    StateLayerParams,
    check_state_shapes,
)
from ...spec import MambaSpec
from ...state_inputs import (
    GatedDeltaNetInputs,
    LinearAttentionInputs,
    ShortConvInputs,
    StateInputs,
)
from ._checks import check_tensor
from .mamba1 import ReferenceMamba1Impl
from .mamba2 import ReferenceMamba2Impl, ReferenceStateMetadata

__all__ = [
    "ReferenceGatedDeltaNetImpl",
    "ReferenceLinearAttentionImpl",
    "ReferenceShortConvImpl",
    "ReferenceStateImpl",
]


def _check_spec(owner: str, spec: MambaSpec, params: StateLayerParams, mamba_type: str) -> None:
    if spec.mamba_type != mamba_type:
        raise ValueError(
            f"{owner}: kv_cache_spec.mamba_type must be {mamba_type!r}, got {spec.mamba_type!r}"
        )
    check_state_shapes(owner, spec, params)


def _states(owner: str, kv_cache: Sequence[torch.Tensor], spec: MambaSpec) -> list[torch.Tensor]:
    if len(kv_cache) != len(spec.shapes):
        raise ValueError(
            f"{owner}: kv_cache must hold {len(spec.shapes)} state tensors, got {len(kv_cache)}"
        )
    return [
        check_tensor(
            owner, f"kv_cache[{i}]", t, layout="[NB, *state]", shape=(None, *shape), dtype=dtype
        )
        for i, (t, shape, dtype) in enumerate(zip(kv_cache, spec.shapes, spec.dtypes, strict=True))
    ]


class ReferenceGatedDeltaNetImpl(
    StateImpl[ReferenceStateMetadata, GatedDeltaNetLayerParams, GatedDeltaNetInputs]
):
    """Short conv (SiLU) over q/k/v, L2-normalised q and k, then the gated delta rule.

    ``forward(GatedDeltaNetInputs(qkv [T, C], g [T, H], beta [T, H])) -> o [T, H, V]``,
    ``C = 2*Hk*K + H*V`` (q, k with the ``Hk`` key heads, v with the ``H`` value heads).
    """

    def __init__(self, kv_cache_spec: MambaSpec, layer_params: GatedDeltaNetLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        _check_spec(type(self).__name__, kv_cache_spec, layer_params, "gdn")
        if kv_cache_spec.dtypes[1] != torch.float32:
            raise ValueError(
                f"{type(self).__name__}: the delta-rule state (dtypes[1]) must be float32"
            )

    @override
    def forward(
        self,
        inputs: GatedDeltaNetInputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceStateMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        owner, p, md = f"{type(self).__name__}.forward", self.layer_params, attn_metadata
        conv_states, states = _states(owner, kv_cache, self.kv_cache_spec)
        n = md.num_actual_tokens
        qkv = check_tensor(owner, "inputs.qkv", inputs.qkv, layout="[T, C]", shape=(None, p.conv_dim))
        rows = (qkv.shape[0], p.num_heads)
        g = check_tensor(owner, "inputs.g", inputs.g, layout="[T, H]", shape=rows)
        beta = check_tensor(owner, "inputs.beta", inputs.beta, layout="[T, H]", shape=rows)
        mixed = causal_conv1d_varlen(
            qkv[:n].to(conv_states.dtype),
            p.conv_weight,
            p.conv_bias,
            conv_states=conv_states,
            query_start_loc=md.query_start_loc,
            state_indices=md.state_indices,
            has_initial_state=md.has_initial_state,
            activation="silu",
        )
        # q | k | v: Hk*K, Hk*K and H*V channels; q/k normalised per key head (the
        # kernel shares each key head among H // Hk value heads).
        qk_width = p.key_heads * p.key_dim
        q = l2_normalize(mixed[:, :qk_width].reshape(n, p.key_heads, p.key_dim))
        k = l2_normalize(mixed[:, qk_width : 2 * qk_width].reshape(n, p.key_heads, p.key_dim))
        v = mixed[:, 2 * qk_width :].reshape(n, p.num_heads, p.value_dim)
        scale = p.scale if p.scale is not None else p.key_dim**-0.5
        output[:n] = chunk_gated_delta_rule_varlen(
            q,
            k,
            v,
            g[:n].float(),
            beta[:n].float(),
            scale=scale,
            query_start_loc=md.query_start_loc,
            states=states,
            state_indices=md.state_indices,
            has_initial_state=md.has_initial_state,
            chunk_size=p.chunk_size,
        ).to(output.dtype)
        output[n:] = 0
        return output


class ReferenceLinearAttentionImpl(
    StateImpl[ReferenceStateMetadata, LinearAttentionLayerParams, LinearAttentionInputs]
):
    """Linear attention with per-head decay. ``forward(LinearAttentionInputs(q, k, v)) -> o [T, H, V]``."""

    def __init__(self, kv_cache_spec: MambaSpec, layer_params: LinearAttentionLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        _check_spec(type(self).__name__, kv_cache_spec, layer_params, "linear")
        if kv_cache_spec.dtypes[0] != torch.float32:
            raise ValueError(f"{type(self).__name__}: the linear-attention state must be float32")

    @override
    def forward(
        self,
        inputs: LinearAttentionInputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceStateMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        owner, p, md = f"{type(self).__name__}.forward", self.layer_params, attn_metadata
        (states,) = _states(owner, kv_cache, self.kv_cache_spec)
        n = md.num_actual_tokens
        q = check_tensor(
            owner, "inputs.q", inputs.q, layout="[T, H, K]", shape=(None, p.num_heads, p.key_dim)
        )
        k = check_tensor(owner, "inputs.k", inputs.k, layout="[T, H, K]", shape=q.shape)
        v = check_tensor(
            owner,
            "inputs.v",
            inputs.v,
            layout="[T, H, V]",
            shape=(q.shape[0], p.num_heads, p.value_dim),
        )
        scale = p.scale if p.scale is not None else p.key_dim**-0.5
        output[:n] = chunk_linear_attention_varlen(
            q[:n],
            k[:n],
            v[:n],
            p.decay,
            scale=scale,
            query_start_loc=md.query_start_loc,
            states=states,
            state_indices=md.state_indices,
            has_initial_state=md.has_initial_state,
            chunk_size=p.chunk_size,
        ).to(output.dtype)
        output[n:] = 0
        return output


class ReferenceShortConvImpl(
    StateImpl[ReferenceStateMetadata, ShortConvLayerParams, ShortConvInputs]
):
    """LFM2 short conv: ``y = c * conv(b * x)``. ``forward(ShortConvInputs(b, c, x)) -> y [T, C]``."""

    def __init__(self, kv_cache_spec: MambaSpec, layer_params: ShortConvLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        _check_spec(type(self).__name__, kv_cache_spec, layer_params, "short_conv")

    @override
    def forward(
        self,
        inputs: ShortConvInputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceStateMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        owner, p, md = f"{type(self).__name__}.forward", self.layer_params, attn_metadata
        (conv_states,) = _states(owner, kv_cache, self.kv_cache_spec)
        n = md.num_actual_tokens
        b = check_tensor(
            owner,
            "inputs.b",
            inputs.b,
            layout="[T, C]",
            shape=(None, p.channels),
            dtype=conv_states.dtype,
        )
        c = check_tensor(owner, "inputs.c", inputs.c, layout="[T, C]", shape=b.shape, dtype=b.dtype)
        x = check_tensor(owner, "inputs.x", inputs.x, layout="[T, C]", shape=b.shape, dtype=b.dtype)
        output[:n] = short_conv_varlen(
            b[:n],
            c[:n],
            x[:n],
            p.conv_weight,
            p.conv_bias,
            conv_states=conv_states,
            query_start_loc=md.query_start_loc,
            state_indices=md.state_indices,
            has_initial_state=md.has_initial_state,
        ).to(output.dtype)
        output[n:] = 0
        return output


class ReferenceStateImpl(StateImpl[ReferenceStateMetadata, StateLayerParams, StateInputs]):
    """The reference impl of any state layer: the one its parameters' class names.

    Takes ``StateInputs``; the input class must be the one of the layer's type
    (``layer_params.inputs_type``), else ``TypeError``.
    """

    def __init__(self, kv_cache_spec: MambaSpec, layer_params: StateLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        if isinstance(layer_params, GatedDeltaNetLayerParams):
            self._core: StateImpl[ReferenceStateMetadata, StateLayerParams, Any] = (
                ReferenceGatedDeltaNetImpl(kv_cache_spec, layer_params)
            )
        elif isinstance(layer_params, LinearAttentionLayerParams):
            self._core = ReferenceLinearAttentionImpl(kv_cache_spec, layer_params)
        elif isinstance(layer_params, ShortConvLayerParams):
            self._core = ReferenceShortConvImpl(kv_cache_spec, layer_params)
        elif isinstance(layer_params, Mamba1LayerParams):
            self._core = ReferenceMamba1Impl(kv_cache_spec, layer_params)
        else:
            self._core = ReferenceMamba2Impl(kv_cache_spec, layer_params)

    @override
    def forward(
        self,
        inputs: StateInputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceStateMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        expected = self.layer_params.inputs_type
        if not isinstance(inputs, expected):
            raise TypeError(
                f"ReferenceStateImpl: a {self.kv_cache_spec.mamba_type} layer takes "
                f"{expected.__name__}, got {type(inputs).__name__}"
            )
        return self._core.forward(inputs, kv_cache, attn_metadata, output)
