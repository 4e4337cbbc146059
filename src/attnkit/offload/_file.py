"""``FileTier``: one file per page under a directory (a store that outlives the
process, and the second ``KVConnector``)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import torch
from typing_extensions import override

from ..errors import ArgumentTypeError
from ._connector import ConnectorStats, DoneHandle, KVConnector, TransferHandle
from ._host import _check_page

__all__ = ["FileTier"]

_MAGIC = b"attnkit-page-v1\n"


class FileTier(KVConnector):
    """Pages as files ``<directory>/<key hex>.page``: a header (magic, the key, the
    size) then the bytes, written to a temporary name and renamed, so a reader never
    sees half a page. Synchronous: every handle is done when returned. A file whose
    header does not match (another key, a truncated write) fails its load.

    Args:
        directory: where the pages go (made if missing).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        given: object = directory
        if not isinstance(given, str | os.PathLike):
            raise ArgumentTypeError(
                f"directory must be a str or os.PathLike, got {type(given).__name__}"
            )
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._stats = ConnectorStats()

    def _path(self, key: bytes) -> Path:
        # Keys can be long: a digest names the file, the header holds the key itself.
        return self.directory / f"{hashlib.sha256(key).hexdigest()}.page"

    def _count(self, **changes: int) -> None:
        s = self._stats
        self._stats = dataclasses.replace(
            s, **{name: getattr(s, name) + change for name, change in changes.items()}
        )

    @override
    def contains(self, key: bytes) -> bool:
        return self._path(key).exists()

    @override
    def submit_save(self, key: bytes, data: torch.Tensor) -> TransferHandle:
        _check_page("data", data)
        self._count(saves=1)
        path = self._path(key)
        if path.exists():
            return DoneHandle(True)
        header = _MAGIC + len(key).to_bytes(4, "little") + key + data.numel().to_bytes(8, "little")
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(data.cpu().numpy().tobytes())
        os.replace(tmp, path)
        return DoneHandle(True)

    @override
    def submit_load(self, key: bytes, out: torch.Tensor) -> TransferHandle:
        _check_page("out", out)
        self._count(loads=1)
        try:
            raw = self._path(key).read_bytes()
        except OSError:
            self._count(load_failures=1)
            return DoneHandle(False)
        header = _MAGIC + len(key).to_bytes(4, "little") + key + out.numel().to_bytes(8, "little")
        if not raw.startswith(header) or len(raw) != len(header) + out.numel():
            self._count(load_failures=1)
            return DoneHandle(False)
        body = torch.frombuffer(bytearray(raw[len(header) :]), dtype=torch.uint8)
        out.copy_(body)
        return DoneHandle(True)

    @override
    def stats(self) -> ConnectorStats:
        files = list(self.directory.glob("*.page"))
        return dataclasses.replace(
            self._stats, pages=len(files), bytes=sum(f.stat().st_size for f in files)
        )
