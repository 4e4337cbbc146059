"""The torch Mamba (1) selective-scan oracle against a plain token-by-token definition
(Gu & Dao 2023, arXiv:2312.00752, Algorithm 2), written here channel by channel."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.kernels.mamba1.reference import (
    mamba1_projections,
    selective_scan_update,
    selective_scan_varlen,
)

TOL = 1e-5


def softplus(v: float) -> float:
    return v if v > 20 else math.log1p(math.exp(v))


def scan_definition(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    softplus_dt: bool,
    h0: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, scalar by scalar: h[d,n] = exp(dt'[d] A[d,n]) h[d,n] + dt'[d] B[n] x[d];
    y[d] = sum_n C[n] h[d,n] + D[d] x[d]."""
    length, channels = x.shape
    n_state = A.shape[1]
    h = [[0.0] * n_state for _ in range(channels)] if h0 is None else h0.double().tolist()
    y = torch.zeros(length, channels, dtype=torch.float64)
    for t in range(length):
        for d in range(channels):
            step = float(dt[t, d]) + (float(dt_bias[d]) if dt_bias is not None else 0.0)
            if softplus_dt:
                step = softplus(step)
            acc = 0.0
            for n in range(n_state):
                h[d][n] = math.exp(step * float(A[d, n])) * h[d][n] + step * float(B[t, n]) * float(
                    x[t, d]
                )
                acc += float(C[t, n]) * h[d][n]
            if D is not None:
                acc += float(D[d]) * float(x[t, d])
            y[t, d] = acc
    return y, torch.tensor(h, dtype=torch.float64)


def _operands(
    gen: torch.Generator, tokens: int, channels: int = 6, n_state: int = 4
) -> dict[str, torch.Tensor]:
    return {
        "x": torch.randn(tokens, channels, generator=gen),
        "dt": torch.randn(tokens, channels, generator=gen) * 0.5,
        "A": -torch.rand(channels, n_state, generator=gen) * 2 - 0.1,
        "B": torch.randn(tokens, n_state, generator=gen),
        "C": torch.randn(tokens, n_state, generator=gen),
        "D": torch.randn(channels, generator=gen),
        "dt_bias": torch.randn(channels, generator=gen) * 0.3,
    }


@pytest.mark.parametrize("softplus_dt", [True, False])
def test_varlen_matches_definition_on_a_ragged_batch(softplus_dt: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    lens = [5, 0, 1, 7]
    ops = _operands(gen, sum(lens))
    if not softplus_dt:
        ops["dt"], ops["dt_bias"] = ops["dt"].abs(), ops["dt_bias"].abs()
    states = torch.full((6, 6, 4), float("nan"))
    slots = [4, 0, 2, 5]
    has_init = [True, False, True, False]
    init = {s: torch.randn(6, 4, generator=gen) for s, f in zip(slots, has_init, strict=True) if f}
    for s, v in init.items():
        states[s] = v
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    y = selective_scan_varlen(
        ops["x"],
        ops["dt"],
        ops["A"],
        ops["B"],
        ops["C"],
        D=ops["D"],
        dt_bias=ops["dt_bias"],
        dt_softplus=softplus_dt,
        query_start_loc=qsl,
        ssm_states=states,
        state_indices=torch.tensor(slots, dtype=torch.int32),
        has_initial_state=torch.tensor(has_init),
    )
    for b, (slot, flag) in enumerate(zip(slots, has_init, strict=True)):
        rows = slice(int(qsl[b]), int(qsl[b + 1]))
        want_y, want_h = scan_definition(
            ops["x"][rows],
            ops["dt"][rows],
            ops["A"],
            ops["B"][rows],
            ops["C"][rows],
            ops["D"],
            ops["dt_bias"],
            softplus_dt,
            init.get(slot) if flag else None,
        )
        torch.testing.assert_close(y[rows].double(), want_y, atol=TOL, rtol=TOL)
        torch.testing.assert_close(states[slot].double(), want_h, atol=TOL, rtol=TOL)
    # Slots no request used keep their (NaN) content.
    assert bool(states[[1, 3]].isnan().all())


def test_chunks_continue_from_the_cached_state_and_update_matches() -> None:
    """Prefill in two calls, then single-step updates == the whole sequence at once."""
    gen = torch.Generator().manual_seed(1)
    ops = _operands(gen, 10)
    want_y, want_h = scan_definition(
        ops["x"], ops["dt"], ops["A"], ops["B"], ops["C"], ops["D"], ops["dt_bias"], True, None
    )
    states = torch.full((3, 6, 4), float("nan"))
    slot = torch.tensor([1], dtype=torch.int32)
    common = {"A": ops["A"], "D": ops["D"], "dt_bias": ops["dt_bias"], "dt_softplus": True}
    parts = []
    for start, end, flag in ((0, 4, False), (4, 7, True)):
        parts.append(
            selective_scan_varlen(
                ops["x"][start:end],
                ops["dt"][start:end],
                B=ops["B"][start:end],
                C=ops["C"][start:end],
                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                ssm_states=states,
                state_indices=slot,
                has_initial_state=torch.tensor([flag]),
                **common,
            )
        )
    for t in range(7, 10):
        parts.append(
            selective_scan_update(
                ops["x"][t : t + 1],
                ops["dt"][t : t + 1],
                B=ops["B"][t : t + 1],
                C=ops["C"][t : t + 1],
                ssm_states=states,
                state_indices=slot,
                **common,
            )
        )
    torch.testing.assert_close(torch.cat(parts).double(), want_y, atol=TOL, rtol=TOL)
    torch.testing.assert_close(states[1].double(), want_h, atol=TOL, rtol=TOL)
    assert bool(states[[0, 2]].isnan().all())


def test_update_batches_requests_in_their_own_slots() -> None:
    gen = torch.Generator().manual_seed(2)
    ops = _operands(gen, 3)
    states = torch.randn(5, 6, 4, generator=gen)
    before = states.clone()
    slots = [3, 0, 4]
    y = selective_scan_update(
        ops["x"],
        ops["dt"],
        ops["A"],
        ops["B"],
        ops["C"],
        D=None,
        dt_bias=None,
        dt_softplus=True,
        ssm_states=states,
        state_indices=torch.tensor(slots, dtype=torch.int32),
    )
    for b, slot in enumerate(slots):
        want_y, want_h = scan_definition(
            ops["x"][b : b + 1],
            ops["dt"][b : b + 1],
            ops["A"],
            ops["B"][b : b + 1],
            ops["C"][b : b + 1],
            None,
            None,
            True,
            before[slot],
        )
        torch.testing.assert_close(y[b : b + 1].double(), want_y, atol=TOL, rtol=TOL)
        torch.testing.assert_close(states[slot].double(), want_h, atol=TOL, rtol=TOL)
    torch.testing.assert_close(states[[1, 2]], before[[1, 2]], atol=0.0, rtol=0.0)


def test_half_precision_inputs_accumulate_in_float32() -> None:
    gen = torch.Generator().manual_seed(3)
    ops = _operands(gen, 6)
    x16 = ops["x"].to(torch.bfloat16)
    states = torch.zeros(1, 6, 4)
    y = selective_scan_varlen(
        x16,
        ops["dt"].to(torch.bfloat16),
        ops["A"],
        ops["B"].to(torch.bfloat16),
        ops["C"].to(torch.bfloat16),
        D=ops["D"],
        dt_bias=ops["dt_bias"],
        dt_softplus=True,
        query_start_loc=torch.tensor([0, 6], dtype=torch.int32),
        ssm_states=states,
        state_indices=torch.tensor([0], dtype=torch.int32),
        has_initial_state=torch.tensor([False]),
    )
    assert y.dtype == torch.bfloat16
    want_y, want_h = scan_definition(
        x16.float(),
        ops["dt"].to(torch.bfloat16).float(),
        ops["A"],
        ops["B"].to(torch.bfloat16).float(),
        ops["C"].to(torch.bfloat16).float(),
        ops["D"],
        ops["dt_bias"],
        True,
        None,
    )
    torch.testing.assert_close(y.double(), want_y, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(states[0].double(), want_h, atol=TOL, rtol=TOL)


def test_projections_match_the_plain_definition() -> None:
    gen = torch.Generator().manual_seed(4)
    channels, rank, n_state, eps = 6, 3, 4, 1e-6
    u = torch.randn(5, channels, generator=gen)
    xw = torch.randn(rank + 2 * n_state, channels, generator=gen)
    dw = torch.randn(channels, rank, generator=gen)
    norms = [torch.rand(k, generator=gen) + 0.5 for k in (rank, n_state, n_state)]

    def rms(v: list[float], w: torch.Tensor) -> list[float]:
        scale = 1.0 / math.sqrt(sum(e * e for e in v) / len(v) + eps)
        return [e * scale * float(w[i]) for i, e in enumerate(v)]

    for use_norm in (False, True):
        dt, b, c = mamba1_projections(
            u,
            xw,
            dw,
            dt_norm_weight=norms[0] if use_norm else None,
            B_norm_weight=norms[1] if use_norm else None,
            C_norm_weight=norms[2] if use_norm else None,
            norm_eps=eps,
        )
        for t in range(5):
            proj = [
                sum(float(xw[r, d]) * float(u[t, d]) for d in range(channels))
                for r in range(xw.shape[0])
            ]
            low, bb, cc = proj[:rank], proj[rank : rank + n_state], proj[rank + n_state :]
            if use_norm:
                low, bb, cc = rms(low, norms[0]), rms(bb, norms[1]), rms(cc, norms[2])
            want_dt = [sum(float(dw[d, r]) * low[r] for r in range(rank)) for d in range(channels)]
            torch.testing.assert_close(
                dt[t].double(), torch.tensor(want_dt, dtype=torch.float64), atol=1e-4, rtol=1e-4
            )
            torch.testing.assert_close(
                b[t].double(), torch.tensor(bb, dtype=torch.float64), atol=1e-4, rtol=1e-4
            )
            torch.testing.assert_close(
                c[t].double(), torch.tensor(cc, dtype=torch.float64), atol=1e-4, rtol=1e-4
            )


def test_bad_operands_name_the_argument() -> None:
    gen = torch.Generator().manual_seed(5)
    ops = _operands(gen, 3)
    states = torch.zeros(2, 6, 4)
    kw = {
        "D": None,
        "dt_bias": None,
        "dt_softplus": True,
        "state_indices": torch.tensor([0, 1, 1], dtype=torch.int32),
    }
    with pytest.raises(ValueError, match=r"^A: expected shape \[D, N\] = \[6, \*\], got \[4, 6\]$"):
        selective_scan_update(
            ops["x"], ops["dt"], ops["A"].T, ops["B"], ops["C"], ssm_states=states, **kw
        )
    with pytest.raises(
        ValueError, match=r"^ssm_states: expected dtype torch.float32, got torch.float16$"
    ):
        selective_scan_update(
            ops["x"], ops["dt"], ops["A"], ops["B"], ops["C"], ssm_states=states.half(), **kw
        )
    with pytest.raises(ValueError, match=r"^C: expected shape \[B, N\] = \[3, 4\], got \[3, 5\]$"):
        selective_scan_update(
            ops["x"], ops["dt"], ops["A"], ops["B"], torch.zeros(3, 5), ssm_states=states, **kw
        )
    with pytest.raises(ValueError, match="state_indices"):
        selective_scan_update(
            ops["x"], ops["dt"], ops["A"], ops["B"], ops["C"], ssm_states=states, **kw
        )
    with pytest.raises(ValueError, match=r"x_proj_weight: expected R \+ 2N rows with R = 2"):
        mamba1_projections(ops["x"], torch.zeros(5, 6), torch.zeros(6, 2))
