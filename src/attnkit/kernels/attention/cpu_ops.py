"""The CPU engines as torch operators: ``torch.ops.attnkit.cpu_paged_decode`` (the
native paged decode, by request) and ``torch.ops.attnkit.cpu_paged_prefill`` (the
blocked prefill).

``torch.compile`` cannot trace into a ctypes call: a model that calls
:func:`~attnkit.kernels.attention.cpu_decode.paged_attention_requests` or
:func:`~attnkit.kernels.attention.cpu_prefill.paged_prefill` directly breaks its graph
there. Through an operator it does not: each is defined by its schema (``output`` and
``lse`` declared mutated, nothing returned) with a CPU kernel and a fake
implementation, so Dynamo and AOTAutograd trace the call as one node and Inductor keeps
it as an opaque kernel call. The eager path is the same function with the same checks:
every error the function raises, the operator raises.

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
from .cpu_prefill import paged_prefill

__all__ = ["PREFILL_SCHEMA", "SCHEMA", "cpu_paged_decode", "cpu_paged_prefill"]

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
        output=output,
        alibi_slopes=alibi_slopes,
        **_options(block_size, causal, window, chunk, scale, soft_cap),
        sinks=sinks,
        lse=lse,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def _options(
    block_size: int, causal: bool, window: int, chunk: int, scale: float, soft_cap: float
) -> dict[str, Any]:
    """The scalar options as the functions take them (the schemas' 0 is "none")."""
    return {
        "block_size": block_size,
        "causal": causal,
        "window": None if window == 0 else window,
        "chunk": None if chunk == 0 else chunk,
        "scale": scale,
        "soft_cap": None if soft_cap == 0.0 else soft_cap,
    }


def _no_compute_fake(*args: object) -> None:
    """Nothing to compute while tracing: the operators return nothing and write only
    their declared outputs."""
    return None


# torch leaves Library and its methods unannotated; what they register is checked by
# tests/kernels/test_cpu_ops.py (the schema, opcheck, fullgraph tracing).
_library: Any = torch.library
_LIB = _library.Library("attnkit", "FRAGMENT")
_LIB.define(SCHEMA)
_LIB.impl("cpu_paged_decode", cpu_paged_decode, "CPU")
_library.register_fake("attnkit::cpu_paged_decode", _no_compute_fake, lib=_LIB)


PREFILL_SCHEMA = (
    "cpu_paged_prefill(Tensor query, Tensor? k_plane, Tensor? v_plane, Tensor? block_table, "
    "Tensor requests, Tensor query_start, Tensor query_lens, Tensor seq_lens, "
    "Tensor(a!) output, Tensor(b!)? lse, SymInt block_size, bool causal, SymInt window, "
    "SymInt chunk, float scale, float soft_cap, Tensor? alibi_slopes, Tensor? key, "
    "Tensor? value, Tensor? sinks, Tensor? k_scale, Tensor? v_scale) -> ()"
)
"""The prefill operator's schema (``attnkit::`` namespace)."""


def _host_ints(name: str, t: Tensor) -> Any:
    """An int64 CPU vector as the numpy array :func:`paged_prefill` takes (no copy)."""
    if t.dtype != torch.int64 or t.dim() != 1 or t.device.type != "cpu":
        raise ValueError(
            f"{name}: expected a 1-D int64 tensor on cpu, got {t.dtype} {list(t.shape)} "
            f"on {t.device}"
        )
    return t.contiguous().numpy()


def cpu_paged_prefill(
    query: Tensor,
    k_plane: Tensor | None,
    v_plane: Tensor | None,
    block_table: Tensor | None,
    requests: Tensor,
    query_start: Tensor,
    query_lens: Tensor,
    seq_lens: Tensor,
    output: Tensor,
    lse: Tensor | None,
    block_size: int,
    causal: bool,
    window: int,
    chunk: int,
    scale: float,
    soft_cap: float,
    alibi_slopes: Tensor | None,
    key: Tensor | None,
    value: Tensor | None,
    sinks: Tensor | None,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> None:
    """The prefill operator's CPU kernel, :func:`paged_prefill`: writes the served rows of
    ``output`` (and ``lse``). The per-request vectors are int64 CPU tensors (the
    function's numpy arrays); the scalar options take 0 for "none", as
    :func:`cpu_paged_decode`'s."""
    paged_prefill(
        query,
        k_plane,
        v_plane,
        block_table,
        _host_ints("requests", requests),
        _host_ints("query_start", query_start),
        _host_ints("query_lens", query_lens),
        _host_ints("seq_lens", seq_lens),
        output=output,
        alibi_slopes=alibi_slopes,
        **_options(block_size, causal, window, chunk, scale, soft_cap),
        key=key,
        value=value,
        sinks=sinks,
        lse=lse,
        k_scale=k_scale,
        v_scale=v_scale,
    )


_LIB.define(PREFILL_SCHEMA)
_LIB.impl("cpu_paged_prefill", cpu_paged_prefill, "CPU")
_library.register_fake("attnkit::cpu_paged_prefill", _no_compute_fake, lib=_LIB)
"""``torch.ops.attnkit.cpu_paged_prefill``: the CPU blocked prefill as a torch operator."""
