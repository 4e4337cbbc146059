"""What an engine schedules (``ScheduledRequest``) and what ``begin_step`` decided
(``StepBatch``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import cast

from .._validation import check_mm_prefix_ranges, is_nonnegative_int, is_positive_int
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..kv_cache import PrefixMatch


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    """One request of a step.

    Attributes:
        req_id: the engine's id; a new id starts a request.
        num_new_tokens: tokens scheduled this step (a prompt chunk, or 1 to decode).
        encoder_len: for models with cross-attention layers, the request's encoder
            tokens (given on its first step).
        prefix: on a request's first step, the ``PrefixMatch`` of its prompt
            (``runtime.match_prefix``, prefix caching on): the request starts with
            ``prefix.num_tokens`` computed tokens read from the cached blocks, and
            ``num_new_tokens`` counts from there. Read on the first step only (a
            request that holds cache has started; a later step's prefix is ignored).
        num_draft_tokens: how many of the step's last tokens are speculative drafts
            (at most ``config.num_speculative_tokens``, fewer than ``num_new_tokens``,
            0 on a request's first step), which ``runtime.accept`` may take back after
            verification (docs/speculative.md).
        draft_parents: the drafts as a tree: per draft token (in draft order), the
            index of its parent among the step's drafts, or -1 for the root (the
            step's last token before the drafts, the request's last accepted token).
            Each parent comes before its child, so ``draft_parents[i]`` is in ``-1 ..
            i - 1``. ``None`` (the default): a chain, draft ``i``'s parent is ``i - 1``.
            A draft token attends to the cached context, the root, its ancestors and
            itself; trees need ``AttentionConfig.draft_tree_width`` > 1.
        mm_prefix_ranges: on a request's first step, its image ranges: ``(start,
            end)`` pairs of token positions (``start`` included, ``end`` not), sorted
            and not overlapping, at most ``config.max_mm_prefix_ranges``. Layers whose
            spec sets ``mm_prefix`` let the queries of a range see all of it. A range
            is scheduled whole: a step whose tokens end strictly inside one, or a
            prefix hit that does, is refused. Read on the first step only, like
            ``prefix``.
    """

    req_id: str
    num_new_tokens: int
    encoder_len: int = 0
    prefix: PrefixMatch | None = None
    num_draft_tokens: int = 0
    draft_parents: tuple[int, ...] | None = None
    mm_prefix_ranges: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        # Checked here, where the engine makes it, so begin_step need not re-check
        # every field of every request on the hot path.
        if not isinstance(self.req_id, str):
            raise ArgumentTypeError(
                f"ScheduledRequest.req_id must be a str, got {self.req_id!r} "
                f"({type(self.req_id).__name__})"
            )
        if not self.req_id:
            raise InvalidArgumentError("ScheduledRequest.req_id must be a non-empty str, got ''")
        if not is_positive_int(self.num_new_tokens):
            raise InvalidArgumentError(
                f"request {self.req_id!r}: num_new_tokens must be an int >= 1, "
                f"got {self.num_new_tokens!r}"
            )
        if not is_nonnegative_int(self.encoder_len):
            raise InvalidArgumentError(
                f"request {self.req_id!r}: encoder_len must be an int >= 0, got {self.encoder_len!r}"
            )
        if self.num_draft_tokens != 0 and (
            not is_nonnegative_int(self.num_draft_tokens)
            or self.num_draft_tokens >= self.num_new_tokens
        ):
            raise InvalidArgumentError(
                f"request {self.req_id!r}: num_draft_tokens must be an int >= 0 and below "
                f"num_new_tokens={self.num_new_tokens} (the step's first token is never "
                f"a draft), got {self.num_draft_tokens!r}"
            )
        if self.draft_parents is not None:
            object.__setattr__(self, "draft_parents", self._checked_parents())
        if self.mm_prefix_ranges != ():
            check_mm_prefix_ranges(f"request {self.req_id!r}: mm_prefix_ranges", self.mm_prefix_ranges)
        if self.prefix is not None and not isinstance(self.prefix, PrefixMatch):
            raise ArgumentTypeError(
                f"request {self.req_id!r}: prefix must be a PrefixMatch (from "
                f"runtime.match_prefix) or None, got {type(self.prefix).__name__}"
            )


    def _checked_parents(self) -> tuple[int, ...]:
        given: object = self.draft_parents  # untyped callers reach here too
        if isinstance(given, str | bytes) or not isinstance(given, Sequence):
            raise ArgumentTypeError(
                f"request {self.req_id!r}: draft_parents must be a sequence of ints (one "
                f"parent index per draft token) or None, got {type(given).__name__}"
            )
        parents = tuple(cast("Sequence[object]", given))
        if len(parents) != self.num_draft_tokens:
            raise InvalidArgumentError(
                f"request {self.req_id!r}: draft_parents must have one entry per draft "
                f"token (num_draft_tokens={self.num_draft_tokens}), got {len(parents)}"
            )
        for i, p in enumerate(parents):
            if isinstance(p, bool) or not isinstance(p, int) or not -1 <= p < i:
                raise InvalidArgumentError(
                    f"request {self.req_id!r}: draft_parents[{i}] must be an int in -1..{i - 1} "
                    f"(-1: the root; else an earlier draft token), got {p!r}"
                )
        return cast("tuple[int, ...]", parents)

    @property
    def is_tree(self) -> bool:
        """Whether the drafts are a tree other than a chain."""
        parents = self.draft_parents
        return parents is not None and any(p != i - 1 for i, p in enumerate(parents))


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """What ``begin_step`` decided.

    Attributes:
        order: request ids in batch order; the step's tokens must be laid out in it.
        query_lens: new tokens per request, in ``order``.
        num_tokens: total tokens of the step.
        encoder_order: requests whose encoder K/V are written this step, in order.
    """

    order: tuple[str, ...]
    query_lens: tuple[int, ...]
    num_tokens: int
    encoder_order: tuple[str, ...]

    def token_slices(self) -> dict[str, slice]:
        """Request id -> the rows of the step's token tensors that belong to it."""
        slices: dict[str, slice] = {}
        start = 0
        for rid, n in zip(self.order, self.query_lens, strict=True):
            slices[rid] = slice(start, start + n)
            start += n
        return slices
