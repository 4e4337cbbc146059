"""Prefix caching through ``AttentionRuntime``: ``match_prefix``, a request started
from its match, generated blocks cached at ``free``, ``discard_step``,
``reset_prefix_cache``, the counters and the memory report; hits change no output on
the backends that run on CPU; rejected calls change nothing."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pydantic
import pytest
import torch

from attnkit import (
    ArgumentTypeError,
    AttentionConfig,
    BackendRegistry,
    ContextParallel,
    InvalidArgumentError,
    MissingDependencyError,
    OutOfBlocksError,
    PrefixCacheStats,
    PrefixCachingConfig,
    PrefixMatch,
    ScheduledRequest,
    StalePrefixError,
)
from attnkit.demo import PRIORITIES, DemoModel
from attnkit.kv_cache import CachedPool, CachedSlab
from attnkit.registry import BUILTIN_BACKENDS
from attnkit.runtime import AttentionRuntime
from attnkit.testing.tolerances import tolerance_for
from prefix_variants import misplace_hits

BS = 16  # the demo model's attention block size (the CPU and Triton kernels take 16)


def model(layout: Sequence[str] = ("full", "window", "full"), **sizes: int) -> DemoModel:
    return DemoModel(layout=layout, block_size=BS, window=10, chunk=16, num_kv_heads=1, **sizes)


def make_runtime(
    m: DemoModel,
    *,
    on: bool = True,
    prefer: str = "reference",
    pages: int | None = None,
    **caching: object,
) -> AttentionRuntime:
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    config = AttentionConfig.model_validate(
        {"prefix_caching": {"enabled": on, **caching}}, context={"registry": reg}
    )
    priority = {"cpu": PRIORITIES[prefer]} if PRIORITIES[prefer] else None

    def build(budget: int) -> AttentionRuntime:
        return AttentionRuntime(
            m.specs,
            config,
            device="cpu",
            memory_budget_bytes=budget,
            layer_params=m.params,
            registry=reg,
            priority=priority,
            cache_fill=float("nan"),  # a read of an unwritten slot poisons the outputs
        )

    runtime = build(2**22)
    if pages is not None:
        per_page = runtime.memory_report().total_bytes // runtime.num_blocks
        runtime = build(pages * per_page)
        assert runtime.num_blocks == pages
    random.Random(0).shuffle(runtime.manager.pool._free)  # pages in any order
    return runtime


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Driver:
    """Runs requests through a runtime and the demo model, keeping each request's
    tokens and the hidden states of the positions it computed."""

    def __init__(self, m: DemoModel, runtime: AttentionRuntime) -> None:
        self.m, self.runtime = m, runtime
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}
        self.out: dict[str, dict[int, torch.Tensor]] = {}

    def step(self, chunks: Sequence[tuple[str, int]], prefixes: dict[str, PrefixMatch]) -> None:
        for rid, match in prefixes.items():
            self.done[rid] = match.num_tokens
        scheduled = [ScheduledRequest(rid, n, prefix=prefixes.get(rid)) for rid, n in chunks]
        batch = self.runtime.begin_step(scheduled)
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


def off_outputs(m: DemoModel, prefer: str, seqs: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Each sequence alone through a runtime with caching off, in one prefill."""
    out: dict[str, torch.Tensor] = {}
    for rid, toks in seqs.items():
        driver = Driver(m, make_runtime(m, on=False, prefer=prefer))
        driver.tokens[rid] = toks
        driver.step([(rid, len(toks))], {})
        out[rid] = torch.stack([driver.out[rid][i] for i in range(len(toks))])
    return out


# ---------------------------------------------------------------------------- outputs

CASES = [
    ("reference", ("full", "window", "full")),
    ("reference", ("chunked", "full")),
    ("reference", ("sink_tokens",)),
    ("reference", ("mla", "mla_window")),
    ("default", ("full", "window", "full")),
    ("default", ("chunked", "full")),
    ("triton", ("full", "window")),
]


@pytest.mark.parametrize(
    ("prefer", "layout"), CASES, ids=[f"{p}-{'+'.join(la)}" for p, la in CASES]
)
def test_hits_change_no_output(prefer: str, layout: tuple[str, ...]) -> None:
    """A request prefilled in chunks and decoded, freed with its tokens; then a prompt
    sharing part of its prompt, one extending its generated tokens, and two requests
    sampled from one match in one step. Each request's computed rows equal what the
    same sequence gives alone with caching off."""
    hit_scenario(prefer, layout)


def test_a_hit_that_reads_the_wrong_blocks_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: the outputs check must see it."""
    misplace_hits(monkeypatch)
    with pytest.raises(AssertionError):
        hit_scenario("reference", ("full", "window", "full"))


def hit_scenario(prefer: str, layout: tuple[str, ...]) -> None:
    m = model(layout)
    runtime = make_runtime(m, prefer=prefer)
    tol = tolerance_for(torch.float32)
    d = Driver(m, runtime)
    d.tokens["a"] = tokens(70, seed=1)
    d.step([("a", 40)], {"a": runtime.match_prefix(d.tokens["a"])})  # tracked from here
    d.step([("a", 30)], {})
    for t in (5, 9, 11):  # three decodes (the tokens a sampler would pick)
        d.tokens["a"].append(t)
        d.step([("a", 1)], {})
    runtime.free(["a"], token_ids={"a": d.tokens["a"]})  # 73 tokens computed
    d.tokens["b"] = d.tokens["a"][:60] + tokens(6, seed=2)
    d.tokens["c"] = [*d.tokens["a"], 7, 7, 7, 7, 7]
    d.tokens["d"] = list(d.tokens["c"])
    hits: dict[str, PrefixMatch] = {"b": runtime.match_prefix(d.tokens["b"])}
    shared = runtime.match_prefix(d.tokens["c"])
    hits["c"] = hits["d"] = shared  # parallel sampling: one match, two requests
    served = {rid: match.num_tokens for rid, match in hits.items()}
    if "sink_tokens" in layout:  # blocks of 16 shifted by 4 sink slots: hits end at 16k - 4
        assert served["b"] == 60, hits["b"].explain()
    else:
        assert served["b"] == 48, hits["b"].explain()  # blocks 0..2 (block 3 differs)
        assert served["c"] == 64, shared.explain()  # prompt and generated blocks
    d.step([(rid, len(d.tokens[rid]) - served[rid]) for rid in ("b", "c", "d")], hits)
    expected = off_outputs(m, prefer, {rid: d.tokens[rid] for rid in ("b", "c", "d")})
    for rid in ("b", "c", "d"):
        rows = sorted(d.out[rid])
        assert rows == list(range(served[rid], len(d.tokens[rid])))
        got = torch.stack([d.out[rid][i] for i in rows])
        torch.testing.assert_close(got, expected[rid][served[rid] :], atol=tol.atol, rtol=tol.rtol)
    stats = runtime.prefix_cache_stats()
    assert (stats.queries, stats.hits) == (3, 2)
    assert stats.hit_tokens == served["b"] + served["c"]


def test_a_hit_request_writes_only_blocks_of_its_own() -> None:
    """The slots a step writes lie in blocks with one holder and no name."""
    m = model()
    runtime = make_runtime(m)
    d = Driver(m, runtime)
    d.tokens["a"] = tokens(65, seed=3)
    d.step([("a", 65)], {"a": runtime.match_prefix(d.tokens["a"])})
    d.tokens["b"] = list(d.tokens["a"])
    match = runtime.match_prefix(d.tokens["b"])
    assert match.num_tokens == 64
    runtime.begin_step([ScheduledRequest("b", 1, prefix=match)])
    for group in runtime.groups:
        slab = runtime.manager.cached_slabs[group.group_id]
        assert isinstance(slab, CachedSlab)
        common = runtime._groups[group.group_id].common
        assert common is not None
        written = (common.slot_mapping // group.spec.block_size).tolist()
        assert written
        assert all(slab.refs[b] == 1 for b in written)
        assert not any(slab.named[b] for b in written)


# ---------------------------------------------------------------------------- rejected calls


def manager_state(runtime: AttentionRuntime) -> tuple[object, ...]:
    mgr = runtime.manager
    pool = mgr.pool
    assert isinstance(pool, CachedPool)
    idle = tuple(pool.idle)  # (first: reading the idle pages sorts the given-back ones)
    return (
        tuple(pool._free),
        idle,
        len(mgr),
        tuple(
            None if s is None else (s.refs.tobytes(), tuple(s.block_of.items()))
            for s in mgr.cached_slabs
        ),
    )


def test_out_of_blocks_with_a_hit_changes_nothing() -> None:
    m = model(("full",))
    runtime = make_runtime(m, pages=8)  # 7 usable pages
    d = Driver(m, runtime)
    d.tokens["a"] = tokens(65, seed=4)  # 5 pages, 4 of them named
    d.step([("a", 65)], {"a": runtime.match_prefix(d.tokens["a"])})
    runtime.free(["a"])
    prompt = d.tokens["a"][:64] + tokens(60, seed=5)  # hits 64, needs 4 new pages
    match = runtime.match_prefix(prompt)
    assert match.num_tokens == 64
    before = manager_state(runtime), runtime.prefix_cache_stats()
    with pytest.raises(OutOfBlocksError, match="hold only cached blocks"):
        runtime.begin_step([ScheduledRequest("b", 60, prefix=match)])
    assert (manager_state(runtime), runtime.prefix_cache_stats()) == before
    d.tokens["b"] = prompt
    d.step([("b", 48)], {"b": match})  # 3 new pages fit
    assert runtime.manager.num_tokens("b") == 112


def test_an_evicted_hit_is_refused_and_changes_nothing() -> None:
    m = model(("full",))
    runtime = make_runtime(m, pages=6)  # 5 usable pages
    d = Driver(m, runtime)
    d.tokens["a"] = tokens(33, seed=6)
    d.step([("a", 33)], {"a": runtime.match_prefix(d.tokens["a"])})
    runtime.free(["a"])
    match = runtime.match_prefix(d.tokens["a"])
    assert match.num_tokens == 32
    d.tokens["big"] = tokens(80, seed=7)
    d.step([("big", 80)], {})  # every page: the cached ones are evicted
    before = manager_state(runtime)
    with pytest.raises(StalePrefixError, match="evicted since match_prefix"):
        runtime.begin_step([ScheduledRequest("a2", 1, prefix=match)])
    assert manager_state(runtime) == before
    assert "was evicted" in runtime.match_prefix(d.tokens["a"]).explain()


def test_a_match_of_another_runtime_is_refused() -> None:
    m = model(("full",))
    one, two = make_runtime(m), make_runtime(m)
    with pytest.raises(StalePrefixError, match="another runtime"):
        two.begin_step([ScheduledRequest("r", 3, prefix=one.match_prefix([1, 2, 3]))])


# ---------------------------------------------------------------------------- the calls


def test_discard_step_names_nothing_of_the_failed_step() -> None:
    m = model(("full",))
    runtime = make_runtime(m)
    prompt = tokens(40, seed=8)
    runtime.begin_step([ScheduledRequest("a", 40, prefix=runtime.match_prefix(prompt))])
    runtime.discard_step()  # the model call failed: its blocks hold nothing valid
    assert runtime.match_prefix(prompt).num_tokens == 0
    runtime.free(["a"], token_ids={"a": prompt})
    assert runtime.prefix_cache_stats().cached_blocks == 0


def test_reset_prefix_cache_forgets_every_block() -> None:
    m = model(("full",))
    runtime = make_runtime(m)
    d = Driver(m, runtime)
    d.tokens["a"] = tokens(50, seed=9)
    d.step([("a", 50)], {"a": runtime.match_prefix(d.tokens["a"])})
    assert runtime.match_prefix(d.tokens["a"]).num_tokens == 48
    assert runtime.reset_prefix_cache() == 3
    stats = runtime.prefix_cache_stats()
    assert (stats.cached_blocks, stats.queries) == (0, 2)
    assert runtime.match_prefix(d.tokens["a"]).num_tokens == 0
    assert runtime.manager.num_tokens("a") == 50  # still running, on its own blocks


def test_stats_and_memory_report_say_what_the_cache_holds() -> None:
    m = model(("full", "window"))
    runtime = make_runtime(m)
    d = Driver(m, runtime)
    d.tokens["a"] = tokens(40, seed=10)
    d.step([("a", 40)], {"a": runtime.match_prefix(d.tokens["a"])})
    runtime.free(["a"])
    assert runtime.match_prefix(d.tokens["a"]).num_tokens == 32
    stats = runtime.prefix_cache_stats()
    assert stats == PrefixCacheStats(
        queries=2, query_tokens=80, hits=1, hit_tokens=32, cached_blocks=4, cached_free_blocks=4
    )
    report = runtime.memory_report()
    assert [(g.cached_blocks, g.cached_free_blocks) for g in report.groups] == [(2, 2), (2, 2)]
    page = runtime.page_size_bytes // runtime.groups[0].blocks_per_page
    assert report.groups[0].cached_bytes == 2 * page
    assert "prefix cache: 2 named block(s)" in report.describe()
    off = make_runtime(m, on=False)
    assert off.prefix_cache_stats() == PrefixCacheStats()
    assert off.memory_report().groups[0].cached_blocks is None
    assert off.reset_prefix_cache() == 0
    off.discard_step()  # a no-op


def test_state_layers_say_they_have_no_checkpoint() -> None:
    m = model(("full", "mamba"))
    runtime = make_runtime(m)
    d = Driver(m, runtime)
    d.tokens["a"] = tokens(40, seed=11)
    d.step([("a", 40)], {"a": runtime.match_prefix(d.tokens["a"])})
    match = runtime.match_prefix(d.tokens["a"])
    assert match.num_tokens == 0
    assert match.group_hits[0].length == 32
    assert match.limiting_group == 1
    assert "no state checkpoint at token 39" in match.explain()


def test_salts_and_adapters_keep_requests_apart() -> None:
    m = model(("full",))
    runtime = make_runtime(m)
    d = Driver(m, runtime)
    prompt = tokens(33, seed=12)
    d.tokens["a"] = prompt
    d.step([("a", 33)], {"a": runtime.match_prefix(prompt, cache_salt="t1")})
    assert runtime.match_prefix(prompt, cache_salt="t1").num_tokens == 32
    assert runtime.match_prefix(prompt, cache_salt="t1", adapter_id="lora-2").num_tokens == 0
    other = runtime.match_prefix(prompt, cache_salt="t2")
    assert other.num_tokens == 0
    assert "different cache salt" in other.explain()


def test_errors_name_the_argument() -> None:
    m = model(("full",))
    off = make_runtime(m, on=False)
    with pytest.raises(InvalidArgumentError, match="match_prefix: prefix caching is off"):
        off.match_prefix([1, 2, 3])
    runtime = make_runtime(m)
    match = runtime.match_prefix([1, 2, 3])
    with pytest.raises(
        InvalidArgumentError, match="request 'r' brings a prefix match but prefix caching is off"
    ):
        off.begin_step([ScheduledRequest("r", 3, prefix=match)])
    with pytest.raises(InvalidArgumentError, match="prompt_token_ids must hold at least one token"):
        runtime.match_prefix([])
    with pytest.raises(InvalidArgumentError, match=r"prompt_token_ids\[1\] must be a token id"):
        runtime.match_prefix([1, -1])
    with pytest.raises(ArgumentTypeError, match="cache_salt must be a str"):
        runtime.match_prefix([1], cache_salt=3)  # type: ignore[arg-type]  # the wrong type on purpose
    with pytest.raises(ArgumentTypeError, match="request 'r': prefix must be a PrefixMatch"):
        ScheduledRequest("r", 1, prefix="abc")  # type: ignore[arg-type]  # the wrong type on purpose
    runtime.begin_step([ScheduledRequest("r", 3, prefix=match)])
    with pytest.raises(ArgumentTypeError, match="token_ids must be a mapping"):
        runtime.free(["r"], token_ids=[1, 2, 3])  # type: ignore[arg-type]  # the wrong type on purpose
    with pytest.raises(InvalidArgumentError, match=r"token_ids names request\(s\) \['x'\]"):
        runtime.free(["r"], token_ids={"x": [1]})
    with pytest.raises(
        InvalidArgumentError, match=r"token_ids\['r'\] must be the request's tokens"
    ):
        runtime.free(["r"], token_ids={"r": [9, 9, 9, 9]})
    assert "r" in runtime.manager  # nothing was freed
    runtime.free(["r"], token_ids={"r": [1, 2, 3, 4]})


def test_context_parallelism_and_prefix_caching_are_refused_together() -> None:
    class Member:
        rank, world_size = 0, 2

        def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
            raise AssertionError("not called")

    m = model(("full",))
    with pytest.raises(InvalidArgumentError, match="does not run with decode context parallelism"):
        AttentionRuntime(
            m.specs,
            AttentionConfig(prefix_caching={"enabled": True}),
            device="cpu",
            memory_budget_bytes=2**20,
            layer_params=m.params,
            context_parallel=ContextParallel(Member()),
        )


def test_the_config_section() -> None:
    assert AttentionConfig().prefix_caching == PrefixCachingConfig()
    assert not AttentionConfig().prefix_caching.enabled
    config = AttentionConfig(prefix_caching={"enabled": True, "model_revision": "r1"})
    assert config.prefix_caching.enabled
    assert "prefix_caching=on (sha256, revision 'r1')" in config.describe()
    for bad in ({"enabled": 1}, {"hash": "md5"}, {"enabled": True, "extra": 1}):
        with pytest.raises(pydantic.ValidationError):
            AttentionConfig(prefix_caching=bad)


def test_the_xxh3_hash_names_its_extra_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    real = importlib.import_module

    def no_xxhash(name: str, package: str | None = None) -> object:
        if name == "xxhash":
            raise ImportError("no xxhash here")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", no_xxhash)
    with pytest.raises(MissingDependencyError, match=r"attnkit\[xxhash\]"):
        make_runtime(model(("full",)), hash="xxh3_128")


def _chunked_rows(prompt: int, *, on: bool) -> tuple[int, dict[int, torch.Tensor]]:
    """One chunked-local layer (block 16, chunk 32) on ``reference``: with caching on, a
    fresh runtime's match and the rows computed from it; off: every row computed."""
    from attnkit import AttentionLayerParams, ChunkedLocalAttentionSpec

    spec = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32,
        attention_chunk_size=32,
    )
    config = AttentionConfig(backend="reference", prefix_caching={"enabled": on}, max_model_len=256)
    rt = AttentionRuntime(
        {"l": spec}, config, device="cpu", memory_budget_bytes=spec.page_size_bytes * 64,
        layer_params={"l": AttentionLayerParams(num_heads=4)}, cache_fill=float("nan"),
    )
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(prompt, h, 32, generator=gen) for h in (4, 2, 2))
    match = rt.match_prefix(list(range(prompt))) if on else None
    start = match.num_tokens if match is not None else 0
    rt.begin_step([ScheduledRequest("x", prompt - start, prefix=match)])
    out = rt.forward("l", q[start:], k[start:], v[start:])
    return start, {start + i: out[i] for i in range(prompt - start)}


def test_a_chunked_local_layer_hits_at_a_chunk_boundary_without_cached_blocks() -> None:
    """Queries from a chunk boundary on read nothing before it: a fresh cache serves the
    boundary (no block needed), and the rows from there equal the ones computed with
    every token."""
    start, got = _chunked_rows(55, on=True)
    assert start == 32
    _, want = _chunked_rows(55, on=False)
    for pos, row in got.items():
        torch.testing.assert_close(row, want[pos], rtol=1e-5, atol=1e-5)
