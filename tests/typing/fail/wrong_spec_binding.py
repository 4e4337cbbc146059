"""Binding a builder and an impl to a spec class that one of them does not accept, or
an impl to a builder whose metadata it does not consume. (The same in a backend's class
body: class_body_binding.py.)"""

from __future__ import annotations

from attnkit import FullAttentionSpec, SlidingWindowSpec
from attnkit.backend_api import bind_builder, bind_each

from ._common import (
    AnyAttentionBuilder,
    FullBuilder,
    FullOnlyImpl,
    MambaBuilder,
    MambaMetaAttnImpl,
    SinkOnlyImpl,
    SlidingOnlyImpl,
)

# The builder's __init__ takes MambaSpec, so it cannot be bound to an attention spec.
bind_builder(SlidingWindowSpec, MambaBuilder, MambaMetaAttnImpl)  # E: arg-type | pyright: reportArgumentType
# Builder and impl accept disjoint specs (full vs sliding window): no spec fits both.
bind_builder(FullAttentionSpec, FullBuilder, SlidingOnlyImpl)  # E: arg-type | pyright: reportArgumentType
# The impl is narrowed to FullAttentionSpec; the binding hands it sliding-window specs.
bind_builder(SlidingWindowSpec, AnyAttentionBuilder, FullOnlyImpl)  # E: arg-type | pyright: reportArgumentType
# The impl is narrowed to SinkFullAttentionSpec, narrower than the binding's spec class.
bind_builder(FullAttentionSpec, FullBuilder, SinkOnlyImpl)  # E: arg-type | pyright: reportArgumentType
# bind_each checks every spec class against both.
bind_each((FullAttentionSpec, SlidingWindowSpec), AnyAttentionBuilder, FullOnlyImpl)  # E: arg-type | pyright: reportArgumentType
# The impl consumes MambaMeta but the builder produces AttnMeta.
bind_builder(FullAttentionSpec, FullBuilder, MambaMetaAttnImpl)  # E: misc | pyright: reportArgumentType
