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
    AttentionBackend,
    AttentionConfig,
    AttentionFeature,
    AttentionLayerParams,
    AttentionMetadataBuilder,
    AttentionSpec,
    BackendRequest,
    ChunkedLocalAttentionSpec,
    CommonAttentionMetadata,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
    MLAAttentionSpec,
    MultipleOf,
    SizeRange,
    SlidingWindowSpec,
    bind_builder,
)
from attnkit.backend import format_sizes
from toy_backends import (
    ALL_TOY_BACKENDS,
    FastCudaBackend,
    FullOnlyBackend,
    GenericToyBackend,
    NeedsMissingPackage,
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


def _allowed(size: int, rule: Sequence[int | MultipleOf] | None) -> bool:
    # Independent restatement of a size rule: exact sizes or any multiple of n.
    if rule is None:
        return True
    exact = {r for r in rule if isinstance(r, int)}
    multiples = [r.n for r in rule if isinstance(r, MultipleOf)]
    return size in exact or any(size % n == 0 for n in multiples)


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
        "kind": kind not in backend.supported_kinds,
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
    )
    assert params.features == frozenset(AttentionFeature)
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
            r"k_scale must be a finite float > 0, got 0.0",
            id="k-scale",
        ),
        pytest.param(
            {"num_heads": 2, "v_scale": float("inf")},
            r"v_scale must be a finite float > 0, got inf",
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


def test_binding_picks_most_specific_spec_type() -> None:
    class SpecialFullBuilder(ToyAttentionBuilder):
        backend_name = "special"

    class TwoBindings(AttentionBackend):
        name = "toy_two"
        supported_kinds = frozenset(
            {KVCacheSpecKind.FULL_ATTENTION, KVCacheSpecKind.SLIDING_WINDOW}
        )
        builders = (
            bind_builder(AttentionSpec, ToyAttentionBuilder, ToyImpl),
            bind_builder(FullAttentionSpec, SpecialFullBuilder, ToyImpl),
        )

    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=4
    )
    assert TwoBindings.get_binding(full()).builder_cls is SpecialFullBuilder
    assert TwoBindings.get_binding(window).builder_cls is ToyAttentionBuilder


def test_binding_create_checks_spec_at_runtime() -> None:
    binding = ToyMambaBackend.get_binding(mamba())
    builder = binding.create(mamba(), ["m0"], CONFIG, CPU)
    assert isinstance(builder, ToyMambaBuilder)
    assert builder.kv_cache_spec == mamba()
    assert builder.layer_names == ("m0",)
    with pytest.raises(
        TypeError,
        match=r"ToyMambaBuilder is bound to MambaSpec, got a FullAttentionSpec \(kind=full_attention\)",
    ):
        binding.create(full(), ["a0"], CONFIG, CPU)
    impl = binding.create_impl(mamba(), None)
    assert isinstance(impl, ToyMambaImpl)


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
        match=r"ToyMambaBuilder accepts MambaSpec specs, so it cannot be bound to AttentionSpec",
    ):
        bind(AttentionSpec, ToyMambaBuilder, ToyMambaImpl)  # type: ignore[operator]  # called through an untyped alias on purpose
    with pytest.raises(
        TypeError,
        match=r"builder_cls must be a subclass of AttentionMetadataBuilder, got <class 'int'>",
    ):
        bind(AttentionSpec, int, ToyImpl)  # type: ignore[operator]  # called through an untyped alias on purpose
    with pytest.raises(
        TypeError, match=r"spec_type must be a subclass of KVCacheSpec, got <class 'str'>"
    ):
        bind(str, ToyAttentionBuilder, ToyImpl)  # type: ignore[operator]  # called through an untyped alias on purpose
    with pytest.raises(TypeError, match=r"impl_cls must be a subclass of AttentionImpl"):
        bind(AttentionSpec, ToyAttentionBuilder, object)  # type: ignore[operator]  # called through an untyped alias on purpose


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
    with pytest.raises(TypeError, match=r"OnlyFull accepts FullAttentionSpec specs"):
        bind(AttentionSpec, OnlyFull, ToyImpl)  # type: ignore[operator]  # called through an untyped alias on purpose
    assert bind_builder(FullAttentionSpec, OnlyFull, ToyImpl).spec_type is FullAttentionSpec


# ---------------------------------------------------------------------------
# Declaration problems (checked at registration)


def test_declaration_problems() -> None:
    class NoBuilderForKind(AttentionBackend):
        name = "toy_bad_kind"
        supported_kinds = frozenset({KVCacheSpecKind.FULL_ATTENTION, KVCacheSpecKind.MAMBA})
        builders = (bind_builder(FullAttentionSpec, ToyAttentionBuilder, ToyImpl),)

    problems = NoBuilderForKind.declaration_problems()
    assert problems == [
        "kind mamba is declared but no builder is bound to MambaSpec or a base of it",
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

    problems = Missing.declaration_problems()
    assert "name must be an identifier string, got None" in problems
    assert any(p.startswith("supported_kinds must be a non-empty frozenset") for p in problems)
    assert any(
        p.startswith("builders must be a tuple of bind_builder(...) results") for p in problems
    )


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
        "from attnkit import AttentionMetadataBuilder\n"
        "class ForwardRefBuilder(AttentionMetadataBuilder):\n"
        "    def __init__(self, kv_cache_spec: 'NotDefinedAnywhere', layer_names, config, device):\n"
        "        super().__init__(kv_cache_spec, layer_names, config, device)\n"
        "    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):\n"
        "        return None\n",
        namespace,
    )
    bind: object = bind_builder
    binding = bind(FullAttentionSpec, namespace["ForwardRefBuilder"], ToyImpl)  # type: ignore[operator]  # called through an untyped alias on purpose
    assert binding.spec_type is FullAttentionSpec  # type: ignore[attr-defined]  # attribute of the concrete impl behind the ABC


def test_an_unregistered_class_with_a_gap_reports_it() -> None:
    class Gap(AttentionBackend):
        name = "toy_gap"
        supported_kinds = frozenset({KVCacheSpecKind.FULL_ATTENTION})
        builders = (bind_builder(SlidingWindowSpec, ToyAttentionBuilder, ToyImpl),)

    assert Gap.not_supported_reasons(BackendRequest(spec=full(), device=CPU)) == [
        "no builder is bound to FullAttentionSpec"
    ]
    assert Gap.declaration_problems() == [
        "kind full_attention is declared but no builder is bound to FullAttentionSpec or a base of it"
    ]


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
    from attnkit.backend import attention_params_problems

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
