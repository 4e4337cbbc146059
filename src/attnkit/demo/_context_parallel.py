"""``run_demo_context_parallel``: ``run_demo`` on local processes, one decode
context-parallel rank each (``torch.distributed``, gloo)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TextIO, cast

from ..errors import InvalidArgumentError
from ._report import DemoResult
from ._run import run_demo


def run_demo_context_parallel(
    world_size: int, *, out: TextIO, timeout_s: float = 120.0, **kwargs: Any
) -> DemoResult:
    """``run_demo`` on ``world_size`` local processes, one decode context-parallel rank
    each (``torch.distributed`` with gloo, a file store in a temporary directory).

    Rank 0's report goes to ``out``, followed by every rank's peak KV-cache blocks and
    the largest difference between the ranks' and rank 0's results; ``kwargs`` are
    ``run_demo``'s (``registry`` must be left out: each process uses the default one).
    The result is rank 0's, passed only if every rank passed.

    Raises:
        InvalidArgumentError: ``world_size`` is not an int >= 1, or a bad ``kwargs``.
        RuntimeError: a rank failed (its error is in the message).
    """
    import json
    import tempfile
    from pathlib import Path

    from torch.multiprocessing.spawn import (
        spawn as untyped_spawn,  # pyright: ignore[reportUnknownVariableType]  # unannotated in torch
    )

    # torch leaves spawn unannotated; typed here once.
    spawn = cast("Callable[..., object]", untyped_spawn)
    given: object = world_size  # untyped callers may pass anything
    if not (isinstance(given, int) and not isinstance(given, bool) and world_size >= 1):
        raise InvalidArgumentError(
            f"context_parallel: the rank count must be an int >= 1, got {world_size!r}"
        )
    if "registry" in kwargs or "context_parallel" in kwargs or "out" in kwargs:
        raise InvalidArgumentError(
            "run_demo_context_parallel: registry, context_parallel and out are set per rank; "
            f"got {sorted(k for k in kwargs if k in ('registry', 'context_parallel', 'out'))}"
        )
    with tempfile.TemporaryDirectory(prefix="attnkit-cp-") as tmp:
        spawn(
            _context_parallel_rank,
            args=(world_size, tmp, timeout_s, kwargs),
            nprocs=world_size,
            join=True,
        )
        reports = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world_size)]
    first = reports[0]
    out.write(first["text"])
    blocks = ", ".join(f"rank {r}: {rep['peak_kv_blocks']}" for r, rep in enumerate(reports))
    out.write(f"peak KV-cache blocks per rank: {blocks}\n")
    passed = all(rep["passed"] for rep in reports)
    if not passed:
        failing = [r for r, rep in enumerate(reports) if not rep["passed"]]
        out.write(f"FAIL: ranks {failing} did not match their dense recompute\n")
    return DemoResult(
        passed=passed,
        max_error=max(rep["max_error"] for rep in reports),
        steps=first["steps"],
        tokens=first["tokens"],
        seconds=first["seconds"],
        peak_kv_blocks=first["peak_kv_blocks"],
    )


def _context_parallel_rank(
    rank: int, world_size: int, tmp: str, timeout_s: float, kwargs: dict[str, Any]
) -> None:
    """One rank of ``run_demo_context_parallel`` (a spawned process)."""
    import datetime
    import io
    import json
    from pathlib import Path

    import torch.distributed as dist

    from ..parallel import ContextParallel

    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        text = io.StringIO()
        result = run_demo(out=text, context_parallel=ContextParallel.from_process_group(), **kwargs)
        report = {**dataclasses.asdict(result), "text": text.getvalue()}
        (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()
