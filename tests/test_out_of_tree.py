"""The out-of-tree example package (examples/out_of_tree_backend) is discovered through
its entry point, listed, chosen through ``backend_per_kind``, and computes correctly.

The package is put on the path with a ``.dist-info`` carrying the entry point its
pyproject declares, which is what ``pip install`` would write.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnkit import (
    AttentionConfig,
    AttentionLayerParams,
    BackendRegistry,
    ChunkedLocalAttentionSpec,
    KVCacheSpecKind,
    select_backend,
)
from attnkit.backend_api import AttentionImpl, CommonAttentionMetadata
from attnkit.cli import main as cli_main

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "out_of_tree_backend"


@pytest.fixture
def example_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pyproject = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    entry_points = pyproject["project"]["entry-points"]["attnkit.backends"]
    dist_info = tmp_path / "attnkit_example_chunked-0.1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: attnkit-example-chunked\nVersion: 0.1.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        "[attnkit.backends]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    )
    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("ATTNKIT_PLUGINS", raising=False)
    return tmp_path


SPEC = ChunkedLocalAttentionSpec(
    block_size=8, num_kv_heads=1, head_size=16, dtype=torch.float32, attention_chunk_size=6
)


def test_discovered_from_its_entry_point(example_path: Path) -> None:
    reg = BackendRegistry()
    assert "example_chunked_local" in reg.names()
    entry = reg.entry("example_chunked_local")
    assert entry.origin == "plugin"
    assert entry.source == (
        "entry point example_chunked_local = attnkit_example_chunked.backend:ChunkedLocalBackend "
        "from distribution 'attnkit-example-chunked'"
    )
    backend = reg.get("example_chunked_local")
    assert backend.__module__ == "attnkit_example_chunked.backend"


def test_listed_by_attnkit_backends(example_path: Path) -> None:
    out = io.StringIO()
    assert cli_main(["backends"], registry=BackendRegistry(), out=out) == 0
    text = out.getvalue()
    assert "  example_chunked_local [plugin] available\n    kinds: chunked_local_attention\n" in text


def test_chosen_through_backend_per_kind(example_path: Path) -> None:
    reg = BackendRegistry()
    config = AttentionConfig.model_validate(
        {"backend_per_kind": "chunked_local_attention=example_chunked_local"}, context={"registry": reg}
    )
    selection = select_backend(SPEC, config, device="cpu", registry=reg)
    assert selection.backend_name == "example_chunked_local"
    assert selection.source == "backend_per_kind"
    # Asked for a kind it does not serve, it says so.
    bad = AttentionConfig.model_validate(
        {"backend_per_kind": "full_attention=example_chunked_local"}, context={"registry": reg}
    )
    from attnkit import BackendNotSupportedError, FullAttentionSpec

    with pytest.raises(BackendNotSupportedError, match=r"kind=full_attention not supported \(supported: chunked_local_attention\)"):
        select_backend(
            FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=16, dtype=torch.float32),
            bad, device="cpu", registry=reg,
        )


def _chunked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, scale: float) -> torch.Tensor:
    """Dense chunked-local causal attention of one sequence, by explicit loops (float64)."""
    out = torch.zeros_like(q, dtype=torch.float64)
    n = q.shape[0]
    for i in range(n):
        keys = [j for j in range(i + 1) if j // chunk == i // chunk]
        scores = torch.stack([(q[i].double() * k[j].double()).sum(-1) * scale for j in keys])  # [len, H]
        weights = torch.softmax(scores, dim=0)
        out[i] = sum(weights[t][:, None] * v[j].double() for t, j in enumerate(keys))
    return out


def test_computes_chunked_local_attention(example_path: Path) -> None:
    reg = BackendRegistry()
    config = AttentionConfig.model_validate({}, context={"registry": reg})
    backend = select_backend(SPEC, config, device="cpu", registry=reg).backend
    binding = backend.get_binding(SPEC)
    builder = binding.create(SPEC, ["layers.0"], config, torch.device("cpu"))
    impl = binding.create_impl(SPEC, AttentionLayerParams(num_heads=2))
    assert isinstance(impl, AttentionImpl)

    torch.manual_seed(0)
    (shape,) = backend.get_kv_cache_shapes(8, SPEC)
    cache = torch.full(shape, float("nan"))
    # Request 0: 13-token prompt in blocks 5, 2; request 1: 4-token prompt in block 7.
    lens, tables = [13, 4], [[5, 2], [7]]
    slots = [tables[r][p // 8] * 8 + p % 8 for r, n in enumerate(lens) for p in range(n)]
    cm = CommonAttentionMetadata.from_lists(
        query_lens=lens, seq_lens=lens, block_table=tables, slot_mapping=slots
    )
    q, k, v = torch.randn(17, 2, 16), torch.randn(17, 1, 16), torch.randn(17, 1, 16)
    output = torch.full((17, 2, 16), float("nan"))
    impl.forward(q, k, v, [cache], builder.build(0, cm), output)

    scale = 16**-0.5
    expected = torch.cat(
        [
            _chunked_reference(q[:13], k[:13].expand(13, 2, 16), v[:13].expand(13, 2, 16), 6, scale),
            _chunked_reference(q[13:], k[13:].expand(4, 2, 16), v[13:].expand(4, 2, 16), 6, scale),
        ]
    )
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)


def test_impl_is_made_only_with_what_it_declares(example_path: Path) -> None:
    backend = BackendRegistry().get("example_chunked_local")
    assert backend.supported_kinds() == {KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION}
    assert backend.declaration_problems() == []
    binding = backend.get_binding(SPEC)
    with pytest.raises(
        TypeError, match=r"^ChunkedLocalImpl takes layer_params of type AttentionLayerParams, got NoneType$"
    ):
        binding.create_impl(SPEC, None)
    with pytest.raises(
        ValueError,
        match=r"^ChunkedLocalImpl: the layer needs logits_soft_cap, which example_chunked_local does "
        r"not support \(supported features: none\)$",
    ):
        binding.create_impl(SPEC, AttentionLayerParams(num_heads=2, logits_soft_cap=30.0))


def test_listed_by_the_installed_command_line(example_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(example_path), str(EXAMPLE / "src")]))
    env.pop("ATTNKIT_PLUGINS", None)
    code = (
        "import sys, attnkit; assert 'attnkit_example_chunked' not in sys.modules; "
        "from attnkit.cli import main; sys.exit(main(['backends', '--json']))"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    rows = {row["name"]: row for row in json.loads(result.stdout)["backends"]}
    assert rows["example_chunked_local"]["available"] is True
    assert rows["example_chunked_local"]["kinds"] == ["chunked_local_attention"]
    # The allowlist keeps it out.
    env["ATTNKIT_PLUGINS"] = "something_else"
    result = subprocess.run(
        [sys.executable, "-m", "attnkit", "backends", "--json"], env=env, capture_output=True, text=True, check=True
    )
    rows = {row["name"]: row for row in json.loads(result.stdout)["backends"]}
    assert rows["example_chunked_local"]["reasons"] == [
        "excluded: plugin 'example_chunked_local' is not in the allowlist ATTNKIT_PLUGINS='something_else'"
    ]
