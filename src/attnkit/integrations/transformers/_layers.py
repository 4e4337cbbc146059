"""The config's layout and the probed calls, paired: which layers attnkit serves through
transformers' attention calls, and each served layer's ``LayerBinding`` (spec and
parameters, checked against what its module passed)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch

from ...kinds import rules_for
from ...models import LayerInfo, ModelLayout, layout_from_hf_config
from ...params import AttentionLayerParams
from ...spec import AttentionSpec, AttentionType
from ._interface import UnsupportedModelError
from ._probe import Call


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


def config_layout(
    model: torch.nn.Module, model_type: str, dtype: torch.dtype, block_size: int
) -> ModelLayout:
    config: Any = getattr(model, "config", None)
    data: dict[str, object] = dict(config.to_dict())
    if model_type == "llama4_text":
        # layout_from_hf_config reads Llama 4 from the multimodal config's text_config.
        data = {"model_type": "llama4", "text_config": data}
    return layout_from_hf_config(data, dtype=dtype, block_size=block_size)


def unservable(info: LayerInfo) -> str | None:
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


def bind_layers(layout: ModelLayout, calls: Mapping[torch.nn.Module, Call]) -> dict[str, LayerBinding]:
    """Pair each probed module with its layout layer (by layer index) and build its
    parameters from what the module passed; disagreements are errors."""
    by_index: dict[int, LayerInfo] = {}
    for layer_name, info in layout.layers.items():
        why = unservable(info)
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
