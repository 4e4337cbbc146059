"""Hugging Face ``config.json`` -> attnkit layer specs.

``layout_from_hf_config`` reads a model's ``config.json`` (a path to the file, to the
directory holding it, or the already-parsed mapping) and returns a ``ModelLayout``: one
``LayerInfo`` per cached sub-layer, in model order, named after the model's own module
(``model.layers.3.self_attn``, ``model.layers.4.mamba``), each with its
``KVCacheSpec`` and the facts an engine needs to build the layer's parameters::

    >>> import attnkit
    >>> layout = attnkit.layout_from_hf_config({
    ...     "model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 2,
    ...     "num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": 4096,
    ...     "torch_dtype": "bfloat16"})
    >>> list(layout.layers)
    ['model.layers.0.self_attn', 'model.layers.1.self_attn']
    >>> layout.layers["model.layers.0.self_attn"].spec.kind.value
    'sliding_window'
    >>> layout.kv_bytes_per_token()  # 2 layers * 2 (K, V) * 8 heads * 128 * 2 bytes
    8192

Each family follows the rule of its transformers configuration class (named in the
family's reader and in docs/models.md): ``layer_types`` when the file has it, else the
family's own keys. A key a family needs and the file lacks is an error naming the key
and the family; defaults are taken only where the transformers configuration class
documents one.

The package: ``_layout`` (the public layout types), ``_config`` (checked config reads
and the layer builder the readers share), one module of readers per family group
(``_dense``, ``_hybrids``, ``_encoders``), and ``_reader`` (``layout_from_hf_config``).
"""

from ._layout import (
    GatedDeltaNetDims,
    LayerInfo,
    LinearAttentionDims,
    Mamba1Dims,
    Mamba2Dims,
    MLADims,
    ModelLayout,
    ShortConvDims,
    StateDims,
    lightning_attention_decay,
)
from ._reader import SUPPORTED_MODEL_TYPES, layout_from_hf_config

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "GatedDeltaNetDims",
    "LayerInfo",
    "LinearAttentionDims",
    "MLADims",
    "Mamba1Dims",
    "Mamba2Dims",
    "ModelLayout",
    "ShortConvDims",
    "StateDims",
    "layout_from_hf_config",
    "lightning_attention_decay",
]
