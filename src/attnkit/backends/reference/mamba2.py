"""The reference backend's Mamba2 path: conv1d + chunked SSD with states in the cache.

Every request of a step, decode or prefill, goes through the varlen kernels of
``attnkit.kernels`` references (``causal_conv1d_varlen``, ``ssd_chunked_varlen``): one path,
so state continuity does not depend on how a batch is split. A request starts from
its cached state when it has context before the step (``has_initial_state``), from
zeros otherwise. Letters: H heads, P head dim, G groups, N state size, W conv width,
C = H*P + 2*G*N conv channels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from typing_extensions import override

from ..._validation import dtype_name
from ...builder import AttentionCGSupport, AttentionMetadataBuilder
from ...config import AttentionConfig
from ...impl import StateImpl
from ...kernels.conv1d.reference import causal_conv1d_varlen
from ...kernels.mamba2.reference import ssd_chunked_varlen
from ...metadata import CommonAttentionMetadata
from ...params import Mamba2LayerParams, check_state_shapes
from ...spec import MambaSpec
from ...state_inputs import Mamba2Inputs
from ._checks import check_tensor, describe

__all__ = ["ReferenceMamba2Impl", "ReferenceStateBuilder", "ReferenceStateMetadata"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReferenceStateMetadata:
    """One Mamba2 group's step, as the reference kernels take it.

    Attributes:
        num_actual_tokens: ``T``, the step's real tokens (inputs may be padded past it).
        query_start_loc: int32 ``[B+1]`` on the device (``CommonAttentionMetadata``'s own).
        state_indices: int32 ``[B]``: each request's state block, column 0 of the block
            table (a view of it, not a copy).
        has_initial_state: bool ``[B]``: the request has context before this step
            (``seq_lens - query_lens > 0``), so it continues from its cached state.
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor


class ReferenceStateBuilder(AttentionMetadataBuilder[ReferenceStateMetadata, MambaSpec]):
    """Builds ``ReferenceStateMetadata``; narrowed to ``MambaSpec`` by its type parameter."""

    # The torch kernels read offsets back to the host: nothing can be captured.
    cudagraph_support = AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: MambaSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        # One metadata serves every state layer type: each request's state block,
        # offsets and whether it continues from a cached state.

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ReferenceStateMetadata:
        cm = common_attn_metadata
        table = cm.block_table_tensor
        if table.shape[1] < 1:
            raise ValueError(
                f"ReferenceStateBuilder: block_table_tensor must have a column 0 holding each "
                f"request's state block, got {describe(table)}"
            )
        qsl = cm.query_start_loc
        query_lens = qsl[1:] - qsl[:-1]
        return ReferenceStateMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=qsl,
            state_indices=table[:, 0],
            has_initial_state=(cm.seq_lens - query_lens) > 0,
        )


def mamba2_spec_problems(spec: MambaSpec) -> list[str]:
    """What makes ``spec`` unusable by the reference Mamba2 kernels (empty if nothing)."""
    problems: list[str] = []
    if len(spec.shapes) != 2 or len(spec.shapes[0]) != 2 or len(spec.shapes[1]) != 3:
        problems.append(f"mamba2 shapes must be ((C, W-1), (H, P, N)), got {spec.shapes}")
    elif spec.dtypes[1] != torch.float32:
        problems.append(
            f"mamba2 ssm state dtype (dtypes[1]) must be float32, got {dtype_name(spec.dtypes[1])}"
        )
    return problems


class ReferenceMamba2Impl(StateImpl[ReferenceStateMetadata, Mamba2LayerParams, Mamba2Inputs]):
    """Runs the state-space core of one Mamba2 layer (conv1d with SiLU, then SSD).

    Args:
        kv_cache_spec: the layer's ``MambaSpec`` (``mamba_type="mamba2"``, shapes
            ``layer_params.state_shapes``, SSM state in float32).
        layer_params: its ``Mamba2LayerParams`` (required).
    """

    def __init__(self, kv_cache_spec: MambaSpec, layer_params: Mamba2LayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        owner = "ReferenceMamba2Impl"
        if kv_cache_spec.mamba_type != "mamba2":
            raise ValueError(
                f"{owner}: kv_cache_spec.mamba_type must be 'mamba2', got "
                f"{kv_cache_spec.mamba_type!r}"
            )
        problems = mamba2_spec_problems(kv_cache_spec)
        if problems:
            raise ValueError(f"{owner}: kv_cache_spec: {'; '.join(problems)}")
        check_state_shapes(owner, kv_cache_spec, layer_params)

    def _check_inputs(
        self,
        inputs: Mamba2Inputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: object,
        output: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Check every argument; return ``(dt, conv_states, ssm_states)``."""
        owner = "ReferenceMamba2Impl.forward"
        p = self.layer_params
        if not isinstance(attn_metadata, ReferenceStateMetadata):
            raise TypeError(
                f"{owner}: attn_metadata must be ReferenceStateMetadata, "
                f"got {type(attn_metadata).__name__}"
            )
        state_dtype = self.kv_cache_spec.dtypes[0]
        xbc = check_tensor(
            owner,
            "inputs.xBC",
            inputs.xBC,
            layout="[T, C]",
            shape=(None, p.conv_dim),
            dtype=state_dtype,
        )
        device, tokens = xbc.device, xbc.shape[0]
        if tokens < attn_metadata.num_actual_tokens:
            raise ValueError(
                f"{owner}: inputs.xBC must have at least num_actual_tokens="
                f"{attn_metadata.num_actual_tokens} rows, got {describe(xbc)}"
            )
        dt = check_tensor(
            owner, "inputs.dt", inputs.dt, layout="[T, H]", shape=(tokens, p.num_heads), device=device
        )
        if not dt.is_floating_point():
            raise ValueError(
                f"{owner}: inputs.dt must be a floating-point tensor, got {describe(dt)}"
            )
        check_tensor(
            owner,
            "output (y)",
            output,
            layout="[T, H, P]",
            shape=(tokens, p.num_heads, p.head_dim),
            dtype=xbc.dtype,
            device=device,
        )
        if len(kv_cache) != 2:
            raise ValueError(
                f"{owner}: kv_cache must hold 2 tensors (conv state, ssm state), got {len(kv_cache)}"
            )
        conv_shape, ssm_shape = self.kv_cache_spec.shapes
        conv_states = check_tensor(
            owner,
            "kv_cache[0] (conv state)",
            kv_cache[0],
            layout="[NB, C, W-1]",
            shape=(None, *conv_shape),
            dtype=state_dtype,
            device=device,
        )
        ssm_states = check_tensor(
            owner,
            "kv_cache[1] (ssm state)",
            kv_cache[1],
            layout="[NB, H, P, N]",
            shape=(None, *ssm_shape),
            dtype=torch.float32,
            device=device,
        )
        for name in ("conv_weight", "conv_bias", "A", "D", "dt_bias"):
            t = getattr(p, name)
            if t is not None and t.device != device:
                raise ValueError(
                    f"{owner}: layer_params.{name} must be on the inputs' device {device}, "
                    f"got {describe(t)}"
                )
        return dt, conv_states, ssm_states

    @override
    def forward(
        self,
        inputs: Mamba2Inputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceStateMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        dt, conv_states, ssm_states = self._check_inputs(inputs, kv_cache, attn_metadata, output)
        p, md = self.layer_params, attn_metadata
        n = md.num_actual_tokens
        # 1. Causal depthwise conv (SiLU) over x, B and C together, states in the cache.
        xbc = causal_conv1d_varlen(
            inputs.xBC[:n],
            p.conv_weight,
            p.conv_bias,
            conv_states=conv_states,
            query_start_loc=md.query_start_loc,
            state_indices=md.state_indices,
            has_initial_state=md.has_initial_state,
            activation="silu",
        )
        # 2. Split channels: the first H*P are x, then G*N for B, then G*N for C.
        hp, gn = p.num_heads * p.head_dim, p.n_groups * p.d_state
        x = xbc[:, :hp].reshape(n, p.num_heads, p.head_dim)
        b = xbc[:, hp : hp + gn].reshape(n, p.n_groups, p.d_state)
        c = xbc[:, hp + gn :].reshape(n, p.n_groups, p.d_state)
        # 3. Chunked SSD, states read and written in the cache slots.
        output[:n] = ssd_chunked_varlen(
            x,
            dt[:n],
            p.A,
            b,
            c,
            D=p.D,
            dt_bias=p.dt_bias,
            dt_softplus=p.dt_softplus,
            query_start_loc=md.query_start_loc,
            ssm_states=ssm_states,
            state_indices=md.state_indices,
            has_initial_state=md.has_initial_state,
            chunk_size=p.chunk_size,
        )
        output[n:] = 0  # padding rows
        return output
