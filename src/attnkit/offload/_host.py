"""``HostMemoryTier``: a bounded pool of host memory with its own LRU."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import override

from .._validation import is_positive_int
from ..errors import ArgumentTypeError, InvalidArgumentError
from ._connector import ConnectorStats, DoneHandle, KVConnector, TransferHandle

__all__ = ["HostMemoryTier"]

_CUDA: Any = torch.cuda
"""``torch.cuda``, whose ``Event`` and ``Stream`` are untyped: called through ``Any``."""

_CHUNK_PAGES = 256
"""Slots are allocated in chunks of this many pages (fewer when the bound is smaller)."""


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


class _Slots:
    """Fixed-size page slots of one page size: chunks of host memory (pinned when the
    pages come from CUDA), a free list, slot ``s`` is row ``s % n`` of chunk ``s // n``."""

    def __init__(self, size: int, per_chunk: int, pinned: bool) -> None:
        self.size, self.per_chunk, self.pinned = size, per_chunk, pinned
        self.chunks: list[torch.Tensor] = []
        self.free: list[int] = []

    def take(self) -> int:
        if not self.free:
            base = len(self.chunks) * self.per_chunk
            self.chunks.append(
                torch.empty((self.per_chunk, self.size), dtype=torch.uint8, pin_memory=self.pinned)
            )
            self.free = list(range(base + self.per_chunk - 1, base - 1, -1))  # low first
        return self.free.pop()

    def row(self, slot: int) -> torch.Tensor:
        return self.chunks[slot // self.per_chunk][slot % self.per_chunk]


class HostMemoryTier(KVConnector):
    """Pages in host memory, at most ``capacity_bytes``, least recently used dropped
    first (a load counts as a use). Pages live in fixed-size slots allocated in chunks
    and reused, so a save allocates nothing once the tier is warm.

    Pages saved from CUDA tensors are copied into pinned slots on a side stream (after
    the current stream's work up to the save, so the copy reads the bytes as they were
    then), and loads copy back on that stream; ``wait()`` synchronises on the copy's
    event, and a slot is not reused while a copy into it may be in flight. Pages from
    CPU tensors are copied at once.

    Args:
        capacity_bytes: the bound on the pages' bytes.
        background: ``saves_in_background``; ``None`` (default): on CUDA, where the
            host's part of a save (ids, slots) then overlaps the device's work, and not
            on CPU, where a save is a copy of a few pages and waking a thread costs
            more than the copy.

    Raises:
        InvalidArgumentError: ``capacity_bytes`` not a positive int.
        ArgumentTypeError: ``background`` not a bool or ``None``.
    """

    def __init__(self, capacity_bytes: int, *, background: bool | None = None) -> None:
        if not is_positive_int(capacity_bytes):
            raise InvalidArgumentError(
                f"capacity_bytes must be a positive int, got {capacity_bytes!r}"
            )
        given: object = background
        if given is not None and not isinstance(given, bool):
            raise ArgumentTypeError(
                f"background must be a bool or None, got {type(given).__name__}"
            )
        self.capacity_bytes = capacity_bytes
        self.background = background
        self._entries: dict[bytes, tuple[_Slots, int]] = {}
        """key -> its slot, least recently used first."""
        self._saving: dict[bytes, _EventHandle] = {}
        """CUDA saves that may be in flight, by key."""
        self._slots: dict[tuple[int, bool], _Slots] = {}
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
    def saves_in_background(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.background is None else self.background

    @override
    def contains(self, key: bytes) -> bool:
        return key in self._entries

    @override
    def submit_save(self, key: bytes, data: torch.Tensor) -> TransferHandle:
        _check_page("data", data)
        return self.submit_save_batch([key], data.view(1, -1))

    @override
    def submit_save_batch(self, keys: Sequence[bytes], pages: torch.Tensor) -> TransferHandle:
        """One copy for the batch (on CUDA: one event)."""
        if pages.dtype != torch.uint8 or pages.dim() != 2 or not pages.is_contiguous():
            raise InvalidArgumentError(
                f"pages must be a contiguous 2-D uint8 tensor (a page per row), got "
                f"{pages.dtype} of shape {tuple(pages.shape)}"
            )
        if len(keys) != pages.shape[0]:
            raise InvalidArgumentError(
                f"keys must have one entry per row of pages ({pages.shape[0]}), got {len(keys)}"
            )
        size = int(pages.shape[1])
        entries = self._entries
        fresh: list[int] = []
        for i, key in enumerate(keys):
            if key in entries:  # a content address: the bytes are the same
                entries[key] = entries.pop(key)
            else:
                fresh.append(i)
        s = self._stats
        if size > self.capacity_bytes:
            self._stats = dataclasses.replace(
                s, saves=s.saves + len(keys), rejected=s.rejected + len(fresh)
            )
            return DoneHandle(not fresh)
        fresh = fresh[-(self.capacity_bytes // size) :] if fresh else fresh  # what fits
        self._stats = dataclasses.replace(s, saves=s.saves + len(keys))
        if not fresh:
            return DoneHandle(True)
        while self._bytes + len(fresh) * size > self.capacity_bytes:
            self._drop(next(iter(entries)))
        cuda = pages.is_cuda
        slots = self._slots.get((size, cuda))
        if slots is None:
            per_chunk = max(1, min(_CHUNK_PAGES, self.capacity_bytes // size))
            slots = self._slots[size, cuda] = _Slots(size, per_chunk, cuda)
        taken = [slots.take() for _ in fresh]
        source = pages if len(fresh) == len(keys) else pages[fresh]
        handle: TransferHandle = DoneHandle(True)
        if cuda:
            ready = _CUDA.Event()
            ready.record(_CUDA.current_stream(pages.device))
            stream = self._side_stream(pages.device)
            with _CUDA.stream(stream):
                stream.wait_event(ready)
                for j, slot in enumerate(taken):
                    slots.row(slot).copy_(source[j], non_blocking=True)
                copied = _CUDA.Event()
                copied.record(stream)
            saving = _EventHandle(copied, source)
            for i in fresh:
                self._saving[keys[i]] = saving
            handle = saving
        else:
            _copy_rows(slots, taken, source)
        for i, slot in zip(fresh, taken, strict=True):
            entries[keys[i]] = (slots, slot)
        self._bytes += len(fresh) * size
        return handle

    def _drop(self, key: bytes) -> None:
        slots, slot = self._entries.pop(key)
        saving = self._saving.pop(key, None)
        if saving is not None:
            saving.wait()  # never reuse a slot a copy may still write
        slots.free.append(slot)
        self._bytes -= slots.size
        self._count(evictions=1)

    @override
    def submit_load(self, key: bytes, out: torch.Tensor) -> TransferHandle:
        _check_page("out", out)
        self._count(loads=1)
        entry = self._entries.get(key)
        if entry is None or entry[0].size != out.numel():
            self._count(load_failures=1)
            return DoneHandle(False)
        self._entries[key] = self._entries.pop(key)  # most recently used
        slots, slot = entry
        row = slots.row(slot)
        if out.is_cuda or slots.pinned:
            device = out.device if out.is_cuda else torch.device("cuda")
            stream = self._side_stream(device)
            ready = _CUDA.Event()
            ready.record(_CUDA.current_stream(device))
            with _CUDA.stream(stream):  # after the save's copy (the same stream)
                stream.wait_event(ready)
                out.copy_(row, non_blocking=True)
                copied = _CUDA.Event()
                copied.record(stream)
            return _EventHandle(copied, None)
        out.copy_(row)
        return DoneHandle(True)

    @override
    def submit_load_batch(self, keys: Sequence[bytes], out: torch.Tensor) -> list[TransferHandle]:
        """On CPU, the pages found copied at once, one stats update; CUDA as
        ``submit_load``."""
        if out.is_cuda or out.dim() != 2 or out.dtype != torch.uint8 or not out.is_contiguous():
            return super().submit_load_batch(keys, out)
        entries = self._entries
        size = int(out.shape[1])
        found: dict[_Slots, tuple[list[int], list[int]]] = {}
        handles: list[TransferHandle] = []
        for i, key in enumerate(keys):
            entry = entries.get(key)
            if entry is None or entry[0].size != size or entry[0].pinned:
                handles.append(self.submit_load(key, out[i]))
                continue
            entries[key] = entries.pop(key)  # most recently used
            rows, picks = found.setdefault(entry[0], ([], []))
            rows.append(entry[1])
            picks.append(i)
            handles.append(DoneHandle(True))
        for slots, (taken, picks) in found.items():
            per = slots.per_chunk
            for chunk in {slot // per for slot in taken}:
                pairs = [
                    (s % per, p) for s, p in zip(taken, picks, strict=True) if s // per == chunk
                ]
                src = slots.chunks[chunk][torch.tensor([r for r, _ in pairs], dtype=torch.long)]
                out.index_copy_(0, torch.tensor([p for _, p in pairs], dtype=torch.long), src)
        loaded = sum(len(p) for _, p in found.values())
        if loaded:
            self._count(loads=loaded)
        return handles

    @override
    def stats(self) -> ConnectorStats:
        return dataclasses.replace(self._stats, pages=len(self._entries), bytes=self._bytes)

    @override
    def close(self) -> None:
        for handle in self._saving.values():
            handle.wait()
        self._saving.clear()


def _copy_rows(slots: _Slots, taken: list[int], source: torch.Tensor) -> None:
    """``source[j]`` into slot ``taken[j]``: one copy per run of consecutive slots in a
    chunk (a fresh chunk hands slots out in order; on CPU ``index_copy_`` of wide uint8
    rows costs several times more than plain copies)."""
    per = slots.per_chunk
    start = 0
    n = len(taken)
    while start < n:
        first = taken[start]
        end = start + 1
        while end < n and taken[end] == first + (end - start) and taken[end] % per:
            end += 1
        row = first % per
        slots.chunks[first // per][row : row + end - start].copy_(source[start:end])
        start = end


def _check_page(name: str, tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise InvalidArgumentError(
            f"{name} must be a contiguous 1-D uint8 tensor (a page's bytes), got "
            f"{tensor.dtype} of shape {tuple(tensor.shape)}"
        )
