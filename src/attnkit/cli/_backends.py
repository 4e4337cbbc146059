"""``attnkit backends``: every registered backend, what it serves, and whether it can
run on a device (with the reasons when it cannot)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from functools import partial

import torch

from ..capabilities import Determinism
from ..devices import device_problem, parse_device
from ..errors import ArgumentTypeError, InvalidArgumentError, PluginError
from ..registry import BackendRegistry, call_backend_code
from ..selector import DEFAULT_PRIORITY
from ._common import Streams


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
    determinism: dict[str, str] = dataclasses.field(default_factory=dict[str, str])
    """Kind -> the ``Determinism`` level declared for it (``determinism_for``)."""
    features: list[str] = dataclasses.field(default_factory=list[str])
    """The optional features declared (``supported_features``), e.g. ``per_head_quant_scales``."""
    kv_cache_dtypes: list[str] = dataclasses.field(default_factory=list[str])
    """The cache dtypes declared (``supported_kv_cache_dtypes``)."""
    notes: list[str] = dataclasses.field(default_factory=list[str])
    """What it runs with here (``environment_notes``), e.g. which native library."""


def determinism_line(levels: dict[str, str]) -> str:
    """``"prefix_hit_invariant (full_attention, sliding_window); run_to_run (cross_attention)"``:
    each declared level, strongest first, with its kinds."""
    order = {level.label: level for level in Determinism}
    by_level: dict[str, list[str]] = {}
    for kind, level in sorted(levels.items()):
        by_level.setdefault(level, []).append(kind)
    ranked = sorted(by_level, key=lambda name: -order[name])
    return "; ".join(f"{level} ({', '.join(by_level[level])})" for level in ranked)


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
        levels: dict[str, str] = {}
        try:
            declared = call_backend_code(entry, "supported_kinds()", backend.supported_kinds)
            kinds = sorted(k.value for k in declared)
            for kind in declared:
                level = call_backend_code(
                    entry, "determinism_for()", partial(backend.determinism_for, kind)
                )
                levels[kind.value] = Determinism.parse(level).label
        except (PluginError, ArgumentTypeError, InvalidArgumentError) as exc:
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
        notes: list[str] = []
        try:
            notes = call_backend_code(
                entry, "environment_notes()", partial(backend.environment_notes, device)
            )
        except PluginError as exc:
            reasons.append(str(exc))
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
                determinism=levels,
                features=sorted(f.value for f in backend.supported_features),
                kv_cache_dtypes=sorted(backend.supported_kv_cache_dtypes),
                notes=notes,
            )
        )
    return rows


def _inspected_device(args: argparse.Namespace, io: Streams) -> torch.device:
    """``--device`` of ``backends`` and ``plan``: these describe a device, so an absent
    one is reported on stderr (as a note) rather than refused."""
    device = parse_device(args.device, argument="--device")
    problem = device_problem(device)
    if problem is not None:
        io.note(f"{problem}; showing what attnkit reports for it")
    return device


def cmd_backends(args: argparse.Namespace, registry: BackendRegistry, io: Streams) -> int:
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
        if row.determinism:
            out.write(f"    determinism: {determinism_line(row.determinism)}\n")
        if row.features:
            out.write(f"    features: {', '.join(row.features)}\n")
        if row.kv_cache_dtypes and row.kv_cache_dtypes != ["auto"]:
            out.write(f"    kv cache dtypes: {', '.join(row.kv_cache_dtypes)}\n")
        for note in row.notes:
            out.write(f"    runs with: {note}\n")
        for reason in row.reasons:
            out.write(f"    - {reason}\n")
    return 0
