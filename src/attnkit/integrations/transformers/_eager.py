"""The check against transformers' own eager attention: ``eager_logits``, and
``check_against_eager``, which compares every step of an engine run with it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from ...errors import InvalidArgumentError
from ._attachment import TransformersAttachment


class _StepLogits(Protocol):
    @property
    def start(self) -> int: ...
    @property
    def logits(self) -> torch.Tensor: ...


class _Step(Protocol):
    @property
    def logits(self) -> Mapping[str, _StepLogits] | None: ...


class _Result(Protocol):
    @property
    def tokens(self) -> Mapping[str, list[int]]: ...
    @property
    def steps(self) -> Sequence[_Step]: ...


def eager_logits(
    attached: TransformersAttachment,
    token_ids: Sequence[int],
    *,
    mm_prefix_ranges: Sequence[tuple[int, int]] = (),
) -> torch.Tensor:
    """Logits ``[n, V]`` (float32, CPU) of one sequence on transformers' eager attention.

    ``mm_prefix_ranges``: image ranges, given to the model as ``token_type_ids`` (1
    inside a range), from which transformers' Gemma 3 builds its bidirectional image
    mask (ranges must not touch: adjacent runs of 1 are one image there)."""
    kwargs: dict[str, object] = {}
    if mm_prefix_ranges:
        types = torch.zeros(1, len(token_ids), dtype=torch.long)
        for start, end in mm_prefix_ranges:
            types[0, start:end] = 1
        kwargs["token_type_ids"] = types.to(attached._model_device())
    with attached.eager() as model, torch.no_grad():
        device = attached._model_device()
        out = model(
            input_ids=torch.tensor([list(token_ids)], device=device), use_cache=False, **kwargs
        )
    logits: torch.Tensor = out.logits[0]
    return logits.float().cpu()


EAGER_TOLERANCE: Mapping[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}
"""Largest ``|logit - eager logit|`` ``check_against_eager`` accepts, as a fraction of
``max(1, largest |eager logit|)``: float32 at the attnkit tolerance table's 1e-4; 16-bit
logits are themselves rounded to a few ulps of the largest (bfloat16 keeps 8 bits)."""


@dataclasses.dataclass(frozen=True)
class EagerCheck:
    """The outcome of ``check_against_eager``.

    Attributes:
        max_error: largest ``|logit - eager logit|`` over every step and request.
        max_logit: largest ``|eager logit|`` seen (the scale of the logits).
        tolerance: the bound ``max_error`` was held to.
        rows: logit rows compared.
    """

    max_error: float
    max_logit: float
    tolerance: float
    rows: int

    @property
    def passed(self) -> bool:
        return self.max_error <= self.tolerance


def check_against_eager(
    attached: TransformersAttachment,
    result: _Result,
    *,
    mm_prefix_ranges: Mapping[str, Sequence[tuple[int, int]]] | None = None,
) -> EagerCheck:
    """Compare every step of an engine run (made with ``keep_logits=True``) with
    transformers' eager attention: each request's sequence runs once through eager
    attention, and each step's rows are compared with the rows of the same positions.
    ``mm_prefix_ranges``: request id -> its image ranges, for eager's image mask
    (``eager_logits``).

    Raises:
        InvalidArgumentError: the run kept no logits.
    """
    worst = largest = 0.0
    rows_seen = 0
    reference: dict[str, torch.Tensor] = {}
    for step in result.steps:
        if step.logits is None:
            raise InvalidArgumentError(
                "check_against_eager: the run kept no logits; make the Engine with keep_logits=True"
            )
        for req_id, rows in step.logits.items():
            if req_id not in reference:
                # The last sampled token was never fed to the model.
                reference[req_id] = eager_logits(
                    attached,
                    result.tokens[req_id][:-1],
                    mm_prefix_ranges=(mm_prefix_ranges or {}).get(req_id, ()),
                )
            got = rows.logits.float().cpu()
            expected = reference[req_id][rows.start : rows.start + got.shape[0]]
            worst = max(worst, float((got - expected).abs().max()))
            largest = max(largest, float(expected.abs().max()))
            rows_seen += got.shape[0]
    tolerance = EAGER_TOLERANCE[attached.dtype] * max(1.0, largest)
    return EagerCheck(worst, largest, tolerance, rows_seen)
