"""Serve a Hugging Face transformers model's attention through attnkit.

``attach(model, ...)`` routes every attention layer of a loaded causal LM through an
``AttentionRuntime`` and returns a ``TransformersAttachment``: the ``StepModel`` that
``attnkit.integrations.engine.Engine`` drives, one runtime step per engine step::

    from transformers import AutoModelForCausalLM
    from attnkit import AttentionConfig
    from attnkit.integrations.engine import Engine, SamplingParams
    from attnkit.integrations.transformers import attach

    model = AutoModelForCausalLM.from_pretrained("...").eval()
    attached = attach(model, config=AttentionConfig(), num_blocks=512)
    engine = Engine(attached, max_tokens_per_step=256)
    engine.add_request("a", [1, 15043, 3186], SamplingParams(max_new_tokens=32))
    print(engine.run().outputs["a"])

How it works. transformers' attention modules call the function registered for the
model's attention implementation (``AttentionInterface``) with
``query [B, Hq, T, D]``, ``key``/``value [B, Hkv, T, D]`` (after their projections,
norms and rotary embeddings), the mask and the layer's parameters as keywords
(``scaling``, ``sliding_window``, ``softcap``, ``s_aux`` for sinks). ``attach``
registers one function, ``"attnkit"``, and sets it as the model's implementation;
transformers builds no mask for an implementation it has no mask function for. Each
step the whole batch is one sequence of ``T`` tokens (batch of one) with each token's
own position in ``position_ids``, and the function hands ``[T, H, D]`` views to
``runtime.forward``; which token belongs to which request, and what it may see, is the
runtime's metadata.

Layer specs come from the model's config through ``attnkit.layout_from_hf_config``
(the same reader as ``attnkit plan``); the parameters come from what the modules pass:
``attach`` runs the model once on one token with a recording function (the probe) and
takes each layer's ``scaling``, ``softcap``, window and sinks from the call, and checks
them against the config's layout. Parameters stay in step with the module:

- sinks (gpt-oss ``s_aux``) are read on every call (copied into the runtime's float32
  buffer), so sinks changed in place or moved with ``model.to`` are never stale;
- before each step (``prepare_step``) the model's device and dtype and each attention
  module's ``scaling``, ``sliding_window`` and soft-cap are compared with what the
  runtime was built from; on a change the model is probed again and the runtime rebuilt
  (its cache is new, so the engine recomputes running requests);
- every call checks its ``scaling``, ``sliding_window`` and ``softcap`` and the query's
  dtype and device against the runtime; a mismatch raises ``StaleParametersError``
  naming the layer and both values, never a silently wrong result.

Llama 4's NoPE layers scale their queries by a function of each token's position
(attention temperature tuning, arXiv:2501.19399) that they read from the cache object
(``cache.get_seq_length``); with no transformers cache the adapter passes a stand-in
that reports each token's position.

Families: ``SUPPORTED_MODEL_TYPES``. A model with layers attnkit cannot serve this way
(state layers computed inside transformers' own modules, MLA, encoders, cross-attention)
fails in ``attach`` with ``UnsupportedModelError`` naming the layer and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import math
import re
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

import torch

from .._validation import is_positive_int
from ..config import AttentionConfig
from ..devices import parse_device
from ..errors import ArgumentTypeError, AttnkitError, InvalidArgumentError, StaleStepError
from ..kinds import rules_for
from ..models import LayerInfo, ModelLayout, layout_from_hf_config
from ..params import AttentionLayerParams
from ..registry import BackendRegistry
from ..runtime import AttentionRuntime, StepBatch
from ..spec import AttentionSpec, AttentionType, KVCacheSpec

__all__ = [
    "ATTENTION_IMPLEMENTATION",
    "EAGER_TOLERANCE",
    "MIN_TRANSFORMERS_VERSION",
    "SUPPORTED_MODEL_TYPES",
    "EagerCheck",
    "LayerBinding",
    "MissingDependencyError",
    "StaleParametersError",
    "TransformersAttachment",
    "UnsupportedModelError",
    "attach",
    "check_against_eager",
    "describe_layers",
    "eager_logits",
    "tiny_model",
]

_LOG = logging.getLogger(__name__)

ATTENTION_IMPLEMENTATION = "attnkit"
"""The name ``attach`` registers in transformers' ``AttentionInterface``."""

MIN_TRANSFORMERS_VERSION = (5, 0)
"""The oldest transformers release this adapter is written for (``AttentionInterface``
with per-call keyword parameters, ``set_attn_implementation``, v5 module layout)."""

SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "gemma2",
    "gemma3_text",
    "gpt_oss",
    "llama",
    "llama4_text",
    "mistral",
    "qwen2",
    "qwen3",
)
"""The ``config.model_type`` values ``attach`` serves (text causal LMs)."""

_EXTRA_HINT = "pip install 'attnkit[transformers]'"

# The keywords transformers' attention modules pass that attnkit reads; anything the
# runtime's metadata already covers (position_ids, use_cache, ...) is ignored.
_KNOWN_KWARGS = frozenset({"scaling", "sliding_window", "softcap", "s_aux", "dropout", "is_causal"})


class MissingDependencyError(AttnkitError, ImportError):
    """An optional dependency is missing or too old; the message names the extra."""


class UnsupportedModelError(AttnkitError, ValueError):
    """The model has a layer (or a convention) attnkit cannot serve through transformers'
    attention interface; the message names the layer and why."""


class StaleParametersError(AttnkitError, RuntimeError):
    """A layer's parameters (scale, window, soft-cap, dtype, device) differ from those
    the runtime was built with; the message names the layer and both values."""


# --------------------------------------------------------------------------- transformers


def _transformers() -> Any:
    """transformers, imported on first use; a clear error when it is missing or old."""
    try:
        module = importlib.import_module("transformers")
    except ImportError as exc:
        raise MissingDependencyError(
            f"attnkit.integrations.transformers needs the transformers package "
            f"(>= {'.'.join(map(str, MIN_TRANSFORMERS_VERSION))}): {_EXTRA_HINT}"
        ) from exc
    version = str(getattr(module, "__version__", "0"))
    found = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    if found < MIN_TRANSFORMERS_VERSION:
        raise MissingDependencyError(
            f"attnkit.integrations.transformers needs transformers >= "
            f"{'.'.join(map(str, MIN_TRANSFORMERS_VERSION))}, found {version}: "
            f"pip install -U 'attnkit[transformers]'"
        )
    return module


_HANDLERS: weakref.WeakKeyDictionary[torch.nn.Module, _Handler] = weakref.WeakKeyDictionary()
"""Attention module -> who serves it (the probe, or an attachment)."""


class _Handler(Protocol):
    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: object,
        kwargs: Mapping[str, object],
    ) -> torch.Tensor: ...


def _attention_function(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: object,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``"attnkit"``: finds the module's handler."""
    handler = _HANDLERS.get(module)
    if handler is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} (layer_idx={getattr(module, 'layer_idx', '?')}) called "
            f"attention implementation {ATTENTION_IMPLEMENTATION!r} but is not attached: "
            f"attach the model with attnkit.integrations.transformers.attach(model, ...)"
        )
    return handler(module, query, key, value, attention_mask, kwargs), None


def _register(tf: Any) -> None:
    interface = tf.AttentionInterface
    interface.register(ATTENTION_IMPLEMENTATION, _attention_function)


# --------------------------------------------------------------------------- the probe


@dataclasses.dataclass(frozen=True)
class _Call:
    """What one attention module passed on the probe's call."""

    name: str
    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    v_head_size: int
    scaling: float | None
    sliding_window: int | None
    softcap: float | None
    has_sinks: bool
    dtype: torch.dtype
    device: torch.device


def _number(kwargs: Mapping[str, object], key: str) -> float | None:
    value = kwargs.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UnsupportedModelError(
            f"the attention call passed {key}={value!r}; attnkit needs a number or None"
        )
    return float(value)


def _window(kwargs: Mapping[str, object]) -> int | None:
    value = kwargs.get("sliding_window")
    if value is None:
        return None
    if not is_positive_int(value):
        raise UnsupportedModelError(
            f"the attention call passed sliding_window={value!r}; attnkit needs an int >= 1 or None"
        )
    return int(str(value))


class _PositionsCache:
    """Stands in for a transformers cache where a module reads positions from it.

    Llama 4's NoPE layers compute ``arange(T) + cache.get_seq_length(layer)`` as the
    tokens' positions; returning ``positions - arange(T)`` makes that each token's own
    position in its request. ``update`` returns the step's keys and values unchanged
    (attnkit's runtime holds the cache).
    """

    def __init__(self, positions: torch.Tensor) -> None:
        self._offsets = positions - torch.arange(positions.numel(), device=positions.device)

    def get_seq_length(self, layer_idx: int | None = 0) -> torch.Tensor:
        return self._offsets

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return key_states, value_states


# --------------------------------------------------------------------------- attachment


@dataclasses.dataclass
class LayerBinding:
    """One attention module and the runtime layer that serves it.

    Attributes:
        name: the module's name in the model (``model.layers.0.self_attn``), also the
            runtime's layer name.
        layer_idx: the module's ``layer_idx``.
        info: the layer as ``layout_from_hf_config`` reads it from the config.
        spec: the layer's cache spec.
        params: the runtime's parameters of the layer.
        sinks: the float32 ``[Hq]`` buffer the runtime reads the sinks from (refilled
            from ``s_aux`` on every call), or ``None``.
    """

    name: str
    layer_idx: int
    info: LayerInfo
    spec: AttentionSpec
    params: AttentionLayerParams
    sinks: torch.Tensor | None


class _StepLogits(Protocol):
    @property
    def start(self) -> int: ...
    @property
    def logits(self) -> torch.Tensor: ...


class _Step(Protocol):
    @property
    def logits(self) -> Mapping[str, _StepLogits] | None: ...


class _Result(Protocol):
    @property
    def tokens(self) -> Mapping[str, list[int]]: ...
    @property
    def steps(self) -> Sequence[_Step]: ...


class TransformersAttachment:
    """A transformers model attached to an ``AttentionRuntime`` (made by ``attach``).

    It is the ``StepModel`` the engine drives: ``prepare_step()`` returns the runtime
    (rebuilt when the model moved or its attention parameters changed), and
    ``attached(batch, token_ids, positions)`` runs the model on one step and returns
    the logits ``[T, V]``.

    Attributes:
        model: the transformers model.
        layout: the config's layout (``layout_from_hf_config``).
        layers: runtime layer name -> ``LayerBinding``, in model order.
        rebuilds: how many times the runtime was rebuilt after a change.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        config: AttentionConfig,
        num_blocks: int | None,
        memory_budget_bytes: int | None,
        block_size: int,
        registry: BackendRegistry | None,
        cache_fill: float | None,
    ) -> None:
        self._tf = _transformers()
        self.model = model
        self.config = config
        self._num_blocks = num_blocks
        self._budget = memory_budget_bytes
        self._block_size = block_size
        self._registry = registry
        self._cache_fill = cache_fill
        model_config: Any = getattr(model, "config", None)
        self.model_type = str(getattr(model_config, "model_type", ""))
        self._previous_impl: object = getattr(model_config, "_attn_implementation", None)
        self._active = False
        self._detached = False
        self._probing: dict[torch.nn.Module, _Call] | None = None
        named = _named_modules(model)
        self._names: dict[int, str] = {id(m): n for n, m in named}
        self._modules: dict[str, torch.nn.Module] = {
            n: m for n, m in named if _looks_like_attention(m)
        }
        self._positions_keyword = (
            _positions_keyword(model) if self.model_type == "llama4_text" else None
        )
        self.rebuilds = 0
        _register(self._tf)
        _set_implementation(model, ATTENTION_IMPLEMENTATION)
        try:
            self._build()
        except BaseException:
            self.detach()
            raise

    # ------------------------------------------------------------------ building

    def _build(self) -> None:
        """Probe the model, read its layout, make the runtime; all or nothing."""
        calls = self._probe()
        first = next(iter(calls.values()))
        layout = _layout(self.model, self.model_type, first.dtype, self._block_size)
        layers = _bind(layout, calls)
        runtime = self._new_runtime(layers, first.device)
        self.dtype, self.device = first.dtype, first.device
        self.layout, self.layers, self._runtime = layout, layers, runtime
        self._fingerprint = self._current_fingerprint()

    def _probe(self) -> dict[torch.nn.Module, _Call]:
        """Run the model on one token with a recording handler; each module's call."""
        modules = list(self._modules.values())
        self._probing = {}
        for module in modules:
            _HANDLERS[module] = self._record
        try:
            positions = torch.zeros(1, dtype=torch.int64)
            self._run_model(torch.zeros(1, dtype=torch.int64), positions)
            calls = self._probing
        finally:
            self._probing = None
            for module in modules:
                _HANDLERS[module] = self._serve
        if not calls:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} ({self.model_type}) made no call to the "
                f"attention interface; attnkit serves models whose attention modules call "
                f"transformers' AttentionInterface"
            )
        missing = [self._names.get(id(m), "?") for m in modules if m not in calls]
        if missing:
            raise UnsupportedModelError(
                f"attention modules {missing} did not call the attention interface on a "
                f"forward pass; attnkit cannot serve them"
            )
        return calls

    def _record(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: object,
        kwargs: Mapping[str, object],
    ) -> torch.Tensor:
        name = self._names.get(id(module), type(module).__name__)
        probing = self._probing
        assert probing is not None  # handlers point here only while _probe runs
        _check_call(name, query, key, value, attention_mask, kwargs)
        sinks = kwargs.get("s_aux")
        probing[module] = _Call(
            name=name,
            layer_idx=_layer_idx(name, module),
            num_heads=query.shape[1],
            num_kv_heads=key.shape[1],
            head_size=query.shape[-1],
            v_head_size=value.shape[-1],
            scaling=_number(kwargs, "scaling"),
            sliding_window=_window(kwargs),
            softcap=_number(kwargs, "softcap"),
            has_sinks=isinstance(sinks, torch.Tensor),
            dtype=query.dtype,
            device=query.device,
        )
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])

    def _new_runtime(
        self, layers: Mapping[str, LayerBinding], device: torch.device
    ) -> AttentionRuntime:
        specs: dict[str, KVCacheSpec] = {n: b.spec for n, b in layers.items()}
        params = {n: b.params for n, b in layers.items()}

        def build(budget: int) -> AttentionRuntime:
            return AttentionRuntime(
                specs,
                self.config,
                device=device,
                memory_budget_bytes=budget,
                layer_params=params,
                registry=self._registry,
                cache_fill=self._cache_fill,
            )

        if self._budget is not None:
            return build(self._budget)
        assert self._num_blocks is not None  # attach() checked that one of them is given
        # The bytes a block costs depend on the cache layouts the selected backends
        # declare: size a two-block runtime first, then the real one.
        page = max(spec.page_size_bytes for spec in specs.values())
        small = build(2 * page * len(specs))
        report = small.memory_report()
        per_block = report.page_size_bytes * sum(report.buffers.values())
        if self._num_blocks == small.num_blocks:
            return small
        del small
        return build(self._num_blocks * per_block)

    def _current_fingerprint(self) -> tuple[object, ...]:
        """What the runtime was built from and a change of which rebuilds it."""
        first = next(self.model.parameters(), None)
        items: list[object] = [
            None if first is None else (first.device, first.dtype),
            getattr(getattr(self.model, "config", None), "sliding_window", None),
        ]
        for name in self.layers:
            module = self._modules[name]
            sinks = getattr(module, "sinks", None)
            items.append(
                (
                    getattr(module, "scaling", None),
                    getattr(module, "sliding_window", None),
                    getattr(module, "attn_logit_softcapping", None),
                    (sinks.device, sinks.dtype) if isinstance(sinks, torch.Tensor) else None,
                    next(module.parameters(), torch.empty(0)).dtype,
                )
            )
        return tuple(items)

    # ------------------------------------------------------------------ StepModel

    @property
    def runtime(self) -> AttentionRuntime:
        """The current runtime (``prepare_step`` may replace it)."""
        return self._runtime

    def prepare_step(self) -> AttentionRuntime:
        """The runtime for the next step: rebuilt first when the model changed since
        (device, dtype, a module's scale, window or soft-cap).

        A rebuilt runtime has an empty cache: the requests the old one held must be
        computed again (the engine does so when it sees a new runtime).
        """
        if self._detached:
            raise StaleStepError(
                f"{type(self.model).__name__} was detached from attnkit; attach it again"
            )
        now = self._current_fingerprint()
        if now != self._fingerprint:
            before = (self.device, self.dtype)
            self._build()
            self.rebuilds += 1
            _LOG.info(
                "attnkit: %s changed since its runtime was built (device, dtype %s -> %s); "
                "rebuilt the runtime, requests it held recompute",
                type(self.model).__name__,
                before,
                (self.device, self.dtype),
            )
        return self._runtime

    def __call__(
        self, batch: StepBatch, token_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Run the model on one step: ``token_ids``/``positions`` ``[T]`` in
        ``batch.order``; returns the logits ``[T, V]`` (float, on the model's device)."""
        if token_ids.shape != (batch.num_tokens,) or positions.shape != (batch.num_tokens,):
            raise InvalidArgumentError(
                f"token_ids and positions must be [T] with T={batch.num_tokens} (the step's "
                f"tokens), got {list(token_ids.shape)} and {list(positions.shape)}"
            )
        self._active = True
        try:
            logits = self._run_model(token_ids, positions)
        finally:
            self._active = False
        return logits[0]

    def _run_model(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ids = token_ids.to(self._model_device()).view(1, -1)
        pos = positions.to(self._model_device()).view(1, -1)
        kwargs: dict[str, object] = {"input_ids": ids, "position_ids": pos, "use_cache": False}
        if self._positions_keyword == "cache_position":
            kwargs["cache_position"] = pos[0]
        elif self._positions_keyword is not None:
            kwargs[self._positions_keyword] = _PositionsCache(pos[0])
        with torch.no_grad():
            out = self.model(**kwargs)
        logits = getattr(out, "logits", None)
        if not isinstance(logits, torch.Tensor):
            raise UnsupportedModelError(
                f"{type(self.model).__name__} returned no logits; attach a causal LM "
                f"(AutoModelForCausalLM)"
            )
        return logits

    def _model_device(self) -> torch.device:
        first = next(self.model.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    # ------------------------------------------------------------------ serving

    def _serve(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: object,
        kwargs: Mapping[str, object],
    ) -> torch.Tensor:
        name = self._names.get(id(module), type(module).__name__)
        if not self._active:
            raise StaleStepError(
                f"{name}: this model is attached to attnkit and runs only in engine steps "
                f"(Engine(attached).run(), or attached(batch, token_ids, positions) after "
                f"runtime.begin_step); call attached.detach() to use it on its own"
            )
        binding = self.layers[name]
        _check_call(name, query, key, value, attention_mask, kwargs)
        self._check_parameters(binding, query, kwargs)
        if binding.sinks is not None:
            sinks = kwargs["s_aux"]
            assert isinstance(sinks, torch.Tensor)  # _check_parameters checked it
            binding.sinks.copy_(sinks.detach())
        q = query[0].transpose(0, 1)
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
        out = self._runtime.forward(name, q.contiguous(), k.contiguous(), v.contiguous())
        return out.unsqueeze(0)

    def _check_parameters(
        self, binding: LayerBinding, query: torch.Tensor, kwargs: Mapping[str, object]
    ) -> None:
        """The call's parameters must be the runtime's (else: stale, say so)."""
        p, spec, name = binding.params, binding.spec, binding.name
        expected_window = rules_for(spec).mask(spec).window
        given_scale = _number(kwargs, "scaling")
        checks: list[tuple[str, object, object]] = [
            ("scaling", spec.head_size**-0.5 if given_scale is None else given_scale, p.scale),
            ("sliding_window", _window(kwargs), expected_window),
            ("softcap", _number(kwargs, "softcap"), p.logits_soft_cap),
            ("s_aux (sinks)", isinstance(kwargs.get("s_aux"), torch.Tensor), p.sinks is not None),
            ("query dtype", query.dtype, spec.dtype),
            ("query device", query.device, self._runtime.device),
        ]
        for what, given, built in checks:
            if given != built:
                raise StaleParametersError(
                    f"{name}: the module passed {what}={given!r}, the runtime was built with "
                    f"{built!r}; call prepare_step() before each step (the engine does), or "
                    f"refresh() to rebuild the runtime"
                )

    def refresh(self) -> AttentionRuntime:
        """Probe the model again and rebuild the runtime, whatever changed (its cache
        starts empty)."""
        self._build()
        self.rebuilds += 1
        return self._runtime

    def detach(self) -> None:
        """Give the model back its previous attention implementation; the attachment
        (and its runtime's cache) is not usable afterwards."""
        self._detached = True
        for module in list(_HANDLERS):
            if id(module) in self._names:
                del _HANDLERS[module]
        previous = self._previous_impl
        if isinstance(previous, str) and previous != ATTENTION_IMPLEMENTATION:
            _set_implementation(self.model, previous)

    @contextlib.contextmanager
    def eager(self) -> Generator[torch.nn.Module, None, None]:
        """The model on transformers' own ``"eager"`` attention for the block (for
        reference runs), then attnkit's again."""
        _set_implementation(self.model, "eager")
        try:
            yield self.model
        finally:
            _set_implementation(self.model, ATTENTION_IMPLEMENTATION)


def _named_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``model.named_modules()`` as a typed list (torch leaves its ``memo`` parameter
    unannotated, so pyright sees the method as partially unknown)."""
    named = cast("Iterator[tuple[str, torch.nn.Module]]", model.named_modules())
    return list(named)


# torch.manual_seed, typed (pyright: partially unknown in torch's stubs).
_manual_seed: Callable[[int], object] = torch.manual_seed  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]


def _set_implementation(model: Any, name: str) -> None:
    """``model.set_attn_implementation(name)`` (a transformers method; torch types module
    attributes as tensors or modules, so the model is ``Any`` here)."""
    model.set_attn_implementation(name)


def _positions_keyword(model: torch.nn.Module) -> str:
    """How Llama 4's NoPE layers get each token's position: transformers 5.0 reads
    ``cache_position`` (passed as the positions themselves), later releases read the
    cache object (``cache``, before that ``past_key_values``: the stand-in)."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("cache_position", "cache", "past_key_values"):
        if name in parameters:
            return name
    raise UnsupportedModelError(
        f"{type(model).__name__}.forward takes none of 'cache_position', 'cache', "
        f"'past_key_values'; attnkit passes Llama 4's NoPE layers their positions through one"
    )


def _looks_like_attention(module: torch.nn.Module) -> bool:
    """An attention module of the supported families: it has ``layer_idx`` and the
    q/k/v/o projections."""
    return hasattr(module, "layer_idx") and all(
        isinstance(getattr(module, p, None), torch.nn.Module)
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    )


def _layer_idx(name: str, module: torch.nn.Module) -> int:
    index = getattr(module, "layer_idx", None)
    if not isinstance(index, int) or isinstance(index, bool):
        raise UnsupportedModelError(f"{name}: the attention module has no int layer_idx")
    return index


def _check_call(
    name: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: object,
    kwargs: Mapping[str, object],
) -> None:
    """What every call must look like for attnkit to serve it."""
    if attention_mask is not None:
        raise UnsupportedModelError(
            f"{name}: transformers passed an attention mask; attnkit's runtime masks from "
            f"its own metadata and serves calls without one (pass no attention_mask)"
        )
    dropout = kwargs.get("dropout", 0.0)
    if dropout not in (0, 0.0, None):
        raise UnsupportedModelError(
            f"{name}: attention dropout {dropout!r}; attnkit serves inference: call model.eval()"
        )
    if kwargs.get("is_causal", True) is False:
        raise UnsupportedModelError(
            f"{name}: a bidirectional (is_causal=False) attention call; attnkit serves "
            f"causal decoder attention through transformers"
        )
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.shape[0] != 1:
        raise UnsupportedModelError(
            f"{name}: expected query/key/value [1, H, T, D], got {list(query.shape)}, "
            f"{list(key.shape)}, {list(value.shape)}"
        )


def _layout(
    model: torch.nn.Module, model_type: str, dtype: torch.dtype, block_size: int
) -> ModelLayout:
    config: Any = getattr(model, "config", None)
    data: dict[str, object] = dict(config.to_dict())
    if model_type == "llama4_text":
        # layout_from_hf_config reads Llama 4 from the multimodal config's text_config.
        data = {"model_type": "llama4", "text_config": data}
    return layout_from_hf_config(data, dtype=dtype, block_size=block_size)


def _unservable(info: LayerInfo) -> str | None:
    """Why attnkit cannot serve a layer through transformers' attention calls."""
    if info.state is not None:
        return (
            f"a {info.state.mamba_type} state layer, which transformers computes inside its "
            f"own module (it calls no attention function attnkit could serve)"
        )
    if info.mla is not None:
        return (
            "multi-head latent attention: transformers attends over up-projected keys and "
            "values, attnkit's MLA cache holds the compressed latent"
        )
    if info.attn_type is not AttentionType.DECODER:
        kind = info.attn_type.value if info.attn_type is not None else "unknown"
        return f"{kind} attention (attnkit serves causal decoder attention here)"
    rules = rules_for(info.spec)
    mask = rules.mask(info.spec)
    # Served: causal decoder attention over per-head K/V written each step, with at most
    # a window or a chunk (transformers' sink tokens and latents are not attnkit's).
    if rules.latent or mask.bidirectional or mask.sink_len or rules.writes != "step":
        return f"a {info.spec.kind.value} layer"
    return None


def _bind(layout: ModelLayout, calls: Mapping[torch.nn.Module, _Call]) -> dict[str, LayerBinding]:
    """Pair each probed module with its layout layer (by layer index) and build its
    parameters from what the module passed; disagreements are errors."""
    by_index: dict[int, LayerInfo] = {}
    for layer_name, info in layout.layers.items():
        why = _unservable(info)
        if why is not None:
            raise UnsupportedModelError(f"{layer_name} is {why}")
        found = re.search(r"\.(\d+)\.self_attn$", layer_name)
        if found is None:
            raise UnsupportedModelError(f"{layer_name}: cannot tell its layer index")
        by_index[int(found.group(1))] = info
    bound: dict[str, LayerBinding] = {}
    for call in sorted(calls.values(), key=lambda c: c.layer_idx):
        found_info = by_index.get(call.layer_idx)
        if found_info is None or not isinstance(found_info.spec, AttentionSpec):
            raise UnsupportedModelError(
                f"{call.name} (layer_idx={call.layer_idx}) is not an attention layer of the "
                f"config's layout ({', '.join(layout.layers)})"
            )
        info, spec = found_info, found_info.spec
        facts = [
            ("query heads", call.num_heads, info.num_heads),
            ("key/value heads", call.num_kv_heads, spec.num_kv_heads),
            ("head size", call.head_size, spec.head_size),
            ("value head size", call.v_head_size, spec.head_size),
            ("sliding_window", call.sliding_window, rules_for(spec).mask(spec).window),
            ("sinks", call.has_sinks, info.has_sinks),
        ]
        for what, given, config_says in facts:
            if given != config_says:
                raise UnsupportedModelError(
                    f"{call.name}: the module attends with {what}={given!r}, the config says "
                    f"{config_says!r}; attnkit cannot serve a layer whose call and config "
                    f"disagree"
                )
        sinks = (
            torch.zeros(call.num_heads, dtype=torch.float32, device=call.device)
            if call.has_sinks
            else None
        )
        scale = call.scaling if call.scaling is not None else spec.head_size**-0.5
        params = AttentionLayerParams(
            num_heads=call.num_heads, scale=scale, logits_soft_cap=call.softcap, sinks=sinks
        )
        bound[call.name] = LayerBinding(call.name, call.layer_idx, info, spec, params, sinks)
    return bound


# --------------------------------------------------------------------------- attach


def attach(
    model: torch.nn.Module,
    *,
    config: AttentionConfig | None = None,
    num_blocks: int | None = None,
    memory_budget_bytes: int | None = None,
    block_size: int = 16,
    device: torch.device | str | None = None,
    registry: BackendRegistry | None = None,
    cache_fill: float | None = None,
) -> TransformersAttachment:
    """Route a transformers causal LM's attention through an ``AttentionRuntime``.

    Args:
        model: a loaded model of a family in ``SUPPORTED_MODEL_TYPES``
            (``AutoModelForCausalLM``), in eval mode.
        config: backend choices and engine limits (default ``AttentionConfig()``).
        num_blocks: cache blocks of the pool, the null block included; or
        memory_budget_bytes: bytes for the cache (exactly one of the two).
        block_size: tokens per cache block.
        device: where the model runs; it must be where it is (default: there).
        registry, cache_fill: as for ``AttentionRuntime``.

    Returns:
        The ``TransformersAttachment``: ``Engine(attached)`` serves requests.

    Raises:
        MissingDependencyError: transformers is missing (``pip install
            'attnkit[transformers]'``) or too old.
        UnsupportedModelError: a family or a layer attnkit cannot serve (the message
            names the layer and why).
        InvalidArgumentError: bad arguments (named in the message).
    """
    tf = _transformers()
    given: object = model  # untyped callers may pass anything
    if not isinstance(given, tf.PreTrainedModel):
        raise ArgumentTypeError(
            f"model must be a transformers PreTrainedModel, got {type(given).__name__}"
        )
    model_type = str(getattr(model.config, "model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(_family_problem(model, model_type))
    if config is None:
        config = AttentionConfig()
    if not isinstance(config, AttentionConfig):
        raise ArgumentTypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
    if (num_blocks is None) == (memory_budget_bytes is None):
        raise InvalidArgumentError(
            f"give exactly one of num_blocks and memory_budget_bytes, got num_blocks="
            f"{num_blocks!r}, memory_budget_bytes={memory_budget_bytes!r}"
        )
    if num_blocks is not None and (not is_positive_int(num_blocks) or num_blocks < 2):
        raise InvalidArgumentError(
            f"num_blocks must be an int >= 2 (the null block and one more), got {num_blocks!r}"
        )
    if not is_positive_int(block_size):
        raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
    if model.training:
        raise InvalidArgumentError(
            "model is in training mode (dropout on); call model.eval() before attach()"
        )
    first = next(model.parameters(), None)
    where = first.device if first is not None else torch.device("cpu")
    if device is not None:
        wanted = parse_device(device)
        same = wanted.type == where.type and wanted.index in (None, where.index)
        if not same:
            raise InvalidArgumentError(
                f"device={device!r}, but the model is on {where}: move it first "
                f"(model.to({str(wanted)!r})) or leave device unset"
            )
    attached = TransformersAttachment(
        model,
        config=config,
        num_blocks=num_blocks,
        memory_budget_bytes=memory_budget_bytes,
        block_size=block_size,
        registry=registry,
        cache_fill=cache_fill,
    )
    return attached


def _family_problem(model: torch.nn.Module, model_type: str) -> str:
    """Why a model of an unsupported family cannot be attached, naming a layer when the
    config's layout can say which."""
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    base = f"model_type {model_type!r} ({type(model).__name__}) is not served by attach()"
    try:
        layout = _layout(model, model_type, torch.float32, 16)
    except AttnkitError:
        return f"{base}; supported: {supported}"
    for name, info in layout.layers.items():
        why = _unservable(info)
        if why is not None:
            return f"{base}: layer {name} is {why}; supported: {supported}"
    return (
        f"{base} (its attention conventions are not checked against eager); supported: {supported}"
    )


# --------------------------------------------------------------------------- checks


def eager_logits(attached: TransformersAttachment, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits ``[n, V]`` (float32, CPU) of one sequence on transformers' eager attention."""
    with attached.eager() as model, torch.no_grad():
        device = attached._model_device()
        out = model(input_ids=torch.tensor([list(token_ids)], device=device), use_cache=False)
    logits: torch.Tensor = out.logits[0]
    return logits.float().cpu()


EAGER_TOLERANCE: Mapping[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}
"""Largest ``|logit - eager logit|`` ``check_against_eager`` accepts, as a fraction of
``max(1, largest |eager logit|)``: float32 at the attnkit tolerance table's 1e-4; 16-bit
logits are themselves rounded to a few ulps of the largest (bfloat16 keeps 8 bits)."""


@dataclasses.dataclass(frozen=True)
class EagerCheck:
    """The outcome of ``check_against_eager``.

    Attributes:
        max_error: largest ``|logit - eager logit|`` over every step and request.
        max_logit: largest ``|eager logit|`` seen (the scale of the logits).
        tolerance: the bound ``max_error`` was held to.
        rows: logit rows compared.
    """

    max_error: float
    max_logit: float
    tolerance: float
    rows: int

    @property
    def passed(self) -> bool:
        return self.max_error <= self.tolerance


def check_against_eager(attached: TransformersAttachment, result: _Result) -> EagerCheck:
    """Compare every step of an engine run (made with ``keep_logits=True``) with
    transformers' eager attention: each request's sequence runs once through eager
    attention, and each step's rows are compared with the rows of the same positions.

    Raises:
        InvalidArgumentError: the run kept no logits.
    """
    worst = largest = 0.0
    rows_seen = 0
    reference: dict[str, torch.Tensor] = {}
    for step in result.steps:
        if step.logits is None:
            raise InvalidArgumentError(
                "check_against_eager: the run kept no logits; make the Engine with keep_logits=True"
            )
        for req_id, rows in step.logits.items():
            if req_id not in reference:
                # The last sampled token was never fed to the model.
                reference[req_id] = eager_logits(attached, result.tokens[req_id][:-1])
            got = rows.logits.float().cpu()
            expected = reference[req_id][rows.start : rows.start + got.shape[0]]
            worst = max(worst, float((got - expected).abs().max()))
            largest = max(largest, float(expected.abs().max()))
            rows_seen += got.shape[0]
    tolerance = EAGER_TOLERANCE[attached.dtype] * max(1.0, largest)
    return EagerCheck(worst, largest, tolerance, rows_seen)


# --------------------------------------------------------------------------- tiny models


def tiny_model(
    model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """A tiny random-weight causal LM of a supported family (no download), with a short
    window and chunk so a few dozen tokens cross them; weights drawn with ``seed``.

    Raises:
        InvalidArgumentError: ``model_type`` not in ``SUPPORTED_MODEL_TYPES``.
    """
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise InvalidArgumentError(
            f"model_type must be one of {', '.join(SUPPORTED_MODEL_TYPES)}, got {model_type!r}"
        )
    tf = _transformers()
    common: dict[str, object] = {
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "initializer_range": 0.2,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    window: dict[str, object] = {"sliding_window": 6}
    two_kinds: dict[str, object] = {"layer_types": ["sliding_attention", "full_attention"]}
    configs: dict[str, tuple[str, dict[str, object]]] = {
        "llama": ("LlamaConfig", {}),
        "mistral": ("MistralConfig", window),
        "qwen2": (
            "Qwen2Config",
            {**window, "use_sliding_window": True, "max_window_layers": 1},
        ),
        "qwen3": ("Qwen3Config", {**window, "use_sliding_window": True, "max_window_layers": 1}),
        "gemma2": (
            "Gemma2Config",
            {**window, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0},
        ),
        "gemma3_text": (
            "Gemma3TextConfig",
            {**window, **two_kinds, "query_pre_attn_scalar": 24},
        ),
        "gpt_oss": (
            "GptOssConfig",
            {**window, **two_kinds, "num_local_experts": 4, "num_experts_per_tok": 2},
        ),
        "llama4_text": (
            "Llama4TextConfig",
            {
                "attention_chunk_size": 8,
                "no_rope_layers": [1, 0],
                "num_local_experts": 2,
                "intermediate_size_mlp": 64,
                "floor_scale": 4,
                "attn_scale": 0.5,
            },
        ),
    }
    class_name, extra = configs[model_type]
    config = getattr(tf, class_name)(**common, **extra)
    generator_state = torch.random.get_rng_state()
    try:
        _manual_seed(seed)
        model: torch.nn.Module = tf.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", dtype=dtype
        )
        if model_type == "gpt_oss":
            # Sinks drawn at the scale of the scores, so they visibly take softmax mass.
            with torch.no_grad():
                for module in model.modules():
                    sinks = getattr(module, "sinks", None)
                    if isinstance(sinks, torch.Tensor):
                        sinks.normal_(0.0, 1.0)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.eval()


def describe_layers(attached: TransformersAttachment) -> list[str]:
    """One line per layer: name, kind, window or chunk, scale, soft-cap, sinks."""
    lines: list[str] = []
    for name, b in attached.layers.items():
        spec = b.spec
        mask = rules_for(spec).mask(spec)
        extent = (
            f" window={mask.window}"
            if mask.window is not None
            else f" chunk={mask.chunk}"
            if mask.chunk is not None
            else ""
        )
        scale = b.params.scale if b.params.scale is not None else math.nan
        lines.append(
            f"{name}: {spec.kind.value}{extent} scale={scale:.4g}"
            + (f" softcap={b.params.logits_soft_cap:g}" if b.params.logits_soft_cap else "")
            + (" sinks" if b.sinks is not None else "")
            + f" backend={attached.runtime.backend_for(name).name}"
        )
    return lines
