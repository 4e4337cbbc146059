"""``run_demo``: its arguments and their checks, the runtimes it builds (an encoder
and a decoder runtime), the report's header (routing, CUDA graphs), and the requests it
serves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

import torch

from ..config import AttentionConfig
from ..devices import check_device_available, parse_device
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..parallel import ContextParallel
from ..registry import BackendRegistry
from ..runtime import AttentionRuntime
from ..spec import MambaSpec
from ._model import MODELS, DemoModel
from ._report import DemoResult, Tally
from ._serve import serve_decoder, serve_encoder_only

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-2, torch.bfloat16: 1e-1}


PRIORITIES: dict[str, tuple[str, ...]] = {
    "default": (),  # the device's default priority list
    # The oracle for every kind (on CPU the default puts cpu_attn first).
    "reference": ("reference",),
    "triton": (
        "triton_attn",
        "triton_mla",
        "triton_mamba1",
        "triton_mamba2",
        "triton_gdn",
        "triton_linear_attn",
        "triton_short_conv",
        "reference",
    ),
    # Compiled FlexAttention first (CUDA, or CPU by this choice: each new shape compiles
    # on first use, seconds on a CPU), the reference for what it does not serve (MLA,
    # state layers, sink logits).
    "flex": ("flex_attention", "reference"),
}


def _check_demo_arguments(
    *, decode_steps: object, dtype: object, token_budget: object, model_name: object, prefer: object
) -> None:
    """``run_demo``'s checks of its plain arguments (``device`` is parsed separately)."""
    for argument, value in (("decode_steps", decode_steps), ("token_budget", token_budget)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ArgumentTypeError(
                f"{argument} must be an int >= 1, got {value!r} ({type(value).__name__})"
            )
        if value < 1:
            raise InvalidArgumentError(f"{argument} must be an int >= 1, got {value}")
    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(
            f"dtype must be a torch.dtype, got {dtype!r} ({type(dtype).__name__})"
        )
    if dtype not in TOLERANCE:
        raise InvalidArgumentError(
            f"dtype must be one of {', '.join(map(str, TOLERANCE))}, got {dtype}"
        )
    if model_name not in MODELS:
        raise InvalidArgumentError(
            f"unknown model {model_name!r}; choose one of {', '.join(MODELS)}"
        )
    if prefer not in PRIORITIES:
        raise InvalidArgumentError(f"prefer must be one of {', '.join(PRIORITIES)}, got {prefer!r}")


def run_demo(
    *,
    device: str = "cpu",
    backend_per_kind: str | None = None,
    decode_steps: int = 8,
    dtype: torch.dtype = torch.float32,
    token_budget: int = 16,
    out: TextIO,
    registry: BackendRegistry | None = None,
    model_name: str = "default",
    prefer: str = "default",
    layout: Sequence[str] | None = None,
    context_parallel: ContextParallel | None = None,
) -> DemoResult:
    """Serve four requests (one long prompt, chunked) and check every step; see the package doc.

    ``context_parallel``: run as one rank of a decode context-parallel group (every rank
    calls ``run_demo`` with the same arguments; ``run_demo_context_parallel`` starts
    them); the dense check runs on every rank.

    ``model_name``: a key of ``MODELS``; or, with ``layout`` (the layer kinds, e.g. from
    ``demo_layout``), only the name the report shows. ``prefer`` (kinds without a per-kind setting):
    ``"default"`` the device's priority list, ``"reference"`` the reference backend for
    every kind, ``"triton"`` the Triton backends first, ``"flex"`` flex_attention (compiled
    FlexAttention) first.

    The layout's ``DemoModel.mode`` decides how requests are served: ``"decoder"``
    prefills the prompts (the long one in chunks under ``token_budget``) and decodes
    greedily; ``"encoder"`` (encoder-only layers) encodes whole prompts, as many per step
    as fit ``token_budget`` (a longer prompt alone), with no decode steps;
    ``"encoder-decoder"`` encodes each request's source prompt whole in the step before
    its decoder starts (an encoder runtime), then prefills a short decoder prompt and
    decodes greedily (a decoder runtime), its cross-attention layers reading the
    request's encoder output. Every step of each runtime is checked.

    Raises:
        ArgumentTypeError, InvalidArgumentError: a bad argument (checked before
            anything runs; the message names it, the value and what is allowed).
        DeviceUnavailableError: ``device`` does not exist on this machine.
        pydantic.ValidationError: ``backend_per_kind`` is not a valid setting.
        NoBackendError: a layer has no backend (``BackendNotSupportedError``: the one
            ``backend_per_kind`` names cannot serve it).
    """
    _check_demo_arguments(
        decode_steps=decode_steps,
        dtype=dtype,
        token_budget=token_budget,
        model_name=model_name if layout is None else "default",
        prefer=prefer,
    )
    torch_device = parse_device(device)
    check_device_available(torch_device)
    device = str(torch_device)
    torch.manual_seed(0)  # pyright: ignore[reportUnknownMemberType]  # torch leaves seed unannotated
    model = DemoModel(
        layout=MODELS[model_name] if layout is None else layout, dtype=dtype, device=device
    )
    config = AttentionConfig.model_validate(
        {"backend_per_kind": backend_per_kind or {}},
        context={"registry": registry} if registry is not None else None,
    )
    priority = PRIORITIES[prefer]

    def runtime_for(names: Sequence[str]) -> AttentionRuntime:
        return AttentionRuntime(
            {name: model.specs[name] for name in names},
            config,
            device=device,
            memory_budget_bytes=64 * 2**20,
            layer_params={name: model.params[name] for name in names},
            registry=registry,
            priority={torch.device(device).type: priority} if priority else None,
            cache_fill=float("nan"),
            context_parallel=context_parallel,
        )

    # An encoder runtime for the encoder stack, a decoder runtime for the rest.
    runtimes: dict[str, AttentionRuntime] = {}
    if model.encoder_layers:
        runtimes["encoder"] = runtime_for(model.encoder_layers)
    if model.decoder_layers:
        runtimes["decoder"] = runtime_for(model.decoder_layers)
    cached = runtimes.get("decoder")
    memory = (
        f"{cached.num_blocks} blocks of {cached.page_size_bytes} B"
        if cached is not None
        else "no cache (encoder-only layers keep none)"
    )
    out.write(
        f"attnkit demo: model {model_name}, {len(model.layers)} layers, {memory}, {dtype}, "
        f"{device}\n"
    )
    if context_parallel is not None:
        out.write(
            f"context parallel: rank {context_parallel.rank} of {context_parallel.world_size}; "
            f"full and MLA layers keep token t on rank t mod {context_parallel.world_size} and "
            f"merge the ranks' partial attention, the other kinds are replicated\n"
        )
    if model.mode == "encoder":
        out.write(
            "mode: encoder-only: each step encodes whole prompts bidirectionally (a "
            "request's prompt comes in one step, nothing is cached), checked against a "
            "dense encoder; no decode steps\n"
        )
    elif model.mode == "encoder-decoder":
        out.write(
            f"mode: encoder-decoder: the encoder ({', '.join(model.encoder_layers)}) encodes "
            f"each request's source prompt whole, in one step; the decoder "
            f"({', '.join(model.decoder_layers)}) prefills a decoder prompt and decodes "
            f"greedily, its cross-attention layers reading the request's encoder output; "
            f"both stacks are checked against dense recomputes\n"
        )
    for which, runtime in runtimes.items():
        label = f" ({which} runtime)" if len(runtimes) > 1 else ""
        out.write(f"routing{label}:\n")
        rows = runtime.routing_table()
        kinds = [
            row.kind.value + (f"({spec.mamba_type})" if isinstance(spec, MambaSpec) else "")
            for row in rows
            for spec in (runtime.groups[row.group_id].spec,)
        ]
        width = max(17, *map(len, kinds))
        for row, kind in zip(rows, kinds, strict=True):
            group = runtime.groups[row.group_id]
            per_page = f", {group.blocks_per_page} per page" if group.blocks_per_page > 1 else ""
            out.write(
                f"  {row.layer:<10} {kind:<{width}} group {row.group_id} "
                f"(block_size {group.spec.block_size}{per_page}) -> {row.backend} "
                f"({row.source})\n"
            )
    for which, runtime in runtimes.items():
        label = f" ({which} runtime)" if len(runtimes) > 1 else ""
        level, who = runtime.cudagraph_support()
        out.write(f"CUDA graphs{label}: {level.name} (limited by {who})\n")

    gen = torch.Generator().manual_seed(1)
    lengths = {"req-a": 5, "req-b": 12, "req-long": 40, "req-c": 3}
    prompts: dict[str, list[int]] = {
        rid: torch.randint(0, 64, (n,), generator=gen).tolist()  # pyright: ignore[reportUnknownMemberType]  # torch types tolist() as a bare List
        for rid, n in lengths.items()
    }
    tally = Tally(out, TOLERANCE[dtype])
    encoder_runtime = runtimes.get("encoder")
    if cached is None:
        assert encoder_runtime is not None  # a layout has layers
        serve_encoder_only(model, encoder_runtime, prompts, token_budget, tally)
        return tally.result()
    sources: dict[str, list[int]] | None = None
    if encoder_runtime is not None:
        # The prompts above are the encoder's sources; each request's decoder starts
        # from a short prompt of its own (the long one still takes two chunks).
        sources = prompts
        decoder_lengths = {"req-a": 2, "req-b": 4, "req-long": 20, "req-c": 1}
        prompts = {
            rid: torch.randint(0, 64, (n,), generator=gen).tolist()  # pyright: ignore[reportUnknownMemberType]  # as above
            for rid, n in decoder_lengths.items()
        }
    serve_decoder(
        model,
        cached,
        prompts,
        decode_steps=decode_steps,
        token_budget=token_budget,
        tally=tally,
        encoder=(encoder_runtime, sources)
        if encoder_runtime is not None and sources is not None
        else None,
    )
    return tally.result()
