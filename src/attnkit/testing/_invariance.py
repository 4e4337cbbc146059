"""The bitwise invariance check: does a backend keep its declared ``Determinism`` level?

One target request (a prompt, then decodes) is run through ``AttentionRuntime`` with
the backend, under the level, in several schedules; its output rows must be
``torch.equal`` to those of the first schedule, the request alone:

- ``run_to_run``: alone, again;
- ``batch_invariant``: with random co-batched requests (prefills, chunks and decodes
  of random lengths) in a random order, its own schedule unchanged;
- ``prefill_decode``: its decode rows against the rows of one prefill of the whole
  sequence;
- ``chunking_invariant``: its prompt cut into random chunks (a 1-token chunk, chunks
  off block boundaries) over several steps;
- ``prefix_hit_invariant``: after another request with the same prompt filled the
  prefix cache, the target starting from the hit.

Inputs are drawn once per sequence position, so a token's query, key and value are the
same bits in every schedule. Levels above the declared one are not run (skipped, with
the reason); a level above what the backend declares for the kind is refused by
selection, so the check runs each kind at its own declared level unless told less.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections.abc import Iterable, Sequence

import torch

from ..backend import AttentionBackend
from ..capabilities import Determinism, size_allowed
from ..config import AttentionConfig
from ..devices import parse_device
from ..errors import InvalidArgumentError
from ..kinds import rules_for_kind
from ..params import AttentionLayerParams
from ..registry import BUILTIN_BACKENDS, BackendRegistry
from ..runtime import AttentionRuntime, PrefixMatch, ScheduledRequest
from ..spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpecKind,
    SlidingWindowSpec,
)
from ._report import CapabilityResult, ConformanceReport

__all__ = ["INVARIANCE_KINDS", "check_invariance"]

INVARIANCE_KINDS = (
    KVCacheSpecKind.FULL_ATTENTION,
    KVCacheSpecKind.SLIDING_WINDOW,
    KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION,
)
"""The kinds the check builds layers of (causal K/V attention with a cache)."""

_LAYER = "layers.0"
_WINDOW = 24  # off block boundaries on purpose
_CHUNK = 32
_PROMPT = (37, 61)  # the target's prompt length range: several blocks, a partial one
_DECODES = 5
_OTHERS = (2, 6)
_HEAD_SIZES = (64, 32, 128, 16, 80, 96, 256)
_BLOCK_SIZES = (16, 32, 64, 128)

Rows = dict[int, torch.Tensor]
"""Sequence position -> the request's output row there ``[Hq, D]``."""


@dataclasses.dataclass(frozen=True)
class _Seq:
    tokens: list[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def _spec_for(
    backend: type[AttentionBackend], kind: KVCacheSpecKind, dtype: torch.dtype
) -> AttentionSpec | str:
    heads = [h for h in _HEAD_SIZES if backend.supported_head_sizes is None
             or size_allowed(h, backend.supported_head_sizes)]
    blocks = [b for b in _BLOCK_SIZES if backend.supported_block_sizes is None
              or size_allowed(b, backend.supported_block_sizes)]
    if not heads or not blocks:
        return f"no head size of {_HEAD_SIZES} or block size of {_BLOCK_SIZES} is declared"
    block, head = blocks[0], heads[0]
    if kind is KVCacheSpecKind.FULL_ATTENTION:
        return FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=head, dtype=dtype)
    if kind is KVCacheSpecKind.SLIDING_WINDOW:
        return SlidingWindowSpec(
            block_size=block, num_kv_heads=2, head_size=head, dtype=dtype, sliding_window=_WINDOW
        )
    return ChunkedLocalAttentionSpec(
        block_size=block, num_kv_heads=2, head_size=head, dtype=dtype, attention_chunk_size=_CHUNK
    )


class _Runner:
    """Runs schedules of one layer through fresh runtimes of one backend at one level."""

    def __init__(
        self,
        name: str,
        spec: AttentionSpec,
        level: Determinism,
        registry: BackendRegistry,
        device: torch.device,
    ) -> None:
        self.name, self.spec, self.level = name, spec, level
        self.registry, self.device = registry, device
        self.params = AttentionLayerParams(num_heads=4)

    def runtime(self, *, prefix: bool = False) -> AttentionRuntime:
        config = AttentionConfig(
            backend=self.name,
            determinism=self.level,
            prefix_caching={"enabled": prefix},
            max_num_reqs=16,
            max_num_batched_tokens=1024,
            max_model_len=256,
        )
        pages = 16 * 256 // self.spec.block_size + 8
        return AttentionRuntime(
            {_LAYER: self.spec},
            config,
            device=self.device,
            memory_budget_bytes=self.spec.page_size_bytes * pages,
            layer_params={_LAYER: self.params},
            registry=self.registry,
            cache_fill=float("nan"),
        )

    def sequence(self, gen: torch.Generator, length: int, tokens: list[int]) -> _Seq:
        spec = self.spec

        def t(heads: int) -> torch.Tensor:
            x = torch.randn(length, heads, spec.head_size, generator=gen)
            return x.to(device=self.device, dtype=spec.dtype)

        return _Seq(tokens, t(self.params.num_heads), t(spec.num_kv_heads), t(spec.num_kv_heads))

    def run(
        self,
        runtime: AttentionRuntime,
        seqs: dict[str, _Seq],
        steps: Sequence[Sequence[tuple[str, int]]],
        *,
        done: dict[str, int] | None = None,
        prefixes: dict[str, PrefixMatch] | None = None,
    ) -> dict[str, Rows]:
        """Each request's rows by position; ``steps`` lists ``(request, new tokens)``
        in the order given to ``begin_step``."""
        done = dict(done or {})
        prefixes = dict(prefixes or {})
        rows: dict[str, Rows] = {rid: {} for rid in seqs}
        for step in steps:
            scheduled = [
                ScheduledRequest(rid, n, prefix=prefixes.pop(rid, None))
                for rid, n in step
            ]
            batch = runtime.begin_step(scheduled)
            starts = {rid: done.get(rid, 0) for rid, _ in step}
            sizes = dict(step)
            order = batch.order
            q = torch.cat([seqs[r].q[starts[r] : starts[r] + sizes[r]] for r in order])
            k = torch.cat([seqs[r].k[starts[r] : starts[r] + sizes[r]] for r in order])
            v = torch.cat([seqs[r].v[starts[r] : starts[r] + sizes[r]] for r in order])
            out = runtime.forward(_LAYER, q, k, v)
            for rid, where in batch.token_slices().items():
                got = out[where].cpu()
                for i in range(got.shape[0]):
                    rows[rid][starts[rid] + i] = got[i].clone()
            for rid, n in step:
                done[rid] = done.get(rid, 0) + n
        return rows


def _first_difference(got: Rows, want: Rows, positions: Iterable[int]) -> str | None:
    for pos in positions:
        if pos not in got:
            return f"no row at position {pos}"
        a, b = got[pos], want[pos]
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().nan_to_num(float("inf"))
            count = int((a != b).sum())
            return (
                f"position {pos}: {count} of {a.numel()} values differ (max abs difference "
                f"{diff.max().item():.3g})"
            )
    return None


def _alone_steps(prompt: int, decodes: int) -> list[list[tuple[str, int]]]:
    return [[("x", prompt)], *([("x", 1)] for _ in range(decodes))]


class _Scenarios:
    """The schedules of one kind, all compared with the request alone."""

    def __init__(self, runner: _Runner, seed: int) -> None:
        self.runner = runner
        self.rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.prompt = self.rng.randint(*_PROMPT)
        self.total = self.prompt + _DECODES
        tokens = [self.rng.randrange(1, 50_000) for _ in range(self.total)]
        self.gen = gen
        self.target = runner.sequence(gen, self.total, tokens)
        self.alone = self._alone()

    def _alone(self) -> Rows:
        r = self.runner
        return r.run(r.runtime(), {"x": self.target}, _alone_steps(self.prompt, _DECODES))["x"]

    def run_to_run(self) -> str | None:
        return _first_difference(self._alone(), self.alone, range(self.total))

    def batched(self) -> str | None:
        rng, r = self.rng, self.runner
        others = {
            f"o{i}": r.sequence(self.gen, rng.randint(3, 90), [])
            for i in range(rng.randint(*_OTHERS))
        }
        left = {rid: len(s.q) for rid, s in others.items()}
        # A first step of the others alone: some of them decode next to the target.
        first: list[tuple[str, int]] = []
        for rid in others:
            n = min(left[rid], rng.choice((1, 7, rng.randint(1, left[rid]))))
            first.append((rid, n))
            left[rid] -= n
        steps: list[list[tuple[str, int]]] = [first]
        for own in _alone_steps(self.prompt, _DECODES):
            step = list(own)
            for rid in others:
                if left[rid] and rng.random() < 0.8:
                    n = min(left[rid], rng.choice((1, 1, 3, rng.randint(1, left[rid]))))
                    step.append((rid, n))
                    left[rid] -= n
            rng.shuffle(step)
            steps.append(step)
        got = r.run(r.runtime(), {"x": self.target, **others}, steps)["x"]
        return _first_difference(got, self.alone, range(self.total))

    def prefill_decode(self) -> str | None:
        r = self.runner
        got = r.run(r.runtime(), {"x": self.target}, [[("x", self.total)]])["x"]
        return _first_difference(got, self.alone, range(self.prompt, self.total))

    def chunking(self) -> str | None:
        rng, r = self.rng, self.runner
        cuts = sorted(rng.sample(range(2, self.prompt - 1), 2))
        one = rng.randrange(cuts[1] + 1, self.prompt)  # a one-token chunk
        bounds = [0, *cuts, one, one + 1, self.prompt]
        bounds = sorted(set(bounds))
        steps = [[("x", b - a)] for a, b in itertools.pairwise(bounds)]
        steps += [[("x", 1)] for _ in range(_DECODES)]
        got = r.run(r.runtime(), {"x": self.target}, steps)["x"]
        return _first_difference(got, self.alone, range(self.total))

    def prefix_hit(self) -> str | None:
        r = self.runner
        runtime = r.runtime(prefix=True)
        prompt_tokens = self.target.tokens[: self.prompt]
        warm = runtime.match_prefix(prompt_tokens)
        # A hit needs no cached block where the kind reads none (a chunked-local layer at
        # a chunk boundary): the warm request starts from its own match too.
        start = warm.num_tokens
        r.run(
            runtime,
            {"w": self.target},
            [[("w", self.prompt - start)]],
            done={"w": start},
            prefixes={"w": warm},
        )
        runtime.free(["w"], token_ids={"w": prompt_tokens})
        match = runtime.match_prefix(prompt_tokens)
        hit = match.num_tokens
        if hit == 0:
            return f"no prefix-cache hit for a {self.prompt}-token prompt ({match.explain()})"
        steps = [[("x", self.prompt - hit)], *([("x", 1)] for _ in range(_DECODES))]
        got = r.run(
            runtime, {"x": self.target}, steps, done={"x": hit}, prefixes={"x": match}
        )["x"]
        return _first_difference(got, self.alone, range(hit, self.total))


_SCENARIOS: tuple[tuple[Determinism, str, str], ...] = (
    (Determinism.RUN_TO_RUN, "alone, twice", "run_to_run"),
    (Determinism.BATCH_INVARIANT, "alone vs co-batched, random order", "batched"),
    (Determinism.PREFILL_DECODE, "decodes vs one prefill", "prefill_decode"),
    (Determinism.CHUNKING_INVARIANT, "one chunk vs random chunks", "chunking"),
    (Determinism.PREFIX_HIT_INVARIANT, "computed vs a prefix-cache hit", "prefix_hit"),
)
_REPEATED = frozenset({"batched", "chunking"})


def check_invariance(
    backend_cls: type[AttentionBackend],
    *,
    level: Determinism | str | None = None,
    kinds: Iterable[KVCacheSpecKind | str] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    trials: int = 2,
    seed: int = 0,
    registry: BackendRegistry | None = None,
) -> ConformanceReport:
    """Check, bit for bit, that ``backend_cls`` keeps its declared ``Determinism``.

    Args:
        backend_cls: the backend class (registered or not).
        level: the level to check (default: each kind's declared level,
            ``determinism_for``); a level above the declared one is refused by
            selection, and reported as a failure.
        kinds: the kinds to check (default: those of ``INVARIANCE_KINDS`` it serves).
        dtype: the model dtype of the layer.
        device: where to run.
        trials: random schedules per co-batched and chunking entry.
        seed: makes the run reproducible.
        registry: where other backends come from (default: the built-ins only).

    Returns:
        A ``ConformanceReport`` with one entry per level and kind, e.g.
        ``"batch_invariant (full_attention)"``: passed, failed (with the first
        position whose row differs) or skipped (a level above the one checked).
    """
    dev = parse_device(device)
    given: object = trials
    if not isinstance(given, int) or isinstance(given, bool) or given < 1:
        raise InvalidArgumentError(f"trials must be an int >= 1, got {trials!r}")
    wanted = None if level is None else Determinism.parse(level, argument="level")
    served = backend_cls.supported_kinds()
    chosen = (
        [k for k in INVARIANCE_KINDS if k in served]
        if kinds is None
        else [rules_for_kind(k).kind for k in kinds]
    )
    name = backend_cls.name
    results: list[CapabilityResult] = []

    def report(skipped: str | None = None) -> ConformanceReport:
        return ConformanceReport(
            backend=name,
            device=str(dev),
            results=tuple(results),
            skipped=skipped,
            max_examples=trials,
            seed=seed,
            check="invariance",
        )

    environment = backend_cls.environment_reasons(dev) + backend_cls.device_reasons(dev)
    if environment:
        return report("; ".join(environment))
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    if registry is not None:
        for other in registry.names():
            if other != name:
                reg.register(registry.get(other), replace=True)
    reg.register(backend_cls, replace=True)
    for kind in chosen:
        checked = wanted if wanted is not None else backend_cls.determinism_for(kind)
        if kind not in INVARIANCE_KINDS:
            results.append(
                CapabilityResult(
                    f"determinism ({kind.value})",
                    "skipped",
                    "the check builds full, sliding-window and chunked-local layers only",
                )
            )
            continue
        spec = _spec_for(backend_cls, kind, dtype)
        runner = None if isinstance(spec, str) else _Runner(name, spec, checked, reg, dev)
        drawn: dict[int, _Scenarios] = {}
        for scenario_level, what, method in _SCENARIOS:
            capability = f"{scenario_level.label} ({kind.value})"
            if runner is None:
                results.append(CapabilityResult(capability, "skipped", str(spec)))
                continue
            if scenario_level > checked:
                results.append(
                    CapabilityResult(
                        capability,
                        "skipped",
                        f"above the level checked ({checked.label}; declared: "
                        f"{backend_cls.determinism_for(kind).label})",
                    )
                )
                continue
            started = time.perf_counter()
            problem: str | None = None
            runs = trials if method in _REPEATED else 1
            try:
                for trial in range(runs):
                    if trial not in drawn:
                        drawn[trial] = _Scenarios(runner, seed * 1009 + trial)
                    problem = getattr(drawn[trial], method)()
                    if problem is not None:
                        problem = f"{what}, trial {trial}: {problem}"
                        break
            except Exception as exc:
                problem = f"{what}: {type(exc).__name__}: {exc}"
            results.append(
                CapabilityResult(
                    capability,
                    "failed" if problem else "passed",
                    problem or what,
                    seconds=time.perf_counter() - started,
                    examples=runs,
                )
            )
    return report()
