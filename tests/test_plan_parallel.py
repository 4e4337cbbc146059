"""Tensor- and context-parallel planning: ``plan_model(..., tensor_parallel=T,
context_parallel=C)`` and ``attnkit plan --tensor-parallel T --context-parallel C``.

Every expected number is computed by hand in a comment next to it, from the model's
config (heads, head size, layers, dtype) and the rules of docs/parallel.md:
query heads split; K/V heads split, or one per rank replicated
``T / Hkv`` times when fewer than the ranks; MLA latents on every rank; state heads
split; full and MLA caches sharded token by token over the context-parallel
ranks (``ceil(L / C)`` tokens on rank 0), the others (sink layers too) replicated. The longest
request a pool holds is checked against a brute-force search written here."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from attnkit import (
    ArgumentTypeError,
    AttentionConfig,
    AttentionLayerParams,
    BackendRegistry,
    FullAttentionSpec,
    InvalidArgumentError,
    KVCacheSpec,
    LayerParams,
    MambaSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    layout_from_hf_config,
)
from attnkit.cli import example_model, main
from attnkit.planner import PER_RANK_JSON_KEYS, PLAN_JSON_KEYS, ModelPlan, plan_model

CONFIGS = Path(__file__).resolve().parent / "fixtures" / "model-configs"
GIB = 2**30
MEMORY_80GIB = 80 * GIB  # 85899345920


def reference_only() -> BackendRegistry:
    """The reference backend alone: every kind on CPU, no Triton."""
    return BackendRegistry(
        builtins={"reference": "attnkit.backends.reference:ReferenceBackend"}, entry_points=[]
    )


def plan_of(
    name: str,
    *,
    max_model_len: int,
    batched: int = 8192,
    tp: int = 1,
    cp: int = 1,
    memory: int | None = MEMORY_80GIB,
    dtype: torch.dtype | None = None,
) -> ModelPlan:
    return plan_model(
        layout_from_hf_config(CONFIGS / f"{name}.json", dtype=dtype),
        AttentionConfig(max_model_len=max_model_len, max_num_batched_tokens=batched),
        device="cpu",
        registry=reference_only(),
        memory_bytes=memory,
        tensor_parallel=tp,
        context_parallel=cp,
    )


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = main(argv, registry=reference_only(), out=out, err=err)
    return status, out.getvalue(), err.getvalue()


# --------------------------------------------------------------------------- no parallelism


def test_one_rank_is_the_whole_model() -> None:
    """Llama 3.1 8B at 131072 tokens in 80 GiB: the per-rank figures are the single
    device's (test_cli_plan.py computes the same numbers for the whole model)."""
    plan = plan_of("llama-3.1-8b", max_model_len=131072)
    rank = plan.per_rank
    assert (plan.tensor_parallel, plan.context_parallel, rank.world_size) == (1, 1, 1)
    assert rank.page_size_bytes == 65536  # 2 * 16 * 8 * 128 * 2
    assert rank.bytes_per_block == 2097152  # 32 layers * 65536
    assert rank.kv_bytes_per_token == 131072  # 32 * 2 * 8 * 128 * 2
    assert rank.num_blocks == 40960  # 85899345920 // 2097152
    assert rank.blocks_per_request == 8192  # 131072 / 16
    assert rank.max_concurrency == 4  # 40959 // 8192
    assert rank.tokens_that_fit == 655344  # 40959 * 16
    # one request alone: 40959 blocks of 16 tokens
    assert rank.max_context_tokens == 655344
    assert rank.context_tokens == 131072
    (split,) = rank.splits
    assert (split.query_heads, split.kv_heads, split.kv_replicas) == (32, 8, 1)


@pytest.mark.parametrize(
    "name", ["gemma-2-9b-it", "qwen3-next-80b-a3b-instruct", "t5-small", "lfm2-1.2b"]
)
def test_one_rank_repeats_the_whole_plans_figures(name: str) -> None:
    """With T = C = 1 the per-rank path (split, regroup, re-unify) must land on the
    whole model's groups, page and counts."""
    plan = plan_of(name, max_model_len=8192, batched=512)
    rank = plan.per_rank
    assert [g.group for g in rank.groups] == [g.group for g in plan.groups]
    assert [g.blocks_per_request for g in rank.groups] == [
        g.blocks_per_request for g in plan.groups
    ]
    assert [g.per_request_cap_bytes for g in rank.groups] == [
        g.per_request_cap_bytes for g in plan.groups
    ]
    assert (rank.page_size_bytes, dict(rank.buffers), rank.num_blocks) == (
        plan.page_size_bytes,
        dict(plan.buffers),
        plan.num_blocks,
    )
    assert (rank.kv_bytes_per_token, rank.state_bytes_per_request) == (
        plan.kv_bytes_per_token,
        plan.state_bytes_per_request,
    )
    assert (rank.max_concurrency, rank.tokens_that_fit) == (
        plan.max_concurrency,
        plan.tokens_that_fit,
    )


# --------------------------------------------------------------------------- tensor parallel


@pytest.mark.parametrize(
    ("tp", "query", "kv", "replicas", "page", "per_block", "per_token", "blocks", "requests"),
    [
        # 8 KV heads / 2 = 4 per rank: page 2 * 16 * 4 * 128 * 2 = 32768, 32 layers ->
        # 1048576 B a block, 85899345920 // 1048576 = 81920 blocks, 81919 // 8192 = 9
        pytest.param(2, 16, 4, 1, 32768, 1048576, 65536, 81920, 9, id="tp2-split"),
        # 8 / 8 = 1 per rank: page 8192, 262144 B a block, 327680 blocks, 327679 // 8192
        pytest.param(8, 4, 1, 1, 8192, 262144, 16384, 327680, 39, id="tp8-one-each"),
        # 8 KV heads < 16 ranks: 1 per rank, each head on 16 / 8 = 2 ranks; same bytes
        pytest.param(16, 2, 1, 2, 8192, 262144, 16384, 327680, 39, id="tp16-replicated"),
        pytest.param(32, 1, 1, 4, 8192, 262144, 16384, 327680, 39, id="tp32-replicated"),
    ],
)
def test_llama_kv_heads_split_then_replicate(
    tp: int,
    query: int,
    kv: int,
    replicas: int,
    page: int,
    per_block: int,
    per_token: int,
    blocks: int,
    requests: int,
) -> None:
    plan = plan_of("llama-3.1-8b", max_model_len=131072, tp=tp)
    rank = plan.per_rank
    (split,) = rank.splits
    assert (split.query_heads, split.kv_heads, split.kv_replicas) == (query, kv, replicas)
    assert split.context == "sharded"
    (group,) = rank.groups
    assert isinstance(group.group.spec, FullAttentionSpec)
    assert group.group.spec.num_kv_heads == kv
    assert group.group.spec.block_size == 16
    assert rank.page_size_bytes == page
    assert rank.bytes_per_block == per_block
    assert rank.kv_bytes_per_token == per_token  # 32 layers * 2 * kv * 128 * 2
    assert group.bytes_per_token == per_token
    assert rank.num_blocks == blocks
    assert rank.blocks_per_request == 8192  # ceil(131072 / 16): no context parallelism
    assert rank.bytes_per_request == 8192 * per_block
    assert rank.max_concurrency == requests
    assert rank.tokens_that_fit == (blocks - 1) * 16
    assert rank.max_context_tokens == (blocks - 1) * 16
    # The whole-model figures are still one device's.
    assert (plan.num_blocks, plan.max_concurrency) == (40960, 4)


def test_llama_replication_is_described() -> None:
    split = plan_of("llama-3.1-8b", max_model_len=4096, tp=16, memory=None).per_rank.splits[0]
    assert (
        split.detail == "query heads 32 -> 2 per rank; K/V heads 8 -> 1 per rank (each on 2 ranks)"
    )


def test_deepseek_v3_latent_is_replicated_on_every_rank() -> None:
    """MLA: one latent of 512 + 64 = 576 values per token, read by all 128 heads; at
    T = 8 each rank holds 16 query heads and the whole latent, so every cache figure
    is the single device's (test_cli_plan.py's hand numbers)."""
    plan = plan_of("deepseek-v3", max_model_len=163840, tp=8)
    rank = plan.per_rank
    (split,) = rank.splits
    assert (split.query_heads, split.kv_heads, split.kv_replicas) == (16, 1, 8)
    assert "MLA latent (576 per token) shared by all heads: replicated on every" in split.detail
    assert rank.page_size_bytes == 18432  # 16 * 576 * 2
    assert rank.bytes_per_block == 1124352  # 61 layers
    assert rank.kv_bytes_per_token == 70272  # 61 * 576 * 2
    assert rank.num_blocks == 76398  # 85899345920 // 1124352
    assert rank.blocks_per_request == 10240  # 163840 / 16
    assert rank.max_concurrency == 7  # 76397 // 10240
    assert rank.max_context_tokens == 1222352  # 76397 * 16


def test_deepseek_v3_with_context_parallelism_shards_the_latent() -> None:
    """T = 8, C = 4: 32 ranks. Rank 0 holds ceil(163840 / 4) = 40960 tokens of each
    request: 2560 blocks."""
    rank = plan_of("deepseek-v3", max_model_len=163840, tp=8, cp=4).per_rank
    assert rank.world_size == 32
    assert rank.context_tokens == 40960
    assert rank.blocks_per_request == 2560
    assert rank.bytes_per_request == 2560 * 1124352
    assert rank.max_concurrency == 29  # 76397 // 2560 (2560 * 30 = 76800)
    assert rank.tokens_that_fit == 4889408  # 76397 * 163840 // 2560 = 76397 * 64
    # ceil(ceil(L / 4) / 16) <= 76397  <=>  L <= 76397 * 64
    assert rank.max_context_tokens == 4889408


def test_qwen3_next_gated_deltanet_splits_its_heads() -> None:
    """T = 2. Gated DeltaNet: 32 value heads -> 16, 16 key heads -> 8; conv channels
    2 * 8 * 128 + 16 * 128 = 4096 (bf16, width 4 - 1), state (16, 128, 128) float32:
    4096 * 3 * 2 + 16 * 128 * 128 * 4 = 24576 + 1048576 = 1073152 B. Attention: 2 KV
    heads -> 1, page 2 * 16 * 1 * 256 * 2 = 16384 B; the rank's page is
    16384 * ceil(1073152 / 16384) = 16384 * 66 = 1081344 B: 66 attention blocks of 16
    tokens a page."""
    plan = plan_of("qwen3-next-80b-a3b-instruct", max_model_len=262144, tp=2)
    rank = plan.per_rank
    gdn, attention = rank.splits
    assert isinstance(gdn.spec, MambaSpec)
    assert gdn.spec.shapes == ((4096, 3), (16, 128, 128))
    assert gdn.spec.page_size_bytes == 1073152
    assert gdn.detail == "gdn value heads 32 -> 16, key heads 16 -> 8 per rank"
    assert gdn.context == "replicated"
    assert (attention.query_heads, attention.kv_heads, attention.kv_replicas) == (8, 1, 1)
    assert rank.page_size_bytes == 1081344
    assert [g.group.spec.block_size for g in rank.groups] == [16, 16]
    assert [g.group.blocks_per_page for g in rank.groups] == [1, 66]
    assert rank.bytes_per_block == 38928384  # 36 state layers' buffers * 1081344
    assert rank.num_blocks == 2206  # 85899345920 // 38928384
    assert rank.state_bytes_per_request == 38633472  # 36 * 1073152
    assert rank.kv_bytes_per_token == 12288  # 12 layers * 2 * 1 * 256 * 2
    # ceil(262144 / 16) = 16384 kernel blocks in ceil(16384 / 66) = 249 pages + 1 state page
    assert [g.kernel_blocks_per_request for g in rank.groups] == [1, 16384]
    assert [g.blocks_per_request for g in rank.groups] == [1, 249]
    assert rank.max_concurrency == 8  # 2205 // 250
    assert rank.tokens_that_fit == 2312110  # 2205 * 262144 // 250
    assert rank.max_context_tokens == 2327424  # (2205 - 1) pages * 66 * 16


def test_bamba_mamba2_group_is_replicated_with_context_parallelism() -> None:
    """Bamba in float32, T = 8, C = 2. Mamba2: 128 heads -> 16, one B/C group, kept on
    every rank: conv (16 * 64 + 2 * 1 * 128 = 1280, 3), SSM (16, 64, 128):
    1280 * 3 * 4 + 16 * 64 * 128 * 4 = 15360 + 524288 = 539648 B. Attention: 8 KV heads
    -> 1, page 2 * 16 * 1 * 128 * 4 = 16384; rank page 16384 * ceil(539648 / 16384) =
    16384 * 33 = 540672: 33 attention blocks of 16 tokens (528 tokens) a page."""
    rank = plan_of("bamba-9b", max_model_len=8192, tp=8, cp=2, dtype=torch.float32).per_rank
    mamba, attention = rank.splits
    assert isinstance(mamba.spec, MambaSpec)
    assert mamba.spec.shapes == ((1280, 3), (16, 64, 128))
    assert mamba.spec.page_size_bytes == 539648
    assert "B/C groups 1 -> 1 per rank (each on 8 ranks)" in mamba.detail
    assert (mamba.context, attention.context) == ("replicated", "sharded")
    assert rank.page_size_bytes == 540672
    assert [g.group.spec.block_size for g in rank.groups] == [16, 16]
    assert [g.group.blocks_per_page for g in rank.groups] == [1, 33]
    # the state page, and ceil(8192 / 2) / 16 = 256 kernel blocks in ceil(256 / 33) = 8 pages
    assert [g.kernel_blocks_per_request for g in rank.groups] == [1, 256]
    assert [g.blocks_per_request for g in rank.groups] == [1, 8]
    assert rank.bytes_per_block == 15679488  # 29 state layers * 540672
    assert rank.num_blocks == 5478  # 85899345920 // 15679488
    assert rank.max_concurrency == 608  # 5477 // 9
    # one request alone: 5477 - 1 state page = 5476 attention pages of 33 * 16 tokens
    # per rank, every second token on this rank: 5476 * 528 * 2
    assert rank.max_context_tokens == 5782656


@pytest.mark.parametrize(
    ("name", "tp", "shapes"),
    [
        # Jamba's Mamba (1): d_inner = 2 * 4096 = 8192 channels -> 1024
        ("jamba-v0.1", 8, ((1024, 3), (1024, 16))),
        # LFM2's short conv: 2048 channels -> 256, conv_L_cache 3 -> width - 1 = 2
        ("lfm2-1.2b", 8, ((256, 2),)),
    ],
)
def test_state_channels_split(name: str, tp: int, shapes: tuple[tuple[int, ...], ...]) -> None:
    splits = plan_of(name, max_model_len=4096, tp=tp, memory=None).per_rank.splits
    states = [s.spec for s in splits if isinstance(s.spec, MambaSpec)]
    assert [s.shapes for s in states] == [shapes]


def test_groups_that_become_equal_share_a_rank_group() -> None:
    """2 and 4 KV heads are two groups of the model; at T = 4 both keep 1 head per rank
    (the first replicated on 2 ranks), so each rank builds one group of both layers,
    as its runtime would. float32, head 16: page 2 * 16 * 1 * 16 * 4 = 2048 B, two
    layers in the group: 4096 B a block; 1024 tokens: 64 blocks."""
    two = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32)
    four = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=16, dtype=torch.float32)
    specs: dict[str, KVCacheSpec] = {"l0": two, "l1": four}
    params: dict[str, LayerParams] = {
        "l0": AttentionLayerParams(num_heads=8),
        "l1": AttentionLayerParams(num_heads=8),
    }
    plan = plan_model(
        specs,
        AttentionConfig(max_model_len=1024),
        device="cpu",
        registry=reference_only(),
        layer_params=params,
        num_blocks=10,
        tensor_parallel=4,
    )
    assert len(plan.groups) == 2
    rank = plan.per_rank
    assert [(s.kv_heads, s.kv_replicas) for s in rank.splits] == [(1, 2), (1, 1)]
    (group,) = rank.groups
    assert group.model_groups == (0, 1)
    assert group.group.layer_names == ("l0", "l1")
    assert group.describe() == "rank group 0 (full_attention; model groups 0, 1)"
    assert rank.page_size_bytes == 2048
    assert rank.bytes_per_block == 4096
    assert rank.memory_bytes == 10 * 4096
    assert rank.blocks_per_request == 64


# --------------------------------------------------------------------------- context parallel


def test_gemma2_window_is_replicated_and_full_attention_sharded() -> None:
    """Gemma 2 9B, C = 4, 8192 tokens, 512-token steps, 80 GiB a rank. The window group
    keeps ceil((4095 + 512) / 16) + 1 = 289 blocks (its cap 289 * 131072 * 21 =
    795475968 B) on every rank; the full group holds ceil(ceil(8192 / 4) / 16) = 128
    instead of 512. 31206 usable blocks (test_cli_plan.py)."""
    plan = plan_of("gemma-2-9b-it", max_model_len=8192, batched=512, cp=4)
    rank = plan.per_rank
    assert [s.context for s in rank.splits] == ["replicated", "sharded"]
    window, full = rank.groups
    assert (window.context_sharded, full.context_sharded) == (False, True)
    assert (window.blocks_per_request, full.blocks_per_request) == (289, 128)
    assert window.per_request_cap_bytes == 795475968
    assert rank.context_tokens == 2048
    assert rank.num_blocks == 31207
    assert rank.max_concurrency == 74  # 31206 // 417 (417 * 75 = 31275)
    assert rank.tokens_that_fit == 613044  # 31206 * 8192 // 417
    assert rank.bytes_per_request == 417 * 2752512
    # alone: the window's 289 blocks, and 30917 full blocks of 16 tokens on each of 4
    assert rank.max_context_tokens == 1978688  # 30917 * 16 * 4
    # the whole model on one device, unchanged
    assert (plan.max_concurrency, plan.blocks_per_request) == (38, 801)


def test_windowed_only_model_has_no_context_limit_when_the_window_fits() -> None:
    """Mistral 7B: every layer has a 4096 window, nothing grows with the context."""
    rank = plan_of("mistral-7b-v0.1", max_model_len=32768, cp=2).per_rank
    assert [s.context for s in rank.splits] == ["replicated"]
    # ceil((4095 + 8192) / 16) + 1 = 769 (< ceil(32768 / 16) = 2048), as one device
    assert rank.blocks_per_request == 769
    assert rank.max_context_tokens is None


def test_a_small_budget_bounds_even_a_windowed_model() -> None:
    """Mistral at T = 8, C = 2 with 3 MiB a rank: a block is 32 layers * 2 * 16 * 1 *
    128 * 2 = 262144 B, so 12 blocks (11 usable). A request of L tokens holds
    min(ceil(min(4095 + 8192, L) / 16) + 1, ceil(L / 16)) window blocks: 11 at L = 176,
    12 at L = 177. The whole model's 2097152 B blocks: only 1 fits."""
    plan = plan_of("mistral-7b-v0.1", max_model_len=32768, tp=8, cp=2, memory=3 * 2**20)
    assert plan.num_blocks is None
    assert plan.memory_bytes == 3 * 2**20
    assert plan.per_rank.num_blocks == 12
    assert plan.per_rank.max_context_tokens == 176


def test_one_device_budget_too_small_is_still_an_error() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^memory_budget_bytes=3145728 holds 1 block"):
        plan_of("mistral-7b-v0.1", max_model_len=32768, memory=3 * 2**20)


def test_sink_layers_are_replicated() -> None:
    """A sink layer of 4 sink slots, 100 tokens: 104 slots, ceil(104 / 16) = 7 blocks on
    one device and, replicated (the runtime does not shard sink slots), on every one of
    3 context-parallel ranks."""
    sink = SinkFullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32, sink_len=4
    )
    plan = plan_model(
        {"l0": sink},
        AttentionConfig(max_model_len=100),
        device="cpu",
        registry=reference_only(),
        context_parallel=3,
    )
    assert plan.blocks_per_request == 7
    assert plan.per_rank.blocks_per_request == 7
    assert plan.per_rank.splits[0].context == "replicated"


def test_t5_cross_attention_is_replicated() -> None:
    """t5-small (float32, 8 heads of 64, 6 layers of each kind), T = 2, C = 2,
    32768 tokens, 1000 blocks a rank. 4 KV heads per rank: page 2 * 16 * 4 * 64 * 4 =
    32768 B. Decoder self-attention: ceil(16384 / 16) = 1024 blocks; cross-attention
    keeps the encoder's ceil(32768 / 16) = 2048 on every rank; encoder layers none."""
    plan = plan_model(
        layout_from_hf_config(CONFIGS / "t5-small.json"),
        AttentionConfig(max_model_len=32768),
        device="cpu",
        registry=reference_only(),
        num_blocks=1000,
        tensor_parallel=2,
        context_parallel=2,
    )
    rank = plan.per_rank
    assert [s.context for s in rank.splits] == ["none", "sharded", "replicated"]
    assert [s.kv_heads for s in rank.splits] == [4, 4, 4]
    assert rank.page_size_bytes == 32768
    assert [g.blocks_per_request for g in rank.groups] == [0, 1024, 2048]
    assert rank.memory_bytes == 1000 * 32768 * 6
    # ceil(ceil(L / 2) / 16) + ceil(L / 16) <= 999: 333 + 666 at L = 10656, 334 + 667
    # at L = 10657
    assert rank.max_context_tokens == 10656


def _brute_force_longest(
    usable: int, cp: int, bs: int, per_page: int, window: int, batched: int
) -> int:
    """The largest L whose pages fit, by trying every length: full attention sharded
    (token t on rank t mod cp), a window replicated (its bound written out again), in
    kernel blocks of ``bs`` tokens, ``per_page`` to a page; a state of one page."""

    def blocks(length: int) -> int:
        full = math.ceil(math.ceil(length / cp) / bs)
        live = min(window - 1 + batched, length)
        windowed = min(math.ceil(live / bs) + 1, math.ceil(length / bs))
        return math.ceil(full / per_page) + math.ceil(windowed / per_page) + 1

    length = 0
    while blocks(length + 1) <= usable:
        length += 1
    return length


@pytest.mark.parametrize("num_blocks", [4, 9, 30])
@pytest.mark.parametrize("cp", [1, 3])
def test_longest_request_matches_a_brute_force_search(num_blocks: int, cp: int) -> None:
    """Full, Mamba2 and sliding-window layers whose state puts 3 attention blocks of 16
    tokens in a page (the small hybrid of test_cli_plan.py: page 2048 * 3)."""
    state = MambaSpec(
        block_size=16,
        shapes=((96, 3), (4, 16, 16)),
        dtypes=(torch.float32, torch.float32),
        mamba_type="mamba2",
    )
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32, sliding_window=64
    )
    plan = plan_model(
        {"l0": full, "l1": state, "l2": window},
        AttentionConfig(max_model_len=256, max_num_batched_tokens=32),
        device="cpu",
        registry=reference_only(),
        num_blocks=num_blocks,
        context_parallel=cp,
    )
    rank = plan.per_rank
    assert [g.group.spec.block_size for g in rank.groups] == [16, 16, 16]
    assert [g.group.blocks_per_page for g in rank.groups] == [3, 1, 3]
    expected = _brute_force_longest(num_blocks - 1, cp, 16, 3, 64, 32)
    assert rank.max_context_tokens == expected


def test_longest_request_is_zero_when_nothing_fits() -> None:
    """A request of 1 token holds a full-attention block and a state block: 2; a pool
    of 2 blocks has 1 usable."""
    state = MambaSpec(
        block_size=16, shapes=((8, 3),), dtypes=(torch.float32,), mamba_type="short_conv"
    )
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32)
    plan = plan_model(
        {"l0": full, "l1": state},
        AttentionConfig(max_model_len=64),
        device="cpu",
        registry=reference_only(),
        num_blocks=2,
    )
    assert plan.per_rank.max_context_tokens == 0


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"tensor_parallel": 0},
            InvalidArgumentError,
            "plan_model: tensor_parallel must be an int >= 1 (ranks), got 0",
        ),
        (
            {"context_parallel": -2},
            InvalidArgumentError,
            "plan_model: context_parallel must be an int >= 1 (ranks), got -2",
        ),
        (
            {"tensor_parallel": True},
            ArgumentTypeError,
            "plan_model: tensor_parallel must be an int >= 1 (ranks), got True (bool)",
        ),
        (
            {"context_parallel": "2"},
            ArgumentTypeError,
            "plan_model: context_parallel must be an int >= 1 (ranks), got '2' (str)",
        ),
        (
            {"tensor_parallel": 2.0},
            ArgumentTypeError,
            "plan_model: tensor_parallel must be an int >= 1 (ranks), got 2.0 (float)",
        ),
    ],
    ids=["tp-zero", "cp-negative", "tp-bool", "cp-str", "tp-float"],
)
def test_rank_counts_are_checked(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        plan_model(
            example_model("llama"),
            AttentionConfig(),
            device="cpu",
            registry=reference_only(),
            **kwargs,
        )
    assert str(info.value) == message


def test_query_heads_must_split() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        plan_of("deepseek-v3", max_model_len=4096, tp=3, memory=None)
    assert str(info.value) == (
        "plan_model: tensor_parallel=3 does not divide the 128 query heads of layer "
        "'model.layers.0.self_attn' (mla_attention); each rank must hold whole heads "
        # the divisors of 128 (the latent is on every rank, whatever the size)
        "(tensor_parallel sizes that split every layer of this model: 1, 2, 4, 8, 16, 32, "
        "64, 128)"
    )


def test_fewer_kv_heads_than_ranks_must_divide_the_ranks() -> None:
    """Qwen2.5 7B: 28 query heads (7 divides them), 4 KV heads (7 is no multiple)."""
    with pytest.raises(InvalidArgumentError) as info:
        plan_of("qwen2.5-7b", max_model_len=4096, tp=7, memory=None)
    assert str(info.value) == (
        "plan_model: tensor_parallel=7 cannot split the 4 K/V heads of layer "
        "'model.layers.0.self_attn' (group 0, 28 layers): with fewer K/V heads than "
        "ranks, tensor_parallel must be a multiple of 4 (each is then replicated on "
        "tensor_parallel / 4 ranks) "
        # divisors of the 28 query heads that divide the 4 K/V heads or are a multiple
        "(tensor_parallel sizes that split every layer of this model: 1, 2, 4, 28)"
    )


def test_more_kv_heads_than_ranks_must_be_divided_by_them() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=6, head_size=16, dtype=torch.float32)
    with pytest.raises(InvalidArgumentError) as info:
        plan_model(
            {"l0": spec},
            AttentionConfig(),
            device="cpu",
            registry=reference_only(),
            layer_params={"l0": AttentionLayerParams(num_heads=12)},
            tensor_parallel=4,
        )
    assert str(info.value) == (
        "plan_model: tensor_parallel=4 cannot split the 6 K/V heads of layer 'l0' "
        "(group 0): with at least as many K/V heads as ranks, tensor_parallel must "
        "divide 6 "
        # divisors of the 12 query heads that divide the 6 K/V heads or are a multiple
        "(tensor_parallel sizes that split every layer of this model: 1, 2, 3, 6, 12)"
    )


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (
            # Mamba2 of 4 heads (P 16, N 16, one group: conv 4 * 16 + 2 * 16 = 96)
            MambaSpec(
                block_size=16,
                shapes=((96, 3), (4, 16, 16)),
                dtypes=(torch.float32, torch.float32),
                mamba_type="mamba2",
            ),
            "plan_model: tensor_parallel=8 cannot split the mamba2 state of layer 's' "
            "(group 0): its 4 heads are not a multiple of 8 (tensor_parallel sizes that "
            "split every layer of this model: 1, 2, 4)",
        ),
        (
            # 100 - 4 * 16 = 36 conv channels left for B and C: not 2 * G * 16
            MambaSpec(
                block_size=16,
                shapes=((100, 3), (4, 16, 16)),
                dtypes=(torch.float32, torch.float32),
                mamba_type="mamba2",
            ),
            "plan_model: tensor_parallel=8 cannot split the mamba2 state of layer 's' "
            "(group 0): shapes ((100, 3), (4, 16, 16)) are not ((H*P + 2*G*N, W-1), "
            "(H, P, N))",
        ),
        (
            # Gated DeltaNet: Hv 16, Hk 4 (conv 2 * 4 * 8 + 16 * 8 = 192): 4 key heads
            MambaSpec(
                block_size=16,
                shapes=((192, 3), (16, 8, 8)),
                dtypes=(torch.float32, torch.float32),
                mamba_type="gdn",
            ),
            "plan_model: tensor_parallel=8 cannot split the gdn state of layer 's' "
            "(group 0): its 4 key heads are not a multiple of 8 (tensor_parallel sizes "
            "that split every layer of this model: 1, 2, 4)",
        ),
        (
            MambaSpec(
                block_size=16, shapes=((12, 3),), dtypes=(torch.float32,), mamba_type="linear"
            ),
            "plan_model: tensor_parallel=8 cannot split the linear state of layer 's' "
            "(group 0): its shapes ((12, 3),) are not the linear layout attnkit knows",
        ),
    ],
    ids=["mamba2-heads", "mamba2-layout", "gdn-key-heads", "linear-layout"],
)
def test_states_that_do_not_split_are_errors(state: MambaSpec, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        plan_model(
            {"s": state},
            AttentionConfig(),
            device="cpu",
            registry=reference_only(),
            tensor_parallel=8,
        )
    assert str(info.value) == message


# --------------------------------------------------------------------------- the command


def test_cli_text_has_a_per_rank_section() -> None:
    status, text, err = run(
        [
            "plan",
            str(CONFIGS / "llama-3.1-8b.json"),
            "--gpu-memory",
            "80GiB",
            "--max-model-len",
            "131072",
            "--tensor-parallel",
            "16",
            "--context-parallel",
            "2",
        ]
    )
    assert (status, err) == (0, "")
    section = text[text.index("\nper rank ") :]
    # 8 KV heads at T = 16: 1 per rank (page 8192 B, 32 layers: 262144 B a block,
    # 327680 blocks); rank 0 holds 65536 tokens of a request: 4096 blocks
    assert section == (
        "\nper rank (tensor_parallel 16 x context_parallel 2 = 32 ranks; --gpu-memory and "
        "--num-blocks are each rank's, the capacity above is the whole model on one "
        "device):\n"
        "  group 0 (full_attention, backend reference): query heads 32 -> 2 per rank; K/V "
        "heads 8 -> 1 per rank (each on 2 ranks); context sharded (token t on rank t mod 2)\n"
        "groups on each rank:\n"
        "  group 0 (full_attention): block size 16, 1 K/V head(s), 32 layer(s), at most "
        "4096 block(s) per request\n"
        "capacity per rank:\n"
        "  page:                8192 B in 32 layer buffer(s) (page_major 32) = 262144 B "
        "(256.00 KiB) per block\n"
        "  KV per token:        16384 B (16.00 KiB) (attention layers, on a rank that holds "
        "the token)\n"
        "  context per rank:    65536 of 131072 tokens in sharded groups\n"
        "  state per request:   0 B\n"
        "  blocks per request:  4096 (group 0: 4096) = 1073741824 B (1.00 GiB)\n"
        "  memory:              85899345920 B (80.00 GiB) -> 327680 blocks (327679 usable; "
        "block 0 is the null block)\n"
        "  tokens that fit:     10485728\n"  # 327679 * 131072 // 4096 = 327679 * 32
        "  concurrent requests: 79 of 131072 tokens\n"  # 327679 // 4096
        "  max context:         10485728 tokens (one request alone in the pool)\n"
    )


def test_cli_text_says_the_mla_latent_is_replicated() -> None:
    status, text, _ = run(["plan", str(CONFIGS / "deepseek-v3.json"), "--tensor-parallel", "8"])
    assert status == 0
    section = text[text.index("\nper rank ") :]
    assert (
        "  group 0 (mla_attention, backend reference): query heads 128 -> 16 per rank; MLA "
        "latent (576 per token) shared by all heads: replicated on every tensor-parallel "
        "rank\n"
    ) in section
    # 32768 tokens / 16 = 2048 blocks of the whole 576-wide latent on every rank
    assert (
        "  group 0 (mla_attention): block size 16, latent 576, 61 layer(s), at most 2048 "
        "block(s) per request\n"
    ) in section
    assert "  KV per token:        70272 B (68.62 KiB) " in section  # 61 * 576 * 2


def test_cli_text_without_parallelism_has_no_per_rank_section() -> None:
    config = str(CONFIGS / "gemma-2-9b-it.json")
    status, plain, _ = run(["plan", config, "--num-blocks", "100"])
    assert status == 0
    assert "per rank" not in plain
    status, ones, _ = run(
        ["plan", config, "--num-blocks", "100", "--tensor-parallel", "1", "--context-parallel", "1"]
    )
    assert (status, ones) == (0, plain)


def test_cli_windowed_group_lines_per_rank() -> None:
    status, text, _ = run(
        [
            "plan",
            str(CONFIGS / "gemma-2-9b-it.json"),
            "--max-model-len",
            "8192",
            "--max-num-batched-tokens",
            "512",
            "--context-parallel",
            "4",
        ]
    )
    assert status == 0
    section = text[text.index("\nper rank ") :]
    assert (
        "  group 0 (sliding_window, backend reference): query heads 16 -> 16 per rank; K/V "
        "heads 8 -> 8 per rank; context replicated on each of the 4 context-parallel ranks\n"
    ) in section
    assert (
        "  group 0:             172032 B per token up to its window 4096; at most 795475968 B "
        "(758.62 MiB) per request\n"
    ) in section
    assert "  blocks per request:  417 (group 0: 289, group 1: 128) = " in section
    assert "  memory:              not given (--gpu-memory or --num-blocks)\n" in section


def test_cli_json_per_rank() -> None:
    status, text, err = run(
        [
            "plan",
            str(CONFIGS / "deepseek-v3.json"),
            "--gpu-memory",
            "80GiB",
            "--max-model-len",
            "163840",
            "--tensor-parallel",
            "8",
            "--context-parallel",
            "4",
            "--json",
        ]
    )
    assert (status, err) == (0, "")
    data = cast("dict[str, Any]", json.loads(text))
    assert tuple(data) == PLAN_JSON_KEYS
    assert (data["tensor_parallel"], data["context_parallel"]) == (8, 4)
    rank = data["per_rank"]
    assert tuple(rank) == PER_RANK_JSON_KEYS
    assert rank["world_size"] == 32
    assert rank["splits"][0]["query_heads"] == 16
    assert rank["splits"][0]["kv_replicas"] == 8
    assert rank["splits"][0]["context"] == "sharded"
    assert rank["groups"][0]["blocks_per_request"] == 2560  # the hand numbers above
    assert rank["max_concurrency"] == 29
    assert rank["max_context_tokens"] == 4889408
    # the whole model on one device: test_cli_plan.py's numbers
    assert (data["num_blocks"], data["max_concurrency"]) == (76398, 7)


def test_cli_json_without_parallelism_has_the_keys() -> None:
    status, text, _ = run(["plan", "--example", "llama", "--json"])
    assert status == 0
    data = cast("dict[str, Any]", json.loads(text))
    assert (data["tensor_parallel"], data["context_parallel"]) == (1, 1)
    assert data["per_rank"]["world_size"] == 1
    assert data["per_rank"]["max_context_tokens"] is None  # no budget


@pytest.mark.parametrize(
    ("option", "value"),
    [("--tensor-parallel", "0"), ("--context-parallel", "-1"), ("--tensor-parallel", "two")],
)
def test_cli_rejects_bad_rank_counts(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--example", "llama", option, value])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(
        f"attnkit plan: error: argument {option}: must be an integer >= 1, got {value!r}\n"
    )


def test_cli_reports_heads_that_do_not_split() -> None:
    status, text, err = run(["plan", str(CONFIGS / "llama-3.1-8b.json"), "--tensor-parallel", "3"])
    assert (status, text) == (2, "")
    assert err == (
        "attnkit plan: error: plan_model: tensor_parallel=3 does not divide the 32 query "
        "heads of layer 'model.layers.0.self_attn' (full_attention); each rank must hold "
        "whole heads (tensor_parallel sizes that split every layer of this model: 1, 2, 4, "
        "8, 16, 32)\n"
    )


def test_cli_budget_per_rank_smaller_than_a_whole_model_block() -> None:
    status, text, err = run(
        [
            "plan",
            str(CONFIGS / "mistral-7b-v0.1.json"),
            "--gpu-memory",
            "3MiB",
            "--tensor-parallel",
            "8",
            "--context-parallel",
            "2",
        ]
    )
    assert (status, err) == (0, "")
    assert (
        "  memory:              3145728 B (3.00 MiB) holds fewer than 2 blocks of the whole "
        "model (see per rank)\n"
    ) in text
    assert "  max context:         176 tokens (one request alone in the pool)\n" in text
