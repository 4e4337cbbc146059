"""Build, cache and load the native CPU kernels (``paged_decode.c``, ``paged_prefill.c``
with the compute it includes per instruction set, ``paged_prefill_body.h``).

The C sources ship with the package and are compiled once per machine with the system C
compiler (``$CC``, else ``cc``, ``gcc``, ``clang`` on ``PATH``) into a shared library
cached under ``$ATTNKIT_CACHE_DIR/cpu-kernels/`` (default ``~/.cache/attnkit/
cpu-kernels/``). The file name carries a hash of everything the binary depends on: the
source bytes, the compiler (path and ``--version``), the flags, ``platform.machine()`` and
the CPU feature flags of ``/proc/cpuinfo`` (``-march=native`` code must not be reused on
a CPU with fewer features). The prefill's compute is built once per instruction set in
the same library and chosen at run time from what the CPU reports
(:attr:`NativeLibrary.prefill_isa`). The library is written to a temporary file and moved in
place with :func:`os.replace`, so processes compiling at once never load a partial file.

:func:`native_problem` says why the kernels cannot be used (no compiler, the compiler
failed: the first lines of its error output) or ``None``; :func:`load_paged_decode`
returns the loaded library or raises :class:`RuntimeError` with that text.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NativeLibrary", "load_paged_decode", "native_problem"]

_LOG = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode.c")
_SOURCES = (_SOURCE, _SOURCE.with_name("paged_prefill.c"))
# Hashed into the cache key with the sources: headers they include, not compiled alone.
_HEADERS = tuple(
    _SOURCE.with_name(name)
    for name in (
        "paged_prefill_body.h",
        "paged_decode_body.h",
        "paged_decode_amx.h",
        "half_float.h",
    )
)
_BASE_FLAGS = ("-O3", "-fPIC", "-shared")
# Tried in order: the first set the compiler accepts is kept. -march=native tunes for
# this CPU (hence the CPU flags in the cache key); -fopenmp enables the threaded path.
_FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-march=native", "-fopenmp"),
    ("-march=native",),
    (),
)
_ABI_VERSION = 6
_COMPILE_TIMEOUT_S = 120.0
_STDERR_LINES = 8

_i64 = ctypes.c_int64
_i32 = ctypes.c_int
_ptr = ctypes.c_void_p
_f32 = ctypes.c_float

_ArgType = type[ctypes.c_int64] | type[ctypes.c_int] | type[ctypes.c_void_p] | type[ctypes.c_float]

# The entry points' parameters, in order (see paged_decode.c). Both start with the same
# arguments (decode.py's _lead_args) and end with the same tail.
_LEAD: list[_ArgType] = [
    _i32,  # dtype
    _i32, _ptr, _ptr,  # kv_dtype, k_scale, v_scale
    _ptr, _i64, _i64,  # query, q_st, q_sh
    _ptr, _i64, _i64,  # k_plane, k_sr, k_sh
    _ptr, _i64, _i64,  # v_plane, v_sr, v_sh
    _ptr, _i64, _i64, _i64, _i64,  # block_table, bt_sb, B, W, R
]  # fmt: skip
_TAIL: list[_ArgType] = [
    _f32, _f32, _ptr,  # scale, soft_cap, alibi
    _ptr, _ptr, _i64, _i64,  # sinks, lse, lse_st, lse_sh
    _ptr, _i64, _i64,  # output, o_st, o_sh
    _i32,  # num_threads
    _ptr,  # err (int64[3])
]  # fmt: skip
# attnkit_paged_decode
_PAGED_DECODE_ARGTYPES: list[_ArgType] = [
    *_LEAD,
    _ptr, _ptr, _ptr, _ptr, _ptr,  # rows, requests, key_start, key_end, query_pos
    _i64, _i64, _i64, _i64, _i64, _i64,  # N, T, Hq, Hkv, D, block_size
    _i64, _i64,  # pos_mul, pos_add
    *_TAIL,
]  # fmt: skip
# attnkit_paged_prefill
_PAGED_PREFILL_ARGTYPES: list[_ArgType] = [
    *_LEAD,
    _ptr, _i64, _i64, _ptr, _i64, _i64,  # key, kd_sr, kd_sh, value, vd_sr, vd_sh
    _ptr, _ptr, _ptr, _ptr, _ptr, _i64,  # requests, query_start, query_len, seq_len, dense, n
    _i64, _i64, _i64, _i64, _i64,  # T, Hq, Hkv, D, block_size
    _i32, _i64, _i64, _i64,  # causal, window, chunk, query_block
    *_TAIL,
]  # fmt: skip
# attnkit_paged_decode_requests
_PAGED_DECODE_REQUESTS_ARGTYPES: list[_ArgType] = [
    *_LEAD,
    _ptr, _ptr, _ptr, _i64,  # query_start_loc, seq_lens, requests, n
    _i64, _i64, _i64, _i64, _i64,  # T, Hq, Hkv, D, block_size
    _i32, _i64, _i64,  # causal, window, chunk
    *_TAIL,
]  # fmt: skip


@dataclass(frozen=True)
class NativeLibrary:
    """The loaded kernel library and how it was built."""

    path: Path
    paged_decode: Callable[..., int]
    paged_decode_requests: Callable[..., int]
    paged_prefill: Callable[..., int]
    has_openmp: bool
    _prefill_isa: Callable[[], bytes]
    _decode_isa: Callable[[int, int], bytes]

    @property
    def prefill_isa(self) -> str:
        """The instruction set whose copy of the prefill compute runs (chosen at each
        call from the CPU; ``ATTNKIT_CPU_ISA`` caps it)."""
        return self._prefill_isa().decode()

    def decode_isa(self, dtype_code: int, head_size: int) -> str:
        """The instruction set of the decode's copy for a dtype code (0 float32, 1 bf16,
        2 fp16) and head size: ``avx512bf16``, ``avx512``, or ``vector8`` (8-lane
        vectors as the build flags lower them)."""
        return self._decode_isa(dtype_code, head_size).decode()


class _BuildError(Exception):
    """Why the library could not be built or loaded (the text of native_problem)."""


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


def _first_lines(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    shown = "\n".join(lines[:_STDERR_LINES])
    return shown if shown else "(no output)"


def _compile(compiler: str, sources: tuple[Path, ...], target: Path) -> tuple[str, ...]:
    """Compile to ``target`` (atomically) with the first flag set that works."""
    target.parent.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    for extra in _FLAG_SETS:
        flags = (*_BASE_FLAGS, *extra)
        fd, tmp_name = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.stem}-", suffix=".so.tmp"
        )
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            cmd = [compiler, *flags, *(str(s) for s in sources), "-o", str(tmp), "-lm"]
            try:
                done = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, check=False
                )
            except (OSError, subprocess.SubprocessError) as exc:
                errors.append(f"{' '.join(flags)}: {exc}")
                continue
            if done.returncode != 0:
                errors.append(f"{' '.join(flags)}:\n{_first_lines(done.stderr or done.stdout)}")
                continue
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
            return flags
        finally:
            if tmp.exists():
                tmp.unlink()
    raise _BuildError(
        f"C compiler {compiler!r} failed to build {', '.join(s.name for s in sources)} ("
        + "; ".join(errors[:1])
        + ")"
    )


def _load(path: Path) -> NativeLibrary:
    lib = ctypes.CDLL(str(path))
    abi = lib.attnkit_abi_version
    abi.argtypes = []
    abi.restype = ctypes.c_int
    if abi() != _ABI_VERSION:
        raise _BuildError(f"{path}: ABI version {abi()} is not {_ABI_VERSION}")
    has_openmp = lib.attnkit_has_openmp
    has_openmp.argtypes = []
    has_openmp.restype = ctypes.c_int
    fn = lib.attnkit_paged_decode
    fn.argtypes = _PAGED_DECODE_ARGTYPES
    fn.restype = ctypes.c_int
    by_request = lib.attnkit_paged_decode_requests
    by_request.argtypes = _PAGED_DECODE_REQUESTS_ARGTYPES
    by_request.restype = ctypes.c_int
    prefill = lib.attnkit_paged_prefill
    prefill.argtypes = _PAGED_PREFILL_ARGTYPES
    prefill.restype = ctypes.c_int
    isa = lib.attnkit_prefill_isa
    isa.argtypes = []
    isa.restype = ctypes.c_char_p
    decode_isa = lib.attnkit_decode_isa
    decode_isa.argtypes = [ctypes.c_int, ctypes.c_int64]
    decode_isa.restype = ctypes.c_char_p
    return NativeLibrary(
        path=path,
        paged_decode=fn,
        paged_decode_requests=by_request,
        paged_prefill=prefill,
        has_openmp=bool(has_openmp()),
        _prefill_isa=isa,
        _decode_isa=decode_isa,
    )


def _build() -> NativeLibrary:
    for src in (*_SOURCES, *_HEADERS):
        if not src.is_file():
            raise _BuildError(f"the kernel source {src} is missing from the installation")
    compiler = _find_compiler()
    if compiler is None:
        raise _BuildError("no C compiler found (set CC, or install cc, gcc or clang)")
    key = hashlib.sha256()
    for part in (
        *(src.read_bytes() for src in (*_SOURCES, *_HEADERS)),
        compiler.encode(),
        _compiler_version(compiler).encode(),
        repr((_BASE_FLAGS, _FLAG_SETS, _ABI_VERSION)).encode(),
        platform.machine().encode(),
        _cpu_flags().encode(),
    ):
        key.update(len(part).to_bytes(8, "little"))
        key.update(part)
    target = _cache_dir() / f"paged_decode-{key.hexdigest()[:24]}.so"
    if target.is_file():
        try:
            return _load(target)
        except OSError as exc:  # a damaged cache entry: rebuild it below
            _LOG.warning("attnkit: reloading cached %s failed (%s); rebuilding", target, exc)
    start = time.perf_counter()
    try:
        flags = _compile(compiler, _SOURCES, target)
    except OSError as exc:  # an unwritable cache directory: build in a private one
        _LOG.warning(
            "attnkit: cannot write %s (%s); building in a temporary directory", target, exc
        )
        target = Path(tempfile.mkdtemp(prefix="attnkit-cpu-kernels-")) / target.name
        flags = _compile(compiler, _SOURCES, target)
    _LOG.info(
        "attnkit: compiled %s with %s %s in %.2f s -> %s",
        ", ".join(s.name for s in _SOURCES),
        compiler,
        " ".join(flags),
        time.perf_counter() - start,
        target,
    )
    try:
        return _load(target)
    except OSError as exc:
        raise _BuildError(f"loading {target} failed: {exc}") from exc


_LOCK = threading.Lock()
_STATE: list[NativeLibrary | str] = []  # filled once: the library or the problem


def _state() -> NativeLibrary | str:
    if not _STATE:
        with _LOCK:
            if not _STATE:
                try:
                    _STATE.append(_build())
                except _BuildError as exc:
                    _STATE.append(str(exc))
    return _STATE[0]


def native_problem() -> str | None:
    """Why the native CPU kernels cannot be used here, or ``None`` when they can.

    Builds (or loads from the cache) the library on first call; the answer is cached for
    the process.
    """
    state = _state()
    return state if isinstance(state, str) else None


def load_paged_decode() -> NativeLibrary:
    """The loaded library; :class:`RuntimeError` with :func:`native_problem`'s text when
    it cannot be built or loaded."""
    state = _state()
    if isinstance(state, str):
        raise RuntimeError(f"attnkit native CPU kernels are unavailable: {state}")
    return state
