"""Ahead-of-time compile report of the Triton kernels for NVIDIA targets (no GPU needed).

Every kernel variant is derived from the launchers themselves: each declared case calls
the real launcher (``unified_attention``, ``ssd_chunked_varlen``, ...) with small CPU
tensors while the module's ``@triton.jit`` kernels are swapped for a recorder, so the
launcher's own checks and constexpr / tile / warp choices run unchanged and every
``kernel[grid](...)`` call is captured. Triton's own binder then turns each call into the
signature, constexprs, alignment attributes and options a GPU launch would compile
with, and ``triton.compile`` builds it for each target (sm_80, sm_90, sm_100).

For each variant x target the report records: status (or the compile error), registers,
spill (stack) bytes, shared memory (and whether it exceeds the per-block limit),
num_warps / num_stages and the number of tensor-core instructions in the SASS (from the
``cuobjdump`` shipped in Triton's NVIDIA backend).

Per-block shared-memory limits (maximum shared memory per thread block, opt-in): 163 KB
on compute capability 8.0, 227 KB on 9.0 and 10.0 -- NVIDIA, CUDA C++ Programming Guide,
"Compute Capabilities", technical specifications table:
https://docs.nvidia.com/cuda/cuda-programming-guide/05-appendices/compute-capabilities.html

    python benchmarks/compile_report.py [--full] [--targets 80,90,100] [--out DIR]
                                        [--only SUBSTR] [--jobs N] [--report-only]

Exit status: 1 on any compile failure, register spill or shared memory over the limit
(0 with ``--report-only``); 2 when Triton's NVIDIA backend tools are missing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction

KMOD = "attnkit.kernels"
# Maximum shared memory per thread block in bytes (see the module docstring).
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024}
DEFAULT_TARGETS = (80, 90, 100)
# Tensor-core (matrix multiply-accumulate) SASS opcodes: Volta..Ampere HMMA/IMMA,
# Hopper warpgroup GMMA, Blackwell tcgen05 UTC*MMA.
TC_OPCODE = re.compile(r"\b(?:HMMA|IMMA|BMMA|DMMA|HGMMA|IGMMA|QGMMA|BGMMA|UTC\w*MMA)\b")
RESOURCE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")

# --------------------------------------------------------------------------- tools


def nvidia_bin() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def missing_tools() -> str | None:
    """Why AOT compilation for NVIDIA cannot run here, or None when it can."""
    for tool in ("ptxas", "cuobjdump"):
        path = nvidia_bin() / tool
        if not os.access(path, os.X_OK):
            return f"Triton's NVIDIA backend tool {tool} is missing ({path})"
    return None


# --------------------------------------------------------------------------- recording


@dataclasses.dataclass
class Launch:
    """One recorded ``kernel[grid](*args, **kwargs)`` call of a launcher."""

    kernel: str  # launcher module and name, e.g. "attention.triton._unified_attention_kernel"
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _Recorder:
    def __init__(self, name: str, sink: list[Launch]) -> None:
        self._name = name
        self._sink = sink

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self._sink.append(Launch(self._name, args, kwargs))

        return launch


@contextlib.contextmanager
def recording(*module_names: str) -> Iterator[list[Launch]]:
    """Swap every ``@triton.jit`` function in the namespace of ``attnkit.kernels.<module_name>``
    (for each name given: a launcher module, e.g. ``"attention.triton"``, whose kernels
    are looked up there when it launches them) for a recorder while the block runs;
    yields the list the launches land in."""
    sink: list[Launch] = []
    saved: list[tuple[Any, str, JITFunction[Any]]] = []
    try:
        for module_name in module_names:
            module = importlib.import_module(f"{KMOD}.{module_name}")
            for name, fn in list(vars(module).items()):
                if isinstance(fn, JITFunction):
                    saved.append((module, name, fn))
                    setattr(module, name, _Recorder(f"{module_name}.{name}", sink))
        yield sink
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def kernel_fn(kernel: str) -> JITFunction[Any]:
    module_name, attr = kernel.rsplit(".", 1)
    fn = getattr(importlib.import_module(f"{KMOD}.{module_name}"), attr)
    assert isinstance(fn, JITFunction), kernel
    return fn


# --------------------------------------------------------------------------- cases

DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
FP8 = torch.float8_e4m3fn


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _attention_batch(q_len: int, ctx: int, bs: int) -> dict[str, Any]:
    blocks = triton.cdiv(ctx, bs)
    return {
        "query_start_loc": _i32([0, q_len]),
        "seq_lens": _i32([ctx]),
        "block_table": torch.zeros(1, blocks, dtype=torch.int32),
        "max_query_len": q_len,
        "max_seq_len": ctx,
        "scale": 0.125,
    }


def _attention_tensors(
    p: dict[str, Any], q_len: int, hq: int = 8
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """8 query heads over ``p["kv_heads"]`` KV heads (default 2: groups of 4; 8 is
    triton_mla's up-projected prefill, one query head per KV head)."""
    dtype, d, bs = DT[p["dtype"]], p["head"], p["block"]
    hkv = p.get("kv_heads", 2)
    query = torch.zeros(q_len, hq, d, dtype=dtype)
    cache, extra = _kv_cache(p["kv"], bs, hkv, d, dtype)
    return query, cache, extra


def _kv_cache(
    kv: str, bs: int, hkv: int, d: int, dtype: torch.dtype
) -> tuple[torch.Tensor, dict[str, Any]]:
    """A 4-block cache of case ``kv`` and its scale arguments: ``same`` (the model
    dtype), ``fp8`` (per-tensor scales), ``fp8_head`` (one scale per K/V head),
    ``fp8_tok`` / ``int8_tok`` (per-token-head scales beside the cache)."""
    cache_dtype = {"same": dtype, "int8_tok": torch.int8}.get(kv, FP8)
    cache = torch.zeros(4, 2, bs, hkv, d, dtype=cache_dtype)
    if kv == "fp8":
        return cache, {"k_scale": torch.ones(1), "v_scale": torch.ones(1)}
    if kv == "fp8_head":
        return cache, {"k_scale": torch.ones(hkv), "v_scale": torch.ones(hkv)}
    if kv in ("fp8_tok", "int8_tok"):
        return cache, {"kv_scales": torch.ones(4, 2, bs, hkv)}
    return cache, {}


def run_unified(p: dict[str, Any]) -> None:
    from attnkit.kernels.attention.triton_unified import unified_attention

    q_len = p["q_len"]
    query, cache, extra = _attention_tensors(p, q_len)
    batch = _attention_batch(q_len, max(q_len, 4 * p["block"]), p["block"])
    if "shard" in p:
        _run_shard(p, query, cache, batch, extra, num_splits=0)
        return
    if "tree" in p:
        _run_tree(p, query, cache, batch, extra, num_splits=0)
        return
    if "mm_prefix" in p:
        _run_mm_prefix(p, query, cache, batch, extra)
        return
    unified_attention(query, cache, **batch, **extra)


def _run_mm_prefix(
    p: dict[str, Any],
    query: torch.Tensor,
    cache: torch.Tensor,
    batch: dict[str, Any],
    extra: dict[str, Any],
) -> None:
    """A prefill with bidirectional image ranges on a sliding-window layer (the one-pass
    kernel's MM_PREFIX path: each query's last visible key read from a tensor), as
    ``triton_attn`` runs a Gemma 3 image prompt."""
    from attnkit.kernels.attention.triton import paged_attention
    from attnkit.kernels.attention.triton_plan import plan_paged_attention

    q_len, ctx = batch["max_query_len"], batch["max_seq_len"]
    plan = plan_paged_attention(
        batch["query_start_loc"],
        batch["seq_lens"],
        batch["block_table"],
        max_query_len=q_len,
        max_seq_len=ctx,
        block_size=p["block"],
        num_kv_heads=cache.shape[3],
        sliding_window=32,
        num_splits=0,
        mm_prefix_key_ends=_i32([ctx - q_len + t + 1 for t in range(q_len)]),
    )
    paged_attention(query, cache, plan, scale=batch["scale"], **extra)


def run_split_kv(p: dict[str, Any]) -> None:
    from attnkit.kernels.attention.triton_split_kv import split_kv_decode

    q_len = 1 + p.get("tree", 0)
    query, cache, extra = _attention_tensors(p, q_len)
    batch = _attention_batch(q_len, 4 * p["block"], p["block"])
    if "shard" in p:
        _run_shard(p, query, cache, batch, extra, num_splits=p["splits"])
        return
    if "tree" in p:
        _run_tree(p, query, cache, batch, extra, num_splits=p["splits"])
        return
    split_kv_decode(query, cache, **batch, num_splits=p["splits"], lse=torch.zeros(1, 8), **extra)


def _run_shard(
    p: dict[str, Any],
    query: torch.Tensor,
    cache: torch.Tensor,
    batch: dict[str, Any],
    extra: dict[str, Any],
    *,
    num_splits: int,
) -> None:
    """A decode context-parallel shard (rank 1 of ``p["shard"]``): the same launch with the
    kernels' SHARDED path (local keys, global query positions) and the lse stored, as
    ``triton_attn``'s ``forward_partial`` runs it."""
    from attnkit.kernels.attention.triton import paged_attention
    from attnkit.kernels.attention.triton_plan import plan_paged_attention

    size = p["shard"]
    total = batch["max_seq_len"]
    local = -(-(total - 1) // size)
    plan = plan_paged_attention(
        batch["query_start_loc"],
        _i32([local]),
        batch["block_table"],
        max_query_len=batch["max_query_len"],
        max_seq_len=local,
        block_size=p["block"],
        num_kv_heads=cache.shape[3],
        num_splits=num_splits,
        context_shard=(1, size),
        global_seq_lens=_i32([total]),
    )
    lse = torch.zeros(query.shape[0], query.shape[1])
    paged_attention(query, cache, plan, scale=batch["scale"], lse=lse, **extra)


def _run_tree(
    p: dict[str, Any],
    query: torch.Tensor,
    cache: torch.Tensor,
    batch: dict[str, Any],
    extra: dict[str, Any],
    *,
    num_splits: int,
) -> None:
    """A verify step of a draft tree of ``p["tree"]`` tokens (the kernels' USE_TREE
    path), as ``triton_attn`` runs one."""
    from attnkit.kernels.attention.triton import paged_attention
    from attnkit.kernels.attention.triton_plan import plan_paged_attention

    plan = plan_paged_attention(
        batch["query_start_loc"],
        batch["seq_lens"],
        batch["block_table"],
        max_query_len=batch["max_query_len"],
        max_seq_len=batch["max_seq_len"],
        block_size=p["block"],
        num_kv_heads=cache.shape[3],
        num_splits=num_splits,
    )
    paged_attention(
        query,
        cache,
        plan,
        scale=batch["scale"],
        draft_ancestors=torch.zeros(query.shape[0], dtype=torch.int64),
        draft_counts=_i32([p["tree"]]),
        **extra,
    )


def run_merge(p: dict[str, Any]) -> None:
    from attnkit.kernels.merge.triton import merge_attn_states

    out = torch.zeros(4, p["heads"], p["head"], dtype=DT[p["dtype"]])
    lse = torch.zeros(4, p["heads"])
    merge_attn_states(out, lse, out.clone(), lse.clone(), output_lse=lse.clone())


def run_kv_write(p: dict[str, Any]) -> None:
    from attnkit.kernels.attention.triton_kv_write import write_kv_cache

    dtype = DT[p["dtype"]]
    key = torch.zeros(4, 2, p["head"], dtype=dtype)
    cache, extra = _kv_cache(p["kv"], p["block"], 2, p["head"], dtype)
    write_kv_cache(key, key.clone(), cache, torch.arange(4), **extra)


def run_mla(p: dict[str, Any]) -> None:
    """DeepSeek-V3's absorbed MLA (128 heads, latent 576 = kv_lora_rank 512 + rope 64):
    decode (``q_len`` 1) on the split-KV path with ``splits`` splits, longer queries in
    one pass; plus the latent write of the step's tokens."""
    from attnkit.kernels.attention.triton_plan import plan_paged_attention
    from attnkit.kernels.mla.triton import mla_attention, write_mla_latents

    dtype, bs, q_len = DT[p["dtype"]], p["block"], p["q_len"]
    query = torch.zeros(q_len, 128, 576, dtype=dtype)
    cache = torch.zeros(4, bs, 576, dtype=FP8 if p["kv"] == "fp8" else dtype)
    batch = _attention_batch(q_len, max(q_len, 4 * bs), bs)
    plan = plan_paged_attention(
        batch["query_start_loc"],
        batch["seq_lens"],
        batch["block_table"],
        max_query_len=q_len,
        max_seq_len=batch["max_seq_len"],
        block_size=bs,
        num_kv_heads=1,
        num_splits=p.get("splits", 0),
    )
    kv_scale = torch.ones(1) if p["kv"] == "fp8" else None
    write_mla_latents(query[:, 0], cache, torch.arange(q_len), kv_scale=kv_scale)
    mla_attention(query, cache, plan, kv_lora_rank=512, scale=0.1, kv_scale=kv_scale)


def run_dsa(p: dict[str, Any]) -> None:
    """DeepSeek-V3.2 sparse attention at its sizes: the index-key write (128 values + one
    scale per token), indexer logits (64 heads x 128 over fp8 rows), top-2048 selection,
    and sparse MLA (128 heads, latent 512 + 64) over 2048 selected slots."""
    from attnkit.kernels.dsa.triton import (
        indexer_logits,
        sparse_mla_attention,
        topk_select,
        write_index_cache,
    )

    dtype, bs, op = DT[p["dtype"]], p["block"], p["op"]
    qsl, seq = _i32([0, 1, 2]), _i32([4 * bs, 4 * bs])
    table = torch.zeros(2, 4, dtype=torch.int32)
    cache = torch.zeros(8, bs, 132, dtype=torch.uint8)
    if op == "write":
        write_index_cache(torch.zeros(2, 128, dtype=dtype), cache, torch.arange(2))
    elif op == "logits":
        q, w = torch.zeros(2, 64, 128, dtype=dtype), torch.zeros(2, 64)
        indexer_logits(
            q, w, cache, query_start_loc=qsl, seq_lens=seq, block_table=table, max_seq_len=4 * bs
        )
    elif op == "topk":
        topk_select(
            torch.zeros(2, 4 * bs), query_start_loc=qsl, seq_lens=seq, block_table=table,
            block_size=bs, topk=2048,
        )
    else:
        q = torch.zeros(2, 128, 576, dtype=dtype)
        latents = torch.zeros(8, bs, 576, dtype=dtype)
        idx, lens = torch.zeros(2, 2048, dtype=torch.int32), _i32([2048, 2048])
        sparse_mla_attention(q, latents, idx, lens, kv_lora_rank=512, scale=0.1)


def _varlen(tokens: int) -> dict[str, Any]:
    return {
        "query_start_loc": _i32([0, tokens]),
        "state_indices": _i32([0]),
        "has_initial_state": torch.ones(1, dtype=torch.bool),
    }


def run_conv1d(p: dict[str, Any]) -> None:
    from attnkit.kernels.conv1d import triton as conv1d

    dtype, c, w, t = DT[p["dtype"]], p["channels"], p["width"], p["tokens"]
    weight = torch.zeros(c, w, dtype=dtype)
    states = torch.zeros(2, c, w - 1, dtype=dtype)
    x = torch.zeros(t, c, dtype=dtype)
    bias = torch.zeros(c, dtype=dtype)
    if p["mode"] == "varlen":
        conv1d.causal_conv1d_varlen(x, weight, bias, conv_states=states, **_varlen(t))
    else:
        conv1d.causal_conv1d_update(
            x[:1], weight, bias, conv_states=states, state_indices=_i32([0])
        )


def run_short_conv(p: dict[str, Any]) -> None:
    from attnkit.kernels.short_conv import triton as short_conv

    dtype, c, w, t = DT[p["dtype"]], p["channels"], p["width"], p["tokens"]
    weight = torch.zeros(c, w, dtype=dtype)
    states = torch.zeros(2, c, w - 1, dtype=dtype)
    x = torch.zeros(t, c, dtype=dtype)
    if p["mode"] == "varlen":
        short_conv.short_conv_varlen(
            x, x.clone(), x.clone(), weight, conv_states=states, **_varlen(t)
        )
    else:
        x = x[:1]
        short_conv.short_conv_update(
            x, x.clone(), x.clone(), weight, conv_states=states, state_indices=_i32([0])
        )


def run_gated_delta(p: dict[str, Any]) -> None:
    from attnkit.kernels.gated_delta import triton as gated_delta

    dtype, h, k, v = DT[p["dtype"]], 2, p["key"], p["value"]
    # key_heads < h: value heads share key heads (Qwen3-Next: 16 key, 32 value heads).
    hk = p.get("key_heads", h)
    t = p["tokens"] if p["mode"] == "varlen" else 1
    q = torch.zeros(t, hk, k, dtype=dtype)
    vv = torch.zeros(t, h, v, dtype=dtype)
    g = torch.zeros(t, h, dtype=dtype)
    states = torch.zeros(2, h, k, v)
    if p["mode"] == "varlen":
        gated_delta.chunk_gated_delta_rule_varlen(
            q,
            q.clone(),
            vv,
            g,
            g.clone(),
            scale=0.1,
            states=states,
            chunk_size=p["chunk"],
            **_varlen(t),
        )
    else:
        gated_delta.fused_recurrent_gated_delta_rule_update(
            q, q.clone(), vv, g, g.clone(), scale=0.1, states=states, state_indices=_i32([0])
        )


def run_linear_attention(p: dict[str, Any]) -> None:
    from attnkit.kernels.linear_attention import triton as linear_attention

    dtype, h, k, v = DT[p["dtype"]], 2, p["key"], p["value"]
    t = p["tokens"] if p["mode"] == "varlen" else 1
    q = torch.zeros(t, h, k, dtype=dtype)
    vv = torch.zeros(t, h, v, dtype=dtype)
    decay = torch.ones(h)
    states = torch.zeros(2, h, k, v)
    if p["mode"] == "varlen":
        linear_attention.chunk_linear_attention_varlen(
            q,
            q.clone(),
            vv,
            decay,
            scale=0.1,
            states=states,
            chunk_size=p["chunk"],
            **_varlen(t),
        )
    else:
        linear_attention.linear_attention_decode(
            q, q.clone(), vv, decay, scale=0.1, states=states, state_indices=_i32([0])
        )


def run_mamba2(p: dict[str, Any]) -> None:
    from attnkit.kernels.mamba2 import triton as mamba2

    dtype, h, hd, n = DT[p["dtype"]], 4, p["head"], p["state"]
    t = p["tokens"] if p["mode"] == "varlen" else 1
    x = torch.zeros(t, h, hd, dtype=dtype)
    dt = torch.zeros(t, h, dtype=dtype)
    a = -torch.ones(h)
    bc = torch.zeros(t, 1, n, dtype=dtype)
    states = torch.zeros(2, h, hd, n)
    common: dict[str, Any] = {
        "D": torch.ones(h),
        "dt_bias": torch.zeros(h),
        "dt_softplus": True,
        "ssm_states": states,
    }
    if p["mode"] == "varlen":
        mamba2.ssd_chunked_varlen(
            x, dt, a, bc, bc.clone(), chunk_size=p["chunk"], **common, **_varlen(t)
        )
    else:
        mamba2.selective_state_update(x, dt, a, bc, bc.clone(), state_indices=_i32([0]), **common)


def run_mamba1(p: dict[str, Any]) -> None:
    from attnkit.kernels.mamba1 import triton as mamba1

    dtype, d, n = DT[p["dtype"]], p["channels"], p["state"]
    t = p["tokens"] if p["mode"] == "varlen" else 1
    x = torch.zeros(t, d, dtype=dtype)
    bc = torch.zeros(t, n, dtype=dtype)
    common: dict[str, Any] = {
        "D": torch.ones(d),
        "dt_bias": torch.zeros(d),
        "dt_softplus": True,
        "ssm_states": torch.zeros(2, d, n),
    }
    a = -torch.ones(d, n)
    if p["mode"] == "varlen":
        mamba1.selective_scan_varlen(x, x.clone(), a, bc, bc.clone(), **common, **_varlen(t))
    else:
        mamba1.selective_scan_update(
            x, x.clone(), a, bc, bc.clone(), state_indices=_i32([0]), **common
        )


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # kernel family, the row group of the report
    module: str  # launcher module under attnkit.kernels whose kernels are recorded
    run: Callable[[dict[str, Any]], None]
    default: tuple[dict[str, Any], ...]  # the small default set
    full: tuple[dict[str, Any], ...]  # added by --full
    # Further modules whose kernels the launcher reaches (e.g. a shared merge stage).
    extra_modules: tuple[str, ...] = ()


def _grid(**axes: tuple[Any, ...]) -> tuple[dict[str, Any], ...]:
    cases: list[dict[str, Any]] = [{}]
    for key, values in axes.items():
        cases = [{**c, key: v} for c in cases for v in values]
    return tuple(cases)


# Cache dtypes triton_attn may declare -> the report's case names; a new declared cache
# dtype fails loudly here until the report knows how to build its cache.
KV_CASE = {
    "auto": "same",
    "fp8_e4m3": "fp8",
    "fp8_e4m3_per_token_head": "fp8_tok",
    "int8_per_token_head": "int8_tok",
}
# Per-head static scales are a layer option on an fp8_e4m3 cache, not a cache dtype:
# the --full grid adds them beside it.
KV_EXTRA_CASES = {"fp8": ("fp8_head",)}


def representative_sizes(rule: tuple[Any, ...], cap: int = 256) -> tuple[int, ...]:
    """Sizes that stand for a declared size rule: every exact size; for a range, each
    power of two in it plus 96 and 192 (non-powers of two, padded in the kernels: the
    masks of a partial tile), where they fall in the range; for ``MultipleOf(n)``, n,
    2n and 4n up to ``cap``."""
    from attnkit.capabilities import MultipleOf, SizeRange

    sizes: set[int] = set()
    for r in rule:
        if isinstance(r, int):
            sizes.add(r)
        elif isinstance(r, SizeRange):
            p = 1
            while p <= r.high:
                if p >= r.low:
                    sizes.add(p)
                p *= 2
            sizes.update(x for x in (96, 192) if r.low <= x <= r.high)
        elif isinstance(r, MultipleOf):
            sizes.update(m for m in (r.n, 2 * r.n, 4 * r.n) if m <= cap)
    return tuple(sorted(sizes))


def declared_attention_grid(**axes: tuple[Any, ...]) -> tuple[dict[str, Any], ...]:
    """Every combination triton_attn declares (model dtypes, cache dtypes, exact block
    sizes, representative head sizes) times ``axes``: the ``--full`` attention set, read
    from the backend so a newly declared size or dtype is compiled without editing
    this file. Combinations the backend refuses on a target (fp8 below sm_89) are
    reported as not declared there."""
    from attnkit.backends.triton_attn import TritonAttentionBackend as backend

    dtypes = tuple(name for name, dt in DT.items() if dt in backend.supported_dtypes)
    kvs = tuple(
        case
        for k in sorted(backend.supported_kv_cache_dtypes)
        for case in (KV_CASE[k], *KV_EXTRA_CASES.get(KV_CASE[k], ()))
    )
    blocks = tuple(b for b in backend.supported_block_sizes if isinstance(b, int))
    heads = representative_sizes(backend.supported_head_sizes)
    return _grid(head=heads, dtype=dtypes, kv=kvs, block=blocks, **axes)


def _attn(**kw: Any) -> dict[str, Any]:
    return {"dtype": "fp16", "kv": "same", "block": 16, **kw}


# Decode context-parallel shards (the kernels' SHARDED path): every model dtype, the
# common head sizes, both cache dtypes, a small and a large block, decode and prefill.
_SHARD_GRID = _grid(
    head=(64, 128, 256),
    dtype=("fp32", "fp16", "bf16"),
    kv=("same", "fp8"),
    block=(16, 64),
    q_len=(1, 128),
    shard=(2,),
)


FAMILIES: tuple[Family, ...] = (
    Family(
        "unified_attention",
        "attention.triton",
        run_unified,
        default=(
            *(_attn(head=d, q_len=128) for d in (64, 128, 256)),
            _attn(head=128, q_len=1),
            _attn(head=128, q_len=128, dtype="bf16", block=64),
            _attn(head=128, q_len=128, kv="fp8"),
            # Per-head static scales, and per-token-head int8 and fp8 caches.
            _attn(head=128, q_len=128, kv="fp8_head"),
            _attn(head=128, q_len=128, kv="int8_tok"),
            _attn(head=128, q_len=1, dtype="bf16", kv="fp8_tok"),
            # triton_mla's up-projected prefill at DeepSeek-V3 widths: keys 128 + 64,
            # one query head per KV head.
            _attn(head=192, q_len=128, dtype="bf16", block=64, kv_heads=8),
            # A decode context-parallel shard (forward_partial): chunked prefill, bf16.
            _attn(head=128, q_len=128, dtype="bf16", shard=2),
            # A draft tree's verify step (the ancestor mask in the key tile).
            _attn(head=128, q_len=8, dtype="bf16", tree=7),
            # Bidirectional image ranges (Gemma 3) on a window layer, bf16 and fp16.
            _attn(head=256, q_len=128, dtype="bf16", mm_prefix=1),
            _attn(head=128, q_len=128, mm_prefix=1),
        ),
        full=(
            *declared_attention_grid(q_len=(1, 128)),
            *_grid(
                head=(192,),
                dtype=("fp32", "fp16", "bf16"),
                kv=("same",),
                block=(16, 32, 64, 128),
                q_len=(128,),
                kv_heads=(8,),
            ),
            *_SHARD_GRID,
        ),
    ),
    Family(
        "split_kv_decode",
        "attention.triton",
        run_split_kv,
        default=(
            _attn(head=128, splits=4),
            _attn(head=256, splits=4, kv="fp8"),
            _attn(head=128, splits=4, kv="fp8_head"),
            _attn(head=128, splits=4, dtype="bf16", kv="int8_tok"),
            _attn(head=128, splits=4, kv="fp8_tok"),
            _attn(head=128, splits=4, dtype="bf16", shard=4),
            _attn(head=128, splits=4, dtype="bf16", tree=7),
        ),
        full=(
            *declared_attention_grid(splits=(4,)),
            *({**c, "splits": 4} for c in _SHARD_GRID if c["q_len"] == 1),
        ),
    ),
    Family(
        "mla_attention",
        "mla.triton",
        run_mla,
        default=(
            {"dtype": "bf16", "kv": "same", "block": 64, "q_len": 1, "splits": 4},
            {"dtype": "bf16", "kv": "same", "block": 64, "q_len": 128},
            {"dtype": "bf16", "kv": "fp8", "block": 64, "q_len": 1, "splits": 4},
        ),
        full=(
            *(
                {**c, "splits": 4} if c["q_len"] == 1 else c
                for c in _grid(
                    dtype=("fp16", "bf16"), kv=("same", "fp8"), block=(16, 32, 64), q_len=(1, 128)
                )
            ),
            {"dtype": "fp32", "kv": "same", "block": 16, "q_len": 128},
        ),
        # The split-KV merge is paged attention's (merge_split_kv).
        extra_modules=("attention.triton",),
    ),
    Family(
        "dsa",
        "dsa.triton",
        run_dsa,
        default=_grid(op=("write", "logits", "topk", "sparse"), dtype=("bf16",), block=(64,)),
        full=_grid(op=("write", "logits", "topk", "sparse"), dtype=("fp16", "bf16"), block=(64,)),
    ),
    Family(
        "merge_attn_states",
        "merge.triton",
        run_merge,
        default=({"dtype": "fp16", "heads": 8, "head": 128},),
        full=_grid(dtype=("fp16", "bf16"), heads=(8,), head=(64, 128, 256)),
    ),
    Family(
        "kv_write",
        "attention.triton_kv_write",
        run_kv_write,
        default=(
            {"dtype": "fp16", "kv": "same", "block": 16, "head": 128},
            {"dtype": "bf16", "kv": "fp8", "block": 16, "head": 128},
            {"dtype": "bf16", "kv": "fp8_head", "block": 16, "head": 128},
            {"dtype": "bf16", "kv": "fp8_tok", "block": 16, "head": 128},
            {"dtype": "fp16", "kv": "int8_tok", "block": 16, "head": 128},
        ),
        full=declared_attention_grid(),
    ),
    Family(
        "conv1d",
        "conv1d.triton",
        run_conv1d,
        default=_grid(
            mode=("varlen", "update"), dtype=("bf16",), channels=(4096,), width=(4,), tokens=(64,)
        ),
        full=_grid(
            mode=("varlen", "update"),
            dtype=("fp16", "bf16"),
            channels=(4096,),
            width=(2, 4),
            tokens=(64,),
        ),
    ),
    Family(
        "short_conv",
        "short_conv.triton",
        run_short_conv,
        default=_grid(
            mode=("varlen", "update"), dtype=("bf16",), channels=(1024,), width=(3,), tokens=(64,)
        ),
        full=_grid(
            mode=("varlen", "update"),
            dtype=("fp16", "bf16"),
            channels=(1024,),
            width=(3, 4),
            tokens=(64,),
        ),
    ),
    Family(
        "gated_delta",
        "gated_delta.triton",
        run_gated_delta,
        default=_grid(
            mode=("varlen", "update"),
            dtype=("bf16",),
            key=(128,),
            value=(128,),
            chunk=(64,),
            tokens=(128,),
            key_heads=(1, 2),
        ),
        full=_grid(
            mode=("varlen", "update"),
            dtype=("fp16", "bf16"),
            key=(64, 128, 256),
            value=(128,),
            chunk=(16, 32, 64),
            tokens=(128,),
            key_heads=(1, 2),
        ),
    ),
    Family(
        "linear_attention",
        "linear_attention.triton",
        run_linear_attention,
        default=_grid(
            mode=("varlen", "update"),
            dtype=("bf16",),
            key=(128,),
            value=(128,),
            chunk=(64,),
            tokens=(128,),
        ),
        full=_grid(
            mode=("varlen", "update"),
            dtype=("fp16", "bf16", "fp32"),
            key=(64, 128, 256),
            value=(128, 256),
            chunk=(32, 64, 128),
            tokens=(128,),
        ),
    ),
    Family(
        "mamba1",
        "mamba1.triton",
        run_mamba1,
        default=_grid(
            mode=("varlen", "update"), dtype=("bf16",), channels=(8192,), state=(16,), tokens=(64,)
        ),
        full=_grid(
            mode=("varlen", "update"),
            dtype=("fp16", "bf16", "fp32"),
            channels=(8192,),
            state=(16, 64, 256),
            tokens=(64,),
        ),
    ),
    Family(
        "mamba2",
        "mamba2.triton",
        run_mamba2,
        default=_grid(
            mode=("varlen", "update"),
            dtype=("bf16",),
            head=(64,),
            state=(128,),
            chunk=(256,),
            tokens=(256,),
        ),
        full=_grid(
            mode=("varlen", "update"),
            dtype=("fp16", "bf16", "fp32"),
            head=(64, 128),
            state=(64, 128, 256),
            chunk=(128, 256),
            tokens=(256,),
        ),
    ),
)


# Families whose kernels only the triton_attn backend launches: a case is declared for a
# target when that backend accepts the matching spec on a device of that capability.
TRITON_ATTN_FAMILIES = frozenset({"unified_attention", "split_kv_decode", "kv_write"})


def undeclared_reasons(family: str, case: dict[str, Any], cap: int) -> list[str]:
    """Why the backend launching ``family`` does not declare ``case`` on ``sm_<cap>``.

    Asked of the backend itself (``not_supported_reasons`` of a hypothetical CUDA device
    of that capability: declarations only, no device query), so a capability rule
    added to a backend is honoured here without editing the report. Empty: declared.
    MLA cases are DeepSeek-V3's latent (576 wide, one KV head) on ``triton_mla``; the
    other attention families' layers run on ``triton_attn``.
    """
    from attnkit.backend import BackendRequest
    from attnkit.backends.triton_attn import TritonAttentionBackend
    from attnkit.backends.triton_mla import TritonMLABackend
    from attnkit.spec import AttentionSpec, FullAttentionSpec, MLAAttentionSpec

    if "kv" not in case or (family != "mla_attention" and family not in TRITON_ATTN_FAMILIES):
        return []
    common: dict[str, Any] = {
        "block_size": case.get("block", 16),
        "dtype": DT[case["dtype"]],
        "kv_cache_dtype": {v: k for k, v in KV_CASE.items()}.get(
            case["kv"], "fp8_e4m3" if case["kv"] == "fp8_head" else "auto"
        ),
    }
    spec: AttentionSpec
    backend: type[TritonAttentionBackend] | type[TritonMLABackend]
    if family == "mla_attention":
        spec, backend = MLAAttentionSpec(head_size=576, **common), TritonMLABackend
    else:
        spec = FullAttentionSpec(num_kv_heads=2, head_size=case["head"], **common)
        backend = TritonAttentionBackend
    request = BackendRequest(
        spec=spec, device=torch.device("cuda"), capability=(cap // 10, cap % 10)
    )
    return backend.not_supported_reasons(request)


def case_label(p: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in p.items())


# --------------------------------------------------------------------------- variants


@dataclasses.dataclass
class Variant:
    """One distinct compilation: a kernel, its launch arguments and the cases using it."""

    family: str
    kernel: str
    launch: Launch
    cases: list[str]
    params: list[dict[str, Any]] = dataclasses.field(default_factory=list[dict[str, Any]])


def collect_variants(
    families: tuple[Family, ...], full: bool, only: str | None
) -> tuple[list[Variant], list[dict[str, Any]]]:
    """Run every case's launcher under recording; dedupe identical launches (same kernel,
    same argument types and constexprs). Returns the variants and the cases the launcher
    itself rejected (reported as errors)."""
    variants: dict[str, Variant] = {}
    rejected: list[dict[str, Any]] = []
    for fam in families:
        if only and only not in fam.name:
            continue
        cases = list(fam.default)
        if full:
            cases += [c for c in fam.full if c not in cases]
        for case in cases:
            label = case_label(case)
            with recording(fam.module, *fam.extra_modules) as launches:
                try:
                    fam.run(case)
                except Exception as exc:  # a launcher check rejected the declared case
                    rejected.append({"kernel": fam.name, "config": label, "error": repr(exc)})
                    continue
            for launch in launches:
                key = launch_key(launch)
                if key in variants:
                    variants[key].cases.append(label)
                    variants[key].params.append(case)
                else:
                    variants[key] = Variant(fam.name, launch.kernel, launch, [label], [case])
    return list(variants.values()), rejected


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor({value.dtype},align16={value.data_ptr() % 16 == 0})"
    return repr(value)


def launch_key(launch: Launch) -> str:
    fn = kernel_fn(launch.kernel)
    params = dict(zip(fn.arg_names, launch.args, strict=False)) | launch.kwargs
    # Non-constexpr ints only matter through Triton's specialisation (1, divisible by 16).
    parts = []
    for name, value in sorted(params.items()):
        runtime_int = name in fn.arg_names and type(value) is int
        if runtime_int and not fn.params[fn.arg_names.index(name)].is_constexpr:
            value = ("int", value == 1, value % 16 == 0)
        parts.append(f"{name}={_describe(value)}")
    return f"{launch.kernel}({', '.join(parts)})"


# --------------------------------------------------------------------------- compiling


@dataclasses.dataclass
class Row:
    kernel: str  # family
    function: str  # the @triton.jit function
    target: int
    config: str  # constexpr choices (upper-case names)
    cases: list[str]
    status: str = "ok"  # "ok", "error" or "undeclared" (not compiled: see error)
    error: str = ""  # the last line of the compile error (the cause)
    error_full: str = ""
    registers: int = 0
    spill_bytes: int = 0  # STACK from cuobjdump --dump-resource-usage
    local_bytes: int = 0
    shared_bytes: int = 0  # dynamic shared memory Triton requests (metadata.shared)
    smem_limit: int = 0
    smem_over: bool = False
    num_warps: int = 0
    num_stages: int = 0
    tensor_core_ops: int = 0
    # The kernel's module lists it in TENSOR_CORE_KERNELS (its work is matrix products)
    # and every case using this variant computes in a 16-bit dtype: it must show
    # tensor-core instructions.
    needs_tensor_cores: bool = False
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        if self.status == "undeclared":
            return False
        return (
            self.status != "ok"
            or self.spill_bytes > 0
            or self.smem_over
            or (self.needs_tensor_cores and self.tensor_core_ops == 0)
        )


def _config(fn: JITFunction[Any], launch: Launch) -> str:
    params = dict(zip(fn.arg_names, launch.args, strict=False)) | launch.kwargs
    # Tensor element types in argument order (e.g. bf16/fp8e4nv/i32/fp32): the kernels
    # take their compute dtypes from their pointers, not from a constexpr.
    dtypes = dict.fromkeys(
        str(params[n].dtype).removeprefix("torch.")
        for n in fn.arg_names
        if isinstance(params.get(n), torch.Tensor)
    )
    shown = [f"dtypes={'/'.join(dtypes)}"]
    for name in fn.arg_names:
        if fn.params[fn.arg_names.index(name)].is_constexpr and name in params:
            value = params[name]
            if value is False or value is None:
                continue
            shown.append(name if value is True else f"{name}={value}")
    for opt in ("num_warps", "num_stages"):
        if opt in launch.kwargs:
            shown.append(f"{opt}={launch.kwargs[opt]}")
    return " ".join(shown)


def _tool(name: str, *args: str) -> str:
    proc = subprocess.run(
        [str(nvidia_bin() / name), *args], capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} {' '.join(args)}: {proc.stderr.strip()[:500]}")
    return proc.stdout


def compile_variant(kernel: str, launch: Launch, cap: int) -> dict[str, Any]:
    """Compile one launch for ``sm_<cap>`` and read its resources; a dict of Row fields."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = kernel_fn(kernel)
    target = GPUTarget("cuda", cap, 32)
    backend = make_backend(target)
    started = time.perf_counter()
    out: dict[str, Any] = {"smem_limit": SMEM_LIMIT.get(cap, 0)}
    try:
        # The binder and _pack_args of a real launch: same signature, specialisation
        # (ints equal to 1 become constexprs, 16-byte alignment / divisibility
        # attributes) and options (num_warps, num_stages, enable_fp_fusion, ...).
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, opts = binder(*launch.args, **launch.kwargs)
        options, signature, constexprs, attrs = fn._pack_args(
            backend, launch.kwargs, bound, spec, opts
        )
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
        )
    except Exception as exc:
        text = str(exc).strip() or repr(exc)
        # Triton's CompilationError starts with the source location; the cause is last.
        cause = [line.strip() for line in text.splitlines() if line.strip()][-1]
        out.update(status="error", error=cause[:400], error_full=text[:4000])
        out["seconds"] = time.perf_counter() - started
        return out
    meta = compiled.metadata
    out.update(num_warps=meta.num_warps, num_stages=meta.num_stages, shared_bytes=meta.shared)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "kernel.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            usage = RESOURCE.search(_tool("cuobjdump", "--dump-resource-usage", str(cubin)))
            if usage is None:
                raise RuntimeError("cuobjdump --dump-resource-usage: no REG/STACK line")
            regs, stack, static_smem, local = (int(g) for g in usage.groups())
            sass = _tool("cuobjdump", "-sass", str(cubin))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        out.update(status="error", error=f"reading the cubin: {exc}"[:400])
        out["seconds"] = time.perf_counter() - started
        return out
    out.update(
        registers=regs,
        spill_bytes=stack,
        local_bytes=local,
        shared_bytes=max(meta.shared, static_smem),
        tensor_core_ops=len(TC_OPCODE.findall(sass)),
    )
    out["smem_over"] = bool(out["smem_limit"]) and out["shared_bytes"] > out["smem_limit"]
    out["seconds"] = time.perf_counter() - started
    return out


def needs_tensor_cores(v: Variant) -> bool:
    """Whether ``v`` must use tensor cores: its kernel module declares the kernel in
    ``TENSOR_CORE_KERNELS`` (work that is matrix products) and no case using the variant
    computes in float32 (float32 inputs keep IEEE float32 dots, on the FMA units, by
    design: see each kernel module's precision notes)."""
    fn = kernel_fn(v.kernel)
    # Declared where the kernel is defined (a launcher may import it from a sibling).
    module = importlib.import_module(fn.fn.__module__)
    declared: tuple[str, ...] = getattr(module, "TENSOR_CORE_KERNELS", ())
    fn_name = fn.__name__
    return fn_name in declared and all(c.get("dtype") != "fp32" for c in v.params)


def _compile_job(job: tuple[str, Launch, int]) -> dict[str, Any]:
    return compile_variant(*job)


def run_report(variants: list[Variant], targets: tuple[int, ...], jobs: int) -> list[Row]:
    rows: list[Row] = []
    work: list[tuple[str, Launch, int]] = []
    compiled: list[Row] = []
    for v in variants:
        fn = kernel_fn(v.kernel)
        for cap in targets:
            row = Row(v.family, fn.__name__, cap, _config(fn, v.launch), v.cases)
            row.needs_tensor_cores = needs_tensor_cores(v)
            rows.append(row)
            # Compiled when at least one of the cases using it is declared on the target.
            reasons = [undeclared_reasons(v.family, case, cap) for case in v.params]
            if reasons and all(reasons):
                row.status, row.error = "undeclared", "; ".join(reasons[0])
                continue
            compiled.append(row)
            work.append((v.kernel, v.launch, cap))
    if jobs > 1 and len(work) > 1:
        # spawn: a fresh interpreter per worker, no forked torch / LLVM state.
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            results = list(pool.map(_compile_job, work))
    else:
        results = [_compile_job(w) for w in work]
    for row, result in zip(compiled, results, strict=True):
        for key, value in result.items():
            setattr(row, key, value)
    return rows


# --------------------------------------------------------------------------- output

HEADER = (
    "| kernel | function | target | config | status | regs | spill B | smem B | smem limit B "
    "| warps | stages | TC ops | cases |"
)


def markdown_row(r: Row) -> str:
    status = {"ok": "ok", "undeclared": f"not declared: {r.error[:160]}"}.get(
        r.status, f"ERROR: {r.error[:160]}"
    )
    smem = f"{r.shared_bytes} OVER" if r.smem_over else str(r.shared_bytes)
    spill = f"{r.spill_bytes} SPILL" if r.spill_bytes else "0"
    cells = [
        r.kernel,
        f"`{r.function}`",
        f"sm_{r.target}",
        r.config,
        status,
        str(r.registers),
        spill,
        smem,
        str(r.smem_limit),
        str(r.num_warps),
        str(r.num_stages),
        f"{r.tensor_core_ops} NO-TC"
        if r.needs_tensor_cores and not r.tensor_core_ops
        else str(r.tensor_core_ops),
        "; ".join(r.cases),
    ]
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def summaries(rows: list[Row], rejected: list[dict[str, Any]]) -> list[str]:
    lines = []
    for fam in dict.fromkeys(r.kernel for r in rows):
        undeclared = [r for r in rows if r.kernel == fam and r.status == "undeclared"]
        mine = [r for r in rows if r.kernel == fam and r.status != "undeclared"]
        ok = [r for r in mine if r.status == "ok"]
        errors = len(mine) - len(ok)
        spills = sum(r.spill_bytes > 0 for r in ok)
        no_mma = sum(r.needs_tensor_cores and r.tensor_core_ops == 0 for r in ok)
        over = sum(r.smem_over for r in ok)
        # Functions without a single tensor-core instruction on any compiled target.
        no_tc = [
            f
            for f in dict.fromkeys(r.function for r in ok)
            if not any(r.tensor_core_ops for r in ok if r.function == f)
        ]
        regs = max((r.registers for r in ok), default=0)
        smem = max((r.shared_bytes for r in ok), default=0)
        verdict = "FAIL" if errors or spills or over or no_mma else "PASS"
        lines.append(
            f"{verdict} {fam}: {len(ok)}/{len(mine)} compiled, {errors} errors, "
            f"{spills} spilling, {over} smem over limit, {no_mma} without required "
            f"tensor-core ops, max regs {regs}, max smem {smem} B"
            + (f"; no tensor-core ops in {', '.join(no_tc)}" if no_tc else "")
            + (
                f"; {len(undeclared)} not declared by the backend (not compiled): "
                + "; ".join(sorted({f"sm_{r.target}: {r.error}" for r in undeclared}))
                if undeclared
                else ""
            )
        )
    for rej in rejected:
        lines.append(
            f"FAIL {rej['kernel']}: launcher rejected case {rej['config']}: {rej['error']}"
        )
    return lines


def write_outputs(
    out: Path, rows: list[Row], rejected: list[dict[str, Any]], meta: dict[str, Any]
) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    lines = summaries(rows, rejected)
    md = [
        "# Triton kernel compile report",
        "",
        f"triton {triton.__version__}, targets {meta['targets']}, "
        f"{'full' if meta['full'] else 'default'} set, {meta['seconds']:.0f} s.",
        "Shared-memory limits per block: CUDA C++ Programming Guide, Compute Capabilities.",
        "",
        *(f"- {line}" for line in lines),
        "",
        HEADER,
        "|" + "---|" * HEADER.count(" | ") + "---|",
        *(markdown_row(r) for r in rows),
        "",
    ]
    md_path = out / "compile_report.md"
    md_path.write_text("\n".join(md))
    json_path = out / "compile_report.json"
    payload = {
        **meta,
        "triton": triton.__version__,
        "summary": lines,
        "rejected_cases": rejected,
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    json_path.write_text(json.dumps(payload, indent=1))
    return md_path, json_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-results/compile", type=Path)
    ap.add_argument(
        "--targets",
        default=",".join(map(str, DEFAULT_TARGETS)),
        help="comma-separated compute capabilities, e.g. 80,90,100",
    )
    ap.add_argument("--full", action="store_true", help="the wider variant set")
    ap.add_argument("--only", default=None, help="only kernel families containing this")
    ap.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="parallel compile processes (default: min(2, CPUs))",
    )
    ap.add_argument("--report-only", action="store_true", help="always exit 0")
    args = ap.parse_args(argv)
    targets = tuple(int(t) for t in args.targets.split(",") if t.strip())

    if reason := missing_tools():
        print(f"compile_report: cannot compile: {reason}", file=sys.stderr)
        return 0 if args.report_only else 2
    # The launchers must see compiled (not interpreted) kernels.
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_report: TRITON_INTERPRET is set; unset it", file=sys.stderr)
        return 0 if args.report_only else 2

    started = time.perf_counter()
    variants, rejected = collect_variants(FAMILIES, args.full, args.only)
    print(f"{len(variants)} variants x {len(targets)} targets, {args.jobs} jobs", flush=True)
    rows = run_report(variants, targets, args.jobs)
    seconds = time.perf_counter() - started
    meta = {"targets": list(targets), "full": args.full, "seconds": round(seconds, 1)}
    md_path, json_path = write_outputs(args.out, rows, rejected, meta)
    for line in summaries(rows, rejected):
        print(line)
    print(f"wrote {md_path} and {json_path} in {seconds:.0f} s")
    failed = bool(rejected) or any(r.failed for r in rows)
    return 0 if args.report_only or not failed else 1


if __name__ == "__main__":
    sys.exit(main())
