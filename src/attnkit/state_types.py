"""One object per state-layer type (``MambaSpec.mamba_type``), holding every per-type fact.

A ``StateType`` says, for one type: its parameter class (``attnkit.params``) and input
class (``attnkit.state_inputs``); its states (name, dimensions, which are recurrent)
and so what makes a spec unusable (``spec_problems``); the widths its inputs must have;
how tensor parallelism splits its states (``split_shapes``); the reference computation
(pure torch, the kernels of ``attnkit.kernels.<op>.reference``), which the ``reference``
backend's one state impl calls; the conformance kit's example layer and inputs; the
demo's short name. Code that differs per type asks ``state_type_of(spec)``; nothing
else switches on ``mamba_type``, and an unknown type is an error naming the known ones::

    st = state_type_of(spec)            # or state_type_of("mamba2")
    st.spec_problems(spec)              # [] or the reasons, e.g. a wrong layout
    st.params_type, st.inputs_type      # Mamba2LayerParams, Mamba2Inputs

A new type is its name in ``spec.MambaType``, its input and parameter classes, and
its object here, added to ``_ALL`` (docs/architecture.md, "Adding a state type"); the
record's class is ``attnkit._state_type.StateType``. Letters as in ``attnkit.params``:
T tokens, H heads, P head dim, G groups, N state size, W conv width, C conv channels,
D ``d_inner``, K key dim, V value dim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, get_args

import torch

from ._state_type import InputWidth, Shapes, StateSplit, StateStep, StateTensor, StateType
from .errors import InvalidArgumentError
from .kernels.conv1d.reference import causal_conv1d_varlen
from .kernels.gated_delta.reference import chunk_gated_delta_rule_varlen, l2_normalize
from .kernels.linear_attention.reference import chunk_linear_attention_varlen
from .kernels.mamba1.reference import mamba1_projections, selective_scan_varlen
from .kernels.mamba2.reference import ssd_chunked_varlen
from .kernels.short_conv.reference import short_conv_varlen
from .params import (
    GatedDeltaNetLayerParams,
    LinearAttentionLayerParams,
    Mamba1LayerParams,
    Mamba2LayerParams,
    ShortConvLayerParams,
    StateLayerParams,
    check_state_shapes,
)
from .spec import KVCacheSpec, MambaSpec, MambaType
from .state_inputs import (
    GatedDeltaNetInputs,
    LinearAttentionInputs,
    Mamba1Inputs,
    Mamba2Inputs,
    ShortConvInputs,
    StateInputs,
)

__all__ = [
    "STATE_TYPES",
    "InputWidth",
    "StateSplit",
    "StateStep",
    "StateTensor",
    "StateType",
    "check_state_layer",
    "state_spec_reasons",
    "state_type_of",
]

def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def _conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    step: StateStep,
) -> torch.Tensor:
    """The SiLU causal depthwise conv of a step, conv states read and written in place."""
    return causal_conv1d_varlen(
        x,
        weight,
        bias,
        conv_states=conv_states,
        query_start_loc=step.query_start_loc,
        state_indices=step.state_indices,
        has_initial_state=step.has_initial_state,
        activation="silu",
    )


# ----------------------------------------------------------------------------- mamba1


def _mamba1_reference(
    p: Mamba1LayerParams, inputs: Mamba1Inputs, states: Sequence[torch.Tensor], step: StateStep
) -> torch.Tensor:
    conv_states, ssm_states = states
    # 1. Causal depthwise conv (SiLU) over x; 2. dt, B, C from the convolved x.
    u = _conv(inputs.x, p.conv_weight, p.conv_bias, conv_states, step)
    dt, b, c = mamba1_projections(
        u,
        p.x_proj_weight,
        p.dt_proj_weight,
        dt_norm_weight=p.dt_norm_weight,
        B_norm_weight=p.B_norm_weight,
        C_norm_weight=p.C_norm_weight,
        norm_eps=p.norm_eps,
    )
    # 3. The selective scan, SSM states read and written in the cache slots.
    return selective_scan_varlen(
        u,
        dt,
        p.A,
        b,
        c,
        D=p.D,
        dt_bias=p.dt_bias,
        dt_softplus=p.dt_softplus,
        query_start_loc=step.query_start_loc,
        ssm_states=ssm_states,
        state_indices=step.state_indices,
        has_initial_state=step.has_initial_state,
    )


def _mamba1_split(shapes: Shapes, split: StateSplit) -> tuple[Shapes, str]:
    # ((D, W - 1), (D, N)): every channel has its own conv and SSM state.
    (d_inner, taps), (_, d_state) = shapes
    local = split.per_rank(d_inner, "channels (d_inner)")
    return ((local, taps), (local, d_state)), f"mamba1 channels {d_inner} -> {local} per rank"


def _mamba1_example(gen: torch.Generator, device: torch.device) -> Mamba1LayerParams:
    d_inner, d_state, rank = 16, 8, 2
    return Mamba1LayerParams(
        d_inner=d_inner,
        d_state=d_state,
        conv_weight=_randn(gen, d_inner, 4, scale=0.5).to(device),
        conv_bias=_randn(gen, d_inner, scale=0.1).to(device),
        x_proj_weight=_randn(gen, rank + 2 * d_state, d_inner, scale=0.3).to(device),
        dt_proj_weight=_randn(gen, d_inner, rank, scale=0.5).to(device),
        dt_bias=_randn(gen, d_inner, scale=0.5).to(device),
        A=-torch.rand(d_inner, d_state, generator=gen).add(0.5).to(device),
        D=_randn(gen, d_inner).to(device),
    )


MAMBA1 = StateType(
    name="mamba1",
    short_name="mamba1",
    params_type=Mamba1LayerParams,
    inputs_type=Mamba1Inputs,
    states=(
        StateTensor("conv state", ("D", "W-1")),
        StateTensor("ssm state", ("D", "N"), recurrent=True),
    ),
    output=("y", "[T, D]"),
    input_widths=lambda p: {"x": InputWidth("[T, D]", (p.d_inner,), conv_dtype=True)},
    reference=_mamba1_reference,
    split=_mamba1_split,
    example=_mamba1_example,
    example_inputs=lambda p, n, gen, device: Mamba1Inputs(
        x=_randn(gen, n, p.d_inner).to(device)
    ),
)
"""Mamba (1) (Jamba): conv1d, x_proj/dt_proj on the convolved x, selective scan."""


# ----------------------------------------------------------------------------- mamba2


def _mamba2_reference(
    p: Mamba2LayerParams, inputs: Mamba2Inputs, states: Sequence[torch.Tensor], step: StateStep
) -> torch.Tensor:
    conv_states, ssm_states = states
    n = step.num_tokens
    # 1. Causal depthwise conv (SiLU) over x, B and C together, states in the cache.
    xbc = _conv(inputs.xBC, p.conv_weight, p.conv_bias, conv_states, step)
    # 2. Split channels: the first H*P are x, then G*N for B, then G*N for C.
    hp, gn = p.num_heads * p.head_dim, p.n_groups * p.d_state
    x = xbc[:, :hp].reshape(n, p.num_heads, p.head_dim)
    b = xbc[:, hp : hp + gn].reshape(n, p.n_groups, p.d_state)
    c = xbc[:, hp + gn :].reshape(n, p.n_groups, p.d_state)
    # 3. Chunked SSD, states read and written in the cache slots.
    return ssd_chunked_varlen(
        x,
        inputs.dt,
        p.A,
        b,
        c,
        D=p.D,
        dt_bias=p.dt_bias,
        dt_softplus=p.dt_softplus,
        query_start_loc=step.query_start_loc,
        ssm_states=ssm_states,
        state_indices=step.state_indices,
        has_initial_state=step.has_initial_state,
        chunk_size=p.chunk_size,
    )


def _mamba2_split(shapes: Shapes, split: StateSplit) -> tuple[Shapes, str]:
    # ((H * P + 2 * G * N, W - 1), (H, P, N)): heads split, the B/C groups G like K/V
    # heads (replicated when fewer than the ranks).
    (conv, taps), (heads, head_dim, d_state) = shapes
    bc = conv - heads * head_dim
    if bc <= 0 or bc % (2 * d_state):
        raise split.error(f"shapes {shapes} are not ((H*P + 2*G*N, W-1), (H, P, N))")
    n_groups = bc // (2 * d_state)
    local = split.per_rank(heads, "heads")
    local_groups, copies = split.per_rank_or_replicated(n_groups, "B/C groups")
    ranks = ((local * head_dim + 2 * local_groups * d_state, taps), (local, head_dim, d_state))
    shared = f" (each on {copies} ranks)" if copies > 1 else ""
    return ranks, (
        f"mamba2 heads {heads} -> {local} per rank, B/C groups {n_groups} -> "
        f"{local_groups} per rank{shared}"
    )


def _mamba2_example(gen: torch.Generator, device: torch.device) -> Mamba2LayerParams:
    heads, head_dim, groups, d_state = 2, 8, 1, 8
    conv_dim = heads * head_dim + 2 * groups * d_state
    return Mamba2LayerParams(
        num_heads=heads,
        head_dim=head_dim,
        n_groups=groups,
        d_state=d_state,
        conv_weight=_randn(gen, conv_dim, 4, scale=0.5).to(device),
        conv_bias=_randn(gen, conv_dim, scale=0.1).to(device),
        A=-torch.rand(heads, generator=gen).add(0.5).to(device),
        D=_randn(gen, heads).to(device),
        dt_bias=_randn(gen, heads, scale=0.5).to(device),
        dt_softplus=True,
        chunk_size=8,
    )


MAMBA2 = StateType(
    name="mamba2",
    short_name="mamba",
    params_type=Mamba2LayerParams,
    inputs_type=Mamba2Inputs,
    states=(
        StateTensor("conv state", ("C", "W-1")),
        StateTensor("ssm state", ("H", "P", "N"), recurrent=True),
    ),
    output=("y", "[T, H, P]"),
    input_widths=lambda p: {
        "xBC": InputWidth("[T, C]", (p.conv_dim,), conv_dtype=True),
        "dt": InputWidth("[T, H]", (p.num_heads,)),
    },
    reference=_mamba2_reference,
    split=_mamba2_split,
    example=_mamba2_example,
    example_inputs=lambda p, n, gen, device: Mamba2Inputs(
        xBC=_randn(gen, n, p.conv_dim).to(device),
        dt=_randn(gen, n, p.num_heads, scale=0.5).to(device),
    ),
)
"""Mamba2: conv1d over x, B and C, then the chunked SSD."""


# -------------------------------------------------------------------------------- gdn


def _gdn_reference(
    p: GatedDeltaNetLayerParams,
    inputs: GatedDeltaNetInputs,
    states: Sequence[torch.Tensor],
    step: StateStep,
) -> torch.Tensor:
    conv_states, delta_states = states
    n = step.num_tokens
    mixed = _conv(inputs.qkv.to(conv_states.dtype), p.conv_weight, p.conv_bias, conv_states, step)
    # q | k | v: Hk*K, Hk*K and H*V channels; q/k normalised per key head (the kernel
    # shares each key head among H // Hk value heads).
    qk_width = p.key_heads * p.key_dim
    q = l2_normalize(mixed[:, :qk_width].reshape(n, p.key_heads, p.key_dim))
    k = l2_normalize(mixed[:, qk_width : 2 * qk_width].reshape(n, p.key_heads, p.key_dim))
    v = mixed[:, 2 * qk_width :].reshape(n, p.num_heads, p.value_dim)
    return chunk_gated_delta_rule_varlen(
        q,
        k,
        v,
        inputs.g.float(),
        inputs.beta.float(),
        scale=p.scale if p.scale is not None else p.key_dim**-0.5,
        query_start_loc=step.query_start_loc,
        states=delta_states,
        state_indices=step.state_indices,
        has_initial_state=step.has_initial_state,
        chunk_size=p.chunk_size,
    )


def _gdn_split(shapes: Shapes, split: StateSplit) -> tuple[Shapes, str]:
    # ((2 * Hk * K + Hv * V, W - 1), (Hv, K, V)): value and key heads both split.
    (conv, taps), (value_heads, key_dim, value_dim) = shapes
    qk = conv - value_heads * value_dim
    if qk <= 0 or qk % (2 * key_dim):
        raise split.error(f"shapes {shapes} are not ((2*Hk*K + Hv*V, W-1), (Hv, K, V))")
    key_heads = qk // (2 * key_dim)
    local_v = split.per_rank(value_heads, "value heads")
    local_k = split.per_rank(key_heads, "key heads")
    ranks = ((2 * local_k * key_dim + local_v * value_dim, taps), (local_v, key_dim, value_dim))
    return ranks, (
        f"gdn value heads {value_heads} -> {local_v}, key heads {key_heads} -> {local_k} per rank"
    )


def _gdn_example(gen: torch.Generator, device: torch.device) -> GatedDeltaNetLayerParams:
    # One query/key head shared by both value heads (as Qwen3-Next's 16 key heads serve
    # 32 value heads): a backend must map value head h to key head h // (H // Hk); equal
    # counts are the special case H // Hk = 1.
    heads, key_heads, key_dim, value_dim = 2, 1, 8, 8
    conv_dim = 2 * key_heads * key_dim + heads * value_dim
    return GatedDeltaNetLayerParams(
        num_heads=heads,
        num_key_heads=key_heads,
        key_dim=key_dim,
        value_dim=value_dim,
        conv_weight=_randn(gen, conv_dim, 4, scale=0.5).to(device),
        conv_bias=None,
        chunk_size=16,
    )


def _gdn_example_inputs(
    p: GatedDeltaNetLayerParams, n: int, gen: torch.Generator, device: torch.device
) -> GatedDeltaNetInputs:
    return GatedDeltaNetInputs(
        qkv=_randn(gen, n, p.conv_dim, scale=0.5).to(device),
        g=-torch.nn.functional.softplus(_randn(gen, n, p.num_heads).to(device)),
        beta=torch.sigmoid(_randn(gen, n, p.num_heads).to(device)),
    )


GATED_DELTA_NET = StateType(
    name="gdn",
    short_name="gdn",
    params_type=GatedDeltaNetLayerParams,
    inputs_type=GatedDeltaNetInputs,
    states=(
        StateTensor("conv state", ("C", "W-1")),
        StateTensor("delta-rule state", ("H", "K", "V"), recurrent=True),
    ),
    output=("o", "[T, H, V]"),
    input_widths=lambda p: {
        "qkv": InputWidth("[T, C]", (p.conv_dim,)),
        "g": InputWidth("[T, H]", (p.num_heads,)),
        "beta": InputWidth("[T, H]", (p.num_heads,)),
    },
    reference=_gdn_reference,
    split=_gdn_split,
    example=_gdn_example,
    example_inputs=_gdn_example_inputs,
)
"""Gated DeltaNet: short conv (SiLU) over q/k/v, L2-normalised q and k, the gated delta rule."""


# ----------------------------------------------------------------------------- linear


def _linear_reference(
    p: LinearAttentionLayerParams,
    inputs: LinearAttentionInputs,
    states: Sequence[torch.Tensor],
    step: StateStep,
) -> torch.Tensor:
    (kv_states,) = states
    return chunk_linear_attention_varlen(
        inputs.q,
        inputs.k,
        inputs.v,
        p.decay,
        scale=p.scale if p.scale is not None else p.key_dim**-0.5,
        query_start_loc=step.query_start_loc,
        states=kv_states,
        state_indices=step.state_indices,
        has_initial_state=step.has_initial_state,
        chunk_size=p.chunk_size,
    )


def _linear_split(shapes: Shapes, split: StateSplit) -> tuple[Shapes, str]:
    ((heads, key_dim, value_dim),) = shapes
    local = split.per_rank(heads, "heads")
    return ((local, key_dim, value_dim),), f"linear attention heads {heads} -> {local} per rank"


def _linear_example(gen: torch.Generator, device: torch.device) -> LinearAttentionLayerParams:
    heads = 2
    decay = torch.tensor([2.0 ** (-4.0 * (i + 1)) for i in range(heads)], device=device)
    return LinearAttentionLayerParams(
        num_heads=heads, key_dim=8, value_dim=8, decay=decay, chunk_size=16
    )


def _linear_example_inputs(
    p: LinearAttentionLayerParams, n: int, gen: torch.Generator, device: torch.device
) -> LinearAttentionInputs:
    def t(*shape: int) -> torch.Tensor:
        return _randn(gen, *shape).to(device)

    return LinearAttentionInputs(
        q=torch.nn.functional.silu(t(n, p.num_heads, p.key_dim)),
        k=torch.nn.functional.silu(t(n, p.num_heads, p.key_dim)),
        v=t(n, p.num_heads, p.value_dim),
    )


LINEAR_ATTENTION = StateType(
    name="linear",
    short_name="linear",
    params_type=LinearAttentionLayerParams,
    inputs_type=LinearAttentionInputs,
    states=(StateTensor("linear-attention state", ("H", "K", "V"), recurrent=True),),
    output=("o", "[T, H, V]"),
    input_widths=lambda p: {
        "q": InputWidth("[T, H, K]", (p.num_heads, p.key_dim)),
        "k": InputWidth("[T, H, K]", (p.num_heads, p.key_dim)),
        "v": InputWidth("[T, H, V]", (p.num_heads, p.value_dim)),
    },
    reference=_linear_reference,
    split=_linear_split,
    example=_linear_example,
    example_inputs=_linear_example_inputs,
)
"""Linear attention with per-head decay (lightning attention)."""


# ------------------------------------------------------------------------- short_conv


def _short_conv_reference(
    p: ShortConvLayerParams,
    inputs: ShortConvInputs,
    states: Sequence[torch.Tensor],
    step: StateStep,
) -> torch.Tensor:
    (conv_states,) = states
    return short_conv_varlen(
        inputs.b,
        inputs.c,
        inputs.x,
        p.conv_weight,
        p.conv_bias,
        conv_states=conv_states,
        query_start_loc=step.query_start_loc,
        state_indices=step.state_indices,
        has_initial_state=step.has_initial_state,
    )


def _short_conv_split(shapes: Shapes, split: StateSplit) -> tuple[Shapes, str]:
    ((channels, taps),) = shapes
    local = split.per_rank(channels, "channels")
    return ((local, taps),), f"short conv channels {channels} -> {local} per rank"


def _short_conv_example_inputs(
    p: ShortConvLayerParams, n: int, gen: torch.Generator, device: torch.device
) -> ShortConvInputs:
    b, c, x = (_randn(gen, n, p.channels).to(device) for _ in range(3))
    return ShortConvInputs(b=b, c=c, x=x)


SHORT_CONV = StateType(
    name="short_conv",
    short_name="short_conv",
    params_type=ShortConvLayerParams,
    inputs_type=ShortConvInputs,
    states=(StateTensor("conv state", ("C", "W-1")),),
    output=("y", "[T, C]"),
    input_widths=lambda p: {
        name: InputWidth("[T, C]", (p.channels,), conv_dtype=True) for name in ("b", "c", "x")
    },
    reference=_short_conv_reference,
    split=_short_conv_split,
    example=lambda gen, device: ShortConvLayerParams(
        channels=16, conv_weight=_randn(gen, 16, 3, scale=0.5).to(device)
    ),
    example_inputs=_short_conv_example_inputs,
)
"""LFM2-style gated short convolution: ``y = c * conv(b * x)``."""


# --------------------------------------------------------------------------- registry

_ALL: tuple[StateType[Any, Any], ...] = (
    MAMBA1,
    MAMBA2,
    GATED_DELTA_NET,
    LINEAR_ATTENTION,
    SHORT_CONV,
)

STATE_TYPES: Mapping[MambaType, StateType[Any, Any]] = {t.name: t for t in _ALL}
"""``MambaSpec.mamba_type`` -> its ``StateType``: every type has one (checked at import)."""
_BY_NAME: dict[str, StateType[Any, Any]] = {t.name: t for t in _ALL}

_missing = sorted(set(get_args(MambaType)) - set(STATE_TYPES))
assert not _missing, (
    f"mamba_type {', '.join(map(repr, _missing))} has no StateType: add one to _ALL in "
    f"attnkit/state_types.py"
)
_unlisted = [
    name
    for t in _ALL
    for name, cls, union in (
        (t.params_type.__name__, t.params_type, StateLayerParams),
        (t.inputs_type.__name__, t.inputs_type, StateInputs),
    )
    if cls not in get_args(union)
]
assert not _unlisted, (
    f"{', '.join(_unlisted)} must be in the StateLayerParams / StateInputs unions "
    f"(attnkit/params.py, attnkit/state_inputs.py)"
)


def state_type_of(spec_or_name: KVCacheSpec | str) -> StateType[Any, Any]:
    """The ``StateType`` of a ``MambaSpec`` or of a ``mamba_type`` name.

    Raises:
        InvalidArgumentError: a spec that is not a ``MambaSpec``, or an unknown type;
            the message lists the known ones.
    """
    given: object = spec_or_name  # untyped callers may pass anything
    if isinstance(given, MambaSpec):
        name: object = given.mamba_type
    elif isinstance(given, str):
        name = given
    else:
        raise InvalidArgumentError(
            f"state_type_of: expected a MambaSpec or a mamba_type name, got "
            f"{type(given).__name__}"
        )
    found = _BY_NAME.get(name) if isinstance(name, str) else None
    if found is None:
        raise InvalidArgumentError(
            f"unknown mamba_type {name!r}; known: {', '.join(STATE_TYPES)}"
        )
    return found


def state_spec_reasons(spec: KVCacheSpec, served: frozenset[MambaType]) -> list[str]:
    """What a backend serving the state types ``served`` says of ``spec``: the type's
    ``spec_problems`` for a ``MambaSpec`` of a served type, else nothing (the
    ``mamba_type=... not supported`` reason is the base class's)."""
    if not isinstance(spec, MambaSpec) or spec.mamba_type not in served:
        return []
    return state_type_of(spec).spec_problems(spec)


def check_state_layer(
    owner: str, spec: MambaSpec, params: StateLayerParams
) -> StateType[Any, Any]:
    """Construction-time checks of a state impl: the parameters are of the spec's type,
    the spec has no ``spec_problems``, and its shapes are the parameters'
    ``state_shapes``. Returns the type.

    Raises:
        InvalidArgumentError: naming ``owner`` and what does not fit.
    """
    state_type = state_type_of(spec)
    if not isinstance(params, state_type.params_type):
        theirs = next((t.name for t in _ALL if isinstance(params, t.params_type)), None)
        if theirs is None:
            raise InvalidArgumentError(
                f"{owner}: a {spec.mamba_type} layer takes layer_params of type "
                f"{state_type.params_type.__name__}, got {type(params).__name__}"
            )
        raise InvalidArgumentError(
            f"{owner}: kv_cache_spec.mamba_type must be {theirs!r}, got {spec.mamba_type!r}"
        )
    problems = state_type.spec_problems(spec)
    if problems:
        raise InvalidArgumentError(f"{owner}: kv_cache_spec: {'; '.join(problems)}")
    check_state_shapes(owner, spec, params)
    return state_type
