"""What attention modules pass: the probe's record of one call, the keywords read from
it, the checks every call must pass, and the module conventions the adapter relies on
(``layer_idx``, the q/k/v/o projections, how Llama 4's NoPE layers get positions)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping

import torch

from ..._validation import is_positive_int
from ._interface import UnsupportedModelError

# The keywords transformers' attention modules pass that attnkit reads; anything the
# runtime's metadata already covers (position_ids, use_cache, ...) is ignored.
_KNOWN_KWARGS = frozenset({"scaling", "sliding_window", "softcap", "s_aux", "dropout", "is_causal"})


@dataclasses.dataclass(frozen=True)
class Call:
    """What one attention module passed on the probe's call."""

    name: str
    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    v_head_size: int
    scaling: float | None
    sliding_window: int | None
    softcap: float | None
    has_sinks: bool
    dtype: torch.dtype
    device: torch.device


def number_kwarg(kwargs: Mapping[str, object], key: str) -> float | None:
    value = kwargs.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UnsupportedModelError(
            f"the attention call passed {key}={value!r}; attnkit needs a number or None"
        )
    return float(value)


def window_kwarg(kwargs: Mapping[str, object]) -> int | None:
    value = kwargs.get("sliding_window")
    if value is None:
        return None
    if not is_positive_int(value):
        raise UnsupportedModelError(
            f"the attention call passed sliding_window={value!r}; attnkit needs an int >= 1 or None"
        )
    return int(str(value))


class PositionsCache:
    """Stands in for a transformers cache where a module reads positions from it.

    Llama 4's NoPE layers compute ``arange(T) + cache.get_seq_length(layer)`` as the
    tokens' positions; returning ``positions - arange(T)`` makes that each token's own
    position in its request. ``update`` returns the step's keys and values unchanged
    (attnkit's runtime holds the cache).
    """

    def __init__(self, positions: torch.Tensor) -> None:
        self._offsets = positions - torch.arange(positions.numel(), device=positions.device)

    def get_seq_length(self, layer_idx: int | None = 0) -> torch.Tensor:
        return self._offsets

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return key_states, value_states


def positions_keyword(model: torch.nn.Module) -> str:
    """How Llama 4's NoPE layers get each token's position: transformers 5.0 reads
    ``cache_position`` (passed as the positions themselves), later releases read the
    cache object (``cache``, before that ``past_key_values``: the stand-in)."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("cache_position", "cache", "past_key_values"):
        if name in parameters:
            return name
    raise UnsupportedModelError(
        f"{type(model).__name__}.forward takes none of 'cache_position', 'cache', "
        f"'past_key_values'; attnkit passes Llama 4's NoPE layers their positions through one"
    )


def looks_like_attention(module: torch.nn.Module) -> bool:
    """An attention module of the supported families: it has ``layer_idx`` and the
    q/k/v/o projections."""
    return hasattr(module, "layer_idx") and all(
        isinstance(getattr(module, p, None), torch.nn.Module)
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    )


def layer_index(name: str, module: torch.nn.Module) -> int:
    index = getattr(module, "layer_idx", None)
    if not isinstance(index, int) or isinstance(index, bool):
        raise UnsupportedModelError(f"{name}: the attention module has no int layer_idx")
    return index


def check_call(
    name: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: object,
    kwargs: Mapping[str, object],
) -> None:
    """What every call must look like for attnkit to serve it."""
    if attention_mask is not None:
        raise UnsupportedModelError(
            f"{name}: transformers passed an attention mask; attnkit's runtime masks from "
            f"its own metadata and serves calls without one (pass no attention_mask)"
        )
    dropout = kwargs.get("dropout", 0.0)
    if dropout not in (0, 0.0, None):
        raise UnsupportedModelError(
            f"{name}: attention dropout {dropout!r}; attnkit serves inference: call model.eval()"
        )
    if kwargs.get("is_causal", True) is False:
        raise UnsupportedModelError(
            f"{name}: a bidirectional (is_causal=False) attention call; attnkit serves "
            f"causal decoder attention through transformers"
        )
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.shape[0] != 1:
        raise UnsupportedModelError(
            f"{name}: expected query/key/value [1, H, T, D], got {list(query.shape)}, "
            f"{list(key.shape)}, {list(value.shape)}"
        )
