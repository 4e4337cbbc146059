"""``attnkit demo``: the self-checking demo (``attnkit.demo``) on a device, with
``--context-parallel N`` on N local ranks, or with ``--hf-family NAME`` a tiny
transformers model through the engine loop, checked against eager attention."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ..config import AttentionConfig
from ..devices import check_device_available, parse_device
from ..errors import DeviceUnavailableError, InvalidArgumentError
from ..models import layout_from_hf_config
from ..registry import BackendRegistry
from ._common import DTYPES, EXIT_FAILED, Streams, check_config_path

DEMO_MAX_STEPS = 10_000
"""Most decode steps ``attnkit demo`` takes (the sequences stay far below
``AttentionConfig.max_model_len``)."""


def cmd_demo(args: argparse.Namespace, registry: BackendRegistry, io: Streams) -> int:
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
    from ..demo import TOLERANCE, demo_layout, is_sparse, run_demo, run_sparse_demo

    layout: tuple[str, ...] | None = None
    name: str = args.model
    if args.config is not None:
        check_config_path(args.config)
        model = layout_from_hf_config(args.config)
        if is_sparse(model):  # DeepSeek sparse attention: its own demo (indexer + MLA)
            sparse = run_sparse_demo(
                model,
                device=str(device),
                dtype=DTYPES[args.dtype],
                decode_steps=min(args.steps, 4),
                backend_per_kind=args.backend_per_kind,
                out=io.out,
                registry=registry,
            )
            if sparse.passed:
                return 0
            io.error(f"the runtime's outputs differ from the dense sparse-attention oracle: max|err| {sparse.max_error:.2e}")
            return EXIT_FAILED
        layout = demo_layout(model)
        name = f"{model.model_type} ({args.config}: {', '.join(layout)})"
    dtype = DTYPES[args.dtype]
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
    io: Streams,
    device: torch.device,
    layout: tuple[str, ...] | None,
    name: str,
) -> int:
    """``demo --context-parallel N``: the demo on N local gloo processes."""
    from ..demo import TOLERANCE, run_demo_context_parallel

    if device.type != "cpu":
        raise InvalidArgumentError(
            f"--context-parallel {args.context_parallel}: the demo's ranks are local gloo "
            f"processes on the CPU; got --device {args.device}"
        )
    dtype = DTYPES[args.dtype]
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
    args: argparse.Namespace, registry: BackendRegistry, io: Streams, device: torch.device
) -> int:
    """``demo --hf-family NAME``: a tiny transformers model through the engine loop, every
    step checked against transformers' eager attention."""
    from ..integrations.engine import Engine, SamplingParams
    from ..integrations.transformers import attach, check_against_eager, describe_layers, tiny_model

    dtype = DTYPES[args.dtype]
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
