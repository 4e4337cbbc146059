"""Tests for the pure-torch Mamba2 references: causal conv1d and SSD with cached states.

The conv is checked against an explicit per-token window sum written here; the chunked
SSD against ``ssd_recurrent_reference`` (the token-by-token definition). Continuity
tests run one sequence as one call, as three prefill chunks, and as a prefill followed
by decode steps, with the state passing through a cache slot each time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from attnkit.kernels.conv1d.reference import causal_conv1d_update, causal_conv1d_varlen
from attnkit.kernels.mamba2.reference import (
    selective_state_update,
    ssd_chunked_varlen,
    ssd_recurrent_reference,
)


class Tol(NamedTuple):
    atol: float
    rtol: float


# Tolerances per input dtype, all in one place. float32: only the order of float32
# accumulation differs. float16/bfloat16: both sides read the same rounded inputs and
# accumulate in float32, so the gap is mostly one rounding of the output (bf16 has an
# 8-bit mantissa, fp16 an 11-bit one), with some headroom.
TOLS: dict[torch.dtype, Tol] = {
    torch.float32: Tol(atol=1e-4, rtol=1e-4),
    torch.float16: Tol(atol=4e-3, rtol=4e-3),
    torch.bfloat16: Tol(atol=3e-2, rtol=3e-2),
}
# The float32 states after a low-precision run: looser than float32, tighter than outputs.
STATE_TOLS: dict[torch.dtype, Tol] = {
    torch.float32: Tol(atol=1e-4, rtol=1e-4),
    torch.float16: Tol(atol=1e-3, rtol=1e-3),
    torch.bfloat16: Tol(atol=1e-3, rtol=1e-3),
}

NUM_SLOTS = 7
Activation = Literal["silu"] | None


def i32(values: Sequence[int]) -> Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


def bools(values: Sequence[bool]) -> Tensor:
    return torch.tensor(list(values), dtype=torch.bool)


def offsets_of(lengths: Sequence[int]) -> Tensor:
    return i32([0, *itertools.accumulate(lengths)])


def assert_close(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    tol = TOLS[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol.atol, rtol=tol.rtol)


def assert_state_close(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    tol = STATE_TOLS[dtype]
    torch.testing.assert_close(actual, expected, atol=tol.atol, rtol=tol.rtol)


def assert_untouched(after: Tensor, before: Tensor, used: Sequence[int]) -> None:
    """Slots not in ``used`` must be bit-for-bit unchanged."""
    others = [s for s in range(before.shape[0]) if s not in set(used)]
    assert torch.equal(after[others], before[others])


def split_lengths(total: int, cuts: tuple[int, int]) -> list[tuple[int, int]]:
    """Split ``[0, total)`` into 3 pieces at fractions ``cuts`` (in 1/10ths)."""
    a = total * cuts[0] // 10
    b = max(a, total * cuts[1] // 10)
    return [(0, a), (a, b), (b, total)]


# ----------------------------------------------------------------------------------
# Causal conv1d
# ----------------------------------------------------------------------------------


def naive_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, prev: Tensor, activation: Activation
) -> tuple[Tensor, Tensor]:
    """Explicit window sum for one request in float64.

    ``x`` ``[L, C]``, ``prev`` ``[C, W-1]`` (oldest first). Returns the output ``[L, C]``
    and the new state ``[C, W-1]``.
    """
    channels, width = weight.shape
    stream = [prev[:, k].double() for k in range(width - 1)]
    stream += [x[t].double() for t in range(x.shape[0])]
    outputs = []
    for t in range(x.shape[0]):
        acc = bias.double() if bias is not None else torch.zeros(channels, dtype=torch.float64)
        for k in range(width):
            acc = acc + weight[:, k].double() * stream[t + k]
        outputs.append(F.silu(acc) if activation == "silu" else acc)
    out = torch.stack(outputs) if outputs else torch.zeros(0, channels, dtype=torch.float64)
    tail = stream[len(stream) - (width - 1) :]
    state = torch.stack(tail, dim=1) if tail else torch.zeros(channels, 0, dtype=torch.float64)
    return out, state


@dataclass
class ConvData:
    x: Tensor
    weight: Tensor
    bias: Tensor | None
    conv_states: Tensor


def make_conv(
    gen: torch.Generator,
    num_tokens: int,
    *,
    channels: int = 6,
    width: int = 4,
    use_bias: bool = True,
    dtype: torch.dtype = torch.float32,
) -> ConvData:
    x = torch.randn(num_tokens, channels, generator=gen).to(dtype)
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    bias = torch.randn(channels, generator=gen).to(dtype) if use_bias else None
    # Garbage in every slot: slots without an initial state must ignore it.
    conv_states = torch.randn(NUM_SLOTS, channels, width - 1, generator=gen).to(dtype)
    return ConvData(x, weight, bias, conv_states)


def check_conv_against_naive(
    data: ConvData,
    lengths: Sequence[int],
    slots: Sequence[int],
    flags: Sequence[bool],
    activation: Activation,
) -> None:
    before = data.conv_states.clone()
    out = causal_conv1d_varlen(
        data.x,
        data.weight,
        data.bias,
        conv_states=data.conv_states,
        query_start_loc=offsets_of(lengths),
        state_indices=i32(slots),
        has_initial_state=bools(flags),
        activation=activation,
    )
    assert out.dtype == data.x.dtype
    assert out.shape == data.x.shape
    starts = offsets_of(lengths).tolist()
    for b, slot in enumerate(slots):
        prev = before[slot] if flags[b] else torch.zeros_like(before[slot])
        seg = slice(starts[b], starts[b + 1])
        want_out, want_state = naive_conv(data.x[seg], data.weight, data.bias, prev, activation)
        assert_close(out[seg], want_out, data.x.dtype)
        # The state holds raw inputs: it must be exact.
        assert torch.equal(data.conv_states[slot].double(), want_state)
    assert_untouched(data.conv_states, before, slots)


CONV_LENGTHS = [5, 1, 2, 0, 9]  # with W = 4: three requests shorter than W-1 = 3
CONV_SLOTS = [5, 0, 3, 6, 2]
CONV_FLAGS = [True, False, True, True, False]


@pytest.mark.parametrize(
    ("width", "use_bias", "activation"),
    [
        pytest.param(4, True, "silu", id="w4-bias-silu"),
        pytest.param(4, False, "silu", id="w4-nobias-silu"),
        pytest.param(4, True, None, id="w4-bias-noact"),
        pytest.param(4, False, None, id="w4-nobias-noact"),
        pytest.param(2, True, "silu", id="w2-bias-silu"),
        pytest.param(1, True, None, id="w1-nostate"),
        pytest.param(7, False, "silu", id="w7-all-requests-short"),
    ],
)
def test_conv_varlen_matches_naive(width: int, use_bias: bool, activation: Activation) -> None:
    gen = torch.Generator().manual_seed(width * 10 + use_bias)
    data = make_conv(gen, sum(CONV_LENGTHS), width=width, use_bias=use_bias)
    check_conv_against_naive(data, CONV_LENGTHS, CONV_SLOTS, CONV_FLAGS, activation)


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.bfloat16, id="bf16"),
        pytest.param(torch.float16, id="fp16"),
    ],
)
def test_conv_varlen_low_precision(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    data = make_conv(gen, sum(CONV_LENGTHS), dtype=dtype)
    check_conv_against_naive(data, CONV_LENGTHS, CONV_SLOTS, CONV_FLAGS, "silu")


@pytest.mark.parametrize(
    "first_has_state",
    [pytest.param(True, id="initial-state"), pytest.param(False, id="from-zeros")],
)
def test_conv_continuity(first_has_state: bool) -> None:
    """One call == three prefill chunks == prefill + decode steps, via the cache slots."""
    gen = torch.Generator().manual_seed(7)
    lengths, slots = [9, 4, 11], [4, 1, 6]
    data = make_conv(gen, sum(lengths))
    starts = offsets_of(lengths).tolist()
    xs = [data.x[starts[b] : starts[b + 1]] for b in range(len(lengths))]
    first_flags = bools([first_has_state] * len(lengths))

    def varlen(cache: Tensor, pieces: list[Tensor], flags: Tensor) -> list[Tensor]:
        out = causal_conv1d_varlen(
            torch.cat(pieces),
            data.weight,
            data.bias,
            conv_states=cache,
            query_start_loc=offsets_of([p.shape[0] for p in pieces]),
            state_indices=i32(slots),
            has_initial_state=flags,
            activation="silu",
        )
        return list(torch.split(out, [p.shape[0] for p in pieces]))

    # 1. One call.
    cache_one = data.conv_states.clone()
    out_one = varlen(cache_one, xs, first_flags)

    # 2. Three prefill calls (the middle piece of request 0 is empty).
    cache_three = data.conv_states.clone()
    cuts = [(3, 3), (2, 6), (5, 9)]
    pieces = [split_lengths(len(x), c) for x, c in zip(xs, cuts, strict=True)]
    outs_three: list[list[Tensor]] = [[] for _ in xs]
    for step in range(3):
        flags = first_flags if step == 0 else bools([True] * len(xs))
        chunk = [x[pc[step][0] : pc[step][1]] for x, pc in zip(xs, pieces, strict=True)]
        for b, o in enumerate(varlen(cache_three, chunk, flags)):
            outs_three[b].append(o)

    # 3. Prefill the first piece, then one token per decode step.
    cache_dec = data.conv_states.clone()
    prefill = [pc[0][1] for pc in pieces]
    outs_dec = [
        [o]
        for o in varlen(cache_dec, [x[:n] for x, n in zip(xs, prefill, strict=True)], first_flags)
    ]
    for t in range(max(lengths)):
        live = [b for b in range(len(xs)) if prefill[b] + t < lengths[b]]
        if not live:
            break
        y = causal_conv1d_update(
            torch.stack([xs[b][prefill[b] + t] for b in live]),
            data.weight,
            data.bias,
            conv_states=cache_dec,
            state_indices=i32([slots[b] for b in live]),
            activation="silu",
        )
        for row, b in enumerate(live):
            outs_dec[b].append(y[row : row + 1])

    for b in range(len(xs)):
        assert_close(torch.cat(outs_three[b]), out_one[b], torch.float32)
        assert_close(torch.cat(outs_dec[b]), out_one[b], torch.float32)
    assert torch.equal(cache_three, cache_one)
    assert torch.equal(cache_dec, cache_one)
    assert_untouched(cache_one, data.conv_states, slots)


# ----------------------------------------------------------------------------------
# Mamba2 SSD
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SsmConfig:
    heads: int = 4
    head_dim: int = 3
    groups: int = 2
    state: int = 5
    use_d: bool = True
    use_dt_bias: bool = True
    softplus: bool = True


@dataclass
class SsmData:
    x: Tensor
    dt: Tensor
    A: Tensor
    B: Tensor
    C: Tensor
    D: Tensor | None
    dt_bias: Tensor | None
    softplus: bool
    ssm_states: Tensor

    def operands(self, rows: slice | Tensor | None = None) -> dict[str, Any]:
        """Per-token operands (optionally a subset of rows) plus the per-head ones."""

        def pick(t: Tensor) -> Tensor:
            return t if rows is None else t[rows]

        return {
            "x": pick(self.x),
            "dt": pick(self.dt),
            "A": self.A,
            "B": pick(self.B),
            "C": pick(self.C),
            "D": self.D,
            "dt_bias": self.dt_bias,
            "dt_softplus": self.softplus,
        }


def make_ssm(
    gen: torch.Generator, num_tokens: int, cfg: SsmConfig, dtype: torch.dtype = torch.float32
) -> SsmData:
    h, p, g, n = cfg.heads, cfg.head_dim, cfg.groups, cfg.state
    if cfg.softplus:
        dt = torch.randn(num_tokens, h, generator=gen)
        dt_bias = torch.randn(h, generator=gen) * 0.5
    else:  # keep dt' positive without the softplus
        dt = torch.rand(num_tokens, h, generator=gen) * 0.5 + 0.05
        dt_bias = torch.rand(h, generator=gen) * 0.1
    return SsmData(
        x=torch.randn(num_tokens, h, p, generator=gen).to(dtype),
        dt=dt.to(dtype),
        A=-(torch.rand(h, generator=gen) + 0.5),
        B=torch.randn(num_tokens, g, n, generator=gen).to(dtype),
        C=torch.randn(num_tokens, g, n, generator=gen).to(dtype),
        D=torch.randn(h, generator=gen) if cfg.use_d else None,
        dt_bias=dt_bias if cfg.use_dt_bias else None,
        softplus=cfg.softplus,
        ssm_states=torch.randn(NUM_SLOTS, h, p, n, generator=gen),
    )


def check_ssd_against_recurrent(
    data: SsmData,
    lengths: Sequence[int],
    slots: Sequence[int],
    flags: Sequence[bool],
    chunk_size: int,
) -> None:
    dtype = data.x.dtype
    before = data.ssm_states.clone()
    y = ssd_chunked_varlen(
        **data.operands(),
        query_start_loc=offsets_of(lengths),
        ssm_states=data.ssm_states,
        state_indices=i32(slots),
        has_initial_state=bools(flags),
        chunk_size=chunk_size,
    )
    assert y.dtype == dtype
    assert y.shape == data.x.shape
    starts = offsets_of(lengths).tolist()
    for b, slot in enumerate(slots):
        seg = slice(starts[b], starts[b + 1])
        want_y, want_state = ssd_recurrent_reference(
            **data.operands(seg), initial_state=before[slot] if flags[b] else None
        )
        assert_close(y[seg], want_y, dtype)
        assert_state_close(data.ssm_states[slot], want_state, dtype)
    assert_untouched(data.ssm_states, before, slots)


SSD_LENGTHS = [12, 1, 0, 7, 16]
SSD_SLOTS = [3, 6, 0, 5, 1]
SSD_FLAGS = [True, False, True, True, False]


@pytest.mark.parametrize(
    "chunk_size",
    [
        pytest.param(1, id="chunk1"),
        pytest.param(5, id="chunk5-not-dividing"),
        pytest.param(8, id="chunk8"),
        pytest.param(64, id="chunk64-longer-than-seqs"),
    ],
)
@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param(SsmConfig(), id="G2<H4-D-bias-softplus"),
        pytest.param(SsmConfig(groups=1), id="G1-D-bias-softplus"),
        pytest.param(SsmConfig(groups=4), id="G=H"),
        pytest.param(
            SsmConfig(use_d=False, use_dt_bias=False, softplus=False), id="plain-no-D-bias-softplus"
        ),
        pytest.param(SsmConfig(use_d=False, softplus=True), id="no-D"),
        pytest.param(SsmConfig(use_dt_bias=False, softplus=True), id="no-dt-bias"),
    ],
)
def test_ssd_chunked_matches_recurrent(cfg: SsmConfig, chunk_size: int) -> None:
    gen = torch.Generator().manual_seed(chunk_size)
    data = make_ssm(gen, sum(SSD_LENGTHS), cfg)
    check_ssd_against_recurrent(data, SSD_LENGTHS, SSD_SLOTS, SSD_FLAGS, chunk_size)


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")],
)
@pytest.mark.parametrize(
    "chunk_size", [pytest.param(4, id="chunk4"), pytest.param(64, id="chunk64")]
)
def test_ssd_chunked_low_precision(dtype: torch.dtype, chunk_size: int) -> None:
    gen = torch.Generator().manual_seed(3)
    data = make_ssm(gen, sum(SSD_LENGTHS), SsmConfig(), dtype=dtype)
    check_ssd_against_recurrent(data, SSD_LENGTHS, SSD_SLOTS, SSD_FLAGS, chunk_size)


def test_ssd_reference_is_the_formula() -> None:
    """Pin the definition itself on a tiny case written out by hand."""
    x = torch.tensor([[[1.0]], [[2.0]]])  # L=2, H=1, P=1
    dt = torch.tensor([[0.5], [0.25]])
    A = torch.tensor([-2.0])
    B = torch.tensor([[[1.0]], [[3.0]]])  # G=1, N=1
    C = torch.tensor([[[2.0]], [[-1.0]]])
    D = torch.tensor([0.5])
    h0 = torch.tensor([[[4.0]]])
    y, h = ssd_recurrent_reference(x, dt, A, B, C, D=D, initial_state=h0)
    h1 = torch.exp(torch.tensor(-1.0)) * 4.0 + 0.5 * 1.0 * 1.0
    h2 = torch.exp(torch.tensor(-0.5)) * h1 + 0.25 * 2.0 * 3.0
    torch.testing.assert_close(y.flatten(), torch.stack([h1 * 2 + 0.5, -h2 + 1.0]))
    torch.testing.assert_close(h.flatten(), h2.reshape(1))


@pytest.mark.parametrize(
    "first_has_state",
    [pytest.param(True, id="initial-state"), pytest.param(False, id="from-zeros")],
)
def test_ssd_continuity(first_has_state: bool) -> None:
    """One call == three prefill chunks == prefill + decode steps, via the cache slots."""
    gen = torch.Generator().manual_seed(11)
    lengths, slots, chunk_size = [9, 4, 13], [4, 1, 6], 4
    data = make_ssm(gen, sum(lengths), SsmConfig())
    starts = offsets_of(lengths).tolist()
    rows = [torch.arange(starts[b], starts[b + 1]) for b in range(len(lengths))]
    first_flags = bools([first_has_state] * len(lengths))

    def varlen(cache: Tensor, picks: list[Tensor], flags: Tensor) -> list[Tensor]:
        sizes = [len(p) for p in picks]
        y = ssd_chunked_varlen(
            **data.operands(torch.cat(picks)),
            query_start_loc=offsets_of(sizes),
            ssm_states=cache,
            state_indices=i32(slots),
            has_initial_state=flags,
            chunk_size=chunk_size,
        )
        return list(torch.split(y, sizes))

    cache_one = data.ssm_states.clone()
    y_one = varlen(cache_one, rows, first_flags)

    cache_three = data.ssm_states.clone()
    cuts = [(3, 3), (2, 6), (5, 9)]
    pieces = [split_lengths(len(r), c) for r, c in zip(rows, cuts, strict=True)]
    ys_three: list[list[Tensor]] = [[] for _ in rows]
    for step in range(3):
        flags = first_flags if step == 0 else bools([True] * len(rows))
        picks = [r[pc[step][0] : pc[step][1]] for r, pc in zip(rows, pieces, strict=True)]
        for b, y in enumerate(varlen(cache_three, picks, flags)):
            ys_three[b].append(y)

    cache_dec = data.ssm_states.clone()
    prefill = [pc[0][1] for pc in pieces]
    picks = [r[:n] for r, n in zip(rows, prefill, strict=True)]
    ys_dec = [[y] for y in varlen(cache_dec, picks, first_flags)]
    for t in range(max(lengths)):
        live = [b for b in range(len(rows)) if prefill[b] + t < lengths[b]]
        if not live:
            break
        y = selective_state_update(
            **data.operands(torch.stack([rows[b][prefill[b] + t] for b in live])),
            ssm_states=cache_dec,
            state_indices=i32([slots[b] for b in live]),
        )
        for row, b in enumerate(live):
            ys_dec[b].append(y[row : row + 1])

    for b in range(len(rows)):
        assert_close(torch.cat(ys_three[b]), y_one[b], torch.float32)
        assert_close(torch.cat(ys_dec[b]), y_one[b], torch.float32)
    assert_state_close(cache_three, cache_one, torch.float32)
    assert_state_close(cache_dec, cache_one, torch.float32)
    assert_untouched(cache_one, data.ssm_states, slots)
    assert_untouched(cache_three, data.ssm_states, slots)
    assert_untouched(cache_dec, data.ssm_states, slots)


def test_selective_state_update_matches_recurrent_step() -> None:
    gen = torch.Generator().manual_seed(5)
    data = make_ssm(gen, 3, SsmConfig(groups=1))
    slots = [6, 2, 4]
    before = data.ssm_states.clone()
    y = selective_state_update(
        **data.operands(), ssm_states=data.ssm_states, state_indices=i32(slots)
    )
    for b, slot in enumerate(slots):
        want_y, want_state = ssd_recurrent_reference(
            **data.operands(slice(b, b + 1)), initial_state=before[slot]
        )
        assert_close(y[b : b + 1], want_y, torch.float32)
        torch.testing.assert_close(data.ssm_states[slot], want_state)
    assert_untouched(data.ssm_states, before, slots)


# ----------------------------------------------------------------------------------
# Property test over small ragged batches (conv and SSD together)
# ----------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    width=st.integers(1, 4),
    chunk_size=st.integers(1, 6),
    heads_groups=st.sampled_from([(1, 1), (2, 1), (4, 2), (4, 4)]),
    flags=st.lists(st.booleans(), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_ragged_batches_match_definitions(
    lengths: list[int],
    width: int,
    chunk_size: int,
    heads_groups: tuple[int, int],
    flags: list[bool],
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[: len(lengths)].tolist()
    flags = flags[: len(lengths)]
    conv = make_conv(gen, sum(lengths), channels=3, width=width)
    check_conv_against_naive(conv, lengths, slots, flags, "silu")
    heads, groups = heads_groups
    ssm = make_ssm(gen, sum(lengths), SsmConfig(heads=heads, groups=groups, head_dim=2, state=3))
    check_ssd_against_recurrent(ssm, lengths, slots, flags, chunk_size)


# ----------------------------------------------------------------------------------
# Error paths
# ----------------------------------------------------------------------------------

Mutation = Callable[[dict[str, Any]], None]


def conv_varlen_kwargs() -> dict[str, Any]:
    data = make_conv(torch.Generator().manual_seed(0), 5)
    return {
        "x": data.x,
        "weight": data.weight,
        "bias": data.bias,
        "conv_states": data.conv_states,
        "query_start_loc": i32([0, 2, 5]),
        "state_indices": i32([3, 1]),
        "has_initial_state": bools([True, False]),
        "activation": "silu",
    }


def ssd_varlen_kwargs() -> dict[str, Any]:
    data = make_ssm(torch.Generator().manual_seed(0), 5, SsmConfig())
    return {
        **data.operands(),
        "ssm_states": data.ssm_states,
        "query_start_loc": i32([0, 2, 5]),
        "state_indices": i32([3, 1]),
        "has_initial_state": bools([True, False]),
        "chunk_size": 4,
    }


def _set(**changes: Any) -> Mutation:
    return lambda kwargs: kwargs.update(changes)


def _edit(name: str, fn: Callable[[Any], Any]) -> Mutation:
    def mutate(kwargs: dict[str, Any]) -> None:
        kwargs[name] = fn(kwargs[name])

    return mutate


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        pytest.param(_edit("x", lambda t: t[:, 0]), r"x: expected shape \[T, C\]", id="x-rank"),
        pytest.param(
            _edit("x", lambda t: t.long()), r"x: expected a floating-point dtype", id="x-int"
        ),
        pytest.param(
            _edit("weight", lambda t: t[:3]),
            r"weight: expected shape \[C, W\] = \[6, \*\], got \[3, 4\]",
            id="weight-channels",
        ),
        pytest.param(
            _edit("bias", lambda t: t[:2]), r"bias: expected shape \[C\]", id="bias-shape"
        ),
        pytest.param(
            _edit("conv_states", lambda t: t[..., :2]),
            r"conv_states: expected shape \[S, C, W-1\] = \[\*, 6, 3\]",
            id="state-width",
        ),
        pytest.param(
            _edit("conv_states", lambda t: t.double()),
            r"conv_states: expected the dtype of x \(torch.float32\), got torch.float64",
            id="state-dtype",
        ),
        pytest.param(
            _set(query_start_loc=torch.tensor([0, 2, 5])),
            r"query_start_loc: expected dtype torch.int32, got torch.int64",
            id="qsl-int64",
        ),
        pytest.param(
            _set(query_start_loc=i32([0, 2, 4])),
            r"query_start_loc: expected last offset .* T = 5, got 4",
            id="qsl-last",
        ),
        pytest.param(
            _set(query_start_loc=i32([1, 2, 5])),
            r"query_start_loc: expected first offset 0, got 1",
            id="qsl-first",
        ),
        pytest.param(
            _set(
                query_start_loc=i32([0, 3, 2, 5]),
                state_indices=i32([0, 1, 2]),
                has_initial_state=bools([True] * 3),
            ),
            r"query_start_loc: expected non-decreasing",
            id="qsl-decreasing",
        ),
        pytest.param(
            _set(state_indices=i32([3, 7])),
            r"state_indices: expected slots in \[0, S\) = \[0, 7\), got out-of-range values \[7\]",
            id="slot-too-big",
        ),
        pytest.param(
            _set(state_indices=i32([-1, 0])),
            r"state_indices: .*out-of-range values \[-1\]",
            id="slot-negative",
        ),
        pytest.param(
            _set(state_indices=i32([2, 2])),
            r"state_indices: expected distinct slots",
            id="slot-duplicate",
        ),
        pytest.param(
            _set(state_indices=i32([2])),
            r"state_indices: expected shape \[B\] = \[2\], got \[1\]",
            id="slots-length",
        ),
        pytest.param(
            _set(state_indices=torch.tensor([3, 1])),
            r"state_indices: expected dtype torch.int32",
            id="slots-int64",
        ),
        pytest.param(
            _set(has_initial_state=i32([1, 0])),
            r"has_initial_state: expected dtype torch.bool, got torch.int32",
            id="flags-dtype",
        ),
        pytest.param(
            _set(activation="relu"),
            r"activation: expected 'silu' or None, got 'relu'",
            id="activation",
        ),
    ],
)
def test_conv_varlen_errors(mutate: Mutation, match: str) -> None:
    kwargs = conv_varlen_kwargs()
    mutate(kwargs)
    with pytest.raises(ValueError, match=match):
        causal_conv1d_varlen(**kwargs)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        pytest.param(_edit("x", lambda t: t[None]), r"x: expected shape \[B, C\]", id="x-rank"),
        pytest.param(
            _set(state_indices=i32([0, 1, 2])),
            r"state_indices: expected shape \[B\] = \[2\], got \[3\]",
            id="slots-length",
        ),
        pytest.param(
            _set(state_indices=i32([0, 9])),
            r"state_indices: .*out-of-range values \[9\]",
            id="slot-out-of-range",
        ),
        pytest.param(_set(activation="gelu"), r"activation: expected", id="activation"),
    ],
)
def test_conv_update_errors(mutate: Mutation, match: str) -> None:
    data = make_conv(torch.Generator().manual_seed(0), 2)
    kwargs: dict[str, Any] = {
        "x": data.x,
        "weight": data.weight,
        "bias": data.bias,
        "conv_states": data.conv_states,
        "state_indices": i32([0, 1]),
        "activation": "silu",
    }
    mutate(kwargs)
    with pytest.raises(ValueError, match=match):
        causal_conv1d_update(**kwargs)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        pytest.param(
            _edit("x", lambda t: t[..., 0]), r"x: expected shape \[T, H, P\]", id="x-rank"
        ),
        pytest.param(
            _edit("dt", lambda t: t[:, :2]),
            r"dt: expected shape \[T, H\] = \[5, 4\], got \[5, 2\]",
            id="dt-shape",
        ),
        pytest.param(
            _edit("A", lambda t: t[:3]), r"A: expected shape \[H\] = \[4\], got \[3\]", id="A-shape"
        ),
        pytest.param(
            _edit("B", lambda t: t[:4]),
            r"B: expected shape \[T, G, N\] = \[5, \*, \*\], got \[4, 2, 5\]",
            id="B-tokens",
        ),
        pytest.param(
            _edit("C", lambda t: t[..., :3]),
            r"C: expected shape \[T, G, N\] = \[5, 2, 5\], got \[5, 2, 3\]",
            id="C-mismatch",
        ),
        pytest.param(
            _set(B=torch.randn(5, 3, 5), C=torch.randn(5, 3, 5)),
            r"G = 3, H = 4",
            id="H-not-multiple-of-G",
        ),
        pytest.param(_set(D=torch.randn(4, 3)), r"D: expected shape \[H\]", id="D-shape"),
        pytest.param(
            _set(dt_bias=torch.randn(2)),
            r"dt_bias: expected shape \[H\] = \[4\], got \[2\]",
            id="dt-bias-shape",
        ),
        pytest.param(
            _edit("ssm_states", lambda t: t.bfloat16()),
            r"ssm_states: expected dtype torch.float32, got torch.bfloat16",
            id="states-bf16",
        ),
        pytest.param(
            _edit("ssm_states", lambda t: t[..., :4]),
            r"ssm_states: expected shape \[S, H, P, N\] = \[\*, 4, 3, 5\]",
            id="states-shape",
        ),
        pytest.param(
            _set(chunk_size=0), r"chunk_size: expected an int >= 1, got 0", id="chunk-zero"
        ),
        pytest.param(
            _set(chunk_size=2.0), r"chunk_size: expected an int >= 1, got 2.0", id="chunk-float"
        ),
        pytest.param(
            _set(chunk_size=True), r"chunk_size: expected an int >= 1, got True", id="chunk-bool"
        ),
        pytest.param(
            _set(state_indices=i32([3, 12])),
            r"state_indices: .*out-of-range values \[12\]",
            id="slot-out-of-range",
        ),
        pytest.param(
            _set(query_start_loc=i32([0, 5])),
            r"state_indices: expected shape \[B\] = \[1\], got \[2\]",
            id="batch-mismatch",
        ),
        pytest.param(
            _set(has_initial_state=bools([True])),
            r"has_initial_state: expected shape \[B\] = \[2\], got \[1\]",
            id="flags-length",
        ),
    ],
)
def test_ssd_varlen_errors(mutate: Mutation, match: str) -> None:
    kwargs = ssd_varlen_kwargs()
    mutate(kwargs)
    with pytest.raises(ValueError, match=match):
        ssd_chunked_varlen(**kwargs)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        pytest.param(_edit("x", lambda t: t[0]), r"x: expected shape \[B, H, P\]", id="x-rank"),
        pytest.param(
            _edit("ssm_states", lambda t: t.half()),
            r"ssm_states: expected dtype torch.float32",
            id="states-fp16",
        ),
        pytest.param(
            _set(state_indices=i32([0, 1, 7])),
            r"state_indices: .*out-of-range values \[7\]",
            id="slot-out-of-range",
        ),
    ],
)
def test_selective_state_update_errors(mutate: Mutation, match: str) -> None:
    data = make_ssm(torch.Generator().manual_seed(0), 3, SsmConfig())
    kwargs: dict[str, Any] = {
        **data.operands(),
        "ssm_states": data.ssm_states,
        "state_indices": i32([0, 1, 2]),
    }
    mutate(kwargs)
    with pytest.raises(ValueError, match=match):
        selective_state_update(**kwargs)


def test_recurrent_reference_errors() -> None:
    data = make_ssm(torch.Generator().manual_seed(0), 3, SsmConfig())
    with pytest.raises(
        ValueError, match=r"initial_state: expected shape \[H, P, N\] = \[4, 3, 5\]"
    ):
        ssd_recurrent_reference(**data.operands(), initial_state=torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"x: expected shape \[L, H, P\]"):
        ssd_recurrent_reference(**{**data.operands(), "x": data.x[0]})


def test_ssd_group_mapping() -> None:
    """Head ``h`` reads group ``h // (H // G)``: pinned by expanding B/C to G = H by hand."""
    gen = torch.Generator().manual_seed(13)
    cfg = SsmConfig(heads=6, groups=3)
    data = make_ssm(gen, 10, cfg)
    per_head = [h // (cfg.heads // cfg.groups) for h in range(cfg.heads)]
    grouped, _ = ssd_recurrent_reference(**data.operands())
    expanded, _ = ssd_recurrent_reference(
        **{**data.operands(), "B": data.B[:, per_head], "C": data.C[:, per_head]}
    )
    assert_close(grouped, expanded, torch.float32)
