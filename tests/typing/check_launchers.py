"""Every function of the Triton kernel modules other than a ``@triton.jit`` kernel is fully
annotated.

mypy's override for the Triton kernel modules (``pyproject.toml``: the
``[[tool.mypy.overrides]]`` entry that sets ``disallow_untyped_defs = false``, e.g.
``attnkit.kernels.*.triton``) relaxes ``disallow_untyped_defs`` and
``disallow_incomplete_defs`` so the Triton DSL bodies need no per-function ignores;
this check keeps that relaxation from hiding an untyped launcher (or a nested helper
of one). It checks exactly the modules the override matches, and fails on an override
pattern that matches no module (a stale name after a move). Usable as a script
(``python tests/typing/check_launchers.py``) and from the test suite.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the dev extra installs tomli on 3.10
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SRC = ROOT / "src"

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


def _is_triton_kernel(node: FunctionNode) -> bool:
    """Decorated with ``triton.jit`` (bare or called), the DSL mypy cannot check."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target) in ("triton.jit", "jit"):
            return True
    return False


def _functions(tree: ast.AST) -> Iterator[FunctionNode]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _missing(node: FunctionNode, in_class: bool) -> list[str]:
    args = node.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    if in_class and params and params[0].arg in ("self", "cls"):
        params = params[1:]
    missing = [p.arg for p in params if p.annotation is None]
    missing += [f"*{a.arg}" for a in (args.vararg, args.kwarg) if a and a.annotation is None]
    if node.returns is None:
        missing.append("return")
    return missing


def relaxed_patterns(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The module patterns of the mypy override that allows untyped defs."""
    config = tomllib.loads(pyproject.read_text())
    patterns: list[str] = []
    for override in config["tool"]["mypy"].get("overrides", []):
        if override.get("disallow_untyped_defs") is False:
            module = override["module"]
            patterns += [module] if isinstance(module, str) else module
    return patterns


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """mypy's module pattern semantics: ``a.*`` matches ``a`` and everything below it;
    ``a.*.b`` matches ``a.b``, ``a.x.b``, ``a.x.y.b`` (any components in between)."""
    parts = pattern.split(".")
    regex = re.escape(parts[0])
    for part in parts[1:]:
        regex += r"(\.[^.]+)*" if part == "*" else r"\." + re.escape(part)
    return re.compile(regex + r"\Z")


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def relaxed_modules(
    patterns: Iterable[str] | None = None, src: Path = SRC
) -> tuple[list[Path], list[str]]:
    """The files whose modules an override pattern matches, and the patterns that match
    no module at all."""
    patterns = relaxed_patterns() if patterns is None else list(patterns)
    files = sorted(src.rglob("*.py"))
    found: list[Path] = []
    stale: list[str] = []
    for pattern in patterns:
        regex = _pattern_regex(pattern)
        matched = [f for f in files if regex.match(_module_name(f, src))]
        if not matched:
            stale.append(pattern)
        found += [f for f in matched if f not in found]
    return sorted(found), stale


def unannotated(paths: Iterable[Path] | None = None, root: Path = ROOT) -> list[str]:
    """``file:line: name (missing: ...)`` for each launcher or helper missing annotations
    (in ``paths``; by default every module the mypy override relaxes)."""
    problems: list[str] = []
    for path in sorted(relaxed_modules()[0] if paths is None else paths):
        tree = ast.parse(path.read_text(), filename=str(path))
        methods = {
            id(item)
            for cls in ast.walk(tree)
            if isinstance(cls, ast.ClassDef)
            for item in cls.body
        }
        for node in _functions(tree):
            if _is_triton_kernel(node):
                continue
            missing = _missing(node, in_class=id(node) in methods)
            if missing:
                rel = path.relative_to(root).as_posix()
                problems.append(f"{rel}:{node.lineno}: {node.name} (missing: {', '.join(missing)})")
    return problems


def main() -> int:
    files, stale = relaxed_modules()
    problems = unannotated(files)
    for pattern in stale:
        print(f"mypy override pattern matches no module: {pattern}")
    for problem in problems:
        print(f"unannotated non-kernel function: {problem}")
    if not problems and not stale:
        print(f"triton launchers: every non-@triton.jit function of {len(files)} modules is annotated")
    return 1 if problems or stale else 0


if __name__ == "__main__":
    sys.exit(main())
