"""The encoders' and encoder-decoders' readers (BERT, T5, BART), each after its
transformers configuration class, and their ``model_type`` values."""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import InvalidArgumentError
from ..spec import AttentionType
from ._config import _Builder, _Config, _Family, _head_dim, _Layers
from ._layout import LayerInfo


def _bert(cfg: _Config, b: _Builder) -> _Layers:
    """transformers BertConfig: ``num_hidden_layers`` bidirectional self-attention layers
    of ``hidden_size // num_attention_heads`` (multi-head: as many KV heads as heads),
    named as in BertForMaskedLM and the other heads (``bert.encoder.layer.{i}.attention.self``)."""
    num_layers = cfg.int_("num_hidden_layers")
    num_heads = cfg.int_("num_attention_heads")
    head_dim = _head_dim(cfg, num_heads)
    for i in range(num_layers):
        yield (
            f"bert.encoder.layer.{i}.attention.self",
            b.attention(
                num_heads=num_heads,
                num_kv_heads=num_heads,
                head_size=head_dim,
                attn_type=AttentionType.ENCODER_ONLY,
            ),
        )


def _t5(cfg: _Config, b: _Builder) -> _Layers:
    """transformers T5Config: ``num_layers`` encoder blocks and ``num_decoder_layers``
    (defaults to ``num_layers``) decoder blocks, ``num_heads`` heads of ``d_kv``. T5
    attention does not scale its scores (the scaling is folded into the weights), so the
    softmax scale is 1.0."""
    enc_layers = cfg.int_("num_layers")
    dec_layers = cfg.int_("num_decoder_layers", default=enc_layers)
    heads = cfg.int_("num_heads")
    d_kv = cfg.int_("d_kv")

    def layer(attn_type: AttentionType) -> LayerInfo:
        return b.attention(
            num_heads=heads, num_kv_heads=heads, head_size=d_kv, attn_type=attn_type, scale=1.0
        )

    for i in range(enc_layers):
        yield f"encoder.block.{i}.layer.0.SelfAttention", layer(AttentionType.ENCODER)
    for i in range(dec_layers):
        yield f"decoder.block.{i}.layer.0.SelfAttention", layer(AttentionType.DECODER)
        yield f"decoder.block.{i}.layer.1.EncDecAttention", layer(AttentionType.ENCODER_DECODER)


def _bart(cfg: _Config, b: _Builder) -> _Layers:
    """transformers BartConfig: ``encoder_layers`` encoder layers of
    ``encoder_attention_heads`` heads and ``decoder_layers`` decoder layers of
    ``decoder_attention_heads`` heads, each of ``d_model // heads``; names as in
    BartForConditionalGeneration (``model.encoder.layers.{i}.self_attn``,
    ``model.decoder.layers.{i}.self_attn`` and ``.encoder_attn``)."""
    d_model = cfg.int_("d_model")

    def heads_and_dim(key: str) -> tuple[int, int]:
        heads = cfg.int_(key)
        if d_model % heads:
            raise InvalidArgumentError(
                f"layout_from_hf_config: bart config: d_model={d_model} is not a multiple of "
                f"{key}={heads}"
            )
        return heads, d_model // heads

    enc_layers = cfg.int_("encoder_layers")
    dec_layers = cfg.int_("decoder_layers")
    enc_heads, enc_dim = heads_and_dim("encoder_attention_heads")
    dec_heads, dec_dim = heads_and_dim("decoder_attention_heads")
    for i in range(enc_layers):
        yield (
            f"model.encoder.layers.{i}.self_attn",
            b.attention(
                num_heads=enc_heads,
                num_kv_heads=enc_heads,
                head_size=enc_dim,
                attn_type=AttentionType.ENCODER,
            ),
        )
    for i in range(dec_layers):
        yield (
            f"model.decoder.layers.{i}.self_attn",
            b.attention(num_heads=dec_heads, num_kv_heads=dec_heads, head_size=dec_dim),
        )
        # Cross-attention: decoder queries (decoder heads) over the encoder's keys/values.
        yield (
            f"model.decoder.layers.{i}.encoder_attn",
            b.attention(
                num_heads=dec_heads,
                num_kv_heads=dec_heads,
                head_size=dec_dim,
                attn_type=AttentionType.ENCODER_DECODER,
            ),
        )


ENCODER_FAMILIES: Mapping[str, _Family] = {
    "bert": _bert,
    "t5": _t5,
    "bart": _bart,
}
"""``model_type`` -> its reader, for the encoders and encoder-decoders."""
