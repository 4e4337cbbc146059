"""The conformance kit: is a backend right, capability by capability?

``check_backend(MyBackend)`` walks what the backend declares (the kinds of its
bindings, head sizes, block sizes, dtypes, KV-cache dtypes, features, state types,
its builders' CUDA-graph levels, ``deterministic``), combines the values pairwise over
every kind (each pair of values of two dimensions meets in some combination, a
non-default softmax scale among them), generates cases for each combination with
hypothesis (ragged batches of decodes, prefills and chunked prefills over several
steps; shuffled block pools; NaN-filled caches; windows and chunks near block edges;
GQA ratios; two layers per group), runs each through ``AttentionRuntime`` with the
backend and with ``reference``, and reports per capability: passed, failed (with the
smallest failing case hypothesis found, what went wrong and which values the failure
needs) or skipped (with why)::

    from attnkit.testing import check_backend

    def test_conformance() -> None:
        check_backend(MyBackend).assert_ok()

A declared capability that the backend rejects, raises on, or computes differently
from reference (beyond ``tolerances.TOLERANCES``) fails, named; so does a ``forward``
that changes its inputs, the step's metadata or a cache slot outside the step's
writes. Each declared 16-bit dtype also runs one long-context case (3000 tokens), and
a backend declaring ``deterministic`` runs every call twice, compared bit for bit. A
CUDA-graph level above ``NEVER`` is checked by two capture builds of batches of one
shape: replaying the first build's metadata on the second batch must match
reference (a builder that reallocates its tensors fails, and the report lists the
tensors that moved). A backend that cannot run here at all is **not checked**
(``report.ok`` is False). Needs ``hypothesis`` (``pip install 'attnkit[testing]'``).

``check_invariance(MyBackend)`` checks, bit for bit, the ``Determinism`` level the
backend declares per kind: one request's rows alone, co-batched in random order, as
decodes against one prefill, under random chunkings and after a prefix-cache hit
(docs/determinism.md).

Defaults suit CI (``DEFAULT_MAX_EXAMPLES`` per capability); authors should run
``max_examples=AUTHOR_MAX_EXAMPLES`` (or more) before a release.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import tempfile
import time
from collections.abc import Generator, Iterable, Sequence
from pathlib import Path
from typing import Literal, cast

import torch

try:
    import hypothesis
    import hypothesis.configuration
    from hypothesis import HealthCheck, Phase
    from hypothesis.errors import NoSuchExample
except ImportError as exc:  # pragma: no cover - exercised without the extra only
    raise ImportError("attnkit.testing needs hypothesis: pip install 'attnkit[testing]'") from exc

from .._validation import dtype_name
from ..backend import AttentionBackend, BackendRequest
from ..builder import AttentionCGSupport
from ..capabilities import AttentionFeature, MultipleOf, SizeRange, SizeRule, size_allowed
from ..devices import parse_device
from ..kinds import attention_rules, rules_for_kind
from ..params import AttentionLayerParams, LayerParams
from ..registry import BUILTIN_BACKENDS, BackendRegistry
from ..spec import DYNAMIC_KV_CACHE_DTYPES, MODEL_DTYPES, KVCacheDType, KVCacheSpec, KVCacheSpecKind
from ._cases import (
    KitError,
    check_cudagraph,
    config_for,
    make_layer,
    run_case,
    run_sparse_case,
    tolerance_of,
)
from ._invariance import INVARIANCE_KINDS, check_invariance
from ._pairwise import pairwise
from ._report import DEFAULT_MAX_EXAMPLES, CapabilityResult, ConformanceReport, Status, Verdict
from .strategies import Case, LayerChoice, cases, long_context_case, ragged_case
from .tolerances import TOLERANCES, Tolerance, tolerance_for

__all__ = [
    "AUTHOR_MAX_EXAMPLES",
    "BLOCK_SIZES",
    "DEFAULT_MAX_EXAMPLES",
    "HEAD_SIZES",
    "INVARIANCE_KINDS",
    "KIT_SCALE",
    "TOLERANCES",
    "CapabilityResult",
    "ConformanceReport",
    "Status",
    "Tolerance",
    "Verdict",
    "check_backend",
    "check_invariance",
    "declared_capabilities",
    "layer_of",
    "rerun",
    "tolerance_for",
]

AUTHOR_MAX_EXAMPLES = 25
"""What a backend author should run before a release (``max_examples=...``)."""

SHRINK_RUNS = 40
"""Cases the kit runs, at most, to shrink a failure (beyond ``max_examples``)."""

HEAD_SIZES = (16, 80, 96, 64, 128, 32, 256, 8)
"""Head sizes the kit draws from, in order: the first four a backend allows."""
BLOCK_SIZES = (16, 48, 24, 528, 64, 32, 128, 8, 256)
"""Block sizes the kit draws from, in order: the first four a backend allows (528 is
the attention block of a hybrid model whose blocks are scaled to its state page, as
engines that unify pages that way, vLLM among them, run it)."""
KIT_SCALE = 0.15
"""The non-default softmax scale (``AttentionLayerParams.scale``) combinations take."""
_PER_DIMENSION = 4

_NOT_CHECKED = {
    AttentionFeature.CONTEXT_PARALLEL: (
        "the kit does not run a group of context-parallel ranks yet "
        "(tests/test_context_parallel.py does, for the reference backend)"
    ),
    AttentionFeature.SPARSE_ATTENTION: (
        "checked by the sparse_attention cases (an indexer and its sparse MLA layer)"
    ),
    AttentionFeature.PER_HEAD_QUANT_SCALES: (
        "the kit does not draw per-head scales yet (they need an fp8_e4m3 cache; "
        "tests/test_kv_quant_scales.py checks reference and triton_attn, "
        "tests/backends/test_cpu_attn_quant.py cpu_attn)"
    ),
    AttentionFeature.MM_PREFIX: (
        "the kit does not schedule image ranges yet (tests/test_mm_prefix.py checks the "
        "built-in backends against a float64 oracle)"
    ),
}

Mode = Literal["search", "twice", "long", "sparse"]


class _ShrinkBudgetSpent(Exception):
    """Stops ``hypothesis.find`` once shrinking has run ``SHRINK_RUNS`` cases."""


def _sizes(rule: SizeRule | None, candidates: Sequence[int]) -> list[int]:
    """Up to four of ``candidates`` that ``rule`` allows (in their order), smallest
    first; the rule's smallest size when none is."""
    allowed = [s for s in candidates if rule is None or size_allowed(s, rule)]
    return sorted(allowed[:_PER_DIMENSION]) or (_smallest(rule) if rule is not None else [])


def _smallest(rule: SizeRule) -> list[int]:
    """The smallest size a rule allows (for rules none of the candidates meet)."""
    found: list[int] = []
    for r in rule:
        if isinstance(r, MultipleOf):
            found.append(r.n)
        elif isinstance(r, SizeRange):
            found.append(r.low)
        else:
            found.append(r)
    return [min(found)] if found else []


def _base_size(sizes: Sequence[int]) -> int:
    """The size a kind's first combination takes: 16 where allowed, else the smallest."""
    return 16 if 16 in sizes else sizes[0]


@dataclasses.dataclass(frozen=True)
class _Plan:
    capability: str
    choice: LayerChoice | None
    skip: str | None = None
    cudagraph: AttentionCGSupport | None = None
    rejected: str | None = None
    """Declared, but ``not_supported_reasons`` rejects it: the failure's detail."""
    base: LayerChoice | None = None
    """The kind's first combination (failures are narrowed towards it)."""
    mode: Mode = "search"


# Dimensions of a combination, after the kind: (name, LayerChoice field).
_DIMENSIONS = (
    ("head_size", "head_size"),
    ("block_size", "block_size"),
    ("dtype", "dtype"),
    ("kv_cache_dtype", "kv_cache_dtype"),
    ("feature", "features"),
    ("scale", "scale"),
)
Row = tuple[object, ...]


def _value_name(dimension: str, value: object) -> str:
    if isinstance(value, torch.dtype):
        return f"{dimension}={dtype_name(value)}"
    if isinstance(value, frozenset):
        names = sorted(f.value for f in cast("frozenset[AttentionFeature]", value))
        return f"{dimension}={','.join(names) or 'none'}"
    if isinstance(value, float):
        return f"{dimension}={value:g}"
    if value is None:
        return f"{dimension}=default"
    return f"{dimension}={value}"


def _choice_of(row: Row) -> LayerChoice:
    kind, head, block, dtype, cache, features, scale = row
    assert isinstance(kind, KVCacheSpecKind)
    assert isinstance(dtype, torch.dtype)
    assert isinstance(head, int)
    assert isinstance(block, int)
    assert isinstance(features, frozenset)
    assert scale is None or isinstance(scale, float)
    wanted = cast("frozenset[AttentionFeature]", features)
    return LayerChoice(
        kind=kind,
        head_size=head,
        block_size=block,
        dtype=dtype,
        kv_cache_dtype=cast("KVCacheDType", cache),
        features=wanted,
        scale=scale,
    )


def _row_of(choice: LayerChoice) -> Row:
    return (choice.kind, *(getattr(choice, field) for _, field in _DIMENSIONS))


def _replaced(choice: LayerChoice, field: str, value: object) -> LayerChoice:
    """``choice`` with one dimension's ``field`` set to ``value``."""
    row = list(_row_of(choice))
    row[1 + [f for _, f in _DIMENSIONS].index(field)] = value
    return dataclasses.replace(_choice_of(tuple(row)), mamba_type=choice.mamba_type)


def _name(choice: LayerChoice, base: LayerChoice) -> str:
    """``kind=K`` and the values that differ from the kind's first combination."""
    parts = [f"kind={choice.kind.value}"]
    for dimension, field in _DIMENSIONS:
        value = getattr(choice, field)
        if value != getattr(base, field):
            parts.append(_value_name(dimension, value))
    return " ".join(parts)


class _Planner:
    """What ``check_backend`` runs: combinations, long contexts, determinism, graphs."""

    def __init__(
        self,
        backend: type[AttentionBackend],
        reference: type[AttentionBackend],
        device: torch.device,
        kinds: Iterable[KVCacheSpecKind] | None,
    ) -> None:
        self.backend, self.reference, self.device = backend, reference, device
        served = backend.supported_kinds()
        self.served = served
        self.wanted = served if kinds is None else served & frozenset(kinds)
        self.heads = _sizes(backend.supported_head_sizes, HEAD_SIZES)
        self.blocks = _sizes(backend.supported_block_sizes, BLOCK_SIZES)
        dtypes = [
            d for d in (torch.float32, torch.float16, torch.bfloat16) if d in backend.supported_dtypes
        ]
        self.dtypes = dtypes + sorted(backend.supported_dtypes - MODEL_DTYPES - set(dtypes), key=str)
        self.caches: list[KVCacheDType] = ["auto", *sorted(backend.supported_kv_cache_dtypes - {"auto"})]
        checked = sorted(
            (f for f in backend.supported_features if f not in _NOT_CHECKED), key=lambda f: f.value
        )
        self.features: list[frozenset[AttentionFeature]] = [
            frozenset(),
            *(frozenset({f}) for f in checked),
        ]
        self._reasons: dict[tuple[str, LayerChoice], list[str]] = {}
        self.uncovered: list[str] = []

    def reasons(self, side: type[AttentionBackend], choice: LayerChoice) -> list[str]:
        """Why ``side`` cannot serve ``choice`` (cached)."""
        key = (side.name, choice)
        if key not in self._reasons:
            found = _kit_reasons(choice)
            if not found:
                spec, params = make_layer(Case(choice, 1, 1, 2 * choice.block_size - 1, (), 0), self.device)
                found = side.not_supported_reasons(
                    BackendRequest(spec=spec, device=self.device, features=_features(params))
                )
            self._reasons[key] = found
        return self._reasons[key]

    def valid(self, choice: LayerChoice) -> bool:
        return not self.reasons(self.reference, choice) and not self.reasons(self.backend, choice)

    def plans(self) -> list[_Plan]:
        plans: list[_Plan] = []
        bases: dict[KVCacheSpecKind, LayerChoice] = {}
        dtype = self.dtypes[0] if self.dtypes else torch.float32
        # Every attention kind the rules know, K/V kinds before latent ones.
        order = [r.kind for r in sorted(attention_rules(), key=lambda r: r.latent)]
        # The indexer selects instead of attending: its own cases below.
        attention: list[KVCacheSpecKind] = [
            k for k in order if k in self.wanted and k is not KVCacheSpecKind.INDEXER
        ]
        for kind in attention:
            base = LayerChoice(
                kind=kind,
                head_size=_base_size(self.heads),
                block_size=_base_size(self.blocks),
                dtype=dtype,
            )
            rejected = self.reasons(self.backend, base)
            by_reference = self.reasons(self.reference, base)
            name = f"kind={kind.value}"
            if by_reference:
                plans.append(_Plan(name, base, skip=_cannot(by_reference)))
            elif rejected:
                plans.append(_Plan(name, base, rejected=_declared_but(rejected)))
            else:
                bases[kind] = base
        if bases:
            plans += self._combinations(bases)
        primary = next(iter(bases.values()), None)
        for feature in sorted(self.backend.supported_features, key=lambda f: f.value):
            if feature in _NOT_CHECKED:
                choice = primary and dataclasses.replace(primary, features=frozenset({feature}))
                plans.append(_Plan(f"feature={feature.value}", choice, skip=_NOT_CHECKED[feature]))
        plans += self._long_contexts(bases)
        plans += self._sparse()
        states: list[LayerChoice] = []
        if KVCacheSpecKind.MAMBA in self.wanted:
            for state_type in sorted(self.backend.supported_mamba_types):
                choice = LayerChoice(
                    kind=KVCacheSpecKind.MAMBA, block_size=self.blocks[0], mamba_type=state_type
                )
                states.append(choice)
                plans.append(_Plan(f"kind=mamba mamba_type={state_type}", choice))
        plans += self._determinism([*bases.values(), *states])
        for kind in sorted(self.served - self.wanted, key=lambda k: k.value):
            plans.append(_Plan(f"kind={kind.value}", None, skip="not among the kinds asked for"))
        plans += self._cudagraphs([*bases.values(), *states])
        return [self._with_reference_check(p) for p in plans]

    def _sparse(self) -> list[_Plan]:
        """DeepSeek sparse attention: an indexer and its sparse MLA layer, per block size
        and dtype, where the backend declares the indexer kind or sparse attention."""
        indexer = KVCacheSpecKind.INDEXER in self.wanted
        sparse = AttentionFeature.SPARSE_ATTENTION in self.backend.supported_features and (
            KVCacheSpecKind.MLA_ATTENTION in self.wanted
        )
        if not (indexer or sparse):
            return []
        kind = KVCacheSpecKind.INDEXER if indexer else KVCacheSpecKind.MLA_ATTENTION
        features: frozenset[AttentionFeature] = (
            frozenset({AttentionFeature.SPARSE_ATTENTION}) if not indexer else frozenset()
        )
        plans: list[_Plan] = []
        for block_size in self.blocks[:2]:
            for dtype in self.dtypes:
                choice = LayerChoice(
                    kind=kind, head_size=128, block_size=block_size, dtype=dtype, features=features
                )
                name = (
                    f"sparse_attention kind={kind.value} block_size={block_size} "
                    f"dtype={dtype_name(dtype)}"
                )
                plans.append(_Plan(name, choice, mode="sparse"))
        return plans

    def _combinations(self, bases: dict[KVCacheSpecKind, LayerChoice]) -> list[_Plan]:
        """Every kind's first combination, then pairwise combinations of every value."""
        base = next(iter(bases.values()))
        dims: list[list[object]] = [
            list(bases),
            _first(self.heads, base.head_size),
            _first(self.blocks, base.block_size),
            list(self.dtypes),
            list(self.caches),
            list(self.features),
            [None, KIT_SCALE],
        ]
        first = [_row_of(b) for b in bases.values()]
        rows, missing = pairwise(dims, lambda row: self.valid(_choice_of(row)), first=first)
        plans: list[_Plan] = []
        for row in rows:
            choice = _choice_of(row)
            kind_base = bases[choice.kind]
            plans.append(_Plan(_name(choice, kind_base), choice, base=kind_base))
        names = ["kind", *(d for d, _ in _DIMENSIONS)]
        unserved: dict[tuple[int, object], int] = {}
        for i, a, j, b in missing:
            if i == 0:
                unserved[(j, b)] = unserved.get((j, b), 0) + 1
            left = f"kind={a.value}" if isinstance(a, KVCacheSpecKind) else _value_name(names[i], a)
            self.uncovered.append(f"{left} {_value_name(names[j], b)}")
        # A value no kind serves in any combination: declared but rejected, or one
        # reference cannot compare.
        for (j, value), count in unserved.items():
            if count < len(bases):
                continue
            field = _DIMENSIONS[j - 1][1]
            label = _value_name(names[j], value)
            trials = [_replaced(b, field, value) for b in bases.values()]
            served = [c for c in trials if not self.reasons(self.reference, c)]
            if not served:
                plans.append(_Plan(label, trials[0], skip=_cannot(self.reasons(self.reference, trials[0]))))
            else:
                plans.append(_Plan(label, served[0], rejected=_declared_but(self.reasons(self.backend, served[0]))))
        return plans

    def _long_contexts(self, bases: dict[KVCacheSpecKind, LayerChoice]) -> list[_Plan]:
        """One long-context case per declared 16-bit dtype, kinds taken in turn."""
        eligible = [
            b
            for b in sorted(bases.values(), key=lambda b: rules_for_kind(b.kind).extent is not None)
            if _long_context_kind(b.kind)
        ]
        plans: list[_Plan] = []
        for dtype in (torch.float16, torch.bfloat16):
            if dtype not in self.dtypes:
                continue
            label = f"long_context dtype={dtype_name(dtype)}"
            trials = [dataclasses.replace(b, dtype=dtype) for b in eligible]
            trials = [c for c in trials if self.valid(c)]
            if not trials:
                why = "no kind the backend serves in it keeps a cache of the step's own tokens"
                plans.append(_Plan(label, None, skip=why))
                continue
            choice = trials[len(plans) % len(trials)]
            plans.append(_Plan(f"{label} ({choice.kind.value})", choice, mode="long"))
        return plans

    def _determinism(self, choices: Sequence[LayerChoice]) -> list[_Plan]:
        if not self.backend.deterministic:
            why = "not declared (AttentionBackend.deterministic is False): two runs are not compared"
            return [_Plan("deterministic", None, skip=why)]
        return [_Plan(f"deterministic ({_where(c)})", c, mode="twice") for c in choices]

    def _cudagraphs(self, choices: Sequence[LayerChoice]) -> list[_Plan]:
        """CUDA-graph levels, per kind (its first combination) and state type."""
        plans: list[_Plan] = []
        for c in choices:
            spec, _ = make_layer(Case(c, 1, 1, 2 * c.block_size - 1, (), 0), self.device)
            binding = self.backend.find_binding(spec)
            if binding is None:
                continue
            level = binding.get_cudagraph_support(config_for(c.kind, self.backend.name), spec)
            if level is not AttentionCGSupport.NEVER:
                plans.append(_Plan(f"cudagraph={level.name} ({_where(c)})", c, cudagraph=level))
        return plans

    def _with_reference_check(self, plan: _Plan) -> _Plan:
        """Skip what reference itself cannot serve (nothing to compare with)."""
        if plan.skip or plan.rejected or plan.choice is None:
            return plan
        c = plan.choice
        if c.kind is KVCacheSpecKind.MAMBA and c.mamba_type not in self.reference.supported_mamba_types:
            return dataclasses.replace(plan, skip=f"reference does not serve mamba_type={c.mamba_type}")
        reasons = self.reasons(self.reference, c)
        if reasons:
            return dataclasses.replace(plan, skip=_cannot(reasons))
        rejected = self.reasons(self.backend, c)
        if rejected:
            return dataclasses.replace(plan, rejected=_declared_but(rejected))
        return plan


def _first(values: Sequence[int], base: int) -> list[object]:
    """``values`` with ``base`` first (the first value of a dimension is its base)."""
    return [base, *(v for v in values if v != base)]


def _where(choice: LayerChoice) -> str:
    return choice.kind.value if choice.mamba_type is None else f"mamba {choice.mamba_type}"


def _cannot(reasons: Sequence[str]) -> str:
    return "reference cannot serve it: " + "; ".join(reasons)


def _declared_but(reasons: Sequence[str]) -> str:
    return "declared, but not_supported_reasons rejects it: " + "; ".join(reasons)


def _kit_reasons(choice: LayerChoice) -> list[str]:
    """Combinations the kit does not make: the MLA projection is an MLA layer's."""
    if AttentionFeature.MLA_PROJECTION in choice.features and not rules_for_kind(choice.kind).latent:
        return [f"the MLA projection is for MLA kinds, not {choice.kind.value}"]
    if choice.kv_cache_dtype in DYNAMIC_KV_CACHE_DTYPES and rules_for_kind(choice.kind).latent:
        return [
            f"kv_cache_dtype={choice.kv_cache_dtype} is not an MLA cache (a latent keeps one "
            f"per-tensor scale)"
        ]
    return []


def _long_context_kind(kind: KVCacheSpecKind) -> bool:
    """Kinds whose context the kit writes itself: a cache of the step's own tokens, no
    sink tokens (``long_context_case``)."""
    rules = rules_for_kind(kind)
    return rules.has_cache and rules.writes == "step" and rules.extent != "sink_len"


def _features(params: LayerParams) -> frozenset[AttentionFeature]:
    return params.features if isinstance(params, AttentionLayerParams) else frozenset()


@contextlib.contextmanager
def _hypothesis_home(folder: str | Path | None) -> Generator[None, None, None]:
    """Hypothesis writes its caches to ``folder`` (a temporary one when ``None``, removed
    afterwards), never to ``.hypothesis/`` in the caller's directory; the caller's own
    setting is restored afterwards. Hypothesis has a setter for it, no getter."""
    previous = getattr(hypothesis.configuration, "__hypothesis_home_directory", None)
    with contextlib.ExitStack() as stack:
        home = folder if folder is not None else stack.enter_context(
            tempfile.TemporaryDirectory(prefix="attnkit-hypothesis-")
        )
        hypothesis.configuration.set_hypothesis_home_dir(home)
        try:
            yield
        finally:
            hypothesis.configuration.set_hypothesis_home_dir(previous)


def check_backend(
    backend_cls: type[AttentionBackend],
    *,
    device: torch.device | str = "cpu",
    kinds: Iterable[KVCacheSpecKind | str] | None = None,
    max_examples: int = DEFAULT_MAX_EXAMPLES,
    seed: int = 0,
    shrink: bool = True,
    registry: BackendRegistry | None = None,
    hypothesis_dir: str | Path | None = None,
) -> ConformanceReport:
    """Check ``backend_cls`` against ``reference``, capability by capability.

    Args:
        backend_cls: the backend class (registered or not).
        device: where to run (the backend's environment reasons for it, such as a
            missing device or package, leave the whole backend not checked, with
            those reasons).
        kinds: restrict to these kinds (default: every kind it serves).
        max_examples: hypothesis cases per capability.
        seed: makes the run reproducible (the same seed, the same cases).
        shrink: shrink a failing case to the smallest one hypothesis finds.
        registry: where ``reference`` comes from (default: the built-ins only); the
            backend under test is registered in a copy-free private registry.
        hypothesis_dir: where hypothesis may write its caches (the kit keeps no
            example database); default: a temporary folder, removed afterwards.

    Returns:
        The report; ``report.assert_ok()`` fails a test with the whole report.
    """
    dev = parse_device(device)
    wanted = None if kinds is None else [rules_for_kind(k).kind for k in kinds]
    name = backend_cls.name
    tolerances = (
        *((str(d).removeprefix("torch."), t) for d, t in TOLERANCES.items()),
        ("fp8 cache", tolerance_for(torch.float32, "fp8_e4m3")),
    )

    def report(
        results: Sequence[CapabilityResult],
        skipped: str | None = None,
        uncovered: Sequence[str] = (),
    ) -> ConformanceReport:
        return ConformanceReport(
            backend=name,
            device=str(dev),
            results=tuple(results),
            skipped=skipped,
            tolerances=tolerances,
            max_examples=max_examples,
            seed=seed,
            uncovered=tuple(uncovered),
        )

    environment = backend_cls.environment_reasons(dev) + backend_cls.device_reasons(dev)
    if environment:
        return report([], skipped="; ".join(environment))
    reg, reference = _registry(backend_cls, registry)
    results: list[CapabilityResult] = []
    with _hypothesis_home(hypothesis_dir):
        planner = _Planner(backend_cls, reference, dev, wanted)
        for index, plan in enumerate(planner.plans()):
            if plan.skip or plan.choice is None:
                results.append(
                    CapabilityResult(plan.capability, "skipped", plan.skip or "", plan.choice)
                )
                continue
            started = time.perf_counter()
            result = _check(
                plan, plan.choice, planner, reg, dev, max_examples, seed + index, shrink
            )
            results.append(dataclasses.replace(result, seconds=time.perf_counter() - started))
    return report(results, uncovered=planner.uncovered)


def _registry(
    backend_cls: type[AttentionBackend], registry: BackendRegistry | None = None
) -> tuple[BackendRegistry, type[AttentionBackend]]:
    """A private registry holding reference and the backend under test."""
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    reference = (registry or reg).get("reference")
    if backend_cls.name != "reference":
        reg.register(backend_cls, replace=True)
    if registry is not None:
        reg.register(reference, replace=True)
    return reg, reference


def rerun(
    case: Case,
    backend_cls: type[AttentionBackend],
    *,
    device: torch.device | str = "cpu",
    twice: bool = False,
) -> str | None:
    """Run one case (e.g. a report's ``example``) again: ``None`` if ``backend_cls``
    agrees with reference, else what went wrong, as in the report (``twice``: the
    determinism check too)."""
    reg, _ = _registry(backend_cls)
    return run_case(case, backend_cls.name, reg, parse_device(device), twice=twice)


def declared_capabilities(
    backend_cls: type[AttentionBackend],
    *,
    device: torch.device | str = "cpu",
    kinds: Iterable[KVCacheSpecKind | str] | None = None,
) -> list[tuple[str, LayerChoice | None, str | None]]:
    """What ``check_backend`` would check: ``(capability, layer choice, why skipped)``
    (a declared value the backend rejects is listed with no reason: it fails)."""
    dev = parse_device(device)
    wanted = None if kinds is None else [rules_for_kind(k).kind for k in kinds]
    _, reference = _registry(backend_cls)
    plans = _Planner(backend_cls, reference, dev, wanted).plans()
    return [(p.capability, p.choice, p.skip) for p in plans]


def layer_of(case: Case, device: torch.device | str = "cpu") -> tuple[KVCacheSpec, LayerParams]:
    """The spec and layer parameters a case runs (weights drawn from its seed)."""
    return make_layer(case, parse_device(device))


def _check(
    plan: _Plan,
    choice: LayerChoice,
    planner: _Planner,
    registry: BackendRegistry,
    device: torch.device,
    max_examples: int,
    seed: int,
    shrink: bool,
) -> CapabilityResult:
    tol = tolerance_of(choice)
    if plan.rejected is not None:
        return CapabilityResult(plan.capability, "failed", plan.rejected, choice, tolerance=tol)
    backend = planner.backend
    try:
        if plan.cudagraph is not None:
            case, problem, moved = check_cudagraph(
                choice, plan.cudagraph, backend.name, registry, device, seed
            )
            if problem is None and moved:
                # A captured graph keeps reading the first build's addresses: a tensor
                # that moves is one the replay does not see, however its values agree.
                problem = (
                    f"claims {plan.cudagraph.name} but reallocates between capture builds: "
                    f"{', '.join(moved)}"
                )
            if problem is None:
                return CapabilityResult(plan.capability, "passed", "", choice, None, 1, tol)
            return CapabilityResult(plan.capability, "failed", problem, choice, case, 1, tol)
        if plan.mode == "sparse":
            problem = run_sparse_case(choice, backend.name, registry, device, seed)
            if problem is None:
                return CapabilityResult(plan.capability, "passed", "", choice, None, 1, tol)
            return CapabilityResult(plan.capability, "failed", problem, choice, None, 1, tol)
        if plan.mode == "long":
            case = long_context_case(choice, seed=seed)
            problem = run_case(case, backend.name, registry, device)
            if problem is None:
                return CapabilityResult(plan.capability, "passed", "", choice, None, 1, tol)
            return CapabilityResult(plan.capability, "failed", problem, choice, case, 1, tol)
        result = _search(plan, choice, backend.name, registry, device, max_examples, seed, shrink)
        if result.status == "failed" and result.example is not None and plan.base is not None:
            needs = _narrow(plan.base, result.example, planner, registry, device)
            result = dataclasses.replace(result, needs=needs)
        return result
    except KitError as exc:
        return CapabilityResult(
            plan.capability, "skipped", f"the kit could not run it: {exc}", choice, tolerance=tol
        )


def _narrow(
    base: LayerChoice,
    found: Case,
    planner: _Planner,
    registry: BackendRegistry,
    device: torch.device,
) -> tuple[str, ...]:
    """The values of a failing combination its smallest case needs to fail: each value
    in turn set back to the kind's first combination's; kept if the case then passes."""
    current = found.choice
    needs = [f"kind={current.kind.value}"]
    for dimension, field in _DIMENSIONS:
        value = getattr(current, field)
        if value == getattr(base, field):
            continue
        trial = _replaced(current, field, getattr(base, field))
        still = planner.valid(trial) and (
            run_case(dataclasses.replace(found, choice=trial), planner.backend.name, registry, device)
            is not None
        )
        if still:
            current = trial
        else:
            needs.append(_value_name(dimension, value))
    return tuple(needs)


def _search(
    plan: _Plan,
    choice: LayerChoice,
    backend: str,
    registry: BackendRegistry,
    device: torch.device,
    max_examples: int,
    seed: int,
    shrink: bool,
) -> CapabilityResult:
    tol = tolerance_of(choice)
    twice = plan.mode == "twice"
    runs = 0
    smallest: list[Case] = []

    def fails(case: Case) -> bool:
        nonlocal runs
        if smallest and runs >= max_examples + SHRINK_RUNS:
            raise _ShrinkBudgetSpent
        runs += 1
        failing = run_case(case, backend, registry, device, twice=twice) is not None
        if failing:
            # The shrinker tries only smaller cases: the latest failure is the smallest.
            smallest.append(case)
        return failing

    # The fixed ragged case first: hypothesis starts from the simplest cases.
    ragged = ragged_case(choice, seed=seed)
    first = fails(ragged)
    if first and not shrink:
        problem = run_case(ragged, backend, registry, device, twice=twice) or "fails intermittently"
        return CapabilityResult(plan.capability, "failed", problem, choice, ragged, runs, tol)
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]
    settings = hypothesis.settings(
        max_examples=max(max_examples, 20) if first else max_examples,
        database=None,
        deadline=None,
        phases=phases,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.large_base_example,
        ],
    )
    try:
        found = hypothesis.find(cases(choice), fails, settings=settings, random=random.Random(seed))
    except NoSuchExample:
        if not first:
            return CapabilityResult(plan.capability, "passed", "", choice, None, runs, tol)
        found = ragged
    except _ShrinkBudgetSpent:
        found = smallest[-1]
    problem = run_case(found, backend, registry, device, twice=twice) or "fails intermittently"
    return CapabilityResult(plan.capability, "failed", problem, choice, found, runs, tol)
