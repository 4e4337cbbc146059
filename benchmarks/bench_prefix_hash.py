"""What naming a prompt's blocks costs, against hashing the same bytes with the hash alone.

``block_names`` takes a prompt (a Python list of token ids, as engines hold them, or an
int64 numpy array), checks and converts it to little-endian ``uint32`` once, lays each
block's header and trailer around its ids in one buffer, and chains one hash call per
block. The floor is the hash alone: the exact messages the chain hashed (parent name +
block bytes, prebuilt), each hashed once in a list comprehension with the hash's
cheapest call (``hashlib.sha256(m).digest()``, ``xxhash.xxh3_128_digest(m)``); no
conversion, no checks, no concatenation. Each round times both back to back, alternating which goes first
(paired rounds); the figures are medians over rounds, in nanoseconds per prompt token,
and the ratio is the median of the per-round ratios.

Cases: prompts of 1k, 8k and 32k tokens (random ids below 150k), block sizes 16 and
64, SHA-256 and XXH3-128 (when the ``xxhash`` package is installed). A last section
times the combined hit (``find_prefix_hit``) of a hybrid model (full attention,
sliding window, a state group) whose whole 32k prompt is cached, per prompt token: the
rule's share of a lookup (the pool's name lookups are not part of it).

    python benchmarks/bench_prefix_hash.py --out bench-results [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from attnkit import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from attnkit.errors import MissingDependencyError
from attnkit.prefix_cache import (
    GroupLookup,
    Hasher,
    HashName,
    TokenLayout,
    block_names,
    find_prefix_hit,
    get_hasher,
    prefix_root,
)

LENGTHS = (1024, 8192, 32768)
BLOCK_SIZES = (16, 64)


def _messages(tokens: list[int], layout: TokenLayout, hasher: Hasher, root: bytes) -> list[bytes]:
    """The exact bytes the chain hashes for each block (parent name + block), prebuilt."""
    names = block_names(tokens, layout, hasher, root)
    bs = layout.block_size
    out: list[bytes] = []
    parent = root
    for b, name in enumerate(names):
        ids = np.asarray(tokens[b * bs : (b + 1) * bs], dtype="<u4").tobytes()
        message = parent + np.uint32(bs).astype("<u4").tobytes() + ids + b"\x00\x00\x00\x00"
        assert hasher.digest(message) == name  # the floor hashes what the chain hashed
        out.append(message)
        parent = name
    return out


def _time(fn: Callable[[], object], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def measure(
    length: int, bs: int, hash_name: HashName, *, rounds: int, rng: np.random.Generator
) -> dict[str, float]:
    hasher = get_hasher(hash_name)
    tokens = rng.integers(0, 150_000, size=length).tolist()
    array = np.asarray(tokens, dtype=np.int64)
    layout = TokenLayout(bs)
    root = prefix_root(hasher)
    messages = _messages(tokens, layout, hasher, root)
    digest, new = hasher.digest, hasher.new

    def names_from_list() -> object:
        return block_names(tokens, layout, hasher, root)

    def names_from_array() -> object:
        return block_names(array, layout, hasher, root)

    def hash_alone() -> object:  # the cheapest call of the hash per message
        if new is not None:
            return [new(m).digest() for m in messages]
        return [digest(m) for m in messages]

    number = max(1, 200_000 // length)
    lst: list[float] = []
    arr: list[float] = []
    floor: list[float] = []
    ratios: list[float] = []
    for r in range(rounds):
        if r % 2:
            f = _time(hash_alone, number)
            a = _time(names_from_list, number)
        else:
            a = _time(names_from_list, number)
            f = _time(hash_alone, number)
        lst.append(a)
        floor.append(f)
        ratios.append(a / f)
        arr.append(_time(names_from_array, number))
    per_token = 1e9 / length
    return {
        "names_list_ns_per_token": statistics.median(lst) * per_token,
        "names_array_ns_per_token": statistics.median(arr) * per_token,
        "hash_alone_ns_per_token": statistics.median(floor) * per_token,
        "ratio": statistics.median(ratios),
    }


def measure_hit(*, rounds: int) -> dict[str, float]:
    """``find_prefix_hit`` of a hybrid model, whole prompt cached, per prompt token."""
    length = 32768
    specs = [
        FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16),
        SlidingWindowSpec(
            block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, sliding_window=4096
        ),
        MambaSpec(block_size=16, shapes=((64, 3),), dtypes=(torch.float32,)),
    ]
    blocks = np.ones(length // 16, dtype=np.bool_)
    checkpoints = np.zeros(length + 1, dtype=np.bool_)
    checkpoints[::256] = True
    groups = [
        GroupLookup(specs[0], blocks),
        GroupLookup(specs[1], blocks),
        GroupLookup(specs[2], checkpoints),
    ]
    hit = find_prefix_hit(groups, length)
    assert hit.length == length - 256, hit
    times = [_time(lambda: find_prefix_hit(groups, length), 50) for _ in range(rounds)]
    return {"find_prefix_hit_ns_per_token": statistics.median(times) * 1e9 / length}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--quick", action="store_true", help="fewer rounds (smoke run)")
    args = parser.parse_args(argv)
    rounds = 5 if args.quick else 21
    rng = np.random.default_rng(0)
    hashes: list[HashName] = ["sha256"]
    try:
        get_hasher("xxh3_128")
        hashes.append("xxh3_128")
    except MissingDependencyError as exc:
        print(f"xxh3_128 skipped: {exc}")
    results: dict[str, dict[str, float]] = {}
    print(
        f"{'case':28s} {'names(list)':>12s} {'names(array)':>13s} {'hash alone':>11s} "
        f"{'ratio':>6s}   (ns per prompt token)"
    )
    for hash_name in hashes:
        for bs in BLOCK_SIZES:
            for length in LENGTHS:
                key = f"{hash_name}_bs{bs}_{length}"
                row = measure(length, bs, hash_name, rounds=rounds, rng=rng)
                results[key] = row
                print(
                    f"{key:28s} {row['names_list_ns_per_token']:12.1f} "
                    f"{row['names_array_ns_per_token']:13.1f} "
                    f"{row['hash_alone_ns_per_token']:11.1f} {row['ratio']:6.2f}"
                )
    results["hybrid_hit_32k"] = measure_hit(rounds=rounds)
    print(
        "find_prefix_hit, hybrid (full + window + state), 32k cached: "
        f"{results['hybrid_hit_32k']['find_prefix_hit_ns_per_token']:.2f} ns per prompt token"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_prefix_hash.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
