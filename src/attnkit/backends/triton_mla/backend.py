"""The ``triton_mla`` backend: multi-head latent attention with attnkit's Triton kernels.

Serves ``mla_attention`` and ``sliding_window_mla`` layers (DeepSeek-V2/V3's MLA,
arXiv:2405.04434 section 2.1, in its weight-absorbed form) with
``kernels.mla.triton``. The cache ``[NB, BS, D]`` holds one latent per token,
``D = R + rope``: the first ``R = kv_lora_rank`` channels are the compressed KV (the
value of every head), the last ``rope`` channels the shared rotary key. The caller
absorbs ``W_UK`` into the query, so every head scores its ``[D]`` query against the
whole latent, and up-projects the ``[T, H, R]`` output with ``W_UV`` afterwards.

The contract is the reference backend's MLA path: ``query [T, H, D]`` (absorbed),
``key [T, 1, D]`` the step's new latents, ``value`` ``None`` or the latents again,
``output [T, H, R]`` with ``R = layer_params.v_head_size`` (``None``: ``D``),
``scale`` default ``D ** -0.5``. An fp8_e4m3 cache stores ``latent / k_scale`` (one
scale for the whole latent: it is both key and value).

The builder plans each step once with ``plan_paged_attention`` (one KV head, the
layer's window), exactly as ``triton_attn`` plans a one-KV-head layer: the one-pass
kernel for mixed prefill, chunked prefill and decode, or split-KV (flash-decoding)
for plain-decode batches whose few requests would leave SMs idle. Every layer of the
group launches with that plan.

With ``layer_params.mla_projection`` (the ``mla_projection`` feature) the impl applies
``W_UK``/``W_UV`` itself: it takes the un-absorbed query ``[T, H, N + P]`` and returns
``[T, H, V]``. Batches come decodes first (``reorder_batch_threshold``); decodes always
run absorbed, and the prefill part runs in whichever form costs fewer FLOPs for the
step: absorbed, or up-projected (the latent blocks the prefills read are gathered,
up-projected to per-head keys ``[c W_UK, k_pe]`` and values ``c W_UV`` and attended by
the paged-attention kernel). The builder lays out both (``TritonMLAMetadata.prefill``);
the impl, which knows the projection's widths, picks (``mla_prefill_costs``).

Importing this module does not import triton: the builder and impl import the kernel
modules when they are constructed. On CPU the kernels run only under the Triton
interpreter (``TRITON_INTERPRET=1`` before triton is first imported).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple

import numpy as np
import numpy.typing as npt
import torch
from typing_extensions import override

from ..._validation import describe_tensor, dtype_name
from ...backend import AttentionBackend, BackendRequest
from ...binding import bind_each
from ...builder import AttentionCGSupport, AttentionMetadataBuilder
from ...capabilities import AttentionFeature, SizeRange, SizeRule
from ...config import AttentionConfig, BackendOptions
from ...impl import AttentionImpl
from ...kinds import rules_for
from ...metadata import CommonAttentionMetadata, host_to_device
from ...params import AttentionLayerParams, attention_params_problems, mla_projection_problems
from ...spec import (
    AttentionSpec,
    KVCacheDType,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)
from .._triton_env import triton_cpu_reasons
from .._triton_paged import GraphBuffers, fp8_e4m3_capability_reasons, num_sms

if TYPE_CHECKING:  # the kernel modules import triton; annotations only
    from ...kernels.attention.triton_plan import PagedAttentionPlan, SplitKVWorkspace

__all__ = [
    "DECODE_THRESHOLD",
    "MLAPrefillCosts",
    "MLAPrefillMetadata",
    "TritonMLABackend",
    "TritonMLAImpl",
    "TritonMLAMetadata",
    "TritonMLAMetadataBuilder",
    "TritonMLAOptions",
    "mla_params_problems",
    "mla_prefill_costs",
]

Ints = npt.NDArray[np.int64]
# torch.from_numpy, typed: torch leaves its parameter unannotated (pyright: Unknown).
_from_numpy: Callable[[npt.NDArray[Any]], torch.Tensor] = torch.from_numpy  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]


# What the launchers accept; kept here as literals because reading them from the kernel
# module would import triton. The test suite checks they still agree.
# Head size: the latent width D = R + rope, up to the launcher's MAX_LATENT_DIM (the
# kernel pads R and rope separately, to at least 16 each, so small widths work too).
_HEAD_SIZES: SizeRule = (SizeRange(16, 1024),)
_BLOCK_SIZES: SizeRule = (16, 32, 64, 128)
# Soft-cap, ALiBi and sink logits are not part of MLA models, and forward() has no way
# to hand a log-sum-exp back (return_lse). The projection is served (both forms).
_FEATURES: frozenset[AttentionFeature] = frozenset({AttentionFeature.MLA_PROJECTION})
# What the paged-attention kernel (the up-projected prefill) accepts; literals for the
# same reason as above, checked against the kernel module by the tests.
_PAGED_MIN_HEAD_DIM, _PAGED_MAX_HEAD_DIM = 16, 256

DECODE_THRESHOLD = 16
"""Requests with at most this many new tokens over cached context are decodes: they come
first in the batch and always run absorbed. At ``q`` queries per key the absorbed form
costs ``q * 1088`` multiply-adds per (key, head) at DeepSeek-V3's widths, the
up-projected one ``131072 + q * 512`` (docs/architecture.md): at 16 (speculative
verification, a chunk's last few tokens) absorbed is 7x cheaper."""


PrefillForm = Literal["auto", "absorbed", "up_projected"]


class TritonMLAOptions(BackendOptions):
    """Settings of ``triton_mla``: ``backend_options={"triton_mla": {...}}``.

    Attributes:
        prefill_form: how layers with ``mla_projection`` run a step's prefill part:
            ``"auto"`` (the form :func:`mla_prefill_costs` finds cheaper),
            ``"absorbed"`` or ``"up_projected"`` (for measuring both on a device; a
            layer whose widths the paged kernel cannot take then raises). Decodes
            always run absorbed; layers without a projection always run absorbed.
    """

    prefill_form: PrefillForm = "auto"


class MLAPrefillCosts(NamedTuple):
    """Multiply-adds per head of a step's prefill part in each form (see
    :func:`mla_prefill_costs`)."""

    absorbed: int
    up_projected: int


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def mla_prefill_costs(
    *,
    pairs: int,
    num_tokens: int,
    context_tokens: int,
    kv_lora_rank: int,
    rope_dim: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
) -> MLAPrefillCosts:
    """FLOPs per head (multiply-adds) of a prefill part in both forms, at the widths the
    kernels execute (each dot padded to a power of two, as their tiles are).

    Args:
        pairs: (query, key) pairs the prefills attend (causal, windowed).
        num_tokens: the prefills' query tokens.
        context_tokens: latent rows the up-projected form gathers and up-projects
            (whole blocks).
        kv_lora_rank, rope_dim, qk_nope_head_dim, v_head_dim: ``R``, ``P``, ``N``,
            ``V``.

    Absorbed: ``q_nope @ W_UK`` and ``o @ W_UV`` per query token (``R * (N + V)``), and
    per pair a score over ``R`` and ``P`` channels plus a value over ``R``.
    Up-projected: ``c @ W_UK`` and ``c @ W_UV`` per context row (``R * (N + V)``), and per
    pair a score and a value each over ``N + P`` channels (the value plane is padded to
    the key width).
    """
    rank, rope = kv_lora_rank, rope_dim
    projection = rank * (qk_nope_head_dim + v_head_dim)
    absorbed_pair = _pow2(rank) + (max(16, _pow2(rope)) if rope else 0) + _pow2(rank)
    up_pair = 2 * _pow2(qk_nope_head_dim + rope)
    return MLAPrefillCosts(
        absorbed=num_tokens * projection + pairs * absorbed_pair,
        up_projected=context_tokens * projection + pairs * up_pair,
    )


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class MLAPrefillMetadata:
    """The prefill part of a step (requests ``[num_decodes, B)``, tokens
    ``[num_decode_tokens, T)``), laid out for the up-projected form.

    Attributes:
        block_ids: int64 ``[NBt]``: the latent-cache blocks the prefills read, request
            by request (blocks wholly before every query's window are left out); the
            impl gathers them into a temporary ``[NBt, BS, D]``.
        plan: paged-attention plan of the prefills over the temporary up-projected
            cache: block table rows index ``block_ids`` positions, query offsets
            rebased to 0. Planned with one KV head; the impl sets its head count.
        num_tokens: the prefills' query tokens.
        pairs, context_tokens: the cost terms of :func:`mla_prefill_costs`.
        form: ``TritonMLAOptions.prefill_form``.
    """

    block_ids: torch.Tensor
    plan: PagedAttentionPlan
    num_tokens: int
    pairs: int
    context_tokens: int
    form: PrefillForm = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TritonMLAMetadata:
    """One MLA group's step, exactly as the Triton kernels take it.

    Attributes:
        query_start_loc: int32 ``[B+1]``.
        seq_lens: int32 ``[B]``.
        block_table: int32 ``[B, MB]``.
        slot_mapping: int64 ``[T']``; -1 = padding.
        max_query_len, max_seq_len: bounds that size the grid (Python ints).
        num_actual_tokens: ``T``; rows past it are padding.
        sliding_window: the group's window, or ``None``.
        num_splits: 0 for the one-pass kernel, ``S >= 2`` for split-KV decode (the
            plan's choice, repeated here).
        plan: the step's ``PagedAttentionPlan`` (validated metadata, path, grid); every
            layer of the group launches with it.
        num_decodes, num_decode_tokens: the leading decode requests (at most
            ``DECODE_THRESHOLD`` new tokens over cached context) and their tokens.
        decode_plan: a plan of the decodes alone, when the step has decodes and
            prefills (for projected layers whose prefills run up-projected).
        prefill: the prefill part laid out for the up-projected form, or ``None``
            (no prefill request).

    In eager builds the tensors are ``CommonAttentionMetadata``'s own (no copies); in
    CUDA-graph builds they are views of the builder's fixed-address buffers, valid
    until its next build.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    sliding_window: int | None = None
    num_splits: int = 0
    plan: PagedAttentionPlan
    num_decodes: int = 0
    num_decode_tokens: int = 0
    decode_plan: PagedAttentionPlan | None = None
    prefill: MLAPrefillMetadata | None = None


def _window_pairs(end: Ints, window: int | None) -> Ints:
    """``sum(min(k, window) for k in 1..end)`` per entry: keys seen by the queries at
    positions ``0..end-1``."""
    if window is None:
        pairs: Ints = end * (end + 1) // 2
        return pairs
    inside = np.minimum(end, window)
    pairs = inside * (inside + 1) // 2 + np.maximum(end - window, 0) * window
    return pairs


class TritonMLAMetadataBuilder(AttentionMetadataBuilder[TritonMLAMetadata, AttentionSpec]):
    """Plans an MLA group's step: ``plan_paged_attention`` with one KV head and the
    group's window.

    Eager ``build`` passes the step's tensors through (reads only Python ints and the
    CPU offsets: no device sync, no per-request loop); ``build_for_cudagraph_capture``
    copies them into fixed-address buffers first.

    Batches come decodes first (``reorder_batch_threshold = DECODE_THRESHOLD``): the
    one-pass kernel itself takes any order, but layers with ``mla_projection`` run the
    decodes and the prefills in different forms, so a step with prefills also gets a
    plan of the decodes alone and the prefill part's layout (``MLAPrefillMetadata``).
    The split is counted, not trusted: decodes are the leading requests with at most
    ``DECODE_THRESHOLD`` new tokens and cached context, so a batch in any order stays
    correct (a late decode is handled as a prefill).

    Attributes:
        num_sms: streaming multiprocessors of the device (1 off CUDA); the split-KV
            heuristic fills them.
    """

    reorder_batch_threshold: ClassVar[int | None] = DECODE_THRESHOLD

    @classmethod
    @override
    def get_cudagraph_support(
        cls, config: AttentionConfig, kv_cache_spec: KVCacheSpec
    ) -> AttentionCGSupport:
        # ALWAYS: graph builds copy the step into fixed-address buffers and plan with
        # grid bounds that depend only on the captured batch's shape (max_query_len = its
        # token count, the block table's full width, tile offsets computed on the
        # device), so any batch of that shape replays; the kernels read every
        # per-request value (offsets, lengths, blocks, slots, the fp8 scale) from
        # tensors and skip empty tiles.
        if rules_for(kv_cache_spec).latent:
            return AttentionCGSupport.ALWAYS
        return AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        spec = kv_cache_spec
        self.sliding_window = rules_for(spec).mask(spec).window
        self.num_sms: int = num_sms(device)
        self.prefill_form: PrefillForm = config.options_for(
            "triton_mla", TritonMLAOptions
        ).prefill_form
        # Imported here (after selection): importing the backend must not import triton.
        # Assigned unannotated, so the attribute keeps the function's own signature.
        from ...kernels.attention.triton_plan import plan_paged_attention

        self._plan_paged_attention = plan_paged_attention
        self._graph: GraphBuffers | None = None

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TritonMLAMetadata:
        cm = common_attn_metadata
        if not cm.causal:
            raise ValueError(
                f"{type(self).__name__}: a {self.kv_cache_spec.kind.value} group needs "
                f"causal=True, got causal={cm.causal}"
            )
        plan = self._plan_requests(cm, cm.num_reqs, cm.max_query_len, cm.max_seq_len)
        query_lens = cm.query_lens_cpu.numpy()
        seq_lens = cm.seq_lens_cpu.numpy()
        is_decode = (query_lens <= DECODE_THRESHOLD) & (seq_lens > query_lens)
        # The leading run of decodes (the runtime orders them first).
        num_decodes = int(np.argmin(is_decode)) if not is_decode.all() else cm.num_reqs
        if num_decodes == cm.num_reqs:
            return TritonMLAMetadata(
                query_start_loc=cm.query_start_loc,
                seq_lens=cm.seq_lens,
                block_table=cm.block_table_tensor,
                slot_mapping=cm.slot_mapping,
                max_query_len=cm.max_query_len,
                max_seq_len=cm.max_seq_len,
                num_actual_tokens=cm.num_actual_tokens,
                sliding_window=self.sliding_window,
                num_splits=plan.num_splits,
                plan=plan,
                num_decodes=num_decodes,
                num_decode_tokens=cm.num_actual_tokens,
            )
        num_decode_tokens = int(cm.query_start_loc_cpu[num_decodes])
        decode_plan = None
        if num_decodes:
            nd = num_decodes
            decode_plan = self._plan_requests(
                cm, nd, int(query_lens[:nd].max()), int(seq_lens[:nd].max())
            )
        return TritonMLAMetadata(
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            num_actual_tokens=cm.num_actual_tokens,
            sliding_window=self.sliding_window,
            num_splits=plan.num_splits,
            plan=plan,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            decode_plan=decode_plan,
            prefill=self._prefill(cm, num_decodes, num_decode_tokens, query_lens, seq_lens),
        )

    def _plan_requests(
        self, cm: CommonAttentionMetadata, count: int, max_query_len: int, max_seq_len: int
    ) -> PagedAttentionPlan:
        """The plan of the step's first ``count`` requests over the latent cache (split-KV
        for plain decode when the heuristic fills more SMs with it)."""
        return self._plan_paged_attention(
            cm.query_start_loc[: count + 1],
            cm.seq_lens[:count],
            cm.block_table_tensor[:count],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_size=self.kv_cache_spec.block_size,
            num_kv_heads=1,
            causal=True,
            sliding_window=self.sliding_window,
            num_tokens=int(cm.query_start_loc_cpu[count]),
            num_splits=None,
            num_sms=self.num_sms,
            query_start_loc_cpu=cm.query_start_loc_cpu[: count + 1],
            copy_to_device=host_to_device,
        )

    def _prefill(
        self,
        cm: CommonAttentionMetadata,
        num_decodes: int,
        num_decode_tokens: int,
        query_lens: Ints,
        seq_lens: Ints,
    ) -> MLAPrefillMetadata:
        """Lay out requests ``[num_decodes, B)`` for the up-projected form: which latent
        blocks to gather (host arithmetic, one gather index copy), a block table over the
        gathered blocks and the plan over it."""
        nd, bs, window = num_decodes, self.kv_cache_spec.block_size, self.sliding_window
        q = query_lens[nd:].astype(np.int64)
        s = seq_lens[nd:].astype(np.int64)
        ctx = s - q
        num_blocks = -(-s // bs)
        # Blocks wholly before the first query's window hold no key any query sees.
        first = np.maximum(ctx - window + 1, 0) // bs if window is not None else np.zeros_like(s)
        counts = num_blocks - first
        starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        total = int(counts.sum())
        rows = np.repeat(np.arange(nd, cm.num_reqs, dtype=np.int64), counts)
        cols = np.arange(total, dtype=np.int64) - np.repeat(starts - first, counts)
        width = int(num_blocks.max())
        # Row i, column j -> gathered block starts[i] + (j - first[i]), clamped into the
        # request's own range (columns before `first` are never read by the kernel).
        j = np.arange(width, dtype=np.int64)[None, :]
        table = starts[:, None] + np.minimum(
            np.maximum(j - first[:, None], 0), (counts - 1)[:, None]
        )
        index = _from_numpy(np.stack([rows, cols]))
        index = host_to_device(index, self.device)
        block_ids = cm.block_table_tensor[index[0], index[1]].to(torch.int64)
        qsl_cpu = (cm.query_start_loc_cpu[nd:] - num_decode_tokens).to(torch.int32)
        plan = self._plan_paged_attention(
            host_to_device(qsl_cpu.clone(), self.device),
            cm.seq_lens[nd:],
            host_to_device(_from_numpy(table.astype(np.int32)), self.device),
            max_query_len=int(q.max()),
            max_seq_len=int(s.max()),
            block_size=bs,
            num_kv_heads=1,
            causal=True,
            sliding_window=window,
            num_tokens=int(q.sum()),
            num_splits=0,
            query_start_loc_cpu=qsl_cpu,
            copy_to_device=host_to_device,
        )
        pairs = int((_window_pairs(s, window) - _window_pairs(ctx, window)).sum())
        return MLAPrefillMetadata(
            block_ids=block_ids,
            plan=plan,
            num_tokens=int(q.sum()),
            pairs=pairs,
            context_tokens=total * bs,
            form=self.prefill_form,
        )

    @override
    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> TritonMLAMetadata:
        """Copy the step into fixed-address buffers; call it for the capture and before
        every replay of a batch of the same shape (``num_reqs`` and token count).

        Raises:
            ValueError: a non-causal batch.
            RuntimeError: a step larger than the config's ``max_num_reqs`` /
                ``max_num_batched_tokens`` / ``max_model_len``.
        """
        cm = common_attn_metadata
        if not cm.causal:
            raise ValueError(
                f"{type(self).__name__}: a {self.kv_cache_spec.kind.value} group needs "
                f"causal=True, got causal={cm.causal}"
            )
        step = self._graph_buffers().load(type(self).__name__, cm)
        # Tile offsets computed on the device into a fixed buffer; the grid is the
        # plan's shape-only bound, so every batch of this shape replays.
        plan = self._plan_paged_attention(
            step.query_start_loc,
            step.seq_lens,
            step.block_table,
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            block_size=self.kv_cache_spec.block_size,
            num_kv_heads=1,
            causal=True,
            sliding_window=self.sliding_window,
            num_tokens=step.num_tokens,
            num_splits=0,
            tile_offsets_out=step.tile_offsets,
        )
        return TritonMLAMetadata(
            query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens,
            block_table=step.block_table,
            slot_mapping=step.slot_mapping,
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            num_actual_tokens=cm.num_actual_tokens,
            sliding_window=self.sliding_window,
            num_splits=0,
            plan=plan,
            num_decodes=cm.num_reqs,
            num_decode_tokens=cm.num_actual_tokens,
        )

    def _graph_buffers(self) -> GraphBuffers:
        if self._graph is None:
            self._graph = GraphBuffers.allocate(
                self.config, self.kv_cache_spec.block_size, self.device
            )
        return self._graph


def mla_params_problems(spec: AttentionSpec, params: AttentionLayerParams) -> list[str]:
    """What keeps ``triton_mla`` from running an MLA layer with ``params`` (empty: nothing).

    The generic checks (features, sink tokens, head counts) of
    ``attention_params_problems``, plus MLA's own: the values are the latent's first
    ``v_head_size`` channels, so ``v_head_size`` (the kv_lora_rank) must be at most the
    latent width.
    """
    # v_head_size and the projection are checked here: narrower values are what MLA is.
    generic = dataclasses.replace(params, v_head_size=None, mla_projection=None)
    problems = attention_params_problems(
        spec, generic, backend="triton_mla", supported_features=_FEATURES
    )
    if params.mla_projection is not None:
        return problems + mla_projection_problems(spec, params)
    rank = params.v_head_size
    if rank is not None and rank > spec.head_size:
        problems.append(
            f"v_head_size (the kv_lora_rank) must be at most the latent width "
            f"head_size={spec.head_size}, got {rank}"
        )
    return problems


def _check_tensor(
    owner: str,
    name: str,
    t: object,
    *,
    layout: str,
    shape: tuple[int | None, ...],
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check ``t``'s rank, sizes (``None`` = any), dtype and device.

    Raises:
        TypeError: ``t`` is not a tensor.
        ValueError: naming ``owner``, ``name``, what was expected and what was given.
    """
    if not isinstance(t, torch.Tensor):
        got = "None" if t is None else f"a {type(t).__name__}"
        want = _want(layout, shape, dtype, device)
        raise TypeError(f"{owner}: {name} must be a torch.Tensor {want}, got {got}")
    if (
        t.dim() != len(shape)
        or any(w is not None and g != w for g, w in zip(t.shape, shape, strict=True))
        or t.dtype != dtype
        or (device is not None and t.device != device)
    ):
        want = _want(layout, shape, dtype, device)
        raise ValueError(f"{owner}: {name} must be {want}, got {describe_tensor(t)}")
    return t


def _want(
    layout: str, shape: tuple[int | None, ...], dtype: torch.dtype, device: torch.device | None
) -> str:
    """``"float16 [NB, BS, D]=[*, 16, 48] on cpu"``, for messages (built only for one)."""
    sizes = ", ".join("*" if d is None else str(d) for d in shape)
    where = "" if device is None else f" on {device}"
    return f"{dtype_name(dtype)} {layout}=[{sizes}]{where}"


class TritonMLAImpl(AttentionImpl[TritonMLAMetadata, AttentionSpec, AttentionLayerParams]):
    """Writes the step's latents with ``write_mla_latents``, then runs ``mla_attention``
    with the step's plan (the one-pass kernel, or split-KV when the plan chose it).

    With ``layer_params.mla_projection`` the query is un-absorbed ``[T, H, N + P]`` and
    the output ``[T, H, V]``: decodes run absorbed (``q_nope @ W_UK`` in, ``@ W_UV``
    out, around the same kernel); the step's prefill part runs absorbed too, or
    up-projected when :func:`mla_prefill_costs` says that costs fewer FLOPs and the
    paged-attention kernel takes ``N + P`` as a head size.

    Attributes:
        kv_lora_rank: ``R``, the latent output width (``layer_params.v_head_size``, or
            the whole latent when it is ``None``; the projection's ``R`` with one).
        scale: the softmax scale (``layer_params.scale``, default ``D ** -0.5`` with
            ``D`` the latent width, as in the reference backend; ``(N + P) ** -0.5``
            with a projection).
        projection: ``layer_params.mla_projection``.
        up_projection_possible: whether prefills may run up-projected (``N + P`` within
            the paged kernel's head sizes and ``V <= N + P``).

    Raises at construction (so a bad layer fails before its first step):
        ValueError: ``layer_params`` asks for a feature the backend does not declare,
            or does not fit the spec.
    """

    def __init__(self, kv_cache_spec: AttentionSpec, layer_params: AttentionLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        problems = mla_params_problems(kv_cache_spec, layer_params)
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
        self.num_heads = layer_params.num_heads
        self.head_size = kv_cache_spec.head_size
        self.projection = layer_params.mla_projection
        self.kv_lora_rank: int = (
            layer_params.v_head_size if layer_params.v_head_size is not None else self.head_size
        )
        self.query_size = self.head_size
        self.up_projection_possible = False
        if self.projection is not None:
            self.kv_lora_rank = self.projection.kv_lora_rank
            self.rope_dim = self.head_size - self.kv_lora_rank
            self.query_size = self.projection.qk_nope_head_dim + self.rope_dim
            self.up_projection_possible = (
                _PAGED_MIN_HEAD_DIM <= self.query_size <= _PAGED_MAX_HEAD_DIM
                and self.projection.v_head_dim <= self.query_size
            )
        self.scale: float = (
            layer_params.scale if layer_params.scale is not None else self.query_size**-0.5
        )
        self.fp8 = kv_cache_spec.kv_cache_dtype == "fp8_e4m3"
        # The fp8 scale on the layer's device, made on the first forward (the device is
        # not known before) and reused, so later steps and graph replays allocate nothing.
        self._kv_scale: torch.Tensor | None = None
        self._workspace: SplitKVWorkspace | None = None
        # Imported here, not at module level: importing the backend must not import
        # triton (and on CPU, triton must be imported after TRITON_INTERPRET is set).
        # Assigned unannotated, so each attribute keeps the launcher's own signature.
        from ...kernels.attention.triton import paged_attention
        from ...kernels.mla.triton import (
            mla_attention,
            mla_split_workspace,
            write_mla_latents,
        )

        self._mla_attention = mla_attention
        self._mla_split_workspace = mla_split_workspace
        self._write_mla_latents = write_mla_latents
        self._paged_attention = paged_attention

    def _scale_tensor(self, device: torch.device) -> torch.Tensor | None:
        """float32 ``[1]`` holding ``k_scale`` on ``device`` for fp8 caches, else None."""
        if not self.fp8:
            return None
        if self._kv_scale is None or self._kv_scale.device != device:
            self._kv_scale = torch.tensor(
                [float(self.layer_params.k_scale)], dtype=torch.float32, device=device
            )
        return self._kv_scale

    def _split_workspace(
        self, num_splits: int, num_tokens: int, device: torch.device
    ) -> SplitKVWorkspace:
        """Scratch of the split path, grown when a step needs more (reused otherwise)."""
        ws = self._workspace
        if ws is None or ws[0].shape[0] < num_splits or ws[0].shape[1] < num_tokens:
            splits = max(num_splits, ws[0].shape[0] if ws else 0)
            tokens = max(num_tokens, ws[0].shape[1] if ws else 0)
            ws = self._mla_split_workspace(
                splits, tokens, self.num_heads, self.kv_lora_rank, device=device
            )
            self._workspace = ws
        return ws

    def _check_inputs(
        self,
        key: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: object,
        device: torch.device,
    ) -> torch.Tensor:
        """The backend's own rules (no device reads): its metadata, the latent cache's
        layout and the projection's device; return the cache tensor. The query, the
        latents and the output were checked against the layer by the runtime
        (``attnkit.runtime._boundary``); only the latents' presence is checked here."""
        spec = self.kv_cache_spec
        owner = f"{type(self).__name__}.forward ({spec.kind.value})"
        if not isinstance(attn_metadata, TritonMLAMetadata):
            raise TypeError(
                f"{owner}: attn_metadata must be TritonMLAMetadata, "
                f"got {type(attn_metadata).__name__}"
            )
        if key is None:
            raise TypeError(
                f"{owner}: key (the new latents) must be a torch.Tensor [T, 1, D], got None"
            )
        if self.projection is not None and self.projection.w_uk.device != device:
            raise ValueError(
                f"{owner}: layer_params.mla_projection must be on the query's device "
                f"{device}, got its weights on {self.projection.w_uk.device}"
            )
        if len(kv_cache) != 1:
            raise ValueError(f"{owner}: kv_cache must hold 1 tensor, got {len(kv_cache)}")
        return _check_tensor(
            owner,
            "kv_cache[0]",
            kv_cache[0],
            layout="[NB, BS, D]",
            shape=(None, spec.block_size, self.head_size),
            dtype=spec.cache_torch_dtype,
            device=device,
        )

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: TritonMLAMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Write the new latents (``key[:T, 0]``) into the cache, then attend.

        ``value`` is ignored (the latents are written once, from ``key``).
        """
        cache = self._check_inputs(key, kv_cache, attn_metadata, query.device)
        assert key is not None  # checked above
        m = attn_metadata
        n = m.num_actual_tokens
        kv_scale = self._scale_tensor(query.device)
        self._write_mla_latents(key[:n, 0], cache, m.slot_mapping[:n], kv_scale=kv_scale)
        if self.projection is None:
            return self._latent_attention(query, cache, m.plan, kv_scale, output)
        if m.prefill is None or not self.prefers_up_projection(m.prefill):
            # Rows past num_actual_tokens (padding) are left untouched, as the kernel does.
            self._absorbed(query[:n], cache, m.plan, kv_scale, output[:n])
            return output
        nd = m.num_decode_tokens
        if m.decode_plan is not None:
            self._absorbed(query[:nd], cache, m.decode_plan, kv_scale, output[:nd])
        end = nd + m.prefill.num_tokens
        self._up_projected(query[nd:end], cache, m.prefill, output[nd:end])
        return output

    @property
    def output_size(self) -> int:
        """Width of ``forward``'s output: ``R``, or ``V`` with a projection."""
        return self.projection.v_head_dim if self.projection is not None else self.kv_lora_rank

    def prefers_up_projection(self, prefill: MLAPrefillMetadata) -> bool:
        """Whether this layer runs ``prefill`` up-projected: possible for its widths and
        fewer FLOPs than absorbed (:func:`mla_prefill_costs`)."""
        proj = self.projection
        if proj is None or prefill.form == "absorbed":
            return False
        if prefill.form == "up_projected" and not self.up_projection_possible:
            raise ValueError(
                f"{type(self).__name__}: backend_options prefill_form='up_projected' needs "
                f"qk_nope_head_dim + rope in [{_PAGED_MIN_HEAD_DIM}, {_PAGED_MAX_HEAD_DIM}] "
                f"and v_head_dim <= that (the paged-attention kernel's head sizes), got "
                f"N + P = {self.query_size}, V = {proj.v_head_dim}"
            )
        if prefill.form == "up_projected":
            return True
        if not self.up_projection_possible:
            return False
        costs = mla_prefill_costs(
            pairs=prefill.pairs,
            num_tokens=prefill.num_tokens,
            context_tokens=prefill.context_tokens,
            kv_lora_rank=self.kv_lora_rank,
            rope_dim=self.rope_dim,
            qk_nope_head_dim=proj.qk_nope_head_dim,
            v_head_dim=proj.v_head_dim,
        )
        return costs.up_projected < costs.absorbed

    def _latent_attention(
        self,
        query: torch.Tensor,
        cache: torch.Tensor,
        plan: PagedAttentionPlan,
        kv_scale: torch.Tensor | None,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """The kernel on an absorbed query: ``output [T, H, R]``."""
        workspace = (
            self._split_workspace(plan.num_splits, query.shape[0], query.device)
            if plan.num_splits
            else None
        )
        return self._mla_attention(
            query,
            cache,
            plan,
            kv_lora_rank=self.kv_lora_rank,
            scale=self.scale,
            kv_scale=kv_scale,
            output=output,
            workspace=workspace,
        )

    def _absorbed(
        self,
        query: torch.Tensor,
        cache: torch.Tensor,
        plan: PagedAttentionPlan,
        kv_scale: torch.Tensor | None,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """``q_nope @ W_UK`` next to ``q_pe`` (one batched matmul over heads), the kernel,
        then ``@ W_UV``: ``output [T, H, V]``."""
        proj = self.projection
        assert proj is not None  # only called with a projection
        tokens, nope, rank = query.shape[0], proj.qk_nope_head_dim, self.kv_lora_rank
        q_abs = query.new_empty((tokens, self.num_heads, self.head_size))
        # [H, T, N] @ [H, N, R] -> [H, T, R], written through a transposed view.
        torch.matmul(
            query[:, :, :nope].transpose(0, 1),
            proj.w_uk.transpose(1, 2),
            out=q_abs[:, :, :rank].transpose(0, 1),
        )
        q_abs[:, :, rank:] = query[:, :, nope:]
        latent_out = query.new_empty((tokens, self.num_heads, rank))
        self._latent_attention(q_abs, cache, plan, kv_scale, latent_out)
        # [H, T, R] @ [H, R, V] -> [H, T, V].
        output.transpose(0, 1).copy_(torch.matmul(latent_out.transpose(0, 1), proj.w_uv))
        return output

    def _up_projected(
        self,
        query: torch.Tensor,
        cache: torch.Tensor,
        prefill: MLAPrefillMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Gather the prefills' latent blocks, up-project them into a temporary paged K/V
        cache ``[NBt, 2, BS, H, N + P]`` (keys ``[c W_UK, k_pe]``, values ``c W_UV``
        zero-padded to the key width), and run the paged-attention kernel over it."""
        proj = self.projection
        assert proj is not None  # only called with a projection
        rank, nope, v_dim = self.kv_lora_rank, proj.qk_nope_head_dim, proj.v_head_dim
        heads, width = self.num_heads, self.query_size
        latents = cache[prefill.block_ids]  # [NBt, BS, D]
        if self.fp8:
            latents = (latents.float() * float(self.layer_params.k_scale)).to(query.dtype)
        blocks, block_size = latents.shape[0], latents.shape[1]
        c = latents[:, :, :rank].reshape(blocks * block_size, rank)
        kv = query.new_empty((blocks, 2, block_size, heads, width))
        # [S, R] @ [H, R, N] -> [H, S, N] (c broadcast over heads, no copy).
        k_nope = torch.matmul(c, proj.w_uk).view(heads, blocks, block_size, nope)
        kv[:, 0, :, :, :nope] = k_nope.permute(1, 2, 0, 3)
        kv[:, 0, :, :, nope:] = latents[:, :, None, rank:]
        v = torch.matmul(c, proj.w_uv).view(heads, blocks, block_size, v_dim)
        kv[:, 1, :, :, :v_dim] = v.permute(1, 2, 0, 3)
        if v_dim < width:
            kv[:, 1, :, :, v_dim:] = 0
        plan = dataclasses.replace(prefill.plan, num_kv_heads=heads)
        full = output if v_dim == width else query.new_empty((query.shape[0], heads, width))
        self._paged_attention(query, kv, plan, scale=self.scale, output=full)
        if full is not output:
            output.copy_(full[:, :, :v_dim])
        return output


class TritonMLABackend(AttentionBackend):
    """Multi-head latent attention (DeepSeek-V2/V3) in Triton: full and sliding-window MLA."""

    name = "triton_mla"
    description = (
        "Triton multi-head latent attention (absorbed MLA): full and sliding-window, "
        "fp8 latent cache, split-KV decode, CUDA graphs"
    )
    supported_devices = frozenset({"cpu", "cuda"})
    supported_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto", "fp8_e4m3"})
    supported_head_sizes = _HEAD_SIZES
    supported_block_sizes = _BLOCK_SIZES
    supported_features = _FEATURES
    options_type = TritonMLAOptions
    required_packages: ClassVar[Mapping[str, str]] = {"triton": "triton>=3.0"}
    builders = bind_each(
        (MLAAttentionSpec, SlidingWindowMLASpec), TritonMLAMetadataBuilder, TritonMLAImpl
    )

    @classmethod
    @override
    def extra_environment_reasons(cls, device: torch.device) -> list[str]:
        """On CPU, the Triton interpreter must be on (read from the environment now)."""
        return triton_cpu_reasons(device)

    @classmethod
    @override
    def extra_not_supported_reasons(cls, request: BackendRequest) -> list[str]:
        """fp8_e4m3 caches need compute capability >= 8.9 on CUDA (see
        ``fp8_e4m3_capability_reasons``; the rule ``triton_attn`` declares)."""
        return fp8_e4m3_capability_reasons(request)
