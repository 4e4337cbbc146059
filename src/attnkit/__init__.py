"""attnkit: a typed attention-backend SDK for LLM inference engines.

Describe each layer's KV cache with a spec, route every spec kind to a backend,
and build per-step metadata that kernels consume directly::

    >>> import torch, attnkit
    >>> spec = attnkit.SlidingWindowSpec(
    ...     block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=128)
    >>> spec.kind
    <KVCacheSpecKind.SLIDING_WINDOW: 'sliding_window'>

``import attnkit`` imports neither triton nor flash_attn; backends import them lazily.
"""

from __future__ import annotations

from .backend import (
    AnyBuilderBinding,
    AttentionBackend,
    AttentionFeature,
    AttentionImpl,
    AttentionLayerParams,
    BackendRequest,
    BuilderBinding,
    BuilderClass,
    GatedDeltaNetLayerParams,
    LayerParams,
    LinearAttentionLayerParams,
    Mamba2LayerParams,
    MultipleOf,
    ShortConvLayerParams,
    SizeRange,
    SizeRule,
    StateLayerParams,
    bind_builder,
)
from .builder import AttentionCGSupport, AttentionMetadataBuilder
from .config import AttentionConfig, parse_backend_per_kind
from .metadata import (
    CommonAttentionMetadata,
    DecodePrefillSplit,
    reorder_batch_to_split_decodes_and_prefills,
    split_decodes_and_prefills,
)
from .registry import (
    ENTRY_POINT_GROUP,
    BackendRegistry,
    DuplicateBackendError,
    InvalidBackendError,
    RegistryEntry,
    UnknownBackendError,
    default_registry,
    register_backend,
)
from .selector import (
    DEFAULT_PRIORITY,
    BackendNotSupportedError,
    NoBackendError,
    Rejection,
    Selection,
    select_backend,
)
from .spec import (
    AttentionSpec,
    AttentionType,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheDType,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
    MambaType,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    get_attn_spec_kind,
    spec_class_for_kind,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_PRIORITY",
    "ENTRY_POINT_GROUP",
    "AnyBuilderBinding",
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionConfig",
    "AttentionFeature",
    "AttentionImpl",
    "AttentionLayerParams",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "AttentionType",
    "BackendNotSupportedError",
    "BackendRegistry",
    "BackendRequest",
    "BuilderBinding",
    "BuilderClass",
    "ChunkedLocalAttentionSpec",
    "CommonAttentionMetadata",
    "CrossAttentionSpec",
    "DecodePrefillSplit",
    "DuplicateBackendError",
    "EncoderOnlyAttentionSpec",
    "FullAttentionSpec",
    "GatedDeltaNetLayerParams",
    "InvalidBackendError",
    "KVCacheDType",
    "KVCacheSpec",
    "KVCacheSpecKind",
    "LayerParams",
    "LinearAttentionLayerParams",
    "MLAAttentionSpec",
    "Mamba2LayerParams",
    "MambaSpec",
    "MambaType",
    "MultipleOf",
    "NoBackendError",
    "RegistryEntry",
    "Rejection",
    "Selection",
    "ShortConvLayerParams",
    "SinkFullAttentionSpec",
    "SizeRange",
    "SizeRule",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "StateLayerParams",
    "UnknownBackendError",
    "__version__",
    "bind_builder",
    "default_registry",
    "get_attn_spec_kind",
    "parse_backend_per_kind",
    "register_backend",
    "reorder_batch_to_split_decodes_and_prefills",
    "select_backend",
    "spec_class_for_kind",
    "split_decodes_and_prefills",
]
