"""``attnkit demo``: a tiny hybrid model served end to end through ``AttentionRuntime``.

The model (random weights, fixed seed) has full-attention, sliding-window-attention and
Mamba2 layers. Several requests of different lengths are prefilled (one long prompt in
chunks, under a per-step token budget) and then decoded greedily. After every step the
step's outputs are checked against a dense recompute of each request's whole sequence
without any cache (``dense_attention`` per sequence, the token-by-token Mamba2
recurrence), and the step prints its time, max abs error and tokens/s.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import TextIO

import torch
import torch.nn.functional as F

from .backend import AttentionLayerParams, Mamba2LayerParams
from .config import AttentionConfig
from .kernels.torch.attention import dense_attention
from .kernels.torch.mamba2 import ssd_recurrent_reference
from .registry import BackendRegistry
from .runtime import AttentionRuntime, ScheduledRequest
from .spec import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

__all__ = ["DemoModel", "DemoResult", "run_demo"]

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-2, torch.bfloat16: 1e-1}


@dataclasses.dataclass
class _AttnLayer:
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    window: int | None


@dataclasses.dataclass
class _MambaLayer:
    w_in: torch.Tensor  # hidden -> z, xBC, dt
    w_out: torch.Tensor
    params: Mamba2LayerParams


class DemoModel:
    """A small hybrid decoder: embeddings, a stack of mixers with residuals, an LM head."""

    def __init__(
        self,
        *,
        layout: Sequence[str] = ("full", "mamba", "window", "mamba", "full", "window"),
        vocab: int = 64,
        hidden: int = 64,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_size: int = 16,
        window: int = 8,
        mamba_heads: int = 4,
        mamba_groups: int = 1,
        d_state: int = 16,
        conv_width: int = 4,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.device = torch.device(device)
        self.dtype = dtype

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(self.device, dtype)

        self.hidden, self.num_heads, self.num_kv_heads, self.head_size = (
            hidden,
            num_heads,
            num_kv_heads,
            head_size,
        )
        self.embed = rand(vocab, hidden)
        self.lm_head = rand(hidden, vocab, scale=hidden**-0.5)
        self.layers: dict[str, _AttnLayer | _MambaLayer] = {}
        self.specs: dict[str, KVCacheSpec] = {}
        self.params: dict[str, AttentionLayerParams | Mamba2LayerParams] = {}
        head_dim = hidden // mamba_heads
        conv_dim = hidden + 2 * mamba_groups * d_state
        for i, kind in enumerate(layout):
            name = f"layers.{i}"
            if kind in ("full", "window"):
                w = window if kind == "window" else None
                self.layers[name] = _AttnLayer(
                    wq=rand(hidden, num_heads * head_size, scale=hidden**-0.5),
                    wk=rand(hidden, num_kv_heads * head_size, scale=hidden**-0.5),
                    wv=rand(hidden, num_kv_heads * head_size, scale=hidden**-0.5),
                    wo=rand(num_heads * head_size, hidden, scale=(num_heads * head_size) ** -0.5),
                    window=w,
                )
                common = {
                    "block_size": block_size,
                    "num_kv_heads": num_kv_heads,
                    "head_size": head_size,
                    "dtype": dtype,
                }
                self.specs[name] = (
                    SlidingWindowSpec(sliding_window=w, **common)  # type: ignore[arg-type]  # keys match the fields
                    if w is not None
                    else FullAttentionSpec(**common)  # type: ignore[arg-type]
                )
                self.params[name] = AttentionLayerParams(num_heads=num_heads)
            elif kind == "mamba":
                params = Mamba2LayerParams(
                    num_heads=mamba_heads,
                    head_dim=head_dim,
                    n_groups=mamba_groups,
                    d_state=d_state,
                    conv_weight=rand(conv_dim, conv_width, scale=0.5).float(),
                    conv_bias=rand(conv_dim, scale=0.1).float(),
                    A=-torch.rand(mamba_heads, generator=gen).add(0.5).to(self.device),
                    D=rand(mamba_heads).float(),
                    dt_bias=rand(mamba_heads, scale=0.5).float(),
                    dt_softplus=True,
                    chunk_size=8,
                )
                self.layers[name] = _MambaLayer(
                    w_in=rand(hidden, hidden + conv_dim + mamba_heads, scale=hidden**-0.5),
                    w_out=rand(hidden, hidden, scale=hidden**-0.5),
                    params=params,
                )
                self.specs[name] = MambaSpec(
                    block_size=block_size,
                    shapes=params.state_shapes,
                    dtypes=(dtype, torch.float32),
                    mamba_type="mamba2",
                )
                self.params[name] = params
            else:
                raise ValueError(
                    f"unknown layer kind {kind!r} in layout; use full, window or mamba"
                )

    # The two forward paths share everything but the mixer core.

    def _attn_inputs(
        self, layer: _AttnLayer, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        q = (x @ layer.wq).view(t, self.num_heads, self.head_size)
        k = (x @ layer.wk).view(t, self.num_kv_heads, self.head_size)
        v = (x @ layer.wv).view(t, self.num_kv_heads, self.head_size)
        return q, k, v

    def _mamba_inputs(
        self, layer: _MambaLayer, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        proj = x @ layer.w_in
        z, xbc, dt = torch.split(
            proj, [self.hidden, layer.params.conv_dim, layer.params.num_heads], dim=-1
        )
        return z, xbc.contiguous(), dt.contiguous()

    def _mamba_out(self, layer: _MambaLayer, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (y.reshape(y.shape[0], -1) * F.silu(z)) @ layer.w_out

    def forward_step(self, runtime: AttentionRuntime, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states of the step's tokens (laid out in ``StepBatch.order``), via the runtime."""
        x = self.embed[tokens]
        for name, layer in self.layers.items():
            h = _rms_norm(x)
            if isinstance(layer, _AttnLayer):
                q, k, v = self._attn_inputs(layer, h)
                out = runtime.forward(name, q, k, v)
                x = x + out.reshape(x.shape[0], -1) @ layer.wo
            else:
                z, xbc, dt = self._mamba_inputs(layer, h)
                y = runtime.forward(name, xbc, dt)
                x = x + self._mamba_out(layer, y, z)
        return _rms_norm(x)

    def forward_dense(self, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states of one whole sequence, with no cache (the check)."""
        x = self.embed[tokens]
        for layer in self.layers.values():
            h = _rms_norm(x)
            if isinstance(layer, _AttnLayer):
                q, k, v = self._attn_inputs(layer, h)
                out = dense_attention(
                    q, k, v, scale=self.head_size**-0.5, causal=True, sliding_window=layer.window
                )
                x = x + out.reshape(x.shape[0], -1) @ layer.wo
            else:
                z, xbc, dt = self._mamba_inputs(layer, h)
                y = _dense_mamba2(layer.params, xbc, dt)
                x = x + self._mamba_out(layer, y.to(x.dtype), z)
        return _rms_norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Pre-norm without a weight: keeps activations O(1) through the random stack."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _dense_mamba2(p: Mamba2LayerParams, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """Mamba2 core of one sequence from a zero state: explicit causal conv, then the recurrence."""
    width = p.conv_kernel
    padded = torch.cat([xbc.new_zeros(width - 1, xbc.shape[1]), xbc]).float()
    conv = torch.zeros_like(padded[width - 1 :])
    for i in range(width):  # out[t] = sum_i w[:, i] * x[t - (W-1) + i]
        conv += padded[i : i + xbc.shape[0]] * p.conv_weight[:, i]
    if p.conv_bias is not None:
        conv = conv + p.conv_bias
    conv = F.silu(conv)
    hp, gn = p.num_heads * p.head_dim, p.n_groups * p.d_state
    xs, bs, cs = torch.split(conv, [hp, gn, gn], dim=-1)
    t = xbc.shape[0]
    y, _ = ssd_recurrent_reference(
        xs.reshape(t, p.num_heads, p.head_dim),
        dt.float(),
        p.A,
        bs.reshape(t, p.n_groups, p.d_state),
        cs.reshape(t, p.n_groups, p.d_state),
        D=p.D,
        dt_bias=p.dt_bias,
        dt_softplus=p.dt_softplus,
    )
    return y


@dataclasses.dataclass
class DemoResult:
    passed: bool
    max_error: float
    steps: int
    tokens: int
    seconds: float


def _schedule(
    prompts: dict[str, list[int]],
    done: dict[str, int],
    generated: dict[str, list[int]],
    budget: int,
) -> list[ScheduledRequest]:
    """Decodes first (1 token each), then prompt chunks under the token budget."""
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
            scheduled.append(ScheduledRequest(rid, take))
            left -= take
    return scheduled


def run_demo(
    *,
    device: str = "cpu",
    backend_per_kind: str | None = None,
    decode_steps: int = 8,
    dtype: torch.dtype = torch.float32,
    token_budget: int = 16,
    out: TextIO,
    registry: BackendRegistry | None = None,
) -> DemoResult:
    """Serve four requests (one long prompt, chunked) and check every step; see the module doc."""
    torch.manual_seed(0)
    model = DemoModel(dtype=dtype, device=device)
    config = AttentionConfig.model_validate(
        {"backend_per_kind": backend_per_kind or {}},
        context={"registry": registry} if registry is not None else None,
    )
    runtime = AttentionRuntime(
        model.specs,
        config,
        device=device,
        memory_budget_bytes=64 * 2**20,
        layer_params=model.params,
        registry=registry,
        cache_fill=float("nan"),
    )
    out.write(
        f"attnkit demo: {len(model.layers)} layers, {runtime.num_blocks} blocks of {runtime.page_size_bytes} B, {dtype}, {device}\n"
    )
    out.write("routing:\n")
    for row in runtime.routing_table():
        group = runtime.groups[row.group_id]
        out.write(
            f"  {row.layer:<10} {row.kind.value:<15} group {row.group_id} "
            f"(block_size {group.spec.block_size}) -> {row.backend} ({row.source})\n"
        )
    level, who = runtime.cudagraph_support()
    out.write(f"CUDA graphs: {level.name} (limited by {who})\n")

    gen = torch.Generator().manual_seed(1)
    lengths = {"req-a": 5, "req-b": 12, "req-long": 40, "req-c": 3}
    prompts = {
        rid: torch.randint(0, 64, (n,), generator=gen).tolist() for rid, n in lengths.items()
    }
    targets = {
        "req-a": decode_steps,
        "req-b": max(1, decode_steps // 2),
        "req-long": decode_steps,
        "req-c": decode_steps,
    }
    done = dict.fromkeys(prompts, 0)
    generated: dict[str, list[int]] = {rid: [] for rid in prompts}
    finished: list[str] = []
    max_error, total_tokens, total_time, step = 0.0, 0, 0.0, 0
    tol = TOLERANCE[dtype]
    passed = True
    while prompts:
        scheduled = _schedule(prompts, done, generated, token_budget)
        start = time.perf_counter()
        batch = runtime.begin_step(scheduled, finished=finished)
        finished = []
        slices = batch.token_slices()
        inputs: list[int] = []
        for rid, n in zip(batch.order, batch.query_lens, strict=True):
            prefilling = done[rid] < len(prompts[rid])
            inputs.extend(
                prompts[rid][done[rid] : done[rid] + n] if prefilling else generated[rid][-1:]
            )
        tokens = torch.tensor(inputs, device=model.device)
        hidden = model.forward_step(runtime, tokens)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        # The check: each request's whole sequence so far, recomputed densely.
        step_error = 0.0
        for rid, n in zip(batch.order, batch.query_lens, strict=True):
            prefilling = done[rid] < len(prompts[rid])
            full_seq = (
                prompts[rid][: done[rid] + n] if prefilling else prompts[rid] + generated[rid]
            )
            dense = model.forward_dense(torch.tensor(full_seq, device=model.device))[-n:]
            step_error = max(
                step_error, (hidden[slices[rid]].float() - dense.float()).abs().max().item()
            )
        ok = math.isfinite(step_error) and step_error <= tol
        passed &= ok
        max_error = max(max_error, step_error) if math.isfinite(step_error) else math.inf
        total_tokens += batch.num_tokens
        total_time += elapsed
        kinds = ", ".join(
            f"{rid}:{n}" for rid, n in zip(batch.order, batch.query_lens, strict=True)
        )
        out.write(
            f"step {step:2d}  [{kinds}]  {elapsed * 1e3:7.1f} ms  max|err| {step_error:.2e}  "
            f"{batch.num_tokens / elapsed:8.0f} tok/s  {'PASS' if ok else 'FAIL'}\n"
        )
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
        step += 1
    runtime.free(finished)
    out.write(
        f"{'PASS' if passed else 'FAIL'}: {step} steps, {total_tokens} tokens, "
        f"max|err| {max_error:.2e} (tolerance {tol:.0e}), {total_tokens / total_time:.0f} tok/s overall\n"
    )
    return DemoResult(
        passed=passed, max_error=max_error, steps=step, tokens=total_tokens, seconds=total_time
    )
