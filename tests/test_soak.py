"""Soak test of the engine-facing runtime: a seeded random engine loop over a hybrid model.

A small engine drives ``AttentionRuntime`` (reference backend, CPU) for many steps over
a model with full-attention, sliding-window, chunked-local and Mamba2 layers, within
the limits it gives ``AttentionConfig`` (max_model_len, max_num_batched_tokens,
max_num_reqs). Each step mixes:

* arrivals, chunked prefills under a random per-step token budget, decodes;
* aborts through ``finished=`` and through ``free()``, restarts (an id finished and
  scheduled anew in one step), and the last step's ids repeated after one was freed;
* ``OutOfBlocksError``: the test predicts from its own counts whether a step fits and
  the runtime must agree (and name the blocks needed); a refused step changes nothing,
  even when it also finishes a live request; then the youngest request is preempted
  (freed, recomputed later) and the step retried;
* rejected steps submitted before the good one (a request scheduled twice, an unknown
  or repeated finished id, a step over an engine limit, a step too big for the cache):
  the right attnkit error, and nothing changed;
* ``forward`` after a request of the step was freed: ``StaleStepError``.

After every step the cache is checked against counts the test keeps itself: no block
owned twice (across requests and groups), the null block never owned, free + owned ==
every usable block, each live request's token count and the exact shape of its block
table in every group (released window/chunk blocks included). Outputs are checked
against a dense recompute of the whole sequence without any cache (float64 attention
by its definition, the token-by-token Mamba2 recurrence) when a request ends and for
one request every ``CHECK_EVERY`` steps. At the end everything is freed and every
block must be back.

A second soak drives ``Engine`` with prefix caching on: requests built from a few shared
prefixes (repeats included) on a pool small enough to evict cached blocks and preempt;
after every step each cached group's ref counts must be exactly its tables' holders (a
block two requests hold is shared through its name), no page in two groups, nothing
leaked; the tokens equal the same requests' with caching off.

``ATTNKIT_SOAK_STEPS`` sets the steps per seed (default ``DEFAULT_STEPS``; ``nox -s
soak`` runs 5000).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import random
import re
from collections.abc import Iterator
from typing import Protocol

import pytest
import torch

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    BackendRegistry,
    ChunkedLocalAttentionSpec,
    DuplicateRequestError,
    EngineLimitError,
    FullAttentionSpec,
    KVCacheSpec,
    KVConnector,
    MambaSpec,
    OutOfBlocksError,
    SlidingWindowSpec,
    StaleStepError,
    UnknownRequestError,
)
from attnkit.demo import DemoModel
from attnkit.integrations.engine import Engine, FunctionModel, SamplingParams
from attnkit.integrations.engine import Request as EngineRequest
from attnkit.kv_cache import NULL_BLOCK
from attnkit.params import LayerParams
from attnkit.registry import BUILTIN_BACKENDS
from attnkit.runtime import AttentionRuntime, ScheduledRequest, StepBatch
from offload_variants import FaultyTier

DEFAULT_STEPS = 200
SEEDS = (0, 1, 2)
CHECK_EVERY = 10
TOL = 2e-5  # float32; the observed error is ~3e-6

# The engine's limits, given to AttentionConfig and respected by the scheduler below.
MAX_MODEL_LEN = 48
MAX_BATCHED_TOKENS = 16
MAX_NUM_REQS = 6

# The model: tiny, so a step costs milliseconds.
VOCAB = 64
HIDDEN = 16
HEADS, KV_HEADS, HEAD_SIZE = 2, 1, 8
WINDOW = 7
CHUNK = 10
BLOCK_SIZE = 4  # attention block size; a unified page holds 3 of them (12 tokens)
NUM_BLOCKS = 26  # pages: null page + 25; one request of MAX_MODEL_LEN needs about 11


def soak_steps() -> int:
    raw = os.environ.get("ATTNKIT_SOAK_STEPS", str(DEFAULT_STEPS))
    try:
        steps = int(raw)
    except ValueError:
        raise ValueError(f"ATTNKIT_SOAK_STEPS must be an int >= 1, got {raw!r}") from None
    if steps < 1:
        raise ValueError(f"ATTNKIT_SOAK_STEPS must be an int >= 1, got {raw!r}")
    return steps


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: torch's thread pool only adds overhead (and the machine is shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------ model


class Mixer(Protocol):
    """One layer: a step through the runtime, and a dense recompute of a whole sequence."""

    @property
    def spec(self) -> KVCacheSpec: ...

    @property
    def params(self) -> LayerParams: ...

    def step(self, runtime: AttentionRuntime, name: str, h: torch.Tensor) -> torch.Tensor: ...

    def dense(self, h: torch.Tensor) -> torch.Tensor: ...


def attention_by_definition(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int | None, chunk: int | None
) -> torch.Tensor:
    """Causal attention of one sequence, in float64, with an explicit mask: key ``j`` is
    visible to query ``i`` iff ``j <= i``, within the window (``i - j < window``) and
    in the same chunk (``i // chunk == j // chunk``). Shares no code with the kernels."""
    t = q.shape[0]
    i = torch.arange(t).unsqueeze(1)
    j = torch.arange(t).unsqueeze(0)
    visible = j <= i
    if window is not None:
        visible &= i - j < window
    if chunk is not None:
        visible &= i // chunk == j // chunk
    groups = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(groups, dim=1)
    vv = v.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    out: torch.Tensor = torch.einsum("hts,shd->thd", scores.softmax(-1), vv)
    return out


class Attention:
    """Full, sliding-window (``window``) or chunked-local (``chunk``) attention."""

    def __init__(
        self, gen: torch.Generator, *, window: int | None = None, chunk: int | None = None
    ) -> None:
        def rand(*shape: int) -> torch.Tensor:
            weight: torch.Tensor = torch.randn(*shape, generator=gen) * shape[0] ** -0.5
            return weight

        self.window, self.chunk = window, chunk
        self.wq = rand(HIDDEN, HEADS * HEAD_SIZE)
        self.wk = rand(HIDDEN, KV_HEADS * HEAD_SIZE)
        self.wv = rand(HIDDEN, KV_HEADS * HEAD_SIZE)
        self.wo = rand(HEADS * HEAD_SIZE, HIDDEN)
        self.spec: KVCacheSpec
        if window is not None:
            self.spec = SlidingWindowSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=KV_HEADS,
                head_size=HEAD_SIZE,
                dtype=torch.float32,
                sliding_window=window,
            )
        elif chunk is not None:
            self.spec = ChunkedLocalAttentionSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=KV_HEADS,
                head_size=HEAD_SIZE,
                dtype=torch.float32,
                attention_chunk_size=chunk,
            )
        else:
            self.spec = FullAttentionSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=KV_HEADS,
                head_size=HEAD_SIZE,
                dtype=torch.float32,
            )
        self.params: LayerParams = AttentionLayerParams(num_heads=HEADS)

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = h.shape[0]
        return (
            (h @ self.wq).view(t, HEADS, HEAD_SIZE),
            (h @ self.wk).view(t, KV_HEADS, HEAD_SIZE),
            (h @ self.wv).view(t, KV_HEADS, HEAD_SIZE),
        )

    def step(self, runtime: AttentionRuntime, name: str, h: torch.Tensor) -> torch.Tensor:
        return runtime.forward(name, *self._qkv(h)).reshape(h.shape[0], -1) @ self.wo

    def dense(self, h: torch.Tensor) -> torch.Tensor:
        out = attention_by_definition(*self._qkv(h), window=self.window, chunk=self.chunk)
        return out.float().reshape(h.shape[0], -1) @ self.wo


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class SoakModel:
    """Embeddings and five pre-norm residual mixers: full, Mamba2, sliding-window,
    chunked-local, full (four KV-cache groups; the two full layers share one)."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=gen)
        # DemoModel's Mamba2 mixer: its dense path is the token-by-token recurrence.
        mamba: Mixer = DemoModel(
            layout=("mamba",),
            hidden=HIDDEN,
            mamba_heads=2,
            d_state=4,
            conv_width=4,
            block_size=BLOCK_SIZE,
            seed=seed,
        ).layers["layers.0"]
        self.layers: dict[str, Mixer] = {
            "l0.full": Attention(gen),
            "l1.mamba": mamba,
            "l2.window": Attention(gen, window=WINDOW),
            "l3.chunked": Attention(gen, chunk=CHUNK),
            "l4.full": Attention(gen),
        }
        self.specs = {name: m.spec for name, m in self.layers.items()}
        self.params = {name: m.params for name, m in self.layers.items()}

    def forward_step(self, runtime: AttentionRuntime, tokens: torch.Tensor) -> torch.Tensor:
        """The step's tokens (in ``StepBatch.order``) through the runtime."""
        x = self.embed[tokens]
        for name, mixer in self.layers.items():
            x = x + mixer.step(runtime, name, rms_norm(x))
        return rms_norm(x)

    def forward_dense(self, tokens: torch.Tensor) -> torch.Tensor:
        """One whole sequence, recomputed without any cache (the reference)."""
        x = self.embed[tokens]
        for mixer in self.layers.values():
            x = x + mixer.dense(rms_norm(x))
        return rms_norm(x)


def make_runtime(model: SoakModel, seed: int) -> AttentionRuntime:
    registry = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    config = AttentionConfig.model_validate(
        {
            "backend": "reference",
            "max_model_len": MAX_MODEL_LEN,
            "max_num_batched_tokens": MAX_BATCHED_TOKENS,
            "max_num_reqs": MAX_NUM_REQS,
        },
        context={"registry": registry},
    )
    probe = AttentionRuntime(
        model.specs,
        config,
        device="cpu",
        memory_budget_bytes=2**20,
        layer_params=model.params,
        registry=registry,
    )
    per_block = probe.memory_report().total_bytes // probe.num_blocks
    runtime = AttentionRuntime(
        model.specs,
        config,
        device="cpu",
        memory_budget_bytes=NUM_BLOCKS * per_block,
        layer_params=model.params,
        registry=registry,
        cache_fill=float("nan"),  # a read of an unwritten slot poisons the outputs
    )
    assert runtime.num_blocks == NUM_BLOCKS
    # full, Mamba2, window, chunk: the state fills a page of three attention blocks.
    assert [g.blocks_per_page for g in runtime.groups] == [3, 1, 3, 3]
    assert {row.backend for row in runtime.routing_table()} == {"reference"}
    # Hand out physical blocks in a random order: nothing may rely on contiguity.
    random.Random(seed).shuffle(runtime.manager.pool._free)
    return runtime


# ------------------------------------------------------------------------- the engine


@dataclasses.dataclass
class Request:
    rid: str
    tokens: list[int]  # prompt, then the tokens "sampled" after it
    prompt_len: int
    target_len: int  # the request ends once this many tokens are in the cache
    computed: int = 0  # tokens in the cache: the test's own count
    computed_before_last_step: int = 0  # ``computed`` before its last scheduled step
    admitted: int = -1  # admission order while live (larger: younger)
    prefill_steps: int = 0
    outputs: list[torch.Tensor] = dataclasses.field(default_factory=list[torch.Tensor])

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.computed

    def restart(self) -> None:
        """Preempted: everything computed is dropped and recomputed later."""
        self.computed = self.computed_before_last_step = self.prefill_steps = 0
        self.admitted = -1
        self.outputs.clear()


Snapshot = tuple[
    list[int],
    dict[str, tuple[int, tuple[tuple[int, ...], ...]]],
    list[tuple[int, bytes, bytes] | None],
]


def snapshot(runtime: AttentionRuntime) -> Snapshot:
    """Everything a rejected call must leave alone: the free list of pages (order
    included), the live requests, their token counts and block tables in every group,
    and each slab's free kernel blocks (order included) and ref counts."""
    manager = runtime.manager
    tables = {
        rid: (
            manager.num_tokens(rid),
            tuple(tuple(manager.block_table(g.group_id, rid)) for g in runtime.groups),
        )
        for rid in manager.owned_blocks()
    }
    slabs = [
        None
        if slab is None
        else (slab.num_free_blocks, slab._stack[: slab._top].tobytes(), slab.refs.tobytes())
        for slab in manager.slabs
    ]
    return list(manager.pool._free), tables, slabs


def expected_table(spec: KVCacheSpec, req: Request) -> tuple[int, int]:
    """(length, released prefix) of ``req``'s table in a group with ``spec``, from the
    kind's rules applied to the test's own counts."""
    n, before = req.computed, req.computed_before_last_step
    if isinstance(spec, MambaSpec):
        return 1, 0  # one block holds the whole state
    length = math.ceil(n / spec.block_size)
    # Releases happen as a step begins: nothing before the step's first query can see.
    if isinstance(spec, SlidingWindowSpec):
        return length, max(before - spec.sliding_window + 1, 0) // spec.block_size
    if isinstance(spec, ChunkedLocalAttentionSpec):
        chunk = spec.attention_chunk_size
        return length, before // chunk * chunk // spec.block_size
    assert type(spec) is FullAttentionSpec, spec
    return length, 0


def blocks_held(runtime: AttentionRuntime, req: Request) -> int:
    """Blocks ``req`` holds over every group, by the test's own counts."""
    held = 0
    for group in runtime.groups:
        length, released = expected_table(group.spec, req)
        held += length - released
    return held


@dataclasses.dataclass(frozen=True)
class BadStep:
    """A step the runtime must refuse: the error type and a text the message must name."""

    what: str
    scheduled: list[ScheduledRequest]
    finished: list[str]
    error: type[Exception]
    names: str


class Soak:
    """The engine: its queue, its live requests and its own count of their tokens."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.model = SoakModel(seed)
        self.runtime = make_runtime(self.model, seed)
        self.live: dict[str, Request] = {}  # in the runtime (computed > 0)
        self.waiting: collections.deque[Request] = collections.deque()
        self.to_finish: list[Request] = []  # reached target_len: finish next step
        self.gone: list[str] = []  # ids freed once (unknown to the runtime now)
        self.next_id = 0
        self.admissions = 0
        self.stats: collections.Counter[str] = collections.Counter()
        self.max_error = 0.0
        self.last_order: set[str] = set()  # requests of the current step
        self.last_tokens = 0
        self.restarting: list[Request] = []
        self.last_step: list[tuple[Request, int]] = []  # as given to begin_step

    # ---------------------------------------------------------------- requests

    def arrive(self) -> None:
        for _ in range(self.rng.choice((0, 0, 0, 1, 1, 2))):
            prompt_len = self.rng.randint(1, MAX_MODEL_LEN - 8)
            target = min(MAX_MODEL_LEN, prompt_len + self.rng.randint(1, 12))
            tokens = [self.rng.randrange(VOCAB) for _ in range(prompt_len)]
            self.waiting.append(Request(f"r{self.next_id}", tokens, prompt_len, target))
            self.next_id += 1

    def end(self, req: Request, how: str) -> None:
        """``req`` left the runtime: check its outputs for its whole sequence."""
        self.stats[how] += 1
        self.gone.append(req.rid)
        if req.computed:
            self.check_numerics(req)

    def check_numerics(self, req: Request) -> None:
        got = torch.cat(req.outputs)
        assert got.shape[0] == req.computed
        dense = self.model.forward_dense(torch.tensor(req.tokens[: req.computed]))
        error = (got - dense).abs().max().item()
        assert math.isfinite(error), (req.rid, req.computed, error)
        assert error <= TOL, (req.rid, req.computed, error)
        self.max_error = max(self.max_error, error)
        self.stats["dense checks"] += 1

    # ---------------------------------------------------------------- one step

    def finish(self, req: Request, finished: list[str]) -> None:
        """Finish ``req`` through this step's ``finished=`` (its blocks serve the step)."""
        finished.append(req.rid)

    def aborts(self, finished: list[str]) -> None:
        """Abort a random live request (``finished=`` or ``free``), restart one (finished
        and scheduled anew in one step: recompute), or drop a waiting one."""
        if self.live and self.rng.random() < 0.04:
            req = self.rng.choice(list(self.live.values()))
            del self.live[req.rid]
            if self.rng.random() < 0.5:
                self.finish(req, finished)
            else:
                self.free([req.rid])
            self.end(req, "aborted")
        if self.live and self.rng.random() < 0.02:
            req = self.rng.choice(list(self.live.values()))
            del self.live[req.rid]
            self.finish(req, finished)
            req.restart()
            self.restarting.append(req)  # scheduled first, as new, in this step
        if self.waiting and self.rng.random() < 0.02:
            self.waiting.remove(self.rng.choice(self.waiting))
            self.stats["dropped while waiting"] += 1

    def replay(self, finished: list[str]) -> list[tuple[Request, int]]:
        """Sometimes: free one request of the last step and schedule the same ids in the
        same order again, that one anew (the runtime caches the rows of a repeated id
        list; a free in between must not leave them stale)."""
        last = self.last_step
        if finished or self.restarting or not last or self.rng.random() > 0.05:
            return []
        if any(self.live.get(r.rid) is not r or not r.pending for r, _ in last):
            return []
        victim = self.rng.choice(last)[0]
        self.free([victim.rid])
        del self.live[victim.rid]
        victim.restart()
        self.stats["same ids after a free"] += 1
        return [(r, min(n, r.pending)) for r, n in last]

    def schedule(self) -> list[tuple[Request, int]]:
        """Restarts first, then decodes, prefill chunks (oldest first) and new requests,
        under a random token budget <= MAX_BATCHED_TOKENS and MAX_NUM_REQS live requests."""
        left = self.rng.randint(1, MAX_BATCHED_TOKENS)
        picked: list[tuple[Request, int]] = []
        restarts = 0
        for req in self.restarting:  # live requests finished in this step: capacity is there
            take = min(req.pending, left)
            if take:
                picked.append((req, take))
                restarts += 1
                left -= take
            else:
                self.waiting.appendleft(req)
        self.restarting.clear()
        running = sorted(self.live.values(), key=lambda r: r.admitted)
        decodes = [r for r in running if r.computed >= r.prompt_len]
        prefills = [r for r in running if r.computed < r.prompt_len]
        for req in decodes + prefills:
            if left == 0:
                break
            if req.pending and self.rng.random() < 0.9:  # sometimes left out
                take = min(req.pending, left)
                picked.append((req, take))
                left -= take
        new: list[Request] = []
        for req in list(self.waiting):
            if left == 0 or len(self.live) + restarts + len(new) >= MAX_NUM_REQS:
                break
            take = min(req.pending, left)
            picked.append((req, take))
            new.append(req)
            left -= take
        for req in new:
            self.waiting.remove(req)
        if self.rng.random() < 0.3:
            self.rng.shuffle(picked)  # any order: the runtime decides the batch order
        return picked

    def bad_steps(self, scheduled: list[ScheduledRequest], finished: list[str]) -> list[BadStep]:
        """Variants of the step that each break exactly one rule (and fit otherwise)."""
        slack_tokens = MAX_BATCHED_TOKENS - sum(s.num_new_tokens for s in scheduled)
        slack_reqs = MAX_NUM_REQS - len(scheduled)
        ghost = f"ghost{self.rng.randrange(10**6)}"
        bad: list[BadStep] = []
        if scheduled and slack_tokens and slack_reqs:
            twice = self.rng.choice(scheduled)
            at = self.rng.randint(0, len(scheduled))
            dup = [*scheduled[:at], ScheduledRequest(twice.req_id, 1), *scheduled[at:]]
            bad.append(
                BadStep("scheduled twice", dup, finished, DuplicateRequestError, twice.req_id)
            )
        # An id freed earlier (finished, aborted) or one never seen.
        freed = [r for r in self.gone if r not in self.runtime.manager]
        unknown = self.rng.choice(freed) if freed and self.rng.random() < 0.5 else ghost
        names = [*finished, unknown]
        self.rng.shuffle(names)
        bad.append(BadStep("unknown finished", scheduled, names, UnknownRequestError, unknown))
        if finished:
            again = self.rng.choice(finished)
            names = [*finished, again]
            bad.append(BadStep("finished twice", scheduled, names, DuplicateRequestError, again))
        if slack_reqs:
            over = [*scheduled, ScheduledRequest(ghost, slack_tokens + 1)]
            bad.append(
                BadStep(
                    "over max_num_batched_tokens",
                    over,
                    finished,
                    EngineLimitError,
                    f"max_num_batched_tokens={MAX_BATCHED_TOKENS}",
                )
            )
        if slack_reqs + 1 <= slack_tokens:
            extra = [ScheduledRequest(f"{ghost}.{i}", 1) for i in range(slack_reqs + 1)]
            bad.append(
                BadStep(
                    "over max_num_reqs",
                    [*scheduled, *extra],
                    finished,
                    EngineLimitError,
                    f"max_num_reqs={MAX_NUM_REQS}",
                )
            )
        for s in scheduled:
            req = self.live.get(s.req_id)
            if req is None or s.req_id in finished:
                continue
            n = MAX_MODEL_LEN - req.computed + 1
            if n - s.num_new_tokens <= slack_tokens:
                long = [ScheduledRequest(x.req_id, n) if x is s else x for x in scheduled]
                bad.append(
                    BadStep(
                        "over max_model_len",
                        long,
                        finished,
                        EngineLimitError,
                        f"max_model_len={MAX_MODEL_LEN}",
                    )
                )
                break
        if slack_reqs and slack_tokens:
            # A new request too big for the cache.
            big = [*scheduled, ScheduledRequest(ghost, slack_tokens)]
            need, usable = self.fit(big)
            if need > usable:
                bad.append(
                    BadStep("out of blocks", big, finished, OutOfBlocksError, self.needs(need))
                )
        return bad

    def submit_bad(self, scheduled: list[ScheduledRequest], finished: list[str]) -> None:
        """Submit a rejected variant of the step first: the right error, nothing changed."""
        options = self.bad_steps(scheduled, finished)
        full = [b for b in options if b.error is OutOfBlocksError]  # only when the cache is full
        bad = self.rng.choice(full if full and self.rng.random() < 0.5 else options)
        before = snapshot(self.runtime)
        with pytest.raises(bad.error, match=re.escape(bad.names)):
            self.runtime.begin_step(bad.scheduled, finished=bad.finished)
        assert snapshot(self.runtime) == before, bad.what
        self.stats[f"rejected: {bad.what}"] += 1
        if bad.error is OutOfBlocksError:
            self.stats["out of blocks with finished="] += bool(bad.finished)

    def fit(
        self, scheduled: list[ScheduledRequest], also_finished: Request | None = None
    ) -> tuple[int, int]:
        """(new pages the step needs, pages it may use), from the test's own counts, the
        kinds' rules and the kernel blocks in the tables: after the step's releases and
        finished requests (``also_finished``: one more of them) gave their blocks back,
        a page is held by the group with a live kernel block in it; each group needs
        the fewest pages that hold its new kernel blocks beyond the free ones in the
        pages it holds. Finished or unknown ids start anew."""
        runtime = self.runtime
        need = [0] * len(runtime.groups)
        live: set[tuple[int, int]] = set()  # (group, kernel block) live after the step's releases
        steps = {s.req_id: s for s in scheduled}
        for group in runtime.groups:
            spec, gid = group.spec, group.group_id
            for rid, req in self.live.items():
                if also_finished is not None and rid == also_finished.rid:
                    continue  # its blocks go back
                have, before = expected_table(spec, req)
                first = before
                s = steps.get(rid)
                if s is not None:
                    computed = req.computed
                    if isinstance(spec, SlidingWindowSpec):
                        first = max(computed - spec.sliding_window + 1, 0) // spec.block_size
                    elif isinstance(spec, ChunkedLocalAttentionSpec):
                        chunk = spec.attention_chunk_size
                        first = computed // chunk * chunk // spec.block_size
                    first = max(min(first, have), before)
                table = runtime.block_table(group.layer_names[0], rid)
                live.update((gid, b) for b in table[first:have])
            for s in scheduled:
                if also_finished is not None and s.req_id == also_finished.rid:
                    req = None  # finished and scheduled: starts anew
                else:
                    req = self.live.get(s.req_id)
                computed = req.computed if req is not None else 0
                have = expected_table(spec, req)[0] if req is not None else 0
                if isinstance(spec, MambaSpec):
                    need[gid] += 1 - have
                else:
                    blocks = math.ceil((computed + s.num_new_tokens) / spec.block_size)
                    need[gid] += max(blocks - have, 0)
        per_page = [g.blocks_per_page for g in runtime.groups]
        held = [{b // per_page[gid] for g, b in live if g == gid} for gid in range(len(need))]
        pages = 0
        for gid, wanted in enumerate(need):
            free = len(held[gid]) * per_page[gid] - sum(1 for g, _ in live if g == gid)
            pages += -(-max(0, wanted - free) // per_page[gid])
        return pages, runtime.num_blocks - 1 - sum(map(len, held))

    def needs(self, pages: int) -> str:
        """What the runtime's ``OutOfBlocksError`` says a step needs: pages, or blocks
        when every group's kernel blocks are pages."""
        paged = any(g.blocks_per_page > 1 for g in self.runtime.groups)
        return f"needs {pages} new {'page' if paged else 'block'}"

    def refuse_finishing_more(self, scheduled: list[ScheduledRequest], finished: list[str]) -> None:
        """The step did not fit. Finishing one more live request (the one holding the
        fewest blocks that still leaves the step too big) must not help either: the step
        is refused and that request stays live, its blocks untouched."""
        for extra in sorted(self.live.values(), key=lambda r: blocks_held(self.runtime, r)):
            need, usable = self.fit(scheduled, also_finished=extra)
            if need > usable:
                break
        else:
            return
        before = snapshot(self.runtime)
        with pytest.raises(OutOfBlocksError, match=self.needs(need)):
            self.runtime.begin_step(scheduled, finished=[*finished, extra.rid])
        assert snapshot(self.runtime) == before
        self.stats["out of blocks with finished="] += 1

    def preempt(self, picked: list[tuple[Request, int]], finished: list[str]) -> None:
        """Free the youngest live request that is not finishing (back to the front of
        the queue, to be recomputed from scratch), else defer the step's last new one."""
        candidates = [r for r in self.live.values() if r.rid not in finished]
        if candidates:
            victim = max(candidates, key=lambda r: r.admitted)
            self.free([victim.rid])
            del self.live[victim.rid]
            victim.restart()
            self.stats["preempted"] += 1
        else:
            new = [r for r, _ in picked if r.rid not in self.live]
            assert new, "a step that cannot fit even alone"
            victim = new[-1]
            self.stats["deferred"] += 1
        self.waiting.appendleft(victim)
        picked[:] = [(r, n) for r, n in picked if r is not victim]

    def free(self, rids: list[str]) -> None:
        """``runtime.free``; freeing a request of the current step makes it stale."""
        self.runtime.free(rids)
        if set(rids) & self.last_order:
            self.last_order.clear()
            before = snapshot(self.runtime)
            probe = torch.zeros(self.last_tokens, HEADS, HEAD_SIZE)
            with pytest.raises(StaleStepError, match=r"freed after begin_step\(\)"):
                self.runtime.forward("l0.full", probe, probe[:, :KV_HEADS], probe[:, :KV_HEADS])
            assert snapshot(self.runtime) == before
            self.stats["stale step refused"] += 1

    def step(self, index: int) -> None:
        self.arrive()
        finished: list[str] = []
        for req in self.to_finish:
            del self.live[req.rid]
            if self.rng.random() < 0.7:
                self.finish(req, finished)
            else:
                self.free([req.rid])
        self.to_finish.clear()
        self.aborts(finished)
        self.rng.shuffle(finished)
        picked = self.replay(finished) or self.schedule()
        by_id = {r.rid: r for r, _ in picked}
        if self.rng.random() < 0.15:
            self.submit_bad([ScheduledRequest(r.rid, n) for r, n in picked], finished)
        while True:
            if not picked:  # a step that only finishes requests
                batch = self.runtime.begin_step([], finished=finished)
                assert batch.order == ()
                assert batch.num_tokens == 0
                self.last_order, self.last_tokens, self.last_step = set(), 0, []
                self.stats["idle steps"] += 1
                self.check_invariants()
                return
            scheduled = [ScheduledRequest(r.rid, n) for r, n in picked]
            # The test predicts whether the step fits; the runtime must agree.
            need, usable = self.fit(scheduled)
            if need <= usable:
                batch = self.runtime.begin_step(scheduled, finished=finished)
                break
            before = snapshot(self.runtime)
            with pytest.raises(OutOfBlocksError, match=self.needs(need)):
                self.runtime.begin_step(scheduled, finished=finished)
            assert snapshot(self.runtime) == before
            self.stats["out of blocks"] += 1
            self.stats["out of blocks with finished="] += bool(finished)
            self.refuse_finishing_more(scheduled, finished)
            self.preempt(picked, finished)
        given = {s.req_id: s.num_new_tokens for s in scheduled}
        assert sorted(batch.order) == sorted(given)
        assert batch.query_lens == tuple(given[rid] for rid in batch.order)
        assert batch.num_tokens == sum(given.values())
        if batch.order and set(batch.order) == self.last_order:
            self.stats["same requests as the last step"] += 1
        self.stats["restarted in one step"] += len(set(finished) & set(batch.order))
        self.last_order = set(batch.order)
        self.last_tokens = batch.num_tokens
        self.last_step = [(by_id[s.req_id], s.num_new_tokens) for s in scheduled]
        tokens: list[int] = []
        for rid, n in zip(batch.order, batch.query_lens, strict=True):
            req = by_id[rid]
            if req.rid not in self.live:
                req.admitted = self.admissions
                self.admissions += 1
                self.live[rid] = req
            tokens.extend(req.tokens[req.computed : req.computed + n])
            req.computed_before_last_step = req.computed
            req.computed += n
            if req.computed <= req.prompt_len:
                req.prefill_steps += 1
                if req.computed == req.prompt_len and req.prefill_steps > 1:
                    self.stats["chunked prefills"] += 1
        if batch.num_tokens:
            hidden = self.model.forward_step(self.runtime, torch.tensor(tokens))
            for rid, rows in batch.token_slices().items():
                by_id[rid].outputs.append(hidden[rows])
        self.check_invariants()
        for rid in batch.order:
            req = by_id[rid]
            if req.pending:
                continue
            if req.computed >= req.target_len:
                self.to_finish.append(req)
                self.end(req, "completed")
            else:  # "sample" the next token
                req.tokens.append(self.rng.randrange(VOCAB))
        if index % CHECK_EVERY == 0 and batch.order:
            self.check_numerics(by_id[self.rng.choice(batch.order)])

    # ---------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        runtime, manager = self.runtime, self.runtime.manager
        owned = manager.owned_blocks()
        assert set(owned) == set(self.live)
        assert len(manager) == len(self.live)
        held: collections.Counter[tuple[int, int]] = collections.Counter()
        for group in runtime.groups:
            layer = group.layer_names[0]
            for rid, req in self.live.items():
                assert manager.num_tokens(rid) == req.computed, rid
                table = runtime.block_table(layer, rid)
                length, released = expected_table(group.spec, req)
                assert len(table) == length, (rid, group.spec, table, req.computed)
                assert table[:released] == [NULL_BLOCK] * released, (rid, group.spec, table)
                assert NULL_BLOCK not in table[released:], (rid, group.spec, table)
                held.update((group.group_id, b) for b in table[released:])
                if released:
                    self.stats[f"released: {group.kind.value}"] += 1
        twice = sorted(b for b, count in held.items() if count > 1)
        assert not twice, f"kernel blocks owned twice: {twice}"
        assert set(held) == set().union(*owned.values())
        # Pages: a page with a live kernel block belongs to that block's group only.
        page_owner: dict[int, int] = {}
        for gid, block in held:
            page = block // runtime.groups[gid].blocks_per_page
            assert page != NULL_BLOCK, f"kernel block {block} of group {gid} is in the null page"
            assert page_owner.setdefault(page, gid) == gid, f"page {page} in two groups"
        free = manager.pool._free
        assert len(set(free)) == len(free), "a page is free twice"
        assert NULL_BLOCK not in free
        assert not set(free) & set(page_owner), "a page is both free and holds a live block"
        assert manager.pool.num_free_blocks + len(page_owner) == runtime.num_blocks - 1, "leak"

    def finish_all(self) -> None:
        """Free every live request; all blocks must be back."""
        live = list(self.live.values())
        self.runtime.begin_step([], finished=[r.rid for r in live])
        for req in live:
            if req not in self.to_finish:  # completed ones were checked already
                self.end(req, "aborted")
        self.live.clear()
        self.to_finish.clear()
        assert len(self.runtime.manager) == 0
        assert self.runtime.manager.owned_blocks() == {}
        assert self.runtime.manager.pool.num_free_blocks == self.runtime.num_blocks - 1


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
def test_soak(seed: int) -> None:
    steps = soak_steps()
    soak = Soak(seed)
    for index in range(steps):
        soak.step(index)
    soak.finish_all()
    stats = soak.stats
    print(
        f"\nseed {seed}: {steps} steps, max |err| {soak.max_error:.2e}, {dict(sorted(stats.items()))}"
    )
    if steps < DEFAULT_STEPS:
        return
    # The run exercised what it is for (each of these happens in 200 steps of every seed).
    for what in (
        "completed",
        "aborted",
        "preempted",
        "chunked prefills",
        "dense checks",
        "released: sliding_window",
        "released: chunked_local_attention",
        "rejected: scheduled twice",
        "rejected: unknown finished",
        "rejected: out of blocks",
        "out of blocks with finished=",
        "restarted in one step",
        "same ids after a free",
        "same requests as the last step",
    ):
        assert stats[what] > 0, (what, dict(stats))


def test_an_empty_step_with_state_layers() -> None:
    """A step that only finishes requests (nothing scheduled) is a normal engine step."""
    model = SoakModel(0)
    runtime = make_runtime(model, 0)
    runtime.begin_step([ScheduledRequest("a", 3)])
    model.forward_step(runtime, torch.tensor([1, 2, 3]))
    batch = runtime.begin_step([], finished=["a"])
    assert batch.order == ()
    assert batch.num_tokens == 0
    assert "a" not in runtime.manager
    assert runtime.manager.pool.num_free_blocks == runtime.num_blocks - 1


# ---------------------------------------------------------------------------- prefixes

PREFIX_LAYOUT = ("full", "window", "chunked", "full")


def check_prefix_cache(runtime: AttentionRuntime) -> None:
    """With prefix caching on: every cached group's ref counts are exactly the table
    entries that hold each kernel block (a block two requests hold is shared through
    its name), no page is in two groups or both free and owned, nothing leaks."""
    manager = runtime.manager
    page_owner: dict[int, int] = {}
    for gid, (tables, slab) in enumerate(zip(manager._tables, manager.cached_slabs, strict=True)):
        assert slab is not None, f"group {gid} caches nothing"
        holders: collections.Counter[int] = collections.Counter()
        for row in manager._rows.values():
            used = tables.table[row, tables.first_live[row] : tables.num_blocks[row]]
            holders.update(int(b) for b in used.tolist() if b != NULL_BLOCK)
        refs = {int(b): int(slab.refs[b]) for b in slab.refs.nonzero()[0].tolist()}
        assert refs == dict(holders), f"group {gid}: ref counts are not the tables' holders"
        for block, count in holders.items():
            assert count == 1 or bool(slab.named[block]), f"block {block} shared without a name"
        assert not slab.named[NULL_BLOCK], "the null block holds a name"
        bpp = runtime.groups[gid].blocks_per_page
        for page in slab.owned.nonzero()[0].tolist():
            assert page != NULL_BLOCK, f"group {gid} owns the null page"
            assert page_owner.setdefault(page, gid) == gid, f"page {page} in two groups"
        for block in holders:
            assert slab.owned[block // bpp], f"block {block} held in a page its group lacks"
    free = manager.pool._free
    assert len(set(free)) == len(free), "a page is free twice"
    assert not set(free) & set(page_owner), "a page is both free and owned"
    assert len(free) + len(page_owner) == runtime.num_blocks - 1, "leak"


def prefix_engine(
    model: DemoModel, *, on: bool, pages: int | None, kv_connector: KVConnector | None = None
) -> tuple[Engine, AttentionRuntime]:
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    config = AttentionConfig.model_validate(
        {
            "backend": "reference",
            "max_num_batched_tokens": 48,
            "max_model_len": 256,
            "prefix_caching": {"enabled": on},
        },
        context={"registry": reg},
    )

    def build(budget: int) -> AttentionRuntime:
        return AttentionRuntime(
            model.specs,
            config,
            device="cpu",
            memory_budget_bytes=budget,
            layer_params=model.params,
            registry=reg,
            cache_fill=float("nan"),
            kv_connector=kv_connector,
        )

    runtime = build(2**22)
    if pages is not None:
        runtime = build(pages * (runtime.memory_report().total_bytes // runtime.num_blocks))
    random.Random(pages).shuffle(runtime.manager.pool._free)

    def call(batch: StepBatch, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model.logits(model.forward_step(runtime, token_ids, positions=positions))

    return Engine(FunctionModel(runtime, call), max_tokens_per_step=48), runtime


@pytest.mark.parametrize(
    ("seed", "offload"),
    [(SEEDS[0], False), (SEEDS[1], False), (SEEDS[0], True)],
    ids=[f"seed{SEEDS[0]}", f"seed{SEEDS[1]}", f"seed{SEEDS[0]}-offload"],
)
def test_soak_engine_with_shared_prefixes(seed: int, offload: bool) -> None:
    """Requests built from a few shared prefixes (and repeats, and second turns of
    finished ones) through ``Engine`` with prefix caching on, on a pool small enough to
    evict and preempt: the cache is checked after every step, the tokens equal those
    of the same requests with caching off on a roomy pool, and every block comes back.
    With ``offload``, evicted blocks go to a connector that completes late and fails
    every third load (docs/offload.md): hits load them back, a failed one recomputes."""
    rng = random.Random(seed)
    model = DemoModel(layout=PREFIX_LAYOUT, block_size=16, window=10, chunk=16, num_kv_heads=1)
    prefixes = [[rng.randrange(64) for _ in range(rng.randrange(16, 70))] for _ in range(3)]
    requests: list[EngineRequest] = []
    for i in range(30):
        prompt = [*rng.choice(prefixes), *(rng.randrange(64) for _ in range(rng.randrange(1, 20)))]
        if requests and rng.random() < 0.2:
            prompt = list(rng.choice(requests).prompt)  # a repeat: everything but one token hits
        sampling = SamplingParams(max_new_tokens=rng.randrange(1, 8))
        requests.append(
            EngineRequest(f"r{i}", tuple(prompt), sampling, arrival_step=rng.randrange(0, 60))
        )
    connector = FaultyTier(fail_every=3) if offload else None
    engine, runtime = prefix_engine(model, on=True, pages=24, kv_connector=connector)
    for request in requests:
        engine.submit(request)
    steps = preempted = 0
    while engine.has_unfinished():
        preempted += len(engine.step().preempted)
        check_prefix_cache(runtime)
        steps += 1
        assert steps < 2000
    reference, _ = prefix_engine(model, on=False, pages=None)
    expected = reference.run(requests).outputs
    got = {rid: live.tokens[len(live.request.prompt) :] for rid, live in engine._done.items()}
    assert got == dict(expected)
    stats = engine.prefix_stats()
    cache = runtime.prefix_cache_stats()
    print(
        f"\nseed {seed}: {steps} steps, {stats.cached_tokens}/{stats.prompt_tokens} tokens "
        f"from the cache, {cache.evictions} evictions, {preempted} preemptions"
    )
    assert stats.cached_tokens > 0, stats
    assert cache.evictions > 0, cache  # the pool was small enough to evict
    assert preempted > 0
    if offload:
        assert cache.offloaded > 0, cache
        assert cache.offload_loads > 0, cache
    assert not runtime.manager._rows
    assert all(s is None or int(s.refs.sum()) == 0 for s in runtime.manager.cached_slabs)


@pytest.mark.parametrize("broken", ["forgotten ref", "shared unnamed", "leaked page"])
def test_the_prefix_cache_check_catches_broken_caches(broken: str) -> None:
    """Broken variants: a ref count short of the tables, a block two requests hold
    without a name, a page neither free nor owned."""
    model = DemoModel(layout=("full",), block_size=16, num_kv_heads=1)
    engine, runtime = prefix_engine(model, on=True, pages=None)
    engine.add_request("a", list(range(40)), SamplingParams(max_new_tokens=8))
    engine.add_request("b", list(range(40)), SamplingParams(max_new_tokens=8), arrival_step=1)
    engine.step()
    engine.step()
    check_prefix_cache(runtime)  # intact: b shares a's two full blocks
    slab = runtime.manager.cached_slabs[0]
    assert slab is not None
    shared = int((slab.refs == 2).nonzero()[0][0])
    if broken == "forgotten ref":  # one block per page: the holders beyond the first
        assert slab.blocks_per_page == 1
        slab.extra[shared] -= 1
    elif broken == "shared unnamed":
        slab.named[shared] = False
    else:
        runtime.manager.pool._free.pop()
    with pytest.raises(AssertionError):
        check_prefix_cache(runtime)
