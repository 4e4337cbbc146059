"""The per-step host path: ``begin_step`` (checks, admission, order, allocation), each
group's ``CommonAttentionMetadata`` and the arrays every group shares, ``free`` and the
context-parallel ranks' agreement on the step (see "The per-step host path" in
docs/runtime.md)."""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch

from ..errors import (
    ArgumentTypeError,
    DuplicateRequestError,
    EngineLimitError,
    InvalidArgumentError,
)
from ..kinds import Ints, KindRules, StepLens, StepTokens, spans
from ..kv_cache import KVCacheGroup, PrefixMatch
from ..metadata import CommonAttentionMetadata, host_to_device
from ..parallel import ContextParallelMismatchError, step_fingerprint
from ..prefix_cache import Tokens
from ..spec import KVCacheSpec
from ._requests import ScheduledRequest, StepBatch
from ._spec import SpeculativeCalls, draft_tree_mask, step_drafts

# torch.from_numpy, typed: torch leaves its parameter unannotated (pyright: Unknown).
_from_numpy: Callable[[np.ndarray[Any, Any]], torch.Tensor] = torch.from_numpy  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]


class StepHost(SpeculativeCalls):
    """``AttentionRuntime``'s per-step part: ``begin_step``, ``free``."""

    def begin_step(
        self, scheduled: Sequence[ScheduledRequest], *, finished: Iterable[str] = ()
    ) -> StepBatch:
        """Free finished requests, make room for the scheduled ones, build all metadata.

        All or nothing: when it raises, nothing changed (finished requests included),
        so the same call can be retried.

        Raises:
            ArgumentTypeError: ``scheduled`` is not a sequence of ``ScheduledRequest``,
                or ``finished`` not an iterable of ids (a bare string is refused).
            UnknownRequestError: ``finished`` names a request that is not live.
            DuplicateRequestError: a request scheduled twice or finished twice.
            EngineLimitError: more requests than ``config.max_num_reqs``, more tokens
                than ``config.max_num_batched_tokens``, or a request longer than
                ``config.max_model_len``.
            InvalidArgumentError: an encoder-only request split over steps, a new
                cross-attention request without encoder tokens, a ``prefix`` with
                prefix caching off.
            OutOfBlocksError: the cache cannot hold the step.
            StalePrefixError: a new request's ``prefix`` hits blocks evicted since its
                ``match_prefix`` (or a match of another runtime): match it again.
        """
        # No request finished (the common step): nothing to check.
        finished = [] if finished == () else self._check_ids("finished", finished)
        _check_types(scheduled)
        ids: list[str] = list(map(_REQ_ID, scheduled))
        if self.context_parallel is not None:
            self._check_ranks_agree(scheduled, finished)
        # The steady state schedules the same requests as the last step: their rows
        # are known (and their ids unique) while no request gained or lost a row.
        cached = (
            not finished
            and self.manager.rows_version == self._last_rows_version
            and ids == self._last_ids
        )
        if not cached:
            _check_unique(ids)
        count = len(ids)
        limits = self.config
        if count > limits.max_num_reqs:
            raise EngineLimitError(
                f"the step schedules {count} requests; AttentionConfig.max_num_reqs="
                f"{limits.max_num_reqs} allows at most that many per step"
            )
        counts = np.fromiter(map(_NUM_NEW, scheduled), dtype=np.int64, count=count)
        step_tokens = int(counts.sum())
        if step_tokens > limits.max_num_batched_tokens:
            raise EngineLimitError(
                f"the step schedules {step_tokens} tokens; AttentionConfig."
                f"max_num_batched_tokens={limits.max_num_batched_tokens} allows at most "
                f"that many per step"
            )
        encoder = (
            np.fromiter(map(_ENCODER_LEN, scheduled), dtype=np.int64, count=count)
            if self._reads_encoder
            else np.zeros(count, dtype=np.int64)
        )
        # Not mutated below unless a request is new or finished (then not cached).
        rows = self._last_rows if cached else self.manager.lookup_rows(ids)
        given_ids, given_rows, version = ids, rows, self.manager.rows_version
        if finished:
            # Finished requests are freed only once the step is known to fit; an id
            # finished and scheduled again starts anew.
            gone = set(finished)
            for i, req_id in enumerate(ids):
                if req_id in gone:
                    rows[i] = -1
        # New requests may start from a prefix hit (the steady state has none).
        prefixes, starts = (None, None) if cached else self._new_prefixes(scheduled, rows)
        found = (
            step_drafts(self, scheduled, ids, rows) if self.config.num_speculative_tokens else None
        )
        drafts, trees = (None, None) if found is None else found
        lens = self.manager.step_lens(rows, counts, encoder, starts, all_live=cached)
        longest = int(lens.total.max()) if count else 0
        if longest > limits.max_model_len:
            index = int(lens.total.argmax())
            raise EngineLimitError(
                f"request {ids[index]!r} would reach {longest} tokens "
                f"({int(lens.computed[index])} cached + {int(lens.query[index])} new); "
                f"AttentionConfig.max_model_len={limits.max_model_len}"
            )
        mm_ranges = self._mm.step(scheduled, ids, rows, lens) if self._mm is not None else None
        if mm_ranges is None and not cached:
            _check_no_ranges(scheduled, rows)
        for rules in self._kind_rules:
            problem = rules.admission_problems(lens)
            if problem is not None:
                index, why = problem
                raise InvalidArgumentError(f"request {ids[index]!r} {why}")
        # A steady decode step (the last step's requests, one token each) is in order
        # already: every request is a continuing decode, so every key below is 0.
        if self._thresholds and not (cached and step_tokens == count):
            # Stable: for every builder's threshold, continuing requests at or under it
            # come first. A new request is never a decode (nothing cached to extend).
            key = sum((lens.is_new | (lens.query > t)).astype(np.int64) for t in self._thresholds)
            order = np.argsort(key, kind="stable")
            if (order != np.arange(order.size)).any():
                ids = [ids[i] for i in order.tolist()]
                rows = rows[order]
                lens = StepLens(lens.computed[order], lens.query[order], lens.encoder[order])
                if prefixes is not None:
                    moved: list[int] = order.tolist()
                    prefixes = [prefixes[i] for i in moved]
                if drafts is not None:
                    drafts = drafts[order]
                if trees is not None:
                    reordered: list[int] = order.tolist()
                    trees = [trees[i] for i in reordered]
        rows = self.manager.allocate_rows(ids, rows, lens, finished=finished, prefixes=prefixes)
        if self.manager.rows_version == version:  # no request gained or lost a row
            self._last_ids, self._last_rows = given_ids, given_rows
            self._last_rows_version = version
        # The steady state's rows are the last step's array: its contiguity is known.
        contiguous = self._last_contiguous if rows is self._contiguous_rows else None
        # Off the CPU the step's tensors are made on the host and sent together, once
        # every group's are known (``hosts_to_device``: one copy a step).
        upload = None if self._send_to_device is None else _StepUpload()
        to_device = self._to_device if upload is None else upload.defer
        decode_qsl = None
        if step_tokens == count:  # one token each: the offsets are 0..B, made once
            decode_qsl = self._decode_qsl
            if decode_qsl is None or decode_qsl.shape[0] != count + 1:
                decode_qsl = _from_numpy(np.arange(count + 1, dtype=np.int32))
                self._decode_qsl = decode_qsl
        manager = self.manager
        last = self._last_shared
        shared = _SharedStep(
            lens,
            rows,
            to_device,
            contiguous,
            decode_qsl,
            serial=manager.step_serial,
            steady=manager.steady_serial == manager.step_serial,
            # A run's step repeats the last step's new tokens from where it left them:
            # its offsets and each token's request are the last step's.
            repeats=(
                last
                if last is not None
                and manager.run_serial == manager.step_serial
                and last.serial == manager.step_serial - 1
                else None
            ),
        )
        self._last_shared = shared
        self._contiguous_rows, self._last_contiguous = rows, shared.rows_contiguous
        tree = (
            None
            if trees is None or drafts is None
            else draft_tree_mask(trees, drafts, lens.query, to_device)
        )
        mm_tensors = (
            self._mm.metadata(mm_ranges, ids, lens, to_device)
            if self._mm is not None and mm_ranges
            else None
        )
        try:
            commons: list[CommonAttentionMetadata] = []
            for entry in self._groups:
                owner = entry.group.block_owner
                if owner is not None:
                    # Shared block ids: the owner's table and slots (owners come first).
                    common = commons[owner]
                else:
                    common = self._common_metadata(entry.group, rows, lens, shared, to_device)
                common.draft_tree = tree
                if mm_tensors is not None and entry.group.group_id in self._mm_groups:
                    common = dataclasses.replace(
                        common,
                        mm_prefix_ranges=mm_tensors[0],
                        mm_prefix_ranges_cpu=mm_tensors[1],
                        mm_prefix_counts_cpu=mm_tensors[2],
                        validate=False,
                    )
                commons.append(common)
            if upload is not None and self._send_to_device is not None:
                sent = self._send_to_device(upload.tensors)
                copies = {id(h): d for h, d in zip(upload.tensors, sent, strict=True)}
                commons = [_on_device(common, copies) for common in commons]
            for entry, common in zip(self._groups, commons, strict=True):
                entry.common = common
                entry.metadata = entry.builder.build(0, common)
        except BaseException as exc:
            # The cache already holds the step (builders run on its tables): a builder
            # that fails here is a backend bug. No layer may run on half-built metadata.
            self._stale = (
                f"begin_step() failed while building metadata ({type(exc).__name__}: "
                f"{exc}); the step's blocks are allocated, call begin_step() again"
            )
            self._step_rows_version = self.manager.rows_version
            if self.manager.prefix is not None:
                self.manager.prefix.discard()  # no layer runs: nothing the step fills is named
            raise
        if self._mm is not None and mm_ranges is not None:
            self._mm.forget(finished)
            self._mm.commit(mm_ranges, ids, lens)
        if drafts is not None or self._verify is not None:
            self._prepare_verify(drafts, trees, rows, lens)
        query_lens = tuple(lens.query.tolist())
        self._stale = None
        self._step_rows_version = self.manager.rows_version
        encoder_order: tuple[str, ...] = ()
        self._encoder_tokens = 0
        if self._reads_encoder:
            writers = np.flatnonzero(lens.is_new & (lens.encoder > 0))
            encoder_order = tuple(ids[int(i)] for i in writers)
            self._encoder_tokens = int(lens.encoder[writers].sum())
        self._step = StepBatch(
            order=tuple(ids),
            query_lens=query_lens,
            num_tokens=shared.num_tokens,
            encoder_order=encoder_order,
        )
        return self._step

    def _new_prefixes(
        self, scheduled: Sequence[ScheduledRequest], rows: Ints
    ) -> tuple[list[PrefixMatch | None] | None, Ints | None]:
        """The matches new requests (rows -1) bring and the computed tokens they start
        with, or ``(None, None)`` when none brings one."""
        new = (rows < 0).nonzero()[0]
        if not new.size:
            return None, None
        indices: list[int] = new.tolist()
        found = [(i, p) for i in indices if (p := scheduled[i].prefix) is not None]
        if not found:
            return None, None
        if self.manager.prefix is None:
            raise InvalidArgumentError(
                f"request {scheduled[found[0][0]].req_id!r} brings a prefix match but prefix "
                f"caching is off: build the runtime with "
                f"AttentionConfig(prefix_caching={{'enabled': True}})"
            )
        prefixes: list[PrefixMatch | None] = [None] * rows.size
        starts = np.zeros(rows.size, dtype=np.int64)
        for i, match in found:
            prefixes[i] = match
            starts[i] = match.num_tokens
        return prefixes, starts

    def _common_metadata(
        self,
        group: KVCacheGroup,
        rows: Ints,
        lens: StepLens,
        shared: _SharedStep,
        to_device: Callable[[torch.Tensor], torch.Tensor],
    ) -> CommonAttentionMetadata:
        """The group's view of the step (see "Per-group metadata" in docs/architecture.md)."""
        spec = group.spec
        rules = self._rules_of[group.group_id]
        num_reqs = rows.size
        if rules.has_cache and num_reqs:
            width = self.manager.step_width(group.group_id)
            persistent = self.manager.table_array(group.group_id)
            first = int(rows[0])
            if shared.rows_contiguous:
                # The batch holds consecutive rows in order (the steady state): a view of
                # the persistent table, no copy. Valid until the next begin_step.
                table = persistent[first : first + num_reqs, :width]
            else:
                table = persistent[rows, :width]
        else:
            # No request (a step that only finishes requests) or no cache: an empty
            # table, one column wide for cached kinds (state builders read column 0).
            table = np.zeros((num_reqs, 1 if rules.has_cache else 0), dtype=np.int32)
        # The kind writes its own slots (the step's tokens, the encoder's, a shard's).
        slots = self._slots(group.group_id, rules, spec, table, shared, lens)
        shard = rules.context_shard
        global_lens: torch.Tensor | None = None
        if shard is not None:
            global_lens = _from_numpy(rules.global_seq_lens(spec, lens).astype(np.int32))
        seq_cpu, max_seq_len = shared.seq_lens(rules.seq_lens(spec, lens))
        return CommonAttentionMetadata(
            query_start_loc=shared.query_start_loc_device,
            query_start_loc_cpu=shared.query_start_loc,
            seq_lens=to_device(seq_cpu),
            seq_lens_cpu=seq_cpu,
            num_reqs=num_reqs,
            num_actual_tokens=shared.num_tokens,
            max_query_len=shared.max_query_len,
            max_seq_len=max_seq_len,
            block_table_tensor=to_device(_from_numpy(table)),
            slot_mapping=to_device(_from_numpy(slots)),
            causal=rules.causal,
            num_computed_tokens_cpu=shared.computed,
            context_shard=shard,
            global_seq_lens_cpu=global_lens,
            step_id=shared.step_id,
            slots_written=group.group_id in self._slot_steps,
            validate=False,
        )

    def _slots(
        self,
        gid: int,
        rules: KindRules[Any],
        spec: KVCacheSpec,
        table: np.ndarray[Any, Any],
        shared: _SharedStep,
        lens: StepLens,
    ) -> Ints:
        """The group's slot mapping: its kind's, or in the steady decode state (the
        manager's ``steady_serial``: the same rows as the last step, one token each, no
        table changed) for a kind with the default slots, the last step's plus one
        (each request's new token is the next position of the block its last one went
        to). Kept after every decode step of such a group, with the manager's serial."""
        if gid not in self._slot_steps:
            return rules.slot_mapping(spec, table, shared, lens)
        last = self._decode_slots.get(gid)
        if shared.steady and last is not None and last[0] == shared.serial - 1:
            slots: Ints = last[1] + 1
        else:
            slots = rules.slot_mapping(spec, table, shared, lens)
        if shared.num_tokens == lens.query.size:
            self._decode_slots[gid] = (shared.serial, slots)
        return slots

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the runtime's device, without a wait (``host_to_device``)."""
        if self.device.type == "cpu":
            return t
        return host_to_device(t, self.device)

    def _check_ranks_agree(
        self, scheduled: Sequence[ScheduledRequest], finished: Sequence[str]
    ) -> None:
        """All-gather this step's fingerprint; raise on every rank when they differ."""
        cp = self.context_parallel
        assert cp is not None
        schedule = [(r.req_id, r.num_new_tokens, r.encoder_len) for r in scheduled]
        mine = step_fingerprint(self._cp_step, schedule, finished)
        probe = torch.tensor([self._cp_step, mine], dtype=torch.int64, device=self.device)
        seen = [(int(t[0]), int(t[1])) for t in cp.communicator.all_gather(probe)]
        if len(set(seen)) != 1:
            steps = [s for s, _ in seen]
            odd = [r for r, fp in enumerate(seen) if fp != seen[cp.rank]]
            raise ContextParallelMismatchError(
                f"context-parallel rank {cp.rank} of {cp.world_size}: the ranks were given "
                f"different steps (step counters {steps}; ranks {odd} differ from this "
                f"one, which scheduled {schedule} and finished {sorted(finished)}); every "
                f"rank must call begin_step with the same requests in the same order"
            )
        self._cp_step += 1

    def free(
        self, req_ids: Iterable[str], *, token_ids: Mapping[str, Tokens] | None = None
    ) -> None:
        """Release finished requests now (``begin_step(finished=...)`` does the same).

        All or nothing: every id is checked before any is freed. Freeing a request of
        the current step makes the step's metadata stale: ``forward`` then raises
        ``StaleStepError`` instead of writing into blocks that are back in the pool.

        With prefix caching on, ``token_ids`` gives a request's tokens (its prompt, then
        the tokens it generated) so the full blocks of its generated tokens are cached
        too (only the tokens the cache holds count: a last sampled token never computed
        is ignored); ignored with caching off.

        Raises:
            ArgumentTypeError: ``req_ids`` is a bare string or holds a non-string;
                ``token_ids`` is not a mapping of token ids.
            UnknownRequestError: an id is not live (the message says whether it was
                already freed or never scheduled).
            DuplicateRequestError: an id given twice.
            InvalidArgumentError: ``token_ids`` names a request ``req_ids`` does not
                free, or a request's tokens do not start with its prompt.
        """
        ids = self._check_ids("req_ids", req_ids)
        tokens = self._check_free_tokens(token_ids, ids)
        step = self._step
        for req_id in ids:
            self.manager.free_request(req_id, tokens.get(req_id))
        if self._mm is not None:
            self._mm.forget(ids)
        if step is not None and self._stale is None:
            hit = set(ids).intersection(step.order)
            if hit:
                self._stale = (
                    f"request(s) {sorted(hit)} of the current step were freed after "
                    f"begin_step(); its metadata would write into blocks back in the pool. "
                    f"Call begin_step() again"
                )
            else:  # unrelated requests: the step's metadata still holds
                self._step_rows_version = self.manager.rows_version

    def _check_free_tokens(
        self, token_ids: Mapping[str, Tokens] | None, ids: Sequence[str]
    ) -> dict[str, Tokens]:
        """``token_ids`` checked for every request before any is freed (``{}`` when
        none is given, or with caching off)."""
        if token_ids is None:
            return {}
        given: object = token_ids  # untyped callers reach here too
        if not isinstance(given, Mapping):
            raise ArgumentTypeError(
                f"token_ids must be a mapping of request id -> token ids, got "
                f"{type(given).__name__}"
            )
        extra = sorted(set(token_ids) - set(ids), key=str)
        if extra:
            raise InvalidArgumentError(
                f"token_ids names request(s) {extra} that req_ids does not free"
            )
        prefix = self.manager.prefix
        if prefix is None:
            return {}
        return {
            rid: prefix.check_tokens(self.manager.row_of(rid), rid, tokens)
            for rid, tokens in token_ids.items()
        }

    def _check_ids(self, argument: str, req_ids: Iterable[str]) -> list[str]:
        """``req_ids`` as a list of live, distinct ids, or an error naming ``argument``."""
        given: object = req_ids  # untyped callers reach here too
        if isinstance(given, str | bytes) or not isinstance(given, Iterable):
            raise ArgumentTypeError(
                f"{argument} must be an iterable of request ids (e.g. a list of str), "
                f"got {req_ids!r}"
            )
        ids: list[object] = list(cast("Iterable[object]", given))
        for req_id in ids:
            if not isinstance(req_id, str):
                raise ArgumentTypeError(
                    f"{argument} must hold request ids (str), got {req_id!r} "
                    f"({type(req_id).__name__})"
                )
            if req_id not in self.manager:
                raise self.manager.unknown_request(req_id)
        checked = cast("list[str]", ids)
        if len(set(checked)) != len(checked):
            twice = sorted({r for r in checked if checked.count(r) > 1})
            raise DuplicateRequestError(f"{argument} names request(s) {twice} twice")
        return checked


_STEP_IDS = itertools.count()
"""Every ``begin_step`` of the process gets the next number (``step_id``), whatever
its runtime: two steps never share one."""
_REQ_ID = operator.attrgetter("req_id")
_NUM_NEW = operator.attrgetter("num_new_tokens")
_ENCODER_LEN = operator.attrgetter("encoder_len")


class _SharedStep(StepTokens):
    """What every group's metadata shares in a step: offsets, token positions, lengths."""

    def __init__(
        self,
        lens: StepLens,
        rows: Ints,
        to_device: Callable[[torch.Tensor], torch.Tensor],
        contiguous: bool | None = None,
        decode_qsl: torch.Tensor | None = None,
        *,
        serial: int = -1,
        steady: bool = False,
        repeats: _SharedStep | None = None,
    ) -> None:
        n = rows.size
        self.rows_contiguous = (
            bool(n and rows[-1] - rows[0] == n - 1 and (rows[1:] == rows[:-1] + 1).all())
            if contiguous is None
            else contiguous
        )
        self._step_of_token: Ints | None = None
        if decode_qsl is not None:  # every request decodes one token: 0..n, kept
            self.query_start_loc = decode_qsl
            num_tokens = n
        elif repeats is not None:  # the same new tokens as the last step: its offsets
            self.query_start_loc = repeats.query_start_loc
            num_tokens = repeats.num_tokens
        else:
            qsl = np.zeros(n + 1, dtype=np.int32)
            lens.query.cumsum(out=qsl[1:])
            self.query_start_loc = _from_numpy(qsl)
            num_tokens = int(qsl[-1])
        self.query_start_loc_device = to_device(self.query_start_loc)
        self.computed = _from_numpy(lens.computed.astype(np.int32))
        if num_tokens == n:  # every request decodes one token (each has >= 1)
            self.max_query_len = 1 if n else 0
            super().__init__(_arange(n), lens.computed)
        elif repeats is not None:
            # Each token sits its request's new tokens further on than the last step's.
            self.max_query_len = repeats.max_query_len
            self._step_of_token = repeats.step_of_token(lens)
            super().__init__(repeats.token_req, repeats.token_pos + self._step_of_token)
        else:
            self.max_query_len = int(lens.query.max())
            # Request index and (unshifted) position of every token of the step.
            super().__init__(*spans(lens.query, lens.computed))
        self._seq: list[tuple[Ints, torch.Tensor, int]] = []
        self.serial = serial
        """The manager's ``step_serial`` after this step's allocation."""
        self.steady = steady
        """Whether the manager took its steady decode state for the step."""
        self.step_id = next(_STEP_IDS)
        """The step's ``CommonAttentionMetadata.step_id``: numbered across the process."""

    def step_of_token(self, lens: StepLens) -> Ints:
        """Each token's request's new tokens this step (``query[token_req]``), made
        once for the steps that repeat it."""
        if self._step_of_token is None:
            self._step_of_token = lens.query[self.token_req]
        return self._step_of_token

    def seq_lens(self, values: Ints) -> tuple[torch.Tensor, int]:
        """``values`` as an int32 CPU tensor and its maximum, made once per array per step
        (groups of the same kind rules share the step's ``total`` array)."""
        for array, tensor, largest in self._seq:
            if array is values:
                return tensor, largest
        tensor = _from_numpy(values.astype(np.int32))
        largest = int(values.max()) if values.size else 0
        self._seq.append((values, tensor, largest))
        return tensor, largest


class _StepUpload:
    """A step's host tensors bound for the device, each once, in order: ``defer``
    stands in for ``host_to_device`` while the step's metadata is made, then
    ``hosts_to_device`` sends them all in one copy and ``_on_device`` swaps them in."""

    __slots__ = ("_seen", "tensors")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._seen: set[int] = set()

    def defer(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in self._seen:
            self._seen.add(id(t))
            self.tensors.append(t)
        return t


def _on_device(
    cm: CommonAttentionMetadata, moved: dict[int, torch.Tensor]
) -> CommonAttentionMetadata:
    """``cm`` with its device fields (made on the host by ``_StepUpload.defer``) swapped
    for their sent copies; the ``*_cpu`` fields, often the same host tensors, stay."""

    def sent(t: torch.Tensor) -> torch.Tensor:
        return moved.get(id(t), t)

    tree = cm.draft_tree
    if tree is not None:
        tree = dataclasses.replace(
            tree, ancestors=sent(tree.ancestors), num_drafts=sent(tree.num_drafts)
        )
    ranges = cm.mm_prefix_ranges
    return dataclasses.replace(
        cm,
        query_start_loc=sent(cm.query_start_loc),
        seq_lens=sent(cm.seq_lens),
        block_table_tensor=sent(cm.block_table_tensor),
        slot_mapping=sent(cm.slot_mapping),
        draft_tree=tree,
        mm_prefix_ranges=None if ranges is None else sent(ranges),
        validate=False,
    )


_ARANGE: list[Ints] = [np.arange(1024)]
_ARANGE[0].flags.writeable = False


def _arange(n: int) -> Ints:
    """``np.arange(n)`` as a read-only view of a cached array (decode steps use it)."""
    if n > _ARANGE[0].size:
        grown = np.arange(max(n, 2 * _ARANGE[0].size))
        grown.flags.writeable = False
        _ARANGE[0] = grown
    return _ARANGE[0][:n]


def _check_no_ranges(scheduled: Sequence[ScheduledRequest], rows: Ints) -> None:
    """A new request's image ranges need a layer that takes them: never ignored."""
    new: list[int] = (rows < 0).nonzero()[0].tolist()
    for i in new:
        if scheduled[i].mm_prefix_ranges:
            raise InvalidArgumentError(
                f"request {scheduled[i].req_id!r} brings mm_prefix_ranges, but no layer of "
                f"this runtime takes image ranges (AttentionSpec.mm_prefix is False on "
                f"every layer)"
            )


def _check_types(scheduled: Sequence[ScheduledRequest]) -> None:
    """``scheduled`` must be a sequence whose entries are ``ScheduledRequest`` (or a
    subclass): their own checks ran."""
    given_object: object = scheduled  # untyped callers reach here too
    if not isinstance(given_object, Sequence) or isinstance(given_object, str | bytes):
        raise ArgumentTypeError(
            f"scheduled must be a sequence (e.g. a list) of ScheduledRequest, got "
            f"{type(given_object).__name__}"
            + (" (wrap it in a list)" if isinstance(given_object, ScheduledRequest) else "")
        )
    types = set(map(type, scheduled)) - {ScheduledRequest}
    if types and not all(issubclass(t, ScheduledRequest) for t in types):
        given: Sequence[object] = scheduled  # untyped callers reach here too
        bad = next(r for r in given if not isinstance(r, ScheduledRequest))
        raise ArgumentTypeError(f"scheduled must hold ScheduledRequest objects, got {bad!r}")


def _check_unique(ids: list[str]) -> None:
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        for req_id in ids:
            if req_id in seen:
                raise DuplicateRequestError(f"request {req_id!r} is scheduled twice in one step")
            seen.add(req_id)
