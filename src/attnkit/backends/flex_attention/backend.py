"""The ``flex_attention`` backend: attention over the paged K/V planes, through
compiled FlexAttention on CUDA and the CPU engines on CPU.

On CPU (``FlexAttentionOptions.cpu_path="engines"``, the default) a step runs on
``attnkit.kernels.attention`` instead of FlexAttention: requests with at most
``NATIVE_MAX_QUERY`` queries go to a native paged kernel that reads K and V in place
through the block table, longer runs to blocked matrix products over keys gathered
once. Measured on a 2-core AVX2 machine (``benchmarks/bench_cpu.py``), inductor's
compiled CPU kernel for FlexAttention reads K/V at 19-29% of a plain read when
decoding and prefills at 0.5-0.67x SDPA whatever the block sizes, and compiles each
new shape for 5-18 s; the engines meet the targets (decode >= 60% of a plain read:
61-64%; prefill >= 1x SDPA: 1.5x) and compile one small C file once per machine.
``cpu_path="flex"`` keeps FlexAttention on CPU too (the description below).

FlexAttention (PyTorch, ``torch.nn.attention.flex_attention``; Dong et al. 2024,
arXiv:2412.05496) computes attention with a user mask (``mask_mod``) and score
modification (``score_mod``) over a block-sparse ``BlockMask``, and ``torch.compile``
turns it into one fused kernel (a C++ template on CPU, Triton on CUDA).

How a paged step maps onto it, without gathering K or V:

* The backend declares ``kv_cache_layout = "planes"``: each layer's cache is a K plane
  and a V plane ``[NB * BS, Hkv, D]`` (row = slot). FlexAttention reads one plane as a
  single key sequence ``[1, Hkv, NB * BS, D]`` (a strided view, no copy) broadcast over
  the batch, and the ``BlockMask`` lists for each request and query block the
  *physical* cache blocks it may read (sparse KV block = cache block): a
  logical -> physical mapping through the block table, so only those blocks are read.
* ``mask_mod`` turns a physical key index back into the request's logical position
  (``physical -> logical`` block map of the step) and applies the kind's mask (causal,
  window, chunk, bidirectional) and the request's lengths; blocks every query of the
  block sees entirely are listed as *full*, where the mask is skipped.
* Queries are GQA-packed: ``[Bb, Hkv, Lb * G, D]`` (row ``t * G + g``), so each K/V tile
  is read once per group of ``G`` query heads; decodes (one query) and prefills run as
  two calls, each padded to declared buckets (``FlexAttentionOptions``) so the compiled
  kernels are reused across steps.

The builder plans the step once (``build``: the block lists, the query layout, the
physical -> logical pairs, on the host from the CPU offsets); the first layer that runs
makes the ``BlockMask`` for its cache size and every other layer reuses it.

What FlexAttention cannot do here, and so is not declared: per-head sink logits
(``attention_sinks``: the correction needs the log-sum-exp, which the compiled CPU
kernel of torch 2.13 cannot return), ``return_lse`` (same), fp8 caches, MLA (one
latent per token: no planes layout) and state layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt
import torch
from pydantic import field_validator
from typing_extensions import override

from ...backend import AttentionBackend
from ...binding import bind_each
from ...builder import AttentionMetadataBuilder
from ...capabilities import AttentionFeature, KVCacheLayout, MultipleOf, SizeRule
from ...config import AttentionConfig, BackendOptions
from ...impl import AttentionImpl
from ...kinds import Mask, attention_rules, rules_for
from ...metadata import CommonAttentionMetadata, host_to_device
from ...params import AttentionLayerParams, attention_params_problems
from ...spec import AttentionSpec, KVCacheDType, KVCacheSpecKind
from ._compile import environment_problems, recorded_failure, run_compiled
from ._plan import NO_LIMIT, CallPlan, Ints, bucket_for, plan_call

if TYPE_CHECKING:  # importing flex_attention pulls in dynamo: annotations only
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "FlexAttentionBackend",
    "FlexAttentionImpl",
    "FlexAttentionMetadata",
    "FlexAttentionMetadataBuilder",
    "FlexAttentionOptions",
]

_NAME = "flex_attention"
# torch.from_numpy, typed: torch leaves its parameter unannotated (pyright: Unknown).
_from_numpy: Callable[[npt.NDArray[Any]], torch.Tensor] = torch.from_numpy  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
_FEATURES = frozenset({AttentionFeature.LOGITS_SOFT_CAP, AttentionFeature.ALIBI})
# Head sizes checked on CPU; FlexAttention's Triton template on CUDA wants powers of two.
_HEAD_SIZES: SizeRule = (16, 32, 64, 128, 256)
# The sparse KV block is the cache block; Triton's dots need at least 16 rows.
_BLOCK_SIZES: SizeRule = (MultipleOf(16),)
_QUERY_TOKENS_PER_BLOCK = 32
"""Query tokens per sparse query block (``32 * G`` rows: 128 at Llama 3's G = 4)."""
_MIN_DECODE_BATCH = 8
"""Decode calls of fewer requests are padded to 8: a padding request lists no block,
so the kernel skips it, its query and output rows are a few KB, and every bucket
avoided is one compile (about 10 s on a 2-core CPU). Prefill calls are padded to
powers of two from 1: their padding costs whole query and output planes."""
_MIN_PREFILL_BUCKET = 32
"""One query block of tokens: rows of a request past its length cost nothing once a
query block holds none of its tokens, so small prompts share one bucket."""
NATIVE_MAX_QUERY = 4
"""On the CPU engines, requests with at most this many queries (decodes, short
speculative runs) go to the native paged kernel, which reads each key once per query
token; longer runs go to blocked matrix products, which gather the keys once."""
_ENCODER_BLOCK = 16
_NO_BLOCKS = torch.zeros(0, dtype=torch.int64)
_NO_INTS: Ints = np.zeros(0, dtype=np.int64)


def _int32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous int32 tensor (no copy when it is one already)."""
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


"""Block size of the per-step scratch plane that holds an encoder-only step's K/V."""


class FlexAttentionOptions(BackendOptions):
    """Settings of ``flex_attention``: ``backend_options={"flex_attention": {...}}``.

    Every distinct padded shape is one compiled kernel (seconds to compile on a CPU),
    so batches are padded up to a declared bucket.

    Attributes:
        batch_buckets: request counts a call is padded to (strictly increasing);
            ``None``: powers of two from 8. Past the largest, the next power of two.
        query_buckets: query lengths a prefill call is padded to (strictly
            increasing); ``None``: powers of two from 32. Decodes use 1.
        cpu_path: on CPU, ``"engines"`` (default) runs requests of at most
            ``NATIVE_MAX_QUERY`` queries through the native paged kernel and longer runs
            as blocked matrix products (``kernels.attention.cpu_prefill``): nothing to compile
            per shape, and faster than FlexAttention's compiled CPU kernel
            (``benchmarks/bench_cpu.py`` measures both); ``"flex"`` runs compiled
            FlexAttention for every call. Buckets apply to ``"flex"`` only. Ignored
            on CUDA, where FlexAttention always runs.
    """

    batch_buckets: tuple[int, ...] | None = None
    query_buckets: tuple[int, ...] | None = None
    cpu_path: Literal["engines", "flex"] = "engines"

    @field_validator("batch_buckets", "query_buckets")
    @classmethod
    def _increasing(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is None:
            return None
        if not value or any(v < 1 for v in value) or list(value) != sorted(set(value)):
            raise ValueError(
                f"buckets must be a non-empty, strictly increasing tuple of ints >= 1, "
                f"got {value!r}"
            )
        return value


def _options(config: AttentionConfig) -> FlexAttentionOptions:
    return config.options_for(_NAME, FlexAttentionOptions)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class FlexCall:
    """One FlexAttention launch of a step, its tensors on the device.

    Attributes:
        batch, query_len: the padded shape ``Bb``, ``Lb``.
        q_source: int64 ``[Bb * Lb]``: the step token each padded query slot reads.
        out_batch, out_token, out_dest: int64 ``[m]``: for each real query token, its
            padded request slot, its index in the request and its row in ``output``.
        out_flat: int64 ``[m]``: ``out_batch * Lb + out_token``.
        info: int32 ``[Bb, 3]``: ``(qpos0, qlen, seq)`` per padded request.
        kv_num, kv_blocks, full_num, full_blocks: int32 ``[Bb, 1, NQB]`` counts and
            ``[Bb, 1, NQB, W]`` physical block ids of the partial and full KV blocks.
    """

    batch: int
    query_len: int
    q_source: torch.Tensor
    out_batch: torch.Tensor
    out_token: torch.Tensor
    out_dest: torch.Tensor
    out_flat: torch.Tensor
    info: torch.Tensor
    kv_num: torch.Tensor
    kv_blocks: torch.Tensor
    full_num: torch.Tensor
    full_blocks: torch.Tensor


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class CpuPlan:
    """One step on the CPU engines (``FlexAttentionOptions.cpu_path="engines"``).

    Attributes:
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
    """

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


@dataclasses.dataclass
class _Resolved:
    """What the first layer of a step makes for its cache size and GQA ratio."""

    p2l: torch.Tensor
    masks: tuple[BlockMask, ...]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class FlexAttentionMetadata:
    """One group's step, planned for FlexAttention.

    Attributes:
        num_actual_tokens: ``T``; rows of ``output`` past it are zeroed.
        kind: the group's kind.
        block_size: the sparse KV block: the cache block (encoder-only: the scratch's).
        calls: the step's launches (decodes, prefills; empty for an empty step).
        limits: int32 ``[4]``: ``(future, window, chunk, offset)`` of the mask (see
            ``_mask``); ``NO_LIMIT`` where a term does not apply.
        write_slots: int64: cache slots of the new keys/values (-1 entries removed
            when the slot mapping was on the CPU); ``None`` for encoder-only.
        write_rows: int64 rows of ``key``/``value`` for ``write_slots``; ``None``: the
            first ``len(write_slots)`` rows.
        sink_slots: int64 ``[R * sink_len]`` sink slots of requests in their first step
            (sink_full_attention), or ``None``.
        tail_slots: int64: the slots past each request's length in its last block,
            zeroed before attending (they may hold anything, and FlexAttention
            multiplies masked weights, which are 0, by them); ``None`` if none.
        p2l_blocks, p2l_logical: int64: physical blocks the step reads and their
            logical index, from which the physical -> logical map is made.
        scratch_rows, scratch_dest: encoder-only: rows of the scratch plane and, for
            each of the step's tokens in order, its scratch row.
        cpu: the step on the CPU engines (then ``calls`` is empty), or ``None``.
    """

    num_actual_tokens: int
    kind: KVCacheSpecKind
    block_size: int
    calls: tuple[FlexCall, ...]
    limits: torch.Tensor
    write_slots: torch.Tensor | None = None
    write_rows: torch.Tensor | None = None
    sink_slots: torch.Tensor | None = None
    tail_slots: torch.Tensor | None = None
    p2l_blocks: torch.Tensor
    p2l_logical: torch.Tensor
    scratch_rows: int = 0
    scratch_dest: torch.Tensor | None = None
    cpu: CpuPlan | None = None
    _resolved: dict[tuple[int, int], _Resolved] = dataclasses.field(
        default_factory=lambda: dict[tuple[int, int], _Resolved]()
    )

    def resolve(self, num_blocks: int, group: int) -> _Resolved:
        """The physical -> logical map and one ``BlockMask`` per call, for a plane of
        ``num_blocks`` blocks and ``group`` query heads per K/V head: made by the first
        layer of the step that asks, reused by the others."""
        key = (num_blocks, group)
        found = self._resolved.get(key)
        if found is None:
            found = self._make(num_blocks, group)
            self._resolved[key] = found
        return found

    def _make(self, num_blocks: int, group: int) -> _Resolved:
        from torch.nn.attention.flex_attention import BlockMask

        device = self.limits.device
        p2l = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        if self.p2l_blocks.numel():
            if device.type == "cpu" and int(self.p2l_blocks.max()) >= num_blocks:
                raise ValueError(
                    f"FlexAttentionMetadata: the block table names block "
                    f"{int(self.p2l_blocks.max())}, past the cache's {num_blocks} blocks"
                )
            p2l[self.p2l_blocks] = self.p2l_logical.to(torch.int32)
            if device.type == "cpu" and not bool((p2l[self.p2l_blocks] == self.p2l_logical).all()):
                raise ValueError(
                    "FlexAttentionMetadata: a physical block sits at two different logical "
                    "positions in this step's block tables; flex_attention maps each "
                    "physical block to one logical block per step"
                )
        bs = self.block_size
        masks: list[BlockMask] = []
        for call in self.calls:
            rows = _rows(call.query_len, group)
            width = num_blocks
            kv = _pad_blocks(call.kv_blocks, width)
            full = _pad_blocks(call.full_blocks, width)
            masks.append(
                BlockMask.from_kv_blocks(
                    call.kv_num,
                    kv,
                    call.full_num,
                    full,
                    BLOCK_SIZE=(_QUERY_TOKENS_PER_BLOCK * group, bs),
                    mask_mod=_mask(p2l, call.info, self.limits, group, bs),
                    seq_lengths=(rows, num_blocks * bs),
                    compute_q_blocks=False,
                )
            )
        return _Resolved(p2l=p2l, masks=tuple(masks))


def _rows(query_len: int, group: int) -> int:
    # One query row per K/V head would select inductor's CPU decoding template, which
    # walks every listed block once per partition of the whole plane when the mask
    # depends on the request; two rows (one padding) keep the block-sparse template.
    return max(query_len * group, 2)


def _pad_blocks(blocks: torch.Tensor, width: int) -> torch.Tensor:
    """``[Bb, 1, NQB, W]`` -> ``[Bb, 1, NQB, width]``: the compiled CPU kernel asserts
    that the index tensor spans the whole key sequence (``NB`` blocks)."""
    out = blocks.new_zeros((*blocks.shape[:-1], width))
    out[..., : min(blocks.shape[-1], width)] = blocks[..., :width]
    return out


def _mask(
    p2l: torch.Tensor, info: torch.Tensor, limits: torch.Tensor, group: int, block_size: int
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The step's ``mask_mod``: one function for every kind (the kind's terms come
    from ``limits``), so one compiled kernel serves every kind of one shape."""

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        t = q_idx // group
        logical = p2l[kv_idx // block_size]
        pos = logical * block_size + kv_idx % block_size
        qp = info[b, 0] + t
        future, window, chunk, offset = limits[0], limits[1], limits[2], limits[3]
        return (
            (t < info[b, 1])
            & (logical >= 0)
            & (pos < info[b, 2])
            & (pos <= qp + future)
            & (qp - pos < window)
            & ((pos + offset) // chunk == (qp + offset) // chunk)
        )

    return mask_mod


def _score(
    p2l: torch.Tensor,
    info: torch.Tensor,
    group: int,
    block_size: int,
    soft_cap: torch.Tensor | None,
    slopes: torch.Tensor | None,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The layer's ``score_mod``: soft-cap ``cap * tanh(s / cap)``, then ALiBi
    ``s + slope[head] * (j - i)`` (the reference's order and sign)."""

    def score_mod(
        score: torch.Tensor,
        b: torch.Tensor,
        h: torch.Tensor,
        q_idx: torch.Tensor,
        kv_idx: torch.Tensor,
    ) -> torch.Tensor:
        if soft_cap is not None:
            score = soft_cap * torch.tanh(score / soft_cap)
        if slopes is not None:
            head = h * group + q_idx % group
            pos = p2l[kv_idx // block_size] * block_size + kv_idx % block_size
            qp = info[b, 0] + q_idx // group
            score = score + slopes[head] * (pos - qp)
        return score

    return score_mod


_workspaces: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}


def _workspace(name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A flat buffer of at least ``numel`` elements, shared by every layer (layers run
    one after another) and grown when a step needs more: the query and output copies of
    a prefill are tens of MB, and a fresh allocation of that size costs page faults on
    every layer."""
    key = (name, like.device, like.dtype)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(
            max(numel, int(buf.numel() * 1.5) if buf is not None else 0),
            dtype=like.dtype,
            device=like.device,
        )
        _workspaces[key] = buf
    return buf[:numel]


class FlexAttentionMetadataBuilder(AttentionMetadataBuilder[FlexAttentionMetadata, AttentionSpec]):
    """Plans each step on the host (block lists, query layout, buckets) and moves the
    plan to the device once; no device sync, no per-request loop."""

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
        self.causal, self.window, self.chunk = mask.causal, mask.window, mask.chunk
        self.sink_len = mask.sink_len
        self.options = _options(config)
        # No cache (encoder-only): the step's own keys/values, in a scratch plane.
        self.encoder = not rules.has_cache
        # The cache holds the encoder's tokens (cross attention), written when given.
        self.encoder_keys = rules.writes == "encoder"
        if self.causal:
            limits = (0, self.window or NO_LIMIT, self.chunk or NO_LIMIT, 0)
        else:
            # Bidirectional queries may sit before position 0 (cross attention may have
            # more queries than keys: qp = seq - qlen + t < 0). With the offset NO_LIMIT / 2
            # both sides of the chunk term fall in chunk 0 of NO_LIMIT for any
            # -2**29 <= qp, pos < 2**29.
            limits = (NO_LIMIT, NO_LIMIT, NO_LIMIT, NO_LIMIT // 2)
        self._limits = torch.tensor(limits, dtype=torch.int32, device=device)

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> FlexAttentionMetadata:
        cm = common_attn_metadata
        who = type(self).__name__
        if cm.causal is not self.causal:
            raise ValueError(
                f"{who}: common_attn_metadata.causal must be {self.causal} for "
                f"{self.kind.value} layers, got {cm.causal}"
            )
        engines = self.device.type == "cpu" and self.options.cpu_path == "engines"
        if (
            engines
            and cm.max_query_len <= NATIVE_MAX_QUERY
            and not self.encoder
            and not self.sink_len
        ):
            return self._build_cpu_short(cm)
        qsl = cm.query_start_loc_cpu.numpy().astype(np.int64)
        qlens = np.diff(qsl)
        seq = cm.seq_lens_cpu.numpy().astype(np.int64)
        if self.encoder and bool((seq != qlens).any()):
            b = int(np.argmax(seq != qlens))
            raise ValueError(
                f"{who}: {self.kind.value} encodes a request whole in one step, so "
                f"seq_lens must equal the query lengths; request {b} has "
                f"seq_lens={int(seq[b])} and query length {int(qlens[b])}"
            )
        if self.sink_len and bool((seq - qlens < self.sink_len).any()):
            b = int(np.argmax(seq - qlens < self.sink_len))
            raise ValueError(
                f"{who}: {self.kind.value} seq_lens must count the sink_len="
                f"{self.sink_len} sink tokens, but request {b} has seq_lens - query_lens = "
                f"{int(seq[b] - qlens[b])} < {self.sink_len}"
            )
        if engines:
            return self._build_cpu(cm, qsl, qlens, seq)
        if self.encoder:
            return self._build_encoder(cm, qsl, qlens, seq)
        return self._build_paged(cm, qsl, qlens, seq)

    # ------------------------------------------------------------------ CPU engines

    def _build_cpu_short(self, cm: CommonAttentionMetadata) -> FlexAttentionMetadata:
        """Every request has at most ``NATIVE_MAX_QUERY`` queries (decode steps): the
        native kernel takes the whole step from the runtime's offsets as they are, so
        nothing is planned here (no host array is touched)."""
        # No sink kind here (sink_len == 0), so the lengths are not read.
        return self._cpu_metadata(cm, _NO_INTS, _NO_INTS, None, True, _NO_INTS, _NO_INTS)

    def _build_cpu(
        self,
        cm: CommonAttentionMetadata,
        qsl: Ints,
        qlens: Ints,
        seq: Ints,
    ) -> FlexAttentionMetadata:
        """Split the step between the native kernel (requests with short query runs)
        and the blocked prefill (the rest; everything for encoder-only layers)."""
        is_live = qlens > 0
        is_short = is_live & (qlens <= NATIVE_MAX_QUERY) if not self.encoder else ~is_live
        long = np.flatnonzero(is_live & ~is_short)
        short = np.flatnonzero(is_short)
        served = None if len(long) == 0 else _from_numpy(short.astype(np.int32))
        return self._cpu_metadata(cm, seq, qlens, served, len(short) > 0, long, qsl[long])

    def _cpu_metadata(
        self,
        cm: CommonAttentionMetadata,
        seq: Ints,
        qlens: Ints,
        served: torch.Tensor | None,
        native: bool,
        long: Ints,
        long_start: Ints,
    ) -> FlexAttentionMetadata:
        table: torch.Tensor | None = None
        write: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if not self.encoder:
            table = cm.block_table_tensor
            if table.dtype != torch.int32 or table.stride(-1) != 1:
                table = table.to(torch.int32).contiguous()
            write = self._write_plan(cm)
        plan = CpuPlan(
            block_table=table,
            query_start_loc=_int32(cm.query_start_loc_cpu),
            seq_lens=_int32(cm.seq_lens_cpu),
            native=native,
            native_requests=served,
            prefill_requests=long,
            prefill_start=long_start,
            prefill_lens=qlens[long],
            prefill_seq=seq[long],
            read_step_kv=self.encoder
            or (not self.encoder_keys and write[1] is None),
        )
        return self._metadata(
            cm,
            seq,
            qlens,
            write,
            block_size=self.kv_cache_spec.block_size,
            calls=(),
            p2l_blocks=_NO_BLOCKS,
            p2l_logical=_NO_BLOCKS,
            cpu=plan,
        )

    def _metadata(
        self,
        cm: CommonAttentionMetadata,
        seq: Ints,
        qlens: Ints,
        write: tuple[torch.Tensor | None, torch.Tensor | None],
        **fields: Any,
    ) -> FlexAttentionMetadata:
        """The step's metadata: what every paged path sets the same way (the writes,
        the sink slots, the limits), plus the path's own ``fields``."""
        return FlexAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            kind=self.kind,
            limits=self._limits,
            write_slots=write[0],
            write_rows=write[1],
            sink_slots=self._sink_slots(cm, seq, qlens) if self.sink_len else None,
            **fields,
        )

    # ------------------------------------------------------------------ paged kinds

    def _build_paged(
        self,
        cm: CommonAttentionMetadata,
        qsl: Ints,
        qlens: Ints,
        seq: Ints,
    ) -> FlexAttentionMetadata:
        bs = self.kv_cache_spec.block_size
        table = cm.block_table_tensor
        device = table.device
        live = np.nonzero(qlens > 0)[0]
        decodes = live[qlens[live] == 1]
        prefills = live[qlens[live] > 1]
        plans: list[CallPlan] = []
        opts = self.options
        if len(decodes):
            plans.append(
                self._plan(
                    decodes,
                    qsl,
                    qlens,
                    seq,
                    bucket_for(len(decodes), opts.batch_buckets, _MIN_DECODE_BATCH),
                    1,
                )
            )
        if len(prefills):
            longest = int(qlens[prefills].max())
            plans.append(
                self._plan(
                    prefills,
                    qsl,
                    qlens,
                    seq,
                    bucket_for(len(prefills), opts.batch_buckets),
                    bucket_for(longest, opts.query_buckets, _MIN_PREFILL_BUCKET),
                )
            )
        calls: list[FlexCall] = []
        p2l_req: list[Ints] = []
        p2l_log: list[Ints] = []
        for plan in plans:
            calls.append(self._to_device(plan, table, device))
            for num, logical in (
                (plan.kv_num, plan.kv_logical),
                (plan.full_num, plan.full_logical),
            ):
                n = len(plan.requests)
                width = int(logical.shape[-1])
                valid = np.less(np.arange(width), num[:n, :, None])
                p2l_req.append(np.broadcast_to(plan.requests[:, None, None], valid.shape)[valid])
                p2l_log.append(logical[:n][valid])
        req_all = np.concatenate(p2l_req) if p2l_req else np.zeros(0, dtype=np.int64)
        log_all = np.concatenate(p2l_log) if p2l_log else np.zeros(0, dtype=np.int64)
        req_t = host_to_device(_from_numpy(req_all), device)
        log_t = host_to_device(_from_numpy(log_all), device)
        p2l_blocks = table[req_t, log_t].to(torch.int64)

        # The slots past each request's length in its last block.
        rem = seq % bs
        has_tail = (seq > 0) & (rem != 0)
        tail_req = np.nonzero(has_tail)[0]
        tail_slots: torch.Tensor | None = None
        if len(tail_req):
            count = bs - rem[tail_req]
            req_rep = np.repeat(tail_req, count)
            starts = np.cumsum(count) - count
            offsets = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(starts, count)
            offsets += np.repeat(rem[tail_req], count)
            last = np.repeat((seq[tail_req] - 1) // bs, count)
            r_t = host_to_device(_from_numpy(req_rep), device)
            l_t = host_to_device(_from_numpy(last), device)
            o_t = host_to_device(_from_numpy(offsets), device)
            tail_slots = table[r_t, l_t].to(torch.int64) * bs + o_t

        return self._metadata(
            cm,
            seq,
            qlens,
            self._write_plan(cm),
            block_size=bs,
            calls=tuple(calls),
            tail_slots=tail_slots,
            p2l_blocks=p2l_blocks,
            p2l_logical=log_t,
        )

    def _write_plan(self, cm: CommonAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The slots new keys/values go to. From a CPU slot mapping, -1 entries are
        dropped here (once per step); on CUDA the runtime's contract holds (no -1 among
        the step's tokens; cross attention: the first ``E`` entries are the encoder's)."""
        slots = cm.slot_mapping
        if not self.encoder_keys:
            slots = slots[: cm.num_actual_tokens]
        if slots.device.type != "cpu":
            return slots, None
        if slots.numel() == 0 or int(slots.numpy().min()) >= 0:  # numpy: no dispatch cost
            return slots, None
        keep = slots >= 0
        rows = torch.nonzero(keep).flatten()
        if self.encoder_keys and bool(
            (rows == torch.arange(rows.numel())).all()
        ):
            return slots[: rows.numel()], None  # the encoder tokens lead, as usual
        return slots[rows], rows

    def _sink_slots(
        self, cm: CommonAttentionMetadata, seq: Ints, qlens: Ints
    ) -> torch.Tensor | None:
        """Sink slots of the requests in their first step (context == sink_len)."""
        sink_len, bs = self.sink_len, self.kv_cache_spec.block_size
        new = np.nonzero(seq - qlens == sink_len)[0]
        if len(new) == 0:
            return None
        table = cm.block_table_tensor
        pos = np.arange(sink_len, dtype=np.int64)
        rows = host_to_device(_from_numpy(np.repeat(new, sink_len)), table.device)
        logical = host_to_device(_from_numpy(np.tile(pos // bs, len(new))), table.device)
        offsets = host_to_device(_from_numpy(np.tile(pos % bs, len(new))), table.device)
        return table[rows, logical].to(torch.int64) * bs + offsets

    def _plan(
        self,
        requests: Ints,
        qsl: Ints,
        qlens: Ints,
        seq: Ints,
        batch: int,
        query_len: int,
        block_size: int | None = None,
    ) -> CallPlan:
        return plan_call(
            requests,
            query_start=qsl[:-1],
            query_lens=qlens,
            seq_lens=seq,
            batch=batch,
            query_len=query_len,
            group=1,  # planned in tokens; the query block holds 32 tokens for any G
            q_block=_QUERY_TOKENS_PER_BLOCK,
            block_size=block_size or self.kv_cache_spec.block_size,
            causal=self.causal,
            window=self.window,
            chunk=self.chunk,
        )

    @staticmethod
    def _to_device(
        plan: CallPlan, table: torch.Tensor | None, device: torch.device, scratch_blocks: int = 0
    ) -> FlexCall:
        """Move a plan to the device; logical blocks become physical ones through the
        block table (paged kinds) or the scratch layout (encoder-only)."""

        def dev(a: npt.NDArray[Any]) -> torch.Tensor:
            return host_to_device(_from_numpy(np.array(a, copy=True)), device)

        bb = plan.batch
        slot_req = np.zeros(bb, dtype=np.int64)
        slot_req[: len(plan.requests)] = plan.requests

        def physical(logical: Ints) -> torch.Tensor:
            if table is None:
                slot = np.arange(bb, dtype=np.int64)[:, None, None]
                return dev((slot * scratch_blocks + logical).astype(np.int32))[:, None]
            rows = dev(np.broadcast_to(slot_req[:, None, None], logical.shape))
            return table[rows, dev(logical)][:, None].to(torch.int32)

        return FlexCall(
            batch=bb,
            query_len=plan.query_len,
            q_source=dev(plan.q_source),
            out_batch=dev(plan.out_batch),
            out_token=dev(plan.out_token),
            out_dest=dev(plan.out_dest),
            out_flat=dev(plan.out_batch * plan.query_len + plan.out_token),
            info=dev(plan.info),
            kv_num=dev(plan.kv_num[:, None]),
            kv_blocks=physical(plan.kv_logical),
            full_num=dev(plan.full_num[:, None]),
            full_blocks=physical(plan.full_logical),
        )

    # ------------------------------------------------------------------ encoder-only

    def _build_encoder(
        self,
        cm: CommonAttentionMetadata,
        qsl: Ints,
        qlens: Ints,
        seq: Ints,
    ) -> FlexAttentionMetadata:
        """Encoder-only layers keep no cache: each step's keys/values go into a scratch
        plane, request slot ``i`` owning rows ``[i * Lb, (i + 1) * Lb)`` (zeros past its
        length), and the paged machinery runs over it."""
        device = cm.query_start_loc.device
        live = np.nonzero(qlens > 0)[0]
        calls: tuple[FlexCall, ...] = ()
        rows = 0
        dest: torch.Tensor | None = None
        p2l_blocks = torch.zeros(0, dtype=torch.int64, device=device)
        p2l_logical = torch.zeros(0, dtype=torch.int64, device=device)
        if len(live):
            opts = self.options
            blk = _ENCODER_BLOCK
            lb = bucket_for(int(qlens[live].max()), opts.query_buckets, _MIN_PREFILL_BUCKET)
            lb = -(-lb // blk) * blk
            bb = bucket_for(len(live), opts.batch_buckets)
            plan = self._plan(live, qsl, qlens, seq, bb, lb, block_size=blk)
            per = lb // blk
            calls = (self._to_device(plan, None, device, scratch_blocks=per),)
            rows = bb * lb
            by_token = np.empty(cm.num_actual_tokens, dtype=np.int64)
            by_token[plan.out_dest] = plan.out_batch * lb + plan.out_token
            dest = host_to_device(_from_numpy(by_token), device)
            blocks = np.arange(bb * per, dtype=np.int64)
            p2l_blocks = host_to_device(_from_numpy(blocks), device)
            p2l_logical = host_to_device(_from_numpy(blocks % per), device)
        return FlexAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            kind=self.kind,
            block_size=_ENCODER_BLOCK,
            calls=calls,
            limits=self._limits,
            p2l_blocks=p2l_blocks,
            p2l_logical=p2l_logical,
            scratch_rows=rows,
            scratch_dest=dest,
        )


class FlexAttentionImpl(AttentionImpl[FlexAttentionMetadata, AttentionSpec, AttentionLayerParams]):
    """Writes the step's K/V into the planes and runs compiled FlexAttention with the
    step's block masks and the layer's score modification.

    Raises at construction (so a bad layer fails before its first step):
        ValueError: ``layer_params`` asks for a feature the backend does not declare,
            or does not fit the spec.
    """

    def __init__(self, kv_cache_spec: AttentionSpec, layer_params: AttentionLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        who = type(self).__name__
        spec, params = kv_cache_spec, layer_params
        rules = rules_for(spec)
        self._mask: Mask = rules.mask(spec)
        self._has_cache = rules.has_cache
        self._encoder_keys = rules.writes == "encoder"
        sink_len = self._mask.sink_len
        sink_tokens = sink_len > 0
        checked = (
            dataclasses.replace(params, sink_key=None, sink_value=None) if sink_tokens else params
        )
        problems = attention_params_problems(
            spec, checked, backend=_NAME, supported_features=_FEATURES
        )
        if sink_tokens:
            want = (sink_len, spec.num_kv_heads, spec.head_size)
            if params.sink_key is None or tuple(params.sink_key.shape) != want:
                got = "None" if params.sink_key is None else str(list(params.sink_key.shape))
                problems.append(
                    f"a {spec.kind.value} layer needs layer_params.sink_key and sink_value "
                    f"of shape [sink_len, Hkv, D]={list(want)}, got {got}"
                )
        if problems:
            raise ValueError(f"{who}: " + "; ".join(problems))
        self.num_heads = params.num_heads
        self.group = params.num_heads // spec.num_kv_heads
        self.scale: float = params.scale if params.scale is not None else spec.head_size**-0.5
        self._soft_cap = params.logits_soft_cap
        self._alibi = params.alibi_slopes
        self._constants: dict[torch.device, tuple[torch.Tensor | None, torch.Tensor | None]] = {}

    def _device_constants(
        self, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Soft-cap and ALiBi slopes as device tensors (tensors, not Python numbers, so
        one compiled kernel serves every value)."""
        found = self._constants.get(device)
        if found is None:
            cap = (
                torch.tensor(self._soft_cap, dtype=torch.float32, device=device)
                if self._soft_cap is not None
                else None
            )
            slopes = (
                torch.tensor(self._alibi, dtype=torch.float32, device=device)
                if self._alibi is not None
                else None
            )
            found = (cap, slopes)
            self._constants[device] = found
        return found

    def _check(
        self,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        m: object,
    ) -> None:
        """The backend's own rules: its metadata and the planes layout. The query, key,
        value and output were checked against the layer by the runtime
        (``attnkit._boundary``); only their presence is checked here."""
        who = f"{type(self).__name__}.forward ({self.kv_cache_spec.kind.value})"
        spec = self.kv_cache_spec
        if not isinstance(m, FlexAttentionMetadata):
            raise TypeError(
                f"{who}: attn_metadata must be FlexAttentionMetadata, got {type(m).__name__}"
            )
        if (key is None) != (value is None) or (
            key is None and not self._encoder_keys
        ):
            raise ValueError(f"{who}: key and value must both be tensors [T, Hkv, D]")
        want_kv = (spec.num_kv_heads, spec.head_size)
        expected = 2 if self._has_cache else 0
        if len(kv_cache) != expected:
            raise ValueError(
                f"{who}: kv_cache must hold {expected} tensors (the planes layout: K plane, "
                f"V plane), got {len(kv_cache)}"
            )
        for name, plane in zip(("K plane", "V plane"), kv_cache, strict=False):
            if (
                plane.dim() != 3
                or tuple(plane.shape[1:]) != want_kv
                or plane.shape[0] % spec.block_size
                or plane.dtype != spec.dtype
            ):
                raise ValueError(
                    f"{who}: kv_cache's {name} must be {spec.dtype} [NB * BS, Hkv, D] with "
                    f"BS={spec.block_size}, Hkv={spec.num_kv_heads}, D={spec.head_size}, "
                    f"got {plane.dtype} {list(plane.shape)}"
                )

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: FlexAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        self._check(key, value, kv_cache, attn_metadata)
        m = attn_metadata
        n = m.num_actual_tokens
        spec = self.kv_cache_spec
        if m.cpu is not None:
            return self._forward_cpu(query, key, value, kv_cache, m, m.cpu, output)
        if not self._has_cache:
            assert key is not None  # checked
            assert value is not None
            k_plane = key.new_zeros((m.scratch_rows, spec.num_kv_heads, spec.head_size))
            v_plane = torch.zeros_like(k_plane)
            if m.scratch_dest is not None:
                k_plane.index_copy_(0, m.scratch_dest, key[:n])
                v_plane.index_copy_(0, m.scratch_dest, value[:n])
        else:
            k_plane, v_plane = kv_cache[0], kv_cache[1]
            self._write(k_plane, v_plane, key, value, m)
        output[n:] = 0
        if not m.calls:
            return output
        num_blocks = k_plane.shape[0] // m.block_size
        resolved = m.resolve(num_blocks, self.group)
        cap, slopes = self._device_constants(query.device)
        hkv, d, g = spec.num_kv_heads, spec.head_size, self.group
        # [1, Hkv, NB * BS, D]: the planes as one key sequence, broadcast over requests.
        k = k_plane.permute(1, 0, 2).unsqueeze(0)
        v = v_plane.permute(1, 0, 2).unsqueeze(0)
        # [Hkv, T, G, D]: gathering tokens along dim 1 lays the query out as the kernel
        # reads it ([Bb, Hkv, Lb * G, D], a permuted view) in one copy.
        q_heads = query.view(query.shape[0], hkv, g, d).transpose(0, 1)
        variant = ("cap" if cap is not None else "") + ("alibi" if slopes is not None else "")
        for call, mask in zip(m.calls, resolved.masks, strict=True):
            bb, lb = call.batch, call.query_len
            q_rows = _workspace("q", hkv * bb * lb * g * d, query).view(hkv, bb * lb, g, d)
            torch.index_select(q_heads, 1, call.q_source, out=q_rows)
            q = q_rows.view(hkv, bb, lb * g, d).transpose(0, 1)
            rows = _rows(lb, g)
            if rows != lb * g:
                q = torch.cat([q, q.new_zeros((bb, hkv, rows - lb * g, d))], dim=2)
            score_mod = (
                _score(resolved.p2l, call.info, g, m.block_size, cap, slopes) if variant else None
            )
            shape = (
                f"{variant or 'plain'} q=[{bb},{hkv},{rows},{d}] kv={k.shape[2]} "
                f"bs={m.block_size} g={g} {str(query.dtype).removeprefix('torch.')}"
            )
            out = run_compiled(
                shape,
                query.device.type,
                q,
                k,
                v,
                score_mod=score_mod,
                block_mask=mask,
                scale=self.scale,
            )
            # out is [Bb, Hkv, R, D] in q's memory order ([Hkv, Bb, R, D]): one gather of the
            # real rows into a reused buffer, one scatter into the token-major output.
            heads_first = out.transpose(0, 1)[:, :, : lb * g].reshape(hkv, bb * lb, g * d)
            m_rows = call.out_flat.shape[0]
            picked = _workspace("out", hkv * m_rows * g * d, query).view(hkv, m_rows, g * d)
            torch.index_select(heads_first, 1, call.out_flat, out=picked)
            target = output if output.is_contiguous() else torch.empty_like(output)
            target.view(-1, hkv, g * d).index_copy_(0, call.out_dest, picked.transpose(0, 1))
            if target is not output:
                output.index_copy_(0, call.out_dest, target.index_select(0, call.out_dest))
        return output

    def _forward_cpu(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        m: FlexAttentionMetadata,
        plan: CpuPlan,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """The step on the CPU engines: write the planes, then the native kernel for the
        short query runs and blocked matrix products for the rest."""
        from ...kernels.attention.cpu_decode import paged_attention_requests
        from ...kernels.attention.cpu_prefill import paged_prefill

        n = m.num_actual_tokens
        k_plane: torch.Tensor | None = None
        v_plane: torch.Tensor | None = None
        if kv_cache:
            k_plane, v_plane = kv_cache[0], kv_cache[1]
            self._write(k_plane, v_plane, key, value, m)
        output[n:] = 0
        _, slopes = self._device_constants(query.device)
        causal, window, chunk = self._mask.causal, self._mask.window, self._mask.chunk
        if plan.native:
            assert k_plane is not None
            assert v_plane is not None
            assert plan.block_table is not None
            paged_attention_requests(
                query,
                k_plane,
                v_plane,
                plan.block_table,
                plan.query_start_loc,
                plan.seq_lens,
                plan.native_requests,
                block_size=m.block_size,
                causal=causal,
                window=window,
                chunk=chunk,
                scale=self.scale,
                output=output,
                soft_cap=self._soft_cap,
                alibi_slopes=slopes,
            )
        if len(plan.prefill_requests):
            paged_prefill(
                query,
                k_plane,
                v_plane,
                plan.block_table,
                plan.prefill_requests,
                plan.prefill_start,
                plan.prefill_lens,
                plan.prefill_seq,
                block_size=m.block_size,
                causal=causal,
                window=window,
                chunk=chunk,
                scale=self.scale,
                output=output,
                soft_cap=self._soft_cap,
                alibi_slopes=slopes,
                key=key if plan.read_step_kv else None,
                value=value if plan.read_step_kv else None,
            )
        return output

    def _write(
        self,
        k_plane: torch.Tensor,
        v_plane: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        m: FlexAttentionMetadata,
    ) -> None:
        """New keys/values (and sink tokens) into the planes, then zero the tails."""
        if key is not None and value is not None and m.write_slots is not None:
            slots = m.write_slots
            if m.write_rows is not None:
                k_new, v_new = (
                    key.index_select(0, m.write_rows),
                    value.index_select(0, m.write_rows),
                )
            else:
                count = min(slots.shape[0], key.shape[0])
                slots, k_new, v_new = slots[:count], key[:count], value[:count]
            k_plane.index_copy_(0, slots, k_new)
            v_plane.index_copy_(0, slots, v_new)
        if m.sink_slots is not None:
            sk, sv = self.layer_params.sink_key, self.layer_params.sink_value
            assert sk is not None  # checked at construction
            assert sv is not None
            new = m.sink_slots.shape[0] // sk.shape[0]
            k_plane.index_copy_(0, m.sink_slots, sk.to(k_plane).repeat(new, 1, 1))
            v_plane.index_copy_(0, m.sink_slots, sv.to(v_plane).repeat(new, 1, 1))
        if m.tail_slots is not None:
            k_plane.index_fill_(0, m.tail_slots, 0)
            v_plane.index_fill_(0, m.tail_slots, 0)


class FlexAttentionBackend(AttentionBackend):
    """Compiled FlexAttention over the paged planes: the fast path on CPU."""

    name = _NAME
    description = (
        "compiled FlexAttention over K/V planes: full, sliding-window, chunked-local, "
        "sink-token, encoder-only and cross; GQA, soft-cap, ALiBi; CPU and CUDA"
    )
    supported_devices = frozenset({"cpu", "cuda"})
    supported_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto"})
    supported_head_sizes = _HEAD_SIZES
    supported_block_sizes = _BLOCK_SIZES
    supported_features = _FEATURES
    options_type = FlexAttentionOptions
    kv_cache_layout: ClassVar[KVCacheLayout] = "planes"
    # Every attention kind with K and V planes: the mask_mod and the CPU engines express
    # every kind's Mask (causal or bidirectional, window, chunk, sink tokens), and the
    # write plan what each kind writes; MLA latents have no planes.
    builders = bind_each(
        tuple(r.spec_class for r in attention_rules() if "planes" in r.layouts),
        FlexAttentionMetadataBuilder,
        FlexAttentionImpl,
    )

    @classmethod
    @override
    def extra_environment_reasons(cls, device: torch.device) -> list[str]:
        """On CPU the default path is the CPU engines, whose native kernel must build
        here (a C compiler; built once per machine and cached on disk); elsewhere
        compiled FlexAttention must be possible (see ``_compile``): the backend never
        runs it uncompiled. A compile failure recorded in this process counts on both."""
        if device.type != "cpu":
            return environment_problems(device)
        from ...kernels.attention.cpu_native import native_problem

        problems: list[str] = []
        native = native_problem()
        if native is not None:
            problems.append(
                f"the CPU engines' native kernel is unavailable ({native}); "
                "flex_attention is not offered on CPU"
            )
        failed = recorded_failure("cpu")
        if failed is not None:
            problems.append(f"compiling FlexAttention failed earlier in this process: {failed}")
        return problems
