"""``DemoModel`` (embeddings, an encoder and a decoder stack of mixers, an LM head), its
layer kinds (``LAYER_KINDS``, ``MODELS``) and ``demo_layout``, which shrinks a real
model's layout to them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from ..errors import InvalidArgumentError
from ..kinds import rules_for
from ..models import ModelLayout
from ..params import LayerParams
from ..runtime import AttentionRuntime
from ..spec import KVCacheSpec, MambaSpec
from ..state_types import state_type_of
from ._attention import KIND_RULES, MLA, Attention
from ._mixer import Context, Mixer, rms_norm
from ._state import STATE_KINDS, STATE_MIXERS, StateSizes

_SINK_TOKENS = 4
"""Sink tokens of a ``sink_tokens`` layer (``SinkFullAttentionSpec.sink_len``)."""


LAYER_KINDS = (
    *(name for name, r in KIND_RULES.items() if not r.latent),
    *(name for name, r in KIND_RULES.items() if r.latent),
    *STATE_KINDS,
)
"""``DemoModel``'s layer kinds; an attention or MLA kind with the suffix ``"_sinks"``
(``"full_sinks"``) also has learned per-head sink logits (gpt-oss)."""
SINKS_SUFFIX = "_sinks"


MODELS: dict[str, tuple[str, ...]] = {
    "default": ("full", "mamba", "window", "mamba", "full", "window"),
    "hybrid": ("full", "mamba", "window", "gdn", "linear", "short_conv", "full", "gdn"),
}


DEMO_LAYERS_PER_KIND = 2
"""Layers of each kind ``demo_layout`` keeps."""


DemoMode = Literal["decoder", "encoder", "encoder-decoder"]
"""How ``run_demo`` serves a layout: ``"decoder"`` (prefill and greedy decode),
``"encoder"`` (encoder-only layers: each prompt encoded whole, no decode) or
``"encoder-decoder"`` (an encoder stack, then a decoder stack reading its output)."""


def _base_kind(kind: str) -> tuple[str, bool]:
    """``kind`` without its ``"_sinks"`` suffix, and whether it had one."""
    if kind.endswith(SINKS_SUFFIX):
        return kind.removesuffix(SINKS_SUFFIX), True
    return kind, False


def _encodes(kind: str) -> bool:
    """Whether a layer kind is the encoder stack's: attention that keeps no cache
    (encoder-only, each prompt encoded whole)."""
    rules = KIND_RULES.get(_base_kind(kind)[0])
    return rules is not None and not rules.has_cache


def _reads_encoder(kind: str) -> bool:
    """Whether a layer kind reads the encoder's output (cross-attention)."""
    rules = KIND_RULES.get(_base_kind(kind)[0])
    return rules is not None and rules.writes == "encoder"


def _stack_problem(kinds: Sequence[str]) -> tuple[int, str] | None:
    """The first layer the demo's two stacks cannot place, and why: encoder-only layers
    form the encoder stack and must all come first; every other layer is in the
    decoder stack, whose cross-attention layers read the encoder's output."""
    first_decoder: int | None = None
    for i, kind in enumerate(kinds):
        if _encodes(kind):
            if first_decoder is not None:
                return i, (
                    f"an encoder-only layer after a decoder layer (index {first_decoder}); "
                    f"the demo runs the encoder-only layers first, as one encoder stack"
                )
        else:
            if first_decoder is None:
                first_decoder = i
            if _reads_encoder(kind) and first_decoder == 0:
                return i, (
                    "a cross-attention layer with no encoder-only layer before it: there "
                    "is no encoder output for it to read"
                )
    return None


def demo_layout(model: ModelLayout, *, per_kind: int = DEMO_LAYERS_PER_KIND) -> tuple[str, ...]:
    """A real model's layer kinds, shrunk for ``DemoModel``: the model's layers in
    order, keeping the first ``per_kind`` of each kind; the demo gives them its own small
    sizes. Kinds: ``"full"``, ``"window"``, ``"chunked"`` (chunked-local),
    ``"sink_tokens"`` (``sink_full_attention``), ``"mla"``, ``"mla_window"``
    (``sliding_window_mla``), ``"encoder"`` (encoder-only), ``"cross"``
    (cross-attention), and one per state-layer type (``"mamba"`` for Mamba2,
    ``"mamba1"``, ``"gdn"``, ``"linear"``, ``"short_conv"``); attention layers with
    learned sinks (``LayerInfo.has_sinks``) get the suffix ``"_sinks"``.

    Raises:
        InvalidArgumentError: a layer the demo cannot run: a kind it has no mixer for,
            an encoder-only layer after decoder layers (the demo runs one encoder stack,
            then the decoder stack), or a cross-attention layer with no encoder-only
            layer before it (nothing to read); the message names the layer and why.
    """
    kinds: list[str] = []
    names: list[str] = []
    for name, info in model.layers.items():
        spec = info.spec
        mamba_type = spec.mamba_type if isinstance(spec, MambaSpec) else None
        what = spec.kind.value + (f" ({mamba_type})" if mamba_type else "")
        kind = (
            state_type_of(spec).short_name
            if isinstance(spec, MambaSpec)
            else rules_for(spec).short_name
        )
        if kind is None or kind not in LAYER_KINDS:
            raise InvalidArgumentError(
                f"the demo runs {', '.join(sorted(LAYER_KINDS))} layers (see "
                f"demo_layout); {model.model_type} layer {name!r} is {what}, which it has "
                f"no mixer for"
            )
        kinds.append(kind + (SINKS_SUFFIX if info.has_sinks else ""))
        names.append(name)
    problem = _stack_problem(kinds)
    if problem is not None:
        index, why = problem
        raise InvalidArgumentError(
            f"the demo cannot run {model.model_type} layer {names[index]!r}: it is {why}"
        )
    kept: list[str] = []
    for kind in kinds:
        if kept.count(kind) < per_kind:
            kept.append(kind)
    return tuple(kept)


class DemoModel:
    """A small model: embeddings, stacks of pre-norm mixers with residuals, an LM head.

    ``layout`` names each layer (``LAYER_KINDS``): full / window / chunked-local
    attention, sink_tokens (full attention with sink tokens), mla / mla_window (latent
    attention), encoder (encoder-only), cross (cross-attention), mamba (Mamba2), mamba1,
    gdn (Gated DeltaNet), linear (linear attention with decay), short_conv (LFM2
    style); ``"_sinks"`` adds learned sink logits to an attention kind. Encoder-only
    layers, which must come first, form the encoder stack (``encoder_layers``); the
    others the decoder stack (``decoder_layers``), which reads the encoder's output in
    its cross-attention layers. The two stacks share the embeddings.

    Sizes: attention ``num_heads`` x ``head_size`` (``num_kv_heads`` K/V heads), the
    ``window`` of sliding layers and the chunk of chunked-local layers; MLA
    ``num_heads`` heads, a latent of rank ``3 * head_size`` plus a RoPE key of
    ``head_size``, ``head_size`` no-RoPE query/key and value widths; Mamba1
    ``hidden`` channels, state ``d_state``, dt rank ``hidden // 16``.
    """

    def __init__(
        self,
        *,
        layout: Sequence[str] = MODELS["default"],
        vocab: int = 64,
        hidden: int = 64,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_size: int = 16,
        window: int = 8,
        chunk: int = 8,
        mamba_heads: int = 4,
        mamba_groups: int = 1,
        d_state: int = 16,
        conv_width: int = 4,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.device = torch.device(device)
        self.dtype = dtype
        if not layout:
            raise InvalidArgumentError(f"layout must name at least one layer, got {layout!r}")
        for kind in layout:
            base, sinks = _base_kind(kind)
            if base not in LAYER_KINDS or (sinks and base in STATE_KINDS):
                raise InvalidArgumentError(
                    f"unknown layer kind {kind!r} in layout; use one of {', '.join(LAYER_KINDS)} "
                    f"(attention and MLA kinds may end in {SINKS_SUFFIX!r})"
                )
        problem = _stack_problem(layout)
        if problem is not None:
            index, why = problem
            raise InvalidArgumentError(f"layout[{index}] ({layout[index]!r}) is {why}")

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(self.device, dtype)

        self.embed = rand(vocab, hidden)
        self.lm_head = rand(hidden, vocab, scale=hidden**-0.5)
        sizes = StateSizes(
            hidden, mamba_heads, mamba_groups, d_state, conv_width, block_size, dtype, self.device
        )
        # Mixers of every kind (each with its own spec and parameter types).
        self.layers: dict[str, Mixer[Any, Any]] = {}
        for i, kind in enumerate(layout):
            base, sinks = _base_kind(kind)
            mixer: Mixer[Any, Any]
            rules = KIND_RULES.get(base)
            # The demo's size for the kind's one length parameter, if it has one.
            extent = (
                {"window": window, "chunk": chunk, "sink_len": _SINK_TOKENS}[rules.extent]
                if rules is not None and rules.extent is not None
                else None
            )
            if rules is not None and not rules.latent:
                mixer = Attention(
                    rand,
                    rules=rules,
                    hidden=hidden,
                    heads=num_heads,
                    kv_heads=num_kv_heads,
                    head_size=head_size,
                    extent=extent,
                    block_size=block_size,
                    dtype=dtype,
                    sinks=sinks,
                )
            elif rules is not None:
                mixer = MLA(
                    rand,
                    rules=rules,
                    hidden=hidden,
                    heads=num_heads,
                    rank=3 * head_size,
                    rope_dim=head_size,
                    nope_dim=head_size,
                    v_dim=head_size,
                    extent=extent,
                    block_size=block_size,
                    dtype=dtype,
                    sinks=sinks,
                )
            else:  # a state kind: the kinds were checked above
                mixer = STATE_MIXERS[STATE_KINDS[base]](rand, gen, sizes)
            self.layers[f"layers.{i}"] = mixer
        self.specs: dict[str, KVCacheSpec] = {name: m.spec for name, m in self.layers.items()}
        self.params: dict[str, LayerParams] = {name: m.params for name, m in self.layers.items()}
        names = list(self.layers)
        self.encoder_layers: tuple[str, ...] = tuple(
            n for n, kind in zip(names, layout, strict=True) if _encodes(kind)
        )
        """The encoder stack's layers (encoder-only), in order."""
        self.decoder_layers: tuple[str, ...] = tuple(
            n for n in names if n not in self.encoder_layers
        )
        """The decoder stack's layers (every other layer), in order."""
        self.mode: DemoMode = (
            "decoder"
            if not self.encoder_layers
            else "encoder"
            if not self.decoder_layers
            else "encoder-decoder"
        )

    def forward_step(
        self,
        runtime: AttentionRuntime,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        encoder: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states of the step's tokens (laid out in ``StepBatch.order``) through the
        decoder stack, via the runtime. ``positions``: each token's position in its
        sequence (MLA layers need them); ``encoder``: the encoder outputs of
        ``StepBatch.encoder_order``, concatenated (cross-attention layers write them)."""
        ctx = Context(positions=positions, encoder=encoder)
        x = self.embed[tokens]
        for name in self.decoder_layers:
            x = x + self.layers[name].step(runtime, name, rms_norm(x), ctx).to(x.dtype)
        return rms_norm(x)

    def forward_dense(
        self, tokens: torch.Tensor, *, encoder: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hidden states of one whole sequence through the decoder stack, with no cache
        (the check); ``encoder``: the request's encoder output (cross-attention)."""
        ctx = Context(encoder=encoder)
        x = self.embed[tokens]
        for name in self.decoder_layers:
            x = x + self.layers[name].dense(rms_norm(x), ctx).to(x.dtype)
        return rms_norm(x)

    def encode_step(self, runtime: AttentionRuntime, tokens: torch.Tensor) -> torch.Tensor:
        """The encoder stack's output for the step's whole prompts, via the runtime."""
        x = self.embed[tokens]
        for name in self.encoder_layers:
            x = x + self.layers[name].step(runtime, name, rms_norm(x)).to(x.dtype)
        return rms_norm(x)

    def encode_dense(self, tokens: torch.Tensor) -> torch.Tensor:
        """The encoder stack's output for one whole prompt, with no cache (the check)."""
        x = self.embed[tokens]
        for name in self.encoder_layers:
            x = x + self.layers[name].dense(rms_norm(x)).to(x.dtype)
        return rms_norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head
