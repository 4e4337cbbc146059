"""The metadata-builder contract: the typing heart of attnkit.

A builder is made once per KV-cache group and turns each step's
``CommonAttentionMetadata`` into the metadata its backend's kernels consume (the
"plan"; ``AttentionImpl.forward`` is the "run" and reuses it for every layer).

The base class declares the widest contract, ``KVCacheSpec``, as a read-only
property. A subclass narrows its spec without ``assert isinstance``, in either of two
ways::

    class MambaBuilder(AttentionMetadataBuilder[MambaMeta, MambaSpec]):   # generic
        ...

    class MambaBuilder(AttentionMetadataBuilder[MambaMeta]):              # vLLM style
        kv_cache_spec: MambaSpec
        def __init__(self, kv_cache_spec: MambaSpec, layer_names: Sequence[str],
                     config: AttentionConfig, device: torch.device) -> None: ...

The generic spelling is sound and accepted by mypy and pyright. The vLLM spelling
(a class-level ``kv_cache_spec: MambaSpec``) overrides the read-only property with a
narrower attribute: mypy accepts it (a covariant override of a read-only member);
pyright reports it as ``reportIncompatibleMethodOverride`` (it does not let a
variable override a property), so under pyright use the generic spelling.

``get_cudagraph_support`` is a classmethod and so is checked for override
compatibility: it takes ``KVCacheSpec`` everywhere, and a subclass that narrows it
is an ``[override]`` error.
"""

from __future__ import annotations

import enum
import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Generic

import torch
from typing_extensions import TypeVar

from .config import AttentionConfig
from .metadata import CommonAttentionMetadata
from .spec import KVCacheSpec

__all__ = ["AttentionCGSupport", "AttentionMetadataBuilder"]

M_co = TypeVar("M_co", covariant=True)
"""The backend metadata type a builder returns (only produced, so covariant)."""

S_co = TypeVar("S_co", bound=KVCacheSpec, covariant=True, default=KVCacheSpec)
"""The spec type a builder accepts; ``KVCacheSpec`` unless the subclass narrows it.
Read-only after construction, so covariant: narrowing it in a subclass is sound."""


@functools.total_ordering
class AttentionCGSupport(enum.Enum):
    """How much of a step a builder's metadata lets CUDA graphs capture, ordered.

    ``NEVER < UNIFORM_SINGLE_TOKEN_DECODE < UNIFORM_BATCH < ALWAYS``; a model's
    support is the minimum over its groups.
    """

    NEVER = 0
    """Every step runs eagerly."""
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    """Batches where every request decodes exactly one token can be captured."""
    UNIFORM_BATCH = 2
    """Batches where every request has the same query length can be captured."""
    ALWAYS = 3
    """Any batch (mixed prefill and decode) can be captured."""

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, AttentionCGSupport):
            return NotImplemented
        return self.value < other.value


class AttentionMetadataBuilder(ABC, Generic[M_co, S_co]):
    """Builds one KV-cache group's backend metadata each step.

    Args:
        kv_cache_spec: the group's spec (all its layers share it).
        layer_names: the layers of the group, which reuse the built metadata.
        config: the attention config the engine runs with.
        device: where the metadata tensors live.

    Class attributes:
        cudagraph_support: what ``get_cudagraph_support`` reports by default.
        reorder_batch_threshold: if set, the runtime orders each batch so requests
            with at most this many new tokens come first ("decodes"), as
            ``split_decodes_and_prefills`` expects; ``None``: any order.
    """

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: ClassVar[int | None] = None

    def __init__(
        self,
        kv_cache_spec: S_co,
        layer_names: Sequence[str],
        config: AttentionConfig,
        device: torch.device,
    ) -> None:
        self._kv_cache_spec = kv_cache_spec
        self.layer_names: tuple[str, ...] = tuple(layer_names)
        self.config = config
        self.device = device

    @property
    def kv_cache_spec(self) -> S_co:
        """The group's spec (read-only, so a subclass may narrow its type soundly)."""
        return self._kv_cache_spec

    @classmethod
    def get_cudagraph_support(
        cls, config: AttentionConfig, kv_cache_spec: KVCacheSpec
    ) -> AttentionCGSupport:
        """The CUDA-graph support of this builder for a group with ``kv_cache_spec``.

        Takes ``KVCacheSpec`` in every subclass: it is asked before any builder exists,
        for any group. Override to depend on the config or the spec.
        """
        return cls.cudagraph_support

    @abstractmethod
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> M_co:
        """Build this step's metadata.

        Args:
            common_prefix_len: tokens every request of the batch shares as a cached
                prefix (0 if none); a backend may use it for cascade attention.
            common_attn_metadata: the step's batch.
            fast_build: prefer a cheaper build over faster kernels (speculative
                decoding drafts call this many times per step).
        """

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> M_co:
        """Build metadata for a CUDA-graph capture of ``common_attn_metadata``'s shape.

        Raises:
            RuntimeError: if the builder declares ``AttentionCGSupport.NEVER`` for its
                group, or the batch is not uniform enough for its declared level.
        """
        support = type(self).get_cudagraph_support(self.config, self.kv_cache_spec)
        query_lens = common_attn_metadata.query_lens_cpu
        uniform = common_attn_metadata.num_reqs == 0 or bool((query_lens == query_lens[0]).all())
        single_token = uniform and common_attn_metadata.max_query_len <= 1
        if (
            support is AttentionCGSupport.NEVER
            or (support is AttentionCGSupport.UNIFORM_BATCH and not uniform)
            or (support is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE and not single_token)
        ):
            raise RuntimeError(
                f"{type(self).__name__} cannot capture this batch in a CUDA graph: its "
                f"support is {support.name} and the batch has query lengths "
                f"{query_lens.tolist()}"  # pyright: ignore[reportUnknownMemberType]  # torch types tolist() as a bare List
            )
        return self.build(0, common_attn_metadata)
