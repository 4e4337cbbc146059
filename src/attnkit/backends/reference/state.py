"""The reference backend's state layers: one builder and one impl for every state type.

The impl checks a step's tensors against what the layer's type declares
(``attnkit.state_types``: its input widths, its states, its output) and runs the type's
reference computation, the pure-torch varlen kernels of ``attnkit.kernels.<op>.reference``:
every request of a step (decode or prefill) goes one path, starting from its cached
states when it has context before the step, so state continuity does not depend on
how a batch is split. A type it does not know is an error, never another type's path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import override

from ...builder import AttentionCGSupport, AttentionMetadataBuilder
from ...config import AttentionConfig
from ...errors import ArgumentTypeError, InvalidArgumentError
from ...impl import StateImpl
from ...metadata import CommonAttentionMetadata
from ...params import StateLayerParams
from ...spec import MambaSpec
from ...state_inputs import StateInputs
from ...state_types import StateStep, StateType, check_state_layer
from ._checks import check_tensor, describe

__all__ = ["ReferenceStateBuilder", "ReferenceStateImpl", "ReferenceStateMetadata"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReferenceStateMetadata:
    """One state group's step, as the reference kernels take it.

    Attributes:
        num_actual_tokens: ``T``, the step's real tokens (inputs may be padded past it).
        query_start_loc: int32 ``[B+1]`` on the device (``CommonAttentionMetadata``'s own).
        state_indices: int32 ``[B]``: each request's state block, column 0 of the block
            table (a view of it, not a copy).
        has_initial_state: bool ``[B]``: the request has context before this step
            (``seq_lens - query_lens > 0``), so it continues from its cached state.
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor


class ReferenceStateBuilder(AttentionMetadataBuilder[ReferenceStateMetadata, MambaSpec]):
    """Builds ``ReferenceStateMetadata``; narrowed to ``MambaSpec`` by its type parameter."""

    # The torch kernels read offsets back to the host: nothing can be captured.
    cudagraph_support = AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: MambaSpec,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, config, device)
        # One metadata serves every state layer type: each request's state block,
        # offsets and whether it continues from a cached state.

    @override
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ReferenceStateMetadata:
        cm = common_attn_metadata
        table = cm.block_table_tensor
        if table.shape[1] < 1:
            raise InvalidArgumentError(
                f"ReferenceStateBuilder: block_table_tensor must have a column 0 holding each "
                f"request's state block, got {describe(table)}"
            )
        qsl = cm.query_start_loc
        query_lens = qsl[1:] - qsl[:-1]
        return ReferenceStateMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=qsl,
            state_indices=table[:, 0],
            has_initial_state=(cm.seq_lens - query_lens) > 0,
        )


class ReferenceStateImpl(StateImpl[ReferenceStateMetadata, StateLayerParams, StateInputs]):
    """The reference impl of any state layer: its type's reference computation.

    ``forward(inputs, kv_cache, attn_metadata, output)`` takes the input class of the
    layer's type (``layer_params.inputs_type``, else ``TypeError``) and writes
    ``output`` (``layer_params.output_shape(T)``; rows past the step's tokens are
    zeroed).

    Args:
        kv_cache_spec: the layer's ``MambaSpec``: a known type, shapes
            ``layer_params.state_shapes``, recurrent states in float32.
        layer_params: the parameter class of its type.
    """

    def __init__(self, kv_cache_spec: MambaSpec, layer_params: StateLayerParams) -> None:
        super().__init__(kv_cache_spec, layer_params)
        self._type: StateType[Any, Any] = check_state_layer(
            type(self).__name__, kv_cache_spec, layer_params
        )

    def _check(
        self,
        inputs: StateInputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: object,
        output: torch.Tensor,
    ) -> tuple[StateInputs, list[torch.Tensor], int]:
        """Check every argument; return the inputs cut to the step's tokens, the states
        and the step's token count."""
        owner, p, spec = f"{type(self).__name__}.forward", self.layer_params, self.kv_cache_spec
        if not isinstance(attn_metadata, ReferenceStateMetadata):
            raise ArgumentTypeError(
                f"{owner}: attn_metadata must be ReferenceStateMetadata, "
                f"got {type(attn_metadata).__name__}"
            )
        n = attn_metadata.num_actual_tokens
        rows: int | None = None
        device = inputs.device
        for name, want in self._type.input_widths(p).items():
            label = f"inputs.{name}"
            dtype = spec.dtypes[0] if want.conv_dtype else None
            shape = (rows, *want.widths)
            t = check_tensor(
                owner,
                label,
                getattr(inputs, name),
                layout=want.layout,
                shape=shape,
                dtype=dtype,
                device=None if rows is None else device,
            )
            if rows is None:
                rows = t.shape[0]
                if rows < n:
                    raise InvalidArgumentError(
                        f"{owner}: {label} must have at least num_actual_tokens={n} rows, "
                        f"got {describe(t)}"
                    )
            if not t.is_floating_point():
                raise InvalidArgumentError(
                    f"{owner}: {label} must be a floating-point tensor, got {describe(t)}"
                )
        assert rows is not None  # every type declares at least one input
        name, layout = self._type.output
        check_tensor(
            owner,
            f"output ({name})",
            output,
            layout=layout,
            shape=p.output_shape(rows),
            dtype=inputs.dtype,
            device=device,
        )
        states = self._type.states
        if len(kv_cache) != len(states):
            raise InvalidArgumentError(
                f"{owner}: kv_cache must hold {len(states)} tensors "
                f"({', '.join(s.name for s in states)}), got {len(kv_cache)}"
            )
        checked = [
            check_tensor(
                owner,
                f"kv_cache[{i}] ({state.name})",
                t,
                layout=f"[NB, {', '.join(state.dims)}]",
                shape=(None, *shape),
                dtype=dtype,
                device=device,
            )
            for i, (t, state, shape, dtype) in enumerate(
                zip(kv_cache, states, spec.shapes, spec.dtypes, strict=True)
            )
        ]
        for field in dataclasses.fields(p):
            t = getattr(p, field.name)
            if isinstance(t, torch.Tensor) and t.device != device:
                raise InvalidArgumentError(
                    f"{owner}: layer_params.{field.name} must be on the inputs' device "
                    f"{device}, got {describe(t)}"
                )
        if rows > n:
            cut = {f.name: getattr(inputs, f.name)[:n] for f in dataclasses.fields(inputs)}
            inputs = dataclasses.replace(inputs, **cut)
        return inputs, checked, n

    @override
    def forward(
        self,
        inputs: StateInputs,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: ReferenceStateMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        expected = self.layer_params.inputs_type
        if not isinstance(inputs, expected):
            raise ArgumentTypeError(
                f"{type(self).__name__}: a {self.kv_cache_spec.mamba_type} layer takes "
                f"{expected.__name__}, got {type(inputs).__name__}"
            )
        inputs, states, n = self._check(inputs, kv_cache, attn_metadata, output)
        md = attn_metadata
        step = StateStep(
            num_tokens=n,
            query_start_loc=md.query_start_loc,
            state_indices=md.state_indices,
            has_initial_state=md.has_initial_state,
        )
        output[:n] = self._type.reference(self.layer_params, inputs, states, step)
        output[n:] = 0  # padding rows
        return output
