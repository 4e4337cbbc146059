"""The demo's state mixers, one per state type (Mamba2, Mamba1, Gated DeltaNet, linear
attention, short conv), each with its dense definition (the token-by-token recurrence);
``STATE_MIXERS`` builds them by ``mamba_type``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from typing_extensions import override

from ..kernels.gated_delta.reference import gated_delta_rule_recurrent_reference, l2_normalize
from ..kernels.linear_attention.reference import linear_attention_recurrent_reference
from ..kernels.mamba2.reference import ssd_recurrent_reference
from ..params import (
    GatedDeltaNetLayerParams,
    LinearAttentionLayerParams,
    Mamba1LayerParams,
    Mamba2LayerParams,
    ShortConvLayerParams,
)
from ..runtime import AttentionRuntime
from ..spec import MambaSpec, MambaType
from ..state_inputs import (
    GatedDeltaNetInputs,
    LinearAttentionInputs,
    Mamba1Inputs,
    Mamba2Inputs,
    ShortConvInputs,
)
from ..state_types import state_type_of
from ._mixer import NO_CONTEXT, Context, Mixer, Rand, rms_norm


def _causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal conv of one sequence from a zero state, by its definition."""
    width = weight.shape[1]
    padded = torch.cat([x.new_zeros(width - 1, x.shape[1]), x]).float()
    out = torch.zeros_like(padded[width - 1 :])
    for i in range(width):  # out[t] = sum_i w[:, i] * x[t - (W-1) + i]
        out += padded[i : i + x.shape[0]] * weight[:, i]
    return out + bias if bias is not None else out


class _Mamba2(Mixer[MambaSpec, Mamba2LayerParams]):
    params: Mamba2LayerParams

    def __init__(
        self,
        rand: Rand,
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
        self, runtime: AttentionRuntime, name: str, h: torch.Tensor, ctx: Context = NO_CONTEXT
    ) -> torch.Tensor:
        z, xbc, dt = self._inputs(h)
        return self._out(runtime.forward_state(name, Mamba2Inputs(xBC=xbc, dt=dt)), z)

    @override
    def dense(self, h: torch.Tensor, ctx: Context = NO_CONTEXT) -> torch.Tensor:
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


class _Mamba1(Mixer[MambaSpec, Mamba1LayerParams]):
    """A Mamba (1) mixer as in Jamba: ``in_proj`` gives ``x`` and the gate ``z`` (``d_inner``
    channels each); the runtime runs the conv, ``x_proj``/``dt_proj`` (with Jamba's
    RMSNorms of ``dt``, ``B`` and ``C``) and the selective scan; ``y * silu(z)`` then
    ``out_proj``. The dense check is the selective scan's definition, token by token."""

    params: Mamba1LayerParams

    def __init__(
        self,
        rand: Rand,
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
        self, runtime: AttentionRuntime, name: str, h: torch.Tensor, ctx: Context = NO_CONTEXT
    ) -> torch.Tensor:
        x, z = self._xz(h)
        return self._out(runtime.forward_state(name, Mamba1Inputs(x=x)), z)

    @override
    def dense(self, h: torch.Tensor, ctx: Context = NO_CONTEXT) -> torch.Tensor:
        p = self.params
        x, z = self._xz(h)
        u = F.silu(_causal_conv(x, p.conv_weight, p.conv_bias))  # float32 [T, D]
        rank, n = p.dt_rank, p.d_state
        dt_low, b, c = torch.split(u @ p.x_proj_weight.T, [rank, n, n], dim=-1)
        dt_low = rms_norm(dt_low, p.dt_norm_weight, p.norm_eps)
        b = rms_norm(b, p.B_norm_weight, p.norm_eps)
        c = rms_norm(c, p.C_norm_weight, p.norm_eps)
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


class _GatedDeltaNet(Mixer[MambaSpec, GatedDeltaNetLayerParams]):
    params: GatedDeltaNetLayerParams

    def __init__(
        self,
        rand: Rand,
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
        self, runtime: AttentionRuntime, name: str, h: torch.Tensor, ctx: Context = NO_CONTEXT
    ) -> torch.Tensor:
        qkv, g, beta, z = self._inputs(h)
        return self._out(
            runtime.forward_state(name, GatedDeltaNetInputs(qkv=qkv, g=g, beta=beta)), z
        )

    @override
    def dense(self, h: torch.Tensor, ctx: Context = NO_CONTEXT) -> torch.Tensor:
        p = self.params
        qkv, g, beta, z = self._inputs(h)
        mixed = F.silu(_causal_conv(qkv, p.conv_weight, p.conv_bias))
        t, hk = h.shape[0], p.num_heads * p.key_dim
        q = l2_normalize(mixed[:, :hk].reshape(t, p.num_heads, p.key_dim))
        k = l2_normalize(mixed[:, hk : 2 * hk].reshape(t, p.num_heads, p.key_dim))
        v = mixed[:, 2 * hk :].reshape(t, p.num_heads, p.value_dim)
        o, _ = gated_delta_rule_recurrent_reference(q, k, v, g, beta, scale=p.key_dim**-0.5)
        return self._out(o, z)


class _LinearAttention(Mixer[MambaSpec, LinearAttentionLayerParams]):
    params: LinearAttentionLayerParams

    def __init__(
        self,
        rand: Rand,
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
        self, runtime: AttentionRuntime, name: str, h: torch.Tensor, ctx: Context = NO_CONTEXT
    ) -> torch.Tensor:
        q, k, v = self._qkv(h)
        o = runtime.forward_state(name, LinearAttentionInputs(q=q, k=k, v=v))
        return rms_norm(o.reshape(h.shape[0], -1).to(h.dtype)) @ self.w_out

    @override
    def dense(self, h: torch.Tensor, ctx: Context = NO_CONTEXT) -> torch.Tensor:
        q, k, v = self._qkv(h)
        o, _ = linear_attention_recurrent_reference(
            q, k, v, self.params.decay, scale=self.key_dim**-0.5
        )
        return rms_norm(o.reshape(h.shape[0], -1).to(h.dtype)) @ self.w_out


class _ShortConv(Mixer[MambaSpec, ShortConvLayerParams]):
    params: ShortConvLayerParams

    def __init__(
        self, rand: Rand, *, hidden: int, width: int, block_size: int, dtype: torch.dtype
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
        self, runtime: AttentionRuntime, name: str, h: torch.Tensor, ctx: Context = NO_CONTEXT
    ) -> torch.Tensor:
        b, c, x = self._bcx(h)
        return runtime.forward_state(name, ShortConvInputs(b=b, c=c, x=x)) @ self.w_out

    @override
    def dense(self, h: torch.Tensor, ctx: Context = NO_CONTEXT) -> torch.Tensor:
        b, c, x = self._bcx(h)
        y = c.float() * _causal_conv(b * x, self.params.conv_weight.float(), None)
        return y.to(h.dtype) @ self.w_out


@dataclasses.dataclass(frozen=True)
class StateSizes:
    """What the demo's state mixers are built from (``DemoModel``'s arguments)."""

    hidden: int
    heads: int
    groups: int
    d_state: int
    width: int
    block_size: int
    dtype: torch.dtype
    device: torch.device


_StateMixer = Callable[[Rand, torch.Generator, StateSizes], Mixer[MambaSpec, Any]]

STATE_MIXERS: dict[MambaType, _StateMixer] = {
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
STATE_KINDS: dict[str, MambaType] = {state_type_of(t).short_name: t for t in STATE_MIXERS}
