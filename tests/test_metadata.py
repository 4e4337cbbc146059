"""Tests for ``attnkit.metadata``: batch metadata validation and the decode/prefill split.

Expected tensors and splits are written out by hand. The property test for the reorder
counts decodes and tokens directly from the query lengths, independently of the code
under test. Device-side tensors are put on the ``meta`` device to exercise the
"must be on the CPU" and "same device" checks without a GPU.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.metadata import (
    CommonAttentionMetadata,
    DecodePrefillSplit,
    reorder_batch_to_split_decodes_and_prefills,
    split_decodes_and_prefills,
)

I32 = torch.int32
I64 = torch.int64


def i32(values: list[Any], device: str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=I32, device=device)


def i64(values: list[Any], device: str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=I64, device=device)


# The reference batch: 3 requests with query lengths [1, 1, 5] and context lengths
# [10, 7, 5]; offsets [0, 1, 2, 7]; 7 tokens; block table rows [3, 4], [5], [6].
def valid_kwargs() -> dict[str, Any]:
    return {
        "query_start_loc": i32([0, 1, 2, 7]),
        "query_start_loc_cpu": i32([0, 1, 2, 7]),
        "seq_lens": i32([10, 7, 5]),
        "seq_lens_cpu": i32([10, 7, 5]),
        "num_reqs": 3,
        "num_actual_tokens": 7,
        "max_query_len": 5,
        "max_seq_len": 10,
        "block_table_tensor": i32([[3, 4], [5, 0], [6, 0]]),
        "slot_mapping": i64([57, 113, 96, 97, 98, 99, 100]),
    }


def from_query_lens(query_lens: list[int], context: int = 3) -> CommonAttentionMetadata:
    """A batch with the given query lengths (contexts and slots are arbitrary but valid)."""
    total = sum(query_lens)
    return CommonAttentionMetadata.from_lists(
        query_lens=query_lens,
        seq_lens=[q + context for q in query_lens],
        block_table=[[i + 1] for i in range(len(query_lens))],
        slot_mapping=list(range(total)),
    )


def assert_tensor(t: torch.Tensor, values: list[Any], dtype: torch.dtype) -> None:
    assert t.dtype == dtype
    assert t.device.type == "cpu"
    assert t.tolist() == values


# ---------------------------------------------------------------------------------------
# Construction
# ---------------------------------------------------------------------------------------


def test_construct_from_tensors() -> None:
    kwargs = valid_kwargs()
    md = CommonAttentionMetadata(**kwargs)
    for name, value in kwargs.items():
        assert getattr(md, name) is value
    assert md.causal is True
    assert_tensor(md.query_lens_cpu, [1, 1, 5], I32)


def test_padded_slot_mapping_is_valid() -> None:
    kwargs = valid_kwargs()
    kwargs["slot_mapping"] = i64([57, 113, 96, 97, 98, 99, 100, -1, -1])
    md = CommonAttentionMetadata(**kwargs)
    assert md.slot_mapping.shape == (9,)
    # The padding past num_actual_tokens is not the step's: slots_written still holds.
    assert CommonAttentionMetadata(**kwargs, slots_written=True).slots_written


def test_non_causal_is_kept() -> None:
    md = CommonAttentionMetadata(**valid_kwargs(), causal=False)
    assert md.causal is False


def test_from_lists() -> None:
    md = CommonAttentionMetadata.from_lists(
        query_lens=[1, 1, 5],
        seq_lens=[10, 7, 5],
        block_table=[[3, 4], [5], [6]],
        slot_mapping=[57, 113, 96, 97, 98, 99, 100],
    )
    assert_tensor(md.query_start_loc, [0, 1, 2, 7], I32)
    assert_tensor(md.query_start_loc_cpu, [0, 1, 2, 7], I32)
    assert_tensor(md.seq_lens, [10, 7, 5], I32)
    assert_tensor(md.seq_lens_cpu, [10, 7, 5], I32)
    assert_tensor(md.block_table_tensor, [[3, 4], [5, 0], [6, 0]], I32)
    assert_tensor(md.slot_mapping, [57, 113, 96, 97, 98, 99, 100], I64)
    assert md.num_reqs == 3
    assert md.num_actual_tokens == 7
    assert md.max_query_len == 5
    assert md.max_seq_len == 10
    assert md.causal is True
    assert_tensor(md.query_lens_cpu, [1, 1, 5], I32)


def test_from_lists_device_tensors_go_to_device() -> None:
    md = CommonAttentionMetadata.from_lists(
        query_lens=[2, 3],
        seq_lens=[4, 3],
        block_table=[[7], [8, 9]],
        slot_mapping=[0, 1, 2, 3, 4],
        device="meta",
        causal=False,
    )
    for t in (md.query_start_loc, md.seq_lens, md.block_table_tensor, md.slot_mapping):
        assert t.device.type == "meta"
    assert md.block_table_tensor.shape == (2, 2)
    assert_tensor(md.query_start_loc_cpu, [0, 2, 5], I32)
    assert_tensor(md.seq_lens_cpu, [4, 3], I32)
    assert md.causal is False
    assert (md.max_query_len, md.max_seq_len, md.num_actual_tokens) == (3, 4, 5)


def test_zero_length_query_is_valid() -> None:
    md = from_query_lens([0, 2])
    assert_tensor(md.query_start_loc_cpu, [0, 0, 2], I32)
    assert_tensor(md.query_lens_cpu, [0, 2], I32)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            {"query_lens": [1, 2], "seq_lens": [1, 2, 3], "block_table": [[], [], []]},
            "query_lens, seq_lens and block_table must have one entry per request, got 2, 3 and 3",
            id="seq_lens-longer",
        ),
        pytest.param(
            {"query_lens": [1, 2], "seq_lens": [1, 2], "block_table": [[1]]},
            "query_lens, seq_lens and block_table must have one entry per request, got 2, 2 and 1",
            id="block_table-shorter",
        ),
        pytest.param(
            {"query_lens": [1, -1], "seq_lens": [1, 2], "block_table": [[1], [2]]},
            "query_lens must be >= 0, got [1, -1]",
            id="negative-query",
        ),
    ],
)
def test_from_lists_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        CommonAttentionMetadata.from_lists(**kwargs, slot_mapping=[0, 1, 2])


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(
            lambda: CommonAttentionMetadata.from_lists(
                query_lens=[], seq_lens=[], block_table=[], slot_mapping=[]
            ),
            id="from_lists",
        ),
        pytest.param(
            lambda: CommonAttentionMetadata(
                query_start_loc=i32([0]),
                query_start_loc_cpu=i32([0]),
                seq_lens=i32([]),
                seq_lens_cpu=i32([]),
                num_reqs=0,
                num_actual_tokens=0,
                max_query_len=0,
                max_seq_len=0,
                block_table_tensor=torch.zeros((0, 4), dtype=I32),
                slot_mapping=i64([-1, -1]),
            ),
            id="tensors-padded",
        ),
    ],
)
def test_empty_batch_is_valid(build: Any) -> None:
    md = build()
    assert md.num_reqs == 0
    assert md.num_actual_tokens == 0
    assert_tensor(md.query_start_loc_cpu, [0], I32)
    assert_tensor(md.query_lens_cpu, [], I32)
    assert split_decodes_and_prefills(md) == (0, 0, 0, 0)
    assert split_decodes_and_prefills(md, decode_threshold=4) == (0, 0, 0, 0)


# ---------------------------------------------------------------------------------------
# Validation errors: each case changes one field of the valid reference batch.
# ---------------------------------------------------------------------------------------

_VALIDATION_CASES = [
    pytest.param(
        {"query_start_loc": i64([0, 1, 2, 7])},
        "query_start_loc must be int32 of shape [4] (num_reqs=3), got int64 [4] on cpu",
        id="query_start_loc-int64",
    ),
    pytest.param(
        {"query_start_loc": i32([0, 1, 2, 7, 7])},
        "query_start_loc must be int32 of shape [4] (num_reqs=3), got int32 [5] on cpu",
        id="query_start_loc-shape",
    ),
    pytest.param(
        {"query_start_loc_cpu": i64([0, 1, 2, 7])},
        "query_start_loc_cpu must be int32 of shape [4] (num_reqs=3), got int64 [4] on cpu",
        id="query_start_loc_cpu-int64",
    ),
    pytest.param(
        {"query_start_loc_cpu": i32([[0, 1, 2, 7]])},
        "query_start_loc_cpu must be int32 of shape [4] (num_reqs=3), got int32 [1, 4] on cpu",
        id="query_start_loc_cpu-2d",
    ),
    pytest.param(
        {"seq_lens": i64([10, 7, 5])},
        "seq_lens must be int32 of shape [3] (num_reqs=3), got int64 [3] on cpu",
        id="seq_lens-int64",
    ),
    pytest.param(
        {"seq_lens_cpu": i32([10, 7])},
        "seq_lens_cpu must be int32 of shape [3] (num_reqs=3), got int32 [2] on cpu",
        id="seq_lens_cpu-shape",
    ),
    pytest.param(
        {"block_table_tensor": i64([[3, 4], [5, 0], [6, 0]])},
        "block_table_tensor must be int32 (num_reqs=3), got int64 [3, 2] on cpu",
        id="block_table-int64",
    ),
    pytest.param(
        {"slot_mapping": i32([57, 113, 96, 97, 98, 99, 100])},
        "slot_mapping must be int64 (num_reqs=3), got int32 [7] on cpu",
        id="slot_mapping-int32",
    ),
    pytest.param(
        {"query_start_loc_cpu": i32([0, 1, 2, 7], device="meta")},
        "query_start_loc_cpu must be on the CPU, got int32 [4] on meta",
        id="query_start_loc_cpu-on-device",
    ),
    pytest.param(
        {"seq_lens_cpu": i32([10, 7, 5], device="meta")},
        "seq_lens_cpu must be on the CPU, got int32 [3] on meta",
        id="seq_lens_cpu-on-device",
    ),
    pytest.param(
        {"seq_lens": i32([10, 7, 5], device="meta")},
        "seq_lens must be on query_start_loc's device cpu, got int32 [3] on meta",
        id="seq_lens-other-device",
    ),
    pytest.param(
        {"block_table_tensor": i32([[3, 4], [5, 0], [6, 0]], device="meta")},
        "block_table_tensor must be on query_start_loc's device cpu, got int32 [3, 2] on meta",
        id="block_table-other-device",
    ),
    pytest.param(
        {"slot_mapping": i64([0] * 7, device="meta")},
        "slot_mapping must be on query_start_loc's device cpu, got int64 [7] on meta",
        id="slot_mapping-other-device",
    ),
    pytest.param(
        {"block_table_tensor": i32([3, 4, 5, 0, 6, 0])},
        "block_table_tensor must be int32 of shape [num_reqs=3, max_blocks], got int32 [6] on cpu",
        id="block_table-rank-1",
    ),
    pytest.param(
        {"block_table_tensor": i32([[3, 4], [5, 0]])},
        "block_table_tensor must be int32 of shape [num_reqs=3, max_blocks], "
        "got int32 [2, 2] on cpu",
        id="block_table-too-few-rows",
    ),
    pytest.param(
        {"block_table_tensor": i32([[[3, 4]], [[5, 0]], [[6, 0]]])},
        "block_table_tensor must be int32 of shape [num_reqs=3, max_blocks], "
        "got int32 [3, 1, 2] on cpu",
        id="block_table-rank-3",
    ),
    pytest.param(
        {"slot_mapping": i64([[57], [113], [96], [97], [98], [99], [100]])},
        "slot_mapping must be 1-D [num_tokens], got int64 [7, 1] on cpu",
        id="slot_mapping-2d",
    ),
    pytest.param(
        {"query_start_loc": i32([1, 2, 3, 8]), "query_start_loc_cpu": i32([1, 2, 3, 8])},
        "query_start_loc_cpu[0] must be 0, got 1",
        id="offsets-start-at-1",
    ),
    pytest.param(
        {"query_start_loc": i32([0, 3, 2, 7]), "query_start_loc_cpu": i32([0, 3, 2, 7])},
        "query_start_loc_cpu must be non-decreasing, but entry 2 (2) < entry 1 (3)",
        id="offsets-decrease",
    ),
    pytest.param(
        {"num_actual_tokens": 8},
        "num_actual_tokens must equal query_start_loc_cpu[-1]=7, got 8",
        id="num_actual_tokens-too-many",
    ),
    pytest.param(
        {"num_actual_tokens": 6},
        "num_actual_tokens must equal query_start_loc_cpu[-1]=7, got 6",
        id="num_actual_tokens-too-few",
    ),
    pytest.param(
        {"slot_mapping": i64([57, 113, 96, 97, 98, 99])},
        "slot_mapping must have at least num_actual_tokens=7 entries, got int64 [6] on cpu",
        id="slot_mapping-too-short",
    ),
    pytest.param(
        {"seq_lens": i32([10, 7, 4]), "seq_lens_cpu": i32([10, 7, 4])},
        "seq_lens_cpu[2]=4 is shorter than the request's 5 new tokens",
        id="seq_len-shorter-than-query",
    ),
    pytest.param(
        {"max_query_len": 4},
        "max_query_len must be the largest query length 5, got 4",
        id="max_query_len",
    ),
    pytest.param(
        {"max_seq_len": 11},
        "max_seq_len must be the largest seq_lens entry 10, got 11",
        id="max_seq_len",
    ),
    pytest.param({"num_reqs": -1}, "num_reqs must be an int >= 0, got -1", id="num_reqs-negative"),
    pytest.param({"num_reqs": True}, "num_reqs must be an int >= 0, got True", id="num_reqs-bool"),
    pytest.param(
        {"num_reqs": 2},
        "query_start_loc must be int32 of shape [3] (num_reqs=2), got int32 [4] on cpu",
        id="num_reqs-mismatch",
    ),
    pytest.param({"causal": "yes"}, "causal must be a bool, got 'yes'", id="causal-str"),
    pytest.param(
        {"slots_written": True, "slot_mapping": i64([57, 113, -1, 97, 98, 99, 100])},
        "slots_written=True, but slot_mapping[2] is -1: every one of the step's 7 tokens "
        "must have a slot >= 0",
        id="slots_written-with-an-unwritten-token",
    ),
    pytest.param(
        {"slots_written": 1}, "slots_written must be a bool, got 1", id="slots_written-int"
    ),
]


@pytest.mark.parametrize(("changes", "message"), _VALIDATION_CASES)
def test_validation_errors(changes: dict[str, Any], message: str) -> None:
    kwargs = {**valid_kwargs(), **changes}
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        CommonAttentionMetadata(**kwargs)


@pytest.mark.parametrize(("changes", "message"), _VALIDATION_CASES)
def test_validate_false_skips_checks(changes: dict[str, Any], message: str) -> None:
    kwargs = {**valid_kwargs(), **changes}
    md = CommonAttentionMetadata(**kwargs, validate=False)
    for name, value in changes.items():
        assert getattr(md, name) is value


@pytest.mark.parametrize(
    ("field", "value"),
    [
        pytest.param("query_start_loc", [0, 1, 2, 7], id="query_start_loc-list"),
        pytest.param("seq_lens_cpu", (10, 7, 5), id="seq_lens_cpu-tuple"),
        pytest.param("slot_mapping", None, id="slot_mapping-none"),
    ],
)
def test_non_tensor_field_raises_type_error(field: str, value: object) -> None:
    kwargs = {**valid_kwargs(), field: value}
    message = f"{field} must be a torch.Tensor, got {type(value).__name__}"
    with pytest.raises(TypeError, match=re.escape(message) + "$"):
        CommonAttentionMetadata(**kwargs)


# ---------------------------------------------------------------------------------------
# split_decodes_and_prefills
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query_lens", "threshold", "expected"),
    [
        # (num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)
        pytest.param([1, 1, 1], 1, (3, 0, 3, 0), id="decodes-only"),
        pytest.param([4, 7], 1, (0, 2, 0, 11), id="prefills-only"),
        pytest.param([1, 1, 5, 3], 1, (2, 2, 2, 8), id="mixed"),
        pytest.param([1], 1, (1, 0, 1, 0), id="one-decode"),
        pytest.param([2], 1, (0, 1, 0, 2), id="one-prefill"),
        pytest.param([0, 1, 6], 1, (2, 1, 1, 6), id="zero-length-decode"),
        # Speculative decode: 3 tokens per decode step.
        pytest.param([3, 2, 3, 8, 4], 3, (3, 2, 8, 12), id="spec-decode-threshold-3"),
        pytest.param([3, 2, 4, 8, 5, 9], 4, (3, 3, 9, 22), id="threshold-4"),
        pytest.param([3, 3, 4], 1, (0, 3, 0, 10), id="spec-tokens-are-prefills-at-1"),
        pytest.param([2, 2, 2], 2, (3, 0, 6, 0), id="at-threshold-is-decode"),
    ],
)
def test_split(query_lens: list[int], threshold: int, expected: tuple[int, int, int, int]) -> None:
    md = from_query_lens(query_lens)
    split = split_decodes_and_prefills(md, decode_threshold=threshold)
    assert isinstance(split, DecodePrefillSplit)
    assert tuple(split) == expected
    num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = expected
    assert split.num_decodes == num_decodes
    assert split.num_prefills == num_prefills
    assert split.num_decode_tokens == num_decode_tokens
    assert split.num_prefill_tokens == num_prefill_tokens


def test_split_default_threshold_is_one() -> None:
    assert split_decodes_and_prefills(from_query_lens([1, 2])) == (1, 1, 1, 2)


def test_split_ignores_padded_slots() -> None:
    md = CommonAttentionMetadata.from_lists(
        query_lens=[1, 4],
        seq_lens=[9, 4],
        block_table=[[1], [2]],
        slot_mapping=[0, 1, 2, 3, 4, -1, -1, -1],
    )
    assert split_decodes_and_prefills(md) == (1, 1, 1, 4)


@pytest.mark.parametrize(
    ("query_lens", "threshold", "message"),
    [
        pytest.param(
            [1, 2, 1],
            1,
            "request 2 is a decode (query length 1 <= decode_threshold=1, cached context) "
            "after prefill request 1 (query length 2)",
            id="decode-after-prefill",
        ),
        pytest.param(
            [5, 1],
            1,
            "request 1 is a decode (query length 1 <= decode_threshold=1, cached context) "
            "after prefill request 0 (query length 5)",
            id="prefill-first",
        ),
        pytest.param(
            [3, 9, 7, 0, 1],
            3,
            "request 3 is a decode (query length 0 <= decode_threshold=3, cached context) "
            "after prefill request 1 (query length 9)",
            id="threshold-3",
        ),
    ],
)
def test_split_unordered_batch_raises(query_lens: list[int], threshold: int, message: str) -> None:
    md = from_query_lens(query_lens)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        split_decodes_and_prefills(md, decode_threshold=threshold)
    assert str(info.value).startswith("batch is not ordered decodes first: ")
    assert str(info.value).endswith(
        "HINT: order requests with reorder_batch_to_split_decodes_and_prefills"
    )


_BAD_THRESHOLDS = [
    pytest.param(0, "0", id="zero"),
    pytest.param(-1, "-1", id="negative"),
    pytest.param(True, "True", id="bool"),
    pytest.param(1.5, "1.5", id="float"),
    pytest.param(None, "None", id="none"),
]


@pytest.mark.parametrize(("threshold", "shown"), _BAD_THRESHOLDS)
def test_split_bad_threshold(threshold: Any, shown: str) -> None:
    message = f"decode_threshold must be an int >= 1, got {shown}"
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        split_decodes_and_prefills(from_query_lens([1]), decode_threshold=threshold)


# ---------------------------------------------------------------------------------------
# reorder_batch_to_split_decodes_and_prefills
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query_lens", "threshold", "expected"),
    [
        pytest.param([5, 1, 7, 1], 1, [1, 3, 0, 2], id="docstring"),
        pytest.param([4, 3, 1, 9, 2], 3, [1, 2, 4, 0, 3], id="threshold-3"),
        pytest.param([1, 1], 1, [0, 1], id="decodes-only"),
        pytest.param([3, 2], 1, [0, 1], id="prefills-only"),
        pytest.param([1, 1, 8], 1, [0, 1, 2], id="already-ordered"),
        pytest.param([0, 5, 0], 1, [0, 2, 1], id="zero-lengths-are-decodes"),
        pytest.param([], 1, [], id="empty"),
        pytest.param((9, 1), 1, [1, 0], id="tuple-input"),
        # Stable: decodes keep their order among themselves, as do prefills.
        pytest.param([2, 2, 2, 1, 1, 1], 1, [3, 4, 5, 0, 1, 2], id="stable-blocks"),
        pytest.param([6, 1, 5, 1, 4, 1], 1, [1, 3, 5, 0, 2, 4], id="stable-interleaved"),
    ],
)
def test_reorder(query_lens: list[int], threshold: int, expected: list[int]) -> None:
    assert (
        reorder_batch_to_split_decodes_and_prefills(query_lens, decode_threshold=threshold)
        == expected
    )


def test_reorder_default_threshold_is_one() -> None:
    assert reorder_batch_to_split_decodes_and_prefills([2, 1]) == [1, 0]


@pytest.mark.parametrize(
    ("query_lens", "message"),
    [
        pytest.param([1, -1], "query_lens[1] must be an int >= 0, got -1", id="negative"),
        pytest.param([1.0], "query_lens[0] must be an int >= 0, got 1.0", id="float"),
        pytest.param([2, True], "query_lens[1] must be an int >= 0, got True", id="bool"),
        pytest.param([2, "3"], "query_lens[1] must be an int >= 0, got '3'", id="str"),
    ],
)
def test_reorder_bad_query_lens(query_lens: list[Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        reorder_batch_to_split_decodes_and_prefills(query_lens)


@pytest.mark.parametrize(("threshold", "shown"), _BAD_THRESHOLDS)
def test_reorder_bad_threshold(threshold: Any, shown: str) -> None:
    message = f"decode_threshold must be an int >= 1, got {shown}"
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        reorder_batch_to_split_decodes_and_prefills([1], decode_threshold=threshold)


@settings(max_examples=150, deadline=None, database=None)
@given(
    query_lens=st.lists(st.integers(min_value=0, max_value=12), max_size=12),
    threshold=st.integers(min_value=1, max_value=5),
)
def test_reorder_then_split_property(query_lens: list[int], threshold: int) -> None:
    order = reorder_batch_to_split_decodes_and_prefills(query_lens, decode_threshold=threshold)
    n = len(query_lens)

    # A permutation of the request indices.
    assert sorted(order) == list(range(n))

    # Counted directly from the input.
    decode_idx = [i for i in range(n) if query_lens[i] <= threshold]
    prefill_idx = [i for i in range(n) if query_lens[i] > threshold]
    num_decodes = len(decode_idx)
    decode_tokens = sum(query_lens[i] for i in decode_idx)
    prefill_tokens = sum(query_lens[i] for i in prefill_idx)

    reordered = [query_lens[i] for i in order]
    assert all(q <= threshold for q in reordered[:num_decodes])
    assert all(q > threshold for q in reordered[num_decodes:])
    # Stable within each class: the original indices appear in increasing order.
    assert order[:num_decodes] == decode_idx
    assert order[num_decodes:] == prefill_idx

    md = from_query_lens(reordered)
    assert split_decodes_and_prefills(md, decode_threshold=threshold) == (
        num_decodes,
        n - num_decodes,
        decode_tokens,
        prefill_tokens,
    )

    # The original order splits iff no decode comes after a prefill.
    unordered = any(
        query_lens[i] > threshold and query_lens[j] <= threshold
        for i in range(n)
        for j in range(i + 1, n)
    )
    original = from_query_lens(query_lens)
    if unordered:
        with pytest.raises(ValueError, match="HINT: order requests with reorder_batch"):
            split_decodes_and_prefills(original, decode_threshold=threshold)
    else:
        assert order == list(range(n))
        assert split_decodes_and_prefills(original, decode_threshold=threshold) == (
            num_decodes,
            n - num_decodes,
            decode_tokens,
            prefill_tokens,
        )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        pytest.param("num_actual_tokens", 2.0, id="float-tokens"),
        pytest.param("max_query_len", True, id="bool-max-query"),
        pytest.param("max_seq_len", -1, id="negative-max-seq"),
    ],
)
def test_scalar_fields_must_be_ints(field: str, value: object) -> None:
    good = CommonAttentionMetadata.from_lists(
        query_lens=[1, 1], seq_lens=[3, 4], block_table=[[1], [2]], slot_mapping=[18, 35]
    )
    fields = {f.name: getattr(good, f.name) for f in dataclasses.fields(good)}
    fields[field] = value
    with pytest.raises(ValueError, match=re.escape(f"{field} must be an int >= 0, got {value!r}")):
        CommonAttentionMetadata(**fields)


def test_reorder_accepts_a_tensor_of_query_lens() -> None:
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[4, 1, 1],
        seq_lens=[4, 9, 9],
        block_table=[[1], [2], [3]],
        slot_mapping=[16, 17, 18, 19, 40, 56],
    )
    assert reorder_batch_to_split_decodes_and_prefills(cm.query_lens_cpu) == [1, 2, 0]
