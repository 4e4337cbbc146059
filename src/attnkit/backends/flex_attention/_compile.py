"""Compiling FlexAttention: one process-wide compiled callable per device type, the
compile cost of each new shape, and the environment reasons selection reads.

FlexAttention run eagerly materialises every score (tens of times slower than the
compiled kernel), so this backend never runs it uncompiled: where compilation cannot
work it says why (``environment_problems``) and selection moves on, and a compile that
fails at run time raises ``FlexCompileError`` and is remembered, so every later
selection in the process skips the backend with that reason.

Shapes are static (``dynamic=False``): with symbolic shapes, inductor's CPU template
for masks that read tensors fails to compile in torch 2.13 (``'cur_qSplitSize7' was
not declared in this scope``), so the builder pads batches to declared buckets and
every bucket is compiled once and cached by dynamo across steps.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ...errors import AttnkitError

__all__ = [
    "CompileRecord",
    "FlexCompileError",
    "compile_records",
    "environment_problems",
    "forget_failures",
    "record_failure",
    "recorded_failure",
    "run_compiled",
]

logger = logging.getLogger("attnkit.backends.flex_attention")

_RECOMPILE_LIMIT = 4096
"""Dynamo's own limit is 8 variants per function, after which it silently runs the
function uncompiled. Each variant here is a declared bucket, bounded by the buckets
the user declares, so the limit is raised for these calls only, and hitting it fails
loudly instead (``fail_on_recompile_limit_hit``)."""


class FlexCompileError(AttnkitError, RuntimeError):
    """Compiling a FlexAttention kernel failed; ``flex_attention`` is no longer selected
    in this process (the message says why and what to choose instead)."""


@dataclasses.dataclass(frozen=True)
class CompileRecord:
    """One compiled shape: what it was and how long its first call took.

    Attributes:
        device_type: ``"cpu"`` or ``"cuda"``.
        key: the shapes and variant that were compiled (human-readable).
        seconds: wall time of the first call (compile + one run).
    """

    device_type: str
    key: str
    seconds: float


_records: list[CompileRecord] = []
_seen: set[tuple[str, str]] = set()
_failures: dict[str, str] = {}


def compile_records() -> tuple[CompileRecord, ...]:
    """Every shape compiled in this process so far, in order (the first-step cost)."""
    return tuple(_records)


def record_failure(device_type: str, message: str) -> None:
    """Remember that compiling failed on ``device_type``: selection skips the backend
    there from now on, with ``message`` as the reason."""
    _failures[device_type] = message


def recorded_failure(device_type: str) -> str | None:
    """The compile failure recorded on ``device_type`` in this process, if any."""
    return _failures.get(device_type)


def forget_failures() -> None:
    """Forget recorded failures (tests, or after fixing the toolchain in a live process)."""
    _failures.clear()


@functools.cache
def _flex_importable() -> str | None:
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    return None


def _cpp_compiler_problem() -> str | None:
    """Inductor's own compiler lookup (``torch._inductor.config.cpp.cxx``), uncached, so
    a fixed ``CXX`` is seen at once."""
    try:
        from torch._inductor import cpp_builder  # heavy: only when asked

        cpp_builder.get_cpp_compiler()
    except Exception as exc:  # inductor raises its own InvalidCxxCompiler, and OSError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (
            "torch.compile needs a C++ compiler on CPU and none was found "
            f"({type(exc).__name__}: {first}); uncompiled FlexAttention is tens of times "
            "slower, so flex_attention is not offered (install g++ or set CXX)"
        )
    return None


def _cpu_isa_problem() -> str | None:
    # The CPU template inductor uses for flex_attention needs AVX2 (x86) and no
    # ATEN_CPU_CAPABILITY=default override; elsewhere it refuses to compile.
    import os

    avx2 = bool(torch.cpu._is_avx2_supported())
    if not avx2 or os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        return (
            "inductor compiles FlexAttention on CPU only with AVX2 (and without "
            "ATEN_CPU_CAPABILITY=default); uncompiled it is tens of times slower"
        )
    return None


def environment_problems(device: torch.device) -> list[str]:
    """Why compiled FlexAttention cannot run on ``device``'s type (empty: it can).

    Cheap checks only (no compile): flex_attention present in torch, a C++ compiler
    and AVX2 on CPU, triton on CUDA, and any compile failure recorded in this process.
    """
    problems: list[str] = []
    missing = _flex_importable()
    if missing is not None:
        return [missing]
    if device.type == "cpu":
        for problem in (_cpp_compiler_problem(), _cpu_isa_problem()):
            if problem is not None:
                problems.append(problem)
    elif device.type == "cuda" and importlib.util.find_spec("triton") is None:
        problems.append("torch.compile of FlexAttention on CUDA needs triton (pip install triton)")
    failed = _failures.get(device.type)
    if failed is not None:
        problems.append(f"compiling FlexAttention failed earlier in this process: {failed}")
    return problems


@functools.cache
def _compiled(device_type: str) -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    # One wrapper per device type: dynamo caches a compiled variant per static shape.
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)  # pyright: ignore[reportUnknownMemberType]  # torch types compile's overloads partially


def _compile(device_type: str) -> Callable[..., Any]:
    """The compiled callable (a seam: tests replace it to force a compile failure)."""
    return _compiled(device_type)


def run_compiled(key: str, device_type: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Call compiled ``flex_attention``; the first call of ``key`` compiles it.

    Raises:
        FlexCompileError: the first call of ``key`` failed (compilation, most likely);
            the failure is recorded, so selection skips ``flex_attention`` from now on.
    """
    first = (device_type, key) not in _seen
    started = time.perf_counter()
    try:
        fn = _compile(device_type)
        with (
            torch._dynamo.config.patch(  # pyright: ignore[reportUnknownMemberType]  # dynamo's config module is untyped
                recompile_limit=_RECOMPILE_LIMIT,
                accumulated_recompile_limit=_RECOMPILE_LIMIT,
                fail_on_recompile_limit_hit=True,
            ),
            warnings.catch_warnings(),
        ):
            # Compiling imports inductor modules that warn about torch's own deprecated
            # APIs; under warnings-as-errors (pytest here, some servers) that would turn
            # into a compile failure that has nothing to do with the user's code.
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            out = fn(*args, **kwargs)
    except Exception as exc:
        if not first:
            raise
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        message = f"{type(exc).__name__}: {' '.join(lines[:2])[:300]}"
        record_failure(device_type, message)
        raise FlexCompileError(
            f"flex_attention: compiling FlexAttention for {key} on {device_type} failed "
            f"({message}). The backend does not fall back to the uncompiled kernel (tens of "
            f"times slower); it is now refused by selection in this process, so choose "
            f"another backend for a new AttentionRuntime (on CPU: cpu_attn, the default, "
            f"or reference), or drop the setting that named flex_attention."
        ) from exc
    if first:
        seconds = time.perf_counter() - started
        _seen.add((device_type, key))
        _records.append(CompileRecord(device_type, key, seconds))
        logger.info("flex_attention: compiled %s on %s in %.1f s", key, device_type, seconds)
    assert isinstance(out, torch.Tensor)  # flex_attention without return_lse
    return out
