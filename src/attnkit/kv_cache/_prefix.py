"""The prefix cache of a block manager: lookups (``PrefixMatch``), the hits a new
request starts from, and when a request's blocks get their names.

- A lookup (``PrefixCache.match``) names the prompt's full blocks once per distinct
  token layout, asks each group which of them it holds and combines the groups
  (``attnkit.prefix_cache.find_prefix_hit``). It changes nothing but the counters.
- A new request scheduled with its match starts with ``match.num_tokens`` computed
  tokens: its tables point at the hit blocks (one more holder each). The blocks are
  found again by name when the step is checked (``resolve``): one evicted since the
  match is a ``StalePrefixError``, and nothing changes.
- A request started with a match is **tracked**: the prompt blocks its steps fill are
  named once the step is done, i.e. at the manager's next ``commit`` (the runtime's next
  ``match_prefix``, ``begin_step`` or ``free``); ``discard`` drops them (a step whose
  model call failed). Blocks of generated tokens are named when the request is freed
  with its tokens: nothing is hashed on the decode path.
- Naming is lazy where it can be: a commit moves the request's watermark (its named
  tokens); the blocks of a group that keeps them (full attention, MLA, sinks) enter its
  map (``flush``) when something reads the map: a lookup, the request's free, a report,
  a step that shares blocks. A group that releases blocks (a window, a chunk) must know
  before a step frees them: a commit checks whether the coming step can release a
  block named but not marked (the kind's ``release_reach``: the tokens a request must
  hold for that) and then, or once the prompt is done, its slab marks every waiting
  block named and, with a block per page, defers the names (``CachedSlab.defer``) until
  something reads its map (the same readers, a register, a reclaim of idle pages). A
  long prompt in chunks thus marks a window group's names once per window, not per
  step, and a prefill step does no dict work per block in any group. In a run of
  repeated steps the run's releases name the blocks instead (``plan_release_names``),
  and the commits that would only move watermarks are skipped (``commit``).
- A request whose step was discarded, or that was live at a ``reset``, is never named
  again (its later blocks were computed over bytes no name describes).
- State groups (with ``state_checkpoints="step_end"``) keep ``CheckpointStore`` pages:
  a tracked request whose step ends its known prompt tokens on a checkpoint boundary
  ``L`` gets its state copied into a page named by the prompt's block name at ``L`` in
  the checkpoint layout (blocks of ``checkpoint_interval`` tokens), at the commit
  (before any later step runs); a hit restores it into the new request's own state
  page right after the step's allocation (``restore``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from typing_extensions import override

from ..errors import InvalidArgumentError, StalePrefixError
from ..kinds import Ints, KindRules, StepLens
from ..prefix_cache import (
    GroupHit,
    GroupLookup,
    Hasher,
    MultimodalInput,
    PrefixCacheCounters,
    PrefixCacheStats,
    PrefixHit,
    PrefixMiss,
    TokenLayout,
    Tokens,
    as_token_array,
    block_names,
    check_mm_inputs,
    find_prefix_hit,
    miss_causes,
    prefix_granularity,
    prefix_root,
)
from ._cached import CachedSlab, PageKeeper
from ._checkpoints import CheckpointStore
from ._groups import KVCacheGroup
from ._pool import NULL_BLOCK, Ints32

__all__ = ["OffloadHooks", "PrefixCache", "PrefixMatch"]


class OffloadHooks(Protocol):
    """What a lookup asks of a KV connector (the runtime's, docs/offload.md): whether
    it holds a group's block by name, and loading blocks into given kernel blocks (or
    checkpoint pages) of the group, awaited: ``True`` per block whose bytes are in
    place, ``False`` where the load failed (the block holds nothing usable)."""

    def contains(self, group_id: int, name: bytes) -> bool: ...

    def load(self, group_id: int, blocks: Sequence[int], names: Sequence[bytes]) -> list[bool]: ...


class TableView(Protocol):
    """One group's block tables as the manager keeps them (``_Tables``): the
    persistent ``[rows, width]`` table (replaced when it grows: read it each time) and
    each row's first live column (entries before it were released: null)."""

    table: Ints32
    first_live: Ints


class PrefixMatch:
    """What ``match_prefix`` found for a prompt: the hit, each group's own hit and why
    the hit is not longer, and the prompt's block names (made once, reused when the
    request runs). Schedule the request with it (``ScheduledRequest(..., prefix=match)``)
    to start from the hit; several requests may start from one match (parallel
    sampling shares its blocks).

    Attributes:
        num_tokens: the hit: the tokens the request starts with as computed (a multiple
            of every attention group's block size, at most ``num_prompt_tokens - 1``).
        num_prompt_tokens: the prompt's length.
        hit: the full result (``PrefixHit``: ``groups``, ``limiting``, ``reason``,
            ``minimum``, ``explain()``).
        cache_salt, adapter_id: as given to the lookup.
    """

    __slots__ = (
        "_cached",
        "_hit_blocks",
        "_hit_names",
        "_names",
        "_owner",
        "_root",
        "_salt_free",
        "adapter_id",
        "cache_salt",
        "checkpoint_junction",
        "hit",
        "mm_inputs",
        "tokens",
    )

    def __init__(
        self,
        *,
        owner: PrefixCache,
        hit: PrefixHit,
        tokens: npt.NDArray[np.uint32],
        root: bytes,
        mm_inputs: tuple[MultimodalInput, ...],
        names: dict[TokenLayout, tuple[bytes, ...]],
        salt_free: dict[TokenLayout, bytes | None],
        cached: tuple[npt.NDArray[np.bool_] | None, ...],
        hit_blocks: tuple[Ints | None, ...],
        hit_names: tuple[tuple[bytes, ...], ...],
        cache_salt: str | None,
        adapter_id: str | int | None,
        checkpoint_junction: int | None = None,
    ) -> None:
        self._owner = owner
        self.hit = hit
        self.tokens = tokens
        """The prompt's token ids (read only)."""
        self._root = root
        self.mm_inputs = mm_inputs
        """The prompt's multimodal inputs, sorted."""
        self._names = names
        self._salt_free = salt_free
        self._cached = cached
        self._hit_blocks = hit_blocks
        self._hit_names = hit_names
        self.cache_salt = cache_salt
        self.adapter_id = adapter_id
        self.checkpoint_junction = (
            hit.length if checkpoint_junction is None else checkpoint_junction
        )
        """With state checkpoints on: the longest prefix the model would serve if every
        state group had a checkpoint at each boundary (else ``num_tokens``). Above
        ``num_tokens``, only state checkpoints are missing: a step of this request that
        ends there takes them, so the next request with this prefix hits (``Engine``
        ends the request's first chunk there)."""

    @property
    def num_tokens(self) -> int:
        return self.hit.length

    @property
    def num_prompt_tokens(self) -> int:
        return self.hit.num_tokens

    @property
    def group_hits(self) -> tuple[GroupHit, ...]:
        """Each group's own hit (in group order)."""
        return self.hit.groups

    @property
    def limiting_group(self) -> int | None:
        """The id of the group that set the hit, or ``None`` (the model as a whole, or
        nothing, limited it)."""
        return self.hit.limiting

    @property
    def reason(self) -> PrefixMiss | None:
        """Why the hit is shorter than asked (``None``: it is not)."""
        return self.hit.reason

    def block_names(self, group_id: int) -> tuple[bytes, ...]:
        """The names of the prompt's full blocks in group ``group_id``'s layout (empty
        for a group that caches nothing).

        Raises:
            InvalidArgumentError: an unknown group id.
        """
        layout = self._layout(group_id)
        return () if layout is None else self._names[layout]

    def cached_blocks(self, group_id: int) -> npt.NDArray[np.bool_] | None:
        """Which of ``block_names(group_id)`` the group held at the lookup (``None`` for
        a group that caches nothing)."""
        self._layout(group_id)
        cached = self._cached[group_id]
        if cached is None:
            return None
        held: npt.NDArray[np.bool_] = np.array(cached)
        return held

    def _layout(self, group_id: int) -> TokenLayout | None:
        layouts = self._owner.layouts
        given: object = group_id  # untyped callers reach here too
        if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given < len(layouts):
            raise InvalidArgumentError(
                f"group_id must be a group id in 0..{len(layouts) - 1}, got {group_id!r}"
            )
        return layouts[group_id]

    def explain(self) -> str:
        """One line: the hit and, when it is short, which group limited it and why."""
        return self.hit.explain()

    @override
    def __str__(self) -> str:
        return self.explain()

    @override
    def __repr__(self) -> str:
        return (
            f"PrefixMatch(num_tokens={self.num_tokens}, num_prompt_tokens={self.num_prompt_tokens})"
        )


@dataclasses.dataclass(slots=True)
class PrefixHitTables:
    """A new request's start from its match, per group: the table entries (kernel block
    ids, null where a window or chunk needs nothing) and the first live entry."""

    index: int  # in the step's batch
    match: PrefixMatch
    tables: list[tuple[Ints32, int] | None]  # per group; None: nothing to install
    restores: list[tuple[int, int]] = dataclasses.field(default_factory=list[tuple[int, int]])
    """(state group id, checkpoint page) to copy into the request's state page."""


@dataclasses.dataclass(slots=True, eq=False)
class _Tracked:
    """A request started from a match: ``named`` tokens are committed (their full
    blocks are named), of which each group's map holds the first ``flushed[g]``
    blocks."""

    row: int
    match: PrefixMatch
    named: int
    flushed: list[int]
    names: list[tuple[bytes, ...]]  # per group: its layout's prompt block names
    tainted: bool = False
    prompt: int = 0  # match.num_prompt_tokens
    mark_at: int = 0
    """Tokens held at which a step can release a deferring group's first unmarked
    block (the least ``KindRules.release_reach`` over those groups)."""


ReleaseName = tuple[int, int, _Tracked, int]
"""``(start, end, tracked, column)``: ``PrefixCache.plan_release_names``."""


class PrefixCache:
    """The block manager's prefix cache (module docstring).

    Args:
        groups, rules: the manager's groups and their rules.
        slabs: per group its ``CachedSlab``, ``None`` for a group that caches nothing
            (state layers until they have checkpoints, kinds that never hit).
        hasher: the hash of block names.
        tables: per group the manager's block tables (``TableView``).
        num_tokens: the tokens the manager holds per row.
        stores: per group its ``CheckpointStore`` (state groups with checkpoints on),
            else ``None``; ``checkpoint_interval``: their boundaries' spacing.
    """

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        rules: Sequence[KindRules[Any]],
        slabs: Sequence[CachedSlab | None],
        hasher: Hasher,
        tables: Sequence[TableView],
        num_tokens: Ints,
        stores: Sequence[CheckpointStore | None] | None = None,
        checkpoint_interval: int | None = None,
    ) -> None:
        self.groups = tuple(groups)
        self.rules = tuple(rules)
        self.slabs = tuple(slabs)
        self.hasher = hasher
        self._tables = tuple(tables)
        self.row_tokens = num_tokens
        """The manager's tokens held per row (``int64 [rows]``, read only; the manager
        sets the new array when its rows grow)."""
        self.layouts: tuple[TokenLayout | None, ...] = tuple(
            None if slab is None else r.prefix_layout(g.spec)
            for g, r, slab in zip(self.groups, self.rules, self.slabs, strict=True)
        )
        self.stores: tuple[CheckpointStore | None, ...] = (
            tuple(stores) if stores is not None else (None,) * len(self.groups)
        )
        self._stores = [(gid, st) for gid, st in enumerate(self.stores) if st is not None]
        self.checkpoint_interval = checkpoint_interval if self._stores else None
        self.checkpoint_layout: TokenLayout | None = (
            TokenLayout(checkpoint_interval)
            if self._stores and checkpoint_interval is not None
            else None
        )
        """The layout checkpoints are named in (``None``: no checkpoints)."""
        self._distinct: tuple[TokenLayout, ...] = tuple(
            dict.fromkeys(lay for lay in (*self.layouts, self.checkpoint_layout) if lay is not None)
        )
        self.granularity = prefix_granularity(
            (g.spec for g in self.groups), checkpoint_interval=self.checkpoint_interval
        )
        self.copy_states: Callable[[int, list[int], list[int]], None] | None = None
        """``copy_states(group_id, sources, destinations)`` copies state pages (every
        state tensor of every layer of the group); set by the runtime (a manager
        without tensors leaves it ``None``)."""
        self.pending_checkpoints: list[tuple[_Tracked, int]] = []
        """The last step's checkpoint boundaries per request, taken at ``commit``."""
        self.counters = PrefixCacheCounters()
        self._fresh: list[tuple[CachedSlab | CheckpointStore, int]] = []
        """Pages lookups loaded since the last step (``_reload`` keeps them)."""
        self.offload: OffloadHooks | None = None
        """With a KV connector: a lookup loads the blocks and checkpoints the device
        lacks and the connector holds before it computes the hit (``_reload``)."""
        self._cached_groups = [
            (gid, slab, lay)
            for gid, (slab, lay) in enumerate(zip(self.slabs, self.layouts, strict=True))
            if slab is not None and lay is not None
        ]
        self._eager = [gid for gid, _, _ in self._cached_groups if self.rules[gid].releases]
        """The cached groups that release blocks: named at the commit."""
        self._lazy = len(self._eager) < len(self._cached_groups)
        self._block_layout = [
            (0, 1) if lay is None else (lay.shift, lay.block_size) for lay in self.layouts
        ]
        """Per group: its layout's (shift, block size) (``lay.full_blocks``, inlined)."""
        deferrable = [s is not None and s.blocks_per_page == 1 for s in self.slabs]
        self._reach: list[tuple[int, Callable[[Any, int], int], Any]] = [
            (gid, self.rules[gid].release_reach, self.groups[gid].spec)
            for gid in self._eager
            if deferrable[gid]
        ]
        """``(group id, its kind's release_reach, its spec)`` of the eager groups whose
        slabs defer names (``CachedSlab.defer``): ``_defer``."""
        self._flushing = [gid for gid in self._eager if not deferrable[gid]]
        """The other eager groups: named into their maps at the commit (``_flush``)."""
        self._waits = self._lazy or bool(self._reach)
        """Whether a commit can leave names waiting (``unflushed``)."""
        pools = [s.pool for s in self.slabs if s is not None]
        self._deferred: dict[CachedSlab, None] = pools[0].deferred if pools else {}
        """The slabs with deferred names (their pool's, shared)."""
        self._tracked: dict[int, _Tracked] = {}
        self._in_prompt: dict[int, _Tracked] = {}
        """Tracked rows whose prompt is not all computed yet."""
        self.pending = False
        """Whether tracked prompts filled tokens since the last ``commit`` (a step's
        allocation ran since), to be named there."""
        self.unflushed: dict[int, _Tracked] = {}
        """Rows with named blocks their groups' maps do not hold yet."""
        self.lagging = False
        """Whether the last step's allocation skipped its commit (``commit``)."""
        self._release_rows: list[_Tracked] = []
        """The rows whose blocks a run names as it releases them (``plan_release_names``)."""
        self._lag: list[tuple[_Tracked, int]] = []
        """The rows in their prompt of the run whose commits are skipped, each with the
        tokens each of its steps adds (``discard`` names what the skipped ones left)."""
        self._step_rows: Ints = np.zeros(0, dtype=np.int64)
        for slab in self.slabs:
            if slab is not None:
                slab._on_evict = self.counters.record_evictions
        for _, store in self._stores:
            store._on_evict = self.counters.record_evictions

    # ------------------------------------------------------------------ lookups

    def match(
        self,
        prompt_token_ids: Tokens,
        *,
        cache_salt: str | None = None,
        adapter_id: str | int | None = None,
        mm_inputs: Iterable[MultimodalInput | tuple[int, int, str | bytes]] = (),
    ) -> PrefixMatch:
        """Look ``prompt_token_ids`` up (the last step's blocks are committed first).

        Raises:
            ArgumentTypeError, InvalidArgumentError: token ids that are not ``uint32``
                values, an empty prompt, a bad salt, adapter id or multimodal input
                (the message names the argument).
        """
        if self.pending:
            self.commit()
        if self.unflushed or self._deferred:
            self.flush()
        tokens = as_token_array(prompt_token_ids, "prompt_token_ids")
        n = int(tokens.size)
        if n == 0:
            raise InvalidArgumentError("prompt_token_ids must hold at least one token, got none")
        mm = tuple(check_mm_inputs(mm_inputs, n))
        hasher = self.hasher
        root = prefix_root(hasher, cache_salt=cache_salt, adapter_id=adapter_id)
        names = {
            lay: tuple(block_names(tokens, lay, hasher, root, mm_inputs=mm))
            for lay in self._distinct
        }
        salt_free: dict[TokenLayout, bytes | None] = {}
        free_root = prefix_root(hasher, adapter_id=adapter_id) if cache_salt is not None else None
        for layout, got in names.items():
            if free_root is None:
                salt_free[layout] = got[0] if got else None
            else:
                first = block_names(tokens, layout, hasher, free_root, mm_inputs=mm, max_blocks=1)
                salt_free[layout] = first[0] if first else None
        device_hit = self._reload(names, n) if self.offload is not None else None
        lookups: list[GroupLookup] = []
        cached: list[npt.NDArray[np.bool_] | None] = []
        for group, slab, lay, store in zip(
            self.groups, self.slabs, self.layouts, self.stores, strict=True
        ):
            if store is not None:
                lookups.append(GroupLookup(group.spec, self._checkpoints_held(store, names, n)))
                cached.append(None)
                continue
            if slab is None or lay is None:
                # Kinds that never hit ignore it; a state group has no checkpoint.
                lookups.append(GroupLookup(group.spec, np.zeros(0, dtype=np.bool_)))
                cached.append(None)
                continue
            of = names[lay]
            held = np.fromiter(map(slab.block_of.__contains__, of), dtype=np.bool_, count=len(of))
            cause = miss_causes(
                of,
                evicted=slab.evicted,
                salt_free_first=salt_free[lay],
                cached_salt_free_firsts=slab.first_salt_free,
            )
            lookups.append(GroupLookup(group.spec, held, miss_cause=cause))
            cached.append(held)
        hit = find_prefix_hit(lookups, n, granularity=self.granularity)
        self.counters.record(hit)
        if device_hit is not None and hit.length > device_hit:
            self.counters.record_offload(hit_tokens=hit.length - device_hit)
        junction = None
        if self._stores and hit.length < hit.candidate:
            every = self._checkpoints_held(None, names, n)
            optimistic = [
                GroupLookup(g.spec, every) if st is not None else look
                for g, st, look in zip(self.groups, self.stores, lookups, strict=True)
            ]
            junction = find_prefix_hit(optimistic, n, granularity=self.granularity).length
        hit_blocks: list[Ints | None] = []
        hit_names: list[tuple[bytes, ...]] = []
        for group, rules, lay in zip(self.groups, self.rules, self.layouts, strict=True):
            if lay is None or hit.length == 0:
                hit_blocks.append(None)
                hit_names.append(())
                continue
            index = rules.prefix_blocks(group.spec, hit.length)
            hit_blocks.append(index)
            chain = names[lay]
            lo = int(index[0]) if index.size else 0
            if index.size and int(index[-1]) - lo + 1 == index.size:  # one run of blocks
                hit_names.append(chain[lo : lo + index.size])
            else:
                read: list[int] = index.tolist()
                hit_names.append(tuple([chain[i] for i in read]))
        return PrefixMatch(
            owner=self,
            hit=hit,
            tokens=tokens,
            root=root,
            mm_inputs=mm,
            names=names,
            salt_free=salt_free,
            cached=tuple(cached),
            hit_blocks=tuple(hit_blocks),
            hit_names=tuple(hit_names),
            cache_salt=cache_salt,
            adapter_id=adapter_id,
            checkpoint_junction=junction,
        )

    def _reload(self, names: dict[TokenLayout, tuple[bytes, ...]], n: int) -> int:
        """Load, from the KV connector into free or idle pages, the blocks and
        checkpoints of the longest hit that the device and the connector hold together,
        where the device lacks them; the pages of the hit the device holds are kept from
        eviction meanwhile. A load that fails leaves its page unnamed (free), so the
        lookup that follows sees only what is in place. Returns the hit the device held
        before (for the counters)."""
        hooks = self.offload
        assert hooks is not None
        device: list[GroupLookup] = []
        either: list[GroupLookup] = []
        for gid, (group, slab, lay, store) in enumerate(
            zip(self.groups, self.slabs, self.layouts, self.stores, strict=True)
        ):
            if store is not None:
                held = self._checkpoints_held(store, names, n)
                device.append(GroupLookup(group.spec, held))
                either.append(GroupLookup(group.spec, held | self._offloaded(gid, names, n)))
                continue
            if slab is None or lay is None:
                device.append(GroupLookup(group.spec, np.zeros(0, dtype=np.bool_)))
                either.append(device[-1])
                continue
            of = names[lay]
            held = np.fromiter(map(slab.block_of.__contains__, of), dtype=np.bool_, count=len(of))
            also: npt.NDArray[np.bool_] = np.array(held)
            absent: list[int] = np.flatnonzero(~held).tolist()
            for i in absent:
                also[i] = hooks.contains(gid, of[i])
            device.append(GroupLookup(group.spec, held))
            either.append(GroupLookup(group.spec, also))
        before = find_prefix_hit(device, n, granularity=self.granularity).length
        length = find_prefix_hit(either, n, granularity=self.granularity).length
        if length <= before:
            return before
        # What the hit reads: missing names to load, resident pages to keep meanwhile.
        loads: list[tuple[int, CachedSlab | CheckpointStore, list[bytes]]] = []
        # The pages earlier lookups loaded since the last step are kept too: a lookup
        # never evicts what another request's match, not yet scheduled, hits (the two
        # would evict each other's loads on every retry).
        keep: list[tuple[CachedSlab | CheckpointStore, int]] = list(self._fresh)
        for gid, slab, lay in self._cached_groups:
            of = names[lay]
            read: list[int] = self.rules[gid].prefix_blocks(self.groups[gid].spec, length).tolist()
            want = [of[i] for i in read]
            keep.extend((slab, slab.block_of[m]) for m in want if m in slab.block_of)
            missing = [m for m in want if m not in slab.block_of]
            if missing:
                loads.append((gid, slab, missing))
        if self._stores:
            name = self._checkpoint_names(names)[length // (self.checkpoint_interval or 1) - 1]
            for gid, store in self._stores:
                page = store.block_of.get(name)
                if page is None:
                    loads.append((gid, store, [name]))
                else:
                    keep.append((store, page))
        pool = loads[0][1].pool
        idle = pool.idle
        kept: list[tuple[int, PageKeeper]] = []
        kept_free: list[tuple[CachedSlab, int]] = []
        for keeper, block in keep:
            k = keeper.blocks_per_page if isinstance(keeper, CachedSlab) else 1
            page = block // k
            owner = idle.pop(page, None)
            if owner is not None:
                kept.append((page, owner))
            if isinstance(keeper, CachedSlab) and k > 1 and block in keeper._named_free:
                del keeper._named_free[block]
                kept_free.append((keeper, block))
        loaded = failed = 0
        try:
            for gid, keeper, wanted in loads:
                if isinstance(keeper, CheckpointStore):
                    if pool.num_available < 1:
                        continue
                    page = keeper.take(wanted[0])
                    assert page is not None
                    if hooks.load(gid, [page], wanted)[0]:
                        loaded += 1
                        self._fresh.append((keeper, page))
                    else:
                        failed += 1
                        keeper.discard(page)
                    continue
                k = keeper.blocks_per_page
                room = pool.num_available * k
                if k > 1:
                    room += keeper.num_free_unnamed + keeper.num_free_named
                wanted = wanted[:room]
                if not wanted:
                    continue
                taken = keeper.take(len(wanted)) if k > 1 else pool.take(len(wanted))
                blocks: list[int] = taken.tolist() if isinstance(taken, np.ndarray) else taken
                ok = hooks.load(gid, blocks, wanted)
                good = [(b, m) for b, m, fine in zip(blocks, wanted, ok, strict=True) if fine]
                loaded += len(good)
                failed += len(blocks) - len(good)
                if good:
                    keeper.register([b for b, _ in good], [m for _, m in good], None)
                    self._fresh.extend((keeper, b) for b, _ in good)
                keeper.give_back(blocks)  # named: idle (cached); failed: free
        finally:
            for page, owner in kept:
                idle[page] = owner
            for keeper, block in kept_free:
                keeper._named_free[block] = None
        self.counters.record_offload(loaded=loaded, failed=failed)
        return before

    def _checkpoint_names(self, names: dict[TokenLayout, tuple[bytes, ...]]) -> tuple[bytes, ...]:
        layout = self.checkpoint_layout
        assert layout is not None
        return names[layout]

    def _offloaded(
        self, gid: int, names: dict[TokenLayout, tuple[bytes, ...]], n: int
    ) -> npt.NDArray[np.bool_]:
        """By length: whether the connector holds group ``gid``'s checkpoint there."""
        hooks = self.offload
        held = np.zeros(n, dtype=np.bool_)
        interval = self.checkpoint_interval
        if hooks is None or interval is None:
            return held
        for i, name in enumerate(self._checkpoint_names(names)):
            end = (i + 1) * interval
            if end < n and hooks.contains(gid, name):
                held[end] = True
        return held

    def _checkpoints_held(
        self,
        store: CheckpointStore | None,
        names: dict[TokenLayout, tuple[bytes, ...]],
        n: int,
    ) -> npt.NDArray[np.bool_]:
        """By length, for a prompt of ``n`` tokens: whether ``store`` (``None``: any
        store) holds a checkpoint after that many tokens."""
        held = np.zeros(n, dtype=np.bool_)
        layout, interval = self.checkpoint_layout, self.checkpoint_interval
        if layout is None or interval is None:
            return held
        of = names[layout]
        if store is None:
            ends = np.arange(1, len(of) + 1, dtype=np.int64) * interval
        else:
            ends = (np.flatnonzero([name in store.block_of for name in of]) + 1) * interval
        held[ends[ends < n]] = True
        return held

    def checkpoint_name(self, match: PrefixMatch, length: int) -> bytes:
        """The name of the checkpoint after ``length`` tokens of ``match``'s prompt (a
        boundary within it)."""
        layout, interval = self.checkpoint_layout, self.checkpoint_interval
        assert layout is not None
        assert interval is not None
        assert length % interval == 0
        return match._names[layout][length // interval - 1]

    def resolve(
        self, req_ids: Sequence[str], prefixes: Sequence[PrefixMatch | None], lens: StepLens
    ) -> list[PrefixHitTables]:
        """The hit tables of the step's new requests that bring a match, found by name
        now (nothing changes).

        Raises:
            StalePrefixError: a match of another cache, or one whose blocks were evicted
                (or the cache reset) since it was made.
        """
        hits: list[PrefixHitTables] = []
        for i, match in enumerate(prefixes):
            if match is None:
                continue
            if match._owner is not self:
                raise StalePrefixError(
                    f"request {req_ids[i]!r}: its prefix was matched by another runtime's "
                    f"prefix cache; match the prompt with this runtime's match_prefix"
                )
            length = match.num_tokens
            restores: list[tuple[int, int]] = []
            if length:
                for gid, store in self._stores:
                    page = store.block_of.get(self.checkpoint_name(match, length))
                    if page is None:
                        raise StalePrefixError(
                            f"request {req_ids[i]!r}: the state checkpoint at token {length} "
                            f"of group {gid} ({self.groups[gid].kind.value}) that its prefix "
                            f"match hits was evicted since match_prefix (or the prefix cache "
                            f"was reset); nothing was changed: match the prompt again"
                        )
                    restores.append((gid, page))
            tables: list[tuple[Ints32, int] | None] = []
            for gid, (group, rules, slab, lay) in enumerate(
                zip(self.groups, self.rules, self.slabs, self.layouts, strict=True)
            ):
                if length == 0 or slab is None or lay is None:
                    # A hit > 0 means every group with a cache serves it (each is cached).
                    tables.append(None)
                    continue
                index = match._hit_blocks[gid]
                assert index is not None
                blocks: list[int] = []
                for b, name in zip(index.tolist(), match._hit_names[gid], strict=True):
                    block = slab.block_of.get(name)
                    if block is None:
                        start, end = lay.tokens_of(b)
                        raise StalePrefixError(
                            f"request {req_ids[i]!r}: block {b} (tokens {start}..{end - 1}) "
                            f"of group {gid} ({group.kind.value}) that its prefix match hits "
                            f"was evicted since match_prefix (or the prefix cache was reset); "
                            f"nothing was changed: match the prompt again"
                        )
                    blocks.append(block)
                width = lay.full_blocks(length)
                entries = np.zeros(width, dtype=np.int32)
                entries[index] = blocks
                one = StepLens(
                    np.array([length], dtype=np.int64),
                    lens.query[i : i + 1],
                    np.zeros(1, dtype=np.int64),
                )
                live = int(index[0]) if index.size else width
                if rules.releases:  # entries no query of the step sees start released
                    first = int(rules.first_live_block(group.spec, one)[0])
                    if first > live:
                        entries[live:first] = NULL_BLOCK
                        live = first
                tables.append((entries, min(live, width)))
            hits.append(PrefixHitTables(i, match, tables, restores))
        return hits

    def restore(self, hits: Sequence[PrefixHitTables], rows: Ints) -> None:
        """After a step's allocation: copy each hit's checkpoints into its request's
        state pages (``pin``-ned by the caller before the allocation), then unpin."""
        copies: dict[int, tuple[list[int], list[int]]] = {}
        for hit in hits:
            row = int(rows[hit.index])
            for gid, page in hit.restores:
                src, dst = copies.setdefault(gid, ([], []))
                src.append(page)
                dst.append(int(self._tables[gid].table[row, 0]))
        if self.copy_states is not None:
            for gid, (src, dst) in copies.items():
                self.copy_states(gid, src, dst)
        for _, store in self._stores:
            store.unpin()

    # ------------------------------------------------------------------ requests

    def track(self, row: int, match: PrefixMatch) -> None:
        """Row ``row`` starts from ``match``: its prompt blocks get names as they fill
        (its hit's blocks have theirs)."""
        flushed = [0] * len(self.groups)
        names: list[tuple[bytes, ...]] = [()] * len(self.groups)
        for gid, _, lay in self._cached_groups:
            flushed[gid] = lay.full_blocks(match.num_tokens) if match.num_tokens else 0
            names[gid] = match._names[lay]
        tracked = _Tracked(
            row, match, match.num_tokens, flushed, names, False, match.hit.num_tokens
        )
        if self._reach:
            tracked.mark_at = min(reach(spec, flushed[gid]) for gid, reach, spec in self._reach)
        self._tracked[row] = tracked
        self._in_prompt[row] = tracked

    def note_step(self, rows: Ints) -> None:
        """After a step's allocation: its rows (``discard`` taints them). The prompt
        tokens tracked requests filled are named at the next ``commit``."""
        self._step_rows = rows
        if self._fresh:
            self._fresh.clear()  # the step's hits hold what they read
        if self._in_prompt:
            self.pending = True

    # ------------------------------------------------------- runs of repeated steps

    def plan_release_names(
        self, first_live: Sequence[Ints], releases: Sequence[tuple[int, Ints, Ints, list[int]]]
    ) -> dict[int, list[list[ReleaseName]]]:
        """For a run of repeated steps (``KVCacheManager._plan_run``): name a tracked
        prompt's blocks as the run releases them, not before (``defer_released``).

        ``releases``: per deferring group with releases in the run, ``(group id, owners,
        columns, bounds)`` of the entries each step ``k`` releases (``bounds[k]`` to
        ``bounds[k + 1]``, in batch order, a row's in column order); ``first_live``: per
        group, each row's first live column now. A row in its prompt takes part when
        every deferring group has marked its blocks up to its first live one at least;
        its commits then mark nothing (``mark_at`` is lifted until ``end_release_names``),
        so the run's steps carry the marks, each the entries of that step. Returns, per
        group, per step, ``(start, end, tracked, column)``: the step's entries ``start..
        end - 1`` are the row's prompt blocks from ``column`` on."""
        self.end_release_names()
        if not self._in_prompt or not self._reach or self.checkpoint_interval is not None:
            return {}
        rows = [
            tracked
            for row, tracked in self._in_prompt.items()
            if not tracked.tainted
            and all(tracked.flushed[gid] >= int(first_live[gid][row]) for gid, _, _ in self._reach)
        ]
        if not rows:
            return {}
        deferring = {gid for gid, _, _ in self._reach}
        out: dict[int, list[list[ReleaseName]]] = {}
        for gid, owners, cols, bounds in releases:
            if gid not in deferring:
                continue
            lay = self.layouts[gid]
            assert lay is not None
            per_step: list[list[ReleaseName]] = [[] for _ in range(len(bounds) - 1)]
            bound = np.asarray(bounds, dtype=np.int64)
            for tracked in rows:
                limit = lay.full_blocks(tracked.prompt)
                at = np.flatnonzero((owners == tracked.row) & (cols < limit))
                if not at.size:
                    continue
                step_of = np.searchsorted(bound, at, side="right") - 1
                cuts = (np.flatnonzero(np.diff(step_of)) + 1).tolist()
                for i0, i1 in zip([0, *cuts], [*cuts, at.size], strict=True):
                    k = int(step_of[i0])  # the row's entries of step k: at[i0..i1 - 1]
                    lo = bounds[k]
                    first = int(at[i0])
                    per_step[k].append(
                        (first - lo, int(at[i1 - 1]) + 1 - lo, tracked, int(cols[first]))
                    )
            out[gid] = per_step
        for tracked in rows:
            tracked.mark_at = 1 << 62
        self._release_rows = rows
        return out

    def defer_released(self, gid: int, dead: Ints32, names: Sequence[ReleaseName]) -> None:
        """A run's step releases ``dead`` (its entries of group ``gid``, in order, before
        they go back): the prompt blocks among them (``plan_release_names``) get their
        names deferred first, so that they go back cached."""
        slab = self.slabs[gid]
        assert slab is not None
        for start, end, tracked, col in names:
            flushed = tracked.flushed
            first = flushed[gid]  # (a lookup may have named some since: they are)
            stop = col + end - start
            if tracked.tainted or first >= stop:
                continue
            skip = first - col if first > col else 0
            col += skip
            salt_free = None
            if col == 0:
                lay = self.layouts[gid]
                assert lay is not None
                salt_free = tracked.match._salt_free[lay]
            slab.defer(dead[start + skip : end], tracked.names[gid], col, salt_free)
            flushed[gid] = stop

    def end_release_names(self) -> None:
        """The run of ``plan_release_names`` is over: its rows' commits mark again."""
        if not self._release_rows:
            return
        rows, self._release_rows = self._release_rows, []
        tokens = self.row_tokens
        for tracked in rows:
            if self._in_prompt.get(tracked.row) is not tracked:
                continue  # freed, tainted or done since
            tracked.mark_at = min(
                reach(spec, tracked.flushed[gid]) for gid, reach, spec in self._reach
            )
            held = int(tokens[tracked.row])
            if held >= tracked.mark_at:  # the coming step can release one: marked now
                self._mark(tracked, held)

    def skip_commit(self) -> None:
        """Skip a commit that ``commit`` counted as quiet (``pending`` stays set)."""
        self.lagging = True

    def commit(self, pos: dict[int, int] | None = None, query: Ints | None = None) -> int:
        """The last step is done: the prompt blocks it filled are named (lazily: see
        the module docstring); the state checkpoints it reached are taken.

        A releasing group's new names wait, like a keeping group's, unless the coming
        step can release one (the request holds at least ``KindRules.release_reach`` of
        the group's first unmarked block) or the prompt is done; then every name
        waiting is marked at once (``_defer``).

        In a run of repeated steps (each adds ``query[i]`` tokens to the row at
        ``pos[row] == i``), returns how many of the next commits would only move
        watermarks (no name to mark, no prompt done, no checkpoint; else 0). The manager
        skips them (``skip_commit``), ``pending`` staying set: the next reader (a lookup,
        a free, a step that is not the run's) or the next commit due makes them at once,
        as a commit reads the tokens held. ``discard`` makes the ones skipped before a
        discarded step first."""
        self.pending = self.lagging = False
        if self.checkpoint_interval is not None:
            self._commit_with_checkpoints()
            return 0
        held_at = self.row_tokens.item
        done: list[int] | None = None
        flushing, waits, unflushed = self._flushing, self._waits, self.unflushed
        lag: list[tuple[_Tracked, int]] = []
        quiet = 0 if pos is None or flushing else 1 << 30
        for row, tracked in self._in_prompt.items():
            held: int = held_at(row)
            if held < tracked.prompt:  # (``_name``, inlined: this runs every step)
                if held > tracked.named:
                    tracked.named = held
                    if held >= tracked.mark_at:
                        self._mark(tracked, held)
                    for gid in flushing:
                        self._flush(tracked, gid)
                    if waits:
                        unflushed[row] = tracked
                if quiet and pos is not None and query is not None:
                    i = pos.get(row)
                    if i is not None:  # (else not in the run: it holds what it holds)
                        q: int = query.item(i)
                        # the next commit reads held + q
                        due = min(tracked.mark_at, tracked.prompt) - held - q
                        quiet = min(quiet, -(-due // q)) if due > 0 and q > 0 else 0
                        lag.append((tracked, q))
                continue
            if tracked.prompt > tracked.named:  # the prompt is done
                self._name(tracked, tracked.prompt, held)
            if done is None:
                done = []
            done.append(row)
        if done is not None:
            for row in done:
                del self._in_prompt[row]
        if pos is not None:
            self._lag = lag
        return quiet

    def _commit_with_checkpoints(self) -> None:
        """``commit`` with state checkpoints: the checkpoints the last step reached are
        taken before its blocks are named."""
        tokens = self.row_tokens
        interval = self.checkpoint_interval
        assert interval is not None
        filled_now: list[tuple[_Tracked, int, int]] = []
        done: list[int] = []
        for row, tracked in self._in_prompt.items():
            n = tracked.prompt
            held = int(tokens[row])
            filled = held if held < n else n
            if filled > tracked.named:
                filled_now.append((tracked, filled, held))
                if held == filled and filled % interval == 0:
                    self.pending_checkpoints.append((tracked, filled))
            if filled >= n:
                done.append(row)
        for row in done:
            del self._in_prompt[row]
        if self.pending_checkpoints:
            self._take_checkpoints()
        for tracked, filled, held in filled_now:
            self._name(tracked, filled, held)

    def _name(self, tracked: _Tracked, filled: int, held: int) -> None:
        """``tracked``'s prompt is computed up to ``filled`` of the ``held`` tokens."""
        tracked.named = filled
        if held >= tracked.mark_at or filled >= tracked.prompt:
            self._mark(tracked, held)
        for gid in self._flushing:
            self._flush(tracked, gid)
        if self._waits:
            self.unflushed[tracked.row] = tracked

    def _mark(self, tracked: _Tracked, held: int) -> None:
        """Mark (``_defer``) the waiting names of each deferring group whose coming step
        (at ``held`` tokens) can release one, every one of them at a done prompt; then
        the tokens at which that is next so."""
        flushed = tracked.flushed
        done = tracked.named >= tracked.prompt
        if len(self._reach) == 1:  # (the common case: one window or chunk group)
            # The commit's ``held >= tracked.mark_at`` was this group's test; a name
            # marked early is only marked sooner (``flush`` may have moved ``flushed``).
            gid, reach, spec = self._reach[0]
            self._defer(tracked, gid)
            tracked.mark_at = reach(spec, flushed[gid])
            return
        mark_at = 1 << 62
        for gid, reach, spec in self._reach:
            if done or held >= reach(spec, flushed[gid]):
                self._defer(tracked, gid)
            at = reach(spec, flushed[gid])
            if at < mark_at:
                mark_at = at
        tracked.mark_at = mark_at

    def _take_checkpoints(self) -> None:
        """Copy the state of each request whose last step ended on a boundary into a
        new checkpoint page per state group (all of them or none: a hit needs every
        state group's), unless the pool has no free or idle page left."""
        copies: dict[int, tuple[list[int], list[int]]] = {}
        for tracked, length in self.pending_checkpoints:
            if tracked.tainted or self._tracked.get(tracked.row) is not tracked:
                continue
            name = self.checkpoint_name(tracked.match, length)
            missing = [(gid, st) for gid, st in self._stores if name not in st.block_of]
            if not missing:
                continue
            if missing[0][1].pool.num_available < len(missing):
                for _, store in missing:
                    store.skipped += 1
                continue
            for gid, store in missing:
                page = store.take(name)
                assert page is not None
                src, dst = copies.setdefault(gid, ([], []))
                src.append(int(self._tables[gid].table[tracked.row, 0]))
                dst.append(page)
        self.pending_checkpoints.clear()
        if self.copy_states is not None:
            for gid, (src, dst) in copies.items():
                self.copy_states(gid, src, dst)

    @property
    def needs_flush(self) -> bool:
        """Whether named blocks wait for their maps (``flush`` puts them in)."""
        return bool(self.unflushed or self._deferred)

    def flush(self) -> None:
        """Put every named block into its group's map."""
        for tracked in list(self.unflushed.values()):
            self._flush(tracked, None)
        for slab in list(self._deferred):
            slab.settle()

    def _defer(self, tracked: _Tracked, gid: int) -> None:
        """``_flush(tracked, gid)`` for a group whose slab defers names: the blocks are
        marked named now (a release makes them cached), the maps get them later."""
        flushed = tracked.flushed
        start = flushed[gid]
        shift, size = self._block_layout[gid]
        end = (tracked.named + shift) // size  # lay.full_blocks, inlined
        if end <= start:
            return
        tables = self._tables[gid]
        row = tracked.row
        if tables.first_live.item(row) > start:  # a released entry (null) before it was
            self._flush(tracked, gid)  # named: rare
            return
        # Entries past the first live column hold blocks; copied, as a release nulls them.
        view: Ints32 = tables.table[row, start:end]
        entries: Ints32 = np.array(view)
        slab = self.slabs[gid]
        assert slab is not None
        salt_free = None
        if start == 0:
            lay = self.layouts[gid]
            assert lay is not None
            salt_free = tracked.match._salt_free[lay]
        slab.defer(entries, tracked.names[gid], start, salt_free)
        flushed[gid] = end

    def _flush(self, tracked: _Tracked, only: int | None) -> None:
        """Put ``tracked``'s named blocks into their maps (``only``: one group's)."""
        for gid, slab, lay in self._cached_groups:
            if only is not None and gid != only:
                continue
            start = tracked.flushed[gid]
            end = (tracked.named + lay.shift) // lay.block_size  # lay.full_blocks, inlined
            if end <= start:
                continue
            entries = self._tables[gid].table[tracked.row, start:end]
            blocks: list[int] = entries.tolist()
            names: Sequence[bytes] = tracked.names[gid][start:end]
            if NULL_BLOCK in blocks:
                pairs = [(b, m) for b, m in zip(blocks, names, strict=True) if b != NULL_BLOCK]
                blocks, names = [b for b, _ in pairs], [m for _, m in pairs]
            salt_free = tracked.match._salt_free[lay] if start == 0 else None
            if len(blocks) == end - start:  # no null entry: the table's row, as it is
                slab.register(blocks, names, salt_free, entries)
            elif blocks:
                slab.register(blocks, names, salt_free)
            tracked.flushed[gid] = end
        if only is None:
            self.unflushed.pop(tracked.row, None)

    def discard(self) -> None:
        """The last step's model call failed: its blocks are not named, and its tracked
        requests are never named again."""
        if self.lagging:  # the commits skipped before it: what the run's steps left
            self.lagging = False
            tokens = self.row_tokens
            for tracked, q in self._lag:
                held = int(tokens[tracked.row]) - q
                if held > tracked.named and not tracked.tainted:
                    tracked.named = held  # (below every mark and the prompt's end)
                    if self._waits:
                        self.unflushed[tracked.row] = tracked
        self.pending = False
        self.pending_checkpoints.clear()
        for row in self._step_rows.tolist():
            self._taint(row)

    def _taint(self, row: int) -> None:
        tracked = self._tracked.get(row)
        if tracked is None:
            return
        tracked.tainted = True
        if self._in_prompt.pop(row, None) is not None:
            for gid, _, _ in self._reach:  # its committed names stay good: marked now,
                self._defer(tracked, gid)  # as no commit looks at the row again

    def check_tokens(self, row: int, req_id: str, token_ids: Tokens) -> npt.NDArray[np.uint32]:
        """``token_ids`` given for a request at its free: its tokens, prompt first.

        Raises:
            ArgumentTypeError, InvalidArgumentError: not token ids, or not starting with
                the prompt its match was made from (the message names ``token_ids``).
        """
        where = f"token_ids[{req_id!r}]"
        tokens = as_token_array(token_ids, where)
        tracked = self._tracked.get(row)
        if tracked is None:
            return tokens
        prompt = tracked.match.tokens
        if tokens.size < prompt.size or not np.array_equal(tokens[: prompt.size], prompt):
            raise InvalidArgumentError(
                f"{where} must be the request's tokens, starting with the {prompt.size}-token "
                f"prompt its prefix match was made from; got {tokens.size} token(s) that do "
                f"not start with it"
            )
        return tokens

    def forget(self, row: int, num_tokens: int, tokens: npt.NDArray[np.uint32] | None) -> None:
        """Row ``row`` is being freed (its blocks are still in its tables): name the full
        blocks of its generated tokens first, when ``tokens`` (checked) are given."""
        tracked = self._tracked.get(row)
        if tracked is None:
            return
        if row in self.unflushed:
            self._flush(tracked, None)
        del self._tracked[row]
        self._in_prompt.pop(row, None)
        if tokens is None or tracked.tainted:
            return
        match = tracked.match
        known = min(num_tokens, int(tokens.size))
        made: dict[TokenLayout, tuple[int, list[bytes]]] = {}
        for gid, slab, lay in self._cached_groups:
            first, end = lay.full_blocks(match.num_prompt_tokens), lay.full_blocks(known)
            if end <= first:
                continue
            if lay not in made:
                start = lay.tokens_of(first)[0]
                prompt_names = match._names[lay]
                parent = prompt_names[first - 1] if first else match._root
                made[lay] = (
                    first,
                    block_names(
                        tokens[start:known],
                        lay,
                        self.hasher,
                        parent,
                        first_block=first,
                        mm_inputs=match.mm_inputs,
                    ),
                )
            blocks: list[int] = self._tables[gid].table[row, first:end].tolist()
            names = made[lay][1]
            pairs = [(b, m) for b, m in zip(blocks, names, strict=True) if b != NULL_BLOCK]
            if pairs:
                slab.register([b for b, _ in pairs], [m for _, m in pairs], None)

    def reset(self) -> int:
        """Drop every name (weights changed); live requests are never named again.
        Returns the names dropped."""
        self.pending = self.lagging = False
        self.pending_checkpoints.clear()
        self.unflushed.clear()
        self._fresh.clear()
        self.flush()  # the deferred names, made to be dropped with the others
        self._in_prompt.clear()  # (so the taints below mark no names to be dropped)
        for row in list(self._tracked):
            self._taint(row)
        dropped = sum(store.reset() for _, store in self._stores)
        return dropped + sum(slab.reset() for slab in self.slabs if slab is not None)

    def stats(self) -> PrefixCacheStats:
        """The counters, with the named blocks now (in use or free) and the free ones."""
        if self.unflushed or self._deferred:
            self.flush()
        slabs = [s for s in self.slabs if s is not None]
        return dataclasses.replace(
            self.counters.stats(),
            cached_blocks=sum(len(s.name_of) for s in slabs),
            cached_free_blocks=sum(s.num_cached_free() for s in slabs),
            checkpoints=sum(len(st.name_of) for _, st in self._stores),
        )
