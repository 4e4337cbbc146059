"""The backend ABC: a named set of kernels with declared capabilities.

A backend is a class whose capabilities are class variables. Support is a list of
reasons, never a bare bool: ``not_supported_reasons(request)`` is computed from the
declarations alone (plus the ``extra_not_supported_reasons`` hook for conditions no
declaration can express), so a declaration cannot lie::

    class MyBackend(AttentionBackend):
        name = "my_backend"
        supported_devices = frozenset({"cuda"})
        supported_head_sizes = (64, 128, 256)
        supported_block_sizes = (MultipleOf(16),)
        builders = (bind_builder(FullAttentionSpec, MyBuilder, MyImpl),)

The kinds a backend serves are those of its bindings (``supported_kinds()``), so they
are declared once; ``bind_builder`` (``attnkit.binding``) ties each spec class to the
builder that accepts it and the impl that consumes the builder's metadata.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
from abc import ABC
from collections.abc import Mapping
from typing import ClassVar, cast

import torch

from ._validation import dtype_name, is_capability, is_positive_int
from .binding import Binding, BuilderBinding
from .capabilities import (
    KV_CACHE_LAYOUTS,
    AttentionFeature,
    Determinism,
    KVCacheLayout,
    MultipleOf,
    SizeRange,
    SizeRule,
    format_sizes,
    size_allowed,
)
from .config import AttentionConfig, BackendOptions
from .devices import SUPPORTED_DEVICE_TYPES, device_problem
from .kinds import rules_for
from .spec import (
    MODEL_DTYPES,
    AttentionSpec,
    KVCacheDType,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
    MambaType,
)

__all__ = ["AttentionBackend", "BackendRequest", "DraftTreeSupport"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftTreeSupport:
    """What a backend's attention kernels take of draft trees (docs/speculative.md):
    each draft token attends to the cached context, its ancestors and itself
    (``CommonAttentionMetadata.draft_tree``).

    Attributes:
        kinds: the attention kinds whose layers take tree masks (a kind whose mask is
            measured in positions, a window or a chunk, would need each draft's depth
            as its position, so none declares those).
        max_width: the most draft tokens at one depth of a tree.
        max_depth: the deepest draft token (the root, the last accepted token, is at
            depth 0).
        how: one line on how the kernels apply the mask (for ``attnkit backends``
            and the docs).
        alibi: whether layers with ALiBi slopes take trees: a draft's distances are
            then measured along its path (it sits at the root's position plus its
            depth, not at its slot).
    """

    kinds: frozenset[KVCacheSpecKind]
    max_width: int
    max_depth: int
    how: str = ""
    alibi: bool = False

@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendRequest:
    """What a backend is asked to serve: one group's spec, on one device.

    Attributes:
        spec: the group's cache spec.
        device: where it runs.
        capability: CUDA compute capability ``(major, minor)``; ``None`` off CUDA or
            when unknown (a backend with a minimum capability then says so).
        features: optional features the group's layers need.
        num_heads: query heads, if known (checked against ``num_kv_heads``).
        config: the config the selection runs under, for backends whose support
            depends on a setting (e.g. ``backend_options``); ``None`` if unknown.
    """

    spec: KVCacheSpec
    device: torch.device
    capability: tuple[int, int] | None = None
    features: frozenset[AttentionFeature] = frozenset()
    num_heads: int | None = None
    config: AttentionConfig | None = None


class AttentionBackend(ABC):
    """A named set of kernels with declared capabilities.

    Subclasses set the class variables below and ``builders``; they are validated when
    registered (``attnkit.registry``). Everything a backend says about support comes
    from ``not_supported_reasons``.
    """

    name: ClassVar[str]
    """Registry name, e.g. ``"triton_attn"``."""
    builders: ClassVar[tuple[Binding, ...]]
    """One ``bind_builder(...)`` per spec class served; their kinds are the kinds served.

    Declared with the non-generic ``Binding`` so that each ``bind_builder`` call in a
    subclass body is checked from its own arguments (``attnkit.binding``)."""
    supported_devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    """Device types (``torch.device.type``)."""
    min_compute_capability: ClassVar[tuple[int, int] | None] = None
    """On CUDA, the oldest compute capability served."""
    max_compute_capability: ClassVar[tuple[int, int] | None] = None
    """On CUDA, the newest compute capability served."""
    supported_dtypes: ClassVar[frozenset[torch.dtype]] = MODEL_DTYPES
    """Model dtypes of attention layers."""
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto"})
    """Cache storage dtypes of attention layers."""
    supported_head_sizes: ClassVar[SizeRule | None] = None
    """Head sizes of attention layers; ``None``: any."""
    supported_block_sizes: ClassVar[SizeRule | None] = None
    """Block sizes of attention layers; ``None``: any."""
    supported_features: ClassVar[frozenset[AttentionFeature]] = frozenset()
    """Optional features served."""
    supported_mamba_types: ClassVar[frozenset[MambaType]] = frozenset()
    """``MambaSpec.mamba_type`` values served (for the ``mamba`` kind)."""
    required_packages: ClassVar[Mapping[str, str]] = {}
    """Import name -> pip requirement of optional packages the backend needs."""
    description: ClassVar[str] = ""
    """One line for ``attnkit backends``."""
    deterministic: ClassVar[bool] = False
    """The same step on the same inputs and cache gives the same output and cache, bit
    for bit, run after run on one device. ``True`` is a promise the conformance kit
    checks (it runs every call twice and compares the bits); ``False`` promises nothing.
    ``True`` is the level ``Determinism.RUN_TO_RUN`` for every kind not in
    ``determinism``."""
    determinism: ClassVar[Mapping[KVCacheSpecKind, Determinism]] = {}
    """Per kind served, the strongest ``Determinism`` level kept when a config asks for
    it (its builders may take a slower, invariant path then; docs/determinism.md).
    A kind not listed has ``RUN_TO_RUN`` when ``deterministic``; with ``deterministic =
    False`` every kind has ``NONE`` (a subclass that sets it promises nothing). Read it
    with ``determinism_for``.
    ``attnkit.testing.check_invariance`` checks a declared level bit for bit."""
    options_type: ClassVar[type[BackendOptions] | None] = None
    """The backend's own settings (a ``BackendOptions`` model), given by users as
    ``AttentionConfig(backend_options={name: {...}})``; ``None``: it has none."""
    draft_trees: ClassVar[DraftTreeSupport | None] = None
    """Draft trees its attention kernels take (``AttentionConfig.draft_tree_width`` >
    1); ``None``: drafts are chains only. State layers need nothing: the runtime runs a
    tree's tokens through their decode paths (docs/speculative.md)."""
    kv_cache_layout: ClassVar[KVCacheLayout] = "interleaved"
    """How its attention layers receive their cache (``get_kv_cache_shapes``).

    ``"interleaved"``: one page-major tensor ``[num_blocks, 2, block_size, Hkv, D]``.
    ``"planes"``: two token-major tensors, K and V, each
    ``[num_blocks * block_size, Hkv, D]``, row = slot (``block * block_size + offset``),
    for kernels that take K and V as flat token tensors (FlexAttention/SDPA style) and
    would otherwise gather them every step. Planes apply to the K/V attention kinds
    (full, sink, sliding-window, chunked-local, cross; encoder-only keeps no cache);
    for MLA and state kinds a planes backend is rejected with a reason. Plane views
    cannot alias page-major ones, so a model that mixes both allocates a second set of
    layer buffers; ``AttentionRuntime.memory_report()`` shows what that costs."""

    @classmethod
    def supported_kinds(cls) -> frozenset[KVCacheSpecKind]:
        """The kinds served: one per binding in ``builders``."""
        return frozenset(b.kind for b in getattr(cls, "builders", ()))

    @classmethod
    def determinism_for(cls, kind: KVCacheSpecKind) -> Determinism:
        """The level declared for ``kind``: ``NONE`` unless ``deterministic``, then its
        entry in ``determinism``, else ``RUN_TO_RUN``."""
        if not cls.deterministic:
            return Determinism.NONE
        level = cls.determinism.get(kind)
        if level is not None:
            return level
        return Determinism.RUN_TO_RUN

    @classmethod
    def not_supported_reasons(cls, request: BackendRequest) -> list[str]:
        """Every reason this backend cannot serve ``request``; empty if it can."""
        spec = request.spec
        reasons = cls.environment_reasons(request.device, request.capability)
        if spec.kind not in cls.supported_kinds():
            # The decisive reason; field-by-field reasons for a kind the backend does
            # not serve would only be noise.
            reasons.append(
                f"kind={spec.kind.value} not supported "
                f"(supported: {', '.join(sorted(k.value for k in cls.supported_kinds()))})"
            )
            return reasons
        if cls.find_binding(spec) is None:
            bound = ", ".join(b.spec_type.__name__ for b in cls.builders)
            reasons.append(f"no builder is bound to {type(spec).__name__} (bound: {bound})")
        reasons.extend(cls._layout_reasons(spec))
        wanted = request.config.determinism if request.config is not None else Determinism.NONE
        declared = cls.determinism_for(spec.kind)
        if wanted > declared:
            reasons.append(
                f"determinism={wanted.label} not kept for kind={spec.kind.value} "
                f"(declared: {declared.label})"
            )
        if isinstance(spec, AttentionSpec):
            reasons.extend(cls._attention_reasons(spec, request))
        elif isinstance(spec, MambaSpec) and spec.mamba_type not in cls.supported_mamba_types:
            supported = ", ".join(sorted(cls.supported_mamba_types)) or "none"
            reasons.append(f"mamba_type={spec.mamba_type} not supported (supported: {supported})")
        wanted_features = request.features
        if rules_for(spec).mask(spec).mm_prefix:  # the spec asks it, not the layer params
            wanted_features = wanted_features | {AttentionFeature.MM_PREFIX}
        missing = sorted(wanted_features - cls.supported_features)
        if missing:
            supported = ", ".join(sorted(f.value for f in cls.supported_features)) or "none"
            for feature in missing:
                reasons.append(f"feature {feature.value} not supported (supported: {supported})")
        reasons.extend(cls.extra_not_supported_reasons(request))
        return reasons

    @classmethod
    def _layout_reasons(cls, spec: KVCacheSpec) -> list[str]:
        """The declared ``kv_cache_layout`` must be one the spec's kind has."""
        try:
            rules_for(spec).check_layout(spec, cls.kv_cache_layout)
        except ValueError as exc:
            return [f"kv_cache_layout={cls.kv_cache_layout} not supported: {exc}"]
        return []

    @classmethod
    def _attention_reasons(cls, spec: AttentionSpec, request: BackendRequest) -> list[str]:
        reasons: list[str] = []
        if spec.dtype not in cls.supported_dtypes:
            supported = ", ".join(sorted(dtype_name(d) for d in cls.supported_dtypes))
            reasons.append(
                f"dtype={dtype_name(spec.dtype)} not supported (supported: {supported})"
            )
        if spec.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            supported = ", ".join(sorted(cls.supported_kv_cache_dtypes))
            reasons.append(
                f"kv_cache_dtype={spec.kv_cache_dtype} not supported (supported: {supported})"
            )
        if cls.supported_head_sizes is not None and not size_allowed(
            spec.head_size, cls.supported_head_sizes
        ):
            reasons.append(
                f"head_size={spec.head_size} not supported "
                f"(supported: {format_sizes(cls.supported_head_sizes)})"
            )
        if cls.supported_block_sizes is not None and not size_allowed(
            spec.block_size, cls.supported_block_sizes
        ):
            reasons.append(
                f"block_size={spec.block_size} not supported "
                f"(supported: {format_sizes(cls.supported_block_sizes)})"
            )
        if AttentionFeature.PER_HEAD_QUANT_SCALES in request.features and rules_for(spec).latent:
            reasons.append(
                f"per_head_quant_scales not supported for {spec.kind.value} layers: an MLA "
                f"latent is shared by every head and keeps one per-tensor scale"
            )
        if request.num_heads is not None and request.num_heads % spec.num_kv_heads != 0:
            reasons.append(
                f"num_heads={request.num_heads} is not a multiple of "
                f"num_kv_heads={spec.num_kv_heads}"
            )
        if request.config is not None and request.config.draft_tree_width > 1:
            reasons.extend(cls._draft_tree_reasons(spec, request.config, request.features))
        return reasons

    @classmethod
    def _draft_tree_reasons(
        cls,
        spec: AttentionSpec,
        config: AttentionConfig,
        features: frozenset[AttentionFeature] = frozenset(),
    ) -> list[str]:
        """Why the backend cannot take the config's draft trees on ``spec``'s layers."""
        width, depth = config.draft_tree_width, config.num_speculative_tokens
        wanted = f"draft trees (AttentionConfig.draft_tree_width={width})"
        support = cls.draft_trees
        if support is None:
            return [f"{wanted} not supported (draft chains only)"]
        reasons: list[str] = []
        if spec.kind not in support.kinds:
            kinds = ", ".join(sorted(k.value for k in support.kinds)) or "none"
            reasons.append(f"{wanted} not supported on kind={spec.kind.value} (tree kinds: {kinds})")
        if AttentionFeature.ALIBI in features and not support.alibi:
            reasons.append(
                f"{wanted} not supported with alibi (a draft's distances would be counted "
                f"in slots, not along its path)"
            )
        if width > support.max_width:
            reasons.append(f"{wanted} not supported (max width {support.max_width})")
        if depth > support.max_depth:
            reasons.append(
                f"draft trees as deep as num_speculative_tokens={depth} not supported "
                f"(max depth {support.max_depth})"
            )
        return reasons

    @classmethod
    def environment_reasons(
        cls, device: torch.device, capability: tuple[int, int] | None = None
    ) -> list[str]:
        """Reasons independent of any spec: device type, compute capability, packages."""
        reasons: list[str] = []
        if device.type not in cls.supported_devices:
            reasons.append(
                f"device={device.type} not supported "
                f"(supported: {', '.join(sorted(cls.supported_devices))})"
            )
        elif device.type == "cuda":
            low, high = cls.min_compute_capability, cls.max_compute_capability
            if (low is not None or high is not None) and capability is None:
                reasons.append("compute capability unknown (pass capability=(major, minor))")
            elif capability is not None and low is not None and capability < low:
                reasons.append(
                    f"compute capability {capability[0]}.{capability[1]} < minimum {low[0]}.{low[1]}"
                )
            elif capability is not None and high is not None and capability > high:
                reasons.append(
                    f"compute capability {capability[0]}.{capability[1]} > maximum {high[0]}.{high[1]}"
                )
        for module, requirement in cls.required_packages.items():
            if importlib.util.find_spec(module) is None:
                reasons.append(
                    f"required package {module!r} is not installed (pip install '{requirement}')"
                )
        reasons.extend(cls.extra_environment_reasons(device))
        return reasons

    @classmethod
    def device_reasons(cls, device: torch.device) -> list[str]:
        """Why ``device`` does not exist on this machine (no CUDA, an index past the
        device count); empty when it does.

        Selection (``select_backend``) asks every candidate, built-in or plugin, and adds
        these reasons to the candidate's ``not_supported_reasons``, so no backend is
        chosen for an absent device. Declarations alone (``not_supported_reasons``) do
        not include them: they describe what a backend serves, on any machine. The
        default is ``attnkit.devices.device_problem``; override only to answer from a
        backend's own probe of the device.
        """
        problem = device_problem(device)
        return [problem] if problem is not None else []

    @classmethod
    def extra_environment_reasons(cls, device: torch.device) -> list[str]:
        """Hook: environment conditions no declaration expresses (e.g. an interpreter flag)."""
        return []

    @classmethod
    def environment_notes(cls, device: torch.device) -> list[str]:
        """Hook: what the backend runs with on this machine and why (a native library
        and where it came from, say), shown by ``attnkit backends``. Informational only:
        selection never reads it. Default: none."""
        return []

    @classmethod
    def extra_not_supported_reasons(cls, request: BackendRequest) -> list[str]:
        """Hook: spec-dependent conditions no declaration expresses. Default: none."""
        return []

    @classmethod
    def supports(cls, request: BackendRequest) -> bool:
        """``not cls.not_supported_reasons(request)``."""
        return not cls.not_supported_reasons(request)

    @classmethod
    def find_binding(cls, spec: KVCacheSpec) -> Binding | None:
        """The binding of ``spec``'s kind (binding is by exact kind), if ``spec`` is of its class."""
        for binding in cls.builders:
            if binding.kind is spec.kind and isinstance(spec, binding.spec_type):
                return binding
        return None

    @classmethod
    def get_binding(cls, spec: KVCacheSpec) -> Binding:
        """Like ``find_binding`` but raises ``TypeError`` naming the bound spec types."""
        binding = cls.find_binding(spec)
        if binding is None:
            bound = ", ".join(b.spec_type.__name__ for b in cls.builders) or "none"
            raise TypeError(
                f"backend {cls.name!r} has no builder for {type(spec).__name__} (bound: {bound})"
            )
        return binding

    @classmethod
    def get_kv_cache_shapes(cls, num_blocks: int, spec: KVCacheSpec) -> tuple[tuple[int, ...], ...]:
        """One shape per cache tensor of a layer with ``spec``, in ``kv_cache_layout``.

        Default: the kind's shapes for the declared layout (``attnkit.kinds``):
        attention ``[num_blocks, 2, block_size, Hkv, D]`` (interleaved) or two planes
        ``[num_blocks * block_size, Hkv, D]`` (planes); MLA ``[num_blocks, block_size, D]``;
        Mamba ``[num_blocks, *shape]`` per state; encoder-only layers keep no cache (no
        tensors). ``num_blocks`` counts kernel blocks of ``spec.block_size`` (the pool's
        pages times the blocks a page holds, ``KVCacheGroup.blocks_per_page``). An
        override must keep the allocator's geometry: page-major tensors start with
        ``num_blocks`` and fit one block's share of a page per block; the two planes
        start with ``num_blocks * block_size`` and a page's rows fill exactly half a page.

        Raises:
            ValueError: a bad ``num_blocks``, or a layout the kind does not have.
        """
        if not is_positive_int(num_blocks):
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        return rules_for(spec).cache_shapes(spec, num_blocks, cls.kv_cache_layout)

    @classmethod
    def declaration_problems(cls) -> list[str]:
        """What is wrong with this class's declarations (empty when it is a valid backend).

        Checked when the backend is registered.
        """
        problems: list[str] = []
        if inspect.isabstract(cls):
            problems.append(f"{cls.__qualname__} is abstract")
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name.isidentifier():
            problems.append(f"name must be an identifier string, got {name!r}")
        if not isinstance(inspect.getattr_static(cls, "supported_kinds"), classmethod):
            problems.append(
                "supported_kinds must not be declared: it is derived from builders "
                "(one kind per bind_builder)"
            )
        builders: object = getattr(cls, "builders", None)
        # The declaration is unchecked here: look at it as objects, keep the bindings.
        items = cast("tuple[object, ...]", builders) if isinstance(builders, tuple) else ()
        bindings: list[Binding] = [b for b in items if isinstance(b, BuilderBinding)]
        if not items or len(bindings) != len(items):
            problems.append(
                f"builders must be a non-empty tuple of bind_builder(...) results, got {builders!r}"
            )
            bindings = []
        seen: dict[KVCacheSpecKind, str] = {}
        for b in bindings:
            if b.kind in seen:
                problems.append(
                    f"kind {b.kind.value} is bound twice ({seen[b.kind]} and {b.spec_type.__name__})"
                )
            seen[b.kind] = b.spec_type.__name__
        kinds = frozenset(seen)
        layout: object = getattr(cls, "kv_cache_layout", None)
        if layout not in KV_CACHE_LAYOUTS:
            problems.append(
                f"kv_cache_layout must be one of {', '.join(map(repr, KV_CACHE_LAYOUTS))}, "
                f"got {layout!r}"
            )
        devices: object = getattr(cls, "supported_devices", None)
        if not (
            isinstance(devices, frozenset)
            and devices
            and all(d in SUPPORTED_DEVICE_TYPES for d in cast("frozenset[object]", devices))
        ):
            problems.append(
                "supported_devices must be a non-empty frozenset of "
                f"{', '.join(map(repr, SUPPORTED_DEVICE_TYPES))}, got {devices!r}"
            )
        for attr in ("min_compute_capability", "max_compute_capability"):
            capability: object = getattr(cls, attr, None)
            if capability is not None and not is_capability(capability):
                problems.append(
                    f"{attr} must be None or a (major, minor) tuple of ints >= 0, "
                    f"got {capability!r}"
                )
        description: object = getattr(cls, "description", None)
        if not isinstance(description, str):
            problems.append(f"description must be a str, got {description!r}")
        deterministic: object = getattr(cls, "deterministic", None)
        if not isinstance(deterministic, bool):
            problems.append(f"deterministic must be a bool, got {deterministic!r}")
        levels: object = getattr(cls, "determinism", None)
        if not isinstance(levels, Mapping) or not all(
            isinstance(k, KVCacheSpecKind) and isinstance(v, Determinism)
            for k, v in cast("Mapping[object, object]", levels).items()
        ):
            problems.append(
                f"determinism must be a mapping of KVCacheSpecKind -> Determinism, got {levels!r}"
            )
        trees: object = getattr(cls, "draft_trees", None)
        if trees is not None and not (
            isinstance(trees, DraftTreeSupport)
            and is_positive_int(trees.max_width)
            and is_positive_int(trees.max_depth)
            and isinstance(cast(object, trees.kinds), frozenset)
            and all(isinstance(k, KVCacheSpecKind) for k in cast("frozenset[object]", trees.kinds))
        ):
            problems.append(
                f"draft_trees must be None or a DraftTreeSupport with max_width, max_depth "
                f">= 1 and a frozenset of KVCacheSpecKind, got {trees!r}"
            )
        options = getattr(cls, "options_type", None)
        if options is not None and not (isinstance(options, type) and issubclass(options, BackendOptions)):
            problems.append(f"options_type must be None or a BackendOptions subclass, got {options!r}")
        if KVCacheSpecKind.MAMBA in kinds and not cls.supported_mamba_types:
            problems.append("kind mamba is declared but supported_mamba_types is empty")
        for attr in ("supported_head_sizes", "supported_block_sizes"):
            rule: object = getattr(cls, attr)
            if rule is not None and (
                not isinstance(rule, tuple)
                or not rule
                or not all(
                    isinstance(r, MultipleOf | SizeRange)
                    or is_positive_int(r)
                    for r in cast("tuple[object, ...]", rule)
                )
            ):
                problems.append(
                    f"{attr} must be None or a non-empty tuple of positive ints/MultipleOf, got {rule!r}"
                )
        return problems


