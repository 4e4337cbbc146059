"""``attach`` and ``TransformersAttachment``: the probe, the runtime built from the
probed calls, the fingerprint that rebuilds it when the model changes, the handler
that serves each attention call (its parameters checked against the runtime), and
``describe_layers``."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
from collections.abc import Generator, Iterator, Mapping
from typing import Any, Literal, cast

import torch

from ..._validation import is_positive_int
from ...config import AttentionConfig
from ...devices import parse_device
from ...errors import ArgumentTypeError, InvalidArgumentError, StaleStepError
from ...kinds import rules_for
from ...registry import BackendRegistry
from ...runtime import AttentionRuntime, StepBatch
from ...spec import KVCacheSpec
from ._families import SUPPORTED_MODEL_TYPES, family_problem
from ._interface import (
    ATTENTION_IMPLEMENTATION,
    HANDLERS,
    StaleParametersError,
    UnsupportedModelError,
    import_transformers,
    register,
    set_implementation,
)
from ._layers import LayerBinding, bind_layers, config_layout
from ._linears import PackedLinears, packing_problem
from ._probe import (
    Call,
    PositionsCache,
    check_call,
    layer_index,
    looks_like_attention,
    number_kwarg,
    positions_keyword,
    window_kwarg,
)

# The package's logger (the name users configure), not this module's.
_LOG = logging.getLogger(__package__)


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
        linears: Literal["onednn", "packed", "module"] = "module",
    ) -> None:
        self._tf = import_transformers()
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
        self._probing: dict[torch.nn.Module, Call] | None = None
        named = _named_modules(model)
        self._names: dict[int, str] = {id(m): n for n, m in named}
        self._modules: dict[str, torch.nn.Module] = {
            n: m for n, m in named if looks_like_attention(m)
        }
        self._positions_keyword = (
            positions_keyword(model) if self.model_type == "llama4_text" else None
        )
        self._keeps_logits = _logits_keyword(model)
        """The forward's keyword that computes the LM head on chosen rows only
        (``logits_to_keep``), or ``None``: the logits are cut after it."""
        self.rebuilds = 0
        self._compiled: Any = None  # torch.compile(model) after compile()
        self.linears_mode = linears
        """How its steps run the model's CPU linears: ``"module"``, ``"onednn"`` or
        ``"packed"`` (``attach``'s ``linears``, ``"auto"`` resolved)."""
        self.linears = (
            PackedLinears(model, copies=linears == "packed") if linears != "module" else None
        )
        """Unless ``linears_mode`` is ``"module"``: the oneDNN linears its steps run."""
        register(self._tf)
        set_implementation(model, ATTENTION_IMPLEMENTATION)
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
        layout = config_layout(self.model, self.model_type, first.dtype, self._block_size)
        layers = bind_layers(layout, calls)
        runtime = self._new_runtime(layers, first.device)
        self.dtype, self.device = first.dtype, first.device
        self.layout, self.layers, self._runtime = layout, layers, runtime
        self._fingerprint = self._current_fingerprint()

    def _probe(self) -> dict[torch.nn.Module, Call]:
        """Run the model on one token with a recording handler; each module's call."""
        modules = list(self._modules.values())
        self._probing = {}
        for module in modules:
            HANDLERS[module] = self._record
        try:
            positions = torch.zeros(1, dtype=torch.int64)
            self._run_model(torch.zeros(1, dtype=torch.int64), positions)
            calls = self._probing
        finally:
            self._probing = None
            for module in modules:
                HANDLERS[module] = self._serve
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
        check_call(name, query, key, value, attention_mask, kwargs)
        sinks = kwargs.get("s_aux")
        probing[module] = Call(
            name=name,
            layer_idx=layer_index(name, module),
            num_heads=query.shape[1],
            num_kv_heads=key.shape[1],
            head_size=query.shape[-1],
            v_head_size=value.shape[-1],
            scaling=number_kwarg(kwargs, "scaling"),
            sliding_window=window_kwarg(kwargs),
            softcap=number_kwarg(kwargs, "softcap"),
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
        self,
        batch: StepBatch,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the model on one step: ``token_ids``/``positions`` ``[T]`` in
        ``batch.order``; returns the logits ``[T, V]`` (float, on the model's device),
        or ``[R, V]`` of the rows ``logits_rows`` (int64 ``[R]``) names: the LM head
        runs on those rows only (transformers' ``logits_to_keep``)."""
        if token_ids.shape != (batch.num_tokens,) or positions.shape != (batch.num_tokens,):
            raise InvalidArgumentError(
                f"token_ids and positions must be [T] with T={batch.num_tokens} (the step's "
                f"tokens), got {list(token_ids.shape)} and {list(positions.shape)}"
            )
        if logits_rows is not None:
            in_range = logits_rows.numel() == 0 or (
                int(logits_rows.min()) >= 0 and int(logits_rows.max()) < batch.num_tokens
            )
            if logits_rows.dtype != torch.int64 or logits_rows.dim() != 1 or not in_range:
                raise InvalidArgumentError(
                    f"logits_rows must be int64 [R] rows of the step's {batch.num_tokens} "
                    f"tokens, got {logits_rows.dtype} {list(logits_rows.shape)}"
                    + ("" if in_range else " with a row out of range")
                )
        linears = self.linears
        if linears is not None:
            linears.refresh()
            linears.active = True
        self._active = True
        try:
            logits = self._run_model(token_ids, positions, logits_rows)
        finally:
            self._active = False
            if linears is not None:
                linears.active = False
        return logits[0]

    def _run_model(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ids = token_ids.to(self._model_device()).view(1, -1)
        pos = positions.to(self._model_device()).view(1, -1)
        kwargs: dict[str, object] = {"input_ids": ids, "position_ids": pos, "use_cache": False}
        keep = self._keeps_logits
        if logits_rows is not None and keep is not None:
            kwargs[keep] = logits_rows.to(ids.device)
        if self._positions_keyword == "cache_position":
            kwargs["cache_position"] = pos[0]
        elif self._positions_keyword is not None:
            kwargs[self._positions_keyword] = PositionsCache(pos[0])
        with torch.no_grad():
            out = (self.model if self._compiled is None else self._compiled)(**kwargs)
        logits = getattr(out, "logits", None)
        if not isinstance(logits, torch.Tensor):
            raise UnsupportedModelError(
                f"{type(self.model).__name__} returned no logits; attach a causal LM "
                f"(AutoModelForCausalLM)"
            )
        if logits_rows is not None and keep is None:  # a forward without logits_to_keep
            logits = logits[:, logits_rows.to(logits.device)]
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
        return self._serve_layer(name, query, key, value, attention_mask, kwargs)

    def _serve_layer(
        self,
        name: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: object,
        kwargs: Mapping[str, object],
        *,
        traced: bool = False,
    ) -> torch.Tensor:
        """One attention call of layer ``name``; ``traced``: as ``torch.compile`` traces
        it (``compile``), the checks run while tracing and the layer is one
        ``attnkit::runtime_forward`` node (``AttentionRuntime.forward_op``)."""
        if not self._active:
            raise StaleStepError(
                f"{name}: this model is attached to attnkit and runs only in engine steps "
                f"(Engine(attached).run(), or attached(batch, token_ids, positions) after "
                f"runtime.begin_step); call attached.detach() to use it on its own"
            )
        binding = self.layers[name]
        check_call(name, query, key, value, attention_mask, kwargs)
        self._check_parameters(binding, query, kwargs)
        if binding.sinks is not None:
            sinks = kwargs["s_aux"]
            assert isinstance(sinks, torch.Tensor)  # _check_parameters checked it
            binding.sinks.copy_(sinks.detach())
        q = query[0].transpose(0, 1)
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
        if traced:
            out = self._runtime.forward_op(name, q, k, v)
        else:
            out = self._runtime.forward(name, q.contiguous(), k.contiguous(), v.contiguous())
        return out.unsqueeze(0)

    def compile(self, **options: Any) -> None:
        """Run the model's steps through ``torch.compile(model, **options)``, its
        attention layers as ``attnkit::runtime_forward`` nodes (``forward_op``), so the
        rest of each layer (projections, norms, rotary, MLP) compiles around them.

        The model's outputs are the eager attachment's (within the compiler's
        rounding); the first steps of each new shape compile. The compiled steps run
        the modules' own linears (``linears_mode`` becomes ``"module"``: the compiler
        fuses around them); not with packed linears (their copies are opaque calls).

        Raises:
            InvalidArgumentError: the attachment packs its linears.
        """
        if self.linears_mode == "packed":
            raise InvalidArgumentError(
                "compile: this attachment packs its linears (linears='packed'), which "
                "torch.compile cannot trace; attach with linears='auto' to compile"
            )
        if self.linears is not None:
            self.linears.detach()
            self.linears, self.linears_mode = None, "module"
        for name, module in self._modules.items():
            # Read by _interface while compiling: a plain attribute, not the weak map.
            module.__dict__["_attnkit_traced"] = functools.partial(
                self._serve_layer, name, traced=True
            )
        compile_fn: Any = cast(
            "Any", torch
        ).compile  # its overloads' callables are partly unannotated
        self._compiled = compile_fn(self.model, **options)

    def _check_parameters(
        self, binding: LayerBinding, query: torch.Tensor, kwargs: Mapping[str, object]
    ) -> None:
        """The call's parameters must be the runtime's (else: stale, say so)."""
        p, spec, name = binding.params, binding.spec, binding.name
        expected_window = rules_for(spec).mask(spec).window
        given_scale = number_kwarg(kwargs, "scaling")
        checks: list[tuple[str, object, object]] = [
            ("scaling", spec.head_size**-0.5 if given_scale is None else given_scale, p.scale),
            ("sliding_window", window_kwarg(kwargs), expected_window),
            ("softcap", number_kwarg(kwargs, "softcap"), p.logits_soft_cap),
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
        if self.linears is not None:
            self.linears.detach()
        for module in list(HANDLERS):
            if id(module) in self._names:
                del HANDLERS[module]
        for module in self._modules.values():
            module.__dict__.pop("_attnkit_traced", None)
        self._compiled = None
        previous = self._previous_impl
        if isinstance(previous, str) and previous != ATTENTION_IMPLEMENTATION:
            set_implementation(self.model, previous)

    @contextlib.contextmanager
    def eager(self) -> Generator[torch.nn.Module, None, None]:
        """The model on transformers' own ``"eager"`` attention for the block (for
        reference runs), then attnkit's again."""
        set_implementation(self.model, "eager")
        try:
            yield self.model
        finally:
            set_implementation(self.model, ATTENTION_IMPLEMENTATION)


def _named_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``model.named_modules()`` as a typed list (torch leaves its ``memo`` parameter
    unannotated, so pyright sees the method as partially unknown)."""
    named = cast("Iterator[tuple[str, torch.nn.Module]]", model.named_modules())
    return list(named)


LINEARS = ("auto", "onednn", "packed", "module")
"""``attach``'s ``linears`` choices."""


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
    linears: Literal["auto", "onednn", "packed", "module"] = "auto",
    pack_linears: bool = False,
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
        linears: how the attachment's steps run the model's CPU ``nn.Linear`` layers
            (outside a step every module runs its own ``forward``): ``"onednn"``,
            oneDNN's linear on the module's own weight (no copy; faster than
            ``F.linear`` on the CPUs measured: ``attnkit.integrations.transformers.
            _linears``); ``"packed"``, a oneDNN-packed copy of each weight (faster
            again, twice the linears' memory; a weight changed since is packed again
            before the next step); ``"module"``, each module's own ``F.linear``; or
            ``"auto"`` (default): ``"onednn"`` where this torch has oneDNN's linear
            and the model is on the CPU, else ``"module"``. oneDNN's results differ
            from ``F.linear``'s by rounding (another summation order).
        pack_linears: ``True`` is ``linears="packed"``.

    Returns:
        The ``TransformersAttachment``: ``Engine(attached)`` serves requests.

    Raises:
        MissingDependencyError: transformers is missing (``pip install
            'attnkit[transformers]'``) or too old.
        UnsupportedModelError: a family or a layer attnkit cannot serve (the message
            names the layer and why).
        InvalidArgumentError: bad arguments (named in the message).
    """
    tf = import_transformers()
    given: object = model  # untyped callers may pass anything
    if not isinstance(given, tf.PreTrainedModel):
        raise ArgumentTypeError(
            f"model must be a transformers PreTrainedModel, got {type(given).__name__}"
        )
    model_type = str(getattr(model.config, "model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(family_problem(model, model_type))
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
    if not isinstance(pack_linears, bool):
        raise ArgumentTypeError(f"pack_linears must be a bool, got {pack_linears!r}")
    given_linears: object = linears  # untyped callers may pass anything
    if not isinstance(given_linears, str) or given_linears not in LINEARS:
        raise InvalidArgumentError(
            f"linears must be one of {', '.join(map(repr, LINEARS))}, got {linears!r}"
        )
    if pack_linears:
        if linears not in ("auto", "packed"):
            raise InvalidArgumentError(
                f"pack_linears=True is linears='packed', but linears={linears!r} was given"
            )
        linears = "packed"
    problem = packing_problem()
    if linears in ("onednn", "packed") and problem is not None:
        name = "pack_linears=True" if pack_linears else f"linears={linears!r}"
        raise InvalidArgumentError(f"{name}, but {problem}")
    first = next(model.parameters(), None)
    where = first.device if first is not None else torch.device("cpu")
    if linears == "auto":
        linears = "onednn" if problem is None and where.type == "cpu" else "module"
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
        linears=linears,
    )
    return attached


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


def _logits_keyword(model: torch.nn.Module) -> str | None:
    """``"logits_to_keep"`` when ``model.forward`` takes it as a tensor of rows (recent
    transformers causal LMs do), else ``None``."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # (a forward without a signature: cut after)
        return None
    return "logits_to_keep" if "logits_to_keep" in parameters else None
