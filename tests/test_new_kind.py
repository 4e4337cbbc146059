"""A spec kind added through ``spec.py``, ``kinds/_attention.py`` and ``__init__.py`` alone
is run by the runtime on ``reference``, planned by ``plan_model`` and checked by the
conformance kit, and hits the prefix cache by the rule its mask implies, with no edit
anywhere else (docs/architecture.md, "Adding a spec kind").

The test copies the package to a temporary directory, inserts a throwaway kind there
(``wide_window``: a sliding window under another name and another field, ``width``),
and runs a script against the copy in a subprocess. The script checks the runtime's
output against a dense softmax over each request's whole sequence under the window
mask, written here, plans a model with the kind, and runs the kit on ``reference`` and
on ``cpu_attn`` (both declare their kinds from the rules) restricted to it. The
negative control leaves the ``kinds/_attention.py`` insertions out and must fail at
import, naming the kind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import attnkit

PACKAGE = Path(attnkit.__file__).parent
SPEC_CLASS = '''
@dataclasses.dataclass(frozen=True, kw_only=True)
class WideWindowSpec(AttentionSpec):
    """Causal attention to the last ``width`` tokens (a throwaway kind of the tests)."""

    kind: ClassVar[KVCacheSpecKind] = KVCacheSpecKind.WIDE_WINDOW
    width: int

    @override
    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int(type(self).__name__, "width", self.width)

    @override
    def _max_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        live = min(self.width - 1 + max_num_batched_tokens, max_model_len)
        return min(math.ceil(live / self.block_size) + 1, math.ceil(max_model_len / self.block_size))


'''
KINDS_CLASS = '''
class _WideWindowRules(_PagedRules[WideWindowSpec]):
    releases = True
    grows_without_bound = False
    extent = "window"
    extent_field = "width"
    short_name = "wide_window"

    @override
    def mask(self, spec: WideWindowSpec) -> Mask:
        return Mask(window=spec.width)


'''


def _after(anchor: str, text: str) -> tuple[str, str]:
    return anchor, anchor + text


def _before(anchor: str, text: str) -> tuple[str, str]:
    return anchor, text + anchor


# file -> (anchor, replacement), each anchor found exactly once in its file.
SPEC_EDITS: dict[str, list[tuple[str, str]]] = {
    "spec.py": [
        _after('    CROSS_ATTENTION = "cross_attention"\n', '    WIDE_WINDOW = "wide_window"\n'),
        _before("_ABSTRACT_SPECS: frozenset", SPEC_CLASS),
        _after("    CrossAttentionSpec,\n", "    WideWindowSpec,\n"),  # ATTENTION_SPEC_CLASSES
    ],
    "__init__.py": [
        _after("    get_attn_spec_kind,\n", "    WideWindowSpec,\n"),
        _after('    "SlidingWindowSpec",\n', '    "WideWindowSpec",\n'),
    ],
}
KINDS_EDITS: dict[str, list[tuple[str, str]]] = {
    "kinds/_attention.py": [
        _after("    SlidingWindowSpec,\n)\n", "from ..spec import WideWindowSpec\n"),
        _before("ATTENTION_RULES: tuple[", KINDS_CLASS),
        _after("    _CrossRules(CrossAttentionSpec),\n", "    _WideWindowRules(WideWindowSpec),\n"),
    ],
}

SCRIPT = textwrap.dedent(
    '''
    import math

    import torch

    import attnkit
    from attnkit import (
        AttentionConfig,
        AttentionLayerParams,
        AttentionRuntime,
        FullAttentionSpec,
        KVCacheSpecKind,
        ScheduledRequest,
        WideWindowSpec,
    )
    from attnkit.backends.reference import ReferenceBackend
    from attnkit.planner import plan_model
    from attnkit.testing import check_backend

    assert attnkit.__file__.startswith(COPY), attnkit.__file__
    KIND = KVCacheSpecKind("wide_window")
    WIDTH, HQ, HKV, D, BS = 5, 4, 2, 8, 4
    spec = WideWindowSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32,
                          width=WIDTH)

    # 1. The runtime, on reference: every step against a dense recompute.
    runtime = AttentionRuntime(
        {"layer": spec},
        AttentionConfig(backend_per_kind={KIND: "reference"}, max_model_len=64),
        device="cpu",
        memory_budget_bytes=64 * spec.page_size_bytes,
        layer_params={"layer": AttentionLayerParams(num_heads=HQ)},
        cache_fill=float("nan"),
    )
    assert runtime.routing_table()[0].backend == "reference"
    gen = torch.Generator().manual_seed(0)
    seen = {}  # request -> its (q, k, v) so far

    def dense(q, k, v):
        """Softmax over every earlier key within WIDTH positions, by definition."""
        n = k.shape[0]
        i = torch.arange(n)[-q.shape[0]:, None]
        j = torch.arange(n)[None, :]
        allowed = (j <= i) & (i - j < WIDTH)
        kk = k.repeat_interleave(HQ // HKV, dim=1)
        vv = v.repeat_interleave(HQ // HKV, dim=1)
        scores = torch.einsum("thd,shd->hts", q, kk) / math.sqrt(D)
        scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.einsum("hts,shd->thd", scores.softmax(-1), vv)

    schedule = [[("a", 7), ("b", 3)], [("a", 4), ("b", 1)], [("a", 1), ("b", 1), ("c", 9)],
                [("a", 1), ("b", 6), ("c", 1)], [("a", 1), ("c", 1)]]
    worst = 0.0
    for step in schedule:
        batch = runtime.begin_step([ScheduledRequest(r, n) for r, n in step])
        new = {r: [torch.randn(n, h, D, generator=gen) for h in (HQ, HKV, HKV)] for r, n in step}
        order = batch.order
        q, k, v = (torch.cat([new[r][i] for r in order]) for i in range(3))
        out = runtime.forward("layer", q, k, v)
        for r, rows in batch.token_slices().items():
            before = seen.get(r)
            whole = [t if before is None else torch.cat([before[i], t])
                     for i, t in enumerate(new[r])]
            seen[r] = whole
            expected = dense(new[r][0], whole[1], whole[2])
            worst = max(worst, (out[rows] - expected).abs().max().item())
    assert worst < 1e-5, worst
    # Request a's last query (position 13) sees 9..13: blocks 0 and 1 went back to the
    # pool, as the kind's window says (its first live block follows from its mask).
    table = runtime.manager.block_table(0, "a")
    assert table[:2] == [0, 0] and all(table[2:]) and len(table) == 4, table
    print(f"runtime: max error {worst:.2e}")

    # 2. The planner: the kind's window bounds its cache; tensor and context parallelism.
    full = FullAttentionSpec(block_size=16, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    plan = plan_model(
        {"wide": WideWindowSpec(block_size=16, num_kv_heads=HKV, head_size=D,
                                dtype=torch.float32, width=512), "full": full},
        AttentionConfig(backend_per_kind={KIND: "reference"}, max_model_len=8192,
                        max_num_batched_tokens=256),
        device="cpu", memory_bytes=1 << 26, tensor_parallel=2, context_parallel=2,
    )
    wide = plan.layers[0]
    assert (wide.kind, wide.sliding_window, wide.attention_chunk_size) == ("wide_window", 512, None)
    group = plan.groups[plan.layers[0].group]
    assert group.error is None and group.backend_name == "reference", group
    assert group.per_request_cap_bytes is not None  # bounded by its window
    assert group.blocks_per_request == (512 - 1 + 256 + 15) // 16 + 1
    split = plan.per_rank.splits[group.group.group_id]
    assert split.context == "replicated" and split.kv_heads == 1, split
    assert plan.kv_bytes_per_token == 2 * (spec.page_size_bytes // BS)
    assert plan.per_rank.max_context_tokens is not None
    print("plan:", split.detail)

    # 3. The conformance kit, restricted to the kind: its cases come from the kind.
    report = check_backend(ReferenceBackend, kinds=[KIND], max_examples=2)
    report.assert_ok()
    assert report.result("kind=wide_window").status == "passed"
    assert report.result("kind=full_attention").status == "skipped"
    print("kit:", report.result("kind=wide_window").capability, "passed")

    # cpu_attn (and flex_attention) declare their kinds from the rules too (every kind
    # with K/V planes): the kit checks the CPU default against reference on the new kind.
    from attnkit.backends.cpu_attn import CpuAttentionBackend
    from attnkit.backends.flex_attention import FlexAttentionBackend

    assert KIND in FlexAttentionBackend.supported_kinds()
    assert KIND in CpuAttentionBackend.supported_kinds()
    engines = check_backend(CpuAttentionBackend, kinds=[KIND], max_examples=2)
    engines.assert_ok()
    print("cpu_attn:", engines.result("kind=wide_window").status)

    # 4. The prefix cache: the kind's hit rule follows from its mask (a window of 5 in
    # blocks of 4: a hit of 12 tokens reads the blocks of positions 8..11, block 2 only).
    import numpy as np
    from attnkit.kinds import rules_for

    rules = rules_for(spec)
    cached = np.array([False, False, True, False])
    assert rules.prefix_hit(spec, cached, 13)[0] == 12, rules.prefix_hit(spec, cached, 13)
    assert rules.prefix_blocks(spec, 12).tolist() == [2]
    print("prefix: hit", rules.prefix_hit(spec, cached, 13)[0])
    '''
)


def _copy_with(tmp: Path, edits: dict[str, list[tuple[str, str]]]) -> Path:
    """The package copied under ``tmp/src``, with ``edits`` applied; returns ``tmp/src``."""
    dest = tmp / "src" / "attnkit"
    shutil.copytree(PACKAGE, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for name, replacements in edits.items():
        path = dest / name
        body = path.read_text()
        for anchor, replacement in replacements:
            assert body.count(anchor) == 1, (name, anchor)
            body = body.replace(anchor, replacement)
        path.write_text(body)
    return dest.parent


def _run(tmp: Path, src: Path) -> subprocess.CompletedProcess[str]:
    script = tmp / "new_kind.py"
    script.write_text(f"COPY = {str(src)!r}\n" + SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp,
        timeout=600,
        check=False,
    )


def test_a_kind_added_in_spec_kinds_and_init_only_runs_plans_and_passes_the_kit(
    tmp_path: Path,
) -> None:
    src = _copy_with(tmp_path, {**SPEC_EDITS, **KINDS_EDITS})
    copy = src / "attnkit"
    changed = {
        p.relative_to(copy).as_posix()
        for p in copy.rglob("*")
        if p.is_file() and p.read_bytes() != (PACKAGE / p.relative_to(copy)).read_bytes()
    }
    assert changed == {"spec.py", "kinds/_attention.py", "__init__.py"}  # nothing else is edited
    result = _run(tmp_path, src)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "runtime: max error" in result.stdout
    assert "kit: kind=wide_window passed" in result.stdout
    assert "cpu_attn: passed" in result.stdout
    assert "prefix: hit 12" in result.stdout


def test_a_kind_without_rules_fails_at_import_naming_it(tmp_path: Path) -> None:
    """Negative control: the same kind with the ``kinds/_attention.py`` insertions left out."""
    src = _copy_with(tmp_path, SPEC_EDITS)
    result = _run(tmp_path, src)
    assert result.returncode != 0
    assert "TypeError: attnkit.kinds declares no KindRules for kind(s) wide_window" in (
        result.stderr
    ), result.stderr
