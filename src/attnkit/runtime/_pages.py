"""Page descriptors: where each kernel block's bytes are, per layer and group, and the
canonical, parallelism-agnostic id of a named block (docs/offload.md).

A **page** here is one kernel block of one group over all the group's layers: the
bytes a connector moves. Every cache tensor of a layer is indexed by kernel block on
dim 0 (``rows_per_block`` rows each: 1 page-major, ``block_size`` for a plane), so
block ``b``'s bytes in a tensor are rows ``[b * r, (b + 1) * r)``, contiguous; the
page's bytes are those ranges of every tensor of every layer, in layer order then
tensor order (``GroupPages.tensors``' order).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Literal

import torch

from .._validation import is_nonnegative_int, is_positive_int
from ..capabilities import KVCacheLayout
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..kinds import rules_for
from ..spec import KVCacheSpec, KVCacheSpecKind

__all__ = [
    "CacheTensorPages",
    "GroupPages",
    "PageDescriptors",
    "PageSharing",
    "ScaleDescriptor",
    "TensorParallelRank",
    "canonical_page_id",
]

PAGE_FORMAT = b"attnkit-page-v1"
"""The canonical page id's format tag (bumped if the page byte order changes)."""

TensorRole = Literal["kv", "k", "v", "token_rows", "state", "other"]


@dataclasses.dataclass(frozen=True)
class TensorParallelRank:
    """This process's place in a tensor-parallel group, for canonical page ids.

    Attributes:
        rank, world_size: the rank and the group's size.
        kv_replicas: ranks that hold each K/V head (``TensorSplit.kv_replicas`` from
            ``plan``: above 1 when the model has fewer K/V heads than ranks); ranks
            ``r`` with equal ``r // kv_replicas`` hold the same heads. Latent (MLA) and
            index caches are replicated on every rank whatever this says.
    """

    rank: int
    world_size: int
    kv_replicas: int = 1

    def __post_init__(self) -> None:
        if not is_positive_int(self.world_size):
            raise InvalidArgumentError(
                f"tensor_parallel.world_size must be a positive int, got {self.world_size!r}"
            )
        if not is_nonnegative_int(self.rank) or self.rank >= self.world_size:
            raise InvalidArgumentError(
                f"tensor_parallel.rank must be an int in 0..{self.world_size - 1}, got "
                f"{self.rank!r}"
            )
        if not is_positive_int(self.kv_replicas) or self.world_size % self.kv_replicas:
            raise InvalidArgumentError(
                f"tensor_parallel.kv_replicas must be a positive divisor of world_size="
                f"{self.world_size}, got {self.kv_replicas!r}"
            )


@dataclasses.dataclass(frozen=True)
class PageSharing:
    """Whether a group's pages are the same bytes on other ranks.

    Attributes:
        replicated: every rank of the page's replica set holds the same bytes for the
            same tokens, and they share one canonical id.
        shard, num_shards: which shard of the tensor-parallel split the page's bytes
            are (0 of 1 when replicated on every rank); in the canonical id when
            ``num_shards > 1``.
        replicas: ranks holding each shard; ``replica_index``: this rank among them.
        reason: why, in words.
    """

    replicated: bool
    shard: int
    num_shards: int
    replicas: int
    replica_index: int
    reason: str

    @property
    def parallelism_agnostic(self) -> bool:
        """The id does not depend on the parallel layout: one shard, every rank."""
        return self.replicated and self.num_shards == 1

    def writer(self, page_id: bytes) -> int:
        """The replica (``0..replicas - 1``) that writes ``page_id`` to a shared store,
        spread over the replicas by id; the others only read."""
        return int.from_bytes(page_id[:4], "little") % self.replicas

    def tag(self) -> bytes:
        """What the canonical id adds for this sharing (nothing when agnostic)."""
        if self.num_shards == 1:
            return b""
        return b"shard" + self.shard.to_bytes(4, "little") + self.num_shards.to_bytes(4, "little")


@dataclasses.dataclass(frozen=True)
class ScaleDescriptor:
    """A scale the bytes of a layer's pages are stored under (fp8 caches).

    Attributes:
        layer, name: the layer and the scale (``"k_scale"``, ``"v_scale"``).
        shape: ``()`` for a per-tensor scale, else the scale tensor's shape (per head).
        dtype: ``"float"`` for a Python float, else the tensor's dtype.
        in_page: whether the scale's bytes travel with each page (``False``: a layer
            parameter, part of the group's namespace, so of every canonical id).
    """

    layer: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    in_page: bool = False


@dataclasses.dataclass(frozen=True)
class CacheTensorPages:
    """One cache tensor of one layer, as pages.

    Attributes:
        layer, index: the layer and the tensor's place in ``runtime.kv_caches[layer]``.
        role: what it holds: ``"kv"`` (K and V interleaved, ``[NB*k, 2, BS, Hkv, D]``),
            ``"k"`` / ``"v"`` (planes ``[NB*k*BS, Hkv, D]``; ``D + 4`` bytes a head with
            per-token-head scales, each head's scale after its values), ``"token_rows"`` (one row
            per token, ``[NB*k, BS, W]``: MLA latents, DSA index keys), ``"state"`` (a
            state layer's tensors).
        shape, strides: in elements; ``dtype``: its dtype's name; ``itemsize``: bytes.
        rows_per_block: dim-0 rows of one kernel block.
        block_bytes: one kernel block's bytes in this tensor (contiguous).
        block_stride_bytes: from one kernel block's bytes to the next (above
            ``block_bytes`` where the pool pads a state to its page).
        token_dim: the dim that indexes a token within its block (``None``: a state).
        offset_in_page: where this tensor's share starts in a page's bytes.
    """

    layer: str
    index: int
    role: TensorRole
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    itemsize: int
    rows_per_block: int
    block_bytes: int
    block_stride_bytes: int
    token_dim: int | None
    offset_in_page: int

    def block_byte_range(self, block_id: int) -> tuple[int, int]:
        """Bytes ``[start, end)`` of kernel block ``block_id`` from the tensor's start."""
        start = block_id * self.block_stride_bytes
        return start, start + self.block_bytes

    def token_byte_offset(self, block_id: int, token: int) -> int:
        """The first byte of token ``token`` (0-based within the block) of kernel block
        ``block_id``, from the tensor's start (a ``"kv"`` tensor: its K row; its V row
        is ``strides[1] * itemsize`` further).

        Raises:
            InvalidArgumentError: a state tensor (no tokens), or a token outside the
                block.
        """
        if self.token_dim is None:
            raise InvalidArgumentError(
                f"token_byte_offset: {self.layer!r} tensor {self.index} holds a state, not tokens"
            )
        rows = self.shape[self.token_dim] if self.token_dim else self.rows_per_block
        if not is_nonnegative_int(token) or token >= rows:
            raise InvalidArgumentError(
                f"token must be an int in 0..{rows - 1} (a token within the block), got {token!r}"
            )
        if self.token_dim == 0:  # a plane: row = slot
            return (block_id * self.rows_per_block + token) * self.strides[0] * self.itemsize
        return (block_id * self.strides[0] + token * self.strides[self.token_dim]) * self.itemsize


@dataclasses.dataclass(frozen=True)
class GroupPages:
    """One KV-cache group's pages.

    Attributes:
        group_id, kind: the group.
        layout: its backend's cache layout; ``buffer_set``: the layer buffers it views.
        block_size: tokens per kernel block (a state group's spec value).
        blocks_per_page: kernel blocks per pool page (hybrid models keep their unified
            pages: a connector sees kernel blocks, never a re-allocated cache).
        num_kernel_blocks: kernel block ids run ``0 .. num_kernel_blocks - 1`` (0: null).
        page_bytes: one page's bytes (one kernel block over every layer).
        layers: the group's layers, in order; ``tensors``: their cache tensors in page
            order; ``scales``: the scales their bytes are stored under.
        namespace: the group's prefix-cache namespace (``None``: no names, so no
            canonical ids: prefix caching off, or a kind that never hits).
        sharing: whether its pages are replicated across tensor-parallel ranks.
        checkpoints: a state group's pages are state checkpoints, named by the prefix
            they follow.
        sharing_groups: the groups that share this group's block ids (DeepSeek sparse
            attention's indexer beside its MLA group): their layers and tensors follow
            this group's in ``layers`` and ``tensors``, so a page carries them too, and
            they have no pages of their own.
    """

    group_id: int
    kind: KVCacheSpecKind
    layout: KVCacheLayout
    buffer_set: str
    block_size: int
    blocks_per_page: int
    num_kernel_blocks: int
    page_bytes: int
    layers: tuple[str, ...]
    tensors: tuple[CacheTensorPages, ...]
    scales: tuple[ScaleDescriptor, ...]
    namespace: bytes | None
    sharing: PageSharing
    checkpoints: bool = False
    sharing_groups: tuple[int, ...] = ()

    def page_id(self, name: bytes, *, epoch: int = 0) -> bytes:
        """The canonical id of this group's block named ``name`` (its prefix-cache
        block name, ``PrefixMatch.block_names``).

        Raises:
            InvalidArgumentError: the group has no namespace (no names).
        """
        if self.namespace is None:
            raise InvalidArgumentError(
                f"group {self.group_id} ({self.kind.value}) names no blocks (prefix caching "
                f"is off, or its kind never hits): it has no canonical page ids"
            )
        return canonical_page_id(self.namespace, name, self.sharing, epoch=epoch)


@dataclasses.dataclass(frozen=True)
class PageDescriptors:
    """Every group's pages (``AttentionRuntime.page_descriptors()``).

    Attributes:
        num_pages, page_size_bytes: the pool (null page included).
        groups: one ``GroupPages`` per group with a cache, in group order.
        tensor_parallel: the rank the ids were made for (``None``: one device).
    """

    num_pages: int
    page_size_bytes: int
    groups: tuple[GroupPages, ...]
    tensor_parallel: TensorParallelRank | None = None

    def group(self, group_id: int) -> GroupPages:
        """The pages of group ``group_id`` (of its owner, for a group that shares its
        owner's block ids: ``GroupPages.sharing_groups``).

        Raises:
            InvalidArgumentError: a group without a cache, or an unknown id.
        """
        for g in self.groups:
            if g.group_id == group_id or group_id in g.sharing_groups:
                return g
        raise InvalidArgumentError(
            f"group_id must be one of the groups with a cache "
            f"({[g.group_id for g in self.groups]}), got {group_id!r}"
        )


def canonical_page_id(
    namespace: bytes, name: bytes, sharing: PageSharing, *, epoch: int = 0
) -> bytes:
    """SHA-256 over the format tag, the namespace, the block name, the shard (when the
    split has several) and the reset epoch (when above 0), each length-prefixed."""
    h = hashlib.sha256(PAGE_FORMAT)
    for part in (namespace, name, sharing.tag(), epoch.to_bytes(8, "little") if epoch else b""):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def page_sharing(
    spec: KVCacheSpec,
    tensor_parallel: TensorParallelRank | None,
    *,
    context_sharded: bool = False,
) -> PageSharing:
    """Whether a group's pages are replicated across ranks (fail closed: rank-private
    unless the kind says its bytes are the same on every rank)."""
    if context_sharded:
        return PageSharing(
            False, 0, 1, 1, 0, "context-parallel shard: a rank holds every n-th token"
        )
    if tensor_parallel is None or tensor_parallel.world_size == 1:
        return PageSharing(True, 0, 1, 1, 0, "one rank")
    tp = tensor_parallel
    rules = rules_for(spec)
    if rules.tp_replicated:
        return PageSharing(
            True, 0, 1, tp.world_size, tp.rank, "one latent per token, replicated on every rank"
        )
    if rules.has_cache and rules.prefix_unit == "length":  # a state: its heads are split
        return PageSharing(
            False,
            tp.rank,
            tp.world_size,
            1,
            0,
            "a state layer's heads are split over the ranks: rank-private",
        )
    shards = tp.world_size // tp.kv_replicas
    shard = tp.rank // tp.kv_replicas
    if shards == 1:
        return PageSharing(True, 0, 1, tp.kv_replicas, tp.rank, "every rank holds every K/V head")
    return PageSharing(
        tp.kv_replicas > 1,
        shard,
        shards,
        tp.kv_replicas,
        tp.rank % tp.kv_replicas,
        f"K/V heads split in {shards} shards"
        + (f", each on {tp.kv_replicas} ranks" if tp.kv_replicas > 1 else ": rank-private"),
    )


def block_matrix(tensor: torch.Tensor, num_kernel_blocks: int) -> torch.Tensor | None:
    """``tensor``'s bytes as a ``[num_kernel_blocks, block bytes]`` uint8 view (writes go
    to the cache), or ``None`` when a block's bytes are not one contiguous run: dim 0
    must be a whole number ``r`` of rows per block, each row contiguous, and the rows of
    a block adjacent when ``r > 1`` (a state page padded to the pool's page keeps its
    own dim-0 stride, which is fine with ``r == 1``)."""
    shape = tuple(tensor.shape)
    if not shape or shape[0] % num_kernel_blocks or tensor.numel() == 0:
        return None
    rows = shape[0] // num_kernel_blocks
    row = tensor[0]
    if not row.is_contiguous():
        return None
    row_bytes = row.numel() * tensor.element_size()
    stride_bytes = tensor.stride(0) * tensor.element_size()
    if rows > 1 and stride_bytes != row_bytes:
        return None
    flat = tensor.view(torch.uint8) if tensor.dim() else tensor
    base = flat.storage_offset()
    return flat.as_strided((num_kernel_blocks, rows * row_bytes), (rows * stride_bytes, 1), base)


def describe_tensors(
    layers: tuple[str, ...],
    kv_caches: Mapping[str, tuple[torch.Tensor, ...]],
    *,
    num_kernel_blocks: int,
    block_size: int,
    layout: KVCacheLayout,
    state: bool,
) -> tuple[tuple[CacheTensorPages, ...], int]:
    """Every tensor of ``layers`` as pages, and the page's bytes.

    Raises:
        InvalidArgumentError: a tensor whose dim 0 is not a whole number of rows per
            kernel block, or that is not contiguous (fail closed: no descriptor).
    """
    out: list[CacheTensorPages] = []
    offset = 0
    for layer in layers:
        for index, tensor in enumerate(kv_caches[layer]):
            shape = tuple(tensor.shape)
            matrix = block_matrix(tensor, num_kernel_blocks)
            if matrix is None:
                raise InvalidArgumentError(
                    f"layer {layer!r} cache tensor {index} of shape {shape} (strides "
                    f"{tuple(tensor.stride())}) is not {num_kernel_blocks} kernel blocks of "
                    f"contiguous bytes on dim 0: no page descriptor for it"
                )
            rows = shape[0] // num_kernel_blocks
            role: TensorRole
            token_dim: int | None
            if state:
                role, token_dim = "state", None
            elif layout == "planes":
                role, token_dim = ("k" if index == 0 else "v"), 0
            elif len(shape) == 3:  # [NB*k, BS, W]: MLA latents, DSA index keys
                role, token_dim = "token_rows", 1
            elif len(shape) == 5:
                role, token_dim = "kv", 2
            else:
                role, token_dim = "other", None
            if token_dim and shape[token_dim] != block_size:
                token_dim = None  # not the layout assumed: no token offsets (fail closed)
            nbytes = int(matrix.shape[1])
            out.append(
                CacheTensorPages(
                    layer=layer,
                    index=index,
                    role=role,
                    shape=shape,
                    strides=tuple(tensor.stride()),
                    dtype=str(tensor.dtype).removeprefix("torch."),
                    itemsize=tensor.element_size(),
                    rows_per_block=rows,
                    block_bytes=nbytes,
                    block_stride_bytes=int(matrix.stride(0)),
                    token_dim=token_dim,
                    offset_in_page=offset,
                )
            )
            offset += nbytes
    return tuple(out), offset


def scale_descriptors(layer: str, params: object) -> tuple[ScaleDescriptor, ...]:
    """The K/V scales of an attention layer's parameters (none for other layers)."""
    out: list[ScaleDescriptor] = []
    for name in ("k_scale", "v_scale"):
        value = getattr(params, name, None)
        if isinstance(value, torch.Tensor):
            out.append(
                ScaleDescriptor(
                    layer, name, tuple(value.shape), str(value.dtype).removeprefix("torch.")
                )
            )
        elif isinstance(value, float | int) and not isinstance(value, bool):
            out.append(ScaleDescriptor(layer, name, (), "float"))
    return tuple(out)


def check_tensor_parallel(value: object) -> TensorParallelRank | None:
    if value is not None and not isinstance(value, TensorParallelRank):
        raise ArgumentTypeError(
            f"tensor_parallel must be a TensorParallelRank or None, got {type(value).__name__}"
        )
    return value
