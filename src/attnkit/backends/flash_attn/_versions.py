"""What each flash-attn version can do, and which one serves a request: the one place
where the ``flash_attn`` backend's version rules live.

``choose_version`` picks flash-attn 2 or 4 (``FlashAttentionOptions.version``,
else by compute capability) and returns every reason the chosen version cannot serve
a request. ``installed_versions`` finds the packages with ``importlib.util.find_spec``
only: nothing here imports flash-attn.

Facts relied on (public sources of Dao-AILab/flash-attention, read while writing this):

flash-attn 2 (``pip install flash-attn``, module ``flash_attn``, compiled extension
``flash_attn_2_cuda``):
  * GPUs: README "Ampere, Ada, or Hopper GPUs"; ``csrc/flash_attn/flash_api.cpp``
    checks compute capability major >= 8 (older releases: 8.x and 9.0 only).
  * fp16 and bf16; head dimensions up to 256 (README; ``flash_api.cpp`` "head dimension
    at most 256"). The Python wrapper pads a head size that is not a multiple of 8, which
    would copy a whole paged cache per call, so only multiples of 8 are declared.
  * ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, dropout_p, softmax_scale, causal, window_size=(-1, -1), softcap=0.0,
    alibi_slopes, deterministic, return_attn_probs, block_table)``
    (``flash_attn/flash_attn_interface.py``): no ``seqused_k``, no ``out``, no sinks.
    With ``block_table``, k/v are ``(num_blocks, page_block_size, nheads_k, headdim)``
    and the key lengths still come from ``cu_seqlens_k``.
  * Paged KV: ``mha_varlen_fwd`` in ``flash_api.cpp`` checks
    ``page_block_size % 256 == 0``; the ``flash_attn_with_kvcache`` docstring says
    "page_block_size must be a multiple of 256".
  * ``window_size=(left, right)``, -1 = unbounded: query ``i`` sees keys
    ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``; ``causal``
    is aligned to the bottom-right corner; ``softcap > 0`` caps the scaled scores;
    ``alibi_slopes`` adds ``-slope * |i + seqlen_k - seqlen_q - j|``.

flash-attn 4 (``pip install flash-attn-4``, module ``flash_attn.cute``, CuTe DSL):
  * ``flash_attn/cute/interface.py``: ``flash_attn_varlen_func(q, k, v, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, page_table,
    softmax_scale, causal, window_size=(None, None), learnable_sink, softcap=0.0, ...)``
    returning ``(out, lse)``; ``page_table`` excludes ``cu_seqlens_k`` (key lengths come
    from ``seqused_k``); ``learnable_sink`` must be bfloat16 of shape ``(num_heads,)``;
    no ALiBi; window ``None`` = unbounded.
  * Compute capability 9.x, 10.x, 11.x ("Unsupported compute capability. Supported:
    9.x, 10.x, 11.x"); later releases add 8.x and 12.x without paged KV. Paged KV on
    9.x: "paged KV not supported on SM 9.0" in the releases read (newer sources add
    it), so attnkit does not claim it there.
  * Head sizes: multiples of 8 (16-byte alignment of 16-bit types); on 10.x/11.x up to
    128 (``_validate_head_dims``; the dedicated 256 kernel has no softcap, sinks or
    ``seqused_k``), on 9.x up to 256.
  * Any page size (``page_size`` other than the tile size takes the cp.async path).

These facts move with releases; when a newer flash-attn widens them, this module is
the only one to update.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import torch

from ...capabilities import AttentionFeature
from ...spec import AttentionSpec, KVCacheSpecKind

__all__ = [
    "FA2_PIP",
    "FA4_PIP",
    "NOT_INSTALLED_REASON",
    "NO_CUDA_REASON",
    "PAGED_KINDS",
    "FlashAttnVersion",
    "VersionChoice",
    "choose_version",
    "cuda_available",
    "installed_versions",
    "window_size",
]

FlashAttnVersion = Literal[2, 4]

FA2_PIP = "pip install 'attnkit[flash-attn]'"
FA4_PIP = "pip install flash-attn-4"
NOT_INSTALLED_REASON = (
    f"flash-attn is not installed ({FA2_PIP} for flash-attn 2, or {FA4_PIP} for flash-attn 4)"
)
NO_CUDA_REASON = "no CUDA device is available (torch.cuda.is_available() is False)"

PAGED_KINDS = frozenset(
    {
        KVCacheSpecKind.FULL_ATTENTION,
        KVCacheSpecKind.SLIDING_WINDOW,
        KVCacheSpecKind.CROSS_ATTENTION,
    }
)
"""Kinds whose keys/values the kernel reads from the paged cache (through a block table)."""

_CAUSAL_KINDS = frozenset({KVCacheSpecKind.FULL_ATTENTION, KVCacheSpecKind.SLIDING_WINDOW})

_PIP: dict[int, str] = {2: FA2_PIP, 4: FA4_PIP}
_FEATURES: dict[int, frozenset[AttentionFeature]] = {
    2: frozenset({AttentionFeature.LOGITS_SOFT_CAP, AttentionFeature.ALIBI}),
    4: frozenset({AttentionFeature.LOGITS_SOFT_CAP, AttentionFeature.ATTENTION_SINKS}),
}
FA2_PAGE_MULTIPLE = 256
"""flash-attn 2's paged KV block size must be a multiple of this (flash_api.cpp)."""
FA4_CAPABILITY_MAJORS = (9, 10, 11)
"""Compute capability majors flash-attn 4 runs on (interface.py's arch check)."""
FA4_AUTO_MAJORS = (10, 11)
"""Where ``version=None`` picks flash-attn 4 (all kinds served there)."""


@dataclasses.dataclass(frozen=True)
class VersionChoice:
    """The flash-attn version chosen for a request, and why it cannot serve it.

    Attributes:
        version: 2 or 4; ``None`` only when no version was set and none is installed.
        reasons: every version-specific reason it cannot serve the request (empty: it can).
    """

    version: FlashAttnVersion | None
    reasons: tuple[str, ...]


def installed_versions() -> frozenset[FlashAttnVersion]:
    """The flash-attn versions installed here, found without importing anything.

    flash-attn 2 ships the top-level compiled extension ``flash_attn_2_cuda``;
    flash-attn 4 ships ``flash_attn/cute/interface.py`` (possibly in a ``flash_attn``
    namespace package of its own). ``find_spec`` of a top-level name imports nothing.
    """
    found: set[FlashAttnVersion] = set()
    if _find_spec("flash_attn_2_cuda") is not None:
        found.add(2)
    spec = _find_spec("flash_attn")
    locations: Iterable[str] = (spec.submodule_search_locations or ()) if spec is not None else ()
    if any((Path(loc) / "cute" / "interface.py").is_file() for loc in locations):
        found.add(4)
    return frozenset(found)


def _find_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a broken install, or a module without __spec__
        return None


def cuda_available() -> bool:
    """``torch.cuda.is_available()`` (a function of its own so tests can replace it)."""
    return torch.cuda.is_available()


def window_size(
    version: FlashAttnVersion, sliding_window: int | None
) -> tuple[int | None, int | None]:
    """The ``window_size=(left, right)`` argument for a layer's window.

    attnkit's window ``W`` counts the query itself (query ``i`` sees keys ``j`` with
    ``i - W < j <= i``), so ``left = W - 1`` and ``right = 0``. No window: flash-attn 2
    takes ``(-1, -1)``, flash-attn 4 ``(None, None)``.
    """
    if sliding_window is not None:
        return (sliding_window - 1, 0)
    return (-1, -1) if version == 2 else (None, None)


def _label(version: int) -> str:
    return f"flash-attn {version}"


def _cc(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def choose_version(
    setting: FlashAttnVersion | None,
    capability: tuple[int, int] | None,
    *,
    installed: frozenset[FlashAttnVersion],
    spec: AttentionSpec | None = None,
    features: frozenset[AttentionFeature] = frozenset(),
) -> VersionChoice:
    """Choose flash-attn 2 or 4 and list every reason it cannot serve the request.

    Args:
        setting: ``FlashAttentionOptions.version``; ``None`` chooses flash-attn 4
            on compute capability 10.x/11.x when it is installed, else flash-attn 2 when
            installed, else flash-attn 4 when installed.
        capability: the CUDA device's compute capability, if known.
        installed: ``installed_versions()``.
        spec: the layer group's spec (of a kind the backend serves), for the
            spec-dependent rules; ``None`` checks only installation and capability.
        features: the optional features the group's layers need.

    Reasons the backend's declarations already give (device type, dtype, the head-size
    range, minimum capability 8.0) and "nothing is installed" (an environment reason)
    are not repeated here.
    """
    version: FlashAttnVersion | None
    if setting is not None:
        version = setting
    elif capability is not None and capability[0] in FA4_AUTO_MAJORS and 4 in installed:
        version = 4
    elif 2 in installed:
        version = 2
    elif 4 in installed:
        version = 4
    else:
        return VersionChoice(None, ())

    reasons: list[str] = []
    if installed and version not in installed:
        reasons.append(
            f"backend_options flash_attn version={version} was requested but {_label(version)} is not "
            f"installed ({_PIP[version]})"
        )
    if version == 4 and capability is not None:
        low, high = FA4_CAPABILITY_MAJORS[0], FA4_CAPABILITY_MAJORS[-1]
        if capability[0] < low:
            reasons.append(
                f"compute capability {_cc(capability)} is too old for flash-attn 4 "
                f"(it needs {low}.0 to {high}.x)"
            )
        elif capability[0] > high:
            reasons.append(
                f"compute capability {_cc(capability)} is too new for flash-attn 4 "
                f"(it supports {low}.0 to {high}.x)"
            )
    if spec is not None:
        reasons.extend(_spec_reasons(version, spec, capability, features))
    return VersionChoice(version, tuple(reasons))


def _spec_reasons(
    version: FlashAttnVersion,
    spec: AttentionSpec,
    capability: tuple[int, int] | None,
    features: frozenset[AttentionFeature],
) -> list[str]:
    reasons: list[str] = []
    label, kind = _label(version), spec.kind
    paged = kind in PAGED_KINDS
    hopper = capability is not None and capability[0] == 9
    if version == 4 and paged and hopper:
        assert capability is not None
        reasons.append(
            f"flash-attn 4 has no paged KV cache on compute capability {_cc(capability)}, "
            f"which kind={kind.value} needs (use backend_options={{'flash_attn': {{'version': 2}}}} on this GPU)"
        )

    # Head sizes: the declared range (8 to 256) is checked by the backend; here the
    # per-version rule within it.
    max_head = 128 if version == 4 and not hopper else 256
    if 8 <= spec.head_size <= 256 and (spec.head_size % 8 or spec.head_size > max_head):
        where = f" on compute capability {_cc(capability)}" if version == 4 and capability else ""
        reasons.append(
            f"head_size={spec.head_size} not supported by {label}{where} "
            f"(supported: multiples of 8 up to {max_head})"
        )

    if version == 2 and paged and spec.block_size % FA2_PAGE_MULTIPLE:
        reasons.append(
            f"block_size={spec.block_size} not supported by flash-attn 2 (its paged KV "
            f"cache needs a multiple of {FA2_PAGE_MULTIPLE})"
        )

    supported = _FEATURES[version]
    names = ", ".join(sorted(f.value for f in supported))
    for feature in sorted(features - supported, key=lambda f: f.value):
        if feature in _FEATURES[2] | _FEATURES[4]:  # others: the backend's declaration says so
            reasons.append(f"feature {feature.value} not supported by {label} (supported: {names})")
    if version == 2 and AttentionFeature.ALIBI in features and kind not in _CAUSAL_KINDS:
        reasons.append(
            f"feature alibi not supported by flash-attn 2 for kind={kind.value} (its bias "
            f"-slope*|i-j| differs from attnkit's slope*(j-i) when keys follow the query)"
        )
    return reasons
