"""The ``triton_mla`` backend: multi-head latent attention with attnkit's Triton kernels.

Serves ``mla_attention``, ``sliding_window_mla`` and ``indexer`` layers (the last, with
the ``sparse_attention`` feature, is DeepSeek-V3.2's sparse attention: ``indexer.py``
and ``TritonMLAImpl.forward_sparse`` over ``kernels.dsa.triton``); the MLA layers
(DeepSeek-V2/V3's MLA, arXiv:2405.04434 section 2.1, in its weight-absorbed form) with
``kernels.mla.triton``. The cache ``[NB, BS, D]`` holds one latent per token,
``D = R + rope``: the first ``R = kv_lora_rank`` channels are the compressed KV (the
value of every head), the last ``rope`` channels the shared rotary key. The caller
absorbs ``W_UK`` into the query, so every head scores its ``[D]`` query against the
whole latent, and up-projects the ``[T, H, R]`` output with ``W_UV`` afterwards.

The contract is the reference backend's MLA path: ``query [T, H, D]`` (absorbed),
``key [T, 1, D]`` the step's new latents, ``value`` ``None`` or the latents again,
``output [T, H, R]`` with ``R = layer_params.v_head_size`` (``None``: ``D``),
``scale`` default ``D ** -0.5``. An fp8_e4m3 cache stores ``latent / k_scale`` (one
scale for the whole latent: it is both key and value).

The builder plans each step once with ``plan_paged_attention`` (one KV head, the
layer's window), exactly as ``triton_attn`` plans a one-KV-head layer: the one-pass
kernel for mixed prefill, chunked prefill and decode, or split-KV (flash-decoding)
for plain-decode batches whose few requests would leave SMs idle. Every layer of the
group launches with that plan.

With ``layer_params.mla_projection`` (the ``mla_projection`` feature) the impl applies
``W_UK``/``W_UV`` itself: it takes the un-absorbed query ``[T, H, N + P]`` and returns
``[T, H, V]``. Batches come decodes first (``reorder_batch_threshold``); decodes always
run absorbed, and the prefill part runs in whichever form costs fewer FLOPs for the
step: absorbed, or up-projected (the latent blocks the prefills read are gathered,
up-projected to per-head keys ``[c W_UK, k_pe]`` and values ``c W_UV`` and attended by
the paged-attention kernel). The builder lays out both (``TritonMLAMetadata.prefill``);
the impl, which knows the projection's widths, picks (``mla_prefill_costs``).

The package's modules: ``backend`` (this class, what it declares), ``builder`` (the
metadata and its builder), ``impl`` (the impl and its layer-parameter rules),
``costs`` (the prefill-form FLOP model and ``TritonMLAOptions``), ``_limits`` (the
kernels' limits as literals).

Importing this module does not import triton: the builder and impl import the kernel
modules when they are constructed. On CPU the kernels run only under the Triton
interpreter (``TRITON_INTERPRET=1`` before triton is first imported).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from typing_extensions import override

from ...backend import AttentionBackend, BackendRequest
from ...binding import bind_builder, bind_each
from ...capabilities import AttentionFeature
from ...spec import AttentionSpec, IndexerSpec, KVCacheDType, MLAAttentionSpec, SlidingWindowMLASpec
from .._triton_env import triton_cpu_reasons
from .._triton_paged import fp8_e4m3_capability_reasons
from ._limits import _BLOCK_SIZES, _FEATURES, _HEAD_SIZES
from .builder import TritonMLAMetadataBuilder
from .costs import TritonMLAOptions
from .impl import TritonMLAImpl
from .indexer import TritonIndexerBuilder, TritonIndexerImpl

__all__ = ["TritonMLABackend"]


class TritonMLABackend(AttentionBackend):
    """Multi-head latent attention (DeepSeek-V2/V3) in Triton: full and sliding-window MLA."""

    name = "triton_mla"
    description = (
        "Triton multi-head latent attention (absorbed MLA): full and sliding-window, "
        "fp8 latent cache, split-KV decode, CUDA graphs"
    )
    supported_devices = frozenset({"cpu", "cuda"})
    supported_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto", "fp8_e4m3"})
    supported_head_sizes = _HEAD_SIZES
    supported_block_sizes = _BLOCK_SIZES
    supported_features = _FEATURES
    options_type = TritonMLAOptions
    required_packages: ClassVar[Mapping[str, str]] = {"triton": "triton>=3.0"}
    builders = (
        *bind_each(
            (MLAAttentionSpec, SlidingWindowMLASpec), TritonMLAMetadataBuilder, TritonMLAImpl
        ),
        # DeepSeek sparse attention: the indexer, and sparse MLA (forward_sparse).
        bind_builder(IndexerSpec, TritonIndexerBuilder, TritonIndexerImpl),
    )

    @classmethod
    @override
    def extra_environment_reasons(cls, device: torch.device) -> list[str]:
        """On CPU, the Triton interpreter must be on (read from the environment now)."""
        return triton_cpu_reasons(device)

    @classmethod
    @override
    def extra_not_supported_reasons(cls, request: BackendRequest) -> list[str]:
        """fp8_e4m3 caches need compute capability >= 8.9 on CUDA (see
        ``fp8_e4m3_capability_reasons``; the rule ``triton_attn`` declares), except the
        index cache, which the kernels decode with integer ops. Sparse attention takes a
        16-bit or float32 latent cache and the absorbed query."""
        spec = request.spec
        if isinstance(spec, IndexerSpec):
            return []
        reasons = fp8_e4m3_capability_reasons(request)
        if AttentionFeature.SPARSE_ATTENTION in request.features and isinstance(spec, AttentionSpec):
            if spec.kv_cache_dtype == "fp8_e4m3":
                reasons.append("sparse_attention with an fp8_e4m3 latent cache is not supported")
            if AttentionFeature.MLA_PROJECTION in request.features:
                reasons.append("sparse_attention with mla_projection is not supported")
        return reasons
