"""The ``attnkit`` argument parser: no abbreviations, a bad command line exits with
status 2 naming the option; every subcommand's options and their checks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from typing_extensions import override

from ..config import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_BATCHED_TOKENS
from ..devices import CUDA_CAPABILITIES
from ..errors import InvalidArgumentError
from ..planner import parse_memory_size
from ..spec import KV_CACHE_DTYPES
from ._common import DTYPES, EXIT_USAGE
from ._demo import DEMO_MAX_STEPS
from ._plan import EXAMPLE_MODELS

_PLAN_HELP = """\
Plan a model's KV cache and backends: what attnkit.planner.plan_model computes, as
text or --json. CONFIG is a Hugging Face config.json or a directory holding one;
without it, --example NAME plans an example layout (default hybrid).

The text report: a table of layers (name, kind, state type, window, chunk, group,
backend), with a note for each group that falls back to the pure-torch reference
backend and why the others refused; each group with its backend, every skipped
candidate and why, its block size, the blocks a unified page holds (where more than
one) and blocks per request; then capacity: bytes per block, KV bytes per token,
windowed groups' per-request cap, state bytes per request, blocks per request, and
with --gpu-memory or --num-blocks the blocks, tokens and concurrent requests of
--max-model-len tokens that fit, and the CUDA-graph support with the group that
limits it. With --tensor-parallel N or --context-parallel N (the budget is then each
rank's), a per-rank section follows: how each group splits, the groups each rank
builds, and each rank's bytes, blocks, requests and longest request that fit.

--json writes the same plan as one object; docs/models.md lists its keys
(attnkit.planner.PLAN_JSON_KEYS) and what each holds."""


def _parse_capability(text: str) -> tuple[int, int]:
    major, sep, minor = text.partition(".")
    if not sep or not major.isdigit() or not minor.isdigit():
        raise argparse.ArgumentTypeError(
            f"must look like 9.0 (MAJOR.MINOR, digits only), got {text!r}"
        )
    capability = int(major), int(minor)
    if capability not in CUDA_CAPABILITIES:
        known = ", ".join(f"{a}.{b}" for a, b in CUDA_CAPABILITIES)
        raise argparse.ArgumentTypeError(
            f"must be the compute capability of a CUDA GPU ({known}), got {text!r}"
        )
    return capability


def int_range(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: a decimal integer ``>= low`` (and ``<= high`` if given).

    argparse prefixes the error with the option's name (``argument --steps: ...``).
    """
    allowed = f"an integer from {low} to {high}" if high is not None else f"an integer >= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    return parse


def _memory_size(text: str) -> int:
    try:
        return parse_memory_size(text, argument="the size")
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("the size ")) from None


class _Parser(argparse.ArgumentParser):
    """argparse without abbreviations; an error is ``prog: error: ...`` first, then a hint."""

    @override
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\nsee '{self.prog} --help'\n")


def _add_debug(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--debug",
        action="store_true",
        default=default,
        help="on an error, raise it with its traceback instead of one line on stderr",
    )


def _build() -> tuple[_Parser, dict[str, _Parser]]:
    parser = _Parser(
        prog="attnkit",
        description="attnkit: list the attention backends, plan a model's KV cache and "
        "backends, or run the demo (COMMAND --help for each command's options).",
        epilog="exit status: 0 done; 1 plan found a layer with no backend (without "
        "--report-only) or demo failed its check; 2 bad options or settings (one line on "
        "stderr; --debug raises the error with its traceback instead)",
        allow_abbrev=False,
    )
    _add_debug(parser, False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands: dict[str, _Parser] = {}

    def add(name: str, summary: str) -> _Parser:
        # parser_class is _Parser: add_subparsers passes type(parser).
        command = sub.add_parser(name, help=summary, allow_abbrev=False)
        # SUPPRESS: without --debug here, the top-level value stays.
        _add_debug(command, argparse.SUPPRESS)
        commands[name] = command
        return command

    backends = add("backends", "list registered backends and their availability")
    backends.add_argument(
        "--device", default="cpu", help="device to check availability on: cpu, cuda, cuda:N"
    )
    backends.add_argument("--json", action="store_true", help="print JSON instead of text")

    plan = add(
        "plan",
        "plan a model's groups, backends and KV-cache capacity from its config.json",
    )
    plan.description = _PLAN_HELP
    plan.formatter_class = argparse.RawDescriptionHelpFormatter
    plan.add_argument(
        "config",
        nargs="?",
        default=None,
        metavar="CONFIG",
        help="a Hugging Face config.json, or a directory holding one (without it: --example)",
    )
    plan.add_argument(
        "--example",
        "--model",
        dest="example",
        choices=EXAMPLE_MODELS,
        default=None,
        help="an example layout instead of a CONFIG (default hybrid); --model is an alias",
    )
    plan.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="model dtype (default: the config's torch_dtype; examples: bfloat16)",
    )
    plan.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="attention cache storage dtype (CONFIG only; default auto: the model dtype)",
    )
    plan.add_argument(
        "--state-dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="recurrent-state dtype of state layers (CONFIG only; default float32, what "
        "the built-in state backends keep); conv states take the model dtype",
    )
    plan.add_argument(
        "--block-size",
        type=int_range(1),
        default=16,
        help="tokens per block as declared (CONFIG only; default 16): the kernels' block; "
        "a unified page may hold several, and the plan shows how many",
    )
    plan.add_argument(
        "--max-model-len",
        type=int_range(1),
        default=DEFAULT_MAX_MODEL_LEN,
        help=f"tokens per request for the per-request bound (default {DEFAULT_MAX_MODEL_LEN})",
    )
    plan.add_argument(
        "--max-num-batched-tokens",
        type=int_range(1),
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="most tokens of one step (windowed layers keep a step's tokens beyond their "
        f"window until it ends; default {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    budget = plan.add_mutually_exclusive_group()
    budget.add_argument(
        "--gpu-memory",
        type=_memory_size,
        default=None,
        metavar="SIZE",
        help="KV-cache memory (each rank's with --tensor-parallel or --context-parallel): "
        "80GiB, 500MB, 1.5TiB or bytes (B, kB/KB, MB, GB, TB, KiB, MiB, GiB, TiB)",
    )
    budget.add_argument(
        "--num-blocks",
        type=int_range(2),
        default=None,
        help="the pool's size in blocks (each rank's), the null block included, instead of "
        "--gpu-memory",
    )
    plan.add_argument(
        "--tensor-parallel",
        type=int_range(1),
        default=1,
        metavar="N",
        help="plan for N tensor-parallel ranks: heads split (K/V heads replicated when "
        "fewer than N, MLA latents on every rank); the report adds what each rank holds",
    )
    plan.add_argument(
        "--context-parallel",
        type=int_range(1),
        default=1,
        metavar="N",
        help="plan for N decode context-parallel ranks: full and MLA caches shard "
        "their tokens (token t on rank t mod N), bounded caches replicate; the report adds "
        "each rank's memory and the longest request it holds",
    )
    plan.add_argument(
        "--state-checkpoints",
        choices=("none", "step_end"),
        default="none",
        help="state layers' checkpoint policy for the prefix cache",
    )
    plan.add_argument(
        "--checkpoint-interval",
        type=int_range(1),
        default=None,
        metavar="N",
        help="tokens between state checkpoints (default: lcm of the block sizes)",
    )
    plan.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    plan.add_argument(
        "--capability", type=_parse_capability, default=None, help="CUDA capability, e.g. 9.0"
    )
    plan.add_argument("--backend", default=None, help="one backend for every kind it serves")
    plan.add_argument(
        "--backend-per-kind",
        default=None,
        help="kind=backend pairs, e.g. sliding_window=triton_attn,full_attention=reference",
    )
    plan.add_argument(
        "--determinism",
        default="none",
        metavar="LEVEL",
        help="the level every backend must keep, none .. prefix_hit_invariant "
        "(docs/determinism.md)",
    )
    plan.add_argument(
        "--json", action="store_true", help="print the plan as JSON (keys: see above)"
    )
    exits = plan.add_mutually_exclusive_group()
    exits.add_argument(
        "--report-only",
        action="store_true",
        help="exit 0 even if a layer has no backend (default: exit 1)",
    )
    exits.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 if a layer has no backend (the default; kept for old scripts)",
    )

    demo = add("demo", "serve a tiny hybrid model and check every step")
    demo.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (must exist here)")
    demo.add_argument(
        "--backend-per-kind",
        default=None,
        help="kind=backend pairs, e.g. full_attention=triton_attn,sliding_window=triton_attn",
    )
    demo.add_argument(
        "--steps",
        type=int_range(1, DEMO_MAX_STEPS),
        default=8,
        help=f"decode steps per request, 1 to {DEMO_MAX_STEPS}",
    )
    demo.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    which = demo.add_mutually_exclusive_group()
    which.add_argument(
        "--config",
        default=None,
        metavar="CONFIG",
        help="a Hugging Face config.json (or its directory): run the model's layer kinds "
        "in its order, the first two layers of each kind, with the demo's small sizes "
        "(encoder-only models encode whole prompts; encoder-decoder models encode, then "
        "decode)",
    )
    which.add_argument(
        "--model",
        choices=("default", "hybrid"),
        default="default",
        help="default: full, sliding-window and Mamba2 layers; hybrid: also Gated DeltaNet, "
        "linear attention and short conv",
    )
    from ..integrations.transformers import SUPPORTED_MODEL_TYPES

    which.add_argument(
        "--hf-family",
        choices=SUPPORTED_MODEL_TYPES,
        default=None,
        metavar="NAME",
        help="run a tiny random-weight transformers model of this family "
        f"({', '.join(SUPPORTED_MODEL_TYPES)}) through the engine loop (3 requests, chunked "
        "prefill, interleaved decodes) and check every step's logits against transformers' "
        "eager attention; needs pip install 'attnkit[transformers]'",
    )
    demo.add_argument(
        "--prefer",
        choices=("default", "reference", "triton", "flex"),
        default="default",
        help="default: the device's priority list (on CPU cpu_attn, attnkit's CPU "
        "engines, for the attention kinds it serves); reference: the reference backend "
        "for every kind; triton: try the Triton backends first for every kind (on CPU, "
        "under the interpreter); flex: flex_attention (compiled FlexAttention) first; on "
        "CPU each new shape compiles for seconds",
    )
    demo.add_argument(
        "--context-parallel",
        type=int_range(1),
        default=1,
        metavar="N",
        help="run the demo on N local processes, one decode context-parallel rank each "
        "(torch.distributed, gloo; CPU): full and MLA caches keep token t on rank t mod N; "
        "rank 0 reports, every rank checks its steps, and each rank's peak KV blocks are shown",
    )
    return parser, commands


def build_parser() -> argparse.ArgumentParser:
    """The ``attnkit`` argument parser (no abbreviations, errors exit with status 2)."""
    return _build()[0]


def _join_dashed_values(
    argv: Sequence[str], parsers: Sequence[argparse.ArgumentParser]
) -> list[str]:
    """``--gpu-memory -80GiB`` as ``--gpu-memory=-80GiB``.

    argparse takes a value that starts with ``-`` (other than a plain negative number)
    for an option and reports "expected one argument"; joined to its option, the value
    reaches the option's own check, which says what is wrong with it. A token that is
    an option of the command stays an option.
    """
    actions = [a for p in parsers for a in p._actions]  # argparse has no public list
    options = {o for a in actions for o in a.option_strings}
    takes_value = {o for a in actions if a.nargs is None for o in a.option_strings}
    joined: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            joined.extend(argv[i:])
            break
        value = argv[i + 1] if i + 1 < len(argv) else None
        if (
            token in takes_value
            and value is not None
            and value.startswith("-")
            and value.partition("=")[0] not in options
        ):
            joined.append(f"{token}={value}")
            i += 2
        else:
            joined.append(token)
            i += 1
    return joined


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser, commands = _build()
    argv = _join_dashed_values(sys.argv[1:] if argv is None else argv, [parser, *commands.values()])
    args, extra = parser.parse_known_args(argv)
    if extra:
        # Report unknown options from the subcommand, with the options it does take.
        command = commands[args.command]
        actions = command._actions  # argparse has no public list of its options
        options = sorted(
            {o for a in actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        )
        command.error(
            f"unrecognized arguments: {' '.join(extra)} ({args.command} takes {', '.join(options)})"
        )
    return args
