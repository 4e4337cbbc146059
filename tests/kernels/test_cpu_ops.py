"""``torch.ops.attnkit.cpu_paged_decode`` and ``cpu_paged_prefill``: the CPU engines as
torch operators.

Checked against the float64 oracles of ``test_cpu_decode`` and ``test_cpu_prefill``
(eager, and inside
``torch.compile(fullgraph=True)`` graphs: one traced as a single graph by AOTAutograd,
one compiled by Inductor), by ``torch.library.opcheck`` (schema, fake tensor,
autograd registration, AOT dispatch), and with their errors the functions'. The same
calls through the functions are shown to break ``fullgraph`` tracing, the failure the
operators exist to prevent.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from test_cpu_decode import TOL, _request_items, make_case, oracle
from test_cpu_prefill import SENTINEL, Case, Req, build
from test_cpu_prefill import _check as check_prefill

from attnkit.kernels.attention import cpu_ops
from attnkit.kernels.attention.cpu_decode import native_problem, paged_attention_requests
from attnkit.kernels.attention.cpu_prefill import paged_prefill

_PROBLEM = native_problem()
if _PROBLEM is not None and _PROBLEM.startswith("no C compiler"):  # pragma: no cover
    pytest.skip(f"native CPU kernels unavailable: {_PROBLEM}", allow_module_level=True)

HQ, HKV, D, BS = 8, 2, 64, 16
QLEN = [1, 3, 1]
SEQ = [37, 20, 50]


def _case(dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    qsl = [0]
    for n in QLEN:
        qsl.append(qsl[-1] + n)
    width = -(-max(SEQ) // BS)
    q, k, v, table = make_case(
        dtype=dtype, hq=HQ, hkv=HKV, d=D, bs=BS, ranges=[(0, s) for s in SEQ], width=width
    )
    q = q[: qsl[-1]].contiguous()
    return {
        "q": q,
        "k": k,
        "v": v,
        "table": table,
        "qsl": torch.tensor(qsl, dtype=torch.int32),
        "seq": torch.tensor(SEQ, dtype=torch.int32),
        "qsl_list": qsl,
    }


def _args(
    c: dict[str, Any], out: torch.Tensor, lse: torch.Tensor | None, window: int = 0
) -> tuple[Any, ...]:
    return (
        c["q"], c["k"], c["v"], c["table"], c["qsl"], c["seq"], None, out, lse,
        BS, True, window, 0, D**-0.5, 0.0, None, None, None, None,
    )  # fmt: skip


def _check(c: dict[str, Any], out: torch.Tensor, lse: torch.Tensor, window: int | None) -> None:
    items = _request_items(c["qsl_list"], SEQ, [0, 1, 2], True, window, None)
    want_lse: dict[int, torch.Tensor] = {}
    want = oracle(c["q"], c["k"], c["v"], c["table"], *items, BS, D**-0.5, lse=want_lse)
    for row, w in want.items():
        err = (out[row].double() - w).abs().max().item()
        assert err <= TOL[out.dtype], f"row {row}: output error {err:.3g}"
        lerr = (lse[row].double() - want_lse[row]).abs().max().item()
        assert lerr <= 1e-4, f"row {row}: lse error {lerr:.3g}"


@pytest.mark.parametrize("window", [None, 7])
def test_the_operator_matches_the_oracle(window: int | None) -> None:
    c = _case()
    out, lse = torch.empty_like(c["q"]), torch.empty(c["q"].shape[0], HQ)
    torch.ops.attnkit.cpu_paged_decode(*_args(c, out, lse, window or 0))
    _check(c, out, lse, window)


def test_opcheck() -> None:
    assert str(torch.ops.attnkit.cpu_paged_decode.default._schema) == "attnkit::" + cpu_ops.SCHEMA
    c = _case()
    out, lse = torch.empty_like(c["q"]), torch.empty(c["q"].shape[0], HQ)
    torch.library.opcheck(torch.ops.attnkit.cpu_paged_decode.default, _args(c, out, lse))


def _layer(c: dict[str, Any]) -> Any:
    def step(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], HQ)
        torch.ops.attnkit.cpu_paged_decode(*_args({**c, "q": q * 1.0}, out, lse))
        return out + 0.0, lse

    return step


# Inductor's own code path calls a deprecated torch.jit helper (a torch warning, not ours).
@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.* is deprecated:DeprecationWarning")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_with_fullgraph(backend: str) -> None:
    """The call traces as one graph (``fullgraph=True`` refuses a break), with work on
    both sides of it, and the compiled result is the oracle's."""
    torch._dynamo.reset()
    c = _case()
    step = torch.compile(_layer(c), fullgraph=True, backend=backend)
    out, lse = step(c["q"])
    _check(c, out, lse, None)


def test_errors_are_the_functions() -> None:
    c = _case()
    out = torch.empty_like(c["q"])
    bad = {**c, "seq": torch.tensor([37, 20, 500], dtype=torch.int32)}
    with pytest.raises(ValueError, match="request 2"):
        torch.ops.attnkit.cpu_paged_decode(*_args(bad, out, None))
    with pytest.raises(ValueError, match="window"):
        torch.ops.attnkit.cpu_paged_decode(*_args(c, out, None, window=-3))


def test_the_direct_call_breaks_fullgraph_tracing() -> None:
    """The broken variant: the same attention through the ctypes function instead of
    the operator cannot be traced as one graph, which ``test_compiled_with_fullgraph``
    shows the operator can."""
    torch._dynamo.reset()
    c = _case()

    def step(q: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        paged_attention_requests(
            q * 1.0, c["k"], c["v"], c["table"], c["qsl"], c["seq"], None, block_size=BS,
            causal=True, window=None, chunk=None, scale=D**-0.5, output=out,
        )  # fmt: skip
        return out + 0.0

    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(step, fullgraph=True, backend="aot_eager")(c["q"])


# ---------------------------------------------------------------- the prefill operator

# Two requests: a chunk of 6 over 9 cached tokens, and a fresh prompt of 7 read from the
# step's key/value rows (test_cpu_prefill's harness: NaN where nothing should be read).
_PREFILL = Case([Req(qlen=6, seq=15), Req(qlen=7, seq=7, from_key=True)], with_lse=True)


def _prefill_args(
    data: dict[str, Any], out: torch.Tensor, lse: torch.Tensor | None, c: Case = _PREFILL
) -> tuple[Any, ...]:
    def ints(name: str) -> torch.Tensor:
        return torch.from_numpy(data[name].copy())

    return (
        data["query"], data["k_plane"], data["v_plane"], data["block_table"],
        ints("requests"), ints("query_start"), ints("query_lens"), ints("seq_lens"),
        out, lse, c.block_size, c.causal, c.window or 0, c.chunk or 0, c.d**-0.5, 0.0,
        None, data["key"], data["value"], None, None, None,
    )  # fmt: skip


def _prefill_outputs(data: dict[str, Any], c: Case = _PREFILL) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full_like(data["query"], SENTINEL)
    lse_big = torch.full((out.shape[0], 2 * c.hq), SENTINEL)
    return out, lse_big


@pytest.mark.parametrize("window", [None, 4])
def test_the_prefill_operator_matches_the_oracle(window: int | None) -> None:
    c = dataclasses.replace(_PREFILL, window=window)
    data = build(c, seed=5)
    out, lse_big = _prefill_outputs(data, c)
    torch.ops.attnkit.cpu_paged_prefill(*_prefill_args(data, out, lse_big[:, ::2], c))
    check_prefill(c, data, c.d**-0.5, out, lse_big)


def test_prefill_opcheck() -> None:
    op = torch.ops.attnkit.cpu_paged_prefill.default
    assert str(op._schema) == "attnkit::" + cpu_ops.PREFILL_SCHEMA
    data = build(_PREFILL, seed=5)
    out, lse_big = _prefill_outputs(data)
    torch.library.opcheck(op, _prefill_args(data, out, lse_big[:, ::2].contiguous()))


@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.* is deprecated:DeprecationWarning")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_prefill_compiled_with_fullgraph(backend: str) -> None:
    torch._dynamo.reset()
    data = build(_PREFILL, seed=5)

    def step(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.full_like(q, SENTINEL)
        lse = torch.full((q.shape[0], 2 * _PREFILL.hq), SENTINEL)
        torch.ops.attnkit.cpu_paged_prefill(
            *_prefill_args({**data, "query": q * 1.0}, out, lse[:, ::2])
        )
        return out + 0.0, lse

    out, lse_big = torch.compile(step, fullgraph=True, backend=backend)(data["query"])
    check_prefill(_PREFILL, data, _PREFILL.d**-0.5, out, lse_big)


def test_prefill_errors_are_the_functions() -> None:
    data = build(_PREFILL, seed=5)
    out, _ = _prefill_outputs(data)
    args = list(_prefill_args(data, out, None))
    args[4] = args[4].to(torch.int32)
    with pytest.raises(
        ValueError, match=r"requests: expected a 1-D int64 tensor on cpu, got torch.int32"
    ):
        torch.ops.attnkit.cpu_paged_prefill(*args)
    args = list(_prefill_args(data, out, None))
    args[12] = -2  # window
    with pytest.raises(ValueError, match="window"):
        torch.ops.attnkit.cpu_paged_prefill(*args)
    assert (out == SENTINEL).all()  # a refused call wrote nothing


def test_the_direct_prefill_call_breaks_fullgraph_tracing() -> None:
    """The broken variant: the same prefill through the function (numpy vectors, the
    ctypes call) instead of the operator breaks the graph."""
    torch._dynamo.reset()
    data = build(_PREFILL, seed=5)

    def step(q: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        paged_prefill(
            q * 1.0, data["k_plane"], data["v_plane"], data["block_table"], data["requests"],
            data["query_start"], data["query_lens"], data["seq_lens"],
            block_size=_PREFILL.block_size, causal=True, window=None, chunk=None,
            scale=_PREFILL.d**-0.5, output=out, key=data["key"], value=data["value"],
        )  # fmt: skip
        return out + 0.0

    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(step, fullgraph=True, backend="aot_eager")(data["query"])
