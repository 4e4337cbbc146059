"""Packed CPU linears for an attached model (``attach(..., pack_linears=True)``).

A transformers model's projections and LM head are ``nn.Linear`` layers, which run
``F.linear`` (MKL's sgemm on the CPU). oneDNN's linear on a weight reordered once into
its blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` /
``_linear_pointwise``, what inductor's freezing uses) is 2-3x faster on this class of
CPU at both decode and prefill sizes, and that, not attention, is most of an engine
step on a small model. So an attachment can keep a packed copy of each CPU linear
weight (float32, and bfloat16 where the CPU has AVX-512 BF16) and run those during
its steps:

- only during the attachment's steps: a call of the model outside one (a reference
  run under ``attached.eager()``, training) runs the module's own ``forward``;
- a weight replaced, changed in place (its version counter), moved or cast is packed
  again before the next step, or served by its own ``forward`` when it no longer can
  be packed (not on the CPU, another dtype);
- ``detach()`` removes every packed copy.

The packed copies cost as much memory as the weights they copy. The results differ
from ``F.linear`` by rounding only (another summation order).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PackedLinears", "packing_problem"]

_Linear = Callable[..., torch.Tensor]


def packing_problem() -> str | None:
    """Why this torch build cannot pack linears (``None``: it can)."""
    backends: Any = torch.backends  # (mkldnn.is_available is untyped in torch's stubs)
    if not backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    ops: Any = torch.ops.mkldnn
    for name in ("_reorder_linear_weight", "_linear_pointwise"):
        if not hasattr(ops, name):
            return f"this torch build has no torch.ops.mkldnn.{name}"
    return None


def _packable(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.is_mkldnn:
        return False
    if weight.dtype == torch.float32:
        return True
    cpu: Any = torch.cpu  # (a private helper of torch's: the CPU's AVX-512 BF16)
    return weight.dtype == torch.bfloat16 and bool(cpu._is_avx512_bf16_supported())


class _Entry:
    """One linear: its weight as packed (identity, version, dtype, device), the copy."""

    __slots__ = ("module", "packed", "source", "version")

    def __init__(self, module: torch.nn.Linear) -> None:
        self.module = module
        self.source: torch.Tensor | None = None
        self.version = -1
        self.packed: torch.Tensor | None = None

    def refresh(self) -> None:
        weight = self.module.weight
        if weight is self.source and weight._version == self.version:
            return
        self.source, self.version = weight, weight._version
        ops: Any = torch.ops.mkldnn
        self.packed = (
            ops._reorder_linear_weight(weight.detach(), None) if _packable(weight) else None
        )


class PackedLinears:
    """The packed copies of a model's CPU linear weights, served while ``active``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.active = False
        self._entries: list[_Entry] = []
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                entry = _Entry(module)
                entry.refresh()
                self._entries.append(entry)
                module.forward = self._forward(entry, module.forward)  # type: ignore[method-assign]  # (an instance attribute, removed by detach)

    @property
    def num_packed(self) -> int:
        """Linears served packed at the next step."""
        return sum(entry.packed is not None for entry in self._entries)

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed copies."""
        return sum(
            e.packed.numel() * e.packed.element_size()
            for e in self._entries
            if e.packed is not None
        )

    def refresh(self) -> None:
        """Pack again what changed since (before each step)."""
        for entry in self._entries:
            entry.refresh()

    def _forward(self, entry: _Entry, own: _Linear) -> _Linear:
        ops: Any = torch.ops.mkldnn
        linear: _Linear = ops._linear_pointwise

        def forward(x: torch.Tensor) -> torch.Tensor:
            packed = entry.packed
            if not self.active or packed is None or x.dtype != packed.dtype:
                return own(x)
            bias: object = entry.module.bias  # (None for bias=False: typed as a Parameter)
            detached = bias.detach() if isinstance(bias, torch.Tensor) else None
            return linear(x, packed, detached, "none", [], "")

        return forward

    def detach(self) -> None:
        """Every linear's own ``forward`` again; the packed copies dropped."""
        for entry in self._entries:
            entry.module.__dict__.pop("forward", None)
            entry.packed = entry.source = None
        self._entries = []
        self.active = False
