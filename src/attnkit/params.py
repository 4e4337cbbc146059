"""Per-layer parameters: what an impl needs beyond the layer's cache spec.

``AttentionLayerParams`` for attention layers; one class per state-layer type
(``Mamba1LayerParams``, ``Mamba2LayerParams``, ``GatedDeltaNetLayerParams``, ``LinearAttentionLayerParams``,
``ShortConvLayerParams``), each naming the input class its layers take
(``inputs_type``, from ``attnkit.state_inputs``). Impls are generic over the class
they take (``AttentionImpl[M, S, AttentionLayerParams]``), so a backend author's
impl reads typed fields with no ``isinstance``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import ClassVar

import torch

from ._validation import is_positive_int
from .capabilities import AttentionFeature
from .errors import InvalidArgumentError
from .kinds import rules_for
from .spec import AttentionSpec, MambaSpec
from .state_inputs import (
    GatedDeltaNetInputs,
    LinearAttentionInputs,
    Mamba1Inputs,
    Mamba2Inputs,
    ShortConvInputs,
)

__all__ = [
    "AttentionLayerParams",
    "GatedDeltaNetLayerParams",
    "LayerParams",
    "LinearAttentionLayerParams",
    "MLAProjection",
    "Mamba1LayerParams",
    "Mamba2LayerParams",
    "ShortConvLayerParams",
    "StateLayerParams",
    "attention_params_problems",
    "check_state_shapes",
    "mla_params_problems",
    "mla_projection_problems",
    "quant_scale_problems",
    "rank_layer_params",
]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class MLAProjection:
    """MLA's per-head up-projection of the latent (DeepSeek-V2, arXiv:2405.04434 2.1).

    With it in ``AttentionLayerParams.mla_projection`` an MLA layer's impl applies the
    projections itself: it takes the **un-absorbed** query ``[T, H, N + P]`` (``q_nope``
    then the rotated ``q_pe``) and returns ``[T, H, V]``, and may run a step in either
    form: absorbed (``q_nope @ W_UK`` scored against the latent, the ``[R]`` result
    multiplied by ``W_UV``) or up-projected (per-head keys ``[c @ W_UK, k_pe]`` and
    values ``c @ W_UV``, then ordinary attention). Both give the same result; they cost
    different FLOPs (docs/backends.md, "triton_mla").

    Attributes:
        w_uk: ``[H, R, N]``: head ``h``'s no-rope key is ``c @ w_uk[h]`` (``R`` the
            kv_lora_rank, ``N`` qk_nope_head_dim).
        w_uv: ``[H, R, V]``: head ``h``'s value is ``c @ w_uv[h]`` (``V`` v_head_dim).

    Both have the model's dtype and live where the layer runs; impls read them in place
    (no copy is kept, so a weight updated in place is seen by the next step).
    """

    w_uk: torch.Tensor
    w_uv: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("w_uk", "w_uv"):
            t: object = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise InvalidArgumentError(
                    f"MLAProjection.{name} must be a torch.Tensor [H, R, N or V], "
                    f"got {type(t).__name__}"
                )
            if t.dim() != 3 or 0 in t.shape or not t.is_floating_point():
                raise InvalidArgumentError(
                    f"MLAProjection.{name} must be a floating-point [H, R, N or V] tensor "
                    f"with no empty dimension, got {t.dtype} {list(t.shape)}"
                )
        uk, uv = self.w_uk, self.w_uv
        if uk.shape[:2] != uv.shape[:2] or uk.dtype != uv.dtype or uk.device != uv.device:
            raise InvalidArgumentError(
                f"MLAProjection.w_uk and w_uv must share H, R, dtype and device, got "
                f"{uk.dtype} {list(uk.shape)} on {uk.device} and "
                f"{uv.dtype} {list(uv.shape)} on {uv.device}"
            )

    @classmethod
    def from_kv_b_proj(
        cls, weight: torch.Tensor, *, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
    ) -> MLAProjection:
        """Split a ``kv_b_proj`` weight ``[H * (N + V), R]`` (``nn.Linear(R, H * (N + V))``,
        output laid out per head as ``[k_nope | v]``, DeepSeek-V2/V3's layout) into views.

        No copy: ``w_uk`` and ``w_uv`` are strided views of ``weight``.
        """
        given: object = weight  # untyped callers may pass anything
        if not isinstance(given, torch.Tensor) or given.dim() != 2:
            got = list(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
            raise InvalidArgumentError(
                f"MLAProjection.from_kv_b_proj: weight must be a 2-D tensor "
                f"[H * (N + V), R], got {got}"
            )
        for name, value in (
            ("num_heads", num_heads),
            ("qk_nope_head_dim", qk_nope_head_dim),
            ("v_head_dim", v_head_dim),
        ):
            if not is_positive_int(value):
                raise InvalidArgumentError(
                    f"MLAProjection.from_kv_b_proj: {name} must be a positive int, got {value!r}"
                )
        rows = num_heads * (qk_nope_head_dim + v_head_dim)
        if weight.shape[0] != rows:
            raise InvalidArgumentError(
                f"MLAProjection.from_kv_b_proj: weight must have num_heads * "
                f"(qk_nope_head_dim + v_head_dim) = {rows} rows, got {list(weight.shape)}"
            )
        per_head = weight.view(num_heads, qk_nope_head_dim + v_head_dim, weight.shape[1])
        return cls(
            w_uk=per_head[:, :qk_nope_head_dim].transpose(1, 2),
            w_uv=per_head[:, qk_nope_head_dim:].transpose(1, 2),
        )

    @property
    def num_heads(self) -> int:
        """``H``."""
        return int(self.w_uk.shape[0])

    @property
    def kv_lora_rank(self) -> int:
        """``R``, the width of the compressed KV (the latent's first channels)."""
        return int(self.w_uk.shape[1])

    @property
    def qk_nope_head_dim(self) -> int:
        """``N``, the no-rope part of each head's query and key."""
        return int(self.w_uk.shape[2])

    @property
    def v_head_dim(self) -> int:
        """``V``, each head's value width (the layer's output width)."""
        return int(self.w_uv.shape[2])


def _check_quant_scale(name: str, value: object) -> None:
    """A per-tensor scale (a finite number > 0) or a non-empty tuple of them (per head)."""
    where = f"AttentionLayerParams.{name}"
    if isinstance(value, tuple):
        items: tuple[object, ...] = value  # pyright: ignore[reportUnknownVariableType]  # narrowed from object
        if not items:
            raise InvalidArgumentError(
                f"{where} must be a finite float > 0 or a tuple of one per K/V head, got ()"
            )
        for i, item in enumerate(items):
            if not _positive_scale(item):
                raise InvalidArgumentError(
                    f"{where}[{i}] must be a finite float > 0 (the scale of K/V head {i}), "
                    f"got {item!r}"
                )
        return
    if not _positive_scale(value):
        raise InvalidArgumentError(
            f"{where} must be a finite float > 0 or a tuple of one per K/V head, got {value!r}"
        )


def _positive_scale(value: object) -> bool:
    return (
        isinstance(value, float | int)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _per_head(scale: float | tuple[float, ...], num_kv_heads: int) -> tuple[float, ...]:
    if isinstance(scale, tuple):
        return tuple(float(s) for s in scale)
    return (float(scale),) * num_kv_heads


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionLayerParams:
    """What one attention layer needs beyond its cache spec.

    Attributes:
        num_heads: query heads (Hq); a multiple of the spec's ``num_kv_heads``.
        scale: softmax scale; ``None`` means ``head_size ** -0.5``.
        logits_soft_cap: soft-cap of the scores, or ``None``.
        alibi_slopes: one ALiBi slope per query head, or ``None``.
        sinks: float32 ``[Hq]`` learned sink logits, or ``None``.
        return_lse: whether the layer needs the log-sum-exp back.
        v_head_size: width of the values when it differs from the keys (MLA: the
            latent's first ``v_head_size`` channels are the values); ``None``: the
            spec's ``head_size``.
        sink_key, sink_value: ``[sink_len, Hkv, D]`` learned sink tokens of a
            ``sink_full_attention`` layer, written in front of every request's context.
        k_scale, v_scale: quantisation scales of an fp8 cache: the cache stores
            ``key / k_scale`` (and ``value / v_scale``); 1.0 for other caches. A float
            is one scale for the tensor; a tuple of ``num_kv_heads`` floats is one per
            K/V head (calibrated offline; the ``per_head_quant_scales`` feature, an
            ``fp8_e4m3`` cache): head ``n`` stores ``key[:, n] / k_scale[n]``.
            Tensor parallelism slices them with the heads (``rank_layer_params``).
            A ``*_per_token_head`` cache computes its scales per token when it writes,
            so these stay 1.0.
        mla_projection: MLA layers only, opt-in: ``W_UK``/``W_UV`` for an impl that
            applies them itself (the ``mla_projection`` feature). The layer then takes
            the un-absorbed query ``[T, H, N + P]`` and returns ``[T, H, V]``;
            ``v_head_size`` is set to ``V`` and ``scale`` defaults to
            ``(N + P) ** -0.5``. ``None``: the caller absorbs (query ``[T, H, D]``,
            output ``[T, H, v_head_size]``).
        index_topk: MLA layers of DeepSeek sparse attention only: each query reads the
            (at most) ``index_topk`` positions its indexer selected, passed to ``forward``
            as a ``SparseSelection`` (the ``sparse_attention`` feature); ``None``: dense.
    """

    num_heads: int
    scale: float | None = None
    logits_soft_cap: float | None = None
    alibi_slopes: tuple[float, ...] | None = None
    sinks: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    return_lse: bool = False
    v_head_size: int | None = None
    sink_key: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    sink_value: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    k_scale: float | tuple[float, ...] = 1.0
    v_scale: float | tuple[float, ...] = 1.0
    mla_projection: MLAProjection | None = dataclasses.field(default=None, compare=False)
    index_topk: int | None = None

    def __post_init__(self) -> None:
        if not is_positive_int(self.num_heads):
            raise InvalidArgumentError(
                f"AttentionLayerParams.num_heads must be a positive int, got {self.num_heads!r}"
            )
        if self.scale is not None and not (math.isfinite(self.scale) and self.scale > 0):
            raise InvalidArgumentError(
                f"AttentionLayerParams.scale must be a finite float > 0, got {self.scale!r}"
            )
        if self.logits_soft_cap is not None and not (
            math.isfinite(self.logits_soft_cap) and self.logits_soft_cap > 0
        ):
            raise InvalidArgumentError(
                f"AttentionLayerParams.logits_soft_cap must be a finite float > 0 or None, "
                f"got {self.logits_soft_cap!r}"
            )
        if self.alibi_slopes is not None and len(self.alibi_slopes) != self.num_heads:
            raise InvalidArgumentError(
                f"AttentionLayerParams.alibi_slopes must have num_heads={self.num_heads} "
                f"entries, got {len(self.alibi_slopes)}"
            )
        if self.sinks is not None and tuple(self.sinks.shape) != (self.num_heads,):
            raise InvalidArgumentError(
                f"AttentionLayerParams.sinks must have shape [num_heads={self.num_heads}], "
                f"got {list(self.sinks.shape)}"
            )
        for name in ("k_scale", "v_scale"):
            _check_quant_scale(name, getattr(self, name))
        if self.v_head_size is not None and not is_positive_int(self.v_head_size):
            raise InvalidArgumentError(
                f"AttentionLayerParams.v_head_size must be a positive int or None, got {self.v_head_size!r}"
            )
        if (self.sink_key is None) != (self.sink_value is None):
            raise InvalidArgumentError(
                "AttentionLayerParams.sink_key and sink_value must be given together"
            )
        if (
            self.sink_key is not None
            and self.sink_value is not None
            and (self.sink_key.dim() != 3 or self.sink_key.shape != self.sink_value.shape)
        ):
            raise InvalidArgumentError(
                f"AttentionLayerParams.sink_key and sink_value must both be [sink_len, Hkv, D], "
                f"got {list(self.sink_key.shape)} and {list(self.sink_value.shape)}"
            )
        if self.index_topk is not None and not is_positive_int(self.index_topk):
            raise InvalidArgumentError(
                f"AttentionLayerParams.index_topk must be a positive int or None, got "
                f"{self.index_topk!r}"
            )
        proj: object = self.mla_projection
        if proj is not None:
            if not isinstance(proj, MLAProjection):
                raise InvalidArgumentError(
                    f"AttentionLayerParams.mla_projection must be an MLAProjection or None, "
                    f"got {type(proj).__name__}"
                )
            if proj.num_heads != self.num_heads:
                raise InvalidArgumentError(
                    f"AttentionLayerParams.mla_projection must have num_heads={self.num_heads} "
                    f"heads, got w_uk {list(proj.w_uk.shape)}"
                )
            if self.v_head_size not in (None, proj.v_head_dim):
                raise InvalidArgumentError(
                    f"AttentionLayerParams.v_head_size must be None or the projection's "
                    f"v_head_dim={proj.v_head_dim} (the layer returns per-head values), "
                    f"got {self.v_head_size}"
                )
            # The layer's output is the per-head value width (frozen: set once, here).
            object.__setattr__(self, "v_head_size", proj.v_head_dim)

    @property
    def per_head_quant_scales(self) -> bool:
        """Whether ``k_scale`` or ``v_scale`` holds one scale per K/V head."""
        return isinstance(self.k_scale, tuple) or isinstance(self.v_scale, tuple)

    def head_scales(self, num_kv_heads: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """``(k_scale, v_scale)`` as one float per K/V head (a per-tensor scale repeated)."""
        return (
            _per_head(self.k_scale, num_kv_heads),
            _per_head(self.v_scale, num_kv_heads),
        )

    @property
    def features(self) -> frozenset[AttentionFeature]:
        """The optional features these parameters ask a backend for."""
        wanted = {
            AttentionFeature.LOGITS_SOFT_CAP: self.logits_soft_cap is not None,
            AttentionFeature.ALIBI: self.alibi_slopes is not None,
            AttentionFeature.ATTENTION_SINKS: self.sinks is not None,
            AttentionFeature.RETURN_LSE: self.return_lse,
            AttentionFeature.MLA_PROJECTION: self.mla_projection is not None,
            AttentionFeature.SPARSE_ATTENTION: self.index_topk is not None,
            AttentionFeature.PER_HEAD_QUANT_SCALES: self.per_head_quant_scales,
        }
        return frozenset(f for f, on in wanted.items() if on)


def attention_params_problems(
    spec: AttentionSpec,
    params: AttentionLayerParams,
    *,
    backend: str,
    supported_features: frozenset[AttentionFeature],
) -> list[str]:
    """What keeps a backend whose impls take plain K/V heads from running a layer.

    For impls to check at construction, so a bad layer fails before its first step:
    features the backend does not declare, values narrower than keys (MLA), sink
    tokens, and a query-head count that is not a multiple of the KV heads.
    """
    problems: list[str] = []
    unsupported = sorted(f.value for f in params.features - supported_features)
    if unsupported:
        supported = ", ".join(sorted(f.value for f in supported_features)) or "none"
        problems.append(
            f"the layer needs {', '.join(unsupported)}, which {backend} does not support "
            f"(supported features: {supported})"
        )
    if params.v_head_size not in (None, spec.head_size):
        problems.append(
            f"v_head_size={params.v_head_size} differs from head_size={spec.head_size}, "
            f"which {backend} does not support"
        )
    if params.sink_key is not None:
        problems.append("sink tokens (sink_key/sink_value) are not supported")
    if params.num_heads % spec.num_kv_heads:
        problems.append(
            f"num_heads={params.num_heads} is not a multiple of num_kv_heads={spec.num_kv_heads}"
        )
    problems.extend(quant_scale_problems(spec, params))
    return problems


def mla_params_problems(
    spec: AttentionSpec,
    params: AttentionLayerParams,
    *,
    backend: str,
    supported_features: frozenset[AttentionFeature],
) -> list[str]:
    """What keeps an absorbed-MLA backend from running an MLA layer with ``params``.

    The generic checks of :func:`attention_params_problems` (features, sink tokens, head
    counts), plus MLA's own: the values are the latent's first ``v_head_size`` channels,
    so ``v_head_size`` (the kv_lora_rank) must be at most the latent width; with a
    projection, :func:`mla_projection_problems`.
    """
    # v_head_size and the projection are checked here: narrower values are what MLA is.
    generic = dataclasses.replace(params, v_head_size=None, mla_projection=None)
    problems = attention_params_problems(
        spec, generic, backend=backend, supported_features=supported_features
    )
    if params.mla_projection is not None:
        return problems + mla_projection_problems(spec, params)
    rank = params.v_head_size
    if rank is not None and rank > spec.head_size:
        problems.append(
            f"v_head_size (the kv_lora_rank) must be at most the latent width "
            f"head_size={spec.head_size}, got {rank}"
        )
    return problems


def mla_projection_problems(spec: AttentionSpec, params: AttentionLayerParams) -> list[str]:
    """What keeps ``params.mla_projection`` from fitting ``spec`` (empty: fits, or none).

    The spec's latent width ``D`` is ``R + P`` (``P`` rope channels), so the
    projection's ``R`` must be at most ``D``; its weights must have the spec's dtype.
    For impls that declare the ``mla_projection`` feature to check at construction.
    """
    proj = params.mla_projection
    if proj is None:
        return []
    problems: list[str] = []
    if not rules_for(spec).latent:
        problems.append(f"mla_projection is for MLA layers, not {spec.kind.value}")
    if proj.kv_lora_rank > spec.head_size:
        problems.append(
            f"mla_projection's kv_lora_rank R={proj.kv_lora_rank} must be at most the "
            f"latent width head_size={spec.head_size} (D = R + rope)"
        )
    if proj.w_uk.dtype != spec.dtype:
        problems.append(
            f"mla_projection's weights must have the model dtype {spec.dtype}, "
            f"got {proj.w_uk.dtype}"
        )
    return problems


def quant_scale_problems(spec: AttentionSpec, params: AttentionLayerParams) -> list[str]:
    """What keeps ``params``' quantisation scales from fitting ``spec`` (empty: they fit).

    Per-head scales need one per K/V head of the spec and an ``fp8_e4m3`` cache (the
    only cache that stores ``key / k_scale``); an MLA latent, shared by every head,
    keeps a per-tensor scale; a ``*_per_token_head`` cache computes its own scales, so
    the static ones must stay 1.0.
    """
    problems: list[str] = []
    for name in ("k_scale", "v_scale"):
        value: float | tuple[float, ...] = getattr(params, name)
        if isinstance(value, tuple):
            if rules_for(spec).latent:
                problems.append(
                    f"{name} has {len(value)} per-head scales, but an MLA latent is shared "
                    f"by every head and keeps one per-tensor scale"
                )
            elif len(value) != spec.num_kv_heads:
                problems.append(
                    f"{name} must have one scale per K/V head (num_kv_heads="
                    f"{spec.num_kv_heads}), got {len(value)}"
                )
            elif spec.kv_cache_dtype != "fp8_e4m3":
                problems.append(
                    f"{name} holds per-head scales, which need kv_cache_dtype='fp8_e4m3', "
                    f"got {spec.kv_cache_dtype!r}"
                )
        elif spec.dynamic_kv_scales and float(value) != 1.0:
            problems.append(
                f"{name}={value!r}: a {spec.kv_cache_dtype!r} cache computes a scale per "
                f"token and head when it writes, so {name} must be 1.0"
            )
    return problems


def rank_layer_params(
    params: AttentionLayerParams, spec: AttentionSpec, *, tensor_parallel: int, rank: int
) -> AttentionLayerParams:
    """``params`` as tensor-parallel rank ``rank`` of ``tensor_parallel`` holds them:
    ``num_heads`` divided, per-head K/V scales sliced with the K/V heads the kind's split
    gives the rank (``spec`` is the whole layer's). With fewer K/V heads than ranks each
    head sits on ``tensor_parallel / num_kv_heads`` consecutive ranks, and so does its
    scale. Context parallelism shards tokens, not heads: every rank keeps the scales.

    Raises:
        InvalidArgumentError: a size or rank that does not split the layer, or scales
            that do not fit ``spec`` (``quant_scale_problems``).
    """
    if not is_positive_int(tensor_parallel):
        raise InvalidArgumentError(
            f"rank_layer_params: tensor_parallel must be a positive int, got {tensor_parallel!r}"
        )
    given: object = rank  # untyped callers may pass anything
    if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given < tensor_parallel:
        raise InvalidArgumentError(
            f"rank_layer_params: rank must be an int in [0, {tensor_parallel}), got {rank!r}"
        )
    problems = quant_scale_problems(spec, params)
    if problems:
        raise InvalidArgumentError(f"rank_layer_params: params: {'; '.join(problems)}")
    if params.num_heads % tensor_parallel:
        raise InvalidArgumentError(
            f"rank_layer_params: tensor_parallel={tensor_parallel} does not divide "
            f"params.num_heads={params.num_heads}"
        )
    split = rules_for(spec).tensor_split(spec, tensor_parallel, "rank_layer_params")
    first = (rank // split.kv_replicas) * split.kv_heads

    def mine(scale: float | tuple[float, ...]) -> float | tuple[float, ...]:
        if not isinstance(scale, tuple) or split.kv_heads == spec.num_kv_heads:
            return scale
        return scale[first : first + split.kv_heads]

    return dataclasses.replace(
        params,
        num_heads=params.num_heads // tensor_parallel,
        k_scale=mine(params.k_scale),
        v_scale=mine(params.v_scale),
    )


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Mamba2LayerParams:
    """Weights and sizes of a Mamba2 layer's state-space core (conv1d + SSD).

    The model keeps the projections, gating and norm; the backend runs the part that
    reads and writes the cached states. Letters: H heads, P head dim, G groups, N state
    size, W conv width, C = H*P + 2*G*N conv channels.

    Attributes:
        num_heads, head_dim, n_groups, d_state: H, P, G, N.
        conv_weight: ``[C, W]`` depthwise conv weight; conv_bias ``[C]`` or ``None``.
        A: ``[H]`` (negative) decay rates; D ``[H]`` skip or ``None``; dt_bias ``[H]``
            or ``None``.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        chunk_size: SSD chunk length for prefill.

    Spec shapes for such a layer: ``MambaSpec(shapes=params.state_shapes, ...)``.
    """

    inputs_type: ClassVar[type[Mamba2Inputs]] = Mamba2Inputs

    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None = None
    A: torch.Tensor
    D: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    dt_softplus: bool = True
    chunk_size: int = 64

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "n_groups", "d_state", "chunk_size"):
            if not is_positive_int(getattr(self, name)):
                raise InvalidArgumentError(
                    f"Mamba2LayerParams.{name} must be a positive int, got {getattr(self, name)!r}"
                )
        if self.num_heads % self.n_groups:
            raise InvalidArgumentError(
                f"Mamba2LayerParams.num_heads={self.num_heads} must be a multiple of n_groups={self.n_groups}"
            )
        if self.conv_weight.dim() != 2 or self.conv_weight.shape[0] != self.conv_dim:
            raise InvalidArgumentError(
                f"Mamba2LayerParams.conv_weight must be [conv_dim={self.conv_dim}, W], "
                f"got {list(self.conv_weight.shape)}"
            )
        for name, shape in (
            ("conv_bias", (self.conv_dim,)),
            ("A", (self.num_heads,)),
            ("D", (self.num_heads,)),
            ("dt_bias", (self.num_heads,)),
        ):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise InvalidArgumentError(
                    f"Mamba2LayerParams.{name} must have shape {list(shape)}, got {list(value.shape)}"
                )

    @property
    def conv_dim(self) -> int:
        """C = H*P + 2*G*N: the channels of x, B and C that go through the conv."""
        return self.num_heads * self.head_dim + 2 * self.n_groups * self.d_state

    @property
    def conv_kernel(self) -> int:
        """W, the conv width."""
        return int(self.conv_weight.shape[1])

    @staticmethod
    def state_shapes_for(
        *, num_heads: int, head_dim: int, n_groups: int, d_state: int, conv_kernel: int
    ) -> tuple[tuple[int, ...], ...]:
        """``((C, W-1), (H, P, N))`` for these sizes, ``C = H*P + 2*G*N``: the conv state
        and the SSM state of one request (``attnkit.models`` reads a config's through it)."""
        conv_dim = num_heads * head_dim + 2 * n_groups * d_state
        return ((conv_dim, conv_kernel - 1), (num_heads, head_dim, d_state))

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((C, W-1), (H, P, N))``: the conv state and the SSM state of one request."""
        return self.state_shapes_for(
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            n_groups=self.n_groups,
            d_state=self.d_state,
            conv_kernel=self.conv_kernel,
        )

    def output_shape(self, num_tokens: int) -> tuple[int, ...]:
        """``y`` of a step: ``[T, H, P]``."""
        return (num_tokens, self.num_heads, self.head_dim)


def _check_state_params(owner: str, obj: object, ints: Sequence[str]) -> None:
    for name in ints:
        if not is_positive_int(getattr(obj, name)):
            raise InvalidArgumentError(
                f"{owner}.{name} must be a positive int, got {getattr(obj, name)!r}"
            )


def _check_conv_weight(
    owner: str, weight: torch.Tensor, bias: torch.Tensor | None, channels: int
) -> None:
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise InvalidArgumentError(
            f"{owner}.conv_weight must be [channels={channels}, W >= 1], got {list(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (channels,):
        raise InvalidArgumentError(
            f"{owner}.conv_bias must have shape [{channels}], got {list(bias.shape)}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Mamba1LayerParams:
    """Weights and sizes of a Mamba (1) layer's selective-scan core (Gu & Dao 2023,
    arXiv:2312.00752, Algorithm 2), as in Jamba.

    Split between model and backend: the model keeps ``in_proj`` (giving ``x`` and the
    gate ``z``), the gate ``y * silu(z)`` and ``out_proj``. The backend runs everything
    in between, because it all hangs on the cached states: the causal depthwise conv
    (SiLU) of ``x`` with its conv state, then ``x_proj`` and ``dt_proj`` applied to the
    *convolved* ``x`` (so they cannot run in the model before the step), then the
    selective scan with its SSM state. Letters: D = ``d_inner`` channels, N state size,
    R ``dt_rank``, W conv width.

    Per token, with ``u = silu(conv(x))`` ``[D]``::

        dt_low, B, C = split(x_proj_weight @ u, [R, N, N])    # each RMS-normed if its
                                                              # *_norm_weight is given
        dt = dt_proj_weight @ dt_low + dt_bias                # [D]
        dt = softplus(dt) if dt_softplus
        h  = exp(dt[:, None] * A) * h + (dt * u)[:, None] * B[None, :]   # [D, N]
        y  = h @ C + D_skip * u                               # [D]

    Attributes:
        d_inner, d_state: D, N.
        conv_weight: ``[D, W]`` depthwise conv weight; conv_bias ``[D]`` or ``None``.
        x_proj_weight: ``[R + 2N, D]`` (no bias, as in Mamba).
        dt_proj_weight: ``[D, R]``; dt_bias ``[D]`` (``dt_proj``'s bias) or ``None``.
        A: ``[D, N]``, negative (``-exp(A_log)``). D: ``[D]`` skip or ``None``.
        dt_softplus: apply softplus to ``dt``.
        dt_norm_weight, B_norm_weight, C_norm_weight: Jamba's RMSNorms of ``dt_low``
            ``[R]``, ``B`` ``[N]`` and ``C`` ``[N]`` (``None``: no norm, plain Mamba);
            norm_eps their epsilon.

    Spec shapes for such a layer: ``MambaSpec(shapes=params.state_shapes, ...)``.
    """

    inputs_type: ClassVar[type[Mamba1Inputs]] = Mamba1Inputs

    d_inner: int
    d_state: int
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None = None
    x_proj_weight: torch.Tensor
    dt_proj_weight: torch.Tensor
    dt_bias: torch.Tensor | None = None
    A: torch.Tensor
    D: torch.Tensor | None = None
    dt_softplus: bool = True
    dt_norm_weight: torch.Tensor | None = None
    B_norm_weight: torch.Tensor | None = None
    C_norm_weight: torch.Tensor | None = None
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_state_params(owner, self, ("d_inner", "d_state"))
        _check_conv_weight(owner, self.conv_weight, self.conv_bias, self.d_inner)
        if self.dt_proj_weight.dim() != 2 or self.dt_proj_weight.shape[0] != self.d_inner:
            raise InvalidArgumentError(
                f"{owner}.dt_proj_weight must be [d_inner={self.d_inner}, dt_rank], "
                f"got {list(self.dt_proj_weight.shape)}"
            )
        rank, n = self.dt_rank, self.d_state
        if rank < 1:
            raise InvalidArgumentError(
                f"{owner}.dt_proj_weight must have dt_rank >= 1 columns, got 0"
            )
        for name, shape in (
            ("x_proj_weight", (rank + 2 * n, self.d_inner)),
            ("A", (self.d_inner, n)),
            ("D", (self.d_inner,)),
            ("dt_bias", (self.d_inner,)),
            ("dt_norm_weight", (rank,)),
            ("B_norm_weight", (n,)),
            ("C_norm_weight", (n,)),
        ):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise InvalidArgumentError(
                    f"{owner}.{name} must have shape {list(shape)}, got {list(value.shape)}"
                )
        eps: object = self.norm_eps
        if not (isinstance(eps, float | int) and math.isfinite(eps) and eps > 0):
            raise InvalidArgumentError(f"{owner}.norm_eps must be a finite float > 0, got {eps!r}")

    @property
    def dt_rank(self) -> int:
        """R, the width of ``dt`` before ``dt_proj``."""
        return int(self.dt_proj_weight.shape[1])

    @property
    def conv_kernel(self) -> int:
        """W, the conv width."""
        return int(self.conv_weight.shape[1])

    @staticmethod
    def state_shapes_for(
        *, d_inner: int, d_state: int, conv_kernel: int
    ) -> tuple[tuple[int, ...], ...]:
        """``((D, W-1), (D, N))`` for these sizes: the conv state and the SSM state of one
        request."""
        return ((d_inner, conv_kernel - 1), (d_inner, d_state))

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((D, W-1), (D, N))``: the conv state and the SSM state of one request."""
        return self.state_shapes_for(
            d_inner=self.d_inner, d_state=self.d_state, conv_kernel=self.conv_kernel
        )

    def output_shape(self, num_tokens: int) -> tuple[int, ...]:
        """``y`` of a step: ``[T, D]``."""
        return (num_tokens, self.d_inner)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class GatedDeltaNetLayerParams:
    """A Gated DeltaNet layer's core: short conv over q/k/v, then the gated delta rule.

    Letters: H value heads (= state and output heads), Hk key heads (q and k; H is a
    multiple of Hk), K key dim, V value dim, W conv width, C = 2*Hk*K + H*V.
    Its layers take ``GatedDeltaNetInputs(qkv [T, C], g [T, H], beta [T, H])`` (qkv:
    q ``[T, Hk*K]``, k ``[T, Hk*K]`` and v ``[T, H*V]`` concatenated in that order, before
    the conv; g: log decay, <= 0) and write ``o [T, H, V]``. After the conv (SiLU) q and
    k are L2-normalised per key head, as Gated DeltaNet layers do (Yang et al. 2025).
    Value head ``h`` reads query/key head ``h // (H // Hk)``: each key head serves
    ``H // Hk`` consecutive value heads (Qwen3-Next: Hk = 16, H = 32).

    Attributes:
        num_heads, key_dim, value_dim: H, K, V.
        num_key_heads: Hk, a positive divisor of ``num_heads``; ``None`` means
            ``num_heads`` (one key head per value head).
        conv_weight: ``[C, W]``; conv_bias ``[C]`` or ``None``.
        scale: multiplies ``S^T q``; ``None`` means ``K ** -0.5``.
        chunk_size: chunk length of the prefill algorithm.
    """

    inputs_type: ClassVar[type[GatedDeltaNetInputs]] = GatedDeltaNetInputs

    num_heads: int
    key_dim: int
    value_dim: int
    conv_weight: torch.Tensor
    num_key_heads: int | None = None
    conv_bias: torch.Tensor | None = None
    scale: float | None = None
    chunk_size: int = 64

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_state_params(owner, self, ("num_heads", "key_dim", "value_dim", "chunk_size"))
        hk = self.num_key_heads
        if hk is not None and (not is_positive_int(hk) or self.num_heads % hk):
            raise InvalidArgumentError(
                f"{owner}.num_key_heads must be None or a positive int dividing "
                f"num_heads={self.num_heads}, got {hk!r}"
            )
        _check_conv_weight(owner, self.conv_weight, self.conv_bias, self.conv_dim)

    @property
    def key_heads(self) -> int:
        """Hk: ``num_key_heads``, or ``num_heads`` when it is ``None``."""
        return self.num_heads if self.num_key_heads is None else self.num_key_heads

    @property
    def conv_dim(self) -> int:
        """C = 2*Hk*K + H*V."""
        return 2 * self.key_heads * self.key_dim + self.num_heads * self.value_dim

    @staticmethod
    def state_shapes_for(
        *, num_heads: int, num_key_heads: int, key_dim: int, value_dim: int, conv_kernel: int
    ) -> tuple[tuple[int, ...], ...]:
        """``((C, W-1), (H, K, V))`` for these sizes, ``C = 2*Hk*K + H*V``: conv state and
        delta-rule state."""
        conv_dim = 2 * num_key_heads * key_dim + num_heads * value_dim
        return ((conv_dim, conv_kernel - 1), (num_heads, key_dim, value_dim))

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((C, W-1), (H, K, V))``: conv state and delta-rule state."""
        return self.state_shapes_for(
            num_heads=self.num_heads,
            num_key_heads=self.key_heads,
            key_dim=self.key_dim,
            value_dim=self.value_dim,
            conv_kernel=int(self.conv_weight.shape[1]),
        )

    def output_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (num_tokens, self.num_heads, self.value_dim)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class LinearAttentionLayerParams:
    """A linear-attention layer with per-head decay (lightning attention).

    Its layers take ``LinearAttentionInputs(q [T, H, K], k, v [T, H, V])`` and write
    ``o [T, H, V]``; the state ``S_t = exp(-decay_h) S_{t-1} + k_t v_t^T``.

    Attributes:
        num_heads, key_dim, value_dim: H, K, V.
        decay: ``[H]`` non-negative decay rates.
        scale: ``None`` means ``K ** -0.5``.
        chunk_size: chunk length of the prefill algorithm.
    """

    inputs_type: ClassVar[type[LinearAttentionInputs]] = LinearAttentionInputs

    num_heads: int
    key_dim: int
    value_dim: int
    decay: torch.Tensor
    scale: float | None = None
    chunk_size: int = 64

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_state_params(owner, self, ("num_heads", "key_dim", "value_dim", "chunk_size"))
        if tuple(self.decay.shape) != (self.num_heads,) or bool((self.decay < 0).any()):
            raise InvalidArgumentError(
                f"{owner}.decay must be [num_heads={self.num_heads}] and >= 0, got "
                f"{list(self.decay.shape)} with min {float(self.decay.min()) if self.decay.numel() else 'n/a'}"
            )

    @staticmethod
    def state_shapes_for(
        *, num_heads: int, key_dim: int, value_dim: int
    ) -> tuple[tuple[int, ...], ...]:
        """``((H, K, V),)`` for these sizes: one ``K x V`` state per head."""
        return ((num_heads, key_dim, value_dim),)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((H, K, V),)``."""
        return self.state_shapes_for(
            num_heads=self.num_heads, key_dim=self.key_dim, value_dim=self.value_dim
        )

    def output_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (num_tokens, self.num_heads, self.value_dim)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ShortConvLayerParams:
    """An LFM2-style short-conv layer's core: ``y = c * conv(b * x)`` with a conv state.

    Its layers take ``ShortConvInputs(b [T, C], c [T, C], x [T, C])`` and write ``y [T, C]``.

    Attributes:
        channels: C.
        conv_weight: ``[C, W]``; conv_bias ``[C]`` or ``None``.
    """

    inputs_type: ClassVar[type[ShortConvInputs]] = ShortConvInputs

    channels: int
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_state_params(owner, self, ("channels",))
        _check_conv_weight(owner, self.conv_weight, self.conv_bias, self.channels)

    @staticmethod
    def state_shapes_for(*, channels: int, conv_kernel: int) -> tuple[tuple[int, ...], ...]:
        """``((C, W-1),)`` for these sizes: the conv state."""
        return ((channels, conv_kernel - 1),)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``((C, W-1),)``."""
        return self.state_shapes_for(
            channels=self.channels, conv_kernel=int(self.conv_weight.shape[1])
        )

    def output_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (num_tokens, self.channels)


StateLayerParams = (
    Mamba1LayerParams
    | Mamba2LayerParams
    | GatedDeltaNetLayerParams
    | LinearAttentionLayerParams
    | ShortConvLayerParams
)
"""Parameters of a ``MambaSpec`` layer, one type per ``mamba_type`` (which class is whose:
``attnkit.state_types``)."""

LayerParams = AttentionLayerParams | StateLayerParams
"""Per-layer parameters an impl is built with."""


def check_state_shapes(owner: str, spec: MambaSpec, params: StateLayerParams) -> None:
    """Raise ``ValueError`` unless the spec's state shapes are the parameters' ``state_shapes``
    (for state impls to call at construction)."""
    if spec.shapes != params.state_shapes:
        raise InvalidArgumentError(
            f"{owner}: kv_cache_spec.shapes must be layer_params.state_shapes="
            f"{params.state_shapes}, got {spec.shapes}"
        )
