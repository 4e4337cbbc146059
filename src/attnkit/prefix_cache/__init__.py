"""Prefix caching's content addressing and hit rules (docs/prefix-caching.md).

A full block of a request's tokens is named by a chained hash over its parent's name,
its token ids and its extra keys (``block_names``, ``BlockChain``), from a root that
holds the cache salt and adapter id (``prefix_root``); names live in a group's
namespace (``group_namespace``: the spec, layout, scales, revision), so a pool key is
``(namespace, name)``. The bytes hashed are canonical (``_format``): stable across
processes and platforms. Each kind says which cached blocks serve a prefix
(``KindRules.prefix_hit``); ``find_prefix_hit`` combines the groups (a fixed point) and
explains the result (``PrefixHit``), ``prefix_granularity`` gives the model's minimum
cacheable prefix, and ``PrefixCacheCounters`` counts lookups.

The package: ``_format`` (the byte format, token ids, multimodal inputs), ``_hashers``
(SHA-256, XXH3-128), ``_chains`` (roots and block names), ``_namespace`` (group
namespaces), ``_match`` (the combined hit, the granularity, the reports), ``_stats``
(the counters).
"""

from ..kinds import (
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
from ._chains import ROOT_MAGIC, BlockChain, block_names, prefix_root
from ._format import (
    FORMAT_VERSION,
    MAX_TOKEN_ID,
    MultimodalInput,
    Tokens,
    as_token_array,
    check_mm_inputs,
    encode_value,
)
from ._hashers import HASH_NAMES, Hasher, HashName, get_hasher
from ._match import (
    GroupHit,
    GroupLookup,
    PrefixGranularity,
    PrefixHit,
    checkpoint_interval_for,
    find_prefix_hit,
    miss_causes,
    prefix_granularity,
)
from ._namespace import NAMESPACE_MAGIC, group_namespace
from ._stats import PrefixCacheCounters, PrefixCacheStats

__all__ = [
    "FORMAT_VERSION",
    "HASH_NAMES",
    "MAX_TOKEN_ID",
    "NAMESPACE_MAGIC",
    "ROOT_MAGIC",
    "BelowMinimum",
    "BlockChain",
    "BlockLookup",
    "BlockNotCached",
    "GroupHit",
    "GroupLookup",
    "HashName",
    "Hasher",
    "MissCause",
    "MultimodalInput",
    "NeverHits",
    "NoCheckpoint",
    "NotFullBlock",
    "PrefixCacheCounters",
    "PrefixCacheStats",
    "PrefixGranularity",
    "PrefixHit",
    "PrefixMiss",
    "TokenLayout",
    "Tokens",
    "as_token_array",
    "block_names",
    "check_mm_inputs",
    "checkpoint_interval_for",
    "encode_value",
    "find_prefix_hit",
    "get_hasher",
    "group_namespace",
    "miss_causes",
    "prefix_granularity",
    "prefix_root",
]
