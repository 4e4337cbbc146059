"""The engine end to end: ``attach`` + ``Engine`` on a locally built random Llama, and,
when ``vllm`` is importable (``vllm-cpu``, an optional benchmark environment, never an
attnkit dependency), vLLM's ``LLM`` on the same weights, in alternating rounds.

The workload (the host-path issue's): a random Llama (4 layers, hidden 1024, 16 query
and 4 KV heads of 64, MLP 2816, vocabulary 32000, float32), 16 prompts of 128 random
tokens, 64 greedy tokens each, a step budget of 2048 tokens on both sides (the prompts
prefill in one step). attnkit runs its CPU default backend with blocks of 16; vLLM
eager with blocks of 128 (its CPU default), in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with its OpenMP threads bound to the first
``--threads`` cores.

attnkit runs three times, one per ``attach(..., linears=...)``: ``"onednn"`` (the
default: oneDNN's linear on the model's own weights, no copy), ``"packed"``
(``pack_linears=True``: oneDNN-packed copies of the weights, as vLLM's CPU worker
packs its own; twice the linears' memory) and ``"module"`` (each ``nn.Linear``'s own
``F.linear``). Reported: tokens per second of each side (the median of the rounds), each
attnkit side over vLLM's (target: at least 0.8, at 1 and 2 threads: run once per
thread count), whether the greedy outputs equal vLLM's request by request, and
attnkit's time split from one extra, untimed round: attention (``runtime.forward``),
``begin_step`` and the rest.

    python benchmarks/bench_engine.py [--threads N] [--rounds R] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TARGET = 0.8
"""attnkit's tokens per second over vLLM's, at least."""

PROMPTS, PROMPT_LEN, NEW_TOKENS, BUDGET = 16, 128, 64, 2048


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round, 16 new tokens")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # vLLM's CPU worker binds its OpenMP threads when it starts; the environment must say
    # how many before torch or vllm is imported.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    threads = max(1, args.threads)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
    try:
        import transformers
    except ImportError:
        print("bench_engine: skipped (transformers is not installed: pip install 'attnkit[transformers]')")
        return 0
    import torch

    from attnkit.integrations.engine import Engine, Request, SamplingParams
    from attnkit.integrations.transformers import attach

    torch.set_num_threads(threads)
    new_tokens = 16 if args.quick else NEW_TOKENS
    rounds = 1 if args.quick else max(1, args.rounds)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [
        tuple(torch.randint(0, 32000, (PROMPT_LEN,), generator=g).tolist()) for _ in range(PROMPTS)
    ]
    tokens_out = PROMPTS * new_tokens

    blocks = PROMPTS * (-(-(PROMPT_LEN + new_tokens) // 16)) + 16
    attached = {
        "attnkit": attach(copy.deepcopy(model), num_blocks=blocks, block_size=16),
        "attnkit_packed": attach(
            copy.deepcopy(model), num_blocks=blocks, block_size=16, pack_linears=True
        ),
        "attnkit_module": attach(
            copy.deepcopy(model), num_blocks=blocks, block_size=16, linears="module"
        ),
    }

    def engine_side(name: str) -> Callable[[], list[tuple[int, ...]]]:
        def run() -> list[tuple[int, ...]]:
            engine = Engine(attached[name], max_tokens_per_step=BUDGET)
            result = engine.run(
                [
                    Request(f"r{i}", p, SamplingParams(max_new_tokens=new_tokens))
                    for i, p in enumerate(prompts)
                ]
            )
            return [tuple(result.outputs[f"r{i}"]) for i in range(PROMPTS)]

        return run

    sides: dict[str, Callable[[], list[tuple[int, ...]]]] = {
        name: engine_side(name) for name in attached
    }
    assert attached["attnkit_packed"].linears is not None
    print(
        f"bench_engine: {attached['attnkit_packed'].linears.num_packed} linears packed; "
        f"the default serves them as {attached['attnkit'].linears_mode!r}"
    )
    why_no_vllm = _vllm_missing()
    if why_no_vllm is None:
        sides["vllm"] = _vllm_side(model, prompts, new_tokens)
    else:
        print(f"bench_engine: the vLLM side is skipped ({why_no_vllm})")

    outputs: dict[str, list[tuple[int, ...]]] = {}
    times: dict[str, list[float]] = {name: [] for name in sides}
    with torch.inference_mode():
        for name, side in sides.items():  # warm-up (and the outputs)
            outputs[name] = side()
        for r in range(rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                start = time.perf_counter()
                sides[name]()
                times[name].append(time.perf_counter() - start)
        split = {name: _split(attached[name], sides[name]) for name in attached}

    tok_s = {name: tokens_out / statistics.median(t) for name, t in times.items()}
    results: dict[str, Any] = {
        "threads": threads,
        "rounds": rounds,
        "new_tokens": new_tokens,
        "tokens_per_s": tok_s,
        "attnkit_split_s": split,
        "target": TARGET,
    }
    print(f"engine end to end, {threads} thread(s), {PROMPTS} x {PROMPT_LEN} prompt tokens, {new_tokens} new each:")
    for name, value in tok_s.items():
        print(f"  {name:8s} {value:8.1f} tok/s")
    for name, parts in split.items():
        print(
            f"  {name} split: attention {parts['attention']:.2f} s, begin_step "
            f"{parts['begin_step']:.2f} s, rest {parts['rest']:.2f} s of {parts['total']:.2f} s"
        )
    if "vllm" in tok_s:
        for name in attached:
            same = sum(a == b for a, b in zip(outputs[name], outputs["vllm"], strict=True))
            ratio = tok_s[name] / tok_s["vllm"]
            results[name] = {
                "identical_outputs": same,
                "ratio": ratio,
                "meets_target": ratio >= TARGET,
            }
            print(
                f"  {name} / vLLM tokens per second: {ratio:.2f} (target >= {TARGET}); "
                f"greedy outputs identical: {same}/{PROMPTS}"
            )
    else:
        results["vllm_skipped"] = why_no_vllm
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"engine_{threads}t.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")
    return 0


def _split(attached: Any, run: Callable[[], object]) -> dict[str, float]:
    """One untimed round with ``runtime.forward`` and ``begin_step`` timed."""
    runtime = attached.prepare_step()
    spent = {"attention": 0.0, "begin_step": 0.0}

    def timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                spent[name] += time.perf_counter() - start

        return call

    runtime.forward = timed("attention", runtime.forward)
    runtime.begin_step = timed("begin_step", runtime.begin_step)
    try:
        start = time.perf_counter()
        run()
        total = time.perf_counter() - start
    finally:
        del runtime.forward, runtime.begin_step  # (the instance attributes: the methods again)
    return {**spent, "rest": total - sum(spent.values()), "total": total}


def _vllm_missing() -> str | None:
    try:
        importlib.import_module("vllm")
    except Exception as exc:  # ImportError, or a broken install: the side is skipped
        return f"{type(exc).__name__}: {exc}"
    return None


def _vllm_side(
    model: Any, prompts: list[tuple[int, ...]], new_tokens: int
) -> Callable[[], list[tuple[int, ...]]]:
    """vLLM's ``LLM`` on ``model``'s weights (saved to a temporary directory)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    directory = tempfile.mkdtemp(prefix="attnkit-bench-engine-")
    model.save_pretrained(directory)
    llm = LLM(
        model=directory,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        block_size=128,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=PROMPTS,
        seed=0,
    )
    inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)

    def run() -> list[tuple[int, ...]]:
        outs = llm.generate(inputs, params, use_tqdm=False)
        return [tuple(o.outputs[0].token_ids) for o in outs]

    return run


if __name__ == "__main__":
    sys.exit(main())
