"""``Engine``: a continuous-batching loop over an ``AttentionRuntime``, small enough to read.

Each engine step is one runtime step: the engine picks the step's tokens, calls
``runtime.begin_step`` once, lays the tokens out in the batch order the runtime chose,
calls the model once with the whole step, and samples from the logits of the requests
whose known tokens are all computed::

    engine = Engine(model, max_tokens_per_step=64)
    engine.add_request("a", [1, 5, 9, 4], SamplingParams(max_new_tokens=8))
    engine.add_request("b", [7, 7, 2], SamplingParams(max_new_tokens=4, temperature=0.8, seed=1))
    result = engine.run()
    result.outputs["a"]          # the 8 generated token ids
    result.steps[0].scheduled    # (("a", 4), ("b", 3)): request and tokens, batch order

Scheduling (a common continuous-batching policy, e.g. vLLM's, kept minimal):

- requests already running go first, oldest first: a decoding request takes one token,
  a request still in its prompt takes the next chunk that fits the step's budget
  (chunked prefill); then waiting requests are admitted in arrival order while budget
  and ``max_requests_per_step`` allow, their first chunk cut to what is left;
- when the cache cannot hold the step (``OutOfBlocksError``: ``begin_step`` changed
  nothing), the newest request admitted this step is put back in the queue; with none
  left, the newest running request is **preempted**: its blocks are freed and it goes
  back to the front of the queue, to recompute its prompt and the tokens generated so far
  in a later step (recompute, not swap);
- a request finishes after ``max_new_tokens`` tokens or a stop token; its blocks are
  freed at once (with its tokens, so the cache can name its generated blocks).

Prefix caching (docs/prefix-caching.md): when the runtime was built with it on
(``AttentionConfig(prefix_caching={'enabled': True})``), every request is looked up when
it is admitted (``runtime.match_prefix`` over its known tokens) and starts from the hit:
its cached tokens are not computed again (the last prompt token always is, for its
logits). ``Engine(..., prefix_caching=False)`` turns that off; ``Engine.prefix_stats()``
reports the hit rate, the prefill tokens saved and why hits fell short. When the
runtime's state layers keep checkpoints (``runtime.checkpoint_interval``), a prefill
chunk that would cross a checkpoint boundary ends on the last one it crosses, and a
request's first chunk ends where its match says only checkpoints are missing
(``PrefixMatch.checkpoint_junction``), so the state after a shared prefix is kept.

Speculative decoding (docs/speculative.md): ``Engine(..., speculative=PromptLookup(k))``
drafts up to ``k`` tokens for each greedy decoding request by prompt lookup (the tokens
that followed the latest earlier occurrence of its last n-gram), runs them with its
last token as one verify step (``ScheduledRequest(num_draft_tokens=...)``), keeps the
drafts the model's own greedy picks agree with plus the pick after them, and gives
the rest back (``runtime.accept``); so the tokens equal greedy decoding without
drafts. The runtime needs ``AttentionConfig(num_speculative_tokens >= k)``;
``Engine.speculative_stats()`` reports the acceptance rate and tokens per step.

The model is anything with ``prepare_step()`` (the runtime to run the step on) and
``__call__(batch, token_ids, positions, logits_rows) -> logits`` (``StepModel``: the
logits of the rows the engine samples or verifies from, so the LM head skips the rest
of a prefill);
``FunctionModel`` wraps a runtime and a plain function, and
``attnkit.integrations.transformers.attach`` makes a transformers model one. When
``prepare_step`` returns another runtime than the last step's (a model moved to another
device or dtype was rebuilt), the new runtime's cache is empty, so every running request
recomputes.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import torch

from .._validation import check_mm_prefix_ranges, is_int, is_nonnegative_int, is_positive_int
from ..capabilities import Determinism
from ..errors import (
    ArgumentTypeError,
    DuplicateRequestError,
    EngineLimitError,
    InvalidArgumentError,
    OutOfBlocksError,
    StalePrefixError,
)
from ..kv_cache import PrefixMatch
from ..prefix_cache import PrefixCacheStats
from ..runtime import AttentionRuntime, ScheduledRequest, StepBatch

__all__ = [
    "Engine",
    "EnginePrefixStats",
    "EngineResult",
    "EngineSpeculativeStats",
    "FunctionModel",
    "PromptLookup",
    "Request",
    "RequestLogits",
    "SamplingParams",
    "StepModel",
    "StepStats",
]


class StepModel(Protocol):
    """What the engine drives: a model that runs one whole step at a time."""

    def prepare_step(self) -> AttentionRuntime:
        """The runtime the next step runs on (called once per step, before scheduling)."""
        ...

    def __call__(
        self,
        batch: StepBatch,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[R, V]`` of the step tokens ``logits_rows`` names (all ``T`` when
        ``None``).

        ``token_ids`` and ``positions`` are int64 ``[T]`` on the CPU, laid out in
        ``batch.order`` (each request's tokens contiguous, ``batch.query_lens`` of
        them); ``positions`` are the tokens' positions in their requests.
        ``logits_rows``: int64 ``[R]``, increasing: the rows the engine samples or
        verifies from (a prompt chunk's last token, a decode, a verify step's tokens),
        so a model can skip the LM head on the rest, which is most of a prefill's.
        """
        ...


@dataclasses.dataclass(frozen=True)
class FunctionModel:
    """A ``StepModel`` from a runtime and a function ``(batch, token_ids, positions) ->
    logits``: the engine without any framework (the function calls
    ``runtime.forward`` for each attention layer)."""

    runtime: AttentionRuntime
    function: Callable[[StepBatch, torch.Tensor, torch.Tensor], torch.Tensor]

    def prepare_step(self) -> AttentionRuntime:
        return self.runtime

    def __call__(
        self,
        batch: StepBatch,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        logits = self.function(batch, token_ids, positions)
        returned: object = logits  # any callable may be the function
        if logits_rows is None or not isinstance(returned, torch.Tensor) or logits.dim() != 2:
            return logits  # (the engine checks what came back)
        if logits.shape[0] != batch.num_tokens:
            raise InvalidArgumentError(
                f"the function returned {logits.shape[0]} rows of logits for a step of "
                f"{batch.num_tokens} tokens"
            )
        return logits[logits_rows.to(logits.device)]


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """Prompt-lookup (n-gram) drafting: a request's drafts are the tokens that followed
    the latest earlier occurrence of its last ``n`` tokens, for the longest ``n`` from
    ``max_ngram`` down to ``min_ngram`` that occurs (none: no drafts).

    Attributes:
        num_draft_tokens: the most drafts per request and step (``k``).
        max_ngram, min_ngram: the n-gram lengths tried, longest first.
    """

    num_draft_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        for name in ("num_draft_tokens", "max_ngram", "min_ngram"):
            if not is_positive_int(getattr(self, name)):
                raise InvalidArgumentError(
                    f"PromptLookup.{name} must be an int >= 1, got {getattr(self, name)!r}"
                )
        if self.min_ngram > self.max_ngram:
            raise InvalidArgumentError(
                f"PromptLookup.min_ngram={self.min_ngram} must be at most max_ngram="
                f"{self.max_ngram}"
            )

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``min(limit, num_draft_tokens)`` drafts to follow ``tokens``."""
        limit = min(limit, self.num_draft_tokens)
        if limit <= 0:
            return []
        size = len(tokens)
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            tail = list(tokens[size - n :])
            # The latest earlier occurrence with at least one token after it.
            for start in range(size - n - 1, -1, -1):
                if list(tokens[start : start + n]) == tail:
                    return list(tokens[start + n : start + n + limit])
        return []


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How a request picks its tokens.

    Attributes:
        max_new_tokens: tokens to generate (>= 1).
        temperature: 0 picks the most likely token (greedy); above 0 samples from
            ``softmax(logits / temperature)``.
        top_k: sample among the ``top_k`` most likely tokens only (``None``: all).
        seed: seed of the request's own ``torch.Generator`` (sampling only), so a
            request draws the same tokens whatever else runs beside it.
        stop_token_ids: generation ends after one of these (it is kept in the output).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not is_positive_int(self.max_new_tokens):
            raise InvalidArgumentError(
                f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}"
            )
        temperature: object = self.temperature
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, int | float)
            or not math.isfinite(temperature)
            or temperature < 0
        ):
            raise InvalidArgumentError(
                f"SamplingParams.temperature must be a finite float >= 0 (0: greedy), got "
                f"{self.temperature!r}"
            )
        if self.top_k is not None and not is_positive_int(self.top_k):
            raise InvalidArgumentError(
                f"SamplingParams.top_k must be an int >= 1 or None, got {self.top_k!r}"
            )
        if not is_int(self.seed):
            raise ArgumentTypeError(f"SamplingParams.seed must be an int, got {self.seed!r}")
        if not all(is_nonnegative_int(t) for t in self.stop_token_ids):
            raise InvalidArgumentError(
                f"SamplingParams.stop_token_ids must hold token ids (ints >= 0), got "
                f"{self.stop_token_ids!r}"
            )


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt of token ids to generate from.

    Attributes:
        req_id: unique among the engine's live requests.
        prompt: token ids (at least one).
        sampling: how to pick tokens.
        arrival_step: the first engine step that may schedule it (requests arriving
            while others run).
        mm_prefix_ranges: its image ranges ``(start, end)`` inside the prompt (the
            runtime's ``ScheduledRequest.mm_prefix_ranges``): each is computed in one
            step (a chunk never ends inside one, a prefix hit that would is shortened
            to end before it).
    """

    req_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    arrival_step: int = 0
    mm_prefix_ranges: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        req_id: object = self.req_id  # untyped callers may pass anything
        if not isinstance(req_id, str) or not req_id:
            raise ArgumentTypeError(f"Request.req_id must be a non-empty str, got {self.req_id!r}")
        prompt: object = self.prompt
        if not isinstance(prompt, tuple) or not prompt:
            raise InvalidArgumentError(
                f"request {self.req_id!r}: prompt must be a non-empty tuple of token ids, got "
                f"{self.prompt!r}"
            )
        # Plain ints >= 0 are checked in C (a 1k-token prompt: a call per token cost
        # more than the request's whole admission); anything else goes one by one.
        plain = set(map(type, self.prompt)) == {int} and min(self.prompt) >= 0
        if not plain and not all(is_nonnegative_int(t) for t in self.prompt):
            bad = next(t for t in self.prompt if not is_nonnegative_int(t))
            raise InvalidArgumentError(
                f"request {self.req_id!r}: prompt must hold token ids (ints >= 0), got {bad!r}"
            )
        if not isinstance(self.sampling, SamplingParams):
            raise ArgumentTypeError(
                f"request {self.req_id!r}: sampling must be a SamplingParams, got "
                f"{type(self.sampling).__name__}"
            )
        if not is_nonnegative_int(self.arrival_step):
            raise InvalidArgumentError(
                f"request {self.req_id!r}: arrival_step must be an int >= 0, got "
                f"{self.arrival_step!r}"
            )
        where = f"request {self.req_id!r}: mm_prefix_ranges"
        if check_mm_prefix_ranges(where, self.mm_prefix_ranges) > len(self.prompt):
            raise InvalidArgumentError(
                f"{where} = {self.mm_prefix_ranges!r} reaches past the prompt's "
                f"{len(self.prompt)} tokens"
            )


@dataclasses.dataclass(frozen=True)
class RequestLogits:
    """The logits one step computed for one request.

    Attributes:
        start: position of the first row's token in the request.
        logits: ``[n, V]``, row ``i`` for the token at position ``start + i``.
    """

    start: int
    logits: torch.Tensor


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one engine step did.

    Attributes:
        step: the step's index (0-based).
        scheduled: (request id, tokens) in the runtime's batch order; empty for a step
            that only waited for arrivals (no runtime step then).
        num_tokens: tokens computed.
        num_prefill_tokens, num_decode_tokens: of them, prompt (or recomputed)
            tokens, and single-token decodes of a request's newest token.
        admitted: requests that started (or restarted after preemption) this step.
        preempted: running requests whose blocks were freed to make room.
        sampled: request id -> the token it generated this step.
        finished: requests that completed this step.
        num_free_blocks: free cache blocks after the step (finished requests freed).
        logits: request id -> its rows of the step's logits (``keep_logits=True``).
        num_cached_tokens: tokens the step's admitted requests started with from the
            prefix cache (not computed: prefill saved).
        num_draft_tokens, num_accepted_tokens: speculative drafts the step verified,
            and of them those kept.
    """

    step: int
    scheduled: tuple[tuple[str, int], ...]
    num_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    admitted: tuple[str, ...]
    preempted: tuple[str, ...]
    sampled: Mapping[str, int]
    finished: tuple[str, ...]
    num_free_blocks: int
    logits: Mapping[str, RequestLogits] | None = None
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class EnginePrefixStats:
    """What prefix caching saved the engine so far (``Engine.prefix_stats()``).

    Attributes:
        enabled: whether the engine looks requests up (the runtime has a prefix cache
            and the engine was not built with ``prefix_caching=False``).
        why_off: why it does not, when ``enabled`` is false.
        admissions: requests admitted with a lookup (a preempted request admitted
            again counts again: it recomputes).
        prompt_tokens: the known tokens of those admissions (prompt, plus the tokens
            generated before a preemption).
        cached_tokens: of them, the tokens started from the cache: prefill saved.
        misses: why a lookup served less than its tokens minus the last: the reason's
            kind (``"BlockNotCached"``, ``"NoCheckpoint"``, ``"NeverHits"``, ...) ->
            admissions it limited.
        last_miss: the last such explanation, in words (``PrefixMatch.explain()``).
        cache: the runtime's own counters (``runtime.prefix_cache_stats()``), ``None``
            when it has no prefix cache.
    """

    enabled: bool
    why_off: str | None = None
    admissions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    misses: Mapping[str, int] = dataclasses.field(default_factory=dict[str, int])
    last_miss: str | None = None
    cache: PrefixCacheStats | None = None

    @property
    def hit_rate(self) -> float:
        """Cached tokens over the admissions' tokens (0 with none)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclasses.dataclass(frozen=True)
class EngineSpeculativeStats:
    """What drafting did so far (``Engine.speculative_stats()``).

    Attributes:
        draft_tokens: drafts verified; accepted_tokens: of them, those kept.
        decode_steps: request-steps that decoded (with drafts or without);
        decode_tokens: the tokens they generated.
    """

    draft_tokens: int = 0
    accepted_tokens: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafts verified (0 with none)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a decoding request generates per step (1 without drafts)."""
        return self.decode_tokens / self.decode_steps if self.decode_steps else 0.0


@dataclasses.dataclass(frozen=True)
class EngineResult:
    """What ``Engine.run`` returns.

    Attributes:
        outputs: request id -> generated token ids, in the order requests were added.
        tokens: request id -> prompt followed by the generated tokens.
        steps: one ``StepStats`` per step.
    """

    outputs: Mapping[str, list[int]]
    tokens: Mapping[str, list[int]]
    steps: list[StepStats]

    @property
    def num_preemptions(self) -> int:
        return sum(len(s.preempted) for s in self.steps)


@dataclasses.dataclass(eq=False)
class _Live:
    """A request the engine holds: its tokens, and how many the runtime has computed."""

    request: Request
    tokens: list[int]
    generator: torch.Generator
    num_computed: int = 0
    started: bool = False  # holds blocks in the current runtime
    match: PrefixMatch | None = None  # its lookup, for the admission being tried
    drafts: list[int] = dataclasses.field(default_factory=list[int])  # this step's

    @property
    def req_id(self) -> str:
        return self.request.req_id

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)


def _range_around(ranges: tuple[tuple[int, int], ...], at: int) -> tuple[int, int] | None:
    """The image range ``at`` falls strictly inside, or ``None``."""
    for start, end in ranges:
        if start < at < end:
            return start, end
    return None


def _whole_ranges(live: _Live, start: int, n: int, budget: int) -> int:
    """``n`` tokens from ``start``, cut so the chunk does not end inside an image range:
    back to the range's start, or (a range starting here) on to its end when the budget
    holds it; 0 when it must wait for a step with room."""
    inside = _range_around(live.request.mm_prefix_ranges, start + n)
    if inside is None:
        return n
    if inside[0] > start:
        return inside[0] - start
    return inside[1] - start if inside[1] - start <= budget else 0


class Engine:
    """Serves token-id requests through a ``StepModel`` (see the module docstring).

    Args:
        model: the model (``StepModel``).
        max_tokens_per_step: token budget of a step; default and upper bound: the
            runtime's ``AttentionConfig.max_num_batched_tokens``.
        max_requests_per_step: default and upper bound: ``AttentionConfig.max_num_reqs``.
        keep_logits: keep each step's logits in ``StepStats.logits`` (for checks).
        prefix_caching: look every admitted request up in the runtime's prefix cache
            and skip its cached tokens (default); it takes effect when the runtime was
            built with prefix caching on. ``False``: never look up (every token is
            computed; the runtime still caches what it computes).
        determinism: the ``Determinism`` level the engine keeps for each request's
            attention rows (a level or its name; docs/determinism.md). The runtime must
            have been built with at least it (``AttentionConfig(determinism=...)``, so
            its backends keep it). Below ``chunking_invariant`` a request's prompt is
            cut at fixed positions (multiples of ``chunk_tokens``), never by what the
            step's other requests leave of the budget: a chunk that does not fit waits
            for a later step. Below ``prefix_hit_invariant`` requests are not looked up
            in the prefix cache (a hit would move the chunk boundaries). End-to-end
            bitwise outputs also need the model's own kernels batch-invariant (matrix
            products with one tiling and no split-K, norms reduced per row), which this
            engine cannot see; and a preempted request recomputes its tokens as a
            prefill, the same bits only from ``prefill_decode`` up.
        speculative: draft tokens for greedy decoding requests (``PromptLookup``), at
            most the runtime's ``AttentionConfig.num_speculative_tokens`` per step;
            ``None``: decode one token per step.

    Raises:
        InvalidArgumentError: a limit out of range, or a ``determinism`` above the
            runtime's (the message names it).
    """

    def __init__(
        self,
        model: StepModel,
        *,
        max_tokens_per_step: int | None = None,
        max_requests_per_step: int | None = None,
        keep_logits: bool = False,
        prefix_caching: bool = True,
        determinism: Determinism | str = Determinism.NONE,
        speculative: PromptLookup | None = None,
    ) -> None:
        given: object = model
        if not callable(given) or not callable(getattr(given, "prepare_step", None)):
            raise ArgumentTypeError(
                f"model must have prepare_step() and __call__(batch, token_ids, positions) "
                f"(a StepModel; FunctionModel wraps a runtime and a function), got "
                f"{type(given).__name__}"
            )
        self.model = model
        self._runtime = model.prepare_step()
        config = self._runtime.config
        self.max_tokens_per_step = _limit(
            "max_tokens_per_step",
            max_tokens_per_step,
            config.max_num_batched_tokens,
            "AttentionConfig.max_num_batched_tokens",
        )
        self.max_requests_per_step = _limit(
            "max_requests_per_step",
            max_requests_per_step,
            config.max_num_reqs,
            "AttentionConfig.max_num_reqs",
        )
        self.keep_logits = keep_logits
        self._logit_row: dict[int, int] | None = None
        """The last step's step row -> row of the model's logits (``None``: the same)."""
        flag: object = prefix_caching
        if not isinstance(flag, bool):
            raise ArgumentTypeError(f"prefix_caching must be a bool, got {type(flag).__name__}")
        self.prefix_caching = prefix_caching
        self.determinism = Determinism.parse(determinism)
        if self.determinism > config.determinism:
            raise InvalidArgumentError(
                f"determinism={self.determinism.label} needs a runtime built with at least "
                f"that level (AttentionConfig(determinism={self.determinism.label!r})), "
                f"got a runtime at {config.determinism.label}"
            )
        # Below chunking invariance a request's chunks must not follow the others'.
        fixed = Determinism.BATCH_INVARIANT <= self.determinism < Determinism.CHUNKING_INVARIANT
        # A fixed chunk fits beside a decode of every other request the step may hold.
        budget, width = self.max_tokens_per_step, self.max_requests_per_step
        self.chunk_tokens: int | None = max(1, budget // 2, budget - width + 1) if fixed else None
        if speculative is not None:
            if not isinstance(speculative, PromptLookup):
                raise ArgumentTypeError(
                    f"speculative must be a PromptLookup or None, got {type(speculative).__name__}"
                )
            if speculative.num_draft_tokens > config.num_speculative_tokens:
                raise InvalidArgumentError(
                    f"speculative: PromptLookup.num_draft_tokens={speculative.num_draft_tokens} "
                    f"exceeds the runtime's AttentionConfig.num_speculative_tokens="
                    f"{config.num_speculative_tokens}"
                )
        self.speculative = speculative
        self._spec = EngineSpeculativeStats()
        self._rejected = 0  # the last step's rejected drafts
        self._prefix = _PrefixTally()
        self.step_index = 0
        self._live: dict[str, _Live] = {}
        self._running: list[_Live] = []  # holds blocks, oldest admission first
        self._waiting: deque[_Live] = deque()  # arrival order; preempted ones in front
        self._done: dict[str, _Live] = {}
        self._order: list[str] = []

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        req_id: str,
        prompt: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        arrival_step: int | None = None,
        mm_prefix_ranges: tuple[tuple[int, int], ...] = (),
    ) -> None:
        """Queue a request; it is scheduled from ``arrival_step`` on (default: now);
        ``mm_prefix_ranges``: its image ranges (``Request.mm_prefix_ranges``).

        Raises:
            DuplicateRequestError: ``req_id`` is live or already finished here.
            EngineLimitError: prompt plus ``max_new_tokens`` exceed ``max_model_len``.
        """
        if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence):
            raise ArgumentTypeError(
                f"request {req_id!r}: prompt must be a sequence of token ids (e.g. a list of "
                f"int), got {type(prompt).__name__}"
            )
        request = Request(
            req_id,
            tuple(prompt),
            sampling if sampling is not None else SamplingParams(),
            self.step_index if arrival_step is None else arrival_step,
            mm_prefix_ranges,
        )
        self.submit(request)

    def submit(self, request: Request) -> None:
        """Queue a ``Request`` (``add_request`` with the fields given as one object)."""
        if not isinstance(request, Request):
            raise ArgumentTypeError(f"request must be a Request, got {type(request).__name__}")
        if request.req_id in self._live or request.req_id in self._done:
            raise DuplicateRequestError(f"request {request.req_id!r} was already added")
        longest = len(request.prompt) + request.sampling.max_new_tokens
        limit = self._runtime.config.max_model_len
        if longest > limit:
            raise EngineLimitError(
                f"request {request.req_id!r} may reach {longest} tokens ({len(request.prompt)} "
                f"prompt + {request.sampling.max_new_tokens} new); AttentionConfig."
                f"max_model_len={limit}"
            )
        longest_range = max((e - s for s, e in request.mm_prefix_ranges), default=0)
        if longest_range > self.max_tokens_per_step:
            raise EngineLimitError(
                f"request {request.req_id!r}: an image range of {longest_range} tokens "
                f"(mm_prefix_ranges) is computed in one step, more than "
                f"max_tokens_per_step={self.max_tokens_per_step}"
            )
        generator = torch.Generator()
        generator.manual_seed(request.sampling.seed)
        live = _Live(request, list(request.prompt), generator)
        self._live[request.req_id] = live
        self._waiting.append(live)
        self._order.append(request.req_id)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._live)

    # ------------------------------------------------------------------ stepping

    def run(self, requests: Iterable[Request] = (), *, max_steps: int = 100_000) -> EngineResult:
        """Submit ``requests``, then step until every request has finished.

        Raises:
            EngineLimitError: ``max_steps`` steps did not finish the requests.
            OutOfBlocksError: one request alone needs more blocks than the pool has.
        """
        for request in requests:
            self.submit(request)
        steps: list[StepStats] = []
        while self.has_unfinished():
            if len(steps) >= max_steps:
                raise EngineLimitError(
                    f"Engine.run: {len(self._live)} request(s) unfinished after max_steps="
                    f"{max_steps} steps"
                )
            steps.append(self.step())
        return EngineResult(
            outputs={
                rid: self._done[rid].tokens[len(self._done[rid].request.prompt) :]
                for rid in self._order
                if rid in self._done
            },
            tokens={rid: list(self._done[rid].tokens) for rid in self._order if rid in self._done},
            steps=steps,
        )

    def step(self) -> StepStats:
        """Run one engine step (one runtime step when anything is scheduled)."""
        index = self.step_index
        self.step_index += 1
        runtime = self.model.prepare_step()
        if runtime is not self._runtime:
            # A rebuilt runtime holds no cache: everything running starts over.
            self._runtime = runtime
            for live in self._running:
                live.num_computed, live.started = 0, False
        lookup = runtime if self._looks_up(runtime) else None
        for live in self._waiting:  # a request held back is looked up again
            live.match = None
        for live in self._running:
            live.match = None
        preempted: list[str] = []
        held: set[_Live] = set()
        while True:
            # No admissions in a step that had to preempt: the room is for the running.
            plan, admitted = self._schedule(index, held, admit=not preempted, lookup=lookup)
            if not plan:
                return self._idle_stats(index, preempted)
            try:
                batch = runtime.begin_step(
                    [
                        ScheduledRequest(
                            live.req_id,
                            n,
                            prefix=live.match,
                            num_draft_tokens=len(live.drafts),
                            # A request new to the runtime brings its image ranges.
                            mm_prefix_ranges=() if live.started else live.request.mm_prefix_ranges,
                        )
                        for live, n in plan.items()
                    ]
                )
                break
            except OutOfBlocksError:
                self._make_room(plan, admitted, held, preempted)
            except StalePrefixError:
                # A hit's block was evicted since its lookup (nothing changed): look
                # the step's new requests up again.
                for live in plan:
                    live.match = None
        for live in admitted:
            self._waiting.remove(live)
            self._running.append(live)
        cached = 0
        for live in plan:
            if live.match is not None:  # it started in the runtime from its hit
                live.num_computed = live.match.num_tokens
                cached += live.num_computed
                self._prefix.record(live.match)
                live.match = None
        try:
            logits = self._forward(batch, plan)
        except BaseException:
            # The runtime counted the step's tokens, the engine did not: start everything
            # running over so both agree again, then let the error through.
            self._reset_running(runtime)
            raise
        return self._finish_step(index, runtime, batch, plan, admitted, preempted, logits, cached)

    def speculative_stats(self) -> EngineSpeculativeStats:
        """Drafts verified and kept so far, and tokens per decoding step."""
        return self._spec

    def _looks_up(self, runtime: AttentionRuntime) -> bool:
        return (
            self.prefix_caching
            and runtime.manager.prefix is not None
            and not Determinism.BATCH_INVARIANT
            <= self.determinism
            < Determinism.PREFIX_HIT_INVARIANT
        )

    def prefix_stats(self) -> EnginePrefixStats:
        """The hit rate and prefill tokens prefix caching saved so far, and why it is
        off (``why_off``) or why hits fell short (``misses``, ``last_miss``)."""
        runtime = self._runtime
        has_cache = runtime.manager.prefix is not None
        why_off: str | None = None
        if not self.prefix_caching:
            why_off = "turned off: Engine(prefix_caching=False)"
        elif Determinism.BATCH_INVARIANT <= self.determinism < Determinism.PREFIX_HIT_INVARIANT:
            why_off = (
                f"turned off by Engine(determinism={self.determinism.label!r}): a hit would "
                "move the request's chunk boundaries (prefix_hit_invariant keeps them)"
            )
        elif not has_cache:
            why_off = (
                "the runtime's prefix caching is off: build it with "
                "AttentionConfig(prefix_caching={'enabled': True})"
            )
        tally = self._prefix
        return EnginePrefixStats(
            enabled=why_off is None,
            why_off=why_off,
            admissions=tally.admissions,
            prompt_tokens=tally.prompt_tokens,
            cached_tokens=tally.cached_tokens,
            misses=dict(tally.misses),
            last_miss=tally.last_miss,
            cache=runtime.prefix_cache_stats() if has_cache else None,
        )

    def _schedule(
        self, index: int, held: set[_Live], *, admit: bool, lookup: AttentionRuntime | None
    ) -> tuple[dict[_Live, int], list[_Live]]:
        """Tokens per request for this step (running first), and the newly admitted
        (none unless ``admit``); ``held``: waiting requests held back from this step.
        ``lookup``: the runtime whose prefix cache an admission is looked up in (its
        first chunk starts after the hit)."""
        budget = self.max_tokens_per_step
        interval = lookup.checkpoint_interval if lookup is not None else None
        plan: dict[_Live, int] = {}
        for live in self._running:
            if budget == 0 or len(plan) == self.max_requests_per_step:
                break
            # One that holds no blocks (a failed step, a rebuilt runtime) starts again.
            hit = 0 if live.started else self._look_up(live, lookup)
            start = max(live.num_computed, hit)
            n = self._take(live, start, budget)
            if n == 0:
                continue  # a fixed chunk that does not fit this step
            if self.chunk_tokens is None:  # fixed chunks keep their positions
                n = _aligned(live, start, n, interval)
            live.drafts = self._drafts(live, start, n, budget)
            n += len(live.drafts)
            plan[live] = n
            budget -= n
        admitted: list[_Live] = []
        for live in self._waiting if admit else ():
            if budget == 0 or len(plan) == self.max_requests_per_step:
                break
            if live.request.arrival_step > index or live in held:
                continue
            start = self._look_up(live, lookup)
            n = self._take(live, start, budget)
            if n == 0:
                continue
            if self.chunk_tokens is None:
                n = _aligned(live, start, n, interval)
            live.drafts = []
            plan[live] = n
            admitted.append(live)
            budget -= n
        return plan, admitted

    def _take(self, live: _Live, start: int, budget: int) -> int:
        """Tokens ``live`` computes this step from ``start``: all that fit ``budget``;
        with ``chunk_tokens``, the rest of its fixed chunk (ending at the next multiple
        of ``chunk_tokens``) or nothing when that does not fit."""
        left = len(live.tokens) - start
        if self.chunk_tokens is None:
            return _whole_ranges(live, start, min(left, budget), budget)
        n = min(left, (start // self.chunk_tokens + 1) * self.chunk_tokens - start)
        return _whole_ranges(live, start, n, budget) if n <= budget else 0

    def _drafts(self, live: _Live, start: int, n: int, budget: int) -> list[int]:
        """Drafts for a greedy request decoding its newest token (none otherwise)."""
        drafter = self.speculative
        if (
            drafter is None
            or not live.started
            or n != 1
            or start != len(live.tokens) - 1
            or live.request.sampling.temperature != 0
        ):
            return []
        # A verify step yields at most drafts + 1 tokens: stay within max_new_tokens.
        left = live.request.sampling.max_new_tokens - live.num_generated - 1
        return drafter.propose(live.tokens, min(left, budget - 1))

    @staticmethod
    def _look_up(live: _Live, lookup: AttentionRuntime | None) -> int:
        """The tokens ``live`` starts with from ``lookup``'s prefix cache (matched once
        per attempt)."""
        if lookup is None:
            return 0
        if live.match is None:
            live.match = lookup.match_prefix(live.tokens)
            # A hit ending inside an image range would split it: look the prompt up
            # again cut at the range's start (the hit is then at most that).
            inside = _range_around(live.request.mm_prefix_ranges, live.match.num_tokens)
            while inside is not None:
                live.match = lookup.match_prefix(live.tokens[: inside[0] + 1])
                inside = _range_around(live.request.mm_prefix_ranges, live.match.num_tokens)
        return live.match.num_tokens

    def _make_room(
        self,
        plan: Mapping[_Live, int],
        admitted: list[_Live],
        held: set[_Live],
        preempted: list[str],
    ) -> None:
        """The step did not fit: hold back the newest admission, else preempt the newest
        running request (free its blocks, queue it first to recompute)."""
        if len(plan) == 1 and len(self._running) <= (0 if admitted else 1):
            # Alone in the pool (nothing else holds blocks) and still too big.
            ((live, n),) = plan.items()
            raise OutOfBlocksError(
                f"request {live.req_id!r} needs more cache blocks for {n} token(s) at "
                f"position {live.num_computed} than the pool's "
                f"{self._runtime.manager.pool.num_blocks - 1} usable blocks hold, with "
                f"nothing left to preempt; attach with more blocks or lower "
                f"max_tokens_per_step"
            )
        if admitted:
            # Held back: it stays in the queue, unchanged, for a later step.
            held.add(admitted[-1])
            return
        victim = self._running.pop()
        if victim.started:
            self._free(self._runtime, [victim])
        victim.num_computed, victim.started = 0, False
        victim.drafts = []
        self._waiting.appendleft(victim)
        preempted.append(victim.req_id)

    def _forward(self, batch: StepBatch, plan: Mapping[_Live, int]) -> torch.Tensor:
        """Lay the step's tokens out in batch order, run the model for the logits of
        the rows the step samples or verifies from (every row with ``keep_logits``),
        check them; returns them as ``[T, V]`` rows in ``self._logit_row`` order."""
        token_ids: list[int] = []
        positions: list[int] = []
        wanted: list[int] = []
        row = 0
        for req_id, n in zip(batch.order, batch.query_lens, strict=True):
            live = self._live[req_id]
            start = live.num_computed
            if live.drafts:  # its newest token, then the drafts: every row verifies
                token_ids.extend([*live.tokens[start:], *live.drafts])
                wanted.extend(range(row, row + n))
            else:
                token_ids.extend(live.tokens[start : start + n])
                if start + n >= len(live.tokens):  # its known tokens done: it samples
                    wanted.append(row + n - 1)
            positions.extend(range(start, start + n))
            row += n
        every = self.keep_logits or len(wanted) == batch.num_tokens
        rows = None if every else torch.tensor(wanted, dtype=torch.int64)
        self._logit_row = None if every else {r: i for i, r in enumerate(wanted)}
        logits = self.model(
            batch,
            torch.tensor(token_ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            rows,
        )
        returned: object = logits  # any callable may be the model
        if not isinstance(returned, torch.Tensor):
            raise ArgumentTypeError(
                f"the model must return logits [T, V] as a torch.Tensor, got "
                f"{type(returned).__name__}"
            )
        if logits.dim() != 2:
            raise InvalidArgumentError(
                f"the model must return logits [T, V], got shape {list(logits.shape)}"
            )
        expected = batch.num_tokens if rows is None else rows.numel()
        if logits.shape[0] != expected:
            raise InvalidArgumentError(
                f"the model returned {logits.shape[0]} rows of logits for a step of "
                f"{batch.num_tokens} tokens"
                + ("" if rows is None else f" that asked for {expected} (logits_rows)")
            )
        for live in plan:
            live.started = True
        return logits

    def _finish_step(
        self,
        index: int,
        runtime: AttentionRuntime,
        batch: StepBatch,
        plan: Mapping[_Live, int],
        admitted: list[_Live],
        preempted: list[str],
        logits: torch.Tensor,
        cached: int,
    ) -> StepStats:
        sampled: dict[str, int] = {}
        finished: list[str] = []
        kept: dict[str, RequestLogits] = {}
        prefill = decode = decodes = 0
        slices = batch.token_slices()
        verified = self._verify(runtime, slices, logits)
        greedy = self._greedy_picks(slices, verified, logits)
        for req_id, rows in slices.items():
            live = self._live[req_id]
            n = rows.stop - rows.start
            is_decode = (
                n == 1 + len(live.drafts)
                and live.num_generated > 0
                and live.num_computed == len(live.tokens) - 1
            )
            decode += n if is_decode else 0
            prefill += 0 if is_decode else n
            if self.keep_logits:
                kept[req_id] = RequestLogits(live.num_computed, logits[rows].detach())
            if req_id in verified:
                # The root and the accepted drafts are computed; the last pick is new.
                picks = verified[req_id]
                live.num_computed += len(picks)
                live.drafts = []
                stop = live.request.sampling
                for token in picks:
                    live.tokens.append(token)
                    if live.num_generated >= stop.max_new_tokens or token in stop.stop_token_ids:
                        finished.append(req_id)
                        break
                sampled[req_id] = live.tokens[-1]
                continue
            decodes += is_decode
            live.num_computed += n
            if live.num_computed < len(live.tokens):
                continue  # mid-prompt (or mid-recompute): nothing to sample yet
            pick = greedy.get(req_id)
            token = (
                pick
                if pick is not None
                else _pick(logits[self._row(rows.stop - 1)], live.request.sampling, live.generator)
            )
            live.tokens.append(token)
            sampled[req_id] = token
            stop = live.request.sampling
            if live.num_generated >= stop.max_new_tokens or token in stop.stop_token_ids:
                finished.append(req_id)
        if decodes:  # (the stats are replaced once a step, not per request)
            self._spec = dataclasses.replace(
                self._spec,
                decode_steps=self._spec.decode_steps + decodes,
                decode_tokens=self._spec.decode_tokens + decodes,
            )
        if finished:
            self._free(runtime, [self._live[rid] for rid in finished])
            for req_id in finished:
                live = self._live.pop(req_id)
                self._running.remove(live)
                self._done[req_id] = live
        return StepStats(
            step=index,
            scheduled=tuple(zip(batch.order, batch.query_lens, strict=True)),
            num_tokens=batch.num_tokens,
            num_prefill_tokens=prefill,
            num_decode_tokens=decode,
            admitted=tuple(live.req_id for live in admitted),
            preempted=tuple(preempted),
            sampled=sampled,
            finished=tuple(finished),
            num_free_blocks=runtime.manager.pool.num_free_blocks,
            logits=kept if self.keep_logits else None,
            num_cached_tokens=cached,
            num_draft_tokens=sum(len(p) - 1 for p in verified.values()) + self._rejected,
            num_accepted_tokens=sum(len(p) - 1 for p in verified.values()),
        )

    def _verify(
        self, runtime: AttentionRuntime, slices: Mapping[str, slice], logits: torch.Tensor
    ) -> dict[str, list[int]]:
        """Greedy verification of the step's drafts: request -> its tokens to append
        (the accepted drafts, then the model's pick after them); the rejected drafts
        are given back to the runtime (``accept``)."""
        verified: dict[str, list[int]] = {}
        accepted: dict[str, int] = {}
        self._rejected = 0
        for req_id, rows in slices.items():
            drafts = self._live[req_id].drafts
            if not drafts:
                continue
            first = self._row(rows.start)
            best = torch.argmax(
                logits[first : first + rows.stop - rows.start].detach().float().cpu(), dim=-1
            )
            picks = [int(t) for t in best]
            a = 0
            while a < len(drafts) and drafts[a] == picks[a]:
                a += 1
            verified[req_id] = [*drafts[:a], picks[a]]
            accepted[req_id] = a
            self._rejected += len(drafts) - a
        if accepted:
            kept = sum(accepted.values())
            spec = self._spec
            self._spec = dataclasses.replace(
                spec,
                draft_tokens=spec.draft_tokens + kept + self._rejected,
                accepted_tokens=spec.accepted_tokens + kept,
                decode_steps=spec.decode_steps + len(accepted),
                decode_tokens=spec.decode_tokens + kept + len(accepted),
            )
            runtime.accept(accepted)
        return verified

    def _greedy_picks(
        self, slices: Mapping[str, slice], verified: Mapping[str, list[int]], logits: torch.Tensor
    ) -> dict[str, int]:
        """The step's greedy samples (temperature 0, its known tokens done after the
        step), from one argmax over their rows (what ``_pick`` gives each row alone)."""
        ids: list[str] = []
        rows: list[int] = []
        for req_id, span in slices.items():
            live = self._live[req_id]
            if (
                req_id not in verified
                and live.request.sampling.temperature == 0
                and live.num_computed + span.stop - span.start >= len(live.tokens)
            ):
                ids.append(req_id)
                rows.append(self._row(span.stop - 1))
        if not ids:
            return {}
        best = torch.argmax(logits[rows].detach().float().cpu(), dim=-1)
        picks: list[int] = best.numpy().tolist()
        return dict(zip(ids, picks, strict=True))

    def _row(self, step_row: int) -> int:
        """The row of the model's logits that holds step row ``step_row``'s."""
        return step_row if self._logit_row is None else self._logit_row[step_row]

    def _idle_stats(self, index: int, preempted: list[str]) -> StepStats:
        return StepStats(
            step=index,
            scheduled=(),
            num_tokens=0,
            num_prefill_tokens=0,
            num_decode_tokens=0,
            admitted=(),
            preempted=tuple(preempted),
            sampled={},
            finished=(),
            num_free_blocks=self._runtime.manager.pool.num_free_blocks,
            logits={} if self.keep_logits else None,
        )

    def _free(self, runtime: AttentionRuntime, lives: Sequence[_Live]) -> None:
        """Free requests, with their tokens so their generated blocks get names."""
        ids = [live.req_id for live in lives]
        if runtime.manager.prefix is None:
            runtime.free(ids)
        else:
            runtime.free(ids, token_ids={live.req_id: live.tokens for live in lives})

    def _reset_running(self, runtime: AttentionRuntime) -> None:
        runtime.discard_step()  # the failed step's blocks must never get names
        held = [live.req_id for live in self._running if live.req_id in runtime.manager]
        if held:
            runtime.free(held)
        for live in self._running:
            live.num_computed, live.started = 0, False
            live.drafts = []


class _PrefixTally:
    """The engine's prefix-caching counts (``EnginePrefixStats``)."""

    def __init__(self) -> None:
        self.admissions = self.prompt_tokens = self.cached_tokens = 0
        self.misses: dict[str, int] = {}
        self.last_miss: str | None = None

    def record(self, match: PrefixMatch) -> None:
        self.admissions += 1
        self.prompt_tokens += match.num_prompt_tokens
        self.cached_tokens += match.num_tokens
        reason = match.reason
        if reason is not None:
            kind = type(reason).__name__
            self.misses[kind] = self.misses.get(kind, 0) + 1
            self.last_miss = match.explain()


def _aligned(live: _Live, start: int, n: int, interval: int | None) -> int:
    """A chunk of ``n`` tokens from ``start``, shortened so that it ends on a state
    checkpoint boundary when it crosses one (``interval``; ``None``: no checkpoints):
    at the match's junction (the request's first chunk: only checkpoints are missing
    there, so the next request with the prefix hits), else on the last boundary it
    crosses. Decodes (one token) are left alone."""
    if interval is None or n <= 1:
        return n
    end = start + n
    junction = live.match.checkpoint_junction if live.match is not None else 0
    if start < junction < end:
        return junction - start
    boundary = end // interval * interval
    return boundary - start if start < boundary < end else n


def _limit(name: str, value: int | None, bound: int, bound_name: str) -> int:
    if value is None:
        return bound
    if not is_positive_int(value) or value > bound:
        raise InvalidArgumentError(
            f"{name} must be an int in [1, {bound}] ({bound_name} of the runtime), got {value!r}"
        )
    return value


def _pick(row: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> int:
    """The next token from one row of logits ``[V]``: greedy, or sampled with the
    request's generator (on the CPU, so the draw does not depend on the device)."""
    scores = row.detach().float().cpu()
    if sampling.temperature == 0:
        return int(torch.argmax(scores).item())
    scores = scores / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < scores.numel():
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
