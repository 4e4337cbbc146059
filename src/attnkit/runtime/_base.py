"""What the runtime's parts share: the state ``AttentionRuntime.__init__`` sets up and
the step lookups every part makes (which layer is in which group, whether the current
step still holds).

``AttentionRuntime`` is one class made of parts, one per module: construction and
introspection (``_runtime``), the per-step host path (``_step``) and the layer calls
(``_forward``). Each part derives from ``RuntimeBase``, which declares the attributes
they read, so the type checkers see one runtime.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..binding import Binding
from ..builder import AttentionMetadataBuilder
from ..capabilities import KVCacheLayout
from ..config import AttentionConfig
from ..errors import StaleStepError, UnknownLayerError
from ..impl import AttentionImpl, StateImpl
from ..kinds import Ints, KindRules
from ..kv_cache import KVCacheGroup, KVCacheManager
from ..metadata import CommonAttentionMetadata
from ..parallel import ContextParallel
from ..params import LayerParams
from ..selector import Selection
from ._boundary import AttentionInputs, StateLayerInputs
from ._mm_prefix import MMPrefixRanges
from ._offload import Offloader
from ._pages import TensorParallelRank
from ._requests import StepBatch


@dataclasses.dataclass
class _Group:
    group: KVCacheGroup
    selection: Selection
    binding: Binding
    builder: AttentionMetadataBuilder[Any, Any]
    metadata: Any = None
    common: CommonAttentionMetadata | None = None


class RuntimeBase:
    """The runtime's state, declared for its parts (set by ``AttentionRuntime.__init__``
    and, per step, by ``begin_step``)."""

    # Built once.
    device: torch.device
    _send_to_device: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]] | None
    """How a step's host tensors reach the device together (``hosts_to_device``);
    ``None`` on the CPU, where they are the device's."""
    config: AttentionConfig
    context_parallel: ContextParallel | None
    manager: KVCacheManager
    kv_caches: dict[str, tuple[torch.Tensor, ...]]
    _groups: list[_Group]
    _layer_group: dict[str, int]
    _sharded: frozenset[int]
    _table_group: dict[int, int]
    _rules_of: dict[int, KindRules[Any]]
    _kind_rules: list[KindRules[Any]]
    _thresholds: tuple[int, ...]
    _reads_encoder: bool
    _mm_groups: frozenset[int]
    _mm: MMPrefixRanges | None
    _attention_impls: dict[str, AttentionImpl[Any, Any, Any]]
    _state_impls: dict[str, StateImpl[Any, Any, Any]]
    _attention_inputs: dict[str, AttentionInputs]
    _state_inputs: dict[str, StateLayerInputs]
    _offloader: Offloader | None
    tensor_parallel: TensorParallelRank | None
    num_blocks: int
    page_size_bytes: int
    layouts: dict[int, KVCacheLayout]
    layer_params: dict[str, LayerParams | None]
    # Per step.
    _cp_step: int
    _step: StepBatch | None
    _encoder_tokens: int
    _stale: str | None
    _step_rows_version: int
    _last_ids: list[str]
    _last_rows: Ints
    _last_rows_version: int
    _contiguous_rows: Ints | None
    _last_contiguous: bool
    _decode_qsl: torch.Tensor | None
    _last_shared: Any  # the last step's _SharedStep (runtime._step), None before one
    _slot_steps: frozenset[int]
    _decode_slots: dict[int, tuple[int, Ints]]
    _op_name: str  # its name for torch.ops.attnkit.runtime_forward (_ops)

    def _group_id(self, layer_name: str) -> int:
        try:
            return self._layer_group[layer_name]
        except (KeyError, TypeError):  # TypeError: an unhashable name
            raise UnknownLayerError(
                f"unknown layer {layer_name!r}; layers: {', '.join(self._layer_group)}"
            ) from None

    def _table_gid(self, layer_name: str) -> int:
        """The group whose tables ``layer_name``'s group reads: its own, or the owner's
        whose block ids it shares (``KVCacheGroup.block_owner``)."""
        return self._table_group[self._group_id(layer_name)]

    def _block_layers(self, group_id: int) -> tuple[str, ...]:
        """The layers whose tensors a kernel block of group ``group_id`` holds: its own,
        then those of every group sharing its block ids."""
        return tuple(
            name
            for e in self._groups
            if self._table_group[e.group.group_id] == group_id
            for name in e.group.layer_names
        )

    def _current_step(self) -> StepBatch:
        if self._step is None:
            raise StaleStepError("forward() called before begin_step()")
        return self._step

    def _check_step_live(self) -> None:
        """Raise ``StaleStepError`` unless the current step's metadata still holds."""
        if self._stale is None and self.manager.rows_version != self._step_rows_version:
            self._stale = (
                "requests gained or lost their cache since begin_step() (through the "
                "manager); call begin_step() again"
            )
        if self._stale is not None:
            raise StaleStepError(self._stale)
        offloader = self._offloader
        if offloader is not None and offloader.needs_fence:
            # Every layer call checks here first, so the blocks the step reuses have their
            # evicted bytes copied out before anything writes them (docs/offload.md).
            offloader.fence()
