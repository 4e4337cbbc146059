"""The public API is deliberate: ``attnkit.__all__`` (the engine's surface) and
``attnkit.backend_api.__all__`` (the backend author's) are guarded, and importing
attnkit stays light (no triton, no flash_attn)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import attnkit
import attnkit.backend_api

PUBLIC_API = [
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
"""What an engine uses: ``import attnkit``."""

BACKEND_API = [
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
"""What a backend author uses: ``attnkit.backend_api``."""


def test_all_is_the_guarded_public_api() -> None:
    assert attnkit.__all__ == PUBLIC_API


def test_backend_api_is_guarded() -> None:
    assert attnkit.backend_api.__all__ == BACKEND_API


@pytest.mark.parametrize("module", [attnkit, attnkit.backend_api], ids=["attnkit", "backend_api"])
def test_every_public_name_exists(module: object) -> None:
    names: list[str] = getattr(module, "__all__")  # noqa: B009 (typed as object here)
    missing = [name for name in names if not hasattr(module, name)]
    assert missing == []


def test_engine_surface_has_what_an_engine_uses_and_no_plumbing() -> None:
    engine = set(PUBLIC_API)
    # The engine loop of docs/usage.md: runtime, step types, errors, config, specs, inputs.
    assert {
        "AttentionRuntime",
        "ScheduledRequest",
        "StepBatch",
        "OutOfBlocksError",
        "AttnkitError",
        "AttentionConfig",
        "Mamba2Inputs",
    } <= engine
    # Author-side machinery lives in attnkit.backend_api only.
    assert not engine & {"bind_builder", "AttentionImpl", "AttentionMetadataBuilder", "BuilderBinding"}
    shared = {
        "AttentionCGSupport",
        "AttentionFeature",
        "BackendOptions",
        "Determinism",
        "register_backend",
    }
    assert engine & set(BACKEND_API) == shared


def test_every_error_is_an_attnkit_error() -> None:
    errors = [getattr(attnkit, n) for n in PUBLIC_API if n.endswith("Error")]
    assert len(errors) == 19
    assert all(issubclass(e, attnkit.AttnkitError) for e in errors)
    # Each also derives from the builtin it resembles, so existing clauses catch it.
    builtins = (ValueError, TypeError, KeyError, RuntimeError, ImportError)
    assert all(issubclass(e, builtins) for e in errors if e is not attnkit.AttnkitError)


@pytest.mark.parametrize("module", [attnkit, attnkit.backend_api], ids=["attnkit", "backend_api"])
def test_all_is_sorted_constants_classes_functions(module: object) -> None:
    names = [n for n in getattr(module, "__all__") if n != "__version__"]  # noqa: B009

    def group(name: str) -> int:
        if name.isupper():
            return 0
        return 1 if name[0].isupper() else 2

    assert names == sorted(names, key=lambda n: (group(n), n))


def test_import_does_not_pull_optional_packages() -> None:
    code = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        import attnkit
        import attnkit.backend_api
        import attnkit.kernels
        # Every kernel module but the Triton ones: contracts, references, CPU engines.
        for m in pkgutil.walk_packages(attnkit.kernels.__path__, "attnkit.kernels."):
            parts = m.name.split(".")[2:]
            if not any(part.lstrip("_").startswith("triton") for part in parts):
                importlib.import_module(m.name)
        heavy = sorted(m for m in ("triton", "flash_attn", "flash_attn_interface") if m in sys.modules)
        print(",".join(heavy) or "none")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "none", result.stderr


def test_py_typed_marker_ships() -> None:
    from importlib import resources

    assert resources.files("attnkit").joinpath("py.typed").is_file()
