"""What an engine pays per step for ``TritonAttentionMetadataBuilder``, and how it grows
with the batch.

Cases: 1, 64, 256 and 1024 decode requests (context 2048 each, block size 16, so a
block table of 128 entries per request) and one mixed batch (a 512-token prefill chunk
among 63 decodes). For each, the host microseconds per step of:

* ``build()``, the eager build: it passes the step's tensors through and reads a few
  Python ints (no copy);
* ``build_for_cudagraph_capture()``, the graph build: it copies the step's offsets,
  lengths, block table and slot mapping into the builder's fixed-address buffers;
* the in-run baseline for the graph build: the bare cost of the same four tensor
  copies (``copy_(..., non_blocking=True)``) into fixed-address buffers of the same
  shapes, and nothing else (timed in turns with the two builds);
* a calibration: a bare Python ``for`` over the step's requests with an empty body,
  the cheapest per-request Python work there is.

On CUDA the figures are host time (the device work is enqueued, not awaited), which
is what a step's CPU path pays.

Criteria. The absolute cost does not show whether a builder loops over requests in
Python; its growth with the batch does. Slopes are least-squares fits over the decode
cases with 64, 256 and 1024 requests, in microseconds per extra request:

* eager ``build()`` copies nothing, so its slope must be below the calibration loop's
  slope: any per-request Python loop, whatever its body, adds at least that much;
* the graph build must grow no faster than its copies: its slope minus the baseline's
  slope must be below the calibration loop's slope.

(A flat *ratio* to a baseline would show neither: the copies grow with the bytes, and
a builder with a per-request loop can keep a flat ratio to them.)

Target (issue "triton_attn: the complete, fast Triton paged-attention backend"): at
most 50 microseconds per eager ``build()`` for 256 decode requests; no device-to-host
sync (checked with ``torch.cuda.set_sync_debug_mode("error")`` when a GPU is present).

    python benchmarks/bench_metadata.py --out bench-results [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from attnkit import AttentionConfig, FullAttentionSpec
from attnkit.backend_api import CommonAttentionMetadata
from attnkit.backends.triton_attn import TritonAttentionMetadataBuilder

TARGET_US_256 = 50.0
BLOCK_SIZE = 16
CONTEXT = 2048
MAX_NUM_REQS, MAX_BATCHED_TOKENS, MAX_MODEL_LEN = 1024, 2048, 4096
SLOPE_SIZES = (64, 256, 1024)


def timed(
    fns: dict[str, Callable[[], object]], device: torch.device, *, repeat: int, number: int
) -> dict[str, float]:
    """Median over ``repeat`` runs of the mean host microseconds per call of each of
    ``fns``; the functions take turns within each run (paired, so drift hits all)."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # start each run with an empty queue
            start = time.perf_counter()
            for _ in range(number):
                fn()
            runs[name].append((time.perf_counter() - start) / number)
    return {name: statistics.median(times) * 1e6 for name, times in runs.items()}


def batch(num_decodes: int, prefill: int, device: torch.device) -> CommonAttentionMetadata:
    query_lens = [1] * num_decodes + ([prefill] if prefill else [])
    seq_lens = [CONTEXT] * num_decodes + ([prefill] if prefill else [])
    num_reqs = len(query_lens)
    width = -(-CONTEXT // BLOCK_SIZE)
    table = torch.arange(num_reqs * width, dtype=torch.int32).reshape(num_reqs, width) + 1
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    tokens = int(qsl[-1])
    slots = torch.arange(tokens, dtype=torch.int64)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq.to(device),
        seq_lens_cpu=seq,
        num_reqs=num_reqs,
        num_actual_tokens=tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table.to(device),
        slot_mapping=slots.to(device),
    )


class FixedBuffers:
    """The baseline's fixed-address buffers, shaped as the builder's graph buffers."""

    def __init__(self, device: torch.device) -> None:
        width = -(-MAX_MODEL_LEN // BLOCK_SIZE)
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((MAX_NUM_REQS, width), dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((MAX_BATCHED_TOKENS,), -1, dtype=torch.int64, device=device)

    def copy_step(self, cm: CommonAttentionMetadata) -> None:
        """The graph build's four copies, and nothing else."""
        num_reqs, num_tokens = cm.num_reqs, cm.slot_mapping.shape[0]
        width = cm.block_table_tensor.shape[1]
        self.query_start_loc[: num_reqs + 1].copy_(cm.query_start_loc, non_blocking=True)
        self.seq_lens[:num_reqs].copy_(cm.seq_lens, non_blocking=True)
        self.block_table[:num_reqs, :width].copy_(cm.block_table_tensor, non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(cm.slot_mapping, non_blocking=True)


def python_loop(num_reqs: int) -> Callable[[], None]:
    """The calibration: a bare Python loop over ``num_reqs`` requests."""
    reqs = range(num_reqs)

    def loop() -> None:
        for _ in reqs:
            pass

    return loop


def measure(
    builder: TritonAttentionMetadataBuilder,
    fixed: FixedBuffers,
    name: str,
    decodes: int,
    prefill: int,
    device: torch.device,
    *,
    repeat: int,
    number: int,
) -> dict[str, float | int | str]:
    cm = batch(decodes, prefill, device)
    sync_mode = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")  # any device-to-host sync raises
    try:
        us = timed(
            {
                "build": lambda: builder.build(0, cm),
                "graph_build": lambda: builder.build_for_cudagraph_capture(cm),
                "copies": lambda: fixed.copy_step(cm),
            },
            device,
            repeat=repeat,
            number=number,
        )
    finally:
        if sync_mode is not None:
            torch.cuda.set_sync_debug_mode(sync_mode)
    loop = timed({"loop": python_loop(cm.num_reqs)}, device, repeat=repeat, number=number)
    return {
        "case": name,
        "num_reqs": cm.num_reqs,
        "tokens": cm.num_actual_tokens,
        "build_us": us["build"],
        "graph_build_us": us["graph_build"],
        "copies_us": us["copies"],
        "graph_over_copies_us": us["graph_build"] - us["copies"],
        "python_loop_us": loop["loop"],
    }


def slope(rows: list[dict[str, float | int | str]], key: str) -> float:
    """Least-squares microseconds per extra request over the decode cases of SLOPE_SIZES."""
    points = [r for r in rows if r["case"] == "decode" and r["num_reqs"] in SLOPE_SIZES]
    x = np.array([float(r["num_reqs"]) for r in points])
    y = np.array([float(r[key]) for r in points])
    return float(np.polyfit(x, y, 1)[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    repeat, number = (5, 100) if args.quick else (9, 400)
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    config = AttentionConfig.model_validate(
        {
            "max_num_reqs": MAX_NUM_REQS,
            "max_num_batched_tokens": MAX_BATCHED_TOKENS,
            "max_model_len": MAX_MODEL_LEN,
        },
        context={"known_backends": []},
    )
    builder = TritonAttentionMetadataBuilder(spec, ["layers.0"], config, device)
    fixed = FixedBuffers(device)
    cases = [("decode", n, 0) for n in (1, *SLOPE_SIZES)] + [("mixed", 63, 512)]
    rows = [
        measure(builder, fixed, name, d, p, device, repeat=repeat, number=number)
        for name, d, p in cases
    ]
    print(f"TritonAttentionMetadataBuilder on {device}: host microseconds per step")
    print(
        f"{'case':>7} {'reqs':>5} {'tokens':>6} {'build':>8} {'graph build':>12} "
        f"{'copies (baseline)':>18} {'graph - copies':>15} {'python loop':>12}"
    )
    for r in rows:
        print(
            f"{r['case']:>7} {r['num_reqs']:>5} {r['tokens']:>6} {r['build_us']:>8.2f} "
            f"{r['graph_build_us']:>12.2f} {r['copies_us']:>18.2f} "
            f"{r['graph_over_copies_us']:>15.2f} {r['python_loop_us']:>12.2f}"
        )
    slopes = {
        "build": slope(rows, "build_us"),
        "graph_build": slope(rows, "graph_build_us"),
        "copies": slope(rows, "copies_us"),
        "python_loop": slope(rows, "python_loop_us"),
    }
    excess = slopes["graph_build"] - slopes["copies"]
    bound = slopes["python_loop"]
    decode256 = next(r for r in rows if r["case"] == "decode" and r["num_reqs"] == 256)
    build_256 = float(decode256["build_us"])
    verdicts = {
        "build_256_us_meets_target": build_256 <= TARGET_US_256,
        "build_has_no_per_request_loop": slopes["build"] < bound,
        "graph_build_has_no_per_request_loop": excess < bound,
    }
    print(f"slopes over {', '.join(map(str, SLOPE_SIZES))} decodes (us per extra request):")
    print(
        f"  build {slopes['build']:.4f}, graph build {slopes['graph_build']:.4f}, "
        f"copies {slopes['copies']:.4f}, graph build - copies {excess:.4f}; "
        f"a bare Python loop over requests {slopes['python_loop']:.4f} (the bound)"
    )
    for what, ok in (
        ("build()", verdicts["build_has_no_per_request_loop"]),
        ("graph build (beyond its copies)", verdicts["graph_build_has_no_per_request_loop"]),
    ):
        print(f"  {what}: per-request loop {'none (meets)' if ok else 'FOUND (misses)'}")
    print(
        f"256 decodes: build() {build_256:.1f} us: "
        f"{'meets' if verdicts['build_256_us_meets_target'] else 'MISSES'} the "
        f"{TARGET_US_256:.0f} us target (graph build {float(decode256['graph_build_us']):.1f} "
        f"us, its copies alone {float(decode256['copies_us']):.1f} us)"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_metadata.json").write_text(
        json.dumps(
            {
                "device": str(device),
                "rows": rows,
                "slopes_us_per_req": slopes,
                "graph_minus_copies_slope_us_per_req": excess,
                "loop_bound_us_per_req": bound,
                "verdicts": verdicts,
                "target_build_us_256": TARGET_US_256,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
