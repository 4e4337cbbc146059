"""get_cudagraph_support is a classmethod asked for any group: narrowing its spec
parameter breaks Liskov."""

from __future__ import annotations

from typing_extensions import override

from attnkit import AttentionCGSupport, AttentionConfig, AttentionSpec

from ._common import FullBuilder


class NarrowingBuilder(FullBuilder):
    @classmethod
    @override
    def get_cudagraph_support(  # E: - | pyright: reportIncompatibleMethodOverride
        cls,
        config: AttentionConfig,
        kv_cache_spec: AttentionSpec,  # E: override | pyright: -
    ) -> AttentionCGSupport:
        return AttentionCGSupport.ALWAYS
