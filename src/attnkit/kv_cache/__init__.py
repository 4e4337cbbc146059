"""Paged KV cache: grouping, page-size unification, the block pool, block tables,
slot mapping and allocation.

Letters: NB = blocks in the pool, P = the unified page size in bytes, BS = a group's
block size.

The package: ``_groups`` (grouping and page-size unification), ``_pool`` (the block
pool), ``_manager`` (the block manager and its per-request tables), ``_buffers`` (the
layer buffers, the budget and the cache tensors).

Grouping
    Layers with equal specs share a ``KVCacheGroup`` (one block table per request per
    group, one metadata build per step per group). Different kinds never share a
    group, since their specs differ.

Page-size unification (one pool serves every group)
    Every block id names one page of ``P`` bytes in every group. ``P`` is chosen so
    that each attention group's page is exactly ``P`` after scaling its block size by
    an integer, and each Mamba group's (fixed) state fits in ``P``:

    * ``L`` = least common multiple of the attention groups' page sizes;
    * ``M`` = the largest Mamba page (0 without Mamba groups);
    * ``P`` = the smallest multiple of ``L`` that is >= ``M`` (``P = M`` without
      attention groups);
    * an attention group's ``block_size`` is multiplied by ``P / page``; a Mamba
      group's page is padded to ``P``.

    Encoder-only groups keep no cache and take no part. Scaling changes the block
    size the backends are asked to serve, so selection happens after unification and
    a backend that cannot serve the scaled size says so.

Memory: two sets of aliased layer buffers
    A block id is owned by exactly one group at a time (one pool serves every group),
    so groups can share memory: layer ``j`` of every group views the ``j``-th byte
    buffer of ``NB * P`` bytes of its group's *buffer set*:

    * page-major set (``"interleaved"`` layout: attention, MLA and state groups): a
      buffer is ``[NB, P]``; block ``b`` is bytes ``[b*P, (b+1)*P)``, laid out as the
      group's page (K and V of the block, an MLA latent page, a request's states);
    * planes set (``"planes"`` layout): a buffer's first half is the K plane and its
      second half the V plane, each ``[NB * BS, Hkv, D]`` token-major; block ``c``'s
      K rows are bytes ``[c*P/2, (c+1)*P/2)`` of the first half and its V rows the same
      range of the second half (a block's rows fill exactly half a page).

    The two sets cannot alias each other: in one buffer, page-major block ``b``
    (bytes ``[b*P, (b+1)*P)``) is the K rows of plane blocks ``2b`` and ``2b+1``, so two
    groups owning different blocks would write the same bytes. Within a set every group
    puts block ``c`` at the same bytes, so ownership keeps them apart. The memory is
    ``NB * P * (max layers per page-major group + max layers per planes group)``; a
    model with one set costs what it always did.

Block ownership
    Block 0 is the null block: never handed out, used to pad block tables and to stand
    for blocks a sliding-window or chunked-local group has released.
"""

from ..errors import OutOfBlocksError
from ._buffers import (
    BufferSetName,
    allocate_kv_cache_tensors,
    buffer_set_of,
    buffers_per_set,
    cache_buffer,
    num_blocks_for_budget,
)
from ._groups import KVCacheGroup, group_layers, unified_groups, unify_page_sizes
from ._manager import KVCacheManager
from ._pool import NULL_BLOCK, BlockPool

__all__ = [
    "NULL_BLOCK",
    "BlockPool",
    "BufferSetName",
    "KVCacheGroup",
    "KVCacheManager",
    "OutOfBlocksError",
    "allocate_kv_cache_tensors",
    "buffer_set_of",
    "buffers_per_set",
    "cache_buffer",
    "group_layers",
    "num_blocks_for_budget",
    "unified_groups",
    "unify_page_sizes",
]
