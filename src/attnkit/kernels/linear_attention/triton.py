"""Linear attention with a constant per-head decay, states in a cache (Triton).

Semantics, shapes and cache conventions are those of the torch oracle
:mod:`attnkit.kernels.linear_attention.reference` (read its module docstring): per head
``h`` with ``lam = exp(-decay[h])``::

    S_t = lam * S_{t-1} + outer(k_t, v_t);    o_t = scale * S_t^T q_t

with float32 states ``[S, H, K, V]`` (any strides) addressed by ``state_indices``.

Kernel design
-------------
:func:`chunk_linear_attention_varlen` launches one program per (request, head, tile of
``BLOCK_V`` value columns): columns of the state are independent, so each program owns
the ``[K, BLOCK_V]`` slice of its request's state and walks the request's chunks in
order -- the intra/inter-block split of Lightning Attention-2 (Z. Qin et al.,
arXiv:2401.04658). Chunks start at each request's first token of the call, as in the
oracle; a chunk is padded to ``BLOCK_C = max(16, next_pow2(chunk_size))`` rows (masked),
so any chunk size in ``[1, 128]`` works. Per chunk of ``n`` tokens, for each tile of
``BLOCK_K`` key rows of the state (the output is a sum over key tiles):

* ``o += lam^(i+1) q_kt S_kt`` (inter-chunk part, old state) and
  ``S_kt <- lam^n S_kt + sum_j lam^(n-1-j) k_j,kt^T v_j`` (the update, summed over
  blocks of ``BLOCK_J`` tokens);

then, over blocks of ``BLOCK_J`` key tokens ``j``, ``o += ((q k_j^T) * M) v_j`` with the
decay mask ``M[i, j] = lam^(i-j)`` (``j <= i``), the scores summed over key tiles. Token
blocks past the chunk's ``n`` tokens are skipped (short last chunks, short requests).

Registers and shared memory therefore depend on the tiles only (``[BLOCK_C, BLOCK_V]``
output, ``[BLOCK_C, BLOCK_J]`` scores, ``[BLOCK_K, BLOCK_V]`` state tile), never on ``K``,
``V`` or ``BLOCK_C`` beyond those tensors, and every configuration (``K, V <= 256``,
chunks up to 128) compiles without spills within the shared memory of sm_80.
The alternative of keeping the whole ``[K, BLOCK_V]`` slice in registers across chunks
(no tiling of ``K``) needs ``[BLOCK_C, K]`` operands at once and cannot be tiled in
Triton, which has no indexing into a register tensor; a multi-kernel scheme (per-chunk
states in parallel, then a recurrence) needs a workspace of one state per chunk and
chunk bookkeeping on the host side. Instead the slice lives in the request's cache
slot, which is the program's working buffer: each key tile is read, used and written
back once per chunk (from L2 in practice). Without an initial state the slot is first
zeroed (its old content is never read). A barrier ends every chunk so the next chunk's
reads see this chunk's writes by other threads, and the launch uses ``num_stages=1`` so
no load is software-pipelined ahead of the write it depends on. The ``BLOCK_J`` token
blocks bound the reduction length of the dots, which sets their operand registers
(on sm_80 the whole reduction extent of an operand is held in registers).

:func:`linear_attention_decode` launches one program per (request, head, value tile),
loads the state slice, applies one step in registers and writes it back (elementwise:
no matrix products).

The launchers check shapes, dtypes and devices only: they never read tensor values back
to the host (so they are safe under CUDA graphs). ``query_start_loc``,
``state_indices`` and ``decay >= 0`` are therefore trusted; the torch oracle checks them.

Precision
---------
float32 inputs: every dot is IEEE float32 (FMA, ``input_precision="ieee"``).

16-bit inputs: every dot runs on tensor cores with 16-bit operands and float32
accumulation, and no operand is rounded by more than about 2^-16 relative: ``q k^T``
multiplies the inputs themselves (exact products); the float32 operands -- the state
``S``, the masked scores ``p`` and the decayed keys ``lam^(n-1-j) k`` -- are each split
into a high and a low 16-bit part (``x = hi + lo`` to ~16 significant bits) and the dot
is the sum of the dots of the parts. ``S`` and ``p`` are split into bfloat16 (the range
of float32: a long sequence without decay grows the state past float16's 65504); with
float16 inputs the other operand (``q``, ``v``: 11 significant bits) is then split into
bfloat16 parts too, exactly, and the ``lo x lo`` product (~2^-16) is dropped. The decayed
keys stay in the input dtype (``|lam^m k| <= |k|``). A single 16-bit rounding of ``p``
(as flash attention rounds its probabilities) measured up to 1.6x the bfloat16
tolerance where the terms of an output cancel; with the splits the error is mostly the
final rounding of the output, and the float32 states stay within 2e-4 of the definition.
The Triton interpreter ignores ``input_precision`` and computes bfloat16 dots wrongly, so
under it the 16-bit operands are widened to float32 first (exact) and bfloat16 outputs
are rounded to nearest by hand: the interpreter tests measure the kernel's own rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.kernels._checks import (
    check_chunk_size,
    check_distinct_output,
    check_dtype,
    check_finite_float,
    check_has_slots,
    check_slot_tensor,
    check_states,
    check_varlen_tensors,
)
from attnkit.kernels._triton.interpret import INTERPRETED
from attnkit.kernels._triton.rounding import round_bf16
from attnkit.kernels._triton.varlen import flags_as_bytes
from attnkit.kernels.linear_attention.contract import alloc_out, check_decay_shape, check_qkv

__all__ = ["chunk_linear_attention_varlen", "linear_attention_decode"]

# Kernels whose work is matrix products: with 16-bit inputs they must run on tensor
# cores (benchmarks/compile_report.py fails a 16-bit variant without MMA instructions).
TENSOR_CORE_KERNELS = ("_chunk_linear_attention_kernel",)

_MAX_KEY_DIM = 256
_MAX_CHUNK_SIZE = 128
# Largest (BLOCK_K, BLOCK_V, BLOCK_J) of the chunk kernel: 16-bit inputs (tensor-core
# dots) and float32 inputs (FMA dots, operands in registers). See _chunk_config.
_DOT16_TILES = (16, 32, 32)
_FP32_TILES = (16, 32, 16)
# Register budget (.maxnreg) of the chunk kernel by "inputs are float32": above what any
# variant needs (16-bit: at most ~175 on sm_80, ~130 on sm_90/100), below 255.
_MAX_REGISTERS = {False: 192, True: 255}


@triton.jit
def _dot16(a, b, acc, EMULATE: tl.constexpr):
    """``acc + a @ b`` for 16-bit ``a``, ``b`` with float32 accumulation (tensor cores).

    The interpreter computes a bfloat16 ``tl.dot`` wrongly, so under it (``EMULATE``)
    the operands are widened to float32 first: products of 16-bit values are exact in
    float32, so this is the same computation up to the order of the float32 sums.
    """
    if EMULATE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _chunk_linear_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    decay_ptr,
    o_ptr,
    states_ptr,
    query_start_loc_ptr,
    state_indices_ptr,
    has_initial_state_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_qk,
    stride_kt,
    stride_kh,
    stride_kk,
    stride_vt,
    stride_vh,
    stride_vv,
    stride_ot,
    stride_oh,
    stride_ov,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_sv,
    stride_decay,
    stride_qsl,
    stride_si,
    stride_his,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_J: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    SPLIT_Q: tl.constexpr,
    EMULATE_DOT16: tl.constexpr,
    EXACT_BF16: tl.constexpr,
):
    tl.static_assert(BLOCK_C >= CHUNK)
    # tl.dot needs every dimension >= 16.
    tl.static_assert(BLOCK_K >= 16)
    tl.static_assert(BLOCK_V >= 16)
    tl.static_assert(BLOCK_C >= 16)
    in_dtype = q_ptr.dtype.element_ty

    request = tl.program_id(0)
    head = tl.program_id(1)
    v_tile = tl.program_id(2)

    start = tl.load(query_start_loc_ptr + request * stride_qsl)
    end = tl.load(query_start_loc_ptr + (request + 1) * stride_qsl)
    # int64 before multiplying by strides: S * H * K * V may exceed 2**31 elements.
    slot = tl.load(state_indices_ptr + request * stride_si).to(tl.int64)
    has_init = tl.load(has_initial_state_ptr + request * stride_his) != 0
    neg_decay = -tl.load(decay_ptr + head * stride_decay).to(tl.float32)

    offs_kt = tl.arange(0, BLOCK_K)
    offs_v = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    v_valid = offs_v < VALUE_DIM
    # The program's [K, BLOCK_V] slice of the state lives in its cache slot, which is
    # the working buffer (float32): read and written one [BLOCK_K, BLOCK_V] tile at a
    # time, so registers and shared memory do not grow with K.
    state_cols = states_ptr + slot * stride_ss + head * stride_sh + offs_v[None, :] * stride_sv

    if not has_init:
        # Start from zeros: the slot's old content (maybe NaN) is never read.
        for k0 in range(0, KEY_DIM, BLOCK_K):
            offs_k = k0 + offs_kt
            tl.store(
                state_cols + offs_k[:, None] * stride_sk,
                tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32),
                mask=(offs_k < KEY_DIM)[:, None] & v_valid[None, :],
            )
    # Each chunk's state reads follow the previous chunk's writes, possibly by other
    # threads of the program: a barrier orders them (global memory is coherent within a
    # thread block across a barrier).
    tl.debug_barrier()

    rows = tl.arange(0, BLOCK_C)
    pos = rows.to(tl.float32)
    # num_stages=1: the state tiles read in one chunk are those written by the previous
    # one, so no load of chunk c+1 may be issued (software-pipelined) before chunk c ends.
    for c0 in tl.range(start, end, CHUNK, num_stages=1):
        n = tl.minimum(end - c0, CHUNK)
        row_valid = rows < n
        tok = (c0 + rows).to(tl.int64)
        v_mask = row_valid[:, None] & v_valid[None, :]
        decay_all = tl.exp(neg_decay * n.to(tl.float32))  # lam^n

        # Inter-chunk part q_i . S and the state update, one key tile of the state at a
        # time: S_kt <- lam^n S_kt + sum_j lam^(n-1-j) k_j,kt^T v_j, summed over blocks
        # of BLOCK_J tokens (the reduction length of a dot sets its operand registers).
        o = tl.zeros([BLOCK_C, BLOCK_V], dtype=tl.float32)
        for k0 in range(0, KEY_DIM, BLOCK_K):
            offs_k = k0 + offs_kt
            k_valid = offs_k < KEY_DIM
            q = tl.load(
                q_ptr + tok[:, None] * stride_qt + head * stride_qh + offs_k[None, :] * stride_qk,
                mask=row_valid[:, None] & k_valid[None, :],
                other=0.0,
            )
            state_ptrs = state_cols + offs_k[:, None] * stride_sk
            state_mask = k_valid[:, None] & v_valid[None, :]
            state = tl.load(state_ptrs, mask=state_mask, other=0.0)
            if IEEE_FP32:
                o = tl.dot(q, state, o, input_precision="ieee")
            else:
                # The float32 state as a sum of two bfloat16 values (bfloat16: the range
                # of float32, so no overflow): error ~2^-16 relative, on tensor cores.
                s_hi = state.to(tl.bfloat16)
                s_lo = (state - s_hi.to(tl.float32)).to(tl.bfloat16)
                if SPLIT_Q:
                    # float16 q: its 11 significant bits are exactly bf16 hi + lo.
                    q_hi = q.to(tl.bfloat16)
                    q_lo = (q.to(tl.float32) - q_hi.to(tl.float32)).to(tl.bfloat16)
                    o = _dot16(q_hi, s_hi, o, EMULATE_DOT16)
                    o = _dot16(q_lo, s_hi, o, EMULATE_DOT16)
                    o = _dot16(q_hi, s_lo, o, EMULATE_DOT16)
                else:
                    o = _dot16(q, s_hi, o, EMULATE_DOT16)
                    o = _dot16(q, s_lo, o, EMULATE_DOT16)
            update = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
            # Only blocks holding some of the chunk's n tokens (a short last chunk or
            # request skips the padding).
            for j0 in range(0, n, BLOCK_J):
                cols = j0 + tl.arange(0, BLOCK_J)
                col_valid = cols < n
                tok_j = (c0 + cols).to(tl.int64)
                k_j = tl.load(
                    k_ptr
                    + tok_j[:, None] * stride_kt
                    + head * stride_kh
                    + offs_k[None, :] * stride_kk,
                    mask=col_valid[:, None] & k_valid[None, :],
                    other=0.0,
                )
                v_j = tl.load(
                    v_ptr
                    + tok_j[:, None] * stride_vt
                    + head * stride_vh
                    + offs_v[None, :] * stride_vv,
                    mask=col_valid[:, None] & v_valid[None, :],
                    other=0.0,
                )
                # lam^(n-1-j); padding tokens get 0, not exp(+large).
                decay_out = tl.where(
                    col_valid, tl.exp(neg_decay * (n - 1 - cols).to(tl.float32)), 0.0
                )
                k_dec = k_j.to(tl.float32) * decay_out[:, None]
                if IEEE_FP32:
                    update = tl.dot(tl.trans(k_dec), v_j, update, input_precision="ieee")
                else:
                    # Decayed keys as hi + lo in the input dtype (|k_dec| <= |k|: no
                    # overflow), so the state update stays accurate to ~float32.
                    kd_hi = k_dec.to(in_dtype)
                    kd_lo = (k_dec - kd_hi.to(tl.float32)).to(in_dtype)
                    update = _dot16(tl.trans(kd_hi), v_j, update, EMULATE_DOT16)
                    update = _dot16(tl.trans(kd_lo), v_j, update, EMULATE_DOT16)
            tl.store(state_ptrs, state * decay_all + update, mask=state_mask)
        o = o * (tl.exp(neg_decay * (pos + 1.0)) * scale)[:, None]  # scale * lam^(i+1)

        # Intra-chunk part: scale * ((q k^T) * M) v with M[i, j] = lam^(i-j), j <= i,
        # over blocks of BLOCK_J key tokens j (so the scores tile is [BLOCK_C, BLOCK_J]).
        for j0 in range(0, n, BLOCK_J):
            cols = j0 + tl.arange(0, BLOCK_J)
            col_valid = cols < n
            tok_j = (c0 + cols).to(tl.int64)
            scores = tl.zeros([BLOCK_C, BLOCK_J], dtype=tl.float32)
            for k0 in range(0, KEY_DIM, BLOCK_K):
                offs_k = k0 + offs_kt
                k_valid = offs_k < KEY_DIM
                q = tl.load(
                    q_ptr
                    + tok[:, None] * stride_qt
                    + head * stride_qh
                    + offs_k[None, :] * stride_qk,
                    mask=row_valid[:, None] & k_valid[None, :],
                    other=0.0,
                )
                k = tl.load(
                    k_ptr
                    + tok_j[:, None] * stride_kt
                    + head * stride_kh
                    + offs_k[None, :] * stride_kk,
                    mask=col_valid[:, None] & k_valid[None, :],
                    other=0.0,
                )
                if IEEE_FP32:
                    scores = tl.dot(q, tl.trans(k), scores, input_precision="ieee")
                else:
                    scores = _dot16(q, tl.trans(k), scores, EMULATE_DOT16)
            v_j = tl.load(
                v_ptr + tok_j[:, None] * stride_vt + head * stride_vh + offs_v[None, :] * stride_vv,
                mask=col_valid[:, None] & v_valid[None, :],
                other=0.0,
            )
            # Each power is one exp, selected (never multiplied); the exponent is clamped
            # to [0, n] (padding rows only) so that no entry overflows.
            diff = (rows[:, None] - cols[None, :]).to(tl.float32)  # i - j
            mask = tl.where(
                diff >= 0,
                tl.exp(neg_decay * tl.minimum(tl.maximum(diff, 0.0), n.to(tl.float32))),
                0.0,
            )
            p = scores * mask * scale
            if IEEE_FP32:
                o = tl.dot(p, v_j, o, input_precision="ieee")
            else:
                # p as a sum of two bfloat16 values, like the state above: one rounding
                # to 16 bits would cost more than the tolerance where terms cancel.
                p_hi = p.to(tl.bfloat16)
                p_lo = (p - p_hi.to(tl.float32)).to(tl.bfloat16)
                if SPLIT_Q:
                    # float16 v: exactly bf16 hi + lo.
                    v_hi = v_j.to(tl.bfloat16)
                    v_lo = (v_j.to(tl.float32) - v_hi.to(tl.float32)).to(tl.bfloat16)
                    o = _dot16(p_hi, v_hi, o, EMULATE_DOT16)
                    o = _dot16(p_lo, v_hi, o, EMULATE_DOT16)
                    o = _dot16(p_hi, v_lo, o, EMULATE_DOT16)
                else:
                    o = _dot16(p_hi, v_j, o, EMULATE_DOT16)
                    o = _dot16(p_lo, v_j, o, EMULATE_DOT16)
        tl.store(
            o_ptr + tok[:, None] * stride_ot + head * stride_oh + offs_v[None, :] * stride_ov,
            round_bf16(o, EXACT_BF16).to(o_ptr.dtype.element_ty),
            mask=v_mask,
        )
        # This chunk's state writes before the next chunk's reads (see above).
        tl.debug_barrier()


@triton.jit
def _linear_attention_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    decay_ptr,
    o_ptr,
    states_ptr,
    state_indices_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_qk,
    stride_kb,
    stride_kh,
    stride_kk,
    stride_vb,
    stride_vh,
    stride_vv,
    stride_ob,
    stride_oh,
    stride_ov,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_sv,
    stride_decay,
    stride_si,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    EXACT_BF16: tl.constexpr,
):
    request = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    v_tile = tl.program_id(2)

    slot = tl.load(state_indices_ptr + request * stride_si).to(tl.int64)
    lam = tl.exp(-tl.load(decay_ptr + head * stride_decay).to(tl.float32))

    offs_k = tl.arange(0, BLOCK_K)
    offs_v = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    k_valid = offs_k < KEY_DIM
    v_valid = offs_v < VALUE_DIM
    q = tl.load(
        q_ptr + request * stride_qb + head * stride_qh + offs_k * stride_qk, mask=k_valid, other=0.0
    ).to(tl.float32)
    k = tl.load(
        k_ptr + request * stride_kb + head * stride_kh + offs_k * stride_kk, mask=k_valid, other=0.0
    ).to(tl.float32)
    v = tl.load(
        v_ptr + request * stride_vb + head * stride_vh + offs_v * stride_vv, mask=v_valid, other=0.0
    ).to(tl.float32)

    state_mask = k_valid[:, None] & v_valid[None, :]
    state_ptrs = (
        states_ptr
        + slot * stride_ss
        + head * stride_sh
        + offs_k[:, None] * stride_sk
        + offs_v[None, :] * stride_sv
    )
    state = tl.load(state_ptrs, mask=state_mask, other=0.0)
    state = lam * state + k[:, None] * v[None, :]
    tl.store(state_ptrs, state, mask=state_mask)
    o = tl.sum(state * q[:, None], axis=0) * scale
    tl.store(
        o_ptr + request * stride_ob + head * stride_oh + offs_v * stride_ov,
        round_bf16(o, EXACT_BF16).to(o_ptr.dtype.element_ty),
        mask=v_valid,
    )


def _check_common(
    q: object, k: object, v: object, decay: object, scale: object, states: object, *, lead: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor]:
    q, k, v = check_qkv(q, k, v, lead=lead)
    check_dtype("q", q)
    if q.shape[2] > _MAX_KEY_DIM:
        raise ValueError(f"q: expected head dim K <= {_MAX_KEY_DIM}, got {q.shape[2]}")
    decay = check_decay_shape(decay, q)
    return q, k, v, decay, check_finite_float("scale", scale), check_states(states, q, v)


def _chunk_config(
    key_dim: int, value_dim: int, chunk_size: int, dtype: torch.dtype
) -> tuple[int, int, int, int, int]:
    """``(BLOCK_K, BLOCK_V, BLOCK_C, BLOCK_J, num_warps)`` of the chunk kernel.

    The chunk is padded to ``BLOCK_C = max(16, next_pow2(chunk_size))`` rows; the state
    is walked in ``[BLOCK_K, BLOCK_V]`` tiles and the chunk's tokens in blocks of
    ``BLOCK_J`` wherever they are the reduction dimension of a dot, so registers and
    shared memory depend on these tiles, never on ``K``, ``V`` or ``chunk_size`` beyond
    ``BLOCK_C``. The widest register tensors left are the ``[BLOCK_C, BLOCK_V]`` output
    and the ``[BLOCK_C, BLOCK_J]`` scores, hence 8 warps from 64 rows. float32 inputs
    use FMA dots whose operands sit in registers: smaller tiles.
    """
    block_c = max(16, triton.next_power_of_2(chunk_size))
    if dtype == torch.float32:
        k_cap, v_cap, j_cap = _FP32_TILES
    else:
        k_cap, v_cap, j_cap = _DOT16_TILES
    block_k = max(16, min(triton.next_power_of_2(key_dim), k_cap))
    block_v = max(16, min(triton.next_power_of_2(value_dim), v_cap))
    block_j = min(block_c, j_cap)
    return block_k, block_v, block_c, block_j, 8 if block_c >= 64 else 4


def _decode_blocks(key_dim: int, value_dim: int) -> tuple[int, int]:
    block_k = max(16, triton.next_power_of_2(key_dim))
    # The [BLOCK_K, BLOCK_V] float32 state slice lives in registers: narrower value
    # tiles for wide keys.
    block_v = max(16, min(triton.next_power_of_2(value_dim), 64 if block_k <= 128 else 32))
    return block_k, block_v


def chunk_linear_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    *,
    scale: float,
    query_start_loc: torch.Tensor,
    states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int = 64,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked linear attention over a varlen batch, reading/writing cached states.

    Same contract as the torch oracle of the same name, except that nothing is read
    back to the host: ``query_start_loc`` must be valid (starts at 0, ends at ``T``,
    non-decreasing), ``state_indices`` distinct and in ``[0, S)``, ``decay >= 0``.
    ``q``/``k``/``v`` are float32, float16 or bfloat16 with ``K <= 256``;
    ``chunk_size`` is in ``[1, 128]``. Any strides everywhere; ``out`` must not be
    ``q``, ``k``, ``v`` or ``states``.
    """
    q, k, v, decay, scale, states = _check_common(q, k, v, decay, scale, states, lead="T")
    chunk_size = check_chunk_size(chunk_size, maximum=_MAX_CHUNK_SIZE)
    qsl, si, his = check_varlen_tensors(
        query_start_loc, state_indices, has_initial_state, device=q.device
    )
    batch = qsl.shape[0] - 1
    check_has_slots("states", states, batch)
    o = alloc_out(out, q, v, lead="T")
    check_distinct_output("out", o, {"q": q, "k": k, "v": v, "states": states})

    _, heads, key_dim = q.shape
    value_dim = v.shape[2]
    if batch == 0 or heads == 0:
        return o
    block_k, block_v, block_c, block_j, num_warps = _chunk_config(
        key_dim, value_dim, chunk_size, q.dtype
    )
    grid = (batch, heads, triton.cdiv(value_dim, block_v))
    _chunk_linear_attention_kernel[grid](
        q_ptr=q,
        k_ptr=k,
        v_ptr=v,
        decay_ptr=decay,
        o_ptr=o,
        states_ptr=states,
        query_start_loc_ptr=qsl,
        state_indices_ptr=si,
        has_initial_state_ptr=flags_as_bytes(his),
        scale=scale,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_qk=q.stride(2),
        stride_kt=k.stride(0),
        stride_kh=k.stride(1),
        stride_kk=k.stride(2),
        stride_vt=v.stride(0),
        stride_vh=v.stride(1),
        stride_vv=v.stride(2),
        stride_ot=o.stride(0),
        stride_oh=o.stride(1),
        stride_ov=o.stride(2),
        stride_ss=states.stride(0),
        stride_sh=states.stride(1),
        stride_sk=states.stride(2),
        stride_sv=states.stride(3),
        stride_decay=decay.stride(0),
        stride_qsl=qsl.stride(0),
        stride_si=si.stride(0),
        stride_his=his.stride(0),
        KEY_DIM=key_dim,
        VALUE_DIM=value_dim,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        CHUNK=chunk_size,
        BLOCK_C=block_c,
        BLOCK_J=block_j,
        IEEE_FP32=q.dtype == torch.float32,
        SPLIT_Q=q.dtype == torch.float16,
        EMULATE_DOT16=INTERPRETED,
        EXACT_BF16=INTERPRETED and q.dtype == torch.bfloat16,
        num_warps=num_warps,
        # No software pipelining: the loads it would issue early include state tiles
        # that the previous iteration writes (see the kernel).
        num_stages=1,
        # An explicit register budget (.maxnreg): Triton runs ptxas with
        # --regAllocOptLevel=2 (a workaround of its own), under which ptxas 13 for sm_100
        # settles on 80 registers for the 128-row chunks and spills 12-24 bytes; with a
        # budget it allocates without spilling. Not 255: given that, ptxas for sm_80
        # takes up to 254 where about 170 suffice (see _MAX_REGISTERS).
        maxnreg=_MAX_REGISTERS[q.dtype == torch.float32],
        # Explicit, not Triton's default: Triton 3.9 warns when the option is left unset.
        enable_fp_fusion=True,
    )
    return o


def linear_attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    *,
    scale: float,
    states: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step for ``B`` requests, each continuing from its cache slot.

    Same contract as the torch oracle of the same name; ``state_indices`` (distinct, in
    ``[0, S)``) and ``decay >= 0`` are trusted, not read back; ``out`` must not be
    ``q``, ``k``, ``v`` or ``states``.
    """
    q, k, v, decay, scale, states = _check_common(q, k, v, decay, scale, states, lead="B")
    batch, heads, key_dim = q.shape
    si = check_slot_tensor(state_indices, batch=batch, device=q.device)
    check_has_slots("states", states, batch)
    o = alloc_out(out, q, v, lead="B")
    check_distinct_output("out", o, {"q": q, "k": k, "v": v, "states": states})
    value_dim = v.shape[2]
    if batch == 0 or heads == 0:
        return o
    block_k, block_v = _decode_blocks(key_dim, value_dim)
    grid = (batch, heads, triton.cdiv(value_dim, block_v))
    _linear_attention_decode_kernel[grid](
        q_ptr=q,
        k_ptr=k,
        v_ptr=v,
        decay_ptr=decay,
        o_ptr=o,
        states_ptr=states,
        state_indices_ptr=si,
        scale=scale,
        stride_qb=q.stride(0),
        stride_qh=q.stride(1),
        stride_qk=q.stride(2),
        stride_kb=k.stride(0),
        stride_kh=k.stride(1),
        stride_kk=k.stride(2),
        stride_vb=v.stride(0),
        stride_vh=v.stride(1),
        stride_vv=v.stride(2),
        stride_ob=o.stride(0),
        stride_oh=o.stride(1),
        stride_ov=o.stride(2),
        stride_ss=states.stride(0),
        stride_sh=states.stride(1),
        stride_sk=states.stride(2),
        stride_sv=states.stride(3),
        stride_decay=decay.stride(0),
        stride_si=si.stride(0),
        KEY_DIM=key_dim,
        VALUE_DIM=value_dim,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        EXACT_BF16=INTERPRETED and q.dtype == torch.bfloat16,
        num_warps=4,
        enable_fp_fusion=True,
    )
    return o
