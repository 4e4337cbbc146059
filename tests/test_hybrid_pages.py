"""A hybrid model whose state pages hold many attention blocks: attention keeps its
declared block size (16) for the kernels, one unified page holds ``blocks_per_page`` of
its kernel blocks, and every backend that runs on CPU gives what a dense recompute of
each sequence gives (``DemoModel.forward_dense``, no cache)."""

from __future__ import annotations

import random

import pytest
import torch

from attnkit import AttentionConfig, BackendRegistry
from attnkit.demo import PRIORITIES, DemoModel
from attnkit.kv_cache import NULL_BLOCK
from attnkit.registry import BUILTIN_BACKENDS
from attnkit.runtime import AttentionRuntime, ScheduledRequest

TOL = 3e-5
# Full attention, Gated DeltaNet, a window of 24 and Mamba2; one K/V head and 64-wide
# Mamba2 states: the state (23296 B) sets the page, 24576 B = 12 attention blocks of
# 2048 B (16 tokens): 192 tokens a page.
LAYOUT = ("full", "gdn", "window", "mamba")
PER_PAGE = 12

# What each choice routes to: the attention groups (full, window), then the states.
EXPECTED = {
    "reference": ("reference", "reference", "reference", "reference"),
    "default": ("cpu_attn", "reference", "cpu_attn", "reference"),
    "triton": ("triton_attn", "triton_gdn", "triton_attn", "triton_mamba2"),
}


def model() -> DemoModel:
    return DemoModel(layout=LAYOUT, num_kv_heads=1, d_state=64, window=24)


def make_runtime(m: DemoModel, prefer: str, seed: int, num_pages: int) -> AttentionRuntime:
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    config = AttentionConfig.model_validate({}, context={"registry": reg})
    priority = {"cpu": PRIORITIES[prefer]} if PRIORITIES[prefer] else None
    probe = AttentionRuntime(
        m.specs,
        config,
        device="cpu",
        memory_budget_bytes=2**24,
        layer_params=m.params,
        registry=reg,
        priority=priority,
    )
    per_page = probe.memory_report().total_bytes // probe.num_blocks
    runtime = AttentionRuntime(
        m.specs,
        config,
        device="cpu",
        memory_budget_bytes=num_pages * per_page,
        layer_params=m.params,
        registry=reg,
        priority=priority,
        cache_fill=float("nan"),  # a read of an unwritten slot poisons the outputs
    )
    assert runtime.num_blocks == num_pages
    random.Random(seed).shuffle(runtime.manager.pool._free)  # pages in any order
    return runtime


@pytest.mark.parametrize("prefer", list(EXPECTED))
def test_hybrid_attention_in_big_pages_matches_dense(prefer: str) -> None:
    """Three requests: a long prompt in chunks across page boundaries, a short one, and
    one that starts once the first finishes (it reuses pages given back), with decodes
    mixed in."""
    m = model()
    runtime = make_runtime(m, prefer, seed=3, num_pages=24)
    full, _, window, _ = runtime.groups
    assert [g.spec.block_size for g in (full, window)] == [16, 16]  # what the kernels see
    assert [g.blocks_per_page for g in runtime.groups] == [PER_PAGE, 1, PER_PAGE, 1]
    assert (
        tuple(runtime.selections[g.group_id].backend_name for g in runtime.groups)
        == (EXPECTED[prefer])
    )
    # Interleaved caches have a row per kernel block; planes (cpu_attn) a row per slot.
    kernel_blocks = runtime.num_blocks * PER_PAGE
    rows = kernel_blocks * (16 if prefer == "default" else 1)
    assert runtime.kv_caches["layers.0"][0].shape[0] == rows

    gen = torch.Generator().manual_seed(0)
    prompts = {
        rid: torch.randint(0, 64, (n,), generator=gen).tolist()
        for rid, n in (("long", 230), ("short", 21), ("late", 40))
    }
    tokens = {rid: list(p) for rid, p in prompts.items()}
    done = dict.fromkeys(prompts, 0)
    outputs: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    schedule: list[tuple[list[tuple[str, int]], list[str]]] = [
        ([("long", 100), ("short", 21)], []),
        ([("short", 1), ("long", 97)], []),  # "long" reaches 197: a second page each
        ([("long", 33), ("short", 1)], []),
        ([("long", 1), ("short", 1)], []),
        ([("short", 1)], ["long"]),  # "long"'s pages go back
        ([("late", 40), ("short", 1)], []),
        ([("late", 1), ("short", 1)], []),
    ]
    for step, finished in schedule:
        for rid, n in step:
            while len(tokens[rid]) < done[rid] + n:  # decodes: a next token
                tokens[rid].append(int(torch.randint(0, 64, (1,), generator=gen)))
        batch = runtime.begin_step([ScheduledRequest(rid, n) for rid, n in step], finished=finished)
        chunk = dict(step)
        ids = torch.tensor(
            [t for rid in batch.order for t in tokens[rid][done[rid] : done[rid] + chunk[rid]]]
        )
        hidden = m.forward_step(runtime, ids)
        for rid, rows in batch.token_slices().items():
            outputs[rid].append(hidden[rows])
            done[rid] += chunk[rid]
        for rid in batch.order:  # tables: kernel blocks of pages other groups do not hold
            for group in (full, window):
                table = runtime.block_table(group.layer_names[0], rid)
                assert all(b // PER_PAGE != NULL_BLOCK for b in table if b != NULL_BLOCK)
    pages = runtime.manager.owned_pages()
    held = [p for group_pages in pages.values() for p in group_pages]
    assert len(held) == len(set(held)), "a page held by two groups"
    for rid, parts in outputs.items():
        dense = m.forward_dense(torch.tensor(tokens[rid][: done[rid]]))
        torch.testing.assert_close(torch.cat(parts), dense, atol=TOL, rtol=TOL)
