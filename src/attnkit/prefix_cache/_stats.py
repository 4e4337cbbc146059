"""The prefix cache's counters: lookups, the tokens they asked for, hits, the tokens
served, evictions."""

from __future__ import annotations

import dataclasses

from typing_extensions import override

from ..errors import InvalidArgumentError
from ._match import PrefixHit

__all__ = ["PrefixCacheCounters", "PrefixCacheStats"]


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    """A snapshot of the counters.

    Attributes:
        queries: lookups (``find_prefix_hit`` calls recorded).
        query_tokens: prompt tokens those lookups covered.
        hits: lookups that hit at least one token.
        hit_tokens: tokens served from the cache.
        evictions: cached blocks evicted.
        cached_blocks: blocks that hold a name now, in use or free (a cache's snapshot;
            the counters alone leave it 0).
        cached_free_blocks: of them, the ones no request holds (evictable).
        checkpoints: state checkpoints kept now (pages of state groups, evictable;
            docs/prefix-caching.md, "State checkpoints").
        offloaded: with a KV connector (docs/offload.md), evicted blocks and
            checkpoints saved to it; ``offload_loads``: pages loaded back from it for
            a lookup; ``offload_load_failures``: loads that failed (the hit shortened,
            the tokens are recomputed); ``offload_hit_tokens``: tokens of hits that
            only the loaded pages served.
    """

    queries: int = 0
    query_tokens: int = 0
    hits: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    cached_blocks: int = 0
    cached_free_blocks: int = 0
    checkpoints: int = 0
    offloaded: int = 0
    offload_loads: int = 0
    offload_load_failures: int = 0
    offload_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Hits per lookup (0.0 before any)."""
        return self.hits / self.queries if self.queries else 0.0

    @property
    def token_hit_rate(self) -> float:
        """Tokens served per prompt token looked up (0.0 before any)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @override
    def __str__(self) -> str:
        return (
            f"prefix cache: {self.hits}/{self.queries} lookups hit ({self.hit_rate:.1%}), "
            f"{self.hit_tokens}/{self.query_tokens} tokens served "
            f"({self.token_hit_rate:.1%}), {self.evictions} evictions, "
            f"{self.cached_blocks} cached blocks ({self.cached_free_blocks} free)"
            + (f", {self.checkpoints} state checkpoints" if self.checkpoints else "")
            + (
                f", offload: {self.offloaded} saved, {self.offload_loads} loaded "
                f"({self.offload_load_failures} failed), {self.offload_hit_tokens} tokens "
                f"served from it"
                if self.offloaded or self.offload_loads or self.offload_load_failures
                else ""
            )
        )


class PrefixCacheCounters:
    """The running counters (``stats()`` is a frozen snapshot)."""

    def __init__(self) -> None:
        self._stats = PrefixCacheStats()

    def record(self, hit: PrefixHit) -> None:
        """Count one lookup and its result."""
        self.record_query(hit.num_tokens, hit.length)

    def record_query(self, num_tokens: int, hit_tokens: int) -> None:
        """Count one lookup of ``num_tokens`` prompt tokens that served ``hit_tokens``.

        Raises:
            InvalidArgumentError: negative counts, or more tokens served than asked.
        """
        if not 0 <= hit_tokens <= num_tokens:
            raise InvalidArgumentError(
                f"record_query: need 0 <= hit_tokens <= num_tokens, got hit_tokens="
                f"{hit_tokens}, num_tokens={num_tokens}"
            )
        s = self._stats
        self._stats = dataclasses.replace(
            s,
            queries=s.queries + 1,
            query_tokens=s.query_tokens + num_tokens,
            hits=s.hits + (hit_tokens > 0),
            hit_tokens=s.hit_tokens + hit_tokens,
        )

    def record_evictions(self, count: int) -> None:
        """Count ``count`` evicted blocks.

        Raises:
            InvalidArgumentError: a negative count.
        """
        if count < 0:
            raise InvalidArgumentError(f"record_evictions: count must be >= 0, got {count}")
        self._stats = dataclasses.replace(self._stats, evictions=self._stats.evictions + count)

    def record_offload(
        self, *, saved: int = 0, loaded: int = 0, failed: int = 0, hit_tokens: int = 0
    ) -> None:
        """Count pages saved to and loaded from a KV connector, failed loads, and the
        hit tokens the loads served.

        Raises:
            InvalidArgumentError: a negative count.
        """
        if min(saved, loaded, failed, hit_tokens) < 0:
            raise InvalidArgumentError(
                f"record_offload: counts must be >= 0, got saved={saved}, loaded={loaded}, "
                f"failed={failed}, hit_tokens={hit_tokens}"
            )
        s = self._stats
        self._stats = dataclasses.replace(
            s,
            offloaded=s.offloaded + saved,
            offload_loads=s.offload_loads + loaded,
            offload_load_failures=s.offload_load_failures + failed,
            offload_hit_tokens=s.offload_hit_tokens + hit_tokens,
        )

    def stats(self) -> PrefixCacheStats:
        """The counters now."""
        return self._stats

    def reset(self) -> None:
        """Every counter back to 0."""
        self._stats = PrefixCacheStats()
