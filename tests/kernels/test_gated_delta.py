"""Tests for the Gated DeltaNet kernels: the pure-torch oracle and the Triton kernels.

``gated_delta_rule_recurrent_reference`` (token by token) is the definition. The torch
chunked kernel is checked against it; the Triton kernels against both the definition
and the torch launchers of the same name. On a machine without CUDA,
``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` and the Triton kernels run on CPU
tensors under the (slow) interpreter, so shapes stay small; tests marked ``gpu`` run
realistic sizes on CUDA.

Every state cache is built to catch a kernel that reads or writes what it must not:
slots are shuffled, the slot of a request without an initial state is NaN (it must not
be read), and with ``strided=True`` the states are a non-contiguous view into a larger
page whose every other element must come back bit-for-bit unchanged.
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
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from attnkit.kernels.gated_delta import reference as torch_gdn
from attnkit.kernels.gated_delta.reference import gated_delta_rule_recurrent_reference
from attnkit.testing.tolerances import TOLERANCES

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is a Linux-only dependency
    HAS_TRITON = False

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Tol(NamedTuple):
    atol: float
    rtol: float


# Tolerances, all in one place, keyed by the dtype of q/k/v. float32: the chunked form
# only sums in another order than the recurrence (measured ~1e-7 at these sizes).
# bfloat16: every side reads the same rounded inputs and accumulates in float32, so
# outputs differ by about one rounding to bf16 (8-bit mantissa, 2**-8 relative), with
# headroom; the float32 states differ only by the order of sums.
TOLS: dict[torch.dtype, Tol] = {
    torch.float32: Tol(atol=5e-5, rtol=5e-5),
    torch.bfloat16: Tol(atol=1.6e-2, rtol=1.6e-2),
}
STATE_TOLS: dict[torch.dtype, Tol] = {
    torch.float32: Tol(atol=5e-5, rtol=5e-5),
    torch.bfloat16: Tol(atol=1e-4, rtol=1e-4),
}
# The Triton chunked kernel with float16/bfloat16 q/k/v multiplies 16-bit operands on
# tensor cores (k, W, the entering state, D, the masked scores, ... rounded to the input
# dtype, float32 accumulation; see its module doc), so its outputs *and* states are held
# to the project's tolerance for that dtype (attnkit.testing.tolerances) against the
# float32 definition. (Measured: about 5e-3 for bfloat16 and 6e-4 for float16.)
TRITON_16BIT_TOLS: dict[torch.dtype, Tol] = {
    dtype: Tol(atol=TOLERANCES[dtype].atol, rtol=TOLERANCES[dtype].rtol)
    for dtype in (torch.float16, torch.bfloat16)
}
# At realistic sizes on a GPU (T = 4096, K = V = 128) sums are longer.
GPU_TOLS = Tol(atol=3e-2, rtol=3e-2)
GPU_STATE_TOLS = Tol(atol=2e-3, rtol=2e-3)
# The chunked kernel's bfloat16 tensor-core path rounds the state to bfloat16 in its dots.
GPU_CHUNK_STATE_TOLS = TRITON_16BIT_TOLS[torch.bfloat16]

NUM_SLOTS = 9
TRITON_CHUNK_SIZES = (16, 32, 64)


def triton_gdn() -> ModuleType:
    if not HAS_TRITON:  # pragma: no cover
        pytest.skip("needs triton")
    import attnkit.kernels.gated_delta.triton as module

    return module


def impl_of(name: str) -> ModuleType:
    return torch_gdn if name == "torch" else triton_gdn()


IMPLS = [pytest.param("torch", id="torch"), pytest.param("triton", id="triton")]


def i32(values: Sequence[int]) -> Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=DEVICE)


def bools(values: Sequence[bool]) -> Tensor:
    return torch.tensor(list(values), dtype=torch.bool, device=DEVICE)


def offsets_of(lengths: Sequence[int]) -> Tensor:
    return i32([0, *itertools.accumulate(lengths)])


def assert_close(actual: Tensor, expected: Tensor, tol: Tol) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol.atol, rtol=tol.rtol)


# ----------------------------------------------------------------------------------
# Fixtures
# ----------------------------------------------------------------------------------


@dataclass
class Inputs:
    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor

    def rows(self, sl: slice) -> Inputs:
        return Inputs(self.q[sl], self.k[sl], self.v[sl], self.g[sl], self.beta[sl])

    def args(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return self.q, self.k, self.v, self.g, self.beta


def make_inputs(
    gen: torch.Generator,
    num_tokens: int,
    *,
    heads: int = 2,
    key_dim: int = 8,
    value_dim: int = 6,
    dtype: torch.dtype = torch.float32,
    strided: bool = False,
    strong_decay: bool = False,
    key_heads: int | None = None,
) -> Inputs:
    """Random operands as a model produces them: L2-normalised q/k, g <= 0, beta in (0, 1).

    ``strided``: q/k/v are slices of one fused projection ``[T, H, 2K + V + 1]`` (so
    none is contiguous) and g/beta columns of one ``[T, 2H]`` tensor. ``strong_decay``:
    every 5th token has ``g = -30`` (the state is all but wiped there). ``key_heads``
    (``Hk``, a divisor of ``heads``; None: ``heads``): q and k get ``Hk`` heads, laid out
    as the model's conv output ``[T, Hk*K | Hk*K | H*V]`` (see :func:`make_shared_inputs`).
    """
    if key_heads is not None and key_heads != heads:
        return make_shared_inputs(
            gen,
            num_tokens,
            heads=heads,
            key_heads=key_heads,
            key_dim=key_dim,
            value_dim=value_dim,
            dtype=dtype,
            strided=strided,
            strong_decay=strong_decay,
        )
    h, kd, vd = heads, key_dim, value_dim
    fused = torch.randn(num_tokens, h, 2 * kd + vd + 1, generator=gen)
    fused[..., :kd] = F.normalize(fused[..., :kd], dim=-1)
    fused[..., kd : 2 * kd] = F.normalize(fused[..., kd : 2 * kd], dim=-1)
    gates = torch.randn(num_tokens, 2 * h, generator=gen)
    gates[:, :h] = F.logsigmoid(1.5 * gates[:, :h] + 2.0)
    if strong_decay:
        gates[::5, :h] = -30.0
    gates[:, h:] = torch.sigmoid(gates[:, h:])
    fused = fused.to(dtype).to(DEVICE)
    gates = gates.to(DEVICE)
    if not strided:
        fused = fused.clone()
        return Inputs(
            fused[..., :kd].contiguous(),
            fused[..., kd : 2 * kd].contiguous(),
            fused[..., 2 * kd : 2 * kd + vd].contiguous(),
            gates[:, :h].contiguous(),
            gates[:, h:].to(dtype).contiguous(),
        )
    return Inputs(
        fused[..., :kd],
        fused[..., kd : 2 * kd],
        fused[..., 2 * kd : 2 * kd + vd],
        gates[:, :h],
        gates[:, h:],
    )


def make_shared_inputs(
    gen: torch.Generator,
    num_tokens: int,
    *,
    heads: int,
    key_heads: int,
    key_dim: int,
    value_dim: int,
    dtype: torch.dtype,
    strided: bool,
    strong_decay: bool,
) -> Inputs:
    """Operands with ``Hk = key_heads`` query/key heads and ``H = heads`` value heads.

    ``strided``: q, k and v are views into one ``[T, 2*Hk*K + H*V + 1]`` tensor laid out
    q | k | v as a Gated DeltaNet layer's conv output (each head of q and k normalised
    over ``K``), so none is contiguous; g/beta are columns of one ``[T, 2H]`` tensor.
    """
    assert heads % key_heads == 0
    qk_width, v_width = key_heads * key_dim, heads * value_dim
    flat = torch.randn(num_tokens, 2 * qk_width + v_width + 1, generator=gen)
    for part in (slice(0, qk_width), slice(qk_width, 2 * qk_width)):
        heads_view = flat[:, part].unflatten(1, (key_heads, key_dim))
        flat[:, part] = F.normalize(heads_view, dim=-1).flatten(1)
    gates = torch.randn(num_tokens, 2 * heads, generator=gen)
    gates[:, :heads] = F.logsigmoid(1.5 * gates[:, :heads] + 2.0)
    if strong_decay:
        gates[::5, :heads] = -30.0
    gates[:, heads:] = torch.sigmoid(gates[:, heads:])
    flat = flat.to(dtype).to(DEVICE)
    gates = gates.to(DEVICE)
    q = flat[:, :qk_width].unflatten(1, (key_heads, key_dim))
    k = flat[:, qk_width : 2 * qk_width].unflatten(1, (key_heads, key_dim))
    v = flat[:, 2 * qk_width : 2 * qk_width + v_width].unflatten(1, (heads, value_dim))
    g, beta = gates[:, :heads], gates[:, heads:].to(dtype)
    if strided:
        assert not q.is_contiguous()
        assert not k.is_contiguous()
        assert not v.is_contiguous()
        return Inputs(q, k, v, g, beta)
    return Inputs(*(t.contiguous() for t in (q, k, v, g, beta)))


def shared_head_recurrence(
    inputs: Inputs, *, scale: float, initial_state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The gated delta rule written out token by token and head by head in float64, with
    the head sharing explicit: value head ``h`` reads q/k head ``h // (H // Hk)``.

    Independent of the oracle (which expands q/k with ``repeat_interleave``). Returns
    ``o`` ``[L, H, V]`` and the final state ``[H, K, V]``, both float64.
    """
    q, k, v = inputs.q.double(), inputs.k.double(), inputs.v.double()
    g, beta = inputs.g.double(), inputs.beta.double()
    length, heads, value_dim = v.shape
    key_heads, key_dim = k.shape[1], k.shape[2]
    group = heads // key_heads
    if initial_state is None:
        state = torch.zeros(heads, key_dim, value_dim, dtype=torch.float64, device=v.device)
    else:
        state = initial_state.double().clone()
    o = torch.zeros(length, heads, value_dim, dtype=torch.float64, device=v.device)
    for t in range(length):
        for h in range(heads):
            kh = h // group
            decayed = math.exp(float(g[t, h])) * state[h]  # [K, V]
            u = v[t, h] - decayed.T @ k[t, kh]  # [V]
            state[h] = decayed + float(beta[t, h]) * torch.outer(k[t, kh], u)
            o[t, h] = scale * (state[h].T @ q[t, kh])
    return o, state


@dataclass
class Cache:
    """``states`` ``[S, H, K, V]`` float32, possibly a strided view into ``page``."""

    page: Tensor
    strided: bool
    key_dim: int

    def view(self, page: Tensor) -> Tensor:
        if not self.strided:
            return page
        # page [S, 2, H, V, K + 3]: states live in half 1, transposed, offset by one.
        return page[:, 1, :, :, 1 : self.key_dim + 1].transpose(-1, -2)

    @property
    def states(self) -> Tensor:
        return self.view(self.page)


def make_cache(
    gen: torch.Generator,
    *,
    heads: int,
    key_dim: int,
    value_dim: int,
    strided: bool,
    nan_slots: Sequence[int] = (),
) -> Cache:
    shape = (
        (NUM_SLOTS, 2, heads, value_dim, key_dim + 3)
        if strided
        else (NUM_SLOTS, heads, key_dim, value_dim)
    )
    cache = Cache(torch.randn(shape, generator=gen).to(DEVICE), strided, key_dim)
    assert cache.states.is_contiguous() != strided
    for slot in nan_slots:
        cache.states[slot] = float("nan")
    return cache


def reference_batch(
    inputs: Inputs,
    lengths: Sequence[int],
    slots: Sequence[int],
    flags: Sequence[bool],
    states: Tensor,
    scale: float,
) -> tuple[Tensor, list[Tensor]]:
    """The definition, request by request, in float32 (the inputs read as float32):
    outputs ``[T, H, V]`` float32 and final states. With fewer key heads than value
    heads, the explicit head-sharing recurrence of this file (float64, then float32)."""
    starts = list(itertools.accumulate(lengths, initial=0))
    shared = inputs.q.shape[1] != inputs.v.shape[1]
    outs, finals = [], []
    for b, slot in enumerate(slots):
        init = states[slot].clone() if flags[b] else None
        rows = inputs.rows(slice(starts[b], starts[b + 1]))
        if shared:
            o, final = shared_head_recurrence(rows, scale=scale, initial_state=init)
            o, final = o.float(), final.float()
        else:
            o, final = gated_delta_rule_recurrent_reference(
                *(t.float() for t in rows.args()), scale=scale, initial_state=init
            )
        outs.append(o)
        finals.append(final)
    return torch.cat(outs) if outs else inputs.v[:0].float(), finals


def assert_states(
    cache: Cache,
    before: Tensor,
    slots: Sequence[int],
    finals: Sequence[Tensor],
    tol: Tol,
) -> None:
    """Used slots hold ``finals``; everything else in the page is bit-for-bit unchanged."""
    for slot, want in zip(slots, finals, strict=True):
        assert_close(cache.states[slot], want, tol)
    touched = torch.zeros_like(cache.page, dtype=torch.bool)
    cache.view(touched)[list(slots)] = True
    torch.testing.assert_close(
        cache.page[~touched], before[~touched], atol=0, rtol=0, equal_nan=True
    )


@dataclass
class Case:
    lengths: list[int]
    slots: list[int]
    flags: list[bool]
    heads: int = 2
    key_dim: int = 8
    value_dim: int = 6
    dtype: torch.dtype = torch.float32
    strided: bool = False
    strong_decay: bool = False
    seed: int = 0
    key_heads: int | None = None  # Hk query/key heads shared by the H value heads


def chunked_tols(impl: ModuleType, dtype: torch.dtype) -> tuple[Tol, Tol]:
    """``(output, state)`` tolerances of ``impl``'s chunked kernel for inputs of ``dtype``."""
    if impl is not torch_gdn and dtype in TRITON_16BIT_TOLS:
        return TRITON_16BIT_TOLS[dtype], TRITON_16BIT_TOLS[dtype]
    return TOLS[dtype], STATE_TOLS[dtype]


def check_chunked(impl: ModuleType, case: Case, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Run ``impl``'s chunked kernel on ``case``; check it against the float32 definition.

    Returns the output and the states after the call.
    """
    gen = torch.Generator().manual_seed(case.seed)
    dims = dict(heads=case.heads, key_dim=case.key_dim, value_dim=case.value_dim)
    inputs = make_inputs(
        gen,
        sum(case.lengths),
        dtype=case.dtype,
        strided=case.strided,
        strong_decay=case.strong_decay,
        key_heads=case.key_heads,
        **dims,
    )
    no_init = [s for s, f in zip(case.slots, case.flags, strict=True) if not f]
    cache = make_cache(gen, strided=case.strided, nan_slots=no_init, **dims)
    before = cache.page.clone()
    scale = case.key_dim**-0.5
    out = torch.full_like(inputs.v, float("nan"))
    o = impl.chunk_gated_delta_rule_varlen(
        *inputs.args(),
        scale=scale,
        query_start_loc=offsets_of(case.lengths),
        states=cache.states,
        state_indices=i32(case.slots),
        has_initial_state=bools(case.flags),
        chunk_size=chunk_size,
        out=out,
    )
    assert o is out
    want_o, finals = reference_batch(
        inputs, case.lengths, case.slots, case.flags, cache.view(before), scale
    )
    assert o.dtype == inputs.v.dtype
    tol, state_tol = chunked_tols(impl, case.dtype)
    assert_close(o, want_o, tol)
    assert_states(cache, before, case.slots, finals, state_tol)
    return o, cache.states.clone()


# Ragged, with zero-length requests (first, middle and last), a 1-token request and
# lengths that are not multiples of any chunk size; slots shuffled, two left unused.
LENGTHS = [0, 37, 1, 16, 0, 50, 0]
SLOTS = [4, 7, 0, 2, 8, 5, 3]
FLAGS = [True, True, False, True, False, False, True]


# ----------------------------------------------------------------------------------
# Torch chunked vs the definition
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunk_size", "strided", "strong_decay"),
    [
        pytest.param(1, False, False, id="c1"),
        pytest.param(3, True, False, id="c3-strided"),
        pytest.param(7, False, True, id="c7-strong-decay"),
        pytest.param(16, True, False, id="c16-strided"),
        pytest.param(64, False, True, id="c64-strong-decay"),
        pytest.param(100, True, False, id="c100-longer-than-every-request"),
    ],
)
def test_torch_chunked_matches_recurrent(
    chunk_size: int, strided: bool, strong_decay: bool
) -> None:
    case = Case(LENGTHS, SLOTS, FLAGS, strided=strided, strong_decay=strong_decay, seed=chunk_size)
    check_chunked(torch_gdn, case, chunk_size)


def test_torch_chunked_bf16() -> None:
    case = Case(LENGTHS, SLOTS, FLAGS, dtype=torch.bfloat16, strided=True, seed=11)
    check_chunked(torch_gdn, case, 16)


def test_torch_chunked_does_not_depend_on_chunk_size() -> None:
    case = Case([45, 3], [1, 6], [True, False], heads=3, key_dim=5, value_dim=4, seed=3)
    outs = [check_chunked(torch_gdn, case, c) for c in (1, 4, 16, 45)]
    for o, states in outs[1:]:
        assert_close(o, outs[0][0], TOLS[torch.float32])
        assert_close(states[[1, 6]], outs[0][1][[1, 6]], STATE_TOLS[torch.float32])


# ----------------------------------------------------------------------------------
# Shared key heads: the oracle vs the recurrence with explicit head sharing
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key_heads", "heads"),
    [
        pytest.param(2, 4, id="Hk2-H4"),
        pytest.param(1, 3, id="Hk1-H3"),
        pytest.param(2, 2, id="Hk2-H2-plain"),
    ],
)
def test_torch_oracle_shares_key_heads(key_heads: int, heads: int) -> None:
    """The oracle's recurrence, chunked form (several chunk sizes) and decode steps
    agree with :func:`shared_head_recurrence`, which indexes key head ``h // (H // Hk)``
    by hand, from an initial state and from zeros."""
    gen = torch.Generator().manual_seed(100 + 10 * key_heads + heads)
    length, scale = 19, 0.3
    inputs = make_inputs(
        gen, length, heads=heads, key_heads=key_heads, key_dim=5, value_dim=4, strided=True
    )
    assert inputs.q.shape == (length, key_heads, 5)
    assert inputs.v.shape == (length, heads, 4)
    init = torch.randn(heads, 5, 4, generator=gen).to(DEVICE)
    tol, state_tol = TOLS[torch.float32], STATE_TOLS[torch.float32]
    for start in (init, None):
        want_o, want_s = shared_head_recurrence(inputs, scale=scale, initial_state=start)
        o, s = gated_delta_rule_recurrent_reference(
            *inputs.args(), scale=scale, initial_state=start
        )
        assert_close(o, want_o, tol)
        assert_close(s, want_s, state_tol)
        for c in (1, 4, 64):
            o, s = run_chunked_one(
                torch_gdn, inputs, scale=scale, initial_state=start, chunk_size=c
            )
            assert_close(o, want_o, tol)
            assert_close(s, want_s, state_tol)
        states = torch.zeros(2, heads, 5, 4, device=DEVICE)
        if start is not None:
            states[1] = start
        for t in range(length):
            o = torch_gdn.fused_recurrent_gated_delta_rule_update(
                *inputs.rows(slice(t, t + 1)).args(),
                scale=scale,
                states=states,
                state_indices=i32([1]),
            )
            assert_close(o[0], want_o[t], tol)
        assert_close(states[1], want_s, state_tol)


# ----------------------------------------------------------------------------------
# Triton vs the torch launchers (and the definition)
# ----------------------------------------------------------------------------------


TRITON_CASES = {
    "fp32-strided": Case(LENGTHS, SLOTS, FLAGS, strided=True, seed=21),
    "fp32-K20-V72-two-value-blocks": Case(
        [19, 0, 2], [6, 1, 3], [True, False, False], key_dim=20, value_dim=72, seed=22
    ),
    "bf16-strided": Case(LENGTHS, SLOTS, FLAGS, dtype=torch.bfloat16, strided=True, seed=23),
    "fp32-strong-decay": Case([33, 1], [2, 0], [True, True], heads=1, strong_decay=True, seed=24),
    # K = 130: four key tiles of 64, the last two mostly past K (masked loads/stores).
    "fp32-K130-V20-four-key-tiles": Case(
        [21, 40], [8, 2], [False, True], heads=1, key_dim=130, value_dim=20, seed=25
    ),
    # Shared key heads (Qwen3-Next: Hk = 16, H = 32): q/k/v views into the model's
    # [T, Hk*K | Hk*K | H*V] conv output; each kernel maps value head h to key head
    # h // (H // Hk).
    "fp32-Hk2-H4-strided": Case(
        LENGTHS,
        SLOTS,
        FLAGS,
        heads=4,
        key_heads=2,
        key_dim=16,
        value_dim=16,
        strided=True,
        seed=26,
    ),
    "bf16-Hk1-H3-K20-V40": Case(
        [40, 0, 7],
        [1, 5, 2],
        [True, False, True],
        heads=3,
        key_heads=1,
        key_dim=20,
        value_dim=40,
        dtype=torch.bfloat16,
        seed=27,
    ),
}


# Every case at chunk 16; the larger chunks on two cases only (interpreter time).
@pytest.mark.parametrize(
    ("case_name", "chunk_size"),
    [
        *((name, 16) for name in TRITON_CASES),
        *((name, c) for name in ("fp32-strided", "fp32-strong-decay") for c in (32, 64)),
        ("fp32-Hk2-H4-strided", 64),
    ],
    ids=lambda x: f"c{x}" if isinstance(x, int) else x,
)
def test_triton_chunked_matches_torch(case_name: str, chunk_size: int) -> None:
    case = TRITON_CASES[case_name]
    o, states = check_chunked(triton_gdn(), case, chunk_size)
    o_ref, states_ref = check_chunked(torch_gdn, case, chunk_size)
    tol, state_tol = chunked_tols(triton_gdn(), case.dtype)
    assert_close(o, o_ref, tol)
    used = torch.tensor(case.slots, dtype=torch.long)
    assert_close(states[used], states_ref[used], state_tol)


# 16-bit inputs take the tensor-core path (16-bit dot operands, float32 accumulation):
# long multi-chunk requests in ragged batches with empty and 1-token requests, requests
# without an initial state over NaN-filled slots, one, two and four key tiles and
# several value tiles, held to the project's tolerance against the float32 definition.
def sixteen_bit_cases(tag: str, dtype: torch.dtype, seed: int) -> dict[str, Case]:
    return {
        f"K128-V40-long-ragged-{tag}": Case(
            [150, 0, 41, 1, 97],
            [3, 8, 0, 5, 6],
            [True, False, False, True, False],
            key_dim=128,
            value_dim=40,
            dtype=dtype,
            seed=seed,
        ),
        f"K256-V72-strided-{tag}": Case(
            [70, 23],
            [2, 7],
            [False, True],
            heads=1,
            key_dim=256,
            value_dim=72,
            dtype=dtype,
            strided=True,
            seed=seed + 1,
        ),
        f"K32-V16-strong-decay-{tag}": Case(
            [130, 5],
            [1, 4],
            [True, False],
            key_dim=32,
            value_dim=16,
            dtype=dtype,
            strong_decay=True,
            seed=seed + 2,
        ),
    }


SIXTEEN_BIT_CASES = {
    **sixteen_bit_cases("bf16", torch.bfloat16, 81),
    **sixteen_bit_cases("fp16", torch.float16, 91),
}


@pytest.mark.parametrize(
    ("case_name", "chunk_size"),
    [
        *((name, 16) for name in SIXTEEN_BIT_CASES if "K128" in name),
        *((name, 64) for name in SIXTEEN_BIT_CASES if "K128" in name),
        *((name, 32) for name in SIXTEEN_BIT_CASES if "K128" not in name),
    ],
    ids=lambda x: f"c{x}" if isinstance(x, int) else x,
)
def test_triton_chunked_16bit_matches_fp32_definition(case_name: str, chunk_size: int) -> None:
    case = SIXTEEN_BIT_CASES[case_name]
    check_chunked(triton_gdn(), case, chunk_size)


@pytest.mark.parametrize(
    ("dtype", "strided", "heads", "key_heads"),
    [
        pytest.param(torch.float32, True, 3, None, id="fp32-strided"),
        pytest.param(torch.bfloat16, False, 3, None, id="bf16"),
        pytest.param(torch.float32, True, 4, 2, id="fp32-strided-Hk2-H4"),
        pytest.param(torch.bfloat16, False, 6, 2, id="bf16-Hk2-H6"),
    ],
)
def test_triton_decode_matches_torch(
    dtype: torch.dtype, strided: bool, heads: int, key_heads: int | None
) -> None:
    gen = torch.Generator().manual_seed(31)
    slots = [5, 0, 8, 2]
    dims = dict(heads=heads, key_dim=12, value_dim=10)
    inputs = make_inputs(gen, len(slots), dtype=dtype, strided=strided, key_heads=key_heads, **dims)
    results = []
    for impl in (torch_gdn, triton_gdn()):
        cache = make_cache(torch.Generator().manual_seed(32), strided=strided, **dims)
        before = cache.page.clone()
        o = impl.fused_recurrent_gated_delta_rule_update(
            *inputs.args(), scale=0.25, states=cache.states, state_indices=i32(slots)
        )
        # The definition, one token per request (with explicit head sharing when
        # key_heads is given).
        finals = []
        for b, slot in enumerate(slots):
            row = inputs.rows(slice(b, b + 1))
            init = cache.view(before)[slot]
            if key_heads is None:
                want_o, want_state = gated_delta_rule_recurrent_reference(
                    *row.args(), scale=0.25, initial_state=init
                )
            else:
                want_o, want_state = shared_head_recurrence(row, scale=0.25, initial_state=init)
            assert_close(o[b], want_o[0], TOLS[dtype])
            finals.append(want_state)
        assert o.dtype == dtype
        assert_states(cache, before, slots, finals, STATE_TOLS[dtype])
        results.append((o, cache.states[slots]))
    assert_close(results[1][0], results[0][0], TOLS[dtype])
    assert_close(results[1][1], results[0][1], STATE_TOLS[dtype])


def test_triton_chunked_edge_batches() -> None:
    """Rows past ``query_start_loc[-1]`` stay untouched; all-empty and empty batches."""
    kernels = triton_gdn()
    gen = torch.Generator().manual_seed(41)
    dims = dict(heads=2, key_dim=4, value_dim=4)
    inputs = make_inputs(gen, 12, **dims)
    cache = make_cache(gen, strided=False, nan_slots=[1], **dims)
    before = cache.states.clone()
    out = torch.full_like(inputs.v, float("nan"))
    # 7 real tokens in 12 rows (a padded batch, e.g. for a CUDA graph); two empty requests.
    kernels.chunk_gated_delta_rule_varlen(
        *inputs.args(),
        scale=0.5,
        query_start_loc=i32([0, 7, 7, 7]),
        states=cache.states,
        state_indices=i32([3, 1, 6]),
        has_initial_state=bools([True, False, True]),
        chunk_size=16,
        out=out,
    )
    assert torch.isnan(out[7:]).all()
    want_o, want_state = gated_delta_rule_recurrent_reference(
        *inputs.rows(slice(0, 7)).args(), scale=0.5, initial_state=before[3]
    )
    assert_close(out[:7], want_o, TOLS[torch.float32])
    assert_close(cache.states[3], want_state, STATE_TOLS[torch.float32])
    # Zero-length requests store their initial state: zeros without one.
    assert torch.equal(cache.states[1], torch.zeros_like(before[1]))
    assert torch.equal(cache.states[6], before[6])

    # T = 0 with one request: still writes the state; B = 0: a no-op.
    empty = inputs.rows(slice(0, 0))
    for qsl, idx, flags in (([0, 0], [2], [False]), ([0], [], [])):
        o = kernels.chunk_gated_delta_rule_varlen(
            *empty.args(),
            scale=0.5,
            query_start_loc=i32(qsl),
            states=cache.states,
            state_indices=i32(idx),
            has_initial_state=bools(flags),
        )
        assert o.shape == (0, 2, 4)
    assert torch.equal(cache.states[2], torch.zeros_like(before[2]))
    o = kernels.fused_recurrent_gated_delta_rule_update(
        *empty.args(), scale=0.5, states=cache.states, state_indices=i32([])
    )
    assert o.shape == (0, 2, 4)


# ----------------------------------------------------------------------------------
# Both implementations: hand-checked numbers and state continuity
# ----------------------------------------------------------------------------------


def run_chunked_one(
    impl: ModuleType,
    inputs: Inputs,
    *,
    scale: float,
    initial_state: Tensor | None,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """One request through ``impl``'s chunked kernel, its state in slot 1 of 3."""
    heads, key_dim = inputs.v.shape[1], inputs.k.shape[2]
    states = torch.full((3, heads, key_dim, inputs.v.shape[2]), float("nan"), device=DEVICE)
    if initial_state is not None:
        states[1] = initial_state
    o = impl.chunk_gated_delta_rule_varlen(
        *inputs.args(),
        scale=scale,
        query_start_loc=i32([0, inputs.q.shape[0]]),
        states=states,
        state_indices=i32([1]),
        has_initial_state=bools([initial_state is not None]),
        chunk_size=chunk_size,
    )
    assert torch.isnan(states[[0, 2]]).all()
    return o, states[1]


def hand_inputs(
    rows: Sequence[tuple[list[float], list[float], list[float], float, float]],
) -> Inputs:
    """``rows`` of ``(q, k, v, alpha, beta)`` for one head."""

    def col(i: int) -> Tensor:
        return torch.tensor([[r[i]] for r in rows], dtype=torch.float32, device=DEVICE)

    return Inputs(
        col(0),
        col(1),
        col(2),
        torch.log(torch.tensor([[r[3]] for r in rows], device=DEVICE)),
        torch.tensor([[r[4]] for r in rows], device=DEVICE),
    )


@pytest.mark.parametrize("impl_name", IMPLS)
def test_hand_computed(impl_name: str) -> None:
    """Tiny cases worked by hand from the definition (all values exact in binary)."""
    impl = impl_of(impl_name)
    chunk_sizes = TRITON_CHUNK_SIZES[:1] if impl_name == "triton" else (1, 2)

    # K = V = 1, scale 0.5, S_0 = 2.
    #   t=0: q=2, k=1, v=4, alpha=0.5, beta=0.25: S' = 1, u = 4 - 1 = 3,
    #        S = 1 + 0.25*3 = 1.75, o = 0.5 * 1.75 * 2 = 1.75.
    #   t=1: q=1, k=0.5, v=-1, alpha=1, beta=0.5: S' = 1.75, u = -1 - 0.875 = -1.875,
    #        S = 1.75 + 0.5*0.5*(-1.875) = 1.28125, o = 0.5 * 1.28125 = 0.640625.
    one = hand_inputs([([2.0], [1.0], [4.0], 0.5, 0.25), ([1.0], [0.5], [-1.0], 1.0, 0.5)])
    s0 = torch.full((1, 1, 1), 2.0, device=DEVICE)
    want_o = torch.tensor([[[1.75]], [[0.640625]]], device=DEVICE)
    want_s = torch.full((1, 1, 1), 1.28125, device=DEVICE)

    # K = V = 2, scale 1, S_0 = 0.
    #   t=0: q=(1,1), k=(1,0), v=(1,2), alpha=1, beta=1: u = v, S = [[1,2],[0,0]],
    #        o = S^T q = (1, 2).
    #   t=1: q=(1,1), k=(0,1), v=(3,4), alpha=0.5, beta=0.5: S' = [[0.5,1],[0,0]],
    #        u = (3,4) - S'^T k = (3,4), S = S' + 0.5*outer((0,1),(3,4)) = [[0.5,1],[1.5,2]],
    #        o = S^T q = (2, 3).
    two = hand_inputs([([1, 1], [1, 0], [1, 2], 1.0, 1.0), ([1, 1], [0, 1], [3, 4], 0.5, 0.5)])
    two = Inputs(two.q.view(2, 1, 2), two.k.view(2, 1, 2), two.v.view(2, 1, 2), two.g, two.beta)
    want_o2 = torch.tensor([[[1.0, 2.0]], [[2.0, 3.0]]], device=DEVICE)
    want_s2 = torch.tensor([[[0.5, 1.0], [1.5, 2.0]]], device=DEVICE)

    exact = Tol(atol=1e-6, rtol=1e-6)
    for inputs, scale, init, o_want, s_want in (
        (one, 0.5, s0, want_o, want_s),
        (two, 1.0, None, want_o2, want_s2),
    ):
        if impl_name == "torch":
            o, s = gated_delta_rule_recurrent_reference(
                *inputs.args(), scale=scale, initial_state=init
            )
            assert_close(o, o_want, exact)
            assert_close(s, s_want, exact)
        for c in chunk_sizes:
            o, s = run_chunked_one(impl, inputs, scale=scale, initial_state=init, chunk_size=c)
            assert_close(o, o_want, exact)
            assert_close(s, s_want, exact)
        # The same two tokens as two decode steps.
        states = torch.zeros(2, *s_want.shape, device=DEVICE)
        if init is not None:
            states[0] = init
        for t in range(2):
            o = impl.fused_recurrent_gated_delta_rule_update(
                *inputs.rows(slice(t, t + 1)).args(),
                scale=scale,
                states=states,
                state_indices=i32([0]),
            )
            assert_close(o[0], o_want[t], exact)
        assert_close(states[0], s_want, exact)


@pytest.mark.parametrize("key_heads", [None, 1], ids=["H2", "Hk1-H2"])
@pytest.mark.parametrize("impl_name", IMPLS)
def test_state_continuity(impl_name: str, key_heads: int | None) -> None:
    """One call == three chunked calls == prefill + token-by-token decode updates."""
    impl = impl_of(impl_name)
    chunk = 16 if impl_name == "triton" else 5
    gen = torch.Generator().manual_seed(51)
    lengths, slots = [23, 6, 18], [4, 1, 7]
    dims = dict(heads=2, key_dim=6, value_dim=5)
    inputs = make_inputs(gen, sum(lengths), key_heads=key_heads, **dims)
    start_cache = make_cache(gen, strided=True, **dims)
    starts = list(itertools.accumulate(lengths, initial=0))
    reqs = [inputs.rows(slice(starts[b], starts[b + 1])) for b in range(len(lengths))]
    scale = 0.4

    def varlen(cache: Cache, pieces: list[Inputs], has_init: bool) -> list[Tensor]:
        cat = Inputs(*(torch.cat(ts) for ts in zip(*(p.args() for p in pieces), strict=True)))
        sizes = [p.q.shape[0] for p in pieces]
        o = impl.chunk_gated_delta_rule_varlen(
            *cat.args(),
            scale=scale,
            query_start_loc=offsets_of(sizes),
            states=cache.states,
            state_indices=i32(slots),
            has_initial_state=bools([has_init] * len(pieces)),
            chunk_size=chunk,
        )
        return list(torch.split(o, sizes))

    def fresh() -> Cache:
        return Cache(start_cache.page.clone(), start_cache.strided, start_cache.key_dim)

    # 1. One call.
    one = fresh()
    outs_one = varlen(one, reqs, True)

    # 2. Three calls (request 1's middle piece is empty).
    three = fresh()
    cuts = [(0, 9, 20), (0, 3, 3), (0, 17, 17)]
    bounds = [[*c, n] for c, n in zip(cuts, lengths, strict=True)]
    outs_three: list[list[Tensor]] = [[] for _ in reqs]
    for step in range(3):
        pieces = [r.rows(slice(bd[step], bd[step + 1])) for r, bd in zip(reqs, bounds, strict=True)]
        for b, o in enumerate(varlen(three, pieces, True)):
            outs_three[b].append(o)

    # 3. Prefill the first cut, then one decode step per token (live requests only).
    dec = fresh()
    prefill = [bd[1] for bd in bounds]
    outs_dec = [
        [o]
        for o in varlen(
            dec, [r.rows(slice(0, n)) for r, n in zip(reqs, prefill, strict=True)], True
        )
    ]
    for t in range(max(lengths)):
        live = [b for b in range(len(reqs)) if prefill[b] + t < lengths[b]]
        if not live:
            break
        rows = [reqs[b].rows(slice(prefill[b] + t, prefill[b] + t + 1)) for b in live]
        step_in = Inputs(*(torch.cat(ts) for ts in zip(*(r.args() for r in rows), strict=True)))
        o = impl.fused_recurrent_gated_delta_rule_update(
            *step_in.args(),
            scale=scale,
            states=dec.states,
            state_indices=i32([slots[b] for b in live]),
        )
        for i, b in enumerate(live):
            outs_dec[b].append(o[i : i + 1])

    tol, state_tol = TOLS[torch.float32], STATE_TOLS[torch.float32]
    for b in range(len(reqs)):
        assert_close(torch.cat(outs_three[b]), outs_one[b], tol)
        assert_close(torch.cat(outs_dec[b]), outs_one[b], tol)
    for cache in (three, dec):
        assert_close(cache.states[slots], one.states[slots], state_tol)
        torch.testing.assert_close(cache.page, one.page, atol=state_tol.atol, rtol=state_tol.rtol)


# ----------------------------------------------------------------------------------
# Property test
# ----------------------------------------------------------------------------------


@settings(max_examples=6, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    chunk_size=st.sampled_from(TRITON_CHUNK_SIZES),
    key_dim=st.integers(1, 17),
    value_dim=st.integers(1, 9),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_chunked_property(
    lengths: list[int],
    chunk_size: int,
    key_dim: int,
    value_dim: int,
    strided: bool,
    seed: int,
    data: st.DataObject,
) -> None:
    """Torch and Triton chunked kernels agree with the definition on random batches."""
    slots = data.draw(st.permutations(range(NUM_SLOTS)))[: len(lengths)]
    flags = data.draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    case = Case(
        lengths, slots, flags, key_dim=key_dim, value_dim=value_dim, strided=strided, seed=seed
    )
    check_chunked(torch_gdn, case, chunk_size)
    if HAS_TRITON:
        check_chunked(triton_gdn(), case, chunk_size)


# ----------------------------------------------------------------------------------
# Launcher errors
# ----------------------------------------------------------------------------------


def chunk_call_args(**override: Any) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(61)
    inputs = make_inputs(gen, 5, heads=2, key_dim=4, value_dim=3)
    args: dict[str, Any] = dict(
        q=inputs.q,
        k=inputs.k,
        v=inputs.v,
        g=inputs.g,
        beta=inputs.beta,
        scale=0.5,
        query_start_loc=i32([0, 2, 5]),
        states=torch.zeros(4, 2, 4, 3, device=DEVICE),
        state_indices=i32([1, 3]),
        has_initial_state=bools([True, False]),
        chunk_size=16,
    )
    args.update(override)
    return args


def decode_call_args(**override: Any) -> dict[str, Any]:
    args = chunk_call_args()
    for name in ("q", "k", "v", "g", "beta"):
        args[name] = args[name][:2]
    for name in ("query_start_loc", "has_initial_state", "chunk_size"):
        del args[name]
    args.update(override)
    return args


def _v_bad_rows() -> Tensor:
    return torch.zeros(4, 2, 3, device=DEVICE)


CHUNK_ERRORS: list[tuple[str, Callable[[], dict[str, Any]], str]] = [
    ("any", lambda: chunk_call_args(v=_v_bad_rows()), r"v: expected shape \[T, H, V\]"),
    (
        "any",
        lambda: chunk_call_args(q=torch.zeros(5, 2, 4, dtype=torch.int32, device=DEVICE)),
        "q: expected a floating-point dtype",
    ),
    (
        "any",
        lambda: chunk_call_args(states=torch.zeros(4, 2, 4, 3, dtype=torch.float16, device=DEVICE)),
        "states: expected dtype torch.float32",
    ),
    (
        "any",
        lambda: chunk_call_args(states=torch.zeros(4, 2, 3, 4, device=DEVICE)),
        r"states: expected shape \[S, H, K, V\]",
    ),
    (
        "any",
        lambda: chunk_call_args(state_indices=torch.tensor([1, 3], device=DEVICE)),
        "state_indices: expected dtype torch.int32",
    ),
    (
        "any",
        lambda: chunk_call_args(has_initial_state=i32([1, 0])),
        "has_initial_state: expected dtype torch.bool",
    ),
    (
        "any",
        lambda: chunk_call_args(out=torch.zeros(5, 2, 3, dtype=torch.float16, device=DEVICE)),
        r"out: expected dtype torch.float32 \(the dtype of v\)",
    ),
    ("any", lambda: chunk_call_args(scale=math.nan), "scale: expected a finite float"),
    ("any", lambda: chunk_call_args(chunk_size=0), "chunk_size: expected an int >= 1"),
    ("any", lambda: chunk_call_args(chunk_size=True), "chunk_size: expected an int >= 1"),
    (
        "torch",
        lambda: chunk_call_args(query_start_loc=i32([0, 2, 4])),
        "query_start_loc: expected last offset",
    ),
    (
        "torch",
        lambda: chunk_call_args(state_indices=i32([3, 3])),
        "state_indices: expected distinct slots",
    ),
    (
        "triton",
        lambda: chunk_call_args(chunk_size=8),
        r"chunk_size: expected one of \(16, 32, 64\)",
    ),
    (
        "triton",
        lambda: chunk_call_args(g=torch.zeros(5, 2, dtype=torch.float64, device=DEVICE)),
        "g: expected dtype in",
    ),
    (
        "triton",
        lambda: chunk_call_args(
            q=torch.zeros(5, 2, 300, device=DEVICE),
            k=torch.zeros(5, 2, 300, device=DEVICE),
            states=torch.zeros(4, 2, 300, 3, device=DEVICE),
        ),
        r"k: expected key dim K in \[1, 256\]",
    ),
]
DECODE_ERRORS: list[tuple[str, Callable[[], dict[str, Any]], str]] = [
    (
        "any",
        lambda: decode_call_args(beta=torch.zeros(2, 3, device=DEVICE)),
        r"beta: expected shape \[B, H\]",
    ),
    (
        "any",
        lambda: decode_call_args(state_indices=i32([1])),
        r"state_indices: expected shape \[B\]",
    ),
    ("torch", lambda: decode_call_args(state_indices=i32([1, 4])), "state_indices: expected slots"),
]


@pytest.mark.parametrize("impl_name", IMPLS)
def test_launcher_errors(impl_name: str) -> None:
    impl = impl_of(impl_name)
    for which, make_args, match in CHUNK_ERRORS:
        if which in ("any", impl_name):
            with pytest.raises(ValueError, match=match):
                impl.chunk_gated_delta_rule_varlen(**make_args())
    for which, make_args, match in DECODE_ERRORS:
        if which in ("any", impl_name):
            with pytest.raises(ValueError, match=match):
                impl.fused_recurrent_gated_delta_rule_update(**make_args())
    # The valid calls that the cases above perturb do run.
    impl.chunk_gated_delta_rule_varlen(**chunk_call_args())
    impl.fused_recurrent_gated_delta_rule_update(**decode_call_args())


def test_recurrent_reference_errors() -> None:
    inputs = make_inputs(torch.Generator().manual_seed(62), 3, heads=2, key_dim=4, value_dim=3)
    with pytest.raises(ValueError, match=r"initial_state: expected shape \[H, K, V\]"):
        gated_delta_rule_recurrent_reference(
            *inputs.args(), scale=1.0, initial_state=torch.zeros(2, 3, 4)
        )
    # q and k have the Hk key heads (fewer than or as many as v's H value heads).
    with pytest.raises(ValueError, match=r"k: expected shape \[L, Hk, K\] = \[3, 2, 4\]"):
        gated_delta_rule_recurrent_reference(
            inputs.q, inputs.k[:, :1], inputs.v, inputs.g, inputs.beta, scale=1.0
        )


# ----------------------------------------------------------------------------------
# Realistic sizes on a GPU
# ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("key_heads", [None, 8], ids=["H16", "Hk8-H16"])
@pytest.mark.parametrize("chunk_size", [32, 64], ids=lambda c: f"c{c}")
def test_chunked_realistic_sizes_on_gpu(chunk_size: int, key_heads: int | None) -> None:
    """T = 4096 over 4 ragged requests, H = 16 (q/k: 16 or 8 heads), K = V = 128, bf16,
    strided states."""
    kernels = triton_gdn()
    lengths, slots, flags = [1500, 1, 2048, 547], [3, 0, 6, 2], [True, False, True, False]
    gen = torch.Generator().manual_seed(71)
    dims = dict(heads=16, key_dim=128, value_dim=128)
    inputs = make_inputs(
        gen, sum(lengths), dtype=torch.bfloat16, strided=True, key_heads=key_heads, **dims
    )
    cache = make_cache(gen, strided=True, nan_slots=[0, 2], **dims)
    ref_cache = Cache(cache.page.clone(), True, 128)
    before = cache.page.clone()
    common = dict(
        scale=128**-0.5,
        query_start_loc=offsets_of(lengths),
        state_indices=i32(slots),
        has_initial_state=bools(flags),
        chunk_size=chunk_size,
    )
    o = kernels.chunk_gated_delta_rule_varlen(*inputs.args(), states=cache.states, **common)
    o_ref = torch_gdn.chunk_gated_delta_rule_varlen(
        *inputs.args(), states=ref_cache.states, **common
    )
    assert_close(o, o_ref, GPU_TOLS)
    finals = [ref_cache.states[s] for s in slots]
    assert_states(cache, before, slots, finals, GPU_CHUNK_STATE_TOLS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("key_heads", [None, 8], ids=["H16", "Hk8-H16"])
def test_decode_realistic_sizes_on_gpu(key_heads: int | None) -> None:
    """64 requests in shuffled slots of a 96-slot cache, H = 16 (q/k: 16 or 8 heads),
    K = V = 128, bf16."""
    kernels = triton_gdn()
    gen = torch.Generator().manual_seed(72)
    inputs = make_inputs(
        gen,
        64,
        heads=16,
        key_dim=128,
        value_dim=128,
        dtype=torch.bfloat16,
        key_heads=key_heads,
    )
    states = torch.randn(96, 16, 128, 128, generator=gen).to(DEVICE) * 0.1
    ref_states = states.clone()
    slots = i32(torch.randperm(96, generator=gen)[:64].tolist())
    o = kernels.fused_recurrent_gated_delta_rule_update(
        *inputs.args(), scale=128**-0.5, states=states, state_indices=slots
    )
    o_ref = torch_gdn.fused_recurrent_gated_delta_rule_update(
        *inputs.args(), scale=128**-0.5, states=ref_states, state_indices=slots
    )
    assert_close(o, o_ref, GPU_TOLS)
    assert_close(states, ref_states, GPU_STATE_TOLS)
