"""What a state-layer type declares: ``StateType`` and the records it is made of.

``attnkit.state_types`` holds one ``StateType`` per ``mamba_type`` and is where code
asks about a type; this module is the shape of those objects (the states' layout and
what follows from it: ``spec_problems``, ``state_dtypes``, ``split_shapes``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Generic

import torch
from typing_extensions import TypeVar

from ._validation import dtype_name, split_or_replicate
from .errors import InvalidArgumentError
from .spec import MambaSpec, MambaType
from .state_inputs import StateInputs

__all__ = ["InputWidth", "Shapes", "StateSplit", "StateStep", "StateTensor", "StateType"]

Shapes = tuple[tuple[int, ...], ...]
"""A layer's state shapes, one per state, without the block dimension."""

P = TypeVar("P")
"""The type's parameter class (``attnkit.params``)."""
In = TypeVar("In", bound=StateInputs)


@dataclasses.dataclass(frozen=True)
class StateTensor:
    """One of a type's states, as ``MambaSpec.shapes`` holds it.

    Attributes:
        name: for messages (``"conv state"``, ``"ssm state"``).
        dims: one letter per dimension (``("C", "W-1")``). A letter that names a whole
            dimension of two states is one size (Mamba (1)'s ``D``).
        recurrent: the state accumulates over the whole sequence, so it is kept in
            float32 (the built-in kernels read and write it so); conv states hold raw
            inputs and take the model dtype.
    """

    name: str
    dims: tuple[str, ...]
    recurrent: bool = False

    @property
    def layout(self) -> str:
        """``"(C, W-1)"``."""
        return f"({', '.join(self.dims)})"


@dataclasses.dataclass(frozen=True)
class InputWidth:
    """What one field of a type's inputs must be: ``[T, *widths]``, floating point.

    Attributes:
        layout: for messages (``"[T, C]"``).
        widths: the sizes after the token dimension.
        conv_dtype: the field must have the first state's dtype (the conv state it is
            written into); otherwise any floating dtype.
    """

    layout: str
    widths: tuple[int, ...]
    conv_dtype: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class StateStep:
    """One step of a state group, as a reference computation takes it (plain tensors).

    Attributes:
        num_tokens: ``T``, the step's real tokens; the inputs have exactly ``T`` rows.
        query_start_loc: int32 ``[B+1]``, each request's first row.
        state_indices: int32 ``[B]``, each request's state block.
        has_initial_state: bool ``[B]``: the request continues from its cached states
            (else it starts from zeros).
    """

    num_tokens: int
    query_start_loc: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor


@dataclasses.dataclass(frozen=True)
class StateSplit:
    """A tensor-parallel split of one layer's states, as a type's ``split`` rule sees it.

    ``per_rank`` and ``per_rank_or_replicated`` return a rank's share or raise the error
    that names the layer; ``error`` builds it for any other reason.

    Attributes:
        mamba_type: the layer's type.
        ranks: ``tensor_parallel``.
        where: the layer, as the error names it (``"layer 's' (group 0)"``).
        caller: the function the error starts with.
    """

    mamba_type: str
    ranks: int
    where: str
    caller: str = "plan_model"

    def error(self, reason: str) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"{self.caller}: tensor_parallel={self.ranks} cannot split the {self.mamba_type} "
            f"state of {self.where}: {reason}"
        )

    def per_rank(self, count: int, what: str) -> int:
        """``count / ranks``: ``count`` heads (channels) split evenly, else an error."""
        if count % self.ranks:
            raise self.error(f"its {count} {what} are not a multiple of {self.ranks}")
        return count // self.ranks

    def per_rank_or_replicated(self, count: int, what: str) -> tuple[int, int]:
        """``(per rank, ranks holding each)``: split like K/V heads.

        At least as many as ranks: each rank holds ``count / ranks``. Fewer: each rank
        holds one, replicated on ``ranks / count`` ranks (``count`` must divide them).
        """
        return split_or_replicate(count, self.ranks, what, self.where, self.caller)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class StateType(Generic[P, In]):
    """Everything attnkit knows of one state-layer type.

    Attributes:
        name: the ``MambaSpec.mamba_type``.
        short_name: the demo's and the CLI's name for a layer of this type.
        params_type: its layers' parameter class.
        inputs_type: its layers' input class (``params_type.inputs_type``).
        states: its states, in ``MambaSpec.shapes`` order.
        output: ``(name, layout)`` of what a step writes (``("y", "[T, H, P]")``); the
            shape is ``params.output_shape(T)``.
        input_widths: the widths each input field must have, given the params.
        reference: the pure-torch computation of a step: ``(params, inputs, states,
            step) -> output [T, ...]``; reads and writes each request's states in
            place (``states[i][state_indices[r]]``). Inputs come checked against
            ``input_widths`` and cut to the step's tokens.
        split: a tensor-parallel rank's shapes from the whole layer's (already of
            this layout) and the split in words; raises through ``StateSplit``.
        example: the conformance kit's layer parameters, weights from the generator.
        example_inputs: the kit's inputs for ``n`` tokens.
    """

    name: MambaType
    short_name: str
    params_type: type[P]
    inputs_type: type[In]
    states: tuple[StateTensor, ...]
    output: tuple[str, str]
    input_widths: Callable[[P], Mapping[str, InputWidth]]
    reference: Callable[[P, In, Sequence[torch.Tensor], StateStep], torch.Tensor]
    split: Callable[[Shapes, StateSplit], tuple[Shapes, str]]
    example: Callable[[torch.Generator, torch.device], P]
    example_inputs: Callable[[P, int, torch.Generator, torch.device], In]

    def __post_init__(self) -> None:
        declared: object = getattr(self.params_type, "inputs_type", None)
        if declared is not self.inputs_type:
            raise InvalidArgumentError(
                f"StateType {self.name!r}: inputs_type must be {self.params_type.__name__}"
                f".inputs_type, got {self.inputs_type.__name__} (it declares {declared!r})"
            )
        if not self.states:
            raise InvalidArgumentError(f"StateType {self.name!r}: states must not be empty")

    @property
    def layout(self) -> str:
        """The shapes' layout, as a tuple: ``"((C, W-1), (H, P, N))"``, ``"((H, K, V),)"``."""
        inner = ", ".join(s.layout for s in self.states)
        return f"({inner},)" if len(self.states) == 1 else f"({inner})"

    def layout_problem(self, shapes: Shapes) -> str | None:
        """Why ``shapes`` are not of this type's layout (``None`` if they are)."""
        wrong = f"{self.name} shapes must be {self.layout}, got {shapes}"
        if len(shapes) != len(self.states):
            return wrong
        sizes: dict[str, int] = {}
        for shape, state in zip(shapes, self.states, strict=True):
            if len(shape) != len(state.dims):
                return wrong
            for dim, size in zip(state.dims, shape, strict=True):
                if sizes.setdefault(dim, size) != size:
                    return wrong
        return None

    def spec_problems(self, spec: MambaSpec) -> list[str]:
        """What makes ``spec`` (of this type) unusable by attnkit's backends: shapes of
        another layout, or a recurrent state not in float32. Empty if nothing."""
        problem = self.layout_problem(spec.shapes)
        if problem is not None:
            return [problem]
        return [
            f"{self.name} {state.name} dtype (dtypes[{i}]) must be float32, got "
            f"{dtype_name(dtype)}"
            for i, (state, dtype) in enumerate(zip(self.states, spec.dtypes, strict=True))
            if state.recurrent and dtype != torch.float32
        ]

    def state_dtypes(
        self, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32
    ) -> tuple[torch.dtype, ...]:
        """A spec's ``dtypes``: recurrent states in ``state_dtype``, the others (conv
        states) in the model ``dtype``."""
        return tuple(state_dtype if s.recurrent else dtype for s in self.states)

    def split_shapes(
        self, shapes: Shapes, tensor_parallel: int, *, where: str, caller: str = "plan_model"
    ) -> tuple[Shapes, str]:
        """A rank's state shapes under ``tensor_parallel`` ranks, and the split in words.

        Heads (or channels) split evenly and the conv channels follow; what does not
        divide, or shapes of another layout, is an ``InvalidArgumentError`` naming
        ``where``: the planner does not guess a layout the runtime would not run.
        """
        split = StateSplit(self.name, tensor_parallel, where, caller)
        if self.layout_problem(shapes) is not None:
            raise split.error(f"its shapes {shapes} are not the {self.name} layout attnkit knows")
        return self.split(shapes, split)
