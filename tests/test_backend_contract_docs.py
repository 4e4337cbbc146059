"""docs/backend-contract.md's two reference tables describe the code as it is.

* "The step's metadata": the field table must name exactly the fields of
  ``CommonAttentionMetadata`` (and its ``query_lens_cpu`` property).
* "Kernels an author may call": the table must name every ``kernels/<op>/reference.py``
  and, for each, exactly the names of its ``__all__``; each named function exists.

Each checker also runs on a broken copy of the page (a field or a function dropped, a
module that does not exist) to show it catches the drift.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

from attnkit.backend_api import CommonAttentionMetadata

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "backend-contract.md"
KERNELS = ROOT / "src" / "attnkit" / "kernels"


def _section(text: str, heading: str) -> str:
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match is not None, f"docs/backend-contract.md has no '## {heading}' section"
    return match.group(1)


def _first_cells(body: str) -> list[tuple[str, str]]:
    """``(first cell, second cell)`` of each body row of the section's table."""
    rows = []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or set(cells[0]) <= {"-", " "}:
            continue
        rows.append((cells[0], cells[1]))
    return rows[1:]  # the header


def _names(cell: str) -> list[str]:
    """The backticked identifiers of a cell, the trailing parenthesis dropped."""
    return re.findall(r"`([A-Za-z_][\w.]*)`", re.sub(r"\(.*?\)", "", cell))


def metadata_problems(text: str) -> list[str]:
    body = _section(text, "The step's metadata: `CommonAttentionMetadata`")
    listed = {_names(first)[0] for first, _ in _first_cells(body) if _names(first)}
    fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)} | {"query_lens_cpu"}
    problems = [f"field {n} is not in the table" for n in sorted(fields - listed)]
    problems += [f"the table lists {n}, not a field" for n in sorted(listed - fields)]
    return problems


def kernel_problems(text: str) -> list[str]:
    body = _section(text, "Kernels an author may call")
    listed = {}
    for first, second in _first_cells(body):
        module = _names(first)[0]
        listed[module] = set(_names(second))
    ops = {p.parent.name for p in KERNELS.glob("*/reference.py")}
    expected = {f"attnkit.kernels.{op}.reference" for op in ops}
    problems = [f"{m} is not in the table" for m in sorted(expected - set(listed))]
    for module, names in sorted(listed.items()):
        if module not in expected:
            problems.append(f"the table lists {module}, which is no reference module")
            continue
        exported = set(importlib.import_module(module).__all__)
        problems += [f"{module}.{n} is not in the table" for n in sorted(exported - names)]
        problems += [f"the table lists {module}.{n}, not exported" for n in sorted(names - exported)]
    return problems


def test_the_metadata_table_names_every_field() -> None:
    assert metadata_problems(DOC.read_text()) == []


def test_the_kernel_table_is_the_reference_modules_exports() -> None:
    assert kernel_problems(DOC.read_text()) == []


def test_the_checkers_catch_drift() -> None:
    text = DOC.read_text()
    dropped_field = re.sub(r"^\| `max_seq_len` \|.*\n", "", text, flags=re.M)
    assert metadata_problems(dropped_field) == ["field max_seq_len is not in the table"]
    dropped_name = text.replace("`merge_attn_states`", "")
    assert kernel_problems(dropped_name) == [
        "attnkit.kernels.merge.reference.merge_attn_states is not in the table"
    ]
    old_path = text.replace("`attnkit.kernels.merge.reference`", "`attnkit.kernels.torch`")
    assert kernel_problems(old_path) == [
        "attnkit.kernels.merge.reference is not in the table",
        "the table lists attnkit.kernels.torch, which is no reference module",
    ]
