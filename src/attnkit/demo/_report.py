"""What a demo run reports: ``DemoResult``, and the running tally that prints one line
per step and the summary."""

from __future__ import annotations

import dataclasses
import math
from typing import TextIO

from ..runtime import AttentionRuntime


@dataclasses.dataclass
class DemoResult:
    passed: bool
    max_error: float
    steps: int
    tokens: int
    seconds: float
    peak_kv_blocks: int = 0
    """Most cache blocks the decoder runtime held at once (this rank's, with context
    parallelism)."""


@dataclasses.dataclass
class Tally:
    """The demo's running totals; ``record`` prints one step's line."""

    out: TextIO
    tol: float
    passed: bool = True
    max_error: float = 0.0
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    peak_kv_blocks: int = 0

    def note_blocks(self, runtime: AttentionRuntime) -> None:
        """Remember the most blocks ``runtime`` has held (the null block not counted)."""
        held = runtime.num_blocks - 1 - runtime.manager.pool.num_free_blocks
        self.peak_kv_blocks = max(self.peak_kv_blocks, held)

    def record(self, label: str, error: float, tokens: int, elapsed: float) -> None:
        ok = math.isfinite(error) and error <= self.tol
        self.passed &= ok
        self.max_error = max(self.max_error, error) if math.isfinite(error) else math.inf
        self.tokens += tokens
        self.seconds += elapsed
        self.out.write(
            f"step {self.steps:2d}  {label}  {elapsed * 1e3:7.1f} ms  max|err| {error:.2e}  "
            f"{tokens / elapsed:8.0f} tok/s  {'PASS' if ok else 'FAIL'}\n"
        )
        self.steps += 1

    def result(self) -> DemoResult:
        self.out.write(
            f"{'PASS' if self.passed else 'FAIL'}: {self.steps} steps, {self.tokens} tokens, "
            f"max|err| {self.max_error:.2e} (tolerance {self.tol:.0e}), "
            f"{self.tokens / self.seconds:.0f} tok/s overall\n"
        )
        return DemoResult(
            passed=self.passed,
            max_error=self.max_error,
            steps=self.steps,
            tokens=self.tokens,
            seconds=self.seconds,
            peak_kv_blocks=self.peak_kv_blocks,
        )
