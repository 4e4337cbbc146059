"""DeepSeek sparse attention: the indexer group shares its MLA group's block ids.

One allocation per request gives both groups the same block ids (over arrivals,
growth, preemption and prefix hits), each with its own page size, so a selection's
global slot ids index the latent cache as they are. Checked end to end against a dense
float64 oracle written here (scores over each request's whole history, the documented
top-k rule as a mask, softmax attention under it), and the accounting: the pool's
bytes are both caches' tensors; offloaded pages carry the index rows with the latents.
Broken variants (the indexer given its own block ids again; the slots mapped through
the table a second time; offload pages without the index rows) are shown caught.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    IndexerSpec,
    InvalidArgumentError,
    KVCacheSpec,
    MLAAttentionSpec,
    ScheduledRequest,
)
from attnkit.backends._indexer import IndexerKernelImpl, IndexerMetadata
from attnkit.kernels.dsa.reference import dequantize_index_rows, quantize_index_keys
from attnkit.kv_cache import _groups, group_layers
from attnkit.metadata import SparseSelection
from attnkit.parallel import ContextParallel

BS, RANK, ROPE, HEADS, IHEADS, IDIM, TOPK = 4, 32, 16, 2, 2, 128, 5
WIDTH = RANK + ROPE
SCALE = WIDTH**-0.5
PAIRS = ("l0", "l1")


def specs(order: str = "mla_first") -> dict[str, KVCacheSpec]:
    mla = MLAAttentionSpec(block_size=BS, head_size=WIDTH, dtype=torch.float32)
    idx = IndexerSpec(block_size=BS, head_size=IDIM, dtype=torch.float32, index_topk=TOPK)
    out: dict[str, KVCacheSpec] = {}
    for name in PAIRS:
        if order == "indexer_first":
            out[f"{name}.indexer"] = idx
            out[name] = mla
        else:
            out[name] = mla
            out[f"{name}.indexer"] = idx
    return out


def params() -> dict[str, AttentionLayerParams]:
    out: dict[str, AttentionLayerParams] = {}
    for name in PAIRS:
        out[name] = AttentionLayerParams(
            num_heads=HEADS, v_head_size=RANK, scale=SCALE, index_topk=TOPK
        )
        out[f"{name}.indexer"] = AttentionLayerParams(num_heads=IHEADS)
    return out


def make_runtime(*, caching: bool = False, order: str = "mla_first") -> AttentionRuntime:
    runtime = AttentionRuntime(
        specs(order),
        AttentionConfig(prefix_caching={"enabled": caching}),
        device="cpu",
        memory_budget_bytes=64 * 2 * (BS * WIDTH * 4 + BS * 132),
        layer_params=params(),
        cache_fill=float("nan"),
    )
    # Shuffled free blocks: ids unrelated to positions, so a wrong table shows.
    random.Random(7).shuffle(runtime.manager.pool._free)
    return runtime


def oracle_topk(scores: torch.Tensor, k: int) -> list[int]:
    """The documented rule: highest scores, ties to the earlier position; returned ascending."""
    order = sorted(range(scores.numel()), key=lambda s: (-float(scores[s]), s))
    return sorted(order[:k])


class History:
    """Each request's tokens as the oracle sees them: dequantised index keys and latents,
    per layer pair, in position order."""

    def __init__(self) -> None:
        self.keys: dict[tuple[str, str], list[torch.Tensor]] = {}
        self.latents: dict[tuple[str, str], list[torch.Tensor]] = {}

    def copy_prefix(self, src: str, dst: str, length: int) -> None:
        for name in PAIRS:
            self.keys[name, dst] = list(self.keys[name, src][:length])
            self.latents[name, dst] = list(self.latents[name, src][:length])

    def drop(self, rid: str) -> None:
        for name in PAIRS:
            self.keys.pop((name, rid), None)
            self.latents.pop((name, rid), None)


def run_step(
    runtime: AttentionRuntime,
    history: History,
    step: Sequence[ScheduledRequest],
    gen: torch.Generator,
) -> list[str]:
    """One step of every layer pair, checked against the dense oracle; the problems."""
    batch = runtime.begin_step(list(step))
    t = batch.num_tokens
    rows = batch.token_slices()
    problems: list[str] = []
    for name in PAIRS:
        q = torch.randn(t, HEADS, WIDTH, generator=gen)
        latent = torch.randn(t, 1, WIDTH, generator=gen)
        qi = torch.randn(t, IHEADS, IDIM, generator=gen)
        ki = torch.randn(t, 1, IDIM, generator=gen)
        w = torch.randn(t, IHEADS, generator=gen)
        sel = runtime.select(f"{name}.indexer", qi, ki, w)
        got = runtime.forward(name, q, latent, selection=sel)
        flat = runtime.kv_caches[name][0].view(-1, WIDTH)  # slot s is row s
        for rid in batch.order:
            rs = rows[rid]
            keys = history.keys.setdefault((name, rid), [])
            lats = history.latents.setdefault((name, rid), [])
            keys.extend(dequantize_index_rows(quantize_index_keys(ki[rs, 0])).double())
            lats.extend(latent[rs, 0].double())
            k_all, lat_all = torch.stack(keys), torch.stack(lats)
            table = runtime.block_table(name, rid)
            n = rs.stop - rs.start
            for i in range(n):
                tok, pos = rs.start + i, len(keys) - n + i
                scores = (
                    torch.relu(qi[tok].double() @ k_all[: pos + 1].T) * w[tok].double()[:, None]
                ).sum(0)
                keep = oracle_topk(scores, TOPK)
                want = [table[p // BS] * BS + p % BS for p in keep]
                have = [int(x) for x in sel.indices[tok, : int(sel.lens[tok])]]
                if have != want:
                    problems.append(f"{name} {rid} pos {pos}: slots {have}, expected {want}")
                    continue
                # The slots index the latent cache directly: the latents written there.
                if not torch.equal(flat[have].double(), lat_all[keep]):
                    problems.append(f"{name} {rid} pos {pos}: slots hold other latents")
                    continue
                logits = (q[tok].double() @ lat_all[keep].T) * SCALE
                dense = torch.softmax(logits, dim=-1) @ lat_all[keep][:, :RANK]
                err = float((got[tok].double() - dense).abs().max())
                if not err <= 1e-4:
                    problems.append(f"{name} {rid} pos {pos}: output off by {err:.3g}")
    return problems


def shared_ids_problems(runtime: AttentionRuntime) -> list[str]:
    """Every live request holds the same block ids in both groups of each pair."""
    out = []
    for rid in list(runtime.manager._rows):
        for name in PAIRS:
            mla, idx = runtime.block_table(name, rid), runtime.block_table(f"{name}.indexer", rid)
            if mla != idx:
                out.append(f"{rid}: {name} holds {mla}, its indexer {idx}")
    return out


def scenario(runtime: AttentionRuntime) -> Iterator[list[str]]:
    """Arrivals, growth across blocks, a preemption (freed, then scheduled again from
    scratch), decodes; yields each step's problems and the shared-id check."""
    gen = torch.Generator().manual_seed(3)
    history = History()
    steps: list[tuple[list[ScheduledRequest], list[str]]] = [
        ([ScheduledRequest("a", 9), ScheduledRequest("b", 3)], []),
        ([ScheduledRequest("a", 4), ScheduledRequest("b", 1), ScheduledRequest("c", 6)], []),
        ([ScheduledRequest("a", 1), ScheduledRequest("c", 1)], ["b"]),  # b preempted
        ([ScheduledRequest("b", 5), ScheduledRequest("a", 1), ScheduledRequest("c", 3)], []),
        ([ScheduledRequest("a", 1), ScheduledRequest("b", 1), ScheduledRequest("c", 1)], []),
    ]
    for step, preempted in steps:
        if preempted:
            runtime.free(preempted)
            for rid in preempted:
                history.drop(rid)
        try:
            problems = run_step(runtime, history, step, gen)
        except (IndexError, RuntimeError) as exc:  # slots past the cache, say
            problems = [f"the step failed: {type(exc).__name__}: {exc}"]
        yield problems + shared_ids_problems(runtime)


# ---------------------------------------------------------------------------- grouping


@pytest.mark.parametrize("order", ["mla_first", "indexer_first"])
def test_the_indexer_group_is_paired_with_its_mla_group(order: str) -> None:
    groups = group_layers(specs(order))
    assert [g.kind.value for g in groups] == ["mla_attention", "indexer"]
    assert [g.block_owner for g in groups] == [None, 0]
    assert groups[1].layer_names == ("l0.indexer", "l1.indexer")


def test_an_indexer_without_one_mla_group_of_its_block_size_is_refused() -> None:
    idx = IndexerSpec(block_size=BS, head_size=IDIM, dtype=torch.float32, index_topk=TOPK)
    with pytest.raises(InvalidArgumentError, match=r"'i' \(indexer\) shares block ids.*found none"):
        group_layers(
            {"i": idx, "m": MLAAttentionSpec(block_size=8, head_size=WIDTH, dtype=torch.float32)}
        )
    two = {
        "m0": MLAAttentionSpec(block_size=BS, head_size=WIDTH, dtype=torch.float32),
        "m1": MLAAttentionSpec(block_size=BS, head_size=64, dtype=torch.float32),
        "i": idx,
    }
    with pytest.raises(InvalidArgumentError, match=r"found 'm0' \(1 layer\(s\)\); 'm1'"):
        group_layers(two)


def test_context_parallelism_is_refused_for_shared_block_ids() -> None:
    class _Rank0Of2:
        rank, world_size = 0, 2

        def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
            return [tensor, tensor]

    with pytest.raises(InvalidArgumentError, match=r"context_parallel: group 1 \(indexer"):
        AttentionRuntime(
            specs(),
            AttentionConfig(),
            device="cpu",
            memory_budget_bytes=1 << 20,
            layer_params=params(),
            context_parallel=ContextParallel(_Rank0Of2()),
        )


# ---------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("order", ["mla_first", "indexer_first"])
def test_shared_ids_over_arrivals_growth_and_preemption_against_the_oracle(order: str) -> None:
    runtime = make_runtime(order=order)
    for number, problems in enumerate(scenario(runtime)):
        assert problems == [], f"step {number}"
    # One table in the manager per pair, not two.
    assert len(runtime.manager.groups) == 1


def test_a_prefix_hit_is_a_hit_for_both_caches() -> None:
    runtime = make_runtime(caching=True)
    gen = torch.Generator().manual_seed(5)
    history = History()
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks of 4
    first = runtime.match_prefix(prompt)  # tracked from here: its blocks get names
    assert first.num_tokens == 0
    assert run_step(runtime, history, [ScheduledRequest("a", len(prompt), prefix=first)], gen) == []
    a_blocks = runtime.block_table("l0", "a")[:2]
    runtime.free(["a"], token_ids={"a": prompt})
    match = runtime.match_prefix([*prompt, 7, 8])
    assert match.num_tokens == 8
    history.copy_prefix("a", "b", 8)
    problems = run_step(runtime, history, [ScheduledRequest("b", 5, prefix=match)], gen)
    assert problems == []
    assert shared_ids_problems(runtime) == []
    # b reads a's two full blocks in both caches: the same ids.
    assert runtime.block_table("l0", "b")[:2] == a_blocks
    assert runtime.block_table("l0.indexer", "b")[:2] == a_blocks
    # The hit reads a's index rows too: b's first decode selects over them.
    assert run_step(runtime, history, [ScheduledRequest("b", 1)], gen) == []
    # Both groups' pages in one namespace: the indexer group names nothing of its own.
    assert runtime.manager.cached_slabs[0] is not None
    assert len(runtime.manager.cached_slabs) == 1
    # The report's cached bytes: each named block's latents and index rows, 2 layers each.
    mla, idx = runtime.memory_report().groups
    assert mla.cached_blocks is not None
    assert mla.cached_bytes == mla.cached_blocks * 2 * (BS * WIDTH * 4 + BS * 132)
    assert (idx.cached_blocks, idx.cached_bytes) == (None, None)


def test_page_descriptors_carry_the_index_rows_with_the_latents() -> None:
    runtime = make_runtime(caching=True)
    pages = runtime.page_descriptors()
    assert [g.group_id for g in pages.groups] == [0]
    only = pages.groups[0]
    assert only.sharing_groups == (1,)
    assert only.layers == ("l0", "l1", "l0.indexer", "l1.indexer")
    assert only.page_bytes == 2 * BS * WIDTH * 4 + 2 * BS * 132
    assert pages.group(1) is only
    nb = runtime.num_blocks * only.blocks_per_page
    for t in only.tensors:
        assert t.rows_per_block == 1
        assert t.shape[0] == nb


# ---------------------------------------------------------------------------- memory


def test_the_pool_is_both_caches_tensors() -> None:
    runtime = make_runtime()
    report = runtime.memory_report()
    mla_bytes = sum(runtime.kv_caches[n][0].nbytes for n in PAIRS)
    idx_bytes = sum(runtime.kv_caches[f"{n}.indexer"][0].nbytes for n in PAIRS)
    # Each cache with its own page size: 4 x 48 x 4 B and 4 x 132 B per block and layer.
    nb = runtime.num_blocks
    assert mla_bytes == 2 * nb * BS * WIDTH * 4
    assert idx_bytes == 2 * nb * BS * 132
    assert report.total_bytes == mla_bytes + idx_bytes
    assert [g.bytes for g in report.groups] == [mla_bytes, idx_bytes]
    assert [g.block_owner for g in report.groups] == [None, 0]
    # Every tensor is contiguous: no kernel sees a strided cache.
    for name in (*PAIRS, *(f"{n}.indexer" for n in PAIRS)):
        assert runtime.kv_caches[name][0].is_contiguous()
    # The budget counts both: the pool is as large as the budget holds, no more.
    per_block = 2 * (BS * WIDTH * 4 + BS * 132)
    assert nb == 64 * 2 * (BS * WIDTH * 4 + BS * 132) // per_block
    assert "block ids of group 0" in report.describe()


def test_the_plan_counts_what_the_runtime_allocates() -> None:
    from attnkit.planner import plan_model

    runtime = make_runtime()
    plan = plan_model(
        specs(), AttentionConfig(), device="cpu", memory_bytes=runtime.memory_budget_bytes
    )
    assert plan.num_blocks == runtime.num_blocks
    assert plan.bytes_per_block * plan.num_blocks == runtime.memory_report().total_bytes


# ---------------------------------------------------------------------------- broken variants


def _separate_ids(groups: list[_groups.KVCacheGroup]) -> list[_groups.KVCacheGroup]:
    return groups  # no pairing: the indexer allocates its own block ids again


def test_broken_the_indexer_given_its_own_ids_again_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_groups, "_pair_blocks", _separate_ids)
    runtime = make_runtime()
    assert len(runtime.manager.groups) == 2  # the variant is in place
    found = [p for problems in scenario(runtime) for p in problems]
    assert any("its indexer" in p for p in found)  # the shared-id check
    assert any("slots" in p or "step failed" in p for p in found)  # and the oracle


def _mapped_twice(
    select: Callable[..., SparseSelection],
) -> Callable[..., SparseSelection]:
    def broken(
        self: IndexerKernelImpl,
        query: torch.Tensor,
        key: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: IndexerMetadata,
        selection: SparseSelection,
    ) -> SparseSelection:
        out = select(self, query, key, weights, kv_cache, attn_metadata, selection)
        # Treat the global slots as positions and map them through the table again.
        md, n = attn_metadata, attn_metadata.num_actual_tokens
        req = torch.searchsorted(md.query_start_loc[1:], torch.arange(n), right=True)
        s = out.indices[:n].long()
        width = md.block_table.shape[1]
        col = (s // BS).clamp(max=width - 1)
        again = md.block_table[req[:, None], col] * BS + s % BS
        out.indices[:n].copy_(torch.where(s >= 0, again, s).to(torch.int32))
        return out

    return broken


def test_broken_the_mapping_applied_twice_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(IndexerKernelImpl, "select", _mapped_twice(IndexerKernelImpl.select))
    found = [p for problems in scenario(make_runtime()) for p in problems]
    assert any("expected" in p for p in found)
    assert not any("its indexer" in p for p in found)  # the ids are shared; the slots are wrong


# ---------------------------------------------------------------------------- offload


def offload_scenario(runtime: AttentionRuntime) -> tuple[int, list[str]]:
    """a's prompt cached, evicted to the host tier by a request that takes every block
    (whose cache is then overwritten), and read back by b's hit: b's steps against the
    oracle over a's tokens. Returns b's hit and the problems."""
    gen = torch.Generator().manual_seed(11)
    history = History()
    prompt = list(range(200, 211))
    first = runtime.match_prefix(prompt)
    problems = run_step(runtime, history, [ScheduledRequest("a", 11, prefix=first)], gen)
    runtime.free(["a"], token_ids={"a": prompt})
    usable = runtime.manager.pool.num_blocks - 1
    runtime.begin_step([ScheduledRequest("x", usable * BS)])  # evicts every cached block
    runtime.discard_step()
    for tensors in runtime.kv_caches.values():
        for t in tensors:
            t.view(torch.uint8)[BS:].fill_(0xFF)  # NaN everywhere past the null blocks
    runtime.free(["x"])
    match = runtime.match_prefix([*prompt, 7, 8])
    history.copy_prefix("a", "b", match.num_tokens)
    problems += run_step(
        runtime, history, [ScheduledRequest("b", 13 - match.num_tokens, prefix=match)], gen
    )
    problems += run_step(runtime, history, [ScheduledRequest("b", 1)], gen)
    return match.num_tokens, problems


def offloading_runtime() -> AttentionRuntime:
    from attnkit import HostMemoryTier

    return AttentionRuntime(
        specs(),
        AttentionConfig(prefix_caching={"enabled": True}),
        device="cpu",
        memory_budget_bytes=16 * 2 * (BS * WIDTH * 4 + BS * 132),
        layer_params=params(),
        cache_fill=float("nan"),
        kv_connector=HostMemoryTier(1 << 20),
    )


def test_offloaded_pages_carry_the_index_rows_with_the_latents() -> None:
    runtime = offloading_runtime()
    hit, problems = offload_scenario(runtime)
    assert hit == 8
    assert runtime.prefix_cache_stats().offload_loads >= 2  # the hit came from the tier
    assert problems == []


def test_broken_offload_without_the_index_rows_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnkit.runtime._base import RuntimeBase

    def owners_only(self: RuntimeBase, group_id: int) -> tuple[str, ...]:
        return self._groups[group_id].group.layer_names

    monkeypatch.setattr(RuntimeBase, "_block_layers", owners_only)
    hit, problems = offload_scenario(offloading_runtime())
    assert hit == 8
    assert problems != []
