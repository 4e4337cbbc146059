"""Tests for the LFM2-style gated short convolution: torch oracle and Triton kernels.

Both implementations are checked against an explicit per-token loop written here
(``y = c * (bias + sum_k w[:, k] * Bx[t - (W-1) + k])`` with ``Bx = b * x`` and the
request's stored ``Bx`` history prepended). Triton runs under its interpreter on CPU
(``tests/conftest.py``): shapes are small. Tests marked ``gpu`` run realistic sizes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from attnkit.kernels.short_conv import reference as torch_sc
from attnkit.kernels.short_conv import triton as triton_sc

IMPLS: dict[str, ModuleType] = {"torch": torch_sc, "triton": triton_sc}


class Tol(NamedTuple):
    atol: float
    rtol: float


# float32: only the order of the W-term float32 sums differs. bfloat16: the oracle rounds
# the conv output before the output gate and again after it, the Triton kernel once;
# both convolve the same rounded Bx, so the gap is a rounding or two of the output.
TOLS: dict[torch.dtype, Tol] = {
    torch.float32: Tol(atol=1e-5, rtol=1e-5),
    torch.bfloat16: Tol(atol=3e-2, rtol=3e-2),
}

NUM_SLOTS = 8


def i32(values: Sequence[int]) -> Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


def bools(values: Sequence[bool]) -> Tensor:
    return torch.tensor(list(values), dtype=torch.bool)


def offsets_of(lengths: Sequence[int]) -> Tensor:
    return i32([0, *itertools.accumulate(lengths)])


def bits(t: Tensor) -> Tensor:
    """The raw bytes of ``t`` (NaN compares equal to the same NaN)."""
    dense = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return dense.view(torch.uint8)


def assert_close(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    tol = TOLS[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol.atol, rtol=tol.rtol)


# ----------------------------------------------------------------------------------
# The explicit definition
# ----------------------------------------------------------------------------------


def naive_short_conv(
    b: Tensor, c: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, prev: Tensor
) -> tuple[Tensor, Tensor]:
    """One request, token by token, in float64.

    ``b``, ``c``, ``x`` ``[L, C]``; ``prev`` ``[C, W-1]`` (oldest first). ``Bx`` is rounded
    to the dtype of ``x`` (what the kernels convolve and store). Returns ``y`` ``[L, C]``
    (float64) and the new state ``[C, W-1]`` in the dtype of ``x``.
    """
    channels, width = weight.shape
    bx = (b.double() * x.double()).to(x.dtype)
    stream = [prev[:, k] for k in range(width - 1)] + [bx[t] for t in range(x.shape[0])]
    ys = []
    for t in range(x.shape[0]):
        acc = torch.zeros(channels, dtype=torch.float64)
        if bias is not None:
            acc = acc + bias.double()
        for k in range(width):
            acc = acc + weight[:, k].double() * stream[t + k].double()
        ys.append(c[t].double() * acc)
    y = torch.stack(ys) if ys else torch.zeros(0, channels, dtype=torch.float64)
    tail = stream[len(stream) - (width - 1) :]
    state = torch.stack(tail, dim=1) if tail else torch.zeros(channels, 0, dtype=x.dtype)
    return y, state


# ----------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------


@dataclass
class ConvStates:
    """A ``[S, C, W-1]`` view inside a larger buffer, NaN in each page's padding."""

    buf: Tensor
    view: Tensor


def make_conv_states(
    gen: torch.Generator,
    channels: int,
    width: int,
    dtype: torch.dtype,
    *,
    layout: str = "strided",
    device: str = "cpu",
) -> ConvStates:
    """``layout``: ``"strided"`` (rows of a larger page), ``"transposed"`` (the page stores
    ``[W-1, C]``, channels innermost) or ``"contiguous"``."""
    n = channels * (width - 1)
    pad = 0 if layout == "contiguous" else 3
    buf = torch.full((NUM_SLOTS, n + pad), float("nan"))
    buf[:, :n] = torch.randn(NUM_SLOTS, n, generator=gen)
    buf = buf.to(device=device, dtype=dtype)
    if layout == "transposed":
        view = buf[:, :n].view(NUM_SLOTS, width - 1, channels).transpose(1, 2)
    else:
        view = buf[:, :n].view(NUM_SLOTS, channels, width - 1)
    return ConvStates(buf, view)


def clone_states(states: ConvStates) -> ConvStates:
    """A copy of the buffer with the same view into it."""
    buf = states.buf.clone()
    view = states.view
    return ConvStates(buf, buf.as_strided(view.shape, view.stride(), view.storage_offset()))


@dataclass
class Inputs:
    b: Tensor
    c: Tensor
    x: Tensor
    weight: Tensor
    bias: Tensor | None


def make_inputs(
    gen: torch.Generator,
    num_tokens: int,
    channels: int,
    width: int,
    *,
    use_bias: bool = False,
    dtype: torch.dtype = torch.float32,
    strided: bool = False,
    device: str = "cpu",
) -> Inputs:
    """``strided``: b, c, x are slices of one ``[T, 3C]`` projection, as in LFM2."""
    if strided:
        bcx = torch.randn(num_tokens, 3 * channels, generator=gen).to(device=device, dtype=dtype)
        b, c, x = bcx[:, :channels], bcx[:, channels : 2 * channels], bcx[:, 2 * channels :]
    else:
        b, c, x = (
            torch.randn(num_tokens, channels, generator=gen).to(device=device, dtype=dtype)
            for _ in range(3)
        )
    weight = torch.randn(channels, width, generator=gen).to(device=device, dtype=dtype)
    bias = torch.randn(channels, generator=gen).to(device=device, dtype=dtype) if use_bias else None
    return Inputs(b, c, x, weight, bias)


def run_varlen(
    impl: ModuleType,
    inp: Inputs,
    states: Tensor,
    lengths: Sequence[int],
    slots: Sequence[int],
    flags: Sequence[bool],
    out: Tensor | None = None,
) -> Tensor:
    dev = inp.x.device
    result: Tensor = impl.short_conv_varlen(
        inp.b,
        inp.c,
        inp.x,
        inp.weight,
        inp.bias,
        conv_states=states,
        query_start_loc=offsets_of(lengths).to(dev),
        state_indices=i32(slots).to(dev),
        has_initial_state=bools(flags).to(dev),
        out=out,
    )
    return result


def run_update(impl: ModuleType, inp: Inputs, states: Tensor, slots: Sequence[int]) -> Tensor:
    result: Tensor = impl.short_conv_update(
        inp.b,
        inp.c,
        inp.x,
        inp.weight,
        inp.bias,
        conv_states=states,
        state_indices=i32(slots).to(inp.x.device),
    )
    return result


def check_varlen(
    impl: ModuleType,
    gen: torch.Generator,
    lengths: Sequence[int],
    slots: Sequence[int],
    flags: Sequence[bool],
    *,
    channels: int = 6,
    width: int = 4,
    use_bias: bool = False,
    dtype: torch.dtype = torch.float32,
    layout: str = "strided",
    strided_inputs: bool = False,
) -> None:
    """One varlen call against the loop: outputs, exact states, untouched slots/padding."""
    inp = make_inputs(
        gen, sum(lengths), channels, width, use_bias=use_bias, dtype=dtype, strided=strided_inputs
    )
    states = make_conv_states(gen, channels, width, dtype, layout=layout)
    for slot, flag in zip(slots, flags, strict=True):
        if not flag:  # never read: NaN would poison the result if it were
            states.view[slot] = float("nan")
    before = states.buf.clone()
    view_before = states.view.clone()
    out = torch.full((sum(lengths), channels), float("nan"), dtype=dtype)
    result = run_varlen(impl, inp, states.view, lengths, slots, flags, out=out)
    assert result is out
    assert not out.isnan().any()
    starts = offsets_of(lengths).tolist()
    for r, slot in enumerate(slots):
        seg = slice(starts[r], starts[r + 1])
        prev = view_before[slot] if flags[r] else torch.zeros_like(view_before[slot])
        want_y, want_state = naive_short_conv(
            inp.b[seg], inp.c[seg], inp.x[seg], inp.weight, inp.bias, prev
        )
        assert_close(out[seg], want_y, dtype)
        # The state holds rounded Bx values, computed the same way on every side: exact.
        assert torch.equal(bits(states.view[slot]), bits(want_state))
    untouched = [s for s in range(NUM_SLOTS) if s not in set(slots)]
    assert torch.equal(bits(states.buf[untouched]), bits(before[untouched]))
    n = channels * (width - 1)
    assert torch.equal(bits(states.buf[:, n:]), bits(before[:, n:]))  # page padding


# With W = 4: requests of 1 and 2 tokens are shorter than W-1 = 3.
LENGTHS = [5, 1, 0, 2, 40, 0]
SLOTS = [6, 1, 3, 0, 4, 7]
FLAGS = [True, True, False, True, False, True]


# ----------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_hand_computed_case(impl: str) -> None:
    """C = 1, W = 3, w = [1, 2, 3], stored history [5, 7].

    Bx = [1*1, 2*1] = [1, 2]; stream [5, 7, 1, 2]:
    y0 = 1 * (0.5 + 5*1 + 7*2 + 1*3) = 22.5,  y1 = 2 * (0.5 + 7*1 + 1*2 + 2*3) = 31.
    The slot then holds [1, 2].
    """
    mod = IMPLS[impl]
    b = torch.tensor([[1.0], [2.0]])
    c = torch.tensor([[1.0], [2.0]])
    x = torch.tensor([[1.0], [1.0]])
    weight = torch.tensor([[1.0, 2.0, 3.0]])
    states = torch.tensor([[[-1.0, -1.0]], [[5.0, 7.0]]])
    y = mod.short_conv_varlen(
        b,
        c,
        x,
        weight,
        torch.tensor([0.5]),
        conv_states=states,
        query_start_loc=i32([0, 2]),
        state_indices=i32([1]),
        has_initial_state=bools([True]),
    )
    torch.testing.assert_close(y, torch.tensor([[22.5], [31.0]]))
    torch.testing.assert_close(states, torch.tensor([[[-1.0, -1.0]], [[1.0, 2.0]]]))
    # One decode step with b = 3, x = 1, c = -1, no bias: y = -(1*1 + 2*2 + 3*3) = -14.
    y = mod.short_conv_update(
        torch.tensor([[3.0]]),
        torch.tensor([[-1.0]]),
        torch.tensor([[1.0]]),
        weight,
        conv_states=states,
        state_indices=i32([1]),
    )
    torch.testing.assert_close(y, torch.tensor([[-14.0]]))
    torch.testing.assert_close(states, torch.tensor([[[-1.0, -1.0]], [[2.0, 3.0]]]))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize(
    ("width", "use_bias", "layout", "strided_inputs"),
    [
        pytest.param(4, False, "strided", False, id="w4"),
        pytest.param(4, True, "transposed", True, id="w4-bias-transposed-strided-inputs"),
        pytest.param(3, True, "contiguous", False, id="w3-bias"),
        pytest.param(2, False, "transposed", True, id="w2"),
        pytest.param(1, True, "contiguous", False, id="w1-stateless"),
        pytest.param(8, False, "strided", False, id="w8-most-requests-short"),
    ],
)
def test_varlen_matches_definition(
    impl: str, width: int, use_bias: bool, layout: str, strided_inputs: bool
) -> None:
    gen = torch.Generator().manual_seed(width * 10 + use_bias)
    check_varlen(
        IMPLS[impl],
        gen,
        LENGTHS,
        SLOTS,
        FLAGS,
        width=width,
        use_bias=use_bias,
        layout=layout,
        strided_inputs=strided_inputs,
    )


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_bfloat16(impl: str) -> None:
    gen = torch.Generator().manual_seed(2)
    check_varlen(
        IMPLS[impl],
        gen,
        LENGTHS,
        SLOTS,
        FLAGS,
        channels=70,
        use_bias=True,
        dtype=torch.bfloat16,
        layout="transposed",
    )


def test_triton_matches_torch_many_channels() -> None:
    """Several channel tiles and token tiles per request; states bit-identical."""
    gen = torch.Generator().manual_seed(3)
    lengths, slots, flags = [70, 3, 33], [2, 7, 4], [True, False, True]
    inp = make_inputs(gen, sum(lengths), 150, 3, use_bias=True, strided=True)
    s_torch = make_conv_states(gen, 150, 3, torch.float32, layout="transposed")
    s_triton = clone_states(s_torch)
    y_torch = run_varlen(torch_sc, inp, s_torch.view, lengths, slots, flags)
    y_triton = run_varlen(triton_sc, inp, s_triton.view, lengths, slots, flags)
    torch.testing.assert_close(y_triton, y_torch, atol=1e-5, rtol=1e-5)
    assert torch.equal(bits(s_triton.buf), bits(s_torch.buf))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_empty_batches(impl: str) -> None:
    """B = 0 is a no-op; T = 0 with B > 0 keeps initial states or stores zeros."""
    mod = IMPLS[impl]
    gen = torch.Generator().manual_seed(4)
    inp = make_inputs(gen, 0, 6, 4)
    states = make_conv_states(gen, 6, 4, torch.float32)
    before = states.buf.clone()
    y = run_varlen(mod, inp, states.view, [], [], [])
    assert y.shape == (0, 6)
    assert torch.equal(bits(states.buf), bits(before))
    run_varlen(mod, inp, states.view, [0, 0], [3, 5], [True, False])
    assert torch.equal(bits(states.buf[3]), bits(before[3]))
    assert torch.equal(states.view[5], torch.zeros(6, 3))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize(("width", "use_bias"), [(4, True), (1, False)])
def test_update_matches_definition(impl: str, width: int, use_bias: bool) -> None:
    gen = torch.Generator().manual_seed(5 + width)
    inp = make_inputs(gen, 3, 6, width, use_bias=use_bias, strided=True)
    states = make_conv_states(gen, 6, width, torch.float32, layout="transposed")
    slots = [5, 0, 2]
    before = states.buf.clone()
    view_before = states.view.clone()
    out = torch.full((3, 6), float("nan"))
    result = IMPLS[impl].short_conv_update(
        inp.b,
        inp.c,
        inp.x,
        inp.weight,
        inp.bias,
        conv_states=states.view,
        state_indices=i32(slots),
        out=out,
    )
    assert result is out
    for r, slot in enumerate(slots):
        want_y, want_state = naive_short_conv(
            inp.b[r : r + 1],
            inp.c[r : r + 1],
            inp.x[r : r + 1],
            inp.weight,
            inp.bias,
            view_before[slot],
        )
        assert_close(out[r], want_y[0], torch.float32)
        assert torch.equal(bits(states.view[slot]), bits(want_state))
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(bits(states.buf[untouched]), bits(before[untouched]))
    n = 6 * (width - 1)
    assert torch.equal(bits(states.buf[:, n:]), bits(before[:, n:]))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("first_has_state", [False, True])
def test_continuity(impl: str, first_has_state: bool) -> None:
    """One call == three prefill calls (one shorter than W-1) == prefill + decode."""
    mod = IMPLS[impl]
    gen = torch.Generator().manual_seed(6 + first_has_state)
    channels, width, length, slot = 5, 4, 12, 2
    inp = make_inputs(gen, length, channels, width, use_bias=True)
    init = make_conv_states(gen, channels, width, torch.float32).view

    def sub(a: int, b: int) -> Inputs:
        return Inputs(inp.b[a:b], inp.c[a:b], inp.x[a:b], inp.weight, inp.bias)

    one = init.clone()
    y_one = run_varlen(mod, inp, one, [length], [slot], [first_has_state])

    three = init.clone()
    pieces = [(0, 4), (4, 5), (5, 12)]
    y_three = torch.cat(
        [
            run_varlen(mod, sub(a, b), three, [b - a], [slot], [first_has_state or i > 0])
            for i, (a, b) in enumerate(pieces)
        ]
    )

    steps = init.clone()
    ys = [run_varlen(mod, sub(0, 2), steps, [2], [slot], [first_has_state])]
    ys += [run_update(mod, sub(t, t + 1), steps, [slot]) for t in range(2, length)]
    y_steps = torch.cat(ys)

    prev = init[slot] if first_has_state else torch.zeros_like(init[slot])
    want_y, want_state = naive_short_conv(inp.b, inp.c, inp.x, inp.weight, inp.bias, prev)
    for y, states in ((y_one, one), (y_three, three), (y_steps, steps)):
        assert_close(y, want_y, torch.float32)
        assert torch.equal(states[slot], want_state)


@settings(max_examples=8, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    width=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    impl=st.sampled_from(["torch", "triton"]),
)
def test_random_ragged_batches(lengths: list[int], width: int, seed: int, impl: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[: len(lengths)].tolist()
    flags = (torch.rand(len(lengths), generator=gen) < 0.5).tolist()
    check_varlen(
        IMPLS[impl], gen, lengths, slots, flags, channels=5, width=width, use_bias=seed % 2 == 0
    )


# ----------------------------------------------------------------------------------
# Launcher errors
# ----------------------------------------------------------------------------------

Mutation = Callable[[dict[str, Any]], None]


def _varlen_kwargs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(9)
    inp = make_inputs(gen, 4, 6, 3)
    return {
        "b": inp.b,
        "c": inp.c,
        "x": inp.x,
        "weight": inp.weight,
        "bias": None,
        "conv_states": torch.zeros(3, 6, 2),
        "query_start_loc": i32([0, 1, 4]),
        "state_indices": i32([0, 2]),
        "has_initial_state": bools([True, False]),
    }


def _set(**changes: Any) -> Mutation:
    def mutate(kw: dict[str, Any]) -> None:
        kw.update(changes)

    return mutate


def _with(name: str, fn: Callable[[Tensor], Tensor]) -> Mutation:
    def mutate(kw: dict[str, Any]) -> None:
        kw[name] = fn(kw[name])

    return mutate


COMMON_ERRORS = [
    pytest.param(_with("x", lambda t: t[0]), r"x: expected shape \[T, C\]", id="x-rank"),
    pytest.param(_with("b", lambda t: t[:, :3]), r"b: expected shape \[T, C\]", id="b-shape"),
    pytest.param(_with("c", lambda t: t.double()), r"c: expected the dtype of x", id="c-dtype"),
    pytest.param(_with("weight", lambda t: t[:3]), r"weight: expected shape \[C, W\]", id="w"),
    pytest.param(_set(bias=torch.zeros(5)), r"bias: expected shape \[C\]", id="bias"),
    pytest.param(
        _with("conv_states", lambda t: t[..., :1]), r"conv_states: expected shape", id="st"
    ),
    pytest.param(
        _with("conv_states", lambda t: t.half()), r"conv_states: expected the dtype of x", id="sd"
    ),
    pytest.param(
        _with("state_indices", lambda t: t.long()), r"state_indices: expected dtype", id="si"
    ),
    pytest.param(
        _with("has_initial_state", lambda t: t.int()), r"has_initial_state: expected dtype", id="h"
    ),
    pytest.param(
        _with("query_start_loc", lambda t: t[:0]), r"query_start_loc: expected shape", id="qsl"
    ),
    pytest.param(_set(out=torch.zeros(4, 6).half()), r"out: expected the dtype of x", id="out"),
    pytest.param(_set(out=torch.zeros(3, 6)), r"out: expected shape \[T, C\]", id="out-shape"),
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize(("mutate", "match"), COMMON_ERRORS)
def test_varlen_errors(impl: str, mutate: Mutation, match: str) -> None:
    kw = _varlen_kwargs()
    mutate(kw)
    with pytest.raises(ValueError, match=match):
        IMPLS[impl].short_conv_varlen(**kw)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        pytest.param(_set(query_start_loc=i32([0, 2, 1])), r"last offset", id="qsl-end"),
        pytest.param(_set(state_indices=i32([2, 2])), r"expected distinct slots", id="dup"),
        pytest.param(_set(state_indices=i32([0, 3])), r"out-of-range", id="range"),
    ],
)
def test_torch_value_errors(mutate: Mutation, match: str) -> None:
    """Checks that read values back: only the torch oracle does them."""
    kw = _varlen_kwargs()
    mutate(kw)
    with pytest.raises(ValueError, match=match):
        torch_sc.short_conv_varlen(**kw)


def test_triton_launcher_errors() -> None:
    kw = _varlen_kwargs()
    wide = {**kw, "weight": torch.zeros(6, 33), "conv_states": torch.zeros(3, 6, 32)}
    with pytest.raises(ValueError, match=r"weight: expected kernel width W <= 32"):
        triton_sc.short_conv_varlen(**wide)
    f64 = {**kw, **{name: kw[name].double() for name in ("b", "c", "x", "conv_states")}}
    with pytest.raises(ValueError, match=r"x: expected dtype in"):
        triton_sc.short_conv_varlen(**f64)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_update_errors(impl: str) -> None:
    kw = _varlen_kwargs()
    del kw["query_start_loc"], kw["has_initial_state"]
    mod = IMPLS[impl]
    with pytest.raises(ValueError, match=r"state_indices: expected shape \[B\]"):
        mod.short_conv_update(**kw)  # 4 rows, 2 slots
    kw.update(b=kw["b"][:2], c=kw["c"][:2], x=kw["x"][:2])
    with pytest.raises(ValueError, match=r"out: expected shape \[B, C\]"):
        mod.short_conv_update(**kw, out=torch.zeros(3, 6))
    with pytest.raises(ValueError, match=r"weight: expected shape \[C, W\]"):
        mod.short_conv_update(**{**kw, "weight": torch.zeros(6)})


# ----------------------------------------------------------------------------------
# GPU, realistic sizes
# ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["strided", "transposed"])
def test_triton_realistic_sizes_on_gpu(dtype: torch.dtype, layout: str) -> None:
    """LFM2-like width (C = 2048, W = 3), mixed prefills and decode, vs the torch oracle."""
    gen = torch.Generator().manual_seed(12)
    channels, width = 2048, 3
    lengths = [1, 0, 2, 300, 4096, 77]
    slots = [6, 3, 0, 5, 7, 1]
    flags = [True, False, True, False, True, True]
    inp = make_inputs(
        gen, sum(lengths), channels, width, use_bias=True, dtype=dtype, strided=True, device="cuda"
    )
    s_ref = make_conv_states(gen, channels, width, dtype, layout=layout, device="cuda")
    s_tri = clone_states(s_ref)
    y_ref = run_varlen(torch_sc, inp, s_ref.view, lengths, slots, flags)
    y_tri = run_varlen(triton_sc, inp, s_tri.view, lengths, slots, flags)
    torch.cuda.synchronize()
    assert_close(y_tri, y_ref, dtype)
    assert torch.equal(bits(s_tri.buf), bits(s_ref.buf))
    dec = make_inputs(gen, 5, channels, width, use_bias=True, dtype=dtype, device="cuda")
    dec.weight, dec.bias = inp.weight, inp.bias
    assert_close(
        run_update(triton_sc, dec, s_tri.view, slots[:5]),
        run_update(torch_sc, dec, s_ref.view, slots[:5]),
        dtype,
    )
    assert torch.equal(bits(s_tri.buf), bits(s_ref.buf))
