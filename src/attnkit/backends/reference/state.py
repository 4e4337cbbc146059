"""The reference backend's state layers other than Mamba2: Gated DeltaNet, linear
attention with decay, and LFM2-style short convolution, plus the impl that picks the
right one by ``MambaSpec.mamba_type``.

Like the Mamba2 path, every request of a step (decode or prefill) goes through the
varlen torch kernels, starting from its cached state when it has context before the
step. Layer inputs follow ``AttentionImpl.forward``'s convention for each type (see
the parameter classes in ``attnkit.backend``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from typing_extensions import override

from ...backend import (
    STATE_PARAMS_BY_TYPE,
    AttentionImpl,
    GatedDeltaNetLayerParams,
    LayerParams,
    LinearAttentionLayerParams,
    ShortConvLayerParams,
    StateLayerParams,
)
from ...kernels.torch.conv1d import causal_conv1d_varlen
from ...kernels.torch.gated_delta import chunk_gated_delta_rule_varlen, l2_normalize
from ...kernels.torch.linear_attention import chunk_linear_attention_varlen
from ...kernels.torch.short_conv import short_conv_varlen
from ...spec import KVCacheSpec, MambaSpec
from ._checks import check_tensor
from .mamba2 import ReferenceMamba2Impl, ReferenceMamba2Metadata

__all__ = [
    "ReferenceGatedDeltaNetImpl",
    "ReferenceLinearAttentionImpl",
    "ReferenceShortConvImpl",
    "ReferenceStateImpl",
]


def _spec_and_params(
    owner: str, spec: KVCacheSpec, params: LayerParams | None, mamba_type: str
) -> MambaSpec:
    if not isinstance(spec, MambaSpec) or spec.mamba_type != mamba_type:
        raise TypeError(
            f"{owner}: kv_cache_spec must be a MambaSpec of mamba_type {mamba_type!r}, got {spec!r}"
        )
    expected = STATE_PARAMS_BY_TYPE[mamba_type]
    if not isinstance(params, expected):
        raise TypeError(
            f"{owner}: layer_params must be {expected.__name__}, got {type(params).__name__}"
        )
    assert isinstance(params, StateLayerParams)  # every STATE_PARAMS_BY_TYPE value is one
    if spec.shapes != params.state_shapes:
        raise ValueError(
            f"{owner}: kv_cache_spec.shapes must be layer_params.state_shapes={params.state_shapes}, "
            f"got {spec.shapes}"
        )
    return spec


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


class ReferenceGatedDeltaNetImpl(AttentionImpl[ReferenceMamba2Metadata]):
    """Short conv (SiLU) over q/k/v, L2-normalised q and k, then the gated delta rule.

    ``forward(query=qkv [T, C], key=g [T, H], value=beta [T, H]) -> o [T, H, V]``.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, layer_params: LayerParams | None) -> None:
        super().__init__(kv_cache_spec, layer_params)
        self.spec = _spec_and_params(type(self).__name__, kv_cache_spec, layer_params, "gdn")
        assert isinstance(layer_params, GatedDeltaNetLayerParams)  # checked above
        self.params = layer_params
        if self.spec.dtypes[1] != torch.float32:
            raise ValueError(
                f"{type(self).__name__}: the delta-rule state (dtypes[1]) must be float32"
            )

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceMamba2Metadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        owner, p, md = f"{type(self).__name__}.forward", self.params, attn_metadata
        conv_states, states = _states(owner, kv_cache, self.spec)
        n = md.num_actual_tokens
        qkv = check_tensor(owner, "query (qkv)", query, layout="[T, C]", shape=(None, p.conv_dim))
        g = check_tensor(owner, "key (g)", key, layout="[T, H]", shape=(qkv.shape[0], p.num_heads))
        beta = check_tensor(
            owner, "value (beta)", value, layout="[T, H]", shape=(qkv.shape[0], p.num_heads)
        )
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
        hk, h = p.num_heads * p.key_dim, p.num_heads
        q = l2_normalize(mixed[:, :hk].reshape(n, h, p.key_dim))
        k = l2_normalize(mixed[:, hk : 2 * hk].reshape(n, h, p.key_dim))
        v = mixed[:, 2 * hk :].reshape(n, h, p.value_dim)
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


class ReferenceLinearAttentionImpl(AttentionImpl[ReferenceMamba2Metadata]):
    """Linear attention with per-head decay. ``forward(q, k, v) -> o [T, H, V]``."""

    def __init__(self, kv_cache_spec: KVCacheSpec, layer_params: LayerParams | None) -> None:
        super().__init__(kv_cache_spec, layer_params)
        self.spec = _spec_and_params(type(self).__name__, kv_cache_spec, layer_params, "linear")
        assert isinstance(layer_params, LinearAttentionLayerParams)  # checked above
        self.params = layer_params
        if self.spec.dtypes[0] != torch.float32:
            raise ValueError(f"{type(self).__name__}: the linear-attention state must be float32")

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceMamba2Metadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        owner, p, md = f"{type(self).__name__}.forward", self.params, attn_metadata
        (states,) = _states(owner, kv_cache, self.spec)
        n = md.num_actual_tokens
        q = check_tensor(
            owner, "query (q)", query, layout="[T, H, K]", shape=(None, p.num_heads, p.key_dim)
        )
        k = check_tensor(owner, "key (k)", key, layout="[T, H, K]", shape=q.shape)
        v = check_tensor(
            owner,
            "value (v)",
            value,
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


class ReferenceShortConvImpl(AttentionImpl[ReferenceMamba2Metadata]):
    """LFM2 short conv: ``y = c * conv(b * x)``. ``forward(b, c, x) -> y [T, C]``."""

    def __init__(self, kv_cache_spec: KVCacheSpec, layer_params: LayerParams | None) -> None:
        super().__init__(kv_cache_spec, layer_params)
        self.spec = _spec_and_params(type(self).__name__, kv_cache_spec, layer_params, "short_conv")
        assert isinstance(layer_params, ShortConvLayerParams)  # checked above
        self.params = layer_params

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceMamba2Metadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        owner, p, md = f"{type(self).__name__}.forward", self.params, attn_metadata
        (conv_states,) = _states(owner, kv_cache, self.spec)
        n = md.num_actual_tokens
        b = check_tensor(
            owner,
            "query (b)",
            query,
            layout="[T, C]",
            shape=(None, p.channels),
            dtype=conv_states.dtype,
        )
        c = check_tensor(owner, "key (c)", key, layout="[T, C]", shape=b.shape, dtype=b.dtype)
        x = check_tensor(owner, "value (x)", value, layout="[T, C]", shape=b.shape, dtype=b.dtype)
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


_IMPL_BY_TYPE: dict[str, type[AttentionImpl[ReferenceMamba2Metadata]]] = {
    "mamba2": ReferenceMamba2Impl,
    "gdn": ReferenceGatedDeltaNetImpl,
    "linear": ReferenceLinearAttentionImpl,
    "short_conv": ReferenceShortConvImpl,
}


class ReferenceStateImpl(AttentionImpl[ReferenceMamba2Metadata]):
    """The reference impl of any ``MambaSpec`` layer: the one its ``mamba_type`` names."""

    def __init__(self, kv_cache_spec: KVCacheSpec, layer_params: LayerParams | None) -> None:
        super().__init__(kv_cache_spec, layer_params)
        if not isinstance(kv_cache_spec, MambaSpec):
            raise TypeError(
                f"ReferenceStateImpl: kv_cache_spec must be a MambaSpec, got {type(kv_cache_spec).__name__}"
            )
        impl_cls = _IMPL_BY_TYPE.get(kv_cache_spec.mamba_type)
        if impl_cls is None:
            raise ValueError(
                f"ReferenceStateImpl: mamba_type={kv_cache_spec.mamba_type!r} is not supported "
                f"(supported: {', '.join(sorted(_IMPL_BY_TYPE))})"
            )
        self.core = impl_cls(kv_cache_spec, layer_params)

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceMamba2Metadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return self.core.forward(query, key, value, kv_cache, attn_metadata, output)
