"""Speculative decoding on CPU: a verify step against decode steps, and the engine with
and without prompt-lookup drafting.

1. Verify vs decodes (one attention layer, the CPU default ``cpu_attn``; bfloat16, 32
   query heads, 8 KV heads of 128, blocks of 16): 32 requests x 2048 tokens of context
   verify k = 4 drafts in one step (5 queries each), against one decode step and the 5
   sequential decode steps the same tokens take without drafting. Reported: each
   median, the time per verified token, and the verify step over one decode step
   (target: at most 1.5x), and its arithmetic floor: its multiply-adds at the rate
   ``torch.mm`` reaches on this machine in DTYPE (what a verify step costs when
   arithmetic, not memory, bounds it). Paired rounds (verify, one decode, five decodes in turn)
   keep a shared machine's drift out of the ratios.
2. Engine with and without drafting on repetitive text (the demo model, full and
   sliding-window layers; prompts are short patterns repeated, greedy decoding):
   tokens per second, steps, the acceptance rate and tokens per decoding step. The
   tokens are checked equal.

    python benchmarks/bench_spec.py [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    FullAttentionSpec,
    ScheduledRequest,
)

HQ, HKV, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16


def _runtime(requests: int, context: int, k: int) -> AttentionRuntime:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=DTYPE)
    per_request = (context + 2 * (k + 1) * 8 + BS) // BS
    itemsize = torch.empty((), dtype=DTYPE).element_size()
    budget = (requests * per_request + 8) * 2 * BS * HKV * D * itemsize
    return AttentionRuntime(
        {"l": spec},
        AttentionConfig(
            max_num_batched_tokens=max(8192, requests * (k + 1)),
            max_model_len=context + 256,
            num_speculative_tokens=k,
            max_num_reqs=max(requests, 8),
        ),
        device="cpu",
        memory_budget_bytes=budget,
        layer_params={"l": AttentionLayerParams(num_heads=HQ)},
    )


def _tensors(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(n, HQ, D, generator=gen).to(DTYPE)
    k, v = torch.randn(2, n, HKV, D, generator=gen).to(DTYPE)
    return q, k, v


def gemm_rate(rounds: int) -> float:
    """Multiply-adds per second of ``torch.mm`` on 1024 x 1024 matrices of DTYPE with the
    same threads: what this machine's cores reach on dense arithmetic, for the verify
    step's arithmetic floor (its multiply-adds at that rate)."""
    n = 1024
    a, b = torch.randn(2, n, n, generator=torch.Generator().manual_seed(1)).to(DTYPE)
    torch.mm(a, b)  # warm-up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return n**3 / min(times)


def verify_vs_decodes(requests: int, context: int, k: int, rounds: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    ids = [f"r{i}" for i in range(requests)]
    rt = _runtime(requests, context, k)
    for i in range(0, requests, 4):  # the context, a few requests per step
        step = rt.begin_step([ScheduledRequest(r, context) for r in ids[i : i + 4]])
        rt.forward("l", *_tensors(step.num_tokens, gen))
    verify_in = _tensors(requests * (k + 1), gen)
    decode_in = [_tensors(requests, gen) for _ in range(k + 1)]

    rows = rt.manager.lookup_rows(ids)
    start = rt.manager._num_tokens[rows].copy()

    def restore() -> None:
        """Every request back to its context (host tables only; not timed)."""
        rt.manager.take_back(rows, start)

    def verify() -> float:
        t0 = time.perf_counter()
        rt.begin_step([ScheduledRequest(r, k + 1, num_draft_tokens=k) for r in ids])
        rt.forward("l", *verify_in)
        rt.accept(dict.fromkeys(ids, 0))
        seconds = time.perf_counter() - t0
        restore()
        return seconds

    def decodes(n: int) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            for j in range(n):
                rt.begin_step([ScheduledRequest(r, 1) for r in ids])
                rt.forward("l", *decode_in[j])
            seconds = time.perf_counter() - t0
            restore()
            return seconds

        return run

    fns = {"verify": verify, "decode": decodes(1), "decodes": decodes(k + 1)}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(fn())
    med = {name: statistics.median(v) for name, v in times.items()}
    verified = requests * (k + 1)
    # Row t of a request sees context + t + 1 keys; each key costs HQ * D multiply-adds
    # for the score and as many for the value.
    mul_adds = requests * sum(context + t + 1 for t in range(k + 1)) * HQ * D * 2
    floor_s = mul_adds / gemm_rate(max(rounds, 3))
    return {
        "requests": requests,
        "context": context,
        "k": k,
        "backend": rt.routing_table()[0].backend,
        "verify_s": med["verify"],
        "decode_s": med["decode"],
        "sequential_decodes_s": med["decodes"],
        "verify_per_token_us": med["verify"] / verified * 1e6,
        "decode_per_token_us": med["decode"] / requests * 1e6,
        "verify_over_decode": med["verify"] / med["decode"],
        "sequential_over_verify": med["decodes"] / med["verify"],
        "target_verify_over_decode": 1.5,
        "verify_mul_adds": mul_adds,
        "arithmetic_floor_s": floor_s,
        "arithmetic_floor_over_decode": floor_s / med["decode"],
    }


def engine_with_and_without_drafting(k: int, new_tokens: int) -> dict[str, Any]:
    from attnkit.demo import DemoModel
    from attnkit.integrations.engine import Engine, FunctionModel, PromptLookup, SamplingParams

    m = DemoModel(layout=("full", "window"), block_size=16, window=64, num_kv_heads=1)
    gen = torch.Generator().manual_seed(3)
    prompts = {}
    for i, (width, times) in enumerate([(5, 12), (3, 20), (7, 9), (11, 6), (4, 15), (6, 10)]):
        pattern = torch.randint(0, 64, (width,), generator=gen).tolist()
        prompts[f"r{i}"] = pattern * times
    rows: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    for label, drafter in (("plain", None), ("prompt_lookup", PromptLookup(k))):
        runtime = AttentionRuntime(
            m.specs,
            AttentionConfig(num_speculative_tokens=k, max_num_batched_tokens=512),
            device="cpu",
            memory_budget_bytes=2**24,
            layer_params=m.params,
        )

        def call(
            batch: Any, token_ids: torch.Tensor, positions: torch.Tensor, rt: Any = runtime
        ) -> torch.Tensor:
            return m.logits(m.forward_step(rt, token_ids, positions=positions))

        e = Engine(FunctionModel(runtime, call), max_tokens_per_step=512, speculative=drafter)
        for rid, prompt in prompts.items():
            e.add_request(rid, prompt, SamplingParams(max_new_tokens=new_tokens))
        t0 = time.perf_counter()
        result = e.run()
        seconds = time.perf_counter() - t0
        generated = sum(len(v) for v in result.outputs.values())
        stats = e.speculative_stats()
        outputs[label] = result.outputs
        rows[label] = {
            "seconds": seconds,
            "generated_tokens": generated,
            "tokens_per_s": generated / seconds,
            "steps": len(result.steps),
            "acceptance_rate": stats.acceptance_rate,
            "tokens_per_step": stats.tokens_per_step,
            "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens,
        }
    rows["same_tokens"] = outputs["plain"] == outputs["prompt_lookup"]
    rows["speedup"] = rows["prompt_lookup"]["tokens_per_s"] / rows["plain"]["tokens_per_s"]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer rounds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="the verify-vs-decode layer's dtype (default bfloat16)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    global DTYPE
    DTYPE = getattr(torch, args.dtype)
    requests, context, rounds = (8, 512, 3) if args.quick else (32, 2048, 7)
    verify = verify_vs_decodes(requests, context, 4, rounds)
    print(
        f"verify step (k=4, {requests} requests x {context} context, {args.dtype}, "
        f"{verify['backend']}): "
        f"{verify['verify_s'] * 1e3:.1f} ms; one decode step {verify['decode_s'] * 1e3:.1f} ms; "
        f"5 decode steps {verify['sequential_decodes_s'] * 1e3:.1f} ms\n"
        f"  per verified token {verify['verify_per_token_us']:.1f} us vs per decoded token "
        f"{verify['decode_per_token_us']:.1f} us; verify / decode = "
        f"{verify['verify_over_decode']:.2f}x (target <= 1.5x); 5 decodes / verify = "
        f"{verify['sequential_over_verify']:.2f}x\n"
        f"  arithmetic floor: the verify's {verify['verify_mul_adds'] / 1e9:.2f} G multiply-adds "
        f"at torch.mm's rate = {verify['arithmetic_floor_s'] * 1e3:.1f} ms = "
        f"{verify['arithmetic_floor_over_decode']:.2f}x one decode"
    )
    engine = engine_with_and_without_drafting(4, 16 if args.quick else 48)
    for label in ("plain", "prompt_lookup"):
        r = engine[label]
        print(
            f"engine {label}: {r['tokens_per_s']:.0f} tokens/s, {r['steps']} steps, "
            f"acceptance {r['acceptance_rate']:.2f}, {r['tokens_per_step']:.2f} tokens per "
            f"decoding step"
        )
    print(f"  same tokens: {engine['same_tokens']}; speedup {engine['speedup']:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_spec.json"
    path.write_text(json.dumps({"verify": verify, "engine": engine}, indent=2))
    print(f"wrote {path}")
    return 0 if engine["same_tokens"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
