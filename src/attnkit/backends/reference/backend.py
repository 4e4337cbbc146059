"""``ReferenceBackend``: pure torch, CPU and CUDA, every kind; the oracle for every backend."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from typing_extensions import override

from ...backend import AttentionBackend, BackendRequest, DraftTreeSupport
from ...binding import bind_builder, bind_each
from ...capabilities import AttentionFeature, Determinism
from ...kinds import rules_for
from ...spec import (
    ATTENTION_SPEC_CLASSES,
    AttentionSpec,
    IndexerSpec,
    KVCacheDType,
    KVCacheSpecKind,
    MambaSpec,
    MambaType,
)
from ...state_types import STATE_TYPES, state_spec_reasons
from .attention import ReferenceAttentionBuilder, ReferenceAttentionImpl
from .indexer import ReferenceIndexerBuilder, ReferenceIndexerImpl
from .state import ReferenceStateBuilder, ReferenceStateImpl

__all__ = ["ReferenceBackend"]


class ReferenceBackend(AttentionBackend):
    """Pure-torch kernels with float32 accumulation, written for clarity, not speed.

    Serves every ``KVCacheSpecKind`` (state layers of every type in
    ``attnkit.state_types``) with any head size and block size, on CPU and CUDA. Other
    backends are tested against it.

    Its attention kinds are ``ATTENTION_SPEC_CLASSES``, and its impl asks each kind's
    ``KindRules`` (mask, what a step writes, latent or K/V), so a kind added in
    ``spec.py`` and ``kinds/_attention.py`` is served here with no edit.
    """

    name = "reference"
    description = "pure torch, every kind, CPU and CUDA, float32 accumulation (the oracle)"
    # Measured on CPU: every call of every combination the kit makes, run twice, bit for bit.
    deterministic = True
    # A loop over requests: each request's rows come from its own tensors only
    # (tests/test_invariance.py, bit for bit). Not prefill = decode or chunking: the
    # matrix products' rounding depends on how many query rows a request has in a step.
    # State kinds: run_to_run (the chunked scan and the recurrent step round
    # differently; docs/determinism.md).
    determinism: ClassVar[Mapping[KVCacheSpecKind, Determinism]] = {
        KVCacheSpecKind.FULL_ATTENTION: Determinism.BATCH_INVARIANT,
        KVCacheSpecKind.SLIDING_WINDOW: Determinism.BATCH_INVARIANT,
        KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION: Determinism.BATCH_INVARIANT,
    }
    supported_devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset(
        {
            "auto",
            "float32",
            "float16",
            "bfloat16",
            "fp8_e4m3",
            "fp8_e4m3_per_token_head",
            "int8_per_token_head",
        }
    )
    supported_head_sizes = None
    supported_block_sizes = None
    supported_features: ClassVar[frozenset[AttentionFeature]] = frozenset(
        {
            AttentionFeature.LOGITS_SOFT_CAP,
            AttentionFeature.ATTENTION_SINKS,
            AttentionFeature.ALIBI,
            AttentionFeature.MLA_PROJECTION,
            AttentionFeature.CONTEXT_PARALLEL,
            AttentionFeature.SPARSE_ATTENTION,
            AttentionFeature.PER_HEAD_QUANT_SCALES,
            AttentionFeature.MM_PREFIX,
            AttentionFeature.RETURN_LSE,
        }
    )
    # Every state type: each declares its reference computation.
    supported_mamba_types: ClassVar[frozenset[MambaType]] = frozenset(STATE_TYPES)
    # Every causal kind over a cache; windows, chunks and ALiBi measured in each draft's
    # depth position (the contract's "Draft trees").
    draft_trees: ClassVar[DraftTreeSupport | None] = DraftTreeSupport(
        kinds=frozenset(
            {
                KVCacheSpecKind.FULL_ATTENTION,
                KVCacheSpecKind.SINK_FULL_ATTENTION,
                KVCacheSpecKind.SLIDING_WINDOW,
                KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION,
                KVCacheSpecKind.MLA_ATTENTION,
                KVCacheSpecKind.SLIDING_WINDOW_MLA,
            }
        ),
        max_width=63,
        max_depth=63,
        how="a dense ancestor mask per request, drafts at their depth positions",
        alibi=True,
    )
    builders = (
        *bind_each(ATTENTION_SPEC_CLASSES, ReferenceAttentionBuilder, ReferenceAttentionImpl),
        bind_builder(MambaSpec, ReferenceStateBuilder, ReferenceStateImpl),
        bind_builder(IndexerSpec, ReferenceIndexerBuilder, ReferenceIndexerImpl),
    )

    @classmethod
    @override
    def extra_not_supported_reasons(cls, request: BackendRequest) -> list[str]:
        spec = request.spec
        if isinstance(spec, MambaSpec):
            return state_spec_reasons(spec, cls.supported_mamba_types)
        if isinstance(spec, IndexerSpec):
            return []  # the index cache is fp8 by its format, whatever the MLA cache's
        if (
            rules_for(spec).latent
            and isinstance(spec, AttentionSpec)
            and spec.kv_cache_dtype.startswith("fp8")
        ):
            return [
                f"kv_cache_dtype={spec.kv_cache_dtype} is not supported for {spec.kind.value} layers"
            ]
        return []
