"""Offload ordering (docs/offload.md, "Ordering"): saves leave ``begin_step``, yet what
the connector holds for an evicted block is, bit for bit, what the block held when the
pool evicted it, however late the connector's saves run (on the worker thread, or read
at the handle's completion); a hit on pages still being saved equals a resident hit;
the soak with a connector that delays, fails and raises saves leaks nothing. Broken
variants are caught: no fence before the layer calls, a fence that does not wait for
its snapshot, staging rows reused while the connector still reads them."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import torch
from typing_extensions import override

from attnkit import HostMemoryTier, KVConnector, TransferHandle
from attnkit.demo import DemoModel
from attnkit.offload import DoneHandle
from attnkit.runtime import AttentionRuntime
from attnkit.runtime._offload import Offloader, _Staging
from offload_variants import FaultyTier
from test_offload import (
    BS,
    Driver,
    hit_outputs,
    offloader,
    runtime_for,
    soak,
    tokens,
)


class SlowTier(HostMemoryTier):
    """A host tier whose saves run on the worker thread and start ``delay`` seconds
    late; every ``fail_every``-th batch is dropped (a failed save: its handle says
    ``False``) and every ``raise_every``-th raises."""

    def __init__(self, delay: float = 0.01, fail_every: int = 0, raise_every: int = 0) -> None:
        super().__init__(2**26, background=True)
        self.delay, self.fail_every, self.raise_every = delay, fail_every, raise_every
        self.batches = 0
        self.threads: set[str] = set()

    @override
    def submit_save_batch(self, keys: Sequence[bytes], pages: torch.Tensor) -> TransferHandle:
        self.threads.add(threading.current_thread().name)
        self.batches += 1
        time.sleep(self.delay)
        if self.raise_every and self.batches % self.raise_every == 0:
            raise RuntimeError("the store is down")
        if self.fail_every and self.batches % self.fail_every == 0:
            return DoneHandle(False)
        return super().submit_save_batch(keys, pages)


def page_bytes_now(runtime: AttentionRuntime, group_id: int, block: int) -> bytes:
    """Group ``group_id``'s kernel block ``block`` as a page: each layer's tensors in
    order, sliced by the layout (an independent reading of the cache)."""
    planes = runtime.layouts[group_id] == "planes"
    out: list[bytes] = []
    for layer in runtime.groups[group_id].layer_names:
        for t in runtime.kv_caches[layer]:
            rows = t[block * BS : (block + 1) * BS] if planes else t[block]
            out.append(rows.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return b"".join(out)


class EvictionOracle:
    """Wraps the pool's sink: at each eviction (before anything can write the block)
    reads the block's bytes, keyed by the page's canonical id."""

    def __init__(self, runtime: AttentionRuntime) -> None:
        self.runtime = runtime
        self.off = offloader(runtime)
        self.expected: dict[bytes, bytes] = {}
        pool = runtime.manager.pool
        sink = pool.offload_sink  # type: ignore[attr-defined]  # a CachedPool's
        assert sink is not None

        def record(evicted: list[tuple[int, int, bytes]]) -> None:
            for gid, block, name in evicted:
                key = self.off.key(gid, name)
                self.expected.setdefault(key, page_bytes_now(runtime, gid, block))
            sink(evicted)

        pool.offload_sink = record  # type: ignore[attr-defined]  # a CachedPool's

    def check(self) -> int:
        """Every saved page the connector holds is what its block held at eviction;
        returns how many were checked."""
        self.off.wait_saves()
        connector = self.off.connector
        checked = 0
        for key, want in self.expected.items():
            if not connector.contains(key):
                continue
            out = torch.empty(len(want), dtype=torch.uint8)
            assert connector.submit_load(key, out).wait()
            assert out.numpy().tobytes() == want, "a saved page differs from its evicted block"
            checked += 1
        return checked


def churn(
    connector: KVConnector, *, turns: int = 12, inference: bool = False
) -> tuple[EvictionOracle, AttentionRuntime]:
    """Unique requests through a 12-page pool: each evicts the last ones' blocks and
    writes new K/V into the pages at once (the step's first layer call); with
    ``inference``, the steps run under ``torch.inference_mode`` (as engines run them)."""
    m = DemoModel(layout=("full", "window", "full"), block_size=BS, window=10, num_kv_heads=1)
    runtime = runtime_for(dict(m.specs), params=dict(m.params), pages=12, connector=connector)
    oracle = EvictionOracle(runtime)
    d = Driver(m, runtime)
    with torch.inference_mode(inference):
        for i in range(turns):
            d.turn(f"u{i}", tokens(5 * BS + 3, seed=50 + i), first_chunk=3 * BS)
    return oracle, runtime


CONNECTORS = {
    "slow-background": lambda: SlowTier(delay=0.01),
    "late-handles": lambda: FaultyTier(delay=4),
    "inline": lambda: HostMemoryTier(2**26, background=False),
}


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
@pytest.mark.parametrize("make", list(CONNECTORS.values()), ids=list(CONNECTORS))
def test_what_the_connector_holds_is_the_block_at_eviction(make: object, inference: bool) -> None:
    assert callable(make)
    connector = make()
    oracle, runtime = churn(connector, inference=inference)
    stats = runtime.prefix_cache_stats()
    assert stats.offloaded >= 40, str(stats)  # the pool was reused many times over
    assert offloader(runtime).save_errors == 0
    assert oracle.check() == len(oracle.expected)
    if isinstance(connector, SlowTier):
        assert connector.threads == {"attnkit-offload"}  # off the caller's thread


def test_begin_step_saves_nothing_and_the_first_layer_call_fences() -> None:
    """``begin_step`` only logs the step's evictions; the first layer call snapshots
    them (one job), before the step's K/V are written."""
    tier = SlowTier(delay=0.0)
    m = DemoModel(layout=("full",), block_size=BS, num_kv_heads=1)
    runtime = runtime_for(dict(m.specs), params=dict(m.params), pages=6, connector=tier)
    d = Driver(m, runtime)
    d.turn("a", tokens(4 * BS, seed=1))
    off = offloader(runtime)
    from attnkit import ScheduledRequest

    d.tokens["b"] = tokens(4 * BS, seed=2)
    runtime.begin_step([ScheduledRequest("b", 4 * BS)])  # evicts a's blocks
    assert off.needs_fence
    assert tier.batches == 0
    assert not tier.stats().pages
    evicted = [(gid, name) for gid, _, name in off._log]
    assert all(off.contains(gid, name) for gid, name in evicted), "a load would wait"
    m.forward_step(runtime, torch.tensor(d.tokens["b"]), positions=torch.arange(4 * BS))
    assert not off.needs_fence
    off.wait_saves()
    assert tier.batches == 1  # one batch for the step
    assert tier.stats().pages == 3  # the blocks it evicted (the pool had one page free)


def test_broken_contains_blind_to_the_log_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = Offloader._is_queued

    def without_the_log(self: Offloader, group_id: int, name: bytes) -> object:
        log, self._log = self._log, []
        try:
            return real(self, group_id, name)
        finally:
            self._log = log

    monkeypatch.setattr(Offloader, "_is_queued", without_the_log)
    with pytest.raises(AssertionError, match="a load would wait"):
        test_begin_step_saves_nothing_and_the_first_layer_call_fences()


def test_a_hit_on_pages_still_being_saved_equals_a_resident_hit() -> None:
    """The lookup right after the evictions finds the pages queued on the worker (the
    connector does not hold them yet): ``contains`` counts them, the load waits."""
    case = ("reference", ("full", "window", "full"), {})
    resident, rows_r, out_r, _ = hit_outputs(*case, None)
    offloaded, rows_o, out_o, runtime = hit_outputs(*case, SlowTier(delay=0.02))
    stats = runtime.prefix_cache_stats()
    assert resident.num_tokens == offloaded.num_tokens == 64, offloaded.explain()
    assert stats.offload_hit_tokens == 64
    assert stats.offload_load_failures == 0
    assert rows_r == rows_o
    assert torch.equal(out_o, out_r)


def test_soak_with_saves_that_are_late_fail_and_raise() -> None:
    before = threading.active_count()
    tier = SlowTier(delay=0.002, fail_every=3, raise_every=5)
    runtime = soak(tier)  # outputs equal caching off, no page leaks (checked there)
    off = offloader(runtime)
    with pytest.raises(RuntimeError, match="the store is down"):
        off.wait_saves()  # a raising save fails no step; the drain reports it
    off.wait_saves()
    assert off.save_errors > 0
    assert runtime.prefix_cache_stats().offload_loads > 0
    assert threading.active_count() <= max(before, 2)  # at most the one worker


# ---------------------------------------------------------------- broken variants


def test_broken_no_fence_before_the_layer_calls_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Offloader, "needs_fence", property(lambda self: False))
    oracle, _ = churn(HostMemoryTier(2**26, background=False))
    with pytest.raises(AssertionError, match="differs from its evicted block"):
        oracle.check()


def test_broken_a_fence_that_does_not_wait_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshot runs late on another thread, after the step's writes."""
    real = Offloader.fence
    late: list[threading.Thread] = []

    def fence_without_waiting(self: Offloader) -> None:
        if not self._log:
            return
        log, self._log = self._log, []

        def snapshot_later() -> None:
            time.sleep(0.05)
            self._log[:0] = log
            real(self)

        late.append(threading.Thread(target=snapshot_later))
        late[-1].start()

    monkeypatch.setattr(Offloader, "fence", fence_without_waiting)
    monkeypatch.setattr(Offloader, "needs_fence", property(lambda self: bool(self._log)))
    oracle, _ = churn(HostMemoryTier(2**26, background=False), turns=6)
    for thread in late:
        thread.join()
    with pytest.raises(AssertionError, match="differs from its evicted block"):
        oracle.check()


def test_broken_staging_reused_while_the_connector_reads_it_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_Staging, "busy", lambda self: False)
    oracle, _ = churn(FaultyTier(delay=10**6))  # saves read their rows at wait()
    with pytest.raises(AssertionError, match="differs from its evicted block"):
        oracle.check()


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="the CUDA save path (gathers on the current stream, an event, pinned slots "
    "filled on a side stream) needs a CUDA device",
)
def test_cuda_saves_hold_the_block_at_eviction() -> None:
    from attnkit import AttentionConfig, ScheduledRequest

    cuda = torch.device("cuda")
    m = DemoModel(
        layout=("full", "window", "full"), block_size=BS, window=10, num_kv_heads=1, device=cuda
    )
    tier = HostMemoryTier(2**26)
    assert tier.saves_in_background(cuda)
    config = AttentionConfig(prefix_caching={"enabled": True})

    def build(budget: int) -> AttentionRuntime:
        return AttentionRuntime(
            m.specs,
            config,
            device=cuda,
            memory_budget_bytes=budget,
            layer_params=m.params,
            kv_connector=tier,
        )

    probe = build(2**22)
    runtime = build(12 * (probe.memory_report().total_bytes // probe.num_blocks))
    oracle = EvictionOracle(runtime)
    for i in range(8):
        toks = tokens(5 * BS + 3, seed=50 + i)
        match = runtime.match_prefix(toks)
        start = match.num_tokens
        runtime.begin_step([ScheduledRequest(f"u{i}", len(toks) - start, prefix=match)])
        m.forward_step(
            runtime,
            torch.tensor(toks[start:], device=cuda),
            positions=torch.arange(start, len(toks), device=cuda),
        )
        runtime.free([f"u{i}"], token_ids={f"u{i}": toks})
    assert runtime.prefix_cache_stats().offloaded > 0
    assert oracle.check() == len(oracle.expected)


def lookup_after_a_reset(tier: KVConnector) -> tuple[int, int]:
    """``a`` computed, all its blocks evicted by ``b``'s step (logged, not yet saved),
    the prefix cache reset before ``b``'s layers run: a lookup of ``a`` then gets its
    hit tokens and load failures (no hit may come from before the reset)."""
    from attnkit import ScheduledRequest

    m = DemoModel(layout=("full",), block_size=BS, num_kv_heads=1)
    runtime = runtime_for(dict(m.specs), params=dict(m.params), pages=6, connector=tier)
    d = Driver(m, runtime)
    a = tokens(4 * BS + 1, seed=1)
    d.turn("a", a)
    b = tokens(5 * BS, seed=2)
    runtime.begin_step([ScheduledRequest("b", 5 * BS)])  # the whole pool: evicts all of a
    assert len(offloader(runtime)._log) == 4
    runtime.reset_prefix_cache()
    m.forward_step(runtime, torch.tensor(b), positions=torch.arange(5 * BS))
    runtime.free(["b"], token_ids={"b": b})
    match = runtime.match_prefix(a)
    return match.num_tokens, runtime.prefix_cache_stats().offload_load_failures


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
def test_a_reset_keeps_pages_evicted_before_it_from_hitting(background: bool) -> None:
    assert lookup_after_a_reset(SlowTier(delay=0.5) if background else HostMemoryTier(2**26)) == (
        0,
        0,
    )


def test_broken_an_epoch_bumped_before_the_log_is_saved_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The blocks evicted before the reset would be saved under the new epoch."""

    def bump_only(self: Offloader) -> None:
        self.epoch += 1

    monkeypatch.setattr(Offloader, "bump_epoch", bump_only)
    hit, _ = lookup_after_a_reset(HostMemoryTier(2**26))
    assert hit > 0  # a hit on bytes from before the reset: what the test above refuses


def test_broken_names_queued_before_a_reset_still_counted_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def bump_keeping_the_queue(self: Offloader) -> None:
        self.fence()
        self.epoch += 1

    monkeypatch.setattr(Offloader, "bump_epoch", bump_keeping_the_queue)
    _, failures = lookup_after_a_reset(SlowTier(delay=0.5))  # still queued at the lookup
    assert failures > 0  # a load of a name the tier never held under this epoch
