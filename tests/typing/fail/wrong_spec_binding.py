"""Registering a builder (or impl) for a spec type / metadata it does not accept."""

from __future__ import annotations

from attnkit import (
    AttentionBackend,
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpecKind,
    bind_builder,
)

from ._common import AttnImpl, FullBuilder, MambaBuilder, MambaImpl

# The builder's __init__ takes MambaSpec, so it cannot be bound to attention specs.
bind_builder(AttentionSpec, MambaBuilder, MambaImpl)  # E: misc
# FullBuilder accepts FullAttentionSpec only, not every AttentionSpec.
bind_builder(AttentionSpec, FullBuilder, AttnImpl)  # E: misc
# The impl consumes MambaMeta but the builder produces AttnMeta.
bind_builder(FullAttentionSpec, FullBuilder, MambaImpl)  # E: misc


class WrongBackend(AttentionBackend):
    name = "wrong"
    supported_kinds = frozenset({KVCacheSpecKind.FULL_ATTENTION})
    builders = (bind_builder(FullAttentionSpec, MambaBuilder, MambaImpl),)  # E: misc
