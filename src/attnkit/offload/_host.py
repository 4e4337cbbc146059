"""``HostMemoryTier``: a bounded pool of host memory with its own LRU."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from typing_extensions import override

from .._validation import is_positive_int
from ..errors import ArgumentTypeError, InvalidArgumentError
from ._connector import ConnectorStats, DoneHandle, KVConnector, TransferHandle

__all__ = ["HostMemoryTier"]

_CUDA: Any = torch.cuda
"""``torch.cuda``, whose ``Event`` and ``Stream`` are untyped: called through ``Any``."""


class _EventHandle(TransferHandle):
    """A CUDA copy: done when its event has completed."""

    __slots__ = ("_event", "_keep")

    def __init__(self, event: Any, keep: torch.Tensor | None) -> None:
        self._event = event
        self._keep = keep  # the source of a save stays alive until the copy is done

    @override
    def done(self) -> bool:
        if bool(self._event.query()):
            self._keep = None
            return True
        return False

    @override
    def wait(self) -> bool:
        self._event.synchronize()
        self._keep = None
        return True


@dataclasses.dataclass(slots=True)
class _Entry:
    data: torch.Tensor  # host uint8 (pinned when pages come from CUDA)
    saved: _EventHandle | None  # the save's copy, while it may be in flight


class HostMemoryTier(KVConnector):
    """Pages in host memory, at most ``capacity_bytes``, least recently used dropped
    first (a load counts as a use).

    Pages saved from CUDA tensors are copied into pinned host memory on a side stream
    (after the current stream's work up to the save, so the copy reads the bytes as
    they were then), and loads copy back on that stream; ``wait()`` synchronises on
    the copy's event. Pages from CPU tensors are copied at once.

    Args:
        capacity_bytes: the bound on the pages' bytes.

    Raises:
        InvalidArgumentError: ``capacity_bytes`` not a positive int.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if not is_positive_int(capacity_bytes):
            raise InvalidArgumentError(
                f"capacity_bytes must be a positive int, got {capacity_bytes!r}"
            )
        self.capacity_bytes = capacity_bytes
        self._entries: dict[bytes, _Entry] = {}
        self._bytes = 0
        self._stats = ConnectorStats(capacity_bytes=capacity_bytes)
        self._stream: Any = None

    def _count(self, **changes: int) -> None:
        s = self._stats
        self._stats = dataclasses.replace(
            s, **{name: getattr(s, name) + change for name, change in changes.items()}
        )

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = _CUDA.Stream(device=device)
        return self._stream

    @override
    def contains(self, key: bytes) -> bool:
        return key in self._entries

    @override
    def submit_save(self, key: bytes, data: torch.Tensor) -> TransferHandle:
        _check_page("data", data)
        self._count(saves=1)
        size = data.numel()
        if key in self._entries:  # a content address: the bytes are the same
            self._entries[key] = self._entries.pop(key)
            return DoneHandle(True)
        if size > self.capacity_bytes:
            self._count(rejected=1)
            return DoneHandle(False)
        while self._bytes + size > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
        if data.is_cuda:
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            ready = _CUDA.Event()
            ready.record(torch.cuda.current_stream(data.device))
            stream = self._side_stream(data.device)
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                host.copy_(data, non_blocking=True)
                copied = _CUDA.Event()
                copied.record(stream)
            saved = _EventHandle(copied, data)
            self._entries[key] = _Entry(host, saved)
            self._bytes += size
            return saved
        self._entries[key] = _Entry(data.clone(), None)
        self._bytes += size
        return DoneHandle(True)

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        if entry.saved is not None:
            entry.saved.wait()  # never free pinned memory a copy still reads
        self._bytes -= entry.data.numel()
        self._count(evictions=1)

    @override
    def submit_load(self, key: bytes, out: torch.Tensor) -> TransferHandle:
        _check_page("out", out)
        self._count(loads=1)
        entry = self._entries.get(key)
        if entry is None or entry.data.numel() != out.numel():
            self._count(load_failures=1)
            return DoneHandle(False)
        self._entries[key] = self._entries.pop(key)  # most recently used
        if out.is_cuda:
            stream = self._side_stream(out.device)
            ready = _CUDA.Event()
            ready.record(torch.cuda.current_stream(out.device))
            with torch.cuda.stream(stream):  # after the save's copy (same stream)
                stream.wait_event(ready)
                out.copy_(entry.data, non_blocking=True)
                copied = _CUDA.Event()
                copied.record(stream)
            return _EventHandle(copied, None)
        if entry.saved is not None:
            entry.saved.wait()
        out.copy_(entry.data)
        return DoneHandle(True)

    @override
    def stats(self) -> ConnectorStats:
        return dataclasses.replace(self._stats, pages=len(self._entries), bytes=self._bytes)

    @override
    def close(self) -> None:
        for entry in self._entries.values():
            if entry.saved is not None:
                entry.saved.wait()


def _check_page(name: str, tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise InvalidArgumentError(
            f"{name} must be a contiguous 1-D uint8 tensor (a page's bytes), got "
            f"{tensor.dtype} of shape {tuple(tensor.shape)}"
        )
