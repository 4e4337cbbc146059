"""The cache memory: the layer buffers of each buffer set (``attnkit.kv_cache``'s
docstring, "Memory"), how many blocks a budget holds, and the per-layer cache tensors
viewed from the buffers (``allocate_kv_cache_tensors``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, cast

import torch

from .._validation import is_positive_int
from ..capabilities import KVCacheLayout
from ..errors import InvalidArgumentError
from ..spec import AttentionSpec, KVCacheSpec, MambaSpec
from ._groups import _ALIGN, KVCacheGroup, _round_up
from ._pool import NULL_BLOCK

_HUGE_PAGE = 1 << 21
_MADV_HUGEPAGE = 14  # <linux/mman.h>


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` (Linux only), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast("Callable[[int, int, int], int]", fn)


def cache_buffer(nbytes: int, device: torch.device | str) -> torch.Tensor:
    """An uninitialised flat ``uint8`` buffer of ``nbytes`` for KV-cache tensors.

    On a Linux CPU, buffers of at least 2 MB start on a 2 MB boundary and are marked
    ``MADV_HUGEPAGE`` before anything touches them, so that transparent huge pages back
    them where the system allows it (``/sys/kernel/mm/transparent_hugepage/enabled`` set
    to ``madvise`` or ``always``): paged attention reads K/V block by block from all
    over the cache, and 4 KB pages cost a TLB miss every 4 KB (``benchmarks/bench_cpu.py``:
    decode reads K/V about 10% faster on huge pages here). Elsewhere, or if ``madvise``
    fails, a plain ``torch.empty``: the advice is a hint, never a requirement.
    """
    device = torch.device(device)
    madvise = _madvise() if device.type == "cpu" else None
    if madvise is None or nbytes < _HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8, device=device)
    skip = -raw.data_ptr() % _HUGE_PAGE
    buf = raw[skip : skip + nbytes]  # a view: keeps ``raw`` alive
    madvise(buf.data_ptr(), nbytes - nbytes % _HUGE_PAGE, _MADV_HUGEPAGE)
    return buf


BufferSetName = Literal["page_major", "planes"]
"""The set of layer buffers a group's cache views (the package docstring, "Memory")."""


def buffer_set_of(layout: KVCacheLayout) -> BufferSetName:
    """The buffer set of a group whose backend declares ``layout``."""
    return "planes" if layout == "planes" else "page_major"


def buffers_per_set(
    groups: Sequence[KVCacheGroup], layouts: Mapping[int, KVCacheLayout] | None = None
) -> dict[BufferSetName, int]:
    """Layer buffers of each set in use: the most layers of any cached group in it.

    ``layouts`` maps group id -> its backend's layout (absent: ``"interleaved"``).
    Sets no cached group uses are left out, and so are the groups that share an owner's
    block ids: their layers have buffers of their own (``shared_bytes_per_page``).
    """
    counts: dict[BufferSetName, int] = {}
    for group in groups:
        if group.has_cache and group.block_owner is None:
            name = buffer_set_of((layouts or {}).get(group.group_id, "interleaved"))
            counts[name] = max(counts.get(name, 0), len(group.layer_names))
    return counts


def shared_bytes_per_page(groups: Sequence[KVCacheGroup]) -> int:
    """What one page of the pool costs beyond the layer buffers: the tensors of the
    groups that share an owner's block ids (``KVCacheGroup.block_owner``), one kernel
    block of their own page size per kernel block of the owner's page, per layer
    (V3.2: the 61 index caches' 16 x 132 B beside each page of latents)."""
    return sum(
        g.blocks_per_page * g.spec.page_size_bytes * len(g.layer_names)
        for g in groups
        if g.has_cache and g.block_owner is not None
    )


def num_blocks_for_budget(
    groups: Sequence[KVCacheGroup],
    page_size_bytes: int,
    memory_budget_bytes: int,
    layouts: Mapping[int, KVCacheLayout] | None = None,
) -> int:
    """How many blocks (the null block included) fit in ``memory_budget_bytes``.

    Each block costs one page in every layer buffer of every set in use
    (``buffers_per_set``; ``layouts`` as there), and the bytes of the groups sharing
    its block ids (``shared_bytes_per_page``).

    Raises:
        ValueError: if the budget does not hold the null block and one more block.
    """
    if not is_positive_int(memory_budget_bytes):
        raise InvalidArgumentError(
            f"memory_budget_bytes must be a positive int, got {memory_budget_bytes!r}"
        )
    slots = sum(buffers_per_set(groups, layouts).values())
    if slots == 0 or page_size_bytes == 0:
        return 2  # nothing is cached: only the bookkeeping exists
    shared = shared_bytes_per_page(groups)
    per_block = page_size_bytes * slots + shared
    num_blocks = memory_budget_bytes // per_block
    if num_blocks < 2:
        beside = f" + {shared} B of groups sharing its block ids" if shared else ""
        raise InvalidArgumentError(
            f"memory_budget_bytes={memory_budget_bytes} holds {num_blocks} block(s) of "
            f"{per_block} bytes ({slots} layer buffer(s) x page {page_size_bytes} B{beside}); "
            f"at least 2 are needed (the null block and one more), i.e. {2 * per_block} bytes"
        )
    return num_blocks


def allocate_kv_cache_tensors(
    groups: Sequence[KVCacheGroup],
    shapes: Mapping[int, tuple[tuple[int, ...], ...]],
    *,
    num_blocks: int,
    page_size_bytes: int,
    device: torch.device,
    fill: float | None = None,
    layouts: Mapping[int, KVCacheLayout] | None = None,
) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per-layer cache tensors, aliased within each buffer set as the package docstring says.

    Every tensor is a view of a layer buffer (nothing is copied, ever): writing
    through it writes the buffer. A group whose page holds ``k = blocks_per_page``
    kernel blocks sees the same bytes at kernel-block granularity: page-major tensors
    start with ``num_blocks * k`` (kernel block ``p * k + j`` is the ``j``-th ``P / k``
    bytes of page ``p``), and planes with ``num_blocks * k * block_size`` rows.

    Args:
        groups: unified groups.
        shapes: group id -> the shapes its backend declares (``get_kv_cache_shapes``
            for ``num_blocks * blocks_per_page`` kernel blocks); page-major shapes start
            with that count; a planes group declares two shapes (K plane, V plane)
            starting with ``num_blocks * blocks_per_page * block_size``.
        num_blocks, page_size_bytes: the pool's geometry (pages).
        device: where the buffers live.
        fill: a value to fill every tensor with (tests use NaN to catch reads of
            unwritten slots); ``None`` leaves memory uninitialised. Page 0, the null
            page (every kernel block of it), is always zeroed.
        layouts: group id -> its backend's ``kv_cache_layout`` (absent:
            ``"interleaved"``); it picks the group's buffer set.

    Raises:
        ValueError: if a page-major group's tensors do not fit one kernel block's share
            of a page per kernel block, or a planes group's are not two planes whose
            kernel block rows fill half of that share each.
    """
    counts = buffers_per_set(groups, layouts)
    buffers = [
        cache_buffer(num_blocks * page_size_bytes, device).view(num_blocks, page_size_bytes)
        for _ in range(counts.get("page_major", 0))
    ]
    # Planes set: flat buffers, K plane = first half, V plane = second half.
    plane_buffers = [
        cache_buffer(num_blocks * page_size_bytes, device) for _ in range(counts.get("planes", 0))
    ]
    caches: dict[str, tuple[torch.Tensor, ...]] = {}
    own: list[torch.Tensor] = []  # the null rows of the sharing groups' own buffers
    for group in groups:
        group_shapes = shapes.get(group.group_id, ())
        layout = (layouts or {}).get(group.group_id, "interleaved")
        dtypes = _tensor_dtypes(group.spec, len(group_shapes), layout)
        if (
            group.block_owner is not None
            and group.has_cache
            and buffer_set_of(layout) != "page_major"
        ):
            raise InvalidArgumentError(
                f"group {group.group_id} ({group.kind.value}) shares the block ids of group "
                f"{group.block_owner}: its backend must declare the interleaved layout, got "
                f"{layout!r}"
            )
        if group.has_cache and buffer_set_of(layout) == "planes":
            _check_planes(group, group_shapes, dtypes, num_blocks, page_size_bytes)
            half = num_blocks * page_size_bytes // 2
            for j, layer in enumerate(group.layer_names):
                planes = tuple(
                    plane_buffers[j][i * half : (i + 1) * half].view(dtype).view(shape)
                    for i, (shape, dtype) in enumerate(zip(group_shapes, dtypes, strict=True))
                )
                if fill is not None:
                    for plane in planes:
                        if plane.element_size() == 1 and math.isnan(fill):
                            # Every bit set: NaN in fp8 values and in the float32 scales
                            # of per-token-head rows alike (-1 in int8).
                            plane.view(torch.uint8).fill_(0xFF)
                        else:
                            plane.fill_(fill)
                caches[layer] = planes
            continue
        if not group_shapes:  # no cache (encoder-only layers)
            for layer in group.layer_names:
                caches[layer] = ()
            continue
        per_page = group.blocks_per_page
        kernel_blocks = num_blocks * per_page
        block_bytes = page_size_bytes // per_page
        if group.block_owner is not None:
            # Shared block ids, own page size: the layers' buffers of their own, one
            # kernel block of this group's page per kernel block id of the owner.
            block_bytes = group.spec.page_size_bytes
        offsets: list[int] = []
        offset = 0
        for shape, dtype in zip(group_shapes, dtypes, strict=True):
            if not shape or shape[0] != kernel_blocks:
                expected = (
                    f"num_blocks={num_blocks}"
                    if per_page == 1
                    else f"num_blocks * blocks_per_page = {num_blocks} * {per_page} = "
                    f"{kernel_blocks} (kernel blocks)"
                )
                raise InvalidArgumentError(
                    f"group {group.group_id} ({group.kind.value}): cache shape {shape} must "
                    f"start with {expected}"
                )
            offset = _round_up(offset, _ALIGN)
            offsets.append(offset)
            offset += math.prod(shape[1:]) * dtype.itemsize
        if offset > block_bytes:
            where = (
                f"pages are {page_size_bytes} bytes"
                if per_page == 1
                else f"kernel blocks are {block_bytes} bytes ({per_page} per page of "
                f"{page_size_bytes} bytes)"
            )
            raise InvalidArgumentError(
                f"group {group.group_id} ({group.kind.value}) needs {offset} bytes per "
                f"{'block' if per_page == 1 else 'kernel block'} but {where}"
            )
        for j, layer in enumerate(group.layer_names):
            if group.block_owner is not None:
                rows = cache_buffer(kernel_blocks * block_bytes, device).view(
                    kernel_blocks, block_bytes
                )
                own.append(rows[:per_page])  # the null page's kernel blocks
            else:
                # The same bytes as the page-major [num_blocks, P] buffer, one row per
                # kernel block (P is a multiple of the group's block bytes).
                rows = buffers[j].view(kernel_blocks, block_bytes)
            tensors: list[torch.Tensor] = []
            for shape, dtype, start in zip(group_shapes, dtypes, offsets, strict=True):
                nbytes = math.prod(shape[1:]) * dtype.itemsize
                view = rows[:, start : start + nbytes].view(dtype).view(shape)
                if fill is not None and not dtype.is_floating_point:
                    # A byte-format cache (the fp8 index rows): every bit set, which is
                    # NaN in its fp8 values and its float32 scales alike.
                    view.fill_(-1 if dtype.is_signed else torch.iinfo(dtype).max)
                elif fill is not None:
                    view.fill_(fill)
                tensors.append(view)
            caches[layer] = tuple(tensors)
    # The null page pads block tables and stands for released window blocks; kernels
    # that load whole tiles may touch it, so it must hold finite zeros (after any fill).
    for buffer in buffers:
        buffer[NULL_BLOCK].zero_()
    for null_rows in own:
        null_rows.zero_()
    half_page, half = page_size_bytes // 2, num_blocks * page_size_bytes // 2
    for buffer in plane_buffers:  # the null page's K rows and V rows
        buffer[NULL_BLOCK * half_page : (NULL_BLOCK + 1) * half_page].zero_()
        buffer[half + NULL_BLOCK * half_page : half + (NULL_BLOCK + 1) * half_page].zero_()
    return caches


def _check_planes(
    group: KVCacheGroup,
    group_shapes: tuple[tuple[int, ...], ...],
    dtypes: tuple[torch.dtype, ...],
    num_blocks: int,
    page_size_bytes: int,
) -> None:
    """A planes group declares a K and a V plane, token-major, whose page rows
    (``blocks_per_page`` kernel blocks) fill exactly half a page: then page ``c``'s rows
    sit at the same bytes in every planes group, and page ownership keeps the groups
    apart."""
    where = f"group {group.group_id} ({group.kind.value}, planes layout)"
    if len(group_shapes) != 2:
        raise InvalidArgumentError(
            f"{where}: needs two cache tensors (the K and V planes), got {len(group_shapes)}"
        )
    block_size = group.page_tokens
    rows = num_blocks * block_size
    per_page = group.blocks_per_page
    for shape, dtype in zip(group_shapes, dtypes, strict=True):
        if not shape or shape[0] != rows:
            counted = (
                f"num_blocks * block_size = {num_blocks} * {block_size}"
                if per_page == 1
                else f"num_blocks * blocks_per_page * block_size = {num_blocks} * "
                f"{per_page} * {group.spec.block_size}"
            )
            raise InvalidArgumentError(
                f"{where}: plane shape {shape} must start with {counted} = {rows}"
            )
        block_bytes = block_size * math.prod(shape[1:]) * dtype.itemsize
        if 2 * block_bytes != page_size_bytes:
            what = "a block's rows" if per_page == 1 else "a page's rows"
            raise InvalidArgumentError(
                f"{where}: {what} of plane {shape} take {block_bytes} bytes but must "
                f"fill half a page ({page_size_bytes} / 2 = {page_size_bytes / 2:g} bytes)"
            )


def _tensor_dtypes(
    spec: KVCacheSpec, count: int, layout: KVCacheLayout = "interleaved"
) -> tuple[torch.dtype, ...]:
    if isinstance(spec, MambaSpec):
        if count != len(spec.dtypes):
            raise InvalidArgumentError(
                f"a Mamba layer declares {len(spec.dtypes)} state dtypes but its backend "
                f"declares {count} cache tensors"
            )
        return spec.dtypes
    if isinstance(spec, AttentionSpec):
        if spec.dynamic_kv_scales and count == 2 and layout != "planes":
            return (spec.cache_torch_dtype, torch.float32)  # the values, their scales
        return (spec.cache_torch_dtype,) * count
    raise TypeError(f"no cache dtype rule for {type(spec).__name__}")
