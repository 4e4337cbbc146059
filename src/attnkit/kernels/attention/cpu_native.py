"""Find, build and load the native CPU kernels (``paged_decode.c``, ``paged_prefill.c``
with what they include; :mod:`.cpu_native_build` says how they are built).

Which library loads (``ATTNKIT_CPU_LIBRARY``: ``auto``, the default, ``prebuilt`` or
``compile``):

* **prebuilt**: a platform wheel carries the library built for portable variants
  (:data:`.cpu_native_build.VARIANTS`: ``x86-64-v3``, ``x86-64``, ``armv8-a``; no
  ``-march=native``). The loader takes the best one this CPU runs (its ``/proc/cpuinfo``
  flags) whose source hash is the installed sources' (a library built from other
  sources, e.g. in an edited checkout, is stale and skipped). The kernels' AVX-512 and
  AVX512-BF16 copies are in every x86-64 variant and picked at each call from what the
  CPU reports.
* **compile**: where no prebuilt library fits, the system C compiler (``$CC``, else
  ``cc``, ``gcc``, ``clang`` on ``PATH``) builds one with ``-march=native`` at first use,
  cached under ``$ATTNKIT_CACHE_DIR/cpu-kernels/`` (default ``~/.cache/attnkit/
  cpu-kernels/``) by a hash of the sources, the compiler and its version, the flags, the
  machine and the CPU's feature flags.

**OpenMP.** No library links an OpenMP runtime: before loading one, the loader makes
the runtime torch itself loaded global (found among the process's mapped libraries), and
checks afterwards which file the library's OpenMP calls resolved to
(:attr:`NativeLibrary.openmp_runtime`). One process so runs one OpenMP runtime and one
thread pool.

**The ABI** lives in ``attnkit_abi.h`` alone: the library exports its function table
and error codes as text, the ctypes signatures are built from it, and each wrapper's
:class:`Entry` (the parameter names in the order it passes them) is checked against it
at load, so a library and wrappers from different versions are refused with the first
parameter where they differ, instead of corrupting memory.

:func:`native_problem` says why no library can be used (or ``None``);
:func:`load_paged_decode` returns the loaded :class:`NativeLibrary` or raises
:class:`RuntimeError` with that text.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import importlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from . import cpu_native_build

__all__ = ["Entry", "NativeLibrary", "load_paged_decode", "native_problem"]

_LOG = logging.getLogger(__name__)

_DIR = Path(__file__).parent
# Where the prebuilt libraries are looked for (the package; tests point it elsewhere).
_PREBUILT_DIR = _DIR
_MODE_ENV = "ATTNKIT_CPU_LIBRARY"
_MODES = ("auto", "prebuilt", "compile")
# The run-time build's flag sets, tried in order: the first the compiler accepts is kept.
# -march=native tunes for this CPU (hence the CPU flags in the cache key).
_FLAG_SETS: tuple[tuple[str, ...], ...] = (("-march=native",), ())
# Extra -D names for every build (the tests' broken variants; never prebuilt).
_DEFINES: tuple[str, ...] = ()
# The modules whose Entry objects call the library: imported before the check at load.
_WRAPPERS = (
    "attnkit.kernels.attention.cpu_decode",
    "attnkit.kernels.attention.cpu_prefill_native",
)

_CType = type[ctypes.c_int] | type[ctypes.c_int64] | type[ctypes.c_float] | type[ctypes.c_void_p]
# attnkit_abi.h's kinds; a return kind may also be "str" (const char *).
_KINDS: Mapping[str, _CType] = {
    "i32": ctypes.c_int,
    "i64": ctypes.c_int64,
    "f32": ctypes.c_float,
    "ptr": ctypes.c_void_p,
}
_ENTRIES: dict[str, Entry] = {}


class Entry:
    """A native function as a Python wrapper calls it: ``name`` (without the
    ``attnkit_`` prefix), the parameter names in the order the wrapper passes them, and
    the error names it reads. Creating one registers it; every registered entry is
    checked against the library's ABI table when the library loads.
    """

    __slots__ = ("errors", "name", "params")

    def __init__(self, name: str, params: str, errors: str = "") -> None:
        self.name = name
        self.params = tuple(params.split())
        self.errors = tuple(errors.split())
        _ENTRIES[name] = self

    def of(self, lib: NativeLibrary) -> Callable[..., int]:
        """This function in a loaded library (checked against this entry at its load)."""
        return lib.functions[self.name]


@dataclass(frozen=True)
class NativeLibrary:
    """The loaded kernel library, where it came from and why it was chosen."""

    path: Path
    origin: Literal["prebuilt", "compiled"]
    variant: str
    """The prebuilt variant (``x86-64-v3``, ...) or the run-time build's flags."""
    why: str
    """Why this library was loaded (and what was passed over), for ``attnkit backends``."""
    openmp_runtime: str | None
    """The OpenMP runtime file its calls resolved to; ``None``: built without OpenMP."""
    functions: Mapping[str, Callable[..., int]]
    errors: Mapping[int, str]
    """Error code -> name (``attnkit_abi.h``)."""
    _strings: Mapping[str, Callable[..., bytes]] = field(repr=False)

    @property
    def has_openmp(self) -> bool:
        return self.openmp_runtime is not None

    @property
    def prefill_isa(self) -> str:
        """The instruction set whose copy of the prefill compute runs (chosen at each
        call from the CPU; ``ATTNKIT_CPU_ISA`` caps it)."""
        return self._strings["prefill_isa"]().decode()

    def decode_isa(self, dtype_code: int, head_size: int) -> str:
        """The instruction set of the decode's copy for a dtype code (0 float32, 1 bf16,
        2 fp16) and head size: ``amxbf16``, ``avx512bf16``, or ``vector8`` (8-lane
        vectors as the build's baseline lowers them)."""
        return self._strings["decode_isa"](dtype_code, head_size).decode()

    def error_name(self, code: int) -> str:
        """The name of an error code (``"?"`` for one the table lacks)."""
        return self.errors.get(code, "?")

    def describe(self) -> str:
        """One line: which library, from where, with which OpenMP runtime."""
        omp = self.openmp_runtime
        threads = f"OpenMP runtime {omp}" if omp else "no OpenMP (one thread)"
        return f"{self.origin} {self.variant} library {self.path} ({self.why}); {threads}"


class _BuildError(Exception):
    """Why a library could not be built or loaded (the text of native_problem)."""


# ---------------------------------------------------------------- the ABI table


def _table(lib: ctypes.CDLL, path: Path) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """The library's function table: name -> (return kind, [(kind, name), ...])."""
    try:
        fn = lib.attnkit_abi_table
    except AttributeError as exc:
        raise _BuildError(f"{path} exports no attnkit_abi_table (an older library)") from exc
    fn.argtypes = []
    fn.restype = ctypes.c_char_p
    raw = fn()
    if not isinstance(raw, bytes):
        raise _BuildError(f"{path}: attnkit_abi_table returned no text")
    table: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    for line in raw.decode().splitlines():
        parts = line.split()
        if len(parts) not in (2, 3):
            raise _BuildError(f"{path}: malformed ABI table line {line!r}")
        params = [tuple(p.split(":", 1)) for p in parts[2].split(",")] if len(parts) == 3 else []
        table[parts[0]] = (parts[1], [(p[0], p[1]) for p in params if len(p) == 2])
    return table


def _errors(text: bytes) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in text.decode().splitlines():
        code, name = line.split()[:2]
        out[int(code)] = name
    return out


def _bind(
    lib: ctypes.CDLL, path: Path, name: str, ret: str, params: list[tuple[str, str]]
) -> Callable[..., Any]:
    try:
        fn = lib[f"attnkit_{name}"]
    except AttributeError as exc:
        raise _BuildError(f"{path}: its ABI table lists attnkit_{name}, which it lacks") from exc
    unknown = [f"{k}:{n}" for k, n in params if k not in _KINDS] + (
        [] if ret == "str" or ret in _KINDS else [f"return {ret}"]
    )
    if unknown:
        raise _BuildError(f"{path}: attnkit_{name} has unknown ABI kinds {unknown}")
    fn.argtypes = [_KINDS[kind] for kind, _ in params]
    fn.restype = ctypes.c_char_p if ret == "str" else _KINDS[ret]
    return fn


_Table = Mapping[str, tuple[str, list[tuple[str, str]]]]


def _check_entries(table: _Table, errors: Mapping[int, str], path: Path) -> None:
    for module in _WRAPPERS:
        importlib.import_module(module)
    names = set(errors.values())
    for entry in _ENTRIES.values():
        if entry.name not in table:
            raise _BuildError(f"{path} has no attnkit_{entry.name}, which its wrapper calls")
        have = [name for _, name in table[entry.name][1]]
        if have != list(entry.params):
            where = next(
                (i for i, (a, b) in enumerate(zip(have, entry.params, strict=False)) if a != b),
                min(len(have), len(entry.params)),
            )
            theirs = have[where] if where < len(have) else "(no parameter)"
            ours = entry.params[where] if where < len(entry.params) else "(no parameter)"
            raise _BuildError(
                f"{path}: attnkit_{entry.name} takes {len(have)} parameters and its wrapper "
                f"passes {len(entry.params)}; parameter {where} is {theirs!r} in the library "
                f"but {ours!r} in the wrapper (the library and the Python wrappers are from "
                "different versions)"
            )
        missing = [e for e in entry.errors if e not in names]
        if missing:
            raise _BuildError(
                f"{path} lacks the error codes {', '.join(missing)} that the wrapper of "
                f"attnkit_{entry.name} reads"
            )


# ---------------------------------------------------------------- OpenMP


def _mappings() -> list[tuple[int, int, str]]:
    """This process's mappings (``/proc/self/maps``): start, end and file (``""`` for an
    anonymous one). Raises OSError where there is no such file."""
    found: list[tuple[int, int, str]] = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            low, _, high = fields[0].partition("-")
            path = fields[5].strip() if len(fields) == 6 else ""
            found.append((int(low, 16), int(high, 16), path))
    return found


def _torch_openmp() -> str | None:
    """The OpenMP runtime torch loaded (a mapped ``lib*omp*.so*``; torch's own first)."""
    import torch

    torch_dir = str(Path(torch.__file__).resolve().parent)
    try:
        paths = {path for _, _, path in _mappings() if "omp" in path and "/" in path}
    except OSError:
        return None
    found = sorted(
        p for p in paths if re.fullmatch(r"lib(g|i|)omp[\w.-]*\.so[\w.]*", os.path.basename(p))
    )
    found.sort(key=lambda p: not p.startswith(torch_dir))
    return found[0] if found else None


def _mapped_file(address: int) -> str:
    """The file mapped at ``address`` in this process (``"?"`` where the mappings cannot
    be read or nothing file-backed is mapped there)."""
    try:
        return next((p for low, high, p in _mappings() if low <= address < high), "") or "?"
    except (OSError, ValueError):
        return "?"


def _openmp_runtime() -> tuple[str | None, str]:
    """Make an OpenMP runtime global before a library loads: torch's, else the system's
    libgomp. Returns its path (``None``: none found) and a note on the choice."""
    path = _torch_openmp()
    note = "torch's OpenMP runtime"
    if path is None:
        path = ctypes.util.find_library("gomp")
        note = "the system's libgomp (torch loaded no OpenMP runtime)"
    if path is None:
        return None, "no OpenMP runtime found"
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        return None, f"loading the OpenMP runtime {path} failed ({exc})"
    return path, note


# ---------------------------------------------------------------- loading


def _load(path: Path, origin: Literal["prebuilt", "compiled"], why: str) -> NativeLibrary:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise _BuildError(f"loading {path} failed: {exc}") from exc
    table = _table(lib, path)
    fns = {name: _bind(lib, path, name, ret, params) for name, (ret, params) in table.items()}
    for name, ret in (("abi_errors", "str"), ("build_variant", "str"), ("has_openmp", "i32"),
                      ("openmp_entry", "ptr"), ("prefill_isa", "str"), ("decode_isa", "str")):  # fmt: skip
        if table.get(name, ("",))[0] != ret:
            raise _BuildError(f"{path}: attnkit_{name} missing or not returning {ret}")
    errors = _errors(fns["abi_errors"]())
    _check_entries(table, errors, path)
    omp: str | None = None
    if fns["has_openmp"]():
        entry = fns["openmp_entry"]()
        omp = _mapped_file(entry) if isinstance(entry, int) else "?"
    return NativeLibrary(
        path=path,
        origin=origin,
        variant=fns["build_variant"]().decode(),
        why=why,
        openmp_runtime=omp,
        functions={n: f for n, f in fns.items() if table[n][0] == "i32"},
        errors=errors,
        _strings={n: f for n, f in fns.items() if table[n][0] == "str"},
    )


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features"):
                    return line.strip()
    except OSError:
        pass
    return ""


def _hash_of(path: Path) -> str:
    """The source hash a library file was built from (``"unknown"`` when it exports
    none); :class:`_BuildError` when it does not load."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise _BuildError(f"loading {path} failed: {exc}") from exc
    fn = getattr(lib, "attnkit_source_hash", None)
    if fn is None:
        return "unknown"
    fn.argtypes = []
    fn.restype = ctypes.c_char_p
    raw = fn()
    return raw.decode() if isinstance(raw, bytes) else "unknown"


def _prebuilt() -> NativeLibrary:
    """The best packaged library this CPU runs, or :class:`_BuildError` saying why none."""
    machine = platform.machine()
    flags = _cpu_flags().split(":", 1)[-1].split()
    runnable = cpu_native_build.runnable_variants(machine, flags)
    packaged = {
        v.name: file
        for v in cpu_native_build.VARIANTS
        if (file := _PREBUILT_DIR / cpu_native_build.prebuilt_name(v)).is_file()
    }
    if not packaged:
        raise _BuildError("no prebuilt library is packaged (a source install)")
    want = cpu_native_build.source_hash(_DIR)
    passed: list[str] = []
    for variant in runnable:
        path = packaged.get(variant.name)
        if path is None:
            continue
        try:
            built_from = _hash_of(path)
        except _BuildError as exc:
            passed.append(str(exc))
            continue
        if built_from != want:
            passed.append(
                f"{path.name} is stale (built from sources {built_from}, installed {want})"
            )
            continue
        why = f"the best packaged variant this {machine} CPU runs"
        if passed:
            why += "; passed over: " + "; ".join(passed)
        return _load(path, "prebuilt", why)
    if not passed:
        passed.append(
            f"none of the packaged variants ({', '.join(packaged)}) runs on this {machine} CPU"
        )
    raise _BuildError("; ".join(passed))


def _cache_dir() -> Path:
    root = os.environ.get("ATTNKIT_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "attnkit"
    return base / "cpu-kernels"


def _find_compiler() -> str | None:
    env = os.environ.get("CC", "").strip()
    if env:
        found = shutil.which(env)
        if found is None:
            raise _BuildError(f"CC={env!r} is not an executable on PATH")
        return found
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found is not None:
            return found
    return None


def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30.0, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise _BuildError(f"C compiler {compiler!r} does not run: {exc}") from exc
    return done.stdout + done.stderr


def _compile_into(compiler: str, target: Path, openmp: bool) -> tuple[str, ...]:
    """Build with the first flag set that works; the flags kept."""
    errors: list[str] = []
    for flags in _FLAG_SETS:
        try:
            cpu_native_build.compile_library(
                compiler, _DIR, target, flags,
                variant=" ".join(flags) or "baseline", openmp=openmp, defines=_DEFINES,
            )  # fmt: skip
        except cpu_native_build.BuildFailed as exc:
            errors.append(str(exc))
            continue
        return flags
    raise _BuildError(
        f"C compiler {compiler!r} failed to build {', '.join(cpu_native_build.SOURCES)} ("
        + "; ".join(errors[:1])
        + ")"
    )


def _build(why: str = "compiled at first use", *, openmp: bool | None = None) -> NativeLibrary:
    """The run-time build: compile here (or load the cached build). ``openmp``: whether
    an OpenMP runtime was made global (``None``: find out here)."""
    for name in (*cpu_native_build.SOURCES, *cpu_native_build.HEADERS):
        if not (_DIR / name).is_file():
            raise _BuildError(f"the kernel source {_DIR / name} is missing from the installation")
    compiler = _find_compiler()
    if compiler is None:
        raise _BuildError("no C compiler found (set CC, or install cc, gcc or clang)")
    if openmp is None:
        openmp = _openmp_runtime()[0] is not None
    key = hashlib.sha256()
    for part in (
        cpu_native_build.source_hash(_DIR).encode(),
        compiler.encode(),
        _compiler_version(compiler).encode(),
        repr((cpu_native_build.BASE_FLAGS, _FLAG_SETS, _DEFINES, openmp)).encode(),
        platform.machine().encode(),
        _cpu_flags().encode(),
    ):
        key.update(len(part).to_bytes(8, "little"))
        key.update(part)
    target = _cache_dir() / f"paged_decode-{key.hexdigest()[:24]}.so"
    if target.is_file():
        try:
            return _load(target, "compiled", why)
        except _BuildError as exc:  # a damaged cache entry: rebuild it below
            _LOG.warning("attnkit: reloading cached %s failed (%s); rebuilding", target, exc)
    start = time.perf_counter()
    try:
        flags = _compile_into(compiler, target, openmp)
    except OSError as exc:  # an unwritable cache directory: build in a private one
        _LOG.warning(
            "attnkit: cannot write %s (%s); building in a temporary directory", target, exc
        )
        target = Path(tempfile.mkdtemp(prefix="attnkit-cpu-kernels-")) / target.name
        flags = _compile_into(compiler, target, openmp)
    _LOG.info(
        "attnkit: compiled %s with %s %s in %.2f s -> %s",
        ", ".join(cpu_native_build.SOURCES),
        compiler,
        " ".join(flags),
        time.perf_counter() - start,
        target,
    )
    return _load(target, "compiled", why)


def _select() -> NativeLibrary:
    """The library ``ATTNKIT_CPU_LIBRARY`` asks for (``auto``: prebuilt, else compiled)."""
    mode = os.environ.get(_MODE_ENV, "").strip().lower() or "auto"
    if mode not in _MODES:
        raise _BuildError(
            f"{_MODE_ENV}={os.environ[_MODE_ENV]!r} is not one of {', '.join(_MODES)}"
        )
    runtime, omp_note = _openmp_runtime()
    openmp = runtime is not None
    if mode == "compile" or _DEFINES:
        why = f"{_MODE_ENV}=compile" if mode == "compile" else "a test build"
        lib = _build(why, openmp=openmp)
    elif mode == "prebuilt":
        lib = _prebuilt()
    else:
        try:
            lib = _prebuilt()
        except _BuildError as exc:
            try:
                lib = _build(f"compiled at first use: {exc}", openmp=openmp)
            except _BuildError as failed:
                raise _BuildError(f"{failed}; and no prebuilt library fits: {exc}") from failed
    resolved = lib.openmp_runtime
    if resolved and runtime and os.path.realpath(resolved) != os.path.realpath(runtime):
        _LOG.warning(
            "attnkit: the native library's OpenMP calls resolved to %s, not %s (%s)",
            resolved, runtime, omp_note,
        )  # fmt: skip
    return lib


_LOCK = threading.Lock()
_STATE: list[NativeLibrary | str] = []  # filled once: the library or the problem


def _state() -> NativeLibrary | str:
    if not _STATE:
        with _LOCK:
            if not _STATE:
                try:
                    _STATE.append(_select())
                except _BuildError as exc:
                    _STATE.append(str(exc))
    return _STATE[0]


def native_problem() -> str | None:
    """Why the native CPU kernels cannot be used here, or ``None`` when they can.

    Finds (or builds) the library on first call; the answer is cached for the process.
    """
    state = _state()
    return state if isinstance(state, str) else None


def load_paged_decode() -> NativeLibrary:
    """The loaded library; :class:`RuntimeError` with :func:`native_problem`'s text when
    none can be loaded."""
    state = _state()
    if isinstance(state, str):
        raise RuntimeError(f"attnkit native CPU kernels are unavailable: {state}")
    return state
