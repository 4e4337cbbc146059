"""supported_kinds() is derived from a backend's bindings (a classmethod): a backend
that declares it as a class attribute is an error."""

from __future__ import annotations

from attnkit import FullAttentionSpec, KVCacheSpecKind
from attnkit.backend_api import AttentionBackend, bind_builder

from ._common import AttnImpl, FullBuilder


class DeclaringBackend(AttentionBackend):
    name = "declaring"
    supported_kinds = frozenset({KVCacheSpecKind.FULL_ATTENTION})  # E: assignment | pyright: reportAssignmentType
    builders = (bind_builder(FullAttentionSpec, FullBuilder, AttnImpl),)
