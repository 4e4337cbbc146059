"""A fault-injecting KV connector for the offload tests and the soak: transfers that
complete late, loads that fail, garbage in a load's destination until it is done."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from attnkit import HostMemoryTier, KVConnector, TransferHandle
from attnkit.offload import DoneHandle


class _Deferred(TransferHandle):
    """A transfer that happens at ``wait()`` (or once polled ``delay`` times)."""

    def __init__(self, run: Any, delay: int) -> None:
        self._run, self._delay, self._ok = run, delay, None

    def _finish(self) -> bool:
        if self._ok is None:
            self._ok = bool(self._run())
        return self._ok

    @override
    def done(self) -> bool:
        self._delay -= 1
        if self._delay <= 0:
            self._finish()
            return True
        return False

    @override
    def wait(self) -> bool:
        return self._finish()


class FaultyTier(KVConnector):
    """A host tier whose saves and loads complete late (at ``wait`` or after polls),
    whose every ``fail_every``-th load fails, and which writes garbage (0xFF: NaN in
    float32) into a load's destination until the load is done."""

    def __init__(self, fail_every: int = 0, delay: int = 3) -> None:
        self.inner = HostMemoryTier(2**26)
        self.fail_every, self.delay = fail_every, delay
        self.loads = 0
        self.pending: dict[bytes, _Deferred] = {}

    @override
    def contains(self, key: bytes) -> bool:
        return key in self.pending or self.inner.contains(key)

    @override
    def submit_save(self, key: bytes, data: torch.Tensor) -> TransferHandle:
        handle = _Deferred(lambda: self.inner.submit_save(key, data).wait(), self.delay)
        self.pending[key] = handle
        return handle

    @override
    def submit_load(self, key: bytes, out: torch.Tensor) -> TransferHandle:
        saved = self.pending.pop(key, None)
        if saved is not None:
            saved.wait()  # a load waits for the save of its key
        self.loads += 1
        out.fill_(0xFF)
        if self.fail_every and self.loads % self.fail_every == 0:
            return DoneHandle(False)
        return _Deferred(lambda: self.inner.submit_load(key, out).wait(), self.delay)
