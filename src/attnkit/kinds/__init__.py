"""One place per spec kind: every fact that depends on a layer's kind.

Every rule that depends on a layer's kind lives in its ``KindRules``: whether it keeps
a cache, the cache layouts it can take (``KVCacheLayout``) and their shapes, how many
blocks a request's table needs, which blocks no present or future query can see
(released to the pool), the sequence lengths and slot mapping the runtime hands
builders, what a scheduled request must satisfy, the kind's **mask** (``Mask``:
causal or bidirectional, window, chunk, sink tokens), whether its cache holds one
latent per token, what bounds a request's live cache, the plan-time facts (context
sharded or replicated, growth without bound, bytes per token, the tensor-parallel
split), its example specs and layer parameters (the conformance kit, the demo), its
short name, and how it hits the **prefix cache** (``prefix_hit``, ``prefix_layout``,
``prefix_blocks``, ``prefix_never_hits``). The block manager (``kv_cache``), the
runtime, the planner, the backends, the kit and the demo all ask ``rules_for(spec)``; adding a kind means one spec class
(``spec.py``) and one ``KindRules`` (an attention kind's in ``_attention.py``, listed in
its ``ATTENTION_RULES``).

The package: ``_base`` (``KindRules``, ``Mask``, the step types and shared helpers),
``_attention`` (the attention kinds), ``_state`` (the state kind), ``_sharded``
(``ShardedRules``), ``_registry`` (every kind's rules, checked at import, and the lookups),
``_prefix`` (the prefix-cache hit rules' parts: ``TokenLayout``, the rule derived from a
kind's mask, the state kind's checkpoint rule, and the reasons a prefix misses).

Every per-step method is vectorised over the requests of a step (numpy arrays, one
entry per request): the host path does no per-request Python work for any kind.

Positions: a request's tokens are numbered from 0; a kind may *shift* them (sink
tokens sit in front of every request, so token ``t`` is at position ``sink_len + t``).
"""

from ._base import (
    Extent,
    KindRules,
    Mask,
    StepLens,
    StepTokens,
    TensorSplit,
    boundary_lengths,
    slots_of,
    spans,
)
from ._base import Ints as Ints  # the int64 array type the runtime and kv_cache annotate with
from ._prefix import (
    BelowMinimum,
    BlockLookup,
    BlockNotCached,
    MissCause,
    NeverHits,
    NoCheckpoint,
    NotFullBlock,
    PrefixMiss,
    TokenLayout,
)
from ._registry import (
    CONTEXT_SHARDED_KINDS,
    all_rules,
    attention_rules,
    rules_for,
    rules_for_kind,
)
from ._sharded import ShardedRules

__all__ = [
    "CONTEXT_SHARDED_KINDS",
    "BelowMinimum",
    "BlockLookup",
    "BlockNotCached",
    "Extent",
    "KindRules",
    "Mask",
    "MissCause",
    "NeverHits",
    "NoCheckpoint",
    "NotFullBlock",
    "PrefixMiss",
    "ShardedRules",
    "StepLens",
    "StepTokens",
    "TensorSplit",
    "TokenLayout",
    "all_rules",
    "attention_rules",
    "boundary_lengths",
    "rules_for",
    "rules_for_kind",
    "slots_of",
    "spans",
]
