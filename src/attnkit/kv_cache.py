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

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import itertools
import math
import operator
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NoReturn, SupportsIndex, cast

import numpy as np
import numpy.typing as npt
import torch

from ._validation import is_nonnegative_int, is_positive_int
from .capabilities import KVCacheLayout
from .errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    OutOfBlocksError,
    UnknownRequestError,
)
from .kinds import Ints, KindRules, StepLens, rules_for, spans
from .spec import (
    AttentionSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
)

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

NULL_BLOCK = 0
_ALIGN = 16  # byte alignment of each state tensor inside a page
_HUGE_PAGE = 1 << 21
_MADV_HUGEPAGE = 14  # <linux/mman.h>


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` (Linux only), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast("Callable[[int, int, int], int]", fn)


def cache_buffer(nbytes: int, device: torch.device | str) -> torch.Tensor:
    """An uninitialised flat ``uint8`` buffer of ``nbytes`` for KV-cache tensors.

    On a Linux CPU, buffers of at least 2 MB start on a 2 MB boundary and are marked
    ``MADV_HUGEPAGE`` before anything touches them, so that transparent huge pages back
    them where the system allows it (``/sys/kernel/mm/transparent_hugepage/enabled`` set
    to ``madvise`` or ``always``): paged attention reads K/V block by block from all
    over the cache, and 4 KB pages cost a TLB miss every 4 KB (``benchmarks/bench_cpu.py``:
    decode reads K/V about 10% faster on huge pages here). Elsewhere, or if ``madvise``
    fails, a plain ``torch.empty``: the advice is a hint, never a requirement.
    """
    device = torch.device(device)
    madvise = _madvise() if device.type == "cpu" else None
    if madvise is None or nbytes < _HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8, device=device)
    skip = -raw.data_ptr() % _HUGE_PAGE
    buf = raw[skip : skip + nbytes]  # a view: keeps ``raw`` alive
    madvise(buf.data_ptr(), nbytes - nbytes % _HUGE_PAGE, _MADV_HUGEPAGE)
    return buf


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
        return rules_for(self.spec).has_cache


def group_layers(layer_specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroup]:
    """Group layers with equal specs, in order of first appearance.

    Raises:
        ValueError: if there are no layers, or a value is not a ``KVCacheSpec``.
    """
    if not layer_specs:
        raise InvalidArgumentError("layer_specs must name at least one layer, got none")
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        if not isinstance(spec, KVCacheSpec):
            raise InvalidArgumentError(
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


def unified_groups(layer_specs: Mapping[str, KVCacheSpec]) -> tuple[list[KVCacheGroup], int]:
    """``group_layers`` then ``unify_page_sizes``: the groups (block sizes scaled) and the
    unified page size ``P``.

    The one code path from layer specs to the groups the cache is built for:
    ``AttentionRuntime`` and ``attnkit.planner.plan_model`` both call it, so the block
    size a plan shows is the one the runtime runs.

    Raises:
        InvalidArgumentError: as ``group_layers``.
    """
    return unify_page_sizes(group_layers(layer_specs))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


BufferSetName = Literal["page_major", "planes"]
"""The set of layer buffers a group's cache views (module docstring, "Memory")."""


def buffer_set_of(layout: KVCacheLayout) -> BufferSetName:
    """The buffer set of a group whose backend declares ``layout``."""
    return "planes" if layout == "planes" else "page_major"


def buffers_per_set(
    groups: Sequence[KVCacheGroup], layouts: Mapping[int, KVCacheLayout] | None = None
) -> dict[BufferSetName, int]:
    """Layer buffers of each set in use: the most layers of any cached group in it.

    ``layouts`` maps group id -> its backend's layout (absent: ``"interleaved"``).
    Sets no cached group uses are left out.
    """
    counts: dict[BufferSetName, int] = {}
    for group in groups:
        if group.has_cache:
            name = buffer_set_of((layouts or {}).get(group.group_id, "interleaved"))
            counts[name] = max(counts.get(name, 0), len(group.layer_names))
    return counts


def num_blocks_for_budget(
    groups: Sequence[KVCacheGroup],
    page_size_bytes: int,
    memory_budget_bytes: int,
    layouts: Mapping[int, KVCacheLayout] | None = None,
) -> int:
    """How many blocks (the null block included) fit in ``memory_budget_bytes``.

    Each block costs one page in every layer buffer of every set in use
    (``buffers_per_set``; ``layouts`` as there).

    Raises:
        ValueError: if the budget does not hold the null block and one more block.
    """
    if not is_positive_int(memory_budget_bytes):
        raise InvalidArgumentError(f"memory_budget_bytes must be a positive int, got {memory_budget_bytes!r}")
    slots = sum(buffers_per_set(groups, layouts).values())
    if slots == 0 or page_size_bytes == 0:
        return 2  # nothing is cached: only the bookkeeping exists
    per_block = page_size_bytes * slots
    num_blocks = memory_budget_bytes // per_block
    if num_blocks < 2:
        raise InvalidArgumentError(
            f"memory_budget_bytes={memory_budget_bytes} holds {num_blocks} block(s) of "
            f"{per_block} bytes ({slots} layer buffer(s) x page {page_size_bytes} B); "
            f"at least 2 are needed (the null block and one more), i.e. {2 * per_block} bytes"
        )
    return num_blocks


class BlockPool:
    """A fixed set of block ids; id 0 (the null block) is never handed out.

    The public ``allocate``/``free`` check their arguments and either succeed whole or
    raise and change nothing. The block manager uses the batched, unchecked
    ``take``/``give_back`` on its hot path, for blocks whose ownership it tracks
    itself; its own invariants are checked by the state-machine test.

    The free ids are a Python list used as a stack (slice deletion and ``extend`` run
    in C, whatever the count). Which ids are handed out is a ``bytearray`` built the
    first time a checked call needs it, then kept current; it is read per id from
    Python for a few ids and through a numpy view of the same bytes for many, and a
    pool driven only by the manager's fast path never pays for it.
    """

    _SMALL = 16
    """Up to this many ids, the checked calls loop in Python; above, they vectorise."""

    def __init__(self, num_blocks: int) -> None:
        if not is_positive_int(num_blocks) or num_blocks < 2:
            raise InvalidArgumentError(
                f"num_blocks must be an int >= 2 (block 0 is reserved), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        # Stacked high to low, so low ids are handed out first (readable tests).
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))
        self._in_use_cache: bytearray | None = None
        self._in_use_view: npt.NDArray[np.bool_] = np.zeros(0, dtype=np.bool_)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def _in_use(self) -> bytearray:
        if self._in_use_cache is None:
            in_use = bytearray(b"\x01") * self.num_blocks
            view = np.frombuffer(in_use, dtype=np.bool_)
            view[NULL_BLOCK] = False
            view[self._free] = False
            self._in_use_cache, self._in_use_view = in_use, view
        return self._in_use_cache

    def _mark(self, blocks: list[int], value: bool) -> None:
        """Record ``blocks`` as handed out (``True``) or free, if the map exists."""
        in_use = self._in_use_cache
        if in_use is None:
            return
        if len(blocks) <= self._SMALL:
            flag = 1 if value else 0
            for block in blocks:
                in_use[block] = flag
        else:
            self._in_use_view[blocks] = value

    def is_allocated(self, block: int) -> bool:
        return 0 < block < self.num_blocks and bool(self._in_use[block])

    def take(self, n: int) -> list[int]:
        """Take ``n`` free blocks (the caller has checked that ``n`` are free)."""
        free = self._free
        if n == 1:  # one decode growing: the common case
            blocks = [free.pop()]
        elif n > 0:
            blocks = free[: -n - 1 : -1]  # the top n, top first
            del free[-n:]
        else:
            return []
        if self._in_use_cache is not None:
            self._mark(blocks, True)
        return blocks

    def give_back(self, blocks: Ints32 | list[int]) -> None:
        """Return blocks the caller owns (no checks)."""
        given: list[int] = blocks.tolist() if isinstance(blocks, np.ndarray) else blocks
        self._free.extend(given)
        if self._in_use_cache is not None:
            self._mark(given, False)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks.

        Raises:
            OutOfBlocksError: if fewer than ``n`` are free (the pool is unchanged).
        """
        if not is_nonnegative_int(n):
            raise InvalidArgumentError(f"n must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise OutOfBlocksError(
                f"need {n} free block(s) but only {len(self._free)} of "
                f"{self.num_blocks - 1} are free"
            )
        return self.take(n)

    def free(self, blocks: Iterable[int]) -> None:
        """Return blocks to the pool.

        Raises:
            ValueError: for the null block, an id out of range, a block that is not
                allocated, or one given twice (the pool is unchanged).
        """
        given = list(blocks)
        count = len(given)
        if count == 0:
            return
        in_use = self._in_use_cache if self._in_use_cache is not None else self._in_use
        if count <= self._SMALL:
            limit = self.num_blocks
            for block in given:
                if type(block) is not int or not 0 < block < limit or not in_use[block]:
                    # Rare: convert numpy ids, then find the culprit (or free them).
                    given = [_block_id(b) for b in given]
                    if any(not 0 < b < limit or not in_use[b] for b in given):
                        self._reject(given, in_use)
                    break
            if count > 1 and len(set(given)) != count:
                self._reject(given, in_use)
        else:
            if not set(map(type, given)) <= {int}:
                given = [_block_id(b) for b in given]
            arr = np.array(given, dtype=np.int64)
            if (
                arr.min() < 1
                or arr.max() >= self.num_blocks
                or len(set(given)) != len(given)
                or not self._in_use_view[arr].all()
            ):
                self._reject(given, in_use)
        self.give_back(given)

    def _reject(self, given: list[int], in_use: bytearray) -> NoReturn:
        """Raise for the first block of ``given`` that cannot be freed."""
        seen: set[int] = set()
        for block in given:
            if not 0 < block < self.num_blocks:
                raise InvalidArgumentError(
                    f"cannot free block {block!r}: ids run from 1 to {self.num_blocks - 1}"
                )
            if block in seen:
                raise InvalidArgumentError(f"cannot free block {block}: it is given twice")
            if not in_use[block]:
                raise InvalidArgumentError(f"cannot free block {block}: it is not allocated (double free?)")
            seen.add(block)
        raise AssertionError("_reject called for blocks that can all be freed")


Ints32 = npt.NDArray[np.int32]


RECENTLY_FREED = 4096
"""How many freed request ids the manager remembers, to tell "already freed" apart
from "never scheduled" in errors."""


def _block_id(block: object) -> int:
    """``block`` as a Python int: ints and numpy integers are ids, nothing else is."""
    given = f"{block!r} ({type(block).__name__})"
    if isinstance(block, bool | np.bool_) or not isinstance(block, int | np.integer):
        raise ArgumentTypeError(f"block ids must be ints, got {given}")
    return operator.index(cast("SupportsIndex", block))


class _Tables:
    """One group's block tables: a persistent ``[rows, width]`` int32 array.

    Row ``r`` is the request that holds row ``r``; ``num_blocks[r]`` logical blocks
    exist (entries past it are 0), entries before ``first_live[r]`` were released (0,
    the null block). Grown by doubling, never rebuilt.
    """

    def __init__(self, rows: int, width: int) -> None:
        self.table = np.zeros((rows, width), dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.first_live = np.zeros(rows, dtype=np.int64)

    def grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self.table.shape
        if rows <= old_rows and width <= old_width:
            return
        new_rows, new_width = max(rows, old_rows), max(width, old_width)
        if rows > old_rows:
            new_rows = max(rows, 2 * old_rows)
        if width > old_width:
            new_width = max(width, 2 * old_width)
        table = np.zeros((new_rows, new_width), dtype=np.int32)
        table[:old_rows, :old_width] = self.table
        self.table = table
        for name in ("num_blocks", "first_live"):
            old = getattr(self, name)
            new = np.zeros(new_rows, dtype=np.int64)
            new[:old_rows] = old
            setattr(self, name, new)


@dataclasses.dataclass
class _StepPlan:
    """What one group does in a step, computed before anything changes."""

    group: KVCacheGroup
    grow: Ints  # new blocks per scheduled request
    release_from: Ints  # first_live before the step
    release_to: Ints  # first_live after the step
    width: int  # the largest table length among the step's requests after it


class KVCacheManager:
    """Per-request block tables of every group, over one ``BlockPool``.

    A request's table in a group maps its logical block ``i`` to a physical block.
    What a group allocates and releases follows its kind's rules (``attnkit.kinds``):
    attention groups grow their tables as tokens arrive; sliding-window and
    chunked-local groups release blocks that no present or future query can see
    (their entries become the null block); a Mamba group holds one block per request;
    a cross-attention group holds the request's encoder tokens; encoder-only groups
    hold nothing.

    Tables are persistent numpy arrays, one row per live request (rows of finished
    requests are reused): a step does only its new work, vectorised over requests,
    and releases cost O(blocks released).
    """

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        num_blocks: int,
        *,
        rules: Sequence[KindRules[Any]] | None = None,
    ) -> None:
        """``rules``: one per group, replacing its kind's (a context-parallel rank's
        sharded rules); default ``rules_for`` each group's spec."""
        self.groups = tuple(groups)
        self.pool = BlockPool(num_blocks)
        self._rules = list(rules) if rules is not None else [rules_for(g.spec) for g in self.groups]
        if len(self._rules) != len(self.groups):
            raise ValueError(
                f"rules must have one entry per group ({len(self.groups)}), got {len(self._rules)}"
            )
        self._rows: dict[str, int] = {}
        capacity = 16
        # Unused rows; invariant: len(_rows) + len(_free_rows) == capacity.
        self._free_rows: list[int] = list(range(capacity - 1, -1, -1))
        self._step_widths: list[int] = [0] * len(self.groups)
        self.rows_version = 0
        # Ids of the last frees (oldest first), so a second free can say "already freed".
        self._recently_freed: dict[str, None] = {}
        """Bumped whenever a request id gains or loses its row (callers may cache
        ``lookup_rows`` results while it is unchanged)."""
        self._num_tokens = np.zeros(capacity, dtype=np.int64)
        self._encoder_len = np.zeros(capacity, dtype=np.int64)
        self._tables = [_Tables(capacity, 16) for _ in self.groups]

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def row_of(self, req_id: str) -> int:
        """The table row of a live request.

        Raises:
            UnknownRequestError: ``req_id`` is not live; the message says whether it
                was freed (among the last ``RECENTLY_FREED`` frees) or never seen.
        """
        try:
            return self._rows[req_id]
        except KeyError:
            raise self.unknown_request(req_id) from None
        except TypeError:  # unhashable
            raise ArgumentTypeError(
                f"request ids are strings, got {req_id!r} ({type(req_id).__name__})"
            ) from None

    def unknown_request(self, req_id: object) -> UnknownRequestError:
        """The error for a request id that is not live (see ``row_of``)."""
        if not isinstance(req_id, str):
            return UnknownRequestError(
                f"unknown request {req_id!r}: request ids are strings, "
                f"got {type(req_id).__name__}"
            )
        if req_id in self._recently_freed:
            return UnknownRequestError(
                f"request {req_id!r} was already freed (it has no cache now; schedule it "
                f"as a new request to start it again)"
            )
        return UnknownRequestError(
            f"unknown request {req_id!r}: it was never scheduled, or was freed long ago "
            f"({len(self._rows)} live request(s))"
        )

    def num_tokens(self, req_id: str) -> int:
        """Tokens of ``req_id`` whose K/V (or state) are in the cache after the last step."""
        return int(self._num_tokens[self.row_of(req_id)])

    def encoder_len(self, req_id: str) -> int:
        return int(self._encoder_len[self.row_of(req_id)])

    def block_table(self, group_id: int, req_id: str) -> list[int]:
        """A copy of ``req_id``'s table in group ``group_id``."""
        row = self.row_of(req_id)
        tables = self._tables[group_id]
        blocks: list[int] = tables.table[row, : tables.num_blocks[row]].tolist()
        return blocks

    def step_width(self, group_id: int) -> int:
        """The largest table length (logical blocks) in group ``group_id`` among the
        requests of the last ``allocate_rows`` call."""
        return self._step_widths[group_id]

    def num_blocks_of(self, group_id: int, rows: Ints) -> Ints:
        """Logical blocks of each of ``rows`` in group ``group_id`` (released ones included)."""
        return self._tables[group_id].num_blocks[rows]

    def table_array(self, group_id: int) -> Ints32:
        """Group ``group_id``'s persistent table (rows as ``row_of`` gives them); read only."""
        return self._tables[group_id].table

    def owned_blocks(self) -> dict[str, set[int]]:
        """Request -> every non-null block it holds in any group (for checks)."""
        return {
            rid: {
                b
                for t in range(len(self.groups))
                for b in self.block_table(t, rid)
                if b != NULL_BLOCK
            }
            for rid in self._rows
        }

    def lookup_rows(self, req_ids: Sequence[str]) -> Ints:
        """Rows of ``req_ids``, -1 for ids not live."""
        return np.fromiter(
            map(self._rows.get, req_ids, itertools.repeat(-1)), dtype=np.int64, count=len(req_ids)
        )

    def step_lens(self, rows: Ints, num_new: Ints, encoder_lens: Ints) -> StepLens:
        """The step's lengths for ``rows`` (-1: a new request)."""
        live = rows >= 0
        if live.all():
            return StepLens(self._num_tokens[rows], num_new, self._encoder_len[rows])
        safe = np.where(live, rows, 0)
        computed = np.where(live, self._num_tokens[safe], 0)
        encoder = np.where(live, self._encoder_len[safe], encoder_lens)
        return StepLens(computed, num_new, encoder)

    def allocate_step(
        self,
        scheduled: Sequence[tuple[str, int, int]],
    ) -> None:
        """Make room for one step: ``(req_id, num_new_tokens, encoder_len)`` per request.

        New request ids are added. Blocks that fall out of a window are released
        first. All or nothing: on ``OutOfBlocksError`` no table and no block changed.
        """
        ids = [r for r, _, _ in scheduled]
        num_new = np.fromiter((n for _, n, _ in scheduled), dtype=np.int64, count=len(ids))
        enc = np.fromiter((e for _, _, e in scheduled), dtype=np.int64, count=len(ids))
        rows = self.lookup_rows(ids)
        self.allocate_rows(ids, rows, self.step_lens(rows, num_new, enc))

    def allocate_rows(
        self,
        req_ids: Sequence[str],
        rows: Ints,
        lens: StepLens,
        *,
        finished: Sequence[str] = (),
    ) -> Ints:
        """``allocate_step`` for callers that have the rows and lengths already.

        ``rows`` holds -1 for new requests; the rows they get are filled in (the array
        is updated in place and returned). ``finished`` requests are freed first, but
        only once the step is known to fit (their blocks count as free): a rejected
        step changes nothing, finished requests included. An id both finished and
        scheduled must be given as new (-1) in ``rows``.

        Raises:
            OutOfBlocksError: the pool cannot hold the step (nothing changed).
        """
        plans: list[_StepPlan] = []
        total_new = total_released = 0
        new = rows < 0
        any_new = bool(new.any())
        old_rows = np.where(new, 0, rows) if any_new else rows
        for group, rules in zip(self.groups, self._rules, strict=True):
            tables = self._tables[group.group_id]
            have = tables.num_blocks[old_rows]
            if any_new:
                have[new] = 0
            after_grow = np.maximum(rules.blocks_needed(group.spec, lens), have)
            grow = after_grow - have
            width = int(after_grow.max()) if after_grow.size else 0
            if rules.releases:
                before = tables.first_live[old_rows]
                if any_new:
                    before[new] = 0
                after = np.maximum(
                    np.minimum(rules.first_live_block(group.spec, lens), have), before
                )
                total_released += int((after - before).sum())
            else:
                before = after = _NO_INTS
            total_new += int(grow.sum())
            plans.append(_StepPlan(group, grow, before, after, width))
        held = sum(self._blocks_held(self.row_of(r)) for r in finished)
        if total_new > self.pool.num_free_blocks + total_released + held:
            raise OutOfBlocksError(
                f"the step needs {total_new} new block(s) but only "
                f"{self.pool.num_free_blocks} are free (+{total_released} released by windows, "
                f"+{held} held by finished requests) of {self.pool.num_blocks - 1}; "
                f"nothing was allocated or freed"
            )
        # Checked: from here on nothing fails. Finished requests go, new ones get rows.
        for req_id in finished:
            self.free_request(req_id)
        if any_new:
            self._assign_rows(req_ids, rows, lens)
        # Releases first, for every request: a request earlier in the batch may need
        # the blocks a later one releases.
        for plan in plans:
            if plan.release_to.size:
                self._release(
                    self._tables[plan.group.group_id], rows, plan.release_from, plan.release_to
                )
        for plan in plans:
            self._grow(self._tables[plan.group.group_id], rows, plan.grow, plan.width)
        self._num_tokens[rows] = lens.total
        self._step_widths = [plan.width for plan in plans]
        return rows

    def _assign_rows(self, req_ids: Sequence[str], rows: Ints, lens: StepLens) -> None:
        new_idx = np.flatnonzero(rows < 0)
        needed = len(self._rows) + new_idx.size
        capacity = self._num_tokens.shape[0]
        if needed > capacity:
            size = max(needed, 2 * capacity)
            for name in ("_num_tokens", "_encoder_len"):
                grown = np.zeros(size, dtype=np.int64)
                grown[:capacity] = getattr(self, name)
                setattr(self, name, grown)
            for tables in self._tables:
                tables.grow(size, 0)
            self._free_rows[:0] = range(size - 1, capacity - 1, -1)
        self.rows_version += 1
        for i in (int(k) for k in new_idx):
            row = self._free_rows.pop()
            rows[i] = row
            self._rows[req_ids[i]] = row
            if self._recently_freed:
                self._recently_freed.pop(req_ids[i], None)
        self._encoder_len[rows[new_idx]] = lens.encoder[new_idx]
        self._num_tokens[rows[new_idx]] = 0

    def _release(self, tables: _Tables, rows: Ints, before: Ints, after: Ints) -> None:
        moved = np.flatnonzero(after > before)
        if moved.size == 0:
            return
        rows, before, after = rows[moved], before[moved], after[moved]
        owners, cols = spans(after - before, before, rows)
        dead = tables.table[owners, cols]
        tables.table[owners, cols] = NULL_BLOCK
        self.pool.give_back(dead[dead != NULL_BLOCK])
        tables.first_live[rows] = after

    def _grow(self, tables: _Tables, rows: Ints, grow: Ints, width: int) -> None:
        growing = np.flatnonzero(grow)
        if growing.size == 0:
            return
        rows, grow = rows[growing], grow[growing]
        have = tables.num_blocks[rows]
        tables.grow(0, width)
        owners, cols = spans(grow, have, rows)
        tables.table[owners, cols] = self.pool.take(owners.size)
        tables.num_blocks[rows] = have + grow

    def _blocks_held(self, row: int) -> int:
        held = 0
        for tables in self._tables:
            used = tables.table[row, tables.first_live[row] : tables.num_blocks[row]]
            held += int(np.count_nonzero(used))
        return held

    def free_request(self, req_id: str) -> None:
        """Release every block of ``req_id`` and forget it."""
        row = self.row_of(req_id)
        for tables in self._tables:
            used = tables.table[row, tables.first_live[row] : tables.num_blocks[row]]
            self.pool.give_back(used[used != NULL_BLOCK])
            tables.table[row, : tables.num_blocks[row]] = NULL_BLOCK
            tables.num_blocks[row] = 0
            tables.first_live[row] = 0
        self._num_tokens[row] = 0
        self._encoder_len[row] = 0
        del self._rows[req_id]
        self._free_rows.append(row)
        self.rows_version += 1
        recent = self._recently_freed
        recent[req_id] = None
        if len(recent) > RECENTLY_FREED:
            del recent[next(iter(recent))]


_NO_INTS: Ints = np.zeros(0, dtype=np.int64)


def allocate_kv_cache_tensors(
    groups: Sequence[KVCacheGroup],
    shapes: Mapping[int, tuple[tuple[int, ...], ...]],
    *,
    num_blocks: int,
    page_size_bytes: int,
    device: torch.device,
    fill: float | None = None,
    layouts: Mapping[int, KVCacheLayout] | None = None,
) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per-layer cache tensors, aliased within each buffer set as the module docstring says.

    Every tensor is a view of a layer buffer (nothing is copied, ever): writing
    through it writes the buffer.

    Args:
        groups: unified groups.
        shapes: group id -> the shapes its backend declares (``get_kv_cache_shapes``);
            page-major shapes start with ``num_blocks``; a planes group declares two
            shapes (K plane, V plane) starting with ``num_blocks * block_size``.
        num_blocks, page_size_bytes: the pool's geometry.
        device: where the buffers live.
        fill: a value to fill every tensor with (tests use NaN to catch reads of
            unwritten slots); ``None`` leaves memory uninitialised. Block 0, the null
            block, is always zeroed.
        layouts: group id -> its backend's ``kv_cache_layout`` (absent:
            ``"interleaved"``); it picks the group's buffer set.

    Raises:
        ValueError: if a page-major group's tensors do not fit one page per block, or a
            planes group's are not two planes whose block rows fill half a page each.
    """
    counts = buffers_per_set(groups, layouts)
    buffers = [
        cache_buffer(num_blocks * page_size_bytes, device).view(num_blocks, page_size_bytes)
        for _ in range(counts.get("page_major", 0))
    ]
    # Planes set: flat buffers, K plane = first half, V plane = second half.
    plane_buffers = [
        cache_buffer(num_blocks * page_size_bytes, device)
        for _ in range(counts.get("planes", 0))
    ]
    caches: dict[str, tuple[torch.Tensor, ...]] = {}
    for group in groups:
        group_shapes = shapes.get(group.group_id, ())
        dtypes = _tensor_dtypes(group.spec, len(group_shapes))
        layout = (layouts or {}).get(group.group_id, "interleaved")
        if group.has_cache and buffer_set_of(layout) == "planes":
            _check_planes(group, group_shapes, dtypes, num_blocks, page_size_bytes)
            half = num_blocks * page_size_bytes // 2
            for j, layer in enumerate(group.layer_names):
                planes = tuple(
                    plane_buffers[j][i * half : (i + 1) * half].view(dtype).view(shape)
                    for i, (shape, dtype) in enumerate(zip(group_shapes, dtypes, strict=True))
                )
                if fill is not None:
                    for plane in planes:
                        plane.fill_(fill)
                caches[layer] = planes
            continue
        offsets: list[int] = []
        offset = 0
        for shape, dtype in zip(group_shapes, dtypes, strict=True):
            if not shape or shape[0] != num_blocks:
                raise InvalidArgumentError(
                    f"group {group.group_id} ({group.kind.value}): cache shape {shape} must "
                    f"start with num_blocks={num_blocks}"
                )
            offset = _round_up(offset, _ALIGN)
            offsets.append(offset)
            offset += math.prod(shape[1:]) * dtype.itemsize
        if offset > page_size_bytes:
            raise InvalidArgumentError(
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
    half_page, half = page_size_bytes // 2, num_blocks * page_size_bytes // 2
    for buffer in plane_buffers:  # the null block's K rows and V rows
        buffer[NULL_BLOCK * half_page : (NULL_BLOCK + 1) * half_page].zero_()
        buffer[half + NULL_BLOCK * half_page : half + (NULL_BLOCK + 1) * half_page].zero_()
    return caches


def _check_planes(
    group: KVCacheGroup,
    group_shapes: tuple[tuple[int, ...], ...],
    dtypes: tuple[torch.dtype, ...],
    num_blocks: int,
    page_size_bytes: int,
) -> None:
    """A planes group declares a K and a V plane, token-major, whose block rows fill
    exactly half a page: then block ``c``'s rows sit at the same bytes in every planes
    group, and block ownership keeps the groups apart."""
    where = f"group {group.group_id} ({group.kind.value}, planes layout)"
    if len(group_shapes) != 2:
        raise InvalidArgumentError(
            f"{where}: needs two cache tensors (the K and V planes), got {len(group_shapes)}"
        )
    block_size = group.spec.block_size
    rows = num_blocks * block_size
    for shape, dtype in zip(group_shapes, dtypes, strict=True):
        if not shape or shape[0] != rows:
            raise InvalidArgumentError(
                f"{where}: plane shape {shape} must start with "
                f"num_blocks * block_size = {num_blocks} * {block_size} = {rows}"
            )
        block_bytes = block_size * math.prod(shape[1:]) * dtype.itemsize
        if 2 * block_bytes != page_size_bytes:
            raise InvalidArgumentError(
                f"{where}: a block's rows of plane {shape} take {block_bytes} bytes but must "
                f"fill half a page ({page_size_bytes} / 2 = {page_size_bytes / 2:g} bytes)"
            )


def _tensor_dtypes(spec: KVCacheSpec, count: int) -> tuple[torch.dtype, ...]:
    if isinstance(spec, MambaSpec):
        if count != len(spec.dtypes):
            raise InvalidArgumentError(
                f"a Mamba layer declares {len(spec.dtypes)} state dtypes but its backend "
                f"declares {count} cache tensors"
            )
        return spec.dtypes
    if isinstance(spec, AttentionSpec):
        return (spec.cache_torch_dtype,) * count
    raise TypeError(f"no cache dtype rule for {type(spec).__name__}")
