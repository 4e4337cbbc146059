"""Decode and prefill through the ``flash_attn`` backend, against SDPA in the same run.

For each installed flash-attn version that can serve the GPU, times
``FlashAttentionImpl.forward`` (KV write + ``flash_attn_varlen_func`` + copy into the
output buffer) over a paged cache, and ``torch.nn.functional.scaled_dot_product_attention``
on the same shapes as contiguous ``[B, H, T, D]`` tensors (the baseline; it reads no
block table and writes no cache). CUDA events, warm-up first, median of the timed runs.
Without a GPU or flash-attn it prints why and returns ``[]``.

    python benchmarks/flash_attn_cases.py --out bench-results
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attnkit import AttentionConfig, AttentionLayerParams, FullAttentionSpec
from attnkit.backend_api import BackendRequest, CommonAttentionMetadata
from attnkit.backends.flash_attn import FlashAttentionBackend, _versions

WARMUP = 5
RUNS = 20

# name, requests, new tokens per request, context per request (after the step)
CASES: tuple[tuple[str, int, int, int], ...] = (
    ("decode", 64, 1, 4096),
    ("prefill", 4, 2048, 2048),
)
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, DTYPE = 32, 8, 128, torch.bfloat16


def _time_ms(fn: Callable[[], object]) -> float:
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(RUNS):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _case(version: int, name: str, num_reqs: int, new: int, context: int) -> dict[str, Any] | None:
    device = torch.device("cuda")
    block_size = 256 if version == 2 else 128
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE
    )
    config = AttentionConfig.model_validate(
        {"backend_options": {"flash_attn": {"version": version}}}
    )
    reasons = FlashAttentionBackend.not_supported_reasons(
        BackendRequest(
            spec=spec,
            device=device,
            capability=torch.cuda.get_device_capability(),
            num_heads=NUM_HEADS,
            config=config,
        )
    )
    if reasons:
        print(f"flash_attn {name} (flash-attn {version}) skipped: {'; '.join(reasons)}")
        return None

    blocks_per_req = -(-context // block_size)
    num_blocks = num_reqs * blocks_per_req + 1
    pool = list(range(1, num_blocks))
    random.Random(0).shuffle(pool)
    tables = [pool[r * blocks_per_req : (r + 1) * blocks_per_req] for r in range(num_reqs)]
    slots = [
        tables[r][p // block_size] * block_size + p % block_size
        for r in range(num_reqs)
        for p in range(context - new, context)
    ]
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[new] * num_reqs,
        seq_lens=[context] * num_reqs,
        block_table=tables,
        slot_mapping=slots,
        device=device,
    )
    (shape,) = FlashAttentionBackend.get_kv_cache_shapes(num_blocks, spec)
    cache = torch.randn(shape, device=device, dtype=DTYPE)
    cache[0] = 0
    tokens = num_reqs * new
    query = torch.randn(tokens, NUM_HEADS, HEAD_SIZE, device=device, dtype=DTYPE)
    key = torch.randn(tokens, NUM_KV_HEADS, HEAD_SIZE, device=device, dtype=DTYPE)
    value = torch.randn_like(key)
    output = torch.empty_like(query)
    binding = FlashAttentionBackend.get_binding(spec)
    builder = binding.create(spec, ["bench"], config, device)
    impl = binding.create_impl(spec, AttentionLayerParams(num_heads=NUM_HEADS))
    md = builder.build(0, cm)
    flash_ms = _time_ms(lambda: impl.forward(query, key, value, [cache], md, output))

    group = NUM_HEADS // NUM_KV_HEADS
    q = torch.randn(num_reqs, NUM_HEADS, new, HEAD_SIZE, device=device, dtype=DTYPE)
    k = torch.randn(num_reqs, NUM_KV_HEADS, context, HEAD_SIZE, device=device, dtype=DTYPE)
    k = k.repeat_interleave(group, dim=1).contiguous()
    v = torch.randn_like(k)
    causal = new == context  # a decode row sees its whole context
    sdpa_ms = _time_ms(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    )
    return {
        "case": name,
        "flash_attn_version": version,
        "num_reqs": num_reqs,
        "new_tokens": new,
        "context": context,
        "block_size": block_size,
        "flash_attn_ms": flash_ms,
        "sdpa_ms": sdpa_ms,
        "flash_attn_over_sdpa": flash_ms / sdpa_ms,
    }


def run_flash_attn_cases(out_dir: str) -> list[dict[str, Any]]:
    """Time every case for every usable flash-attn version; write ``flash_attn_cases.json``.

    Returns the rows written, or ``[]`` (with the reason printed) without a GPU or
    flash-attn.
    """
    if not torch.cuda.is_available():
        print("flash_attn cases skipped: no CUDA device")
        return []
    installed = _versions.installed_versions()
    if not installed:
        print(f"flash_attn cases skipped: {_versions.NOT_INSTALLED_REASON}")
        return []
    rows = [
        row
        for version in sorted(installed)
        for case in CASES
        if (row := _case(version, *case)) is not None
    ]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flash_attn_cases.json").write_text(json.dumps(rows, indent=2) + "\n")
    for row in rows:
        print(
            f"flash_attn {row['case']:8s} fa{row['flash_attn_version']}: "
            f"{row['flash_attn_ms']:.3f} ms, sdpa {row['sdpa_ms']:.3f} ms "
            f"(x{row['flash_attn_over_sdpa']:.2f})"
        )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results")
    run_flash_attn_cases(parser.parse_args().out)
