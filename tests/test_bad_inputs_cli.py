"""Bad-input catalogue of the ``attnkit`` command, run as subprocesses
(``python -m attnkit ...``), one test case per bad command line.

Each case checks the exit status (2: a user error, 1: ``plan`` found a layer without a
backend), that stderr's first line is ``attnkit <command>: error: ...`` naming the bad
value and what is allowed (then only the lines the case expects: argparse's pointer to
``--help``, a ``NoBackendError``'s reasons), that stdout has no error text, and that
there is no traceback, except under ``--debug``, which re-raises with one.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from attnkit.devices import device_problem

ROOT = Path(__file__).resolve().parent.parent

CUDA_PROBLEM = device_problem(torch.device("cuda"))
CUDA7_PROBLEM = device_problem(torch.device("cuda:7"))

ANY = "<*>"
"""In an expected line: any text (everything else is literal)."""

REGISTERED = "registered backends: " + ANY + "reference, triton_attn" + ANY
KINDS = (
    "valid kinds: full_attention, sliding_window, chunked_local_attention, "
    "sink_full_attention, mla_attention, sliding_window_mla, encoder_only_attention, "
    "cross_attention, mamba, indexer"
)
DEVICES = "--device must be 'cpu', 'cuda' or 'cuda:N', got "


def pattern(line: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in line.split(ANY)))


@dataclasses.dataclass(frozen=True)
class Case:
    """``attnkit *argv``: the exit status and what stderr says.

    ``error``: stderr's first line after ``attnkit <command>: error: ``; ``rest``: every
    further stderr line, in order (``usage``: argparse's ``see '... --help'``);
    ``report``: text stdout must contain (else stdout must be empty).
    """

    argv: tuple[str, ...]
    error: str | None
    status: int = 2
    usage: bool = False
    rest: tuple[str, ...] = ()
    report: str | None = None


def usage(*argv: str, error: str) -> Case:
    """An argparse error: the message, then a pointer to the command's ``--help``."""
    return Case(argv, error, usage=True)


def user(*argv: str, error: str, rest: tuple[str, ...] = ()) -> Case:
    """An attnkit error (``AttnkitError``, a rejected configuration)."""
    return Case(argv, error, rest=rest)


def cuda_case(*argv: str, problem: str | None) -> object:
    return pytest.param(
        user(*argv, error=f"--device {argv[-1]}: {problem} (--device cpu runs anywhere)"),
        marks=pytest.mark.skipif(problem is None, reason=f"{argv[-1]} exists here"),
        id=f"demo-absent-{argv[-1].replace(':', '')}",
    )


STEPS = "argument --steps: must be an integer from 1 to 10000, got "
CAPABILITY = "argument --capability: must look like 9.0 (MAJOR.MINOR, digits only), got "
CANNOT_SERVE = (
    "backend 'triton_attn' was requested by AttentionConfig.backend_per_kind[{kind!r}] "
    "but cannot serve {spec}(" + ANY + ") on cpu:"
)
HINT = "HINT: choose another backend for this kind, or drop the setting to let attnkit choose."

CASES = [
    # The command itself.
    pytest.param(
        usage(
            "frob",
            error="argument COMMAND: invalid choice: 'frob' "
            "(choose from 'backends', 'plan', 'demo')",
        ),
        id="unknown-subcommand",
    ),
    pytest.param(usage(error="the following arguments are required: COMMAND"), id="no-subcommand"),
    # Abbreviations are not options.
    pytest.param(
        usage(
            "demo",
            "--backend",
            "triton_mamba2",
            error="unrecognized arguments: --backend triton_mamba2 (demo takes "
            "--backend-per-kind, --config, --context-parallel, --debug, --device, --dtype, "
            "--hf-family, --model, --prefer, --steps)",
        ),
        id="demo-backend-is-no-abbreviation",
    ),
    pytest.param(
        usage("demo", "--step", "3", error="unrecognized arguments: --step 3 (demo takes " + ANY),
        id="demo-abbreviated-steps",
    ),
    pytest.param(
        usage(
            "plan",
            "--mod",
            "llama",
            # "llama" is taken as the CONFIG argument; the abbreviation is refused.
            error="unrecognized arguments: --mod (plan takes --backend, "
            "--backend-per-kind, --block-size, --capability, --checkpoint-interval, "
            "--context-parallel, --debug, --determinism, --device, --dtype, --example, "
            "--gpu-memory, --json, --kv-cache-dtype, --max-model-len, --max-num-batched-tokens, "
            "--model, --num-blocks, --report-only, --state-checkpoints, --state-dtype, --strict, "
            "--tensor-parallel)",
        ),
        id="plan-abbreviated-model",
    ),
    pytest.param(
        usage(
            "backends",
            "--js",
            error="unrecognized arguments: --js (backends takes --debug, --device, --json)",
        ),
        id="backends-abbreviated-json",
    ),
    # Numbers.
    pytest.param(usage("demo", "--steps", "-5", error=STEPS + "'-5'"), id="steps-negative"),
    pytest.param(usage("demo", "--steps", "0", error=STEPS + "'0'"), id="steps-zero"),
    pytest.param(usage("demo", "--steps", "10001", error=STEPS + "'10001'"), id="steps-too-many"),
    pytest.param(usage("demo", "--steps", "2.5", error=STEPS + "'2.5'"), id="steps-not-an-int"),
    pytest.param(usage("demo", "--steps=", error=STEPS + "''"), id="steps-empty"),
    pytest.param(usage("plan", "--capability", "9", error=CAPABILITY + "'9'"), id="capability-9"),
    pytest.param(
        usage("plan", "--capability", "-1.0", error=CAPABILITY + "'-1.0'"), id="capability-negative"
    ),
    pytest.param(
        usage(
            "plan",
            "--device",
            "cuda",
            "--capability",
            "99.99",
            error="argument --capability: must be the compute capability of a CUDA GPU (3.0, "
            "3.2, 3.5, 3.7, 5.0, 5.2, 5.3, 6.0, 6.1, 6.2, 7.0, 7.2, 7.5, 8.0, 8.6, 8.7, 8.9, "
            "9.0, 10.0, 10.1, 10.3, 11.0, 12.0, 12.1), got '99.99'",
        ),
        id="capability-no-such-gpu",
    ),
    pytest.param(
        usage("plan", "--gpu-memory", "-80GiB", error="argument --gpu-memory: must be positive, got '-80GiB'"),
        id="plan-gpu-memory-negative",
    ),
    pytest.param(
        usage("plan", "--block-size", "-16", error="argument --block-size: must be an integer >= 1, got '-16'"),
        id="plan-block-size-negative",
    ),
    pytest.param(
        # A value that starts with "-" reaches the option's own check ...
        user("plan", "--device", "-x", error=DEVICES + "'-x'" + ANY),
        id="plan-device-dashed",
    ),
    pytest.param(
        # ... and an option of the command stays an option.
        usage("plan", "--backend", "--json", error="argument --backend: expected one argument"),
        id="plan-backend-without-value",
    ),
    pytest.param(
        user(
            "plan",
            "tests/fixtures/model-configs/qwen3-next-80b-a3b-instruct.json",
            "--tensor-parallel",
            "32",
            # 32 divides the 32 value heads but not the 16 key heads (nor the attention
            # layers' 16 query heads): the sizes given split every layer.
            error="plan_model: tensor_parallel=32 cannot split the gdn state of layer "
            "'model.layers.0.linear_attn' (group 0, 36 layers): its 16 key heads are not a "
            "multiple of 32 (tensor_parallel sizes that split every layer of this model: 1, "
            "2, 4, 8, 16)",
        ),
        id="plan-tensor-parallel-state-and-heads",
    ),
    # Choices.
    pytest.param(
        usage(
            "demo",
            "--dtype",
            "int8",
            error="argument --dtype: invalid choice: 'int8' (choose from 'bfloat16', 'float16', "
            "'float32')",
        ),
        id="demo-dtype",
    ),
    pytest.param(
        usage(
            "plan",
            "--model",
            "gpt",
            error="argument --example/--model: invalid choice: 'gpt' (choose from 'hybrid', "
            "'llama', 'gemma2', 'llama4')",
        ),
        id="plan-model",
    ),
    pytest.param(
        usage(
            "plan",
            "--gpu-memory",
            "80 gigs",
            error="argument --gpu-memory: must be a size such as 80GiB, 500MB or 4096 (bytes); "
            "units: B, KB, kB, MB, GB, TB, KiB, MiB, GiB, TiB; got '80 gigs'",
        ),
        id="plan-gpu-memory",
    ),
    pytest.param(
        user(
            "plan",
            "tests/fixtures/model-configs/no-such-model.json",
            error="CONFIG must be a config.json or a directory holding one; "
            "'tests/fixtures/model-configs/no-such-model.json' does not exist",
        ),
        id="plan-missing-config",
    ),
    pytest.param(
        usage(
            "demo",
            "--prefer",
            "cuda",
            error="argument --prefer: invalid choice: 'cuda' (choose from 'default', "
            "'reference', 'triton', 'flex')",
        ),
        id="demo-prefer",
    ),
    pytest.param(
        usage(
            "plan",
            "--strict",
            "--report-only",
            error="argument --report-only: not allowed with argument --strict",
        ),
        id="plan-strict-and-report-only",
    ),
    # Devices.
    pytest.param(user("demo", "--device", "tpu", error=DEVICES + "'tpu'" + ANY), id="demo-tpu"),
    pytest.param(user("plan", "--device", "meta", error=DEVICES + "'meta'" + ANY), id="plan-meta"),
    pytest.param(
        user("backends", "--device", "cuda:x", error=DEVICES + "'cuda:x'" + ANY),
        id="backends-bad-index",
    ),
    cuda_case("demo", "--device", "cuda", problem=CUDA_PROBLEM),
    cuda_case("demo", "--device", "cuda:7", problem=CUDA7_PROBLEM),
    # Backends and kinds in the settings.
    pytest.param(
        user("plan", "--backend", "nope", error="backend: unknown backend 'nope'; " + REGISTERED),
        id="plan-unknown-backend",
    ),
    pytest.param(
        user(
            "demo",
            "--backend-per-kind",
            "full_attention=nope",
            error="backend_per_kind['full_attention']: unknown backend 'nope'; " + REGISTERED,
        ),
        id="demo-per-kind-unknown-backend",
    ),
    pytest.param(
        user(
            "plan",
            "--backend-per-kind",
            "slidingwindow=reference",
            error=f"backend_per_kind: unknown kind 'slidingwindow'; {KINDS}",
        ),
        id="plan-per-kind-unknown-kind",
    ),
    pytest.param(
        user(
            "demo",
            "--backend-per-kind",
            "attention=reference",
            error=f"backend_per_kind: unknown kind 'attention'; {KINDS}",
        ),
        id="demo-per-kind-unknown-kind",
    ),
    pytest.param(
        user(
            "plan",
            "--backend-per-kind",
            "triton_attn",
            error="backend_per_kind entry 'triton_attn' must look like 'kind=backend' "
            "(e.g. 'sliding_window=triton_attn')",
        ),
        id="per-kind-without-equals",
    ),
    pytest.param(
        user(
            "demo",
            "--backend-per-kind",
            "full_attention=triton_attn,full_attention=reference",
            error="backend_per_kind: kind 'full_attention' is given twice",
        ),
        id="per-kind-twice",
    ),
    pytest.param(
        user(
            "plan",
            "--backend-per-kind",
            "full_attention=",
            error="backend_per_kind['full_attention'] must be a backend name, got ''",
        ),
        id="per-kind-empty-backend",
    ),
    # Backends that cannot serve what the demo asks.
    pytest.param(
        user(
            "demo",
            "--backend-per-kind",
            "mamba=triton_attn",
            error=CANNOT_SERVE.format(kind="mamba", spec="MambaSpec"),
            rest=("  - kind=mamba not supported (supported: " + ANY + "full_attention" + ANY, HINT),
        ),
        id="demo-backend-cannot-serve-kind",
    ),
    # plan: a layer without a backend fails, unless --report-only.
    pytest.param(
        Case(
            ("plan", "--backend-per-kind", "mamba=triton_attn"),
            "no backend for 1 of 4 layer group(s): layers.1, layers.3, layers.5 (mamba) "
            "(the report on stdout says why; --report-only exits 0)",
            status=1,
            report="layers.1, layers.3, layers.5: mamba (MambaSpec)\n  NO BACKEND\n",
        ),
        id="plan-layer-without-backend",
    ),
    pytest.param(
        Case(
            ("plan", "--backend-per-kind", "mamba=triton_attn", "--report-only"),
            None,
            status=0,
            report="layers.1, layers.3, layers.5: mamba (MambaSpec)\n  NO BACKEND\n",
        ),
        id="plan-layer-without-backend-report-only",
    ),
]


Result = subprocess.CompletedProcess[str]


def run_cli(argv: tuple[str, ...]) -> Result:
    return subprocess.run(
        [sys.executable, "-m", "attnkit", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )


# These runs start from worker threads of a process holding torch's threads. Under heavy
# load, one exec of the interpreter failed with EFAULT ("[Errno 14] Bad address") while
# the parent's other threads kept running in the vfork()ed address space; plain fork()
# (CPython's documented escape hatch) gives each child its own.
subprocess._USE_VFORK = False  # type: ignore[attr-defined]  # pyright: ignore[reportPrivateUsage]  # CPython escape hatch, not in typeshed


class Runs:
    """Each command line run once, two at a time (importing torch is most of each run)."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self.runs: dict[tuple[str, ...], Future[Result]] = {}

    def start(self, argv: tuple[str, ...]) -> None:
        if argv not in self.runs:
            self.runs[argv] = self.pool.submit(run_cli, argv)

    def result(self, argv: tuple[str, ...]) -> Result:
        self.start(argv)
        return self.runs[argv].result()


@pytest.fixture(scope="module")
def cli(request: pytest.FixtureRequest) -> Iterator[Runs]:
    """Starts the runs of every selected case of this module, in test order."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = Runs(pool)
        for item in request.session.items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            if item.module is sys.modules[__name__] and "argv" in params:
                runs.start(params["argv"])
            elif item.module is sys.modules[__name__] and "case" in params:
                runs.start(params["case"].argv)
        yield runs
        for future in runs.runs.values():
            future.cancel()


@pytest.mark.parametrize("case", CASES)
def test_bad_command_line(case: Case, cli: Runs) -> None:
    result = cli.result(case.argv)
    command = next((a for a in case.argv if a in ("backends", "plan", "demo")), None)
    prog = "attnkit" if command is None else f"attnkit {command}"
    assert result.returncode == case.status, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    expected: list[str] = []
    if case.error is not None:
        expected = [f"{prog}: error: {case.error}"]
        if case.usage:
            expected.append(f"see '{prog} --help'")
        expected.extend(case.rest)
    assert len(lines) == len(expected), result.stderr
    for line, want in zip(lines, expected, strict=True):
        assert pattern(want).fullmatch(line), (line, want)
    if case.report is None:
        assert result.stdout == ""
    else:
        assert case.report in result.stdout
        assert "error" not in result.stdout.lower()


@pytest.mark.parametrize(
    ("argv", "exception"),
    [
        pytest.param(
            ("--debug", "demo", "--device", "tpu"),
            "attnkit.errors.InvalidArgumentError: " + DEVICES + "'tpu'" + ANY,
            id="global-debug",
        ),
        pytest.param(
            ("plan", "--debug", "--backend", "nope"),
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for AttentionConfig",
            id="subcommand-debug",
        ),
    ],
)
def test_debug_shows_the_traceback(argv: tuple[str, ...], exception: str, cli: Runs) -> None:
    result = cli.result(argv)
    assert result.returncode == 1
    assert result.stderr.startswith("Traceback (most recent call last):\n")
    assert any(pattern(exception).fullmatch(line) for line in result.stderr.splitlines())
    assert ": error: " not in result.stderr
    assert result.stdout == ""
