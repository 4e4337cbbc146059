"""The demo's attention mixers and their dense definitions: softmax attention under a
kind's mask (``Attention``: full, sliding-window, chunked-local, sink tokens,
encoder-only, cross-attention; learned sink logits) and multi-head latent attention
(``MLA``); the attention kinds by their short names (``KIND_RULES``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from typing_extensions import override

from ..errors import InvalidArgumentError
from ..kinds import KindRules, Mask, attention_rules
from ..params import AttentionLayerParams, MLAProjection
from ..runtime import AttentionRuntime
from ..spec import AttentionSpec
from ._mixer import NO_CONTEXT, Context, Mixer, Rand, rms_norm


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
    of ``chunk`` positions). Sink tokens are the caller's (``Attention.dense``)."""
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


class Attention(Mixer[AttentionSpec, AttentionLayerParams]):
    """Softmax attention of one kind (``rules``) under its mask: full, sliding-window,
    chunked-local, with sink tokens (``sink_full_attention``: learned K/V in front of
    every context, StreamingLLM style), encoder-only (bidirectional, no cache) or
    cross-attention (queries from the decoder, keys/values from the encoder output);
    ``sinks=True`` adds learned per-head sink logits (gpt-oss)."""

    params: AttentionLayerParams

    def __init__(
        self,
        rand: Rand,
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
        self, runtime: AttentionRuntime, name: str, h: torch.Tensor, ctx: Context = NO_CONTEXT
    ) -> torch.Tensor:
        if self.reads_encoder:
            # The encoder K/V are written once, on a request's first step; later steps
            # read them from the cache.
            k, v = self._kv(ctx.encoder) if ctx.encoder is not None else (None, None)
        else:
            k, v = self._kv(h)
        return runtime.forward(name, self._q(h), k, v).reshape(h.shape[0], -1) @ self.wo

    @override
    def dense(self, h: torch.Tensor, ctx: Context = NO_CONTEXT) -> torch.Tensor:
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


class MLA(Mixer[AttentionSpec, AttentionLayerParams]):
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
        rand: Rand,
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
        c_kv = rms_norm(h @ self.w_ckv)
        k_pe = (h @ self.w_kpe).view(t, 1, self.rope_dim)
        return q_nope, _rope(q_pe, positions), c_kv, _rope(k_pe, positions)

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        return o.to(self.wo.dtype).reshape(o.shape[0], -1) @ self.wo

    @override
    def step(
        self, runtime: AttentionRuntime, name: str, h: torch.Tensor, ctx: Context = NO_CONTEXT
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
    def dense(self, h: torch.Tensor, ctx: Context = NO_CONTEXT) -> torch.Tensor:
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


KIND_RULES: dict[str, KindRules[Any]] = {
    r.short_name: r for r in attention_rules() if r.short_name is not None
}
"""The attention kinds by their short names, which the kinds declare
(``KindRules.short_name``: ``"full"``, ``"window"``, ``"chunked"``, ``"sink_tokens"``,
``"mla"``, ``"mla_window"``, ``"encoder"``, ``"cross"``)."""
