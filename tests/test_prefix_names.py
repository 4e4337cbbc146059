"""Prefix-cache names: the byte format, the chains, the roots, the namespaces.

The oracle below serializes one block at a time with ``struct`` and hashes it with
``hashlib``, written from the format in docs/prefix-caching.md ("The byte format"),
not from the code: a root is ``H(b"AKPR" || u8 1 || value(salt) || value(adapter))``,
a block ``H(parent || u32 n || n x u32 ids || u32 k || k extra keys)``, an extra key
``u8 1 || u32 len || u64 start || u64 end || value(mm_hash)``, a value ``N`` (None),
``S`` + u32 length + UTF-8, ``I`` + int64, all little-endian. Known digests are pinned,
and a fresh interpreter (another hash seed) computes the same ones.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import importlib
import os
import struct
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import (
    ArgumentTypeError,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    InvalidArgumentError,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
    MissingDependencyError,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from attnkit.prefix_cache import (
    BlockChain,
    MultimodalInput,
    TokenLayout,
    block_names,
    check_mm_inputs,
    encode_value,
    get_hasher,
    group_namespace,
    prefix_root,
)

SHA = get_hasher("sha256")

# ---------------------------------------------------------------------------- oracle


def ref_value(v: object) -> bytes:
    if v is None:
        return b"N"
    if isinstance(v, str):
        data = v.encode("utf-8")
        return b"S" + struct.pack("<I", len(data)) + data
    if isinstance(v, bytes):
        return b"Y" + struct.pack("<I", len(v)) + v
    assert isinstance(v, int)
    return b"I" + struct.pack("<q", v)


def ref_root(salt: str | None = None, adapter: str | int | None = None) -> bytes:
    return hashlib.sha256(b"AKPR" + bytes([1]) + ref_value(salt) + ref_value(adapter)).digest()


def ref_names(
    tokens: Sequence[int],
    block_size: int,
    shift: int,
    root: bytes,
    mm: Sequence[tuple[int, int, str]] = (),
) -> list[bytes]:
    """Every full block's name, one block at a time."""
    names: list[bytes] = []
    parent = root
    b = 0
    while (b + 1) * block_size - shift <= len(tokens):
        start, end = max(0, b * block_size - shift), (b + 1) * block_size - shift
        ids = list(tokens[start:end]) if end > 0 else []
        data = parent + struct.pack("<I", len(ids))
        for t in ids:
            data += struct.pack("<I", t)
        keys = [
            bytes([1]) + struct.pack("<I", 16 + len(ref_value(h))) + struct.pack("<QQ", s, e) + ref_value(h)
            for s, e, h in sorted(mm)
            if ids and s < end and e > start
        ]
        data += struct.pack("<I", len(keys)) + b"".join(keys)
        parent = hashlib.sha256(data).digest()
        names.append(parent)
        b += 1
    return names


# ---------------------------------------------------------------------------- the format


PINNED_ROOT = {
    "sha256": "e2ca2357445804e90d09b1ed13ee38fcc8f0085d36250a3d7f2f2ffeaafdb3a1",
    "xxh3_128": "c8dfc3bad53d886ee760c41a3a0ff97d",
}
PINNED_NAMES = {
    "sha256": [
        "8f66c4c79434e7aa4d811d42e431c7d6cd3fc9f967c1758eb1f3069237ecda34",
        "f20679137e930760bfdc26a177f8e8f88aa02fe45079a790aec41acbf7faf2c7",
    ],
    "xxh3_128": ["44bf24b1f26e42a0ece725125046ba0b", "615ed376054c127bc300cd5522c08d4d"],
}
PINNED_NAMESPACE = "3d703afddd08b522316b25109c485e257d7c0d1e7cd20e1cd570cdfdb6f973f5"
EXAMPLE_TOKENS = [1, 2, 3, 4, 5, 6, 70000, 4294967295, 9]
EXAMPLE_MM = [(5, 7, "img0")]

PIN_SCRIPT = textwrap.dedent(
    """
    import torch
    from attnkit import FullAttentionSpec
    from attnkit.prefix_cache import TokenLayout, block_names, get_hasher, group_namespace, prefix_root
    for name in ("sha256", "xxh3_128"):
        h = get_hasher(name)
        root = prefix_root(h, cache_salt="tenant-a", adapter_id=7)
        names = block_names(TOKENS, TokenLayout(4), h, root, mm_inputs=MM)
        print(name, root.hex(), *(n.hex() for n in names))
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    print(group_namespace(spec, revision="rev1", k_scales=[1.0], v_scales=[0.5]).hex())
    """
)


@pytest.mark.parametrize("hash_name", ["sha256", "xxh3_128"])
def test_known_digests(hash_name: Any) -> None:
    h = get_hasher(hash_name)
    root = prefix_root(h, cache_salt="tenant-a", adapter_id=7)
    names = block_names(EXAMPLE_TOKENS, TokenLayout(4), h, root, mm_inputs=EXAMPLE_MM)
    assert root.hex() == PINNED_ROOT[hash_name]
    assert [n.hex() for n in names] == PINNED_NAMES[hash_name]
    if hash_name == "sha256":  # the oracle computes the same from the documented format
        assert root == ref_root("tenant-a", 7)
        assert names == ref_names(EXAMPLE_TOKENS, 4, 0, root, EXAMPLE_MM)


def test_the_digests_are_the_same_in_another_process() -> None:
    script = f"TOKENS = {EXAMPLE_TOKENS!r}\nMM = {EXAMPLE_MM!r}\n" + PIN_SCRIPT
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env
    ).stdout.splitlines()
    assert out[0].split() == ["sha256", PINNED_ROOT["sha256"], *PINNED_NAMES["sha256"]]
    assert out[1].split() == ["xxh3_128", PINNED_ROOT["xxh3_128"], *PINNED_NAMES["xxh3_128"]]
    assert out[2] == PINNED_NAMESPACE


def test_the_value_encoding() -> None:
    assert encode_value(None) == b"N"
    assert encode_value(True) == b"B\x01"
    assert encode_value(-2) == b"I" + struct.pack("<q", -2)
    assert encode_value(0.5) == b"F" + struct.pack("<d", 0.5)
    assert encode_value("é") == b"S\x02\x00\x00\x00\xc3\xa9"
    assert encode_value(b"ab") == b"Y\x02\x00\x00\x00ab"
    assert encode_value(torch.float16) == b"D\x0d\x00\x00\x00torch.float16"
    assert encode_value((1, "a")) == b"L\x02\x00\x00\x00" + encode_value(1) + encode_value("a")
    t = torch.tensor([[1.0, 2.0]], dtype=torch.float32)
    assert encode_value(t) == (
        b"T" + b"\x0d\x00\x00\x00torch.float32" + struct.pack("<I", 2) + struct.pack("<QQ", 1, 2)
        + struct.pack("<I", 8) + struct.pack("<ff", 1.0, 2.0)
    )
    with pytest.raises(ArgumentTypeError, match=r"spec\.x must be None, a bool, int"):
        encode_value(object(), "spec.x")
    with pytest.raises(InvalidArgumentError, match="must fit in int64"):
        encode_value(2**63)
    with pytest.raises(InvalidArgumentError, match="must be finite"):
        encode_value(float("nan"))


# ---------------------------------------------------------------------------- chains


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[int], int, int, list[tuple[int, int, str]]]:
    bs = draw(st.sampled_from([1, 2, 3, 4, 16]))
    shift = draw(st.sampled_from([0, 0, 1, bs - 1, bs, bs + 1, 2 * bs + 3]))
    n = draw(st.integers(0, 80))
    ids = st.one_of(st.integers(0, 200), st.just(2**32 - 1))
    tokens = draw(st.lists(ids, min_size=n, max_size=n))
    mm: list[tuple[int, int, str]] = []
    if n:
        for _ in range(draw(st.integers(0, 3))):
            start = draw(st.integers(0, n - 1))
            end = draw(st.integers(start + 1, n))
            mm.append((start, end, draw(st.sampled_from(["a", "b", "img-7"]))))
    return tokens, bs, max(shift, 0), mm


@settings(max_examples=200, deadline=None)
@given(req=requests(), salt=st.sampled_from([None, "s", "tenant"]))
def test_chains_equal_a_block_by_block_hashlib_loop(
    req: tuple[list[int], int, int, list[tuple[int, int, str]]], salt: str | None
) -> None:
    tokens, bs, shift, mm = req
    root = prefix_root(SHA, cache_salt=salt)
    assert root == ref_root(salt)
    expected = ref_names(tokens, bs, shift, root, mm)
    layout = TokenLayout(bs, shift)
    for form in (tokens, np.array(tokens, dtype=np.int64), array.array("I", tokens)):
        assert block_names(form, layout, SHA, root, mm_inputs=mm) == expected
    assert len(expected) == layout.full_blocks(len(tokens))


@settings(max_examples=200, deadline=None)
@given(req=requests(), data=st.data())
def test_incremental_names_equal_one_shot(
    req: tuple[list[int], int, int, list[tuple[int, int, str]]], data: st.DataObject
) -> None:
    tokens, bs, shift, mm = req
    layout = TokenLayout(bs, shift)
    root = prefix_root(SHA)
    whole = block_names(tokens, layout, SHA, root, mm_inputs=mm)
    # BlockChain: a prompt, then generated tokens in random pieces.
    cut = data.draw(st.integers(0, len(tokens)))
    prompt_mm = [m for m in mm if m[1] <= cut]
    chain = BlockChain(tokens[:cut], layout, SHA, root, mm_inputs=prompt_mm)
    rest = tokens[cut:]
    while rest:
        k = data.draw(st.integers(1, len(rest)))
        before = len(chain.names)
        added = chain.append(rest[:k])
        assert chain.names[before:] == added
        rest = rest[k:]
    assert chain.num_tokens == len(tokens)
    assert chain.names == block_names(tokens, layout, SHA, root, mm_inputs=prompt_mm)
    # block_names from a block on, from the last name.
    first = data.draw(st.integers(0, len(whole)))
    parent = whole[first - 1] if first else root
    start = layout.tokens_of(first)[0]
    assert block_names(tokens[start:], layout, SHA, parent, first_block=first, mm_inputs=mm) == whole[first:]
    assert block_names(tokens, layout, SHA, root, mm_inputs=mm, max_blocks=1) == whole[:1]


def test_a_salt_or_an_adapter_changes_every_name() -> None:
    tokens = list(range(64))
    layout = TokenLayout(16)
    plain = block_names(tokens, layout, SHA, prefix_root(SHA))
    assert plain == block_names(tokens, layout, SHA, prefix_root(SHA, cache_salt=None))
    for root in (
        prefix_root(SHA, cache_salt="a"),
        prefix_root(SHA, cache_salt=""),
        prefix_root(SHA, adapter_id="lora-1"),
        prefix_root(SHA, adapter_id=1),
        prefix_root(SHA, adapter_id="1"),  # the str "1" is not the int 1
    ):
        other = block_names(tokens, layout, SHA, root)
        assert all(a != b for a, b in zip(plain, other, strict=True))
    assert prefix_root(SHA, cache_salt="a") == prefix_root(SHA, cache_salt="a")
    assert prefix_root(SHA, adapter_id=1) != prefix_root(SHA, adapter_id="1")


@pytest.mark.parametrize(("start", "end", "first"), [(0, 1, 0), (17, 18, 1), (15, 33, 0), (40, 48, 2)])
def test_a_multimodal_input_changes_the_blocks_it_overlaps_and_every_later_one(
    start: int, end: int, first: int
) -> None:
    tokens = [7] * 64
    layout = TokenLayout(16)
    root = prefix_root(SHA)
    plain = block_names(tokens, layout, SHA, root)
    with_mm = block_names(tokens, layout, SHA, root, mm_inputs=[(start, end, "img")])
    assert plain[:first] == with_mm[:first]
    assert all(a != b for a, b in zip(plain[first:], with_mm[first:], strict=True))
    other = block_names(tokens, layout, SHA, root, mm_inputs=[(start, end, "img2")])
    assert other[:first] == plain[:first]
    assert other[first] != with_mm[first]
    # bytes and str hashes are told apart; the order inputs are given in is not
    assert block_names(tokens, layout, SHA, root, mm_inputs=[(start, end, b"img")]) != with_mm
    two = [(0, 2, "x"), (start, end, "img")]
    assert block_names(tokens, layout, SHA, root, mm_inputs=two) == block_names(
        tokens, layout, SHA, root, mm_inputs=two[::-1]
    )


@pytest.mark.parametrize(
    ("token_ids", "error", "match"),
    [
        ([1, -1], InvalidArgumentError, r"token_ids\[1\] must be a token id in 0..4294967295 \(uint32\), got -1"),
        ([2**32], InvalidArgumentError, r"token_ids\[0\] must be a token id in 0..4294967295 \(uint32\), got 4294967296"),
        (np.array([3, 2**40]), InvalidArgumentError, r"token_ids\[1\] must be a token id .* got 1099511627776"),
        (np.array([-5]), InvalidArgumentError, r"token_ids\[0\] .* got -5"),
        ([1, 2.0], ArgumentTypeError, r"token_ids\[1\] must be an int token id, got float 2.0"),
        (np.array([1.0]), ArgumentTypeError, "token_ids must be a 1-d integer array, got a 1-d float64 array"),
        (np.array([[1]]), ArgumentTypeError, "token_ids must be a 1-d integer array, got a 2-d int64 array"),
        (np.array([True]), ArgumentTypeError, "got a 1-d bool array"),
        ("abc", ArgumentTypeError, "token_ids must be a sequence of ints or an integer array, got str"),
        (7, ArgumentTypeError, "got int"),
    ],
)
def test_bad_token_ids_are_refused(token_ids: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        block_names(token_ids, TokenLayout(4), SHA, prefix_root(SHA))


@pytest.mark.parametrize(
    ("mm", "error", "match"),
    [
        ([(-1, 2, "a")], InvalidArgumentError, r"mm_inputs\[0\].start must be >= 0, got -1"),
        ([(3, 3, "a")], InvalidArgumentError, r"mm_inputs\[0\] must have start < end, got start=3, end=3"),
        ([(0, 2, "a"), (2, 11, "b")], InvalidArgumentError, r"mm_inputs\[1\] must lie within the prompt's 10 tokens, got start=2, end=11"),
        ([(0, 2, "")], InvalidArgumentError, r"mm_inputs\[0\].mm_hash must be a non-empty str or bytes"),
        ([(0, 2, 5)], InvalidArgumentError, r"mm_hash must be a non-empty str or bytes, got 5"),
        ([(0.0, 2, "a")], ArgumentTypeError, r"mm_inputs\[0\].start must be an int, got float"),
        ([(0, 2)], ArgumentTypeError, r"mm_inputs\[0\] must be a MultimodalInput or a \(start, end, mm_hash\) tuple"),
    ],
)
def test_bad_multimodal_inputs_are_refused(mm: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        block_names(list(range(10)), TokenLayout(4), SHA, prefix_root(SHA), mm_inputs=mm)


def test_multimodal_inputs_are_checked_and_sorted() -> None:
    given = [MultimodalInput(4, 6, "b"), (0, 2, "a")]
    assert check_mm_inputs(given, 6) == (MultimodalInput(0, 2, "a"), MultimodalInput(4, 6, "b"))
    with pytest.raises(InvalidArgumentError, match="MultimodalInput must have start < end"):
        MultimodalInput(5, 2, "a")


def test_bad_chain_arguments() -> None:
    root = prefix_root(SHA)
    with pytest.raises(InvalidArgumentError, match="parent must be a 32-byte sha256 name"):
        block_names([1, 2], TokenLayout(1), SHA, root[:16])
    with pytest.raises(InvalidArgumentError, match="first_block must be an int >= 0, got -1"):
        block_names([1, 2], TokenLayout(1), SHA, root, first_block=-1)
    with pytest.raises(InvalidArgumentError, match=r"TokenLayout\.block_size must be a positive int, got 0"):
        TokenLayout(0)
    with pytest.raises(InvalidArgumentError, match=r"TokenLayout\.shift must be an int >= 0, got -2"):
        TokenLayout(4, -2)
    with pytest.raises(ArgumentTypeError, match="cache_salt must be a str or None, got bytes"):
        prefix_root(SHA, cache_salt=b"x")
    with pytest.raises(ArgumentTypeError, match="adapter_id must be a str, an int or None, got float"):
        prefix_root(SHA, adapter_id=1.5)


def test_token_layouts() -> None:
    sinks = TokenLayout(4, 6)  # block 0: sinks only; block 1: 2 sinks, tokens 0, 1
    assert [sinks.tokens_of(b) for b in range(3)] == [(0, 0), (0, 2), (2, 6)]
    assert [sinks.full_blocks(n) for n in (0, 1, 2, 5, 6)] == [1, 1, 2, 2, 3]
    assert [sinks.floor(n) for n in (0, 1, 2, 5, 6, 7)] == [0, 0, 2, 2, 6, 6]
    assert str(sinks) == "blocks of 4, shifted by 6"


# ---------------------------------------------------------------------------- hashers


def test_hashers() -> None:
    assert SHA.digest(b"abc") == hashlib.sha256(b"abc").digest()
    assert SHA.digest_size == 32
    xxh = get_hasher("xxh3_128")
    assert (xxh.name, xxh.digest_size) == ("xxh3_128", 16)
    assert xxh.digest(b"abc").hex() == "06b05ab6733a618578af5f94892f3950"  # XXH3-128 of "abc"
    with pytest.raises(InvalidArgumentError, match="hash must be one of 'sha256', 'xxh3_128', got 'md5'"):
        get_hasher("md5")


def test_xxh3_without_xxhash_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def without_xxhash(name: str, package: str | None = None) -> Any:
        if name == "xxhash":
            raise ModuleNotFoundError("No module named 'xxhash'")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", without_xxhash)
    with pytest.raises(MissingDependencyError, match=r"pip install 'attnkit\[xxhash\]'") as info:
        get_hasher("xxh3_128")
    assert isinstance(info.value, ImportError)
    assert get_hasher("sha256") is SHA  # the default needs nothing


# ---------------------------------------------------------------------------- namespaces


def _specs() -> list[KVCacheSpec]:
    attn: dict[str, Any] = {"block_size": 16, "head_size": 64, "dtype": torch.bfloat16}
    return [
        FullAttentionSpec(num_kv_heads=4, **attn),
        SinkFullAttentionSpec(num_kv_heads=4, sink_len=4, **attn),
        MLAAttentionSpec(**attn),
        SlidingWindowSpec(num_kv_heads=4, sliding_window=128, **attn),
        SlidingWindowMLASpec(sliding_window=128, **attn),
        ChunkedLocalAttentionSpec(num_kv_heads=4, attention_chunk_size=256, **attn),
        EncoderOnlyAttentionSpec(num_kv_heads=4, **attn),
        CrossAttentionSpec(num_kv_heads=4, **attn),
        MambaSpec(block_size=16, shapes=((8, 3), (2, 4, 16)), dtypes=(torch.bfloat16, torch.float32)),
    ]


ALTERED: dict[str, list[object]] = {
    "block_size": [32],
    "num_kv_heads": [8],
    "head_size": [128],
    "dtype": [torch.float16],
    "kv_cache_dtype": ["fp8_e4m3"],
    "sink_len": [5],
    "sliding_window": [127],
    "attention_chunk_size": [512],
    "shapes": [((8, 3), (2, 4, 17)), ((3, 8), (2, 4, 16))],
    "dtypes": [(torch.bfloat16, torch.bfloat16)],
    "mamba_type": ["gdn"],
    "mm_prefix": [True],
}

MM_PREFIX_KINDS = {KVCacheSpecKind.FULL_ATTENTION, KVCacheSpecKind.SLIDING_WINDOW}
"""The kinds whose specs take ``mm_prefix`` (image ranges); others refuse it."""


@pytest.mark.parametrize("spec", _specs(), ids=lambda s: s.kind.value)
def test_namespaces_differ_for_every_spec_field(spec: KVCacheSpec) -> None:
    base = group_namespace(spec)
    assert base == group_namespace(dataclasses.replace(spec))
    assert len(base) == 32
    refused: set[str] = set()
    for field in dataclasses.fields(spec):
        for value in ALTERED[field.name]:
            try:
                other = dataclasses.replace(spec, **{field.name: value})
            except InvalidArgumentError:
                refused.add(field.name)  # not a valid value for this kind
                continue
            assert group_namespace(other) != base, field.name
    may_refuse = {"mm_prefix"} if spec.kind not in MM_PREFIX_KINDS else set()
    if "mla" in spec.kind.value:
        may_refuse.add("num_kv_heads")  # an MLA spec has 1 head
    assert refused <= may_refuse


def test_namespaces_differ_for_kind_layout_revision_hash_scales_and_sinks() -> None:
    spec = _specs()[1]  # sink tokens
    sink = torch.zeros(4, 4, 64)
    base_args: dict[str, Any] = {
        "revision": "r1",
        "k_scales": [1.0, 1.0],
        "v_scales": [1.0, 1.0],
        "sink_keys": [sink, sink],
        "sink_values": [sink, sink],
    }
    base = group_namespace(spec, **base_args)
    assert group_namespace(spec, **base_args) == base
    nudged = sink.clone()
    nudged[3, 3, 63] = 1e-3
    variants: list[dict[str, Any]] = [
        {"revision": "r2"},
        {"layout": "planes"},
        {"hash_name": "xxh3_128"},
        {"k_scales": [1.0, 0.5]},
        {"v_scales": [0.5, 1.0]},
        {"k_scales": [1.0, torch.tensor(1.0)]},  # a tensor scale is not the float
        {"sink_keys": [sink, nudged]},
        {"sink_values": [nudged, sink]},
        {"sink_keys": [sink, sink.to(torch.bfloat16)]},
    ]
    for change in variants:
        assert group_namespace(spec, **{**base_args, **change}) != base, change
    # the same fields, another kind: full vs cross attention
    full = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    assert group_namespace(full) != group_namespace(cross)


def test_bad_namespace_arguments() -> None:
    spec = _specs()[0]
    with pytest.raises(InvalidArgumentError, match="k_scales and v_scales must have one entry per layer each, got 2 and 1"):
        group_namespace(spec, k_scales=[1.0, 1.0], v_scales=[1.0])
    with pytest.raises(ArgumentTypeError, match=r"k_scales\[0\] must be a float or a tensor, got str"):
        group_namespace(spec, k_scales=["1"], v_scales=[1.0])
    with pytest.raises(InvalidArgumentError, match="layout must be one of"):
        group_namespace(spec, layout="paged")
    with pytest.raises(ArgumentTypeError, match="spec must be a KVCacheSpec, got dict"):
        group_namespace({})
    with pytest.raises(ArgumentTypeError, match=r"sink_keys\[0\] must be a tensor, got list"):
        group_namespace(spec, sink_keys=[[0.0]], sink_values=[torch.zeros(1)])
