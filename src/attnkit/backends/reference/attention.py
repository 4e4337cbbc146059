"""The reference backend's attention path: one metadata type, one builder, one impl
for every attention kind.

The builder passes the step's tensors through untouched and adds the kind's
parameters from the spec; the impl writes the new keys/values through the slot
mapping and runs the pure-torch kernels of ``attnkit.kernels.attention.reference``
(float32 accumulation). What each kind does in ``forward``:

* ``full_attention``, ``sliding_window``, ``chunked_local_attention``: cache
  ``[NB, 2, BS, Hkv, D]``; causal paged attention, with the window or chunk mask.
* ``sink_full_attention``: as full attention over positions shifted by ``sink_len``;
  on a request's first step the layer's ``sink_key``/``sink_value`` are written into
  the slots of positions ``0..sink_len-1`` (the builder finds them).
* ``mla_attention``, ``sliding_window_mla``: cache ``[NB, BS, D]``, one latent per
  token; the latent is the key of every head, and its first ``v_head_size`` channels
  are the value. The cache is read as a one-head K=V cache (a stride-0 view, no copy).
* ``encoder_only_attention``: no cache; each request attends bidirectionally to its
  own keys/values of this step.
* ``cross_attention``: the encoder keys/values are written when given (first ``E``
  slot-mapping entries); queries attend bidirectionally to the cached encoder tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch
from typing_extensions import override

from ...builder import AttentionCGSupport, AttentionMetadataBuilder
from ...config import AttentionConfig
from ...impl import AttentionImpl
from ...kernels.attention.reference import dense_attention, paged_attention, write_kv_cache
from ...kernels.dsa.reference import sparse_mla_attention
from ...kinds import rules_for
from ...metadata import CommonAttentionMetadata, SparseSelection
from ...params import AttentionLayerParams, mla_projection_problems, quant_scale_problems
from ...spec import AttentionSpec
from ._checks import check_tensor, describe

__all__ = [
    "ReferenceAttentionBuilder",
    "ReferenceAttentionImpl",
    "ReferenceAttentionMetadata",
]

@dataclasses.dataclass(frozen=True, kw_only=True)
class ReferenceAttentionMetadata:
    """One attention group's step, as the reference kernels take it.

    The tensors are ``CommonAttentionMetadata``'s own (no copies).

    Attributes:
        num_actual_tokens: ``T``, the step's real tokens (inputs may be padded past it).
        query_start_loc: int32 ``[B+1]`` on the device.
        query_start_loc_cpu: the same on the CPU (encoder-only layers loop over it).
        seq_lens: int32 ``[B]`` on the device (see the per-kind table in the docs).
        block_table: int32 ``[B, MB]`` on the device.
        slot_mapping: int64 ``[T']`` on the device; -1 = do not write.
        causal: whether queries see only earlier positions (False for encoder-only
            and cross attention).
        sliding_window: the window of a sliding-window layer, else ``None``.
        chunk_size: the chunk of a chunked-local layer, else ``None``.
        sink_len: sink tokens in front of each context (0 unless sink_full_attention).
        sink_slot_mapping: int64 ``[R * sink_len]``: the sink slots of the ``R``
            requests in their first step, in batch order; ``None`` when there are none.
        context_shard, global_seq_lens: ``CommonAttentionMetadata``'s, for
            ``forward_partial`` (decode context parallelism); ``None`` otherwise.
        draft_ancestors, draft_counts: the step's draft trees
            (``CommonAttentionMetadata.draft_tree``), else ``None``.
        mm_prefix_ranges: ``CommonAttentionMetadata.mm_prefix_ranges`` (int32
            ``[B, R, 2]``) for a layer whose spec sets ``mm_prefix``, else ``None``.
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool
    sliding_window: int | None = None
    chunk_size: int | None = None
    sink_len: int = 0
    sink_slot_mapping: torch.Tensor | None = None
    context_shard: tuple[int, int] | None = None
    global_seq_lens: torch.Tensor | None = None
    draft_ancestors: torch.Tensor | None = None
    draft_counts: torch.Tensor | None = None
    mm_prefix_ranges: torch.Tensor | None = None


class ReferenceAttentionBuilder(
    AttentionMetadataBuilder[ReferenceAttentionMetadata, AttentionSpec]
):
    """Builds ``ReferenceAttentionMetadata`` for any attention kind."""

    # The torch kernels read lengths back to the host: nothing can be captured.
    cudagraph_support = AttentionCGSupport.NEVER

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
        self.causal = mask.causal
        self.sliding_window = mask.window
        self.chunk_size = mask.chunk
        self.sink_len = mask.sink_len
        self.mm_prefix = mask.mm_prefix
        self.has_cache = rules.has_cache

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ReferenceAttentionMetadata:
        cm = common_attn_metadata
        if cm.causal is not self.causal:
            raise ValueError(
                f"ReferenceAttentionBuilder: common_attn_metadata.causal must be {self.causal} "
                f"for {self.kind.value} layers, got {cm.causal}"
            )
        if not self.has_cache:
            differ = cm.seq_lens_cpu != cm.query_lens_cpu
            if bool(differ.any()):
                b = int(torch.nonzero(differ)[0, 0])
                raise ValueError(
                    f"ReferenceAttentionBuilder: {self.kind.value} keeps no cache and encodes "
                    f"a request whole in one step, so seq_lens must equal the query lengths; request "
                    f"{b} has seq_lens={int(cm.seq_lens_cpu[b])} and "
                    f"query length {int(cm.query_lens_cpu[b])}"
                )
        return ReferenceAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=cm.query_start_loc,
            query_start_loc_cpu=cm.query_start_loc_cpu,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            causal=self.causal,
            sliding_window=self.sliding_window,
            chunk_size=self.chunk_size,
            sink_len=self.sink_len,
            sink_slot_mapping=self._sink_slots(cm) if self.sink_len else None,
            context_shard=cm.context_shard,
            global_seq_lens=cm.global_seq_lens_cpu,
            draft_ancestors=None if cm.draft_tree is None else cm.draft_tree.ancestors,
            draft_counts=None if cm.draft_tree is None else cm.draft_tree.num_drafts,
            mm_prefix_ranges=cm.mm_prefix_ranges if self.mm_prefix else None,
        )

    def _sink_slots(self, cm: CommonAttentionMetadata) -> torch.Tensor | None:
        """The sink slots of the requests in their first step (host decides, device computes).

        A request is new when its context before the step is exactly ``sink_len``.
        """
        sink_len, block_size = self.sink_len, self.kv_cache_spec.block_size
        context = cm.seq_lens_cpu - cm.query_lens_cpu
        short = context < sink_len
        if bool(short.any()):
            b = int(torch.nonzero(short)[0, 0])
            raise ValueError(
                f"ReferenceAttentionBuilder: {self.kind.value} seq_lens must count the "
                f"sink_len={sink_len} sink tokens, but request {b} has seq_lens - query_lens = "
                f"{int(context[b])} < {sink_len}"
            )
        new = torch.nonzero(context == sink_len).flatten()
        if new.numel() == 0:
            return None
        needed = -(-sink_len // block_size)
        table = cm.block_table_tensor
        if table.shape[1] < needed:
            raise ValueError(
                f"ReferenceAttentionBuilder: block_table_tensor must cover the {sink_len} sink "
                f"slots ({needed} blocks of {block_size}), got {describe(table)}"
            )
        rows = new.to(table.device)
        positions = torch.arange(sink_len, device=table.device)
        blocks = table[rows[:, None], (positions // block_size)[None, :]]  # [R, sink_len]
        slots = blocks.to(torch.int64) * block_size + positions % block_size
        return slots.reshape(-1)


class ReferenceAttentionImpl(
    AttentionImpl[ReferenceAttentionMetadata, AttentionSpec, AttentionLayerParams]
):
    """Runs one attention layer of any kind with the pure-torch kernels.

    Args:
        kv_cache_spec: the layer's ``AttentionSpec``.
        layer_params: its ``AttentionLayerParams`` (required). With ``return_lse``,
            ``forward_lse`` also writes each row's log-sum-exp (every kind; not a
            sparse layer's ``forward_sparse``).
    """

    def __init__(self, kv_cache_spec: AttentionSpec, layer_params: AttentionLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        owner = "ReferenceAttentionImpl"
        spec, params = kv_cache_spec, layer_params
        if params.num_heads % spec.num_kv_heads:
            raise ValueError(
                f"{owner}: layer_params.num_heads={params.num_heads} must be a multiple of "
                f"the spec's num_kv_heads={spec.num_kv_heads}"
            )
        self.kind = spec.kind
        rules = rules_for(spec)
        self.is_mla = rules.latent
        self.has_cache = rules.has_cache
        # Cross attention: the cache holds the encoder's tokens, written when given.
        self.encoder_keys = rules.writes == "encoder"
        sink_len = rules.mask(spec).sink_len
        # Where forward_partial wants the lse (set only for the length of that call).
        self._lse_out: torch.Tensor | None = None
        self.num_heads = params.num_heads
        self.head_size = spec.head_size
        self.v_head_size = params.v_head_size if params.v_head_size is not None else spec.head_size
        # MLA with the projection: the impl absorbs W_UK into the query and applies W_UV
        # to the latent output itself (the absorbed form for every step: the oracle).
        self.projection = params.mla_projection
        self.query_size = spec.head_size
        if self.projection is not None:
            problems = mla_projection_problems(spec, params)
            if problems:
                raise ValueError(f"{owner}: layer_params.mla_projection: " + "; ".join(problems))
            self.rank = self.projection.kv_lora_rank
            self.query_size = self.projection.qk_nope_head_dim + spec.head_size - self.rank
        elif self.is_mla and self.v_head_size > spec.head_size:
            raise ValueError(
                f"{owner}: layer_params.v_head_size must be <= the latent width "
                f"head_size={spec.head_size}, got {self.v_head_size}"
            )
        if params.index_topk is not None and (not self.is_mla or self.projection is not None):
            raise ValueError(
                f"{owner}: layer_params.index_topk (sparse attention) is for MLA layers "
                f"without mla_projection, got a {self.kind.value} layer"
                + (" with mla_projection" if self.projection is not None else "")
            )
        if not self.is_mla and self.v_head_size != spec.head_size:
            raise ValueError(
                f"{owner}: layer_params.v_head_size must be None or head_size={spec.head_size} "
                f"for a {self.kind.value} layer (only MLA values are narrower), "
                f"got {self.v_head_size}"
            )
        self.scale = params.scale if params.scale is not None else self.query_size**-0.5
        scale_problems = quant_scale_problems(spec, params)
        if scale_problems:
            raise ValueError(f"{owner}: layer_params.{scale_problems[0]}")
        # fp8 caches store key / k_scale and value / v_scale; 1.0 changes nothing. Per-head
        # scales are float32 [Hkv] tensors (moved to the cache's device when used); a
        # *_per_token_head cache keeps its scales in kv_cache[1].
        self.k_scale: float | torch.Tensor = _scale_of(params.k_scale)
        self.v_scale: float | torch.Tensor = _scale_of(params.v_scale)
        # An MLA latent keeps one per-tensor scale (per-head ones are refused above).
        self.latent_scale = 1.0 if isinstance(params.k_scale, tuple) else float(params.k_scale)
        self.dynamic_scales = spec.dynamic_kv_scales
        self.alibi_slopes = (
            torch.tensor(params.alibi_slopes, dtype=torch.float32)
            if params.alibi_slopes is not None
            else None
        )
        if sink_len:
            want = (sink_len, spec.num_kv_heads, spec.head_size)
            if params.sink_key is None or tuple(params.sink_key.shape) != want:
                got = "None" if params.sink_key is None else describe(params.sink_key)
                raise ValueError(
                    f"{owner}: a {self.kind.value} layer needs layer_params.sink_key and "
                    f"sink_value of shape [sink_len, Hkv, D]={list(want)}, got {got}"
                )
        elif params.sink_key is not None:
            raise ValueError(
                f"{owner}: layer_params.sink_key/sink_value are only used by "
                f"sink_full_attention layers, got them for a {self.kind.value} layer"
            )

    # ------------------------------------------------------------------ checks

    def _check_inputs(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: object,
        output: torch.Tensor,
    ) -> torch.Tensor | None:
        """Check every argument; return the cache tensor (``None`` for encoder-only)."""
        owner = f"ReferenceAttentionImpl.forward ({self.kind.value})"
        if not isinstance(attn_metadata, ReferenceAttentionMetadata):
            raise TypeError(
                f"{owner}: attn_metadata must be ReferenceAttentionMetadata, "
                f"got {type(attn_metadata).__name__}"
            )
        query = check_tensor(
            owner,
            "query",
            query,
            layout="[T, Hq, N + P]" if self.projection is not None else "[T, Hq, D]",
            shape=(None, self.num_heads, self.query_size),
            dtype=self.kv_cache_spec.dtype,
        )
        if self.projection is not None and self.projection.w_uk.device != query.device:
            raise ValueError(
                f"{owner}: layer_params.mla_projection must be on the query's device "
                f"{query.device}, got its weights on {self.projection.w_uk.device}"
            )
        device, tokens = query.device, query.shape[0]
        if tokens < attn_metadata.num_actual_tokens:
            raise ValueError(
                f"{owner}: query must have at least num_actual_tokens="
                f"{attn_metadata.num_actual_tokens} rows, got {describe(query)}"
            )
        check_tensor(
            owner,
            "output",
            output,
            layout="[T, Hq, Dv]",
            shape=(tokens, self.num_heads, self.v_head_size),
            dtype=query.dtype,
            device=device,
        )
        kv_heads = self.kv_cache_spec.num_kv_heads
        if self.is_mla:
            check_tensor(
                owner,
                "key (the new latents)",
                key,
                layout="[T, 1, D]",
                shape=(tokens, 1, self.head_size),
                dtype=query.dtype,
                device=device,
            )
            if value is not None:
                check_tensor(
                    owner,
                    "value (None or the latents again)",
                    value,
                    layout="[T, 1, D]",
                    shape=(tokens, 1, self.head_size),
                    dtype=query.dtype,
                    device=device,
                )
        elif self.encoder_keys:
            if (key is None) != (value is None):
                raise ValueError(
                    f"{owner}: key and value must both be the encoder states or both be "
                    f"None, got {describe(key)} and {describe(value)}"
                )
            if key is not None:
                key = check_tensor(
                    owner,
                    "key (encoder states)",
                    key,
                    layout="[E, Hkv, D]",
                    shape=(None, kv_heads, self.head_size),
                    dtype=query.dtype,
                    device=device,
                )
                check_tensor(
                    owner,
                    "value (encoder states)",
                    value,
                    layout="[E, Hkv, D]",
                    shape=tuple(key.shape),
                    dtype=query.dtype,
                    device=device,
                )
                if attn_metadata.slot_mapping.shape[0] < key.shape[0]:
                    raise ValueError(
                        f"{owner}: slot_mapping must have an entry for each of the "
                        f"E={key.shape[0]} encoder tokens, got {describe(attn_metadata.slot_mapping)}"
                    )
        else:
            for name, t in (("key", key), ("value", value)):
                check_tensor(
                    owner,
                    name,
                    t,
                    layout="[T, Hkv, D]",
                    shape=(tokens, kv_heads, self.head_size),
                    dtype=query.dtype,
                    device=device,
                )

        if not self.has_cache:
            if len(kv_cache) != 0:
                raise ValueError(
                    f"{owner}: kv_cache must be empty ({self.kind.value} layers keep no cache), "
                    f"got {len(kv_cache)} tensors"
                )
            return None
        want = 2 if self.dynamic_scales else 1
        if len(kv_cache) != want:
            raise ValueError(
                f"{owner}: kv_cache must hold {want} tensor{'s' if want > 1 else ''}, "
                f"got {len(kv_cache)}"
            )
        cache = kv_cache[0]
        bs = self.kv_cache_spec.block_size
        if self.dynamic_scales:
            check_tensor(
                owner,
                "kv_cache[1] (the per-token-head scales)",
                kv_cache[1],
                layout="[NB, 2, BS, Hkv]",
                shape=(cache.shape[0] if cache.dim() == 5 else None, 2, bs, kv_heads),
                dtype=torch.float32,
                device=device,
            )
        shape: tuple[int | None, ...]
        if self.is_mla:
            layout, shape = "[NB, BS, D]", (None, bs, self.head_size)
        else:
            layout, shape = "[NB, 2, BS, Hkv, D]", (None, 2, bs, kv_heads, self.head_size)
        return check_tensor(
            owner,
            "kv_cache[0]",
            cache,
            layout=layout,
            shape=shape,
            dtype=self.kv_cache_spec.cache_torch_dtype,
            device=device,
        )

    # ------------------------------------------------------------------ forward

    @override
    def forward_partial(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceAttentionMetadata,
        output: torch.Tensor,
        lse: torch.Tensor,
    ) -> torch.Tensor:
        """``forward`` over one context-parallel shard, with the partial's lse."""
        owner = f"ReferenceAttentionImpl.forward_partial ({self.kind.value})"
        if not isinstance(attn_metadata, ReferenceAttentionMetadata):
            raise TypeError(
                f"{owner}: attn_metadata must be ReferenceAttentionMetadata, "
                f"got {type(attn_metadata).__name__}"
            )
        if attn_metadata.context_shard is None:
            raise ValueError(
                f"{owner}: the metadata has no context_shard (the group is not sharded "
                f"by context); call forward"
            )
        return self._with_lse(owner, query, key, value, kv_cache, attn_metadata, output, lse)

    @override
    def forward_lse(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceAttentionMetadata,
        output: torch.Tensor,
        lse: torch.Tensor,
    ) -> torch.Tensor:
        """``forward`` with each row's log-sum-exp in ``lse [T, Hq]``."""
        owner = f"ReferenceAttentionImpl.forward_lse ({self.kind.value})"
        if not self.layer_params.return_lse:
            raise ValueError(
                f"{owner}: the layer was built without layer_params.return_lse=True, "
                f"got an lse to fill"
            )
        shard = getattr(attn_metadata, "context_shard", None)  # the type is checked below
        if shard is not None:
            raise ValueError(
                f"{owner}: the group is sharded by context (context_shard={shard}); its "
                f"result is partial, call forward_partial"
            )
        return self._with_lse(owner, query, key, value, kv_cache, attn_metadata, output, lse)

    def _with_lse(
        self,
        owner: str,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceAttentionMetadata,
        output: torch.Tensor,
        lse: torch.Tensor,
    ) -> torch.Tensor:
        """``_forward`` with the rows' lse copied into ``lse`` (checked: float32 ``[T, Hq]``
        on the query's device)."""
        check_tensor(
            owner,
            "lse",
            lse,
            layout="[T, Hq]",
            shape=(query.shape[0], self.num_heads),
            dtype=torch.float32,
            device=query.device,
        )
        self._lse_out = lse
        try:
            return self._forward(query, key, value, kv_cache, attn_metadata, output)
        finally:
            self._lse_out = None

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        shard = getattr(attn_metadata, "context_shard", None)  # the type is checked below
        if shard is not None and self._lse_out is None:
            raise ValueError(
                f"ReferenceAttentionImpl.forward ({self.kind.value}): the group is sharded "
                f"by context (context_shard={shard}); its result is "
                f"partial, call forward_partial"
            )
        return self._forward(query, key, value, kv_cache, attn_metadata, output)

    def _forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """``forward`` (the lse into ``self._lse_out`` when set)."""
        cache = self._check_inputs(query, key, value, kv_cache, attn_metadata, output)
        md = attn_metadata
        n = md.num_actual_tokens
        if cache is None:
            assert key is not None  # checked above
            assert value is not None
            return self._encoder_only(query, key, value, md, output)

        scales = kv_cache[1] if self.dynamic_scales else None
        # 1. Write this step's keys/values (or latents, or encoder states).
        if self.is_mla:
            assert key is not None  # checked above
            _write_latents(key[:n, 0], cache, md.slot_mapping[:n])
        elif self.encoder_keys:
            if key is not None and value is not None:
                write_kv_cache(
                    key,
                    value,
                    cache,
                    md.slot_mapping[: key.shape[0]],
                    k_scale=self.k_scale,
                    v_scale=self.v_scale,
                    kv_scales=scales,
                )
        else:
            assert key is not None  # checked above
            assert value is not None
            write_kv_cache(
                key[:n],
                value[:n],
                cache,
                md.slot_mapping[:n],
                k_scale=self.k_scale,
                v_scale=self.v_scale,
                kv_scales=scales,
            )
        if md.sink_slot_mapping is not None:
            self._write_sinks(cache, md.sink_slot_mapping, scales)

        # 2. Attend over the paged cache.
        if self.is_mla:
            # One latent per token read as a one-head cache whose K and V planes are the
            # same memory (stride 0 along the plane dim): no copy, no value plane.
            num_blocks, block_size, latent = cache.shape
            kv_view = cache[:, None, :, None, :].expand(num_blocks, 2, block_size, 1, latent)
            if self.projection is not None:
                return self._projected(query, kv_view, md, output)
            full = output if self.v_head_size == latent else torch.empty_like(query)
            self._paged(query, kv_view, md, full)
            if full is not output:
                output.copy_(full[..., : self.v_head_size])
            return output
        return self._paged(query, cache, md, output, scales)

    @override
    def forward_sparse(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceAttentionMetadata,
        output: torch.Tensor,
        selection: SparseSelection,
    ) -> torch.Tensor:
        if self.layer_params.index_topk is None:
            raise ValueError(
                f"ReferenceAttentionImpl.forward_sparse ({self.kind.value}): the layer is "
                f"dense (layer_params.index_topk is None); call forward"
            )
        cache = self._check_inputs(query, key, value, kv_cache, attn_metadata, output)
        md, n = attn_metadata, attn_metadata.num_actual_tokens
        assert cache is not None  # an MLA layer: checked above
        assert key is not None
        _write_latents(key[:n, 0], cache, md.slot_mapping[:n])
        rows = selection.rows(n)
        sparse_mla_attention(
            query[:n],
            cache,
            rows.indices,
            rows.lens,
            kv_lora_rank=self.v_head_size,
            scale=self.scale,
            kv_scale=self.latent_scale,
            output=output[:n],
        )
        return output

    def _projected(
        self,
        query: torch.Tensor,
        kv_view: torch.Tensor,
        md: ReferenceAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """MLA with the layer's projection, in the absorbed form: ``q_nope @ W_UK^T``
        (float32) next to ``q_pe`` scored against the latent, the first ``R`` output
        channels multiplied by ``W_UV`` (float32)."""
        proj = self.projection
        assert proj is not None  # only called with a projection
        nope = proj.qk_nope_head_dim
        q_nope = query[:, :, :nope].float()
        absorbed = torch.einsum("thn,hrn->thr", q_nope, proj.w_uk.float())
        q_abs = torch.cat([absorbed.to(query.dtype), query[:, :, nope:]], dim=-1)
        latent_out = q_abs.new_empty(q_abs.shape)
        self._paged(q_abs, kv_view, md, latent_out)
        values = torch.einsum(
            "thr,hrv->thv", latent_out[:, :, : self.rank].float(), proj.w_uv.float()
        )
        output.copy_(values)
        return output

    def _paged(
        self,
        query: torch.Tensor,
        cache: torch.Tensor,
        md: ReferenceAttentionMetadata,
        output: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        alibi = self.alibi_slopes.to(query.device) if self.alibi_slopes is not None else None
        out, lse = paged_attention(
            query,
            cache,
            query_start_loc=md.query_start_loc,
            seq_lens=md.seq_lens,
            block_table=md.block_table,
            scale=self.scale,
            causal=md.causal,
            sliding_window=md.sliding_window,
            chunk_size=md.chunk_size,
            logits_soft_cap=self.layer_params.logits_soft_cap,
            alibi_slopes=alibi,
            # A sink logit joins exactly one softmax denominator: on a context-parallel
            # group, rank 0's (the merge of the ranks' partials then counts it once).
            sinks=self.layer_params.sinks
            if md.context_shard is None or md.context_shard[0] == 0
            else None,
            output=output,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            kv_scales=kv_scales,
            context_shard=md.context_shard,
            global_seq_lens=md.global_seq_lens,
            draft_ancestors=md.draft_ancestors,
            draft_counts=md.draft_counts,
            mm_prefix_ranges=md.mm_prefix_ranges,
            return_lse=True,
        )
        if self._lse_out is not None:
            self._lse_out.copy_(lse)
        return out

    def _write_sinks(
        self, cache: torch.Tensor, sink_slots: torch.Tensor, kv_scales: torch.Tensor | None
    ) -> None:
        """Write the layer's sink tokens into the sink slots of each new request."""
        sink_key, sink_value = self.layer_params.sink_key, self.layer_params.sink_value
        assert sink_key is not None  # checked in __init__
        assert sink_value is not None
        sink_len = sink_key.shape[0]
        num_new = sink_slots.shape[0] // sink_len
        keys = sink_key.to(cache.device).expand(num_new, *sink_key.shape)
        values = sink_value.to(cache.device).expand(num_new, *sink_value.shape)
        write_kv_cache(
            keys.reshape(-1, *sink_key.shape[1:]),
            values.reshape(-1, *sink_value.shape[1:]),
            cache,
            sink_slots,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            kv_scales=kv_scales,
        )

    def _encoder_only(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        md: ReferenceAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Each request attends bidirectionally to its own rows of this step."""
        alibi = self.alibi_slopes.to(query.device) if self.alibi_slopes is not None else None
        starts: list[int] = md.query_start_loc_cpu.tolist()  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]  # torch types tolist() as a bare List
        output[starts[-1] :] = 0  # padding rows
        lse_out = self._lse_out
        if lse_out is not None:
            lse_out[starts[-1] :] = float("-inf")
        for start, end in itertools.pairwise(starts):
            if end == start:
                continue
            out, lse = dense_attention(
                query[start:end],
                key[start:end],
                value[start:end],
                scale=self.scale,
                causal=False,
                logits_soft_cap=self.layer_params.logits_soft_cap,
                alibi_slopes=alibi,
                sinks=self.layer_params.sinks,
                return_lse=True,
            )
            output[start:end] = out
            if lse_out is not None:
                lse_out[start:end] = lse
        return output


def _write_latents(latents: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``[T, D]`` latents into an MLA cache ``[NB, BS, D]``; slot -1 is skipped."""
    num_blocks, block_size, _ = cache.shape
    valid = slot_mapping != -1
    slots = slot_mapping[valid]
    if slots.numel() > 0:
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= num_blocks * block_size:
            raise ValueError(
                f"ReferenceAttentionImpl: slot_mapping entries must be -1 or in [0, NB*BS)="
                f"[0, {num_blocks * block_size}), got values in [{lo}, {hi}]"
            )
    cache[slots // block_size, slots % block_size] = latents[valid].to(cache.dtype)


def _scale_of(scale: float | tuple[float, ...]) -> float | torch.Tensor:
    """A layer's K or V scale as the kernels take it: a float, or float32 ``[Hkv]``."""
    if isinstance(scale, tuple):
        return torch.tensor(scale, dtype=torch.float32)
    return float(scale)
