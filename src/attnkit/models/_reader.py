"""``layout_from_hf_config``: a ``config.json`` (a path or the parsed mapping) read by its
family's reader into a ``ModelLayout``; ``SUPPORTED_MODEL_TYPES``."""

from __future__ import annotations

import json
import os
import types
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import torch

from .._validation import check_positive_int, dtype_name
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..spec import KV_CACHE_DTYPES, MODEL_DTYPES, KVCacheDType
from ._config import _Builder, _Config, _Family
from ._dense import DENSE_FAMILIES
from ._encoders import ENCODER_FAMILIES
from ._hybrids import HYBRID_FAMILIES
from ._layout import LayerInfo, ModelLayout

_FAMILIES: Mapping[str, _Family] = {**DENSE_FAMILIES, **HYBRID_FAMILIES, **ENCODER_FAMILIES}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_FAMILIES))
"""The ``model_type`` values ``layout_from_hf_config`` reads."""

_NESTED_TEXT: frozenset[str] = frozenset({"gemma3", "gemma4", "llama4", "molmo2", "paligemma"})


def _load(config_or_path: object) -> Mapping[str, object]:
    if isinstance(config_or_path, Mapping):
        data = cast("Mapping[object, object]", config_or_path)
        bad = [k for k in data if not isinstance(k, str)]
        if bad:
            raise ArgumentTypeError(
                f"layout_from_hf_config: config_or_path keys must be strings, got {bad[0]!r}"
            )
        return cast("Mapping[str, object]", data)
    if not isinstance(config_or_path, str | os.PathLike):
        raise ArgumentTypeError(
            "layout_from_hf_config: config_or_path must be a mapping (a parsed config.json), "
            f"a str or an os.PathLike, got {type(config_or_path).__name__}"
        )
    shown = os.fspath(cast("str | os.PathLike[str]", config_or_path))
    path = Path(shown)
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgumentError(
            f"layout_from_hf_config: config_or_path={shown!r}: cannot read "
            f"{str(path)!r} ({exc.strerror or exc})"
        ) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(
            f"layout_from_hf_config: config_or_path={shown!r}: {str(path)!r} is "
            f"not valid JSON ({exc})"
        ) from exc
    if not isinstance(data, dict):
        raise InvalidArgumentError(
            f"layout_from_hf_config: config_or_path={shown!r}: {str(path)!r} "
            f"must hold a JSON object, got {type(data).__name__}"
        )
    return cast("dict[str, object]", data)


def layout_from_hf_config(
    config_or_path: Mapping[str, object] | str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    block_size: int = 16,
    kv_cache_dtype: KVCacheDType = "auto",
    state_dtype: torch.dtype = torch.float32,
) -> ModelLayout:
    """Read a Hugging Face ``config.json`` into attnkit layer specs.

    Args:
        config_or_path: the parsed config, or a path to ``config.json`` or to the
            directory holding it.
        dtype: the model dtype. ``None`` (default): the config's ``torch_dtype`` (or
            ``dtype``; for ``gemma3`` and ``llama4`` the text config's first, then the
            top level's), else ``torch.float32``, what transformers loads a model in when
            no dtype is asked for.
        block_size: tokens per cache block of every layer.
        kv_cache_dtype: the attention layers' cache storage dtype.
        state_dtype: the dtype of the recurrent state of state layers (the SSM state of
            Mamba1/Mamba2, the delta-rule and linear-attention states), which
            accumulates over the whole sequence: float32 by default, what every built-in
            state backend keeps. Conv states (and short-conv layers) take the model
            dtype.

    Returns:
        A ``ModelLayout``: one entry per cached sub-layer, in model order, named after
        the model's modules. Layers without a cache (Nemotron-H MLP and MoE blocks)
        have none.

    Raises:
        InvalidArgumentError: an unknown ``model_type`` (the message lists the supported
            ones), a key the family needs that the config lacks (naming key and family),
            an unreadable file, a value out of range.
        ArgumentTypeError: a value of the wrong JSON type (naming the key).
    """
    check_positive_int("layout_from_hf_config", "block_size", block_size)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidArgumentError(
            f"layout_from_hf_config: kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
            f"{kv_cache_dtype!r}"
        )
    given_dtype: object = dtype
    if given_dtype is not None and (
        not isinstance(given_dtype, torch.dtype) or given_dtype not in MODEL_DTYPES
    ):
        supported = ", ".join(sorted(dtype_name(d) for d in MODEL_DTYPES))
        raise InvalidArgumentError(
            f"layout_from_hf_config: dtype must be None or a torch.dtype among ({supported}), "
            f"got {dtype!r}"
        )
    data = _load(config_or_path)
    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        raise InvalidArgumentError(
            "layout_from_hf_config: the config needs a string 'model_type' (one of "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}), got {model_type!r}"
        )
    family = _FAMILIES.get(model_type)
    if family is None:
        raise InvalidArgumentError(
            f"layout_from_hf_config: unsupported model_type {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    cfg = _Config(data, model_type)
    if dtype is None:
        found = cfg.sub("text_config").dtype() if model_type in _NESTED_TEXT else None
        if found is None:
            found = cfg.dtype()
        dtype = found if found is not None else torch.float32
    given_state: object = state_dtype
    if not isinstance(given_state, torch.dtype) or given_state not in MODEL_DTYPES:
        supported = ", ".join(sorted(dtype_name(d) for d in MODEL_DTYPES))
        raise InvalidArgumentError(
            f"layout_from_hf_config: state_dtype must be a torch.dtype among ({supported}), "
            f"got {state_dtype!r}"
        )
    builder = _Builder(dtype, block_size, kv_cache_dtype, state_dtype)
    layers: dict[str, LayerInfo] = {}
    for name, info in family(cfg, builder):
        layers[name] = info
    return ModelLayout(model_type=model_type, dtype=dtype, layers=types.MappingProxyType(layers))
