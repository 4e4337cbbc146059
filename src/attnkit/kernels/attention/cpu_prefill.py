"""CPU prefill engine: paged attention for runs of query tokens as blocked matrix products.

:func:`paged_prefill` checks its arguments here, then runs the native blocked kernel
(``paged_prefill.c``, the default ``engine="native"``): tasks of (request, K/V head,
about 256 rows of query tokens x grouped heads), each packing its keys once per chunk of
256 (K transposed, V row-major, from the planes through the block table or from the
step's own key / value rows) and walking them in tiles of 32 with an online softmax, in
register-blocked micro-kernels of the instruction set the CPU reports (AVX512-BF16:
bf16 scores as native bf16 dot products; AVX-512; AVX2; the compiler's baseline).

``engine="torch"`` keeps the first implementation, described below, as a second one to
compare with. One request at a time, the keys and values its queries can see are taken once: straight
from the step's own ``key`` / ``value`` rows for a fresh prompt (``seq == qlen``; strided
views, no copy in float32), else gathered from the paged K/V planes with one
``index_select`` over the slots the block table gives for the positions some query of the
request can see. The queries are then walked in blocks of ``query_block`` tokens. For each
block, its queries are rearranged into ``[Hkv, Bq * G, D]`` (row ``t * G + g`` is token
``t`` of query head ``kvh * G + g``: grouped-query heads share one product with their
K/V head, no K/V copy per query head) and multiplied with only the keys the block can see:
from the first query's lower bound (window or chunk start; 0 otherwise) up to the last
query's own position (everything for bidirectional attention). Scores are soft-capped,
given the ALiBi bias and masked (only the columns where some row of the block is masked:
the diagonal and the window / chunk edge), then a softmax in place and a product with the
values gives the block's output rows.

A block that sees more than ``key_chunk`` keys (a prompt chunk over a long context) walks
its keys in chunks of at most ``key_chunk`` with an online softmax (running maximum and
sum, accumulator rescaled when the maximum grows), so the score buffer stays bounded.

Numerics: scores, softmax and accumulation are float32 whatever the input dtype; the
output is rounded to the query dtype once. bfloat16 / float16 K/V are converted to float32
once per request: on this project's CPUs (AVX2, no AVX-512 / AMX) a 16-bit ``torch.bmm``
of ``[8, 256, 128] x [8, 128, 512]`` took ~200 ms against ~3 ms in float32 (1 thread,
torch 2.13, MKL), so products in the half dtype are never faster here.

The scale is folded into the query rows (``scale / soft_cap`` with a soft-cap, so the
cap is one ``tanh`` and one multiply). The ALiBi bias ``slope * (p - qp)`` is applied as
``slope * (p - qp_first)`` with ``qp_first`` the block's first query position: the two
differ by a per-row constant, which softmax ignores, and the bias stays small near the
diagonal where the weight is. With a sink logit or the log-sum-exp asked for, the row
constant matters, and each row gets its own ``slope * (p - qp)``.

Sinks (one logit per head in every denominator, no value) and the log-sum-exp take the
online softmax's running maximum and sum, folded in once after the last key.

Buffers (query block, scores, output block) are allocated once per call and reused for
every block: a fresh 4 MiB score tensor per block costs more than the softmax over it
(page faults), measured 3.5 ms against 1.1 ms for the softmax of ``[8, 256, 512]``.

Threads: torch's own (``torch.get_num_threads()``); the caller sets them.
"""

from __future__ import annotations

from typing import Literal, cast

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from attnkit.kernels._checks import (
    KernelTypeError,
    check_bool,
    check_distinct_output,
    check_finite_float,
    check_int_arg,
    check_last_dim_contiguous,
    describe,
    require_tensor,
)
from attnkit.kernels.attention.cpu_kv_format import KVFormat, dequantise_rows, kv_format

__all__ = ["KEY_CHUNK", "QUERY_ROWS", "paged_prefill"]

#: Rows (query tokens x grouped query heads) one score product aims at: the default
#: block is ``clamp(QUERY_ROWS // G, 32, 64)`` tokens. Measured on 4 x 512 fresh causal
#: prompts, Hq 32, D 128, float32, 1 thread, median of 5 (ratio to SDPA causal):
#: Hkv 8 (G 4): 1.68x at 32 tokens, 1.65x at 48, 1.62x at 64; Hkv 4 (G 8): 1.71x at 16,
#: 1.74x at 32, 1.63x at 64; Hkv 32 (G 1): 1.30x at 32, 1.35x at 64, 1.29x at 128.
QUERY_ROWS = 128
#: Most keys one score product covers; longer key ranges use the online softmax.
KEY_CHUNK = 2048

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NEG_INF = float("-inf")


# --------------------------------------------------------------------------- checks


def _check_cpu_tensor(
    name: str, value: object, ndim: int, expected: str, dtype: torch.dtype | None = None
) -> Tensor:
    t = require_tensor(name, value, expected)
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {expected}, got {describe(t)}")
    if t.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor, got {describe(t)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {describe(t)}")
    return t


def _check_index_array(name: str, value: object, n: int | None) -> list[int]:
    if not isinstance(value, np.ndarray):
        raise KernelTypeError(f"{name}: expected a 1-D int64 numpy array, got {describe(value)}")
    arr = cast("npt.NDArray[np.generic]", value)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{name}: expected a 1-D int64 numpy array, got a {arr.ndim}-D {arr.dtype} array "
            f"of shape {list(arr.shape)}"
        )
    if n is not None and arr.shape[0] != n:
        raise ValueError(
            f"{name}: expected {n} entries (one per request, as requests), got {arr.shape[0]}"
        )
    return [int(x) for x in arr.tolist()]


def _optional_positive_int(name: str, value: object) -> int | None:
    if value is None:
        return None
    return check_int_arg(name, value, 1)


# --------------------------------------------------------------------------- engine


class _Buffers:
    """float32 work buffers reused by every query block of one call."""

    def __init__(self, hkv: int, rows: int, d: int, keys: int, online: bool) -> None:
        self.q = torch.empty(hkv * rows * d, dtype=torch.float32)
        self.s = torch.empty(hkv * rows * max(keys, 1), dtype=torch.float32)
        self.o = torch.empty(hkv * rows * d, dtype=torch.float32)
        n = hkv * rows if online else 0
        self.m = torch.empty(n, dtype=torch.float32)
        self.m_new = torch.empty(n, dtype=torch.float32)
        self.l = torch.empty(n, dtype=torch.float32)
        self.row_sum = torch.empty(n, dtype=torch.float32)


def _mask_columns(
    s4: Tensor,
    col_lo: int,
    a: int,
    b: int,
    qf: int,
    nb: int,
    window: int | None,
    chunk: int | None,
) -> None:
    """Set to -inf the scores of key positions ``[a, b)`` a causal row cannot see.

    ``s4`` is ``[Hkv, nb, G, n]`` whose column 0 is key position ``col_lo``; the block's
    query positions are ``qf .. qf + nb - 1``.
    """
    if a >= b:
        return
    p = torch.arange(a, b).view(1, b - a)
    qp = torch.arange(qf, qf + nb).view(nb, 1)
    hidden = p > qp
    if window is not None:
        hidden |= (qp - p) >= window
    if chunk is not None:
        hidden |= torch.div(p, chunk, rounding_mode="floor") != torch.div(
            qp, chunk, rounding_mode="floor"
        )
    s4[..., a - col_lo : b - col_lo].masked_fill_(hidden.view(1, nb, 1, b - a), _NEG_INF)


def _scores(
    buf: _Buffers,
    q2: Tensor,
    k: Tensor,
    k_base: int,
    c_lo: int,
    c_hi: int,
    qf: int,
    nb: int,
    g: int,
    causal: bool,
    window: int | None,
    chunk: int | None,
    soft_cap: float | None,
    slopes: Tensor | None,
    exact: bool,
) -> Tensor:
    """Scores ``[Hkv, nb * G, c_hi - c_lo]`` of the block's rows against keys ``[c_lo, c_hi)``
    (the ALiBi bias relative to the block's first query unless ``exact``)."""
    hkv, rows, _ = q2.shape
    n = c_hi - c_lo
    s = buf.s[: hkv * rows * n].view(hkv, rows, n)
    torch.bmm(q2, k[:, c_lo - k_base : c_hi - k_base].transpose(1, 2), out=s)
    if soft_cap is not None:
        s.tanh_().mul_(soft_cap)
    s4 = s.view(hkv, nb, g, n)
    if slopes is not None:
        rel = torch.arange(c_lo - qf, c_hi - qf, dtype=torch.float32)
        bias = slopes.view(hkv, 1, g, 1) * rel.view(1, 1, 1, n)
        if exact:  # each row's own position (a sink or the lse sees the row constant)
            bias = bias - slopes.view(hkv, 1, g, 1) * torch.arange(nb).view(1, nb, 1, 1)
        s4.add_(bias)
    if causal:
        ql = qf + nb - 1
        # Diagonal: a key after the block's first query is hidden from some row.
        _mask_columns(s4, c_lo, max(c_lo, qf + 1), c_hi, qf, nb, window, chunk)
        # Edge: keys some later row has left behind (window end, or an earlier chunk).
        edge = c_lo
        if window is not None:
            edge = ql - window + 1
        elif chunk is not None:
            edge = (ql // chunk) * chunk
        _mask_columns(s4, c_lo, c_lo, min(c_hi, edge, qf + 1), qf, nb, window, chunk)
    return s


def _attend_request(
    buf: _Buffers,
    q_rows: Tensor,
    out_rows: Tensor,
    k: Tensor,
    v: Tensor,
    k_base: int,
    qp0: int,
    seq: int,
    *,
    g: int,
    causal: bool,
    window: int | None,
    chunk: int | None,
    q_scale: float,
    soft_cap: float | None,
    slopes: Tensor | None,
    query_block: int,
    key_chunk: int,
    sinks: Tensor | None = None,
    lse_rows: Tensor | None = None,
) -> None:
    """One request: ``q_rows`` ``[L, Hq, D]`` against ``k`` / ``v`` ``[Hkv, n, D]`` (float32),
    whose column 0 is key position ``k_base``; writes ``out_rows`` ``[L, Hq, D]`` (and
    ``lse_rows`` ``[L, Hq]`` when given). ``sinks``: float32 ``[Hq]`` logits that join
    every denominator."""
    length, _, d = q_rows.shape
    hkv = k.shape[0]
    # The plain softmax unless a sink or the lse needs the running max and sum.
    plain = sinks is None and lse_rows is None
    for t0 in range(0, length, query_block):
        t1 = min(length, t0 + query_block)
        nb = t1 - t0
        rows = nb * g
        qf = qp0 + t0
        if causal:
            hi = qf + nb
            if window is not None:
                lo = max(0, qf - window + 1)
            elif chunk is not None:
                lo = (qf // chunk) * chunk
            else:
                lo = 0
        else:
            lo, hi = 0, seq
        out4 = out_rows[t0:t1].view(nb, hkv, g, d)
        if hi <= lo:  # no key at all (bidirectional over an empty sequence)
            out4.zero_()
            if lse_rows is not None:
                lse_rows[t0:t1] = _NEG_INF if sinks is None else sinks
            continue
        q4 = buf.q[: hkv * rows * d].view(hkv, nb, g, d)
        q4.copy_(q_rows[t0:t1].view(nb, hkv, g, d).permute(1, 0, 2, 3))
        q4.mul_(q_scale)
        q2 = q4.view(hkv, rows, d)
        o = buf.o[: hkv * rows * d].view(hkv, rows, d)
        args = (nb, g, causal, window, chunk, soft_cap, slopes, not plain)
        if plain and hi - lo <= key_chunk:
            s = _scores(buf, q2, k, k_base, lo, hi, qf, *args)
            torch.softmax(s, -1, out=s)
            torch.bmm(s, v[:, lo - k_base : hi - k_base], out=o)
        else:
            m = buf.m[: hkv * rows].view(hkv, rows, 1).fill_(_NEG_INF)
            m_new = buf.m_new[: hkv * rows].view(hkv, rows, 1)
            den = buf.l[: hkv * rows].view(hkv, rows, 1).zero_()
            row_sum = buf.row_sum[: hkv * rows].view(hkv, rows, 1)
            o.zero_()
            for c_lo in range(lo, hi, key_chunk):
                c_hi = min(hi, c_lo + key_chunk)
                s = _scores(buf, q2, k, k_base, c_lo, c_hi, qf, *args)
                torch.amax(s, -1, keepdim=True, out=m_new)
                torch.maximum(m_new, m, out=m_new)
                # A row that has seen no key yet keeps -inf: subtract 0 there instead,
                # so exp gives 0 (not exp(-inf + inf) = nan).
                m_safe = m_new.masked_fill(m_new == _NEG_INF, 0.0)
                s.sub_(m_safe).exp_()
                rescale = m.sub_(m_safe).exp_()
                den.mul_(rescale).add_(torch.sum(s, -1, keepdim=True, out=row_sum))
                o.mul_(rescale).baddbmm_(s, v[:, c_lo - k_base : c_hi - k_base])
                m.copy_(m_new)
            if sinks is not None:  # one more logit per row, with no value
                sink = sinks.view(hkv, 1, g).expand(hkv, nb, g).reshape(hkv, rows, 1)
                m_new = torch.maximum(m, sink)
                keep = torch.where(m == _NEG_INF, 0.0, (m - m_new).exp())
                den.mul_(keep).add_((sink - m_new).exp())
                o.mul_(keep)
                m.copy_(m_new)
            o.mul_(torch.where(den > 0, den.reciprocal(), 0.0))
            if lse_rows is not None:
                lse = torch.where(den > 0, m + den.log(), _NEG_INF)  # [Hkv, rows, 1]
                lse_rows[t0:t1] = lse.view(hkv, nb, g).permute(1, 0, 2).reshape(nb, hkv * g)
        out4.copy_(o.view(hkv, nb, g, d).permute(1, 0, 2, 3))


def paged_prefill(
    query: Tensor,
    k_plane: Tensor | None,
    v_plane: Tensor | None,
    block_table: Tensor | None,
    requests: npt.NDArray[np.int64],
    query_start: npt.NDArray[np.int64],
    query_lens: npt.NDArray[np.int64],
    seq_lens: npt.NDArray[np.int64],
    *,
    block_size: int,
    causal: bool,
    window: int | None,
    chunk: int | None,
    scale: float,
    output: Tensor,
    soft_cap: float | None = None,
    alibi_slopes: Tensor | None = None,
    key: Tensor | None = None,
    value: Tensor | None = None,
    query_block: int | None = None,
    key_chunk: int | None = None,
    sinks: Tensor | None = None,
    lse: Tensor | None = None,
    engine: Literal["native", "torch"] = "native",
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Attention of runs of query tokens over the paged K/V planes; writes ``output``.

    ``query`` / ``output`` ``[T, Hq, D]``; ``k_plane`` / ``v_plane`` ``[R, Hkv, D]`` with
    ``R = NB * block_size`` (row = slot); ``block_table`` int32 ``[B, W]``. Request ``i``
    uses block-table row ``requests[i]``, query rows ``query_start[i] :
    query_start[i] + query_lens[i]`` and keys at positions ``0 .. seq_lens[i] - 1``;
    its query ``t`` sits at position ``seq - qlen + t``. A request with
    ``seq == qlen`` reads its keys / values from ``key`` / ``value`` at its query rows
    when those are given (a fresh prompt), else from the planes. Only the served rows of
    ``output`` are written.

    ``causal=False`` is bidirectional: every key ``p < seq`` is visible, and ``qlen`` may
    exceed ``seq`` (cross attention). ``window`` / ``chunk`` (at most one) need
    ``causal``. ``sinks`` (float32 ``[Hq]``): one logit per head that joins every
    softmax denominator and carries no value. ``lse`` (float32 ``[T, Hq]``, any strides):
    receives the served rows' natural-log sum of exp (``-inf`` where no key and no sink
    is visible). ``query_block`` (tokens per block; default: the native kernel's
    choice, or from :data:`QUERY_ROWS`) and ``key_chunk`` (default :data:`KEY_CHUNK`;
    the torch engine's only) are tuning knobs.

    8-bit planes (``float8_e4m3fn``, ``float8_e5m2``, ``int8``) are read as ``stored *
    scale`` (:mod:`.cpu_kv_format`): ``[R, Hkv, D]`` with the per-head ``k_scale`` /
    ``v_scale`` (float32 ``[Hkv]``), or ``[R, Hkv, D + 4]`` with each head's float32
    scale after its values; ``key`` / ``value`` stay in the query's dtype.

    ``engine``: ``"native"`` (default) runs ``paged_prefill.c`` (built by
    :mod:`.cpu_native`; :class:`RuntimeError` where it cannot be built), ``"torch"`` the
    blocked torch products below (kept as a second implementation to compare with).
    """
    # ---- tensors
    q = _check_cpu_tensor("query", query, 3, "a torch.Tensor [T, Hq, D]")
    if q.dtype not in _DTYPES:
        raise ValueError(f"query: expected dtype float32, bfloat16 or float16, got {describe(q)}")
    check_last_dim_contiguous("query", q)
    total, hq, d = q.shape
    out = _check_cpu_tensor("output", output, 3, "a torch.Tensor [T, Hq, D]", q.dtype)
    if out.shape != q.shape:
        raise ValueError(f"output: expected shape {list(q.shape)} (as query), got {describe(out)}")
    check_last_dim_contiguous("output", out)

    if (k_plane is None) != (v_plane is None):
        raise ValueError(
            "k_plane, v_plane: expected both tensors or both None, got "
            f"k_plane {describe(k_plane)} and v_plane {describe(v_plane)}"
        )
    if (key is None) != (value is None):
        raise ValueError(
            f"key, value: expected both tensors or both None, got key {describe(key)} "
            f"and value {describe(value)}"
        )
    hkv: int | None = None
    kp: Tensor | None = None
    vp: Tensor | None = None
    kv_fmt: KVFormat | None = None
    if k_plane is not None and v_plane is not None:
        kp = _check_cpu_tensor("k_plane", k_plane, 3, "a torch.Tensor [R, Hkv, D]")
        vp = _check_cpu_tensor("v_plane", v_plane, 3, "a torch.Tensor [R, Hkv, D]")
        check_last_dim_contiguous("k_plane", kp)
        check_last_dim_contiguous("v_plane", vp)
        kv_fmt = kv_format(q.dtype, kp, vp, d, k_scale, v_scale)
        if vp.shape != kp.shape:
            raise ValueError(
                f"v_plane: expected shape {list(kp.shape)} (as k_plane), got {describe(vp)}"
            )
        hkv = kp.shape[1]
    elif k_scale is not None or v_scale is not None:
        raise ValueError("k_scale, v_scale: expected None without K/V planes")
    kk: Tensor | None = None
    vv: Tensor | None = None
    if key is not None and value is not None:
        kk = _check_cpu_tensor("key", key, 3, "a torch.Tensor [T, Hkv, D]", q.dtype)
        vv = _check_cpu_tensor("value", value, 3, "a torch.Tensor [T, Hkv, D]", q.dtype)
        if kk.shape[0] != total or kk.shape[2] != d or (hkv is not None and kk.shape[1] != hkv):
            want = f"[{total}, {hkv if hkv is not None else 'Hkv'}, {d}]"
            raise ValueError(
                f"key: expected shape {want} (T and D of query, Hkv of the planes), "
                f"got {describe(kk)}"
            )
        if vv.shape != kk.shape:
            raise ValueError(f"value: expected shape {list(kk.shape)} (as key), got {describe(vv)}")
        check_last_dim_contiguous("key", kk)
        check_last_dim_contiguous("value", vv)
        hkv = kk.shape[1]
    if hkv is not None and (hkv == 0 or hq % hkv != 0):
        raise ValueError(
            f"query: expected Hq a multiple of Hkv = {hkv} (grouped-query attention), "
            f"got {describe(q)}"
        )

    slopes: Tensor | None = None
    if alibi_slopes is not None:
        slopes = _check_cpu_tensor(
            "alibi_slopes", alibi_slopes, 1, f"a float32 tensor [{hq}]", torch.float32
        )
        if slopes.shape[0] != hq:
            raise ValueError(
                f"alibi_slopes: expected a float32 tensor [{hq}], got {describe(slopes)}"
            )

    sink_t: Tensor | None = None
    if sinks is not None:
        sink_t = _check_cpu_tensor("sinks", sinks, 1, f"a float32 tensor [{hq}]", torch.float32)
        if sink_t.shape[0] != hq:
            raise ValueError(f"sinks: expected a float32 tensor [{hq}], got {describe(sink_t)}")
    lse_t: Tensor | None = None
    if lse is not None:
        want_lse = f"a float32 tensor [{total}, {hq}] (T and Hq of query)"
        lse_t = _check_cpu_tensor("lse", lse, 2, want_lse, torch.float32)
        if lse_t.shape != (total, hq):
            raise ValueError(f"lse: expected {want_lse}, got {describe(lse_t)}")

    # ---- numbers
    bs = check_int_arg("block_size", block_size, 1)
    causal = check_bool("causal", causal)
    window = _optional_positive_int("window", window)
    chunk = _optional_positive_int("chunk", chunk)
    if window is not None and chunk is not None:
        raise ValueError(
            f"window, chunk: expected at most one of them, got window {window} and chunk {chunk}"
        )
    if not causal and (window is not None or chunk is not None):
        which = "window" if window is not None else "chunk"
        raise ValueError(
            f"{which}: expected None with causal=False (bidirectional attention has no "
            f"{which}), got {window if window is not None else chunk}"
        )
    scale_f = check_finite_float("scale", scale)
    cap: float | None = None
    if soft_cap is not None:
        cap = check_finite_float("soft_cap", soft_cap)
        if cap <= 0.0:
            raise ValueError(f"soft_cap: expected a finite float > 0 or None, got {cap!r}")
    q_block_arg = None if query_block is None else check_int_arg("query_block", query_block, 1)
    k_chunk = KEY_CHUNK if key_chunk is None else check_int_arg("key_chunk", key_chunk, 1)

    # ---- per-request arrays
    req = _check_index_array("requests", requests, None)
    n = len(req)
    starts = _check_index_array("query_start", query_start, n)
    qlens = _check_index_array("query_lens", query_lens, n)
    seqs = _check_index_array("seq_lens", seq_lens, n)

    if engine not in ("native", "torch"):
        raise ValueError(f"engine: expected 'native' or 'torch', got {engine!r}")
    bt: npt.NDArray[np.int64] | None = None
    btt: Tensor | None = None
    if block_table is not None:
        btt = _check_cpu_tensor(
            "block_table", block_table, 2, "an int32 torch.Tensor [B, W]", torch.int32
        )
        bt = btt.numpy().astype(np.int64)

    # Where each request's keys come from, and which positions it reads.
    plans: list[tuple[int, int, int, int, int, bool]] = []  # (start, qlen, seq, lo, row, from_key)
    for i in range(n):
        start, qlen, seq, row = starts[i], qlens[i], seqs[i], req[i]
        if qlen < 1:
            raise ValueError(f"query_lens: expected every entry >= 1, got {qlen} at [{i}]")
        if start < 0 or start + qlen > total:
            raise ValueError(
                f"query_start: expected query rows start .. start + qlen within [0, {total}] "
                f"(T of query), got start {start} with qlen {qlen} at [{i}]"
            )
        if seq < 0:
            raise ValueError(f"seq_lens: expected every entry >= 0, got {seq} at [{i}]")
        if causal and seq < qlen:
            raise ValueError(
                f"seq_lens: expected seq >= qlen with causal=True (queries are the last qlen "
                f"positions), got seq {seq} < qlen {qlen} at [{i}]"
            )
        qp0 = seq - qlen
        lo = 0
        if window is not None:
            lo = max(0, qp0 - window + 1)
        elif chunk is not None:
            lo = (qp0 // chunk) * chunk
        from_key = kk is not None and seq == qlen
        if not from_key and seq > lo:
            if kp is None:
                raise ValueError(
                    f"k_plane: expected the K/V planes (request {i} has seq {seq} != qlen "
                    f"{qlen}, or key/value are not given), got None"
                )
            if bt is None:
                raise ValueError(
                    f"block_table: expected an int32 tensor [B, W] (request {i} reads the "
                    "planes), got None"
                )
            if not 0 <= row < bt.shape[0]:
                raise ValueError(
                    f"requests: expected block-table rows in [0, {bt.shape[0]}), got {row} at [{i}]"
                )
            need = -(-seq // bs)
            if need > bt.shape[1]:
                raise ValueError(
                    f"block_table: expected at least {need} columns (seq {seq} of request "
                    f"{i} over block_size {bs}), got {describe(block_table)}"
                )
        plans.append((start, qlen, seq, lo, row, from_key))

    if hkv is None:  # no planes and no key/value: only empty requests can be served
        if any(seq > 0 for (_, _, seq, _, _, _) in plans):
            raise ValueError("k_plane: expected the K/V planes or key/value, got None")
        hkv = 1 if hq == 0 else hq
    check_distinct_output(
        "output", out, {"query": q, "key": kk, "value": vv, "k_plane": kp, "v_plane": vp}
    )
    if lse_t is not None:
        check_distinct_output(
            "lse", lse_t, {"output": out, "query": q, "k_plane": kp, "v_plane": vp}
        )
    if n == 0:
        return

    g = hq // hkv
    q_block = q_block_arg if q_block_arg is not None else max(32, min(64, QUERY_ROWS // max(g, 1)))
    n_blocks = kp.shape[0] // bs if kp is not None else 0
    # Gather the slots of every plane reader before any work, so a bad block table
    # raises before anything is written.
    slots: list[Tensor | None] = []
    max_keys = 0
    online = sink_t is not None or lse_t is not None  # they need the running max and sum
    for i, (_start, qlen, seq, lo, row, from_key) in enumerate(plans):
        qb = min(q_block, qlen)
        if causal:
            span = qb + (window - 1 if window is not None else (chunk - 1 if chunk else seq))
            span = min(span, seq)
        else:
            span = seq
        max_keys = max(max_keys, min(span, k_chunk))
        online = online or span > k_chunk
        if from_key or seq <= lo:
            slots.append(None)
            continue
        assert bt is not None
        pos = np.arange(lo, seq, dtype=np.int64)
        cols = pos // bs
        blocks = bt[row, cols]
        bad = np.flatnonzero((blocks < 0) | (blocks >= n_blocks))
        if bad.size:
            j = int(bad[0])
            raise ValueError(
                f"block_table: expected physical blocks in [0, {n_blocks}) (k_plane has "
                f"{kp.shape[0] if kp is not None else 0} rows of block_size {bs}), got "
                f"{int(blocks[j])} at [{row}, {int(cols[j])}] (request {i})"
            )
        slots.append(torch.as_tensor(blocks * bs + pos % bs))

    if engine == "native":
        from attnkit.kernels.attention.cpu_prefill_native import native_prefill

        check_last_dim_contiguous("output", out)
        native_prefill(
            q, kp, vp, btt if bt is not None else None, kk, vv,
            [(start, qlen, seq, row, from_key) for (start, qlen, seq, _, row, from_key) in plans],
            block_size=bs, causal=causal, window=window, chunk=chunk, scale=scale_f,
            soft_cap=cap, alibi_slopes=slopes, sinks=sink_t, lse=lse_t, output=out,
            query_block=q_block_arg, planes_format=kv_fmt,
        )  # fmt: skip
        return

    slopes32 = slopes.contiguous() if slopes is not None else None
    sinks32 = sink_t.contiguous() if sink_t is not None else None
    q_scale = scale_f / cap if cap is not None else scale_f
    buf = _Buffers(hkv, min(q_block, max(qlens)) * g, d, max_keys, online)
    for (start, qlen, seq, lo, _row, from_key), idx in zip(plans, slots, strict=True):
        q_rows = q[start : start + qlen]
        out_rows = out[start : start + qlen]
        if from_key:
            assert kk is not None
            assert vv is not None
            k_src = kk[start : start + qlen]
            v_src = vv[start : start + qlen]
            k_base = 0
        elif idx is not None:
            assert kp is not None
            assert vp is not None
            k_src = kp.index_select(0, idx)
            v_src = vp.index_select(0, idx)
            if kv_fmt is not None and kv_fmt.quantised:
                k_src = dequantise_rows(k_src, kv_fmt.k_scale)
                v_src = dequantise_rows(v_src, kv_fmt.v_scale)
            k_base = lo
        else:  # no visible key
            k_src = v_src = q.new_empty(0, hkv, d)
            k_base = lo
        k = k_src.permute(1, 0, 2).to(torch.float32, memory_format=torch.contiguous_format)
        v = v_src.permute(1, 0, 2).to(torch.float32, memory_format=torch.contiguous_format)
        _attend_request(
            buf,
            q_rows,
            out_rows,
            k,
            v,
            k_base,
            seq - qlen,
            seq,
            g=g,
            causal=causal,
            window=window,
            chunk=chunk,
            q_scale=q_scale,
            soft_cap=cap,
            slopes=slopes32,
            query_block=q_block,
            key_chunk=k_chunk,
            sinks=sinks32,
            lse_rows=lse_t[start : start + qlen] if lse_t is not None else None,
        )
