"""Gated DeltaNet (gated delta rule) kernels with states in a cache: chunked prefill, decode.

The launchers and their design notes; the ``@triton.jit`` kernels they launch are in
:mod:`attnkit.kernels.gated_delta.triton_kernels`.

The definition, the chunked (WY / UT-transform) form and the cache conventions are those
of the torch oracle :mod:`attnkit.kernels.gated_delta.reference` (read its module doc first;
the math is from S. Yang, J. Kautz and A. Hatamizadeh, "Gated Delta Networks: Improving
Mamba2 with Delta Rule", ICLR 2025, arXiv:2412.06464, and S. Yang et al.,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length", NeurIPS
2024, arXiv:2406.06484). The launchers here have the same names and signatures; the
operand checks are the shared contract :mod:`attnkit.kernels.gated_delta.contract`.

Shapes: ``T`` tokens, ``B`` requests, ``H`` value heads, ``Hk`` query/key heads, ``K`` key
dim (``<= 256``), ``V`` value dim, ``S`` cache slots, ``C`` the chunk size (16, 32 or
64). ``q``/``k`` ``[*, Hk, K]``, ``v``/``out`` ``[*, H, V]``, ``g``/``beta`` ``[*, H]``
(float32, float16 or bfloat16, any strides; ``q`` and ``k`` already L2-normalised by the
model), ``states`` float32 ``[S, H, K, V]`` with any strides (a view into a larger page
is fine). The output has the dtype of ``v``. ``H`` is a multiple of ``Hk``: every grid
runs over the ``H`` value heads and value head ``h`` reads query/key head
``h // HEAD_GROUP`` (``HEAD_GROUP = H // Hk``, a constexpr) through its pointer, so no
expanded copy of ``q`` or ``k`` is made (Qwen3-Next: ``Hk = 16``, ``H = 32``).

Chunked prefill: three launches
-------------------------------
Chunks start at each request's first token. ``cu_chunks`` (int32 ``[B+1]``, the
cumulative chunk counts, computed on the device by
:func:`attnkit.kernels.mamba2.triton.ssd_chunk_offsets`) numbers the chunks of the whole
batch; a chunk program finds its request by binary search over it
(:func:`attnkit.kernels._triton.varlen.find_segment`). Grids are sized from shapes only:
a batch of ``T`` tokens in ``B`` requests has at most
``NC = min(T, (T + B (C - 1)) // C)`` chunks, and programs past the real count exit.
The launcher allocates the float32 / compute-dtype workspaces with ``torch.empty``
(no host read of a device value, so a launch can be captured in a CUDA graph).

1. ``_gdn_chunk_prep_kernel``, grid ``NC x H``, every chunk in parallel. With padding
   rows past the request's end reading ``g = beta = 0`` and zero vectors (they change
   nothing): ``G = cumsum(g)`` (stored), ``A = beta_i exp(G_i - G_j) (k_i . k_j)``
   strictly below the diagonal (``k k^T`` accumulated over ``K`` tiles of at most 64),
   ``Tm = (I + A)^-1`` by forward substitution in float32 (``C - 1`` dependent row
   updates of a ``[C, C]`` tile), then ``W = Tm diag(beta exp(G)) K`` (per ``K`` tile,
   stored in the compute dtype) and ``U = Tm diag(beta) V`` (per value tile, stored in
   float32: it is only ever subtracted from).
2. ``_gdn_state_pass_kernel``, grid ``B x H x cdiv(V, BLOCK_V)``, sequential over the
   request's chunks: ``D = U - W S``; the entering state ``S`` (compute dtype) and ``D``
   go to workspaces; ``S <- exp(G_last) S + (diag(exp(G_last - G)) K)^T D``. The
   program's float32 state slice ``[K, BLOCK_V]`` is held as up to four ``[64, BLOCK_V]``
   register tiles (one per ``K`` tile), with ``K * BLOCK_V <= 4096`` (``BLOCK_V`` 64, 32
   and 16 for ``K`` up to 64, 128 and 256) and no software pipelining (``num_stages=1``:
   each chunk waits for the previous state anyway), so nothing spills and the shared
   memory stays near 16 KB.
   The slot is read only when ``has_initial_state`` is set (a slot without one may hold
   NaN garbage: the load is masked off, never multiplied by zero); the final state goes
   back to the slot, and a zero-length request stores its initial state.
3. ``_gdn_chunk_output_kernel``, grid ``NC x H x cdiv(V, BLOCK_V)``, every chunk in
   parallel: ``O = scale (diag(exp(G)) Q S_entry + (Q K^T * M) D)`` with
   ``M_ij = exp(G_i - G_j) [j <= i]``, ``Q K^T`` and ``Q S_entry`` accumulated over
   ``K`` tiles.

Only the state pass is sequential, and it does two small dots per chunk; everything
with ``O(C^2)`` or ``O(C K V)`` work per chunk runs over all chunks of the batch at once.

Precision (tensor cores)
------------------------
When ``q``, ``k`` and ``v`` share a 16-bit dtype, every ``tl.dot`` takes operands
explicitly cast to that dtype (``k``, ``Tm``, ``beta exp(G) k``, ``beta v``, ``W``, the
state ``S``, ``D``, ``exp(G_last - G) k``, ``q``, the masked scores) and accumulates in
float32, so all three kernels run on tensor cores (HMMA / HGMMA). The state, the
decays, ``U``, ``D = U - W S`` and the forward substitution stay float32. Otherwise
(float32 or mixed input dtypes) the dots take float32 operands in IEEE mode (no TF32:
it would be visible at float32 tolerances, and the interpreter cannot test it).

Measured under the interpreter (which honours the casts; bfloat16 operands are rounded
to nearest-even by hand there, see ``triton_kernels._as_dot_operand``) against the float32
token-by-token definition of the same (16-bit) inputs, with q, k L2-normalised,
``beta = sigmoid(N(0, 1))``, ``g = logsigmoid(1.5 N(0, 1) + 2)``, ``v ~ N(0, 1)``, initial
states ``~ N(0, 1)``, ``H = 2``, ``K = V = 128``, requests of 256, 37 and 1 tokens (the
last two without an initial state, over NaN slots); max abs errors, outputs up to 0.23
in magnitude and states O(1):

==========  =====  =======  ============
dtype       C      output   final state
==========  =====  =======  ============
bfloat16    16     1.1e-3   2.3e-3
bfloat16    64     1.1e-3   2.5e-3
float16     16     8.3e-5   2.9e-4
float16     64     8.3e-5   2.7e-4
==========  =====  =======  ============

With ``K = V = 64``, ``C = 16`` and requests of 512 (32 chunks), 37, 200 and 1 tokens,
bfloat16 gives 1.1e-3 / 3.2e-3: no marked growth with the number of chunks (each step
of the state update is a contraction for ``beta`` in ``(0, 1)``, ``g <= 0``, unit ``k``).
These are within the project's tolerances (``attnkit.testing.tolerances``: bf16 2.5e-2,
fp16 4e-3), so 16-bit inputs always take the tensor-core path.

``fused_recurrent_gated_delta_rule_update`` (decode) is one step of the definition per
program, ``B x H x cdiv(V, BLOCK_V)``, with elementwise ops and row/column reductions (no
matrix products).

No launcher reads a device value back to the host: index tensors are checked for
dtype, shape and device only, and their values must satisfy the oracle's conventions
(offsets non-decreasing from 0 to at most ``T``; slots distinct and in ``[0, S)``).
"""

from __future__ import annotations

import torch
import triton

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
from attnkit.kernels._triton.varlen import flags_as_bytes, search_iters
from attnkit.kernels.gated_delta.contract import alloc_out, check_gdn_inputs, head_group
from attnkit.kernels.gated_delta.triton_kernels import (
    _gdn_chunk_output_kernel,
    _gdn_chunk_prep_kernel,
    _gdn_state_pass_kernel,
    _recurrent_update_kernel,
)
from attnkit.kernels.mamba2.triton import ssd_chunk_offsets

__all__ = ["chunk_gated_delta_rule_varlen", "fused_recurrent_gated_delta_rule_update"]

_TENSOR_CORE_DTYPES = (torch.float16, torch.bfloat16)
# tl.dot needs every extent >= 16, so the chunk is one of these; the torch oracle
# accepts any chunk size >= 1.
_SUPPORTED_CHUNK_SIZES = (16, 32, 64)
_MAX_KEY_DIM = 256
_MIN_DOT_DIM = 16
_MAX_BLOCK_K = 64  # K tile of every kernel: at most 4 tiles for K <= 256
_MAX_BLOCK_V = 64
_MAX_STATE_TILE = 4096  # float32 elements of a state-pass program's state slice


# ----------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------


def _check_triton_inputs(
    q: object,
    k: object,
    v: object,
    g: object,
    beta: object,
    scale: object,
    states: object,
    *,
    lead: str,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor
]:
    q, k, v, g, beta = check_gdn_inputs(q, k, v, g, beta, lead=lead)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_dtype(name, t)
    key_dim = k.shape[2]
    if not 1 <= key_dim <= _MAX_KEY_DIM:
        raise ValueError(f"k: expected key dim K in [1, {_MAX_KEY_DIM}], got {key_dim}")
    if v.shape[2] < 1:
        raise ValueError(f"v: expected value dim V >= 1, got {v.shape[2]}")
    return q, k, v, g, beta, check_finite_float("scale", scale), check_states(states, k, v)


def _blocks(key_dim: int, value_dim: int) -> tuple[int, int]:
    """``(KEY_PAD, BLOCK_V)`` of the decode kernel: powers of two, at least 16.

    The ``[KEY_PAD, BLOCK_V]`` float32 state slice is one register tile: at most 64
    columns and at most 8192 elements (32 KiB; 128 x 64, 256 x 32).
    """
    key_pad = max(_MIN_DOT_DIM, triton.next_power_of_2(key_dim))
    block_v = min(max(_MIN_DOT_DIM, triton.next_power_of_2(value_dim)), 64, 8192 // key_pad)
    return key_pad, block_v


def _dot_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The dtype of every ``tl.dot`` operand of the chunked kernels (see the module doc):
    the inputs' 16-bit dtype when ``q``, ``k`` and ``v`` share one, else float32."""
    if q.dtype == k.dtype == v.dtype and q.dtype in _TENSOR_CORE_DTYPES:
        return q.dtype
    return torch.float32


def chunk_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    query_start_loc: torch.Tensor,
    states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int = 64,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked gated delta rule over a varlen batch, reading/writing cached states.

    Same contract as the torch oracle of the same name, except that ``chunk_size`` must
    be 16, 32 or 64 and the index tensors' values are trusted (not read back). Returns
    ``out`` (allocated when None); rows past ``query_start_loc[-1]`` are left untouched.
    ``out`` must not be ``q``, ``k``, ``v`` or ``states`` (other programs still read the
    inputs). Three launches over device-side chunk bookkeeping (see the module doc).
    """
    q, k, v, g, beta, scale, states = _check_triton_inputs(
        q, k, v, g, beta, scale, states, lead="T"
    )
    chunk = check_chunk_size(chunk_size, allowed=_SUPPORTED_CHUNK_SIZES)
    qsl, slots, flags = check_varlen_tensors(
        query_start_loc, state_indices, has_initial_state, device=q.device
    )
    batch = qsl.numel() - 1
    check_has_slots("states", states, batch)
    out = alloc_out(out, v, "T")
    check_distinct_output("out", out, {"q": q, "k": k, "v": v, "states": states})
    if batch == 0:
        return out

    num_tokens, key_dim = k.shape[0], k.shape[2]
    heads, value_dim = v.shape[1], v.shape[2]
    dev = q.device
    # Every chunk holds at least one token and a request's chunks but its last are full.
    max_chunks = min(num_tokens, (num_tokens + batch * (chunk - 1)) // chunk)
    cu_chunks = ssd_chunk_offsets(qsl, num_tokens, chunk)
    iters = search_iters(batch)
    dot_dtype = _dot_dtype(q, k, v)
    # Under the interpreter bfloat16 dot operands live in float32 workspaces, rounded to
    # bfloat16 values by hand (see _as_dot_operand).
    emulate_bf16 = INTERPRETED and dot_dtype == torch.bfloat16
    ws_dtype = torch.float32 if emulate_bf16 else dot_dtype
    # Workspaces (at least one chunk each, so that every pointer is valid).
    n_ws = max(max_chunks, 1)
    cum = torch.empty(n_ws, heads, chunk, dtype=torch.float32, device=dev)
    w = torch.empty(n_ws, heads, chunk, key_dim, dtype=ws_dtype, device=dev)
    u = torch.empty(n_ws, heads, chunk, value_dim, dtype=torch.float32, device=dev)
    h = torch.empty(n_ws, heads, key_dim, value_dim, dtype=ws_dtype, device=dev)
    d = torch.empty(n_ws, heads, chunk, value_dim, dtype=ws_dtype, device=dev)

    key_pad = max(_MIN_DOT_DIM, triton.next_power_of_2(key_dim))
    block_k = min(key_pad, _MAX_BLOCK_K)
    value_pad = max(_MIN_DOT_DIM, triton.next_power_of_2(value_dim))
    block_v = min(value_pad, _MAX_BLOCK_V)
    block_v_state = min(block_v, _MAX_STATE_TILE // key_pad)
    tiles = dict(KEY_DIM=key_dim, VALUE_DIM=value_dim, CHUNK=chunk, BLOCK_K=block_k)
    tiles["NUM_K_TILES"] = key_pad // block_k
    # Grids run over the H value heads; each reads its key head by index (no copy).
    tiles["HEAD_GROUP"] = head_group(k, v)
    # fp32 operands would otherwise default to TF32 on NVIDIA (see the module doc);
    # 16-bit operands ignore it.
    precision = dict(DOT_PRECISION="ieee", ROUND_BF16=emulate_bf16)
    # Explicit, not Triton's default: Triton 3.9 warns when the option is left unset
    # (its default flips in 3.10), and the test suite turns warnings into errors.
    fusion = dict(enable_fp_fusion=True)
    cum_strides = dict(stride_cum_c=cum.stride(0), stride_cum_h=cum.stride(1))
    w_strides = dict(stride_w_c=w.stride(0), stride_w_h=w.stride(1), stride_w_r=w.stride(2))
    u_strides = dict(stride_u_c=u.stride(0), stride_u_h=u.stride(1), stride_u_r=u.stride(2))
    h_strides = dict(stride_h_c=h.stride(0), stride_h_h=h.stride(1), stride_h_k=h.stride(2))
    d_strides = dict(stride_d_c=d.stride(0), stride_d_h=d.stride(1), stride_d_r=d.stride(2))
    k_strides = dict(stride_kt=k.stride(0), stride_kh=k.stride(1), stride_kk=k.stride(2))

    if max_chunks > 0:
        _gdn_chunk_prep_kernel[(max_chunks, heads)](
            k_ptr=k,
            v_ptr=v,
            g_ptr=g,
            beta_ptr=beta,
            qsl_ptr=qsl,
            cu_ptr=cu_chunks,
            cum_ptr=cum,
            w_ptr=w,
            u_ptr=u,
            num_requests=batch,
            num_search_iters=iters,
            **k_strides,
            stride_vt=v.stride(0),
            stride_vh=v.stride(1),
            stride_vv=v.stride(2),
            stride_gt=g.stride(0),
            stride_gh=g.stride(1),
            stride_bt=beta.stride(0),
            stride_bh=beta.stride(1),
            stride_qsl=qsl.stride(0),
            **cum_strides,
            **w_strides,
            **u_strides,
            **tiles,
            BLOCK_V=block_v,
            **precision,
            # The [C, C] Tm and A tiles live through the forward substitution.
            num_warps=8 if chunk >= 64 else 4,
            num_stages=1,
            **fusion,
        )
    _gdn_state_pass_kernel[(batch, heads, triton.cdiv(value_dim, block_v_state))](
        k_ptr=k,
        states_ptr=states,
        qsl_ptr=qsl,
        cu_ptr=cu_chunks,
        state_indices_ptr=slots,
        has_initial_state_ptr=flags_as_bytes(flags),
        cum_ptr=cum,
        w_ptr=w,
        u_ptr=u,
        h_ptr=h,
        d_ptr=d,
        **k_strides,
        stride_ss=states.stride(0),
        stride_sh=states.stride(1),
        stride_sk=states.stride(2),
        stride_sv=states.stride(3),
        stride_qsl=qsl.stride(0),
        stride_si=slots.stride(0),
        stride_his=flags.stride(0),
        **cum_strides,
        **w_strides,
        **u_strides,
        **h_strides,
        **d_strides,
        **tiles,
        BLOCK_V=block_v_state,
        **precision,
        # 8 warps for a full state slice, except 256 x 16 (4 warps: with 8, ptxas spills
        # on sm_100).
        num_warps=8 if key_pad * block_v_state >= _MAX_STATE_TILE and block_v_state >= 32 else 4,
        # Each chunk depends on the previous one through the state: software pipelining
        # would only buy shared-memory buffers and registers.
        num_stages=1,
        **fusion,
    )
    if max_chunks > 0:
        _gdn_chunk_output_kernel[(max_chunks, heads, triton.cdiv(value_dim, block_v))](
            q_ptr=q,
            k_ptr=k,
            out_ptr=out,
            qsl_ptr=qsl,
            cu_ptr=cu_chunks,
            cum_ptr=cum,
            h_ptr=h,
            d_ptr=d,
            scale=scale,
            num_requests=batch,
            num_search_iters=iters,
            stride_qt=q.stride(0),
            stride_qh=q.stride(1),
            stride_qk=q.stride(2),
            **k_strides,
            stride_ot=out.stride(0),
            stride_oh=out.stride(1),
            stride_ov=out.stride(2),
            stride_qsl=qsl.stride(0),
            **cum_strides,
            **h_strides,
            **d_strides,
            **tiles,
            BLOCK_V=block_v,
            **precision,
            num_warps=4,
            **fusion,
        )
    return out


def fused_recurrent_gated_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    states: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step for ``B`` requests, each continuing from its cache slot.

    Same contract as the torch oracle of the same name, except that ``state_indices``'
    values are trusted (not read back). Returns ``out`` (allocated when None), which
    must not be ``q``, ``k``, ``v`` or ``states``.
    """
    q, k, v, g, beta, scale, states = _check_triton_inputs(
        q, k, v, g, beta, scale, states, lead="B"
    )
    batch = q.shape[0]
    slots = check_slot_tensor(state_indices, batch=batch, device=q.device)
    check_has_slots("states", states, batch)
    out = alloc_out(out, v, "B")
    check_distinct_output("out", out, {"q": q, "k": k, "v": v, "states": states})
    if batch == 0:
        return out

    key_dim, value_dim = k.shape[2], v.shape[2]
    key_pad, block_v = _blocks(key_dim, value_dim)
    grid = (batch, v.shape[1], triton.cdiv(value_dim, block_v))
    _recurrent_update_kernel[grid](
        q_ptr=q,
        k_ptr=k,
        v_ptr=v,
        g_ptr=g,
        beta_ptr=beta,
        out_ptr=out,
        states_ptr=states,
        state_indices_ptr=slots,
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
        stride_gb=g.stride(0),
        stride_gh=g.stride(1),
        stride_bb=beta.stride(0),
        stride_bh=beta.stride(1),
        stride_ob=out.stride(0),
        stride_oh=out.stride(1),
        stride_ov=out.stride(2),
        stride_ss=states.stride(0),
        stride_sh=states.stride(1),
        stride_sk=states.stride(2),
        stride_sv=states.stride(3),
        stride_si=slots.stride(0),
        KEY_DIM=key_dim,
        VALUE_DIM=value_dim,
        KEY_PAD=key_pad,
        BLOCK_V=block_v,
        HEAD_GROUP=head_group(k, v),
        num_warps=8 if key_pad * block_v >= 8192 else 4,
        enable_fp_fusion=True,
    )
    return out
