"""``AttentionRuntime``'s prefix-caching part: ``match_prefix``, ``discard_step``,
``reset_prefix_cache``, ``prefix_cache_stats``, and each group's namespace
(docs/prefix-caching.md, "The runtime")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from ..capabilities import KVCacheLayout
from ..errors import InvalidArgumentError
from ..kv_cache import KVCacheGroup, PrefixMatch, buffer_set_of
from ..params import AttentionLayerParams, LayerParams
from ..prefix_cache import (
    HashName,
    MultimodalInput,
    PrefixCacheStats,
    Tokens,
    group_namespace,
)
from ._base import RuntimeBase
from ._pages import (
    GroupPages,
    PageDescriptors,
    describe_tensors,
    page_sharing,
    scale_descriptors,
)

_OFF = (
    "prefix caching is off: build the runtime with "
    "AttentionConfig(prefix_caching={'enabled': True})"
)


class PrefixCalls(RuntimeBase):
    """``AttentionRuntime``'s prefix-caching calls."""

    def match_prefix(
        self,
        prompt_token_ids: Tokens,
        *,
        cache_salt: str | None = None,
        adapter_id: str | int | None = None,
        mm_inputs: Iterable[MultimodalInput | tuple[int, int, str | bytes]] = (),
    ) -> PrefixMatch:
        """Look a new request's prompt up in the prefix cache: how many of its tokens
        can start as computed (``match.num_tokens``), each group's own hit, and why the
        hit is not longer (``match.explain()``). Nothing changes but the counters (and
        the last step's blocks get their names first). Schedule the request with
        ``ScheduledRequest(req_id, len(prompt) - match.num_tokens, prefix=match)`` (or
        a first chunk of that).

        Args:
            prompt_token_ids: the prompt (a list of ints or an integer array).
            cache_salt: requests share blocks only with the same salt (a tenant's).
            adapter_id: the LoRA adapter (or other weight variant) the request runs.
            mm_inputs: ``(start, end, mm_hash)`` per multimodal input: the prompt
                positions its placeholder tokens fill and the hash of its content.

        Raises:
            InvalidArgumentError: prefix caching is off, or an argument out of range
                (an empty prompt, a token id outside uint32, a bad multimodal range).
            ArgumentTypeError: an argument of the wrong type.
        """
        prefix = self.manager.prefix
        if prefix is None:
            raise InvalidArgumentError(f"match_prefix: {_OFF}")
        return prefix.match(
            prompt_token_ids, cache_salt=cache_salt, adapter_id=adapter_id, mm_inputs=mm_inputs
        )

    @property
    def checkpoint_interval(self) -> int | None:
        """The tokens between state checkpoint boundaries, or ``None`` when no state
        layer keeps checkpoints (prefix caching off, ``state_checkpoints="none"``, or
        no state layers). A step whose end lands on a boundary within a prompt leaves
        a checkpoint, so an engine ends prefill chunks on boundaries."""
        prefix = self.manager.prefix
        return None if prefix is None else prefix.checkpoint_interval

    def discard_step(self) -> None:
        """The model call of the last ``begin_step`` failed (or never ran): none of the
        blocks it would have filled gets a name, and its requests' blocks are never
        named again (their cache holds whatever the failed call wrote: free or preempt
        them). Call it before the next ``match_prefix``, ``begin_step`` or ``free``,
        which name the last step's blocks. A no-op with prefix caching off."""
        prefix = self.manager.prefix
        if prefix is not None:
            prefix.discard()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (the weights changed, e.g. in an RL loop): no
        later lookup hits anything cached before, blocks in use stay in use, and the
        requests live now are never named again. Counters are kept. Returns the blocks
        that lost their name (0 with prefix caching off)."""
        prefix = self.manager.prefix
        if self._offloader is not None:
            self._offloader.bump_epoch()  # pages saved before never load again
        return 0 if prefix is None else prefix.reset()

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Lookups, their prompt tokens, hits, tokens served and evictions so far, with
        the blocks cached now (all zero with prefix caching off)."""
        prefix = self.manager.prefix
        return PrefixCacheStats() if prefix is None else prefix.stats()

    def page_descriptors(self) -> PageDescriptors:
        """Where every group's kernel blocks are, byte for byte, and how their canonical
        page ids are made (docs/offload.md): per group its layout, each layer's cache
        tensors (shape, strides, dtype, rows per block, token offsets), the scales the
        bytes are stored under, the namespace and whether the pages are replicated over
        the tensor-parallel ranks (``tensor_parallel``; rank-private otherwise)."""
        manager = self.manager
        groups: list[GroupPages] = []
        for entry in self._groups:
            group = entry.group
            if not group.has_cache or group.block_owner is not None:
                continue  # (a group sharing an owner's block ids is in the owner's pages)
            gid = group.group_id
            rules = self._rules_of[gid]
            nb = self.num_blocks * group.blocks_per_page
            tensors, page_bytes = describe_tensors(
                self._block_layers(gid),
                self.kv_caches,
                num_kernel_blocks=nb,
                block_size=group.spec.block_size,
                layout=self.layouts[gid],
                state=rules.prefix_unit == "length",
            )
            keeper = (
                None
                if manager.prefix is None
                else manager.cached_slabs[gid] or manager.checkpoint_stores[gid]
            )
            groups.append(
                GroupPages(
                    group_id=gid,
                    kind=group.kind,
                    layout=self.layouts[gid],
                    buffer_set=buffer_set_of(self.layouts[gid]),
                    block_size=group.spec.block_size,
                    blocks_per_page=group.blocks_per_page,
                    num_kernel_blocks=nb,
                    page_bytes=page_bytes,
                    layers=self._block_layers(gid),
                    tensors=tensors,
                    scales=tuple(
                        s
                        for name in self._block_layers(gid)
                        for s in scale_descriptors(name, self.layer_params[name])
                    ),
                    namespace=None if keeper is None else keeper.namespace,
                    sharing=page_sharing(
                        group.spec, self.tensor_parallel, context_sharded=gid in self._sharded
                    ),
                    checkpoints=manager.checkpoint_stores[gid] is not None,
                    sharing_groups=tuple(
                        e.group.group_id for e in self._groups if e.group.block_owner == gid
                    ),
                )
            )
        return PageDescriptors(
            num_pages=self.num_blocks,
            page_size_bytes=self.page_size_bytes,
            groups=tuple(groups),
            tensor_parallel=self.tensor_parallel,
        )

    def request_pages(self, req_id: str) -> tuple[tuple[tuple[int, bytes | None], ...], ...]:
        """``req_id``'s kernel blocks per group (group order; ``()`` for a group with no
        table), each with its canonical page id while the block holds a name, else
        ``None`` (a block still filling, or prefix caching off).

        Raises:
            UnknownRequestError: an unknown request.
        """
        manager = self.manager
        prefix = manager.prefix
        if prefix is not None and prefix.needs_flush:
            prefix.flush()
        descriptors = self.page_descriptors()
        by_gid = {g.group_id: g for g in descriptors.groups}
        epoch = 0 if self._offloader is None else self._offloader.epoch
        out: list[tuple[tuple[int, bytes | None], ...]] = []
        for entry in self._groups:
            gid = self._table_group[entry.group.group_id]  # a sharing group: its owner's
            table = manager.block_table(gid, req_id)
            slab = manager.cached_slabs[gid]
            pages = by_gid.get(gid)
            row: list[tuple[int, bytes | None]] = []
            for block in table:
                name = None if slab is None else slab.name_of.get(block)
                pid = (
                    None
                    if name is None or pages is None or pages.namespace is None
                    else pages.page_id(name, epoch=epoch)
                )
                row.append((block, pid))
            out.append(tuple(row))
        return tuple(out)


def group_namespaces(
    groups: Sequence[KVCacheGroup],
    layer_params: Mapping[str, LayerParams | None],
    layouts: Mapping[int, KVCacheLayout],
    *,
    revision: str,
    hash_name: HashName,
) -> list[bytes]:
    """Each group's namespace: its spec, layout, the revision, the hash, and its layers'
    K/V scales and sink K/V (whatever changes the bytes a block holds). A group whose
    block ids others share (``KVCacheGroup.block_owner``) names blocks that hold their
    bytes too, so its namespace is its own followed by each of theirs (digests of one
    length: the concatenation is unambiguous), and a hit is a hit for all of them."""
    out: list[bytes] = []
    for group in groups:
        params = [layer_params[name] for name in group.layer_names]
        attention = [p for p in params if isinstance(p, AttentionLayerParams)]
        sinks = [p for p in attention if p.sink_key is not None and p.sink_value is not None]
        sink_keys: list[torch.Tensor] = [p.sink_key for p in sinks if p.sink_key is not None]
        sink_values: list[torch.Tensor] = [p.sink_value for p in sinks if p.sink_value is not None]
        out.append(
            group_namespace(
                group.spec,
                revision=revision,
                layout=layouts[group.group_id],
                hash_name=hash_name,
                k_scales=[_scale_value(p.k_scale) for p in attention],
                v_scales=[_scale_value(p.v_scale) for p in attention],
                sink_keys=sink_keys,
                sink_values=sink_values,
            )
        )
    for group in groups:
        if group.block_owner is not None:
            out[group.block_owner] += out[group.group_id]
    return out


def _scale_value(scale: float | tuple[float, ...]) -> float | torch.Tensor:
    """A layer's K or V scale as the namespace hashes it (per-head scales as a tensor)."""
    return torch.tensor(scale, dtype=torch.float64) if isinstance(scale, tuple) else scale
