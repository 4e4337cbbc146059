"""The block manager: every request's block table in every group, persistent numpy
tables grown and released by the groups' kind rules, over one ``BlockPool`` of pages
(and a ``PageSlab`` of kernel blocks per group whose page holds several). With prefix
caching on, the pool is a ``CachedPool``, every cacheable group's blocks come from a
``CachedSlab`` and ``prefix`` (a ``PrefixCache``) looks prompts up and names blocks."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._validation import is_positive_int
from ..config import PrefixCachingConfig
from ..errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    OutOfBlocksError,
    UnknownRequestError,
)
from ..kinds import Ints, KindRules, StepLens, rules_for, spans
from ..prefix_cache import Tokens, checkpoint_interval_for, get_hasher, group_namespace
from ._cached import CachedPool, CachedSlab, GroupNeed, PageKeeper, check_step
from ._checkpoints import CheckpointStore
from ._groups import KVCacheGroup
from ._pool import NULL_BLOCK, BlockPool, Ints32, PageSlab
from ._prefix import PrefixCache, PrefixHitTables, PrefixMatch, ReleaseName

STEADY_MAX_REQS = 16
"""Up to this many requests, a decode step looks ahead for how many more decode steps of
the same requests change no table (``KVCacheManager.allocate_rows``' steady state); in
larger batches some request crosses a block boundary at nearly every step."""
STEADY_LOOKAHEAD = 32
"""How many decode steps ahead that look goes."""
RUN_MAX_REQS = 256
"""Decode steps of more requests than ``STEADY_MAX_REQS`` and up to this many, and steps
of up to this many requests that repeat the last one's new tokens (a prompt's chunks of
one size beside decodes), are planned ``STEADY_LOOKAHEAD`` steps at a time
(``KVCacheManager._plan_run``): each step then only writes the entries it changes. The
plan's work grows with the batch (its arrays are ``STEADY_LOOKAHEAD`` x the requests),
a step's saving with the per-call overhead it removes, so larger batches take the full
step (the runs' mean cost per decode step, plans included, against the full step's
here: 0.83x at 64 requests, 0.90x at 256, 0.99x at 512, 1.05x at 1024)."""

TABLE_PRESIZE_BYTES = 64 << 20
"""The most bytes one group's block table is given up front from ``table_hint``
(``max_num_reqs`` rows of ``max_model_len`` tokens' blocks, as vLLM's ``BlockTable``
holds); past it the table starts small and grows by doubling. ``np.zeros`` of that size
reserves address space: pages become memory as rows fill them."""

RECENTLY_FREED = 4096
"""How many freed request ids the manager remembers, to tell "already freed" apart
from "never scheduled" in errors."""


class _Tables:
    """One group's block tables: a persistent ``[rows, width]`` int32 array.

    Row ``r`` is the request that holds row ``r``; ``num_blocks[r]`` logical blocks
    exist (entries past it are 0), entries before ``first_live[r]`` were released (0,
    the null block). Entries are kernel block ids (the group's block size). Grown by
    doubling, never rebuilt.
    """

    def __init__(self, rows: int, width: int) -> None:
        self.table = np.zeros((rows, width), dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.first_live = np.zeros(rows, dtype=np.int64)

    def used(self) -> tuple[Ints32, Ints]:
        """The table's columns any row uses (a presized table is mostly unused) and
        their indices, for scans of every row."""
        width = int(self.num_blocks.max())
        return self.table[:, :width], np.arange(width)

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


@dataclasses.dataclass(slots=True)
class _Growth:
    """The table entries one group's growth fills in a step: the rows that grow, their
    lengths after it, and each new entry's row and column."""

    rows: Ints
    after: Ints
    owners: Ints
    cols: Ints


def _growth_key(group: KVCacheGroup, rules: KindRules[Any]) -> tuple[int, int] | None:
    """Groups with the same key need the same logical blocks at every length (the
    default ``blocks_needed``, one block size and shift); ``None``: a kind's own."""
    if not rules.keeps_default("blocks_needed"):
        return None
    return (group.spec.block_size, rules.shift(group.spec))


@dataclasses.dataclass(slots=True)
class _StepPlan:
    """What one group does in a step, computed before anything changes."""

    group: KVCacheGroup
    grow: Ints  # new blocks per scheduled request
    release_from: Ints  # first_live before the step
    release_to: Ints  # first_live after the step
    width: int  # the largest table length among the step's requests after it
    new: int  # new kernel blocks in all
    released: int  # entries released in all
    # A slab group's released entries, found for the check (None: found when released).
    release_at: tuple[Ints, Ints, Ints32] | None = None  # (rows, columns, blocks)


def _next_steps(lens: StepLens, ahead: int) -> StepLens:
    """The lengths of the ``ahead`` steps after ``lens``' whose requests take the same new
    tokens each (decodes: one), flattened step by step (``[ahead * B]``)."""
    computed = (lens.total[None, :] + np.arange(ahead)[:, None] * lens.query[None, :]).ravel()
    return StepLens(computed, np.tile(lens.query, ahead), np.tile(lens.encoder, ahead))


def _run_entries(rows: Ints, start: Ints, end: Ints, steps: Ints) -> _Entries | None:
    """The entries ``start[k, i] .. end[k, i] - 1`` of ``rows[i]`` at each step ``k``
    (``[steps, B]`` arrays, ``end >= start``), step by step and in batch order within a
    step, as the full step's spans; ``None`` when no step has any."""
    count = end - start
    ks, idx = count.nonzero()
    if ks.size == 0:
        return None
    counts = count[ks, idx]
    owners, cols = spans(counts, start[ks, idx], rows[idx])
    per_step = count.sum(axis=1)
    bounds = np.zeros(steps.size + 1, dtype=np.int64)
    per_step.cumsum(out=bounds[1:])
    row_bounds = np.searchsorted(ks, np.arange(steps.size + 1))
    return _Entries(
        owners=owners,
        cols=cols,
        bounds=bounds.tolist(),
        rows=rows[idx],
        values=end[ks, idx],
        row_bounds=row_bounds.tolist(),
        per_step=per_step,
    )


@dataclasses.dataclass(slots=True)
class _Entries:
    """Table entries a run fills or releases, step by step: entry ``i`` of step
    ``k`` is ``(owners[i], cols[i])`` for ``bounds[k] <= i < bounds[k + 1]``, and the
    rows they change take ``values[j]`` for ``row_bounds[k] <= j < row_bounds[k + 1]``
    (``num_blocks`` after a growth, ``first_live`` after a release)."""

    owners: Ints
    cols: Ints
    bounds: list[int]
    rows: Ints
    values: Ints
    row_bounds: list[int]
    per_step: Ints  # entries per step

    def at(self, k: int) -> tuple[Ints, Ints, Ints, Ints] | None:
        """Step ``k``'s entries (owners, columns) and changed rows and their values;
        ``None`` when it has none."""
        lo, hi = self.bounds[k], self.bounds[k + 1]
        if hi == lo:
            return None
        r0, r1 = self.row_bounds[k], self.row_bounds[k + 1]
        return self.owners[lo:hi], self.cols[lo:hi], self.rows[r0:r1], self.values[r0:r1]


@dataclasses.dataclass(slots=True)
class _StepRun:
    """The next steps of the same rows with the same new tokens each (decodes of a batch
    too large for the steady state, where some request crosses a block boundary at
    nearly every step; a prompt's chunks of one size beside them), planned at once:
    which entries each step fills and releases in each group, its table widths and its
    block counts, so that each step only writes them (``KVCacheManager._run_step``).
    Valid while the same rows take ``query`` new tokens each from ``expected`` (and no
    row is assigned or freed)."""

    rows: Ints
    # What the next step must bring, as bytes (a comparison of bytes costs a tenth of
    # np.array_equal's here): its rows, each row's tokens before it and its new ones.
    row_bytes: bytes
    version: int
    expected: bytes
    query: bytes
    step: int
    steps: int
    grows: list[_Entries | None]  # per group (a growth twin: its twin's entries)
    releases: list[_Entries | None]  # per releasing group
    widths: list[list[int]]  # per step, per group
    new: list[int]  # per step: new blocks of all groups
    released: list[int]  # per step: released entries of all groups
    # With prefix caching: per group, per step, the prompt blocks its releases name
    # (``PrefixCache.plan_release_names``).
    release_names: dict[int, list[list[ReleaseName]]]
    quiet: int = 0  # the prefix cache's next commits to skip (``PrefixCache.commit``)
    pos: dict[int, int] | None = None  # with prefix caching: row -> its index in ``rows``


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

    Tables hold kernel block ids. A group whose page holds one kernel block
    (``blocks_per_page == 1``: state groups, models without unification) takes its
    blocks from the pool directly, as pages; a group with several takes them from its
    ``PageSlab`` (``slabs[group_id]``), which takes pages from the pool as it needs
    them and gives a page back once all its kernel blocks are free.

    With ``prefix_caching`` enabled, every group whose kind can hit takes its kernel
    blocks from a ``CachedSlab`` (``cached_slabs[group_id]``), whatever its blocks per
    page: ref-counted blocks that keep their names once free (``_cached``'s docstring),
    and ``prefix`` is the ``PrefixCache``. Other groups keep their ``PageSlab`` or take
    pages directly, from a pool that also reclaims idle cached pages.
    """

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        num_blocks: int,
        *,
        rules: Sequence[KindRules[Any]] | None = None,
        prefix_caching: PrefixCachingConfig | None = None,
        namespaces: Sequence[bytes] | None = None,
        table_hint: tuple[int, int] | None = None,
    ) -> None:
        """``rules``: one per group, replacing its kind's (a context-parallel rank's
        sharded rules); default ``rules_for`` each group's spec. ``prefix_caching``: on
        when given and enabled; ``namespaces``: each group's (``group_namespace``),
        by default made from its spec alone. ``table_hint``: ``(max_num_reqs,
        max_model_len)``, the engine's limits, so the block tables are made at their
        full size once (up to ``TABLE_PRESIZE_BYTES`` each) instead of grown by copies
        while requests arrive and prompts lengthen; not a limit (tables still grow past
        it)."""
        self.groups = tuple(groups)
        caching = prefix_caching is not None and prefix_caching.enabled
        self.pool = CachedPool(num_blocks) if caching else BlockPool(num_blocks)
        self._rules = list(rules) if rules is not None else [rules_for(g.spec) for g in self.groups]
        if len(self._rules) != len(self.groups):
            raise ValueError(
                f"rules must have one entry per group ({len(self.groups)}), got {len(self._rules)}"
            )
        for group, group_rules in zip(self.groups, self._rules, strict=True):
            if group.block_owner is not None:
                raise InvalidArgumentError(
                    f"group {group.group_id} ({group.kind.value}) shares the block ids of "
                    f"group {group.block_owner}: it has no tables of its own; give the "
                    f"manager the groups that own their blocks (its tables are the owner's)"
                )
            per_page: object = group.blocks_per_page
            if not is_positive_int(per_page):
                raise InvalidArgumentError(
                    f"group {group.group_id} ({group.kind.value}): blocks_per_page must be "
                    f"a positive int, got {per_page!r}"
                )
            if group.blocks_per_page > 1 and (
                not group_rules.has_cache or group_rules.writes == "none"
            ):
                raise InvalidArgumentError(
                    f"group {group.group_id} ({group.kind.value}): blocks_per_page must be 1 "
                    f"for a group whose block is a whole page (a state, or no cache), got "
                    f"{group.blocks_per_page}"
                )
        cached: list[CachedSlab | None] = [None] * len(self.groups)
        self.prefix: PrefixCache | None = None
        """The prefix cache (``None``: prefix caching is off)."""
        if caching:
            assert prefix_caching is not None
            assert isinstance(self.pool, CachedPool)
            cached = self._cached_slabs(self.pool, prefix_caching, namespaces)
        self.cached_slabs: tuple[CachedSlab | None, ...] = tuple(cached)
        """Per group: its ``CachedSlab`` when prefix caching is on and its kind can hit."""
        stores: list[CheckpointStore | None] = [None] * len(self.groups)
        interval: int | None = None
        if caching:
            assert prefix_caching is not None
            assert isinstance(self.pool, CachedPool)
            stores, interval = self._checkpoint_stores(self.pool, prefix_caching, namespaces)
        self.checkpoint_stores: tuple[CheckpointStore | None, ...] = tuple(stores)
        """Per group: its ``CheckpointStore`` (a state group with checkpoints on)."""
        self.slabs: tuple[PageSlab | None, ...] = tuple(
            PageSlab(self.pool, g.blocks_per_page) if g.blocks_per_page > 1 and c is None else None
            for g, c in zip(self.groups, cached, strict=True)
        )
        """Per group: its ``PageSlab``, or ``None`` when its kernel blocks are pages (or
        come from its ``CachedSlab``)."""
        self._paged = any(slab is not None for slab in self.slabs)
        self._take: list[Callable[[int], list[int] | Ints32]] = []
        self._give_back: list[Callable[[Ints32 | list[int]], None]] = []
        for gid, (slab, c) in enumerate(zip(self.slabs, cached, strict=True)):
            source: BlockPool | PageSlab | CachedSlab = (
                c if c is not None else slab if slab is not None else self.pool
            )
            if c is not None and c.blocks_per_page == 1:
                c.held = functools.partial(self._held_entries, gid)
                # Its take is the pool's (a new block's one holder is implicit).
                source = self.pool
            self._take.append(source.take)
            self._give_back.append((c if c is not None else source).give_back)
        keys = [_growth_key(g, r) for g, r in zip(self.groups, self._rules, strict=True)]
        self._growth_twin: list[int | None] = [
            None if key is None or keys.index(key) == gid else keys.index(key)
            for gid, key in enumerate(keys)
        ]
        """Per group: an earlier group whose tables grow alike (the same logical blocks
        at every length, so the same ``num_blocks`` for every row, always), whose
        step figures it reuses; else ``None``."""
        self._steady_max = STEADY_MAX_REQS
        self._steady_rows: Ints | None = None
        """The rows of the steady state (``_look_ahead``), ``None`` outside it."""
        self._steady_left = 0
        self._steady_version = -1
        self._steady_computed: list[int] = []
        self._steady_ones: list[int] = []
        self._steady_row_ids: list[int] = []
        self._run: _StepRun | None = None
        """The planned run of steps (``_plan_run``), ``None`` outside one."""
        self._run_seed: tuple[Ints, Ints, Ints, int] | None = None
        """The last step that was not a decode step and could start a run (``_repeats``):
        its rows, lengths after it, new tokens and ``rows_version``."""
        self._plan_runs = True
        """Whether repeated steps are planned as runs (tests turn it off to compare
        with the full step)."""
        self._rows: dict[str, int] = {}
        shapes = self._table_shapes(table_hint)
        capacity = shapes[0][0] if shapes else 16
        # Unused rows; invariant: len(_rows) + len(_free_rows) == capacity.
        self._free_rows: list[int] = list(range(capacity - 1, -1, -1))
        self._step_widths: list[int] = [0] * len(self.groups)
        self.rows_version = 0
        self.step_serial = 0
        """How many ``allocate_rows`` calls succeeded (``allocate_step``'s included)."""
        self.steady_serial = -1
        """``step_serial`` of the last step that took the steady decode state: equal to
        ``step_serial`` when the last step did, so each of its requests' new token went
        to the slot after the one the step before wrote (same rows, one token each, no
        table changed)."""
        self.run_serial = -1
        """``step_serial`` of the last step a run took (``_run_step``): equal to
        ``step_serial`` when the last step was one, so it scheduled the same rows with the
        same new tokens each as the step before, each from where that one left it."""
        # Ids of the last frees (oldest first), so a second free can say "already freed".
        self._recently_freed: dict[str, None] = {}
        """Bumped whenever a request id gains or loses its row (callers may cache
        ``lookup_rows`` results while it is unchanged)."""
        self._num_tokens = np.zeros(capacity, dtype=np.int64)
        self._encoder_len = np.zeros(capacity, dtype=np.int64)
        self._tables = [
            _Tables(capacity, width) for _, width in shapes or [(16, 16)] * len(self.groups)
        ]
        self._idle: dict[int, PageKeeper] | None = None
        """With prefix caching on and every cached group's block a page (no slab of
        several blocks per page), the pool's idle pages: steps take the plain path."""
        self._cached_pool = self.pool if isinstance(self.pool, CachedPool) else CachedPool(2)
        if caching:
            assert prefix_caching is not None
            if not self._paged and all(c is None or c.blocks_per_page == 1 for c in cached):
                self._idle = self._cached_pool.idle
            self.prefix = PrefixCache(
                self.groups,
                self._rules,
                self.cached_slabs,
                get_hasher(prefix_caching.hash),
                self._tables,
                self._num_tokens,
                stores,
                interval,
            )

    def _cached_slabs(
        self,
        pool: CachedPool,
        config: PrefixCachingConfig,
        namespaces: Sequence[bytes] | None,
    ) -> list[CachedSlab | None]:
        """A ``CachedSlab`` for every group whose kind can hit."""
        if namespaces is not None and len(namespaces) != len(self.groups):
            raise InvalidArgumentError(
                f"namespaces must have one entry per group ({len(self.groups)}), got "
                f"{len(namespaces)}"
            )
        slabs: list[CachedSlab | None] = []
        for i, (group, group_rules) in enumerate(zip(self.groups, self._rules, strict=True)):
            if group_rules.context_shard is not None:
                raise InvalidArgumentError(
                    f"group {group.group_id} ({group.kind.value}) is a context-parallel shard: "
                    f"prefix caching does not run with decode context parallelism (a rank's "
                    f"blocks hold every n-th token, so no prefix ever hits)"
                )
            if (
                not group_rules.has_cache
                or group_rules.prefix_never_hits(group.spec) is not None
                or group_rules.prefix_layout(group.spec) is None
            ):
                slabs.append(None)
                continue
            namespace = (
                namespaces[i]
                if namespaces is not None
                else group_namespace(
                    group.spec, revision=config.model_revision, hash_name=config.hash
                )
            )
            slabs.append(CachedSlab(pool, group.blocks_per_page, namespace))
        return slabs

    def _checkpoint_stores(
        self,
        pool: CachedPool,
        config: PrefixCachingConfig,
        namespaces: Sequence[bytes] | None,
    ) -> tuple[list[CheckpointStore | None], int | None]:
        """A ``CheckpointStore`` per state group when ``config.state_checkpoints`` is
        on, and the checkpoint interval (checked against the attention groups' kernel
        block sizes; default their least common multiple)."""
        stores: list[CheckpointStore | None] = [None] * len(self.groups)
        state = [
            g
            for g, r in zip(self.groups, self._rules, strict=True)
            if r.has_cache and r.prefix_unit == "length"
        ]
        if config.state_checkpoints == "none" or not state:
            return stores, None
        interval = checkpoint_interval_for(
            (g.spec for g in self.groups), config.checkpoint_interval
        )
        for group in state:
            namespace = (
                namespaces[group.group_id]
                if namespaces is not None
                else group_namespace(
                    group.spec, revision=config.model_revision, hash_name=config.hash
                )
            )
            stores[group.group_id] = CheckpointStore(pool, namespace)
        return stores, interval

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
                f"unknown request {req_id!r}: request ids are strings, got {type(req_id).__name__}"
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

    def owned_blocks(self) -> dict[str, set[tuple[int, int]]]:
        """Request -> every ``(group id, kernel block)`` it holds (non-null; for checks).

        Kernel block ids are per group: group ``g``'s block ``b`` lies in page ``b //
        groups[g].blocks_per_page``.
        """
        return {
            rid: {
                (t, b)
                for t in range(len(self.groups))
                for b in self.block_table(t, rid)
                if b != NULL_BLOCK
            }
            for rid in self._rows
        }

    def _table_shapes(self, hint: tuple[int, int] | None) -> list[tuple[int, int]]:
        """Each group's first table shape for ``hint`` (``[]``: no hint, 16 x 16): the
        rows of ``max_num_reqs`` and the columns of a ``max_model_len`` request, while
        every table fits ``TABLE_PRESIZE_BYTES``; else 16 rows of that width, or 16 x 16."""
        if hint is None:
            return []
        max_reqs, max_len = hint
        longest = np.array([max_len], dtype=np.int64)
        lens = StepLens(longest, np.zeros_like(longest), longest)
        widths = [
            max(int(rules.blocks_needed(group.spec, lens)[0]), 1)
            for group, rules in zip(self.groups, self._rules, strict=True)
        ]
        itemsize = np.dtype(np.int32).itemsize
        for rows in (max_reqs, 16):
            if all(rows * w * itemsize <= TABLE_PRESIZE_BYTES for w in widths):
                return [(rows, w) for w in widths]
        return [(16, 16)] * len(widths)

    def owned_pages(self) -> dict[int, set[int]]:
        """Group id -> the pages it holds: its slab's, or the pages in its tables (for
        checks; a page belongs to one group at a time)."""
        pages: dict[int, set[int]] = {}
        if self.prefix is not None and self.prefix.needs_flush:
            self.prefix.flush()  # deferred names: a free block named for a while is free
        for group, slab, cached in zip(self.groups, self.slabs, self.cached_slabs, strict=True):
            if cached is not None:
                pages[group.group_id] = set(np.flatnonzero(cached.owned).tolist())
                continue
            if slab is not None:
                pages[group.group_id] = set(np.flatnonzero(slab.owned).tolist())
                continue
            tables = self._tables[group.group_id]
            table, cols = tables.used()
            used = table[cols < tables.num_blocks[:, None]]
            pages[group.group_id] = set(used[used != NULL_BLOCK].tolist())
        return pages

    def lookup_rows(self, req_ids: Sequence[str]) -> Ints:
        """Rows of ``req_ids``, -1 for ids not live."""
        return np.fromiter(
            map(self._rows.get, req_ids, itertools.repeat(-1)), dtype=np.int64, count=len(req_ids)
        )

    def step_lens(
        self,
        rows: Ints,
        num_new: Ints,
        encoder_lens: Ints,
        start: Ints | None = None,
        *,
        all_live: bool = False,
    ) -> StepLens:
        """The step's lengths for ``rows`` (-1: a new request, which starts with
        ``start`` computed tokens: its prefix hit; default 0). ``all_live``: the caller
        knows that no row is -1 (the steady state), so it is not looked for."""
        if not all_live:
            live = rows >= 0
            if not live.all():
                safe = np.where(live, rows, 0)
                computed = np.where(live, self._num_tokens[safe], 0 if start is None else start)
                encoder = np.where(live, self._encoder_len[safe], encoder_lens)
                return StepLens(computed, num_new, encoder)
        return StepLens(self._num_tokens[rows], num_new, self._encoder_len[rows])

    def allocate_step(
        self,
        scheduled: Sequence[tuple[str, int, int]],
        *,
        prefixes: Sequence[PrefixMatch | None] | None = None,
    ) -> None:
        """Make room for one step: ``(req_id, num_new_tokens, encoder_len)`` per request.

        New request ids are added; ``prefixes`` (one per request, prefix caching on)
        gives a new request the match it starts from (``num_new_tokens`` then counts
        from its hit). Blocks that fall out of a window are released first. All or
        nothing: on ``OutOfBlocksError`` (or ``StalePrefixError``) no table and no block
        changed.
        """
        ids = [r for r, _, _ in scheduled]
        num_new = np.fromiter((n for _, n, _ in scheduled), dtype=np.int64, count=len(ids))
        enc = np.fromiter((e for _, _, e in scheduled), dtype=np.int64, count=len(ids))
        rows = self.lookup_rows(ids)
        start = None
        if prefixes is not None:
            if len(prefixes) != len(ids):
                raise InvalidArgumentError(
                    f"prefixes must have one entry per scheduled request ({len(ids)}), got "
                    f"{len(prefixes)}"
                )
            start = np.array(
                [
                    0 if p is None or r >= 0 else p.num_tokens
                    for p, r in zip(prefixes, rows.tolist(), strict=True)
                ],
                dtype=np.int64,
            )
        self.allocate_rows(ids, rows, self.step_lens(rows, num_new, enc, start), prefixes=prefixes)

    def allocate_rows(
        self,
        req_ids: Sequence[str],
        rows: Ints,
        lens: StepLens,
        *,
        finished: Sequence[str] = (),
        prefixes: Sequence[PrefixMatch | None] | None = None,
    ) -> Ints:
        """``allocate_step`` for callers that have the rows and lengths already.

        ``rows`` holds -1 for new requests; the rows they get are filled in (the array
        is updated in place and returned). ``finished`` requests are freed first, but
        only once the step is known to fit (their blocks count as free): a rejected
        step changes nothing, finished requests included. An id both finished and
        scheduled must be given as new (-1) in ``rows``. ``prefixes``: as in
        ``allocate_step`` (``lens.computed`` of a new request is its match's hit).

        Raises:
            OutOfBlocksError: the pool cannot hold the step (nothing changed).
            StalePrefixError: a match whose blocks were evicted since (nothing changed).
        """
        done = self._allocate_rows(req_ids, rows, lens, finished, prefixes)
        self.step_serial += 1
        return done

    def _allocate_rows(
        self,
        req_ids: Sequence[str],
        rows: Ints,
        lens: StepLens,
        finished: Sequence[str],
        prefixes: Sequence[PrefixMatch | None] | None,
    ) -> Ints:
        prefix = self.prefix
        if (
            rows is self._steady_rows
            and self._steady_left
            and not finished
            and prefixes is None
            and self.rows_version == self._steady_version
            and self._is_steady(rows, lens)
        ):
            # The steady state: the same requests decode one token each, and the
            # look-ahead of the last full step showed that no table changes.
            if prefix is not None and prefix.pending:
                prefix.commit()
            self._steady_left -= 1
            self.steady_serial = self.step_serial + 1  # (this step's, once it returns)
            self._steady_computed = lens.total.tolist()
            self._num_tokens[rows] = lens.total
            if prefix is not None:
                prefix.note_step(rows)
            return rows
        run = self._run
        if (
            run is not None
            and rows is run.rows
            and not finished
            and prefixes is None
            and self.rows_version == run.version
            and self._run_step(run, rows, lens)
        ):
            return rows
        self._end_run()
        self._steady_rows = None
        if prefix is not None:
            if prefix.pending:
                prefix.commit()  # the last step is done: its blocks get their names
            if prefixes is not None or self._idle is None:
                return self._allocate_cached(req_ids, rows, lens, finished, prefixes)
            # Else no request starts from a hit and every cached block is a page: the
            # step is checked and made as without caching, free idle pages counted as
            # free (with shared blocks, only if it fits without what it gives back).
        elif prefixes is not None and any(p is not None for p in prefixes):
            raise InvalidArgumentError(
                "a request brings a prefix match but prefix caching is off "
                "(AttentionConfig(prefix_caching={'enabled': True}))"
            )
        plans: list[_StepPlan] = []
        total_new = total_released = 0
        new = rows < 0
        any_new = bool(new.any())
        old_rows = np.where(new, 0, rows) if any_new else rows
        growth: list[tuple[Ints, Ints, int, int]] = []
        for group, rules, slab, twin in zip(
            self.groups, self._rules, self.slabs, self._growth_twin, strict=True
        ):
            tables = self._tables[group.group_id]
            if twin is not None:  # an earlier group grows alike: its figures are this one's
                have, grow, width, new_blocks = growth[twin]
                growth.append(growth[twin])
            else:
                have = tables.num_blocks[old_rows]
                if any_new:
                    have[new] = 0
                after_grow = np.maximum(rules.blocks_needed(group.spec, lens), have)
                grow = after_grow - have
                width = int(after_grow.max()) if after_grow.size else 0
                new_blocks = int(grow.sum())
                growth.append((have, grow, width, new_blocks))
            released = 0
            release_at: tuple[Ints, Ints, Ints32] | None = None
            if rules.releases:
                before = tables.first_live[old_rows]
                if any_new:
                    before[new] = 0
                after = np.maximum(
                    np.minimum(rules.first_live_block(group.spec, lens), have), before
                )
                released = int((after - before).sum())
                total_released += released
                if slab is not None and released:
                    release_at = _released_entries(tables, rows, before, after)
            else:
                before = after = _NO_INTS
            total_new += new_blocks
            plans.append(
                _StepPlan(group, grow, before, after, width, new_blocks, released, release_at)
            )
        if self._paged:
            self._check_pages(plans, [self.row_of(r) for r in finished])
        else:  # every kernel block is a page: count blocks
            free = self._free_pages(total_new)
            if free is None:
                return self._allocate_cached(req_ids, rows, lens, finished, prefixes)
            held = sum(self._blocks_held(self.row_of(r)) for r in finished)
            if total_new > free + total_released + held:
                raise OutOfBlocksError(
                    f"the step needs {total_new} new block(s) but only "
                    f"{self.pool.num_free_blocks} are free"
                    + (f" and {len(self._idle)} hold only cached blocks" if self._idle else "")
                    + f" (+{total_released} released by windows, +{held} held by finished "
                    f"requests) of {self.pool.num_blocks - 1}; nothing was allocated or freed"
                )
        # Checked: from here on nothing fails. Finished requests go, new ones get rows.
        for req_id in finished:
            self.free_request(req_id)
        if any_new:
            self._assign_rows(req_ids, rows, lens)
        # Releases first, for every request: a request earlier in the batch may need
        # the blocks a later one releases.
        for plan in plans:
            if plan.release_at is not None:
                self._release_entries(plan.group.group_id, rows, plan.release_to, plan.release_at)
            elif plan.released:  # (a step that releases nothing changes no table)
                self._release(plan.group.group_id, rows, plan.release_from, plan.release_to)
        grown: list[_Growth | None] = []
        for plan, twin in zip(plans, self._growth_twin, strict=True):
            if not plan.new:  # (most decode steps grow few groups' tables, often none)
                grown.append(None)
                continue
            gid = plan.group.group_id
            made = self._grow(
                gid, rows, plan.grow, plan.width, grown[twin] if twin is not None else None
            )
            grown.append(made)
        self._num_tokens[rows] = lens.total
        self._step_widths = [plan.width for plan in plans]
        if rows.size > 0 and not any_new and not finished:
            decode = int(lens.query.max()) == 1
            if decode and rows.size <= self._steady_max:
                self._look_ahead(rows, lens)
            elif (
                self._plan_runs
                and rows.size <= RUN_MAX_REQS
                and (prefix is None or self._idle is not None)  # (each cached block a page)
                and not self._paged
                and (decode or self._repeats(rows, lens))
            ):
                self._plan_run(rows, lens)
        if prefix is not None:
            prefix.note_step(rows)
        return rows

    def _end_run(self) -> None:
        """No run of repeated steps goes on (a step that is not its next one)."""
        if self._run is not None:
            self._run = None
            if self.prefix is not None:
                self.prefix.end_release_names()

    def _free_pages(self, need: int) -> int | None:
        """The pages a step that takes ``need`` new ones (every kernel block a page) can
        count on before its releases: free ones, and with prefix caching idle ones too;
        ``None`` when blocks other requests hold make that count unsafe (a block still
        held frees no page when given back: ``_allocate_cached``'s exact check)."""
        if self._idle is None:
            return self.pool.num_free_blocks
        free = self._cached_pool.num_available
        return None if self._cached_pool.shared and need > free else free

    def _is_steady(self, rows: Ints, lens: StepLens) -> bool:
        """Whether ``rows`` and ``lens`` are the look-ahead's: the same rows, each with
        the tokens the cache holds, one more each."""
        computed: list[int] = lens.computed.tolist()
        query: list[int] = lens.query.tolist()
        row_ids: list[int] = rows.tolist()
        return (
            computed == self._steady_computed
            and query == self._steady_ones
            and row_ids == self._steady_row_ids
        )

    def _look_ahead(self, rows: Ints, lens: StepLens) -> None:
        """After a step of ``rows``: if it decoded one token each, how many more such
        steps of the same rows change no table (each kind's rules asked for every one
        of ``STEADY_LOOKAHEAD`` steps ahead); those steps take the steady path."""
        n = rows.size
        ones: list[int] = [1] * n
        if lens.query.tolist() != ones:
            return
        ahead = STEADY_LOOKAHEAD
        future = _next_steps(lens, ahead)
        still = np.ones(future.computed.size, dtype=np.bool_)
        for gid, (group, rules, twin) in enumerate(
            zip(self.groups, self._rules, self._growth_twin, strict=True)
        ):
            tables = self._tables[gid]
            have = np.tile(tables.num_blocks[rows], ahead)
            if twin is None:  # (a twin needs the same blocks)
                still &= rules.blocks_needed(group.spec, future) <= have
            if rules.releases:  # a release: the first live block moves
                before = np.tile(tables.first_live[rows], ahead)
                still &= np.minimum(rules.first_live_block(group.spec, future), have) <= before
        steady = np.reshape(still, (ahead, n)).all(axis=1)
        left = ahead if steady.all() else int(np.argmin(steady))
        if left:
            self._steady_rows, self._steady_left = rows, left
            self._steady_version = self.rows_version
            self._steady_computed = lens.total.tolist()
            self._steady_ones = ones
            self._steady_row_ids = rows.tolist()

    def _repeats(self, rows: Ints, lens: StepLens) -> bool:
        """Whether this step (not a decode step) repeats the last one that was not: the
        same rows, each with the same new tokens, from where that one left them (a
        prompt's chunks of one size beside decodes); it is remembered for the next."""
        seed = self._run_seed
        self._run_seed = (rows, lens.total, lens.query, self.rows_version)
        return (
            seed is not None
            and seed[0] is rows
            and seed[3] == self.rows_version
            and lens.query.tobytes() == seed[2].tobytes()
            and lens.computed.tobytes() == seed[1].tobytes()
        )

    def _plan_run(self, rows: Ints, lens: StepLens) -> None:
        """After a step of ``rows`` (no request new or finished, every kernel block a
        page, with prefix caching every cached block too): plan the next
        ``STEADY_LOOKAHEAD`` steps of the same rows with the same new tokens each
        (decodes; a prompt's chunks of one size) as the full step would make them, group
        by group (each step's releases from the window's or chunk's first live block,
        then its growth), with each kind's rules asked for every step at once."""
        ahead, n = STEADY_LOOKAHEAD, rows.size
        future = _next_steps(lens, ahead)
        steps = np.arange(ahead)
        grows: list[_Entries | None] = []
        releases: list[_Entries | None] = []
        haves: list[Ints] = []  # per group: blocks before each step, (ahead, n)
        widths = np.zeros((ahead, len(self.groups)), dtype=np.int64)
        new = np.zeros(ahead, dtype=np.int64)
        released = np.zeros(ahead, dtype=np.int64)
        for gid, (group, rules, twin) in enumerate(
            zip(self.groups, self._rules, self._growth_twin, strict=True)
        ):
            tables = self._tables[gid]
            if twin is not None:  # the same blocks at every length: its twin's entries
                grows.append(grows[twin])
                haves.append(haves[twin])
                widths[:, gid] = widths[:, twin]
                grown = grows[twin]
                if grown is not None:
                    new += grown.per_step
            else:
                have0 = tables.num_blocks[rows]
                need = np.reshape(rules.blocks_needed(group.spec, future), (ahead, n))
                after = np.maximum.accumulate(np.maximum(need, have0[None, :]), axis=0)
                have = np.concatenate([have0[None, :], after[:-1]])
                haves.append(have)
                widths[:, gid] = after.max(axis=1)
                entries = _run_entries(rows, have, after, steps)
                grows.append(entries)
                if entries is not None:
                    new += entries.per_step
            if not rules.releases:
                releases.append(None)
                continue
            before0 = tables.first_live[rows]
            first = np.reshape(rules.first_live_block(group.spec, future), (ahead, n))
            # after_k = max(min(first_k, have_k), after_{k-1}), after_{-1} = before0
            live = np.maximum.accumulate(
                np.maximum(np.minimum(first, haves[gid]), before0[None, :]), axis=0
            )
            start = np.concatenate([before0[None, :], live[:-1]])
            entries = _run_entries(rows, start, live, steps)
            releases.append(entries)
            if entries is not None:
                released += entries.per_step
        release_names: dict[int, list[list[ReleaseName]]] = {}
        if self.prefix is not None:
            release_names = self.prefix.plan_release_names(
                [tables.first_live for tables in self._tables],
                [
                    (gid, e.owners, e.cols, e.bounds)
                    for gid, e in enumerate(releases)
                    if e is not None
                ],
            )
        self._run = _StepRun(
            release_names=release_names,
            rows=rows,
            row_bytes=rows.tobytes(),
            version=self.rows_version,
            expected=lens.total.tobytes(),
            query=lens.query.tobytes(),
            step=0,
            steps=ahead,
            grows=grows,
            releases=releases,
            widths=widths.tolist(),
            new=new.tolist(),
            released=released.tolist(),
        )

    def _run_step(self, run: _StepRun, rows: Ints, lens: StepLens) -> bool:
        """Take the next step of ``run`` if ``rows`` and ``lens`` are its (the same rows,
        the same new tokens each, from the lengths the last step left) and it fits; ``False``: the full step decides (it raises
        ``OutOfBlocksError`` for a step that does not fit)."""
        k = run.step
        if (
            k >= run.steps
            or rows.tobytes() != run.row_bytes  # (the caller's array: refilled in place?)
            or lens.computed.tobytes() != run.expected
            or lens.query.tobytes() != run.query
        ):
            return False
        prefix = self.prefix
        if prefix is not None:
            if run.quiet:  # (counted in steps: a lookup between two commits too)
                run.quiet -= 1
                if prefix.pending:  # the commit would only move watermarks: the next one's
                    prefix.skip_commit()
            elif prefix.pending:
                if run.pos is None:
                    run.pos = {row: i for i, row in enumerate(run.rows.tolist())}
                # The last step is done: its blocks get their names.
                run.quiet = prefix.commit(run.pos, lens.query)
        free = self._free_pages(run.new[k])
        if free is None or run.new[k] > free + run.released[k]:
            return False  # the full step decides (an exact check, or the refusal)
        # As the full step: every group's releases, then every group's growth.
        for gid, entries in enumerate(run.releases):
            step = None if entries is None else entries.at(k)
            if step is not None:
                owners, cols, changed, first_live = step
                tables = self._tables[gid]
                dead = tables.table[owners, cols]
                tables.table[owners, cols] = NULL_BLOCK
                if run.release_names:  # (before they go back: they go back cached)
                    names = run.release_names.get(gid)
                    if names is not None and names[k]:
                        assert prefix is not None
                        prefix.defer_released(gid, dead, names[k])
                self._give_back[gid](dead[dead != NULL_BLOCK])
                tables.first_live[changed] = first_live
        widths = run.widths[k]
        for gid, entries in enumerate(run.grows):
            step = None if entries is None else entries.at(k)
            if step is not None:
                owners, cols, changed, num_blocks = step
                tables = self._tables[gid]
                tables.grow(0, widths[gid])
                tables.table[owners, cols] = self._take[gid](owners.size)
                tables.num_blocks[changed] = num_blocks
        self._num_tokens[rows] = lens.total
        self._step_widths = widths
        run.expected = lens.total.tobytes()
        run.step = k + 1
        self.run_serial = self.step_serial + 1  # (this step's, once it returns)
        if prefix is not None:
            prefix.note_step(rows)
        return True

    def _allocate_cached(
        self,
        req_ids: Sequence[str],
        rows: Ints,
        lens: StepLens,
        finished: Sequence[str],
        prefixes: Sequence[PrefixMatch | None] | None,
    ) -> Ints:
        """``allocate_rows`` with prefix caching on: new requests may start from their
        hits (tables pointing at cached blocks, one more holder each), and the step is
        checked with ``_check_cached``."""
        prefix = self.prefix
        assert prefix is not None
        # Resolved and checked before the lazily named blocks are put in their maps
        # (``flush``, once the step is checked), so a refused step changes nothing: a
        # flush may give a deferred duplicate's page back to the free list. Neither
        # needs it: a match names blocks the maps held when it was made, and a free
        # block counts as available whether it is named (idle) or not (free).
        hits: list[PrefixHitTables] = (
            prefix.resolve(req_ids, prefixes, lens) if prefixes is not None else []
        )
        new = rows < 0
        any_new = bool(new.any())
        old_rows = np.where(new, 0, rows) if any_new else rows
        plans: list[_StepPlan] = []
        for gid, (group, rules) in enumerate(zip(self.groups, self._rules, strict=True)):
            tables = self._tables[gid]
            have = tables.num_blocks[old_rows]
            if any_new:
                have[new] = 0
            before = tables.first_live[old_rows] if rules.releases else _NO_INTS
            if any_new and rules.releases:
                before[new] = 0
            for hit in hits:
                installed = hit.tables[gid]
                if installed is not None:
                    have[hit.index] = installed[0].size
                    if rules.releases:
                        before[hit.index] = installed[1]
            after_grow = np.maximum(rules.blocks_needed(group.spec, lens), have)
            grow = after_grow - have
            width = int(after_grow.max()) if after_grow.size else 0
            released = 0
            release_at: tuple[Ints, Ints, Ints32] | None = None
            after = _NO_INTS
            if rules.releases:
                after = np.maximum(
                    np.minimum(rules.first_live_block(group.spec, lens), have), before
                )
                released = int((after - before).sum())
                if released:
                    # Hit rows release nothing in their first step (resolve trims them).
                    release_at = _released_entries(tables, rows, before, after)
                    released = int(release_at[2].size)
            plans.append(
                _StepPlan(group, grow, before, after, width, int(grow.sum()), released, release_at)
            )
        finished_rows = [self.row_of(r) for r in finished]
        self._check_cached(plans, finished_rows, hits)
        if prefix.needs_flush:  # checked: the frees below read which blocks hold names
            prefix.flush()
        for hit in hits:  # checked: their checkpoints are kept from eviction
            for gid, page in hit.restores:
                store = self.checkpoint_stores[gid]
                assert store is not None
                store.pin((page,))
        # Checked: from here on nothing fails.
        for req_id in finished:
            self.free_request(req_id)
        if any_new:
            self._assign_rows(req_ids, rows, lens)
        # Hits first (their blocks leave the evictable sets), then releases, then growth.
        touched: list[list[Ints32]] = [[] for _ in self.groups]
        for hit in hits:
            row = int(rows[hit.index])
            for gid, installed in enumerate(hit.tables):
                if installed is None:
                    continue
                entries, live = installed
                tables = self._tables[gid]
                tables.grow(0, entries.size)
                tables.table[row, : entries.size] = entries
                tables.num_blocks[row] = entries.size
                tables.first_live[row] = live
                touched[gid].append(entries[entries != NULL_BLOCK])
            prefix.track(row, hit.match)
        for gid, parts in enumerate(touched):
            slab = self.cached_slabs[gid]
            if parts and slab is not None:
                slab.touch(np.concatenate(parts))
        for plan in plans:
            if plan.release_at is not None:
                self._release_entries(plan.group.group_id, rows, plan.release_to, plan.release_at)
        for plan in plans:
            self._grow(plan.group.group_id, rows, plan.grow, plan.width)
        if prefix.checkpoint_layout is not None:
            prefix.restore(hits, rows)
        self._num_tokens[rows] = lens.total
        self._step_widths = [plan.width for plan in plans]
        prefix.note_step(rows)
        return rows

    def _check_cached(
        self,
        plans: Sequence[_StepPlan],
        finished_rows: Sequence[int],
        hits: Sequence[PrefixHitTables],
    ) -> None:
        """``_check_pages`` with prefix caching on (``_cached.check_step``)."""
        needs: list[GroupNeed] = []
        for plan, slab, cached in zip(plans, self.slabs, self.cached_slabs, strict=True):
            gid = plan.group.group_id
            freed = [self._held(gid, row) for row in finished_rows]
            if plan.release_at is not None:
                freed.append(plan.release_at[2])
            touched = [
                t[0][t[0] != NULL_BLOCK] for hit in hits if (t := hit.tables[gid]) is not None
            ]
            label = f"group {gid} ({plan.group.kind.value})"
            needs.append(GroupNeed(label, plan.new, freed, touched, cached, slab))
        pool = self.pool
        assert isinstance(pool, CachedPool)
        pinned = {(gid, page) for hit in hits for gid, page in hit.restores}
        check_step(pool, needs, pinned=len(pinned))

    def _assign_rows(self, req_ids: Sequence[str], rows: Ints, lens: StepLens) -> None:
        new_idx = (rows < 0).nonzero()[0]
        needed = len(self._rows) + new_idx.size
        capacity = self._num_tokens.shape[0]
        if needed > capacity:
            size = max(needed, 2 * capacity)
            for name in ("_num_tokens", "_encoder_len"):
                grown = np.zeros(size, dtype=np.int64)
                grown[:capacity] = getattr(self, name)
                setattr(self, name, grown)
            if self.prefix is not None:
                self.prefix.row_tokens = self._num_tokens
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

    def _check_pages(self, plans: Sequence[_StepPlan], finished_rows: Sequence[int]) -> None:
        """Raise ``OutOfBlocksError`` unless the step fits (nothing changes either way),
        for a manager with slabs (without, ``allocate_rows`` counts blocks).

        Counted in pages: a group whose kernel blocks are pages needs one per new block;
        a slab group needs ``ceil(max(0, new - free) / blocks_per_page)``, ``free`` being
        the free kernel blocks in its pages once its releases and finished requests gave
        theirs back. The step fits when the pages needed are at most the free ones plus
        the pages its releases and finished requests give back to the pool.
        """
        needed = back = 0
        slab_lines: list[str] = []
        for plan, slab in zip(plans, self.slabs, strict=True):
            gid = plan.group.group_id
            if slab is None:
                needed += plan.new
                back += plan.released + sum(self._held(gid, row).size for row in finished_rows)
                continue
            freed = [self._held(gid, row) for row in finished_rows]
            if plan.release_at is not None:
                freed.append(plan.release_at[2])
            if freed:
                free_after, emptied = slab.preview_give_back(np.concatenate(freed))
            else:  # nothing given back (a decode step, the common case)
                free_after, emptied = slab.num_free_blocks, 0
            pages = slab.pages_for(plan.new, free_after)
            needed += pages
            back += emptied
            if pages:
                slab_lines.append(
                    f"group {gid} ({plan.group.kind.value}): {plan.new} kernel block(s) of "
                    f"{plan.group.spec.block_size} tokens, {free_after} free in its "
                    f"{slab.num_pages} page(s) of {slab.blocks_per_page} -> {pages} page(s)"
                )
        free = self.pool.num_free_blocks
        if needed <= free + back:
            return
        whole = [
            f"group {p.group.group_id} ({p.group.kind.value}): {p.new} page(s)"
            for p, slab in zip(plans, self.slabs, strict=True)
            if slab is None and p.new
        ]
        raise OutOfBlocksError(
            f"the step needs {needed} new page(s) but only {free} are free (+{back} given "
            f"back by window releases and finished requests) of {self.pool.num_blocks - 1}; "
            f"{'; '.join(slab_lines + whole)}; nothing was allocated or freed"
        )

    def _held(self, group_id: int, row: int) -> Ints32:
        """The non-null kernel blocks row ``row`` holds in group ``group_id``."""
        tables = self._tables[group_id]
        used = tables.table[row, tables.first_live[row] : tables.num_blocks[row]]
        held: Ints32 = used[used != NULL_BLOCK]
        return held

    def _release(self, group_id: int, rows: Ints, before: Ints, after: Ints) -> None:
        moved = (after > before).nonzero()[0]
        if moved.size == 0:
            return
        tables = self._tables[group_id]
        rows, before, after = rows[moved], before[moved], after[moved]
        owners, cols = spans(after - before, before, rows)
        dead = tables.table[owners, cols]
        tables.table[owners, cols] = NULL_BLOCK
        self._give_back[group_id](dead[dead != NULL_BLOCK])
        tables.first_live[rows] = after

    def _release_entries(
        self, group_id: int, rows: Ints, after: Ints, at: tuple[Ints, Ints, Ints32]
    ) -> None:
        """``_release`` with the entries the check found (``_released_entries``)."""
        tables = self._tables[group_id]
        owners, cols, dead = at
        tables.table[owners, cols] = NULL_BLOCK
        self._give_back[group_id](dead)
        tables.first_live[rows] = np.maximum(tables.first_live[rows], after)

    def _grow(
        self, group_id: int, rows: Ints, grow: Ints, width: int, like: _Growth | None = None
    ) -> _Growth | None:
        """Grow the tables of ``rows`` by ``grow`` blocks each; ``like``: the entries a
        group that grows alike (``_growth_twin``) filled this step, reused. Returns the
        entries filled (``None``: none)."""
        tables = self._tables[group_id]
        if like is None:
            growing = grow.nonzero()[0]
            if growing.size == 0:
                return None
            rows, grow = rows[growing], grow[growing]
            have = tables.num_blocks[rows]
            owners, cols = spans(grow, have, rows)
            like = _Growth(rows, have + grow, owners, cols)
        tables.grow(0, width)
        tables.table[like.owners, like.cols] = self._take[group_id](like.owners.size)
        tables.num_blocks[like.rows] = like.after
        return like

    def _held_entries(self, group_id: int) -> Ints32:
        """Every table entry of group ``group_id`` that holds a block (non-null, live
        columns, one per entry: a block two requests hold appears twice)."""
        tables = self._tables[group_id]
        table, cols = tables.used()
        live = (cols >= tables.first_live[:, None]) & (cols < tables.num_blocks[:, None])
        used = table[live]
        held: Ints32 = used[used != NULL_BLOCK]
        return held

    def _blocks_held(self, row: int) -> int:
        held = 0
        for tables in self._tables:
            used = tables.table[row, tables.first_live[row] : tables.num_blocks[row]]
            held += int(np.count_nonzero(used))
        return held

    def take_back(self, rows: Ints, num_tokens: Ints) -> None:
        """Rejected draft tokens are taken back: each of ``rows`` holds ``num_tokens``
        tokens now (at most what it held, at least what it held before its last step:
        the caller checks), and the blocks its kind no longer needs past them are
        given back (``KindRules.blocks_needed`` at the new length; window and chunk
        releases were made from the step's first query, so they stay exact).

        The slots of the rejected tokens stay as written, past ``num_tokens``: no
        kernel reads them and the next tokens overwrite them, and a block is named
        only once full of held tokens (prefix caching), so none holding a rejected
        token ever is.
        """
        if not rows.size:
            return
        lens = StepLens(num_tokens, np.zeros_like(num_tokens), self._encoder_len[rows])
        for gid, (group, rules) in enumerate(zip(self.groups, self._rules, strict=True)):
            if not rules.has_cache:
                continue
            tables = self._tables[gid]
            have = tables.num_blocks[rows]
            keep = np.minimum(rules.blocks_needed(group.spec, lens), have)
            cut = np.flatnonzero(keep < have)
            if not cut.size:
                continue
            owners, cols = spans(have[cut] - keep[cut], keep[cut], rows[cut])
            dead = tables.table[owners, cols]
            tables.table[owners, cols] = NULL_BLOCK
            tables.num_blocks[rows[cut]] = keep[cut]
            # Tail first, as a free gives a cached group's blocks back.
            self._give_back[gid](np.ascontiguousarray(dead[dead != NULL_BLOCK][::-1]))
        self._num_tokens[rows] = num_tokens
        self._steady_rows = None  # lengths moved back: the steady look-ahead is void
        self._end_run()

    def free_request(self, req_id: str, token_ids: Tokens | None = None) -> None:
        """Release every block of ``req_id`` and forget it.

        With prefix caching on, its blocks are given back tail first (the chain's tail
        is evicted first), and ``token_ids`` (its tokens, prompt first) names the full
        blocks of its generated tokens before they are freed.

        Raises:
            UnknownRequestError: ``req_id`` is not live.
            ArgumentTypeError, InvalidArgumentError: ``token_ids`` are not the request's
                tokens (nothing changed).
        """
        row = self.row_of(req_id)
        prefix = self.prefix
        if prefix is not None:
            tokens = None if token_ids is None else prefix.check_tokens(row, req_id, token_ids)
            if prefix.pending:
                prefix.commit()  # the last step is done: its blocks get their names
            prefix.forget(row, int(self._num_tokens[row]), tokens)
        for gid, (tables, give_back) in enumerate(zip(self._tables, self._give_back, strict=True)):
            used = tables.table[row, tables.first_live[row] : tables.num_blocks[row]]
            if prefix is not None and self.cached_slabs[gid] is not None:
                give_back(used[used != NULL_BLOCK][::-1])
            else:
                give_back(used[used != NULL_BLOCK])
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


def _released_entries(
    tables: _Tables, rows: Ints, before: Ints, after: Ints
) -> tuple[Ints, Ints, Ints32]:
    """The entries a release nulls: their rows, columns and non-null blocks (the rows
    of ``rows`` are -1 for new requests, which release nothing)."""
    moved = (after > before).nonzero()[0]
    owners, cols = spans(after[moved] - before[moved], before[moved], rows[moved])
    dead = tables.table[owners, cols]
    live = dead != NULL_BLOCK
    return owners[live], cols[live], dead[live]


_NO_INTS: Ints = np.zeros(0, dtype=np.int64)
