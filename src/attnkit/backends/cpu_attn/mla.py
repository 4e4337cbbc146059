"""The ``cpu_mla`` backend: absorbed multi-head latent attention on the CPU engines
(beside ``cpu_attn``, whose builder it shares).

Serves ``mla_attention`` and ``sliding_window_mla`` layers (DeepSeek-V2/V3's MLA,
arXiv:2405.04434 section 2.1, weight-absorbed) with the same native kernels as
``cpu_attn``: a latent ``[D]`` per token (``D = R + rope``: the first
``R = kv_lora_rank`` channels are the compressed KV, the value of every head; the last
``rope`` the shared rotary key) is one KV head whose key is the whole latent and whose
value is its first ``R`` channels. So the engines attend GQA with one KV head and head
size ``D`` over the cache ``[NB, BS, D]`` viewed as planes ``[NB * BS, 1, D]``, the same
tensor for K and V; each row's first ``R`` output channels are the result (the last
``rope`` are discarded: 64 of 576 for DeepSeek, 11% more value work than needed, against
no change to the kernels). Decodes and short runs (at most ``NATIVE_MAX_QUERY`` queries)
go to the native paged decode, longer runs to the native blocked prefill.

The contract is ``reference``'s MLA path: ``query [T, H, D]`` (absorbed), ``key
[T, 1, D]`` the step's new latents, ``value`` ``None`` or the latents again, ``output
[T, H, R]`` with ``R = layer_params.v_head_size`` (``None``: ``D``), ``scale`` default
``D ** -0.5``. An ``fp8_e4m3`` cache stores ``latent / k_scale`` (one per-tensor scale,
``layer_params.k_scale``: the latent is both key and value), as ``triton_mla`` does;
the engines dequantise each tile. With ``mla_projection`` the impl absorbs ``W_UK``
into the query and applies ``W_UV`` to the result itself (always absorbed, as
``reference``). Not served (so not declared; those layers go to ``reference`` on CPU):
sparse attention (DSA).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from typing_extensions import override

from ...backend import AttentionBackend
from ...binding import bind_each
from ...capabilities import AttentionFeature, MultipleOf, SizeRule
from ...impl import AttentionImpl
from ...kernels.attention.cpu_decode import PreparedPlanes
from ...kinds import Mask, rules_for
from ...params import AttentionLayerParams, mla_params_problems
from ...spec import AttentionSpec, KVCacheDType, MLAAttentionSpec, SlidingWindowMLASpec
from .._planes import PlanesQuant, PlanesWrites, copy_rows, rows_to_write
from .backend import (
    NATIVE_MAX_QUERY,
    CpuAttentionBackend,
    CpuAttentionMetadata,
    CpuAttentionMetadataBuilder,
    cpu_metadata,
)

__all__ = ["CpuMLABackend", "CpuMLAImpl"]

_NAME = "cpu_mla"
# The projection (W_UK / W_UV applied here, around the engines: always absorbed).
_FEATURES: frozenset[AttentionFeature] = frozenset({AttentionFeature.MLA_PROJECTION})
# The latent width D: the engines take any multiple of 16 (DeepSeek: 576 = 512 + 64).
_HEAD_SIZES: SizeRule = (MultipleOf(16),)
_BLOCK_SIZES: SizeRule = (MultipleOf(16),)


class CpuMLAImpl(AttentionImpl[CpuAttentionMetadata, AttentionSpec, AttentionLayerParams]):
    """Writes the step's latents into the cache, then attends them as one KV head of
    width ``D`` (key: the latent; value: the same latent, of which the first ``R``
    output channels are kept).

    With ``layer_params.mla_projection`` the query is un-absorbed ``[T, H, N + P]`` and
    the output ``[T, H, V]``: the impl absorbs ``q_nope @ W_UK`` (float32) into the
    query the engines take, and multiplies their first ``R`` channels by ``W_UV``
    (float32), as ``reference`` does; every step runs absorbed.

    Attributes:
        kv_lora_rank: ``R``, the latent's value width (``layer_params.v_head_size``, or
            ``D``; the projection's ``R`` with one).
        scale: the softmax scale (``layer_params.scale``, default ``D ** -0.5``;
            ``(N + P) ** -0.5`` with a projection).

    Raises at construction (so a bad layer fails before its first step):
        ValueError: ``layer_params`` asks for what the backend does not serve.
    """

    def __init__(self, kv_cache_spec: AttentionSpec, layer_params: AttentionLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        spec, params = kv_cache_spec, layer_params
        problems = mla_params_problems(spec, params, backend=_NAME, supported_features=_FEATURES)
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
        self._mask: Mask = rules_for(spec).mask(spec)
        self.head_size = spec.head_size
        self.projection = params.mla_projection
        self.kv_lora_rank: int = (
            params.v_head_size if params.v_head_size is not None else spec.head_size
        )
        query_size = spec.head_size
        if self.projection is not None:
            self.kv_lora_rank = self.projection.kv_lora_rank
            query_size = self.projection.qk_nope_head_dim + spec.head_size - self.kv_lora_rank
        self.scale: float = params.scale if params.scale is not None else query_size**-0.5
        # An fp8 latent cache stores latent / k_scale (one scale: the latent is key and
        # value both), written as the reference quantiser writes it.
        self._quant = PlanesQuant.of(spec, params)
        self._latent_scale = self._quant.engine_scales(1)[0] if self._quant is not None else None
        self._prepared: PreparedPlanes | None = None
        # [T, H, D] results of the last step's shape, reused while it fits.
        self._scratch: torch.Tensor | None = None

    @property
    def output_size(self) -> int:
        """Width of ``forward``'s output: ``R``, or ``V`` with a projection."""
        return self.projection.v_head_dim if self.projection is not None else self.kv_lora_rank

    def _absorbed(self, query: torch.Tensor) -> torch.Tensor:
        """The query the engines take: as given, or with a projection
        ``[q_nope @ W_UK^T, q_pe]`` (float32 products, back in the query's dtype)."""
        proj = self.projection
        if proj is None:
            return query
        if proj.w_uk.device != query.device:
            raise ValueError(
                f"{type(self).__name__}.forward: layer_params.mla_projection must be on the "
                f"query's device {query.device}, got its weights on {proj.w_uk.device}"
            )
        nope = proj.qk_nope_head_dim
        absorbed = torch.einsum("thn,hrn->thr", query[:, :, :nope].float(), proj.w_uk.float())
        return torch.cat([absorbed.to(query.dtype), query[:, :, nope:]], dim=-1)

    def _plane(self, kv_cache: Sequence[torch.Tensor], who: str) -> torch.Tensor:
        """The latent cache ``[NB, BS, D]`` as one plane ``[NB * BS, 1, D]`` (a view)."""
        spec = self.kv_cache_spec
        if len(kv_cache) != 1:
            raise ValueError(
                f"{who}: kv_cache must hold 1 tensor (the latents), got {len(kv_cache)}"
            )
        cache = kv_cache[0]
        want = (spec.block_size, spec.head_size)
        if (
            cache.dim() != 3
            or tuple(cache.shape[1:]) != want
            or cache.dtype != spec.cache_torch_dtype
            or not cache.is_contiguous()
        ):
            raise ValueError(
                f"{who}: kv_cache[0] must be a contiguous {spec.cache_torch_dtype} tensor "
                f"[NB, BS, D] with BS={spec.block_size}, D={spec.head_size}, got "
                f"{cache.dtype} {list(cache.shape)}"
            )
        return cache.view(-1, 1, spec.head_size)

    def _results(self, query: torch.Tensor) -> torch.Tensor:
        """The engines' ``[T, H, D]`` results buffer for this step (reused)."""
        s = self._scratch
        if (
            s is None
            or s.dtype != query.dtype
            or s.shape[0] < query.shape[0]
            or s.shape[1:] != query.shape[1:]
        ):
            s = self._scratch = torch.empty(query.shape, dtype=query.dtype)
        return s[: query.shape[0]]

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: CpuAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Write the new latents (``key[:, 0]``), then attend; ``value`` is ignored."""
        spec = self.kv_cache_spec
        who = f"{type(self).__name__}.forward ({spec.kind.value})"
        m = cpu_metadata(who, attn_metadata)
        if key is None:
            raise TypeError(
                f"{who}: key (the new latents) must be a torch.Tensor [T, 1, D], got None"
            )
        plane = self._plane(kv_cache, who)
        query = self._absorbed(query)  # checked before anything is written
        self._write_latents(plane, key, m.writes)
        n = m.num_actual_tokens
        if n < output.shape[0]:  # padding rows
            output[n:] = 0
        results = self._results(query)
        causal, window = self._mask.causal, self._mask.window
        assert m.block_table is not None  # MLA layers have a cache
        if m.native:
            prepared = self._prepared
            if prepared is None or not prepared.serves(plane, plane, query.dtype, m.block_size):
                prepared = self._prepared = PreparedPlanes(
                    plane,
                    plane,
                    query_dtype=query.dtype,
                    num_heads=self.layer_params.num_heads,
                    head_size=spec.head_size,
                    block_size=m.block_size,
                    scale=self.scale,
                    k_scale=self._latent_scale,
                    v_scale=self._latent_scale,
                )
            prepared.requests(
                query, m.block_table, m.query_start_loc, m.seq_lens, m.native_requests,
                causal=causal, window=window, chunk=None, output=results,
            )  # fmt: skip
        if len(m.prefill_requests):
            from ...kernels.attention.cpu_prefill import paged_prefill

            # A fresh prompt reads the step's latents, unless the cache is quantised:
            # then the stored values, as every later step reads them.
            dense = key if m.read_step_kv and self._quant is None else None
            paged_prefill(
                query, plane, plane, m.block_table, m.prefill_requests, m.prefill_start,
                m.prefill_lens, m.prefill_seq, block_size=m.block_size, causal=causal,
                window=window, chunk=None, scale=self.scale, output=results,
                key=dense, value=dense, k_scale=self._latent_scale, v_scale=self._latent_scale,
            )  # fmt: skip
        output[:n].copy_(self._values(results[:n]))
        return output

    def _write_latents(self, plane: torch.Tensor, key: torch.Tensor, writes: PlanesWrites) -> None:
        """The step's new latents into their slots of the plane."""
        if writes.slots is None:
            return
        slots, new = rows_to_write(writes.slots, writes.rows, key)
        stored = new.to(plane.dtype) if self._quant is None else self._quant.stored(new, False)
        copy_rows(plane, slots, stored)

    def _values(self, results: torch.Tensor) -> torch.Tensor:
        """The output of the engines' ``[T, H, D]`` rows: the first ``R`` channels (the
        value part of the latent; the rest is the rope part's weighted sum), times
        ``W_UV`` with a projection."""
        values = results[..., : self.kv_lora_rank]
        proj = self.projection
        if proj is None:
            return values
        return torch.einsum("thr,hrv->thv", values.float(), proj.w_uv.float())


class CpuMLABackend(AttentionBackend):
    """Absorbed MLA (DeepSeek-V2/V3) on the CPU engines: full and sliding-window."""

    name = _NAME
    description = (
        "CPU engines for absorbed multi-head latent attention: the latent as one KV head "
        "(key: the whole latent, value: its first kv_lora_rank channels), the native "
        f"paged decode for decodes and runs of up to {NATIVE_MAX_QUERY} queries, the "
        "native blocked prefill for the rest; full and sliding-window MLA; CPU only"
    )
    supported_devices = frozenset({"cpu"})
    supported_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto", "fp8_e4m3"})
    supported_head_sizes = _HEAD_SIZES
    supported_block_sizes = _BLOCK_SIZES
    supported_features = _FEATURES
    deterministic = True
    builders = bind_each(
        (MLAAttentionSpec, SlidingWindowMLASpec), CpuAttentionMetadataBuilder, CpuMLAImpl
    )

    @classmethod
    @override
    def extra_environment_reasons(cls, device: torch.device) -> list[str]:
        """The engines' native library must load here (``cpu_attn``'s reasons)."""
        return CpuAttentionBackend.extra_environment_reasons(device)

    @classmethod
    @override
    def environment_notes(cls, device: torch.device) -> list[str]:
        """The native library the engines load (``cpu_attn``'s notes)."""
        return CpuAttentionBackend.environment_notes(device)
