"""The reference backend's Mamba (1) path: conv1d, x_proj/dt_proj, selective scan.

Every request of a step, decode or prefill, goes through the varlen torch kernels
(``causal_conv1d_varlen``, ``mamba1_projections``, ``selective_scan_varlen``), starting
from its cached states when it has context before the step. Letters: D ``d_inner``
channels, N state size, W conv width. (Gu & Dao 2023, arXiv:2312.00752.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from typing_extensions import override

from ..._validation import dtype_name
from ...impl import StateImpl
from ...kernels.conv1d.reference import causal_conv1d_varlen
from ...kernels.mamba1.reference import mamba1_projections, selective_scan_varlen
from ...params import Mamba1LayerParams, check_state_shapes
from ...spec import MambaSpec
from ...state_inputs import Mamba1Inputs
from ._checks import check_tensor, describe
from .mamba2 import ReferenceStateMetadata

__all__ = [
    "ReferenceMamba1Impl",
    "check_mamba1_layer",
    "mamba1_layer_tensors",
    "mamba1_spec_problems",
]


def mamba1_spec_problems(spec: MambaSpec) -> list[str]:
    """What makes ``spec`` unusable by the Mamba (1) kernels (empty if nothing)."""
    shapes = spec.shapes
    if (
        len(shapes) != 2
        or len(shapes[0]) != 2
        or len(shapes[1]) != 2
        or shapes[0][0] != shapes[1][0]
    ):
        return [f"mamba1 shapes must be ((D, W-1), (D, N)), got {shapes}"]
    if spec.dtypes[1] != torch.float32:
        return [
            f"mamba1 ssm state dtype (dtypes[1]) must be float32, got {dtype_name(spec.dtypes[1])}"
        ]
    return []


def mamba1_layer_tensors(
    owner: str,
    spec: MambaSpec,
    p: Mamba1LayerParams,
    inputs: Mamba1Inputs,
    kv_cache: Sequence[torch.Tensor],
    num_actual_tokens: int,
    output: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check one step's tensors; return ``(x, conv_states, ssm_states)``."""
    conv_dtype = spec.dtypes[0]
    x = check_tensor(
        owner, "inputs.x", inputs.x, layout="[T, D]", shape=(None, p.d_inner), dtype=conv_dtype
    )
    if x.shape[0] < num_actual_tokens:
        raise ValueError(
            f"{owner}: inputs.x must have at least num_actual_tokens={num_actual_tokens} rows, "
            f"got {describe(x)}"
        )
    device = x.device
    check_tensor(
        owner,
        "output (y)",
        output,
        layout="[T, D]",
        shape=(x.shape[0], p.d_inner),
        dtype=x.dtype,
        device=device,
    )
    if len(kv_cache) != 2:
        raise ValueError(
            f"{owner}: kv_cache must hold 2 tensors (conv state, ssm state), got {len(kv_cache)}"
        )
    conv_shape, ssm_shape = spec.shapes
    conv_states = check_tensor(
        owner,
        "kv_cache[0] (conv state)",
        kv_cache[0],
        layout="[NB, D, W-1]",
        shape=(None, *conv_shape),
        dtype=conv_dtype,
        device=device,
    )
    ssm_states = check_tensor(
        owner,
        "kv_cache[1] (ssm state)",
        kv_cache[1],
        layout="[NB, D, N]",
        shape=(None, *ssm_shape),
        dtype=torch.float32,
        device=device,
    )
    for name in (
        "conv_weight",
        "conv_bias",
        "x_proj_weight",
        "dt_proj_weight",
        "dt_bias",
        "A",
        "D",
        "dt_norm_weight",
        "B_norm_weight",
        "C_norm_weight",
    ):
        t = getattr(p, name)
        if t is not None and t.device != device:
            raise ValueError(
                f"{owner}: layer_params.{name} must be on the inputs' device {device}, "
                f"got {describe(t)}"
            )
    return x, conv_states, ssm_states


def check_mamba1_layer(owner: str, spec: MambaSpec, params: Mamba1LayerParams) -> None:
    """Construction-time checks shared by the Mamba (1) impls."""
    if spec.mamba_type != "mamba1":
        raise ValueError(
            f"{owner}: kv_cache_spec.mamba_type must be 'mamba1', got {spec.mamba_type!r}"
        )
    problems = mamba1_spec_problems(spec)
    if problems:
        raise ValueError(f"{owner}: kv_cache_spec: {'; '.join(problems)}")
    check_state_shapes(owner, spec, params)


class ReferenceMamba1Impl(StateImpl[ReferenceStateMetadata, Mamba1LayerParams, Mamba1Inputs]):
    """Runs the selective-scan core of one Mamba (1) layer.

    ``forward(Mamba1Inputs(x [T, D])) -> y [T, D]`` (before the model's ``z`` gate).
    """

    def __init__(self, kv_cache_spec: MambaSpec, layer_params: Mamba1LayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        check_mamba1_layer(type(self).__name__, kv_cache_spec, layer_params)

    @override
    def forward(
        self,
        inputs: Mamba1Inputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceStateMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        owner, p, md = f"{type(self).__name__}.forward", self.layer_params, attn_metadata
        n = md.num_actual_tokens
        x, conv_states, ssm_states = mamba1_layer_tensors(
            owner, self.kv_cache_spec, p, inputs, kv_cache, n, output
        )
        # 1. Causal depthwise conv (SiLU) over x, conv states in the cache.
        u = causal_conv1d_varlen(
            x[:n],
            p.conv_weight,
            p.conv_bias,
            conv_states=conv_states,
            query_start_loc=md.query_start_loc,
            state_indices=md.state_indices,
            has_initial_state=md.has_initial_state,
            activation="silu",
        )
        # 2. The input-dependent dt, B, C from the convolved x.
        dt, b, c = mamba1_projections(
            u,
            p.x_proj_weight,
            p.dt_proj_weight,
            dt_norm_weight=p.dt_norm_weight,
            B_norm_weight=p.B_norm_weight,
            C_norm_weight=p.C_norm_weight,
            norm_eps=p.norm_eps,
        )
        # 3. The selective scan, SSM states read and written in the cache slots.
        output[:n] = selective_scan_varlen(
            u,
            dt,
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
        )
        output[n:] = 0  # padding rows
        return output
