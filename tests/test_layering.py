"""The import rules of docs/architecture.md, enforced.

Every ``import`` of an attnkit module anywhere in ``src/attnkit`` (module level,
inside functions, under ``TYPE_CHECKING``) is an edge of the import graph. The graph
must have no cycle, and every edge must point down the layer table below (the same
table as in docs/architecture.md, "Layers of the package"): a module imports only
modules of a strictly lower layer, a backend package imports the core modules up to
``backend`` plus the kernels and itself, and a kernel module imports only kernel
modules (kernels know no attnkit types).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

# Lower number = lower layer. Modules of one layer may not import each other.
LAYERS: dict[str, int] = {
    "attnkit._validation": 1,
    "attnkit.errors": 0,
    "attnkit.state_inputs": 1,
    "attnkit.spec": 2,
    "attnkit.capabilities": 2,
    "attnkit.devices": 2,
    "attnkit.metadata": 3,
    "attnkit.kinds": 3,
    "attnkit._state_type": 3,
    "attnkit.config": 4,
    "attnkit.params": 4,
    "attnkit.builder": 5,
    "attnkit.impl": 5,
    "attnkit.state_types": 5,
    "attnkit.models": 6,
    "attnkit._boundary": 6,
    "attnkit.binding": 6,
    "attnkit.backend": 7,
    "attnkit.registry": 8,
    "attnkit.kv_cache": 8,
    "attnkit.selector": 9,
    "attnkit.parallel": 9,
    "attnkit.runtime": 10,
    "attnkit.backend_api": 11,
    "attnkit.demo": 11,
    "attnkit.planner": 11,
    # The transformers integration: the engine loop and the adapter (layer 11, beside
    # demo; neither imports the other), used by the cli.
    "attnkit.integrations": 11,
    "attnkit.integrations.engine": 11,
    "attnkit.integrations.transformers": 11,
    # The conformance kit (docs/backend-authors.md): beside backend_api and demo, above
    # the runtime; its own modules stack inside the package, and nothing imports it.
    "attnkit.testing.tolerances": 11,
    "attnkit.testing.strategies": 11,
    "attnkit.testing._cases": 12,
    "attnkit.testing": 13,
    "attnkit.testing.pytest_plugin": 14,
    "attnkit.cli": 12,
    "attnkit": 13,
    "attnkit.__main__": 14,
}
"""Core modules and their layer."""

_KERNEL_CALLERS = frozenset({"attnkit.demo", "attnkit.parallel", "attnkit.state_types"})
"""Core modules that call a kernel: the demo, the context-parallel merge
(``merge_attn_states``), and the state types' reference computations."""

BACKEND_MAX_CORE_LAYER = LAYERS["attnkit.backend"]
"""Backends (``attnkit.backends.*``) see the core up to ``backend``, never the registry,
selector or runtime that drive them."""


def _modules() -> dict[str, tuple[Path, bool]]:
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted((SRC / "attnkit").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


MODULES = _modules()


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The attnkit modules one import statement imports (a name of a package that is a
    submodule counts as that submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "attnkit"]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join([*base, *([node.module] if node.module else [])])
    else:
        target = node.module or ""
    if target.split(".")[0] != "attnkit":
        return []
    return [
        f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names
    ]


def _import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in MODULES.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges.update(
                    t for t in _targets(module, is_package, node) if t != module and t in MODULES
                )
        graph[module] = edges
    return graph


GRAPH = _import_graph()


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _violation(source: str, target: str) -> str | None:
    """Why ``source`` may not import ``target`` (``None`` if it may)."""
    if source.startswith("attnkit.kernels"):
        if not target.startswith("attnkit.kernels"):
            return "kernels import only kernel modules"
        return None
    if target.startswith("attnkit.kernels"):
        return None if source.startswith("attnkit.backends") or source in _KERNEL_CALLERS else (
            "only backends (and the demo, the merge, the state types) import kernels"
        )
    if source.startswith("attnkit.backends"):
        if target.startswith("attnkit.backends"):
            # Within one backend package, or the shared helpers of attnkit.backends.
            own = ".".join(source.split(".")[:3])
            shared = target.count(".") == 2 and target.split(".")[2].startswith("_")
            return None if target.startswith(own) or shared else "a backend imports another backend"
        if LAYERS[target] > BACKEND_MAX_CORE_LAYER:
            return f"backends may import core modules up to attnkit.backend, not {target}"
        return None
    if target.startswith("attnkit.backends"):
        return f"{source} imports a backend package (backends are loaded through the registry)"
    if LAYERS[target] >= LAYERS[source]:
        return f"layer {LAYERS[source]} imports layer {LAYERS[target]}"
    return None


def test_every_core_module_has_a_layer() -> None:
    core = {m for m in MODULES if not m.startswith(("attnkit.kernels", "attnkit.backends"))}
    assert core == set(LAYERS), "update LAYERS (and docs/architecture.md) for new modules"


def test_import_graph_has_no_cycle() -> None:
    assert _cycle(GRAPH) is None


def test_imports_point_down_the_layer_table() -> None:
    problems = [
        f"{source} -> {target}: {why}"
        for source, targets in sorted(GRAPH.items())
        for target in sorted(targets)
        if (why := _violation(source, target))
    ]
    assert problems == []


def test_the_checker_sees_function_level_imports(tmp_path: Path) -> None:
    # The old config -> registry cycle hid behind an import inside a function.
    code = "def f():\n    from .registry import default_registry\n"
    tree = ast.parse(code)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    assert _targets("attnkit.config", False, node) == ["attnkit.registry"]
    assert _violation("attnkit.config", "attnkit.registry") == "layer 4 imports layer 8"


@pytest.mark.parametrize(
    ("graph", "cycle"),
    [
        ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ],
)
def test_cycle_finder(graph: dict[str, set[str]], cycle: list[str] | None) -> None:
    assert _cycle(graph) == cycle


# --------------------------------------------------------------------------- kernels

KERNEL_TREES = ("attnkit.kernels.torch", "attnkit.kernels.triton")
"""The oracles and the Triton kernels: neither tree imports the other. What both need
(an op's argument checks) lives in ``attnkit.kernels.contracts.<op>`` or the shared
``attnkit.kernels._checks`` / ``_state_common``."""


def _tree(module: str) -> str | None:
    return next((t for t in KERNEL_TREES if module == t or module.startswith(t + ".")), None)


def kernel_import_problems(module: str, path: Path, is_package: bool) -> list[str]:
    """Imports of ``module`` (a kernel module) that break the per-op organisation: an
    import across the torch and Triton trees, or of a private (``_``-prefixed) name
    from another module."""
    problems: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        targets = [t for t in dict.fromkeys(_targets(module, is_package, node)) if t != module]
        for target in targets:
            mine, theirs = _tree(module), _tree(target)
            if mine and theirs and mine != theirs:
                problems.append(f"{module} imports {target} (across the torch/triton trees)")
        private = [a.name for a in node.names if a.name.startswith("_")]
        if isinstance(node, ast.ImportFrom) and private and targets:
            problems.append(f"{module} imports private {', '.join(private)} from {targets[0]}")
    return problems


def test_kernels_are_organised_by_op() -> None:
    problems = [
        problem
        for module, (path, is_package) in MODULES.items()
        if module.startswith("attnkit.kernels")
        for problem in kernel_import_problems(module, path, is_package)
    ]
    assert not problems, "\n".join(problems)


def test_the_kernel_rule_sees_cross_tree_and_private_imports(tmp_path: Path) -> None:
    path = tmp_path / "k.py"
    path.write_text(
        "from attnkit.kernels.torch.mamba2 import ssd_chunked_varlen\n"
        "from attnkit.kernels.contracts.mamba2 import _hidden, check_ssm_inputs\n"
        "from attnkit.kernels._checks import describe\n"
    )
    problems = kernel_import_problems("attnkit.kernels.triton.fake", path, False)
    assert problems == [
        "attnkit.kernels.triton.fake imports attnkit.kernels.torch.mamba2 "
        "(across the torch/triton trees)",
        "attnkit.kernels.triton.fake imports private _hidden from "
        "attnkit.kernels.contracts.mamba2",
    ]
