"""A state layer takes its own input class only: Mamba2 layers take Mamba2Inputs."""

from __future__ import annotations

import torch

from attnkit import AttentionRuntime, GatedDeltaNetInputs, Mamba2Inputs, ShortConvInputs, StateLayer

from ._common import MambaImpl, MambaMeta


def misuse(
    impl: MambaImpl,
    meta: MambaMeta,
    layer: StateLayer[Mamba2Inputs],
    runtime: AttentionRuntime,
    t: torch.Tensor,
) -> None:
    gdn = GatedDeltaNetInputs(qkv=t, g=t, beta=t)
    impl.forward(gdn, [t], meta, t)  # E: arg-type | pyright: reportArgumentType
    layer.forward(ShortConvInputs(b=t, c=t, x=t))  # E: arg-type | pyright: reportArgumentType
    runtime.state_layer("layers.1", Mamba2Inputs).forward(gdn)  # E: arg-type | pyright: reportArgumentType
    # Attention-style arguments are not a state layer's inputs either.
    layer.forward(t)  # E: arg-type | pyright: reportArgumentType
