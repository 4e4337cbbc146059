"""Decode context parallelism (``attnkit.parallel``): N ranks, each holding every N-th
token of the sharded kinds' caches, must reproduce the single-device runtime.

Ranks run in threads of this process over an in-memory communicator (fast, exact
collectives), and in separate processes over ``torch.distributed`` with gloo (the
real transport). The expected outputs come from an ``AttentionRuntime`` without
context parallelism on the same inputs; the reference backend serves both.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from attnkit.errors import ArgumentTypeError, InvalidArgumentError
from attnkit.kernels.attention.reference import paged_attention
from attnkit.kinds import CONTEXT_SHARDED_KINDS
from attnkit.parallel import ContextParallel, ContextParallelMismatchError, merge_partials
from attnkit.runtime import ScheduledRequest

F32 = torch.float32
BS = 16
HQ, HKV, D = 4, 2, 16
MLA_D, MLA_R = 32, 16  # latent pages of 128 B per token: full attention keeps blocks of 16


class ThreadGroup:
    """An in-memory all-gather for ``world_size`` threads (a barrier per call)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._slots: list[torch.Tensor | None] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=60)

    def member(self, rank: int) -> ThreadMember:
        return ThreadMember(self, rank)


@dataclasses.dataclass
class ThreadMember:
    group: ThreadGroup
    _rank: int

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.group._slots[self._rank] = tensor.clone()
        self.group._barrier.wait()
        out = [t.clone() for t in self.group._slots if t is not None]
        self.group._barrier.wait()
        return out


def specs() -> dict[str, KVCacheSpec]:
    return {
        "full.0": FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=F32),
        "window.1": SlidingWindowSpec(
            block_size=BS, num_kv_heads=HKV, head_size=D, dtype=F32, sliding_window=5
        ),
        "mla.2": MLAAttentionSpec(block_size=BS, head_size=MLA_D, dtype=F32),
        "full.3": FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=F32),
    }


def params(gen: torch.Generator) -> dict[str, AttentionLayerParams]:
    return {
        "full.0": AttentionLayerParams(num_heads=HQ),
        "window.1": AttentionLayerParams(num_heads=HQ),
        "mla.2": AttentionLayerParams(num_heads=HQ, v_head_size=MLA_R),
        # gpt-oss-style sinks and ALiBi: each must join the merged softmax once.
        "full.3": AttentionLayerParams(
            num_heads=HQ,
            sinks=torch.randn(HQ, generator=gen),
            alibi_slopes=tuple(2.0 ** -(i + 1) for i in range(HQ)),
        ),
    }


# Chunked prefills, interleaved decodes, a finished request whose blocks are reused.
SCHEDULE: list[tuple[dict[str, int], list[str]]] = [
    ({"a": 9, "b": 3}, []),
    ({"a": 6, "b": 1, "c": 2}, []),
    ({"a": 1, "b": 1, "c": 7}, []),
    ({"c": 1, "d": 11}, ["a"]),
    ({"b": 1, "c": 1, "d": 1, "e": 1}, []),
    ({"d": 5, "e": 2}, ["b"]),
]


def make_runtime(
    cp: ContextParallel | None, seed: int, full_backend: str = "reference"
) -> AttentionRuntime:
    gen = torch.Generator().manual_seed(0)
    rt = AttentionRuntime(
        specs(),
        AttentionConfig(backend_per_kind={"full_attention": full_backend}),
        device="cpu",
        memory_budget_bytes=2**19,
        layer_params=params(gen),
        cache_fill=float("nan"),
        context_parallel=cp,
    )
    random.Random(seed).shuffle(rt.manager.pool._free)
    return rt


def step_inputs(seed: int, step: int, tokens: int) -> dict[str, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(1000 * seed + step)
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    for name in specs():
        if name.startswith("mla"):
            out[name] = (
                torch.randn(tokens, HQ, MLA_D, generator=gen),
                torch.randn(tokens, 1, MLA_D, generator=gen),
            )
        else:
            out[name] = tuple(torch.randn(tokens, h, D, generator=gen) for h in (HQ, HKV, HKV))
    return out


def run(rt: AttentionRuntime, seed: int) -> list[dict[str, torch.Tensor]]:
    """Every step's output per layer (the same inputs for every runtime)."""
    results = []
    for i, (scheduled, finished) in enumerate(SCHEDULE):
        batch = rt.begin_step(
            [ScheduledRequest(r, n) for r, n in scheduled.items()], finished=finished
        )
        inputs = step_inputs(seed, i, batch.num_tokens)
        step: dict[str, torch.Tensor] = {}
        for name, tensors in inputs.items():
            if name.startswith("mla"):
                step[name] = rt.forward(name, tensors[0], tensors[1], None)
            else:
                step[name] = rt.forward(name, *tensors)
        results.append(step)
    return results


def run_ranks(world: int, body: Callable[[int, ContextParallel], Any]) -> list[Any]:
    group = ThreadGroup(world)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = body(rank, ContextParallel(group.member(rank)))
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)
            group._barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize(
    ("world", "full_backend"),
    [(2, "reference"), (3, "reference"), (4, "reference"), (2, "cpu_attn"), (3, "cpu_attn")],
)
def test_ranks_reproduce_the_single_device_runtime(world: int, full_backend: str) -> None:
    """Every rank's merged output equals one device's (the reference backend there).
    (Triton's interpreter is not thread-safe: triton_attn ranks run as processes below.)"""
    expected = run(make_runtime(None, seed=0), seed=5)
    ranks = run_ranks(
        world,
        lambda rank, cp: run(make_runtime(cp, seed=rank + 1, full_backend=full_backend), seed=5),
    )
    for rank, got in enumerate(ranks):
        for step, (g, e) in enumerate(zip(got, expected, strict=True)):
            for name in e:
                torch.testing.assert_close(
                    g[name],
                    e[name],
                    atol=2e-5,
                    rtol=2e-5,
                    msg=lambda m, where=f"rank {rank} step {step} {name}": f"{where}: {m}",
                )


def test_each_rank_holds_only_its_tokens() -> None:
    """Sharded groups allocate ceil(ceil((L - rank) / N) / BS) blocks per request; the
    replicated window group allocates as on one device."""
    world = 3

    def body(rank: int, cp: ContextParallel) -> dict[str, list[int]]:
        rt = make_runtime(cp, seed=rank)
        rt.begin_step([ScheduledRequest("a", 61), ScheduledRequest("b", 2)])
        sizes = {name: rt.groups[rt._layer_group[name]].spec.block_size for name in specs()}
        return {
            name: [sizes[name]] + [len(rt.block_table(name, r)) for r in ("a", "b")]
            for name in ("full.0", "mla.2", "window.1")
        }

    for rank, got in enumerate(run_ranks(world, body)):
        local = [-(-(n - rank) // world) for n in (61, 2)]
        for name in ("full.0", "mla.2"):
            bs = got[name][0]  # the group's (kernel) block size
            assert got[name][1:] == [-(-c // bs) for c in local], (rank, name, got)
        bs = got["window.1"][0]
        assert got["window.1"][1:] == [-(-61 // bs), -(-2 // bs)]
    # A sharded group's tables are smaller than one device's for the long request.
    one_device = -(-61 // got["full.0"][0])
    assert got["full.0"][1] < one_device


def test_divergent_schedules_fail_clearly_on_every_rank() -> None:
    def body(rank: int, cp: ContextParallel) -> str:
        rt = make_runtime(cp, seed=rank)
        rt.begin_step([ScheduledRequest("a", 4)])
        try:
            rt.begin_step([ScheduledRequest("a", 1 + rank)])  # rank 1 schedules 2 tokens
        except ContextParallelMismatchError as exc:
            return str(exc)
        return "no error"

    messages = run_ranks(2, body)
    assert all("the ranks were given different steps" in m for m in messages), messages
    assert "step counters [1, 1]" in messages[0]
    assert "ranks [1] differ" in messages[0]


def test_single_rank_group_is_the_plain_runtime() -> None:
    expected = run(make_runtime(None, seed=0), seed=2)
    (got,) = run_ranks(1, lambda rank, cp: run(make_runtime(cp, seed=3), seed=2))
    for g, e in zip(got, expected, strict=True):
        for name in e:
            torch.testing.assert_close(g[name], e[name], atol=1e-6, rtol=1e-6)


def test_sharded_kinds_are_chosen_with_the_feature() -> None:
    def body(rank: int, cp: ContextParallel) -> list[tuple[str, str]]:
        rt = make_runtime(cp, seed=rank)
        return [(row.layer, row.backend) for row in rt.routing_table()]

    rows = dict(run_ranks(2, body)[0])
    # Sharded groups need the feature; the reference backend declares it.
    assert [rows[n] for n in ("full.0", "mla.2", "full.3")] == ["reference"] * 3

    def triton(rank: int, cp: ContextParallel) -> list[tuple[str, str]]:
        rt = make_runtime(cp, seed=rank, full_backend="triton_attn")
        return [(row.layer, row.backend) for row in rt.routing_table()]

    routed = dict(run_ranks(2, triton)[0])
    assert routed["full.0"] == routed["full.3"] == "triton_attn"
    assert {k.value for k in CONTEXT_SHARDED_KINDS} == {"full_attention", "mla_attention"}


def test_bad_context_parallel_arguments() -> None:
    with pytest.raises(ArgumentTypeError, match="context_parallel must be a ContextParallel"):
        AttentionRuntime(
            specs(), AttentionConfig(), device="cpu", memory_budget_bytes=2**19, context_parallel=2
        )  # type: ignore[arg-type]  # the wrong type on purpose
    group = ThreadGroup(2)
    member = group.member(2)
    with pytest.raises(InvalidArgumentError, match=r"0 <= rank < world_size, got rank=2"):
        ContextParallel(member)
    with pytest.raises(InvalidArgumentError, match="must implement Communicator"):
        ContextParallel(object())  # type: ignore[arg-type]  # the wrong type on purpose
    with pytest.raises(InvalidArgumentError, match=r"torch\.distributed must be initialised"):
        ContextParallel.from_process_group()


def test_merge_partials_equals_attention_over_the_union() -> None:
    """Two disjoint key sets merged by their lses equal attention over all keys
    (an independent dense softmax in float64)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(5, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))

    def part(idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        s = torch.einsum("thd,khd->thk", q, k[idx])
        return torch.einsum("thk,khd->thd", torch.softmax(s, -1), v[idx]), torch.logsumexp(s, -1)

    a, b = part([0, 2, 4]), part([1, 3])
    out = torch.empty(5, 2, 8, dtype=torch.float64)
    lse = torch.empty(5, 2)
    merge_partials([a[0], b[0]], [a[1].float(), b[1].float()], out, lse)
    scores = torch.einsum("thd,khd->thk", q, k)
    full = torch.einsum("thk,khd->thd", torch.softmax(scores, -1), v)
    torch.testing.assert_close(out, full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-6)
    one = torch.empty(5, 2)
    merge_partials([a[0]], [a[1].float()], out, one)
    torch.testing.assert_close(one, a[1].float())


def test_oracle_rejects_an_inconsistent_shard() -> None:
    cache = torch.zeros(4, 2, BS, 1, 8)
    with pytest.raises(ValueError, match=r"ceil\(\(L - rank\) / world_size\) = 2"):
        paged_attention(
            torch.zeros(1, 1, 8),
            cache,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=torch.tensor([3], dtype=torch.int32),
            block_table=torch.tensor([[1]], dtype=torch.int32),
            scale=1.0,
            context_shard=(1, 2),
            global_seq_lens=torch.tensor([5]),
        )


# ---------------------------------------------------------------- torch.distributed


def _gloo_worker(
    rank: int, world: int, init_file: str, out_dir: str, full_backend: str = "reference"
) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        if full_backend.startswith("triton"):
            os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (CPU)
        cp = ContextParallel.from_process_group()
        got = run(make_runtime(cp, seed=rank + 7, full_backend=full_backend), seed=9)
        torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("world", "full_backend"), [(2, "reference"), (4, "reference"), (2, "triton_attn")]
)
def test_gloo_processes_reproduce_the_single_device_runtime(
    world: int, full_backend: str, tmp_path: Path
) -> None:
    """Ranks as processes over gloo; with triton_attn the sharded full-attention layers
    run its kernels (one-pass and split-KV) with the shard's key positions, under the
    Triton interpreter on CPU."""
    import torch.multiprocessing as mp

    mp.spawn(
        _gloo_worker,
        args=(world, str(tmp_path / "init"), str(tmp_path), full_backend),
        nprocs=world,
        join=True,
    )
    expected = run(make_runtime(None, seed=0), seed=9)
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for g, e in zip(got, expected, strict=True):
            for name in e:
                torch.testing.assert_close(g[name], e[name], atol=2e-5, rtol=2e-5)


def _lse_run(cp: ContextParallel | None, seed: int, backend: str) -> list[tuple[torch.Tensor, ...]]:
    """SCHEDULE through one full-attention layer built with return_lse (sinks and all):
    each step's output and lse."""
    gen = torch.Generator().manual_seed(0)
    rt = AttentionRuntime(
        {"full": FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=F32)},
        AttentionConfig(backend_per_kind={"full_attention": backend}),
        device="cpu",
        memory_budget_bytes=2**19,
        layer_params={
            "full": AttentionLayerParams(
                num_heads=HQ, sinks=torch.randn(HQ, generator=gen), return_lse=True
            )
        },
        cache_fill=float("nan"),
        context_parallel=cp,
    )
    random.Random(seed).shuffle(rt.manager.pool._free)
    results = []
    for i, (scheduled, finished) in enumerate(SCHEDULE):
        batch = rt.begin_step(
            [ScheduledRequest(r, n) for r, n in scheduled.items()], finished=finished
        )
        q, k, v = step_inputs(5, i, batch.num_tokens)["full.0"]
        lse = torch.full((batch.num_tokens, HQ), float("nan"))
        results.append((rt.forward("full", q, k, v, lse=lse), lse))
    return results


@pytest.mark.parametrize("backend", ["reference", "cpu_attn"])
def test_ranks_merge_the_lse_as_one_device(backend: str) -> None:
    """A return_lse layer on a context-parallel group: every rank's lse is the merge of
    the ranks' partial lses, equal to one device's (whose lse tests/test_return_lse.py
    checks against a float64 oracle)."""
    expected = _lse_run(None, 0, "reference")
    ranks = run_ranks(2, lambda rank, cp: _lse_run(cp, rank + 1, backend))
    for got in ranks:
        for (out, lse), (want_out, want_lse) in zip(got, expected, strict=True):
            torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)
