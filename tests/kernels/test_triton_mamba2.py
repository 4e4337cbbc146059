"""Triton Mamba2 kernels (causal conv1d, chunked SSD, decode steps) against the torch oracles.

Every launcher in ``attnkit.kernels.conv1d.triton`` / ``.mamba2`` is compared with its
oracle (``attnkit.kernels.<op>.reference``) on the same inputs. The cache states are handed in
the way attnkit's runtime does: non-contiguous views into larger pages (whose padding
is NaN, so a kernel that assumed contiguity would read it), with slots in shuffled
order; slots not used by a call must stay bit-for-bit unchanged, and outputs are
pre-filled with NaN.

Without CUDA, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` and the kernels run on
CPU tensors under the Triton interpreter, which is slow: shapes stay small. GPU-marked
tests at the end run realistic sizes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from attnkit.kernels.conv1d import reference as ref_conv
from attnkit.kernels.mamba2 import reference as ref_ssm
from attnkit.testing.tolerances import TOLERANCES

pytest.importorskip("triton")

from attnkit.kernels.conv1d import triton as tri_conv
from attnkit.kernels.mamba2 import triton as tri_ssm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
Activation = Literal["silu"] | None


class Tol(NamedTuple):
    atol: float
    rtol: float


# Output tolerances per dtype of x, in one place. Both sides read the same rounded
# inputs and compute in float32, so float32 differs only by summation order (the
# kernels also use differences of cumulative log-decays where the oracle sums each
# segment); 16-bit outputs may differ by one rounding of the result (fp16: 2**-11,
# bf16: 2**-8 relative), with headroom.
TOLS: dict[torch.dtype, Tol] = {
    torch.float32: Tol(atol=1e-4, rtol=1e-4),
    torch.float16: Tol(atol=2e-3, rtol=2e-3),
    torch.bfloat16: Tol(atol=1.6e-2, rtol=1.6e-2),
}
# The float32 SSM states, whatever the dtype of x (inputs are rounded identically).
STATE_TOL = Tol(atol=1e-4, rtol=1e-4)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

NUM_SLOTS = 8
PAGE_PAD = 5  # extra elements per cache page beyond one state: makes the views strided


# ------------------------------------------------------------------------- helpers


def i32(values: Sequence[int]) -> Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=DEVICE)


def bools(values: Sequence[bool]) -> Tensor:
    return torch.tensor(list(values), dtype=torch.bool, device=DEVICE)


def offsets_of(lengths: Sequence[int]) -> Tensor:
    return i32([0, *itertools.accumulate(lengths)])


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def strided(t: Tensor) -> Tensor:
    """A non-contiguous copy of ``t``: each row of dim 0 sits in a wider, NaN-padded row."""
    rows = t.shape[0]
    width = math.prod(t.shape[1:])
    big = torch.full((rows, width + 3), float("nan"), dtype=t.dtype, device=t.device)
    big[:, :width] = t.reshape(rows, width)
    view = big[:, :width].view(t.shape)
    assert rows < 2 or not view.is_contiguous()
    return view


@dataclass
class Cache:
    """Cache states as the runtime hands them in: views into NaN-padded pages."""

    pages: Tensor  # [S, page]
    states: Tensor  # [S, *shape], a strided view into pages

    @classmethod
    def random(
        cls,
        gen: torch.Generator,
        shape: Sequence[int],
        dtype: torch.dtype,
        num_slots: int = NUM_SLOTS,
    ) -> Cache:
        size = math.prod(shape)
        pages = torch.full((num_slots, size + PAGE_PAD), float("nan"), dtype=dtype, device=DEVICE)
        # Garbage in every slot: a request without an initial state must ignore it.
        pages[:, :size] = randn(gen, num_slots, size, dtype=dtype)
        states = pages[:, :size].view(num_slots, *shape)
        assert size == 0 or not states.is_contiguous()
        return cls(pages, states)

    def check_padding(self) -> None:
        size = math.prod(self.states.shape[1:])
        assert self.pages[:, size:].isnan().all(), "a kernel wrote outside its state"


def assert_close(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    tol = TOLS[dtype]
    assert not actual.isnan().any(), "NaN in the output (an element was never written?)"
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol.atol, rtol=tol.rtol)


def assert_states(actual: Tensor, expected: Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=STATE_TOL.atol, rtol=STATE_TOL.rtol)


def assert_untouched(after: Tensor, before: Tensor, used: Sequence[int]) -> None:
    """Slots not in ``used`` must be bit-for-bit unchanged."""
    others = [s for s in range(before.shape[0]) if s not in set(used)]
    assert torch.equal(after[others], before[others])


def nan_out(like: Tensor) -> Tensor:
    return torch.full_like(like, float("nan"))


# ------------------------------------------------------------------------ conv data


@dataclass
class ConvData:
    x: Tensor  # [T, C], strided
    weight: Tensor
    bias: Tensor | None
    cache: Cache

    @classmethod
    def random(
        cls,
        gen: torch.Generator,
        num_tokens: int,
        *,
        channels: int = 6,
        width: int = 4,
        use_bias: bool = True,
        dtype: torch.dtype = torch.float32,
        num_slots: int = NUM_SLOTS,
    ) -> ConvData:
        return cls(
            x=strided(randn(gen, num_tokens, channels, dtype=dtype)),
            weight=randn(gen, channels, width, dtype=dtype),
            bias=randn(gen, channels, dtype=dtype) if use_bias else None,
            cache=Cache.random(gen, (channels, width - 1), dtype, num_slots),
        )


def check_conv_varlen(
    data: ConvData,
    lengths: Sequence[int],
    slots: Sequence[int],
    flags: Sequence[bool],
    activation: Activation,
) -> None:
    """Triton vs torch on one varlen call; states must match exactly (raw inputs)."""
    states = data.cache.states
    before = states.clone()
    expected_states = states.clone()
    meta: dict[str, Any] = dict(
        query_start_loc=offsets_of(lengths),
        state_indices=i32(slots),
        has_initial_state=bools(flags),
        activation=activation,
    )
    out = nan_out(data.x)
    got = tri_conv.causal_conv1d_varlen(
        data.x, data.weight, data.bias, conv_states=states, out=out, **meta
    )
    assert got is out
    want = ref_conv.causal_conv1d_varlen(
        data.x, data.weight, data.bias, conv_states=expected_states, **meta
    )
    assert_close(out, want, data.x.dtype)
    assert torch.equal(states, expected_states)
    assert_untouched(states, before, slots)
    data.cache.check_padding()


# Requests shorter than W-1 = 3 (1 and 2 tokens) and zero-length ones, with and without
# initial states; slots in shuffled order, two of the eight left untouched.
CONV_LENGTHS = [0, 5, 1, 2, 0, 9]
CONV_SLOTS = [4, 6, 0, 3, 1, 5]
CONV_FLAGS = [True, True, False, True, False, False]


@pytest.mark.parametrize(
    ("width", "use_bias", "activation"),
    [
        pytest.param(4, True, "silu", id="w4-bias-silu"),
        pytest.param(4, False, None, id="w4-nobias-noact"),
        pytest.param(2, True, None, id="w2-bias-noact"),
        pytest.param(1, True, "silu", id="w1-nostate"),
        pytest.param(7, False, "silu", id="w7-all-requests-short"),
    ],
)
def test_conv_varlen_matches_torch(width: int, use_bias: bool, activation: Activation) -> None:
    gen = torch.Generator().manual_seed(width * 10 + use_bias)
    data = ConvData.random(gen, sum(CONV_LENGTHS), width=width, use_bias=use_bias)
    check_conv_varlen(data, CONV_LENGTHS, CONV_SLOTS, CONV_FLAGS, activation)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
def test_conv_varlen_low_precision(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    data = ConvData.random(gen, sum(CONV_LENGTHS), dtype=dtype)
    check_conv_varlen(data, CONV_LENGTHS, CONV_SLOTS, CONV_FLAGS, "silu")


def test_conv_varlen_token_tiles_straddle_requests() -> None:
    """More tokens than one tile (32) and channels than one tile (128), many requests."""
    gen = torch.Generator().manual_seed(4)
    lengths = [7, 0, 30, 2, 1, 13]
    data = ConvData.random(gen, sum(lengths), channels=130)
    check_conv_varlen(
        data, lengths, [7, 1, 2, 5, 0, 3], [True, False, True, True, False, True], "silu"
    )


@pytest.mark.parametrize(
    ("width", "use_bias", "activation", "dtype"),
    [
        pytest.param(4, True, "silu", torch.float32, id="w4-bias-silu-fp32"),
        pytest.param(4, False, None, torch.float32, id="w4-nobias-noact-fp32"),
        pytest.param(2, True, None, torch.float32, id="w2-bias-noact-fp32"),
        pytest.param(1, False, "silu", torch.float32, id="w1-nostate-fp32"),
        pytest.param(4, True, "silu", torch.bfloat16, id="w4-bias-silu-bf16"),
    ],
)
def test_conv_update_matches_torch(
    width: int, use_bias: bool, activation: Activation, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(width + 100 * use_bias)
    slots = [6, 2, 0, 5, 3]
    data = ConvData.random(gen, len(slots), width=width, use_bias=use_bias, dtype=dtype)
    states = data.cache.states
    before = states.clone()
    expected_states = states.clone()
    out = nan_out(data.x)
    got = tri_conv.causal_conv1d_update(
        data.x, data.weight, data.bias, conv_states=states, state_indices=i32(slots),
        activation=activation, out=out,
    )  # fmt: skip
    assert got is out
    want = ref_conv.causal_conv1d_update(
        data.x, data.weight, data.bias, conv_states=expected_states, state_indices=i32(slots),
        activation=activation,
    )  # fmt: skip
    assert_close(out, want, dtype)
    assert torch.equal(states, expected_states)
    assert_untouched(states, before, slots)
    data.cache.check_padding()


# ------------------------------------------------------------------------- SSD data


@dataclass
class SsdData:
    x: Tensor  # [T, H, P], strided
    dt: Tensor  # [T, H]
    A: Tensor  # [H]
    B: Tensor  # [T, G, N], strided
    C: Tensor  # [T, G, N], strided
    D: Tensor | None
    dt_bias: Tensor | None
    dt_softplus: bool
    cache: Cache

    @classmethod
    def random(
        cls,
        gen: torch.Generator,
        num_tokens: int,
        *,
        heads: int = 4,
        head_dim: int = 4,
        groups: int = 2,
        state: int = 8,
        options: str = "full",
        dtype: torch.dtype = torch.float32,
        num_slots: int = NUM_SLOTS,
    ) -> SsdData:
        use_d, use_bias, softplus = SSD_OPTIONS[options]
        dt = torch.rand(num_tokens, heads, generator=gen) * 0.5 + 0.05
        if softplus:  # pre-activation values around softplus^-1 of small steps
            dt = torch.randn(num_tokens, heads, generator=gen) - 1.5
        return cls(
            x=strided(randn(gen, num_tokens, heads, head_dim, dtype=dtype)),
            dt=strided(dt.to(dtype=dtype, device=DEVICE)),
            A=-(torch.rand(heads, generator=gen) + 0.2).to(DEVICE),
            B=strided(randn(gen, num_tokens, groups, state, dtype=dtype)),
            C=strided(randn(gen, num_tokens, groups, state, dtype=dtype)),
            D=randn(gen, heads) if use_d else None,
            dt_bias=randn(gen, heads) * 0.5 if use_bias else None,
            dt_softplus=softplus,
            cache=Cache.random(gen, (heads, head_dim, state), torch.float32, num_slots),
        )

    def params(self) -> dict[str, Any]:
        return dict(D=self.D, dt_bias=self.dt_bias, dt_softplus=self.dt_softplus)

    def rows(self, start: int, end: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        s = slice(start, end)
        return self.x[s], self.dt[s], self.B[s], self.C[s]


# (D, dt_bias, dt_softplus)
SSD_OPTIONS: dict[str, tuple[bool, bool, bool]] = {
    "plain": (False, False, False),
    "full": (True, True, True),
    "d-softplus": (True, False, True),
    "bias-only": (False, True, False),
}


def check_ssd_varlen(
    data: SsdData,
    lengths: Sequence[int],
    slots: Sequence[int],
    flags: Sequence[bool],
    chunk_size: int,
) -> None:
    states = data.cache.states
    before = states.clone()
    expected_states = states.clone()
    meta: dict[str, Any] = dict(
        query_start_loc=offsets_of(lengths),
        state_indices=i32(slots),
        has_initial_state=bools(flags),
        chunk_size=chunk_size,
        **data.params(),
    )
    out = nan_out(data.x)
    got = tri_ssm.ssd_chunked_varlen(
        data.x, data.dt, data.A, data.B, data.C, ssm_states=states, out=out, **meta
    )
    assert got is out
    want = ref_ssm.ssd_chunked_varlen(
        data.x, data.dt, data.A, data.B, data.C, ssm_states=expected_states, **meta
    )
    assert_close(out, want, data.x.dtype)
    assert_states(states, expected_states)
    assert_untouched(states, before, slots)
    data.cache.check_padding()


SSD_LENGTHS = [0, 7, 1, 0, 11, 4]
SSD_SLOTS = [3, 7, 0, 5, 2, 6]
SSD_FLAGS = [True, True, False, False, True, False]


@pytest.mark.parametrize(
    ("chunk_size", "options"),
    [
        pytest.param(1, "full", id="chunk1-full"),
        pytest.param(3, "plain", id="chunk3-plain"),
        pytest.param(3, "full", id="chunk3-full"),
        pytest.param(4, "bias-only", id="chunk4-bias-only"),
        pytest.param(64, "d-softplus", id="chunk64-longer-than-batch"),
    ],
)
def test_ssd_varlen_matches_torch(chunk_size: int, options: str) -> None:
    gen = torch.Generator().manual_seed(chunk_size)
    data = SsdData.random(gen, sum(SSD_LENGTHS), options=options)
    check_ssd_varlen(data, SSD_LENGTHS, SSD_SLOTS, SSD_FLAGS, chunk_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
def test_ssd_varlen_low_precision(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    data = SsdData.random(gen, sum(SSD_LENGTHS), dtype=dtype)
    check_ssd_varlen(data, SSD_LENGTHS, SSD_SLOTS, SSD_FLAGS, 4)


def test_ssd_varlen_multi_tile_chunks() -> None:
    """Chunks of several row tiles, and P (72) and N (80) beyond one tile each."""
    gen = torch.Generator().manual_seed(6)
    lengths = [90, 0, 21]
    data = SsdData.random(gen, sum(lengths), heads=2, head_dim=72, groups=1, state=80)
    check_ssd_varlen(data, lengths, [1, 4, 0], [True, False, False], 70)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
def test_ssd_varlen_16bit_dots_match_float32_oracle(dtype: torch.dtype) -> None:
    """The tensor-core path (x, B, C all 16-bit) against the float32 oracle on the same
    rounded inputs, at Mamba2-like magnitudes: several row, head-dim and state tiles per
    chunk, ragged chunks, cached initial states. Outputs are held to the project's
    tolerance for the dtype (``attnkit.testing.tolerances``) and the float32 states to
    the float32 tolerance: the split ``hi + lo`` operands keep about 16 bits (module doc
    of the Triton kernels), so the states are as accurate as with float32 dots."""
    gen = torch.Generator().manual_seed(31)
    lengths, slots, flags = [150, 0, 83], [6, 0, 3], [True, False, True]
    data = SsdData.random(gen, sum(lengths), heads=2, head_dim=80, groups=1, state=80, dtype=dtype)
    states = data.cache.states
    expected_states = states.clone()
    meta: dict[str, Any] = dict(
        query_start_loc=offsets_of(lengths),
        state_indices=i32(slots),
        has_initial_state=bools(flags),
        chunk_size=128,
        **data.params(),
    )
    got = tri_ssm.ssd_chunked_varlen(
        data.x, data.dt, data.A, data.B, data.C, ssm_states=states, **meta
    )
    want = ref_ssm.ssd_chunked_varlen(
        data.x.float(), data.dt, data.A, data.B.float(), data.C.float(),
        ssm_states=expected_states, **meta,
    )  # fmt: skip
    assert got.dtype == dtype
    assert want.dtype == torch.float32
    tol = TOLERANCES[dtype]
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want.double(), atol=tol.atol, rtol=tol.rtol)
    assert_states(states, expected_states)
    data.cache.check_padding()


@pytest.mark.parametrize("case", ["state", "scores"])
def test_ssd_varlen_fp16_operands_beyond_fp16_range(case: str) -> None:
    """fp16 inputs whose derived dot operands overflow float16 while the outputs do not:
    a cached state near 1e5 read out by a small C ("state"), or scores C.B times dt'
    near 1e5 applied to a small x ("scores"). The kernels scale such tiles down before
    rounding them, so the result matches the float32 oracle to fp16 accuracy."""
    gen = torch.Generator().manual_seed(32)
    lengths, slots = [70, 25], [2, 5]
    data = SsdData.random(gen, sum(lengths), heads=2, head_dim=16, groups=1, state=64)
    states = data.cache.states
    if case == "state":
        x_scale, bc_scale, flags = 1.0, (1.0, 0.002), [True, True]
        states.mul_(1e5)
    else:
        x_scale, bc_scale, flags = 1e-3, (300.0, 300.0), [False, False]
    x = (data.x * x_scale).to(torch.float16)
    B = (data.B * bc_scale[0]).to(torch.float16)
    C = (data.C * bc_scale[1]).to(torch.float16)
    expected_states = states.clone()
    meta: dict[str, Any] = dict(
        query_start_loc=offsets_of(lengths),
        state_indices=i32(slots),
        has_initial_state=bools(flags),
        chunk_size=64,
        **data.params(),
    )
    got = tri_ssm.ssd_chunked_varlen(x, data.dt, data.A, B, C, ssm_states=states, **meta)
    want = ref_ssm.ssd_chunked_varlen(
        x.float(), data.dt, data.A, B.float(), C.float(), ssm_states=expected_states, **meta
    )
    assert got.isfinite().all()
    scale = want.abs().max().item()
    assert 10 < scale < 60000
    torch.testing.assert_close(got.double(), want.double(), atol=4e-3 * scale, rtol=4e-3)
    size = expected_states.abs().max().item()
    torch.testing.assert_close(states, expected_states, atol=1e-4 * size, rtol=1e-4)


def test_ssd_varlen_only_empty_requests() -> None:
    """T = 0: the slots still get their initial state (or zeros)."""
    gen = torch.Generator().manual_seed(7)
    data = SsdData.random(gen, 0)
    check_ssd_varlen(data, [0, 0], [2, 5], [True, False], 8)


@pytest.mark.parametrize(
    ("groups", "options"),
    [
        pytest.param(1, "full", id="G1-full"),
        pytest.param(2, "plain", id="G2-plain"),
        pytest.param(4, "d-softplus", id="G4-d-softplus"),
        pytest.param(2, "bias-only", id="G2-bias-only"),
    ],
)
def test_selective_state_update_matches_torch(groups: int, options: str) -> None:
    gen = torch.Generator().manual_seed(groups * 7)
    slots = [6, 1, 3, 0, 4]
    data = SsdData.random(gen, len(slots), groups=groups, options=options)
    states = data.cache.states
    before = states.clone()
    expected_states = states.clone()
    args = (data.x, data.dt, data.A, data.B, data.C)
    out = nan_out(data.x)
    got = tri_ssm.selective_state_update(
        *args, ssm_states=states, state_indices=i32(slots), out=out, **data.params()
    )
    assert got is out
    want = ref_ssm.selective_state_update(
        *args, ssm_states=expected_states, state_indices=i32(slots), **data.params()
    )
    assert_close(out, want, data.x.dtype)
    assert_states(states, expected_states)
    assert_untouched(states, before, slots)
    data.cache.check_padding()


def test_selective_state_update_wide_state() -> None:
    """A state wider than 128 (N = 300): the decode launcher narrows its head-dim tile
    (BLOCK_P x N stays within its register budget), so P = 40 spans several tiles."""
    gen = torch.Generator().manual_seed(33)
    slots = [4, 1, 6]
    data = SsdData.random(gen, len(slots), heads=2, head_dim=40, groups=1, state=300)
    states = data.cache.states
    before = states.clone()
    expected_states = states.clone()
    args = (data.x, data.dt, data.A, data.B, data.C)
    got = tri_ssm.selective_state_update(
        *args, ssm_states=states, state_indices=i32(slots), **data.params()
    )
    want = ref_ssm.selective_state_update(
        *args, ssm_states=expected_states, state_indices=i32(slots), **data.params()
    )
    assert_close(got, want, torch.float32)
    assert_states(states, expected_states)
    assert_untouched(states, before, slots)
    data.cache.check_padding()


def test_selective_state_update_low_precision() -> None:
    gen = torch.Generator().manual_seed(8)
    slots = [2, 7, 5]
    data = SsdData.random(gen, len(slots), dtype=torch.bfloat16)
    expected_states = data.cache.states.clone()
    args = (data.x, data.dt, data.A, data.B, data.C)
    got = tri_ssm.selective_state_update(
        *args, ssm_states=data.cache.states, state_indices=i32(slots), **data.params()
    )
    want = ref_ssm.selective_state_update(
        *args, ssm_states=expected_states, state_indices=i32(slots), **data.params()
    )
    assert got.dtype == torch.bfloat16
    assert_close(got, want, torch.bfloat16)
    assert_states(data.cache.states, expected_states)


# -------------------------------------------------------------------- continuity

# Two requests (slots 5 and 2) of 10 and 7 tokens, run (a) in one prefill call, (b) in
# three prefill calls (pieces of 0, 1 and 2 tokens included: shorter than W-1 for the
# conv), (c) as a prefill followed by one-token decode steps. All three must give the
# same outputs and final states. A plan is a list of calls; a call gives each request
# its token range (within its own sequence), possibly empty.
CONT_LENGTHS = (10, 7)
CONT_SLOTS = (5, 2)
Plan = list[list[tuple[int, int]]]
ONE_CALL: Plan = [[(0, 10), (0, 7)]]
THREE_CALLS: Plan = [[(0, 1), (0, 2)], [(1, 3), (2, 2)], [(3, 10), (2, 7)]]
PREFILL_THEN_DECODE: Plan = [[(0, 6), (0, 3)]] + [
    [(min(6 + t, 10), min(7 + t, 10)), (min(3 + t, 7), min(4 + t, 7))] for t in range(4)
]
SEQ_STARTS = [0, *itertools.accumulate(CONT_LENGTHS)]


def gather(ranges: list[tuple[int, int]]) -> Tensor:
    """Token indices (into the one-call batch) of a call, request-major."""
    idx = [SEQ_STARTS[b] + i for b, (s, e) in enumerate(ranges) for i in range(s, e)]
    return torch.tensor(idx, dtype=torch.long, device=DEVICE)


def run_plan(
    plan: Plan, step: Callable[[list[tuple[int, int]], bool], Tensor], like: Tensor
) -> Tensor:
    """Run ``step(ranges, continued)`` for each call; outputs back in one-call order."""
    result = nan_out(like)
    for k, ranges in enumerate(plan):
        result[gather(ranges)] = step(ranges, k > 0)
    return result


def live_slots(ranges: list[tuple[int, int]]) -> Tensor:
    return i32([slot for slot, (s, e) in zip(CONT_SLOTS, ranges, strict=True) if e > s])


def lengths_of(ranges: list[tuple[int, int]]) -> list[int]:
    return [e - s for s, e in ranges]


def test_conv_state_continuity() -> None:
    gen = torch.Generator().manual_seed(9)
    data = ConvData.random(gen, sum(CONT_LENGTHS), width=4)
    states = data.cache.states

    def prefill(ranges: list[tuple[int, int]], continued: bool) -> Tensor:
        return tri_conv.causal_conv1d_varlen(
            data.x[gather(ranges)], data.weight, data.bias, conv_states=states,
            query_start_loc=offsets_of(lengths_of(ranges)), state_indices=i32(CONT_SLOTS),
            has_initial_state=bools([continued] * len(ranges)), activation="silu",
        )  # fmt: skip

    def decode(ranges: list[tuple[int, int]], continued: bool) -> Tensor:
        if not continued:
            return prefill(ranges, continued)
        return tri_conv.causal_conv1d_update(
            data.x[gather(ranges)], data.weight, data.bias, conv_states=states,
            state_indices=live_slots(ranges), activation="silu",
        )  # fmt: skip

    results, finals = [], []
    for plan, step in [(ONE_CALL, prefill), (THREE_CALLS, prefill), (PREFILL_THEN_DECODE, decode)]:
        results.append(run_plan(plan, step, data.x))
        finals.append(states[list(CONT_SLOTS)].clone())
    for result, final in zip(results[1:], finals[1:], strict=True):
        assert_close(result, results[0], torch.float32)
        assert torch.equal(final, finals[0])  # raw inputs: exact


def test_ssd_state_continuity() -> None:
    gen = torch.Generator().manual_seed(10)
    data = SsdData.random(gen, sum(CONT_LENGTHS), options="full")
    states = data.cache.states

    def operands(ranges: list[tuple[int, int]]) -> tuple[Tensor, ...]:
        t = gather(ranges)
        return data.x[t], data.dt[t], data.A, data.B[t], data.C[t]

    def prefill(ranges: list[tuple[int, int]], continued: bool) -> Tensor:
        return tri_ssm.ssd_chunked_varlen(
            *operands(ranges), ssm_states=states,
            query_start_loc=offsets_of(lengths_of(ranges)), state_indices=i32(CONT_SLOTS),
            has_initial_state=bools([continued] * len(ranges)), chunk_size=3, **data.params(),
        )  # fmt: skip

    def decode(ranges: list[tuple[int, int]], continued: bool) -> Tensor:
        if not continued:
            return prefill(ranges, continued)
        return tri_ssm.selective_state_update(
            *operands(ranges), ssm_states=states, state_indices=live_slots(ranges),
            **data.params(),
        )  # fmt: skip

    results, finals = [], []
    for plan, step in [(ONE_CALL, prefill), (THREE_CALLS, prefill), (PREFILL_THEN_DECODE, decode)]:
        results.append(run_plan(plan, step, data.x))
        finals.append(states[list(CONT_SLOTS)].clone())
    # The one-call run is also checked against the definition (token-by-token).
    for b, n in enumerate(CONT_LENGTHS):
        seq = slice(SEQ_STARTS[b], SEQ_STARTS[b] + n)
        y, final = ref_ssm.ssd_recurrent_reference(
            data.x[seq], data.dt[seq], data.A, data.B[seq], data.C[seq], **data.params()
        )
        assert_close(results[0][seq], y, torch.float32)
        assert_states(finals[0][b], final)
    for result, final in zip(results[1:], finals[1:], strict=True):
        assert_close(result, results[0], torch.float32)
        assert_states(final, finals[0])


# -------------------------------------------------------------------- hypothesis


@settings(max_examples=8, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    width=st.integers(1, 4),
    chunk_size=st.integers(1, 8),
    options=st.sampled_from(sorted(SSD_OPTIONS)),
    groups=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_random_batches_match_torch(
    lengths: list[int], width: int, chunk_size: int, options: str, groups: int, seed: int
) -> None:
    """A Mamba2 mixer's prefill on a random ragged batch: conv, then SSD."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[: len(lengths)].tolist()
    flags = (torch.rand(len(lengths), generator=gen) < 0.5).tolist()
    conv = ConvData.random(gen, sum(lengths), width=width, use_bias=seed % 2 == 0)
    check_conv_varlen(conv, lengths, slots, flags, "silu" if seed % 3 else None)
    ssd = SsdData.random(gen, sum(lengths), heads=2, groups=groups, options=options)
    check_ssd_varlen(ssd, lengths, slots, flags, chunk_size)


# ------------------------------------------------------------------- launcher API


def test_launchers_never_read_device_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """No .item()/.tolist()/bool(): the launchers must not synchronise with the device."""
    gen = torch.Generator().manual_seed(11)
    conv = ConvData.random(gen, sum(SSD_LENGTHS))
    ssd = SsdData.random(gen, sum(SSD_LENGTHS))
    dec = SsdData.random(gen, 2)
    meta: dict[str, Any] = dict(
        query_start_loc=offsets_of(SSD_LENGTHS),
        state_indices=i32(SSD_SLOTS),
        has_initial_state=bools(SSD_FLAGS),
    )

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a launcher read a device value back to the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(Tensor, name, forbidden)
    tri_conv.causal_conv1d_varlen(
        conv.x, conv.weight, conv.bias, conv_states=conv.cache.states, **meta
    )
    tri_conv.causal_conv1d_update(
        conv.x[:2], conv.weight, conv.bias, conv_states=conv.cache.states, state_indices=i32([1, 0])
    )
    tri_ssm.ssd_chunked_varlen(
        ssd.x, ssd.dt, ssd.A, ssd.B, ssd.C, ssm_states=ssd.cache.states, chunk_size=4,
        **meta, **ssd.params(),
    )  # fmt: skip
    tri_ssm.selective_state_update(
        dec.x, dec.dt, dec.A, dec.B, dec.C, ssm_states=dec.cache.states,
        state_indices=i32([1, 0]), **dec.params(),
    )  # fmt: skip


def conv_call(**overrides: Any) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(12)
    data = ConvData.random(gen, 5)
    kwargs: dict[str, Any] = dict(
        x=data.x, weight=data.weight, bias=data.bias, conv_states=data.cache.states,
        query_start_loc=offsets_of([2, 3]), state_indices=i32([0, 1]),
        has_initial_state=bools([True, False]), activation="silu",
    )  # fmt: skip
    kwargs.update(overrides)
    return lambda: tri_conv.causal_conv1d_varlen(**kwargs)


def conv_update_call(**overrides: Any) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(13)
    data = ConvData.random(gen, 2)
    kwargs: dict[str, Any] = dict(
        x=data.x, weight=data.weight, bias=data.bias, conv_states=data.cache.states,
        state_indices=i32([0, 1]), activation="silu",
    )  # fmt: skip
    kwargs.update(overrides)
    return lambda: tri_conv.causal_conv1d_update(**kwargs)


def ssd_call(**overrides: Any) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(14)
    data = SsdData.random(gen, 5)
    kwargs: dict[str, Any] = dict(
        x=data.x, dt=data.dt, A=data.A, B=data.B, C=data.C, ssm_states=data.cache.states,
        query_start_loc=offsets_of([2, 3]), state_indices=i32([0, 1]),
        has_initial_state=bools([True, False]), chunk_size=4, **data.params(),
    )  # fmt: skip
    kwargs.update(overrides)
    return lambda: tri_ssm.ssd_chunked_varlen(**kwargs)


def update_call(**overrides: Any) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(15)
    data = SsdData.random(gen, 2)
    kwargs: dict[str, Any] = dict(
        x=data.x, dt=data.dt, A=data.A, B=data.B, C=data.C, ssm_states=data.cache.states,
        state_indices=i32([0, 1]), **data.params(),
    )  # fmt: skip
    kwargs.update(overrides)
    return lambda: tri_ssm.selective_state_update(**kwargs)


META = torch.device("meta")


@pytest.mark.parametrize(
    ("make_call", "match"),
    [
        pytest.param(
            lambda: conv_call(x=torch.zeros(5, 6, dtype=torch.float64, device=DEVICE)),
            r"x: expected dtype in",
            id="conv-x-float64",
        ),
        pytest.param(
            lambda: conv_call(conv_states=torch.zeros(2, 6, 3, dtype=torch.float16, device=DEVICE)),
            r"conv_states: expected the dtype of x \(torch.float32\)",
            id="conv-state-dtype",
        ),
        pytest.param(
            lambda: conv_call(conv_states=torch.zeros(2, 6, 2, device=DEVICE)),
            r"conv_states: expected shape \[S, C, W-1\] = \[\*, 6, 3\], got \[2, 6, 2\]",
            id="conv-state-shape",
        ),
        pytest.param(
            lambda: conv_call(conv_states=torch.zeros(2, 6, 3, device=META)),
            r"conv_states: expected a tensor on device",
            id="conv-state-device",
        ),
        pytest.param(
            lambda: conv_call(query_start_loc=offsets_of([2, 3]).long()),
            r"query_start_loc: expected dtype torch.int32, got torch.int64",
            id="conv-qsl-dtype",
        ),
        pytest.param(
            lambda: conv_call(query_start_loc=i32([0])),
            r"query_start_loc: expected at least one request for T = 5",
            id="conv-qsl-empty",
        ),
        pytest.param(
            lambda: conv_call(state_indices=i32([0, 1, 2])),
            r"state_indices: expected shape \[B\] = \[2\], got \[3\]",
            id="conv-slots-shape",
        ),
        pytest.param(
            lambda: conv_call(has_initial_state=i32([1, 0])),
            r"has_initial_state: expected dtype torch.bool",
            id="conv-flags-dtype",
        ),
        pytest.param(
            lambda: conv_call(activation="relu"),
            r"activation: expected 'silu' or None, got 'relu'",
            id="conv-activation",
        ),
        pytest.param(
            lambda: conv_call(out=torch.zeros(5, 6, dtype=torch.float16, device=DEVICE)),
            r"out: expected the dtype of x \(torch.float32\), got torch.float16",
            id="conv-out-dtype",
        ),
        pytest.param(
            lambda: conv_call(out=torch.zeros(5, 7, device=DEVICE)),
            r"out: expected shape \[T, C\] = \[5, 6\], got \[5, 7\]",
            id="conv-out-shape",
        ),
        pytest.param(
            lambda: conv_update_call(weight=torch.zeros(5, 4, device=DEVICE)),
            r"weight: expected shape \[C, W\] = \[6, \*\], got \[5, 4\]",
            id="update-weight",
        ),
        pytest.param(
            lambda: conv_update_call(state_indices=i32([0])),
            r"state_indices: expected shape \[B\] = \[2\], got \[1\]",
            id="update-slots",
        ),
        pytest.param(
            lambda: ssd_call(
                ssm_states=torch.zeros(2, 4, 4, 8, dtype=torch.bfloat16, device=DEVICE)
            ),
            r"ssm_states: expected dtype torch.float32, got torch.bfloat16",
            id="ssd-state-dtype",
        ),
        pytest.param(
            lambda: ssd_call(ssm_states=torch.zeros(2, 4, 4, 9, device=DEVICE)),
            r"ssm_states: expected shape \[S, H, P, N\] = \[\*, 4, 4, 8\]",
            id="ssd-state-shape",
        ),
        pytest.param(
            lambda: ssd_call(chunk_size=0),
            r"chunk_size: expected an int >= 1, got 0",
            id="ssd-chunk-0",
        ),
        pytest.param(
            lambda: ssd_call(chunk_size=True),
            r"chunk_size: expected an int >= 1, got True",
            id="ssd-chunk-bool",
        ),
        pytest.param(
            lambda: ssd_call(
                B=torch.zeros(5, 3, 8, device=DEVICE), C=torch.zeros(5, 3, 8, device=DEVICE)
            ),
            r"B: expected the number of groups G to divide the number of heads H",
            id="ssd-groups",
        ),
        pytest.param(
            lambda: ssd_call(dt=torch.zeros(5, 3, device=DEVICE)),
            r"dt: expected shape \[T, H\] = \[5, 4\], got \[5, 3\]",
            id="ssd-dt-shape",
        ),
        pytest.param(
            lambda: ssd_call(has_initial_state=bools([True])),
            r"has_initial_state: expected shape \[B\] = \[2\], got \[1\]",
            id="ssd-flags-shape",
        ),
        pytest.param(
            lambda: ssd_call(out=torch.zeros(5, 4, 4, dtype=torch.bfloat16, device=DEVICE)),
            r"out: expected the dtype of x",
            id="ssd-out-dtype",
        ),
        pytest.param(
            lambda: update_call(D=torch.zeros(3, device=DEVICE)),
            r"D: expected shape \[H\] = \[4\], got \[3\]",
            id="update-D-shape",
        ),
        pytest.param(
            lambda: update_call(x=torch.zeros(2, 4, 4, dtype=torch.float64, device=DEVICE)),
            r"x: expected dtype in",
            id="update-x-float64",
        ),
        pytest.param(
            lambda: update_call(state_indices=offsets_of([1]).long()[:2]),
            r"state_indices: expected dtype torch.int32",
            id="update-slots-dtype",
        ),
    ],
)
def test_launcher_errors(make_call: Callable[[], Callable[[], object]], match: str) -> None:
    call = make_call()
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# A Mamba2-2.7B-like layer: H = 32 heads of P = 64, state N = 128, G = 8 groups; the
# conv runs over x, B and C together (C = H P + 2 G N channels).
GPU_H, GPU_P, GPU_N, GPU_G, GPU_W = 32, 64, 128, 8, 4
GPU_CHANNELS = GPU_H * GPU_P + 2 * GPU_G * GPU_N
GPU_LENGTHS = [1000, 0, 37, 3059]  # T = 4096
GPU_SLOTS = [5, 1, 7, 2]
GPU_FLAGS = [True, False, True, False]


@contextmanager
def forbid_device_sync() -> Iterator[None]:
    """Any torch op that waits for the device raises (the launchers must not)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("chunk_size", [256, 100])
def test_gpu_prefill_realistic(dtype: torch.dtype, chunk_size: int) -> None:
    gen = torch.Generator().manual_seed(20)
    num_tokens = sum(GPU_LENGTHS)
    conv = ConvData.random(gen, num_tokens, channels=GPU_CHANNELS, width=GPU_W, dtype=dtype)
    check_conv_varlen(conv, GPU_LENGTHS, GPU_SLOTS, GPU_FLAGS, "silu")
    ssd = SsdData.random(
        gen, num_tokens, heads=GPU_H, head_dim=GPU_P, groups=GPU_G, state=GPU_N, dtype=dtype
    )
    check_ssd_varlen(ssd, GPU_LENGTHS, GPU_SLOTS, GPU_FLAGS, chunk_size)


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_realistic_and_sync_free() -> None:
    """64 decode requests in shuffled slots of 128; then all launchers, with no sync."""
    gen = torch.Generator().manual_seed(21)
    batch, num_slots = 64, 128
    slots = torch.randperm(num_slots, generator=gen)[:batch].tolist()
    conv = ConvData.random(
        gen, batch, channels=GPU_CHANNELS, width=GPU_W, dtype=torch.bfloat16, num_slots=num_slots
    )
    ssd = SsdData.random(
        gen, batch, heads=GPU_H, head_dim=GPU_P, groups=GPU_G, state=GPU_N,
        dtype=torch.bfloat16, num_slots=num_slots,
    )  # fmt: skip
    conv_states, ssm_states = conv.cache.states, ssd.cache.states
    conv_before, ssm_before = conv_states.clone(), ssm_states.clone()
    conv_want_states, ssm_want_states = conv_states.clone(), ssm_states.clone()

    conv_out, ssd_out = nan_out(conv.x), nan_out(ssd.x)
    tri_conv.causal_conv1d_update(
        conv.x, conv.weight, conv.bias, conv_states=conv_states, state_indices=i32(slots),
        out=conv_out,
    )  # fmt: skip
    tri_ssm.selective_state_update(
        ssd.x, ssd.dt, ssd.A, ssd.B, ssd.C, ssm_states=ssm_states, state_indices=i32(slots),
        out=ssd_out, **ssd.params(),
    )  # fmt: skip
    conv_want = ref_conv.causal_conv1d_update(
        conv.x, conv.weight, conv.bias, conv_states=conv_want_states, state_indices=i32(slots)
    )
    ssd_want = ref_ssm.selective_state_update(
        ssd.x, ssd.dt, ssd.A, ssd.B, ssd.C, ssm_states=ssm_want_states,
        state_indices=i32(slots), **ssd.params(),
    )  # fmt: skip
    assert_close(conv_out, conv_want, torch.bfloat16)
    assert torch.equal(conv_states, conv_want_states)
    assert_untouched(conv_states, conv_before, slots)
    assert_close(ssd_out, ssd_want, torch.bfloat16)
    assert_states(ssm_states, ssm_want_states)
    assert_untouched(ssm_states, ssm_before, slots)

    # Prefill launchers too, once compiled (above for decode, here before the check).
    prefill = SsdData.random(gen, 64, heads=GPU_H, head_dim=GPU_P, groups=GPU_G, state=GPU_N)
    meta: dict[str, Any] = dict(
        query_start_loc=offsets_of([20, 0, 44]),
        state_indices=i32([3, 0, 1]),
        has_initial_state=bools([True, False, True]),
    )

    def launch_all() -> None:
        tri_conv.causal_conv1d_varlen(
            conv.x, conv.weight, conv.bias, conv_states=conv_states, out=conv_out, **meta
        )
        tri_conv.causal_conv1d_update(
            conv.x, conv.weight, conv.bias, conv_states=conv_states, state_indices=i32(slots),
            out=conv_out,
        )  # fmt: skip
        tri_ssm.ssd_chunked_varlen(
            prefill.x, prefill.dt, prefill.A, prefill.B, prefill.C,
            ssm_states=prefill.cache.states, chunk_size=16, **meta, **prefill.params(),
        )  # fmt: skip
        tri_ssm.selective_state_update(
            ssd.x, ssd.dt, ssd.A, ssd.B, ssd.C, ssm_states=ssm_states,
            state_indices=i32(slots), out=ssd_out, **ssd.params(),
        )  # fmt: skip

    launch_all()
    with forbid_device_sync():
        launch_all()
    torch.cuda.synchronize()


def test_precomputed_chunk_offsets_give_the_same_result() -> None:
    from attnkit.kernels.mamba2.triton import ssd_chunk_offsets
    from attnkit.kernels.mamba2.triton import ssd_chunked_varlen as tri_ssd

    gen = torch.Generator().manual_seed(11)
    lens = [5, 0, 9]
    t, h, p, g, n = sum(lens), 2, 4, 1, 4
    qsl = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    x = torch.randn(t, h, p, generator=gen)
    dt = torch.randn(t, h, generator=gen)
    a = -torch.rand(h, generator=gen)
    b = torch.randn(t, g, n, generator=gen)
    c = torch.randn(t, g, n, generator=gen)
    slots = torch.tensor([2, 0, 1], dtype=torch.int32)
    flags = torch.tensor([False, False, False])
    kwargs = dict(
        D=None,
        dt_bias=None,
        dt_softplus=True,
        query_start_loc=qsl,
        state_indices=slots,
        has_initial_state=flags,
        chunk_size=4,
    )
    offsets = ssd_chunk_offsets(qsl, t, 4)
    assert offsets.tolist() == [0, 2, 2, 5]
    s1, s2 = torch.zeros(3, h, p, n), torch.zeros(3, h, p, n)
    y1 = tri_ssd(x, dt, a, b, c, ssm_states=s1, **kwargs)  # type: ignore[arg-type]  # test input built loosely or wrong on purpose
    y2 = tri_ssd(x, dt, a, b, c, ssm_states=s2, cu_chunks=offsets, **kwargs)  # type: ignore[arg-type]  # test input built loosely or wrong on purpose
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    torch.testing.assert_close(s1, s2, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"cu_chunks: expected int32 \[B\+1\]=\[4\]"):
        tri_ssd(x, dt, a, b, c, ssm_states=s2, cu_chunks=offsets.long(), **kwargs)  # type: ignore[arg-type]  # test input built loosely or wrong on purpose


def test_oracle_and_launchers_share_one_contract() -> None:
    """The operand checks live in ``kernels.mamba2.contract``; the Triton module takes
    nothing from the torch oracle's module (a reference and a Triton kernel never import
    each other)."""
    import ast
    import inspect

    from attnkit.kernels.mamba2 import contract

    assert ref_ssm.check_ssm_inputs is contract.check_ssm_inputs
    assert tri_ssm.check_ssm_inputs is contract.check_ssm_inputs
    assert ref_ssm.check_ssm_states is contract.check_ssm_states
    assert tri_ssm.check_ssm_states is contract.check_ssm_states
    tree = ast.parse(inspect.getsource(tri_ssm))
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not any(m.endswith(".reference") for m in imported), imported
