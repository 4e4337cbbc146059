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
from collections.abc import Callable, Sequence
from typing import Any, Generic, TextIO, TypeVar

import torch
import torch.nn.functional as F
from typing_extensions import override

from .config import AttentionConfig
from .devices import check_device_available, parse_device
from .errors import ArgumentTypeError, InvalidArgumentError
from .kernels.torch.attention import dense_attention
from .kernels.torch.gated_delta import gated_delta_rule_recurrent_reference, l2_normalize
from .kernels.torch.linear_attention import linear_attention_recurrent_reference
from .kernels.torch.mamba2 import ssd_recurrent_reference
from .models import ModelLayout
from .params import (
    AttentionLayerParams,
    GatedDeltaNetLayerParams,
    LayerParams,
    LinearAttentionLayerParams,
    Mamba2LayerParams,
    ShortConvLayerParams,
)
from .registry import BackendRegistry
from .runtime import AttentionRuntime, ScheduledRequest
from .spec import AttentionSpec, FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from .state_inputs import GatedDeltaNetInputs, LinearAttentionInputs, Mamba2Inputs, ShortConvInputs

__all__ = ["MODELS", "DemoModel", "DemoResult", "demo_layout", "run_demo"]

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-2, torch.bfloat16: 1e-1}


_Rand = Callable[..., torch.Tensor]


_SpecT = TypeVar("_SpecT", bound=KVCacheSpec)
_ParamsT = TypeVar("_ParamsT", bound=LayerParams)


class _Mixer(Generic[_SpecT, _ParamsT]):
    """One layer's mixer: the same projections around a runtime core and a dense core.

    Generic in its spec and parameter types, so each mixer keeps its own (a subclass
    may not narrow a mutable attribute of its base).
    """

    spec: _SpecT
    params: _ParamsT

    def step(self, runtime: AttentionRuntime, name: str, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _Attention(_Mixer[AttentionSpec, AttentionLayerParams]):
    params: AttentionLayerParams

    def __init__(
        self,
        rand: _Rand,
        *,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_size: int,
        window: int | None,
        block_size: int,
        dtype: torch.dtype,
    ) -> None:
        self.heads, self.kv_heads, self.head_size, self.window = heads, kv_heads, head_size, window
        self.wq = rand(hidden, heads * head_size, scale=hidden**-0.5)
        self.wk = rand(hidden, kv_heads * head_size, scale=hidden**-0.5)
        self.wv = rand(hidden, kv_heads * head_size, scale=hidden**-0.5)
        self.wo = rand(heads * head_size, hidden, scale=(heads * head_size) ** -0.5)
        self.spec: AttentionSpec = (
            SlidingWindowSpec(
                block_size=block_size,
                num_kv_heads=kv_heads,
                head_size=head_size,
                dtype=dtype,
                sliding_window=window,
            )
            if window is not None
            else FullAttentionSpec(
                block_size=block_size, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype
            )
        )
        self.params = AttentionLayerParams(num_heads=heads)

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = h.shape[0]
        return (
            (h @ self.wq).view(t, self.heads, self.head_size),
            (h @ self.wk).view(t, self.kv_heads, self.head_size),
            (h @ self.wv).view(t, self.kv_heads, self.head_size),
        )

    @override
    def step(self, runtime: AttentionRuntime, name: str, h: torch.Tensor) -> torch.Tensor:
        return runtime.forward(name, *self._qkv(h)).reshape(h.shape[0], -1) @ self.wo

    @override
    def dense(self, h: torch.Tensor) -> torch.Tensor:
        out = dense_attention(
            *self._qkv(h), scale=self.head_size**-0.5, causal=True, sliding_window=self.window
        )
        return out.reshape(h.shape[0], -1) @ self.wo


def _causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal conv of one sequence from a zero state, by its definition."""
    width = weight.shape[1]
    padded = torch.cat([x.new_zeros(width - 1, x.shape[1]), x]).float()
    out = torch.zeros_like(padded[width - 1 :])
    for i in range(width):  # out[t] = sum_i w[:, i] * x[t - (W-1) + i]
        out += padded[i : i + x.shape[0]] * weight[:, i]
    return out + bias if bias is not None else out


class _Mamba2(_Mixer[MambaSpec, Mamba2LayerParams]):
    params: Mamba2LayerParams

    def __init__(
        self,
        rand: _Rand,
        gen: torch.Generator,
        *,
        hidden: int,
        heads: int,
        groups: int,
        d_state: int,
        width: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.hidden = hidden
        conv_dim = hidden + 2 * groups * d_state
        self.params = p = Mamba2LayerParams(
            num_heads=heads,
            head_dim=hidden // heads,
            n_groups=groups,
            d_state=d_state,
            conv_weight=rand(conv_dim, width, scale=0.5).float(),
            conv_bias=rand(conv_dim, scale=0.1).float(),
            A=-torch.rand(heads, generator=gen).add(0.5).to(device),
            D=rand(heads).float(),
            dt_bias=rand(heads, scale=0.5).float(),
            dt_softplus=True,
            chunk_size=8,
        )
        self.w_in = rand(hidden, hidden + conv_dim + heads, scale=hidden**-0.5)
        self.w_out = rand(hidden, hidden, scale=hidden**-0.5)
        self.spec = MambaSpec(
            block_size=block_size,
            shapes=p.state_shapes,
            dtypes=(dtype, torch.float32),
            mamba_type="mamba2",
        )

    def _inputs(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self.params
        z, xbc, dt = torch.split(h @ self.w_in, [self.hidden, p.conv_dim, p.num_heads], dim=-1)
        return z, xbc.contiguous(), dt.contiguous()

    def _out(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (y.reshape(y.shape[0], -1).to(z.dtype) * F.silu(z)) @ self.w_out

    @override
    def step(self, runtime: AttentionRuntime, name: str, h: torch.Tensor) -> torch.Tensor:
        z, xbc, dt = self._inputs(h)
        return self._out(runtime.forward_state(name, Mamba2Inputs(xBC=xbc, dt=dt)), z)

    @override
    def dense(self, h: torch.Tensor) -> torch.Tensor:
        p = self.params
        z, xbc, dt = self._inputs(h)
        conv = F.silu(_causal_conv(xbc, p.conv_weight, p.conv_bias))
        hp, gn = p.num_heads * p.head_dim, p.n_groups * p.d_state
        xs, bs, cs = torch.split(conv, [hp, gn, gn], dim=-1)
        t = h.shape[0]
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
        return self._out(y, z)


class _GatedDeltaNet(_Mixer[MambaSpec, GatedDeltaNetLayerParams]):
    params: GatedDeltaNetLayerParams

    def __init__(
        self,
        rand: _Rand,
        *,
        hidden: int,
        heads: int,
        key_dim: int,
        width: int,
        block_size: int,
        dtype: torch.dtype,
    ) -> None:
        self.hidden, value_dim = hidden, hidden // heads
        conv_dim = heads * (2 * key_dim + value_dim)
        self.params = p = GatedDeltaNetLayerParams(
            num_heads=heads,
            key_dim=key_dim,
            value_dim=value_dim,
            conv_weight=rand(conv_dim, width, scale=0.5).float(),
            conv_bias=None,
            chunk_size=16,
        )
        self.w_in = rand(hidden, conv_dim + 2 * heads + hidden, scale=hidden**-0.5)
        self.w_out = rand(hidden, hidden, scale=hidden**-0.5)
        self.spec = MambaSpec(
            block_size=block_size,
            shapes=p.state_shapes,
            dtypes=(dtype, torch.float32),
            mamba_type="gdn",
        )

    def _inputs(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p = self.params
        qkv, a, b, z = torch.split(
            h @ self.w_in, [p.conv_dim, p.num_heads, p.num_heads, self.hidden], dim=-1
        )
        g = -F.softplus(a.float())  # log decay <= 0
        beta = torch.sigmoid(b.float())
        return qkv.contiguous(), g.contiguous(), beta.contiguous(), z

    def _out(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (o.reshape(o.shape[0], -1).to(z.dtype) * F.silu(z)) @ self.w_out

    @override
    def step(self, runtime: AttentionRuntime, name: str, h: torch.Tensor) -> torch.Tensor:
        qkv, g, beta, z = self._inputs(h)
        return self._out(
            runtime.forward_state(name, GatedDeltaNetInputs(qkv=qkv, g=g, beta=beta)), z
        )

    @override
    def dense(self, h: torch.Tensor) -> torch.Tensor:
        p = self.params
        qkv, g, beta, z = self._inputs(h)
        mixed = F.silu(_causal_conv(qkv, p.conv_weight, p.conv_bias))
        t, hk = h.shape[0], p.num_heads * p.key_dim
        q = l2_normalize(mixed[:, :hk].reshape(t, p.num_heads, p.key_dim))
        k = l2_normalize(mixed[:, hk : 2 * hk].reshape(t, p.num_heads, p.key_dim))
        v = mixed[:, 2 * hk :].reshape(t, p.num_heads, p.value_dim)
        o, _ = gated_delta_rule_recurrent_reference(q, k, v, g, beta, scale=p.key_dim**-0.5)
        return self._out(o, z)


class _LinearAttention(_Mixer[MambaSpec, LinearAttentionLayerParams]):
    params: LinearAttentionLayerParams

    def __init__(
        self,
        rand: _Rand,
        *,
        hidden: int,
        heads: int,
        key_dim: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.heads, self.key_dim, self.value_dim = heads, key_dim, hidden // heads
        decay = torch.tensor(
            [2.0 ** (-(8.0 / heads) * (i + 1)) for i in range(heads)], device=device
        )
        self.params = p = LinearAttentionLayerParams(
            num_heads=heads, key_dim=key_dim, value_dim=self.value_dim, decay=decay, chunk_size=16
        )
        self.w_qkv = rand(hidden, heads * (2 * key_dim + self.value_dim), scale=hidden**-0.5)
        self.w_out = rand(hidden, hidden, scale=hidden**-0.5)
        self.spec = MambaSpec(
            block_size=block_size,
            shapes=p.state_shapes,
            dtypes=(torch.float32,),
            mamba_type="linear",
        )

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, hk = h.shape[0], self.heads * self.key_dim
        proj = h @ self.w_qkv
        q = F.silu(proj[:, :hk]).reshape(t, self.heads, self.key_dim)
        k = F.silu(proj[:, hk : 2 * hk]).reshape(t, self.heads, self.key_dim)
        v = proj[:, 2 * hk :].reshape(t, self.heads, self.value_dim)
        return q.contiguous(), k.contiguous(), v.contiguous()

    @override
    def step(self, runtime: AttentionRuntime, name: str, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(h)
        o = runtime.forward_state(name, LinearAttentionInputs(q=q, k=k, v=v))
        return _rms_norm(o.reshape(h.shape[0], -1).to(h.dtype)) @ self.w_out

    @override
    def dense(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(h)
        o, _ = linear_attention_recurrent_reference(
            q, k, v, self.params.decay, scale=self.key_dim**-0.5
        )
        return _rms_norm(o.reshape(h.shape[0], -1).to(h.dtype)) @ self.w_out


class _ShortConv(_Mixer[MambaSpec, ShortConvLayerParams]):
    params: ShortConvLayerParams

    def __init__(
        self, rand: _Rand, *, hidden: int, width: int, block_size: int, dtype: torch.dtype
    ) -> None:
        self.hidden = hidden
        self.params = p = ShortConvLayerParams(
            channels=hidden, conv_weight=rand(hidden, width, scale=0.5).to(dtype)
        )
        self.w_in = rand(hidden, 3 * hidden, scale=hidden**-0.5)
        self.w_out = rand(hidden, hidden, scale=hidden**-0.5)
        self.spec = MambaSpec(
            block_size=block_size, shapes=p.state_shapes, dtypes=(dtype,), mamba_type="short_conv"
        )

    def _bcx(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.contiguous() for t in torch.split(h @ self.w_in, self.hidden, dim=-1))

    @override
    def step(self, runtime: AttentionRuntime, name: str, h: torch.Tensor) -> torch.Tensor:
        b, c, x = self._bcx(h)
        return runtime.forward_state(name, ShortConvInputs(b=b, c=c, x=x)) @ self.w_out

    @override
    def dense(self, h: torch.Tensor) -> torch.Tensor:
        b, c, x = self._bcx(h)
        y = c.float() * _causal_conv(b * x, self.params.conv_weight.float(), None)
        return y.to(h.dtype) @ self.w_out


LAYER_KINDS = ("full", "window", "mamba", "gdn", "linear", "short_conv")
PRIORITIES: dict[str, tuple[str, ...]] = {
    "reference": (),  # the device's default priority list
    "triton": (
        "triton_attn",
        "triton_mamba1",
        "triton_mamba2",
        "triton_gdn",
        "triton_linear_attn",
        "triton_short_conv",
        "reference",
    ),
}
MODELS: dict[str, tuple[str, ...]] = {
    "default": ("full", "mamba", "window", "mamba", "full", "window"),
    "hybrid": ("full", "mamba", "window", "gdn", "linear", "short_conv", "full", "gdn"),
}


DEMO_LAYERS_PER_KIND = 2
"""Layers of each kind ``demo_layout`` keeps."""

_DEMO_KINDS: dict[tuple[str, str | None], str] = {
    ("full_attention", None): "full",
    ("sliding_window", None): "window",
    ("mamba", "mamba2"): "mamba",
    ("mamba", "gdn"): "gdn",
    ("mamba", "linear"): "linear",
    ("mamba", "short_conv"): "short_conv",
}


def demo_layout(model: ModelLayout, *, per_kind: int = DEMO_LAYERS_PER_KIND) -> tuple[str, ...]:
    """A real model's layer kinds, shrunk for ``DemoModel``: the model's layers in
    order, keeping the first ``per_kind`` of each kind (``"full"``, ``"window"``, and one
    kind per state-layer type); the demo gives them its own small sizes.

    Raises:
        InvalidArgumentError: the model has a layer the demo cannot run (MLA,
            chunked-local, encoder-only, cross-attention, sink or Mamba1 layers); the
            message names the first such layer and its kind.
    """
    kept: list[str] = []
    for name, info in model.layers.items():
        spec = info.spec
        mamba_type = spec.mamba_type if isinstance(spec, MambaSpec) else None
        kind = _DEMO_KINDS.get((spec.kind.value, mamba_type))
        if kind is None:
            what = spec.kind.value + (f" ({mamba_type})" if mamba_type else "")
            raise InvalidArgumentError(
                f"the demo runs full-attention, sliding-window, mamba2, gdn, linear and "
                f"short_conv layers; {model.model_type} layer {name!r} is {what}"
            )
        if kept.count(kind) < per_kind:
            kept.append(kind)
    return tuple(kept)


class DemoModel:
    """A small hybrid decoder: embeddings, a stack of pre-norm mixers with residuals, an LM head.

    ``layout`` names each layer: full / window attention, mamba (Mamba2), gdn (Gated
    DeltaNet), linear (linear attention with decay), short_conv (LFM2 style).
    """

    def __init__(
        self,
        *,
        layout: Sequence[str] = MODELS["default"],
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

        self.embed = rand(vocab, hidden)
        self.lm_head = rand(hidden, vocab, scale=hidden**-0.5)
        # Mixers of every kind (each with its own spec and parameter types).
        self.layers: dict[str, _Mixer[Any, Any]] = {}
        for i, kind in enumerate(layout):
            mixer: _Mixer[Any, Any]
            if kind in ("full", "window"):
                mixer = _Attention(
                    rand,
                    hidden=hidden,
                    heads=num_heads,
                    kv_heads=num_kv_heads,
                    head_size=head_size,
                    window=window if kind == "window" else None,
                    block_size=block_size,
                    dtype=dtype,
                )
            elif kind == "mamba":
                mixer = _Mamba2(
                    rand,
                    gen,
                    hidden=hidden,
                    heads=mamba_heads,
                    groups=mamba_groups,
                    d_state=d_state,
                    width=conv_width,
                    block_size=block_size,
                    dtype=dtype,
                    device=self.device,
                )
            elif kind == "gdn":
                mixer = _GatedDeltaNet(
                    rand,
                    hidden=hidden,
                    heads=mamba_heads,
                    key_dim=d_state,
                    width=conv_width,
                    block_size=block_size,
                    dtype=dtype,
                )
            elif kind == "linear":
                mixer = _LinearAttention(
                    rand,
                    hidden=hidden,
                    heads=mamba_heads,
                    key_dim=d_state,
                    block_size=block_size,
                    device=self.device,
                )
            elif kind == "short_conv":
                mixer = _ShortConv(rand, hidden=hidden, width=3, block_size=block_size, dtype=dtype)
            else:
                raise InvalidArgumentError(
                    f"unknown layer kind {kind!r} in layout; use one of {', '.join(LAYER_KINDS)}"
                )
            self.layers[f"layers.{i}"] = mixer
        self.specs: dict[str, KVCacheSpec] = {name: m.spec for name, m in self.layers.items()}
        self.params: dict[str, LayerParams] = {name: m.params for name, m in self.layers.items()}

    def forward_step(self, runtime: AttentionRuntime, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states of the step's tokens (laid out in ``StepBatch.order``), via the runtime."""
        x = self.embed[tokens]
        for name, mixer in self.layers.items():
            x = x + mixer.step(runtime, name, _rms_norm(x)).to(x.dtype)
        return _rms_norm(x)

    def forward_dense(self, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states of one whole sequence, with no cache (the check)."""
        x = self.embed[tokens]
        for mixer in self.layers.values():
            x = x + mixer.dense(_rms_norm(x)).to(x.dtype)
        return _rms_norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Pre-norm without a weight: keeps activations O(1) through the random stack."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


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


def _check_demo_arguments(
    *, decode_steps: object, dtype: object, token_budget: object, model_name: object, prefer: object
) -> None:
    """``run_demo``'s checks of its plain arguments (``device`` is parsed separately)."""
    for argument, value in (("decode_steps", decode_steps), ("token_budget", token_budget)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ArgumentTypeError(
                f"{argument} must be an int >= 1, got {value!r} ({type(value).__name__})"
            )
        if value < 1:
            raise InvalidArgumentError(f"{argument} must be an int >= 1, got {value}")
    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(
            f"dtype must be a torch.dtype, got {dtype!r} ({type(dtype).__name__})"
        )
    if dtype not in TOLERANCE:
        raise InvalidArgumentError(
            f"dtype must be one of {', '.join(map(str, TOLERANCE))}, got {dtype}"
        )
    if model_name not in MODELS:
        raise InvalidArgumentError(
            f"unknown model {model_name!r}; choose one of {', '.join(MODELS)}"
        )
    if prefer not in PRIORITIES:
        raise InvalidArgumentError(f"prefer must be one of {', '.join(PRIORITIES)}, got {prefer!r}")


def run_demo(
    *,
    device: str = "cpu",
    backend_per_kind: str | None = None,
    decode_steps: int = 8,
    dtype: torch.dtype = torch.float32,
    token_budget: int = 16,
    out: TextIO,
    registry: BackendRegistry | None = None,
    model_name: str = "default",
    prefer: str = "reference",
    layout: Sequence[str] | None = None,
) -> DemoResult:
    """Serve four requests (one long prompt, chunked) and check every step; see the module doc.

    ``model_name``: a key of ``MODELS``; or, with ``layout`` (the layer kinds, e.g. from
    ``demo_layout``), only the name the report shows. ``prefer="triton"`` puts the Triton backends
    first in the device's priority list (kinds without a per-kind setting).

    Raises:
        ArgumentTypeError, InvalidArgumentError: a bad argument (checked before
            anything runs; the message names it, the value and what is allowed).
        DeviceUnavailableError: ``device`` does not exist on this machine.
        pydantic.ValidationError: ``backend_per_kind`` is not a valid setting.
        NoBackendError: a layer has no backend (``BackendNotSupportedError``: the one
            ``backend_per_kind`` names cannot serve it).
    """
    _check_demo_arguments(
        decode_steps=decode_steps,
        dtype=dtype,
        token_budget=token_budget,
        model_name=model_name if layout is None else "default",
        prefer=prefer,
    )
    torch_device = parse_device(device)
    check_device_available(torch_device)
    device = str(torch_device)
    torch.manual_seed(0)  # pyright: ignore[reportUnknownMemberType]  # torch leaves seed unannotated
    model = DemoModel(
        layout=MODELS[model_name] if layout is None else layout, dtype=dtype, device=device
    )
    config = AttentionConfig.model_validate(
        {"backend_per_kind": backend_per_kind or {}},
        context={"registry": registry} if registry is not None else None,
    )
    priority = PRIORITIES[prefer]
    runtime = AttentionRuntime(
        model.specs,
        config,
        device=device,
        memory_budget_bytes=64 * 2**20,
        layer_params=model.params,
        registry=registry,
        priority={torch.device(device).type: priority} if priority else None,
        cache_fill=float("nan"),
    )
    out.write(
        f"attnkit demo: model {model_name}, {len(model.layers)} layers, {runtime.num_blocks} blocks "
        f"of {runtime.page_size_bytes} B, {dtype}, {device}\n"
    )
    out.write("routing:\n")
    for row in runtime.routing_table():
        group = runtime.groups[row.group_id]
        kind = row.kind.value
        if isinstance(group.spec, MambaSpec):
            kind += f"({group.spec.mamba_type})"
        out.write(
            f"  {row.layer:<10} {kind:<17} group {row.group_id} "
            f"(block_size {group.spec.block_size}) -> {row.backend} ({row.source})\n"
        )
    level, who = runtime.cudagraph_support()
    out.write(f"CUDA graphs: {level.name} (limited by {who})\n")

    gen = torch.Generator().manual_seed(1)
    lengths = {"req-a": 5, "req-b": 12, "req-long": 40, "req-c": 3}
    prompts: dict[str, list[int]] = {
        rid: torch.randint(0, 64, (n,), generator=gen).tolist()  # pyright: ignore[reportUnknownMemberType]  # torch types tolist() as a bare List
        for rid, n in lengths.items()
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
        if torch_device.type == "cuda":
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
