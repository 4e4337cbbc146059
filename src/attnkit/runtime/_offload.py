"""The runtime's side of offload (docs/offload.md): evicted blocks and checkpoints are
gathered from the cache tensors into pages and saved to the KV connector; a lookup's
loads are scattered back once the connector says they are in place.

Ordering. A block is gathered while the pool reclaims it, before ``take`` returns, so
nothing has written it yet; the gather is a copy on the current stream, so later writes
(the step's forward) come after it, and the connector reads the gathered copy, which
its handle keeps alive. A load is awaited (``TransferHandle.wait``) before its bytes
are scattered into the cache, and a block is named only after that, so nothing reads
it before; a failed load names nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..offload import KVConnector, TransferHandle
from ..prefix_cache import PrefixCacheCounters
from ._pages import PAGE_FORMAT, PageSharing, block_matrix, canonical_page_id

__all__ = ["Offloader"]

_POLL_EVERY = 64
"""Save batches in flight are polled (and the done ones dropped) every this many."""


class Offloader:
    """Moves pages between the cache tensors and a ``KVConnector``.

    Args:
        connector: the store.
        kv_caches: the runtime's layer tensors.
        layers: group id -> its layers (the groups that offload).
        num_kernel_blocks: group id -> its kernel blocks (a state group: its pages).
        namespaces, sharing: group id -> its namespace and ``PageSharing``.
        counters: the prefix cache's counters (saves, loads, failures).
    """

    def __init__(
        self,
        connector: KVConnector,
        kv_caches: Mapping[str, tuple[torch.Tensor, ...]],
        layers: Mapping[int, Sequence[str]],
        num_kernel_blocks: Mapping[int, int],
        namespaces: Mapping[int, bytes],
        sharing: Mapping[int, PageSharing],
        counters: PrefixCacheCounters,
    ) -> None:
        self.connector = connector
        self._namespaces = dict(namespaces)
        self._sharing = dict(sharing)
        self._counters = counters
        self.epoch = 0
        """Bumped by ``reset_prefix_cache``: pages saved before never load again."""
        self._rows: dict[int, list[torch.Tensor]] = {}
        """Group id -> its tensors as byte matrices ``[kernel blocks, bytes per block]``."""
        self.page_bytes: dict[int, int] = {}
        for gid, names in layers.items():
            nb = num_kernel_blocks[gid]
            mats: list[torch.Tensor] = []
            for name in names:
                for index, t in enumerate(kv_caches[name]):
                    matrix = block_matrix(t, nb)
                    if matrix is None:
                        raise InvalidArgumentError(
                            f"kv_connector: layer {name!r} cache tensor {index} (shape "
                            f"{tuple(t.shape)}, strides {tuple(t.stride())}) is not "
                            f"{nb} kernel blocks of contiguous bytes; it cannot be offloaded"
                        )
                    mats.append(matrix)
            self._rows[gid] = mats
            self.page_bytes[gid] = sum(int(m.shape[1]) for m in mats)
        self._in_flight: list[TransferHandle] = []
        self._hashers: dict[int, tuple[int, Any, bytes]] = {}
        self._staged: dict[int, tuple[torch.Tensor | None, TransferHandle | None]] = {}
        """Group id -> its staging buffer for saves and the handle of its last batch."""
        self._parts: dict[int, list[torch.Tensor]] = {}
        self._saves = 0
        self.device = next(iter(kv_caches.values()))[0].device if kv_caches else None

    def key(self, group_id: int, name: bytes) -> bytes:
        """``canonical_page_id`` of group ``group_id``'s block ``name`` (the hash of its
        constant parts made once per group and epoch, then copied)."""
        made = self._hashers.get(group_id)
        if made is None or made[0] != self.epoch:
            made = self._hasher(group_id)
            self._hashers[group_id] = made
        _, base, tail = made
        h = base.copy()
        h.update(len(name).to_bytes(4, "little") + name + tail)
        return bytes(h.digest())

    def _hasher(self, group_id: int) -> tuple[int, Any, bytes]:
        namespace, sharing, epoch = self._namespaces[group_id], self._sharing[group_id], self.epoch
        base = hashlib.sha256(PAGE_FORMAT)
        base.update(len(namespace).to_bytes(4, "little") + namespace)
        tag = sharing.tag()
        ep = epoch.to_bytes(8, "little") if epoch else b""
        tail = len(tag).to_bytes(4, "little") + tag + len(ep).to_bytes(4, "little") + ep
        check = base.copy()  # made once per group: the shortcut agrees with the definition
        check.update(len(b"x").to_bytes(4, "little") + b"x" + tail)
        assert check.digest() == canonical_page_id(namespace, b"x", sharing, epoch=epoch)
        return epoch, base, tail

    # ------------------------------------------------------------------ saves

    def save(self, evicted: list[tuple[int, int, bytes]]) -> None:
        """Gather and save evicted blocks (``CachedPool.offload_sink``)."""
        by_group: dict[int, tuple[list[int], list[bytes]]] = {}
        for gid, block, name in evicted:
            if gid in self._rows:
                blocks, names = by_group.setdefault(gid, ([], []))
                blocks.append(block)
                names.append(name)
        for gid, (blocks, names) in by_group.items():
            pages = self._gather_staged(gid, blocks)
            keys = [self.key(gid, name) for name in names]
            handle = self.connector.submit_save_batch(keys, pages)
            self._staged[gid] = (self._staged[gid][0], handle)
            self._in_flight.append(handle)
            self._counters.record_offload(saved=len(names))
            self._saves += 1
        if self._saves >= _POLL_EVERY:
            self._saves = 0
            self._in_flight = [h for h in self._in_flight if not h.done()]

    def _gather_staged(self, group_id: int, blocks: Sequence[int]) -> torch.Tensor:
        """``gather`` into the group's staging buffer, reused once the connector is done
        with its last batch (a new one otherwise): no allocation per eviction."""
        n = len(blocks)
        staged, handle = self._staged.get(group_id, (None, None))
        busy = handle is not None and not handle.done()
        if staged is None or staged.shape[0] < n or busy:
            # Grown by doubling when too small; a busy one is left to the connector.
            rows = max(n, 16 if staged is None or busy else 2 * staged.shape[0])
            staged = torch.empty(
                (rows, self.page_bytes[group_id]),
                dtype=torch.uint8,
                device=self._rows[group_id][0].device,
            )
            self._parts[group_id] = [
                torch.empty((rows, int(m.shape[1])), dtype=torch.uint8, device=m.device)
                for m in self._rows[group_id]
            ]
        self._staged[group_id] = (staged, None)
        out = staged[:n]
        index = torch.tensor(blocks, dtype=torch.long, device=staged.device)
        mats = self._rows[group_id]
        if len(mats) == 1:
            torch.index_select(mats[0], 0, index, out=out)
            return out
        parts = [part[:n] for part in self._parts[group_id]]
        for m, part in zip(mats, parts, strict=True):
            torch.index_select(m, 0, index, out=part)
        torch.cat(parts, dim=1, out=out)
        return out

    def gather(self, group_id: int, blocks: Sequence[int]) -> torch.Tensor:
        """``[len(blocks), page_bytes]`` uint8: each block's page (a copy)."""
        mats = self._rows[group_id]
        index = torch.tensor(blocks, dtype=torch.long, device=mats[0].device)
        if len(mats) == 1:
            return mats[0].index_select(0, index)
        return torch.cat([m.index_select(0, index) for m in mats], dim=1)

    def scatter(self, group_id: int, blocks: Sequence[int], pages: torch.Tensor) -> None:
        """Write ``pages`` (``[len(blocks), page_bytes]``) into ``blocks``."""
        start = 0
        for m in self._rows[group_id]:
            width = int(m.shape[1])
            # A row copy per block: ``index_copy_`` of wide uint8 rows costs several
            # times more on CPU.
            for i, block in enumerate(blocks):
                m[block].copy_(pages[i, start : start + width])
            start += width

    # ------------------------------------------------------------------ loads (OffloadHooks)

    def contains(self, group_id: int, name: bytes) -> bool:
        return group_id in self._rows and self.connector.contains(self.key(group_id, name))

    def load(self, group_id: int, blocks: Sequence[int], names: Sequence[bytes]) -> list[bool]:
        """Load ``names`` into ``blocks``, awaited; ``True`` where the bytes are in place."""
        if not blocks:
            return []
        mats = self._rows[group_id]
        pages = torch.empty(
            (len(blocks), self.page_bytes[group_id]), dtype=torch.uint8, device=mats[0].device
        )
        handles = self.connector.submit_load_batch([self.key(group_id, n) for n in names], pages)
        ok = [bool(h.wait()) for h in handles]  # never scatter before the copy is done
        good = [i for i, fine in enumerate(ok) if fine]
        if good:
            rows = pages if len(good) == len(ok) else pages[good]
            self.scatter(group_id, [blocks[i] for i in good], rows)
        return ok

    def wait_saves(self) -> None:
        """Block until every save in flight is done."""
        for handle in self._in_flight:
            handle.wait()
        self._in_flight.clear()
