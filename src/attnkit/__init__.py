"""attnkit: a typed attention-backend SDK for LLM inference engines.

Describe each layer's KV cache with a spec, route every spec kind to a backend,
and run the model's attention through ``AttentionRuntime``::

    >>> import torch, attnkit
    >>> spec = attnkit.SlidingWindowSpec(
    ...     block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=128)
    >>> spec.kind
    <KVCacheSpecKind.SLIDING_WINDOW: 'sliding_window'>

This module holds what an *engine* uses: specs, config, selection, the runtime and
its step types, layer parameters and state-layer inputs, the errors, and
``layout_from_hf_config`` (a Hugging Face ``config.json`` -> layer specs). What a
*backend author* needs (the builder and impl ABCs, ``bind_builder``, capability
declarations, the metadata types) is in ``attnkit.backend_api``.

``import attnkit`` imports neither triton nor flash_attn; backends import them lazily.
"""

from __future__ import annotations

from .builder import AttentionCGSupport
from .capabilities import AttentionFeature, Determinism
from .config import AttentionConfig, BackendOptions, PrefixCachingConfig, parse_backend_per_kind
from .errors import (
    ArgumentTypeError,
    AttnkitError,
    BackendNotSupportedError,
    DeviceUnavailableError,
    DuplicateBackendError,
    DuplicateRequestError,
    EngineLimitError,
    InvalidArgumentError,
    InvalidBackendError,
    MissingDependencyError,
    NoBackendError,
    OutOfBlocksError,
    PluginError,
    Rejection,
    StalePrefixError,
    StaleStepError,
    UnknownBackendError,
    UnknownLayerError,
    UnknownRequestError,
)
from .models import LayerInfo, ModelLayout, layout_from_hf_config
from .offload import ConnectorStats, FileTier, HostMemoryTier, KVConnector, TransferHandle
from .parallel import ContextParallel, ContextParallelMismatchError
from .params import (
    AttentionLayerParams,
    GatedDeltaNetLayerParams,
    LayerParams,
    LinearAttentionLayerParams,
    Mamba1LayerParams,
    Mamba2LayerParams,
    MLAProjection,
    ShortConvLayerParams,
    StateLayerParams,
)
from .prefix_cache import PrefixCacheStats
from .registry import BackendRegistry, default_registry, register_backend
from .runtime import (
    AttentionRuntime,
    CacheTensorPages,
    GroupMemory,
    GroupPages,
    MemoryReport,
    PageDescriptors,
    PageSharing,
    PrefixMatch,
    RoutingRow,
    ScaleDescriptor,
    ScheduledRequest,
    StateLayer,
    StepBatch,
    TensorParallelRank,
)
from .selector import Selection, select_backend
from .spec import (
    AttentionSpec,
    AttentionType,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    IndexerSpec,
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
from .state_inputs import (
    GatedDeltaNetInputs,
    LinearAttentionInputs,
    Mamba1Inputs,
    Mamba2Inputs,
    ShortConvInputs,
    StateInputs,
)

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "AttentionCGSupport",
    "AttentionConfig",
    "AttentionFeature",
    "AttentionLayerParams",
    "AttentionRuntime",
    "AttentionSpec",
    "AttentionType",
    "AttnkitError",
    "BackendNotSupportedError",
    "BackendOptions",
    "BackendRegistry",
    "CacheTensorPages",
    "ChunkedLocalAttentionSpec",
    "ConnectorStats",
    "ContextParallel",
    "ContextParallelMismatchError",
    "CrossAttentionSpec",
    "Determinism",
    "DeviceUnavailableError",
    "DuplicateBackendError",
    "DuplicateRequestError",
    "EncoderOnlyAttentionSpec",
    "EngineLimitError",
    "FileTier",
    "FullAttentionSpec",
    "GatedDeltaNetInputs",
    "GatedDeltaNetLayerParams",
    "GroupMemory",
    "GroupPages",
    "HostMemoryTier",
    "IndexerSpec",
    "InvalidArgumentError",
    "InvalidBackendError",
    "KVCacheDType",
    "KVCacheSpec",
    "KVCacheSpecKind",
    "KVConnector",
    "LayerInfo",
    "LayerParams",
    "LinearAttentionInputs",
    "LinearAttentionLayerParams",
    "MLAAttentionSpec",
    "MLAProjection",
    "Mamba1Inputs",
    "Mamba1LayerParams",
    "Mamba2Inputs",
    "Mamba2LayerParams",
    "MambaSpec",
    "MambaType",
    "MemoryReport",
    "MissingDependencyError",
    "ModelLayout",
    "NoBackendError",
    "OutOfBlocksError",
    "PageDescriptors",
    "PageSharing",
    "PluginError",
    "PrefixCacheStats",
    "PrefixCachingConfig",
    "PrefixMatch",
    "Rejection",
    "RoutingRow",
    "ScaleDescriptor",
    "ScheduledRequest",
    "Selection",
    "ShortConvInputs",
    "ShortConvLayerParams",
    "SinkFullAttentionSpec",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "StalePrefixError",
    "StaleStepError",
    "StateInputs",
    "StateLayer",
    "StateLayerParams",
    "StepBatch",
    "TensorParallelRank",
    "TransferHandle",
    "UnknownBackendError",
    "UnknownLayerError",
    "UnknownRequestError",
    "__version__",
    "default_registry",
    "get_attn_spec_kind",
    "layout_from_hf_config",
    "parse_backend_per_kind",
    "register_backend",
    "select_backend",
    "spec_class_for_kind",
]
