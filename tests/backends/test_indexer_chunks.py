"""The indexer scores a step in chunks of query tokens when its logits would pass the
budget (``IndexerKernelImpl.logits_budget_bytes``): the selection is the same as one
call's, chunks cut requests anywhere, and no logits call passes the budget.

The reference for the selection is a dense float64 oracle written here: each query
token's scores over every position it sees, from the dequantised index keys, the
``index_topk`` best (ties to the earlier position)."""

from __future__ import annotations

import pytest
import torch

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    ScheduledRequest,
    StepBatch,
)
from attnkit.backends import _indexer
from attnkit.kernels.dsa.reference import dequantize_index_rows, quantize_index_keys
from attnkit.spec import IndexerSpec, MLAAttentionSpec

HEADS, DIM, TOPK, BS = 2, 128, 4, 16
STEPS = [[("a", 13), ("b", 7)], [("a", 6), ("c", 9)], [("a", 1), ("b", 1), ("c", 1)]]


def _runtime(backend: str) -> AttentionRuntime:
    specs = {
        "mla": MLAAttentionSpec(block_size=BS, head_size=24, dtype=torch.float32),
        "mla.indexer": IndexerSpec(
            block_size=BS, head_size=DIM, dtype=torch.float32, index_topk=TOPK
        ),
    }
    params = {
        "mla": AttentionLayerParams(num_heads=2, v_head_size=16, scale=0.2, index_topk=TOPK),
        "mla.indexer": AttentionLayerParams(num_heads=HEADS),
    }
    return AttentionRuntime(
        specs,
        AttentionConfig(backend_per_kind={"indexer": backend, "mla_attention": backend}),
        device="cpu",
        memory_budget_bytes=1 << 22,
        layer_params=params,
    )


def _run(backend: str, budget: int, sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Each step's selection (global slots), recording each logits call's shape."""
    runtime = _runtime(backend)
    impl = runtime._attention_impls["mla.indexer"]
    assert isinstance(impl, _indexer.IndexerKernelImpl)
    impl.logits_budget_bytes = budget
    own = impl._logits

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        logits = own(*args, **kwargs)
        sizes.append((logits.shape[0], logits.shape[1]))
        return logits

    impl._logits = recording  # type: ignore[method-assign]  # (an instance attribute: recorded)
    gen = torch.Generator().manual_seed(0)
    out: list[torch.Tensor] = []
    keys: dict[str, list[torch.Tensor]] = {}
    for step in STEPS:
        batch = runtime.begin_step([ScheduledRequest(r, n) for r, n in step])
        t = batch.num_tokens
        qi = torch.randn(t, HEADS, DIM, generator=gen)
        ki = torch.randn(t, 1, DIM, generator=gen)
        w = torch.randn(t, HEADS, generator=gen)
        sel = runtime.select("mla.indexer", qi, ki, w)
        out.append(sel.indices.clone())
        _check_oracle(batch, qi, ki, w, sel.indices, keys, runtime)
    return out


def _check_oracle(
    batch: StepBatch,
    qi: torch.Tensor,
    ki: torch.Tensor,
    w: torch.Tensor,
    slots: torch.Tensor,
    keys: dict[str, list[torch.Tensor]],
    runtime: AttentionRuntime,
) -> None:
    """Each token's selection against dense float64 scores over its request's history."""
    stored = dequantize_index_rows(quantize_index_keys(ki[:, 0])).double()  # what the cache holds
    row = 0
    for rid, n in zip(batch.order, batch.query_lens, strict=True):
        history = keys.setdefault(rid, [])
        start = len(history)
        history.extend(stored[row : row + n])
        table = runtime.block_table("mla", rid)
        for i in range(n):
            pos = start + i
            seen = torch.stack(history[: pos + 1])  # [pos + 1, D]
            scores = torch.relu(qi[row + i].double() @ seen.T)  # [H, pos + 1]
            total = (scores * w[row + i].double()[:, None]).sum(dim=0)
            ranked = sorted(range(pos + 1), key=lambda s: (-float(total[s]), s))
            kept = sorted(ranked[:TOPK])
            expected = [table[s // BS] * BS + s % BS for s in kept]
            got = [int(x) for x in slots[row + i] if int(x) >= 0]
            assert got == expected, f"{rid} token {pos}: {got} != {expected}"
        row += n


@pytest.mark.parametrize("backend", ["reference", "triton_mla"])
@pytest.mark.parametrize("rows_per_chunk", [1, 3, 8])
def test_chunked_selection_equals_the_oracle_within_the_budget(
    backend: str, rows_per_chunk: int
) -> None:
    longest = 13 + 6  # request a's context at the second step
    budget = rows_per_chunk * 4 * longest
    sizes: list[tuple[int, int]] = []
    chunked = _run(backend, budget, sizes)
    assert all(r * c * 4 <= budget or r == 1 for r, c in sizes)
    assert len(sizes) > len(STEPS)  # some step was chunked
    whole_sizes: list[tuple[int, int]] = []
    whole = _run(backend, 1 << 30, whole_sizes)
    assert len(whole_sizes) == len(STEPS)
    for a, b in zip(chunked, whole, strict=True):
        assert torch.equal(a, b)


def _chunks_without_the_cut(
    md: _indexer.IndexerMetadata, n: int, budget: int
) -> list[_indexer._Chunk]:
    """A chunking that keeps each request's whole context length: the chunk's tokens
    take positions past their own, so they see tokens after them."""
    chunks = _own_chunks(md, n, budget)
    return [
        _indexer._Chunk(
            c.start,
            c.end,
            c.requests,
            c.query_start_loc,
            md.seq_lens[c.requests] if isinstance(c.requests, torch.Tensor) else c.seq_lens,
            md.max_seq_len,
        )
        for c in chunks
    ]


_own_chunks = _indexer._chunks


def test_a_chunk_that_keeps_the_whole_context_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_indexer, "_chunks", _chunks_without_the_cut)
    with pytest.raises(AssertionError, match="token"):
        _run("reference", 4 * 19 * 2, [])
