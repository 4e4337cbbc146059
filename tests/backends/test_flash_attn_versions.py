"""flash-attn detection and per-release rules (``backends/flash_attn/_versions.py``).

Detection runs on fake distributions written to a temporary directory put first on
``sys.path``: a ``<name>-<version>.dist-info`` with ``METADATA``, ``RECORD`` and
``top_level.txt``, plus package files that raise if imported. The layouts follow the
real ones: the flash-attn 2.8.3 sdist ships ``flash_attn/cute/interface.py`` inside the
``flash-attn`` distribution; the ``flash-attn-4`` 4.0.0b36 wheel ships only
``flash_attn/cute/`` (no ``flash_attn/__init__.py``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from attnkit import (
    AttentionConfig,
    AttentionFeature,
    AttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
)
from attnkit.backend_api import BackendRequest
from attnkit.backends.flash_attn import FlashAttentionBackend, _versions, choose_version
from attnkit.backends.flash_attn.backend import _import_varlen_func

REALLY_INSTALLED = _versions.installed_releases()
CUDA = torch.device("cuda")
FA4_NOT_INSTALLED = (
    "backend_options flash_attn version=4 was requested but flash-attn 4 is not installed "
    "(pip install flash-attn-4)"
)
RAISES = "raise RuntimeError('imported')\n"

pytestmark = pytest.mark.skipif(
    bool(REALLY_INSTALLED), reason="flash-attn is installed here: fakes would mix with it"
)


def write_dist(root: Path, name: str, version: str, files: dict[str, str]) -> None:
    """A fake installed distribution ``name`` ``version`` owning ``files``."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    tops = sorted({path.split("/")[0].removesuffix(".py") for path in files})
    (info / "top_level.txt").write_text("".join(f"{t}\n" for t in tops))
    record = [f"{path},," for path in files] + [
        f"{info.name}/{n},," for n in ("METADATA", "RECORD")
    ]
    (info / "RECORD").write_text("\n".join(record) + "\n")
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def fa2(root: Path, version: str = "2.8.3") -> None:
    files = {
        "flash_attn/__init__.py": RAISES,
        "flash_attn/flash_attn_interface.py": RAISES,
        "flash_attn_2_cuda.py": RAISES,  # stands for the compiled extension
    }
    if version.startswith("2.8."):  # 2.8.0-2.8.3: the prototype cute package
        files["flash_attn/cute/__init__.py"] = RAISES
        files["flash_attn/cute/interface.py"] = RAISES
    write_dist(root, "flash-attn", version, files)


def fa4(root: Path, version: str = "4.0.0b36") -> None:
    write_dist(
        root,
        "flash-attn-4",
        version,
        {"flash_attn/cute/__init__.py": RAISES, "flash_attn/cute/interface.py": RAISES},
    )


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty site directory, first on ``sys.path``; no flash_attn module leaks out."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_versions, "cuda_available", lambda: True)
    yield tmp_path
    for name in [m for m in sys.modules if m.split(".")[0] in ("flash_attn", "flash_attn_2_cuda")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def detected(site: Path) -> dict[_versions.FlashAttnVersion, str]:
    importlib.invalidate_caches()
    found = _versions.installed_releases()
    assert not [m for m in sys.modules if m.split(".")[0] in ("flash_attn", "flash_attn_2_cuda")]
    return dict(found)


def spec_full(**overrides: object) -> FullAttentionSpec:
    fields: dict[str, object] = {
        "block_size": 256,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": torch.float16,
    }
    fields.update(overrides)
    return FullAttentionSpec(**fields)  # pyright: ignore[reportArgumentType]  # test fields


def reasons(spec: AttentionSpec, version: int | None, capability: tuple[int, int]) -> list[str]:
    config = AttentionConfig.model_validate(
        {"backend_options": {"flash_attn": {"version": version}}},
        context={"known_backends": ["flash_attn"]},
    )
    return FlashAttentionBackend.not_supported_reasons(
        BackendRequest(spec=spec, device=CUDA, capability=capability, config=config)
    )


# ----------------------------------------------------------------------------------
# Detection by distribution
# ----------------------------------------------------------------------------------


def test_flash_attn_2_8_3_alone_is_not_flash_attn_4(site: Path) -> None:
    fa2(site, "2.8.3")
    assert (site / "flash_attn" / "cute" / "interface.py").is_file()
    assert detected(site) == {2: "2.8.3"}
    assert _versions.installed_versions() == frozenset({2})


def test_auto_choice_on_blackwell_with_only_flash_attn_2_is_2(site: Path) -> None:
    fa2(site, "2.8.3")
    choice = choose_version(None, (10, 0), installed=detected(site), spec=spec_full())
    assert (choice.version, choice.reasons, choice.release) == (2, (), "2.8.3")
    assert reasons(spec_full(), None, (10, 0)) == []


def test_requesting_4_with_only_flash_attn_2_says_not_installed(site: Path) -> None:
    fa2(site, "2.8.3")
    detected(site)
    assert reasons(spec_full(block_size=16), 4, (10, 0)) == [FA4_NOT_INSTALLED]


def test_flash_attn_4_alone(site: Path) -> None:
    fa4(site, "4.0.0b36")
    assert detected(site) == {4: "4.0.0b36"}
    assert choose_version(None, (9, 0), installed=detected(site)).version == 4


def test_both_installed(site: Path) -> None:
    fa2(site, "2.8.3")
    fa4(site, "4.0.0b36")
    assert detected(site) == {2: "2.8.3", 4: "4.0.0b36"}
    choice = choose_version(None, (10, 0), installed=detected(site))
    assert (choice.version, choice.release) == (4, "4.0.0b36")


def test_a_flash_attn_1_distribution_is_not_flash_attn_2(site: Path) -> None:
    write_dist(site, "flash-attn", "1.0.9", {"flash_attn/__init__.py": RAISES})
    assert detected(site) == {}


def test_a_cute_package_without_a_distribution_is_nothing(site: Path) -> None:
    (site / "flash_attn" / "cute").mkdir(parents=True)
    (site / "flash_attn" / "cute" / "interface.py").write_text(RAISES)
    assert detected(site) == {}


def test_a_prototype_cute_interface_is_refused_at_import(site: Path) -> None:
    # The 2.8.3 prototype's flash_attn_varlen_func takes no max_seqlen_q / max_seqlen_k
    # (flash_attn-2.8.3 sdist, flash_attn/cute/interface.py).
    stub = (
        "def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None,\n"
        "        seqused_q=None, seqused_k=None, page_table=None, softmax_scale=None,\n"
        "        causal=False, window_size=(None, None), learnable_sink=None,\n"
        "        softcap=0.0, pack_gqa=None):\n"
        "    raise AssertionError('called')\n"
    )
    write_dist(
        site,
        "flash-attn",
        "2.8.3",
        {"flash_attn/__init__.py": "", "flash_attn/cute/__init__.py": stub},
    )
    importlib.invalidate_caches()
    with pytest.raises(ImportError, match="does not take max_seqlen_q, max_seqlen_k: it is not"):
        _import_varlen_func(4)


# ----------------------------------------------------------------------------------
# Releases
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("release", "threshold", "expected"),
    [
        ("4.0.0b36", "4.0.0b30", True),
        ("4.0.0b4", "4.0.0b30", False),
        ("4.0.0b30", "4.0.0b30", True),
        ("4.0.0", "4.0.0b36", True),
        ("4.0.0rc1", "4.0.0b36", True),
        ("2.7.4.post1", "2.7.3", True),
        ("2.7.2", "2.7.3", False),
        ("2.8.3+cu12torch2.8", "2.7.3", True),
        ("nonsense", "2.7.3", False),
        (None, "2.7.3", False),
    ],
)
def test_release_at_least(release: str | None, threshold: str, expected: bool) -> None:
    assert _versions.release_at_least(release, threshold) is expected


def test_sink_dtypes_per_release() -> None:
    assert _versions.sink_dtypes("4.0.0b20") == frozenset({torch.bfloat16})
    assert _versions.sink_dtypes("4.0.0b30") == frozenset(
        {torch.float16, torch.bfloat16, torch.float32}
    )
    assert _versions.sink_dtypes(None) == frozenset({torch.bfloat16})


# ----------------------------------------------------------------------------------
# Rules per release (each row: a fact read in that release; docs/flash-attn.md)
# ----------------------------------------------------------------------------------

ENC = EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
SINKS = frozenset({AttentionFeature.ATTENTION_SINKS})
NO_FEATURES: frozenset[AttentionFeature] = frozenset()


@pytest.mark.parametrize(
    ("release", "capability", "spec", "features", "expected"),
    [
        # capability range: b3 9-11; b20+ 8-12
        pytest.param("4.0.0b3", (8, 0), ENC, NO_FEATURES, ["too old"], id="b3-ampere"),
        pytest.param("4.0.0b19", (12, 0), ENC, NO_FEATURES, ["too new"], id="b19-sm120"),
        pytest.param("4.0.0b20", (8, 0), ENC, NO_FEATURES, [], id="b20-ampere-unpaged"),
        pytest.param("4.0.0b36", (12, 0), ENC, NO_FEATURES, [], id="b36-sm120-unpaged"),
        # paged KV: not on 9.x in b3; from b20 on 9.x-11.x, never on 8.x/12.x
        pytest.param("4.0.0b3", (9, 0), spec_full(block_size=16), NO_FEATURES,
                     ["no paged KV cache on compute capability 9.0 before 4.0.0b20"],
                     id="b3-hopper-paged"),
        pytest.param("4.0.0b20", (9, 0), spec_full(block_size=16), NO_FEATURES, [],
                     id="b20-hopper-paged"),
        pytest.param("4.0.0b36", (12, 0), spec_full(block_size=16), NO_FEATURES,
                     ["no paged KV cache on compute capability 12.0"], id="b36-sm120-paged"),
        # sinks: not in the SM80-MMA kernel (8.x/12.x)
        pytest.param("4.0.0b36", (8, 0), ENC, SINKS, ["attention_sinks not supported"],
                     id="b36-ampere-sinks"),
        pytest.param("4.0.0b36", (10, 0), ENC, SINKS, [], id="b36-blackwell-sinks"),
        # head size 256 on 10.x/11.x: from b36
        pytest.param("4.0.0b30", (10, 0), spec_full(block_size=16, head_size=256), NO_FEATURES,
                     ["head_size=256 not supported by flash-attn 4 on compute capability 10.0 "
                      "(supported: multiples of 8 up to 128)"], id="b30-blackwell-256"),
        pytest.param("4.0.0b36", (11, 0), spec_full(block_size=16, head_size=256), NO_FEATURES,
                     [], id="b36-thor-256"),
        pytest.param("4.0.0b36", (10, 0), spec_full(block_size=16, head_size=192), NO_FEATURES,
                     ["(supported: multiples of 8 up to 128, and 256)"], id="b36-blackwell-192"),
        pytest.param("4.0.0b36", (9, 0), spec_full(block_size=16, head_size=256), NO_FEATURES,
                     [], id="b36-hopper-256"),
        pytest.param("4.0.0b36", (12, 0), ENC.__class__(block_size=16, num_kv_heads=2,
                     head_size=256, dtype=torch.float16), NO_FEATURES,
                     ["(supported: multiples of 8 up to 128)"], id="b36-sm120-256"),
    ],
)  # fmt: skip
def test_flash_attn_4_rules_per_release(
    release: str,
    capability: tuple[int, int],
    spec: AttentionSpec,
    features: frozenset[AttentionFeature],
    expected: list[str],
) -> None:
    choice = choose_version(4, capability, installed={4: release}, spec=spec, features=features)
    assert len(choice.reasons) == len(expected), choice.reasons
    for got, part in zip(choice.reasons, expected, strict=True):
        assert part in got, (got, part)


@pytest.mark.parametrize(
    ("release", "capability", "expected"),
    [
        pytest.param("2.6.3", (8, 9), [], id="2.6.3-ada"),
        pytest.param("2.6.3", (9, 0), [], id="2.6.3-hopper"),
        pytest.param(
            "2.6.3",
            (10, 0),
            [
                "compute capability 10.0 not supported by flash-attn 2 before 2.7.3 "
                "(installed: 2.6.3; it runs on 8.x and 9.0 only; 2.7.3 and later run on "
                "8.0 and newer)"
            ],
            id="2.6.3-blackwell",
        ),
        pytest.param("2.7.3", (10, 0), [], id="2.7.3-blackwell"),
        pytest.param("2.8.3", (12, 0), [], id="2.8.3-sm120"),
    ],
)
def test_flash_attn_2_capability_per_release(
    release: str, capability: tuple[int, int], expected: list[str]
) -> None:
    choice = choose_version(2, capability, installed={2: release}, spec=spec_full())
    assert list(choice.reasons) == expected


def test_unknown_release_gets_the_oldest_rules() -> None:
    choice = choose_version(4, (9, 0), installed=frozenset({4}), spec=spec_full(block_size=16))
    assert choice.release is None
    assert [r.split(" (")[0] for r in choice.reasons] == [
        "flash-attn 4 has no paged KV cache on compute capability 9.0 before 4.0.0b20"
    ]


def test_not_installed_version_is_judged_by_the_newest_release_read() -> None:
    choice = choose_version(4, (9, 0), installed={2: "2.8.3"}, spec=spec_full(block_size=16))
    assert choice.reasons == (FA4_NOT_INSTALLED,)


def test_pyproject_minimum_flash_attn_2_matches_the_capability_rule() -> None:
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert f'"flash-attn>={_versions.FA2_ANY_AMPERE_OR_NEWER}; ' in text
