"""The runtime's input boundary: each ``forward`` / ``forward_state`` call checked against
its layer and the current step before any backend runs.

One rules object per layer, made once when the runtime is built, holds what the layer
takes; ``check`` reads a few attributes of each tensor (shape, dtype, device, and the
last stride of a tensor that is not contiguous) and touches no data::

    AttentionInputs: query [T, Hq, Dq], key/value [T, Hkv, D] (the query's T), output
        [T, Hq, Dv]; T >= the step's tokens. Dq is the spec's head_size, or N + P with
        an MLA projection (the un-absorbed query); Dv is layer_params.v_head_size or the
        head_size. MLA kinds: key [T, 1, D] the new latents, value None or the same
        latents. Cross attention: key/value [E, Hkv, D], the encoder states of
        StepBatch.encoder_order (E their encoder tokens), or None when E is 0.
    StateLayerInputs: the layer type's input class, each field [T, *widths] as its
        StateType declares (``input_widths``), output ``layer_params.output_shape(T)``.

Every tensor must have the spec's model dtype (a state input field: the conv state's
dtype, or any floating dtype where the type allows it) and live on the runtime's
device. Errors are attnkit errors naming the caller's argument (``key``,
``inputs.xBC``), what the layer takes and what was given.

Strides: any strided view is accepted. A tensor whose last dimension is not
unit-stride (a transposed or expanded view) is copied once, here, into a contiguous
tensor; every other view (rows or heads strided, such as slices of a fused QKV
projection) reaches the backend as given, and a contiguous tensor is never copied. An
``output`` with a strided last dimension is computed into a contiguous buffer and
copied back. So every backend receives tensors whose last dimension is unit-stride.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NoReturn, cast

import torch

from .._validation import describe_tensor, dtype_name
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..kinds import rules_for
from ..params import AttentionLayerParams, StateLayerParams
from ..spec import AttentionSpec, MambaSpec
from ..state_inputs import StateInputs
from ..state_types import state_type_of

__all__ = ["AttentionInputs", "StateLayerInputs", "copy_back", "input_device", "unit_last_stride"]


def input_device(device: torch.device) -> torch.device:
    """The device the runtime's tensors live on: ``device``, with the current CUDA
    device's index for a bare ``"cuda"`` (where its caches were allocated)."""
    # None for a bare "cuda", although torch's stubs type it as int.
    index = cast("int | None", device.index)
    if device.type == "cuda" and index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is unit-stride (always when contiguous), else
    one contiguous copy."""
    if t.is_contiguous() or t.shape[-1] <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


@dataclasses.dataclass(frozen=True)
class _Dim:
    """One dimension after the rows: its letter, size and where the size comes from."""

    letter: str
    size: int
    source: str


@dataclasses.dataclass(frozen=True)
class _TensorRule:
    """What one argument must be: ``[rows, *dims]`` of ``dtype`` on ``device``."""

    name: str
    rows: str
    dims: tuple[_Dim, ...]
    dtype: torch.dtype | None
    device: torch.device

    @property
    def inner(self) -> tuple[int, ...]:
        return tuple(d.size for d in self.dims)

    @property
    def layout(self) -> str:
        """``"[T, Hq, D]"``."""
        return f"[{', '.join((self.rows, *(d.letter for d in self.dims)))}]"

    def want(self, rows: str) -> str:
        sizes = ", ".join((rows, *(str(d.size) for d in self.dims)))
        dtype = "floating-point" if self.dtype is None else dtype_name(self.dtype)
        return f"{dtype} {self.layout}=[{sizes}] on {self.device}"

    def error(
        self, layer: str, t: torch.Tensor, rows: int, exact: bool, rows_why: str
    ) -> InvalidArgumentError:
        """Why ``t`` does not fit (rows: at least ``rows``, or exactly when ``exact``)."""
        name, shape = self.name, tuple(t.shape)
        if len(shape) != 1 + len(self.dims):
            reason = f"{name} has {len(shape)} dimension(s), not {1 + len(self.dims)}"
        elif shape[0] < rows or (exact and shape[0] != rows):
            reason = f"{name} has {shape[0]} rows but {rows_why}"
        elif shape[1:] != self.inner:
            dim, got = next(
                (d, g) for d, g in zip(self.dims, shape[1:], strict=True) if d.size != g
            )
            reason = f"{name} has {dim.letter}={got}, the layer takes {dim.size} ({dim.source})"
        elif self.dtype is None and not t.is_floating_point():
            reason = f"{name} is {dtype_name(t.dtype)}, not a floating-point tensor"
        elif self.dtype is not None and t.dtype != self.dtype:
            reason = f"{name} is {dtype_name(t.dtype)}, the layer's dtype {dtype_name(self.dtype)}"
        else:
            reason = f"{name} is on {t.device}, the runtime on {self.device}"
        want = self.want(str(rows) if exact else f">={rows}")
        return InvalidArgumentError(
            f"{layer}: {reason}; {name} must be {want}, got {describe_tensor(t)}"
        )


_Tensor = torch.Tensor


def _tensor_type_error(layer: str, name: str, what: str, t: object) -> ArgumentTypeError:
    return ArgumentTypeError(f"{layer}: {name} must be {what}, got {type(t).__name__}")


KVForm = Literal["step", "latent", "encoder"]
"""How a layer takes key/value: the step's tokens, the new latents (MLA; value
optional), or the encoder states of the step's new requests (cross attention)."""


class AttentionInputs:
    """What one attention layer's ``forward`` takes (see the module docstring).

    ``check`` returns the tensors to hand the backend and, when ``output`` had to be
    replaced by a contiguous buffer, the caller's output to copy the result into.
    """

    __slots__ = (
        "_d",
        "_dq",
        "_dv",
        "_hkv",
        "_hq",
        "device",
        "dtype",
        "form",
        "key",
        "layer",
        "output",
        "query",
        "value",
    )

    def __init__(
        self,
        layer: str,
        spec: AttentionSpec,
        params: AttentionLayerParams,
        device: torch.device,
    ) -> None:
        self.layer = layer
        self.dtype = spec.dtype
        self.device = device
        rules = rules_for(spec)
        self.form: KVForm = (
            "encoder" if rules.writes == "encoder" else "latent" if rules.latent else "step"
        )
        heads = _Dim("Hq", params.num_heads, "layer_params.num_heads")
        proj = params.mla_projection
        if proj is not None:
            rope = spec.head_size - proj.kv_lora_rank
            width = _Dim(
                "N + P",
                proj.qk_nope_head_dim + rope,
                f"mla_projection's qk_nope_head_dim {proj.qk_nope_head_dim} + rope "
                f"{rope}: the un-absorbed query",
            )
        else:
            width = _Dim("D", spec.head_size, "the spec's head_size")
        self.query = _TensorRule("query", "T", (heads, width), spec.dtype, device)
        v_width = (
            _Dim("Dv", params.v_head_size, "layer_params.v_head_size")
            if params.v_head_size is not None
            else _Dim("Dv", spec.head_size, "the spec's head_size")
        )
        self.output = _TensorRule("output", "T", (heads, v_width), spec.dtype, device)
        kv_heads = (
            "one latent per token, read by every head"
            if self.form == "latent"
            else "the spec's num_kv_heads"
        )
        kv_dims = (
            _Dim("Hkv", spec.num_kv_heads, kv_heads),
            _Dim("D", spec.head_size, "the spec's head_size"),
        )
        rows = "E" if self.form == "encoder" else "T"
        key, value = "key", "value"
        if self.form == "latent":
            key, value = "key (the new latents)", "value (None or the latents again)"
        elif self.form == "encoder":
            key, value = "key (encoder states)", "value (encoder states)"
        self.key = _TensorRule(key, rows, kv_dims, spec.dtype, device)
        self.value = _TensorRule(value, rows, kv_dims, spec.dtype, device)
        # The sizes, flat, for the per-call comparisons.
        self._hq, self._dq, self._dv = heads.size, width.size, v_width.size
        self._hkv, self._d = spec.num_kv_heads, spec.head_size

    def _type_error(self, query: object, key: object, value: object, output: object) -> NoReturn:
        layer = self.layer
        if not isinstance(query, torch.Tensor):
            raise _tensor_type_error(layer, "query", f"a torch.Tensor {self.query.layout}", query)
        for name, t in (("key", key), ("value", value)):
            if t is not None and not isinstance(t, torch.Tensor):
                what = "a torch.Tensor [T, Hkv, D]"
                if self.form == "encoder":
                    what = "a torch.Tensor [E, Hkv, D] (the encoder states) or None"
                elif self.form == "latent":
                    what = "a torch.Tensor [T, 1, D] (the new latents)"
                    if name == "value":
                        what = "None or a torch.Tensor [T, 1, D] (the latents again)"
                raise _tensor_type_error(layer, name, what, t)
        raise _tensor_type_error(layer, "output", "a torch.Tensor [T, Hq, Dv] or None", output)

    def check(
        self,
        query: object,
        key: object,
        value: object,
        output: object,
        num_tokens: int,
        encoder_tokens: int,
    ) -> tuple[
        torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None
    ]:
        """Raise unless the call fits; return ``(query, key, value, output, caller's
        output or None)`` as the backend takes them. ``output=None`` gets a new tensor."""
        # The fast path reads each tensor's shape, dtype and device once and compares
        # them whole (torch dtypes are singletons); the messages are built only on error.
        if (
            not isinstance(query, _Tensor)
            or (key is not None and not isinstance(key, _Tensor))
            or (value is not None and not isinstance(value, _Tensor))
            or (output is not None and not isinstance(output, _Tensor))
        ):
            self._type_error(query, key, value, output)
        dtype, device = self.dtype, self.device
        s = query.shape
        rows = s[0] if len(s) == 3 else -1
        if (
            rows < num_tokens
            or s != (rows, self._hq, self._dq)
            or query.dtype is not dtype
            or query.device != device
        ):
            raise self.query.error(
                self.layer, query, num_tokens, False, f"the step has {num_tokens} tokens"
            )
        if not query.is_contiguous():
            query = unit_last_stride(query)
        if self.form == "encoder":
            key, value = self._encoder_states(key, value, encoder_tokens)
        else:
            want = (rows, self._hkv, self._d)
            if key is None or key.shape != want or key.dtype is not dtype or key.device != device:
                raise self._kv_error(self.key, key, rows, num_tokens)
            if not key.is_contiguous():
                key = unit_last_stride(key)
            if value is not None:
                if value.shape != want or value.dtype is not dtype or value.device != device:
                    raise self._kv_error(self.value, value, rows, num_tokens)
                if not value.is_contiguous():
                    value = unit_last_stride(value)
            elif self.form == "step":
                raise self._kv_error(self.value, value, rows, num_tokens)
        want = (rows, self._hq, self._dv)
        if output is None:
            return query, key, value, query.new_empty(want), None
        if output.shape != want or output.dtype is not dtype or output.device != device:
            raise self.output.error(self.layer, output, rows, True, f"the query has {rows}")
        if output.is_contiguous():
            return query, key, value, output, None
        dense = unit_last_stride(output)
        return query, key, value, dense, (output if dense is not output else None)

    def _kv_error(
        self, rule: _TensorRule, t: torch.Tensor | None, rows: int, num_tokens: int
    ) -> InvalidArgumentError:
        if t is None:
            return InvalidArgumentError(
                f"{self.layer}: {rule.name} must be {rule.want(str(rows))}, got None"
            )
        why = (
            f"the step has {num_tokens} tokens"
            if rows == num_tokens
            else f"the query has {rows} (the step {num_tokens} tokens)"
        )
        return rule.error(self.layer, t, rows, True, why)

    def _encoder_states(
        self, key: torch.Tensor | None, value: torch.Tensor | None, encoder_tokens: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        layer, e = self.layer, encoder_tokens
        if (key is None) != (value is None):
            raise InvalidArgumentError(
                f"{layer}: key and value must both be the encoder states or both be None, "
                f"got key {_describe(key)} and value {_describe(value)}"
            )
        if key is None or value is None:
            if e:
                raise InvalidArgumentError(
                    f"{layer}: the step's new requests (StepBatch.encoder_order) have {e} "
                    f"encoder tokens for cross-attention layers to write: key and value must "
                    f"be {self.key.want(str(e))}, got None"
                )
            return None, None
        why = (
            f"the step's new requests (StepBatch.encoder_order) have {e} encoder tokens"
            if e
            else "no request of the step is new (StepBatch.encoder_order is empty): pass "
            "key=None and value=None"
        )
        want = (e, self._hkv, self._d)
        for rule, t in ((self.key, key), (self.value, value)):
            if t.shape != want or t.dtype is not self.dtype or t.device != self.device:
                raise rule.error(layer, t, e, True, why)
        return unit_last_stride(key), unit_last_stride(value)


def _describe(t: torch.Tensor | None) -> str:
    return "None" if t is None else describe_tensor(t)


class StateLayerInputs:
    """What one state layer's ``forward_state`` takes (see the module docstring)."""

    __slots__ = ("_fields", "_out_inner", "device", "inputs_type", "layer", "mamba_type", "output")

    def __init__(
        self, layer: str, spec: MambaSpec, params: StateLayerParams, device: torch.device
    ) -> None:
        self.layer = layer
        self.device = device
        self.mamba_type = spec.mamba_type
        state_type = state_type_of(spec)
        self.inputs_type: type[StateInputs] = state_type.inputs_type
        fields: list[tuple[str, _TensorRule, tuple[int, ...]]] = []
        for name, width in state_type.input_widths(params).items():
            letters = [s.strip() for s in width.layout.strip("[]").split(",")][1:]
            if len(letters) != len(width.widths):  # a layout that does not spell its widths
                letters = [f"d{i}" for i in range(len(width.widths))]
            dims = tuple(
                _Dim(letter, size, f"the {spec.mamba_type} layer's parameters")
                for letter, size in zip(letters, width.widths, strict=True)
            )
            dtype = spec.dtypes[0] if width.conv_dtype else None
            rule = _TensorRule(f"inputs.{name}", "T", dims, dtype, device)
            fields.append((name, rule, rule.inner))
        self._fields: tuple[tuple[str, _TensorRule, tuple[int, ...]], ...] = tuple(fields)
        out_name, out_layout = state_type.output
        out_inner = params.output_shape(1)[1:]
        letters = [s.strip() for s in out_layout.strip("[]").split(",")][1:]
        if len(letters) != len(out_inner):
            letters = [f"d{i}" for i in range(len(out_inner))]
        self._out_inner = out_inner
        self.output = _TensorRule(
            f"output ({out_name})",
            "T",
            tuple(
                _Dim(letter, size, "layer_params.output_shape")
                for letter, size in zip(letters, out_inner, strict=True)
            ),
            None,
            device,
        )

    def check(
        self, inputs: StateInputs, output: torch.Tensor | None, num_tokens: int
    ) -> tuple[StateInputs, torch.Tensor, torch.Tensor | None]:
        """Raise unless the call fits; return ``(inputs, output, caller's output or
        None)`` as the backend takes them. ``output=None`` gets a new tensor."""
        layer, device = self.layer, self.device
        given: object = output  # untyped callers may pass anything
        if given is not None and not isinstance(given, _Tensor):
            raise _tensor_type_error(layer, "output", "a torch.Tensor or None", given)
        if not isinstance(inputs, self.inputs_type):
            raise ArgumentTypeError(
                f"{layer} is a {self.mamba_type} layer: inputs must be "
                f"{self.inputs_type.__name__}, got {type(inputs).__name__}"
            )
        rows = inputs.num_rows
        copies: dict[str, Any] = {}
        for name, rule, inner in self._fields:
            t: torch.Tensor = getattr(inputs, name)
            dtype = rule.dtype
            if (
                rows < num_tokens
                or t.shape != (rows, *inner)
                or (t.dtype is not dtype if dtype is not None else not t.is_floating_point())
                or t.device != device
            ):
                raise rule.error(layer, t, num_tokens, False, f"the step has {num_tokens} tokens")
            if not t.is_contiguous():
                dense = unit_last_stride(t)
                if dense is not t:
                    copies[name] = dense
        if copies:
            inputs = dataclasses.replace(inputs, **copies)
        if output is None:
            made = torch.empty((rows, *self._out_inner), dtype=inputs.dtype, device=inputs.device)
            return inputs, made, None
        if (
            output.shape != (rows, *self._out_inner)
            or output.dtype is not inputs.dtype
            or output.device != device
        ):
            rule = dataclasses.replace(self.output, dtype=inputs.dtype)
            raise rule.error(layer, output, rows, True, f"the inputs have {rows}")
        if output.is_contiguous():
            return inputs, output, None
        dense = unit_last_stride(output)
        return inputs, dense, (output if dense is not output else None)


def copy_back(result: torch.Tensor, caller: torch.Tensor | None) -> torch.Tensor:
    """The caller's output holding ``result`` (``result`` when no buffer replaced it)."""
    if caller is None:
        return result
    caller.copy_(result)
    return caller
