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

import torch
from torch import Tensor

from attnkit.kernels._checks import (
    check_distinct_output,
    check_finite_float,
    check_int_arg,
    describe,
    require_tensor,
)
from attnkit.kernels.cpu._native import load_paged_decode, native_problem

__all__ = ["native_problem", "paged_attention_rows"]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# Error codes of attnkit_paged_decode (paged_decode.c).
_ERR_ROW = 1
_ERR_REQUEST = 2
_ERR_KEY_START = 3
_ERR_KEY_END = 4
_ERR_RANGE = 5
_ERR_BLOCK = 6
_ERR_NOMEM = 7

_INT32_MAX = 2**31 - 1


def _cpu(name: str, t: Tensor, expected: str) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{name}: expected {expected} on cpu, got {describe(t)}")


def _last_dim_contiguous(name: str, t: Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected a contiguous last dimension (stride 1), got strides "
            f"{list(t.stride())} for {describe(t)}"
        )


def _index_vector(name: str, value: object, dtype: torch.dtype, n: int | None) -> Tensor:
    t = require_tensor(name, value, f"a {dtype} tensor [N] on cpu")
    if t.dim() != 1 or t.dtype != dtype or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a {dtype} tensor [N] on cpu, got {describe(t)}")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name}: expected {n} entries (one per row in rows), got {describe(t)}")
    _last_dim_contiguous(name, t)
    return t


def _plane(name: str, value: object, dtype: torch.dtype) -> Tensor:
    t = require_tensor(name, value, "a torch.Tensor [R, Hkv, D]")
    if t.dim() != 3:
        raise ValueError(f"{name}: expected a tensor [R, Hkv, D], got {describe(t)}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype} (the query's), got {describe(t)}")
    _cpu(name, t, "a tensor [R, Hkv, D]")
    _last_dim_contiguous(name, t)
    return t


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
    num_threads: int | None = None,
) -> None:
    """Attend query rows to contiguous key ranges of paged K/V planes, writing ``output``.

    Args:
        query: ``[T, Hq, D]`` float32, bfloat16 or float16, last dim contiguous.
        k_plane, v_plane: ``[R, Hkv, D]`` (``R = num_blocks * block_size``), the query's
            dtype, last dim contiguous. Query head ``h`` reads K/V head ``h // (Hq // Hkv)``.
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
        num_threads: OpenMP threads (default :func:`torch.get_num_threads`).

    Scores accumulate in float32 whatever the dtype. Raises :class:`RuntimeError` when
    the native library cannot be built here (:func:`native_problem` says why).
    """
    q = require_tensor("query", query, "a torch.Tensor [T, Hq, D]")
    if q.dim() != 3:
        raise ValueError(f"query: expected a tensor [T, Hq, D], got {describe(q)}")
    if q.dtype not in _DTYPE_CODES:
        raise ValueError(
            f"query: expected dtype torch.float32, torch.bfloat16 or torch.float16, "
            f"got {describe(q)}"
        )
    _cpu("query", q, "a tensor [T, Hq, D]")
    _last_dim_contiguous("query", q)
    T, Hq, D = q.shape
    if Hq < 1 or D < 1:
        raise ValueError(f"query: expected Hq >= 1 and D >= 1, got {describe(q)}")

    k = _plane("k_plane", k_plane, q.dtype)
    v = _plane("v_plane", v_plane, q.dtype)
    R, Hkv, Dk = k.shape
    if Dk != D:
        raise ValueError(f"k_plane: expected head size D = {D} (the query's), got {describe(k)}")
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
    _last_dim_contiguous("block_table", bt)
    B, W = bt.shape

    r = _index_vector("rows", rows, torch.int64, None)
    n = r.shape[0]
    req = _index_vector("requests", requests, torch.int32, n)
    ks = _index_vector("key_start", key_start, torch.int32, n)
    ke = _index_vector("key_end", key_end, torch.int32, n)
    qp = _index_vector("query_pos", query_pos, torch.int32, n)

    scale_f = check_finite_float("scale", scale)
    cap = 0.0
    if soft_cap is not None:
        cap = check_finite_float("soft_cap", soft_cap)
        if cap <= 0.0:
            raise ValueError(f"soft_cap: expected a finite float > 0 or None, got {soft_cap!r}")
    slopes: Tensor | None = None
    if alibi_slopes is not None:
        slopes = require_tensor("alibi_slopes", alibi_slopes, f"a float32 tensor [{Hq}] on cpu")
        if (
            slopes.dim() != 1
            or slopes.shape[0] != Hq
            or slopes.dtype != torch.float32
            or slopes.device.type != "cpu"
        ):
            raise ValueError(
                f"alibi_slopes: expected a float32 tensor [{Hq}] on cpu, got {describe(slopes)}"
            )
        _last_dim_contiguous("alibi_slopes", slopes)

    out = require_tensor("output", output, "a torch.Tensor [T, Hq, D]")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(
            f"output: expected a {q.dtype} tensor {list(q.shape)} (the query's), "
            f"got {describe(out)}"
        )
    _cpu("output", out, "a tensor [T, Hq, D]")
    _last_dim_contiguous("output", out)
    check_distinct_output("output", out, {"k_plane": k, "v_plane": v})

    threads = torch.get_num_threads() if num_threads is None else num_threads
    threads = check_int_arg("num_threads", threads, 1, _INT32_MAX)

    lib = load_paged_decode()
    if n == 0:
        return
    err = (ctypes.c_int64 * 3)()
    code = lib.paged_decode(
        _DTYPE_CODES[q.dtype],
        q.data_ptr(), q.stride(0), q.stride(1),
        k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1),
        bt.data_ptr(), bt.stride(0), B, W, R,
        r.data_ptr(), req.data_ptr(), ks.data_ptr(), ke.data_ptr(), qp.data_ptr(),
        n, T, Hq, Hkv, D, bs,
        scale_f, cap, None if slopes is None else slopes.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1),
        threads,
        ctypes.addressof(err),
    )  # fmt: skip
    if code != 0:
        _raise_index_error(code, err[0], err[1], err[2], req, T=T, B=B, W=W, R=R, bs=bs)


def _raise_index_error(
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
    if code == _ERR_NOMEM:
        raise MemoryError("paged_attention_rows: the native kernel could not allocate scratch")
    if code == _ERR_ROW:
        raise ValueError(f"rows: expected query rows in [0, {T}), got {value} at rows[{item}]")
    if code == _ERR_REQUEST:
        raise ValueError(
            f"requests: expected block_table rows in [0, {B}), got {value} at requests[{item}]"
        )
    request = int(requests[item])
    if code == _ERR_KEY_START:
        raise ValueError(
            f"key_start: expected values >= 0, got {value} at key_start[{item}] (request {request})"
        )
    if code == _ERR_KEY_END:
        raise ValueError(
            f"key_end: expected values <= W * block_size = {W * bs} (the block_table width), "
            f"got {value} at key_end[{item}] (request {request})"
        )
    if code == _ERR_RANGE:
        raise ValueError(
            f"key_end: expected values >= key_start, got key_end[{item}] = {value} < "
            f"key_start[{item}] = {extra} (request {request})"
        )
    if code == _ERR_BLOCK:
        raise ValueError(
            f"block_table: expected physical blocks in [0, {R // bs}) (R // block_size), "
            f"got {value} at block_table[{request}, {extra}] (work item {item})"
        )
    raise RuntimeError(f"paged_attention_rows: the native kernel failed with code {code}")
