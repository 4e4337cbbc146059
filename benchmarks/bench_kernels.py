"""Kernel speed on a GPU: the triton_attn backend against torch SDPA and FlexAttention.

Decode (GQA 32/8, head 128, batch 1-256, context 1k-32k, bf16 and fp8 KV): achieved
bandwidth in GB/s (bytes = K/V read + Q read + O written) and as a fraction of the
device's peak. Prefill (causal, 1k-16k, head 64/128, bf16): TFLOP/s. Each case runs
side by side, in the same process, with ``scaled_dot_product_attention`` on contiguous
tensors (flash backend where it accepts the case) and FlexAttention (contiguous,
compiled), plus the flash_attn backend's cases when flash-attn is installed.
Determinism (docs/determinism.md): triton_attn at ``batch_invariant`` against the same
launch at ``none``, decode 32 x 2k and prefill 4 x 512, alternating rounds. DSA
(DeepSeek-V3.2 sparse attention: 128 heads, top-2048, 32k-128k contexts): the indexer
and sparse MLA timed on the GPU, torch references and Triton kernels (the Triton
selection checked equal to the reference's), and the bytes each decode token reads
against dense MLA (``--dsa-bytes-only``: computed from the formats, no GPU).

Targets (H100/H200): decode at context >= 4k reaches 75% of peak bandwidth; prefill
at 8k is at least 1.0x SDPA's flash backend. Times come from CUDA events (median of
``--iters`` after ``--warmup``).

    python benchmarks/bench_kernels.py --out bench-results          # on a GPU
    python benchmarks/bench_kernels.py --smoke --device cpu          # harness check, tiny shapes

Without a CUDA device (and without ``--smoke``) it prints why and writes that to the
JSON, so ``nox -s bench`` works everywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# Peak HBM bandwidth, GB/s, by device name (vendor data sheets: H100 SXM 3.35 TB/s,
# H100 PCIe 2.0 TB/s, H200 4.8 TB/s, B200 8 TB/s).
PEAK_GBPS = {"H200": 4800.0, "H100 PCIe": 2000.0, "H100": 3350.0, "B200": 8000.0, "A100": 2039.0}


@dataclasses.dataclass
class Result:
    kind: str
    impl: str
    case: str
    ms: float | None
    gbps: float | None = None
    peak_fraction: float | None = None
    tflops: float | None = None
    note: str = ""


def peak_gbps(device: torch.device, override: float | None) -> float | None:
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_GBPS.items():  # ordered: "H100 PCIe" before "H100"
        if key in name:
            return value
    return None


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        runs = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - start) * 1e3)
        return statistics.median(runs)
    torch.cuda.synchronize(device)
    runs = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        runs.append(start.elapsed_time(end))
    return statistics.median(runs)


def _runtime_pieces(
    *,
    num_reqs: int,
    context: int,
    q_len: int,
    heads: int,
    kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    fp8: bool,
    device: torch.device,
    determinism: str = "none",
) -> tuple[Callable[[], object], dict[str, torch.Tensor]]:
    """The triton_attn builder and impl on a paged cache holding ``context`` tokens per
    request, under ``AttentionConfig(determinism=...)``."""
    from attnkit import AttentionConfig, AttentionLayerParams, FullAttentionSpec
    from attnkit.backend_api import CommonAttentionMetadata
    from attnkit.backends.triton_attn import TritonAttentionBackend

    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=kv_heads,
        head_size=head_size,
        dtype=dtype,
        kv_cache_dtype="fp8_e4m3" if fp8 else "auto",
    )
    config = AttentionConfig.model_validate(
        {"determinism": determinism}, context={"known_backends": []}
    )
    binding = TritonAttentionBackend.get_binding(spec)
    builder = binding.create(spec, ["bench"], config, device)
    params = (
        AttentionLayerParams(num_heads=heads, k_scale=0.05, v_scale=0.05)
        if fp8
        else AttentionLayerParams(num_heads=heads)
    )
    impl = binding.create_impl(spec, params)
    blocks_per_req = math.ceil(context / block_size)
    num_blocks = num_reqs * blocks_per_req + 1
    (shape,) = TritonAttentionBackend.get_kv_cache_shapes(num_blocks, spec)
    cache = torch.empty(shape, dtype=spec.cache_torch_dtype, device=device)
    if fp8:
        cache.view(torch.uint8).random_(0, 120)  # finite e4m3 bit patterns
    else:
        cache.normal_()
    perm = torch.randperm(num_blocks - 1, device=device) + 1  # shuffled physical blocks
    table = perm.reshape(num_reqs, blocks_per_req).to(torch.int32)
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32) * q_len
    seq = torch.full((num_reqs,), context, dtype=torch.int32)
    pos = torch.arange(context - q_len, context, device=device)
    slots = (table.long()[:, pos // block_size] * block_size + pos % block_size).reshape(-1)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq.to(device),
        seq_lens_cpu=seq,
        num_reqs=num_reqs,
        num_actual_tokens=num_reqs * q_len,
        max_query_len=q_len,
        max_seq_len=context,
        block_table_tensor=table,
        slot_mapping=slots,
    )
    meta = builder.build(0, cm)
    t = num_reqs * q_len
    q = torch.randn(t, heads, head_size, dtype=dtype, device=device)
    k = torch.randn(t, kv_heads, head_size, dtype=dtype, device=device)
    v = torch.randn(t, kv_heads, head_size, dtype=dtype, device=device)
    out = torch.empty_like(q)
    return (lambda: impl.forward(q, k, v, [cache], meta, out)), {
        "splits": torch.tensor(meta.num_splits)
    }


def _sdpa(
    q_len: int,
    num_reqs: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device,
    causal: bool,
) -> tuple[Callable[[], object], str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(num_reqs, heads, q_len, head_size, dtype=dtype, device=device)
    k = torch.randn(num_reqs, kv_heads, context, head_size, dtype=dtype, device=device)
    v = torch.randn_like(k)
    backends = [SDPBackend.FLASH_ATTENTION] if device.type == "cuda" else [SDPBackend.MATH]

    def run() -> object:
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=causal and q_len > 1, enable_gqa=True
            )

    try:
        run()
        return run, f"sdpa[{backends[0].name.lower()}]"
    except RuntimeError as exc:  # the flash backend refuses some GQA/shape combinations
        kx = k.repeat_interleave(heads // kv_heads, dim=1)
        vx = v.repeat_interleave(heads // kv_heads, dim=1)

        def run_expanded() -> object:
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, kx, vx, is_causal=causal and q_len > 1)

        return run_expanded, f"sdpa[{backends[0].name.lower()}, kv heads expanded: {str(exc)[:60]}]"


def _flex(
    q_len: int,
    num_reqs: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device,
    causal: bool,
) -> tuple[Callable[[], object], str] | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    q = torch.randn(num_reqs, heads, q_len, head_size, dtype=dtype, device=device)
    k = torch.randn(num_reqs, kv_heads, context, head_size, dtype=dtype, device=device)
    v = torch.randn_like(k)
    offset = context - q_len

    def causal_mask(b: Any, h: Any, qi: Any, kj: Any) -> Any:
        return kj <= qi + offset

    mask = (
        create_block_mask(causal_mask, None, None, q_len, context, device=str(device))
        if causal
        else None
    )
    compiled = (
        torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
    )
    return (lambda: compiled(q, k, v, block_mask=mask, enable_gqa=True)), "flex_attention"


def _state_layer(mamba_type: str, device: torch.device, smoke: bool) -> tuple[Any, Any]:
    """(spec, params) of one realistic state layer of each type (tiny under --smoke)."""
    from attnkit import (
        GatedDeltaNetLayerParams,
        LinearAttentionLayerParams,
        Mamba2LayerParams,
        MambaSpec,
        ShortConvLayerParams,
    )

    s = 8 if smoke else 1
    dt = torch.bfloat16
    params: Any
    if mamba_type == "mamba2":
        h, p_, g, n = 32 // s, 64 // s, 8 // s or 1, 128 // s
        conv = h * p_ + 2 * g * n
        params = Mamba2LayerParams(
            num_heads=h,
            head_dim=p_,
            n_groups=g,
            d_state=n,
            conv_weight=torch.randn(conv, 4, device=device) * 0.3,
            A=-torch.rand(h, device=device) - 0.5,
            D=torch.ones(h, device=device),
            dt_bias=torch.zeros(h, device=device),
            chunk_size=256 // s,
        )
        dtypes = (dt, torch.float32)
    elif mamba_type == "gdn":
        h, k = 16 // s or 1, 128 // s
        params = GatedDeltaNetLayerParams(
            num_heads=h,
            key_dim=k,
            value_dim=k,
            conv_weight=torch.randn(h * 3 * k, 4, device=device) * 0.3,
            chunk_size=64 if not smoke else 16,
        )
        dtypes = (dt, torch.float32)
    elif mamba_type == "linear":
        h, k = 32 // s, 128 // s
        params = LinearAttentionLayerParams(
            num_heads=h,
            key_dim=k,
            value_dim=k,
            decay=torch.rand(h, device=device),
            chunk_size=64 if not smoke else 16,
        )
        dtypes = (torch.float32,)
    else:
        c = 2048 // s
        params = ShortConvLayerParams(
            channels=c, conv_weight=(torch.randn(c, 3, device=device) * 0.3).to(dt)
        )
        dtypes = (dt,)
    spec = MambaSpec(
        block_size=16, shapes=params.state_shapes, dtypes=dtypes, mamba_type=mamba_type
    )
    return spec, params


def _state_inputs(mamba_type: str, params: Any, t: int, device: torch.device) -> Any:
    """The layer type's input class (``attnkit.state_inputs``) for ``t`` tokens."""
    from attnkit import GatedDeltaNetInputs, LinearAttentionInputs, Mamba2Inputs, ShortConvInputs

    dt = torch.bfloat16
    if mamba_type == "mamba2":
        return Mamba2Inputs(
            xBC=torch.randn(t, params.conv_dim, device=device, dtype=dt),
            dt=torch.randn(t, params.num_heads, device=device),
        )
    if mamba_type == "gdn":
        h = params.num_heads
        return GatedDeltaNetInputs(
            qkv=torch.randn(t, params.conv_dim, device=device, dtype=dt),
            g=-torch.rand(t, h, device=device),
            beta=torch.rand(t, h, device=device),
        )
    if mamba_type == "linear":
        h, k = params.num_heads, params.key_dim
        q, k_, v = (torch.randn(t, h, k, device=device, dtype=dt) * 0.1 for _ in range(3))
        return LinearAttentionInputs(q=q, k=k_, v=v)
    b, c, x = (torch.randn(t, params.channels, device=device, dtype=dt) for _ in range(3))
    return ShortConvInputs(b=b, c=c, x=x)


def _time_impl(
    impl: Any,
    inputs: Any,
    states: list[torch.Tensor],
    meta: Any,
    out: torch.Tensor,
    device: torch.device,
    args: argparse.Namespace,
) -> float:
    return time_ms(lambda: impl.forward(inputs, states, meta, out), device, args.warmup, args.iters)


def state_results(args: argparse.Namespace, device: torch.device) -> list[Result]:
    """Decode-step latency and prefill tokens/s of each state backend vs the torch reference."""
    from attnkit import AttentionConfig
    from attnkit.backend_api import CommonAttentionMetadata
    from attnkit.backends.reference import ReferenceBackend
    from attnkit.backends.triton_state import (
        TritonGatedDeltaNetBackend,
        TritonLinearAttentionBackend,
        TritonMamba2Backend,
        TritonShortConvBackend,
    )

    triton = {
        "mamba2": TritonMamba2Backend,
        "gdn": TritonGatedDeltaNetBackend,
        "linear": TritonLinearAttentionBackend,
        "short_conv": TritonShortConvBackend,
    }
    config = AttentionConfig.model_validate({}, context={"known_backends": []})
    results: list[Result] = []
    shapes = [
        ("decode", 2 if args.smoke else 64, 1),
        ("prefill", 2 if args.smoke else 4, 16 if args.smoke else 1024),
    ]
    for mamba_type, backend in triton.items():
        spec, params = _state_layer(mamba_type, device, args.smoke)
        for kind, num_reqs, q_len in shapes:
            t = num_reqs * q_len
            qsl = torch.arange(num_reqs + 1, dtype=torch.int32) * q_len
            context = q_len + (100 if kind == "decode" else 0)
            seq = torch.full((num_reqs,), context, dtype=torch.int32)
            table = (torch.arange(num_reqs, dtype=torch.int32) + 1)[:, None]
            cm = CommonAttentionMetadata(
                query_start_loc=qsl.to(device),
                query_start_loc_cpu=qsl,
                seq_lens=seq.to(device),
                seq_lens_cpu=seq,
                num_reqs=num_reqs,
                num_actual_tokens=t,
                max_query_len=q_len,
                max_seq_len=context,
                block_table_tensor=table.to(device),
                slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=device),
            )
            inputs = _state_inputs(mamba_type, params, t, device)
            for impl_backend, label in (
                (backend, backend.name),
                (ReferenceBackend, "reference (torch)"),
            ):
                binding = impl_backend.get_binding(spec)
                meta = binding.create(spec, ["bench"], config, device).build(0, cm)
                impl = binding.create_impl(spec, params)
                states = [
                    torch.zeros((num_reqs + 1, *shape), dtype=dtype, device=device)
                    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
                ]
                out = torch.empty(params.output_shape(t), dtype=torch.bfloat16, device=device)
                ms = _time_impl(impl, inputs, states, meta, out, device, args)
                case = f"{mamba_type} B={num_reqs} q={q_len}"
                note = (
                    f"{t / (ms * 1e-3):.0f} tok/s"
                    if kind == "prefill"
                    else f"{ms * 1e3:.0f} us/step"
                )
                results.append(Result(f"state-{kind}", label, case, ms, note=note))
    return results


def mla_results(args: argparse.Namespace, device: torch.device, peak: float | None) -> list[Result]:
    """MLA decode on ``triton_mla``'s kernel at DeepSeek-V3 dims (128 heads, latent 576 =
    512 + 64 rope, block 64): GB/s of latent-cache traffic against the device's peak.

    Bytes per step: every request's latents once (``B * ctx * 576`` elements; the kernel
    reads each latent tile once for a block of heads, so head blocks re-read it from L2,
    which this figure does not count), plus the absorbed queries and the outputs."""
    from attnkit.backends._triton_paged import num_sms
    from attnkit.kernels.attention.triton_plan import plan_paged_attention
    from attnkit.kernels.mla.triton import mla_attention, mla_split_workspace

    heads, rank, rope, block = (4, 32, 16, 16) if args.smoke else (128, 512, 64, 64)
    latent = rank + rope
    cases = [(2, 64)] if args.smoke else [(64, 4096), (64, 16384), (128, 4096), (128, 32768)]
    results: list[Result] = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for num_reqs, context in cases:
        blocks_per_req = -(-context // block)
        num_blocks = num_reqs * blocks_per_req
        cache = torch.randn(num_blocks, block, latent, generator=gen).to(device, torch.bfloat16)
        # Shuffled blocks: a real cache's pages are not contiguous per request.
        perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        table = perm.view(num_reqs, blocks_per_req).to(device)
        query = torch.randn(num_reqs, heads, latent, generator=gen).to(device, torch.bfloat16)
        qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
        seq = torch.full((num_reqs,), context, dtype=torch.int32)
        plan = plan_paged_attention(
            qsl.to(device),
            seq.to(device),
            table,
            max_query_len=1,
            max_seq_len=context,
            block_size=block,
            num_kv_heads=1,
            num_tokens=num_reqs,
            num_splits=None,
            num_sms=num_sms(device),
            query_start_loc_cpu=qsl,
        )
        workspace = (
            mla_split_workspace(plan.num_splits, num_reqs, heads, rank, device=device)
            if plan.num_splits
            else None
        )
        out = torch.empty(num_reqs, heads, rank, dtype=torch.bfloat16, device=device)

        def step(
            query: torch.Tensor = query,
            cache: torch.Tensor = cache,
            plan: Any = plan,
            out: torch.Tensor = out,
            workspace: Any = workspace,
        ) -> None:
            mla_attention(
                query,
                cache,
                plan,
                kv_lora_rank=rank,
                scale=latent**-0.5,
                output=out,
                workspace=workspace,
            )

        ms = time_ms(step, device, args.warmup, args.iters)
        moved = 2 * (num_reqs * context * latent + num_reqs * heads * (latent + rank))
        gbps = moved / (ms * 1e-3) / 1e9
        results.append(
            Result(
                "mla-decode",
                "triton_mla",
                f"B={num_reqs} ctx={context} H={heads} D={latent}",
                ms,
                gbps,
                gbps / peak if peak else None,
                note=f"splits={plan.num_splits}",
            )
        )
    return results


# DeepSeek-V3.2 sparse attention (DSA) at its own sizes: 128 MLA heads over a 576-wide
# bf16 latent, an indexer of 64 heads x 128 over 132-byte fp8 rows, top-2048.
DSA_HEADS, DSA_RANK, DSA_ROPE = 128, 512, 64
DSA_INDEX_HEADS, DSA_INDEX_DIM, DSA_TOPK, DSA_BLOCK = 64, 128, 2048, 64
DSA_ROW_BYTES = DSA_INDEX_DIM + DSA_INDEX_DIM // 128 * 4


def dsa_cases(smoke: bool) -> list[tuple[int, int]]:
    """(requests, context) of the DSA decode cases: 32k to 128k contexts (tiny with --smoke)."""
    if smoke:
        return [(2, 96)]
    return [(1, 32768), (8, 32768), (1, 65536), (1, 131072), (4, 131072)]


def dsa_bytes_per_token(context: int, topk: int = DSA_TOPK) -> dict[str, float]:
    """Bytes one decode token of one layer reads, computed from the formats (not
    measured): the indexer reads every index row of the context, sparse MLA ``topk``
    latents (bf16, 576 x 2 B); dense MLA reads every latent."""
    latent_bytes = (DSA_RANK + DSA_ROPE) * 2
    indexer = context * DSA_ROW_BYTES
    sparse = min(topk, context) * latent_bytes
    dense = context * latent_bytes
    return {
        "context": context,
        "indexer_bytes": indexer,
        "sparse_mla_bytes": sparse,
        "dsa_bytes": indexer + sparse,
        "dense_mla_bytes": dense,
        "dsa_over_dense": (indexer + sparse) / dense,
    }


def print_dsa_bytes(contexts: list[int]) -> list[dict[str, float]]:
    rows = [dsa_bytes_per_token(c) for c in contexts]
    print("DSA decode, bytes read per token per layer (computed from the formats, not measured)")
    print(f"{'context':>8} {'indexer':>12} {'sparse MLA':>12} {'DSA total':>12} {'dense MLA':>12} {'ratio':>6}")
    for r in rows:
        print(
            f"{int(r['context']):>8} {r['indexer_bytes'] / 1e6:>10.2f}MB {r['sparse_mla_bytes'] / 1e6:>10.2f}MB "
            f"{r['dsa_bytes'] / 1e6:>10.2f}MB {r['dense_mla_bytes'] / 1e6:>10.2f}MB {r['dsa_over_dense']:>6.3f}"
        )
    return rows


def _dsa_kernels(device: torch.device) -> list[tuple[str, Any]]:
    """The DSA kernel modules to time: the torch references everywhere, the Triton
    kernels on a GPU (or under ``TRITON_INTERPRET=1``, for a smoke run)."""
    from attnkit.kernels.dsa import reference

    kernels: list[tuple[str, Any]] = [("reference (torch)", reference)]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "cuda" or interpreted:
        try:
            from attnkit.kernels.dsa import triton as triton_dsa
        except ImportError as exc:  # no triton: the references only
            print(f"DSA: the Triton kernels are not timed ({exc})")
        else:
            kernels.append(("triton", triton_dsa))
    return kernels


def dsa_results(args: argparse.Namespace, device: torch.device, peak: float | None) -> list[Result]:
    """DSA decode at V3.2 sizes: the indexer (scores + top-k) and sparse MLA, each
    timed alone, on the torch references and (on a GPU) the Triton kernels
    (``attnkit.kernels.dsa``); GB/s of the bytes ``dsa_bytes_per_token`` counts. The
    Triton kernels' selection is checked equal to the reference's before timing."""
    from attnkit.kernels.dsa.reference import quantize_index_keys

    heads, rank, rope = (4, 32, 16) if args.smoke else (DSA_HEADS, DSA_RANK, DSA_ROPE)
    iheads, topk, block = (4, 16, 16) if args.smoke else (DSA_INDEX_HEADS, DSA_TOPK, DSA_BLOCK)
    latent = rank + rope
    results: list[Result] = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    kernels = _dsa_kernels(device)
    for num_reqs, context in dsa_cases(args.smoke):
        per_req = -(-context // block)
        num_blocks = num_reqs * per_req + 1
        perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
        table = perm.view(num_reqs, per_req).to(device)
        keys = torch.randn(num_blocks * block, DSA_INDEX_DIM, generator=gen)
        index_cache = quantize_index_keys(keys).view(num_blocks, block, DSA_ROW_BYTES).to(device)
        latents = torch.randn(num_blocks, block, latent, generator=gen).to(device, torch.bfloat16)
        qsl = torch.arange(num_reqs + 1, dtype=torch.int32, device=device)
        seq = torch.full((num_reqs,), context, dtype=torch.int32, device=device)
        qi = torch.randn(num_reqs, iheads, DSA_INDEX_DIM, generator=gen).to(device, torch.bfloat16)
        w = torch.randn(num_reqs, iheads, generator=gen).to(device)
        q = torch.randn(num_reqs, heads, latent, generator=gen).to(device, torch.bfloat16)
        bytes_ = dsa_bytes_per_token(context, topk)
        case = f"B={num_reqs} ctx={context} H={heads} topk={topk}"
        selections: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, ops in kernels:
            holder: dict[str, Any] = {}

            def indexer(ops: Any = ops, holder: dict[str, Any] = holder, qi: torch.Tensor = qi,
                        w: torch.Tensor = w, index_cache: torch.Tensor = index_cache,
                        qsl: torch.Tensor = qsl, seq: torch.Tensor = seq,
                        table: torch.Tensor = table, context: int = context) -> None:
                logits = ops.indexer_logits(qi, w, index_cache, query_start_loc=qsl,
                                            seq_lens=seq, block_table=table, max_seq_len=context)
                holder["sel"] = ops.topk_select(logits, query_start_loc=qsl, seq_lens=seq,
                                                block_table=table, block_size=block, topk=topk)

            ms_i = time_ms(indexer, device, args.warmup, args.iters)
            indices, lens = holder["sel"]
            selections[name] = (indices, lens)
            if name != "reference (torch)":
                ref_indices, ref_lens = selections["reference (torch)"]
                if not (torch.equal(indices.cpu(), ref_indices.cpu()) and torch.equal(lens.cpu(), ref_lens.cpu())):
                    raise AssertionError(f"DSA {case}: the {name} selection differs from the reference's")
            out = torch.empty(num_reqs, heads, rank, dtype=torch.bfloat16, device=device)

            def sparse(ops: Any = ops, indices: Any = indices, lens: Any = lens,
                       out: torch.Tensor = out, q: torch.Tensor = q,
                       latents: torch.Tensor = latents) -> None:
                ops.sparse_mla_attention(q, latents, indices, lens, kv_lora_rank=rank,
                                         scale=latent**-0.5, output=out)

            ms_s = time_ms(sparse, device, args.warmup, args.iters)
            for kind, ms, moved in (
                ("dsa-indexer", ms_i, num_reqs * bytes_["indexer_bytes"]),
                ("dsa-sparse-mla", ms_s, num_reqs * bytes_["sparse_mla_bytes"]),
            ):
                gbps = moved / (ms * 1e-3) / 1e9
                results.append(Result(kind, name, case, ms, gbps,
                                      gbps / peak if peak else None,
                                      note=f"dense MLA reads {bytes_['dense_mla_bytes'] / 1e6:.1f} MB/token"))
    return results


def mla_prefill_results(args: argparse.Namespace, device: torch.device) -> list[Result]:
    """MLA prefill with ``mla_projection`` on ``triton_mla``, each form forced
    (``prefill_form``), at DeepSeek-V3 dims (128 heads, R 512, rope 64, N = V = 128,
    bf16, block 64): what the FLOP model that ``"auto"`` follows predicts, measured.

    Cases: fresh prompts, and chunks over a cached context; each row's note says which
    form ``"auto"`` picks for it. The step is begun once and its forward timed (it
    rewrites the same latents each time)."""
    from attnkit import (
        AttentionConfig,
        AttentionLayerParams,
        AttentionRuntime,
        MLAAttentionSpec,
        MLAProjection,
    )
    from attnkit.backends.triton_mla import MLAPrefillMetadata, TritonMLAImpl
    from attnkit.runtime import ScheduledRequest

    if args.smoke:
        heads, rank, rope, nope, v_dim, block = 4, 32, 16, 16, 16, 16
        cases = [(1, 0, 48), (1, 64, 24)]
    else:
        heads, rank, rope, nope, v_dim, block = 128, 512, 64, 128, 128, 64
        # (requests, cached context each, new tokens each)
        cases = [(1, 0, 4096), (4, 0, 1024), (1, 8192, 256), (1, 8192, 1024), (8, 4096, 64)]
    dtype = torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    proj = MLAProjection(
        w_uk=(torch.randn(heads, rank, nope, generator=gen) * rank**-0.5).to(device, dtype),
        w_uv=(torch.randn(heads, rank, v_dim, generator=gen) * rank**-0.5).to(device, dtype),
    )
    spec = MLAAttentionSpec(block_size=block, head_size=rank + rope, dtype=dtype)
    params = AttentionLayerParams(num_heads=heads, mla_projection=proj)
    results: list[Result] = []
    for num_reqs, context, new in cases:
        label = f"B={num_reqs} ctx={context} new={new} H={heads}"
        timings: dict[str, float] = {}
        auto = "absorbed (a decode step)"
        for form in ("absorbed", "up_projected"):
            config = AttentionConfig(
                backend_per_kind={"mla_attention": "triton_mla"},
                backend_options={"triton_mla": {"prefill_form": form}},
                max_model_len=context + new + block,
                max_num_batched_tokens=max(num_reqs * max(context, new), 1),
            )
            budget = spec.page_size_bytes * (num_reqs * (-(-(context + new) // block) + 1) + 4)
            rt = AttentionRuntime(
                {"mla": spec},
                config,
                device=device,
                memory_budget_bytes=budget,
                layer_params={"mla": params},
            )
            width = nope + rope
            if context:
                batch = rt.begin_step([ScheduledRequest(f"r{i}", context) for i in range(num_reqs)])
                t = batch.num_tokens
                rt.forward(
                    "mla",
                    torch.randn(t, heads, width, device=device, dtype=dtype),
                    torch.randn(t, 1, rank + rope, device=device, dtype=dtype),
                    None,
                )
            batch = rt.begin_step([ScheduledRequest(f"r{i}", new) for i in range(num_reqs)])
            t = batch.num_tokens
            query = torch.randn(t, heads, width, device=device, dtype=dtype)
            latents = torch.randn(t, 1, rank + rope, device=device, dtype=dtype)
            out = torch.empty(t, heads, v_dim, device=device, dtype=dtype)
            impl = rt._attention_impls["mla"]
            prefill = rt._groups[0].metadata.prefill
            if isinstance(impl, TritonMLAImpl) and isinstance(prefill, MLAPrefillMetadata):
                auto_meta = dataclasses.replace(prefill, form="auto")
                auto = "up_projected" if impl.prefers_up_projection(auto_meta) else "absorbed"

            def step(
                rt: AttentionRuntime = rt,
                query: torch.Tensor = query,
                latents: torch.Tensor = latents,
                out: torch.Tensor = out,
            ) -> None:
                rt.forward("mla", query, latents, None, output=out)

            timings[form] = time_ms(step, device, args.warmup, args.iters)
        for form, ms in timings.items():
            other = timings["up_projected" if form == "absorbed" else "absorbed"]
            results.append(
                Result(
                    "mla-prefill",
                    f"triton_mla/{form}",
                    label,
                    ms,
                    note=f"auto picks {auto}; {other / ms:.2f}x vs the other form",
                )
            )
    return results


def decode_cases(smoke: bool) -> list[tuple[int, int]]:
    if smoke:
        return [(2, 64)]
    return [
        (1, 1024),
        (1, 8192),
        (1, 32768),
        (8, 4096),
        (8, 32768),
        (64, 4096),
        (64, 16384),
        (256, 1024),
        (256, 4096),
        (256, 8192),
    ]


def prefill_cases(smoke: bool) -> list[tuple[int, int]]:
    if smoke:
        return [(32, 16)]
    return [(1024, 128), (4096, 128), (8192, 128), (16384, 128), (8192, 64)]


def determinism_results(args: argparse.Namespace, device: torch.device) -> list[Result]:
    """triton_attn at batch_invariant (its declared level: one-pass kernel, fixed
    32-query tiles) against the same launch at none, decode 32 x 2k and prefill 4 x 512,
    bf16: three rounds alternating which runs first, the median cost ratio in the note.
    (The mixed step of bench_cpu.py needs ragged batches, which these pieces do not
    build.)"""
    heads, kv_heads, head = (4, 2, 32) if args.smoke else (32, 8, 128)
    cases = [("decode", 32, 2048, 1), ("prefill", 4, 512, 512)]
    if args.smoke:
        cases = [("decode", 2, 64, 1), ("prefill", 1, 32, 32)]
    results: list[Result] = []
    for kind, num_reqs, context, q_len in cases:
        fns = {
            level: _runtime_pieces(
                num_reqs=num_reqs,
                context=context,
                q_len=q_len,
                heads=heads,
                kv_heads=kv_heads,
                head_size=head,
                block_size=16,
                dtype=torch.bfloat16,
                fp8=False,
                device=device,
                determinism=level,
            )[0]
            for level in ("none", "batch_invariant")
        }
        times: dict[str, list[float]] = {"none": [], "batch_invariant": []}
        for i in range(3):
            for level in ("none", "batch_invariant")[:: 1 if i % 2 == 0 else -1]:
                times[level].append(time_ms(fns[level], device, args.warmup, args.iters))
        cost = statistics.median(
            b / a for a, b in zip(times["none"], times["batch_invariant"], strict=True)
        )
        case = f"{kind} B={num_reqs} ctx={context} q={q_len} bf16"
        for level in ("none", "batch_invariant"):
            note = f"determinism={level}"
            if level != "none":
                note += f"; {cost:.2f}x none"
            results.append(
                Result("determinism", "triton_attn", case, statistics.median(times[level]), note=note)
            )
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    heads, kv_heads = (4, 2) if args.smoke else (32, 8)
    block = 16
    peak = peak_gbps(device, args.peak_gbps)
    results: list[Result] = []
    flex_budget = 3 if not args.smoke else 0  # each compiled shape costs tens of seconds
    for fp8 in (False, True):
        for num_reqs, context in decode_cases(args.smoke):
            head = 32 if args.smoke else 128
            case = f"B={num_reqs} ctx={context} {'fp8' if fp8 else 'bf16'}"
            kv_bytes = num_reqs * context * kv_heads * head * 2 * (1 if fp8 else 2)
            qo_bytes = 2 * num_reqs * heads * head * 2
            fn, info = _runtime_pieces(
                num_reqs=num_reqs,
                context=context,
                q_len=1,
                heads=heads,
                kv_heads=kv_heads,
                head_size=head,
                block_size=block,
                dtype=torch.bfloat16,
                fp8=fp8,
                device=device,
            )
            ms = time_ms(fn, device, args.warmup, args.iters)
            gbps = (kv_bytes + qo_bytes) / (ms * 1e-3) / 1e9
            results.append(
                Result(
                    "decode",
                    "triton_attn",
                    case,
                    ms,
                    gbps,
                    gbps / peak if peak else None,
                    note=f"splits={int(info['splits'])}",
                )
            )
            if not fp8:
                sdpa, label = _sdpa(
                    1, num_reqs, context, heads, kv_heads, head, torch.bfloat16, device, causal=True
                )
                ms_s = time_ms(sdpa, device, args.warmup, args.iters)
                g = (kv_bytes + qo_bytes) / (ms_s * 1e-3) / 1e9
                results.append(
                    Result(
                        "decode",
                        label,
                        case,
                        ms_s,
                        g,
                        g / peak if peak else None,
                        note="contiguous K/V",
                    )
                )
                if flex_budget and context == 4096:
                    flex_budget -= 1
                    made = _flex(
                        1,
                        num_reqs,
                        context,
                        heads,
                        kv_heads,
                        head,
                        torch.bfloat16,
                        device,
                        causal=True,
                    )
                    if made is not None:
                        ms_f = time_ms(made[0], device, args.warmup, args.iters)
                        g = (kv_bytes + qo_bytes) / (ms_f * 1e-3) / 1e9
                        results.append(
                            Result(
                                "decode",
                                made[1],
                                case,
                                ms_f,
                                g,
                                g / peak if peak else None,
                                note="contiguous K/V",
                            )
                        )
    for seq, head in prefill_cases(args.smoke):
        total = 16 if args.smoke else 16384
        num_reqs = max(1, total // seq)
        case = f"S={seq} D={head} B={num_reqs}"
        flops = 4 * num_reqs * heads * seq * seq * head / 2  # causal: half the scores
        fn, _ = _runtime_pieces(
            num_reqs=num_reqs,
            context=seq,
            q_len=seq,
            heads=heads,
            kv_heads=kv_heads,
            head_size=head,
            block_size=block,
            dtype=torch.bfloat16,
            fp8=False,
            device=device,
        )
        ms = time_ms(fn, device, args.warmup, args.iters)
        results.append(
            Result("prefill", "triton_attn", case, ms, tflops=flops / (ms * 1e-3) / 1e12)
        )
        sdpa, label = _sdpa(
            seq, num_reqs, seq, heads, kv_heads, head, torch.bfloat16, device, causal=True
        )
        ms_s = time_ms(sdpa, device, args.warmup, args.iters)
        results.append(Result("prefill", label, case, ms_s, tflops=flops / (ms_s * 1e-3) / 1e12))
        if not args.smoke and seq == 8192 and head == 128:
            made = _flex(
                seq, num_reqs, seq, heads, kv_heads, head, torch.bfloat16, device, causal=True
            )
            if made is not None:
                ms_f = time_ms(made[0], device, args.warmup, args.iters)
                results.append(
                    Result("prefill", made[1], case, ms_f, tflops=flops / (ms_f * 1e-3) / 1e12)
                )
    results.extend(determinism_results(args, device))
    results.extend(state_results(args, device))
    results.extend(mla_results(args, device, peak))
    results.extend(mla_prefill_results(args, device))
    results.extend(dsa_results(args, device, peak))
    flash_rows: list[dict[str, Any]] = []
    if not args.smoke:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from flash_attn_cases import run_flash_attn_cases

        flash_rows = run_flash_attn_cases(args.out)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "peak_gbps": peak,
        "results": [dataclasses.asdict(r) for r in results],
        "flash_attn": flash_rows,
        "targets": targets(results, peak),
        "dsa_bytes_per_token": [dsa_bytes_per_token(c) for _, c in dsa_cases(False)],
    }


def targets(results: list[Result], peak: float | None) -> dict[str, Any]:
    """The issue's two targets, judged from this run's numbers."""
    long_decodes = [
        r
        for r in results
        if r.kind == "decode"
        and r.impl == "triton_attn"
        and "bf16" in r.case
        and int(r.case.split("ctx=")[1].split()[0]) >= 4096
    ]
    fractions = [r.peak_fraction for r in long_decodes if r.peak_fraction is not None]
    prefill = {
        r.impl: r.ms for r in results if r.kind == "prefill" and r.case.startswith("S=8192 D=128")
    }
    sdpa_ms = next((ms for impl, ms in prefill.items() if impl.startswith("sdpa") and ms), None)
    ours = prefill.get("triton_attn")
    return {
        "decode_min_peak_fraction_ctx>=4k": min(fractions) if fractions else None,
        "decode_target_met": (min(fractions) >= 0.75) if fractions else None,
        "prefill_8k_speedup_vs_sdpa": (sdpa_ms / ours) if sdpa_ms and ours else None,
        "prefill_target_met": (sdpa_ms / ours >= 1.0) if sdpa_ms and ours else None,
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"device: {report['device']}  peak: {report['peak_gbps']} GB/s")
    print(
        f"{'kind':<8} {'case':<24} {'impl':<44} {'ms':>9} {'GB/s':>8} {'peak':>6} {'TFLOP/s':>8}  note"
    )
    for r in report["results"]:
        ms = f"{r['ms']:.3f}" if r["ms"] is not None else "-"
        gb = f"{r['gbps']:.0f}" if r["gbps"] else "-"
        pf = f"{r['peak_fraction']:.0%}" if r["peak_fraction"] else "-"
        tf = f"{r['tflops']:.1f}" if r["tflops"] else "-"
        print(
            f"{r['kind']:<8} {r['case']:<24} {r['impl'][:44]:<44} {ms:>9} {gb:>8} {pf:>6} {tf:>8}  {r['note']}"
        )
    print("targets:", json.dumps(report["targets"]))


# --------------------------------------------------------------------------- grid efficiency

# vLLM-like batches: (name, query length of every request, context length of every request).
GRID_BATCHES: tuple[tuple[str, list[int], list[int]], ...] = (
    ("255 decodes (2k ctx) + 1 x 2k prefill", [1] * 255 + [2048], [2048] * 256),
    ("8 x 512-token prefills", [512] * 8, [512] * 8),
    ("32 decodes (2k ctx)", [1] * 32, [2048] * 32),
    ("chunked prefill 1000 + 63 decodes (4k)", [1000] + [1] * 63, [4096] * 64),
    ("4 x 4-token spec decodes + 1 x 300", [4] * 4 + [300], [1024] * 5),
    ("128 decodes + 3 x 100-token prefills", [1] * 128 + [100] * 3, [1024] * 131),
    ("4 decodes (32k ctx)", [1] * 4, [32768] * 4),
)


def _old_block_q(max_query_len: int, group: int) -> int:
    """Query tokens per program of the grid before the plan (requests x tiles of the
    longest request): as many as fit 64 rows of (token, head of the group), >= 16 rows."""
    group_pad = 1 << (group - 1).bit_length()
    block_q = 1 << (max(max_query_len, 1) - 1).bit_length()
    block_q = min(block_q, max(1, 64 // group_pad))
    return max(block_q, 16 // group_pad, 1)


def grid_efficiency(
    num_q_heads: int = 32, num_kv_heads: int = 8, block_size: int = 16, num_sms: int = 132
) -> list[dict[str, Any]]:
    """Programs launched along the query-tile axis vs programs with work, per batch: the
    plan's shape-only grid (what a CUDA graph captures), its exact grid (eager, from the
    CPU offsets) and the old requests x tiles-of-the-longest grid. Needs no GPU: it
    builds the launcher's plan on CPU tensors and counts the tiles in plain Python."""
    from attnkit.kernels.attention.triton_plan import count_query_tiles, plan_paged_attention

    rows: list[dict[str, Any]] = []
    group = num_q_heads // num_kv_heads
    for name, q_lens, seq_lens in GRID_BATCHES:
        qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        table = torch.zeros(len(q_lens), -(-max(seq_lens) // block_size), dtype=torch.int32)
        common: dict[str, Any] = dict(
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            num_tokens=sum(q_lens),
            num_splits=None,
            num_sms=num_sms,
        )
        graph_plan = plan_paged_attention(qsl, seq, table, **common)
        eager_plan = plan_paged_attention(qsl, seq, table, query_start_loc_cpu=qsl, **common)
        with_work = count_query_tiles(q_lens, graph_plan.block_q)
        old_bq = _old_block_q(max(q_lens), group)
        old_launched = len(q_lens) * -(-max(q_lens) // old_bq)
        old_work = count_query_tiles(q_lens, old_bq)
        rows.append(
            {
                "batch": name,
                "path": f"split-KV x{graph_plan.num_splits}"
                if graph_plan.num_splits
                else "unified",
                "block_q": graph_plan.block_q,
                "tiles_with_work": with_work,
                "graph_launched": graph_plan.num_tiles,
                "graph_efficiency": with_work / graph_plan.num_tiles,
                "eager_launched": eager_plan.num_tiles,
                "eager_efficiency": with_work / eager_plan.num_tiles,
                "old_block_q": old_bq,
                "old_launched": old_launched,
                "old_efficiency": old_work / old_launched,
            }
        )
    return rows


def print_grid_efficiency(rows: list[dict[str, Any]]) -> None:
    print("grid efficiency (query-tile axis; programs with work / programs launched):")
    print(
        f"  {'batch':42s} {'path':13s} {'BQ':>3s} {'work':>5s} "
        f"{'graph':>13s} {'eager':>13s} {'old (BQ)':>20s}"
    )
    for r in rows:
        print(
            f"  {r['batch']:42s} {r['path']:13s} {r['block_q']:3d} {r['tiles_with_work']:5d} "
            f"{r['graph_launched']:5d} {r['graph_efficiency']:6.1%} "
            f"{r['eager_launched']:5d} {r['eager_efficiency']:6.1%} "
            f"{r['old_launched']:6d} {r['old_efficiency']:6.1%} ({r['old_block_q']:2d})"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes: checks the harness, times mean nothing"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--peak-gbps", type=float, default=None, help="override the device's peak bandwidth"
    )
    parser.add_argument(
        "--dsa-bytes-only",
        action="store_true",
        help="print the DSA bytes-per-token table against dense MLA (no GPU needed) and exit",
    )
    parser.add_argument(
        "--grid-only",
        action="store_true",
        help="print the attention grid-efficiency table (no GPU needed) and exit",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if torch.device(args.device).type == "cpu":
        # Before anything imports triton (the grid plan below does).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.dsa_bytes_only:
        rows = print_dsa_bytes(sorted({c for _, c in dsa_cases(False)}))
        (out / "dsa_bytes.json").write_text(json.dumps(rows, indent=2))
        return 0
    grid = grid_efficiency()
    print_grid_efficiency(grid)
    (out / "grid_efficiency.json").write_text(json.dumps(grid, indent=2))
    if args.grid_only:
        return 0
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        reason = "no CUDA device: GPU kernel benchmarks skipped (run benchmarks/gpu_check.sh on a GPU machine)"
        print(reason)
        (out / "bench_kernels.json").write_text(json.dumps({"skipped": reason}, indent=2))
        return 0
    report = run(args)
    print_table(report)
    (out / "bench_kernels.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
