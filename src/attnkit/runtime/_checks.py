"""What ``AttentionRuntime`` checks at construction: its arguments by type, and each
layer's params against its spec; the params and features a group's selection is asked
about (shared with ``attnkit.planner``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from .._validation import is_positive_int
from ..capabilities import AttentionFeature
from ..config import AttentionConfig
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..params import AttentionLayerParams, LayerParams, StateLayerParams, quant_scale_problems
from ..spec import AttentionSpec, KVCacheSpec, MambaSpec
from ..state_types import state_type_of


def check_constructor_args(
    layer_specs: object,
    config: object,
    layer_params: object,
    memory_budget_bytes: object,
    cache_fill: object,
) -> None:
    """The runtime's arguments, by type, before anything is built (untyped callers)."""
    if not isinstance(layer_specs, Mapping) or not layer_specs:
        raise ArgumentTypeError(
            f"layer_specs must be a non-empty mapping of layer name -> KVCacheSpec, got "
            f"{layer_specs!r}"
        )
    for name, spec in cast("Mapping[object, object]", layer_specs).items():
        if not isinstance(name, str) or not isinstance(spec, KVCacheSpec):
            raise ArgumentTypeError(
                f"layer_specs must map layer names (str) to KVCacheSpec, got "
                f"{name!r}: {type(spec).__name__}"
            )
    if not isinstance(config, AttentionConfig):
        raise ArgumentTypeError(
            f"config must be an AttentionConfig, got {type(config).__name__} "
            f"(build one with AttentionConfig(...) or AttentionConfig.model_validate(...))"
        )
    if layer_params is not None and not isinstance(layer_params, Mapping):
        raise ArgumentTypeError(
            f"layer_params must be a mapping of layer name -> LayerParams or None, got "
            f"{type(layer_params).__name__}"
        )
    if not is_positive_int(memory_budget_bytes):
        raise InvalidArgumentError(
            f"memory_budget_bytes must be a positive int, got {memory_budget_bytes!r}"
        )
    if cache_fill is not None and (
        not isinstance(cache_fill, int | float) or isinstance(cache_fill, bool)
    ):
        raise ArgumentTypeError(f"cache_fill must be a float or None, got {cache_fill!r}")


def default_layer_params(spec: KVCacheSpec) -> LayerParams | None:
    """The params a layer gets when the engine passes none: attention layers
    ``AttentionLayerParams(num_heads=num_kv_heads)``, state layers none."""
    if isinstance(spec, AttentionSpec):
        return AttentionLayerParams(num_heads=spec.num_kv_heads)
    return None


def group_features(params: Sequence[LayerParams | None]) -> frozenset[AttentionFeature]:
    """The features a group's backend is asked for: the union over its layers' params
    (what ``AttentionRuntime`` and ``attnkit.planner`` pass to ``select_backend``)."""
    found: set[AttentionFeature] = set()
    for p in params:
        if isinstance(p, AttentionLayerParams):
            found |= p.features
    return frozenset(found)


def group_num_heads(params: Sequence[LayerParams | None]) -> int | None:
    """The query heads a group's backend is asked about: its first attention layer's."""
    heads = [p.num_heads for p in params if isinstance(p, AttentionLayerParams)]
    return heads[0] if heads else None


def check_params(name: str, spec: KVCacheSpec, params: LayerParams | None) -> None:
    """A layer's params must fit its spec; each layer is checked (selection asks once per group)."""
    if isinstance(spec, AttentionSpec):
        if not isinstance(params, AttentionLayerParams):
            raise InvalidArgumentError(
                f"layer_params[{name!r}] must be AttentionLayerParams for a {type(spec).__name__}, "
                f"got {type(params).__name__}"
            )
        if params.num_heads % spec.num_kv_heads:
            raise InvalidArgumentError(
                f"layer_params[{name!r}].num_heads={params.num_heads} is not a multiple of the "
                f"spec's num_kv_heads={spec.num_kv_heads}"
            )
        scale_problems = quant_scale_problems(spec, params)
        if scale_problems:
            raise InvalidArgumentError(f"layer_params[{name!r}].{scale_problems[0]}")
    elif isinstance(spec, MambaSpec):
        state_type = state_type_of(spec)
        layout = state_type.layout_problem(spec.shapes)
        if layout is not None:  # no backend could run it: said before any is selected
            raise InvalidArgumentError(f"layer_specs[{name!r}]: {layout}")
        expected: type[StateLayerParams] = state_type.params_type
        if not isinstance(params, expected):
            raise InvalidArgumentError(
                f"layer_params[{name!r}] must be {expected.__name__} for a {spec.mamba_type} "
                f"layer, got {type(params).__name__}"
            )
        if params.state_shapes != spec.shapes:
            raise InvalidArgumentError(
                f"layer_params[{name!r}].state_shapes={params.state_shapes} do not match the "
                f"spec's shapes={spec.shapes}"
            )
