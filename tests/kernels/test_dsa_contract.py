"""The DSA ops' contract: the torch references and the Triton launchers refuse the same
bad arguments with the same message (both call ``attnkit.kernels.dsa.contract``), and
each refusal names the argument. A launcher that drops a contract check is caught."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

import attnkit.kernels.dsa.reference as reference_ops

triton_ops = pytest.importorskip("attnkit.kernels.dsa.triton")

D, BS, NB, T, H, L, R = 128, 4, 3, 2, 2, 8, 32


def cache() -> torch.Tensor:
    return torch.zeros(NB, BS, D + 4, dtype=torch.uint8)


def qsl() -> dict[str, Any]:
    return {
        "query_start_loc": torch.tensor([0, T], dtype=torch.int32),
        "seq_lens": torch.tensor([T], dtype=torch.int32),
        "block_table": torch.tensor([[1, 2]], dtype=torch.int32),
    }


def write(ops: ModuleType, **bad: Any) -> None:
    args = {
        "keys": torch.zeros(T, D),
        "index_cache": cache(),
        "slot_mapping": torch.tensor([4, 5], dtype=torch.int64),
    }
    ops.write_index_cache(**{**args, **bad})


def logits(ops: ModuleType, **bad: Any) -> None:
    args = {
        "q": torch.zeros(T, H, D),
        "weights": torch.zeros(T, H),
        "index_cache": cache(),
        "max_seq_len": L,
        **qsl(),
    }
    ops.indexer_logits(**{**args, **bad})


def topk(ops: ModuleType, **bad: Any) -> None:
    args = {"logits": torch.zeros(T, L), "block_size": BS, "topk": 2, **qsl()}
    ops.topk_select(**{**args, **bad})


def sparse(ops: ModuleType, **bad: Any) -> None:
    args = {
        "query": torch.zeros(T, H, R + 16),
        "latent_cache": torch.zeros(NB, BS, R + 16),
        "indices": torch.zeros(T, 2, dtype=torch.int32),
        "lens": torch.ones(T, dtype=torch.int32),
        "kv_lora_rank": R,
        "scale": 1.0,
    }
    ops.sparse_mla_attention(**{**args, **bad})


# (op, the bad argument, its value, the start of the message)
CASES: list[tuple[Callable[..., None], str, Any, str]] = [
    (write, "index_cache", torch.zeros(NB, BS, D + 4), "index_cache: expected dtype torch.uint8"),
    (
        write,
        "index_cache",
        torch.zeros(NB, BS, 100, dtype=torch.uint8),
        "index_cache: expected a row width",
    ),
    (write, "keys", torch.zeros(T, 64), "keys:"),
    (write, "keys", torch.zeros(T, D, dtype=torch.float64), "keys: expected dtype in"),
    (
        write,
        "slot_mapping",
        torch.tensor([4, 5], dtype=torch.int32),
        "slot_mapping: expected dtype torch.int64",
    ),
    (write, "slot_mapping", torch.tensor([4], dtype=torch.int64), "slot_mapping:"),
    (logits, "q", torch.zeros(T, H, D, dtype=torch.float64), "q: expected dtype in"),
    (logits, "weights", torch.zeros(T, H + 1), "weights:"),
    (logits, "max_seq_len", 0, "max_seq_len"),
    (logits, "window", 0, "window"),
    (topk, "topk", 0, "topk"),
    (topk, "block_size", 0, "block_size"),
    (topk, "window", -1, "window"),
    (topk, "logits", torch.zeros(L), "logits:"),
    (sparse, "query", torch.zeros(T, R + 16), "query: expected shape [T, H, D]"),
    (sparse, "latent_cache", torch.zeros(NB, BS, R), "latent_cache:"),
    (sparse, "kv_lora_rank", R + 17, "kv_lora_rank"),
    (
        sparse,
        "indices",
        torch.zeros(T, 2, dtype=torch.int64),
        "indices: expected dtype torch.int32",
    ),
    (sparse, "lens", torch.ones(T + 1, dtype=torch.int32), "lens:"),
    (sparse, "output", torch.zeros(T, H, R + 1), "output:"),
    (sparse, "lse", torch.zeros(T, H + 1), "lse:"),
]


def refusal(op: Callable[..., None], ops: ModuleType, name: str, value: Any) -> str | None:
    """The message ``op`` of ``ops`` refuses the bad argument with, ``None`` if it runs."""
    try:
        op(ops, **{name: value})
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def disagreements() -> list[str]:
    out = []
    for op, name, value, start in CASES:
        ref, tri = refusal(op, reference_ops, name, value), refusal(op, triton_ops, name, value)
        where = f"{op.__name__}({name}=...)"
        if ref is None or tri is None or ref != tri:
            out.append(f"{where}: reference {ref!r}, triton {tri!r}")
        elif start not in ref:
            out.append(f"{where}: {ref!r} does not name {start!r}")
    return out


def test_the_good_calls_run_on_both() -> None:
    for op in (write, logits, topk, sparse):
        for ops in (reference_ops, triton_ops):
            op(ops)


def test_both_implementations_refuse_alike() -> None:
    assert disagreements() == []


def test_broken_a_launcher_without_the_contract_check_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from attnkit.kernels.dsa import contract

    def no_window_check(
        q: torch.Tensor, weights: object, index_cache: object, max_seq_len: object, window: Any
    ) -> Any:
        return contract.check_logits_args(q, weights, index_cache, max_seq_len, None)

    monkeypatch.setattr(triton_ops, "check_logits_args", no_window_check)
    assert [d.split(":")[0] for d in disagreements()] == ["logits(window=...)"]
