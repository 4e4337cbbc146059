"""Backend selection: per-kind routing, global backend, priority lists, errors with reasons."""

from __future__ import annotations

import dataclasses
from importlib.metadata import EntryPoint
from typing import Any

import pytest
import torch
from typing_extensions import override

import attnkit
from attnkit import (
    ArgumentTypeError,
    AttentionConfig,
    AttentionFeature,
    AttnkitError,
    BackendNotSupportedError,
    BackendRegistry,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    IndexerSpec,
    InvalidArgumentError,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
    MLAAttentionSpec,
    NoBackendError,
    Rejection,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UnknownBackendError,
    errors,
    select_backend,
)
from attnkit.backend_api import (
    ENTRY_POINT_GROUP,
    AttentionBackend,
    BackendRequest,
    bind_builder,
    bind_each,
)
from attnkit.backends.flash_attn import FlashAttentionOptions
from attnkit.spec import ATTENTION_SPEC_CLASSES
from toy_backends import (
    FastCudaBackend,
    FullOnlyBackend,
    GenericToyBackend,
    NeedsMissingPackage,
    SlidingOnlyBackend,
    ToyAttentionBuilder,
    ToyImpl,
    ToyMambaBackend,
    ToyMambaBuilder,
    ToyMambaImpl,
)


class EveryKindBackend(AttentionBackend):
    """Serves every kind on CPU: lets tests address each kind through backend_per_kind."""

    name = "toy_every_kind"
    # The indexer's cache is fp8 by its format: a backend serving it reads fp8.
    supported_kv_cache_dtypes = frozenset({"auto", "fp8_e4m3"})
    supported_mamba_types = frozenset({"mamba2", "gdn", "linear", "short_conv", "mamba1"})
    supported_devices = frozenset({"cpu"})
    builders = (
        *bind_each(ATTENTION_SPEC_CLASSES, ToyAttentionBuilder, ToyImpl),
        bind_builder(MambaSpec, ToyMambaBuilder, ToyMambaImpl),
        bind_builder(IndexerSpec, ToyAttentionBuilder, ToyImpl),
    )


def registry(*backends: type[AttentionBackend], entry_points: list[EntryPoint] | None = None) -> BackendRegistry:
    reg = BackendRegistry(discover_plugins=entry_points is not None, entry_points=entry_points, allowlist=None)
    for backend in backends:
        reg.register(backend)
    return reg


def config(reg: BackendRegistry, **data: Any) -> AttentionConfig:
    return AttentionConfig.model_validate(data, context={"registry": reg})


FULL_ATTN = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
ATTN = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float16}
SPECS: dict[KVCacheSpecKind, KVCacheSpec] = {
    KVCacheSpecKind.FULL_ATTENTION: FULL_ATTN,
    KVCacheSpecKind.SLIDING_WINDOW: SlidingWindowSpec(sliding_window=32, **ATTN),  # type: ignore[arg-type]  # test input built loosely or wrong on purpose
    KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION: ChunkedLocalAttentionSpec(attention_chunk_size=64, **ATTN),  # type: ignore[arg-type]  # test input built loosely or wrong on purpose
    KVCacheSpecKind.SINK_FULL_ATTENTION: SinkFullAttentionSpec(sink_len=4, **ATTN),  # type: ignore[arg-type]  # test input built loosely or wrong on purpose
    KVCacheSpecKind.MLA_ATTENTION: MLAAttentionSpec(block_size=16, head_size=576, dtype=torch.bfloat16),
    KVCacheSpecKind.SLIDING_WINDOW_MLA: SlidingWindowMLASpec(
        block_size=16, head_size=576, dtype=torch.bfloat16, sliding_window=128
    ),
    KVCacheSpecKind.ENCODER_ONLY_ATTENTION: EncoderOnlyAttentionSpec(**ATTN),  # type: ignore[arg-type]  # test input built loosely or wrong on purpose
    KVCacheSpecKind.CROSS_ATTENTION: CrossAttentionSpec(**ATTN),  # type: ignore[arg-type]  # test input built loosely or wrong on purpose
    KVCacheSpecKind.MAMBA: MambaSpec(block_size=1, shapes=((4, 3),), dtypes=(torch.float32,)),
    KVCacheSpecKind.INDEXER: IndexerSpec(block_size=16, dtype=torch.bfloat16),
}
FULL = SPECS[KVCacheSpecKind.FULL_ATTENTION]
WINDOW = SPECS[KVCacheSpecKind.SLIDING_WINDOW]
MAMBA = SPECS[KVCacheSpecKind.MAMBA]


@pytest.mark.parametrize("kind", list(KVCacheSpecKind), ids=lambda k: k.value)
def test_every_kind_routes_through_backend_per_kind(kind: KVCacheSpecKind) -> None:
    reg = registry(EveryKindBackend, GenericToyBackend, ToyMambaBackend)
    selection = select_backend(
        SPECS[kind], config(reg, backend_per_kind={kind.value: "toy_every_kind"}), device="cpu", registry=reg
    )
    assert selection.backend is EveryKindBackend
    assert selection.kind is kind
    assert selection.source == "backend_per_kind"


def test_per_kind_routes_two_kinds_to_two_backends_and_swaps() -> None:
    reg = registry(GenericToyBackend, EveryKindBackend)
    cfg = config(reg, backend_per_kind="full_attention=toy_generic,sliding_window=toy_every_kind")
    assert select_backend(FULL, cfg, device="cpu", registry=reg).backend is GenericToyBackend
    assert select_backend(WINDOW, cfg, device="cpu", registry=reg).backend is EveryKindBackend
    swapped = config(reg, backend_per_kind="full_attention=toy_every_kind,sliding_window=toy_generic")
    assert select_backend(FULL, swapped, device="cpu", registry=reg).backend is EveryKindBackend
    assert select_backend(WINDOW, swapped, device="cpu", registry=reg).backend is GenericToyBackend


def test_per_kind_wins_over_global_backend() -> None:
    reg = registry(GenericToyBackend, EveryKindBackend)
    cfg = config(reg, backend="toy_generic", backend_per_kind={"full_attention": "toy_every_kind"})
    full = select_backend(FULL, cfg, device="cpu", registry=reg)
    window = select_backend(WINDOW, cfg, device="cpu", registry=reg)
    assert (full.backend, full.source) == (EveryKindBackend, "backend_per_kind")
    assert (window.backend, window.source) == (GenericToyBackend, "backend")


def test_explicit_backend_that_cannot_serve_raises_with_reasons() -> None:
    reg = registry(GenericToyBackend, EveryKindBackend)
    spec = dataclasses.replace(FULL_ATTN, head_size=72)
    cfg = config(reg, backend_per_kind={"full_attention": "toy_generic"})
    with pytest.raises(BackendNotSupportedError) as info:
        select_backend(spec, cfg, device="cpu", registry=reg)
    message = str(info.value)
    assert message.startswith(
        "backend 'toy_generic' was requested by AttentionConfig.backend_per_kind['full_attention'] "
        "but cannot serve FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=72"
    )
    assert "  - head_size=72 not supported (supported: 64, 128)" in message
    assert "HINT:" in message
    # No silent fallback to EveryKindBackend, which could serve it.
    assert info.value.rejected == (Rejection("toy_generic", ("head_size=72 not supported (supported: 64, 128)",)),)


def test_global_backend_that_cannot_serve_a_declared_kind_raises() -> None:
    reg = registry(FastCudaBackend, EveryKindBackend)
    cfg = config(reg, backend="toy_fast_cuda")
    with pytest.raises(BackendNotSupportedError, match=r"requested by AttentionConfig.backend but cannot serve"):
        select_backend(FULL, cfg, device="cpu", registry=reg)


def test_global_backend_skips_kinds_it_does_not_declare() -> None:
    reg = registry(GenericToyBackend, ToyMambaBackend)
    cfg = config(reg, backend="toy_generic")
    selection = select_backend(MAMBA, cfg, device="cpu", registry=reg)
    assert selection.backend is ToyMambaBackend
    assert selection.source == "priority"
    assert selection.rejected[0] == Rejection(
        "toy_generic",
        ("config.backend='toy_generic' does not serve kind=mamba; using the cpu priority list for this kind",),
    )


def test_priority_list_order_and_rejections() -> None:
    reg = registry(GenericToyBackend, FullOnlyBackend, FastCudaBackend)
    cfg = config(reg)
    priority = {"cpu": ("toy_fast_cuda", "toy_full_only", "toy_generic"), "cuda": ()}
    selection = select_backend(FULL, cfg, device="cpu", registry=reg, priority=priority)
    assert selection.backend is FullOnlyBackend
    assert selection.source == "priority"
    assert [r.backend for r in selection.rejected] == ["toy_fast_cuda"]
    assert selection.rejected[0].reasons[0] == "device=cpu not supported (supported: cuda)"
    explained = selection.explain()
    assert explained.splitlines()[0] == "full_attention: toy_full_only (chosen by priority)"
    assert "skipped toy_fast_cuda: device=cpu not supported (supported: cuda)" in explained


def test_registered_backends_outside_the_priority_list_are_tried_by_name() -> None:
    reg = registry(SlidingOnlyBackend, GenericToyBackend)
    selection = select_backend(WINDOW, config(reg), device="cpu", registry=reg, priority={"cpu": ()})
    # Alphabetical: toy_generic before toy_sliding_only.
    assert selection.backend is GenericToyBackend


def test_priority_names_not_installed_are_skipped_silently() -> None:
    reg = registry(GenericToyBackend)
    selection = select_backend(FULL, config(reg), device="cpu", registry=reg)
    # DEFAULT_PRIORITY names reference/triton_attn, which this registry lacks.
    assert selection.backend is GenericToyBackend
    assert selection.rejected == ()


def test_no_backend_lists_every_candidate_and_reason() -> None:
    reg = registry(GenericToyBackend, FastCudaBackend, NeedsMissingPackage)
    spec = dataclasses.replace(FULL_ATTN, head_size=72)
    with pytest.raises(NoBackendError) as info:
        select_backend(spec, config(reg), device="cpu", registry=reg)
    message = str(info.value)
    assert message.startswith("no backend can serve FullAttentionSpec(")
    assert "  `toy_generic` is not supported because:\n    head_size=72 not supported (supported: 64, 128)" in message
    assert "  `toy_fast_cuda` is not supported because:\n    device=cpu not supported (supported: cuda)" in message
    assert "  `toy_needs_pkg` is not supported because:\n    required package 'attnkit_test_missing_pkg'" in message
    assert "HINT: `attnkit backends`" in message
    assert {r.backend for r in info.value.rejected} == {"toy_generic", "toy_fast_cuda", "toy_needs_pkg"}
    assert not isinstance(info.value, BackendNotSupportedError)


def test_no_backend_registered_at_all() -> None:
    reg = registry()
    with pytest.raises(NoBackendError, match=r"\(no backend is registered\)"):
        select_backend(FULL, config(reg), device="cpu", registry=reg)


@pytest.fixture
def stand_in_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every CUDA device counts as present (the shared ``device_reasons`` check says
    nothing), so CUDA-only declarations can be exercised on a CPU-only machine."""
    monkeypatch.setattr(attnkit.backend, "device_problem", lambda device: None)


@pytest.mark.usefixtures("stand_in_gpu")
def test_features_capability_and_heads_reach_the_backends() -> None:
    reg = registry(FastCudaBackend)
    cfg = config(reg)
    ok = select_backend(
        FULL, cfg, device="cuda", capability=(9, 0), registry=reg,
        features=frozenset({AttentionFeature.LOGITS_SOFT_CAP}), num_heads=8,
    )
    assert ok.backend is FastCudaBackend
    assert ok.request.features == frozenset({AttentionFeature.LOGITS_SOFT_CAP})
    with pytest.raises(NoBackendError, match=r"compute capability 7.5 < minimum 8.0"):
        select_backend(FULL, cfg, device="cuda", capability=(7, 5), registry=reg)
    with pytest.raises(NoBackendError, match=r"feature alibi not supported"):
        select_backend(
            FULL, cfg, device="cuda", capability=(9, 0), registry=reg,
            features=frozenset({AttentionFeature.ALIBI}),
        )
    with pytest.raises(NoBackendError, match=r"num_heads=3 is not a multiple of num_kv_heads=2"):
        select_backend(FULL, cfg, device="cuda", capability=(9, 0), registry=reg, num_heads=3)


def test_config_plugin_allowlist_blocks_plugins_without_importing_them() -> None:
    eps = [EntryPoint(name="plug", value="attnkit_never_imported_module:X", group=ENTRY_POINT_GROUP)]
    reg = registry(GenericToyBackend, entry_points=eps)
    cfg = config(reg, backend_per_kind={"full_attention": "plug"}, plugins=["other"])
    with pytest.raises(BackendNotSupportedError, match=r"plugin 'plug' is not in AttentionConfig.plugins=\['other'\]"):
        select_backend(FULL, cfg, device="cpu", registry=reg)
    assert reg.excluded() == {}  # never loaded, so never failed
    selection = select_backend(FULL, config(reg, plugins=[]), device="cpu", registry=reg, priority={"cpu": ("plug",)})
    assert selection.backend is GenericToyBackend
    assert selection.rejected == (Rejection("plug", ("plugin 'plug' is not in AttentionConfig.plugins=[]",)),)


def test_name_unknown_to_this_registry_is_an_error() -> None:
    reg = registry(GenericToyBackend)
    cfg = AttentionConfig.model_validate({"backend": "elsewhere"}, context={"known_backends": ["elsewhere"]})
    with pytest.raises(BackendNotSupportedError, match=r"unknown backend 'elsewhere'; registered backends: toy_generic"):
        select_backend(FULL, cfg, device="cpu", registry=reg)


def test_selection_depends_only_on_arguments() -> None:
    reg_a = registry(GenericToyBackend, FullOnlyBackend)
    reg_b = registry(FullOnlyBackend)
    priority = {"cpu": ("toy_generic", "toy_full_only")}
    first = select_backend(FULL, config(reg_a), device="cpu", registry=reg_a, priority=priority)
    other = select_backend(FULL, config(reg_b), device="cpu", registry=reg_b, priority=priority)
    again = select_backend(FULL, config(reg_a), device="cpu", registry=reg_a, priority=priority)
    assert first.backend is GenericToyBackend
    assert other.backend is FullOnlyBackend
    assert again == first


def test_spec_must_be_a_spec() -> None:
    reg = registry(GenericToyBackend)
    with pytest.raises(
        errors.ArgumentTypeError,
        match=r"^spec must be a KVCacheSpec \(e\.g\. FullAttentionSpec, SlidingWindowSpec, "
        r"MambaSpec\), got \{\} \(dict\)$",
    ):
        select_backend({}, config(reg), device="cpu", registry=reg)  # type: ignore[arg-type]  # test input built loosely or wrong on purpose


def _device_registry() -> BackendRegistry:
    from attnkit.registry import BUILTIN_BACKENDS

    return BackendRegistry(builtins=BUILTIN_BACKENDS, discover_plugins=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
@pytest.mark.parametrize("device", ["cuda", "cuda:7", torch.device("cuda:0")], ids=str)
def test_an_absent_device_rejects_every_builtin_with_the_reason(device: str | torch.device) -> None:
    reg = _device_registry()
    with pytest.raises(NoBackendError) as info:
        select_backend(FULL, config(reg), device=device, capability=(9, 0), registry=reg)
    shown = str(torch.device(device))
    problem = f"device '{shown}' is not available: this torch build has no CUDA support"
    rejected = {r.backend: r.reasons for r in info.value.rejected}
    assert set(rejected) == set(reg.names())  # every built-in was asked, none chosen
    for name, reasons in rejected.items():
        if name == "flash_attn":  # it says so in its own words (its own probe)
            assert "no CUDA device is available (torch.cuda.is_available() is False)" in reasons
        else:
            assert reasons[0] == problem, name
            assert f"  `{name}` is not supported because:\n    {problem}" in str(info.value)
    # Asked directly, every built-in gives the reason too.
    for name in reg.names():
        assert reg.get(name).device_reasons(torch.device(device)), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_planning_for_a_hypothetical_gpu() -> None:
    """hypothetical_device: the routing a GPU machine would get, from a CPU machine;
    declared rules (capability, kinds) and installed packages still decide."""
    reg = _device_registry()
    chosen = select_backend(
        FULL, config(reg), device="cuda", capability=(9, 0), registry=reg,
        hypothetical_device=True,
    )
    assert chosen.backend_name == "triton_attn"
    flash = dict((r.backend, r.reasons) for r in chosen.rejected)["flash_attn"]
    assert any("flash-attn is not installed" in r for r in flash)
    assert not any("this torch build has no CUDA support" in r for r in flash)
    mamba = MambaSpec(block_size=16, shapes=((8, 3), (2, 4, 4)), dtypes=(torch.float32, torch.float32),
                      mamba_type="mamba2")
    assert select_backend(
        mamba, config(reg), device="cuda", capability=(9, 0), registry=reg,
        hypothetical_device=True,
    ).backend_name == "triton_mamba2"
    with pytest.raises(InvalidArgumentError, match=r"needs its capability, e.g. capability=\(9, 0\)"):
        select_backend(FULL, config(reg), device="cuda", registry=reg, hypothetical_device=True)
    with pytest.raises(ArgumentTypeError, match=r"hypothetical_device must be a bool, got 1"):
        select_backend(FULL, config(reg), device="cpu", registry=reg, hypothetical_device=1)  # type: ignore[arg-type]  # the wrong type is the test


def test_a_present_device_has_no_device_reason() -> None:
    reg = _device_registry()
    for name in reg.names():
        assert reg.get(name).device_reasons(torch.device("cpu")) == [], name
    chosen = select_backend(FULL, config(reg), device="cpu", registry=reg)
    assert chosen.backend_name == "cpu_attn"  # first on CPU for the kinds it serves


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_a_backend_overriding_not_supported_reasons_still_gets_the_device_reason() -> None:
    class SaysYes(GenericToyBackend):
        name = "toy_says_yes"

        @classmethod
        @override
        def not_supported_reasons(cls, request: BackendRequest) -> list[str]:
            return []

    reg = registry(SaysYes)
    with pytest.raises(NoBackendError) as info:
        select_backend(FULL, config(reg), device="cuda:3", registry=reg)
    assert info.value.rejected == (
        Rejection(
            "toy_says_yes",
            ("device 'cuda:3' is not available: this torch build has no CUDA support",),
        ),
    )


def test_a_plugin_that_fails_to_load_during_selection_is_a_reason() -> None:
    eps = [EntryPoint(name="fragile", value="attnkit_missing_plugin_module:X", group=ENTRY_POINT_GROUP)]
    reg = registry(GenericToyBackend, entry_points=eps)
    selection = select_backend(FULL, config(reg), device="cpu", registry=reg, priority={"cpu": ("fragile",)})
    assert selection.backend is GenericToyBackend
    (rejection,) = selection.rejected
    assert rejection.backend == "fragile"
    assert rejection.reasons == (
        "plugin 'fragile' (entry point fragile = attnkit_missing_plugin_module:X) failed to "
        "load and is excluded: ModuleNotFoundError: No module named "
        "'attnkit_missing_plugin_module'",
    )
    # Once failed, it is still a candidate with the same reason: selection reads the same.
    again = select_backend(
        FULL, config(reg), device="cpu", registry=reg, priority={"cpu": ("fragile",)}
    )
    assert again == selection
    # Named explicitly, its failure is the reason (not "unknown backend").
    cfg = AttentionConfig(backend="fragile")
    with pytest.raises(BackendNotSupportedError, match=r"ModuleNotFoundError: No module") as info:
        select_backend(FULL, cfg, device="cpu", registry=reg)
    assert info.value.rejected == (Rejection("fragile", rejection.reasons),)


def test_backends_see_the_config() -> None:
    seen: list[AttentionConfig | None] = []

    class ConfigAware(GenericToyBackend):
        name = "toy_config_aware"

        @classmethod
        @override
        def extra_not_supported_reasons(cls, request: BackendRequest) -> list[str]:
            seen.append(request.config)
            return []

    reg = registry(ConfigAware)
    cfg = config(reg, backend_options={"toy_config_aware": {"version": 4}})
    assert select_backend(FULL, cfg, device="cpu", registry=reg).request.config is cfg
    assert seen == [cfg]
    (given,) = seen
    assert given is not None
    assert given.options_for("toy_config_aware", FlashAttentionOptions).version == 4


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        pytest.param(errors.UnknownBackendError, KeyError, id="unknown"),
        pytest.param(errors.DuplicateBackendError, ValueError, id="duplicate"),
        pytest.param(errors.InvalidBackendError, TypeError, id="invalid"),
        pytest.param(errors.NoBackendError, RuntimeError, id="no-backend"),
        pytest.param(errors.BackendNotSupportedError, errors.NoBackendError, id="not-supported"),
        pytest.param(errors.OutOfBlocksError, RuntimeError, id="out-of-blocks"),
        pytest.param(errors.ArgumentTypeError, TypeError, id="argument-type"),
        pytest.param(errors.InvalidArgumentError, ValueError, id="invalid-argument"),
        pytest.param(errors.UnknownRequestError, KeyError, id="unknown-request"),
        pytest.param(errors.DuplicateRequestError, ValueError, id="duplicate-request"),
        pytest.param(errors.EngineLimitError, ValueError, id="engine-limit"),
        pytest.param(errors.StaleStepError, RuntimeError, id="stale-step"),
        pytest.param(errors.DeviceUnavailableError, RuntimeError, id="device-unavailable"),
        pytest.param(errors.PluginError, RuntimeError, id="plugin"),
    ],
)
def test_every_error_is_an_attnkit_error_and_its_builtin(error: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(error, AttnkitError)
    assert issubclass(error, builtin)
    assert getattr(attnkit, error.__name__) is error  # engines catch them from attnkit


def test_the_error_family_is_complete() -> None:
    # Every exception class errors.py defines is in the family, listed in its __all__
    # and importable from attnkit; the ones above are among them.
    defined = {
        obj for obj in vars(errors).values() if isinstance(obj, type) and issubclass(obj, BaseException)
    }
    assert all(issubclass(cls, AttnkitError) for cls in defined)
    assert {cls.__name__ for cls in defined} <= set(errors.__all__)
    assert all(getattr(attnkit, cls.__name__) is cls for cls in defined)
    assert {
        errors.UnknownBackendError,
        errors.NoBackendError,
        errors.ArgumentTypeError,
        errors.InvalidArgumentError,
        errors.PluginError,
        errors.DeviceUnavailableError,
    } <= defined


def test_one_except_clause_catches_an_unknown_backend() -> None:
    reg = registry(GenericToyBackend)
    cfg = AttentionConfig(backend_per_kind={"full_attention": "missing_backend"})
    caught: list[AttnkitError] = []
    for attempt in (
        lambda: select_backend(FULL, cfg, device="cpu", registry=reg),
        lambda: reg.get("missing_backend"),
    ):
        try:
            attempt()
        except AttnkitError as exc:
            caught.append(exc)
    selection_error, lookup_error = caught
    assert isinstance(selection_error, BackendNotSupportedError)
    assert "unknown backend 'missing_backend'; registered backends: toy_generic" in str(selection_error)
    assert isinstance(lookup_error, UnknownBackendError)
    # Its builtin still catches it, and the message is not quoted as KeyError would.
    with pytest.raises(KeyError) as info:
        reg.get("missing_backend")
    assert str(info.value) == "unknown backend 'missing_backend'; registered backends: toy_generic"


def test_sparse_attention_on_cuda_routes_to_triton_mla_and_says_what_it_lacks() -> None:
    """DeepSeek-V3.2 on a GPU (issues vLLM #30644, #40851): triton_mla serves the sparse
    MLA layer and its indexer (on sm_80 too); where it cannot (an fp8 latent cache) the
    reason names what is missing, and a backend without the feature is told which."""
    mla = MLAAttentionSpec(block_size=64, head_size=576, dtype=torch.bfloat16)
    sparse = {AttentionFeature.SPARSE_ATTENTION}
    chosen = select_backend(
        mla, AttentionConfig(), device="cuda", capability=(9, 0), num_heads=128,
        features=sparse, hypothetical_device=True,
    )
    assert chosen.backend_name == "triton_mla"
    # An fp8 latent cache: no sparse kernel reads it (reference keeps latents unquantised),
    # and the error says so for triton_mla.
    fp8 = dataclasses.replace(mla, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(
        NoBackendError, match="sparse_attention with an fp8_e4m3 latent cache is not supported"
    ):
        select_backend(
            fp8, AttentionConfig(), device="cuda", capability=(9, 0), num_heads=128,
            features=sparse, hypothetical_device=True,
        )
    indexer = IndexerSpec(block_size=64, dtype=torch.bfloat16)
    for capability in ((8, 0), (9, 0)):  # integer-decoded fp8 rows: no fp8 hardware needed
        served = select_backend(
            indexer, AttentionConfig(), device="cuda", capability=capability,
            hypothetical_device=True,
        )
        assert served.backend_name == "triton_mla"
    # Without the feature declared, a sparse layer's reason names it (a plugin MLA backend).
    assert any(
        "feature sparse_attention not supported" in r
        for r in ReferenceLessMLA.not_supported_reasons(
            BackendRequest(spec=mla, device=torch.device("cpu"), features=frozenset(sparse))
        )
    )


class ReferenceLessMLA(AttentionBackend):
    """An MLA backend that declares no sparse attention."""

    name = "toy_dense_mla"
    supported_devices = frozenset({"cpu"})
    builders = (bind_builder(MLAAttentionSpec, ToyAttentionBuilder, ToyImpl),)
