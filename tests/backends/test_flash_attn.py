"""The ``flash_attn`` backend: its reasons, its metadata, and its half of the flash-attn contract.

flash-attn needs CUDA and is not installed where this suite usually runs, so most of
this file checks what attnkit controls:

* capability and selection reasons, exact sentence by exact sentence, with flash-attn
  truly missing and with its presence simulated (``_versions.installed_releases``
  replaced; detection itself, on fake distributions, is in test_flash_attn_versions.py);
* the builder's metadata field by field against the documented meaning of each
  ``flash_attn_varlen_func`` argument, by running the builder and impl through a small
  pure-torch model of that documented contract (``fa2_contract`` / ``fa4_contract``
  below) and comparing with the reference backend on ragged multi-step batches over
  shuffled blocks. This checks our half of the contract (what we pass and how we lay
  out the cache), not the kernel: the models are written from the docstrings and
  argument checks of flash-attn's ``flash_attn_interface.py`` and
  ``cute/interface.py``, and a misreading of those would pass here and fail on a GPU.
  The models also hold the kernels' hidden preconditions: the flash-attn 4 model reads
  whole pages and fails on a non-finite row in them (TMA page loads, b36), the flash-attn
  2 model fails a GQA decode call (``max_seqlen_q == 1``) whose batch has an empty
  query row (2.8.3 ``flash_api.cpp`` reshape);
* on a GPU with flash-attn installed (``gpu`` marker), the real kernels on the same
  batches against the reference backend.
"""

from __future__ import annotations

import dataclasses
import random
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch

from attnkit import (
    AttentionCGSupport,
    AttentionConfig,
    AttentionFeature,
    AttentionLayerParams,
    AttentionSpec,
    BackendNotSupportedError,
    BackendRegistry,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpecKind,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    select_backend,
)
from attnkit.backend_api import BackendRequest, CommonAttentionMetadata
from attnkit.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
    _versions,
    choose_version,
)
from attnkit.backends.flash_attn.backend import _import_varlen_func
from attnkit.backends.reference import ReferenceBackend
from attnkit.registry import BUILTIN_BACKENDS

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
NAN = float("nan")
F = KVCacheSpecKind
NOT_INSTALLED = (
    "flash-attn is not installed (pip install 'attnkit[flash-attn]' for flash-attn 2, "
    "or pip install flash-attn-4 for flash-attn 4)"
)
NO_CUDA = "no CUDA device is available (torch.cuda.is_available() is False)"
REALLY_INSTALLED = _versions.installed_versions()


def config(version: int | None = None) -> AttentionConfig:
    return AttentionConfig.model_validate(
        {"backend_options": {"flash_attn": {"version": version}}},
        context={"known_backends": ["flash_attn"]},
    )


def full_spec(**overrides: Any) -> FullAttentionSpec:
    fields: dict[str, Any] = {
        "block_size": 256,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": torch.float16,
    }
    fields.update(overrides)
    return FullAttentionSpec(**fields)


LATEST = {2: "2.8.3", 4: "4.0.0b36"}
"""The newest releases read (their rules apply when a test installs just a version)."""


@pytest.fixture
def simulate(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``simulate(installed={2, 4}, cuda=True)``: pretend flash-attn and a GPU are here.

    ``installed`` is versions (each at its ``LATEST`` release) or version -> release."""

    def apply(installed: Iterable[int] | dict[int, str] = (2, 4), cuda: bool = True) -> None:
        found = (
            dict(installed) if isinstance(installed, dict) else {v: LATEST[v] for v in installed}
        )
        monkeypatch.setattr(_versions, "installed_releases", lambda: dict(found))
        monkeypatch.setattr(_versions, "cuda_available", lambda: cuda)

    return apply


def reasons(
    spec: AttentionSpec,
    *,
    version: int | None = None,
    capability: tuple[int, int] | None = (9, 0),
    device: torch.device = CUDA,
    features: frozenset[AttentionFeature] = frozenset(),
    num_heads: int | None = None,
) -> list[str]:
    return FlashAttentionBackend.not_supported_reasons(
        BackendRequest(
            spec=spec,
            device=device,
            capability=capability,
            features=features,
            num_heads=num_heads,
            config=config(version),
        )
    )


# ----------------------------------------------------------------------------------
# Declarations and environment reasons
# ----------------------------------------------------------------------------------


def test_declarations_are_valid() -> None:
    assert FlashAttentionBackend.declaration_problems() == []
    assert FlashAttentionBackend.name == "flash_attn"
    assert FlashAttentionBackend.supported_devices == frozenset({"cuda"})
    assert FlashAttentionBackend.supported_dtypes == frozenset({torch.float16, torch.bfloat16})
    assert FlashAttentionBackend.supported_kv_cache_dtypes == frozenset({"auto"})
    assert FlashAttentionBackend.supported_kinds() == frozenset(
        {F.FULL_ATTENTION, F.SLIDING_WINDOW, F.ENCODER_ONLY_ATTENTION, F.CROSS_ATTENTION}
    )
    assert AttentionFeature.RETURN_LSE not in FlashAttentionBackend.supported_features
    for kind in FlashAttentionBackend.supported_kinds():
        spec_cls = {
            F.FULL_ATTENTION: FullAttentionSpec,
            F.SLIDING_WINDOW: SlidingWindowSpec,
            F.ENCODER_ONLY_ATTENTION: EncoderOnlyAttentionSpec,
            F.CROSS_ATTENTION: CrossAttentionSpec,
        }[kind]
        binding = next(b for b in FlashAttentionBackend.builders if b.spec_type is spec_cls)
        assert binding.kind is kind
        assert binding.builder_type is FlashAttentionMetadataBuilder
        assert binding.impl_type is FlashAttentionImpl


@pytest.mark.skipif(bool(REALLY_INSTALLED), reason="flash-attn is installed here")
def test_not_installed_is_a_reason_here() -> None:
    assert FlashAttentionBackend.environment_reasons(CPU) == [
        "device=cpu not supported (supported: cuda)",
        NOT_INSTALLED,
    ]
    assert NOT_INSTALLED in reasons(full_spec())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_no_cuda_device_is_a_reason_here() -> None:
    assert NO_CUDA in FlashAttentionBackend.environment_reasons(CUDA, (9, 0))


def test_import_does_not_pull_flash_attn() -> None:
    code = textwrap.dedent(
        """
        import sys, torch
        import attnkit
        from attnkit import FullAttentionSpec
        from attnkit.backend_api import BackendRequest
        from attnkit.backends.flash_attn import FlashAttentionBackend
        spec = FullAttentionSpec(block_size=256, num_kv_heads=2, head_size=64, dtype=torch.float16)
        FlashAttentionBackend.not_supported_reasons(
            BackendRequest(spec=spec, device=torch.device("cuda"), capability=(9, 0))
        )
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("flash_attn", "flash_attn_2_cuda"))
        print(",".join(heavy) or "none")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "none", result.stderr


# ----------------------------------------------------------------------------------
# Version choice and per-version reasons (flash-attn simulated)
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "capability", "installed", "version"),
    [
        pytest.param(None, (10, 0), {2, 4}, 4, id="auto-blackwell-both"),
        pytest.param(None, (11, 0), {4}, 4, id="auto-thor-fa4"),
        pytest.param(None, (9, 0), {2, 4}, 2, id="auto-hopper-prefers-fa2"),
        pytest.param(None, (8, 6), {2, 4}, 2, id="auto-ampere"),
        pytest.param(None, (10, 0), {2}, 2, id="auto-blackwell-only-fa2"),
        pytest.param(None, (9, 0), {4}, 4, id="auto-hopper-only-fa4"),
        pytest.param(None, None, {2, 4}, 2, id="auto-unknown-capability"),
        pytest.param(None, (9, 0), set(), None, id="auto-nothing-installed"),
        pytest.param(4, (8, 0), {2}, 4, id="explicit-wins"),
    ],
)
def test_version_choice(
    setting: int | None,
    capability: tuple[int, int] | None,
    installed: set[int],
    version: int | None,
) -> None:
    choice = choose_version(setting, capability, installed=frozenset(installed))  # type: ignore[arg-type]  # test input built loosely or wrong on purpose
    assert choice.version == version


@pytest.mark.parametrize(
    ("installed", "kwargs", "expected"),
    [
        # --- served as is
        pytest.param({2}, {"capability": (8, 0)}, [], id="fa2-ampere"),
        pytest.param(
            {4}, {"capability": (10, 0), "spec": full_spec(block_size=16)}, [], id="fa4-blackwell"
        ),
        pytest.param(
            {2, 4},
            {
                "capability": (9, 0),
                "version": 4,
                "spec": EncoderOnlyAttentionSpec(
                    block_size=16, num_kv_heads=2, head_size=256, dtype=torch.bfloat16
                ),
            },
            [],
            id="fa4-hopper-encoder-only",
        ),
        # --- installation
        pytest.param(
            {2},
            {"capability": (10, 0), "version": 4},
            [
                "backend_options flash_attn version=4 was requested but flash-attn 4 is not "
                "installed "
                "(pip install flash-attn-4)"
            ],
            id="fa4-requested-not-installed",
        ),
        pytest.param(
            {4},
            {"capability": (10, 0), "version": 2},
            [
                "backend_options flash_attn version=2 was requested but flash-attn 2 is not "
                "installed "
                "(pip install 'attnkit[flash-attn]')"
            ],
            id="fa2-requested-not-installed",
        ),
        # --- compute capability
        pytest.param(
            {2}, {"capability": (7, 5)}, ["compute capability 7.5 < minimum 8.0"], id="fa2-turing"
        ),
        pytest.param(
            {2: "2.8.3", 4: "4.0.0b3"},
            {"capability": (8, 6), "version": 4, "spec": full_spec(block_size=16)},
            [
                "compute capability 8.6 is too old for flash-attn 4 (it needs 9.0 to 11.x; "
                "installed: 4.0.0b3; 4.0.0b20 and later: 8.0 to 12.x)"
            ],
            id="fa4-b3-too-old",
        ),
        pytest.param(
            {2: "2.8.3", 4: "4.0.0b3"},
            {"capability": (12, 0), "version": 4, "spec": full_spec(block_size=16)},
            [
                "compute capability 12.0 is too new for flash-attn 4 (it supports 9.0 to "
                "11.x; installed: 4.0.0b3; 4.0.0b20 and later: 8.0 to 12.x)"
            ],
            id="fa4-b3-too-new",
        ),
        pytest.param(
            {2: "2.8.3", 4: "4.0.0b3"},
            {"capability": (9, 0), "version": 4, "spec": full_spec(block_size=128)},
            [
                "flash-attn 4 has no paged KV cache on compute capability 9.0 before "
                "4.0.0b20 (installed: 4.0.0b3), which kind=full_attention needs (upgrade "
                "flash-attn-4, or use backend_options={'flash_attn': {'version': 2}})"
            ],
            id="fa4-b3-hopper-paged",
        ),
        pytest.param(
            {2, 4},
            {"capability": (9, 0), "version": 4, "spec": full_spec(block_size=128)},
            [],
            id="fa4-b36-hopper-paged",
        ),
        pytest.param(
            {2, 4},
            {"capability": (8, 6), "version": 4, "spec": full_spec(block_size=16)},
            [
                "flash-attn 4 has no paged KV cache on compute capability 8.6, which "
                "kind=full_attention needs (use backend_options={'flash_attn': {'version': 2}} "
                "on this GPU)"
            ],
            id="fa4-b36-ampere-paged",
        ),
        pytest.param(
            {2, 4},
            {"capability": (12, 0), "version": 4, "spec": full_spec(block_size=16)},
            [
                "flash-attn 4 has no paged KV cache on compute capability 12.0, which "
                "kind=full_attention needs (use backend_options={'flash_attn': {'version': 2}} "
                "on this GPU)"
            ],
            id="fa4-b36-sm120-paged",
        ),
        pytest.param(
            {2, 4},
            {
                "capability": (13, 0),
                "version": 4,
                "spec": EncoderOnlyAttentionSpec(
                    block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
                ),
            },
            [
                "compute capability 13.0 is too new for flash-attn 4 (it supports 8.0 to "
                "12.x; installed: 4.0.0b36)"
            ],
            id="fa4-b36-too-new",
        ),
        pytest.param(
            {2, 4},
            {"capability": None},
            ["compute capability unknown (pass capability=(major, minor))"],
            id="capability-unknown",
        ),
        # --- head sizes, dtypes, block sizes
        pytest.param(
            {2},
            {"capability": (8, 0), "spec": full_spec(head_size=36)},
            ["head_size=36 not supported by flash-attn 2 (supported: multiples of 8 up to 256)"],
            id="fa2-head-36",
        ),
        pytest.param(
            {2},
            {"capability": (8, 0), "spec": full_spec(head_size=512)},
            ["head_size=512 not supported (supported: 8 to 256)"],
            id="head-512",
        ),
        pytest.param(
            {4},
            {"capability": (10, 0), "spec": full_spec(head_size=192, block_size=16)},
            [
                "head_size=192 not supported by flash-attn 4 on compute capability 10.0 "
                "(supported: multiples of 8 up to 128, and 256)"
            ],
            id="fa4-head-192-blackwell",
        ),
        pytest.param(
            {2},
            {"capability": (8, 0), "spec": full_spec(dtype=torch.float32)},
            ["dtype=float32 not supported (supported: bfloat16, float16)"],
            id="fp32",
        ),
        pytest.param(
            {2},
            {"capability": (8, 0), "spec": full_spec(kv_cache_dtype="fp8_e4m3")},
            ["kv_cache_dtype=fp8_e4m3 not supported (supported: auto)"],
            id="fp8-cache",
        ),
        pytest.param(
            {2},
            {"capability": (8, 0), "spec": full_spec(block_size=16)},
            [
                "block_size=16 not supported by flash-attn 2 (its paged KV cache needs a "
                "multiple of 256)"
            ],
            id="fa2-block-16",
        ),
        pytest.param(
            {2},
            {
                "capability": (8, 0),
                "spec": EncoderOnlyAttentionSpec(
                    block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
                ),
            },
            [],
            id="fa2-encoder-only-any-block",
        ),
        pytest.param(
            {2},
            {"capability": (8, 0), "num_heads": 3},
            ["num_heads=3 is not a multiple of num_kv_heads=2"],
            id="gqa-ratio",
        ),
        # --- features
        pytest.param(
            {2},
            {"capability": (8, 0), "features": frozenset({AttentionFeature.ATTENTION_SINKS})},
            [
                "feature attention_sinks not supported by flash-attn 2 (supported: alibi, "
                "logits_soft_cap)"
            ],
            id="fa2-sinks",
        ),
        pytest.param(
            {4},
            {
                "capability": (10, 0),
                "spec": full_spec(block_size=16),
                "features": frozenset({AttentionFeature.ALIBI, AttentionFeature.LOGITS_SOFT_CAP}),
            },
            [
                "feature alibi not supported by flash-attn 4 (supported: attention_sinks, "
                "logits_soft_cap)"
            ],
            id="fa4-alibi",
        ),
        pytest.param(
            {2},
            {
                "capability": (8, 0),
                "spec": EncoderOnlyAttentionSpec(
                    block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
                ),
                "features": frozenset({AttentionFeature.ALIBI}),
            },
            [
                "feature alibi not supported by flash-attn 2 for kind=encoder_only_attention "
                "(its bias -slope*|i-j| differs from attnkit's slope*(j-i) when keys follow "
                "the query)"
            ],
            id="fa2-alibi-bidirectional",
        ),
        pytest.param(
            {2},
            {"capability": (8, 0), "features": frozenset({AttentionFeature.RETURN_LSE})},
            [
                "feature return_lse not supported (supported: alibi, attention_sinks, "
                "logits_soft_cap)"
            ],
            id="return-lse",
        ),
        # --- kinds
        pytest.param(
            {2, 4},
            {
                "capability": (10, 0),
                "spec": ChunkedLocalAttentionSpec(
                    block_size=256,
                    num_kv_heads=2,
                    head_size=64,
                    dtype=torch.float16,
                    attention_chunk_size=512,
                ),
            },
            [
                "kind=chunked_local_attention not supported (supported: cross_attention, "
                "encoder_only_attention, full_attention, sliding_window)"
            ],
            id="chunked-local",
        ),
        # --- device
        pytest.param(
            {2},
            {"device": CPU, "capability": None},
            ["device=cpu not supported (supported: cuda)"],
            id="cpu",
        ),
    ],
)
def test_exact_reasons(
    simulate: Callable[..., None],
    installed: set[int] | dict[int, str],
    kwargs: dict[str, Any],
    expected: list[str],
) -> None:
    simulate(installed=installed)
    spec = kwargs.pop("spec", full_spec())
    assert reasons(spec, **kwargs) == expected


def test_no_cuda_device_simulated(simulate: Callable[..., None]) -> None:
    simulate(installed={2}, cuda=False)
    assert reasons(full_spec(), capability=(8, 0)) == [NO_CUDA]


def registry_with_flash_attn() -> BackendRegistry:
    return BackendRegistry(
        builtins={
            **BUILTIN_BACKENDS,
            "flash_attn": "attnkit.backends.flash_attn:FlashAttentionBackend",
        },
        discover_plugins=False,
    )


@pytest.mark.parametrize(
    ("spec", "capability", "expected"),
    [
        pytest.param(
            ChunkedLocalAttentionSpec(
                block_size=256,
                num_kv_heads=2,
                head_size=64,
                dtype=torch.float16,
                attention_chunk_size=512,
            ),
            (10, 0),
            (
                "kind=chunked_local_attention not supported (supported: cross_attention, "
                "encoder_only_attention, full_attention, sliding_window)",
            ),
            id="chunked-local",
        ),
        pytest.param(
            SinkFullAttentionSpec(
                block_size=256, num_kv_heads=2, head_size=64, dtype=torch.float16, sink_len=4
            ),
            (10, 0),
            (
                "kind=sink_full_attention not supported (supported: cross_attention, "
                "encoder_only_attention, full_attention, sliding_window)",
            ),
            id="sink-tokens",
        ),
        pytest.param(
            full_spec(block_size=16),
            (8, 0),
            (
                "block_size=16 not supported by flash-attn 2 (its paged KV cache needs a "
                "multiple of 256)",
            ),
            id="fa2-block-size",
        ),
    ],
)
def test_routing_through_backend_per_kind(
    simulate: Callable[..., None],
    spec: AttentionSpec,
    capability: tuple[int, int],
    expected: tuple[str, ...],
) -> None:
    simulate(installed={2})
    registry = registry_with_flash_attn()
    cfg = AttentionConfig.model_validate(
        {"backend_per_kind": {spec.kind.value: "flash_attn"}}, context={"registry": registry}
    )
    with pytest.raises(BackendNotSupportedError, match="flash_attn") as info:
        select_backend(spec, cfg, device="cuda", capability=capability, registry=registry)
    assert info.value.rejected[-1].backend == "flash_attn"
    assert info.value.rejected[-1].reasons == expected


@pytest.mark.skipif(
    bool(REALLY_INSTALLED) or torch.cuda.is_available(), reason="flash-attn or CUDA present"
)
def test_routing_here_names_what_is_missing() -> None:
    registry = registry_with_flash_attn()
    cfg = AttentionConfig.model_validate(
        {"backend_per_kind": {"full_attention": "flash_attn"}}, context={"registry": registry}
    )
    with pytest.raises(BackendNotSupportedError) as info:
        select_backend(full_spec(), cfg, device="cuda", capability=(9, 0), registry=registry)
    assert info.value.rejected[-1].reasons == (NOT_INSTALLED, NO_CUDA)


def test_routing_selects_flash_attn_when_it_can(simulate: Callable[..., None]) -> None:
    simulate(installed={2, 4})
    registry = registry_with_flash_attn()
    cfg = AttentionConfig.model_validate(
        {"backend_per_kind": {"sliding_window": "flash_attn"}}, context={"registry": registry}
    )
    spec = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16, sliding_window=512
    )
    selection = select_backend(spec, cfg, device="cuda", capability=(10, 0), registry=registry)
    assert selection.backend is FlashAttentionBackend
    # Priority order on cuda lists flash_attn first.
    selection = select_backend(spec, config(), device="cuda", capability=(10, 0), registry=registry)
    assert selection.backend is FlashAttentionBackend
    assert selection.source == "priority"


# ----------------------------------------------------------------------------------
# A pure-torch model of the documented flash_attn_varlen_func contract
# ----------------------------------------------------------------------------------


class ContractViolation(AssertionError):
    """An argument does not mean what flash-attn documents, or breaks one of its checks."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise ContractViolation(message)


def check_index_tensor(
    name: str, t: object, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    expect(isinstance(t, torch.Tensor), f"{name} must be a tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    expect(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    expect(tuple(t.shape) == shape, f"{name} must have shape {shape}, got {tuple(t.shape)}")
    expect(t.stride(-1) == 1, f"{name} must be contiguous in its last dimension")
    expect(t.device == device, f"{name} must be on {device}, got {t.device}")
    return t


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    left: int | None,
    right: int | None,
    softcap: float,
    alibi: torch.Tensor | None,
    sink: torch.Tensor | None,
) -> torch.Tensor:
    """One sequence, as both versions document it: bottom-right aligned causal mask and
    window (query ``i`` of ``Lq`` sits at ``i + Lk - Lq``), ``window_size=(left, right)``
    bounds ``[i' - left, i' + right]`` (``None``: unbounded), ``softcap`` caps the scaled
    scores, ALiBi adds ``-slope * |i' - j|``, a sink logit joins the denominator. Keys a
    row may not see do not contribute; a row that sees nothing is 0."""
    lq, hq, _ = q.shape
    lk, hkv, _ = keys.shape
    group = hq // hkv
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    visible = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        visible &= j <= i
    if left is not None:
        visible &= j >= i - left
    if right is not None:
        visible &= j <= i + right
    seen = visible.any(dim=0)[:, None, None]
    k = keys.float().masked_fill(~seen, 0.0).repeat_interleave(group, dim=1)
    v = values.float().masked_fill(~seen, 0.0).repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        s = s - alibi.float()[:, None, None] * (i - j).abs().float()[None]
    s = s.masked_fill(~visible[None], float("-inf"))
    extra = (
        sink.float()[:, None, None].expand(hq, lq, 1)
        if sink is not None
        else torch.full((hq, lq, 1), float("-inf"))
    )
    logits = torch.cat([s, extra], dim=-1)
    peak = logits.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    w = torch.exp(logits - peak)
    denom = w.sum(dim=-1, keepdim=True)
    out = torch.einsum("hqk,khd->hqd", w[..., :lk], v)
    out = torch.where(denom == 0, torch.zeros_like(out), out / denom)
    return out.permute(1, 0, 2).to(q.dtype)


def common_checks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    expect(q.dtype in (torch.float16, torch.bfloat16), f"q must be fp16/bf16, got {q.dtype}")
    expect(k.dtype == q.dtype and v.dtype == q.dtype, "q, k, v must share a dtype")
    for name, t in (("q", q), ("k", k), ("v", v)):
        expect(t.stride(-1) == 1, f"{name} must be contiguous in its last dimension")
    expect(q.dim() == 3, f"q must be (total_q, nheads, headdim), got {tuple(q.shape)}")
    expect(q.shape[-1] <= 256 and q.shape[-1] % 8 == 0, f"headdim {q.shape[-1]} unsupported")
    expect(q.shape[1] % k.shape[-2] == 0, "nheads must be a multiple of nheads_k")


def check_max(name: str, value: object, lengths: list[int]) -> int:
    # The kernels size their grids (and flash-attn 2 its window clamp) from these.
    expect(type(value) is int, f"{name} must be a Python int, got {type(value).__name__}")
    assert isinstance(value, int)
    expect(value >= max(lengths, default=0), f"{name}={value} < longest {max(lengths)}")
    return value


def paged_rows(
    cache: torch.Tensor, table_row: torch.Tensor, length: int, *, whole_pages: bool = False
) -> torch.Tensor:
    """The first ``length`` key rows of one sequence. ``whole_pages``: read every row of
    every page those keys touch, as flash-attn 4's TMA page loads do (b36
    ``flash_attn_varlen_func`` docstring, ``page_table``), and require them all finite:
    a masked score still multiplies its V row, and ``0 * NaN`` is NaN."""
    page = cache.shape[1]
    needed = -(-length // page)
    expect(needed <= table_row.shape[0], f"block table row too short for {length} keys")
    pages = table_row[:needed].long()
    rows = cache[pages].reshape(needed * page, *cache.shape[2:])
    if whole_pages:
        non_finite = (~torch.isfinite(rows.float())).flatten(1).any(dim=1)
        bad = [int(i) for i in non_finite.nonzero().flatten()]
        expect(
            not bad,
            f"rows {bad} of the pages read (sequence of {length} keys, page size {page}) "
            f"are not finite: flash-attn 4 loads whole pages, rows past seqused_k included",
        )
    return rows[:length]


def fa4_beta(release: str | None) -> int:
    """The beta number of a flash-attn 4 release ``4.0.0bN`` (a final release counts as
    after every beta; unknown as before all)."""
    if release is None:
        return -1
    match = re.fullmatch(r"4\.0\.0b(\d+)", release)
    return int(match.group(1)) if match else 10**6


class Contract:
    """Records every call; ``fa2`` / ``fa4`` are the models for each version.

    ``release``: the flash-attn release modelled, for the rules that differ between
    releases (flash-attn 4's ``learnable_sink`` dtypes); ``run_case`` also presents it
    as installed. ``None``: not installed, the backend applies the oldest rules.
    """

    def __init__(self, release: str | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.release = release

    def fa2(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: torch.Tensor | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """flash-attn 2 ``flash_attn_varlen_func`` (flash_attn_interface.py)."""
        self.calls.append({"version": 2, **{n: x for n, x in locals().items() if n != "self"}})
        common_checks(q, k, v)
        expect(dropout_p == 0.0 and not return_attn_probs, "inference calls only")
        b = cu_seqlens_q.shape[0] - 1
        expect(b > 0, "batch size must be positive")
        check_index_tensor("cu_seqlens_q", cu_seqlens_q, (b + 1,), q.device)
        check_index_tensor("cu_seqlens_k", cu_seqlens_k, (b + 1,), q.device)
        qsl, ksl = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        q_lens = [qsl[r + 1] - qsl[r] for r in range(b)]
        k_lens = [ksl[r + 1] - ksl[r] for r in range(b)]
        check_max("max_seqlen_q", max_seqlen_q, q_lens)
        check_max("max_seqlen_k", max_seqlen_k, k_lens)
        if block_table is not None:
            expect(k.dim() == 4 and k.shape == v.shape, "paged k/v are (blocks, page, nheads_k, d)")
            expect(
                k.shape[1] % 256 == 0, f"paged KV block size {k.shape[1]} is not a multiple of 256"
            )
            check_index_tensor("block_table", block_table, (b, block_table.shape[1]), q.device)
        else:
            expect(k.dim() == 3 and k.shape == v.shape, "k/v are (total_k, nheads_k, d)")
        left, right = window_size
        expect(all(type(x) is int and x >= -1 for x in window_size), f"window_size {window_size}")
        if alibi_slopes is not None:
            expect(alibi_slopes.dtype == torch.float32, "alibi_slopes must be fp32")
            expect(tuple(alibi_slopes.shape) == (q.shape[1],), "alibi_slopes must be (nheads,)")
        # mha_varlen_fwd (2.8.3 flash_api.cpp 585-598): causal is dropped when
        # max_seqlen_q == 1 (no ALiBi), then with GQA, no window and no ALiBi q is
        # reshaped to (batch, nheads_k, ngroups, d) and cu_seqlens_q is ignored.
        still_causal = causal and not (max_seqlen_q == 1 and alibi_slopes is None)
        swapped = (
            max_seqlen_q == 1
            and q.shape[1] > k.shape[-2]
            and left < 0
            and (0 if still_causal else right) < 0
            and alibi_slopes is None
        )
        if swapped:
            expect(
                q.shape[0] == b,
                f"GQA decode path (max_seqlen_q == 1) reshapes q of {q.shape[0]} rows to "
                f"(batch={b}, nheads_k, ngroups, d): every request needs exactly one query",
            )
        expect(isinstance(softcap, float), "softcap is a float, 0.0 = off")
        out = torch.full_like(q, NAN)
        for r in range(b):
            if block_table is not None:
                keys = paged_rows(k, block_table[r], k_lens[r])
                values = paged_rows(v, block_table[r], k_lens[r])
            else:
                keys, values = k[ksl[r] : ksl[r + 1]], v[ksl[r] : ksl[r + 1]]
            out[qsl[r] : qsl[r + 1]] = attend(
                q[qsl[r] : qsl[r + 1]],
                keys,
                values,
                scale=softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5,
                causal=causal,
                left=None if left < 0 else left,
                right=0 if causal else (None if right < 0 else right),
                softcap=softcap,
                alibi=alibi_slopes,
                sink=None,
            )
        return out

    def fa4(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
        seqused_q: torch.Tensor | None = None,
        seqused_k: torch.Tensor | None = None,
        page_table: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int | None, int | None] = (None, None),
        learnable_sink: torch.Tensor | None = None,
        softcap: float = 0.0,
        num_splits: int = 1,
        pack_gqa: bool | None = None,
        deterministic: bool = False,
        return_lse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """flash-attn 4 ``flash_attn_varlen_func`` (cute/interface.py)."""
        self.calls.append({"version": 4, **{n: x for n, x in locals().items() if n != "self"}})
        common_checks(q, k, v)
        expect(cu_seqlens_q is not None, "varlen queries need cu_seqlens_q")
        assert cu_seqlens_q is not None
        b = cu_seqlens_q.shape[0] - 1
        check_index_tensor("cu_seqlens_q", cu_seqlens_q, (b + 1,), q.device)
        qsl = cu_seqlens_q.tolist()
        q_lens = [qsl[r + 1] - qsl[r] for r in range(b)]
        if max_seqlen_q is not None:
            check_max("max_seqlen_q", max_seqlen_q, q_lens)
        expect(seqused_q is None, "attnkit never passes seqused_q")
        if page_table is not None:
            expect(cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k")
            expect(k.dim() == 4 and k.shape == v.shape, "paged k/v are (pages, page_size, h, d)")
            check_index_tensor("page_table", page_table, (b, page_table.shape[1]), q.device)
            if seqused_k is not None:
                k_lens = check_index_tensor("seqused_k", seqused_k, (b,), q.device).tolist()
            else:  # without seqused_k every page of the table is a key
                k_lens = [page_table.shape[1] * k.shape[1]] * b
        else:
            expect(cu_seqlens_k is not None, "varlen keys need cu_seqlens_k")
            assert cu_seqlens_k is not None
            ksl = check_index_tensor("cu_seqlens_k", cu_seqlens_k, (b + 1,), q.device).tolist()
            k_lens = [ksl[r + 1] - ksl[r] for r in range(b)]
            if seqused_k is not None:
                k_lens = check_index_tensor("seqused_k", seqused_k, (b,), q.device).tolist()
        if max_seqlen_k is not None:
            check_max("max_seqlen_k", max_seqlen_k, k_lens)
        if learnable_sink is not None:
            # bfloat16 only before 4.0.0b30; float16/bfloat16/float32 from b30 (b30, b36).
            accepted = (
                (torch.float16, torch.bfloat16, torch.float32)
                if fa4_beta(self.release) >= 30
                else (torch.bfloat16,)
            )
            expect(
                learnable_sink.dtype in accepted,
                f"learnable_sink must be one of {accepted} in {self.release}",
            )
            expect(tuple(learnable_sink.shape) == (q.shape[1],), "learnable_sink must be (nheads,)")
        expect(num_splits == 1 and not return_lse, "defaults only")
        left, right = window_size
        for x in window_size:
            expect(x is None or (type(x) is int and x >= 0), f"window_size {window_size}")
        out = torch.full_like(q, NAN)
        for r in range(b):
            if page_table is not None:
                keys = paged_rows(k, page_table[r], k_lens[r], whole_pages=True)
                values = paged_rows(v, page_table[r], k_lens[r], whole_pages=True)
            else:
                assert cu_seqlens_k is not None
                start = int(cu_seqlens_k[r])
                keys, values = k[start : start + k_lens[r]], v[start : start + k_lens[r]]
            out[qsl[r] : qsl[r + 1]] = attend(
                q[qsl[r] : qsl[r + 1]],
                keys,
                values,
                scale=softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5,
                causal=causal,
                left=left,
                right=0 if causal else right,
                softcap=softcap,
                alibi=None,
                sink=learnable_sink,
            )
        return out, None

    def funcs(self) -> dict[int, Callable[..., Any]]:
        return {2: self.fa2, 4: self.fa4}


# ----------------------------------------------------------------------------------
# Ragged multi-step batches through flash_attn and through the reference backend
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    kind: KVCacheSpecKind
    steps: tuple[tuple[int, ...], ...]
    block_size: int
    window: int | None = None
    encoder_lens: tuple[int, ...] = ()
    softcap: float | None = None
    alibi: bool = False
    sinks: bool = False
    dtype: torch.dtype = torch.float16
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    pad: int = 2
    idle: bool = False
    """Keep started requests with no new token in the batch (zero-length query rows)."""


TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
"""Output vs the reference backend: both accumulate in float32 and round once."""
GPU_TOL = {torch.float16: (4e-3, 4e-3), torch.bfloat16: (2.5e-2, 2.5e-2)}
"""The kernels round the softmax weights to the dtype before P.V."""


def make_spec(case: Case) -> AttentionSpec:
    common: dict[str, Any] = {
        "block_size": case.block_size,
        "num_kv_heads": case.num_kv_heads,
        "head_size": case.head_size,
        "dtype": case.dtype,
    }
    if case.kind is F.SLIDING_WINDOW:
        assert case.window is not None
        return SlidingWindowSpec(**common, sliding_window=case.window)
    spec_cls = {
        F.FULL_ATTENTION: FullAttentionSpec,
        F.ENCODER_ONLY_ATTENTION: EncoderOnlyAttentionSpec,
        F.CROSS_ATTENTION: CrossAttentionSpec,
    }[case.kind]
    return spec_cls(**common)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def assert_same_cache(got: torch.Tensor, want: torch.Tensor, step: int) -> None:
    """Bit for bit where the reference wrote; where it did not (the NaN fill), flash_attn
    may have zeroed the row (flash-attn 4 zeroes each last page's tail) or left it."""
    got, want = got.cpu(), want.cpu()
    unwritten = torch.isnan(want)
    assert torch.equal(bits(got)[~unwritten], bits(want)[~unwritten]), f"step {step}: caches differ"
    left = got[unwritten]
    assert bool((torch.isnan(left) | (left == 0)).all()), f"step {step}: unwritten rows changed"


def run_case(
    case: Case,
    version: int,
    *,
    device: torch.device = CPU,
    contract: Contract | None = None,
    seed: int = 0,
) -> list[FlashAttentionMetadata]:
    """Every step through flash_attn (the contract model, or the real kernel when
    ``contract`` is None) and through the reference backend, on copies of one cache.
    Outputs must agree within ``TOL``, caches bit for bit. Returns the metadata built."""
    if contract is not None:  # the modelled release is the installed one
        installed = {version: contract.release} if contract.release is not None else {}
        with mock.patch.object(_versions, "installed_releases", return_value=installed):
            return _run_case(case, version, device=device, contract=contract, seed=seed)
    return _run_case(case, version, device=device, contract=contract, seed=seed)


def _run_case(
    case: Case,
    version: int,
    *,
    device: torch.device,
    contract: Contract | None,
    seed: int,
) -> list[FlashAttentionMetadata]:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    spec = make_spec(case)
    heads, kv_heads, d = case.num_heads, case.num_kv_heads, case.head_size
    sinks = randn(gen, heads, dtype=torch.bfloat16).float() if case.sinks else None
    params = AttentionLayerParams(
        num_heads=heads,
        logits_soft_cap=case.softcap,
        alibi_slopes=tuple(2.0 ** -(h + 1) for h in range(heads)) if case.alibi else None,
        sinks=sinks,
    )
    binding = FlashAttentionBackend.get_binding(spec)
    builder = binding.create(spec, ["layers.0"], config(version), device)
    assert isinstance(builder, FlashAttentionMetadataBuilder)
    assert builder.version == version
    impl = (
        FlashAttentionImpl(spec, params, varlen_funcs=contract.funcs())
        if contract is not None
        else binding.create_impl(spec, params)
    )
    ref_binding = ReferenceBackend.get_binding(spec)
    ref_builder = ref_binding.create(spec, ["layers.0"], config(), device)
    ref_impl = ref_binding.create_impl(spec, params)

    num_reqs = len(case.steps[0])
    lengths = [sum(step[r] for step in case.steps) for r in range(num_reqs)]
    q_all = [randn(gen, n, heads, d, dtype=case.dtype) for n in lengths]
    k_all = [randn(gen, n, kv_heads, d, dtype=case.dtype) for n in lengths]
    v_all = [randn(gen, n, kv_heads, d, dtype=case.dtype) for n in lengths]
    enc = case.encoder_lens or (0,) * num_reqs
    enc_k = [randn(gen, e, kv_heads, d, dtype=case.dtype) for e in enc]
    enc_v = [randn(gen, e, kv_heads, d, dtype=case.dtype) for e in enc]
    bs = case.block_size
    encoder_only = case.kind is F.ENCODER_ONLY_ATTENTION
    cached = list(enc) if case.encoder_lens else lengths
    num_blocks = sum(-(-n // bs) for n in cached) + 3
    pool = list(range(1, num_blocks))  # block 0 is the null block
    rng.shuffle(pool)
    caches: list[torch.Tensor] = []
    if not encoder_only:
        (shape,) = FlashAttentionBackend.get_kv_cache_shapes(num_blocks, spec)
        cache = torch.full(shape, NAN, dtype=case.dtype)
        cache[0] = 0  # the null block reads as zeros
        caches = [cache.to(device)]
    ref_caches = [c.clone() for c in caches]
    tables: list[list[int]] = [[] for _ in range(num_reqs)]
    done = [0] * num_reqs
    built: list[FlashAttentionMetadata] = []

    def grow(r: int, tokens: int) -> None:
        while len(tables[r]) * bs < tokens:
            tables[r].append(pool.pop())

    def slot(r: int, p: int) -> int:
        return tables[r][p // bs] * bs + p % bs

    for s, step in enumerate(case.steps):
        batch = [r for r in range(num_reqs) if step[r] > 0 or (case.idle and done[r] > 0)]
        if s % 2:
            batch.reverse()
        q_rows, k_rows, v_rows, slots, seq_lens = [], [], [], [], []
        enc_k_rows, enc_v_rows, enc_slots = [], [], []
        for r in batch:
            n, start = step[r], done[r]
            q_rows.append(q_all[r][start : start + n])
            k_rows.append(k_all[r][start : start + n])
            v_rows.append(v_all[r][start : start + n])
            if encoder_only:
                seq_lens.append(n)
                slots.extend([-1] * n)
            elif case.kind is F.CROSS_ATTENTION:
                seq_lens.append(enc[r])
                slots.extend([-1] * n)
                if start == 0:
                    grow(r, enc[r])
                    enc_k_rows.append(enc_k[r])
                    enc_v_rows.append(enc_v[r])
                    enc_slots.extend(slot(r, p) for p in range(enc[r]))
            else:
                grow(r, start + n)
                seq_lens.append(start + n)
                slots.extend(slot(r, start + t) for t in range(n))
        tokens = sum(step[r] for r in batch)
        query = torch.cat([*q_rows, randn(gen, case.pad, heads, d, dtype=case.dtype)])
        key: torch.Tensor | None
        value: torch.Tensor | None
        if case.kind is F.CROSS_ATTENTION:
            key = torch.cat(enc_k_rows) if enc_k_rows else None
            value = torch.cat(enc_v_rows) if enc_v_rows else None
            width = max(tokens + case.pad, len(enc_slots))
            slot_mapping = enc_slots + [-1] * (width - len(enc_slots))
        else:
            pad = randn(gen, case.pad, kv_heads, d, dtype=case.dtype)
            key, value = torch.cat([*k_rows, pad]), torch.cat([*v_rows, pad])
            slot_mapping = slots + [-1] * case.pad
        cm = CommonAttentionMetadata.from_lists(
            query_lens=[step[r] for r in batch],
            seq_lens=seq_lens,
            block_table=[[] if encoder_only else list(tables[r]) for r in batch],
            slot_mapping=slot_mapping,
            device=device,
            causal=case.kind not in (F.ENCODER_ONLY_ATTENTION, F.CROSS_ATTENTION),
        )
        md = builder.build(0, cm)
        built.append(md)
        query = query.to(device)
        key = key.to(device) if key is not None else None
        value = value.to(device) if value is not None else None
        output = torch.full_like(query, NAN)
        ref_output = torch.full_like(query, NAN)
        assert impl.forward(query, key, value, caches, md, output) is output
        ref_impl.forward(query, key, value, ref_caches, ref_builder.build(0, cm), ref_output)
        atol, rtol = (TOL if contract is not None else GPU_TOL)[case.dtype]
        torch.testing.assert_close(
            output[:tokens].cpu(),
            ref_output[:tokens].cpu(),
            atol=atol,
            rtol=rtol,
            msg=lambda m, s=s: f"step {s}: {m}",
        )
        for got, want in zip(caches, ref_caches, strict=True):
            assert_same_cache(got, want, s)
        for r in batch:
            done[r] += step[r]
            if case.window is not None:  # blocks no later query sees go back to the pool
                first_live = done[r] - case.window + 1
                for i, block in enumerate(tables[r]):
                    if block and (i + 1) * bs <= first_live:
                        pool.append(block)
                        tables[r][i] = 0
    return built


# Ragged schedules: steps[s][r] = new tokens of request r at step s (0: not scheduled).
# flash-attn 2 needs 256-token blocks, so its requests run past 256 tokens.
FA2_CASES = [
    pytest.param(Case(F.FULL_ATTENTION, ((5, 300, 0), (1, 1, 270), (1, 40, 1)), 256), id="full"),
    pytest.param(
        Case(F.FULL_ATTENTION, ((260, 3), (1, 2)), 256, softcap=3.0, alibi=True, num_kv_heads=1),
        id="full-softcap-alibi-mqa",
    ),
    pytest.param(
        Case(
            F.SLIDING_WINDOW,
            ((300, 7, 0), (1, 260, 2), (2, 1, 300)),
            256,
            window=100,
            dtype=torch.bfloat16,
        ),
        id="sliding-window-bf16",
    ),
    pytest.param(
        Case(F.CROSS_ATTENTION, ((4, 3), (1, 1), (2, 0)), 256, encoder_lens=(300, 40)),
        id="cross",
    ),
    pytest.param(
        Case(F.ENCODER_ONLY_ATTENTION, ((5, 1, 0), (0, 0, 9)), 256, softcap=2.0),
        id="encoder-only-softcap",
    ),
    # Decode steps (longest query 1) with a started request that has no new token: the
    # GQA decode path of flash-attn 2 would need one query per request.
    pytest.param(
        Case(F.FULL_ATTENTION, ((300, 5, 7), (1, 0, 1), (0, 1, 1)), 256, idle=True),
        id="decode-idle-rows-gqa",
    ),
    # Speculative verify steps: every request 1 + k queries (k = 4, then 7), uniform.
    pytest.param(
        Case(F.FULL_ATTENTION, ((300, 20, 7), (5, 5, 5), (8, 8, 8)), 256), id="verify-uniform"
    ),
    pytest.param(
        Case(F.SLIDING_WINDOW, ((290, 9, 40), (5, 5, 5), (8, 8, 8)), 256, window=30),
        id="verify-uniform-window",
    ),
]
FA4_CASES = [
    pytest.param(Case(F.FULL_ATTENTION, ((5, 40, 0), (1, 1, 33), (1, 7, 1)), 16), id="full"),
    pytest.param(
        Case(F.FULL_ATTENTION, ((130, 3), (1, 2)), 128, dtype=torch.bfloat16), id="full-page-128"
    ),
    pytest.param(
        Case(
            F.SLIDING_WINDOW,
            ((20, 3, 0), (1, 17, 5), (2, 1, 30)),
            16,
            window=10,
            softcap=4.0,
            sinks=True,
        ),
        id="sliding-window-softcap-sinks",
    ),
    pytest.param(
        Case(F.CROSS_ATTENTION, ((4, 3), (1, 1), (2, 0)), 16, encoder_lens=(30, 7), sinks=True),
        id="cross-sinks",
    ),
    pytest.param(
        Case(F.ENCODER_ONLY_ATTENTION, ((5, 1, 0), (0, 0, 9)), 16, sinks=True, num_kv_heads=1),
        id="encoder-only-sinks-mqa",
    ),
    pytest.param(
        Case(F.FULL_ATTENTION, ((20, 5, 7), (1, 0, 1), (0, 1, 1)), 16, idle=True),
        id="decode-idle-rows",
    ),
    pytest.param(
        Case(F.FULL_ATTENTION, ((40, 20, 7), (5, 5, 5), (8, 8, 8)), 16), id="verify-uniform"
    ),
]


def case_named(cases: list[Any], name: str) -> Case:
    (case,) = next(p.values for p in cases if p.id == name)
    assert isinstance(case, Case)
    return case


@pytest.mark.parametrize("case", FA2_CASES)
def test_fa2_contract_matches_reference(case: Case) -> None:
    contract = Contract(LATEST[2])
    run_case(case, 2, contract=contract)
    assert contract.calls
    assert all(c["version"] == 2 for c in contract.calls)


@pytest.mark.parametrize("case", FA4_CASES)
def test_fa4_contract_matches_reference(case: Case) -> None:
    contract = Contract(LATEST[4])
    run_case(case, 4, contract=contract)
    assert contract.calls
    assert all(c["version"] == 4 for c in contract.calls)


def test_fa4_model_catches_non_finite_page_tails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the impl's zeroing, the NaN-filled tail of a last page reaches the model."""
    from attnkit.backends.flash_attn import backend

    def no_zeroing(cache: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor) -> None:
        pass

    monkeypatch.setattr(backend, "_zero_page_tails", no_zeroing)
    with pytest.raises(ContractViolation, match="not finite: flash-attn 4 loads whole pages"):
        run_case(case_named(FA4_CASES, "full"), 4, contract=Contract(LATEST[4]))


def test_fa2_model_catches_gqa_decode_with_empty_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Passing the true max_seqlen_q=1 for a decode step with an idle request breaks
    flash-attn 2's GQA decode reshape; the builder passes 2 there."""
    from attnkit.backends.flash_attn import backend

    def true_max(cm: CommonAttentionMetadata) -> int:
        return cm.max_query_len

    case = case_named(FA2_CASES, "decode-idle-rows-gqa")
    monkeypatch.setattr(backend, "_fa2_max_seqlen_q", true_max)
    with pytest.raises(ContractViolation, match="GQA decode path"):
        run_case(case, 2, contract=Contract(LATEST[2]))


def test_fa2_max_seqlen_q_avoids_the_gqa_decode_reshape_only_when_needed() -> None:
    builders = {
        v: FlashAttentionMetadataBuilder(full_spec(), ["l"], config(v), CPU) for v in (2, 4)
    }
    idle = batch([1, 0, 1], [5, 3, 9], [[1], [2], [3]])
    assert builders[2].build(0, idle).max_seqlen_q == 2
    assert builders[4].build(0, idle).max_seqlen_q == 1
    assert builders[2].build(0, batch([1, 1], [5, 9], [[1], [2]])).max_seqlen_q == 1
    assert builders[2].build(0, batch([2, 0], [5, 9], [[1], [2]])).max_seqlen_q == 2
    assert builders[2].build(0, batch([3, 0], [5, 9], [[1], [2]])).max_seqlen_q == 3


def test_batch_invariant_flash_attn_2_never_takes_the_gqa_decode_path() -> None:
    """At batch_invariant every step gets max_seqlen_q >= 2, so a decode row runs the
    one varlen kernel (never the reshaped GQA decode path, flash-attn 2's only split-KV
    path) whether its step is all decodes or holds a prefill."""
    invariant = config(2).model_copy(update={"determinism": "batch_invariant"})
    builder = FlashAttentionMetadataBuilder(full_spec(), ["l"], invariant, CPU)
    decodes = batch([1, 1], [5, 9], [[1], [2]])
    mixed = batch([1, 6], [5, 9], [[1], [2]])
    assert builder.build(0, decodes).max_seqlen_q == 2
    assert builder.build(0, mixed).max_seqlen_q == 6
    assert builder.build(0, batch([1, 0, 1], [5, 3, 9], [[1], [2], [3]])).max_seqlen_q == 2
    # The arguments each call passes: the same kernel path for both steps' decode rows.
    assert FlashAttentionMetadataBuilder(full_spec(), ["l"], config(2), CPU).build(
        0, decodes
    ).max_seqlen_q == 1


def test_batch_invariance_is_refused_on_flash_attn_4_with_the_reason(
    simulate: Callable[..., None],
) -> None:
    simulate(installed={2, 4})
    registry = registry_with_flash_attn()
    spec = full_spec(block_size=16, dtype=torch.bfloat16)
    for version, chosen in ((2, True), (4, False)):
        cfg = AttentionConfig.model_validate(
            {
                "backend": "flash_attn",
                "backend_options": {"flash_attn": {"version": version}},
                "determinism": "batch_invariant",
            },
            context={"registry": registry},
        )
        if chosen:
            block = full_spec(block_size=256, dtype=torch.bfloat16)
            selection = select_backend(
                block, cfg, device="cuda", capability=(9, 0), registry=registry
            )
            assert selection.backend is FlashAttentionBackend
            continue
        with pytest.raises(BackendNotSupportedError, match="kept with flash-attn 2 only"):
            select_backend(spec, cfg, device="cuda", capability=(10, 0), registry=registry)


def test_zero_page_tails_clears_only_the_unused_rows_of_last_pages() -> None:
    from attnkit.backends.flash_attn.backend import _zero_page_tails

    cache = torch.full((6, 2, 4, 1, 8), NAN, dtype=torch.float16)
    cache[0] = 0
    # Request 0: 6 keys on pages 3, 1 (rows 2, 3 of page 1 unused); request 1: 8 keys,
    # pages full; request 2: no keys, its table row stale (page 5 belongs to no one here).
    table = torch.tensor([[3, 1, 0], [2, 4, 0], [5, 5, 5]], dtype=torch.int32)
    seq_lens = torch.tensor([6, 8, 0], dtype=torch.int32)
    before = cache.clone()
    _zero_page_tails(cache, table, seq_lens)
    changed = (bits(cache) != bits(before)).flatten(3).any(dim=3)  # [page, plane, row]
    expected = torch.zeros_like(changed)
    expected[1, :, 2:] = True
    assert torch.equal(changed, expected)
    assert bool((cache[1, :, 2:] == 0).all())


@pytest.mark.parametrize(
    ("release", "dtype"),
    [("4.0.0b20", torch.bfloat16), ("4.0.0b30", torch.float32), (None, torch.bfloat16)],
)
def test_sinks_keep_float32_where_the_release_accepts_it(
    release: str | None, dtype: torch.dtype
) -> None:
    case = case_named(FA4_CASES, "cross-sinks")
    contract = Contract(release)
    run_case(case, 4, contract=contract)
    assert {c["learnable_sink"].dtype for c in contract.calls} == {dtype}


def test_calls_pass_the_metadata_fields_unchanged() -> None:
    """Field by field: each argument is the metadata's own object (no conversion)."""
    for version, case in ((2, FA2_CASES[0].values[0]), (4, FA4_CASES[2].values[0])):
        contract = Contract(LATEST[version])
        built = run_case(case, version, contract=contract)
        assert len(built) == len(contract.calls)
        for md, call in zip(built, contract.calls, strict=True):
            assert call["cu_seqlens_q"] is md.cu_seqlens_q
            assert call["cu_seqlens_k"] is md.cu_seqlens_k
            table = call["block_table"] if version == 2 else call["page_table"]
            assert table is md.block_table
            if version == 4:
                assert call["seqused_k"] is md.seqused_k
                assert call["learnable_sink"].dtype == torch.float32  # b36 takes fp32 sinks
                assert md.release == LATEST[4]
            assert call["max_seqlen_q"] == md.max_seqlen_q
            assert call["max_seqlen_k"] == md.max_seqlen_k
            assert call["window_size"] == md.window_size
            assert call["causal"] is md.causal
            assert call["softmax_scale"] == case.head_size**-0.5


# ----------------------------------------------------------------------------------
# Builder: metadata fields, buffers, CUDA-graph capture
# ----------------------------------------------------------------------------------


def batch(
    query_lens: list[int], seq_lens: list[int], table: list[list[int]], *, causal: bool = True
) -> CommonAttentionMetadata:
    slots = list(range(16, 16 + sum(query_lens)))
    return CommonAttentionMetadata.from_lists(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=slots,
        causal=causal,
    )


@pytest.mark.parametrize("version", [2, 4])
def test_metadata_fields(version: int) -> None:
    block_size = 256 if version == 2 else 16
    spec = SlidingWindowSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=8
    )
    builder = FlashAttentionMetadataBuilder(spec, ["l"], config(version), CPU)
    cm = batch([3, 1], [3, 9], [[1], [2, 3]])
    md = builder.build(0, cm)
    assert md.version == version
    assert (md.num_reqs, md.num_actual_tokens) == (2, 4)
    assert md.cu_seqlens_q.dtype == torch.int32
    assert md.cu_seqlens_q.tolist() == [0, 3, 4]
    assert md.slot_mapping.tolist() == cm.slot_mapping.tolist()
    assert md.block_table is not None
    assert md.block_table.dtype == torch.int32
    assert md.block_table.shape == (2, builder.max_blocks)
    assert md.block_table[:, :2].tolist() == [[1, 0], [2, 3]]
    assert type(md.max_seqlen_q) is int
    assert md.max_seqlen_q == 3
    assert type(md.max_seqlen_k) is int
    assert md.max_seqlen_k == 9
    assert md.causal is True
    assert md.window_size == (7, 0)
    if version == 2:
        assert md.seqused_k is None
        assert md.cu_seqlens_k is not None
        assert md.cu_seqlens_k.dtype == torch.int32
        assert md.cu_seqlens_k.tolist() == [0, 3, 12]
    else:
        assert md.cu_seqlens_k is None
        assert md.seqused_k is not None
        assert md.seqused_k.dtype == torch.int32
        assert md.seqused_k.tolist() == [3, 9]
    # Fixed addresses: the next step lands in the same buffers.
    again = builder.build(0, batch([1, 1, 2], [4, 10, 2], [[1], [2, 3], [4]]))
    for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table", "slot_mapping"):
        old, new = getattr(md, name), getattr(again, name)
        assert (old is None) == (new is None)
        if old is not None:
            assert old.data_ptr() == new.data_ptr(), name


@pytest.mark.parametrize(
    ("version", "kind", "window"),
    [(2, F.FULL_ATTENTION, (-1, -1)), (4, F.FULL_ATTENTION, (None, None))],
)
def test_full_attention_window_is_unbounded(
    version: int, kind: KVCacheSpecKind, window: tuple[int | None, int | None]
) -> None:
    builder = FlashAttentionMetadataBuilder(full_spec(), ["l"], config(version), CPU)
    assert builder.build(0, batch([2], [5], [[1]])).window_size == window


def test_encoder_only_and_cross_metadata() -> None:
    spec = EncoderOnlyAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
    )
    builder = FlashAttentionMetadataBuilder(spec, ["l"], config(4), CPU)
    md = builder.build(0, batch([3, 2], [3, 2], [[], []], causal=False))
    assert md.causal is False
    assert md.cu_seqlens_k is md.cu_seqlens_q
    assert md.block_table is None
    assert md.seqused_k is None
    assert md.max_seqlen_k == 3
    with pytest.raises(ValueError, match="seq_lens must equal the query lengths"):
        builder.build(0, batch([3, 2], [4, 2], [[], []], causal=False))
    with pytest.raises(ValueError, match="causal must be False"):
        builder.build(0, batch([3], [3], [[]]))

    cross = CrossAttentionSpec(block_size=256, num_kv_heads=2, head_size=64, dtype=torch.float16)
    md = FlashAttentionMetadataBuilder(cross, ["l"], config(2), CPU).build(
        0, batch([2, 1], [7, 300], [[1], [2, 3]], causal=False)
    )
    assert md.causal is False
    assert md.window_size == (-1, -1)
    assert md.cu_seqlens_k is not None
    assert md.cu_seqlens_k.tolist() == [0, 7, 307]


def test_large_steps_use_the_batch_tensors() -> None:
    class Small(FlashAttentionMetadataBuilder):
        max_num_reqs = 1

    builder = Small(full_spec(block_size=16), ["l"], config(4), CPU)
    cm = batch([1, 1], [3, 4], [[1], [2]])
    md = builder.build(0, cm)
    assert md.cu_seqlens_q is cm.query_start_loc
    assert md.seqused_k is cm.seq_lens
    assert md.block_table is cm.block_table_tensor
    with pytest.raises(RuntimeError, match="exceeds the persistent buffers"):
        builder.build_for_cudagraph_capture(cm)


def test_cudagraph_support_and_capture() -> None:
    spec = full_spec()
    assert (
        FlashAttentionMetadataBuilder.get_cudagraph_support(config(), spec)
        is AttentionCGSupport.UNIFORM_BATCH
    )
    builder = FlashAttentionMetadataBuilder(spec, ["l"], config(2), CPU)
    md = builder.build_for_cudagraph_capture(batch([2, 2], [5, 9], [[1], [2]]))
    assert md.max_seqlen_q == 2
    assert md.max_seqlen_k == builder.max_model_len  # a replay may see any context length
    with pytest.raises(RuntimeError, match="UNIFORM_BATCH"):
        builder.build_for_cudagraph_capture(batch([1, 3], [5, 9], [[1], [2]]))


def test_uniform_verify_batches_capture_at_fixed_addresses() -> None:
    """Speculative verify steps (1 + 4 queries per request): two captures of one shape
    reuse the same buffers, holding the second batch's values."""
    builder = FlashAttentionMetadataBuilder(full_spec(), ["l"], config(2), CPU)
    first = builder.build_for_cudagraph_capture(batch([5, 5, 5], [9, 30, 77], [[1], [2], [3]]))
    addresses = {
        name: t.data_ptr() for name, t in vars(first).items() if isinstance(t, torch.Tensor)
    }
    second = builder.build_for_cudagraph_capture(batch([5, 5, 5], [12, 6, 41], [[4], [5], [6]]))
    assert second.max_seqlen_q == 5
    for name, ptr in addresses.items():
        assert getattr(second, name).data_ptr() == ptr, name
    assert second.cu_seqlens_q[:4].tolist() == [0, 5, 10, 15]
    assert second.block_table is not None
    assert second.block_table[:3, 0].tolist() == [4, 5, 6]


# ----------------------------------------------------------------------------------
# Impl: errors
# ----------------------------------------------------------------------------------


def test_impl_needs_cuda_without_a_stand_in() -> None:
    spec = full_spec()
    impl = FlashAttentionImpl(spec, AttentionLayerParams(num_heads=4))
    builder = FlashAttentionMetadataBuilder(spec, ["l"], config(2), CPU)
    md = builder.build(0, batch([1], [1], [[1]]))
    q = torch.zeros(1, 4, 64, dtype=torch.float16)
    kv = torch.zeros(1, 2, 64, dtype=torch.float16)
    cache = torch.zeros(2, 2, 256, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="flash-attn runs on CUDA tensors, got query on cpu"):
        impl.forward(q, kv, kv, [cache], md, torch.empty_like(q))


@pytest.mark.skipif(bool(REALLY_INSTALLED), reason="flash-attn is installed here")
@pytest.mark.parametrize(
    ("version", "pip"), [(2, "pip install 'attnkit[flash-attn]'"), (4, "pip install flash-attn-4")]
)
def test_missing_package_error_names_the_pip_command(version: int, pip: str) -> None:
    with pytest.raises(ImportError, match=re.escape(f"install it with: {pip}") + "$"):
        _import_varlen_func(version)  # type: ignore[arg-type]  # test input built loosely or wrong on purpose


@pytest.mark.parametrize(
    ("version", "params", "message"),
    [
        (2, AttentionLayerParams(num_heads=4, sinks=torch.zeros(4)), "attention_sinks"),
        (4, AttentionLayerParams(num_heads=4, alibi_slopes=(0.5,) * 4), "alibi"),
    ],
)
def test_impl_refuses_features_its_version_lacks(
    version: int, params: AttentionLayerParams, message: str
) -> None:
    spec = full_spec()
    impl = FlashAttentionImpl(spec, params, varlen_funcs=Contract().funcs())
    md = FlashAttentionMetadataBuilder(spec, ["l"], config(version), CPU).build(
        0, batch([1], [1], [[1]])
    )
    q = torch.zeros(1, 4, 64, dtype=torch.float16)
    kv = torch.zeros(1, 2, 64, dtype=torch.float16)
    cache = torch.zeros(2, 2, 256, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=f"needs {message}, which flash-attn {version}"):
        impl.forward(q, kv, kv, [cache], md, torch.empty_like(q))


def test_impl_rejects_bad_layers() -> None:
    spec = full_spec()
    binding = FlashAttentionBackend.get_binding(spec)
    with pytest.raises(
        TypeError,
        match="FlashAttentionImpl takes layer_params of type AttentionLayerParams, got NoneType",
    ):
        binding.create_impl(spec, None)
    with pytest.raises(ValueError, match="return_lse"):
        FlashAttentionImpl(spec, AttentionLayerParams(num_heads=4, return_lse=True))
    with pytest.raises(ValueError, match="v_head_size"):
        FlashAttentionImpl(spec, AttentionLayerParams(num_heads=4, v_head_size=32))
    sink_spec = SinkFullAttentionSpec(
        block_size=256, num_kv_heads=2, head_size=64, dtype=torch.float16, sink_len=2
    )
    # Binding is by exact kind: no binding serves sink_full_attention (nor MLA), and the
    # FullAttentionSpec binding, which matches them by isinstance, refuses them.
    mla_spec = MLAAttentionSpec(block_size=256, head_size=64, dtype=torch.float16)
    for other in (sink_spec, mla_spec):
        assert FlashAttentionBackend.find_binding(other) is None
        why = reasons(other)
        assert any(r.startswith(f"kind={other.kind.value} not supported") for r in why), why
        refused = f"got a {type(other).__name__} \\(kind={other.kind.value}\\)"
        with pytest.raises(TypeError, match=refused):
            binding.create_impl(other, AttentionLayerParams(num_heads=4))
        with pytest.raises(TypeError, match=refused):
            binding.create(other, ["l"], config(2), CPU)


# ----------------------------------------------------------------------------------
# GPU: the real kernels
# ----------------------------------------------------------------------------------


def gpu_skip_reason(version: int, case: Case) -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if version not in _versions.installed_versions():
        return f"flash-attn {version} is not installed"
    request = BackendRequest(
        spec=make_spec(case),
        device=CUDA,
        capability=torch.cuda.get_device_capability(),
        features=frozenset(
            f
            for f, on in (
                (AttentionFeature.LOGITS_SOFT_CAP, case.softcap is not None),
                (AttentionFeature.ALIBI, case.alibi),
                (AttentionFeature.ATTENTION_SINKS, case.sinks),
            )
            if on
        ),
        config=config(version),
    )
    found = FlashAttentionBackend.not_supported_reasons(request)
    return "; ".join(found) if found else None


def gpu_params() -> Iterator[Any]:
    for version, cases in ((2, FA2_CASES), (4, FA4_CASES)):
        for param in cases:
            (case,) = param.values
            yield pytest.param(version, case, id=f"fa{version}-{param.id}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not REALLY_INSTALLED, reason="flash-attn is not installed")
@pytest.mark.parametrize(("version", "case"), list(gpu_params()))
def test_real_kernel_matches_reference(version: int, case: Case) -> None:
    reason = gpu_skip_reason(version, case)
    if reason is not None:
        pytest.skip(reason)
    run_case(case, version, device=CUDA)
