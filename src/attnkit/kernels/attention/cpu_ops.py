"""The CPU paged-decode engine as a torch operator, ``torch.ops.attnkit.cpu_paged_decode``.

``torch.compile`` cannot trace into a ctypes call: a model that calls
:func:`~attnkit.kernels.attention.cpu_decode.paged_attention_requests` directly breaks
its graph there. Through the operator it does not: the operator is defined by its
schema (``output`` and ``lse`` declared mutated, nothing returned) with a CPU kernel and
a fake implementation, so Dynamo and AOTAutograd trace the call as one node and Inductor
keeps it as an opaque kernel call. The eager path is the same function with the same
checks: every error :func:`paged_attention_requests` raises, the operator raises.

Why ``torch.library.Library`` and not ``torch.library.custom_op``: the latter's Python
wrapper cost about 210 us per eager call here (a 1-token decode is about 57 us), the
plain kernel registration about 14 us.

Registered on import of this module (``import attnkit.kernels.attention.cpu_ops``);
the CPU backend's own forward keeps its direct call (``PreparedPlanes``), which skips
the dispatcher's per-call cost on small steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .cpu_decode import paged_attention_requests

__all__ = ["SCHEMA", "cpu_paged_decode"]

SCHEMA = (
    "cpu_paged_decode(Tensor query, Tensor k_plane, Tensor v_plane, Tensor block_table, "
    "Tensor query_start_loc, Tensor seq_lens, Tensor? requests, Tensor(a!) output, "
    "Tensor(b!)? lse, SymInt block_size, bool causal, SymInt window, SymInt chunk, "
    "float scale, float soft_cap, Tensor? alibi_slopes, Tensor? sinks, Tensor? k_scale, "
    "Tensor? v_scale) -> ()"
)
"""The operator's schema (``attnkit::`` namespace)."""


def cpu_paged_decode(
    query: Tensor,
    k_plane: Tensor,
    v_plane: Tensor,
    block_table: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    requests: Tensor | None,
    output: Tensor,
    lse: Tensor | None,
    block_size: int,
    causal: bool,
    window: int,
    chunk: int,
    scale: float,
    soft_cap: float,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> None:
    """The operator's CPU kernel, :func:`paged_attention_requests`: writes ``output``
    (and ``lse``).

    The scalar options take 0 for "none" (the schema has no optional ints): ``window``
    and ``chunk`` ``0`` = no window / chunk, ``soft_cap`` ``0.0`` = no soft-cap; a
    negative one is refused as :func:`paged_attention_requests` refuses it.
    """
    paged_attention_requests(
        query,
        k_plane,
        v_plane,
        block_table,
        query_start_loc,
        seq_lens,
        requests,
        block_size=block_size,
        causal=causal,
        window=None if window == 0 else window,
        chunk=None if chunk == 0 else chunk,
        scale=scale,
        output=output,
        soft_cap=None if soft_cap == 0.0 else soft_cap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        lse=lse,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def _cpu_paged_decode_fake(*args: object) -> None:
    """Nothing to compute while tracing: the operator returns nothing and writes only
    its declared outputs."""
    return None


# torch leaves Library and its methods unannotated; what they register is checked by
# tests/kernels/test_cpu_ops.py (the schema, opcheck, fullgraph tracing).
_library: Any = torch.library
_LIB = _library.Library("attnkit", "FRAGMENT")
_LIB.define(SCHEMA)
_LIB.impl("cpu_paged_decode", cpu_paged_decode, "CPU")
_library.register_fake("attnkit::cpu_paged_decode", _cpu_paged_decode_fake, lib=_LIB)
