"""Build the native CPU kernels' prebuilt libraries into the package.

Everything else about the project is in ``pyproject.toml``. This file only adds one
build step: for each portable variant of this machine
(``src/attnkit/kernels/attention/cpu_native_build.py``: ``x86-64-v3`` and ``x86-64`` on
x86-64, ``armv8-a`` on AArch64; no ``-march=native``), the C kernels are compiled into
``attnkit/kernels/attention/_native.<variant>.so``, which makes the wheel a platform
wheel. At run time the loader takes the best variant the CPU runs and compiles with
``-march=native`` only where none fits.

Without a working C compiler the step is skipped with a warning (the install still
succeeds and compiles at first use, or falls back to ``reference``);
``ATTNKIT_REQUIRE_PREBUILT=1`` makes it an error instead, for wheel builders.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import sys
import types
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

_KERNELS = Path(__file__).resolve().parent / "src" / "attnkit" / "kernels" / "attention"


def _native_build() -> types.ModuleType:
    """cpu_native_build.py, loaded by path: importing attnkit would import torch."""
    spec = importlib.util.spec_from_file_location(
        "_attnkit_native_build", _KERNELS / "cpu_native_build.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


_NB = _native_build()
_VARIANTS = {
    "attnkit.kernels.attention._native_" + v.name.replace("-", "_"): v
    for v in _NB.VARIANTS
    if v.machine == platform.machine()
}


def _compiler() -> str | None:
    env = os.environ.get("CC", "").strip()
    if env:
        return shutil.which(env)
    return next((c for c in map(shutil.which, ("cc", "gcc", "clang")) if c), None)


class BuildNative(build_ext):
    """Compile each variant with cpu_native_build (the loader's own build code)."""

    def get_ext_filename(self, fullname: str) -> str:
        """``attnkit/kernels/attention/_native.<variant>.so``: a plain library the loader
        finds by name, not a Python extension module. Asked with the full dotted name or
        with its last part (setuptools does both)."""
        by_last = {name.rsplit(".", 1)[-1]: name for name in _VARIANTS}
        full = by_last.get(fullname, fullname)
        if full in _VARIANTS:
            name = _NB.prebuilt_name(_VARIANTS[full])
            return name if full != fullname else os.path.join(*full.split(".")[:-1], name)
        return super().get_ext_filename(fullname)

    def build_extensions(self) -> None:
        """Build each variant; one that fails is dropped from the outputs (so an
        editable install copies only what was built) unless ATTNKIT_REQUIRE_PREBUILT=1."""
        built = [ext for ext in self.extensions if self._build_variant(ext)]
        self.extensions[:] = built

    def _build_variant(self, ext: Extension) -> bool:
        variant = _VARIANTS[ext.name]
        target = Path(self.get_ext_fullpath(ext.name))
        compiler = _compiler()
        try:
            if compiler is None:
                raise _NB.BuildFailed("no C compiler found (set CC, or install cc, gcc or clang)")
            _NB.compile_library(compiler, _KERNELS, target, variant.flags, variant=variant.name)
            needs = _NB.required_glibc(target)
            if needs is not None and needs > _NB.GLIBC_FLOOR:
                target.unlink()
                floor = ".".join(map(str, _NB.GLIBC_FLOOR))
                raise _NB.BuildFailed(
                    f"{target.name} needs glibc {needs[0]}.{needs[1]}, newer than the "
                    f"wheel's floor {floor} (a symbol attnkit_abi.h does not pin)"
                )
        except _NB.BuildFailed as exc:
            if os.environ.get("ATTNKIT_REQUIRE_PREBUILT", "") == "1":
                raise
            print(
                f"warning: attnkit's prebuilt {variant.name} CPU kernels were not built "
                f"({exc}); they will be compiled at first use where a compiler exists",
                file=sys.stderr,
            )
            return False
        return True


class PlatformWheel(bdist_wheel):
    """``py3-none-<platform>``: the libraries are plain C loaded with ctypes, not Python
    extension modules, so one wheel per platform serves every Python the project
    supports (``nox -s wheel`` then audits it as ``manylinux_2_17``)."""

    def get_tag(self) -> tuple[str, str, str]:
        platform_tag = super().get_tag()[2]
        return "py3", "none", platform_tag


setup(
    ext_modules=[Extension(name, sources=[]) for name in _VARIANTS],
    cmdclass={"build_ext": BuildNative, "bdist_wheel": PlatformWheel},
)
