"""``attnkit plan``: a capacity plan of a model's ``config.json`` or of an example
layout (``example_model``), as text or JSON."""

from __future__ import annotations

import argparse
import json

import torch

from ..config import AttentionConfig
from ..devices import device_problem, parse_device
from ..errors import InvalidArgumentError
from ..models import ModelLayout, layout_from_hf_config
from ..planner import plan_model
from ..registry import BackendRegistry
from ..spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from ._common import DTYPES, EXIT_FAILED, Streams, check_config_path
from ._plan_report import layer_list, write_plan

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


def cmd_plan(args: argparse.Namespace, registry: BackendRegistry, io: Streams) -> int:
    """``attnkit plan``: see ``build_parser`` and docs/models.md for options and JSON."""
    config = AttentionConfig.model_validate(
        {
            "backend": args.backend,
            "backend_per_kind": args.backend_per_kind or {},
            "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "prefix_caching": {
                "state_checkpoints": args.state_checkpoints,
                "checkpoint_interval": args.checkpoint_interval,
            },
            "determinism": getattr(args, "determinism", "none"),
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
    dtype = DTYPES[args.dtype] if args.dtype is not None else None
    model: ModelLayout | dict[str, KVCacheSpec]
    if args.config is not None:
        if args.example is not None:
            raise InvalidArgumentError(
                f"give CONFIG or --example, not both; got CONFIG {args.config!r} and "
                f"--example {args.example}"
            )
        check_config_path(args.config)
        model = layout_from_hf_config(
            args.config,
            dtype=dtype,
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
            state_dtype=DTYPES[args.state_dtype],
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
        write_plan(out, plan, f"{title} on {device} ({config.describe()})")
    unserved = [f"{layer_list(g.group.layer_names)} ({g.group.kind.value})" for g in plan.unserved]
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
