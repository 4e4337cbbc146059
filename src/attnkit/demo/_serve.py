"""The demo's serving loops: the scheduler (decodes first, prompt chunks under the token
budget), the encoder step, and the decoder loop (prefill, greedy decode), each step's
rows checked against a dense recompute of each request's sequence."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..runtime import AttentionRuntime, ScheduledRequest
from ._model import DemoModel
from ._report import Tally


def _schedule(
    prompts: dict[str, list[int]],
    done: dict[str, int],
    generated: dict[str, list[int]],
    budget: int,
    encoder_lens: dict[str, int] | None = None,
) -> list[ScheduledRequest]:
    """Decodes first (1 token each), then prompt chunks under the token budget; a
    request's first chunk brings its encoder length (``encoder_lens``, cross-attention)."""
    scheduled = [
        ScheduledRequest(rid, 1)
        for rid in prompts
        if done[rid] >= len(prompts[rid]) and generated[rid]
    ]
    left = budget - len(scheduled)
    for rid, prompt in prompts.items():
        remaining = len(prompt) - done[rid]
        if remaining > 0 and left > 0:
            take = min(remaining, left)
            encoder_len = encoder_lens[rid] if encoder_lens is not None and done[rid] == 0 else 0
            scheduled.append(ScheduledRequest(rid, take, encoder_len))
            left -= take
    return scheduled


def _error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Max abs difference of the runtime's rows and the dense recompute's."""
    return float((got.float() - expected.float()).abs().max().item())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _encode(
    model: DemoModel,
    runtime: AttentionRuntime,
    sources: dict[str, list[int]],
    req_ids: Sequence[str],
    tally: Tally,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One encoder step: the requests' whole prompts (encoder-only layers take a request
    in one step), then freed. Returns request id -> (the runtime's encoder output, the
    dense encoder's output), and records the step."""
    start = time.perf_counter()
    batch = runtime.begin_step([ScheduledRequest(rid, len(sources[rid])) for rid in req_ids])
    tokens = torch.tensor([t for rid in batch.order for t in sources[rid]], device=model.device)
    hidden = model.encode_step(runtime, tokens)
    _sync(model.device)
    elapsed = time.perf_counter() - start
    runtime.free(batch.order)  # encoder-only layers keep nothing between steps
    outputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    error = 0.0
    for rid, rows in batch.token_slices().items():
        dense = model.encode_dense(torch.tensor(sources[rid], device=model.device))
        error = max(error, _error(hidden[rows], dense))
        outputs[rid] = (hidden[rows], dense)
    lens = ", ".join(f"{rid}:{n}" for rid, n in zip(batch.order, batch.query_lens, strict=True))
    tally.record(f"encode [{lens}]", error, batch.num_tokens, elapsed)
    return outputs


def serve_encoder_only(
    model: DemoModel,
    runtime: AttentionRuntime,
    prompts: dict[str, list[int]],
    token_budget: int,
    tally: Tally,
) -> None:
    """Encode every prompt whole: each step takes the waiting prompts that fit the
    budget, in order (a prompt longer than the budget goes alone)."""
    waiting = list(prompts)
    while waiting:
        step = [waiting.pop(0)]
        used = len(prompts[step[0]])
        for rid in list(waiting):
            if used + len(prompts[rid]) <= token_budget:
                step.append(rid)
                waiting.remove(rid)
                used += len(prompts[rid])
        _encode(model, runtime, prompts, step, tally)


def serve_decoder(
    model: DemoModel,
    runtime: AttentionRuntime,
    prompts: dict[str, list[int]],
    *,
    decode_steps: int,
    token_budget: int,
    tally: Tally,
    encoder: tuple[AttentionRuntime, dict[str, list[int]]] | None,
) -> None:
    """Prefill (chunked under the budget) and decode greedily through the decoder stack,
    checking each step's rows against a dense recompute of each request's sequence.
    ``encoder``: the encoder runtime and the requests' sources; a request's source is
    encoded in the step before its first decoder step."""
    targets = {
        "req-a": decode_steps,
        "req-b": max(1, decode_steps // 2),
        "req-long": decode_steps,
        "req-c": decode_steps,
    }
    done = dict.fromkeys(prompts, 0)
    generated: dict[str, list[int]] = {rid: [] for rid in prompts}
    finished: list[str] = []
    encoded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    encoder_lens = {rid: len(src) for rid, src in encoder[1].items()} if encoder else None
    while prompts:
        scheduled = _schedule(prompts, done, generated, token_budget, encoder_lens)
        if encoder is not None:
            starting = [r.req_id for r in scheduled if r.encoder_len]
            if starting:
                encoded.update(_encode(model, encoder[0], encoder[1], starting, tally))
        start = time.perf_counter()
        batch = runtime.begin_step(scheduled, finished=finished)
        tally.note_blocks(runtime)
        finished = []
        slices = batch.token_slices()
        inputs: list[int] = []
        positions: list[int] = []
        for rid, n in zip(batch.order, batch.query_lens, strict=True):
            prefilling = done[rid] < len(prompts[rid])
            first = done[rid] if prefilling else len(prompts[rid]) + len(generated[rid]) - 1
            inputs.extend(
                prompts[rid][done[rid] : done[rid] + n] if prefilling else generated[rid][-1:]
            )
            positions.extend(range(first, first + n))
        tokens = torch.tensor(inputs, device=model.device)
        states = (
            torch.cat([encoded[rid][0] for rid in batch.encoder_order])
            if batch.encoder_order
            else None
        )
        hidden = model.forward_step(
            runtime,
            tokens,
            positions=torch.tensor(positions, device=model.device),
            encoder=states,
        )
        _sync(model.device)
        elapsed = time.perf_counter() - start
        # The check: each request's whole sequence so far, recomputed densely.
        step_error = 0.0
        for rid, n in zip(batch.order, batch.query_lens, strict=True):
            prefilling = done[rid] < len(prompts[rid])
            full_seq = (
                prompts[rid][: done[rid] + n] if prefilling else prompts[rid] + generated[rid]
            )
            dense = model.forward_dense(
                torch.tensor(full_seq, device=model.device),
                encoder=encoded[rid][1] if encoder is not None else None,
            )[-n:]
            step_error = max(step_error, _error(hidden[slices[rid]], dense))
        kinds = ", ".join(
            f"{rid}:{n}" for rid, n in zip(batch.order, batch.query_lens, strict=True)
        )
        tally.record(f"[{kinds}]", step_error, batch.num_tokens, elapsed)
        # Advance: prompts consume their chunk; requests whose prompt is done sample a token.
        next_tokens = model.logits(hidden).argmax(-1)
        for rid, n in zip(batch.order, batch.query_lens, strict=True):
            if done[rid] < len(prompts[rid]):
                done[rid] += n
                if done[rid] < len(prompts[rid]):
                    continue
            generated[rid].append(int(next_tokens[slices[rid].stop - 1]))
            if len(generated[rid]) > targets[rid]:
                finished.append(rid)
        for rid in finished:
            del prompts[rid], done[rid], generated[rid]
    runtime.free(finished)
