"""The conformance kit (attnkit.testing): it passes every built-in backend that runs
here, reports flash_attn as not checked with its reason, and fails deliberately broken
backends naming the capability each breaks.

The broken backends here are the reference backend with one bug each, so they run fast
and shrink quickly; the kit's report must name the capability and say what went wrong.
tests/test_conformance_kit_catches.py has more, on a small SDPA-over-pages backend.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from hypothesis import given, settings
from typing_extensions import override

from attnkit import AttentionLayerParams, AttentionSpec, KVCacheDType, KVCacheSpecKind, MambaType
from attnkit.backend_api import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionFeature,
    CommonAttentionMetadata,
    bind_each,
)
from attnkit.backends.reference import ReferenceBackend
from attnkit.backends.reference.attention import (
    ReferenceAttentionBuilder,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
)
from attnkit.registry import BUILTIN_BACKENDS, BackendRegistry
from attnkit.spec import FullAttentionSpec, SlidingWindowSpec
from attnkit.testing import (
    AUTHOR_MAX_EXAMPLES,
    DEFAULT_MAX_EXAMPLES,
    ConformanceReport,
    check_backend,
    declared_capabilities,
    layer_of,
    rerun,
    tolerance_for,
)
from attnkit.testing.strategies import Case, LayerChoice, cases, ragged_case

pytest_plugins = ["pytester"]

FULL = KVCacheSpecKind.FULL_ATTENTION
WINDOW = KVCacheSpecKind.SLIDING_WINDOW
ROOT = Path(__file__).resolve().parent.parent
REGISTRY = BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)


def builtin(name: str) -> type[AttentionBackend]:
    return REGISTRY.get(name)


def assert_passes(report: ConformanceReport) -> None:
    report.assert_ok()
    assert report.skipped is None, report.describe()
    assert any(r.status == "passed" for r in report.results), report.describe()


def passed_values(report: ConformanceReport) -> set[tuple[str, str]]:
    """``(kind, "name=value")`` of every value some passed combination holds."""
    found = set()
    for r in report.results:
        if r.status != "passed" or r.choice is None or not r.capability.startswith("kind="):
            continue
        kind, *values = r.capability.split()
        found.update((kind.removeprefix("kind="), v) for v in values)
    return found


# ------------------------------------------------------------------ built-in backends


def test_reference_passes_every_capability() -> None:
    report = check_backend(ReferenceBackend)
    assert_passes(report)
    checked = {r.capability for r in report.results if r.status == "passed"}
    assert {
        f"kind={k.value}"
        for k in ReferenceBackend.supported_kinds()
        if k.value not in ("mamba", "indexer")
    } <= checked
    # The indexer selects rather than attends: its own cases, with its sparse MLA layer.
    assert "sparse_attention kind=indexer block_size=16 dtype=float32" in checked
    assert {
        "kind=mamba mamba_type=gdn",
        "long_context dtype=float16 (full_attention)",
        "long_context dtype=bfloat16 (mla_attention)",
    } <= checked
    values = passed_values(report)
    for kind in ("full_attention", "sliding_window", "cross_attention", "mla_attention"):
        for value in (
            "feature=logits_soft_cap",
            "feature=alibi",
            "feature=attention_sinks",
            "block_size=48",
            "block_size=528",
            "head_size=80",
            "head_size=96",
            "scale=0.15",
            "dtype=bfloat16",
        ):
            assert (kind, value) in values, (kind, value)
    assert ("full_attention", "kv_cache_dtype=fp8_e4m3") in values
    assert ("mla_attention", "feature=mla_projection") in values
    # What reference does not serve together is listed, not silently dropped.
    assert "kind=mla_attention kv_cache_dtype=fp8_e4m3" in report.uncovered
    assert report.tolerances  # the tolerance per dtype is part of the report


def test_triton_attn_passes() -> None:
    report = check_backend(builtin("triton_attn"))
    assert_passes(report)
    passed = {r.capability for r in report.results if r.status == "passed"}
    assert {
        "kind=full_attention",
        "kind=sliding_window",
        "kind=chunked_local_attention",
        "kind=cross_attention",
        "kind=encoder_only_attention",
        "long_context dtype=float16 (full_attention)",
        "cudagraph=ALWAYS (full_attention)",
    } <= passed
    values = passed_values(report)
    for kind in ("full_attention", "sliding_window", "chunked_local_attention"):
        for value in ("block_size=64", "block_size=128", "head_size=80", "head_size=96",
                      "feature=logits_soft_cap", "feature=attention_sinks", "scale=0.15",
                      "kv_cache_dtype=fp8_e4m3"):
            assert (kind, value) in values, (kind, value)


def test_cpu_attn_passes() -> None:
    """The CPU default (the native decode kernel, blocked prefill): every kind and
    feature it declares, against the kit's oracle."""
    report = check_backend(builtin("cpu_attn"))
    assert_passes(report)
    passed = {r.capability for r in report.results if r.status == "passed"}
    assert {
        "kind=full_attention",
        "kind=sliding_window",
        "kind=chunked_local_attention",
        "kind=cross_attention",
        "kind=encoder_only_attention",
        "deterministic (full_attention)",
    } <= passed
    values = passed_values(report)
    for kind in ("full_attention", "sliding_window", "sink_full_attention"):
        for value in ("feature=logits_soft_cap", "feature=alibi", "feature=attention_sinks",
                      "block_size=48", "block_size=528", "scale=0.15",
                      "kv_cache_dtype=fp8_e4m3", "kv_cache_dtype=fp8_e4m3_per_token_head",
                      "kv_cache_dtype=int8_per_token_head"):
            assert (kind, value) in values, (kind, value)


def test_cpu_mla_passes() -> None:
    """Absorbed MLA on the CPU engines: both MLA kinds at every size the kit tries."""
    report = check_backend(builtin("cpu_mla"))
    assert_passes(report)
    passed = {r.capability for r in report.results if r.status == "passed"}
    assert {
        "kind=mla_attention",
        "kind=sliding_window_mla",
        "deterministic (mla_attention)",
        "long_context dtype=float16 (mla_attention)",
    } <= passed


@pytest.mark.parametrize(
    "name",
    ["triton_mamba1", "triton_mamba2", "triton_gdn", "triton_linear_attn", "triton_short_conv"],
)
def test_triton_state_backends_pass(name: str) -> None:
    report = check_backend(builtin(name))
    assert_passes(report)
    graph = [r for r in report.results if r.capability.startswith("cudagraph=")]
    assert [r.status for r in graph] == ["passed"]


def test_flash_attn_is_skipped_with_its_reason_off_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: flash_attn may run here")
    report = check_backend(builtin("flash_attn"), device="cpu")
    assert not report.ok  # nothing is known about it here
    assert report.verdict == "not checked"
    assert report.results == ()
    assert report.skipped is not None
    assert "device=cpu not supported" in report.skipped
    assert "NOT CHECKED" in report.describe()


def test_the_out_of_tree_example_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    # On the path as in tests/test_out_of_tree.py: CI's test session does not install it.
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "out_of_tree_backend" / "src"))
    from attnkit_example_chunked import ChunkedLocalBackend

    assert_passes(check_backend(ChunkedLocalBackend))


def test_import_attnkit_does_not_import_the_kit_or_hypothesis() -> None:
    code = (
        "import sys, attnkit, attnkit.backend_api\n"
        "print(sorted(m for m in ('hypothesis', 'attnkit.testing') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", result.stderr


def test_nothing_outside_the_kit_imports_it() -> None:
    importers = []
    for path in sorted((ROOT / "src" / "attnkit").rglob("*.py")):
        if "testing" in path.relative_to(ROOT / "src" / "attnkit").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [f"{'.' * node.level}{node.module or ''}"]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n.startswith("attnkit.testing") or n.lstrip(".") == "testing" for n in names):
                importers.append(str(path))
    assert importers == []


# ------------------------------------------------------------------ broken backends


class _Narrow(ReferenceBackend):
    """The reference backend declaring few capabilities, so each broken one runs fast."""

    supported_head_sizes = (16,)
    supported_block_sizes = (16,)
    supported_dtypes = frozenset({torch.float32})
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto"})
    supported_features: ClassVar[frozenset[AttentionFeature]] = frozenset()
    deterministic = False  # each test is about its one bug


class _SoftCapIgnoringImpl(ReferenceAttentionImpl):
    """Declares soft-cap (inherited) but computes without it."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_params: AttentionLayerParams) -> None:
        super().__init__(kv_cache_spec, dataclasses.replace(layer_params, logits_soft_cap=None))


class IgnoresSoftCap(_Narrow):
    name = "broken_soft_cap"
    supported_features = frozenset({AttentionFeature.LOGITS_SOFT_CAP, AttentionFeature.ALIBI})
    builders = bind_each((FullAttentionSpec,), ReferenceAttentionBuilder, _SoftCapIgnoringImpl)


class _WindowOffByOneBuilder(ReferenceAttentionBuilder):
    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ReferenceAttentionMetadata:
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if meta.sliding_window is None:
            return meta
        return dataclasses.replace(meta, sliding_window=meta.sliding_window + 1)


class WindowOffByOne(_Narrow):
    name = "broken_window_edge"
    builders = bind_each(
        (FullAttentionSpec, SlidingWindowSpec), _WindowOffByOneBuilder, ReferenceAttentionImpl
    )


class _Block64Builder(ReferenceAttentionBuilder):
    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ReferenceAttentionMetadata:
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.kv_cache_spec.block_size != 64:
            return meta
        return dataclasses.replace(meta, block_table=meta.block_table.roll(1, dims=1))


class WrongBlockAt64(_Narrow):
    name = "broken_block_64"
    supported_block_sizes = (16, 32, 64)
    builders = bind_each((FullAttentionSpec,), _Block64Builder, ReferenceAttentionImpl)


class _ChunkSlotBuilder(ReferenceAttentionBuilder):
    """Writes a continuing chunk's K/V in reverse slot order (chunked prefill only)."""

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ReferenceAttentionMetadata:
        cm = common_attn_metadata
        meta = super().build(common_prefix_len, cm, fast_build)
        slots = meta.slot_mapping.clone()
        starts = cm.query_start_loc_cpu.tolist()
        for i, computed in enumerate(cm.num_computed_tokens_cpu.tolist()):
            lo, hi = starts[i], starts[i + 1]
            if computed > 0 and hi - lo > 1:
                slots[lo:hi] = slots[lo:hi].flip(0)
        return dataclasses.replace(meta, slot_mapping=slots)


class WrongSlotInChunkedPrefill(_Narrow):
    name = "broken_chunk_slots"
    builders = bind_each((FullAttentionSpec,), _ChunkSlotBuilder, ReferenceAttentionImpl)


class _ClaimsGraphsBuilder(ReferenceAttentionBuilder):
    """Claims ALWAYS; its capture builds hand out the step's own (new) tensors."""

    cudagraph_support = AttentionCGSupport.ALWAYS


class ClaimsGraphsButReallocates(_Narrow):
    name = "broken_cudagraph"
    builders = bind_each((FullAttentionSpec,), _ClaimsGraphsBuilder, ReferenceAttentionImpl)


def failed(report: ConformanceReport) -> dict[str, str]:
    return {r.capability: r.detail for r in report.failures()}


def test_ignoring_soft_cap_fails_the_soft_cap_capability() -> None:
    report = check_backend(IgnoresSoftCap)
    assert not report.ok
    failures = report.failures()
    assert failures, report.describe()
    for result in failures:
        assert "feature=logits_soft_cap" in result.capability.split(), report.describe()
        assert result.needs == ("kind=full_attention", "feature=logits_soft_cap"), result
        assert "differ from reference" in result.detail
        assert result.example is not None
        assert result.example.choice == result.choice
    assert report.result("kind=full_attention feature=alibi").status == "passed"
    text = report.describe()
    assert "FAILED  kind=full_attention feature=logits_soft_cap" in text
    assert "fails with just: kind=full_attention feature=logits_soft_cap" in text
    assert "smallest failing case: full_attention" in text


def test_window_off_by_one_fails_the_sliding_window_kind() -> None:
    report = check_backend(WindowOffByOne)
    failures = failed(report)
    assert "kind=sliding_window" in failures, report.describe()
    assert all(name.startswith("kind=sliding_window") for name in failures), report.describe()
    result = report.result("kind=sliding_window")
    assert result.example is not None
    # The smallest case reruns by hand, with the same verdict; reference passes it.
    assert rerun(result.example, WindowOffByOne) == result.detail
    assert rerun(result.example, ReferenceBackend) is None
    spec, _ = layer_of(result.example)
    assert isinstance(spec, SlidingWindowSpec)
    # Shrunk: the window is one of the lengths at a block edge, the schedule small.
    assert result.example.window is not None
    assert sum(len(s.scheduled) for s in result.example.steps) <= 6, result.describe()


def test_wrong_block_at_64_fails_block_size_64_only() -> None:
    report = check_backend(WrongBlockAt64)
    failures = report.failures()
    assert failures, report.describe()
    for result in failures:
        assert "block_size=64" in result.capability.split(), report.describe()
        assert result.needs == ("kind=full_attention", "block_size=64"), result
        assert "NaN" in result.detail  # it read an unwritten block
    assert report.result("kind=full_attention block_size=32").status == "passed"


def test_wrong_slot_in_chunked_prefill_is_reported_as_chunked_prefill() -> None:
    report = check_backend(WrongSlotInChunkedPrefill)
    failures = failed(report)
    assert "kind=full_attention" in failures, report.describe()
    # The smallest case continues a prompt by a chunk, and the report says so.
    assert all("chunked prefill" in detail for detail in failures.values()), report.describe()


def test_claiming_cudagraphs_but_reallocating_fails_the_cudagraph_level() -> None:
    report = check_backend(ClaimsGraphsButReallocates)
    assert list(failed(report)) == ["cudagraph=ALWAYS (full_attention)"], report.describe()
    detail = report.result("cudagraph=ALWAYS (full_attention)").detail
    assert detail.startswith("claims ALWAYS: step 2")
    assert "replaying the first capture's metadata" in detail
    assert "tensors reallocated between capture builds: " in detail
    assert "slot_mapping" in detail


def test_a_capture_that_moves_a_tensor_fails_even_when_values_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pure-decode capture whose values are right but one tensor is a fresh copy on
    each build: a replay reads the first build's copy, so the claim does not hold."""
    from attnkit.backends.triton_state.backend import TritonStateMetadataBuilder

    honest = TritonStateMetadataBuilder.build_for_cudagraph_capture

    def copies(self: TritonStateMetadataBuilder, cm: CommonAttentionMetadata) -> object:
        md = honest(self, cm)
        return dataclasses.replace(md, has_initial_state=md.has_initial_state.clone())

    monkeypatch.setattr(TritonStateMetadataBuilder, "build_for_cudagraph_capture", copies)
    report = check_backend(builtin("triton_mamba2"), max_examples=1)
    (graph,) = [r for r in report.results if r.capability.startswith("cudagraph=")]
    assert graph.status == "failed"
    assert graph.detail == (
        "claims UNIFORM_SINGLE_TOKEN_DECODE but reallocates between capture builds: "
        "has_initial_state"
    )


def test_a_declared_capability_rejected_at_selection_fails() -> None:
    class RejectsBf16(_Narrow):
        name = "broken_rejects_bf16"
        supported_dtypes = frozenset({torch.float32, torch.bfloat16})
        builders = bind_each(
            (FullAttentionSpec,), ReferenceAttentionBuilder, ReferenceAttentionImpl
        )

        @classmethod
        @override
        def extra_not_supported_reasons(cls, request: object) -> list[str]:
            spec = getattr(request, "spec", None)
            if getattr(spec, "dtype", None) is torch.bfloat16:
                return ["bfloat16 is broken"]
            return []

    report = check_backend(RejectsBf16)
    assert list(failed(report)) == ["dtype=bfloat16"], report.describe()
    assert "bfloat16 is broken" in report.result("dtype=bfloat16").detail


def test_a_backend_that_raises_fails_with_the_exception() -> None:
    class _Raises(ReferenceAttentionImpl):
        @override
        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor | None,
            value: torch.Tensor | None,
            kv_cache: Sequence[torch.Tensor],
            attn_metadata: ReferenceAttentionMetadata,
            output: torch.Tensor,
        ) -> torch.Tensor:
            if self.kv_cache_spec.dtype is torch.float16:
                raise RuntimeError("no half kernels")
            return super().forward(query, key, value, kv_cache, attn_metadata, output)

    class RaisesOnHalf(_Narrow):
        name = "broken_raises"
        supported_dtypes = frozenset({torch.float32, torch.float16})
        builders = bind_each((FullAttentionSpec,), ReferenceAttentionBuilder, _Raises)

    report = check_backend(RaisesOnHalf, shrink=False)
    failures = report.failures()
    assert {r.capability for r in failures} == {
        "kind=full_attention dtype=float16",
        "kind=full_attention dtype=float16 scale=0.15",
        "long_context dtype=float16 (full_attention)",
    }, report.describe()
    for result in failures:
        assert "RuntimeError: no half kernels" in result.detail


# ------------------------------------------------------------------ settings and pieces


class NarrowReference(_Narrow):
    """The reference backend, every kind, few sizes: settings tests run fast on it."""

    name = "narrow_reference"
    supported_mamba_types: ClassVar[frozenset[MambaType]] = frozenset({"mamba2"})


def test_kinds_restricts_the_run_and_skips_the_rest() -> None:
    report = check_backend(NarrowReference, kinds=["sliding_window"])
    assert_passes(report)
    assert report.result("kind=full_attention").status == "skipped"
    assert report.result("kind=sliding_window").status == "passed"


def test_the_same_seed_gives_the_same_failure() -> None:
    a = check_backend(WindowOffByOne, kinds=[WINDOW], seed=3)
    b = check_backend(WindowOffByOne, kinds=[WINDOW], seed=3)
    assert [r.detail for r in a.failures()] == [r.detail for r in b.failures()]
    assert [r.example for r in a.failures()] == [r.example for r in b.failures()]
    assert a.failures()


def test_tolerances_are_declared_in_one_place() -> None:
    assert tolerance_for(torch.float32).atol < tolerance_for(torch.float16).atol
    assert tolerance_for(torch.float16).atol < tolerance_for(torch.bfloat16).atol
    assert tolerance_for(torch.float32, "fp8_e4m3").atol >= tolerance_for(torch.bfloat16).atol
    assert tolerance_for(torch.float32, "float16") == tolerance_for(torch.float16)
    assert AUTHOR_MAX_EXAMPLES > DEFAULT_MAX_EXAMPLES


@settings(max_examples=30, deadline=None, database=None)
@given(case=cases(LayerChoice(kind=WINDOW, block_size=8), max_requests=2, max_steps=4, max_len=20))
def test_strategies_make_valid_schedules(case: Case) -> None:
    live: dict[str, int] = {}
    for step in case.steps:
        for rid in step.finished:
            assert rid in live
            del live[rid]
        ids = [rid for rid, _, _ in step.scheduled]
        assert ids
        assert len(set(ids)) == len(ids)
        for rid, n, _ in step.scheduled:
            live[rid] = live.get(rid, 0) + n
            assert live[rid] <= 20
        assert len(live) <= 2
    assert case.window is not None
    assert case.window >= 1


def test_the_ragged_case_crosses_block_edges() -> None:
    ragged = ragged_case(LayerChoice(kind=WINDOW, block_size=8))
    assert len(ragged.steps) == 4
    assert ragged.window == 9
    assert ragged.steps[0].scheduled[0] == ("r0", 11, 0)


def test_declared_capabilities_list_what_the_kit_checks() -> None:
    listed = declared_capabilities(WrongBlockAt64)
    assert [(name, skip) for name, _, skip in listed] == [
        ("kind=full_attention", None),
        ("kind=full_attention block_size=32 scale=0.15", None),
        ("kind=full_attention block_size=64", None),
        ("kind=full_attention scale=0.15", None),
        ("kind=full_attention block_size=32", None),
        ("kind=full_attention block_size=64 scale=0.15", None),
        ("deterministic", "not declared (AttentionBackend.deterministic is False): "
         "two runs are not compared"),
    ]
    listed_triton = {name: skip for name, _, skip in declared_capabilities(builtin("triton_attn"))}
    assert any("feature=logits_soft_cap" in n and s is None for n, s in listed_triton.items())
    assert listed_triton["feature=context_parallel"] is not None
    assert listed_triton["feature=per_head_quant_scales"] is not None


def test_report_names_the_backend_and_settings() -> None:
    report = check_backend(NarrowReference, kinds=[FULL], max_examples=1, seed=5)
    text = report.describe()
    assert text.startswith(
        "conformance of backend 'narrow_reference' on cpu (max_examples=1, seed=5): 2 passed"
    )
    assert "tolerances: float32: atol=" in text
    with pytest.raises(KeyError, match="checked: "):
        report.result("nothing")


def test_the_pytest_fixture(pytester: pytest.Pytester) -> None:
    pytester.makeconftest('pytest_plugins = ["attnkit.testing.pytest_plugin"]\n')
    pytester.makepyfile(
        """
        from attnkit.backends.reference import ReferenceBackend

        def test_conformance(attnkit_conformance):
            report = attnkit_conformance(ReferenceBackend, kinds=["full_attention"])
            assert report.max_examples == 1 and report.seed == 7
        """
    )
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "--attnkit-max-examples=1", "--attnkit-seed=7"
    )
    result.assert_outcomes(passed=1)
