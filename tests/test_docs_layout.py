"""docs/architecture.md describes the tree as it is.

Two blocks of that page are checked against the code:

* "Layout": the source tree, one line per entry (``name`` or ``name/`` for a directory,
  indented two spaces per level under ``src/attnkit/``, then a description). Every
  listed path must exist with that kind (file or directory), and every module and
  package directly under ``src/attnkit``, ``src/attnkit/backends`` and
  ``src/attnkit/kernels`` (every backend and every kernel op) must be listed.
* "Layers of the package": the table must name exactly the modules, layers and packages
  of ``tests/test_layering.py``'s ``LAYERS`` and ``PACKAGES``, the dict its docstring
  calls this table.

Each checker is also run on a broken copy (a path that does not exist, a missing
module, a changed layer) to show it catches the drift.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from test_layering import LAYERS, PACKAGES

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "src" / "attnkit"

COMPLETE_UNDER = ("", "backends", "kernels")
"""Directories (relative to ``src/attnkit``) whose every module and package the Layout
block must list (below the top, a package's ``__init__.py`` is its directory's line)."""


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of ``text``."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match is not None, f"docs/architecture.md has no '## {heading}' section"
    return match.group(1)


def layout_entries(text: str) -> list[tuple[str, bool, str]]:
    """``(path under src/attnkit, is a directory, description)`` per line of the Layout
    block of ``text`` (the page's Markdown), in order; raises ``ValueError`` for a line
    the block's format has no place for."""
    body = _section(text, "Layout")
    match = re.search(r"```text\n(.*?)```", body, flags=re.S)
    if match is None:
        raise ValueError("the Layout section has no ```text block")
    lines = match.group(1).splitlines()
    if not lines or lines[0] != "src/attnkit/":
        raise ValueError("the Layout block must start with 'src/attnkit/'")
    entries: list[tuple[str, bool, str]] = []
    parents: list[str] = []  # the directories above the current line, outermost first
    for line in lines[1:]:
        found = re.fullmatch(r"((?:  )+)(\S+)(?: {2,}(\S.*))?", line)
        if found is None:
            raise ValueError(f"Layout line not of the form '  name  description': {line!r}")
        depth = len(found.group(1)) // 2
        name, description = found.group(2), found.group(3) or ""
        if depth > len(parents) + 1:
            raise ValueError(f"Layout line indented under no directory: {line!r}")
        del parents[depth - 1 :]
        is_dir = name.endswith("/")
        path = "/".join([*parents, name.rstrip("/")])
        entries.append((path, is_dir, description))
        if is_dir:
            parents.append(name.rstrip("/"))
    return entries


def _modules_and_packages(directory: Path) -> set[str]:
    """The Python modules and packages directly in ``directory`` (names, packages with a
    trailing ``/``)."""
    found = set()
    for child in directory.iterdir():
        if child.is_file() and child.suffix == ".py":
            found.add(child.name)
        elif child.is_dir() and (child / "__init__.py").exists():
            found.add(child.name + "/")
    return found


def layout_problems(text: str, package: Path) -> list[str]:
    """How the Layout block of ``text`` disagrees with the tree at ``package``."""
    try:
        entries = layout_entries(text)
    except ValueError as exc:
        return [str(exc)]
    problems: list[str] = []
    listed: set[str] = set()
    for path, is_dir, description in entries:
        shown = path + ("/" if is_dir else "")
        if shown in listed:
            problems.append(f"{shown} is listed twice")
        listed.add(shown)
        if not description:
            problems.append(f"{shown} has no description")
        target = package / path
        if is_dir and not target.is_dir():
            problems.append(f"{shown} is listed but is not a directory of src/attnkit")
        elif not is_dir and not target.is_file():
            problems.append(f"{shown} is listed but is not a file of src/attnkit")
    for under in COMPLETE_UNDER:
        prefix = f"{under}/" if under else ""
        for name in sorted(_modules_and_packages(package / under)):
            if under and name == "__init__.py":
                continue  # the directory's own line stands for it
            if prefix + name not in listed:
                problems.append(f"{prefix}{name} is in src/attnkit but not in the Layout block")
    return problems


def layer_table(text: str) -> tuple[dict[str, int], set[str]]:
    """The "Layers of the package" table of ``text``: module -> layer, and the modules
    marked as packages (a trailing ``/``)."""
    body = _section(text, "Layers of the package (src/attnkit)")
    layers: dict[str, int] = {}
    packages: set[str] = set()
    for row in re.findall(r"^\| (\d+) \| (.*?) \|", body, flags=re.M):
        layer, cell = int(row[0]), re.sub(r"\(.*?\)", "", row[1])  # drop "(`__init__`)"
        for name in re.findall(r"`([^`]+)`", cell):
            module = "attnkit" if name == "attnkit" else f"attnkit.{name.rstrip('/')}"
            if module in layers:
                raise ValueError(f"{module} is in the layer table twice")
            layers[module] = layer
            if name.endswith("/"):
                packages.add(module)
    return layers, packages


def test_the_layout_block_matches_the_tree() -> None:
    assert layout_problems(DOC.read_text(), PACKAGE) == []


def test_the_layout_block_lists_every_backend_and_kernel_op() -> None:
    listed = {path for path, is_dir, _ in layout_entries(DOC.read_text()) if is_dir}
    backends = {p.name for p in (PACKAGE / "backends").iterdir() if (p / "__init__.py").exists()}
    ops = {p.name for p in (PACKAGE / "kernels").iterdir() if (p / "__init__.py").exists()}
    assert {"cpu_attn", "reference", "triton_attn"} <= backends  # the walk found them
    assert {f"backends/{b}" for b in backends} <= listed
    assert {f"kernels/{op}" for op in ops} <= listed


def test_the_layout_check_catches_a_path_that_does_not_exist() -> None:
    text = DOC.read_text().replace(
        "  spec.py ", "  spec_old.py        a module that was removed\n  spec.py ", 1
    )
    assert layout_problems(text, PACKAGE) == [
        "spec_old.py is listed but is not a file of src/attnkit"
    ]
    text = DOC.read_text().replace("    mla/ ", "    mla.py ", 1)
    assert layout_problems(text, PACKAGE) == [
        "kernels/mla.py is listed but is not a file of src/attnkit",
        "kernels/mla/ is in src/attnkit but not in the Layout block",
    ]


def test_the_layout_check_catches_a_missing_entry() -> None:
    text = "\n".join(
        line
        for line in DOC.read_text().splitlines()
        if not line.startswith(("  selector.py ", "    triton_mla/ "))
    )
    assert layout_problems(text, PACKAGE) == [
        "selector.py is in src/attnkit but not in the Layout block",
        "backends/triton_mla/ is in src/attnkit but not in the Layout block",
    ]


def test_the_layout_check_catches_a_module_added_to_the_tree(tmp_path: Path) -> None:
    copy = tmp_path / "attnkit"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "speculative.py").write_text("")
    (copy / "kernels" / "sparse").mkdir()
    (copy / "kernels" / "sparse" / "__init__.py").write_text("")
    (copy / "backends" / "notes").mkdir()  # not a package: nothing to list
    assert layout_problems(DOC.read_text(), copy) == [
        "speculative.py is in src/attnkit but not in the Layout block",
        "kernels/sparse/ is in src/attnkit but not in the Layout block",
    ]


def test_the_layout_check_catches_a_malformed_block() -> None:
    # __main__.py indented under __init__.py, a file.
    text = DOC.read_text().replace("\n  __main__.py ", "\n    __main__.py ", 1)
    assert layout_problems(text, PACKAGE) == [
        "Layout line indented under no directory: '    __main__.py          python -m attnkit'"
    ]
    text = DOC.read_text().replace("  errors.py   ", "  errors.py\t", 1)
    assert layout_problems(text, PACKAGE)[0].startswith("Layout line not of the form")


def test_the_layer_table_is_the_layering_tests_table() -> None:
    layers, packages = layer_table(DOC.read_text())
    assert layers == LAYERS
    assert packages == PACKAGES


def test_the_layer_table_check_catches_a_changed_layer() -> None:
    text = DOC.read_text()
    row = "| 9 | `selector`, `parallel` |"
    assert row in text
    layers, _ = layer_table(text.replace(row, "| 10 | `selector`, `parallel` |"))
    assert {m for m in LAYERS if layers.get(m) != LAYERS[m]} == {
        "attnkit.selector",
        "attnkit.parallel",
    }
    _, packages = layer_table(text.replace("`kv_cache/`", "`kv_cache`"))
    assert PACKAGES - packages == {"attnkit.kv_cache"}
