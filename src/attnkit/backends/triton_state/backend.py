"""Triton backends for Mamba (1), Mamba2, Gated DeltaNet, linear attention and short
conv layers.

One builder serves all five: its metadata carries each request's state block
(``state_indices``, column 0 of the block table), whether it continues from a cached
state (``has_initial_state``), and the decode/prefill split of a decodes-first batch
(``reorder_batch_threshold = 1``), with the prefill part's offsets rebased to 0 so the
varlen kernels take it as is. Decodes run the single-step ``*_update`` kernels, prefills
the chunked varlen kernels; both read and write the states in the cache in place.

CUDA graphs: UNIFORM_SINGLE_TOKEN_DECODE. ``build_for_cudagraph_capture`` accepts
pure-decode batches and copies their state indices into a fixed-address buffer; the
update kernels take no other per-step value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from typing_extensions import override

from ...backend import AttentionBackend, BackendRequest
from ...binding import bind_builder
from ...builder import AttentionCGSupport, AttentionMetadataBuilder
from ...config import AttentionConfig
from ...impl import StateImpl
from ...kernels.gated_delta.reference import l2_normalize
from ...kernels.mamba1.reference import mamba1_projections
from ...metadata import CommonAttentionMetadata
from ...params import (
    GatedDeltaNetLayerParams,
    LinearAttentionLayerParams,
    Mamba1LayerParams,
    Mamba2LayerParams,
    ShortConvLayerParams,
)
from ...spec import MambaSpec, MambaType
from ...state_inputs import (
    GatedDeltaNetInputs,
    LinearAttentionInputs,
    Mamba1Inputs,
    Mamba2Inputs,
    ShortConvInputs,
)
from ...state_types import check_state_layer, state_spec_reasons
from .._triton_env import triton_cpu_reasons

__all__ = [
    "TritonGatedDeltaNetBackend",
    "TritonGatedDeltaNetImpl",
    "TritonLinearAttentionBackend",
    "TritonLinearAttentionImpl",
    "TritonMamba1Backend",
    "TritonMamba1Impl",
    "TritonMamba2Backend",
    "TritonMamba2Impl",
    "TritonShortConvBackend",
    "TritonShortConvImpl",
    "TritonStateMetadata",
    "TritonStateMetadataBuilder",
]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TritonStateMetadata:
    """One state group's step, split into decodes (first) and prefills.

    Attributes:
        num_actual_tokens: ``T``.
        num_decodes, num_decode_tokens: the decode part (one token each).
        num_prefills: requests after the decodes.
        state_indices: int32 ``[B]`` each request's state block.
        has_initial_state: bool ``[B]``.
        prefill_query_start_loc: int32 ``[P+1]`` offsets of the prefill part, from 0.
        chunk_offsets: chunk bookkeeping of the prefill part per chunk size (cumulative
            chunk counts, int32 ``[P+1]``), planned by the first layer of the step that
            needs it and reused by every other layer.
    """

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    chunk_offsets: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict[int, torch.Tensor])


class TritonStateMetadataBuilder(AttentionMetadataBuilder[TritonStateMetadata, MambaSpec]):
    """Narrowed to ``MambaSpec`` by its type parameter; reads only CPU copies (no sync)."""

    reorder_batch_threshold: ClassVar[int | None] = 1
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(
        self,
        kv_cache_spec: MambaSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        self._graph_indices: torch.Tensor | None = None
        self._graph_has_initial = torch.zeros(0, dtype=torch.bool)
        self._graph_prefill_qsl = torch.zeros(0, dtype=torch.int32)

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TritonStateMetadata:
        cm = common_attn_metadata
        # Decodes: the leading requests that add one token to a cached state. A new
        # request of one token has no state to update, so it (and everything after the
        # leading run) goes through the varlen kernels, which handle any request.
        query_lens_cpu = cm.query_lens_cpu
        is_decode = (query_lens_cpu == 1) & (cm.seq_lens_cpu > 1)
        num_decodes = int(torch.cumprod(is_decode.to(torch.int32), 0).sum()) if cm.num_reqs else 0
        num_decode_tokens = num_decodes
        table = cm.block_table_tensor
        if table.shape[1] < 1 and cm.num_reqs:
            raise ValueError(
                f"{type(self).__name__}: block_table_tensor needs a column 0 with each "
                f"request's state block, got shape {list(table.shape)}"
            )
        qsl = cm.query_start_loc
        has_initial = (cm.seq_lens - (qsl[1:] - qsl[:-1])) > 0
        return TritonStateMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=cm.num_reqs - num_decodes,
            state_indices=table[:, 0] if cm.num_reqs else table.new_zeros(0),
            has_initial_state=has_initial,
            prefill_query_start_loc=qsl[num_decodes:] - num_decode_tokens,
        )

    @override
    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> TritonStateMetadata:
        """Pure-decode batches only; their state indices go to a fixed-address buffer."""
        cm = common_attn_metadata
        if cm.max_query_len > 1 or bool((cm.seq_lens_cpu <= 1).any()):
            raise RuntimeError(
                f"{type(self).__name__}: only batches where every request decodes one token "
                f"onto a cached state can be captured, got max_query_len={cm.max_query_len}"
            )
        if cm.num_reqs > self.config.max_num_reqs:
            raise RuntimeError(
                f"{type(self).__name__}: {cm.num_reqs} requests exceed the CUDA-graph buffer "
                f"({self.config.max_num_reqs}); raise AttentionConfig.max_num_reqs"
            )
        if self._graph_indices is None:
            n = self.config.max_num_reqs
            self._graph_indices = torch.zeros(n, dtype=torch.int32, device=self.device)
            # A pure-decode batch: every request has a state, and the prefill part is
            # empty (its offsets are [0]). Fixed addresses, written once.
            self._graph_has_initial = torch.ones(n, dtype=torch.bool, device=self.device)
            self._graph_prefill_qsl = torch.zeros(1, dtype=torch.int32, device=self.device)
        meta = self.build(0, cm)
        indices = self._graph_indices[: cm.num_reqs]
        indices.copy_(meta.state_indices, non_blocking=True)
        return dataclasses.replace(
            meta,
            state_indices=indices,
            has_initial_state=self._graph_has_initial[: cm.num_reqs],
            prefill_query_start_loc=self._graph_prefill_qsl,
        )


class _ConvMixin:
    """The SiLU causal conv shared by Mamba (1), Mamba2 and Gated DeltaNet layers."""

    def _load_conv(self) -> None:
        # Imported here: importing the backend must not import triton.
        from ...kernels.conv1d.triton import causal_conv1d_update, causal_conv1d_varlen

        self._conv_update = causal_conv1d_update
        self._conv_varlen = causal_conv1d_varlen

    def _conv(
        self,
        x: torch.Tensor,
        p: Mamba1LayerParams | Mamba2LayerParams | GatedDeltaNetLayerParams,
        conv_states: torch.Tensor,
        md: TritonStateMetadata,
    ) -> torch.Tensor:
        """SiLU causal conv over the step: decodes with the update kernel, prefills varlen."""
        nd, n = md.num_decode_tokens, md.num_actual_tokens
        out = torch.empty((n, x.shape[1]), dtype=conv_states.dtype, device=x.device)
        x = x[:n].to(conv_states.dtype)
        if md.num_decodes:
            self._conv_update(
                x[:nd],
                p.conv_weight,
                p.conv_bias,
                conv_states=conv_states,
                state_indices=md.state_indices[: md.num_decodes],
                activation="silu",
                out=out[:nd],
            )
        if md.num_prefills:
            self._conv_varlen(
                x[nd:],
                p.conv_weight,
                p.conv_bias,
                conv_states=conv_states,
                query_start_loc=md.prefill_query_start_loc,
                state_indices=md.state_indices[md.num_decodes :],
                has_initial_state=md.has_initial_state[md.num_decodes :],
                activation="silu",
                out=out[nd:],
            )
        return out


class TritonMamba1Impl(
    _ConvMixin, StateImpl[TritonStateMetadata, Mamba1LayerParams, Mamba1Inputs]
):
    """Mamba (1) (Gu & Dao 2023, arXiv:2312.00752): causal conv1d (SiLU), then
    ``x_proj``/``dt_proj`` on the convolved ``x`` (torch matmuls), then the selective
    scan (prefills) or its one-token update (decodes), states in the cache.

    ``forward(Mamba1Inputs(x [T, D])) -> y [T, D]``, before the model's ``z`` gate.
    """

    def __init__(self, kv_cache_spec: MambaSpec, layer_params: Mamba1LayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        check_state_layer(type(self).__name__, kv_cache_spec, layer_params)
        self._load_conv()
        from ...kernels.mamba1.triton import selective_scan_update, selective_scan_varlen

        self._scan_update = selective_scan_update
        self._scan = selective_scan_varlen

    @override
    def forward(
        self,
        inputs: Mamba1Inputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: TritonStateMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        md, p = attn_metadata, self.layer_params
        nd, n = md.num_decode_tokens, md.num_actual_tokens
        dec = slice(0, md.num_decodes)
        pre = slice(md.num_decodes, md.num_decodes + md.num_prefills)
        conv_states, ssm_states = kv_cache
        u = self._conv(inputs.x, p, conv_states, md)
        dt, b, c = mamba1_projections(
            u,
            p.x_proj_weight,
            p.dt_proj_weight,
            dt_norm_weight=p.dt_norm_weight,
            B_norm_weight=p.B_norm_weight,
            C_norm_weight=p.C_norm_weight,
            norm_eps=p.norm_eps,
        )
        if md.num_decodes:
            self._scan_update(
                u[:nd],
                dt[:nd],
                p.A,
                b[:nd],
                c[:nd],
                D=p.D,
                dt_bias=p.dt_bias,
                dt_softplus=p.dt_softplus,
                ssm_states=ssm_states,
                state_indices=md.state_indices[dec],
                out=output[:nd],
            )
        if md.num_prefills:
            self._scan(
                u[nd:],
                dt[nd:],
                p.A,
                b[nd:],
                c[nd:],
                D=p.D,
                dt_bias=p.dt_bias,
                dt_softplus=p.dt_softplus,
                ssm_states=ssm_states,
                out=output[nd:n],
                query_start_loc=md.prefill_query_start_loc,
                state_indices=md.state_indices[pre],
                has_initial_state=md.has_initial_state[pre],
            )
        return output


class TritonMamba2Impl(
    _ConvMixin, StateImpl[TritonStateMetadata, Mamba2LayerParams, Mamba2Inputs]
):
    """Mamba2: causal conv1d, then the chunked SSD (prefills) or selective state update."""

    def __init__(self, kv_cache_spec: MambaSpec, layer_params: Mamba2LayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        check_state_layer(type(self).__name__, kv_cache_spec, layer_params)
        self._load_conv()
        from ...kernels.mamba2.triton import (
            selective_state_update,
            ssd_chunk_offsets,
            ssd_chunked_varlen,
        )

        self._ssd_update = selective_state_update
        self._ssd_chunk_offsets = ssd_chunk_offsets
        self._ssd = ssd_chunked_varlen

    @override
    def forward(
        self,
        inputs: Mamba2Inputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: TritonStateMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        md, p = attn_metadata, self.layer_params
        nd, n = md.num_decode_tokens, md.num_actual_tokens
        dec = slice(0, md.num_decodes)
        pre = slice(md.num_decodes, md.num_decodes + md.num_prefills)
        dt = inputs.dt
        conv_states, ssm_states = kv_cache
        xbc = self._conv(inputs.xBC, p, conv_states, md)
        hp, gn = p.num_heads * p.head_dim, p.n_groups * p.d_state
        x = xbc[:, :hp].reshape(n, p.num_heads, p.head_dim)
        b = xbc[:, hp : hp + gn].reshape(n, p.n_groups, p.d_state)
        c = xbc[:, hp + gn :].reshape(n, p.n_groups, p.d_state)
        if md.num_decodes:
            self._ssd_update(
                x[:nd],
                dt[:nd],
                p.A,
                b[:nd],
                c[:nd],
                D=p.D,
                dt_bias=p.dt_bias,
                dt_softplus=p.dt_softplus,
                ssm_states=ssm_states,
                state_indices=md.state_indices[dec],
                out=output[:nd],
            )
        if md.num_prefills:
            cu_chunks = md.chunk_offsets.get(p.chunk_size)
            if cu_chunks is None:  # planned once per step, by the first layer
                cu_chunks = self._ssd_chunk_offsets(md.prefill_query_start_loc, n - nd, p.chunk_size)
                md.chunk_offsets[p.chunk_size] = cu_chunks
            self._ssd(
                x[nd:],
                dt[nd:n],
                p.A,
                b[nd:],
                c[nd:],
                D=p.D,
                dt_bias=p.dt_bias,
                dt_softplus=p.dt_softplus,
                ssm_states=ssm_states,
                chunk_size=p.chunk_size,
                out=output[nd:n],
                cu_chunks=cu_chunks,
                query_start_loc=md.prefill_query_start_loc,
                state_indices=md.state_indices[pre],
                has_initial_state=md.has_initial_state[pre],
            )
        return output


class TritonGatedDeltaNetImpl(
    _ConvMixin, StateImpl[TritonStateMetadata, GatedDeltaNetLayerParams, GatedDeltaNetInputs]
):
    """Gated DeltaNet: short conv (SiLU), L2-normalised q/k, chunked rule or fused step."""

    def __init__(self, kv_cache_spec: MambaSpec, layer_params: GatedDeltaNetLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        check_state_layer(type(self).__name__, kv_cache_spec, layer_params)
        who = type(self).__name__
        # What the Triton kernels accept beyond the parameter class's own checks.
        if layer_params.chunk_size not in (16, 32, 64):
            raise ValueError(
                f"{who}: gdn chunk_size must be 16, 32 or 64, got {layer_params.chunk_size}"
            )
        self._load_conv()
        from ...kernels.gated_delta.triton import (
            chunk_gated_delta_rule_varlen,
            fused_recurrent_gated_delta_rule_update,
        )

        self._chunk = chunk_gated_delta_rule_varlen
        self._update = fused_recurrent_gated_delta_rule_update

    @override
    def forward(
        self,
        inputs: GatedDeltaNetInputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: TritonStateMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        md, p = attn_metadata, self.layer_params
        nd, n = md.num_decode_tokens, md.num_actual_tokens
        dec = slice(0, md.num_decodes)
        pre = slice(md.num_decodes, md.num_decodes + md.num_prefills)
        conv_states, states = kv_cache
        mixed = self._conv(inputs.qkv, p, conv_states, md)
        # q | k | v: Hk*K, Hk*K and H*V channels; the kernels map each value head to
        # its key head by index (q and k stay at Hk heads).
        qk_width = p.key_heads * p.key_dim
        q = l2_normalize(mixed[:, :qk_width].reshape(n, p.key_heads, p.key_dim))
        k = l2_normalize(mixed[:, qk_width : 2 * qk_width].reshape(n, p.key_heads, p.key_dim))
        v = mixed[:, 2 * qk_width :].reshape(n, p.num_heads, p.value_dim)
        g, beta = inputs.g[:n].float(), inputs.beta[:n].float()
        scale = p.scale if p.scale is not None else p.key_dim**-0.5
        if md.num_decodes:
            self._update(
                q[:nd],
                k[:nd],
                v[:nd],
                g[:nd],
                beta[:nd],
                scale=scale,
                states=states,
                state_indices=md.state_indices[dec],
                out=output[:nd],
            )
        if md.num_prefills:
            self._chunk(
                q[nd:],
                k[nd:],
                v[nd:],
                g[nd:],
                beta[nd:],
                scale=scale,
                states=states,
                chunk_size=p.chunk_size,
                out=output[nd:n],
                query_start_loc=md.prefill_query_start_loc,
                state_indices=md.state_indices[pre],
                has_initial_state=md.has_initial_state[pre],
            )
        return output


class TritonLinearAttentionImpl(
    StateImpl[TritonStateMetadata, LinearAttentionLayerParams, LinearAttentionInputs]
):
    """Linear attention with per-head decay: chunked prefill, one-step decode."""

    def __init__(self, kv_cache_spec: MambaSpec, layer_params: LinearAttentionLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        check_state_layer(type(self).__name__, kv_cache_spec, layer_params)
        who = type(self).__name__
        if layer_params.chunk_size > 128:
            raise ValueError(
                f"{who}: linear-attention chunk_size must be <= 128, got {layer_params.chunk_size}"
            )
        from ...kernels.linear_attention.triton import (
            chunk_linear_attention_varlen,
            linear_attention_decode,
        )

        self._chunk = chunk_linear_attention_varlen
        self._decode = linear_attention_decode

    @override
    def forward(
        self,
        inputs: LinearAttentionInputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: TritonStateMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        md, p = attn_metadata, self.layer_params
        nd, n = md.num_decode_tokens, md.num_actual_tokens
        dec = slice(0, md.num_decodes)
        pre = slice(md.num_decodes, md.num_decodes + md.num_prefills)
        (states,) = kv_cache
        q, k, v = inputs.q, inputs.k, inputs.v
        scale = p.scale if p.scale is not None else p.key_dim**-0.5
        decay = p.decay.to(q.device)
        if md.num_decodes:
            self._decode(
                q[:nd],
                k[:nd],
                v[:nd],
                decay,
                scale=scale,
                states=states,
                state_indices=md.state_indices[dec],
                out=output[:nd],
            )
        if md.num_prefills:
            self._chunk(
                q[nd:n],
                k[nd:n],
                v[nd:n],
                decay,
                scale=scale,
                states=states,
                chunk_size=p.chunk_size,
                out=output[nd:n],
                query_start_loc=md.prefill_query_start_loc,
                state_indices=md.state_indices[pre],
                has_initial_state=md.has_initial_state[pre],
            )
        return output


class TritonShortConvImpl(StateImpl[TritonStateMetadata, ShortConvLayerParams, ShortConvInputs]):
    """LFM2 short conv ``y = c * conv(b * x)``: varlen prefill, one-step update."""

    def __init__(self, kv_cache_spec: MambaSpec, layer_params: ShortConvLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        check_state_layer(type(self).__name__, kv_cache_spec, layer_params)
        from ...kernels.short_conv.triton import short_conv_update, short_conv_varlen

        self._varlen = short_conv_varlen
        self._update = short_conv_update

    @override
    def forward(
        self,
        inputs: ShortConvInputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: TritonStateMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        md, p = attn_metadata, self.layer_params
        nd, n = md.num_decode_tokens, md.num_actual_tokens
        dec = slice(0, md.num_decodes)
        pre = slice(md.num_decodes, md.num_decodes + md.num_prefills)
        (conv_states,) = kv_cache
        b, c, x = inputs.b, inputs.c, inputs.x
        if md.num_decodes:
            self._update(
                b[:nd],
                c[:nd],
                x[:nd],
                p.conv_weight,
                p.conv_bias,
                conv_states=conv_states,
                state_indices=md.state_indices[dec],
                out=output[:nd],
            )
        if md.num_prefills:
            self._varlen(
                b[nd:n],
                c[nd:n],
                x[nd:n],
                p.conv_weight,
                p.conv_bias,
                conv_states=conv_states,
                out=output[nd:n],
                query_start_loc=md.prefill_query_start_loc,
                state_indices=md.state_indices[pre],
                has_initial_state=md.has_initial_state[pre],
            )
        return output


class _TritonStateBackend(AttentionBackend):
    """Shared declarations of the five state backends."""

    supported_devices = frozenset({"cpu", "cuda"})
    required_packages: ClassVar[Mapping[str, str]] = {"triton": "triton>=3.0"}

    @classmethod
    @override
    def extra_environment_reasons(cls, device: torch.device) -> list[str]:
        return triton_cpu_reasons(device)

    @classmethod
    @override
    def extra_not_supported_reasons(cls, request: BackendRequest) -> list[str]:
        # The type's own rules: its layout, and recurrent states in float32.
        return state_spec_reasons(request.spec, cls.supported_mamba_types)


class TritonMamba1Backend(_TritonStateBackend):
    name = "triton_mamba1"
    description = "Triton Mamba (1): causal conv1d + selective scan / one-token update"
    supported_mamba_types: ClassVar[frozenset[MambaType]] = frozenset({"mamba1"})
    builders = (bind_builder(MambaSpec, TritonStateMetadataBuilder, TritonMamba1Impl),)


class TritonMamba2Backend(_TritonStateBackend):
    name = "triton_mamba2"
    description = "Triton Mamba2: causal conv1d + chunked SSD / selective state update"
    supported_mamba_types: ClassVar[frozenset[MambaType]] = frozenset({"mamba2"})
    builders = (bind_builder(MambaSpec, TritonStateMetadataBuilder, TritonMamba2Impl),)


class TritonGatedDeltaNetBackend(_TritonStateBackend):
    name = "triton_gdn"
    description = (
        "Triton Gated DeltaNet: short conv + chunked gated delta rule / fused recurrent step"
    )
    supported_mamba_types: ClassVar[frozenset[MambaType]] = frozenset({"gdn"})
    builders = (bind_builder(MambaSpec, TritonStateMetadataBuilder, TritonGatedDeltaNetImpl),)


class TritonLinearAttentionBackend(_TritonStateBackend):
    name = "triton_linear_attn"
    description = "Triton linear attention with per-head decay (lightning style)"
    supported_mamba_types: ClassVar[frozenset[MambaType]] = frozenset({"linear"})
    builders = (bind_builder(MambaSpec, TritonStateMetadataBuilder, TritonLinearAttentionImpl),)


class TritonShortConvBackend(_TritonStateBackend):
    name = "triton_short_conv"
    description = "Triton LFM2-style gated short convolution"
    supported_mamba_types: ClassVar[frozenset[MambaType]] = frozenset({"short_conv"})
    builders = (bind_builder(MambaSpec, TritonStateMetadataBuilder, TritonShortConvImpl),)
