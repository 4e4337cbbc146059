"""Tests for ``attnkit.models``: Hugging Face ``config.json`` -> layer specs.

The twelve real configs under tests/fixtures/model-configs/ (copied from
shared/model-configs, see its README) and small synthetic configs written here from
each family's documented keys. Every expectation is computed independently: the layer
rule restated as plain Python over the config (``[i % 8 == 4 for i in range(32)]`` for
Jamba), sizes and bytes written as numbers with their arithmetic in a comment. Nothing
expected is read back from the code under test.
"""

from __future__ import annotations

import ast
import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import attnkit
import attnkit.models
from attnkit import (
    ArgumentTypeError,
    AttentionLayerParams,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    GatedDeltaNetLayerParams,
    IndexerSpec,
    InvalidArgumentError,
    KVCacheSpec,
    LinearAttentionLayerParams,
    Mamba1LayerParams,
    Mamba2LayerParams,
    MambaSpec,
    MLAAttentionSpec,
    ShortConvLayerParams,
    SlidingWindowSpec,
)
from attnkit.models import (
    SUPPORTED_MODEL_TYPES,
    GatedDeltaNetDims,
    LayerInfo,
    LinearAttentionDims,
    Mamba1Dims,
    Mamba2Dims,
    ModelLayout,
    ShortConvDims,
    layout_from_hf_config,
    lightning_attention_decay,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "model-configs"
BF16 = torch.bfloat16
F32 = torch.float32


def _read(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return data


def _spec_classes(layout: ModelLayout) -> list[type[KVCacheSpec]]:
    return [type(info.spec) for info in layout.layers.values()]


def _only_attention(layout: ModelLayout) -> list[LayerInfo]:
    return [info for info in layout.layers.values() if info.is_attention]


def _attn_shape(info: LayerInfo) -> tuple[int, int, torch.dtype]:
    spec = info.spec
    assert isinstance(spec, attnkit.AttentionSpec)
    return spec.num_kv_heads, spec.head_size, spec.dtype


# --------------------------------------------------------------------------- real configs


def test_every_real_config_is_a_fixture() -> None:
    names = sorted(p.name for p in FIXTURES.glob("*.json"))
    assert len(names) == 13
    for name in names:
        assert layout_from_hf_config(FIXTURES / name).model_type == _read(name)["model_type"]


def test_llama_3_1_8b() -> None:
    layout = layout_from_hf_config(FIXTURES / "llama-3.1-8b.json")
    assert list(layout.layers) == [f"model.layers.{i}.self_attn" for i in range(32)]
    assert _spec_classes(layout) == [FullAttentionSpec] * 32
    # No head_dim key: 4096 // 32 = 128; GQA 32 query / 8 KV heads; torch_dtype bfloat16.
    assert {_attn_shape(i) for i in layout.layers.values()} == {(8, 128, BF16)}
    assert {i.num_heads for i in layout.layers.values()} == {32}
    # 128 ** -0.5 = 0.08838834764831845
    assert [i.scale for i in layout.layers.values()] == [pytest.approx(0.0883883476483)] * 32
    # 32 layers * 2 (K, V) * 8 heads * 128 * 2 bytes = 131072
    assert layout.kv_bytes_per_token() == 131072
    assert layout.state_bytes_per_request() == 0


def test_mistral_7b_slides_every_layer() -> None:
    layout = layout_from_hf_config(FIXTURES / "mistral-7b-v0.1.json")
    assert _spec_classes(layout) == [SlidingWindowSpec] * 32
    assert {i.sliding_window for i in layout.layers.values()} == {4096}
    assert {getattr(i.spec, "sliding_window", None) for i in layout.layers.values()} == {4096}
    # 32 * 2 * 8 * 128 * 2 = 131072
    assert layout.kv_bytes_per_token() == 131072


def test_gemma_2_9b_alternates_with_even_layers_sliding() -> None:
    config = _read("gemma-2-9b-it.json")
    layout = layout_from_hf_config(config)
    # Gemma2Config: sliding when (i + 1) % 2, i.e. even layers.
    sliding = [i % 2 == 0 for i in range(42)]
    assert _spec_classes(layout) == [SlidingWindowSpec if s else FullAttentionSpec for s in sliding]
    assert [i.sliding_window for i in layout.layers.values()] == [
        4096 if s else None for s in sliding
    ]
    assert {_attn_shape(i) for i in layout.layers.values()} == {(8, 256, BF16)}
    # query_pre_attn_scalar 256: 256 ** -0.5 = 1/16; soft-cap 50.
    assert {i.scale for i in layout.layers.values()} == {0.0625}
    assert {i.logits_soft_cap for i in layout.layers.values()} == {50.0}
    params = layout.layers["model.layers.0.self_attn"].attention_params()
    assert (params.num_heads, params.scale, params.logits_soft_cap) == (16, 0.0625, 50.0)
    # 42 * 2 * 8 * 256 * 2 = 344064
    assert layout.kv_bytes_per_token() == 344064


def test_qwen2_5_7b_ignores_a_window_that_is_not_in_use() -> None:
    layout = layout_from_hf_config(FIXTURES / "qwen2.5-7b.json")
    assert _spec_classes(layout) == [FullAttentionSpec] * 28
    assert {i.sliding_window for i in layout.layers.values()} == {None}
    # 3584 // 28 = 128; 4 KV heads; 28 * 2 * 4 * 128 * 2 = 57344
    assert {_attn_shape(i) for i in layout.layers.values()} == {(4, 128, BF16)}
    assert layout.kv_bytes_per_token() == 57344


def test_gpt_oss_20b_layer_types_and_sinks() -> None:
    config = _read("gpt-oss-20b.json")
    layout = layout_from_hf_config(config)
    sliding = [t == "sliding_attention" for t in config["layer_types"]]
    assert sliding == [i % 2 == 0 for i in range(24)]
    assert _spec_classes(layout) == [SlidingWindowSpec if s else FullAttentionSpec for s in sliding]
    assert [i.sliding_window for i in layout.layers.values()] == [
        128 if s else None for s in sliding
    ]
    assert all(i.has_sinks for i in layout.layers.values())
    assert {_attn_shape(i) for i in layout.layers.values()} == {(8, 64, BF16)}
    # 24 * 2 * 8 * 64 * 2 = 49152
    assert layout.kv_bytes_per_token() == 49152
    info = layout.layers["model.layers.1.self_attn"]
    with pytest.raises(InvalidArgumentError, match=r"learned sinks.*sinks="):
        info.attention_params()
    sinks = torch.zeros(64)
    params = info.attention_params(sinks=sinks)
    assert params.sinks is sinks
    assert params.num_heads == 64
    # Layers with sinks need their weights, so the bulk helper leaves them out.
    assert layout.attention_params() == {}


def test_deepseek_v3_is_mla_with_a_576_latent_and_yarn_scale() -> None:
    layout = layout_from_hf_config(FIXTURES / "deepseek-v3.json")
    assert _spec_classes(layout) == [MLAAttentionSpec] * 61
    # kv_lora_rank 512 + qk_rope_head_dim 64 = 576, one latent shared by all heads.
    assert {_attn_shape(i) for i in layout.layers.values()} == {(1, 576, BF16)}
    info = layout.layers["model.layers.0.self_attn"]
    assert info.mla is not None
    assert (info.mla.kv_lora_rank, info.mla.qk_rope_head_dim) == (512, 64)
    assert (info.mla.qk_nope_head_dim, info.mla.v_head_dim, info.mla.q_lora_rank) == (
        128,
        128,
        1536,
    )
    # (128 + 64) ** -0.5 = 0.0721687836; yarn factor 40, mscale_all_dim 1.0:
    # mscale = 0.1 * 1.0 * ln(40) + 1 = 1.3688879454; squared 1.8738541...
    # 0.0721687836 * 1.8738541 = 0.1352337789
    assert info.scale == pytest.approx(0.1352337789, rel=1e-9)
    params = info.attention_params()
    assert (params.num_heads, params.v_head_size) == (128, 512)
    # 61 layers * 576 * 2 bytes (one latent, no separate V) = 70272
    assert layout.kv_bytes_per_token() == 70272


def test_deepseek_v32_adds_an_fp8_indexer_cache_beside_every_mla_layer() -> None:
    layout = layout_from_hf_config(FIXTURES / "deepseek-v3.2-exp.json")
    names = list(layout.layers)
    assert names[:4] == [
        "model.layers.0.self_attn",
        "model.layers.0.self_attn.indexer",
        "model.layers.1.self_attn",
        "model.layers.1.self_attn.indexer",
    ]
    assert _spec_classes(layout) == [MLAAttentionSpec, IndexerSpec] * 61
    indexer = layout.layers["model.layers.7.self_attn.indexer"]
    assert isinstance(indexer.spec, IndexerSpec)
    assert (indexer.spec.head_size, indexer.spec.index_topk, indexer.num_heads) == (128, 2048, 64)
    assert indexer.spec.kv_cache_dtype == "fp8_e4m3"
    assert indexer.spec.block_size == layout.layers["model.layers.7.self_attn"].spec.block_size
    # Per token: 61 * (576 * 2 latent bytes + 128 fp8 bytes + 4 scale bytes) = 78324.
    assert layout.kv_bytes_per_token() == 61 * (1152 + 132) == 78324


def test_qwen3_next_gated_deltanet_with_full_attention_every_4th() -> None:
    layout = layout_from_hf_config(FIXTURES / "qwen3-next-80b-a3b-instruct.json")
    full = [(i + 1) % 4 == 0 for i in range(48)]
    assert list(layout.layers) == [
        f"model.layers.{i}.self_attn" if f else f"model.layers.{i}.linear_attn"
        for i, f in enumerate(full)
    ]
    assert _spec_classes(layout) == [FullAttentionSpec if f else MambaSpec for f in full]
    assert {_attn_shape(i) for i in _only_attention(layout)} == {(2, 256, BF16)}
    gdn = layout.layers["model.layers.0.linear_attn"]
    assert isinstance(gdn.spec, MambaSpec)
    assert gdn.spec.mamba_type == "gdn"
    # conv over q, k, v: 2 * 16 key heads * 128 + 32 value heads * 128 = 8192 channels,
    # width 4 -> 3 kept; delta-rule state per value head: (32, 128, 128).
    assert gdn.spec.shapes == ((8192, 3), (32, 128, 128))
    # conv state in the model dtype, the recurrent state in float32 (state_dtype)
    assert gdn.spec.dtypes == (BF16, torch.float32)
    # 12 attention layers * 2 * 2 * 256 * 2 = 24576
    assert layout.kv_bytes_per_token() == 24576
    # bytes per request: 36 layers * (8192*3*2 + 32*128*128*4) = 36 * 2146304 = 77266944
    assert layout.state_bytes_per_request() == 77266944
    # with state_dtype=bf16 (what some engines keep): 36 * (8192*3 + 32*128*128) * 2
    narrow = layout_from_hf_config(
        FIXTURES / "qwen3-next-80b-a3b-instruct.json", state_dtype=torch.bfloat16
    )
    assert narrow.state_bytes_per_request() == 39518208
    assert gdn.state == GatedDeltaNetDims(
        num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128, conv_kernel=4
    )
    # 16 key heads, each shared by 32 / 16 = 2 value heads: the parameters keep both counts.
    params = gdn.state_params(conv_weight=torch.zeros(8192, 4))
    assert isinstance(params, GatedDeltaNetLayerParams)
    assert (params.num_heads, params.num_key_heads, params.key_heads) == (32, 16, 16)
    assert (params.key_dim, params.value_dim) == (128, 128)
    # C = 2 * Hk * K + Hv * V = 2 * 16 * 128 + 32 * 128 = 4096 + 4096 = 8192
    assert params.conv_dim == 8192
    assert params.state_shapes == ((8192, 3), (32, 128, 128)) == gdn.spec.shapes
    # g / beta [T, Hv], o [T, Hv, V]
    assert params.output_shape(5) == (5, 32, 128)
    # A conv weight sized for equal heads (3 * 32 * 128 channels) is refused.
    with pytest.raises(InvalidArgumentError, match=r"conv_weight must be \[channels=8192"):
        gdn.state_params(conv_weight=torch.zeros(12288, 4))


@pytest.mark.parametrize("bad", [0, -2, 3, True, 2.0, "2"], ids=repr)
def test_gdn_params_reject_bad_num_key_heads(bad: object) -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=r"GatedDeltaNetLayerParams\.num_key_heads must be None or a positive int "
        r"dividing num_heads=4, got ",
    ):
        GatedDeltaNetLayerParams(
            num_heads=4,
            num_key_heads=bad,  # type: ignore[arg-type]  # the bad value under test
            key_dim=8,
            value_dim=8,
            conv_weight=torch.zeros(64, 4),
        )
    # None and every divisor are fine: C = 2 * Hk * 8 + 4 * 8.
    for hk, channels in ((None, 96), (4, 96), (2, 64), (1, 48)):
        params = GatedDeltaNetLayerParams(
            num_heads=4,
            num_key_heads=hk,
            key_dim=8,
            value_dim=8,
            conv_weight=torch.zeros(channels, 4),
        )
        assert params.conv_dim == channels
        assert params.state_shapes[1] == (4, 8, 8)


def test_gdn_value_heads_must_be_a_multiple_of_key_heads() -> None:
    config = {
        "model_type": "qwen3_next",
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 3,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
    }
    gdn = layout_from_hf_config(config).layers["model.layers.0.linear_attn"]
    # C = 2 * 3 * 8 + 4 * 8 = 80
    with pytest.raises(
        InvalidArgumentError,
        match=r"GatedDeltaNetLayerParams\.num_key_heads must be None or a positive int "
        r"dividing num_heads=4, got 3",
    ):
        gdn.state_params(conv_weight=torch.zeros(80, 4))


def test_jamba_mamba1_with_attention_at_offset_4_of_8() -> None:
    layout = layout_from_hf_config(FIXTURES / "jamba-v0.1.json")
    attn = [i % 8 == 4 for i in range(32)]
    assert list(layout.layers) == [
        f"model.layers.{i}.self_attn" if a else f"model.layers.{i}.mamba"
        for i, a in enumerate(attn)
    ]
    assert _spec_classes(layout) == [FullAttentionSpec if a else MambaSpec for a in attn]
    mamba = layout.layers["model.layers.0.mamba"]
    assert isinstance(mamba.spec, MambaSpec)
    assert mamba.spec.mamba_type == "mamba1"
    # d_inner = mamba_expand 2 * hidden 4096 = 8192; conv (8192, d_conv 4 - 1); ssm (8192, 16)
    assert mamba.spec.shapes == ((8192, 3), (8192, 16))
    assert mamba.state == Mamba1Dims(d_inner=8192, d_state=16, d_conv=4, dt_rank=256)
    weights = {
        "conv_weight": torch.zeros(8192, 4),
        "x_proj_weight": torch.zeros(256 + 2 * 16, 8192),
        "dt_proj_weight": torch.zeros(8192, 256),
        "A": -torch.ones(8192, 16),
    }
    params = mamba.state_params(**weights, dt_norm_weight=torch.ones(256))
    assert isinstance(params, Mamba1LayerParams)
    assert (params.d_inner, params.d_state, params.dt_rank) == (8192, 16, 256)
    assert params.state_shapes == mamba.spec.shapes
    assert params.dt_norm_weight is not None
    assert params.B_norm_weight is None
    with pytest.raises(InvalidArgumentError, match=r"mamba1 layer needs x_proj_weight, got None"):
        mamba.state_params(**{**weights, "x_proj_weight": None})
    with pytest.raises(InvalidArgumentError, match=r"dt_proj_weight must be \[8192, dt_rank=256\]"):
        mamba.state_params(**{**weights, "dt_proj_weight": torch.zeros(8192, 8)})
    with pytest.raises(InvalidArgumentError, match=r"got \['decay'\] too"):
        mamba.state_params(**weights, decay=torch.ones(2))
    with pytest.raises(InvalidArgumentError, match=r"conv_weight must be \[8192, 4\]"):
        mamba.state_params(**{**weights, "conv_weight": torch.zeros(8192, 3)})
    # 4 attention layers * 2 * 8 * 128 * 2 = 16384
    assert layout.kv_bytes_per_token() == 16384


def test_bamba_mamba2_with_attention_at_listed_indices() -> None:
    layout = layout_from_hf_config(FIXTURES / "bamba-9b.json")
    attn = [i in (9, 18, 27) for i in range(32)]
    assert _spec_classes(layout) == [FullAttentionSpec if a else MambaSpec for a in attn]
    assert layout.dtype == F32  # the fixture has no torch_dtype
    mamba = layout.layers["model.layers.0.mamba"]
    assert isinstance(mamba.spec, MambaSpec)
    # conv channels: 128 heads * 64 + 2 * 1 group * 128 = 8448; ssm (128, 64, 128)
    assert mamba.spec.shapes == ((8448, 3), (128, 64, 128))
    params = mamba.state_params(conv_weight=torch.zeros(8448, 4), A=-torch.ones(128))
    assert isinstance(params, Mamba2LayerParams)
    assert params.state_shapes == ((8448, 3), (128, 64, 128))
    assert params.chunk_size == 256
    # 3 layers * 2 * 8 * 128 * 4 bytes (float32) = 24576
    assert layout.kv_bytes_per_token() == 24576


def test_lfm2_short_conv_with_attention_at_full_attn_idxs() -> None:
    layout = layout_from_hf_config(FIXTURES / "lfm2-1.2b.json")
    attn = [i in (2, 5, 8, 10, 12, 14) for i in range(16)]
    assert list(layout.layers) == [
        f"model.layers.{i}.self_attn" if a else f"model.layers.{i}.conv" for i, a in enumerate(attn)
    ]
    conv = layout.layers["model.layers.0.conv"]
    assert isinstance(conv.spec, MambaSpec)
    assert conv.spec.mamba_type == "short_conv"
    # hidden 2048 channels, conv_L_cache 3 -> 2 kept
    assert conv.spec.shapes == ((2048, 2),)
    params = conv.state_params(conv_weight=torch.zeros(2048, 3))
    assert isinstance(params, ShortConvLayerParams)
    assert params.state_shapes == conv.spec.shapes
    # 2048 // 32 = 64; 6 layers * 2 * 8 * 64 * 2 = 12288
    assert {_attn_shape(i) for i in _only_attention(layout)} == {(8, 64, BF16)}
    assert layout.kv_bytes_per_token() == 12288


def test_bert_is_encoder_only() -> None:
    layout = layout_from_hf_config(FIXTURES / "bert-base-uncased.json")
    assert list(layout.layers) == [f"bert.encoder.layer.{i}.attention.self" for i in range(12)]
    assert _spec_classes(layout) == [EncoderOnlyAttentionSpec] * 12
    # no num_key_value_heads: multi-head, 768 // 12 = 64; no torch_dtype: float32
    assert {_attn_shape(i) for i in layout.layers.values()} == {(12, 64, F32)}
    assert layout.kv_bytes_per_token() == 0


def test_t5_small_encoder_decoder() -> None:
    layout = layout_from_hf_config(FIXTURES / "t5-small.json")
    expected = [f"encoder.block.{i}.layer.0.SelfAttention" for i in range(6)]
    for i in range(6):
        expected += [
            f"decoder.block.{i}.layer.0.SelfAttention",
            f"decoder.block.{i}.layer.1.EncDecAttention",
        ]
    assert list(layout.layers) == expected
    assert (
        _spec_classes(layout)
        == [EncoderOnlyAttentionSpec] * 6
        + [
            FullAttentionSpec,
            CrossAttentionSpec,
        ]
        * 6
    )
    assert {_attn_shape(i) for i in layout.layers.values()} == {(8, 64, F32)}
    # T5 does not scale its scores.
    assert {i.scale for i in layout.layers.values()} == {1.0}
    # decoder self-attention only: 6 * 2 * 8 * 64 * 4 bytes = 24576
    assert layout.kv_bytes_per_token() == 24576


def test_a_path_a_directory_and_a_dict_give_the_same_layout(tmp_path: Path) -> None:
    for name in ("gemma-2-9b-it.json", "qwen3-next-80b-a3b-instruct.json", "t5-small.json"):
        from_dict = layout_from_hf_config(_read(name))
        from_path = layout_from_hf_config(FIXTURES / name)
        from_str = layout_from_hf_config(str(FIXTURES / name))
        model_dir = tmp_path / name.removesuffix(".json")
        model_dir.mkdir()
        shutil.copy(FIXTURES / name, model_dir / "config.json")
        from_dir = layout_from_hf_config(model_dir)
        for other in (from_path, from_str, from_dir):
            assert other.model_type == from_dict.model_type
            assert other.specs() == from_dict.specs()
            assert dict(other.layers) == dict(from_dict.layers)


# --------------------------------------------------------------------------- synthetic configs


def test_qwen2_window_applies_from_max_window_layers_when_enabled() -> None:
    config = {
        "model_type": "qwen2",
        "hidden_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "use_sliding_window": True,
        "sliding_window": 256,
        "max_window_layers": 4,
    }
    layout = layout_from_hf_config(config)
    assert [i.sliding_window for i in layout.layers.values()] == [
        256 if i >= 4 else None for i in range(6)
    ]


def test_qwen2_layer_types_without_the_window_switch_attend_to_everything() -> None:
    config = _read("qwen2.5-7b.json")
    types = ["sliding_attention"] * 28
    layout = layout_from_hf_config({**config, "layer_types": types})
    assert _spec_classes(layout) == [FullAttentionSpec] * 28
    enabled = layout_from_hf_config({**config, "layer_types": types, "use_sliding_window": True})
    assert {i.sliding_window for i in enabled.layers.values()} == {131072}


def test_qwen3_head_dim_default_and_window_rule() -> None:
    config = {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "num_hidden_layers": 6,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "use_sliding_window": True,
        "sliding_window": 512,
        "max_window_layers": 2,
    }
    layout = layout_from_hf_config(config)
    assert _spec_classes(layout) == [FullAttentionSpec] * 2 + [SlidingWindowSpec] * 4
    # Qwen3Config: head_dim defaults to 128 (not 1024 // 16 = 64).
    assert {_attn_shape(i) for i in layout.layers.values()} == {(8, 128, F32)}
    # 6 * 2 * 8 * 128 * 4 bytes = 49152
    assert layout.kv_bytes_per_token() == 49152


GEMMA3_TEXT: dict[str, Any] = {
    "model_type": "gemma3_text",
    "hidden_size": 640,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256,
    "torch_dtype": "bfloat16",
}


def test_gemma3_text_pattern_of_six() -> None:
    layout = layout_from_hf_config(GEMMA3_TEXT)
    full = [(i + 1) % 6 == 0 for i in range(12)]  # layers 5 and 11
    assert [i.sliding_window for i in layout.layers.values()] == [None if f else 512 for f in full]
    assert {i.logits_soft_cap for i in layout.layers.values()} == {None}
    assert {i.scale for i in layout.layers.values()} == {0.0625}
    # 12 * 2 * 1 * 256 * 2 = 12288
    assert layout.kv_bytes_per_token() == 12288


def test_gemma3_text_layer_types_override_the_pattern() -> None:
    types = ["full_attention"] * 2 + ["sliding_attention"] * 10
    layout = layout_from_hf_config({**GEMMA3_TEXT, "layer_types": types})
    assert [i.sliding_window for i in layout.layers.values()] == [None, None] + [512] * 10


def test_gemma3_multimodal_reads_text_config() -> None:
    text = {**GEMMA3_TEXT, "head_dim": 128, "query_pre_attn_scalar": 168}
    del text["torch_dtype"]
    layout = layout_from_hf_config(
        {"model_type": "gemma3", "text_config": text, "torch_dtype": "bfloat16"}
    )
    assert list(layout.layers) == [f"model.language_model.layers.{i}.self_attn" for i in range(12)]
    assert layout.dtype == BF16
    # 168 ** -0.5 = 0.0771516750
    assert [i.scale for i in layout.layers.values()] == [pytest.approx(0.0771516750)] * 12
    # 12 * 2 * 1 * 128 * 2 = 6144
    assert layout.kv_bytes_per_token() == 6144


LLAMA4: dict[str, Any] = {
    "model_type": "llama4",
    "text_config": {
        "model_type": "llama4_text",
        "hidden_size": 5120,
        "num_hidden_layers": 8,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "attention_chunk_size": 8192,
        "no_rope_layer_interval": 4,
    },
    "torch_dtype": "bfloat16",
}


def test_llama4_chunked_rope_layers_and_nope_full_every_4th() -> None:
    layout = layout_from_hf_config(LLAMA4)
    nope = [(i + 1) % 4 == 0 for i in range(8)]  # layers 3 and 7
    assert list(layout.layers) == [f"language_model.model.layers.{i}.self_attn" for i in range(8)]
    assert _spec_classes(layout) == [
        FullAttentionSpec if n else ChunkedLocalAttentionSpec for n in nope
    ]
    assert [i.attention_chunk_size for i in layout.layers.values()] == [
        None if n else 8192 for n in nope
    ]
    assert [i.use_rope for i in layout.layers.values()] == [not n for n in nope]
    # 8 * 2 * 8 * 128 * 2 = 32768
    assert layout.kv_bytes_per_token() == 32768


def test_llama4_explicit_no_rope_layers() -> None:
    flags = [1, 0, 1, 1, 1, 1, 0, 1]  # 1 = uses RoPE
    config = {**LLAMA4, "text_config": {**LLAMA4["text_config"], "no_rope_layers": flags}}
    layout = layout_from_hf_config(config)
    assert [i.use_rope for i in layout.layers.values()] == [f == 1 for f in flags]
    assert [i.attention_chunk_size for i in layout.layers.values()] == [
        8192 if f else None for f in flags
    ]


DEEPSEEK_V2: dict[str, Any] = {
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707},
    "torch_dtype": "bfloat16",
}


def test_deepseek_v2_mla_scale() -> None:
    layout = layout_from_hf_config(DEEPSEEK_V2)
    assert _spec_classes(layout) == [MLAAttentionSpec] * 4
    info = layout.layers["model.layers.0.self_attn"]
    assert info.mla is not None
    assert info.mla.q_lora_rank is None
    # mscale = 0.1 * 0.707 * ln(40) + 1 = 1.2608037775; squared 1.5896262...;
    # 192 ** -0.5 = 0.0721687836; product 0.1147215...
    assert info.scale == pytest.approx(192**-0.5 * (0.0707 * math.log(40) + 1) ** 2, rel=1e-12)
    assert info.scale == pytest.approx(0.11472, rel=1e-4)
    # 4 layers * 576 * 2 bytes = 4608
    assert layout.kv_bytes_per_token() == 4608
    plain = layout_from_hf_config({**DEEPSEEK_V2, "rope_scaling": None})
    assert plain.layers["model.layers.0.self_attn"].scale == pytest.approx(192**-0.5)


NEMOTRON_H: dict[str, Any] = {
    "model_type": "nemotron_h",
    "hidden_size": 1024,
    "hybrid_override_pattern": "M-M*-ME",
    "num_hidden_layers": 7,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_num_heads": 32,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "chunk_size": 128,
    "torch_dtype": "bfloat16",
}


def test_nemotron_h_pattern_skips_mlp_and_moe_blocks() -> None:
    layout = layout_from_hf_config(NEMOTRON_H)
    pattern = NEMOTRON_H["hybrid_override_pattern"]
    cached = [(i, c) for i, c in enumerate(pattern) if c in "M*"]
    assert list(layout.layers) == [f"backbone.layers.{i}.mixer" for i, _ in cached]
    assert _spec_classes(layout) == [
        MambaSpec if c == "M" else FullAttentionSpec for _, c in cached
    ]
    mamba = layout.layers["backbone.layers.0.mixer"]
    assert isinstance(mamba.spec, MambaSpec)
    # conv: 32 heads * 64 + 2 * 8 groups * 128 = 4096 channels; ssm (32, 64, 128)
    assert mamba.spec.shapes == ((4096, 3), (32, 64, 128))
    params = mamba.state_params(conv_weight=torch.zeros(4096, 4), A=-torch.ones(32))
    assert params.state_shapes == mamba.spec.shapes
    # 1 attention layer * 2 * 2 * 128 * 2 = 1024
    assert layout.kv_bytes_per_token() == 1024


def test_nemotron_h_layers_block_type_list() -> None:
    config = {k: v for k, v in NEMOTRON_H.items() if k != "hybrid_override_pattern"}
    config["layers_block_type"] = ["mamba", "mlp", "attention", "moe"]
    layout = layout_from_hf_config(config)
    assert list(layout.layers) == ["backbone.layers.0.mixer", "backbone.layers.2.mixer"]
    assert _spec_classes(layout) == [MambaSpec, FullAttentionSpec]


MINIMAX: dict[str, Any] = {
    "model_type": "minimax",
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
}


def test_minimax_layer_types_and_default() -> None:
    layout = layout_from_hf_config(MINIMAX)
    assert list(layout.layers) == [f"model.layers.{i}.self_attn" for i in range(4)]
    assert _spec_classes(layout) == [MambaSpec] * 3 + [FullAttentionSpec]
    linear = layout.layers["model.layers.0.self_attn"]
    assert isinstance(linear.spec, MambaSpec)
    assert linear.spec.mamba_type == "linear"
    assert linear.spec.shapes == ((8, 64, 64),)
    params = linear.state_params(decay=torch.ones(8))
    assert isinstance(params, LinearAttentionLayerParams)
    assert params.state_shapes == linear.spec.shapes
    # MiniMaxConfig default: full attention when (i + 1) % 2, i.e. even layers.
    default = layout_from_hf_config({k: v for k, v in MINIMAX.items() if k != "layer_types"})
    assert _spec_classes(default) == [
        FullAttentionSpec if (i + 1) % 2 else MambaSpec for i in range(4)
    ]


def test_minimax_text_01_attn_type_list() -> None:
    flags = [0, 0, 0, 0, 0, 0, 0, 1]
    config = {
        "model_type": "minimax_text_01",
        "hidden_size": 6144,
        "num_hidden_layers": 8,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "attn_type_list": flags,
        "torch_dtype": "bfloat16",
    }
    layout = layout_from_hf_config(config)
    assert _spec_classes(layout) == [FullAttentionSpec if f else MambaSpec for f in flags]
    linear = layout.layers["model.layers.0.self_attn"]
    assert isinstance(linear.spec, MambaSpec)
    assert linear.spec.shapes == ((64, 128, 128),)
    assert linear.state == LinearAttentionDims(
        num_heads=64, head_dim=128, layer_index=0, num_layers=8
    )
    # 1 layer * 2 * 8 * 128 * 2 = 4096
    assert layout.kv_bytes_per_token() == 4096


FALCON_H1: dict[str, Any] = {
    "model_type": "falcon_h1",
    "hidden_size": 1024,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "mamba_d_ssm": 1536,
    "mamba_n_heads": 24,
    "mamba_d_head": "auto",
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 128,
    "torch_dtype": "bfloat16",
}


def test_falcon_h1_attention_and_mamba_in_every_layer() -> None:
    layout = layout_from_hf_config(FALCON_H1)
    names: list[str] = []
    for i in range(3):
        names += [f"model.layers.{i}.mamba", f"model.layers.{i}.self_attn"]
    assert list(layout.layers) == names
    assert _spec_classes(layout) == [MambaSpec, FullAttentionSpec] * 3
    mamba = layout.layers["model.layers.0.mamba"]
    assert isinstance(mamba.spec, MambaSpec)
    # head dim "auto": 1536 // 24 = 64; conv 1536 + 2 * 1 * 128 = 1792; ssm (24, 64, 128)
    assert mamba.spec.shapes == ((1792, 3), (24, 64, 128))
    assert mamba.state == Mamba2Dims(
        num_heads=24, head_dim=64, n_groups=1, d_state=128, d_conv=4, chunk_size=128
    )
    # 3 * 2 * 2 * 64 * 2 = 1536
    assert layout.kv_bytes_per_token() == 1536
    # mamba_d_ssm null: mamba_expand 2 * hidden 1024 = 2048 inner -> head dim 2048 // 24
    # is not whole (85.3), so the sizes do not fit.
    with pytest.raises(InvalidArgumentError, match="mamba intermediate size 2048"):
        layout_from_hf_config({**FALCON_H1, "mamba_d_ssm": None})


def test_bart_encoder_decoder_names_and_kinds() -> None:
    config = {
        "model_type": "bart",
        "d_model": 768,
        "encoder_layers": 6,
        "decoder_layers": 6,
        "encoder_attention_heads": 12,
        "decoder_attention_heads": 12,
    }
    layout = layout_from_hf_config(config)
    expected = [f"model.encoder.layers.{i}.self_attn" for i in range(6)]
    for i in range(6):
        expected += [
            f"model.decoder.layers.{i}.self_attn",
            f"model.decoder.layers.{i}.encoder_attn",
        ]
    assert list(layout.layers) == expected
    assert (
        _spec_classes(layout)
        == [EncoderOnlyAttentionSpec] * 6
        + [
            FullAttentionSpec,
            CrossAttentionSpec,
        ]
        * 6
    )
    # 768 // 12 = 64; decoder self-attention: 6 * 2 * 12 * 64 * 4 bytes = 36864
    assert {_attn_shape(i) for i in layout.layers.values()} == {(12, 64, F32)}
    assert layout.kv_bytes_per_token() == 36864


def test_qwen3_next_equal_heads_builds_gdn_params() -> None:
    config = {
        "model_type": "qwen3_next",
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
    }
    layout = layout_from_hf_config(config)
    gdn = layout.layers["model.layers.0.linear_attn"]
    # conv: 4 * (2 * 32 + 16) = 320 channels; state (4, 32, 16)
    assert isinstance(gdn.spec, MambaSpec)
    assert gdn.spec.shapes == ((320, 3), (4, 32, 16))
    assert gdn.state == GatedDeltaNetDims(
        num_key_heads=4, num_value_heads=4, key_head_dim=32, value_head_dim=16, conv_kernel=4
    )
    params = gdn.state_params(conv_weight=torch.zeros(320, 4))
    assert isinstance(params, GatedDeltaNetLayerParams)
    assert params.state_shapes == gdn.spec.shapes
    with pytest.raises(InvalidArgumentError, match="conv_weight"):
        gdn.state_params(conv_weight=torch.zeros(320, 5))


def test_lfm2_layer_types_list() -> None:
    config = {**_read("lfm2-1.2b.json"), "layer_types": ["conv"] * 15 + ["full_attention"]}
    del config["full_attn_idxs"]
    layout = layout_from_hf_config(config)
    assert _spec_classes(layout) == [MambaSpec] * 15 + [FullAttentionSpec]
    assert layout.layers["model.layers.3.conv"].state == ShortConvDims(channels=2048, conv_kernel=3)


# --------------------------------------------------------------------------- options and records


def test_dtype_and_cache_dtype_options() -> None:
    config = _read("llama-3.1-8b.json")
    layout = layout_from_hf_config(
        config, dtype=torch.float16, kv_cache_dtype="fp8_e4m3", block_size=32
    )
    spec = layout.layers["model.layers.0.self_attn"].spec
    assert isinstance(spec, FullAttentionSpec)
    assert (spec.dtype, spec.kv_cache_dtype, spec.block_size) == (torch.float16, "fp8_e4m3", 32)
    # fp8: 32 * 2 * 8 * 128 * 1 byte = 65536
    assert layout.kv_bytes_per_token() == 65536
    no_dtype = {k: v for k, v in config.items() if k != "torch_dtype"}
    assert layout_from_hf_config(no_dtype).dtype == F32
    assert layout_from_hf_config({**no_dtype, "dtype": "float16"}).dtype == torch.float16


def test_layout_is_read_only_and_ordered() -> None:
    layout = layout_from_hf_config(FIXTURES / "jamba-v0.1.json")
    writable: Any = layout.layers  # an engine that tries to edit it anyway
    with pytest.raises(TypeError):
        writable["x"] = layout.layers["model.layers.0.mamba"]
    assert isinstance(layout.layers, Mapping)
    assert list(layout.specs()) == list(layout.layers)
    assert all(isinstance(p, AttentionLayerParams) for p in layout.attention_params().values())
    assert len(layout.attention_params()) == 4


def test_wrong_params_call_for_the_layer_kind() -> None:
    layout = layout_from_hf_config(FIXTURES / "lfm2-1.2b.json")
    with pytest.raises(InvalidArgumentError, match="not an attention layer"):
        layout.layers["model.layers.0.conv"].attention_params()
    with pytest.raises(InvalidArgumentError, match="not a state layer"):
        layout.layers["model.layers.2.self_attn"].state_params()
    with pytest.raises(InvalidArgumentError, match=r"short_conv layer takes .* got \['A'\] too"):
        layout.layers["model.layers.0.conv"].state_params(
            conv_weight=torch.zeros(2048, 3), A=torch.zeros(1)
        )
    with pytest.raises(InvalidArgumentError, match="needs conv_weight"):
        layout.layers["model.layers.0.conv"].state_params()


def test_models_imports_only_spec_kinds_params_state_types_errors_and_validation() -> None:
    # What the package's modules import from outside it (``from ..spec import ...``).
    package = Path(attnkit.models.__file__).parent
    imported = {
        node.module
        for path in package.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level == 2
    }
    assert imported == {"_validation", "errors", "kinds", "params", "spec", "state_types"}


# --------------------------------------------------------------------------- errors


def test_unknown_model_type_lists_the_supported_ones() -> None:
    with pytest.raises(InvalidArgumentError, match="unsupported model_type 'gpt2'") as info:
        layout_from_hf_config({"model_type": "gpt2"})
    for name in ("llama", "jamba", "nemotron_h", "t5"):
        assert name in str(info.value)
    assert len(SUPPORTED_MODEL_TYPES) == 28
    with pytest.raises(InvalidArgumentError, match="needs a string 'model_type'"):
        layout_from_hf_config({"hidden_size": 8})


@pytest.mark.parametrize(
    ("config", "drop", "family"),
    [
        (_read("llama-3.1-8b.json"), "num_hidden_layers", "llama"),
        (_read("llama-3.1-8b.json"), "num_attention_heads", "llama"),
        (_read("deepseek-v3.json"), "kv_lora_rank", "deepseek_v3"),
        (_read("jamba-v0.1.json"), "attn_layer_period", "jamba"),
        (_read("jamba-v0.1.json"), "mamba_d_state", "jamba"),
        (_read("bamba-9b.json"), "mamba_n_heads", "bamba"),
        (_read("qwen3-next-80b-a3b-instruct.json"), "linear_num_value_heads", "qwen3_next"),
        (_read("lfm2-1.2b.json"), "conv_L_cache", "lfm2"),
        (_read("t5-small.json"), "d_kv", "t5"),
        (_read("bert-base-uncased.json"), "hidden_size", "bert"),
        (NEMOTRON_H, "hybrid_override_pattern", "nemotron_h"),
        (NEMOTRON_H, "ssm_state_size", "nemotron_h"),
        (FALCON_H1, "mamba_d_ssm", "falcon_h1"),
        (LLAMA4, "text_config", "llama4"),
        (
            {k: v for k, v in MINIMAX.items() if k != "layer_types"}
            | {"model_type": "minimax_text_01"},
            "attn_type_list",
            "minimax_text_01",
        ),
    ],
)
def test_a_missing_key_is_named_with_its_family(
    config: dict[str, Any], drop: str, family: str
) -> None:
    broken = {k: v for k, v in config.items() if k != drop}
    with pytest.raises(
        InvalidArgumentError, match=f"a {family} config needs key '{drop}', which is missing"
    ):
        layout_from_hf_config(broken)


def test_a_missing_nested_key_names_its_path() -> None:
    text = {k: v for k, v in LLAMA4["text_config"].items() if k != "num_attention_heads"}
    with pytest.raises(
        InvalidArgumentError, match=r"llama4 config needs key 'text_config\.num_attention_heads'"
    ):
        layout_from_hf_config({**LLAMA4, "text_config": text})


def test_bad_values_are_named() -> None:
    llama = _read("llama-3.1-8b.json")
    with pytest.raises(
        ArgumentTypeError,
        match=r"llama config key 'num_attention_heads' must be a positive int, got '32' \(str\)",
    ):
        layout_from_hf_config({**llama, "num_attention_heads": "32"})
    with pytest.raises(
        InvalidArgumentError, match=r"key 'attn_layer_indices' lists layers \[40\].*32 layers"
    ):
        layout_from_hf_config({**_read("bamba-9b.json"), "attn_layer_indices": [9, 40]})
    with pytest.raises(
        InvalidArgumentError, match=r"key 'layer_types' must have one entry per layer \(24\), got 2"
    ):
        layout_from_hf_config({**_read("gpt-oss-20b.json"), "layer_types": ["full_attention"] * 2})
    with pytest.raises(InvalidArgumentError, match=r"layer_types\[0\] must be one of"):
        layout_from_hf_config({**_read("gpt-oss-20b.json"), "layer_types": ["global"] * 24})
    with pytest.raises(
        InvalidArgumentError, match="'hybrid_override_pattern' must be a non-empty string"
    ):
        layout_from_hf_config({**NEMOTRON_H, "hybrid_override_pattern": "M*X"})
    with pytest.raises(InvalidArgumentError, match="'torch_dtype' must name one of"):
        layout_from_hf_config({**llama, "torch_dtype": "float8_e4m3fn"})
    # ... which dtype= overrides.
    assert (
        layout_from_hf_config({**llama, "torch_dtype": "float8_e4m3fn"}, dtype=BF16).dtype == BF16
    )


def test_bad_arguments() -> None:
    llama = _read("llama-3.1-8b.json")
    bad_value: Any = "int8"  # untyped callers can pass anything
    bad_type: Any = 3
    with pytest.raises(InvalidArgumentError, match="block_size must be a positive int, got 0"):
        layout_from_hf_config(llama, block_size=0)
    with pytest.raises(InvalidArgumentError, match="kv_cache_dtype must be one of"):
        layout_from_hf_config(llama, kv_cache_dtype=bad_value)
    with pytest.raises(InvalidArgumentError, match=r"dtype must be None or a torch\.dtype"):
        layout_from_hf_config(llama, dtype=torch.int8)
    with pytest.raises(ArgumentTypeError, match=r"config_or_path must be a mapping .* got int"):
        layout_from_hf_config(bad_type)


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        layout_from_hf_config(tmp_path / "missing.json")
    with pytest.raises(InvalidArgumentError, match=r"cannot read .*config\.json"):
        layout_from_hf_config(tmp_path)  # a directory without config.json
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidArgumentError, match="is not valid JSON"):
        layout_from_hf_config(bad)
    arr = tmp_path / "list.json"
    arr.write_text("[1, 2]")
    with pytest.raises(InvalidArgumentError, match="must hold a JSON object, got list"):
        layout_from_hf_config(arr)


def test_a_layout_runs_in_the_runtime() -> None:
    # A two-layer Gemma 2 (one sliding, one full, soft-capped) straight into the runtime
    # with the reference backend: the specs and parameters fit what it takes.
    config = {**_read("gemma-2-9b-it.json"), "num_hidden_layers": 2, "head_dim": 32}
    layout = layout_from_hf_config(config, dtype=F32)
    registry = attnkit.BackendRegistry(
        builtins={"reference": "attnkit.backends.reference:ReferenceBackend"}
    )
    runtime = attnkit.AttentionRuntime(
        layout.specs(),
        attnkit.AttentionConfig(backend="reference"),
        device="cpu",
        memory_budget_bytes=1 << 20,
        layer_params=layout.attention_params(),
        registry=registry,
    )
    step = runtime.begin_step([attnkit.ScheduledRequest("a", 5)])
    q = torch.randn(5, 16, 32)
    k, v = torch.randn(2, 5, 8, 32)
    for name in layout.layers:
        assert runtime.forward(name, q, k, v).shape == (5, 16, 32)
    assert step.num_tokens == 5


def test_lightning_decay_follows_minimax_rule() -> None:
    """Per-head rates 2**(-8/H)**(h+1), scaled by 1 - i/(L-1+1e-5) + 1e-5 (MiniMax-01)."""
    # H = 8: base 2**-1 = 0.5. Layer 0 of 4: depth factor 1 + 1e-5.
    first = lightning_attention_decay(8, 0, 4)
    assert first.dtype == torch.float32
    expected = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625])
    torch.testing.assert_close(first, expected * 1.00001, rtol=1e-6, atol=0)
    # Last layer: 1 - 3/3.00001 + 1e-5 = 1.333329e-5 (by hand: 3.33332e-6 + 1e-5).
    last = lightning_attention_decay(8, 3, 4)
    torch.testing.assert_close(last, expected * 1.3333289e-5, rtol=1e-5, atol=0)
    for bad in ((0, 0, 4), (8, 4, 4), (8, -1, 4), (8, 0, 0), (8, True, 4)):
        with pytest.raises(InvalidArgumentError, match="lightning_attention_decay"):
            lightning_attention_decay(*bad)


def test_minimax_linear_layers_derive_their_decay() -> None:
    """state_params() needs no decay for a MiniMax linear layer: each layer's rates come
    from its depth (the first layer forgets fastest), and a given decay still wins."""
    config = {
        "model_type": "minimax_text_01",
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "attn_type_list": [0, 0, 1, 0],
        "torch_dtype": "bfloat16",
    }
    layout = layout_from_hf_config(config)
    rates = []
    for i in (0, 1, 3):
        params = layout.layers[f"model.layers.{i}.self_attn"].state_params()
        assert isinstance(params, LinearAttentionLayerParams)
        depth = 1 - i / (3 + 1e-5) + 1e-5
        # H = 4: base 2**-2 = 0.25.
        expected = torch.tensor([0.25, 0.0625, 0.015625, 0.00390625]) * depth
        torch.testing.assert_close(params.decay, expected, rtol=1e-6, atol=0)
        rates.append(params.decay)
    assert bool((rates[0] > rates[1]).all())
    assert bool((rates[1] > rates[2]).all())
    given = torch.full((4,), 0.5)
    params = layout.layers["model.layers.0.self_attn"].state_params(decay=given)
    assert isinstance(params, LinearAttentionLayerParams)
    assert torch.equal(params.decay, given)
