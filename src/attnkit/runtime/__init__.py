"""``AttentionRuntime``: the per-step driver an engine uses.

Built once from the model's layer specs, it groups layers, unifies page sizes, selects
a backend per group, makes one builder per group and one impl per layer, and
allocates the paged cache. Each step::

    step = runtime.begin_step([ScheduledRequest("a", 7), ScheduledRequest("b", 1)],
                              finished=["c"])
    # lay out the step's tokens in step.order (decodes first when a backend asks)
    out = runtime.forward("layers.0", q, k, v)                         # attention
    y = runtime.forward_state("layers.1", Mamba2Inputs(xBC=xbc, dt=dt))  # a state layer
    mamba = runtime.state_layer("layers.1", Mamba2Inputs)    # or a typed handle:
    y = mamba.forward(Mamba2Inputs(xBC=xbc, dt=dt))          # mypy checks the input class

``begin_step`` builds ``CommonAttentionMetadata`` and each group's backend metadata
exactly once; every ``forward`` of the step reuses it.

With prefix caching on (``AttentionConfig(prefix_caching={"enabled": True})``), a new
request's prompt is looked up first and the request starts from its hit::

    match = runtime.match_prefix(prompt)           # pure lookup: match.explain()
    runtime.begin_step([ScheduledRequest("c", len(prompt) - match.num_tokens, prefix=match)])
    ...
    runtime.free(["c"], token_ids={"c": prompt + generated})  # caches generated blocks

The package's modules: ``_requests`` (``ScheduledRequest``, ``StepBatch``), ``_runtime``
(``AttentionRuntime``'s construction and introspection, ``StateLayer``), ``_step`` (the
per-step host path), ``_forward`` (the layer calls), ``_boundary`` (the input boundary
those calls pass), ``_prefix`` (the prefix-caching calls), ``_spec`` (speculative
decoding: ``accept``, the state layers' verify path), ``_base`` (the state its parts
share), ``_checks`` (construction checks), ``_reports`` (routing and memory reports),
``_pages`` (page descriptors, canonical page ids), ``_offload`` (pages to and from a
KV connector).
"""

from __future__ import annotations

from ..kv_cache import PrefixMatch
from ._checks import default_layer_params as default_layer_params
from ._checks import group_features as group_features
from ._checks import group_num_heads as group_num_heads
from ._pages import (
    CacheTensorPages,
    GroupPages,
    PageDescriptors,
    PageSharing,
    ScaleDescriptor,
    TensorParallelRank,
)
from ._reports import GroupMemory, MemoryReport, RoutingRow
from ._requests import ScheduledRequest, StepBatch
from ._runtime import AttentionRuntime, StateLayer
from ._spec import draft_state_bytes as draft_state_bytes

__all__ = [
    "AttentionRuntime",
    "CacheTensorPages",
    "GroupMemory",
    "GroupPages",
    "MemoryReport",
    "PageDescriptors",
    "PageSharing",
    "PrefixMatch",
    "RoutingRow",
    "ScaleDescriptor",
    "ScheduledRequest",
    "StateLayer",
    "StepBatch",
    "TensorParallelRank",
]
