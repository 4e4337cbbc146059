"""Tests for ``attnkit.spec``: the KV-cache spec classes, their sizes and kind derivation.

Every expected number here is written out from first principles (bytes of one page =
planes * block_size * heads * head_size * itemsize; blocks = a ceiling division done by
hand in the comments), never obtained from the code under test. The kind of each class
and the rules of ``get_attn_spec_kind`` are restated as literal tables.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.spec import (
    AttentionSpec,
    AttentionType,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    IndexerSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    get_attn_spec_kind,
    spec_class_for_kind,
)

F16 = torch.float16
BF16 = torch.bfloat16
F32 = torch.float32

# ---------------------------------------------------------------------------------------
# The literal tables the tests check against.
# ---------------------------------------------------------------------------------------

KIND_OF_CLASS: dict[type[KVCacheSpec], str] = {
    FullAttentionSpec: "full_attention",
    SinkFullAttentionSpec: "sink_full_attention",
    MLAAttentionSpec: "mla_attention",
    SlidingWindowSpec: "sliding_window",
    SlidingWindowMLASpec: "sliding_window_mla",
    ChunkedLocalAttentionSpec: "chunked_local_attention",
    EncoderOnlyAttentionSpec: "encoder_only_attention",
    CrossAttentionSpec: "cross_attention",
    MambaSpec: "mamba",
    IndexerSpec: "indexer",
}

# One valid set of keyword arguments per concrete class.
VALID_KWARGS: dict[type[KVCacheSpec], dict[str, Any]] = {
    FullAttentionSpec: {"block_size": 16, "num_kv_heads": 8, "head_size": 128, "dtype": BF16},
    SinkFullAttentionSpec: {
        "block_size": 16,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": F16,
        "sink_len": 4,
    },
    MLAAttentionSpec: {"block_size": 64, "head_size": 576, "dtype": BF16},
    SlidingWindowSpec: {
        "block_size": 16,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": F16,
        "sliding_window": 128,
    },
    SlidingWindowMLASpec: {
        "block_size": 64,
        "head_size": 576,
        "dtype": F16,
        "sliding_window": 512,
    },
    ChunkedLocalAttentionSpec: {
        "block_size": 32,
        "num_kv_heads": 8,
        "head_size": 128,
        "dtype": BF16,
        "attention_chunk_size": 8192,
    },
    EncoderOnlyAttentionSpec: {"block_size": 16, "num_kv_heads": 4, "head_size": 64, "dtype": F32},
    CrossAttentionSpec: {"block_size": 16, "num_kv_heads": 8, "head_size": 64, "dtype": F16},
    MambaSpec: {"block_size": 16, "shapes": ((256, 3), (8, 64, 16)), "dtypes": (BF16, F32)},
    IndexerSpec: {"block_size": 64, "head_size": 128, "dtype": BF16, "index_topk": 2048},
}

# page_size_bytes of each VALID_KWARGS spec, written out.
PAGE_OF_VALID: dict[type[KVCacheSpec], int] = {
    FullAttentionSpec: 2 * 16 * 8 * 128 * 2,  # 65536
    SinkFullAttentionSpec: 2 * 16 * 2 * 64 * 2,  # 8192
    MLAAttentionSpec: 1 * 64 * 1 * 576 * 2,  # one latent plane: 73728
    SlidingWindowSpec: 2 * 16 * 2 * 64 * 2,  # 8192
    SlidingWindowMLASpec: 1 * 64 * 1 * 576 * 2,  # 73728
    ChunkedLocalAttentionSpec: 2 * 32 * 8 * 128 * 2,  # 131072
    EncoderOnlyAttentionSpec: 2 * 16 * 4 * 64 * 4,  # 32768
    CrossAttentionSpec: 2 * 16 * 8 * 64 * 2,  # 32768
    MambaSpec: 256 * 3 * 2 + 8 * 64 * 16 * 4,  # 1536 + 32768 = 34304
    IndexerSpec: 64 * (128 + 4),  # 128 fp8 bytes and one fp32 scale per token: 8448
}

CONCRETE = list(VALID_KWARGS)


def _cls_params() -> list[Any]:
    return [pytest.param(cls, id=cls.__name__) for cls in CONCRETE]


def make(cls: type[KVCacheSpec], **overrides: Any) -> Any:
    return cls(**{**VALID_KWARGS[cls], **overrides})


def test_tables_cover_every_kind() -> None:
    assert set(KIND_OF_CLASS.values()) == {k.value for k in KVCacheSpecKind}
    assert len(KIND_OF_CLASS) == len(KVCacheSpecKind) == 10
    assert set(VALID_KWARGS) == set(KIND_OF_CLASS) == set(PAGE_OF_VALID)


# ---------------------------------------------------------------------------------------
# Construction, kind, dataclass properties
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", _cls_params())
def test_construction_keeps_fields_and_kind(cls: type[KVCacheSpec]) -> None:
    spec = make(cls)
    for name, value in VALID_KWARGS[cls].items():
        assert getattr(spec, name) == value
    assert isinstance(cls.kind, KVCacheSpecKind)
    assert cls.kind.value == KIND_OF_CLASS[cls]
    assert spec.kind is cls.kind
    assert str(spec.kind) == KIND_OF_CLASS[cls]
    # kind is a class variable, not a dataclass field.
    assert "kind" not in {f.name for f in dataclasses.fields(spec)}


@pytest.mark.parametrize("cls", _cls_params())
def test_attention_and_mamba_are_siblings(cls: type[KVCacheSpec]) -> None:
    assert issubclass(cls, KVCacheSpec)
    assert issubclass(cls, AttentionSpec) is (cls is not MambaSpec)


def test_defaults() -> None:
    full = make(FullAttentionSpec)
    assert full.kv_cache_dtype == "auto"
    assert full.cache_torch_dtype is BF16
    assert make(MLAAttentionSpec).num_kv_heads == 1
    assert make(SlidingWindowMLASpec).num_kv_heads == 1
    assert make(MambaSpec).mamba_type == "mamba2"


@pytest.mark.parametrize(
    ("kv_cache_dtype", "expected"),
    [
        pytest.param("auto", BF16, id="auto-is-model-dtype"),
        pytest.param("float32", torch.float32, id="float32"),
        pytest.param("float16", torch.float16, id="float16"),
        pytest.param("bfloat16", torch.bfloat16, id="bfloat16"),
        pytest.param("fp8_e4m3", torch.float8_e4m3fn, id="fp8_e4m3"),
        pytest.param("fp8_e5m2", torch.float8_e5m2, id="fp8_e5m2"),
    ],
)
def test_cache_torch_dtype(kv_cache_dtype: str, expected: torch.dtype) -> None:
    spec = make(FullAttentionSpec, kv_cache_dtype=kv_cache_dtype)
    assert spec.cache_torch_dtype is expected


@pytest.mark.parametrize("cls", _cls_params())
def test_frozen(cls: type[KVCacheSpec]) -> None:
    spec = make(cls)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_size = 32
    assert spec.block_size == VALID_KWARGS[cls]["block_size"]


@pytest.mark.parametrize("cls", _cls_params())
def test_keyword_only(cls: type[KVCacheSpec]) -> None:
    values = list(VALID_KWARGS[cls].values())
    constructor: Any = cls
    with pytest.raises(TypeError, match="positional argument"):
        constructor(*values)


@pytest.mark.parametrize(
    ("cls", "missing"),
    [
        pytest.param(SlidingWindowSpec, "sliding_window", id="window"),
        pytest.param(ChunkedLocalAttentionSpec, "attention_chunk_size", id="chunk"),
        pytest.param(SinkFullAttentionSpec, "sink_len", id="sink"),
        pytest.param(FullAttentionSpec, "dtype", id="dtype"),
        pytest.param(MambaSpec, "dtypes", id="mamba-dtypes"),
    ],
)
def test_missing_required_field(cls: type[KVCacheSpec], missing: str) -> None:
    kwargs = {k: v for k, v in VALID_KWARGS[cls].items() if k != missing}
    with pytest.raises(TypeError, match=missing):
        cls(**kwargs)


@pytest.mark.parametrize("cls", _cls_params())
def test_hashable_and_equal(cls: type[KVCacheSpec]) -> None:
    a, b = make(cls), make(cls)
    assert a is not b
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    different = make(cls, block_size=2 * VALID_KWARGS[cls]["block_size"])
    assert different != a
    assert len({a, different}) == 2


def test_same_fields_different_class_are_not_equal() -> None:
    fields: dict[str, Any] = {"block_size": 16, "num_kv_heads": 1, "head_size": 64, "dtype": F16}
    full: KVCacheSpec = FullAttentionSpec(**fields)
    assert full != MLAAttentionSpec(**fields)
    assert full != CrossAttentionSpec(**fields)


ABSTRACT_MESSAGE = (
    "is abstract; construct one of its concrete subclasses (ChunkedLocalAttentionSpec, "
    "CrossAttentionSpec, EncoderOnlyAttentionSpec, FullAttentionSpec, IndexerSpec, "
    "MLAAttentionSpec, MambaSpec, SinkFullAttentionSpec, SlidingWindowMLASpec, SlidingWindowSpec)"
)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        pytest.param(KVCacheSpec, {"block_size": 16}, id="KVCacheSpec"),
        pytest.param(
            AttentionSpec,
            {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": F16},
            id="AttentionSpec",
        ),
    ],
)
def test_abstract_specs_cannot_be_constructed(
    cls: type[KVCacheSpec], kwargs: dict[str, Any]
) -> None:
    with pytest.raises(TypeError, match=re.escape(cls.__name__ + " " + ABSTRACT_MESSAGE)):
        cls(**kwargs)


# ---------------------------------------------------------------------------------------
# page_size_bytes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", _cls_params())
def test_page_size_of_each_class(cls: type[KVCacheSpec]) -> None:
    assert make(cls).page_size_bytes == PAGE_OF_VALID[cls]


@pytest.mark.parametrize(
    ("cls", "overrides", "expected"),
    [
        # FullAttentionSpec base: block 16, 8 heads, head 128, model dtype bf16.
        pytest.param(FullAttentionSpec, {}, 2 * 16 * 8 * 128 * 2, id="full-auto-bf16"),
        pytest.param(
            FullAttentionSpec, {"kv_cache_dtype": "fp8_e4m3"}, 2 * 16 * 8 * 128 * 1, id="full-fp8"
        ),
        pytest.param(
            FullAttentionSpec, {"kv_cache_dtype": "fp8_e5m2"}, 2 * 16 * 8 * 128 * 1, id="full-e5m2"
        ),
        pytest.param(
            FullAttentionSpec,
            {"kv_cache_dtype": "float32"},
            2 * 16 * 8 * 128 * 4,
            id="full-bf16-model-float32-cache",
        ),
        pytest.param(
            FullAttentionSpec, {"dtype": F32}, 2 * 16 * 8 * 128 * 4, id="full-auto-float32"
        ),
        pytest.param(
            FullAttentionSpec,
            {"dtype": F32, "kv_cache_dtype": "float16"},
            2 * 16 * 8 * 128 * 2,
            id="full-float32-model-fp16-cache",
        ),
        pytest.param(
            FullAttentionSpec,
            {"block_size": 1, "num_kv_heads": 1, "head_size": 1, "dtype": F16},
            2 * 1 * 1 * 1 * 2,
            id="full-smallest",
        ),
        pytest.param(
            MLAAttentionSpec, {"kv_cache_dtype": "fp8_e4m3"}, 1 * 64 * 1 * 576 * 1, id="mla-fp8"
        ),
        pytest.param(MLAAttentionSpec, {"dtype": F32}, 1 * 64 * 1 * 576 * 4, id="mla-float32"),
        pytest.param(
            SlidingWindowMLASpec,
            {"kv_cache_dtype": "fp8_e5m2"},
            1 * 64 * 1 * 576 * 1,
            id="sliding-mla-fp8",
        ),
        pytest.param(
            SlidingWindowSpec,
            {"kv_cache_dtype": "fp8_e4m3", "block_size": 32},
            2 * 32 * 2 * 64 * 1,
            id="sliding-fp8",
        ),
        pytest.param(
            SinkFullAttentionSpec,
            {"sink_len": 1000},
            2 * 16 * 2 * 64 * 2,
            id="sink-len-does-not-change-page",
        ),
        pytest.param(
            ChunkedLocalAttentionSpec,
            {"kv_cache_dtype": "bfloat16", "dtype": F32},
            2 * 32 * 8 * 128 * 2,
            id="chunked-bf16-cache",
        ),
        pytest.param(
            CrossAttentionSpec, {"kv_cache_dtype": "fp8_e4m3"}, 2 * 16 * 8 * 64, id="cross-fp8"
        ),
        pytest.param(
            EncoderOnlyAttentionSpec, {"dtype": BF16}, 2 * 16 * 4 * 64 * 2, id="encoder-only-bf16"
        ),
        pytest.param(MambaSpec, {"shapes": ((4, 4),), "dtypes": (F16,)}, 4 * 4 * 2, id="mamba-1"),
        pytest.param(
            MambaSpec,
            {"shapes": ((3,), (2, 5), (1, 2, 3)), "dtypes": (F32, F16, BF16)},
            3 * 4 + 2 * 5 * 2 + 1 * 2 * 3 * 2,
            id="mamba-3-states",
        ),
        pytest.param(
            MambaSpec,
            {"block_size": 4096},
            256 * 3 * 2 + 8 * 64 * 16 * 4,
            id="mamba-block-size-does-not-change-page",
        ),
    ],
)
def test_page_size_bytes(cls: type[KVCacheSpec], overrides: dict[str, Any], expected: int) -> None:
    assert make(cls, **overrides).page_size_bytes == expected


# ---------------------------------------------------------------------------------------
# max_memory_usage_bytes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "max_model_len", "max_batched", "expected_blocks"),
    [
        # Full attention: ceil(max_model_len / 16), whatever the batch.
        pytest.param(FullAttentionSpec, 100, 8, 7, id="full-100"),  # 100/16 = 6.25
        pytest.param(FullAttentionSpec, 32, 4096, 2, id="full-32-exact"),
        pytest.param(FullAttentionSpec, 1, 1, 1, id="full-1"),
        pytest.param(CrossAttentionSpec, 33, 1, 3, id="cross-33"),  # 33/16 = 2.06
        pytest.param(MLAAttentionSpec, 4096, 512, 64, id="mla-4096"),  # 4096/64
        pytest.param(MLAAttentionSpec, 65, 512, 2, id="mla-65"),
        # Sinks add sink_len=4 token slots in front: ceil((L + 4) / 16).
        pytest.param(SinkFullAttentionSpec, 100, 8, 7, id="sink-104"),  # 104/16 = 6.5
        pytest.param(SinkFullAttentionSpec, 96, 8, 7, id="sink-100"),  # full would be 6
        pytest.param(SinkFullAttentionSpec, 92, 8, 6, id="sink-96-exact"),
        pytest.param(SinkFullAttentionSpec, 1, 1, 1, id="sink-5"),
        # No cache at all.
        pytest.param(EncoderOnlyAttentionSpec, 4096, 512, 0, id="encoder-only"),
        pytest.param(EncoderOnlyAttentionSpec, 1, 1, 0, id="encoder-only-1"),
        # One state block per request, whatever the length.
        pytest.param(MambaSpec, 1, 1, 1, id="mamba-1"),
        pytest.param(MambaSpec, 1_000_000, 8192, 1, id="mamba-long"),
    ],
)
def test_max_memory_usage_non_windowed(
    cls: type[KVCacheSpec], max_model_len: int, max_batched: int, expected_blocks: int
) -> None:
    spec = make(cls)
    expected = expected_blocks * PAGE_OF_VALID[cls]
    assert spec.max_memory_usage_bytes(max_model_len, max_batched) == expected


# The documented rule for a sliding window w (block size bs, step of n tokens, length L):
# live = min(w - 1 + n, L) tokens; blocks = min(ceil(live / bs) + 1, ceil(L / bs)).
@pytest.mark.parametrize(
    ("window", "max_model_len", "max_batched", "block_size", "expected_blocks"),
    [
        # live = 32-1+16 = 47 -> ceil(47/16) = 3, +1 = 4; full would be 64.
        pytest.param(32, 1024, 16, 16, 4, id="w32-n16"),
        # live = 128-1+1 = 128 -> 8, +1 = 9.
        pytest.param(128, 4096, 1, 16, 9, id="w128-n1"),
        # live = 17 -> 2, +1 = 3.
        pytest.param(17, 4096, 1, 16, 3, id="w17-n1"),
        # live = 4096-1+2048 = 6143 -> ceil(6143/16) = 384, +1 = 385; full = 8192.
        pytest.param(4096, 131072, 2048, 16, 385, id="w4096-n2048"),
        # Window larger than the model length: live = min(4607, 1000) = 1000 -> 63 (+1 = 64),
        # capped at full attention's ceil(1000/16) = 63.
        pytest.param(4096, 1000, 512, 16, 63, id="window-longer-than-model"),
        # Huge step: live = min(2099, 1000) = 1000 -> capped at 63.
        pytest.param(100, 1000, 2000, 16, 63, id="step-longer-than-model"),
        # w=1, n=1: live = 1 -> 1 (+1 = 2), capped at ceil(10/16) = 1.
        pytest.param(1, 10, 1, 16, 1, id="tiny-model"),
        # live = 8-1+1 = 8 -> ceil(8/4) = 2, +1 = 3; full = 25.
        pytest.param(8, 100, 1, 4, 3, id="bs4-aligned-window"),
    ],
)
def test_max_memory_usage_sliding_window(
    window: int, max_model_len: int, max_batched: int, block_size: int, expected_blocks: int
) -> None:
    spec = SlidingWindowSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=F16, sliding_window=window
    )
    page = 2 * block_size * 2 * 64 * 2
    assert spec.max_memory_usage_bytes(max_model_len, max_batched) == expected_blocks * page
    mla = SlidingWindowMLASpec(
        block_size=block_size, head_size=576, dtype=F16, sliding_window=window
    )
    mla_page = 1 * block_size * 1 * 576 * 2
    assert mla.max_memory_usage_bytes(max_model_len, max_batched) == expected_blocks * mla_page


# The documented rule for chunked-local attention with chunk c:
# live = min(c + n, L) tokens; blocks = min(ceil(live / bs) + 1, ceil(L / bs)).
@pytest.mark.parametrize(
    ("chunk", "max_model_len", "max_batched", "block_size", "expected_blocks"),
    [
        # live = 8192+2048 = 10240 -> 640, +1 = 641; full = 8192.
        pytest.param(8192, 131072, 2048, 16, 641, id="c8192-n2048"),
        # live = 65 -> 5, +1 = 6.
        pytest.param(64, 4096, 1, 16, 6, id="c64-n1"),
        # live = min(128, 100) = 100 -> 7 (+1 = 8), capped at ceil(100/16) = 7.
        pytest.param(64, 100, 64, 16, 7, id="capped-by-model-len"),
        # Chunk larger than the model length: live = 1000 -> capped at 63.
        pytest.param(8192, 1000, 1, 16, 63, id="chunk-longer-than-model"),
        # live = 1+1 = 2 -> ceil(2/32) = 1, +1 = 2; full = ceil(1000/32) = 32.
        pytest.param(1, 1000, 1, 32, 2, id="chunk-1"),
    ],
)
def test_max_memory_usage_chunked_local(
    chunk: int, max_model_len: int, max_batched: int, block_size: int, expected_blocks: int
) -> None:
    spec = ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=8,
        head_size=128,
        dtype=BF16,
        attention_chunk_size=chunk,
    )
    page = 2 * block_size * 8 * 128 * 2
    assert spec.max_memory_usage_bytes(max_model_len, max_batched) == expected_blocks * page


@settings(max_examples=200, deadline=None, database=None)
@given(
    local=st.integers(1, 5000),
    use_chunk=st.booleans(),
    max_model_len=st.integers(1, 20000),
    max_batched=st.integers(1, 5000),
    block_size=st.sampled_from([1, 2, 16, 64, 256]),
)
def test_windowed_bound_never_exceeds_full_and_holds_the_window(
    local: int, use_chunk: bool, max_model_len: int, max_batched: int, block_size: int
) -> None:
    common: dict[str, Any] = {
        "block_size": block_size,
        "num_kv_heads": 1,
        "head_size": 8,
        "dtype": F32,
    }
    spec: AttentionSpec
    if use_chunk:
        spec = ChunkedLocalAttentionSpec(**common, attention_chunk_size=local)
    else:
        spec = SlidingWindowSpec(**common, sliding_window=local)
    page = 2 * block_size * 1 * 8 * 4
    full_blocks = -(-max_model_len // block_size)
    got = spec.max_memory_usage_bytes(max_model_len, max_batched)
    assert got % page == 0
    blocks = got // page
    assert blocks <= full_blocks
    # At least the live window itself (capped at the model length) must fit.
    assert blocks >= -(-min(local, max_model_len) // block_size)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param((0, 1), "max_model_len must be a positive int, got 0", id="len-0"),
        pytest.param((-5, 1), "max_model_len must be a positive int, got -5", id="len-negative"),
        pytest.param((True, 1), "max_model_len must be a positive int, got True", id="len-bool"),
        pytest.param((1.5, 1), "max_model_len must be a positive int, got 1.5", id="len-float"),
        pytest.param(
            (16, 0), "max_num_batched_tokens must be a positive int, got 0", id="batched-0"
        ),
        pytest.param(
            (16, "8"), "max_num_batched_tokens must be a positive int, got '8'", id="batched-str"
        ),
    ],
)
@pytest.mark.parametrize("cls", _cls_params())
def test_max_memory_usage_invalid_arguments(
    cls: type[KVCacheSpec], args: tuple[Any, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape("max_memory_usage_bytes." + message)):
        make(cls).max_memory_usage_bytes(*args)


# ---------------------------------------------------------------------------------------
# merge
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", _cls_params())
def test_merge_equal_specs_returns_first(cls: type[KVCacheSpec]) -> None:
    first, second, third = make(cls), make(cls), make(cls)
    assert cls.merge([first, second, third]) is first
    assert cls.merge([second]) is second
    assert KVCacheSpec.merge((third, first)) is third


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        pytest.param(
            [make(FullAttentionSpec), make(FullAttentionSpec, block_size=32)],
            "field 'block_size' differs between spec 0 (16) and spec 1 (32)",
            id="block_size",
        ),
        pytest.param(
            [
                make(FullAttentionSpec),
                make(FullAttentionSpec),
                make(FullAttentionSpec, num_kv_heads=4),
            ],
            "field 'num_kv_heads' differs between spec 0 (8) and spec 2 (4)",
            id="num_kv_heads-third",
        ),
        pytest.param(
            [make(CrossAttentionSpec), make(CrossAttentionSpec, dtype=BF16)],
            "field 'dtype' differs between spec 0 (torch.float16) and spec 1 (torch.bfloat16)",
            id="dtype",
        ),
        pytest.param(
            [make(FullAttentionSpec), make(FullAttentionSpec, kv_cache_dtype="fp8_e4m3")],
            "field 'kv_cache_dtype' differs between spec 0 ('auto') and spec 1 ('fp8_e4m3')",
            id="kv_cache_dtype",
        ),
        pytest.param(
            [make(SlidingWindowSpec), make(SlidingWindowSpec, sliding_window=256)],
            "field 'sliding_window' differs between spec 0 (128) and spec 1 (256)",
            id="sliding_window",
        ),
        pytest.param(
            [make(SinkFullAttentionSpec), make(SinkFullAttentionSpec, sink_len=8)],
            "field 'sink_len' differs between spec 0 (4) and spec 1 (8)",
            id="sink_len",
        ),
        pytest.param(
            [make(MambaSpec), make(MambaSpec, mamba_type="gdn")],
            "field 'mamba_type' differs between spec 0 ('mamba2') and spec 1 ('gdn')",
            id="mamba_type",
        ),
        pytest.param(
            [
                make(MambaSpec, shapes=((4,),), dtypes=(F16,)),
                make(MambaSpec, shapes=((5,),), dtypes=(F16,)),
            ],
            "field 'shapes' differs between spec 0 (((4,),)) and spec 1 (((5,),))",
            id="mamba-shapes",
        ),
    ],
)
def test_merge_differing_field(specs: list[KVCacheSpec], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape("cannot merge specs: " + message)):
        type(specs[0]).merge(specs)


@pytest.mark.parametrize(
    ("first", "second", "message"),
    [
        pytest.param(
            make(FullAttentionSpec),
            make(SlidingWindowSpec),
            "spec 0 is FullAttentionSpec (kind=full_attention) but spec 1 is "
            "SlidingWindowSpec (kind=sliding_window)",
            id="full-vs-sliding",
        ),
        pytest.param(
            make(FullAttentionSpec, num_kv_heads=1, head_size=576, block_size=64),
            make(MLAAttentionSpec),
            "spec 0 is FullAttentionSpec (kind=full_attention) but spec 1 is "
            "MLAAttentionSpec (kind=mla_attention)",
            id="full-vs-mla-subclass",
        ),
        pytest.param(
            make(MambaSpec),
            make(FullAttentionSpec),
            "spec 0 is MambaSpec (kind=mamba) but spec 1 is FullAttentionSpec (kind=full_attention)",
            id="mamba-vs-full",
        ),
    ],
)
def test_merge_different_classes(first: KVCacheSpec, second: KVCacheSpec, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape("cannot merge specs: " + message)):
        KVCacheSpec.merge([first, second])


@pytest.mark.parametrize(
    "cls",
    [pytest.param(KVCacheSpec, id="KVCacheSpec"), *_cls_params()],
)
def test_merge_empty(cls: type[KVCacheSpec]) -> None:
    with pytest.raises(
        ValueError, match=re.escape(f"{cls.__name__}.merge needs at least one spec, got none")
    ):
        cls.merge([])


# ---------------------------------------------------------------------------------------
# Invalid fields
# ---------------------------------------------------------------------------------------

_POSITIVE_INT_CASES = [
    pytest.param(FullAttentionSpec, "block_size", 0, "0", id="block_size-0"),
    pytest.param(FullAttentionSpec, "block_size", -16, "-16", id="block_size-negative"),
    pytest.param(FullAttentionSpec, "block_size", True, "True", id="block_size-bool"),
    pytest.param(FullAttentionSpec, "block_size", 16.0, "16.0", id="block_size-float"),
    pytest.param(MambaSpec, "block_size", 0, "0", id="mamba-block_size-0"),
    pytest.param(MambaSpec, "block_size", False, "False", id="mamba-block_size-bool"),
    pytest.param(CrossAttentionSpec, "num_kv_heads", 0, "0", id="num_kv_heads-0"),
    pytest.param(CrossAttentionSpec, "num_kv_heads", True, "True", id="num_kv_heads-bool"),
    pytest.param(SlidingWindowSpec, "num_kv_heads", "8", "'8'", id="num_kv_heads-str"),
    pytest.param(EncoderOnlyAttentionSpec, "head_size", -64, "-64", id="head_size-negative"),
    pytest.param(MLAAttentionSpec, "head_size", 0, "0", id="mla-head_size-0"),
    pytest.param(SlidingWindowSpec, "sliding_window", 0, "0", id="window-0"),
    pytest.param(SlidingWindowSpec, "sliding_window", -1, "-1", id="window-negative"),
    pytest.param(SlidingWindowMLASpec, "sliding_window", 0, "0", id="mla-window-0"),
    pytest.param(ChunkedLocalAttentionSpec, "attention_chunk_size", 0, "0", id="chunk-0"),
    pytest.param(ChunkedLocalAttentionSpec, "attention_chunk_size", None, "None", id="chunk-none"),
    pytest.param(SinkFullAttentionSpec, "sink_len", 0, "0", id="sink-0"),
    pytest.param(SinkFullAttentionSpec, "sink_len", -4, "-4", id="sink-negative"),
]


@pytest.mark.parametrize(("cls", "field", "value", "shown"), _POSITIVE_INT_CASES)
def test_non_positive_int_fields_raise(
    cls: type[KVCacheSpec], field: str, value: object, shown: str
) -> None:
    message = f"{cls.__name__}.{field} must be a positive int, got {shown}"
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        make(cls, **{field: value})


@pytest.mark.parametrize(
    ("cls", "field", "value", "message"),
    [
        pytest.param(
            FullAttentionSpec,
            "dtype",
            torch.float64,
            "FullAttentionSpec.dtype must be a torch.dtype among (bfloat16, float16, float32), "
            "got torch.float64",
            id="dtype-float64",
        ),
        pytest.param(
            SlidingWindowSpec,
            "dtype",
            "float16",
            "SlidingWindowSpec.dtype must be a torch.dtype among (bfloat16, float16, float32), "
            "got 'float16'",
            id="dtype-string",
        ),
        pytest.param(
            CrossAttentionSpec,
            "dtype",
            torch.int8,
            "CrossAttentionSpec.dtype must be a torch.dtype among (bfloat16, float16, float32), "
            "got torch.int8",
            id="dtype-int8",
        ),
        pytest.param(
            FullAttentionSpec,
            "kv_cache_dtype",
            "fp8",
            "FullAttentionSpec.kv_cache_dtype must be one of ('auto', 'float32', 'float16', "
            "'bfloat16', 'fp8_e4m3', 'fp8_e5m2', 'fp8_e4m3_per_token_head', 'int8_per_token_head'), got 'fp8'",
            id="kv_cache_dtype-fp8",
        ),
        pytest.param(
            MLAAttentionSpec,
            "kv_cache_dtype",
            torch.float16,
            "MLAAttentionSpec.kv_cache_dtype must be one of ('auto', 'float32', 'float16', "
            "'bfloat16', 'fp8_e4m3', 'fp8_e5m2', 'fp8_e4m3_per_token_head', 'int8_per_token_head'), got torch.float16",
            id="kv_cache_dtype-torch-dtype",
        ),
        pytest.param(
            MLAAttentionSpec,
            "num_kv_heads",
            8,
            "MLAAttentionSpec.num_kv_heads must be 1 (the MLA latent is shared by every head), "
            "got 8",
            id="mla-8-heads",
        ),
        pytest.param(
            SlidingWindowMLASpec,
            "num_kv_heads",
            2,
            "SlidingWindowMLASpec.num_kv_heads must be 1 (the MLA latent is shared by every "
            "head), got 2",
            id="sliding-mla-2-heads",
        ),
    ],
)
def test_invalid_attention_fields(
    cls: type[KVCacheSpec], field: str, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        make(cls, **{field: value})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            {"shapes": ()},
            "MambaSpec.shapes must be a non-empty tuple of shapes, got ()",
            id="shapes-empty",
        ),
        pytest.param(
            {"shapes": [(4, 4)], "dtypes": (F16,)},
            "MambaSpec.shapes must be a non-empty tuple of shapes, got [(4, 4)]",
            id="shapes-list",
        ),
        pytest.param(
            {"shapes": ((),), "dtypes": (F16,)},
            "MambaSpec.shapes[0] must be a non-empty tuple of positive ints, got ()",
            id="shape-empty",
        ),
        pytest.param(
            {"shapes": ((4,), (2, 0))},
            "MambaSpec.shapes[1] must be a non-empty tuple of positive ints, got (2, 0)",
            id="dim-zero",
        ),
        pytest.param(
            {"shapes": ((4,), (2, 3.0))},
            "MambaSpec.shapes[1] must be a non-empty tuple of positive ints, got (2, 3.0)",
            id="dim-float",
        ),
        pytest.param(
            {"shapes": ((True, 2), (4,))},
            "MambaSpec.shapes[0] must be a non-empty tuple of positive ints, got (True, 2)",
            id="dim-bool",
        ),
        pytest.param(
            {"shapes": ([4, 4], (4,))},
            "MambaSpec.shapes[0] must be a non-empty tuple of positive ints, got [4, 4]",
            id="shape-list",
        ),
        pytest.param(
            {"dtypes": (F16,)},
            "MambaSpec.dtypes must be a tuple with one dtype per shape (2), got (torch.float16,)",
            id="dtypes-too-few",
        ),
        pytest.param(
            {"dtypes": (F16, F16, F16)},
            "MambaSpec.dtypes must be a tuple with one dtype per shape (2), got "
            "(torch.float16, torch.float16, torch.float16)",
            id="dtypes-too-many",
        ),
        pytest.param(
            {"dtypes": [F16, F32]},
            "MambaSpec.dtypes must be a tuple with one dtype per shape (2), got "
            "[torch.float16, torch.float32]",
            id="dtypes-list",
        ),
        pytest.param(
            {"dtypes": (F16, torch.float64)},
            "MambaSpec.dtypes[1] must be a torch.dtype among (bfloat16, float16, float32), "
            "got torch.float64",
            id="dtype-float64",
        ),
        pytest.param(
            {"dtypes": ("float16", F32)},
            "MambaSpec.dtypes[0] must be a torch.dtype among (bfloat16, float16, float32), "
            "got 'float16'",
            id="dtype-string",
        ),
        pytest.param(
            {"mamba_type": "mamba3"},
            "MambaSpec.mamba_type must be one of ('mamba1', 'mamba2', 'gdn', 'linear', "
            "'short_conv'), got 'mamba3'",
            id="mamba_type",
        ),
    ],
)
def test_invalid_mamba_fields(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        make(MambaSpec, **overrides)


@pytest.mark.parametrize("mamba_type", ["mamba1", "mamba2", "gdn", "linear", "short_conv"])
def test_every_mamba_type_is_accepted(mamba_type: str) -> None:
    assert make(MambaSpec, mamba_type=mamba_type).mamba_type == mamba_type


# ---------------------------------------------------------------------------------------
# spec_class_for_kind
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "cls"),
    [pytest.param(kind, cls, id=kind) for cls, kind in KIND_OF_CLASS.items()],
)
def test_spec_class_for_kind(kind: str, cls: type[KVCacheSpec]) -> None:
    assert spec_class_for_kind(KVCacheSpecKind(kind)) is cls
    assert spec_class_for_kind(kind) is cls  # type: ignore[arg-type]  # str accepted


def test_spec_class_for_unknown_kind() -> None:
    with pytest.raises(ValueError, match="'full' is not a valid KVCacheSpecKind"):
        spec_class_for_kind("full")  # type: ignore[arg-type]  # test input built loosely or wrong on purpose


# ---------------------------------------------------------------------------------------
# get_attn_spec_kind
# ---------------------------------------------------------------------------------------

ERROR = "error"

# Decoder layers, keyed (use_mla, has_window, has_chunk, has_sink), from the docstring rules.
_DECODER_TABLE: dict[tuple[bool, bool, bool, bool], str] = {
    (False, False, False, False): "full_attention",
    (False, False, False, True): "sink_full_attention",
    (False, False, True, False): "chunked_local_attention",
    (False, False, True, True): ERROR,  # sinks + chunk
    (False, True, False, False): "sliding_window",
    (False, True, False, True): ERROR,  # sinks + window
    (False, True, True, False): ERROR,  # window + chunk
    (False, True, True, True): ERROR,
    (True, False, False, False): "mla_attention",
    (True, False, False, True): ERROR,  # sinks + MLA
    (True, False, True, False): ERROR,  # MLA + chunk
    (True, False, True, True): ERROR,
    (True, True, False, False): "sliding_window_mla",
    (True, True, False, True): ERROR,
    (True, True, True, False): ERROR,
    (True, True, True, True): ERROR,
}
# Non-decoder layers take no signal at all.
_NON_DECODER_KIND: dict[AttentionType, str] = {
    AttentionType.ENCODER: "encoder_only_attention",
    AttentionType.ENCODER_ONLY: "encoder_only_attention",
    AttentionType.ENCODER_DECODER: "cross_attention",
}
NO_SIGNAL = (False, False, False, False)
EXPECTED_KIND: dict[tuple[AttentionType, bool, bool, bool, bool], str] = {
    (AttentionType.DECODER, mla, win, chunk, sink): kind
    for (mla, win, chunk, sink), kind in _DECODER_TABLE.items()
}
EXPECTED_KIND.update(
    {
        (attn_type, mla, win, chunk, sink): (
            kind if (mla, win, chunk, sink) == NO_SIGNAL else ERROR
        )
        for attn_type, kind in _NON_DECODER_KIND.items()
        for mla, win, chunk, sink in itertools.product([False, True], repeat=4)
    }
)


class Signals(NamedTuple):
    attn_type: AttentionType
    use_mla: bool
    sliding_window: int | None
    attention_chunk_size: int | None
    sink_len: int | None


def _some(value: int | None) -> int:
    assert value is not None
    return value


_COMMON: dict[str, Any] = {"block_size": 16, "head_size": 64, "dtype": F16}

# The spec class a model definition would construct for each kind, from the signals.
CONSTRUCT: dict[str, Callable[[Signals], KVCacheSpec]] = {
    "full_attention": lambda s: FullAttentionSpec(**_COMMON, num_kv_heads=4),
    "sink_full_attention": lambda s: SinkFullAttentionSpec(
        **_COMMON, num_kv_heads=4, sink_len=_some(s.sink_len)
    ),
    "chunked_local_attention": lambda s: ChunkedLocalAttentionSpec(
        **_COMMON, num_kv_heads=4, attention_chunk_size=_some(s.attention_chunk_size)
    ),
    "sliding_window": lambda s: SlidingWindowSpec(
        **_COMMON, num_kv_heads=4, sliding_window=_some(s.sliding_window)
    ),
    "mla_attention": lambda s: MLAAttentionSpec(**_COMMON),
    "sliding_window_mla": lambda s: SlidingWindowMLASpec(
        **_COMMON, sliding_window=_some(s.sliding_window)
    ),
    "encoder_only_attention": lambda s: EncoderOnlyAttentionSpec(**_COMMON, num_kv_heads=4),
    "cross_attention": lambda s: CrossAttentionSpec(**_COMMON, num_kv_heads=4),
}

_SIGNAL_NAMES = ("use_mla", "sliding_window", "attention_chunk_size", "sink_len")


def test_expected_kind_table_is_complete() -> None:
    assert len(EXPECTED_KIND) == 4 * 2**4
    assert set(EXPECTED_KIND.values()) - {ERROR} == set(CONSTRUCT)
    # An indexer is no attention layer's signal: models declare it beside their MLA layers.
    assert set(CONSTRUCT) == {k.value for k in KVCacheSpecKind} - {"mamba", "indexer"}


def _check_signals(s: Signals) -> None:
    key = (
        s.attn_type,
        s.use_mla,
        s.sliding_window is not None,
        s.attention_chunk_size is not None,
        s.sink_len is not None,
    )
    expected = EXPECTED_KIND[key]
    kwargs = s._asdict()
    if expected == ERROR:
        with pytest.raises(ValueError, match="get_attn_spec_kind: no spec kind") as info:
            get_attn_spec_kind(**kwargs)
        message = str(info.value)
        assert f"attn_type={s.attn_type.value}" in message
        present = dict(zip(_SIGNAL_NAMES, key[1:], strict=True))
        for name, is_present in present.items():
            named = re.search(rf"\b{name}\b", message) is not None
            assert named is is_present, (name, message)
        return
    kind = get_attn_spec_kind(**kwargs)
    assert isinstance(kind, KVCacheSpecKind)
    assert kind.value == expected
    spec = CONSTRUCT[expected](s)
    assert spec.kind == kind
    assert spec.kind is kind


_positive_or_none = st.none() | st.integers(min_value=1, max_value=10**6)


@settings(max_examples=400, deadline=None, database=None)
@given(
    attn_type=st.sampled_from(AttentionType),
    use_mla=st.booleans(),
    sliding_window=_positive_or_none,
    attention_chunk_size=_positive_or_none,
    sink_len=_positive_or_none,
)
def test_get_attn_spec_kind_property(
    attn_type: AttentionType,
    use_mla: bool,
    sliding_window: int | None,
    attention_chunk_size: int | None,
    sink_len: int | None,
) -> None:
    _check_signals(Signals(attn_type, use_mla, sliding_window, attention_chunk_size, sink_len))


@pytest.mark.parametrize(
    "key", [pytest.param(key, id="-".join(map(str, key))) for key in EXPECTED_KIND]
)
def test_get_attn_spec_kind_every_combination(
    key: tuple[AttentionType, bool, bool, bool, bool],
) -> None:
    # The property test samples; this walks all 64 presence combinations once.
    attn_type, use_mla, has_window, has_chunk, has_sink = key
    _check_signals(
        Signals(
            attn_type,
            use_mla,
            256 if has_window else None,
            8192 if has_chunk else None,
            4 if has_sink else None,
        )
    )


def test_get_attn_spec_kind_defaults_and_strings() -> None:
    assert get_attn_spec_kind() is KVCacheSpecKind.FULL_ATTENTION
    assert (
        get_attn_spec_kind(attn_type="encoder_decoder")  # type: ignore[arg-type]  # test input built loosely or wrong on purpose
        is KVCacheSpecKind.CROSS_ATTENTION
    )
    with pytest.raises(ValueError, match="'cross' is not a valid AttentionType"):
        get_attn_spec_kind(attn_type="cross")  # type: ignore[arg-type]  # test input built loosely or wrong on purpose


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            {"sliding_window": 0}, "sliding_window must be a positive int, got 0", id="window-0"
        ),
        pytest.param(
            {"sliding_window": -1}, "sliding_window must be a positive int, got -1", id="window-neg"
        ),
        pytest.param(
            {"sliding_window": True},
            "sliding_window must be a positive int, got True",
            id="window-bool",
        ),
        pytest.param(
            {"attention_chunk_size": 0},
            "attention_chunk_size must be a positive int, got 0",
            id="chunk-0",
        ),
        pytest.param(
            {"attention_chunk_size": 2.5},
            "attention_chunk_size must be a positive int, got 2.5",
            id="chunk-float",
        ),
        pytest.param({"sink_len": 0}, "sink_len must be a positive int, got 0", id="sink-0"),
        pytest.param({"sink_len": -3}, "sink_len must be a positive int, got -3", id="sink-neg"),
        pytest.param(
            {"attn_type": AttentionType.ENCODER, "sliding_window": 0},
            "sliding_window must be a positive int, got 0",
            id="encoder-window-0",
        ),
    ],
)
def test_get_attn_spec_kind_non_positive_signals(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape("get_attn_spec_kind." + message) + "$"):
        get_attn_spec_kind(**kwargs)


def test_get_attn_spec_kind_use_mla_must_be_bool() -> None:
    with pytest.raises(ValueError, match=re.escape("get_attn_spec_kind: use_mla must be a bool, got 'no'")):
        get_attn_spec_kind(use_mla="no")  # type: ignore[arg-type]  # the wrong type is the test
