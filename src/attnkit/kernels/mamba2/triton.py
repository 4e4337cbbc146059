"""Mamba2 selective state-space (SSD) kernels with per-request cached states (Triton).

The launchers and their design notes; the ``@triton.jit`` kernels they launch are in
:mod:`attnkit.kernels.mamba2.triton_kernels`.

Same semantics, signatures and cache conventions as the torch oracle
:mod:`attnkit.kernels.mamba2.reference` (read its module docstring first), plus an optional
``out=`` tensor. The math is that of the state-space duality (SSD) of T. Dao and A. Gu,
"Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured
State Space Duality", ICML 2024 (arXiv:2405.21060), with a scalar decay per head::

    dt'[t, h]  = softplus(dt[t, h] + dt_bias[h])   (or without softplus / bias)
    state_t    = exp(dt'[t, h] A[h]) state_{t-1} + dt'[t, h] outer(x[t, h], B[t, g])
    y[t, h]    = state_t C[t, g] + D[h] x[t, h]

* ``x`` ``[T, H, P]`` (or ``[B, H, P]`` for decode): float32, float16 or bfloat16, any
  strides. ``dt``, ``A``, ``B``, ``C``, ``D``, ``dt_bias``: any of those dtypes, any
  strides, read as float32. All arithmetic is float32 (the matrix products of 16-bit
  inputs run on tensor cores with float32 accumulation: see "Precision" below); ``y``
  has the dtype of ``x``.
* ``ssm_states`` ``[S, H, P, N]`` float32, **any strides** (views into larger pages),
  updated in place.
* ``query_start_loc`` int32 ``[B+1]``, ``state_indices`` int32 ``[B]``,
  ``has_initial_state`` bool ``[B]``. The launchers check shapes, dtypes and devices but
  never read device values back to the host, so their *values* (offsets from 0 to ``T``,
  non-decreasing; distinct slots in ``[0, S)``) are the caller's responsibility.
  ``out`` must not overlap the inputs or ``ssm_states``.

Decomposition of :func:`ssd_chunked_varlen`
--------------------------------------------
Chunks of ``Q = chunk_size`` tokens are aligned to each request's first token, so
request ``b`` has ``cdiv(L_b, Q)`` chunks and the batch at most
``K = min(T, (T + B (Q - 1)) // Q)`` of them: every grid below is sized from shapes
only. The chunk offsets per request (``cu_chunks``, int32 ``[B+1]``) are computed on the
device with torch ops (no synchronisation); a chunk program finds its request by binary
search over them, and programs past the batch's real chunk count exit at once.

1. ``_ssd_chunk_cumsum_kernel`` (grid ``K x H-tiles``): ``dt'`` and the inclusive
   cumulative log-decay ``cum[t] = sum_{s = chunk start}^{t} dt'[s] A`` within each chunk,
   both ``[T, H]`` float32, indexed by token (chunks partition the tokens).
2. ``_ssd_chunk_state_kernel`` (grid ``K x H x (P, N)-tiles``): the state each chunk
   would leave from a zero start, ``sum_j exp(cum[last] - cum[j]) dt'[j] x[j] B[j]^T``,
   into a ``[K, H, P, N]`` float32 workspace: one ``(weighted x)^T B`` product per tile
   of ``BLOCK_T`` tokens.
3. ``_ssd_state_passing_kernel`` (grid ``B x H x (P, N)-tiles``): the only sequential
   part, one short loop over a request's chunks: starting from the cached state (or
   zeros), it replaces each chunk's entry of the workspace by the state *entering* that
   chunk and carries ``s <- exp(cum[last]) s + chunk_state``; the final state goes back
   to the request's slot.
4. ``_ssd_chunk_output_kernel`` (grid ``K * cdiv(Q, BLOCK_T) x H x P-tiles``): per tile of
   output rows ``i``, the inter-chunk term ``exp(cum[i]) C[i] . s_entry`` plus the
   intra-chunk quadratic form ``sum_{j <= i} (C[i] . B[j]) exp(cum[i] - cum[j]) dt'[j]
   x[j]`` (the segment-sum decay mask of the paper), plus ``D x``. Both ``C[i] . s_entry``
   and the scores ``C[i] . B[j]`` are accumulated over tiles of ``BLOCK_N`` state
   columns, so no ``[BLOCK_T, N]`` tile is ever held whole: register use does not grow
   with ``N``.

Precision (tensor cores)
------------------------
The launcher picks a ``DOT_MODE`` per call from the dtypes (``_dot_mode``): when ``x``,
``B`` and ``C`` share a 16-bit dtype (fp16 ``1`` or bf16 ``2``) every ``tl.dot`` of the
chunk-state and chunk-output kernels runs on tensor cores (HMMA / HGMMA) with float32
accumulation; otherwise (float32 or mixed inputs, mode ``0``) the dots take float32
operands with IEEE precision (no TF32, which the interpreter cannot test). The decays,
``dt'``, the states and all elementwise work stay float32 in every mode.

In 16-bit mode one operand of each product is raw input, exact in its dtype (``x``,
``B``, ``C``); the other is computed in float32 (the decay-weighted ``x`` of the chunk
state, the entering state ``s_entry``, the decayed scores ``(C . B) exp(..) dt'``).
Rounding that one to 16 bits would cost a relative ``2**-9`` (bf16) / ``2**-12`` (fp16)
per term, and the output sums many terms that can cancel: measured below it needed a
tolerance of up to 3e-1 (bf16) / 4e-2 (fp16) on ``y``. So the derived operand ``v`` is
split as ``hi = rnd(v)``, ``lo = rnd(v - hi)`` (``v - hi`` is exact in float32) and both
halves are multiplied on the tensor cores: ``hi + lo`` carries about 16 (bf16) / 22
(fp16) significant bits, and the product with an exact 16-bit operand is then nearly as
accurate as the float32 dot, for twice the (cheap) tensor-core work of those products;
``C . B`` needs no split. In fp16 a derived tile can exceed the fp16 range (a large
cached state, large scores); such a tile is first scaled by a factor ``s <= 1`` (its
peak brought to ``2**14``) and the accumulator is kept in units of the latest ``s``
(rescaled when ``s`` changes, like the running maximum of online softmax); tiles in
range are not scaled. bf16 has float32's range.

Measured under the interpreter (which honours the casts; bfloat16 products are
emulated exactly, see ``round_bf16``) against the float32 oracle on the same
rounded inputs, ``x``, ``B``, ``C`` ~ N(0, 1) (and a 3x / 30x-state case),
``dt' = softplus(N(0, 1) - 1.5 + bias)``, ``A`` in ``[-4.5, -0.5]``, ``P = 64``,
``N = 64 / 128``, chunks 64 / 128, cached initial states: the tolerance ``t`` (as
``atol = rtol = t``) the outputs need is 4.8e-4 (fp16) and 3.8e-3 (bf16), one rounding
of the output, as with float32 dots (single-rounded operands: 3.9e-2 / 3.4e-1); the
float32 states need 1.4e-5 (float32 dots: 2e-6). The project's tolerances
(``attnkit.testing.tolerances``) are 4e-3 (fp16) and 2.5e-2 (bf16).

Tiles (``_STATE_TILES``, ``_OUTPUT_TILES``; caps, shrunk to small problems) were chosen
from the compile report so that nothing spills on sm_80 / sm_90 / sm_100 whatever
``P`` and ``N`` (they only change grid and loop counts): in 16-bit modes the chunk
state uses ``BLOCK_T = BLOCK_P = BLOCK_N = 64`` and the chunk output ``BLOCK_T = 64``,
``BLOCK_P`` up to 128 (a head dim of 128 in one program, which computes its row tile's
scores once), ``BLOCK_N = 32``; float32 mode uses ``BLOCK_T = BLOCK_N = 32``,
``BLOCK_P = 64``. All with 8 warps (4 for the float32 chunk state) and 2 pipeline
stages. Checked for ``P`` 64 / 128, ``N`` 64 / 128 / 256, chunks 128 / 256.

Trade-offs: the decays use differences of float32 cumulative sums within one chunk
(the oracle sums each segment directly); the difference is far below the test
tolerances for chunk sizes used in practice. The workspace holds ``K`` float32 states
of ``H x P x N``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from torch import Tensor

from attnkit.kernels._checks import (
    alloc_out,
    check_bool,
    check_chunk_size,
    check_distinct_output,
    check_dtype,
    check_has_slots,
    check_int_arg,
    check_slot_tensor,
    check_varlen_tensors,
    describe,
    require_tensor,
)
from attnkit.kernels._triton.interpret import INTERPRETED
from attnkit.kernels._triton.varlen import search_iters
from attnkit.kernels.mamba2.contract import check_ssm_inputs, check_ssm_states
from attnkit.kernels.mamba2.triton_kernels import (
    _selective_state_update_kernel,
    _ssd_chunk_cumsum_kernel,
    _ssd_chunk_output_kernel,
    _ssd_chunk_state_kernel,
    _ssd_state_passing_kernel,
)

__all__ = ["selective_state_update", "ssd_chunk_offsets", "ssd_chunked_varlen"]

_MAX_BLOCK_P = 64  # the decode kernel's head-dim tile ...
_MAX_UPDATE_TILE = 8192  # ... and its cap on BLOCK_P x N (float32 state elements)
_MIN_DOT = 16  # the smallest tl.dot extent on every target
_MAX_CUMSUM_TILE = 4096  # elements of the [chunk, heads] tile of the cumsum kernel


# ----------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------


def _check_dtypes(**tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        check_dtype(name, t)


def _stride(t: Tensor | None, dim: int = 0) -> int:
    return t.stride(dim) if t is not None else 0


def _dot_block(extent: int, cap: int) -> int:
    """Power-of-two tile for a ``tl.dot`` extent: at least 16, at most ``cap``."""
    return max(_MIN_DOT, min(cap, int(triton.next_power_of_2(max(extent, 1)))))


_DOT_FP32 = 0
_DOT_FP16 = 1
_DOT_BF16 = 2
_DOT_MODES = {torch.float16: _DOT_FP16, torch.bfloat16: _DOT_BF16}


def _dot_mode(x: Tensor, B: Tensor, C: Tensor) -> int:
    """The ``DOT_MODE`` of the chunk kernels: 16-bit operands (tensor cores) when ``x``,
    ``B`` and ``C`` share a 16-bit dtype, else IEEE float32 dots."""
    if x.dtype == B.dtype == C.dtype:
        return _DOT_MODES.get(x.dtype, _DOT_FP32)
    return _DOT_FP32


class _Tiles(NamedTuple):
    """Tile sizes (caps, before fitting to the problem) and warps of one chunk kernel."""

    block_t: int
    block_p: int
    block_n: int
    num_warps: int
    num_stages: int


# Tile caps per dot mode, (BLOCK_T, BLOCK_P, BLOCK_N, warps, stages); chosen from the
# compile report so that no variant spills on sm_80 / sm_90 / sm_100 (module doc).
_STATE_TILES = {
    _DOT_FP32: _Tiles(32, 64, 32, 4, 2),
    _DOT_FP16: _Tiles(64, 64, 64, 8, 2),
    _DOT_BF16: _Tiles(64, 64, 64, 8, 2),
}
_OUTPUT_TILES = {
    _DOT_FP32: _Tiles(32, 64, 32, 8, 2),
    _DOT_FP16: _Tiles(64, 128, 32, 8, 2),
    _DOT_BF16: _Tiles(64, 128, 32, 8, 2),
}


def _fit(tiles: _Tiles, q: int, head_dim: int, state_size: int) -> _Tiles:
    """``tiles`` shrunk to the problem (powers of two, at least the smallest dot)."""
    return _Tiles(
        _dot_block(q, tiles.block_t),
        _dot_block(head_dim, tiles.block_p),
        _dot_block(state_size, tiles.block_n),
        tiles.num_warps,
        tiles.num_stages,
    )


def _effective_chunk(chunk_size: int, num_tokens: int) -> int:
    # A chunk longer than the whole batch is one chunk per request either way.
    return min(chunk_size, max(num_tokens, 1))


def _check_cu_chunks(cu_chunks: object, batch: int, device: torch.device) -> Tensor:
    """int32 ``[B+1]`` on ``device`` with unit stride (the kernels index it directly)."""
    cu_chunks = require_tensor(
        "cu_chunks", cu_chunks, f"an int32 torch.Tensor [B+1]=[{batch + 1}] or None"
    )
    if (
        cu_chunks.dtype != torch.int32
        or tuple(cu_chunks.shape) != (batch + 1,)
        or cu_chunks.device != device
    ):
        raise ValueError(
            f"cu_chunks: expected int32 [B+1]=[{batch + 1}] on {device}, got "
            f"{cu_chunks.dtype} {list(cu_chunks.shape)} on {cu_chunks.device}"
        )
    if batch > 0 and cu_chunks.stride(0) != 1:
        raise ValueError(
            f"cu_chunks: expected unit stride, got stride {cu_chunks.stride(0)} "
            f"({describe(cu_chunks)})"
        )
    return cu_chunks


def ssd_chunk_offsets(query_start_loc: Tensor, num_tokens: int, chunk_size: int) -> Tensor:
    """int32 ``[B+1]`` cumulative chunk counts of a varlen batch (chunks start at each
    request's first token): the chunk bookkeeping ``ssd_chunked_varlen`` takes.

    Device ops only (no host read); compute it once per step and pass it to every layer.
    ``query_start_loc`` is int32 ``[B+1]`` (``B >= 0``), ``num_tokens`` the batch's
    ``T >= 0`` and ``chunk_size >= 1``; only their metadata is checked.
    """
    query_start_loc = require_tensor(
        "query_start_loc", query_start_loc, "an int32 torch.Tensor [B+1]"
    )
    if query_start_loc.dtype != torch.int32 or query_start_loc.dim() != 1:
        raise ValueError(
            f"query_start_loc: expected an int32 tensor [B+1], got {describe(query_start_loc)}"
        )
    if query_start_loc.shape[0] < 1:
        raise ValueError(
            f"query_start_loc: expected shape [B+1] with B >= 0, got {describe(query_start_loc)}"
        )
    num_tokens = check_int_arg("num_tokens", num_tokens, 0)
    chunk_size = check_chunk_size(chunk_size)
    q = _effective_chunk(chunk_size, num_tokens)
    lengths = query_start_loc[1:] - query_start_loc[:-1]
    offsets = torch.zeros(
        query_start_loc.shape[0], dtype=torch.int32, device=query_start_loc.device
    )
    torch.cumsum(
        torch.div(lengths + (q - 1), q, rounding_mode="floor"),
        0,
        dtype=torch.int32,
        out=offsets[1:],
    )
    return offsets


def ssd_chunked_varlen(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    query_start_loc: Tensor,
    ssm_states: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    chunk_size: int,
    out: Tensor | None = None,
    cu_chunks: Tensor | None = None,
) -> Tensor:
    """Chunked SSD over a varlen batch, reading/writing per-request states in the cache.

    Semantics of :func:`attnkit.kernels.mamba2.reference.ssd_chunked_varlen`; ``out``
    (``[T, H, P]``, dtype of ``x``, any strides) receives the result when given.
    ``cu_chunks``: the batch's chunk bookkeeping from :func:`ssd_chunk_offsets` for the
    same ``query_start_loc``, ``T`` and ``chunk_size``, planned once per step and shared
    by every layer; computed here when ``None`` (given, it is int32 ``[B+1]`` with unit
    stride on the device of ``x``). ``out`` must not be ``x``, ``B``, ``C``, ``dt`` or
    ``ssm_states``. Returns ``y`` ``[T, H, P]`` in the dtype of ``x``.
    """
    dt, A, B, C, D, dt_bias = check_ssm_inputs(x, dt, A, B, C, D, dt_bias, lead="T")
    _check_dtypes(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias)
    ssm_states = check_ssm_states(ssm_states, x, B.shape[-1])
    chunk_size = check_chunk_size(chunk_size)
    dt_softplus = check_bool("dt_softplus", dt_softplus)
    num_tokens, heads, head_dim = x.shape
    qsl, slots, flags = check_varlen_tensors(
        query_start_loc, state_indices, has_initial_state, device=x.device, num_tokens=num_tokens
    )
    batch = qsl.shape[0] - 1
    check_has_slots("ssm_states", ssm_states, batch)
    result = alloc_out(out, x, "[T, H, P]")
    check_distinct_output(
        "out", result, {"x": x, "B": B, "C": C, "dt": dt, "ssm_states": ssm_states}
    )
    if cu_chunks is not None:
        cu_chunks = _check_cu_chunks(cu_chunks, batch, x.device)
    groups, state_size = B.shape[1], B.shape[2]
    if batch == 0 or heads == 0 or head_dim == 0 or state_size == 0:
        # Nothing to compute (a zero-size state has nothing to carry); y is all D x.
        if num_tokens > 0:
            y = x.float() * (D.float()[:, None] if D is not None else 0.0)
            result.copy_(y.to(x.dtype))
        return result

    q = _effective_chunk(chunk_size, num_tokens)
    max_chunks = min(num_tokens, (num_tokens + batch * (q - 1)) // q)
    dev = x.device
    if cu_chunks is None:
        cu_chunks = ssd_chunk_offsets(qsl, num_tokens, chunk_size)
    # Workspaces: dt' and the within-chunk cumulative log-decay per token, and one state
    # per chunk (at least one row each so that every pointer is valid).
    dtp = torch.empty(max(num_tokens, 1), heads, dtype=torch.float32, device=dev)
    cum = torch.empty_like(dtp)
    work = torch.empty(
        max(max_chunks, 1), heads, head_dim, state_size, dtype=torch.float32, device=dev
    )
    iters = search_iters(batch)
    heads_per_group = heads // groups

    dot_mode = _dot_mode(x, B, C)
    emulate_bf16 = INTERPRETED and dot_mode == _DOT_BF16
    st = _fit(_STATE_TILES[dot_mode], q, head_dim, state_size)
    ot = _fit(_OUTPUT_TILES[dot_mode], q, head_dim, state_size)
    pn_tiles = triton.cdiv(head_dim, st.block_p) * triton.cdiv(state_size, st.block_n)
    common = dict(num_requests=batch, num_search_iters=iters, chunk_size=q)

    if max_chunks > 0:
        chunk_pad = triton.next_power_of_2(q)
        block_h = max(1, min(triton.next_power_of_2(heads), _MAX_CUMSUM_TILE // chunk_pad))
        _ssd_chunk_cumsum_kernel[(max_chunks, triton.cdiv(heads, block_h))](
            dt,
            dt_bias,
            A,
            qsl,
            cu_chunks,
            dtp,
            cum,
            num_heads=heads,
            stride_dt_t=dt.stride(0),
            stride_dt_h=dt.stride(1),
            stride_dt_bias=_stride(dt_bias),
            stride_A=A.stride(0),
            stride_qsl=qsl.stride(0),
            HAS_DT_BIAS=dt_bias is not None,
            DT_SOFTPLUS=bool(dt_softplus),
            CHUNK_PAD=chunk_pad,
            BLOCK_H=block_h,
            enable_fp_fusion=True,
            **common,
        )
        _ssd_chunk_state_kernel[(max_chunks, heads, pn_tiles)](
            x,
            B,
            dtp,
            cum,
            qsl,
            cu_chunks,
            work,
            head_dim=head_dim,
            state_size=state_size,
            num_heads=heads,
            heads_per_group=heads_per_group,
            stride_xt=x.stride(0),
            stride_xh=x.stride(1),
            stride_xp=x.stride(2),
            stride_Bt=B.stride(0),
            stride_Bg=B.stride(1),
            stride_Bn=B.stride(2),
            stride_qsl=qsl.stride(0),
            stride_wk=work.stride(0),
            stride_wh=work.stride(1),
            stride_wp=work.stride(2),
            stride_wn=work.stride(3),
            DOT_MODE=dot_mode,
            EMULATE_BF16=emulate_bf16,
            BLOCK_T=st.block_t,
            BLOCK_P=st.block_p,
            BLOCK_N=st.block_n,
            num_warps=st.num_warps,
            num_stages=st.num_stages,
            enable_fp_fusion=True,
            **common,
        )
    _ssd_state_passing_kernel[(batch, heads, pn_tiles)](
        ssm_states,
        work,
        cum,
        qsl,
        cu_chunks,
        slots,
        flags,
        head_dim=head_dim,
        state_size=state_size,
        num_heads=heads,
        chunk_size=q,
        stride_ss=ssm_states.stride(0),
        stride_sh=ssm_states.stride(1),
        stride_sp=ssm_states.stride(2),
        stride_sn=ssm_states.stride(3),
        stride_wk=work.stride(0),
        stride_wh=work.stride(1),
        stride_wp=work.stride(2),
        stride_wn=work.stride(3),
        stride_qsl=qsl.stride(0),
        stride_slot=slots.stride(0),
        stride_init=flags.stride(0),
        BLOCK_P=st.block_p,
        BLOCK_N=st.block_n,
        enable_fp_fusion=True,
    )
    if max_chunks > 0:
        tiles_per_chunk = triton.cdiv(q, ot.block_t)
        _ssd_chunk_output_kernel[
            (max_chunks * tiles_per_chunk, heads, triton.cdiv(head_dim, ot.block_p))
        ](
            x,
            B,
            C,
            D,
            dtp,
            cum,
            work,
            qsl,
            cu_chunks,
            result,
            head_dim=head_dim,
            state_size=state_size,
            num_heads=heads,
            heads_per_group=heads_per_group,
            tiles_per_chunk=tiles_per_chunk,
            stride_xt=x.stride(0),
            stride_xh=x.stride(1),
            stride_xp=x.stride(2),
            stride_Bt=B.stride(0),
            stride_Bg=B.stride(1),
            stride_Bn=B.stride(2),
            stride_Ct=C.stride(0),
            stride_Cg=C.stride(1),
            stride_Cn=C.stride(2),
            stride_D=_stride(D),
            stride_wk=work.stride(0),
            stride_wh=work.stride(1),
            stride_wp=work.stride(2),
            stride_wn=work.stride(3),
            stride_qsl=qsl.stride(0),
            stride_ot=result.stride(0),
            stride_oh=result.stride(1),
            stride_op=result.stride(2),
            HAS_D=D is not None,
            DOT_MODE=dot_mode,
            EMULATE_BF16=emulate_bf16,
            BLOCK_T=ot.block_t,
            BLOCK_P=ot.block_p,
            BLOCK_N=ot.block_n,
            num_warps=ot.num_warps,
            num_stages=ot.num_stages,
            enable_fp_fusion=True,
            **common,
        )
    return result


def selective_state_update(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    ssm_states: Tensor,
    state_indices: Tensor,
    out: Tensor | None = None,
) -> Tensor:
    """One decode step for ``B`` requests, each continuing from its cache slot.

    Semantics of :func:`attnkit.kernels.mamba2.reference.selective_state_update`; ``out``
    (``[B, H, P]``, dtype of ``x``, any strides) receives the result when given.
    Returns ``y`` ``[B, H, P]`` in the dtype of ``x``.

    Grid ``(B, H, cdiv(P, BLOCK_P))``: each program owns a ``[BLOCK_P, N]`` tile of one
    request's state for one head, updates it in place and reads ``y`` out of it.
    """
    dt, A, B, C, D, dt_bias = check_ssm_inputs(x, dt, A, B, C, D, dt_bias, lead="B")
    _check_dtypes(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias)
    ssm_states = check_ssm_states(ssm_states, x, B.shape[-1])
    dt_softplus = check_bool("dt_softplus", dt_softplus)
    batch, heads, head_dim = x.shape
    slots = check_slot_tensor(state_indices, batch=batch, device=x.device)
    check_has_slots("ssm_states", ssm_states, batch)
    result = alloc_out(out, x, "[B, H, P]")
    if batch == 0 or heads == 0 or head_dim == 0:
        return result
    groups, state_size = B.shape[1], B.shape[2]
    n_pad = triton.next_power_of_2(max(state_size, 1))
    # The [BLOCK_P, N] float32 state tile lives in registers: at most 8192 elements
    # (64 x 128) per program keeps it spill-free for any N (d_state 256 -> BLOCK_P 32).
    block_p = max(1, min(_MAX_BLOCK_P, triton.next_power_of_2(head_dim), _MAX_UPDATE_TILE // n_pad))
    _selective_state_update_kernel[(batch, heads, triton.cdiv(head_dim, block_p))](
        x,
        dt,
        dt_bias,
        A,
        B,
        C,
        D,
        ssm_states,
        slots,
        result,
        head_dim=head_dim,
        state_size=state_size,
        heads_per_group=heads // groups,
        stride_xb=x.stride(0),
        stride_xh=x.stride(1),
        stride_xp=x.stride(2),
        stride_dt_b=dt.stride(0),
        stride_dt_h=dt.stride(1),
        stride_dt_bias=_stride(dt_bias),
        stride_A=A.stride(0),
        stride_Bb=B.stride(0),
        stride_Bg=B.stride(1),
        stride_Bn=B.stride(2),
        stride_Cb=C.stride(0),
        stride_Cg=C.stride(1),
        stride_Cn=C.stride(2),
        stride_D=_stride(D),
        stride_ss=ssm_states.stride(0),
        stride_sh=ssm_states.stride(1),
        stride_sp=ssm_states.stride(2),
        stride_sn=ssm_states.stride(3),
        stride_slot=slots.stride(0),
        stride_ob=result.stride(0),
        stride_oh=result.stride(1),
        stride_op=result.stride(2),
        HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=bool(dt_softplus),
        HAS_D=D is not None,
        BLOCK_P=block_p,
        N_PAD=n_pad,
        enable_fp_fusion=True,
    )
    return result
