"""Paged attention for mixed batches: one plan per step, one launcher per layer.

A step's attention runs in two calls:

1. :func:`plan_paged_attention` (once per step, from the batch metadata) validates the
   metadata, chooses the path (the one-pass kernel, or split-KV "flash-decoding" for
   decode batches with few requests and long contexts), and lays out the grid: the
   cumulative count of query tiles per request (``tile_offsets``, int32 ``[B + 1]`` on
   the device) and how many programs to launch. It returns a frozen
   :class:`PagedAttentionPlan`.
2. :func:`paged_attention` (once per layer) validates only the layer's tensors (query,
   cache, output, per-head vectors, scales) against the plan and launches the kernels.

Shapes (fixed letters used throughout ``attnkit.kernels``):

* ``T``   total query tokens in the batch
* ``B``   requests
* ``Hq``  query heads; ``Hkv`` key/value heads (``Hq % Hkv == 0``); ``G = Hq // Hkv``
* ``D``   head size
* ``NB``  physical blocks; ``BS`` tokens per block; ``MB`` block-table width

Tensors:

* ``query``: ``[T, Hq, D]``, any strides. ``output``: ``[T, Hq, D]``, same dtype.
* ``kv_cache``: ``[NB, 2, BS, Hkv, D]``, contiguous; index 0 of dim 1 keys, 1 values.
  Either the query dtype or ``torch.float8_e4m3fn`` (then with ``k_scale``/``v_scale``).
* ``query_start_loc``: int32 ``[B + 1]``; request ``b`` owns query rows
  ``query_start_loc[b] : query_start_loc[b + 1]``.
* ``seq_lens``: int32 ``[B]``; context length of request ``b`` *including* its queries.
* ``block_table``: int32 ``[B, MB]``; position ``p`` of request ``b`` lives in block
  ``block_table[b, p // BS]`` at offset ``p % BS``.
* ``lse`` (optional output): float32 ``[T, Hq]``, any strides.

Semantics are those of the torch oracle :func:`attnkit.kernels.attention.reference.paged_attention`
(and the argument rules those of :mod:`attnkit.kernels.attention.contract`): query ``t``
(0-based within its request) sits at absolute position ``i = seq_len - q_len + t`` (also
when ``causal=False``, where ``q_len > seq_len`` is allowed and ``i`` may be negative;
it then only matters to ALiBi). Query head ``h`` reads kv head ``h // G``. Key ``j`` is
visible iff ``j < seq_len`` and, when causal, ``j <= i``; a sliding window ``W`` adds
``i - j < W`` and a local-attention chunk ``C`` adds ``j // C == i // C``. Scores are
``s = scale * k_scale * (q . k)``, then ``cap * tanh(s / cap)``, then
``+ slope[h] * (j - i)``; a sink adds ``exp(sink[h])`` to each row's softmax
denominator with no value. ``lse`` is the natural-log log-sum-exp of the row, sink
included (``-inf`` for a row that sees nothing and has no sink). Rows of ``output`` and
``lse`` at or past ``query_start_loc[B]`` are left untouched.

Grid. Axis 0 walks the batch's *query tiles*: request ``b`` has
``cdiv(q_len_b, BLOCK_Q)`` tiles and ``tile_offsets`` their running sum; a program finds
its request by binary search over ``tile_offsets`` (``find_segment``) and exits at once
when its index is past ``tile_offsets[B]``. The plan launches exactly
``tile_offsets[B]`` programs when the builder hands it the host copy of the offsets
(``query_start_loc_cpu``), and otherwise the shape-only bound
``min(T, (T + B * (BLOCK_Q - 1)) // BLOCK_Q, B * cdiv(max_query_len, BLOCK_Q))`` (each
tile holds at least one and at most ``BLOCK_Q`` tokens), which keeps a CUDA graph valid
for every batch of the captured shape. Axis 1 is the kv head: a program covers every
query head of that head's group, so one K/V tile load serves ``G`` heads. Split-KV adds
axis 2 (the split) and a merge kernel over ``(T, Hq)``.

Split-KV (Flash-Decoding: Dao, Haziza, Massa, Sizov, 2023, "Flash-Decoding for
long-context inference"): stage 1 runs the online softmax over one of ``num_splits``
runs of consecutive cache blocks and writes a float32 partial output (already divided
by its own denominator) and its lse into a :class:`SplitKVWorkspace`; stage 2 merges
the partials of each (token, head) by log-sum-exp weighting and adds the sink logit
once. A split that sees no key leaves output 0 and lse ``-inf``, which the merge
ignores.

With the plan built, and ``output``, ``lse`` (if wanted) and ``workspace`` given, the
launcher allocates nothing and never reads device memory back to the host, so it can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton

from attnkit.kernels._checks import (
    KernelTypeError,
    check_device,
    check_dtype,
    check_finite_float,
    describe,
    require_tensor,
)
from attnkit.kernels._triton.interpret import INTERPRETED
from attnkit.kernels.attention.contract import (
    FP8_DTYPE,
    check_cache_layout,
    check_draft_tree,
    check_head_vector,
    check_kv_scale,
    check_kv_scales_cache,
    check_logits_soft_cap,
    check_query_layout,
)
from attnkit.kernels.attention.triton_kernels import (
    _split_kv_merge_kernel,
    _split_kv_partial_kernel,
    _unified_attention_kernel,
)
from attnkit.kernels.attention.triton_plan import (
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_DTYPES,
    PagedAttentionPlan,
    SplitKVWorkspace,
    _check_workspace,
    _launch_shape,
    split_kv_workspace,
)

__all__ = ["FP8_DTYPE", "check_kv_cache", "check_query", "merge_split_kv", "paged_attention"]


# ------------------------------------------------------------------------ per-layer checks


def check_query(query: object, device: torch.device | None = None) -> torch.Tensor:
    """``query`` ``[T, Hq, D]`` of a supported dtype (and head size), on ``device``."""
    query = check_query_layout(query)
    check_dtype("query", query, SUPPORTED_DTYPES)
    check_device("query", query, device, "plan")
    return query


def check_kv_cache(
    kv_cache: object,
    query: torch.Tensor,
    *,
    block_size: int | None = None,
    num_kv_heads: int | None = None,
    int8: bool = False,
) -> torch.Tensor:
    """A paged cache the kernels read for ``query`` (and, when given, of the plan's
    ``block_size`` / ``num_kv_heads``); ``int8``: an int8 cache is allowed too (one
    with per-token-head scales)."""
    kv_cache = check_cache_layout(kv_cache, query)
    allowed = (query.dtype, FP8_DTYPE, torch.int8) if int8 else (query.dtype, FP8_DTYPE)
    if kv_cache.dtype not in allowed:
        names = " or ".join(str(d) for d in allowed[1:])
        raise ValueError(
            f"kv_cache: expected dtype {query.dtype} (the query dtype) or {names}, "
            f"got {kv_cache.dtype}"
        )
    num_blocks, _, cache_block_size, cache_kv_heads, _ = kv_cache.shape
    head_dim = query.shape[2]
    check_device("kv_cache", kv_cache, query.device)
    if num_blocks == 0:
        raise ValueError(
            f"kv_cache: expected at least one block (NB >= 1), got {describe(kv_cache)}"
        )
    # Each block contiguous; blocks may sit apart (a page holding the per-token-head
    # scales after the values): the kernels step blocks by stride(0).
    if kv_cache.shape[0] > 0 and not kv_cache[0].is_contiguous():
        raise ValueError(
            "kv_cache: expected a contiguous tensor, got a non-contiguous one "
            f"({describe(kv_cache)}, strides {tuple(kv_cache.stride())})"
        )
    if cache_block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"kv_cache: expected block size in {SUPPORTED_BLOCK_SIZES}, got {cache_block_size}"
        )
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"query: expected head size in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}"
        )
    if block_size is not None and cache_block_size != block_size:
        raise ValueError(
            f"kv_cache: expected block size {block_size} (the plan's block_size), "
            f"got {cache_block_size}"
        )
    if num_kv_heads is not None and cache_kv_heads != num_kv_heads:
        raise ValueError(
            f"kv_cache: expected {num_kv_heads} kv heads (the plan's num_kv_heads), "
            f"got {cache_kv_heads}"
        )
    return kv_cache


def _check_like(
    name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, of: str
) -> torch.Tensor:
    t = require_tensor(name, t, f"a {of} torch.Tensor or None")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    check_device(name, t, device)
    return t


# ------------------------------------------------------------------------ launch

# Under the Triton interpreter (INTERPRETED): it stores bfloat16 as uint16 and its
# tl.dot multiplies those bit patterns (triton-lang/triton#11584; upstream: bf16 is
# unsupported there and should be cast to float32). Under the interpreter only, bf16 dot
# operands are upcast after the same rounding the GPU path applies (DOT_IN_FP32);
# compiled kernels keep native bf16 dots.
#
# fp8 under the interpreter (attnkit.kernels._triton.fp8): a NaN in an unwritten slot
# must stay NaN so the tests catch a kernel that reads one, so under the interpreter the
# cache is passed as a uint8 view and decoded exactly by e4m3_bits_to_f32 (integer ops
# only: exact, and checked against torch for all 256 patterns). Compiled kernels keep
# the fp8 tensor and Triton's native conversion (hardware cvt on sm_89+); the FP8_BITS
# branch is a constexpr, so it costs them nothing.


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: PagedAttentionPlan,
    *,
    scale: float,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: SplitKVWorkspace | None = None,
    draft_ancestors: torch.Tensor | None = None,
    draft_counts: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` ``[T, Hq, D]`` over the paged ``kv_cache`` for a planned step.

    The new tokens' K/V must already be in the cache (see ``write_kv_cache``). Checks
    only the layer's own arguments (the plan checked the metadata) and launches the
    plan's path.

    Args:
        query: ``[T, Hq, D]`` float32/float16/bfloat16, any strides, on the plan device.
        kv_cache: ``[NB, 2, BS, Hkv, D]`` contiguous, the query dtype or
            ``torch.float8_e4m3fn``; ``BS`` and ``Hkv`` those of the plan.
        plan: from :func:`plan_paged_attention`.
        scale: multiplies ``q . k``.
        logits_soft_cap, alibi_slopes, sinks: as for the oracle; the two ``[Hq]``
            vectors may be float32, float16 or bfloat16.
        k_scale, v_scale: multiply the cached keys / values: None (1.0), a float > 0, a
            float32 ``[Hkv]`` tensor (one per K/V head, fp8 caches), or
            a one-element float32 device tensor (read by the kernel, never by the host).
            Required with an fp8 cache (which stores ``key / k_scale``) unless
            ``kv_scales`` is given.
        kv_scales: float32 ``[NB, 2, BS, Hkv]`` per-token-head scales of an fp8 e4m3
            or int8 cache (the op contract's rule); ``k_scale`` / ``v_scale`` are then
            None.
        output: optional ``[T, Hq, D]`` of the query dtype to write into.
        lse: optional float32 ``[T, Hq]`` to receive the natural-log lse (sink included).
        workspace: split-KV scratch (:func:`split_kv_workspace`); allocated per call when
            the plan uses split-KV and none is given; ignored otherwise.
        draft_ancestors, draft_counts: a verify step's draft trees (int64 ``[T']`` per
            query row, int32 ``[B]``; the contract's "Draft trees"), on the plan device;
            read by the kernels only, so capture buffers replay with new trees.

    Returns:
        ``output`` (allocated when not given).
    """
    if not isinstance(plan, PagedAttentionPlan):
        raise KernelTypeError(
            f"plan: expected a PagedAttentionPlan (plan_paged_attention), got {describe(plan)}"
        )
    device = plan.device
    query = check_query(query, device)
    kv_cache = check_kv_cache(
        kv_cache,
        query,
        block_size=plan.block_size,
        num_kv_heads=plan.num_kv_heads,
        int8=kv_scales is not None,
    )
    kv_scales = check_kv_scales_cache(kv_scales, kv_cache)
    num_tokens, num_q_heads, head_dim = query.shape
    scale = check_finite_float("scale", scale)
    logits_soft_cap = check_logits_soft_cap(logits_soft_cap)
    alibi_slopes = check_head_vector("alibi_slopes", alibi_slopes, num_q_heads, device)
    sinks = check_head_vector("sinks", sinks, num_q_heads, device)
    k_scale = check_kv_scale("k_scale", k_scale, device, num_kv_heads=plan.num_kv_heads)
    v_scale = check_kv_scale("v_scale", v_scale, device, num_kv_heads=plan.num_kv_heads)
    is_fp8 = kv_cache.dtype == FP8_DTYPE
    if kv_scales is not None and (k_scale is not None or v_scale is not None):
        raise ValueError(
            "k_scale, v_scale: expected None with kv_scales (per-token-head scales), got "
            f"{describe(k_scale)} and {describe(v_scale)}"
        )
    if kv_scales is not None and kv_scales.shape[0] > 0 and not kv_scales[0].is_contiguous():
        raise ValueError(
            f"kv_scales: expected contiguous blocks, got strides {tuple(kv_scales.stride())}"
        )
    if is_fp8 and kv_scales is None and (k_scale is None or v_scale is None):
        missing = "k_scale" if k_scale is None else "v_scale"
        raise ValueError(
            f"{missing}: expected a float or a one-element torch.float32 tensor with a "
            f"{FP8_DTYPE} kv_cache, got None"
        )
    per_head = any(isinstance(t, torch.Tensor) and t.numel() > 1 for t in (k_scale, v_scale))
    if per_head and not all(
        isinstance(t, torch.Tensor) and t.numel() == plan.num_kv_heads for t in (k_scale, v_scale)
    ):
        # One constexpr (PER_HEAD_SCALES) serves both reads.
        raise ValueError(
            f"k_scale, v_scale: expected both per-head [Hkv]=[{plan.num_kv_heads}] tensors "
            f"or neither, got {describe(k_scale)} and {describe(v_scale)}"
        )
    if per_head and not is_fp8:
        raise ValueError(
            f"k_scale, v_scale: per-head [Hkv] scales need a {FP8_DTYPE} kv_cache, "
            f"got {kv_cache.dtype}"
        )
    if lse is not None:
        lse = _check_like(
            "lse",
            lse,
            (num_tokens, num_q_heads),
            torch.float32,
            device,
            f"float32 [T, Hq]=[{num_tokens}, {num_q_heads}]",
        )
    if output is None:
        output = torch.empty_like(query)
    else:
        output = require_tensor("output", output, "a torch.Tensor [T, Hq, D] or None")
        if tuple(output.shape) != tuple(query.shape):
            raise ValueError(
                f"output: expected shape {tuple(query.shape)} (the query shape), "
                f"got {tuple(output.shape)}"
            )
        if output.dtype != query.dtype:
            raise ValueError(
                f"output: expected dtype {query.dtype} (the query dtype), got {output.dtype}"
            )
        check_device("output", output, device)
    tree = check_draft_tree(
        draft_ancestors, draft_counts, num_tokens, plan.num_reqs, plan.causal
    )
    if tree is not None:
        check_device("draft_ancestors", tree[0], device)
        check_device("draft_counts", tree[1], device)
    if plan.num_splits and workspace is not None:
        workspace = _check_workspace(
            workspace, plan.num_splits, num_tokens, num_q_heads, head_dim, device
        )
    if num_tokens == 0 or plan.num_tiles == 0:
        return output

    group = num_q_heads // plan.num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    shape = _launch_shape(
        head_dim_pad,
        plan.block_size,
        plan.block_q,
        group_pad,
        fp32=query.dtype == torch.float32,
        fp8_kv=is_fp8 or kv_scales is not None,
        sharded=plan.context_shard is not None,
    )
    fp8_bits = is_fp8 and INTERPRETED
    # A uint8 view shares the storage (no copy); see the note on INTERPRETED.
    cache_arg = kv_cache.view(torch.uint8) if fp8_bits else kv_cache
    # Scales given as tensors are read by the kernel (the float slot is then unused);
    # floats travel as arguments (seq_lens stands in for the unread pointer).
    k_ptr = k_scale if isinstance(k_scale, torch.Tensor) else plan.seq_lens
    v_ptr = v_scale if isinstance(v_scale, torch.Tensor) else plan.seq_lens
    k_value = k_scale if isinstance(k_scale, float) else 1.0
    v_value = v_scale if isinstance(v_scale, float) else 1.0
    common = {
        "query_ptr": query,
        "cache_ptr": cache_arg,
        "query_start_loc_ptr": plan.query_start_loc,
        # A shard's whole lengths follow its local ones ([2B]; no extra kernel argument).
        "seq_lens_ptr": plan.shard_lens if plan.shard_lens is not None else plan.seq_lens,
        "block_table_ptr": plan.block_table,
        "tile_offsets_ptr": plan.tile_offsets,
        "alibi_slopes_ptr": alibi_slopes if alibi_slopes is not None else plan.seq_lens,
        "draft_anc_ptr": tree[0] if tree is not None else plan.seq_lens,
        "draft_counts_ptr": tree[1] if tree is not None else plan.seq_lens,
        "USE_TREE": tree is not None,
        "k_scale_ptr": k_ptr,
        "v_scale_ptr": v_ptr,
        "scale": scale,
        "k_scale": k_value,
        "v_scale": v_value,
        # Per-token-head scales (seq_lens stands in for the unread pointer without them);
        # each block's [2, BS, Hkv] is contiguous, blocks stride_sb apart.
        "kv_scales_ptr": kv_scales if kv_scales is not None else plan.seq_lens,
        "stride_sb": kv_scales.stride(0) if kv_scales is not None else 0,
        # Both scales per head ([Hkv], read at kv_head), or both one per tensor.
        "PER_HEAD_SCALES": per_head,
        "DYN_SCALES": kv_scales is not None,
        "softcap": logits_soft_cap if logits_soft_cap is not None else 1.0,
        "window": plan.sliding_window if plan.sliding_window is not None else 0,
        "chunk": plan.chunk_size if plan.chunk_size is not None else 1,
        "num_reqs": plan.num_reqs,
        "search_iters": plan.search_iters,
        "stride_qt": query.stride(0),
        "stride_qh": query.stride(1),
        "stride_qd": query.stride(2),
        "stride_cb": kv_cache.stride(0),
        "stride_ckv": kv_cache.stride(1),
        "stride_cs": kv_cache.stride(2),
        "stride_ch": kv_cache.stride(3),
        "stride_cd": kv_cache.stride(4),
        "stride_bt": plan.block_table.stride(0),
        "stride_alibi": alibi_slopes.stride(0) if alibi_slopes is not None else 0,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": head_dim_pad,
        "GROUP": group,
        "GROUP_PAD": group_pad,
        "BLOCK_Q": plan.block_q,
        "ROWS_Q": shape.rows_q,
        "BLOCK_SIZE": plan.block_size,
        "TILE_N": shape.tile_n,
        "IS_CAUSAL": plan.causal,
        "SHARDED": plan.context_shard is not None,
        # Constexprs: one compilation per rank of a group (a handful), and no extra
        # runtime arguments in unsharded launches.
        "SHARD_RANK": plan.context_shard[0] if plan.context_shard is not None else 0,
        "SHARD_SIZE": plan.context_shard[1] if plan.context_shard is not None else 1,
        "USE_WINDOW": plan.sliding_window is not None,
        "USE_CHUNK": plan.chunk_size is not None,
        "USE_SOFTCAP": logits_soft_cap is not None,
        "USE_ALIBI": alibi_slopes is not None,
        "K_SCALE_FROM_PTR": isinstance(k_scale, torch.Tensor),
        "V_SCALE_FROM_PTR": isinstance(v_scale, torch.Tensor),
        "FP8_BITS": fp8_bits,
        # fp32 inputs would otherwise default to TF32 on NVIDIA, far outside fp32
        # tolerances; the setting has no effect on 16-bit operands (tensor cores).
        "DOT_PRECISION": "ieee",
        "DOT_IN_FP32": INTERPRETED and query.dtype == torch.bfloat16,
        "num_warps": shape.num_warps,
        # Explicit, not Triton's default: Triton 3.9 warns when the option is left unset
        # (its default flips in 3.10), and the test suite turns warnings into errors.
        "enable_fp_fusion": True,
    }
    if not plan.num_splits:
        _unified_attention_kernel[(plan.num_tiles, plan.num_kv_heads)](
            output_ptr=output,
            key_ends_ptr=(
                plan.mm_prefix_key_ends if plan.mm_prefix_key_ends is not None else plan.seq_lens
            ),
            MM_PREFIX=plan.mm_prefix_key_ends is not None,
            lse_ptr=lse if lse is not None else output,
            sinks_ptr=sinks if sinks is not None else plan.seq_lens,
            stride_ot=output.stride(0),
            stride_oh=output.stride(1),
            stride_od=output.stride(2),
            stride_lt=lse.stride(0) if lse is not None else 0,
            stride_lh=lse.stride(1) if lse is not None else 0,
            stride_sinks=sinks.stride(0) if sinks is not None else 0,
            USE_SINKS=sinks is not None,
            STORE_LSE=lse is not None,
            num_stages=shape.num_stages,
            **common,
        )
        return output

    if workspace is None:
        workspace = split_kv_workspace(
            plan.num_splits, num_tokens, num_q_heads, head_dim, device=device
        )
    part_out, part_lse = workspace
    _split_kv_partial_kernel[(plan.num_tiles, plan.num_kv_heads, plan.num_splits)](
        part_out_ptr=part_out,
        part_lse_ptr=part_lse,
        num_splits=plan.num_splits,
        split_blocks=plan.split_blocks,
        stride_ps=part_out.stride(0),
        stride_pt=part_out.stride(1),
        stride_ph=part_out.stride(2),
        stride_pd=part_out.stride(3),
        stride_ls=part_lse.stride(0),
        stride_lt=part_lse.stride(1),
        stride_lh=part_lse.stride(2),
        # The tree mask's registers: one pipeline stage fewer keeps the partial kernel
        # from spilling (compile report: 128 registers at 8 warps on sm_90 / sm_100).
        num_stages=shape.split_num_stages if tree is None else min(shape.split_num_stages, 2),
        **{**common, "num_warps": shape.split_num_warps or shape.num_warps},
    )
    merge_split_kv(workspace, output, plan, lse=lse, sinks=sinks)
    return output


def merge_split_kv(
    workspace: SplitKVWorkspace,
    output: torch.Tensor,
    plan: PagedAttentionPlan,
    *,
    lse: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stage 2 of split-KV: merge the ``plan.num_splits`` partials of every (token, head).

    ``workspace`` holds stage 1's float32 partial outputs (each divided by its own
    denominator) and natural-log lse per split; a split with lse ``-inf`` saw nothing
    and is not read. Each (token, head) of ``output`` ``[T, H, Dv]`` gets the
    lse-weighted sum of its partials (``Dv`` is the partials' width, which is the value
    width: the head size for paged attention, ``kv_lora_rank`` for absorbed MLA); a sink
    logit (``sinks`` ``[H]``) joins the denominator once. ``lse`` (float32 ``[T, H]``)
    receives the merged log-sum-exp. Rows at or past ``query_start_loc[B]`` are left
    untouched. Allocates nothing and reads no device value back to the host.

    Args:
        workspace: stage 1's scratch, ``[S >= num_splits, T' >= T, H, Dv]`` and
            ``[S, T', H]``, float32.
        output: ``[T, H, Dv]`` float32/float16/bfloat16, any strides.
        plan: the step's split-KV plan (``plan.num_splits >= 1``).
        lse: optional float32 ``[T, H]``, any strides.
        sinks: optional ``[H]`` sink logits (float32/float16/bfloat16/float64).

    Returns:
        ``output``.
    """
    if not isinstance(plan, PagedAttentionPlan):
        raise KernelTypeError(
            f"plan: expected a PagedAttentionPlan (plan_paged_attention), got {describe(plan)}"
        )
    if not plan.num_splits:
        raise ValueError(
            "plan: expected a split-KV plan (num_splits >= 1), got one with num_splits=0"
        )
    device = plan.device
    output = require_tensor("output", output, "a torch.Tensor [T, H, Dv]")
    if output.dim() != 3 or 0 in output.shape[1:]:
        raise ValueError(f"output: expected shape [T, H >= 1, Dv >= 1], got {tuple(output.shape)}")
    check_dtype("output", output, SUPPORTED_DTYPES)
    check_device("output", output, device)
    num_tokens, num_heads, head_dim = output.shape
    part_out, part_lse = _check_workspace(
        workspace, plan.num_splits, num_tokens, num_heads, head_dim, device
    )
    if lse is not None:
        lse = _check_like(
            "lse",
            lse,
            (num_tokens, num_heads),
            torch.float32,
            device,
            f"float32 [T, H]=[{num_tokens}, {num_heads}]",
        )
    sinks = check_head_vector("sinks", sinks, num_heads, device)
    if num_tokens == 0:
        return output
    _split_kv_merge_kernel[(num_tokens, num_heads)](
        part_out_ptr=part_out,
        part_lse_ptr=part_lse,
        output_ptr=output,
        # Without lse the merge kernel never touches lse_ptr; part_lse stands in for it.
        lse_ptr=lse if lse is not None else part_lse,
        sinks_ptr=sinks if sinks is not None else plan.seq_lens,
        query_start_loc_ptr=plan.query_start_loc,
        num_reqs=plan.num_reqs,
        num_splits=plan.num_splits,
        stride_ps=part_out.stride(0),
        stride_pt=part_out.stride(1),
        stride_ph=part_out.stride(2),
        stride_pd=part_out.stride(3),
        stride_ls=part_lse.stride(0),
        stride_lt=part_lse.stride(1),
        stride_lh=part_lse.stride(2),
        stride_ot=output.stride(0),
        stride_oh=output.stride(1),
        stride_od=output.stride(2),
        stride_olt=lse.stride(0) if lse is not None else 0,
        stride_olh=lse.stride(1) if lse is not None else 0,
        stride_sinks=sinks.stride(0) if sinks is not None else 0,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        SPLITS_PAD=triton.next_power_of_2(plan.num_splits),
        USE_SINKS=sinks is not None,
        STORE_LSE=lse is not None,
        enable_fp_fusion=True,
    )
    return output
