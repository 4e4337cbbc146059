"""Offload (docs/offload.md): the connectors, page descriptors and canonical page ids,
bitwise round trips through the runtime for every cache dtype and state checkpoints, a
hit on offloaded blocks giving what a hit on resident ones gives, and an eviction soak
with a connector that delays and fails transfers. Broken variants (a load not awaited,
a tier returning another page's bytes, a failed load taken as good) are caught."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from typing_extensions import override

from attnkit import (
    ArgumentTypeError,
    AttentionConfig,
    AttentionLayerParams,
    BackendRegistry,
    FileTier,
    FullAttentionSpec,
    HostMemoryTier,
    InvalidArgumentError,
    KVCacheSpec,
    KVConnector,
    MLAAttentionSpec,
    PrefixMatch,
    TensorParallelRank,
    TransferHandle,
)
from attnkit.demo import PRIORITIES, DemoModel
from attnkit.offload import DoneHandle
from attnkit.registry import BUILTIN_BACKENDS
from attnkit.runtime import AttentionRuntime
from attnkit.runtime._offload import Offloader
from attnkit.testing.tolerances import tolerance_for
from offload_variants import FaultyTier

BS = 16


def page(n: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


# ---------------------------------------------------------------- the connectors


def test_host_tier_round_trips_bitwise_and_keeps_its_bound_by_lru() -> None:
    tier = HostMemoryTier(3 * 64)
    pages = {bytes([i]): page(64, i) for i in range(4)}
    for key in list(pages)[:3]:
        assert tier.submit_save(key, pages[key]).wait()
    out = torch.empty(64, dtype=torch.uint8)
    assert tier.submit_load(b"\x00", out).wait()  # a use: key 1 is now the oldest
    assert torch.equal(out, pages[b"\x00"])
    assert tier.submit_save(b"\x03", pages[b"\x03"]).wait()
    assert [tier.contains(k) for k in pages] == [True, False, True, True]
    stats = tier.stats()
    assert (stats.pages, stats.bytes, stats.evictions) == (3, 192, 1)
    assert not tier.submit_load(b"\x01", out).wait()  # dropped: the load fails
    assert not tier.submit_load(b"\x00", torch.empty(63, dtype=torch.uint8)).wait()
    assert not tier.submit_save(b"big", page(193, 9)).wait()  # larger than the bound
    assert tier.stats().rejected == 1
    assert tier.stats().load_failures == 2
    saved = pages[b"\x02"].clone()
    pages[b"\x02"].zero_()  # the tier copied the page: the caller may reuse its buffer
    assert tier.submit_load(b"\x02", out).wait()
    assert torch.equal(out, saved)


def test_host_tier_batches_reuse_slots_and_keep_every_page_bitwise() -> None:
    """Batches larger than the bound, slots reused after LRU drops (runs of slots copied
    at once): every page held loads back as saved, through both load paths."""
    tier = HostMemoryTier(6 * 32)
    saved: dict[bytes, torch.Tensor] = {}
    for batch in range(5):
        keys = [bytes([batch, i]) for i in range(4 if batch else 8)]
        pages = torch.stack([page(32, 100 * batch + i) for i in range(len(keys))])
        assert tier.submit_save_batch(keys, pages).wait()
        saved.update({k: pages[i].clone() for i, k in enumerate(keys)})
        pages.zero_()  # the tier copied them
    held = [k for k in saved if tier.contains(k)]
    assert len(held) == 6
    assert held == list(saved)[-6:]  # the least recently saved were dropped
    out = torch.empty((len(held), 32), dtype=torch.uint8)
    assert all(h.wait() for h in tier.submit_load_batch(held, out))
    for i, k in enumerate(held):
        one = torch.empty(32, dtype=torch.uint8)
        assert tier.submit_load(k, one).wait()
        assert torch.equal(out[i], saved[k])
        assert torch.equal(one, saved[k])
    with pytest.raises(InvalidArgumentError, match="keys must have one entry per row"):
        tier.submit_save_batch([b"a"], torch.zeros((2, 32), dtype=torch.uint8))


def test_file_tier_round_trips_across_instances_and_fails_a_bad_file(tmp_path: Path) -> None:
    data = page(100, 1)
    assert FileTier(tmp_path).submit_save(b"key", data).wait()
    again = FileTier(tmp_path)  # another process, later
    out = torch.empty(100, dtype=torch.uint8)
    assert again.contains(b"key")
    assert again.submit_load(b"key", out).wait()
    assert torch.equal(out, data)
    assert not again.submit_load(b"other", out).wait()
    assert not again.submit_load(b"key", torch.empty(99, dtype=torch.uint8)).wait()
    (file,) = tmp_path.glob("*.page")
    file.write_bytes(file.read_bytes()[:-1])  # a truncated write
    assert not again.submit_load(b"key", out).wait()
    assert again.stats().load_failures == 3


def test_connector_errors_name_the_argument(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="capacity_bytes"):
        HostMemoryTier(0)
    with pytest.raises(InvalidArgumentError, match="data must be a contiguous 1-D uint8"):
        HostMemoryTier(10).submit_save(b"k", torch.zeros(2, dtype=torch.float32))
    with pytest.raises(ArgumentTypeError, match=r"out must be a torch\.Tensor"):
        FileTier(tmp_path).submit_load(b"k", [0])  # type: ignore[arg-type]  # untyped callers
    with pytest.raises(ArgumentTypeError, match="directory"):
        FileTier(3)  # type: ignore[arg-type]  # untyped callers
    with pytest.raises(InvalidArgumentError, match=r"tensor_parallel\.rank"):
        TensorParallelRank(2, 2)
    with pytest.raises(InvalidArgumentError, match="kv_replicas"):
        TensorParallelRank(0, 4, kv_replicas=3)


# ---------------------------------------------------------------- runtimes

REG = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)


def runtime_for(
    specs: dict[str, KVCacheSpec],
    *,
    pages: int | None = None,
    connector: KVConnector | None = None,
    params: dict[str, Any] | None = None,
    prefer: str = "reference",
    tensor_parallel: TensorParallelRank | None = None,
    **caching: object,
) -> AttentionRuntime:
    config = AttentionConfig.model_validate(
        {"prefix_caching": {"enabled": True, **caching}}, context={"registry": REG}
    )
    priority = {"cpu": PRIORITIES[prefer]} if PRIORITIES[prefer] else None

    def build(budget: int) -> AttentionRuntime:
        return AttentionRuntime(
            specs,
            config,
            device="cpu",
            memory_budget_bytes=budget,
            layer_params=params,
            registry=REG,
            priority=priority,
            cache_fill=float("nan"),
            kv_connector=connector,
            tensor_parallel=tensor_parallel,
        )

    runtime = build(2**22)
    if pages is not None:
        per_page = runtime.memory_report().total_bytes // runtime.num_blocks
        runtime = build(pages * per_page)
        assert runtime.num_blocks == pages
    random.Random(0).shuffle(runtime.manager.pool._free)
    return runtime


def offloader(runtime: AttentionRuntime) -> Offloader:
    off = runtime._offloader
    assert off is not None
    return off


def block_bytes(runtime: AttentionRuntime, layer: str, layout: str, block: int) -> list[bytes]:
    """Kernel block ``block``'s bytes in each of ``layer``'s tensors, sliced by the layout
    written out here (an independent reading of the cache shapes)."""
    out: list[bytes] = []
    for t in runtime.kv_caches[layer]:
        # planes: BS rows per block; page-major [NB*k, ...]: K/V, MLA latents, states
        rows = t[block * BS : (block + 1) * BS] if layout == "planes" else t[block]
        out.append(rows.contiguous().view(torch.uint8).numpy().tobytes())
    return out


DTYPES = ["auto", "float16", "bfloat16", "fp8_e4m3"]  # every dtype a CPU backend serves


@pytest.mark.parametrize("kv_cache_dtype", DTYPES)
@pytest.mark.parametrize("prefer", ["reference", "default"])
def test_pages_round_trip_bitwise_for_every_cache_dtype(kv_cache_dtype: str, prefer: str) -> None:
    """A block's bytes saved and loaded into another block are the same bytes, in every
    tensor of every layer (fp8 with its scales: the scales are in the namespace, so in
    the id); the descriptor's byte ranges and token offsets agree with torch's views."""
    fp8 = kv_cache_dtype.startswith("fp8")
    spec = FullAttentionSpec(
        block_size=BS,
        num_kv_heads=2,
        head_size=8,
        dtype=torch.float32,
        kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]  # the parametrised Literal
    )
    params = {
        n: AttentionLayerParams(
            num_heads=2, k_scale=0.5 if fp8 else 1.0, v_scale=2.0 if fp8 else 1.0
        )
        for n in ("l0", "l1")
    }
    runtime = runtime_for(
        {"l0": spec, "l1": spec}, connector=HostMemoryTier(2**20), params=params, prefer=prefer
    )
    for tensors in runtime.kv_caches.values():
        for t in tensors:
            t.view(torch.uint8).copy_(
                torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8)
            )
    layout = runtime.layouts[0]
    before = {n: block_bytes(runtime, n, layout, 5) for n in ("l0", "l1")}
    off = offloader(runtime)
    off.save([(0, 5, b"name")])
    assert off.load(0, [9], [b"name"]) == [True]
    for n in ("l0", "l1"):
        assert block_bytes(runtime, n, layout, 9) == before[n]
    pages = runtime.page_descriptors().group(0)
    assert pages.page_bytes == sum(len(b) for n in ("l0", "l1") for b in before[n])
    assert [s.name for s in pages.scales] == ["k_scale", "v_scale"] * 2
    for desc in pages.tensors:
        t = runtime.kv_caches[desc.layer][desc.index]
        start, end = desc.block_byte_range(9)
        raw = t.view(torch.uint8).reshape(-1)[start:end].numpy().tobytes()
        assert raw == block_bytes(runtime, desc.layer, layout, 9)[desc.index]
        view = t[9 * BS + 3] if layout == "planes" else t[9, 0, 3]  # token 3 (its K row)
        assert desc.token_byte_offset(9, 3) == view.data_ptr() - t.data_ptr()
    same = runtime_for({"l0": spec, "l1": spec}, params=params, prefer=prefer)
    assert same.page_descriptors().group(0).page_id(b"n") == pages.page_id(b"n")
    if fp8:  # other scales: other bytes for the same tokens, so another id
        other = runtime_for(
            {"l0": spec, "l1": spec},
            params={
                n: AttentionLayerParams(num_heads=2, k_scale=0.25, v_scale=2.0)
                for n in ("l0", "l1")
            },
            prefer=prefer,
        )
        assert other.page_descriptors().group(0).page_id(b"n") != pages.page_id(b"n")


def test_mla_and_state_checkpoint_pages_round_trip_bitwise() -> None:
    m = DemoModel(layout=("mla", "mamba"), block_size=BS, num_kv_heads=1)
    runtime = runtime_for(
        dict(m.specs),
        params=dict(m.params),
        connector=HostMemoryTier(2**22),
        state_checkpoints="step_end",
    )
    for tensors in runtime.kv_caches.values():
        for t in tensors:
            t.view(torch.uint8).copy_(
                torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8)
            )
    off = offloader(runtime)
    pages = runtime.page_descriptors()
    state = next(g for g in pages.groups if g.checkpoints)
    latent = next(g for g in pages.groups if not g.checkpoints)
    assert {t.role for t in state.tensors} == {"state"}
    assert {t.role for t in latent.tensors} == {"token_rows"}
    for g in (latent, state):
        before = {n: block_bytes(runtime, n, "interleaved", 3) for n in g.layers}
        off.save([(g.group_id, 3, b"x")])
        assert off.load(g.group_id, [7], [b"x"]) == [True]
        for n in g.layers:
            assert block_bytes(runtime, n, "interleaved", 7) == before[n]


def test_the_connector_needs_prefix_caching_and_says_so() -> None:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    with pytest.raises(InvalidArgumentError, match="kv_connector needs prefix caching"):
        AttentionRuntime(
            {"l": spec},
            AttentionConfig(),
            device="cpu",
            memory_budget_bytes=2**20,
            kv_connector=HostMemoryTier(100),
        )
    with pytest.raises(ArgumentTypeError, match="kv_connector must be a KVConnector"):
        AttentionRuntime(
            {"l": spec},
            AttentionConfig(prefix_caching={"enabled": True}),
            device="cpu",
            memory_budget_bytes=2**20,
            kv_connector="host",  # type: ignore[arg-type]  # untyped callers
        )
    with pytest.raises(ArgumentTypeError, match="tensor_parallel must be a TensorParallelRank"):
        AttentionRuntime(
            {"l": spec},
            AttentionConfig(),
            device="cpu",
            memory_budget_bytes=2**20,
            tensor_parallel=(0, 2),  # type: ignore[arg-type]  # untyped callers
        )


# ---------------------------------------------------------------- canonical ids


def test_page_sharing_by_kind_and_tensor_parallel_rank() -> None:
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32)
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float32)
    ids: dict[tuple[int, int], tuple[bytes, bytes]] = {}
    for rank in (0, 1):
        for replicas in (1, 2):
            tp = TensorParallelRank(rank, 2, kv_replicas=replicas)
            rt = runtime_for({"f": full, "m": mla}, tensor_parallel=tp)
            pages = rt.page_descriptors()
            f, m = (pages.group(g.group_id) for g in rt.groups)
            assert m.sharing.parallelism_agnostic
            assert f.sharing.replicated == (replicas == 2)
            ids[rank, replicas] = (f.page_id(b"n"), m.page_id(b"n"))
    # The latent page: one id whatever the rank and split; the K/V page: per shard.
    assert len({m for _, m in ids.values()}) == 1
    assert ids[0, 1][0] != ids[1, 1][0]
    assert ids[0, 2][0] == ids[1, 2][0]
    single = runtime_for({"f": full, "m": mla}).page_descriptors()
    assert single.group(1).page_id(b"n") == ids[0, 1][1]


def _gloo_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
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
        m = DemoModel(layout=("mla", "full"), block_size=BS, num_kv_heads=1)
        rt = runtime_for(
            dict(m.specs), params=dict(m.params), tensor_parallel=TensorParallelRank(rank, world)
        )
        prompt = list(range(3, 3 + 40))
        match = rt.match_prefix(prompt)
        pages = rt.page_descriptors()
        ids = {
            g.kind.value: [g.page_id(n) for n in match.block_names(g.group_id)]
            for g in pages.groups
        }
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, ids)
        if rank == 0:
            torch.save(gathered, str(Path(out_dir) / "ids.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_share_the_ids_of_replicated_pages(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_gloo_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = torch.load(tmp_path / "ids.pt")
    assert len(r0["mla_attention"]) == 2
    assert r0["mla_attention"] == r1["mla_attention"]
    # K/V heads split over the ranks: rank-private ids (fail closed).
    assert not set(r0["full_attention"]) & set(r1["full_attention"])


# ---------------------------------------------------------------- hits through the runtime


class Driver:
    """Runs requests through a runtime and the demo model, keeping each request's tokens
    and the hidden states of the positions it computed."""

    def __init__(self, m: DemoModel, runtime: AttentionRuntime) -> None:
        self.m, self.runtime = m, runtime
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}
        self.out: dict[str, dict[int, torch.Tensor]] = {}

    def step(self, chunks: Sequence[tuple[str, int]], prefixes: dict[str, PrefixMatch]) -> None:
        for rid, match in prefixes.items():
            self.done[rid] = match.num_tokens
        from attnkit import ScheduledRequest

        batch = self.runtime.begin_step(
            [ScheduledRequest(rid, n, prefix=prefixes.get(rid)) for rid, n in chunks]
        )
        n_of = dict(chunks)
        ids: list[int] = []
        positions: list[int] = []
        for rid in batch.order:
            start = self.done.setdefault(rid, 0)
            ids += self.tokens[rid][start : start + n_of[rid]]
            positions += range(start, start + n_of[rid])
        hidden = self.m.forward_step(
            self.runtime, torch.tensor(ids), positions=torch.tensor(positions)
        )
        for rid, rows in batch.token_slices().items():
            start = self.done[rid]
            for i, row in enumerate(hidden[rows]):
                self.out.setdefault(rid, {})[start + i] = row
            self.done[rid] += n_of[rid]

    def turn(self, rid: str, toks: list[int], *, first_chunk: int | None = None) -> PrefixMatch:
        """A request for ``toks``, started from its match, computed, freed with its tokens."""
        self.tokens[rid] = toks
        match = self.runtime.match_prefix(toks)
        left = len(toks) - match.num_tokens
        if first_chunk is not None and first_chunk < left:
            self.step([(rid, first_chunk)], {rid: match})
            self.step([(rid, left - first_chunk)], {})
        else:
            self.step([(rid, left)], {rid: match})
        self.runtime.free([rid], token_ids={rid: toks})
        return match

    def rows(self, rid: str) -> tuple[list[int], torch.Tensor]:
        rows = sorted(self.out[rid])
        return rows, torch.stack([self.out[rid][i] for i in rows])


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def holds_any(runtime: AttentionRuntime, match: PrefixMatch) -> bool:
    """Whether the device still holds a block or a checkpoint of ``match``'s prompt."""
    manager = runtime.manager
    prefix = manager.prefix
    assert prefix is not None
    prefix.flush()
    for gid, (slab, store) in enumerate(
        zip(manager.cached_slabs, manager.checkpoint_stores, strict=True)
    ):
        if slab is not None and set(match.block_names(gid)) & set(slab.block_of):
            return True
        layout = prefix.checkpoint_layout
        if (
            store is not None
            and layout is not None
            and set(match._names[layout]) & set(store.block_of)
        ):
            return True
    return False


HIT_CASES = [
    ("reference", ("full", "window", "full"), {}),
    ("default", ("full", "window", "full"), {}),
    ("reference", ("mla", "mla_window"), {}),
    ("reference", ("full", "mamba"), {"state_checkpoints": "step_end"}),
]


def hit_outputs(
    prefer: str,
    layout: tuple[str, ...],
    caching: dict[str, object],
    connector: KVConnector | None,
) -> tuple[PrefixMatch, list[int], torch.Tensor, AttentionRuntime]:
    """Request ``a`` (its first chunk ending on a checkpoint boundary), then, with a
    connector, fillers that evict all of it from a small pool; then ``b`` sharing 64
    tokens of ``a``: its match and computed rows."""
    m = DemoModel(layout=layout, block_size=BS, window=10, num_kv_heads=1)
    runtime = runtime_for(
        dict(m.specs),
        params=dict(m.params),
        prefer=prefer,
        pages=None if connector is None else 16,
        connector=connector,
        **caching,
    )
    d = Driver(m, runtime)
    first = d.turn("a", tokens(70, seed=1), first_chunk=64)
    if connector is not None:
        for i in range(40):  # until the device holds nothing of ``a``
            if not holds_any(runtime, first):
                break
            d.turn(f"filler{i}", tokens(70, seed=100 + i), first_chunk=64)
        assert not holds_any(runtime, first)
    b = d.tokens["a"][:64] + tokens(6, seed=2)
    match = d.turn("b", b)
    rows, got = d.rows("b")
    return match, rows, got, runtime


@pytest.mark.parametrize(
    ("prefer", "layout", "caching"),
    HIT_CASES,
    ids=[f"{p}-{'+'.join(la)}" for p, la, _ in HIT_CASES],
)
def test_a_hit_on_offloaded_blocks_gives_what_a_resident_hit_gives(
    prefer: str, layout: tuple[str, ...], caching: dict[str, object]
) -> None:
    resident, rows_r, out_r, _ = hit_outputs(prefer, layout, caching, None)
    offloaded, rows_o, out_o, runtime = hit_outputs(prefer, layout, caching, HostMemoryTier(2**24))
    stats = runtime.prefix_cache_stats()
    assert resident.num_tokens == offloaded.num_tokens == 64, offloaded.explain()
    assert stats.offloaded > 0
    assert stats.offload_loads > 0
    assert stats.offload_load_failures == 0
    assert stats.offload_hit_tokens == 64  # the device held none of it: all from the tier
    assert rows_r == rows_o == list(range(64, 70))
    assert torch.equal(out_o, out_r)  # bitwise: the same bytes, read the same way
    report = runtime.memory_report()
    assert report.offload is not None
    assert report.offload.pages > 0
    assert "offload tier" in report.describe()
    assert "offload:" in str(stats)


# ---------------------------------------------------------------- faults


def soak(connector: KVConnector, *, prefer: str = "reference", turns: int = 3) -> AttentionRuntime:
    """Multi-turn conversations under eviction pressure: each turn looks the history
    up, computes the rest, is freed with its tokens. Every computed row must equal the
    conversation computed alone with caching off; nothing leaks."""
    m = DemoModel(layout=("full", "window", "full"), block_size=BS, window=10, num_kv_heads=1)
    runtime = runtime_for(
        dict(m.specs), params=dict(m.params), prefer=prefer, pages=20, connector=connector
    )
    d = Driver(m, runtime)
    rng = random.Random(3)
    history = {c: tokens(30 + 7 * c, seed=10 + c) for c in range(4)}
    for t in range(turns):
        for c in rng.sample(sorted(history), len(history)):
            history[c] = history[c] + tokens(20, seed=1000 * t + c)
            d.turn(f"c{c}t{t}", list(history[c]))
    # Leaks: every page is free or cached (idle); after a reset, every page is free.
    pool = runtime.manager.pool
    assert len(runtime.manager) == 0
    assert pool.num_free_blocks + len(pool.idle) == runtime.num_blocks - 1
    for slab in runtime.manager.cached_slabs:
        assert slab is None or not slab.refs.any()
    # The outputs, against each conversation alone with caching off.
    tol = tolerance_for(torch.float32)
    for c, full in history.items():
        alone = AttentionRuntime(
            m.specs,
            AttentionConfig.model_validate({}, context={"registry": REG}),
            device="cpu",
            memory_budget_bytes=2**22,
            layer_params=m.params,
            registry=REG,
            priority={"cpu": PRIORITIES[prefer]} if PRIORITIES[prefer] else None,
        )
        ref = Driver(m, alone)
        ref.tokens["x"] = full
        ref.step([("x", len(full))], {})
        _, expected = ref.rows("x")
        for t in range(turns):
            rows, got = d.rows(f"c{c}t{t}")
            torch.testing.assert_close(got, expected[rows], atol=tol.atol, rtol=tol.rtol)
    runtime.reset_prefix_cache()
    assert pool.num_free_blocks == runtime.num_blocks - 1
    return runtime


def test_soak_with_a_connector_that_delays_and_fails() -> None:
    runtime = soak(FaultyTier(fail_every=3))
    stats = runtime.prefix_cache_stats()
    assert stats.offload_loads > 0, str(stats)
    assert stats.offload_load_failures > 0, str(stats)
    assert stats.offload_hit_tokens > 0


def test_soak_on_the_cpu_default_with_the_file_tier(tmp_path: Path) -> None:
    runtime = soak(FileTier(tmp_path), prefer="default", turns=2)
    assert runtime.prefix_cache_stats().offload_loads > 0


def test_broken_a_load_not_awaited_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def load_without_wait(
        self: Offloader, gid: int, blocks: Sequence[int], names: Sequence[bytes]
    ) -> list[bool]:
        pages = torch.empty((len(blocks), self.page_bytes[gid]), dtype=torch.uint8)
        handles = [
            self.connector.submit_load(self.key(gid, n), pages[i]) for i, n in enumerate(names)
        ]
        self.scatter(gid, list(blocks), pages)  # before the copies are done
        return [h.wait() for h in handles]

    monkeypatch.setattr(Offloader, "load", load_without_wait)
    with pytest.raises(AssertionError, match="not close"):
        soak(FaultyTier())


def test_broken_a_failed_load_taken_as_good_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = Offloader.load

    def load_ignoring_failures(
        self: Offloader, gid: int, blocks: Sequence[int], names: Sequence[bytes]
    ) -> list[bool]:
        pages = torch.empty((len(blocks), self.page_bytes[gid]), dtype=torch.uint8)
        for i, n in enumerate(names):
            self.connector.submit_load(self.key(gid, n), pages[i]).wait()
        self.scatter(gid, list(blocks), pages)
        return [True] * len(blocks)

    assert real is not load_ignoring_failures
    monkeypatch.setattr(Offloader, "load", load_ignoring_failures)
    with pytest.raises(AssertionError, match="not close"):
        soak(FaultyTier(fail_every=2))


class StaleTier(HostMemoryTier):
    """Broken: a load returns the bytes of another page of the same size (stale bytes)."""

    submit_load_batch = KVConnector.submit_load_batch  # every load through submit_load

    @override
    def submit_load(self, key: bytes, out: torch.Tensor) -> TransferHandle:
        if not self.contains(key):
            return DoneHandle(False)
        other = [
            k for k, (slots, _) in self._entries.items() if k != key and slots.size == out.numel()
        ]
        return super().submit_load(other[0] if other else key, out)


def test_broken_a_tier_returning_stale_bytes_is_caught() -> None:
    with pytest.raises(AssertionError, match="not close"):
        soak(StaleTier(2**26))


def test_a_connector_keeps_the_unified_pages_and_request_pages_name_the_blocks() -> None:
    """Attaching a connector changes no pool geometry of a hybrid model (no capacity
    lost), and ``request_pages`` gives each full block's canonical id, the id of its
    prefix-cache name, ``None`` for the block still filling."""
    m = DemoModel(layout=("full", "mamba", "window"), block_size=BS, window=10, num_kv_heads=1)
    specs, params = dict(m.specs), dict(m.params)
    plain = runtime_for(specs, params=params, state_checkpoints="step_end")
    offloading = runtime_for(
        specs, params=params, connector=HostMemoryTier(2**20), state_checkpoints="step_end"
    )
    assert offloading.num_blocks == plain.num_blocks
    assert offloading.page_size_bytes == plain.page_size_bytes
    assert [g.blocks_per_page for g in offloading.groups] == [
        g.blocks_per_page for g in plain.groups
    ]
    d = Driver(m, offloading)
    d.tokens["a"] = tokens(40, seed=5)
    match = offloading.match_prefix(d.tokens["a"])
    d.step([("a", 40)], {"a": match})
    offloading.match_prefix([1, 2, 3])  # the step is done: its blocks are named
    pages = offloading.page_descriptors()
    full = next(g for g in offloading.groups if g.kind.value == "full_attention")
    got = offloading.request_pages("a")[full.group_id]
    names = match.block_names(full.group_id)
    assert [pid for _, pid in got] == [pages.group(full.group_id).page_id(n) for n in names] + [
        None
    ]
    assert [b for b, _ in got] == offloading.block_table(full.layer_names[0], "a")


def test_a_lookup_never_evicts_what_an_earlier_lookups_loads_serve() -> None:
    """Two conversations evicted to the tier, on a pool that holds about one history:
    the second lookup loads only what fits beside the first's loads, so the first
    match is not stale when its request is scheduled (without the guard the second
    lookup evicts the first's loads, and an engine retrying would go round in a
    circle)."""
    m = DemoModel(layout=("full",), block_size=BS, num_kv_heads=1)
    runtime = runtime_for(
        dict(m.specs), params=dict(m.params), pages=8, connector=HostMemoryTier(2**22)
    )
    d = Driver(m, runtime)
    a, b = tokens(80, seed=1), tokens(80, seed=2)
    d.turn("a", a)
    d.turn("b", b)
    for i in range(3):  # evict both
        d.turn(f"f{i}", tokens(80, seed=50 + i))
    first = runtime.match_prefix([*a, 1])
    second = runtime.match_prefix([*b, 1])
    assert first.num_tokens == 80, first.explain()
    assert 0 < second.num_tokens < 80, second.explain()  # what fitted beside a's loads
    d.tokens["a2"] = [*a, 1]
    d.step([("a2", 1)], {"a2": first})  # not stale
    alone = Driver(m, runtime_for(dict(m.specs), params=dict(m.params)))
    alone.tokens["x"] = d.tokens["a2"]
    alone.step([("x", 81)], {})
    tol = tolerance_for(torch.float32)
    rows, got = d.rows("a2")
    assert rows == [80]
    torch.testing.assert_close(got, alone.rows("x")[1][rows], atol=tol.atol, rtol=tol.rtol)


def test_broken_without_the_guard_the_first_match_goes_stale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broken variant: lookups that may evict each other's loads."""
    from attnkit import StalePrefixError
    from attnkit.kv_cache import _prefix

    real = _prefix.PrefixCache._reload

    def forgetful(self: _prefix.PrefixCache, *args: Any) -> int:
        self._fresh.clear()
        return real(self, *args)

    monkeypatch.setattr(_prefix.PrefixCache, "_reload", forgetful)
    with pytest.raises((StalePrefixError, AssertionError)):
        test_a_lookup_never_evicts_what_an_earlier_lookups_loads_serve()
