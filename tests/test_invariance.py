"""``attnkit.testing.check_invariance``: each backend's declared ``Determinism`` level,
checked bit for bit (reference, the CPU default, triton_attn under the interpreter),
with negative controls: a backend whose splits follow the batch is reported, and so is
cpu_attn claiming prefill = decode without its invariant path."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import pytest
import torch

from attnkit import Determinism, FullAttentionSpec
from attnkit.backend_api import AttentionBackend, bind_each
from attnkit.backends.cpu_attn import CpuAttentionBackend
from attnkit.backends.cpu_attn.backend import CpuAttentionImpl, CpuAttentionMetadataBuilder
from attnkit.backends.triton_attn import TritonAttentionBackend
from attnkit.backends.triton_attn.backend import (
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)
from attnkit.errors import InvalidArgumentError
from attnkit.registry import default_registry
from attnkit.spec import KVCacheSpecKind
from attnkit.testing import check_invariance

FULL = KVCacheSpecKind.FULL_ATTENTION
LEVELS = list(Determinism)
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="triton_attn runs on CPU under the Triton interpreter (TRITON_INTERPRET=1)",
)


def builtin(name: str) -> type[AttentionBackend]:
    return default_registry().get(name)


# ---------------------------------------------------------------- the check


def passed(report: Any) -> list[str]:
    return [r.capability for r in report.results if r.status == "passed"]


def assert_passes(report: Any, expected: Sequence[str]) -> None:
    assert report.ok, report.describe()
    assert set(expected) <= set(passed(report)), report.describe()


ALL_LEVELS = [f"{level.label} ({{}})" for level in LEVELS[1:]]


def test_reference_is_batch_invariant() -> None:
    report = check_invariance(builtin("reference"))
    kinds = ("full_attention", "sliding_window", "chunked_local_attention")
    assert_passes(report, [f.format(k) for f in ALL_LEVELS[:2] for k in kinds])
    assert report.result("prefill_decode (full_attention)").status == "skipped"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attn_keeps_every_level_it_declares(dtype: torch.dtype) -> None:
    """Full, sliding-window and chunked-local layers up to prefix-hit invariance, with
    threads (the machine's default) and both engines."""
    report = check_invariance(builtin("cpu_attn"), dtype=dtype)
    kinds = ("full_attention", "sliding_window", "chunked_local_attention")
    assert_passes(report, [f.format(k) for f in ALL_LEVELS for k in kinds])


def test_cpu_attn_below_prefill_decode_is_not_prefill_decode_invariant() -> None:
    """The control for the level above: at batch_invariant, prefills run on the blocked
    engine, whose rows round differently from the decode kernel's: the check says so."""
    report = check_invariance(builtin("cpu_attn"), level="batch_invariant", kinds=["full_attention"])
    assert report.ok

    class NoRowsNative(CpuAttentionMetadataBuilder):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.rows_native = False  # every request on its query length's engine

    class SaysMore(CpuAttentionBackend):
        name = "cpu_says_more"
        builders = bind_each((FullAttentionSpec,), NoRowsNative, CpuAttentionImpl)
    report = check_invariance(SaysMore, kinds=["full_attention"])
    assert report.result("batch_invariant (full_attention)").status == "passed"
    failed = report.result("prefill_decode (full_attention)")
    assert failed.status == "failed", report.describe()
    assert "values differ" in failed.detail


@needs_interpreter
def test_triton_attn_is_batch_invariant_under_the_interpreter() -> None:
    report = check_invariance(builtin("triton_attn"), kinds=["full_attention", "sliding_window"])
    assert_passes(
        report,
        [f.format(k) for f in ALL_LEVELS[:2] for k in ("full_attention", "sliding_window")],
    )


@needs_interpreter
def test_batch_dependent_splits_are_reported() -> None:
    """The negative control: triton_attn whose split-KV decode takes its split count from
    the batch (one more split than there are requests), declaring batch invariance."""

    class BatchSplits(TritonAttentionMetadataBuilder):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            plan = self._plan_paged_attention

            def batch_splits(*a: Any, **kw: Any) -> Any:
                if kw["max_query_len"] <= 16:
                    kw.update(num_splits=1 + a[1].shape[0])
                    kw.pop("block_q", None)
                return plan(*a, **kw)

            self._plan_paged_attention = batch_splits

    class Splits(TritonAttentionBackend):
        name = "triton_batch_splits"
        deterministic = True
        determinism: ClassVar[Mapping[KVCacheSpecKind, Determinism]] = {
            FULL: Determinism.BATCH_INVARIANT
        }
        builders = bind_each((FullAttentionSpec,), BatchSplits, TritonAttentionImpl)

    report = check_invariance(Splits, kinds=["full_attention"])
    assert report.result("run_to_run (full_attention)").status == "passed", report.describe()
    failed = report.result("batch_invariant (full_attention)")
    assert failed.status == "failed", report.describe()
    assert "co-batched" in failed.detail
    assert "values differ" in failed.detail


def test_a_level_above_the_declared_one_fails_at_selection() -> None:
    report = check_invariance(
        builtin("reference"), level="chunking_invariant", kinds=["full_attention"]
    )
    failed = report.result("run_to_run (full_attention)")
    assert failed.status == "failed"
    assert "determinism=chunking_invariant not kept for kind=full_attention" in failed.detail


def test_the_report_names_the_check() -> None:
    report = check_invariance(builtin("reference"), kinds=["full_attention"], trials=1)
    assert report.describe().startswith("invariance of backend 'reference' on cpu")
    with pytest.raises(InvalidArgumentError, match="trials must be an int >= 1, got 0"):
        check_invariance(builtin("reference"), trials=0)


@needs_interpreter
@pytest.mark.parametrize(
    ("level", "splits", "block_q"), [("none", 2, 1), ("batch_invariant", 0, 32)]
)
def test_triton_attn_plans_no_batch_dependent_path_when_invariant(
    level: str, splits: int, block_q: int
) -> None:
    """A lone long decode on a GPU-sized device (132 SMs): the heuristic splits it, the
    tile holds one query; batch-invariant: one pass, fixed 32-query tiles, whatever
    the batch."""
    from attnkit import AttentionConfig, AttentionRuntime, ScheduledRequest

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    runtime = AttentionRuntime(
        {"layers.0": spec},
        AttentionConfig(backend="triton_attn", determinism=level),
        device="cpu",
        memory_budget_bytes=spec.page_size_bytes * 64,
    )
    builder = runtime._groups[0].builder
    assert isinstance(builder, TritonAttentionMetadataBuilder)
    builder.num_sms = 132
    runtime.begin_step([ScheduledRequest("a", 600)])
    runtime.begin_step([ScheduledRequest("a", 1)])
    plan = runtime.metadata_for("layers.0").plan
    assert (plan.num_splits, plan.block_q) == (splits, block_q)
