"""What the backends over the K/V planes share (``flex_attention``, ``cpu_attn``): where
a step's keys and values go, the checks of a step's lengths and of a layer's
parameters, and the write itself.

Planes (``kv_cache_layout = "planes"``): each layer's cache is a K plane and a V plane
``[NB * BS, Hkv, D]``, row = slot (``block * BS + offset``); encoder-only layers keep
none. A ``*_per_token_head`` cache's planes are ``[NB * BS, Hkv, D + 4]``: each head's
``D`` stored values, then the 4 bytes of its float32 scale (:class:`PlanesQuant`), so a
row carries its scales wherever a slot is copied. ``T`` is the step's token count, ``R``
the requests in their first step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..capabilities import AttentionFeature
from ..metadata import CommonAttentionMetadata, host_to_device
from ..params import AttentionLayerParams, attention_params_problems
from ..spec import AttentionSpec, KVCacheSpecKind

_ROW_SCALE_BYTES = torch.float32.itemsize  # a per-token-head row's scale, after its values

__all__ = [
    "NO_WRITES",
    "Ints",
    "PlanesQuant",
    "PlanesWrites",
    "check_causal",
    "check_planes",
    "check_step_lengths",
    "copy_rows",
    "from_numpy",
    "layer_problems",
    "rows_to_write",
    "step_writes",
    "write_planes",
]

Ints = npt.NDArray[np.int64]
# torch.from_numpy, typed: torch leaves its parameter unannotated (pyright: Unknown).
from_numpy: Callable[[npt.NDArray[Any]], torch.Tensor] = torch.from_numpy  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False, slots=True)
class PlanesWrites:
    """What one step writes into a layer's planes, as device tensors (the builder makes
    it once per step; every layer of the group writes with it).

    Attributes:
        slots: int64 cache slots of the step's new keys/values (-1 entries removed when
            the slot mapping was on the CPU); ``None``: nothing to write (encoder-only).
        rows: int64 rows of ``key``/``value`` for ``slots``; ``None``: the first
            ``len(slots)`` rows.
        sink_slots: int64 ``[R * sink_len]``: the sink slots of the requests in their
            first step (``sink_full_attention``), or ``None``.
        tail_slots: int64: slots to zero after writing (``flex_attention``: the rows
            past each request's length in its last block), or ``None``.
    """

    slots: torch.Tensor | None
    rows: torch.Tensor | None = None
    sink_slots: torch.Tensor | None = None
    tail_slots: torch.Tensor | None = None


NO_WRITES = PlanesWrites(slots=None)
"""A step that writes nothing (encoder-only layers keep no cache)."""


@dataclasses.dataclass(frozen=True, eq=False)
class PlanesQuant:
    """How a quantised cache (``kv_cache_dtype`` other than ``"auto"``) stores its rows
    in the planes: the reference backend's quantisers
    (``attnkit.kernels.attention.reference``), so both caches hold the same bytes.

    Attributes:
        dtype: the planes' dtype (``spec.cache_torch_dtype``).
        k_scale, v_scale: the static scales (a float, or float32 ``[Hkv]``); 1.0 for a
            per-token-head cache.
        dynamic: a ``*_per_token_head`` cache: each head's values are followed by their
            float32 scale (``absmax / qmax``, computed here).
    """

    dtype: torch.dtype
    k_scale: float | torch.Tensor
    v_scale: float | torch.Tensor
    dynamic: bool

    @classmethod
    def of(cls, spec: AttentionSpec, params: AttentionLayerParams) -> PlanesQuant | None:
        """The layer's quantisation (``None``: the cache stores the model dtype)."""
        if spec.kv_cache_dtype == "auto":
            return None

        def scale(value: float | tuple[float, ...]) -> float | torch.Tensor:
            if isinstance(value, tuple):
                return torch.tensor(value, dtype=torch.float32)
            return float(value)

        return cls(
            spec.cache_torch_dtype,
            scale(params.k_scale),
            scale(params.v_scale),
            spec.dynamic_kv_scales,
        )

    def stored(self, x: torch.Tensor, value: bool) -> torch.Tensor:
        """The plane rows of keys (``value`` False) or values ``x`` ``[T, Hkv, D]``."""
        from ..kernels.attention.reference import quantise_per_token_head, quantise_static

        if not self.dynamic:
            return quantise_static(x, self.v_scale if value else self.k_scale, self.dtype)
        stored, scales = quantise_per_token_head(x, self.dtype)
        t, hkv, _ = stored.shape
        scale_bytes = scales.contiguous().view(torch.uint8).reshape(t, hkv, _ROW_SCALE_BYTES)
        return torch.cat([stored.view(torch.uint8), scale_bytes], dim=-1).view(self.dtype)

    def engine_scales(self, num_kv_heads: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(k_scale, v_scale)`` as the CPU engines take them: float32 ``[Hkv]`` static
        scales, or ``None`` for both (the scales are in the rows)."""
        if self.dynamic:
            return None, None

        def heads(s: float | torch.Tensor) -> torch.Tensor:
            if isinstance(s, torch.Tensor):
                return s.to(torch.float32).contiguous()
            return torch.full((num_kv_heads,), s, dtype=torch.float32)

        return heads(self.k_scale), heads(self.v_scale)


# ------------------------------------------------------------------ builder side


def check_causal(
    who: str, kind: KVCacheSpecKind, causal: bool, cm: CommonAttentionMetadata
) -> None:
    """The step's ``causal`` flag must be the kind's."""
    if cm.causal is not causal:
        raise ValueError(
            f"{who}: common_attn_metadata.causal must be {causal} for {kind.value} layers, "
            f"got {cm.causal}"
        )


def check_step_lengths(
    who: str, kind: KVCacheSpecKind, *, encoder: bool, sink_len: int, qlens: Ints, seq: Ints
) -> None:
    """An encoder-only step encodes each request whole (``seq == qlen``); a sink kind's
    ``seq_lens`` count its sink tokens."""
    if encoder and bool((seq != qlens).any()):
        b = int(np.argmax(seq != qlens))
        raise ValueError(
            f"{who}: {kind.value} encodes a request whole in one step, so seq_lens must "
            f"equal the query lengths; request {b} has seq_lens={int(seq[b])} and query "
            f"length {int(qlens[b])}"
        )
    if sink_len and bool((seq - qlens < sink_len).any()):
        b = int(np.argmax(seq - qlens < sink_len))
        raise ValueError(
            f"{who}: {kind.value} seq_lens must count the sink_len={sink_len} sink tokens, "
            f"but request {b} has seq_lens - query_lens = {int(seq[b] - qlens[b])} < {sink_len}"
        )


def _write_plan(
    cm: CommonAttentionMetadata, encoder_keys: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots new keys/values go to. From a CPU slot mapping, -1 entries are dropped
    here (once per step); on CUDA the runtime's contract holds (no -1 among the step's
    tokens; cross attention: the first ``E`` entries are the encoder's)."""
    slots = cm.slot_mapping
    if not encoder_keys and slots.shape[0] != cm.num_actual_tokens:
        slots = slots[: cm.num_actual_tokens]
    if cm.slots_written or slots.device.type != "cpu":
        return slots, None
    if slots.numel() == 0 or int(slots.numpy().min()) >= 0:  # numpy: no dispatch cost
        return slots, None
    keep = slots >= 0
    rows = torch.nonzero(keep).flatten()
    if encoder_keys and bool((rows == torch.arange(rows.numel())).all()):
        return slots[: rows.numel()], None  # the encoder tokens lead, as usual
    return slots[rows], rows


def _sink_slots(
    cm: CommonAttentionMetadata, sink_len: int, block_size: int, seq: Ints, qlens: Ints
) -> torch.Tensor | None:
    """Sink slots of the requests in their first step (context == sink_len)."""
    new = np.nonzero(seq - qlens == sink_len)[0]
    if len(new) == 0:
        return None
    table = cm.block_table_tensor
    pos = np.arange(sink_len, dtype=np.int64)
    rows = host_to_device(from_numpy(np.repeat(new, sink_len)), table.device)
    logical = host_to_device(from_numpy(np.tile(pos // block_size, len(new))), table.device)
    offsets = host_to_device(from_numpy(np.tile(pos % block_size, len(new))), table.device)
    return table[rows, logical].to(torch.int64) * block_size + offsets


def step_writes(
    cm: CommonAttentionMetadata,
    *,
    encoder_keys: bool,
    sink_len: int,
    block_size: int,
    seq: Ints,
    qlens: Ints,
    tail_slots: torch.Tensor | None = None,
) -> PlanesWrites:
    """What a step of a layer with a cache writes: the new keys/values (cross attention:
    the encoder's, when given), the sink tokens of requests in their first step (``seq``
    and ``qlens`` are read only for a sink kind), and ``tail_slots`` to zero."""
    slots, rows = _write_plan(cm, encoder_keys)
    return PlanesWrites(
        slots=slots,
        rows=rows,
        sink_slots=_sink_slots(cm, sink_len, block_size, seq, qlens) if sink_len else None,
        tail_slots=tail_slots,
    )


# ------------------------------------------------------------------ impl side


def layer_problems(
    spec: AttentionSpec,
    params: AttentionLayerParams,
    *,
    sink_len: int,
    backend: str,
    features: frozenset[AttentionFeature],
) -> list[str]:
    """What is wrong with ``params`` for a planes layer of ``spec``: the declared
    features, and for a sink kind (``sink_len > 0``) the sink tokens' keys and values
    the backend writes into the planes (``sink_key``/``sink_value`` are no feature)."""
    checked = dataclasses.replace(params, sink_key=None, sink_value=None) if sink_len else params
    problems = attention_params_problems(
        spec, checked, backend=backend, supported_features=features
    )
    if sink_len:
        want = (sink_len, spec.num_kv_heads, spec.head_size)
        if params.sink_key is None or tuple(params.sink_key.shape) != want:
            got = "None" if params.sink_key is None else str(list(params.sink_key.shape))
            problems.append(
                f"a {spec.kind.value} layer needs layer_params.sink_key and sink_value "
                f"of shape [sink_len, Hkv, D]={list(want)}, got {got}"
            )
    return problems


def check_planes(
    who: str,
    spec: AttentionSpec,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: Sequence[torch.Tensor],
    *,
    has_cache: bool,
    encoder_keys: bool,
) -> None:
    """The planes layout's own rules for one ``forward``: key and value given together
    (absent only for cross attention, whose encoder tokens were written earlier), and
    two planes ``[NB * BS, Hkv, D]`` of the spec's cache dtype (``D + 4`` columns with
    per-token-head scales; none without a cache). The query, key, value and output were
    checked against the layer by the runtime (``attnkit.runtime._boundary``)."""
    if (key is None) != (value is None) or (key is None and not encoder_keys):
        raise ValueError(f"{who}: key and value must both be tensors [T, Hkv, D]")
    width = spec.head_size + (_ROW_SCALE_BYTES if spec.dynamic_kv_scales else 0)
    want_kv = (spec.num_kv_heads, width)
    dtype = spec.cache_torch_dtype
    expected = 2 if has_cache else 0
    if len(kv_cache) != expected:
        raise ValueError(
            f"{who}: kv_cache must hold {expected} tensors (the planes layout: K plane, "
            f"V plane), got {len(kv_cache)}"
        )
    for name, plane in zip(("K plane", "V plane"), kv_cache, strict=False):
        if (
            plane.dim() != 3
            or tuple(plane.shape[1:]) != want_kv
            or plane.shape[0] % spec.block_size
            or plane.dtype != dtype
        ):
            cols = "D + 4" if spec.dynamic_kv_scales else "D"
            raise ValueError(
                f"{who}: kv_cache's {name} must be {dtype} [NB * BS, Hkv, {cols}] with "
                f"BS={spec.block_size}, Hkv={spec.num_kv_heads}, D={spec.head_size}, "
                f"got {plane.dtype} {list(plane.shape)}"
            )


def write_planes(
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    writes: PlanesWrites,
    params: AttentionLayerParams,
    quant: PlanesQuant | None = None,
) -> None:
    """The step's new keys/values (and sink tokens) into the planes, quantised by
    ``quant`` when given, then zero the tails. ``params`` holds the sink tokens (checked
    at construction)."""
    if key is not None and value is not None and writes.slots is not None:
        slots, k_new = rows_to_write(writes.slots, writes.rows, key)
        _, v_new = rows_to_write(writes.slots, writes.rows, value)
        if quant is not None:
            k_new, v_new = quant.stored(k_new, False), quant.stored(v_new, True)
        copy_rows(k_plane, slots, k_new)
        copy_rows(v_plane, slots, v_new)
    if writes.sink_slots is not None:
        sk, sv = params.sink_key, params.sink_value
        assert sk is not None  # checked at construction (layer_problems)
        assert sv is not None
        new = writes.sink_slots.shape[0] // sk.shape[0]
        if quant is not None:
            sk_rows = quant.stored(sk, False).to(k_plane.device)
            sv_rows = quant.stored(sv, True).to(v_plane.device)
        else:
            sk_rows, sv_rows = sk.to(k_plane), sv.to(v_plane)
        copy_rows(k_plane, writes.sink_slots, sk_rows.repeat(new, 1, 1))
        copy_rows(v_plane, writes.sink_slots, sv_rows.repeat(new, 1, 1))
    if writes.tail_slots is not None:
        k_plane.index_fill_(0, writes.tail_slots, 0)
        v_plane.index_fill_(0, writes.tail_slots, 0)


def rows_to_write(
    slots: torch.Tensor, rows: torch.Tensor | None, step: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots a step writes and the rows of ``step`` (its new keys, values or
    latents) that go to them: ``step[rows]``, or, with ``rows`` ``None``, the first
    ``len(slots)`` rows (as many as ``step`` has)."""
    if rows is not None:
        return slots, step.index_select(0, rows)
    count = min(slots.shape[0], step.shape[0])
    return slots[:count], step[:count]


def copy_rows(plane: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``plane[slots] = rows``; the bytes of a 1-byte format (torch has no fp8
    ``index_copy_``)."""
    if plane.element_size() == 1 and rows.dtype == plane.dtype:
        plane.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        plane.index_copy_(0, slots, rows)
