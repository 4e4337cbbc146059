"""The public API is deliberate: ``attnkit.__all__`` is guarded, and importing attnkit
stays light (no triton, no flash_attn)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import attnkit

PUBLIC_API = [
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


def test_all_is_the_guarded_public_api() -> None:
    assert attnkit.__all__ == PUBLIC_API


def test_every_public_name_exists() -> None:
    missing = [name for name in attnkit.__all__ if not hasattr(attnkit, name)]
    assert missing == []


def test_all_is_sorted_constants_classes_functions() -> None:
    names = [n for n in attnkit.__all__ if n != "__version__"]

    def group(name: str) -> int:
        if name.isupper():
            return 0
        return 1 if name[0].isupper() else 2

    assert names == sorted(names, key=lambda n: (group(n), n))


def test_import_does_not_pull_optional_packages() -> None:
    code = textwrap.dedent(
        """
        import sys
        import attnkit
        import attnkit.kernels, attnkit.kernels.torch, attnkit.kernels.triton
        heavy = sorted(m for m in ("triton", "flash_attn", "flash_attn_interface") if m in sys.modules)
        print(",".join(heavy) or "none")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "none", result.stderr


def test_py_typed_marker_ships() -> None:
    from importlib import resources

    assert resources.files("attnkit").joinpath("py.typed").is_file()
