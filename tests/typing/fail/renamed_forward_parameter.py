"""An impl whose ``forward`` renames a parameter: a hole mypy has and pyright does not.

pyright reports the override (``reportIncompatibleMethodOverride``, "Parameter 2 name
mismatch"). mypy does not check the names of parameters that are not keyword-only
against the overridden method's, with or without ``@override``, and no
``--enable-error-code`` turns it on (python/mypy#6709). attnkit's runtime passes
``forward``'s arguments by position, so the rename breaks only callers that pass them
by keyword.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from typing_extensions import override

from attnkit import AttentionLayerParams, AttentionSpec, Mamba2Inputs, Mamba2LayerParams
from attnkit.backend_api import AttentionImpl, StateImpl

from ._common import AttnMeta, MambaMeta


class RenamedQueryImpl(AttentionImpl[AttnMeta, AttentionSpec, AttentionLayerParams]):
    @override
    def forward(  # E: - | pyright: reportIncompatibleMethodOverride
        self,
        q: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: AttnMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return output


class RenamedMetadataImpl(StateImpl[MambaMeta, Mamba2LayerParams, Mamba2Inputs]):
    @override
    def forward(  # E: - | pyright: reportIncompatibleMethodOverride
        self,
        inputs: Mamba2Inputs,
        kv_cache: Sequence[torch.Tensor],
        metadata: MambaMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        return output
