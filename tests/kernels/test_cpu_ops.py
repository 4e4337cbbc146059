"""``torch.ops.attnkit.cpu_paged_decode``: the CPU paged decode as a torch operator.

Checked against the float64 oracle of ``test_cpu_decode`` (eager, and inside
``torch.compile(fullgraph=True)`` graphs: one traced as a single graph by AOTAutograd,
one compiled by Inductor), by ``torch.library.opcheck`` (schema, fake tensor,
autograd registration, AOT dispatch), and with its errors the function's. The same
call through the ctypes function is shown to break ``fullgraph`` tracing, the failure
the operator exists to prevent.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_cpu_decode import TOL, _request_items, make_case, oracle

from attnkit.kernels.attention import cpu_ops
from attnkit.kernels.attention.cpu_decode import native_problem, paged_attention_requests

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


def _args(c: dict[str, Any], out: torch.Tensor, lse: torch.Tensor | None, window: int = 0) -> tuple[Any, ...]:
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
