"""Backend declarations, ``not_supported_reasons`` and the builder binding."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typing_extensions import override

from attnkit import (
    AttentionCGSupport,
    AttentionConfig,
    AttentionFeature,
    AttentionLayerParams,
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    Mamba2LayerParams,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from attnkit.backend_api import (
    AttentionBackend,
    AttentionMetadataBuilder,
    BackendRequest,
    CommonAttentionMetadata,
    MultipleOf,
    SizeRange,
    attention_params_problems,
    bind_builder,
    bind_each,
    format_sizes,
)
from attnkit.backends.reference import ReferenceBackend
from toy_backends import (
    ALL_TOY_BACKENDS,
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
    ToyMeta,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
CONFIG = AttentionConfig.model_validate({}, context={"known_backends": []})


def full(**overrides: object) -> FullAttentionSpec:
    fields: dict[str, object] = {
        "block_size": 16,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": torch.float16,
    }
    fields.update(overrides)
    return FullAttentionSpec(**fields)  # type: ignore[arg-type]  # fields vary per test


def mamba(mamba_type: str = "mamba2") -> MambaSpec:
    return MambaSpec(
        block_size=1,
        shapes=((8, 3), (2, 4, 16)),
        dtypes=(torch.float32, torch.float32),
        mamba_type=mamba_type,  # type: ignore[arg-type]  # bad values are part of the tests
    )


# ---------------------------------------------------------------------------
# Reasons, one declaration at a time (messages written out by hand)


@pytest.mark.parametrize(
    ("backend", "request_", "expected"),
    [
        pytest.param(
            GenericToyBackend,
            BackendRequest(spec=full(head_size=72), device=CPU),
            ["head_size=72 not supported (supported: 64, 128)"],
            id="head-size",
        ),
        pytest.param(
            GenericToyBackend,
            BackendRequest(spec=full(block_size=24), device=CPU),
            ["block_size=24 not supported (supported: 16, 32)"],
            id="block-size",
        ),
        pytest.param(
            FastCudaBackend,
            BackendRequest(spec=full(block_size=96, head_size=96), device=CUDA, capability=(9, 0)),
            ["block_size=96 not supported (supported: 16, multiple of 64)"],
            id="block-size-multiple-rule",
        ),
        pytest.param(
            FastCudaBackend,
            BackendRequest(spec=full(), device=CPU),
            ["device=cpu not supported (supported: cuda)"],
            id="device",
        ),
        pytest.param(
            FastCudaBackend,
            BackendRequest(spec=full(), device=CUDA, capability=(7, 5)),
            ["compute capability 7.5 < minimum 8.0"],
            id="capability-too-old",
        ),
        pytest.param(
            FastCudaBackend,
            BackendRequest(spec=full(), device=CUDA),
            ["compute capability unknown (pass capability=(major, minor))"],
            id="capability-unknown",
        ),
        pytest.param(
            FastCudaBackend,
            BackendRequest(spec=full(dtype=torch.float32), device=CUDA, capability=(9, 0)),
            ["dtype=float32 not supported (supported: bfloat16, float16)"],
            id="dtype",
        ),
        pytest.param(
            GenericToyBackend,
            BackendRequest(spec=full(kv_cache_dtype="fp8_e4m3"), device=CPU),
            ["kv_cache_dtype=fp8_e4m3 not supported (supported: auto)"],
            id="kv-cache-dtype",
        ),
        pytest.param(
            GenericToyBackend,
            BackendRequest(spec=full(), device=CPU, features=frozenset({AttentionFeature.ALIBI})),
            ["feature alibi not supported (supported: none)"],
            id="feature",
        ),
        pytest.param(
            FullOnlyBackend,
            BackendRequest(
                spec=SlidingWindowSpec(
                    block_size=16,
                    num_kv_heads=2,
                    head_size=64,
                    dtype=torch.float16,
                    sliding_window=8,
                ),
                device=CPU,
            ),
            ["kind=sliding_window not supported (supported: full_attention)"],
            id="kind",
        ),
        pytest.param(
            ToyMambaBackend,
            BackendRequest(spec=mamba("gdn"), device=CPU),
            ["mamba_type=gdn not supported (supported: mamba2)"],
            id="mamba-type",
        ),
        pytest.param(
            GenericToyBackend,
            BackendRequest(spec=full(num_kv_heads=3), device=CPU, num_heads=8),
            ["num_heads=8 is not a multiple of num_kv_heads=3"],
            id="gqa-ratio",
        ),
        pytest.param(
            NeedsMissingPackage,
            BackendRequest(spec=full(), device=CPU),
            [
                "required package 'attnkit_test_missing_pkg' is not installed "
                "(pip install 'attnkit-test-missing-pkg>=1')"
            ],
            id="missing-package",
        ),
    ],
)
def test_single_reason(
    backend: type[AttentionBackend], request_: BackendRequest, expected: list[str]
) -> None:
    assert backend.not_supported_reasons(request_) == expected
    assert not backend.supports(request_)


def test_all_reasons_are_reported_together() -> None:
    request = BackendRequest(
        spec=full(head_size=72, block_size=24, dtype=torch.float32),
        device=CPU,
        features=frozenset({AttentionFeature.ALIBI, AttentionFeature.ATTENTION_SINKS}),
    )
    reasons = FastCudaBackend.not_supported_reasons(request)
    assert reasons == [
        "device=cpu not supported (supported: cuda)",
        "dtype=float32 not supported (supported: bfloat16, float16)",
        "head_size=72 not supported (supported: multiple of 32)",
        "block_size=24 not supported (supported: 16, multiple of 64)",
        "feature alibi not supported (supported: logits_soft_cap)",
        "feature attention_sinks not supported (supported: logits_soft_cap)",
    ]


def test_supported_request_has_no_reasons() -> None:
    request = BackendRequest(
        spec=full(head_size=96, block_size=128, kv_cache_dtype="fp8_e4m3"),
        device=CUDA,
        capability=(9, 0),
        features=frozenset({AttentionFeature.LOGITS_SOFT_CAP}),
        num_heads=8,
    )
    assert FastCudaBackend.not_supported_reasons(request) == []
    assert FastCudaBackend.supports(request)


def test_max_compute_capability() -> None:
    class OldGpuBackend(GenericToyBackend):
        name = "toy_old_gpu"
        max_compute_capability = (9, 0)

    request = BackendRequest(spec=full(), device=CUDA, capability=(10, 0))
    assert OldGpuBackend.not_supported_reasons(request) == ["compute capability 10.0 > maximum 9.0"]
    assert OldGpuBackend.supports(BackendRequest(spec=full(), device=CUDA, capability=(9, 0)))


def test_extra_reason_hooks_are_included() -> None:
    class Picky(GenericToyBackend):
        name = "toy_picky"

        @classmethod
        @override
        def extra_environment_reasons(cls, device: torch.device) -> list[str]:
            return ["the interpreter flag is off"]

        @classmethod
        @override
        def extra_not_supported_reasons(cls, request: BackendRequest) -> list[str]:
            return ["no odd block counts"]

    reasons = Picky.not_supported_reasons(BackendRequest(spec=full(), device=CPU))
    assert reasons == ["the interpreter flag is off", "no odd block counts"]
    assert Picky.environment_reasons(CPU) == ["the interpreter flag is off"]


def test_format_sizes() -> None:
    assert format_sizes((16, 32, MultipleOf(64))) == "16, 32, multiple of 64"


def test_multiple_of_rejects_non_positive() -> None:
    with pytest.raises(ValueError, match=r"MultipleOf.n must be a positive int, got 0"):
        MultipleOf(0)


# ---------------------------------------------------------------------------
# Generated from the declarations: what a declaration says is what the backend does


HEAD_SIZES = [32, 48, 64, 72, 80, 96, 128, 160, 192, 256]
BLOCK_SIZES = [1, 8, 16, 24, 32, 48, 64, 128, 256]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
KV_DTYPES = ["auto", "float16", "fp8_e4m3"]


def _allowed(size: int, rule: Sequence[int | MultipleOf | SizeRange] | None) -> bool:
    # Independent restatement of a size rule: exact sizes, any multiple of n, or a range.
    if rule is None:
        return True
    exact = {r for r in rule if isinstance(r, int)}
    multiples = [r.n for r in rule if isinstance(r, MultipleOf)]
    ranges = [range(r.low, r.high + 1) for r in rule if isinstance(r, SizeRange)]
    return size in exact or any(size % n == 0 for n in multiples) or any(size in r for r in ranges)


@settings(max_examples=150, deadline=None)
@given(
    backend=st.sampled_from([b for b in ALL_TOY_BACKENDS if b is not NeedsMissingPackage]),
    kind=st.sampled_from([KVCacheSpecKind.FULL_ATTENTION, KVCacheSpecKind.SLIDING_WINDOW]),
    head_size=st.sampled_from(HEAD_SIZES),
    block_size=st.sampled_from(BLOCK_SIZES),
    dtype=st.sampled_from(DTYPES),
    kv_cache_dtype=st.sampled_from(KV_DTYPES),
    device=st.sampled_from(["cpu", "cuda"]),
    capability=st.sampled_from([(7, 0), (8, 0), (9, 0), (12, 0)]),
    features=st.frozensets(st.sampled_from(list(AttentionFeature)), max_size=2),
)
def test_reasons_follow_declarations(
    backend: type[AttentionBackend],
    kind: KVCacheSpecKind,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    device: str,
    capability: tuple[int, int],
    features: frozenset[AttentionFeature],
) -> None:
    common = {
        "block_size": block_size,
        "num_kv_heads": 2,
        "head_size": head_size,
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype,
    }
    spec: AttentionSpec = (
        FullAttentionSpec(**common)  # type: ignore[arg-type]  # test input built loosely or wrong on purpose
        if kind is KVCacheSpecKind.FULL_ATTENTION
        else SlidingWindowSpec(sliding_window=64, **common)  # type: ignore[arg-type]  # test input built loosely or wrong on purpose
    )
    request = BackendRequest(
        spec=spec, device=torch.device(device), capability=capability, features=features
    )
    expected_failures = {
        "kind": kind not in backend.supported_kinds(),
        "device": device not in backend.supported_devices,
        "capability": device == "cuda"
        and backend.min_compute_capability is not None
        and capability < backend.min_compute_capability,
        "dtype": dtype not in backend.supported_dtypes,
        "kv_cache_dtype": kv_cache_dtype not in backend.supported_kv_cache_dtypes,
        "head_size": not _allowed(head_size, backend.supported_head_sizes),
        "block_size": not _allowed(block_size, backend.supported_block_sizes),
        "feature": not features <= backend.supported_features,
    }
    if expected_failures["kind"]:
        # A kind the backend does not serve is reported alone, with the environment.
        for what in ("dtype", "kv_cache_dtype", "head_size", "block_size", "feature"):
            expected_failures[what] = False
    reasons = backend.not_supported_reasons(request)
    assert (not reasons) == (not any(expected_failures.values())), (reasons, expected_failures)
    for what, fails in expected_failures.items():
        if what == "capability":
            mentioned = any("compute capability" in r for r in reasons)
        elif what == "feature":
            mentioned = any(r.startswith("feature ") for r in reasons)
        else:
            mentioned = any(r.startswith(f"{what}=") for r in reasons)
        assert mentioned == fails, (what, reasons)


# ---------------------------------------------------------------------------
# Layer params


def test_layer_params_features() -> None:
    params = AttentionLayerParams(
        num_heads=4,
        logits_soft_cap=30.0,
        alibi_slopes=(0.5, 0.25, 0.125, 0.0625),
        sinks=torch.zeros(4),
        return_lse=True,
        index_topk=2048,
        k_scale=(1.0, 2.0),
    )
    # Every feature a layer's parameters can ask for; context_parallel is asked by the
    # runtime for a sharded group, mla_projection by an MLAProjection (tested with MLA),
    # mm_prefix by the spec (tests/test_mm_prefix.py).
    assert params.features == frozenset(AttentionFeature) - {
        AttentionFeature.CONTEXT_PARALLEL,
        AttentionFeature.MLA_PROJECTION,
        AttentionFeature.MM_PREFIX,
    }
    assert AttentionLayerParams(num_heads=4).features == frozenset()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"num_heads": 0}, r"num_heads must be a positive int, got 0", id="heads"),
        pytest.param(
            {"num_heads": 2, "scale": -1.0},
            r"scale must be a finite float > 0, got -1.0",
            id="scale",
        ),
        pytest.param(
            {"num_heads": 2, "logits_soft_cap": 0.0},
            r"logits_soft_cap must be a finite float > 0 or None, got 0.0",
            id="softcap",
        ),
        pytest.param(
            {"num_heads": 2, "alibi_slopes": (1.0,)},
            r"alibi_slopes must have num_heads=2 entries, got 1",
            id="alibi",
        ),
        pytest.param(
            {"num_heads": 2, "k_scale": 0.0},
            r"k_scale must be a finite float > 0 or a tuple of one per K/V head, got 0.0",
            id="k-scale",
        ),
        pytest.param(
            {"num_heads": 2, "v_scale": float("inf")},
            r"v_scale must be a finite float > 0 or a tuple of one per K/V head, got inf",
            id="v-scale",
        ),
        pytest.param(
            {"num_heads": 2, "sinks": torch.zeros(3)},
            r"sinks must have shape \[num_heads=2\], got \[3\]",
            id="sinks",
        ),
    ],
)
def test_layer_params_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AttentionLayerParams(**kwargs)  # type: ignore[arg-type]  # test input built loosely or wrong on purpose


# ---------------------------------------------------------------------------
# Binding


def mamba2_params() -> Mamba2LayerParams:
    # H=2, P=4, G=1, N=2: conv channels C = H*P + 2*G*N = 12.
    return Mamba2LayerParams(
        num_heads=2, head_dim=4, n_groups=1, d_state=2, conv_weight=torch.zeros(12, 4), A=-torch.ones(2)
    )


def test_each_kind_has_its_own_binding() -> None:
    class SpecialFullBuilder(ToyAttentionBuilder):
        backend_name = "special"

    class TwoBindings(AttentionBackend):
        name = "toy_two"
        builders = (
            bind_builder(SlidingWindowSpec, ToyAttentionBuilder, ToyImpl),
            bind_builder(FullAttentionSpec, SpecialFullBuilder, ToyImpl),
        )

    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=4
    )
    full_binding = TwoBindings.get_binding(full())
    window_binding = TwoBindings.get_binding(window)
    assert (full_binding.kind, full_binding.spec_type) == (KVCacheSpecKind.FULL_ATTENTION, FullAttentionSpec)
    assert full_binding.builder_type is SpecialFullBuilder
    assert full_binding.builder_name.endswith("SpecialFullBuilder")
    assert window_binding.builder_type is ToyAttentionBuilder
    assert window_binding.impl_type is ToyImpl
    assert (window_binding.builder_name, window_binding.impl_name) == ("ToyAttentionBuilder", "ToyImpl")
    assert TwoBindings.supported_kinds() == {KVCacheSpecKind.FULL_ATTENTION, KVCacheSpecKind.SLIDING_WINDOW}
    assert TwoBindings.declaration_problems() == []


MLA = MLAAttentionSpec(block_size=16, head_size=576, dtype=torch.bfloat16)
SINK = SinkFullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sink_len=4)


@pytest.mark.parametrize("spec", [MLA, SINK], ids=lambda s: s.kind.value)
def test_a_binding_serves_its_exact_kind_not_subclass_kinds(spec: FullAttentionSpec) -> None:
    # MLAAttentionSpec and SinkFullAttentionSpec subclass FullAttentionSpec, but each
    # is a kind of its own: a full-attention binding does not serve them.
    assert isinstance(spec, FullAttentionSpec)
    assert FullOnlyBackend.not_supported_reasons(BackendRequest(spec=spec, device=CPU)) == [
        f"kind={spec.kind.value} not supported (supported: full_attention)"
    ]
    assert FullOnlyBackend.find_binding(spec) is None
    with pytest.raises(
        TypeError,
        match=rf"^backend 'toy_full_only' has no builder for {type(spec).__name__} \(bound: FullAttentionSpec\)$",
    ):
        FullOnlyBackend.get_binding(spec)
    binding = FullOnlyBackend.get_binding(full())
    with pytest.raises(
        TypeError,
        match=rf"^ToyAttentionBuilder is bound to FullAttentionSpec \(kind=full_attention\), got a "
        rf"{type(spec).__name__} \(kind={spec.kind.value}\)$",
    ):
        binding.create(spec, ["l0"], CONFIG, CPU)
    with pytest.raises(TypeError, match=rf"got a {type(spec).__name__} \(kind={spec.kind.value}\)$"):
        binding.create_impl(spec, AttentionLayerParams(num_heads=2))


@pytest.mark.parametrize("spec_type", [AttentionSpec, KVCacheSpec], ids=lambda t: t.__name__)
def test_bind_builder_rejects_a_spec_class_without_a_kind(spec_type: type[AttentionSpec]) -> None:
    with pytest.raises(
        TypeError,
        match=rf"^bind_builder: spec_type must be a concrete spec class with a kind, got "
        rf"{spec_type.__name__}; bind each concrete class \(bind_each\)$",
    ):
        bind_builder(spec_type, ToyAttentionBuilder, ToyImpl)
    with pytest.raises(TypeError, match=rf"got {spec_type.__name__}; bind each concrete class"):
        bind_each((FullAttentionSpec, spec_type), ToyAttentionBuilder, ToyImpl)


def test_bind_each_binds_every_class_given() -> None:
    spec_types = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)
    bindings = bind_each(spec_types, ToyAttentionBuilder, ToyImpl)
    assert [b.spec_type for b in bindings] == list(spec_types)
    assert [b.kind for b in bindings] == [t.kind for t in spec_types]
    assert all(b.builder_type is ToyAttentionBuilder and b.impl_type is ToyImpl for b in bindings)

    class Three(AttentionBackend):
        name = "toy_three"
        builders = bindings

    assert Three.supported_kinds() == {
        KVCacheSpecKind.FULL_ATTENTION,
        KVCacheSpecKind.SLIDING_WINDOW,
        KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION,
    }
    chunked = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, attention_chunk_size=32
    )
    assert Three.get_binding(chunked) is bindings[2]
    assert Three.declaration_problems() == []


@pytest.mark.parametrize(
    "backend", [*ALL_TOY_BACKENDS, ReferenceBackend], ids=lambda b: b.name
)
def test_supported_kinds_are_the_bound_kinds(backend: type[AttentionBackend]) -> None:
    assert backend.supported_kinds() == frozenset(b.kind for b in backend.builders)
    assert len(backend.builders) == len(backend.supported_kinds())  # one binding per kind


def test_supported_kinds_written_out() -> None:
    both = {KVCacheSpecKind.FULL_ATTENTION, KVCacheSpecKind.SLIDING_WINDOW}
    assert GenericToyBackend.supported_kinds() == both
    assert FastCudaBackend.supported_kinds() == both
    assert FullOnlyBackend.supported_kinds() == {KVCacheSpecKind.FULL_ATTENTION}
    assert SlidingOnlyBackend.supported_kinds() == {KVCacheSpecKind.SLIDING_WINDOW}
    assert ToyMambaBackend.supported_kinds() == {KVCacheSpecKind.MAMBA}
    assert ReferenceBackend.supported_kinds() == set(KVCacheSpecKind)


def test_binding_create_checks_spec_at_runtime() -> None:
    binding = ToyMambaBackend.get_binding(mamba())
    builder = binding.create(mamba(), ["m0"], CONFIG, CPU)
    assert isinstance(builder, ToyMambaBuilder)
    assert builder.kv_cache_spec == mamba()
    assert builder.layer_names == ("m0",)
    with pytest.raises(
        TypeError,
        match=r"^ToyMambaBuilder is bound to MambaSpec \(kind=mamba\), got a FullAttentionSpec \(kind=full_attention\)$",
    ):
        binding.create(full(), ["a0"], CONFIG, CPU)
    params = mamba2_params()
    impl = binding.create_impl(mamba(), params)
    assert isinstance(impl, ToyMambaImpl)
    assert impl.kv_cache_spec == mamba()
    assert impl.layer_params is params


@pytest.mark.parametrize(
    ("backend", "spec", "params", "message"),
    [
        pytest.param(
            ToyMambaBackend,
            mamba(),
            AttentionLayerParams(num_heads=2),
            r"^ToyMambaImpl takes layer_params of type Mamba2LayerParams, got AttentionLayerParams$",
            id="attention-params-to-a-state-impl",
        ),
        pytest.param(
            ToyMambaBackend,
            mamba(),
            None,
            r"^ToyMambaImpl takes layer_params of type Mamba2LayerParams, got NoneType$",
            id="none-to-a-state-impl",
        ),
        pytest.param(
            GenericToyBackend,
            full(),
            mamba2_params(),
            r"^ToyImpl takes layer_params of type AttentionLayerParams, got Mamba2LayerParams$",
            id="state-params-to-an-attention-impl",
        ),
        pytest.param(
            GenericToyBackend,
            full(),
            None,
            r"^ToyImpl takes layer_params of type AttentionLayerParams, got NoneType$",
            id="none-to-an-attention-impl",
        ),
    ],
)
def test_create_impl_checks_the_layer_params_class(
    backend: type[AttentionBackend], spec: KVCacheSpec, params: object, message: str
) -> None:
    binding = backend.get_binding(spec)
    with pytest.raises(TypeError, match=message):
        binding.create_impl(spec, params)


def test_create_impl_builds_an_attention_impl() -> None:
    params = AttentionLayerParams(num_heads=4)
    impl = GenericToyBackend.get_binding(full()).create_impl(full(), params)
    assert isinstance(impl, ToyImpl)
    assert impl.kv_cache_spec == full()
    assert impl.layer_params is params


def test_binding_reports_its_builder_class_settings() -> None:
    state = ToyMambaBackend.get_binding(mamba())
    attention = GenericToyBackend.get_binding(full())
    assert state.is_state_binding
    assert not attention.is_state_binding
    assert state.get_cudagraph_support(CONFIG, mamba()) is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert attention.get_cudagraph_support(CONFIG, full()) is AttentionCGSupport.UNIFORM_BATCH
    assert state.reorder_batch_threshold is None

    class Reordering(ToyAttentionBuilder):
        reorder_batch_threshold = 1

    assert bind_builder(FullAttentionSpec, Reordering, ToyImpl).reorder_batch_threshold == 1


def test_get_binding_for_unbound_spec() -> None:
    with pytest.raises(
        TypeError,
        match=r"backend 'toy_mamba' has no builder for FullAttentionSpec \(bound: MambaSpec\)",
    ):
        ToyMambaBackend.get_binding(full())
    assert ToyMambaBackend.find_binding(full()) is None


def test_bind_builder_rejects_annotation_mismatch_at_runtime() -> None:
    # mypy rejects this statically (tests/typing/fail/wrong_spec_binding.py); an
    # untyped plugin reaches the same check at run time.
    bind: object = bind_builder
    with pytest.raises(
        TypeError,
        match=r"the builder ToyMambaBuilder accepts MambaSpec specs, so it cannot be bound to FullAttentionSpec",
    ):
        bind(FullAttentionSpec, ToyMambaBuilder, ToyImpl)  # type: ignore[operator]  # called through an untyped alias on purpose
    with pytest.raises(
        TypeError,
        match=r"the impl ToyImpl accepts AttentionSpec specs, so it cannot be bound to MambaSpec",
    ):
        bind(MambaSpec, ToyMambaBuilder, ToyImpl)  # type: ignore[operator]  # called through an untyped alias on purpose
    with pytest.raises(
        TypeError,
        match=r"builder_cls must be a subclass of AttentionMetadataBuilder, got <class 'int'>",
    ):
        bind(FullAttentionSpec, int, ToyImpl)  # type: ignore[operator]  # called through an untyped alias on purpose
    with pytest.raises(
        TypeError, match=r"spec_type must be a subclass of KVCacheSpec, got <class 'str'>"
    ):
        bind(str, ToyAttentionBuilder, ToyImpl)  # type: ignore[operator]  # called through an untyped alias on purpose
    with pytest.raises(TypeError, match=r"impl_cls must be a subclass of AttentionImpl or StateImpl, got <class 'object'>"):
        bind(FullAttentionSpec, ToyAttentionBuilder, object)  # type: ignore[operator]  # called through an untyped alias on purpose


def test_a_state_impl_cannot_be_bound_to_an_attention_spec_at_runtime() -> None:
    bind: object = bind_builder
    with pytest.raises(
        TypeError,
        match=r"the impl ToyMambaImpl accepts MambaSpec specs, so it cannot be bound to FullAttentionSpec",
    ):
        bind(FullAttentionSpec, ToyAttentionBuilder, ToyMambaImpl)  # type: ignore[operator]  # called through an untyped alias on purpose


def test_bind_builder_narrowing_via_generic_parameter_is_seen_at_runtime() -> None:
    class OnlyFull(AttentionMetadataBuilder[ToyMeta, FullAttentionSpec]):
        @override
        def build(
            self,
            common_prefix_len: int,
            common_attn_metadata: CommonAttentionMetadata,
            fast_build: bool = False,
        ) -> ToyMeta:
            raise NotImplementedError

    bind: object = bind_builder
    with pytest.raises(TypeError, match=r"OnlyFull accepts FullAttentionSpec specs, so it cannot be bound to SlidingWindowSpec"):
        bind(SlidingWindowSpec, OnlyFull, ToyImpl)  # type: ignore[operator]  # called through an untyped alias on purpose
    assert bind_builder(FullAttentionSpec, OnlyFull, ToyImpl).spec_type is FullAttentionSpec


def test_bind_builder_narrowing_by_annotation_alone_is_seen_at_runtime() -> None:
    # A class-level annotation with no __init__ taking the narrower spec: mypy reports
    # neither this binding nor a construction with another spec
    # (tests/typing/fail/annotation_only_narrowing.py); the import-time check does.
    class AnnotatedOnly(AttentionMetadataBuilder[ToyMeta]):
        kv_cache_spec: FullAttentionSpec  # pyright: ignore[reportIncompatibleMethodOverride]  # the spelling under test

        @override
        def build(
            self,
            common_prefix_len: int,
            common_attn_metadata: CommonAttentionMetadata,
            fast_build: bool = False,
        ) -> ToyMeta:
            raise NotImplementedError

    with pytest.raises(
        TypeError,
        match=r"AnnotatedOnly accepts FullAttentionSpec specs, so it cannot be bound to SlidingWindowSpec$",
    ):
        bind_builder(SlidingWindowSpec, AnnotatedOnly, ToyImpl)
    assert bind_builder(FullAttentionSpec, AnnotatedOnly, ToyImpl).spec_type is FullAttentionSpec


# ---------------------------------------------------------------------------
# Declaration problems (checked at registration)


def test_declaration_problems() -> None:
    class MambaWithoutTypes(AttentionBackend):
        name = "toy_bad_mamba"
        builders = (bind_builder(MambaSpec, ToyMambaBuilder, ToyMambaImpl),)

    assert MambaWithoutTypes.declaration_problems() == [
        "kind mamba is declared but supported_mamba_types is empty",
    ]

    class BadName(GenericToyBackend):
        name = "not a name"
        supported_head_sizes = (64, 0)

    assert BadName.declaration_problems() == [
        "name must be an identifier string, got 'not a name'",
        "supported_head_sizes must be None or a non-empty tuple of positive ints/MultipleOf, got (64, 0)",
    ]

    class Missing(AttentionBackend):
        pass

    assert Missing.declaration_problems() == [
        "name must be an identifier string, got None",
        "builders must be a non-empty tuple of bind_builder(...) results, got None",
    ]

    class Empty(GenericToyBackend):
        name = "toy_empty"
        builders = ()

    assert Empty.declaration_problems() == [
        "builders must be a non-empty tuple of bind_builder(...) results, got ()"
    ]
    assert Empty.supported_kinds() == frozenset()


def test_declaring_supported_kinds_is_a_declaration_problem() -> None:
    class DeclaresKinds(AttentionBackend):
        name = "toy_declares_kinds"
        supported_kinds = frozenset({KVCacheSpecKind.FULL_ATTENTION, KVCacheSpecKind.MAMBA})  # type: ignore[assignment]  # declaring it is the mistake under test
        builders = (bind_builder(FullAttentionSpec, ToyAttentionBuilder, ToyImpl),)

    assert DeclaresKinds.declaration_problems() == [
        "supported_kinds must not be declared: it is derived from builders (one kind per bind_builder)"
    ]


def test_a_kind_bound_twice_is_a_declaration_problem() -> None:
    class OtherBuilder(ToyAttentionBuilder):
        backend_name = "other"

    class Twice(AttentionBackend):
        name = "toy_twice"
        builders = (
            *bind_each((FullAttentionSpec, SlidingWindowSpec), ToyAttentionBuilder, ToyImpl),
            bind_builder(SlidingWindowSpec, OtherBuilder, ToyImpl),
        )

    assert Twice.declaration_problems() == [
        "kind sliding_window is bound twice (SlidingWindowSpec and SlidingWindowSpec)"
    ]


def test_toy_backends_are_valid() -> None:
    for backend in ALL_TOY_BACKENDS:
        assert backend.declaration_problems() == [], backend.name


# ---------------------------------------------------------------------------
# Cache shapes


@pytest.mark.parametrize(
    ("spec", "shapes"),
    [
        pytest.param(
            full(block_size=16, num_kv_heads=2, head_size=64), ((10, 2, 16, 2, 64),), id="full"
        ),
        pytest.param(
            MLAAttentionSpec(block_size=32, head_size=576, dtype=torch.bfloat16),
            ((10, 32, 576),),
            id="mla",
        ),
        pytest.param(mamba(), ((10, 8, 3), (10, 2, 4, 16)), id="mamba"),
        pytest.param(
            EncoderOnlyAttentionSpec(
                block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32
            ),
            (),
            id="encoder-only",
        ),
        pytest.param(
            CrossAttentionSpec(block_size=16, num_kv_heads=4, head_size=32, dtype=torch.float32),
            ((10, 2, 16, 4, 32),),
            id="cross",
        ),
        pytest.param(
            ChunkedLocalAttentionSpec(
                block_size=16,
                num_kv_heads=1,
                head_size=32,
                dtype=torch.float32,
                attention_chunk_size=64,
            ),
            ((10, 2, 16, 1, 32),),
            id="chunked",
        ),
    ],
)
def test_default_kv_cache_shapes(spec: KVCacheSpec, shapes: tuple[tuple[int, ...], ...]) -> None:
    assert AttentionBackend.get_kv_cache_shapes(10, spec) == shapes


def test_kv_cache_shapes_rejects_bad_num_blocks() -> None:
    with pytest.raises(ValueError, match=r"num_blocks must be a positive int, got 0"):
        AttentionBackend.get_kv_cache_shapes(0, full())


def test_toy_builder_builds() -> None:
    binding = GenericToyBackend.get_binding(full())
    builder = binding.create(full(), ["l0", "l1"], CONFIG, CPU)
    cm = CommonAttentionMetadata.from_lists(
        query_lens=[1, 3], seq_lens=[5, 3], block_table=[[1], [2]], slot_mapping=[20, 32, 33, 34]
    )
    meta = builder.build(0, cm)
    assert isinstance(meta, ToyMeta)
    assert meta.num_reqs == 2
    assert dataclasses.replace(meta, backend="x").backend == "x"


def test_feature_prints_its_value() -> None:
    assert str(AttentionFeature.LOGITS_SOFT_CAP) == "logits_soft_cap"


def test_unresolvable_builder_annotations_skip_the_runtime_check() -> None:
    # A plugin whose annotations name types mypy never saw (forward references that
    # cannot be resolved) still binds; the static check is the one that applies then.
    namespace: dict[str, object] = {}
    exec(  # builds a class whose annotation cannot be resolved at run time
        "from attnkit.backend_api import AttentionMetadataBuilder\n"
        "class ForwardRefBuilder(AttentionMetadataBuilder):\n"
        "    def __init__(self, kv_cache_spec: 'NotDefinedAnywhere', layer_names, config, device):\n"
        "        super().__init__(kv_cache_spec, layer_names, config, device)\n"
        "    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):\n"
        "        return None\n",
        namespace,
    )
    bind: object = bind_builder
    binding = bind(FullAttentionSpec, namespace["ForwardRefBuilder"], ToyImpl)  # type: ignore[operator]  # called through an untyped alias on purpose
    assert binding.spec_type is FullAttentionSpec


def test_a_binding_to_a_spec_subclass_does_not_serve_the_base_class() -> None:
    # A plugin may bind its own subclass of a spec class (same kind); specs of the
    # base class are then of the kind but not of the bound class, and it says so.
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class TaggedFullSpec(FullAttentionSpec):
        tag: str = "mine"

    class Narrow(AttentionBackend):
        name = "toy_narrow"
        builders = (bind_builder(TaggedFullSpec, ToyAttentionBuilder, ToyImpl),)

    assert Narrow.declaration_problems() == []
    assert Narrow.supported_kinds() == {KVCacheSpecKind.FULL_ATTENTION}
    assert Narrow.not_supported_reasons(BackendRequest(spec=full(), device=CPU)) == [
        "no builder is bound to FullAttentionSpec (bound: TaggedFullSpec)"
    ]
    assert Narrow.find_binding(full()) is None
    tagged = TaggedFullSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    assert Narrow.not_supported_reasons(BackendRequest(spec=tagged, device=CPU)) == []
    binding = Narrow.get_binding(tagged)
    with pytest.raises(TypeError, match=r"is bound to TaggedFullSpec \(kind=full_attention\), got a FullAttentionSpec"):
        binding.create(full(), ["l0"], CONFIG, CPU)


def test_abstract_backend_is_a_declaration_problem() -> None:
    class StillAbstract(GenericToyBackend):
        name = "toy_abstract"

        @classmethod
        @abc.abstractmethod
        def something(cls) -> None: ...

    assert StillAbstract.declaration_problems()[0].endswith("StillAbstract is abstract")


def test_size_range_rule() -> None:
    class Ranged(GenericToyBackend):
        name = "toy_ranged"
        supported_head_sizes = (SizeRange(16, 256),)
        supported_block_sizes = (8, MultipleOf(16), SizeRange(40, 48))

    ok = BackendRequest(spec=full(head_size=200, block_size=44), device=CPU)
    assert Ranged.not_supported_reasons(ok) == []
    bad = BackendRequest(spec=full(head_size=300, block_size=50), device=CPU)
    assert Ranged.not_supported_reasons(bad) == [
        "head_size=300 not supported (supported: 16 to 256)",
        "block_size=50 not supported (supported: 8, multiple of 16, 40 to 48)",
    ]
    assert Ranged.declaration_problems() == []
    with pytest.raises(
        ValueError, match=r"SizeRange needs positive ints with low <= high, got \(9, 3\)"
    ):
        SizeRange(9, 3)


def test_attention_params_problems() -> None:
    spec = full(num_kv_heads=2, head_size=64)
    ok = AttentionLayerParams(num_heads=4, logits_soft_cap=10.0)
    soft = frozenset({AttentionFeature.LOGITS_SOFT_CAP})
    assert attention_params_problems(spec, ok, backend="b", supported_features=soft) == []
    bad = AttentionLayerParams(
        num_heads=3,
        alibi_slopes=(0.1, 0.2, 0.3),
        v_head_size=32,
        sink_key=torch.zeros(1, 2, 64),
        sink_value=torch.zeros(1, 2, 64),
    )
    assert attention_params_problems(spec, bad, backend="b", supported_features=frozenset()) == [
        "the layer needs alibi, which b does not support (supported features: none)",
        "v_head_size=32 differs from head_size=64, which b does not support",
        "sink tokens (sink_key/sink_value) are not supported",
        "num_heads=3 is not a multiple of num_kv_heads=2",
    ]
