"""The dense decoders' readers (Llama, Mistral, Qwen, Gemma, gpt-oss, Llama 4, DeepSeek
MLA), each after its transformers configuration class, and their ``model_type`` values."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

from ..errors import InvalidArgumentError
from ._config import _Builder, _Config, _Decoder, _Family, _Layers, _self_attn, _type_list_or
from ._layout import MLADims


def _llama(cfg: _Config, b: _Builder) -> _Layers:
    """transformers LlamaConfig: every layer full attention; head_dim defaults to
    hidden_size // num_attention_heads; num_key_value_heads to num_attention_heads."""
    d = _Decoder(cfg)
    for i in range(d.num_layers):
        yield (
            _self_attn("model.layers", i),
            b.attention(num_heads=d.num_heads, num_kv_heads=d.num_kv_heads, head_size=d.head_dim),
        )


def _mistral(cfg: _Config, b: _Builder) -> _Layers:
    """transformers MistralConfig: ``sliding_window`` (defaults to 4096; null: none) on
    every layer."""
    d = _Decoder(cfg)
    window = cfg.opt_int("sliding_window", default=4096)
    for i in range(d.num_layers):
        yield (
            _self_attn("model.layers", i),
            b.attention(
                num_heads=d.num_heads,
                num_kv_heads=d.num_kv_heads,
                head_size=d.head_dim,
                sliding_window=window,
            ),
        )


def _qwen(
    cfg: _Config,
    b: _Builder,
    head_dim_default: int | None,
    prefix: str = "model.layers",
    *,
    mm_prefix: bool = False,
) -> _Layers:
    """transformers Qwen2Config / Qwen3Config: ``sliding_window`` (4096) applies only when
    ``use_sliding_window`` (defaults to false), and then to layers
    ``i >= max_window_layers`` (28); ``layer_types`` overrides which layers.
    ``mm_prefix``: every layer takes image ranges (Bagel's Qwen2 decoder)."""
    d = _Decoder(cfg, head_dim_default)
    window: int | None = None
    if cfg.bool_("use_sliding_window", default=False):
        window = cfg.opt_int("sliding_window", default=4096)
    # Qwen2Config documents max_window_layers defaulting to 28.
    max_window_layers = cfg.index("max_window_layers") if cfg.has("max_window_layers") else 28

    def rule(i: int) -> str:
        sliding = window is not None and i >= max_window_layers
        return "sliding_attention" if sliding else "full_attention"

    # With the window off, sliding_window is None and a "sliding_attention" entry of
    # layer_types attends to the whole context, as in transformers.
    types_ = _type_list_or(cfg, d.num_layers, ("full_attention", "sliding_attention"), rule)
    for i, kind in enumerate(types_):
        yield (
            _self_attn(prefix, i),
            b.attention(
                num_heads=d.num_heads,
                num_kv_heads=d.num_kv_heads,
                head_size=d.head_dim,
                sliding_window=window if kind == "sliding_attention" else None,
                mm_prefix=mm_prefix,
            ),
        )


MMPrefixRule = Literal["none", "all", "window"]
"""Which layers of a multimodal family let an image's tokens attend to each other
(``AttentionSpec.mm_prefix``): none, every layer (Gemma 3, PaliGemma: transformers'
``OR(causal, blockwise)`` on every layer), or the sliding-window layers only (Gemma 4:
its full-attention layers stay causal)."""


def _gemma(
    cfg: _Config, b: _Builder, prefix: str, *, gemma3: bool, mm_prefix: MMPrefixRule = "none"
) -> _Layers:
    """transformers Gemma2Config: layer i is sliding when ``(i + 1) % 2`` (even layers);
    Gemma3TextConfig: sliding unless ``(i + 1) % sliding_window_pattern == 0`` (pattern
    defaults to 6); ``layer_types`` overrides both. Both: ``head_dim``, ``sliding_window``
    (4096) and ``query_pre_attn_scalar`` (256) default as documented there; the softmax
    scale is ``query_pre_attn_scalar ** -0.5``; scores soft-capped at
    ``attn_logit_softcapping`` (Gemma2 defaults to 50.0, Gemma3 to none). ``mm_prefix``:
    which layers take image ranges (``MMPrefixRule``)."""
    d = _Decoder(cfg, head_dim_default=256)
    window = cfg.int_("sliding_window", default=4096)
    scale = cfg.int_("query_pre_attn_scalar", default=256) ** -0.5
    soft_cap = cfg.opt_float("attn_logit_softcapping", default=None if gemma3 else 50.0)
    if gemma3:
        pattern = cfg.int_(
            "sliding_window_pattern", default=cfg.int_("_sliding_window_pattern", default=6)
        )
    else:
        pattern = 2

    def rule(i: int) -> str:
        return "sliding_attention" if (i + 1) % pattern else "full_attention"

    types_ = _type_list_or(cfg, d.num_layers, ("full_attention", "sliding_attention"), rule)
    for i, kind in enumerate(types_):
        sliding = kind == "sliding_attention"
        yield (
            _self_attn(prefix, i),
            b.attention(
                num_heads=d.num_heads,
                num_kv_heads=d.num_kv_heads,
                head_size=d.head_dim,
                sliding_window=window if sliding else None,
                logits_soft_cap=soft_cap,
                scale=scale,
                mm_prefix=mm_prefix == "all" or (mm_prefix == "window" and sliding),
            ),
        )


def _gemma1(cfg: _Config, b: _Builder, prefix: str, *, mm_prefix: bool) -> _Layers:
    """transformers GemmaConfig (Gemma 1): every layer full attention, ``head_dim``
    (256) as documented there, softmax scale ``head_dim ** -0.5``."""
    d = _Decoder(cfg, head_dim_default=256)
    for i in range(d.num_layers):
        yield (
            _self_attn(prefix, i),
            b.attention(
                num_heads=d.num_heads,
                num_kv_heads=d.num_kv_heads,
                head_size=d.head_dim,
                mm_prefix=mm_prefix,
            ),
        )


def _paligemma(cfg: _Config, b: _Builder) -> _Layers:
    """transformers PaliGemmaConfig: a Gemma (PaliGemma 1) or Gemma 2 (PaliGemma 2)
    text model under ``text_config`` (``model.language_model.layers``); its image tokens
    and prompt prefix attend bidirectionally on every layer (the ranges the engine
    gives), so every layer takes image ranges."""
    text = cfg.sub("text_config")
    kind = text.data.get("model_type", "gemma")
    if kind == "gemma2":
        return _gemma(text, b, "model.language_model.layers", gemma3=False, mm_prefix="all")
    if kind == "gemma":
        return _gemma1(text, b, "model.language_model.layers", mm_prefix=True)
    raise InvalidArgumentError(
        f"layout_from_hf_config: paligemma config key 'text_config.model_type' must be "
        f"'gemma' or 'gemma2', got {kind!r}"
    )


def _gemma4(cfg: _Config, b: _Builder, prefix: str) -> _Layers:
    """transformers Gemma4TextConfig: ``layer_types`` (``sliding_attention`` /
    ``full_attention``, required here); a sliding layer has ``head_dim`` and
    ``num_key_value_heads``, a full one ``global_head_dim`` and
    ``num_global_key_value_heads`` (each the sliding value when absent or null); the
    softmax scale is 1.0 (the q/k norms take the place of ``head_dim ** -0.5``); no
    score soft-cap unless ``attn_logit_softcapping`` is set. With
    ``use_bidirectional_attention == "vision"`` an image's tokens attend to each other
    on the sliding layers only, clamped to the window (``MMPrefixRule`` "window"; vLLM
    PR #47217); the full-attention layers stay causal.

    Refused: ``num_kv_shared_layers > 0`` (trailing layers that read an earlier layer's
    K/V instead of keeping their own: no spec describes a layer without its own cache
    yet, and giving them one would overstate the cache) and a fully bidirectional text
    model (``use_bidirectional_attention: true``)."""
    shared = cfg.int_("num_kv_shared_layers", default=0)
    if shared:
        raise InvalidArgumentError(
            f"layout_from_hf_config: {cfg.family} config key "
            f"{cfg.where + 'num_kv_shared_layers'!r} "
            f"is {shared}: layers that read another layer's K/V cache (KV sharing) are not "
            f"modelled; only configs with num_kv_shared_layers 0 are read"
        )
    bidirectional = cfg.data.get("use_bidirectional_attention")
    if bidirectional not in (None, False, "vision"):
        raise InvalidArgumentError(
            f"layout_from_hf_config: {cfg.family} config key "
            f"{cfg.where + 'use_bidirectional_attention'!r} must be null, false or 'vision' "
            f"(a decoder), got {bidirectional!r}"
        )
    num_layers = cfg.int_("num_hidden_layers")
    num_heads = cfg.int_("num_attention_heads")
    head_dim = cfg.int_("head_dim")
    global_head_dim = cfg.int_("global_head_dim", default=head_dim)
    kv_heads = cfg.int_("num_key_value_heads", default=num_heads)
    global_kv_heads = cfg.int_("num_global_key_value_heads", default=kv_heads)
    window = cfg.int_("sliding_window")
    soft_cap = cfg.opt_float("attn_logit_softcapping", default=None)
    types_ = cfg.layer_types("layer_types", num_layers, ("full_attention", "sliding_attention"))
    for i, kind in enumerate(types_):
        sliding = kind == "sliding_attention"
        yield (
            _self_attn(prefix, i),
            b.attention(
                num_heads=num_heads,
                num_kv_heads=kv_heads if sliding else global_kv_heads,
                head_size=head_dim if sliding else global_head_dim,
                sliding_window=window if sliding else None,
                logits_soft_cap=soft_cap,
                scale=1.0,
                mm_prefix=sliding and bidirectional == "vision",
            ),
        )


def _molmo2(cfg: _Config, b: _Builder) -> _Layers:
    """Molmo2Config: a Qwen-style text decoder under ``text_config`` (every layer full
    attention; ``head_dim`` defaults to ``hidden_size // num_attention_heads``), whose
    image tokens attend bidirectionally on every layer (vLLM's ``is_mm_prefix_lm``
    families). Names: ``model.language_model.layers``."""
    text = cfg.sub("text_config")
    d = _Decoder(text)
    for i in range(d.num_layers):
        yield (
            _self_attn("model.language_model.layers", i),
            b.attention(
                num_heads=d.num_heads,
                num_kv_heads=d.num_kv_heads,
                head_size=d.head_dim,
                mm_prefix=True,
            ),
        )


def _bagel(cfg: _Config, b: _Builder) -> _Layers:
    """BagelConfig: a Qwen2 decoder under ``llm_config`` (read as ``qwen2``; names
    ``language_model.model.layers``), its image tokens attending bidirectionally on
    every layer (vLLM's ``is_mm_prefix_lm`` families)."""
    return _qwen(cfg.sub("llm_config"), b, None, "language_model.model.layers", mm_prefix=True)


def _gpt_oss(cfg: _Config, b: _Builder) -> _Layers:
    """transformers GptOssConfig: ``layer_types`` (default: sliding when ``(i + 1) % 2``),
    ``sliding_window`` (128) and ``head_dim`` (64) as documented there; every attention
    layer has learned per-head sinks (``GptOssAttention.sinks``, one logit per head)."""
    d = _Decoder(cfg, head_dim_default=64)
    window = cfg.int_("sliding_window", default=128)

    def rule(i: int) -> str:
        return "sliding_attention" if (i + 1) % 2 else "full_attention"

    types_ = _type_list_or(cfg, d.num_layers, ("full_attention", "sliding_attention"), rule)
    for i, kind in enumerate(types_):
        yield (
            _self_attn("model.layers", i),
            b.attention(
                num_heads=d.num_heads,
                num_kv_heads=d.num_kv_heads,
                head_size=d.head_dim,
                sliding_window=window if kind == "sliding_attention" else None,
                has_sinks=True,
            ),
        )


def _llama4(cfg: _Config, b: _Builder) -> _Layers:
    """transformers Llama4TextConfig: ``no_rope_layers[i]`` is 1 for a RoPE layer, 0 for
    a NoPE layer (an empty or absent list means ``int((i + 1) % no_rope_layer_interval
    != 0)``, the interval defaulting to 4); ``layer_types`` defaults to
    ``chunked_attention`` on RoPE layers and ``full_attention`` on NoPE layers, with
    ``attention_chunk_size`` (8192; null: no chunking). ``head_dim`` defaults to 128.
    The NoPE layers' query temperature tuning is the model's, not the softmax scale's."""
    text = cfg.sub("text_config")
    d = _Decoder(text, head_dim_default=128)
    interval = text.int_("no_rope_layer_interval", default=4)
    no_rope: list[int] = []
    if text.has("no_rope_layers") and text.data["no_rope_layers"]:
        no_rope = text.int_list("no_rope_layers")
        if len(no_rope) != d.num_layers:
            raise InvalidArgumentError(
                f"layout_from_hf_config: llama4 config key 'text_config.no_rope_layers' must "
                f"have one entry per layer ({d.num_layers}), got {len(no_rope)}"
            )
    else:
        no_rope = [int((i + 1) % interval != 0) for i in range(d.num_layers)]
    chunk = text.opt_int("attention_chunk_size", default=8192)
    types_ = _type_list_or(
        text,
        d.num_layers,
        ("chunked_attention", "full_attention"),
        lambda i: "chunked_attention" if no_rope[i] else "full_attention",
    )
    for i, kind in enumerate(types_):
        yield (
            _self_attn("language_model.model.layers", i),
            b.attention(
                num_heads=d.num_heads,
                num_kv_heads=d.num_kv_heads,
                head_size=d.head_dim,
                attention_chunk_size=chunk if kind == "chunked_attention" else None,
                use_rope=bool(no_rope[i]),
            ),
        )


def _yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's yarn attention factor: ``0.1 * mscale * ln(factor) + 1`` for factor > 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _deepseek(cfg: _Config, b: _Builder) -> _Layers:
    """transformers DeepseekV2Config / DeepseekV3Config: every layer is MLA. The cached
    latent is ``kv_lora_rank + qk_rope_head_dim`` wide (one per token, shared by all
    heads). The softmax scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times
    ``mscale**2`` when ``rope_scaling`` is a non-default type with a non-zero
    ``mscale_all_dim`` (DeepseekV3Attention: ``mscale = 0.1 * mscale_all_dim *
    ln(factor) + 1``). The multi-token-prediction layers
    (``num_nextn_predict_layers``) are not part of the model's layers."""
    num_layers = cfg.int_("num_hidden_layers")
    num_heads = cfg.int_("num_attention_heads")
    dims = MLADims(
        kv_lora_rank=cfg.int_("kv_lora_rank"),
        qk_rope_head_dim=cfg.int_("qk_rope_head_dim"),
        qk_nope_head_dim=cfg.int_("qk_nope_head_dim"),
        v_head_dim=cfg.int_("v_head_dim"),
        q_lora_rank=cfg.opt_int("q_lora_rank"),
    )
    scale = dims.qk_head_dim**-0.5
    if cfg.has("rope_scaling") and cfg.data["rope_scaling"] is not None:
        rope = cfg.sub("rope_scaling")
        kind = rope.data.get("rope_type", rope.data.get("type", "default"))
        mscale_all_dim = rope.opt_float("mscale_all_dim", default=0.0)
        if kind != "default" and mscale_all_dim:
            factor = rope.opt_float("factor")
            if factor is None:
                raise rope._missing("factor")
            scale *= _yarn_mscale(factor, mscale_all_dim) ** 2
    # DeepSeek-V3.2 (sparse attention): each layer's indexer keeps its own cache beside
    # the latent, and the MLA reads only the index_topk positions it selects.
    sparse = cfg.has("index_topk")
    index_topk = cfg.int_("index_topk") if sparse else None
    index_heads = cfg.int_("index_n_heads") if sparse else 0
    index_dim = cfg.int_("index_head_dim") if sparse else 0
    for i in range(num_layers):
        yield _self_attn("model.layers", i), b.mla(
            num_heads=num_heads, dims=dims, scale=scale, index_topk=index_topk
        )
        if index_topk is not None:
            yield f"{_self_attn('model.layers', i)}.indexer", b.indexer(
                num_heads=index_heads, head_size=index_dim, index_topk=index_topk
            )


DENSE_FAMILIES: Mapping[str, _Family] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": lambda c, b: _qwen(c, b, None),
    # Qwen3Config documents head_dim defaulting to 128.
    "qwen3": lambda c, b: _qwen(c, b, 128),
    "gemma2": lambda c, b: _gemma(c, b, "model.layers", gemma3=False),
    "gemma3_text": lambda c, b: _gemma(c, b, "model.layers", gemma3=True),
    # Gemma3Config: the text model's keys are under text_config; module names as in
    # Gemma3ForConditionalGeneration.
    # Images attend bidirectionally on every layer (vLLM's is_mm_prefix_lm families).
    "gemma3": lambda c, b: _gemma(
        c.sub("text_config"), b, "model.language_model.layers", gemma3=True, mm_prefix="all"
    ),
    "paligemma": _paligemma,
    # Gemma4Config: text keys under text_config, images bidirectional on window layers.
    "gemma4": lambda c, b: _gemma4(c.sub("text_config"), b, "model.language_model.layers"),
    "gemma4_text": lambda c, b: _gemma4(c, b, "model.layers"),
    "molmo2": _molmo2,
    "bagel": _bagel,
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "deepseek_v32": _deepseek,
}
"""``model_type`` -> its reader, for the dense decoders."""
