"""The layer calls of a step: ``forward`` (attention; a context-sharded group's
partial result and the merge across ranks) and ``forward_state`` (state layers), each
checked at the input boundary before any backend runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ArgumentTypeError, InvalidArgumentError
from ..impl import AttentionImpl, IndexerImpl
from ..metadata import SparseSelection
from ..parallel import merge_partials
from ..state_inputs import StateInputs
from ._boundary import copy_back
from ._spec import SpeculativeCalls


class LayerCalls(SpeculativeCalls):
    """``AttentionRuntime``'s layer calls: ``forward``, ``forward_state``."""

    def forward(
        self,
        layer_name: str,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        output: torch.Tensor | None = None,
        selection: SparseSelection | None = None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one attention layer of the current step.

        query ``[T, Hq, D]`` (with ``layer_params.mla_projection``: the un-absorbed
        ``[T, Hq, N + P]``), key/value ``[T, Hkv, D]`` with the query's ``T`` (MLA: key
        the new latents ``[T, 1, D]``, value ``None`` or the same; cross-attention: the
        encoder states ``[E, Hkv, D]`` of ``StepBatch.encoder_order``, ``E`` their
        encoder tokens, or ``None`` when no request is new); ``T`` is at least the
        step's tokens (rows past them are padding). Every tensor has the spec's dtype
        and is on the runtime's device. Returns ``output`` ``[T, Hq, Dv]`` (``Dv`` is
        ``layer_params.v_head_size`` or the head size), a new tensor when ``None``.
        State layers take typed inputs: ``forward_state`` or ``state_layer``.
        A sparse-attention MLA layer (``layer_params.index_topk``) takes the
        ``selection`` its indexer made (``select``), and only such a layer does.
        ``lse``: a float32 ``[T, Hq]`` tensor on the runtime's device, for a layer built
        with ``layer_params.return_lse=True`` (routed to a backend with the
        ``return_lse`` feature): each row's natural-log sum of exp over the keys it
        sees (``-inf`` past the step's tokens), written beside the output; on a
        context-parallel group, the merged lse of the ranks.

        The call is checked before any backend runs, so a rejected call changes
        nothing. Any strided view is accepted: a tensor whose last dimension is not
        unit-stride is copied once into a contiguous tensor (an ``output`` of that
        kind is written through a contiguous buffer); other views, such as slices of
        a fused QKV projection, reach the backend without a copy.

        Raises:
            ArgumentTypeError: ``layer_name`` is a state layer, or an argument is not a
                tensor.
            InvalidArgumentError: a tensor's rank, rows, sizes, dtype or device does
                not fit the layer and the step (the message names the argument).
            StaleStepError: no step yet, or the step's requests were freed since.
        """
        name: object = layer_name  # untyped callers may pass anything
        impl = self._attention_impls.get(layer_name) if isinstance(name, str) else None
        if impl is None:
            self._group_id(layer_name)  # unknown layers: the error lists the layers
            raise ArgumentTypeError(
                f"{layer_name} is a state layer: call forward_state({layer_name!r}, "
                f"{self._state_impls[layer_name].layer_params.inputs_type.__name__}(...))"
            )
        self._check_step_live()
        query, key, value, out, caller = self._attention_inputs[layer_name].check(
            query, key, value, output, self._current_step().num_tokens, self._encoder_tokens
        )
        if lse is not None:
            _check_lse(layer_name, impl, lse, out)
        entry = self._groups[self._layer_group[layer_name]]
        caches = self.kv_caches.get(layer_name, ())
        sparse = _sparse_layer(impl)
        if sparse is not None and lse is not None:
            raise InvalidArgumentError(
                f"{layer_name}: a sparse-attention layer (index_topk={sparse}) returns no "
                f"lse; got lse=<a tensor>"
            )
        if sparse is not None:
            if (
                not isinstance(selection, SparseSelection)
                or selection.indices.shape[0] < out.shape[0]
            ):
                raise InvalidArgumentError(
                    f"{layer_name}: a sparse-attention layer (index_topk={sparse}) needs "
                    f"selection=<the SparseSelection of its indexer, at least {out.shape[0]} "
                    f"rows>, got {_what(selection)}"
                )
            result = impl.forward_sparse(query, key, value, caches, entry.metadata, out, selection)
            return result if caller is None else copy_back(result, caller)
        if selection is not None:
            raise InvalidArgumentError(
                f"{layer_name}: selection is only for sparse-attention layers "
                f"(layer_params.index_topk), got one for a dense layer"
            )
        if entry.group.group_id in self._sharded:
            result = self._forward_sharded(
                impl, query, key, value, caches, entry.metadata, out, lse
            )
        elif lse is None:
            result = impl.forward(query, key, value, caches, entry.metadata, out)
        else:
            result = impl.forward_lse(query, key, value, caches, entry.metadata, out, lse)
        return result if caller is None else copy_back(result, caller)

    def select(
        self,
        layer_name: str,
        query: torch.Tensor,
        key: torch.Tensor,
        weights: torch.Tensor,
        *,
        selection: SparseSelection | None = None,
    ) -> SparseSelection:
        """Run one indexer layer (``IndexerSpec``) of the current step: write its index
        keys and return, per query token, the positions its MLA layer reads.

        query ``[T, H, D]`` (``H = layer_params.num_heads`` indexer heads, ``D`` the
        spec's head size), key ``[T, 1, D]`` the step's index keys, weights ``[T, H]``
        (any float dtype), ``T`` at least the step's tokens. The indexer's group shares
        its MLA group's block ids (``KVCacheGroup.block_owner``), so the selection's
        global slots index the MLA layers' latent caches as they are. ``selection`` is a buffer of
        at least ``T`` rows and ``index_topk`` columns to fill (``None``: a new one).
        Returns the step's rows of it.

        Raises:
            ArgumentTypeError: ``layer_name`` is not an indexer layer.
            InvalidArgumentError: a tensor does not fit the layer and the step.
        """
        name: object = layer_name
        impl = self._attention_impls.get(layer_name) if isinstance(name, str) else None
        if not isinstance(impl, IndexerImpl):
            self._group_id(layer_name)  # unknown layers: the error lists the layers
            raise ArgumentTypeError(
                f"{layer_name} is not an indexer layer (IndexerSpec): select() runs "
                f"indexers; call forward"
            )
        self._check_step_live()
        num_tokens = self._current_step().num_tokens
        # The boundary's rules for query and key; the key doubles as the value (an
        # indexer has none) and the query as the output it never writes.
        query, checked_key, _, _, _ = self._attention_inputs[layer_name].check(
            query, key, key, query, num_tokens, self._encoder_tokens
        )
        assert checked_key is not None  # checked above
        rows, heads = query.shape[0], query.shape[1]
        given: object = weights  # untyped callers may pass anything
        if (
            not isinstance(given, torch.Tensor)
            or tuple(weights.shape) != (rows, heads)
            or not weights.is_floating_point()
            or weights.device != query.device
        ):
            raise InvalidArgumentError(
                f"{layer_name}: weights must be a floating tensor [T, H] = [{rows}, {heads}] "
                f"on {query.device} (one per query token and indexer head), got {_what(weights)}"
            )
        topk = impl.kv_cache_spec.index_topk
        if selection is None:
            selection = SparseSelection.empty(rows, topk, query.device)
        elif selection.topk != topk or selection.indices.shape[0] < rows:
            raise InvalidArgumentError(
                f"{layer_name}: selection must have index_topk={topk} columns and at least "
                f"{rows} rows, got indices {list(selection.indices.shape)}"
            )
        entry = self._groups[self._layer_group[layer_name]]
        caches = self.kv_caches.get(layer_name, ())
        return impl.select(query, checked_key, weights, caches, entry.metadata, selection)

    def forward_op(
        self,
        layer_name: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        """``forward(layer_name, query, key, value)`` through the torch operator
        ``attnkit::runtime_forward``: the same result, and a call that
        ``torch.compile(fullgraph=True)`` traces as one node (``forward`` itself breaks
        the graph: Dynamo cannot trace the runtime's host code). Call ``begin_step``
        outside the compiled region; one compiled graph then serves every step.

        For layers with their own keys and values (full, sliding-window, chunked and
        sink attention; not MLA latents or cross-attention): the output is a new
        ``[T, Hq, D]`` tensor like ``query``. Everything ``forward`` checks is checked
        when the node runs, with ``forward``'s errors.
        """
        output = torch.empty_like(query)
        torch.ops.attnkit.runtime_forward(self._op_name, layer_name, query, key, value, output)
        return output

    def _forward_sharded(
        self,
        impl: AttentionImpl[Any, Any, Any],
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        caches: Sequence[torch.Tensor],
        metadata: Any,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's partial attention, then one all-gather of ``(output, lse)`` and the
        merge (``attnkit.parallel``); the merged lse into ``output_lse`` when given."""
        cp = self.context_parallel
        assert cp is not None  # only sharded groups come here
        n = self._current_step().num_tokens
        lse = torch.empty(query.shape[0], query.shape[1], dtype=torch.float32, device=query.device)
        partial = output.new_empty(output.shape)
        impl.forward_partial(query, key, value, caches, metadata, partial, lse)
        # Rows past the step's tokens (padding) are not exchanged.
        packed = torch.cat([partial[:n].float().flatten(1), lse[:n]], dim=1)
        gathered = cp.communicator.all_gather(packed)
        width = partial[:n].flatten(1).shape[1]
        shape = (n, *output.shape[1:])
        outs = [g[:, :width].reshape(shape) for g in gathered]
        lses = [g[:, width:] for g in gathered]
        merge_partials(outs, lses, output[:n], None if output_lse is None else output_lse[:n])
        if output_lse is not None:
            output_lse[n:] = float("-inf")
        return output

    def forward_state(
        self, layer_name: str, inputs: StateInputs, *, output: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run one state layer of the current step with its type's inputs.

        ``inputs`` is the input class of the layer's type (``Mamba2Inputs``,
        ``GatedDeltaNetInputs``, ``LinearAttentionInputs``, ``ShortConvInputs``); the
        result has ``layer_params.output_shape(T)``. ``state_layer`` gives a handle
        whose ``forward`` the type checker checks too.

        Checked before any backend runs, as ``forward`` is: each field has the widths
        its type declares (``StateType.input_widths``) and at least the step's tokens
        as rows, the dtype the type asks for, and the runtime's device; the same
        stride rule applies (a field whose last dimension is not unit-stride is copied
        once).

        Raises:
            ArgumentTypeError: an attention layer, or inputs of another layer type.
            InvalidArgumentError: a field's rank, rows, widths, dtype or device, or the
                output's, does not fit (the message names ``inputs.<field>``).
            StaleStepError: no step yet, or the step's requests were freed since.
        """
        name: object = layer_name  # untyped callers may pass anything
        impl = self._state_impls.get(layer_name) if isinstance(name, str) else None
        if impl is None:
            self._group_id(layer_name)
            raise ArgumentTypeError(
                f"{layer_name} is an attention layer: call forward({layer_name!r}, query, key, value)"
            )
        self._check_step_live()
        inputs, out, caller = self._state_inputs[layer_name].check(
            inputs, output, self._current_step().num_tokens
        )
        entry = self._groups[self._layer_group[layer_name]]
        caches = self.kv_caches.get(layer_name, ())
        verify = self._verify
        if verify is not None and (subs := verify.sub_steps.get(entry.group.group_id)):
            result = self._forward_verify_state(layer_name, impl, inputs, caches, out, subs)
        else:
            result = impl.forward(inputs, caches, entry.metadata, out)
        return result if caller is None else copy_back(result, caller)


def _check_lse(
    layer_name: str, impl: AttentionImpl[Any, Any, Any], lse: object, out: torch.Tensor
) -> None:
    """``forward``'s ``lse``: for a layer built with ``return_lse``, float32 ``[T, Hq]``
    on the output's device."""
    params = impl.layer_params
    if not getattr(params, "return_lse", False):
        raise InvalidArgumentError(
            f"{layer_name}: lse is only filled for a layer built with "
            f"layer_params.return_lse=True (which routes it to a backend that returns it), "
            f"got an lse for a layer without it"
        )
    want = (out.shape[0], out.shape[1])
    if not isinstance(lse, torch.Tensor):
        raise ArgumentTypeError(
            f"{layer_name}: lse must be a float32 tensor {list(want)} ([T, Hq]), "
            f"got {type(lse).__name__}"
        )
    if tuple(lse.shape) != want or lse.dtype != torch.float32 or lse.device != out.device:
        raise InvalidArgumentError(
            f"{layer_name}: lse must be a float32 tensor {list(want)} ([T, Hq]) on "
            f"{out.device}, got a {lse.dtype} tensor {list(lse.shape)} on {lse.device}"
        )


def _sparse_layer(impl: AttentionImpl[Any, Any, Any]) -> int | None:
    """The layer's ``index_topk`` when it is a sparse-attention layer, else ``None``."""
    topk: int | None = impl.layer_params.index_topk
    return topk


def _what(value: object) -> str:
    if isinstance(value, SparseSelection):
        return f"a SparseSelection of {value.indices.shape[0]} rows"
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor {list(value.shape)} on {value.device}"
    return type(value).__name__
