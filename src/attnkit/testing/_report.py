"""The conformance report: one entry per capability, and the verdict on the backend."""

from __future__ import annotations

import dataclasses
from typing import Literal

from typing_extensions import override

from .strategies import Case, LayerChoice
from .tolerances import Tolerance

__all__ = ["CapabilityResult", "ConformanceReport", "Status", "Verdict"]

DEFAULT_MAX_EXAMPLES = 2
"""Cases per capability at the default settings (sized for CI under the Triton
interpreter)."""

Status = Literal["passed", "failed", "skipped"]
"""One capability's status."""

Verdict = Literal["passed", "failed", "not checked"]
"""The whole report's: ``"not checked"`` when nothing ran (the backend was skipped as a
whole, or every capability was), so nothing is known about it."""


@dataclasses.dataclass(frozen=True)
class CapabilityResult:
    """One capability's verdict.

    Attributes:
        capability: what was checked, e.g. ``"kind=sliding_window block_size=48"`` or
            ``"cudagraph=ALWAYS (full_attention)"``, with the layer it was checked on
            in ``choice``.
        status: ``"passed"``, ``"failed"`` or ``"skipped"``.
        detail: what went wrong (failed), why it was skipped, or notes.
        choice: the layer the capability was checked on.
        example: the smallest failing case found (failed only).
        needs: of a failing combination, the values the failure needs (the kind and
            each value that, set back to the kind's first one, makes the smallest
            case pass), e.g. ``("kind=sliding_window", "block_size=48")``.
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
    needs: tuple[str, ...] = ()

    def describe(self) -> str:
        head = f"{self.status.upper():7} {self.capability}"
        if self.choice is not None:
            head += f"  [{self.choice.describe()}]"
        lines = [head]
        if self.detail:
            lines.append(f"        {self.detail}")
        if self.needs:
            lines.append(f"        fails with just: {' '.join(self.needs)}")
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
        uncovered: value pairs no combination holds, because the backend or reference
            does not serve them together (``"kind=mla_attention kv_cache_dtype=fp8_e4m3"``).
        max_examples, seed: the settings used.
    """

    backend: str
    device: str
    results: tuple[CapabilityResult, ...]
    skipped: str | None = None
    tolerances: tuple[tuple[str, Tolerance], ...] = ()
    max_examples: int = DEFAULT_MAX_EXAMPLES
    seed: int = 0
    uncovered: tuple[str, ...] = ()
    check: str = "conformance"
    """What was checked: ``"conformance"`` (``check_backend``) or ``"invariance"``
    (``check_invariance``)."""

    @property
    def verdict(self) -> Verdict:
        """``"failed"`` when a capability failed; ``"not checked"`` when none passed (the
        backend was skipped as a whole, or every entry was); else ``"passed"``."""
        if self.failures():
            return "failed"
        if self.skipped is not None or not any(r.status == "passed" for r in self.results):
            return "not checked"
        return "passed"

    @property
    def ok(self) -> bool:
        """The backend was checked and no capability failed (``verdict == "passed"``); a
        backend skipped as a whole is not ok: nothing is known about it."""
        return self.verdict == "passed"

    @property
    def seconds(self) -> float:
        """Wall time of the capabilities run."""
        return sum(r.seconds for r in self.results)

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
        if self.skipped:
            summary = f"NOT CHECKED: {self.skipped}"
        else:
            summary = ", ".join(f"{n} {s}" for s, n in counts.items())
            if self.verdict == "not checked":
                summary = f"NOT CHECKED (no capability ran): {summary}"
        lines = [
            f"{self.check} of backend {self.backend!r} on {self.device} "
            f"(max_examples={self.max_examples}, seed={self.seed}): {summary}"
        ]
        lines += [r.describe() for r in self.results]
        if self.uncovered:
            lines.append(
                f"not combined ({len(self.uncovered)} value pairs the backend or reference "
                f"does not serve together): {'; '.join(self.uncovered)}"
            )
        if self.tolerances:
            lines.append(
                "tolerances: " + "; ".join(f"{name}: {tol}" for name, tol in self.tolerances)
            )
        return "\n".join(lines)

    def assert_ok(self) -> None:
        """Raise ``AssertionError`` with the whole report unless the backend was checked
        and passed: a failed capability, or a backend not checked here (wrong device, a
        missing package) both raise."""
        if not self.ok:
            raise AssertionError(self.describe())

    @override
    def __str__(self) -> str:
        return self.describe()
