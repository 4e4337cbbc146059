"""README.md and docs/*.md are true as written: every code block runs, parses or is
compared with what the code prints.

The conventions (docs/development.md, "Docs that run"): a fenced block's kind is its
language, or a marker, an HTML comment on the line above the fence:
``<!-- docs: KEYWORD [ARGUMENT] -->``.

* ``python``: runs. A page's Python blocks run in order in one namespace (a REPL
  session), in the repository root; ``skip REASON`` leaves one out (it is compiled),
  ``substitute NAME=VALUE ...`` runs it with VALUE for each placeholder NAME,
  ``tested-by PATH`` says which test runs it (with a stand-in for a download, say),
  ``excerpt PATH`` that it is a verbatim part of PATH, ``signatures MODULE`` that it is
  a sketch whose classes and methods exist in MODULE with those parameters.
* ``bash``: every ``attnkit`` command parses with attnkit's own parser, every script
  or example it runs exists, every ``nox -s NAME`` is a session of noxfile.py, every
  ``attnkit[EXTRA]`` is an extra of pyproject.toml.
* ``toml``: parses (``excerpt PATH`` too: it is part of PATH).
* ``output``: what the block above printed (a Python block's stdout; a bash block's
  one command, run: stdout, then stderr), or ``output of COMMAND`` (``attnkit ...`` or
  ``python PATH``). A line ``...`` stands for any lines, ``...`` within a line for any
  text; trailing blanks do not count.
* ``figure``: a drawing; ``tree PATH``: a drawing of PATH's files, each of which must
  exist; ``tested-by PATH``: a block another test compares with the code.

Any other block fails ``test_every_block_says_what_it_is``. Inline code spans that are
``attnkit`` commands must name options the command has. Each check is also run on a
broken page to show it catches the drift.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import importlib
import inspect
import io
import re
import runpy
import shlex
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from attnkit.cli import main as cli_main
from attnkit.cli._parser import _build, parse_args
from attnkit.planner import PER_RANK_JSON_KEYS, PLAN_JSON_KEYS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLE_SRC = ROOT / "examples" / "out_of_tree_backend" / "src"

KEYWORDS = {
    "skip",
    "substitute",
    "tested-by",
    "excerpt",
    "signatures",
    "output",
    "figure",
    "tree",
}
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+)(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!-- docs: (?P<keyword>[a-z-]+)(?: (?P<argument>.*?))? -->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced block of a page: where it is, its language, marker and text."""

    page: str  # relative to the repository root
    line: int  # of the opening fence, from 1
    lang: str
    keyword: str | None
    argument: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks_of(text: str, page: str) -> list[Block]:
    """The fenced blocks of a page's Markdown, in order, with their markers."""
    lines = text.splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening.group("indent"), opening.group("fence")
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        body = [line.removeprefix(indent) for line in lines[i + 1 : end]]
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.match(above)
        found.append(
            Block(
                page=page,
                line=i + 1,
                lang=opening.group("lang"),
                keyword=marker.group("keyword") if marker else None,
                argument=(marker.group("argument") or "") if marker else "",
                text="\n".join(body) + "\n" if body else "",
            )
        )
        i = end + 1
    return found


def _page_blocks(path: Path) -> list[Block]:
    return blocks_of(path.read_text(), str(path.relative_to(ROOT)))


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


# ------------------------------------------------------------------------------ commands


def commands_of(script: str) -> list[list[str]]:
    """The simple commands of a shell block: continuation lines joined, comments
    dropped, ``&&``, ``||``, ``;`` and ``|`` split; each as its words."""
    joined = re.sub(r"\\\n", " ", script)
    commands: list[list[str]] = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for word in words:
            if word in {"&&", "||", ";", "|"}:
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(word)
        if current:
            commands.append(current)
    return commands


def _nox_sessions() -> set[str]:
    """The session names noxfile.py declares (``@nox.session(name=...)`` or the
    function's name)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    names: set[str] = set()
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            call = decorator if isinstance(decorator, ast.Call) else None
            target = call.func if call is not None else decorator
            if ast.unparse(target) != "nox.session":
                continue
            name = node.name
            for keyword in call.keywords if call is not None else []:
                if keyword.arg == "name" and isinstance(keyword.value, ast.Constant):
                    name = str(keyword.value.value)
            names.add(name)
    return names


def _extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def command_problems(words: list[str]) -> list[str]:
    """What is wrong with one command of a shell block (nothing for commands this
    check does not know)."""
    shown = " ".join(words)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        words = words[1:]  # VAR=value before the program
    if not words:
        return []
    program, args = words[0], words[1:]
    if program == "attnkit":
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parse_args(args)
        except SystemExit:
            return [f"{shown!r} does not parse: {err.getvalue().strip()}"]
        return []
    if program in {"python", "python3"}:
        if args[:2] == ["-m", "nox"]:
            program, args = "nox", args[2:]
        elif args[:2] == ["-m", "pip"]:
            program, args = "pip", args[2:]
        elif args and args[0].endswith(".py") and not (ROOT / args[0]).is_file():
            return [f"{shown!r} runs {args[0]}, which does not exist"]
    if program == "nox":
        sessions = _nox_sessions()
        named = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "-s"]
        return [
            f"{shown!r} names nox session {s!r}; noxfile.py has {sorted(sessions)}"
            for s in named
            if s not in sessions
        ]
    if program == "pip" and args[:1] == ["install"]:
        extras = _extras()
        wanted = [
            e.strip()
            for arg in args
            for group in re.findall(r"^attnkit\[([^\]]+)\]$", arg)
            for e in group.split(",")
        ]
        return [f"{shown!r} installs extra {e!r}, which pyproject.toml lacks" for e in wanted if e not in extras]
    if "/" in program and program.endswith((".sh", ".py")) and not (ROOT / program).is_file():
        return [f"{shown!r} runs {program}, which does not exist"]
    return []


def run_command(words: list[str]) -> str:
    """Run an ``attnkit`` command in process, or a ``python PATH`` script; what it
    printed (stdout, then stderr)."""
    out, err = io.StringIO(), io.StringIO()
    if words[0] == "attnkit":
        # argparse's errors exit, their message on stderr, as the command's do.
        redirect = contextlib.redirect_stdout(out), contextlib.redirect_stderr(err)
        with redirect[0], redirect[1], contextlib.suppress(SystemExit):
            cli_main(words[1:], out=out, err=err)
    elif words[0] in {"python", "python3"} and words[1].endswith(".py"):
        argv = sys.argv
        sys.argv = words[1:]
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                runpy.run_path(str(ROOT / words[1]), run_name="__main__")
        finally:
            sys.argv = argv
    else:
        raise AssertionError(f"an output block can show 'attnkit ...' or 'python PATH', not {words}")
    return out.getvalue() + err.getvalue()


# ------------------------------------------------------------------------------- output


def output_mismatch(expected: str, actual: str) -> str | None:
    """``None`` if ``actual`` matches ``expected`` (``...`` lines: any lines; ``...``
    within a line: any text; trailing blanks ignored), else a diff."""
    want = [line.rstrip() for line in expected.rstrip("\n").splitlines()]
    got = [line.rstrip() for line in actual.rstrip("\n").splitlines()]
    pattern = ""
    for line in want:
        if line.strip() == "...":
            pattern += r"(?:[^\n]*\n)*?"
        else:
            pattern += ".*".join(re.escape(part) for part in line.split("...")) + r"\n"
    if re.fullmatch(pattern, "".join(g + "\n" for g in got)):
        return None
    diff = difflib.unified_diff(want, got, "documented", "printed", lineterm="")
    return "\n".join(diff)


# ----------------------------------------------------------------------- block checks


def _repo_file(argument: str, block: Block) -> tuple[Path | None, list[str]]:
    path = ROOT / argument
    if not argument or not path.is_file():
        return None, [f"{block.where}: '{block.keyword} {argument}' names no file of the repository"]
    return path, []


def tree_problems(block: Block) -> list[str]:
    """Every entry of a ``tree PATH`` drawing (``├── name``, ``└── name``, four
    columns a level) must exist under PATH."""
    root = ROOT / block.argument
    if not block.argument or not root.is_dir():
        return [f"{block.where}: 'tree {block.argument}' names no directory"]
    problems: list[str] = []
    parents: list[str] = []
    for line in block.text.splitlines()[1:]:
        match = re.match(r"^(?P<lead>(?:│   |    )*)[├└]── (?P<name>[^\s#]+)", line)
        if match is None:
            continue
        depth = len(match.group("lead")) // 4
        del parents[depth:]
        name = match.group("name").rstrip("/")
        path = root.joinpath(*parents, name)
        if not path.exists():
            problems.append(f"{block.where}: {path.relative_to(ROOT)} is drawn but does not exist")
        parents.append(name)
    return problems


def signature_problems(block: Block) -> list[str]:
    """A sketch's classes exist in the module, and each method it shows has the real
    method's parameters, in order."""
    module = importlib.import_module(block.argument)
    problems: list[str] = []
    for node in ast.parse(block.text).body:
        if not isinstance(node, ast.ClassDef):
            continue
        real = getattr(module, node.name, None)
        if not inspect.isclass(real):
            problems.append(f"{block.where}: {block.argument} has no class {node.name}")
            continue
        for item in node.body:
            if not isinstance(item, ast.FunctionDef):
                continue
            method = inspect.getattr_static(real, item.name, None)
            if isinstance(method, property):
                method = method.fget
            elif isinstance(method, classmethod | staticmethod):
                method = method.__func__
            if method is None:
                problems.append(f"{block.where}: {node.name} has no {item.name}")
                continue
            shown = [a.arg for a in item.args.args + item.args.kwonlyargs]
            params = list(inspect.signature(method).parameters)
            if shown != params:
                problems.append(
                    f"{block.where}: {node.name}.{item.name} takes {params}, the sketch shows {shown}"
                )
    return problems


def marker_problems(blocks: list[Block], page_text: str) -> list[str]:
    """What is wrong with the blocks' kinds and markers (not running anything)."""
    problems: list[str] = []
    for i, block in enumerate(blocks):
        keyword, argument = block.keyword, block.argument
        if keyword is None:
            if block.lang not in {"python", "bash", "toml"}:
                problems.append(
                    f"{block.where}: a ```{block.lang} block without a marker; say what it is "
                    f"(<!-- docs: {' | '.join(sorted(KEYWORDS))} -->)"
                )
            continue
        if keyword not in KEYWORDS:
            problems.append(f"{block.where}: unknown marker {keyword!r}")
        elif keyword in {"skip"} and not argument:
            problems.append(f"{block.where}: 'skip' needs a reason")
        elif keyword in {"skip", "substitute", "signatures"} and block.lang != "python":
            problems.append(f"{block.where}: '{keyword}' marks a python block")
        elif keyword in {"tested-by", "excerpt"}:
            path, missing = _repo_file(argument, block)
            problems.extend(missing)
            if path is not None and keyword == "tested-by" and block.page not in path.read_text():
                problems.append(f"{block.where}: {argument} does not name {block.page}")
            if path is not None and keyword == "excerpt" and block.text not in path.read_text():
                problems.append(f"{block.where}: the block is not a verbatim part of {argument}")
        elif keyword == "output" and not argument:
            before = blocks[i - 1] if i else None
            if before is None or before.lang not in {"python", "bash"} or before.keyword in {
                "skip",
                "excerpt",
                "signatures",
                "tested-by",
            }:
                problems.append(f"{block.where}: 'output' follows no python or bash block that runs")
            elif before.lang == "bash" and (
                len(commands_of(before.text)) != 1
                or commands_of(before.text)[0][0] not in {"attnkit", "python", "python3"}
            ):
                problems.append(
                    f"{block.where}: 'output' follows a bash block that is not one "
                    "'attnkit ...' or 'python PATH' command"
                )
        elif keyword == "output" and (
            not argument.startswith("of ")
            or commands_of(argument.removeprefix("of "))[0][0] not in {"attnkit", "python", "python3"}
        ):
            problems.append(f"{block.where}: 'output of' runs 'attnkit ...' or 'python PATH'")
        elif keyword == "tree":
            problems.extend(tree_problems(block))
        elif keyword == "substitute" and not re.fullmatch(r"(\w+=\S+ ?)+", argument):
            problems.append(f"{block.where}: 'substitute' takes NAME=VALUE pairs")
    return problems


def _inline_commands(text: str) -> Iterator[str]:
    """Inline code spans (outside fenced blocks) that start with ``attnkit ``."""
    outside = re.sub(r"^ *```.*?^ *```", "", text, flags=re.M | re.S)
    yield from re.findall(r"`(attnkit [^`]+)`", outside)


def inline_option_problems(text: str, page: str) -> list[str]:
    """Each ``--option`` of an inline ``attnkit COMMAND ...`` span is an option of
    COMMAND."""
    parser, commands = _build()
    problems: list[str] = []
    for span in _inline_commands(text):
        words = span.split()
        command = commands.get(words[1]) if len(words) > 1 else None
        known = parser if command is None else command
        options = {o for a in known._actions for o in a.option_strings}
        for word in words[2:] if command is not None else words[1:]:
            option = word.partition("=")[0]
            if option.startswith("--") and option not in options:
                problems.append(f"{page}: `{span}`: {option} is not an option of attnkit {words[1]}")
    return problems


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_block_says_what_it_is(page: Path) -> None:
    text = page.read_text()
    blocks = _page_blocks(page)
    assert marker_problems(blocks, text) == []
    assert inline_option_problems(text, str(page.relative_to(ROOT))) == []


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_shell_blocks_parse(page: Path) -> None:
    problems = [
        f"{block.where}: {problem}"
        for block in _page_blocks(page)
        if block.lang == "bash"
        for words in commands_of(block.text)
        for problem in command_problems(words)
    ]
    assert problems == []


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_toml_blocks_parse(page: Path) -> None:
    for block in _page_blocks(page):
        if block.lang == "toml":
            tomllib.loads(block.text)


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_sketches_match_the_code(page: Path) -> None:
    problems = [
        problem
        for block in _page_blocks(page)
        if block.keyword == "signatures"
        for problem in signature_problems(block)
    ]
    assert problems == []


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_python_blocks_that_run_elsewhere_compile(page: Path) -> None:
    for block in _page_blocks(page):
        if block.lang == "python" and block.keyword in {"skip", "tested-by", "excerpt", "signatures"}:
            compile(block.text, block.where, "exec")


def _substituted(block: Block) -> str:
    text = block.text
    if block.keyword == "substitute":
        for pair in block.argument.split():
            name, _, value = pair.partition("=")
            text = re.sub(rf"\b{re.escape(name)}\b", value, text)
    return text


RUNS = {"substitute", None}


def _runnable(path: Path) -> bool:
    return any(b.lang == "python" and b.keyword in RUNS for b in _page_blocks(path))


RUNNABLE = [p for p in PAGES if _runnable(p)]


@pytest.mark.parametrize("page", RUNNABLE, ids=_ids(RUNNABLE))
def test_python_blocks_run_and_print_what_the_page_shows(
    page: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(EXAMPLE_SRC))
    name = "docs_" + re.sub(r"\W", "_", page.stem)
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)
    blocks = _page_blocks(page)
    printed: dict[int, str] = {}
    for i, block in enumerate(blocks):
        if block.lang != "python" or block.keyword not in RUNS:
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(_substituted(block), block.where, "exec"), module.__dict__)
            # A block that defines tests runs those that need no fixture.
            for key, test in list(vars(module).items()):
                if (
                    key.startswith("test_")
                    and inspect.isfunction(test)
                    and test.__code__.co_filename == block.where
                    and not inspect.signature(test).parameters
                ):
                    test()
        printed[i] = out.getvalue()
    mismatches = []
    for i, block in enumerate(blocks):
        if block.keyword == "output" and not block.argument and i - 1 in printed:
            diff = output_mismatch(block.text, printed[i - 1])
            if diff is not None:
                mismatches.append(f"{block.where}:\n{diff}")
    assert mismatches == [], "\n\n".join(mismatches)


def _compared(path: Path) -> list[tuple[Block, list[str]]]:
    """The output blocks of a page that show a command's output, with the command."""
    blocks = _page_blocks(path)
    found = []
    for i, block in enumerate(blocks):
        if block.keyword != "output":
            continue
        if block.argument:
            found.append((block, commands_of(block.argument.removeprefix("of "))[0]))
        elif i and blocks[i - 1].lang == "bash":
            found.append((block, commands_of(blocks[i - 1].text)[0]))
    return found


COMMAND_OUTPUTS = [(b, words) for p in PAGES for b, words in _compared(p)]


@pytest.mark.parametrize(
    ("block", "words"), COMMAND_OUTPUTS, ids=[b.where for b, _ in COMMAND_OUTPUTS]
)
def test_command_output_is_what_the_page_shows(
    block: Block, words: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    diff = output_mismatch(block.text, run_command(words))
    assert diff is None, f"{block.where} ({' '.join(words)}):\n{diff}"


def _json_table(text: str) -> list[tuple[list[str], str]]:
    """The ``--json`` key table of docs/models.md: (keys of the row, the row's text)."""
    section = text[text.index("### `--json`") :]
    section = section[: section.index("\n## ")]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first, _, rest = line[2:].partition(" | ")
            rows.append((re.findall(r"`([^`]+)`", first), rest))
    return rows


def test_the_json_table_lists_every_key_in_order() -> None:
    rows = _json_table((ROOT / "docs" / "models.md").read_text())
    assert [key for keys, _ in rows for key in keys] == list(PLAN_JSON_KEYS)
    per_rank = next(rest for keys, rest in rows if keys == ["per_rank"])
    # Its keys, after what it is: the row less parentheses (sub-keys, explanations).
    keys = re.sub(r"\([^()]*\)", "", per_rank.partition("):")[2])
    assert re.findall(r"`([a-z_]+)`", keys) == list(PER_RANK_JSON_KEYS)


# --------------------------------------------------------- each check catches a broken page

BROKEN_PAGE = """\
# A page

```
an unmarked block
```

<!-- docs: skip -->
```python
print("no reason given")
```

<!-- docs: tested-by tests/no_such_test.py -->
```python
pass
```

<!-- docs: excerpt noxfile.py -->
```python
this line is in no file
```

<!-- docs: tree examples/out_of_tree_backend -->
```
examples/out_of_tree_backend/
├── pyproject.toml
└── src/
    └── gone.py
```

```toml
ok = 1
```

<!-- docs: output -->
```text
an output after a toml block
```

Run `attnkit plan --gpu-memry 80GiB`.
"""


def test_the_marker_check_catches_a_broken_page() -> None:
    blocks = blocks_of(BROKEN_PAGE, "broken.md")
    assert [(b.lang, b.keyword) for b in blocks] == [
        ("", None),
        ("python", "skip"),
        ("python", "tested-by"),
        ("python", "excerpt"),
        ("", "tree"),
        ("toml", None),
        ("text", "output"),
    ]
    problems = marker_problems(blocks, BROKEN_PAGE)
    assert problems == [
        "broken.md:3: a ``` block without a marker; say what it is (<!-- docs: excerpt | "
        "figure | output | signatures | skip | substitute | tested-by | tree -->)",
        "broken.md:8: 'skip' needs a reason",
        "broken.md:13: 'tested-by tests/no_such_test.py' names no file of the repository",
        "broken.md:18: the block is not a verbatim part of noxfile.py",
        "broken.md:23: examples/out_of_tree_backend/src/gone.py is drawn but does not exist",
        "broken.md:35: 'output' follows no python or bash block that runs",
    ]
    assert inline_option_problems(BROKEN_PAGE, "broken.md") == [
        "broken.md: `attnkit plan --gpu-memry 80GiB`: --gpu-memry is not an option of attnkit plan"
    ]


def test_the_shell_check_catches_stale_commands() -> None:
    script = (
        "attnkit plan --gpu-memory 80GiB --tensor-paralel 2  # a typo\n"
        "python3 -m nox -s test && python examples/gone.py\n"
        "pip install 'attnkit[transformer]' \\\n    torch\n"
        "attnkit backends --json\n"
    )
    assert commands_of(script) == [
        ["attnkit", "plan", "--gpu-memory", "80GiB", "--tensor-paralel", "2"],
        ["python3", "-m", "nox", "-s", "test"],
        ["python", "examples/gone.py"],
        ["pip", "install", "attnkit[transformer]", "torch"],
        ["attnkit", "backends", "--json"],
    ]
    problems = [p for words in commands_of(script) for p in command_problems(words)]
    assert len(problems) == 4
    assert problems[0].startswith(
        "'attnkit plan --gpu-memory 80GiB --tensor-paralel 2' does not parse: attnkit plan: "
        "error: unrecognized arguments: --tensor-paralel (plan takes "
    )
    assert problems[1].startswith("'python3 -m nox -s test' names nox session 'test'; ")
    assert problems[2] == "'python examples/gone.py' runs examples/gone.py, which does not exist"
    assert problems[3] == (
        "'pip install attnkit[transformer] torch' installs extra 'transformer', which "
        "pyproject.toml lacks"
    )


def test_the_output_check_catches_a_changed_figure() -> None:
    printed = "layers: 32\npage: 65536 B\nblocks: 40960\nCUDA graphs: NEVER\n"
    assert output_mismatch("layers: 32\n...\nCUDA graphs: NEVER\n", printed) is None
    assert output_mismatch("layers: ...\npage: 65536 B   \n...\n", printed) is None
    diff = output_mismatch("layers: 32\n...\nblocks: 40961\n...\n", printed)
    assert diff is not None
    assert "-blocks: 40961" in diff
    assert output_mismatch("page: 65536 B\n...\n", printed) is not None  # must start there


def test_the_signature_check_catches_a_renamed_parameter() -> None:
    sketch = (
        "class AttentionImpl(LayerImpl[M_contra, S_co, P_co]):\n"
        "    def forward(self, q, key, value, kv_cache, attn_metadata, output) -> Tensor: ...\n"
        "class NoSuchBuilder:\n"
        "    pass\n"
    )
    block = Block("sketch.md", 1, "python", "signatures", "attnkit.backend_api", sketch)
    assert signature_problems(block) == [
        "sketch.md:1: AttentionImpl.forward takes ['self', 'query', 'key', 'value', "
        "'kv_cache', 'attn_metadata', 'output'], the sketch shows ['self', 'q', 'key', "
        "'value', 'kv_cache', 'attn_metadata', 'output']",
        "sketch.md:1: attnkit.backend_api has no class NoSuchBuilder",
    ]
