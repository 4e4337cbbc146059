"""The backend of docs/first-backend.md, "A backend in one file", is complete: it
imports, type-checks under ``mypy --strict``, registers, and computes the same
attention as the reference backend (tests/test_docs.py runs the page as written)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    AttentionRuntime,
    BackendRegistry,
    FullAttentionSpec,
    ScheduledRequest,
)

ROOT = Path(__file__).resolve().parent.parent


def _example_source() -> str:
    text = (ROOT / "docs" / "first-backend.md").read_text()
    match = re.search(r"```python\n(.*?)```", text, flags=re.S)
    assert match is not None, "docs/first-backend.md has no python block"
    return match.group(1)


def _example_module() -> types.ModuleType:
    module = types.ModuleType("readme_backend_example")
    sys.modules[module.__name__] = module
    exec(compile(_example_source(), "docs/first-backend.md", "exec"), module.__dict__)
    return module


def _run(backend: str, registry: BackendRegistry) -> list[torch.Tensor]:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    runtime = AttentionRuntime(
        {"l0": spec},
        AttentionConfig(backend_per_kind={"full_attention": backend}),
        device="cpu",
        memory_budget_bytes=32 * spec.page_size_bytes,
        layer_params={"l0": AttentionLayerParams(num_heads=4)},
        registry=registry,
        cache_fill=float("nan"),
    )
    gen = torch.Generator().manual_seed(0)
    outputs = []
    for schedule in ([("a", 21), ("b", 5)], [("a", 1), ("b", 17)], [("a", 1), ("b", 1)]):
        step = runtime.begin_step([ScheduledRequest(r, n) for r, n in schedule])
        t = step.num_tokens
        q = torch.randn(t, 4, 32, generator=gen)
        k, v = torch.randn(2, t, 2, 32, generator=gen)
        outputs.append(runtime.forward("l0", q, k, v))
    return outputs


def test_readme_backend_matches_the_reference_backend() -> None:
    example = _example_module()
    registry = BackendRegistry(builtins={"reference": "attnkit.backends.reference:ReferenceBackend"})
    registry.register(example.MyBackend)
    assert example.MyBackend.supported_kinds() == {FullAttentionSpec.kind}
    got, want = _run("my_backend", registry), _run("reference", registry)
    for g, w in zip(got, want, strict=True):
        assert not g.isnan().any()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.typing
def test_readme_backend_type_checks(tmp_path: Path) -> None:
    from mypy import api

    case = tmp_path / "readme_backend.py"
    case.write_text(_example_source())
    stdout, stderr, status = api.run(
        ["--config-file", str(ROOT / "pyproject.toml"), "--no-error-summary", str(case)]
    )
    assert (status, stdout, stderr) == (0, "", "")
