"""The hybrid models' readers (attention beside Mamba, Mamba2, Gated DeltaNet, lightning
attention or short-conv layers), each after its configuration class, and their
``model_type`` values."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import InvalidArgumentError
from ._config import (
    _Builder,
    _Config,
    _Decoder,
    _Family,
    _head_dim,
    _kv_heads,
    _Layers,
    _self_attn,
    _type_list_or,
)
from ._layout import GatedDeltaNetDims, LinearAttentionDims, Mamba1Dims, Mamba2Dims, ShortConvDims


def _qwen3_next(cfg: _Config, b: _Builder) -> _Layers:
    """transformers Qwen3NextConfig: ``layer_types`` (default: ``full_attention`` when
    ``(i + 1) % full_attention_interval == 0``, interval 4, else ``linear_attention``, a
    Gated DeltaNet ``linear_attn``); ``head_dim`` defaults to 256."""
    d = _Decoder(cfg, head_dim_default=256)
    interval = cfg.int_("full_attention_interval", default=4)
    types_ = _type_list_or(
        cfg,
        d.num_layers,
        ("full_attention", "linear_attention"),
        lambda i: "linear_attention" if (i + 1) % interval else "full_attention",
    )
    dims: GatedDeltaNetDims | None = None
    if "linear_attention" in types_:
        dims = GatedDeltaNetDims(
            num_key_heads=cfg.int_("linear_num_key_heads"),
            num_value_heads=cfg.int_("linear_num_value_heads"),
            key_head_dim=cfg.int_("linear_key_head_dim"),
            value_head_dim=cfg.int_("linear_value_head_dim"),
            conv_kernel=cfg.int_("linear_conv_kernel_dim"),
        )
    for i, kind in enumerate(types_):
        if kind == "full_attention":
            yield (
                _self_attn("model.layers", i),
                b.attention(
                    num_heads=d.num_heads, num_kv_heads=d.num_kv_heads, head_size=d.head_dim
                ),
            )
        else:
            assert dims is not None
            yield f"model.layers.{i}.linear_attn", b.state(dims)


def _jamba(cfg: _Config, b: _Builder) -> _Layers:
    """transformers JambaConfig: layer i is attention when ``i % attn_layer_period ==
    attn_layer_offset``, else a Mamba (1) mixer of ``d_inner = mamba_expand *
    hidden_size`` channels; attention layers use ``sliding_window`` when it is set."""
    d = _Decoder(cfg)
    period = cfg.int_("attn_layer_period")
    offset = cfg.index("attn_layer_offset")
    window = cfg.opt_int("sliding_window")
    dims = Mamba1Dims(
        d_inner=cfg.int_("mamba_expand") * cfg.int_("hidden_size"),
        d_state=cfg.int_("mamba_d_state"),
        d_conv=cfg.int_("mamba_d_conv"),
        # JambaConfig: mamba_dt_rank "auto" means ceil(hidden_size / 16); not a cache size.
        dt_rank=cfg.opt_int("mamba_dt_rank") if cfg.data.get("mamba_dt_rank") != "auto" else None,
    )
    for i in range(d.num_layers):
        if i % period == offset:
            yield (
                _self_attn("model.layers", i),
                b.attention(
                    num_heads=d.num_heads,
                    num_kv_heads=d.num_kv_heads,
                    head_size=d.head_dim,
                    sliding_window=window,
                ),
            )
        else:
            yield f"model.layers.{i}.mamba", b.state(dims)


def _mamba2_dims(
    cfg: _Config,
    *,
    num_heads: str,
    head_dim: str,
    n_groups: str,
    d_state: str,
    d_conv: str,
    chunk_size: str,
    intermediate: int | None,
) -> Mamba2Dims:
    """Mamba2 sizes from a family's keys; a ``head_dim`` of ``"auto"`` means
    ``intermediate // num_heads`` (BambaConfig, FalconH1Config)."""
    heads = cfg.int_(num_heads)
    if cfg.raw(head_dim) == "auto":
        if intermediate is None:
            raise cfg._wrong(head_dim, "a positive int", "auto")
        p = intermediate // heads
    else:
        p = cfg.int_(head_dim)
    if intermediate is not None and heads * p != intermediate:
        raise InvalidArgumentError(
            f"layout_from_hf_config: {cfg.family} config: {num_heads}={heads} * {head_dim}={p} "
            f"must equal the mamba intermediate size {intermediate}"
        )
    return Mamba2Dims(
        num_heads=heads,
        head_dim=p,
        n_groups=cfg.int_(n_groups),
        d_state=cfg.int_(d_state),
        d_conv=cfg.int_(d_conv),
        chunk_size=cfg.opt_int(chunk_size),
    )


def _bamba(cfg: _Config, b: _Builder) -> _Layers:
    """transformers BambaConfig: attention at ``attn_layer_indices`` (absent or null:
    none), Mamba2 elsewhere, with ``mamba_expand * hidden_size`` inner channels."""
    d = _Decoder(cfg)
    attn = (
        cfg.indices("attn_layer_indices", d.num_layers)
        if cfg.data.get("attn_layer_indices") is not None
        else set[int]()
    )
    dims = _mamba2_dims(
        cfg,
        num_heads="mamba_n_heads",
        head_dim="mamba_d_head",
        n_groups="mamba_n_groups",
        d_state="mamba_d_state",
        d_conv="mamba_d_conv",
        chunk_size="mamba_chunk_size",
        intermediate=cfg.int_("mamba_expand") * cfg.int_("hidden_size"),
    )
    for i in range(d.num_layers):
        if i in attn:
            yield (
                _self_attn("model.layers", i),
                b.attention(
                    num_heads=d.num_heads, num_kv_heads=d.num_kv_heads, head_size=d.head_dim
                ),
            )
        else:
            yield f"model.layers.{i}.mamba", b.state(dims)


_NEMOTRON_PATTERN: Mapping[str, str] = {
    "M": "mamba",
    "*": "attention",
    "-": "mlp",
    "E": "moe",
}
_NEMOTRON_TYPES: Mapping[str, str] = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}


def _nemotron_h(cfg: _Config, b: _Builder) -> _Layers:
    """transformers NemotronHConfig: one block per character of
    ``hybrid_override_pattern`` (``M`` Mamba2, ``*`` attention, ``-`` MLP, ``E`` MoE; the
    pattern's length is the layer count), or ``layers_block_type`` / ``layer_types``
    (``mamba``/``linear_attention``, ``attention``/``full_attention``, ``mlp``, ``moe``).
    Every block's module is ``backbone.layers.{i}.mixer``; MLP and MoE blocks keep no
    cache. Mamba2 sizes: ``mamba_num_heads``, ``mamba_head_dim``, ``n_groups``,
    ``ssm_state_size``, ``conv_kernel``; attention ``head_dim`` (128 documented)."""
    blocks: list[str]
    list_key = next(
        (k for k in ("layers_block_type", "layer_types") if cfg.data.get(k) is not None), None
    )
    if list_key is not None:
        items = cfg.list_(list_key)
        blocks = cfg.layer_types(list_key, len(items), list(_NEMOTRON_TYPES))
        blocks = [_NEMOTRON_TYPES[t] for t in blocks]
    else:
        pattern = cfg.str_("hybrid_override_pattern")
        bad = sorted({c for c in pattern if c not in _NEMOTRON_PATTERN})
        if bad or not pattern:
            raise InvalidArgumentError(
                "layout_from_hf_config: nemotron_h config key 'hybrid_override_pattern' must "
                f"be a non-empty string of {list(_NEMOTRON_PATTERN)}, got {pattern!r}"
            )
        blocks = [_NEMOTRON_PATTERN[c] for c in pattern]
    attention = mamba = None
    if "attention" in blocks:
        num_heads = cfg.int_("num_attention_heads")
        head_dim = (
            cfg.int_("attention_head_dim")
            if cfg.data.get("head_dim") is None and cfg.has("attention_head_dim")
            else _head_dim(cfg, num_heads, default=128)
        )
        attention = (num_heads, _kv_heads(cfg, num_heads), head_dim)
    if "mamba" in blocks:
        mamba = Mamba2Dims(
            num_heads=cfg.int_("mamba_num_heads"),
            head_dim=cfg.int_("mamba_head_dim"),
            n_groups=cfg.int_("n_groups") if cfg.has("n_groups") else cfg.int_("mamba_n_groups"),
            d_state=cfg.int_("ssm_state_size"),
            d_conv=cfg.int_("conv_kernel") if cfg.has("conv_kernel") else cfg.int_("mamba_d_conv"),
            chunk_size=cfg.opt_int("chunk_size", default=cfg.opt_int("mamba_chunk_size")),
        )
    for i, block in enumerate(blocks):
        name = f"backbone.layers.{i}.mixer"
        if block == "attention":
            assert attention is not None
            yield (
                name,
                b.attention(
                    num_heads=attention[0], num_kv_heads=attention[1], head_size=attention[2]
                ),
            )
        elif block == "mamba":
            assert mamba is not None
            yield name, b.state(mamba)


def _lfm2(cfg: _Config, b: _Builder) -> _Layers:
    """transformers Lfm2Config: ``layer_types`` (``full_attention``/``conv``), else
    attention at ``full_attn_idxs`` (absent: every layer) and a short conv of
    ``hidden_size`` channels and width ``conv_L_cache`` elsewhere."""
    d = _Decoder(cfg)
    if cfg.data.get("layer_types") is not None:
        types_ = cfg.layer_types("layer_types", d.num_layers, ("full_attention", "conv"))
    else:
        attn = (
            cfg.indices("full_attn_idxs", d.num_layers)
            if cfg.data.get("full_attn_idxs") is not None
            else set(range(d.num_layers))
        )
        types_ = ["full_attention" if i in attn else "conv" for i in range(d.num_layers)]
    dims = None
    if "conv" in types_:
        dims = ShortConvDims(channels=cfg.int_("hidden_size"), conv_kernel=cfg.int_("conv_L_cache"))
    for i, kind in enumerate(types_):
        if kind == "full_attention":
            yield (
                _self_attn("model.layers", i),
                b.attention(
                    num_heads=d.num_heads, num_kv_heads=d.num_kv_heads, head_size=d.head_dim
                ),
            )
        else:
            assert dims is not None
            yield f"model.layers.{i}.conv", b.state(dims)


def _minimax_layers(cfg: _Config, b: _Builder, types_: Sequence[str]) -> _Layers:
    d = _Decoder(cfg)
    window = cfg.opt_int("sliding_window")
    for i, kind in enumerate(types_):
        dims = LinearAttentionDims(
            num_heads=d.num_heads, head_dim=d.head_dim, layer_index=i, num_layers=len(types_)
        )
        if kind == "full_attention":
            yield (
                _self_attn("model.layers", i),
                b.attention(
                    num_heads=d.num_heads,
                    num_kv_heads=d.num_kv_heads,
                    head_size=d.head_dim,
                    sliding_window=window,
                ),
            )
        else:
            yield _self_attn("model.layers", i), b.state(dims)


def _minimax(cfg: _Config, b: _Builder) -> _Layers:
    """transformers MiniMaxConfig: ``layer_types`` (default: ``full_attention`` when
    ``(i + 1) % 2``, else ``linear_attention``, a lightning attention layer with one
    ``(head_dim, head_dim)`` state per head). Both kinds live at ``self_attn``."""
    num_layers = cfg.int_("num_hidden_layers")
    types_ = _type_list_or(
        cfg,
        num_layers,
        ("full_attention", "linear_attention"),
        lambda i: "full_attention" if (i + 1) % 2 else "linear_attention",
    )
    yield from _minimax_layers(cfg, b, types_)


def _minimax_text_01(cfg: _Config, b: _Builder) -> _Layers:
    """MiniMax-Text-01's own MiniMaxText01Config (remote code): ``attn_type_list[i]`` is 0
    for a lightning (linear) attention layer, 1 for softmax attention."""
    num_layers = cfg.int_("num_hidden_layers")
    flags = cfg.list_("attn_type_list")
    if len(flags) != num_layers or any(f not in (0, 1) or isinstance(f, bool) for f in flags):
        raise InvalidArgumentError(
            "layout_from_hf_config: minimax_text_01 config key 'attn_type_list' must hold one "
            f"0 (linear) or 1 (softmax) per layer ({num_layers}), got {flags!r}"
        )
    types_ = ["full_attention" if f == 1 else "linear_attention" for f in flags]
    yield from _minimax_layers(cfg, b, types_)


def _falcon_h1(cfg: _Config, b: _Builder) -> _Layers:
    """transformers FalconH1Config: every layer runs a Mamba2 mixer (``mamba``) and
    attention (``self_attn``) side by side. Mamba inner size ``mamba_d_ssm`` (null:
    ``mamba_expand * hidden_size``); ``mamba_d_head`` ``"auto"`` is inner //
    ``mamba_n_heads``; attention ``head_dim`` defaults to hidden_size // heads."""
    d = _Decoder(cfg)
    cfg.raw("mamba_d_ssm")  # required: its default changed across transformers versions
    inner = cfg.opt_int("mamba_d_ssm")
    if inner is None:
        inner = cfg.int_("mamba_expand") * cfg.int_("hidden_size")
    dims = _mamba2_dims(
        cfg,
        num_heads="mamba_n_heads",
        head_dim="mamba_d_head",
        n_groups="mamba_n_groups",
        d_state="mamba_d_state",
        d_conv="mamba_d_conv",
        chunk_size="mamba_chunk_size",
        intermediate=inner,
    )
    for i in range(d.num_layers):
        yield f"model.layers.{i}.mamba", b.state(dims)
        yield (
            _self_attn("model.layers", i),
            b.attention(num_heads=d.num_heads, num_kv_heads=d.num_kv_heads, head_size=d.head_dim),
        )


HYBRID_FAMILIES: Mapping[str, _Family] = {
    "qwen3_next": _qwen3_next,
    "jamba": _jamba,
    "bamba": _bamba,
    "nemotron_h": _nemotron_h,
    "lfm2": _lfm2,
    "minimax": _minimax,
    "minimax_text_01": _minimax_text_01,
    "falcon_h1": _falcon_h1,
}
"""``model_type`` -> its reader, for the hybrids of attention and state layers."""
