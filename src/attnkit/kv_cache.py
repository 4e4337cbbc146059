"""Paged KV cache: grouping, page-size unification, the block pool, block tables,
slot mapping and allocation.

Letters: NB = blocks in the pool, P = the unified page size in bytes, BS = a group's
block size.

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

Memory
    Layer ``j`` of every group shares the ``j``-th byte buffer of ``NB * P`` bytes: a
    block id is owned by exactly one group at a time, so the aliasing is safe, and the
    memory is ``NB * P * max(layers per group)``.

Block ownership
    Block 0 is the null block: never handed out, used to pad block tables and to stand
    for blocks a sliding-window or chunked-local group has released.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from ._validation import is_nonnegative_int, is_positive_int
from .errors import OutOfBlocksError
from .spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

__all__ = [
    "NULL_BLOCK",
    "BlockPool",
    "KVCacheGroup",
    "KVCacheManager",
    "OutOfBlocksError",
    "allocate_kv_cache_tensors",
    "group_layers",
    "num_blocks_for_budget",
    "unify_page_sizes",
]

NULL_BLOCK = 0
_ALIGN = 16  # byte alignment of each state tensor inside a page


@dataclasses.dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one spec, and so one block table per request.

    Attributes:
        group_id: index of the group.
        spec: the spec the backends see (block size possibly scaled by unification).
        layer_names: the group's layers, in model order.
        original_spec: the spec the layers declared.
    """

    group_id: int
    spec: KVCacheSpec
    layer_names: tuple[str, ...]
    original_spec: KVCacheSpec

    @property
    def kind(self) -> KVCacheSpecKind:
        return self.spec.kind

    @property
    def has_cache(self) -> bool:
        """Whether the group keeps anything between steps (encoder-only layers do not)."""
        return self.spec.kind is not KVCacheSpecKind.ENCODER_ONLY_ATTENTION


def group_layers(layer_specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroup]:
    """Group layers with equal specs, in order of first appearance.

    Raises:
        ValueError: if there are no layers, or a value is not a ``KVCacheSpec``.
    """
    if not layer_specs:
        raise ValueError("layer_specs must name at least one layer, got none")
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        if not isinstance(spec, KVCacheSpec):
            raise ValueError(
                f"layer_specs[{name!r}] must be a KVCacheSpec, got {type(spec).__name__}"
            )
        by_spec.setdefault(spec, []).append(name)
    return [
        KVCacheGroup(group_id=i, spec=spec, layer_names=tuple(names), original_spec=spec)
        for i, (spec, names) in enumerate(by_spec.items())
    ]


def unify_page_sizes(groups: Sequence[KVCacheGroup]) -> tuple[list[KVCacheGroup], int]:
    """Apply the unification rule of the module docstring.

    Returns:
        The groups with scaled specs, and the unified page size ``P`` in bytes
        (0 when no group keeps a cache).
    """
    cached = [g for g in groups if g.has_cache]
    attention_pages = [g.spec.page_size_bytes for g in cached if isinstance(g.spec, AttentionSpec)]
    mamba_pages = [g.spec.page_size_bytes for g in cached if isinstance(g.spec, MambaSpec)]
    largest_state = max(mamba_pages, default=0)
    if attention_pages:
        lcm = math.lcm(*attention_pages)
        page = lcm * max(1, math.ceil(largest_state / lcm))
    else:
        page = _round_up(largest_state, _ALIGN)
    unified: list[KVCacheGroup] = []
    for group in groups:
        spec = group.spec
        if group.has_cache and isinstance(spec, AttentionSpec):
            factor = page // spec.page_size_bytes
            spec = dataclasses.replace(spec, block_size=spec.block_size * factor)
        unified.append(dataclasses.replace(group, spec=spec))
    return unified, page


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def num_blocks_for_budget(
    groups: Sequence[KVCacheGroup], page_size_bytes: int, memory_budget_bytes: int
) -> int:
    """How many blocks (the null block included) fit in ``memory_budget_bytes``.

    Raises:
        ValueError: if the budget does not hold the null block and one more block.
    """
    if not is_positive_int(memory_budget_bytes):
        raise ValueError(f"memory_budget_bytes must be a positive int, got {memory_budget_bytes!r}")
    slots = max((len(g.layer_names) for g in groups if g.has_cache), default=0)
    if slots == 0 or page_size_bytes == 0:
        return 2  # nothing is cached: only the bookkeeping exists
    per_block = page_size_bytes * slots
    num_blocks = memory_budget_bytes // per_block
    if num_blocks < 2:
        raise ValueError(
            f"memory_budget_bytes={memory_budget_bytes} holds {num_blocks} block(s) of "
            f"{per_block} bytes ({slots} layer buffer(s) x page {page_size_bytes} B); "
            f"at least 2 are needed (the null block and one more), i.e. {2 * per_block} bytes"
        )
    return num_blocks


class BlockPool:
    """A fixed set of block ids; id 0 (the null block) is never handed out.

    ``allocate`` and ``free`` are O(1) per block. Every call either succeeds whole or
    raises and changes nothing.
    """

    def __init__(self, num_blocks: int) -> None:
        if not is_positive_int(num_blocks) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block 0 is reserved), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        # Popped from the end: low ids are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))
        self._in_use = bytearray(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def is_allocated(self, block: int) -> bool:
        return 0 < block < self.num_blocks and bool(self._in_use[block])

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks.

        Raises:
            OutOfBlocksError: if fewer than ``n`` are free (the pool is unchanged).
        """
        if not is_nonnegative_int(n):
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise OutOfBlocksError(
                f"need {n} free block(s) but only {len(self._free)} of {self.num_blocks - 1} are free"
            )
        taken = [self._free.pop() for _ in range(n)]
        for block in taken:
            self._in_use[block] = 1
        return taken

    def free(self, blocks: Iterable[int]) -> None:
        """Return blocks to the pool.

        Raises:
            ValueError: for the null block, an id out of range, a block that is not
                allocated, or one given twice (the pool is unchanged).
        """
        blocks = list(blocks)
        seen: set[int] = set()
        for block in blocks:
            if not (is_positive_int(block) and block < self.num_blocks):
                raise ValueError(
                    f"cannot free block {block!r}: ids run from 1 to {self.num_blocks - 1}"
                )
            if not self._in_use[block] or block in seen:
                raise ValueError(f"cannot free block {block}: it is not allocated (double free?)")
            seen.add(block)
        for block in blocks:
            self._in_use[block] = 0
            self._free.append(block)


@dataclasses.dataclass
class _Request:
    num_tokens: int = 0
    encoder_len: int = 0
    tables: list[list[int]] = dataclasses.field(default_factory=list[list[int]])


class KVCacheManager:
    """Per-request block tables of every group, over one ``BlockPool``.

    A request's table in a group maps its logical block ``i`` to a physical block.
    Attention groups grow their tables as tokens arrive; sliding-window and
    chunked-local groups release blocks that no present or future query can see
    (their entries become the null block); a Mamba group holds one block per request;
    a cross-attention group holds the request's encoder tokens; encoder-only groups
    hold nothing.
    """

    def __init__(self, groups: Sequence[KVCacheGroup], num_blocks: int) -> None:
        self.groups = tuple(groups)
        self.pool = BlockPool(num_blocks)
        self._requests: dict[str, _Request] = {}

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._requests

    def num_tokens(self, req_id: str) -> int:
        """Tokens of ``req_id`` whose K/V (or state) are in the cache after the last step."""
        return self._request(req_id).num_tokens

    def encoder_len(self, req_id: str) -> int:
        return self._request(req_id).encoder_len

    def block_table(self, group_id: int, req_id: str) -> list[int]:
        """A copy of ``req_id``'s table in group ``group_id``."""
        return list(self._request(req_id).tables[group_id])

    def owned_blocks(self) -> dict[str, set[int]]:
        """Request -> every non-null block it holds in any group (for checks)."""
        return {
            rid: {b for table in req.tables for b in table if b != NULL_BLOCK}
            for rid, req in self._requests.items()
        }

    def _request(self, req_id: str) -> _Request:
        try:
            return self._requests[req_id]
        except KeyError:
            raise KeyError(f"unknown request {req_id!r}") from None

    def _plan(self, group: KVCacheGroup, req: _Request, num_new: int) -> tuple[int, list[int]]:
        """(blocks to allocate, table indices to release) for ``num_new`` more tokens."""
        spec = group.spec
        table = req.tables[group.group_id]
        if not group.has_cache:
            return 0, []
        if isinstance(spec, MambaSpec):
            return (0 if table else 1), []
        if spec.kind is KVCacheSpecKind.CROSS_ATTENTION:
            return (0 if table else math.ceil(req.encoder_len / spec.block_size)), []
        shift = spec.sink_len if isinstance(spec, SinkFullAttentionSpec) else 0
        first = req.num_tokens + shift  # group position of the first new token
        end = first + num_new
        needed = math.ceil(end / spec.block_size) - len(table)
        first_live = 0
        if isinstance(spec, SlidingWindowSpec):
            first_live = max(0, first - spec.sliding_window + 1)
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            first_live = (first // spec.attention_chunk_size) * spec.attention_chunk_size
        dead = [i for i in range(first_live // spec.block_size) if table[i] != NULL_BLOCK]
        return max(needed, 0), dead

    def allocate_step(self, scheduled: Sequence[tuple[str, int, int]]) -> None:
        """Make room for one step: ``(req_id, num_new_tokens, encoder_len)`` per request.

        New request ids are added. Blocks that fall out of a window are released
        first. All or nothing: on ``OutOfBlocksError`` no table and no block changed.
        """
        plans: list[tuple[_Request, list[tuple[int, list[int]]], int]] = []
        total_new = total_released = 0
        for req_id, num_new, encoder_len in scheduled:
            req = self._requests.get(req_id) or _Request(
                encoder_len=encoder_len, tables=[[] for _ in self.groups]
            )
            per_group = [self._plan(g, req, num_new) for g in self.groups]
            total_new += sum(n for n, _ in per_group)
            total_released += sum(len(d) for _, d in per_group)
            plans.append((req, per_group, num_new))
        if total_new > self.pool.num_free_blocks + total_released:
            raise OutOfBlocksError(
                f"the step needs {total_new} new block(s) but only "
                f"{self.pool.num_free_blocks} are free (+{total_released} released by windows) "
                f"of {self.pool.num_blocks - 1}; nothing was allocated"
            )
        # Releases first, for every request: a request earlier in the batch may need
        # the blocks a later one releases.
        for req, per_group, _ in plans:
            for group, (_, dead) in zip(self.groups, per_group, strict=True):
                table = req.tables[group.group_id]
                self.pool.free(table[i] for i in dead)
                for i in dead:
                    table[i] = NULL_BLOCK
        for (req_id, _, _), (req, per_group, num_new) in zip(scheduled, plans, strict=True):
            for group, (count, _) in zip(self.groups, per_group, strict=True):
                req.tables[group.group_id].extend(self.pool.allocate(count))
            req.num_tokens += num_new
            self._requests[req_id] = req

    def free_request(self, req_id: str) -> None:
        """Release every block of ``req_id`` and forget it."""
        req = self._request(req_id)
        self.pool.free(b for table in req.tables for b in table if b != NULL_BLOCK)
        del self._requests[req_id]


def allocate_kv_cache_tensors(
    groups: Sequence[KVCacheGroup],
    shapes: Mapping[int, tuple[tuple[int, ...], ...]],
    *,
    num_blocks: int,
    page_size_bytes: int,
    device: torch.device,
    fill: float | None = None,
) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per-layer cache tensors, aliased across groups as the module docstring says.

    Args:
        groups: unified groups.
        shapes: group id -> the shapes its backend declares (``get_kv_cache_shapes``);
            each shape starts with ``num_blocks``.
        num_blocks, page_size_bytes: the pool's geometry.
        device: where the buffers live.
        fill: a value to fill every tensor with (tests use NaN to catch reads of
            unwritten slots); ``None`` leaves memory uninitialised. Block 0, the null
            block, is always zeroed.

    Raises:
        ValueError: if a group's tensors do not fit one page per block.
    """
    slots = max((len(g.layer_names) for g in groups if g.has_cache), default=0)
    buffers = [
        torch.empty((num_blocks, page_size_bytes), dtype=torch.uint8, device=device)
        for _ in range(slots)
    ]
    caches: dict[str, tuple[torch.Tensor, ...]] = {}
    for group in groups:
        group_shapes = shapes.get(group.group_id, ())
        dtypes = _tensor_dtypes(group.spec, len(group_shapes))
        offsets: list[int] = []
        offset = 0
        for shape, dtype in zip(group_shapes, dtypes, strict=True):
            if not shape or shape[0] != num_blocks:
                raise ValueError(
                    f"group {group.group_id} ({group.kind.value}): cache shape {shape} must "
                    f"start with num_blocks={num_blocks}"
                )
            offset = _round_up(offset, _ALIGN)
            offsets.append(offset)
            offset += math.prod(shape[1:]) * dtype.itemsize
        if offset > page_size_bytes:
            raise ValueError(
                f"group {group.group_id} ({group.kind.value}) needs {offset} bytes per block "
                f"but pages are {page_size_bytes} bytes"
            )
        for j, layer in enumerate(group.layer_names):
            tensors: list[torch.Tensor] = []
            for shape, dtype, start in zip(group_shapes, dtypes, offsets, strict=True):
                nbytes = math.prod(shape[1:]) * dtype.itemsize
                view = buffers[j][:, start : start + nbytes].view(dtype).view(shape)
                if fill is not None:
                    view.fill_(fill)
                tensors.append(view)
            caches[layer] = tuple(tensors)
    # The null block pads block tables and stands for released window blocks; kernels
    # that load whole tiles may touch it, so it must hold finite zeros (after any fill).
    for buffer in buffers:
        buffer[NULL_BLOCK].zero_()
    return caches


def _tensor_dtypes(spec: KVCacheSpec, count: int) -> tuple[torch.dtype, ...]:
    if isinstance(spec, MambaSpec):
        if count != len(spec.dtypes):
            raise ValueError(
                f"a Mamba layer declares {len(spec.dtypes)} state dtypes but its backend "
                f"declares {count} cache tensors"
            )
        return spec.dtypes
    if isinstance(spec, AttentionSpec):
        return (spec.cache_torch_dtype,) * count
    raise TypeError(f"no cache dtype rule for {type(spec).__name__}")
