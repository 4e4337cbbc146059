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

from ...errors import MissingDependencyError
from ._attachment import TransformersAttachment, attach, describe_layers
from ._eager import EAGER_TOLERANCE, EagerCheck, check_against_eager, eager_logits
from ._families import SUPPORTED_MODEL_TYPES, tiny_model
from ._interface import (
    ATTENTION_IMPLEMENTATION,
    MIN_TRANSFORMERS_VERSION,
    StaleParametersError,
    UnsupportedModelError,
)
from ._layers import LayerBinding

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
