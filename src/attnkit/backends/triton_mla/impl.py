"""``triton_mla``'s impl: writes the step's latents, then attends absorbed, or, with
``mla_projection``, runs the prefill part up-projected when that costs fewer FLOPs
(``costs``); and the layer-parameter rules it checks at construction."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from typing_extensions import override

from ..._validation import describe_tensor, dtype_name
from ...impl import AttentionImpl
from ...metadata import SparseSelection
from ...params import AttentionLayerParams
from ...params import mla_params_problems as _mla_params_problems
from ...spec import AttentionSpec
from ._limits import _FEATURES, _PAGED_MAX_HEAD_DIM, _PAGED_MIN_HEAD_DIM
from .builder import MLAPrefillMetadata, TritonMLAMetadata
from .costs import mla_prefill_costs

if TYPE_CHECKING:  # the kernel modules import triton; annotations only
    from ...kernels.attention.triton_plan import PagedAttentionPlan, SplitKVWorkspace


def mla_params_problems(spec: AttentionSpec, params: AttentionLayerParams) -> list[str]:
    """What keeps ``triton_mla`` from running an MLA layer with ``params`` (empty:
    nothing): :func:`attnkit.params.mla_params_problems` with its features."""
    return _mla_params_problems(spec, params, backend="triton_mla", supported_features=_FEATURES)


def _check_tensor(
    owner: str,
    name: str,
    t: object,
    *,
    layout: str,
    shape: tuple[int | None, ...],
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check ``t``'s rank, sizes (``None`` = any), dtype and device.

    Raises:
        TypeError: ``t`` is not a tensor.
        ValueError: naming ``owner``, ``name``, what was expected and what was given.
    """
    if not isinstance(t, torch.Tensor):
        got = "None" if t is None else f"a {type(t).__name__}"
        want = _want(layout, shape, dtype, device)
        raise TypeError(f"{owner}: {name} must be a torch.Tensor {want}, got {got}")
    if (
        t.dim() != len(shape)
        or any(w is not None and g != w for g, w in zip(t.shape, shape, strict=True))
        or t.dtype != dtype
        or (device is not None and t.device != device)
    ):
        want = _want(layout, shape, dtype, device)
        raise ValueError(f"{owner}: {name} must be {want}, got {describe_tensor(t)}")
    return t


def _want(
    layout: str, shape: tuple[int | None, ...], dtype: torch.dtype, device: torch.device | None
) -> str:
    """``"float16 [NB, BS, D]=[*, 16, 48] on cpu"``, for messages (built only for one)."""
    sizes = ", ".join("*" if d is None else str(d) for d in shape)
    where = "" if device is None else f" on {device}"
    return f"{dtype_name(dtype)} {layout}=[{sizes}]{where}"


class TritonMLAImpl(AttentionImpl[TritonMLAMetadata, AttentionSpec, AttentionLayerParams]):
    """Writes the step's latents with ``write_mla_latents``, then runs ``mla_attention``
    with the step's plan (the one-pass kernel, or split-KV when the plan chose it).

    With ``layer_params.mla_projection`` the query is un-absorbed ``[T, H, N + P]`` and
    the output ``[T, H, V]``: decodes run absorbed (``q_nope @ W_UK`` in, ``@ W_UV``
    out, around the same kernel); the step's prefill part runs absorbed too, or
    up-projected when :func:`mla_prefill_costs` says that costs fewer FLOPs and the
    paged-attention kernel takes ``N + P`` as a head size.

    Attributes:
        kv_lora_rank: ``R``, the latent output width (``layer_params.v_head_size``, or
            the whole latent when it is ``None``; the projection's ``R`` with one).
        scale: the softmax scale (``layer_params.scale``, default ``D ** -0.5`` with
            ``D`` the latent width, as in the reference backend; ``(N + P) ** -0.5``
            with a projection).
        projection: ``layer_params.mla_projection``.
        up_projection_possible: whether prefills may run up-projected (``N + P`` within
            the paged kernel's head sizes and ``V <= N + P``).

    Raises at construction (so a bad layer fails before its first step):
        ValueError: ``layer_params`` asks for a feature the backend does not declare,
            or does not fit the spec.
    """

    def __init__(self, kv_cache_spec: AttentionSpec, layer_params: AttentionLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        problems = mla_params_problems(kv_cache_spec, layer_params)
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
        self.num_heads = layer_params.num_heads
        self.head_size = kv_cache_spec.head_size
        self.projection = layer_params.mla_projection
        self.kv_lora_rank: int = (
            layer_params.v_head_size if layer_params.v_head_size is not None else self.head_size
        )
        self.query_size = self.head_size
        self.up_projection_possible = False
        if self.projection is not None:
            self.kv_lora_rank = self.projection.kv_lora_rank
            self.rope_dim = self.head_size - self.kv_lora_rank
            self.query_size = self.projection.qk_nope_head_dim + self.rope_dim
            self.up_projection_possible = (
                _PAGED_MIN_HEAD_DIM <= self.query_size <= _PAGED_MAX_HEAD_DIM
                and self.projection.v_head_dim <= self.query_size
            )
        self.scale: float = (
            layer_params.scale if layer_params.scale is not None else self.query_size**-0.5
        )
        self.fp8 = kv_cache_spec.kv_cache_dtype == "fp8_e4m3"
        # The fp8 scale on the layer's device, made on the first forward (the device is
        # not known before) and reused, so later steps and graph replays allocate nothing.
        self._kv_scale: torch.Tensor | None = None
        self._workspace: SplitKVWorkspace | None = None
        # Imported here, not at module level: importing the backend must not import
        # triton (and on CPU, triton must be imported after TRITON_INTERPRET is set).
        # Assigned unannotated, so each attribute keeps the launcher's own signature.
        from ...kernels.attention.triton import paged_attention
        from ...kernels.mla.triton import (
            mla_attention,
            mla_split_workspace,
            write_mla_latents,
        )

        self._mla_attention = mla_attention
        self._mla_split_workspace = mla_split_workspace
        self._write_mla_latents = write_mla_latents
        self._paged_attention = paged_attention

    def _scale_tensor(self, device: torch.device) -> torch.Tensor | None:
        """float32 ``[1]`` holding ``k_scale`` on ``device`` for fp8 caches, else None."""
        if not self.fp8:
            return None
        if self._kv_scale is None or self._kv_scale.device != device:
            self._kv_scale = torch.tensor(
                [_latent_scale(self.layer_params)], dtype=torch.float32, device=device
            )
        return self._kv_scale

    def _split_workspace(
        self, num_splits: int, num_tokens: int, device: torch.device
    ) -> SplitKVWorkspace:
        """Scratch of the split path, grown when a step needs more (reused otherwise)."""
        ws = self._workspace
        if ws is None or ws[0].shape[0] < num_splits or ws[0].shape[1] < num_tokens:
            splits = max(num_splits, ws[0].shape[0] if ws else 0)
            tokens = max(num_tokens, ws[0].shape[1] if ws else 0)
            ws = self._mla_split_workspace(
                splits, tokens, self.num_heads, self.kv_lora_rank, device=device
            )
            self._workspace = ws
        return ws

    def _check_inputs(
        self,
        key: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: object,
        device: torch.device,
    ) -> torch.Tensor:
        """The backend's own rules (no device reads): its metadata, the latent cache's
        layout and the projection's device; return the cache tensor. The query, the
        latents and the output were checked against the layer by the runtime
        (``attnkit.runtime._boundary``); only the latents' presence is checked here."""
        spec = self.kv_cache_spec
        owner = f"{type(self).__name__}.forward ({spec.kind.value})"
        if not isinstance(attn_metadata, TritonMLAMetadata):
            raise TypeError(
                f"{owner}: attn_metadata must be TritonMLAMetadata, "
                f"got {type(attn_metadata).__name__}"
            )
        if key is None:
            raise TypeError(
                f"{owner}: key (the new latents) must be a torch.Tensor [T, 1, D], got None"
            )
        if self.projection is not None and self.projection.w_uk.device != device:
            raise ValueError(
                f"{owner}: layer_params.mla_projection must be on the query's device "
                f"{device}, got its weights on {self.projection.w_uk.device}"
            )
        if len(kv_cache) != 1:
            raise ValueError(f"{owner}: kv_cache must hold 1 tensor, got {len(kv_cache)}")
        return _check_tensor(
            owner,
            "kv_cache[0]",
            kv_cache[0],
            layout="[NB, BS, D]",
            shape=(None, spec.block_size, self.head_size),
            dtype=spec.cache_torch_dtype,
            device=device,
        )

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: TritonMLAMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Write the new latents (``key[:T, 0]``) into the cache, then attend.

        ``value`` is ignored (the latents are written once, from ``key``).
        """
        cache = self._check_inputs(key, kv_cache, attn_metadata, query.device)
        assert key is not None  # checked above
        m = attn_metadata
        n = m.num_actual_tokens
        kv_scale = self._scale_tensor(query.device)
        self._write_mla_latents(key[:n, 0], cache, m.slot_mapping[:n], kv_scale=kv_scale)
        if self.projection is None:
            return self._latent_attention(query, cache, m.plan, kv_scale, output)
        if m.prefill is None or not self.prefers_up_projection(m.prefill):
            # Rows past num_actual_tokens (padding) are left untouched, as the kernel does.
            self._absorbed(query[:n], cache, m.plan, kv_scale, output[:n])
            return output
        nd = m.num_decode_tokens
        if m.decode_plan is not None:
            self._absorbed(query[:nd], cache, m.decode_plan, kv_scale, output[:nd])
        end = nd + m.prefill.num_tokens
        self._up_projected(query[nd:end], cache, m.prefill, output[nd:end])
        return output

    @override
    def forward_sparse(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: TritonMLAMetadata,
        output: torch.Tensor,
        selection: SparseSelection,
    ) -> torch.Tensor:
        """Write the new latents, then attend to the selected slots only
        (``kernels.dsa.triton.sparse_mla_attention``; a 16-bit or float32 latent cache,
        the caller's absorbed query)."""
        cache = self._check_inputs(key, kv_cache, attn_metadata, query.device)
        assert key is not None  # checked above
        if self.projection is not None or self.fp8:
            raise ValueError(
                f"{type(self).__name__}.forward_sparse: sparse attention takes the absorbed "
                f"query and a 16-bit or float32 latent cache (no mla_projection, no fp8)"
            )
        from ...kernels.dsa.triton import sparse_mla_attention

        m, n = attn_metadata, attn_metadata.num_actual_tokens
        self._write_mla_latents(key[:n, 0], cache, m.slot_mapping[:n])
        rows = selection.rows(n)
        sparse_mla_attention(
            query[:n],
            cache,
            rows.indices,
            rows.lens,
            kv_lora_rank=self.kv_lora_rank,
            scale=self.scale,
            output=output[:n],
        )
        return output

    @property
    def output_size(self) -> int:
        """Width of ``forward``'s output: ``R``, or ``V`` with a projection."""
        return self.projection.v_head_dim if self.projection is not None else self.kv_lora_rank

    def prefers_up_projection(self, prefill: MLAPrefillMetadata) -> bool:
        """Whether this layer runs ``prefill`` up-projected: possible for its widths and
        fewer FLOPs than absorbed (:func:`mla_prefill_costs`)."""
        proj = self.projection
        if proj is None or prefill.form == "absorbed":
            return False
        if prefill.form == "up_projected" and not self.up_projection_possible:
            raise ValueError(
                f"{type(self).__name__}: backend_options prefill_form='up_projected' needs "
                f"qk_nope_head_dim + rope in [{_PAGED_MIN_HEAD_DIM}, {_PAGED_MAX_HEAD_DIM}] "
                f"and v_head_dim <= that (the paged-attention kernel's head sizes), got "
                f"N + P = {self.query_size}, V = {proj.v_head_dim}"
            )
        if prefill.form == "up_projected":
            return True
        if not self.up_projection_possible:
            return False
        costs = mla_prefill_costs(
            pairs=prefill.pairs,
            num_tokens=prefill.num_tokens,
            context_tokens=prefill.context_tokens,
            kv_lora_rank=self.kv_lora_rank,
            rope_dim=self.rope_dim,
            qk_nope_head_dim=proj.qk_nope_head_dim,
            v_head_dim=proj.v_head_dim,
        )
        return costs.up_projected < costs.absorbed

    def _latent_attention(
        self,
        query: torch.Tensor,
        cache: torch.Tensor,
        plan: PagedAttentionPlan,
        kv_scale: torch.Tensor | None,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """The kernel on an absorbed query: ``output [T, H, R]``."""
        workspace = (
            self._split_workspace(plan.num_splits, query.shape[0], query.device)
            if plan.num_splits
            else None
        )
        return self._mla_attention(
            query,
            cache,
            plan,
            kv_lora_rank=self.kv_lora_rank,
            scale=self.scale,
            kv_scale=kv_scale,
            output=output,
            workspace=workspace,
        )

    def _absorbed(
        self,
        query: torch.Tensor,
        cache: torch.Tensor,
        plan: PagedAttentionPlan,
        kv_scale: torch.Tensor | None,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """``q_nope @ W_UK`` next to ``q_pe`` (one batched matmul over heads), the kernel,
        then ``@ W_UV``: ``output [T, H, V]``."""
        proj = self.projection
        assert proj is not None  # only called with a projection
        tokens, nope, rank = query.shape[0], proj.qk_nope_head_dim, self.kv_lora_rank
        q_abs = query.new_empty((tokens, self.num_heads, self.head_size))
        # [H, T, N] @ [H, N, R] -> [H, T, R], written through a transposed view.
        torch.matmul(
            query[:, :, :nope].transpose(0, 1),
            proj.w_uk.transpose(1, 2),
            out=q_abs[:, :, :rank].transpose(0, 1),
        )
        q_abs[:, :, rank:] = query[:, :, nope:]
        latent_out = query.new_empty((tokens, self.num_heads, rank))
        self._latent_attention(q_abs, cache, plan, kv_scale, latent_out)
        # [H, T, R] @ [H, R, V] -> [H, T, V].
        output.transpose(0, 1).copy_(torch.matmul(latent_out.transpose(0, 1), proj.w_uv))
        return output

    def _up_projected(
        self,
        query: torch.Tensor,
        cache: torch.Tensor,
        prefill: MLAPrefillMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Gather the prefills' latent blocks, up-project them into a temporary paged K/V
        cache ``[NBt, 2, BS, H, N + P]`` (keys ``[c W_UK, k_pe]``, values ``c W_UV``
        zero-padded to the key width), and run the paged-attention kernel over it."""
        proj = self.projection
        assert proj is not None  # only called with a projection
        rank, nope, v_dim = self.kv_lora_rank, proj.qk_nope_head_dim, proj.v_head_dim
        heads, width = self.num_heads, self.query_size
        latents = cache[prefill.block_ids]  # [NBt, BS, D]
        if self.fp8:
            latents = (latents.float() * _latent_scale(self.layer_params)).to(query.dtype)
        blocks, block_size = latents.shape[0], latents.shape[1]
        c = latents[:, :, :rank].reshape(blocks * block_size, rank)
        kv = query.new_empty((blocks, 2, block_size, heads, width))
        # [S, R] @ [H, R, N] -> [H, S, N] (c broadcast over heads, no copy).
        k_nope = torch.matmul(c, proj.w_uk).view(heads, blocks, block_size, nope)
        kv[:, 0, :, :, :nope] = k_nope.permute(1, 2, 0, 3)
        kv[:, 0, :, :, nope:] = latents[:, :, None, rank:]
        v = torch.matmul(c, proj.w_uv).view(heads, blocks, block_size, v_dim)
        kv[:, 1, :, :, :v_dim] = v.permute(1, 2, 0, 3)
        if v_dim < width:
            kv[:, 1, :, :, v_dim:] = 0
        plan = dataclasses.replace(prefill.plan, num_kv_heads=heads)
        full = output if v_dim == width else query.new_empty((query.shape[0], heads, width))
        self._paged_attention(query, kv, plan, scale=self.scale, output=full)
        if full is not output:
            output.copy_(full[:, :, :v_dim])
        return output


def _latent_scale(params: AttentionLayerParams) -> float:
    """The latent cache's one per-tensor scale (per-head scales are refused for MLA at
    construction, by ``attention_params_problems``)."""
    scale = params.k_scale
    return 1.0 if isinstance(scale, tuple) else float(scale)
