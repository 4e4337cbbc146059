"""The runtime's side of offload (docs/offload.md): evicted blocks and checkpoints are
gathered from the cache tensors into pages and saved to the KV connector; a lookup's
loads are scattered back once the connector says they are in place.

Ordering. The pool hands each eviction to ``save``, which only logs it: nothing is
copied inside the allocation (``begin_step``) that evicts. A reused block is written
only by the step's layer calls, a lookup's load or a state copy, and each of those
calls ``fence`` first: one gather per cache tensor of everything logged (the
*snapshot*, into staging rows; on CUDA queued on the current stream, so the writes
queue after it), before the write. The canonical ids and the connector's copy of the
rows follow, on the worker thread when the connector asks for it
(``KVConnector.saves_in_background``; on CUDA after the gathers' event), else before
``fence`` returns. Staging rows are reused only once their job and the connector's
handle are done. A load waits for a queued save of its name, is awaited
(``TransferHandle.wait``) before its bytes are scattered into the cache, and a block is
named only after that, so nothing reads it before; a failed load names nothing.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..offload import ConnectorStats, KVConnector, TransferHandle
from ..prefix_cache import PrefixCacheCounters
from ._pages import PAGE_FORMAT, PageSharing, block_matrix, canonical_page_id

__all__ = ["Offloader"]

_POLL_EVERY = 64
"""Jobs and handles in flight are polled (and the done ones dropped) every this many."""

_CUDA: Any = torch.cuda
"""``torch.cuda``, whose ``Event`` is untyped: called through ``Any``."""


class _Worker:
    """The one thread every runtime's saves finish on: per job the canonical ids, the
    join of a group's parts and the connector's copy. Started at the first job; a job
    holds its runtime only while it is queued, so an idle runtime is not kept alive."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_SaveJob] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: _SaveJob) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._loop, name="attnkit-offload", daemon=True
                    )
                    self._thread.start()
        self._jobs.put(job)

    def _loop(self) -> None:
        jobs = self._jobs
        while True:
            job = jobs.get()
            owner, job.owner = job.owner, None
            if owner is not None:
                # Staging rows made under the caller's inference mode are inference
                # tensors; inside it, the worker may write them and ordinary ones alike.
                with torch.inference_mode():
                    owner.finish(job)
            del job, owner


_WORKER = _Worker()


class _Staging:
    """A group's staging rows: ``pages`` ``[rows, page bytes]`` and, for a group of
    several cache tensors, one part per tensor (gathered first, then joined)."""

    __slots__ = ("handle", "job", "pages", "parts")

    def __init__(self, pages: torch.Tensor, parts: list[torch.Tensor]) -> None:
        self.pages, self.parts = pages, parts
        self.job: _SaveJob | None = None
        self.handle: TransferHandle | None = None

    def busy(self) -> bool:
        """Whether a job or the connector may still read these rows."""
        if self.job is not None and not self.job.finished.is_set():
            return True
        return self.handle is not None and not self.handle.done()


class _SaveJob:
    """One fence's evictions, snapshotted: per group its names and staging rows, saved
    under ``epoch``; ``finished`` once the connector has them (or raised)."""

    __slots__ = ("epoch", "finished", "gathered", "groups", "owner")

    def __init__(self, owner: Offloader, epoch: int) -> None:
        self.owner: Offloader | None = owner
        self.epoch = epoch
        self.groups: list[tuple[int, list[bytes], torch.Tensor, list[torch.Tensor], _Staging]] = []
        """Per group: its id, names, page rows, parts to join into them (or none) and
        the staging they are rows of."""
        self.finished = threading.Event()
        self.gathered: Any = None
        """CUDA: the event after the gathers on the stream that queued them."""


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
        self._hashers: dict[tuple[int, int], tuple[Any, bytes]] = {}
        self._staged: dict[int, _Staging] = {}
        self._log: list[tuple[int, int, bytes]] = []
        """Evictions logged since the last ``fence``: ``(group id, block, name)``."""
        self._queued: dict[tuple[int, bytes], _SaveJob] = {}
        """Blocks in a job on the worker that the connector may not have yet, so
        ``contains`` counts them and a load waits for them (the log counts too)."""
        self._jobs: list[_SaveJob] = []
        """Jobs not known to be finished."""
        self._lock = threading.Lock()
        """Held around every connector call: the worker's and the lookups' never overlap."""
        self._fences = 0
        self.save_error: BaseException | None = None
        """The first error the connector raised in a save since the last ``drain``
        (those pages are not saved: their hits recompute); ``drain`` raises it."""
        self.save_errors = 0
        """Saves that raised, in all."""
        self.device = next(iter(kv_caches.values()))[0].device if kv_caches else None
        self._cuda = self.device is not None and self.device.type == "cuda"
        self._background = self.device is not None and connector.saves_in_background(self.device)
        """Whether a fence's ids and connector copy run on the worker thread (the
        connector says: ``KVConnector.saves_in_background``) or before it returns."""

    @property
    def needs_fence(self) -> bool:
        """Whether a block was evicted and is not snapshotted yet."""
        return bool(self._log)

    def key(self, group_id: int, name: bytes, epoch: int | None = None) -> bytes:
        """``canonical_page_id`` of group ``group_id``'s block ``name`` (the hash of its
        constant parts made once per group and epoch, then copied)."""
        ep = self.epoch if epoch is None else epoch
        made = self._hashers.get((group_id, ep))
        if made is None:
            made = self._hasher(group_id, ep)
            self._hashers[group_id, ep] = made
        base, tail = made
        h = base.copy()
        h.update(len(name).to_bytes(4, "little") + name + tail)
        return bytes(h.digest())

    def _hasher(self, group_id: int, epoch: int) -> tuple[Any, bytes]:
        namespace, sharing = self._namespaces[group_id], self._sharing[group_id]
        base = hashlib.sha256(PAGE_FORMAT)
        base.update(len(namespace).to_bytes(4, "little") + namespace)
        tag = sharing.tag()
        ep = epoch.to_bytes(8, "little") if epoch else b""
        tail = len(tag).to_bytes(4, "little") + tag + len(ep).to_bytes(4, "little") + ep
        check = base.copy()  # made once per group: the shortcut agrees with the definition
        check.update(len(b"x").to_bytes(4, "little") + b"x" + tail)
        assert check.digest() == canonical_page_id(namespace, b"x", sharing, epoch=epoch)
        return base, tail

    # ------------------------------------------------------------------ saves

    def save(self, evicted: list[tuple[int, int, bytes]]) -> None:
        """Log evicted blocks (``CachedPool.offload_sink``; the pool logs only the groups
        that offload); ``fence`` saves them."""
        self._log.extend(evicted)

    def fence(self) -> None:
        """Copy out the bytes of every block evicted since the last fence (before any
        write to a reused block: the layer calls, a load's scatter, a state copy): one
        gather per cache tensor into staging rows (on CUDA queued on the current
        stream, so the writes queue after it), then the worker makes the ids and hands
        the rows to the connector."""
        if not self._log:
            return
        log, self._log = self._log, []
        self._counters.record_offload(saved=len(log))
        by_group: dict[int, tuple[list[int], list[bytes]]] = {}
        for gid, block, name in log:
            blocks, names = by_group.setdefault(gid, ([], []))
            blocks.append(block)
            names.append(name)
        job = _SaveJob(self, self.epoch)
        queued = self._queued
        for gid, (blocks, names) in by_group.items():
            pages, parts, staging = self._snapshot(gid, blocks)
            staging.job = job
            job.groups.append((gid, names, pages, parts, staging))
            if self._background:
                for name in names:
                    queued[gid, name] = job
        if self._cuda and self._background:
            # The worker's calls are on its own stream: it waits for the gathers first.
            # (Inline, the connector orders its copy after the current stream's work.)
            job.gathered = _CUDA.Event()
            job.gathered.record(_CUDA.current_stream(self.device))
        self._jobs.append(job)
        if self._background:
            _WORKER.submit(job)
        else:
            job.owner = None
            self.finish(job)
        self._fences += 1
        if self._fences >= _POLL_EVERY:
            self._fences = 0
            self._jobs = [j for j in self._jobs if not j.finished.is_set()]
            done = [k for k, j in queued.items() if j.finished.is_set()]
            for k in done:
                del queued[k]

    def drain(self) -> None:
        """Return once the connector has every save (its handles may still run); the
        first error the connector raised in the worker is raised here."""
        self.fence()
        for job in self._jobs:
            job.finished.wait()
        self._jobs.clear()
        self._queued.clear()
        error, self.save_error = self.save_error, None
        if error is not None:
            raise error

    def finish(self, job: _SaveJob) -> None:
        """The worker's part of a job: the ids, the join of a group's parts and the
        connector's copy."""
        try:
            if job.gathered is not None:
                job.gathered.synchronize()  # the connector's copy reads finished rows
            for gid, names, pages, parts, staging in job.groups:
                if parts:
                    torch.cat(parts, dim=1, out=pages)
                keys = [self.key(gid, name, job.epoch) for name in names]
                with self._lock:
                    staging.handle = self.connector.submit_save_batch(keys, pages)
                self._in_flight.append(staging.handle)
            if len(self._in_flight) >= _POLL_EVERY:
                with self._lock:
                    self._in_flight = [h for h in self._in_flight if not h.done()]
        except Exception as exc:  # those pages are not saved: their hits recompute
            self.save_errors += 1
            if self.save_error is None:
                self.save_error = exc
        finally:
            job.finished.set()

    def _snapshot(
        self, group_id: int, blocks: list[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor], _Staging]:
        """Gather ``blocks`` of group ``group_id`` into free staging rows: the rows, the
        per-tensor parts still to join into them (none for one tensor), the staging."""
        n = len(blocks)
        staging = self._staging(group_id, n)
        mats = self._rows[group_id]
        index = torch.tensor(blocks, dtype=torch.long)
        if self._cuda:
            index = index.to(mats[0].device, non_blocking=True)
        pages = staging.pages[:n]
        if len(mats) == 1:
            torch.index_select(mats[0], 0, index, out=pages)
            return pages, [], staging
        parts = [part[:n] for part in staging.parts]
        for m, part in zip(mats, parts, strict=True):
            torch.index_select(m, 0, index, out=part)
        return pages, parts, staging

    def _staging(self, group_id: int, n: int) -> _Staging:
        """Group ``group_id``'s staging rows for ``n`` pages: the last ones when free and
        large enough, new ones otherwise (grown by doubling; busy ones are left to their
        job and the connector)."""
        staging = self._staged.get(group_id)
        busy = staging is None or staging.busy()
        if staging is not None and not busy and staging.pages.shape[0] >= n:
            return staging
        rows = max(n, 16 if staging is None or busy else 2 * int(staging.pages.shape[0]))
        mats = self._rows[group_id]
        device = mats[0].device
        pages = torch.empty((rows, self.page_bytes[group_id]), dtype=torch.uint8, device=device)
        parts = (
            [torch.empty((rows, int(m.shape[1])), dtype=torch.uint8, device=device) for m in mats]
            if len(mats) > 1
            else []
        )
        staging = self._staged[group_id] = _Staging(pages, parts)
        return staging

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

    def _is_queued(self, group_id: int, name: bytes) -> _SaveJob | bool | None:
        """The job saving ``name`` if the connector may not have it yet (``None``: logged,
        not snapshotted yet), ``False`` when none does."""
        key = (group_id, name)
        job = self._queued.get(key)
        if job is not None:
            if not job.finished.is_set():
                return job
            del self._queued[key]
        if self._log and any(g == group_id and n == name for g, _, n in self._log):
            return None  # (the log is short: a step's evictions until its first write)
        return False

    def contains(self, group_id: int, name: bytes) -> bool:
        if group_id not in self._rows:
            return False
        if self._is_queued(group_id, name) is not False:
            return True  # its save is queued: a load waits for it
        key = self.key(group_id, name)
        with self._lock:
            return self.connector.contains(key)

    def load(self, group_id: int, blocks: Sequence[int], names: Sequence[bytes]) -> list[bool]:
        """Load ``names`` into ``blocks``, awaited; ``True`` where the bytes are in place."""
        if not blocks:
            return []
        # The blocks loaded into may have just been evicted (the lookup took them):
        # their bytes are copied out first; a name whose save is queued waits for it.
        self.fence()
        for name in names:
            job = self._is_queued(group_id, name)
            if isinstance(job, _SaveJob):
                job.finished.wait()
        mats = self._rows[group_id]
        pages = torch.empty(
            (len(blocks), self.page_bytes[group_id]), dtype=torch.uint8, device=mats[0].device
        )
        keys = [self.key(group_id, n) for n in names]
        with self._lock:
            handles = self.connector.submit_load_batch(keys, pages)
            ok = [bool(h.wait()) for h in handles]  # never scatter before the copy is done
        good = [i for i, fine in enumerate(ok) if fine]
        if good:
            rows = pages if len(good) == len(ok) else pages[good]
            self.scatter(group_id, [blocks[i] for i in good], rows)
        return ok

    def bump_epoch(self) -> None:
        """``reset_prefix_cache``: what was evicted before is saved under the old epoch,
        and no page saved before loads again."""
        self.fence()
        self._queued.clear()  # saved under the old epoch: no load of the new one waits
        self.epoch += 1

    def stats(self) -> ConnectorStats:
        with self._lock:
            return self.connector.stats()

    def wait_saves(self) -> None:
        """Block until every save is done (the connector's handles included)."""
        self.drain()
        with self._lock:
            in_flight, self._in_flight = self._in_flight, []
            for handle in in_flight:
                handle.wait()
