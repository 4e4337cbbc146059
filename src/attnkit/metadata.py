"""Per-step batch metadata shared by every backend, and batch-order helpers.

Letters: B = requests in the step, T = scheduled (query) tokens, MB = the widest
block table row.

``CommonAttentionMetadata`` is what the runtime builds once per step per KV-cache
group; a backend's builder turns it into the metadata its kernels consume.
Requests are ordered decodes first (see ``reorder_batch_to_split_decodes_and_prefills``)
so a backend can split the batch into two contiguous ranges without a gather.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from ._validation import describe_tensor, dtype_name, is_nonnegative_int, is_positive_int
from .errors import ArgumentTypeError, InvalidArgumentError

__all__ = [
    "CommonAttentionMetadata",
    "DecodePrefillSplit",
    "DraftTreeMask",
    "SparseSelection",
    "host_to_device",
    "hosts_to_device",
    "mm_prefix_key_ends",
    "reorder_batch_to_split_decodes_and_prefills",
    "split_decodes_and_prefills",
]


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without making the host wait: itself on the CPU; on
    CUDA through pinned memory with a non-blocking copy (torch's caching host allocator
    keeps the pinned block alive until the copy is done). What ``begin_step`` and the
    builders use for every per-step tensor, so no step synchronises with the device."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


_ALIGN = 8
"""Each tensor starts on a multiple of this many bytes in a packed upload (the widest
element: a view of any dtype starts on its own size)."""


def hosts_to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors on ``device`` in one copy, without a wait: themselves on the CPU;
    else packed into one pinned byte buffer (each at an 8-byte boundary), sent by one
    non-blocking copy, and each returned as a view of the device buffer (its dtype and
    shape). What ``begin_step`` does with the step's tensors: one transfer a step
    instead of one per tensor (each a pinned allocation and a copy launch)."""
    if device.type == "cpu":
        return list(tensors)
    return pack_and_copy(
        tensors, lambda buf: buf.to(device, non_blocking=True), pin=device.type == "cuda"
    )


def pack_and_copy(
    tensors: Sequence[torch.Tensor],
    copy: Callable[[torch.Tensor], torch.Tensor],
    *,
    pin: bool = False,
) -> list[torch.Tensor]:
    """``hosts_to_device``'s packing: ``tensors`` (host, any dtype and shape) written into
    one uint8 buffer (pinned when ``pin``), ``copy(buffer)`` called once, and each tensor
    returned as a view of what it gave back."""
    offsets: list[int] = []
    total = 0
    for t in tensors:
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += t.numel() * t.element_size()
    buffer = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pin)
    host = buffer.numpy()
    for t, start in zip(tensors, offsets, strict=True):
        size = t.numel() * t.element_size()
        if not size:
            continue
        if t.dtype in _NUMPY_DTYPES:  # (numpy: no dispatch cost per tensor)
            values: npt.NDArray[Any] = t.numpy()
            flat: npt.NDArray[Any] = np.ravel(values)
            host[start : start + size] = np.frombuffer(np.ascontiguousarray(flat), np.uint8)
        else:
            buffer[start : start + size].view(t.dtype).view(t.shape).copy_(t)
    sent = copy(buffer)
    return [
        sent[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        for t, start in zip(tensors, offsets, strict=True)
    ]


_NUMPY_DTYPES = frozenset(
    {torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float32}
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftTreeMask:
    """The draft trees of a verify step, as every attention kernel takes them: each
    draft token attends to the cached context, its ancestors and itself
    (docs/speculative.md, "Draft trees").

    A request's last ``num_drafts[b]`` context positions are its draft tokens, in draft
    order (``ScheduledRequest.draft_parents``); key position ``j`` of request ``b`` is
    visible to query row ``t`` when the kind's mask allows it and ``j < seq_lens[b] -
    num_drafts[b]`` or bit ``j - (seq_lens[b] - num_drafts[b])`` of ``ancestors[t]``
    is set. Rows that are not drafts hold 0 (their causal mask already hides every
    draft). Fixed-shape: rows past the step's tokens are never read, so a capture
    buffer of ``max_num_batched_tokens`` rows serves every step.

    Attributes:
        ancestors: int64 ``[T]`` on the device: per token, the bitmask of its request's
            draft tokens it may see (its ancestors and itself).
        num_drafts: int32 ``[B]`` on the device: each request's draft tokens.
        ancestors_cpu, num_drafts_cpu: the same on the CPU.
    """

    ancestors: torch.Tensor
    num_drafts: torch.Tensor
    ancestors_cpu: torch.Tensor
    num_drafts_cpu: torch.Tensor


@dataclasses.dataclass(kw_only=True, slots=True)
class CommonAttentionMetadata:
    """The batch of one scheduling step, as every backend sees it.

    Attributes:
        query_start_loc: int32 ``[B+1]`` on the compute device; request ``b``'s new
            tokens are ``query_start_loc[b]:query_start_loc[b+1]`` of the step's
            flattened tokens.
        query_start_loc_cpu: the same values on the CPU, for host-side decisions
            (splits, grids) without a device sync.
        seq_lens: int32 ``[B]`` on the device: each request's context length after
            this step (cached tokens + new tokens).
        seq_lens_cpu: the same values on the CPU.
        num_reqs: ``B``.
        num_actual_tokens: ``T`` (= ``query_start_loc_cpu[-1]``); the step's token
            tensors may be padded past it.
        max_query_len: the most new tokens of any request in the step.
        max_seq_len: the longest ``seq_lens`` entry.
        block_table_tensor: int32 ``[B, MB]`` on the device: request ``b``'s logical
            block ``i`` is physical block ``block_table_tensor[b, i]``.
        slot_mapping: int64 ``[T']`` (``T' >= T``) on the device: the cache slot
            (``block * block_size + offset``) each new token is written to; -1 for
            padding tokens.
        causal: whether queries see only earlier positions.
        num_computed_tokens_cpu: int32 ``[B]`` on the CPU: each request's tokens
            computed before this step, whatever the kind (0 for a request in its first
            step; sink and encoder tokens are not counted). ``None`` when the caller
            does not know it; ``AttentionRuntime`` always sets it.
        context_shard: ``(rank, world_size)`` when the group's cache is one decode
            context-parallel shard (``AttentionRuntime(context_parallel=...)``):
            position ``p`` lives on rank ``p % world_size``, ``seq_lens`` and the block
            table are the rank's (``ceil((L - rank) / world_size)`` positions of an
            ``L``-token request), slots of positions other ranks hold are -1, and the
            layer's impl returns a partial result with its log-sum-exp
            (``AttentionImpl.forward_partial``). ``None``: the whole context.
        global_seq_lens_cpu: int32 ``[B]`` on the CPU: every request's whole length
            (where its queries sit), with ``context_shard`` only.
        draft_tree: the step's draft trees (``DraftTreeMask``) when some request's
            drafts are a tree (``ScheduledRequest.draft_parents``); ``None`` when every
            draft is a chain, which the causal mask already covers.
        mm_prefix_ranges: int32 ``[B, R, 2]`` on the device, for a group whose layers
            take image ranges (``Mask.mm_prefix``): request ``b``'s bidirectional
            ranges ``[start, end)`` in its token positions, sorted, padded with
            ``(0, 0)``; ``R`` is ``AttentionConfig.max_mm_prefix_ranges`` (fixed, so
            the shape does not change from step to step). ``None`` otherwise.
        mm_prefix_ranges_cpu: the same values on the CPU.
        mm_prefix_counts_cpu: int32 ``[B]`` on the CPU: the valid ranges of each row.
        step_id: a number its producer gives each step, never the same for two of its
            steps (``AttentionRuntime`` numbers every ``begin_step`` of the process);
            ``None``: not given. Within one ``step_id``, groups whose
            ``query_start_loc_cpu`` and ``seq_lens_cpu`` are the same tensors see the
            same step, so a builder may plan it once and share the host-side plan
            with the step's other groups (``cpu_attn`` shares its split of the step
            between its engines). A producer that refills those tensors in place must
            give the refilled step a new id, or ``None``.
        slots_written: ``True`` when the producer guarantees that every one of the
            step's ``num_actual_tokens`` first ``slot_mapping`` entries is ``>= 0``
            (each new token is written: the default slots of a decoder kind), so a
            builder need not look for -1 entries; ``False`` (the default): not known.

    Construction checks shapes, dtypes and devices, and (on the CPU copies only, so
    no device sync) that offsets are monotonic and agree with ``num_actual_tokens``,
    ``max_query_len`` and ``max_seq_len``. Pass ``validate=False`` on a hot path whose
    inputs are already known good.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    num_computed_tokens_cpu: torch.Tensor | None = None
    context_shard: tuple[int, int] | None = None
    global_seq_lens_cpu: torch.Tensor | None = None
    draft_tree: DraftTreeMask | None = None
    mm_prefix_ranges: torch.Tensor | None = None
    mm_prefix_ranges_cpu: torch.Tensor | None = None
    mm_prefix_counts_cpu: torch.Tensor | None = None
    step_id: int | None = None
    slots_written: bool = False
    validate: dataclasses.InitVar[bool] = True

    def __post_init__(self, validate: bool) -> None:
        if validate:
            self._validate()

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        """int32 ``[B]`` new tokens per request, on the CPU."""
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    def _validate(self) -> None:
        b = self.num_reqs
        for name in ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len"):
            value = getattr(self, name)
            if not is_nonnegative_int(value):
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.step_id is not None and not is_nonnegative_int(self.step_id):
            raise ValueError(f"step_id must be an int >= 0 or None, got {self.step_id!r}")
        expected: list[tuple[str, torch.Tensor, torch.dtype, tuple[int, ...] | None, bool]] = [
            ("query_start_loc", self.query_start_loc, torch.int32, (b + 1,), False),
            ("query_start_loc_cpu", self.query_start_loc_cpu, torch.int32, (b + 1,), True),
            ("seq_lens", self.seq_lens, torch.int32, (b,), False),
            ("seq_lens_cpu", self.seq_lens_cpu, torch.int32, (b,), True),
            ("block_table_tensor", self.block_table_tensor, torch.int32, None, False),
            ("slot_mapping", self.slot_mapping, torch.int64, None, False),
        ]
        if self.num_computed_tokens_cpu is not None:
            expected.append(
                ("num_computed_tokens_cpu", self.num_computed_tokens_cpu, torch.int32, (b,), True)
            )
        for name, tensor, dtype, shape, on_cpu in expected:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
            want_shape = "" if shape is None else f" of shape {list(shape)}"
            if tensor.dtype != dtype or (shape is not None and tuple(tensor.shape) != shape):
                raise ValueError(
                    f"{name} must be {dtype_name(dtype)}{want_shape} "
                    f"(num_reqs={b}), got {describe_tensor(tensor)}"
                )
            if on_cpu and tensor.device.type != "cpu":
                raise ValueError(f"{name} must be on the CPU, got {describe_tensor(tensor)}")
        device = self.query_start_loc.device
        for name, tensor in (
            ("seq_lens", self.seq_lens),
            ("block_table_tensor", self.block_table_tensor),
            ("slot_mapping", self.slot_mapping),
        ):
            if tensor.device != device:
                raise ValueError(
                    f"{name} must be on query_start_loc's device {device}, got {describe_tensor(tensor)}"
                )
        if self.block_table_tensor.dim() != 2 or self.block_table_tensor.shape[0] != b:
            raise ValueError(
                f"block_table_tensor must be int32 of shape [num_reqs={b}, max_blocks], "
                f"got {describe_tensor(self.block_table_tensor)}"
            )
        if self.slot_mapping.dim() != 1:
            raise ValueError(
                f"slot_mapping must be 1-D [num_tokens], got {describe_tensor(self.slot_mapping)}"
            )
        # Value checks read the CPU copies through zero-copy numpy views: no device
        # sync, and a few microseconds instead of a torch op dispatch per check.
        qsl = self.query_start_loc_cpu.numpy()
        seq = self.seq_lens_cpu.numpy()
        if qsl[0] != 0:
            raise ValueError(f"query_start_loc_cpu[0] must be 0, got {int(qsl[0])}")
        query_lens = np.diff(qsl)
        if b and query_lens.min() < 0:
            bad = int(np.argmax(query_lens < 0))
            raise ValueError(
                f"query_start_loc_cpu must be non-decreasing, but entry {bad + 1} "
                f"({int(qsl[bad + 1])}) < entry {bad} ({int(qsl[bad])})"
            )
        total = int(qsl[-1])
        if self.num_actual_tokens != total:
            raise ValueError(
                f"num_actual_tokens must equal query_start_loc_cpu[-1]={total}, "
                f"got {self.num_actual_tokens}"
            )
        if self.slot_mapping.shape[0] < total:
            raise ValueError(
                f"slot_mapping must have at least num_actual_tokens={total} entries, "
                f"got {describe_tensor(self.slot_mapping)}"
            )
        if not isinstance(self.slots_written, bool):
            raise ValueError(f"slots_written must be a bool, got {self.slots_written!r}")
        if self.slots_written and self.slot_mapping.device.type == "cpu" and total:
            written = self.slot_mapping[:total].numpy()
            if written.min() < 0:
                bad = int(np.argmax(written < 0))
                raise ValueError(
                    f"slots_written=True, but slot_mapping[{bad}] is {int(written[bad])}: "
                    f"every one of the step's {total} tokens must have a slot >= 0"
                )
        short = seq < query_lens
        # Causal queries are the last positions of their context; a non-causal step
        # (cross attention) may have more queries than cached keys.
        if self.causal and self.context_shard is None and b and short.any():
            bad = int(np.argmax(short))
            raise ValueError(
                f"seq_lens_cpu[{bad}]={int(seq[bad])} is shorter than the "
                f"request's {int(query_lens[bad])} new tokens"
            )
        max_q = int(query_lens.max()) if b else 0
        if self.max_query_len != max_q:
            raise ValueError(
                f"max_query_len must be the largest query length {max_q}, got {self.max_query_len}"
            )
        max_s = int(seq.max()) if b else 0
        if self.max_seq_len != max_s:
            raise ValueError(
                f"max_seq_len must be the largest seq_lens entry {max_s}, got {self.max_seq_len}"
            )
        if self.causal is not True and self.causal is not False:
            raise ValueError(f"causal must be a bool, got {self.causal!r}")
        self._validate_mm_prefix()

    def _validate_mm_prefix(self) -> None:
        given = (self.mm_prefix_ranges, self.mm_prefix_ranges_cpu, self.mm_prefix_counts_cpu)
        if all(t is None for t in given):
            return
        if any(t is None for t in given):
            raise ValueError(
                "mm_prefix_ranges, mm_prefix_ranges_cpu and mm_prefix_counts_cpu must be "
                "given together (or none of them)"
            )
        assert self.mm_prefix_ranges is not None
        assert self.mm_prefix_ranges_cpu is not None
        assert self.mm_prefix_counts_cpu is not None
        b = self.num_reqs
        cpu = self.mm_prefix_ranges_cpu
        for name, t, on_cpu in (
            ("mm_prefix_ranges", self.mm_prefix_ranges, False),
            ("mm_prefix_ranges_cpu", cpu, True),
        ):
            if t.dtype != torch.int32 or t.dim() != 3 or t.shape[0] != b or t.shape[2] != 2:
                raise ValueError(
                    f"{name} must be int32 of shape [num_reqs={b}, max_ranges, 2], got "
                    f"{describe_tensor(t)}"
                )
            if on_cpu and t.device.type != "cpu":
                raise ValueError(f"{name} must be on the CPU, got {describe_tensor(t)}")
        if self.mm_prefix_ranges.shape != cpu.shape:
            raise ValueError(
                f"mm_prefix_ranges {describe_tensor(self.mm_prefix_ranges)} and "
                f"mm_prefix_ranges_cpu {describe_tensor(cpu)} must have one shape"
            )
        counts = self.mm_prefix_counts_cpu
        if (
            counts.dtype != torch.int32
            or tuple(counts.shape) != (b,)
            or counts.device.type != "cpu"
        ):
            raise ValueError(
                f"mm_prefix_counts_cpu must be int32 of shape [num_reqs={b}] on the CPU, "
                f"got {describe_tensor(counts)}"
            )
        r: npt.NDArray[np.int32] = cpu.numpy()
        n: npt.NDArray[np.int32] = counts.numpy()
        width = int(r.shape[1])
        valid: npt.NDArray[np.bool_] = np.less(np.arange(width), np.expand_dims(n, 1))
        if b and (n.min() < 0 or n.max() > r.shape[1]):
            raise ValueError(f"mm_prefix_counts_cpu must be in [0, {r.shape[1]}], got {n.tolist()}")
        starts, ends = r[..., 0], r[..., 1]
        bad: npt.NDArray[np.bool_] = valid & ((starts < 0) | (ends <= starts))
        bad[:, 1:] |= valid[:, 1:] & (starts[:, 1:] < ends[:, :-1])
        if bad.any():
            row, col = (int(x) for x in np.argwhere(bad)[0])
            raise ValueError(
                f"mm_prefix_ranges_cpu[{row}, {col}] = {r[row, col].tolist()}: ranges must "
                f"be [start, end) with 0 <= start < end, sorted and not overlapping"
            )

    @classmethod
    def from_lists(
        cls,
        *,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_table: Sequence[Sequence[int]],
        slot_mapping: Sequence[int],
        device: torch.device | str = "cpu",
        causal: bool = True,
    ) -> CommonAttentionMetadata:
        """Build the metadata from plain lists (tests, examples, simple engines).

        Block-table rows are padded with 0 (the null block) to the widest row.
        """
        device = torch.device(device)
        if len(query_lens) != len(seq_lens) or len(block_table) != len(seq_lens):
            raise ValueError(
                f"query_lens, seq_lens and block_table must have one entry per request, "
                f"got {len(query_lens)}, {len(seq_lens)} and {len(block_table)}"
            )
        if any(q < 0 for q in query_lens):
            raise ValueError(f"query_lens must be >= 0, got {list(query_lens)}")
        offsets = [0]
        for q in query_lens:
            offsets.append(offsets[-1] + q)
        width = max((len(row) for row in block_table), default=0)
        table = torch.zeros((len(block_table), width), dtype=torch.int32)
        for i, row in enumerate(block_table):
            table[i, : len(row)] = torch.tensor(list(row), dtype=torch.int32)
        qsl_cpu = torch.tensor(offsets, dtype=torch.int32)
        seq_cpu = torch.tensor(list(seq_lens), dtype=torch.int32)
        return cls(
            query_start_loc=qsl_cpu.to(device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_cpu.to(device),
            seq_lens_cpu=seq_cpu,
            num_reqs=len(query_lens),
            num_actual_tokens=offsets[-1],
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            block_table_tensor=table.to(device),
            slot_mapping=torch.tensor(list(slot_mapping), dtype=torch.int64, device=device),
            causal=causal,
        )


@dataclasses.dataclass(frozen=True)
class SparseSelection:
    """Which cached tokens each query token attends to: what any indexer produces and
    any sparse-attention impl consumes (DeepSeek sparse attention), backend-neutral.

    Fixed-shape, so it can live in CUDA-graph buffers: allocate it once for the most
    tokens a step may have (``SparseSelection.empty``) and let each step fill its first
    ``T`` rows; rows past the step's tokens are never read.

    Attributes:
        indices: int32 ``[T_max, topk]``, the **global slot ids** (``block * block_size
            + offset``) of the paired latent cache, in ascending position order; ``-1``
            pads a row past its valid entries. No block table is needed to read them.
        lens: int32 ``[T_max]``, each row's valid entries (``min(topk, visible)``).
    """

    indices: torch.Tensor
    lens: torch.Tensor

    def __post_init__(self) -> None:
        for name, t in (("indices", self.indices), ("lens", self.lens)):
            if not isinstance(t, torch.Tensor):
                raise ArgumentTypeError(
                    f"SparseSelection.{name} must be a torch.Tensor, got {type(t).__name__}"
                )
            if t.dtype != torch.int32:
                raise InvalidArgumentError(
                    f"SparseSelection.{name} must be int32, got {describe_tensor(t)}"
                )
        if self.indices.dim() != 2 or self.indices.shape[1] < 1:
            raise InvalidArgumentError(
                "SparseSelection.indices must be [T, topk] with topk >= 1, got "
                f"{describe_tensor(self.indices)}"
            )
        if tuple(self.lens.shape) != (self.indices.shape[0],):
            raise InvalidArgumentError(
                f"SparseSelection.lens must be [T] = [{self.indices.shape[0]}] (one count per "
                f"row of indices), got {describe_tensor(self.lens)}"
            )
        if self.lens.device != self.indices.device:
            raise InvalidArgumentError(
                f"SparseSelection.lens must be on the device of indices ({self.indices.device}), "
                f"got {describe_tensor(self.lens)}"
            )

    @classmethod
    def empty(
        cls, max_tokens: int, topk: int, device: torch.device | str = "cpu"
    ) -> SparseSelection:
        """A selection buffer of ``max_tokens`` rows that selects nothing (all ``-1``)."""
        for name, value in (("max_tokens", max_tokens), ("topk", topk)):
            if not is_positive_int(value):
                raise InvalidArgumentError(
                    f"SparseSelection.empty: {name} must be an int >= 1, got {value!r}"
                )
        return cls(
            torch.full((max_tokens, topk), -1, dtype=torch.int32, device=device),
            torch.zeros(max_tokens, dtype=torch.int32, device=device),
        )

    @property
    def topk(self) -> int:
        """The selection width (columns of ``indices``)."""
        return int(self.indices.shape[1])

    def rows(self, num_tokens: int) -> SparseSelection:
        """The first ``num_tokens`` rows (views, no copy): a step's part of the buffer."""
        if not is_nonnegative_int(num_tokens) or num_tokens > self.indices.shape[0]:
            raise InvalidArgumentError(
                f"SparseSelection.rows: num_tokens must be an int in [0, "
                f"{self.indices.shape[0]}], got {num_tokens!r}"
            )
        return SparseSelection(self.indices[:num_tokens], self.lens[:num_tokens])


class DecodePrefillSplit(NamedTuple):
    """Where a decodes-first batch splits: requests ``[0, num_decodes)`` are decodes."""

    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int


def _check_threshold(decode_threshold: int) -> None:
    if not is_positive_int(decode_threshold):
        raise ValueError(f"decode_threshold must be an int >= 1, got {decode_threshold!r}")


def mm_prefix_key_ends(common_attn_metadata: CommonAttentionMetadata) -> np.ndarray | None:
    """Each query token's visible keys end (exclusive) under ``Mask.mm_prefix``: int64
    ``[T]`` on the host, or ``None`` when no query of the step lies in a range longer
    than itself (every row is then plainly causal).

    Query ``t`` of request ``b`` sits at ``p = seq_lens[b] - q_len[b] + t``. Outside
    every range it sees keys up to ``p`` (``p + 1``); inside ``[s, e)`` up to ``e - 1``
    (``Mask.mm_prefix``). Its first visible key is unchanged (the window's or 0), so
    each row stays one contiguous run of keys, which is how the kernels take it. Reads
    only CPU tensors.
    """
    cm = common_attn_metadata
    ranges = cm.mm_prefix_ranges_cpu
    counts = cm.mm_prefix_counts_cpu
    if ranges is None or counts is None or cm.num_actual_tokens == 0:
        return None
    n: npt.NDArray[np.int64] = counts.numpy().astype(np.int64)
    if not n.any():
        return None
    qsl = cm.query_start_loc_cpu.numpy().astype(np.int64)
    qlens = np.diff(qsl)
    seq = cm.seq_lens_cpu.numpy().astype(np.int64)
    req = np.repeat(np.arange(cm.num_reqs), qlens)
    pos = seq[req] - qlens[req] + (np.arange(int(qsl[-1])) - qsl[:-1][req])
    r = ranges.numpy().astype(np.int64)
    width = int(r.shape[1])
    valid: npt.NDArray[np.bool_] = np.less(np.arange(width), np.expand_dims(n, 1))
    starts = np.where(valid, r[..., 0], 0)[req]
    ends = np.where(valid, r[..., 1], 0)[req]
    inside = (starts <= pos[:, None]) & (pos[:, None] < ends)
    # Ranges do not overlap: at most one holds the query.
    end = np.max(np.where(inside, ends, 0), axis=1)
    key_ends: np.ndarray = np.maximum(end, pos + 1)
    if np.array_equal(key_ends, pos + 1):
        return None
    return key_ends


def split_decodes_and_prefills(
    common_attn_metadata: CommonAttentionMetadata, *, decode_threshold: int = 1
) -> DecodePrefillSplit:
    """Split a batch whose decodes come first.

    A decode is a request with at most ``decode_threshold`` new tokens that continues
    cached context (``num_computed_tokens_cpu > 0``): a new request, even of one token,
    has nothing cached to extend, so it is a prefill, as ``AttentionRuntime`` orders
    it. (Without ``num_computed_tokens_cpu``, query lengths alone decide.)

    Reads only CPU tensors: no device sync.

    Raises:
        ValueError: if a decode follows a prefill (the batch was not reordered), or
            ``decode_threshold`` < 1.
    """
    _check_threshold(decode_threshold)
    query_lens = common_attn_metadata.query_lens_cpu
    b = common_attn_metadata.num_reqs
    is_prefill = query_lens > decode_threshold
    computed = common_attn_metadata.num_computed_tokens_cpu
    if computed is not None:
        is_prefill |= computed == 0
    num_decodes = int(torch.argmax(is_prefill.to(torch.int8))) if bool(is_prefill.any()) else b
    if bool((~is_prefill[num_decodes:]).any()):
        late = num_decodes + int(torch.nonzero(~is_prefill[num_decodes:])[0, 0])
        raise ValueError(
            f"batch is not ordered decodes first: request {late} is a decode (query length "
            f"{int(query_lens[late])} <= decode_threshold={decode_threshold}, cached context) "
            f"after prefill request {num_decodes} (query length {int(query_lens[num_decodes])}); "
            f"HINT: order requests with reorder_batch_to_split_decodes_and_prefills"
        )
    num_decode_tokens = int(common_attn_metadata.query_start_loc_cpu[num_decodes])
    return DecodePrefillSplit(
        num_decodes=num_decodes,
        num_prefills=b - num_decodes,
        num_decode_tokens=num_decode_tokens,
        num_prefill_tokens=common_attn_metadata.num_actual_tokens - num_decode_tokens,
    )


def _int_list(name: str, values: Sequence[int] | torch.Tensor) -> list[int]:
    out: list[int] = values.tolist() if isinstance(values, torch.Tensor) else list(values)  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]  # torch types tolist() as a bare List
    for i, v in enumerate(out):
        if not is_nonnegative_int(v):
            raise ValueError(f"{name}[{i}] must be an int >= 0, got {v!r}")
    return out


def reorder_batch_to_split_decodes_and_prefills(
    query_lens: Sequence[int] | torch.Tensor,
    *,
    num_computed_tokens: Sequence[int] | torch.Tensor | None = None,
    decode_threshold: int = 1,
) -> list[int]:
    """The order that puts decodes first, as ``split_decodes_and_prefills`` expects.

    A decode has at most ``decode_threshold`` new tokens and, when
    ``num_computed_tokens`` is given, cached context (a new request is a prefill).
    Returns a permutation ``order``: position ``i`` of the reordered batch holds the
    request at index ``order[i]`` of the input. The order is stable within decodes and
    within prefills, so requests move no more than needed for the split.

    >>> reorder_batch_to_split_decodes_and_prefills([5, 1, 7, 1])
    [1, 3, 0, 2]
    >>> reorder_batch_to_split_decodes_and_prefills([5, 1, 7, 1], num_computed_tokens=[0, 0, 3, 9])
    [3, 0, 1, 2]
    """
    _check_threshold(decode_threshold)
    lens = _int_list("query_lens", query_lens)
    computed = (
        _int_list("num_computed_tokens", num_computed_tokens)
        if num_computed_tokens is not None
        else [1] * len(lens)
    )
    if len(computed) != len(lens):
        raise ValueError(
            f"num_computed_tokens must have one entry per request ({len(lens)}), got {len(computed)}"
        )
    is_decode = [q <= decode_threshold and c > 0 for q, c in zip(lens, computed, strict=True)]
    return [i for i, d in enumerate(is_decode) if d] + [i for i, d in enumerate(is_decode) if not d]
