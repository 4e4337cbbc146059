"""What a layer call may change, checked after every ``forward`` of the backend under test.

A backend's ``forward`` writes its output and, in the layer's cache, the step's slots
(``slot_mapping``), the sink slots of requests in their first step and, if it likes,
the slots past each request's length in its last block (kernels may zero them); a
state layer writes the state blocks of the step's requests. Everything else stays as
it was: the inputs (query, key, value or the state inputs), the step's
``CommonAttentionMetadata`` (every layer of the group reads it) and every other cache
slot. ``Guard`` copies what it checks before the call (the kit's tensors are small) and
compares bit for bit afterwards, NaN included.

Letters: NB kernel blocks, BS block size, Hkv KV heads, D head size. Cache tensors by
layout: interleaved ``[NB, 2, BS, Hkv, D]``, planes ``[NB * BS, Hkv, D]`` (K and V),
latent ``[NB, BS, D]``, states ``[NB, *shape]``. A tensor of another shape (a backend's
own ``get_kv_cache_shapes``) is checked per block when it starts with ``NB``, per slot
when it starts with ``NB * BS``, and not at all otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import torch

from ..capabilities import KVCacheLayout
from ..metadata import CommonAttentionMetadata

__all__ = ["CacheGeometry", "Guard", "compare_runs", "write_slots"]

Unit = Literal["slot", "block"]


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """How one layer's cache tensors map to slots and blocks.

    Attributes:
        num_blocks: NB, the layer's kernel blocks (the pool's pages times the blocks a
            page holds; block 0, the null block, included).
        block_size: BS, the group's block size.
        layout: the backend's ``kv_cache_layout``.
        latent: one latent per token (MLA): ``[NB, BS, D]``.
        state: a state layer: one state per block, ``[NB, *shape]``.
        default_shapes: the kind's own shapes of the cache (``KindRules.cache_shapes``).
    """

    num_blocks: int
    block_size: int
    layout: KVCacheLayout
    latent: bool
    state: bool
    default_shapes: tuple[tuple[int, ...], ...]

    def changed(
        self, before: torch.Tensor, after: torch.Tensor, index: int
    ) -> tuple[torch.Tensor, Unit] | None:
        """bool ``[units]``: which slots (or blocks) of cache tensor ``index`` changed;
        ``None``: the kit cannot tell which of its parts belong to which slot."""
        nb, bs = self.num_blocks, self.block_size
        default = index < len(self.default_shapes) and tuple(after.shape) == self.default_shapes[index]
        if self.state:
            return (_differs(before, after).reshape(nb, -1).any(1), "block") if after.shape[0] == nb else None
        if default and self.layout == "interleaved" and not self.latent:
            # [NB, 2, BS, Hkv, D]: a slot is [b, :, offset], its K and V.
            differs = _differs(before, after).reshape(nb, 2, bs, -1).any(3).any(1)
            return differs.reshape(nb * bs), "slot"
        if default or after.shape[0] == nb * bs:
            return _differs(before, after).reshape(nb * bs, -1).any(1), "slot"
        if after.shape[0] == nb:
            return _differs(before, after).reshape(nb, -1).any(1), "block"
        return None


def _differs(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """bool, per byte of the last dimension: where the bits differ (NaN equals NaN)."""
    if not after.numel():
        return torch.zeros(after.shape, dtype=torch.bool)
    if after.stride(-1) != 1:  # a byte view needs a unit-stride last dimension
        after = after.contiguous()
    return before.contiguous().view(torch.uint8) != after.view(torch.uint8)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as bytes, one row per leading index (NaN compares equal to itself)."""
    rows = t.shape[0] if t.dim() else 1
    if not t.numel():
        return torch.zeros(rows, 0, dtype=torch.uint8)
    return t.detach().reshape(rows, -1).contiguous().view(torch.uint8)


def _changed_rows(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """bool ``[rows]``: which rows' bits differ."""
    return (_bytes(before) != _bytes(after)).any(dim=1)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))


def _writable(cm: CommonAttentionMetadata, geometry: CacheGeometry) -> np.ndarray:
    """bool ``[NB * BS]`` (attention) or ``[NB]`` (state): what the step may write."""
    nb, bs = geometry.num_blocks, geometry.block_size
    table = cm.block_table_tensor.cpu().numpy()
    if geometry.state:
        blocks = np.zeros(nb, dtype=bool)
        blocks[table[table > 0]] = True
        return blocks
    slots = np.zeros(nb * bs, dtype=bool)
    mapping = cm.slot_mapping.cpu().numpy()
    slots[mapping[mapping >= 0]] = True
    seq = cm.seq_lens_cpu.numpy()
    qlens = cm.query_lens_cpu.numpy()
    computed = cm.num_computed_tokens_cpu
    new = computed.numpy() == 0 if computed is not None else np.zeros(seq.size, dtype=bool)
    if not table.shape[1]:  # no cache (encoder-only)
        return slots
    for b in range(cm.num_reqs):
        length = int(seq[b])
        if length % bs and length:  # the tail of the last block: never written yet
            last = int(table[b, (length - 1) // bs])
            slots[last * bs + length % bs : (last + 1) * bs] = True
        front = length - int(qlens[b])
        if new[b] and front > 0:  # a new request's sink tokens sit in front of it
            pos = np.arange(front)
            slots[table[b, pos // bs].astype(np.int64) * bs + pos % bs] = True
    return slots


class Guard:
    """Copies of what one ``forward`` must leave unchanged, taken before the call."""

    def __init__(
        self,
        *,
        inputs: Mapping[str, torch.Tensor],
        common: CommonAttentionMetadata,
        caches: Sequence[torch.Tensor],
        geometry: CacheGeometry,
    ) -> None:
        self._inputs = {name: (t, t.clone()) for name, t in inputs.items()}
        fields = {f.name: getattr(common, f.name) for f in dataclasses.fields(common)}
        self._metadata = {
            name: (t, t.clone()) for name, t in fields.items() if isinstance(t, torch.Tensor)
        }
        self._common = common
        self._caches = tuple(caches)
        self._before = tuple(c.clone() for c in caches)
        self._geometry = geometry

    def restore_cache(self) -> None:
        """Put the cache back as it was before the call (to run the step again)."""
        for cache, before in zip(self._caches, self._before, strict=True):
            cache.copy_(before)

    def problems(self) -> str | None:
        """What the call changed that it must not have, or ``None``."""
        for name, (now, before) in self._inputs.items():
            if not _same(now, before):
                changed = int(_changed_rows(before, now).sum())
                return (
                    f"forward changed its input {name} in place ({changed} of "
                    f"{now.shape[0]} rows); inputs are the caller's (and the next layer's)"
                )
        moved = [name for name, (now, before) in self._metadata.items() if not _same(now, before)]
        if moved:
            return (
                f"forward changed the step's metadata in place: {', '.join(moved)} "
                f"(CommonAttentionMetadata is read by every layer of the group)"
            )
        return self._outside_writes()

    def _outside_writes(self) -> str | None:
        geometry = self._geometry
        writable = _writable(self._common, geometry)
        for index, (cache, before) in enumerate(zip(self._caches, self._before, strict=True)):
            found = geometry.changed(before, cache, index)
            if found is None:
                continue
            changed, unit = found
            allowed = torch.as_tensor(writable)
            if unit == "block" and not geometry.state:
                allowed = allowed.reshape(geometry.num_blocks, geometry.block_size).any(dim=1)
            bad = torch.nonzero(changed & ~allowed).flatten()
            if bad.numel():
                first = int(bad[0])
                where = (
                    f"slot {first}: block {first // geometry.block_size}, offset "
                    f"{first % geometry.block_size}"
                    if unit == "slot"
                    else f"block {first}"
                )
                what = "the step's state blocks" if geometry.state else "the step's slots"
                return (
                    f"forward changed {bad.numel()} cache {unit}(s) of kv_cache[{index}] outside "
                    f"{what} (e.g. {where}); slot_mapping names the slots a step writes"
                )
        return None


def compare_runs(
    first: torch.Tensor,
    second: torch.Tensor,
    first_caches: Sequence[torch.Tensor],
    second_caches: Sequence[torch.Tensor],
) -> str | None:
    """``None`` when two runs of one call agree bit for bit (output and cache)."""
    if not _same(first, second):
        differ = _bytes(first) != _bytes(second)
        err = (first.double() - second.double()).abs().nan_to_num(float("inf")).max().item()
        return (
            f"not deterministic: the same call run twice on the same inputs and cache gave "
            f"outputs whose bits differ in {int(differ.any(1).sum())} of {first.shape[0]} "
            f"rows (max abs difference {err:.3g})"
        )
    for index, (a, b) in enumerate(zip(first_caches, second_caches, strict=True)):
        if not _same(a, b):
            return (
                f"not deterministic: the same call run twice on the same inputs and cache "
                f"left kv_cache[{index}] with different bits"
            )
    return None


def write_slots(
    caches: Sequence[torch.Tensor],
    geometry: CacheGeometry,
    slots: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
) -> bool:
    """Write ``key`` (and ``value``) ``[n, Hkv, D]`` (latent: ``key`` ``[n, 1, D]``) at
    ``slots`` of a cache in the kind's own shapes; ``False`` (nothing written) when the
    cache has other shapes."""
    shapes = tuple(tuple(c.shape) for c in caches)
    if geometry.state or shapes != geometry.default_shapes:
        return False
    bs = geometry.block_size
    blocks, offsets = slots // bs, slots % bs
    if geometry.latent:
        caches[0][blocks, offsets] = key[:, 0].to(caches[0].dtype)
    elif geometry.layout == "planes":
        assert value is not None
        caches[0][slots] = key.to(caches[0].dtype)
        caches[1][slots] = value.to(caches[1].dtype)
    else:
        assert value is not None
        caches[0][blocks, 0, offsets] = key.to(caches[0].dtype)
        caches[0][blocks, 1, offsets] = value.to(caches[0].dtype)
    return True
