"""The registry of every kind's rules (checked at import) and the lookups: ``rules_for``,
``rules_for_kind``, ``all_rules``, ``attention_rules``, ``CONTEXT_SHARDED_KINDS``."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgumentError
from ..spec import AttentionSpec, KVCacheSpec, KVCacheSpecKind, MambaSpec, spec_class_for_kind
from ._attention import ATTENTION_RULES
from ._base import KindRules
from ._state import _StateRules


def _registry(*rules: KindRules[Any]) -> dict[KVCacheSpecKind, KindRules[Any]]:
    """Kind -> its rules; every ``KVCacheSpecKind`` needs exactly one, declared with the
    spec class ``spec.py`` defines for it (checked at import, so a kind without rules
    fails when attnkit is imported, not mid-step)."""
    found: dict[KVCacheSpecKind, KindRules[Any]] = {}
    for r in rules:
        if r.kind in found:
            raise TypeError(f"attnkit.kinds: kind {r.kind.value} has two KindRules")
        if spec_class_for_kind(r.kind) is not r.spec_class:
            raise TypeError(
                f"attnkit.kinds: the rules of kind {r.kind.value} name spec class "
                f"{r.spec_class.__name__}, spec.py defines "
                f"{spec_class_for_kind(r.kind).__name__}"
            )
        found[r.kind] = r
    missing = [k.value for k in KVCacheSpecKind if k not in found]
    if missing:
        raise TypeError(
            f"attnkit.kinds declares no KindRules for kind(s) {', '.join(missing)}: every "
            f"KVCacheSpecKind needs its rules in attnkit/kinds/ (known: "
            f"{', '.join(k.value for k in found)})"
        )
    return {k: found[k] for k in KVCacheSpecKind}  # in the enum's order


_RULES: dict[KVCacheSpecKind, KindRules[Any]] = _registry(*ATTENTION_RULES, _StateRules(MambaSpec))


def rules_for(spec: KVCacheSpec) -> KindRules[Any]:
    """The rules of ``spec``'s kind."""
    return _RULES[spec.kind]


def rules_for_kind(kind: object) -> KindRules[Any]:
    """The rules of ``kind`` (a ``KVCacheSpecKind`` or its value).

    Raises:
        InvalidArgumentError: not a known kind (the message lists the known ones).
    """
    try:
        return _RULES[KVCacheSpecKind(kind)]
    except (ValueError, KeyError):
        raise InvalidArgumentError(
            f"kind must be a KVCacheSpecKind, got {kind!r}; known kinds: "
            f"{', '.join(k.value for k in _RULES)}"
        ) from None


def all_rules() -> tuple[KindRules[Any], ...]:
    """Every kind's rules, in ``KVCacheSpecKind`` order."""
    return tuple(_RULES.values())


def attention_rules() -> tuple[KindRules[Any], ...]:
    """The attention kinds' rules (specs under ``AttentionSpec``), in ``KVCacheSpecKind``
    order."""
    return tuple(r for r in _RULES.values() if issubclass(r.spec_class, AttentionSpec))


CONTEXT_SHARDED_KINDS: frozenset[KVCacheSpecKind] = frozenset(
    r.kind for r in _RULES.values() if r.context_sharded
)
"""Kinds whose cache decode context parallelism shards across ranks (token ``t`` on rank
``t mod N``; ``KindRules.context_sharded``): full and MLA attention, whose caches grow
with the context without bound. Every other kind is replicated on every rank: windows,
chunks and states are bounded per request (sharding would save little and cost a merge
per layer), cross-attention is bounded by the encoder length, and sink tokens
(``sink_full_attention``) would need their sink slots sharded too, which the runtime
does not do yet."""
