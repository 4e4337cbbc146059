"""oneDNN CPU linears for an attached model (``attach(..., linears=...)``).

A transformers model's projections and LM head are ``nn.Linear`` layers, which run
``F.linear`` (MKL's sgemm on the CPU). oneDNN's linear (``torch.ops.mkldnn.
_linear_pointwise``) is faster on the CPUs measured, and that, not attention, is most of
an engine step on a small model. Two forms, both on float32 weights and on bfloat16 ones
where the CPU has AVX-512 BF16:

- ``linears="onednn"`` (the default on the CPU): oneDNN's linear on the module's own
  weight, no copy. A 16-row GEMM of 1024 x 4096 took 0.82x ``F.linear``'s time on one
  thread and 0.57x on two (a 2-core AMD EPYC with AVX-512); ``benchmarks/bench_engine.py``
  ran 1.2x (one thread) and 1.5x (two) the tokens per second of ``F.linear``.
- ``linears="packed"`` (``pack_linears=True``): a copy of each weight reordered once into
  oneDNN's blocked layout (``_reorder_linear_weight``, what inductor's freezing uses):
  0.68x and 0.33x ``F.linear``'s time in the same measurement, 1.5x and 1.9x the
  engine's tokens per second, for twice the linears' memory.

Either runs during the attachment's steps:

- only during the attachment's steps: a call of the model outside one (a reference
  run under ``attached.eager()``, training) runs the module's own ``forward``;
- a weight replaced, changed in place (its version counter), moved or cast (its data)
  is taken again before the next step, or served by its own ``forward`` when it no longer can
  be packed (not on the CPU, another dtype);
- ``detach()`` removes every packed copy.

The packed copies cost as much memory as the weights they copy; the unpacked form costs
nothing. The results differ from ``F.linear`` by rounding only (another summation order).
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
    """One linear: its weight as served (identity, version, dtype, device), and what
    oneDNN runs on: the packed copy, or the weight itself (``copies=False``)."""

    __slots__ = ("copies", "module", "packed", "source", "storage", "version")

    def __init__(self, module: torch.nn.Linear, copies: bool) -> None:
        self.module = module
        self.copies = copies
        self.source: torch.Tensor | None = None
        self.version = -1
        self.storage: int = 0
        self.packed: torch.Tensor | None = None

    def refresh(self) -> None:
        weight = self.module.weight
        # (``model.to(dtype)`` gives the same parameter new data, version unchanged)
        storage = weight.data_ptr()
        if weight is self.source and weight._version == self.version and storage == self.storage:
            return
        self.source, self.version, self.storage = weight, weight._version, storage
        if not _packable(weight):
            self.packed = None
        elif self.copies:
            ops: Any = torch.ops.mkldnn
            self.packed = ops._reorder_linear_weight(weight.detach(), None)
        else:  # the weight's own storage (an in-place change is seen as it is made)
            self.packed = weight.detach() if weight.is_contiguous() else None


class PackedLinears:
    """A model's CPU linears on oneDNN, served while ``active``: packed copies of their
    weights (``copies``), or the weights as they are."""

    def __init__(self, model: torch.nn.Module, *, copies: bool = True) -> None:
        self.active = False
        self.copies = copies
        self._entries: list[_Entry] = []
        for module in model.modules():
            # A subclass with a forward of its own (llama4's router returns its top-k
            # too) keeps it: only the plain linear is served.
            if isinstance(module, torch.nn.Linear) and (
                type(module).forward is torch.nn.Linear.forward
            ):
                entry = _Entry(module, copies)
                entry.refresh()
                self._entries.append(entry)
                module.forward = self._forward(entry, module.forward)  # type: ignore[method-assign]  # (an instance attribute, removed by detach)

    @property
    def num_packed(self) -> int:
        """Linears served by oneDNN at the next step."""
        return sum(entry.packed is not None for entry in self._entries)

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed copies (0 without copies)."""
        return sum(
            e.packed.numel() * e.packed.element_size()
            for e in self._entries
            if e.packed is not None and e.copies
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
