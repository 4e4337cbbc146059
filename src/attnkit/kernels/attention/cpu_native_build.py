"""How the native CPU kernels are built: sources, prebuilt variants, compiler calls.

Standard library only, so that ``setup.py`` runs it (by path) to build the prebuilt
libraries into a platform wheel, and :mod:`.cpu_native` runs the same code to compile at
first use where no prebuilt library fits.

A build compiles each source to an object with OpenMP on (``-fopenmp``) and links the
objects without an OpenMP runtime: the library's OpenMP calls stay unresolved until the
loader makes torch's own runtime global (:mod:`.cpu_native`), so one process never runs
two OpenMP runtimes. Every build carries the hash of its sources
(``attnkit_source_hash``) and its variant's name (``attnkit_build_variant``).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "GLIBC_FLOOR",
    "HEADERS",
    "SOURCES",
    "VARIANTS",
    "BuildFailed",
    "Variant",
    "compile_library",
    "prebuilt_name",
    "required_glibc",
    "runnable_variants",
    "source_hash",
]

SOURCES = ("paged_decode.c", "paged_prefill.c")
"""Compiled, in this order, into one library."""
HEADERS = (
    "attnkit_abi.h",
    "paged_prefill_body.h",
    "paged_decode_body.h",
    "paged_decode_amx.h",
    "paged_prefill_amx.h",
    "avx512_transpose.h",
    "amx_tiles.h",
    "half_float.h",
)
"""Included by the sources (hashed with them, never compiled alone)."""

BASE_FLAGS = ("-O3", "-fPIC", "-Wno-psabi")
COMPILE_TIMEOUT_S = 120.0
_ERROR_LINES = 8


@dataclass(frozen=True)
class Variant:
    """A prebuilt library: its name, the flags that tune its baseline code, the machine
    (``platform.machine()``) it is for, and the CPU flags (``/proc/cpuinfo``) it needs.

    Only the code outside the kernels' own target regions depends on the variant: the
    AVX-512 and AVX512-BF16 copies are in every x86-64 variant and chosen at each call
    from what the CPU reports.
    """

    name: str
    flags: tuple[str, ...]
    machine: str
    cpu_flags: tuple[str, ...]


VARIANTS = (
    # x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE (the 8-lane copy's vectors whole).
    Variant(
        "x86-64-v3",
        ("-march=x86-64-v3", "-mtune=generic"),
        "x86_64",
        ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "sse4_2", "popcnt"),
    ),
    # Any x86-64 CPU: the 8-lane copy in SSE pairs.
    Variant("x86-64", ("-march=x86-64", "-mtune=generic"), "x86_64", ()),
    # Any AArch64 CPU: NEON is its baseline.
    Variant("armv8-a", ("-march=armv8-a",), "aarch64", ()),
)
"""Best first per machine; a CPU runs the first whose flags it has."""


GLIBC_FLOOR = (2, 17)
"""The newest glibc a prebuilt library may ask for: manylinux2014's (``manylinux_2_17``),
so one wheel loads on every distribution since 2014. The sources pin the two symbols
that would raise it (``attnkit_abi.h``)."""


def required_glibc(library: Path) -> tuple[int, int] | None:
    """The newest glibc symbol version ``library`` needs, from its version-needs section
    (``readelf -V``); ``None`` where it needs none or ``readelf`` (binutils) is missing."""
    try:
        done = subprocess.run(
            ["readelf", "-V", "-W", str(library)],
            capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    found = [(int(a), int(b)) for a, b in re.findall(r"Name: GLIBC_(\d+)\.(\d+)", done.stdout)]
    return max(found) if found else None


class BuildFailed(Exception):
    """The compiler could not build the library (the message carries its first lines)."""


def source_hash(directory: Path) -> str:
    """The sha256 (first 24 hex digits) of every source and header, by name."""
    key = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        data = (directory / name).read_bytes()
        for part in (name.encode(), data):
            key.update(len(part).to_bytes(8, "little"))
            key.update(part)
    return key.hexdigest()[:24]


def prebuilt_name(variant: Variant) -> str:
    """The file name of a variant's prebuilt library, beside the sources. Not a module
    name (the dot), so package walkers (``pkgutil``, doc tools) never try to import it."""
    return f"_native.{variant.name}.so"


def runnable_variants(machine: str, cpu_flags: Iterable[str]) -> list[Variant]:
    """The variants this CPU runs, best first."""
    have = set(cpu_flags)
    return [v for v in VARIANTS if v.machine == machine and have.issuperset(v.cpu_flags)]


def _first_lines(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[:_ERROR_LINES]) or "(no output)"


def _run(cmd: Sequence[str]) -> str | None:
    """Run a compiler command; its error text, or ``None`` when it succeeded."""
    try:
        done = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    if done.returncode != 0:
        return _first_lines(done.stderr or done.stdout)
    return None


def compile_library(
    compiler: str,
    source_dir: Path,
    target: Path,
    flags: Sequence[str],
    *,
    variant: str,
    openmp: bool = True,
    defines: Sequence[str] = (),
) -> None:
    """Build the library into ``target`` (written to a temporary file, then moved in
    place, so concurrent builds never expose a partial file).

    ``flags`` tune the baseline code (``-march=...``); ``openmp`` compiles the threaded
    path; ``defines`` are extra ``-D`` names (the tests' broken variants). Raises
    :class:`BuildFailed` with the compiler's first error lines.
    """
    digest = source_hash(source_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    cflags = [
        *BASE_FLAGS,
        *flags,
        *(["-fopenmp"] if openmp else []),
        f'-DATTNKIT_SOURCE_HASH="{digest}"',
        f'-DATTNKIT_BUILD_VARIANT="{variant}"',
        *(f"-D{name}" for name in defines),
    ]
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.stem}-") as tmp:
        objects: list[str] = []
        for source in SOURCES:
            obj = os.path.join(tmp, source + ".o")
            error = _run([compiler, *cflags, "-c", str(source_dir / source), "-o", obj])
            if error is not None:
                raise BuildFailed(f"{' '.join(flags) or '(no flags)'}: {source}:\n{error}")
            objects.append(obj)
        out = os.path.join(tmp, target.name)
        # No -fopenmp here: the OpenMP runtime is the one torch loaded (see cpu_native).
        error = _run([compiler, "-shared", *objects, "-o", out, "-lm"])
        if error is not None:
            raise BuildFailed(f"linking {target.name}:\n{error}")
        os.chmod(out, 0o755)
        os.replace(out, target)
