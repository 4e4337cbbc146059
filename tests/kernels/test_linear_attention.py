"""Tests for linear attention with per-head decay: torch oracle and Triton kernels.

The torch chunked kernel is checked against ``linear_attention_recurrent_reference``
(the token-by-token definition); the Triton kernels against both. Triton runs under its
interpreter on CPU (``tests/conftest.py``), which is slow: shapes here are small on
purpose. Tests marked ``gpu`` run realistic sizes on a CUDA device.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from attnkit.kernels.linear_attention import reference as torch_la
from attnkit.kernels.linear_attention import triton as triton_la
from attnkit.kernels.linear_attention.reference import linear_attention_recurrent_reference

IMPLS: dict[str, ModuleType] = {"torch": torch_la, "triton": triton_la}


class Tol(NamedTuple):
    atol: float
    rtol: float


# Outputs per input dtype. float32: only the order of float32 accumulation differs.
# 16-bit: both sides read the same rounded inputs; the oracle accumulates in float32,
# the Triton kernel's tensor-core dots take float32 operands as two 16-bit halves (about
# 16 significant bits), so the gap is mostly one rounding of the output (8-bit mantissa
# for bfloat16, 11-bit for float16). float16 is held to the project's tolerance
# (attnkit.testing.tolerances), bfloat16 with headroom.
TOLS: dict[torch.dtype, Tol] = {
    torch.float32: Tol(atol=2e-4, rtol=2e-4),
    torch.float16: Tol(atol=4e-3, rtol=4e-3),
    torch.bfloat16: Tol(atol=3e-2, rtol=3e-2),
}
# Float32 states, whatever the input dtype (the inputs are the same rounded values).
STATE_TOL = Tol(atol=2e-4, rtol=2e-4)
# On a GPU sizes are larger (longer float32 sums).
GPU_TOLS: dict[torch.dtype, Tol] = {
    torch.float32: Tol(atol=2e-3, rtol=2e-3),
    torch.bfloat16: Tol(atol=1e-1, rtol=5e-2),
}

NUM_SLOTS = 8


def i32(values: Sequence[int]) -> Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


def bools(values: Sequence[bool]) -> Tensor:
    return torch.tensor(list(values), dtype=torch.bool)


def offsets_of(lengths: Sequence[int]) -> Tensor:
    return i32([0, *itertools.accumulate(lengths)])


def bits(t: Tensor) -> Tensor:
    """The raw bytes of ``t`` (so NaN compares equal to the same NaN)."""
    dense = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return dense.view(torch.uint8)


def assert_close(actual: Tensor, expected: Tensor, tol: Tol) -> None:
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=tol.atol, rtol=tol.rtol, equal_nan=False
    )


# ----------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------


@dataclass
class States:
    """A ``[S, H, K, V]`` float32 view inside a larger buffer (as the runtime hands out)."""

    buf: Tensor
    view: Tensor


def make_states(
    gen: torch.Generator,
    heads: int,
    key_dim: int,
    value_dim: int,
    *,
    layout: str = "strided",
    device: str = "cpu",
) -> States:
    """Random content in every slot, NaN in the padding of each page.

    ``layout``: ``"strided"`` (rows of a larger page), ``"transposed"`` (the page stores
    ``[H, V, K]``, so the K and V strides are swapped) or ``"contiguous"``.
    """
    n = heads * key_dim * value_dim
    pad = 0 if layout == "contiguous" else 5
    buf = torch.full((NUM_SLOTS, n + pad), float("nan"))
    buf[:, :n] = torch.randn(NUM_SLOTS, n, generator=gen)
    buf = buf.to(device)
    if layout == "transposed":
        view = buf[:, :n].view(NUM_SLOTS, heads, value_dim, key_dim).transpose(2, 3)
    else:
        view = buf[:, :n].view(NUM_SLOTS, heads, key_dim, value_dim)
    return States(buf, view)


def clone_states(states: States) -> States:
    """A copy of the buffer with the same view into it."""
    buf = states.buf.clone()
    view = states.view
    return States(buf, buf.as_strided(view.shape, view.stride(), view.storage_offset()))


@dataclass
class Inputs:
    q: Tensor
    k: Tensor
    v: Tensor
    decay: Tensor
    scale: float


def make_inputs(
    gen: torch.Generator,
    num_tokens: int,
    heads: int,
    key_dim: int,
    value_dim: int,
    *,
    dtype: torch.dtype = torch.float32,
    strided: bool = False,
    device: str = "cpu",
) -> Inputs:
    """``strided``: q/k/v are slices of a wider packed projection (non-contiguous)."""
    if strided:
        packed = torch.randn(num_tokens, heads, 2 * key_dim + value_dim + 3, generator=gen)
        packed = packed.to(device=device, dtype=dtype)
        q = packed[..., :key_dim]
        k = packed[..., key_dim : 2 * key_dim]
        v = packed[..., 2 * key_dim : 2 * key_dim + value_dim]
    else:
        q = torch.randn(num_tokens, heads, key_dim, generator=gen).to(device=device, dtype=dtype)
        k = torch.randn(num_tokens, heads, key_dim, generator=gen).to(device=device, dtype=dtype)
        v = torch.randn(num_tokens, heads, value_dim, generator=gen).to(device=device, dtype=dtype)
    # ALiBi-like slopes, as in lightning attention: 2^(-8 h / H), plus a zero decay
    # (lam = 1, plain causal linear attention) in head 0.
    decay = torch.tensor([2.0 ** (-8 * h / heads) for h in range(heads)], dtype=torch.float32)
    decay[0] = 0.0
    return Inputs(q, k, v, decay.to(device), key_dim**-0.5)


def expected_varlen(
    inp: Inputs,
    lengths: Sequence[int],
    slots: Sequence[int],
    flags: Sequence[bool],
    states_before: Tensor,
) -> tuple[Tensor, dict[int, Tensor]]:
    """Outputs and final states per slot from the token-by-token definition."""
    starts = offsets_of(lengths).tolist()
    outs = []
    finals = {}
    for b, slot in enumerate(slots):
        seg = slice(starts[b], starts[b + 1])
        o, final = linear_attention_recurrent_reference(
            inp.q[seg].cpu(),
            inp.k[seg].cpu(),
            inp.v[seg].cpu(),
            inp.decay.cpu(),
            scale=inp.scale,
            initial_state=states_before[slot].cpu() if flags[b] else None,
        )
        outs.append(o)
        finals[slot] = final
    return torch.cat(outs), finals


def run_varlen(
    impl: ModuleType,
    inp: Inputs,
    states: Tensor,
    lengths: Sequence[int],
    slots: Sequence[int],
    flags: Sequence[bool],
    chunk_size: int,
    out: Tensor | None = None,
) -> Tensor:
    dev = inp.q.device
    result: Tensor = impl.chunk_linear_attention_varlen(
        inp.q,
        inp.k,
        inp.v,
        inp.decay,
        scale=inp.scale,
        query_start_loc=offsets_of(lengths).to(dev),
        states=states,
        state_indices=i32(slots).to(dev),
        has_initial_state=bools(flags).to(dev),
        chunk_size=chunk_size,
        out=out,
    )
    return result


def check_varlen(
    impl: ModuleType,
    gen: torch.Generator,
    lengths: Sequence[int],
    slots: Sequence[int],
    flags: Sequence[bool],
    *,
    chunk_size: int,
    heads: int = 2,
    key_dim: int = 16,
    value_dim: int = 24,
    dtype: torch.dtype = torch.float32,
    layout: str = "strided",
    strided_inputs: bool = False,
) -> None:
    """One varlen call against the definition: outputs, states, untouched slots/padding."""
    inp = make_inputs(
        gen, sum(lengths), heads, key_dim, value_dim, dtype=dtype, strided=strided_inputs
    )
    states = make_states(gen, heads, key_dim, value_dim, layout=layout)
    for slot, flag in zip(slots, flags, strict=True):
        if not flag:  # never read: NaN would poison the result if it were
            states.view[slot] = float("nan")
    before = states.buf.clone()
    view_before = states.view.clone()
    out = torch.full((sum(lengths), heads, value_dim), float("nan"), dtype=dtype)
    result = run_varlen(impl, inp, states.view, lengths, slots, flags, chunk_size, out=out)
    assert result is out
    want_out, want_states = expected_varlen(inp, lengths, slots, flags, view_before)
    assert not out.isnan().any()
    assert_close(out, want_out, TOLS[dtype])
    for slot, want in want_states.items():
        assert_close(states.view[slot], want, STATE_TOL)
    untouched = [s for s in range(NUM_SLOTS) if s not in set(slots)]
    assert torch.equal(bits(states.buf[untouched]), bits(before[untouched]))
    n = heads * key_dim * value_dim
    assert torch.equal(bits(states.buf[:, n:]), bits(before[:, n:]))  # page padding


LENGTHS = [5, 0, 19, 1, 0, 8]
SLOTS = [6, 1, 3, 0, 4, 7]
FLAGS = [True, False, True, False, True, True]


# ----------------------------------------------------------------------------------
# The definition itself
# ----------------------------------------------------------------------------------


def test_hand_computed_case() -> None:
    """K = V = H = 1, lam = 1/2, scale = 1: S = 1, 2.5, 4.25 and o = q * S."""
    q = torch.tensor([1.0, 1.0, 2.0]).view(3, 1, 1)
    k = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    v = torch.ones(3, 1, 1)
    decay = torch.tensor([math.log(2.0)])
    want_o = torch.tensor([1.0, 2.5, 8.5]).view(3, 1, 1)
    o, final = linear_attention_recurrent_reference(q, k, v, decay, scale=1.0)
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(final, torch.tensor([[[4.25]]]))
    # With initial state 4: S = 3, 3.5, 4.75.
    o, final = linear_attention_recurrent_reference(
        q, k, v, decay, scale=2.0, initial_state=torch.tensor([[[4.0]]])
    )
    torch.testing.assert_close(o, torch.tensor([6.0, 7.0, 19.0]).view(3, 1, 1))
    torch.testing.assert_close(final, torch.tensor([[[4.75]]]))
    for impl in IMPLS.values():
        states = torch.tensor([[[[4.0]]], [[[-1.0]]]])
        o = impl.chunk_linear_attention_varlen(
            q,
            k,
            v,
            decay,
            scale=2.0,
            query_start_loc=i32([0, 3]),
            states=states,
            state_indices=i32([0]),
            has_initial_state=bools([True]),
            chunk_size=2,
        )
        torch.testing.assert_close(o, torch.tensor([6.0, 7.0, 19.0]).view(3, 1, 1))
        torch.testing.assert_close(states, torch.tensor([[[[4.75]]], [[[-1.0]]]]))


def test_reference_matches_explicit_sum() -> None:
    """o_t = scale * sum_{j<=t} lam^(t-j) (q_t . k_j) v_j, written out in float64."""
    gen = torch.Generator().manual_seed(1)
    inp = make_inputs(gen, 7, 3, 5, 4)
    o, final = linear_attention_recurrent_reference(inp.q, inp.k, inp.v, inp.decay, scale=inp.scale)
    lam = torch.exp(-inp.decay.double())
    q, k, v = inp.q.double(), inp.k.double(), inp.v.double()
    for t in range(7):
        want = sum(
            lam[:, None] ** (t - j) * (q[t] * k[j]).sum(-1, keepdim=True) * v[j]
            for j in range(t + 1)
        )
        assert isinstance(want, Tensor)
        assert_close(o[t], inp.scale * want, TOLS[torch.float32])
    want_state = sum(
        lam[:, None, None] ** (6 - j) * k[j][:, :, None] * v[j][:, None, :] for j in range(7)
    )
    assert isinstance(want_state, Tensor)
    assert_close(final, want_state, STATE_TOL)


# ----------------------------------------------------------------------------------
# Chunked varlen
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 64])
@pytest.mark.parametrize("layout", ["strided", "transposed"])
def test_torch_chunked_matches_definition(chunk_size: int, layout: str) -> None:
    gen = torch.Generator().manual_seed(chunk_size)
    check_varlen(torch_la, gen, LENGTHS, SLOTS, FLAGS, chunk_size=chunk_size, layout=layout)


@pytest.mark.parametrize(
    ("chunk_size", "layout", "key_dim", "value_dim", "strided_inputs"),
    [
        pytest.param(1, "strided", 16, 24, False, id="chunk1"),
        pytest.param(5, "transposed", 16, 24, True, id="chunk5-nondivisor-transposed"),
        pytest.param(16, "strided", 20, 80, True, id="chunk16-K20-V80-two-value-tiles"),
        pytest.param(64, "contiguous", 8, 8, False, id="chunk64-longer-than-requests"),
    ],
)
def test_triton_chunked_matches_definition(
    chunk_size: int, layout: str, key_dim: int, value_dim: int, strided_inputs: bool
) -> None:
    gen = torch.Generator().manual_seed(100 + chunk_size)
    check_varlen(
        triton_la,
        gen,
        LENGTHS,
        SLOTS,
        FLAGS,
        chunk_size=chunk_size,
        key_dim=key_dim,
        value_dim=value_dim,
        layout=layout,
        strided_inputs=strided_inputs,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_16bit(impl: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    check_varlen(
        IMPLS[impl], gen, [9, 0, 14], [2, 5, 0], [True, False, False], chunk_size=4, dtype=dtype
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_many_tiles(dtype: torch.dtype) -> None:
    """Every tiling loop of the chunk kernel runs more than once, with ragged ends.

    K = 40 and V = 40 are not multiples of the state tiles, chunk 100 pads to 128 rows
    walked in several token blocks, and the 130-token request spans two chunks (the
    second partial), so the state round trip between chunks is exercised too.
    """
    gen = torch.Generator().manual_seed(12)
    check_varlen(
        triton_la,
        gen,
        [130, 0, 7],
        [4, 1, 6],
        [True, False, False],
        chunk_size=100,
        heads=1,
        key_dim=40,
        value_dim=40,
        dtype=dtype,
        layout="transposed",
    )


def test_triton_matches_torch_chunked() -> None:
    """Same chunking on both sides: outputs and states agree to float32 rounding."""
    gen = torch.Generator().manual_seed(3)
    inp = make_inputs(gen, sum(LENGTHS), 2, 16, 24)
    s_torch = make_states(gen, 2, 16, 24)
    s_triton = clone_states(s_torch)
    o_torch = run_varlen(torch_la, inp, s_torch.view, LENGTHS, SLOTS, FLAGS, 4)
    o_triton = run_varlen(triton_la, inp, s_triton.view, LENGTHS, SLOTS, FLAGS, 4)
    torch.testing.assert_close(o_triton, o_torch, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_triton.buf, s_torch.buf, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_empty_batches(impl: str) -> None:
    """B = 0 is a no-op; T = 0 with B > 0 stores initial states (or zeros)."""
    mod = IMPLS[impl]
    gen = torch.Generator().manual_seed(4)
    inp = make_inputs(gen, 0, 2, 16, 16)
    states = make_states(gen, 2, 16, 16)
    before = states.buf.clone()
    o = run_varlen(mod, inp, states.view, [], [], [], 8)
    assert o.shape == (0, 2, 16)
    assert torch.equal(bits(states.buf), bits(before))
    o = run_varlen(mod, inp, states.view, [0, 0], [3, 5], [True, False], 8)
    assert torch.equal(bits(states.view[3]), bits(before[3, : 2 * 16 * 16].view(2, 16, 16)))
    assert torch.equal(states.view[5], torch.zeros(2, 16, 16))


# ----------------------------------------------------------------------------------
# Decode and continuity
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_decode_matches_definition(impl: str) -> None:
    gen = torch.Generator().manual_seed(5)
    heads, key_dim, value_dim = 2, 12, 20
    inp = make_inputs(gen, 3, heads, key_dim, value_dim, strided=True)
    states = make_states(gen, heads, key_dim, value_dim, layout="transposed")
    slots = [5, 0, 2]
    before = states.buf.clone()
    view_before = states.view.clone()
    out = torch.full((3, heads, value_dim), float("nan"))
    result = IMPLS[impl].linear_attention_decode(
        inp.q,
        inp.k,
        inp.v,
        inp.decay,
        scale=inp.scale,
        states=states.view,
        state_indices=i32(slots),
        out=out,
    )
    assert result is out
    for b, slot in enumerate(slots):
        o, final = linear_attention_recurrent_reference(
            inp.q[b : b + 1],
            inp.k[b : b + 1],
            inp.v[b : b + 1],
            inp.decay,
            scale=inp.scale,
            initial_state=view_before[slot],
        )
        assert_close(out[b], o[0], TOLS[torch.float32])
        assert_close(states.view[slot], final, STATE_TOL)
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(bits(states.buf[untouched]), bits(before[untouched]))
    n = heads * key_dim * value_dim
    assert torch.equal(bits(states.buf[:, n:]), bits(before[:, n:]))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("first_has_state", [False, True])
def test_continuity(impl: str, first_has_state: bool) -> None:
    """One call == three prefill calls == prefill + token-by-token decode."""
    mod = IMPLS[impl]
    gen = torch.Generator().manual_seed(6 + first_has_state)
    heads, key_dim, value_dim, length, slot = 2, 8, 16, 13, 2
    inp = make_inputs(gen, length, heads, key_dim, value_dim)
    init = make_states(gen, heads, key_dim, value_dim).view

    def sub(a: int, b: int) -> Inputs:
        return Inputs(inp.q[a:b], inp.k[a:b], inp.v[a:b], inp.decay, inp.scale)

    one = init.clone()
    o_one = run_varlen(mod, inp, one, [length], [slot], [first_has_state], 4)

    three = init.clone()
    pieces = [(0, 3), (3, 3), (3, 13)]  # includes an empty middle call
    o_three = torch.cat(
        [
            run_varlen(mod, sub(a, b), three, [b - a], [slot], [first_has_state or i > 0], 4)
            for i, (a, b) in enumerate(pieces)
        ]
    )

    steps = init.clone()
    outs = [run_varlen(mod, sub(0, 5), steps, [5], [slot], [first_has_state], 4)]
    for t in range(5, length):
        s = sub(t, t + 1)
        outs.append(
            mod.linear_attention_decode(
                s.q, s.k, s.v, inp.decay, scale=inp.scale, states=steps, state_indices=i32([slot])
            )
        )
    o_steps = torch.cat(outs)

    want_o, want_states = expected_varlen(inp, [length], [slot], [first_has_state], init)
    for o, states in ((o_one, one), (o_three, three), (o_steps, steps)):
        assert_close(o, want_o, TOLS[torch.float32])
        assert_close(states[slot], want_states[slot], STATE_TOL)


# ----------------------------------------------------------------------------------
# Random ragged batches
# ----------------------------------------------------------------------------------


@settings(max_examples=6, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 11), min_size=1, max_size=4),
    chunk_size=st.sampled_from([1, 2, 3, 8, 16]),
    flags_seed=st.integers(0, 2**16),
    impl=st.sampled_from(["torch", "triton"]),
)
def test_random_ragged_batches(
    lengths: list[int], chunk_size: int, flags_seed: int, impl: str
) -> None:
    gen = torch.Generator().manual_seed(flags_seed)
    perm = torch.randperm(NUM_SLOTS, generator=gen)[: len(lengths)].tolist()
    flags = (torch.rand(len(lengths), generator=gen) < 0.5).tolist()
    check_varlen(
        IMPLS[impl],
        gen,
        lengths,
        perm,
        flags,
        chunk_size=chunk_size,
        heads=1,
        key_dim=8,
        value_dim=8,
    )


# ----------------------------------------------------------------------------------
# Launcher errors
# ----------------------------------------------------------------------------------

Mutation = Callable[[dict[str, Any]], None]


def _varlen_kwargs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(9)
    inp = make_inputs(gen, 4, 2, 16, 16)
    return {
        "q": inp.q,
        "k": inp.k,
        "v": inp.v,
        "decay": inp.decay,
        "scale": 0.25,
        "query_start_loc": i32([0, 1, 4]),
        "states": torch.zeros(3, 2, 16, 16),
        "state_indices": i32([0, 2]),
        "has_initial_state": bools([True, False]),
        "chunk_size": 4,
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
    pytest.param(_with("q", lambda t: t[0]), r"q: expected shape \[T, H, K\]", id="q-rank"),
    pytest.param(_with("k", lambda t: t[..., :8]), r"k: expected shape", id="k-shape"),
    pytest.param(_with("v", lambda t: t.double()), r"v: expected the dtype of q", id="v-dtype"),
    pytest.param(_with("decay", lambda t: t[:1]), r"decay: expected shape \[H\]", id="decay"),
    pytest.param(_set(scale=float("nan")), r"scale: expected a finite float", id="scale"),
    pytest.param(
        _with("states", lambda t: t.double()), r"states: expected dtype torch.float32", id="st"
    ),
    pytest.param(
        _with("states", lambda t: t[..., :8]), r"states: expected shape \[S, H, K, V\]", id="stV"
    ),
    pytest.param(_set(chunk_size=0), r"chunk_size: expected an int >= 1", id="chunk0"),
    pytest.param(_set(chunk_size=True), r"chunk_size: expected an int >= 1", id="chunk-bool"),
    pytest.param(
        _with("state_indices", lambda t: t.long()), r"state_indices: expected dtype", id="si"
    ),
    pytest.param(
        _with("has_initial_state", lambda t: t[:1]), r"has_initial_state: expected shape", id="h"
    ),
    pytest.param(
        _set(out=torch.zeros(4, 2, 16, dtype=torch.float16)), r"out: expected the dtype", id="out"
    ),
    pytest.param(_set(out=torch.zeros(4, 2, 8)), r"out: expected shape \[T, H, V\]", id="out-s"),
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize(("mutate", "match"), COMMON_ERRORS)
def test_varlen_errors(impl: str, mutate: Mutation, match: str) -> None:
    kw = _varlen_kwargs()
    mutate(kw)
    with pytest.raises(ValueError, match=match):
        IMPLS[impl].chunk_linear_attention_varlen(**kw)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        pytest.param(_set(query_start_loc=i32([0, 1, 3])), r"last offset", id="qsl-end"),
        pytest.param(
            _set(state_indices=i32([2, 2])), r"state_indices: expected distinct", id="dup"
        ),
        pytest.param(_set(state_indices=i32([0, 3])), r"out-of-range", id="range"),
        pytest.param(_set(decay=torch.tensor([0.5, -0.1])), r"decay: expected finite", id="neg"),
    ],
)
def test_torch_value_errors(mutate: Mutation, match: str) -> None:
    """Checks that read values back: only the torch oracle does them."""
    kw = _varlen_kwargs()
    mutate(kw)
    with pytest.raises(ValueError, match=match):
        torch_la.chunk_linear_attention_varlen(**kw)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        pytest.param(_set(chunk_size=129), r"chunk_size: expected an int <= 128", id="chunk"),
        pytest.param(
            _set(
                q=torch.zeros(4, 2, 16, dtype=torch.float64),
                k=torch.zeros(4, 2, 16, dtype=torch.float64),
                v=torch.zeros(4, 2, 16, dtype=torch.float64),
            ),
            r"q: expected dtype in",
            id="f64",
        ),
        pytest.param(
            _set(
                q=torch.zeros(4, 2, 300),
                k=torch.zeros(4, 2, 300),
                states=torch.zeros(3, 2, 300, 16),
            ),
            r"q: expected head dim K <= 256",
            id="K",
        ),
    ],
)
def test_triton_launcher_errors(mutate: Mutation, match: str) -> None:
    kw = _varlen_kwargs()
    mutate(kw)
    with pytest.raises(ValueError, match=match):
        triton_la.chunk_linear_attention_varlen(**kw)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_decode_errors(impl: str) -> None:
    kw = _varlen_kwargs()
    for name in ("query_start_loc", "has_initial_state", "chunk_size"):
        del kw[name]
    mod = IMPLS[impl]
    with pytest.raises(ValueError, match=r"state_indices: expected shape \[B\]"):
        mod.linear_attention_decode(**kw)  # 4 tokens, 2 slots
    kw.update(q=kw["q"][:2], k=kw["k"][:2], v=kw["v"][:2])
    with pytest.raises(ValueError, match=r"out: expected shape \[B, H, V\]"):
        mod.linear_attention_decode(**kw, out=torch.zeros(3, 2, 16))
    with pytest.raises(ValueError, match=r"states: expected shape"):
        mod.linear_attention_decode(**{**kw, "states": torch.zeros(3, 2, 16)})


def test_recurrent_reference_errors() -> None:
    q = torch.zeros(3, 2, 4)
    with pytest.raises(ValueError, match=r"initial_state: expected shape \[H, K, V\]"):
        linear_attention_recurrent_reference(
            q, q, q, torch.zeros(2), scale=1.0, initial_state=torch.zeros(2, 4, 5)
        )
    with pytest.raises(ValueError, match=r"decay: expected a floating-point dtype"):
        linear_attention_recurrent_reference(q, q, q, torch.zeros(2, dtype=torch.int64), scale=1.0)


# ----------------------------------------------------------------------------------
# GPU, realistic sizes
# ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [64, 128])
def test_triton_realistic_sizes_on_gpu(dtype: torch.dtype, chunk_size: int) -> None:
    """MiniMax-01-like heads (K = V = 128), mixed long prefills, against the torch oracle."""
    gen = torch.Generator().manual_seed(11)
    heads, key_dim, value_dim = 8, 128, 128
    lengths = [1, 0, 300, 2048, 77, 1024]
    slots = [9, 3, 0, 14, 7, 1]
    flags = [True, False, True, False, True, True]
    inp = make_inputs(gen, sum(lengths), heads, key_dim, value_dim, dtype=dtype, device="cuda")
    n = heads * key_dim * value_dim
    buf = torch.randn(16, n + 64, generator=gen).cuda()
    s_ref = buf[:, :n].view(16, heads, key_dim, value_dim)
    buf2 = buf.clone()
    s_tri = buf2[:, :n].view(16, heads, key_dim, value_dim)
    o_ref = run_varlen(torch_la, inp, s_ref, lengths, slots, flags, chunk_size)
    o_tri = run_varlen(triton_la, inp, s_tri, lengths, slots, flags, chunk_size)
    torch.cuda.synchronize()
    tol = GPU_TOLS[dtype]
    assert_close(o_tri, o_ref, tol)
    torch.testing.assert_close(s_tri, s_ref, atol=2e-3, rtol=2e-3)
    assert torch.equal(buf2[:, n:], buf[:, n:])
    untouched = [s for s in range(16) if s not in slots]
    assert torch.equal(buf2[untouched], buf[untouched])
    # Decode on top of the prefilled states.
    dec = make_inputs(gen, 5, heads, key_dim, value_dim, dtype=dtype, device="cuda")
    idx = i32(slots[:5]).cuda()
    d_ref = torch_la.linear_attention_decode(
        dec.q[:5], dec.k[:5], dec.v[:5], dec.decay, scale=dec.scale, states=s_ref, state_indices=idx
    )
    d_tri = triton_la.linear_attention_decode(
        dec.q[:5], dec.k[:5], dec.v[:5], dec.decay, scale=dec.scale, states=s_tri, state_indices=idx
    )
    assert_close(d_tri, d_ref, tol)
    torch.testing.assert_close(s_tri, s_ref, atol=2e-3, rtol=2e-3)
