"""Helpers the speculative-decoding tests share (chains in test_speculative.py, trees in
test_speculative_tree.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from attnkit import AttentionRuntime


def gen(*key: object) -> torch.Generator:
    """A generator seeded from ``key`` (stable across processes)."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


@contextmanager
def broken(target: Any, name: str, replacement: Any) -> Iterator[None]:
    """``target.name`` replaced for the block (a deliberately broken variant)."""
    original = getattr(target, name)
    setattr(target, name, replacement)
    try:
        yield
    finally:
        setattr(target, name, original)


def state_of(rt: AttentionRuntime, rid: str) -> list[torch.Tensor]:
    """The state tensors of layer ``"mixer"`` for request ``rid`` (copies)."""
    gid = rt._layer_group["mixer"]
    block = rt.manager.block_table(gid, rid)[0]
    return [t[block].clone() for t in rt.kv_caches["mixer"]]
