"""The impl side of the backend contract: one object per layer that runs it.

An impl is made once per layer from the layer's spec and parameters, and each step
runs the layer with the metadata its group's builder made (``build()`` is the plan,
``forward`` the run; an impl does no per-call metadata work). It is generic over
all three things it consumes, so a backend author's impl reads typed fields with no
``isinstance`` and ``bind_builder`` can check it against its builder:

- ``AttentionImpl[M, S, P]``: attention layers. ``M`` the metadata it consumes,
  ``S`` the spec it accepts (an ``AttentionSpec``), ``P`` its layer parameters
  (``AttentionLayerParams`` or a subclass). ``forward(query, key, value, ...)``.
- ``StateImpl[M, P, I]``: state layers (``MambaSpec``). ``P`` the parameter class
  of its ``mamba_type``, ``I`` the input class (``attnkit.state_inputs``).
  ``forward(inputs, ...)``.

::

    class MyImpl(AttentionImpl[MyMeta, FullAttentionSpec, AttentionLayerParams]):
        def __init__(self, kv_cache_spec: FullAttentionSpec,
                     layer_params: AttentionLayerParams) -> None:
            super().__init__(kv_cache_spec, layer_params)
            self.scale = layer_params.scale or kv_cache_spec.head_size ** -0.5

        @override
        def forward(self, query, key, value, kv_cache, attn_metadata: MyMeta, output): ...
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Generic

import torch
from typing_extensions import TypeVar, override

from .errors import InvalidArgumentError
from .metadata import SparseSelection
from .params import AttentionLayerParams, StateLayerParams
from .spec import AttentionSpec, IndexerSpec, KVCacheSpec, MambaSpec
from .state_inputs import StateInputs

__all__ = ["AttentionImpl", "IndexerImpl", "LayerImpl", "StateImpl"]

M_contra = TypeVar("M_contra", contravariant=True)
"""The metadata an impl consumes (only consumed, so contravariant)."""
S_co = TypeVar("S_co", bound=KVCacheSpec, covariant=True, default=KVCacheSpec)
"""The spec an impl accepts; read-only after construction, so covariant."""
P_co = TypeVar("P_co", covariant=True, default=object)
"""The layer parameters an impl is built with; read-only, so covariant."""
SA_co = TypeVar("SA_co", bound=AttentionSpec, covariant=True, default=AttentionSpec)
PA_co = TypeVar("PA_co", bound=AttentionLayerParams, covariant=True, default=AttentionLayerParams)
PS_co = TypeVar("PS_co", bound=StateLayerParams, covariant=True, default=StateLayerParams)
I_contra = TypeVar("I_contra", bound=StateInputs, contravariant=True, default=StateInputs)
"""The state-layer input class an impl consumes."""


class LayerImpl(ABC, Generic[M_contra, S_co, P_co]):
    """What every impl shares: the layer's spec and parameters, read-only.

    Both are read-only properties so that a subclass may narrow them soundly (a
    covariant override): nothing can store a wider spec through the base type.
    """

    def __init__(self, kv_cache_spec: S_co, layer_params: P_co) -> None:
        self._kv_cache_spec = kv_cache_spec
        self._layer_params = layer_params

    @property
    def kv_cache_spec(self) -> S_co:
        """The layer's cache spec."""
        return self._kv_cache_spec

    @property
    def layer_params(self) -> P_co:
        """The layer's parameters."""
        return self._layer_params


class AttentionImpl(LayerImpl[M_contra, SA_co, PA_co]):
    """Runs one attention layer with the metadata its backend's builder made.

    Args:
        kv_cache_spec: the layer's spec.
        layer_params: the layer's ``AttentionLayerParams`` (heads, scale, soft-cap, ...).
    """

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: M_contra,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Write this step's new K/V into ``kv_cache`` and the attention result into ``output``.

        query ``[T, Hq, D]``, key/value ``[T, Hkv, D]`` (``None`` for a cross-attention
        step that writes no encoder tokens), output ``[T, Hq, Dv]``. ``kv_cache`` holds
        one tensor per shape of ``AttentionBackend.get_kv_cache_shapes``. Returns
        ``output``.
        """

    def forward_partial(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: M_contra,
        output: torch.Tensor,
        lse: torch.Tensor,
    ) -> torch.Tensor:
        """``forward`` over one decode context-parallel shard (the ``context_parallel``
        feature): write the new K/V of the positions this rank holds (their slots; the
        others are -1), attend over the shard (key ``j`` of a request at position ``j *
        world_size + rank``, the queries at their global positions, from
        ``CommonAttentionMetadata.context_shard`` / ``global_seq_lens_cpu`` as the
        builder passed them on), and write the partial output and its float32
        natural-log ``lse [T, Hq]`` (``-inf`` for rows that see no key here). The
        runtime merges the ranks' partials. Returns ``output``.

        Raises:
            NotImplementedError: the impl does not serve context parallelism (its
                backend does not declare ``AttentionFeature.CONTEXT_PARALLEL``).
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not serve decode context parallelism "
            f"(its backend does not declare the context_parallel feature)"
        )

    def forward_lse(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: M_contra,
        output: torch.Tensor,
        lse: torch.Tensor,
    ) -> torch.Tensor:
        """``forward``, also writing each row's float32 natural-log sum of exp over the
        keys it sees (a sink logit included) into ``lse [T, Hq]`` (the ``return_lse``
        feature: cascades and merges of attention over disjoint key sets). Rows past the
        step's tokens get ``-inf``, as do rows that see no key. Returns ``output``.

        Raises:
            NotImplementedError: the impl does not return the lse (its backend does
                not declare ``AttentionFeature.RETURN_LSE``).
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not return the log-sum-exp "
            f"(its backend does not declare the return_lse feature)"
        )

    def forward_sparse(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: M_contra,
        output: torch.Tensor,
        selection: SparseSelection,
    ) -> torch.Tensor:
        """``forward`` of a sparse-attention MLA layer (the ``sparse_attention`` feature,
        ``layer_params.index_topk`` set): write the step's latents, then attend, per
        query token ``t``, only to the slots ``selection.indices[t, :selection.lens[t]]``
        (global slot ids of this layer's cache; ``-1`` entries are not read). Returns
        ``output``.

        Raises:
            NotImplementedError: the backend does not declare ``sparse_attention``.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not serve sparse attention "
            f"(its backend does not declare the sparse_attention feature)"
        )


class IndexerImpl(AttentionImpl[M_contra, IndexerSpec, PA_co]):
    """Runs one indexer layer (``IndexerSpec``, DeepSeek sparse attention): writes the
    step's index keys and selects, per query token, the positions its MLA layers read.

    ``layer_params.num_heads`` is the number of indexer heads. The result is a
    ``SparseSelection``, not an attention output, so ``forward`` is refused.
    """

    @abstractmethod
    def select(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: M_contra,
        selection: SparseSelection,
    ) -> SparseSelection:
        """Write ``key`` ``[T, 1, D]`` (the step's index keys) into ``kv_cache`` and fill
        the first ``T`` rows of ``selection`` from the scores ``sum_j weights[t, j] *
        relu(query[t, j] . k[s])`` (query ``[T, H, D]``, weights ``[T, H]``).

        The indexer group shares its MLA group's block ids, so the slots made from
        ``attn_metadata``'s block table are the MLA cache's as they are (no mapping).
        Returns ``selection.rows(T)``.
        """

    @override
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: M_contra,
        output: torch.Tensor,
    ) -> torch.Tensor:
        raise InvalidArgumentError(
            f"{type(self).__name__}.forward: an indexer layer computes a selection, not an "
            f"attention output; call select(query, key, weights, kv_cache, attn_metadata, "
            f"selection)"
        )


class StateImpl(LayerImpl[M_contra, MambaSpec, PS_co], Generic[M_contra, PS_co, I_contra]):
    """Runs one state layer (``MambaSpec``) with the metadata its backend's builder made.

    Args:
        kv_cache_spec: the layer's ``MambaSpec``.
        layer_params: the parameter class of its ``mamba_type``.
    """

    @abstractmethod
    def forward(
        self,
        inputs: I_contra,
        kv_cache: Sequence[torch.Tensor],
        attn_metadata: M_contra,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Update the cached states with this step and write the layer's output.

        ``inputs`` is the layer type's input class (``Mamba2Inputs``, ...);
        ``kv_cache`` holds one tensor per state shape (``[num_blocks, *shape]``);
        ``output`` has ``layer_params.output_shape(T)``. Returns ``output``.
        """
