"""KV-cache layouts: a backend declaring ``kv_cache_layout = "planes"`` gets token-major
K and V planes that are views of the runtime's buffers, computes what the reference
backend computes, and pays for a second buffer set only when the model also has
page-major groups (which the memory report and the log say)."""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections.abc import Sequence
from typing import ClassVar

import pytest
import torch
from typing_extensions import override

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionSpec,
    BackendNotSupportedError,
    BackendRegistry,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    InvalidBackendError,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    select_backend,
)
from attnkit.backend_api import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    BackendRequest,
    CommonAttentionMetadata,
    KVCacheLayout,
    bind_builder,
    bind_each,
)
from attnkit.demo import DemoModel
from attnkit.kernels.attention.reference import dense_attention
from attnkit.kinds import rules_for
from attnkit.kv_cache import (
    NULL_BLOCK,
    allocate_kv_cache_tensors,
    buffers_per_set,
    group_layers,
    num_blocks_for_budget,
    unify_page_sizes,
)
from attnkit.registry import BUILTIN_BACKENDS
from attnkit.runtime import AttentionRuntime, ScheduledRequest

CPU = torch.device("cpu")

# ---------------------------------------------------------------------------- a planes backend
# Written as an out-of-tree author would: only attnkit.backend_api, attnkit and the
# pure-torch dense kernel. It reads K/V rows out of the planes by slot and runs dense
# attention per request: a computation independent of the reference's paged kernels.


@dataclasses.dataclass(frozen=True)
class PlanesMeta:
    num_actual_tokens: int
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    sliding_window: int | None


class PlanesBuilder(AttentionMetadataBuilder[PlanesMeta, AttentionSpec]):
    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> PlanesMeta:
        cm = common_attn_metadata
        spec = self.kv_cache_spec
        return PlanesMeta(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=[int(x) for x in cm.query_start_loc_cpu],
            seq_lens=[int(x) for x in cm.seq_lens_cpu],
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            sliding_window=spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None,
        )


class PlanesImpl(AttentionImpl[PlanesMeta, AttentionSpec, AttentionLayerParams]):
    received: ClassVar[list[tuple[torch.Tensor, ...]]] = []
    """Every ``kv_cache`` any impl of this class was handed (tests clear it)."""

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: PlanesMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        PlanesImpl.received.append(tuple(kv_cache))
        k_plane, v_plane = kv_cache
        meta = attn_metadata
        assert key is not None
        assert value is not None
        n = meta.num_actual_tokens
        slots = meta.slot_mapping[:n]
        write = slots >= 0
        k_plane[slots[write]] = key[:n][write].to(k_plane.dtype)
        v_plane[slots[write]] = value[:n][write].to(v_plane.dtype)
        bs = self.kv_cache_spec.block_size
        scale = self.layer_params.scale or self.kv_cache_spec.head_size**-0.5
        qsl = meta.query_start_loc
        for b, seq_len in enumerate(meta.seq_lens):
            pos = torch.arange(seq_len)
            rows = meta.block_table[b, pos // bs].long() * bs + pos % bs
            output[qsl[b] : qsl[b + 1]] = dense_attention(
                query[qsl[b] : qsl[b + 1]],
                k_plane[rows],
                v_plane[rows],
                scale=scale,
                causal=True,
                sliding_window=meta.sliding_window,
            )
        return output


class PlanesBackend(AttentionBackend):
    name = "toy_planes"
    kv_cache_layout: ClassVar[KVCacheLayout] = "planes"
    supported_devices = frozenset({"cpu"})
    builders = bind_each((FullAttentionSpec, SlidingWindowSpec), PlanesBuilder, PlanesImpl)


class PlanesForMLABackend(AttentionBackend):
    """Declares planes and binds MLA: the layout cannot be honoured for MLA."""

    name = "toy_planes_mla"
    kv_cache_layout: ClassVar[KVCacheLayout] = "planes"
    builders = (
        bind_builder(FullAttentionSpec, PlanesBuilder, PlanesImpl),
        bind_builder(MLAAttentionSpec, PlanesBuilder, PlanesImpl),
    )


@pytest.fixture(autouse=True)
def _clear_received() -> None:
    PlanesImpl.received.clear()


def registry() -> BackendRegistry:
    reg = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    reg.register(PlanesBackend)
    reg.register(PlanesForMLABackend)
    return reg


def make_runtime(
    model: DemoModel, per_kind: dict[str, str], *, budget: int, shuffle: int
) -> AttentionRuntime:
    reg = registry()
    config = AttentionConfig.model_validate(
        {"backend_per_kind": per_kind}, context={"registry": reg}
    )
    runtime = AttentionRuntime(
        model.specs,
        config,
        device="cpu",
        memory_budget_bytes=budget,
        layer_params=model.params,
        registry=reg,
        cache_fill=float("nan"),
    )
    # Hand out physical blocks in a shuffled order: nothing may rely on contiguity.
    random.Random(shuffle).shuffle(runtime.manager.pool._free)
    return runtime


Step = list[tuple[str, int]]

SCHEDULE: list[tuple[Step, list[str]]] = [
    ([("a", 7), ("b", 3)], []),  # a: first chunk of a long prompt
    ([("a", 13), ("b", 1), ("c", 5)], []),  # chunked prefill beside a decode
    ([("a", 11), ("b", 1), ("c", 1)], []),  # a's last chunk
    ([("a", 1), ("b", 1), ("c", 1)], []),
    ([("a", 1), ("c", 1), ("d", 9)], ["b"]),  # b finishes, its blocks are reused
    ([("a", 1), ("c", 1), ("d", 1)], []),
    ([("a", 1), ("d", 1)], []),
]


def run(
    model: DemoModel, runtime: AttentionRuntime, *, seed: int = 0, check_blocks: bool = False
) -> dict[str, torch.Tensor]:
    """Run ``SCHEDULE`` (random tokens from ``seed``); each request's outputs, concatenated."""
    gen = torch.Generator().manual_seed(seed)
    outputs: dict[str, list[torch.Tensor]] = {}
    for step, finished in SCHEDULE:
        tokens = {rid: torch.randint(0, 64, (n,), generator=gen) for rid, n in step}
        batch = runtime.begin_step([ScheduledRequest(rid, n) for rid, n in step], finished=finished)
        hidden = model.forward_step(runtime, torch.cat([tokens[rid] for rid in batch.order]))
        for rid, rows in batch.token_slices().items():
            outputs.setdefault(rid, []).append(hidden[rows])
        if check_blocks:
            assert_no_block_used_twice(runtime)
    return {rid: torch.cat(parts) for rid, parts in outputs.items()}


def assert_no_block_used_twice(runtime: AttentionRuntime) -> None:
    """Every live (non-null) block of every group's tables belongs to one table entry."""
    used: list[int] = []
    for group in runtime.groups:
        if not group.has_cache:
            continue
        for rid in runtime.manager.owned_blocks():
            used.extend(
                b for b in runtime.block_table(group.layer_names[0], rid) if b != NULL_BLOCK
            )
    assert len(used) == len(set(used)), sorted(used)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for rid in want:
        assert not bool(torch.isnan(want[rid]).any())
        torch.testing.assert_close(got[rid], want[rid], atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------- shapes and reasons


def full(heads: int = 2, head_size: int = 16, block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=torch.float32
    )


MLA = MLAAttentionSpec(block_size=16, head_size=64, dtype=torch.float32)
MAMBA = MambaSpec(
    block_size=16,
    shapes=((96, 3), (4, 16, 16)),
    dtypes=(torch.float32, torch.float32),
    mamba_type="mamba2",
)


def test_planes_shapes_are_token_major_k_and_v() -> None:
    spec = full(heads=2, head_size=16, block_size=16)
    assert PlanesBackend.get_kv_cache_shapes(10, spec) == ((160, 2, 16), (160, 2, 16))
    window = SlidingWindowSpec(
        block_size=8, num_kv_heads=4, head_size=32, dtype=torch.float32, sliding_window=5
    )
    assert PlanesBackend.get_kv_cache_shapes(3, window) == ((24, 4, 32), (24, 4, 32))
    # The default stays interleaved, and the kind rules give both.
    assert AttentionBackend.kv_cache_layout == "interleaved"
    assert AttentionBackend.get_kv_cache_shapes(10, spec) == ((10, 2, 16, 2, 16),)
    rules = rules_for(spec)
    assert rules.cache_shapes(spec, 10) == ((10, 2, 16, 2, 16),)
    assert rules.cache_shapes(spec, 10, "planes") == ((160, 2, 16), (160, 2, 16))
    encoder = EncoderOnlyAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32
    )
    assert rules_for(encoder).cache_shapes(encoder, 10, "planes") == ()
    with pytest.raises(ValueError, match=r"kind mla_attention has no 'planes' cache layout"):
        rules_for(MLA).cache_shapes(MLA, 10, "planes")
    with pytest.raises(ValueError, match=r"kind mamba has no 'planes' cache layout"):
        rules_for(MAMBA).cache_shapes(MAMBA, 10, "planes")


def test_a_planes_backend_is_rejected_for_mla_with_a_reason_naming_the_layout() -> None:
    reasons = PlanesForMLABackend.not_supported_reasons(BackendRequest(spec=MLA, device=CPU))
    assert reasons == [
        "kv_cache_layout=planes not supported: kind mla_attention has no 'planes' cache "
        "layout: an MLA cache holds one latent per token, not separate K and V "
        "(layouts: interleaved)"
    ]
    assert PlanesForMLABackend.not_supported_reasons(BackendRequest(spec=full(), device=CPU)) == []
    reg = registry()
    # Named explicitly: an error with the reason, never a silent fallback.
    config = AttentionConfig.model_validate(
        {"backend_per_kind": {"mla_attention": "toy_planes_mla"}}, context={"registry": reg}
    )
    with pytest.raises(BackendNotSupportedError, match=r"kv_cache_layout=planes not supported"):
        select_backend(MLA, config, device=CPU, registry=reg)
    # Through the priority list: skipped, and the explanation says why.
    selection = select_backend(
        MLA,
        AttentionConfig(),
        device=CPU,
        registry=reg,
        priority={"cpu": ("toy_planes_mla", "reference")},
    )
    assert selection.backend_name == "reference"
    assert "toy_planes_mla" in selection.explain()
    assert "kv_cache_layout=planes not supported" in selection.explain()


def test_a_layout_that_does_not_exist_is_a_declaration_problem(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Misspelled(AttentionBackend):
        name = "toy_misspelled"
        builders = (bind_builder(FullAttentionSpec, PlanesBuilder, PlanesImpl),)

    # What an untyped plugin can declare (a type checker would refuse it).
    monkeypatch.setattr(Misspelled, "kv_cache_layout", "plane")

    with pytest.raises(
        InvalidBackendError,
        match=r"kv_cache_layout must be one of 'interleaved', 'planes', got 'plane'",
    ):
        registry().register(Misspelled)


# ---------------------------------------------------------------------------- allocation


def test_budget_counts_one_buffer_per_layer_of_each_set() -> None:
    groups, page = unify_page_sizes(group_layers({"a0": full(), "m": MAMBA, "a1": full()}))
    assert page == 8192  # 4096 B attention pages, scaled to hold the 5248 B state
    assert buffers_per_set(groups) == {"page_major": 2}
    assert buffers_per_set(groups, {0: "planes", 1: "interleaved"}) == {
        "planes": 2,
        "page_major": 1,
    }
    budget = 10 * 3 * page + 5
    assert num_blocks_for_budget(groups, page, budget) == 15
    assert num_blocks_for_budget(groups, page, budget, {0: "planes"}) == 10


def test_plane_groups_of_any_geometry_put_a_page_at_the_same_bytes() -> None:
    # Two planes groups with one page size but different heads (so a page holds one
    # and two kernel blocks of 16 tokens) alias one buffer: page c is the same bytes in
    # both.
    groups, page = unify_page_sizes(group_layers({"a": full(heads=2), "b": full(heads=1)}))
    assert [g.spec.block_size for g in groups] == [16, 16]
    assert [g.blocks_per_page for g in groups] == [1, 2]
    nb = 6
    layouts: dict[int, KVCacheLayout] = {0: "planes", 1: "planes"}
    shapes = {
        g.group_id: PlanesBackend.get_kv_cache_shapes(nb * g.blocks_per_page, g.spec)
        for g in groups
    }
    caches = allocate_kv_cache_tensors(
        groups, shapes, num_blocks=nb, page_size_bytes=page, device=CPU, fill=0.0, layouts=layouts
    )
    (ka, va), (kb, vb) = caches["a"], caches["b"]
    assert ka.shape == (nb * 16, 2, 16)
    assert kb.shape == (nb * 32, 1, 16)
    storage = ka.untyped_storage()
    assert storage.nbytes() == nb * page  # one buffer of NB * P bytes ...
    for plane in (va, kb, vb):  # ... viewed by both groups
        assert plane.untyped_storage().data_ptr() == storage.data_ptr()
    for block in range(1, nb):
        ka.zero_()
        ka[block * 16 : (block + 1) * 16] = 1.0  # group a writes page `block`'s K rows
        touched = (kb != 0).any(dim=(1, 2))
        assert torch.equal(touched.nonzero().flatten(), torch.arange(block * 32, (block + 1) * 32))
        assert bool((va == 0).all())
        assert bool((vb == 0).all())


def test_planes_are_views_of_their_buffer_and_the_null_block_is_zero() -> None:
    groups, page = unify_page_sizes(group_layers({"a0": full(), "a1": full()}))
    nb, bs = 5, 16
    shapes = {0: PlanesBackend.get_kv_cache_shapes(nb, groups[0].spec)}
    caches = allocate_kv_cache_tensors(
        groups,
        shapes,
        num_blocks=nb,
        page_size_bytes=page,
        device=CPU,
        fill=float("nan"),
        layouts={0: "planes"},
    )
    row_bytes = 2 * 16 * 4  # Hkv * D * float32
    seen: set[int] = set()
    for layer in ("a0", "a1"):
        k, v = caches[layer]
        storage = k.untyped_storage()
        seen.add(storage.data_ptr())
        assert storage.nbytes() == nb * page
        assert k.data_ptr() == storage.data_ptr()
        assert v.untyped_storage().data_ptr() == storage.data_ptr()
        assert v.data_ptr() == storage.data_ptr() + nb * page // 2
        assert bool((k[:bs] == 0).all())
        assert bool((v[:bs] == 0).all())
        assert bool(torch.isnan(k[bs:]).all())
        assert bool(torch.isnan(v[bs:]).all())
        # Writing through the plane writes the buffer: slot s of K at s * row_bytes,
        # of V at half the buffer further.
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        slot = 3 * bs + 5
        k[slot] = 7.0
        v[slot] = -2.0
        k_bytes = raw[slot * row_bytes : (slot + 1) * row_bytes].view(torch.float32)
        v_start = nb * page // 2 + slot * row_bytes
        v_bytes = raw[v_start : v_start + row_bytes].view(torch.float32)
        assert bool((k_bytes == 7.0).all())
        assert bool((v_bytes == -2.0).all())
    assert len(seen) == 2  # one buffer per layer of the group


def test_planes_allocation_errors() -> None:
    groups, page = unify_page_sizes(group_layers({"a": full()}))
    planes: dict[int, KVCacheLayout] = {0: "planes"}
    with pytest.raises(ValueError, match=r"needs two cache tensors \(the K and V planes\), got 1"):
        allocate_kv_cache_tensors(
            groups,
            {0: ((64, 2, 16),)},
            num_blocks=4,
            page_size_bytes=page,
            device=CPU,
            layouts=planes,
        )
    with pytest.raises(
        ValueError,
        match=r"plane shape \(4, 2, 16\) must start with num_blocks \* block_size = 4 \* 16 = 64",
    ):
        allocate_kv_cache_tensors(
            groups,
            {0: ((4, 2, 16), (4, 2, 16))},
            num_blocks=4,
            page_size_bytes=page,
            device=CPU,
            layouts=planes,
        )
    with pytest.raises(
        ValueError, match=r"take 1024 bytes but must fill half a page \(4096 / 2 = 2048"
    ):
        allocate_kv_cache_tensors(
            groups,
            {0: ((64, 1, 16), (64, 1, 16))},
            num_blocks=4,
            page_size_bytes=page,
            device=CPU,
            layouts=planes,
        )


# ---------------------------------------------------------------------------- runtime


def test_planes_backend_matches_reference_over_a_ragged_schedule() -> None:
    model = DemoModel(layout=("full", "window", "full", "window"), window=5, block_size=4)
    budget = 1 << 20
    planes = make_runtime(
        model,
        {"full_attention": "toy_planes", "sliding_window": "toy_planes"},
        budget=budget,
        shuffle=1,
    )
    reference = make_runtime(
        model,
        {"full_attention": "reference", "sliding_window": "reference"},
        budget=budget,
        shuffle=2,
    )
    assert {r.backend for r in planes.routing_table()} == {"toy_planes"}
    got = run(model, planes, check_blocks=True)
    assert_same(got, run(model, reference))
    # Every step, every layer: the impl got the runtime's own plane views.
    assert len(PlanesImpl.received) == len(SCHEDULE) * 4
    views = {tuple(t.data_ptr() for t in c) for c in planes.kv_caches.values()}
    for kv in PlanesImpl.received:
        assert tuple(t.data_ptr() for t in kv) in views


def test_impl_writes_through_the_planes_into_the_buffer() -> None:
    model = DemoModel(layout=("full",), block_size=4)
    runtime = make_runtime(model, {"full_attention": "toy_planes"}, budget=1 << 16, shuffle=3)
    k, v = runtime.kv_caches["layers.0"]
    storage = k.untyped_storage()
    assert (k.data_ptr(), v.data_ptr()) == (
        storage.data_ptr(),
        storage.data_ptr() + runtime.num_blocks * runtime.page_size_bytes // 2,
    )
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    batch = runtime.begin_step([ScheduledRequest("r", 6)])
    q = torch.randn(6, 4, 16)
    key, value = torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    runtime.forward("layers.0", q, key, value)
    (received,) = PlanesImpl.received
    assert received[0] is k
    assert received[1] is v
    # Token t of the request sits at slot table[t // 4] * 4 + t % 4: its K and V rows
    # in the raw buffer hold exactly what was written.
    table = runtime.block_table("layers.0", "r")
    row_bytes = 2 * 16 * 4
    half = runtime.num_blocks * runtime.page_size_bytes // 2
    for t in range(batch.num_tokens):
        slot = table[t // 4] * 4 + t % 4
        k_row = raw[slot * row_bytes : (slot + 1) * row_bytes].view(torch.float32)
        v_row = raw[half + slot * row_bytes : half + (slot + 1) * row_bytes].view(torch.float32)
        assert torch.equal(k_row, key[t].flatten())
        assert torch.equal(v_row, value[t].flatten())


def test_hybrid_planes_and_mamba_use_two_buffer_sets_and_say_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = DemoModel(layout=("full", "mamba", "full"))
    # Hand computation: attention pages are 2 * 16 * 2 * 16 * 4 = 4096 B, the Mamba2
    # state 96 * 3 * 4 + 4 * 16 * 16 * 4 = 5248 B, so P = 8192 (attention blocks of 32).
    page = 8192
    budget = 60 * page * 3 + 100  # two plane buffers (2 full layers) + one page-major
    with caplog.at_level(logging.INFO, logger="attnkit.runtime"):
        runtime = make_runtime(
            model, {"full_attention": "toy_planes", "mamba": "reference"}, budget=budget, shuffle=4
        )
    assert runtime.page_size_bytes == page
    assert runtime.num_blocks == 60
    report = runtime.memory_report()
    assert report.buffers == {"planes": 2, "page_major": 1}
    assert report.set_bytes == {"planes": 2 * 60 * page, "page_major": 60 * page}
    assert report.total_bytes == 3 * 60 * page
    assert report.extra_bytes == 60 * page  # the page-major set a single set would not need
    assert report.num_blocks_one_set == budget // (2 * page) == 90
    rows = [
        (g.group_id, g.kind.value, g.backend, g.layout, g.buffer_set, g.num_layers, g.bytes)
        for g in report.groups
    ]
    assert rows == [
        (0, "full_attention", "toy_planes", "planes", "planes", 2, 2 * 60 * page),
        (1, "mamba", "reference", "interleaved", "page_major", 1, 60 * page),
    ]
    (k0, v0), (k2, _) = runtime.kv_caches["layers.0"], runtime.kv_caches["layers.2"]
    assert k0.shape == (60 * 32, 2, 16) == v0.shape
    # The Mamba states and the planes live in different buffers.
    plane_storages = {k0.untyped_storage().data_ptr(), k2.untyped_storage().data_ptr()}
    for state in runtime.kv_caches["layers.1"]:
        assert state.untyped_storage().data_ptr() not in plane_storages
        assert state.untyped_storage().nbytes() == 60 * page
    logged = [r.getMessage() for r in caplog.records if r.name == "attnkit.runtime"]
    assert len(logged) == 1
    assert f"the second set costs {60 * page} B" in logged[0]
    assert (
        "group 0 (full_attention, backend toy_planes, 2 layer(s)): layout planes, block size "
        "16, 2 per page, buffer set planes" in logged[0]
    )
    assert (
        "group 1 (mamba, backend reference, 1 layer(s)): layout interleaved, buffer set page_major"
        in logged[0]
    )
    assert report.describe() == logged[0]
    # Several steps: no block is used twice, and the outputs are the reference model's.
    reference = make_runtime(
        model, {"full_attention": "reference", "mamba": "reference"}, budget=budget, shuffle=5
    )
    assert reference.memory_report().buffers == {"page_major": 2}
    assert_same(run(model, runtime, check_blocks=True), run(model, reference))


def test_planes_next_to_interleaved_attention_never_collide() -> None:
    # Full attention on planes, sliding window on the reference (page-major): two sets.
    model = DemoModel(layout=("full", "window", "full"), window=5, block_size=4)
    mixed = make_runtime(
        model,
        {"full_attention": "toy_planes", "sliding_window": "reference"},
        budget=1 << 18,
        shuffle=6,
    )
    assert mixed.memory_report().buffers == {"planes": 2, "page_major": 1}
    reference = make_runtime(model, {}, budget=1 << 18, shuffle=7)
    assert_same(run(model, mixed, check_blocks=True), run(model, reference))


def test_an_all_planes_model_costs_what_an_interleaved_one_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = DemoModel(layout=("full", "window", "full"), window=5)
    budget = 1 << 20
    with caplog.at_level(logging.INFO, logger="attnkit.runtime"):
        planes = make_runtime(
            model,
            {"full_attention": "toy_planes", "sliding_window": "toy_planes"},
            budget=budget,
            shuffle=8,
        )
    interleaved = make_runtime(
        model,
        {"full_attention": "reference", "sliding_window": "reference"},
        budget=budget,
        shuffle=9,
    )
    ours, theirs = planes.memory_report(), interleaved.memory_report()
    assert ours.buffers == {"planes": 2}
    assert theirs.buffers == {"page_major": 2}
    assert planes.num_blocks == interleaved.num_blocks == budget // (2 * planes.page_size_bytes)
    assert ours.total_bytes == theirs.total_bytes
    assert ours.extra_bytes == 0
    assert ours.num_blocks_one_set == planes.num_blocks
    assert "cannot alias" not in caplog.text
    storages = {t.untyped_storage().data_ptr() for c in planes.kv_caches.values() for t in c}
    assert len(storages) == 2  # layer j of both groups shares buffer j
    assert (
        math.prod(planes.kv_caches["layers.1"][0].shape) * 4 * 2
        == planes.num_blocks * planes.page_size_bytes
    )
