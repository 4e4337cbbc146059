"""Hypothesis strategies for conformance cases: layer choices, schedules, cases.

A **case** is one layer (its spec kind and the declared capability under test: head
size, block size, dtype, cache dtype, features, state type), a GQA ratio, a window /
chunk / sink length near the block boundaries, and a **schedule**: steps of
``(request, new tokens)`` with the requests finished before each step. Schedules mix
new requests, chunked prefills continuing over several steps, decodes, idle and
finished requests, in a random batch order; tensors come from the case's seed.

Strategies are built for ``hypothesis.find``, so a failing case shrinks to the
smallest one (fewest steps, requests and tokens; decodes before chunks)::

    from attnkit.testing.strategies import LayerChoice, cases
    case = cases(LayerChoice(kind=KVCacheSpecKind.FULL_ATTENTION, head_size=16,
                             block_size=16, dtype=torch.float32)).example()

Needs ``hypothesis`` (``pip install 'attnkit[testing]'``); ``import attnkit`` does not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import strategies as st

from .._validation import dtype_name
from ..capabilities import AttentionFeature
from ..errors import InvalidArgumentError
from ..kinds import boundary_lengths, rules_for_kind
from ..spec import KVCacheDType, KVCacheSpecKind, MambaType

__all__ = [
    "Case",
    "LayerChoice",
    "Step",
    "boundary_lengths",
    "cases",
    "long_context_case",
    "ragged_case",
    "schedules",
]

LONG_CONTEXT = 3000
"""Tokens of context the long-context case's requests reach (``long_context_case``)."""


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """One declared capability choice: the layer a case runs.

    Attributes:
        kind: the spec kind.
        head_size, block_size, dtype, kv_cache_dtype: the attention spec's fields
            (state layers use ``block_size`` only; their states are float32).
        features: the optional features the layer parameters ask for.
        mamba_type: the state type (``kind`` mamba only).
        scale: the layer's softmax scale (``AttentionLayerParams.scale``); ``None``:
            the default, ``head_size ** -0.5``.
    """

    kind: KVCacheSpecKind
    head_size: int = 16
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    kv_cache_dtype: KVCacheDType = "auto"
    features: frozenset[AttentionFeature] = frozenset()
    mamba_type: MambaType | None = None
    scale: float | None = None

    def describe(self) -> str:
        if self.kind is KVCacheSpecKind.MAMBA:
            return f"mamba_type={self.mamba_type} block_size={self.block_size}"
        parts = [
            self.kind.value,
            f"head_size={self.head_size}",
            f"block_size={self.block_size}",
            f"dtype={dtype_name(self.dtype)}",
            f"kv_cache_dtype={self.kv_cache_dtype}",
        ]
        parts += [f"feature={f.value}" for f in sorted(self.features, key=lambda f: f.value)]
        if self.scale is not None:
            parts.append(f"scale={self.scale:g}")
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Step:
    """One scheduling step.

    Attributes:
        scheduled: ``(request id, new tokens, encoder tokens)`` in the engine's order
            (encoder tokens: cross-attention requests in their first step, else 0).
        finished: requests freed before the step.
        written: the kit writes the step's keys and values into both caches itself
            and runs no layer (how the long-context case builds its context cheaply;
            needs the kind's default cache shapes).
    """

    scheduled: tuple[tuple[str, int, int], ...]
    finished: tuple[str, ...] = ()
    written: bool = False

    def describe(self) -> str:
        reqs = ", ".join(
            f"{rid}+{n}" + (f" (encoder {enc})" if enc else "") for rid, n, enc in self.scheduled
        )
        done = f"; finished {', '.join(self.finished)}" if self.finished else ""
        written = " written by the kit" if self.written else ""
        return f"[{reqs}{done}]{written}"


@dataclasses.dataclass(frozen=True)
class Case:
    """A layer, its shape parameters, a schedule and a seed for every tensor.

    Attributes:
        choice: the declared capability under test.
        num_kv_heads: key/value heads (1 for MLA; the state layers' head count).
        gqa: query heads per KV head (``num_heads = num_kv_heads * gqa``).
        window: the sliding window, chunk size or sink length of kinds that have one
            (``KindRules.extent``).
        steps: the schedule.
        seed: seeds the tensors and the shuffle of the block pool.
        layers: layers of the kind, one KV-cache group: each layer reads the step's
            metadata after the one before it has run (the ragged case has two).
    """

    choice: LayerChoice
    num_kv_heads: int
    gqa: int
    window: int | None
    steps: tuple[Step, ...]
    seed: int
    layers: int = 1

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.gqa

    def describe(self) -> str:
        """One line: what to rerun by hand."""
        window = rules_for_kind(self.choice.kind).extent_field
        shape = f"num_kv_heads={self.num_kv_heads} num_heads={self.num_heads}"
        if window is not None:
            shape += f" {window}={self.window}"
        if self.layers != 1:
            shape += f" layers={self.layers}"
        steps = " ".join(s.describe() for s in self.steps)
        return f"{self.choice.describe()} {shape} seed={self.seed} steps: {steps}"


def schedules(
    kind: KVCacheSpecKind,
    *,
    max_requests: int = 3,
    max_steps: int = 3,
    max_len: int = 24,
    max_chunk: int = 12,
    max_encoder_len: int = 12,
) -> st.SearchStrategy[tuple[Step, ...]]:
    """Schedules of 1 to ``max_steps`` steps over up to ``max_requests`` live requests.

    Each step, a live request decodes one token, continues its prompt by a chunk,
    idles or finishes (finished requests are named in the next step's ``finished``);
    new requests start with a chunk of their prompt; the batch order is shuffled. No
    request exceeds ``max_len`` tokens. Encoder-only requests come whole and finish
    after their step; new cross-attention requests bring 1 to ``max_encoder_len``
    encoder tokens.
    """
    rules = rules_for_kind(kind)
    whole = not rules.has_cache  # requests come whole, and finish after their step
    encoder = rules.writes == "encoder"  # new requests bring encoder tokens

    @st.composite
    def build(draw: Callable[[st.SearchStrategy[Any]], Any]) -> tuple[Step, ...]:
        live: dict[str, int] = {}
        next_id = 0
        steps: list[Step] = []
        for _ in range(draw(st.integers(1, max_steps))):
            finished: list[str] = []
            scheduled: list[tuple[str, int, int]] = []
            idle: list[str] = []
            for rid in list(live):
                room = max_len - live[rid]
                action = (
                    "finish"
                    if whole or room <= 0
                    else draw(st.sampled_from(("decode", "chunk", "idle", "finish")))
                )
                if action == "finish":
                    finished.append(rid)
                    del live[rid]
                elif action == "idle":
                    idle.append(rid)
                else:
                    n = 1 if action == "decode" else draw(st.integers(1, min(max_chunk, room)))
                    scheduled.append((rid, n, 0))
                    live[rid] += n
            room_for_new = max_requests - len(live)
            if not scheduled and not room_for_new:
                # Everyone idles and no request can start: the first idle one decodes.
                rid = idle[0]
                scheduled.append((rid, 1, 0))
                live[rid] += 1
            low = 0 if scheduled else 1
            for _ in range(draw(st.integers(low, max(low, room_for_new)))):
                rid = f"r{next_id}"
                next_id += 1
                limit = max_len if whole else min(max_chunk, max_len)
                n = draw(st.integers(1, limit))
                enc = draw(st.integers(1, max_encoder_len)) if encoder else 0
                scheduled.append((rid, n, enc))
                live[rid] = n
            order: list[tuple[str, int, int]] = draw(st.permutations(scheduled))
            steps.append(Step(tuple(order), tuple(finished)))
        return tuple(steps)

    strategy: st.SearchStrategy[tuple[Step, ...]] = build()
    return strategy


def cases(
    choice: LayerChoice,
    *,
    max_requests: int = 3,
    max_steps: int = 3,
    max_len: int | None = None,
    max_chunk: int | None = None,
) -> st.SearchStrategy[Case]:
    """Cases of ``choice``: GQA ratio, window near the block edges, schedule, seed.

    Request lengths default to just over two blocks (20 to 80 tokens), so a request
    crosses block boundaries; chunks to a bit over one block (9 to 40 tokens).
    """
    bs = choice.block_size
    length = max_len if max_len is not None else min(max(20, 2 * bs + 3), 80)
    chunk = max_chunk if max_chunk is not None else min(max(9, bs + 2), 40)
    kind = choice.kind
    rules = rules_for_kind(kind)
    if kind is KVCacheSpecKind.MAMBA:
        heads: st.SearchStrategy[int] = st.just(2)
        gqa: st.SearchStrategy[int] = st.just(1)
    elif rules.latent:
        heads, gqa = st.just(1), st.sampled_from((1, 2, 4))
    else:
        heads, gqa = st.sampled_from((1, 2)), st.sampled_from((1, 2, 3))
    extents = rules.example_extents(bs)
    window: st.SearchStrategy[int | None] = st.sampled_from(extents) if extents else st.none()
    return st.builds(
        Case,
        choice=st.just(choice),
        num_kv_heads=heads,
        gqa=gqa,
        window=window,
        steps=schedules(
            kind, max_requests=max_requests, max_steps=max_steps, max_len=length, max_chunk=chunk
        ),
        seed=st.integers(0, 2**16),
    )


def ragged_case(choice: LayerChoice, *, seed: int = 0) -> Case:
    """A fixed case that exercises every path in four steps: a prefill crossing a
    block edge, continued as a chunk (past the second block edge for a kind with a
    window or chunk, which then starts past the first block), left idle a step and
    then decoded; a short
    prefill that decodes and finishes; requests joining later, one of them scheduled
    before a decode (a backend without ``reorder_batch_threshold`` gets the batch in
    this order); 2 KV heads with 2 query heads each, the window or chunk one past a
    block; two layers in the group. The kit runs it before the generated cases (the
    first cases hypothesis generates are its simplest ones)."""
    bs = choice.block_size
    kind = choice.kind
    rules = rules_for_kind(kind)
    steps: tuple[Step, ...]
    if not rules.has_cache:
        steps = (
            Step((("r0", bs + 3, 0), ("r1", 5, 0))),
            Step((("r2", 2, 0), ("r3", bs + 1, 0)), finished=("r0", "r1")),
            Step((("r4", 1, 0),), finished=("r2", "r3")),
        )
    else:
        enc = rules.writes == "encoder"
        # With a window or chunk, r0 passes 2 blocks: its window starts past a block.
        chunk = max(4, bs - 1) if rules.extent in ("window", "chunk") else 4
        steps = (
            Step((("r0", bs + 3, bs + 2 if enc else 0), ("r1", 5, 3 if enc else 0))),
            Step((("r1", 1, 0), ("r0", chunk, 0), ("r2", 2, 1 if enc else 0))),
            # A prefill before a decode.
            Step((("r3", 3, 2 if enc else 0), ("r2", 1, 0)), finished=("r1",)),
            Step((("r3", 1, 0), ("r0", 1, 0))),
        )
    state = kind is KVCacheSpecKind.MAMBA
    return Case(
        choice=choice,
        num_kv_heads=1 if rules.latent else 2,
        gqa=1 if state else 2,
        window=bs + 1 if rules.extent is not None else None,
        steps=steps,
        seed=seed,
        layers=2,
    )


def long_context_case(choice: LayerChoice, *, context: int = LONG_CONTEXT, seed: int = 0) -> Case:
    """Two requests with ``context`` and ``context - 600`` tokens of context (written by
    the kit, ``Step.written``), then a decode and a chunk of 16 tokens over them, then
    two decodes: long enough that a kernel accumulating in 16 bits, or overflowing,
    leaves the tolerance. A kind with a window or chunk gets
    one longer than the context (the case is about the length, not the mask); kinds
    without a cache of the step's tokens, or with sink tokens, have none (``InvalidArgumentError``)."""
    rules = rules_for_kind(choice.kind)
    if not rules.has_cache or rules.writes != "step" or rules.extent == "sink_len":
        raise InvalidArgumentError(
            f"long_context_case: kind {choice.kind.value} has no context the kit can write "
            f"itself (it needs a cache of the step's own tokens, and no sink tokens)"
        )
    steps = (
        Step((("r0", context, 0), ("r1", context - 600, 0)), written=True),
        Step((("r0", 1, 0), ("r1", 16, 0))),
        Step((("r1", 1, 0), ("r0", 1, 0))),
    )
    return Case(
        choice=choice,
        num_kv_heads=1,
        gqa=2,
        window=2 * context if rules.extent is not None else None,
        steps=steps,
        seed=seed,
    )
