"""The native blocked prefill (``paged_prefill.c``): the call, after
:func:`.cpu_prefill.paged_prefill` has checked every argument.

One call serves every request of a step: a request whose keys are the step's own
``key`` / ``value`` rows (a fresh prompt, encoder-only attention) is flagged ``dense``
and read there, the others through the block table from the planes. The native code
checks every index again before it reads anything (an error here means the checks in
``paged_prefill`` and the C disagree: a bug, raised as :class:`RuntimeError`).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from attnkit.kernels.attention.cpu_decode import LEAD_PARAMS, TAIL_PARAMS
from attnkit.kernels.attention.cpu_kv_format import KVFormat
from attnkit.kernels.attention.cpu_native import Entry, load_paged_decode

__all__ = ["native_prefill", "prefill_isa"]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# attnkit_paged_prefill as native_prefill calls it (attnkit_abi.h; checked at load).
_PAGED_PREFILL = Entry(
    "paged_prefill",
    f"{LEAD_PARAMS} key kd_sr kd_sh value vd_sr vd_sh requests query_start query_len seq_len "
    f"dense n T Hq Hkv D block_size causal window chunk query_block {TAIL_PARAMS}",
    errors="NOMEM",
)


def prefill_isa() -> str:
    """The instruction set whose copy of the prefill compute runs on this CPU
    (``avx512bf16``, ``avx512``, ``avx2`` or ``generic``; ``ATTNKIT_CPU_ISA`` caps it)."""
    return load_paged_decode().prefill_isa


def _strides(t: Tensor | None) -> tuple[int | None, int, int]:
    if t is None:
        return None, 0, 0
    return t.data_ptr(), t.stride(0), t.stride(1)


def native_prefill(
    query: Tensor,
    k_plane: Tensor | None,
    v_plane: Tensor | None,
    block_table: Tensor | None,
    key: Tensor | None,
    value: Tensor | None,
    plans: list[tuple[int, int, int, int, bool]],
    *,
    block_size: int,
    causal: bool,
    window: int | None,
    chunk: int | None,
    scale: float,
    soft_cap: float | None,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
    lse: Tensor | None,
    output: Tensor,
    query_block: int | None,
    planes_format: KVFormat | None = None,
) -> None:
    """Run the checked step: ``plans`` holds ``(query start, query length, sequence
    length, block-table row, reads key/value)`` per request; ``planes_format`` the planes' format
    (``None``: the query's dtype, or no planes)."""
    lib = load_paged_decode()
    n = len(plans)
    cols = list(zip(*plans, strict=True)) if plans else [(), (), (), (), ()]
    starts = torch.tensor(cols[0], dtype=torch.int32)
    qlens = torch.tensor(cols[1], dtype=torch.int32)
    seqs = torch.tensor(cols[2], dtype=torch.int32)
    rows = torch.tensor(cols[3], dtype=torch.int32)
    dense = torch.tensor([int(x) for x in cols[4]], dtype=torch.int32)
    q, out = query, output
    t, hq, d = q.shape
    kv = k_plane if k_plane is not None else key
    hkv = kv.shape[1] if kv is not None else hq  # neither: every request sees no key
    slopes = None if alibi_slopes is None else alibi_slopes.contiguous()
    sink = None if sinks is None else sinks.contiguous()
    bt = block_table
    kp_ptr, k_sr, k_sh = _strides(k_plane)
    vp_ptr, v_sr, v_sh = _strides(v_plane)
    kd_ptr, kd_sr, kd_sh = _strides(key)
    vd_ptr, vd_sr, vd_sh = _strides(value)
    lse_ptr, lse_st, lse_sh = _strides(lse)
    err = (ctypes.c_int64 * 3)()
    code = _PAGED_PREFILL.of(lib)(
        _DTYPE_CODES[q.dtype],
        *(planes_format.args() if planes_format is not None else (_DTYPE_CODES[q.dtype], None, None)),
        q.data_ptr(), q.stride(0), q.stride(1),
        kp_ptr, k_sr, k_sh,
        vp_ptr, v_sr, v_sh,
        None if bt is None else bt.data_ptr(), 0 if bt is None else bt.stride(0),
        0 if bt is None else bt.shape[0], 0 if bt is None else bt.shape[1],
        0 if k_plane is None else k_plane.shape[0],
        kd_ptr, kd_sr, kd_sh, vd_ptr, vd_sr, vd_sh,
        rows.data_ptr(), starts.data_ptr(), qlens.data_ptr(), seqs.data_ptr(),
        dense.data_ptr(), n,
        t, hq, hkv, d, block_size,
        int(causal), window or 0, chunk or 0, query_block or 0,
        scale, soft_cap or 0.0,
        None if slopes is None else slopes.data_ptr(),
        None if sink is None else sink.data_ptr(),
        lse_ptr, lse_st, lse_sh,
        out.data_ptr(), out.stride(0), out.stride(1),
        torch.get_num_threads(),
        ctypes.addressof(err),
    )  # fmt: skip
    if lib.error_name(code) == "NOMEM":
        raise MemoryError("paged_prefill: the native kernel could not allocate scratch")
    if code != 0:
        raise RuntimeError(
            f"paged_prefill: the native kernel refused checked arguments ({lib.error_name(code)}, "
            f"request {err[0]}, value {err[1]}, {err[2]})"
        )
