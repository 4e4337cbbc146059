"""Block names: the chained hash of every full block of a request's tokens.

``h_b = H(h_{b-1} || u32 n || n token ids (u32 LE) || u32 k || k extra keys)``, where
``h_{-1}`` is the request's root (``prefix_root``: format version, cache salt, adapter
id) and the extra keys of block ``b`` are those of the multimodal inputs overlapping
it. A name therefore stands for the whole prefix up to the end of its block, under one
root. Names depend on the token layout (``TokenLayout``: block size and shift), so they
are computed once per distinct layout and shared by the groups with that layout.

The serialization is vectorised: the token ids become one ``uint32`` buffer with each
block's header and trailer in place (``numpy``, once), and the loop hashes a slice per
block.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from .._validation import is_nonnegative_int
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..kinds import TokenLayout
from ._format import (
    FORMAT_VERSION,
    MultimodalInput,
    Tokens,
    as_token_array,
    check_mm_inputs,
    encode_value,
    mm_extra_key,
)
from ._hashers import Hasher

__all__ = ["ROOT_MAGIC", "BlockChain", "block_names", "prefix_root"]

ROOT_MAGIC = b"AKPR"
"""The first bytes of every root's serialization."""

_U32 = struct.Struct("<I")
_NO_EXTRAS = _U32.pack(0)


def prefix_root(
    hasher: Hasher, *, cache_salt: str | None = None, adapter_id: str | int | None = None
) -> bytes:
    """A request's root name, the parent of its block 0:
    ``H(b"AKPR" || u8 version || encode_value(cache_salt) || encode_value(adapter_id))``.
    A salt or an adapter changes every name of the request.

    Raises:
        ArgumentTypeError: a salt that is not a ``str``, an adapter id that is not a
            ``str`` or an ``int``.
    """
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ArgumentTypeError(
            f"cache_salt must be a str or None, got {type(cache_salt).__name__}"
        )
    if adapter_id is not None and (
        isinstance(adapter_id, bool) or not isinstance(adapter_id, str | int)
    ):
        raise ArgumentTypeError(
            f"adapter_id must be a str, an int or None, got {type(adapter_id).__name__}"
        )
    data = (
        ROOT_MAGIC
        + bytes([FORMAT_VERSION])
        + encode_value(cache_salt, "cache_salt")
        + encode_value(adapter_id, "adapter_id")
    )
    return hasher.digest(data)


def _check_parent(parent: object, hasher: Hasher) -> bytes:
    if not isinstance(parent, bytes) or len(parent) != hasher.digest_size:
        raise InvalidArgumentError(
            f"parent must be a {hasher.digest_size}-byte {hasher.name} name (a root or a "
            f"block name), got {parent!r:.80}"
        )
    return parent


def _extras_by_block(
    mm_inputs: Sequence[MultimodalInput], layout: TokenLayout, first: int, end: int
) -> dict[int, bytes]:
    """Block -> its extra-key trailer (``u32 count || keys``), for the blocks in
    ``first .. end - 1`` that multimodal inputs overlap (inputs sorted canonically)."""
    keys: dict[int, list[bytes]] = {}
    bs, shift = layout.block_size, layout.shift
    for mm in mm_inputs:
        lo = max((mm.start + shift) // bs, first)
        hi = min((mm.end - 1 + shift) // bs + 1, end)
        key = mm_extra_key(mm)
        for b in range(lo, hi):
            keys.setdefault(b, []).append(key)
    return {b: _U32.pack(len(k)) + b"".join(k) for b, k in keys.items()}


def _names(
    tokens: npt.NDArray[np.uint32],
    layout: TokenLayout,
    hasher: Hasher,
    parent: bytes,
    first: int,
    end: int,
    mm_inputs: Sequence[MultimodalInput],
) -> list[bytes]:
    """Names of blocks ``first .. end - 1``; ``tokens`` start at block ``first``'s first
    token and cover the blocks."""
    names: list[bytes] = []
    if end <= first:
        return names
    bs, shift = layout.block_size, layout.shift
    extras = _extras_by_block(mm_inputs, layout, first, end) if mm_inputs else {}
    digest, new = hasher.digest, hasher.new
    prev = parent
    b = first
    offset = 0  # into tokens
    while b < end and b * bs < shift:  # blocks that hold sink slots: fewer tokens
        start, stop = layout.tokens_of(b)
        count = stop - start
        data = _U32.pack(count) + tokens[offset : offset + count].astype("<u4").tobytes()
        prev = digest(prev + data + extras.get(b, _NO_EXTRAS))
        names.append(prev)
        offset += count
        b += 1
    m = end - b
    if m <= 0:
        return names
    # Every remaining block holds bs tokens: one buffer, a row per block, each row
    # ``u32 bs || bs ids || u32 0`` (the extra-key count), sliced per block below.
    rows = np.empty((m, bs + 2), dtype="<u4")
    rows[:, 0] = bs
    rows[:, 1:-1] = np.reshape(tokens[offset : offset + m * bs], (m, bs))
    rows[:, -1] = 0
    buf = rows.tobytes()  # bytes: slicing them is cheaper than slicing a memoryview
    width = (bs + 2) * 4
    if extras:
        for i in range(m):
            trailer = extras.get(b + i)
            row = buf[i * width : (i + 1) * width]
            prev = digest(prev + row if trailer is None else prev + row[:-4] + trailer)
            names.append(prev)
    elif new is not None:
        for i in range(0, m * width, width):
            prev = new(prev + buf[i : i + width]).digest()
            names.append(prev)
    else:
        for i in range(0, m * width, width):
            prev = digest(prev + buf[i : i + width])
            names.append(prev)
    return names


def block_names(
    token_ids: Tokens,
    layout: TokenLayout,
    hasher: Hasher,
    parent: bytes,
    *,
    first_block: int = 0,
    mm_inputs: Iterable[MultimodalInput | tuple[int, int, str | bytes]] = (),
    max_blocks: int | None = None,
) -> list[bytes]:
    """The names of the full blocks of ``token_ids`` in ``layout``, chained from
    ``parent``.

    One-shot: ``token_ids`` is the whole prompt, ``parent`` the request's root
    (``prefix_root``), ``first_block`` 0. Incremental: ``first_block`` is the first block
    not yet named, ``parent`` the last name (of block ``first_block - 1``), and
    ``token_ids`` the tokens from that block's first token on; the names equal the
    one-shot's from ``first_block`` on. A partial block at the end gets no name.

    Args:
        mm_inputs: ``(start, end, mm_hash)`` ranges in absolute token positions (of the
            whole request), each within the tokens seen so far.
        max_blocks: name at most this many blocks (e.g. 1: block 0 alone).

    Raises:
        ArgumentTypeError, InvalidArgumentError: token ids that are not ``uint32``
            values, a ``parent`` of the wrong size, an ``mm_inputs`` range that is
            empty, negative or past the tokens.
    """
    tokens = as_token_array(token_ids)
    parent = _check_parent(parent, hasher)
    if not is_nonnegative_int(first_block):
        raise InvalidArgumentError(f"first_block must be an int >= 0, got {first_block!r}")
    start = layout.tokens_of(first_block)[0]
    mm = check_mm_inputs(mm_inputs, start + tokens.size)
    end = layout.full_blocks(start + tokens.size)
    if max_blocks is not None:
        if not is_nonnegative_int(max_blocks):
            raise InvalidArgumentError(f"max_blocks must be an int >= 0, got {max_blocks!r}")
        end = min(end, first_block + max_blocks)
    return _names(tokens, layout, hasher, parent, first_block, end, mm)


class BlockChain:
    """A request's block names in one layout, extended as its tokens arrive.

    Made from the prompt (its full blocks are named at once); ``append`` adds generated
    tokens and returns the names of the blocks they complete, hashing only those. It
    keeps the names and the tokens of the last, partial block.

    Args:
        prompt_token_ids: the prompt.
        layout, hasher, root: the layout, the hash function and the request's root.
        mm_inputs: the prompt's multimodal inputs (within the prompt).

    Attributes:
        names: the name of every full block so far, in order.
        num_tokens: tokens seen so far.
    """

    def __init__(
        self,
        prompt_token_ids: Tokens,
        layout: TokenLayout,
        hasher: Hasher,
        root: bytes,
        *,
        mm_inputs: Iterable[MultimodalInput | tuple[int, int, str | bytes]] = (),
    ) -> None:
        tokens = as_token_array(prompt_token_ids, "prompt_token_ids")
        self.layout, self.hasher, self.root = layout, hasher, _check_parent(root, hasher)
        self._mm = check_mm_inputs(mm_inputs, tokens.size)
        self.names: list[bytes] = _names(
            tokens, layout, hasher, root, 0, layout.full_blocks(tokens.size), self._mm
        )
        self.num_tokens = int(tokens.size)
        tail_start = layout.tokens_of(len(self.names))[0]
        self._tail: npt.NDArray[np.uint32] = np.array(tokens[tail_start:], dtype="<u4")

    def append(self, token_ids: Tokens) -> list[bytes]:
        """Add tokens; the names of the blocks they complete (possibly none)."""
        new = as_token_array(token_ids)
        if not new.size:
            return []
        tokens = np.concatenate([self._tail, new]) if self._tail.size else new
        first = len(self.names)
        end = self.layout.full_blocks(self.num_tokens + int(new.size))
        parent = self.names[-1] if self.names else self.root
        added = _names(tokens, self.layout, self.hasher, parent, first, end, self._mm)
        self.names.extend(added)
        self.num_tokens += int(new.size)
        consumed = self.layout.tokens_of(end)[0] - self.layout.tokens_of(first)[0]
        self._tail = np.array(tokens[consumed:], dtype="<u4")
        return added
