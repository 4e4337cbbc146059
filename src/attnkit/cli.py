"""The ``attnkit`` command.

``attnkit backends``  every registered backend, what it serves, and whether it can run
                      here (with the reasons when it cannot).
``attnkit plan``      a capacity plan for a model's ``config.json`` (or an example
                      layout): layer -> kind -> group -> backend, with every skipped
                      candidate and why; the unified page and block sizes the runtime
                      runs; bytes per token and per request; blocks, tokens and
                      concurrent requests that fit in ``--gpu-memory``.
``attnkit demo``      serve a tiny hybrid model (full, sliding-window and Mamba2 layers,
                      or with ``--config`` a real model's layer kinds, shrunk: any kind,
                      encoder-only and encoder-decoder models included) through the
                      runtime, checking every step against a dense recompute; with
                      ``--hf-family NAME`` a tiny transformers model through the engine
                      loop, checking every step against transformers' eager attention.

Output and exit status: reports go to stdout, errors to stderr. A user error (a bad
option value, an unknown backend or kind, a backend that cannot serve what was asked,
an absent device) prints ``attnkit <command>: error: <what is wrong>`` (a
``NoBackendError`` follows with its reasons, one per line) and exits with status 2,
without a traceback; ``--debug`` lets the exception propagate with its traceback
instead. Status 1: ``plan`` found a layer with no backend (unless ``--report-only``),
or ``demo`` failed its check against the dense recompute. Option names are never
abbreviated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import NoReturn, TextIO

import pydantic
import torch
from typing_extensions import override

from .config import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_BATCHED_TOKENS, AttentionConfig
from .devices import check_device_available, device_problem, parse_device
from .errors import AttnkitError, DeviceUnavailableError, InvalidArgumentError, PluginError
from .kinds import rules_for
from .models import ModelLayout, layout_from_hf_config
from .planner import GroupSplit, ModelPlan, RankPlan, format_bytes, parse_memory_size, plan_model
from .registry import BackendRegistry, call_backend_code, default_registry
from .selector import DEFAULT_PRIORITY
from .spec import (
    KV_CACHE_DTYPES,
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

__all__ = [
    "DEMO_MAX_STEPS",
    "EXAMPLE_MODELS",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "BackendRow",
    "backend_rows",
    "build_parser",
    "example_model",
    "main",
]

EXAMPLE_MODELS = ("hybrid", "llama", "gemma2", "llama4")

EXIT_FAILED = 1
"""``plan``: a layer has no backend (without ``--report-only``); ``demo``: a step failed
its check."""
EXIT_USAGE = 2
"""A user error: bad options, or a configuration attnkit rejects."""

_PLAN_HELP = """\
Plan a model's KV cache and backends: what attnkit.planner.plan_model computes, as
text or --json. CONFIG is a Hugging Face config.json or a directory holding one;
without it, --example NAME plans an example layout (default hybrid).

The text report: a table of layers (name, kind, state type, window, chunk, group,
backend); each group with its backend, every skipped candidate and why, its block
size (scaled to the unified page where the runtime scales it) and blocks per request;
then capacity: bytes per block, KV bytes per token, windowed groups' per-request cap,
state bytes per request, blocks per request, and with --gpu-memory or --num-blocks
the blocks, tokens and concurrent requests of --max-model-len tokens that fit, and
the CUDA-graph support with the group that limits it. With --tensor-parallel N or
--context-parallel N (the budget is then each rank's), a per-rank section follows:
how each group splits (query, K/V and state heads per rank; which caches shard their
tokens over the context-parallel ranks), the groups each rank builds, and each rank's
bytes per token and per request, blocks, requests and longest request that fit.

--json writes one object with these keys, in this order: model_type, source, device,
capability, dtype, max_model_len, max_num_batched_tokens, layers (each: name, kind,
mamba_type, sliding_window, attention_chunk_size, group, backend), groups (each:
group, kind, spec, layers, block_size, declared_block_size, page_size_bytes,
bytes_per_token, blocks_per_request, per_request_cap_bytes, backend, chosen_by,
layout, buffer_set, cudagraph_support, skipped [{backend, reasons}], error),
page_size_bytes, buffers, bytes_per_block, kv_bytes_per_token,
state_bytes_per_request, blocks_per_request, bytes_per_request, memory_bytes,
num_blocks, usable_blocks, tokens_that_fit, max_concurrency, cudagraph_support,
cudagraph_limited_by, unserved_groups, tensor_parallel, context_parallel, per_rank
(tensor_parallel, context_parallel, world_size, context_tokens, splits [{group,
query_heads, kv_heads, kv_replicas, state_shapes, page_size_bytes, context, detail}],
groups [{group, kind, spec, model_groups, num_layers, block_size, page_size_bytes,
bytes_per_token, blocks_per_request, per_request_cap_bytes, context_sharded, layout}],
page_size_bytes, buffers, bytes_per_block, kv_bytes_per_token,
state_bytes_per_request, blocks_per_request, bytes_per_request, memory_bytes,
num_blocks, usable_blocks, tokens_that_fit, max_concurrency, max_context_tokens).
Absent values are null (no budget: no num_blocks, tokens_that_fit or
max_concurrency). docs/models.md and docs/architecture.md have the details."""

DEMO_MAX_STEPS = 10_000
"""Most decode steps ``attnkit demo`` takes (the sequences stay far below
``AttentionConfig.max_model_len``)."""


def example_model(name: str, *, dtype: torch.dtype = torch.bfloat16) -> dict[str, KVCacheSpec]:
    """Layer specs of a small example model (what an engine would hand attnkit).

    ``hybrid``: full, sliding-window, chunked-local and Mamba2 layers; ``llama``: full
    attention; ``gemma2``: alternating full and sliding-window; ``llama4``: chunked
    local with every fourth layer full.
    """
    bs, heads, size = 16, 8, 128
    full = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=size, dtype=dtype)
    window = SlidingWindowSpec(
        block_size=bs, num_kv_heads=heads, head_size=size, dtype=dtype, sliding_window=4096
    )
    chunked = ChunkedLocalAttentionSpec(
        block_size=bs, num_kv_heads=heads, head_size=size, dtype=dtype, attention_chunk_size=8192
    )
    mamba = MambaSpec(
        block_size=16,
        shapes=((2 * 4096 + 2 * 128, 3), (64, 64, 128)),
        dtypes=(dtype, torch.float32),
        mamba_type="mamba2",
    )
    layouts: dict[str, list[KVCacheSpec]] = {
        "hybrid": [full, mamba, window, mamba, chunked, mamba],
        "llama": [full] * 4,
        "gemma2": [window, full] * 3,
        "llama4": [chunked, chunked, chunked, full] * 2,
    }
    if name not in layouts:
        raise ValueError(
            f"unknown example model {name!r}; choose one of {', '.join(EXAMPLE_MODELS)}"
        )
    return {f"layers.{i}": spec for i, spec in enumerate(layouts[name])}


def _parse_capability(text: str) -> tuple[int, int]:
    major, sep, minor = text.partition(".")
    if not sep or not major.isdigit() or not minor.isdigit():
        raise argparse.ArgumentTypeError(
            f"must look like 9.0 (MAJOR.MINOR, digits only), got {text!r}"
        )
    return int(major), int(minor)


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


@dataclasses.dataclass
class BackendRow:
    """One line of ``attnkit backends``."""

    name: str
    origin: str
    source: str
    kinds: list[str]
    devices: list[str]
    available: bool
    reasons: list[str]
    description: str


def backend_rows(registry: BackendRegistry, device: torch.device) -> list[BackendRow]:
    """Every backend (loading plugins), excluded plugins last, with availability on ``device``."""
    rows: list[BackendRow] = []
    for entry in registry.load_all():
        backend = entry.backend
        if backend is None:
            rows.append(
                BackendRow(
                    entry.name,
                    entry.origin,
                    entry.source,
                    [],
                    [],
                    False,
                    [f"excluded: {entry.error}"],
                    "",
                )
            )
            continue
        # A plugin's hooks run behind the plugin guard: what they raise becomes a
        # reason on its row (the PluginError's message), not an error of the listing.
        reasons: list[str] = []
        kinds: list[str] = []
        try:
            declared = call_backend_code(entry, "supported_kinds()", backend.supported_kinds)
            kinds = sorted(k.value for k in declared)
        except PluginError as exc:
            reasons.append(str(exc))
        for what, hook in (
            ("environment_reasons()", backend.environment_reasons),
            ("device_reasons()", backend.device_reasons),  # the device is absent here
        ):
            try:
                found = call_backend_code(entry, what, partial(hook, device))
            except PluginError as exc:
                found = [str(exc)]
            reasons += [r for r in found if r not in reasons]
        rows.append(
            BackendRow(
                name=entry.name,
                origin=entry.origin,
                source=entry.source,
                kinds=kinds,
                devices=sorted(backend.supported_devices),
                available=not reasons,
                reasons=reasons,
                description=backend.description,
            )
        )
    return rows


@dataclasses.dataclass
class _Streams:
    prog: str
    out: TextIO
    err: TextIO

    def note(self, text: str) -> None:
        self.err.write(f"{self.prog}: note: {text}\n")

    def error(self, text: str) -> None:
        """``prog: error: <first line>``, then the other lines as they are."""
        first, *rest = text.splitlines() or [""]
        self.err.write(f"{self.prog}: error: {first}\n" + "".join(f"{line}\n" for line in rest))


def _inspected_device(args: argparse.Namespace, io: _Streams) -> torch.device:
    """``--device`` of ``backends`` and ``plan``: these describe a device, so an absent
    one is reported on stderr (as a note) rather than refused."""
    device = parse_device(args.device, argument="--device")
    problem = device_problem(device)
    if problem is not None:
        io.note(f"{problem}; showing what attnkit reports for it")
    return device


def cmd_backends(args: argparse.Namespace, registry: BackendRegistry, io: _Streams) -> int:
    device = _inspected_device(args, io)
    out = io.out
    rows = backend_rows(registry, device)
    # The device's default order, as far as these backends are registered: a layer gets
    # the first one that serves it, so the first is the device's default.
    listed = {row.name for row in rows}
    order = [name for name in DEFAULT_PRIORITY.get(device.type, ()) if name in listed]
    if args.json:
        json.dump(
            {
                "device": str(device),
                "default_order": order,
                "backends": [dataclasses.asdict(r) for r in rows],
            },
            out,
            indent=2,
        )
        out.write("\n")
        return 0
    if not rows:
        out.write("no backends are registered\n")
        return 0
    out.write(f"backends on {device}:\n")
    if order:
        then = f", then {', '.join(order[1:])}" if len(order) > 1 else ""
        out.write(
            f"  default on {device.type}: {order[0]}{then} (each layer gets the first that "
            "serves it)\n"
        )
    for row in rows:
        status = "available" if row.available else "unavailable"
        if order and row.name == order[0]:
            status += f" (default on {device.type})"
        out.write(
            f"  {row.name} [{row.origin}] {status}\n    kinds: {', '.join(row.kinds) or '-'}\n"
        )
        if row.description:
            out.write(f"    {row.description}\n")
        for reason in row.reasons:
            out.write(f"    - {reason}\n")
    return 0


def _names(names: Sequence[str]) -> str:
    """Layer names for a group's header: all of them, or the first two and the last."""
    if len(names) <= 4:
        return ", ".join(names)
    return f"{names[0]}, {names[1]}, ..., {names[-1]} ({len(names)} layers)"


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _bytes(value: int) -> str:
    shown = format_bytes(value)
    return f"{value} B" if shown.endswith(" B") else f"{value} B ({shown})"


def _pool_lines(
    pool: ModelPlan | RankPlan, memory_bytes: int, num_blocks: int
) -> list[tuple[str, str]]:
    """The memory and capacity lines of a pool with a budget (one device or one rank)."""
    lines = [
        (
            "memory",
            f"{_bytes(memory_bytes)} -> {num_blocks} blocks "
            f"({pool.usable_blocks} usable; block 0 is the null block)",
        )
    ]
    if pool.max_concurrency is None:
        lines.append(("capacity", "unbounded by the cache (the model caches nothing)"))
    else:
        lines.append(("tokens that fit", str(pool.tokens_that_fit)))
        lines.append(
            ("concurrent requests", f"{pool.max_concurrency} of {pool.max_model_len} tokens")
        )
    return lines


def _write_plan(out: TextIO, plan: ModelPlan, title: str) -> None:
    """The plan as text: layers, groups with their backends, capacity."""
    out.write(f"{title}\n")
    dtype = str(plan.dtype).removeprefix("torch.") if plan.dtype is not None else None
    if dtype is not None:
        out.write(f"dtype {dtype}\n")
    out.write("\nlayers:\n")
    rows = [("layer", "kind", "state", "window", "chunk", "group", "backend")]
    for layer in plan.layers:
        rows.append(
            (
                layer.name,
                layer.kind,
                layer.mamba_type or "-",
                str(layer.sliding_window or "-"),
                str(layer.attention_chunk_size or "-"),
                str(layer.group),
                plan.groups[layer.group].backend_name or "NONE",
            )
        )
    out.writelines(line + "\n" for line in _table(rows))
    out.write(f"\ngroups (unified page {plan.page_size_bytes} B):\n")
    for g in plan.groups:
        group = g.group
        out.write(
            f"\n{_names(group.layer_names)}: {group.kind.value} ({type(group.spec).__name__})\n"
        )
        if g.selection is None:
            out.write(
                "  NO BACKEND\n" + "".join(f"    {line}\n" for line in (g.error or "").splitlines())
            )
        else:
            out.write(f"  -> {g.selection.backend_name} (chosen by {g.selection.source})\n")
            for rejection in g.rejected:
                out.write(f"     skipped {rejection}\n")
        if not group.has_cache:
            out.write(f"  group {group.group_id}: no cache\n")
            continue
        spec, declared = group.spec, group.original_spec
        scaled = (
            f" (declared {declared.block_size}, scaled to the unified page)"
            if spec.block_size != declared.block_size
            else ""
        )
        size = (
            f"block size {spec.block_size}{scaled}, "
            if isinstance(spec, AttentionSpec)
            else f"state {spec.page_size_bytes} B per layer, "
        )
        out.write(
            f"  group {group.group_id}: {size}{len(group.layer_names)} layer(s), layout "
            f"{g.layout}, at most {g.blocks_per_request} block(s) per request\n"
        )
    out.write(
        f"\ncapacity (max_model_len {plan.max_model_len}, max_num_batched_tokens "
        f"{plan.max_num_batched_tokens}):\n"
    )
    sets = ", ".join(f"{name} {count}" for name, count in sorted(plan.buffers.items()))
    lines = [
        (
            "page",
            f"{plan.page_size_bytes} B in {sum(plan.buffers.values())} layer buffer(s)"
            f" ({sets or 'none'}) = {_bytes(plan.bytes_per_block)} per block",
        ),
        ("KV per token", f"{_bytes(plan.kv_bytes_per_token)} (attention layers)"),
    ]
    for g in plan.groups:
        if g.per_request_cap_bytes is None:
            continue
        bound = _bound(g.group.spec)
        lines.append(
            (
                f"group {g.group.group_id}",
                f"{g.bytes_per_token} B per token up to its {bound}; at most "
                f"{_bytes(g.per_request_cap_bytes)} per request",
            )
        )
    lines.append(("state per request", _bytes(plan.state_bytes_per_request)))
    per_group = ", ".join(f"group {g.group.group_id}: {g.blocks_per_request}" for g in plan.groups)
    lines.append(
        (
            "blocks per request",
            f"{plan.blocks_per_request} ({per_group}) = {_bytes(plan.bytes_per_request)}",
        )
    )
    if plan.memory_bytes is None:
        lines.append(("memory", "not given (--gpu-memory or --num-blocks)"))
    elif plan.num_blocks is None:
        lines.append(
            (
                "memory",
                f"{_bytes(plan.memory_bytes)} holds fewer than 2 blocks of the whole model "
                "(see per rank)",
            )
        )
    else:
        lines.extend(_pool_lines(plan, plan.memory_bytes, plan.num_blocks))
    cg = plan.cudagraph()
    lines.append(
        (
            "CUDA graphs",
            f"{cg[0].name} (limited by {cg[1]})"
            if cg is not None
            else "unknown (a group has no backend)",
        )
    )
    width = max(len("concurrent requests:"), *(len(label) + 1 for label, _ in lines))
    out.writelines(f"  {(label + ':').ljust(width)} {text}\n" for label, text in lines)
    if plan.per_rank.world_size > 1:
        _write_per_rank(out, plan)


def _bound(spec: KVCacheSpec) -> str:
    """``window 4096`` / ``chunk 8192``: what bounds a windowed group's cache."""
    return rules_for(spec).bound_label(spec) or "no bound"


def _placement(split: GroupSplit, cp: int) -> str:
    """How context parallelism places the group, after ``; `` (nothing to say at cp 1)."""
    if split.context == "none":
        return "; no cache"
    if cp == 1:
        return ""
    if split.context == "sharded":
        return f"; context sharded (token t on rank t mod {cp})"
    return f"; context replicated on each of the {cp} context-parallel ranks"


def _write_per_rank(out: TextIO, plan: ModelPlan) -> None:
    """What each rank holds with --tensor-parallel / --context-parallel: the split of
    every model group, the rank's groups, and its capacity."""
    rank = plan.per_rank
    tp, cp = rank.tensor_parallel, rank.context_parallel
    out.write(
        f"\nper rank (tensor_parallel {tp} x context_parallel {cp} = {rank.world_size} "
        "ranks; --gpu-memory and --num-blocks are each rank's, the capacity above is the "
        "whole model on one device):\n"
    )
    for split in rank.splits:
        model = plan.groups[split.group_id]
        out.write(f"  {model.describe()}: {split.detail}{_placement(split, cp)}\n")
    out.write("groups on each rank:\n")
    for g in rank.groups:
        group = g.group
        if not group.has_cache:
            out.write(f"  {g.describe()}: no cache\n")
            continue
        spec = group.spec
        if isinstance(spec, AttentionSpec):
            declared = group.original_spec.block_size
            scaled = (
                f" (declared {declared}, scaled to the rank's page)"
                if spec.block_size != declared
                else ""
            )
            heads = (
                f"latent {spec.head_size}"
                if rules_for(spec).latent
                else f"{spec.num_kv_heads} K/V head(s)"
            )
            size = f"block size {spec.block_size}{scaled}, {heads}, "
        else:
            size = f"state {spec.page_size_bytes} B per layer, "
        out.write(
            f"  {g.describe()}: {size}{len(group.layer_names)} layer(s), at most "
            f"{g.blocks_per_request} block(s) per request\n"
        )
    sets = ", ".join(f"{name} {count}" for name, count in sorted(rank.buffers.items()))
    lines = [
        (
            "page",
            f"{rank.page_size_bytes} B in {sum(rank.buffers.values())} layer buffer(s)"
            f" ({sets or 'none'}) = {_bytes(rank.bytes_per_block)} per block",
        ),
        (
            "KV per token",
            f"{_bytes(rank.kv_bytes_per_token)} (attention layers, on a rank that holds "
            "the token)",
        ),
    ]
    if cp > 1 and any(g.context_sharded for g in rank.groups):
        lines.append(
            (
                "context per rank",
                f"{rank.context_tokens} of {plan.max_model_len} tokens in sharded groups",
            )
        )
    for g in rank.groups:
        if g.per_request_cap_bytes is not None:
            lines.append(
                (
                    f"group {g.group.group_id}",
                    f"{g.bytes_per_token} B per token up to its {_bound(g.group.spec)}; at "
                    f"most {_bytes(g.per_request_cap_bytes)} per request",
                )
            )
    lines.append(("state per request", _bytes(rank.state_bytes_per_request)))
    per_group = ", ".join(f"group {g.group.group_id}: {g.blocks_per_request}" for g in rank.groups)
    lines.append(
        (
            "blocks per request",
            f"{rank.blocks_per_request} ({per_group}) = {_bytes(rank.bytes_per_request)}",
        )
    )
    if rank.memory_bytes is None or rank.num_blocks is None:
        lines.append(("memory", "not given (--gpu-memory or --num-blocks)"))
    else:
        lines.extend(_pool_lines(rank, rank.memory_bytes, rank.num_blocks))
        longest = rank.max_context_tokens
        lines.append(
            (
                "max context",
                f"{longest} tokens (one request alone in the pool)"
                if longest is not None
                else "unbounded by the cache (no cached layer grows with the context)",
            )
        )
    width = max(len("concurrent requests:"), *(len(label) + 1 for label, _ in lines))
    out.write("capacity per rank:\n")
    out.writelines(f"  {(label + ':').ljust(width)} {text}\n" for label, text in lines)


def _check_config_path(path: str) -> None:
    if not os.path.exists(path):
        raise InvalidArgumentError(
            f"CONFIG must be a config.json or a directory holding one; {path!r} does not exist"
        )


def cmd_plan(args: argparse.Namespace, registry: BackendRegistry, io: _Streams) -> int:
    """``attnkit plan``: see ``build_parser`` and docs/models.md for options and JSON."""
    config = AttentionConfig.model_validate(
        {
            "backend": args.backend,
            "backend_per_kind": args.backend_per_kind or {},
            "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
        context={"registry": registry},
    )
    device = parse_device(args.device, argument="--device")
    problem = device_problem(device)
    # An absent CUDA device with an explicit capability is a plan for hardware this
    # machine lacks; without a capability there is nothing to plan for.
    capability: tuple[int, int] | None = args.capability
    hypothetical = problem is not None and capability is not None
    if problem is not None and capability is not None:
        io.note(
            f"{problem}; planning for it as a hypothetical device of capability "
            f"{capability[0]}.{capability[1]} (installed packages still count)"
        )
    elif problem is not None:
        io.note(f"{problem}; pass --capability X.Y to plan for it as a hypothetical device")
    dtype = _DTYPES[args.dtype] if args.dtype is not None else None
    model: ModelLayout | dict[str, KVCacheSpec]
    if args.config is not None:
        if args.example is not None:
            raise InvalidArgumentError(
                f"give CONFIG or --example, not both; got CONFIG {args.config!r} and "
                f"--example {args.example}"
            )
        _check_config_path(args.config)
        model = layout_from_hf_config(
            args.config,
            dtype=dtype,
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
            state_dtype=_DTYPES[args.state_dtype],
        )
        source = args.config
        title = f"model {model.model_type} ({args.config})"
    else:
        name = args.example or "hybrid"
        changed = [
            option
            for option, value, default in (
                ("--block-size", args.block_size, 16),
                ("--kv-cache-dtype", args.kv_cache_dtype, "auto"),
                ("--state-dtype", args.state_dtype, "float32"),
            )
            if value != default
        ]
        if changed:
            raise InvalidArgumentError(
                f"{', '.join(changed)} applies to a CONFIG; the example models use "
                f"block size 16 and kv-cache dtype auto (got --example {name})"
            )
        model = example_model(name, dtype=dtype or torch.bfloat16)
        source = f"example:{name}"
        title = f"model {name}"
    memory: int | None = args.gpu_memory
    try:
        plan = plan_model(
            model,
            config,
            device=device,
            capability=capability,
            hypothetical_device=hypothetical,
            registry=registry,
            memory_bytes=memory,
            num_blocks=args.num_blocks,
            tensor_parallel=args.tensor_parallel,
            context_parallel=args.context_parallel,
        )
    except InvalidArgumentError as exc:
        # The pool's check names the library's argument; say which option it was.
        text = str(exc)
        if memory is None or not text.startswith(f"memory_budget_bytes={memory} "):
            raise
        raise InvalidArgumentError(
            f"--gpu-memory {memory} B" + text.removeprefix(f"memory_budget_bytes={memory}")
        ) from exc
    out = io.out
    if args.json:
        json.dump(plan.to_json(source), out, indent=2)
        out.write("\n")
    else:
        _write_plan(out, plan, f"{title} on {device} ({config.describe()})")
    unserved = [f"{_names(g.group.layer_names)} ({g.group.kind.value})" for g in plan.unserved]
    if not unserved:
        return 0
    if not args.json:
        out.write(f"\n{len(unserved)} group(s) have no backend\n")
    if args.report_only:
        return 0
    io.error(
        f"no backend for {len(unserved)} of {len(plan.groups)} layer group(s): "
        f"{'; '.join(unserved)} (the report on stdout says why; --report-only exits 0)"
    )
    return EXIT_FAILED


def _memory_size(text: str) -> int:
    try:
        return parse_memory_size(text, argument="the size")
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("the size ")) from None


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cmd_demo(args: argparse.Namespace, registry: BackendRegistry, io: _Streams) -> int:
    device = parse_device(args.device, argument="--device")
    try:
        check_device_available(device)
    except DeviceUnavailableError as exc:
        raise DeviceUnavailableError(
            f"--device {args.device}: {exc} (--device cpu runs anywhere)"
        ) from exc
    if device.type == "cpu" and "triton" not in sys.modules:
        # Triton kernels run on CPU tensors only under its interpreter, which must be
        # chosen before triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Check the settings before building the model (run_demo checks them again).
    AttentionConfig.model_validate(
        {"backend_per_kind": args.backend_per_kind or {}}, context={"registry": registry}
    )
    if args.hf_family is not None:
        return _demo_hf(args, registry, io, device)
    from .demo import TOLERANCE, demo_layout, run_demo

    layout: tuple[str, ...] | None = None
    name: str = args.model
    if args.config is not None:
        _check_config_path(args.config)
        model = layout_from_hf_config(args.config)
        layout = demo_layout(model)
        name = f"{model.model_type} ({args.config}: {', '.join(layout)})"
    dtype = _DTYPES[args.dtype]
    if args.context_parallel > 1:
        return _demo_context_parallel(args, io, device, layout, name)
    result = run_demo(
        layout=layout,
        device=str(device),
        backend_per_kind=args.backend_per_kind,
        decode_steps=args.steps,
        dtype=dtype,
        out=io.out,
        registry=registry,
        model_name=name,
        prefer=args.prefer,
    )
    if result.passed:
        return 0
    io.error(
        f"the runtime's outputs differ from the dense recompute: max|err| "
        f"{result.max_error:.2e} > tolerance {TOLERANCE[dtype]:.0e} for {args.dtype}"
    )
    return EXIT_FAILED


def _demo_context_parallel(
    args: argparse.Namespace,
    io: _Streams,
    device: torch.device,
    layout: tuple[str, ...] | None,
    name: str,
) -> int:
    """``demo --context-parallel N``: the demo on N local gloo processes."""
    from .demo import TOLERANCE, run_demo_context_parallel

    if device.type != "cpu":
        raise InvalidArgumentError(
            f"--context-parallel {args.context_parallel}: the demo's ranks are local gloo "
            f"processes on the CPU; got --device {args.device}"
        )
    dtype = _DTYPES[args.dtype]
    result = run_demo_context_parallel(
        args.context_parallel,
        out=io.out,
        layout=layout,
        device="cpu",
        backend_per_kind=args.backend_per_kind,
        decode_steps=args.steps,
        dtype=dtype,
        model_name=name,
        prefer=args.prefer,
    )
    if result.passed:
        return 0
    io.error(
        f"a context-parallel rank's outputs differ from the dense recompute: max|err| "
        f"{result.max_error:.2e} > tolerance {TOLERANCE[dtype]:.0e} for {args.dtype}"
    )
    return EXIT_FAILED


def _demo_hf(
    args: argparse.Namespace, registry: BackendRegistry, io: _Streams, device: torch.device
) -> int:
    """``demo --hf-family NAME``: a tiny transformers model through the engine loop, every
    step checked against transformers' eager attention."""
    from .integrations.engine import Engine, SamplingParams
    from .integrations.transformers import attach, check_against_eager, describe_layers, tiny_model

    dtype = _DTYPES[args.dtype]
    model = tiny_model(args.hf_family, dtype=dtype).to(device)
    settings: dict[str, object] = {"backend_per_kind": args.backend_per_kind or {}}
    if args.prefer == "triton":
        settings["backend"] = "triton_attn"
    config = AttentionConfig.model_validate(settings, context={"registry": registry})
    # Block size 16: the smallest triton_attn takes; 12 blocks make the three requests
    # share a small pool.
    attached = attach(model, config=config, num_blocks=12, block_size=16, registry=registry)
    io.out.write(f"attnkit demo: tiny {args.hf_family} ({type(model).__name__}, {args.dtype})\n")
    for line in describe_layers(attached):
        io.out.write(f"  {line}\n")
    engine = Engine(attached, max_tokens_per_step=6, keep_logits=True)
    drawn = torch.randint(3, 90, (11,), generator=torch.Generator().manual_seed(0))
    prompts = [int(t) for t in drawn]
    for i, (start, stop) in enumerate(((0, 11), (2, 7), (1, 10))):
        engine.add_request(
            f"req{i}",
            prompts[start:stop],
            SamplingParams(max_new_tokens=args.steps, temperature=0.8 if i == 1 else 0.0, seed=i),
            arrival_step=i,
        )
    result = engine.run(max_steps=DEMO_MAX_STEPS * 4)
    for step in result.steps:
        scheduled = ", ".join(f"{rid}+{n}" for rid, n in step.scheduled) or "-"
        extra = "".join(
            f" {label} {', '.join(ids)}"
            for label, ids in (("preempted", step.preempted), ("finished", step.finished))
            if ids
        )
        io.out.write(
            f"  step {step.step}: {scheduled} ({step.num_prefill_tokens} prefill, "
            f"{step.num_decode_tokens} decode){extra}\n"
        )
    for rid, tokens in result.outputs.items():
        io.out.write(f"  {rid}: {tokens}\n")
    check = check_against_eager(attached, result)
    verdict = "matches" if check.passed else "DIFFERS FROM"
    io.out.write(
        f"{verdict} transformers eager attention at every step: max |dlogit| "
        f"{check.max_error:.2e} over {check.rows} rows (tolerance {check.tolerance:.1e})\n"
    )
    if check.passed:
        return 0
    io.error(
        f"the engine's logits differ from transformers' eager attention: max |dlogit| "
        f"{check.max_error:.2e} > {check.tolerance:.1e}"
    )
    return EXIT_FAILED


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
        description=(__doc__ or "attnkit").splitlines()[0],
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
        choices=sorted(_DTYPES),
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
        choices=sorted(_DTYPES),
        default="float32",
        help="recurrent-state dtype of state layers (CONFIG only; default float32, what "
        "the built-in state backends keep); conv states take the model dtype",
    )
    plan.add_argument(
        "--block-size",
        type=int_range(1),
        default=16,
        help="tokens per block as declared (CONFIG only; default 16); the runtime may "
        "scale attention groups' blocks to the unified page, and the plan shows that",
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
    demo.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
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
    from .integrations.transformers import SUPPORTED_MODEL_TYPES

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


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser, commands = _build()
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


_COMMANDS: dict[str, Callable[[argparse.Namespace, BackendRegistry, _Streams], int]] = {
    "backends": cmd_backends,
    "plan": cmd_plan,
    "demo": cmd_demo,
}


def _message(exc: AttnkitError | pydantic.ValidationError) -> str:
    if isinstance(exc, pydantic.ValidationError):
        return "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
    return str(exc) or type(exc).__name__


def main(
    argv: Sequence[str] | None = None,
    *,
    registry: BackendRegistry | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Entry point of the ``attnkit`` command; returns the exit status.

    Bad command lines exit through argparse (``SystemExit(2)``, the message on
    stderr). Otherwise: 0 on success, ``EXIT_FAILED`` (1), or ``EXIT_USAGE`` (2) for a
    user error (an ``AttnkitError`` or a rejected configuration), reported as one line
    on ``err`` (a ``NoBackendError``'s reasons follow) unless ``--debug`` re-raises it.
    """
    args = _parse(argv)
    io = _Streams(
        f"attnkit {args.command}",
        out if out is not None else sys.stdout,
        err if err is not None else sys.stderr,
    )
    try:
        registry = registry if registry is not None else default_registry()
        return _COMMANDS[args.command](args, registry, io)
    except (AttnkitError, pydantic.ValidationError) as exc:
        if args.debug:
            raise
        io.error(_message(exc))
        return EXIT_USAGE
