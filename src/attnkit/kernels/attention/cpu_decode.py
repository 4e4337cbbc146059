"""Paged decode on CPU: query rows against a contiguous range of their request's keys.

:func:`paged_attention_rows` runs the native kernel (``paged_decode.c``, built by
:mod:`._native`). Each work item is one query row (all ``Hq`` heads) attending the keys
at logical positions ``[key_start, key_end)`` of one request, read in place from the
paged planes through the block table. A contiguous range covers decode and short query
runs under full, sliding-window, chunked and bidirectional masks; the caller computes it.

This wrapper checks every argument's metadata (type, shape, dtype, device, strides);
the index *values* (rows, requests, key ranges, the physical blocks a range reaches) are
checked by the native code before it reads anything, and a bad one is raised here as a
:class:`ValueError` naming the argument and the request.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.kernels._checks import (
    check_bool,
    check_distinct_output,
    check_finite_float,
    check_int_arg,
    check_last_dim_contiguous,
    describe,
    require_tensor,
)
from attnkit.kernels.attention.cpu_kv_format import KVFormat, kv_format
from attnkit.kernels.attention.cpu_native import Entry, load_paged_decode, native_problem

__all__ = [
    "PreparedPlanes",
    "native_problem",
    "paged_attention_requests",
    "paged_attention_rows",
]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# The native entry points as these wrappers call them (attnkit_abi.h; checked at load):
# the parameters in the order _lead_args, the call and _tail_args pass them.
LEAD_PARAMS = "dtype kv_dtype k_scale v_scale query q_st q_sh k_plane k_sr k_sh v_plane v_sr v_sh "
LEAD_PARAMS += "block_table bt_sb B W R"
TAIL_PARAMS = "scale soft_cap alibi sinks lse lse_st lse_sh output o_st o_sh num_threads err"
_PAGED_DECODE = Entry(
    "paged_decode",
    f"{LEAD_PARAMS} rows requests key_start key_end query_pos N T Hq Hkv D block_size "
    f"pos_mul pos_add {TAIL_PARAMS}",
    errors="ROW REQUEST KEY_START KEY_END RANGE BLOCK NOMEM",
)
_PAGED_DECODE_REQUESTS = Entry(
    "paged_decode_requests",
    f"{LEAD_PARAMS} query_start_loc seq_lens requests n T Hq Hkv D block_size causal window "
    f"chunk {TAIL_PARAMS}",
    errors="REQUEST QSL SEQ KEY_END BLOCK NOMEM",
)

_INT32_MAX = 2**31 - 1


def _cpu(name: str, t: Tensor, expected: str) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{name}: expected {expected} on cpu, got {describe(t)}")


def _index_vector(name: str, value: object, dtype: torch.dtype, n: int | None) -> Tensor:
    t = require_tensor(name, value, f"a {dtype} tensor [N] on cpu")
    if t.dim() != 1 or t.dtype != dtype or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a {dtype} tensor [N] on cpu, got {describe(t)}")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name}: expected {n} entries (one per row in rows), got {describe(t)}")
    check_last_dim_contiguous(name, t)
    return t


def _plane(name: str, value: object) -> Tensor:
    t = require_tensor(name, value, "a torch.Tensor [R, Hkv, D]")
    if t.dim() != 3:
        raise ValueError(f"{name}: expected a tensor [R, Hkv, D], got {describe(t)}")
    _cpu(name, t, "a tensor [R, Hkv, D]")
    check_last_dim_contiguous(name, t)
    return t


@dataclass(frozen=True)
class _Common:
    """The checked arguments both entry points share."""

    query: Tensor
    k: Tensor
    v: Tensor
    bt: Tensor
    kv: KVFormat
    out: Tensor
    block_size: int
    scale: float
    cap: float
    slopes: Tensor | None
    sinks: Tensor | None
    lse: Tensor | None
    threads: int


def _lead_args(c: _Common) -> tuple[int | None, ...]:
    """The native entry points' leading arguments: the dtype code, the planes' format (code,
    static scales or None), then the query, K plane, V plane (pointer, row stride, head
    stride each) and block table (pointer, row stride, B, W, R)."""
    q, k, v, bt = c.query, c.k, c.v, c.bt
    return (
        _DTYPE_CODES[q.dtype], *c.kv.args(),
        q.data_ptr(), q.stride(0), q.stride(1),
        k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1),
        bt.data_ptr(), bt.stride(0), bt.shape[0], bt.shape[1], k.shape[0],
    )  # fmt: skip


def _head_vector(name: str, value: object, hq: int) -> Tensor | None:
    """An optional float32 ``[Hq]`` CPU tensor (ALiBi slopes, sink logits)."""
    if value is None:
        return None
    t = require_tensor(name, value, f"a float32 tensor [{hq}] on cpu")
    if t.dim() != 1 or t.shape[0] != hq or t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a float32 tensor [{hq}] on cpu, got {describe(t)}")
    check_last_dim_contiguous(name, t)
    return t


def _tail_args(c: _Common) -> tuple[object, ...]:
    """The native entry points' trailing arguments, from the scale to the thread count."""
    lse = c.lse
    return (
        c.scale, c.cap, None if c.slopes is None else c.slopes.data_ptr(),
        None if c.sinks is None else c.sinks.data_ptr(),
        None if lse is None else lse.data_ptr(),
        0 if lse is None else lse.stride(0), 0 if lse is None else lse.stride(1),
        c.out.data_ptr(), c.out.stride(0), c.out.stride(1),
        c.threads,
    )  # fmt: skip


def _check_common(
    query: object,
    k_plane: object,
    v_plane: object,
    block_table: object,
    block_size: object,
    scale: object,
    output: object,
    soft_cap: object,
    alibi_slopes: object,
    num_threads: object,
    sinks: object = None,
    lse: object = None,
    k_scale: object = None,
    v_scale: object = None,
) -> _Common:
    q = require_tensor("query", query, "a torch.Tensor [T, Hq, D]")
    if q.dim() != 3:
        raise ValueError(f"query: expected a tensor [T, Hq, D], got {describe(q)}")
    if q.dtype not in _DTYPE_CODES:
        raise ValueError(
            f"query: expected dtype torch.float32, torch.bfloat16 or torch.float16, "
            f"got {describe(q)}"
        )
    _cpu("query", q, "a tensor [T, Hq, D]")
    check_last_dim_contiguous("query", q)
    _, Hq, D = q.shape
    if Hq < 1 or D < 1:
        raise ValueError(f"query: expected Hq >= 1 and D >= 1, got {describe(q)}")

    k = _plane("k_plane", k_plane)
    v = _plane("v_plane", v_plane)
    Hkv = k.shape[1]
    kv = kv_format(q.dtype, k, v, D, k_scale, v_scale)
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(
            f"k_plane: expected Hkv >= 1 dividing the query's Hq = {Hq}, got {describe(k)}"
        )
    if v.shape != k.shape:
        raise ValueError(
            f"v_plane: expected the shape of k_plane {list(k.shape)}, got {describe(v)}"
        )

    bs = check_int_arg("block_size", block_size, 1)
    bt = require_tensor("block_table", block_table, "an int32 tensor [B, W] on cpu")
    if bt.dim() != 2 or bt.dtype != torch.int32:
        raise ValueError(f"block_table: expected an int32 tensor [B, W], got {describe(bt)}")
    _cpu("block_table", bt, "an int32 tensor [B, W]")
    check_last_dim_contiguous("block_table", bt)

    scale_f = check_finite_float("scale", scale)
    cap = 0.0
    if soft_cap is not None:
        cap = check_finite_float("soft_cap", soft_cap)
        if cap <= 0.0:
            raise ValueError(f"soft_cap: expected a finite float > 0 or None, got {soft_cap!r}")
    slopes = _head_vector("alibi_slopes", alibi_slopes, Hq)
    sink_t = _head_vector("sinks", sinks, Hq)
    lse_t: Tensor | None = None
    if lse is not None:
        want = f"a float32 tensor [{q.shape[0]}, {Hq}] on cpu (T and Hq of query)"
        lse_t = require_tensor("lse", lse, want)
        if (
            lse_t.shape != (q.shape[0], Hq)
            or lse_t.dtype != torch.float32
            or lse_t.device.type != "cpu"
        ):
            raise ValueError(f"lse: expected {want}, got {describe(lse_t)}")

    out = require_tensor("output", output, "a torch.Tensor [T, Hq, D]")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(
            f"output: expected a {q.dtype} tensor {list(q.shape)} (the query's), "
            f"got {describe(out)}"
        )
    _cpu("output", out, "a tensor [T, Hq, D]")
    check_last_dim_contiguous("output", out)
    check_distinct_output("output", out, {"k_plane": k, "v_plane": v})
    if lse_t is not None:
        check_distinct_output("lse", lse_t, {"output": out, "query": q, "k_plane": k, "v_plane": v})

    threads = torch.get_num_threads() if num_threads is None else num_threads
    threads = check_int_arg("num_threads", threads, 1, _INT32_MAX)

    return _Common(
        query=q,
        k=k,
        v=v,
        bt=bt,
        kv=kv,
        out=out,
        block_size=bs,
        scale=scale_f,
        cap=cap,
        slopes=slopes,
        sinks=sink_t,
        lse=lse_t,
        threads=threads,
    )


def paged_attention_rows(
    query: Tensor,
    k_plane: Tensor,
    v_plane: Tensor,
    block_table: Tensor,
    rows: Tensor,
    requests: Tensor,
    key_start: Tensor,
    key_end: Tensor,
    query_pos: Tensor,
    *,
    block_size: int,
    scale: float,
    output: Tensor,
    soft_cap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    lse: Tensor | None = None,
    num_threads: int | None = None,
    key_stride: int = 1,
    key_offset: int = 0,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Attend query rows to contiguous key ranges of paged K/V planes, writing ``output``.

    Args:
        query: ``[T, Hq, D]`` float32, bfloat16 or float16, last dim contiguous.
        k_plane, v_plane: ``[R, Hkv, D]`` (``R = num_blocks * block_size``), the query's
            dtype, last dim contiguous. Query head ``h`` reads K/V head ``h // (Hq // Hkv)``.
            Or 8-bit planes (``float8_e4m3fn``, ``float8_e5m2``, ``int8``) read as
            ``stored * scale`` (:mod:`.cpu_kv_format`): ``[R, Hkv, D]`` with ``k_scale``
            / ``v_scale``, or ``[R, Hkv, D + 4]`` with each head's float32 scale after its
            values.
        block_table: int32 ``[B, W]``, last dim contiguous: logical position ``p`` of
            request ``b`` is physical row ``block_table[b, p // block_size] * block_size
            + p % block_size``.
        rows: int64 ``[N]``, the query/output row of each work item.
        requests: int32 ``[N]``, each item's block_table row.
        key_start, key_end: int32 ``[N]``, the visible logical keys ``[start, end)``
            (``0 <= start <= end <= W * block_size``); an empty range writes zeros.
        query_pos: int32 ``[N]``, the query's position (ALiBi's ``qp``).
        block_size: rows per block.
        scale: the factor on ``q . k``.
        output: ``[T, Hq, D]``, the query's dtype, last dim contiguous; only ``rows`` are
            written.
        soft_cap: ``s = soft_cap * tanh(s / soft_cap)`` after scaling (``None``: none).
        alibi_slopes: float32 ``[Hq]``: ``s += slope[h] * (p - query_pos)`` after the cap.
        sinks: float32 ``[Hq]``: one logit per head that joins every softmax denominator
            (and carries no value).
        lse: float32 ``[T, Hq]`` (any strides): each written row's natural-log sum of
            exp over its visible keys (and the sink), ``-inf`` where none is visible.
        num_threads: OpenMP threads (default :func:`torch.get_num_threads`).
        key_stride, key_offset: ALiBi's position of logical key ``p`` is ``p *
            key_stride + key_offset`` (a context-parallel shard: ``world_size`` and
            ``rank``, with ``query_pos`` the global positions); 1 and 0 otherwise.
        k_scale, v_scale: float32 ``[Hkv]``: the static per-head scales of 8-bit
            planes ``[R, Hkv, D]``; ``None`` otherwise.

    Scores accumulate in float32 whatever the dtype. Raises :class:`RuntimeError` when
    the native library cannot be built here (:func:`native_problem` says why).
    """
    c = _check_common(
        query, k_plane, v_plane, block_table, block_size, scale, output, soft_cap,
        alibi_slopes, num_threads, sinks, lse, k_scale, v_scale,
    )  # fmt: skip
    q, k, bt = c.query, c.k, c.bt
    T, Hq, D = q.shape
    R, Hkv, _ = k.shape
    B, W = bt.shape
    bs = c.block_size
    r = _index_vector("rows", rows, torch.int64, None)
    n = r.shape[0]
    req = _index_vector("requests", requests, torch.int32, n)
    ks = _index_vector("key_start", key_start, torch.int32, n)
    ke = _index_vector("key_end", key_end, torch.int32, n)
    qp = _index_vector("query_pos", query_pos, torch.int32, n)
    stride = check_int_arg("key_stride", key_stride, 1, _INT32_MAX)
    offset = check_int_arg("key_offset", key_offset, 0, _INT32_MAX)

    lib = load_paged_decode()
    if n == 0:
        return
    err = (ctypes.c_int64 * 3)()
    code = _PAGED_DECODE.of(lib)(
        *_lead_args(c),
        r.data_ptr(), req.data_ptr(), ks.data_ptr(), ke.data_ptr(), qp.data_ptr(),
        n, T, Hq, Hkv, D, bs, stride, offset,
        *_tail_args(c),
        ctypes.addressof(err),
    )  # fmt: skip
    if code != 0:
        _raise_index_error(
            lib.error_name(code), code, err[0], err[1], err[2], req, T=T, B=B, W=W, R=R, bs=bs
        )


def _raise_index_error(
    error: str,
    code: int,
    item: int,
    value: int,
    extra: int,
    requests: Tensor,
    *,
    T: int,
    B: int,
    W: int,
    R: int,
    bs: int,
) -> None:
    if error == "NOMEM":
        raise MemoryError("paged_attention_rows: the native kernel could not allocate scratch")
    if error == "ROW":
        raise ValueError(f"rows: expected query rows in [0, {T}), got {value} at rows[{item}]")
    if error == "REQUEST":
        raise ValueError(
            f"requests: expected block_table rows in [0, {B}), got {value} at requests[{item}]"
        )
    request = int(requests[item])
    if error == "KEY_START":
        raise ValueError(
            f"key_start: expected values >= 0, got {value} at key_start[{item}] (request {request})"
        )
    if error == "KEY_END":
        raise ValueError(
            f"key_end: expected values <= W * block_size = {W * bs} (the block_table width), "
            f"got {value} at key_end[{item}] (request {request})"
        )
    if error == "RANGE":
        raise ValueError(
            f"key_end: expected values >= key_start, got key_end[{item}] = {value} < "
            f"key_start[{item}] = {extra} (request {request})"
        )
    if error == "BLOCK":
        raise ValueError(
            f"block_table: expected physical blocks in [0, {R // bs}) (R // block_size), "
            f"got {value} at block_table[{request}, {extra}] (work item {item})"
        )
    raise RuntimeError(f"paged_attention_rows: the native kernel failed with code {code}")


def paged_attention_requests(
    query: Tensor,
    k_plane: Tensor,
    v_plane: Tensor,
    block_table: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    requests: Tensor | None,
    *,
    block_size: int,
    causal: bool,
    window: int | None,
    chunk: int | None,
    scale: float,
    output: Tensor,
    soft_cap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    lse: Tensor | None = None,
    num_threads: int | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """:func:`paged_attention_rows` for whole requests, from the batch metadata as is.

    The native code plans the work items itself from ``query_start_loc`` and
    ``seq_lens`` (what the runtime hands every builder), so the caller builds no
    per-token arrays: query ``t`` of request ``r`` (``qlen = query_start_loc[r + 1] -
    query_start_loc[r]``) sits at ``qp = seq_lens[r] - qlen + t`` and sees the keys
    ``[lo, qp + 1)`` when ``causal`` (``lo``: 0; ``max(qp - window + 1, 0)``; or the
    start of ``qp``'s chunk) and ``[0, seq_lens[r])`` otherwise.

    Args:
        query_start_loc: int32 ``[B + 1]``; seq_lens: int32 ``[B]`` (CPU).
        requests: int32 ``[n]``: the requests to serve (their rows of ``output`` are
            written, no other); ``None``: every request.
        causal, window, chunk: the mask (``window``/``chunk``: at most one, causal only).
        The rest as :func:`paged_attention_rows`.

    Raises:
        ValueError: an argument's metadata, or an index value (a request out of range,
            offsets out of order, a length too short for its queries, a block outside
            the planes, lengths past the block table), naming the argument and request.
    """
    c = _check_common(
        query, k_plane, v_plane, block_table, block_size, scale, output, soft_cap,
        alibi_slopes, num_threads, sinks, lse, k_scale, v_scale,
    )  # fmt: skip
    q, k, bt = c.query, c.k, c.bt
    T, Hq, D = q.shape
    R, Hkv, _ = k.shape
    B, W = bt.shape
    qsl = _index_vector("query_start_loc", query_start_loc, torch.int32, B + 1)
    seq = _index_vector("seq_lens", seq_lens, torch.int32, B)
    served: Tensor | None = None
    if requests is not None:
        served = _index_vector("requests", requests, torch.int32, None)
    causal_b = check_bool("causal", causal)
    for name, limit in (("window", window), ("chunk", chunk)):
        if limit is not None:
            check_int_arg(name, limit, 1, _INT32_MAX)
            if not causal_b:
                raise ValueError(f"{name}: expected None when causal is False, got {limit!r}")
    if window is not None and chunk is not None:
        raise ValueError(f"chunk: expected None when a window is given, got {chunk!r}")
    w = int(window) if window is not None else 0
    ch = int(chunk) if chunk is not None else 0
    lib = load_paged_decode()
    n = B if served is None else served.shape[0]
    if n == 0:
        return
    err = (ctypes.c_int64 * 3)()
    code = _PAGED_DECODE_REQUESTS.of(lib)(
        *_lead_args(c),
        qsl.data_ptr(), seq.data_ptr(), None if served is None else served.data_ptr(), n,
        T, Hq, Hkv, D, c.block_size,
        int(causal_b), w, ch,
        *_tail_args(c),
        ctypes.addressof(err),
    )  # fmt: skip
    if code != 0:
        _raise_request_error(
            lib.error_name(code), code, err[0], err[1], err[2], T=T, B=B, W=W, R=R, bs=c.block_size
        )


class PreparedPlanes:
    """A layer's paged planes and its constant arguments (block size, scale, soft-cap,
    ALiBi slopes, sinks, static 8-bit scales) checked once for a query dtype and shape
    ``[*, Hq, D]``, so that :meth:`requests` checks only what changes per step.

    A backend keeps one per layer and prepares again when :meth:`serves` says the
    planes (or the query's dtype) changed: the per-call checks of
    :func:`paged_attention_requests` cost more than the decode kernel itself at small
    batches.
    """

    __slots__ = ("_common", "_head", "_key", "_planes", "_tail", "d", "hq")

    def __init__(
        self,
        k_plane: Tensor,
        v_plane: Tensor,
        *,
        query_dtype: torch.dtype,
        num_heads: int,
        head_size: int,
        block_size: int,
        scale: float,
        soft_cap: float | None = None,
        alibi_slopes: Tensor | None = None,
        sinks: Tensor | None = None,
        k_scale: Tensor | None = None,
        v_scale: Tensor | None = None,
    ) -> None:
        probe = torch.empty(0, num_heads, head_size, dtype=query_dtype)
        c = _check_common(
            probe, k_plane, v_plane, torch.zeros(0, 1, dtype=torch.int32), block_size, scale,
            torch.empty_like(probe), soft_cap, alibi_slopes, 1, sinks, None, k_scale, v_scale,
        )  # fmt: skip
        self._common = c
        self.hq, self.d = num_heads, head_size
        k, v = c.k, c.v
        self._key = PreparedPlanes.key_of(k, v, query_dtype, c.block_size)
        self._head = (_DTYPE_CODES[query_dtype], *c.kv.args())
        self._planes = (
            k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
        )  # fmt: skip
        self._tail = (
            c.scale, c.cap, None if c.slopes is None else c.slopes.data_ptr(),
            None if c.sinks is None else c.sinks.data_ptr(),
        )  # fmt: skip

    @staticmethod
    def key_of(
        k_plane: Tensor, v_plane: Tensor, query_dtype: torch.dtype, block_size: int
    ) -> tuple[object, ...]:
        """What the preparation depends on: the planes' memory, shape, strides and
        dtype, the query's dtype and the block size."""
        return (
            k_plane.data_ptr(), v_plane.data_ptr(), k_plane.shape, v_plane.shape,
            k_plane.stride(), v_plane.stride(), k_plane.dtype, v_plane.dtype, query_dtype,
            block_size,
        )  # fmt: skip

    def serves(
        self, k_plane: Tensor, v_plane: Tensor, query_dtype: torch.dtype, block_size: int
    ) -> bool:
        """Whether these planes, query dtype and block size are the prepared ones."""
        return PreparedPlanes.key_of(k_plane, v_plane, query_dtype, block_size) == self._key

    def requests(
        self,
        query: Tensor,
        block_table: Tensor,
        query_start_loc: Tensor,
        seq_lens: Tensor,
        requests: Tensor | None,
        *,
        causal: bool,
        window: int | None,
        chunk: int | None,
        output: Tensor,
    ) -> None:
        """:func:`paged_attention_requests` over the prepared planes. ``block_table``,
        ``query_start_loc``, ``seq_lens`` and ``requests`` are the builder's (int32,
        contiguous, CPU: not checked again; their values are, by the native code);
        ``query`` and ``output`` are checked against the prepared dtype and heads."""
        c = self._common
        q, out = query, output
        if (
            q.dtype != c.query.dtype
            or q.dim() != 3
            or q.shape[1] != self.hq
            or q.shape[2] != self.d
            or q.stride(2) != 1
            or q.device.type != "cpu"
        ):
            raise ValueError(
                f"query: expected a {c.query.dtype} CPU tensor [T, {self.hq}, {self.d}] with "
                f"a contiguous last dim (the prepared planes'), got {describe(q)}"
            )
        if out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
            raise ValueError(
                f"output: expected a {q.dtype} tensor {list(q.shape)} (the query's) with a "
                f"contiguous last dim, got {describe(out)}"
            )
        check_distinct_output("output", out, {"k_plane": c.k, "v_plane": c.v})
        T = q.shape[0]
        B, W = block_table.shape
        n = B if requests is None else requests.shape[0]
        if n == 0:
            return
        lib = load_paged_decode()
        err = (ctypes.c_int64 * 3)()
        R, Hkv, _ = c.k.shape
        bs = c.block_size
        code = _PAGED_DECODE_REQUESTS.of(lib)(
            *self._head,
            q.data_ptr(), q.stride(0), q.stride(1),
            *self._planes,
            block_table.data_ptr(), block_table.stride(0), B, W, R,
            query_start_loc.data_ptr(), seq_lens.data_ptr(),
            None if requests is None else requests.data_ptr(), n,
            T, self.hq, Hkv, self.d, bs,
            int(causal), window or 0, chunk or 0,
            *self._tail, None, 0, 0,
            out.data_ptr(), out.stride(0), out.stride(1),
            torch.get_num_threads(),
            ctypes.addressof(err),
        )  # fmt: skip
        if code != 0:
            _raise_request_error(
                lib.error_name(code), code, err[0], err[1], err[2], T=T, B=B, W=W, R=R, bs=bs
            )


def _raise_request_error(
    error: str,
    code: int,
    request: int,
    value: int,
    extra: int,
    *,
    T: int,
    B: int,
    W: int,
    R: int,
    bs: int,
) -> None:
    if error == "NOMEM":
        raise MemoryError("paged_attention_requests: the native kernel could not allocate scratch")
    if error == "REQUEST":
        raise ValueError(
            f"requests: expected requests in [0, {B}), got {value} at requests[{request}]"
        )
    if error == "QSL":
        raise ValueError(
            f"query_start_loc: expected 0 <= query_start_loc[r] <= query_start_loc[r + 1] <= "
            f"{T} (T of query), got {value} .. {extra} for request {request}"
        )
    if error == "SEQ":
        raise ValueError(
            f"seq_lens: expected seq_lens[r] >= 0 and, when causal, >= the query length, "
            f"got {value} for request {request} with {extra} queries"
        )
    if error == "KEY_END":
        raise ValueError(
            f"seq_lens: expected lengths <= W * block_size = {W * bs} (the block_table "
            f"width), got {value} keys visible to request {request}"
        )
    if error == "BLOCK":
        raise ValueError(
            f"block_table: expected physical blocks in [0, {R // bs}) (R // block_size), "
            f"got {value} at block_table[{request}, {extra}]"
        )
    raise RuntimeError(f"paged_attention_requests: native error code {code}")
