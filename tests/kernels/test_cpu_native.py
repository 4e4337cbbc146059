"""How the native CPU kernels are found, built and loaded: the ABI table checked at load,
prebuilt variants chosen by the CPU (and stale ones refused), the run-time build as the
fallback, and torch's OpenMP runtime."""

from __future__ import annotations

import ctypes
import math
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnkit.kernels.attention import cpu_native as _native
from attnkit.kernels.attention import cpu_native_build
from attnkit.kernels.attention.cpu_decode import paged_attention_requests

_COMPILER = shutil.which(os.environ.get("CC", "") or "cc") or shutil.which("gcc")
needs_compiler = pytest.mark.skipif(_COMPILER is None, reason="needs a C compiler")
_MACHINE = platform.machine()
_VARIANTS = [v for v in cpu_native_build.VARIANTS if v.machine == _MACHINE]
needs_variant = pytest.mark.skipif(not _VARIANTS, reason=f"no prebuilt variant for {_MACHINE}")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A fresh process's view: nothing loaded, an empty cache and no prebuilt library;
    returns the (empty) prebuilt directory."""
    prebuilt = tmp_path / "prebuilt"
    prebuilt.mkdir()
    monkeypatch.setattr(_native, "_STATE", [])
    monkeypatch.setattr(_native, "_PREBUILT_DIR", prebuilt)
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ATTNKIT_CPU_LIBRARY", raising=False)
    return prebuilt


def _prebuild(directory: Path, variant: cpu_native_build.Variant, source: Path | None = None) -> Path:
    """Build a variant as setup.py does, under the name the loader looks for."""
    assert _COMPILER is not None
    target = directory / cpu_native_build.prebuilt_name(variant)
    cpu_native_build.compile_library(
        _COMPILER, source or _native._DIR, target, variant.flags, variant=variant.name
    )
    return target


def _decode_matches_oracle() -> None:
    """One decode step of three requests through the loaded library, against float64."""
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, bs, lens = 4, 2, 64, 8, [5, 17, 30]
    nb = 1 + sum(-(-n // bs) for n in lens)
    k = torch.randn(nb * bs, hkv, d, generator=gen)
    v = torch.randn(nb * bs, hkv, d, generator=gen)
    k[:bs] = v[:bs] = math.nan  # block 0: never in a table
    table = torch.zeros(len(lens), 4, dtype=torch.int32)
    nxt = 1
    for r, n in enumerate(lens):
        for c in range(-(-n // bs)):
            table[r, c] = nxt
            nxt += 1
    q = torch.randn(len(lens), hq, d, generator=gen)
    out = torch.empty_like(q)
    paged_attention_requests(
        q, k, v, table, torch.arange(len(lens) + 1, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32), None, block_size=bs, causal=True,
        window=None, chunk=None, scale=d**-0.5, output=out,
    )  # fmt: skip
    for r, n in enumerate(lens):
        pos = torch.arange(n)
        rows = table[r].long()[pos // bs] * bs + pos % bs
        for h in range(hq):
            kk, vv = k[rows, h // 2].double(), v[rows, h // 2].double()
            p = torch.softmax(d**-0.5 * (kk @ q[r, h].double()), 0)
            assert (out[r, h].double() - p @ vv).abs().max().item() < 2e-5, (r, h)


# ---------------------------------------------------------------- the ABI table


def test_the_library_table_types_every_wrapper_call() -> None:
    lib = _native.load_paged_decode()
    for name in ("paged_decode", "paged_decode_requests", "paged_prefill"):
        n = len(_native._ENTRIES[name].params)
        # ctypes counts the signature built from the table: a short call is refused.
        with pytest.raises(TypeError, match=rf"takes at least {n} arguments \(0 given\)"):
            lib.functions[name]()
    assert lib.errors[7] == "NOMEM"
    assert lib.errors[1] == "ROW"
    # The header's error list, read here independently of the library's text.
    header = (_native._DIR / "attnkit_abi.h").read_text()
    assert "X(10, SEQ," in header
    assert lib.errors[10] == "SEQ"


def test_a_wrapper_passing_parameters_in_another_order_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entry = _native._ENTRIES["paged_decode"]
    table = {n: ("i32", [("i64", p) for p in e.params]) for n, e in _native._ENTRIES.items()}
    errors = {1: "ROW", 2: "REQUEST", 3: "KEY_START", 4: "KEY_END", 5: "RANGE", 6: "BLOCK",
              7: "NOMEM", 9: "QSL", 10: "SEQ"}  # fmt: skip
    _native._check_entries(table, errors, Path("lib.so"))  # the wrappers as they are
    swapped = list(entry.params)
    i = swapped.index("k_sr")
    swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
    monkeypatch.setattr(entry, "params", tuple(swapped))
    with pytest.raises(
        _native._BuildError, match=r"parameter 8 is 'k_sr' in the library but 'k_sh'"
    ):
        _native._check_entries(table, errors, Path("lib.so"))
    monkeypatch.setattr(entry, "params", tuple(swapped[:-1]))
    with pytest.raises(_native._BuildError, match=r"takes 43 parameters and its wrapper passes 42"):
        _native._check_entries(table, errors, Path("lib.so"))


def test_a_wrapper_reading_an_unknown_error_name_is_refused() -> None:
    entry = _native._ENTRIES["paged_decode_requests"]
    table = {n: ("i32", [("i64", p) for p in e.params]) for n, e in _native._ENTRIES.items()}
    errors = {
        1: "ROW",
        2: "REQUEST",
        4: "KEY_END",
        6: "BLOCK",
        7: "NOMEM",
        9: "QSL",
        3: "KEY_START",
        5: "RANGE",
    }  # fmt: skip  -- SEQ missing
    with pytest.raises(
        _native._BuildError,
        match=rf"lacks the error codes SEQ that the wrapper of attnkit_{entry.name}",
    ):
        _native._check_entries(table, errors, Path("lib.so"))


def test_a_mismatched_wrapper_makes_the_library_unavailable_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, fresh: Path
) -> None:
    entry = _native._ENTRIES["paged_prefill"]
    monkeypatch.setattr(entry, "params", (*entry.params, "extra"))
    problem = _native.native_problem()
    n = len(entry.params)
    assert problem is not None
    assert (
        f"paged_prefill takes {n - 1} parameters and its wrapper "
        f"passes {n}; parameter {n - 1} is '(no parameter)' in the library but 'extra'" in problem
    )


# ---------------------------------------------------------------- prebuilt libraries


def test_variants_follow_the_cpu_flags() -> None:
    v3 = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "sse4_2", "popcnt")
    assert [v.name for v in cpu_native_build.runnable_variants("x86_64", v3)] == ["x86-64-v3", "x86-64"]
    assert [v.name for v in cpu_native_build.runnable_variants("x86_64", v3[1:])] == ["x86-64"]
    assert [v.name for v in cpu_native_build.runnable_variants("aarch64", ())] == ["armv8-a"]
    assert cpu_native_build.runnable_variants("riscv64", v3) == []


@needs_compiler
@needs_variant
def test_a_prebuilt_library_loads_without_a_compiler(
    monkeypatch: pytest.MonkeyPatch, fresh: Path
) -> None:
    variant = _VARIANTS[-1]  # the baseline: every CPU of this machine type runs it
    path = _prebuild(fresh, variant)
    monkeypatch.setenv("CC", "attnkit-no-such-compiler")
    assert _native.native_problem() is None
    lib = _native.load_paged_decode()
    assert (lib.origin, lib.variant, lib.path) == ("prebuilt", variant.name, path)
    _decode_matches_oracle()


@needs_compiler
@needs_variant
def test_the_best_runnable_variant_is_chosen(monkeypatch: pytest.MonkeyPatch, fresh: Path) -> None:
    for variant in _VARIANTS:
        _prebuild(fresh, variant)
    flags = _native._cpu_flags().split(":", 1)[-1].split()
    runnable = cpu_native_build.runnable_variants(_MACHINE, flags)
    assert _native.load_paged_decode().variant == runnable[0].name
    # A CPU without the better variant's flags gets the baseline.
    monkeypatch.setattr(_native, "_STATE", [])
    monkeypatch.setattr(_native, "_cpu_flags", lambda: "flags\t\t: fpu")
    assert _native.load_paged_decode().variant == _VARIANTS[-1].name
    _decode_matches_oracle()


@needs_compiler
@needs_variant
def test_a_stale_prebuilt_library_is_not_loaded(
    monkeypatch: pytest.MonkeyPatch, fresh: Path, tmp_path: Path
) -> None:
    # Built from other sources (one comment changed): what an edited checkout holds.
    other = tmp_path / "other-sources"
    other.mkdir()
    for name in (*cpu_native_build.SOURCES, *cpu_native_build.HEADERS):
        shutil.copy(_native._DIR / name, other / name)
    with open(other / "paged_decode.c", "a") as f:
        f.write("\n/* an edit */\n")
    stale = _prebuild(fresh, _VARIANTS[-1], source=other)
    lib = _native.load_paged_decode()
    assert lib.origin == "compiled"
    assert lib.path != stale
    assert f"{stale.name} is stale (built from sources" in lib.why
    # Asked for prebuilt only, the stale one is refused, not loaded.
    monkeypatch.setattr(_native, "_STATE", [])
    monkeypatch.setenv("ATTNKIT_CPU_LIBRARY", "prebuilt")
    problem = _native.native_problem()
    assert problem is not None
    assert "is stale" in problem


def test_modes(monkeypatch: pytest.MonkeyPatch, fresh: Path) -> None:
    monkeypatch.setenv("ATTNKIT_CPU_LIBRARY", "fastest")
    assert _native.native_problem() == (
        "ATTNKIT_CPU_LIBRARY='fastest' is not one of auto, prebuilt, compile"
    )
    monkeypatch.setattr(_native, "_STATE", [])
    monkeypatch.setenv("ATTNKIT_CPU_LIBRARY", "prebuilt")
    assert _native.native_problem() == "no prebuilt library is packaged (a source install)"
    monkeypatch.setattr(_native, "_STATE", [])
    monkeypatch.setenv("CC", "attnkit-no-such-compiler")
    monkeypatch.setenv("ATTNKIT_CPU_LIBRARY", "auto")
    assert _native.native_problem() == (
        "CC='attnkit-no-such-compiler' is not an executable on PATH; and no prebuilt "
        "library fits: no prebuilt library is packaged (a source install)"
    )


@needs_compiler
@needs_variant
def test_the_install_built_the_prebuilt_libraries() -> None:
    """setup.py builds every variant of this machine into the package (pip install -e .
    builds them in place); the loader takes one of them unless told otherwise."""
    names = sorted(p.name for p in _native._DIR.glob("_native.*.so"))
    assert cpu_native_build.prebuilt_name(_VARIANTS[-1]) in names, names


_GLIBC_X86 = (
    sys.platform.startswith("linux")
    and _MACHINE == "x86_64"
    and platform.libc_ver()[0] == "glibc"
    and shutil.which("readelf") is not None
)
needs_glibc_x86 = pytest.mark.skipif(
    not _GLIBC_X86, reason="the pins are glibc x86-64's; the check reads readelf -V"
)


@needs_glibc_x86
def test_the_prebuilt_libraries_need_no_newer_glibc_than_the_floor() -> None:
    """The wheel's libraries load on glibc 2.17 (manylinux2014): the newest symbol
    version each asks for is at most the floor, whatever this machine's glibc is."""
    built = sorted(_native._DIR.glob("_native.*.so"))
    assert built
    for library in built:
        needs = cpu_native_build.required_glibc(library)
        assert needs is not None, library  # memcpy and friends: some version is needed
        assert needs <= cpu_native_build.GLIBC_FLOOR, (library.name, needs)


@needs_glibc_x86
@needs_compiler
def test_a_build_without_the_pins_is_caught(tmp_path: Path) -> None:
    """The check's broken variant: without attnkit_abi.h's pins, expf and logf bind to
    glibc 2.27's versions (this machine's glibc is newer), and the check sees it."""
    assert _COMPILER is not None
    if tuple(map(int, platform.libc_ver()[1].split(".")[:2])) < (2, 27):
        pytest.skip("this glibc predates expf's 2.27 version: nothing to pin")
    variant = _VARIANTS[-1]
    target = tmp_path / cpu_native_build.prebuilt_name(variant)
    cpu_native_build.compile_library(
        _COMPILER, _native._DIR, target, variant.flags, variant=variant.name,
        defines=("ATTNKIT_TEST_NO_GLIBC_PINS",),
    )  # fmt: skip
    needs = cpu_native_build.required_glibc(target)
    assert needs is not None
    assert needs >= (2, 27) > cpu_native_build.GLIBC_FLOOR


def test_required_glibc_reads_the_version_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The newest GLIBC_x.y in readelf's version-needs listing (numerically: 2.34 over
    2.4); None with none listed or without readelf."""
    listing = (
        "Version needs section '.gnu.version_r' contains 2 entries:\n"
        "  000000: Version: 1  File: libm.so.6  Cnt: 1\n"
        "  0x0010:   Name: GLIBC_2.4  Flags: none  Version: 3\n"
        "  0x0020: Version: 1  File: libc.so.6  Cnt: 2\n"
        "  0x0030:   Name: GLIBC_2.34  Flags: none  Version: 4\n"
        "  0x0040:   Name: GLIBC_2.2.5  Flags: none  Version: 2\n"
    )

    def run(out: str) -> object:
        return lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=out, stderr="")

    monkeypatch.setattr(cpu_native_build.subprocess, "run", run(listing))
    assert cpu_native_build.required_glibc(Path("x.so")) == (2, 34)
    monkeypatch.setattr(cpu_native_build.subprocess, "run", run("no version info\n"))
    assert cpu_native_build.required_glibc(Path("x.so")) is None

    def missing(*a: object, **k: object) -> object:
        raise FileNotFoundError("readelf")

    monkeypatch.setattr(cpu_native_build.subprocess, "run", missing)
    assert cpu_native_build.required_glibc(Path("x.so")) is None


# ---------------------------------------------------------------- OpenMP


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_openmp_is_torchs_runtime() -> None:
    lib = _native.load_paged_decode()
    torch_omp = _native._torch_openmp()
    assert torch_omp is not None
    assert lib.openmp_runtime is not None
    assert os.path.realpath(lib.openmp_runtime) == os.path.realpath(torch_omp)
    if shutil.which("readelf"):
        needed = subprocess.run(
            ["readelf", "-d", str(lib.path)], capture_output=True, text=True, check=True
        ).stdout
        assert "omp" not in needed, needed  # the library links no OpenMP runtime itself


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_library_resolving_to_another_openmp_runtime_is_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The check's broken case: the runtime the library's calls resolved to is not the
    one the loader made global (here the loader is told torch's is elsewhere)."""
    torch_omp, _ = _native._openmp_runtime()  # made global for real, as any load does
    assert torch_omp is not None
    monkeypatch.setattr(_native, "_STATE", [])
    monkeypatch.setattr(_native, "_torch_openmp", lambda: torch_omp + ".elsewhere")
    monkeypatch.setattr(_native.ctypes, "CDLL", _cdll_except(torch_omp + ".elsewhere"))
    with caplog.at_level("WARNING", logger=_native.__name__):
        lib = _native.load_paged_decode()
    assert lib.openmp_runtime is not None
    assert os.path.realpath(lib.openmp_runtime) == os.path.realpath(torch_omp)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"resolved to {lib.openmp_runtime}, not {torch_omp}.elsewhere" in warning


def _cdll_except(fake: str) -> object:
    real = ctypes.CDLL

    def cdll(name: str, *args: object, **kwargs: object) -> object:
        if name == fake:
            return None  # "loaded": the real runtime stays the one in use
        return real(name, *args, **kwargs)  # type: ignore[arg-type]  # ctypes' own signature

    return cdll
