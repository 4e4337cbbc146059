"""The demo of DeepSeek sparse attention (a model whose config has ``index_topk``, such
as DeepSeek-V3.2): a shrunk layout of its layer pairs (an MLA layer and its indexer),
served by the runtime, every step checked against a dense oracle.

Per layer pair and step the runtime writes the index keys, selects (``select``) and
runs sparse MLA over the selection (``forward(..., selection=)``). The oracle, in
float64 over each request's whole history: the indexer scores of every visible
position from the stored index keys (the fp8 format is exact to dequantise), the
``index_topk`` best (ties to the earlier position) as a mask, and dense softmax
attention over the latents under that mask. A step passes when the runtime's selection
equals the oracle's and its output is within the dtype's tolerance.
"""

from __future__ import annotations

import time
from typing import TextIO

import torch

from ..config import AttentionConfig
from ..errors import InvalidArgumentError
from ..kernels.dsa.reference import dequantize_index_rows, quantize_index_keys
from ..models import ModelLayout
from ..params import AttentionLayerParams, LayerParams
from ..registry import BackendRegistry
from ..runtime import AttentionRuntime, ScheduledRequest
from ..spec import IndexerSpec, KVCacheSpec, KVCacheSpecKind, MLAAttentionSpec
from ._report import DemoResult, Tally

__all__ = ["SPARSE_DEMO_SIZES", "is_sparse", "run_sparse_demo"]

SPARSE_DEMO_SIZES = {
    "pairs": 2,
    "heads": 4,
    "kv_lora_rank": 32,
    "rope": 16,
    "index_heads": 4,
    "index_head_dim": 128,
    "index_topk": 8,
    "block_size": 4,
}
"""The shrunk layout: layer pairs, MLA heads and latent, indexer heads and width, the
selection width and the block size (the model's own kinds and pairing, small sizes)."""

_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def is_sparse(model: ModelLayout) -> bool:
    """Whether the model has DeepSeek sparse attention (indexer layers)."""
    return any(info.spec.kind is KVCacheSpecKind.INDEXER for info in model.layers.values())


def _oracle_topk(scores: torch.Tensor, k: int) -> list[int]:
    """Positions of the ``k`` best scores, ties to the earlier one, in ascending order."""
    ranked = sorted(range(scores.numel()), key=lambda s: (-float(scores[s]), s))
    return sorted(ranked[:k])


def run_sparse_demo(
    model: ModelLayout,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    decode_steps: int = 4,
    backend_per_kind: str | None = None,
    out: TextIO,
    registry: BackendRegistry | None = None,
) -> DemoResult:
    """Serve three requests (one longer than ``index_topk``, prefilled in two chunks; one
    shorter) through the runtime, checking every step (see the module doc)."""
    if not is_sparse(model):
        raise InvalidArgumentError(
            f"run_sparse_demo: model {model.model_type} has no indexer layers (no "
            f"index_topk in its config)"
        )
    if dtype not in _TOLERANCE:
        raise InvalidArgumentError(
            f"run_sparse_demo: dtype must be one of {list(_TOLERANCE)}, got {dtype}"
        )
    z = SPARSE_DEMO_SIZES
    rank, rope, heads, iheads, idim, topk, bs = (
        z["kv_lora_rank"],
        z["rope"],
        z["heads"],
        z["index_heads"],
        z["index_head_dim"],
        z["index_topk"],
        z["block_size"],
    )
    width = rank + rope
    specs: dict[str, KVCacheSpec] = {}
    params: dict[str, LayerParams] = {}
    pairs = [
        name for name, info in model.layers.items() if info.spec.kind is KVCacheSpecKind.INDEXER
    ]
    pairs = pairs[: z["pairs"]]
    mla_of = {name: name.rsplit(".", 1)[0] for name in pairs}  # "<mla>.indexer" -> "<mla>"
    for name in pairs:
        specs[mla_of[name]] = MLAAttentionSpec(block_size=bs, head_size=width, dtype=dtype)
        params[mla_of[name]] = AttentionLayerParams(
            num_heads=heads, v_head_size=rank, scale=width**-0.5, index_topk=topk
        )
        specs[name] = IndexerSpec(block_size=bs, head_size=idim, dtype=dtype, index_topk=topk)
        params[name] = AttentionLayerParams(num_heads=iheads)
    config = AttentionConfig(backend_per_kind=backend_per_kind or {})
    runtime = AttentionRuntime(
        specs,
        config,
        device=device,
        memory_budget_bytes=1 << 24,
        layer_params=params,
        registry=registry,
        cache_fill=float("nan"),
    )
    out.write(
        f"sparse attention (DSA) demo of {model.model_type}: {len(pairs)} layer pair(s) "
        f"(MLA {heads} heads, latent {rank}+{rope}; indexer {iheads} heads of {idim}, "
        f"top-{topk}), block size {bs}\n"
    )
    for row in runtime.routing_table():
        out.write(f"  {row.layer}: {row.kind.value} -> {row.backend} ({row.source})\n")
    memory = runtime.memory_report()
    for g in memory.groups:
        shared = f", block ids of group {g.block_owner}" if g.block_owner is not None else ""
        out.write(
            f"  cache group {g.group_id} ({g.kind.value}): {g.bytes} B"
            f"{shared}, block size {g.block_size}\n"
        )
    gen = torch.Generator().manual_seed(0)
    history: dict[str, dict[str, list[torch.Tensor]]] = {}
    lengths = {"long": 3 * topk + 3, "short": topk // 2, "mid": topk + 1}
    steps = [
        [("long", 2 * topk), ("short", lengths["short"])],
        [("long", topk + 3), ("mid", lengths["mid"])],
    ]
    steps += [[("long", 1), ("short", 1), ("mid", 1)]] * decode_steps
    tally = Tally(out=out, tol=_TOLERANCE[dtype])
    for step in steps:
        started = time.perf_counter()
        batch = runtime.begin_step([ScheduledRequest(rid, n) for rid, n in step])
        t = batch.num_tokens
        worst = 0.0
        for name in pairs:
            mla = mla_of[name]
            q = torch.randn(t, heads, width, generator=gen).to(device, dtype)
            latent = torch.randn(t, 1, width, generator=gen).to(device, dtype)
            qi = torch.randn(t, iheads, idim, generator=gen).to(device, dtype)
            ki = torch.randn(t, 1, idim, generator=gen).to(device, dtype)
            w = torch.randn(t, iheads, generator=gen).to(device) * iheads**-0.5
            selection = runtime.select(name, qi, ki, w)
            got = runtime.forward(mla, q, latent, selection=selection)
            worst = max(
                worst,
                _check(
                    history.setdefault(name, {}),
                    step,
                    q,
                    latent,
                    qi,
                    ki,
                    w,
                    selection.indices,
                    selection.lens,
                    got,
                    runtime,
                    mla,
                    topk,
                    width**-0.5,
                    rank,
                ),
            )
        elapsed = time.perf_counter() - started
        tally.record(", ".join(f"{r}+{n}" for r, n in step), worst, t, elapsed)
    return tally.result()


def _check(
    history: dict[str, list[torch.Tensor]],
    step: list[tuple[str, int]],
    q: torch.Tensor,
    latent: torch.Tensor,
    qi: torch.Tensor,
    ki: torch.Tensor,
    w: torch.Tensor,
    indices: torch.Tensor,
    lens: torch.Tensor,
    got: torch.Tensor,
    runtime: AttentionRuntime,
    mla: str,
    topk: int,
    scale: float,
    rank: int,
) -> float:
    """The step's worst error against the dense oracle (``inf``: a selection differs)."""
    bs = SPARSE_DEMO_SIZES["block_size"]
    worst, row = 0.0, 0
    for rid, n in step:
        table = runtime.block_table(mla, rid)
        keys = history.setdefault(f"{rid}/k", [])
        lats = history.setdefault(f"{rid}/lat", [])
        keys.extend(dequantize_index_rows(quantize_index_keys(ki[row : row + n, 0])).double())
        lats.extend(latent[row : row + n, 0].double())
        k_all, lat_all = torch.stack(keys), torch.stack(lats)
        ctx = len(keys)
        for i in range(n):
            t, p = row + i, ctx - n + i
            relu = torch.relu(qi[t].double() @ k_all[: p + 1].T)  # [H, p+1]
            scores = (relu * w[t].double()[:, None]).sum(dim=0)
            keep = _oracle_topk(scores, topk)
            want = [int(table[s // bs]) * bs + s % bs for s in keep]
            if int(lens[t]) != len(keep) or [int(x) for x in indices[t, : len(keep)]] != want:
                return float("inf")
            logits = (q[t].double() @ lat_all[keep].T) * scale  # [Hq, k]
            dense = torch.softmax(logits, dim=-1) @ lat_all[keep][:, :rank]
            worst = max(worst, float((got[t].double() - dense).abs().max()))
        row += n
    return worst
