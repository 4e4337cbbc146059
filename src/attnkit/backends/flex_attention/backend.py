"""The ``flex_attention`` backend: compiled FlexAttention over the paged K/V planes, on
CUDA and, when a user selects it there, on CPU (the CPU default is ``cpu_attn``: on CPU,
inductor's compiled kernel is slower than attnkit's CPU engines and compiles each new
shape for seconds, see ``benchmarks/bench_cpu.py``).

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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np
import numpy.typing as npt
import torch
from pydantic import field_validator, model_validator
from typing_extensions import override

from ...backend import AttentionBackend
from ...binding import bind_each
from ...builder import AttentionMetadataBuilder
from ...capabilities import AttentionFeature, KVCacheLayout, MultipleOf, SizeRule
from ...config import AttentionConfig, BackendOptions
from ...impl import AttentionImpl
from ...kinds import attention_rules, rules_for
from ...metadata import CommonAttentionMetadata, host_to_device, mm_prefix_key_ends
from ...params import AttentionLayerParams
from ...spec import AttentionSpec, KVCacheDType, KVCacheSpecKind
from .._planes import (
    NO_WRITES,
    PlanesWrites,
    check_causal,
    check_planes,
    check_step_lengths,
    from_numpy,
    layer_problems,
    step_writes,
    write_planes,
)
from ._compile import environment_problems, run_compiled
from ._mods import make_mask_mod, make_score_mod, pad_blocks, query_rows, workspace
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
_ENCODER_BLOCK = 16
"""Block size of the per-step scratch plane that holds an encoder-only step's K/V."""


def _has_key(data: object, key: str) -> bool:
    return isinstance(data, Mapping) and key in cast("Mapping[object, object]", data)


class FlexAttentionOptions(BackendOptions):
    """Settings of ``flex_attention``: ``backend_options={"flex_attention": {...}}``.

    Every distinct padded shape is one compiled kernel (seconds to compile on a CPU),
    so batches are padded up to a declared bucket.

    Attributes:
        batch_buckets: request counts a call is padded to (strictly increasing);
            ``None``: powers of two from 8. Past the largest, the next power of two.
        query_buckets: query lengths a prefill call is padded to (strictly
            increasing); ``None``: powers of two from 32. Decodes use 1.
    """

    batch_buckets: tuple[int, ...] | None = None
    query_buckets: tuple[int, ...] | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_cpu_path(cls, data: object) -> object:
        # Unknown fields are refused anyway; this one says where its setting went.
        if _has_key(data, "cpu_path"):
            raise ValueError(
                "cpu_path is no longer a flex_attention option: flex_attention always runs "
                "compiled FlexAttention, and the CPU engines (cpu_path='engines') are the "
                "cpu_attn backend, the CPU default"
            )
        return data

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
        q_last: int32 ``[Bb, Lb]``, each query's last visible key in a step with a
            query inside an image range (``Mask.mm_prefix``), else ``None``.
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
    q_last: torch.Tensor | None = None


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
        writes: what the step writes into the planes (the new keys/values, sink
            tokens) and the slots it zeroes: past each request's length in its last
            block, which may hold anything, and FlexAttention multiplies masked
            weights, which are 0, by them. Nothing for encoder-only.
        p2l_blocks, p2l_logical: int64: physical blocks the step reads and their
            logical index, from which the physical -> logical map is made.
        scratch_rows, scratch_dest: encoder-only: rows of the scratch plane and, for
            each of the step's tokens in order, its scratch row.
    """

    num_actual_tokens: int
    kind: KVCacheSpecKind
    block_size: int
    calls: tuple[FlexCall, ...]
    limits: torch.Tensor
    writes: PlanesWrites = NO_WRITES
    p2l_blocks: torch.Tensor
    p2l_logical: torch.Tensor
    scratch_rows: int = 0
    scratch_dest: torch.Tensor | None = None
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
            rows = query_rows(call.query_len, group)
            width = num_blocks
            kv = pad_blocks(call.kv_blocks, width)
            full = pad_blocks(call.full_blocks, width)
            masks.append(
                BlockMask.from_kv_blocks(
                    call.kv_num,
                    kv,
                    call.full_num,
                    full,
                    BLOCK_SIZE=(_QUERY_TOKENS_PER_BLOCK * group, bs),
                    mask_mod=make_mask_mod(p2l, call.info, self.limits, group, bs, call.q_last),
                    seq_lengths=(rows, num_blocks * bs),
                    compute_q_blocks=False,
                )
            )
        return _Resolved(p2l=p2l, masks=tuple(masks))


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
        self.mm_prefix = mask.mm_prefix
        self._key_ends: Ints | None = None
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
        check_causal(who, self.kind, self.causal, cm)
        qsl = cm.query_start_loc_cpu.numpy().astype(np.int64)
        qlens = np.diff(qsl)
        seq = cm.seq_lens_cpu.numpy().astype(np.int64)
        check_step_lengths(
            who, self.kind, encoder=self.encoder, sink_len=self.sink_len, qlens=qlens, seq=seq
        )
        if self.encoder:
            return self._build_encoder(cm, qsl, qlens, seq)
        return self._build_paged(cm, qsl, qlens, seq)

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
        # Image ranges: each query's last visible key, for the plan and the mask_mod.
        self._key_ends = mm_prefix_key_ends(cm) if self.mm_prefix else None
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
        req_t = host_to_device(from_numpy(req_all), device)
        log_t = host_to_device(from_numpy(log_all), device)
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
            r_t = host_to_device(from_numpy(req_rep), device)
            l_t = host_to_device(from_numpy(last), device)
            o_t = host_to_device(from_numpy(offsets), device)
            tail_slots = table[r_t, l_t].to(torch.int64) * bs + o_t

        writes = step_writes(
            cm,
            encoder_keys=self.encoder_keys,
            sink_len=self.sink_len,
            block_size=bs,
            seq=seq,
            qlens=qlens,
            tail_slots=tail_slots,
        )
        return FlexAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            kind=self.kind,
            block_size=bs,
            calls=tuple(calls),
            limits=self._limits,
            writes=writes,
            p2l_blocks=p2l_blocks,
            p2l_logical=log_t,
        )

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
            key_ends=self._key_ends if block_size is None else None,
        )

    @staticmethod
    def _to_device(
        plan: CallPlan, table: torch.Tensor | None, device: torch.device, scratch_blocks: int = 0
    ) -> FlexCall:
        """Move a plan to the device; logical blocks become physical ones through the
        block table (paged kinds) or the scratch layout (encoder-only)."""

        def dev(a: npt.NDArray[Any]) -> torch.Tensor:
            return host_to_device(from_numpy(np.array(a, copy=True)), device)

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
            q_last=dev(plan.q_last) if plan.q_last is not None else None,
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
            dest = host_to_device(from_numpy(by_token), device)
            blocks = np.arange(bb * per, dtype=np.int64)
            p2l_blocks = host_to_device(from_numpy(blocks), device)
            p2l_logical = host_to_device(from_numpy(blocks % per), device)
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
        self._has_cache = rules.has_cache
        self._encoder_keys = rules.writes == "encoder"
        problems = layer_problems(
            spec, params, sink_len=rules.mask(spec).sink_len, backend=_NAME, features=_FEATURES
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
        m: object = attn_metadata
        spec = self.kv_cache_spec
        who = f"{type(self).__name__}.forward ({spec.kind.value})"
        if not isinstance(m, FlexAttentionMetadata):
            raise TypeError(
                f"{who}: attn_metadata must be FlexAttentionMetadata, got {type(m).__name__}"
            )
        check_planes(
            who,
            spec,
            key,
            value,
            kv_cache,
            has_cache=self._has_cache,
            encoder_keys=self._encoder_keys,
        )
        n = m.num_actual_tokens
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
            write_planes(k_plane, v_plane, key, value, m.writes, self.layer_params)
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
            q_rows = workspace("q", hkv * bb * lb * g * d, query).view(hkv, bb * lb, g, d)
            torch.index_select(q_heads, 1, call.q_source, out=q_rows)
            q = q_rows.view(hkv, bb, lb * g, d).transpose(0, 1)
            rows = query_rows(lb, g)
            if rows != lb * g:
                q = torch.cat([q, q.new_zeros((bb, hkv, rows - lb * g, d))], dim=2)
            score_mod = (
                make_score_mod(resolved.p2l, call.info, g, m.block_size, cap, slopes)
                if variant
                else None
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
            picked = workspace("out", hkv * m_rows * g * d, query).view(hkv, m_rows, g * d)
            torch.index_select(heads_first, 1, call.out_flat, out=picked)
            target = output if output.is_contiguous() else torch.empty_like(output)
            target.view(-1, hkv, g * d).index_copy_(0, call.out_dest, picked.transpose(0, 1))
            if target is not output:
                output.index_copy_(0, call.out_dest, target.index_select(0, call.out_dest))
        return output


class FlexAttentionBackend(AttentionBackend):
    """Compiled FlexAttention over the paged planes: on CUDA, and on CPU when selected
    by name (the CPU priority list has ``cpu_attn`` instead)."""

    name = _NAME
    description = (
        "compiled FlexAttention (torch.compile) over K/V planes: full, sliding-window, "
        "chunked-local, sink-token, encoder-only and cross; GQA, soft-cap, ALiBi; CUDA, "
        "and CPU when selected by name (each new shape compiles for seconds)"
    )
    supported_devices = frozenset({"cpu", "cuda"})
    supported_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto"})
    supported_head_sizes = _HEAD_SIZES
    supported_block_sizes = _BLOCK_SIZES
    # mm_prefix is asked by the spec (bidirectional image ranges), not the layer params.
    supported_features = _FEATURES | {AttentionFeature.MM_PREFIX}
    options_type = FlexAttentionOptions
    kv_cache_layout: ClassVar[KVCacheLayout] = "planes"
    # Every attention kind with K and V planes: the mask_mod expresses every kind's Mask
    # (causal or bidirectional, window, chunk, sink tokens), and the write plan what
    # each kind writes; MLA latents have no planes.
    builders = bind_each(
        tuple(r.spec_class for r in attention_rules() if "planes" in r.layouts),
        FlexAttentionMetadataBuilder,
        FlexAttentionImpl,
    )

    @classmethod
    @override
    def extra_environment_reasons(cls, device: torch.device) -> list[str]:
        """Compiled FlexAttention must be possible on the device (see ``_compile``): the
        backend never runs it uncompiled. A compile failure recorded in this process
        counts too."""
        return environment_problems(device)
