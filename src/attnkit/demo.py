"""``attnkit demo``: a tiny model served end to end through ``AttentionRuntime``.

The default model (random weights, fixed seed) has full-attention, sliding-window
attention and Mamba2 layers; ``demo_layout`` shrinks a real model's layout to the
demo's sizes (every kind attnkit serves: chunked-local, MLA, sink, encoder-only and
cross-attention layers, and the state layers). Several requests of different lengths
are prefilled (one long prompt in chunks, under a per-step token budget) and then
decoded greedily; a layout of encoder-only layers encodes whole prompts instead, and
an encoder-decoder layout encodes each request's source before its decoder runs.
After every step the step's outputs are checked against a dense recompute of each
request's whole sequence without any cache, written here by the definitions
(softmax attention under each kind's mask, MLA in its unabsorbed form, the
token-by-token recurrences of the state layers), and the step prints its time, max
abs error and tokens/s.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, Literal, TextIO, TypeVar, cast

import torch
import torch.nn.functional as F
from typing_extensions import override

from .config import AttentionConfig
from .devices import check_device_available, parse_device
from .errors import ArgumentTypeError, InvalidArgumentError
from .kernels.gated_delta.reference import gated_delta_rule_recurrent_reference, l2_normalize
from .kernels.linear_attention.reference import linear_attention_recurrent_reference
from .kernels.mamba2.reference import ssd_recurrent_reference
from .kinds import KindRules, Mask, attention_rules, rules_for
from .models import ModelLayout
from .parallel import ContextParallel
from .params import (
    AttentionLayerParams,
    GatedDeltaNetLayerParams,
    LayerParams,
    LinearAttentionLayerParams,
    Mamba1LayerParams,
    Mamba2LayerParams,
    MLAProjection,
    ShortConvLayerParams,
)
from .registry import BackendRegistry
from .runtime import AttentionRuntime, ScheduledRequest
from .spec import AttentionSpec, KVCacheSpec, MambaSpec, MambaType
from .state_inputs import (
    GatedDeltaNetInputs,
    LinearAttentionInputs,
    Mamba1Inputs,
    Mamba2Inputs,
    ShortConvInputs,
)
from .state_types import state_type_of

__all__ = ["LAYER_KINDS", "MODELS", "DemoModel", "DemoResult", "demo_layout", "run_demo"]

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-2, torch.bfloat16: 1e-1}


_Rand = Callable[..., torch.Tensor]

_SINK_TOKENS = 4
"""Sink tokens of a ``sink_tokens`` layer (``SinkFullAttentionSpec.sink_len``)."""


@dataclasses.dataclass(frozen=True)
class _Context:
    """What a mixer needs besides its hidden states.

    Attributes:
        positions: int64 ``[T]``, each token's position in its sequence (MLA's RoPE);
            ``None`` in a dense recompute means ``0..T-1``.
        encoder: ``[E, hidden]`` encoder output that cross-attention layers read: in a
            step the outputs of ``StepBatch.encoder_order`` concatenated (``None`` when
            no request starts), in a dense recompute the request's own.
    """

    positions: torch.Tensor | None = None
    encoder: torch.Tensor | None = None


_NO_CONTEXT = _Context()


_SpecT = TypeVar("_SpecT", bound=KVCacheSpec)
_ParamsT = TypeVar("_ParamsT", bound=LayerParams)


class _Mixer(Generic[_SpecT, _ParamsT]):
    """One layer's mixer: the same projections around a runtime core and a dense core.

    Generic in its spec and parameter types, so each mixer keeps its own (a subclass
    may not narrow a mutable attribute of its base). ``ctx`` brings the step's
    positions and encoder output to the mixers that read them (MLA, cross-attention).
    """

    spec: _SpecT
    params: _ParamsT

    def step(
        self, runtime: AttentionRuntime, name: str, h: torch.Tensor, ctx: _Context = _NO_CONTEXT
    ) -> torch.Tensor:
        raise NotImplementedError

    def dense(self, h: torch.Tensor, ctx: _Context = _NO_CONTEXT) -> torch.Tensor:
        raise NotImplementedError


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention by its definition, in float32: the dense checks' core.

    q ``[T, Hq, D]``, k ``[S, Hkv, D]``, v ``[S, Hkv, Dv]``, mask bool ``[T, S]`` (True:
    query ``t`` sees key ``s``), sinks float ``[Hq]`` learned logits that join each row's
    softmax denominator with no value (gpt-oss), or ``None``. Returns ``[T, Hq, Dv]``.
    """
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), kf) * scale
    scores = scores.masked_fill(~mask, -math.inf)
    if sinks is not None:
        column = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hts,shd->thd", probs, vf)


def _mask(mask: Mask, rows: int, cols: int, *, device: torch.device) -> torch.Tensor:
    """Which keys each query of one sequence sees (bool ``[rows, cols]``), by definition:
    queries and keys at positions ``0..rows-1`` (bidirectional layers, cross-attention
    and encoder ones: every key; causal ones the keys up to the query, and with a
    ``window`` the last ``window`` positions, with a ``chunk`` those of the query's chunk
    of ``chunk`` positions). Sink tokens are the caller's (``_Attention.dense``)."""
    if mask.bidirectional:
        return torch.ones(rows, cols, dtype=torch.bool, device=device)
    i = torch.arange(rows, device=device)[:, None]
    j = torch.arange(cols, device=device)[None, :]
    seen = j <= i
    if mask.window is not None:
        seen &= j > i - mask.window
    if mask.chunk is not None:
        seen &= j // mask.chunk == i // mask.chunk
    return seen


class _Attention(_Mixer[AttentionSpec, AttentionLayerParams]):
    """Softmax attention of one kind (``rules``) under its mask: full, sliding-window,
    chunked-local, with sink tokens (``sink_full_attention``: learned K/V in front of
    every context, StreamingLLM style), encoder-only (bidirectional, no cache) or
    cross-attention (queries from the decoder, keys/values from the encoder output);
    ``sinks=True`` adds learned per-head sink logits (gpt-oss)."""

    params: AttentionLayerParams

    def __init__(
        self,
        rand: _Rand,
        *,
        rules: KindRules[Any],
        hidden: int,
        heads: int,
        kv_heads: int,
        head_size: int,
        extent: int | None,
        block_size: int,
        dtype: torch.dtype,
        sinks: bool = False,
    ) -> None:
        self.heads, self.kv_heads, self.head_size = heads, kv_heads, head_size
        # Cross attention: the keys/values come from the encoder's output.
        self.reads_encoder = rules.writes == "encoder"
        self.wq = rand(hidden, heads * head_size, scale=hidden**-0.5)
        self.wk = rand(hidden, kv_heads * head_size, scale=hidden**-0.5)
        self.wv = rand(hidden, kv_heads * head_size, scale=hidden**-0.5)
        self.wo = rand(heads * head_size, hidden, scale=(heads * head_size) ** -0.5)
        self.spec: AttentionSpec = rules.example_spec(
            block_size=block_size,
            num_kv_heads=kv_heads,
            head_size=head_size,
            dtype=dtype,
            extent=extent,
        )
        self.mask = rules.mask(self.spec)
        extra = rules.example_layer_params(self.spec, rand)  # the sink tokens' K/V
        self.params = AttentionLayerParams(
            num_heads=heads, sinks=rand(heads).float() if sinks else None, **extra
        )

    def _q(self, h: torch.Tensor) -> torch.Tensor:
        return (h @ self.wq).view(h.shape[0], self.heads, self.head_size)

    def _kv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = h.shape[0]
        return (
            (h @ self.wk).view(t, self.kv_heads, self.head_size),
            (h @ self.wv).view(t, self.kv_heads, self.head_size),
        )

    @override
    def step(
        self, runtime: AttentionRuntime, name: str, h: torch.Tensor, ctx: _Context = _NO_CONTEXT
    ) -> torch.Tensor:
        if self.reads_encoder:
            # The encoder K/V are written once, on a request's first step; later steps
            # read them from the cache.
            k, v = self._kv(ctx.encoder) if ctx.encoder is not None else (None, None)
        else:
            k, v = self._kv(h)
        return runtime.forward(name, self._q(h), k, v).reshape(h.shape[0], -1) @ self.wo

    @override
    def dense(self, h: torch.Tensor, ctx: _Context = _NO_CONTEXT) -> torch.Tensor:
        q = self._q(h)
        if self.reads_encoder:
            if ctx.encoder is None:
                raise InvalidArgumentError("a cross-attention layer needs the encoder output")
            k, v = self._kv(ctx.encoder)
        else:
            k, v = self._kv(h)
        mask = _mask(self.mask, q.shape[0], k.shape[0], device=h.device)
        p = self.params
        if p.sink_key is not None and p.sink_value is not None:
            # Sink tokens sit in front of the context, seen by every query.
            k, v = torch.cat([p.sink_key, k]), torch.cat([p.sink_value, v])
            mask = torch.cat([mask.new_ones(mask.shape[0], p.sink_key.shape[0]), mask], dim=1)
        out = _attend(q, k, v, mask, scale=self.head_size**-0.5, sinks=p.sinks)
        return out.to(h.dtype).reshape(h.shape[0], -1) @ self.wo


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, arXiv:2104.09864), rotate-half form,
    base 10000: ``x`` ``[T, H, R]`` rotated by each token's position, in float32."""
    half = x.shape[-1] // 2
    inv_freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * inv_freq  # [T, R/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class _MLA(_Mixer[AttentionSpec, AttentionLayerParams]):
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434), served in its
    absorbed form: the cache holds one latent ``[c_kv, rope(k_pe)]`` per token, every
    head's query is ``[q_nope @ W_UK^T, rope(q_pe)]`` (the key up-projection folded into
    the query), and the attention output (the latent's first ``rank`` channels, the
    values) is up-projected per head by ``W_UV``. The dense check runs the unabsorbed
    form: standard attention over per-head keys ``[c_kv @ W_UK, rope(k_pe)]`` and
    values ``c_kv @ W_UV``; both give the same scores ``q_nope . (c_kv W_UK) =
    (q_nope W_UK^T) . c_kv``."""

    params: AttentionLayerParams

    def __init__(
        self,
        rand: _Rand,
        *,
        rules: KindRules[Any],
        hidden: int,
        heads: int,
        rank: int,
        rope_dim: int,
        nope_dim: int,
        v_dim: int,
        extent: int | None,
        block_size: int,
        dtype: torch.dtype,
        sinks: bool = False,
    ) -> None:
        self.heads, self.rank, self.rope_dim, self.nope_dim = heads, rank, rope_dim, nope_dim
        self.wq = rand(hidden, heads * (nope_dim + rope_dim), scale=hidden**-0.5)
        self.w_ckv = rand(hidden, rank, scale=hidden**-0.5)  # the latent's down-projection
        self.w_kpe = rand(hidden, rope_dim, scale=hidden**-0.5)  # the shared RoPE key
        self.w_uk = rand(heads, rank, nope_dim, scale=rank**-0.5)
        self.w_uv = rand(heads, rank, v_dim, scale=rank**-0.5)
        self.wo = rand(heads * v_dim, hidden, scale=(heads * v_dim) ** -0.5)
        self.spec: AttentionSpec = rules.example_spec(
            block_size=block_size,
            num_kv_heads=1,  # one latent, read by every head
            head_size=rank + rope_dim,
            dtype=dtype,
            extent=extent,
        )
        self.mask = rules.mask(self.spec)
        # The scale of the unabsorbed per-head width: absorption keeps every score.
        # Without sinks the layer hands W_UK/W_UV to the backend (mla_projection), which
        # then picks the absorbed or up-projected form per step; with sinks (a feature
        # only the reference serves for MLA) the demo absorbs itself.
        self.project = not sinks
        self.params = AttentionLayerParams(
            num_heads=heads,
            scale=(nope_dim + rope_dim) ** -0.5,
            v_head_size=None if self.project else rank,
            sinks=rand(heads).float() if sinks else None,
            mla_projection=(
                MLAProjection(w_uk=self.w_uk, w_uv=self.w_uv) if self.project else None
            ),
        )

    def _parts(
        self, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_nope [T, H, nope], rope(q_pe) [T, H, R], c_kv [T, rank], rope(k_pe) [T, 1, R])``."""
        t = h.shape[0]
        q = (h @ self.wq).view(t, self.heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = torch.split(q, [self.nope_dim, self.rope_dim], dim=-1)
        c_kv = _rms_norm(h @ self.w_ckv)
        k_pe = (h @ self.w_kpe).view(t, 1, self.rope_dim)
        return q_nope, _rope(q_pe, positions), c_kv, _rope(k_pe, positions)

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        return o.to(self.wo.dtype).reshape(o.shape[0], -1) @ self.wo

    @override
    def step(
        self, runtime: AttentionRuntime, name: str, h: torch.Tensor, ctx: _Context = _NO_CONTEXT
    ) -> torch.Tensor:
        if ctx.positions is None:
            raise InvalidArgumentError("an MLA layer's step needs the tokens' positions (RoPE)")
        q_nope, q_pe, c_kv, k_pe = self._parts(h, ctx.positions)
        latent = torch.cat([c_kv[:, None, :], k_pe], dim=-1)
        if self.project:
            query = torch.cat([q_nope, q_pe], dim=-1)
            return self._out(runtime.forward(name, query.contiguous(), latent.contiguous(), None))
        query = torch.cat([torch.einsum("thn,hrn->thr", q_nope, self.w_uk), q_pe], dim=-1)
        o_latent = runtime.forward(name, query.contiguous(), latent.contiguous(), None)
        return self._out(torch.einsum("thr,hrv->thv", o_latent, self.w_uv))

    @override
    def dense(self, h: torch.Tensor, ctx: _Context = _NO_CONTEXT) -> torch.Tensor:
        t = h.shape[0]
        positions = torch.arange(t, device=h.device)
        q_nope, q_pe, c_kv, k_pe = self._parts(h, positions)
        k_nope = torch.einsum("tr,hrn->thn", c_kv.float(), self.w_uk.float())
        k = torch.cat([k_nope, k_pe.float().expand(t, self.heads, self.rope_dim)], dim=-1)
        v = torch.einsum("tr,hrv->thv", c_kv.float(), self.w_uv.float())
        q = torch.cat([q_nope, q_pe], dim=-1)
        mask = _mask(self.mask, t, t, device=h.device)
        scale = self.params.scale
        assert scale is not None  # set in __init__
        return self._out(_attend(q, k, v, mask, scale=scale, sinks=self.params.sinks))


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
    def step(
        self, runtime: AttentionRuntime, name: str, h: torch.Tensor, ctx: _Context = _NO_CONTEXT
    ) -> torch.Tensor:
        z, xbc, dt = self._inputs(h)
        return self._out(runtime.forward_state(name, Mamba2Inputs(xBC=xbc, dt=dt)), z)

    @override
    def dense(self, h: torch.Tensor, ctx: _Context = _NO_CONTEXT) -> torch.Tensor:
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


class _Mamba1(_Mixer[MambaSpec, Mamba1LayerParams]):
    """A Mamba (1) mixer as in Jamba: ``in_proj`` gives ``x`` and the gate ``z`` (``d_inner``
    channels each); the runtime runs the conv, ``x_proj``/``dt_proj`` (with Jamba's
    RMSNorms of ``dt``, ``B`` and ``C``) and the selective scan; ``y * silu(z)`` then
    ``out_proj``. The dense check is the selective scan's definition, token by token."""

    params: Mamba1LayerParams

    def __init__(
        self,
        rand: _Rand,
        gen: torch.Generator,
        *,
        hidden: int,
        d_inner: int,
        d_state: int,
        dt_rank: int,
        width: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.d_inner = d_inner
        self.params = p = Mamba1LayerParams(
            d_inner=d_inner,
            d_state=d_state,
            conv_weight=rand(d_inner, width, scale=0.5).float(),
            conv_bias=rand(d_inner, scale=0.1).float(),
            x_proj_weight=rand(dt_rank + 2 * d_state, d_inner, scale=d_inner**-0.5).float(),
            dt_proj_weight=rand(d_inner, dt_rank, scale=dt_rank**-0.5).float(),
            dt_bias=rand(d_inner, scale=0.5).float(),
            A=-torch.rand(d_inner, d_state, generator=gen).add(0.5).to(device),
            D=rand(d_inner).float(),
            dt_norm_weight=rand(dt_rank, scale=0.1).float() + 1,
            B_norm_weight=rand(d_state, scale=0.1).float() + 1,
            C_norm_weight=rand(d_state, scale=0.1).float() + 1,
        )
        self.w_in = rand(hidden, 2 * d_inner, scale=hidden**-0.5)
        self.w_out = rand(d_inner, hidden, scale=d_inner**-0.5)
        self.spec = MambaSpec(
            block_size=block_size,
            shapes=p.state_shapes,
            dtypes=(dtype, torch.float32),
            mamba_type="mamba1",
        )

    def _xz(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, z = torch.split(h @ self.w_in, self.d_inner, dim=-1)
        return x.contiguous(), z

    def _out(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (y.to(z.dtype) * F.silu(z)) @ self.w_out

    @override
    def step(
        self, runtime: AttentionRuntime, name: str, h: torch.Tensor, ctx: _Context = _NO_CONTEXT
    ) -> torch.Tensor:
        x, z = self._xz(h)
        return self._out(runtime.forward_state(name, Mamba1Inputs(x=x)), z)

    @override
    def dense(self, h: torch.Tensor, ctx: _Context = _NO_CONTEXT) -> torch.Tensor:
        p = self.params
        x, z = self._xz(h)
        u = F.silu(_causal_conv(x, p.conv_weight, p.conv_bias))  # float32 [T, D]
        rank, n = p.dt_rank, p.d_state
        dt_low, b, c = torch.split(u @ p.x_proj_weight.T, [rank, n, n], dim=-1)
        dt_low = _rms_norm(dt_low, p.dt_norm_weight, p.norm_eps)
        b = _rms_norm(b, p.B_norm_weight, p.norm_eps)
        c = _rms_norm(c, p.C_norm_weight, p.norm_eps)
        assert p.dt_bias is not None  # set in __init__
        assert p.D is not None
        dt = F.softplus(dt_low @ p.dt_proj_weight.T + p.dt_bias)  # [T, D]
        # Gu & Dao 2023 (arXiv:2312.00752), Algorithm 2, one token at a time:
        # h_t = exp(dt_t A) h_{t-1} + (dt_t u_t) B_t;  y_t = h_t C_t + D u_t.
        state = u.new_zeros(p.d_inner, n)
        ys: list[torch.Tensor] = []
        for t in range(u.shape[0]):
            state = torch.exp(dt[t, :, None] * p.A) * state + (dt[t] * u[t])[:, None] * b[t]
            ys.append(state @ c[t] + p.D * u[t])
        return self._out(torch.stack(ys), z)


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
    def step(
        self, runtime: AttentionRuntime, name: str, h: torch.Tensor, ctx: _Context = _NO_CONTEXT
    ) -> torch.Tensor:
        qkv, g, beta, z = self._inputs(h)
        return self._out(
            runtime.forward_state(name, GatedDeltaNetInputs(qkv=qkv, g=g, beta=beta)), z
        )

    @override
    def dense(self, h: torch.Tensor, ctx: _Context = _NO_CONTEXT) -> torch.Tensor:
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
    def step(
        self, runtime: AttentionRuntime, name: str, h: torch.Tensor, ctx: _Context = _NO_CONTEXT
    ) -> torch.Tensor:
        q, k, v = self._qkv(h)
        o = runtime.forward_state(name, LinearAttentionInputs(q=q, k=k, v=v))
        return _rms_norm(o.reshape(h.shape[0], -1).to(h.dtype)) @ self.w_out

    @override
    def dense(self, h: torch.Tensor, ctx: _Context = _NO_CONTEXT) -> torch.Tensor:
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
    def step(
        self, runtime: AttentionRuntime, name: str, h: torch.Tensor, ctx: _Context = _NO_CONTEXT
    ) -> torch.Tensor:
        b, c, x = self._bcx(h)
        return runtime.forward_state(name, ShortConvInputs(b=b, c=c, x=x)) @ self.w_out

    @override
    def dense(self, h: torch.Tensor, ctx: _Context = _NO_CONTEXT) -> torch.Tensor:
        b, c, x = self._bcx(h)
        y = c.float() * _causal_conv(b * x, self.params.conv_weight.float(), None)
        return y.to(h.dtype) @ self.w_out


_KIND_RULES: dict[str, KindRules[Any]] = {
    r.short_name: r for r in attention_rules() if r.short_name is not None
}
"""The attention kinds by their short names, which the kinds declare
(``KindRules.short_name``: ``"full"``, ``"window"``, ``"chunked"``, ``"sink_tokens"``,
``"mla"``, ``"mla_window"``, ``"encoder"``, ``"cross"``)."""


@dataclasses.dataclass(frozen=True)
class _StateSizes:
    """What the demo's state mixers are built from (``DemoModel``'s arguments)."""

    hidden: int
    heads: int
    groups: int
    d_state: int
    width: int
    block_size: int
    dtype: torch.dtype
    device: torch.device


_StateMixer = Callable[[_Rand, torch.Generator, _StateSizes], _Mixer[MambaSpec, Any]]

_STATE_MIXERS: dict[MambaType, _StateMixer] = {
    "mamba2": lambda rand, gen, s: _Mamba2(
        rand,
        gen,
        hidden=s.hidden,
        heads=s.heads,
        groups=s.groups,
        d_state=s.d_state,
        width=s.width,
        block_size=s.block_size,
        dtype=s.dtype,
        device=s.device,
    ),
    "mamba1": lambda rand, gen, s: _Mamba1(
        rand,
        gen,
        hidden=s.hidden,
        d_inner=s.hidden,
        d_state=s.d_state,
        dt_rank=max(1, s.hidden // 16),
        width=s.width,
        block_size=s.block_size,
        dtype=s.dtype,
        device=s.device,
    ),
    "gdn": lambda rand, gen, s: _GatedDeltaNet(
        rand,
        hidden=s.hidden,
        heads=s.heads,
        key_dim=s.d_state,
        width=s.width,
        block_size=s.block_size,
        dtype=s.dtype,
    ),
    "linear": lambda rand, gen, s: _LinearAttention(
        rand,
        hidden=s.hidden,
        heads=s.heads,
        key_dim=s.d_state,
        block_size=s.block_size,
        device=s.device,
    ),
    "short_conv": lambda rand, gen, s: _ShortConv(
        rand, hidden=s.hidden, width=3, block_size=s.block_size, dtype=s.dtype
    ),
}
"""The state types the demo has a mixer for (each with its own dense definition); a
layer's demo name is its type's ``short_name``."""
_STATE_KINDS: dict[str, MambaType] = {state_type_of(t).short_name: t for t in _STATE_MIXERS}
LAYER_KINDS = (
    *(name for name, r in _KIND_RULES.items() if not r.latent),
    *(name for name, r in _KIND_RULES.items() if r.latent),
    *_STATE_KINDS,
)
"""``DemoModel``'s layer kinds; an attention or MLA kind with the suffix ``"_sinks"``
(``"full_sinks"``) also has learned per-head sink logits (gpt-oss)."""
SINKS_SUFFIX = "_sinks"

PRIORITIES: dict[str, tuple[str, ...]] = {
    "default": (),  # the device's default priority list
    # The oracle for every kind (on CPU the default puts cpu_attn first).
    "reference": ("reference",),
    "triton": (
        "triton_attn",
        "triton_mla",
        "triton_mamba1",
        "triton_mamba2",
        "triton_gdn",
        "triton_linear_attn",
        "triton_short_conv",
        "reference",
    ),
    # Compiled FlexAttention first (CUDA, or CPU by this choice: each new shape compiles
    # on first use, seconds on a CPU), the reference for what it does not serve (MLA,
    # state layers, sink logits).
    "flex": ("flex_attention", "reference"),
}
MODELS: dict[str, tuple[str, ...]] = {
    "default": ("full", "mamba", "window", "mamba", "full", "window"),
    "hybrid": ("full", "mamba", "window", "gdn", "linear", "short_conv", "full", "gdn"),
}


DEMO_LAYERS_PER_KIND = 2
"""Layers of each kind ``demo_layout`` keeps."""


DemoMode = Literal["decoder", "encoder", "encoder-decoder"]
"""How ``run_demo`` serves a layout: ``"decoder"`` (prefill and greedy decode),
``"encoder"`` (encoder-only layers: each prompt encoded whole, no decode) or
``"encoder-decoder"`` (an encoder stack, then a decoder stack reading its output)."""


def _base_kind(kind: str) -> tuple[str, bool]:
    """``kind`` without its ``"_sinks"`` suffix, and whether it had one."""
    if kind.endswith(SINKS_SUFFIX):
        return kind.removesuffix(SINKS_SUFFIX), True
    return kind, False


def _encodes(kind: str) -> bool:
    """Whether a layer kind is the encoder stack's: attention that keeps no cache
    (encoder-only, each prompt encoded whole)."""
    rules = _KIND_RULES.get(_base_kind(kind)[0])
    return rules is not None and not rules.has_cache


def _reads_encoder(kind: str) -> bool:
    """Whether a layer kind reads the encoder's output (cross-attention)."""
    rules = _KIND_RULES.get(_base_kind(kind)[0])
    return rules is not None and rules.writes == "encoder"


def _stack_problem(kinds: Sequence[str]) -> tuple[int, str] | None:
    """The first layer the demo's two stacks cannot place, and why: encoder-only layers
    form the encoder stack and must all come first; every other layer is in the
    decoder stack, whose cross-attention layers read the encoder's output."""
    first_decoder: int | None = None
    for i, kind in enumerate(kinds):
        if _encodes(kind):
            if first_decoder is not None:
                return i, (
                    f"an encoder-only layer after a decoder layer (index {first_decoder}); "
                    f"the demo runs the encoder-only layers first, as one encoder stack"
                )
        else:
            if first_decoder is None:
                first_decoder = i
            if _reads_encoder(kind) and first_decoder == 0:
                return i, (
                    "a cross-attention layer with no encoder-only layer before it: there "
                    "is no encoder output for it to read"
                )
    return None


def demo_layout(model: ModelLayout, *, per_kind: int = DEMO_LAYERS_PER_KIND) -> tuple[str, ...]:
    """A real model's layer kinds, shrunk for ``DemoModel``: the model's layers in
    order, keeping the first ``per_kind`` of each kind; the demo gives them its own small
    sizes. Kinds: ``"full"``, ``"window"``, ``"chunked"`` (chunked-local),
    ``"sink_tokens"`` (``sink_full_attention``), ``"mla"``, ``"mla_window"``
    (``sliding_window_mla``), ``"encoder"`` (encoder-only), ``"cross"``
    (cross-attention), and one per state-layer type (``"mamba"`` for Mamba2,
    ``"mamba1"``, ``"gdn"``, ``"linear"``, ``"short_conv"``); attention layers with
    learned sinks (``LayerInfo.has_sinks``) get the suffix ``"_sinks"``.

    Raises:
        InvalidArgumentError: a layer the demo cannot run: a kind it has no mixer for,
            an encoder-only layer after decoder layers (the demo runs one encoder stack,
            then the decoder stack), or a cross-attention layer with no encoder-only
            layer before it (nothing to read); the message names the layer and why.
    """
    kinds: list[str] = []
    names: list[str] = []
    for name, info in model.layers.items():
        spec = info.spec
        mamba_type = spec.mamba_type if isinstance(spec, MambaSpec) else None
        what = spec.kind.value + (f" ({mamba_type})" if mamba_type else "")
        kind = (
            state_type_of(spec).short_name
            if isinstance(spec, MambaSpec)
            else rules_for(spec).short_name
        )
        if kind is None or kind not in LAYER_KINDS:
            raise InvalidArgumentError(
                f"the demo runs {', '.join(sorted(LAYER_KINDS))} layers (see "
                f"demo_layout); {model.model_type} layer {name!r} is {what}, which it has "
                f"no mixer for"
            )
        kinds.append(kind + (SINKS_SUFFIX if info.has_sinks else ""))
        names.append(name)
    problem = _stack_problem(kinds)
    if problem is not None:
        index, why = problem
        raise InvalidArgumentError(
            f"the demo cannot run {model.model_type} layer {names[index]!r}: it is {why}"
        )
    kept: list[str] = []
    for kind in kinds:
        if kept.count(kind) < per_kind:
            kept.append(kind)
    return tuple(kept)


class DemoModel:
    """A small model: embeddings, stacks of pre-norm mixers with residuals, an LM head.

    ``layout`` names each layer (``LAYER_KINDS``): full / window / chunked-local
    attention, sink_tokens (full attention with sink tokens), mla / mla_window (latent
    attention), encoder (encoder-only), cross (cross-attention), mamba (Mamba2), mamba1,
    gdn (Gated DeltaNet), linear (linear attention with decay), short_conv (LFM2
    style); ``"_sinks"`` adds learned sink logits to an attention kind. Encoder-only
    layers, which must come first, form the encoder stack (``encoder_layers``); the
    others the decoder stack (``decoder_layers``), which reads the encoder's output in
    its cross-attention layers. The two stacks share the embeddings.

    Sizes: attention ``num_heads`` x ``head_size`` (``num_kv_heads`` K/V heads), the
    ``window`` of sliding layers and the chunk of chunked-local layers; MLA
    ``num_heads`` heads, a latent of rank ``3 * head_size`` plus a RoPE key of
    ``head_size``, ``head_size`` no-RoPE query/key and value widths; Mamba1
    ``hidden`` channels, state ``d_state``, dt rank ``hidden // 16``.
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
        chunk: int = 8,
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
        if not layout:
            raise InvalidArgumentError(f"layout must name at least one layer, got {layout!r}")
        for kind in layout:
            base, sinks = _base_kind(kind)
            if base not in LAYER_KINDS or (sinks and base in _STATE_KINDS):
                raise InvalidArgumentError(
                    f"unknown layer kind {kind!r} in layout; use one of {', '.join(LAYER_KINDS)} "
                    f"(attention and MLA kinds may end in {SINKS_SUFFIX!r})"
                )
        problem = _stack_problem(layout)
        if problem is not None:
            index, why = problem
            raise InvalidArgumentError(f"layout[{index}] ({layout[index]!r}) is {why}")

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(self.device, dtype)

        self.embed = rand(vocab, hidden)
        self.lm_head = rand(hidden, vocab, scale=hidden**-0.5)
        sizes = _StateSizes(
            hidden, mamba_heads, mamba_groups, d_state, conv_width, block_size, dtype, self.device
        )
        # Mixers of every kind (each with its own spec and parameter types).
        self.layers: dict[str, _Mixer[Any, Any]] = {}
        for i, kind in enumerate(layout):
            base, sinks = _base_kind(kind)
            mixer: _Mixer[Any, Any]
            rules = _KIND_RULES.get(base)
            # The demo's size for the kind's one length parameter, if it has one.
            extent = (
                {"window": window, "chunk": chunk, "sink_len": _SINK_TOKENS}[rules.extent]
                if rules is not None and rules.extent is not None
                else None
            )
            if rules is not None and not rules.latent:
                mixer = _Attention(
                    rand,
                    rules=rules,
                    hidden=hidden,
                    heads=num_heads,
                    kv_heads=num_kv_heads,
                    head_size=head_size,
                    extent=extent,
                    block_size=block_size,
                    dtype=dtype,
                    sinks=sinks,
                )
            elif rules is not None:
                mixer = _MLA(
                    rand,
                    rules=rules,
                    hidden=hidden,
                    heads=num_heads,
                    rank=3 * head_size,
                    rope_dim=head_size,
                    nope_dim=head_size,
                    v_dim=head_size,
                    extent=extent,
                    block_size=block_size,
                    dtype=dtype,
                    sinks=sinks,
                )
            else:  # a state kind: the kinds were checked above
                mixer = _STATE_MIXERS[_STATE_KINDS[base]](rand, gen, sizes)
            self.layers[f"layers.{i}"] = mixer
        self.specs: dict[str, KVCacheSpec] = {name: m.spec for name, m in self.layers.items()}
        self.params: dict[str, LayerParams] = {name: m.params for name, m in self.layers.items()}
        names = list(self.layers)
        self.encoder_layers: tuple[str, ...] = tuple(
            n for n, kind in zip(names, layout, strict=True) if _encodes(kind)
        )
        """The encoder stack's layers (encoder-only), in order."""
        self.decoder_layers: tuple[str, ...] = tuple(
            n for n in names if n not in self.encoder_layers
        )
        """The decoder stack's layers (every other layer), in order."""
        self.mode: DemoMode = (
            "decoder"
            if not self.encoder_layers
            else "encoder"
            if not self.decoder_layers
            else "encoder-decoder"
        )

    def forward_step(
        self,
        runtime: AttentionRuntime,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        encoder: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states of the step's tokens (laid out in ``StepBatch.order``) through the
        decoder stack, via the runtime. ``positions``: each token's position in its
        sequence (MLA layers need them); ``encoder``: the encoder outputs of
        ``StepBatch.encoder_order``, concatenated (cross-attention layers write them)."""
        ctx = _Context(positions=positions, encoder=encoder)
        x = self.embed[tokens]
        for name in self.decoder_layers:
            x = x + self.layers[name].step(runtime, name, _rms_norm(x), ctx).to(x.dtype)
        return _rms_norm(x)

    def forward_dense(
        self, tokens: torch.Tensor, *, encoder: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hidden states of one whole sequence through the decoder stack, with no cache
        (the check); ``encoder``: the request's encoder output (cross-attention)."""
        ctx = _Context(encoder=encoder)
        x = self.embed[tokens]
        for name in self.decoder_layers:
            x = x + self.layers[name].dense(_rms_norm(x), ctx).to(x.dtype)
        return _rms_norm(x)

    def encode_step(self, runtime: AttentionRuntime, tokens: torch.Tensor) -> torch.Tensor:
        """The encoder stack's output for the step's whole prompts, via the runtime."""
        x = self.embed[tokens]
        for name in self.encoder_layers:
            x = x + self.layers[name].step(runtime, name, _rms_norm(x)).to(x.dtype)
        return _rms_norm(x)

    def encode_dense(self, tokens: torch.Tensor) -> torch.Tensor:
        """The encoder stack's output for one whole prompt, with no cache (the check)."""
        x = self.embed[tokens]
        for name in self.encoder_layers:
            x = x + self.layers[name].dense(_rms_norm(x)).to(x.dtype)
        return _rms_norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """RMSNorm (pre-norm without a weight keeps activations O(1) through the random stack)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float() if weight is not None else normed).to(x.dtype)


@dataclasses.dataclass
class DemoResult:
    passed: bool
    max_error: float
    steps: int
    tokens: int
    seconds: float
    peak_kv_blocks: int = 0
    """Most cache blocks the decoder runtime held at once (this rank's, with context
    parallelism)."""


@dataclasses.dataclass
class _Tally:
    """The demo's running totals; ``record`` prints one step's line."""

    out: TextIO
    tol: float
    passed: bool = True
    max_error: float = 0.0
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    peak_kv_blocks: int = 0

    def note_blocks(self, runtime: AttentionRuntime) -> None:
        """Remember the most blocks ``runtime`` has held (the null block not counted)."""
        held = runtime.num_blocks - 1 - runtime.manager.pool.num_free_blocks
        self.peak_kv_blocks = max(self.peak_kv_blocks, held)

    def record(self, label: str, error: float, tokens: int, elapsed: float) -> None:
        ok = math.isfinite(error) and error <= self.tol
        self.passed &= ok
        self.max_error = max(self.max_error, error) if math.isfinite(error) else math.inf
        self.tokens += tokens
        self.seconds += elapsed
        self.out.write(
            f"step {self.steps:2d}  {label}  {elapsed * 1e3:7.1f} ms  max|err| {error:.2e}  "
            f"{tokens / elapsed:8.0f} tok/s  {'PASS' if ok else 'FAIL'}\n"
        )
        self.steps += 1

    def result(self) -> DemoResult:
        self.out.write(
            f"{'PASS' if self.passed else 'FAIL'}: {self.steps} steps, {self.tokens} tokens, "
            f"max|err| {self.max_error:.2e} (tolerance {self.tol:.0e}), "
            f"{self.tokens / self.seconds:.0f} tok/s overall\n"
        )
        return DemoResult(
            passed=self.passed,
            max_error=self.max_error,
            steps=self.steps,
            tokens=self.tokens,
            seconds=self.seconds,
            peak_kv_blocks=self.peak_kv_blocks,
        )


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
    tally: _Tally,
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
    prefer: str = "default",
    layout: Sequence[str] | None = None,
    context_parallel: ContextParallel | None = None,
) -> DemoResult:
    """Serve four requests (one long prompt, chunked) and check every step; see the module doc.

    ``context_parallel``: run as one rank of a decode context-parallel group (every rank
    calls ``run_demo`` with the same arguments; ``run_demo_context_parallel`` starts
    them); the dense check runs on every rank.

    ``model_name``: a key of ``MODELS``; or, with ``layout`` (the layer kinds, e.g. from
    ``demo_layout``), only the name the report shows. ``prefer`` (kinds without a per-kind setting):
    ``"default"`` the device's priority list, ``"reference"`` the reference backend for
    every kind, ``"triton"`` the Triton backends first, ``"flex"`` flex_attention (compiled
    FlexAttention) first.

    The layout's ``DemoModel.mode`` decides how requests are served: ``"decoder"``
    prefills the prompts (the long one in chunks under ``token_budget``) and decodes
    greedily; ``"encoder"`` (encoder-only layers) encodes whole prompts, as many per step
    as fit ``token_budget`` (a longer prompt alone), with no decode steps;
    ``"encoder-decoder"`` encodes each request's source prompt whole in the step before
    its decoder starts (an encoder runtime), then prefills a short decoder prompt and
    decodes greedily (a decoder runtime), its cross-attention layers reading the
    request's encoder output. Every step of each runtime is checked.

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

    def runtime_for(names: Sequence[str]) -> AttentionRuntime:
        return AttentionRuntime(
            {name: model.specs[name] for name in names},
            config,
            device=device,
            memory_budget_bytes=64 * 2**20,
            layer_params={name: model.params[name] for name in names},
            registry=registry,
            priority={torch.device(device).type: priority} if priority else None,
            cache_fill=float("nan"),
            context_parallel=context_parallel,
        )

    # An encoder runtime for the encoder stack, a decoder runtime for the rest.
    runtimes: dict[str, AttentionRuntime] = {}
    if model.encoder_layers:
        runtimes["encoder"] = runtime_for(model.encoder_layers)
    if model.decoder_layers:
        runtimes["decoder"] = runtime_for(model.decoder_layers)
    cached = runtimes.get("decoder")
    memory = (
        f"{cached.num_blocks} blocks of {cached.page_size_bytes} B"
        if cached is not None
        else "no cache (encoder-only layers keep none)"
    )
    out.write(
        f"attnkit demo: model {model_name}, {len(model.layers)} layers, {memory}, {dtype}, "
        f"{device}\n"
    )
    if context_parallel is not None:
        out.write(
            f"context parallel: rank {context_parallel.rank} of {context_parallel.world_size}; "
            f"full and MLA layers keep token t on rank t mod {context_parallel.world_size} and "
            f"merge the ranks' partial attention, the other kinds are replicated\n"
        )
    if model.mode == "encoder":
        out.write(
            "mode: encoder-only: each step encodes whole prompts bidirectionally (a "
            "request's prompt comes in one step, nothing is cached), checked against a "
            "dense encoder; no decode steps\n"
        )
    elif model.mode == "encoder-decoder":
        out.write(
            f"mode: encoder-decoder: the encoder ({', '.join(model.encoder_layers)}) encodes "
            f"each request's source prompt whole, in one step; the decoder "
            f"({', '.join(model.decoder_layers)}) prefills a decoder prompt and decodes "
            f"greedily, its cross-attention layers reading the request's encoder output; "
            f"both stacks are checked against dense recomputes\n"
        )
    for which, runtime in runtimes.items():
        label = f" ({which} runtime)" if len(runtimes) > 1 else ""
        out.write(f"routing{label}:\n")
        rows = runtime.routing_table()
        kinds = [
            row.kind.value + (f"({spec.mamba_type})" if isinstance(spec, MambaSpec) else "")
            for row in rows
            for spec in (runtime.groups[row.group_id].spec,)
        ]
        width = max(17, *map(len, kinds))
        for row, kind in zip(rows, kinds, strict=True):
            group = runtime.groups[row.group_id]
            out.write(
                f"  {row.layer:<10} {kind:<{width}} group {row.group_id} "
                f"(block_size {group.spec.block_size}) -> {row.backend} ({row.source})\n"
            )
    for which, runtime in runtimes.items():
        label = f" ({which} runtime)" if len(runtimes) > 1 else ""
        level, who = runtime.cudagraph_support()
        out.write(f"CUDA graphs{label}: {level.name} (limited by {who})\n")

    gen = torch.Generator().manual_seed(1)
    lengths = {"req-a": 5, "req-b": 12, "req-long": 40, "req-c": 3}
    prompts: dict[str, list[int]] = {
        rid: torch.randint(0, 64, (n,), generator=gen).tolist()  # pyright: ignore[reportUnknownMemberType]  # torch types tolist() as a bare List
        for rid, n in lengths.items()
    }
    tally = _Tally(out, TOLERANCE[dtype])
    encoder_runtime = runtimes.get("encoder")
    if cached is None:
        assert encoder_runtime is not None  # a layout has layers
        _serve_encoder_only(model, encoder_runtime, prompts, token_budget, tally)
        return tally.result()
    sources: dict[str, list[int]] | None = None
    if encoder_runtime is not None:
        # The prompts above are the encoder's sources; each request's decoder starts
        # from a short prompt of its own (the long one still takes two chunks).
        sources = prompts
        decoder_lengths = {"req-a": 2, "req-b": 4, "req-long": 20, "req-c": 1}
        prompts = {
            rid: torch.randint(0, 64, (n,), generator=gen).tolist()  # pyright: ignore[reportUnknownMemberType]  # as above
            for rid, n in decoder_lengths.items()
        }
    _serve_decoder(
        model,
        cached,
        prompts,
        decode_steps=decode_steps,
        token_budget=token_budget,
        tally=tally,
        encoder=(encoder_runtime, sources)
        if encoder_runtime is not None and sources is not None
        else None,
    )
    return tally.result()


def run_demo_context_parallel(
    world_size: int, *, out: TextIO, timeout_s: float = 120.0, **kwargs: Any
) -> DemoResult:
    """``run_demo`` on ``world_size`` local processes, one decode context-parallel rank
    each (``torch.distributed`` with gloo, a file store in a temporary directory).

    Rank 0's report goes to ``out``, followed by every rank's peak KV-cache blocks and
    the largest difference between the ranks' and rank 0's results; ``kwargs`` are
    ``run_demo``'s (``registry`` must be left out: each process uses the default one).
    The result is rank 0's, passed only if every rank passed.

    Raises:
        InvalidArgumentError: ``world_size`` is not an int >= 1, or a bad ``kwargs``.
        RuntimeError: a rank failed (its error is in the message).
    """
    import json
    import tempfile
    from pathlib import Path

    from torch.multiprocessing.spawn import (
        spawn as untyped_spawn,  # pyright: ignore[reportUnknownVariableType]  # unannotated in torch
    )

    # torch leaves spawn unannotated; typed here once.
    spawn = cast("Callable[..., object]", untyped_spawn)
    given: object = world_size  # untyped callers may pass anything
    if not (isinstance(given, int) and not isinstance(given, bool) and world_size >= 1):
        raise InvalidArgumentError(
            f"context_parallel: the rank count must be an int >= 1, got {world_size!r}"
        )
    if "registry" in kwargs or "context_parallel" in kwargs or "out" in kwargs:
        raise InvalidArgumentError(
            "run_demo_context_parallel: registry, context_parallel and out are set per rank; "
            f"got {sorted(k for k in kwargs if k in ('registry', 'context_parallel', 'out'))}"
        )
    with tempfile.TemporaryDirectory(prefix="attnkit-cp-") as tmp:
        spawn(
            _context_parallel_rank,
            args=(world_size, tmp, timeout_s, kwargs),
            nprocs=world_size,
            join=True,
        )
        reports = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world_size)]
    first = reports[0]
    out.write(first["text"])
    blocks = ", ".join(f"rank {r}: {rep['peak_kv_blocks']}" for r, rep in enumerate(reports))
    out.write(f"peak KV-cache blocks per rank: {blocks}\n")
    passed = all(rep["passed"] for rep in reports)
    if not passed:
        failing = [r for r, rep in enumerate(reports) if not rep["passed"]]
        out.write(f"FAIL: ranks {failing} did not match their dense recompute\n")
    return DemoResult(
        passed=passed,
        max_error=max(rep["max_error"] for rep in reports),
        steps=first["steps"],
        tokens=first["tokens"],
        seconds=first["seconds"],
        peak_kv_blocks=first["peak_kv_blocks"],
    )


def _context_parallel_rank(
    rank: int, world_size: int, tmp: str, timeout_s: float, kwargs: dict[str, Any]
) -> None:
    """One rank of ``run_demo_context_parallel`` (a spawned process)."""
    import datetime
    import io
    import json
    from pathlib import Path

    import torch.distributed as dist

    from .parallel import ContextParallel

    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        text = io.StringIO()
        result = run_demo(out=text, context_parallel=ContextParallel.from_process_group(), **kwargs)
        report = {**dataclasses.asdict(result), "text": text.getvalue()}
        (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def _serve_encoder_only(
    model: DemoModel,
    runtime: AttentionRuntime,
    prompts: dict[str, list[int]],
    token_budget: int,
    tally: _Tally,
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


def _serve_decoder(
    model: DemoModel,
    runtime: AttentionRuntime,
    prompts: dict[str, list[int]],
    *,
    decode_steps: int,
    token_budget: int,
    tally: _Tally,
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
