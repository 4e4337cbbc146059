"""The hash functions a prefix-cache name can be made with: SHA-256 (``hashlib``, the
default) or XXH3-128 (the optional ``xxhash`` package, ``pip install 'attnkit[xxhash]'``).

SHA-256 is cryptographic: no prompt can be crafted whose blocks collide with another
tenant's. XXH3-128 is faster and not cryptographic: opt in only where every prompt
comes from a trusted source (a collision serves one request another's cache;
docs/prefix-caching.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
from collections.abc import Callable
from typing import Any, Literal, Protocol, get_args

from ..errors import InvalidArgumentError, MissingDependencyError

__all__ = ["HASH_NAMES", "HashName", "Hasher", "get_hasher"]

HashName = Literal["sha256", "xxh3_128"]
"""The hash functions a name can be made with."""

HASH_NAMES: tuple[HashName, ...] = get_args(HashName)


class _HashObject(Protocol):
    def digest(self) -> bytes: ...


@dataclasses.dataclass(frozen=True)
class Hasher:
    """One hash function: ``digest(data) -> bytes`` of ``digest_size`` bytes.

    Attributes:
        name: its ``HashName``.
        digest_size: bytes per digest (32 for SHA-256, 16 for XXH3-128).
        digest: the function.
        new: a ``hashlib``-style constructor (``new(data).digest()``), when the function
            is one (the chain's loop calls it directly, saving a call per block).
    """

    name: HashName
    digest_size: int
    digest: Callable[[bytes], bytes]
    new: Callable[[bytes], _HashObject] | None = None


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_SHA256 = Hasher("sha256", 32, _sha256_digest, hashlib.sha256)


def _xxh3_128() -> Hasher:
    try:
        xxhash: Any = importlib.import_module("xxhash")
    except ImportError as exc:
        raise MissingDependencyError(
            "hash 'xxh3_128' needs the xxhash package: pip install 'attnkit[xxhash]' "
            "(or use the default, 'sha256')"
        ) from exc
    digest: Callable[[bytes], bytes] | None = getattr(xxhash, "xxh3_128_digest", None)
    if digest is None:
        raise MissingDependencyError(
            f"hash 'xxh3_128' needs xxhash >= 3.0 (xxh3_128_digest), found "
            f"{getattr(xxhash, 'VERSION', 'an older release')}: pip install -U 'attnkit[xxhash]'"
        )
    return Hasher("xxh3_128", 16, digest)


def get_hasher(name: HashName = "sha256") -> Hasher:
    """The hash function called ``name``.

    Raises:
        InvalidArgumentError: an unknown name (the message lists the known ones).
        MissingDependencyError: ``"xxh3_128"`` without the ``xxhash`` package (the
            message names the extra, ``attnkit[xxhash]``).
    """
    if name == "sha256":
        return _SHA256
    if name == "xxh3_128":
        return _xxh3_128()
    raise InvalidArgumentError(
        f"hash must be one of {', '.join(repr(n) for n in HASH_NAMES)}, got {name!r}"
    )
