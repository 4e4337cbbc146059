"""``AttentionConfig``: how an engine chooses backends.

>>> from attnkit import AttentionConfig, KVCacheSpecKind
>>> cfg = AttentionConfig.model_validate(
...     {"backend_per_kind": "sliding_window=triton_attn,full_attention=reference"},
...     context={"known_backends": ["reference", "triton_attn"]},
... )
>>> cfg.backend_per_kind[KVCacheSpecKind.SLIDING_WINDOW]
'triton_attn'

Constructing a config checks the *form* of every setting (kinds, name syntax,
limits) and imports nothing else of attnkit: whether a named backend exists is
checked by selection (``select_backend``, ``AttentionRuntime``) against the registry
it uses, or here when ``model_validate`` is given ``context={"registry": reg}`` or
``context={"known_backends": [...]}``.

Backends with settings of their own declare a ``BackendOptions`` model; users give
them per backend name, typed or as a plain mapping::

    AttentionConfig(backend_options={"flash_attn": {"version": 2}})
    AttentionConfig(backend_options={"flash_attn": FlashAttentionOptions(version=2)})

and the backend reads them typed with ``config.options_for("flash_attn",
FlashAttentionOptions)``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)
from typing_extensions import Self, override

from .capabilities import Determinism
from .errors import ArgumentTypeError
from .spec import KVCacheSpecKind

__all__ = [
    "AttentionConfig",
    "BackendOptions",
    "PrefixCachingConfig",
    "PrefixHashName",
    "StateCheckpointPolicy",
    "parse_backend_per_kind",
]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_VALID_KINDS = ", ".join(k.value for k in KVCacheSpecKind)


def parse_backend_per_kind(value: str | Mapping[str, str] | Mapping[KVCacheSpecKind, str]) -> dict[KVCacheSpecKind, str]:
    """Parse ``"kind=backend,kind=backend"`` (CLI style) or a mapping into kind -> backend.

    Raises:
        ValueError: on an unknown kind (the message lists the valid kinds), a kind
            given twice, or an entry without ``=``.
    """
    items: list[tuple[object, object]]
    if isinstance(value, str):
        items = []
        for part in (p.strip() for p in value.split(",")):
            if not part:
                continue
            if "=" not in part:
                raise ValueError(
                    f"backend_per_kind entry {part!r} must look like 'kind=backend' "
                    f"(e.g. 'sliding_window=triton_attn')"
                )
            kind, _, backend = part.partition("=")
            items.append((kind.strip(), backend.strip()))
    elif isinstance(value, Mapping):
        items = list(value.items())
    else:
        raise ValueError(
            f"backend_per_kind must be a mapping or a 'kind=backend,...' string, "
            f"got {type(value).__name__}"
        )
    parsed: dict[KVCacheSpecKind, str] = {}
    for raw_kind, raw_backend in items:
        try:
            kind = KVCacheSpecKind(raw_kind)
        except ValueError:
            raise ValueError(
                f"backend_per_kind: unknown kind {raw_kind!r}; valid kinds: {_VALID_KINDS}"
            ) from None
        if kind in parsed:
            raise ValueError(f"backend_per_kind: kind {kind.value!r} is given twice")
        if not isinstance(raw_backend, str) or not _NAME.match(raw_backend):
            raise ValueError(
                f"backend_per_kind[{kind.value!r}] must be a backend name, got {raw_backend!r}"
            )
        parsed[kind] = raw_backend
    return parsed


K = TypeVar("K")
V = TypeVar("V")


class _ReadOnly(Mapping[K, V]):
    """A validated config's mapping: read like a dict; writing to it says how to get a
    changed config instead of Python's "does not support item assignment"."""

    __slots__ = ("_field", "_items", "_shown")

    def __init__(self, shown: str, field: str, items: Mapping[K, V]) -> None:
        self._shown, self._field = shown, field
        self._items = dict(items)

    @override
    def __getitem__(self, key: K) -> V:
        return self._items[key]

    @override
    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    @override
    def __len__(self) -> int:
        return len(self._items)

    @override
    def __repr__(self) -> str:
        return repr(self._items)

    def _refuse(self, *_: object) -> NoReturn:
        raise ArgumentTypeError(
            f"AttentionConfig.{self._shown} is read-only (a validated config is frozen); "
            f"make a changed copy instead: config.model_copy(update={{{self._field!r}: ...}}) "
            "validates the new value as the constructor does"
        )

    __setitem__ = __delitem__ = _refuse
    pop = popitem = clear = update = setdefault = _refuse


def _context(info: ValidationInfo) -> Mapping[str, Any]:
    raw: object = info.context
    return cast("Mapping[str, Any]", raw) if isinstance(raw, Mapping) else {}


def _known_backends(info: ValidationInfo) -> Collection[str] | None:
    """The names to check against, when the validation context gives them."""
    context = _context(info)
    known = context.get("known_backends")
    if known is not None:
        return frozenset(known)
    registry = context.get("registry")
    if registry is not None:
        names: Collection[str] = registry.names()
        return names
    return None


def _check_name(name: str, what: str, info: ValidationInfo) -> None:
    if not _NAME.match(name):
        raise ValueError(f"{what} must be a backend name, got {name!r}")
    known = _known_backends(info)
    if known is not None and name not in known:
        # A plugin that failed to load is not "unknown": say what it raised. (The
        # registry is read by duck typing: config sits below the registry's layer.)
        failures: object = getattr(_context(info).get("registry"), "failures", None)
        failed = cast("Mapping[str, str]", failures() if callable(failures) else {})
        if name in failed:
            raise ValueError(f"{what}: backend {name!r} failed to load: {failed[name]}")
        listed = ", ".join(sorted(known)) or "none"
        raise ValueError(f"{what}: unknown backend {name!r}; registered backends: {listed}")


class BackendOptions(BaseModel):
    """Base of a backend's own settings: a frozen pydantic model, unknown fields rejected.

    A backend declares ``options_type = MyOptions``; users give
    ``AttentionConfig(backend_options={"my_backend": {...}})`` and the backend reads
    ``config.options_for("my_backend", MyOptions)``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")


OptionsT = TypeVar("OptionsT", bound=BackendOptions)

PrefixHashName = Literal["sha256", "xxh3_128"]
"""The hashes a prefix-cache block name can be made with (``attnkit.prefix_cache``'s
``HashName``; a test keeps the two equal)."""

StateCheckpointPolicy = Literal["none", "step_end", "every_block"]
"""When a state layer's state is kept for later hits (``PrefixCachingConfig``)."""


class PrefixCachingConfig(BaseModel):
    """Prefix caching: requests that share a prompt prefix share its KV-cache blocks
    (docs/prefix-caching.md).

    Attributes:
        enabled: cache full blocks by content and let ``match_prefix`` hit them. Off by
            default in the runtime: with it off nothing is hashed or counted.
        hash: the hash block names are made with: ``"sha256"`` (the default,
            cryptographic) or ``"xxh3_128"`` (faster, for trusted prompts only; needs
            ``pip install 'attnkit[xxhash]'``).
        model_revision: the model and weights the cache was computed with, in every
            group's namespace (a weight update without a new runtime calls
            ``reset_prefix_cache()`` instead).
        state_checkpoints: when state layers (Mamba, Gated DeltaNet, linear attention,
            short conv) keep a copy of a request's state for later hits: ``"none"``
            (state layers never hit, so neither does a model that has them),
            ``"step_end"`` (a step that ends a prompt's tokens on a checkpoint boundary
            copies the state; ``Engine`` ends prefill chunks on boundaries) or
            ``"every_block"`` (refused: one varlen forward gives no state after a
            step's interior positions; docs/prefix-caching.md says why).
        checkpoint_interval: the tokens between checkpoint boundaries; a multiple of
            every attention group's kernel block size (checked when the runtime is
            built). ``None``: the least common multiple of those block sizes (the
            model's minimum cacheable prefix).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(default=False, strict=True)
    hash: PrefixHashName = "sha256"
    model_revision: str = Field(default="", strict=True)
    state_checkpoints: StateCheckpointPolicy = "none"
    checkpoint_interval: int | None = Field(default=None, strict=True)

    @field_validator("checkpoint_interval")
    @classmethod
    def _positive_interval(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"checkpoint_interval must be an int >= 1 or None, got {value!r}")
        return value

    @field_validator("state_checkpoints")
    @classmethod
    def _supported_policy(cls, value: StateCheckpointPolicy) -> StateCheckpointPolicy:
        if value == "every_block":
            raise ValueError(
                "state_checkpoints='every_block' is not supported: a state layer's varlen "
                "forward gives each request's state after its step's last token only, not "
                "after the boundaries inside the step; use 'step_end' (Engine ends prefill "
                "chunks on checkpoint boundaries, so every chunk leaves one)"
            )
        return value

    def describe(self) -> str:
        """``on (sha256, revision 'r1')`` or ``off``."""
        if not self.enabled:
            return "off"
        revision = f", revision {self.model_revision!r}" if self.model_revision else ""
        states = ""
        if self.state_checkpoints != "none":
            every = f" every {self.checkpoint_interval}" if self.checkpoint_interval else ""
            states = f", state checkpoints {self.state_checkpoints}{every}"
        return f"on ({self.hash}{revision}{states})"


DEFAULT_MAX_NUM_REQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_MODEL_LEN = 32768
MAX_DRAFT_TREE_TOKENS = 63
"""The most draft tokens of a request's draft tree: a token's ancestors among them are
one int64 bitmask (``DraftTreeMask.ancestors``)."""
DEFAULT_MAX_MM_PREFIX_RANGES = 8


class AttentionConfig(BaseModel):
    """Backend choice for a model.

    Attributes:
        backend: a backend for every kind it declares it serves (kinds it does not
            serve fall through to the device's priority list, with the reason kept).
        backend_per_kind: kind -> backend; wins over ``backend`` for that kind.
            Accepts ``{"sliding_window": "triton_attn"}`` or
            ``"sliding_window=triton_attn,full_attention=reference"``.
        backend_options: backend name -> that backend's own settings (its
            ``BackendOptions`` model, or a mapping validated into it when the backend
            reads it; e.g. ``{"flash_attn": {"version": 2}}``).
        plugins: allowlist of entry-point plugin backends that may be loaded for
            this config (``None``: every plugin the environment allows; see
            ``ATTNKIT_PLUGINS``).
        max_num_reqs, max_num_batched_tokens, max_model_len: the engine's limits per
            step and per request; builders size their fixed-address (CUDA-graph)
            buffers from them.
        prefix_caching: a ``PrefixCachingConfig`` (or a mapping of its fields, e.g.
            ``{"enabled": True}``); off by default.
        determinism: the reproducibility level every layer's backend must keep (a
            ``Determinism`` or its name, e.g. ``"batch_invariant"``; default ``none``).
            Selection refuses a backend declaring less for the kind, with the reason,
            and builders take their invariant paths (docs/determinism.md).
        num_speculative_tokens: the most draft tokens a request may bring to one
            step (``ScheduledRequest.num_draft_tokens``; docs/speculative.md); state
            layers keep that many extra states per request for ``accept``. 0: none.
        draft_tree_width: the most draft tokens at one depth of a request's draft
            tree (``ScheduledRequest.draft_parents``; docs/speculative.md, "Draft
            trees"); a tree's depth is at most ``num_speculative_tokens``. 1 (the
            default): drafts are chains. Above 1, selection refuses backends that do not
            declare draft trees for the kind (``AttentionBackend.draft_trees``), and
            ``num_speculative_tokens`` must be in ``draft_tree_width .. 63`` (a token's
            ancestors are one int64 bitmask).
        max_mm_prefix_ranges: the most bidirectional image ranges one request may
            bring (``ScheduledRequest.mm_prefix_ranges``); the metadata of a group
            whose layers take them (``AttentionSpec.mm_prefix``) pads every request's
            ranges to it, so its shape is fixed.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str | None = None
    # Read-only mappings (``_ReadOnly``) once validated: the model is frozen, and a
    # mutable dict inside it would let a caller bypass the validation.
    backend_per_kind: Mapping[KVCacheSpecKind, str] = Field(
        default_factory=lambda: _ReadOnly("backend_per_kind", "backend_per_kind", {})
    )
    # SerializeAsAny: dump a typed options object with its own fields, not the base's.
    backend_options: Mapping[str, SerializeAsAny[BackendOptions] | Mapping[str, Any]] = Field(
        default_factory=lambda: _ReadOnly("backend_options", "backend_options", {})
    )
    plugins: frozenset[str] | None = None
    max_num_reqs: int = Field(default=DEFAULT_MAX_NUM_REQS, ge=1)
    max_num_batched_tokens: int = Field(default=DEFAULT_MAX_NUM_BATCHED_TOKENS, ge=1)
    max_model_len: int = Field(default=DEFAULT_MAX_MODEL_LEN, ge=1)
    prefix_caching: PrefixCachingConfig = Field(default_factory=PrefixCachingConfig)
    determinism: Determinism = Determinism.NONE
    num_speculative_tokens: int = Field(default=0, ge=0)
    draft_tree_width: int = Field(default=1, ge=1)
    max_mm_prefix_ranges: int = Field(default=DEFAULT_MAX_MM_PREFIX_RANGES, ge=1)

    if TYPE_CHECKING:
        # The signature type checkers see, so that every input form the docs show
        # type-checks for users under mypy and pyright without pydantic's plugin (the
        # synthesized one would accept only the stored types). At run time pydantic's
        # own __init__ runs (a real override would drop model_validate's context); the
        # before-validators below accept the same forms, None included.
        def __init__(
            self,
            *,
            backend: str | None = None,
            backend_per_kind: str | Mapping[str, str] | Mapping[KVCacheSpecKind, str] | None = None,
            backend_options: Mapping[str, BackendOptions | Mapping[str, Any]] | None = None,
            plugins: str | Iterable[str] | None = None,
            max_num_reqs: int = DEFAULT_MAX_NUM_REQS,
            max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
            max_model_len: int = DEFAULT_MAX_MODEL_LEN,
            prefix_caching: PrefixCachingConfig | Mapping[str, Any] | None = None,
            determinism: Determinism | str = Determinism.NONE,
            num_speculative_tokens: int = 0,
            draft_tree_width: int = 1,
            max_mm_prefix_ranges: int = DEFAULT_MAX_MM_PREFIX_RANGES,
        ) -> None: ...

    @field_validator("backend_per_kind", mode="before")
    @classmethod
    def _parse_per_kind(cls, value: Any) -> dict[KVCacheSpecKind, str]:
        return {} if value is None else parse_backend_per_kind(value)

    @field_validator("plugins", mode="before")
    @classmethod
    def _parse_plugins(cls, value: Any) -> Any:
        if isinstance(value, str):
            return frozenset(p.strip() for p in value.split(",") if p.strip())
        # Unvalidated input: isinstance cannot say what the items are (pydantic checks
        # them next), hence the casts.
        if isinstance(value, Iterable) and not isinstance(value, frozenset):
            return frozenset(cast("Iterable[object]", value))
        return cast(object, value)

    @field_validator("backend_options", mode="before")
    @classmethod
    def _copy_options(cls, value: Any) -> Any:
        if value is None:
            return {}
        if isinstance(value, Mapping):
            # Unvalidated input (pydantic checks the items next), hence the casts.
            items = cast("Mapping[object, object]", value).items()
            return {
                k: dict(cast("Mapping[object, object]", v)) if isinstance(v, Mapping) else v
                for k, v in items
            }
        return value

    @field_validator("prefix_caching", mode="before")
    @classmethod
    def _default_prefix_caching(cls, value: Any) -> Any:
        return PrefixCachingConfig() if value is None else value

    @field_validator("determinism", mode="before")
    @classmethod
    def _parse_determinism(cls, value: Any) -> Determinism:
        try:
            return Determinism.parse(value)
        except ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None  # pydantic reports ValueErrors only

    @field_serializer("determinism")
    def _determinism_name(self, value: Determinism) -> str:
        return value.label

    @model_validator(mode="after")
    def _check_draft_tree(self) -> Self:
        width, k = self.draft_tree_width, self.num_speculative_tokens
        if width > 1 and not width <= k <= MAX_DRAFT_TREE_TOKENS:
            raise ValueError(
                f"draft_tree_width={width} needs num_speculative_tokens in {width}.."
                f"{MAX_DRAFT_TREE_TOKENS} (a tree of that width, its ancestors one int64 "
                f"bitmask per token), got num_speculative_tokens={k}"
            )
        return self

    @field_validator(
        "max_num_reqs", "max_num_batched_tokens", "max_model_len", "max_mm_prefix_ranges",
        mode="before",
    )
    @classmethod
    def _no_bools(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic would take True as 1.
        if isinstance(value, bool):
            raise ValueError(f"{info.field_name} must be an int >= 1, got {value!r}")
        return value

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            _check_name(value, "backend", info)
        return value

    @field_validator("backend_per_kind")
    @classmethod
    def _check_per_kind(
        cls, value: Mapping[KVCacheSpecKind, str], info: ValidationInfo
    ) -> Mapping[KVCacheSpecKind, str]:
        for kind, name in value.items():
            _check_name(name, f"backend_per_kind[{kind.value!r}]", info)
        return _ReadOnly("backend_per_kind", "backend_per_kind", value)

    @field_validator("backend_options")
    @classmethod
    def _check_options_names(
        cls, value: Mapping[str, BackendOptions | Mapping[str, Any]], info: ValidationInfo
    ) -> Mapping[str, BackendOptions | Mapping[str, Any]]:
        for name in value:
            _check_name(name, "backend_options key", info)
        return _ReadOnly(
            "backend_options",
            "backend_options",
            {
                k: _ReadOnly(f"backend_options[{k!r}]", "backend_options", v)
                if isinstance(v, Mapping)
                else v
                for k, v in value.items()
            },
        )

    @field_serializer("backend_per_kind", "backend_options")
    def _plain_mappings(self, value: Mapping[Any, Any]) -> dict[Any, Any]:
        # The read-only views are dumped as plain dicts (options models as themselves).
        plain: dict[Any, Any] = {}
        for key, item in value.items():
            # pyright narrows Any to Mapping[Unknown, Unknown]; the items are any values.
            plain[key] = dict(item) if isinstance(item, Mapping) else item  # pyright: ignore[reportUnknownArgumentType]
        return plain

    @override
    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy; with ``update``, a new config validated as the constructor validates
        (pydantic's own ``model_copy`` stores updated values unchecked), e.g.
        ``config.model_copy(update={"backend_per_kind": {"sliding_window": "reference"}})``.

        Raises:
            pydantic.ValidationError: an updated value is not valid, or names no field.
        """
        if not update:
            return super().model_copy(deep=deep)
        values = {name: getattr(self, name) for name in self.model_fields_set}
        return self.model_validate({**values, **update})

    def options_for(self, backend: str, options_type: type[OptionsT]) -> OptionsT:
        """The settings given for ``backend`` as ``options_type`` (its defaults if none).

        Raises:
            ValueError: the settings do not validate as ``options_type`` (the message
                names the backend and each bad field).
            TypeError: a ``BackendOptions`` of another class was given for ``backend``.
        """
        raw = self.backend_options.get(backend)
        if raw is None:
            return options_type()
        if isinstance(raw, options_type):
            return raw
        if isinstance(raw, BackendOptions):
            raise TypeError(
                f"backend_options[{backend!r}] is a {type(raw).__name__}; backend "
                f"{backend!r} takes {options_type.__name__}"
            )
        try:
            return options_type.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors()
            )
            raise ValueError(
                f"backend_options[{backend!r}] is not valid {options_type.__name__}: {problems}"
            ) from None

    def describe(self) -> str:
        """One line for logs: ``backend=None backend_per_kind={sliding_window: triton_attn}``."""
        per_kind = ", ".join(f"{k.value}: {v}" for k, v in self.backend_per_kind.items())
        text = f"backend={self.backend} backend_per_kind={{{per_kind}}} plugins={self.plugins}"
        if self.backend_options:
            text += f" backend_options={sorted(self.backend_options)}"
        if self.prefix_caching.enabled:
            text += f" prefix_caching={self.prefix_caching.describe()}"
        if self.determinism:
            text += f" determinism={self.determinism.label}"
        return text
