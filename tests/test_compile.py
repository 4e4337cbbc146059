"""``AttentionRuntime.forward_op``: a model that calls the runtime inside
``torch.compile(fullgraph=True)``.

A two-layer toy model (projections, attention through the runtime, a residual) runs a
prefill of two requests and three decode steps compiled, with ``begin_step`` outside
the compiled region; every step's rows are checked against the same model run densely
in float64 over each request's whole sequence (causal softmax written here). Both
AOTAutograd and Inductor compile it as one graph. The broken variant, the same model
calling ``runtime.forward`` directly, is shown to break the graph; errors raised inside
the node are the runtime's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    FullAttentionSpec,
    ScheduledRequest,
    SlidingWindowSpec,
    StaleStepError,
    UnknownLayerError,
)

HIDDEN, HQ, HKV, D, BS, WINDOW = 48, 4, 2, 16, 16, 6
SPECS = {
    "l0": FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32),
    "l1": SlidingWindowSpec(
        block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32, sliding_window=WINDOW
    ),
}


class Toy(torch.nn.Module):
    def __init__(self, runtime: AttentionRuntime, direct: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.runtime, self.direct = runtime, direct
        self.w = [torch.randn(HIDDEN, (HQ + 2 * HKV) * D, generator=gen) / HIDDEN**0.5 for _ in SPECS]
        self.o = [torch.randn(HQ * D, HIDDEN, generator=gen) / (HQ * D) ** 0.5 for _ in SPECS]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, name in enumerate(SPECS):
            q, k, v = (x @ self.w[i]).split([HQ * D, HKV * D, HKV * D], dim=-1)
            q, k, v = q.reshape(-1, HQ, D), k.reshape(-1, HKV, D), v.reshape(-1, HKV, D)
            if self.direct:
                a = self.runtime.forward(name, q.contiguous(), k.contiguous(), v.contiguous())
            else:
                a = self.runtime.forward_op(name, q, k, v)
            x = x + a.reshape(-1, HQ * D) @ self.o[i]
        return torch.tanh(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """Float64 over one request's whole sequence ``[n, HIDDEN]``."""
        x = x.double()
        n = x.shape[0]
        pos = torch.arange(n)
        for i, name in enumerate(SPECS):
            q, k, v = (x @ self.w[i].double()).split([HQ * D, HKV * D, HKV * D], dim=-1)
            q = q.reshape(n, HQ, D)
            k = k.reshape(n, HKV, D).repeat_interleave(HQ // HKV, 1)
            v = v.reshape(n, HKV, D).repeat_interleave(HQ // HKV, 1)
            visible = pos[None, :] <= pos[:, None]
            if name == "l1":
                visible &= pos[:, None] - pos[None, :] < WINDOW
            s = torch.einsum("thd,khd->htk", q, k) / D**0.5
            s = s.masked_fill(~visible, float("-inf"))
            a = torch.einsum("htk,khd->thd", s.softmax(-1), v)
            x = x + a.reshape(n, HQ * D) @ self.o[i].double()
        return torch.tanh(x)


def _runtime() -> AttentionRuntime:
    return AttentionRuntime(
        SPECS,
        AttentionConfig(max_num_reqs=4),
        device="cpu",
        memory_budget_bytes=2**22,
        layer_params={n: AttentionLayerParams(num_heads=HQ) for n in SPECS},
        cache_fill=float("nan"),
    )


def _run(model: Toy, step_fn: Any) -> None:
    """Prefill 9 and 5 tokens, then three decodes; each step against the dense oracle."""
    gen = torch.Generator().manual_seed(1)
    seqs = {"a": torch.randn(12, HIDDEN, generator=gen), "b": torch.randn(8, HIDDEN, generator=gen)}
    held = {"a": 0, "b": 0}
    for counts in ({"a": 9, "b": 5}, {"a": 1, "b": 1}, {"a": 1, "b": 1}, {"a": 1, "b": 1}):
        batch = model.runtime.begin_step([ScheduledRequest(r, n) for r, n in counts.items()])
        rows = torch.cat([seqs[r][held[r] : held[r] + counts[r]] for r in batch.order])
        got = step_fn(rows)
        slices = batch.token_slices()
        for r in batch.order:
            held[r] += counts[r]
            want = model.dense(seqs[r][: held[r]])[held[r] - counts[r] :]
            err = (got[slices[r]].double() - want).abs().max().item()
            assert err <= 1e-4, f"request {r} at {held[r]} tokens: max error {err:.3g}"


# Inductor's own code path calls a deprecated torch.jit helper (a torch warning, not ours).
@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.* is deprecated:DeprecationWarning")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_model_calls_the_runtime_as_one_graph(backend: str) -> None:
    torch._dynamo.reset()
    model = Toy(_runtime())
    _run(model, torch.compile(model, fullgraph=True, backend=backend))


def test_eager_calls_through_the_operator_are_forward() -> None:
    model = Toy(_runtime())
    _run(model, model)


def test_calling_forward_directly_breaks_the_graph() -> None:
    """The broken variant: ``runtime.forward`` itself under ``fullgraph=True``."""
    torch._dynamo.reset()
    model = Toy(_runtime(), direct=True)
    model.runtime.begin_step([ScheduledRequest("a", 3)])
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(model, fullgraph=True, backend="aot_eager")(torch.randn(3, HIDDEN))


def test_errors_inside_the_node_are_the_runtimes() -> None:
    rt = _runtime()
    q, kv = torch.randn(2, HQ, D), torch.randn(2, HKV, D)
    with pytest.raises(StaleStepError, match=r"forward\(\) called before begin_step"):
        rt.forward_op("l0", q, kv, kv)
    rt.begin_step([ScheduledRequest("a", 2)])
    with pytest.raises(UnknownLayerError, match="unknown layer 'nope'"):
        rt.forward_op("nope", q, kv, kv)
    with pytest.raises(StaleStepError, match="no longer exists"):
        torch.ops.attnkit.runtime_forward("runtime-gone", "l0", q, kv, kv, torch.empty_like(q))
