"""What the conformance kit catches: a small correct backend, then one bug per variant.

``Gathered`` is what a new author writes first: full and sliding-window attention that
writes the step's keys and values at ``slot_mapping``, gathers each request's pages and
attends in float32 (SDPA over gathered pages). It passes the kit. Each variant below
changes one thing, as authors get it wrong, and each test checks that the kit reports
the capability the bug breaks, and says what went wrong. Each variant declares only
what its bug needs, so each run is small.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from typing_extensions import override

from attnkit import (
    AttentionFeature,
    AttentionLayerParams,
    AttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)
from attnkit.backend_api import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
    bind_each,
)
from attnkit.testing import (
    ConformanceReport,
    check_backend,
    rerun,
    tolerance_for,
)
from attnkit.testing.strategies import LayerChoice, ragged_case

ROOT = Path(__file__).resolve().parent.parent
FULL_AND_WINDOW = (FullAttentionSpec, SlidingWindowSpec)


@dataclasses.dataclass(frozen=True)
class GatheredMeta:
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_computed_cpu: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_tokens: int
    window: int | None


class GatheredBuilder(AttentionMetadataBuilder[GatheredMeta, AttentionSpec]):
    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> GatheredMeta:
        cm = common_attn_metadata
        assert cm.num_computed_tokens_cpu is not None  # the runtime always sets it
        return GatheredMeta(
            query_start_loc_cpu=cm.query_start_loc_cpu,
            seq_lens_cpu=cm.seq_lens_cpu,
            num_computed_cpu=cm.num_computed_tokens_cpu,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            num_tokens=cm.num_actual_tokens,
            window=getattr(self.kv_cache_spec, "sliding_window", None),
        )


class GatheredImpl(AttentionImpl[GatheredMeta, AttentionSpec, AttentionLayerParams]):
    """Cache ``[NB, 2, BS, Hkv, D]``; query ``[T, Hq, D]``."""

    @property
    def scale(self) -> float:
        given = self.layer_params.scale
        return given if given is not None else self.kv_cache_spec.head_size**-0.5

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: GatheredMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        md, cache = attn_metadata, kv_cache[0]
        assert key is not None
        assert value is not None
        n = md.num_tokens
        self.write(cache, key[:n], value[:n], md)
        starts = md.query_start_loc_cpu.tolist()
        for b, seq in enumerate(md.seq_lens_cpu.tolist()):
            self.request(query, cache, md, b, starts[b], starts[b + 1], seq, output)
        return output

    def request(
        self,
        query: torch.Tensor,
        cache: torch.Tensor,
        md: GatheredMeta,
        b: int,
        lo: int,
        hi: int,
        seq: int,
        output: torch.Tensor,
    ) -> None:
        if hi > lo:
            output[lo:hi] = self.attend(query[lo:hi], cache, md, b, seq)

    def write(
        self, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, md: GatheredMeta
    ) -> None:
        bs = cache.shape[2]
        slots = md.slot_mapping[: key.shape[0]]
        blocks, offsets = slots // bs, slots % bs
        cache[blocks, 0, offsets] = key
        cache[blocks, 1, offsets] = value

    def first_block(self, first_visible: int, block_size: int) -> int:
        """The first block a window can still see (earlier ones may be released)."""
        return first_visible // block_size

    def attend(
        self, q: torch.Tensor, cache: torch.Tensor, md: GatheredMeta, b: int, seq: int
    ) -> torch.Tensor:
        m, bs = q.shape[0], cache.shape[2]
        first = seq - m  # position of the first query
        skip = 0
        if md.window is not None:
            skip = self.first_block(max(0, first - md.window + 1), bs)
        blocks = md.block_table[b, skip : -(-seq // bs)].long()
        pages = cache[blocks]  # [nb, 2, BS, Hkv, D]
        k = pages[:, 0].flatten(0, 1)[: seq - skip * bs]
        v = pages[:, 1].flatten(0, 1)[: seq - skip * bs]
        qpos = first + torch.arange(m)
        kpos = skip * bs + torch.arange(k.shape[0])
        visible = kpos[None] <= qpos[:, None]
        if md.window is not None:
            visible &= qpos[:, None] - kpos[None] < md.window
        return self.softmax_v(q, k, v, visible)

    def softmax_v(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("mhd,shd->hms", q.float(), k) * self.scale
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        return torch.einsum("hms,shd->mhd", weights, v).to(q.dtype)


class Gathered(AttentionBackend):
    name = "gathered"
    supported_devices = frozenset({"cpu"})
    supported_head_sizes = None
    supported_block_sizes = (MultipleOf(8),)
    supported_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    deterministic = True
    builders = bind_each(FULL_AND_WINDOW, GatheredBuilder, GatheredImpl)


class _Small(AttentionBackend):
    """One kind, one size, one dtype: a variant's run is a handful of combinations."""

    supported_devices = frozenset({"cpu"})
    supported_head_sizes = (16,)
    supported_block_sizes = (16,)
    supported_dtypes = frozenset({torch.float32})


def failed(report: ConformanceReport) -> dict[str, str]:
    return {r.capability: r.detail for r in report.failures()}


def test_the_gathered_backend_passes() -> None:
    report = check_backend(Gathered)
    report.assert_ok()
    passed = {r.capability for r in report.results if r.status == "passed"}
    assert {
        "kind=full_attention",
        "kind=sliding_window",
        "long_context dtype=float16 (full_attention)",
        "long_context dtype=bfloat16 (sliding_window)",
        "deterministic (full_attention)",
        "deterministic (sliding_window)",
    } <= passed, report.describe()
    # Sizes beyond powers of two, every value on every kind, the non-default scale.
    for value in ("block_size=48", "block_size=528", "block_size=24", "head_size=80",
                  "head_size=96", "scale=0.15", "dtype=bfloat16"):
        for kind in ("full_attention", "sliding_window"):
            assert any(
                c.startswith(f"kind={kind} ") and value in c.split() for c in passed
            ), (kind, value, report.describe())


# ------------------------------------------------------------------ the softmax scale


class _IgnoresScale(GatheredImpl):
    @property
    @override
    def scale(self) -> float:
        return self.kv_cache_spec.head_size**-0.5


class IgnoresScale(_Small):
    name = "broken_ignores_scale"
    builders = bind_each((FullAttentionSpec,), GatheredBuilder, _IgnoresScale)


def test_an_ignored_softmax_scale_fails_the_scale() -> None:
    report = check_backend(IgnoresScale)
    assert list(failed(report)) == ["kind=full_attention scale=0.15"], report.describe()
    result = report.result("kind=full_attention scale=0.15")
    assert "differ from reference" in result.detail
    assert result.needs == ("kind=full_attention", "scale=0.15")
    assert report.result("kind=full_attention").status == "passed"


# ------------------------------------------------------------------ 16-bit accumulation


class _Accumulates16(GatheredImpl):
    """Decodes accumulate the softmax sums key by key in the model dtype, as a naive
    decode kernel with a half-precision accumulator does."""

    @override
    def softmax_v(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        if q.shape[0] != 1 or q.dtype == torch.float32:
            return super().softmax_v(q, k, v, visible)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", q[0].float(), k.float()) * self.scale
        scores = scores.masked_fill(~visible[0], float("-inf"))
        weights = (scores - scores.amax(-1, keepdim=True)).exp()  # [H, S]
        total = torch.zeros(q.shape[1], 1, dtype=q.dtype)
        acc = torch.zeros(q.shape[1], q.shape[2], dtype=q.dtype)
        for j in range(k.shape[0]):
            w = weights[:, j : j + 1]
            total = (total + w).to(q.dtype)
            acc = (acc + w * v[j].float()).to(q.dtype)
        return (acc.float() / total.float()).to(q.dtype)[None]


class Accumulates16(_Small):
    name = "broken_accumulates_16"
    supported_dtypes = frozenset({torch.float16, torch.bfloat16})
    builders = bind_each((FullAttentionSpec,), GatheredBuilder, _Accumulates16)


def test_16_bit_accumulation_fails_the_long_context_cases() -> None:
    report = check_backend(Accumulates16)
    assert sorted(failed(report)) == [
        "long_context dtype=bfloat16 (full_attention)",
        "long_context dtype=float16 (full_attention)",
    ], report.describe()
    detail = report.result("long_context dtype=float16 (full_attention)").detail
    assert detail.startswith("step 1, layer 0, request r0 (decode after 3000 token(s))"), detail
    assert str(tolerance_for(torch.float16)) in detail  # the kit's one table


# ------------------------------------------------------------------ inputs in place


class _ScalesQueryInPlace(GatheredImpl):
    """Scales the query in place (the output is right; the caller's query is not)."""

    @property
    @override
    def scale(self) -> float:
        return 1.0  # the query comes scaled

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: GatheredMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        given = self.layer_params.scale
        query.mul_(given if given is not None else self.kv_cache_spec.head_size**-0.5)
        return super().forward(query, key, value, kv_cache, attn_metadata, output)


class MutatesQuery(_Small):
    name = "broken_mutates_query"
    builders = bind_each((FullAttentionSpec,), GatheredBuilder, _ScalesQueryInPlace)


def test_a_query_changed_in_place_fails() -> None:
    report = check_backend(MutatesQuery)
    failures = failed(report)
    assert failures, report.describe()
    for detail in failures.values():
        assert "forward changed its input query in place" in detail, report.describe()


# ------------------------------------------------------------------ determinism


class _Noisy(GatheredImpl):
    """Run-to-run noise of 1e-6 (far inside float32's tolerance)."""

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: GatheredMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        out = super().forward(query, key, value, kv_cache, attn_metadata, output)
        return out.add_(torch.randn(out.shape) * 1e-6)


class Noisy(_Small):
    name = "broken_noisy"
    deterministic = True
    builders = bind_each((FullAttentionSpec,), GatheredBuilder, _Noisy)


class NoisyUndeclared(Noisy):
    name = "broken_noisy_undeclared"
    deterministic = False


def test_run_to_run_noise_fails_the_declared_determinism() -> None:
    report = check_backend(Noisy)
    assert list(failed(report)) == ["deterministic (full_attention)"], report.describe()
    detail = report.result("deterministic (full_attention)").detail
    assert "not deterministic" in detail
    # The same noise passes when the backend does not declare determinism.
    undeclared = check_backend(NoisyUndeclared)
    assert undeclared.ok, undeclared.describe()
    assert undeclared.result("deterministic").status == "skipped"


# ------------------------------------------------------------------ block sizes


class _WindowAssumes16(GatheredImpl):
    """The window's first visible block computed in blocks of 16 tokens."""

    @override
    def first_block(self, first_visible: int, block_size: int) -> int:
        return first_visible // 16


class WindowBugOff16(_Small):
    name = "broken_window_block_16"
    supported_block_sizes = (16, 24, 48)
    builders = bind_each(FULL_AND_WINDOW, GatheredBuilder, _WindowAssumes16)


def test_a_window_bug_at_block_sizes_other_than_16_fails_those_combinations() -> None:
    report = check_backend(WindowBugOff16)
    failures = report.failures()
    assert failures, report.describe()
    assert report.result("kind=sliding_window").status == "passed"  # block size 16
    for r in failures:
        assert r.capability.startswith("kind=sliding_window block_size="), report.describe()
        assert r.needs[0] == "kind=sliding_window", r.describe()
        assert any(n.startswith("block_size=") and n != "block_size=16" for n in r.needs)
    assert not [r for r in report.results if "full_attention" in r.capability and r.status != "passed"]


class _ShiftSlots(GatheredImpl):
    """Slot -> (block, offset) by shift and mask: right for powers of two only."""

    @override
    def write(
        self, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, md: GatheredMeta
    ) -> None:
        bs = cache.shape[2]
        shift = bs.bit_length() - 1
        slots = md.slot_mapping[: key.shape[0]]
        blocks, offsets = slots >> shift, slots & (bs - 1)
        cache[blocks, 0, offsets] = key
        cache[blocks, 1, offsets] = value


class PowerOfTwoSlots(_Small):
    name = "broken_pow2_slots"
    supported_block_sizes = (16, 24, 48)
    builders = bind_each((FullAttentionSpec,), GatheredBuilder, _ShiftSlots)


def test_power_of_two_slot_arithmetic_fails_the_other_block_sizes() -> None:
    report = check_backend(PowerOfTwoSlots)
    bad = {r.capability: r for r in report.failures()}
    sizes = {n for r in bad.values() for n in r.needs if n.startswith("block_size=")}
    assert sizes == {"block_size=24", "block_size=48"}, report.describe()
    assert report.result("kind=full_attention").status == "passed"


# ------------------------------------------------------------------ head sizes


class _Tiles64(GatheredImpl):
    """Scores and output in 64-wide tiles of the head dimension: the tail is dropped."""

    @override
    def softmax_v(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        d = q.shape[-1]
        width = d if d <= 64 else 64 * (d // 64)
        out = torch.zeros_like(q)
        out[..., :width] = super().softmax_v(q[..., :width], k[..., :width], v[..., :width], visible)
        return out


class DropsHeadTail(_Small):
    name = "broken_head_tail"
    supported_head_sizes = None
    builders = bind_each((FullAttentionSpec,), GatheredBuilder, _Tiles64)


def test_a_dropped_head_tail_fails_head_sizes_80_and_96() -> None:
    report = check_backend(DropsHeadTail)
    sizes = {n for r in report.failures() for n in r.needs if n.startswith("head_size=")}
    assert sizes == {"head_size=80", "head_size=96"}, report.describe()
    assert all(
        r.status == "passed"
        for r in report.results
        if r.choice is not None and r.choice.head_size in (16, 64)
    ), report.describe()


# ------------------------------------------------------------------ shared metadata


class _OwnSlotsBuilder(GatheredBuilder):
    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> GatheredMeta:
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        return dataclasses.replace(meta, slot_mapping=meta.slot_mapping.clone())


class _DividesSlotsInPlace(GatheredImpl):
    """Turns the group's slot mapping into block ids in place (``floor_divide_``)."""

    @override
    def write(
        self, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, md: GatheredMeta
    ) -> None:
        bs = cache.shape[2]
        slots = md.slot_mapping[: key.shape[0]]
        offsets = slots % bs
        blocks = slots.floor_divide_(bs)
        cache[blocks, 0, offsets] = key
        cache[blocks, 1, offsets] = value


class MutatesSlotMapping(_Small):
    name = "broken_slot_mapping_in_place"
    builders = bind_each((FullAttentionSpec,), _OwnSlotsBuilder, _DividesSlotsInPlace)


def test_slot_mapping_changed_in_place_fails_the_second_layer() -> None:
    report = check_backend(MutatesSlotMapping)
    failures = report.failures()
    assert failures, report.describe()
    for r in failures:
        assert "layer 1" in r.detail, r.describe()
        assert "layer 0" not in r.detail, r.describe()
        assert r.example is not None
        assert r.example.layers == 2
        # One layer alone is right: the second layer of the group is what breaks.
        assert rerun(dataclasses.replace(r.example, layers=1), MutatesSlotMapping) is None


class _ClampsBlockTable(GatheredImpl):
    """Clamps the group's block table in place (the null block read as block 1)."""

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: GatheredMeta,
        output: torch.Tensor,
    ) -> torch.Tensor:
        out = super().forward(query, key, value, kv_cache, attn_metadata, output)
        attn_metadata.block_table.clamp_(min=1)
        return out


class MutatesBlockTable(_Small):
    name = "broken_block_table_in_place"
    builders = bind_each((FullAttentionSpec,), GatheredBuilder, _ClampsBlockTable)


def test_metadata_changed_in_place_fails() -> None:
    report = check_backend(MutatesBlockTable)
    failures = failed(report)
    assert failures, report.describe()
    for detail in failures.values():
        assert "forward changed the step's metadata in place: block_table_tensor" in detail


class _WritesNextBlock(GatheredImpl):
    """Writes each key and value a second time, one block further on."""

    @override
    def write(
        self, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, md: GatheredMeta
    ) -> None:
        super().write(cache, key, value, md)
        bs, nb = cache.shape[2], cache.shape[0]
        slots = md.slot_mapping[: key.shape[0]]
        blocks = (slots // bs + 1) % nb
        cache[blocks, 0, slots % bs] = key


class WritesOutsideItsSlots(_Small):
    name = "broken_writes_outside"
    builders = bind_each((FullAttentionSpec,), GatheredBuilder, _WritesNextBlock)


def test_a_write_outside_the_steps_slots_fails() -> None:
    report = check_backend(WritesOutsideItsSlots)
    failures = failed(report)
    assert failures, report.describe()
    for detail in failures.values():
        assert "cache slot(s) of kv_cache[0] outside the step's slots" in detail, detail


# ------------------------------------------------------------------ batch order


class _DecodesFirst(GatheredImpl):
    """Takes the batch's first requests to be its decodes (one query each), as a
    backend that reorders nothing but splits like one that does."""

    @override
    def request(
        self,
        query: torch.Tensor,
        cache: torch.Tensor,
        md: GatheredMeta,
        b: int,
        lo: int,
        hi: int,
        seq: int,
        output: torch.Tensor,
    ) -> None:
        qlens = (md.query_start_loc_cpu[1:] - md.query_start_loc_cpu[:-1]).tolist()
        computed = md.num_computed_cpu.tolist()
        decodes = sum(q == 1 and c > 0 for q, c in zip(qlens, computed, strict=True))
        if b < decodes:  # "a decode": its one query at the end of its context
            output[lo : lo + 1] = self.attend(query[lo : lo + 1], cache, md, b, seq)
        else:
            super().request(query, cache, md, b, lo, hi, seq, output)


class AssumesDecodesFirst(_Small):
    name = "broken_decodes_first"
    builders = bind_each((FullAttentionSpec,), GatheredBuilder, _DecodesFirst)


def test_a_decodes_first_assumption_fails_on_the_fixed_case() -> None:
    report = check_backend(AssumesDecodesFirst, max_examples=1)
    assert report.result("kind=full_attention").status == "failed", report.describe()
    # The fixed ragged case alone finds it: its third step schedules a prefill first.
    ragged = ragged_case(LayerChoice(kind=FullAttentionSpec.kind))
    problem = rerun(ragged, AssumesDecodesFirst)
    assert problem is not None
    assert problem.startswith("step 2, layer 0, request r3"), problem


# ------------------------------------------------------------------ the log-sum-exp


class _LseBase2(GatheredImpl):
    """Declares return_lse and fills it in base 2 (as kernels that keep exp2 do)."""

    @override
    def forward_lse(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: GatheredMeta,
        output: torch.Tensor,
        lse: torch.Tensor,
    ) -> torch.Tensor:
        self.forward(query, key, value, kv_cache, attn_metadata, output)
        md, cache = attn_metadata, kv_cache[0]
        lse.fill_(float("-inf"))
        starts = md.query_start_loc_cpu.tolist()
        for b, seq in enumerate(md.seq_lens_cpu.tolist()):
            lo, hi = starts[b], starts[b + 1]
            if hi == lo:
                continue
            m, bs = hi - lo, cache.shape[2]
            pages = cache[md.block_table[b, : -(-seq // bs)].long()]
            k = pages[:, 0].flatten(0, 1)[:seq].float()
            k = k.repeat_interleave(query.shape[1] // k.shape[1], dim=1)
            scores = torch.einsum("mhd,shd->mhs", query[lo:hi].float(), k) * self.scale
            visible = torch.arange(seq)[None] <= (seq - m + torch.arange(m))[:, None]
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            lse[lo:hi] = torch.logsumexp(scores, dim=-1) / math.log(2)  # the bug: log2
        return output


class LseBase2(_Small):
    name = "broken_lse_base2"
    supported_features = frozenset({AttentionFeature.RETURN_LSE})
    builders = bind_each((FullAttentionSpec,), GatheredBuilder, _LseBase2)


def test_an_lse_in_base_2_fails_the_return_lse_combinations() -> None:
    report = check_backend(LseBase2)
    fails = failed(report)
    assert fails, report.describe()
    assert all("feature=return_lse" in c for c in fails), report.describe()
    assert "differ from reference" in next(iter(fails.values()))
    assert report.result("kind=full_attention").status == "passed"


# ------------------------------------------------------------------ nothing checked


class CudaOnly(Gathered):
    name = "broken_cuda_only"
    supported_devices = frozenset({"cuda"})


def test_a_backend_skipped_as_a_whole_is_not_checked() -> None:
    report = check_backend(CudaOnly, device="cpu")
    assert report.results == ()
    assert report.verdict == "not checked"
    assert not report.ok
    assert "NOT CHECKED: device=cpu not supported" in report.describe()
    with pytest.raises(AssertionError, match="NOT CHECKED"):
        report.assert_ok()


def test_the_kit_writes_no_hypothesis_folder_in_the_working_directory(tmp_path: Path) -> None:
    code = (
        "import torch\n"
        "from attnkit.testing import check_backend\n"
        "from attnkit.backends.reference import ReferenceBackend\n"
        "class Small(ReferenceBackend):\n"
        "    name = 'small_reference'\n"
        "    supported_head_sizes = (16,)\n"
        "    supported_block_sizes = (16,)\n"
        "    supported_dtypes = frozenset({torch.float32})\n"
        "    supported_kv_cache_dtypes = frozenset({'auto'})\n"
        "    supported_features = frozenset()\n"
        "assert check_backend(Small, kinds=['full_attention'], max_examples=1).ok\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("HYPOTHESIS_STORAGE_DIRECTORY", None)
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, timeout=300)
    assert not (tmp_path / ".hypothesis").exists()
    assert list(tmp_path.iterdir()) == []
