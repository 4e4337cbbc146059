"""What every demo mixer shares: the ``Mixer`` base (a runtime step and a dense
recompute of one layer), the ``Context`` a step brings (positions, encoder output) and
the RMSNorm the stacks and several mixers use."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from ..params import LayerParams
from ..runtime import AttentionRuntime
from ..spec import KVCacheSpec

Rand = Callable[..., torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Context:
    """What a mixer needs besides its hidden states.

    Attributes:
        positions: int64 ``[T]``, each token's position in its sequence (MLA's RoPE);
            ``None`` in a dense recompute means ``0..T-1``.
        encoder: ``[E, hidden]`` encoder output that cross-attention layers read: in a
            step the outputs of ``StepBatch.encoder_order`` concatenated (``None`` when
            no request starts), in a dense recompute the request's own.
    """

    positions: torch.Tensor | None = None
    encoder: torch.Tensor | None = None


NO_CONTEXT = Context()


_SpecT = TypeVar("_SpecT", bound=KVCacheSpec)
_ParamsT = TypeVar("_ParamsT", bound=LayerParams)


class Mixer(Generic[_SpecT, _ParamsT]):
    """One layer's mixer: the same projections around a runtime core and a dense core.

    Generic in its spec and parameter types, so each mixer keeps its own (a subclass
    may not narrow a mutable attribute of its base). ``ctx`` brings the step's
    positions and encoder output to the mixers that read them (MLA, cross-attention).
    """

    spec: _SpecT
    params: _ParamsT

    def step(
        self, runtime: AttentionRuntime, name: str, h: torch.Tensor, ctx: Context = NO_CONTEXT
    ) -> torch.Tensor:
        raise NotImplementedError

    def dense(self, h: torch.Tensor, ctx: Context = NO_CONTEXT) -> torch.Tensor:
        raise NotImplementedError


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """RMSNorm (pre-norm without a weight keeps activations O(1) through the random stack)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float() if weight is not None else normed).to(x.dtype)
