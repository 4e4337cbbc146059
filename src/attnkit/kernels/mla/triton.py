"""Multi-head latent attention (MLA) in its absorbed form over a latent paged cache.

The op (rules in :mod:`attnkit.kernels.mla.contract`; DeepSeek-AI, 2024, "DeepSeek-V2",
section 2.1): every token caches one latent of ``D = R + P`` channels, the compressed
key/value ``c`` (``R = kv_lora_rank``) followed by the shared rotary key ``k_pe`` (``P``
channels). With ``W_UK`` absorbed into the query, head ``h`` of query token ``t`` scores
key position ``j`` as

    ``s = scale * kv_scale * (q[t, h, :R] . c_j + q[t, h, R:] . pe_j)``

and its output is ``softmax(s) @ (kv_scale * c)`` (``[T, H, R]``; the caller applies
``W_UV``). That is multi-query attention with one key head of width ``D`` and one value
head of width ``R`` that is a prefix of the key: one latent tile, loaded once, is the key
of every head of the program *and* its value.

Shapes: ``query`` ``[T, H, D]`` (any strides), ``latent_cache`` ``[NB, BS, D]``
(contiguous, the query dtype or ``torch.float8_e4m3fn``), ``output`` ``[T, H, R]``,
``lse`` float32 ``[T, H]``. The batch metadata and the launch layout come from a
:class:`~attnkit.kernels.attention.triton_plan.PagedAttentionPlan` built with
``num_kv_heads=1`` (and ``sliding_window`` for sliding-window MLA); its semantics are
those of :func:`~attnkit.kernels.attention.triton.paged_attention` with one kv
head: query ``t`` of a request with ``seq_len`` keys and ``q_len`` queries sits at
position ``i = seq_len - q_len + t`` and sees keys ``j < seq_len`` with ``j <= i`` (when
causal) and ``i - j < W`` (with a window). ``lse`` is the natural-log log-sum-exp of a
row's scores (``-inf`` for a row that sees nothing; its output is 0).

Kernel design (``_mla_attention_kernel``; one kernel, two modes):

* Grid ``(query tile, head block, split)``. A program handles one tile of the plan
  (``BLOCK_Q`` tokens of one request) for ``BLOCK_H`` heads, in steps of ``ROWS_Q``
  tokens: a step's ``ROWS_Q * BLOCK_H <= 64`` rows are (token, head) pairs that share
  every key tile load.
* The score is split at the rope boundary instead of padding ``D = 576`` to a power of
  two (1024): ``s = q[:, :R] @ c^T + q[:, R:] @ pe^T`` with ``R`` and ``P`` each padded
  on their own (512 and 64 for DeepSeek: no padding at all). The value tile is ``c``
  itself.
* Keys in tiles of ``TILE_N`` slots that never straddle a cache block (``TILE_N``
  divides ``BS``): one block-table read per tile. Keys outside the step's range
  ``[window start, seq_len)`` (and the split's run of blocks) are never read: they load
  as 0 and their scores are masked (a released block may hold NaN).
* 16-bit operands run both dots on tensor cores with float32 accumulation; float32
  runs IEEE dots. fp8 latents widen to the query dtype before the dots (exact: every
  e4m3 value is a float16 and a bfloat16 value). ``kv_scale`` folds into the score
  scale and into the final normalisation.
* Split-KV (``plan.num_splits >= 1``; Dao, Haziza, Massa, Sizov, 2023,
  "Flash-Decoding for long-context inference"): each split covers a run of whole
  blocks and writes a float32 partial output and its lse into a
  :class:`~attnkit.kernels.attention.triton_plan.SplitKVWorkspace` (see
  :func:`mla_split_workspace`); :func:`~attnkit.kernels.attention.triton.merge_split_kv`
  merges them.

With ``output``, ``lse`` (if wanted) and ``workspace`` given the launcher allocates
nothing and never reads device memory back to the host (CUDA-graph safe).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from attnkit.kernels._checks import KernelTypeError, check_device, check_finite_float, describe
from attnkit.kernels._triton.fp8 import f32_to_e4m3_bits, saturate_e4m3
from attnkit.kernels._triton.interpret import INTERPRETED
from attnkit.kernels._triton.varlen import find_segment
from attnkit.kernels.attention.triton import merge_split_kv
from attnkit.kernels.attention.triton_plan import (
    SUPPORTED_BLOCK_SIZES,
    PagedAttentionPlan,
    SplitKVWorkspace,
    split_kv_workspace,
)
from attnkit.kernels.attention.triton_tile import (
    load_kv_tile,
    mask_scores,
    online_softmax_update,
)
from attnkit.kernels.mla.contract import (
    FP8_DTYPE,
    check_kv_lora_rank,
    check_latent_cache,
    check_latents,
    check_mla_kv_scale,
    check_mla_lse,
    check_mla_output,
    check_mla_query,
    check_slot_mapping,
)

__all__ = [
    "MAX_LATENT_DIM",
    "SUPPORTED_BLOCK_SIZES",
    "MLALaunchShape",
    "mla_attention",
    "mla_launch_shape",
    "mla_split_workspace",
    "write_mla_latents",
]

# The attention kernel's work is matrix products (q c^T, q_pe pe^T, p c): with 16-bit
# inputs it must run on tensor cores (benchmarks/compile_report.py checks the SASS).
TENSOR_CORE_KERNELS = ("_mla_attention_kernel",)

MAX_LATENT_DIM = 1024
"""Largest latent width ``D`` (DeepSeek-V2/V3 and Kimi K2: 576)."""

# Rows (query tokens x heads) per inner step; 16 is the smallest M tl.dot accepts.
_MAX_ROWS = 64
_MIN_ROWS = 16


# ------------------------------------------------------------------------ device


@triton.jit
def _mla_attention_kernel(
    query_ptr,
    cache_ptr,
    out_ptr,
    lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    tile_offsets_ptr,
    kv_scale_ptr,
    scale,
    kv_scale,
    window,
    num_reqs,
    search_iters,
    num_heads,
    num_splits,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_os,
    stride_ot,
    stride_oh,
    stride_od,
    stride_ls,
    stride_lt,
    stride_lh,
    stride_cb,
    stride_cs,
    stride_bt,
    KV_LORA_RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    ROWS_Q: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    STORE_LSE: tl.constexpr,
    KV_SCALE_FROM_PTR: tl.constexpr,
    FP8_BITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    # Padded extents exist because tl.arange needs powers of two; loads and stores mask
    # the padding lanes (channels >= R or >= P, heads >= num_heads, tokens past the tile).
    tl.static_assert(RANK_PAD >= KV_LORA_RANK)
    tl.static_assert(ROPE_PAD >= ROPE_DIM)
    # K dims of the dots (RANK_PAD, ROPE_PAD for the scores, TILE_N for p @ c) and their
    # N dims (TILE_N, RANK_PAD) must be >= 16 for 16-bit operands on NVIDIA.
    tl.static_assert(RANK_PAD >= 16)
    tl.static_assert(ROPE_PAD >= 16)
    tl.static_assert(TILE_N >= 16)
    # Key tiles never straddle two cache blocks: one block-table read per tile.
    tl.static_assert(BLOCK_SIZE % TILE_N == 0)
    # A window bounds the look-back from the query position: it needs causality.
    tl.static_assert(IS_CAUSAL or not USE_WINDOW)
    # Row r of a step is (token r // BLOCK_H, head r % BLOCK_H of this head block).
    BLOCK_M: tl.constexpr = ROWS_Q * BLOCK_H
    tl.static_assert(BLOCK_M >= 16)
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453

    tile_id = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    # The grid may be an upper bound on the tile count (CUDA graphs): extra programs exit.
    if tile_id >= tl.load(tile_offsets_ptr + num_reqs):
        return
    request = find_segment(tile_offsets_ptr, 1, num_reqs, tile_id, search_iters)
    tile = tile_id - tl.load(tile_offsets_ptr + request)

    q_start = tl.load(query_start_loc_ptr + request)
    q_len = tl.load(query_start_loc_ptr + request + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + request)
    context_len = seq_len - q_len
    tile_start = tile * BLOCK_Q
    tile_end = tl.minimum(tile_start + BLOCK_Q, q_len)

    rows = tl.arange(0, BLOCK_M)
    head = head_block * BLOCK_H + rows % BLOCK_H
    rank_dims = tl.arange(0, RANK_PAD)
    rank_valid = rank_dims < KV_LORA_RANK
    rope_dims = tl.arange(0, ROPE_PAD)
    rope_valid = rope_dims < ROPE_DIM

    # kv_scale multiplies every cached channel: folded into the score scale (keys) and
    # into the final normalisation (values). A tensor is read here, never by the host.
    kv_scale_value = kv_scale
    if KV_SCALE_FROM_PTR:
        kv_scale_value = tl.load(kv_scale_ptr)
    # Scores are kept in the log2 domain (exp2 is the native instruction).
    qk_scale = scale * kv_scale_value * LOG2E
    offs_n = tl.arange(0, TILE_N)
    table_row = block_table_ptr + request.to(tl.int64) * stride_bt
    # The cache is contiguous: channels have unit stride.
    c_offsets = offs_n[:, None] * stride_cs + rank_dims[None, :]
    pe_offsets = offs_n[:, None] * stride_cs + (KV_LORA_RANK + rope_dims)[None, :]
    split64 = split.to(tl.int64)

    # The tile's BLOCK_Q tokens in steps of ROWS_Q tokens (one step when ROWS_Q >= BLOCK_Q).
    for step_start in range(tile_start, tile_end, ROWS_Q):
        q_idx = step_start + rows // BLOCK_H
        row_valid = (q_idx < tile_end) & (head < num_heads)
        q_pos = context_len + q_idx
        # int64 before multiplying by strides: T * H * D may exceed 2**31 elements.
        q_token = (q_start + q_idx).to(tl.int64)
        q_row = query_ptr + q_token[:, None] * stride_qt + head[:, None] * stride_qh
        q_nope = tl.load(
            q_row + rank_dims[None, :] * stride_qd,
            mask=row_valid[:, None] & rank_valid[None, :],
            other=0.0,
        )
        q_pe = tl.load(
            q_row + (KV_LORA_RANK + rope_dims)[None, :] * stride_qd,
            mask=row_valid[:, None] & rope_valid[None, :],
            other=0.0,
        )
        if DOT_IN_FP32:
            q_nope = q_nope.to(tl.float32)
            q_pe = q_pe.to(tl.float32)

        # Keys any row of this step can see: [kv_begin, kv_end). Keys outside it are
        # never read (a block wholly before a window may be released and hold NaN).
        first_q_pos = context_len + step_start
        last_q_pos = context_len + tl.minimum(step_start + ROWS_Q, tile_end) - 1
        kv_end = tl.minimum(last_q_pos + 1, seq_len) if IS_CAUSAL else seq_len
        kv_begin = 0
        if USE_WINDOW:
            kv_begin = tl.maximum(first_q_pos - window + 1, 0)
        lo = kv_begin
        hi = kv_end
        if SPLIT_KV:
            # This program's split: blocks [split_first, split_end) of the step's block
            # range, cut into num_splits nearly equal runs of consecutive blocks (with
            # more splits than blocks some runs are empty and store lse -inf).
            first_block = kv_begin // BLOCK_SIZE
            num_blocks = tl.maximum(tl.cdiv(kv_end, BLOCK_SIZE) - first_block, 0)
            split_first = first_block + (num_blocks * split) // num_splits
            split_end = first_block + (num_blocks * (split + 1)) // num_splits
            lo = tl.maximum(split_first * BLOCK_SIZE, kv_begin)
            hi = tl.minimum(split_end * BLOCK_SIZE, kv_end)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, RANK_PAD], dtype=tl.float32)
        for kv_tile in range(lo // TILE_N, tl.cdiv(hi, TILE_N)):
            tile_pos = kv_tile * TILE_N
            # int64: NB * BS * D may exceed 2**31 elements.
            physical_block = tl.load(table_row + tile_pos // BLOCK_SIZE).to(tl.int64)
            k_pos = tile_pos + offs_n
            k_valid = (k_pos >= lo) & (k_pos < hi)
            slot_base = cache_ptr + physical_block * stride_cb + (tile_pos % BLOCK_SIZE) * stride_cs
            # The latent's first R channels: the key part that meets q_nope and the value.
            c = load_kv_tile(
                slot_base + c_offsets,
                k_valid[:, None] & rank_valid[None, :],
                FP8_BITS,
                q_nope.dtype,
            )
            s = tl.dot(q_nope, tl.trans(c), input_precision=DOT_PRECISION)
            if ROPE_DIM > 0:
                pe = load_kv_tile(
                    slot_base + pe_offsets,
                    k_valid[:, None] & rope_valid[None, :],
                    FP8_BITS,
                    q_nope.dtype,
                )
                s += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
            s = mask_scores(
                s * qk_scale,
                row_valid,
                k_valid,
                q_pos,
                k_pos,
                window,
                1,
                IS_CAUSAL,
                USE_WINDOW,
                False,
            )
            m_i, l_i, acc = online_softmax_update(
                s,
                c,
                m_i,
                l_i,
                acc,
                query_ptr.dtype.element_ty,
                DOT_PRECISION,
                DOT_IN_FP32,
            )

        # l_i == 0 only for rows that see no key (padding rows, an empty split): output
        # 0 and lse -inf, which the merge ignores.
        seen = l_i > 0.0
        l_safe = tl.where(seen, l_i, 1.0)
        out = acc * (kv_scale_value / l_safe)[:, None]
        tl.store(
            out_ptr
            + split64 * stride_os
            + q_token[:, None] * stride_ot
            + head[:, None] * stride_oh
            + rank_dims[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & rank_valid[None, :],
        )
        if STORE_LSE:
            lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
            tl.store(
                lse_ptr + split64 * stride_ls + q_token * stride_lt + head * stride_lh,
                lse,
                mask=row_valid,
            )


@triton.jit
def _write_mla_latents_kernel(
    latents_ptr,
    cache_ptr,
    slot_mapping_ptr,
    kv_scale_ptr,
    kv_scale,
    num_slots,
    stride_xt,
    stride_xd,
    stride_cb,
    stride_cs,
    LATENT_DIM: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_SCALE: tl.constexpr,
    KV_SCALE_FROM_PTR: tl.constexpr,
    TO_FP8: tl.constexpr,
    FP8_BITS: tl.constexpr,
):
    tl.static_assert(LATENT_PAD >= LATENT_DIM)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # -1 is a padding token. A slot past the cache end is dropped as well: the launcher
    # cannot check slot values without a device-to-host sync.
    if (slot >= 0) & (slot < num_slots):
        dims = tl.arange(0, LATENT_PAD)
        mask = dims < LATENT_DIM
        x = tl.load(latents_ptr + token * stride_xt + dims * stride_xd, mask=mask)
        if USE_SCALE:
            scale_value = kv_scale
            if KV_SCALE_FROM_PTR:
                scale_value = tl.load(kv_scale_ptr)
            x = tl.math.div_rn(x.to(tl.float32), scale_value)
        dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + dims
        if FP8_BITS:
            tl.store(dst, f32_to_e4m3_bits(x.to(tl.float32)), mask=mask)
        elif TO_FP8:
            # Saturate to the finite e4m3 range (no infinity; NaN passes through).
            x = saturate_e4m3(x.to(tl.float32))
            tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


# Under the Triton interpreter (CPU tests, INTERPRETED) two things differ from compiled
# kernels, as in attention/triton.py: its tl.dot multiplies bfloat16 operands as their
# uint16 bit patterns (triton-lang/triton#11584), so bfloat16 dot operands are upcast to
# float32 after the same rounding (DOT_IN_FP32); and it stores float8 tensors as raw
# uint8 with a float8 <-> float32 conversion that misreads e4m3fn's NaN and misrounds, so
# fp8 caches travel as uint8 views decoded (load_kv_tile) and encoded (f32_to_e4m3_bits)
# exactly with integer ops (FP8_BITS; attnkit.kernels._triton.fp8). Compiled kernels keep
# native bf16 dots and the hardware fp8 conversion (sm_89+); both flags are constexprs
# that cost them nothing.


# ------------------------------------------------------------------------ launch


@dataclasses.dataclass(frozen=True, slots=True)
class MLALaunchShape:
    """Register-tile choices of one :func:`mla_attention` launch (:func:`mla_launch_shape`)."""

    block_h: int
    """Heads per program (``BLOCK_H``, a power of two)."""
    rows_q: int
    """Query tokens per inner step (``ROWS_Q``; ``rows_q * block_h`` rows)."""
    tile_n: int
    """Keys per inner step (``TILE_N``; divides the block size)."""
    num_warps: int
    num_stages: int


def mla_launch_shape(
    num_heads: int, block_q: int, block_size: int, rank_pad: int, *, fp32: bool
) -> MLALaunchShape:
    """Tile and warp choices of the MLA kernel (no register spills at DeepSeek's dims).

    The working set of a step is the float32 accumulator ``[M, R]`` (``M = rows_q *
    block_h`` rows), the query ``[M, R + P]`` (loop invariant: it stays in registers, as
    the A operand of the score dot, which the tensor-core layout replicates across the
    warps that split the key dimension) and a latent tile ``[TILE_N, R + P]``.

    * Rows: heads first (every head of a block shares each latent load) up to
      ``max_rows``; query tokens then fill the step up to ``max_rows``; at least 16 rows
      (the smallest M of ``tl.dot``).
    * 16-bit, ``R >= 256`` (DeepSeek: 512): 32 rows, 16 keys, 8 warps, 2 stages. From
      the compile report at ``H = 128, D = 576``: 194-250 registers and no spill on
      sm_80/90/100 (the fp8-latent decode is the tightest, 250). 32 keys spilled 24 bytes
      (fp8, sm_90/100); 64 rows spilled 800+ bytes (128 accumulator registers per thread
      at 8 warps plus the query); 32 rows at 4 warps spilled 200-400 bytes.
    * 16-bit, smaller ``R``: 64 rows, 32 keys, 4 warps, 2 stages.
    * float32 (IEEE dots on the FMA units): 16 rows, 16 keys, one stage (float32
      attention is bound by its FMA dots, not by load latency); 8 warps from ``R >=
      256``.
    """
    if fp32:
        max_rows = 16
        tile_n = 16
        num_warps = 8 if rank_pad >= 256 else 4
        num_stages = 1
    elif rank_pad >= 256:
        max_rows, tile_n, num_warps, num_stages = 32, 16, 8, 2
    else:
        max_rows, tile_n, num_warps, num_stages = _MAX_ROWS, 32, 4, 2
    block_h = min(triton.next_power_of_2(num_heads), max_rows)
    rows_q = min(block_q, max(1, max_rows // block_h))
    rows_q = max(rows_q, -(-_MIN_ROWS // block_h))
    return MLALaunchShape(block_h, rows_q, min(tile_n, block_size), num_warps, num_stages)


def mla_split_workspace(
    num_splits: int,
    num_tokens: int,
    num_heads: int,
    kv_lora_rank: int,
    *,
    device: torch.device,
) -> SplitKVWorkspace:
    """Scratch for split-KV MLA: float32 partials ``[S, T, H, R]`` and lse ``[S, T, H]``.

    A workspace sized for the largest batch (``num_tokens``) and split count serves
    every smaller one; pass it to :func:`mla_attention` to keep the launch allocation-free.
    """
    return split_kv_workspace(num_splits, num_tokens, num_heads, kv_lora_rank, device=device)


def _check_plan(plan: object, block_size: int) -> PagedAttentionPlan:
    if not isinstance(plan, PagedAttentionPlan):
        raise KernelTypeError(
            f"plan: expected a PagedAttentionPlan (plan_paged_attention with num_kv_heads=1), "
            f"got {describe(plan)}"
        )
    if plan.num_kv_heads != 1:
        raise ValueError(
            f"plan: expected num_kv_heads=1 (one latent per token is the only kv head), "
            f"got num_kv_heads={plan.num_kv_heads}"
        )
    if plan.chunk_size is not None:
        raise ValueError(
            f"plan: expected chunk_size=None (MLA has no chunked-local mask), "
            f"got chunk_size={plan.chunk_size}"
        )
    if plan.block_size != block_size:
        raise ValueError(
            f"latent_cache: expected block size {plan.block_size} (the plan's block_size), "
            f"got {block_size}"
        )
    return plan


def mla_attention(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    plan: PagedAttentionPlan,
    *,
    kv_lora_rank: int,
    scale: float,
    kv_scale: float | torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: SplitKVWorkspace | None = None,
) -> torch.Tensor:
    """Absorbed-form MLA of ``query`` ``[T, H, D]`` over ``latent_cache`` ``[NB, BS, D]``.

    The step's latents must already be in the cache (:func:`write_mla_latents`).

    Args:
        query: ``[T, H, D]`` float32/float16/bfloat16, any strides: per head the absorbed
            ``q_nope @ W_UK`` (first ``R`` channels) then ``q_pe``.
        latent_cache: ``[NB, BS, D]`` contiguous, the query dtype or
            ``torch.float8_e4m3fn``; ``BS`` the plan's block size.
        plan: :func:`~attnkit.kernels.attention.triton_plan.plan_paged_attention` with
            ``num_kv_heads=1`` (``sliding_window`` for sliding-window MLA; ``num_splits``
            0 for one pass, ``S >= 1`` for split-KV, None to choose).
        kv_lora_rank: ``R``; the values are the first ``R`` channels of each latent.
        scale: multiplies ``q . latent`` (a layer parameter).
        kv_scale: multiplies the cached latents: None (1.0), a float > 0 or a one-element
            float32 device tensor (read by the kernel). Required with an fp8 cache,
            which stores ``latent / kv_scale``.
        output: optional ``[T, H, R]`` of the query dtype to write into.
        lse: optional float32 ``[T, H]`` to receive the natural-log lse.
        workspace: split-KV scratch (:func:`mla_split_workspace`); allocated per call
            when the plan uses split-KV and none is given; ignored otherwise.

    Returns:
        ``output`` (allocated when not given).

    Raises:
        ValueError (TypeError too for a wrong Python type): naming the argument.
    """
    if not isinstance(plan, PagedAttentionPlan):
        raise KernelTypeError(
            f"plan: expected a PagedAttentionPlan (plan_paged_attention with num_kv_heads=1), "
            f"got {describe(plan)}"
        )
    device = plan.device
    query = check_mla_query(query, device)
    latent_cache = check_latent_cache(latent_cache, query)
    num_tokens, num_heads, latent_dim = query.shape
    if latent_dim > MAX_LATENT_DIM:
        raise ValueError(f"query: expected a latent width D <= {MAX_LATENT_DIM}, got {latent_dim}")
    block_size = latent_cache.shape[1]
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"latent_cache: expected block size in {SUPPORTED_BLOCK_SIZES}, got {block_size}"
        )
    plan = _check_plan(plan, block_size)
    rank = check_kv_lora_rank(kv_lora_rank, latent_dim)
    scale = check_finite_float("scale", scale)
    scale_arg = check_mla_kv_scale(kv_scale, latent_cache.dtype, device)
    output = check_mla_output(output, query, rank)
    lse = check_mla_lse(lse, query)
    if output is None:
        output = torch.empty((num_tokens, num_heads, rank), dtype=query.dtype, device=query.device)
    if plan.num_splits and workspace is None and num_tokens and plan.num_tiles:
        workspace = mla_split_workspace(plan.num_splits, num_tokens, num_heads, rank, device=device)
    if num_tokens == 0 or plan.num_tiles == 0:
        return output

    rope = latent_dim - rank
    rank_pad = max(16, triton.next_power_of_2(rank))
    rope_pad = max(16, triton.next_power_of_2(rope)) if rope else 16
    shape = mla_launch_shape(
        num_heads, plan.block_q, block_size, rank_pad, fp32=query.dtype == torch.float32
    )
    fp8_bits = latent_cache.dtype == FP8_DTYPE and INTERPRETED
    common = {
        "query_ptr": query,
        # A uint8 view shares the storage (no copy); see the note on INTERPRETED.
        "cache_ptr": latent_cache.view(torch.uint8) if fp8_bits else latent_cache,
        "query_start_loc_ptr": plan.query_start_loc,
        "seq_lens_ptr": plan.seq_lens,
        "block_table_ptr": plan.block_table,
        "tile_offsets_ptr": plan.tile_offsets,
        # A tensor scale is read by the kernel; seq_lens stands in for the unread pointer.
        "kv_scale_ptr": scale_arg if isinstance(scale_arg, torch.Tensor) else plan.seq_lens,
        "scale": scale,
        "kv_scale": scale_arg if isinstance(scale_arg, float) else 1.0,
        "window": plan.sliding_window if plan.sliding_window is not None else 0,
        "num_reqs": plan.num_reqs,
        "search_iters": plan.search_iters,
        "num_heads": num_heads,
        "stride_qt": query.stride(0),
        "stride_qh": query.stride(1),
        "stride_qd": query.stride(2),
        "stride_cb": latent_cache.stride(0),
        "stride_cs": latent_cache.stride(1),
        "stride_bt": plan.block_table.stride(0),
        "KV_LORA_RANK": rank,
        "RANK_PAD": rank_pad,
        "ROPE_DIM": rope,
        "ROPE_PAD": rope_pad,
        "BLOCK_H": shape.block_h,
        "BLOCK_Q": plan.block_q,
        "ROWS_Q": shape.rows_q,
        "BLOCK_SIZE": block_size,
        "TILE_N": shape.tile_n,
        "IS_CAUSAL": plan.causal,
        "USE_WINDOW": plan.sliding_window is not None,
        "KV_SCALE_FROM_PTR": isinstance(scale_arg, torch.Tensor),
        "FP8_BITS": fp8_bits,
        # float32 inputs would otherwise default to TF32 on NVIDIA; no effect on 16-bit
        # operands (tensor cores, float32 accumulation).
        "DOT_PRECISION": "ieee",
        "DOT_IN_FP32": INTERPRETED and query.dtype == torch.bfloat16,
        "num_warps": shape.num_warps,
        "num_stages": shape.num_stages,
        # Explicit: Triton 3.9 warns when the option is left unset.
        "enable_fp_fusion": True,
    }
    head_blocks = triton.cdiv(num_heads, shape.block_h)
    if not plan.num_splits:
        _mla_attention_kernel[(plan.num_tiles, head_blocks, 1)](
            out_ptr=output,
            lse_ptr=lse if lse is not None else output,
            num_splits=1,
            stride_os=0,
            stride_ot=output.stride(0),
            stride_oh=output.stride(1),
            stride_od=output.stride(2),
            stride_ls=0,
            stride_lt=lse.stride(0) if lse is not None else 0,
            stride_lh=lse.stride(1) if lse is not None else 0,
            SPLIT_KV=False,
            STORE_LSE=lse is not None,
            **common,
        )
        return output

    # Checked before stage 1 writes into it (merge_split_kv checks it again).
    part_out, part_lse = _check_workspace(
        workspace, plan.num_splits, num_tokens, num_heads, rank, device
    )
    _mla_attention_kernel[(plan.num_tiles, head_blocks, plan.num_splits)](
        out_ptr=part_out,
        lse_ptr=part_lse,
        num_splits=plan.num_splits,
        stride_os=part_out.stride(0),
        stride_ot=part_out.stride(1),
        stride_oh=part_out.stride(2),
        stride_od=part_out.stride(3),
        stride_ls=part_lse.stride(0),
        stride_lt=part_lse.stride(1),
        stride_lh=part_lse.stride(2),
        SPLIT_KV=True,
        STORE_LSE=True,
        **common,
    )
    return merge_split_kv(SplitKVWorkspace(part_out, part_lse), output, plan, lse=lse)


def _check_workspace(
    workspace: object,
    num_splits: int,
    num_tokens: int,
    num_heads: int,
    rank: int,
    device: torch.device,
) -> SplitKVWorkspace:
    """The split-KV scratch holds ``S`` splits of float32 ``[T, H, R]`` on ``device``."""
    if not isinstance(workspace, tuple) or len(workspace) != 2:  # pyright: ignore[reportUnknownArgumentType]
        raise KernelTypeError(
            "workspace: expected a SplitKVWorkspace(partial_out, partial_lse) "
            f"(mla_split_workspace), got {describe(workspace)}"
        )
    part_out, part_lse = workspace  # pyright: ignore[reportUnknownVariableType]
    for name, t, tail in (
        ("partial_out", part_out, (num_heads, rank)),
        ("partial_lse", part_lse, (num_heads,)),
    ):
        want = f"[S >= {num_splits}, T >= {num_tokens}, {', '.join(map(str, tail))}]"
        if not isinstance(t, torch.Tensor):
            raise KernelTypeError(f"workspace.{name}: expected a tensor {want}, got {describe(t)}")
        if (
            t.dim() != 2 + len(tail)
            or t.shape[0] < num_splits
            or t.shape[1] < num_tokens
            or tuple(t.shape[2:]) != tail
        ):
            raise ValueError(
                f"workspace.{name}: expected shape {want} (R = kv_lora_rank), got {tuple(t.shape)}"
            )
        if t.dtype != torch.float32:
            raise ValueError(f"workspace.{name}: expected dtype torch.float32, got {t.dtype}")
        check_device(f"workspace.{name}", t, device)
    return SplitKVWorkspace(part_out, part_lse)


def write_mla_latents(
    latents: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scale: float | torch.Tensor | None = None,
) -> None:
    """Write ``latents`` ``[T, D]`` (or ``[T, 1, D]``) into ``latent_cache`` ``[NB, BS, D]``.

    Token ``t`` goes to slot ``slot_mapping[t] = block * BS + offset``; ``-1`` (or a slot
    outside ``[0, NB * BS)``) skips the token. Slots must be distinct among written
    tokens; the launcher never reads slot values back to the host.

    With a ``torch.float8_e4m3fn`` cache ``kv_scale`` is required and the cache stores
    ``latent / kv_scale`` (float32 division, clamped to ``[-448, 448]``, rounded to
    nearest even); ``latents`` may then be float32, float16 or bfloat16. Otherwise
    ``latents`` has the cache dtype and, when ``kv_scale`` is given, the cache stores
    ``latent / kv_scale`` cast to its dtype (what :func:`mla_attention` undoes with the
    same ``kv_scale``).
    """
    cache = latent_cache
    if not isinstance(cache, torch.Tensor):
        raise KernelTypeError(
            f"latent_cache: expected a torch.Tensor [NB, BS, D], got {describe(cache)}"
        )
    if cache.dim() != 3:
        raise ValueError(f"latent_cache: expected shape [NB, BS, D], got {tuple(cache.shape)}")
    if cache.dtype not in (torch.float32, torch.float16, torch.bfloat16, FP8_DTYPE):
        raise ValueError(
            "latent_cache: expected dtype in "
            f"{(torch.float32, torch.float16, torch.bfloat16, FP8_DTYPE)}, got {cache.dtype}"
        )
    if 0 in cache.shape:
        raise ValueError(f"latent_cache: expected NB, BS, D >= 1, got {describe(cache)}")
    if not cache.is_contiguous():
        raise ValueError(
            "latent_cache: expected a contiguous tensor, got a non-contiguous one "
            f"({describe(cache)}, strides {tuple(cache.stride())})"
        )
    latents = check_latents(latents, cache)
    num_tokens, latent_dim = latents.shape
    if latent_dim > MAX_LATENT_DIM:
        raise ValueError(
            f"latent_cache: expected a latent width D <= {MAX_LATENT_DIM}, got {latent_dim}"
        )
    slot_mapping = check_slot_mapping(slot_mapping, num_tokens, cache.device)
    scale_arg = check_mla_kv_scale(kv_scale, cache.dtype, cache.device)
    if num_tokens == 0:
        return
    is_fp8 = cache.dtype == FP8_DTYPE
    fp8_bits = is_fp8 and INTERPRETED
    _write_mla_latents_kernel[(num_tokens,)](
        latents_ptr=latents,
        # A uint8 view shares the storage (no copy); see the note on INTERPRETED.
        cache_ptr=cache.view(torch.uint8) if fp8_bits else cache,
        slot_mapping_ptr=slot_mapping,
        kv_scale_ptr=scale_arg if isinstance(scale_arg, torch.Tensor) else slot_mapping,
        kv_scale=scale_arg if isinstance(scale_arg, float) else 1.0,
        num_slots=cache.shape[0] * cache.shape[1],
        stride_xt=latents.stride(0),
        stride_xd=latents.stride(1),
        stride_cb=cache.stride(0),
        stride_cs=cache.stride(1),
        LATENT_DIM=latent_dim,
        LATENT_PAD=triton.next_power_of_2(latent_dim),
        BLOCK_SIZE=cache.shape[1],
        USE_SCALE=scale_arg is not None,
        KV_SCALE_FROM_PTR=isinstance(scale_arg, torch.Tensor),
        TO_FP8=is_fp8,
        FP8_BITS=fp8_bits,
        enable_fp_fusion=True,
    )
