"""KV connectors: where evicted prefix-cache pages go and come back from
(docs/offload.md).

A page is the bytes one kernel block of one group holds over all the group's layers
(a state checkpoint: one state page), a flat ``uint8`` tensor, keyed by its canonical
page id (``attnkit.PageDescriptors``). ``KVConnector`` is the interface an external
store implements (save, load, contains; asynchronous through ``TransferHandle``);
``HostMemoryTier`` (a bounded host-memory pool with its own LRU, pinned on CUDA) and
``FileTier`` (one file per page) are the built-in ones.
"""

from ._connector import ConnectorStats, DoneHandle, KVConnector, TransferHandle
from ._file import FileTier
from ._host import HostMemoryTier

__all__ = [
    "ConnectorStats",
    "DoneHandle",
    "FileTier",
    "HostMemoryTier",
    "KVConnector",
    "TransferHandle",
]
