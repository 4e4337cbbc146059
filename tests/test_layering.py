"""The import rules of docs/architecture.md, enforced.

Every ``import`` of an attnkit module anywhere in ``src/attnkit`` (module level,
inside functions, under ``TYPE_CHECKING``) is an edge of the import graph. The graph
must have no cycle, and every edge must point down the layer table below (the same
table as in docs/architecture.md, "Layers of the package"): a module imports only
modules of a strictly lower layer, a backend package imports the core modules up to
``backend`` plus the kernels and itself, and a kernel module imports only kernel
modules (kernels know no attnkit types), organised by op (see "kernels" below).
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
    "attnkit.prefix_cache": 4,
    "attnkit.offload": 4,
    "attnkit.builder": 5,
    "attnkit.impl": 5,
    "attnkit.state_types": 5,
    "attnkit.models": 6,
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
    "attnkit.testing._guards": 11,
    "attnkit.testing._pairwise": 11,
    "attnkit.testing._cases": 12,
    "attnkit.testing._invariance": 13,
    "attnkit.testing._report": 12,
    "attnkit.testing": 14,
    "attnkit.testing.pytest_plugin": 15,
    "attnkit.cli": 12,
    "attnkit": 13,
    "attnkit.__main__": 14,
}
"""Core modules and their layer."""

PACKAGES: frozenset[str] = frozenset(
    {
        "attnkit.cli",
        "attnkit.demo",
        "attnkit.integrations.transformers",
        "attnkit.kinds",
        "attnkit.kv_cache",
        "attnkit.models",
        "attnkit.offload",
        "attnkit.planner",
        "attnkit.prefix_cache",
        "attnkit.runtime",
    }
)
"""Core modules that are packages of private submodules (``attnkit.planner._capacity``):
a submodule takes its package's layer, and the modules of one package may import each
other (the cycle check still holds inside the package)."""


def package_of(module: str) -> str | None:
    """The declared package ``module`` is a submodule of, if any."""
    return next((p for p in PACKAGES if module.startswith(p + ".")), None)


def layer_of(module: str) -> int:
    """A core module's layer: its own entry, or its package's."""
    package = package_of(module)
    return LAYERS[module] if package is None else LAYERS[package]


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
        caller = package_of(source) or source
        return None if source.startswith("attnkit.backends") or caller in _KERNEL_CALLERS else (
            "only backends (and the demo, the merge, the state types) import kernels"
        )
    if source.startswith("attnkit.backends"):
        if target.startswith("attnkit.backends"):
            # Within one backend package, or the shared helpers of attnkit.backends.
            own = ".".join(source.split(".")[:3])
            shared = target.count(".") == 2 and target.split(".")[2].startswith("_")
            return None if target.startswith(own) or shared else "a backend imports another backend"
        if layer_of(target) > BACKEND_MAX_CORE_LAYER:
            return f"backends may import core modules up to attnkit.backend, not {target}"
        return None
    if target.startswith("attnkit.backends"):
        return f"{source} imports a backend package (backends are loaded through the registry)"
    own = package_of(source) or source
    if target == own or package_of(target) == own:
        return None  # within one package (or a package and its submodules)
    if layer_of(target) >= layer_of(source):
        return f"layer {layer_of(source)} imports layer {layer_of(target)}"
    return None


def test_every_core_module_has_a_layer() -> None:
    core = {m for m in MODULES if not m.startswith(("attnkit.kernels", "attnkit.backends"))}
    listed = {m for m in core if m in LAYERS or package_of(m) is not None}
    assert listed == core, "update LAYERS (and docs/architecture.md) for new modules"
    assert set(LAYERS) <= core, "LAYERS names a module that does not exist"
    assert set(LAYERS) >= PACKAGES, "a package of PACKAGES needs its layer in LAYERS"


def test_a_package_submodule_takes_its_package_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    # A split module (attnkit.planner -> attnkit.planner._capacity, ...) keeps its
    # layer: its submodules may import each other, but not a module above the package.
    monkeypatch.setitem(globals(), "PACKAGES", frozenset({"attnkit.planner"}))
    assert _violation("attnkit.planner._a", "attnkit.planner._b") is None
    assert _violation("attnkit.planner", "attnkit.planner._a") is None
    assert _violation("attnkit.planner._a", "attnkit.runtime") is None
    assert _violation("attnkit.planner._a", "attnkit.cli") == "layer 11 imports layer 12"
    assert _violation("attnkit.planner._a", "attnkit.demo") == "layer 11 imports layer 11"
    assert _violation("attnkit.runtime", "attnkit.planner._a") == "layer 10 imports layer 11"


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

# Kernels are organised by op (docs/architecture.md, "Kernels"): ``kernels/<op>/`` holds
# the op's contract (``contract.py``), its torch reference (``reference.py``), its Triton
# kernels (``triton.py``, ``triton_*.py``) and its CPU engines (``cpu_*.py``); what every
# op shares is in ``kernels/_checks.py`` (plain Python) and ``kernels/_triton/`` (Triton).
SHARED: dict[str, str] = {
    "attnkit.kernels._checks": "shared",
    "attnkit.kernels._triton": "shared-triton",
}
"""The shared building blocks and their role."""

# What a module of each role may import (roles of kernel modules). The implementations
# (reference, triton, cpu) never import one another's kind: what two of them need is
# the op's contract or a shared helper. Only Triton modules import the Triton helpers,
# so a contract, a reference or a CPU engine never imports triton.
KERNEL_IMPORTS: dict[str, frozenset[str]] = {
    "package": frozenset(),
    "shared": frozenset(),
    "shared-triton": frozenset({"shared", "shared-triton"}),
    "contract": frozenset({"shared", "contract"}),
    "reference": frozenset({"shared", "contract", "reference"}),
    "triton": frozenset({"shared", "shared-triton", "contract", "triton"}),
    "cpu": frozenset({"shared", "contract", "cpu"}),
}
"""Role -> the roles its imports may have."""

def kernel_role(module: str, is_package: bool = False) -> str | None:
    """The role of a kernel module (None: a module the per-op layout has no place for)."""
    if module == "attnkit.kernels":
        return "package"
    for prefix, role in SHARED.items():
        if module == prefix or module.startswith(prefix + "."):
            return role
    parts = module.split(".")
    if len(parts) == 3 and is_package and not parts[2].startswith("_"):
        return "package"  # an op's package: attnkit.kernels.<op>
    if len(parts) != 4 or parts[2].startswith("_"):
        return None
    name = parts[3]
    if name in ("contract", "reference"):
        return name
    if name == "triton" or name.startswith("triton_"):
        return "triton"
    if name.startswith("cpu_"):
        return "cpu"
    return None


def _package(module: str) -> str:
    """The kernel package a module belongs to: ``attnkit.kernels.mamba2.triton`` ->
    ``mamba2`` (an op), ``attnkit.kernels._triton.fp8`` -> ``_triton`` (shared)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else ""


def kernel_import_problems(module: str, path: Path, is_package: bool) -> list[str]:
    """Imports of ``module`` (a kernel module) that break the per-op organisation: an
    import its role may not make (:data:`KERNEL_IMPORTS`), or of a private
    (``_``-prefixed) name from another package's module (an op's private helpers stay
    inside the op)."""
    role = kernel_role(module, is_package)
    if role is None:
        return [f"{module}: not a module of the per-op layout (kernels/<op>/<role>.py)"]
    problems: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        targets = [t for t in dict.fromkeys(_targets(module, is_package, node)) if t != module]
        for target in targets:
            theirs = kernel_role(target, MODULES.get(target, (path, False))[1])
            if theirs not in KERNEL_IMPORTS[role]:
                problems.append(f"{module} ({role}) imports {target} ({theirs})")
        private = [a.name for a in node.names if a.name.startswith("_")]
        if (
            isinstance(node, ast.ImportFrom)
            and private
            and targets
            and _package(targets[0]) != _package(module)
        ):
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


@pytest.mark.parametrize(
    ("module", "is_package", "role"),
    [
        ("attnkit.kernels.mamba2", True, "package"),
        ("attnkit.kernels.mamba2.contract", False, "contract"),
        ("attnkit.kernels.mamba2.reference", False, "reference"),
        ("attnkit.kernels.mamba2.triton", False, "triton"),
        ("attnkit.kernels.attention.triton_plan", False, "triton"),
        ("attnkit.kernels.attention.cpu_decode", False, "cpu"),
        ("attnkit.kernels._checks", False, "shared"),
        ("attnkit.kernels._triton.fp8", False, "shared-triton"),
        ("attnkit.kernels.mamba2.helpers", False, None),
        ("attnkit.kernels.mamba2.torch", False, None),
        ("attnkit.kernels.helpers", False, None),
        ("attnkit.kernels._private_op.triton", False, None),
    ],
)
def test_kernel_roles(module: str, is_package: bool, role: str | None) -> None:
    assert kernel_role(module, is_package) == role


def _fake(tmp_path: Path, module: str, source: str) -> list[str]:
    path = tmp_path / "fake.py"
    path.write_text(source)
    return kernel_import_problems(module, path, False)


def test_the_kernel_rule_sees_cross_implementation_and_private_imports(tmp_path: Path) -> None:
    # A Triton kernel that imports a reference and another op's private helper; its own
    # op's private helpers, the contract and the shared helpers are fine.
    problems = _fake(
        tmp_path,
        "attnkit.kernels.mamba2.triton_fake",
        "from attnkit.kernels.mamba2.reference import ssd_chunked_varlen\n"
        "from attnkit.kernels.gated_delta.contract import _hidden, check_gdn_inputs\n"
        "from attnkit.kernels.mamba2.triton_kernels import _ssd_chunk_state_kernel\n"
        "from attnkit.kernels.mamba2.contract import check_ssm_inputs\n"
        "from attnkit.kernels._checks import describe\n"
        "from attnkit.kernels._triton.varlen import find_segment\n",
    )
    assert problems == [
        "attnkit.kernels.mamba2.triton_fake (triton) imports "
        "attnkit.kernels.mamba2.reference (reference)",
        "attnkit.kernels.mamba2.triton_fake imports private _hidden from "
        "attnkit.kernels.gated_delta.contract",
    ]


def test_the_kernel_rule_keeps_triton_out_of_references_and_contracts(tmp_path: Path) -> None:
    reference = _fake(
        tmp_path,
        "attnkit.kernels.conv1d.reference",
        "from attnkit.kernels.conv1d.triton import causal_conv1d_varlen\n"
        "from attnkit.kernels._triton.varlen import search_iters\n"
        "from attnkit.kernels.conv1d.contract import check_conv_params\n",
    )
    assert reference == [
        "attnkit.kernels.conv1d.reference (reference) imports "
        "attnkit.kernels.conv1d.triton (triton)",
        "attnkit.kernels.conv1d.reference (reference) imports "
        "attnkit.kernels._triton.varlen (shared-triton)",
    ]
    contract = _fake(
        tmp_path,
        "attnkit.kernels.conv1d.contract",
        "from attnkit.kernels.conv1d.reference import causal_conv1d_varlen\n",
    )
    assert contract == [
        "attnkit.kernels.conv1d.contract (contract) imports "
        "attnkit.kernels.conv1d.reference (reference)"
    ]


def test_the_kernel_rule_keeps_shared_helpers_below_the_ops(tmp_path: Path) -> None:
    shared = _fake(
        tmp_path,
        "attnkit.kernels._triton.fake",
        "from attnkit.kernels.attention.triton_tile import attend_kv_tile\n"
        "from attnkit.kernels._checks import describe\n",
    )
    assert shared == [
        "attnkit.kernels._triton.fake (shared-triton) imports "
        "attnkit.kernels.attention.triton_tile (triton)"
    ]
    stray = _fake(tmp_path, "attnkit.kernels.mamba2.helpers", "")
    assert stray == [
        "attnkit.kernels.mamba2.helpers: not a module of the per-op layout "
        "(kernels/<op>/<role>.py)"
    ]


@pytest.mark.parametrize(
    ("source", "target", "why"),
    [
        ("attnkit.kernels.merge.triton", "attnkit.spec", "kernels import only kernel modules"),
        (
            "attnkit.runtime",
            "attnkit.kernels.merge.reference",
            "only backends (and the demo, the merge, the state types) import kernels",
        ),
        ("attnkit.parallel", "attnkit.kernels.merge.triton", None),
        ("attnkit.backends.reference.attention", "attnkit.kernels.attention.reference", None),
    ],
)
def test_the_kernel_edges_of_the_layer_rule(source: str, target: str, why: str | None) -> None:
    assert _violation(source, target) == why


def test_an_op_package_imports_nothing(tmp_path: Path) -> None:
    """Importing an op's package (for its docstring, or a reference below it) must not
    import its Triton modules."""
    path = tmp_path / "__init__.py"
    path.write_text("from attnkit.kernels.conv1d.triton import causal_conv1d_varlen\n")
    assert kernel_import_problems("attnkit.kernels.conv1d", path, True) == [
        "attnkit.kernels.conv1d (package) imports attnkit.kernels.conv1d.triton (triton)"
    ]
