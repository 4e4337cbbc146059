"""The ``cpu_attn`` backend: attention over the paged K/V planes on CPU, through the CPU
engines of ``attnkit.kernels.attention``; the first choice on CPU.

A step's requests with at most ``NATIVE_MAX_QUERY`` queries (decodes, speculative verify
steps) go to the native paged kernel (``cpu_decode``), which reads K and V in place
through the block table; longer runs go to the native blocked prefill (``cpu_prefill``),
which packs their keys once per chunk for many query rows. Nothing is compiled per
shape: the native library ships prebuilt for portable variants (or is compiled once per
machine where none fits), each instruction set's copy picked at run time.
``benchmarks/bench_cpu.py`` measures both engines against a plain read of the same
bytes, SDPA and, where installed, vLLM's CPU attention.

Queries ``[T, Hq, D]``, key/value ``[T, Hkv, D]``, the planes ``[NB * BS, Hkv, D]``
(``attnkit.backends._planes``), output ``[T, Hq, D]``.

Head sizes: 16, every multiple of 16 from 32 to 256, and 512 (tested at each). Per-head sink
logits (``attention_sinks``, gpt-oss) join both engines' softmax denominators. Decode
context parallelism (``context_parallel``): ``forward_partial`` attends a rank's shard
(local key ``j`` at global position ``j * world_size + rank``) with the native kernel,
one work item per query token, and returns the partial's log-sum-exp; a sink logit
joins rank 0's softmax only.

Quantised caches (``kv_cache_dtype``): ``fp8_e4m3`` with a per-tensor or per-K/V-head
scale (``per_head_quant_scales``), ``fp8_e5m2`` per tensor, and the per-token-head
``fp8_e4m3_per_token_head`` / ``int8_per_token_head``, whose planes are
``[NB * BS, Hkv, D + 4]`` (each head's values, then its float32 scale:
``attnkit.backends._planes.PlanesQuant``). The write quantises as the reference backend
does; both engines dequantise each K/V tile into float32 once. A prefill then reads its
keys back from the planes (the stored values), never from the step's rows.

``return_lse`` (``forward_lse``: every query token one work item of the native kernel,
its lse beside its output) on full, sliding-window and chunked-local layers. What the
engines do not serve here, and so is not declared: ``return_lse`` on sink-token,
encoder-only and cross layers, MLA (one latent per token: no planes layout) and state
layers; those layers go to ``reference`` on CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np
import torch
from typing_extensions import override

from ...backend import AttentionBackend, BackendRequest, DraftTreeSupport
from ...binding import bind_each
from ...builder import AttentionMetadataBuilder
from ...capabilities import AttentionFeature, Determinism, KVCacheLayout, MultipleOf, SizeRule
from ...config import MAX_DRAFT_TREE_TOKENS, AttentionConfig
from ...impl import AttentionImpl
from ...kernels._checks import describe
from ...kernels.attention.cpu_decode import PreparedPlanes
from ...kinds import Mask, attention_rules, rules_for
from ...metadata import CommonAttentionMetadata, mm_prefix_key_ends
from ...params import AttentionLayerParams
from ...spec import AttentionSpec, KVCacheDType, KVCacheSpecKind
from .._planes import (
    NO_WRITES,
    Ints,
    PlanesQuant,
    PlanesWrites,
    check_causal,
    check_planes,
    check_step_lengths,
    from_numpy,
    layer_problems,
    step_writes,
    write_planes,
)

__all__ = [
    "NATIVE_MAX_QUERY",
    "CpuAttentionBackend",
    "CpuAttentionImpl",
    "CpuAttentionMetadata",
    "CpuAttentionMetadataBuilder",
    "DraftTreeRows",
    "draft_tree_rows",
]

_NAME = "cpu_attn"
_FEATURES = frozenset(
    {
        AttentionFeature.LOGITS_SOFT_CAP,
        AttentionFeature.ALIBI,
        AttentionFeature.ATTENTION_SINKS,
        AttentionFeature.PER_HEAD_QUANT_SCALES,
        AttentionFeature.RETURN_LSE,
    }
)


def _serves_lse(spec: AttentionSpec) -> bool:
    """Whether ``forward_lse`` serves the kind, from its rules: causal attention over the
    step's own K/V with no sink tokens, so each row's keys are one contiguous run (full,
    sliding-window, chunked-local). Sink-token, encoder-only and cross layers with
    ``return_lse`` go to reference."""
    rules = rules_for(spec)
    mask = rules.mask(spec)
    return rules.has_cache and rules.writes == "step" and mask.causal and not mask.sink_len


_KV_CACHE_DTYPES: frozenset[KVCacheDType] = frozenset(
    {"auto", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3_per_token_head", "int8_per_token_head"}
)
# Not layer parameters (the runtime asks context_parallel of sharded groups, a spec with
# mm_prefix asks mm_prefix): declared, never checked against AttentionLayerParams.
_BACKEND_FEATURES = _FEATURES | {AttentionFeature.CONTEXT_PARALLEL, AttentionFeature.MM_PREFIX}
# The head and block sizes the engines are tested at (tests/kernels/test_cpu_*.py: every
# one of them against a float64 oracle). The kernels themselves take any head size
# (float32 rows of a size not a multiple of 16 go through a float32 buffer) and any block
# size; declaring more needs tests at those sizes.
_HEAD_SIZES: SizeRule = (16, *range(32, 257, 16), 512)  # 512: Gemma 4's full layers
_BLOCK_SIZES: SizeRule = (MultipleOf(16),)
NATIVE_MAX_QUERY = 8
"""Requests with at most this many queries (decodes, verify steps of up to 7 drafts) go
to the native paged kernel, which (bf16 on AVX512-BF16 or AMX) reads each key once for
all of a request's rows; longer runs go to blocked matrix products, which gather the
keys once."""
_NO_INTS: Ints = np.zeros(0, dtype=np.int64)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False, slots=True)
class _Split:
    """A step's split between the engines, made by the first group's builder and
    shared by the step's other groups (``CommonAttentionMetadata.step_id``): the step
    it belongs to (its id and its offsets and lengths tensors, held so their identity
    stays theirs), what it was made for, and the host arrays ``_metadata`` takes. A
    later step with the same offsets (values) takes its shares with its own lengths."""

    step_id: int | None
    qsl_cpu: torch.Tensor
    seq_cpu: torch.Tensor
    encoder: bool
    sink_len: int
    qsl_bytes: bytes  # the offsets it was made for (int32 bytes), compared with a later step's
    qlens: Ints
    seq: Ints
    served: torch.Tensor | None
    native: bool
    long: Ints
    long_start: Ints
    long_lens: Ints
    long_seq: Ints

    def for_step(self, cm: CommonAttentionMetadata, seq: Ints) -> _Split:
        """This split for a later step with the same offsets: that step's tensors and
        lengths (``seq``), the same shares (made field by field: a third of
        ``dataclasses.replace``'s cost)."""
        return _Split(
            step_id=cm.step_id,
            qsl_cpu=cm.query_start_loc_cpu,
            seq_cpu=cm.seq_lens_cpu,
            encoder=self.encoder,
            sink_len=self.sink_len,
            qsl_bytes=self.qsl_bytes,
            qlens=self.qlens,
            seq=seq,
            served=self.served,
            native=self.native,
            long=self.long,
            long_start=self.long_start,
            long_lens=self.long_lens,
            long_seq=seq[self.long] if self.long.size else _NO_INTS,
        )


_SPLIT: list[_Split | None] = [None]
"""The last split made for a numbered step (one entry: the groups of a step are
built one after the other)."""


def _int32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous int32 tensor (no copy when it is one already)."""
    return t if t.dtype is torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False, slots=True)
class CpuAttentionMetadata:
    """One group's step on the CPU engines.

    Attributes:
        num_actual_tokens: ``T``; rows of ``output`` past it are zeroed.
        kind: the group's kind.
        block_size: the cache block size.
        writes: what the step writes into the planes (nothing for encoder-only).
        block_table: int32 ``[B, W]`` (contiguous rows), or ``None`` (encoder-only:
            no cache).
        query_start_loc, seq_lens: the step's int32 CPU offsets ``[B + 1]`` and lengths
            ``[B]``, as the runtime handed them over: the native kernel plans its work
            items from them (no per-token arrays are built on the host).
        native: whether some request goes to the native kernel.
        native_requests: int32 ``[n]``: the requests it serves (those with at most
            ``NATIVE_MAX_QUERY`` queries), or ``None``: every request of the step.
        prefill_requests, prefill_start, prefill_lens, prefill_seq: the longer runs
            (host arrays): block-table row, first row, query length and sequence
            length of each.
        read_step_kv: requests with ``seq == qlen`` may read their keys/values from the
            step's ``key``/``value`` rows instead of the planes (the same values: every
            token of the step was written); False for cross attention, whose step rows
            are encoder tokens, and when some token was not written.
        shard: ``(rank, world_size)`` of a context-parallel step, else ``None``.
        shard_items: with ``shard``, the native kernel's work items (one per query
            token): rows int64, then requests, key starts, key ends and global query
            positions int32, over the rank's local keys.
        mm_prefix_items: a step with a query inside a bidirectional image range
            (``Mask.mm_prefix``): the native kernel's work items for every query token
            of the step, as ``shard_items`` lays them out, each row's keys the
            contiguous run the rule gives (``mm_prefix_key_ends``); else ``None``.
    """

    num_actual_tokens: int
    kind: KVCacheSpecKind
    block_size: int
    writes: PlanesWrites
    block_table: torch.Tensor | None
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    native: bool
    native_requests: torch.Tensor | None
    prefill_requests: Ints
    prefill_start: Ints
    prefill_lens: Ints
    prefill_seq: Ints
    read_step_kv: bool
    shard: tuple[int, int] | None = None
    shard_items: tuple[torch.Tensor, ...] | None = None
    tree: DraftTreeRows | None = None
    mm_prefix_items: tuple[torch.Tensor, ...] | None = None


def cpu_metadata(who: str, attn_metadata: object) -> CpuAttentionMetadata:
    """``attn_metadata`` checked to be the CPU engines' metadata (a :class:`TypeError`
    naming it otherwise)."""
    if not isinstance(attn_metadata, CpuAttentionMetadata):
        raise TypeError(
            f"{who}: attn_metadata must be CpuAttentionMetadata, got {type(attn_metadata).__name__}"
        )
    return attn_metadata


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class DraftTreeRows:
    """A draft tree step's draft rows, recomputed after the engines ran (the native
    kernel takes one contiguous key range per work item, and a draft's visible keys are
    the context and its ancestors, not a range): each row is split into its runs of
    visible keys, one work item per run with its log-sum-exp, merged per row.

    A draft sits at the root's position plus its depth, not at its slot, so a run also
    keeps its keys' slot-to-position offset constant: its query position is the draft's
    own plus that offset, and the kernel's ALiBi distance (slot minus query position) is
    the distance along the draft's path. Windows and chunks are applied here, in those
    positions, when the runs are cut.

    Attributes:
        queries: int64 ``[N]``: the query row of each item.
        requests, key_start, key_end, query_pos: int32 ``[N]``: the items' block-table
            row, key range and query position (``paged_attention_rows``).
        group: int64 ``[N]``: each item's index in ``out_rows``.
        out_rows: int64 ``[G]``: the draft rows written.
    """

    queries: torch.Tensor
    requests: torch.Tensor
    key_start: torch.Tensor
    key_end: torch.Tensor
    query_pos: torch.Tensor
    group: torch.Tensor
    out_rows: torch.Tensor


def _popcounts(masks: Ints) -> Ints:
    """The bits set in each int64 of ``masks`` (all below bit 63)."""
    bits = np.arange(63, dtype=np.int64)
    counts: Ints = ((masks[:, None] >> bits[None, :]) & 1).sum(axis=1)
    return counts


def draft_tree_rows(
    cm: CommonAttentionMetadata, window: int | None = None, chunk: int | None = None
) -> DraftTreeRows | None:
    """The work items of the step's draft rows under its draft tree (``None``: no tree),
    for a layer with ``window`` / ``chunk`` (``None``: none)."""
    tree = cm.draft_tree
    if tree is None:
        return None
    ends = cm.query_start_loc_cpu.numpy().astype(np.int64)[1:]
    seq = cm.seq_lens_cpu.numpy().astype(np.int64)
    counts = tree.num_drafts_cpu.numpy().astype(np.int64)
    ancestors = tree.ancestors_cpu.numpy()
    items: list[tuple[int, int, int, int, int, int]] = []
    out_rows: list[int] = []
    for b in np.flatnonzero(counts).tolist():
        nd, end = int(counts[b]), int(ends[b])
        first = int(seq[b]) - nd
        masks = ancestors[end - nd : end].astype(np.int64)
        # Draft j's position: the root's (first - 1) plus its depth; its offset is its
        # slot (first + j) minus that position (0 for a chain, and for the context).
        depth = _popcounts(masks).tolist()
        for i in range(nd):
            mask = int(masks[i])
            pos = first - 1 + depth[i]
            lo = 0
            if window is not None:
                lo = max(pos - window + 1, 0)
            elif chunk is not None:
                lo = pos - pos % chunk
            g = len(out_rows)
            out_rows.append(end - nd + i)
            # Visible keys in slot order as (slot, offset): the context's then the
            # ancestors' (and the draft's own) whose positions the window or chunk keeps.
            runs: list[list[int]] = []  # [start slot, end slot, offset]
            if lo < first:
                runs.append([lo, first, 0])
            for j in range(i + 1):
                if not (mask >> j) & 1 or first - 1 + depth[j] < lo:
                    continue
                slot, offset = first + j, j + 1 - depth[j]
                if runs and runs[-1][1] == slot and runs[-1][2] == offset:
                    runs[-1][1] = slot + 1
                else:
                    runs.append([slot, slot + 1, offset])
            for start, stop, offset in runs:
                items.append((end - nd + i, b, start, stop, pos + offset, g))
    arr = np.zeros((len(items), 6), dtype=np.int64)
    for r, item in enumerate(items):
        arr[r] = item
    return DraftTreeRows(
        queries=from_numpy(np.ascontiguousarray(arr[:, 0])),
        requests=from_numpy(arr[:, 1].astype(np.int32)),
        key_start=from_numpy(arr[:, 2].astype(np.int32)),
        key_end=from_numpy(arr[:, 3].astype(np.int32)),
        query_pos=from_numpy(arr[:, 4].astype(np.int32)),
        group=from_numpy(np.ascontiguousarray(arr[:, 5])),
        out_rows=from_numpy(np.array(out_rows, dtype=np.int64)),
    )


class CpuAttentionMetadataBuilder(AttentionMetadataBuilder[CpuAttentionMetadata, AttentionSpec]):
    """Splits each step between the two engines; a decode step (every request with at
    most ``NATIVE_MAX_QUERY`` queries) is handed over as the runtime built it."""

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        spec = kv_cache_spec
        self.kind = spec.kind
        rules = rules_for(spec)
        mask = rules.mask(spec)
        self.mask = mask
        self.causal = mask.causal
        self.sink_len = mask.sink_len
        # No cache (encoder-only): the engines read the step's own keys/values.
        self.encoder = not rules.has_cache
        # The cache holds the encoder's tokens (cross attention), written when given.
        self.encoder_keys = rules.writes == "encoder"
        # From PREFILL_DECODE up every row goes to the native kernel, one work item per
        # query token whatever its request's query length: a row's keys are walked in
        # the same tiles whether it is a decode, a chunk or part of a whole prefill.
        self.rows_native = (
            config.determinism >= Determinism.PREFILL_DECODE
            and not self.encoder
            and not self.sink_len
        )
        self._who = type(self).__name__
        self._block_size = spec.block_size

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> CpuAttentionMetadata:
        cm = common_attn_metadata
        md = self._build(cm)
        if cm.draft_tree is not None:
            md = dataclasses.replace(
                md, tree=draft_tree_rows(cm, self.mask.window, self.mask.chunk)
            )
        return md

    def _build(self, cm: CommonAttentionMetadata) -> CpuAttentionMetadata:
        who = self._who
        check_causal(who, self.kind, self.causal, cm)
        if cm.context_shard is not None:
            return self._build_sharded(cm)
        if self.mask.mm_prefix:
            key_ends = mm_prefix_key_ends(cm)
            if key_ends is not None:
                return self._build_mm_prefix(cm, key_ends)
        if self.rows_native or (
            cm.max_query_len <= NATIVE_MAX_QUERY and not self.encoder and not self.sink_len
        ):
            return self._build_short(cm)
        memo = _SPLIT[0]
        if (
            memo is not None
            and cm.step_id is not None
            and memo.step_id == cm.step_id
            and memo.qsl_cpu is cm.query_start_loc_cpu
            and memo.seq_cpu is cm.seq_lens_cpu
            and memo.encoder == self.encoder
            and memo.sink_len == self.sink_len
        ):
            split = memo  # another group of this step planned it
        else:
            offsets = cm.query_start_loc_cpu.numpy()
            seq = cm.seq_lens_cpu.numpy().astype(np.int64)
            # The last split's offsets again (the steps of a run of the same new tokens):
            # its shares between the engines hold; the lengths are this step's.
            last = (
                memo
                if memo is not None
                and memo.encoder == self.encoder
                and memo.sink_len == self.sink_len
                and offsets.tobytes() == memo.qsl_bytes  # (int32: the runtime's dtype)
                else None
            )
            if last is None:
                qsl = offsets.astype(np.int64)
                qlens = qsl[1:] - qsl[:-1]
            else:
                qsl, qlens = _NO_INTS, last.qlens
            check_step_lengths(
                who, self.kind, encoder=self.encoder, sink_len=self.sink_len, qlens=qlens, seq=seq
            )
            split = self._split(cm, qsl, qlens, seq) if last is None else last.for_step(cm, seq)
            _SPLIT[0] = split
        return self._metadata(
            cm,
            split.seq,
            split.qlens,
            split.served,
            split.native,
            split.long,
            split.long_start,
            split.long_lens,
            split.long_seq,
        )

    def _build_short(self, cm: CommonAttentionMetadata) -> CpuAttentionMetadata:
        """Every request has at most ``NATIVE_MAX_QUERY`` queries (decode steps), or the
        config's determinism puts every row on the native kernel: it takes the whole
        step from the runtime's offsets as they are, so nothing is planned here (no host
        array is touched)."""
        # No sink kind here (sink_len == 0), so the lengths are not read.
        return self._metadata(cm, _NO_INTS, _NO_INTS, None, True, _NO_INTS, _NO_INTS)

    def _build_sharded(self, cm: CommonAttentionMetadata) -> CpuAttentionMetadata:
        """A context-parallel step: every query token is one work item over the rank's
        keys, local key ``j`` sitting at global position ``j * world_size + rank``; a
        query at global position ``P`` sees the local keys ``j <= (P - rank) //
        world_size`` (full causal attention: the sharded kinds have no window)."""
        who = type(self).__name__
        shard = cm.context_shard
        assert shard is not None
        rank, world = shard
        if not self.causal or self.mask.window is not None or self.mask.chunk is not None:
            raise ValueError(
                f"{who}: a context-parallel shard needs full causal attention, got "
                f"{self.kind.value}"
            )
        if cm.global_seq_lens_cpu is None:
            raise ValueError(
                f"{who}: common_attn_metadata.global_seq_lens_cpu must be given with "
                f"context_shard={shard}, got None"
            )
        qsl = cm.query_start_loc_cpu.numpy().astype(np.int64)
        qlens = np.diff(qsl)
        seq = cm.seq_lens_cpu.numpy().astype(np.int64)
        total = cm.global_seq_lens_cpu.numpy().astype(np.int64)
        n = int(qsl[-1])
        req = np.repeat(np.arange(len(qlens)), qlens)
        pos = total[req] - qlens[req] + (np.arange(n) - qsl[:-1][req])
        ends = np.where(pos >= rank, (pos - rank) // world + 1, 0)
        ends = np.minimum(ends, seq[req])
        items = (
            from_numpy(np.arange(n, dtype=np.int64)),
            from_numpy(req.astype(np.int32)),
            from_numpy(np.zeros(n, dtype=np.int32)),
            from_numpy(ends.astype(np.int32)),
            from_numpy(pos.astype(np.int32)),
        )
        md = self._metadata(cm, seq, qlens, None, False, _NO_INTS, _NO_INTS)
        return dataclasses.replace(md, shard=(rank, world), shard_items=items)

    def _build_mm_prefix(self, cm: CommonAttentionMetadata, key_ends: Ints) -> CpuAttentionMetadata:
        """A step where some query sits in an image range: every query token is one work
        item of the native kernel over its contiguous run of keys (the window's first
        key, or 0, up to ``key_ends``), so the blocked prefill's causal tiles are not
        used for the step."""
        qsl = cm.query_start_loc_cpu.numpy().astype(np.int64)
        qlens = np.diff(qsl)
        seq = cm.seq_lens_cpu.numpy().astype(np.int64)
        n = int(qsl[-1])
        req = np.repeat(np.arange(len(qlens)), qlens)
        pos = seq[req] - qlens[req] + (np.arange(n) - qsl[:-1][req])
        window = self.mask.window
        starts = np.maximum(pos - window + 1, 0) if window is not None else np.zeros_like(pos)
        items = (
            from_numpy(np.arange(n, dtype=np.int64)),
            from_numpy(req.astype(np.int32)),
            from_numpy(starts.astype(np.int32)),
            from_numpy(key_ends.astype(np.int32)),
            from_numpy(pos.astype(np.int32)),
        )
        md = self._metadata(cm, seq, qlens, None, False, _NO_INTS, _NO_INTS)
        return dataclasses.replace(md, mm_prefix_items=items)

    def _split(self, cm: CommonAttentionMetadata, qsl: Ints, qlens: Ints, seq: Ints) -> _Split:
        """Split the step between the native kernel (requests with short query runs)
        and the blocked prefill (the rest; everything for encoder-only layers)."""
        if self.encoder:  # every live request goes to the blocked prefill
            is_short = qlens == 0
            long, short = (~is_short).nonzero()[0], is_short.nonzero()[0]
            served = None if len(long) == 0 else from_numpy(short.astype(np.int32))
            native = len(short) > 0
        else:
            long = (qlens > NATIVE_MAX_QUERY).nonzero()[0]
            if long.size:
                short = ((qlens > 0) & (qlens <= NATIVE_MAX_QUERY)).nonzero()[0]
                served, native = from_numpy(short.astype(np.int32)), short.size > 0
            else:  # a sink kind's short step: the native kernel takes every request
                served, native = None, bool(qlens.any())
        if long.size:
            long_start, long_lens, long_seq = qsl[long], qlens[long], seq[long]
        else:
            long = long_start = long_lens = long_seq = _NO_INTS
        return _Split(
            step_id=cm.step_id,
            qsl_cpu=cm.query_start_loc_cpu,
            seq_cpu=cm.seq_lens_cpu,
            encoder=self.encoder,
            sink_len=self.sink_len,
            qsl_bytes=cm.query_start_loc_cpu.numpy().tobytes(),
            qlens=qlens,
            seq=seq,
            served=served,
            native=native,
            long=long,
            long_start=long_start,
            long_lens=long_lens,
            long_seq=long_seq,
        )

    def _metadata(
        self,
        cm: CommonAttentionMetadata,
        seq: Ints,
        qlens: Ints,
        served: torch.Tensor | None,
        native: bool,
        long: Ints,
        long_start: Ints,
        long_lens: Ints = _NO_INTS,
        long_seq: Ints = _NO_INTS,
    ) -> CpuAttentionMetadata:
        table: torch.Tensor | None = None
        writes = NO_WRITES
        block_size = self._block_size
        if not self.encoder:
            table = cm.block_table_tensor
            if table.dtype != torch.int32 or table.stride(-1) != 1:
                table = table.to(torch.int32).contiguous()
            writes = step_writes(
                cm,
                encoder_keys=self.encoder_keys,
                sink_len=self.sink_len,
                block_size=block_size,
                seq=seq,
                qlens=qlens,
            )
        return CpuAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            kind=self.kind,
            block_size=block_size,
            writes=writes,
            block_table=table,
            query_start_loc=_int32(cm.query_start_loc_cpu),
            seq_lens=_int32(cm.seq_lens_cpu),
            native=native,
            native_requests=served,
            prefill_requests=long,
            prefill_start=long_start,
            prefill_lens=long_lens,
            prefill_seq=long_seq,
            read_step_kv=self.encoder or (not self.encoder_keys and writes.rows is None),
        )


class CpuAttentionImpl(AttentionImpl[CpuAttentionMetadata, AttentionSpec, AttentionLayerParams]):
    """Writes the step's K/V into the planes, then runs the native kernel for the short
    query runs and blocked matrix products for the rest.

    Raises at construction (so a bad layer fails before its first step):
        ValueError: ``layer_params`` asks for a feature the backend does not declare,
            or does not fit the spec.
    """

    def __init__(self, kv_cache_spec: AttentionSpec, layer_params: AttentionLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        spec, params = kv_cache_spec, layer_params
        rules = rules_for(spec)
        self._mask: Mask = rules.mask(spec)
        self._has_cache = rules.has_cache
        self._encoder_keys = rules.writes == "encoder"
        problems = layer_problems(
            spec, params, sink_len=self._mask.sink_len, backend=_NAME, features=_FEATURES
        )
        if params.return_lse and not _serves_lse(spec):
            problems.append(_lse_reason(spec.kind))
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
        self.scale: float = params.scale if params.scale is not None else spec.head_size**-0.5
        self._soft_cap = params.logits_soft_cap
        self._slopes = (
            torch.tensor(params.alibi_slopes, dtype=torch.float32)
            if params.alibi_slopes is not None
            else None
        )
        self._sinks = (
            params.sinks.detach().to(device="cpu", dtype=torch.float32).contiguous()
            if params.sinks is not None
            else None
        )
        # A quantised cache: the write quantises as the reference backend does, the
        # engines dequantise per tile (static per-head scales, or each row's own).
        self._quant = PlanesQuant.of(spec, params) if self._has_cache else None
        k_scale, v_scale = (
            self._quant.engine_scales(spec.num_kv_heads) if self._quant else (None, None)
        )
        self._k_scale, self._v_scale = k_scale, v_scale
        # The decode kernel's layer-constant arguments, checked once (prepared again
        # when the planes or the query dtype change).
        self._prepared: PreparedPlanes | None = None

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: CpuAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        spec = self.kv_cache_spec
        who = f"{type(self).__name__}.forward ({spec.kind.value})"
        m = cpu_metadata(who, attn_metadata)
        check_planes(
            who,
            spec,
            key,
            value,
            kv_cache,
            has_cache=self._has_cache,
            encoder_keys=self._encoder_keys,
        )
        if m.shard is not None:
            raise ValueError(
                f"{who}: the group is sharded by context (context_shard={m.shard}); its "
                f"result is partial, call forward_partial"
            )
        n = m.num_actual_tokens
        k_plane: torch.Tensor | None = None
        v_plane: torch.Tensor | None = None
        if kv_cache:
            k_plane, v_plane = kv_cache[0], kv_cache[1]
            write_planes(k_plane, v_plane, key, value, m.writes, self.layer_params, self._quant)
        if n < output.shape[0]:  # padding rows
            output[n:] = 0
        if m.mm_prefix_items is not None:
            assert k_plane is not None
            assert v_plane is not None
            self._attend_rows(query, k_plane, v_plane, m, output, m.mm_prefix_items, self._sinks)
            return output
        causal, window, chunk = self._mask.causal, self._mask.window, self._mask.chunk
        if m.native:
            assert k_plane is not None
            assert v_plane is not None
            assert m.block_table is not None
            prepared = self._prepared
            if prepared is None or not prepared.serves(k_plane, v_plane, query.dtype, m.block_size):
                prepared = self._prepared = PreparedPlanes(
                    k_plane,
                    v_plane,
                    query_dtype=query.dtype,
                    num_heads=self.layer_params.num_heads,
                    head_size=spec.head_size,
                    block_size=m.block_size,
                    scale=self.scale,
                    soft_cap=self._soft_cap,
                    alibi_slopes=self._slopes,
                    sinks=self._sinks,
                    k_scale=self._k_scale,
                    v_scale=self._v_scale,
                )
            prepared.requests(
                query,
                m.block_table,
                m.query_start_loc,
                m.seq_lens,
                m.native_requests,
                causal=causal,
                window=window,
                chunk=chunk,
                output=output,
            )
        if len(m.prefill_requests):
            from ...kernels.attention.cpu_prefill import paged_prefill

            paged_prefill(
                query,
                k_plane,
                v_plane,
                m.block_table,
                m.prefill_requests,
                m.prefill_start,
                m.prefill_lens,
                m.prefill_seq,
                block_size=m.block_size,
                causal=causal,
                window=window,
                chunk=chunk,
                scale=self.scale,
                output=output,
                soft_cap=self._soft_cap,
                alibi_slopes=self._slopes,
                # A quantised cache's rows are read back (the values attention sees are
                # the stored ones, as on every later step), never the step's own.
                key=key if m.read_step_kv and self._quant is None else None,
                value=value if m.read_step_kv and self._quant is None else None,
                sinks=self._sinks,
                k_scale=self._k_scale,
                v_scale=self._v_scale,
            )
        if m.tree is not None:
            assert k_plane is not None
            assert v_plane is not None
            assert m.block_table is not None
            self._tree_rows(query, k_plane, v_plane, m.block_table, m.block_size, m.tree, output)
        return output

    @override
    def forward_lse(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: CpuAttentionMetadata,
        output: torch.Tensor,
        lse: torch.Tensor,
    ) -> torch.Tensor:
        """``forward`` with each row's log-sum-exp in ``lse [T, Hq]``: every query token
        is one work item of the native kernel over its run of keys (``_lse_items``), so
        the step takes neither the per-request decode nor the blocked prefill."""
        who = f"{type(self).__name__}.forward_lse ({self.kv_cache_spec.kind.value})"
        m = self._lse_metadata(who, attn_metadata, query, lse)
        if not self.layer_params.return_lse:
            raise ValueError(
                f"{who}: the layer was built without layer_params.return_lse=True, got an "
                f"lse to fill"
            )
        if m.shard is not None:
            raise ValueError(
                f"{who}: the group is sharded by context (context_shard={m.shard}); its "
                f"result is partial, call forward_partial"
            )
        if m.tree is not None:
            raise ValueError(f"{who}: a draft-tree step returns no lse here (verify without lse)")
        return self._rows_with_lse(
            who, query, key, value, kv_cache, m, output, lse, self._lse_items(m), self._sinks
        )

    def _lse_metadata(
        self, who: str, attn_metadata: object, query: torch.Tensor, lse: object
    ) -> CpuAttentionMetadata:
        """The metadata's type and ``lse`` (float32 ``[T, Hq]`` on the CPU), checked."""
        attn_metadata = cpu_metadata(who, attn_metadata)
        want = (query.shape[0], query.shape[1])
        if (
            not isinstance(lse, torch.Tensor)
            or tuple(lse.shape) != want
            or lse.dtype != torch.float32
            or lse.device.type != "cpu"
        ):
            got = describe(lse) if isinstance(lse, torch.Tensor) else type(lse).__name__
            raise ValueError(
                f"{who}: lse must be a float32 cpu tensor {list(want)} ([T, Hq] of query), "
                f"got {got}"
            )
        return attn_metadata

    def _rows_with_lse(
        self,
        who: str,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        m: CpuAttentionMetadata,
        output: torch.Tensor,
        lse: torch.Tensor,
        items: tuple[torch.Tensor, ...],
        sinks: torch.Tensor | None,
        key_stride: int = 1,
        key_offset: int = 0,
    ) -> torch.Tensor:
        """Write the step's K/V, then the native kernel over the work ``items`` (rows
        past the step's tokens: zeros and ``-inf``)."""
        check_planes(
            who,
            self.kv_cache_spec,
            key,
            value,
            kv_cache,
            has_cache=self._has_cache,
            encoder_keys=self._encoder_keys,
        )
        k_plane, v_plane = kv_cache[0], kv_cache[1]
        write_planes(k_plane, v_plane, key, value, m.writes, self.layer_params, self._quant)
        n = m.num_actual_tokens
        output[n:] = 0
        lse[n:] = float("-inf")
        self._attend_rows(
            query, k_plane, v_plane, m, output, items, sinks, lse, key_stride, key_offset
        )
        return output

    def _attend_rows(
        self,
        query: torch.Tensor,
        k_plane: torch.Tensor,
        v_plane: torch.Tensor,
        m: CpuAttentionMetadata,
        output: torch.Tensor,
        items: tuple[torch.Tensor, ...],
        sinks: torch.Tensor | None,
        lse: torch.Tensor | None = None,
        key_stride: int = 1,
        key_offset: int = 0,
    ) -> None:
        """The native kernel over the work ``items`` (rows, requests, key runs,
        positions), with the layer's scale, soft-cap, slopes and static scales."""
        from ...kernels.attention.cpu_decode import paged_attention_rows

        assert m.block_table is not None
        paged_attention_rows(
            query,
            k_plane,
            v_plane,
            m.block_table,
            *items,
            block_size=m.block_size,
            scale=self.scale,
            output=output,
            soft_cap=self._soft_cap,
            alibi_slopes=self._slopes,
            sinks=sinks,
            lse=lse,
            key_stride=key_stride,
            key_offset=key_offset,
            k_scale=self._k_scale,
            v_scale=self._v_scale,
        )

    def _lse_items(self, m: CpuAttentionMetadata) -> tuple[torch.Tensor, ...]:
        """The native kernel's work items for every query token of the step: its row,
        request, first and last visible key (the window's or chunk's first, or 0; the
        image range's end, or its own position + 1) and position."""
        if m.mm_prefix_items is not None:  # the builder made them (the ranges' ends)
            return m.mm_prefix_items
        qsl = m.query_start_loc.numpy().astype(np.int64)
        qlens = np.diff(qsl)
        seq = m.seq_lens.numpy().astype(np.int64)
        n = int(qsl[-1])
        req = np.repeat(np.arange(len(qlens)), qlens)
        pos = seq[req] - qlens[req] + (np.arange(n) - qsl[:-1][req])
        window, chunk = self._mask.window, self._mask.chunk
        if window is not None:
            starts = np.maximum(pos - window + 1, 0)
        elif chunk is not None:
            starts = pos - pos % chunk
        else:
            starts = np.zeros_like(pos)
        return (
            from_numpy(np.arange(n, dtype=np.int64)),
            from_numpy(req.astype(np.int32)),
            from_numpy(starts.astype(np.int32)),
            from_numpy((pos + 1).astype(np.int32)),
            from_numpy(pos.astype(np.int32)),
        )

    def _tree_rows(
        self,
        query: torch.Tensor,
        k_plane: torch.Tensor,
        v_plane: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        tree: DraftTreeRows,
        output: torch.Tensor,
    ) -> None:
        """A draft tree's rows (``DraftTreeRows``): the native kernel per run of visible
        keys, the runs merged by their log-sum-exps (the sink logit joins once)."""
        from ...kernels.attention.cpu_decode import paged_attention_rows

        n = int(tree.queries.numel())
        q = query.index_select(0, tree.queries)
        part = torch.empty_like(q)
        lse = torch.empty((n, query.shape[1]), dtype=torch.float32)
        paged_attention_rows(
            q,
            k_plane,
            v_plane,
            block_table,
            torch.arange(n, dtype=torch.int64),
            tree.requests,
            tree.key_start,
            tree.key_end,
            tree.query_pos,
            block_size=block_size,
            scale=self.scale,
            output=part,
            soft_cap=self._soft_cap,
            alibi_slopes=self._slopes,
            lse=lse,
            k_scale=self._k_scale,
            v_scale=self._v_scale,
        )
        g = int(tree.out_rows.numel())
        top = torch.full((g, lse.shape[1]), float("-inf")).scatter_reduce_(
            0, tree.group[:, None].expand_as(lse), lse, "amax"
        )
        if self._sinks is not None:
            top = torch.maximum(top, self._sinks[None, :])
        weight = torch.exp(lse - top.index_select(0, tree.group))
        denom = torch.zeros_like(top).index_add_(0, tree.group, weight)
        if self._sinks is not None:
            denom += torch.exp(self._sinks[None, :] - top)
        acc = torch.zeros((g, *query.shape[1:]), dtype=torch.float32)
        acc.index_add_(0, tree.group, weight[..., None] * part.float())
        output.index_copy_(0, tree.out_rows, (acc / denom[..., None]).to(output.dtype))

    @override
    def forward_partial(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: CpuAttentionMetadata,
        output: torch.Tensor,
        lse: torch.Tensor,
    ) -> torch.Tensor:
        """``forward`` over one context-parallel shard, with the partial's lse (rows
        past the step's tokens: zeros and ``-inf``; a sink logit joins rank 0's only)."""
        who = f"{type(self).__name__}.forward_partial ({self.kv_cache_spec.kind.value})"
        attn_metadata = cpu_metadata(who, attn_metadata)
        if attn_metadata.shard is None or attn_metadata.shard_items is None:
            raise ValueError(
                f"{who}: the metadata has no context_shard (the group is not sharded by "
                f"context); call forward"
            )
        m = self._lse_metadata(who, attn_metadata, query, lse)
        assert m.shard is not None  # checked above
        assert m.shard_items is not None
        rank, world = m.shard
        sinks = self._sinks if rank == 0 else None
        return self._rows_with_lse(
            who, query, key, value, kv_cache, m, output, lse, m.shard_items, sinks, world, rank
        )


def _lse_reason(kind: KVCacheSpecKind) -> str:
    return (
        f"feature return_lse not supported for kind={kind.value} (supported: causal "
        f"attention over the step's K/V without sink tokens: full, sliding-window, "
        f"chunked-local)"
    )


class CpuAttentionBackend(AttentionBackend):
    """The CPU engines over the paged planes: the first choice on CPU."""

    name = _NAME
    description = (
        "CPU engines over K/V planes: a native paged-decode C kernel for decodes (and runs "
        f"of up to {NATIVE_MAX_QUERY} queries), a native blocked prefill for the rest; full, "
        "sliding-window, chunked-local, sink-token, encoder-only and cross; GQA, soft-cap, "
        "ALiBi, per-head sinks; fp8 caches (per-tensor or per-head scales), per-token-head "
        "fp8/int8; head sizes 16, 32..256 in steps of 16 and 512; CPU only"
    )
    supported_devices = frozenset({"cpu"})
    supported_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = _KV_CACHE_DTYPES
    supported_head_sizes = _HEAD_SIZES
    supported_block_sizes = _BLOCK_SIZES
    supported_features = _BACKEND_FEATURES
    # Measured: every call of every combination the kit makes, run twice, bit for bit.
    deterministic = True
    # Each request's rows are work items of their own (the native kernel: one per query
    # token; the blocked prefill: tasks of one request's tokens), whatever the thread
    # count and the other requests; from prefill_decode up every row goes to the native
    # kernel (its key tiles sit at fixed positions), so a row is the same bits as a
    # decode, in any chunk, or after a prefix hit (the cache holds the model dtype's
    # values exactly). Checked bit for bit (tests/test_invariance.py). Kinds not
    # listed: run_to_run.
    determinism: ClassVar[Mapping[KVCacheSpecKind, Determinism]] = {
        KVCacheSpecKind.FULL_ATTENTION: Determinism.PREFIX_HIT_INVARIANT,
        KVCacheSpecKind.SLIDING_WINDOW: Determinism.PREFIX_HIT_INVARIANT,
        KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION: Determinism.PREFIX_HIT_INVARIANT,
    }
    draft_trees: ClassVar[DraftTreeSupport | None] = DraftTreeSupport(
        kinds=frozenset(
            {
                KVCacheSpecKind.FULL_ATTENTION,
                KVCacheSpecKind.SLIDING_WINDOW,
                KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION,
            }
        ),
        max_width=MAX_DRAFT_TREE_TOKENS,
        max_depth=MAX_DRAFT_TREE_TOKENS,
        how="draft rows recomputed by the native kernel per run of visible keys (window, "
        "chunk and ALiBi in each draft's depth positions), merged by their log-sum-exps",
        alibi=True,
    )
    kv_cache_layout: ClassVar[KVCacheLayout] = "planes"
    # Every attention kind with K and V planes: the engines take every kind's Mask
    # (causal or bidirectional, window, chunk, sink tokens), and the write plan what each
    # kind writes; MLA latents have no planes.
    builders = bind_each(
        tuple(r.spec_class for r in attention_rules() if "planes" in r.layouts),
        CpuAttentionMetadataBuilder,
        CpuAttentionImpl,
    )

    @classmethod
    @override
    def extra_not_supported_reasons(cls, request: BackendRequest) -> list[str]:
        """``return_lse`` on the kinds ``forward_lse`` does not serve."""
        spec = request.spec
        if (
            AttentionFeature.RETURN_LSE in request.features
            and isinstance(spec, AttentionSpec)
            and not _serves_lse(spec)
        ):
            return [_lse_reason(spec.kind)]
        return []

    @classmethod
    @override
    def extra_environment_reasons(cls, device: torch.device) -> list[str]:
        """The engines are CPU code; on CPU their native library must load here (a
        prebuilt variant this CPU runs, or one compiled once per machine)."""
        if device.type != "cpu":
            return [
                f"{_NAME} is CPU-only: its engines are a native C kernel and CPU matrix products"
            ]
        from ...kernels.attention.cpu_native import native_problem

        native = native_problem()
        if native is not None:
            return [f"the CPU engines' native kernel is unavailable ({native})"]
        return []

    @classmethod
    @override
    def environment_notes(cls, device: torch.device) -> list[str]:
        """Which native library the engines load here, from where and why, with its
        OpenMP runtime and the instruction sets its copies run."""
        if device.type != "cpu":
            return []
        from ...kernels.attention.cpu_native import load_paged_decode, native_problem

        if native_problem() is not None:
            return []
        lib = load_paged_decode()
        isas = (
            f"prefill {lib.prefill_isa}; decode float32 {lib.decode_isa(0, 128)}, "
            f"bfloat16 {lib.decode_isa(1, 128)} (head size 128)"
        )
        return [lib.describe(), isas]
