"""``merge_attn_states``: the torch reference against its definition, the Triton kernel
against the torch reference.

The definition: attention over a key set equals the LSE-weighted merge of attention over
any split of that set into two disjoint parts. Under the Triton interpreter (CPU, see
``tests/conftest.py``) the kernel runs slowly, so shapes stay small.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from attnkit.kernels.attention.reference import dense_attention
from attnkit.kernels.merge.reference import merge_attn_states as merge_reference

pytest.importorskip("triton")

from attnkit.kernels.merge.triton import merge_attn_states as merge_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NEG_INF = float("-inf")

# (atol, rtol) of a merged output against the reference fed the same inputs: both
# compute in float32, so the only difference is one rounding of the output to its dtype
# (plus float32 reassociation).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-6, 2e-6),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
}
LSE_TOL = (2e-6, 2e-6)


# ------------------------------------------------------------- reference vs definition


@pytest.mark.parametrize(
    ("num_keys", "split_at", "sinks_on_a"),
    [
        pytest.param(23, 9, False, id="random-split"),
        pytest.param(23, 0, False, id="a-empty"),
        pytest.param(23, 23, False, id="b-empty"),
        pytest.param(1, 1, False, id="one-key"),
        # A sink is one more logit with no value: it belongs to exactly one side.
        pytest.param(30, 12, True, id="sink-on-a"),
    ],
)
def test_reference_merge_equals_attention_over_union(
    num_keys: int, split_at: int, sinks_on_a: bool
) -> None:
    gen = torch.Generator().manual_seed(num_keys * 31 + split_at)
    num_queries, hq, hkv, d = 5, 4, 2, 16
    query = torch.randn(num_queries, hq, d, generator=gen)
    key = torch.randn(num_keys, hkv, d, generator=gen)
    value = torch.randn(num_keys, hkv, d, generator=gen)
    sinks = torch.randn(hq, generator=gen) if sinks_on_a else None
    # Non-causal, so a key's position does not matter and any subset is a valid split.
    kwargs: dict[str, Any] = dict(scale=d**-0.5, causal=False, logits_soft_cap=8.0)
    perm = torch.randperm(num_keys, generator=gen)
    part_a, part_b = perm[:split_at], perm[split_at:]

    full_out, full_lse = dense_attention(query, key, value, sinks=sinks, return_lse=True, **kwargs)
    out_a, lse_a = dense_attention(
        query, key[part_a], value[part_a], sinks=sinks, return_lse=True, **kwargs
    )
    out_b, lse_b = dense_attention(query, key[part_b], value[part_b], return_lse=True, **kwargs)
    if split_at == 0 and not sinks_on_a:
        assert torch.isneginf(lse_a).all()
    if split_at == num_keys:
        assert torch.isneginf(lse_b).all()

    merged_lse = torch.empty_like(full_lse)
    merged = merge_reference(out_a, lse_a, out_b, lse_b, output_lse=merged_lse)
    torch.testing.assert_close(merged, full_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(merged_lse, full_lse, atol=1e-6, rtol=1e-5)


def test_reference_both_empty_and_nan_in_empty_side() -> None:
    out_a = torch.full((3, 2, 4), float("nan"))
    out_b = torch.randn(3, 2, 4)
    lse_a = torch.full((3, 2), NEG_INF)
    lse_b = torch.tensor([[0.5, NEG_INF], [NEG_INF, NEG_INF], [2.0, 1.0]])
    out_b[1] = float("nan")  # row 1: both sides empty, both outs garbage
    merged_lse = torch.empty(3, 2)
    merged = merge_reference(out_a, lse_a, out_b, lse_b, output_lse=merged_lse)
    assert not merged.isnan().any()
    torch.testing.assert_close(merged[0, 0], out_b[0, 0])
    assert (merged[0, 1] == 0).all()
    assert (merged[1] == 0).all()
    torch.testing.assert_close(merged[2], out_b[2])
    torch.testing.assert_close(merged_lse, lse_b)


def test_reference_is_stable_for_huge_lse() -> None:
    out_a, out_b = torch.ones(1, 2, 4), torch.full((1, 2, 4), 3.0)
    lse_a = torch.tensor([[1000.0, -1000.0]])
    lse_b = torch.tensor([[1000.0, -1000.0 + torch.log(torch.tensor(3.0)).item()]])
    merged_lse = torch.empty(1, 2)
    merged = merge_reference(out_a, lse_a, out_b, lse_b, output_lse=merged_lse)
    torch.testing.assert_close(merged[0, 0], torch.full((4,), 2.0))
    torch.testing.assert_close(merged[0, 1], torch.full((4,), 2.5))
    ln2 = torch.log(torch.tensor(2.0)).item()
    ln4 = torch.log(torch.tensor(4.0)).item()
    torch.testing.assert_close(merged_lse, torch.tensor([[1000.0 + ln2, -1000.0 + ln4]]))


# ------------------------------------------------------------------ triton vs reference


def _random_states(
    num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random partial states with -inf on one side, on both, and NaN outs behind -inf."""
    gen = torch.Generator().manual_seed(seed)
    out_a = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    out_b = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    lse_a = torch.randn(num_tokens, num_heads, generator=gen) * 10
    lse_b = torch.randn(num_tokens, num_heads, generator=gen) * 10
    flags = torch.randint(0, 4, (num_tokens, num_heads), generator=gen)
    lse_a[flags == 1] = NEG_INF
    lse_b[flags == 2] = NEG_INF
    lse_a[flags == 3] = NEG_INF
    lse_b[flags == 3] = NEG_INF
    # An empty side's output may be anything; it must not reach the merge.
    out_a[lse_a == NEG_INF] = float("nan")
    out_b[lse_b == NEG_INF] = float("nan")
    assert (flags == 3).any()
    assert (flags == 0).any()
    return out_a, lse_a, out_b, lse_b


def _to(device: torch.device, *ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in ts]


@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "head_dim", "dtype", "out_dtype"),
    [
        pytest.param(7, 4, 32, torch.float32, torch.float32, id="T7-H4-D32-fp32"),
        pytest.param(5, 3, 80, torch.float16, torch.float16, id="T5-H3-D80-fp16"),
        pytest.param(6, 8, 64, torch.bfloat16, torch.bfloat16, id="T6-H8-D64-bf16"),
        # 40 heads of D=128: 16 heads a program, three head tiles, the last partial.
        pytest.param(3, 40, 128, torch.float32, torch.bfloat16, id="T3-H40-D128-fp32-to-bf16"),
        pytest.param(4, 2, 256, torch.float16, torch.float32, id="T4-H2-D256-fp16-to-fp32"),
    ],
)
def test_triton_matches_reference(
    num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    states = _random_states(num_tokens, num_heads, head_dim, dtype, seed=head_dim)
    expected_lse = torch.empty(num_tokens, num_heads)
    expected = merge_reference(
        *states,
        output=torch.empty(num_tokens, num_heads, head_dim, dtype=out_dtype),
        output_lse=expected_lse,
    )
    out_a, lse_a, out_b, lse_b = _to(DEVICE, *states)
    output = torch.full(expected.shape, float("nan"), dtype=out_dtype, device=DEVICE)
    output_lse = torch.full_like(lse_a, float("nan"))
    returned = merge_triton(out_a, lse_a, out_b, lse_b, output=output, output_lse=output_lse)
    assert returned is output
    assert not output.isnan().any()
    atol, rtol = TOLERANCES[out_dtype]
    torch.testing.assert_close(output.cpu(), expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(output_lse.cpu(), expected_lse, atol=LSE_TOL[0], rtol=LSE_TOL[1])
    both_empty = torch.isneginf(states[1]) & torch.isneginf(states[3])
    assert (output.cpu()[both_empty] == 0).all()
    assert torch.isneginf(output_lse.cpu()[both_empty]).all()


def test_triton_strided_inputs_in_place_and_no_lse() -> None:
    out_a, lse_a, out_b, lse_b = _random_states(6, 4, 48, torch.float16, seed=3)
    expected_lse = torch.empty(6, 4)
    expected = merge_reference(out_a, lse_a, out_b, lse_b, output_lse=expected_lse)

    # Views into wider buffers: [T, H, D] slices of [T, H, 2D], lse columns of [T, 2H].
    wide_a = torch.zeros(6, 4, 96, dtype=torch.float16)
    wide_a[..., :48] = out_a
    wide_lse_a = torch.zeros(6, 8)
    wide_lse_a[:, ::2] = lse_a
    view_a = wide_a.to(DEVICE)[..., :48]
    view_lse_a = wide_lse_a.to(DEVICE)[:, ::2]
    assert not view_a.is_contiguous()
    assert not view_lse_a.is_contiguous()
    dev_b, dev_lse_b = _to(DEVICE, out_b.transpose(0, 1).contiguous(), lse_b)
    dev_b = dev_b.transpose(0, 1)  # [T, H, D] with heads outermost in memory

    # In place: the merge overwrites side a.
    returned = merge_triton(
        view_a, view_lse_a, dev_b, dev_lse_b, output=view_a, output_lse=view_lse_a
    )
    assert returned is view_a
    atol, rtol = TOLERANCES[torch.float16]
    torch.testing.assert_close(view_a.cpu(), expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(view_lse_a.cpu(), expected_lse, atol=LSE_TOL[0], rtol=LSE_TOL[1])

    # Without output_lse nothing is written but the output, which is allocated.
    a2, la2, b2, lb2 = _to(DEVICE, out_a, lse_a, out_b, lse_b)
    snapshot = [t.clone() for t in (la2, lb2)]
    fresh = merge_triton(a2, la2, b2, lb2)
    assert fresh.dtype == torch.float16
    assert fresh.shape == out_a.shape
    torch.testing.assert_close(fresh.cpu(), expected, atol=atol, rtol=rtol)
    assert torch.equal(la2, snapshot[0])
    assert torch.equal(lb2, snapshot[1])


def test_triton_empty_batch() -> None:
    out = torch.empty(0, 2, 16, device=DEVICE)
    lse = torch.empty(0, 2, device=DEVICE)
    assert merge_triton(out, lse, out, lse).shape == (0, 2, 16)


# ----------------------------------------------------------------------- validation

_Kwargs = dict[str, Any]
META = torch.device("meta")


def _valid_args() -> _Kwargs:
    return dict(
        out_a=torch.zeros(3, 2, 16, device=DEVICE),
        lse_a=torch.zeros(3, 2, device=DEVICE),
        out_b=torch.zeros(3, 2, 16, device=DEVICE),
        lse_b=torch.zeros(3, 2, device=DEVICE),
    )


def _set(**changes: Callable[[_Kwargs], Any]) -> Callable[[_Kwargs], None]:
    def mutate(args: _Kwargs) -> None:
        for name, make in changes.items():
            args[name] = make(args)

    return mutate


MERGE_ERRORS = [
    pytest.param(
        _set(out_a=lambda a: a["out_a"][0]), r"out_a: expected shape \[T, H, D\]", id="a-2d"
    ),
    pytest.param(
        _set(out_a=lambda a: a["out_a"].double(), out_b=lambda a: a["out_b"].double()),
        "out_a: expected dtype in",
        id="a-fp64",
    ),
    pytest.param(_set(out_b=lambda a: a["out_b"][:2]), "out_b: expected shape", id="b-shape"),
    pytest.param(_set(out_b=lambda a: a["out_b"].half()), "out_b: expected dtype", id="b-dtype"),
    pytest.param(
        _set(out_b=lambda a: a["out_b"].to(META)), "out_b: expected device", id="b-device"
    ),
    pytest.param(
        _set(lse_a=lambda a: a["lse_a"][:, :1]), "lse_a: expected shape", id="lse-a-shape"
    ),
    pytest.param(
        _set(lse_b=lambda a: a["lse_b"].double()),
        "lse_b: expected dtype torch.float32",
        id="lse-b-dtype",
    ),
    pytest.param(
        _set(lse_b=lambda a: a["lse_b"].to(META)), "lse_b: expected device", id="lse-b-device"
    ),
    pytest.param(
        _set(output=lambda a: torch.zeros(3, 2, 8, device=DEVICE)),
        "output: expected shape",
        id="output-shape",
    ),
    pytest.param(
        _set(output=lambda a: a["out_a"].int()), "output: expected dtype in", id="output-int"
    ),
    pytest.param(
        _set(output_lse=lambda a: torch.zeros(3, 2, dtype=torch.float16, device=DEVICE)),
        "output_lse: expected dtype torch.float32",
        id="output-lse-dtype",
    ),
    pytest.param(
        _set(output_lse=lambda a: torch.zeros(3, device=DEVICE)),
        "output_lse: expected shape",
        id="output-lse-shape",
    ),
]


@pytest.mark.parametrize("merge", [merge_reference, merge_triton], ids=["torch", "triton"])
@pytest.mark.parametrize(("mutate", "match"), MERGE_ERRORS)
def test_merge_rejects(
    merge: Callable[..., torch.Tensor], mutate: Callable[[_Kwargs], None], match: str
) -> None:
    args = _valid_args()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        merge(args.pop("out_a"), args.pop("lse_a"), args.pop("out_b"), args.pop("lse_b"), **args)


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_merge_gpu_realistic() -> None:
    states = _random_states(4096, 32, 128, torch.bfloat16, seed=7)
    expected_lse = torch.empty(4096, 32)
    expected = merge_reference(*states, output_lse=expected_lse)
    out_a, lse_a, out_b, lse_b = _to(torch.device("cuda"), *states)
    output_lse = torch.empty_like(lse_a)
    output = merge_triton(out_a, lse_a, out_b, lse_b, output_lse=output_lse)
    atol, rtol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(output.cpu(), expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(output_lse.cpu(), expected_lse, atol=1e-5, rtol=1e-5)
