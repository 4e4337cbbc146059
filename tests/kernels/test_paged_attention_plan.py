"""The paged-attention plan (``attnkit.kernels.attention.triton``): metadata
validated once per step, layer tensors checked against it, the query-tile grid and its
efficiency, the split-KV chooser, and ragged batches checked against the torch oracle.

Without CUDA the kernels run under the Triton interpreter (``tests/conftest.py``).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from attnkit.kernels.attention.reference import paged_attention as oracle

pytest.importorskip("triton")

from attnkit.kernels.attention.triton import paged_attention
from attnkit.kernels.attention.triton_plan import (
    AUTO_SPLIT_MAX_QUERY_LEN,
    BLOCK_Q_MAX,
    PagedAttentionPlan,
    choose_num_splits,
    count_query_tiles,
    plan_paged_attention,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
META = torch.device("meta")
# (atol, rtol) for the output and atol for the lse against the float32 oracle.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3, 1e-4),
    torch.bfloat16: (1.6e-2, 1.6e-2, 1e-4),
}


def _i32(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=DEVICE)


class Batch:
    """A ragged batch whose whole context is in a paged cache of shuffled blocks."""

    def __init__(
        self,
        q_lens: Sequence[int],
        seq_lens: Sequence[int],
        *,
        hq: int = 4,
        hkv: int = 2,
        d: int = 32,
        bs: int = 16,
        dtype: torch.dtype = torch.float32,
        pad_tokens: int = 1,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.q_lens, self.seq_lens_list = list(q_lens), list(seq_lens)
        self.bs, self.hkv = bs, hkv
        blocks_per_req = [-(-s // bs) for s in seq_lens]
        width = max([1, *blocks_per_req])
        physical = list(range(1, 1 + sum(blocks_per_req)))
        random.Random(seed).shuffle(physical)
        cache = torch.randn(1 + len(physical), 2, bs, hkv, d, generator=gen).to(dtype)
        table = torch.zeros(len(q_lens), width, dtype=torch.int32)
        for b, n in enumerate(blocks_per_req):
            table[b, :n] = torch.tensor([physical.pop() for _ in range(n)])
        num_real = sum(q_lens)
        self.num_real = num_real
        self.query = torch.randn(num_real + pad_tokens, hq, d, generator=gen).to(dtype).to(DEVICE)
        self.kv_cache = cache.to(DEVICE)
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        self.qsl_cpu = torch.tensor(starts, dtype=torch.int32)
        self.query_start_loc = self.qsl_cpu.to(DEVICE)
        self.seq_lens = _i32(seq_lens)
        self.block_table = table.to(DEVICE)
        self.scale = d**-0.5

    def plan(self, *, exact: bool = False, **kwargs: Any) -> PagedAttentionPlan:
        args: dict[str, Any] = dict(
            max_query_len=max([0, *self.q_lens]),
            max_seq_len=max([0, *self.seq_lens_list]),
            block_size=self.bs,
            num_kv_heads=self.hkv,
            num_tokens=self.query.shape[0],
        )
        args.update(kwargs)
        if exact:
            args["query_start_loc_cpu"] = self.qsl_cpu
        return plan_paged_attention(self.query_start_loc, self.seq_lens, self.block_table, **args)

    def check(self, output: torch.Tensor, lse: torch.Tensor, **options: Any) -> None:
        expected, expected_lse = oracle(
            self.query,
            self.kv_cache,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            scale=self.scale,
            return_lse=True,
            **options,
        )
        n = self.num_real
        atol, rtol, lse_atol = TOLERANCES[self.query.dtype]
        got = output[:n].cpu().float()
        assert not got.isnan().any(), "a real row was never written"
        torch.testing.assert_close(got, expected[:n].cpu().float(), atol=atol, rtol=rtol)
        torch.testing.assert_close(lse[:n].cpu(), expected_lse[:n].cpu(), atol=lse_atol, rtol=1e-5)
        assert output[n:].isnan().all(), "padding rows of output were written"
        assert lse[n:].isnan().all(), "padding rows of lse were written"


def _run(batch: Batch, plan: PagedAttentionPlan, **options: Any) -> tuple[torch.Tensor, ...]:
    output = torch.full_like(batch.query, float("nan"))
    lse = torch.full(batch.query.shape[:2], float("nan"), device=DEVICE)
    paged_attention(
        batch.query, batch.kv_cache, plan, scale=batch.scale, output=output, lse=lse, **options
    )
    return output, lse


# ------------------------------------------------------------------ ragged batches

# The old grid gave every request the query tiles of the longest one; these batches
# have one request far longer than the rest (and empty requests, which have no tile).
RAGGED = [
    pytest.param([70, 1, 1, 3, 0, 1], [200, 33, 1, 40, 17, 64], {}, id="prefill70-among-decodes"),
    pytest.param(
        [1, 1, 45, 0, 2],
        [90, 16, 45, 5, 130],
        {"sliding_window": 20},
        id="window-prefill45",
    ),
    pytest.param([33, 1, 1], [100, 70, 9], {"chunk_size": 32}, id="chunk32-prefill33"),
    pytest.param(
        [1, 64, 1, 1],
        [50, 64, 3, 129],
        {"alibi": True, "sinks": True, "logits_soft_cap": 10.0},
        id="prefill64-alibi-sinks-softcap",
    ),
]


def _options(batch: Batch, spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(plan options, layer options) from a case's spec."""
    spec = dict(spec)
    hq = batch.query.shape[1]
    layer: dict[str, Any] = {}
    if spec.pop("alibi", False):
        layer["alibi_slopes"] = torch.linspace(-0.5, -0.05, hq, device=DEVICE)
    if spec.pop("sinks", False):
        layer["sinks"] = torch.linspace(-1.0, 2.0, hq, device=DEVICE)
    if "logits_soft_cap" in spec:
        layer["logits_soft_cap"] = spec.pop("logits_soft_cap")
    return spec, layer


@pytest.mark.parametrize("exact", [False, True], ids=["shape-bound-grid", "exact-grid"])
@pytest.mark.parametrize(("q_lens", "seq_lens", "spec"), RAGGED)
def test_ragged_batches_match_oracle(
    q_lens: list[int], seq_lens: list[int], spec: dict[str, Any], exact: bool
) -> None:
    dtype = torch.float16 if exact else torch.float32
    batch = Batch(q_lens, seq_lens, dtype=dtype, seed=len(q_lens))
    mask, layer = _options(batch, spec)
    plan = batch.plan(exact=exact, **mask)
    real_tiles = count_query_tiles(q_lens, plan.block_q)
    assert plan.num_tiles == real_tiles if exact else plan.num_tiles >= real_tiles
    output, lse = _run(batch, plan, **layer)
    batch.check(output, lse, **mask, **layer)


def test_ragged_group8_steps_through_a_tile() -> None:
    """Hq / Hkv = 8: a tile of 32 queries is 256 rows, run in steps of 8 queries."""
    batch = Batch([40, 1, 3], [60, 20, 3], hq=8, hkv=1, d=16, dtype=torch.bfloat16)
    plan = batch.plan(exact=True)
    assert plan.block_q == BLOCK_Q_MAX
    output, lse = _run(batch, plan)
    batch.check(output, lse)


def test_a_fixed_query_tile_gives_each_request_the_same_bits_in_any_batch() -> None:
    """block_q fixed (a batch-invariant caller): a decode row and a prefill's rows are
    the same bits alone and beside a longer query run, which would otherwise change the
    tile (next_power_of_2 of the batch's longest run)."""
    both = Batch([1, 9], [40, 30], hq=4, hkv=2, d=16, seed=5)
    out_both, _ = _run(both, both.plan(exact=True, block_q=BLOCK_Q_MAX))
    for index, (q, s) in enumerate(((1, 40), (9, 30))):
        alone = Batch([q], [s], hq=4, hkv=2, d=16, seed=5)
        # The same cache and queries as the request's part of the pair.
        alone.kv_cache = both.kv_cache
        alone.block_table = both.block_table[index : index + 1].contiguous()
        rows = slice(sum((1, 9)[:index]), sum((1, 9)[: index + 1]))
        alone.query = both.query[rows].contiguous()
        plan = alone.plan(exact=True, block_q=BLOCK_Q_MAX)
        assert plan.block_q == BLOCK_Q_MAX
        out_alone, _ = _run(alone, plan)
        assert torch.equal(out_alone[: rows.stop - rows.start], out_both[rows])


def test_split_kv_on_a_ragged_decode_batch() -> None:
    batch = Batch([1, 1, 3, 0, 2], [300, 17, 90, 4, 250], dtype=torch.float16)
    plan = batch.plan(num_splits=3)
    assert plan.num_splits == 3
    output, lse = _run(batch, plan, logits_soft_cap=5.0)
    batch.check(output, lse, logits_soft_cap=5.0)


def test_one_plan_serves_every_layer() -> None:
    """Two layers of one step (other caches, other options), one plan."""
    batch = Batch([5, 1, 2], [40, 9, 70], seed=3)
    other = Batch([5, 1, 2], [40, 9, 70], seed=4)
    plan = batch.plan(exact=True)
    output, lse = _run(batch, plan)
    batch.check(output, lse)
    # Same metadata, a different layer's cache and query.
    other.block_table = batch.block_table
    other.kv_cache = torch.randn_like(batch.kv_cache)
    output, lse = _run(other, plan, k_scale=0.5, v_scale=torch.tensor([2.0], device=DEVICE))
    other.check(output, lse, k_scale=0.5, v_scale=2.0)


# ------------------------------------------------------------------ validation


def test_layer_tensors_are_checked_against_the_plan() -> None:
    batch = Batch([2, 1], [5, 20])
    plan = batch.plan()
    call = dict(scale=batch.scale)
    cache = torch.zeros(3, 2, 32, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"^kv_cache: expected block size 16 \(the plan's"):
        paged_attention(batch.query, cache, plan, **call)
    cache = torch.zeros(3, 2, 16, 4, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"^kv_cache: expected 2 kv heads \(the plan's"):
        paged_attention(batch.query, cache, plan, **call)
    with pytest.raises(ValueError, match=r"^query: expected device .* \(the plan device\)"):
        paged_attention(batch.query.to(META), batch.kv_cache, plan, **call)
    with pytest.raises(TypeError, match=r"^plan: expected a PagedAttentionPlan"):
        paged_attention(batch.query, batch.kv_cache, {"plan": 1}, **call)  # type: ignore[arg-type]  # deliberate misuse


@pytest.mark.parametrize(
    ("layer", "match"),
    [
        pytest.param(
            {"query": lambda b: b.query.double()}, r"^query: expected dtype in", id="query-f64"
        ),
        pytest.param(
            {"alibi_slopes": lambda b: torch.zeros(3, device=DEVICE)},
            r"^alibi_slopes: expected shape \[4\], got \[3\]",
            id="alibi-shape",
        ),
        pytest.param(
            {"sinks": lambda b: torch.zeros(4, dtype=torch.int64, device=DEVICE)},
            r"^sinks: expected dtype in",
            id="sinks-int",
        ),
        pytest.param(
            {"k_scale": lambda b: -1.0}, r"^k_scale: expected a float > 0, got -1\.0", id="k<0"
        ),
        pytest.param(
            {"lse": lambda b: torch.zeros(2, 4, device=DEVICE)},
            r"^lse: expected shape \[4, 4\], got \[2, 4\]",
            id="lse-shape",
        ),
        pytest.param(
            {"logits_soft_cap": lambda b: float("inf")},
            r"^logits_soft_cap: expected a finite float > 0",
            id="softcap-inf",
        ),
    ],
)
def test_bad_layer_tensor_errors_clearly(layer: dict[str, Any], match: str) -> None:
    batch = Batch([2, 1], [5, 20])
    plan = batch.plan()
    call: dict[str, Any] = {"query": batch.query, "scale": batch.scale}
    call.update({name: make(batch) for name, make in layer.items()})
    query = call.pop("query")
    with pytest.raises(ValueError, match=match):
        paged_attention(query, batch.kv_cache, plan, **call)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        pytest.param({"block_size": 8}, r"^kv_cache: expected block size in", id="block-8"),
        pytest.param({"max_seq_len": 4}, r"^max_seq_len: expected an int >= 5", id="seq<q"),
        pytest.param(
            {"num_splits": 2, "max_query_len": 17},
            r"^max_query_len: expected an int <= 16 with num_splits=2",
            id="split-prefill",
        ),
        pytest.param(
            {"causal": False, "sliding_window": 4},
            r"^sliding_window: expected None with causal=False",
            id="window-noncausal",
        ),
        pytest.param({"num_splits": 257}, r"^num_splits: expected an int <= 256", id="splits"),
        pytest.param({"block_q": 64}, r"^block_q: expected an int <= 32", id="block-q-big"),
        pytest.param({"block_q": 12}, r"^block_q: expected a power of two <= 32", id="block-q-odd"),
        pytest.param(
            {"query_start_loc_cpu": torch.tensor([0, 2], dtype=torch.int32)},
            r"^query_start_loc_cpu: expected an int32 CPU tensor \[3\]",
            id="cpu-offsets-shape",
        ),
        pytest.param(
            {"query_start_loc_cpu": torch.tensor([0, 6, 5], dtype=torch.int32)},
            r"^query_start_loc_cpu: expected non-decreasing offsets, got \[0, 6, 5\]",
            id="cpu-offsets-decreasing",
        ),
        pytest.param(
            {"tile_offsets_out": torch.zeros(3, dtype=torch.int64, device=DEVICE)},
            r"^tile_offsets_out: expected a contiguous torch.int32 tensor \[3\]",
            id="offsets-out-int64",
        ),
    ],
)
def test_plan_rejects_bad_metadata(change: dict[str, Any], match: str) -> None:
    batch = Batch([5, 1], [5, 20])
    with pytest.raises(ValueError, match=match):
        batch.plan(**change)


def test_plan_checks_metadata_tensors_once() -> None:
    batch = Batch([2, 1], [5, 20])
    with pytest.raises(ValueError, match=r"^seq_lens: expected dtype torch.int32"):
        plan_paged_attention(
            batch.query_start_loc,
            batch.seq_lens.long(),
            batch.block_table,
            max_query_len=2,
            max_seq_len=20,
            block_size=16,
            num_kv_heads=2,
        )
    plan = batch.plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_tiles = 0  # type: ignore[misc]  # deliberate misuse under test


# ------------------------------------------------------------------ grid


def _python_tiles(q_lens: Sequence[int], block_q: int) -> list[int]:
    """Cumulative tile offsets, counted one request at a time in plain Python."""
    offsets = [0]
    for q in q_lens:
        tiles = 0
        while tiles * block_q < q:
            tiles += 1
        offsets.append(offsets[-1] + tiles)
    return offsets


# vLLM-like batches: (query lengths, context length of every request).
GRID_BATCHES = {
    "255 decodes (2k) + one 2k prefill": ([1] * 255 + [2048], 2048),
    "8 x 512-token prefills": ([512] * 8, 512),
    "32 decodes": ([1] * 32, 2048),
    "chunked prefill 1000 + 63 decodes": ([1000] + [1] * 63, 4096),
    "4 spec-decode x 4 tokens + 1 x 300": ([4] * 4 + [300], 1024),
    "128 decodes + 3 x 100 prefills": ([1] * 128 + [100] * 3, 1024),
}


@pytest.mark.parametrize("name", list(GRID_BATCHES))
def test_grid_efficiency_of_vllm_like_batches(name: str) -> None:
    q_lens, ctx = GRID_BATCHES[name]
    seq_lens = [max(ctx, q) for q in q_lens]
    num_tokens = sum(q_lens)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    bs = 16
    table = torch.zeros(len(q_lens), -(-max(seq_lens) // bs), dtype=torch.int32)
    common: dict[str, Any] = dict(
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=bs,
        num_kv_heads=8,
        num_tokens=num_tokens,
    )
    # CUDA-graph plan: offsets computed with torch ops, grid from shapes only.
    bound_plan = plan_paged_attention(qsl, _i32(seq_lens).cpu(), table, **common)
    expected = _python_tiles(q_lens, bound_plan.block_q)
    assert bound_plan.tile_offsets.tolist() == expected
    with_work = expected[-1]
    assert bound_plan.num_tiles >= with_work
    assert with_work / bound_plan.num_tiles >= 0.9, (with_work, bound_plan.num_tiles)
    # Eager plan with the host copy: the exact count.
    exact_plan = plan_paged_attention(
        qsl, _i32(seq_lens).cpu(), table, query_start_loc_cpu=qsl, **common
    )
    assert exact_plan.exact_grid
    assert exact_plan.num_tiles == with_work
    assert exact_plan.tile_offsets.tolist() == expected


def test_shape_bound_never_undercounts() -> None:
    rng = random.Random(7)
    for _ in range(200):
        q_lens = [
            rng.choice([0, 1, 1, 2, 5, 16, 31, 33, 64, 100]) for _ in range(rng.randint(1, 9))
        ]
        num_tokens = sum(q_lens) + rng.randint(0, 3)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        max_q = max(q_lens)
        plan = plan_paged_attention(
            qsl,
            torch.full((len(q_lens),), max(max_q, 1), dtype=torch.int32),
            torch.zeros(len(q_lens), 8, dtype=torch.int32),
            max_query_len=max_q,
            max_seq_len=max(max_q, 1),
            block_size=16,
            num_kv_heads=1,
            num_tokens=num_tokens,
        )
        real = _python_tiles(q_lens, plan.block_q)[-1]
        assert plan.num_tiles >= real, (q_lens, plan.num_tiles, real)


# ------------------------------------------------------------------ split-KV chooser


def _decode_plan(num_reqs: int, ctx: int, **kwargs: Any) -> PagedAttentionPlan:
    bs = 16
    q_len = kwargs.pop("q_len", 1)
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32) * q_len
    return plan_paged_attention(
        qsl,
        torch.full((num_reqs,), ctx, dtype=torch.int32),
        torch.zeros(num_reqs, -(-ctx // bs), dtype=torch.int32),
        max_query_len=q_len,
        max_seq_len=ctx,
        block_size=bs,
        num_kv_heads=kwargs.pop("num_kv_heads", 8),
        num_splits=None,
        **kwargs,
    )


def test_chooser_picks_split_kv_for_few_long_decodes() -> None:
    plan = _decode_plan(2, 8192, num_sms=132)
    assert plan.num_splits == choose_num_splits(2, 8, 8192, 16, 132) > 1


@pytest.mark.parametrize(
    ("num_reqs", "ctx", "kwargs"),
    [
        pytest.param(64, 8192, {"num_sms": 132}, id="many-requests-fill-the-sms"),
        pytest.param(2, 300, {"num_sms": 132}, id="short-context"),
        pytest.param(2, 8192, {"num_sms": 1}, id="one-sm"),
        pytest.param(2, 8192, {"num_sms": 132, "causal": False}, id="non-causal"),
        pytest.param(
            2, 8192, {"num_sms": 132, "q_len": AUTO_SPLIT_MAX_QUERY_LEN + 1}, id="prefill"
        ),
    ],
)
def test_chooser_keeps_the_one_pass_kernel(num_reqs: int, ctx: int, kwargs: dict[str, Any]) -> None:
    assert _decode_plan(num_reqs, ctx, **kwargs).num_splits == 0
