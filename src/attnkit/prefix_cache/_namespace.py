"""Group namespaces: a digest of everything that makes a group's cached bytes
incompatible with another's, so a pool key is ``(namespace, block name)`` and two groups
(or two models, two revisions) never share a block by accident.

``namespace = SHA-256(b"AKNS" || u8 version || encode_value of, in order: the chain's
hash name, the model revision, the spec's kind, its fields as (name, value) pairs in
declaration order, the cache layout, the layers' K scales, V scales, sink keys and sink
values)``. Always SHA-256: a namespace is made once per group, not per block.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import torch

from ..capabilities import KVCacheLayout
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..spec import KVCacheSpec
from ._format import FORMAT_VERSION, encode_value
from ._hashers import HASH_NAMES, HashName

__all__ = ["NAMESPACE_MAGIC", "group_namespace"]

NAMESPACE_MAGIC = b"AKNS"
"""The first bytes of every namespace's serialization."""

_LAYOUTS: tuple[KVCacheLayout, ...] = ("interleaved", "planes")


def _scalars(values: Sequence[float | torch.Tensor], where: str) -> tuple[float | torch.Tensor, ...]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise ArgumentTypeError(
            f"group_namespace: {where} must be a sequence (one per layer), got "
            f"{type(values).__name__}"
        )
    out: list[float | torch.Tensor] = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | float | torch.Tensor):
            raise ArgumentTypeError(
                f"group_namespace: {where}[{i}] must be a float or a tensor, got "
                f"{type(v).__name__}"
            )
        out.append(float(v) if isinstance(v, int) else v)
    return tuple(out)


def _tensors(values: Sequence[torch.Tensor], where: str) -> tuple[torch.Tensor, ...]:
    given: object = values
    if isinstance(given, str | bytes) or not isinstance(given, Sequence):
        raise ArgumentTypeError(
            f"group_namespace: {where} must be a sequence of tensors (one per layer), got "
            f"{type(values).__name__}"
        )
    for i, v in enumerate(values):
        if not isinstance(v, torch.Tensor):
            raise ArgumentTypeError(
                f"group_namespace: {where}[{i}] must be a tensor, got {type(v).__name__}"
            )
    return tuple(values)


_ADDED_FIELDS: dict[str, object] = {"mm_prefix": False}
"""Spec fields added after the namespace format was fixed, with the value a spec that
does not use them has: such a field is hashed only when it differs, so the specs that
do not use it keep their namespaces (and a cache saved before it, its names)."""


def group_namespace(
    spec: KVCacheSpec,
    *,
    revision: str = "",
    layout: KVCacheLayout = "interleaved",
    hash_name: HashName = "sha256",
    k_scales: Sequence[float | torch.Tensor] = (),
    v_scales: Sequence[float | torch.Tensor] = (),
    sink_keys: Sequence[torch.Tensor] = (),
    sink_values: Sequence[torch.Tensor] = (),
) -> bytes:
    """The 32-byte namespace of a KV-cache group's blocks.

    Args:
        spec: the group's spec (its kind and every field: block size, heads, head size,
            dtype, KV-cache dtype, window, chunk, sink length, state shapes).
        revision: the model/weights revision the engine names (a weight update must
            change it, or ``reset_prefix_cache`` must run).
        layout: the group's cache layout.
        hash_name: the hash the chain names are made with (names of two hashes never
            share a pool).
        k_scales, v_scales: the group's layers' K and V scales, in layer order (floats
            or tensors, hashed by value / bytes).
        sink_keys, sink_values: the layers' sink K/V (sink kinds), in layer order.

    Raises:
        ArgumentTypeError: a spec that is not a ``KVCacheSpec``, a scale that is not a
            float or a tensor, a sink that is not a tensor.
        InvalidArgumentError: an unknown layout or hash, K and V lists of different
            lengths.
    """
    if not isinstance(spec, KVCacheSpec):
        raise ArgumentTypeError(
            f"group_namespace: spec must be a KVCacheSpec, got {type(spec).__name__}"
        )
    if not isinstance(revision, str):
        raise ArgumentTypeError(
            f"group_namespace: revision must be a str, got {type(revision).__name__}"
        )
    if layout not in _LAYOUTS:
        raise InvalidArgumentError(
            f"group_namespace: layout must be one of {_LAYOUTS}, got {layout!r}"
        )
    if hash_name not in HASH_NAMES:
        raise InvalidArgumentError(
            f"group_namespace: hash_name must be one of {HASH_NAMES}, got {hash_name!r}"
        )
    ks, vs = _scalars(k_scales, "k_scales"), _scalars(v_scales, "v_scales")
    sk, sv = _tensors(sink_keys, "sink_keys"), _tensors(sink_values, "sink_values")
    for a, b, names in ((ks, vs, "k_scales and v_scales"), (sk, sv, "sink_keys and sink_values")):
        if len(a) != len(b):
            raise InvalidArgumentError(
                f"group_namespace: {names} must have one entry per layer each, got "
                f"{len(a)} and {len(b)}"
            )
    fields = tuple(
        (f.name, getattr(spec, f.name))
        for f in dataclasses.fields(spec)
        if f.name not in _ADDED_FIELDS or getattr(spec, f.name) != _ADDED_FIELDS[f.name]
    )
    data = b"".join(
        [
            NAMESPACE_MAGIC,
            bytes([FORMAT_VERSION]),
            encode_value(hash_name, "hash_name"),
            encode_value(revision, "revision"),
            encode_value(spec.kind.value, "spec.kind"),
            encode_value(fields, "spec"),
            encode_value(layout, "layout"),
            encode_value(ks, "k_scales"),
            encode_value(vs, "v_scales"),
            encode_value(sk, "sink_keys"),
            encode_value(sv, "sink_values"),
        ]
    )
    return hashlib.sha256(data).digest()
