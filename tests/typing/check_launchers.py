"""Every function in ``attnkit.kernels.triton`` other than a ``@triton.jit`` kernel is fully
annotated.

mypy's override for ``attnkit.kernels.triton.*`` relaxes ``disallow_untyped_defs`` and
``disallow_incomplete_defs`` so the Triton DSL bodies need no per-function ignores;
this check keeps that relaxation from hiding an untyped launcher (or a nested helper
of one). Usable as a script (``python tests/typing/check_launchers.py``) and from the
test suite.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TRITON_KERNELS = ROOT / "src" / "attnkit" / "kernels" / "triton"

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


def unannotated(folder: Path = TRITON_KERNELS, root: Path = ROOT) -> list[str]:
    """``file:line: name (missing: ...)`` for each launcher or helper missing annotations."""
    problems: list[str] = []
    for path in sorted(folder.glob("*.py")):
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
    problems = unannotated()
    for problem in problems:
        print(f"unannotated non-kernel function: {problem}")
    if not problems:
        print(f"triton launchers: every non-@triton.jit function under {TRITON_KERNELS.name}/ is annotated")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
