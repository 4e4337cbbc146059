"""The ``attnkit`` command.

``attnkit backends``  every registered backend, what it serves, and whether it can run
                      here (with the reasons when it cannot).
``attnkit plan``      route an example model's layers: layer -> kind -> backend, with
                      every skipped candidate and why.
``attnkit demo``      serve a tiny hybrid model (full, sliding-window and Mamba2 layers)
                      through the runtime, checking every step against a dense recompute.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import TextIO

import pydantic
import torch

from .config import AttentionConfig
from .registry import BackendRegistry, default_registry
from .selector import NoBackendError, Selection, select_backend
from .spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

__all__ = ["EXAMPLE_MODELS", "BackendRow", "backend_rows", "example_model", "main"]

EXAMPLE_MODELS = ("hybrid", "llama", "gemma2", "llama4")


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
        raise argparse.ArgumentTypeError(f"--capability must look like 9.0, got {text!r}")
    return int(major), int(minor)


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
        reasons = backend.environment_reasons(device)
        rows.append(
            BackendRow(
                name=backend.name,
                origin=entry.origin,
                source=entry.source,
                kinds=sorted(k.value for k in backend.supported_kinds()),
                devices=sorted(backend.supported_devices),
                available=not reasons,
                reasons=reasons,
                description=backend.description,
            )
        )
    return rows


def cmd_backends(args: argparse.Namespace, registry: BackendRegistry, out: TextIO) -> int:
    device = torch.device(args.device)
    rows = backend_rows(registry, device)
    if args.json:
        json.dump(
            {"device": str(device), "backends": [dataclasses.asdict(r) for r in rows]},
            out,
            indent=2,
        )
        out.write("\n")
        return 0
    if not rows:
        out.write("no backends are registered\n")
        return 0
    out.write(f"backends on {device}:\n")
    for row in rows:
        status = "available" if row.available else "unavailable"
        out.write(
            f"  {row.name} [{row.origin}] {status}\n    kinds: {', '.join(row.kinds) or '-'}\n"
        )
        if row.description:
            out.write(f"    {row.description}\n")
        for reason in row.reasons:
            out.write(f"    - {reason}\n")
    return 0


def cmd_plan(args: argparse.Namespace, registry: BackendRegistry, out: TextIO) -> int:
    try:
        config = AttentionConfig.model_validate(
            {"backend": args.backend, "backend_per_kind": args.backend_per_kind or {}},
            context={"registry": registry},
        )
    except pydantic.ValidationError as exc:
        messages = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
        out.write(f"error: {messages}\n")
        return 2
    device = torch.device(args.device)
    layers = example_model(args.model)
    groups: dict[KVCacheSpec, list[str]] = {}
    for layer, spec in layers.items():
        groups.setdefault(spec, []).append(layer)
    unserved = 0
    out.write(f"model {args.model} on {device} ({config.describe()})\n")
    for spec, names in groups.items():
        out.write(f"\n{', '.join(names)}: {spec.kind.value} ({type(spec).__name__})\n")
        try:
            selection: Selection = select_backend(
                spec, config, device=device, capability=args.capability, registry=registry
            )
        except NoBackendError as exc:
            unserved += 1
            out.write("  NO BACKEND\n" + "".join(f"    {line}\n" for line in str(exc).splitlines()))
            continue
        out.write(f"  -> {selection.backend_name} (chosen by {selection.source})\n")
        for rejection in selection.rejected:
            out.write(f"     skipped {rejection}\n")
    if unserved:
        out.write(f"\n{unserved} group(s) have no backend\n")
    return 1 if unserved and args.strict else 0


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cmd_demo(args: argparse.Namespace, registry: BackendRegistry, out: TextIO) -> int:
    if torch.device(args.device).type == "cpu" and "triton" not in sys.modules:
        # Triton kernels run on CPU tensors only under its interpreter, which must be
        # chosen before triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .demo import run_demo

    try:
        config_check = AttentionConfig.model_validate(
            {"backend_per_kind": args.backend_per_kind or {}}, context={"registry": registry}
        )
    except pydantic.ValidationError as exc:
        messages = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
        out.write(f"error: {messages}\n")
        return 2
    del config_check
    result = run_demo(
        device=args.device,
        backend_per_kind=args.backend_per_kind,
        decode_steps=args.steps,
        dtype=_DTYPES[args.dtype],
        out=out,
        registry=registry,
        model_name=args.model,
        prefer=args.prefer,
    )
    return 0 if result.passed else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnkit", description=(__doc__ or "attnkit").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    backends = sub.add_parser("backends", help="list registered backends and their availability")
    backends.add_argument("--device", default="cpu", help="device to check availability on")
    backends.add_argument("--json", action="store_true", help="print JSON instead of text")
    plan = sub.add_parser("plan", help="show which backend serves each layer of an example model")
    plan.add_argument("--model", choices=EXAMPLE_MODELS, default="hybrid")
    plan.add_argument("--device", default="cpu")
    plan.add_argument(
        "--capability", type=_parse_capability, default=None, help="CUDA capability, e.g. 9.0"
    )
    plan.add_argument("--backend", default=None, help="one backend for every kind it serves")
    plan.add_argument(
        "--backend-per-kind",
        default=None,
        help="kind=backend pairs, e.g. sliding_window=triton_attn,full_attention=reference",
    )
    plan.add_argument("--strict", action="store_true", help="exit 1 if a layer has no backend")
    demo = sub.add_parser("demo", help="serve a tiny hybrid model and check every step")
    demo.add_argument("--device", default="cpu")
    demo.add_argument(
        "--backend-per-kind",
        default=None,
        help="kind=backend pairs, e.g. full_attention=triton_attn,sliding_window=triton_attn",
    )
    demo.add_argument("--steps", type=int, default=8, help="decode steps per request")
    demo.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    demo.add_argument(
        "--model",
        choices=("default", "hybrid"),
        default="default",
        help="default: full, sliding-window and Mamba2 layers; hybrid: also Gated DeltaNet, "
        "linear attention and short conv",
    )
    demo.add_argument(
        "--prefer",
        choices=("reference", "triton"),
        default="reference",
        help="triton: try the Triton backends first for every kind (on CPU, under the interpreter)",
    )
    return parser


def main(
    argv: Sequence[str] | None = None,
    *,
    registry: BackendRegistry | None = None,
    out: TextIO | None = None,
) -> int:
    """Entry point of the ``attnkit`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    registry = registry if registry is not None else default_registry()
    stream = out if out is not None else sys.stdout
    if args.command == "backends":
        return cmd_backends(args, registry, stream)
    if args.command == "demo":
        return cmd_demo(args, registry, stream)
    return cmd_plan(args, registry, stream)
