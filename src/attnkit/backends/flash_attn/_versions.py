"""What each flash-attn version (and release) can do, and which one serves a request:
the one place where the ``flash_attn`` backend's version rules live.

``choose_version`` picks flash-attn 2 or 4 (``FlashAttentionOptions.version``,
else by compute capability) and returns every reason the chosen version cannot serve
a request. ``installed_releases`` finds the installed distributions with
``importlib.metadata`` only: nothing here imports flash-attn.

Detection (by distribution, never by module layout): flash-attn 2 is the ``flash-attn``
distribution (major version 2), flash-attn 4 the ``flash-attn-4`` distribution.
flash-attn 2.8.0 to 2.8.3 ship a prototype ``flash_attn/cute/`` package inside the
``flash-attn`` distribution (flash_attn-2.8.3 sdist: ``flash_attn/cute/interface.py``,
whose ``flash_attn_varlen_func`` has no ``max_seqlen_q``), so the presence of
``flash_attn.cute`` says nothing about flash-attn 4.

Facts relied on, each with the release it was read in (docs/flash-attn.md has the table):

flash-attn 2 (``pip install flash-attn``, module ``flash_attn``, compiled extension
``flash_attn_2_cuda``; sdists 2.6.3, 2.7.3, 2.7.4.post1 and 2.8.3 read):
  * GPUs: ``csrc/flash_attn/flash_api.cpp`` checks ``cc_major >= 8`` in 2.7.3, 2.7.4.post1
    and 2.8.3; 2.6.3 checks ``is_sm8x || is_sm90`` (8.x and 9.0 only). Releases before
    2.7.3 are held to the 2.6.3 rule (the change between them was not located).
  * fp16 and bf16; head dimensions multiples of 8 up to 256 (``flash_api.cpp``
    ``mha_varlen_fwd``). The Python wrapper would pad other sizes, which would copy a
    whole paged cache per call, so only multiples of 8 are declared.
  * ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, dropout_p, softmax_scale, causal, window_size=(-1, -1), softcap=0.0,
    alibi_slopes, deterministic, return_attn_probs, block_table)``
    (``flash_attn/flash_attn_interface.py``, 2.7.3 and 2.8.3): no ``seqused_k``, no
    ``out``, no sinks. With ``block_table``, k/v are
    ``(num_blocks, page_block_size, nheads_k, headdim)`` and the key lengths still come
    from ``cu_seqlens_k``.
  * Paged KV: ``mha_varlen_fwd`` checks ``page_block_size % 256 == 0``.
  * GQA decode: when ``max_seqlen_q == 1``, ``num_heads > num_heads_k``, no window, no
    ALiBi (causal is dropped first), ``mha_varlen_fwd`` reshapes ``q`` to
    ``(batch, num_heads_k, ngroups, d)`` and ignores ``cu_seqlens_q`` (2.8.3
    ``flash_api.cpp`` lines 585-598): ``total_q`` must equal the batch size. The
    builder passes ``max_seqlen_q=2`` for a decode batch with zero-length query rows
    (see ``backend.py``).
  * ``window_size=(left, right)``, -1 = unbounded: query ``i`` sees keys
    ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``; ``causal``
    is aligned to the bottom-right corner; ``softcap > 0`` caps the scaled scores;
    ``alibi_slopes`` adds ``-slope * |i + seqlen_k - seqlen_q - j|``.

flash-attn 4 (``pip install flash-attn-4``, module ``flash_attn.cute``, CuTe DSL; wheels
4.0.0b3, b20, b30 and b36 read, ``flash_attn/cute/interface.py``):
  * ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, seqused_q, seqused_k, page_table, softmax_scale, causal,
    window_size=(None, None), learnable_sink, softcap=0.0, ...)`` returning
    ``(out, lse)``; ``page_table`` excludes ``cu_seqlens_k`` (key lengths come from
    ``seqused_k``); no ALiBi; window ``None`` = unbounded. Same names in every release
    read.
  * Compute capability: b3 accepts 9.x-11.x; b20, b30, b36 accept 8.x-12.x, with no
    paged KV on 8.x ("paged KV not supported on SM 8.0") or 12.x ("Paged KV not
    supported on SM 12.0") and no learnable sink in the SM80-MMA kernel that 8.x and
    12.x run (``flash_fwd.py`` ``FlashAttentionForwardSm80``, b20/b30/b36). Paged KV on 9.x: refused in b3 ("paged KV not
    supported on SM 9.0"), accepted from b20 (cp.async path for pages that are not a
    whole tile).
  * Head sizes: multiples of 8. 9.x: up to 256. 10.x/11.x: up to 128, and from b36 also
    256 (``_validate_head_dims``; b20 and b30 route 256 to a dedicated kernel with extra
    paged-KV conditions, so attnkit does not claim it there). 8.x/12.x: not validated by
    the interface; attnkit claims up to 128 only.
  * ``learnable_sink``: bfloat16 only in b3 and b20; float16, bfloat16 or float32 from
    b30 (``_LEARNABLE_SINK_DTYPES``), so attnkit passes float32 sinks unchanged there.
  * Paged KV reads whole pages when they load by TMA (b36 ``flash_attn_varlen_func``
    docstring): rows past ``seqused_k`` in a sequence's last page must be finite. The
    impl zeroes them before each call (``backend._zero_page_tails``).

A release between two read ones is held to the older one's rules (conservative); an
unknown release (not parseable, or not installed) to the oldest. When a newer
flash-attn widens a rule, this module is the only one to update.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
from collections.abc import Mapping, Set
from typing import Literal

import torch

from ...capabilities import AttentionFeature
from ...kinds import rules_for
from ...spec import AttentionSpec

__all__ = [
    "FA2_DIST",
    "FA2_PIP",
    "FA4_DIST",
    "FA4_PIP",
    "NOT_INSTALLED_REASON",
    "NO_CUDA_REASON",
    "FlashAttnVersion",
    "VersionChoice",
    "choose_version",
    "cuda_available",
    "installed_releases",
    "installed_versions",
    "release_at_least",
    "sink_dtypes",
    "window_size",
]

FlashAttnVersion = Literal[2, 4]

FA2_DIST = "flash-attn"
"""The distribution that is flash-attn 2 (when its major version is 2)."""
FA4_DIST = "flash-attn-4"
"""The distribution that is flash-attn 4."""
FA2_PIP = "pip install 'attnkit[flash-attn]'"
FA4_PIP = "pip install flash-attn-4"
NOT_INSTALLED_REASON = (
    f"flash-attn is not installed ({FA2_PIP} for flash-attn 2, or {FA4_PIP} for flash-attn 4)"
)
NO_CUDA_REASON = "no CUDA device is available (torch.cuda.is_available() is False)"

_PIP: dict[int, str] = {2: FA2_PIP, 4: FA4_PIP}
_FEATURES: dict[int, frozenset[AttentionFeature]] = {
    2: frozenset({AttentionFeature.LOGITS_SOFT_CAP, AttentionFeature.ALIBI}),
    4: frozenset({AttentionFeature.LOGITS_SOFT_CAP, AttentionFeature.ATTENTION_SINKS}),
}
FA2_PAGE_MULTIPLE = 256
"""flash-attn 2's paged KV block size must be a multiple of this (flash_api.cpp)."""
FA2_ANY_AMPERE_OR_NEWER = "2.7.3"
"""From this release flash-attn 2 runs on any capability >= 8.0 (2.7.3 ``flash_api.cpp``
``cc_major >= 8``); before it, 8.x and 9.0 only (2.6.3 ``is_sm8x || is_sm90``)."""
FA2_OLD_MAJORS = ((8, None), (9, 0))
"""flash-attn 2 before ``FA2_ANY_AMPERE_OR_NEWER``: (major, minor or None = any)."""

FA4_CAPABILITY_MAJORS = (9, 10, 11)
"""Compute capability majors flash-attn 4 before ``FA4_WIDE`` runs on (b3 interface.py)."""
FA4_WIDE = "4.0.0b20"
"""From this release (b20, b30, b36 read) flash-attn 4 accepts majors 8 to 12 and pages
KV on 9.x; before it (b3) majors 9 to 11, no paged KV on 9.x."""
FA4_WIDE_CAPABILITY_MAJORS = (8, 9, 10, 11, 12)
FA4_UNPAGED_MAJORS = (8, 12)
"""Majors where flash-attn 4 (``FA4_WIDE`` and later) has no paged KV and no learnable
sink (the SM80-MMA kernel)."""
FA4_FLOAT_SINKS = "4.0.0b30"
"""From this release ``learnable_sink`` may be float16, bfloat16 or float32 (b30, b36
``_LEARNABLE_SINK_DTYPES``); before it bfloat16 only (b3, b20)."""
FA4_HEAD_256_BLACKWELL = "4.0.0b36"
"""From this release head size 256 runs on 10.x/11.x in the general kernel (b36
``_validate_head_dims``); b20/b30 route it to a dedicated kernel with extra paged-KV
conditions, b3 does not validate it."""
FA4_AUTO_MAJORS = (10, 11)
"""Where ``version=None`` picks flash-attn 4 (all kinds served there)."""
NEWEST_READ: dict[int, str] = {2: "2.8.3", 4: "4.0.0b36"}
"""The newest release of each version whose sources these rules were checked against;
its rules apply to a version that is requested but not installed (what would be
installed now)."""

_BF16_ONLY = frozenset({torch.bfloat16})
_FLOAT_SINKS = frozenset({torch.float16, torch.bfloat16, torch.float32})


@dataclasses.dataclass(frozen=True)
class VersionChoice:
    """The flash-attn version chosen for a request, and why it cannot serve it.

    Attributes:
        version: 2 or 4; ``None`` only when no version was set and none is installed.
        reasons: every version-specific reason it cannot serve the request (empty: it can).
        release: the installed release of ``version`` whose rules were applied (``None``:
            not installed or unknown; the oldest rules then apply).
    """

    version: FlashAttnVersion | None
    reasons: tuple[str, ...]
    release: str | None = None


def installed_releases() -> dict[FlashAttnVersion, str]:
    """The flash-attn versions installed here and their releases, from distribution
    metadata (``importlib.metadata``): nothing is imported.

    ``flash-attn`` with major version 2 is flash-attn 2; ``flash-attn-4`` is flash-attn 4.
    The ``flash_attn/cute`` package that ``flash-attn`` 2.8.x ships is not flash-attn 4.
    """
    found: dict[FlashAttnVersion, str] = {}
    fa2 = _dist_version(FA2_DIST)
    if fa2 is not None and (key := _release_key(fa2)) is not None and key[0][0] == 2:
        found[2] = fa2
    fa4 = _dist_version(FA4_DIST)
    if fa4 is not None:
        found[4] = fa4
    return found


def installed_versions() -> frozenset[FlashAttnVersion]:
    """The flash-attn versions installed here (``installed_releases``' keys)."""
    return frozenset(installed_releases())


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


_RELEASE = re.compile(r"(\d+(?:\.\d+)*)(?:[-_.]?(a|b|rc)(\d+))?(?:[-_.]?post(\d+))?")
_PRE_RANK = {"a": 0, "b": 1, "rc": 2, None: 3}


def _release_key(release: str) -> tuple[tuple[int, ...], int, int, int] | None:
    """A sortable key for a PEP 440 release (``4.0.0b36``, ``2.7.4.post1``); dev and
    local parts are ignored. ``None`` if it does not parse."""
    match = _RELEASE.match(release.strip().lower().lstrip("v"))
    if match is None:
        return None
    numbers = tuple(int(n) for n in match.group(1).split("."))
    numbers = numbers + (0,) * (3 - len(numbers))
    pre = match.group(2)
    return (
        numbers,
        _PRE_RANK[pre],
        int(match.group(3) or 0),
        int(match.group(4) or 0),
    )


def release_at_least(release: str | None, threshold: str) -> bool:
    """Whether ``release`` is ``threshold`` or later; an unknown release is not."""
    if release is None:
        return False
    key, floor = _release_key(release), _release_key(threshold)
    return key is not None and floor is not None and key >= floor


def sink_dtypes(release: str | None) -> frozenset[torch.dtype]:
    """The dtypes flash-attn 4 ``release`` accepts for ``learnable_sink``."""
    return _FLOAT_SINKS if release_at_least(release, FA4_FLOAT_SINKS) else _BF16_ONLY


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


def _installed(release: str | None) -> str:
    return f"installed: {release}" if release is not None else "release unknown"


def choose_version(
    setting: FlashAttnVersion | None,
    capability: tuple[int, int] | None,
    *,
    installed: Set[FlashAttnVersion] | Mapping[FlashAttnVersion, str],
    spec: AttentionSpec | None = None,
    features: frozenset[AttentionFeature] = frozenset(),
) -> VersionChoice:
    """Choose flash-attn 2 or 4 and list every reason it cannot serve the request.

    Args:
        setting: ``FlashAttentionOptions.version``; ``None`` chooses flash-attn 4
            on compute capability 10.x/11.x when it is installed, else flash-attn 2 when
            installed, else flash-attn 4 when installed.
        capability: the CUDA device's compute capability, if known.
        installed: ``installed_releases()`` (version -> release), or just the versions
            (releases unknown: the oldest rules apply). A version requested but not
            installed is judged by ``NEWEST_READ``.
        spec: the layer group's spec (of a kind the backend serves), for the
            spec-dependent rules; ``None`` checks only installation and capability.
        features: the optional features the group's layers need.

    Reasons the backend's declarations already give (device type, dtype, the head-size
    range, minimum capability 8.0) and "nothing is installed" (an environment reason)
    are not repeated here.
    """
    releases: Mapping[FlashAttnVersion, str] = installed if isinstance(installed, Mapping) else {}
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
    release = releases.get(version)
    # Not installed: judge by the newest release read (what an install would bring).
    rules = release if release is not None or version in installed else NEWEST_READ[version]

    reasons: list[str] = []
    if installed and version not in installed:
        reasons.append(
            f"backend_options flash_attn version={version} was requested but {_label(version)} is not "
            f"installed ({_PIP[version]})"
        )
    if capability is not None:
        reasons.extend(_capability_reasons(version, rules, capability))
    if spec is not None:
        reasons.extend(_spec_reasons(version, rules, spec, capability, features))
    return VersionChoice(version, tuple(reasons), release)


def _capability_reasons(
    version: FlashAttnVersion, release: str | None, capability: tuple[int, int]
) -> list[str]:
    major, minor = capability
    if version == 2:
        if major < 8 or release_at_least(release, FA2_ANY_AMPERE_OR_NEWER):
            return []  # below 8.0: the backend's declared minimum says so
        if any(major == m and (n is None or minor == n) for m, n in FA2_OLD_MAJORS):
            return []
        return [
            f"compute capability {_cc(capability)} not supported by flash-attn 2 before "
            f"{FA2_ANY_AMPERE_OR_NEWER} ({_installed(release)}; it runs on 8.x and 9.0 "
            f"only; {FA2_ANY_AMPERE_OR_NEWER} and later run on 8.0 and newer)"
        ]
    wide = release_at_least(release, FA4_WIDE)
    majors = FA4_WIDE_CAPABILITY_MAJORS if wide else FA4_CAPABILITY_MAJORS
    low, high = majors[0], majors[-1]
    since = "" if wide else f"; {FA4_WIDE} and later: 8.0 to 12.x"
    if major < low:
        return [
            f"compute capability {_cc(capability)} is too old for flash-attn 4 "
            f"(it needs {low}.0 to {high}.x; {_installed(release)}{since})"
        ]
    if major > high:
        return [
            f"compute capability {_cc(capability)} is too new for flash-attn 4 "
            f"(it supports {low}.0 to {high}.x; {_installed(release)}{since})"
        ]
    return []


def _fa4_max_head(release: str | None, capability: tuple[int, int] | None) -> int:
    """flash-attn 4's largest head size attnkit claims on ``capability`` (multiples of 8)."""
    major = capability[0] if capability is not None else None
    if major == 9:
        return 256
    if major in (10, 11) and release_at_least(release, FA4_HEAD_256_BLACKWELL):
        return 256  # 136..248 stay out: only 256 itself is validated there
    return 128


def _spec_reasons(
    version: FlashAttnVersion,
    release: str | None,
    spec: AttentionSpec,
    capability: tuple[int, int] | None,
    features: frozenset[AttentionFeature],
) -> list[str]:
    reasons: list[str] = []
    label, kind = _label(version), spec.kind
    rules = rules_for(spec)
    paged = rules.has_cache  # the kernel reads the paged cache through a block table
    major = capability[0] if capability is not None else None
    wide = release_at_least(release, FA4_WIDE)
    if version == 4 and paged and capability is not None:
        if major == 9 and not wide:
            reasons.append(
                f"flash-attn 4 has no paged KV cache on compute capability {_cc(capability)} "
                f"before {FA4_WIDE} ({_installed(release)}), which kind={kind.value} needs "
                f"(upgrade flash-attn-4, or use backend_options={{'flash_attn': {{'version': 2}}}})"
            )
        elif major in FA4_UNPAGED_MAJORS and wide:
            reasons.append(
                f"flash-attn 4 has no paged KV cache on compute capability {_cc(capability)}, "
                f"which kind={kind.value} needs (use backend_options={{'flash_attn': "
                f"{{'version': 2}}}} on this GPU)"
            )
    if (
        version == 4
        and wide
        and major in FA4_UNPAGED_MAJORS
        and AttentionFeature.ATTENTION_SINKS in features
    ):
        assert capability is not None
        reasons.append(
            f"feature attention_sinks not supported by flash-attn 4 on compute capability "
            f"{_cc(capability)} (its SM80-MMA kernel takes no learnable_sink)"
        )

    # Head sizes: the declared range (8 to 256) is checked by the backend; here the
    # per-version rule within it.
    if version == 4:
        max_head = _fa4_max_head(release, capability)
        if major in (10, 11) and max_head == 256:  # 8..128, and 256 itself
            fits = spec.head_size % 8 == 0 and (spec.head_size <= 128 or spec.head_size == 256)
            supported = "multiples of 8 up to 128, and 256"
        else:
            fits = spec.head_size % 8 == 0 and spec.head_size <= max_head
            supported = f"multiples of 8 up to {max_head}"
    else:
        fits = spec.head_size % 8 == 0
        supported = "multiples of 8 up to 256"
    if 8 <= spec.head_size <= 256 and not fits:
        where = f" on compute capability {_cc(capability)}" if version == 4 and capability else ""
        reasons.append(
            f"head_size={spec.head_size} not supported by {label}{where} (supported: {supported})"
        )

    if version == 2 and paged and spec.block_size % FA2_PAGE_MULTIPLE:
        reasons.append(
            f"block_size={spec.block_size} not supported by flash-attn 2 (its paged KV "
            f"cache needs a multiple of {FA2_PAGE_MULTIPLE})"
        )

    supported_features = _FEATURES[version]
    names = ", ".join(sorted(f.value for f in supported_features))
    for feature in sorted(features - supported_features, key=lambda f: f.value):
        if feature in _FEATURES[2] | _FEATURES[4]:  # others: the backend's declaration says so
            reasons.append(f"feature {feature.value} not supported by {label} (supported: {names})")
    if version == 2 and AttentionFeature.ALIBI in features and not rules.mask(spec).causal:
        reasons.append(
            f"feature alibi not supported by flash-attn 2 for kind={kind.value} (its bias "
            f"-slope*|i-j| differs from attnkit's slope*(j-i) when keys follow the query)"
        )
    return reasons
