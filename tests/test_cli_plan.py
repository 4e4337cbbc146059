"""``attnkit plan CONFIG.json`` and ``attnkit.planner.plan_model``: the capacity plan of
a real model, checked against arithmetic done by hand (each expected number is
written out, with how it was computed), and against the runtime itself: the block
sizes a plan shows are those an ``AttentionRuntime`` built from the same layout runs."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from attnkit import (
    ArgumentTypeError,
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    BackendRegistry,
    FullAttentionSpec,
    InvalidArgumentError,
    KVCacheSpec,
    LayerParams,
    Mamba2LayerParams,
    MambaSpec,
    SlidingWindowSpec,
    layout_from_hf_config,
)
from attnkit.cli import example_model, main
from attnkit.models import Mamba2Dims, ModelLayout, ShortConvDims
from attnkit.planner import PLAN_JSON_KEYS, ModelPlan, parse_memory_size, plan_model
from attnkit.registry import BUILTIN_BACKENDS

CONFIGS = Path(__file__).resolve().parent / "fixtures" / "model-configs"
GIB = 2**30
MEMORY_80GIB = 80 * GIB  # 85899345920


def reference_only() -> BackendRegistry:
    """The reference backend alone: every kind on CPU, no Triton."""
    return BackendRegistry(
        builtins={"reference": "attnkit.backends.reference:ReferenceBackend"}, entry_points=[]
    )


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = main(argv, registry=reference_only(), out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def plan_json(argv: list[str]) -> dict[str, Any]:
    status, text, err = run(["plan", *argv, "--json"])
    assert (status, err) == (0, "")
    return cast("dict[str, Any]", json.loads(text))


def plan_of(name: str, *, max_model_len: int, batched: int = 8192) -> ModelPlan:
    return plan_model(
        layout_from_hf_config(CONFIGS / f"{name}.json"),
        AttentionConfig(max_model_len=max_model_len, max_num_batched_tokens=batched),
        device="cpu",
        registry=reference_only(),
        memory_bytes=MEMORY_80GIB,
    )


# --------------------------------------------------------------------------- arithmetic


def test_llama_3_1_8b_in_80gib() -> None:
    plan = plan_of("llama-3.1-8b", max_model_len=131072)
    (group,) = plan.groups
    assert group.group.spec.block_size == 16
    # 2 (K, V) * 16 tokens * 8 KV heads * 128 head size * 2 bytes (bf16)
    assert plan.page_size_bytes == 65536
    # one page in each of the 32 layers' buffers
    assert plan.bytes_per_block == 2097152
    # 32 layers * 2 * 8 * 128 * 2
    assert plan.kv_bytes_per_token == 131072
    # 85899345920 // 2097152
    assert plan.num_blocks == 40960
    assert plan.usable_blocks == 40959
    # ceil(131072 / 16)
    assert plan.blocks_per_request == 8192
    # 40959 // 8192
    assert plan.max_concurrency == 4
    # 40959 usable blocks * 16 tokens
    assert plan.tokens_that_fit == 655344
    assert plan.state_bytes_per_request == 0


def test_gemma_2_9b_windowed_layers_are_bounded_by_their_window() -> None:
    plan = plan_of("gemma-2-9b-it", max_model_len=8192, batched=512)
    window, full = plan.groups
    assert (window.group.kind.value, full.group.kind.value) == ("sliding_window", "full_attention")
    assert len(window.group.layer_names) == len(full.group.layer_names) == 21
    # 2 * 16 * 8 KV heads * 256 head size * 2 bytes
    assert plan.page_size_bytes == 131072
    # 21 layers per group share the buffers: 131072 * 21
    assert plan.bytes_per_block == 2752512
    # 42 layers * 2 * 8 * 256 * 2
    assert plan.kv_bytes_per_token == 344064
    # per group: 21 * 2 * 8 * 256 * 2
    assert window.bytes_per_token == full.bytes_per_token == 172032
    # window 4096: the first token of a 512-token step still sees 4095 older ones:
    # ceil((4095 + 512) / 16) + 1 = 288 + 1 = 289 (< ceil(8192 / 16) = 512)
    assert window.blocks_per_request == 289
    # 289 blocks * 131072 B * 21 layers
    assert window.per_request_cap_bytes == 795475968
    assert full.blocks_per_request == 512
    assert full.per_request_cap_bytes is None
    assert plan.blocks_per_request == 801  # 289 + 512
    # 85899345920 // 2752512 = 31207, 31206 usable
    assert plan.num_blocks == 31207
    # 31206 // 801 (801 * 38 = 30438, 801 * 39 = 31239)
    assert plan.max_concurrency == 38
    # 31206 * 8192 // 801
    assert plan.tokens_that_fit == 319150


def test_deepseek_v3_mla_latent_576() -> None:
    plan = plan_of("deepseek-v3", max_model_len=163840)
    (group,) = plan.groups
    assert group.group.kind.value == "mla_attention"
    # one latent of 512 + 64 = 576 per token, no separate V: 16 * 576 * 2 bytes
    assert plan.page_size_bytes == 18432
    # 61 layers
    assert plan.bytes_per_block == 1124352
    # 61 * 576 * 2
    assert plan.kv_bytes_per_token == 70272
    # 85899345920 // 1124352
    assert plan.num_blocks == 76398
    # 163840 / 16
    assert plan.blocks_per_request == 10240
    # 76397 // 10240
    assert plan.max_concurrency == 7
    # 76397 * 16
    assert plan.tokens_that_fit == 1222352


def test_deepseek_v32_plans_the_indexer_cache_as_its_own_group() -> None:
    plan = plan_of("deepseek-v3.2-exp", max_model_len=163840)
    kinds = [g.group.kind.value for g in plan.groups]
    assert kinds == ["mla_attention", "indexer"]
    # The indexer shares the MLA group's block ids: the page is the MLA page, 16 * 576 * 2
    # = 18432 B, one kernel block each; the index rows (16 * 132 = 2112 B per block and
    # layer) are in buffers of their own, counted beside each block.
    assert plan.page_size_bytes == 18432
    assert [g.group.block_owner for g in plan.groups] == [None, 0]
    assert [g.group.blocks_per_page for g in plan.groups] == [1, 1]
    assert plan.shared_bytes_per_page == 61 * 2112
    assert plan.bytes_per_block == 61 * 18432 + 61 * 2112
    # 61 * (576 * 2 + 128 + 4): the indexer's 132 bytes counted per token
    assert plan.kv_bytes_per_token == 78324
    # A request holds its 163840 / 16 = 10240 MLA blocks; the index rows hold none apart.
    assert [g.blocks_per_request for g in plan.groups] == [10240, 0]
    assert [g.kernel_blocks_per_request for g in plan.groups] == [10240, 10240]
    assert plan.blocks_per_request == 10240
    status, text, err = run(
        ["plan", str(CONFIGS / "deepseek-v3.2-exp.json"), "--gpu-memory", "80GiB"]
    )
    assert (status, err) == (0, "")
    assert "indexer (IndexerSpec)" in text
    assert "model.layers.0.self_attn.indexer" in text
    # 80 GiB // (61 * 20544 B) = 68544 blocks; the index cache's own pool line.
    assert "-> 68544 blocks" in text
    blocks = 85899345920 // (61 * 20544)
    assert (
        "group 1 pool:        indexer cache in its own buffers, block ids of group 0: 2112 B "
        f"per kernel block x 61 layer(s) = 128832 B of each block (10.3%); {blocks * 128832} B"
    ) in text
    assert "blocks per request:  2048 (group 0: 2048, group 1: group 0's)" in text
    # Per rank: the same pairing, the index rows replicated with the latents.
    status, text, err = run(
        [
            "plan",
            str(CONFIGS / "deepseek-v3.2-exp.json"),
            "--gpu-memory",
            "80GiB",
            "--tensor-parallel",
            "2",
        ]
    )
    assert (status, err) == (0, "")
    ranked = text[text.index("groups on each rank:") :]
    assert "group 1 (indexer): block size 16, 1 K/V head(s), block ids of group 0" in ranked
    assert "+ 128832 B in the own buffers of groups sharing its ids = 1253184 B" in ranked
    assert "-> 68544 blocks" in ranked


def test_deepseek_v32_plan_refuses_context_parallelism() -> None:
    with pytest.raises(InvalidArgumentError, match=r"context_parallel=2.*shares the block ids"):
        plan_model(
            layout_from_hf_config(CONFIGS / "deepseek-v3.2-exp.json"),
            AttentionConfig(),
            device="cpu",
            registry=reference_only(),
            context_parallel=2,
        )


def test_qwen3_next_hybrid_puts_attention_blocks_in_pages() -> None:
    plan = plan_of("qwen3-next-80b-a3b-instruct", max_model_len=262144)
    gdn, attention = plan.groups
    assert (gdn.group.kind.value, attention.group.kind.value) == ("mamba", "full_attention")
    assert (len(gdn.group.layer_names), len(attention.group.layer_names)) == (36, 12)
    # Gated DeltaNet state: conv (2*16*128 + 32*128 = 8192, 4 - 1) in bf16 = 49152 B,
    # delta-rule state (32, 128, 128) in float32 = 2097152 B; together 2146304 B
    assert plan.state_bytes_per_request == 36 * 2146304  # = 77266944
    # attention page 2 * 16 * 2 KV heads * 256 * 2 = 32768 B; the smallest multiple
    # holding the state: 32768 * ceil(2146304 / 32768) = 32768 * 66 = 2162688
    assert plan.page_size_bytes == 2162688
    # so a page holds 66 attention blocks of 16 tokens (1056 tokens); the kernels see 16
    assert attention.group.spec.block_size == 16
    assert attention.group.blocks_per_page == 66
    assert attention.group.page_tokens == 1056
    # 36 buffers (the largest group) * 2162688
    assert plan.bytes_per_block == 77856768
    # 12 layers * 2 * 2 * 256 * 2
    assert plan.kv_bytes_per_token == 24576
    # 85899345920 // 77856768
    assert plan.num_blocks == 1103
    # ceil(262144 / 16) = 16384 kernel blocks in ceil(16384 / 66) = 249 pages, + 1 state page
    assert (attention.kernel_blocks_per_request, gdn.kernel_blocks_per_request) == (16384, 1)
    assert (attention.blocks_per_request, gdn.blocks_per_request) == (249, 1)
    # 1102 // 250
    assert plan.max_concurrency == 4
    # 1102 * 262144 // 250
    assert plan.tokens_that_fit == 1155530


def test_num_blocks_instead_of_memory() -> None:
    plan = plan_model(
        layout_from_hf_config(CONFIGS / "llama-3.1-8b.json"),
        AttentionConfig(max_model_len=4096),
        device="cpu",
        registry=reference_only(),
        num_blocks=1001,
    )
    # 1001 blocks * 2097152 B
    assert plan.memory_bytes == 2099249152
    # 1000 usable // ceil(4096 / 16) = 256
    assert plan.max_concurrency == 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 85899345920),  # 80 * 2**30
        ("500MB", 500000000),  # 500 * 10**6
        ("1.5 KiB", 1536),
        ("4096", 4096),
        ("2kB", 2000),
    ],
)
def test_parse_memory_size(text: str, expected: int) -> None:
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("80 gigs", "memory must be a size such as 80GiB"),
        ("80gib", "memory must be a size such as 80GiB"),
        ("-1GiB", "memory must be positive, got '-1GiB'"),
        ("0.3B", "memory must be a whole number of bytes, got '0.3B'"),
        ("0", "memory must be at least 1 byte, got '0'"),
    ],
)
def test_parse_memory_size_rejects(text: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match="^" + message.replace(".", r"\.")):
        parse_memory_size(text)


# --------------------------------------------------------------------------- plan == runtime


def _state_params(layout: ModelLayout) -> dict[str, LayerParams]:
    """Zero weights of the shapes the config gives (the runtime checks shapes only)."""
    params: dict[str, LayerParams] = dict(layout.attention_params())
    for name, info in layout.layers.items():
        dims = info.state
        if isinstance(dims, Mamba2Dims):
            params[name] = info.state_params(
                conv_weight=torch.zeros(dims.conv_dim, dims.d_conv),
                A=torch.zeros(dims.num_heads),
            )
        elif isinstance(dims, ShortConvDims):
            params[name] = info.state_params(
                conv_weight=torch.zeros(dims.channels, dims.conv_kernel)
            )
    return params


def _small_hybrid() -> tuple[dict[str, KVCacheSpec], dict[str, LayerParams]]:
    """Full, Mamba2 and sliding-window layers, float32, whose state outgrows the
    attention page: conv (4*16 + 2*1*16 = 96, 3) + SSM (4, 16, 16) = 1152 + 4096 =
    5248 B; attention pages 2*16*1*16*4 = 2048 B scale by ceil(5248 / 2048) = 3."""
    mamba = Mamba2LayerParams(
        num_heads=4,
        head_dim=16,
        n_groups=1,
        d_state=16,
        conv_weight=torch.zeros(96, 4),
        A=torch.zeros(4),
    )
    state = MambaSpec(
        block_size=16,
        shapes=mamba.state_shapes,
        dtypes=(torch.float32, torch.float32),
        mamba_type="mamba2",
    )
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32, sliding_window=64
    )
    specs: dict[str, KVCacheSpec] = {"l0": full, "l1": state, "l2": window, "l3": state}
    params: dict[str, LayerParams] = {
        "l0": AttentionLayerParams(num_heads=2),
        "l1": mamba,
        "l2": AttentionLayerParams(num_heads=2),
        "l3": mamba,
    }
    return specs, params


Case = tuple[str, dict[str, KVCacheSpec], dict[str, LayerParams] | None]


def _layouts() -> list[Case]:
    cases: list[Case] = [
        (f"example-{name}", example_model(name, dtype=torch.float32), None)
        for name in ("gemma2", "llama4")
    ]
    cases.append(("small-hybrid", *_small_hybrid()))
    # The reference backend keeps Mamba2 SSM states in float32 only: bamba in float32.
    for name, dtype in (
        ("lfm2-1.2b", torch.bfloat16),
        ("llama-3.1-8b", torch.bfloat16),
        ("bamba-9b", torch.float32),
    ):
        layout = layout_from_hf_config(CONFIGS / f"{name}.json", dtype=dtype)
        cases.append((name, layout.specs(), _state_params(layout)))
    return cases


def test_the_small_hybrid_puts_three_attention_blocks_in_a_page() -> None:
    specs, params = _small_hybrid()
    plan = plan_model(
        specs, AttentionConfig(), device="cpu", registry=reference_only(), layer_params=params
    )
    # 2048 * 3
    assert plan.page_size_bytes == 6144
    # full, mamba2, sliding window: pages of 3 attention blocks of 16 tokens
    assert [g.group.spec.block_size for g in plan.groups] == [16, 16, 16]
    assert [g.group.blocks_per_page for g in plan.groups] == [3, 1, 3]


@pytest.mark.parametrize(("name", "specs", "params"), _layouts(), ids=[c[0] for c in _layouts()])
def test_plan_block_sizes_are_the_runtimes(
    name: str, specs: dict[str, KVCacheSpec], params: dict[str, LayerParams] | None
) -> None:
    config = AttentionConfig(backend_per_kind={"mamba": "reference"})
    registry = reference_only()
    plan = plan_model(
        specs, config, device="cpu", registry=registry, layer_params=params, num_blocks=3
    )
    runtime = AttentionRuntime(
        specs,
        config,
        device="cpu",
        memory_budget_bytes=plan.memory_bytes or 0,
        layer_params=params,
        registry=registry,
    )
    assert [g.group.spec for g in plan.groups] == [g.spec for g in runtime.groups]
    assert [g.group.layer_names for g in plan.groups] == [g.layer_names for g in runtime.groups]
    assert [g.group for g in plan.groups] == list(runtime.groups)  # blocks per page too
    assert plan.page_size_bytes == runtime.page_size_bytes
    assert plan.num_blocks == runtime.num_blocks == 3
    assert [g.backend_name for g in plan.groups] == [s.backend_name for s in runtime.selections]
    cg = plan.cudagraph()
    assert cg is not None
    assert cg == runtime.cudagraph_support()


def test_the_hybrid_example_puts_attention_blocks_in_pages() -> None:
    """The case the shared path is for: Mamba2 states of (8448, 3) and (64, 64, 128)
    in float32 are 8448*3*4 + 64*64*128*4 = 101376 + 2097152 = 2198528 B; a page holds
    ceil(2198528 / 131072) = 17 attention pages of 2*16*8*128*4 = 131072 B, i.e. 17
    kernel blocks of 16 tokens (272 tokens)."""
    plan = plan_model(
        example_model("hybrid", dtype=torch.float32),
        AttentionConfig(),
        device="cpu",
        registry=reference_only(),
    )
    assert plan.page_size_bytes == 131072 * 17
    assert [g.group.spec.block_size for g in plan.groups] == [16, 16, 16, 16]
    assert [g.group.blocks_per_page for g in plan.groups] == [17, 1, 17, 17]
    assert [g.group.page_tokens for g in plan.groups] == [272, 16, 272, 272]


# --------------------------------------------------------------------------- the command


def test_cli_text_report_for_llama() -> None:
    status, text, err = run(
        [
            "plan",
            str(CONFIGS / "llama-3.1-8b.json"),
            "--gpu-memory",
            "80GiB",
            "--max-model-len",
            "131072",
        ]
    )
    assert (status, err) == (0, "")
    assert text.startswith(f"model llama ({CONFIGS / 'llama-3.1-8b.json'}) on cpu (")
    assert "dtype bfloat16\n" in text
    assert (
        "  model.layers.31.self_attn  full_attention  -      -       -      0      reference\n"
        in text
    )
    assert (
        "model.layers.0.self_attn, model.layers.1.self_attn, ..., model.layers.31.self_attn "
        "(32 layers): full_attention (FullAttentionSpec)\n"
        "  -> reference (chosen by priority; determinism: batch_invariant)\n"
        "  group 0: block size 16, 32 layer(s), layout interleaved, "
        "at most 8192 block(s) per request\n"
    ) in text
    assert "  KV per token:        131072 B (128.00 KiB) (attention layers)\n" in text
    assert (
        "  memory:              85899345920 B (80.00 GiB) -> 40960 blocks (40959 usable; "
        "block 0 is the null block)\n"
    ) in text
    assert "  tokens that fit:     655344\n" in text
    assert "  concurrent requests: 4 of 131072 tokens\n" in text
    assert (
        "  CUDA graphs:         NEVER (limited by group 0 (full_attention, backend reference))\n"
        in text
    )


def test_cli_text_report_shows_windows_and_blocks_per_page() -> None:
    status, text, _ = run(
        ["plan", str(CONFIGS / "qwen3-next-80b-a3b-instruct.json"), "--num-blocks", "100"]
    )
    assert status == 0
    assert (
        "  model.layers.0.linear_attn   mamba           gdn    -       -      0      reference\n"
        in text
    )
    assert "  group 1: block size 16, 66 per page of 1056 tokens, 12 layer(s)" in text
    status, text, _ = run(
        [
            "plan",
            str(CONFIGS / "gemma-2-9b-it.json"),
            "--max-model-len",
            "8192",
            "--max-num-batched-tokens",
            "512",
        ]
    )
    assert status == 0
    assert (
        "  model.layers.0.self_attn   sliding_window  -      4096    -      0      reference\n"
        in text
    )
    assert (
        "  group 0:             172032 B per token up to its window 4096; at most 795475968 B "
        "(758.62 MiB) per request\n"
    ) in text
    assert "  memory:              not given (--gpu-memory or --num-blocks)\n" in text


def test_cli_json_schema_and_values() -> None:
    data = plan_json(
        [
            str(CONFIGS / "gemma-2-9b-it.json"),
            "--gpu-memory",
            "80GiB",
            "--max-model-len",
            "8192",
            "--max-num-batched-tokens",
            "512",
        ]
    )
    assert tuple(data) == PLAN_JSON_KEYS
    assert data["model_type"] == "gemma2"
    assert data["source"] == str(CONFIGS / "gemma-2-9b-it.json")
    assert len(data["layers"]) == 42
    assert data["layers"][0] == {
        "name": "model.layers.0.self_attn",
        "kind": "sliding_window",
        "mamba_type": None,
        "sliding_window": 4096,
        "attention_chunk_size": None,
        "group": 0,
        "backend": "reference",
    }
    assert data["layers"][1]["kind"] == "full_attention"
    assert data["layers"][1]["group"] == 1
    # The hand computations of test_gemma_2_9b_windowed_layers_are_bounded_by_their_window.
    assert data["kv_bytes_per_token"] == 344064
    assert data["num_blocks"] == 31207
    assert data["max_concurrency"] == 38
    assert data["tokens_that_fit"] == 319150
    assert data["memory_bytes"] == MEMORY_80GIB
    assert [g["blocks_per_request"] for g in data["groups"]] == [289, 512]
    assert data["groups"][0]["per_request_cap_bytes"] == 795475968
    assert data["unserved_groups"] == []


def test_cli_json_state_layers_and_directories(tmp_path: Path) -> None:
    # A directory holding config.json is read as its config.
    shutil.copy(CONFIGS / "lfm2-1.2b.json", tmp_path / "config.json")
    data = plan_json([str(tmp_path)])
    kinds = {layer["kind"] for layer in data["layers"]}
    assert kinds == {"mamba", "full_attention"}
    state = [layer for layer in data["layers"] if layer["kind"] == "mamba"]
    assert {layer["mamba_type"] for layer in state} == {"short_conv"}
    assert data["max_concurrency"] is None  # no budget given
    assert data["num_blocks"] is None


def test_cli_examples_keep_working() -> None:
    data = plan_json(["--example", "llama", "--num-blocks", "9"])
    assert data["model_type"] is None
    assert data["source"] == "example:llama"
    # 8 usable blocks // ceil(32768 / 16) = 2048 per request
    assert data["max_concurrency"] == 0
    assert plan_json(["--model", "llama"])["source"] == "example:llama"


def test_cli_block_size_option() -> None:
    data = plan_json([str(CONFIGS / "llama-3.1-8b.json"), "--block-size", "32"])
    # 2 * 32 * 8 * 128 * 2
    assert data["page_size_bytes"] == 131072
    assert data["groups"][0]["block_size"] == 32


def test_cli_says_why_a_group_falls_back_to_reference() -> None:
    """Blocks of 7 tokens: cpu_attn (blocks of 16n) refuses, so every layer runs on
    reference; the note under the layer table says so, with the reason. State layers,
    which no faster CPU backend serves, get no note."""
    llama = str(CONFIGS / "llama-3.1-8b.json")
    registry = BackendRegistry(
        builtins={
            "cpu_attn": "attnkit.backends.cpu_attn:CpuAttentionBackend",
            "reference": "attnkit.backends.reference:ReferenceBackend",
        },
        entry_points=[],
    )

    def report(*argv: str) -> str:
        out, err = io.StringIO(), io.StringIO()
        assert main(["plan", *argv], registry=registry, out=out, err=err) == 0
        assert err.getvalue() == ""
        return out.getvalue()

    text = report(llama, "--block-size", "7")
    table_end = text.index("\ngroups (")
    assert text[text.rindex("  model.layers.31.self_attn", 0, table_end) :].split("\n")[1:3] == [
        "note: group 0 (32 layer(s), full_attention) runs on reference, the pure-torch oracle "
        "(correct, not fast), because the faster backends for full_attention refused:",
        "  cpu_attn: block_size=7 not supported (supported: multiple of 16)",
    ]
    assert "note:" not in report(llama)
    assert "note:" not in report(str(CONFIGS / "jamba-v0.1.json"))  # mamba: reference only


def test_cli_unserved_state_layers_exit_1() -> None:
    """Jamba's Mamba (1) layers with a bfloat16 SSM state have no backend here (the
    state backends keep SSM states in float32 only): exit 1 with the reasons. With the
    default float32 state they are served."""
    jamba = str(CONFIGS / "jamba-v0.1.json")
    status, text, err = run(["plan", jamba, "--state-dtype", "bfloat16"])
    assert status == 1
    assert "mamba1 ssm state dtype (dtypes[1]) must be float32, got bfloat16" in text
    assert err.startswith("attnkit plan: error: no backend for 1 of 2 layer group(s): ")
    status, _, err = run(["plan", jamba, "--state-dtype", "bfloat16", "--report-only"])
    assert (status, err) == (0, "")
    status, text, err = run(["plan", jamba])
    assert (status, err) == (0, "")
    assert "  model.layers.0.mamba" in text


# --------------------------------------------------------------------------- errors


def test_cli_missing_config(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    status, text, err = run(["plan", str(missing)])
    assert (status, text) == (2, "")
    assert err == (
        f"attnkit plan: error: CONFIG must be a config.json or a directory holding one; "
        f"{str(missing)!r} does not exist\n"
    )


def test_cli_directory_without_config(tmp_path: Path) -> None:
    status, text, err = run(["plan", str(tmp_path)])
    assert (status, text) == (2, "")
    assert err.startswith("attnkit plan: error: layout_from_hf_config: config_or_path=")
    assert "config.json" in err
    assert "cannot read" in err


def test_cli_unknown_model_type(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt9", "num_hidden_layers": 2}))
    status, text, err = run(["plan", str(config)])
    assert (status, text) == (2, "")
    assert err.startswith(
        "attnkit plan: error: layout_from_hf_config: unsupported model_type 'gpt9'; supported: "
    )
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("80 gigs", "must be a size such as 80GiB, 500MB or 4096 (bytes); units: "),
        ("1.5B", "must be a whole number of bytes, got '1.5B' (= 1.5 bytes)"),
        ("0", "must be at least 1 byte, got '0'"),
    ],
)
def test_cli_bad_gpu_memory(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", str(CONFIGS / "llama-3.1-8b.json"), "--gpu-memory", value])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"attnkit plan: error: argument --gpu-memory: {message}")


def test_cli_gpu_memory_too_small_for_two_blocks() -> None:
    status, text, err = run(["plan", str(CONFIGS / "llama-3.1-8b.json"), "--gpu-memory", "1MB"])
    assert (status, text) == (2, "")
    # one block is 32 * 65536 = 2097152 B; two need 4194304 B
    assert err == (
        "attnkit plan: error: --gpu-memory 1000000 B holds 0 block(s) of 2097152 bytes "
        "(32 layer buffer(s) x page 65536 B); at least 2 are needed (the null block and "
        "one more), i.e. 4194304 bytes\n"
    )


def test_cli_options_for_configs_only() -> None:
    status, text, err = run(["plan", "--example", "llama", "--block-size", "32"])
    assert (status, text) == (2, "")
    assert err == (
        "attnkit plan: error: --block-size applies to a CONFIG; the example models use "
        "block size 16 and kv-cache dtype auto (got --example llama)\n"
    )
    status, text, err = run(["plan", str(CONFIGS / "llama-3.1-8b.json"), "--example", "llama"])
    assert (status, text) == (2, "")
    assert "give CONFIG or --example, not both" in err


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"memory_bytes": 10**9, "num_blocks": 4},
            InvalidArgumentError,
            "plan_model: give memory_bytes or num_blocks, not both; got memory_bytes=1000000000 "
            "and num_blocks=4",
        ),
        (
            {"num_blocks": 1},
            InvalidArgumentError,
            "plan_model: num_blocks must be an int >= 2 (block 0 is the null block), got 1",
        ),
        (
            {"layer_params": {"layers.9": None}},
            InvalidArgumentError,
            "plan_model: layer_params names layer 'layers.9', which the model lacks",
        ),
    ],
    ids=["memory-and-blocks", "one-block", "unknown-layer"],
)
def test_plan_model_rejects_bad_arguments(
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


def test_plan_model_rejects_a_model_of_another_type() -> None:
    with pytest.raises(ArgumentTypeError) as info:
        plan_model(cast("Any", [1, 2]), AttentionConfig(), device="cpu")
    assert str(info.value) == (
        "plan_model: model must be a ModelLayout or a mapping of layer name -> KVCacheSpec, "
        "got list"
    )


@pytest.mark.parametrize(
    ("name", "per_page"),
    [("qwen3-next-80b-a3b-instruct", 66), ("jamba-v0.1", 9), ("bamba-9b", 33)],
)
def test_hybrid_full_attention_routes_to_triton_attn_on_cuda(name: str, per_page: int) -> None:
    """``attnkit plan CONFIG --device cuda --capability 9.0`` (no GPU needed): a hybrid's
    full attention keeps its blocks of 16 tokens, which triton_attn takes, and a unified
    page holds ``per_page`` of them (once, a page-sized block of 16 * per_page tokens
    went to flex_attention)."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["plan", str(CONFIGS / f"{name}.json"), "--device", "cuda", "--capability", "9.0"]
    registry = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)
    status = main([*argv, "--json"], registry=registry, out=out, err=err)
    assert status == 0, err.getvalue()  # (off CUDA: a note that the device is hypothetical)
    data = json.loads(out.getvalue())
    full = [g for g in data["groups"] if g["kind"] == "full_attention"]
    assert [(g["backend"], g["block_size"], g["blocks_per_page"]) for g in full] == [
        ("triton_attn", 16, per_page)
    ]
    assert full[0]["page_size_bytes"] == data["page_size_bytes"]
    out = io.StringIO()
    assert main(argv, registry=registry, out=out, err=err) == 0
    assert f"block size 16, {per_page} per page of {16 * per_page} tokens" in out.getvalue()
