"""The model families ``attach`` serves, why another family is refused, and
``tiny_model``: a tiny random-weight model of each served family (no download)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...errors import AttnkitError, InvalidArgumentError
from ._interface import import_transformers
from ._layers import config_layout, unservable

SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "gemma2",
    "gemma3",
    "gemma3_text",
    "gpt_oss",
    "llama",
    "llama4_text",
    "mistral",
    "qwen2",
    "qwen3",
)
"""The ``config.model_type`` values ``attach`` serves (text causal LMs, and Gemma 3's
image-text model, whose image tokens attend to each other through the requests'
``mm_prefix_ranges``; the engine passes token ids, so image embeddings are the
placeholder tokens' own)."""


def family_problem(model: torch.nn.Module, model_type: str) -> str:
    """Why a model of an unsupported family cannot be attached, naming a layer when the
    config's layout can say which."""
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    base = f"model_type {model_type!r} ({type(model).__name__}) is not served by attach()"
    try:
        layout = config_layout(model, model_type, torch.float32, 16)
    except AttnkitError:
        return f"{base}; supported: {supported}"
    for name, info in layout.layers.items():
        why = unservable(info)
        if why is not None:
            return f"{base}: layer {name} is {why}; supported: {supported}"
    return (
        f"{base} (its attention conventions are not checked against eager); supported: {supported}"
    )


GEMMA3_IMAGE_TOKEN = 90
"""The image placeholder token of ``tiny_model("gemma3")`` (begin/end of image: 91, 92)."""

# torch.manual_seed, typed (pyright: partially unknown in torch's stubs).
_manual_seed: Callable[[int], object] = torch.manual_seed  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]


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
    tf = import_transformers()
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
    if model_type == "gemma3":
        # The image-text model: a tiny vision tower (never run: no pixel values), image
        # tokens GEMMA3_IMAGE_TOKEN, the text model as gemma3_text's.
        text = {**common, **window, **two_kinds, "query_pre_attn_scalar": 24}
        vision = {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 16,
            "patch_size": 8,
        }
        config = tf.Gemma3Config(
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=4,
            image_token_index=GEMMA3_IMAGE_TOKEN,
            boi_token_index=GEMMA3_IMAGE_TOKEN + 1,
            eoi_token_index=GEMMA3_IMAGE_TOKEN + 2,
        )
    else:
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
