"""Speculative decoding in the runtime: the drafts a step brings
(``ScheduledRequest.num_draft_tokens``), the state layers' verify path, and ``accept``,
which takes rejected drafts back (docs/speculative.md).

Attention layers need nothing at the step: a verify step is a step whose requests have
``1 + k`` new tokens, served by each backend's decode path. ``accept`` then lowers each
request's length to its accepted tokens (``KVCacheManager.take_back``). A state layer's
state has advanced past every draft once its kernel ran, so in a step with drafts it
runs as sub-steps: first every request's tokens up to its first draft (the backend's
own path, prefills included), then one token per drafting request and draft position
(decodes); after each draft position but the last the states of the requests drafting
further are copied into per-layer draft buffers (``num_speculative_tokens`` states per
request slot, counted in the memory budget and ``memory_report``), and ``accept``
copies the accepted position's state back into the request's state page.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch

from ..errors import (
    ArgumentTypeError,
    DuplicateRequestError,
    EngineLimitError,
    InvalidArgumentError,
    StaleStepError,
)
from ..impl import StateImpl
from ..kinds import Ints, StepLens, spans
from ..kv_cache import KVCacheGroup
from ..metadata import CommonAttentionMetadata, DraftTreeMask
from ..state_inputs import StateInputs
from ._base import RuntimeBase

__all__ = [
    "SpeculativeCalls",
    "VerifyStep",
    "draft_state_bytes",
    "draft_tree_mask",
    "step_drafts",
    "tree_ancestors",
    "tree_depths",
]

# torch.from_numpy, typed (torch leaves its parameter unannotated).
_from_numpy: Callable[[np.ndarray[Any, Any]], torch.Tensor] = torch.from_numpy  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]


@dataclasses.dataclass(frozen=True)
class _SubStep:
    """One sub-step of a state group's verify path.

    Attributes:
        tokens: int64 ``[n]``: the step's token rows it runs (device).
        metadata: the group's backend metadata for those tokens alone.
        keep_blocks, keep_slots: int64: the state blocks whose state after this
            sub-step is kept, and the draft-buffer rows it goes to (``None``: none).
        load_blocks, load_slots: int64: draft trees only, the state blocks that first
            take the state of the draft's parent from these draft-buffer rows (the
            page holds the previous draft's state; ``None``: every parent is that).
    """

    tokens: torch.Tensor
    metadata: Any
    keep_blocks: torch.Tensor | None
    keep_slots: torch.Tensor | None
    load_blocks: torch.Tensor | None = None
    load_slots: torch.Tensor | None = None


@dataclasses.dataclass
class VerifyStep:
    """The drafts of the current step (``None`` on the runtime when it has none).

    Attributes:
        drafts: draft tokens per request, in batch order.
        rows: the requests' manager rows, in batch order.
        computed: tokens each held before the step.
        query: tokens each was scheduled.
        sub_steps: state group id -> its sub-steps.
        state_blocks: state group id -> int64 ``[B]``: each request's state block.
        trees: per request its ``draft_parents`` when some request's drafts are a
            tree (``None`` for a chain), else ``None``.
    """

    drafts: Ints
    rows: Ints
    computed: Ints
    query: Ints
    sub_steps: dict[int, list[_SubStep]]
    state_blocks: dict[int, Ints]
    trees: list[tuple[int, ...] | None] | None = None
    accepted: bool = False


def draft_state_bytes(groups: Sequence[KVCacheGroup], k: int, max_num_reqs: int) -> int:
    """Bytes of the state layers' draft buffers: ``k`` states per request slot per
    state layer (0 without drafts or state layers)."""
    if k <= 0:
        return 0
    total = 0
    for group in groups:
        for shape, dtype in _state_shapes(group):
            total += math.prod(shape) * _itemsize(dtype) * len(group.layer_names)
    return total * k * max_num_reqs


def _state_shapes(group: KVCacheGroup) -> list[tuple[tuple[int, ...], torch.dtype]]:
    shapes: object = getattr(group.spec, "shapes", None)
    dtypes: object = getattr(group.spec, "dtypes", None)
    if not group.has_cache or not isinstance(shapes, tuple) or not isinstance(dtypes, tuple):
        return []
    # A state spec's fields (MambaSpec), read without naming its class.
    state_shapes = cast("tuple[tuple[int, ...], ...]", shapes)
    state_dtypes = cast("tuple[torch.dtype, ...]", dtypes)
    return list(zip(state_shapes, state_dtypes, strict=True))


def _rows(value: Any, tokens: torch.Tensor) -> Any:
    """A state input field's rows ``tokens`` (a field that is not a tensor as is)."""
    return value.index_select(0, tokens) if isinstance(value, torch.Tensor) else value


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def step_drafts(
    runtime: RuntimeBase, scheduled: Sequence[Any], ids: Sequence[str], rows: Ints
) -> tuple[Ints, list[tuple[int, ...] | None] | None] | None:
    """The drafts of a step's requests and, when some request's drafts are a tree, each
    request's parents (``None`` for chains); ``None`` when no request brings drafts.
    Checked before anything changes: at most ``config.num_speculative_tokens``, none on
    a request's first step (``rows`` -1), trees only up to ``config.draft_tree_width``."""
    drafts = np.fromiter(
        (r.num_draft_tokens for r in scheduled), dtype=np.int64, count=len(scheduled)
    )
    if not drafts.any():
        return None
    limit = runtime.config.num_speculative_tokens
    over = np.flatnonzero(drafts > limit)
    if over.size:
        i = int(over[0])
        raise EngineLimitError(
            f"request {ids[i]!r} brings {int(drafts[i])} draft tokens; AttentionConfig."
            f"num_speculative_tokens={limit} allows at most that many per step"
        )
    fresh = np.flatnonzero((drafts > 0) & (rows < 0))
    if fresh.size:
        raise InvalidArgumentError(
            f"request {ids[int(fresh[0])]!r} brings draft tokens on its first step: drafts "
            f"follow a request's last sampled token, so its prompt comes first"
        )
    trees = [r.draft_parents if r.is_tree else None for r in scheduled]
    if not any(t is not None for t in trees):
        return drafts, None
    if runtime.context_parallel is not None:
        i = next(i for i, t in enumerate(trees) if t is not None)
        raise InvalidArgumentError(
            f"request {ids[i]!r}: draft_parents makes a draft tree, which a context-parallel "
            f"runtime does not take (an accepted path's keys would move between ranks)"
        )
    width = runtime.config.draft_tree_width
    for i, parents in enumerate(trees):
        if parents is None:
            continue
        widest = int(np.bincount(tree_depths(parents)).max())
        if widest > width:
            raise EngineLimitError(
                f"request {ids[i]!r}: draft_parents makes a tree with {widest} draft tokens "
                f"at one depth; AttentionConfig.draft_tree_width={width} allows at most that "
                f"many" + (" (1: drafts are chains)" if width == 1 else "")
            )
    return drafts, trees


def tree_depths(parents: Sequence[int]) -> Ints:
    """Each draft token's depth (the root, its parent -1, is depth 0; its children 1)."""
    depth = np.zeros(len(parents), dtype=np.int64)
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    return depth


def tree_ancestors(parents: Sequence[int]) -> list[int]:
    """Each draft token's bitmask of the drafts it sees: its ancestors and itself."""
    masks: list[int] = []
    for i, p in enumerate(parents):
        masks.append((masks[p] if p >= 0 else 0) | (1 << i))
    return masks


def draft_tree_mask(
    trees: Sequence[tuple[int, ...] | None],
    drafts: Ints,
    query: Ints,
    to_device: Callable[[torch.Tensor], torch.Tensor],
) -> DraftTreeMask:
    """The step's ``DraftTreeMask``: requests in batch order, a chain where ``trees``
    holds ``None``."""
    ends = np.cumsum(query)
    ancestors = np.zeros(int(ends[-1]) if ends.size else 0, dtype=np.int64)
    for b, nd in enumerate(drafts.tolist()):
        if not nd:
            continue
        parents = trees[b]
        masks = tree_ancestors(parents if parents is not None else tuple(range(-1, nd - 1)))
        end = int(ends[b])
        ancestors[end - nd : end] = masks
    anc_cpu = _from_numpy(ancestors)
    nd_cpu = _from_numpy(drafts.astype(np.int32))
    return DraftTreeMask(
        ancestors=to_device(anc_cpu),
        num_drafts=to_device(nd_cpu),
        ancestors_cpu=anc_cpu,
        num_drafts_cpu=nd_cpu,
    )


class SpeculativeCalls(RuntimeBase):
    """``AttentionRuntime``'s speculative part: ``accept`` and the state layers'
    verify path."""

    _verify: VerifyStep | None
    _draft_states: dict[str, tuple[torch.Tensor, ...]]
    _state_groups: frozenset[int]

    def _allocate_draft_states(self) -> None:
        """One draft buffer per state of every state layer: ``[max_num_reqs * k, *shape]``."""
        k = self.config.num_speculative_tokens
        self._draft_states = {}
        self._state_groups = frozenset(
            e.group.group_id for e in self._groups if _state_shapes(e.group)
        )
        if k <= 0:
            return
        slots = self.config.max_num_reqs * k
        for entry in self._groups:
            shapes = _state_shapes(entry.group)
            for name in entry.group.layer_names if shapes else ():
                self._draft_states[name] = tuple(
                    torch.zeros((slots, *shape), dtype=dtype, device=self.device)
                    for shape, dtype in shapes
                )

    def _prepare_verify(
        self,
        drafts: Ints | None,
        trees: list[tuple[int, ...] | None] | None,
        rows: Ints,
        lens: StepLens,
    ) -> None:
        """After ``begin_step`` built the step: the state groups' sub-steps."""
        if drafts is None:
            self._verify = None
            return
        sub_steps: dict[int, list[_SubStep]] = {}
        blocks: dict[int, Ints] = {}
        for entry in self._groups:
            gid = entry.group.group_id
            if gid not in self._state_groups or entry.common is None:
                continue
            table = entry.common.block_table_tensor
            state_blocks = table[:, 0].to("cpu", torch.int64).numpy()
            blocks[gid] = state_blocks
            sub_steps[gid] = self._sub_steps(entry, drafts, trees, lens, state_blocks)
        self._verify = VerifyStep(
            drafts,
            rows.astype(np.int64),
            lens.computed.astype(np.int64),
            lens.query.astype(np.int64),
            sub_steps,
            blocks,
            trees,
        )

    def _sub_steps(
        self,
        entry: Any,
        drafts: Ints,
        trees: list[tuple[int, ...] | None] | None,
        lens: StepLens,
        state_blocks: Ints,
    ) -> list[_SubStep]:
        common: CommonAttentionMetadata = entry.common
        k = self.config.num_speculative_tokens
        qsl = common.query_start_loc_cpu.numpy().astype(np.int64)
        head = lens.query - drafts
        out: list[_SubStep] = []
        for j in range(int(drafts.max()) + 1):
            if j == 0:
                idx = np.arange(lens.query.size)
                threshold = entry.builder.reorder_batch_threshold
                if threshold is not None:
                    # Decodes first, as the builder asks: a drafting request's first
                    # token is a decode even where its whole step was not.
                    prefill = (head > threshold) | (lens.computed == 0)
                    idx = np.argsort(prefill, kind="stable")
                qlen = head[idx]
                first = qsl[idx]
            else:
                idx = np.flatnonzero(drafts >= j)
                qlen = np.ones(idx.size, dtype=np.int64)
                first = qsl[idx] + head[idx] + (j - 1)
            if not idx.size:
                continue
            tokens = spans(qlen, first)[1].astype(np.int64)
            seq = lens.computed[idx] + head[idx] + j
            cm = self._sub_common(common, idx, qlen, seq, lens.computed[idx])
            keep = np.flatnonzero(drafts > j)
            keep_blocks = keep_slots = load_blocks = load_slots = None
            if keep.size:
                keep_blocks = self._device_ints(state_blocks[keep])
                keep_slots = self._device_ints(keep * k + j)
            if j and trees is not None:
                # Draft j - 1 of a tree starts from its parent's state, kept at draft-
                # buffer row parent + 1 (the root's at row 0), unless its parent is the
                # draft just computed (the state page holds that one).
                batch: list[int] = idx.tolist()
                load: list[tuple[int, int]] = []
                for b in batch:
                    parents = trees[b]
                    if parents is not None and parents[j - 1] != j - 2:
                        load.append((b, parents[j - 1] + 1))
                if load:
                    where = np.array([b for b, _ in load], dtype=np.int64)
                    slots = np.array([r for _, r in load], dtype=np.int64)
                    load_blocks = self._device_ints(state_blocks[where])
                    load_slots = self._device_ints(where * k + slots)
            out.append(
                _SubStep(
                    self._device_ints(tokens),
                    entry.builder.build(0, cm),
                    keep_blocks,
                    keep_slots,
                    load_blocks,
                    load_slots,
                )
            )
        return out

    def _device_ints(self, values: Ints) -> torch.Tensor:
        t = _from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        return t if self.device.type == "cpu" else t.to(self.device)

    def _sub_common(
        self,
        common: CommonAttentionMetadata,
        idx: Ints,
        qlen: Ints,
        seq: Ints,
        computed: Ints,
    ) -> CommonAttentionMetadata:
        qsl = np.zeros(idx.size + 1, dtype=np.int32)
        np.cumsum(qlen, out=qsl[1:])
        n = int(qsl[-1])
        qsl_cpu = _from_numpy(qsl)
        seq_cpu = _from_numpy(seq.astype(np.int32))
        where = self._device_ints(idx)
        return CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(self.device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_cpu.to(self.device),
            seq_lens_cpu=seq_cpu,
            num_reqs=int(idx.size),
            num_actual_tokens=n,
            max_query_len=int(qlen.max()),
            max_seq_len=int(seq.max()),
            block_table_tensor=common.block_table_tensor.index_select(0, where),
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=self.device),
            causal=common.causal,
            num_computed_tokens_cpu=_from_numpy(computed.astype(np.int32)),
            validate=False,
        )

    def _forward_verify_state(
        self,
        layer_name: str,
        impl: StateImpl[Any, Any, Any],
        inputs: StateInputs,
        caches: tuple[torch.Tensor, ...],
        output: torch.Tensor,
        sub_steps: list[_SubStep],
    ) -> torch.Tensor:
        """A state layer in a step with drafts: its sub-steps, keeping the states after
        each draft position but the last."""
        drafts = self._draft_states[layer_name]
        n = self._current_step().num_tokens
        for sub in sub_steps:
            if sub.load_blocks is not None and sub.load_slots is not None:
                for state, draft in zip(caches, drafts, strict=True):
                    state.index_copy_(0, sub.load_blocks, draft.index_select(0, sub.load_slots))
            fields = {
                f.name: _rows(getattr(inputs, f.name), sub.tokens)
                for f in dataclasses.fields(inputs)
            }
            part = type(inputs)(**fields)
            out = output.new_empty((int(sub.tokens.numel()), *output.shape[1:]))
            out = impl.forward(part, caches, sub.metadata, out)
            output.index_copy_(0, sub.tokens, out)
            if sub.keep_blocks is not None and sub.keep_slots is not None:
                for state, draft in zip(caches, drafts, strict=True):
                    draft.index_copy_(0, sub.keep_slots, state.index_select(0, sub.keep_blocks))
        if output.shape[0] > n:
            output[n:].zero_()
        return output

    def accept(self, accepted: Mapping[str, int | Sequence[int]]) -> None:
        """After verification: which of each request's draft tokens of the current
        step were accepted. Rejected drafts are taken back: the request holds its
        accepted tokens only (its next step starts right after them), the blocks past
        them go back to the pool, and each state layer's state is the one after its
        last accepted token. A request of the step not named keeps all its drafts
        (a request whose drafts are a tree must be named).

        A count ``n`` keeps the first ``n`` drafts (they must be a chain). For a draft
        tree (``ScheduledRequest.draft_parents``) give the accepted path instead: the
        draft indices from a child of the root down (``draft_parents[path[0]] == -1``,
        ``draft_parents[path[i]] == path[i - 1]``). The path's keys and values move to
        the positions right after the root in every attention layer, so the cache
        reads as if only the path had been decoded.

        Call it once per step, after every layer of the step ran. All or nothing: every
        entry is checked before anything changes. The step's metadata is stale after
        it (``forward`` raises ``StaleStepError``).

        Raises:
            ArgumentTypeError: ``accepted`` is not a mapping of request id -> int or
                sequence of ints.
            InvalidArgumentError: a request not in the step, a tree request not
                named, a count outside
                ``0 .. num_draft_tokens`` or beyond a tree's first chain, or a path
                that is not a root-to-node path of the request's tree.
            StaleStepError: no step, its requests were freed since, or ``accept``
                already ran for it.
        """
        given: object = accepted  # untyped callers reach here too
        if not isinstance(given, Mapping):
            raise ArgumentTypeError(
                f"accepted must be a mapping of request id -> accepted draft tokens, got "
                f"{type(given).__name__}"
            )
        self._check_step_live()
        step = self._current_step()
        verify = self._verify
        if verify is not None and verify.accepted:
            raise StaleStepError("accept() already ran for this step; call begin_step() first")
        index = {rid: i for i, rid in enumerate(step.order)}
        picks: list[tuple[int, list[int]]] = []
        for rid, value in accepted.items():
            if not isinstance(rid, str):
                raise ArgumentTypeError(f"accepted: request ids are str, got {rid!r}")
            i = index.get(rid)
            if i is None:
                raise InvalidArgumentError(
                    f"accepted names request {rid!r}, which is not in the current step "
                    f"(its requests: {list(step.order)})"
                )
            limit = 0 if verify is None else int(verify.drafts[i])
            parents = None if verify is None or verify.trees is None else verify.trees[i]
            picks.append((i, _accepted_path(rid, value, limit, parents)))
        if len({i for i, _ in picks}) != len(picks):  # a mapping cannot repeat keys
            raise DuplicateRequestError("accepted names a request twice")
        if verify is None:
            return
        if verify.trees is not None:
            named = {i for i, _ in picks}
            missing = [step.order[i] for i, t in enumerate(verify.trees) if t and i not in named]
            if missing:
                raise InvalidArgumentError(
                    f"accepted must name every request whose drafts are a tree (its "
                    f"accepted path): missing {missing}"
                )
        verify.accepted = True
        back = [(i, path) for i, path in picks if len(path) < int(verify.drafts[i])]
        moves = [(i, path) for i, path in picks if path != list(range(len(path)))]
        self._stale = (
            "accept() already ran for this step (drafts were taken back); call begin_step() again"
        )
        if moves:
            self._compact_paths(verify, moves)
        if not back:
            return
        where = np.array([i for i, _ in back], dtype=np.int64)
        kept = np.array([len(path) for _, path in back], dtype=np.int64)
        # The draft-buffer row of the state after the path's last draft (row 0: the
        # root's); the last draft's own state is on the state page already.
        last = np.array([path[-1] + 1 if path else 0 for _, path in back], dtype=np.int64)
        totals = verify.computed[where] + verify.query[where] - verify.drafts[where] + kept
        self.manager.take_back(verify.rows[where], totals)
        copy = last < verify.drafts[where]
        if not copy.any():
            return
        where, last = where[copy], last[copy]
        k = self.config.num_speculative_tokens
        for gid, state_blocks in verify.state_blocks.items():
            dst = self._device_ints(state_blocks[where])
            src = self._device_ints(where * k + last)
            for name in self._groups[gid].group.layer_names:
                for state, draft in zip(
                    self.kv_caches[name], self._draft_states[name], strict=True
                ):
                    state.index_copy_(0, dst, draft.index_select(0, src))

    def _compact_paths(self, verify: VerifyStep, moves: list[tuple[int, list[int]]]) -> None:
        """Move each accepted path's keys and values to the slots right after its root,
        in every attention layer (the step's slot mapping names both)."""
        step = self._current_step()
        starts = np.zeros(len(step.query_lens) + 1, dtype=np.int64)
        np.cumsum(np.asarray(step.query_lens, dtype=np.int64), out=starts[1:])
        src_rows: list[int] = []
        dst_rows: list[int] = []
        for i, path in moves:
            first = int(starts[i + 1] - verify.drafts[i])  # the row of draft 0
            for depth, node in enumerate(path):
                if node != depth:
                    src_rows.append(first + node)
                    dst_rows.append(first + depth)
        src = self._device_ints(np.array(src_rows, dtype=np.int64))
        dst = self._device_ints(np.array(dst_rows, dtype=np.int64))
        for entry in self._groups:
            common = entry.common
            rules = self._rules_of[entry.group.group_id]
            if common is None or not rules.has_cache or rules.writes != "step":
                continue
            if entry.group.group_id in self._state_groups:
                continue
            slots = common.slot_mapping
            src_slots, dst_slots = slots.index_select(0, src), slots.index_select(0, dst)
            block_size = entry.group.spec.block_size
            planes = entry.selection.backend.kv_cache_layout == "planes"
            for name in entry.group.layer_names:
                for cache in self.kv_caches[name]:
                    _copy_slots(cache, src_slots, dst_slots, block_size, planes)


def _accepted_path(
    rid: str, value: object, limit: int, parents: tuple[int, ...] | None
) -> list[int]:
    """``accepted[rid]`` as the accepted draft indices, root to node, checked."""
    chain = limit
    if parents is not None:
        chain = next((i for i, p in enumerate(parents) if p != i - 1), limit)
    if isinstance(value, bool) or not isinstance(value, int | Sequence) or isinstance(value, str):
        raise InvalidArgumentError(
            f"accepted[{rid!r}] must be an int in 0..{chain} (the request's first drafts "
            f"kept) or a sequence of draft indices (a path of its draft tree), got {value!r}"
        )
    if isinstance(value, int):
        if not 0 <= value <= chain:
            where = "its draft tokens" if chain == limit else "the chain its tree starts with"
            raise InvalidArgumentError(
                f"accepted[{rid!r}] must be an int in 0..{chain} ({where} this step), "
                f"got {value!r}" + ("" if chain == limit else "; give a draft tree its path")
            )
        return list(range(value))
    path = list(cast("Sequence[object]", value))
    parent = -1
    for depth, node in enumerate(path):
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < limit:
            raise InvalidArgumentError(
                f"accepted[{rid!r}][{depth}] must be a draft index in 0..{limit - 1}, got {node!r}"
            )
        expected = parents[node] if parents is not None else node - 1
        if expected != parent:
            raise InvalidArgumentError(
                f"accepted[{rid!r}] must be a path of the request's draft tree from the "
                f"root: draft {node} (at {depth}) has parent {expected}, not {parent}"
            )
        parent = node
    return cast("list[int]", path)


def _copy_slots(
    cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, block_size: int, planes: bool
) -> None:
    """Copy cache slots ``src`` to ``dst`` (int64 ``block * block_size + offset``) of one
    attention layer's cache tensor: a plane ``[NB * BS, ...]`` (row = slot), a page-major
    K/V cache ``[NB, 2, BS, ...]`` or a one-latent cache ``[NB, BS, ...]``."""
    if planes:
        rows = (
            cache.view(torch.uint8) if cache.element_size() == 1 else cache
        )  # fp8: no index_copy_
        rows.index_copy_(0, dst, rows.index_select(0, src))
        return
    sb, so = src // block_size, src % block_size
    db, do = dst // block_size, dst % block_size
    if cache.dim() >= 3 and cache.shape[1] == 2 and cache.shape[2] == block_size:
        cache[db, :, do] = cache[sb, :, so]
    else:
        cache[db, do] = cache[sb, so]
