"""Broken variants of the prefix cache, shared by the tests that must catch them
(``tests/`` is on ``sys.path`` for every test module, ``tests/integrations`` included:
``tests/conftest.py`` puts it there)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from attnkit.kv_cache import _prefix

_resolve = _prefix.PrefixCache.resolve


def misplaced_hits(self: _prefix.PrefixCache, *args: Any, **kwargs: Any) -> list[Any]:
    """``PrefixCache.resolve`` whose hits read their last cached block in place of their
    first (a hit that points at the wrong blocks)."""
    hits = _resolve(self, *args, **kwargs)
    for hit in hits:
        for installed in hit.tables:
            if installed is not None:
                entries = installed[0]
                live = np.flatnonzero(entries)
                entries[live[0]] = entries[live[-1]]
    return hits


def misplace_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Install ``misplaced_hits`` for one test."""
    monkeypatch.setattr(_prefix.PrefixCache, "resolve", misplaced_hits)
