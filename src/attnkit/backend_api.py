"""Everything a backend author needs, in one place.

An out-of-tree backend is a package with a backend class, a builder and an impl::

    from attnkit.backend_api import (
        AttentionBackend, AttentionImpl, AttentionMetadataBuilder, CommonAttentionMetadata,
        bind_builder,
    )

    class MyBuilder(AttentionMetadataBuilder[MyMeta, FullAttentionSpec]): ...
    class MyImpl(AttentionImpl[MyMeta, FullAttentionSpec, AttentionLayerParams]): ...

    class MyBackend(AttentionBackend):
        name = "my_backend"
        builders = (bind_builder(FullAttentionSpec, MyBuilder, MyImpl),)

registered through the ``attnkit.backends`` entry point (``ENTRY_POINT_GROUP``).
Specs, layer parameters, state inputs and the config come from ``attnkit`` itself.
``examples/out_of_tree_backend`` is a complete, installable example.
"""

from __future__ import annotations

from .backend import AttentionBackend, BackendRequest, DraftTreeSupport
from .binding import (
    Binding,
    BuilderBinding,
    BuilderConstructor,
    ImplConstructor,
    bind_builder,
    bind_each,
)
from .builder import AttentionCGSupport, AttentionMetadataBuilder
from .capabilities import (
    AttentionFeature,
    Determinism,
    KVCacheLayout,
    MultipleOf,
    SizeRange,
    SizeRule,
    format_sizes,
)
from .config import BackendOptions
from .impl import AttentionImpl, IndexerImpl, LayerImpl, StateImpl
from .metadata import (
    CommonAttentionMetadata,
    DecodePrefillSplit,
    DraftTreeMask,
    SparseSelection,
    mm_prefix_key_ends,
    reorder_batch_to_split_decodes_and_prefills,
    split_decodes_and_prefills,
)
from .params import attention_params_problems, mla_projection_problems
from .registry import ENTRY_POINT_GROUP, register_backend

__all__ = [
    "ENTRY_POINT_GROUP",
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionFeature",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "BackendOptions",
    "BackendRequest",
    "Binding",
    "BuilderBinding",
    "BuilderConstructor",
    "CommonAttentionMetadata",
    "DecodePrefillSplit",
    "Determinism",
    "DraftTreeMask",
    "DraftTreeSupport",
    "ImplConstructor",
    "IndexerImpl",
    "KVCacheLayout",
    "LayerImpl",
    "MultipleOf",
    "SizeRange",
    "SizeRule",
    "SparseSelection",
    "StateImpl",
    "attention_params_problems",
    "bind_builder",
    "bind_each",
    "format_sizes",
    "mla_projection_problems",
    "mm_prefix_key_ends",
    "register_backend",
    "reorder_batch_to_split_decodes_and_prefills",
    "split_decodes_and_prefills",
]
