"""Generate with a Hugging Face transformers model whose attention runs on attnkit.

    pip install 'attnkit[transformers]'
    python examples/transformers_generate.py                       # tiny random llama, CPU
    python examples/transformers_generate.py --family gpt_oss --backend triton_attn
    python examples/transformers_generate.py --model Qwen/Qwen2.5-0.5B --device cuda \\
        --prompt "The capital of France is" --prompt "def fibonacci(n):"

Without ``--model`` the model is a tiny random-weight one of ``--family`` (no download),
prompts are random token ids, and every engine step is checked against transformers'
own eager attention. With ``--model`` the checkpoint and its tokenizer are loaded
(``from_pretrained``: a model id is downloaded from the Hugging Face Hub on first use,
about 1 GB for Qwen2.5-0.5B, then read from the local cache) and the generated text is
printed. ``--device`` is checked first: a device this machine lacks is an error before
anything is downloaded.

The steps: load a causal LM, ``attach`` it (attnkit reads the layer specs from its
config, the scales, windows, soft-caps and sinks from its attention modules, and
registers itself as the model's attention implementation), then let ``Engine`` serve
the requests: continuous batching under a per-step token budget, chunked prefill,
greedy or sampled decoding, preemption when the cache runs out.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def _device_problem(name: str) -> str | None:
    """Why ``name`` is not a device of this machine, or ``None``: checked before a
    checkpoint is downloaded for it."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        return f"{name!r} is not a device (cpu, cuda or cuda:N)"
    if device.type != "cuda":
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (device.index or 0) >= count:
        return f"{name!r} is not available here ({count} CUDA device(s) visible)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face model id or directory")
    parser.add_argument("--family", default="llama", help="tiny random model family")
    parser.add_argument("--prompt", action="append", default=None, help="text (with --model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default=None, help="e.g. reference or triton_attn")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--tokens-per-step", type=int, default=16)
    args = parser.parse_args(argv)
    problem = _device_problem(args.device)
    if problem is not None:
        parser.error(f"argument --device: {problem}; --device cpu runs anywhere")
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton on CPU: the interpreter

    from attnkit import AttentionConfig
    from attnkit.integrations.engine import Engine, SamplingParams
    from attnkit.integrations.transformers import (
        attach,
        check_against_eager,
        describe_layers,
        tiny_model,
    )

    tokenizer = None
    if args.model is None:
        model = tiny_model(args.family).to(args.device)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        model = model.to(args.device).eval()

    config = AttentionConfig(backend=args.backend)
    # triton_attn takes blocks of 16 tokens and more.
    attached = attach(model, config=config, num_blocks=args.num_blocks, block_size=16)
    print("\n".join(describe_layers(attached)))

    engine = Engine(attached, max_tokens_per_step=args.tokens_per_step, keep_logits=True)
    if tokenizer is not None:
        texts = args.prompt or ["The capital of France is", "def fibonacci(n):"]
        prompts = [list(tokenizer(text).input_ids) for text in texts]
    else:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in (12, 5, 9)]
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=0.7 if i % 2 else 0.0,  # odd requests sample, even ones are greedy
            seed=i,
        )
        engine.add_request(f"req{i}", prompt, sampling, arrival_step=i)  # staggered arrivals
    result = engine.run()

    for step in result.steps:
        parts = ", ".join(f"{rid}+{n}" for rid, n in step.scheduled)
        print(f"step {step.step}: {parts}  free blocks {step.num_free_blocks}")
    for rid, tokens in result.outputs.items():
        shown = tokenizer.decode(tokens) if tokenizer is not None else tokens
        print(f"{rid}: {shown!r}" if tokenizer is not None else f"{rid}: {shown}")
    check = check_against_eager(attached, result)
    print(
        f"every step vs transformers eager: max |dlogit| {check.max_error:.2e} "
        f"(tolerance {check.tolerance:.1e}) -> {'ok' if check.passed else 'MISMATCH'}"
    )
    return 0 if check.passed else 1


if __name__ == "__main__":
    sys.exit(main())
