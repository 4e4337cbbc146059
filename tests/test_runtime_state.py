"""State layers through the runtime: every mamba_type, reference and Triton backends,
checked against a dense recompute of each sequence without any cache."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import AttentionConfig, BackendRegistry
from attnkit.demo import PRIORITIES, DemoModel
from attnkit.registry import BUILTIN_BACKENDS
from attnkit.runtime import AttentionRuntime, ScheduledRequest

TOL = 3e-5
LAYOUTS = {
    "mamba2": ("mamba",),
    "gdn": ("gdn",),
    "linear": ("linear",),
    "short_conv": ("short_conv",),
}
EXPECTED_TRITON = {
    "mamba2": "triton_mamba2",
    "gdn": "triton_gdn",
    "linear": "triton_linear_attn",
    "short_conv": "triton_short_conv",
}


def make_runtime(model: DemoModel, prefer: str, seed: int) -> AttentionRuntime:
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    config = AttentionConfig.model_validate({}, context={"registry": reg})
    priority = {"cpu": PRIORITIES[prefer]} if PRIORITIES[prefer] else None
    runtime = AttentionRuntime(
        model.specs,
        config,
        device="cpu",
        memory_budget_bytes=2**22,
        layer_params=model.params,
        registry=reg,
        priority=priority,
        cache_fill=float("nan"),
    )
    random.Random(seed).shuffle(runtime.manager.pool._free)  # non-contiguous state blocks
    return runtime


def run(
    model: DemoModel, runtime: AttentionRuntime, steps: list[list[tuple[str, list[int]]]]
) -> dict[str, torch.Tensor]:
    outputs: dict[str, list[torch.Tensor]] = {}
    for step in steps:
        batch = runtime.begin_step([ScheduledRequest(rid, len(toks)) for rid, toks in step])
        chunks = dict(step)
        tokens = torch.tensor([t for rid in batch.order for t in chunks[rid]])
        hidden = model.forward_step(runtime, tokens)
        for rid, rows in batch.token_slices().items():
            outputs.setdefault(rid, []).append(hidden[rows])
    return {rid: torch.cat(parts) for rid, parts in outputs.items()}


PROMPT = [(i * 7 + 3) % 64 for i in range(37)]
OTHER = [5, 9, 2, 7, 11]


@pytest.mark.parametrize("prefer", ["reference", "triton"])
@pytest.mark.parametrize("mamba_type", list(LAYOUTS))
def test_state_continuity(mamba_type: str, prefer: str) -> None:
    """One-shot prefill == 3 chunks == token by token, all == dense, decodes mixed in."""
    model = DemoModel(layout=LAYOUTS[mamba_type])
    dense = model.forward_dense(torch.tensor([*PROMPT, 1, 2]))
    dense_other = model.forward_dense(torch.tensor([*OTHER, 4, 6]))
    one_shot = make_runtime(model, prefer, 1)
    backend = one_shot.backend_for("layers.0").name
    assert backend == (EXPECTED_TRITON[mamba_type] if prefer == "triton" else "reference")
    a = run(
        model,
        one_shot,
        [[("p", PROMPT), ("o", OTHER)], [("p", [1]), ("o", [4])], [("p", [2]), ("o", [6])]],
    )
    b = run(
        model,
        make_runtime(model, prefer, 2),
        [
            [("o", OTHER), ("p", PROMPT[:5])],
            [("o", [4]), ("p", PROMPT[5:21])],
            [("p", PROMPT[21:]), ("o", [6])],
            [("p", [1])],
            [("p", [2])],
        ],
    )
    tokens = [*PROMPT, 1, 2]
    c = run(model, make_runtime(model, prefer, 3), [[("p", [t])] for t in tokens])
    for got in (a["p"], b["p"], c["p"]):
        torch.testing.assert_close(got, dense, atol=TOL, rtol=TOL)
    for got in (a["o"], b["o"]):
        torch.testing.assert_close(got, dense_other, atol=TOL, rtol=TOL)


@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_random_varlen_batches_hybrid(data: st.DataObject) -> None:
    """Random schedules mixing new requests, continuing prefills and decodes."""
    prefer = data.draw(st.sampled_from(["reference", "triton"]))
    model = DemoModel(layout=("gdn", "full", "mamba", "short_conv", "linear"))
    runtime = make_runtime(model, prefer, data.draw(st.integers(0, 100)))
    lengths = data.draw(st.lists(st.integers(1, 20), min_size=1, max_size=3))
    prompts = {f"r{i}": [(i * 13 + j * 5) % 64 for j in range(n)] for i, n in enumerate(lengths)}
    done = dict.fromkeys(prompts, 0)
    outputs: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    for _ in range(6):
        step = []
        for rid, prompt in prompts.items():
            left = len(prompt) - done[rid]
            if left and data.draw(st.booleans()):
                take = data.draw(st.integers(1, left))
                step.append((rid, prompt[done[rid] : done[rid] + take]))
        if not step:
            continue
        for rid, chunk in step:
            done[rid] += len(chunk)
        got = run(model, runtime, [step])
        for rid, out in got.items():
            outputs[rid].append(out)
    for rid, parts in outputs.items():
        if parts:
            dense = model.forward_dense(torch.tensor(prompts[rid][: done[rid]]))
            torch.testing.assert_close(torch.cat(parts), dense, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("prefer", ["reference", "triton"])
def test_hybrid_demo_passes(prefer: str) -> None:
    """attnkit demo --model hybrid: Mamba2, Gated DeltaNet, linear attention and short
    conv next to full and sliding-window attention, every step checked densely."""
    import io

    from attnkit.demo import run_demo

    out = io.StringIO()
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    result = run_demo(decode_steps=1, out=out, registry=reg, model_name="hybrid", prefer=prefer)
    text = out.getvalue()
    assert result.passed, text
    assert result.max_error < 2e-5
    expected = (
        EXPECTED_TRITON if prefer == "triton" else dict.fromkeys(EXPECTED_TRITON, "reference")
    )
    for mamba_type, backend in expected.items():
        assert f"mamba({mamba_type})" in text
        assert any(
            f"mamba({mamba_type})" in line and line.rstrip().endswith(f"-> {backend} (priority)")
            for line in text.splitlines()
        )
