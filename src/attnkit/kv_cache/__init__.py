"""Paged KV cache: grouping, page-size unification, the block pool, block tables,
slot mapping and allocation.

Letters: NB = pages in the pool, P = the unified page size in bytes, BS = a group's
(kernel) block size, k = a group's kernel blocks per page.

The package: ``_groups`` (grouping and page-size unification), ``_pool`` (the block
pool of pages and the per-group slabs of kernel blocks), ``_cached`` (the pool and the
slabs with prefix caching on: ref-counted blocks that keep their names), ``_prefix``
(the prefix cache: lookups, hits, when blocks get names), ``_manager`` (the block
manager and its per-request tables), ``_buffers`` (the layer buffers, the budget and
the cache tensors).

Grouping
    Layers with equal specs share a ``KVCacheGroup`` (one block table per request per
    group, one metadata build per step per group). Different kinds never share a
    group, since their specs differ.

Page-size unification (one pool serves every group)
    The pool's unit is a page of ``P`` bytes, one page id in every group. ``P`` is
    chosen so that each attention group's page is a whole number of its blocks and
    each Mamba group's (fixed) state fits in ``P``:

    * ``L`` = least common multiple of the attention groups' page sizes;
    * ``M`` = the largest Mamba page (0 without Mamba groups);
    * ``P`` = the smallest multiple of ``L`` that is >= ``M`` (``P = M`` without
      attention groups);
    * an attention group keeps its declared ``block_size`` (the kernels' block, what
      backends, builders and metadata see) and a page holds ``k = P / page`` of its
      kernel blocks (``KVCacheGroup.blocks_per_page``); a Mamba group's page is
      padded to ``P`` (``k = 1``).

    Kernel block ``j`` of page ``p`` is kernel block ``p * k + j``: its bytes are the
    ``j``-th ``P / k`` bytes of the page, so a layer's cache tensor is the page bytes
    viewed at kernel-block granularity (``[NB * k, 2, BS, Hkv, D]`` interleaved,
    ``[NB * k, BS, D]`` MLA, planes of ``NB * k * BS`` rows). Encoder-only groups keep
    no cache and take no part.

Shared block ids (DeepSeek sparse attention)
    A group whose kind shares block ids (``KindRules.shares_blocks_with``: the indexer)
    is paired with its owner (the one MLA group of its block size) and comes after the
    groups that own their blocks. It allocates nothing: a request's table is the
    owner's (the manager holds only owning groups). Its pages are not unified: its
    layers keep buffers of their own, ``[NB * k, BS, W]`` with ``k`` the owner's
    kernel blocks per page, so every tensor stays contiguous, and each page of the
    pool costs ``shared_bytes_per_page`` more.

Two-level allocation
    A group with ``k == 1`` takes pages from the pool as its blocks. A group with
    ``k > 1`` takes kernel blocks from its ``PageSlab``: the pages it holds; the slab
    takes a page from the pool when none of its pages has a free kernel block and
    gives a page back when all its kernel blocks are free, so a page belongs to one
    group at a time. A step is checked in pages before anything changes (the manager's
    ``_check_pages``).

Memory: two sets of aliased layer buffers
    A page is owned by exactly one group at a time (one pool serves every group),
    so groups can share memory: layer ``j`` of every group views the ``j``-th byte
    buffer of ``NB * P`` bytes of its group's *buffer set*:

    * page-major set (``"interleaved"`` layout: attention, MLA and state groups): a
      buffer is ``[NB, P]``; page ``b`` is bytes ``[b*P, (b+1)*P)``, laid out as the
      group's page (its ``k`` kernel blocks of K and V back to back, MLA latents, a
      request's states);
    * planes set (``"planes"`` layout): a buffer's first half is the K plane and its
      second half the V plane, each ``[NB * k * BS, Hkv, D]`` token-major (row =
      slot); page ``c``'s K rows are bytes ``[c*P/2, (c+1)*P/2)`` of the first half and
      its V rows the same range of the second half (a page's rows fill exactly half a
      page).

    The two sets cannot alias each other: in one buffer, page-major page ``b``
    (bytes ``[b*P, (b+1)*P)``) is the K rows of plane pages ``2b`` and ``2b+1``, so two
    groups owning different pages would write the same bytes. Within a set every group
    puts page ``c`` at the same bytes, so ownership keeps them apart. The memory is
    ``NB * P * (max layers per page-major group + max layers per planes group)``; a
    model with one set costs what it always did.

Block ownership
    Page 0 is the null page: never handed out, so kernel blocks ``0 .. k-1`` are null
    in every group; kernel block 0 pads block tables and stands for blocks a
    sliding-window or chunked-local group has released.

Prefix caching (off by default; ``_cached`` and ``_prefix``)
    Kernel blocks are ref-counted; a full block a request computed is named by its
    content and, once free, stays in its group's map until evicted, so a later
    request's table can point at it. A page stays with its group while a block in it
    is live or named; free pages are used before cached ones are evicted. The step
    check counts the hits, releases and frees first, so it stays exact.
"""

from ..errors import OutOfBlocksError
from ._buffers import (
    BufferSetName,
    allocate_kv_cache_tensors,
    buffer_set_of,
    buffers_per_set,
    cache_buffer,
    num_blocks_for_budget,
    shared_bytes_per_page,
)
from ._cached import EVICTED_MEMORY, CachedPool, CachedSlab
from ._checkpoints import CheckpointStore
from ._groups import KVCacheGroup, group_layers, unified_groups, unify_page_sizes
from ._manager import KVCacheManager
from ._pool import NULL_BLOCK, BlockPool, PageSlab
from ._prefix import PrefixCache, PrefixMatch

__all__ = [
    "EVICTED_MEMORY",
    "NULL_BLOCK",
    "BlockPool",
    "BufferSetName",
    "CachedPool",
    "CachedSlab",
    "CheckpointStore",
    "KVCacheGroup",
    "KVCacheManager",
    "OutOfBlocksError",
    "PageSlab",
    "PrefixCache",
    "PrefixMatch",
    "allocate_kv_cache_tensors",
    "buffer_set_of",
    "buffers_per_set",
    "cache_buffer",
    "group_layers",
    "num_blocks_for_budget",
    "shared_bytes_per_page",
    "unified_groups",
    "unify_page_sizes",
]
