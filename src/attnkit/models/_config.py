"""What every family reader uses: typed, checked reads of a config mapping (``_Config``,
whose errors name the key and the family), the ``LayerInfo`` builder of one call
(``_Builder``) and the sizes most decoders share."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import cast

import torch

from .._validation import is_int
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..spec import (
    AttentionSpec,
    AttentionType,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    IndexerSpec,
    KVCacheDType,
    MambaSpec,
    MambaType,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from ..state_types import state_type_of
from ._layout import LayerInfo, MLADims, StateDims

__all__ = [  # what the family readers and the entry point use
    "_Builder",
    "_Config",
    "_Decoder",
    "_Family",
    "_Layers",
    "_head_dim",
    "_kv_heads",
    "_self_attn",
    "_type_list_or",
]


_DTYPE_NAMES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class _Config:
    """Typed, checked reads of one family's config mapping; errors name key and family."""

    def __init__(self, data: Mapping[str, object], family: str, where: str = "") -> None:
        self.data = data
        self.family = family
        self.where = where  # "text_config." for nested configs, in messages

    def _missing(self, key: str) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"layout_from_hf_config: a {self.family} config needs key "
            f"{self.where + key!r}, which is missing"
        )

    def _wrong(self, key: str, expected: str, value: object) -> ArgumentTypeError:
        return ArgumentTypeError(
            f"layout_from_hf_config: {self.family} config key {self.where + key!r} must be "
            f"{expected}, got {value!r} ({type(value).__name__})"
        )

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str) -> object:
        if key not in self.data:
            raise self._missing(key)
        return self.data[key]

    def int_(self, key: str, default: int | None = None) -> int:
        if key not in self.data or (self.data[key] is None and default is not None):
            if default is None:
                raise self._missing(key)
            return default
        value = self.data[key]
        if not is_int(value):
            raise self._wrong(key, "a positive int", value)
        if cast("int", value) < 1:
            raise InvalidArgumentError(
                f"layout_from_hf_config: {self.family} config key {self.where + key!r} must "
                f"be a positive int, got {value!r}"
            )
        return cast("int", value)

    def opt_int(self, key: str, default: int | None = None) -> int | None:
        """An int or ``None`` (JSON null); ``default`` when the key is absent."""
        if key not in self.data:
            return default
        if self.data[key] is None:
            return None
        return self.int_(key)

    def index(self, key: str) -> int:
        value = self.raw(key)
        if not is_int(value) or cast("int", value) < 0:
            raise self._wrong(key, "an int >= 0", value)
        return cast("int", value)

    def opt_float(self, key: str, default: float | None = None) -> float | None:
        if key not in self.data:
            return default
        value = self.data[key]
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._wrong(key, "a number or null", value)
        return float(value)

    def bool_(self, key: str, default: bool) -> bool:
        if key not in self.data or self.data[key] is None:
            return default
        value = self.data[key]
        if not isinstance(value, bool):
            raise self._wrong(key, "a bool", value)
        return value

    def str_(self, key: str) -> str:
        value = self.raw(key)
        if not isinstance(value, str):
            raise self._wrong(key, "a string", value)
        return value

    def list_(self, key: str) -> list[object]:
        value = self.raw(key)
        if not isinstance(value, list):
            raise self._wrong(key, "a list", value)
        return cast("list[object]", value)

    def int_list(self, key: str) -> list[int]:
        items = self.list_(key)
        if not all(is_int(v) and cast("int", v) >= 0 for v in items):
            raise self._wrong(key, "a list of ints >= 0", items)
        return cast("list[int]", items)

    def indices(self, key: str, num_layers: int) -> set[int]:
        """A list of layer indices, each below ``num_layers``."""
        found = self.int_list(key)
        bad = [i for i in found if i >= num_layers]
        if bad:
            raise InvalidArgumentError(
                f"layout_from_hf_config: {self.family} config key {self.where + key!r} lists "
                f"layers {bad}, but the model has {num_layers} layers (0..{num_layers - 1})"
            )
        return set(found)

    def layer_types(self, key: str, num_layers: int, allowed: Sequence[str]) -> list[str]:
        """A per-layer list of type names: one per layer, each in ``allowed``."""
        items = self.list_(key)
        if len(items) != num_layers:
            raise InvalidArgumentError(
                f"layout_from_hf_config: {self.family} config key {self.where + key!r} must "
                f"have one entry per layer ({num_layers}), got {len(items)}"
            )
        for i, item in enumerate(items):
            if item not in allowed:
                raise InvalidArgumentError(
                    f"layout_from_hf_config: {self.family} config key {self.where}{key}[{i}] "
                    f"must be one of {list(allowed)}, got {item!r}"
                )
        return cast("list[str]", items)

    def sub(self, key: str) -> _Config:
        value = self.raw(key)
        if not isinstance(value, Mapping):
            raise self._wrong(key, "an object", value)
        return _Config(cast("Mapping[str, object]", value), self.family, f"{self.where}{key}.")

    def dtype(self) -> torch.dtype | None:
        """The checkpoint dtype (``torch_dtype``, or ``dtype`` in newer files), or ``None``."""
        for key in ("torch_dtype", "dtype"):
            value = self.data.get(key)
            if value is None:
                continue
            name = value.removeprefix("torch.") if isinstance(value, str) else None
            if name is None or name not in _DTYPE_NAMES:
                raise InvalidArgumentError(
                    f"layout_from_hf_config: {self.family} config key {self.where + key!r} must "
                    f"name one of {sorted(_DTYPE_NAMES)}, got {value!r}; pass dtype= to "
                    "override it"
                )
            return _DTYPE_NAMES[name]
        return None


class _Builder:
    """Builds ``LayerInfo`` records for one call (dtype, block size, cache dtype fixed)."""

    def __init__(
        self,
        dtype: torch.dtype,
        block_size: int,
        kv_cache_dtype: KVCacheDType,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.dtype = dtype
        self.state_dtype = state_dtype
        self.block_size = block_size
        self.kv_cache_dtype: KVCacheDType = kv_cache_dtype

    def attention(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        attn_type: AttentionType = AttentionType.DECODER,
        sliding_window: int | None = None,
        attention_chunk_size: int | None = None,
        logits_soft_cap: float | None = None,
        has_sinks: bool = False,
        scale: float | None = None,
        use_rope: bool = True,
        mm_prefix: bool = False,
    ) -> LayerInfo:
        spec: AttentionSpec
        bs, h, d, dt, kvd = (
            self.block_size,
            num_kv_heads,
            head_size,
            self.dtype,
            self.kv_cache_dtype,
        )
        if attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
            spec = EncoderOnlyAttentionSpec(
                block_size=bs, num_kv_heads=h, head_size=d, dtype=dt, kv_cache_dtype=kvd
            )
        elif attn_type is AttentionType.ENCODER_DECODER:
            spec = CrossAttentionSpec(
                block_size=bs, num_kv_heads=h, head_size=d, dtype=dt, kv_cache_dtype=kvd
            )
        elif attention_chunk_size is not None:
            spec = ChunkedLocalAttentionSpec(
                block_size=bs,
                num_kv_heads=h,
                head_size=d,
                dtype=dt,
                kv_cache_dtype=kvd,
                attention_chunk_size=attention_chunk_size,
            )
        elif sliding_window is not None:
            spec = SlidingWindowSpec(
                block_size=bs,
                num_kv_heads=h,
                head_size=d,
                dtype=dt,
                kv_cache_dtype=kvd,
                sliding_window=sliding_window,
                mm_prefix=mm_prefix,
            )
        else:
            spec = FullAttentionSpec(
                block_size=bs,
                num_kv_heads=h,
                head_size=d,
                dtype=dt,
                kv_cache_dtype=kvd,
                mm_prefix=mm_prefix,
            )
        return LayerInfo(
            spec=spec,
            attn_type=attn_type,
            num_heads=num_heads,
            sliding_window=sliding_window,
            attention_chunk_size=attention_chunk_size,
            logits_soft_cap=logits_soft_cap,
            has_sinks=has_sinks,
            scale=scale if scale is not None else head_size**-0.5,
            use_rope=use_rope,
        )

    def mla(
        self, *, num_heads: int, dims: MLADims, scale: float, index_topk: int | None = None
    ) -> LayerInfo:
        spec = MLAAttentionSpec(
            block_size=self.block_size,
            head_size=dims.latent_size,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        return LayerInfo(
            spec=spec,
            attn_type=AttentionType.DECODER,
            num_heads=num_heads,
            scale=scale,
            mla=dims,
            index_topk=index_topk,
        )

    def indexer(self, *, num_heads: int, head_size: int, index_topk: int) -> LayerInfo:
        """A DeepSeek sparse-attention indexer: ``num_heads`` index heads of
        ``head_size``, keeping ``index_topk`` positions per query token."""
        spec = IndexerSpec(
            block_size=self.block_size,
            head_size=head_size,
            dtype=self.dtype,
            index_topk=index_topk,
        )
        return LayerInfo(
            spec=spec,
            attn_type=AttentionType.DECODER,
            num_heads=num_heads,
            scale=head_size**-0.5,
            use_rope=True,
        )

    def state(self, dims: StateDims) -> LayerInfo:
        shapes = dims.state_shapes
        mamba_type: MambaType = dims.mamba_type
        spec = MambaSpec(
            block_size=self.block_size,
            shapes=shapes,
            # Conv states in the model dtype, recurrent states in state_dtype.
            dtypes=state_type_of(mamba_type).state_dtypes(self.dtype, self.state_dtype),
            mamba_type=mamba_type,
        )
        return LayerInfo(spec=spec, state=dims, use_rope=False)


_Layers = Iterator[tuple[str, LayerInfo]]


def _kv_heads(cfg: _Config, num_heads: int) -> int:
    """``num_key_value_heads``; absent or null means ``num_attention_heads`` (multi-head
    attention), as LlamaConfig and the configuration classes derived from it document."""
    return cfg.int_("num_key_value_heads", default=num_heads)


def _head_dim(cfg: _Config, num_heads: int, default: int | None = None) -> int:
    """``head_dim``; absent or null means ``default`` where the family's configuration
    class documents a number, else ``hidden_size // num_attention_heads`` (transformers
    LlamaConfig: head_dim defaults to hidden_size // num_attention_heads)."""
    if cfg.has("head_dim") and cfg.data["head_dim"] is not None:
        return cfg.int_("head_dim")
    if default is not None:
        return default
    hidden = cfg.int_("hidden_size")
    if hidden % num_heads:
        raise InvalidArgumentError(
            f"layout_from_hf_config: {cfg.family} config has no head_dim and hidden_size="
            f"{hidden} is not a multiple of num_attention_heads={num_heads}"
        )
    return hidden // num_heads


class _Decoder:
    """The plain decoder attention sizes most families share."""

    def __init__(self, cfg: _Config, head_dim_default: int | None = None) -> None:
        self.num_layers = cfg.int_("num_hidden_layers")
        self.num_heads = cfg.int_("num_attention_heads")
        self.num_kv_heads = _kv_heads(cfg, self.num_heads)
        self.head_dim = _head_dim(cfg, self.num_heads, head_dim_default)


def _self_attn(prefix: str, i: int) -> str:
    return f"{prefix}.{i}.self_attn"


def _type_list_or(
    cfg: _Config, num_layers: int, allowed: Sequence[str], rule: Callable[[int], str]
) -> list[str]:
    """``layer_types`` when the file has it, else ``rule(i)`` per layer."""
    if cfg.has("layer_types") and cfg.data["layer_types"] is not None:
        return cfg.layer_types("layer_types", num_layers, allowed)
    return [rule(i) for i in range(num_layers)]


_Family = Callable[[_Config, _Builder], _Layers]
"""A family's reader: the config and the builder -> its (name, layer) pairs, in order."""
