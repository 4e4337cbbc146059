"""Triton Mamba (1) selective-scan kernels against the torch oracle
(:mod:`attnkit.kernels.mamba1.reference`, itself checked against a token-by-token
definition in ``test_torch_mamba1.py``).

States are handed in as attnkit's runtime does: non-contiguous views into NaN-padded
pages, slots in shuffled order; slots a call does not use stay bit-for-bit unchanged,
and outputs are pre-filled with NaN. Without CUDA the kernels run under the Triton
interpreter on CPU tensors: shapes stay small. GPU-marked tests run larger sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from attnkit.kernels.mamba1 import reference as ref

pytest.importorskip("triton")

from attnkit.kernels.mamba1 import triton as tri

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLS = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
STATE_TOL = (1e-5, 1e-5)


def i32(values: Sequence[int]) -> Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=DEVICE)


def paged_states(gen: torch.Generator, slots: int, channels: int, n: int) -> Tensor:
    """``[S, D, N]`` float32 view into NaN-padded pages, random content."""
    pages = torch.full((slots, channels + 3, n + 2), float("nan"), device=DEVICE)
    view = pages[:, 1 : channels + 1, :n]
    view.copy_(torch.randn(slots, channels, n, generator=gen).to(DEVICE))
    assert not view.is_contiguous()
    return view


def operands(
    gen: torch.Generator, tokens: int, channels: int, n: int, dtype: torch.dtype
) -> dict[str, Tensor]:
    def r(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)

    x_pages = r(tokens, channels + 2).to(dtype)
    return {
        "x": x_pages[:, 1:-1],  # strided rows
        "dt": r(tokens, channels, scale=0.5).to(dtype),
        "A": -(torch.rand(channels, n, generator=gen) * 2 + 0.05).to(DEVICE),
        "B": r(tokens, n).to(dtype),
        "C": r(n, tokens).to(dtype).T,  # transposed: column-major
        "D": r(channels),
        "dt_bias": r(channels, scale=0.3),
    }


OPTIONS = ["all", "plain", "no-softplus"]


def options(ops: dict[str, Tensor], which: str) -> dict[str, object]:
    if which == "all":
        return {"D": ops["D"], "dt_bias": ops["dt_bias"], "dt_softplus": True}
    if which == "plain":
        return {"D": None, "dt_bias": None, "dt_softplus": True}
    return {"D": ops["D"], "dt_bias": ops["dt_bias"].abs(), "dt_softplus": False}


def check_varlen(
    lengths: Sequence[int],
    *,
    channels: int,
    n: int,
    dtype: torch.dtype = torch.float32,
    which: str = "all",
    seed: int = 0,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    ops = operands(gen, sum(lengths), channels, n, dtype)
    if which == "no-softplus":
        ops["dt"] = ops["dt"].abs()
    slots = [5, 0, 3, 2, 6][: len(lengths)]
    flags = [i % 2 == 0 for i in range(len(lengths))]
    qsl = i32([0, *torch.tensor(list(lengths)).cumsum(0).tolist()])
    states = paged_states(gen, 7, channels, n)
    before = states.clone()
    want_states = states.clone()
    kw = options(ops, which)
    args = (ops["x"], ops["dt"], ops["A"], ops["B"], ops["C"])
    common = {
        "query_start_loc": qsl,
        "state_indices": i32(slots),
        "has_initial_state": torch.tensor(flags, device=DEVICE),
    }
    want = ref.selective_scan_varlen(*args, **kw, ssm_states=want_states, **common)
    out = torch.full_like(ops["x"], float("nan"))
    got = tri.selective_scan_varlen(*args, **kw, ssm_states=states, out=out, **common)
    assert got.data_ptr() == out.data_ptr()
    atol, rtol = TOLS[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(
        states[slots], want_states[slots], atol=STATE_TOL[0], rtol=STATE_TOL[1]
    )
    unused = [s for s in range(7) if s not in slots]
    torch.testing.assert_close(states[unused], before[unused], atol=0.0, rtol=0.0, equal_nan=True)


@pytest.mark.parametrize("which", OPTIONS)
def test_varlen_matches_oracle_on_ragged_batches(which: str) -> None:
    check_varlen([5, 0, 1, 9], channels=6, n=4, which=which)


def test_varlen_several_channel_tiles_and_odd_state_size() -> None:
    # N = 5 pads to 8; D = 70 needs two BLOCK_D = 64 tiles, the last one masked.
    check_varlen([3, 4], channels=70, n=5, seed=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_varlen_low_precision_inputs(dtype: torch.dtype) -> None:
    check_varlen([4, 2, 6], channels=8, n=4, dtype=dtype, seed=2)


def test_varlen_only_empty_requests_store_their_initial_states() -> None:
    gen = torch.Generator().manual_seed(3)
    ops = operands(gen, 0, 4, 4, torch.float32)
    states = paged_states(gen, 3, 4, 4)
    before = states.clone()
    tri.selective_scan_varlen(
        ops["x"],
        ops["dt"],
        ops["A"],
        ops["B"],
        ops["C"],
        D=None,
        dt_bias=None,
        dt_softplus=True,
        query_start_loc=i32([0, 0, 0]),
        ssm_states=states,
        state_indices=i32([2, 0]),
        has_initial_state=torch.tensor([True, False], device=DEVICE),
    )
    torch.testing.assert_close(states[2], before[2], atol=0.0, rtol=0.0)
    assert bool((states[0] == 0).all())
    torch.testing.assert_close(states[1], before[1], atol=0.0, rtol=0.0)


@pytest.mark.parametrize("which", OPTIONS)
def test_update_matches_oracle(which: str) -> None:
    gen = torch.Generator().manual_seed(4)
    ops = operands(gen, 3, 6, 4, torch.float32)
    if which == "no-softplus":
        ops["dt"] = ops["dt"].abs()
    states = paged_states(gen, 5, 6, 4)
    before, want_states = states.clone(), states.clone()
    slots = [4, 1, 2]
    kw = options(ops, which)
    args = (ops["x"], ops["dt"], ops["A"], ops["B"], ops["C"])
    want = ref.selective_scan_update(*args, **kw, ssm_states=want_states, state_indices=i32(slots))
    got = tri.selective_scan_update(*args, **kw, ssm_states=states, state_indices=i32(slots))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[slots], want_states[slots], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[[0, 3]], before[[0, 3]], atol=0.0, rtol=0.0)


def test_prefill_then_updates_continue_the_sequence() -> None:
    """Varlen over a prefix, then one-token updates == varlen over the whole sequence."""
    gen = torch.Generator().manual_seed(5)
    ops = operands(gen, 7, 5, 3, torch.float32)
    kw = {"D": ops["D"], "dt_bias": ops["dt_bias"], "dt_softplus": True}
    whole = torch.zeros(1, 5, 3, device=DEVICE)
    want = ref.selective_scan_varlen(
        ops["x"],
        ops["dt"],
        ops["A"],
        ops["B"],
        ops["C"],
        **kw,
        query_start_loc=i32([0, 7]),
        ssm_states=whole,
        state_indices=i32([0]),
        has_initial_state=torch.tensor([False], device=DEVICE),
    )
    states = torch.full((2, 5, 3), float("nan"), device=DEVICE)
    parts = [
        tri.selective_scan_varlen(
            ops["x"][:4],
            ops["dt"][:4],
            ops["A"],
            ops["B"][:4],
            ops["C"][:4],
            **kw,
            query_start_loc=i32([0, 4]),
            ssm_states=states,
            state_indices=i32([1]),
            has_initial_state=torch.tensor([False], device=DEVICE),
        )
    ]
    for t in range(4, 7):
        s = slice(t, t + 1)
        parts.append(
            tri.selective_scan_update(
                ops["x"][s],
                ops["dt"][s],
                ops["A"],
                ops["B"][s],
                ops["C"][s],
                **kw,
                ssm_states=states,
                state_indices=i32([1]),
            )
        )
    torch.testing.assert_close(torch.cat(parts), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[1], whole[0], atol=1e-5, rtol=1e-5)
    assert bool(states[0].isnan().all())


def test_launchers_reject_bad_operands() -> None:
    gen = torch.Generator().manual_seed(6)
    ops = operands(gen, 3, 4, 2, torch.float32)
    states = torch.zeros(3, 4, 2, device=DEVICE)
    args = (ops["x"], ops["dt"], ops["A"], ops["B"], ops["C"])
    kw = {"D": None, "dt_bias": None, "dt_softplus": True}
    with pytest.raises(
        ValueError, match=r"^ssm_states: expected dtype torch.float32, got torch.float64$"
    ):
        tri.selective_scan_update(
            *args, **kw, ssm_states=states.double(), state_indices=i32([0, 1, 2])
        )
    with pytest.raises(ValueError, match=r"^B: expected dtype in .*, got torch.float64$"):
        tri.selective_scan_update(
            ops["x"],
            ops["dt"],
            ops["A"],
            ops["B"].double(),
            ops["C"],
            **kw,
            ssm_states=states,
            state_indices=i32([0, 1, 2]),
        )
    with pytest.raises(ValueError, match=r"^state_indices: "):
        tri.selective_scan_update(*args, **kw, ssm_states=states, state_indices=i32([0, 1]))
    with pytest.raises(
        ValueError, match=r"^out: expected the dtype of x \(torch.float32\), got torch.float16$"
    ):
        tri.selective_scan_varlen(
            *args,
            **kw,
            query_start_loc=i32([0, 3]),
            ssm_states=states,
            state_indices=i32([0]),
            has_initial_state=torch.tensor([False], device=DEVICE),
            out=torch.empty(3, 4, dtype=torch.float16, device=DEVICE),
        )
    with pytest.raises(ValueError, match=r"^query_start_loc: "):
        tri.selective_scan_varlen(
            *args,
            **kw,
            query_start_loc=i32([0, 3]).long(),
            ssm_states=states,
            state_indices=i32([0]),
            has_initial_state=torch.tensor([False], device=DEVICE),
        )


def test_no_tensor_core_kernels_declared() -> None:
    assert tri.TENSOR_CORE_KERNELS == ()


# ---------------------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_jamba_sized_varlen_and_update(dtype: torch.dtype) -> None:
    """Jamba-like channels (d_inner 1024 of 8192, N 16) over a ragged batch."""
    check_varlen([300, 0, 37, 700], channels=1024, n=16, dtype=dtype, seed=7)
    gen = torch.Generator().manual_seed(8)
    ops = operands(gen, 64, 1024, 16, dtype)
    states = paged_states(gen, 80, 1024, 16)
    want_states = states.clone()
    slots = i32(torch.randperm(80, generator=gen)[:64].tolist())
    args = (ops["x"], ops["dt"], ops["A"], ops["B"], ops["C"])
    kw = {"D": ops["D"], "dt_bias": ops["dt_bias"], "dt_softplus": True}
    want = ref.selective_scan_update(*args, **kw, ssm_states=want_states, state_indices=slots)
    got = tri.selective_scan_update(*args, **kw, ssm_states=states, state_indices=slots)
    atol, rtol = TOLS[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(states, want_states, atol=1e-4, rtol=1e-4, equal_nan=True)
