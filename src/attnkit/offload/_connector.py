"""The connector interface: save and load pages by canonical id, asynchronously."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import torch
from typing_extensions import override

__all__ = ["ConnectorStats", "DoneHandle", "KVConnector", "TransferHandle"]


class TransferHandle(abc.ABC):
    """One submitted save or load.

    ``done()`` polls (never blocks); ``wait()`` blocks until the transfer is over and
    says whether it succeeded. For a load, the destination holds the page's bytes only
    once ``wait()`` returned ``True``; for a save, the connector may read the source
    until the handle is done (the caller keeps it alive and unchanged until then).
    """

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the transfer is over (successfully or not), without blocking."""

    @abc.abstractmethod
    def wait(self) -> bool:
        """Block until the transfer is over; ``True`` if it succeeded."""


class DoneHandle(TransferHandle):
    """A transfer that finished when it was submitted (synchronous connectors)."""

    __slots__ = ("ok",)

    def __init__(self, ok: bool) -> None:
        self.ok = ok

    @override
    def done(self) -> bool:
        return True

    @override
    def wait(self) -> bool:
        return self.ok


class _AllHandle(TransferHandle):
    """Several transfers as one: done when all are, ``True`` when all succeeded."""

    __slots__ = ("_handles",)

    def __init__(self, handles: list[TransferHandle]) -> None:
        self._handles = handles

    @override
    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    @override
    def wait(self) -> bool:
        return all([h.wait() for h in self._handles])


@dataclasses.dataclass(frozen=True)
class ConnectorStats:
    """What a connector holds and has moved.

    Attributes:
        pages: pages held now; ``bytes``: their bytes; ``capacity_bytes``: the bound
            (``None``: unbounded).
        saves, loads: transfers submitted; ``load_failures``: loads that did not
            succeed (a missing page included); ``evictions``: pages the connector's own
            LRU dropped to stay within its bound; ``rejected``: saves refused (a page
            larger than the bound).
    """

    pages: int = 0
    bytes: int = 0
    capacity_bytes: int | None = None
    saves: int = 0
    loads: int = 0
    load_failures: int = 0
    evictions: int = 0
    rejected: int = 0


class KVConnector(abc.ABC):
    """Where evicted pages go, keyed by canonical page id (``bytes``).

    A page is a flat ``uint8`` tensor; the runtime saves each page once per eviction
    and loads it into a tensor of the same size. Keys are content addresses: equal keys
    always mean equal bytes, so a connector may drop a save whose key it holds. Any
    method may be called while transfers are in flight; a load of a key whose save is
    still in flight must return the saved bytes (wait for the save), never older ones.
    The runtime never calls two methods at once (saves may come from its worker thread,
    see ``saves_in_background``), and the pages it saves are its own copies, which it
    leaves alone until the save's handle is done.
    """

    def saves_in_background(self, device: torch.device) -> bool:
        """Whether the runtime hands the pages of ``device``'s cache to
        ``submit_save_batch`` from a worker thread (with their canonical ids made there)
        rather than in the layer call that copies them out. Default ``True``: an
        external store may block (files, a network); a connector whose saves are a
        cheap copy says ``False`` where waking a thread costs more than the copy."""
        return True

    @abc.abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether a load of ``key`` can succeed now (a save in flight counts)."""

    @abc.abstractmethod
    def submit_save(self, key: bytes, data: torch.Tensor) -> TransferHandle:
        """Start saving ``data`` (1-D ``uint8``) under ``key``."""

    def submit_save_batch(self, keys: Sequence[bytes], pages: torch.Tensor) -> TransferHandle:
        """Start saving ``pages[i]`` (``pages``: ``[len(keys), page bytes]`` uint8) under
        ``keys[i]``; as with ``submit_save``, the connector may read ``pages`` until the
        handle is done (the runtime reuses its staging buffer only then). Default:
        ``submit_save`` per page; the handle is done when every save is."""
        return _AllHandle([self.submit_save(key, pages[i]) for i, key in enumerate(keys)])

    @abc.abstractmethod
    def submit_load(self, key: bytes, out: torch.Tensor) -> TransferHandle:
        """Start loading ``key`` into ``out`` (1-D ``uint8`` of the page's size); a
        missing key or a size mismatch gives a handle whose ``wait()`` is ``False``."""

    def submit_load_batch(self, keys: Sequence[bytes], out: torch.Tensor) -> list[TransferHandle]:
        """Start loading ``keys[i]`` into ``out[i]`` (``out``: ``[len(keys), page bytes]``
        uint8); one handle per key. Default: ``submit_load`` per page."""
        return [self.submit_load(key, out[i]) for i, key in enumerate(keys)]

    def stats(self) -> ConnectorStats:
        """What the connector holds and has moved (default: nothing known)."""
        return ConnectorStats()

    def close(self) -> None:  # noqa: B027 (optional hook: most connectors hold nothing)
        """Finish transfers in flight and release resources (default: nothing)."""
