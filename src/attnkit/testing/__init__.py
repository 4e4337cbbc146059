"""The conformance kit: is a backend right, capability by capability?

``check_backend(MyBackend)`` walks what the backend declares (the kinds of its
bindings, head sizes, block sizes, dtypes, KV-cache dtypes, features, state types,
its builders' CUDA-graph levels), generates cases for each with hypothesis (ragged
batches of decodes, prefills and chunked prefills over several steps; shuffled block
pools; NaN-filled caches; windows and chunks near block edges; GQA ratios), runs each
through ``AttentionRuntime`` with the backend and with ``reference``, and reports per
capability: passed, failed (with the smallest failing case hypothesis found, and what
went wrong) or skipped (with why)::

    from attnkit.testing import check_backend

    def test_conformance() -> None:
        check_backend(MyBackend).assert_ok()

A declared capability that the backend rejects at run time, raises on, or computes
differently from reference (beyond ``tolerances.TOLERANCES``) fails, named. A
CUDA-graph level above ``NEVER`` is checked by two capture builds of batches of one
shape: replaying the first build's metadata on the second batch must match
reference (a builder that reallocates its tensors fails, and the report lists the
tensors that moved). Needs ``hypothesis`` (``pip install 'attnkit[testing]'``).

Defaults suit CI (``DEFAULT_MAX_EXAMPLES`` per capability); authors should run
``max_examples=AUTHOR_MAX_EXAMPLES`` (or more) before a release.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterable, Sequence
from typing import Literal

import torch
from typing_extensions import override

try:
    import hypothesis
    from hypothesis import HealthCheck, Phase
    from hypothesis.errors import NoSuchExample
except ImportError as exc:  # pragma: no cover - exercised without the extra only
    raise ImportError("attnkit.testing needs hypothesis: pip install 'attnkit[testing]'") from exc

from ..backend import AttentionBackend, BackendRequest
from ..builder import AttentionCGSupport
from ..capabilities import AttentionFeature, MultipleOf, SizeRange, SizeRule, size_allowed
from ..devices import parse_device
from ..kinds import attention_rules, rules_for_kind
from ..params import AttentionLayerParams, LayerParams
from ..registry import BUILTIN_BACKENDS, BackendRegistry
from ..spec import MODEL_DTYPES, KVCacheSpec, KVCacheSpecKind
from ._cases import KitError, check_cudagraph, config_for, make_layer, run_case, tolerance_of
from .strategies import Case, LayerChoice, cases, ragged_case
from .tolerances import TOLERANCES, Tolerance, tolerance_for

__all__ = [
    "AUTHOR_MAX_EXAMPLES",
    "DEFAULT_MAX_EXAMPLES",
    "TOLERANCES",
    "CapabilityResult",
    "ConformanceReport",
    "Status",
    "Tolerance",
    "check_backend",
    "declared_capabilities",
    "layer_of",
    "rerun",
    "tolerance_for",
]

DEFAULT_MAX_EXAMPLES = 2
"""Cases per capability at the default settings (sized for CI under the Triton
interpreter)."""
AUTHOR_MAX_EXAMPLES = 25
"""What a backend author should run before a release (``max_examples=...``)."""

SHRINK_RUNS = 40
"""Cases the kit runs, at most, to shrink a failure (beyond ``max_examples``)."""

Status = Literal["passed", "failed", "skipped"]


class _ShrinkBudgetSpent(Exception):
    """Stops ``hypothesis.find`` once shrinking has run ``SHRINK_RUNS`` cases."""


_HEAD_SIZES = (16, 32, 64, 80, 128, 8, 256)
_BLOCK_SIZES = (16, 8, 32, 64, 128, 256)
_NOT_CHECKED = {
    AttentionFeature.RETURN_LSE: "the kit does not compare the log-sum-exp output yet",
    AttentionFeature.CONTEXT_PARALLEL: (
        "the kit does not run a group of context-parallel ranks yet "
        "(tests/test_context_parallel.py does, for the reference backend)"
    ),
}


@dataclasses.dataclass(frozen=True)
class CapabilityResult:
    """One capability's verdict.

    Attributes:
        capability: what was checked, e.g. ``"block_size=64"`` or
            ``"cudagraph=ALWAYS"``, with the layer it was checked on in ``choice``.
        status: ``"passed"``, ``"failed"`` or ``"skipped"``.
        detail: what went wrong (failed), why it was skipped, or notes.
        choice: the layer the capability was checked on.
        example: the smallest failing case found (failed only).
        examples: cases run (shrinking included).
        tolerance: the tolerance outputs were held to.
        seconds: wall time spent.
    """

    capability: str
    status: Status
    detail: str = ""
    choice: LayerChoice | None = None
    example: Case | None = None
    examples: int = 0
    tolerance: Tolerance | None = None
    seconds: float = 0.0

    def describe(self) -> str:
        head = f"{self.status.upper():7} {self.capability}"
        if self.choice is not None:
            head += f"  [{self.choice.describe()}]"
        lines = [head]
        if self.detail:
            lines.append(f"        {self.detail}")
        if self.example is not None:
            lines.append(f"        smallest failing case: {self.example.describe()}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class ConformanceReport:
    """What ``check_backend`` found, per capability.

    Attributes:
        backend: the backend's name.
        device: where it ran.
        results: one entry per capability, in the order checked.
        skipped: why the whole backend was not run here (device, packages), or ``None``.
        tolerances: model dtype -> tolerance (``attnkit.testing.tolerances``).
        max_examples, seed: the settings used.
    """

    backend: str
    device: str
    results: tuple[CapabilityResult, ...]
    skipped: str | None = None
    tolerances: tuple[tuple[str, Tolerance], ...] = ()
    max_examples: int = DEFAULT_MAX_EXAMPLES
    seed: int = 0

    @property
    def ok(self) -> bool:
        """No capability failed (a skipped backend is ok: nothing ran)."""
        return not self.failures()

    def failures(self) -> list[CapabilityResult]:
        return [r for r in self.results if r.status == "failed"]

    def result(self, capability: str) -> CapabilityResult:
        """The result of ``capability`` (its exact name)."""
        for r in self.results:
            if r.capability == capability:
                return r
        raise KeyError(f"{capability!r}; checked: {', '.join(r.capability for r in self.results)}")

    def describe(self) -> str:
        counts = {
            s: sum(r.status == s for r in self.results) for s in ("passed", "failed", "skipped")
        }
        lines = [
            f"conformance of backend {self.backend!r} on {self.device} "
            f"(max_examples={self.max_examples}, seed={self.seed}): "
            + (
                f"SKIPPED: {self.skipped}"
                if self.skipped
                else ", ".join(f"{n} {s}" for s, n in counts.items())
            )
        ]
        lines += [r.describe() for r in self.results]
        if self.tolerances:
            lines.append(
                "tolerances: " + "; ".join(f"{name}: {tol}" for name, tol in self.tolerances)
            )
        return "\n".join(lines)

    def assert_ok(self) -> None:
        """Raise ``AssertionError`` with the whole report when a capability failed."""
        if not self.ok:
            raise AssertionError(self.describe())

    @override
    def __str__(self) -> str:
        return self.describe()


def _sizes(rule: SizeRule | None, candidates: Sequence[int]) -> list[int]:
    if rule is None:
        return list(candidates)
    return [s for s in candidates if size_allowed(s, rule)] or _smallest(rule)


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


@dataclasses.dataclass(frozen=True)
class _Plan:
    capability: str
    choice: LayerChoice | None
    skip: str | None = None
    cudagraph: AttentionCGSupport | None = None


def _plans(
    backend: type[AttentionBackend],
    reference: type[AttentionBackend],
    device: torch.device,
    kinds: Iterable[KVCacheSpecKind] | None,
) -> list[_Plan]:
    served = backend.supported_kinds()
    wanted = served if kinds is None else served & frozenset(kinds)
    head_sizes = _sizes(backend.supported_head_sizes, _HEAD_SIZES)
    block_sizes = _sizes(backend.supported_block_sizes, _BLOCK_SIZES)
    dtypes = [
        d for d in (torch.float32, torch.float16, torch.bfloat16) if d in backend.supported_dtypes
    ]
    dtypes += sorted(backend.supported_dtypes - MODEL_DTYPES - set(dtypes), key=str)
    base_dtype = dtypes[0] if dtypes else torch.float32
    plans: list[_Plan] = []
    primary: LayerChoice | None = None
    # Every attention kind the rules know, K/V kinds before latent ones (so the primary
    # choice is a K/V kind where the backend serves one).
    order = sorted(attention_rules(), key=lambda r: r.latent)
    for kind in (r.kind for r in order):
        if kind not in wanted:
            continue
        choice = LayerChoice(
            kind=kind, head_size=head_sizes[0], block_size=block_sizes[0], dtype=base_dtype
        )
        plans.append(_Plan(f"kind={kind.value}", choice))
        if primary is None:
            primary = choice
    if primary is not None:
        for size in _pick(head_sizes[1:], 2):
            plans.append(_Plan(f"head_size={size}", dataclasses.replace(primary, head_size=size)))
        for size in _pick(block_sizes[1:], 2, must=64):
            plans.append(_Plan(f"block_size={size}", dataclasses.replace(primary, block_size=size)))
        for dtype in dtypes[1:]:
            name = str(dtype).removeprefix("torch.")
            plans.append(_Plan(f"dtype={name}", dataclasses.replace(primary, dtype=dtype)))
        for cache in sorted(backend.supported_kv_cache_dtypes - {"auto"}):
            plans.append(
                _Plan(f"kv_cache_dtype={cache}", dataclasses.replace(primary, kv_cache_dtype=cache))
            )
        mla = next(
            (p.choice for p in plans if p.choice and rules_for_kind(p.choice.kind).latent), None
        )
        for feature in sorted(backend.supported_features, key=lambda f: f.value):
            # The projection is an MLA layer's: checked on the first MLA kind served.
            base = mla if feature is AttentionFeature.MLA_PROJECTION else primary
            skip = _NOT_CHECKED.get(feature)
            if base is None:
                base, skip = primary, "the backend serves no MLA kind (or none was asked for)"
            plan = _Plan(
                f"feature={feature.value}",
                dataclasses.replace(base, features=frozenset({feature})),
                skip=skip,
            )
            plans.append(plan)
    if KVCacheSpecKind.MAMBA in wanted:
        for state_type in sorted(backend.supported_mamba_types):
            choice = LayerChoice(
                kind=KVCacheSpecKind.MAMBA, block_size=block_sizes[0], mamba_type=state_type
            )
            plans.append(_Plan(f"kind=mamba mamba_type={state_type}", choice))
    for kind in sorted(served - wanted, key=lambda k: k.value):
        plans.append(_Plan(f"kind={kind.value}", None, skip="not among the kinds asked for"))
    # CUDA-graph levels, per kind checked (the first choice of each kind).
    seen: set[tuple[KVCacheSpecKind, str | None]] = set()
    for plan in list(plans):
        c = plan.choice
        if c is None or plan.skip or not plan.capability.startswith("kind="):
            continue
        if (c.kind, c.mamba_type) in seen:
            continue
        seen.add((c.kind, c.mamba_type))
        spec, _ = make_layer(Case(c, 1, 1, 2 * c.block_size - 1, (), 0), device)
        binding = backend.find_binding(spec)
        if binding is None:
            continue
        level = binding.get_cudagraph_support(config_for(c.kind, backend.name), spec)
        if level is not AttentionCGSupport.NEVER:
            where = c.kind.value if c.mamba_type is None else f"mamba {c.mamba_type}"
            plans.append(_Plan(f"cudagraph={level.name} ({where})", c, cudagraph=level))
    return [_with_reference_check(p, reference, device) for p in plans]


def _pick(sizes: Sequence[int], count: int, must: int | None = None) -> list[int]:
    """Up to ``count`` of ``sizes`` (``must`` first when allowed), small sizes first."""
    chosen = [must] if must is not None and must in sizes else []
    for s in sorted(sizes):
        if len(chosen) >= count:
            break
        if s not in chosen:
            chosen.append(s)
    return sorted(chosen)


def _with_reference_check(
    plan: _Plan, reference: type[AttentionBackend], device: torch.device
) -> _Plan:
    """Skip what reference itself cannot serve (nothing to compare with)."""
    if plan.skip or plan.choice is None:
        return plan
    c = plan.choice
    if c.kind is KVCacheSpecKind.MAMBA and c.mamba_type not in reference.supported_mamba_types:
        return dataclasses.replace(plan, skip=f"reference does not serve mamba_type={c.mamba_type}")
    spec, params = make_layer(Case(c, 1, 1, 2 * c.block_size - 1, (), 0), device)
    features = _features(params)
    request = BackendRequest(spec=spec, device=device, features=features)
    reasons = reference.not_supported_reasons(request)
    if reasons:
        return dataclasses.replace(plan, skip="reference cannot serve it: " + "; ".join(reasons))
    return plan


def _features(params: LayerParams) -> frozenset[AttentionFeature]:
    return params.features if isinstance(params, AttentionLayerParams) else frozenset()


def _declared_reasons(
    backend: type[AttentionBackend], choice: LayerChoice, device: torch.device
) -> list[str]:
    spec, params = make_layer(Case(choice, 1, 1, 2 * choice.block_size - 1, (), 0), device)
    features = _features(params)
    return backend.not_supported_reasons(
        BackendRequest(spec=spec, device=device, features=features)
    )


def check_backend(
    backend_cls: type[AttentionBackend],
    *,
    device: torch.device | str = "cpu",
    kinds: Iterable[KVCacheSpecKind | str] | None = None,
    max_examples: int = DEFAULT_MAX_EXAMPLES,
    seed: int = 0,
    shrink: bool = True,
    registry: BackendRegistry | None = None,
) -> ConformanceReport:
    """Check ``backend_cls`` against ``reference``, capability by capability.

    Args:
        backend_cls: the backend class (registered or not).
        device: where to run (the backend's environment reasons for it, such as a
            missing device or package, skip the whole backend with those reasons).
        kinds: restrict to these kinds (default: every kind it serves).
        max_examples: hypothesis cases per capability.
        seed: makes the run reproducible (the same seed, the same cases).
        shrink: shrink a failing case to the smallest one hypothesis finds.
        registry: where ``reference`` comes from (default: the built-ins only); the
            backend under test is registered in a copy-free private registry.

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
        results: Sequence[CapabilityResult], skipped: str | None = None
    ) -> ConformanceReport:
        return ConformanceReport(
            backend=name,
            device=str(dev),
            results=tuple(results),
            skipped=skipped,
            tolerances=tolerances,
            max_examples=max_examples,
            seed=seed,
        )

    environment = backend_cls.environment_reasons(dev) + backend_cls.device_reasons(dev)
    if environment:
        return report([], skipped="; ".join(environment))
    reg, reference = _registry(backend_cls, registry)
    results: list[CapabilityResult] = []
    for index, plan in enumerate(_plans(backend_cls, reference, dev, wanted)):
        if plan.skip or plan.choice is None:
            results.append(
                CapabilityResult(plan.capability, "skipped", plan.skip or "", plan.choice)
            )
            continue
        started = time.perf_counter()
        result = _check(
            plan, plan.choice, backend_cls, reg, dev, max_examples, seed + index, shrink
        )
        results.append(dataclasses.replace(result, seconds=time.perf_counter() - started))
    return report(results)


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
    case: Case, backend_cls: type[AttentionBackend], *, device: torch.device | str = "cpu"
) -> str | None:
    """Run one case (e.g. a report's ``example``) again: ``None`` if ``backend_cls``
    agrees with reference, else what went wrong, as in the report."""
    reg, _ = _registry(backend_cls)
    return run_case(case, backend_cls.name, reg, parse_device(device))


def declared_capabilities(
    backend_cls: type[AttentionBackend],
    *,
    device: torch.device | str = "cpu",
    kinds: Iterable[KVCacheSpecKind | str] | None = None,
) -> list[tuple[str, LayerChoice | None, str | None]]:
    """What ``check_backend`` would check: ``(capability, layer choice, why skipped)``."""
    dev = parse_device(device)
    wanted = None if kinds is None else [rules_for_kind(k).kind for k in kinds]
    _, reference = _registry(backend_cls)
    return [(p.capability, p.choice, p.skip) for p in _plans(backend_cls, reference, dev, wanted)]


def layer_of(case: Case, device: torch.device | str = "cpu") -> tuple[KVCacheSpec, LayerParams]:
    """The spec and layer parameters a case runs (weights drawn from its seed)."""
    return make_layer(case, parse_device(device))


def _check(
    plan: _Plan,
    choice: LayerChoice,
    backend: type[AttentionBackend],
    registry: BackendRegistry,
    device: torch.device,
    max_examples: int,
    seed: int,
    shrink: bool,
) -> CapabilityResult:
    tol = tolerance_of(choice)
    reasons = _declared_reasons(backend, choice, device)
    if reasons:
        return CapabilityResult(
            plan.capability,
            "failed",
            "declared, but not_supported_reasons rejects it: " + "; ".join(reasons),
            choice,
            tolerance=tol,
        )
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
        return _search(plan, choice, backend.name, registry, device, max_examples, seed, shrink)
    except KitError as exc:
        return CapabilityResult(
            plan.capability, "skipped", f"the kit could not run it: {exc}", choice, tolerance=tol
        )


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
    runs = 0
    smallest: list[Case] = []

    def fails(case: Case) -> bool:
        nonlocal runs
        if smallest and runs >= max_examples + SHRINK_RUNS:
            raise _ShrinkBudgetSpent
        runs += 1
        failing = run_case(case, backend, registry, device) is not None
        if failing:
            # The shrinker tries only smaller cases: the latest failure is the smallest.
            smallest.append(case)
        return failing

    # The fixed ragged case first: hypothesis starts from the simplest cases.
    ragged = ragged_case(choice, seed=seed)
    first = fails(ragged)
    if first and not shrink:
        problem = run_case(ragged, backend, registry, device) or "fails intermittently"
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
    problem = run_case(found, backend, registry, device) or "fails intermittently"
    return CapabilityResult(plan.capability, "failed", problem, choice, found, runs, tol)
